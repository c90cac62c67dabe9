//! The API server as a publisher sees it: ResourceSlices and the Node that owns them, behind the
//! small [`SliceApi`] trait, and as a claim status writer sees it ([`ClaimStatusApi`]), with
//! errors classified by what the caller should do about them.
//! With the `kube` feature (on by default), a `kube::Client` is one ([`kube`]).

#[cfg(feature = "kube")]
pub mod kube;

use futures::future::BoxFuture;
use futures::stream::BoxStream;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Preconditions;

/// Errors from the API, classified by what the caller should do about them. Each carries a
/// [`Failure`]: what failed, and the error that made it fail as its source (never also in the
/// message).
#[derive(Debug)]
pub enum Error {
    /// The object changed since it was read (HTTP 409): re-read and retry.
    Conflict(Failure),
    /// The object does not exist (HTTP 404).
    NotFound(Failure),
    /// The server rejected the object (HTTP 422/400): a bug in what we sent; retrying is futile.
    Invalid(Failure),
    /// No API client could be built (no in-cluster config, unreadable kubeconfig, bad URL).
    Setup(Failure),
    /// The API server refused the caller: HTTP 401 (its credentials: a missing, expired or
    /// foreign ServiceAccount token or kubeconfig) or 403 (RBAC: no Role or ClusterRole bound to
    /// it allows the request). The message says which and what to check; retrying cannot help
    /// until an administrator fixes it.
    Denied(Failure),
    /// Anything that may pass: connection refused, 5xx, timeouts. Retry with backoff.
    Transient(Failure),
}

impl Error {
    fn parts(&self) -> (&'static str, &Failure) {
        match self {
            Error::Conflict(f) => ("conflict", f),
            Error::NotFound(f) => ("not found", f),
            Error::Invalid(f) => ("rejected by the API server", f),
            Error::Setup(f) => ("cannot set up the API client", f),
            Error::Denied(f) => ("denied by the API server", f),
            Error::Transient(f) => ("API server unavailable", f),
        }
    }
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (kind, failure) = self.parts();
        write!(f, "{kind}: {}", failure.what)
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.parts()
            .1
            .cause
            .as_deref()
            .map(|c| c as &(dyn std::error::Error + 'static))
    }
}

/// The cause of a [`Failure`]: a kube-rs, I/O, YAML or task error, kept with its type.
pub type Cause = Box<dyn std::error::Error + Send + Sync + 'static>;

/// What failed (the operation and object), and why. Displays `what` only; the cause is the
/// [`Error`]'s source, so a printer that walks the source chain says it once.
#[derive(Debug)]
pub struct Failure {
    /// The operation and object (`create resourceslice node-a-xyz`), and what went wrong.
    pub what: String,
    /// The error underneath, if any.
    pub cause: Option<Cause>,
}

impl Failure {
    /// `what` failed because of `cause`.
    pub fn caused(what: impl Into<String>, cause: impl Into<Cause>) -> Self {
        Self {
            what: what.into(),
            cause: Some(cause.into()),
        }
    }
}

impl From<String> for Failure {
    fn from(what: String) -> Self {
        Self { what, cause: None }
    }
}

impl From<&str> for Failure {
    fn from(what: &str) -> Self {
        what.to_string().into()
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.what)
    }
}

/// An API call's result.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Something changed among the watched slices; the publisher re-lists and reconciles.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SliceEvent {
    /// A slice was added or modified (name).
    Applied(String),
    /// A slice was deleted (name).
    Deleted(String),
    /// The watch was (re)started; state may have changed while it was down.
    Restarted,
}

/// What the publisher needs of the API server. Implementations are shared behind an `Arc`.
pub trait SliceApi: Send + Sync + 'static {
    /// Slices with `spec.driver == driver` and `spec.nodeName == node`; with `node` empty, the
    /// driver's slices that name no node (network-attached pools).
    fn list_slices<'a>(
        &'a self,
        driver: &'a str,
        node: &'a str,
    ) -> BoxFuture<'a, Result<Vec<ResourceSlice>>>;

    /// Creates a slice (`metadata.generateName` honoured); returns it as stored.
    fn create_slice<'a>(&'a self, slice: &'a ResourceSlice)
    -> BoxFuture<'a, Result<ResourceSlice>>;

    /// Replaces a slice; `metadata.resourceVersion` must match the stored one, else `Conflict`.
    fn replace_slice<'a>(
        &'a self,
        slice: &'a ResourceSlice,
    ) -> BoxFuture<'a, Result<ResourceSlice>>;

    /// Deletes a slice by name; deleting a missing slice is `NotFound`. When `preconditions`
    /// names a uid or resourceVersion, a slice that no longer has them is left in place:
    /// `Conflict`.
    fn delete_slice<'a>(
        &'a self,
        name: &'a str,
        preconditions: &'a Preconditions,
    ) -> BoxFuture<'a, Result<()>>;

    /// Changes to this driver's slices on this node (`node` empty: that name no node), by
    /// anyone. The first item is `Restarted`, and so is any item after which events may have
    /// been missed (e.g. a re-list after 410 Gone). The stream ends or yields errors when the
    /// connection drops; callers restart it.
    fn watch_slices<'a>(
        &'a self,
        driver: &'a str,
        node: &'a str,
    ) -> BoxStream<'a, Result<SliceEvent>>;

    /// Reads a Node (for the owner reference of published slices). `NotFound` means the slices
    /// are published without an owner.
    fn get_node<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Node>>;
}

/// What a [`crate::status::StatusWriter`] needs of the API server: server-side apply of a
/// ResourceClaim's status. Implementations are shared behind an `Arc`.
pub trait ClaimStatusApi: Send + Sync + 'static {
    /// Applies `patch`, a ResourceClaim apply configuration (`apiVersion`, `kind`,
    /// `metadata.name`, `namespace` and `uid`, and the `status` fields `field_manager` owns),
    /// to the claim's `status` subresource: a `PATCH` of type `application/apply-patch+yaml`
    /// as `field_manager`, conflicts forced. Returns the claim as stored. A missing claim is
    /// [`Error::NotFound`]; one whose UID differs from `metadata.uid` (deleted and re-created),
    /// [`Error::Conflict`].
    fn apply_claim_status<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
        field_manager: &'a str,
        patch: &'a serde_json::Value,
    ) -> BoxFuture<'a, Result<ResourceClaim>>;
}

impl<T: ClaimStatusApi + ?Sized> ClaimStatusApi for std::sync::Arc<T> {
    fn apply_claim_status<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
        field_manager: &'a str,
        patch: &'a serde_json::Value,
    ) -> BoxFuture<'a, Result<ResourceClaim>> {
        (**self).apply_claim_status(namespace, name, field_manager, patch)
    }
}
