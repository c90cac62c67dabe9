//! Kubelet plugins in Rust: what a Dynamic Resource Allocation (DRA) driver needs to run on a
//! node, and nothing about the devices it drives. The Rust counterpart of Go's
//! `k8s.io/dynamic-resource-allocation/kubeletplugin` and `resourceslice`.
//!
//! A driver implements [`Driver`] (prepare and unprepare a batch of claims) and, if it reports
//! device health, [`health::HealthSource`]. The library does the rest:
//!
//! - [`socket`]: the Unix sockets the kubelet dials — binding, removal on every way out, and the
//!   adapter that makes h2 accept the `:authority` grpc-go sends (with its own HPACK decoder);
//! - [`service`]: the kubelet's DRA gRPC services `v1` and `v1beta1` on one socket — one handler,
//!   two wire conversions — with every requested claim answered, and the health stream
//!   ([`health`], `v1`, `v1beta1`, `v1alpha1`);
//! - [`registration`]: the kubelet's plugin registration, with socket names that let two
//!   instances of a driver run side by side during a rolling update;
//! - [`nodelock`]: the `flock` that serializes those instances' prepares;
//! - [`publisher`]: keeps the API server's ResourceSlices equal to the driver's desired ones
//!   (reconcile, pool generations, detection of fields the server drops), over the small
//!   [`api::SliceApi`] trait;
//! - [`proto`]: the generated kubelet APIs (DRA, DRA health, plugin registration, device plugin,
//!   PodResources).
//!
//! [`serve`] puts the kubelet side together for a driver; `examples/one-device.rs` is a complete
//! driver in a few lines.

pub mod api;
mod driver;
mod error;
pub mod health;
pub mod lock;
pub mod nodelock;
pub mod proto;
pub mod publisher;
pub mod registration;
pub mod report;
pub mod service;
pub mod socket;
mod wire;

pub use driver::{Claim, Driver, PrepareResults, PreparedDevice, UnprepareResults};
pub use error::Error;
pub use service::{Options, serve};
