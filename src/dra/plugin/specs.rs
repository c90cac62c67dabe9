//! The plugin's claim CDI specs: the directory they live in, the options that name them and the
//! driver files they mount, as one value, so that no call can pair a root with the wrong options.

use std::path::PathBuf;

use crate::cdi::{self, CdiOptions, DriverFiles, DriverRoot, PreparedDevice};
use crate::durable::Durability;
use crate::ids::ClaimUid;

pub(super) struct Specs {
    root: PathBuf,
    opts: CdiOptions,
    driver_files: DriverFiles,
}

impl Specs {
    /// Specs of `driver` in `root`, for a host whose driver files are under `driver_root`.
    pub fn new(driver: &str, driver_root: &DriverRoot, root: PathBuf) -> Result<Self, cdi::Error> {
        Ok(Self {
            opts: CdiOptions::resolve(driver, driver_root)?,
            driver_files: cdi::discover_driver_files(driver_root),
            root,
        })
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
        cdi::claim_spec(&self.opts, uid.as_str(), devices, &self.driver_files)?.to_yaml()
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
