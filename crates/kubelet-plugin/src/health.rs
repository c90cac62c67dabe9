//! DRA resource health (KEP-4680): the `DRAResourceHealth/NodeWatchResources` stream the kubelet
//! reads to show device health in pod status, served as `v1alpha1`, `v1beta1` and `v1` (the same
//! messages in three proto packages; all three advertised at registration).
//!
//! Each message is the complete list of the driver's devices, from its [`HealthSource`], because
//! the kubelet marks a device `Unknown` when it is not re-reported within its timeout (30 s). A
//! stream sends the list on connect, again as soon as the source says it changed, and at least
//! every [`INTERVAL`]; it ends when the plugin shuts down, so a graceful stop never waits on an
//! open stream.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use futures::stream::BoxStream;
use futures::{Stream, StreamExt};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::proto::health::v1alpha1::{
    DeviceIdentifier, HealthStatus, NodeWatchResourcesRequest, NodeWatchResourcesResponse,
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

/// One device's health, as the driver sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeviceHealth {
    /// The device's pool.
    pub pool: String,
    /// The device's name in its pool.
    pub device: String,
    /// `None` is healthy; `Some(cause)` is unhealthy, and the cause is shown to users.
    pub problem: Option<String>,
}

impl DeviceHealth {
    /// `device` of `pool` is healthy.
    pub fn healthy(pool: impl Into<String>, device: impl Into<String>) -> Self {
        Self {
            pool: pool.into(),
            device: device.into(),
            problem: None,
        }
    }

    /// `device` of `pool` is unhealthy because of `problem` (shown to users).
    pub fn unhealthy(
        pool: impl Into<String>,
        device: impl Into<String>,
        problem: impl Into<String>,
    ) -> Self {
        Self {
            problem: Some(problem.into()),
            ..Self::healthy(pool, device)
        }
    }
}

/// The error a [`HealthSource`] may fail with; the stream logs it and skips one round.
pub type Error = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Where the health stream gets its device list.
pub trait HealthSource: Send + Sync + 'static {
    /// The health of every device the driver publishes.
    fn device_health(&self) -> BoxFuture<'_, Result<Vec<DeviceHealth>, Error>>;

    /// Yields whenever the health may have changed, so streams re-send at once instead of at
    /// the next interval. Each stream takes its own. The default never yields.
    fn changes(&self) -> BoxStream<'static, ()> {
        futures::stream::pending().boxed()
    }
}

/// A driver that reports no health: an empty device list.
pub struct NoHealth;

impl HealthSource for NoHealth {
    fn device_health(&self) -> BoxFuture<'_, Result<Vec<DeviceHealth>, Error>> {
        Box::pin(async { Ok(Vec::new()) })
    }
}

/// The message every version sends: `devices` in name order, stamped `now_unix`.
pub fn message(mut devices: Vec<DeviceHealth>, now_unix: i64) -> NodeWatchResourcesResponse {
    devices.sort_by(|a, b| a.device.cmp(&b.device));
    let devices = devices
        .into_iter()
        .map(|d| {
            let DeviceHealth {
                pool,
                device,
                problem,
            } = d;
            let (status, message) = match problem {
                None => (HealthStatus::Healthy, String::new()),
                Some(cause) => (HealthStatus::Unhealthy, cause),
            };
            crate::proto::health::v1alpha1::DeviceHealth {
                device: Some(DeviceIdentifier {
                    pool_name: pool,
                    device_name: device,
                }),
                health: status as i32,
                last_updated_time: now_unix,
                // 0: the kubelet's default timeout.
                health_check_timeout_seconds: 0,
                message,
            }
        })
        .collect();
    NodeWatchResourcesResponse { devices }
}

/// The health streams; cheap to clone.
#[derive(Clone)]
pub struct HealthService {
    source: Arc<dyn HealthSource>,
    interval: Duration,
    shutdown: CancellationToken,
}

impl HealthService {
    /// Streams `source`'s list, re-sent at least every `interval`, until `shutdown`.
    pub fn new(
        source: Arc<dyn HealthSource>,
        interval: Duration,
        shutdown: CancellationToken,
    ) -> Self {
        Self {
            source,
            interval,
            shutdown,
        }
    }

    async fn message(&self) -> Result<NodeWatchResourcesResponse, Error> {
        let devices = self.source.device_health().await?;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
            .unwrap_or_default();
        Ok(message(devices, now))
    }

    /// The stream every version serves (their messages are one type: see `build.rs`).
    fn stream(&self) -> HealthStream {
        tracing::debug!("health stream opened");
        let (tx, rx) = mpsc::channel(1);
        let svc = self.clone();
        let mut changes = self.source.changes();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(svc.interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    biased;
                    () = svc.shutdown.cancelled() => break,
                    () = tx.closed() => break,
                    Some(()) = changes.next() => tick.reset(),
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
                        tracing::warn!(error = %crate::report::chain(&*e), "cannot read device health")
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
    use crate::proto::health::v1alpha1::dra_resource_health_server::DraResourceHealth;
    use std::sync::Mutex;
    use tokio::sync::watch;

    /// A device list the test sets, with a change notice on each set.
    struct Devices {
        list: Mutex<Vec<DeviceHealth>>,
        changed: watch::Sender<()>,
    }

    impl HealthSource for Devices {
        fn device_health(&self) -> BoxFuture<'_, Result<Vec<DeviceHealth>, Error>> {
            let list = self.list.lock().unwrap().clone();
            Box::pin(async move { Ok(list) })
        }
        fn changes(&self) -> BoxStream<'static, ()> {
            tokio_stream::wrappers::WatchStream::from_changes(self.changed.subscribe()).boxed()
        }
    }

    fn device(name: &str, problem: Option<&str>) -> DeviceHealth {
        DeviceHealth {
            pool: "n".into(),
            device: name.into(),
            problem: problem.map(String::from),
        }
    }

    #[test]
    fn the_message_lists_devices_in_name_order_with_their_cause() {
        let m = message(vec![device("b", Some("XID 79")), device("a", None)], 7);
        let summary: Vec<(String, i32, String, i64)> = m
            .devices
            .iter()
            .map(|d| {
                let id = d.device.as_ref().unwrap();
                assert_eq!(id.pool_name, "n");
                (
                    id.device_name.clone(),
                    d.health,
                    d.message.clone(),
                    d.last_updated_time,
                )
            })
            .collect();
        assert_eq!(
            summary,
            vec![
                ("a".into(), HealthStatus::Healthy as i32, String::new(), 7),
                (
                    "b".into(),
                    HealthStatus::Unhealthy as i32,
                    "XID 79".into(),
                    7
                ),
            ]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_change_is_sent_at_once_and_the_stream_ends_on_shutdown() {
        let (changed, _) = watch::channel(());
        let source = Arc::new(Devices {
            list: Mutex::new(vec![device("a", None)]),
            changed,
        });
        let stop = CancellationToken::new();
        let svc = HealthService::new(source.clone(), Duration::from_secs(3600), stop.clone());
        let mut stream = svc
            .node_watch_resources(Request::new(NodeWatchResourcesRequest {}))
            .await
            .unwrap()
            .into_inner();
        let first = stream.next().await.unwrap().unwrap();
        assert_eq!(first.devices[0].health, HealthStatus::Healthy as i32);
        let before = tokio::time::Instant::now();
        *source.list.lock().unwrap() = vec![device("a", Some("fell off the bus"))];
        source.changed.send_replace(());
        let second = stream.next().await.unwrap().unwrap();
        assert_eq!(second.devices[0].message, "fell off the bus");
        assert!(
            before.elapsed() < Duration::from_secs(3600),
            "not the interval's resend"
        );
        stop.cancel();
        assert!(stream.next().await.is_none(), "the stream ends on shutdown");
    }
}
