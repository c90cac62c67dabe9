//! nvdra: NVIDIA GPUs for Kubernetes — a DRA kubelet plugin with a device-plugin fallback.
//!
//! The modules follow `DESIGN.md`: `inventory` describes the node's GPUs; everything downstream is
//! a function of it. Domain modules know nothing of gRPC, kube or NVML; adapters depend on them.

pub mod api;
pub mod cli;
pub mod config;
pub mod dra;
pub mod inventory;
pub mod proto;
