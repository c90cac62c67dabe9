//! `nvdra demo` end to end: the real daemon on simulated GPUs, driven by the demo's kubelet.

use std::process::Command;

#[test]
fn the_demo_runs_the_whole_flow_and_cleans_up() {
    let out = Command::new(env!("CARGO_BIN_EXE_nvdra"))
        .arg("demo")
        .env_remove("NVDRA_LOG")
        .output()
        .expect("run nvdra demo");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");

    // Registration answered with both DRA versions.
    assert!(
        stdout.contains("DRAPlugin plugin \"gpu.nvidia.com\""),
        "{stdout}"
    );
    assert!(
        stdout.contains("\"v1.DRAPlugin\", \"v1beta1.DRAPlugin\""),
        "{stdout}"
    );
    // Eight H100s published once each, allocatable whole or in shares (--shared-capacity),
    // and in every MIG placement (--dynamic-mig): 1 + 25 devices each.
    assert!(
        stdout.contains("with 208 devices for pool demo-node"),
        "{stdout}"
    );
    assert!(
        stdout.contains("8 of them allocatable whole or in shares by memory"),
        "{stdout}"
    );
    assert!(
        stdout.contains("gpu-0: NVIDIA H100 80GB HBM3 80Gi"),
        "{stdout}"
    );
    // The claim that cannot fit is explained device by device.
    assert!(
        stdout.lines().any(|l| {
            let l = l.trim();
            l.starts_with("gpu-7 ") && l.ends_with(" selectors[0]: memory 80Gi < 100Gi")
        }),
        "{stdout}"
    );
    assert!(
        stdout.contains("(200 MIG placements left out: class gpu.nvidia.com wants type \"gpu\")"),
        "{stdout}"
    );
    assert!(
        !(0..8).any(|i| stdout.contains(&format!("gpu-{i}-shared"))),
        "no twins: {stdout}"
    );
    assert!(
        stdout.contains("not satisfiable: request gpus needs 2 devices, 0 fit"),
        "{stdout}"
    );
    // Prepare returned CDI ids and applied the time slice through the backend.
    assert!(
        stdout.contains("gpu-1 -> k8s.gpu.nvidia.com/claim=uid-train-gpu-1"),
        "{stdout}"
    );
    assert!(stdout.contains("NVIDIA_VISIBLE_DEVICES=void"), "{stdout}");
    assert!(
        stdout.contains("GPU device nodes: /dev/nvidia0, /dev/nvidia1"),
        "{stdout}"
    );
    assert!(stdout.contains("time slice Short on GPU-"), "{stdout}");
    // The double allocation was refused with the reason, then allowed after unprepare.
    assert!(
        stdout.contains("device gpu-0 is already prepared for claim demo/train"),
        "{stdout}"
    );
    assert!(stdout.contains("demo/notebook gets gpu-0"), "{stdout}");
    // Two pods share gpu-0 by memory: allocated as nvdra match allocates, prepared with one MPS
    // daemon for the GPU and each claim's pinned memory limit in its CDI spec.
    for n in [1, 2] {
        assert!(
            stdout.contains(&format!(
                "demo/gpu-share-20gi-{n} -> gpu-0 (memory 20Gi, multiprocessors 0)"
            )),
            "{stdout}"
        );
    }
    // A third share may burst to 40Gi: packed by its 20Gi beside them (60Gi of 80Gi counted).
    assert!(
        stdout.contains(
            "demo/gpu-share-burst -> gpu-0 (memory 20Gi, multiprocessors 0, may burst to 40Gi)"
        ),
        "{stdout}"
    );
    let limits: Vec<&str> = stdout
        .lines()
        .filter_map(|l| l.split("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=").nth(1))
        .collect();
    assert_eq!(limits.len(), 3, "{stdout}");
    assert!(
        // 20Gi × (80Gi − 1Gi) / 80Gi: the share's part of what MPS itself takes is left out.
        limits[..2]
            .iter()
            .all(|l| l.contains("0=20224M (20Gi less") && l.ends_with("no SM cap")),
        "{stdout}"
    );
    // The burstable share's per-process limit is its burst, less the same part: 40Gi × 79/80.
    assert!(
        limits[2].starts_with("0=40448M (its 40Gi burst limit") && limits[2].ends_with("no SM cap"),
        "{stdout}"
    );
    assert!(
        stdout.contains("One MPS control daemon serves the GPU's shares (start GPU-"),
        "{stdout}"
    );
    assert!(
        stdout.contains("the MPS host has the daemon quit"),
        "{stdout}"
    );
    // Any shape on demand: the last H100 whole, then two MIG devices (mode on, two instances),
    // refused whole while they run, whole again after (mode off), beside a share of gpu-0.
    assert!(
        stdout.contains("demo/notebook-share (memory 20Gi) -> gpu-0, shared by memory"),
        "{stdout}"
    );
    assert!(
        stdout.contains("demo/train-whole -> gpu-7: prepared whole, MIG mode off"),
        "{stdout}"
    );
    assert!(
        stdout.contains("demo/infer-3g -> gpu-7-mig-3g40gb-9-0: prepared as")
            && stdout.contains("demo/infer-1g -> gpu-7-mig-1g10gb-19-"),
        "{stdout}"
    );
    let recorded: Vec<&str> = stdout
        .lines()
        .filter(|l| l.contains("the simulated GPU recorded: "))
        .collect();
    assert_eq!(recorded.len(), 2, "{stdout}");
    assert!(
        recorded[0].contains("MIG mode on on GPU-")
            && recorded[0].matches(" created on ").count() == 2,
        "{stdout}"
    );
    assert!(
        recorded[1].matches(" destroyed on ").count() == 2
            && recorded[1].contains("MIG mode off on GPU-"),
        "{stdout}"
    );
    assert!(
        stdout.contains("gpu-7 is not offered whole while it has MIG devices"),
        "{stdout}"
    );
    assert!(
        stdout.contains("demo/train-whole -> gpu-7: prepared whole again"),
        "{stdout}"
    );
    assert!(stdout.contains("shut down cleanly"), "{stdout}");
    // The injected fault: the health stream says why, the slice keeps the device, tainted.
    assert!(stdout.contains("gpu-3 Unhealthy: XID 79"), "{stdout}");
    assert!(
        stdout.contains("gpu-3 stays listed, tainted gpu.nvidia.com/xid=79 effect NoSchedule"),
        "{stdout}"
    );
    // The legacy path: the device plugin registered with the demo's kubelet, listed the eight
    // GPUs and allocated one by UUID.
    assert!(
        stdout.contains("nvdra registers \"nvidia.com/gpu\""),
        "{stdout}"
    );
    assert!(
        stdout.contains("ListAndWatch: 8 devices, 8 healthy"),
        "{stdout}"
    );
    assert!(
        stdout.contains("is allocated GPU-") && stdout.contains(": NVIDIA_VISIBLE_DEVICES=GPU-"),
        "{stdout}"
    );

    // The working directory is gone afterwards.
    let dir = stdout
        .lines()
        .find_map(|l| l.trim().strip_prefix("working directory: "))
        .expect("the demo names its directory");
    assert!(!std::path::Path::new(dir).exists(), "{dir} left behind");
}
