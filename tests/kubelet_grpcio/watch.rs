//! The share-daemon watch in a running `nvdra run --shared-capacity`: while the GPU's MPS daemon
//! does not answer (the fake's control file is gone, as after a SIGKILL when nothing answers on
//! the socket), its devices are published with the `gpu.nvidia.com/mps-daemon-down` NoSchedule
//! taint and a new share of it is refused saying so; once the daemon answers again the taint goes
//! and the share is prepared. The kubelet's calls come from the grpcio stand-in.

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

#[tokio::test]
async fn a_daemon_that_stops_answering_taints_its_gpu_and_refuses_shares_until_it_answers() {
    if !have_grpcio() {
        return;
    }
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
    let (mps_root, boot) = (d.root.path().join("mps"), d.root.path().join("boot_id"));
    let driver = d.root.path().join("driver");
    let host = mps::Host::start(&mps_root, &driver, &boot, &[]);
    let mut k = NodeStandin::start(&d.root.path().join("standin"), &d.dra_socket());
    let mut prepare = |uid: &str| {
        k.ok(json!({"op": "prepare", "claims": [
            {"namespace": "default", "name": format!("claim-{uid}"), "uid": uid}
        ]}))["claims"][uid]["error"]
            .as_str()
            .unwrap()
            .to_string()
    };
    assert_eq!(prepare("w1"), "");
    taints_until(&d, "was published untainted", |t| t.is_empty()).await;
    let gpu = {
        use nvdra::inventory::DeviceBackend;
        nvdra::inventory::sim::SimBackend::from_profile("dgx-h100", NODE)
            .unwrap()
            .snapshot()
            .unwrap()
            .gpus[0]
            .uuid
            .to_string()
    };
    let pipe = mps::gpu_pipe_dir(&mps_root, &gpu);
    assert!(mps::ask(&driver, &pipe, "get_server_list").is_some());

    // The MPS host is killed, and its daemon with it: the request and the socket file stay, but
    // nothing answers and nothing starts it again.
    drop(host);
    mps::eventually("the daemon is gone", || {
        mps::ask(&driver, &pipe, "get_server_list").is_none()
    });
    let key = format!("{DRIVER}/mps-daemon-down");
    taints_until(&d, "was tainted mps-daemon-down", |t| {
        t.iter()
            .any(|(dev, k, e)| dev == "gpu-0" && *k == key && e == "NoSchedule")
    })
    .await;
    let err = prepare("w2");
    assert!(
        err.contains(&format!(
            "MPS control daemon of GPU {gpu} has not answered since"
        )),
        "{err}"
    );

    // The MPS host is back (its DaemonSet restarted it) and starts the daemon again.
    let _host = mps::Host::start(&mps_root, &driver, &boot, &[]);
    taints_until(&d, "lost its taint", |t| t.is_empty()).await;
    assert_eq!(prepare("w2"), "");
}
