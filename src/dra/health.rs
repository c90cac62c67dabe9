//! DRA resource health (KEP-4680): the `DRAResourceHealth/NodeWatchResources` stream the kubelet
//! reads to show device health in pod status, served as `v1alpha1`, `v1beta1` and `v1` (the same
//! messages in three proto packages; all three advertised at registration).
//!
//! Each message is the complete list of this node's devices (whole GPUs outside MIG mode, and
//! existing MIG devices), each `HEALTHY` or `UNHEALTHY` with the cause in `message`, because the
//! kubelet marks a device `Unknown` when it is not re-reported within its timeout (30 s). A stream
//! sends the list on connect, again as soon as the health monitor's state changes
//! (`crate::health`), and at least every [`INTERVAL`]; it ends when the plugin shuts down, so a
//! graceful stop never waits on an open stream.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::Stream;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::ids::DeviceName;
use crate::inventory::{self, DeviceBackend, Health, Inventory};
use crate::proto::health::v1alpha1::{
    DeviceHealth, DeviceIdentifier, HealthStatus, NodeWatchResourcesRequest,
    NodeWatchResourcesResponse,
};
use crate::proto::health::{v1, v1alpha1, v1beta1};

/// How often the full list is re-sent without a change: under 15 s, so a device stays known to
/// the kubelet (30 s default timeout) even when one message is lost.
pub const INTERVAL: Duration = Duration::from_secs(10);

/// The `supported_versions` entries of the health services, newest first (each is also the
/// gRPC service name).
pub const SERVICES: [&str; 3] = [
    "v1.DRAResourceHealth",
    "v1beta1.DRAResourceHealth",
    "v1alpha1.DRAResourceHealth",
];

/// The health of every device on the node, in name order.
pub fn device_health(inv: &Inventory, pool: &str, now_unix: i64) -> Vec<DeviceHealth> {
    let entry = |name: DeviceName, health: &Health| {
        let (status, message) = match health {
            Health::Healthy => (HealthStatus::Healthy, String::new()),
            Health::Unhealthy { reason } | Health::Tainted { reason, .. } => {
                (HealthStatus::Unhealthy, reason.clone())
            }
        };
        DeviceHealth {
            device: Some(DeviceIdentifier {
                pool_name: pool.to_string(),
                device_name: name.as_str().to_string(),
            }),
            health: status as i32,
            last_updated_time: now_unix,
            // 0: the kubelet's default timeout.
            health_check_timeout_seconds: 0,
            message,
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
    out.sort_by(|a, b| {
        let name = |d: &DeviceHealth| d.device.as_ref().map(|i| i.device_name.clone());
        name(a).cmp(&name(b))
    });
    out
}

/// The health streams; cheap to clone.
#[derive(Clone)]
pub struct HealthService {
    backend: Arc<dyn DeviceBackend>,
    pool: String,
    interval: Duration,
    shutdown: CancellationToken,
    health: Option<crate::health::Watch>,
}

impl HealthService {
    /// `backend` should carry the monitor's health ([`crate::health::Monitored`]).
    pub fn new(
        backend: Arc<dyn DeviceBackend>,
        pool: String,
        interval: Duration,
        shutdown: CancellationToken,
    ) -> Self {
        Self {
            backend,
            pool,
            interval,
            shutdown,
            health: None,
        }
    }

    /// Re-sends as soon as the monitor's state changes, not only every interval.
    pub fn with_health(mut self, health: crate::health::Watch) -> Self {
        self.health = Some(health);
        self
    }

    async fn message(&self) -> Result<NodeWatchResourcesResponse, inventory::Error> {
        let inv = inventory::refresh(self.backend.clone()).await?;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
            .unwrap_or_default();
        Ok(NodeWatchResourcesResponse {
            devices: device_health(&inv, &self.pool, now),
        })
    }

    /// The stream every version serves (their messages are one type: see `build.rs`).
    fn stream(&self) -> HealthStream {
        tracing::debug!("health stream opened");
        let (tx, rx) = mpsc::channel(1);
        let svc = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(svc.interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut health = svc.health.clone();
            if let Some(h) = &mut health {
                h.mark_unchanged();
            }
            loop {
                tokio::select! {
                    biased;
                    () = svc.shutdown.cancelled() => break,
                    () = tx.closed() => break,
                    Some(()) = crate::health::changed(&mut health) => tick.reset(),
                    _ = tick.tick() => {}
                }
                match svc.message().await {
                    Ok(m) => {
                        if tx.send(Ok(m)).await.is_err() {
                            break;
                        }
                    }
                    // Skipping one round is better than ending the stream: the kubelet only
                    // marks devices Unknown after its timeout.
                    Err(e) => {
                        tracing::warn!(error = %crate::report::chain(&e), "cannot read device health")
                    }
                }
            }
            tracing::debug!("health stream closed");
        });
        Box::pin(ReceiverStream::new(rx))
    }
}

type HealthStream = Pin<Box<dyn Stream<Item = Result<NodeWatchResourcesResponse, Status>> + Send>>;

/// The `v1beta1` service: the same stream.
#[derive(Clone)]
pub struct HealthV1beta1(pub HealthService);

/// The `v1` service: the same stream.
#[derive(Clone)]
pub struct HealthV1(pub HealthService);

/// One version's `DraResourceHealth` over the shared stream; `$svc` reaches the service.
macro_rules! serve_version {
    ($ty:ty, $server:path, |$s:ident| $svc:expr) => {
        #[tonic::async_trait]
        impl $server for $ty {
            type NodeWatchResourcesStream = HealthStream;

            async fn node_watch_resources(
                &self,
                request: Request<NodeWatchResourcesRequest>,
            ) -> Result<Response<Self::NodeWatchResourcesStream>, Status> {
                let NodeWatchResourcesRequest {} = request.into_inner();
                let $s = self;
                Ok(Response::new($svc.stream()))
            }
        }
    };
}

serve_version!(
    HealthService,
    v1alpha1::dra_resource_health_server::DraResourceHealth,
    |s| s
);
serve_version!(
    HealthV1beta1,
    v1beta1::dra_resource_health_server::DraResourceHealth,
    |s| s.0
);
serve_version!(
    HealthV1,
    v1::dra_resource_health_server::DraResourceHealth,
    |s| s.0
);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::health::{BackendProbe, Event, EventKind, Monitor, Monitored, Policy};
    use crate::inventory::sim::SimBackend;
    use crate::proto::health::v1::dra_resource_health_server::DraResourceHealth as _;
    use crate::proto::health::v1alpha1::dra_resource_health_server::DraResourceHealth;
    use crate::proto::health::v1beta1::dra_resource_health_server::DraResourceHealth as _;
    use futures::StreamExt;

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
        let svc = HealthService::new(
            Arc::new(sim.clone()),
            "n".into(),
            Duration::from_secs(10),
            stop.clone(),
        );
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
        let inner: Arc<dyn DeviceBackend> = Arc::new(sim.clone());
        let (monitor, handle) = Monitor::new(
            Policy {
                quiet_period: Duration::from_secs(60),
                probe_interval: Duration::from_secs(5),
                ..Policy::default()
            },
            Arc::new(BackendProbe(inner.clone())),
        );
        let stop = CancellationToken::new();
        tokio::spawn(monitor.run(stop.clone()));
        let backend = Arc::new(Monitored::new(inner, handle.subscribe()));
        let svc = HealthService::new(backend, "n".into(), INTERVAL, stop.clone())
            .with_health(handle.subscribe());
        let mut alpha = svc.stream();
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
            tx.send(Event {
                gpu: gpu3.uuid.clone(),
                kind,
            })
            .await
            .unwrap();
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
}
