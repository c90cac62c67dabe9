//! `nvdra run --mode both`: DRA and the device plugin on one node, kept apart by one ledger,
//! against the grpcio kubelet stand-in (`crates/kubelet-plugin/tests/kubelet/standin.py node`), which serves
//! `kubelet.sock` and PodResources and plays the kubelet's DRA and device-manager calls as the
//! test tells it. The slices are read from the daemon's API directory.
//!
//! Needs python3 with grpcio, grpcio-tools, protobuf and hpack (as
//! tests/integration/kubelet_grpcio.rs). Without them the tests say why and pass — unless
//! `NVDRA_REQUIRE_GRPCIO` is set.

use crate::support;

use std::path::PathBuf;
use std::process::Child;
use std::time::{Duration, Instant};
use support::grpcio::{NodeStandin, have_grpcio};

use nvdra::api::SliceApi;
use nvdra::api::dir::DirApi;
use nvdra::inventory::{DeviceBackend, sim::SimBackend};
use serde_json::{Value, json};

const NODE: &str = "node-a";
const DRIVER: &str = "gpu.nvidia.com";
const PROFILE: &str = "dgx-h100";
/// How long a change may take to reach the slices (the publisher's own pace; not a speed test).
const SLICES_WAIT: Duration = Duration::from_secs(30);

/// The UUID (the device-plugin ID) of GPU `index` of the profile.
fn uuid(index: usize) -> String {
    SimBackend::from_profile(PROFILE, NODE)
        .unwrap()
        .snapshot()
        .unwrap()
        .gpus[index]
        .uuid
        .to_string()
}

/// A kubelet root with the stand-in and `nvdra run --mode both`, both killed when dropped.
struct Node {
    root: tempfile::TempDir,
    standin: NodeStandin,
    nvdra: Child,
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.nvdra.kill();
        let _ = self.nvdra.wait();
    }
}

impl Node {
    /// Writes the claims (`uid`, device) as allocated in the API directory, then starts the
    /// stand-in and nvdra.
    fn start(claims: &[(&str, &str)]) -> Node {
        Self::start_with_pods(claims, json!([]))
    }

    /// As [`Node::start`], with PodResources listing `pods` before nvdra starts.
    fn start_with_pods(claims: &[(&str, &str)], pods: Value) -> Node {
        Self::start_with(claims, pods, &[])
    }

    /// As [`Node::start_with_pods`], with more arguments to `nvdra run`.
    fn start_with(claims: &[(&str, &str)], pods: Value, args: &[&std::ffi::OsStr]) -> Node {
        let root = tempfile::tempdir().unwrap();
        let p = |s: &str| root.path().join(s);
        for (uid, device) in claims {
            let c = nvdra::api::allocated_claim(
                "default",
                &format!("claim-{uid}"),
                uid,
                vec![nvdra::api::allocated_device("gpu", DRIVER, NODE, device)],
                vec![],
            );
            nvdra::api::dir::write_claim(&p("api"), &c).unwrap();
        }
        let dra = p(&format!("kubelet/plugins/{DRIVER}/dra.sock"));
        let mut standin = NodeStandin::start(&p("kubelet"), &dra);
        standin.ok(json!({"op": "pods", "pods": pods, "wait": false}));
        let nvdra = support::daemon::nvdra_run(root.path(), "both", NODE)
            .args(["--profile", PROFILE])
            .args(args)
            .spawn()
            .unwrap();
        let mut node = Node {
            root,
            standin,
            nvdra,
        };
        node.ok(json!({"op": "registered", "names": ["nvidia.com/gpu"]}));
        node
    }

    fn ok(&mut self, cmd: Value) -> Value {
        self.standin.ok(cmd)
    }

    fn prepare(&mut self, op: &str, uid: &str) -> Value {
        let v = self.ok(json!({"op": op, "claims": [
            {"namespace": "default", "name": format!("claim-{uid}"), "uid": uid}
        ]}));
        v["claims"][uid].clone()
    }

    fn api(&self) -> PathBuf {
        self.root.path().join("api")
    }

    /// The device names of the published slices.
    fn published(&self) -> Vec<String> {
        let api = DirApi::new(self.api()).unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let slices = rt.block_on(api.list_slices(DRIVER, NODE)).unwrap();
        slices
            .iter()
            .flat_map(|s| s.spec.devices.iter().flatten())
            .map(|d| d.name.clone())
            .collect()
    }

    /// Waits until the published slices satisfy `pred`; fails with the last ones seen.
    fn wait_published(&self, what: &str, pred: impl Fn(&[String]) -> bool) -> Vec<String> {
        let deadline = Instant::now() + SLICES_WAIT;
        loop {
            let names = self.published();
            if pred(&names) {
                return names;
            }
            assert!(
                Instant::now() < deadline,
                "slices never {what} within {SLICES_WAIT:?}: {names:?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

fn health(list: &Value, id: &str) -> String {
    list.as_array()
        .unwrap()
        .iter()
        .find(|d| d["id"] == id)
        .unwrap_or_else(|| panic!("{id} not in {list}"))["health"]
        .as_str()
        .unwrap()
        .to_string()
}

/// A GPU prepared for a DRA claim is Unhealthy in ListAndWatch while the claim holds it (and
/// only that GPU), Allocate of it fails naming the claim, and it is Healthy and allocatable
/// again once the claim is unprepared.
#[test]
fn a_dra_prepared_gpu_is_unhealthy_in_list_and_watch_until_unprepared() {
    if !have_grpcio() {
        return;
    }
    let uid = "11111111-0000-0000-0000-000000000001";
    let mut node = Node::start(&[(uid, "gpu-0")]);
    let (g0, g1) = (uuid(0), uuid(1));
    let first = node.ok(json!({"op": "watch", "resource": "nvidia.com/gpu"}));
    assert_eq!(health(&first["devices"], &g0), "Healthy");

    let prepared = node.prepare("prepare", uid);
    assert_eq!(prepared["error"], "", "{prepared}");
    assert_eq!(prepared["devices"], json!(["gpu-0"]));
    let list = node
        .ok(json!({"op": "until", "resource": "nvidia.com/gpu", "id": g0, "health": "Unhealthy"}));
    assert!(
        list["index"].as_u64().unwrap() >= 1,
        "re-sent, not the first list: {list}"
    );
    let unhealthy: Vec<&Value> = list["devices"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|d| d["health"] != "Healthy")
        .collect();
    assert_eq!(unhealthy.len(), 1, "only the claimed GPU: {list}");

    let refused = node.ok(json!({"op": "allocate", "resource": "nvidia.com/gpu", "ids": [g0]}));
    assert_eq!(refused["allocated"], false, "{refused}");
    let msg = refused["message"].as_str().unwrap();
    assert!(
        msg.contains(&format!("default/claim-{uid}")) && msg.contains(&g0),
        "{msg}"
    );
    // Another GPU is still the device manager's.
    let other = node.ok(json!({"op": "allocate", "resource": "nvidia.com/gpu", "ids": [g1]}));
    assert_eq!(other["allocated"], true, "{other}");

    let unprepared = node.prepare("unprepare", uid);
    assert_eq!(unprepared["error"], "", "{unprepared}");
    node.ok(json!({"op": "until", "resource": "nvidia.com/gpu", "id": g0, "health": "Healthy"}));
    let again = node.ok(json!({"op": "allocate", "resource": "nvidia.com/gpu", "ids": [g0]}));
    assert_eq!(again["allocated"], true, "{again}");
}

/// A GPU allocated to a running pod (as PodResources lists it) leaves the published slices, a
/// claim for it fails naming the pod and container, and it returns when the pod ends.
#[test]
fn a_gpu_allocated_to_a_running_pod_leaves_the_slices_and_returns_when_the_pod_ends() {
    if !have_grpcio() {
        return;
    }
    let uid = "22222222-0000-0000-0000-000000000002";
    let mut node = Node::start(&[(uid, "gpu-1")]);
    let g1 = uuid(1);
    node.wait_published("listed gpu-1", |n| n.iter().any(|d| d == "gpu-1"));

    let allocated = node.ok(json!({"op": "allocate", "resource": "nvidia.com/gpu", "ids": [g1]}));
    assert_eq!(allocated["allocated"], true, "{allocated}");
    node.ok(
        json!({"op": "pods", "pods": [{"namespace": "default", "name": "legacy", "containers": [
            {"name": "cuda", "devices": [{"resource": "nvidia.com/gpu", "ids": [g1]}]}
        ]}]}),
    );
    let names = node.wait_published("dropped gpu-1", |n| !n.iter().any(|d| d == "gpu-1"));
    assert!(
        names.iter().any(|d| d == "gpu-2"),
        "only gpu-1 hidden: {names:?}"
    );

    let refused = node.prepare("prepare", uid);
    let err = refused["error"].as_str().unwrap();
    assert!(
        err.contains("pod default/legacy container cuda") && err.contains("gpu-1"),
        "{refused}"
    );

    // The pod ends: PodResources no longer lists it.
    node.ok(json!({"op": "pods", "pods": []}));
    node.wait_published("listed gpu-1 again", |n| n.iter().any(|d| d == "gpu-1"));
    let prepared = node.prepare("prepare", uid);
    assert_eq!(prepared["error"], "", "{prepared}");
    assert_eq!(prepared["devices"], json!(["gpu-1"]));
}

/// A pod that kept its GPU across an nvdra restart: the GPU is in none of the published slices,
/// not even the first, and a claim for it fails naming the pod. (The daemon reads PodResources
/// once before serving; the poll's immediate first read would usually win this race too, so this
/// checks the outcome, not which of the two reads got there.)
#[test]
fn a_gpu_a_pod_already_holds_at_start_is_never_published() {
    if !have_grpcio() {
        return;
    }
    let uid = "33333333-0000-0000-0000-000000000003";
    let g3 = uuid(3);
    let pods = json!([{"namespace": "ml", "name": "trainer", "containers": [
        {"name": "main", "devices": [{"resource": "nvidia.com/gpu", "ids": [g3]}]}
    ]}]);
    let mut node = Node::start_with_pods(&[(uid, "gpu-3")], pods);
    let first = node.wait_published("published anything", |n| !n.is_empty());
    assert!(
        first.iter().any(|d| d == "gpu-2") && !first.iter().any(|d| d == "gpu-3"),
        "{first:?}"
    );
    let refused = node.prepare("prepare", uid);
    let err = refused["error"].as_str().unwrap();
    assert!(err.contains("pod ml/trainer container main"), "{refused}");
}

/// `--dynamic-mig` beside the device plugin, under `migStrategy: single` and `mixed`: a DRA
/// claim of a placement switches GPU 0 to MIG mode. The device-plugin path leaves GPU 0 out of
/// its lists instead of failing to compute them (under `single` a node of mixed MIG modes), so
/// ListAndWatch keeps updating: an XID on GPU 1 after the switch reaches it, and GPU 0 is back,
/// healthy, once the claim is unprepared and its MIG mode is off again.
#[test]
fn list_and_watch_stays_live_while_dra_switches_a_gpu_to_mig_mode() {
    if !have_grpcio() {
        return;
    }
    let (g0, g1) = (uuid(0), uuid(1));
    for strategy in ["single", "mixed"] {
        let files = tempfile::tempdir().unwrap();
        let config = files.path().join("dp.yaml");
        let text = format!("version: v1\nflags:\n  migStrategy: {strategy}\n");
        std::fs::write(&config, text).unwrap();
        let faults = files.path().join("faults");
        std::fs::write(&faults, "").unwrap();
        let uid = "44444444-0000-0000-0000-000000000004";
        let placement = "gpu-0-mig-1g10gb-19-0";
        let args = [
            "--dynamic-mig".as_ref(),
            "--device-plugin-config".as_ref(),
            config.as_os_str(),
            "--fault-file".as_ref(),
            faults.as_os_str(),
        ];
        let mut node = Node::start_with(&[(uid, placement)], json!([]), &args);
        let first = node.ok(json!({"op": "watch", "resource": "nvidia.com/gpu"}));
        assert_eq!(health(&first["devices"], &g0), "Healthy", "{strategy}");

        let prepared = node.prepare("prepare", uid);
        assert_eq!(prepared["error"], "", "{strategy}: {prepared}");
        assert_eq!(prepared["devices"], json!([placement]), "{strategy}");

        std::fs::write(&faults, "xid 1 79\n").unwrap();
        let list = node.ok(
            json!({"op": "until", "resource": "nvidia.com/gpu", "id": g1, "health": "Unhealthy"}),
        );
        let ids: Vec<&str> = list["devices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d["id"].as_str().unwrap())
            .collect();
        assert!(
            !ids.contains(&g0.as_str()),
            "{strategy}: GPU 0 left out: {list}"
        );
        assert_eq!(ids.len(), 7, "{strategy}: every other GPU: {list}");

        let unprepared = node.prepare("unprepare", uid);
        assert_eq!(unprepared["error"], "", "{strategy}: {unprepared}");
        // A fresh stream: `until` looks at every list a stream sent, the first one included.
        node.ok(json!({"op": "watch", "resource": "nvidia.com/gpu"}));
        let back = node.ok(
            json!({"op": "until", "resource": "nvidia.com/gpu", "id": g0, "health": "Healthy"}),
        );
        assert_eq!(
            health(&back["devices"], &g1),
            "Unhealthy",
            "{strategy}: {back}"
        );
    }
}
