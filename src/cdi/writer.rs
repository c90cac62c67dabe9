//! The CDI spec writer: claim spec file names, atomic replace, removal and listing. A claim UID
//! arrives typed ([`ClaimUid`]), so it is a valid file-name part without a check here.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use super::{CdiOptions, Result, Spec, io_err};
use crate::durable::Durability;
use crate::ids::ClaimUid;

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
