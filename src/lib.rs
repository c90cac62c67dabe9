//! nvdra: NVIDIA GPUs for Kubernetes — a DRA kubelet plugin with a device-plugin fallback.
//!
//! `inventory` describes the node's GPUs; everything downstream is a function of it: the DRA
//! driver (`dra`: slices, prepare, health) on the `kubelet-plugin` library, the device plugin
//! (`deviceplugin`), CDI specs (`cdi`) and the checkpoint (`ledger`, typed ids from `ids`).
//! Domain modules know nothing of gRPC, kube or NVML; adapters depend on them, and no module
//! imports in a circle (`tests/integration/layering.rs`). `cel`, `matching` and `demo` are the
//! tools for people, built with the default `tools` feature only.

pub mod api;
pub mod cdi;
#[cfg(feature = "tools")]
pub mod cel;
pub mod child;
pub mod cli;
pub mod computedomain;
pub mod config;
pub mod daemon;
#[cfg(feature = "tools")]
pub mod demo;
pub mod deviceplugin;
pub mod dns;
pub mod dra;
pub mod durable;
pub mod health;
pub mod holds;
pub mod ids;
pub mod inventory;
pub mod ledger;
#[cfg(feature = "tools")]
pub mod matching;
pub mod metrics;
pub mod mps;
pub mod sharing;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
pub mod versions;
pub mod yaml;

// How errors are printed and poison-ignoring locks are taken: the library's, as it does.
pub use kubelet_plugin::{lock, report};
