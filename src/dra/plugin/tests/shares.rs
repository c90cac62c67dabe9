//! Consumable-capacity shares of a GPU (`--shared-capacity`): one MPS daemon per GPU, each
//! share's limits in its claim's CDI spec, the GPU's memory enforced across claims, and an
//! allocation of all of a GPU's memory prepared as the GPU whole.

use super::*;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

/// An allocation of `device` as the scheduler makes one of a shareable GPU: a shareID and what
/// it consumes of each capacity (`multiprocessors` at its policy's default, 0).
pub(super) fn share(request: &str, device: &str, memory: &str) -> DeviceRequestAllocationResult {
    share_sms(request, device, memory, "0")
}

/// [`share`], asking for `sms` multiprocessors.
pub(super) fn share_sms(
    request: &str,
    device: &str,
    memory: &str,
    sms: &str,
) -> DeviceRequestAllocationResult {
    DeviceRequestAllocationResult {
        share_id: Some(format!(
            "5f0e{:0>4}-0000-4000-8000-{:0>12}",
            memory.len(),
            request.len() * 100 + device.len()
        )),
        consumed_capacity: Some(BTreeMap::from([
            ("memory".to_string(), Quantity(memory.into())),
            ("multiprocessors".to_string(), Quantity(sms.into())),
        ])),
        ..result(request, device)
    }
}

fn mps_config(mps: serde_json::Value) -> DeviceAllocationConfiguration {
    opaque(
        &[],
        serde_json::json!({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig", "sharing": {"strategy": "MPS", "mpsConfig": mps}}),
    )
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
    let _host = e.mps_host();
    let gpu = e.sim.snapshot().unwrap().gpus[0].uuid.clone();
    for uid in ["s1", "s2", "s3", "s4"] {
        e.add(claim(uid, vec![share("nb", "gpu-0", "24Gi")]));
    }
    for uid in ["s1", "s2", "s3"] {
        let d = e.prepare(uid).await.unwrap();
        assert_eq!(d[0].device, "gpu-0");
        assert!(d[0].share_id.is_some());
        assert_eq!(
            d[0].consumed,
            Some(crate::ledger::Consumed {
                memory: 24 << 30,
                multiprocessors: None,
                shares: None,
                burst_limit: None,
            })
        );
        let spec = std::fs::read_to_string(e.spec(uid)).unwrap();
        // 24Gi less its part of the MPS server's reserve: 24576 MiB × 79/80.
        assert!(
            spec.contains("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=24268M"),
            "{spec}"
        );
        assert!(
            !spec.contains("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"),
            "no SM cap unless asked: {spec}"
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
    let pipe = e.plugin.inner.mps.gpu_pipe_dir(&gpu);
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
            err.contains(&format!("default/claim-{holder} ({holder}): 24Gi")),
            "{err}"
        );
    }
    assert!(
        err.contains(&format!(
            "the scheduler placed this share of 24Gi memory on GPU gpu-0 ({gpu}), which has \
             80Gi in all, and its other shares hold 72Gi"
        )),
        "{err}"
    );
    assert!(
        err.contains("delete the pod so the scheduler places it again"),
        "{err}"
    );
    assert_eq!(
        e.state("s4"),
        None,
        "nothing recorded for the refused share"
    );
    assert!(!e.spec("s4").exists());

    // Unprepared out of order: the daemon stays while any share is left.
    e.unprepare("s2").await.unwrap();
    e.unprepare("s1").await.unwrap();
    assert!(e.plugin.inner.mps.gpu_requested(&gpu));
    assert!(e.spec("s3").exists());
    e.unprepare("s3").await.unwrap();
    assert!(!e.plugin.inner.mps.gpu_requested(&gpu));
    mps::tests::eventually("the host removes the released daemon", || !pipe.exists());
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

/// A share and a claim that holds the GPU whole exclude each other, whichever came first, and
/// the refusal names the real cause and what to do: the scheduler placed it on a GPU in use.
#[tokio::test]
async fn a_share_and_the_whole_gpu_exclude_each_other() {
    let e = env("dgx-h100").await;
    let _host = e.mps_host();
    e.add(claim("s", vec![share("nb", "gpu-1", "8Gi")]));
    e.add(claim("t", vec![share("nb", "gpu-1", "8Gi")]));
    // Whole as the scheduler allocates a claim that asks for no memory: all of it.
    e.add(claim("w", vec![share("gpu", "gpu-1", "80Gi")]));
    e.prepare("s").await.unwrap();
    e.prepare("t").await.unwrap();
    let err = e.prepare("w").await.unwrap_err();
    assert!(matches!(err, ClaimError::WholeGpuOnShares { .. }), "{err}");
    assert_eq!(
        err.to_string(),
        "the scheduler placed a whole-GPU claim on gpu-1, which shares of claims \
         default/claim-s (s), default/claim-t (t) hold; the node refuses it rather than hand a \
         GPU in use whole (the allocation was made against an older state): delete the pod so \
         the scheduler places it again, or wait until those shares end"
    );
    e.unprepare("s").await.unwrap();
    e.unprepare("t").await.unwrap();
    e.prepare("w").await.unwrap();
    let err = e.prepare("s").await.unwrap_err();
    assert!(matches!(err, ClaimError::ShareOnWholeGpu { .. }), "{err}");
    assert!(
        err.to_string().starts_with(
            "the scheduler placed this share on GPU gpu-1, which claim default/claim-w (w) uses \
             whole;"
        ),
        "{err}"
    );
    assert!(
        err.to_string().ends_with(
            "delete the pod so the scheduler places it again, or wait until that claim ends"
        ),
        "{err}"
    );
    // A plain allocation (no shareID) of the GPU is whole too.
    e.unprepare("w").await.unwrap();
    e.add(claim("p", vec![result("gpu", "gpu-1")]));
    e.prepare("p").await.unwrap();
    assert!(matches!(
        e.prepare("s").await.unwrap_err(),
        ClaimError::ShareOnWholeGpu { .. }
    ));
}

/// An allocation that consumes all of a shareable GPU's memory (a claim that asked for none,
/// or for all of it) is the GPU whole: exclusive, no MPS, no share recorded.
#[tokio::test]
async fn all_of_the_memory_is_the_gpu_whole_without_mps() {
    let e = env("dgx-h100").await;
    let _host = e.mps_host();
    let mut no_capacity = result("gpu", "gpu-3");
    no_capacity.share_id = Some("5f0e0000-0000-4000-8000-000000000003".into());
    for (uid, r) in [
        ("whole", share("gpu", "gpu-2", "80Gi")),
        ("no-capacity", no_capacity),
    ] {
        e.add(claim(uid, vec![r]));
        let d = e.prepare(uid).await.unwrap();
        assert_eq!(d[0].consumed, None, "{uid}");
        assert_eq!(d[0].sharing, Sharing::Exclusive, "{uid}");
        assert!(d[0].share_id.is_some(), "{uid}");
        let spec = std::fs::read_to_string(e.spec(uid)).unwrap();
        assert!(!spec.contains("CUDA_MPS"), "{uid}: {spec}");
    }
    assert!(mps_log(&e).is_empty(), "no MPS daemon for a whole GPU");
    // Exclusive: the second whole allocation of gpu-2 is refused as any second claim is.
    e.add(claim("again", vec![share("gpu", "gpu-2", "80Gi")]));
    assert!(matches!(
        e.prepare("again").await.unwrap_err(),
        ClaimError::DeviceInUse { .. }
    ));
}

/// An admin-access allocation (monitoring) of a shared GPU is no share: it runs beside the
/// shares, outside the GPU's MPS daemon, and is not counted against its memory.
#[tokio::test]
async fn admin_access_beside_shares_is_no_share() {
    let e = env("dgx-h100").await;
    let _host = e.mps_host();
    e.add(claim("s", vec![share("nb", "gpu-6", "72Gi")]));
    let mut admin = share("mon", "gpu-6", "24Gi");
    admin.admin_access = Some(true);
    e.add(claim("admin", vec![admin]));
    e.prepare("s").await.unwrap();
    let d = e.prepare("admin").await.unwrap();
    assert_eq!(d[0].consumed, None);
    assert_eq!(d[0].sharing, Sharing::Exclusive);
    let spec = std::fs::read_to_string(e.spec("admin")).unwrap();
    assert!(!spec.contains("CUDA_MPS"), "{spec}");
}

/// What a share asks of the SMs is a cap (`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`): from its
/// config's `defaultActiveThreadPercentage` when set, else the smallest percentage covering the
/// multiprocessors it asked for (132 on an H100).
#[tokio::test]
async fn a_shares_sm_cap_comes_from_its_config_or_the_multiprocessors_it_asked() {
    let e = env("dgx-h100").await;
    let _host = e.mps_host();
    let pct = |uid: &str| {
        let spec = std::fs::read_to_string(e.spec(uid)).unwrap();
        spec.lines()
            .find_map(|l| {
                l.split("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=")
                    .nth(1)
                    .map(|v| v.trim_matches(|c: char| !c.is_ascii_digit()).to_string())
            })
            .unwrap_or_default()
    };
    e.add(claim("sms", vec![share_sms("nb", "gpu-4", "16Gi", "33")]));
    let d = e.prepare("sms").await.unwrap();
    assert_eq!(d[0].consumed.unwrap().multiprocessors, Some(33));
    assert_eq!(pct("sms"), "25");

    e.add(claim_with(
        "cfg",
        vec![share("nb", "gpu-4", "16Gi")],
        vec![mps_config(
            serde_json::json!({"defaultActiveThreadPercentage": 40}),
        )],
    ));
    e.prepare("cfg").await.unwrap();
    assert_eq!(pct("cfg"), "40");

    // The config wins over the asked SMs.
    e.add(claim_with(
        "both",
        vec![share_sms("nb", "gpu-4", "16Gi", "33")],
        vec![mps_config(
            serde_json::json!({"defaultActiveThreadPercentage": 60}),
        )],
    ));
    e.prepare("both").await.unwrap();
    assert_eq!(pct("both"), "60");
    // The node checks memory only: asked SMs are the scheduler's to count (it would not place
    // these three together) and the node's to cap, so three asking 100 of 132 each still fit.
    for uid in ["x1", "x2", "x3"] {
        e.add(claim(uid, vec![share_sms("nb", "gpu-5", "8Gi", "100")]));
        e.prepare(uid).await.unwrap();
        assert_eq!(pct(uid), "76");
    }
}

#[tokio::test]
async fn shares_that_cannot_be_enforced_are_refused_with_the_reason() {
    let e = env("dgx-h100").await;
    let _host = e.mps_host();
    let cases: Vec<(
        &str,
        Vec<DeviceRequestAllocationResult>,
        Vec<DeviceAllocationConfiguration>,
        &str,
    )> = vec![
        (
            "b",
            vec![share("nb", "gpu-0", "1Gi")],
            vec![],
            "less than the smallest share the GPU publishes (1672Mi",
        ),
        (
            "c",
            vec![share("nb", "gpu-0", "lots")],
            vec![],
            "consumed memory \"lots\" is not a quantity of bytes",
        ),
        (
            "d",
            vec![share("a", "gpu-0", "4Gi"), share("b", "gpu-1", "4Gi")],
            vec![],
            "one claim's shares must be of one GPU",
        ),
        (
            "e",
            vec![share("nb", "gpu-0", "4Gi")],
            vec![opaque(
                &[],
                serde_json::json!({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig", "sharing": {"strategy": "TimeSlicing"}}),
            )],
            "sharing.strategy: TimeSlicing cannot apply to a share of a GPU",
        ),
        (
            "f",
            vec![share("nb", "gpu-0", "4Gi")],
            vec![mps_config(
                serde_json::json!({"defaultPinnedDeviceMemoryLimit": "2Gi"}),
            )],
            "invalid device configuration of resource claim default/claim-f, request nb: \
             sharing.mpsConfig.defaultPinnedDeviceMemoryLimit: 2Gi is below the 4Gi of memory \
             the share is guaranteed",
        ),
        (
            "f2",
            vec![share("nb", "gpu-0", "4Gi")],
            vec![mps_config(
                serde_json::json!({"defaultPinnedDeviceMemoryLimit": "81Gi"}),
            )],
            "invalid device configuration of resource claim default/claim-f2, request nb: \
             sharing.mpsConfig.defaultPinnedDeviceMemoryLimit: 81Gi is more than the GPU's 80Gi \
             of memory",
        ),
        (
            "f3",
            vec![share("nb", "gpu-0", "4Gi")],
            vec![mps_config(
                serde_json::json!({"defaultPinnedDeviceMemoryLimit": "lots"}),
            )],
            "invalid device configuration of resource claim default/claim-f3, request nb: claim \
             config #0: sharing.mpsConfig.defaultPinnedDeviceMemoryLimit: invalid quantity \
             \"lots\"",
        ),
        (
            "f4",
            vec![share("nb", "gpu-0", "4Gi")],
            vec![mps_config(
                serde_json::json!({"defaultPerDevicePinnedMemoryLimit": {"0": "8Gi"}}),
            )],
            "sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit: a share's memory is what it \
             consumes",
        ),
        (
            "g",
            vec![share("a", "gpu-0", "4Gi"), share("b", "gpu-0", "4Gi")],
            vec![],
            "the claim already has an allocation of it (request a)",
        ),
        (
            "h",
            vec![share_sms("nb", "gpu-0", "4Gi", "1.5")],
            vec![],
            "consumed multiprocessors \"1.5\" is not a whole number of SMs",
        ),
    ];
    for (uid, results, config, want) in cases {
        e.add(claim_with(uid, results, config));
        let err = crate::report::chain(&e.prepare(uid).await.unwrap_err()).to_string();
        assert!(err.contains(want), "{uid}: {err}");
        assert_eq!(e.state(uid), None, "{uid}");
        assert!(!e.spec(uid).exists(), "{uid}");
    }
    assert!(mps_log(&e).is_empty(), "no daemon for refused shares");
}

#[tokio::test]
async fn a_restart_brings_the_gpus_daemon_back_for_its_shares() {
    let e = env("dgx-h100").await;
    let _host = e.mps_host();
    e.add(claim("s", vec![share("nb", "gpu-2", "8Gi")]));
    e.prepare("s").await.unwrap();
    let gpu = e.sim.snapshot().unwrap().gpus[2].uuid.clone();
    let pipe = e.plugin.inner.mps.gpu_pipe_dir(&gpu);
    // The node rebooted: the MPS root (a tmpfs) is empty.
    std::fs::remove_dir_all(pipe.parent().unwrap()).unwrap();
    let (p, rec, _stop) = e.restart(e.sim.clone()).await;
    assert!(rec.failed.is_empty(), "{rec:?}");
    assert!(
        p.inner.mps.gpu_requested(&gpu),
        "asked for again for the share"
    );
    mps::tests::eventually("the host starts it again", || {
        mps_log(&e)
            .iter()
            .filter(|l| l.starts_with("start"))
            .count()
            == 2
    });
    assert!(p.inner.mps.alive_gpu(&gpu));
}

/// Where the driver partitions GPU memory per cgroup (MPS v3 memory partitioning: the backend
/// answers `nvmlDeviceGetMemoryLimits_v1`), the plugin installs its binary and a share's spec
/// carries the hooks that set its soft and hard limit on its container's own cgroup through the
/// driver's NVML library, beside the per-process limit (`src/cdi/memlimit.rs`;
/// `tests/integration/cdi_podman.rs` runs the hook under runc). Where it does not, the spec has no
/// hook and the share is held per process.
#[tokio::test]
async fn where_the_driver_partitions_memory_a_shares_limits_cover_its_container() {
    let e = env("dgx-h100").await;
    let _host = e.mps_host();
    let gpu = e.sim.snapshot().unwrap().gpus[2].clone();
    let cgroups = e.dir.path().join("driver/sys/fs/cgroup");
    std::fs::create_dir_all(&cgroups).unwrap();
    std::fs::write(cgroups.join("cgroup.controllers"), "cpu memory\n").unwrap();
    let nvml = e
        .dir
        .path()
        .join("driver/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.615.10.01");
    std::fs::create_dir_all(nvml.parent().unwrap()).unwrap();
    std::fs::write(&nvml, "NVML").unwrap();
    // The plugin looks at start: a node's driver and kernel do not change under it.
    e.sim.set_memory_limits(true);
    let (p, rec, _stop) = e.restart(e.sim.clone()).await;
    assert!(rec.failed.is_empty(), "{rec:?}");
    e.add(claim("s", vec![share("nb", "gpu-2", "8Gi")]));
    let mut r = p.prepare(vec![cref("s")]).await;
    r.pop().unwrap().1.unwrap();

    let hook = e.dir.path().join("plugin/bin/nvdra");
    assert!(hook.is_file(), "nvdra's binary is installed as the hook");
    let spec = std::fs::read_to_string(e.spec("s")).unwrap();
    let limit = crate::ledger::shares::cuda_limit(8 << 30, gpu.memory_bytes);
    // The hooks' arguments, in order: YAML lists them one per line.
    let args = |release: bool| {
        let mut lines = vec![
            format!("path: {}", hook.display()),
            "args:".into(),
            "- nvdra".into(),
            "- memory-limit-hook".into(),
        ];
        if release {
            lines.push("- --release".into());
        }
        lines.extend([
            "- --nvml".into(),
            format!("- {}", nvml.display()),
            "- --cgroup-root".into(),
            format!("- {}", cgroups.display()),
            // Soft and hard: what the scheduler counted, not the per-process limit.
            format!("- {}={}:{}", gpu.uuid.as_str(), 8u64 << 30, 8u64 << 30),
        ]);
        lines
    };
    let lines: Vec<&str> = spec.lines().map(str::trim).collect();
    for (point, release) in [("createRuntime", false), ("poststop", true)] {
        let mut want = vec![format!("- hookName: {point}")];
        want.extend(args(release));
        assert!(
            lines.windows(want.len()).any(|w| w == want),
            "no {point} hook with {want:#?} in:\n{spec}"
        );
    }
    assert!(
        spec.contains(&format!(
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0={}M",
            limit >> 20
        )),
        "{spec}"
    );
    // Which limit holds it, as /metrics says (nvdra_share_enforcement).
    let uid = |u: &str| ClaimUid::parse(u).unwrap();
    assert_eq!(p.share_levels(), BTreeMap::from([(uid("s"), "container")]));

    // A driver without partitioning: no hook, the per-process limit alone, said so.
    e.sim.set_memory_limits(false);
    let (p, rec, _stop) = e.restart(e.sim.clone()).await;
    assert!(rec.failed.is_empty(), "{rec:?}");
    e.add(claim("t", vec![share("nb", "gpu-2", "8Gi")]));
    let mut r = p.prepare(vec![cref("t")]).await;
    r.pop().unwrap().1.unwrap();
    let spec = std::fs::read_to_string(e.spec("t")).unwrap();
    assert!(!spec.contains("memory-limit-hook"), "{spec}");
    assert!(spec.contains("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="), "{spec}");
    // Start-up rewrote "s"'s spec for this driver: both are limited per process now.
    assert_eq!(
        p.share_levels(),
        BTreeMap::from([(uid("s"), "process"), (uid("t"), "process")])
    );
    let mut r = p.unprepare(vec![cref("t")]).await;
    r.pop().unwrap().1.unwrap();
    assert_eq!(p.share_levels(), BTreeMap::from([(uid("s"), "process")]));

    // The driver's dmem backend (the root cgroup lists NVIDIA regions): the hard limit only, as
    // a soft one (dmem.min) could not be cleared when the container's cgroup goes.
    std::fs::write(
        cgroups.join("dmem.capacity"),
        format!("nvidia/{}/vidmem {}\n", gpu.pci_bus_id, gpu.memory_bytes),
    )
    .unwrap();
    e.sim.set_memory_limits(true);
    let (p, rec, _stop) = e.restart(e.sim.clone()).await;
    assert!(rec.failed.is_empty(), "{rec:?}");
    e.add(claim("u", vec![share("nb", "gpu-2", "8Gi")]));
    let mut r = p.prepare(vec![cref("u")]).await;
    r.pop().unwrap().1.unwrap();
    let spec = std::fs::read_to_string(e.spec("u")).unwrap();
    assert!(
        spec.contains(&format!("- {}=0:{}", gpu.uuid.as_str(), 8u64 << 30)),
        "{spec}"
    );
}

/// A burstable share (NVIDIA's `defaultPinnedDeviceMemoryLimit` on a share): the node packs it
/// by what it consumes, its container's soft limit is that and its hard limit the burst, its
/// per-process limit is the burst less its part of what MPS takes, and the burst survives a
/// restart that rewrites its spec from the checkpoint. On the GPU whole the field keeps
/// NVIDIA's meaning: the claim's own daemon's per-client limit, as given.
#[tokio::test]
async fn a_burstable_share_is_soft_at_what_it_consumes_and_hard_at_its_burst() {
    let e = env("dgx-h100").await;
    let _host = e.mps_host();
    let gpu = e.sim.snapshot().unwrap().gpus[2].clone();
    // The driver partitions memory (as in the test above): the spec carries the NVML hook.
    let cgroups = e.dir.path().join("driver/sys/fs/cgroup");
    std::fs::create_dir_all(&cgroups).unwrap();
    std::fs::write(cgroups.join("cgroup.controllers"), "cpu memory\n").unwrap();
    let nvml = e
        .dir
        .path()
        .join("driver/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.615.10.01");
    std::fs::create_dir_all(nvml.parent().unwrap()).unwrap();
    std::fs::write(&nvml, "NVML").unwrap();
    e.sim.set_memory_limits(true);
    let (p, rec, _stop) = e.restart(e.sim.clone()).await;
    assert!(rec.failed.is_empty(), "{rec:?}");
    let prepare = |p: &Plugin, uid: &str| {
        let p = p.clone();
        let uid = uid.to_string();
        async move { p.prepare(vec![cref(&uid)]).await.pop().unwrap().1 }
    };

    // 24Gi that may burst to 40Gi, then 56Gi beside it: 80Gi counted, so both fit.
    e.add(claim_with(
        "b",
        vec![share("nb", "gpu-2", "24Gi")],
        vec![mps_config(
            serde_json::json!({"defaultPinnedDeviceMemoryLimit": "40Gi"}),
        )],
    ));
    let d = prepare(&p, "b").await.unwrap();
    let consumed = d[0].consumed.unwrap();
    assert_eq!(
        (consumed.memory, consumed.burst_limit),
        (24 << 30, Some(40 << 30))
    );
    e.add(claim("rest", vec![share("nb", "gpu-2", "56Gi")]));
    prepare(&p, "rest").await.unwrap();

    let limits = |uid: &str| {
        let spec = std::fs::read_to_string(e.spec(uid)).unwrap();
        let hook: Vec<String> = spec
            .lines()
            .map(|l| l.trim().trim_start_matches("- ").to_string())
            .filter(|l| l.starts_with(&format!("{}=", gpu.uuid.as_str())))
            .collect();
        let process = spec
            .lines()
            .find_map(|l| l.split("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=").nth(1))
            .map(|v| v.trim_matches(|c| c == '"' || c == '\'').to_string());
        (hook, process)
    };
    // Soft 24Gi, hard 40Gi on the container (the createRuntime and poststop hooks); per process,
    // 40Gi less its part of the MPS server's reserve: 40960 MiB × 79/80.
    let hard = format!("{}={}:{}", gpu.uuid.as_str(), 24u64 << 30, 40u64 << 30);
    let want = (vec![hard.clone(), hard], Some("0=40448M".to_string()));
    assert_eq!(limits("b"), want);
    let fixed = format!("{}={}:{}", gpu.uuid.as_str(), 56u64 << 30, 56u64 << 30);
    assert_eq!(
        limits("rest"),
        (vec![fixed.clone(), fixed], Some("0=56627M".to_string()))
    );

    // The spec is rewritten at start from the checkpoint, with the burst.
    std::fs::remove_file(e.spec("b")).unwrap();
    let (_p, rec, _stop) = e.restart(e.sim.clone()).await;
    assert!(rec.failed.is_empty(), "{rec:?}");
    assert_eq!(limits("b"), want);

    // The GPU whole, with MPS: NVIDIA's per-client limit of the claim's own daemon, as given.
    e.add(claim_with(
        "w",
        vec![result("nb", "gpu-3")],
        vec![mps_config(
            serde_json::json!({"defaultPinnedDeviceMemoryLimit": "40Gi"}),
        )],
    ));
    let d = prepare(&_p, "w").await.unwrap();
    assert_eq!(d[0].consumed, None);
    let spec = std::fs::read_to_string(e.spec("w")).unwrap();
    assert!(
        spec.contains("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=40960M")
            && !spec.contains("memory-limit-hook"),
        "{spec}"
    );
}

/// A pod `name` (UID `pod-<name>`) whose containers run as `users` (`None`: no runAsUser), the
/// pod itself as `pod_user`.
pub(super) fn pod(
    name: &str,
    pod_user: Option<i64>,
    users: &[Option<i64>],
) -> k8s_openapi::api::core::v1::Pod {
    use k8s_openapi::api::core::v1::{
        Container, Pod, PodSecurityContext, PodSpec, SecurityContext,
    };
    Pod {
        metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
            name: Some(name.into()),
            namespace: Some("default".into()),
            uid: Some(format!("pod-{name}")),
            ..Default::default()
        },
        spec: Some(PodSpec {
            security_context: Some(PodSecurityContext {
                run_as_user: pod_user,
                ..Default::default()
            }),
            containers: users
                .iter()
                .enumerate()
                .map(|(i, u)| Container {
                    name: format!("c{i}"),
                    security_context: Some(SecurityContext {
                        run_as_user: *u,
                        ..Default::default()
                    }),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }),
        ..Default::default()
    }
}

impl Env {
    /// Adds `pod` and a share claim `uid` of `memory` of `device` reserved for it.
    pub(super) fn add_share_for(
        &self,
        uid: &str,
        device: &str,
        memory: &str,
        p: k8s_openapi::api::core::v1::Pod,
    ) {
        let name = p.metadata.name.clone().unwrap();
        let mut c = claim(uid, vec![share("nb", device, memory)]);
        c.status.as_mut().unwrap().reserved_for = Some(vec![
            k8s_openapi::api::resource::v1::ResourceClaimConsumerReference {
                resource: "pods".into(),
                name: name.clone(),
                uid: format!("pod-{name}"),
                ..Default::default()
            },
        ]);
        lock(&self.api.pods).insert(("default".into(), name), p);
        self.add(c);
    }
}

/// Before Volta, MPS has no multi-user mode: a client of another user than the running
/// server's waits until that server ends. Such a share is refused, naming both users; from
/// Volta on (multi-user daemons) users mix.
#[tokio::test]
async fn before_volta_a_share_for_another_user_is_refused_naming_both() {
    let e = env("dgx-h100").await;
    let _host = e.mps_host();
    e.sim
        .update(|inv| inv.gpus[1].cuda_compute_capability.major = 6); // a Pascal GPU
    e.reread().await;
    e.add_share_for("a", "gpu-1", "8Gi", pod("nb-a", Some(1000), &[None]));
    e.add_share_for("b", "gpu-1", "8Gi", pod("nb-b", None, &[Some(2000)]));
    e.add_share_for(
        "c",
        "gpu-1",
        "8Gi",
        pod("nb-c", Some(0), &[Some(1000), Some(1000)]),
    );
    e.add_share_for(
        "d",
        "gpu-1",
        "8Gi",
        pod("nb-d", Some(1000), &[None, Some(2000)]),
    );
    e.add_share_for("v1", "gpu-0", "8Gi", pod("nb-v1", Some(1000), &[None]));
    e.add_share_for("v2", "gpu-0", "8Gi", pod("nb-v2", Some(2000), &[None]));

    e.prepare("a").await.unwrap();
    let recorded = e
        .plugin
        .ledger()
        .read(|c| c.claims.get(&ClaimUid::parse("a").unwrap()).unwrap().user);
    assert_eq!(recorded, Some(crate::ledger::ShareUser::Uid(1000)));
    let err = e.prepare("b").await.unwrap_err().to_string();
    for part in [
        "gpu-1",
        "for uid 2000",
        "run as uid 1000",
        "claim default/claim-a (a)",
    ] {
        assert!(err.contains(part), "{part} missing: {err}");
    }
    // The containers' own runAsUser wins over the pod's.
    e.prepare("c").await.unwrap();
    let err = e.prepare("d").await.unwrap_err().to_string();
    assert!(
        err.contains("different users (uid 1000: c0; uid 2000: c1)"),
        "{err}"
    );
    // Volta and later: multi-user daemons, no check (and no pod read).
    e.prepare("v1").await.unwrap();
    e.prepare("v2").await.unwrap();
    assert_eq!(
        e.plugin
            .ledger()
            .read(|c| c.claims.get(&ClaimUid::parse("v2").unwrap()).unwrap().user),
        None
    );
    // Once the other user's shares end, the GPU takes the new user.
    e.unprepare("a").await.unwrap();
    e.unprepare("c").await.unwrap();
    let gpu = e.sim.snapshot().unwrap().gpus[1].uuid.clone();
    let dir = e.plugin.inner.mps.gpu_pipe_dir(&gpu);
    mps::tests::eventually("the host removes the released daemon", || {
        !dir.parent().unwrap().exists()
    });
    e.prepare("b").await.unwrap();

    // A pod that is not the one the claim is reserved for (replaced under the same name).
    let mut replaced = pod("nb-e", Some(2000), &[None]);
    e.add_share_for("e", "gpu-1", "8Gi", replaced.clone());
    replaced.metadata.uid = Some("pod-nb-e-2".into());
    lock(&e.api.pods).insert(("default".into(), "nb-e".into()), replaced);
    let err = e.prepare("e").await.unwrap_err().to_string();
    assert!(
        err.contains("is not the one the claim is reserved for"),
        "{err}"
    );
}
