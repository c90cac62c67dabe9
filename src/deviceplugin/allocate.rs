//! What one container gets for the device IDs the kubelet allocated to it, per list strategy,
//! as NVIDIA's plugin answers (reference §3):
//! - `envvar`: `NVIDIA_VISIBLE_DEVICES=<id>,<id>` (IDs without the replica suffix, de-duplicated,
//!   in request order);
//! - `volume-mounts`: `NVIDIA_VISIBLE_DEVICES=/var/run/nvidia-container-devices` and one `/dev/null`
//!   mount per device under that directory;
//! - `cdi-annotations`: one `<prefix>nvidia-device-plugin_<uuid>` annotation listing the CDI names;
//! - `cdi-cri`: the CDI names in `cdi_devices`.
//!
//! When every selected strategy is a CDI one, nothing else is added (no `NVIDIA_VISIBLE_DEVICES`,
//! no device specs). In every strategy, each enabled extra driver capability
//! (`flags.gdrcopyEnabled`, `gdsEnabled`, `mofedEnabled`) adds `NVIDIA_<MODE>=enabled`, and in
//! the CDI strategies also its `<vendor>/<mode>=all` CDI device when the host has the mode's
//! nodes — as NVIDIA's plugin does.
//!
//! MPS sharing adds the pipe directory of NVIDIA's MPS control daemon and `/dev/shm`, as
//! NVIDIA's plugin does, and — beyond it — the per-client limits that NVIDIA's MPS control
//! daemon sets only as daemon-wide defaults (reference §3.3): `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE
//! = 100 / replicas` and `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT = <index>=<memory MiB / replicas>M` per
//! GPU, the same integer arithmetic as the daemon's `set_default_active_thread_percentage` and
//! `set_default_device_pinned_mem_limit`. The values equal the daemon's defaults, so a container
//! gets the share it would get from NVIDIA's daemon, and keeps it under a daemon started without
//! those defaults.
//!
//! `nvidia.com/gpu-memory` (nvdra's extension): `k` units of one GPU give the container that GPU
//! (as any device, per strategy) and `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=<k>G`, which CUDA
//! enforces where an MPS control daemon serves the GPU.
//!
//! The limit is keyed by the device's index as the container's CUDA sees it, never by UUID:
//! NVIDIA's device plugin made that change in v0.15.0 because "these limits are not applied for
//! devices if set by UUID". A container's GPUs are numbered from 0 in host index order (NVML's
//! index follows the PCI bus, the order CUDA gives identical GPUs); one GPU is index 0. Units of several GPUs in one request are
//! refused: a process's memory share is per GPU, and a pod asking for `k` GiB means one GPU.
//!
//! A request with an unknown or unhealthy ID, more than one replica where
//! `failRequestsGreaterThanOne`, or GPU-memory units of several GPUs, fails with a message naming
//! the IDs and the rule.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::cdi::CdiOptions;

use super::resources::Resource;
use super::{ListStrategy, Options, ShareKind};

/// Where volume-mount device lists appear in the container.
pub const VOLUME_MOUNT_DIR: &str = "/var/run/nvidia-container-devices";

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    #[error("no device IDs requested for {resource}")]
    Empty { resource: String },
    #[error("unknown device IDs for {resource}: {}", ids.join(", "))]
    Unknown { resource: String, ids: Vec<String> },
    #[error("unhealthy device IDs for {resource}: {}", ids.join(", "))]
    Unhealthy { resource: String, ids: Vec<String> },
    #[error(
        "invalid request for {resource}: maximum request size for shared resources is 1; found {found} ({}); failRequestsGreaterThanOne is set",
        ids.join(", ")
    )]
    TooManyShared {
        resource: String,
        found: usize,
        ids: Vec<String>,
    },
    #[error(
        "invalid request for {resource}: the units of one container must come from one GPU, but they span {}; request at most one GPU's memory",
        gpus.join(", ")
    )]
    MemorySpansGpus { resource: String, gpus: Vec<String> },
}

/// A mount for the container.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MountSpec {
    pub container_path: String,
    pub host_path: String,
    pub read_only: bool,
}

/// A device node for the container.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceSpec {
    pub container_path: String,
    pub host_path: String,
    pub permissions: String,
}

/// What one container gets.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ContainerAllocation {
    pub envs: BTreeMap<String, String>,
    pub mounts: Vec<MountSpec>,
    pub devices: Vec<DeviceSpec>,
    pub annotations: BTreeMap<String, String>,
    pub cdi_devices: Vec<String>,
}

/// What Allocate needs besides the resource.
#[derive(Clone, Debug)]
pub struct Context {
    pub options: Options,
    /// The CDI kind of the device-plugin spec, `<vendor>/<class>` (see [`super::cdi`]).
    pub cdi_kind: String,
    /// The host directory of the `nvidia*` device nodes (for `passDeviceSpecs`).
    pub dev_root: PathBuf,
    /// The `<vendor>/<mode>=all` CDI devices of the enabled driver modes that have a spec, in
    /// [`super::DriverMode::ALL`] order.
    pub cdi_modes: Vec<String>,
}

impl Context {
    /// The context for `options` with the CDI names of `cdi`; reads the host for the driver
    /// modes' device nodes (blocking, a few `readdir`s) when a CDI strategy is selected.
    pub fn new(options: Options, cdi: &CdiOptions) -> Context {
        let cdi_modes = if options.list_strategies.iter().any(|s| s.is_cdi()) {
            options
                .modes
                .iter()
                .filter(|m| super::cdi::mode_spec(cdi, **m).is_some())
                .map(|m| super::cdi::mode_device(cdi, *m))
                .collect()
        } else {
            Vec::new()
        };
        Context {
            options,
            cdi_kind: cdi.kind(),
            dev_root: cdi.dev_root.clone(),
            cdi_modes,
        }
    }
}

/// Control nodes passed with `passDeviceSpecs`, each only when present.
const CONTROL_NODES: [&str; 4] = [
    "nvidiactl",
    "nvidia-uvm",
    "nvidia-uvm-tools",
    "nvidia-modeset",
];

/// Checks `ids` against `resource` and builds the container's response.
pub fn allocate(
    resource: &Resource,
    ids: &[String],
    ctx: &Context,
) -> Result<ContainerAllocation, Error> {
    let name = resource.name.to_string();
    if ids.is_empty() {
        return Err(Error::Empty { resource: name });
    }
    let unknown: Vec<String> = ids
        .iter()
        .filter(|id| resource.device(id).is_none())
        .cloned()
        .collect();
    if !unknown.is_empty() {
        return Err(Error::Unknown {
            resource: name,
            ids: unknown,
        });
    }
    let devices: Vec<_> = ids.iter().filter_map(|id| resource.device(id)).collect();
    let unhealthy: Vec<String> = devices
        .iter()
        .filter(|d| !d.health.is_healthy())
        .map(|d| d.id.clone())
        .collect();
    if !unhealthy.is_empty() {
        return Err(Error::Unhealthy {
            resource: name,
            ids: unhealthy,
        });
    }
    if resource.fail_requests_greater_than_one
        && ids.len() > 1
        && devices.iter().any(|d| d.replica.is_some())
    {
        return Err(Error::TooManyShared {
            resource: name,
            found: ids.len(),
            ids: ids.to_vec(),
        });
    }
    // Unique physical devices, in request order.
    let mut unique: Vec<&super::resources::Device> = Vec::new();
    for d in &devices {
        if !unique.iter().any(|u| u.base == d.base) {
            unique.push(d);
        }
    }
    if resource.memory_units() && unique.len() > 1 {
        return Err(Error::MemorySpansGpus {
            resource: name,
            gpus: unique.iter().map(|d| d.base.clone()).collect(),
        });
    }
    let bases: Vec<&str> = unique.iter().map(|d| d.base.as_str()).collect();
    let opts = &ctx.options;
    let mut out = ContainerAllocation::default();

    let cdi_names: Vec<String> = bases
        .iter()
        .map(|b| format!("{}={b}", ctx.cdi_kind))
        .chain(ctx.cdi_modes.iter().cloned())
        .collect();
    if opts.list_strategies.contains(&ListStrategy::CdiAnnotations) {
        let key = format!(
            "{}nvidia-device-plugin_{}",
            opts.cdi_annotation_prefix,
            random_uuid()
        );
        out.annotations.insert(key, cdi_names.join(","));
    }
    if opts.list_strategies.contains(&ListStrategy::CdiCri) {
        out.cdi_devices = cdi_names;
    }
    if !opts.list_strategies.iter().all(|s| s.is_cdi()) {
        if opts.list_strategies.contains(&ListStrategy::Envvar) {
            out.envs
                .insert("NVIDIA_VISIBLE_DEVICES".into(), bases.join(","));
        }
        if opts.list_strategies.contains(&ListStrategy::VolumeMounts) {
            out.envs
                .insert("NVIDIA_VISIBLE_DEVICES".into(), VOLUME_MOUNT_DIR.into());
            for b in &bases {
                out.mounts.push(MountSpec {
                    container_path: format!("{VOLUME_MOUNT_DIR}/{b}"),
                    host_path: "/dev/null".into(),
                    read_only: false,
                });
            }
        }
        if opts.pass_device_specs {
            out.devices = device_specs(&ctx.dev_root, &unique);
        }
    }
    for mode in &opts.modes {
        out.envs.insert(mode.env().into(), "enabled".into());
    }
    if let [_gpu] = unique[..]
        && resource.memory_units()
    {
        let mut units: Vec<&str> = ids.iter().map(String::as_str).collect();
        units.sort_unstable();
        units.dedup();
        // The container sees this one GPU, as index 0.
        out.envs.insert(
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT".into(),
            format!("0={}G", units.len()),
        );
    }
    if let (Some(sharing), Some(root)) = (&opts.sharing, &opts.mps_root)
        && sharing.kind == ShareKind::Mps
        && resource.replicated()
    {
        mps_limits(&unique, &mut out.envs);
        let dir = format!("/mps/{name}/pipe");
        out.envs
            .insert("CUDA_MPS_PIPE_DIRECTORY".into(), dir.clone());
        out.mounts.push(MountSpec {
            container_path: dir,
            host_path: format!("{root}/{name}/pipe"),
            read_only: false,
        });
        out.mounts.push(MountSpec {
            container_path: "/dev/shm".into(),
            host_path: format!("{root}/shm"),
            read_only: false,
        });
    }
    Ok(out)
}

/// The MPS client limits for the replicated devices among `unique`: the active-thread
/// percentage of the most-shared one (one value per container), and each GPU's pinned-memory
/// share keyed by its index in the container ([`container_indices`]).
fn mps_limits(unique: &[&super::resources::Device], envs: &mut BTreeMap<String, String>) {
    let indexed = container_indices(unique);
    let shared: Vec<_> = indexed
        .iter()
        .filter(|(_, d)| d.replica.is_some())
        .collect();
    let Some(replicas) = shared.iter().map(|(_, d)| d.replicas.max(1)).max() else {
        return;
    };
    envs.insert(
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE".into(),
        (100 / replicas).to_string(),
    );
    let limits: Vec<String> = shared
        .iter()
        .map(|(index, d)| {
            format!(
                "{index}={}M",
                (d.memory_bytes >> 20) / u64::from(d.replicas.max(1))
            )
        })
        .collect();
    envs.insert("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT".into(), limits.join(","));
}

/// Each of a container's devices with its index as the container's CUDA numbers it: from 0, in
/// host index order (MIG devices of one GPU by placement), in which the limits are keyed.
fn container_indices<'a>(
    unique: &[&'a super::resources::Device],
) -> Vec<(usize, &'a super::resources::Device)> {
    let mut sorted = unique.to_vec();
    sorted.sort_by_key(|d| (d.gpu_index, d.placement.map(|p| p.start)));
    sorted.into_iter().enumerate().collect()
}

/// The control nodes that exist under `dev_root`, then `/dev/nvidia<minor>` of each device's GPU
/// (a MIG device's capability nodes are not passed: use a CDI strategy for MIG).
fn device_specs(dev_root: &Path, devices: &[&super::resources::Device]) -> Vec<DeviceSpec> {
    let spec = |name: &str| DeviceSpec {
        container_path: format!("/dev/{name}"),
        host_path: dev_root.join(name).display().to_string(),
        permissions: "rw".into(),
    };
    let mut out: Vec<DeviceSpec> = CONTROL_NODES
        .iter()
        .filter(|n| dev_root.join(n).exists())
        .map(|n| spec(n))
        .collect();
    for d in devices {
        let s = spec(&format!("nvidia{}", d.minor));
        if !out.contains(&s) {
            out.push(s);
        }
    }
    out
}

/// A random version-4 UUID, as NVIDIA's plugin keys its CDI annotations.
fn random_uuid() -> String {
    let mut b: [u8; 16] = rand::random();
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    crate::inventory::ClusterUuid::from_bytes(b).to_string()
}
