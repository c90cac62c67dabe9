//! A driver that prepares what each claim's allocation names: one CDI device per allocated
//! device of this driver (`k8s.<driver>/claim=<claim UID>-<device>`), answered under the
//! request it was allocated for. A device that is not one of this node's (`--devices`, by
//! default `dev-0`) is refused, with the claim's error saying which. Its devices are reported
//! healthy on the health stream.
//!
//! ```text
//! cargo run -p kubelet-plugin --example allocated -- --node NODE [--driver NAME] [--devices A,B] [--kubelet-root DIR] [--claims FILE]
//! ```
//!
//! It reads claims from the API server (`kube::Client::try_default()`: in a pod, or with
//! `$KUBECONFIG`, over HTTPS), or with `--claims FILE` from a JSON list of ResourceClaims. It
//! also builds outside this workspace, against `k8s-openapi/latest`: `tests/adopter/`.

use std::sync::Arc;

use kubelet_plugin::claims::ClaimSource;
use kubelet_plugin::futures::future::BoxFuture;
use kubelet_plugin::health::{self, DeviceHealth, HealthSource};
use kubelet_plugin::k8s_openapi::api::resource::v1::ResourceClaim;
use kubelet_plugin::testing::MemoryClaims;
use kubelet_plugin::{
    BoxError, CancellationToken, Claim, Driver, Options, PrepareClaim, PrepareResults,
    PreparedDevice, UnprepareResults,
};

struct Allocated {
    driver: String,
    node: String,
    devices: Vec<String>,
}

impl Allocated {
    fn prepare_one(&self, c: &PrepareClaim) -> Result<Vec<PreparedDevice>, BoxError> {
        c.results
            .iter()
            .map(|r| {
                if r.pool != self.node || !self.devices.contains(&r.device) {
                    return Err(format!(
                        "device {} of pool {} is not on this node (pool {}, devices {})",
                        r.device,
                        r.pool,
                        self.node,
                        self.devices.join(", ")
                    )
                    .into());
                }
                let cdi = format!("k8s.{}/claim={}-{}", self.driver, c.claim.uid, r.device);
                let device =
                    PreparedDevice::new(vec![r.request.clone()], &r.pool, &r.device, vec![cdi]);
                Ok(match &r.share_id {
                    Some(share) => device.with_share_id(share),
                    None => device,
                })
            })
            .collect()
    }
}

impl Driver for Allocated {
    async fn prepare(&self, claims: Vec<PrepareClaim>) -> Result<PrepareResults, BoxError> {
        Ok(claims
            .iter()
            .map(|c| (c.claim.uid.clone(), self.prepare_one(c)))
            .collect())
    }

    async fn unprepare(&self, claims: Vec<Claim>) -> Result<UnprepareResults, BoxError> {
        Ok(claims.into_iter().map(|c| (c.uid, Ok(()))).collect())
    }
}

impl HealthSource for Allocated {
    fn device_health(&self) -> BoxFuture<'_, Result<Vec<DeviceHealth>, health::Error>> {
        let devices = self
            .devices
            .iter()
            .map(|d| DeviceHealth::healthy(&self.node, d))
            .collect();
        Box::pin(async move { Ok(devices) })
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
    let (mut driver, mut node, mut root, mut file) = ("example.com".to_string(), None, None, None);
    let mut devices = vec!["dev-0".to_string()];
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args.next().ok_or(format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--driver" => driver = value,
            "--kubelet-root" => root = Some(value),
            "--node" => node = Some(value),
            "--claims" => file = Some(value),
            "--devices" => devices = value.split(',').map(String::from).collect(),
            _ => return Err(format!("unknown flag {flag}").into()),
        }
    }
    let node = node.ok_or("--node NAME is required")?;
    let claims: Arc<dyn ClaimSource> = match file {
        Some(path) => Arc::new(claims_from(&path)?),
        None => Arc::new(kubelet_plugin::kube::Client::try_default().await?),
    };
    let mut opts = Options::new(driver.as_str(), node.as_str(), claims)?;
    if let Some(root) = root {
        opts = opts.kubelet_root(root);
    }
    let shutdown = CancellationToken::new();
    let stop = shutdown.clone();
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::spawn(async move {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        stop.cancel();
    });
    let driver = Arc::new(Allocated {
        driver,
        node,
        devices,
    });
    kubelet_plugin::serve(driver.clone(), opts.health(driver), shutdown).await?;
    Ok(())
}
