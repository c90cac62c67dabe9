//! A DRA driver as it runs in a cluster: one pod per node of a DaemonSet (manifests in
//! `examples/deploy/`, explained in the crate README's "Deploy").
//!
//! It publishes two fake devices, `dev-0` and `dev-1`, in the node's pool, serves the kubelet
//! (registration, prepare and unprepare, device health), answers a readiness probe, and stops
//! cleanly on SIGTERM (the signal the kubelet sends a pod it deletes, for instance during a
//! rolling update): sockets removed, the publisher stopped.
//!
//! Environment:
//!
//! - `NODE_NAME`, `POD_UID` (required): the node and this pod, from the downward API. The pod
//!   UID names the sockets apart, so the old and the new pod of a rolling update run side by
//!   side, and makes their calls take turns.
//! - `DRIVER_NAME` (default `devices.example.com`): the driver name of the DeviceClass.
//! - `KUBELET_ROOT` (default `/var/lib/kubelet`): the kubelet's `--root-dir`.
//! - `READY_ADDR` (default `0.0.0.0:8080`): where `GET` answers `200 ok` once the plugin
//!   serves and its slices are published, and `503` before, or after a fatal error.
//! - The kube client's own: in a pod, the service account; outside, `$KUBECONFIG`.
//!
//! ```text
//! NODE_NAME=my-node POD_UID=$(uuidgen) cargo run -p kubelet-plugin --example daemonset
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures::future::BoxFuture;
use kubelet_plugin::health::{self, DeviceHealth, HealthSource};
use kubelet_plugin::k8s_openapi::api::resource::v1::Device;
use kubelet_plugin::publisher::{Resources, Slice};
use kubelet_plugin::{
    BoxError, CancellationToken, Claim, Driver, ErrorKind, Options, PrepareClaim, PrepareResults,
    PreparedDevice, UnprepareResults,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::signal::unix::{SignalKind, signal};

const DEVICES: [&str; 2] = ["dev-0", "dev-1"];

/// The driver: hands out what the scheduler allocated. A real driver sets its devices up here
/// and writes the CDI spec of the ids it answers with.
struct Devices {
    driver: String,
    node: String,
}

impl Driver for Devices {
    async fn prepare(&self, claims: Vec<PrepareClaim>) -> Result<PrepareResults, BoxError> {
        Ok(claims
            .into_iter()
            .map(|c| {
                let devices = c
                    .results
                    .iter()
                    .map(|r| {
                        let cdi = format!("k8s.{}/device={}", self.driver, r.device);
                        PreparedDevice::new(vec![r.request.clone()], &r.pool, &r.device, vec![cdi])
                    })
                    .collect();
                (c.claim.uid, Ok(devices))
            })
            .collect())
    }

    async fn unprepare(&self, claims: Vec<Claim>) -> Result<UnprepareResults, BoxError> {
        Ok(claims.into_iter().map(|c| (c.uid, Ok(()))).collect())
    }
}

/// Device health, streamed to the kubelet (which shows it in the pod's status). A real driver
/// checks its devices here, and yields from `changes` when it learns of a change.
impl HealthSource for Devices {
    fn device_health(&self) -> BoxFuture<'_, Result<Vec<DeviceHealth>, health::Error>> {
        let all = DEVICES
            .iter()
            .map(|d| DeviceHealth::healthy(&self.node, *d))
            .collect();
        Box::pin(async move { Ok(all) })
    }
}

/// What the readiness probe sees.
#[derive(Default)]
struct Readiness {
    serving: AtomicBool,
    published: AtomicBool,
    failed: AtomicBool,
}

impl Readiness {
    fn ready(&self) -> bool {
        self.serving.load(Ordering::Relaxed)
            && self.published.load(Ordering::Relaxed)
            && !self.failed.load(Ordering::Relaxed)
    }
}

/// Answers every HTTP request on `listener` with 200 when ready and 503 when not (the
/// DaemonSet's `httpGet` probe), until `shutdown`.
async fn answer_probes(
    listener: tokio::net::TcpListener,
    ready: Arc<Readiness>,
    shutdown: CancellationToken,
) {
    loop {
        let mut conn = tokio::select! {
            _ = shutdown.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok((conn, _)) => conn,
                Err(e) => {
                    tracing::warn!(error = %e, "readiness probe: accept failed");
                    continue;
                }
            },
        };
        let ready = ready.clone();
        tokio::spawn(async move {
            // The request itself does not matter: read what arrives (a client that sends
            // nothing is answered after a second, so no connection outlives it), answer, close.
            let mut request = [0u8; 1024];
            let _ = tokio::time::timeout(Duration::from_secs(1), conn.read(&mut request)).await;
            let answer: &[u8] = if ready.ready() {
                b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\nconnection: close\r\n\r\nok\n"
            } else {
                b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 10\r\nconnection: close\r\n\r\nnot ready\n"
            };
            let _ = conn.write_all(answer).await;
        });
    }
}

fn env(name: &str) -> Result<String, BoxError> {
    std::env::var(name).map_err(|e| {
        format!("{name}: {e}; set it (in a pod, from the downward API: see examples/deploy/)")
            .into()
    })
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let node = env("NODE_NAME")?;
    let pod_uid = env("POD_UID")?;
    let driver_name = std::env::var("DRIVER_NAME").unwrap_or_else(|_| "devices.example.com".into());
    let ready_addr = std::env::var("READY_ADDR").unwrap_or_else(|_| "0.0.0.0:8080".into());

    // SIGTERM first, so that a signal that arrives while starting up is not lost.
    let mut term = signal(SignalKind::terminate())?;
    let shutdown = CancellationToken::new();
    let ready = Arc::new(Readiness::default());

    let client = kubelet_plugin::kube::Client::try_default()
        .await
        .map_err(|e| format!("no API server: {e}"))?;
    let failed = ready.clone();
    let mut opts = Options::new(&driver_name, &node, client.clone())?
        .pod_uid(pod_uid)
        // Errors no caller waits for (a claim refused, the publisher failing). A fatal one
        // (RBAC missing, slices the API server refuses) passes only when someone fixes it:
        // the pod turns unready, which `kubectl get pods` and alerts show.
        .on_error(move |kind, error, what| {
            kubelet_plugin::log_error(kind, error, what);
            if kind == ErrorKind::Fatal {
                failed.failed.store(true, Ordering::Relaxed);
            }
        });
    if let Ok(root) = std::env::var("KUBELET_ROOT") {
        opts = opts.kubelet_root(root);
    }

    // The slices: one pool named after the node, one slice, its devices in the order the
    // scheduler should try them. The publisher fills in the rest and keeps them so.
    let (publisher, slices) = opts.publisher(Arc::new(client));
    let devices = DEVICES
        .iter()
        .map(|d| Device {
            name: d.to_string(),
            ..Device::default()
        })
        .collect();
    let seq = slices.set_desired(Resources::node_local(
        &node,
        vec![Slice {
            devices,
            ..Slice::default()
        }],
    ))?;
    let publishing = tokio::spawn(publisher.run(shutdown.clone()));
    // A real driver keeps `slices` and calls `set_desired` again when its devices change.
    let (published, synced) = (ready.clone(), slices.clone());
    tokio::spawn(async move {
        synced.wait_synced(seq).await;
        published.published.store(true, Ordering::Relaxed);
        tracing::info!("resourceslices published");
    });

    let probes = tokio::net::TcpListener::bind(&ready_addr)
        .await
        .map_err(|e| format!("cannot listen on READY_ADDR {ready_addr}: {e}"))?;
    tokio::spawn(answer_probes(probes, ready.clone(), shutdown.clone()));

    // Bind the kubelet's sockets (an error here ends the pod), then serve until SIGTERM.
    let driver = Arc::new(Devices {
        driver: driver_name,
        node,
    });
    let serving = kubelet_plugin::start(driver.clone(), opts.health(driver), shutdown.clone())?;
    ready.serving.store(true, Ordering::Relaxed);
    let stop = shutdown.clone();
    tokio::spawn(async move {
        term.recv().await;
        tracing::info!("SIGTERM: stopping");
        stop.cancel();
    });
    let served = serving.wait().await;
    // The servers have stopped and their sockets are gone; the slices stay for the next pod
    // of the DaemonSet (they go with the Node, which owns them).
    shutdown.cancel();
    publishing.await?;
    tracing::info!("stopped");
    Ok(served?)
}
