//! The kubelet-facing gRPC servers of a DRA plugin: `v1.DRAPlugin`, `v1beta1.DRAPlugin` and
//! `DRAResourceHealth` (`v1`, `v1beta1`, `v1alpha1`) on one Unix socket, over one [`Driver`].
//! Errors of a claim travel in its response entry; the RPC itself never fails for a claim.
//!
//! [`serve`] runs a whole plugin: the DRA socket first, then the registration socket (the
//! kubelet dials the endpoint as soon as it sees the registration), until shutdown, removing
//! both sockets on the way out.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use tokio::net::UnixListener;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::driver::Driver;
pub use crate::error::Error;
use crate::health::{HealthService, HealthSource, HealthV1, HealthV1beta1};
use crate::proto::dra::{v1, v1beta1};
use crate::proto::health::{
    v1 as health_v1, v1alpha1 as health_v1alpha1, v1beta1 as health_v1beta1,
};
use crate::registration::{Registrar, Sockets};
use crate::{socket, wire};

/// One handler per operation; each version's service converts its messages and calls it.
struct Handler<D>(Arc<D>);

impl<D> Clone for Handler<D> {
    fn clone(&self) -> Self {
        Self(self.0.clone())
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
                let $ver::NodePrepareResourcesRequest { claims } = request.into_inner();
                tracing::debug!(
                    claims = claims.len(),
                    concat!(stringify!($ver), " NodePrepareResources")
                );
                let claims = wire::$claims(claims);
                let asked: Vec<String> = claims.iter().map(|c| c.uid.clone()).collect();
                let results = (self.0).0.prepare(claims).await;
                Ok(Response::new(wire::$prepare(&asked, results)))
            }

            async fn node_unprepare_resources(
                &self,
                request: Request<$ver::NodeUnprepareResourcesRequest>,
            ) -> Result<Response<$ver::NodeUnprepareResourcesResponse>, Status> {
                let $ver::NodeUnprepareResourcesRequest { claims } = request.into_inner();
                tracing::debug!(
                    claims = claims.len(),
                    concat!(stringify!($ver), " NodeUnprepareResources")
                );
                let claims = wire::$claims(claims);
                let asked: Vec<String> = claims.iter().map(|c| c.uid.clone()).collect();
                let results = (self.0).0.unprepare(claims).await;
                Ok(Response::new(wire::$unprepare(&asked, results)))
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

/// Serves both DRA versions and the health stream on `listener` until `shutdown`, then removes
/// the socket `bound` (if it is still the one bound: see [`socket::Bound::remove`]).
pub async fn serve_dra<D: Driver>(
    driver: Arc<D>,
    health: HealthService,
    listener: UnixListener,
    bound: socket::Bound,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    let result = tonic::transport::Server::builder()
        .add_service(v1::dra_plugin_server::DraPluginServer::new(V1(Handler(
            driver.clone(),
        ))))
        .add_service(v1beta1::dra_plugin_server::DraPluginServer::new(V1beta1(
            Handler(driver),
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

/// Where and as whom a plugin serves.
#[derive(Clone, Debug)]
pub struct Options {
    /// The DRA driver name (`gpu.example.com`).
    pub driver: String,
    /// The kubelet's directory, `/var/lib/kubelet` by default.
    pub kubelet_root: PathBuf,
    /// This instance's pod UID: sockets named apart, so a rolling update's two instances
    /// never share one (see [`Sockets::new`]).
    pub pod_uid: Option<String>,
    /// How often the health stream re-sends an unchanged list ([`crate::health::INTERVAL`]).
    pub health_interval: Duration,
}

impl Options {
    pub fn new(driver: impl Into<String>) -> Self {
        Self {
            driver: driver.into(),
            kubelet_root: PathBuf::from("/var/lib/kubelet"),
            pod_uid: None,
            health_interval: crate::health::INTERVAL,
        }
    }

    /// `<kubelet root>/plugins/<driver>`: the DRA socket's directory, and the driver's own.
    pub fn plugin_dir(&self) -> PathBuf {
        self.kubelet_root.join("plugins").join(&self.driver)
    }

    /// `<kubelet root>/plugins_registry`, which the kubelet watches for registration sockets.
    pub fn registry_dir(&self) -> PathBuf {
        self.kubelet_root.join("plugins_registry")
    }

    pub fn sockets(&self) -> Sockets {
        Sockets::new(
            &self.registry_dir(),
            &self.plugin_dir(),
            &self.driver,
            self.pod_uid.as_deref(),
        )
    }
}

/// Serves `driver` to the kubelet until `shutdown`: the DRA services and the health stream
/// (from `health`, or an empty device list) on the DRA socket, then registration. Returns when
/// both servers have stopped and their sockets are gone; the first server error ends both.
/// `registered` follows the kubelet's verdict on the registration.
pub async fn serve<D: Driver>(
    driver: Arc<D>,
    health: Option<Arc<dyn HealthSource>>,
    opts: Options,
    registered: Arc<AtomicBool>,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    let sockets = opts.sockets();
    let mut owned = socket::OwnedSockets::default();
    let listener = socket::bind(&sockets.dra)?;
    let bound = owned.adopt(&sockets.dra);
    let stop = shutdown.child_token();
    let health = HealthService::new(
        health.unwrap_or_else(|| Arc::new(crate::health::NoHealth)),
        opts.health_interval,
        stop.clone(),
    );
    let dra = serve_dra(driver, health, listener, bound, stop.clone());
    let registrar = Registrar {
        driver: opts.driver.clone(),
        sockets: sockets.clone(),
        registered,
    };
    let listener = registrar.bind()?;
    let bound = owned.adopt(&sockets.registration);
    let reg = registrar.run(listener, bound, stop.clone());
    // Whichever server ends first (shutdown, or an error) stops the other.
    let (dra, reg) = tokio::join!(
        async {
            let r = dra.await;
            stop.cancel();
            r
        },
        async {
            let r = reg.await;
            stop.cancel();
            r
        },
    );
    drop(owned);
    dra.and(reg)
}
