//! The share-daemon watch in a running `nvdra run --shared-capacity`, with the MPS host running
//! the stand-in daemon as a process. The GPU's daemon is SIGKILLed and cannot start again for a
//! while (the stand-in fails its starts while a file exists): its share's client fails, as CUDA
//! processes of a dead MPS do; the watch notices it without any prepare (`nvdra_mps_daemon_up`
//! 0, the GPU's device published with the `gpu.nvidia.com/mps-daemon-down` NoSchedule taint) and
//! a new share of it is refused saying so. Once the host's restart succeeds (a new daemon
//! process) the metric is 1 again, the taint goes and the share is prepared. A second test kills
//! the host itself, so nothing restarts the daemon until the host is back. The kubelet's calls
//! come from the grpcio stand-in.

use std::time::{Duration, Instant};

use k8s_openapi::api::resource::v1::ResourceSlice;
use serde_json::json;

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

/// The UUID of GPU 0 of the simulated DGX H100.
fn gpu0() -> String {
    use nvdra::inventory::DeviceBackend;
    nvdra::inventory::sim::SimBackend::from_profile("dgx-h100", NODE)
        .unwrap()
        .snapshot()
        .unwrap()
        .gpus[0]
        .uuid
        .to_string()
}

/// `nvdra run --shared-capacity` probing its daemons every 100 ms, `/metrics` on `metrics`, with
/// two 8Gi share claims of GPU 0 (`w1`, `w2`) and the stand-in daemon under its driver root.
async fn shares_daemon(metrics: &str) -> Daemon {
    Daemon::start_with(
        &[
            "--shared-capacity",
            "--mps-probe-interval",
            "100ms",
            "--metrics-address",
            metrics,
        ],
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
    .await
}

/// The kubelet's prepare of claim `uid`: the error it got ("" when prepared).
fn prepare(k: &mut NodeStandin, uid: &str) -> String {
    k.ok(json!({"op": "prepare", "claims": [
        {"namespace": "default", "name": format!("claim-{uid}"), "uid": uid}
    ]}))["claims"][uid]["error"]
        .as_str()
        .unwrap()
        .to_string()
}

/// Waits (30 s at most) until `/metrics` on `addr` says GPU `gpu`'s daemon is `up` (1 or 0).
async fn daemon_up_until(addr: &str, gpu: &str, up: u8) {
    let want = format!("nvdra_mps_daemon_up{{gpu=\"{gpu}\"}} {up}");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let body = crate::support::promclient::get(addr, "/metrics")
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

fn down_taint(t: &[(String, String, String)]) -> bool {
    let key = format!("{DRIVER}/mps-daemon-down");
    t.iter()
        .any(|(dev, k, e)| dev == "gpu-0" && *k == key && e == "NoSchedule")
}

#[tokio::test]
async fn a_sigkilled_daemon_is_noticed_tainted_refused_and_restarted() {
    if !have_grpcio() {
        return;
    }
    let metrics = format!("127.0.0.1:{}", crate::support::promclient::free_port());
    let d = shares_daemon(&metrics).await;
    let (mps_root, boot) = (d.root.path().join("mps"), d.root.path().join("boot_id"));
    let driver = d.root.path().join("driver");
    let blocked = d.root.path().join("daemon-cannot-start");
    let blocked_env = blocked.display().to_string();
    let _host = mps::Host::start(
        &mps_root,
        &driver,
        &boot,
        &[("STANDIN_START_FAILS_WHILE", blocked_env.as_str())],
    );
    let mut k = NodeStandin::start(&d.root.path().join("standin"), &d.dra_socket());
    let gpu = gpu0();
    let (dir, pipe) = (
        mps::gpu_dir(&mps_root, &gpu),
        mps::gpu_pipe_dir(&mps_root, &gpu),
    );
    assert_eq!(prepare(&mut k, "w1"), "");
    let mut client = mps::CudaClient::start(&driver, &pipe, &[]);
    taints_until(&d, "was published untainted", |t| t.is_empty()).await;
    daemon_up_until(&metrics, &gpu, 1).await;
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
    daemon_up_until(&metrics, &gpu, 0).await;
    taints_until(&d, "was tainted mps-daemon-down", down_taint).await;
    let err = prepare(&mut k, "w2");
    assert!(
        err.contains(&format!(
            "MPS control daemon of GPU {gpu} has not answered since"
        )),
        "{err}"
    );
    assert!(
        mps::ask(&driver, &pipe, "get_server_list").is_none(),
        "nothing answers while the daemon cannot start"
    );

    // The host's next restart succeeds: a new daemon, noticed without a prepare.
    std::fs::remove_file(&blocked).unwrap();
    daemon_up_until(&metrics, &gpu, 1).await;
    taints_until(&d, "lost its taint", |t| t.is_empty()).await;
    let now = mps::daemon_pids(&dir);
    assert!(
        now.last().is_some_and(|p| *p != first[0] && mps::runs(*p)),
        "a new daemon process serves: {first:?} then {now:?}"
    );
    assert_eq!(prepare(&mut k, "w2"), "");
    let mut again = mps::CudaClient::start(&driver, &pipe, &[]);
    assert!(again.connected(), "a new client is served");
}

#[tokio::test]
async fn a_daemon_whose_host_is_gone_taints_its_gpu_and_refuses_shares_until_it_answers() {
    if !have_grpcio() {
        return;
    }
    let metrics = format!("127.0.0.1:{}", crate::support::promclient::free_port());
    let d = shares_daemon(&metrics).await;
    let (mps_root, boot) = (d.root.path().join("mps"), d.root.path().join("boot_id"));
    let driver = d.root.path().join("driver");
    let host = mps::Host::start(&mps_root, &driver, &boot, &[]);
    let mut k = NodeStandin::start(&d.root.path().join("standin"), &d.dra_socket());
    assert_eq!(prepare(&mut k, "w1"), "");
    taints_until(&d, "was published untainted", |t| t.is_empty()).await;
    let gpu = gpu0();
    let pipe = mps::gpu_pipe_dir(&mps_root, &gpu);
    assert!(mps::ask(&driver, &pipe, "get_server_list").is_some());

    // The MPS host is killed, and its daemon with it: the request and the socket file stay, but
    // nothing answers and nothing starts it again.
    drop(host);
    mps::eventually("the daemon is gone", || {
        mps::ask(&driver, &pipe, "get_server_list").is_none()
    });
    taints_until(&d, "was tainted mps-daemon-down", down_taint).await;
    daemon_up_until(&metrics, &gpu, 0).await;
    let err = prepare(&mut k, "w2");
    assert!(
        err.contains(&format!(
            "MPS control daemon of GPU {gpu} has not answered since"
        )),
        "{err}"
    );

    // The MPS host is back (its DaemonSet restarted it) and starts the daemon again.
    let _host = mps::Host::start(&mps_root, &driver, &boot, &[]);
    taints_until(&d, "lost its taint", |t| t.is_empty()).await;
    daemon_up_until(&metrics, &gpu, 1).await;
    assert_eq!(prepare(&mut k, "w2"), "");
}
