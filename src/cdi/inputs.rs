//! Builder inputs: CDI options, the prepared devices of a claim and the driver files found on the
//! host.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

use super::{Result, validate_class, validate_vendor};
use crate::inventory::{Gpu, MigDevice};
use crate::sharing::Sharing;

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
pub(super) const LIB_DIRS: [&str; 7] = [
    "usr/lib/x86_64-linux-gnu",
    "usr/lib/aarch64-linux-gnu",
    "usr/lib64",
    "usr/lib",
    "lib/x86_64-linux-gnu",
    "lib/aarch64-linux-gnu",
    "lib64",
];
/// Binary directories searched under the driver root.
pub(super) const BIN_DIRS: [&str; 3] = ["usr/bin", "bin", "usr/sbin"];
/// The compute libraries a CUDA container needs (the `<name>.so.` prefix of their files).
pub(super) const LIBRARIES: [&str; 14] = [
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
pub(super) const BINARIES: [&str; 6] = [
    "nvidia-smi",
    "nvidia-debugdump",
    "nvidia-persistenced",
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
    "nvidia-cdi-hook",
];
pub(super) const CDI_HOOK: &str = "nvidia-cdi-hook";

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
