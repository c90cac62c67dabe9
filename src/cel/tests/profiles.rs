//! Selectors over the built-in profiles' devices.

use super::*;

/// How many devices of a built-in profile each selector matches: the documentation's examples,
/// NVIDIA's DeviceClasses and claims, and ours.
#[test]
fn selectors_over_builtin_profiles() {
    let env = Environment::new();
    const GPU: &str =
        "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'gpu'";
    const MIG: &str =
        "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'mig'";
    let cases: &[(&str, &str, usize)] = &[
        ("dgx-h100", GPU, 8),
        ("dgx-h100", MIG, 0),
        ("a100-mig-mixed", GPU, 2),
        ("a100-mig-mixed", MIG, 7),
        ("l40s-pcie", GPU, 4),
        // NVIDIA's examples.
        (
            "a100-mig-mixed",
            "device.attributes['gpu.nvidia.com'].productName.lowerAscii().matches('^.*a100.*$')",
            9,
        ),
        (
            "dgx-h100",
            "device.attributes['gpu.nvidia.com'].productName.lowerAscii().matches('^.*a100.*$')",
            0,
        ),
        (
            "a100-mig-mixed",
            "device.capacity['gpu.nvidia.com'].multiprocessors.isLessThan(quantity(\"30\"))",
            // 3g.20gb has 42 multiprocessors.
            6,
        ),
        (
            "dgx-h100",
            "device.attributes[\"gpu.nvidia.com\"].architecture == \"Hopper\"",
            8,
        ),
        (
            "dgx-h100",
            "device.attributes['gpu.nvidia.com'].driverVersion.isGreaterThan(semver('550.0.0'))",
            8,
        ),
        (
            "a100-mig-mixed",
            "device.attributes['gpu.nvidia.com'].type == 'mig' && device.attributes['gpu.nvidia.com'].profile == '1g.5gb'",
            2,
        ),
        // The dra-example-driver's and the documentation's shape.
        (
            "dgx-h100",
            "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('40Gi')) >= 0",
            8,
        ),
        (
            "l40s-pcie",
            "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('80Gi')) >= 0",
            0,
        ),
        // Ours: unqualified-looking standard attributes need their domain.
        (
            "dgx-h100",
            "device.attributes['resource.kubernetes.io'].pcieRoot.startsWith('pci0000:')",
            8,
        ),
        (
            "dgx-h100",
            "cel.bind(g, device.attributes['gpu.nvidia.com'], g.cudaComputeCapability.major() == 9 && g.numaNode == 1)",
            4,
        ),
        // The standard NUMA attribute (KEP-6072) beside NVIDIA's bare name, on GPUs and MIG
        // devices alike, with the same value; bracket and field selection read it the same.
        (
            "dgx-h100",
            "device.attributes['resource.kubernetes.io'].numaNode == 1",
            4,
        ),
        (
            "a100-mig-mixed",
            "device.attributes['resource.kubernetes.io']['numaNode'] == device.attributes['gpu.nvidia.com'].numaNode",
            9,
        ),
        (
            "a100-mig-mixed",
            "device.attributes['gpu.nvidia.com'].type == 'mig' && device.attributes['resource.kubernetes.io'].numaNode == 0",
            4,
        ),
        // The domain is the attribute's, not the driver's: the standard name is not in it.
        (
            "dgx-h100",
            "!('resource.kubernetes.io/numaNode' in device.attributes['gpu.nvidia.com'])",
            8,
        ),
        (
            "dgx-h100",
            "device.attributes['gpu.nvidia.com'].productName.split(' ')[1].upperAscii() == 'H100'",
            8,
        ),
        (
            "a100-mig-mixed",
            "has(device.attributes['gpu.nvidia.com'].parentUUID)",
            7,
        ),
        (
            "dgx-h100",
            "device.capacity['gpu.nvidia.com'].memory.add(quantity('1Gi')).sub(quantity('1Gi')).isInteger() && device.capacity['gpu.nvidia.com'].memory.asInteger() == 85899345920",
            8,
        ),
        (
            "dgx-h100",
            "device.capacity['gpu.nvidia.com'].memory.asApproximateFloat() > 1e10 && device.capacity['gpu.nvidia.com'].memory.sign() == 1",
            8,
        ),
        (
            "dgx-h100",
            "isQuantity('80Gi') && !isQuantity('eighty') && isSemver('1.2.3') && semver('1.2.3').minor() == 2 && semver('1.2.3').patch() == 3",
            8,
        ),
        (
            "dgx-h100",
            "device.attributes['gpu.nvidia.com'].uuid.substring(0, 4) == 'GPU-' && device.attributes['gpu.nvidia.com'].uuid.indexOf('-') == 3 && ['a', 'b'].join('-') == 'a-b' && '  x '.trim() == 'x' && 'aXa'.replace('X', 'b') == 'aba'",
            8,
        ),
        (
            "dgx-h100",
            "device.attributes.all(d, d in ['gpu.nvidia.com', 'resource.kubernetes.io']) && device.capacity['gpu.nvidia.com'].filter(k, k == 'memory').size() == 1 && [1, 2].map(x, x * 2) == [2, 4]",
            8,
        ),
    ];
    for (profile, expr, want) in cases {
        let sel = Selector::compile(expr).unwrap_or_else(|e| panic!("{expr}: {e}"));
        let mut n = 0;
        for d in profile_devices(profile) {
            let dv = env.device("gpu.nvidia.com", &d).unwrap();
            match sel.evaluate(&env, &dv) {
                Ok(true) => n += 1,
                Ok(false) => {}
                Err(e) => panic!("{profile} {}: {expr}: {e}", d.name),
            }
        }
        assert_eq!(n, *want, "{profile}: {expr}");
    }
}
