//! Dynamic Resource Allocation: everything nvdra does as a `resource.k8s.io/v1` DRA driver. The
//! kubelet side (sockets, registration, the gRPC services, the health stream) and ResourceSlice
//! publishing are the `kubelet-plugin` library's; nvdra supplies what is GPU-specific.
//!
//! The parts, layered so that each depends only on those listed before it:
//!
//! - [`slices`] — pure: turns an [`Inventory`](crate::inventory::Inventory) into the desired
//!   ResourceSlices (device names, attributes, capacities, shared counters, splitting at the API
//!   server's limits) and validates them against those limits. No I/O.
//! - [`sync`] — keeps the desired slices following the inventory and its health, and hands them
//!   to the library's publisher.
//! - [`plugin`] — the prepare/unprepare state machine (with [`mps`] daemons and the
//!   [`compute_mode`] of GPUs that hold shares), the library's [`kubelet_plugin::Driver`]
//!   (`plugin/prepare.rs`), and device [`health`] for the health stream.

pub mod compute_mode;
pub mod health;
pub mod mps;
pub mod plugin;
pub mod slices;
pub mod sync;
