//! The kubelet-facing gRPC servers of the DRA plugin: `v1.DRAPlugin`, `v1beta1.DRAPlugin` and
//! `DRAResourceHealth` (`v1`, `v1beta1`, `v1alpha1`) on one Unix socket. Errors of a claim travel in its response entry; the RPC itself fails only for
//! requests that cannot be answered at all (never, today).

use std::path::PathBuf;

use tokio::net::UnixListener;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use super::health::{HealthService, HealthV1, HealthV1beta1};
use super::plugin::Plugin;
use super::wire;
use crate::proto::dra::{v1, v1beta1};
use crate::proto::health::{
    v1 as health_v1, v1alpha1 as health_v1alpha1, v1beta1 as health_v1beta1,
};
use crate::socket;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Socket(#[from] socket::Error),
    #[error("gRPC server on {path} failed")]
    Serve {
        path: PathBuf,
        #[source]
        source: tonic::transport::Error,
    },
}

#[derive(Clone)]
struct V1(Plugin);

#[derive(Clone)]
struct V1beta1(Plugin);

#[tonic::async_trait]
impl v1::dra_plugin_server::DraPlugin for V1 {
    async fn node_prepare_resources(
        &self,
        request: Request<v1::NodePrepareResourcesRequest>,
    ) -> Result<Response<v1::NodePrepareResourcesResponse>, Status> {
        let v1::NodePrepareResourcesRequest { claims } = request.into_inner();
        tracing::debug!(claims = claims.len(), "v1 NodePrepareResources");
        let claims = wire::claims_v1(claims);
        let results = self.0.prepare(claims.valid).await;
        Ok(Response::new(wire::prepare_response_v1(
            claims.rejected,
            results,
        )))
    }

    async fn node_unprepare_resources(
        &self,
        request: Request<v1::NodeUnprepareResourcesRequest>,
    ) -> Result<Response<v1::NodeUnprepareResourcesResponse>, Status> {
        let v1::NodeUnprepareResourcesRequest { claims } = request.into_inner();
        tracing::debug!(claims = claims.len(), "v1 NodeUnprepareResources");
        let claims = wire::claims_v1(claims);
        let results = self.0.unprepare(claims.valid).await;
        Ok(Response::new(wire::unprepare_response_v1(
            claims.rejected,
            results,
        )))
    }
}

#[tonic::async_trait]
impl v1beta1::dra_plugin_server::DraPlugin for V1beta1 {
    async fn node_prepare_resources(
        &self,
        request: Request<v1beta1::NodePrepareResourcesRequest>,
    ) -> Result<Response<v1beta1::NodePrepareResourcesResponse>, Status> {
        let v1beta1::NodePrepareResourcesRequest { claims } = request.into_inner();
        tracing::debug!(claims = claims.len(), "v1beta1 NodePrepareResources");
        let claims = wire::claims_v1beta1(claims);
        let results = self.0.prepare(claims.valid).await;
        Ok(Response::new(wire::prepare_response_v1beta1(
            claims.rejected,
            results,
        )))
    }

    async fn node_unprepare_resources(
        &self,
        request: Request<v1beta1::NodeUnprepareResourcesRequest>,
    ) -> Result<Response<v1beta1::NodeUnprepareResourcesResponse>, Status> {
        let v1beta1::NodeUnprepareResourcesRequest { claims } = request.into_inner();
        tracing::debug!(claims = claims.len(), "v1beta1 NodeUnprepareResources");
        let claims = wire::claims_v1beta1(claims);
        let results = self.0.unprepare(claims.valid).await;
        Ok(Response::new(wire::unprepare_response_v1beta1(
            claims.rejected,
            results,
        )))
    }
}

/// Serves both DRA versions and the health stream on `listener` until `shutdown`, then removes
/// the socket `bound` (if it is still the one bound: see [`socket::Bound::remove`]).
pub async fn serve_dra(
    plugin: Plugin,
    health: HealthService,
    listener: UnixListener,
    bound: socket::Bound,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    let result = tonic::transport::Server::builder()
        .add_service(v1::dra_plugin_server::DraPluginServer::new(V1(
            plugin.clone()
        )))
        .add_service(v1beta1::dra_plugin_server::DraPluginServer::new(V1beta1(
            plugin,
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
