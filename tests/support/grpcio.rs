//! The grpcio kubelet stand-in (`crates/kubelet-plugin/tests/kubelet/standin.py`): where it is and whether python3
//! can run it. The stand-in is a kubelet nvdra did not write (grpcio's C core, a raw HTTP/2
//! client on the PyPI hpack encoder), for the DRA, registration, device-plugin and PodResources
//! sockets.
// Each test binary uses what it needs.
#![allow(dead_code)]

use std::process::Command;
use std::sync::OnceLock;

/// What CI installs (`.ci/run`); the stand-in is tested with exactly these.
pub const PIP: &str =
    "python3 -m pip install grpcio==1.85.1 grpcio-tools==1.85.1 protobuf==7.36.2 hpack==4.2.0";
pub const STANDIN: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/crates/kubelet-plugin/tests/kubelet/standin.py"
);

fn required() -> bool {
    std::env::var("NVDRA_REQUIRE_GRPCIO").is_ok_and(|v| !v.is_empty() && v != "0")
}

/// Whether python3 can import what the stand-in needs (probed once per test binary); skips or,
/// when required, fails the calling test otherwise.
pub fn have_grpcio() -> bool {
    static PROBE: OnceLock<Result<(), String>> = OnceLock::new();
    let probe = PROBE.get_or_init(|| {
        let out = Command::new("python3")
            .args([
                "-c",
                "import grpc, grpc_tools.protoc, google.protobuf, hpack",
            ])
            .output()
            .map_err(|e| format!("cannot run python3: {e}"))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(format!(
                "python3 cannot import grpc, grpc_tools, protobuf and hpack: {}",
                // The exception, not the traceback above it.
                String::from_utf8_lossy(&out.stderr)
                    .trim()
                    .lines()
                    .last()
                    .unwrap_or("")
            ))
        }
    });
    match probe {
        Ok(()) => true,
        Err(why) if required() => panic!("NVDRA_REQUIRE_GRPCIO is set but {why}; run: {PIP}"),
        Err(why) => {
            eprintln!(
                "skipped: the grpcio kubelet stand-in: {why} (run: {PIP}; set NVDRA_REQUIRE_GRPCIO=1 to make this a failure)"
            );
            false
        }
    }
}
