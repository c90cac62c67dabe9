//! Keeps the published slices a function of the inventory.
//!
//! [`SliceSync`] follows the inventory owner's publications ([`crate::inventory::owner`]: a MIG
//! instance created or destroyed at prepare, a health transition, a rescan), recomputes the
//! desired slices with [`slices::desired_slices`] from each, and hands them to the publisher only
//! when they differ from the ones it holds — so an unchanged node costs no API writes. The
//! desired slices are kept once, by the publisher; this task keeps no inventory.
//!
//! It also owns the one decision that needs the API server's answers: when the server drops the
//! partitionable fields (`sharedCounters`, `consumesCounters`: the DRAPartitionableDevices gate is
//! off), it logs that once and falls back to the plain layout, so the node stays schedulable
//! (with `--dynamic-mig` too: each GPU is then published by its current MIG mode).
//! Likewise for consumable capacity (`allowMultipleAllocations`, `requestPolicy`: the
//! DRAConsumableCapacity gate is off): each shareable GPU is then published as a plain whole GPU.
//! Likewise for device taints (the DRADeviceTaints gate is off): GPUs the health monitor marked
//! are then withdrawn from the slices instead of published tainted, so the scheduler still keeps
//! new claims off them.
//!
//! Likewise for the devices of a dynamic-MIG GPU on which a prepare met `IN_USE` (tainted
//! `mig-switch-blocked` where taints reach the scheduler): withdrawn.
//!
//! Given the plugin's switch blocks ([`SliceSync::with_switch_blocks`]), each publication
//! carries them ([`SwitchBlocks::apply`]), and each change of them is published at once.

use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use super::slices::{self, ConsumableShares, CounterLayout, SliceOptions};
use crate::holds::{ContainerHolds, Holder, Occupied};
use crate::inventory::owner::{self, Watch};
use crate::inventory::switch_blocks::SwitchBlocks;
use crate::inventory::{Health, Inventory};
use crate::metrics::Metrics;
use k8s_openapi::api::resource::v1::ResourceSliceSpec;
use kubelet_plugin::publisher::{PublisherHandle, Resources, Slice};

/// The fields whose loss means partitionable devices cannot work on this cluster.
const PARTITIONABLE_FIELDS: [&str; 2] = ["sharedCounters", "consumesCounters"];
/// The fields whose loss means consumable capacity cannot work on this cluster.
const CONSUMABLE_FIELDS: [&str; 2] = ["allowMultipleAllocations", "requestPolicy"];
/// The field whose loss means device taints do not reach the scheduler.
const TAINTS_FIELD: &str = "taints";

/// The counter layout a server of this Kubernetes minor version accepts: 1.34 wants shared
/// counters in the same slice as the devices using them, 1.35+ in a slice of their own. Unknown
/// (the directory API) gets the newest rules.
pub fn layout_for(minor: Option<u32>) -> CounterLayout {
    match minor {
        Some(m) if m <= 34 => CounterLayout::Together,
        _ => CounterLayout::Separate,
    }
}

/// The task that feeds the publisher.
pub struct SliceSync {
    /// The owner's publications: the node, health applied.
    node: Watch,
    publisher: PublisherHandle,
    options: SliceOptions,
    /// Set once the partitionable layout was abandoned.
    fell_back: bool,
    /// Set once the server was seen dropping taints: tainted devices are withdrawn instead.
    withdraw_tainted: bool,
    metrics: Option<Arc<Metrics>>,
    /// `--mode both`: the device-plugin holds, hidden from the slices.
    holds: Option<ContainerHolds>,
    /// The plugin's record of the GPUs it will not switch now, applied to each read.
    switch_blocks: Option<SwitchBlocks>,
}

impl SliceSync {
    /// Publishes the slices of each node `node` publishes.
    pub fn new(node: Watch, publisher: PublisherHandle, options: SliceOptions) -> Self {
        Self {
            node,
            publisher,
            options,
            fell_back: false,
            withdraw_tainted: false,
            metrics: None,
            holds: None,
            switch_blocks: None,
        }
    }

    /// Reports the GPU count and unhealthy devices of every inventory read.
    pub fn with_metrics(mut self, metrics: Arc<Metrics>) -> Self {
        self.metrics = Some(metrics);
        self
    }

    /// `--mode both`: hides what containers hold through the device plugin (the GPU, or the MIG
    /// device) from the slices while they hold it, re-publishing when the holds change.
    pub fn with_holds(mut self, holds: ContainerHolds) -> Self {
        self.holds = Some(holds);
        self
    }

    /// `--dynamic-mig`: publishes each GPU with the plugin's switch block
    /// ([`Mig::switch_block`](crate::inventory::Mig::switch_block)): one that answered
    /// `RESET_REQUIRED` as one that cannot switch, one where a prepare met `IN_USE` with its
    /// switch-needing devices tainted; each change of them is published at once.
    pub fn with_switch_blocks(mut self, blocks: SwitchBlocks) -> Self {
        self.switch_blocks = Some(blocks);
        self
    }

    /// Runs until `shutdown`. A node the owner could not read, or slices that cannot be built,
    /// are logged and the next publication tried; the last published state stays in place
    /// meanwhile.
    pub async fn run(mut self, shutdown: CancellationToken) {
        let mut dropped = self.publisher.dropped_fields();
        let mut node = self.node.clone();
        let mut changes = self.holds.as_ref().map(ContainerHolds::changes);
        let mut blocks = self.switch_blocks.as_ref().map(SwitchBlocks::changes);
        self.sync_once().await;
        loop {
            tokio::select! {
                biased;
                () = shutdown.cancelled() => return,
                changed = dropped.changed() => {
                    if changed.is_err() {
                        // The publisher is gone; nothing left to feed.
                        return;
                    }
                    let fields: Vec<String> = dropped
                        .borrow_and_update()
                        .iter()
                        .map(|f| f.field().to_string())
                        .collect();
                    self.on_dropped(&fields);
                }
                () = owner::changed(&mut node) => {}
                Ok(()) = async {
                    match &mut changes {
                        Some(c) => c.changed().await,
                        None => std::future::pending().await,
                    }
                } => {}
                Ok(()) = async {
                    match &mut blocks {
                        Some(b) => b.changed().await,
                        None => std::future::pending().await,
                    }
                } => {}
            }
            self.sync_once().await;
        }
    }

    fn on_dropped(&mut self, fields: &[String]) {
        if !self.withdraw_tainted && fields.iter().any(|f| f == TAINTS_FIELD) {
            tracing::warn!(
                "the API server drops device taints (feature gate DRADeviceTaints is off); GPUs \
                 the health monitor marks unhealthy, and devices whose MIG mode switch met \
                 IN_USE, are withdrawn from the slices instead of published tainted"
            );
            self.withdraw_tainted = true;
        }
        let lost: Vec<&str> = fields
            .iter()
            .map(String::as_str)
            .filter(|f| PARTITIONABLE_FIELDS.contains(f))
            .collect();
        let lost_consumable: Vec<&str> = fields
            .iter()
            .map(String::as_str)
            .filter(|f| CONSUMABLE_FIELDS.contains(f))
            .collect();
        if self.options.shared_capacity.enabled() && !lost_consumable.is_empty() {
            // Without `allowMultipleAllocations` the server stores each shareable GPU as a plain
            // device, which the scheduler hands out whole, and without `requestPolicy` a
            // capacity with nothing to say: publish the plain GPUs the server would store.
            tracing::warn!(
                fields = ?lost_consumable,
                "the API server drops fields shareable GPUs need (feature gate \
                 DRAConsumableCapacity is off); publishing each GPU as a plain whole GPU, \
                 allocated to one claim at a time. Enable the gate or run without \
                 --shared-capacity and --consumable-shares to silence this"
            );
            self.options.shared_capacity = ConsumableShares::Disabled;
        }
        let counting = self.options.partitionable || self.options.dynamic_mig;
        if counting && !self.fell_back && !lost.is_empty() {
            // Dynamic MIG needs the counters as much: without them a GPU offered whole and in
            // MIG placements could be handed out both ways at once. Each GPU is then published
            // by its current mode, as without the switch.
            let flags: Vec<&str> = [
                (self.options.partitionable, "--partitionable"),
                (self.options.dynamic_mig, "--dynamic-mig"),
            ]
            .into_iter()
            .filter_map(|(on, flag)| on.then_some(flag))
            .collect();
            tracing::warn!(
                fields = ?lost,
                "the API server drops the partitionable-device fields (feature gate \
                 DRAPartitionableDevices is off); publishing whole GPUs and existing MIG devices \
                 instead. Enable the gate or run without {} to silence this",
                flags.join(" and ")
            );
            self.options.partitionable = false;
            self.options.dynamic_mig = false;
            self.fell_back = true;
        }
    }

    /// Publishes new desired slices from the latest node if they changed.
    pub async fn sync_once(&mut self) {
        let node = self.node.borrow_and_update().node();
        let mut inv = match node {
            Ok(inv) => Inventory::clone(&inv),
            Err(e) => {
                tracing::warn!(error = %crate::report::chain(&e), "cannot read the inventory; keeping the published slices");
                return;
            }
        };
        if let Some(m) = &self.metrics {
            use std::sync::atomic::Ordering::Relaxed;
            let unhealthy = inv
                .gpus
                .iter()
                .map(|g| {
                    usize::from(!g.health.is_healthy())
                        + g.mig
                            .devices
                            .iter()
                            .filter(|d| !d.health.is_healthy())
                            .count()
                })
                .sum::<usize>();
            m.gpus.store(inv.gpus.len() as u64, Relaxed);
            m.unhealthy_devices.store(unhealthy as u64, Relaxed);
        }
        if let Some(blocks) = &self.switch_blocks {
            blocks.apply(&mut inv);
        }
        if self.withdraw_tainted {
            withdraw_tainted(&mut inv);
        }
        if let Some(holds) = &self.holds {
            hide_held(&mut inv, &holds.all());
        }
        let desired = match slices::desired_slices_withdrawing(
            &inv,
            &self.options,
            self.withdraw_tainted,
        ) {
            Ok(d) => pools(d),
            Err(e) => {
                tracing::error!(error = %e, "bug: the desired slices break an API rule; keeping the published ones (please report this)");
                return;
            }
        };
        if self.publisher.desired().is_some_and(|d| *d == desired) {
            return;
        }
        let (count, devices) = (
            desired.slice_count(),
            desired
                .pools
                .values()
                .flat_map(|p| &p.slices)
                .map(|s| s.devices.len())
                .sum::<usize>(),
        );
        match self.publisher.set_desired(desired) {
            Ok(_) => {
                tracing::info!(slices = count, devices, "desired ResourceSlices updated");
            }
            Err(e) => {
                tracing::error!(error = %crate::report::chain(&e), "bug: the publisher refused the desired slices")
            }
        }
    }
}

/// nvdra's slices as the publisher's input: each pool (there is one, named after the node) with
/// its slices' devices and counter sets in the order `desired_slices` made them, which is the
/// order the publisher names them in and so the scheduler's order of preference. The publisher
/// fills in driver, node, pool, generation and count as `desired_slices` did.
pub fn pools(specs: Vec<ResourceSliceSpec>) -> Resources {
    let mut out = Resources::default();
    for s in specs {
        out.pools
            .entry(s.pool.name)
            .or_default()
            .slices
            .push(Slice {
                devices: s.devices.unwrap_or_default(),
                shared_counters: s.shared_counters.unwrap_or_default(),
            });
    }
    out
}

/// Tainted GPUs and MIG devices become withdrawn ones (for a server that drops taints).
fn withdraw_tainted(inv: &mut Inventory) {
    use crate::inventory::Health;
    let withdraw = |h: &mut Health| {
        if let Health::Tainted { reason, .. } = h {
            *h = Health::Unhealthy {
                reason: std::mem::take(reason),
            };
        }
    };
    for g in &mut inv.gpus {
        withdraw(&mut g.health);
        for m in &mut g.mig.devices {
            withdraw(&mut m.health);
        }
    }
}

/// Marks every GPU or MIG device a container holds unhealthy in this copy of the inventory, so
/// it is not published (the health of the backend's inventory is not touched).
fn hide_held(inv: &mut Inventory, holds: &[(Occupied, Holder)]) {
    for (occ, holder) in holds {
        let Some(gpu) = inv.gpus.iter_mut().find(|g| g.uuid == occ.gpu) else {
            continue;
        };
        let reason = format!("held by {holder} through the device plugin");
        match &occ.mig {
            None => gpu.health = Health::Unhealthy { reason },
            Some((mig, _)) => {
                if let Some(d) = gpu.mig.devices.iter_mut().find(|d| d.uuid == *mig) {
                    d.health = Health::Unhealthy { reason };
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::dir::DirApi;
    use crate::inventory::DeviceBackend;
    use crate::inventory::owner::Owner;
    use crate::inventory::sim::SimBackend;
    use kubelet_plugin::publisher::Publisher;
    use std::sync::atomic::Ordering::Relaxed;

    #[tokio::test]
    async fn each_inventory_read_updates_the_gpu_metrics() {
        let dir = tempfile::tempdir().unwrap();
        let api = Arc::new(DirApi::new(dir.path().to_path_buf()).unwrap());
        let (_publisher, handle) = Publisher::new(api, "gpu.nvidia.com", "n1");
        let sim = SimBackend::from_profile("a100-mig-mixed", "n1").unwrap();
        let metrics = Metrics::new();
        let options = SliceOptions {
            driver: "gpu.nvidia.com".into(),
            node_name: "n1".into(),
            partitionable: false,
            shared_capacity: ConsumableShares::Disabled,
            dynamic_mig: false,
            mig_profiles: None,
            layout: CounterLayout::Separate,
        };
        let hour = std::time::Duration::from_secs(3600);
        let (mut owner, inventory) = Owner::new(Arc::new(sim.clone()), hour, hour).unwrap();
        owner.read().await.unwrap();
        let mut sync =
            SliceSync::new(inventory.subscribe(), handle, options).with_metrics(metrics.clone());
        sync.sync_once().await;
        assert_eq!(metrics.gpus.load(Relaxed), 4);
        assert_eq!(metrics.unhealthy_devices.load(Relaxed), 0);

        sim.update(|inv| {
            inv.gpus[0].health = Health::Unhealthy {
                reason: "XID 79".into(),
            };
            inv.gpus[1].mig.devices[0].health = Health::Unhealthy {
                reason: "XID 94".into(),
            };
        });
        owner.read().await.unwrap();
        sync.sync_once().await;
        assert_eq!(metrics.unhealthy_devices.load(Relaxed), 2);
        let desired = sync.publisher.desired().unwrap();
        let names: Vec<&str> = desired
            .pools
            .values()
            .flat_map(|p| &p.slices)
            .flat_map(|s| &s.devices)
            .map(|d| d.name.as_str())
            .collect();
        assert!(!names.contains(&"gpu-0"), "{names:?}");
    }

    #[test]
    fn held_gpus_and_mig_devices_are_hidden_and_nothing_else() {
        use crate::holds::ContainerRef;
        let mut inv = SimBackend::from_profile("a100-mig-mixed", "n1")
            .unwrap()
            .snapshot()
            .unwrap();
        let whole = inv.gpus.iter().position(|g| !g.in_mig_mode()).unwrap();
        let mig = inv
            .gpus
            .iter()
            .position(|g| g.mig.devices.len() > 1)
            .unwrap();
        let m0 = inv.gpus[mig].mig.devices[0].clone();
        let pod = Holder::Container(ContainerRef {
            namespace: "ns".into(),
            pod: "p".into(),
            container: "c".into(),
        });
        let holds = vec![
            (
                Occupied {
                    gpu: inv.gpus[whole].uuid.clone(),
                    mig: None,
                },
                pod.clone(),
            ),
            (
                Occupied {
                    gpu: inv.gpus[mig].uuid.clone(),
                    mig: Some((m0.uuid.clone(), m0.placement)),
                },
                pod,
            ),
        ];
        hide_held(&mut inv, &holds);
        let unhealthy: Vec<String> = inv
            .gpus
            .iter()
            .filter(|g| !g.health.is_healthy())
            .map(|g| g.uuid.to_string())
            .chain(
                inv.gpus
                    .iter()
                    .flat_map(|g| &g.mig.devices)
                    .filter(|d| !d.health.is_healthy())
                    .map(|d| d.uuid.to_string()),
            )
            .collect();
        assert_eq!(
            unhealthy,
            vec![inv.gpus[whole].uuid.to_string(), m0.uuid.to_string()]
        );
        assert!(inv.gpus[mig].health.is_healthy());
    }

    #[test]
    fn layout_follows_the_server_version() {
        assert_eq!(layout_for(Some(34)), CounterLayout::Together);
        assert_eq!(layout_for(Some(33)), CounterLayout::Together);
        assert_eq!(layout_for(Some(35)), CounterLayout::Separate);
        assert_eq!(layout_for(Some(37)), CounterLayout::Separate);
        assert_eq!(layout_for(None), CounterLayout::Separate);
    }
}
