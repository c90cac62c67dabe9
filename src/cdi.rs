//! Container Device Interface (CDI) specs for prepared claims: the model, a builder and an
//! atomic writer.
//!
//! A prepared claim becomes one spec file `<cdi root>/<vendor>-<class>_<claimUID>.yaml` (vendor
//! `k8s.<driver>`, class `claim`, as NVIDIA's driver writes it), with one CDI device per
//! prepared device named `<claimUID>-<device>`. The kubelet hands the runtime the ids
//! `<vendor>/<class>=<claimUID>-<device>` ([`device_id`]); the runtime applies the device's
//! edits plus the spec-wide edits.
//!
//! What goes where:
//! - **Per device**: the device nodes — `/dev/nvidia<minor>` and the GPU's DRM nodes
//!   (`/dev/dri/card<N>`, `renderD<N>`, with a `create-symlinks` hook for their `/dev/dri/by-path`
//!   links when a hook binary is installed), of the parent for a MIG device, and for a MIG device its
//!   GPU-instance and compute-instance capability nodes `/dev/nvidia-caps/nvidia-cap<N>`
//!   (described by number from procfs as NVIDIA's DRA driver writes them, else the host's nodes
//!   through `mig-minors`).
//!   Nothing that could conflict when several devices of one claim are injected together.
//! - **Spec-wide** (applied once whenever any device of the claim is injected): the control nodes
//!   (`/dev/nvidiactl`, `/dev/nvidia-uvm`, `/dev/nvidia-uvm-tools`, `/dev/nvidia-modeset`, each
//!   when present), read-only bind mounts of the driver's libraries, firmware and binaries and
//!   mounts of its IPC sockets (found as NVIDIA's CDI library finds them, `driver`), its
//!   graphics and display files (`graphics`), NVIDIA's
//!   `createContainer` hooks when `nvidia-cdi-hook` or `nvidia-ctk` is installed (`builder`), the
//!   MPS environment and `NVIDIA_VISIBLE_DEVICES=void`.
//!
//! Host paths and read paths: the spec names host paths, under `--driver-root`; nvdra reads the
//! same files where that root is mounted in its own container (`--driver-root-ctr-path`), see
//! [`DriverRoot`].
//!
//! `NVIDIA_VISIBLE_DEVICES=void`, spec-wide, as NVIDIA's driver writes it: the devices a container
//! gets are the CDI devices the kubelet names, never a list in the environment. A list would be
//! claim-wide (CDI concatenates the env of every injected device and the last assignment wins),
//! so a container that uses one request of a two-request claim would be told about the other
//! request's GPU too, and NVIDIA's runtime in its legacy mode (common on GPU Operator nodes) would
//! inject that GPU. `void` makes that runtime inject nothing on top of CDI.
//!
//! Invariants:
//! - Every vendor, class and device name is checked against the CDI grammar before a spec is
//!   produced; a claim UID reaches the writer as a [`ClaimUid`](crate::ids::ClaimUid), valid by
//!   construction, before it becomes part of a file name.
//! - The builder only reads the host (which nodes exist, their major/minor, the MIG capability
//!   table); it never writes. Output is deterministic: same inputs, same bytes.
//! - The writer replaces a spec atomically (temp file in the same directory, fsync, rename, fsync
//!   directory, through [`crate::durable`]), so a runtime scanning the directory never sees a
//!   partial spec, and a crash leaves either the old or the new file. Temp files start with `.`
//!   and end in `.tmp`, which CDI registries ignore, and are removed on failure.

use std::io;
use std::path::PathBuf;

/// The spec-wide env of a claim spec (see the module docs).
pub const VISIBLE_DEVICES_VOID: &str = "NVIDIA_VISIBLE_DEVICES=void";
/// The CDI spec version written; every feature used here exists in 0.5.0.
pub const CDI_VERSION: &str = "0.5.0";
/// Where a claim's MPS pipe directory appears inside containers.
pub const MPS_PIPE_CONTAINER_DIR: &str = "/tmp/nvidia-mps";
/// Where an MPS client sees its daemon's shared-memory directory: MPS clients and their server
/// exchange memory through `/dev/shm`, so both must see the same one (NVIDIA's two stacks mount
/// one tmpfs there into the daemon and every client).
pub const MPS_SHM_CONTAINER_DIR: &str = "/dev/shm";
/// The NVIDIA character device major (fixed by the driver); used when a GPU node is absent.
pub const NVIDIA_MAJOR: i64 = 195;
/// Options of the read-only driver file mounts, as NVIDIA writes them.
pub const READ_ONLY_MOUNT: [&str; 5] = ["ro", "nosuid", "nodev", "rbind", "rprivate"];
/// Options of the IPC socket mounts, as NVIDIA writes them (writable: clients talk over them).
pub const IPC_MOUNT: [&str; 5] = ["nosuid", "nodev", "rbind", "rprivate", "noexec"];

/// Control device nodes every GPU container needs, each included only when present.
const CONTROL_NODES: [&str; 4] = [
    "nvidiactl",
    "nvidia-uvm",
    "nvidia-uvm-tools",
    "nvidia-modeset",
];

/// A CDI problem.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid CDI {what} {value:?}: {rule}")]
    InvalidName {
        what: &'static str,
        value: String,
        rule: &'static str,
    },
    #[error("claim {claim_uid} has no devices to put in a CDI spec")]
    NoDevices { claim_uid: String },
    #[error("claim {claim_uid} lists device {device} twice")]
    DuplicateDevice { claim_uid: String, device: String },
    #[error("claim {claim_uid}: {message}")]
    Mps { claim_uid: String, message: String },
    #[error("cannot {action} {path}")]
    Io {
        action: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    #[error(transparent)]
    Write(#[from] crate::durable::Error),
    #[error("cannot serialize the CDI spec of kind {kind}")]
    Serialize {
        kind: String,
        source: crate::yaml::WriteError,
    },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

mod binary;
mod builder;
mod driver;
pub mod gate;
mod graphics;
mod inputs;
mod lookup;
pub mod memlimit;
mod spec;
pub mod toolkit;

pub use binary::{OciState, install_hook};
pub use builder::{claim_spec, device_id};
pub use driver::{DriverFiles, discover_driver_files};
pub use graphics::FileMount;
pub use inputs::{CdiOptions, DriverRoot, PreparedDevice, existing_node, host_node};
pub use lookup::Symlink;
pub use spec::{
    ContainerEdits, Device, DeviceNode, Hook, Mount, Spec, list_claim_specs, remove_spec,
    spec_path, validate_class, validate_device_name, validate_vendor, write_spec, write_spec_text,
};

#[cfg(test)]
mod tests;
