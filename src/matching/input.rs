//! Reading the objects `nvdra match` and `nvdra validate` work on: multi-document YAML (or JSON)
//! with DeviceClasses, ResourceClaims, ResourceClaimTemplates and ResourceSlices, each error
//! naming the file, the document and the field.
//!
//! The workloads beside them (Pods, Deployments, ReplicaSets, StatefulSets, Jobs, CronJobs,
//! DaemonSets) are read for one thing: which ResourceClaimTemplates their pods name, and for how
//! many pods. Kubernetes makes one claim from the template for each pod, so `nvdra match`
//! matches a template named by a Deployment of 4 replicas 4 times ([`expand_workloads`]), as the
//! scheduler allocates them, one after another.

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
    /// `metadata.namespace`, where it has one.
    pub namespace: Option<String>,
    pub spec: ResourceClaimSpec,
    /// `spec` for a claim, `spec.spec` for a template: where the claim's fields are.
    pub spec_path: &'static str,
    pub origin: Origin,
    /// A claim's `status.allocation`: the devices it already holds.
    pub allocation: Option<AllocationResult>,
}

impl ClaimInput {
    /// Its namespace; `default` where it names none, as `kubectl apply` would put it with the
    /// default context.
    pub fn namespace(&self) -> &str {
        self.namespace.as_deref().unwrap_or("default")
    }
}

/// Everything read from the `-f` files (and `--slices`).
#[derive(Debug, Default)]
pub struct Objects {
    pub classes: Vec<(DeviceClass, Origin)>,
    pub claims: Vec<ClaimInput>,
    pub slices: Vec<ResourceSlice>,
    /// Workloads whose pods name ResourceClaimTemplates ([`expand_workloads`]).
    pub workloads: Vec<Workload>,
    /// Namespaces' labels, by name (`kind: Namespace`, as `kubectl get namespace -o yaml`
    /// prints them): what `--share-trust-domain=label:<key>` compares.
    pub namespace_labels:
        std::collections::BTreeMap<String, std::collections::BTreeMap<String, String>>,
}

/// A workload whose pods name ResourceClaimTemplates: each of its `pods` gets a claim from each.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Workload {
    /// `Deployment`, `Pod`, ...
    pub kind: String,
    pub name: String,
    pub namespace: Option<String>,
    /// Pods running at once: `spec.replicas` (default 1), a Job's `parallelism` (default 1, at
    /// most its `completions`), 1 for a Pod or a DaemonSet (one per node).
    pub pods: u32,
    /// The templates each pod names (`spec.resourceClaims[].resourceClaimTemplateName`), in
    /// order, once per pod claim.
    pub templates: Vec<String>,
}

/// Most claims [`expand_workloads`] makes: input is bounded, and no node holds more.
pub const MAX_EXPANDED_CLAIMS: usize = 1024;

/// The kinds whose pods [`expand_workloads`] counts, and where their pod spec is.
const WORKLOADS: [(&str, &str); 7] = [
    ("Pod", "/spec"),
    ("Deployment", "/spec/template/spec"),
    ("ReplicaSet", "/spec/template/spec"),
    ("StatefulSet", "/spec/template/spec"),
    ("DaemonSet", "/spec/template/spec"),
    ("Job", "/spec/template/spec"),
    ("CronJob", "/spec/jobTemplate/spec/template/spec"),
];

/// Replaces each ResourceClaimTemplate that a workload's pods name with one claim per pod, as
/// Kubernetes makes them (for every workload that names it, in input order, where the template
/// was), named `<template> (<kind> <workload>, pod <i> of <n>)`. A template no workload names
/// stays one claim. A workload and a template match by name, and by namespace where both give
/// one. More than [`MAX_EXPANDED_CLAIMS`] claims is an error.
pub fn expand_workloads(objects: &mut Objects) -> Result<(), InputError> {
    if objects.workloads.is_empty() {
        return Ok(());
    }
    let namespaces_match = |a: &Option<String>, b: &Option<String>| match (a, b) {
        (Some(a), Some(b)) => a == b,
        _ => true,
    };
    let mut out = Vec::new();
    for claim in std::mem::take(&mut objects.claims) {
        if claim.kind != "ResourceClaimTemplate" {
            out.push(claim);
            continue;
        }
        let users: Vec<&Workload> = objects
            .workloads
            .iter()
            .filter(|w| {
                w.templates.contains(&claim.name)
                    && namespaces_match(&w.namespace, &claim.namespace)
            })
            .collect();
        if users.is_empty() {
            out.push(claim);
            continue;
        }
        for w in users {
            let per_pod = w.templates.iter().filter(|t| **t == claim.name).count();
            for pod in 1..=w.pods {
                for _ in 0..per_pod {
                    if out.len() >= MAX_EXPANDED_CLAIMS {
                        return Err(InputError::Other(format!(
                            "{} {} names ResourceClaimTemplate {} for {} pods: more than the \
                             {MAX_EXPANDED_CLAIMS} claims nvdra match explains at once",
                            w.kind, w.name, claim.name, w.pods
                        )));
                    }
                    out.push(ClaimInput {
                        name: format!(
                            "{} ({} {}, pod {pod} of {})",
                            claim.name, w.kind, w.name, w.pods
                        ),
                        ..claim.clone()
                    });
                }
            }
        }
    }
    objects.claims = out;
    Ok(())
}

/// `value` as a [`Workload`] when it is one of [`WORKLOADS`] whose pods name a template.
fn workload(kind: &str, value: &serde_json::Value) -> Option<Workload> {
    let (_, pod_spec) = WORKLOADS.iter().find(|(k, _)| *k == kind)?;
    let templates: Vec<String> = value
        .pointer(&format!("{pod_spec}/resourceClaims"))?
        .as_array()?
        .iter()
        .filter_map(|c| c.get("resourceClaimTemplateName")?.as_str())
        .map(String::from)
        .collect();
    if templates.is_empty() {
        return None;
    }
    let number = |path: &str| value.pointer(path).and_then(|v| v.as_u64());
    let pods = match kind {
        "Pod" | "DaemonSet" => 1,
        "Job" | "CronJob" => {
            let spec = if kind == "Job" {
                "/spec"
            } else {
                "/spec/jobTemplate/spec"
            };
            let parallelism = number(&format!("{spec}/parallelism")).unwrap_or(1);
            number(&format!("{spec}/completions")).map_or(parallelism, |c| parallelism.min(c))
        }
        _ => number("/spec/replicas").unwrap_or(1),
    };
    Some(Workload {
        kind: kind.to_string(),
        name: value
            .pointer("/metadata/name")
            .and_then(|n| n.as_str())
            .unwrap_or_default()
            .to_string(),
        namespace: value
            .pointer("/metadata/namespace")
            .and_then(|n| n.as_str())
            .map(String::from),
        // Beyond the cap anyway; the error names it.
        pods: u32::try_from(pods).unwrap_or(u32::MAX),
        templates,
    })
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
        | "NamespaceList"
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
                namespace: c.metadata.namespace.clone(),
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
                namespace: t.metadata.namespace.clone(),
                spec: t.spec.spec,
                spec_path: "spec.spec",
                origin: origin.clone(),
                allocation: None,
            });
        }
        "ResourceSlice" => out.slices.push(typed(value, origin, &kind, &name)?),
        "Namespace" => {
            let ns: k8s_openapi::api::core::v1::Namespace = typed(value, origin, &kind, &name)?;
            out.namespace_labels
                .insert(name, ns.metadata.labels.unwrap_or_default());
        }
        // Other objects users keep beside their claims (RBAC, a kustomize build's everything)
        // are not ours to read: skipped, but for the templates a workload's pods name. A
        // document without a kind or apiVersion is not a Kubernetes object at all.
        other if !other.is_empty() && value.get("apiVersion").is_some_and(|v| v.is_string()) => {
            out.workloads.extend(workload(other, &value));
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn read(text: &str) -> Objects {
        let mut out = Objects::default();
        read_text(Path::new("w.yaml"), text, &mut out).unwrap();
        out
    }

    fn names(o: &Objects) -> Vec<String> {
        o.claims.iter().map(|c| c.name.clone()).collect()
    }

    const TEMPLATE: &str = "apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {name: one-gpu, namespace: ns}
spec:
  spec:
    devices:
      requests:
      - name: gpu
        exactly: {deviceClassName: gpu.nvidia.com}
";

    fn workload(kind: &str, spec: &str) -> String {
        format!(
            "---\napiVersion: v1\nkind: {kind}\nmetadata: {{name: w, namespace: ns}}\nspec:\n{spec}"
        )
    }

    const POD_SPEC: &str = "resourceClaims: [{name: gpu, resourceClaimTemplateName: one-gpu}]";

    /// Each pod of a workload gets its own claim from the template, as Kubernetes makes them.
    #[test]
    fn a_template_is_matched_once_per_pod_of_each_workload_naming_it() {
        let deployment = |replicas: &str| {
            workload(
                "Deployment",
                &format!("  {replicas}\n  template:\n    spec:\n      {POD_SPEC}\n"),
            )
        };
        for (replicas, pods) in [("replicas: 4", 4), ("replicas: 0", 0), ("paused: false", 1)] {
            let mut o = read(&format!("{TEMPLATE}{}", deployment(replicas)));
            assert_eq!(names(&o), ["one-gpu"], "read as written");
            expand_workloads(&mut o).unwrap();
            assert_eq!(o.claims.len(), pods, "{replicas}");
            if pods == 4 {
                assert_eq!(
                    names(&o),
                    (1..=4)
                        .map(|i| format!("one-gpu (Deployment w, pod {i} of 4)"))
                        .collect::<Vec<_>>()
                );
                assert!(o.claims.iter().all(|c| c.kind == "ResourceClaimTemplate"));
            }
        }
        for (kind, spec, pods) in [
            ("Pod", format!("  {POD_SPEC}\n"), 1),
            (
                "Job",
                format!(
                    "  parallelism: 5\n  completions: 3\n  template:\n    spec:\n      {POD_SPEC}\n"
                ),
                3,
            ),
            (
                "CronJob",
                format!(
                    "  jobTemplate:\n    spec:\n      parallelism: 2\n      template:\n        spec:\n          {POD_SPEC}\n"
                ),
                2,
            ),
            (
                "StatefulSet",
                format!("  replicas: 3\n  template:\n    spec:\n      {POD_SPEC}\n"),
                3,
            ),
            (
                "DaemonSet",
                format!("  template:\n    spec:\n      {POD_SPEC}\n"),
                1,
            ),
        ] {
            let mut o = read(&format!("{TEMPLATE}{}", workload(kind, &spec)));
            expand_workloads(&mut o).unwrap();
            assert_eq!(o.claims.len(), pods, "{kind}");
        }
    }

    /// A template no workload names, one of another namespace, and claims stay as written; a
    /// workload naming a template too many times over is refused.
    #[test]
    fn only_templates_a_workload_names_are_expanded_and_the_count_is_bounded() {
        let other_ns = workload(
            "Deployment",
            &format!("  replicas: 3\n  template:\n    spec:\n      {POD_SPEC}\n"),
        )
        .replace("namespace: ns", "namespace: other");
        let claim = "---\napiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata: {name: one-gpu}\nspec:\n  devices:\n    requests:\n    - name: gpu\n      exactly: {deviceClassName: gpu.nvidia.com}\n";
        let mut o = read(&format!("{TEMPLATE}{other_ns}{claim}"));
        expand_workloads(&mut o).unwrap();
        assert_eq!(names(&o), ["one-gpu", "one-gpu"]);
        assert_eq!(o.claims[1].kind, "ResourceClaim");

        let huge = workload(
            "Deployment",
            &format!("  replicas: 5000\n  template:\n    spec:\n      {POD_SPEC}\n"),
        );
        let mut o = read(&format!("{TEMPLATE}{huge}"));
        let e = expand_workloads(&mut o).unwrap_err().to_string();
        assert!(
            e.contains("Deployment w names ResourceClaimTemplate one-gpu for 5000 pods"),
            "{e}"
        );
    }
}
