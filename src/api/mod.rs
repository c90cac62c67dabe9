//! The API server as nvdra sees it: ResourceSlices to publish, ResourceClaims to read, the Node to
//! own slices, DeviceClasses to follow. One trait, two implementations: `kube` (a real API server
//! through kube-rs; its slice calls are the `kubelet-plugin` library's) and `dir` (a directory of
//! YAML files, the embedded default for runs without a cluster). Each consumer depends on the
//! operations it calls: the plugin on [`ClaimReader`] (one method), the library's publisher on
//! [`SliceApi`], the daemon on [`ClusterApi`], which is everything and what [`connect`] returns.

pub mod dir;
pub mod kube;

use futures::future::BoxFuture;
use futures::stream::BoxStream;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{
    AllocationResult, DeviceAllocationConfiguration, DeviceAllocationResult, DeviceClass,
    DeviceRequestAllocationResult, ResourceClaim, ResourceClaimStatus,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

pub use kubelet_plugin::api::{
    Cause, ClaimStatusApi, Error, Failure, Result, SliceApi, SliceEvent,
};

pub use kubelet_plugin::claims::ClaimSource;

/// What prepare needs of the API server: the claim the kubelet names (the library's
/// [`ClaimSource`], through which `serve` reads claims), for a share of a GPU whose MPS
/// serves one user at a time the pod it is reserved for, and where the claim's status goes.
pub trait ClaimReader: ClaimSource {
    /// Reads a Pod: a share of a GPU whose MPS serves one user at a time needs the user its
    /// pod runs as ([`crate::dra`]'s prepare). APIs that hold no pods say so.
    fn get_pod<'a>(&'a self, namespace: &'a str, name: &'a str) -> BoxFuture<'a, Result<Pod>> {
        Box::pin(async move {
            Err(Error::Invalid(
                format!("this API cannot read pod {namespace}/{name}").into(),
            ))
        })
    }

    /// Reads a Namespace: under `--share-trust-domain=label:<key>` a share needs the value of
    /// that label on its claim's namespace (the Namespace object: a pod's own labels are its
    /// author's, no trust boundary). APIs that hold no namespaces say so.
    fn get_namespace<'a>(
        &'a self,
        name: &'a str,
    ) -> BoxFuture<'a, Result<k8s_openapi::api::core::v1::Namespace>> {
        Box::pin(async move {
            Err(Error::Invalid(
                format!("this API cannot read namespace {name}").into(),
            ))
        })
    }

    /// Where prepare writes a claim's `status.devices` (server-side apply of its status). APIs
    /// that keep no claim status (the directory API) answer `None`, and nothing is written.
    fn claim_status(&self) -> Option<&dyn ClaimStatusApi> {
        None
    }
}

/// The API operations nvdra needs. Implementations are cheap to clone behind an `Arc`; an
/// `Arc<dyn ClusterApi>` coerces to the `Arc<dyn ClaimReader>` the plugin takes.
pub trait ClusterApi: ClaimReader + SliceApi {
    /// The API server's Kubernetes version: its minor version decides the slice layout for
    /// shared counters, and the whole of it which known scheduler bugs to warn about
    /// ([`crate::versions`]). `None` when there is no server to ask (the directory API), meaning
    /// the newest rules apply.
    fn server_version(&self) -> BoxFuture<'_, Result<Option<crate::versions::KubeVersion>>> {
        Box::pin(async { Ok(None) })
    }

    /// Sets (`Some`) and removes (`None`) these labels of a Node in one request (a JSON merge
    /// patch), leaving every other label alone.
    fn patch_node_labels<'a>(
        &'a self,
        name: &'a str,
        labels: &'a std::collections::BTreeMap<String, Option<String>>,
    ) -> BoxFuture<'a, Result<()>> {
        let _ = labels;
        Box::pin(async move {
            Err(Error::Invalid(
                format!("this API cannot label node {name}").into(),
            ))
        })
    }

    /// Whether the server serves `resource.k8s.io/v1` ResourceSlices (API discovery), which
    /// `--mode auto` needs to serve DRA. The directory API does.
    fn dra_served(&self) -> BoxFuture<'_, Result<bool>> {
        Box::pin(async { Ok(true) })
    }

    /// Every DeviceClass: the current list first, then the whole list again after each change.
    /// The stream ends or yields errors when the connection drops; callers restart it.
    fn watch_device_classes(&self) -> BoxStream<'_, Result<Vec<DeviceClass>>> {
        use futures::StreamExt;
        futures::stream::once(async { Ok(Vec::new()) })
            .chain(futures::stream::pending())
            .boxed()
    }
}

/// A ResourceClaim as the scheduler leaves it: allocated `results`, with the opaque `config` the
/// allocation carries. What prepare reads; `nvdra demo`, tests and benchmarks write such claims.
pub fn allocated_claim(
    namespace: &str,
    name: &str,
    uid: &str,
    results: Vec<DeviceRequestAllocationResult>,
    config: Vec<DeviceAllocationConfiguration>,
) -> ResourceClaim {
    ResourceClaim {
        metadata: ObjectMeta {
            namespace: Some(namespace.into()),
            name: Some(name.into()),
            uid: Some(uid.into()),
            ..Default::default()
        },
        status: Some(ResourceClaimStatus {
            allocation: Some(AllocationResult {
                devices: Some(DeviceAllocationResult {
                    results: Some(results),
                    config: (!config.is_empty()).then_some(config),
                }),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// One device of an allocation: `request` got `device` of `driver`'s `pool` (what the scheduler
/// writes into `status.allocation.devices.results`).
pub fn allocated_device(
    request: &str,
    driver: &str,
    pool: &str,
    device: &str,
) -> DeviceRequestAllocationResult {
    DeviceRequestAllocationResult {
        request: request.into(),
        driver: driver.into(),
        pool: pool.into(),
        device: device.into(),
        ..Default::default()
    }
}

/// Connects to the API the configuration names: a directory, the given kubeconfig, or the
/// in-cluster config (falling back to the default kubeconfig).
pub async fn connect(api: &crate::config::Api) -> Result<std::sync::Arc<dyn ClusterApi>> {
    Ok(match api {
        crate::config::Api::Kube { kubeconfig } => {
            std::sync::Arc::new(self::kube::KubeApi::new(kubeconfig.as_deref()).await?)
        }
        crate::config::Api::Dir(dir) => std::sync::Arc::new(dir::DirApi::new(dir.clone())?),
    })
}
