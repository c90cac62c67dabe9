//! Topology tests: file format errors with locations, profiles, semantic checks and generated ids.

use std::collections::BTreeMap;

use super::format::ModelSpec;
use super::locate::{Step, locate, steps};
use super::*;
use crate::inventory::Placement;

const MINIMAL: &str = r#"
version: v1
driverVersion: "570.124.06"
cudaDriverVersion: "12.8"
gpus:
  - index: 0
    model: H100-SXM5-80GB
    pciBusId: "0000:1A:00.0"
    numaNode: 0
"#;

fn parse_err(text: &str) -> Error {
    parse("t.yaml", text, "node-a").unwrap_err()
}

#[test]
fn catalog_mig_names_follow_nvidias_naming_rule() {
    // NVIDIA derives "<G>g.<GB>gb" from the profile's memory share; a catalog entry whose
    // figures contradict its name would publish a name a real GPU never has.
    let catalog: BTreeMap<String, ModelSpec> = parse_yaml("catalog", CATALOG).unwrap();
    let mut checked = 0;
    for (model, spec) in &catalog {
        for p in spec.mig.iter().flat_map(|m| &m.profiles) {
            let gb = crate::inventory::nvml::mig_memory_gb(spec.memory.0, p.memory.0 >> 20);
            let base = p.name.split('+').next().unwrap();
            let slices = base.split('g').next().unwrap();
            assert_eq!(base, format!("{slices}g.{gb}gb"), "{model} {}", p.name);
            assert!(p.memory.0 <= spec.memory.0, "{model} {}", p.name);
            checked += 1;
        }
    }
    assert!(checked >= 28, "{checked}");
}

#[test]
fn every_builtin_profile_parses() {
    for (name, _, _) in PROFILES {
        let inv = load_profile(name, "node-a").unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(!inv.gpus.is_empty(), "{name}");
    }
}

#[test]
fn minimal_file_fills_model_figures() {
    let inv = parse("t.yaml", MINIMAL, "node-a").unwrap();
    let g = &inv.gpus[0];
    assert_eq!(g.product_name, "NVIDIA H100 80GB HBM3");
    assert_eq!(g.memory_bytes, 80 << 30);
    assert_eq!(g.cuda_compute_capability.to_string(), "9.0");
    assert_eq!(g.pci_bus_id.as_str(), "0000:1a:00.0");
    assert_eq!(g.pcie_root.as_deref(), Some("pci0000:1a"));
    assert_eq!(g.minor, 0);
    assert!(g.mig.capable && !g.mig.enabled);
    assert!(g.uuid.as_str().starts_with("GPU-"));
}

#[test]
fn gb200_trays_form_cliques_of_18_by_node_number() {
    let clique = |node: &str| {
        let inv = load_profile("gb200-nvl72", node).unwrap();
        assert_eq!(inv.gpus.len(), 4, "{node}");
        let f: Vec<_> = inv.gpus.iter().map(|g| g.fabric.clone().unwrap()).collect();
        assert!(f.iter().all(|x| *x == f[0]), "one clique per tray: {f:?}");
        assert_eq!(
            f[0].cluster_uuid.as_str(),
            "0b4c7e1a-52d3-4f86-9a1e-3c5d7f90b2e4"
        );
        f[0].clique_id
    };
    assert_eq!(
        ["node-0", "node-17", "node-18", "node-35", "tray"].map(clique),
        [1, 1, 2, 2, 1]
    );
    let (a, b) = (
        load_profile("gb200-nvl72", "node-0").unwrap(),
        load_profile("gb200-nvl72", "node-1").unwrap(),
    );
    assert_ne!(a.gpus[0].uuid, b.gpus[0].uuid, "GPU UUIDs differ per node");
    let g = &a.gpus[3];
    assert_eq!(
        (g.product_name.as_str(), g.memory_bytes),
        ("NVIDIA GB200", 186 << 30)
    );
    assert_eq!(g.cuda_compute_capability.to_string(), "10.0");
    assert_eq!(g.architecture.as_deref(), Some("Blackwell"));
    assert_eq!(g.pci_bus_id.as_str(), "0019:01:00.0");
    assert_eq!(g.numa_node, Some(1));
}

#[test]
fn trays_per_clique_must_be_positive() {
    let text = MINIMAL.replace(
        "numaNode: 0",
        "numaNode: 0\n    fabric: {clusterUuid: 0b4c7e1a-52d3-4f86-9a1e-3c5d7f90b2e4, cliqueId: 1, traysPerClique: 0}",
    );
    let e = parse_err(&text);
    assert_eq!(e.key, "gpus[0].fabric.traysPerClique");
}

#[test]
fn uuids_are_stable_per_seed_and_differ_between_nodes() {
    let a1 = parse("t.yaml", MINIMAL, "node-a").unwrap();
    let a2 = parse("t.yaml", MINIMAL, "node-a").unwrap();
    let b = parse("t.yaml", MINIMAL, "node-b").unwrap();
    assert_eq!(a1.gpus[0].uuid, a2.gpus[0].uuid);
    assert_ne!(a1.gpus[0].uuid, b.gpus[0].uuid);
    assert_eq!(a1.gpus[0].uuid.as_str().len(), "GPU-".len() + 36);
}

#[test]
fn unknown_field_names_line_and_key() {
    let text = MINIMAL.replace("numaNode: 0", "numaNode: 0\n    memry: 1Gi");
    let e = parse_err(&text);
    assert_eq!(e.source_name, "t.yaml");
    assert_eq!(e.line, Some(10), "{e}");
    assert!(e.key.starts_with("gpus[0]"), "{e}");
    assert!(e.message.contains("unknown field `memry`"), "{e}");
    assert!(e.to_string().starts_with("t.yaml:10:"), "{e}");
}

#[test]
fn wrong_type_names_key() {
    let e = parse_err(&MINIMAL.replace("numaNode: 0", "numaNode: zero"));
    assert_eq!(e.key, "gpus[0].numaNode", "{e}");
    assert_eq!(e.line, Some(9), "{e}");
}

#[test]
fn errors_found_after_parsing_still_name_the_line() {
    let e = parse_err(&MINIMAL.replace("H100-SXM5-80GB", "H900"));
    assert_eq!((e.key.as_str(), e.line), ("gpus[0].model", Some(7)), "{e}");
    assert!(e.to_string().starts_with("t.yaml:7: gpus[0].model:"), "{e}");
    let e = parse_err(&MINIMAL.replace("0000:1A:00.0", "1A:00"));
    assert_eq!(e.line, Some(8), "{e}");
    let e = parse_err(&MINIMAL.replace("version: v1", "version: v9"));
    assert_eq!(e.line, Some(2), "{e}");

    // Second GPU, inside a flow mapping of a MIG device list.
    let text = format!(
        "{MINIMAL}  - index: 1\n    model: H100-SXM5-80GB\n    pciBusId: \"0000:1B:00.0\"\n    mig:\n      enabled: true\n      devices:\n        - {{profile: 3g.40gb, placement: 0}}\n        - {{profile: 3g.40gb, placement: 2}}\n"
    );
    let e = parse_err(&text);
    assert_eq!(e.key, "gpus[1].mig.devices[1].placement", "{e}");
    assert_eq!(e.line, Some(17), "{e}");
    // A flow sequence item resolves to its key's line.
    let e = parse_err(&MINIMAL.replace("numaNode: 0", "nvlinkPeers: [3]"));
    assert_eq!(e.line, Some(9), "{e}");
}

#[test]
fn key_paths_parse() {
    assert_eq!(
        steps("gpus[2].mig.devices[10].placement").unwrap(),
        vec![
            Step::Key("gpus"),
            Step::Index(2),
            Step::Key("mig"),
            Step::Key("devices"),
            Step::Index(10),
            Step::Key("placement")
        ]
    );
    assert!(steps("gpus[x]").is_none());
    assert_eq!(locate("a: 1\n", "b"), None);
}

#[test]
fn missing_required_field() {
    let e = parse_err(&MINIMAL.replace("    pciBusId: \"0000:1A:00.0\"\n", ""));
    assert!(e.message.contains("missing field `pciBusId`"), "{e}");
}

#[test]
fn malformed_yaml() {
    let e = parse_err("version: v1\ngpus: [\n");
    assert!(e.line.is_some(), "{e}");
}

#[test]
fn wrong_version() {
    let e = parse_err(&MINIMAL.replace("version: v1", "version: v9"));
    assert_eq!(e.key, "version");
    assert!(e.message.contains("\"v9\""), "{e}");
}

#[test]
fn unknown_model_lists_known_ones() {
    let e = parse_err(&MINIMAL.replace("H100-SXM5-80GB", "H900"));
    assert_eq!(e.key, "gpus[0].model");
    assert!(e.message.contains("A100-SXM4-40GB"), "{e}");
}

#[test]
fn bad_pci_bus_id() {
    let e = parse_err(&MINIMAL.replace("0000:1A:00.0", "1A:00"));
    assert_eq!(e.key, "gpus[0].pciBusId");
}

#[test]
fn bad_quantity_in_custom_model() {
    let text = format!(
        "{MINIMAL}models:\n  X:\n    productName: X\n    architecture: Hopper\n    computeCapability: \"9.0\"\n    memory: lots\n    multiprocessors: 1\n"
    );
    let e = parse_err(&text);
    assert_eq!(e.key, "models.X.memory", "{e}");
    assert!(e.message.contains("invalid quantity \"lots\""), "{e}");
}

#[test]
fn custom_model_is_used() {
    let text = format!(
        "{}models:\n  X:\n    productName: NVIDIA X\n    architecture: Blackwell\n    computeCapability: \"10.0\"\n    memory: 180Gi\n    multiprocessors: 148\n",
        MINIMAL.replace("H100-SXM5-80GB", "X")
    );
    let inv = parse("t.yaml", &text, "n").unwrap();
    assert_eq!(inv.gpus[0].product_name, "NVIDIA X");
    assert_eq!(inv.gpus[0].cuda_compute_capability.major, 10);
    assert!(!inv.gpus[0].mig.capable);
}

#[test]
fn duplicate_index_is_rejected() {
    let text = format!(
        "{MINIMAL}  - index: 0\n    model: H100-SXM5-80GB\n    pciBusId: \"0000:1B:00.0\"\n"
    );
    let e = parse_err(&text);
    assert!(e.message.contains("share the index 0"), "{e}");
}

#[test]
fn nvlink_references_are_checked() {
    let e = parse_err(&MINIMAL.replace("numaNode: 0", "nvlinkPeers: [3]"));
    assert_eq!(e.key, "gpus[0].nvlinkPeers[0]");
    let e = parse_err(&MINIMAL.replace("numaNode: 0", "nvlinkSwitches: [sw9]"));
    assert_eq!(e.key, "gpus[0].nvlinkSwitches[0]");
    assert!(e.message.contains("sw9"), "{e}");
}

#[test]
fn mig_devices_are_validated() {
    let with_mig = |devices: &str| {
        MINIMAL.replace(
            "numaNode: 0",
            &format!("mig:\n      enabled: true\n      devices:\n{devices}"),
        )
    };
    let e = parse_err(&with_mig("        - {profile: 9g.99gb, placement: 0}\n"));
    assert_eq!(e.key, "gpus[0].mig.devices[0].profile");
    assert!(e.message.contains("3g.40gb"), "{e}");
    let e = parse_err(&with_mig("        - {profile: 3g.40gb, placement: 2}\n"));
    assert_eq!(e.key, "gpus[0].mig.devices[0].placement");
    assert!(e.message.contains("valid starts: 0, 4"), "{e}");
    let e = parse_err(&with_mig(
        "        - {profile: 3g.40gb, placement: 4}\n        - {profile: 1g.10gb, placement: 5}\n",
    ));
    assert_eq!(e.key, "gpus[0].mig.devices[1].placement");
    assert!(e.message.contains("overlaps"), "{e}");

    let inv = parse(
        "t.yaml",
        &with_mig(
            "        - {profile: 3g.40gb, placement: 4}\n        - {profile: 1g.10gb, placement: 0}\n",
        ),
        "n",
    )
    .unwrap();
    let m = &inv.gpus[0].mig;
    assert!(m.enabled);
    assert_eq!(m.devices.len(), 2);
    assert_eq!(m.devices[0].gi_id, 1);
    assert_eq!(m.devices[1].placement, Placement { start: 0, size: 1 });
    assert!(m.devices[1].uuid.as_str().starts_with("MIG-"));
}

#[test]
fn fabric_registration_is_optional_and_validated() {
    let inv = parse("t.yaml", MINIMAL, "n").unwrap();
    assert_eq!(inv.gpus[0].fabric, None);

    let text = MINIMAL.replace(
        "numaNode: 0",
        "numaNode: 0\n    fabric: {clusterUuid: 6C1F3A52-8D2E-4B7A-9F10-0123456789AB, cliqueId: 7}",
    );
    let inv = parse("t.yaml", &text, "n").unwrap();
    let f = inv.gpus[0].fabric.as_ref().unwrap();
    assert_eq!(
        f.cluster_uuid.as_str(),
        "6c1f3a52-8d2e-4b7a-9f10-0123456789ab",
        "normalized to lower case"
    );
    assert_eq!(f.clique_id, 7);

    let e = parse_err(&text.replace("6C1F3A52-8D2E", "6C1F3A52"));
    assert_eq!(e.key, "gpus[0].fabric.clusterUuid", "{e}");
    assert_eq!(e.line, Some(10), "{e}");
    assert!(e.message.contains("8-4-4-4-12"), "{e}");
    let e = parse_err(&text.replace("cliqueId: 7", "cliqueId: 7, state: done"));
    assert!(e.message.contains("unknown field `state`"), "{e}");
    let e = parse_err(&text.replace(", cliqueId: 7", ""));
    assert!(e.message.contains("missing field `cliqueId`"), "{e}");
}

#[test]
fn mig_on_incapable_model_is_rejected() {
    let text = MINIMAL
        .replace("H100-SXM5-80GB", "L40S")
        .replace("numaNode: 0", "mig: {enabled: true}");
    let e = parse_err(&text);
    assert_eq!(e.key, "gpus[0].mig.enabled");
}

#[test]
fn unknown_profile_name_lists_choices() {
    let e = load_profile("dgx-z", "n").unwrap_err();
    assert!(e.to_string().contains("dgx-h100"), "{e}");
}

#[test]
fn missing_file_names_it() {
    let e = load_file(Path::new("/nonexistent/topo.yaml"), "n").unwrap_err();
    assert!(
        e.to_string()
            .starts_with("/nonexistent/topo.yaml: cannot read"),
        "{e}"
    );
}
