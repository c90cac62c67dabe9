//! The NVML backend: reads the node's GPUs through nvml-wrapper.
//!
//! `libnvidia-ml.so.1` is loaded at run time, so the binary builds and starts on machines with no
//! NVIDIA software; there a missing library is [`Error::NvmlMissing`], never a panic.
//!
//! A snapshot is two steps with a seam between them, so the logic is testable without a GPU:
//!
//! 1. [`read_raw`] makes every NVML call and keeps each answer, success or failure, in plain owned
//!    values ([`RawNode`], [`RawGpu`], …). It decides nothing beyond which calls to make.
//! 2. [`map`] is pure: it turns a [`RawNode`] plus what sysfs says about PCI placement into an
//!    [`Inventory`] — version strings, architecture and brand names, PCI ids, PCIe roots, NUMA
//!    nodes, MIG profile names, NVLink peers (`nvml/fabric.rs`: NVSwitches at the invalid PCI
//!    address, fabric registrations) — and lists every fact it had to leave out ([`Omission`]).
//!
//! Invariants: one unsupported or failing call never sinks the snapshot. A GPU whose identity
//! (UUID, minor, PCI bus id, name, memory, compute capability) cannot be read is left out with a
//! warning; a MIG device whose GPU-instance ids or placement cannot be read is left out with a
//! warning naming its UUID. Any other fact NVML does not give is `None` (so its attribute or
//! capacity is not published), never a made-up 0, `false` or "Unknown"; the backend logs each
//! such omission once per GPU and field. Only the node-wide driver and CUDA versions are required.
//!
//! nvml-wrapper 0.13 does not wrap the MIG identity calls (GPU/compute-instance ids, GPU-instance
//! info) nor the fabric registration, and its `possible_placements` and
//! `NvLink::remote_device_type` return nothing useful (the first never sets the vector's length,
//! the second writes into a temporary). Those calls go through the raw symbol table in the private
//! `ffi` module (`nvml/ffi.rs`), the only `unsafe` code here, using the `Result` fields of
//! `nvml.lib()`, so a driver without a symbol yields an error value instead of a panic.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use nvml_wrapper::enum_wrappers::device::Brand;
use nvml_wrapper::enums::device::DeviceArchitecture;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::struct_wrappers::device::{DeviceAttributes, ProfileInfo};
use nvml_wrapper::{Device, Nvml};
use tracing::{Level, debug, info, warn};

use super::{
    ComputeCapability, DeviceBackend, Engines, Error, Gpu, GpuUuid, Health, Inventory, Mig,
    MigDevice, MigProfile, MigUuid, PciBusId, Placement, Result,
};

mod fabric;
mod ffi;

pub use fabric::{FabricState, RawFabric, RawNvLink, RawPci, RemoteDevice};

/// The library NVML is loaded from.
pub const LIBRARY: &str = "libnvidia-ml.so.1";

/// Where the kernel's sysfs is mounted. Sysfs belongs to the kernel, not to a driver
/// installation, so it does not move with `--driver-root`.
pub const SYSFS_ROOT: &str = "/sys";

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// `NVML_GPU_INSTANCE_PROFILE_COUNT`: GPU-instance profiles are indexed `0..COUNT`.
const GI_PROFILE_COUNT: u32 = nvml_wrapper_sys::bindings::NVML_GPU_INSTANCE_PROFILE_COUNT;
/// `NVML_NVLINK_MAX_LINKS`.
const NVLINK_MAX_LINKS: u32 = nvml_wrapper_sys::bindings::NVML_NVLINK_MAX_LINKS;

// ------------------------------------------------------------------------------------------------
// The backend
// ------------------------------------------------------------------------------------------------

pub struct NvmlBackend {
    nvml: Nvml,
    sysfs: HostSysfs,
    logged: OmissionLog,
}

impl std::fmt::Debug for NvmlBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmlBackend")
            .field("sysfs", &self.sysfs.root)
            .finish_non_exhaustive()
    }
}

impl NvmlBackend {
    /// Loads NVML. With a driver root other than `/`, the library is looked up under it first
    /// (the usual layout of a containerized driver), then by the default search path.
    pub fn open(driver_root: &Path) -> Result<Self> {
        let mut tried = Vec::new();
        for candidate in library_candidates(driver_root) {
            let init = match &candidate {
                Some(path) => Nvml::builder().lib_path(path.as_os_str()).init(),
                None => Nvml::init(),
            };
            match init {
                Ok(nvml) => {
                    return Ok(Self {
                        nvml,
                        sysfs: HostSysfs::new(SYSFS_ROOT),
                        logged: OmissionLog::default(),
                    });
                }
                Err(NvmlError::LibloadingError(e)) => tried.push(match &candidate {
                    Some(path) => format!("{}: {e}", path.display()),
                    None => e.to_string(),
                }),
                Err(e) => {
                    return Err(Error::Nvml {
                        call: "nvmlInit".into(),
                        reason: e.to_string(),
                    });
                }
            }
        }
        Err(Error::NvmlMissing {
            library: LIBRARY.into(),
            reason: tried.join("; "),
        })
    }

    /// Reads PCI placement from another sysfs mount (for tests or unusual container layouts).
    pub fn with_sysfs_root(mut self, root: impl Into<PathBuf>) -> Self {
        self.sysfs = HostSysfs::new(root);
        self
    }

    pub fn nvml(&self) -> &Nvml {
        &self.nvml
    }
}

fn library_candidates(driver_root: &Path) -> Vec<Option<PathBuf>> {
    let mut out = Vec::new();
    if driver_root != Path::new("/") {
        for dir in [
            "usr/lib/x86_64-linux-gnu",
            "usr/lib/aarch64-linux-gnu",
            "usr/lib64",
            "usr/lib",
            "lib64",
            "lib",
        ] {
            let p = driver_root.join(dir).join(LIBRARY);
            if p.exists() {
                out.push(Some(p));
            }
        }
    }
    out.push(None);
    out
}

impl DeviceBackend for NvmlBackend {
    fn name(&self) -> &'static str {
        "nvml"
    }

    fn snapshot(&self) -> Result<Inventory> {
        let (inv, omissions) = map_with_omissions(read_raw(&self.nvml)?, &self.sysfs)?;
        self.logged.log_new(&omissions);
        Ok(inv)
    }
}

/// A fact NVML did not give for one GPU, left out of the inventory instead of guessed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Omission {
    pub gpu_index: u32,
    pub gpu: GpuUuid,
    /// What is left out, named as published (`multiprocessors`, `brand`, `fabric`, …).
    pub field: &'static str,
    pub reason: String,
    /// How loudly to say it: `WARN` for a gap on hardware that should have the value, `INFO`
    /// for a transient or harmless one, `DEBUG` for what a GPU simply does not have.
    pub level: Level,
}

impl Omission {
    fn log(&self) {
        let (index, uuid, field, reason) =
            (self.gpu_index, self.gpu.as_str(), self.field, &self.reason);
        match self.level {
            Level::ERROR | Level::WARN => {
                warn!(
                    gpu.index = index,
                    gpu.uuid = uuid,
                    field,
                    "{field} not published: {reason}"
                )
            }
            Level::INFO => {
                info!(
                    gpu.index = index,
                    gpu.uuid = uuid,
                    field,
                    "{field} not published: {reason}"
                )
            }
            _ => debug!(
                gpu.index = index,
                gpu.uuid = uuid,
                field,
                "{field} not published: {reason}"
            ),
        }
    }
}

/// Logs each omission once per GPU and field while it lasts: again only when its reason changes,
/// or when it comes back after the value was seen.
#[derive(Debug, Default)]
struct OmissionLog(Mutex<BTreeMap<(GpuUuid, &'static str), String>>);

impl OmissionLog {
    /// Logs the omissions not logged before (or whose reason changed) and returns them.
    fn log_new<'a>(&self, omissions: &'a [Omission]) -> Vec<&'a Omission> {
        // A panic while logging cannot leave the map torn; keep using it.
        let mut seen = crate::lock::lock(&self.0);
        let mut now = BTreeMap::new();
        let mut logged = Vec::new();
        for o in omissions {
            let key = (o.gpu.clone(), o.field);
            if seen.get(&key) != Some(&o.reason) {
                o.log();
                logged.push(o);
            }
            now.insert(key, o.reason.clone());
        }
        *seen = now;
        logged
    }
}

// ------------------------------------------------------------------------------------------------
// Raw capture: every NVML answer, owned
// ------------------------------------------------------------------------------------------------

/// Why an NVML call gave no value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CallError {
    /// `NVML_ERROR_NOT_SUPPORTED`: this GPU or driver does not do that (MIG on an L40S).
    NotSupported,
    /// `NVML_ERROR_NOT_FOUND`: the object does not exist (an empty MIG slot).
    NotFound,
    /// The installed driver's library lacks the function (older than the feature).
    Missing(String),
    /// Any other failure, as NVML describes it.
    Failed(String),
}

impl fmt::Display for CallError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CallError::NotSupported => f.write_str("not supported"),
            CallError::NotFound => f.write_str("not found"),
            CallError::Missing(s) => write!(f, "function missing from the NVML library ({s})"),
            CallError::Failed(s) => f.write_str(s),
        }
    }
}

impl From<NvmlError> for CallError {
    fn from(e: NvmlError) -> Self {
        match e {
            NvmlError::NotSupported => CallError::NotSupported,
            NvmlError::NotFound => CallError::NotFound,
            NvmlError::FailedToLoadSymbol(s) => CallError::Missing(s),
            NvmlError::FunctionNotFound => CallError::Missing("function not found".into()),
            other => CallError::Failed(other.to_string()),
        }
    }
}

/// The answer to one NVML call.
pub type RawResult<T> = std::result::Result<T, CallError>;

fn raw<T>(r: std::result::Result<T, NvmlError>) -> RawResult<T> {
    r.map_err(CallError::from)
}

/// Everything NVML said about the node.
#[derive(Clone, Debug)]
pub struct RawNode {
    /// `nvmlSystemGetDriverVersion`, e.g. `570.124.06`.
    pub driver_version: RawResult<String>,
    /// `nvmlSystemGetCudaDriverVersion`, e.g. `12080`.
    pub cuda_driver_version: RawResult<i32>,
    pub gpus: Vec<RawGpu>,
    /// GPUs NVML counts but whose handle it would not give (fallen off the bus, no permission).
    pub unreadable: Vec<(u32, CallError)>,
}

/// Everything NVML said about one physical GPU.
#[derive(Clone, Debug)]
pub struct RawGpu {
    /// NVML's index (`nvmlDeviceGetHandleByIndex`).
    pub index: u32,
    pub minor: RawResult<u32>,
    pub uuid: RawResult<String>,
    pub name: RawResult<String>,
    pub brand: RawResult<Brand>,
    pub architecture: RawResult<DeviceArchitecture>,
    pub compute_capability: RawResult<ComputeCapability>,
    /// `nvmlDeviceGetMemoryInfo` total, in bytes.
    pub memory_total_bytes: RawResult<u64>,
    /// `nvmlDeviceGetAttributes_v2`; most drivers answer only for MIG devices.
    pub attributes: RawResult<DeviceAttributes>,
    /// `nvmlDeviceGetNumGpuCores` (CUDA cores), for the SM count when attributes are missing.
    pub cuda_cores: RawResult<u32>,
    /// As NVML formats it, e.g. `00000000:07:00.0`.
    pub pci_bus_id: RawResult<String>,
    /// `nvmlDeviceGetNumaNodeId`: the GPU memory's own NUMA node on coherent platforms.
    pub numa_node: RawResult<u32>,
    pub mig_mode: RawResult<RawMigMode>,
    /// GPU-instance profiles this GPU supports (those NVML answered for).
    pub gi_profiles: Vec<RawGiProfile>,
    /// Existing MIG devices (only read in MIG mode).
    pub mig_devices: Vec<RawMigDevice>,
    /// Active NVLinks.
    pub nvlinks: Vec<RawNvLink>,
    /// The NVLink fabric registration (`nvmlDeviceGetGpuFabricInfoV`).
    pub fabric: RawResult<RawFabric>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RawMigMode {
    pub current: bool,
    pub pending: bool,
}

/// One GPU-instance profile a GPU supports.
#[derive(Clone, Debug)]
pub struct RawGiProfile {
    /// The `NVML_GPU_INSTANCE_PROFILE_*` index it was queried with (names derive from it:
    /// `…_REV1` is the media-extension `+me` variant).
    pub profile: u32,
    /// `info.id` is what GPU instances report as their `profileId` (19 for A100 `1g.5gb`).
    pub info: ProfileInfo,
    pub placements: RawResult<Vec<Placement>>,
}

/// One existing MIG device.
#[derive(Clone, Debug)]
pub struct RawMigDevice {
    /// Its index among the parent's MIG device handles.
    pub slot: u32,
    pub uuid: RawResult<String>,
    pub attributes: RawResult<DeviceAttributes>,
    pub gi_id: RawResult<u32>,
    pub ci_id: RawResult<u32>,
    /// `nvmlGpuInstanceGetInfo` of its GPU instance.
    pub gpu_instance: RawResult<RawGpuInstance>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RawGpuInstance {
    /// Matches [`ProfileInfo::id`] of one of the parent's profiles.
    pub profile_id: u32,
    pub placement: Placement,
}

/// Makes every NVML call a snapshot needs. Fails only when NVML cannot count the GPUs.
pub fn read_raw(nvml: &Nvml) -> Result<RawNode> {
    let count = nvml.device_count().map_err(|e| Error::Nvml {
        call: "nvmlDeviceGetCount".into(),
        reason: e.to_string(),
    })?;
    let mut gpus = Vec::new();
    let mut unreadable = Vec::new();
    for index in 0..count {
        match nvml.device_by_index(index) {
            Ok(device) => gpus.push(read_gpu(nvml, index, &device)),
            Err(e) => unreadable.push((index, e.into())),
        }
    }
    Ok(RawNode {
        driver_version: raw(nvml.sys_driver_version()),
        cuda_driver_version: raw(nvml.sys_cuda_driver_version()),
        gpus,
        unreadable,
    })
}

fn read_gpu(nvml: &Nvml, index: u32, d: &Device<'_>) -> RawGpu {
    let mig_mode = raw(d.mig_mode()).map(|m| RawMigMode {
        current: m.current == nvml_wrapper_sys::bindings::NVML_DEVICE_MIG_ENABLE,
        pending: m.pending == nvml_wrapper_sys::bindings::NVML_DEVICE_MIG_ENABLE,
    });
    let (gi_profiles, mig_devices) = match mig_mode {
        Ok(mode) => (
            read_gi_profiles(nvml, d),
            if mode.current {
                read_mig_devices(nvml, d)
            } else {
                Vec::new()
            },
        ),
        Err(_) => (Vec::new(), Vec::new()),
    };
    RawGpu {
        index,
        minor: raw(d.minor_number()),
        uuid: raw(d.uuid()),
        name: raw(d.name()),
        brand: raw(d.brand()),
        architecture: raw(d.architecture()),
        compute_capability: raw(d.cuda_compute_capability()).and_then(|cc| {
            match (u32::try_from(cc.major), u32::try_from(cc.minor)) {
                (Ok(major), Ok(minor)) => Ok(ComputeCapability { major, minor }),
                _ => Err(CallError::Failed(format!(
                    "negative compute capability {}.{}",
                    cc.major, cc.minor
                ))),
            }
        }),
        memory_total_bytes: raw(d.memory_info()).map(|m| m.total),
        attributes: raw(d.attributes()),
        cuda_cores: raw(d.num_cores()),
        pci_bus_id: raw(d.pci_info()).map(|p| p.bus_id),
        numa_node: raw(d.numa_node_id()),
        mig_mode,
        gi_profiles,
        mig_devices,
        nvlinks: read_nvlinks(nvml, d),
        fabric: raw(ffi::gpu_fabric_info(nvml, d)),
    }
}

fn read_gi_profiles(nvml: &Nvml, d: &Device<'_>) -> Vec<RawGiProfile> {
    let mut out = Vec::new();
    for profile in 0..GI_PROFILE_COUNT {
        match d.profile_info(profile) {
            Ok(info) => {
                let placements = raw(ffi::possible_placements(nvml, d, info.id));
                out.push(RawGiProfile {
                    profile,
                    info,
                    placements,
                });
            }
            // Profiles this GPU does not offer answer NotSupported or InvalidArg.
            Err(NvmlError::NotSupported | NvmlError::InvalidArg) => {}
            Err(e) => debug!(profile, error = %e, "nvmlDeviceGetGpuInstanceProfileInfo failed"),
        }
    }
    out
}

fn read_mig_devices(nvml: &Nvml, parent: &Device<'_>) -> Vec<RawMigDevice> {
    let max = match parent.mig_device_count() {
        Ok(n) => n,
        Err(e) => {
            debug!(error = %e, "nvmlDeviceGetMaxMigDeviceCount failed");
            return Vec::new();
        }
    };
    let mut out = Vec::new();
    for slot in 0..max {
        let mig = match parent.mig_device_by_index(slot) {
            Ok(m) => m,
            // Empty slots answer NotFound (or InvalidArg on some drivers).
            Err(NvmlError::NotFound | NvmlError::InvalidArg) => continue,
            Err(e) => {
                debug!(slot, error = %e, "nvmlDeviceGetMigDeviceHandleByIndex failed");
                continue;
            }
        };
        let gi_id = raw(ffi::gpu_instance_id(nvml, &mig));
        let gpu_instance = match &gi_id {
            Ok(id) => raw(ffi::gpu_instance_info(nvml, parent, *id)),
            Err(e) => Err(e.clone()),
        };
        out.push(RawMigDevice {
            slot,
            uuid: raw(mig.uuid()),
            attributes: raw(mig.attributes()),
            gi_id,
            ci_id: raw(ffi::compute_instance_id(nvml, &mig)),
            gpu_instance,
        });
    }
    out
}

fn read_nvlinks(nvml: &Nvml, d: &Device<'_>) -> Vec<RawNvLink> {
    let mut out = Vec::new();
    for link in 0..NVLINK_MAX_LINKS {
        let wrapper = d.link_wrapper_for(link);
        match wrapper.is_active() {
            Ok(true) => out.push(RawNvLink {
                link,
                remote_pci: raw(wrapper.remote_pci_info()).map(|p| RawPci {
                    bus_id: p.bus_id,
                    domain: p.domain,
                    bus: p.bus,
                    device: p.device,
                }),
                remote_type: raw(ffi::nvlink_remote_type(nvml, d, link)),
            }),
            Ok(false) => {}
            // No NVLink on this GPU at all: every link answers the same, stop asking.
            Err(NvmlError::NotSupported) if link == 0 => break,
            Err(NvmlError::NotSupported | NvmlError::InvalidArg) => {}
            Err(e) => debug!(link, error = %e, "nvmlDeviceGetNvLinkState failed"),
        }
    }
    out
}

// ------------------------------------------------------------------------------------------------
// Sysfs: PCI placement
// ------------------------------------------------------------------------------------------------

/// What [`map`] needs from sysfs, per PCI device.
pub trait Sysfs {
    /// The target of the `bus/pci/devices/<bus id>` symlink, e.g.
    /// `../../../devices/pci0000:00/0000:00:01.0/0000:07:00.0`.
    fn pci_device_link(&self, bus: &PciBusId) -> Option<PathBuf>;
    /// The contents of `bus/pci/devices/<bus id>/numa_node` (`-1` when the platform has none).
    fn pci_numa_node(&self, bus: &PciBusId) -> Option<String>;
}

/// Sysfs as mounted on this machine.
#[derive(Clone, Debug)]
pub struct HostSysfs {
    root: PathBuf,
}

impl HostSysfs {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    fn device(&self, bus: &PciBusId) -> PathBuf {
        self.root.join("bus/pci/devices").join(bus.as_str())
    }
}

impl Sysfs for HostSysfs {
    fn pci_device_link(&self, bus: &PciBusId) -> Option<PathBuf> {
        std::fs::read_link(self.device(bus)).ok()
    }

    fn pci_numa_node(&self, bus: &PciBusId) -> Option<String> {
        std::fs::read_to_string(self.device(bus).join("numa_node")).ok()
    }
}

/// The `pci<domain>:<bus>` component of a PCI device's sysfs path: its PCIe root complex.
pub fn pcie_root_of(device_path: &Path) -> Option<String> {
    device_path.components().find_map(|c| {
        let s = c.as_os_str().to_str()?;
        let (domain, bus) = s.strip_prefix("pci")?.split_once(':')?;
        let hex = |t: &str, n: std::ops::RangeInclusive<usize>| {
            n.contains(&t.len()) && t.chars().all(|c| c.is_ascii_hexdigit())
        };
        (hex(domain, 4..=8) && hex(bus, 2..=2)).then(|| s.to_string())
    })
}

/// The NUMA node sysfs reports, `None` for `-1` (no NUMA) or anything unreadable.
fn parse_numa(text: &str) -> Option<u32> {
    text.trim()
        .parse::<i64>()
        .ok()
        .and_then(|n| u32::try_from(n).ok())
}

// ------------------------------------------------------------------------------------------------
// Mapping: RawNode → Inventory (pure)
// ------------------------------------------------------------------------------------------------

/// Turns what NVML and sysfs said into an [`Inventory`], logging every omission. See the module
/// doc for what is required and what degrades.
pub fn map(raw: RawNode, sysfs: &impl Sysfs) -> Result<Inventory> {
    let (inv, omissions) = map_with_omissions(raw, sysfs)?;
    for o in &omissions {
        o.log();
    }
    Ok(inv)
}

/// [`map`], returning the omissions instead of logging them (the backend logs each once).
pub fn map_with_omissions(raw: RawNode, sysfs: &impl Sysfs) -> Result<(Inventory, Vec<Omission>)> {
    let RawNode {
        driver_version,
        cuda_driver_version,
        gpus,
        unreadable,
    } = raw;
    let driver_version = driver_version
        .map_err(|e| Error::Nvml {
            call: "nvmlSystemGetDriverVersion".into(),
            reason: e.to_string(),
        })?
        .trim()
        .to_string();
    let cuda_raw = cuda_driver_version.map_err(|e| Error::Nvml {
        call: "nvmlSystemGetCudaDriverVersion".into(),
        reason: e.to_string(),
    })?;
    let cuda_driver_version = format_cuda_version(cuda_raw).ok_or_else(|| Error::Nvml {
        call: "nvmlSystemGetCudaDriverVersion".into(),
        reason: format!("invalid CUDA driver version {cuda_raw}"),
    })?;
    for (index, e) in &unreadable {
        warn!(gpu.index = index, error = %e, "skipping GPU: NVML gives no handle for it");
    }

    let node_buses: BTreeSet<PciBusId> = gpus
        .iter()
        .filter_map(|g| g.pci_bus_id.as_ref().ok())
        .filter_map(|b| PciBusId::normalize(b))
        .collect();
    let versions = Versions {
        driver: driver_version,
        cuda: cuda_driver_version,
    };
    let mut omissions = Vec::new();
    let mapped = gpus
        .into_iter()
        .filter_map(|g| map_gpu(g, &versions, &node_buses, sysfs, &mut omissions))
        .collect();
    Ok((Inventory::new(mapped)?, omissions))
}

struct Versions {
    driver: String,
    cuda: String,
}

/// Formats NVML's CUDA driver version (`1000 * major + 10 * minor`): 12040 → `12.4`.
pub fn format_cuda_version(v: i32) -> Option<String> {
    (v > 0).then(|| format!("{}.{}", v / 1000, (v % 1000) / 10))
}

/// The brand as NVIDIA's Kubernetes components publish it (`Nvidia`, `GeForceRTX`, …).
pub fn brand_name(b: &Brand) -> &'static str {
    match b {
        Brand::Unknown => "Unknown",
        Brand::Quadro => "Quadro",
        Brand::Tesla => "Tesla",
        Brand::NVS => "NVS",
        Brand::GRID => "GRID",
        Brand::GeForce => "GeForce",
        Brand::Titan => "Titan",
        Brand::VApps => "vApps",
        Brand::VPC => "VPC",
        Brand::VCS => "VCS",
        Brand::VWS => "VWS",
        Brand::CloudGaming | Brand::VGaming => "CloudGaming",
        Brand::QuadroRTX => "QuadroRTX",
        Brand::NvidiaRTX => "NvidiaRTX",
        Brand::Nvidia => "Nvidia",
        Brand::GeForceRTX => "GeForceRTX",
        Brand::TitanRTX => "TitanRTX",
    }
}

/// The architecture name NVML reports, or `None` when it does not know it.
pub fn architecture_name(a: &DeviceArchitecture) -> Option<&'static str> {
    Some(match a {
        DeviceArchitecture::Kepler => "Kepler",
        DeviceArchitecture::Maxwell => "Maxwell",
        DeviceArchitecture::Pascal => "Pascal",
        DeviceArchitecture::Volta => "Volta",
        DeviceArchitecture::Turing => "Turing",
        DeviceArchitecture::Ampere => "Ampere",
        DeviceArchitecture::Ada => "Ada Lovelace",
        DeviceArchitecture::Hopper => "Hopper",
        DeviceArchitecture::Blackwell => "Blackwell",
        DeviceArchitecture::Unknown => return None,
    })
}

/// The architecture a compute capability belongs to, for drivers older than the GPU.
pub fn architecture_from_cc(cc: ComputeCapability) -> Option<&'static str> {
    Some(match (cc.major, cc.minor) {
        (3, _) => "Kepler",
        (5, _) => "Maxwell",
        (6, _) => "Pascal",
        (7, 0 | 2) => "Volta",
        (7, _) => "Turing",
        (8, 9) => "Ada Lovelace",
        (8, _) => "Ampere",
        (9, _) => "Hopper",
        (10.., _) => "Blackwell",
        _ => return None,
    })
}

/// CUDA cores per SM, to turn `nvmlDeviceGetNumGpuCores` into an SM count.
fn cores_per_sm(cc: ComputeCapability) -> Option<u32> {
    match (cc.major, cc.minor) {
        (6, 0) | (7, _) | (8, 0) => Some(64),
        (6, _) | (8, _) | (9, _) | (10..=12, _) => Some(128),
        _ => None,
    }
}

/// The GB figure of a MIG profile name, computed as NVIDIA does: the profile's share of the
/// GPU's memory rounded up to eighths, times the GPU's memory in whole GiB, rounded.
pub fn mig_memory_gb(total_bytes: u64, profile_mib: u64) -> u64 {
    if total_bytes == 0 {
        return (profile_mib as f64 / 1024.0).round() as u64;
    }
    let fraction = (profile_mib * MIB) as f64 / total_bytes as f64;
    let eighths = (fraction * 8.0).ceil() / 8.0;
    let total_gib = total_bytes.div_ceil(GIB) as f64;
    (eighths * total_gib).round() as u64
}

/// The suffix NVIDIA gives a GPU-instance profile variant.
fn profile_suffix(profile: u32) -> &'static str {
    use nvml_wrapper_sys::bindings as b;
    match profile {
        b::NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1 | b::NVML_GPU_INSTANCE_PROFILE_2_SLICE_REV1 => {
            "+me"
        }
        b::NVML_GPU_INSTANCE_PROFILE_1_SLICE_GFX
        | b::NVML_GPU_INSTANCE_PROFILE_2_SLICE_GFX
        | b::NVML_GPU_INSTANCE_PROFILE_4_SLICE_GFX => "+gfx",
        b::NVML_GPU_INSTANCE_PROFILE_1_SLICE_NO_ME | b::NVML_GPU_INSTANCE_PROFILE_2_SLICE_NO_ME => {
            "-me"
        }
        b::NVML_GPU_INSTANCE_PROFILE_1_SLICE_ALL_ME
        | b::NVML_GPU_INSTANCE_PROFILE_2_SLICE_ALL_ME => "+me.all",
        _ => "",
    }
}

/// A MIG profile name: `<G>g.<GB>gb`, `<C>c.<G>g.<GB>gb` when the compute instance is smaller
/// than its GPU instance, plus the variant suffix (`+me`, `+gfx`, `-me`, `+me.all`).
pub fn mig_profile_name(
    profile: Option<u32>,
    gi_slices: u32,
    ci_slices: u32,
    profile_mib: u64,
    total_bytes: u64,
) -> String {
    let gb = mig_memory_gb(total_bytes, profile_mib);
    let suffix = profile.map_or("", profile_suffix);
    if ci_slices != 0 && ci_slices < gi_slices {
        format!("{ci_slices}c.{gi_slices}g.{gb}gb{suffix}")
    } else {
        format!("{gi_slices}g.{gb}gb{suffix}")
    }
}

fn profile_engines(info: &ProfileInfo) -> Engines {
    Engines {
        copy_engines: info.copy_engine_count,
        decoders: info.decoder_count,
        encoders: info.encoder_count,
        jpeg_engines: info.jpeg_count,
        ofa_engines: info.ofa_count,
    }
}

fn attribute_engines(a: &DeviceAttributes) -> Engines {
    Engines {
        copy_engines: a.shared_copy_engine_count,
        decoders: a.shared_decoder_count,
        encoders: a.shared_encoder_count,
        jpeg_engines: a.shared_jpeg_count,
        ofa_engines: a.shared_ofa_count,
    }
}

/// Unwraps a required per-GPU answer, or logs why the GPU is left out.
fn required<T>(index: u32, call: &str, r: RawResult<T>) -> Option<T> {
    r.map_err(|e| warn!(gpu.index = index, call, error = %e, "skipping GPU: {call} failed"))
        .ok()
}

fn map_gpu(
    raw: RawGpu,
    versions: &Versions,
    node_buses: &BTreeSet<PciBusId>,
    sysfs: &impl Sysfs,
    notes: &mut Vec<Omission>,
) -> Option<Gpu> {
    let RawGpu {
        index,
        minor,
        uuid,
        name,
        brand,
        architecture,
        compute_capability,
        memory_total_bytes,
        attributes,
        cuda_cores,
        pci_bus_id,
        numa_node,
        mig_mode,
        gi_profiles,
        mig_devices,
        nvlinks,
        fabric,
    } = raw;
    let uuid = required(index, "nvmlDeviceGetUUID", uuid)?;
    let minor = required(index, "nvmlDeviceGetMinorNumber", minor)?;
    let product_name = required(index, "nvmlDeviceGetName", name)?;
    let memory_bytes = required(index, "nvmlDeviceGetMemoryInfo", memory_total_bytes)?;
    let cc = required(
        index,
        "nvmlDeviceGetCudaComputeCapability",
        compute_capability,
    )?;
    let raw_bus = required(index, "nvmlDeviceGetPciInfo", pci_bus_id)?;
    let Some(pci_bus_id) = PciBusId::normalize(&raw_bus) else {
        warn!(gpu.index = index, bus = %raw_bus, "skipping GPU: NVML reports an invalid PCI bus id");
        return None;
    };

    let gpu = GpuUuid(uuid);
    let mut omit = |field: &'static str, level: Level, reason: String| {
        notes.push(Omission {
            gpu_index: index,
            gpu: gpu.clone(),
            field,
            reason,
            level,
        });
    };

    let brand = match &brand {
        Ok(Brand::Unknown) => {
            omit(
                "brand",
                Level::INFO,
                "NVML reports the brand as unknown".into(),
            );
            None
        }
        Ok(b) => Some(brand_name(b).to_string()),
        Err(e) => {
            omit("brand", Level::INFO, format!("nvmlDeviceGetBrand: {e}"));
            None
        }
    };
    let architecture = match architecture.as_ref().ok().and_then(architecture_name) {
        Some(name) => Some(name),
        None => {
            let from_cc = architecture_from_cc(cc);
            if from_cc.is_none() {
                let nvml = match &architecture {
                    Ok(a) => format!("{a:?}"),
                    Err(e) => e.to_string(),
                };
                omit(
                    "architecture",
                    Level::INFO,
                    format!("NVML says {nvml}, and compute capability {cc} names none"),
                );
            }
            from_cc
        }
    }
    .map(String::from);

    // The SM count: the device's attributes (as for MIG devices), else CUDA cores per SM of the
    // architecture; never a made-up 0.
    let cores = cuda_cores
        .as_ref()
        .ok()
        .filter(|&&c| c > 0)
        .zip(cores_per_sm(cc));
    let multiprocessors = match (&attributes, cores) {
        (Ok(a), _) if a.multiprocessor_count > 0 => Some(a.multiprocessor_count),
        (_, Some((cores, per_sm))) => Some(cores / per_sm),
        _ => {
            let attrs = match &attributes {
                Ok(a) => format!("{} multiprocessors", a.multiprocessor_count),
                Err(e) => e.to_string(),
            };
            let cores = match &cuda_cores {
                Ok(c) => format!("{c} cores at compute capability {cc}"),
                Err(e) => e.to_string(),
            };
            omit(
                "multiprocessors",
                Level::WARN,
                format!("nvmlDeviceGetAttributes_v2: {attrs}; nvmlDeviceGetNumGpuCores: {cores}"),
            );
            None
        }
    };

    let pcie_root = sysfs
        .pci_device_link(&pci_bus_id)
        .and_then(|p| pcie_root_of(&p));
    if pcie_root.is_none() {
        debug!(gpu.index = index, bus = %pci_bus_id, "no PCIe root in sysfs for this GPU");
    }
    // Sysfs first: it is the CPU-side locality the kubelet's topology manager uses. NVML's NUMA
    // id is the GPU memory's own node on coherent platforms (Grace Hopper) — a fallback only.
    let numa_node = match sysfs.pci_numa_node(&pci_bus_id) {
        Some(text) => parse_numa(&text),
        None => numa_node.ok(),
    };

    let mig = map_mig(
        (index, &gpu),
        mig_mode,
        &gi_profiles,
        mig_devices,
        memory_bytes,
        notes,
    );
    let engines = gi_profiles
        .iter()
        .max_by_key(|p| (p.info.slice_count, p.info.memory_size_mb))
        .map(|p| profile_engines(&p.info))
        .unwrap_or_default();

    let nvlink_peers = fabric::map_nvlinks((index, &gpu), &pci_bus_id, &nvlinks, node_buses, notes);
    let fabric = fabric::map_fabric((index, &gpu), fabric, notes);

    Some(Gpu {
        index,
        minor,
        uuid: gpu,
        product_name,
        brand,
        architecture,
        cuda_compute_capability: cc,
        driver_version: versions.driver.clone(),
        cuda_driver_version: versions.cuda.clone(),
        memory_bytes,
        multiprocessors,
        engines,
        pci_bus_id,
        pcie_root,
        numa_node,
        mig,
        nvlink_peers,
        nvlink_domain: index,
        fabric,
        health: Health::Healthy,
    })
}

fn map_mig(
    (index, parent): (u32, &GpuUuid),
    mode: RawResult<RawMigMode>,
    profiles: &[RawGiProfile],
    devices: Vec<RawMigDevice>,
    total_bytes: u64,
    notes: &mut Vec<Omission>,
) -> Mig {
    let parent_uuid = parent.as_str();
    let mode = match mode {
        Ok(m) => m,
        // A driver without the MIG API predates MIG: under it no GPU is MIG-capable.
        Err(CallError::NotSupported | CallError::Missing(_)) => return Mig::default(),
        Err(e) => {
            notes.push(Omission {
                gpu_index: index,
                gpu: parent.clone(),
                field: "migCapable",
                reason: format!("nvmlDeviceGetMigMode: {e}; the GPU is handled as not in MIG mode"),
                level: Level::WARN,
            });
            return Mig {
                mode_unknown: true,
                ..Mig::default()
            };
        }
    };
    if mode.pending != mode.current {
        warn!(
            gpu.index = index,
            current = mode.current,
            pending = mode.pending,
            "MIG mode change is pending; it takes effect after a GPU reset or reboot"
        );
    }
    let mut memory_slices = 0;
    let mut mig_profiles = Vec::with_capacity(profiles.len());
    for p in profiles {
        let mut placements = match &p.placements {
            Ok(v) => v.clone(),
            Err(e) => {
                debug!(gpu.index = index, profile = p.info.id, error = %e, "MIG placements unknown");
                Vec::new()
            }
        };
        placements.sort();
        placements.dedup();
        for pl in &placements {
            memory_slices = memory_slices.max(pl.start + pl.size);
        }
        mig_profiles.push(MigProfile {
            name: mig_profile_name(
                Some(p.profile),
                p.info.slice_count,
                0,
                p.info.memory_size_mb,
                total_bytes,
            ),
            gi_profile_id: p.info.id,
            memory_bytes: p.info.memory_size_mb * MIB,
            multiprocessors: p.info.multiprocessor_count,
            engines: profile_engines(&p.info),
            max_instances: p.info.instance_count,
            placements,
        });
    }

    let mut mig_devices = Vec::new();
    if mode.current {
        for d in devices {
            if let Some(m) = map_mig_device(index, parent_uuid, d, profiles, total_bytes) {
                mig_devices.push(m);
            }
        }
    } else if !devices.is_empty() {
        debug!(
            gpu.index = index,
            "MIG devices reported while MIG mode is off; ignoring them"
        );
    }
    mig_devices.sort_by_key(|m| (m.placement, m.gi_id, m.ci_id));
    // Existing instances count too, should the profiles' placements be unreadable.
    for d in &mig_devices {
        memory_slices = memory_slices.max(d.placement.start + d.placement.size);
    }

    Mig {
        capable: true,
        mode_unknown: false,
        enabled: mode.current,
        memory_slices,
        devices: mig_devices,
        profiles: mig_profiles,
    }
}

fn map_mig_device(
    index: u32,
    parent_uuid: &str,
    raw: RawMigDevice,
    profiles: &[RawGiProfile],
    total_bytes: u64,
) -> Option<MigDevice> {
    let RawMigDevice {
        slot,
        uuid,
        attributes,
        gi_id,
        ci_id,
        gpu_instance,
    } = raw;
    let uuid = match uuid {
        Ok(u) => u,
        Err(e) => {
            warn!(gpu.index = index, gpu.uuid = parent_uuid, slot, error = %e, "skipping MIG device: no UUID");
            return None;
        }
    };
    let skip = |what: &str, e: &CallError| {
        warn!(gpu.index = index, mig.uuid = %uuid, error = %e, "skipping MIG device {uuid}: {what} unknown");
    };
    let gi_id = gi_id.map_err(|e| skip("GPU instance id", &e)).ok()?;
    let ci_id = ci_id.map_err(|e| skip("compute instance id", &e)).ok()?;
    let gi = gpu_instance
        .map_err(|e| skip("GPU instance placement", &e))
        .ok()?;
    let attributes = attributes
        .map_err(|e| debug!(mig.uuid = %uuid, error = %e, "MIG device attributes unknown"))
        .ok();
    let ci_slices = attributes
        .as_ref()
        .map_or(0, |a| a.compute_instance_slice_count);
    let profile = profiles.iter().find(|p| p.info.id == gi.profile_id);

    let (name, memory_bytes, profile_sms, profile_engines_) = match (profile, &attributes) {
        (Some(p), _) => (
            mig_profile_name(
                Some(p.profile),
                p.info.slice_count,
                ci_slices,
                p.info.memory_size_mb,
                total_bytes,
            ),
            p.info.memory_size_mb * MIB,
            p.info.multiprocessor_count,
            profile_engines(&p.info),
        ),
        (None, Some(a)) => {
            warn!(mig.uuid = %uuid, gi.profile_id = gi.profile_id, "GPU-instance profile not among the GPU's profiles; naming it from the device's attributes");
            (
                mig_profile_name(
                    None,
                    a.gpu_instance_slice_count,
                    ci_slices,
                    a.memory_size_mb,
                    total_bytes,
                ),
                a.memory_size_mb * MIB,
                a.multiprocessor_count,
                attribute_engines(a),
            )
        }
        (None, None) => {
            skip(
                "profile",
                &CallError::Failed(format!(
                    "GPU-instance profile id {} is not among the GPU's profiles and the device has no attributes",
                    gi.profile_id
                )),
            );
            return None;
        }
    };

    Some(MigDevice {
        uuid: MigUuid(uuid),
        profile: name,
        gi_profile_id: gi.profile_id,
        gi_id,
        ci_id,
        placement: gi.placement,
        memory_bytes,
        multiprocessors: attributes
            .as_ref()
            .map_or(profile_sms, |a| a.multiprocessor_count),
        engines: attributes
            .as_ref()
            .map_or(profile_engines_, attribute_engines),
        health: Health::Healthy,
    })
}

#[cfg(test)]
mod tests;
