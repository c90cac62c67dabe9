//! Keeps the clique channel pools ([`super::pools`]) and the per-clique IMEX daemons
//! ([`objects::clique_daemon_set`], one DaemonSet per clique) equal to the cliques of the
//! cluster's nodes: a reflector of the Nodes that carry `nvidia.com/gpu.clique`; after each
//! change (settled for a moment, so a rack joining is one write per pool) and every few minutes,
//! the driver's slices and the per-clique DaemonSets are listed and brought to the plan. With no
//! channels configured, both are removed once and nothing is watched.

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

use k8s_openapi::api::apps::v1::DaemonSet;
use kube::ResourceExt;

use super::objects::{self, CLIQUE_DAEMON_DIGEST, CLIQUE_DAEMON_LABEL, Settings};
use super::pools;
use crate::computedomain::api::{CLIQUE_LABEL, DRIVER_NAME};

const SETTLE: Duration = Duration::from_millis(200);
const RESYNC: Duration = Duration::from_secs(300);
const RETRY: Duration = Duration::from_secs(5);

/// One pass: the pools, then the per-clique daemons. The number of writes comes back.
pub async fn sync(
    client: &Client,
    settings: &Settings,
    cliques: &BTreeSet<String>,
    channels: u32,
) -> Result<usize, kube::Error> {
    let pools = sync_pools(client, cliques, channels).await?;
    let daemons = if channels == 0 {
        &BTreeSet::new()
    } else {
        cliques
    };
    Ok(pools + sync_daemons(client, settings, daemons).await?)
}

/// What to do to the per-clique DaemonSets: the names to delete (their clique is gone), the
/// DaemonSets to replace (rendered differently: a new image, driver root…), those to create.
#[derive(Debug, Default, PartialEq)]
pub struct DaemonPlan {
    pub deletes: Vec<String>,
    pub updates: Vec<DaemonSet>,
    pub creates: Vec<DaemonSet>,
}

/// The plan for the per-clique DaemonSets, from the cliques and those that exist (labelled
/// [`CLIQUE_DAEMON_LABEL`] in the driver's namespace).
pub fn daemon_plan(
    settings: &Settings,
    cliques: &BTreeSet<String>,
    existing: &[DaemonSet],
) -> DaemonPlan {
    let mut plan = DaemonPlan::default();
    let digest = |d: &DaemonSet| d.annotations().get(CLIQUE_DAEMON_DIGEST).cloned();
    for clique in cliques {
        let want = objects::clique_daemon_set(clique, settings);
        match existing.iter().find(|e| e.name_any() == want.name_any()) {
            None => plan.creates.push(want),
            Some(e) if digest(e) != digest(&want) => {
                let mut next = want;
                next.metadata.resource_version = e.metadata.resource_version.clone();
                plan.updates.push(next);
            }
            Some(_) => {}
        }
    }
    let wanted: BTreeSet<String> = cliques
        .iter()
        .map(|c| objects::clique_daemon_name(c))
        .collect();
    plan.deletes = existing
        .iter()
        .map(ResourceExt::name_any)
        .filter(|n| !wanted.contains(n))
        .collect();
    plan
}

async fn sync_daemons(
    client: &Client,
    settings: &Settings,
    cliques: &BTreeSet<String>,
) -> Result<usize, kube::Error> {
    let api = Api::<DaemonSet>::namespaced(client.clone(), &settings.namespace);
    let existing = api
        .list(&ListParams::default().labels(CLIQUE_DAEMON_LABEL))
        .await?
        .items;
    let plan = daemon_plan(settings, cliques, &existing);
    for name in &plan.deletes {
        match api.delete(name, &DeleteParams::default()).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(e) => return Err(e),
        }
    }
    for ds in &plan.updates {
        api.replace(&ds.name_any(), &PostParams::default(), ds)
            .await?;
    }
    for ds in &plan.creates {
        match api.create(&PostParams::default(), ds).await {
            Ok(_) => {}
            // Created meanwhile (a previous leader): the next pass compares it.
            Err(kube::Error::Api(s)) if s.code == 409 => {}
            Err(e) => return Err(e),
        }
    }
    let writes = plan.creates.len() + plan.updates.len() + plan.deletes.len();
    if writes > 0 {
        tracing::info!(
            created = ?plan.creates.iter().map(ResourceExt::name_any).collect::<Vec<_>>(),
            updated = ?plan.updates.iter().map(ResourceExt::name_any).collect::<Vec<_>>(),
            deleted = ?plan.deletes,
            "per-clique IMEX daemon sets written"
        );
    }
    Ok(writes)
}

async fn sync_pools(
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
pub async fn run(client: Client, settings: &Settings, channels: u32, shutdown: CancellationToken) {
    if channels == 0 {
        loop {
            match sync(&client, settings, &BTreeSet::new(), 0).await {
                Ok(_) => return,
                Err(e) => tracing::warn!(
                    error = %e,
                    "cannot remove the clique channel pools and per-clique daemons"
                ),
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
                next = match sync(&client, settings, &cliques, channels).await {
                    Ok(_) => tokio::time::Instant::now() + RESYNC,
                    Err(e) => {
                        tracing::warn!(
                            error = %e,
                            "cannot write the clique channel pools or per-clique daemons; retrying"
                        );
                        tokio::time::Instant::now() + RETRY
                    }
                };
            }
        }
    }
}

#[cfg(test)]
mod tests;
