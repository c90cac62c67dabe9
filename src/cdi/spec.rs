//! A CDI spec: the model (field names and layout as in the CDI specification), the grammar of
//! its names (vendor, class, device names, and claim UIDs as file-name parts), and its file: claim
//! spec file names, atomic replace, removal and listing. A claim UID arrives at the file
//! functions typed ([`ClaimUid`]), so it is a valid file-name part without a check there.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::{CdiOptions, Error, Result};
use crate::durable::Durability;
use crate::ids::ClaimUid;

/// A CDI spec file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Spec {
    pub cdi_version: String,
    pub kind: String,
    pub devices: Vec<Device>,
    #[serde(default, skip_serializing_if = "ContainerEdits::is_empty")]
    pub container_edits: ContainerEdits,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Device {
    pub name: String,
    pub container_edits: ContainerEdits,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ContainerEdits {
    /// `NAME=value` entries.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub device_nodes: Vec<DeviceNode>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mounts: Vec<Mount>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hooks: Vec<Hook>,
}

impl ContainerEdits {
    pub fn is_empty(&self) -> bool {
        self.env.is_empty()
            && self.device_nodes.is_empty()
            && self.mounts.is_empty()
            && self.hooks.is_empty()
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceNode {
    /// The path inside the container.
    pub path: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_path: Option<String>,
    /// `c` or `b`.
    #[serde(default, rename = "type", skip_serializing_if = "Option::is_none")]
    pub node_type: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub major: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub minor: Option<i64>,
    /// Permission bits of the node created in the container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file_mode: Option<u32>,
    /// Cgroup device access, `rwm`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub permissions: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Mount {
    pub host_path: String,
    pub container_path: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub options: Vec<String>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Hook {
    /// The OCI hook point, e.g. `createContainer`.
    pub hook_name: String,
    pub path: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
}

impl Spec {
    /// The spec as YAML (deterministic: field order is the struct order, lists keep their order).
    pub fn to_yaml(&self) -> Result<String> {
        crate::yaml::to_string(self).map_err(|source| Error::Serialize {
            kind: self.kind.clone(),
            source,
        })
    }
}

// The names: vendor, class and device-name grammar, and claim UIDs as file-name parts.

pub(super) const VENDOR_RULE: &str = "a vendor starts with a letter, ends with a letter or digit, and \
                           contains only letters, digits, '_', '.' and '-'";
pub(super) const CLASS_RULE: &str = "a class starts with a letter, ends with a letter or digit, and contains \
                          only letters, digits, '_' and '-'";
pub(super) const NAME_RULE: &str = "a device name starts and ends with a letter or digit and contains only \
                         letters, digits, '_', '.', ':' and '-'";

/// Whether `value` is `first middle* last` (last a letter or digit); a single character passes
/// only when `single_ok` (device names allow it, vendors and classes do not).
pub(super) fn matches_grammar(
    value: &str,
    first: fn(u8) -> bool,
    middle: fn(u8) -> bool,
    single_ok: bool,
) -> bool {
    match value.as_bytes() {
        [] => false,
        [only] => single_ok && first(*only) && only.is_ascii_alphanumeric(),
        [head, mid @ .., tail] => {
            first(*head) && mid.iter().all(|&b| middle(b)) && tail.is_ascii_alphanumeric()
        }
    }
}

pub(super) fn invalid(what: &'static str, value: &str, rule: &'static str) -> Error {
    Error::InvalidName {
        what,
        value: value.to_string(),
        rule,
    }
}

/// Checks a CDI vendor: `[A-Za-z][A-Za-z0-9_.-]*[A-Za-z0-9]`.
pub fn validate_vendor(vendor: &str) -> Result<()> {
    let middle = |b: u8| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-');
    if matches_grammar(vendor, |b| b.is_ascii_alphabetic(), middle, false) {
        Ok(())
    } else {
        Err(invalid("vendor", vendor, VENDOR_RULE))
    }
}

/// Checks a CDI class: `[A-Za-z][A-Za-z0-9_-]*[A-Za-z0-9]`.
pub fn validate_class(class: &str) -> Result<()> {
    let middle = |b: u8| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-');
    if matches_grammar(class, |b| b.is_ascii_alphabetic(), middle, false) {
        Ok(())
    } else {
        Err(invalid("class", class, CLASS_RULE))
    }
}

pub(super) fn is_device_name(name: &str) -> bool {
    let middle = |b: u8| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b':' | b'-');
    matches_grammar(name, |b| b.is_ascii_alphanumeric(), middle, true)
}

/// Checks a CDI device name: `[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?`.
pub fn validate_device_name(name: &str) -> Result<()> {
    if is_device_name(name) {
        Ok(())
    } else {
        Err(invalid("device name", name, NAME_RULE))
    }
}

/// A claim UID becomes a device-name prefix and part of a file name, so it must be a valid CDI
/// device name itself (which also rules out `/`).
pub(super) fn validate_claim_uid(claim_uid: &str) -> Result<()> {
    if is_device_name(claim_uid) {
        Ok(())
    } else {
        Err(invalid(
            "claim UID",
            claim_uid,
            "a claim UID starts and ends with a letter or digit and contains only letters, \
             digits, '_', '.', ':' and '-'",
        ))
    }
}

// The file: names, atomic replace, removal and listing.

/// Turns an I/O error of `action` on `path` into an [`Error::Io`].
fn io_err<'a>(action: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> Error + 'a {
    move |source| Error::Io {
        action,
        path: path.to_path_buf(),
        source,
    }
}

pub(super) fn file_prefix(opts: &CdiOptions) -> String {
    format!("{}-{}_", opts.vendor, opts.class)
}

/// `<cdi_root>/<vendor>-<class>_<claimUID>.yaml`.
pub fn spec_path(cdi_root: &Path, opts: &CdiOptions, claim_uid: &ClaimUid) -> PathBuf {
    cdi_root.join(format!("{}{claim_uid}.yaml", file_prefix(opts)))
}

/// Writes (or replaces) a claim's spec atomically, as durably as `durability` says; creates
/// `cdi_root` when missing.
pub fn write_spec(
    cdi_root: &Path,
    opts: &CdiOptions,
    claim_uid: &ClaimUid,
    spec: &Spec,
    durability: Durability,
) -> Result<PathBuf> {
    let text = spec.to_yaml()?;
    write_spec_text(cdi_root, opts, claim_uid, &text, durability)
}

/// [`write_spec`] for a spec already rendered with [`Spec::to_yaml`].
pub fn write_spec_text(
    cdi_root: &Path,
    opts: &CdiOptions,
    claim_uid: &ClaimUid,
    text: &str,
    durability: Durability,
) -> Result<PathBuf> {
    fs::create_dir_all(cdi_root).map_err(io_err("create the CDI directory", cdi_root))?;
    let path = spec_path(cdi_root, opts, claim_uid);
    crate::durable::write_as(&path, text.as_bytes(), durability)?;
    Ok(path)
}

/// Removes a claim's spec; `Ok(false)` when there was none.
pub fn remove_spec(
    cdi_root: &Path,
    opts: &CdiOptions,
    claim_uid: &ClaimUid,
    durability: Durability,
) -> Result<bool> {
    Ok(crate::durable::remove_as(
        &spec_path(cdi_root, opts, claim_uid),
        durability,
    )?)
}

/// The claim UIDs that have a spec file of this vendor and class in `cdi_root`, sorted (empty
/// when the directory does not exist); a file whose name holds no claim UID is not one. For
/// removing specs of claims that are no longer prepared.
pub fn list_claim_specs(cdi_root: &Path, opts: &CdiOptions) -> Result<Vec<ClaimUid>> {
    let entries = match fs::read_dir(cdi_root) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io_err("list", cdi_root)(e)),
    };
    let prefix = file_prefix(opts);
    let mut uids = Vec::new();
    for entry in entries {
        let entry = entry.map_err(io_err("list", cdi_root))?;
        let name = entry.file_name();
        let Some(uid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(&prefix))
            .and_then(|n| n.strip_suffix(".yaml"))
        else {
            continue;
        };
        if let Ok(uid) = ClaimUid::parse(uid) {
            uids.push(uid);
        }
    }
    uids.sort();
    Ok(uids)
}
