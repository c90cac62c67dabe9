//! Dynamic Resource Allocation: everything nvdra does as a `resource.k8s.io/v1` DRA driver.
//!
//! The parts, layered so that each depends only on those listed before it:
//!
//! - [`slices`] — pure: turns an [`Inventory`](crate::inventory::Inventory) into the desired
//!   ResourceSlices (device names, attributes, capacities, shared counters, splitting at the API
//!   server's limits) and validates them against those limits. No I/O.
//! - [`publisher`] — reconciles the desired slices with the API server (create, update, delete,
//!   pool generation, re-publishing after the kubelet wipes them).
//! - [`plugin`] — the kubelet side: the prepare/unprepare state machine (with [`mps`] daemons and
//!   the cross-instance [`nodelock`]), the DRA gRPC services `v1` and `v1beta1` ([`grpc`], with
//!   proto conversions in [`wire`]), device [`health`] streaming and kubelet [`registration`].

pub mod grpc;
pub mod health;
pub mod mps;
pub mod nodelock;
pub mod plugin;
pub mod publisher;
pub mod registration;
pub mod slices;
pub mod sync;
pub mod wire;
