//! The `data` shape of each kind of prepared device (the README documents these very objects).

use std::collections::BTreeMap;

use serde_json::json;

use super::*;
use crate::ids::DeviceName;
use crate::inventory::{GpuUuid, MigUuid, Placement};
use crate::ledger::shares::Consumed;
use crate::ledger::{DeviceRecord, MigRecord};
use crate::sharing::MpsSettings;

const GPU: &str = "GPU-8a2c0d4e-0000-0000-0000-000000000001";
const MIG: &str = "MIG-5d1f7c9b-0000-0000-0000-000000000002";

fn record(device: &str) -> DeviceRecord {
    DeviceRecord {
        requests: vec!["gpu".into()],
        pool: "node-a".into(),
        device: DeviceName::parse(device).unwrap(),
        cdi_ids: vec![],
        share_id: None,
        admin_access: false,
        gpu: GpuUuid(GPU.into()),
        mig: None,
        consumed: None,
        sharing: Sharing::Exclusive,
    }
}

fn json_of(d: &DeviceRecord, enforcement: Option<&'static str>) -> serde_json::Value {
    serde_json::to_value(device_data(d, 0, None, enforcement)).unwrap()
}

#[test]
fn a_whole_gpu_names_its_uuid() {
    assert_eq!(
        json_of(&record("gpu-0"), None),
        json!({"uuid": GPU, "gpuUUID": GPU, "sharing": "exclusive"})
    );
}

#[test]
fn a_mig_device_names_its_uuid_profile_and_gpu() {
    let mut d = record("gpu-0-mig-1g10gb-19-0");
    d.mig = Some(MigRecord {
        uuid: Some(MigUuid(MIG.into())),
        profile: "1g.10gb".into(),
        gi_profile_id: 19,
        placement: Placement { start: 0, size: 1 },
        created: false,
    });
    d.sharing = Sharing::TimeSlicing {
        interval: TimeSliceInterval::Short,
    };
    assert_eq!(
        json_of(&d, None),
        json!({"uuid": MIG, "gpuUUID": GPU, "migProfile": "1g.10gb",
               "sharing": "timeSlicing", "timeSlice": "Short"})
    );
}

#[test]
fn a_share_says_what_holds_it() {
    let mut d = record("gpu-0");
    d.share_id = Some("3f2a".into());
    d.consumed = Some(Consumed {
        memory: 10 << 30,
        multiprocessors: Some(20),
        shares: None,
        burst_limit: Some(16 << 30),
    });
    d.sharing = Sharing::Mps(MpsSettings {
        active_thread_percentage: Some(16),
        pinned_memory_limit: Some(15 << 30),
        per_device_pinned_memory_limit: BTreeMap::new(),
    });
    assert_eq!(
        json_of(&d, Some("container")),
        json!({
            "uuid": GPU, "gpuUUID": GPU, "sharing": "mps",
            "mps": {"activeThreadPercentage": 16, "pinnedMemoryLimit": 15_u64 << 30},
            "share": {"memory": 10_u64 << 30, "memoryLimit": 16_u64 << 30,
                      "enforcement": "container", "multiprocessors": 20},
        })
    );
    // A per-device limit for this device wins over the claim's default.
    if let Sharing::Mps(s) = &mut d.sharing {
        s.per_device_pinned_memory_limit
            .insert(GPU.into(), 12 << 30);
    }
    assert_eq!(
        json_of(&d, None)["mps"]["pinnedMemoryLimit"],
        json!(12_u64 << 30)
    );
}

#[test]
fn a_mig_device_not_created_yet_has_no_uuid() {
    let mut d = record("gpu-0-mig-1g10gb-19-0");
    d.mig = Some(MigRecord {
        uuid: None,
        profile: "1g.10gb".into(),
        gi_profile_id: 19,
        placement: Placement { start: 0, size: 1 },
        created: true,
    });
    assert!(json_of(&d, None).get("uuid").is_none());
}
