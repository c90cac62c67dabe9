//! DRA resource health (KEP-4680): the `v1alpha1.DRAResourceHealth/NodeWatchResources` stream the
//! kubelet reads to show device health in pod status.
//!
//! Each message is the complete list of this node's devices (whole GPUs outside MIG mode, and
//! existing MIG devices), each `HEALTHY` or `UNHEALTHY` with the reason, because the kubelet marks
//! a device `Unknown` when it is not re-reported within its timeout (30 s). A stream sends the list
//! on connect and then every [`INTERVAL`], and ends when the plugin shuts down, so a graceful stop
//! never waits on an open stream.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::Stream;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use super::slices::DeviceName;
use crate::inventory::{self, DeviceBackend, Health, Inventory};
use crate::proto::health::v1alpha1::{
    DeviceHealth, DeviceIdentifier, HealthStatus, NodeWatchResourcesRequest,
    NodeWatchResourcesResponse, dra_resource_health_server::DraResourceHealth,
};

/// How often the full list is re-sent; well under the kubelet's 30 s default timeout.
pub const INTERVAL: Duration = Duration::from_secs(10);

/// The `supported_versions` entry for this service (it is also the gRPC service name).
pub const SERVICE: &str = "v1alpha1.DRAResourceHealth";

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

/// The gRPC service; cheap to clone.
#[derive(Clone)]
pub struct HealthService {
    backend: Arc<dyn DeviceBackend>,
    pool: String,
    interval: Duration,
    shutdown: CancellationToken,
}

impl HealthService {
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
        }
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
}

type HealthStream = Pin<Box<dyn Stream<Item = Result<NodeWatchResourcesResponse, Status>> + Send>>;

#[tonic::async_trait]
impl DraResourceHealth for HealthService {
    type NodeWatchResourcesStream = HealthStream;

    async fn node_watch_resources(
        &self,
        request: Request<NodeWatchResourcesRequest>,
    ) -> Result<Response<Self::NodeWatchResourcesStream>, Status> {
        let NodeWatchResourcesRequest {} = request.into_inner();
        tracing::debug!("health stream opened");
        let (tx, rx) = mpsc::channel(1);
        let svc = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(svc.interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    biased;
                    () = svc.shutdown.cancelled() => break,
                    () = tx.closed() => break,
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
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::sim::SimBackend;
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
}
