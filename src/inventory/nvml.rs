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
//! Prepare's reconfigurations (`nvml/reconfigure.rs`): MIG devices created at a placement and
//! destroyed through NVML's GPU- and compute-instance calls, and time slices set with the driver
//! root's `nvidia-smi` (NVML has no call for them); `DeviceBackend::unavailable` says which of
//! them the loaded library and driver root allow.
//!
//! nvml-wrapper 0.13 does not wrap the MIG identity calls (GPU/compute-instance ids, GPU-instance
//! info), MIG creation and destruction, the per-cgroup memory limits of R615, nor the fabric
//! registration, and its `possible_placements` and
//! `NvLink::remote_device_type` return nothing useful (the first never sets the vector's length,
//! the second writes into a temporary). Those calls go through the raw symbol table in the private
//! `ffi` module (`nvml/ffi.rs`), the only `unsafe` code here, using the `Result` fields of
//! `nvml.lib()`, so a driver without a symbol yields an error value instead of a panic.

mod backend;
mod capture;
mod events;
mod fabric;
mod ffi;
mod mapping;
mod names;
mod reconfigure;
mod sysfs;
mod usage;

use crate::inventory::Placement;
pub use backend::{NvmlBackend, Omission};
use capture::raw;
pub use capture::{
    CallError, RawGiProfile, RawGpu, RawGpuInstance, RawMigDevice, RawMigMode, RawNode, RawResult,
    read_raw,
};
pub use fabric::{FabricState, RawFabric, RawNvLink, RawPci, RemoteDevice};
pub use mapping::{map, map_with_omissions};
pub use names::{
    architecture_from_cc, architecture_name, brand_name, format_cuda_version, mig_memory_gb,
    mig_profile_name,
};
pub use sysfs::{HostSysfs, Sysfs, pcie_root_of};
pub use usage::read_usage;

/// Per-cgroup memory limits (MPS v3 memory partitioning), for nvdra's container hook
/// (`cdi::memlimit`): the raw calls, on a library the hook loads itself.
pub mod memory_limits {
    pub use super::ffi::{GET_MEMORY_LIMITS, SET_MEMORY_LIMITS, memory_limits, set_memory_limits};
}

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

#[cfg(test)]
mod tests;
