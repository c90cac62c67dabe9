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
        shared_capacity: crate::dra::slices::ConsumableShares::Disabled,
        dynamic_mig: false,
        mig_profiles: None,
        layout: slices::CounterLayout::Separate,
    };
    slices::desired_slices(&inv, &opts)
        .unwrap()
        .into_iter()
        .flat_map(|s| s.devices.unwrap_or_default())
        .collect()
}

mod hostile;
mod profiles;
