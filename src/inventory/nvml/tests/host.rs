//! Host tests: PCIe roots and NUMA from sysfs, NVML error classes, opening without a driver.

use super::*;

#[test]
fn pcie_roots_come_from_the_first_pci_component() {
    let root = |p: &str| pcie_root_of(Path::new(p));
    assert_eq!(
        root("../../../devices/pci0000:00/0000:00:01.0/0000:07:00.0").as_deref(),
        Some("pci0000:00")
    );
    // Behind a VMD domain the outer root complex is the one that matters.
    assert_eq!(
        root("/sys/devices/pci0000:64/0000:64:00.5/pci10000:00/10000:00:02.0/10000:01:00.0")
            .as_deref(),
        Some("pci0000:64")
    );
    assert_eq!(root("../../../devices/platform/0000:07:00.0"), None);
    assert_eq!(root("../../../devices/pcizz:00/0000:07:00.0"), None);
    assert_eq!(root("../../../devices/pci0000:0/0000:07:00.0"), None);
}

#[test]
fn numa_text_parses_and_minus_one_is_none() {
    assert_eq!(parse_numa("1\n"), Some(1));
    assert_eq!(parse_numa("-1\n"), None);
    assert_eq!(parse_numa(""), None);
}

#[test]
fn host_sysfs_reads_links_and_numa_from_a_real_tree() {
    let dir = tempfile::tempdir().unwrap();
    let dev = dir
        .path()
        .join("devices/pci0000:80/0000:80:01.0/0000:87:00.0");
    std::fs::create_dir_all(&dev).unwrap();
    std::fs::write(dev.join("numa_node"), "1\n").unwrap();
    let bus_dir = dir.path().join("bus/pci/devices");
    std::fs::create_dir_all(&bus_dir).unwrap();
    std::os::unix::fs::symlink(
        "../../../devices/pci0000:80/0000:80:01.0/0000:87:00.0",
        bus_dir.join("0000:87:00.0"),
    )
    .unwrap();
    let sysfs = HostSysfs::new(dir.path());
    let inv = map(node(vec![h100(0, "00000000:87:00.0")]), &sysfs).unwrap();
    assert_eq!(inv.gpus[0].pcie_root.as_deref(), Some("pci0000:80"));
    assert_eq!(inv.gpus[0].numa_node, Some(1));
    // A device sysfs does not know: None, not an error.
    let inv = map(node(vec![h100(0, "0000:99:00.0")]), &sysfs).unwrap();
    assert_eq!(
        (inv.gpus[0].pcie_root.clone(), inv.gpus[0].numa_node),
        (None, None)
    );
}

#[test]
fn nvml_errors_classify() {
    assert_eq!(
        CallError::from(NvmlError::NotSupported),
        CallError::NotSupported
    );
    assert_eq!(CallError::from(NvmlError::NotFound), CallError::NotFound);
    assert!(matches!(
        CallError::from(NvmlError::FailedToLoadSymbol("x".into())),
        CallError::Missing(_)
    ));
    assert!(matches!(
        CallError::from(NvmlError::GpuLost),
        CallError::Failed(s) if s.contains("lost") || s.contains("bus")
    ));
}

/// Whether this machine has an NVIDIA kernel driver, judged without NVML: the driver creates
/// `/dev/nvidiactl` (on the host and in a container given GPUs). The two `open_*` tests expect
/// exactly one outcome each way: no driver (CI, laptops) means `NvmlMissing`, a driver means a
/// backend that reads real GPUs.
fn has_nvidia_driver() -> bool {
    Path::new("/dev/nvidiactl").exists()
}

/// Opening NVML without a driver must say what is missing and what to do; with one, a real
/// snapshot must map.
#[test]
fn open_without_a_driver_names_the_library_and_the_way_out() {
    let opened = NvmlBackend::open(Path::new("/"));
    if has_nvidia_driver() {
        let backend = opened.expect("NVML opens on a machine with the NVIDIA driver");
        let inv = backend.snapshot().expect("snapshot on a machine with NVML");
        for g in &inv.gpus {
            assert!(g.uuid.as_str().starts_with("GPU-"), "{g:?}");
            assert!(!g.cuda_driver_version.is_empty());
        }
        return;
    }
    match opened {
        Err(e @ Error::NvmlMissing { .. }) => {
            let msg = e.to_string();
            assert!(msg.contains("libnvidia-ml.so.1"), "{msg}");
            assert!(msg.contains("--backend simulated"), "{msg}");
        }
        Err(other) => panic!("without a driver, expected NvmlMissing, got: {other}"),
        Ok(_) => panic!("NVML opened on a machine without /dev/nvidiactl"),
    }
}

#[test]
fn open_reports_each_library_it_tried_under_the_driver_root() {
    let root = tempfile::tempdir().unwrap();
    let lib_dir = root.path().join("usr/lib64");
    std::fs::create_dir_all(&lib_dir).unwrap();
    std::fs::write(lib_dir.join(LIBRARY), b"not an ELF file").unwrap();
    let opened = NvmlBackend::open(root.path());
    if has_nvidia_driver() {
        // The system library loads after the broken one under the driver root failed.
        assert!(opened.is_ok(), "{:?}", opened.err());
        return;
    }
    match opened {
        Err(e @ Error::NvmlMissing { .. }) => {
            let msg = e.to_string();
            assert!(
                msg.contains(&lib_dir.join(LIBRARY).display().to_string()),
                "{msg}"
            );
            assert!(msg.contains("--backend simulated"), "{msg}");
        }
        Err(other) => panic!("without a driver, expected NvmlMissing, got: {other}"),
        Ok(_) => panic!("NVML opened on a machine without /dev/nvidiactl"),
    }
}
