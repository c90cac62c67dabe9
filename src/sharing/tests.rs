use serde_json::json;

use super::*;

fn gpu_config(sharing: serde_json::Value) -> serde_json::Value {
    json!({"apiVersion": API_VERSION, "kind": "GpuConfig", "sharing": sharing})
}

/// An error as nvdra prints it: the message and its sources.
fn chain(e: Error) -> String {
    crate::report::chain(&e).to_string()
}

fn err(v: serde_json::Value) -> String {
    decode(&v).unwrap_err().to_string()
}

#[test]
fn gpu_config_without_sharing_is_exclusive() {
    let c = decode(&json!({"apiVersion": API_VERSION, "kind": "GpuConfig"})).unwrap();
    assert_eq!(
        c,
        DeviceConfig::Gpu {
            sharing: Sharing::Exclusive
        }
    );
}

#[test]
fn gpu_time_slicing_with_and_without_interval() {
    let c = decode(&gpu_config(json!({
        "strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}
    })))
    .unwrap();
    assert_eq!(
        c.sharing(),
        &Sharing::TimeSlicing {
            interval: TimeSliceInterval::Long
        }
    );
    let c = decode(&gpu_config(json!({"strategy": "TimeSlicing"}))).unwrap();
    assert_eq!(
        c.sharing(),
        &Sharing::TimeSlicing {
            interval: TimeSliceInterval::Default
        }
    );
}

#[test]
fn gpu_mps_full_settings() {
    let c = decode(&gpu_config(json!({
        "strategy": "MPS",
        "mpsConfig": {
            "defaultActiveThreadPercentage": 50,
            "defaultPinnedDeviceMemoryLimit": "10Gi",
            "defaultPerDevicePinnedMemoryLimit": {"0": "5Gi", "GPU-abc": 1073741824u64}
        }
    })))
    .unwrap();
    let Sharing::Mps(m) = c.sharing() else {
        panic!("not MPS: {c:?}")
    };
    assert_eq!(m.active_thread_percentage, Some(50));
    assert_eq!(m.pinned_memory_limit, Some(10 << 30));
    assert_eq!(
        m.per_device_pinned_memory_limit,
        BTreeMap::from([("0".to_string(), 5 << 30), ("GPU-abc".to_string(), 1 << 30)])
    );
}

#[test]
fn mps_without_config_has_no_limits() {
    let c = decode(&gpu_config(json!({"strategy": "MPS"}))).unwrap();
    assert_eq!(c.sharing(), &Sharing::Mps(MpsSettings::default()));
}

#[test]
fn mig_configs_decode() {
    let c = decode(
        &json!({"apiVersion": API_VERSION, "kind": "MigDeviceConfig",
        "sharing": {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 25}}}),
    )
    .unwrap();
    assert_eq!(c.kind_name(), "MigDeviceConfig");
    assert_eq!(
        c.sharing(),
        &Sharing::Mps(MpsSettings {
            active_thread_percentage: Some(25),
            ..Default::default()
        })
    );
    let c = decode(
        &json!({"apiVersion": API_VERSION, "kind": "MigDeviceConfig",
        "sharing": {"strategy": "TimeSlicing"}}),
    )
    .unwrap();
    assert_eq!(
        c,
        DeviceConfig::Mig {
            sharing: Sharing::TimeSlicing {
                interval: TimeSliceInterval::Default
            }
        }
    );
}

#[test]
fn wrong_or_missing_api_version_is_rejected() {
    let e = err(json!({"apiVersion": "resource.nvidia.com/v1alpha1", "kind": "GpuConfig"}));
    assert!(e.contains("apiVersion") && e.contains("v1alpha1"), "{e}");
    assert!(e.contains(API_VERSION), "{e}");
    let e = err(json!({"kind": "GpuConfig"}));
    assert!(e.starts_with("apiVersion: missing"), "{e}");
}

#[test]
fn unknown_or_missing_kind_is_rejected() {
    let e = err(json!({"apiVersion": API_VERSION, "kind": "VfioDeviceConfig"}));
    assert!(
        e.contains("VfioDeviceConfig") && e.contains("GpuConfig"),
        "{e}"
    );
    let e = err(json!({"apiVersion": API_VERSION}));
    assert!(e.starts_with("kind: missing"), "{e}");
}

#[test]
fn non_object_parameters_are_rejected() {
    let e = err(json!(["GpuConfig"]));
    assert!(e.contains("JSON object") && e.contains("an array"), "{e}");
}

#[test]
fn unknown_fields_are_named_by_path() {
    let e = err(json!({"apiVersion": API_VERSION, "kind": "GpuConfig", "shring": {}}));
    assert!(e.starts_with("shring: unknown field"), "{e}");
    let e = err(gpu_config(
        json!({"strategy": "MPS", "mpsConfig": {"activeThreads": 5}}),
    ));
    assert!(
        e.starts_with("sharing.mpsConfig.activeThreads: unknown field `activeThreads`"),
        "{e}"
    );
    assert!(e.contains("defaultActiveThreadPercentage"), "{e}");
    let e = err(gpu_config(json!({"strategy": "Exclusive"})));
    assert!(e.starts_with("sharing.strategy: "), "{e}");
    assert!(e.contains("Exclusive"), "{e}");
}

#[test]
fn bad_quantities_are_named_by_path() {
    let e = err(gpu_config(json!({"strategy": "MPS",
        "mpsConfig": {"defaultPinnedDeviceMemoryLimit": "10GB"}})));
    assert!(
        e.starts_with(
            "sharing.mpsConfig.defaultPinnedDeviceMemoryLimit: invalid quantity \"10GB\""
        ),
        "{e}"
    );
    let e = err(gpu_config(json!({"strategy": "MPS",
        "mpsConfig": {"defaultPerDevicePinnedMemoryLimit": {"1": "lots"}}})));
    assert!(
        e.starts_with("sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit.1: invalid quantity"),
        "{e}"
    );
    let e = err(gpu_config(json!({"strategy": "MPS",
        "mpsConfig": {"defaultPinnedDeviceMemoryLimit": "100Ki"}})));
    assert!(e.contains("below the 1Mi minimum"), "{e}");
    let e = err(gpu_config(json!({"strategy": "MPS",
        "mpsConfig": {"defaultPinnedDeviceMemoryLimit": -5}})));
    assert!(e.contains("negative"), "{e}");
}

#[test]
fn bad_per_device_keys_are_rejected() {
    let e = err(gpu_config(json!({"strategy": "MPS",
        "mpsConfig": {"defaultPerDevicePinnedMemoryLimit": {"first": "1Gi"}}})));
    assert!(
        e.starts_with(
            "sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit.first: invalid device key"
        ),
        "{e}"
    );
}

#[test]
fn percentages_outside_1_to_100_are_rejected() {
    for bad in [json!(0), json!(101), json!(-1)] {
        let e = err(gpu_config(json!({"strategy": "MPS",
            "mpsConfig": {"defaultActiveThreadPercentage": bad}})));
        assert!(
            e.starts_with(
                "sharing.mpsConfig.defaultActiveThreadPercentage: must be between 1 and 100"
            ),
            "{e}"
        );
    }
    let e = err(gpu_config(json!({"strategy": "MPS",
        "mpsConfig": {"defaultActiveThreadPercentage": "50%"}})));
    assert!(
        e.starts_with("sharing.mpsConfig.defaultActiveThreadPercentage: "),
        "{e}"
    );
}

#[test]
fn mig_config_rejects_time_slicing_config() {
    let e = err(json!({"apiVersion": API_VERSION, "kind": "MigDeviceConfig",
        "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Short"}}}));
    assert!(
        e.starts_with("sharing.timeSlicingConfig: unknown field `timeSlicingConfig`"),
        "{e}"
    );
}

#[test]
fn strategy_and_sub_config_must_agree() {
    let e = err(gpu_config(
        json!({"strategy": "TimeSlicing", "mpsConfig": {}}),
    ));
    assert!(
        e.starts_with("sharing.mpsConfig: only valid with strategy MPS"),
        "{e}"
    );
    let e = err(gpu_config(
        json!({"strategy": "MPS", "timeSlicingConfig": {}}),
    ));
    assert!(
        e.starts_with("sharing.timeSlicingConfig: only valid"),
        "{e}"
    );
    let e = err(gpu_config(json!({"timeSlicingConfig": {}})));
    assert!(e.contains("strategy"), "{e}");
}

#[test]
fn kind_must_fit_the_device() {
    let gpu = decode(&gpu_config(json!({"strategy": "TimeSlicing"}))).unwrap();
    gpu.check_fits(DeviceKind::Gpu, "gpu-0").unwrap();
    let e = gpu
        .check_fits(DeviceKind::Mig, "gpu-0-mig-1g10gb-19-0")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("GpuConfig cannot configure MIG device gpu-0-mig-1g10gb-19-0")
            && e.contains("MigDeviceConfig"),
        "{e}"
    );
    let mig = decode(&json!({"apiVersion": API_VERSION, "kind": "MigDeviceConfig"})).unwrap();
    assert!(mig.check_fits(DeviceKind::Gpu, "gpu-1").is_err());
    assert_eq!(
        sharing_for(None, DeviceKind::Mig, "x").unwrap(),
        Sharing::Exclusive
    );
    assert!(sharing_for(Some(mig), DeviceKind::Gpu, "gpu-1").is_err());
}

// ------------------------------------------------------------------ precedence

const DRIVER: &str = "gpu.nvidia.com";

fn entry(
    source: ConfigSource,
    requests: &[&str],
    driver: &str,
    p: serde_json::Value,
) -> ConfigEntry {
    ConfigEntry {
        source,
        requests: requests.iter().map(|s| s.to_string()).collect(),
        driver: driver.into(),
        parameters: p,
    }
}

fn ts(interval: &str) -> serde_json::Value {
    gpu_config(json!({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": interval}}))
}

fn interval_of(c: Option<DeviceConfig>) -> Option<TimeSliceInterval> {
    match c?.into_sharing() {
        Sharing::TimeSlicing { interval } => Some(interval),
        other => panic!("unexpected {other:?}"),
    }
}

use ConfigSource::{FromClaim, FromClass};

#[test]
fn claim_configs_override_class_configs_whatever_the_order() {
    // The claim entry comes first in the list, but class configs are applied first.
    let entries = vec![
        entry(FromClaim, &[], DRIVER, ts("Short")),
        entry(FromClass, &[], DRIVER, ts("Long")),
    ];
    let c = config_for(&entries, DRIVER, "gpu").unwrap();
    assert_eq!(interval_of(c), Some(TimeSliceInterval::Short));
}

#[test]
fn later_entries_win_within_a_source() {
    let entries = vec![
        entry(FromClass, &[], DRIVER, ts("Long")),
        entry(FromClass, &[], DRIVER, ts("Medium")),
        entry(FromClaim, &["gpu"], DRIVER, ts("Short")),
        entry(FromClaim, &[], DRIVER, ts("Default")),
    ];
    assert_eq!(
        interval_of(config_for(&entries, DRIVER, "gpu").unwrap()),
        Some(TimeSliceInterval::Default)
    );
    // Without the all-requests claim entry, another request gets the last class entry.
    assert_eq!(
        interval_of(config_for(&entries[..3], DRIVER, "other").unwrap()),
        Some(TimeSliceInterval::Medium)
    );
}

#[test]
fn requests_match_exactly_or_by_base_name() {
    let entries = vec![
        entry(FromClaim, &["gpu"], DRIVER, ts("Short")),
        entry(FromClaim, &["big/h100"], DRIVER, ts("Long")),
    ];
    assert_eq!(
        interval_of(config_for(&entries, DRIVER, "gpu").unwrap()),
        Some(TimeSliceInterval::Short)
    );
    // `gpu` covers its subrequests.
    assert_eq!(
        interval_of(config_for(&entries, DRIVER, "gpu/any").unwrap()),
        Some(TimeSliceInterval::Short)
    );
    assert_eq!(
        interval_of(config_for(&entries, DRIVER, "big/h100").unwrap()),
        Some(TimeSliceInterval::Long)
    );
    // A subrequest entry covers neither its siblings nor a prefix-alike request.
    assert_eq!(config_for(&entries, DRIVER, "big/a100").unwrap(), None);
    assert_eq!(config_for(&entries, DRIVER, "gpus").unwrap(), None);
    assert_eq!(config_for(&entries, DRIVER, "big").unwrap(), None);
}

#[test]
fn other_drivers_are_skipped_and_never_decoded() {
    let entries = vec![
        entry(FromClaim, &[], DRIVER, ts("Short")),
        entry(FromClaim, &[], "net.example.com", json!({"anything": true})),
    ];
    assert_eq!(
        interval_of(config_for(&entries, DRIVER, "gpu").unwrap()),
        Some(TimeSliceInterval::Short)
    );
    assert_eq!(
        config_for(&entries, "other.example.com", "gpu").unwrap(),
        None
    );
}

#[test]
fn decode_errors_name_the_entry_and_source() {
    let entries = vec![
        entry(FromClaim, &[], "net.example.com", json!({})),
        entry(FromClass, &[], DRIVER, ts("Long")),
        entry(
            FromClaim,
            &["gpu"],
            DRIVER,
            gpu_config(json!({"strategy": "MPS",
            "mpsConfig": {"defaultActiveThreadPercentage": 150}})),
        ),
        // A later, valid override does not hide the broken entry.
        entry(FromClaim, &[], DRIVER, ts("Short")),
    ];
    let e = chain(config_for(&entries, DRIVER, "gpu").unwrap_err());
    assert_eq!(
        e,
        "claim config #1: sharing.mpsConfig.defaultActiveThreadPercentage: must be between 1 and 100, got 150"
    );
    // The broken entry does not apply to other requests.
    assert!(config_for(&entries, DRIVER, "other").is_ok());
    let bad_class = vec![entry(FromClass, &[], DRIVER, json!({"kind": "GpuConfig"}))];
    let e = chain(config_for(&bad_class, DRIVER, "gpu").unwrap_err());
    assert!(e.starts_with("class config #0: apiVersion: missing"), "{e}");
}

#[test]
fn device_kind_aware_selection_follows_nvidia() {
    let mig = json!({"apiVersion": API_VERSION, "kind": "MigDeviceConfig",
        "sharing": {"strategy": "MPS"}});
    let entries = vec![
        entry(FromClass, &[], DRIVER, mig.clone()),
        entry(FromClaim, &[], DRIVER, ts("Short")),
    ];
    // The all-requests GpuConfig is skipped for a MIG device; the class MigDeviceConfig applies.
    let c = config_for_device(&entries, DRIVER, "m", DeviceKind::Mig, "gpu-0-mig-x")
        .unwrap()
        .unwrap();
    assert_eq!(c.kind_name(), KIND_MIG);
    let c = config_for_device(&entries, DRIVER, "g", DeviceKind::Gpu, "gpu-0")
        .unwrap()
        .unwrap();
    assert_eq!(c.kind_name(), KIND_GPU);
    // Naming the request explicitly with the wrong kind is an error.
    let entries = vec![entry(FromClaim, &["g"], DRIVER, mig)];
    let e =
        chain(config_for_device(&entries, DRIVER, "g/sub", DeviceKind::Gpu, "gpu-3").unwrap_err());
    assert!(
        e.starts_with("claim config #0: MigDeviceConfig cannot configure GPU device gpu-3"),
        "{e}"
    );
    assert_eq!(
        config_for_device(&entries, DRIVER, "h", DeviceKind::Gpu, "gpu-3").unwrap(),
        None
    );
}

#[test]
fn allocation_configs_are_converted_in_order() {
    use k8s_openapi::api::resource::v1::{
        DeviceAllocationConfiguration, DeviceAllocationResult, OpaqueDeviceConfiguration,
    };
    use k8s_openapi::apimachinery::pkg::runtime::RawExtension;
    let opaque = |driver: &str, v: serde_json::Value| {
        Some(OpaqueDeviceConfiguration {
            driver: driver.into(),
            parameters: RawExtension(v),
        })
    };
    let alloc = AllocationResult {
        devices: Some(DeviceAllocationResult {
            config: Some(vec![
                DeviceAllocationConfiguration {
                    source: "FromClass".into(),
                    requests: None,
                    opaque: opaque(DRIVER, ts("Long")),
                },
                DeviceAllocationConfiguration {
                    source: "FromClaim".into(),
                    requests: Some(vec!["gpu".into()]),
                    opaque: opaque("other.example.com", json!({})),
                },
                DeviceAllocationConfiguration {
                    source: "FromClaim".into(),
                    requests: Some(vec!["gpu".into()]),
                    opaque: None,
                },
                DeviceAllocationConfiguration {
                    source: "FromClaim".into(),
                    requests: Some(vec!["gpu".into()]),
                    opaque: opaque(DRIVER, ts("Short")),
                },
            ]),
            results: None,
        }),
        ..Default::default()
    };
    let entries = from_allocation(&alloc);
    assert_eq!(entries.len(), 3);
    assert_eq!(entries[0].source, FromClass);
    assert!(entries[0].requests.is_empty());
    assert_eq!(entries[1].driver, "other.example.com");
    assert_eq!(entries[2].requests, vec!["gpu".to_string()]);
    assert_eq!(
        interval_of(config_for(&entries, DRIVER, "gpu").unwrap()),
        Some(TimeSliceInterval::Short)
    );
    assert!(from_allocation(&AllocationResult::default()).is_empty());
}

#[test]
fn decoded_configs_round_trip_through_serde() {
    // The checkpoint may persist decoded sharing; it must read back identically.
    for sharing in [
        Sharing::Exclusive,
        Sharing::TimeSlicing {
            interval: TimeSliceInterval::Medium,
        },
        Sharing::Mps(MpsSettings {
            active_thread_percentage: Some(10),
            pinned_memory_limit: Some(1 << 30),
            per_device_pinned_memory_limit: BTreeMap::from([("GPU-x".to_string(), 2 << 30)]),
        }),
    ] {
        let config = DeviceConfig::Mig { sharing };
        let text = serde_json::to_string(&config).unwrap();
        let back: DeviceConfig = serde_json::from_str(&text).unwrap();
        assert_eq!(back, config, "{text}");
    }
}

/// `/metrics` labels a device with `Sharing::strategy`; the checkpoint spells it with serde. One
/// spelling.
#[test]
fn the_strategy_name_is_the_checkpoints() {
    for s in [
        Sharing::Exclusive,
        Sharing::TimeSlicing {
            interval: TimeSliceInterval::Short,
        },
        Sharing::Mps(MpsSettings::default()),
    ] {
        let v = serde_json::to_value(&s).unwrap();
        assert_eq!(v["strategy"], s.strategy(), "{s:?}");
    }
}

/// A share takes MPS's thread percentage and its burst limit (NVIDIA's
/// `defaultPinnedDeviceMemoryLimit`) from its config; time slicing and per-device limits are
/// refused, naming the field.
#[test]
fn a_share_takes_its_sm_cap_and_burst_limit_and_refuses_what_it_cannot_follow() {
    let sharing = |v: serde_json::Value| decode(&gpu_config(v)).unwrap().into_sharing();
    assert_eq!(
        share_config(&Sharing::Exclusive),
        Ok(ShareConfig::default())
    );
    assert_eq!(
        share_config(&sharing(json!({
            "strategy": "MPS",
            "mpsConfig": {"defaultActiveThreadPercentage": 30, "defaultPinnedDeviceMemoryLimit": "40Gi"}
        }))),
        Ok(ShareConfig {
            active_thread_percentage: Some(30),
            burst_limit: Some(40 << 30),
        })
    );
    for (config, field) in [
        (
            json!({"strategy": "TimeSlicing"}),
            "sharing.strategy: TimeSlicing cannot apply",
        ),
        (
            json!({"strategy": "MPS", "mpsConfig": {"defaultPerDevicePinnedMemoryLimit": {"0": "4Gi"}}}),
            "sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit: a share's memory is what it \
             consumes",
        ),
    ] {
        let e = share_config(&sharing(config)).unwrap_err();
        assert!(chain(e.clone()).starts_with(field), "{}", chain(e));
    }
}

/// A share's hard limit is its burst limit, else what the scheduler counted; a burst below what
/// it consumes or above the GPU is refused, naming the field and the bounds.
#[test]
fn a_shares_hard_limit_is_its_burst_between_what_it_consumes_and_the_gpu() {
    const GPU: u64 = 80 << 30;
    let burst = |b: Option<u64>| ShareConfig {
        active_thread_percentage: None,
        burst_limit: b,
    };
    // No burst: the hard limit is the soft one (or none, for a share held to nothing).
    assert_eq!(
        burst(None).hard_limit(Some(24 << 30), GPU),
        Ok(Some(24 << 30))
    );
    assert_eq!(burst(None).hard_limit(None, GPU), Ok(None));
    // A burst from what it consumes up to the whole GPU.
    for b in [24 << 30, 40 << 30, GPU] {
        assert_eq!(burst(Some(b)).hard_limit(Some(24 << 30), GPU), Ok(Some(b)));
    }
    // A share held to nothing (`unlimited`, no memory asked) may still cap itself.
    assert_eq!(
        burst(Some(8 << 30)).hard_limit(None, GPU),
        Ok(Some(8 << 30))
    );
    let e = chain(
        burst(Some(8 << 30))
            .hard_limit(Some(24 << 30), GPU)
            .unwrap_err(),
    );
    assert!(
        e.starts_with(
            "sharing.mpsConfig.defaultPinnedDeviceMemoryLimit: 8Gi is below the 24Gi of memory \
             the share is guaranteed"
        ) && e.contains("set it to 24Gi or more"),
        "{e}"
    );
    let e = chain(
        burst(Some(96 << 30))
            .hard_limit(Some(24 << 30), GPU)
            .unwrap_err(),
    );
    assert!(
        e.starts_with(
            "sharing.mpsConfig.defaultPinnedDeviceMemoryLimit: 96Gi is more than the GPU's 80Gi \
             of memory"
        ) && e.contains("set it to 80Gi or less"),
        "{e}"
    );
}
