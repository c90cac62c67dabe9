//! Fabric tests: which NVLink fabric registrations are kept, and the struct versions.

use super::*;

fn fabric_of(state: FabricState, status: RawResult<()>, uuid: [u8; 16]) -> RawResult<RawFabric> {
    Ok(RawFabric {
        cluster_uuid: uuid,
        clique_id: 32766,
        state,
        status,
    })
}

const CLUSTER: [u8; 16] = [
    0x6c, 0x1f, 0x3a, 0x52, 0x8d, 0x2e, 0x4b, 0x7a, 0x9f, 0x10, 0x01, 0x23, 0x45, 0x67, 0x89, 0xab,
];

#[test]
fn only_completed_successful_fabric_registrations_are_kept() {
    let cases: Vec<(RawResult<RawFabric>, Option<Level>)> = vec![
        (fabric_of(FabricState::Completed, Ok(()), CLUSTER), None),
        (
            fabric_of(FabricState::InProgress, Ok(()), CLUSTER),
            Some(Level::INFO),
        ),
        (
            fabric_of(FabricState::NotStarted, Ok(()), [0; 16]),
            Some(Level::INFO),
        ),
        (
            fabric_of(FabricState::NotSupported, Ok(()), [0; 16]),
            Some(Level::DEBUG),
        ),
        (
            fabric_of(
                FabricState::Completed,
                Err(CallError::Failed("insufficient resources".into())),
                CLUSTER,
            ),
            Some(Level::WARN),
        ),
        (
            fabric_of(FabricState::Completed, Ok(()), [0; 16]),
            Some(Level::DEBUG),
        ),
        (
            fabric_of(FabricState::Other(9), Ok(()), CLUSTER),
            Some(Level::WARN),
        ),
        (Err(CallError::NotSupported), Some(Level::DEBUG)),
        (
            Err(CallError::Missing("nvmlDeviceGetGpuFabricInfo".into())),
            Some(Level::DEBUG),
        ),
        (
            Err(CallError::Failed("gpu is lost".into())),
            Some(Level::WARN),
        ),
        // In transition (NVIDIA's issue 1264): the call or the status answers not ready.
        (Err(CallError::NotReady), Some(Level::INFO)),
        (
            fabric_of(FabricState::Completed, Err(CallError::NotReady), CLUSTER),
            Some(Level::INFO),
        ),
    ];
    let gpus: Vec<RawGpu> = cases
        .iter()
        .enumerate()
        .map(|(i, (f, _))| {
            let mut g = h100(i as u32, &format!("0000:{:02x}:00.0", 0x10 + i));
            g.fabric = f.clone();
            g
        })
        .collect();
    let (inv, omissions) = map_with_omissions(node(gpus), &MapSysfs::default()).unwrap();
    let f = inv.gpus[0].fabric.as_ref().expect("completed registration");
    assert_eq!(
        f.cluster_uuid.as_str(),
        "6c1f3a52-8d2e-4b7a-9f10-0123456789ab"
    );
    assert_eq!(f.clique_id, 32766);
    for (i, (_, level)) in cases.iter().enumerate().skip(1) {
        assert_eq!(inv.gpus[i].fabric, None, "case {i}");
        let note = omissions
            .iter()
            .find(|o| o.gpu_index == i as u32 && o.field == "fabric");
        assert_eq!(note.map(|o| o.level), *level, "case {i}: {note:?}");
    }
    assert!(!omissions.iter().any(|o| o.gpu_index == 0));
    let failed = omissions
        .iter()
        .find(|o| o.gpu_index == 4 && o.field == "fabric")
        .unwrap();
    assert!(
        failed.reason.contains("insufficient resources"),
        "{}",
        failed.reason
    );
    for i in [1, 2, 10, 11] {
        let note = omissions
            .iter()
            .find(|o| o.gpu_index == i && o.field == "fabric")
            .unwrap();
        assert!(
            note.reason.contains("in transition"),
            "case {i}: {}",
            note.reason
        );
    }
}

#[test]
fn nvml_not_ready_is_a_transition_not_a_failure() {
    use nvml_wrapper::error::NvmlError;
    let not_ready = nvml_wrapper_sys::bindings::nvmlReturn_enum_NVML_ERROR_NOT_READY;
    assert_eq!(
        CallError::from(NvmlError::from(not_ready)),
        CallError::NotReady
    );
}

#[test]
fn fabric_struct_versions_match_nvml_h() {
    // NVML_STRUCT_VERSION(GpuFabricInfo, v) = sizeof(nvmlGpuFabricInfo_v<v>_t) | v << 24.
    assert_eq!(ffi::FABRIC_INFO_V3, 40 | (3 << 24));
    assert_eq!(ffi::FABRIC_INFO_V2, 36 | (2 << 24));
}
