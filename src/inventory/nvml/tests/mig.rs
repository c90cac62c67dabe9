//! MIG tests: devices and profiles mapped, unknown identities skipped, MIG unsupported or off.

use super::*;

/// An A100-40GB in MIG mode with 3g.20gb@0, 2g.10gb@4 and 1g.5gb+me@6, listed by NVML in an
/// order other than by placement, next to a second A100 with MIG off.
#[test]
fn a100_in_mig_mode_maps_devices_and_profiles() {
    let mut g0 = a100_40gb(0, "0000:07:00.0");
    g0.mig_mode = Ok(RawMigMode {
        current: true,
        pending: true,
    });
    g0.mig_devices = vec![
        mig_dev(
            0,
            "MIG-aaaaaaaa-0000-5000-8000-000000000001",
            13,
            20,
            6,
            1,
            Ok(DeviceAttributes {
                shared_jpeg_count: 1,
                shared_ofa_count: 1,
                ..attrs(14, 1, 1, 1, 1, 4864)
            }),
        ),
        mig_dev(
            1,
            "MIG-aaaaaaaa-0000-5000-8000-000000000002",
            2,
            9,
            0,
            4,
            Ok(attrs(42, 3, 2, 3, 3, 19968)),
        ),
        mig_dev(
            2,
            "MIG-aaaaaaaa-0000-5000-8000-000000000003",
            5,
            14,
            4,
            2,
            // Attributes unreadable: figures come from the GPU-instance profile.
            Err(CallError::NotSupported),
        ),
    ];
    let g1 = a100_40gb(1, "0000:0F:00.0");
    let inv = map(node(vec![g0, g1]), &MapSysfs::default()).unwrap();

    let mig = &inv.gpus[0].mig;
    assert!(mig.capable && mig.enabled);
    assert!(inv.gpus[0].in_mig_mode());
    assert_eq!(mig.memory_slices, 8);
    let names: Vec<&str> = mig.profiles.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(
        names,
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
    let p3 = &mig.profiles[2];
    assert_eq!(p3.gi_profile_id, 9);
    assert_eq!(p3.memory_bytes, 19968 * MIB_);
    assert_eq!(p3.max_instances, 2);
    assert_eq!(
        p3.placements,
        vec![
            Placement { start: 0, size: 4 },
            Placement { start: 4, size: 4 }
        ],
        "placements sorted by start"
    );
    assert_eq!(
        inv.gpus[0].engines,
        Engines {
            copy_engines: 7,
            decoders: 5,
            ..Engines::default()
        },
        "a full GPU's engines are those of its largest profile"
    );

    let devs: Vec<_> = mig
        .devices
        .iter()
        .map(|d| {
            (
                d.profile.as_str(),
                d.placement.start,
                d.placement.size,
                d.gi_id,
            )
        })
        .collect();
    assert_eq!(
        devs,
        [
            ("3g.20gb", 0, 4, 2),
            ("2g.10gb", 4, 2, 5),
            ("1g.5gb+me", 6, 1, 13)
        ]
    );
    let big = &mig.devices[0];
    assert_eq!(
        big.uuid.as_str(),
        "MIG-aaaaaaaa-0000-5000-8000-000000000002"
    );
    assert_eq!(big.gi_profile_id, 9);
    assert_eq!(big.ci_id, 0);
    assert_eq!(big.memory_bytes, 19968 * MIB_);
    assert_eq!(big.multiprocessors, 42);
    assert_eq!(big.engines.copy_engines, 3);
    let mid = &mig.devices[1];
    assert_eq!(mid.multiprocessors, 28, "from the 2g.10gb profile");
    assert_eq!(mid.engines.decoders, 1);
    let me = &mig.devices[2];
    assert_eq!(me.engines.ofa_engines, 1);
    assert_eq!(me.memory_bytes, 4864 * MIB_);

    // The second GPU: MIG-capable, off, no devices, same profiles.
    let other = &inv.gpus[1].mig;
    assert!(other.capable && !other.enabled);
    assert!(other.devices.is_empty());
    assert_eq!(other.profiles.len(), 7);
}

#[test]
fn mig_device_with_a_smaller_compute_instance_is_named_with_c() {
    let mut g = a100_40gb(0, "0000:07:00.0");
    g.mig_mode = Ok(RawMigMode {
        current: true,
        pending: true,
    });
    let mut d = mig_dev(0, "MIG-1", 1, 9, 0, 4, Ok(attrs(14, 1, 0, 3, 1, 19968)));
    d.ci_id = Ok(2);
    g.mig_devices = vec![d];
    let inv = map(node(vec![g]), &MapSysfs::default()).unwrap();
    let d = &inv.gpus[0].mig.devices[0];
    assert_eq!(d.profile, "1c.3g.20gb");
    assert_eq!(d.ci_id, 2);
    assert_eq!(d.multiprocessors, 14, "the compute instance's SMs");
}

#[test]
fn mig_devices_with_unknown_identity_are_skipped_not_fatal() {
    let mut g = a100_40gb(0, "0000:07:00.0");
    g.mig_mode = Ok(RawMigMode {
        current: true,
        pending: true,
    });
    let ok = mig_dev(0, "MIG-ok", 1, 19, 0, 1, Ok(attrs(14, 1, 0, 1, 1, 4864)));
    let mut no_placement = mig_dev(
        1,
        "MIG-noplace",
        2,
        19,
        1,
        1,
        Ok(attrs(14, 1, 0, 1, 1, 4864)),
    );
    no_placement.gpu_instance = Err(CallError::Missing("nvmlGpuInstanceGetInfo".into()));
    let mut no_ci = mig_dev(2, "MIG-noci", 3, 19, 2, 1, Ok(attrs(14, 1, 0, 1, 1, 4864)));
    no_ci.ci_id = Err(CallError::Failed("insufficient permissions".into()));
    let mut no_uuid = mig_dev(3, "MIG-x", 4, 19, 3, 1, Ok(attrs(14, 1, 0, 1, 1, 4864)));
    no_uuid.uuid = Err(CallError::Failed("gpu lost".into()));
    // A profile id the GPU did not list and no attributes to name it from.
    let unknown_profile = mig_dev(4, "MIG-unknown", 5, 77, 4, 1, Err(CallError::NotSupported));
    // A profile id the GPU did not list, named from its attributes instead.
    let named = mig_dev(5, "MIG-named", 6, 78, 5, 1, Ok(attrs(14, 1, 0, 1, 1, 4864)));
    g.mig_devices = vec![ok, no_placement, no_ci, no_uuid, unknown_profile, named];
    let inv = map(node(vec![g]), &MapSysfs::default()).unwrap();
    let uuids: Vec<(&str, &str)> = inv.gpus[0]
        .mig
        .devices
        .iter()
        .map(|d| (d.uuid.as_str(), d.profile.as_str()))
        .collect();
    assert_eq!(uuids, [("MIG-ok", "1g.5gb"), ("MIG-named", "1g.5gb")]);
}

#[test]
fn mig_not_supported_leaves_the_gpu_whole() {
    let mut g = h100(0, "0000:07:00.0");
    g.mig_mode = Err(CallError::NotSupported);
    let mut h = h100(1, "0000:08:00.0");
    h.mig_mode = Err(CallError::Failed("unknown error".into()));
    let mut k = h100(2, "0000:09:00.0");
    k.mig_mode = Err(CallError::Missing("nvmlDeviceGetMigMode".into()));
    let (inv, omissions) = map_with_omissions(node(vec![g, h, k]), &MapSysfs::default()).unwrap();
    for g in &inv.gpus {
        assert!(!g.mig.capable && !g.in_mig_mode());
        assert!(g.mig.profiles.is_empty() && g.mig.devices.is_empty());
        assert_eq!(g.memory_bytes, 81559 * MIB_);
    }
    // Not supported, or a driver without the MIG API: known not capable. A failed query: unknown.
    let unknown: Vec<bool> = inv.gpus.iter().map(|g| g.mig.mode_unknown).collect();
    assert_eq!(unknown, [false, true, false]);
    let noted: Vec<(u32, &str)> = omissions
        .iter()
        .filter(|o| o.field == "migCapable")
        .map(|o| (o.gpu_index, o.field))
        .collect();
    assert_eq!(noted, [(1, "migCapable")]);
}

#[test]
fn devices_listed_while_mig_is_off_are_ignored() {
    let mut g = a100_40gb(0, "0000:07:00.0");
    g.mig_devices = vec![mig_dev(
        0,
        "MIG-stale",
        1,
        19,
        0,
        1,
        Ok(attrs(14, 1, 0, 1, 1, 4864)),
    )];
    let inv = map(node(vec![g]), &MapSysfs::default()).unwrap();
    assert!(inv.gpus[0].mig.devices.is_empty());
}

/// What decides whether MIG mode may toggle is read per GPU: the pending mode (kept only where
/// it differs from the current one) and the virtualization mode (unknown when NVML fails it,
/// with an omission, never assumed bare metal).
#[test]
fn pending_mig_mode_and_virtualization_are_mapped() {
    use crate::inventory::{NoMigToggle, Virtualization};
    let hopper = h100(0, "0000:07:00.0");
    let mut pending = h100(1, "0000:08:00.0");
    pending.mig_mode = Ok(RawMigMode {
        current: false,
        pending: true,
    });
    let mut guest = h100(2, "0000:09:00.0");
    guest.virtualization = Ok(GpuVirtualizationMode::Vgpu);
    let mut unknown = h100(3, "0000:0a:00.0");
    unknown.virtualization = Err(CallError::Failed("unknown error".into()));
    let mut ampere = a100_40gb(4, "0000:0b:00.0");
    ampere.virtualization = Ok(GpuVirtualizationMode::PassThrough);
    let (inv, omissions) = map_with_omissions(
        node(vec![hopper, pending, guest, unknown, ampere]),
        &MapSysfs::default(),
    )
    .unwrap();
    let g = &inv.gpus;
    assert_eq!(g[0].mig.pending, None);
    assert_eq!(g[0].virtualization, Some(Virtualization::BareMetal));
    assert_eq!(g[0].mig_toggle(), Ok(()));
    assert!(!g[1].mig.enabled);
    assert_eq!(g[1].mig.pending, Some(true));
    assert_eq!(
        g[1].mig_toggle(),
        Err(NoMigToggle::Pending {
            current: false,
            pending: true
        })
    );
    assert_eq!(g[2].virtualization, Some(Virtualization::VgpuGuest));
    assert_eq!(g[2].mig_toggle().unwrap_err().to_string(), "a vGPU guest");
    assert_eq!(g[3].virtualization, None);
    assert_eq!(g[3].mig_toggle(), Err(NoMigToggle::VirtualizationUnknown));
    assert_eq!(g[4].virtualization, Some(Virtualization::Passthrough));
    assert_eq!(
        g[4].mig_toggle().unwrap_err().to_string(),
        "Ampere (8.0): MIG mode changes only through the operator"
    );
    let noted: Vec<u32> = omissions
        .iter()
        .filter(|o| o.field == "virtualization")
        .map(|o| o.gpu_index)
        .collect();
    assert_eq!(noted, [3]);
}
