//! Shared helpers for integration tests.

pub mod apiserver;
pub mod cd_cluster;
pub mod daemon;
pub mod dra;
pub mod fake_nvml;
pub mod flood;
pub mod grpcio;
pub mod manifests;
pub mod mps;
// The integration binary's CDI tests use it; the fake-NVML binaries include support/ too.
#[allow(dead_code)]
pub mod podman;
pub mod promclient;
pub mod python;
#[path = "../../crates/kubelet-plugin/tests/support/require.rs"]
pub mod require;
#[path = "../../crates/kubelet-plugin/tests/support/wait.rs"]
pub mod wait;

/// The name libtest gives `test` of the module `module` (its `module_path!()`): the path below the
/// crate, which `--exact` matches when a test runs one test of its binary as a child process.
#[allow(dead_code)] // Each test binary uses what it needs.
pub fn test_name(module: &str, test: &str) -> String {
    match module.split_once("::") {
        Some((_crate, path)) => format!("{path}::{test}"),
        None => test.to_string(),
    }
}

/// Whether util-linux's `setpriv` runs (the tests that drop `CAP_SYS_ADMIN` from nvdra's
/// bounding set need it). Without it the calling test is skipped, saying so, or fails when
/// `NVDRA_REQUIRE_SETPRIV` requires it, as CI does.
#[allow(dead_code)] // Each test binary uses what it needs.
pub fn setpriv() -> bool {
    let found = std::process::Command::new("setpriv")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !found && require::required("NVDRA_REQUIRE_SETPRIV") {
        panic!(
            "NVDRA_REQUIRE_SETPRIV requires util-linux's setpriv but `setpriv --version` does not \
             run: install util-linux, or unset NVDRA_REQUIRE_SETPRIV"
        );
    }
    if !found {
        eprintln!(
            "setpriv (util-linux) is not installed: skipped (set NVDRA_REQUIRE_SETPRIV=1 to make \
             this a failure)"
        );
    }
    found
}
