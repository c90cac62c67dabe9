//! The real `nvdra run` against a kubelet stand-in that nvdra did not write
//! (`crates/kubelet-plugin/tests/kubelet/standin.py`): grpcio (C-core) clients and a raw HTTP/2 client with the PyPI
//! `hpack` encoder. The kubelet is grpc-go, and what it sends differs from nvdra's own tonic
//! clients above all in `:authority` (`shared/reference/kubelet-wire.md`): each test here plays
//! one form of it over the registration and the DRA socket — registration, DRA v1 and v1beta1
//! prepare/unprepare, the health stream, several and concurrent calls on one channel — and
//! asserts on the stand-in's JSON, its exit code and what the daemon left on disk. The README's
//! "check a node's sockets" snippet is run as printed. `shares`: three consumable-capacity
//! shares of one GPU prepared and unprepared out of order through the stand-in's `node` mode.
//!
//! Needs python3 with grpcio, grpcio-tools, protobuf and hpack (see `.ci/run`). Without them the
//! tests say why and pass — unless `NVDRA_REQUIRE_GRPCIO` is set (CI sets it to 1).

use crate::support;

mod shares;
mod watch;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;
use support::apiserver::TestApiServer;
use support::grpcio::{STANDIN, have_grpcio};

use kubelet_plugin::proto::pluginregistration::{
    InfoRequest, registration_client::RegistrationClient,
};
use serde_json::Value;

const DRIVER: &str = "gpu.nvidia.com";
const NODE: &str = "node-a";
/// The claims in the daemon's API directory (`claim-<uid>` in `default`) and their devices.
const CLAIMS: [(&str, &str); 4] = [
    ("a", "gpu-0"),
    ("b", "gpu-1"),
    ("c", "gpu-2"),
    ("d", "gpu-3"),
];
/// `nvdra run` in a temporary kubelet root, killed when dropped (a failing test leaks nothing).
struct Daemon {
    child: Child,
    root: tempfile::TempDir,
    /// What `start_with` added to `nvdra run`'s arguments, for [`Daemon::replace`].
    args: Vec<String>,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Daemon {
    async fn start() -> Daemon {
        Self::start_with(&[], |api| {
            for (uid, device) in CLAIMS {
                let c = nvdra::api::allocated_claim(
                    "default",
                    &format!("claim-{uid}"),
                    uid,
                    vec![nvdra::api::allocated_device("gpu", DRIVER, NODE, device)],
                    vec![],
                );
                nvdra::api::dir::write_claim(api, &c).unwrap();
            }
        })
        .await
    }

    /// `nvdra run` with `args` added, after `setup` wrote its claims in the API directory (given)
    /// and anything else it needs in the root (the API directory's parent).
    async fn start_with(args: &[&str], setup: impl FnOnce(&Path)) -> Daemon {
        let root = tempfile::tempdir().unwrap();
        setup(&root.path().join("api"));
        let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        let child = Self::spawn(root.path(), &args);
        let mut d = Daemon { child, root, args };
        d.wait_ready().await;
        d
    }

    /// `nvdra run` with `args` added against the test API server `server` (`--kubeconfig`, not
    /// the directory API), which holds the claims; `setup` prepares the root as for
    /// [`Daemon::start_with`] (its API directory goes unused).
    async fn start_on(server: &TestApiServer, args: &[&str], setup: impl FnOnce(&Path)) -> Daemon {
        let root = tempfile::tempdir().unwrap();
        setup(&root.path().join("api"));
        let kubeconfig = root.path().join("kubeconfig");
        std::fs::write(&kubeconfig, server.kubeconfig()).unwrap();
        let mut args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        args.extend(["--kubeconfig".into(), kubeconfig.display().to_string()]);
        let child = Self::spawn(root.path(), &args);
        let mut d = Daemon { child, root, args };
        d.wait_ready().await;
        d
    }

    fn spawn(root: &Path, args: &[String]) -> Child {
        let mut cmd = support::daemon::nvdra_run(root, "dra", NODE);
        if args.iter().any(|a| a == "--kubeconfig") {
            cmd.env_remove("NVDRA_API_DIR");
        }
        cmd.args(["--profile", "dgx-h100"])
            .args(args)
            .spawn()
            .unwrap()
    }

    /// The plugin process replaced, as a crash and its DaemonSet's restart do: SIGKILLed, then
    /// a new `nvdra run` on the same node directories, serving once registered.
    async fn replace(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.child = Self::spawn(self.root.path(), &self.args);
        self.wait_ready().await;
    }

    fn reg_socket(&self) -> PathBuf {
        self.root
            .path()
            .join(format!("kubelet/plugins_registry/{DRIVER}-reg.sock"))
    }

    fn dra_socket(&self) -> PathBuf {
        self.root
            .path()
            .join(format!("kubelet/plugins/{DRIVER}/dra.sock"))
    }

    /// Until the registration socket answers GetInfo (the DRA socket serves before it appears),
    /// failing if the process exits or 30 s pass. Probed with nvdra's own client, whose
    /// `:authority` h2 accepts either way.
    async fn wait_ready(&mut self) {
        for _ in 0..3000 {
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!("nvdra exited before serving: {status}");
            }
            if let Ok(ch) = kubelet_plugin::socket::connect(&self.reg_socket()).await
                && RegistrationClient::new(ch)
                    .get_info(InfoRequest {})
                    .await
                    .is_ok()
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("nvdra did not serve within 30 s");
    }

    fn cdi_specs(&self) -> Vec<String> {
        std::fs::read_dir(self.root.path().join("cdi"))
            .map(|rd| {
                rd.map(|e| e.unwrap().file_name().into_string().unwrap())
                    .collect()
            })
            .unwrap_or_default()
    }

    fn checkpoint_claims(&self) -> serde_json::Map<String, Value> {
        let path = self
            .root
            .path()
            .join(format!("kubelet/plugins/{DRIVER}/checkpoint.json"));
        let cp: Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
        cp["claims"].as_object().unwrap().clone()
    }

    /// Runs the stand-in with `forms` against this daemon.
    fn standin(&self, forms: &[&str]) -> Standin {
        let mut cmd = Command::new("python3");
        cmd.arg(STANDIN)
            .arg("--proto-root")
            .arg(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/crates/kubelet-plugin/proto"
            ))
            .arg("--stubs-cache")
            .arg(concat!(env!("CARGO_TARGET_TMPDIR"), "/kubelet-standin"))
            .arg("--registration")
            .arg(self.reg_socket())
            .arg("--dra")
            .arg(self.dra_socket())
            .args(["--driver", DRIVER, "--node", NODE]);
        for (uid, device) in CLAIMS {
            cmd.arg("--claim").arg(format!("{uid}={device}"));
        }
        for f in forms {
            cmd.args(["--form", f]);
        }
        let out = cmd.stdin(Stdio::null()).output().unwrap();
        Standin::parse(out)
    }
}

/// The stand-in's verdicts: one JSON object per check.
struct Standin {
    out: Output,
    checks: Vec<Value>,
}

impl Standin {
    fn parse(out: Output) -> Standin {
        let stdout = String::from_utf8_lossy(&out.stdout);
        let checks = stdout
            .lines()
            .map(|l| {
                serde_json::from_str(l).unwrap_or_else(|e| {
                    panic!(
                        "the stand-in printed a line that is not JSON ({e}): {l:?}\nstderr: {}",
                        String::from_utf8_lossy(&out.stderr)
                    )
                })
            })
            .collect();
        Standin { out, checks }
    }

    /// Every check passed, the process exited 0, and each of `expected` (socket, rpc) was run.
    /// Panics with every failure's message (each names the form, the authority, the RPC and the
    /// gRPC status or the frames that came back).
    fn assert_all_ok(&self, expected: &[(&str, &str)]) {
        let failures: Vec<&str> = self
            .checks
            .iter()
            .filter(|c| c["ok"] != true)
            .map(|c| c["error"].as_str().unwrap_or("(no message)"))
            .collect();
        assert!(
            failures.is_empty() && self.out.status.success(),
            "{} of {} kubelet stand-in checks failed ({}):\n  {}\nstderr: {}",
            failures.len(),
            self.checks.len(),
            self.out.status,
            failures.join("\n  "),
            String::from_utf8_lossy(&self.out.stderr)
        );
        for (socket, rpc) in expected {
            assert!(
                self.find(socket, rpc).is_some(),
                "the stand-in did not run {socket} {rpc}; it ran {:?}",
                self.checks
                    .iter()
                    .map(|c| format!("{} {}", c["socket"], c["rpc"]))
                    .collect::<Vec<_>>()
            );
        }
    }

    fn find(&self, socket: &str, rpc: &str) -> Option<&Value> {
        self.checks
            .iter()
            .find(|c| c["socket"] == socket && c["rpc"] == rpc)
    }

    fn detail(&self, socket: &str, rpc: &str) -> &Value {
        &self.find(socket, rpc).unwrap()["detail"]
    }
}

/// grpc-go's `:authority` for a bare socket path: the path, percent-encoded. Only `/` needs
/// encoding in the paths these tests use, which the assertion keeps true.
fn percent_encoded(path: &Path) -> String {
    let s = path.to_str().unwrap();
    assert!(
        s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"/._-".contains(&b)),
        "{s}"
    );
    s.replace('/', "%2F")
}

/// The calls every grpcio form makes.
const GRPCIO_CHECKS: [(&str, &str); 15] = [
    ("registration", "GetInfo"),
    ("registration", "NotifyRegistrationStatus"),
    ("registration", "GetInfo x8 concurrent"),
    ("registration", "GetInfo again"),
    ("dra", "v1 NodePrepareResources"),
    ("dra", "v1 NodePrepareResources again"),
    ("dra", "v1 NodeUnprepareResources"),
    ("dra", "v1beta1 NodePrepareResources"),
    ("dra", "v1beta1 NodePrepareResources again"),
    ("dra", "v1beta1 NodeUnprepareResources"),
    ("dra", "v1 NodePrepareResources x4 concurrent"),
    ("dra", "v1 NodeUnprepareResources x4 concurrent"),
    (
        "dra",
        "v1alpha1.DRAResourceHealth/NodeWatchResources first message",
    ),
    (
        "dra",
        "v1beta1.DRAResourceHealth/NodeWatchResources first message",
    ),
    (
        "dra",
        "v1.DRAResourceHealth/NodeWatchResources first message",
    ),
];

/// Plays the kubelet with grpcio sending `authority(socket path)` (None: grpcio's default) and
/// checks what the stand-in saw and what the daemon did.
async fn grpcio_form(form: &str, authority: impl Fn(&Path) -> Option<String>) {
    if !have_grpcio() {
        return;
    }
    let d = Daemon::start().await;
    let run = d.standin(&[form]);
    run.assert_all_ok(&GRPCIO_CHECKS);
    for c in &run.checks {
        assert_eq!(c["form"], form, "{c}");
    }
    for (socket, path) in [("registration", d.reg_socket()), ("dra", d.dra_socket())] {
        if let Some(want) = authority(&path) {
            assert_eq!(
                run.find(socket, "GetInfo")
                    .or(run.find(socket, "v1 NodePrepareResources"))
                    .unwrap()["authority"],
                want.as_str()
            );
        }
    }
    // What GetInfo answered and prepare returned, as the kubelet would use them.
    let info = run.detail("registration", "GetInfo");
    assert_eq!(info["type"], "DRAPlugin");
    assert_eq!(info["name"], DRIVER);
    assert_eq!(info["endpoint"], d.dra_socket().to_str().unwrap());
    for version in ["v1", "v1beta1"] {
        let ids = &run.detail("dra", &format!("{version} NodePrepareResources"))["cdi_device_ids"];
        for (uid, device) in CLAIMS {
            assert_eq!(
                ids[uid],
                serde_json::json!([format!("k8s.{DRIVER}/claim={uid}-{device}")]),
                "{version}"
            );
        }
    }
    for version in ["v1alpha1", "v1beta1", "v1"] {
        let health = run.detail(
            "dra",
            &format!("{version}.DRAResourceHealth/NodeWatchResources first message"),
        );
        assert_eq!(health["devices"], 8, "{version}: a DGX H100's eight GPUs");
    }
    // Every claim was unprepared at the end: no CDI spec, no checkpoint entry left.
    assert!(d.cdi_specs().is_empty(), "{:?}", d.cdi_specs());
    assert!(d.checkpoint_claims().is_empty());
}

/// The kubelet today (grpc-go percent-encodes the dial target): `%2Fvar%2Flib%2F...`.
#[tokio::test]
async fn grpc_go_percent_encoded_path() {
    grpcio_form("grpc-go", |p| Some(percent_encoded(p))).await;
}

/// Kubelets built with grpc-go before it percent-encoded: the raw path.
#[tokio::test]
async fn old_grpc_go_raw_path() {
    grpcio_form("raw-path", |p| Some(p.to_str().unwrap().to_string())).await;
}

/// grpcio's own default for `unix:///path`: the path without its leading slash, percent-encoded.
#[tokio::test]
async fn grpcio_default_authority() {
    grpcio_form("grpcio-default", |_| None).await;
}

/// The device-plugin client's `WithAuthority("localhost")`.
#[tokio::test]
async fn localhost_authority() {
    grpcio_form("localhost", |_| Some("localhost".into())).await;
}

/// No `:authority` field at all (HTTP/2 allows it; grpcio cannot send it): a raw client.
#[tokio::test]
async fn no_authority_raw_http2() {
    if !have_grpcio() {
        return;
    }
    let d = Daemon::start().await;
    let run = d.standin(&["none"]);
    run.assert_all_ok(&[
        ("registration", "GetInfo"),
        ("dra", "v1 NodePrepareResources + NodeUnprepareResources"),
    ]);
    assert_eq!(
        run.detail("registration", "GetInfo")["endpoint"],
        d.dra_socket().to_str().unwrap()
    );
    let ids =
        &run.detail("dra", "v1 NodePrepareResources + NodeUnprepareResources")["cdi_device_ids"];
    for (uid, device) in CLAIMS {
        assert_eq!(
            ids[uid],
            serde_json::json!([format!("k8s.{DRIVER}/claim={uid}-{device}")])
        );
    }
    assert!(d.cdi_specs().is_empty(), "{:?}", d.cdi_specs());
}

/// The grpc-go authority in every encoding HPACK and the framing allow: plain and Huffman-coded
/// strings, a block cut into HEADERS + CONTINUATION frames inside the field, a padded HEADERS
/// frame with priority fields, requests written one byte per write, references into the dynamic
/// table on later requests of one connection, table size updates that empty and refill it.
#[tokio::test]
async fn hpack_encodings_of_the_kubelet_authority() {
    if !have_grpcio() {
        return;
    }
    let d = Daemon::start().await;
    let run = d.standin(&["hpack"]);
    let checks = [
        "GetInfo, plain strings",
        "GetInfo, Huffman-coded strings",
        "GetInfo over HEADERS + CONTINUATION (plain)",
        "GetInfo over HEADERS + CONTINUATION (Huffman)",
        "GetInfo, HEADERS with padding and priority",
        "GetInfo x2 written one byte per write",
        "GetInfo x7 on one connection (dynamic table)",
    ];
    run.assert_all_ok(&checks.map(|rpc| ("registration", rpc)));
    let steps = run.detail(
        "registration",
        "GetInfo x7 on one connection (dynamic table)",
    )["requests"]
        .as_array()
        .unwrap()
        .clone();
    assert_eq!(steps.len(), 7);
    assert_eq!(steps[0]["dynamic_refs"], 0);
    assert!(steps[1]["dynamic_refs"].as_u64().unwrap() >= 5, "{steps:?}");
    for c in &run.checks {
        assert_eq!(c["authority"], percent_encoded(&d.reg_socket()).as_str());
    }
}

/// Requests malformed for reasons other than `:authority` stay refused (RST_STREAM or GOAWAY with
/// PROTOCOL_ERROR; 431 for an over-size header list, after which the connection still serves),
/// with the kubelet's authority as with `localhost`: accepting the kubelet's authority must not
/// switch h2's other checks off.
#[tokio::test]
async fn requests_malformed_otherwise_are_still_refused() {
    if !have_grpcio() {
        return;
    }
    let d = Daemon::start().await;
    let run = d.standin(&["malformed"]);
    let cases = [
        "a header list over 16 KiB",
        "uppercase header name",
        "connection: keep-alive",
        "te: gzip",
        "two :authority fields",
        ":authority after a regular field",
        "no :path",
    ];
    let expected: Vec<String> = cases
        .iter()
        .map(|c| format!("GetInfo with {c} is refused"))
        .collect();
    let expected: Vec<(&str, &str)> = expected
        .iter()
        .map(|rpc| ("registration", rpc.as_str()))
        .collect();
    run.assert_all_ok(&expected);
    let kubelet = percent_encoded(&d.reg_socket());
    for authority in [kubelet.as_str(), "localhost"] {
        let n = run
            .checks
            .iter()
            .filter(|c| c["authority"] == authority)
            .count();
        assert_eq!(n, cases.len(), "{authority}");
    }
}

/// The README's "Check a node's sockets as the kubelet would" snippet, run as printed with only
/// the registration socket's path replaced by this daemon's.
#[tokio::test]
async fn readme_socket_check_snippet() {
    if !have_grpcio() {
        return;
    }
    let readme = include_str!("../../README.md");
    let begin = "<!-- kubelet-socket-check:begin -->";
    let end = "<!-- kubelet-socket-check:end -->";
    let block = readme
        .split_once(begin)
        .and_then(|(_, rest)| rest.split_once(end))
        .map(|(block, _)| block)
        .expect("README.md has the socket check between its markers");
    let script = block
        .trim()
        .strip_prefix("```sh")
        .and_then(|s| s.strip_suffix("```"))
        .expect("the socket check is one ```sh block");
    let default = "/var/lib/kubelet/plugins_registry/gpu.nvidia.com-reg.sock";
    assert_eq!(script.matches(default).count(), 1, "{script}");

    let d = Daemon::start().await;
    let reg = d.reg_socket();
    let out = Command::new("bash")
        .args(["-euo", "pipefail", "-c"])
        .arg(script.replace(default, reg.to_str().unwrap()))
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "the README's socket check failed ({}):\n{stdout}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let dra = d.dra_socket();
    for want in [
        format!(
            "GetInfo on {} (:authority {}): ok",
            reg.display(),
            percent_encoded(&reg)
        ),
        format!("endpoint: \"{}\"", dra.display()),
        format!(
            "NodeUnprepareResources on {} (:authority {}): ok",
            dra.display(),
            percent_encoded(&dra)
        ),
    ] {
        assert!(stdout.contains(&want), "no {want:?} in:\n{stdout}");
    }
}
