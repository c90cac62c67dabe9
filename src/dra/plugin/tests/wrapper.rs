//! [`Wrapper`]: a test write side over another that changes some of what it does (the dynamic
//! MIG tests count, shift or fail calls).

use std::path::Path;

use crate::inventory::{
    ComputeMode, GpuUuid, MemoryLimits, MigDevice, MigModeChange, MigUuid, Placement,
    Reconfiguration, Reconfigure, Result, TimeSlice,
};

/// A write side over another that changes some of what it does. A wrapper implements
/// [`Wrapper::inner`] and the methods it changes; every other [`Reconfigure`] method goes to
/// `inner` unchanged, through the one implementation below instead of a forwarding method per
/// wrapper.
pub trait Wrapper: Send + Sync + 'static {
    /// The write side wrapped.
    fn inner(&self) -> &dyn Reconfigure;

    /// [`Reconfigure::set_mig_mode`].
    fn set_mig_mode(&self, gpu: &GpuUuid, enabled: bool) -> Result<MigModeChange> {
        self.inner().set_mig_mode(gpu, enabled)
    }
}

/// Every method goes to the wrapped one but those [`Wrapper`] changes. A method added to
/// [`Reconfigure`] is added here, and to [`Wrapper`] if a wrapper may change it.
impl<W: Wrapper> Reconfigure for W {
    fn unavailable(&self, what: Reconfiguration) -> Option<String> {
        self.inner().unavailable(what)
    }

    fn set_time_slice(&self, gpu: &GpuUuid, interval: TimeSlice) -> Result<()> {
        self.inner().set_time_slice(gpu, interval)
    }

    fn compute_mode(&self, gpu: &GpuUuid) -> Result<ComputeMode> {
        self.inner().compute_mode(gpu)
    }

    fn set_compute_mode(&self, gpu: &GpuUuid, mode: ComputeMode) -> Result<()> {
        self.inner().set_compute_mode(gpu, mode)
    }

    fn memory_limits(&self, gpu: &GpuUuid, cgroup: &Path) -> Result<MemoryLimits> {
        self.inner().memory_limits(gpu, cgroup)
    }

    fn create_mig(
        &self,
        gpu: &GpuUuid,
        gi_profile_id: u32,
        placement: Placement,
    ) -> Result<MigDevice> {
        self.inner().create_mig(gpu, gi_profile_id, placement)
    }

    fn destroy_mig(&self, gpu: &GpuUuid, mig: &MigUuid) -> Result<()> {
        self.inner().destroy_mig(gpu, mig)
    }

    fn set_mig_mode(&self, gpu: &GpuUuid, enabled: bool) -> Result<MigModeChange> {
        Wrapper::set_mig_mode(self, gpu, enabled)
    }
}
