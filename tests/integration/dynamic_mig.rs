//! Dynamic MIG end to end (issue 27): `nvdra run --dynamic-mig` on a simulated DGX H100, the
//! claims allocated in the test API server (`support/apiserver.rs`, read over `--kubeconfig`),
//! the kubelet's v1 NodePrepare/UnprepareResources calls made by the grpcio stand-in in `node`
//! mode. One GPU goes from whole to two MIG devices (a 3g then a 1g claim switch it into MIG
//! mode and create both instances), refuses a whole-GPU claim until both are unprepared, and is
//! whole again (MIG mode off) for that claim; a GPU with a running process (the fault file's
//! `process` line) answers IN_USE naming it, and the kubelet's retry succeeds once it exits. A
//! GPU held by a DCGM-like process (the fault file's `holder` line) answers IN_USE naming it
//! too, is blocked (its devices that need a switch are published tainted) until it exits, and
//! the retry then switches it and lifts the block: no prepare is left retrying for ever.
//!
//! What the daemon did to the GPU is read from its checkpoint (the GPUs whose MIG mode nvdra
//! turned on, the instances' UUIDs) and from its log lines; the published slices are not used,
//! since what they show of a toggleable GPU is the publisher's business.
//!
//! Needs python3 with grpcio (see `.ci/run`); without it the test says why and passes, unless
//! `NVDRA_REQUIRE_GRPCIO` is set.

use crate::support;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::{Arc, Mutex};

use serde_json::{Value, json};
use support::apiserver::TestApiServer;
use support::grpcio::{NodeStandin, have_grpcio};

const DRIVER: &str = "gpu.nvidia.com";
const NODE: &str = "node-a";
const THREE_G: &str = "gpu-0-mig-3g40gb-9-4";
const ONE_G: &str = "gpu-0-mig-1g10gb-19-0";
const BUSY: &str = "gpu-1-mig-1g10gb-19-0";
const HELD: &str = "gpu-2-mig-1g10gb-19-0";

/// `nvdra run --dynamic-mig` against `server`, its stderr collected.
struct Daemon {
    child: Child,
    root: tempfile::TempDir,
    log: Arc<Mutex<String>>,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Daemon {
    async fn start(server: &TestApiServer) -> Daemon {
        let root = tempfile::tempdir().unwrap();
        let kubeconfig = root.path().join("kubeconfig");
        std::fs::write(&kubeconfig, server.kubeconfig()).unwrap();
        let mut child = support::daemon::nvdra_run(root.path(), "dra", NODE)
            .args(["--profile", "dgx-h100", "--dynamic-mig"])
            .arg("--fault-file")
            .arg(root.path().join("faults"))
            .env_remove("NVDRA_API_DIR")
            .arg("--kubeconfig")
            .arg(&kubeconfig)
            .env("NVDRA_LOG", "info")
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let log = Arc::new(Mutex::new(String::new()));
        let mut stderr = child.stderr.take().unwrap();
        let sink = log.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = stderr.read(&mut buf) {
                if n == 0 {
                    break;
                }
                let text = String::from_utf8_lossy(&buf[..n]).to_string();
                eprint!("{text}");
                sink.lock().unwrap().push_str(&text);
            }
        });
        let reg = root
            .path()
            .join(format!("kubelet/plugins_registry/{DRIVER}-reg.sock"));
        support::dra::wait_ready_at(&reg, &mut child).await;
        Daemon { child, root, log }
    }

    fn dra_socket(&self) -> PathBuf {
        self.root
            .path()
            .join(format!("kubelet/plugins/{DRIVER}/dra.sock"))
    }

    fn checkpoint(&self) -> Value {
        let path = self
            .root
            .path()
            .join(format!("kubelet/plugins/{DRIVER}/checkpoint.json"));
        serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
    }

    fn log_count(&self, what: &str) -> usize {
        self.log.lock().unwrap().matches(what).count()
    }

    fn fault(&self, line: &str) {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.root.path().join("faults"))
            .unwrap();
        writeln!(f, "{line}").unwrap();
    }
}

/// The grpcio stand-in, its blocking calls made off the runtime's workers (the test API server
/// answers the daemon on this runtime meanwhile).
struct Kubelet(NodeStandin);

impl Kubelet {
    fn start(root: &Path, dra_socket: &Path) -> Kubelet {
        Kubelet(NodeStandin::start(&root.join("standin"), dra_socket))
    }

    /// `op` of claim `uid`: its result (`error`, `devices`, ...).
    fn call(&mut self, op: &str, uid: &str) -> Value {
        let cmd = json!({"op": op, "claims": [
            {"namespace": "default", "name": format!("claim-{uid}"), "uid": uid}
        ]});
        tokio::task::block_in_place(|| self.0.ok(cmd))["claims"][uid].clone()
    }

    fn prepare_ok(&mut self, uid: &str, device: &str) {
        let r = self.call("prepare", uid);
        assert_eq!(r["error"], "", "prepare {uid}: {r}");
        assert_eq!(r["devices"], json!([device]), "{uid}: {r}");
    }

    fn unprepare_ok(&mut self, uid: &str) {
        let r = self.call("unprepare", uid);
        assert_eq!(r["error"], "", "unprepare {uid}: {r}");
    }
}

fn seed(server: &TestApiServer, uid: &str, device: &str) {
    server.seed_claim(nvdra::api::allocated_claim(
        "default",
        &format!("claim-{uid}"),
        uid,
        vec![nvdra::api::allocated_device("gpu", DRIVER, NODE, device)],
        vec![],
    ));
}

/// The UUID of GPU `index` of the simulated DGX H100 of node `NODE`.
fn gpu_uuid(index: usize) -> String {
    nvdra::inventory::topology::load_profile("dgx-h100", NODE)
        .unwrap()
        .gpus[index]
        .uuid
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_gpu_goes_whole_to_two_mig_devices_and_back_and_a_busy_gpu_answers_in_use() {
    if !have_grpcio() {
        return;
    }
    let server = TestApiServer::start().await;
    server.seed_node(NODE, "uid-node-a");
    for (uid, device) in [
        ("m3", THREE_G),
        ("m1", ONE_G),
        ("w", "gpu-0"),
        ("busy", BUSY),
    ] {
        seed(&server, uid, device);
    }
    let d = Daemon::start(&server).await;
    let mut k = Kubelet::start(d.root.path(), &d.dra_socket());
    let g0 = gpu_uuid(0);

    // A 3g then a 1g claim: MIG mode on once, two instances.
    k.prepare_ok("m3", THREE_G);
    k.prepare_ok("m1", ONE_G);
    let cp = d.checkpoint();
    assert_eq!(cp["migEnabled"], json!([g0]), "nvdra turned GPU 0 on: {cp}");
    let uuid_of = |uid: &str| cp["claims"][uid]["devices"][0]["mig"]["uuid"].clone();
    let (u3, u1) = (uuid_of("m3"), uuid_of("m1"));
    assert!(u3.is_string() && u1.is_string() && u3 != u1, "{cp}");
    assert_eq!(d.log_count("MIG mode switched"), 1, "one switch for both");

    // The GPU whole is refused while either is prepared, naming the holders.
    let r = k.call("prepare", "w");
    let err = r["error"].as_str().unwrap();
    for held in [
        format!("{THREE_G} by claim default/claim-m3 (m3)"),
        format!("{ONE_G} by claim default/claim-m1 (m1)"),
    ] {
        assert!(err.contains(&held), "{err}");
    }
    assert_eq!(r["devices"], json!([]));
    k.unprepare_ok("m3");
    let r = k.call("prepare", "w");
    let err = r["error"].as_str().unwrap();
    assert!(
        err.contains("default/claim-m1") && !err.contains("claim-m3"),
        "{err}"
    );
    assert_eq!(d.checkpoint()["migEnabled"], json!([g0]), "still on for m1");

    // After the last instance MIG mode goes off, and the whole GPU is prepared.
    k.unprepare_ok("m1");
    assert_eq!(
        d.log_count("MIG mode turned off after the GPU's last MIG device"),
        1
    );
    let cp = d.checkpoint();
    assert!(cp.get("migEnabled").is_none(), "{cp}");
    assert!(cp["claims"].as_object().unwrap().is_empty(), "{cp}");
    k.prepare_ok("w", "gpu-0");
    assert_eq!(
        d.log_count("MIG mode switched"),
        1,
        "whole needed no switch"
    );
    k.unprepare_ok("w");

    // A process on GPU 1 keeps it out of MIG mode: IN_USE, naming it, retried by the kubelet.
    d.fault("process 1 4242 2048");
    let r = k.call("prepare", "busy");
    let err = r["error"].as_str().unwrap();
    assert!(err.contains("pid 4242"), "{err}");
    assert!(err.contains(&format!("gpu-1 ({})", gpu_uuid(1))), "{err}");
    assert!(err.contains("retries"), "{err}");
    let cp = d.checkpoint();
    assert!(cp.get("migEnabled").is_none(), "rolled back: {cp}");
    assert!(cp["claims"].get("busy").is_none(), "{cp}");
    d.fault("exit 1 4242");
    k.prepare_ok("busy", BUSY);
    assert_eq!(d.checkpoint()["migEnabled"], json!([gpu_uuid(1)]));
    k.unprepare_ok("busy");
    assert!(d.checkpoint().get("migEnabled").is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_gpu_answers_in_use_naming_the_holder_and_is_blocked_until_it_exits() {
    if !have_grpcio() {
        return;
    }
    let server = TestApiServer::start().await;
    server.seed_node(NODE, "uid-node-a");
    seed(&server, "held", HELD);
    let d = Daemon::start(&server).await;
    let mut k = Kubelet::start(d.root.path(), &d.dra_socket());
    let g2 = gpu_uuid(2);

    // DCGM's host engine holds GPU 2: IN_USE, naming it; the change is withdrawn and the GPU
    // blocked, once.
    d.fault("holder 2 4242 nv-hostengine");
    for _ in 0..2 {
        let r = k.call("prepare", "held");
        let err = r["error"].as_str().unwrap();
        assert!(err.contains("pid 4242 (nv-hostengine)"), "{err}");
        assert!(err.contains(&format!("gpu-2 ({g2})")), "{err}");
        assert!(err.contains("tainted NoExecute"), "{err}");
        assert!(err.contains("retries"), "{err}");
    }
    assert_eq!(
        d.log_count("MIG mode switch refused (IN_USE)"),
        1,
        "blocked once"
    );
    assert_eq!(d.log_count("pending MIG mode change withdrawn"), 2);
    let cp = d.checkpoint();
    assert!(cp.get("migEnabled").is_none(), "rolled back: {cp}");

    // It exits: the kubelet's retry switches the GPU, and the block is lifted (by that switch,
    // or by a read that found the GPU free first).
    d.fault("exit 2 4242");
    k.prepare_ok("held", HELD);
    assert_eq!(d.checkpoint()["migEnabled"], json!([g2]));
    let lifted = d.log_count("the GPU's MIG mode switched after all")
        + d.log_count("the processes that kept the GPU's MIG mode from switching are gone");
    assert_eq!(lifted, 1, "the block is lifted once");
    k.unprepare_ok("held");
    assert!(d.checkpoint().get("migEnabled").is_none());
}
