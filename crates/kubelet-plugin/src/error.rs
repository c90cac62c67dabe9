//! Why a kubelet-facing server could not serve.

use std::path::PathBuf;

use crate::socket;

/// A server of the plugin (DRA or registration) failed.
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
