//! DRA resource health (KEP-4680) for nvdra's devices: the [`HealthSource`] the library's
//! health stream (`kubelet_plugin::health`) reads. It lists whole GPUs outside MIG mode and
//! existing MIG devices, each healthy or with the cause, from the inventory owner's latest
//! publication (the node with the health monitor's state laid over it), and wakes the streams
//! on each publication.
//! A MIG device is unhealthy with its GPU, or alone with a fault of its own instance (an XID
//! NVML attributed to it, or to an instance on the same memory slices).

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use futures::future::BoxFuture;
use futures::stream::BoxStream;
use kubelet_plugin::health::{self as plugin_health, HealthSource};
use tokio_util::sync::CancellationToken;

use crate::ids::DeviceName;
use crate::inventory::owner::{Published, Watch};
use crate::inventory::{Health, Inventory};

pub use kubelet_plugin::health::{HealthService, INTERVAL};

/// The health of every device on the node.
fn devices(inv: &Inventory, pool: &str) -> Vec<plugin_health::DeviceHealth> {
    let entry = |name: DeviceName, health: &Health| match health {
        Health::Healthy => plugin_health::DeviceHealth::healthy(pool, name.as_str()),
        Health::Unhealthy { reason } | Health::Tainted { reason, .. } => {
            plugin_health::DeviceHealth::unhealthy(pool, name.as_str(), reason.clone())
        }
    };
    let mut out = Vec::new();
    for g in &inv.gpus {
        if !g.in_mig_mode() {
            out.push(entry(DeviceName::gpu(g.minor), &g.health));
            continue;
        }
        for m in &g.mig.devices {
            // A MIG device is as sick as its parent.
            let health = if g.health.is_healthy() {
                &m.health
            } else {
                &g.health
            };
            out.push(entry(
                DeviceName::mig(g.minor, &m.profile, m.gi_profile_id, m.placement.start),
                health,
            ));
        }
    }
    out
}

/// The node's devices as a [`HealthSource`]: their health is the owner's latest publication's.
#[derive(Clone)]
pub struct NodeHealth {
    node: Watch,
    pool: String,
}

impl NodeHealth {
    pub fn new(node: Watch, pool: impl Into<String>) -> Self {
        Self {
            node,
            pool: pool.into(),
        }
    }

    /// The library's health service over this source.
    pub fn service(self, interval: Duration, shutdown: CancellationToken) -> HealthService {
        HealthService::new(Arc::new(self), interval, shutdown)
    }
}

impl HealthSource for NodeHealth {
    fn device_health(
        &self,
    ) -> BoxFuture<'_, Result<Vec<plugin_health::DeviceHealth>, plugin_health::Error>> {
        Box::pin(async move {
            let node = self.node.borrow().node()?;
            Ok(devices(&node, &self.pool))
        })
    }

    /// Every publication that changes the list: a health transition, a MIG change. A rescan
    /// that finds the node as it was sends nothing before the interval's resend.
    fn changes(&self) -> BoxStream<'static, ()> {
        let mut node = self.node.clone();
        let pool = self.pool.clone();
        let list = move |p: &Published| p.node().ok().map(|inv| devices(&inv, &pool));
        let mut last = list(&node.borrow_and_update());
        tokio_stream::wrappers::WatchStream::from_changes(node)
            .filter_map(move |p| {
                let now = list(&p);
                let changed = now != last;
                last = now;
                std::future::ready(changed.then_some(()))
            })
            .boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::health::{Event, EventKind, Monitor, MonitorHandle, Policy};
    use crate::inventory::owner::{InventoryHandle, Owner};
    use crate::inventory::sim::SimBackend;
    use crate::inventory::{DeviceBackend, Reconfigure};
    use futures::StreamExt;
    use kubelet_plugin::health::{HealthV1, HealthV1beta1};
    use kubelet_plugin::proto::health::v1::dra_resource_health_server::DraResourceHealth as _;
    use kubelet_plugin::proto::health::v1alpha1::DeviceHealth;
    use kubelet_plugin::proto::health::v1alpha1::dra_resource_health_server::DraResourceHealth;
    use kubelet_plugin::proto::health::v1alpha1::{HealthStatus, NodeWatchResourcesRequest};
    use kubelet_plugin::proto::health::v1beta1::dra_resource_health_server::DraResourceHealth as _;
    use kubelet_plugin::proto::health::{v1, v1beta1};
    use tonic::Request;

    /// `inv` published as an owner would, and the sender of the next publications.
    fn published(inv: Inventory) -> (tokio::sync::watch::Sender<Published>, Watch) {
        tokio::sync::watch::channel(Published {
            node: Some(Arc::new(inv)),
            ..Published::default()
        })
    }

    /// `sim`'s owner, read once, and a health monitor under `policy` probing through it; the
    /// owner follows the monitor (no rescan: reads only when asked), as in `nvdra run`.
    async fn monitored(
        sim: &SimBackend,
        policy: Policy,
        stop: &CancellationToken,
    ) -> (MonitorHandle, InventoryHandle) {
        // Reads answer in real time, while a paused clock jumps from timer to timer (the
        // monitor's probes, so it runs before the first read): a deadline that none of those
        // jumps reaches.
        let (hour, year) = (Duration::from_secs(3600), Duration::from_secs(365 * 86400));
        let (mut owner, inventory) = Owner::new(Arc::new(sim.clone()), hour, year).unwrap();
        let (monitor, handle) = Monitor::new(policy, Arc::new(inventory.clone()));
        tokio::spawn(monitor.run(stop.clone()));
        owner.read().await.unwrap();
        tokio::spawn(owner.run(handle.subscribe(), stop.clone()));
        (handle, inventory)
    }

    /// The health of every device on the node, in name order, as the stream sends it.
    fn device_health(inv: &Inventory, pool: &str, now_unix: i64) -> Vec<DeviceHealth> {
        plugin_health::message(devices(inv, pool), now_unix).devices
    }

    #[test]
    fn every_device_is_listed_with_its_health() {
        let sim = SimBackend::from_profile("a100-mig-mixed", "n").unwrap();
        sim.update(|inv| {
            inv.gpus[0].health = Health::Unhealthy {
                reason: "XID 79".into(),
            };
            inv.gpus[2].health = Health::Unhealthy {
                reason: "GPU lost".into(),
            };
        });
        let inv = sim.snapshot().unwrap();
        let list = device_health(&inv, "n", 7);
        let summary: Vec<(String, i32, String)> = list
            .iter()
            .map(|d| {
                (
                    d.device.as_ref().unwrap().device_name.clone(),
                    d.health,
                    d.message.clone(),
                )
            })
            .collect();
        let h = HealthStatus::Healthy as i32;
        let u = HealthStatus::Unhealthy as i32;
        assert_eq!(
            summary,
            vec![
                ("gpu-0".into(), u, "XID 79".into()),
                ("gpu-1-mig-1g5gb-19-2".into(), h, String::new()),
                ("gpu-1-mig-1g5gb-19-3".into(), h, String::new()),
                ("gpu-1-mig-2g10gb-14-0".into(), h, String::new()),
                ("gpu-1-mig-3g20gb-9-4".into(), h, String::new()),
                ("gpu-2-mig-1g10gb-15-0".into(), u, "GPU lost".into()),
                ("gpu-2-mig-1g10gb-15-2".into(), u, "GPU lost".into()),
                ("gpu-2-mig-1g10gb-15-4".into(), u, "GPU lost".into()),
                ("gpu-3".into(), h, String::new()),
            ]
        );
        assert!(
            list.iter()
                .all(|d| d.last_updated_time == 7 && d.device.as_ref().unwrap().pool_name == "n")
        );
    }

    #[tokio::test(start_paused = true)]
    async fn stream_resends_the_full_list_and_ends_on_shutdown() {
        let sim = SimBackend::from_profile("l40s-pcie", "n").unwrap();
        let stop = CancellationToken::new();
        let (tx, node) = published(sim.snapshot().unwrap());
        let svc = NodeHealth::new(node, "n").service(Duration::from_secs(10), stop.clone());
        let mut stream = svc
            .node_watch_resources(Request::new(NodeWatchResourcesRequest {}))
            .await
            .unwrap()
            .into_inner();
        let first = stream.next().await.unwrap().unwrap();
        assert_eq!(first.devices.len(), 4);
        assert!(
            first
                .devices
                .iter()
                .all(|d| d.health == HealthStatus::Healthy as i32)
        );
        sim.update(|inv| {
            inv.gpus[1].health = Health::Unhealthy {
                reason: "XID 48".into(),
            }
        });
        tx.send_modify(|p| p.node = Some(Arc::new(sim.snapshot().unwrap())));
        let second = stream.next().await.unwrap().unwrap();
        assert_eq!(second.devices.len(), 4, "always the full list");
        assert_eq!(second.devices[1].health, HealthStatus::Unhealthy as i32);
        assert_eq!(second.devices[1].message, "XID 48");
        stop.cancel();
        assert!(stream.next().await.is_none(), "the stream ends on shutdown");
    }

    #[tokio::test(start_paused = true)]
    async fn a_monitored_xid_is_streamed_at_once_on_every_version_and_resent_each_interval() {
        let sim = SimBackend::from_profile("dgx-a100-mig", "n").unwrap();
        // Two MIG devices on GPU 3 (the profile's GPUs are in MIG mode without instances).
        let g = sim.snapshot().unwrap().gpus[3].clone();
        let p = &g.mig.profiles[0];
        for pl in &p.placements[..2] {
            sim.create_mig(&g.uuid, p.gi_profile_id, *pl).unwrap();
        }
        let gpu3 = sim.snapshot().unwrap().gpus[3].clone();
        let policy = Policy {
            quiet_period: Duration::from_secs(60),
            probe_interval: Duration::from_secs(5),
            ..Policy::default()
        };
        let stop = CancellationToken::new();
        let (handle, owner) = monitored(&sim, policy, &stop).await;
        let node = owner.subscribe();
        let svc = NodeHealth::new(node, "n").service(INTERVAL, stop.clone());
        let mut alpha = svc
            .node_watch_resources(Request::new(NodeWatchResourcesRequest {}))
            .await
            .unwrap()
            .into_inner();
        let mut beta = HealthV1beta1(svc.clone())
            .node_watch_resources(Request::new(v1beta1::NodeWatchResourcesRequest {}))
            .await
            .unwrap()
            .into_inner();
        let mut ga = HealthV1(svc.clone())
            .node_watch_resources(Request::new(v1::NodeWatchResourcesRequest {}))
            .await
            .unwrap()
            .into_inner();
        let first = alpha.next().await.unwrap().unwrap();
        let all = first.devices.len();
        assert!(
            first
                .devices
                .iter()
                .all(|d| d.health == HealthStatus::Healthy as i32)
        );
        assert_eq!(beta.next().await.unwrap().unwrap().devices.len(), all);
        assert_eq!(ga.next().await.unwrap().unwrap().devices.len(), all);

        let tx = handle.events();
        // Ignored first: the next message must be the critical one.
        for kind in [EventKind::Xid(43), EventKind::Xid(94)] {
            tx.send(Event::gpu(gpu3.uuid.clone(), kind)).await.unwrap();
        }
        let start = tokio::time::Instant::now();
        let sick = |names: Vec<(String, i32, String)>| {
            names
                .into_iter()
                .filter(|(_, h, _)| *h == HealthStatus::Unhealthy as i32)
                .map(|(n, _, m)| (n, m))
                .collect::<Vec<_>>()
        };
        let expected: Vec<(String, String)> = gpu3
            .mig
            .devices
            .iter()
            .map(|m| {
                (
                    DeviceName::mig(gpu3.minor, &m.profile, m.gi_profile_id, m.placement.start)
                        .as_str()
                        .to_string(),
                    "XID 94 (contained ECC error)".to_string(),
                )
            })
            .collect();
        assert_eq!(expected.len(), 2);
        let m = alpha.next().await.unwrap().unwrap();
        assert!(
            start.elapsed() < INTERVAL,
            "sent on the change, not the tick"
        );
        assert_eq!(m.devices.len(), all, "always the full list");
        let got = sick(
            m.devices
                .into_iter()
                .map(|d| (d.device.unwrap().device_name, d.health, d.message))
                .collect(),
        );
        assert_eq!(got, expected, "exactly GPU 3's MIG devices");
        let b = beta.next().await.unwrap().unwrap();
        let got = sick(
            b.devices
                .into_iter()
                .map(|d| (d.device.unwrap().device_name, d.health, d.message))
                .collect(),
        );
        assert_eq!(got, expected, "v1beta1");
        let g = ga.next().await.unwrap().unwrap();
        let got = sick(
            g.devices
                .into_iter()
                .map(|d| (d.device.unwrap().device_name, d.health, d.message))
                .collect(),
        );
        assert_eq!(got, expected, "v1");

        // Nothing changes: the list comes again within the interval.
        let before = tokio::time::Instant::now();
        let again = alpha.next().await.unwrap().unwrap();
        assert!(before.elapsed() <= INTERVAL);
        assert_eq!(again.devices.len(), all);

        // Recovery (quiet period over, probe answers) is streamed too.
        loop {
            let m = alpha.next().await.unwrap().unwrap();
            if m.devices
                .iter()
                .all(|d| d.health == HealthStatus::Healthy as i32)
            {
                break;
            }
        }
        assert!(
            start.elapsed() >= Duration::from_secs(60),
            "not before the quiet period"
        );
        stop.cancel();
        assert!(alpha.next().await.is_none());
    }

    /// Dynamic MIG switches a GPU's MIG mode at run time: a fault the monitor holds for the GPU
    /// follows it into whatever it is listed as, its MIG devices while in MIG mode and the GPU
    /// whole again after, each listing read fresh.
    #[tokio::test(start_paused = true)]
    async fn a_gpu_fault_follows_the_gpu_through_mig_mode_changes() {
        let sim = SimBackend::from_profile("dgx-h100", "n").unwrap();
        let g0 = sim.snapshot().unwrap().gpus[0].clone();
        let policy = Policy {
            quiet_period: Duration::from_secs(3600),
            ..Policy::default()
        };
        let stop = CancellationToken::new();
        let (handle, owner) = monitored(&sim, policy, &stop).await;
        let source = NodeHealth::new(owner.subscribe(), "n");
        let sick = || async {
            let list = source.device_health().await.unwrap();
            plugin_health::message(list, 0)
                .devices
                .into_iter()
                .filter(|d| d.health == HealthStatus::Unhealthy as i32)
                .map(|d| d.device.unwrap().device_name)
                .collect::<Vec<_>>()
        };
        let mut changed = owner.subscribe();
        changed.mark_unchanged();
        handle
            .events()
            .send(Event::gpu(g0.uuid.clone(), EventKind::Xid(94)))
            .await
            .unwrap();
        changed.changed().await.unwrap();
        assert_eq!(sick().await, vec!["gpu-0".to_string()]);

        // The owner's reads below answer in real time: a paused clock would jump past the
        // quiet period meanwhile.
        tokio::time::resume();
        sim.set_mig_mode(&g0.uuid, true).unwrap();
        let p = g0
            .mig
            .profiles
            .iter()
            .find(|p| p.name == "1g.10gb")
            .unwrap();
        let m = sim
            .create_mig(&g0.uuid, p.gi_profile_id, p.placements[0])
            .unwrap();
        owner.refresh().await.unwrap();
        let name = DeviceName::mig(g0.minor, &m.profile, m.gi_profile_id, m.placement.start);
        assert_eq!(sick().await, vec![name.as_str().to_string()]);

        sim.destroy_mig(&g0.uuid, &m.uuid).unwrap();
        sim.set_mig_mode(&g0.uuid, false).unwrap();
        owner.refresh().await.unwrap();
        assert_eq!(sick().await, vec!["gpu-0".to_string()]);
        stop.cancel();
    }
}
