//! Removing what was made for a domain, by the domain's UID alone, so that it works without the
//! domain object: at the domain's deletion (its finalizer), and for domains that are gone while
//! no controller ran or that lost their finalizer (the orphan sweep, at the start of each term
//! as leader and every `--cleanup-interval`).
//!
//! A domain's objects are found by the label `resource.nvidia.com/computeDomain=<UID>` (the
//! templates, the shared claim, the DaemonSet, its cliques as the daemons label them, the nodes'
//! label; a per-clique daemon's `fabric.<cliqueID>` object has none and is never touched). Each
//! loses this controller's finalizer, then is deleted.

use std::collections::BTreeSet;
use std::fmt::Debug;

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceClaimTemplate};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::computedomain::api::{
    ComputeDomain, ComputeDomainClique, DOMAIN_LABEL, FINALIZER, NODE_LABEL,
};

/// What one domain (or the sweep) removed.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Removed {
    /// `Kind namespace/name` of each object deleted, and `Node name` of each node unlabelled.
    pub objects: Vec<String>,
}

/// The domain a clique object (or an event about it) names: its name's part before the first
/// `.` (`<UID>.<cliqueID>`).
pub fn clique_domain(name: &str) -> Option<&str> {
    name.split_once('.').map(|(uid, _)| uid)
}

/// The domain an object was made for, by its label.
fn uid_of<K: ResourceExt>(obj: &K) -> Option<String> {
    obj.labels().get(DOMAIN_LABEL).cloned()
}

/// Takes our finalizer off `obj` and deletes it; gone already is fine.
async fn remove<K>(api: &Api<K>, obj: &K, removed: &mut Removed) -> Result<(), kube::Error>
where
    K: Resource<DynamicType = ()> + Clone + Serialize + DeserializeOwned + Debug,
{
    let name = obj.name_any();
    if obj.finalizers().iter().any(|f| f == FINALIZER) {
        let mut next = obj.clone();
        next.meta_mut().finalizers = Some(
            obj.finalizers()
                .iter()
                .filter(|f| *f != FINALIZER)
                .cloned()
                .collect(),
        );
        match api.replace(&name, &PostParams::default(), &next).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 404 => return Ok(()),
            Err(e) => return Err(e),
        }
    }
    if obj.meta().deletion_timestamp.is_none() {
        match api.delete(&name, &DeleteParams::default()).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 404 => return Ok(()),
            Err(e) => return Err(e),
        }
    }
    let ns = obj.namespace().map(|n| format!("{n}/")).unwrap_or_default();
    removed.objects.push(format!("{} {ns}{name}", K::kind(&())));
    Ok(())
}

/// The objects of every domain: templates and claims anywhere, DaemonSets and cliques in the
/// driver's namespace, labelled nodes.
struct Children {
    templates: Vec<ResourceClaimTemplate>,
    claims: Vec<ResourceClaim>,
    daemon_sets: Vec<DaemonSet>,
    cliques: Vec<ComputeDomainClique>,
    nodes: Vec<Node>,
}

async fn children(
    client: &Client,
    namespace: &str,
    selector: &str,
) -> Result<Children, kube::Error> {
    let lp = ListParams::default().labels(selector);
    let claims: Vec<ResourceClaim> = Api::<ResourceClaim>::all(client.clone())
        .list(&lp)
        .await?
        .items
        .into_iter()
        // Only the claims this controller made (a pod's claim from a template has no label).
        .filter(|c| c.finalizers().iter().any(|f| f == FINALIZER))
        .collect();
    Ok(Children {
        templates: Api::<ResourceClaimTemplate>::all(client.clone())
            .list(&lp)
            .await?
            .items,
        claims,
        daemon_sets: Api::<DaemonSet>::namespaced(client.clone(), namespace)
            .list(&lp)
            .await?
            .items,
        cliques: Api::<ComputeDomainClique>::namespaced(client.clone(), namespace)
            .list(&lp)
            .await?
            .items,
        nodes: Api::<Node>::all(client.clone())
            .list(&ListParams::default().labels(&selector.replace(DOMAIN_LABEL, NODE_LABEL)))
            .await?
            .items,
    })
}

/// Removes everything of the domains whose UIDs `gone` accepts.
async fn remove_children(
    client: &Client,
    namespace: &str,
    found: Children,
    gone: impl Fn(&str) -> bool,
) -> Result<Removed, kube::Error> {
    let mut removed = Removed::default();
    for t in &found.templates {
        if uid_of(t).is_some_and(|u| gone(&u)) {
            let api = Api::namespaced(client.clone(), &t.namespace().unwrap_or_default());
            remove(&api, t, &mut removed).await?;
        }
    }
    for c in &found.claims {
        if uid_of(c).is_some_and(|u| gone(&u)) {
            let api = Api::namespaced(client.clone(), &c.namespace().unwrap_or_default());
            remove(&api, c, &mut removed).await?;
        }
    }
    let ds_api = Api::namespaced(client.clone(), namespace);
    for d in &found.daemon_sets {
        if uid_of(d).is_some_and(|u| gone(&u)) {
            remove(&ds_api, d, &mut removed).await?;
        }
    }
    let clique_api = Api::namespaced(client.clone(), namespace);
    for c in &found.cliques {
        if uid_of(c).is_some_and(|u| gone(&u)) {
            remove(&clique_api, c, &mut removed).await?;
        }
    }
    let nodes = Api::<Node>::all(client.clone());
    for n in &found.nodes {
        let Some(uid) = n.labels().get(NODE_LABEL) else {
            continue;
        };
        if gone(uid) {
            let patch = serde_json::json!({"metadata": {"labels": {NODE_LABEL: null}}});
            nodes
                .patch(
                    &n.name_any(),
                    &PatchParams::default(),
                    &Patch::Merge(&patch),
                )
                .await?;
            removed.objects.push(format!("Node {}", n.name_any()));
        }
    }
    Ok(removed)
}

/// Removes everything made for the domain with this UID.
pub async fn domain(client: &Client, namespace: &str, uid: &str) -> Result<Removed, kube::Error> {
    let found = children(client, namespace, &format!("{DOMAIN_LABEL}={uid}")).await?;
    remove_children(client, namespace, found, |u| u == uid).await
}

/// Removes everything made for domains that no longer exist. The children are listed before
/// the domains: a child of a domain created meanwhile was made after its domain, so that
/// domain is in the second list.
pub async fn orphans(client: &Client, namespace: &str) -> Result<Removed, kube::Error> {
    let found = children(client, namespace, DOMAIN_LABEL).await?;
    let live: BTreeSet<String> = Api::<ComputeDomain>::all(client.clone())
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter(|cd| cd.metadata.deletion_timestamp.is_none())
        .filter_map(|cd| cd.metadata.uid)
        .collect();
    remove_children(client, namespace, found, |u| !live.contains(u)).await
}
