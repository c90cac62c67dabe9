#![doc = include_str!("../README.md")]
//!
//! ## Modules
//!
//! - [`socket`]: the Unix sockets the kubelet dials — binding, removal on every way out, and the
//!   adapter that makes h2 accept the `:authority` grpc-go sends (with its own HPACK decoder);
//! - [`serve`] and [`Options`]: the kubelet's DRA gRPC services `v1` and `v1beta1` on one
//!   socket, every requested claim answered, the health stream ([`health`]), and registration
//!   ([`registration`]), with socket names that let two instances of a driver run side by side
//!   during a rolling update, whose calls take turns through [`nodelock`];
//! - [`claims`]: reading and checking the claims the kubelet names;
//! - [`publisher`]: keeps the API server's ResourceSlices equal to the driver's desired ones
//!   (reconcile, pool generations, detection of fields the server drops), over the small
//!   [`api::SliceApi`] trait;
//! - [`validate`]: the API server's rules for ResourceSlices, to check desired slices before
//!   publishing them;
//! - [`metadata`]: the device metadata files (KEP-5304) a container reads, written after
//!   prepare and removed after unprepare;
//! - [`status`]: a driver's entries in a claim's `status.devices` (KEP-4817), written with
//!   server-side apply over the small [`api::ClaimStatusApi`] trait;
//! - [`paths`]: the kubelet's directory layout;
//! - [`report`] and [`lock`]: small helpers the library uses and exports for its drivers, so that
//!   they print errors and take locks as it does: an error with its sources in one line, and a
//!   `Mutex` taken ignoring poison;
//! - [`proto`]: the generated kubelet APIs (DRA, DRA health, plugin registration, device plugin,
//!   PodResources);
//! - `testing` (feature `testing`): in-memory claims and slices, and a kubelet client.
#![warn(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod api;
pub mod call;
pub mod claims;
mod driver;
mod error;
pub mod health;
mod layer;
pub mod lock;
pub mod metadata;
mod names;
pub mod nodelock;
pub mod paths;
pub mod proto;
pub mod publisher;
pub mod registration;
pub mod report;
mod service;
pub mod socket;
pub mod status;
#[cfg(feature = "testing")]
pub mod testing;
pub mod validate;

pub use driver::{
    BoxError, Claim, Driver, PrepareClaim, PrepareResults, PreparedDevice, UnprepareResults,
};
pub use error::{Error, ErrorHandler, ErrorKind, log_error};
pub use layer::{GrpcRequest, GrpcResponse, GrpcService, ServerLayer};
pub use names::InvalidName;
pub use registration::RegistrationHook;
pub use service::{Options, Serving, serve, start};

// The foreign crates whose types are part of this API, so a driver uses the very versions the
// library was built with.
pub use futures;
pub use k8s_openapi;
#[cfg(feature = "kube")]
pub use kube;
pub use tokio_util::sync::CancellationToken;
pub use tonic;
