//! [`Cliques`] on the API server: the ComputeDomainClique objects of the driver's namespace and
//! events about them. Each call is one request with kube's deadlines; a 409 is a
//! [`StoreError::Conflict`] (read again and retry), anything else an error the daemon logs and
//! retries at its next round.

use std::path::Path;

use futures::future::BoxFuture;
use k8s_openapi::api::core::v1::{Event, EventSource, ObjectReference, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};

use super::clique::{Cliques, StoreError};
use crate::computedomain::api::{
    API_VERSION, ComputeDomainClique, DAEMON_PEERS_ANNOTATION, DAEMON_REASON_ANNOTATION,
};

/// The component events name as their source.
pub const COMPONENT: &str = "nvdra-compute-domain-daemon";

/// The clique objects of one namespace.
pub struct KubeCliques {
    api: Api<ComputeDomainClique>,
    events: Api<Event>,
    /// This daemon's own pod (the downward API's `POD_NAME`), whose annotations say why the
    /// node is not ready and which peers IMEX sees; `None`: not annotated.
    pod: Option<(Api<Pod>, String)>,
    node: String,
}

impl KubeCliques {
    /// The kubeconfig's API server, or (without one) the in-cluster config; `pod` is this
    /// daemon's pod in `namespace` (empty: none to annotate).
    pub async fn new(
        kubeconfig: Option<&Path>,
        namespace: &str,
        node: &str,
        pod: &str,
    ) -> anyhow::Result<Self> {
        let config = match kubeconfig {
            Some(path) => {
                let file = Kubeconfig::read_from(path).map_err(|e| {
                    anyhow::anyhow!("cannot read kubeconfig {} ({e}): pass a readable file", path.display())
                })?;
                Config::from_custom_kubeconfig(file, &KubeConfigOptions::default()).await?
            }
            None => Config::infer().await.map_err(|e| {
                anyhow::anyhow!("no in-cluster config and no usable kubeconfig ({e}): run in a pod or pass --kubeconfig")
            })?,
        };
        let client = Client::try_from(config)?;
        Ok(Self {
            api: Api::namespaced(client.clone(), namespace),
            events: Api::namespaced(client.clone(), namespace),
            pod: (!pod.is_empty()).then(|| (Api::namespaced(client, namespace), pod.to_string())),
            node: node.into(),
        })
    }
}

fn classify(e: kube::Error) -> StoreError {
    match e {
        kube::Error::Api(s) if s.code == 409 => StoreError::Conflict,
        e => StoreError::Other(e.to_string()),
    }
}

impl Cliques for KubeCliques {
    fn get<'a>(
        &'a self,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Option<ComputeDomainClique>, StoreError>> {
        Box::pin(async move { self.api.get_opt(name).await.map_err(classify) })
    }

    fn create(
        &self,
        clique: ComputeDomainClique,
    ) -> BoxFuture<'_, Result<ComputeDomainClique, StoreError>> {
        Box::pin(async move {
            self.api
                .create(&PostParams::default(), &clique)
                .await
                .map_err(classify)
        })
    }

    fn replace(
        &self,
        clique: ComputeDomainClique,
    ) -> BoxFuture<'_, Result<ComputeDomainClique, StoreError>> {
        Box::pin(async move {
            let name = clique.metadata.name.clone().unwrap_or_default();
            self.api
                .replace(&name, &PostParams::default(), &clique)
                .await
                .map_err(classify)
        })
    }

    fn event<'a>(
        &'a self,
        clique: &'a ComputeDomainClique,
        warning: bool,
        reason: &'a str,
        message: &'a str,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            let now = Time(Timestamp::now());
            let event = Event {
                metadata: ObjectMeta {
                    generate_name: Some(format!(
                        "{}.",
                        clique.metadata.name.as_deref().unwrap_or("clique")
                    )),
                    namespace: clique.metadata.namespace.clone(),
                    ..ObjectMeta::default()
                },
                involved_object: ObjectReference {
                    api_version: Some(API_VERSION.into()),
                    kind: Some("ComputeDomainClique".into()),
                    name: clique.metadata.name.clone(),
                    namespace: clique.metadata.namespace.clone(),
                    uid: clique.metadata.uid.clone(),
                    ..ObjectReference::default()
                },
                reason: Some(reason.into()),
                message: Some(message.into()),
                type_: Some(if warning { "Warning" } else { "Normal" }.into()),
                source: Some(EventSource {
                    component: Some(COMPONENT.into()),
                    host: Some(self.node.clone()),
                }),
                reporting_component: Some(COMPONENT.into()),
                reporting_instance: Some(self.node.clone()),
                first_timestamp: Some(now.clone()),
                last_timestamp: Some(now),
                count: Some(1),
                ..Event::default()
            };
            self.events
                .create(&PostParams::default(), &event)
                .await
                .map(|_| ())
                .map_err(classify)
        })
    }
    fn annotates(&self) -> bool {
        self.pod.is_some()
    }

    fn annotate<'a>(
        &'a self,
        reason: &'a str,
        peers: Option<&'a str>,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            let Some((pods, name)) = &self.pod else {
                return Ok(());
            };
            let patch = serde_json::json!({"metadata": {"annotations": {
                DAEMON_REASON_ANNOTATION: reason,
                DAEMON_PEERS_ANNOTATION: peers,
            }}});
            pods.patch(name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
                .map(|_| ())
                .map_err(classify)
        })
    }
}
