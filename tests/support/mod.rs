//! Shared helpers for integration tests.

pub mod apiserver;
pub mod daemon;
pub mod dra;
pub mod fake_nvml;
pub mod grpcio;
pub mod manifests;
pub mod mps;
pub mod promclient;
pub mod python;
#[path = "../../crates/kubelet-plugin/tests/support/require.rs"]
pub mod require;
#[path = "../../crates/kubelet-plugin/tests/support/wait.rs"]
pub mod wait;
