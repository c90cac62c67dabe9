//! Simulated topology files: a versioned YAML description of a node's GPUs, and the built-in
//! profiles (`dgx-a100`, `dgx-h100`, …) written in the same format.
//!
//! A topology names a GPU *model* from the catalog (`models.yaml`, real figures for each product)
//! or from its own `models:` section, and adds what differs per GPU: PCI address, NUMA node,
//! NVLink wiring, MIG mode and instances, health. Unknown fields are errors; every error names the
//! file, the line where the parser knows it, and the key.

mod build;
mod format;
mod locate;

use std::fmt;
use std::path::Path;

use serde::Deserialize;

use super::Inventory;

pub use build::parse;
pub(crate) use build::uuid_from;

/// The only topology file version this build reads.
pub const VERSION: &str = "v1";

const CATALOG: &str = include_str!("profiles/models.yaml");

/// Built-in profiles: name, one-line description, file contents.
pub const PROFILES: &[(&str, &str, &str)] = &[
    (
        "dgx-a100",
        "8x A100-SXM4-80GB, 6 NVSwitches, 2 NUMA nodes",
        include_str!("profiles/dgx-a100.yaml"),
    ),
    (
        "dgx-a100-mig",
        "dgx-a100 with every GPU in MIG mode and no instances, for --partitionable",
        include_str!("profiles/dgx-a100-mig.yaml"),
    ),
    (
        "dgx-h100",
        "8x H100-SXM5-80GB, 4 NVSwitches, 2 NUMA nodes",
        include_str!("profiles/dgx-h100.yaml"),
    ),
    (
        "hgx-h200",
        "8x H200 141GB, 4 NVSwitches, 2 NUMA nodes",
        include_str!("profiles/hgx-h200.yaml"),
    ),
    (
        "l40s-pcie",
        "4x L40S on PCIe, no NVLink, 2 NUMA nodes",
        include_str!("profiles/l40s-pcie.yaml"),
    ),
    (
        "a100-mig-mixed",
        "4x A100-SXM4-40GB, two in MIG mode with instances of several profiles",
        include_str!("profiles/a100-mig-mixed.yaml"),
    ),
    (
        "pcie-pairs",
        "4x A100-PCIE-40GB as two NVLink-bridged pairs",
        include_str!("profiles/pcie-pairs.yaml"),
    ),
    (
        "gb200-nvl72",
        "GB200 NVL72 compute tray: 4x GB200 in a fabric clique of 18 trays by node number",
        include_str!("profiles/gb200-nvl72.yaml"),
    ),
];

/// A problem in a topology file.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub struct Error {
    /// The file (or `profile <name>` for built-ins).
    pub source_name: String,
    pub line: Option<usize>,
    pub column: Option<usize>,
    /// The key path, e.g. `gpus[2].mig.devices[0].placement`.
    pub key: String,
    pub message: String,
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.source_name)?;
        if let Some(line) = self.line {
            write!(f, ":{line}")?;
            if let Some(col) = self.column {
                write!(f, ":{col}")?;
            }
        }
        if self.key.is_empty() || self.key == "." {
            write!(f, ": {}", self.message)
        } else {
            write!(f, ": {}: {}", self.key, self.message)
        }
    }
}

/// Parses YAML into `T`, turning serde errors into [`Error`]s with line, column and key path.
fn parse_yaml<T: for<'de> Deserialize<'de>>(source_name: &str, text: &str) -> Result<T, Error> {
    crate::yaml::from_str(text).map_err(|e| {
        let crate::yaml::ParseError {
            path,
            line,
            column,
            message,
        } = e;
        Error {
            source_name: source_name.to_string(),
            line,
            column,
            key: path,
            message,
        }
    })
}

/// Returns the text of a built-in profile.
pub fn builtin(name: &str) -> Option<&'static str> {
    PROFILES
        .iter()
        .find(|(n, _, _)| *n == name)
        .map(|(_, _, text)| *text)
}

/// Names of the built-in profiles, for error messages and `--help`.
pub fn profile_names() -> Vec<&'static str> {
    PROFILES.iter().map(|(n, _, _)| *n).collect()
}

/// Reads and parses a topology file.
pub fn load_file(path: &Path, seed: &str) -> Result<Inventory, Error> {
    let name = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|e| Error {
        source_name: name.clone(),
        line: None,
        column: None,
        key: String::new(),
        message: format!("cannot read topology file: {e}"),
    })?;
    parse(&name, &text, seed)
}

/// Parses a built-in profile by name.
pub fn load_profile(name: &str, seed: &str) -> Result<Inventory, Error> {
    let text = builtin(name).ok_or_else(|| Error {
        source_name: format!("profile {name}"),
        line: None,
        column: None,
        key: String::new(),
        message: format!(
            "no built-in profile named {name:?}; choose one of: {}",
            profile_names().join(", ")
        ),
    })?;
    parse(&format!("profile {name}"), text, seed)
}

#[cfg(test)]
mod tests;
