//! The topology file format: the serde structs of the catalog and of a topology file.

use std::collections::BTreeMap;

use serde::{Deserialize, Deserializer};

use crate::inventory::Engines;

/// Bytes, written as a Kubernetes quantity (`40Gi`, `4864Mi`) or a plain integer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Bytes(pub(super) u64);

impl<'de> Deserialize<'de> for Bytes {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Int(u64),
            Str(String),
        }
        match Raw::deserialize(d)? {
            Raw::Int(n) => Ok(Bytes(n)),
            Raw::Str(s) => crate::inventory::parse_quantity(&s)
                .map(Bytes)
                .ok_or_else(|| {
                    serde::de::Error::custom(format!(
                        "invalid quantity {s:?}: expected bytes such as 40Gi, 4864Mi or 1073741824"
                    ))
                }),
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(super) struct ModelSpec {
    pub(super) product_name: String,
    #[serde(default = "default_brand")]
    pub(super) brand: String,
    pub(super) architecture: String,
    pub(super) compute_capability: String,
    pub(super) memory: Bytes,
    pub(super) multiprocessors: u32,
    #[serde(default)]
    pub(super) engines: Engines,
    #[serde(default)]
    pub(super) mig: Option<ModelMig>,
}

pub(super) fn default_brand() -> String {
    "Nvidia".into()
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(super) struct ModelMig {
    pub(super) memory_slices: u32,
    pub(super) profiles: Vec<ModelMigProfile>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(super) struct ModelMigProfile {
    pub(super) name: String,
    pub(super) id: u32,
    pub(super) memory: Bytes,
    pub(super) multiprocessors: u32,
    #[serde(default)]
    pub(super) engines: Engines,
    pub(super) max_instances: u32,
    pub(super) size: u32,
    pub(super) starts: Vec<u32>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(super) struct TopologyFile {
    pub(super) version: String,
    #[serde(default)]
    pub(super) description: Option<String>,
    pub(super) driver_version: String,
    pub(super) cuda_driver_version: String,
    #[serde(default)]
    pub(super) models: BTreeMap<String, ModelSpec>,
    #[serde(default)]
    pub(super) nvswitches: Vec<String>,
    pub(super) gpus: Vec<GpuSpec>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(super) struct GpuSpec {
    pub(super) index: u32,
    pub(super) model: String,
    #[serde(default)]
    pub(super) minor: Option<u32>,
    #[serde(default)]
    pub(super) uuid: Option<String>,
    pub(super) pci_bus_id: String,
    #[serde(default)]
    pub(super) pcie_root: Option<String>,
    #[serde(default)]
    pub(super) numa_node: Option<u32>,
    /// Indices of GPUs this one is bridged to.
    #[serde(default)]
    pub(super) nvlink_peers: Vec<u32>,
    /// Ids of NVSwitches (from the top-level `nvswitches`) this GPU links to.
    #[serde(default)]
    pub(super) nvlink_switches: Vec<String>,
    #[serde(default)]
    pub(super) mig: Option<GpuMigSpec>,
    /// The NVLink fabric registration NVML would report as completed (multi-node NVLink).
    #[serde(default)]
    pub(super) fabric: Option<FabricSpec>,
    /// When set, the GPU is unhealthy for this reason.
    #[serde(default)]
    pub(super) unhealthy: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(super) struct FabricSpec {
    /// The fabric cluster's UUID, 8-4-4-4-12 hex digits.
    pub(super) cluster_uuid: String,
    pub(super) clique_id: u32,
    /// Nodes per clique, for a profile shared by the trays of several racks: the node's tray
    /// number is the trailing number of its name (the seed; none: 0), and its clique is
    /// `cliqueId + tray / traysPerClique`.
    #[serde(default)]
    pub(super) trays_per_clique: Option<u32>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(super) struct GpuMigSpec {
    pub(super) enabled: bool,
    #[serde(default)]
    pub(super) devices: Vec<MigDeviceSpec>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(super) struct MigDeviceSpec {
    pub(super) profile: String,
    pub(super) placement: u32,
    #[serde(default)]
    pub(super) uuid: Option<String>,
    #[serde(default)]
    pub(super) unhealthy: Option<String>,
}
