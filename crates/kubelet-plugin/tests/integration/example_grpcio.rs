//! The library on its own: its example driver (`examples/one-device.rs`) runs as a process and
//! is registered, prepared, unprepared and health-watched by the grpcio kubelet stand-in
//! (`tests/kubelet/standin.py`, grpcio's C core and a raw HTTP/2 client), over every
//! `:authority` form the kubelet and its clients send.
//!
//! Needs python3 with `grpcio==1.85.1 grpcio-tools==1.85.1 protobuf==7.36.2 hpack==4.2.0`; the
//! test skips without them unless `KUBELET_PLUGIN_REQUIRE_GRPCIO=1` (CI sets it). `cargo test`
//! builds the example; after `cargo test --test integration example_grpcio::` alone, `cargo build --examples`.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::{example, require};

const DRIVER: &str = "example.com";
const NODE: &str = "node-1";
const CLAIMS: [&str; 2] = [
    "0f2d5a3c-1234-4bcd-9876-0123456789ab",
    "7a0c1e44-aaaa-4bbb-8ccc-00000000000d",
];
const STANDIN: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/kubelet/standin.py");
const PIP: &str =
    "python3 -m pip install grpcio==1.85.1 grpcio-tools==1.85.1 protobuf==7.36.2 hpack==4.2.0";

/// Whether python3 can run the stand-in; skips, or fails when CI requires it.
fn have_grpcio() -> bool {
    let ok = Command::new("python3")
        .args([
            "-c",
            "import grpc, grpc_tools.protoc, google.protobuf, hpack",
        ])
        .output()
        .is_ok_and(|o| o.status.success());
    let required = require::required("KUBELET_PLUGIN_REQUIRE_GRPCIO");
    assert!(
        ok || !required,
        "KUBELET_PLUGIN_REQUIRE_GRPCIO=1 but python3 cannot import the stand-in's modules; run: {PIP}"
    );
    if !ok {
        eprintln!("skipped: the grpcio kubelet stand-in needs: {PIP}");
    }
    ok
}

/// The rule every `*_REQUIRE_*` variable is read by, nvdra's included: the three spellings of
/// yes and of no, in any case, and an unknown value refused with the variable's name.
#[test]
fn a_require_variable_is_yes_no_or_refused() {
    for yes in ["1", "true", "TRUE", "Yes", " yes "] {
        assert!(require::truth("X_REQUIRE_Y", Some(yes)), "{yes:?}");
    }
    for no in ["", "0", "false", "False", "no", "NO"] {
        assert!(!require::truth("X_REQUIRE_Y", Some(no)), "{no:?}");
    }
    for unknown in [Some("2"), Some("on"), Some("ture"), None] {
        let err = std::panic::catch_unwind(|| require::truth("X_REQUIRE_Y", unknown))
            .expect_err("an unknown value is refused");
        let text = err.downcast_ref::<String>().unwrap();
        assert!(text.starts_with("X_REQUIRE_Y="), "{text}");
    }
}

#[test]
fn the_example_driver_is_registered_and_prepared_by_the_grpcio_kubelet() {
    if !have_grpcio() {
        return;
    }
    let root = tempfile::tempdir().unwrap();
    let kubelet = root.path().join("kubelet");
    let registration = kubelet.join(format!("plugins_registry/{DRIVER}-reg.sock"));
    let dra = kubelet.join(format!("plugins/{DRIVER}/dra.sock"));
    // No API server: the claims the stand-in names (`claim-<uid>` in `default`), allocated
    // `dev-0`, come from a file.
    let claims: Vec<_> = CLAIMS
        .iter()
        .map(|uid| {
            kubelet_plugin::testing::allocated_claim(
                "default",
                &format!("claim-{uid}"),
                uid,
                vec![kubelet_plugin::testing::allocated_device(
                    "dev", DRIVER, NODE, "dev-0",
                )],
            )
        })
        .collect();
    let claims_file = root.path().join("claims.json");
    std::fs::write(&claims_file, serde_json::to_vec(&claims).unwrap()).unwrap();
    let mut child = example::Killed(
        Command::new(example::path("one-device"))
            .args(["--driver", DRIVER, "--node", NODE, "--kubelet-root"])
            .arg(&kubelet)
            .arg("--claims")
            .arg(&claims_file)
            // No API server: the example says so and serves the kubelet regardless.
            .env("KUBECONFIG", root.path().join("none"))
            .env_remove("KUBERNETES_SERVICE_HOST")
            .stdin(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let started = Instant::now();
    while !registration.exists() {
        assert!(child.0.try_wait().unwrap().is_none(), "the example exited");
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "no registration socket"
        );
        std::thread::sleep(Duration::from_millis(20));
    }

    let mut cmd = Command::new("python3");
    cmd.arg(STANDIN)
        .arg("--proto-root")
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/proto"))
        .arg("--stubs-cache")
        .arg(concat!(env!("CARGO_TARGET_TMPDIR"), "/kubelet-standin"))
        .arg("--registration")
        .arg(&registration)
        .arg("--dra")
        .arg(&dra)
        .args(["--driver", DRIVER, "--node", NODE])
        .args(["--claim", &format!("{}=dev-0", CLAIMS[0])])
        .args(["--claim", &format!("{}=dev-0", CLAIMS[1])]);
    for form in [
        "grpc-go",
        "raw-path",
        "grpcio-default",
        "localhost",
        "none",
        "hpack",
    ] {
        cmd.args(["--form", form]);
    }
    let out = cmd.stdin(Stdio::null()).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let checks: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l:?}")))
        .collect();
    let failed: Vec<String> = checks
        .iter()
        .filter(|c| c["ok"] != true)
        .map(|c| c.to_string())
        .collect();
    assert!(
        failed.is_empty() && out.status.success(),
        "stand-in checks failed:\n  {}\nstderr: {}",
        failed.join("\n  "),
        String::from_utf8_lossy(&out.stderr)
    );
    // Each form ran the DRA calls: v1 and v1beta1 prepare (twice) and unprepare, concurrent
    // calls, and the three health streams' first message naming dev-0.
    let ran = |socket: &str, rpc: &str| {
        checks
            .iter()
            .filter(|c| c["socket"] == socket && c["rpc"] == rpc)
            .count()
    };
    for rpc in [
        "v1 NodePrepareResources",
        "v1beta1 NodePrepareResources again",
        "v1beta1 NodeUnprepareResources",
        "v1.DRAResourceHealth/NodeWatchResources first message",
        "v1alpha1.DRAResourceHealth/NodeWatchResources first message",
    ] {
        assert_eq!(ran("dra", rpc), 4, "{rpc} once per grpcio form");
    }
    // The four grpcio forms, and the raw client's call without `:authority`.
    assert_eq!(ran("registration", "GetInfo"), 5);
    assert!(checks.len() > 40, "{} checks", checks.len());

    // SIGTERM: the example stops and its sockets are gone.
    let pid = child.0.id().to_string();
    Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    let status = child.0.wait().unwrap();
    assert!(status.success(), "{status}");
    assert!(
        !registration.exists() && !dra.exists(),
        "sockets left behind"
    );
}
