//! A complete DRA driver: one fake device, `dev-0`, published in the node's pool and prepared for
//! any claim (its CDI device id is `k8s.<driver>/claim=<claim UID>-dev-0`; a real driver writes
//! that CDI spec before answering).
//!
//! ```text
//! cargo run -p kubelet-plugin --example one-device -- --node NODE [--driver NAME] [--kubelet-root DIR]
//! ```
//!
//! It serves the kubelet under `<kubelet root>` until Ctrl-C or SIGTERM, and publishes its
//! ResourceSlice when a kube client can be made (in a pod, or with `$KUBECONFIG`).

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use futures::future::BoxFuture;
use k8s_openapi::api::resource::v1::{Device, ResourcePool, ResourceSliceSpec};
use kubelet_plugin::health::{self, DeviceHealth, HealthSource};
use kubelet_plugin::publisher::Publisher;
use kubelet_plugin::{Claim, Driver, Options, PrepareResults, PreparedDevice, UnprepareResults};
use tokio_util::sync::CancellationToken;

const DEVICE: &str = "dev-0";

struct OneDevice {
    driver: String,
    node: String,
}

impl Driver for OneDevice {
    type Error = Infallible;

    async fn prepare(&self, claims: Vec<Claim>) -> PrepareResults<Infallible> {
        let prepared = |uid: &str| PreparedDevice {
            requests: Vec::new(),
            pool: self.node.clone(),
            device: DEVICE.into(),
            cdi_ids: vec![format!("k8s.{}/claim={uid}-{DEVICE}", self.driver)],
            share_id: None,
        };
        let results = claims.into_iter().map(|c| {
            let device = prepared(&c.uid);
            (c.uid, Ok(vec![device]))
        });
        results.collect()
    }

    async fn unprepare(&self, claims: Vec<Claim>) -> UnprepareResults<Infallible> {
        claims.into_iter().map(|c| (c.uid, Ok(()))).collect()
    }
}

impl HealthSource for OneDevice {
    fn device_health(&self) -> BoxFuture<'_, Result<Vec<DeviceHealth>, health::Error>> {
        let healthy = DeviceHealth {
            pool: self.node.clone(),
            device: DEVICE.into(),
            problem: None,
        };
        Box::pin(async move { Ok(vec![healthy]) })
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .init();
    let mut opts = Options::new("example.com");
    let mut node = None;
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args.next().ok_or(format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--driver" => opts.driver = value,
            "--kubelet-root" => opts.kubelet_root = value.into(),
            "--node" => node = Some(value),
            _ => return Err(format!("unknown flag {flag}").into()),
        }
    }
    let node = node.ok_or("--node NAME is required")?;
    let shutdown = CancellationToken::new();

    match kube::Client::try_default().await {
        Ok(client) => {
            let (publisher, handle) = Publisher::new(Arc::new(client), &opts.driver, &node);
            handle.set_desired(vec![ResourceSliceSpec {
                driver: opts.driver.clone(),
                node_name: Some(node.clone()),
                pool: ResourcePool {
                    name: node.clone(),
                    generation: 0,
                    resource_slice_count: 1,
                },
                devices: Some(vec![Device {
                    name: DEVICE.into(),
                    ..Device::default()
                }]),
                ..ResourceSliceSpec::default()
            }])?;
            tokio::spawn(publisher.run(shutdown.clone()));
        }
        Err(e) => tracing::warn!(error = %e, "no API server: the device is not published"),
    }

    let driver = Arc::new(OneDevice {
        driver: opts.driver.clone(),
        node,
    });
    let stop = shutdown.clone();
    tokio::spawn(async move {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("SIGTERM handler");
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        stop.cancel();
    });
    let registered = Arc::new(AtomicBool::new(false));
    kubelet_plugin::serve(driver.clone(), Some(driver), opts, registered, shutdown).await?;
    Ok(())
}
