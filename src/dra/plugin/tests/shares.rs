//! Consumable-capacity shares of a GPU (`--shared-capacity`): one MPS daemon per GPU, each
//! share's limits in its claim's CDI spec, the GPU's capacity enforced across claims.

use super::*;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

pub(super) fn share(
    request: &str,
    device: &str,
    memory: &str,
    compute: &str,
) -> DeviceRequestAllocationResult {
    DeviceRequestAllocationResult {
        share_id: Some(format!(
            "5f0e{:0>4}-0000-4000-8000-{:0>12}",
            memory.len(),
            device.len()
        )),
        consumed_capacity: Some(BTreeMap::from([
            ("memory".to_string(), Quantity(memory.into())),
            ("compute".to_string(), Quantity(compute.into())),
        ])),
        ..result(request, device)
    }
}

fn mps_log(e: &Env) -> Vec<String> {
    std::fs::read_to_string(e.dir.path().join("driver/mps.log"))
        .unwrap_or_default()
        .lines()
        .map(String::from)
        .collect()
}

#[tokio::test]
async fn three_shares_of_one_gpu_share_one_daemon_and_a_fourth_is_refused() {
    let e = env("dgx-h100").await;
    mps::tests::fake_control(&e.dir.path().join("driver"));
    let gpu = e.sim.snapshot().unwrap().gpus[0].uuid.clone();
    for uid in ["s1", "s2", "s3", "s4"] {
        e.add(claim(uid, vec![share("nb", "gpu-0-shared", "24Gi", "25")]));
    }
    for uid in ["s1", "s2", "s3"] {
        let d = e.prepare(uid).await.unwrap();
        assert_eq!(d[0].device, "gpu-0-shared");
        assert!(d[0].share_id.is_some());
        let spec = std::fs::read_to_string(e.spec(uid)).unwrap();
        assert!(
            spec.contains("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=24576M"),
            "{spec}"
        );
        assert!(
            spec.contains("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25"),
            "{spec}"
        );
        assert!(
            spec.contains("CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps"),
            "{spec}"
        );
        // The GPU daemon's shared memory is every share's `/dev/shm`.
        let shm = e.plugin.inner.mps.gpu_shm_dir(&gpu);
        assert!(
            spec.contains(&format!("hostPath: {}", shm.display()))
                && spec.contains("containerPath: /dev/shm"),
            "{spec}"
        );
    }
    let pipe = e.dir.path().join(format!("plugin/mps/shared-{gpu}/pipe"));
    assert_eq!(
        mps_log(&e),
        vec![format!("start {gpu} {}", pipe.display())],
        "one daemon for the GPU's shares"
    );
    for uid in ["s1", "s2", "s3"] {
        let spec = std::fs::read_to_string(e.spec(uid)).unwrap();
        assert!(spec.contains(pipe.to_str().unwrap()), "{spec}");
    }

    // 72Gi of 80Gi held: a fourth 24Gi share does not fit, and the error says who holds what.
    let err = e.prepare("s4").await.unwrap_err().to_string();
    for holder in ["s1", "s2", "s3"] {
        assert!(
            err.contains(&format!(
                "default/claim-{holder} ({holder}): 24Gi memory, 25% compute"
            )),
            "{err}"
        );
    }
    assert!(err.contains(&format!("gpu-0 ({gpu})")), "{err}");
    assert!(err.contains("80Gi memory, 100% compute in all"), "{err}");
    assert!(err.contains("hold 72Gi memory, 75% compute"), "{err}");
    assert_eq!(
        e.state("s4"),
        None,
        "nothing recorded for the refused share"
    );
    assert!(!e.spec("s4").exists());

    // Unprepared out of order: the daemon stays while any share is left.
    e.unprepare("s2").await.unwrap();
    e.unprepare("s1").await.unwrap();
    assert!(pipe.join("control").exists());
    assert!(e.spec("s3").exists());
    e.unprepare("s3").await.unwrap();
    assert!(!pipe.exists());
    assert_eq!(
        mps_log(&e),
        vec![
            format!("start {gpu} {}", pipe.display()),
            format!("quit {}", pipe.display())
        ]
    );
    // With the room back, the fourth fits.
    e.prepare("s4").await.unwrap();
}

#[tokio::test]
async fn a_share_and_the_whole_gpu_exclude_each_other() {
    let e = env("dgx-h100").await;
    mps::tests::fake_control(&e.dir.path().join("driver"));
    e.add(claim("s", vec![share("nb", "gpu-1-shared", "8Gi", "10")]));
    e.add(claim("w", vec![result("gpu", "gpu-1")]));
    e.prepare("s").await.unwrap();
    let err = e.prepare("w").await.unwrap_err().to_string();
    assert!(
        err.contains("already prepared for claim default/claim-s"),
        "{err}"
    );
    e.unprepare("s").await.unwrap();
    e.prepare("w").await.unwrap();
    let err = e.prepare("s").await.unwrap_err().to_string();
    assert!(
        err.contains("already prepared for claim default/claim-w"),
        "{err}"
    );
}

#[tokio::test]
async fn shares_that_cannot_be_enforced_are_refused_with_the_reason() {
    let e = env("dgx-h100").await;
    mps::tests::fake_control(&e.dir.path().join("driver"));
    let cases: Vec<(
        &str,
        Vec<DeviceRequestAllocationResult>,
        Vec<DeviceAllocationConfiguration>,
        &str,
    )> = vec![
        (
            "a",
            vec![result("nb", "gpu-0-shared")],
            vec![],
            "has no shareID",
        ),
        (
            "b",
            vec![share("nb", "gpu-0-shared", "200Gi", "10")],
            vec![],
            "200Gi memory",
        ),
        (
            "c",
            vec![share("nb", "gpu-0-shared", "4Gi", "250")],
            vec![],
            "not a whole percent",
        ),
        (
            "d",
            vec![
                share("a", "gpu-0-shared", "4Gi", "10"),
                share("b", "gpu-1-shared", "4Gi", "10"),
            ],
            vec![],
            "one claim's shares must be of one GPU",
        ),
        (
            "e",
            vec![share("nb", "gpu-0-shared", "4Gi", "10")],
            vec![opaque(
                &[],
                serde_json::json!({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig", "sharing": {"strategy": "TimeSlicing"}}),
            )],
            "drop the sharing config",
        ),
    ];
    for (uid, results, config, want) in cases {
        e.add(claim_with(uid, results, config));
        let err = kubelet_plugin::report::chain(&e.prepare(uid).await.unwrap_err()).to_string();
        assert!(err.contains(want), "{uid}: {err}");
        assert_eq!(e.state(uid), None, "{uid}");
    }
    assert!(mps_log(&e).is_empty(), "no daemon for refused shares");
}

#[tokio::test]
async fn a_restart_brings_the_gpus_daemon_back_for_its_shares() {
    let e = env("dgx-h100").await;
    mps::tests::fake_control(&e.dir.path().join("driver"));
    e.add(claim("s", vec![share("nb", "gpu-2-shared", "8Gi", "10")]));
    e.prepare("s").await.unwrap();
    let gpu = e.sim.snapshot().unwrap().gpus[2].uuid.clone();
    let pipe = e.dir.path().join(format!("plugin/mps/shared-{gpu}/pipe"));
    // The node rebooted: the daemon is gone.
    std::fs::remove_file(pipe.join("control")).unwrap();
    let (_p, rec, _stop) = e.restart(e.sim.clone()).await;
    assert!(rec.failed.is_empty(), "{rec:?}");
    assert!(pipe.join("control").exists(), "restarted for the share");
    assert_eq!(
        mps_log(&e)
            .iter()
            .filter(|l| l.starts_with("start"))
            .count(),
        2
    );
}
