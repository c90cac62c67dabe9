//! Reading the objects `nvdra match` and `nvdra validate` work on: multi-document YAML (or JSON)
//! with DeviceClasses, ResourceClaims, ResourceClaimTemplates and ResourceSlices, each error
//! naming the file, the document and the field.

use std::path::{Path, PathBuf};

use k8s_openapi::api::resource::v1::{
    AllocationResult, DeviceClass, ResourceClaim, ResourceClaimSpec, ResourceClaimTemplate,
    ResourceSlice,
};

/// Input that cannot be used (exit code 2).
#[derive(Debug, thiserror::Error)]
pub enum InputError {
    #[error("cannot read {file}")]
    Read {
        file: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{file}: document {doc} (line {line}): {message}")]
    Parse {
        file: PathBuf,
        doc: usize,
        line: usize,
        message: String,
    },
    #[error(transparent)]
    Field(Box<FieldError>),
    #[error(
        "{file}: document {doc} (line {line}): not a Kubernetes object (kind {kind:?}, no \
         apiVersion?)"
    )]
    Kind {
        file: PathBuf,
        doc: usize,
        line: usize,
        kind: String,
    },
    #[error("{0}")]
    Other(String),
}

/// A field of an object that is wrong.
#[derive(Debug, thiserror::Error)]
#[error("{file}: document {doc} (line {line}): {kind} {name}: field {path}: {message}")]
pub struct FieldError {
    pub file: PathBuf,
    pub doc: usize,
    pub line: usize,
    pub kind: String,
    pub name: String,
    pub path: String,
    pub message: String,
}

impl From<FieldError> for InputError {
    fn from(e: FieldError) -> Self {
        InputError::Field(Box::new(e))
    }
}

/// Where an object came from.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Origin {
    pub file: PathBuf,
    /// 1-based document index within the file.
    pub doc: usize,
    /// 1-based line where the document starts.
    pub line: usize,
}

/// A claim or a template's claim, under the name a user knows it by.
#[derive(Debug, Clone)]
pub struct ClaimInput {
    /// `ResourceClaim` or `ResourceClaimTemplate`.
    pub kind: &'static str,
    pub name: String,
    pub spec: ResourceClaimSpec,
    /// `spec` for a claim, `spec.spec` for a template: where the claim's fields are.
    pub spec_path: &'static str,
    pub origin: Origin,
    /// A claim's `status.allocation`: the devices it already holds.
    pub allocation: Option<AllocationResult>,
}

/// Everything read from the `-f` files (and `--slices`).
#[derive(Debug, Default)]
pub struct Objects {
    pub classes: Vec<(DeviceClass, Origin)>,
    pub claims: Vec<ClaimInput>,
    pub slices: Vec<ResourceSlice>,
}

/// Reads every document of every file.
pub fn read_files(files: &[PathBuf]) -> Result<Objects, InputError> {
    let mut out = Objects::default();
    for f in files {
        let text = std::fs::read_to_string(f).map_err(|source| InputError::Read {
            file: f.clone(),
            source,
        })?;
        read_text(f, &text, &mut out)?;
    }
    Ok(out)
}

/// The documents of a YAML stream: (1-based first line, text), empty ones dropped.
fn documents(text: &str) -> Vec<(usize, String)> {
    let mut docs = Vec::new();
    let mut current = String::new();
    let mut start = 1;
    for (i, line) in text.lines().enumerate() {
        if line == "---" || line.starts_with("--- ") || line == "..." {
            docs.push((start, std::mem::take(&mut current)));
            start = i + 2;
            continue;
        }
        current.push_str(line);
        current.push('\n');
    }
    docs.push((start, current));
    docs.into_iter()
        .filter(|(_, d)| {
            d.lines()
                .any(|l| !l.trim().is_empty() && !l.trim_start().starts_with('#'))
        })
        .collect()
}

pub fn read_text(file: &Path, text: &str, out: &mut Objects) -> Result<(), InputError> {
    for (i, (line, doc)) in documents(text).into_iter().enumerate() {
        let origin = Origin {
            file: file.to_path_buf(),
            doc: i + 1,
            line,
        };
        let value: serde_json::Value =
            crate::yaml::from_str(&doc).map_err(|e| InputError::Parse {
                file: file.to_path_buf(),
                doc: i + 1,
                line: line + e.line.unwrap_or(1) - 1,
                message: e.message.clone(),
            })?;
        read_value(value, &origin, out)?;
    }
    Ok(())
}

fn read_value(
    value: serde_json::Value,
    origin: &Origin,
    out: &mut Objects,
) -> Result<(), InputError> {
    let kind = value
        .get("kind")
        .and_then(|k| k.as_str())
        .unwrap_or("")
        .to_string();
    let name = value
        .pointer("/metadata/name")
        .and_then(|n| n.as_str())
        .unwrap_or("")
        .to_string();
    match kind.as_str() {
        "List"
        | "DeviceClassList"
        | "ResourceSliceList"
        | "ResourceClaimList"
        | "ResourceClaimTemplateList" => {
            if let Some(serde_json::Value::Array(items)) = value.get("items") {
                for item in items.clone() {
                    read_value(item, origin, out)?;
                }
            }
        }
        "DeviceClass" => out
            .classes
            .push((typed(value, origin, &kind, &name)?, origin.clone())),
        "ResourceClaim" => {
            let c: ResourceClaim = typed(value, origin, &kind, &name)?;
            out.claims.push(ClaimInput {
                kind: "ResourceClaim",
                name: c.metadata.name.clone().unwrap_or_default(),
                spec: c.spec,
                spec_path: "spec",
                origin: origin.clone(),
                allocation: c.status.and_then(|s| s.allocation),
            });
        }
        "ResourceClaimTemplate" => {
            let t: ResourceClaimTemplate = typed(value, origin, &kind, &name)?;
            out.claims.push(ClaimInput {
                kind: "ResourceClaimTemplate",
                name: t.metadata.name.clone().unwrap_or_default(),
                spec: t.spec.spec,
                spec_path: "spec.spec",
                origin: origin.clone(),
                allocation: None,
            });
        }
        "ResourceSlice" => out.slices.push(typed(value, origin, &kind, &name)?),
        // Other objects users keep beside their claims (the Pod that uses them, RBAC, a
        // kustomize build's everything) are not ours to read: skipped. A document without a kind
        // or apiVersion is not a Kubernetes object at all.
        other if !other.is_empty() && value.get("apiVersion").is_some_and(|v| v.is_string()) => {}
        _ => {
            return Err(InputError::Kind {
                file: origin.file.clone(),
                doc: origin.doc,
                line: origin.line,
                kind,
            });
        }
    }
    Ok(())
}

fn typed<T: serde::de::DeserializeOwned>(
    v: serde_json::Value,
    origin: &Origin,
    kind: &str,
    name: &str,
) -> Result<T, InputError> {
    serde_path_to_error::deserialize(v).map_err(|e| {
        InputError::from(FieldError {
            file: origin.file.clone(),
            doc: origin.doc,
            line: origin.line,
            kind: kind.to_string(),
            name: name.to_string(),
            path: e.path().to_string(),
            message: e.into_inner().to_string(),
        })
    })
}

/// The DeviceClasses nvdra ships (`manifests/base/deviceclasses.yaml`), used when the input does not
/// define a class of the same name.
pub fn builtin_classes() -> Vec<(DeviceClass, Origin)> {
    let mut out = Objects::default();
    let file = Path::new("manifests/base/deviceclasses.yaml");
    match read_text(
        file,
        include_str!("../../manifests/base/deviceclasses.yaml"),
        &mut out,
    ) {
        Ok(()) => out.classes,
        // A unit test reads the same text; it cannot fail at run time.
        Err(_) => Vec::new(),
    }
}
