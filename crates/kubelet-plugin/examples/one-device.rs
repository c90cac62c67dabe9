//! A complete DRA driver: one fake device, `dev-0`, published in the node's pool and prepared for
//! any claim allocated it (its CDI device id is `k8s.<driver>/claim=<claim UID>-dev-0`; a real
//! driver writes that CDI spec before answering).
//!
//! ```text
//! cargo run -p kubelet-plugin --example one-device -- --node NODE [--driver NAME] [--kubelet-root DIR] [--claims FILE]
//! ```
//!
//! It serves the kubelet under `<kubelet root>` until Ctrl-C or SIGTERM. With a kube client (in
//! a pod, or with `$KUBECONFIG`; HTTPS through the `rustls-tls` feature) it publishes its
//! ResourceSlice and reads claims from the API server; `--claims FILE` (a JSON list of
//! ResourceClaims) reads claims from the file instead, to run without a cluster.

use std::sync::Arc;

use futures::future::BoxFuture;
use kubelet_plugin::claims::ClaimSource;
use kubelet_plugin::health::{self, DeviceHealth, HealthSource};
use kubelet_plugin::k8s_openapi::api::resource::v1::{Device, ResourceClaim};
use kubelet_plugin::publisher::{Resources, Slice};
use kubelet_plugin::testing::MemoryClaims;
use kubelet_plugin::{
    BoxError, CancellationToken, Claim, Driver, Options, PrepareClaim, PrepareResults,
    PreparedDevice, UnprepareResults,
};

const DEVICE: &str = "dev-0";

struct OneDevice {
    driver: String,
    node: String,
}

impl Driver for OneDevice {
    async fn prepare(&self, claims: Vec<PrepareClaim>) -> Result<PrepareResults, BoxError> {
        let prepared = |c: &PrepareClaim| {
            let requests = c.results.iter().map(|r| r.request.clone()).collect();
            let cdi = format!("k8s.{}/claim={}-{DEVICE}", self.driver, c.claim.uid);
            PreparedDevice::new(requests, &self.node, DEVICE, vec![cdi])
        };
        Ok(claims
            .into_iter()
            .map(|c| {
                let device = prepared(&c);
                (c.claim.uid, Ok(vec![device]))
            })
            .collect())
    }

    async fn unprepare(&self, claims: Vec<Claim>) -> Result<UnprepareResults, BoxError> {
        Ok(claims.into_iter().map(|c| (c.uid, Ok(()))).collect())
    }
}

impl HealthSource for OneDevice {
    fn device_health(&self) -> BoxFuture<'_, Result<Vec<DeviceHealth>, health::Error>> {
        let healthy = DeviceHealth::healthy(&self.node, DEVICE);
        Box::pin(async move { Ok(vec![healthy]) })
    }
}

/// Claims from a JSON list of ResourceClaims.
fn claims_from(path: &str) -> Result<MemoryClaims, BoxError> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {path}: {e}"))?;
    let list: Vec<ResourceClaim> = serde_json::from_str(&text)
        .map_err(|e| format!("{path} is not a JSON list of ResourceClaims: {e}"))?;
    let claims = MemoryClaims::default();
    list.into_iter().for_each(|c| claims.insert(c));
    Ok(claims)
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .init();
    let (mut driver, mut node, mut root, mut file) = ("example.com".to_string(), None, None, None);
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args.next().ok_or(format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--driver" => driver = value,
            "--kubelet-root" => root = Some(value),
            "--node" => node = Some(value),
            "--claims" => file = Some(value),
            _ => return Err(format!("unknown flag {flag}").into()),
        }
    }
    let node = node.ok_or("--node NAME is required")?;
    let shutdown = CancellationToken::new();

    let client = kubelet_plugin::kube::Client::try_default().await;
    let claims: Arc<dyn ClaimSource> = match (&file, &client) {
        (Some(path), _) => Arc::new(claims_from(path)?),
        (None, Ok(client)) => Arc::new(client.clone()),
        (None, Err(e)) => {
            return Err(
                format!("no API server to read claims from ({e}); give --claims FILE").into(),
            );
        }
    };
    let mut opts = Options::new(driver.as_str(), node.as_str(), claims)?;
    if let Some(root) = root {
        opts = opts.kubelet_root(root);
    }
    match client {
        Ok(client) => {
            let (publisher, handle) = opts.publisher(Arc::new(client));
            // One pool named after the node, with one slice; the publisher fills in driver,
            // node, pool, generation and count.
            let slice = Slice {
                devices: vec![Device {
                    name: DEVICE.into(),
                    ..Device::default()
                }],
                ..Slice::default()
            };
            handle.set_desired(Resources::node_local(&node, vec![slice]))?;
            tokio::spawn(publisher.run(shutdown.clone()));
        }
        Err(e) => tracing::warn!(error = %e, "no API server: the device is not published"),
    }

    let driver = Arc::new(OneDevice { driver, node });
    let stop = shutdown.clone();
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::spawn(async move {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        stop.cancel();
    });
    kubelet_plugin::serve(driver.clone(), opts.health(driver), shutdown).await?;
    Ok(())
}
