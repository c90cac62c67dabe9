//! Name tests: MIG memory and profile names, brand and architecture names.

use super::*;

/// Totals in MiB as NVML reports them, profile sizes in MiB, and the names NVIDIA publishes.
/// The A100 figures are NVIDIA's; the H100/H200 profile sizes are plausible values not checked
/// against hardware.
#[test]
fn mig_memory_names_follow_nvidia() {
    // (GPU, total MiB, [(profile MiB, name GB)])
    type Case = (&'static str, u64, &'static [(u64, u64)]);
    let cases: &[Case] = &[
        (
            "A100-40GB",
            40960,
            &[(4864, 5), (9856, 10), (19968, 20), (40192, 40)],
        ),
        (
            "A100-80GB",
            81920,
            &[(9856, 10), (19968, 20), (40192, 40), (80384, 80)],
        ),
        (
            "H100-80GB",
            81559,
            &[(9984, 10), (19968, 20), (40448, 40), (80384, 80)],
        ),
        (
            "H200-141GB",
            143771,
            &[(16384, 18), (33280, 35), (66816, 71), (133888, 141)],
        ),
    ];
    for (gpu, total_mib, rows) in cases {
        for &(mib, gb) in *rows {
            assert_eq!(
                mig_memory_gb(total_mib * MIB_, mib),
                gb,
                "{gpu}: {mib} MiB of {total_mib} MiB"
            );
        }
    }
    assert_eq!(mig_memory_gb(0, 10240), 10, "unknown total: plain GiB");
}

#[test]
fn mig_profile_names_carry_variant_suffixes() {
    let total = 40960 * MIB_;
    let name = |profile, g, c, mib| mig_profile_name(profile, g, c, mib, total);
    assert_eq!(
        name(Some(b::NVML_GPU_INSTANCE_PROFILE_1_SLICE), 1, 0, 4864),
        "1g.5gb"
    );
    assert_eq!(
        name(Some(b::NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1), 1, 0, 4864),
        "1g.5gb+me"
    );
    assert_eq!(
        name(Some(b::NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2), 1, 0, 9856),
        "1g.10gb"
    );
    assert_eq!(
        name(Some(b::NVML_GPU_INSTANCE_PROFILE_2_SLICE_REV1), 2, 2, 9856),
        "2g.10gb+me"
    );
    assert_eq!(
        name(Some(b::NVML_GPU_INSTANCE_PROFILE_1_SLICE_GFX), 1, 0, 4864),
        "1g.5gb+gfx"
    );
    assert_eq!(
        name(Some(b::NVML_GPU_INSTANCE_PROFILE_1_SLICE_NO_ME), 1, 0, 4864),
        "1g.5gb-me"
    );
    assert_eq!(
        name(
            Some(b::NVML_GPU_INSTANCE_PROFILE_1_SLICE_ALL_ME),
            1,
            0,
            4864
        ),
        "1g.5gb+me.all"
    );
    assert_eq!(
        name(Some(b::NVML_GPU_INSTANCE_PROFILE_3_SLICE), 3, 1, 19968),
        "1c.3g.20gb"
    );
    assert_eq!(name(None, 7, 7, 40192), "7g.40gb");
}

#[test]
fn brand_and_architecture_names_match_nvidia() {
    assert_eq!(brand_name(&Brand::Nvidia), "Nvidia");
    assert_eq!(brand_name(&Brand::GeForceRTX), "GeForceRTX");
    assert_eq!(brand_name(&Brand::Tesla), "Tesla");
    assert_eq!(
        architecture_name(&DeviceArchitecture::Ada),
        Some("Ada Lovelace")
    );
    assert_eq!(
        architecture_name(&DeviceArchitecture::Blackwell),
        Some("Blackwell")
    );
    assert_eq!(architecture_name(&DeviceArchitecture::Unknown), None);
    let cc = |major, minor| ComputeCapability { major, minor };
    assert_eq!(architecture_from_cc(cc(8, 0)), Some("Ampere"));
    assert_eq!(architecture_from_cc(cc(8, 6)), Some("Ampere"));
    assert_eq!(architecture_from_cc(cc(8, 9)), Some("Ada Lovelace"));
    assert_eq!(architecture_from_cc(cc(7, 5)), Some("Turing"));
    assert_eq!(architecture_from_cc(cc(7, 0)), Some("Volta"));
    assert_eq!(architecture_from_cc(cc(12, 0)), Some("Blackwell"));
    assert_eq!(architecture_from_cc(cc(2, 0)), None);
}
