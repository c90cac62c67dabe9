//! Builder inputs: the driver root (host and container paths), CDI options, the prepared
//! devices of a claim, and the device nodes as the host has them (read where nvdra sees the
//! host; the claim spec builder, the DRM nodes and the device plugin's specs use them).

use std::fs;
use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use super::{DeviceNode, Result, validate_class, validate_vendor};
use crate::inventory::{Gpu, MemoryLimits, MigDevice};
use crate::sharing::Sharing;

/// Where the driver is, seen from the host and from nvdra.
///
/// The CDI spec names host paths (the runtime resolves them on the host), while nvdra reads the
/// driver's files wherever the host's driver root is mounted in its own container. On a node
/// with the driver installed on the host both are `/`; on a GPU Operator node the driver lives in
/// a container whose root the host sees at `/run/nvidia/driver`, and nvdra's pod mounts that
/// elsewhere (NVIDIA's charts use `/driver-root`). The device nodes have a root of their own
/// (`<dev root>/dev`), by default the driver root, as in NVIDIA's `nvidiaDevRoot`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DriverRoot {
    host: PathBuf,
    ctr: PathBuf,
    dev: PathBuf,
}

impl DriverRoot {
    /// `host`: the driver root on the host (`--driver-root`); `ctr`: where nvdra reads it
    /// (`--driver-root-ctr-path`); `dev`: the host root whose `dev/` holds the device nodes
    /// (`--dev-root`).
    pub fn new(host: PathBuf, ctr: PathBuf, dev: PathBuf) -> Self {
        Self { host, ctr, dev }
    }

    /// A driver root nvdra reads at its host path, with the device nodes under it: a host
    /// install, or a test's temporary directory.
    pub fn at(path: &Path) -> Self {
        Self::new(path.to_path_buf(), path.to_path_buf(), path.to_path_buf())
    }

    /// The driver root on the host: what CDI specs name.
    pub fn host(&self) -> &Path {
        &self.host
    }

    /// Where nvdra reads the host's driver root.
    pub fn ctr(&self) -> &Path {
        &self.ctr
    }

    /// The host root holding the device nodes' `dev/`.
    pub fn dev(&self) -> &Path {
        &self.dev
    }

    /// Where nvdra reads the host path `host`: under the container path when it is under the
    /// host driver root, else at the same path (a device root mounted where the host has it).
    pub fn read_path(&self, host: &Path) -> PathBuf {
        match host.strip_prefix(&self.host) {
            Ok(rel) if self.host != self.ctr => self.ctr.join(rel),
            _ => host.to_path_buf(),
        }
    }

    /// The host path of `read`, a path nvdra read under the container path.
    pub fn host_path(&self, read: &Path) -> PathBuf {
        match read.strip_prefix(&self.ctr) {
            Ok(rel) if self.host != self.ctr => self.host.join(rel),
            _ => read.to_path_buf(),
        }
    }

    /// The host directory of the device nodes: `<dev root>/dev` when nvdra finds it a directory
    /// (a driver container exposes its nodes there), else `/dev` (NVIDIA's rule too).
    pub fn dev_dir(&self) -> PathBuf {
        let candidate = self.dev.join("dev");
        if self.read_path(&candidate).is_dir() {
            candidate
        } else {
            PathBuf::from("/dev")
        }
    }
}

impl DriverRoot {
    /// Where nvdra reads sysfs, to find each GPU's DRM nodes: `<dev root>/sys` when it holds PCI
    /// devices (a test's fake tree, or a device root that carries the host's sysfs), else `/sys`.
    /// Only read, never named in a spec.
    pub fn sys_dir(&self) -> PathBuf {
        let candidate = self.read_path(&self.dev.join("sys"));
        if candidate.join("bus/pci/devices").is_dir() {
            candidate
        } else {
            PathBuf::from("/sys")
        }
    }
}

impl DriverRoot {
    /// Where nvdra reads procfs, for the MIG capabilities (`driver/nvidia/capabilities`) and the
    /// `nvidia-caps` major (`devices`): `<dev root>/proc` when it has the NVIDIA driver's entries
    /// (a test's fake tree), else `/proc`. Only read, never named in a spec.
    pub fn proc_dir(&self) -> PathBuf {
        let candidate = self.read_path(&self.dev.join("proc"));
        if candidate.join("driver/nvidia").is_dir() {
            candidate
        } else {
            PathBuf::from("/proc")
        }
    }
}

impl DriverRoot {
    /// The host's cgroup v2 root as a host path (the memory-limit hook runs on the host; nvdra
    /// reads it at [`DriverRoot::read_path`]): `<dev root>/sys/fs/cgroup` when that is a cgroup
    /// v2 root (a test's fake tree, or a device root that carries the host's), else
    /// `/sys/fs/cgroup`.
    pub fn cgroup_dir(&self) -> PathBuf {
        let candidate = self.dev.join("sys/fs/cgroup");
        if self
            .read_path(&candidate)
            .join("cgroup.controllers")
            .is_file()
        {
            candidate
        } else {
            PathBuf::from("/sys/fs/cgroup")
        }
    }
}

/// Where CDI names and host paths come from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CdiOptions {
    /// `k8s.<driver>`.
    pub vendor: String,
    /// `claim`.
    pub class: String,
    /// The driver's root on the host and where nvdra reads it.
    pub root: DriverRoot,
    /// The host directory holding the `nvidia*` device nodes ([`DriverRoot::dev_dir`]).
    pub dev_root: PathBuf,
    /// Where nvdra reads sysfs ([`DriverRoot::sys_dir`]).
    pub sys_root: PathBuf,
    /// Where nvdra reads procfs ([`DriverRoot::proc_dir`]).
    pub proc_root: PathBuf,
    /// The host's cgroup v2 root, as a host path ([`DriverRoot::cgroup_dir`]).
    pub cgroup_root: PathBuf,
    /// MPS v3 memory partitioning ([`super::memlimit`]): set by the plugin where the driver
    /// limits GPU memory per cgroup, so the specs of shares of those GPUs carry the hook.
    pub partitioning: Option<super::memlimit::Partitioning>,
    /// The MPS start gate ([`super::gate`]): set when the plugin installed it, so that every
    /// container of an MPS claim starts only while its daemon answers with a server up.
    pub mps_gate: Option<super::gate::Gate>,
}

impl CdiOptions {
    /// Options for `driver` (e.g. `gpu.nvidia.com`): vendor `k8s.<driver>`, class `claim`, the
    /// device directory found from `root`. Fails when the vendor is not a valid CDI vendor.
    pub fn resolve(driver: &str, root: &DriverRoot) -> Result<Self> {
        let opts = Self {
            vendor: format!("k8s.{driver}"),
            class: "claim".into(),
            root: root.clone(),
            dev_root: root.dev_dir(),
            sys_root: root.sys_dir(),
            proc_root: root.proc_dir(),
            cgroup_root: root.cgroup_dir(),
            partitioning: None,
            mps_gate: None,
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
    /// The host directory the claim's MPS control daemon has as `/dev/shm`, mounted on the
    /// client's `/dev/shm` (MPS clients and server share memory there).
    pub mps_shm_dir: Option<PathBuf>,
    /// A share's memory on its GPU: soft = what the scheduler counted, hard = the most it may
    /// use (its burst limit). `None` for a device that is not a share.
    pub memory_limits: Option<MemoryLimits>,
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

// Device nodes as the host has them: whether a node exists where nvdra reads the host, and its
// type, numbers and mode, for a CDI `deviceNodes` entry.

/// [`existing_node`] for the host path `host`, read where nvdra sees it.
pub fn host_node(opts: &CdiOptions, host: &Path, container_path: &str) -> Option<DeviceNode> {
    existing_node(&opts.root.read_path(host), host, container_path)
}

/// A device node with host path `host` if `read` (where nvdra sees it) exists and is a device
/// (symlinks are followed), with its type, numbers and mode read from the host so dynamic majors
/// (`nvidia-uvm`) are right.
pub fn existing_node(read: &Path, host: &Path, container_path: &str) -> Option<DeviceNode> {
    let meta = match fs::metadata(read) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return None,
        Err(e) => {
            tracing::warn!(path = %read.display(), error = %e, "cannot inspect device node; skipped");
            return None;
        }
    };
    let file_type = meta.file_type();
    let node_type = if file_type.is_char_device() {
        "c"
    } else if file_type.is_block_device() {
        "b"
    } else {
        tracing::warn!(path = %read.display(), "not a device node; skipped");
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
pub(super) fn split_dev(dev: u64) -> (i64, i64) {
    let major = ((dev >> 8) & 0xfff) | ((dev >> 32) & 0xffff_f000);
    let minor = (dev & 0xff) | ((dev >> 12) & 0xffff_ff00);
    // Both are at most 32 bits wide after the masks, so they fit in i64.
    (major as i64, minor as i64)
}
