//! Dynamic Resource Allocation: everything nvdra does as a `resource.k8s.io/v1` DRA driver.
//!
//! The parts, layered so that each depends only on those listed before it:
//!
//! - [`slices`] — pure: turns an [`Inventory`](crate::inventory::Inventory) into the desired
//!   ResourceSlices (device names, attributes, capacities, shared counters, splitting at the API
//!   server's limits) and validates them against those limits. No I/O.
//! - `publisher` — reconciles the desired slices with the API server (create, update, delete,
//!   pool generation, re-publishing after the kubelet wipes them).
//! - `plugin` — the kubelet side: registration, the DRA gRPC services (`v1` and `v1beta1`),
//!   prepare/unprepare through CDI, the health stream.

pub mod publisher;
pub mod slices;
pub mod sync;
