//! The NVML backend end to end against `tests/fake-nvml`, a fake `libnvidia-ml.so` with a fixed
//! three-GPU node: library loading under a driver root, every NVML call `read_raw` makes
//! (including the raw MIG and NVLink calls), and the mapping to an `Inventory`.

use std::path::PathBuf;

use nvdra::inventory::nvml::{self, CallError, LIBRARY, NvmlBackend, RemoteDevice};
use nvdra::inventory::{DeviceBackend, NvLinkPeer, Placement};

/// The fake library cargo built for this test: `fake-nvml` is a dev-dependency, so its cdylib
/// lands in `target/<profile>/deps` beside this test binary (or one level up when built alone).
fn fake_library() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let deps = exe
        .parent()
        .expect("test binary lives in target/<profile>/deps");
    let candidates = [
        deps.join("libfake_nvml.so"),
        deps.parent()
            .map_or_else(PathBuf::new, |p| p.join("libfake_nvml.so")),
    ];
    candidates
        .iter()
        .find(|p| p.exists())
        .cloned()
        .unwrap_or_else(|| panic!("libfake_nvml.so is missing from {candidates:?}"))
}

/// A driver root whose `usr/lib64/libnvidia-ml.so.1` is the fake, and a sysfs tree placing the
/// two A100s under `pci0000:00` (NUMA 0) and the L40S under `pci0000:80` (NUMA 1).
struct Node {
    driver_root: tempfile::TempDir,
    sysfs: tempfile::TempDir,
}

fn fake_node() -> Node {
    let driver_root = tempfile::tempdir().unwrap();
    let lib_dir = driver_root.path().join("usr/lib64");
    std::fs::create_dir_all(&lib_dir).unwrap();
    std::os::unix::fs::symlink(fake_library(), lib_dir.join(LIBRARY)).unwrap();

    let sysfs = tempfile::tempdir().unwrap();
    let devices = sysfs.path().join("bus/pci/devices");
    std::fs::create_dir_all(&devices).unwrap();
    for (bus, root, numa) in [
        ("0000:07:00.0", "pci0000:00", "0"),
        ("0000:0f:00.0", "pci0000:00", "0"),
        ("0000:b1:00.0", "pci0000:80", "1"),
    ] {
        let rel = format!("devices/{root}/{root}-port/{bus}");
        let dir = sysfs.path().join(&rel);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("numa_node"), format!("{numa}\n")).unwrap();
        std::os::unix::fs::symlink(format!("../../../{rel}"), devices.join(bus)).unwrap();
    }
    Node { driver_root, sysfs }
}

fn open(node: &Node) -> NvmlBackend {
    NvmlBackend::open(node.driver_root.path())
        .expect("the fake NVML under the driver root loads")
        .with_sysfs_root(node.sysfs.path())
}

#[test]
fn read_raw_captures_every_answer_including_failures() {
    let node = fake_node();
    let backend = open(&node);
    let raw = nvml::read_raw(backend.nvml()).unwrap();
    assert_eq!(raw.driver_version.as_deref(), Ok("550.163.01"));
    assert_eq!(raw.cuda_driver_version, Ok(12040));
    assert_eq!(raw.gpus.len(), 3);
    assert!(raw.unreadable.is_empty());

    let a100 = &raw.gpus[0];
    assert_eq!(a100.pci_bus_id.as_deref(), Ok("00000000:07:00.0"));
    assert_eq!(a100.memory_total_bytes, Ok(40960 << 20));
    assert_eq!(
        a100.attributes.as_ref().err(),
        Some(&CallError::NotSupported)
    );
    // The fake does not export nvmlDeviceGetNumaNodeId, like a driver older than the call.
    assert!(
        matches!(a100.numa_node, Err(CallError::Missing(_))),
        "{:?}",
        a100.numa_node
    );
    // Seven supported profiles out of NVML's 17 indices, each with its placements (read through
    // the raw two-call protocol).
    let profiles: Vec<(u32, u32, usize)> = a100
        .gi_profiles
        .iter()
        .map(|p| {
            (
                p.profile,
                p.info.id,
                p.placements.as_ref().map_or(0, Vec::len),
            )
        })
        .collect();
    assert_eq!(
        profiles,
        [
            (0, 19, 7),
            (1, 14, 3),
            (2, 9, 2),
            (3, 5, 1),
            (4, 0, 1),
            (7, 20, 7),
            (9, 15, 4)
        ]
    );
    // MIG slots 0 and 2 are filled, slot 1 is empty (NotFound) and skipped.
    let slots: Vec<(u32, Result<u32, CallError>)> = a100
        .mig_devices
        .iter()
        .map(|m| (m.slot, m.gi_id.clone()))
        .collect();
    assert_eq!(slots, [(0, Ok(1)), (2, Ok(7))]);
    let gi = a100.mig_devices[1].gpu_instance.clone().unwrap();
    assert_eq!(gi.profile_id, 19);
    assert_eq!(gi.placement, Placement { start: 6, size: 1 });
    // 12 active links, then InvalidArg for links 12..18 is not an error.
    assert_eq!(a100.nvlinks.len(), 12);
    assert_eq!(
        a100.nvlinks[7].remote_pci_bus_id.as_deref(),
        Ok("00000000:02:00.0")
    );
    assert_eq!(a100.nvlinks[7].remote_type, Ok(RemoteDevice::Switch));

    let l40s = &raw.gpus[2];
    assert_eq!(l40s.mig_mode, Err(CallError::NotSupported));
    assert!(l40s.gi_profiles.is_empty() && l40s.mig_devices.is_empty());
    assert!(l40s.nvlinks.is_empty());
}

#[test]
fn snapshot_of_the_fake_node() {
    let node = fake_node();
    let backend = open(&node);
    assert_eq!(backend.name(), "nvml");
    let inv = backend.snapshot().unwrap();
    assert_eq!(inv.gpus.len(), 3);

    let g0 = &inv.gpus[0];
    assert_eq!(g0.product_name, "NVIDIA A100-SXM4-40GB");
    assert_eq!(
        (g0.brand.as_str(), g0.architecture.as_str()),
        ("Nvidia", "Ampere")
    );
    assert_eq!(g0.cuda_compute_capability.to_string(), "8.0");
    assert_eq!(
        (g0.driver_version.as_str(), g0.cuda_driver_version.as_str()),
        ("550.163.01", "12.4")
    );
    assert_eq!(g0.pci_bus_id.as_str(), "0000:07:00.0");
    assert_eq!(g0.pcie_root.as_deref(), Some("pci0000:00"));
    assert_eq!(g0.numa_node, Some(0));
    assert_eq!(g0.memory_bytes, 40 << 30);
    assert_eq!(g0.multiprocessors, 108);
    assert_eq!(g0.nvlink_peers.len(), 6);
    assert!(
        g0.nvlink_peers
            .contains(&NvLinkPeer::Switch("0000:01:00.0".into()))
    );

    assert!(g0.in_mig_mode());
    assert_eq!(g0.mig.memory_slices, 8);
    let profiles: Vec<&str> = g0.mig.profiles.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(
        profiles,
        [
            "1g.5gb",
            "2g.10gb",
            "3g.20gb",
            "4g.20gb",
            "7g.40gb",
            "1g.5gb+me",
            "1g.10gb"
        ]
    );
    let devices: Vec<(&str, &str, u32, u32, u32, u64)> = g0
        .mig
        .devices
        .iter()
        .map(|d| {
            (
                d.uuid.as_str(),
                d.profile.as_str(),
                d.gi_profile_id,
                d.gi_id,
                d.placement.start,
                d.memory_bytes >> 20,
            )
        })
        .collect();
    assert_eq!(
        devices,
        [
            (
                "MIG-f00d0000-0000-5000-8000-000000000001",
                "3g.20gb",
                9,
                1,
                0,
                19968
            ),
            (
                "MIG-f00d0000-0000-5000-8000-000000000007",
                "1g.5gb",
                19,
                7,
                6,
                4864
            ),
        ]
    );
    assert_eq!(g0.mig.devices[0].multiprocessors, 42);

    let g1 = &inv.gpus[1];
    assert!(g1.mig.capable && !g1.mig.enabled && g1.mig.devices.is_empty());

    let g2 = &inv.gpus[2];
    assert_eq!((g2.index, g2.minor), (2, 5));
    assert_eq!(g2.architecture, "Ada Lovelace");
    assert_eq!(g2.multiprocessors, 142);
    assert_eq!(
        (g2.pcie_root.as_deref(), g2.numa_node),
        (Some("pci0000:80"), Some(1))
    );
    assert!(!g2.mig.capable);

    // The A100s share the NVSwitch fabric; the L40S is on its own.
    let domains: Vec<u32> = inv.gpus.iter().map(|g| g.nvlink_domain).collect();
    assert_eq!(domains, [0, 0, 2]);
}
