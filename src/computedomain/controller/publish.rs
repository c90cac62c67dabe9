//! Keeps the clique channel pools ([`super::pools`]) equal to the cliques of the cluster's nodes:
//! a reflector of the Nodes that carry `nvidia.com/gpu.clique`; after each change (settled for a
//! moment, so a rack joining is one write per pool) and every few minutes, the driver's slices
//! are listed and [`pools::plan`] written. With no channels configured, the pools are removed
//! once and nothing is watched.

use std::collections::BTreeSet;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};
use tokio_util::sync::CancellationToken;

use super::pools;
use crate::computedomain::api::{CLIQUE_LABEL, DRIVER_NAME};

const SETTLE: Duration = Duration::from_millis(200);
const RESYNC: Duration = Duration::from_secs(300);
const RETRY: Duration = Duration::from_secs(5);

/// One pass: list the driver's slices, write the plan. The number of writes comes back.
pub async fn sync(
    client: &Client,
    cliques: &BTreeSet<String>,
    channels: u32,
) -> Result<usize, kube::Error> {
    let api = Api::<ResourceSlice>::all(client.clone());
    let existing = api
        .list(&ListParams::default().fields(&format!("spec.driver={DRIVER_NAME}")))
        .await?
        .items;
    let plan = pools::plan(cliques, channels, &existing);
    let writes = plan.creates.len() + plan.updates.len() + plan.deletes.len();
    for name in &plan.deletes {
        match api.delete(name, &DeleteParams::default()).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(e) => return Err(e),
        }
    }
    for slice in &plan.updates {
        let name = slice.metadata.name.clone().unwrap_or_default();
        api.replace(&name, &PostParams::default(), slice).await?;
    }
    for slice in &plan.creates {
        api.create(&PostParams::default(), slice).await?;
    }
    if writes > 0 {
        tracing::info!(
            cliques = cliques.len(),
            channels,
            created = plan.creates.len(),
            updated = plan.updates.len(),
            deleted = plan.deletes.len(),
            "clique channel pools written"
        );
    }
    Ok(writes)
}

fn current(store: &Store<Node>, reported: &mut BTreeSet<String>) -> BTreeSet<String> {
    let nodes: Vec<_> = store.state();
    let (good, bad) = pools::cliques(nodes.iter().map(|n| &**n));
    for b in bad.difference(reported) {
        tracing::warn!(
            clique = %b,
            label = CLIQUE_LABEL,
            "a node's clique label cannot name a pool (lower-case letters, digits, '-' and '.'): \
             its clique gets no channel pool; fix the label"
        );
    }
    *reported = bad;
    good
}

/// Runs until `shutdown`.
pub async fn run(client: Client, channels: u32, shutdown: CancellationToken) {
    if channels == 0 {
        loop {
            match sync(&client, &BTreeSet::new(), 0).await {
                Ok(_) => return,
                Err(e) => tracing::warn!(error = %e, "cannot remove the clique channel pools"),
            }
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(RETRY) => {}
            }
        }
    }
    let (store, writer) = reflector::store();
    let nodes = watcher(
        Api::<Node>::all(client.clone()),
        watcher::Config::default().labels(CLIQUE_LABEL),
    )
    .default_backoff()
    .reflect(writer);
    let mut nodes = std::pin::pin!(nodes);
    let mut reported = BTreeSet::new();
    // Nothing is written before the first complete list of the nodes.
    let mut listed = false;
    let mut next = tokio::time::Instant::now() + RESYNC;
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            ev = nodes.next() => match ev {
                Some(Ok(ev)) => {
                    listed |= matches!(ev, watcher::Event::InitDone);
                    if listed {
                        next = next.min(tokio::time::Instant::now() + SETTLE);
                    }
                }
                Some(Err(e)) => tracing::debug!(error = %e, "node watch"),
                None => return,
            },
            _ = tokio::time::sleep_until(next), if listed => {
                let cliques = current(&store, &mut reported);
                next = match sync(&client, &cliques, channels).await {
                    Ok(_) => tokio::time::Instant::now() + RESYNC,
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot write the clique channel pools; retrying");
                        tokio::time::Instant::now() + RETRY
                    }
                };
            }
        }
    }
}
