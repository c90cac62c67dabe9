//! Why a kubelet-facing server could not serve, and the hook that hears about errors no caller
//! is waiting for (Go's `HandleError`).

use std::path::PathBuf;
use std::sync::Arc;

use crate::socket;

/// A server of the plugin (DRA or registration) failed, or the plugin could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A socket could not be bound or prepared.
    #[error(transparent)]
    Socket(#[from] socket::Error),
    /// A gRPC server stopped with an error.
    #[error("gRPC server on {path} failed")]
    Serve {
        /// The server's socket.
        path: PathBuf,
        /// What tonic reported.
        source: tonic::transport::Error,
    },
}

/// Whether an error reported to an [`ErrorHandler`] passes by itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ErrorKind {
    /// It is retried (an API server that is down, a claim the kubelet will ask for again): log
    /// it, count it.
    Recoverable,
    /// It does not pass by retrying (the API server rejects what the driver publishes, a
    /// server of the plugin stopped): the driver should make it visible, or exit.
    Fatal,
}

/// Hears errors no caller waits for: publishing failures, claims refused or failed, servers
/// stopping (Go's `HandleError`). The default logs them with `tracing`.
pub type ErrorHandler =
    Arc<dyn Fn(ErrorKind, &(dyn std::error::Error + 'static), &str) + Send + Sync>;

/// The default [`ErrorHandler`]: a `warn` for a recoverable error, an `error` for a fatal one,
/// with the whole source chain.
pub fn log_error(kind: ErrorKind, error: &(dyn std::error::Error + 'static), what: &str) {
    let error = crate::report::chain(error);
    match kind {
        ErrorKind::Recoverable => tracing::warn!(%error, "{what}"),
        _ => tracing::error!(%error, "{what}"),
    }
}
