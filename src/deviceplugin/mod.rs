//! The device-plugin fallback: the kubelet's legacy `v1beta1` device-plugin API, served from the
//! same [`Inventory`](crate::inventory::Inventory) as DRA, so `resources.limits: {nvidia.com/gpu:
//! 1}` keeps working where DRA is not available. A drop-in for NVIDIA's k8s-device-plugin: the
//! same resource names, device IDs (`deviceIDStrategy: uuid|index`), replica IDs (`<id>::<n>`),
//! `NVIDIA_VISIBLE_DEVICES` values and config file ([`nvconfig`]). Beyond it: per-GPU sharing
//! (`rename`, `devices`), per-client MPS limits, and `nvidia.com/gpu-memory` in GiB units
//! (`--device-plugin-gpu-memory`).
//!
//! Parts, layered so that only [`server`] knows gRPC:
//! - [`resources`]: inventory + [`Options`] → the advertised resources and their devices (pure);
//! - [`allocate`]: one container's device IDs → what the container gets, per list strategy (pure);
//! - [`preferred`]: topology-aware preferred allocation (pure);
//! - [`cdi`]: the per-node CDI spec naming every device this path hands out;
//! - [`Mapped`]: in `--mode auto`, the names DeviceClasses map to DRA, which it leaves to DRA
//!   (the DeviceClass watch and the node labels are the daemon's: [`crate::daemon`]);
//! - [`both`]: `--mode both`: the ledger shared with DRA, and what PodResources says containers
//!   hold;
//! - what containers hold through this path is a node-level fact, [`crate::holds`], which the
//!   ledger consults when a claim reserves devices;
//! - [`wire`]: proto ↔ domain, the only place that touches the generated types' fields;
//! - [`server`]: one gRPC server per resource on `<kubelet root>/device-plugins/nvidia-<name>.sock`,
//!   registration on `kubelet.sock` with re-registration when the kubelet restarts, and
//!   `ListAndWatch` following the inventory owner's publications (health applied).
//!
//! Invariants: the device list of a resource is a function of the inventory and the options, and
//! is sent whole on every change; Allocate answers only for IDs the current list has, healthy.
//! The module keeps no device list of its own beyond the last computed one.

pub mod allocate;
pub mod both;
pub mod cdi;
pub mod nvconfig;
pub mod preferred;
pub mod resources;
pub mod server;
mod service;
pub mod wire;

use std::collections::BTreeMap;

use serde::Deserialize;

pub use server::DevicePlugin;

/// The resource-name domain of every resource nvdra advertises.
pub const DOMAIN: &str = "nvidia.com";

/// `--mode auto`: extended resource name → the DeviceClasses that map it to DRA (sorted, never
/// empty); the device plugin does not serve these names ([`crate::daemon::auto`] follows them).
pub type Mapped = BTreeMap<String, Vec<String>>;

/// Which path serves `name`, for logs and `nvdra inventory`.
pub fn path_for(mapped: &Mapped, name: &str) -> String {
    match mapped.get(name) {
        Some(classes) => format!(
            "DRA (DeviceClass {} maps it via spec.extendedResourceName)",
            classes.join(", ")
        ),
        None => "device plugin".to_string(),
    }
}

/// How MIG devices are advertised (NVIDIA's `flags.migStrategy`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MigStrategy {
    /// MIG mode is ignored: every GPU is `nvidia.com/gpu`, by its GPU UUID.
    #[default]
    None,
    /// All MIG devices (one profile on the node) as `nvidia.com/gpu`.
    Single,
    /// Whole GPUs as `nvidia.com/gpu`, MIG devices as `nvidia.com/mig-<profile>`.
    Mixed,
}

/// Which identifier a device is advertised by (`flags.plugin.deviceIDStrategy`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum IdStrategy {
    #[default]
    Uuid,
    Index,
}

/// How Allocate hands devices to the container runtime (`flags.plugin.deviceListStrategy`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ListStrategy {
    Envvar,
    VolumeMounts,
    CdiAnnotations,
    CdiCri,
}

impl ListStrategy {
    pub fn is_cdi(self) -> bool {
        matches!(self, ListStrategy::CdiAnnotations | ListStrategy::CdiCri)
    }
}

/// An extra driver capability NVIDIA's plugin hands every container of the device plugin when
/// its flag is on (`flags.gdrcopyEnabled`, `flags.gdsEnabled`, `flags.mofedEnabled`): the
/// `NVIDIA_<MODE>=enabled` variable, and in CDI strategies the `<vendor>/<mode>=all` CDI device
/// of the mode's own spec (written only when the host has the mode's device nodes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum DriverMode {
    /// GDRCopy: `/dev/gdrdrv`.
    Gdrcopy,
    /// GPUDirect Storage: `/dev/nvidia-fs*`, `/etc/cufile.json`, `/run/udev`.
    Gds,
    /// Mellanox OFED: `/dev/infiniband/uverbs*`, `/dev/infiniband/rdma_cm`.
    Mofed,
}

impl DriverMode {
    /// In the order NVIDIA's plugin adds them.
    pub const ALL: [DriverMode; 3] = [DriverMode::Gdrcopy, DriverMode::Gds, DriverMode::Mofed];

    /// The CDI class of the mode's spec (NVIDIA's nvcdi mode name).
    pub fn class(self) -> &'static str {
        match self {
            DriverMode::Gdrcopy => "gdrcopy",
            DriverMode::Gds => "gds",
            DriverMode::Mofed => "mofed",
        }
    }

    /// The variable the NVIDIA container runtime reads (set to `enabled`).
    pub fn env(self) -> &'static str {
        match self {
            DriverMode::Gdrcopy => "NVIDIA_GDRCOPY",
            DriverMode::Gds => "NVIDIA_GDS",
            DriverMode::Mofed => "NVIDIA_MOFED",
        }
    }
}

/// Time-slicing or MPS.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShareKind {
    TimeSlicing,
    Mps,
}

/// Which devices of a resource a sharing entry replicates.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeviceSelector {
    All,
    /// The first `n` devices of the resource, in index order.
    First(u32),
    /// GPU indices (`"0"`), MIG indices (`"0:1"`), GPU or MIG UUIDs.
    List(Vec<String>),
}

/// One `sharing.*.resources[]` entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SharedResource {
    pub name: ResourceName,
    /// Where the replicas are advertised; `None`: `name`, or `name.shared` with
    /// `renameByDefault`.
    pub rename: Option<ResourceName>,
    pub devices: DeviceSelector,
    pub replicas: u32,
}

/// The sharing section.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sharing {
    pub kind: ShareKind,
    pub rename_by_default: bool,
    pub fail_requests_greater_than_one: bool,
    pub resources: Vec<SharedResource>,
}

/// What the device plugin advertises and how it allocates; NVIDIA's defaults.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Options {
    pub mig_strategy: MigStrategy,
    pub id_strategy: IdStrategy,
    pub list_strategies: Vec<ListStrategy>,
    pub pass_device_specs: bool,
    pub cdi_annotation_prefix: String,
    /// `sharedDevicesAllocationPolicy: packed` (default distributed).
    pub packed: bool,
    pub sharing: Option<Sharing>,
    pub mps_root: Option<String>,
    /// The enabled extra driver capabilities, in [`DriverMode::ALL`] order (default none).
    pub modes: Vec<DriverMode>,
    /// nvdra's extension (not in NVIDIA's config file): also advertise `nvidia.com/gpu-memory`,
    /// one device per GiB of each whole GPU (`--device-plugin-gpu-memory`).
    pub gpu_memory: bool,
    /// nvdra's, set from `--dynamic-mig` in `--mode both`: DRA switches the MIG mode of every
    /// GPU that can switch it at run time, so this path hands out such a GPU only whole, while
    /// it is outside MIG mode, and leaves it out of the lists while it is in MIG mode (its MIG
    /// devices are DRA's). Without it a switch would change the node's MIG shape under
    /// `migStrategy: single` and stop the lists from being computed.
    pub dynamic_mig: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            mig_strategy: MigStrategy::None,
            id_strategy: IdStrategy::Uuid,
            list_strategies: vec![ListStrategy::Envvar],
            pass_device_specs: false,
            cdi_annotation_prefix: "cdi.k8s.io/".into(),
            packed: false,
            sharing: None,
            mps_root: None,
            modes: Vec::new(),
            gpu_memory: false,
            dynamic_mig: false,
        }
    }
}

/// A resource name, `nvidia.com/<name>`: at most 63 characters, `<name>` a DNS subdomain.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ResourceName(String);

impl ResourceName {
    /// Accepts `nvidia.com/x` or `x` (the prefix is added, as NVIDIA does).
    pub fn parse(raw: &str) -> Result<Self, String> {
        let full = if raw.contains('/') {
            raw.to_string()
        } else {
            format!("{DOMAIN}/{raw}")
        };
        let Some(name) = full.strip_prefix(&format!("{DOMAIN}/")) else {
            return Err(format!("{raw:?}: a resource name must be {DOMAIN}/<name>"));
        };
        if full.len() > 63 {
            return Err(format!("{raw:?}: a resource name is at most 63 characters"));
        }
        crate::config::check_dns_subdomain("name", name, 63).map_err(|_| {
            format!("{raw:?}: <name> of {DOMAIN}/<name> must be a lower-case DNS subdomain")
        })?;
        Ok(ResourceName(full))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The part after `nvidia.com/`.
    pub fn short(&self) -> &str {
        self.0.strip_prefix("nvidia.com/").unwrap_or(&self.0)
    }

    /// `<name>.shared`.
    pub fn shared(&self) -> Result<Self, String> {
        Self::parse(&format!("{}.shared", self.0))
    }

    /// `nvidia-<short>.sock`, the socket file NVIDIA's plugin uses for this resource.
    pub fn socket_file(&self) -> String {
        format!("nvidia-{}.sock", self.short())
    }
}

impl std::fmt::Display for ResourceName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests;
