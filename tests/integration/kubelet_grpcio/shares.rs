//! Shares of one GPU (`--shared-capacity`) through the stand-in's `node` mode, which makes the
//! kubelet's v1 NodePrepare/UnprepareResources calls with grpcio as the test tells it: three
//! claims each get 24Gi of GPU 0 (`gpu-0`, allocated many times), one MPS control
//! daemon serves them all (run by `nvdra mps-host`; the stand-in `nvidia-cuda-mps-control` under
//! the driver root logs its starts and quits), each claim's CDI spec carries its own limits, a
//! fourth share that does not fit is refused naming the three holders, and the daemon quits with
//! the last share, whatever the order of the unprepares.

use std::path::PathBuf;

use serde_json::{Value, json};

use super::{DRIVER, Daemon, NODE, TestApiServer, have_grpcio};
use crate::support::grpcio::NodeStandin;
use crate::support::mps;

const SHARES: [&str; 4] = ["s1", "s2", "s3", "s4"];

fn share_id(uid: &str) -> String {
    format!("5f0e0000-0000-4000-8000-0000000000{}", &uid[1..2])
}

/// The stand-in in `node` mode against `d`'s DRA socket.
struct Kubelet(NodeStandin);

impl Kubelet {
    fn start(d: &Daemon) -> Kubelet {
        let (dir, socket) = (d.root.path().join("standin"), d.dra_socket());
        Kubelet(tokio::task::block_in_place(|| {
            NodeStandin::start(&dir, &socket)
        }))
    }

    /// `op` (prepare or unprepare) of `uids` in one call; each claim's result.
    fn call(&mut self, op: &str, uids: &[&str]) -> Value {
        let claims: Vec<Value> = uids
            .iter()
            .map(|u| json!({"namespace": "default", "name": format!("claim-{u}"), "uid": u}))
            .collect();
        let cmd = json!({"op": op, "claims": claims});
        // Off the runtime's workers: the test API server may be answering the daemon meanwhile.
        tokio::task::block_in_place(|| self.0.ok(cmd))["claims"].clone()
    }

    fn unprepare(&mut self, uid: &str) {
        let r = self.call("unprepare", &[uid]);
        assert_eq!(r[uid]["error"], "", "unprepare {uid}: {r}");
    }
}

fn plugin_dir(d: &Daemon) -> PathBuf {
    d.root.path().join(format!("kubelet/plugins/{DRIVER}"))
}

fn driver_root(d: &Daemon) -> PathBuf {
    d.root.path().join("driver")
}

/// The env entries of a claim's CDI spec (the spec's and its devices' edits) and its mounts as
/// (host path, container path).
fn spec_edits(d: &Daemon, uid: &str) -> (Vec<String>, Vec<(String, String)>) {
    let path = d
        .root
        .path()
        .join(format!("cdi/k8s.{DRIVER}-claim_{uid}.yaml"));
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("the spec of {uid} ({}): {e}", path.display()));
    let spec: nvdra::cdi::Spec = nvdra::yaml::from_str(&text).unwrap();
    let edits = std::iter::once(&spec.container_edits)
        .chain(spec.devices.iter().map(|d| &d.container_edits));
    let (mut env, mut mounts) = (Vec::new(), Vec::new());
    for e in edits {
        env.extend(e.env.iter().cloned());
        mounts.extend(
            e.mounts
                .iter()
                .map(|m| (m.host_path.clone(), m.container_path.clone())),
        );
    }
    (env, mounts)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_shares_of_one_gpu_one_daemon_unprepared_out_of_order() {
    if !have_grpcio() {
        return;
    }
    let d = Daemon::start_with(&["--shared-capacity"], |api| {
        mps::install_standin(&api.parent().unwrap().join("driver"));
        for uid in SHARES {
            mps::write_share_claim(api, DRIVER, NODE, uid, "gpu-0", &share_id(uid), "24Gi");
        }
    })
    .await;
    let gpu = gpu0_uuid();
    let mps_root = d.root.path().join("mps");
    let pipe = mps::gpu_pipe_dir(&mps_root, &gpu);
    let driver = driver_root(&d);
    let _host = mps::Host::start(&mps_root, &driver, &d.root.path().join("boot_id"), &[]);
    let answers = || mps::ask(&driver, &pipe, "get_server_list").is_some();
    let mut k = Kubelet::start(&d);

    // Three pods' claims in one call, as a kubelet batching them would: one daemon start.
    let r = k.call("prepare", &SHARES[..3]);
    for uid in &SHARES[..3] {
        let c = &r[*uid];
        assert_eq!(c["error"], "", "{uid}: {r}");
        assert_eq!(c["devices"], json!(["gpu-0"]), "{uid}");
        assert_eq!(c["share_ids"], json!([share_id(uid)]), "{uid}: the shareID");
        assert_eq!(
            c["cdi_device_ids"],
            json!([[format!("k8s.{DRIVER}/claim={uid}-gpu-0")]]),
            "{uid}"
        );
    }
    assert_eq!(
        mps::log(&driver),
        vec![format!("start {gpu} {}", pipe.display())],
        "one daemon for the GPU's three shares"
    );
    assert!(answers());
    for uid in &SHARES[..3] {
        let (env, mounts) = spec_edits(&d, uid);
        for want in [
            // Keyed by the index the share's container sees (0), not by UUID; 24Gi less its part
            // of the MPS server's reserve: 24576 MiB × 79/80.
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=24268M".to_string(),
            format!(
                "CUDA_MPS_PIPE_DIRECTORY={}",
                nvdra::cdi::MPS_PIPE_CONTAINER_DIR
            ),
        ] {
            assert!(env.contains(&want), "{uid}: no {want} in {env:?}");
        }
        assert!(
            !env.iter()
                .any(|e| e.starts_with("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=")),
            "{uid}: no SM cap unless asked: {env:?}"
        );
        assert!(
            mounts.contains(&(
                pipe.display().to_string(),
                nvdra::cdi::MPS_PIPE_CONTAINER_DIR.to_string()
            )),
            "{uid}: the GPU's pipe directory is not mounted: {mounts:?}"
        );
    }
    let cp = checkpoint(&d);
    assert_eq!(cp["version"], 3, "shares need checkpoint version 3: {cp}");
    for uid in &SHARES[..3] {
        assert_eq!(
            cp["claims"][*uid]["devices"][0]["consumedCapacity"],
            json!({"memory": 24u64 << 30}),
            "{uid}: {cp}"
        );
    }

    // 72Gi of the H100's 80Gi are held: a fourth quarter does not fit, and the error the kubelet
    // gets names the GPU and every holder.
    let r = k.call("prepare", &["s4"]);
    let err = r["s4"]["error"].as_str().unwrap();
    for holder in &SHARES[..3] {
        assert!(
            err.contains(&format!("default/claim-{holder} ({holder}): 24Gi")),
            "{err}"
        );
    }
    assert!(err.contains(&format!("gpu-0 ({gpu})")), "{err}");
    assert_eq!(r["s4"]["devices"], json!([]), "{r}");
    assert!(checkpoint(&d)["claims"].get("s4").is_none());
    assert_eq!(mps::count(&driver, "start"), 1, "no daemon for the refused");

    // Unprepared 2, 3, 1: the daemon stays while any share is left.
    for (uid, left) in [("s2", 2), ("s3", 1)] {
        k.unprepare(uid);
        assert!(answers(), "daemon stopped after {uid}");
        assert_eq!(mps::count(&driver, "quit"), 0, "after {uid}");
        assert_eq!(checkpoint(&d)["claims"].as_object().unwrap().len(), left);
    }
    assert_eq!(specs(&d), vec![format!("k8s.{DRIVER}-claim_s1.yaml")]);
    k.unprepare("s1");
    mps::eventually("the host removes the released daemon", || !pipe.exists());
    assert_eq!(
        mps::log(&driver),
        vec![
            format!("start {gpu} {}", pipe.display()),
            format!("quit {}", pipe.display())
        ],
        "the daemon stops after the last share"
    );
    assert!(specs(&d).is_empty(), "{:?}", specs(&d));
    let cp = checkpoint(&d);
    assert!(cp["claims"].as_object().unwrap().is_empty(), "{cp}");
    assert_eq!(cp["version"], 1, "no share held: version 1 again: {cp}");

    // With the room back the fourth fits, and gets a daemon of its own start.
    let r = k.call("prepare", &["s4"]);
    assert_eq!(r["s4"]["error"], "", "{r}");
    assert_eq!(mps::count(&driver, "start"), 2);
    k.unprepare("s4");
    mps::eventually("the daemon quits again", || {
        mps::count(&driver, "quit") == 2
    });
    assert!(specs(&d).is_empty());
}

/// The UUID of GPU 0 of the simulated DGX H100 of node `NODE`.
pub(super) fn gpu0_uuid() -> String {
    use nvdra::inventory::DeviceBackend;
    nvdra::inventory::sim::SimBackend::from_profile("dgx-h100", NODE)
        .unwrap()
        .snapshot()
        .unwrap()
        .gpus[0]
        .uuid
        .to_string()
}

fn checkpoint(d: &Daemon) -> Value {
    serde_json::from_slice(&std::fs::read(plugin_dir(d).join("checkpoint.json")).unwrap()).unwrap()
}

fn specs(d: &Daemon) -> Vec<String> {
    let mut v = d.cdi_specs();
    v.sort();
    v
}

/// Three 24Gi shares of GPU 0 and a whole-GPU claim on GPU 1, allocated in the test API server
/// (which nvdra reads over `--kubeconfig` and publishes its slices to) and prepared through the
/// grpcio kubelet, a stand-in CUDA client on each share; then the plugin process replaced
/// (SIGKILL and a new `nvdra run` on the same node, as a crash or an upgrade does). Every client
/// stays connected to the same daemon, the new plugin answers the kubelet's retried prepares from
/// its checkpoint, and its unprepares release the daemon after the last share.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shares_and_a_whole_gpu_keep_their_clients_while_the_plugin_is_replaced() {
    if !have_grpcio() {
        return;
    }
    let server = TestApiServer::start().await;
    server.seed_node(NODE, "uid-node-a");
    for uid in &SHARES[..3] {
        server.seed_claim(mps::share_claim(
            DRIVER,
            NODE,
            uid,
            "gpu-0",
            &share_id(uid),
            "24Gi",
        ));
    }
    let whole = nvdra::api::allocated_device("gpu", DRIVER, NODE, "gpu-1");
    server.seed_claim(nvdra::api::allocated_claim(
        "default",
        "claim-w",
        "w",
        vec![whole],
        vec![],
    ));
    let mut d = Daemon::start_on(&server, &["--shared-capacity"], |api| {
        mps::install_standin(&api.parent().unwrap().join("driver"));
    })
    .await;
    // What the scheduler allocated from: GPU 0 published once, shareable, in the server.
    wait_for_shareable_gpu0(&server).await;
    let gpu = gpu0_uuid();
    let mps_root = d.root.path().join("mps");
    let (dir, pipe) = (
        mps::gpu_dir(&mps_root, &gpu),
        mps::gpu_pipe_dir(&mps_root, &gpu),
    );
    let driver = driver_root(&d);
    let _host = mps::Host::start(&mps_root, &driver, &d.root.path().join("boot_id"), &[]);
    let mut k = Kubelet::start(&d);
    let all = ["s1", "s2", "s3", "w"];
    let r = k.call("prepare", &all);
    for uid in all {
        assert_eq!(r[uid]["error"], "", "{uid}: {r}");
    }
    assert_eq!(r["w"]["devices"], json!(["gpu-1"]), "{r}");
    let (env, _) = spec_edits(&d, "w");
    assert!(
        !env.iter().any(|e| e.starts_with("CUDA_MPS")),
        "the whole GPU is no share: {env:?}"
    );

    // Each share's container: a CUDA process with its spec's limit, through the GPU's daemon.
    let mut clients: Vec<mps::CudaClient> = SHARES[..3]
        .iter()
        .map(|uid| {
            let (env, _) = spec_edits(&d, uid);
            let limit = env
                .iter()
                .find_map(|e| e.strip_prefix("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="))
                .unwrap_or_else(|| panic!("{uid}: no limit in {env:?}"))
                .to_string();
            let c = tokio::task::block_in_place(|| {
                mps::CudaClient::start(
                    &driver,
                    &pipe,
                    &[("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", limit.as_str())],
                )
            });
            assert!(c.connected.contains("pinned=0=24268M"), "{}", c.connected);
            c
        })
        .collect();
    let daemon = mps::daemon_pids(&dir);
    assert_eq!(daemon.len(), 1, "one daemon for the GPU: {daemon:?}");

    drop(k);
    d.replace().await;
    let mut k = Kubelet::start(&d);
    for (uid, c) in SHARES[..3].iter().zip(&mut clients) {
        assert!(c.connected(), "{uid}'s client lost its server");
    }
    assert_eq!(
        mps::daemon_pids(&dir),
        daemon,
        "the same daemon serves them"
    );
    assert_eq!(mps::count(&driver, "start"), 1, "no daemon started again");
    // The kubelet retries a prepare it did not see answered: the new plugin knows the claims.
    let r = k.call("prepare", &all);
    for uid in all {
        assert_eq!(r[uid]["error"], "", "{uid} after the replacement: {r}");
    }
    // The pods end, then the kubelet unprepares their claims.
    drop(clients);
    for uid in all {
        k.unprepare(uid);
    }
    tokio::task::block_in_place(|| {
        mps::eventually("the host removes the released daemon", || !pipe.exists())
    });
    assert!(specs(&d).is_empty(), "{:?}", specs(&d));
}

/// Until the server holds GPU 0 as one shareable device (`gpu-0`, `allowMultipleAllocations`,
/// a `memory` capacity), 30 s at most.
async fn wait_for_shareable_gpu0(server: &TestApiServer) {
    for _ in 0..600 {
        let gpu0: Vec<_> = server
            .slices()
            .into_iter()
            .flat_map(|s| s.spec.devices.unwrap_or_default())
            .filter(|d| d.name == "gpu-0")
            .collect();
        if let [d] = gpu0.as_slice()
            && d.allow_multiple_allocations == Some(true)
            && d.capacity
                .as_ref()
                .is_some_and(|c| c.contains_key("memory"))
        {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    panic!(
        "GPU 0 was never published as one shareable device: {:?}",
        server.slices()
    );
}
