//! nvdra's integration tests, one module per subject, linked into one test binary: on a 2-core
//! CI machine linking each file as its own binary (all of them against nvdra and its
//! dependencies) was a large part of the tests' build. Test names are `module::test`
//! (`cargo test --test integration layering::`).
//!
//! The tests share this process, so none sets an environment variable or changes the working
//! directory of its own process; each child (`nvdra`, the fake NVML's users) gets its own
//! environment. Three files stay binaries of their own (`tests/nvml_fake.rs`,
//! `tests/health_nvml.rs`, `tests/memory_limits.rs`): they load the fake NVML into their own
//! process, whose node is process-wide and which `health_nvml` and `memory_limits` change (an
//! injected XID, a lost GPU, MIG devices created and destroyed, memory limits) and
//! `nvml_fake` expects as the fake starts it. The fake's other users here load it in child
//! processes only.

#[path = "../support/mod.rs"]
mod support;

mod admission;
mod auto_mode;
mod both_grpcio;
mod cd_controller;
mod cd_daemon;
mod cd_e2e;
mod cd_manifests;
mod cd_plugin;
mod cdi_hooks;
mod cdi_podman;
mod claim_status;
// `nvdra demo`, `match` and `validate` are built with the `tools` feature only.
#[cfg(feature = "tools")]
mod cli_demo;
mod cli_inventory;
#[cfg(feature = "tools")]
mod cli_match;
mod cli_paths;
mod cli_slices;
mod device_check;
mod device_metadata;
mod deviceplugin_grpcio;
mod deviceplugin_health;
mod dra_crash;
mod dra_plugin;
mod dynamic_mig;
mod health;
mod helm;
mod hook_floor;
mod kubelet_grpcio;
mod layering;
mod manifests;
mod metrics_attribution;
mod metrics_flood;
mod mps_gate_podman;
mod mps_host;
mod node_labels;
mod nvml_fabric;
mod nvml_mig_mode;
mod nvml_profiles;
mod slice_sync;
mod startup_versions;
mod yaml_readers;
