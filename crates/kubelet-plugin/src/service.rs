//! The kubelet-facing gRPC servers of a DRA plugin: `v1.DRAPlugin`, `v1beta1.DRAPlugin` and
//! `DRAResourceHealth` (`v1`, `v1beta1`, `v1alpha1`) on one Unix socket, over one [`Driver`],
//! and [`serve`], which runs a whole plugin from its [`Options`].
//!
//! A prepare reads and checks its claims first ([`crate::claims`]; a refused claim never reaches
//! the driver), then waits its turn (one call at a time by default; with a pod UID, also the
//! node lock that the other instance of a rolling update takes), then calls the driver in a task
//! of its own: when the kubelet gives up waiting, the call still runs to its end, and the next
//! call sees what it did. Errors of a claim travel in its response entry; the RPC itself never
//! fails for a claim.
//!
//! Each call runs in a tracing span (`dra_call`: method, version, request id, claim UIDs) with
//! its [`Call`] as the driver's [`call::current`]; each claim that fails is logged at `warn`.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::UnixListener;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};
use tracing::Instrument;

use crate::call::{self, Call};
use crate::claims::{self, ClaimSource};
use crate::driver::{BoxError, Claim, Driver, PrepareClaim, PreparedDevice};
use crate::error::{Error, ErrorHandler, ErrorKind};
use crate::health::{HealthService, HealthSource, HealthV1, HealthV1beta1};
use crate::layer::{GrpcRequest, GrpcResponse, GrpcService, ServerLayer, server_layer};
use crate::nodelock::NodeLock;
use crate::proto::dra::{v1, v1beta1};
use crate::proto::health::{
    v1 as health_v1, v1alpha1 as health_v1alpha1, v1beta1 as health_v1beta1,
};
use crate::registration::{Registrar, RegistrationHook, Sockets};
use crate::report::chain;
use crate::{names, socket};
use wire::Answers;

/// How calls take turns: not at all, or one at a time in this process, and with a rolling
/// update's pod UID also across the node's instances (Go's `Serialize` and its file lock).
enum Turns {
    Concurrent,
    OneAtATime {
        here: tokio::sync::Mutex<()>,
        node: Option<NodeLock>,
    },
}

/// Held while a call runs.
struct Turn<'a> {
    _here: Option<tokio::sync::MutexGuard<'a, ()>>,
    _node: Option<crate::nodelock::Guard>,
}

impl Turns {
    async fn take(&self) -> Result<Turn<'_>, crate::nodelock::Error> {
        let Turns::OneAtATime { here, node } = self else {
            return Ok(Turn {
                _here: None,
                _node: None,
            });
        };
        let here = here.lock().await;
        let node = match node {
            Some(l) => Some(l.enter(|| Ok::<(), crate::nodelock::Error>(())).await?),
            None => None,
        };
        Ok(Turn {
            _here: Some(here),
            _node: node,
        })
    }
}

/// What every version's service calls: one handler per operation.
struct Handler<D> {
    driver: Arc<D>,
    name: Arc<str>,
    claims: Arc<dyn ClaimSource>,
    turns: Arc<Turns>,
    on_error: ErrorHandler,
    /// The device metadata files, when the plugin writes them.
    metadata: Option<Arc<crate::metadata::Files>>,
    /// Cancelled when the plugin stops: every call's token is its child.
    stop: CancellationToken,
}

impl<D> Clone for Handler<D> {
    fn clone(&self) -> Self {
        Self {
            driver: self.driver.clone(),
            name: self.name.clone(),
            claims: self.claims.clone(),
            turns: self.turns.clone(),
            on_error: self.on_error.clone(),
            metadata: self.metadata.clone(),
            stop: self.stop.clone(),
        }
    }
}

/// A call's span: what the kubelet asked, the request id, and the claims' UIDs.
fn call_span(
    method: &'static str,
    version: &'static str,
    call: &Call,
    claims: &[Claim],
) -> tracing::Span {
    let uids: Vec<&str> = claims.iter().map(|c| c.uid.as_str()).collect();
    tracing::info_span!(
        "dra_call",
        method,
        version,
        request_id = call.id(),
        claims = %uids.join(","),
    )
}

/// The namespace and name of the claim `uid` among those the kubelet named.
fn named<'a>(claims: &'a [Claim], uid: &str) -> (&'a str, &'a str) {
    claims
        .iter()
        .find(|c| c.uid == uid)
        .map_or(("", ""), |c| (c.namespace.as_str(), c.name.as_str()))
}

/// A span naming the claim `uid`, for what is logged about it alone.
fn claim_span(claims: &[Claim], uid: &str) -> tracing::Span {
    let (namespace, name) = named(claims, uid);
    tracing::warn_span!("claim", namespace, name, uid)
}

/// Logs each claim the driver failed at `warn`, naming it (the call's span adds the request id).
fn log_failures<T>(what: &str, claims: &[Claim], answers: &Answers<T>) {
    for (uid, answer) in answers {
        if let Err(error) = answer {
            let (namespace, name) = named(claims, uid);
            tracing::warn!(namespace, name, uid = %uid, %error, "{what} failed for a claim");
        }
    }
}

/// What a driver call returned: each claim's outcome, or the batch's error.
type Returned<T> = Result<Vec<(String, Result<T, BoxError>)>, BoxError>;

/// A driver call's outcome: a batch error, or its panic (`Err`, in words), becomes every
/// claim's error.
fn settle<T>(uids: &[String], outcome: Result<Returned<T>, String>) -> Answers<T> {
    let failed = |why: String| uids.iter().map(|u| (u.clone(), Err(why.clone()))).collect();
    match outcome {
        Ok(Ok(results)) => results
            .into_iter()
            .map(|(uid, r)| (uid, r.map_err(|e| chain(&*e).to_string())))
            .collect(),
        Ok(Err(batch)) => failed(chain(&*batch).to_string()),
        Err(why) => failed(why),
    }
}

impl<D: Driver> Handler<D> {
    /// A new call: its request id, the deadline its `grpc-timeout` sets, a token that the
    /// plugin's stop cancels.
    fn begin(&self, metadata: &tonic::metadata::MetadataMap) -> Call {
        let deadline = call::grpc_timeout(metadata).map(|t| tokio::time::Instant::now() + t);
        Call::new(call::new_id(), deadline, self.stop.child_token())
    }

    /// Runs `work` in a task of its own once it is this call's turn, so that a caller that gives
    /// up (the kubelet's deadline) does not cancel it halfway; `call` is its
    /// [`call::current`], cancelled when this future is dropped before the task ends (the
    /// kubelet gave up). `Err` is a panic, in words.
    async fn run<T, F>(
        &self,
        what: &'static str,
        call: Call,
        work: F,
    ) -> Result<Result<T, BoxError>, String>
    where
        T: Send + 'static,
        F: Future<Output = Result<T, BoxError>> + Send + 'static,
    {
        let turns = self.turns.clone();
        let gave_up = call.token().clone().drop_guard();
        let task = tokio::spawn(
            call.scope(async move {
                let _turn = turns.take().await.map_err(BoxError::from)?;
                work.await
            })
            .in_current_span(),
        );
        let ended = task.await;
        gave_up.disarm();
        ended.map_err(|join| {
            let e = format!("the driver's {what} failed: {join}");
            (self.on_error)(ErrorKind::Fatal, &join, &e);
            e
        })
    }

    async fn prepare(&self, claims: Vec<Claim>, call: Call) -> Answers<Vec<PreparedDevice>> {
        let asked = claims.clone();
        let fetched = futures::future::join_all(claims.into_iter().map(|c| async {
            let uid = c.uid.clone();
            (uid, claims::fetch(&*self.claims, c, &self.name).await)
        }))
        .await;
        let mut answers: Answers<Vec<PreparedDevice>> = Vec::new();
        let mut ready: Vec<PrepareClaim> = Vec::new();
        for (uid, r) in fetched {
            match r {
                Ok(c) => ready.push(c),
                Err(e) => {
                    // RBAC or credentials: not passing by itself, unlike an unavailable server.
                    let kind = match &e {
                        claims::Error::Api {
                            source: crate::api::Error::Denied(_),
                            ..
                        } => ErrorKind::Fatal,
                        _ => ErrorKind::Recoverable,
                    };
                    // The hook (by default a `warn`) hears it inside a span naming the claim.
                    claim_span(&asked, &uid)
                        .in_scope(|| (self.on_error)(kind, &e, "claim refused before prepare"));
                    answers.push((uid, Err(chain(&e).to_string())));
                }
            }
        }
        if ready.is_empty() {
            return answers;
        }
        let uids: Vec<String> = ready.iter().map(|c| c.claim.uid.clone()).collect();
        let driver = self.driver.clone();
        let metadata = self.metadata.clone().map(|files| {
            let claims = ready.iter().map(|c| {
                let pod = crate::metadata::pod_claim_name(&c.resource_claim).map(String::from);
                (c.claim.clone(), pod)
            });
            (files, claims.collect())
        });
        let outcome = self
            .run("prepare", call, async move {
                let results = driver.prepare(ready).await?;
                match metadata {
                    Some((files, claims)) => {
                        crate::metadata::after_prepare(files, claims, results).await
                    }
                    None => Ok(results),
                }
            })
            .await;
        let settled = settle(&uids, outcome);
        log_failures("prepare", &asked, &settled);
        answers.extend(settled);
        answers
    }

    async fn unprepare(&self, claims: Vec<Claim>, call: Call) -> Answers<()> {
        if claims.is_empty() {
            return Vec::new();
        }
        let asked = claims.clone();
        let uids: Vec<String> = claims.iter().map(|c| c.uid.clone()).collect();
        let driver = self.driver.clone();
        let metadata = self.metadata.clone();
        let outcome = self
            .run("unprepare", call, async move {
                let results = driver.unprepare(claims).await?;
                match metadata {
                    Some(files) => crate::metadata::after_unprepare(files, results).await,
                    None => Ok(results),
                }
            })
            .await;
        let answers = settle(&uids, outcome);
        log_failures("unprepare", &asked, &answers);
        answers
    }
}

struct V1<D>(Handler<D>);
struct V1beta1<D>(Handler<D>);

macro_rules! serve_version {
    ($ty:ident, $ver:ident, $claims:ident, $prepare:ident, $unprepare:ident) => {
        #[tonic::async_trait]
        impl<D: Driver> $ver::dra_plugin_server::DraPlugin for $ty<D> {
            async fn node_prepare_resources(
                &self,
                request: Request<$ver::NodePrepareResourcesRequest>,
            ) -> Result<Response<$ver::NodePrepareResourcesResponse>, Status> {
                let call = self.0.begin(request.metadata());
                let $ver::NodePrepareResourcesRequest { claims } = request.into_inner();
                let claims = wire::$claims(claims);
                let span = call_span("NodePrepareResources", stringify!($ver), &call, &claims);
                async move {
                    tracing::debug!(deadline = ?call.deadline(), "NodePrepareResources");
                    let asked: Vec<String> = claims.iter().map(|c| c.uid.clone()).collect();
                    let results = self.0.prepare(claims, call).await;
                    Ok(Response::new(wire::$prepare(&asked, results)))
                }
                .instrument(span)
                .await
            }

            async fn node_unprepare_resources(
                &self,
                request: Request<$ver::NodeUnprepareResourcesRequest>,
            ) -> Result<Response<$ver::NodeUnprepareResourcesResponse>, Status> {
                let call = self.0.begin(request.metadata());
                let $ver::NodeUnprepareResourcesRequest { claims } = request.into_inner();
                let claims = wire::$claims(claims);
                let span = call_span("NodeUnprepareResources", stringify!($ver), &call, &claims);
                async move {
                    tracing::debug!(deadline = ?call.deadline(), "NodeUnprepareResources");
                    let asked: Vec<String> = claims.iter().map(|c| c.uid.clone()).collect();
                    let results = self.0.unprepare(claims, call).await;
                    Ok(Response::new(wire::$unprepare(&asked, results)))
                }
                .instrument(span)
                .await
            }
        }
    };
}

serve_version!(
    V1,
    v1,
    claims_v1,
    prepare_response_v1,
    unprepare_response_v1
);
serve_version!(
    V1beta1,
    v1beta1,
    claims_v1beta1,
    prepare_response_v1beta1,
    unprepare_response_v1beta1
);

mod wire {
    //! Conversions between the kubelet's DRA protos (`v1`, `v1beta1`) and the library's types,
    //! for the version services above.
    //! Proto structs are destructured exhaustively, so a new proto field breaks the build here
    //! instead of being dropped silently. Apart from `Device` (`v1` has `share_id`), the messages
    //! are field for field the same in both versions; one definition serves both.

    use std::collections::HashMap;

    use crate::claims::base_request;
    use crate::driver::{Claim, PreparedDevice};
    use crate::proto::dra::{v1, v1beta1};

    /// Each claim's outcome, its error already in words (the message and each cause once).
    pub type Answers<T> = Vec<(String, Result<T, String>)>;

    /// The kubelet wants base request names (`request`, not `request/subrequest`).
    fn base_requests(requests: Vec<String>) -> Vec<String> {
        requests
            .into_iter()
            .map(|r| base_request(&r).to_string())
            .collect()
    }

    fn device_v1(d: PreparedDevice) -> v1::Device {
        let PreparedDevice {
            requests,
            pool,
            device,
            cdi_ids,
            share_id,
            // Written to files by the service before the answer is made.
            metadata: _,
        } = d;
        v1::Device {
            request_names: base_requests(requests),
            pool_name: pool,
            device_name: device,
            cdi_device_ids: cdi_ids,
            share_id,
        }
    }

    fn device_v1beta1(d: PreparedDevice) -> v1beta1::Device {
        let PreparedDevice {
            requests,
            pool,
            device,
            cdi_ids,
            // v1beta1 has no share id: kubelets that speak only v1beta1 do not allocate shares.
            share_id: _,
            metadata: _,
        } = d;
        v1beta1::Device {
            request_names: base_requests(requests),
            pool_name: pool,
            device_name: device,
            cdi_device_ids: cdi_ids,
        }
    }

    /// Why a claim has no answer: the driver left it out of its results.
    #[derive(Debug, thiserror::Error)]
    #[error("the driver returned no result for claim {0}")]
    pub struct Missing(pub String);

    macro_rules! same_in_both {
        ($ver:ident, $claims:ident, $prepare:ident, $unprepare:ident, $device:ident) => {
            pub fn $claims(claims: Vec<$ver::Claim>) -> Vec<Claim> {
                claims
                    .into_iter()
                    .map(|c| {
                        let $ver::Claim {
                            namespace,
                            uid,
                            name,
                        } = c;
                        Claim {
                            namespace,
                            name,
                            uid,
                        }
                    })
                    .collect()
            }

            /// One entry per claim UID in `asked`, whatever the driver returned.
            pub fn $prepare(
                asked: &[String],
                results: Answers<Vec<PreparedDevice>>,
            ) -> $ver::NodePrepareResourcesResponse {
                let mut claims: HashMap<String, $ver::NodePrepareResourceResponse> = results
                    .into_iter()
                    .map(|(uid, r)| {
                        let entry = match r {
                            Ok(devices) => $ver::NodePrepareResourceResponse {
                                devices: devices.into_iter().map($device).collect(),
                                error: String::new(),
                            },
                            Err(e) => $ver::NodePrepareResourceResponse {
                                devices: Vec::new(),
                                error: e,
                            },
                        };
                        (uid, entry)
                    })
                    .collect();
                for uid in asked {
                    claims.entry(uid.clone()).or_insert_with(|| {
                        $ver::NodePrepareResourceResponse {
                            devices: Vec::new(),
                            error: Missing(uid.clone()).to_string(),
                        }
                    });
                }
                $ver::NodePrepareResourcesResponse { claims }
            }

            /// One entry per claim UID in `asked`, whatever the driver returned.
            pub fn $unprepare(
                asked: &[String],
                results: Answers<()>,
            ) -> $ver::NodeUnprepareResourcesResponse {
                let mut claims: HashMap<String, $ver::NodeUnprepareResourceResponse> = results
                    .into_iter()
                    .map(|(uid, r)| {
                        let error = r.err().unwrap_or_default();
                        (uid, $ver::NodeUnprepareResourceResponse { error })
                    })
                    .collect();
                for uid in asked {
                    claims.entry(uid.clone()).or_insert_with(|| {
                        $ver::NodeUnprepareResourceResponse {
                            error: Missing(uid.clone()).to_string(),
                        }
                    });
                }
                $ver::NodeUnprepareResourcesResponse { claims }
            }
        };
    }

    same_in_both!(
        v1,
        claims_v1,
        prepare_response_v1,
        unprepare_response_v1,
        device_v1
    );
    same_in_both!(
        v1beta1,
        claims_v1beta1,
        prepare_response_v1beta1,
        unprepare_response_v1beta1,
        device_v1beta1
    );

    #[cfg(test)]
    mod tests {
        use super::*;

        fn device(share: Option<&str>) -> PreparedDevice {
            PreparedDevice {
                requests: vec!["gpu/small".into()],
                pool: "node".into(),
                device: "gpu-0".into(),
                cdi_ids: vec!["k8s.example.com/claim=u-gpu-0".into()],
                share_id: share.map(String::from),
                metadata: None,
            }
        }

        fn uids(uids: &[&str]) -> Vec<String> {
            uids.iter().map(|u| u.to_string()).collect()
        }

        #[test]
        fn share_id_only_on_v1_and_errors_become_entries() {
            let ok = || ("a".to_string(), Ok(vec![device(Some("s1"))]));
            let bad = || ("b".to_string(), Err("claim ns/b is not allocated".into()));
            let asked = uids(&["a", "b"]);
            let r1 = prepare_response_v1(&asked, vec![ok(), bad()]);
            assert_eq!(r1.claims["a"].devices[0].share_id.as_deref(), Some("s1"));
            assert_eq!(r1.claims["a"].devices[0].pool_name, "node");
            assert_eq!(
                r1.claims["a"].devices[0].request_names,
                vec!["gpu".to_string()]
            );
            assert!(r1.claims["b"].error.contains("ns/b is not allocated"));
            assert!(r1.claims["b"].devices.is_empty());
            let r2 = prepare_response_v1beta1(&asked, vec![ok(), bad()]);
            assert_eq!(
                r2.claims["a"].devices[0].cdi_device_ids,
                vec!["k8s.example.com/claim=u-gpu-0".to_string()]
            );
            assert_eq!(
                r2.claims["a"].devices[0].request_names,
                vec!["gpu".to_string()]
            );
            assert!(!r2.claims["b"].error.is_empty());
        }

        #[test]
        fn a_claim_the_driver_left_out_still_gets_an_entry() {
            let asked = uids(&["a", "forgotten"]);
            let done: Answers<Vec<PreparedDevice>> = vec![("a".into(), Ok(vec![device(None)]))];
            let r = prepare_response_v1(&asked, done);
            assert_eq!(r.claims.len(), 2);
            assert_eq!(r.claims["a"].error, "");
            assert_eq!(
                r.claims["forgotten"].error,
                "the driver returned no result for claim forgotten"
            );
            let r = unprepare_response_v1beta1(&asked, vec![("a".into(), Ok(()))]);
            assert_eq!(r.claims["a"].error, "");
            assert!(!r.claims["forgotten"].error.is_empty());
        }

        #[test]
        fn claims_keep_every_field() {
            let c = claims_v1(vec![v1::Claim {
                namespace: "ns".into(),
                uid: "u-1".into(),
                name: "c".into(),
            }]);
            assert_eq!(
                c,
                vec![Claim {
                    namespace: "ns".into(),
                    name: "c".into(),
                    uid: "u-1".into(),
                }]
            );
        }
    }
}

/// Serves both DRA versions and the health stream on `listener` until `shutdown`, then removes
/// the socket `bound` (if it is still the one bound: see [`socket::Bound::remove`]).
async fn serve_dra<D: Driver>(
    handler: Handler<D>,
    health: HealthService,
    listener: UnixListener,
    bound: socket::Bound,
    shutdown: CancellationToken,
    layer: Option<ServerLayer>,
) -> Result<(), Error> {
    let result = tonic::transport::Server::builder()
        .layer(server_layer(layer))
        .add_service(v1::dra_plugin_server::DraPluginServer::new(V1(
            handler.clone()
        )))
        .add_service(v1beta1::dra_plugin_server::DraPluginServer::new(V1beta1(
            handler,
        )))
        .add_service(
            health_v1::dra_resource_health_server::DraResourceHealthServer::new(HealthV1(
                health.clone(),
            )),
        )
        .add_service(
            health_v1beta1::dra_resource_health_server::DraResourceHealthServer::new(
                HealthV1beta1(health.clone()),
            ),
        )
        .add_service(
            health_v1alpha1::dra_resource_health_server::DraResourceHealthServer::new(health),
        )
        .serve_with_incoming_shutdown(socket::incoming(listener), shutdown.cancelled())
        .await;
    bound.remove();
    tracing::info!(socket = %bound.path().display(), "DRA server stopped");
    result.map_err(|source| Error::Serve {
        path: bound.path().to_path_buf(),
        source,
    })
}

/// Everything about a plugin but its driver: the names, where it serves, how calls take turns,
/// where claims are read, and the hooks. Built once, from the driver and node names, which
/// every part (sockets, claim checks, [publisher](Options::publisher)) takes from here.
///
/// ```
/// # use kubelet_plugin::testing::MemoryClaims;
/// let opts = kubelet_plugin::Options::new("fpga.example.com", "node-a", MemoryClaims::default())?
///     .kubelet_root("/var/lib/kubelet")
///     .pod_uid("0f2d5a3c-1234-4bcd-9876-0123456789ab");
/// assert_eq!(
///     opts.plugin_dir(),
///     std::path::Path::new("/var/lib/kubelet/plugins/fpga.example.com")
/// );
/// # Ok::<(), kubelet_plugin::InvalidName>(())
/// ```
#[derive(Clone)]
pub struct Options {
    driver: String,
    node: String,
    claims: Arc<dyn ClaimSource>,
    kubelet_root: PathBuf,
    /// Set apart from the kubelet root (Go's `RegistrarDirectoryPath`, `PluginDataDirectoryPath`,
    /// `FlockDirectoryPath`).
    registry_dir: Option<PathBuf>,
    plugin_dir: Option<PathBuf>,
    lock_dir: Option<PathBuf>,
    layer: Option<ServerLayer>,
    pod_uid: Option<String>,
    serialize: bool,
    node_lock: bool,
    health: Option<Arc<dyn HealthSource>>,
    health_interval: Duration,
    on_error: ErrorHandler,
    on_registered: Option<RegistrationHook>,
    device_metadata: bool,
    cdi_dir: PathBuf,
}

impl std::fmt::Debug for Options {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Options")
            .field("driver", &self.driver)
            .field("node", &self.node)
            .field("kubelet_root", &self.kubelet_root)
            .field("registry_dir", &self.registry_dir)
            .field("plugin_dir", &self.plugin_dir)
            .field("lock_dir", &self.lock_dir)
            .field("layer", &self.layer.is_some())
            .field("pod_uid", &self.pod_uid)
            .field("serialize", &self.serialize)
            .field("node_lock", &self.node_lock)
            .field("health_interval", &self.health_interval)
            .finish_non_exhaustive()
    }
}

use names::InvalidName;

impl Options {
    /// The plugin of driver `driver` (a DNS subdomain such as `fpga.example.com`, as in a
    /// DeviceClass) on node `node`, reading claims from `claims` (a `kube::Client`, or
    /// `testing::MemoryClaims`). Either name invalid is an error naming it.
    ///
    /// Defaults: kubelet root `/var/lib/kubelet`, no pod UID, calls one at a time, the node
    /// lock taken when a pod UID is set, no device health, errors logged.
    pub fn new(
        driver: impl Into<String>,
        node: impl Into<String>,
        claims: impl ClaimSource,
    ) -> Result<Self, InvalidName> {
        let (driver, node) = (driver.into(), node.into());
        names::check("driver", &driver)?;
        names::check("node", &node)?;
        Ok(Self {
            driver,
            node,
            claims: Arc::new(claims),
            kubelet_root: PathBuf::from(crate::paths::DEFAULT_KUBELET_ROOT),
            registry_dir: None,
            plugin_dir: None,
            lock_dir: None,
            layer: None,
            pod_uid: None,
            serialize: true,
            node_lock: true,
            health: None,
            health_interval: crate::health::INTERVAL,
            on_error: Arc::new(crate::error::log_error),
            on_registered: None,
            device_metadata: false,
            cdi_dir: PathBuf::from(crate::metadata::DEFAULT_CDI_DIR),
        })
    }

    /// The kubelet's directory (`--root-dir`), `/var/lib/kubelet` by default: the registry and
    /// plugin data directories are under it unless set apart.
    pub fn kubelet_root(mut self, dir: impl Into<PathBuf>) -> Self {
        self.kubelet_root = dir.into();
        self
    }

    /// Where the kubelet watches for registration sockets, instead of
    /// `<kubelet root>/plugins_registry` (Go's `RegistrarDirectoryPath`; NVIDIA's
    /// `--kubelet-registrar-directory-path`). The same path inside and outside the driver's
    /// container.
    pub fn registrar_directory(mut self, dir: impl Into<PathBuf>) -> Self {
        self.registry_dir = Some(dir.into());
        self
    }

    /// This driver's directory, for the DRA socket the kubelet dials (its path is what
    /// registration announces), the device metadata files, and by default the node lock,
    /// instead of `<kubelet root>/plugins/<driver>` (Go's `PluginDataDirectoryPath`). Not shared
    /// with another plugin; the same path inside and outside the driver's container.
    pub fn plugin_data_directory(mut self, dir: impl Into<PathBuf>) -> Self {
        self.plugin_dir = Some(dir.into());
        self
    }

    /// Where the node lock's `serialize.lock` is, instead of the plugin data directory (Go's
    /// `FlockDirectoryPath`): the directory both instances of a rolling update see. Created
    /// when missing.
    pub fn lock_directory(mut self, dir: impl Into<PathBuf>) -> Self {
        self.lock_dir = Some(dir.into());
        self
    }

    /// A tower layer around both servers of the plugin, the DRA socket's (DRA and health
    /// services) and registration's: it sees every gRPC request (its path names the method)
    /// before the library's services do (Go's `GRPCInterceptor`). One layer; compose several
    /// with `tower::ServiceBuilder`. A layer whose responses have another body type maps them
    /// with `tonic::body::Body::new`.
    ///
    /// ```
    /// # use kubelet_plugin::testing::MemoryClaims;
    /// use kubelet_plugin::{GrpcRequest, Options};
    /// use tower::ServiceBuilder;
    ///
    /// let logged = ServiceBuilder::new()
    ///     .map_request(|r: GrpcRequest| {
    ///         tracing::info!(method = r.uri().path(), "kubelet call");
    ///         r
    ///     })
    ///     .into_inner();
    /// let opts = Options::new("fpga.example.com", "node-a", MemoryClaims::default())?.layer(logged);
    /// # Ok::<(), kubelet_plugin::InvalidName>(())
    /// ```
    pub fn layer<L>(mut self, layer: L) -> Self
    where
        L: tower::Layer<GrpcService> + Send + Sync + 'static,
        L::Service: tower::Service<GrpcRequest, Response = GrpcResponse, Error = BoxError>
            + Clone
            + Send
            + Sync
            + 'static,
        <L::Service as tower::Service<GrpcRequest>>::Future: Send + 'static,
    {
        self.layer = Some(ServerLayer::new(layer));
        self
    }

    /// This instance's pod UID (rolling updates, Go's `RollingUpdate`): sockets named apart, so
    /// two instances of the driver never share one (see [`Sockets::new`]), and, while calls are
    /// serialized, the node lock that makes the two instances take turns.
    pub fn pod_uid(mut self, uid: impl Into<String>) -> Self {
        self.pod_uid = Some(uid.into());
        self
    }

    /// Whether calls reach the driver one at a time (default `true`, as in Go). A driver that
    /// opts out must handle concurrent prepares and unprepares itself, and, with a pod UID,
    /// also the other instance of a rolling update (this also turns the node lock off).
    pub fn serialize(mut self, on: bool) -> Self {
        self.serialize = on;
        self
    }

    /// Whether serialized calls also take `<plugin dir>/serialize.lock` when a pod UID is set
    /// (default `true`): the lock the other instance of a rolling update takes too
    /// ([`crate::nodelock`]).
    pub fn node_lock(mut self, on: bool) -> Self {
        self.node_lock = on;
        self
    }

    /// Where the health stream reads device health; without one, it lists no device.
    pub fn health(mut self, source: Arc<dyn HealthSource>) -> Self {
        self.health = Some(source);
        self
    }

    /// How often the health stream re-sends an unchanged list ([`crate::health::INTERVAL`]).
    pub fn health_interval(mut self, every: Duration) -> Self {
        self.health_interval = every;
        self
    }

    /// Hears the errors no caller waits for (claims refused before the driver saw them, a
    /// driver call that panicked, the publisher's failures): Go's `HandleError`. The default
    /// is [`crate::log_error`].
    pub fn on_error(
        mut self,
        hook: impl Fn(ErrorKind, &(dyn std::error::Error + 'static), &str) + Send + Sync + 'static,
    ) -> Self {
        self.on_error = Arc::new(hook);
        self
    }

    /// Called with the kubelet's verdict on each registration (a readiness input).
    pub fn on_registered(mut self, hook: impl Fn(bool) + Send + Sync + 'static) -> Self {
        self.on_registered = Some(Arc::new(hook));
        self
    }

    /// Whether prepare writes device metadata files (KEP-5304) for its claims and unprepare
    /// removes them (default `false`, as in Go): see [`crate::metadata`]. The container
    /// runtime must read CDI specs from [`Options::cdi_dir`].
    pub fn device_metadata(mut self, on: bool) -> Self {
        self.device_metadata = on;
        self
    }

    /// Where the device metadata files' CDI specs go ([`crate::metadata::DEFAULT_CDI_DIR`] by
    /// default), a directory the container runtime reads specs from.
    pub fn cdi_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.cdi_dir = dir.into();
        self
    }

    /// The device metadata files of this plugin, when it writes them: for the start-up repair
    /// ([`crate::metadata::Files::retain`]) the driver runs before serving.
    pub fn metadata_files(&self) -> Option<crate::metadata::Files> {
        self.device_metadata
            .then(|| crate::metadata::Files::new(&self.driver, &self.plugin_dir(), &self.cdi_dir))
    }

    /// The driver name.
    pub fn driver(&self) -> &str {
        &self.driver
    }

    /// The node name.
    pub fn node(&self) -> &str {
        &self.node
    }

    /// The error hook ([`Options::on_error`]), for the driver's own background work.
    pub fn error_handler(&self) -> ErrorHandler {
        self.on_error.clone()
    }

    /// The DRA socket's directory, and the driver's own: `<kubelet root>/plugins/<driver>`
    /// unless [set apart](Options::plugin_data_directory).
    pub fn plugin_dir(&self) -> PathBuf {
        self.plugin_dir
            .clone()
            .unwrap_or_else(|| crate::paths::plugin_dir(&self.kubelet_root, &self.driver))
    }

    /// Where the kubelet watches for registration sockets: `<kubelet root>/plugins_registry`
    /// unless [set apart](Options::registrar_directory).
    pub fn registry_dir(&self) -> PathBuf {
        self.registry_dir
            .clone()
            .unwrap_or_else(|| crate::paths::registry_dir(&self.kubelet_root))
    }

    /// The node lock's directory: the plugin directory unless
    /// [set apart](Options::lock_directory).
    pub fn lock_dir(&self) -> PathBuf {
        self.lock_dir.clone().unwrap_or_else(|| self.plugin_dir())
    }

    /// This instance's socket paths.
    pub fn sockets(&self) -> Sockets {
        Sockets::new(
            &self.registry_dir(),
            &self.plugin_dir(),
            &self.driver,
            self.pod_uid.as_deref(),
        )
    }

    /// The publisher of this driver's ResourceSlices on this node, writing through `api`, its
    /// failures reported to [`Options::on_error`]. Run the [`crate::publisher::Publisher`];
    /// give it the desired slices through the handle.
    pub fn publisher(
        &self,
        api: Arc<dyn crate::api::SliceApi>,
    ) -> (
        crate::publisher::Publisher,
        crate::publisher::PublisherHandle,
    ) {
        let (publisher, handle) = crate::publisher::Publisher::new(api, &self.driver, &self.node);
        (publisher.on_error(self.on_error.clone()), handle)
    }

    fn turns(&self) -> Turns {
        if !self.serialize {
            return Turns::Concurrent;
        }
        let node =
            (self.node_lock && self.pod_uid.is_some()).then(|| NodeLock::new(&self.lock_dir()));
        Turns::OneAtATime {
            here: tokio::sync::Mutex::new(()),
            node,
        }
    }
}

/// Serves `driver` to the kubelet until `shutdown`: [`start`], then [`Serving::wait`].
pub async fn serve<D: Driver>(
    driver: Arc<D>,
    opts: Options,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    start(driver, opts, shutdown)?.wait().await
}

/// A plugin whose sockets are bound: the kubelet's connections queue until it is awaited.
#[must_use = "the plugin serves only while `wait` is awaited"]
pub struct Serving(futures::future::BoxFuture<'static, Result<(), Error>>);

impl std::fmt::Debug for Serving {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Serving")
    }
}

impl Serving {
    /// Serves until `shutdown`: the DRA services and the health stream on the DRA socket, and
    /// registration. Returns when both servers have stopped and their sockets are gone; the
    /// first server error ends both.
    pub async fn wait(self) -> Result<(), Error> {
        self.0.await
    }
}

/// Binds the plugin's sockets, the DRA socket first, then the registration socket (the kubelet
/// dials the DRA socket as soon as it sees the registration), so that a socket that cannot be
/// bound is an error of the start, as in Go's `Start`. Must be called within a Tokio runtime.
/// Dropping the returned [`Serving`] unused removes both sockets again.
pub fn start<D: Driver>(
    driver: Arc<D>,
    opts: Options,
    shutdown: CancellationToken,
) -> Result<Serving, Error> {
    let sockets = opts.sockets();
    let mut owned = socket::OwnedSockets::default();
    let dra_listener = socket::bind(&sockets.dra)?;
    let dra_bound = owned.adopt(&sockets.dra);
    tracing::info!(socket = %sockets.dra.display(), "DRA server listening (v1, v1beta1)");
    let registrar = Registrar {
        driver: opts.driver.clone(),
        sockets: sockets.clone(),
        registered: opts.on_registered.clone(),
        layer: opts.layer.clone(),
    };
    let reg_listener = registrar.bind()?;
    let reg_bound = owned.adopt(&sockets.registration);
    tracing::info!(socket = %sockets.registration.display(), "registration socket ready");
    let stop = shutdown.child_token();
    let health = HealthService::new(
        opts.health
            .clone()
            .unwrap_or_else(|| Arc::new(crate::health::NoHealth)),
        opts.health_interval,
        stop.clone(),
    );
    let handler = Handler {
        driver,
        name: opts.driver.as_str().into(),
        claims: opts.claims.clone(),
        turns: Arc::new(opts.turns()),
        on_error: opts.on_error.clone(),
        metadata: opts.metadata_files().map(Arc::new),
        stop: stop.clone(),
    };
    let on_error = opts.on_error;
    let layer = opts.layer;
    Ok(Serving(Box::pin(async move {
        let dra = serve_dra(
            handler,
            health,
            dra_listener,
            dra_bound,
            stop.clone(),
            layer,
        );
        let reg = registrar.run(reg_listener, reg_bound, stop.clone());
        // Whichever server ends first (shutdown, or an error) stops the other.
        let ended = |r: Result<(), Error>| {
            if let Err(e) = &r {
                on_error(ErrorKind::Fatal, e, "a server of the plugin stopped");
            }
            stop.cancel();
            r
        };
        let (dra, reg) = tokio::join!(async { ended(dra.await) }, async { ended(reg.await) });
        drop(owned);
        dra.and(reg)
    })))
}
