//! `nvdra inventory -o slices` end to end: the built binary's output must be ResourceSlice objects
//! the API server accepts as they are — every field known to `resource.k8s.io/v1`, nothing lost
//! in a parse and re-serialize round trip.

use std::collections::BTreeSet;
use std::process::{Command, Output};

use k8s_openapi::api::resource::v1::ResourceSlice;

fn nvdra(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_nvdra"));
    for var in [
        "NODE_NAME",
        "NVDRA_CONFIG",
        "NVDRA_BACKEND",
        "NVDRA_PROFILE",
        "NVDRA_TOPOLOGY",
        "NVDRA_DRIVER_NAME",
        "NVDRA_PARTITIONABLE",
        "NVDRA_SHARED_CAPACITY",
        "NVDRA_DYNAMIC_MIG",
        "NVDRA_MIG_PROFILES",
        "NVDRA_COUNTER_LAYOUT",
        "NVDRA_LOG_FORMAT",
    ] {
        cmd.env_remove(var);
    }
    cmd.args(args).envs(env.iter().copied());
    cmd.output().expect("run nvdra")
}

/// Parses every YAML document into a ResourceSlice, failing on any field the type does not know
/// (a parse → serialize round trip must give back exactly the document).
fn strict_parse(text: &str) -> Result<Vec<ResourceSlice>, String> {
    let mut slices = Vec::new();
    let docs: Vec<serde_json::Value> =
        serde_saphyr::from_str_multiple(text).map_err(|e| format!("not YAML: {e}"))?;
    for (i, value) in docs.into_iter().enumerate() {
        let slice: ResourceSlice = serde_path_to_error::deserialize(value.clone())
            .map_err(|e| format!("document {i} at {}: {}", e.path(), e.inner()))?;
        let back = serde_json::to_value(&slice).unwrap();
        if back != value {
            return Err(format!(
                "document {i} has fields ResourceSlice does not know:\n{value}\nre-serialized:\n{back}"
            ));
        }
        slices.push(slice);
    }
    Ok(slices)
}

fn parse_slices(out: &Output) -> Vec<ResourceSlice> {
    assert!(
        out.status.success(),
        "nvdra failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    strict_parse(std::str::from_utf8(&out.stdout).unwrap()).unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn the_strict_parse_catches_unknown_and_mistyped_fields() {
    let good = "apiVersion: resource.k8s.io/v1\nkind: ResourceSlice\nmetadata: {generateName: n-}\n\
                spec: {driver: d.example.com, nodeName: n1, pool: {name: n1, generation: 1, resourceSliceCount: 1}}\n";
    assert_eq!(strict_parse(good).unwrap().len(), 1);
    let two = format!("---\n{good}---\n{good}");
    assert_eq!(strict_parse(&two).unwrap().len(), 2);
    let unknown = good.replace("nodeName: n1,", "nodeName: n1, nodeNmae: n1,");
    assert!(
        strict_parse(&unknown)
            .unwrap_err()
            .contains("does not know")
    );
    let mistyped = good.replace("generation: 1", "generation: one");
    let err = strict_parse(&mistyped).unwrap_err();
    assert!(err.contains("spec.pool.generation"), "{err}");
}

fn attr_int(d: &k8s_openapi::api::resource::v1::Device, name: &str) -> i64 {
    d.attributes.as_ref().unwrap()[name].int.unwrap()
}

#[test]
fn dgx_h100_slices_are_valid_resource_slices() {
    let out = nvdra(
        &[
            "inventory",
            "--profile",
            "dgx-h100",
            "--node-name",
            "node-a",
            "-o",
            "slices",
        ],
        &[],
    );
    let slices = parse_slices(&out);
    assert_eq!(slices.len(), 1);
    let raw: serde_json::Value = serde_saphyr::from_slice(&out.stdout).unwrap();
    assert_eq!(raw["apiVersion"], "resource.k8s.io/v1");
    assert_eq!(raw["kind"], "ResourceSlice");

    let s = &slices[0];
    assert_eq!(
        s.metadata.generate_name.as_deref(),
        Some("00000-gpu.nvidia.com-node-a-")
    );
    assert!(s.metadata.name.is_none());
    assert_eq!(s.spec.driver, "gpu.nvidia.com");
    assert_eq!(s.spec.node_name.as_deref(), Some("node-a"));
    assert_eq!(s.spec.pool.name, "node-a");
    assert_eq!(s.spec.pool.generation, 1);
    assert_eq!(s.spec.pool.resource_slice_count, 1);
    assert!(s.spec.shared_counters.is_none());

    let devices = s.spec.devices.as_ref().unwrap();
    let names: Vec<&str> = devices.iter().map(|d| d.name.as_str()).collect();
    assert_eq!(
        names,
        (0..8)
            .map(|i| format!("gpu-{i}"))
            .collect::<Vec<_>>()
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>()
    );
    for d in devices {
        assert_eq!(d.capacity.as_ref().unwrap()["memory"].value.0, "80Gi");
        let attrs = d.attributes.as_ref().unwrap();
        assert_eq!(attrs["type"].string.as_deref(), Some("gpu"));
        assert_eq!(attrs["driverVersion"].version.as_deref(), Some("570.124.6"));
        assert_eq!(
            attrs["productName"].string.as_deref(),
            Some("NVIDIA H100 80GB HBM3")
        );
    }
    let domains: BTreeSet<i64> = devices
        .iter()
        .map(|d| attr_int(d, "nvlinkDomain"))
        .collect();
    assert_eq!(domains.len(), 1, "all eight GPUs share the NVSwitch fabric");
    let uuids: BTreeSet<&str> = devices
        .iter()
        .map(|d| {
            d.attributes.as_ref().unwrap()["uuid"]
                .string
                .as_deref()
                .unwrap()
        })
        .collect();
    assert_eq!(uuids.len(), 8);
}

#[test]
fn partitionable_layouts() {
    let base = [
        "inventory",
        "--profile",
        "dgx-a100-mig",
        "--node-name",
        "node-a",
        "-o",
        "slices",
    ];
    let separate = parse_slices(&nvdra(&[&base[..], &["--partitionable"]].concat(), &[]));
    assert_eq!(separate.len(), 9);
    assert_eq!(
        separate[0].spec.shared_counters.as_ref().unwrap().len(),
        8,
        "one counters-only slice first"
    );
    assert!(separate[0].spec.devices.is_none());
    let devices: usize = separate
        .iter()
        .map(|s| s.spec.devices.as_ref().map_or(0, Vec::len))
        .sum();
    assert_eq!(devices, 8 * 25);
    assert!(
        separate
            .iter()
            .all(|s| s.spec.pool.resource_slice_count == 9 && s.spec.pool.generation == 1)
    );

    let together = parse_slices(&nvdra(
        &[
            &base[..],
            &["--partitionable", "--counter-layout", "together"],
        ]
        .concat(),
        &[],
    ));
    assert_eq!(together.len(), 8);
    assert!(together.iter().all(|s| {
        s.spec.shared_counters.as_ref().unwrap().len() == 1
            && s.spec.devices.as_ref().unwrap().len() == 25
    }));

    // The same through the environment.
    let env = parse_slices(&nvdra(
        &base,
        &[
            ("NVDRA_PARTITIONABLE", "true"),
            ("NVDRA_COUNTER_LAYOUT", "together"),
        ],
    ));
    assert_eq!(env.len(), 8);
    let off = parse_slices(&nvdra(
        &[&base[..], &["--partitionable=false"]].concat(),
        &[("NVDRA_PARTITIONABLE", "true")],
    ));
    assert_eq!(off.len(), 1, "the flag overrides the environment");
    assert!(
        off[0].spec.devices.as_ref().is_none_or(Vec::is_empty),
        "GPUs in MIG mode without instances offer nothing unless partitionable"
    );
}

#[test]
fn driver_name_is_configurable() {
    let out = nvdra(
        &[
            "inventory",
            "--profile",
            "l40s-pcie",
            "--node-name",
            "node-b",
            "-o",
            "slices",
        ],
        &[("NVDRA_DRIVER_NAME", "gpu.example.com")],
    );
    let slices = parse_slices(&out);
    assert_eq!(slices[0].spec.driver, "gpu.example.com");
    assert_eq!(
        slices[0].metadata.generate_name.as_deref(),
        Some("00000-gpu.example.com-node-b-")
    );

    let bad = nvdra(
        &[
            "inventory",
            "--profile",
            "l40s-pcie",
            "--node-name",
            "node-b",
            "--driver-name",
            "GPU_NVIDIA",
            "-o",
            "slices",
        ],
        &[],
    );
    assert_eq!(bad.status.code(), Some(64));
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(err.contains("--driver-name"), "{err}");
}

#[test]
fn mig_mode_gpus_are_published_as_mig_devices_only() {
    let slices = parse_slices(&nvdra(
        &[
            "inventory",
            "--profile",
            "a100-mig-mixed",
            "--node-name",
            "node-c",
            "-o",
            "slices",
        ],
        &[],
    ));
    let names: Vec<String> = slices
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten())
        .map(|d| d.name.clone())
        .collect();
    assert!(!names.contains(&"gpu-1".to_string()) && !names.contains(&"gpu-2".to_string()));
    assert!(
        names.contains(&"gpu-1-mig-3g20gb-9-4".to_string()),
        "{names:?}"
    );
    assert!(names.contains(&"gpu-0".to_string()) && names.contains(&"gpu-3".to_string()));
}

/// Without `--shared-capacity` the slices are byte for byte what the build before it printed
/// (`tests/data/slices/`, written by `nvdra inventory -o slices` at `730af4d`); with it, the same
/// devices, the GPUs outside MIG mode and the existing MIG devices allocatable many times,
/// strictly parseable.
#[test]
fn shared_capacity_off_leaves_the_slices_byte_identical() {
    for profile in ["dgx-h100", "a100-mig-mixed"] {
        for partitionable in ["false", "true"] {
            let golden = std::fs::read_to_string(format!(
                "{}/tests/data/slices/{profile}-partitionable-{partitionable}.yaml",
                env!("CARGO_MANIFEST_DIR")
            ))
            .unwrap();
            let args = |shared: &'static str| {
                vec![
                    "inventory".to_string(),
                    "--profile".into(),
                    profile.into(),
                    "--node-name".into(),
                    "node-a".into(),
                    "-o".into(),
                    "slices".into(),
                    format!("--partitionable={partitionable}"),
                    format!("--shared-capacity={shared}"),
                ]
            };
            let run = |shared| {
                let a = args(shared);
                let refs: Vec<&str> = a.iter().map(String::as_str).collect();
                let out = nvdra(&refs, &[]);
                assert!(
                    out.status.success(),
                    "{}",
                    String::from_utf8_lossy(&out.stderr)
                );
                String::from_utf8(out.stdout).unwrap()
            };
            assert!(
                run("false") == golden,
                "{profile} partitionable={partitionable} changed"
            );
            let names = |slices: &[ResourceSlice]| -> Vec<String> {
                slices
                    .iter()
                    .flat_map(|s| s.spec.devices.iter().flatten())
                    .map(|d| d.name.clone())
                    .collect()
            };
            let on = strict_parse(&run("true")).unwrap();
            let off = strict_parse(&golden).unwrap();
            assert_eq!(names(&on), names(&off), "{profile}: no twins");
            let shareable: Vec<String> = on
                .iter()
                .flat_map(|s| s.spec.devices.iter().flatten())
                .filter(|d| d.allow_multiple_allocations == Some(true))
                .map(|d| d.name.clone())
                .collect();
            // The GPUs outside MIG mode, and the MIG devices that exist (a100-mig-mixed has 2
            // and 7); never a MIG placement with no instance (partitionable).
            let existing_migs: Vec<String> = off
                .iter()
                .flat_map(|s| s.spec.devices.iter().flatten())
                .filter(|d| d.name.contains("-mig-"))
                .filter(|d| {
                    d.attributes
                        .as_ref()
                        .is_some_and(|a| a.contains_key("uuid"))
                })
                .map(|d| d.name.clone())
                .collect();
            let want = if profile == "dgx-h100" {
                (8, 0)
            } else {
                (2, 7)
            };
            assert_eq!(existing_migs.len(), want.1, "{profile}");
            let (migs, gpus): (Vec<String>, Vec<String>) =
                shareable.into_iter().partition(|n| n.contains("-mig-"));
            assert_eq!(gpus.len(), want.0, "{profile}: {gpus:?}");
            assert_eq!(
                migs, existing_migs,
                "{profile} partitionable={partitionable}"
            );
        }
    }
}

/// The must-show: `nvdra inventory --profile dgx-h100 -o slices --shared-capacity` prints
/// 8 devices, each allocatable many times, whose `memory` policy defaults to the whole GPU (a
/// claim that asks for no memory gets the GPU whole) and lets at most 48 shares fit, and whose
/// `multiprocessors` policy defaults to 0; no twins, no counters.
#[test]
fn dgx_h100_with_shared_capacity_prints_8_shareable_gpus() {
    let out = nvdra(
        &[
            "inventory",
            "--profile",
            "dgx-h100",
            "--node-name",
            "node-a",
            "-o",
            "slices",
            "--shared-capacity",
        ],
        &[],
    );
    let slices = parse_slices(&out);
    let text = String::from_utf8(out.stdout).unwrap();
    assert_eq!(slices.len(), 1);
    assert!(slices[0].spec.shared_counters.is_none());
    let devices = slices[0].spec.devices.as_ref().unwrap();
    let names: Vec<&str> = devices.iter().map(|d| d.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "gpu-0", "gpu-1", "gpu-2", "gpu-3", "gpu-4", "gpu-5", "gpu-6", "gpu-7"
        ]
    );
    for d in devices {
        assert_eq!(d.allow_multiple_allocations, Some(true), "{}", d.name);
        assert_eq!(d.consumes_counters, None, "{}", d.name);
        let caps = d.capacity.as_ref().unwrap();
        let policy = |name: &str| {
            let c = &caps[name];
            let p = c.request_policy.as_ref().unwrap();
            let r = p.valid_range.as_ref().unwrap();
            (
                c.value.0.as_str(),
                p.default.as_ref().unwrap().0.as_str(),
                r.min.0.as_str(),
                r.max.as_ref().unwrap().0.as_str(),
                r.step.as_ref().unwrap().0.as_str(),
            )
        };
        assert_eq!(
            policy("memory"),
            ("80Gi", "80Gi", "1672Mi", "80Gi", "1Mi"),
            "{}",
            d.name
        );
        assert_eq!(
            policy("multiprocessors"),
            ("132", "0", "0", "132", "1"),
            "{}",
            d.name
        );
    }
    // As a person reads it.
    assert_eq!(text.matches("allowMultipleAllocations: true").count(), 8);
    assert!(
        text.contains(
            "      memory:\n        requestPolicy:\n          default: 80Gi\n          \
             validRange:\n            max: 80Gi\n            min: 1672Mi\n            step: 1Mi\n        \
             value: 80Gi\n"
        ),
        "{text}"
    );
    assert!(
        !text.contains("-shared") && !text.contains("compute"),
        "{text}"
    );
}

fn dgx_h100_dynamic(extra: &[&str]) -> Vec<ResourceSlice> {
    let args = [
        &[
            "inventory",
            "--profile",
            "dgx-h100",
            "--node-name",
            "node-a",
            "-o",
            "slices",
            "--dynamic-mig",
        ][..],
        extra,
    ]
    .concat();
    parse_slices(&nvdra(&args, &[]))
}

/// The must-show: `nvdra inventory -o slices --dynamic-mig --profile dgx-h100` prints
/// every H100 whole (as without the switch) and in each of its 25 MIG placements, all of a GPU's
/// devices drawing on one counter set of its own, the whole GPU on every counter of it; the
/// slices parse strictly as ResourceSlices (the 1.35 layout: counters in a slice of their own).
/// With `--mig-profiles 1g.10gb,3g.40gb`, 1 + 7 + 2 devices per GPU.
#[test]
fn dgx_h100_with_dynamic_mig_prints_each_gpu_whole_and_in_every_placement() {
    let plain = parse_slices(&nvdra(
        &[
            "inventory",
            "--profile",
            "dgx-h100",
            "--node-name",
            "node-a",
            "-o",
            "slices",
        ],
        &[],
    ));
    for (extra, per_gpu) in [
        (&[][..], 1 + 7 + 7 + 4 + 3 + 2 + 1 + 1),
        (&["--mig-profiles", "1g.10gb,3g.40gb"][..], 1 + 7 + 2),
    ] {
        let slices = dgx_h100_dynamic(extra);
        let sets: Vec<_> = slices
            .iter()
            .flat_map(|s| s.spec.shared_counters.iter().flatten())
            .collect();
        assert_eq!(sets.len(), 8, "{extra:?}");
        assert!(
            slices
                .iter()
                .all(|s| s.spec.shared_counters.is_none() || s.spec.devices.is_none()),
            "1.35 layout"
        );
        let devices: Vec<_> = slices
            .iter()
            .flat_map(|s| s.spec.devices.iter().flatten())
            .collect();
        assert_eq!(devices.len(), 8 * per_gpu, "{extra:?}");
        for gpu in 0..8 {
            let name = format!("gpu-{gpu}");
            let set_name = format!("gpu-{gpu}-counter-set");
            let set = sets.iter().find(|s| s.name == set_name).unwrap();
            let mine: Vec<_> = devices
                .iter()
                .filter(|d| d.name == name || d.name.starts_with(&format!("{name}-mig-")))
                .collect();
            assert_eq!(mine.len(), per_gpu, "{name} {extra:?}");
            for d in &mine {
                let consumes = d.consumes_counters.as_ref().unwrap();
                assert_eq!(consumes.len(), 1, "{}", d.name);
                assert_eq!(consumes[0].counter_set, set_name, "{}", d.name);
            }
            // The whole GPU: as without the switch, and drawing every counter, all of each.
            let whole = mine.iter().find(|d| d.name == name).unwrap();
            assert_eq!(
                whole.consumes_counters.as_ref().unwrap()[0].counters,
                set.counters
            );
            let mut bare = (**whole).clone();
            bare.consumes_counters = None;
            let before = plain[0].spec.devices.as_ref().unwrap();
            assert_eq!(Some(&bare), before.iter().find(|d| d.name == name));
        }
    }
}

/// Without `--dynamic-mig` (or with `--dynamic-mig=off`) the slices are the golden ones,
/// byte for byte; with it, a node without Hopper GPUs publishes them too.
#[test]
fn dynamic_mig_off_or_without_hopper_leaves_the_slices_byte_identical() {
    for profile in ["dgx-h100", "a100-mig-mixed"] {
        for partitionable in ["false", "true"] {
            let golden = std::fs::read_to_string(format!(
                "{}/tests/data/slices/{profile}-partitionable-{partitionable}.yaml",
                env!("CARGO_MANIFEST_DIR")
            ))
            .unwrap();
            let partitionable = format!("--partitionable={partitionable}");
            let mut modes = vec!["--dynamic-mig=off"];
            if profile == "a100-mig-mixed" {
                modes.push("--dynamic-mig");
            }
            for mode in modes {
                let out = nvdra(
                    &[
                        "inventory",
                        "--profile",
                        profile,
                        "--node-name",
                        "node-a",
                        "-o",
                        "slices",
                        &partitionable,
                        mode,
                    ],
                    &[],
                );
                assert!(
                    out.status.success(),
                    "{}",
                    String::from_utf8_lossy(&out.stderr)
                );
                assert!(
                    String::from_utf8(out.stdout).unwrap() == golden,
                    "{profile} {partitionable} {mode} changed"
                );
            }
        }
    }
}

/// The built-in profiles, in `--profile`'s order.
const PROFILES: [&str; 8] = [
    "dgx-a100",
    "dgx-a100-mig",
    "dgx-h100",
    "hgx-h200",
    "l40s-pcie",
    "a100-mig-mixed",
    "pcie-pairs",
    "gb200-nvl72",
];

/// What every profile publishes, plain and in each publishing mode, is byte for byte what it
/// published when the golden set was written (`tests/data/slices/golden/<profile>-<mode>.yaml`,
/// `nvdra inventory --profile P --node-name node-a -o slices [--MODE]` at `20f04f7`, before
/// issue 35's refactor, which must not change a byte). A change on purpose rewrites the files
/// with that command and says why in its commit.
#[test]
fn every_profile_and_mode_publishes_its_golden_slices() {
    let mut checked = 0;
    for profile in PROFILES {
        for mode in ["plain", "partitionable", "shared-capacity", "dynamic-mig"] {
            let path = format!(
                "{}/tests/data/slices/golden/{profile}-{mode}.yaml",
                env!("CARGO_MANIFEST_DIR")
            );
            let golden = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
            let flag = format!("--{mode}");
            let mut args = vec![
                "inventory",
                "--profile",
                profile,
                "--node-name",
                "node-a",
                "-o",
                "slices",
            ];
            if mode != "plain" {
                args.push(&flag);
            }
            let out = nvdra(&args, &[]);
            assert!(
                out.status.success(),
                "{profile} {mode}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            let now = String::from_utf8(out.stdout).unwrap();
            if now != golden {
                let line = now
                    .lines()
                    .zip(golden.lines())
                    .position(|(a, b)| a != b)
                    .unwrap_or_else(|| now.lines().count().min(golden.lines().count()));
                panic!(
                    "{profile} {mode}: the slices differ from {path} from line {}: now {:?}, \
                     golden {:?}",
                    line + 1,
                    now.lines().nth(line),
                    golden.lines().nth(line)
                );
            }
            checked += 1;
        }
    }
    assert_eq!(checked, 32);
}

/// The golden set covers every built-in profile: a new one gets its files.
#[test]
fn the_golden_set_names_every_built_in_profile() {
    let out = nvdra(&["inventory", "--help"], &[]);
    let help = String::from_utf8_lossy(&out.stdout);
    let line = help
        .lines()
        .find(|l| l.contains("A built-in simulated node:"))
        .expect("--profile's help lists the profiles");
    let listed: Vec<&str> = line
        .split_once(':')
        .unwrap()
        .1
        .split(',')
        .map(str::trim)
        .collect();
    assert_eq!(listed, PROFILES);
}
