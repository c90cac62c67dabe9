//! [`Wrapper`]: a test backend over another that changes some of what it does (the dynamic
//! MIG tests count, shift or fail calls). Test code since the health overlay, its one production
//! user, gave way to the owner's publication.

use std::path::Path;

use crate::inventory::{
    ComputeMode, DeviceBackend, GpuUsage, GpuUuid, Inventory, MemoryLimits, MigDevice,
    MigModeChange, MigUuid, Placement, Reconfiguration, Result, TimeSlice,
};

/// A backend over another that changes some of what it does. A wrapper implements [`Wrapper::inner`] and the
/// methods it changes; every other [`DeviceBackend`] method goes to `inner` unchanged, through
/// the one implementation below instead of a forwarding method per wrapper.
pub trait Wrapper: Send + Sync + 'static {
    /// The backend wrapped.
    fn inner(&self) -> &dyn DeviceBackend;

    /// [`DeviceBackend::snapshot`].
    fn snapshot(&self) -> Result<Inventory> {
        self.inner().snapshot()
    }

    /// [`DeviceBackend::refresh`].
    fn refresh(&self) -> Result<Inventory> {
        self.inner().refresh()
    }

    /// [`DeviceBackend::published`]: `None` unless the wrapper says its snapshot is the
    /// inner one unchanged.
    fn published(&self) -> Option<std::sync::Arc<Inventory>> {
        None
    }

    /// [`DeviceBackend::set_time_slice`].
    fn set_time_slice(&self, gpu: &GpuUuid, interval: TimeSlice) -> Result<()> {
        self.inner().set_time_slice(gpu, interval)
    }

    /// [`DeviceBackend::set_compute_mode`].
    fn set_compute_mode(&self, gpu: &GpuUuid, mode: ComputeMode) -> Result<()> {
        self.inner().set_compute_mode(gpu, mode)
    }

    /// [`DeviceBackend::create_mig`].
    fn create_mig(
        &self,
        gpu: &GpuUuid,
        gi_profile_id: u32,
        placement: Placement,
    ) -> Result<MigDevice> {
        self.inner().create_mig(gpu, gi_profile_id, placement)
    }

    /// [`DeviceBackend::destroy_mig`].
    fn destroy_mig(&self, gpu: &GpuUuid, mig: &MigUuid) -> Result<()> {
        self.inner().destroy_mig(gpu, mig)
    }

    /// [`DeviceBackend::set_mig_mode`].
    fn set_mig_mode(&self, gpu: &GpuUuid, enabled: bool) -> Result<MigModeChange> {
        self.inner().set_mig_mode(gpu, enabled)
    }
}

/// Every method is spelled out, those with a default included: a default here would be the
/// trait's own (`Unsupported`, a probe through `self.refresh()`), not the wrapped backend's. A
/// method added to [`DeviceBackend`] is added here, and to [`Wrapper`] if a wrapper may change it.
impl<W: Wrapper> DeviceBackend for W {
    fn name(&self) -> &'static str {
        self.inner().name()
    }

    fn snapshot(&self) -> Result<Inventory> {
        Wrapper::snapshot(self)
    }

    fn refresh(&self) -> Result<Inventory> {
        Wrapper::refresh(self)
    }

    fn published(&self) -> Option<std::sync::Arc<Inventory>> {
        Wrapper::published(self)
    }

    fn unavailable(&self, what: Reconfiguration) -> Option<String> {
        self.inner().unavailable(what)
    }

    fn set_time_slice(&self, gpu: &GpuUuid, interval: TimeSlice) -> Result<()> {
        Wrapper::set_time_slice(self, gpu, interval)
    }

    /// Read from the hardware through every wrapper: never cached.
    fn compute_mode(&self, gpu: &GpuUuid) -> Result<ComputeMode> {
        self.inner().compute_mode(gpu)
    }

    fn set_compute_mode(&self, gpu: &GpuUuid, mode: ComputeMode) -> Result<()> {
        Wrapper::set_compute_mode(self, gpu, mode)
    }

    /// Read from the driver through every wrapper: never cached.
    fn memory_limits(&self, gpu: &GpuUuid, cgroup: &Path) -> Result<MemoryLimits> {
        self.inner().memory_limits(gpu, cgroup)
    }

    fn create_mig(
        &self,
        gpu: &GpuUuid,
        gi_profile_id: u32,
        placement: Placement,
    ) -> Result<MigDevice> {
        Wrapper::create_mig(self, gpu, gi_profile_id, placement)
    }

    fn start_health_events(
        &self,
        sink: Box<dyn crate::inventory::events::EventSink>,
    ) -> Option<std::io::Result<crate::inventory::events::EventThread>> {
        self.inner().start_health_events(sink)
    }

    fn probe(&self, gpu: &GpuUuid) -> std::result::Result<(), String> {
        self.inner().probe(gpu)
    }

    fn destroy_mig(&self, gpu: &GpuUuid, mig: &MigUuid) -> Result<()> {
        Wrapper::destroy_mig(self, gpu, mig)
    }

    fn set_mig_mode(&self, gpu: &GpuUuid, enabled: bool) -> Result<MigModeChange> {
        Wrapper::set_mig_mode(self, gpu, enabled)
    }

    /// Live readings are never cached nor overlaid: every wrapper reads the wrapped backend's.
    fn usage(&self) -> Result<Vec<GpuUsage>> {
        self.inner().usage()
    }
}
