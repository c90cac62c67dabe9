//! Per-cgroup GPU memory limits (MPS v3 memory partitioning) on the fake NVML: its
//! `nvmlDeviceSetMemoryLimits_v1` and `nvmlDeviceGetMemoryLimits_v1` through nvdra's raw calls,
//! and the backend's probe. In this process the fake serves its default node with the default
//! (working) limits.

mod support;

use nvdra::inventory::nvml::memory_limits::{memory_limits, set_memory_limits};
use nvdra::inventory::nvml::{LIBRARY, NvmlBackend};
use nvdra::inventory::{DeviceBackend, GpuUuid, MEMORY_LIMIT_MAX, MemoryLimits};
use nvml_wrapper::Nvml;
use nvml_wrapper::error::NvmlError;

const GIB: u64 = 1 << 30;

/// The fake's default node: GPU 1 is a whole A100 (MIG off), GPU 0 an A100 with MIG devices.
fn gpu(index: usize) -> String {
    fake_nvml::model::a100_l40s()[index].uuid.clone()
}

fn nvml() -> Nvml {
    Nvml::builder()
        .lib_path(support::fake_nvml::library().as_os_str())
        .init()
        .unwrap()
}

#[test]
fn the_fake_keeps_limits_per_gpu_and_cgroup_as_nvml_documents() {
    let nvml = nvml();
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    std::fs::create_dir_all(&a).unwrap();
    std::fs::create_dir_all(&b).unwrap();
    let whole = nvml.device_by_uuid(gpu(1)).unwrap();
    let limits = MemoryLimits {
        soft: 8 * GIB,
        hard: 12 * GIB,
    };

    // No limit: soft 0, hard NVML_DEVICE_MEMORY_LIMIT_MAX.
    let (read, used) = memory_limits(&nvml, &whole, &a).unwrap();
    assert_eq!(read, MemoryLimits::NONE);
    assert_eq!((read.hard, used), (MEMORY_LIMIT_MAX, 0));

    set_memory_limits(&nvml, &whole, &a, limits).unwrap();
    assert_eq!(memory_limits(&nvml, &whole, &a).unwrap().0, limits);
    assert_eq!(
        memory_limits(&nvml, &whole, &b).unwrap().0,
        MemoryLimits::NONE,
        "per cgroup"
    );
    let other = nvml.device_by_uuid(gpu(2)).unwrap();
    assert_eq!(
        memory_limits(&nvml, &other, &a).unwrap().0,
        MemoryLimits::NONE,
        "per GPU"
    );
    // Cleared as NVML documents: soft 0, hard max.
    set_memory_limits(&nvml, &whole, &a, MemoryLimits::NONE).unwrap();
    assert_eq!(
        memory_limits(&nvml, &whole, &a).unwrap().0,
        MemoryLimits::NONE
    );

    // A cgroup that is not there.
    let gone = dir.path().join("gone");
    assert!(matches!(
        set_memory_limits(&nvml, &whole, &gone, limits),
        Err(NvmlError::NotFound)
    ));
    assert!(matches!(
        memory_limits(&nvml, &whole, &gone),
        Err(NvmlError::NotFound)
    ));
    // A soft limit above the hard one.
    let inverted = MemoryLimits {
        soft: 2 * GIB,
        hard: GIB,
    };
    assert!(matches!(
        set_memory_limits(&nvml, &whole, &a, inverted),
        Err(NvmlError::InvalidArg)
    ));
    // "MIG handles are not supported."
    let parent = nvml.device_by_uuid(gpu(0)).unwrap();
    let mig = parent.mig_device_by_index(0).unwrap();
    assert!(matches!(
        set_memory_limits(&nvml, &mig, &a, limits),
        Err(NvmlError::NotSupported)
    ));
    assert!(matches!(
        memory_limits(&nvml, &mig, &a),
        Err(NvmlError::NotSupported)
    ));
}

/// The plugin's question, through the NVML backend: the fake's driver answers for a whole GPU.
#[test]
fn the_backend_asks_whether_a_gpu_is_partitioned() {
    let root = tempfile::tempdir().unwrap();
    let lib = root.path().join("usr/lib64");
    std::fs::create_dir_all(&lib).unwrap();
    std::os::unix::fs::symlink(support::fake_nvml::library(), lib.join(LIBRARY)).unwrap();
    let backend = NvmlBackend::open(root.path()).unwrap();
    let cgroup = tempfile::tempdir().unwrap();
    assert_eq!(
        backend
            .memory_limits(&GpuUuid(gpu(1)), cgroup.path())
            .unwrap(),
        MemoryLimits::NONE
    );
    let e = backend
        .memory_limits(&GpuUuid("GPU-nope".into()), cgroup.path())
        .unwrap_err();
    assert!(e.to_string().contains("GPU-nope"), "{e}");
}
