//! The GPUs whose MIG mode nvdra will not switch now, and why ([`SwitchBlock`]): set by the
//! plugin from what the driver answered a switch (`RESET_REQUIRED`, `IN_USE`), read where the
//! slices are computed (each GPU's [`Mig::switch_block`](crate::inventory::Mig::switch_block)).
//! Shared by clones; changes are rare (a failed switch), reads are one map lookup per GPU.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use tokio::sync::watch;

use super::{GpuUuid, Inventory, SwitchBlock};

/// One node's switch blocks, shared by the plugin (which sets them) and the slice sync (which
/// follows their [`changes`](SwitchBlocks::changes)).
#[derive(Clone, Debug)]
pub struct SwitchBlocks(
    Arc<Mutex<BTreeMap<GpuUuid, SwitchBlock>>>,
    Arc<watch::Sender<u64>>,
);

impl Default for SwitchBlocks {
    fn default() -> Self {
        Self(Arc::default(), Arc::new(watch::Sender::new(0)))
    }
}

impl SwitchBlocks {
    /// Records why `gpu` is not switched now; whether that changed anything.
    pub fn set(&self, gpu: &GpuUuid, block: SwitchBlock) -> bool {
        let changed = crate::lock::lock(&self.0).insert(gpu.clone(), block.clone()) != Some(block);
        self.changed(changed)
    }

    /// Forgets `gpu`'s block; whether it had one.
    pub fn clear(&self, gpu: &GpuUuid) -> bool {
        let changed = crate::lock::lock(&self.0).remove(gpu).is_some();
        self.changed(changed)
    }

    fn changed(&self, changed: bool) -> bool {
        if changed {
            self.1.send_modify(|n| *n += 1);
        }
        changed
    }

    /// Changes once per block set or cleared.
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.1.subscribe()
    }

    pub fn get(&self, gpu: &GpuUuid) -> Option<SwitchBlock> {
        crate::lock::lock(&self.0).get(gpu).cloned()
    }

    /// Every GPU with a block.
    pub fn all(&self) -> BTreeMap<GpuUuid, SwitchBlock> {
        crate::lock::lock(&self.0).clone()
    }

    /// Writes each GPU's block into `inv` (and clears it on the others).
    pub fn apply(&self, inv: &mut Inventory) {
        let map = crate::lock::lock(&self.0);
        for g in &mut inv.gpus {
            g.mig.switch_block = map.get(&g.uuid).cloned();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_says_whether_it_changed_and_apply_writes_each_gpu() {
        let blocks = SwitchBlocks::default();
        use crate::inventory::DeviceBackend;
        let mut inv = crate::inventory::sim::SimBackend::from_profile("dgx-h100", "n")
            .unwrap()
            .snapshot()
            .unwrap();
        let g0 = inv.gpus[0].uuid.clone();
        assert!(blocks.set(&g0, SwitchBlock::ResetRequired));
        assert!(!blocks.set(&g0, SwitchBlock::ResetRequired));
        inv.gpus[1].mig.switch_block = Some(SwitchBlock::ResetRequired);
        blocks.apply(&mut inv);
        assert_eq!(
            inv.gpus[0].mig.switch_block,
            Some(SwitchBlock::ResetRequired)
        );
        assert_eq!(inv.gpus[1].mig.switch_block, None);
        assert!(blocks.clear(&g0));
        assert!(!blocks.clear(&g0));
        assert!(blocks.all().is_empty());
    }
}
