//! NVIDIA's `unlimited` and integer consumable-share modes (`--consumable-shares`) at prepare:
//! every allocation with a `shareID` is a share under the GPU's MPS daemon, held per process to
//! what the mode allows, and the GPU goes to `EXCLUSIVE_PROCESS` as for `memory` shares.

use super::shares::share;
use super::*;
use crate::inventory::ComputeMode;
use crate::ledger::{Consumed, Shares};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

/// A plugin in share `mode` on a dgx-h100 (80Gi, 132 SMs per GPU).
async fn env_in(mode: &str) -> Env {
    env_with(mode, false).await
}

/// [`env_in`], on a node whose driver partitions memory per cgroup (MPS v3) when `partitions`.
async fn env_with(mode: &str, partitions: bool) -> Env {
    let dir = tempfile::tempdir().unwrap();
    let api = Arc::new(FakeApi::default());
    let sim = SimBackend::from_profile("dgx-h100", NODE).unwrap();
    if partitions {
        partitioning_driver(dir.path(), &sim);
    }
    let mode: ConsumableShares = mode.parse().unwrap();
    let (plugin, _, stop) = start_with(dir.path(), api.clone(), sim.clone(), |o| {
        o.shared_capacity = mode;
    })
    .await;
    Env {
        plugin,
        api,
        sim,
        dir,
        _stop: stop,
    }
}

/// A driver root under `root` whose driver partitions memory per cgroup, as
/// `where_the_driver_partitions_memory_a_shares_limits_cover_its_container` sets one up.
fn partitioning_driver(root: &std::path::Path, sim: &SimBackend) {
    let cgroups = root.join("driver/sys/fs/cgroup");
    std::fs::create_dir_all(&cgroups).unwrap();
    std::fs::write(cgroups.join("cgroup.controllers"), "cpu memory\n").unwrap();
    let nvml = root.join("driver/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.615.10.01");
    std::fs::create_dir_all(nvml.parent().unwrap()).unwrap();
    std::fs::write(&nvml, "NVML").unwrap();
    sim.set_memory_limits(true);
}

/// An allocation as the scheduler makes one on a GPU of `unlimited` or integer mode: a shareID
/// and every published capacity filled in (`consumed`: name and quantity).
fn allocated(
    request: &str,
    device: &str,
    consumed: &[(&str, &str)],
) -> DeviceRequestAllocationResult {
    DeviceRequestAllocationResult {
        consumed_capacity: Some(
            consumed
                .iter()
                .map(|(k, v)| (k.to_string(), Quantity(v.to_string())))
                .collect(),
        ),
        ..share(request, device, "0")
    }
}

fn spec_of(e: &Env, uid: &str) -> String {
    std::fs::read_to_string(e.spec(uid)).unwrap()
}

/// NVIDIA's `unlimited-sharing.yaml`: claims that ask for nothing consume no memory and all
/// share the GPU's MPS daemon, each client without a memory limit; one that asks for memory is
/// held to it. The GPU is in `EXCLUSIVE_PROCESS` while they run, as for `memory` shares, and
/// back after the last.
#[tokio::test]
async fn unlimited_shares_run_under_the_gpus_daemon_limited_only_by_what_they_ask() {
    let e = env_in("unlimited").await;
    let _host = e.mps_host();
    let gpu = e.sim.snapshot().unwrap().gpus[0].uuid.clone();
    let nothing = [("memory", "0"), ("multiprocessors", "0")];
    e.add(claim("a", vec![allocated("gpu", "gpu-0", &nothing)]));
    e.add(claim("b", vec![allocated("gpu", "gpu-0", &nothing)]));
    e.add(claim(
        "c",
        vec![allocated(
            "gpu",
            "gpu-0",
            &[("memory", "16Gi"), ("multiprocessors", "33")],
        )],
    ));
    for uid in ["a", "b", "c"] {
        let d = e.prepare(uid).await.unwrap();
        assert!(d[0].consumed.is_some(), "{uid}: a share");
    }
    assert_eq!(
        e.plugin
            .inner
            .ledger
            .read(|c| c.claims[&ClaimUid::parse("a").unwrap()].devices[0].consumed),
        Some(Consumed {
            memory: 0,
            multiprocessors: None,
            shares: None,
            burst_limit: None,
        })
    );
    let pipe = e.plugin.inner.mps.gpu_pipe_dir(&gpu);
    for uid in ["a", "b"] {
        let spec = spec_of(&e, uid);
        assert!(
            spec.contains(pipe.to_str().unwrap()),
            "{uid}: the GPU's daemon: {spec}"
        );
        assert!(
            spec.contains("CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps"),
            "{spec}"
        );
        assert!(
            !spec.contains("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"),
            "{uid}: no memory limit: {spec}"
        );
        assert!(
            !spec.contains("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"),
            "{uid}: no SM cap: {spec}"
        );
    }
    let spec = spec_of(&e, "c");
    // 16Gi less its part of the MPS server's reserve: 16384 MiB × 79/80; 33 of 132 SMs: 25%.
    assert!(
        spec.contains("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=16179M"),
        "{spec}"
    );
    assert!(
        spec.contains("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25"),
        "{spec}"
    );
    assert_eq!(
        e.sim.compute_mode(&gpu).unwrap(),
        ComputeMode::ExclusiveProcess,
        "a process that misses the daemon fails instead of running beside the shares"
    );
    for uid in ["a", "b", "c"] {
        e.unprepare(uid).await.unwrap();
    }
    assert!(!e.plugin.inner.mps.gpu_requested(&gpu));
    assert_eq!(e.sim.compute_mode(&gpu).unwrap(), ComputeMode::Default);
}

/// In `unlimited` mode the scheduler does not bound claims that ask for nothing; the node
/// refuses the share beyond the clients one MPS server serves per GPU, naming the cause.
#[tokio::test]
async fn unlimited_shares_stop_at_the_clients_mps_serves() {
    let e = env_in("unlimited").await;
    let _host = e.mps_host();
    let nothing = [("memory", "0"), ("multiprocessors", "0")];
    let max = crate::ledger::shares::MAX_SHARES as usize;
    for i in 0..=max {
        e.add(claim(
            &format!("u{i}"),
            vec![allocated("gpu", "gpu-3", &nothing)],
        ));
    }
    for i in 0..max {
        e.prepare(&format!("u{i}")).await.unwrap();
    }
    let err = e.prepare(&format!("u{max}")).await.unwrap_err();
    assert!(
        matches!(
            err,
            ClaimError::TooManyShares {
                shares: 49,
                max: 48,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("GPU gpu-3 ("), "{err}");
    assert_eq!(e.state(&format!("u{max}")), None, "nothing recorded");
    e.unprepare("u0").await.unwrap();
    e.prepare(&format!("u{max}")).await.unwrap();
}

/// NVIDIA's `integer-sharing.yaml` with `--consumable-shares=4`: each claim consumes 1 share by
/// default and is held to its part of the GPU, a quarter of the memory and of the SMs; one of
/// 2 shares gets half; one that also asks for memory is held to that memory.
#[tokio::test]
async fn integer_shares_are_held_to_their_part_of_the_gpu() {
    let e = env_in("4").await;
    let _host = e.mps_host();
    let gpu = e.sim.snapshot().unwrap().gpus[1].uuid.clone();
    let one = [("memory", "0"), ("multiprocessors", "0"), ("shares", "1")];
    e.add(claim("q", vec![allocated("gpu", "gpu-1", &one)]));
    e.add(claim(
        "h",
        vec![allocated(
            "gpu",
            "gpu-1",
            &[("memory", "0"), ("multiprocessors", "0"), ("shares", "2")],
        )],
    ));
    e.add(claim(
        "m",
        vec![allocated(
            "gpu",
            "gpu-1",
            &[("memory", "8Gi"), ("multiprocessors", "0"), ("shares", "1")],
        )],
    ));
    for uid in ["q", "h", "m"] {
        e.prepare(uid).await.unwrap();
    }
    let record = |uid: &str| {
        e.plugin
            .inner
            .ledger
            .read(|c| c.claims[&ClaimUid::parse(uid).unwrap()].devices[0].consumed)
            .unwrap()
    };
    assert_eq!(record("q").shares, Some(Shares { count: 1, of: 4 }));
    assert_eq!(record("h").shares, Some(Shares { count: 2, of: 4 }));
    // A quarter of 80Gi is 20480 MiB, less its part of the server's reserve: × 79/80.
    let q = spec_of(&e, "q");
    assert!(
        q.contains("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=20224M"),
        "{q}"
    );
    assert!(q.contains("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25"), "{q}");
    let h = spec_of(&e, "h");
    assert!(
        h.contains("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=40448M"),
        "{h}"
    );
    assert!(h.contains("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50"), "{h}");
    let m = spec_of(&e, "m");
    assert!(
        m.contains("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=8089M"),
        "{m}"
    );
    assert!(m.contains("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25"), "{m}");
    let pipe = e.plugin.inner.mps.gpu_pipe_dir(&gpu);
    for spec in [&q, &h, &m] {
        assert!(spec.contains(pipe.to_str().unwrap()), "one daemon: {spec}");
    }
    assert_eq!(
        e.sim.compute_mode(&gpu).unwrap(),
        ComputeMode::ExclusiveProcess
    );
}

/// Allocations the node cannot hold to the mode are refused with what to do: more shares than
/// the GPU publishes, shares outside integer mode, a count that is no whole number, memory
/// above the GPU.
#[tokio::test]
async fn allocations_against_other_slices_are_refused() {
    let e = env_in("4").await;
    e.add(claim(
        "five",
        vec![allocated(
            "gpu",
            "gpu-0",
            &[("memory", "0"), ("shares", "5")],
        )],
    ));
    e.add(claim(
        "half",
        vec![allocated(
            "gpu",
            "gpu-0",
            &[("memory", "0"), ("shares", "1.5")],
        )],
    ));
    e.add(claim(
        "big",
        vec![allocated(
            "gpu",
            "gpu-0",
            &[("memory", "81Gi"), ("shares", "1")],
        )],
    ));
    let err = e.prepare("five").await.unwrap_err().to_string();
    assert!(
        err.contains("it consumes 5 shares, more than the 4 the GPU publishes"),
        "{err}"
    );
    assert!(
        err.contains("delete the pod so the scheduler places it again"),
        "{err}"
    );
    let err = e.prepare("half").await.unwrap_err().to_string();
    assert!(
        err.contains("consumed shares \"1.5\" is not a whole number"),
        "{err}"
    );
    let err = e.prepare("big").await.unwrap_err().to_string();
    assert!(
        err.contains("it consumes 81Gi of the GPU's memory, more than the GPU publishes (80Gi)"),
        "{err}"
    );

    let e = env_in("unlimited").await;
    e.add(claim(
        "n",
        vec![allocated(
            "gpu",
            "gpu-0",
            &[("memory", "0"), ("shares", "1")],
        )],
    ));
    let err = e.prepare("n").await.unwrap_err().to_string();
    assert!(
        err.contains("it consumes shares (1), but GPUs publish shares only with --consumable-shares=<N>, and this node runs --consumable-shares=unlimited"),
        "{err}"
    );
}

/// Where all of the memory is not the GPU whole (`unlimited` and integer mode), an allocation
/// without `memory` in its `consumedCapacity` is a share at the default, 0, not the GPU whole
/// as in `memory` mode; without a `shareID` it is the GPU whole in every mode.
#[tokio::test]
async fn the_modes_differ_in_what_an_allocation_without_memory_is() {
    for (mode, shared) in [("memory", false), ("unlimited", true), ("4", true)] {
        let e = env_in(mode).await;
        let _host = e.mps_host();
        e.add(claim("d", vec![allocated("gpu", "gpu-2", &[])]));
        let d = e.prepare("d").await.unwrap();
        assert_eq!(d[0].consumed.is_some(), shared, "{mode}");
        if mode == "4" {
            assert_eq!(
                d[0].consumed.unwrap().shares,
                Some(Shares { count: 1, of: 4 }),
                "the policy's default"
            );
        }
        e.add(claim("p", vec![result("gpu", "gpu-5")]));
        assert_eq!(e.prepare("p").await.unwrap()[0].consumed, None, "{mode}");
    }
}

/// Where the driver partitions memory per cgroup, an integer share's container gets its part of
/// the GPU as its soft and hard limit, as a `memory` share gets what it consumed; an `unlimited`
/// share that asked for no memory gets no limit at all. The record keeps the share's part, so a
/// spec rewritten after a restart (here into a plugin of another N) holds it to the same limits.
#[tokio::test]
async fn container_limits_follow_the_mode_and_survive_a_restart() {
    let e = env_with("4", true).await;
    let _host = e.mps_host();
    let gpu = e.sim.snapshot().unwrap().gpus[4].uuid.clone();
    let one = [("memory", "0"), ("multiprocessors", "0"), ("shares", "1")];
    e.add(claim("q", vec![allocated("gpu", "gpu-4", &one)]));
    e.prepare("q").await.unwrap();
    let quarter = 20u64 << 30;
    let limits = format!("- {}={quarter}:{quarter}", gpu.as_str());
    let spec = spec_of(&e, "q");
    assert!(spec.contains("- memory-limit-hook"), "{spec}");
    assert!(
        spec.lines().any(|l| l.trim() == limits),
        "{limits} in:\n{spec}"
    );
    assert!(
        spec.contains("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=20224M"),
        "{spec}"
    );

    // Lost (the CDI directory is a tmpfs on some nodes) and rewritten at start-up.
    std::fs::remove_file(e.spec("q")).unwrap();
    let (_p, rec, _stop) = start_with(e.dir.path(), e.api.clone(), e.sim.clone(), |o| {
        o.shared_capacity = "8".parse().unwrap();
    })
    .await;
    assert!(rec.failed.is_empty(), "{rec:?}");
    let again = spec_of(&e, "q");
    assert!(
        again.lines().any(|l| l.trim() == limits),
        "{limits} in:\n{again}"
    );
    assert!(
        again.contains("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=20224M"),
        "{again}"
    );
    assert!(
        again.contains("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25"),
        "{again}"
    );

    let e = env_with("unlimited", true).await;
    let _host = e.mps_host();
    e.add(claim(
        "u",
        vec![allocated(
            "gpu",
            "gpu-4",
            &[("memory", "0"), ("multiprocessors", "0")],
        )],
    ));
    e.add(claim(
        "m",
        vec![allocated(
            "gpu",
            "gpu-4",
            &[("memory", "8Gi"), ("multiprocessors", "0")],
        )],
    ));
    e.prepare("u").await.unwrap();
    e.prepare("m").await.unwrap();
    let spec = spec_of(&e, "u");
    assert!(
        !spec.contains("memory-limit-hook"),
        "held to nothing: {spec}"
    );
    let eight = 8u64 << 30;
    let spec = spec_of(&e, "m");
    assert!(
        spec.lines()
            .any(|l| l.trim() == format!("- {}={eight}:{eight}", gpu.as_str())),
        "{spec}"
    );
}
