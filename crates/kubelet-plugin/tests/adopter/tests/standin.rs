//! The `allocated` example, built as a driver's crate builds it (a path dependency on the
//! library, `k8s-openapi/latest`), is registered, prepared, unprepared and health-watched by
//! the grpcio kubelet stand-in over every `:authority` form the kubelet and its clients send.
//!
//! Needs python3 with `grpcio==1.85.1 grpcio-tools==1.85.1 protobuf==7.36.2 hpack==4.2.0`; the
//! test skips without them unless `KUBELET_PLUGIN_REQUIRE_GRPCIO=1` (CI sets it).

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kubelet_plugin::testing::{allocated_claim, allocated_device};

const DRIVER: &str = "fpga.example.com";
const NODE: &str = "node-1";
const LIBRARY: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
const PIP: &str =
    "python3 -m pip install grpcio==1.85.1 grpcio-tools==1.85.1 protobuf==7.36.2 hpack==4.2.0";

fn have_grpcio() -> bool {
    let ok = Command::new("python3")
        .args([
            "-c",
            "import grpc, grpc_tools.protoc, google.protobuf, hpack",
        ])
        .output()
        .is_ok_and(|o| o.status.success());
    let required = std::env::var("KUBELET_PLUGIN_REQUIRE_GRPCIO").is_ok_and(|v| v == "1");
    assert!(
        ok || !required,
        "KUBELET_PLUGIN_REQUIRE_GRPCIO=1 but python3 cannot import the stand-in's modules; run: {PIP}"
    );
    if !ok {
        eprintln!("skipped: the grpcio kubelet stand-in needs: {PIP}");
    }
    ok
}

struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn the_allocated_example_prepares_what_the_allocation_names_for_the_grpcio_kubelet() {
    if !have_grpcio() {
        return;
    }
    let root = tempfile::tempdir().unwrap();
    let kubelet = root.path().join("kubelet");
    let registration = kubelet.join(format!("plugins_registry/{DRIVER}-reg.sock"));
    let dra = kubelet.join(format!("plugins/{DRIVER}/dra.sock"));
    // The claims the stand-in names (`claim-<uid>` in `default`): one allocated dev-0 for a
    // subrequest, one dev-1, and each a device of another driver the example must not see.
    let claims = [
        (
            "0f2d5a3c-1234-4bcd-9876-0123456789ab",
            "fpga/small",
            "dev-0",
        ),
        ("7a0c1e44-aaaa-4bbb-8ccc-00000000000d", "fpga", "dev-1"),
    ];
    let objects: Vec<_> = claims
        .iter()
        .map(|(uid, request, device)| {
            allocated_claim(
                "default",
                &format!("claim-{uid}"),
                uid,
                vec![
                    allocated_device(request, DRIVER, NODE, device),
                    allocated_device("gpu", "gpu.example.com", NODE, "gpu-0"),
                ],
            )
        })
        .collect();
    let file = root.path().join("claims.json");
    std::fs::write(&file, serde_json::to_vec(&objects).unwrap()).unwrap();
    let mut child = Killed(
        Command::new(env!("CARGO_BIN_EXE_allocated"))
            .args([
                "--driver",
                DRIVER,
                "--node",
                NODE,
                "--devices",
                "dev-0,dev-1",
            ])
            .arg("--kubelet-root")
            .arg(&kubelet)
            .arg("--claims")
            .arg(&file)
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
    cmd.arg(format!("{LIBRARY}/tests/kubelet/standin.py"))
        .arg("--proto-root")
        .arg(format!("{LIBRARY}/proto"))
        .arg("--stubs-cache")
        .arg(concat!(env!("CARGO_TARGET_TMPDIR"), "/kubelet-standin"))
        .arg("--registration")
        .arg(&registration)
        .arg("--dra")
        .arg(&dra)
        .args(["--driver", DRIVER, "--node", NODE]);
    for (uid, _, device) in claims {
        cmd.args(["--claim", &format!("{uid}={device}")]);
    }
    for form in ["grpc-go", "raw-path", "grpcio-default", "none"] {
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
    let ran = |rpc: &str| {
        checks
            .iter()
            .filter(|c| c["socket"] == "dra" && c["rpc"] == rpc)
            .count()
    };
    for rpc in [
        "v1 NodePrepareResources",
        "v1beta1 NodePrepareResources again",
        "v1beta1 NodeUnprepareResources",
        "v1.DRAResourceHealth/NodeWatchResources first message",
    ] {
        assert_eq!(ran(rpc), 3, "{rpc} once per grpcio form");
    }

    Command::new("kill")
        .args(["-TERM", &child.0.id().to_string()])
        .status()
        .unwrap();
    let status = child.0.wait().unwrap();
    assert!(status.success(), "{status}");
    assert!(
        !registration.exists() && !dra.exists(),
        "sockets left behind"
    );
}
