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

/// Whether python3 can import what the stand-in needs (probed once per test binary); skips or,
/// when `NVDRA_REQUIRE_GRPCIO` is set, fails the calling test otherwise.
pub fn have_grpcio() -> bool {
    static PROBE: OnceLock<Result<(), String>> = OnceLock::new();
    super::python::have(
        &PROBE,
        "import grpc, grpc_tools.protoc, google.protobuf, hpack",
        "the grpcio kubelet stand-in",
        "NVDRA_REQUIRE_GRPCIO",
        PIP,
    )
}

/// The stand-in in `node` mode (`standin.py node`: the kubelet's registration and PodResources
/// sockets under `kubelet_root`, and the DRA calls to `dra_socket`), driven one JSON command per
/// line; told to quit and killed when dropped.
pub struct NodeStandin {
    child: std::process::Child,
    stdin: std::process::ChildStdin,
    stdout: std::io::BufReader<std::process::ChildStdout>,
}

impl NodeStandin {
    pub fn start(kubelet_root: &std::path::Path, dra_socket: &std::path::Path) -> NodeStandin {
        use std::io::BufRead;
        use std::process::Stdio;
        let mut child = Command::new("python3")
            .arg(STANDIN)
            .arg("node")
            .arg("--proto-root")
            .arg(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/crates/kubelet-plugin/proto"
            ))
            .arg("--stubs-cache")
            .arg(concat!(env!("CARGO_TARGET_TMPDIR"), "/kubelet-standin"))
            .arg("--root")
            .arg(kubelet_root)
            .arg("--dra")
            .arg(dra_socket)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        assert!(line.contains("serving"), "stand-in: {line:?}");
        NodeStandin {
            child,
            stdin,
            stdout,
        }
    }

    /// Sends one command and returns the stand-in's answer.
    pub fn call(&mut self, cmd: serde_json::Value) -> serde_json::Value {
        use std::io::{BufRead, Write};
        writeln!(self.stdin, "{cmd}").unwrap();
        let mut line = String::new();
        self.stdout.read_line(&mut line).unwrap();
        assert!(!line.is_empty(), "the stand-in exited on {cmd}");
        serde_json::from_str(&line).unwrap()
    }

    /// [`NodeStandin::call`], failing unless the stand-in answers `ok`.
    pub fn ok(&mut self, cmd: serde_json::Value) -> serde_json::Value {
        let v = self.call(cmd.clone());
        assert_eq!(v["ok"], true, "{cmd} → {v}");
        v
    }
}

impl Drop for NodeStandin {
    fn drop(&mut self) {
        use std::io::Write;
        let _ = writeln!(self.stdin, "{}", serde_json::json!({"op": "quit"}));
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
