//! [`ClusterApi`] over a real API server, through kube-rs. The slice calls are the
//! `kubelet-plugin` library's (`impl SliceApi for kube::Client`, with its error classes, which
//! nvdra's own calls share through [`classify`]): every call is one HTTP request, and the
//! caller owns backoff.

use futures::future::BoxFuture;
use futures::stream::{BoxStream, StreamExt};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim, ResourceSlice};
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::watcher::{self, watcher};
use kube::{Client, Config};
use std::collections::BTreeMap;
use std::path::Path;

use kubelet_plugin::api::kube::{WATCH_TIMEOUT_SECS, classify, classify_watch};

use super::{ClaimReader, ClaimSource, ClusterApi, Error, Failure, Result, SliceApi, SliceEvent};
use crate::versions::KubeVersion;

/// The API server through kube-rs.
#[derive(Clone)]
pub struct KubeApi {
    client: Client,
}

impl KubeApi {
    /// Uses the given kubeconfig, or (without one) the in-cluster config, falling back to the
    /// default kubeconfig (`$KUBECONFIG`, `~/.kube/config`).
    pub async fn new(kubeconfig: Option<&Path>) -> Result<Self> {
        let config = match kubeconfig {
            Some(path) => {
                let file = Kubeconfig::read_from(path).map_err(|e| {
                    Error::Setup(Failure::caused(
                        format!(
                            "cannot read kubeconfig {} (pass a readable file with --kubeconfig)",
                            path.display()
                        ),
                        e,
                    ))
                })?;
                Config::from_custom_kubeconfig(file, &KubeConfigOptions::default())
                    .await
                    .map_err(|e| {
                        Error::Setup(Failure::caused(
                            format!("kubeconfig {} is not usable", path.display()),
                            e,
                        ))
                    })?
            }
            None => Config::infer().await.map_err(|e| {
                Error::Setup(Failure::caused(
                    "no in-cluster config and no usable kubeconfig \
                     (run in a pod, pass --kubeconfig, or use --api-dir)",
                    e,
                ))
            })?,
        };
        Self::from_config(config)
    }

    /// The published ResourceSlices (of one node, when named) and every DeviceClass, read only:
    /// what `nvdra match --kubeconfig` explains a claim against.
    pub async fn list_for_match(
        &self,
        node: Option<&str>,
    ) -> Result<(
        Vec<ResourceSlice>,
        Vec<k8s_openapi::api::resource::v1::DeviceClass>,
    )> {
        let mut params = ListParams::default();
        if let Some(n) = node {
            params = params.fields(&format!("spec.nodeName={n}"));
        }
        let slices = Api::<ResourceSlice>::all(self.client.clone())
            .list(&params)
            .await
            .map_err(|e| Error::Setup(Failure::caused("cannot list ResourceSlices", e)))?;
        let classes = Api::<k8s_openapi::api::resource::v1::DeviceClass>::all(self.client.clone())
            .list(&ListParams::default())
            .await
            .map_err(|e| Error::Setup(Failure::caused("cannot list DeviceClasses", e)))?;
        Ok((slices.items, classes.items))
    }

    /// Talks plain HTTP (or HTTPS without client auth) to `url`, e.g. a test server.
    pub fn from_url(url: &str) -> Result<Self> {
        let uri: http::Uri = url
            .parse()
            .map_err(|e| Error::Setup(Failure::caused(format!("bad API server url {url:?}"), e)))?;
        Self::from_config(Config::new(uri))
    }

    fn from_config(config: Config) -> Result<Self> {
        let client = Client::try_from(config)
            .map_err(|e| Error::Setup(Failure::caused("cannot build a kube client", e)))?;
        Ok(Self { client })
    }
}

impl SliceApi for KubeApi {
    fn list_slices<'a>(
        &'a self,
        driver: &'a str,
        node: &'a str,
    ) -> BoxFuture<'a, Result<Vec<ResourceSlice>>> {
        self.client.list_slices(driver, node)
    }

    fn create_slice<'a>(
        &'a self,
        slice: &'a ResourceSlice,
    ) -> BoxFuture<'a, Result<ResourceSlice>> {
        self.client.create_slice(slice)
    }

    fn replace_slice<'a>(
        &'a self,
        slice: &'a ResourceSlice,
    ) -> BoxFuture<'a, Result<ResourceSlice>> {
        self.client.replace_slice(slice)
    }

    fn delete_slice<'a>(
        &'a self,
        name: &'a str,
        preconditions: &'a k8s_openapi::apimachinery::pkg::apis::meta::v1::Preconditions,
    ) -> BoxFuture<'a, Result<()>> {
        self.client.delete_slice(name, preconditions)
    }

    fn watch_slices<'a>(
        &'a self,
        driver: &'a str,
        node: &'a str,
    ) -> BoxStream<'a, Result<SliceEvent>> {
        self.client.watch_slices(driver, node)
    }

    fn get_node<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Node>> {
        self.client.get_node(name)
    }
}

impl ClusterApi for KubeApi {
    fn server_version(&self) -> BoxFuture<'_, Result<Option<KubeVersion>>> {
        Box::pin(async move {
            let info = self
                .client
                .apiserver_version()
                .await
                .map_err(|e| classify("get /version", e))?;
            Ok(KubeVersion::from_version_info(
                &info.git_version,
                &info.major,
                &info.minor,
            ))
        })
    }

    fn patch_node_labels<'a>(
        &'a self,
        name: &'a str,
        labels: &'a BTreeMap<String, Option<String>>,
    ) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let body = serde_json::json!({ "metadata": { "labels": labels } });
            Api::<Node>::all(self.client.clone())
                .patch(name, &PatchParams::default(), &Patch::Merge(&body))
                .await
                .map(|_| ())
                .map_err(|e| classify(&format!("patch node {name} labels"), e))
        })
    }

    fn dra_served(&self) -> BoxFuture<'_, Result<bool>> {
        Box::pin(async move {
            match self
                .client
                .list_api_group_resources("resource.k8s.io/v1")
                .await
            {
                Ok(list) => Ok(list.resources.iter().any(|r| r.name == "resourceslices")),
                Err(kube::Error::Api(status)) if status.code == 404 => Ok(false),
                Err(e) => Err(classify("get /apis/resource.k8s.io/v1", e)),
            }
        })
    }

    fn watch_device_classes(&self) -> BoxStream<'_, Result<Vec<DeviceClass>>> {
        use watcher::Event;
        let api = Api::<DeviceClass>::all(self.client.clone());
        let config = watcher::Config::default().timeout(WATCH_TIMEOUT_SECS);
        let mut known: BTreeMap<String, DeviceClass> = BTreeMap::new();
        let mut listing: BTreeMap<String, DeviceClass> = BTreeMap::new();
        watcher(api, config)
            .filter_map(move |item| {
                let name = |c: &DeviceClass| c.metadata.name.clone().unwrap_or_default();
                let out = match item {
                    Ok(Event::Init) => {
                        listing.clear();
                        None
                    }
                    Ok(Event::InitApply(c)) => {
                        listing.insert(name(&c), c);
                        None
                    }
                    Ok(Event::InitDone) => {
                        known = std::mem::take(&mut listing);
                        Some(Ok(known.values().cloned().collect()))
                    }
                    Ok(Event::Apply(c)) => {
                        known.insert(name(&c), c);
                        Some(Ok(known.values().cloned().collect()))
                    }
                    Ok(Event::Delete(c)) => {
                        known.remove(&name(&c));
                        Some(Ok(known.values().cloned().collect()))
                    }
                    Err(watcher::Error::WatchError(s)) if is_gone(&s) => None,
                    Err(e) => Some(Err(classify_watch(e))),
                };
                std::future::ready(out)
            })
            .boxed()
    }
}

impl ClaimSource for KubeApi {
    fn get_claim<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<ResourceClaim>> {
        Box::pin(async move {
            Api::<ResourceClaim>::namespaced(self.client.clone(), namespace)
                .get(name)
                .await
                .map_err(|e| classify(&format!("get resourceclaim {namespace}/{name}"), e))
        })
    }
}

impl ClaimReader for KubeApi {
    fn get_pod<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<k8s_openapi::api::core::v1::Pod>> {
        Box::pin(async move {
            Api::<k8s_openapi::api::core::v1::Pod>::namespaced(self.client.clone(), namespace)
                .get(name)
                .await
                .map_err(|e| classify(&format!("get pod {namespace}/{name}"), e))
        })
    }

    fn get_namespace<'a>(
        &'a self,
        name: &'a str,
    ) -> BoxFuture<'a, Result<k8s_openapi::api::core::v1::Namespace>> {
        Box::pin(async move {
            Api::<k8s_openapi::api::core::v1::Namespace>::all(self.client.clone())
                .get(name)
                .await
                .map_err(|e| classify(&format!("get namespace {name}"), e))
        })
    }

    fn claim_status(&self) -> Option<&dyn super::ClaimStatusApi> {
        Some(&self.client)
    }
}

/// Whether a watch error is 410 Gone: the watcher re-lists by itself.
fn is_gone(status: &kube::core::Status) -> bool {
    status.code == 410 || status.reason == "Expired" || status.reason == "Gone"
}
