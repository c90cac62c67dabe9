//! The tower layer a driver puts around the plugin's servers ([`crate::Options::layer`]): the
//! types it sees, and how each server is built with it.

use crate::driver::BoxError;

/// A request as a layer around the plugin's servers sees it ([`crate::Options::layer`]).
pub type GrpcRequest = http::Request<tonic::body::Body>;
/// A response as a layer around the plugin's servers sees it.
pub type GrpcResponse = http::Response<tonic::body::Body>;
/// The service a layer around the plugin's servers wraps: all of one server's gRPC services,
/// type-erased.
pub type GrpcService = tower::util::BoxCloneSyncService<GrpcRequest, GrpcResponse, BoxError>;
/// A layer around both of the plugin's servers (the DRA socket's and registration), boxed
/// ([`crate::Options::layer`]).
pub type ServerLayer =
    tower::util::BoxCloneSyncServiceLayer<GrpcService, GrpcRequest, GrpcResponse, BoxError>;

/// The layer every server of the plugin is built with: the driver's
/// ([`crate::Options::layer`]) around the server's routes, or none.
pub(crate) fn server_layer(
    layer: Option<ServerLayer>,
) -> impl tower::Layer<tonic::service::Routes, Service = GrpcService> + Clone {
    tower::layer::layer_fn(move |routes: tonic::service::Routes| {
        use tower::ServiceExt;
        let inner = GrpcService::new(ServiceExt::<GrpcRequest>::map_err(
            routes,
            |never| match never {},
        ));
        match &layer {
            Some(layer) => tower::Layer::layer(layer, inner),
            None => inner,
        }
    })
}
