//! The share-daemon watch in a running `nvdra run --shared-capacity`, with the MPS host running
//! the stand-in daemon as a process. The GPU's daemon is SIGKILLed and cannot start again for a
//! while (the stand-in fails its starts while a file exists): its share's client fails, as CUDA
//! processes of a dead MPS do; the watch notices it without any prepare (`nvdra_mps_daemon_up`
//! 0, the GPU's device published with the `gpu.nvidia.com/mps-daemon-down` NoSchedule taint) and
//! a new share of it is refused saying so. Once the host's restart succeeds (a new daemon
//! process) the metric is 1 again, the taint goes and the share is prepared. A second test kills
//! the host itself, so nothing restarts the daemon until the host is back. The kubelet's calls
//! come from the grpcio stand-in.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use k8s_openapi::api::resource::v1::ResourceSlice;
use serde_json::json;

use super::shares::gpu0_uuid;
use super::{DRIVER, Daemon, NODE, have_grpcio};
use crate::support::grpcio::NodeStandin;
use crate::support::mps;

/// The taints of GPU 0's published device (`gpu-0`); `None` while no slice read holds it (a
/// slice being rewritten reads as nothing, not as untainted).
fn gpu0_taints(d: &Daemon) -> Option<Vec<(String, String, String)>> {
    let dir = d.root.path().join("api/resourceslices");
    let mut out = Vec::new();
    let mut seen = false;
    for e in std::fs::read_dir(dir).into_iter().flatten() {
        let text = std::fs::read_to_string(e.unwrap().path()).unwrap_or_default();
        let Ok(slice) = nvdra::yaml::from_str::<ResourceSlice>(&text) else {
            continue;
        };
        for dev in slice.spec.devices.iter().flatten() {
            if dev.name == "gpu-0" {
                seen = true;
                for t in dev.taints.iter().flatten() {
                    out.push((dev.name.clone(), t.key.clone(), t.effect.clone()));
                }
            }
        }
    }
    out.sort();
    seen.then_some(out)
}

/// Waits (30 s at most) until `pred` holds on GPU 0's taints.
async fn taints_until(d: &Daemon, what: &str, pred: impl Fn(&[(String, String, String)]) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let t = gpu0_taints(d);
        if t.as_deref().is_some_and(&pred) {
            return;
        }
        assert!(Instant::now() < deadline, "GPU 0 never {what}: {t:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `nvdra run --shared-capacity` probing its daemons every 100 ms, with two 8Gi share claims of
/// GPU 0 (`w1`, `w2`), the stand-in daemon under its driver root, `/metrics` on a port of its
/// own and the grpcio kubelet; the MPS host is the test's to start.
struct Node {
    d: Daemon,
    k: NodeStandin,
    metrics: String,
    mps_root: PathBuf,
    driver: PathBuf,
    gpu: String,
    pipe: PathBuf,
}

impl Node {
    async fn start() -> Node {
        let d = Daemon::start_with(
            &["--shared-capacity", "--mps-probe-interval", "100ms"],
            |api| {
                mps::install_standin(&api.parent().unwrap().join("driver"));
                for (n, uid) in ["w1", "w2"].iter().enumerate() {
                    mps::write_share_claim(
                        api,
                        DRIVER,
                        NODE,
                        uid,
                        "gpu-0",
                        &format!("5f0e0000-0000-4000-8000-00000000000{n}"),
                        "8Gi",
                    );
                }
            },
        )
        .await;
        let k = NodeStandin::start(&d.root.path().join("standin"), &d.dra_socket());
        let (mps_root, driver) = (d.root.path().join("mps"), d.root.path().join("driver"));
        let gpu = gpu0_uuid();
        let pipe = mps::gpu_pipe_dir(&mps_root, &gpu);
        // `/metrics` on `127.0.0.1:0` (the sandbox's): the port the kernel gave, read back, so
        // no other test takes it between a pick and the bind.
        let metrics = crate::support::daemon::metrics_address(d.child.id()).to_string();
        Node {
            d,
            k,
            metrics,
            mps_root,
            driver,
            gpu,
            pipe,
        }
    }

    /// `nvdra mps-host` for this node, with `env` added.
    fn host(&self, env: &[(&str, &str)]) -> mps::Host {
        let boot = self.d.root.path().join("boot_id");
        mps::Host::start(&self.mps_root, &self.driver, &boot, env)
    }

    /// The kubelet's prepare of claim `uid`: the error it got ("" when prepared).
    fn prepare(&mut self, uid: &str) -> String {
        self.k.ok(json!({"op": "prepare", "claims": [
            {"namespace": "default", "name": format!("claim-{uid}"), "uid": uid}
        ]}))["claims"][uid]["error"]
            .as_str()
            .unwrap()
            .to_string()
    }

    fn answers(&self) -> bool {
        mps::ask(&self.driver, &self.pipe, "get_server_list").is_some()
    }

    /// Waits (30 s at most) until `/metrics` says GPU 0's daemon is `up` (1 or 0).
    async fn daemon_up_until(&self, up: u8) {
        let want = format!("nvdra_mps_daemon_up{{gpu=\"{}\"}} {up}", self.gpu);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let body = crate::support::promclient::get(&self.metrics, "/metrics")
                .map(|(_, body)| body)
                .unwrap_or_default();
            if body.lines().any(|l| l == want) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "never `{want}` in /metrics:\n{body}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// GPU 0 tainted `mps-daemon-down`, `nvdra_mps_daemon_up` 0 and a new share refused saying
    /// since when, all without a prepare of GPU 0 having failed first.
    async fn noticed_down(&mut self) {
        self.daemon_up_until(0).await;
        let key = format!("{DRIVER}/mps-daemon-down");
        taints_until(&self.d, "was tainted mps-daemon-down", |t| {
            t.iter()
                .any(|(dev, k, e)| dev == "gpu-0" && *k == key && e == "NoSchedule")
        })
        .await;
        let err = self.prepare("w2");
        let want = format!(
            "MPS control daemon of GPU {} has not answered since",
            self.gpu
        );
        assert!(err.contains(&want), "{err}");
    }

    /// The taint gone, the metric 1 and the refused share prepared.
    async fn noticed_up(&mut self) {
        self.daemon_up_until(1).await;
        taints_until(&self.d, "lost its taint", |t| t.is_empty()).await;
        assert_eq!(self.prepare("w2"), "");
    }
}

#[tokio::test]
async fn a_sigkilled_daemon_is_noticed_tainted_refused_and_restarted() {
    if !have_grpcio() {
        return;
    }
    let mut n = Node::start().await;
    let blocked = n.d.root.path().join("daemon-cannot-start");
    let blocked_env = blocked.display().to_string();
    let _host = n.host(&[("STANDIN_START_FAILS_WHILE", blocked_env.as_str())]);
    let dir = mps::gpu_dir(&n.mps_root, &n.gpu);
    assert_eq!(n.prepare("w1"), "");
    let mut client = mps::CudaClient::start(&n.driver, &n.pipe, &[]);
    taints_until(&n.d, "was published untainted", |t| t.is_empty()).await;
    n.daemon_up_until(1).await;
    let first = mps::daemon_pids(&dir);
    assert_eq!(first.len(), 1, "one daemon: {first:?}");

    // The daemon is SIGKILLed, and its restarts fail for now. Nothing prepares meanwhile.
    std::fs::write(&blocked, "").unwrap();
    let killed = std::process::Command::new("kill")
        .args(["-KILL", &first[0].to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    mps::eventually("the share's client fails with its daemon", || {
        !client.connected()
    });
    n.noticed_down().await;
    assert!(
        !n.answers(),
        "nothing answers while the daemon cannot start"
    );

    // The host's next restart succeeds: a new daemon, noticed without a prepare.
    std::fs::remove_file(&blocked).unwrap();
    n.noticed_up().await;
    let now = mps::daemon_pids(&dir);
    assert!(
        now.last().is_some_and(|p| *p != first[0] && mps::runs(*p)),
        "a new daemon process serves: {first:?} then {now:?}"
    );
    let mut again = mps::CudaClient::start(&n.driver, &n.pipe, &[]);
    assert!(again.connected(), "a new client is served");
}

#[tokio::test]
async fn a_daemon_whose_host_is_gone_taints_its_gpu_and_refuses_shares_until_it_answers() {
    if !have_grpcio() {
        return;
    }
    let mut n = Node::start().await;
    let host = n.host(&[]);
    assert_eq!(n.prepare("w1"), "");
    taints_until(&n.d, "was published untainted", |t| t.is_empty()).await;
    assert!(n.answers());

    // The MPS host is killed, and its daemon with it: the request and the socket file stay, but
    // nothing answers and nothing starts it again.
    drop(host);
    mps::eventually("the daemon is gone", || !n.answers());
    n.noticed_down().await;

    // The MPS host is back (its DaemonSet restarted it) and starts the daemon again.
    let _host = n.host(&[]);
    n.noticed_up().await;
}
