//! The simulated backend: an [`Inventory`] read from a topology file or a built-in profile, held
//! in memory so tests and demos can change it (health, MIG instances) the way a real node would.

use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};

use super::{DeviceBackend, Inventory, Result, topology};

/// Simulated GPUs. Cloning shares the same model.
#[derive(Clone, Debug)]
pub struct SimBackend {
    model: Arc<Mutex<Inventory>>,
}

impl SimBackend {
    pub fn new(inventory: Inventory) -> Self {
        Self {
            model: Arc::new(Mutex::new(inventory)),
        }
    }

    /// Loads a built-in profile; `seed` (the node name) makes its UUIDs unique per node.
    pub fn from_profile(name: &str, seed: &str) -> Result<Self> {
        Ok(Self::new(topology::load_profile(name, seed)?))
    }

    /// Loads a topology file.
    pub fn from_file(path: &Path, seed: &str) -> Result<Self> {
        Ok(Self::new(topology::load_file(path, seed)?))
    }

    /// Changes the simulated hardware, e.g. to mark a GPU unhealthy in a test. The change is seen
    /// by the next snapshot.
    pub fn update<R>(&self, f: impl FnOnce(&mut Inventory) -> R) -> R {
        f(&mut self.lock())
    }

    fn lock(&self) -> MutexGuard<'_, Inventory> {
        // A panic while holding the lock cannot leave the inventory half-written in a way that
        // matters more than the panic itself; keep serving the last state.
        self.model.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl DeviceBackend for SimBackend {
    fn name(&self) -> &'static str {
        "simulated"
    }

    fn snapshot(&self) -> Result<Inventory> {
        Ok(self.lock().clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::Health;

    #[test]
    fn updates_show_in_next_snapshot() {
        let sim = SimBackend::from_profile("l40s-pcie", "n").unwrap();
        let before = sim.snapshot().unwrap();
        sim.update(|inv| {
            inv.gpus[1].health = Health::Unhealthy {
                reason: "XID 79".into(),
            }
        });
        let after = sim.snapshot().unwrap();
        assert!(before.gpus[1].health.is_healthy());
        assert!(!after.gpus[1].health.is_healthy());
        assert_eq!(before.gpus[0], after.gpus[0]);
    }
}
