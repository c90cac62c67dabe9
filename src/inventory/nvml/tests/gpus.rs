//! GPU tests: omissions logged once, missing or optional facts, node versions, duplicates.

use super::*;

#[test]
fn omissions_are_logged_once_per_gpu_and_field_while_they_last() {
    let log = OmissionLog::default();
    let o = |gpu: &str, field, reason: &str| Omission {
        gpu_index: 0,
        gpu: GpuUuid(gpu.into()),
        field,
        reason: reason.into(),
        level: Level::WARN,
    };
    let first = [
        o("GPU-a", "multiprocessors", "x"),
        o("GPU-b", "multiprocessors", "x"),
    ];
    assert_eq!(log.log_new(&first).len(), 2);
    assert_eq!(log.log_new(&first).len(), 0, "the same gaps again: silent");
    let changed = [
        o("GPU-a", "multiprocessors", "y"),
        o("GPU-b", "multiprocessors", "x"),
    ];
    let logged = log.log_new(&changed);
    assert_eq!(logged.len(), 1, "a new reason is news");
    assert_eq!(logged[0].gpu.as_str(), "GPU-a");
    // GPU-b's value appeared, then went missing again: logged again.
    assert_eq!(log.log_new(&changed[..1]).len(), 0);
    assert_eq!(log.log_new(&changed).len(), 1);
}

#[test]
fn missing_numa_and_pcie_root_are_none_not_errors() {
    let inv = map(node(vec![h100(0, "0000:07:00.0")]), &MapSysfs::default()).unwrap();
    assert_eq!(inv.gpus[0].numa_node, None);
    assert_eq!(inv.gpus[0].pcie_root, None);

    // No sysfs entry, but NVML knows the node (a coherent platform): use NVML's.
    let mut g = h100(0, "0000:07:00.0");
    g.numa_node = Ok(3);
    let inv = map(node(vec![g.clone()]), &MapSysfs::default()).unwrap();
    assert_eq!(inv.gpus[0].numa_node, Some(3));

    // Sysfs says -1 (no NUMA): that wins over NVML, and a link without a root gives no root.
    let mut sysfs = MapSysfs::default();
    sysfs.numa.insert("0000:07:00.0".into(), "-1\n".into());
    sysfs.links.insert(
        "0000:07:00.0".into(),
        "../../../devices/platform/0000:07:00.0".into(),
    );
    let inv = map(node(vec![g]), &sysfs).unwrap();
    assert_eq!(inv.gpus[0].numa_node, None);
    assert_eq!(inv.gpus[0].pcie_root, None);
}

#[test]
fn gpus_without_identity_are_skipped_others_kept() {
    let mut no_uuid = h100(1, "0000:08:00.0");
    no_uuid.uuid = Err(CallError::Failed("gpu is lost".into()));
    let mut bad_bus = h100(2, "0000:09:00.0");
    bad_bus.pci_bus_id = Ok("not-a-bus-id".into());
    let mut no_memory = h100(3, "0000:0a:00.0");
    no_memory.memory_total_bytes = Err(CallError::Failed("gpu is lost".into()));
    let mut raw = node(vec![h100(0, "0000:07:00.0"), no_uuid, bad_bus, no_memory]);
    raw.unreadable
        .push((4, CallError::Failed("insufficient permissions".into())));
    let inv = map(raw, &MapSysfs::default()).unwrap();
    let indices: Vec<u32> = inv.gpus.iter().map(|g| g.index).collect();
    assert_eq!(indices, [0]);
}

#[test]
fn optional_gpu_facts_degrade() {
    let mut g = h100(0, "0000:07:00.0");
    g.brand = Err(CallError::Failed("unexpected enum variant 99".into()));
    g.architecture = Ok(DeviceArchitecture::Unknown);
    g.compute_capability = Ok(ComputeCapability {
        major: 10,
        minor: 0,
    });
    g.cuda_cores = Err(CallError::NotSupported);
    let mut h = h100(1, "0000:08:00.0");
    h.architecture = Err(CallError::Missing("nvmlDeviceGetArchitecture".into()));
    h.attributes = Ok(attrs(132, 0, 0, 0, 0, 81559));
    h.cuda_cores = Err(CallError::NotSupported);
    let mut k = h100(2, "0000:09:00.0");
    k.brand = Ok(Brand::Unknown);
    k.architecture = Ok(DeviceArchitecture::Unknown);
    k.compute_capability = Ok(ComputeCapability { major: 2, minor: 0 });
    let (inv, omissions) = map_with_omissions(node(vec![g, h, k]), &MapSysfs::default()).unwrap();
    assert_eq!(inv.gpus[0].brand, None, "a failed call publishes no brand");
    assert_eq!(
        inv.gpus[0].architecture.as_deref(),
        Some("Blackwell"),
        "from compute capability 10.0"
    );
    assert_eq!(
        inv.gpus[0].multiprocessors, None,
        "no attributes, no cores: omitted, not 0"
    );
    assert_eq!(
        inv.gpus[1].architecture.as_deref(),
        Some("Hopper"),
        "from compute capability 9.0"
    );
    assert_eq!(
        inv.gpus[1].multiprocessors,
        Some(132),
        "from the GPU's attributes"
    );
    assert_eq!(inv.gpus[2].brand, None, "NVML's UNKNOWN brand is no brand");
    assert_eq!(inv.gpus[2].architecture, None, "nothing names it");
    assert_eq!(inv.gpus[2].multiprocessors, None, "no cores per SM for 2.0");
    let noted: Vec<(u32, &str, Level)> = omissions
        .iter()
        .filter(|o| o.field != "fabric")
        .map(|o| (o.gpu_index, o.field, o.level))
        .collect();
    assert_eq!(
        noted,
        [
            (0, "brand", Level::INFO),
            (0, "multiprocessors", Level::WARN),
            (2, "brand", Level::INFO),
            (2, "architecture", Level::INFO),
            (2, "multiprocessors", Level::WARN),
        ]
    );
    let why = &omissions
        .iter()
        .find(|o| o.gpu_index == 0 && o.field == "multiprocessors")
        .unwrap()
        .reason;
    assert!(
        why.contains("nvmlDeviceGetAttributes_v2: not supported")
            && why.contains("nvmlDeviceGetNumGpuCores: not supported"),
        "{why}"
    );
}

#[test]
fn node_versions_are_formatted_and_required() {
    let mut raw = node(vec![h100(0, "0000:07:00.0")]);
    raw.driver_version = Ok(" 570.124.06\n".into());
    raw.cuda_driver_version = Ok(12080);
    let inv = map(raw, &MapSysfs::default()).unwrap();
    assert_eq!(inv.gpus[0].driver_version, "570.124.06");
    assert_eq!(inv.gpus[0].cuda_driver_version, "12.8");

    let mut raw = node(vec![]);
    raw.cuda_driver_version = Err(CallError::Failed("uninitialized".into()));
    let err = map(raw, &MapSysfs::default()).unwrap_err();
    assert!(
        err.to_string().contains("nvmlSystemGetCudaDriverVersion"),
        "{err}"
    );
    let mut raw = node(vec![]);
    raw.cuda_driver_version = Ok(0);
    let err = map(raw, &MapSysfs::default()).unwrap_err();
    assert!(
        err.to_string().contains("invalid CUDA driver version 0"),
        "{err}"
    );
    let mut raw = node(vec![]);
    raw.driver_version = Err(CallError::NotSupported);
    let err = map(raw, &MapSysfs::default()).unwrap_err();
    assert!(
        err.to_string().contains("nvmlSystemGetDriverVersion"),
        "{err}"
    );
}

#[test]
fn cuda_versions_format_like_nvidia_smi() {
    assert_eq!(format_cuda_version(12040).as_deref(), Some("12.4"));
    assert_eq!(format_cuda_version(12080).as_deref(), Some("12.8"));
    assert_eq!(format_cuda_version(13000).as_deref(), Some("13.0"));
    assert_eq!(format_cuda_version(11020).as_deref(), Some("11.2"));
    assert_eq!(format_cuda_version(0), None);
    assert_eq!(format_cuda_version(-1), None);
}

#[test]
fn duplicate_gpus_from_nvml_are_an_error() {
    let a = h100(0, "0000:07:00.0");
    let mut b = h100(1, "0000:08:00.0");
    b.uuid = a.uuid.clone();
    let err = map(node(vec![a, b]), &MapSysfs::default()).unwrap_err();
    assert!(err.to_string().contains("share the uuid"), "{err}");
}
