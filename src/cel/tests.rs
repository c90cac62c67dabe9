//! The DRA CEL environment against expected results: Kubernetes' own DRA CEL test cases
//! (`k8s.io/dynamic-resource-allocation/cel` compile_test.go: the expression and its result or
//! error, not their code), the Kubernetes documentation's, NVIDIA's DeviceClasses and examples,
//! and ours, over the built-in profiles; then hostile input.

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::{Device, DeviceAttribute, DeviceCapacity};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use proptest::prelude::*;

use super::*;

#[derive(Clone, Copy, Debug)]
enum Want {
    Match(bool),
    /// An evaluation error containing this text.
    Fails(&'static str),
    /// A compile error containing this text.
    Refused(&'static str),
}
use Want::*;

fn int(i: i64) -> DeviceAttribute {
    DeviceAttribute {
        int: Some(i),
        ..Default::default()
    }
}
fn boolean(b: bool) -> DeviceAttribute {
    DeviceAttribute {
        bool: Some(b),
        ..Default::default()
    }
}
fn string(s: &str) -> DeviceAttribute {
    DeviceAttribute {
        string: Some(s.into()),
        ..Default::default()
    }
}
fn version(s: &str) -> DeviceAttribute {
    DeviceAttribute {
        version: Some(s.into()),
        ..Default::default()
    }
}

fn device(
    attributes: &[(&str, DeviceAttribute)],
    capacity: &[(&str, &str)],
    allow_multiple: Option<bool>,
) -> Device {
    Device {
        name: "d".into(),
        attributes: Some(
            attributes
                .iter()
                .map(|(k, v)| (k.to_string(), v.clone()))
                .collect::<BTreeMap<_, _>>(),
        ),
        capacity: Some(
            capacity
                .iter()
                .map(|(k, v)| {
                    (
                        k.to_string(),
                        DeviceCapacity {
                            value: Quantity(v.to_string()),
                            request_policy: None,
                        },
                    )
                })
                .collect(),
        ),
        allow_multiple_allocations: allow_multiple,
        ..Default::default()
    }
}

fn check(env: &Environment, name: &str, expr: &str, driver: &str, d: &Device, want: Want) {
    let compiled = Selector::compile(expr);
    match (want, compiled) {
        (Refused(text), Err(e)) => {
            assert!(
                e.to_string().contains(text),
                "{name}: compile error {e} lacks {text:?}"
            )
        }
        (Refused(text), Ok(_)) => panic!("{name}: compiled, wanted an error with {text:?}"),
        (_, Err(e)) => panic!("{name}: compile error {e}"),
        (want, Ok(sel)) => {
            let dv = env.device(driver, d).expect("device converts");
            let got = sel.evaluate(env, &dv);
            match (want, got) {
                (Match(w), Ok(g)) => assert_eq!(g, w, "{name}: {expr}"),
                (Fails(text), Err(e)) => {
                    assert!(
                        e.to_string().contains(text),
                        "{name}: error {e} lacks {text:?}"
                    )
                }
                (w, g) => panic!("{name}: {expr}: wanted {w:?}, got {g:?}"),
            }
        }
    }
}

const EX: &str = "dra.example.com";

/// Kubernetes' compile_test.go cases that exist in resource.k8s.io/v1 of 1.34 (no list-typed
/// attributes): the same expression gives the same answer.
#[test]
fn kubernetes_dra_cel_cases() {
    let env = Environment::new();
    let none = device(&[], &[], None);
    let name_true = device(&[("name", boolean(true))], &[], None);
    let cases: Vec<(&str, &str, &str, Device, Want)> = vec![
        ("true", "true", "", none.clone(), Match(true)),
        ("false", "false", "", none.clone(), Match(false)),
        (
            "syntax-error",
            "?!",
            "",
            none.clone(),
            Refused("syntax error"),
        ),
        (
            "type-error",
            "1",
            "",
            none.clone(),
            Refused("must evaluate to bool"),
        ),
        (
            "runtime-error-lookup-identifier",
            r#"device.attributes["no-such-domain"].noSuchAttr.isGreaterThan(quantity("0"))"#,
            "",
            none.clone(),
            Fails("no such key: noSuchAttr"),
        ),
        (
            "runtime-error-lookup-map",
            r#"device.attributes["no-such-domain"]["noSuchAttr"].isGreaterThan(quantity("0"))"#,
            "",
            none.clone(),
            Fails("no such key: noSuchAttr"),
        ),
        (
            "domain-check-negative",
            r#""no-such-domain" in device.attributes"#,
            "",
            none.clone(),
            Match(false),
        ),
        (
            "domain-check-positive",
            r#""dra.example.com" in device.attributes"#,
            "",
            device(&[("dra.example.com/something", boolean(true))], &[], None),
            Match(true),
        ),
        (
            "empty-driver-name",
            r#"device.driver == """#,
            "",
            none.clone(),
            Match(true),
        ),
        (
            "real-driver-name",
            r#"device.driver == "dra.example.com""#,
            EX,
            none.clone(),
            Match(true),
        ),
        (
            "driver-name-qualifier",
            r#"device.attributes["dra.example.com"].name"#,
            EX,
            name_true.clone(),
            Match(true),
        ),
        (
            "driver-name-qualifier-map-lookup",
            r#"device.attributes["dra.example.com"]["name"]"#,
            EX,
            name_true.clone(),
            Match(true),
        ),
        (
            "bind",
            r#"cel.bind(dra, device.attributes["dra.example.com"], dra.name)"#,
            EX,
            name_true.clone(),
            Match(true),
        ),
        (
            "qualified-attribute-name",
            r#"device.attributes["other.example.com"].name"#,
            EX,
            device(&[("other.example.com/name", boolean(true))], &[], None),
            Match(true),
        ),
        (
            "int",
            r#"device.attributes["dra.example.com"].name > 0"#,
            EX,
            device(&[("name", int(1))], &[], None),
            Match(true),
        ),
        (
            "string",
            r#"device.attributes["dra.example.com"].name == "fish""#,
            EX,
            device(&[("name", string("fish"))], &[], None),
            Match(true),
        ),
        (
            "macro-exists-on-int",
            r#"device.attributes["dra.example.com"].name.exists(x, x > 0)"#,
            EX,
            device(&[("name", int(1))], &[], None),
            Fails(""),
        ),
        (
            "macro-exists-on-string",
            r#"device.attributes["dra.example.com"].name.exists(x, x == "fish")"#,
            EX,
            device(&[("name", string("fish"))], &[], None),
            Fails(""),
        ),
        (
            "version",
            r#"device.attributes["dra.example.com"].name.isGreaterThan(semver("0.0.1"))"#,
            EX,
            device(&[("name", version("1.0.0"))], &[], None),
            Match(true),
        ),
        (
            "version_v",
            r#"device.attributes["dra.example.com"].name.isGreaterThan(semver("v0.0.1", true)) && isSemver("v1.0.0", true)"#,
            EX,
            device(&[("name", version("1.0.0"))], &[], None),
            Match(true),
        ),
        (
            "macro-exists-on-version",
            r#"device.attributes["dra.example.com"].name.exists(x, x.isGreaterThan(semver("0.0.1")))"#,
            EX,
            device(&[("name", version("1.0.0"))], &[], None),
            Fails(""),
        ),
        (
            "quantity",
            r#"device.capacity["dra.example.com"].name.isGreaterThan(quantity("1Ki"))"#,
            EX,
            device(&[], &[("name", "1Mi")], None),
            Match(true),
        ),
        (
            "check-positive",
            r#""name" in device.capacity["dra.example.com"] && device.capacity["dra.example.com"].name.isGreaterThan(quantity("1Ki"))"#,
            EX,
            device(&[], &[("name", "1Mi")], None),
            Match(true),
        ),
        (
            "check-negative",
            r#"!("name" in device.capacity["dra.example.com"]) || device.capacity["dra.example.com"].name.isGreaterThan(quantity("1Ki"))"#,
            "",
            none.clone(),
            Match(true),
        ),
        (
            "all",
            r#"
device.capacity["dra.example.com"].quantity.isGreaterThan(quantity("1Ki")) &&
device.attributes["dra.example.com"].bool &&
device.attributes["dra.example.com"].int > 0 &&
device.attributes["dra.example.com"].string == "fish" &&
device.attributes["dra.example.com"].version.isGreaterThan(semver("0.0.1")) &&
device.capacity["dra.example.com"]["quantity"].isGreaterThan(quantity("1Ki")) &&
device.attributes["dra.example.com"]["bool"] &&
device.attributes["dra.example.com"]["int"] > 0 &&
device.attributes["dra.example.com"]["string"] == "fish" &&
device.attributes["dra.example.com"]["version"].isGreaterThan(semver("0.0.1"))
"#,
            EX,
            device(
                &[
                    ("bool", boolean(true)),
                    ("int", int(1)),
                    ("string", string("fish")),
                    ("version", version("1.0.0")),
                ],
                &[("quantity", "1Mi")],
                None,
            ),
            Match(true),
        ),
        (
            "many",
            r#"device.attributes["dra.example.com"].a && device.attributes["dra.example.com"].b && device.attributes["dra.example.com"].c"#,
            EX,
            device(
                &[
                    ("a", boolean(true)),
                    ("b", boolean(true)),
                    ("c", boolean(true)),
                ],
                &[],
                None,
            ),
            Match(true),
        ),
        (
            "check_attribute_domains",
            r#"device.attributes.exists_one(x, x == "dra.example.com")"#,
            EX,
            device(&[("services", string("some_example_value"))], &[], None),
            Match(true),
        ),
        (
            "check_attribute_ids",
            r#"device.attributes["dra.example.com"].exists_one(x, x == "services")"#,
            EX,
            device(&[("services", string("some_example_value"))], &[], None),
            Match(true),
        ),
        (
            "split_attribute",
            r#"device.attributes["dra.example.com"].services.split("example").size() >= 2"#,
            EX,
            device(&[("services", string("some_example_value"))], &[], None),
            Match(true),
        ),
        (
            "regexp_attribute",
            r#"device.attributes["dra.example.com"].services.matches("[^a]?sym")"#,
            EX,
            device(&[("services", string("asymetric"))], &[], None),
            Match(true),
        ),
        (
            "check_capacity_domains",
            r#"device.capacity.exists_one(x, x == "dra.example.com")"#,
            EX,
            device(&[], &[("memory", "1Mi")], None),
            Match(true),
        ),
        (
            "check_capacity_ids",
            r#"device.capacity["dra.example.com"].exists_one(x, x == "memory")"#,
            EX,
            device(&[], &[("memory", "1Mi")], None),
            Match(true),
        ),
        (
            "expensive",
            "[1, 2, 3, 4, 5, 6, 7, 8, 9, 10].all(x, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10].all(y, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10].all(z, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10].all(z2, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10].all(z3, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10].all(z4, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10].all(z5, int('1'.find('[0-9]*')) < 100)))))))",
            EX,
            none.clone(),
            Fails("actual cost limit exceeded"),
        ),
        (
            "allow_multiple_allocations",
            "device.allowMultipleAllocations == true",
            EX,
            device(&[], &[], Some(true)),
            Match(true),
        ),
        (
            "allow_multiple_allocations_default",
            "device.allowMultipleAllocations == false",
            EX,
            device(&[], &[], None),
            Match(true),
        ),
        (
            "allow_multiple_allocations_false",
            "device.allowMultipleAllocations == false",
            EX,
            device(&[], &[], Some(false)),
            Match(true),
        ),
    ];
    for (name, expr, driver, d, want) in &cases {
        check(&env, name, expr, driver, d, *want);
    }
    // The Kubernetes documentation's examples.
    let doc_device = device(
        &[
            ("model", string("LATEST-GPU-MODEL")),
            ("someBool", boolean(true)),
            ("anotherBool", boolean(false)),
            ("ext.example.com/family", string("a")),
        ],
        &[("modules", "4"), ("test-driver.cdi.k8s.io/counters", "3")],
        Some(true),
    );
    let docs: &[(&str, Want)] = &[
        ("device.driver == 'dra.example.com'", Match(true)),
        (
            "device.attributes['dra.example.com'].model == 'LATEST-GPU-MODEL'",
            Match(true),
        ),
        (
            "device.attributes['ext.example.com'].family == 'a'",
            Match(true),
        ),
        (
            "device.capacity['dra.example.com'].modules.isGreaterThan(quantity('3'))",
            Match(true),
        ),
        (
            "cel.bind(dra, device.attributes['dra.example.com'], dra.someBool && dra.anotherBool)",
            Match(false),
        ),
        (
            "device.capacity['test-driver.cdi.k8s.io'].counters.compareTo(quantity('2')) >= 0",
            Match(true),
        ),
        (
            "device.capacity['dra.example.com'].memory.compareTo(quantity('4Gi')) >= 0",
            Fails("no such key: memory"),
        ),
    ];
    for (expr, want) in docs {
        check(&env, "docs", expr, EX, &doc_device, *want);
    }
}

fn profile_devices(profile: &str) -> Vec<Device> {
    use crate::dra::slices;
    use crate::inventory::DeviceBackend;
    let backend = crate::inventory::sim::SimBackend::from_profile(profile, "node-a").unwrap();
    let inv = backend.snapshot().unwrap();
    let opts = slices::SliceOptions {
        driver: "gpu.nvidia.com".into(),
        node_name: "node-a".into(),
        partitionable: false,
        layout: slices::CounterLayout::Separate,
    };
    slices::desired_slices(&inv, &opts)
        .unwrap()
        .into_iter()
        .flat_map(|s| s.devices.unwrap_or_default())
        .collect()
}

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

#[test]
fn errors_are_evaluation_errors_not_false() {
    let env = Environment::new();
    let d = profile_devices("dgx-h100").remove(0);
    let dv = env.device("gpu.nvidia.com", &d).unwrap();
    let cases: &[(&str, &str)] = &[
        // A missing attribute, as in Kubernetes.
        (
            "device.attributes['gpu.nvidia.com'].noSuch == 1",
            "no such key: noSuch",
        ),
        // Type mismatch: a string compared with an int.
        ("device.attributes['gpu.nvidia.com'].productName > 3", ""),
        // A bad quantity.
        (
            "device.capacity['gpu.nvidia.com'].memory.isGreaterThan(quantity('lots'))",
            "quantity",
        ),
        ("semver('not.a.version').major() == 1", "semver"),
        // Not a bool.
        (
            "device.attributes['gpu.nvidia.com'].index + 1",
            "could not be converted to bool",
        ),
    ];
    for (expr, text) in cases {
        let sel = Selector::compile(expr).unwrap();
        match sel.evaluate(&env, &dv) {
            Err(e) => assert!(e.to_string().contains(text), "{expr}: {e}"),
            Ok(v) => panic!("{expr}: evaluated to {v}, wanted an error"),
        }
    }
    // has() guards the missing attribute.
    let sel = Selector::compile("has(device.attributes['gpu.nvidia.com'].noSuch)").unwrap();
    assert!(!sel.evaluate(&env, &dv).unwrap());
}

#[test]
fn explanations_name_the_failing_value() {
    let env = Environment::new();
    let l40s = profile_devices("l40s-pcie").remove(0);
    let dv = env.device("gpu.nvidia.com", &l40s).unwrap();
    let cases: &[(&str, &str)] = &[
        (
            "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('80Gi')) >= 0",
            "memory 48Gi < 80Gi",
        ),
        (
            "device.attributes['gpu.nvidia.com'].type == 'gpu' && device.attributes['gpu.nvidia.com'].type == 'mig'",
            "type \"gpu\" != \"mig\"",
        ),
        (
            "device.capacity['gpu.nvidia.com'].memory.isGreaterThan(quantity('64Gi'))",
            "memory 48Gi <= 64Gi",
        ),
        (
            "device.attributes['gpu.nvidia.com'].driverVersion.isLessThan(semver('500.0.0'))",
            "driverVersion",
        ),
        (
            "device.attributes['gpu.nvidia.com'].productName.lowerAscii().matches('h100')",
            "productName \"nvidia l40s\" does not match \"h100\"",
        ),
        (
            "device.attributes['gpu.nvidia.com'].noSuch",
            "error: no such key: noSuch",
        ),
    ];
    for (expr, want) in cases {
        let sel = Selector::compile(expr).unwrap();
        let why = sel.explain(&env, &dv).expect("fails");
        assert!(why.contains(want), "{expr}: {why:?} lacks {want:?}");
    }
    let ok = Selector::compile("device.attributes['gpu.nvidia.com'].type == 'gpu'").unwrap();
    assert_eq!(ok.explain(&env, &dv), None);
}

#[test]
fn hostile_expressions_are_refused_cleanly() {
    let long = format!("'{}' == ''", "a".repeat(MAX_EXPRESSION_LENGTH));
    assert!(matches!(
        Selector::compile(&long),
        Err(CompileError::TooLong { .. })
    ));
    for deep in [
        format!("{}true{}", "(".repeat(5000), ")".repeat(5000)),
        format!("{}1]", "[".repeat(5000)),
        format!("{}true", "!".repeat(5000)),
        format!("{}1 == 1", "-".repeat(5000)),
    ] {
        assert!(
            matches!(Selector::compile(&deep), Err(CompileError::TooDeep { .. })),
            "{}",
            &deep[..20]
        );
    }
    // Nesting the text check accepts but the parser does not.
    let nested_calls = format!("{}true{}", "(".repeat(MAX_NESTING), ")".repeat(MAX_NESTING));
    let _ = Selector::compile(&nested_calls);
    // Long operator chains: the parser's recursion limit or ours, never a crash.
    for chain in [
        vec!["1"; 3000].join(" + ") + " > 0",
        vec!["true"; 3000].join(" && "),
        format!("device{}", ".a".repeat(3000)),
    ] {
        if let Ok(sel) = Selector::compile(&chain) {
            let env = Environment::new();
            let dv = env.device("x", &device(&[], &[], None)).unwrap();
            let _ = sel.evaluate(&env, &dv);
        }
    }
    // Parens inside strings are not nesting.
    let in_string = format!("'{}' != ''", "(".repeat(100));
    assert!(Selector::compile(&in_string).is_ok());
    // Message construction would panic the interpreter: refused at compile time.
    assert!(Selector::compile("Foo{a: 1} == 1").is_err());
}

fn doubling(n: usize) -> String {
    let mut e = format!("s{}.size() > 0", n - 1);
    for i in (0..n).rev() {
        let init = if i == 0 {
            "'abcdefgh'".to_string()
        } else {
            format!("s{} + s{}", i - 1, i - 1)
        };
        e = format!("cel.bind(s{i}, {init}, {e})");
    }
    e
}

#[test]
fn budgets_stop_runaway_evaluations() {
    let env = Environment::new();
    let dv = env.device("x", &device(&[], &[], None)).unwrap();
    let cases = [
        // 8M iterations.
        "[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20].all(a, [1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20].all(b, [1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20].all(c, [1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20].all(d, [1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20].all(e, true)))))",
        // Doubling a string through bindings: 2^28 bytes without the cap.
        &doubling(25),
    ];
    for expr in cases {
        let sel = Selector::compile(expr).unwrap();
        let r = sel.evaluate(&env, &dv);
        assert!(
            matches!(
                r,
                Err(EvalError::CostLimit { .. } | EvalError::TooLarge { .. })
            ),
            "{expr}: {r:?}"
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Random text: compiles or is refused; evaluating what compiles never panics or hangs.
    #[test]
    fn random_expressions_never_panic(expr in "[a-z0-9 .()\\[\\]{}'\"!&|<>=+*/%?:,_-]{0,200}") {
        let env = Environment::new();
        let dv = env.device("x", &device(&[("a", int(1))], &[("m", "1Gi")], None)).unwrap();
        if let Ok(sel) = Selector::compile(&expr) {
            let _ = sel.evaluate(&env, &dv);
            let _ = sel.explain(&env, &dv);
        }
    }

}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// Structured hostile expressions: deep nesting, long strings, huge comprehensions.
    #[test]
    fn hostile_shapes_never_panic_or_hang(
        depth in 0usize..200,
        width in 1usize..60,
        nest in 1usize..8,
        len in 0usize..20000,
        pick in 0usize..5,
    ) {
        let list = format!("[{}]", (0..width).map(|i| i.to_string()).collect::<Vec<_>>().join(","));
        let expr = match pick {
            0 => format!("{}true{}", "(".repeat(depth), ")".repeat(depth)),
            1 => format!("'{}'.size() > 0", "x".repeat(len)),
            2 => {
                let mut e = "true".to_string();
                for i in 0..nest {
                    e = format!("{list}.all(v{i}, {e})");
                }
                e
            }
            3 => {
                let mut e = "true".to_string();
                for i in 0..nest {
                    e = format!("{list}.map(v{i}, {list}).size() > 0 && {e}");
                }
                e
            }
            _ => format!("{}device.driver{} == 'x'", "cel.bind(a, 1, ".repeat(depth % 40), ")".repeat(depth % 40)),
        };
        let env = Environment::new();
        let dv = env.device("x", &device(&[], &[], None)).unwrap();
        if let Ok(sel) = Selector::compile(&expr) {
            let _ = sel.evaluate(&env, &dv);
        }
    }
}
