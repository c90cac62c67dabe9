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
    // Eight H100s published once each, allocatable whole or in shares (--shared-capacity).
    assert!(
        stdout.contains("with 8 devices for pool demo-node"),
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
        stdout.contains("gpu-7  selectors[0]: memory 80Gi < 100Gi"),
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
    let limits: Vec<&str> = stdout
        .lines()
        .filter_map(|l| l.split("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=").nth(1))
        .collect();
    assert_eq!(limits.len(), 2, "{stdout}");
    assert!(
        // 20Gi × (80Gi − 1Gi) / 80Gi: the share's part of what MPS itself takes is left out.
        limits
            .iter()
            .all(|l| l.contains("0=20224M (20Gi less") && l.ends_with("no SM cap")),
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
