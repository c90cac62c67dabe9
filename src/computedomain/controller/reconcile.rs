//! The domain reconciler on kube-runtime's `Controller`: each ComputeDomain is reconciled when it
//! changes, when one of its cliques, daemon pods, DaemonSets or shared claims changes (mapped
//! back to the domain by its UID), and every few minutes.
//!
//! A reconcile: (deleted) remove the domain's objects, then its finalizer; (else) add the
//! finalizer, create what is missing of [`objects`], and write the status [`status`] computes
//! when it differs. Creations, refusals and readiness changes are Kubernetes Events on the domain.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{Event as CoreEvent, Pod};
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceClaimTemplate};
use k8s_openapi::jiff::Timestamp;
use kube::api::{ListParams, PostParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event, EventType, Recorder};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;
use kube::{Api, Client, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio_util::sync::CancellationToken;

use super::cleanup;
use super::objects::CLIQUE_DAEMON_LABEL;
use super::objects::{self, ChannelMode, Settings};
use super::status::{self, ClaimState, CliqueDaemons};
use crate::computedomain::api::{
    ComputeDomain, ComputeDomainClique, ComputeDomainStatus, DOMAIN_LABEL, FINALIZER,
    STATUS_NOT_READY, STATUS_READY,
};
use crate::computedomain::daemon::clique::PER_CLIQUE_PREFIX;

/// The events the daemons record on their clique objects.
const CLIQUE_EVENTS: &str = "involvedObject.kind=ComputeDomainClique";

/// How often a domain is reconciled without a change.
const RESYNC: Duration = Duration::from_secs(300);
/// How soon a reconcile whose write met a conflict is retried.
const CONFLICT_RETRY: Duration = Duration::from_millis(100);
/// How soon a failed reconcile is retried.
const RETRY: Duration = Duration::from_secs(5);

/// Errors of one reconcile (retried).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{what}")]
    Kube {
        what: String,
        #[source]
        source: kube::Error,
    },
    #[error("compute domain {0} has no uid: it was not read from the API server")]
    NoUid(String),
}

fn kube(what: impl Into<String>) -> impl FnOnce(kube::Error) -> Error {
    let what = what.into();
    move |source| Error::Kube { what, source }
}

/// What every reconcile shares.
pub struct Context {
    pub client: Client,
    pub settings: Settings,
    pub recorder: Recorder,
}

impl Context {
    async fn event(&self, cd: &ComputeDomain, type_: EventType, reason: &str, note: String) {
        let ev = Event {
            type_,
            reason: reason.into(),
            note: Some(note),
            action: "Reconcile".into(),
            secondary: None,
        };
        if let Err(e) = self.recorder.publish(&ev, &cd.object_ref(&())).await {
            tracing::warn!(domain = %cd.name_any(), error = %e, "could not publish an event");
        }
    }
}

/// Runs the controller until `shutdown`.
pub async fn run(ctx: Arc<Context>, shutdown: CancellationToken) {
    let client = ctx.client.clone();
    let ns = ctx.settings.namespace.clone();
    let domains = Api::<ComputeDomain>::all(client.clone());
    let controller = Controller::new(domains, watcher::Config::default());
    let store = controller.store();
    let labelled = watcher::Config::default().labels(DOMAIN_LABEL);
    let (s1, s2, s3, s4, s5, s6) = (
        store.clone(),
        store.clone(),
        store.clone(),
        store.clone(),
        store.clone(),
        store,
    );
    let stop = shutdown.clone();
    controller
        .watches(
            Api::<ComputeDomainClique>::namespaced(client.clone(), &ns),
            watcher::Config::default(),
            move |c: ComputeDomainClique| match c.labels().get(DOMAIN_LABEL) {
                Some(uid) => domain_ref(&s1, Some(uid)).into_iter().collect(),
                // A per-clique daemons' object (`fabric.<clique>`): the clique-channel domains.
                None => clique_domains(&s1),
            },
        )
        .watches(
            Api::<Pod>::namespaced(client.clone(), &ns),
            watcher::Config::default().labels(CLIQUE_DAEMON_LABEL),
            move |_: Pod| clique_domains(&s6),
        )
        .watches(
            Api::<Pod>::namespaced(client.clone(), &ns),
            labelled.clone(),
            move |p: Pod| domain_ref(&s2, p.labels().get(DOMAIN_LABEL).map(String::as_str)),
        )
        .watches(
            Api::<DaemonSet>::namespaced(client.clone(), &ns),
            labelled.clone(),
            move |d: DaemonSet| domain_ref(&s3, d.labels().get(DOMAIN_LABEL).map(String::as_str)),
        )
        .watches(
            Api::<ResourceClaim>::all(client.clone()),
            labelled,
            move |c: ResourceClaim| {
                domain_ref(&s4, c.labels().get(DOMAIN_LABEL).map(String::as_str))
            },
        )
        .watches(
            Api::<CoreEvent>::namespaced(client.clone(), &ns),
            watcher::Config::default().fields(CLIQUE_EVENTS),
            move |e: CoreEvent| {
                let name = e.involved_object.name.unwrap_or_default();
                match cleanup::clique_domain(&name) {
                    Some(PER_CLIQUE_PREFIX) => clique_domains(&s5),
                    uid => domain_ref(&s5, uid).into_iter().collect(),
                }
            },
        )
        .graceful_shutdown_on(async move { stop.cancelled().await })
        .run(reconcile, error_policy, ctx)
        .for_each(|result| async move {
            // A reconcile's failure is logged by the error policy.
            if let Ok((obj, _)) = result {
                tracing::debug!(domain = %obj, "reconciled");
            }
        })
        .await;
}

/// The domain with this UID, from the controller's cache.
fn domain_ref(store: &Store<ComputeDomain>, uid: Option<&str>) -> Option<ObjectRef<ComputeDomain>> {
    let uid = uid?;
    store
        .state()
        .into_iter()
        .find(|cd| cd.metadata.uid.as_deref() == Some(uid))
        .map(|cd| ObjectRef::from_obj(&*cd))
}

/// The domains in the clique-channel form: those a per-clique daemon's change may concern.
fn clique_domains(store: &Store<ComputeDomain>) -> Vec<ObjectRef<ComputeDomain>> {
    store
        .state()
        .into_iter()
        .filter(|cd| objects::channel_mode(cd) == Ok(ChannelMode::Clique))
        .map(|cd| ObjectRef::from_obj(&*cd))
        .collect()
}

fn error_policy(cd: Arc<ComputeDomain>, error: &Error, _ctx: Arc<Context>) -> Action {
    // A conflict is a write that raced another (the watch is a step behind): read again now.
    if let Error::Kube {
        source: kube::Error::Api(s),
        ..
    } = error
        && s.code == 409
    {
        tracing::debug!(domain = %cd.name_any(), "conflict; reconciling again");
        return Action::requeue(CONFLICT_RETRY);
    }
    tracing::warn!(domain = %cd.name_any(), error = %kubelet_plugin::report::chain(error), "reconcile failed; retrying");
    Action::requeue(RETRY)
}

async fn reconcile(cd: Arc<ComputeDomain>, ctx: Arc<Context>) -> Result<Action, Error> {
    let name = cd.name_any();
    let namespace = cd.namespace().unwrap_or_default();
    let uid = cd
        .metadata
        .uid
        .clone()
        .ok_or_else(|| Error::NoUid(name.clone()))?;
    let api = Api::<ComputeDomain>::namespaced(ctx.client.clone(), &namespace);

    if cd.metadata.deletion_timestamp.is_some() {
        if !cd.finalizers().iter().any(|f| f == FINALIZER) {
            return Ok(Action::await_change());
        }
        let removed = cleanup::domain(&ctx.client, &ctx.settings.namespace, &uid)
            .await
            .map_err(kube(format!(
                "cannot remove the objects of compute domain {namespace}/{name}"
            )))?;
        tracing::info!(domain = %name, uid = %uid, removed = ?removed.objects, "compute domain deleted");
        let mut next = (*cd).clone();
        next.metadata.finalizers = Some(
            cd.finalizers()
                .iter()
                .filter(|f| *f != FINALIZER)
                .cloned()
                .collect(),
        );
        match api.replace(&name, &PostParams::default(), &next).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(e) => {
                return Err(kube(format!(
                    "cannot remove the finalizer of {namespace}/{name}"
                ))(e));
            }
        }
        return Ok(Action::await_change());
    }

    let mut cd = (*cd).clone();
    if !cd.finalizers().iter().any(|f| f == FINALIZER) {
        cd.metadata
            .finalizers
            .get_or_insert_with(Vec::new)
            .push(FINALIZER.into());
        cd = api
            .replace(&name, &PostParams::default(), &cd)
            .await
            .map_err(kube(format!(
                "cannot add the finalizer to {namespace}/{name}"
            )))?;
    }

    let mode = match objects::channel_mode(&cd) {
        Ok(mode) => mode,
        Err(why) => {
            ctx.event(&cd, EventType::Warning, "InvalidChannelMode", why.clone())
                .await;
            let mut status = cd.status.clone().unwrap_or_default();
            status.status = STATUS_NOT_READY.into();
            write_status(&ctx, &api, &cd, status).await?;
            return Ok(Action::await_change());
        }
    };
    let Some(channel) = cd.spec.channel.clone() else {
        ctx.event(
            &cd,
            EventType::Warning,
            "NoChannel",
            "spec.channel.resourceClaimTemplate.name is required".into(),
        )
        .await;
        return Ok(Action::await_change());
    };
    let claim_name = channel.resource_claim_template.name;
    let now = Timestamp::now();

    let status = match mode {
        ChannelMode::PerNode => {
            if let Some(t) = objects::workload_template(&cd) {
                let api = Api::<ResourceClaimTemplate>::namespaced(ctx.client.clone(), &namespace);
                ensure(&ctx, &cd, &api, &t, &uid).await?;
            }
            let ns = &ctx.settings.namespace;
            let t = objects::daemon_template(&uid, &ctx.settings);
            ensure(
                &ctx,
                &cd,
                &Api::namespaced(ctx.client.clone(), ns),
                &t,
                &uid,
            )
            .await?;
            let ds = objects::daemon_set(&uid, &ctx.settings);
            ensure(
                &ctx,
                &cd,
                &Api::namespaced(ctx.client.clone(), ns),
                &ds,
                &uid,
            )
            .await?;

            let mine = ListParams::default().labels(&format!("{DOMAIN_LABEL}={uid}"));
            let cliques = Api::<ComputeDomainClique>::namespaced(ctx.client.clone(), ns)
                .list(&mine)
                .await
                .map_err(kube("cannot list compute domain cliques"))?
                .items;
            let pods = Api::<Pod>::namespaced(ctx.client.clone(), ns)
                .list(&mine)
                .await
                .map_err(kube("cannot list the daemon pods"))?
                .items;
            let reports: Vec<_> = pods.iter().map(status::report).collect();
            let events = Api::<CoreEvent>::namespaced(ctx.client.clone(), ns)
                .list(&ListParams::default().fields(CLIQUE_EVENTS))
                .await
                .map_err(kube("cannot list the daemons' events"))?
                .items;
            let reasons = status::event_reasons(&uid, &events);
            status::per_node(&cd, &cliques, &reports, &reasons, now)
        }
        ChannelMode::Clique => {
            let api = Api::<ResourceClaim>::namespaced(ctx.client.clone(), &namespace);
            let state = match objects::clique_claim(&cd) {
                Some(c) => claim_state(ensure(&ctx, &cd, &api, &c, &uid).await?),
                None => ClaimState::Missing,
            };
            let daemons = match &state {
                ClaimState::Allocated { pool, .. } => {
                    clique_daemons(&ctx, status::pool_clique(pool)).await?
                }
                _ => CliqueDaemons::default(),
            };
            status::clique_mode(&cd, &claim_name, &state, &daemons, now)
        }
    };
    write_status(&ctx, &api, &cd, status).await?;
    Ok(Action::requeue(RESYNC))
}

/// What the per-clique daemons of `clique` report: their clique object `fabric.<clique>`, their
/// pods, the events they recorded on the object.
async fn clique_daemons(ctx: &Context, clique: &str) -> Result<CliqueDaemons, Error> {
    let ns = &ctx.settings.namespace;
    let name = ComputeDomainClique::name_for(PER_CLIQUE_PREFIX, clique);
    let object = Api::<ComputeDomainClique>::namespaced(ctx.client.clone(), ns)
        .get_opt(&name)
        .await
        .map_err(kube(format!("cannot read compute domain clique {name}")))?;
    let pods = Api::<Pod>::namespaced(ctx.client.clone(), ns)
        .list(&ListParams::default().labels(&format!("{CLIQUE_DAEMON_LABEL}={clique}")))
        .await
        .map_err(kube("cannot list the per-clique daemon pods"))?
        .items;
    let events: Vec<CoreEvent> = Api::<CoreEvent>::namespaced(ctx.client.clone(), ns)
        .list(&ListParams::default().fields(&format!("{CLIQUE_EVENTS},involvedObject.name={name}")))
        .await
        .map_err(kube("cannot list the per-clique daemons' events"))?
        .items
        .into_iter()
        .filter(|e| e.involved_object.name.as_deref() == Some(name.as_str()))
        .collect();
    Ok(CliqueDaemons {
        object,
        pods: pods.iter().map(status::report).collect(),
        reasons: status::event_reasons(PER_CLIQUE_PREFIX, &events),
    })
}

/// Where the shared claim stands.
fn claim_state(claim: Option<ResourceClaim>) -> ClaimState {
    let Some(claim) = claim else {
        return ClaimState::Missing;
    };
    let result = claim
        .status
        .and_then(|s| s.allocation)
        .and_then(|a| a.devices)
        .and_then(|d| d.results)
        .and_then(|r| r.into_iter().next());
    match result {
        Some(r) => ClaimState::Allocated {
            pool: r.pool,
            device: r.device,
        },
        None => ClaimState::Pending,
    }
}

/// Creates `obj` unless it exists; the stored object comes back. One that exists but was made
/// for another domain (or by someone else) is left alone, with a Warning event; `None` then.
async fn ensure<K>(
    ctx: &Context,
    cd: &ComputeDomain,
    api: &Api<K>,
    obj: &K,
    uid: &str,
) -> Result<Option<K>, Error>
where
    K: Resource<DynamicType = ()> + Clone + Serialize + DeserializeOwned + std::fmt::Debug,
{
    let name = obj.name_any();
    let kind = K::kind(&());
    let existing = api
        .get_opt(&name)
        .await
        .map_err(kube(format!("cannot read {kind} {name}")))?;
    if let Some(e) = existing {
        if e.labels().get(DOMAIN_LABEL).map(String::as_str) == Some(uid) {
            return Ok(Some(e));
        }
        let note = format!(
            "{kind} {}/{name} exists and is not this domain's (its label {DOMAIN_LABEL} is not \
             {uid}): delete it or name another in spec.channel.resourceClaimTemplate.name",
            e.namespace().unwrap_or_default()
        );
        ctx.event(cd, EventType::Warning, "NameTaken", note).await;
        return Ok(None);
    }
    match api.create(&PostParams::default(), obj).await {
        Ok(created) => {
            ctx.event(
                cd,
                EventType::Normal,
                "Created",
                format!(
                    "created {kind} {}/{name}",
                    obj.namespace().unwrap_or_default()
                ),
            )
            .await;
            Ok(Some(created))
        }
        // Created meanwhile (a previous term's leader, or the watch is behind): next time.
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(None),
        Err(e) => Err(kube(format!("cannot create {kind} {name}"))(e)),
    }
}

/// Writes the status when it differs, with an event when the domain's readiness changes.
async fn write_status(
    ctx: &Context,
    api: &Api<ComputeDomain>,
    cd: &ComputeDomain,
    status: ComputeDomainStatus,
) -> Result<(), Error> {
    if cd.status.as_ref() == Some(&status) {
        return Ok(());
    }
    let ready_of = |cd: &ComputeDomain| {
        status::conditions_of(cd)
            .into_iter()
            .find(|c| c.type_ == status::READY)
    };
    let was = ready_of(cd).map(|c| c.reason);
    let mut next = cd.clone();
    next.status = Some(status.clone());
    api.replace_status(&cd.name_any(), &PostParams::default(), &next)
        .await
        .map_err(kube(format!(
            "cannot write the status of {}",
            cd.name_any()
        )))?;
    // An event when the readiness or its reason changes, named by the reason (the recorder
    // folds repeats of one reason into a series, keeping the first message).
    if let Some(c) = ready_of(&next)
        && was.as_deref() != Some(c.reason.as_str())
    {
        let type_ = if status.status == STATUS_READY {
            EventType::Normal
        } else {
            EventType::Warning
        };
        ctx.event(
            cd,
            type_,
            &c.reason,
            format!("{}: {}", status.status, c.message),
        )
        .await;
    }
    Ok(())
}
