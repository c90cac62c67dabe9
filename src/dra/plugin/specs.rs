//! The plugin's claim CDI specs: the directory they live in, the options that name them and the
//! driver files they mount, as one value, so that no call can pair a root with the wrong options.

use std::path::{Path, PathBuf};

use crate::cdi::{self, CdiOptions, DriverFiles, PreparedDevice};
use crate::ledger::ClaimUid;

pub(super) struct Specs {
    root: PathBuf,
    opts: CdiOptions,
    driver_files: DriverFiles,
}

impl Specs {
    /// Specs of `driver` in `root`, for a host whose driver files are under `driver_root`.
    pub fn new(driver: &str, driver_root: &Path, root: PathBuf) -> Result<Self, cdi::Error> {
        Ok(Self {
            opts: CdiOptions::resolve(driver, driver_root)?,
            driver_files: cdi::discover_driver_files(driver_root),
            root,
        })
    }

    pub fn options(&self) -> &CdiOptions {
        &self.opts
    }

    pub fn exists(&self, uid: &ClaimUid) -> bool {
        cdi::spec_path(&self.root, &self.opts, uid.as_str()).exists()
    }

    /// Builds and writes (or replaces) the claim's spec; reads the host, so blocking.
    pub fn write(&self, uid: &ClaimUid, devices: &[PreparedDevice]) -> Result<(), cdi::Error> {
        let spec = cdi::claim_spec(&self.opts, uid.as_str(), devices, &self.driver_files)?;
        cdi::write_spec(&self.root, &self.opts, uid.as_str(), &spec)?;
        Ok(())
    }

    /// Whether there was a spec to remove.
    pub fn remove(&self, uid: &ClaimUid) -> Result<bool, cdi::Error> {
        cdi::remove_spec(&self.root, &self.opts, uid.as_str())
    }

    /// The claim UIDs of the specs in the directory.
    pub fn list(&self) -> Result<Vec<String>, cdi::Error> {
        cdi::list_claim_specs(&self.root, &self.opts)
    }
}
