//! The NVML backend: reads the node's GPUs through nvml-wrapper.
//!
//! `libnvidia-ml.so.1` is loaded at run time, so the binary builds and starts on machines with no
//! NVIDIA software; there a missing library is [`Error::NvmlMissing`], never a panic.

use std::path::{Path, PathBuf};

use nvml_wrapper::Nvml;
use nvml_wrapper::error::NvmlError;

use super::{DeviceBackend, Error, Inventory, Result};

/// The library NVML is loaded from.
pub const LIBRARY: &str = "libnvidia-ml.so.1";

pub struct NvmlBackend {
    nvml: Nvml,
}

impl std::fmt::Debug for NvmlBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NvmlBackend")
    }
}

impl NvmlBackend {
    /// Loads NVML. With a driver root other than `/`, the library is looked up under it first
    /// (the usual layout of a containerized driver), then by the default search path.
    pub fn open(driver_root: &Path) -> Result<Self> {
        let candidates = library_candidates(driver_root);
        let mut last_reason = String::from("not found");
        for candidate in &candidates {
            let init = match candidate {
                Some(path) => Nvml::builder().lib_path(path.as_os_str()).init(),
                None => Nvml::init(),
            };
            match init {
                Ok(nvml) => return Ok(Self { nvml }),
                Err(NvmlError::LibloadingError(e)) => last_reason = e.to_string(),
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
            reason: last_reason,
        })
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
        Err(Error::Nvml {
            call: "snapshot".into(),
            reason: "reading GPUs through NVML is not implemented yet".into(),
        })
    }
}
