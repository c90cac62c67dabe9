//! A caching [`DeviceBackend`]: prepare resolves devices against the last inventory read instead
//! of enumerating every GPU through NVML on each batch.
//!
//! The cache is filled by the first [`DeviceBackend::snapshot`] and replaced by
//! [`DeviceBackend::refresh`] (which the slice sync and the health stream call, so what prepare
//! sees is never older than what the node publishes). Every reconfiguration through the cache
//! (time slice, MIG create or destroy) empties it, so the next read sees the hardware as it now is.

use std::sync::{Arc, Mutex, MutexGuard};

use super::{DeviceBackend, GpuUuid, Inventory, MigDevice, MigUuid, Placement, Result, TimeSlice};

pub struct Cached {
    backend: Arc<dyn DeviceBackend>,
    last: Mutex<Option<Inventory>>,
}

impl Cached {
    pub fn new(backend: Arc<dyn DeviceBackend>) -> Self {
        Self {
            backend,
            last: Mutex::new(None),
        }
    }

    fn last(&self) -> MutexGuard<'_, Option<Inventory>> {
        // The cache holds a complete value or none; a panic elsewhere cannot leave it torn.
        crate::lock::lock(&self.last)
    }

    fn invalidating<T>(&self, r: Result<T>) -> Result<T> {
        *self.last() = None;
        r
    }
}

// Named, not imported: elsewhere in this module (its tests included) `cached.snapshot()` is
// `DeviceBackend::snapshot` alone, not ambiguous between the two traits.
impl super::Wrapper for Cached {
    fn inner(&self) -> &dyn DeviceBackend {
        &*self.backend
    }

    fn snapshot(&self) -> Result<Inventory> {
        if let Some(inv) = self.last().as_ref() {
            return Ok(inv.clone());
        }
        super::Wrapper::refresh(self)
    }

    fn refresh(&self) -> Result<Inventory> {
        let inv = self.backend.refresh()?;
        *self.last() = Some(inv.clone());
        Ok(inv)
    }

    fn set_time_slice(&self, gpu: &GpuUuid, interval: TimeSlice) -> Result<()> {
        self.invalidating(self.backend.set_time_slice(gpu, interval))
    }

    fn create_mig(
        &self,
        gpu: &GpuUuid,
        gi_profile_id: u32,
        placement: Placement,
    ) -> Result<MigDevice> {
        self.invalidating(self.backend.create_mig(gpu, gi_profile_id, placement))
    }

    fn destroy_mig(&self, gpu: &GpuUuid, mig: &MigUuid) -> Result<()> {
        self.invalidating(self.backend.destroy_mig(gpu, mig))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::Health;
    use crate::inventory::sim::SimBackend;

    #[test]
    fn snapshots_are_cached_until_refreshed_or_reconfigured() {
        let sim = SimBackend::from_profile("a100-mig-mixed", "n").unwrap();
        let cached = Cached::new(Arc::new(sim.clone()));
        let first = cached.snapshot().unwrap();
        sim.update(|inv| {
            inv.gpus[0].health = Health::Unhealthy {
                reason: "XID 79".into(),
            }
        });
        // Cached: the change is not seen until someone refreshes.
        assert_eq!(cached.snapshot().unwrap(), first);
        let fresh = cached.refresh().unwrap();
        assert!(!fresh.gpus[0].health.is_healthy());
        assert_eq!(cached.snapshot().unwrap(), fresh);

        // A reconfiguration through the cache empties it.
        let gpu2 = fresh.gpus[2].uuid.clone();
        let created = cached
            .create_mig(&gpu2, 15, Placement { start: 6, size: 2 })
            .unwrap();
        let after = cached.snapshot().unwrap();
        assert!(
            after.gpus[2]
                .mig
                .devices
                .iter()
                .any(|d| d.uuid == created.uuid)
        );
        cached.destroy_mig(&gpu2, &created.uuid).unwrap();
        assert!(
            !cached.snapshot().unwrap().gpus[2]
                .mig
                .devices
                .iter()
                .any(|d| d.uuid == created.uuid)
        );
    }
}
