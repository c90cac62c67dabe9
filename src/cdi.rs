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
//! - **Per device**: the device nodes only — `/dev/nvidia<minor>` and, for a MIG device, its
//!   GPU-instance and compute-instance capability nodes `/dev/nvidia-caps/nvidia-cap<N>`.
//!   Nothing that could conflict when several devices of one claim are injected together.
//! - **Spec-wide** (applied once whenever any device of the claim is injected): the control nodes
//!   (`/dev/nvidiactl`, `/dev/nvidia-uvm`, `/dev/nvidia-uvm-tools`, `/dev/nvidia-modeset`, each
//!   when present), read-only bind mounts of the driver's libraries and binaries, an
//!   `update-ldcache` hook when `nvidia-cdi-hook` is installed, the MPS environment and
//!   `NVIDIA_VISIBLE_DEVICES`.
//!
//! `NVIDIA_VISIBLE_DEVICES`: NVIDIA's driver sets it to `void` so that a legacy NVIDIA runtime
//! hook injects nothing on top of CDI. nvdra sets it to the comma-separated UUIDs of the claim's
//! devices instead, because workloads and tools read it to learn which GPUs they were given. It
//! is claim-level and not per device because CDI concatenates the env of all injected devices and
//! the last assignment wins: per-device values would leave only one UUID. The price: a container
//! that references only one request of a multi-request claim still sees every UUID of the claim
//! (its device nodes are still only its own), and a node that also runs the legacy NVIDIA runtime
//! hook in `legacy` mode would inject the listed GPUs too — run that hook in `cdi` mode.
//!
//! Invariants:
//! - Every vendor, class and device name is checked against the CDI grammar before a spec is
//!   produced; a claim UID is checked before it becomes part of a file name.
//! - The builder only reads the host (which nodes exist, their major/minor, the MIG capability
//!   table); it never writes. Output is deterministic: same inputs, same bytes.
//! - The writer replaces a spec atomically (temp file in the same directory, fsync, rename, fsync
//!   directory, through [`crate::durable`]), so a runtime scanning the directory never sees a
//!   partial spec, and a crash leaves either the old or the new file. Temp files start with `.`
//!   and end in `.tmp`, which CDI registries ignore, and are removed on failure.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::inventory::{Gpu, MigDevice};
use crate::sharing::{MpsSettings, Sharing};

/// The CDI spec version written; every feature used here exists in 0.5.0.
pub const CDI_VERSION: &str = "0.5.0";
/// Where a claim's MPS pipe directory appears inside containers.
pub const MPS_PIPE_CONTAINER_DIR: &str = "/tmp/nvidia-mps";
/// The NVIDIA character device major (fixed by the driver); used when a GPU node is absent.
pub const NVIDIA_MAJOR: i64 = 195;
/// Options of the read-only driver file mounts, as NVIDIA writes them.
pub const READ_ONLY_MOUNT: [&str; 5] = ["ro", "nosuid", "nodev", "rbind", "rprivate"];

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

fn io_err<'a>(action: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> Error + 'a {
    move |source| Error::Io {
        action,
        path: path.to_path_buf(),
        source,
    }
}

// ---------------------------------------------------------------------------------------------
// Names

const VENDOR_RULE: &str = "a vendor starts with a letter, ends with a letter or digit, and \
                           contains only letters, digits, '_', '.' and '-'";
const CLASS_RULE: &str = "a class starts with a letter, ends with a letter or digit, and contains \
                          only letters, digits, '_' and '-'";
const NAME_RULE: &str = "a device name starts and ends with a letter or digit and contains only \
                         letters, digits, '_', '.', ':' and '-'";

/// Whether `value` is `first middle* last` (last a letter or digit); a single character passes
/// only when `single_ok` (device names allow it, vendors and classes do not).
fn matches_grammar(
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

fn invalid(what: &'static str, value: &str, rule: &'static str) -> Error {
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

fn is_device_name(name: &str) -> bool {
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
fn validate_claim_uid(claim_uid: &str) -> Result<()> {
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

// ---------------------------------------------------------------------------------------------
// Options and inputs

/// Where CDI names and host paths come from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CdiOptions {
    /// `k8s.<driver>`.
    pub vendor: String,
    /// `claim`.
    pub class: String,
    /// The host directory holding the driver's user-space files (`/` on most nodes,
    /// `/run/nvidia/driver` with the driver container).
    pub driver_root: PathBuf,
    /// The host directory holding the `nvidia*` device nodes; see [`resolve_dev_root`].
    pub dev_root: PathBuf,
}

impl CdiOptions {
    /// Options for `driver` (e.g. `gpu.nvidia.com`): vendor `k8s.<driver>`, class `claim`, the
    /// device root found under `driver_root`. Fails when the vendor is not a valid CDI vendor.
    pub fn resolve(driver: &str, driver_root: &Path) -> Result<Self> {
        let opts = Self {
            vendor: format!("k8s.{driver}"),
            class: "claim".into(),
            driver_root: driver_root.to_path_buf(),
            dev_root: resolve_dev_root(driver_root),
        };
        validate_vendor(&opts.vendor)?;
        validate_class(&opts.class)?;
        Ok(opts)
    }

    /// The spec's `kind`, `<vendor>/<class>`.
    pub fn kind(&self) -> String {
        format!("{}/{}", self.vendor, self.class)
    }
}

/// `<driver_root>/dev` when it exists (a driver container exposes its nodes there), else `/dev`.
pub fn resolve_dev_root(driver_root: &Path) -> PathBuf {
    let candidate = driver_root.join("dev");
    if candidate.is_dir() {
        candidate
    } else {
        PathBuf::from("/dev")
    }
}

/// One device of a claim, ready to be described in the claim's spec.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PreparedDevice {
    /// The published device name: `gpu-0` or a MIG device name.
    pub name: String,
    /// The GPU, or the MIG device's parent.
    pub gpu: Gpu,
    pub mig: Option<MigDevice>,
    pub sharing: Sharing,
    /// The host directory of the claim's MPS control daemon pipes (required for MPS sharing).
    pub mps_pipe_dir: Option<PathBuf>,
}

impl PreparedDevice {
    /// The UUID the container uses for this device (the MIG UUID for MIG devices).
    pub fn uuid(&self) -> &str {
        match &self.mig {
            Some(m) => m.uuid.as_str(),
            None => self.gpu.uuid.as_str(),
        }
    }
}

/// The driver's user-space files to mount into containers (host paths under the driver root).
///
/// A binary named `nvidia-cdi-hook` is not mounted: it is used for the `update-ldcache` hook.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DriverFiles {
    pub libraries: Vec<PathBuf>,
    pub binaries: Vec<PathBuf>,
}

/// Library directories searched under the driver root, in order.
const LIB_DIRS: [&str; 7] = [
    "usr/lib/x86_64-linux-gnu",
    "usr/lib/aarch64-linux-gnu",
    "usr/lib64",
    "usr/lib",
    "lib/x86_64-linux-gnu",
    "lib/aarch64-linux-gnu",
    "lib64",
];
/// Binary directories searched under the driver root.
const BIN_DIRS: [&str; 3] = ["usr/bin", "bin", "usr/sbin"];
/// The compute libraries a CUDA container needs (the `<name>.so.` prefix of their files).
const LIBRARIES: [&str; 14] = [
    "libcuda.so",
    "libcudadebugger.so",
    "libnvidia-ml.so",
    "libnvidia-ptxjitcompiler.so",
    "libnvidia-nvvm.so",
    "libnvidia-opencl.so",
    "libnvidia-gpucomp.so",
    "libnvidia-allocator.so",
    "libnvidia-cfg.so",
    "libnvidia-pkcs11.so",
    "libnvidia-pkcs11-openssl3.so",
    "libnvidia-nscq.so",
    "libnvidia-encode.so",
    "libnvcuvid.so",
];
const BINARIES: [&str; 6] = [
    "nvidia-smi",
    "nvidia-debugdump",
    "nvidia-persistenced",
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
    "nvidia-cdi-hook",
];
const CDI_HOOK: &str = "nvidia-cdi-hook";

/// Finds the driver's libraries (versioned files and soname links, e.g. `libcuda.so.550.163.01`
/// and `libcuda.so.1`) and binaries under `driver_root`. Directories reached twice through
/// symlinks (`/lib` → `/usr/lib`) are searched once. Sorted; missing directories are skipped.
pub fn discover_driver_files(driver_root: &Path) -> DriverFiles {
    let mut seen_dirs = BTreeSet::new();
    let mut scan = |dirs: &[&str], wanted: &dyn Fn(&str) -> bool| {
        let mut found = BTreeSet::new();
        for dir in dirs {
            let dir = driver_root.join(dir);
            let Ok(canonical) = dir.canonicalize() else {
                continue;
            };
            if !seen_dirs.insert(canonical) {
                continue;
            }
            let Ok(entries) = fs::read_dir(&dir) else {
                continue;
            };
            for entry in entries.flatten() {
                let name = entry.file_name();
                let Some(name) = name.to_str() else { continue };
                let path = entry.path();
                if wanted(name) && path.is_file() {
                    found.insert(path);
                }
            }
        }
        found.into_iter().collect::<Vec<_>>()
    };
    let libraries = scan(&LIB_DIRS, &|name| {
        LIBRARIES.iter().any(|lib| {
            name.strip_prefix(lib)
                .and_then(|rest| rest.strip_prefix('.'))
                .is_some_and(|version| !version.is_empty())
        })
    });
    let binaries = scan(&BIN_DIRS, &|name| BINARIES.contains(&name));
    DriverFiles {
        libraries,
        binaries,
    }
}

// ---------------------------------------------------------------------------------------------
// The spec model (field names and layout as in the CDI specification)

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

// ---------------------------------------------------------------------------------------------
// Builder

/// `<vendor>/<class>=<claimUID>-<device>`, the id the kubelet passes to the runtime.
pub fn device_id(opts: &CdiOptions, claim_uid: &str, device: &str) -> String {
    format!(
        "{}/{}={}",
        opts.vendor,
        opts.class,
        device_name(claim_uid, device)
    )
}

fn device_name(claim_uid: &str, device: &str) -> String {
    format!("{claim_uid}-{device}")
}

/// Builds the CDI spec of one prepared claim (see the module docs for what goes where).
///
/// Reads the host (device nodes under `dev_root`, the MIG capability table): blocking, so async
/// callers run it with `spawn_blocking`, like [`write_spec`].
pub fn claim_spec(
    opts: &CdiOptions,
    claim_uid: &str,
    devices: &[PreparedDevice],
    driver_files: &DriverFiles,
) -> Result<Spec> {
    validate_vendor(&opts.vendor)?;
    validate_class(&opts.class)?;
    validate_claim_uid(claim_uid)?;
    if devices.is_empty() {
        return Err(Error::NoDevices {
            claim_uid: claim_uid.to_string(),
        });
    }

    let mut mig_minors: Option<Option<BTreeMap<String, u32>>> = None;
    let mut seen = BTreeSet::new();
    let mut cdi_devices = Vec::with_capacity(devices.len());
    for device in devices {
        let name = device_name(claim_uid, &device.name);
        validate_device_name(&name)?;
        if !seen.insert(name.clone()) {
            return Err(Error::DuplicateDevice {
                claim_uid: claim_uid.to_string(),
                device: device.name.clone(),
            });
        }
        let mut nodes = vec![gpu_node(opts, &device.gpu)];
        if let Some(mig) = &device.mig {
            let table = mig_minors.get_or_insert_with(|| read_mig_minors(&opts.driver_root));
            nodes.extend(mig_cap_nodes(
                opts,
                table.as_ref(),
                &device.gpu,
                mig,
                &device.name,
            ));
        }
        cdi_devices.push(Device {
            name,
            container_edits: ContainerEdits {
                device_nodes: nodes,
                ..Default::default()
            },
        });
    }

    let mut common = ContainerEdits::default();
    let uuids: Vec<&str> = devices.iter().map(PreparedDevice::uuid).collect();
    common
        .env
        .push(format!("NVIDIA_VISIBLE_DEVICES={}", uuids.join(",")));
    common.device_nodes = CONTROL_NODES
        .iter()
        .filter_map(|n| existing_node(&opts.dev_root.join(n), &format!("/dev/{n}")))
        .collect();
    driver_file_edits(opts, driver_files, &mut common);
    mps_edits(claim_uid, devices, &mut common)?;

    Ok(Spec {
        cdi_version: CDI_VERSION.into(),
        kind: opts.kind(),
        devices: cdi_devices,
        container_edits: common,
    })
}

/// The GPU's `/dev/nvidia<minor>`. Taken from the host node when it exists; otherwise (simulated
/// GPUs, or a node the driver has not created yet) described by the driver's fixed major and the
/// GPU's minor, so the runtime creates it in the container without a host node.
fn gpu_node(opts: &CdiOptions, gpu: &Gpu) -> DeviceNode {
    let path = format!("/dev/nvidia{}", gpu.minor);
    let host = opts.dev_root.join(format!("nvidia{}", gpu.minor));
    existing_node(&host, &path).unwrap_or_else(|| {
        tracing::warn!(
            gpu.uuid = %gpu.uuid,
            host_path = %host.display(),
            "GPU device node not found; the container gets a node {NVIDIA_MAJOR}:{} created by the runtime",
            gpu.minor
        );
        DeviceNode {
            path,
            host_path: None,
            node_type: Some("c".into()),
            major: Some(NVIDIA_MAJOR),
            minor: Some(i64::from(gpu.minor)),
            file_mode: Some(0o666),
            permissions: Some("rwm".into()),
        }
    })
}

/// A device node for `host` if it exists and is a device (symlinks are followed), with its type,
/// numbers and mode read from the host so dynamic majors (`nvidia-uvm`) are right.
fn existing_node(host: &Path, container_path: &str) -> Option<DeviceNode> {
    let meta = match fs::metadata(host) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return None,
        Err(e) => {
            tracing::warn!(path = %host.display(), error = %e, "cannot inspect device node; skipped");
            return None;
        }
    };
    let file_type = meta.file_type();
    let node_type = if file_type.is_char_device() {
        "c"
    } else if file_type.is_block_device() {
        "b"
    } else {
        tracing::warn!(path = %host.display(), "not a device node; skipped");
        return None;
    };
    let (major, minor) = split_dev(meta.rdev());
    Some(DeviceNode {
        path: container_path.to_string(),
        host_path: Some(host.display().to_string()),
        node_type: Some(node_type.into()),
        major: Some(major),
        minor: Some(minor),
        file_mode: Some(meta.mode() & 0o777),
        permissions: Some("rwm".into()),
    })
}

/// Linux (glibc) `dev_t` encoding, as `major(3)`/`minor(3)` decode it.
fn split_dev(dev: u64) -> (i64, i64) {
    let major = ((dev >> 8) & 0xfff) | ((dev >> 32) & 0xffff_f000);
    let minor = (dev & 0xff) | ((dev >> 12) & 0xffff_ff00);
    // Both are at most 32 bits wide after the masks, so they fit in i64.
    (major as i64, minor as i64)
}

/// `<driver_root>/proc/driver/nvidia-caps/mig-minors`: lines `gpu0/gi1/access 12`, `config 1`, ….
fn read_mig_minors(driver_root: &Path) -> Option<BTreeMap<String, u32>> {
    let path = driver_root.join("proc/driver/nvidia-caps/mig-minors");
    match fs::read_to_string(&path) {
        Ok(text) => Some(parse_mig_minors(&text)),
        Err(e) => {
            tracing::warn!(
                path = %path.display(),
                error = %e,
                "cannot read the MIG capability table; MIG devices get no capability nodes"
            );
            None
        }
    }
}

fn parse_mig_minors(text: &str) -> BTreeMap<String, u32> {
    text.lines()
        .filter_map(|line| {
            let mut parts = line.split_whitespace();
            let key = parts.next()?;
            let minor = parts.next()?.parse().ok()?;
            Some((key.to_string(), minor))
        })
        .collect()
}

/// The GPU-instance and compute-instance access nodes of a MIG device that exist on the host.
fn mig_cap_nodes(
    opts: &CdiOptions,
    table: Option<&BTreeMap<String, u32>>,
    parent: &Gpu,
    mig: &MigDevice,
    device: &str,
) -> Vec<DeviceNode> {
    let Some(table) = table else {
        return Vec::new();
    };
    let gi = format!("gpu{}/gi{}/access", parent.minor, mig.gi_id);
    let ci = format!("gpu{}/gi{}/ci{}/access", parent.minor, mig.gi_id, mig.ci_id);
    let mut nodes = Vec::new();
    for key in [gi, ci] {
        let Some(n) = table.get(&key) else {
            tracing::warn!(device, capability = %key, "MIG capability missing from mig-minors; skipped");
            continue;
        };
        let host = opts.dev_root.join(format!("nvidia-caps/nvidia-cap{n}"));
        match existing_node(&host, &format!("/dev/nvidia-caps/nvidia-cap{n}")) {
            Some(node) => nodes.push(node),
            None => tracing::warn!(
                device,
                host_path = %host.display(),
                "MIG capability device node not found; skipped"
            ),
        }
    }
    nodes
}

/// Read-only mounts of the driver files at their path relative to the driver root, plus the
/// `update-ldcache` hook and `NVIDIA_CTK_LIBCUDA_DIR` when they apply.
fn driver_file_edits(opts: &CdiOptions, files: &DriverFiles, edits: &mut ContainerEdits) {
    let in_container = |host: &Path| -> Option<String> {
        match host.strip_prefix(&opts.driver_root) {
            Ok(rel) => Some(Path::new("/").join(rel).display().to_string()),
            Err(_) => {
                tracing::warn!(path = %host.display(), "driver file outside the driver root; not mounted");
                None
            }
        }
    };
    let mut hook = None;
    let mut mounts = BTreeMap::new();
    let mut lib_dirs = BTreeSet::new();
    let mut libcuda_dir = None;
    for host in files.libraries.iter().chain(&files.binaries) {
        if host.file_name().is_some_and(|n| n == CDI_HOOK) {
            hook = Some(host.display().to_string());
            continue;
        }
        let Some(target) = in_container(host) else {
            continue;
        };
        if files.libraries.contains(host)
            && let Some(dir) = Path::new(&target).parent()
        {
            let dir = dir.display().to_string();
            if host
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("libcuda.so."))
            {
                libcuda_dir.get_or_insert_with(|| dir.clone());
            }
            lib_dirs.insert(dir);
        }
        mounts.insert(target, host.display().to_string());
    }
    edits
        .mounts
        .extend(mounts.into_iter().map(|(container_path, host_path)| Mount {
            host_path,
            container_path,
            options: READ_ONLY_MOUNT.iter().map(|s| s.to_string()).collect(),
        }));
    if let Some(dir) = libcuda_dir {
        edits.env.push(format!("NVIDIA_CTK_LIBCUDA_DIR={dir}"));
    }
    if let Some(path) = hook
        && !lib_dirs.is_empty()
    {
        let mut args = vec![CDI_HOOK.to_string(), "update-ldcache".to_string()];
        for dir in lib_dirs {
            args.push("--folder".into());
            args.push(dir);
        }
        edits.hooks.push(Hook {
            hook_name: "createContainer".into(),
            path,
            args,
            env: Vec::new(),
        });
    }
}

/// The MPS client environment. MPS is per process, so these are claim-wide: all MPS devices of
/// a claim share one control daemon (one pipe directory) and one active-thread percentage, and a
/// claim cannot mix MPS and non-MPS devices (the client would route every device through MPS).
fn mps_edits(
    claim_uid: &str,
    devices: &[PreparedDevice],
    edits: &mut ContainerEdits,
) -> Result<()> {
    let fail = |message: String| Error::Mps {
        claim_uid: claim_uid.to_string(),
        message,
    };
    let mps: Vec<(&PreparedDevice, &MpsSettings)> = devices
        .iter()
        .filter_map(|d| match &d.sharing {
            Sharing::Mps(s) => Some((d, s)),
            _ => None,
        })
        .collect();
    if mps.is_empty() {
        return Ok(());
    }
    if let Some(d) = devices
        .iter()
        .find(|d| !matches!(d.sharing, Sharing::Mps(_)))
    {
        return Err(fail(format!(
            "device {} is not shared with MPS while others are; configure MPS for all devices \
             of the claim or for none",
            d.name
        )));
    }

    let mut pipe_dir: Option<&Path> = None;
    let mut percentage: Option<(u32, &str)> = None;
    let mut limits = Vec::new();
    for (d, settings) in &mps {
        let dir = d.mps_pipe_dir.as_deref().ok_or_else(|| {
            fail(format!(
                "device {} is shared with MPS but has no MPS pipe directory; start the claim's \
                 MPS control daemon before writing its CDI spec",
                d.name
            ))
        })?;
        match pipe_dir {
            Some(p) if p != dir => {
                return Err(fail(format!(
                    "MPS devices use different pipe directories {} and {}; one claim has one \
                     MPS control daemon",
                    p.display(),
                    dir.display()
                )));
            }
            _ => pipe_dir = Some(dir),
        }
        if let Some(p) = settings.active_thread_percentage {
            match percentage {
                Some((q, other)) if q != p => {
                    return Err(fail(format!(
                        "MPS active thread percentage differs between devices {other} ({q}) and \
                         {} ({p}); a container has one percentage, use one config for the claim",
                        d.name
                    )));
                }
                _ => percentage = Some((p, &d.name)),
            }
        }
        // Keys name devices of the claim by position (`"0"`) or UUID.
        for key in settings.per_device_pinned_memory_limit.keys() {
            let known = match key.parse::<usize>() {
                Ok(i) => i < devices.len(),
                Err(_) => devices.iter().any(|x| x.uuid() == key),
            };
            if !known {
                return Err(fail(format!(
                    "MPS pinned memory limit for device {key:?} matches no device of the claim \
                     (use an index below {} or one of the claim's UUIDs)",
                    devices.len()
                )));
            }
        }
    }
    for (index, d) in devices.iter().enumerate() {
        // Every device is MPS here (checked above); the settings that apply are its own.
        let Sharing::Mps(settings) = &d.sharing else {
            continue;
        };
        let limit = settings
            .per_device_pinned_memory_limit
            .get(d.uuid())
            .or_else(|| {
                settings
                    .per_device_pinned_memory_limit
                    .get(&index.to_string())
            })
            .or(settings.pinned_memory_limit.as_ref());
        if let Some(bytes) = limit {
            limits.push(format!("{}={}M", d.uuid(), bytes >> 20));
        }
    }

    if let Some(dir) = pipe_dir {
        edits
            .env
            .push(format!("CUDA_MPS_PIPE_DIRECTORY={MPS_PIPE_CONTAINER_DIR}"));
        edits.mounts.push(Mount {
            host_path: dir.display().to_string(),
            container_path: MPS_PIPE_CONTAINER_DIR.into(),
            options: ["rw", "nosuid", "nodev", "rbind", "rprivate"]
                .iter()
                .map(|s| s.to_string())
                .collect(),
        });
    }
    if let Some((p, _)) = percentage {
        edits
            .env
            .push(format!("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={p}"));
    }
    if !limits.is_empty() {
        edits.env.push(format!(
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={}",
            limits.join(",")
        ));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Writer

fn file_prefix(opts: &CdiOptions) -> String {
    format!("{}-{}_", opts.vendor, opts.class)
}

/// `<cdi_root>/<vendor>-<class>_<claimUID>.yaml`.
pub fn spec_path(cdi_root: &Path, opts: &CdiOptions, claim_uid: &str) -> PathBuf {
    cdi_root.join(format!("{}{claim_uid}.yaml", file_prefix(opts)))
}

/// Writes (or replaces) a claim's spec atomically; creates `cdi_root` when missing.
pub fn write_spec(
    cdi_root: &Path,
    opts: &CdiOptions,
    claim_uid: &str,
    spec: &Spec,
) -> Result<PathBuf> {
    validate_claim_uid(claim_uid)?;
    let text = spec.to_yaml()?;
    fs::create_dir_all(cdi_root).map_err(io_err("create the CDI directory", cdi_root))?;
    let path = spec_path(cdi_root, opts, claim_uid);
    crate::durable::write(&path, text.as_bytes())?;
    Ok(path)
}

/// Removes a claim's spec; `Ok(false)` when there was none.
pub fn remove_spec(cdi_root: &Path, opts: &CdiOptions, claim_uid: &str) -> Result<bool> {
    validate_claim_uid(claim_uid)?;
    Ok(crate::durable::remove(&spec_path(
        cdi_root, opts, claim_uid,
    ))?)
}

/// The claim UIDs that have a spec file of this vendor and class in `cdi_root`, sorted (empty
/// when the directory does not exist). For removing specs of claims that are no longer prepared.
pub fn list_claim_specs(cdi_root: &Path, opts: &CdiOptions) -> Result<Vec<String>> {
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
        if validate_claim_uid(uid).is_ok() {
            uids.push(uid.to_string());
        }
    }
    uids.sort();
    Ok(uids)
}

#[cfg(test)]
mod tests;
