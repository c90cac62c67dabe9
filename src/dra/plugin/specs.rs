//! The plugin's claim CDI specs: the directory they live in, the options that name them and the
//! driver files they mount, as one value, so that no call can pair a root with the wrong options.

use std::path::PathBuf;
use std::sync::Mutex;

use crate::cdi::{self, CdiOptions, DriverFiles, DriverRoot, PreparedDevice};
use crate::durable::Durability;
use crate::ids::ClaimUid;

pub(super) struct Specs {
    root: PathBuf,
    opts: CdiOptions,
    /// Found at start; looked for again while none are found, since on GPU Operator nodes the
    /// driver container may come up after nvdra.
    driver_files: Mutex<DriverFiles>,
}

impl Specs {
    /// Specs of `driver` in `root`, for a host whose driver files are under `driver_root`.
    pub fn new(driver: &str, driver_root: &DriverRoot, root: PathBuf) -> Result<Self, cdi::Error> {
        Ok(Self {
            opts: CdiOptions::resolve(driver, driver_root)?,
            driver_files: Mutex::new(cdi::discover_driver_files(driver_root)),
            root,
        })
    }

    /// Gives share specs the `dmem` limit hook when the node's cgroups list GPU memory regions
    /// (then nvdra's binary is installed in `dir`, a host directory); otherwise, or when it
    /// cannot be installed, shares keep the per-process limit only, as logged.
    pub fn enable_dmem(&mut self, dir: &std::path::Path) {
        let cgroups = self.opts.root.read_path(&self.opts.cgroup_root);
        match cdi::dmem::gpu_regions(&cgroups) {
            Ok(regions) if regions.is_empty() => tracing::info!(
                cgroups = %cgroups.display(),
                "no GPU memory regions in the cgroup v2 dmem controller: a share's memory limit \
                 is per CUDA process (CUDA_MPS_PINNED_DEVICE_MEM_LIMIT)"
            ),
            Ok(regions) => match cdi::dmem::install_hook(dir) {
                Ok(binary) => {
                    tracing::info!(
                        hook = %binary.display(),
                        gpus = regions.len(),
                        "GPU memory regions in the dmem controller: a share's memory limit also \
                         covers its whole container"
                    );
                    self.opts.dmem_hook = Some(binary);
                }
                Err(e) => tracing::warn!(
                    error = %format!("{e:#}"),
                    "cannot install the dmem hook: a share's memory limit is per CUDA process only"
                ),
            },
            Err(e) => tracing::warn!(
                error = %format!("{e:#}"),
                "cannot read the dmem regions: a share's memory limit is per CUDA process only"
            ),
        }
    }

    pub fn options(&self) -> &CdiOptions {
        &self.opts
    }

    /// Builds and writes (or replaces) the claim's spec; reads the host, so blocking. Atomic, not
    /// durable: a power loss may lose or empty it, and start-up's [`Specs::ensure`] repairs that
    /// from the checkpoint, so a prepare waits for one fsync'd write (the checkpoint's), not two.
    pub fn write(&self, uid: &ClaimUid, devices: &[PreparedDevice]) -> Result<(), cdi::Error> {
        let text = self.render(uid, devices)?;
        self.replace(uid, &text)
    }

    /// Rewrites the claim's spec unless the file already holds exactly what [`Specs::write`]
    /// would write (it may be missing, empty or stale after a power loss, or edited by hand).
    /// Whether it wrote.
    pub fn ensure(&self, uid: &ClaimUid, devices: &[PreparedDevice]) -> Result<bool, cdi::Error> {
        let text = self.render(uid, devices)?;
        let path = cdi::spec_path(&self.root, &self.opts, uid);
        if std::fs::read(&path).is_ok_and(|on_disk| on_disk == text.as_bytes()) {
            return Ok(false);
        }
        self.replace(uid, &text)?;
        Ok(true)
    }

    /// The claim's spec as [`Specs::write`] writes it.
    fn render(&self, uid: &ClaimUid, devices: &[PreparedDevice]) -> Result<String, cdi::Error> {
        cdi::claim_spec(&self.opts, uid.as_str(), devices, &self.driver_files())?.to_yaml()
    }

    /// The driver's files, looked for again if none were found before.
    fn driver_files(&self) -> DriverFiles {
        // A poisoned lock still holds a complete value: it is only ever replaced whole.
        let mut files = self
            .driver_files
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if files.version.is_none() {
            let found = cdi::discover_driver_files(&self.opts.root);
            if let Some(version) = &found.version {
                tracing::info!(
                    driver.version = %version,
                    driver_root = %self.opts.root.host().display(),
                    "driver files found; claim specs mount them from now on"
                );
                *files = found;
            }
        }
        files.clone()
    }

    fn replace(&self, uid: &ClaimUid, text: &str) -> Result<(), cdi::Error> {
        cdi::write_spec_text(&self.root, &self.opts, uid, text, Durability::Atomic)?;
        Ok(())
    }

    /// Whether the claim's spec file reads as a CDI spec with devices (it may still be stale).
    pub fn readable(&self, uid: &ClaimUid) -> bool {
        let path = cdi::spec_path(&self.root, &self.opts, uid);
        std::fs::read_to_string(path)
            .ok()
            .and_then(|text| crate::yaml::from_str::<cdi::Spec>(&text).ok())
            .is_some_and(|spec| !spec.devices.is_empty())
    }

    /// Whether there was a spec to remove. Not durable either: a spec that comes back after a
    /// power loss has no checkpoint entry, and start-up removes it.
    pub fn remove(&self, uid: &ClaimUid) -> Result<bool, cdi::Error> {
        cdi::remove_spec(&self.root, &self.opts, uid, Durability::Atomic)
    }

    /// The claim UIDs of the specs in the directory.
    pub fn list(&self) -> Result<Vec<ClaimUid>, cdi::Error> {
        cdi::list_claim_specs(&self.root, &self.opts)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::topology::load_profile;
    use crate::sharing::Sharing;

    /// The driver (an Operator's driver container) shows up after nvdra started: the next spec
    /// mounts its files.
    #[test]
    fn driver_files_found_after_start_reach_the_next_spec() {
        let dir = tempfile::tempdir().unwrap();
        let driver = dir.path().join("driver");
        let specs = Specs::new(
            "gpu.nvidia.com",
            &DriverRoot::at(&driver),
            dir.path().join("cdi"),
        )
        .unwrap();
        let gpu = load_profile("dgx-h100", "n").unwrap().gpus[0].clone();
        let devices = [PreparedDevice {
            name: "gpu-0".into(),
            gpu,
            mig: None,
            sharing: Sharing::Exclusive,
            mps_pipe_dir: None,
            mps_shm_dir: None,
        }];
        let uid = ClaimUid::parse("uid-1").unwrap();
        let lib = "usr/lib/x86_64-linux-gnu/libcuda.so.550.163.01";
        assert!(!specs.render(&uid, &devices).unwrap().contains(lib));
        let path = driver.join(lib);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, "libcuda").unwrap();
        assert!(specs.render(&uid, &devices).unwrap().contains(lib));
    }
}
