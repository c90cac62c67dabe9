//! `nvdra inventory` end to end: the built binary, its exit codes, outputs and configuration
//! precedence.

use std::process::{Command, Output};

use serde_json::Value;

fn nvdra(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_nvdra"));
    cmd.args(args);
    for var in [
        "NVDRA_CONFIG",
        "NVDRA_BACKEND",
        "NVDRA_PROFILE",
        "NVDRA_TOPOLOGY",
        "NODE_NAME",
        "NVIDIA_DRIVER_ROOT",
        "NVDRA_LOG_FORMAT",
    ] {
        cmd.env_remove(var);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("run nvdra")
}

fn json(args: &[&str], env: &[(&str, &str)]) -> Value {
    let out = nvdra(args, env);
    assert!(
        out.status.success(),
        "{args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("inventory JSON")
}

fn gpus(v: &Value) -> &Vec<Value> {
    v["gpus"].as_array().expect("gpus array")
}

#[test]
fn dgx_h100_has_eight_distinct_80gib_gpus_in_one_nvlink_domain() {
    let v = json(
        &[
            "inventory",
            "--profile",
            "dgx-h100",
            "-o",
            "json",
            "--node-name",
            "n1",
        ],
        &[],
    );
    let g = gpus(&v);
    assert_eq!(g.len(), 8);
    let uuids: std::collections::BTreeSet<&str> =
        g.iter().map(|x| x["uuid"].as_str().unwrap()).collect();
    assert_eq!(uuids.len(), 8);
    for x in g {
        assert_eq!(x["memoryBytes"], 80u64 << 30);
        assert_eq!(x["nvlinkDomain"], 0);
        assert_eq!(x["productName"], "NVIDIA H100 80GB HBM3");
        // What decides whether MIG mode may toggle: bare metal, nothing pending.
        assert_eq!(x["virtualization"], "bareMetal");
        assert_eq!(x["mig"].get("pending"), None);
    }
}

#[test]
fn l40s_has_four_nvlink_domains_on_two_numa_nodes() {
    let v = json(
        &[
            "inventory",
            "--profile",
            "l40s-pcie",
            "-o",
            "json",
            "--node-name",
            "n1",
        ],
        &[],
    );
    let g = gpus(&v);
    assert_eq!(g.len(), 4);
    let domains: Vec<u64> = g
        .iter()
        .map(|x| x["nvlinkDomain"].as_u64().unwrap())
        .collect();
    assert_eq!(domains, vec![0, 1, 2, 3]);
    let numa: Vec<u64> = g.iter().map(|x| x["numaNode"].as_u64().unwrap()).collect();
    assert_eq!(numa, vec![0, 0, 1, 1]);
}

#[test]
fn pcie_pairs_has_two_domains() {
    let v = json(
        &[
            "inventory",
            "--profile",
            "pcie-pairs",
            "-o",
            "json",
            "--node-name",
            "n1",
        ],
        &[],
    );
    let domains: Vec<u64> = gpus(&v)
        .iter()
        .map(|x| x["nvlinkDomain"].as_u64().unwrap())
        .collect();
    assert_eq!(domains, vec![0, 0, 2, 2]);
}

#[test]
fn mig_mixed_shows_mig_devices_with_profiles_and_parents() {
    let v = json(
        &[
            "inventory",
            "--profile",
            "a100-mig-mixed",
            "-o",
            "json",
            "--node-name",
            "n1",
        ],
        &[],
    );
    let g = gpus(&v);
    let mig_gpus: Vec<&Value> = g.iter().filter(|x| x["mig"]["enabled"] == true).collect();
    assert_eq!(mig_gpus.len(), 2);
    let profiles: Vec<&str> = mig_gpus
        .iter()
        .flat_map(|x| x["mig"]["devices"].as_array().unwrap())
        .map(|d| d["profile"].as_str().unwrap())
        .collect();
    for p in ["3g.20gb", "2g.10gb", "1g.5gb", "1g.10gb"] {
        assert!(profiles.contains(&p), "{p} missing from {profiles:?}");
    }

    let table = nvdra(
        &[
            "inventory",
            "--profile",
            "a100-mig-mixed",
            "--node-name",
            "n1",
        ],
        &[],
    );
    let text = String::from_utf8(table.stdout).unwrap();
    assert!(text.contains("  └ mig 1/0"), "{text}");
    assert!(
        text.lines().next().unwrap().ends_with(" MIG TOGGLE"),
        "{text}"
    );
    assert!(
        text.lines()
            .find(|l| l.starts_with("gpu-0 "))
            .unwrap()
            .ends_with(" no: Ampere (8.0): MIG mode changes only through the operator"),
        "{text}"
    );
}

#[test]
fn yaml_output_parses_to_the_same_inventory_as_json() {
    let args = [
        "inventory",
        "--profile",
        "hgx-h200",
        "--node-name",
        "n1",
        "-o",
    ];
    let j = json(&[&args[..], &["json"]].concat(), &[]);
    let out = nvdra(&[&args[..], &["yaml"]].concat(), &[]);
    assert!(out.status.success());
    let y: Value = serde_saphyr::from_slice(&out.stdout).unwrap();
    assert_eq!(j, y);
}

#[test]
fn nvml_without_a_driver_is_a_one_line_error_naming_the_library() {
    let out = nvdra(
        &["inventory", "--backend", "nvml", "--node-name", "n1"],
        &[],
    );
    assert!(!out.status.success());
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8(out.stderr).unwrap();
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert!(err.contains("libnvidia-ml.so.1"), "{err}");
    assert!(err.contains("--backend simulated"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn invalid_configuration_exits_64_naming_the_key() {
    for (args, needle) in [
        (vec!["inventory", "--profile", "dgx-z9"], "--profile"),
        (vec!["inventory", "--backend", "quantum"], "--backend"),
        (
            vec!["inventory", "-o", "xml", "--profile", "dgx-h100"],
            "--output",
        ),
        (
            vec![
                "inventory",
                "--profile",
                "dgx-h100",
                "--node-name",
                "Bad_Name",
            ],
            "--node-name",
        ),
    ] {
        let out = nvdra(&args, &[]);
        assert_eq!(out.status.code(), Some(64), "{args:?}");
        let err = String::from_utf8(out.stderr).unwrap();
        assert!(err.contains(needle), "{args:?}: {err}");
    }
}

#[test]
fn bad_topology_file_names_file_line_and_key() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("node.yaml");
    std::fs::write(
        &path,
        "version: v1\ndriverVersion: \"1\"\ncudaDriverVersion: \"12.4\"\ngpus:\n  - index: 0\n    model: L40S\n    pciBusId: \"0000:17:00.0\"\n    numa: 0\n",
    )
    .unwrap();
    let out = nvdra(
        &[
            "inventory",
            "--topology",
            path.to_str().unwrap(),
            "--node-name",
            "n1",
        ],
        &[],
    );
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(err.contains(&format!("{}:8:", path.display())), "{err}");
    assert!(err.contains("gpus[0]"), "{err}");
    assert!(err.contains("unknown field `numa`"), "{err}");

    // An error found after parsing names the line too, and says it once.
    std::fs::write(
        &path,
        "version: v1\ndriverVersion: \"1\"\ncudaDriverVersion: \"12.4\"\ngpus:\n  - index: 0\n    model: A100-SXM4-40GB\n    pciBusId: \"0000:17:00.0\"\n    mig:\n      enabled: true\n      devices:\n        - profile: 3g.20gb\n          placement: 1\n",
    )
    .unwrap();
    let out = nvdra(
        &[
            "inventory",
            "--topology",
            path.to_str().unwrap(),
            "--node-name",
            "n1",
        ],
        &[],
    );
    let err = String::from_utf8(out.stderr).unwrap();
    assert_eq!(
        err.trim_end(),
        format!(
            "nvdra: {}:12: gpus[0].mig.devices[0].placement: 3g.20gb cannot start at memory slice 1; valid starts: 0, 4",
            path.display()
        )
    );
}

#[test]
fn precedence_is_cli_then_env_then_file() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("nvdra.yaml");
    std::fs::write(
        &cfg,
        "version: v1\nprofile: l40s-pcie\nnodeName: from-file\n",
    )
    .unwrap();
    let cfg = cfg.to_str().unwrap();
    let count = |v: &Value| gpus(v).len();

    // File alone.
    let v = json(&["inventory", "-o", "json", "--config", cfg], &[]);
    assert_eq!(count(&v), 4);
    // Env beats file.
    let v = json(
        &["inventory", "-o", "json", "--config", cfg],
        &[("NVDRA_PROFILE", "dgx-h100")],
    );
    assert_eq!(count(&v), 8);
    // CLI beats env.
    let v = json(
        &[
            "inventory",
            "-o",
            "json",
            "--config",
            cfg,
            "--profile",
            "a100-mig-mixed",
        ],
        &[("NVDRA_PROFILE", "dgx-h100")],
    );
    assert_eq!(count(&v), 4);
    assert_eq!(gpus(&v)[1]["mig"]["enabled"], true);
    // The node name seeds simulated UUIDs: file vs env give different ones.
    let a = json(&["inventory", "-o", "json", "--config", cfg], &[]);
    let b = json(
        &["inventory", "-o", "json", "--config", cfg],
        &[("NODE_NAME", "from-env")],
    );
    assert_ne!(gpus(&a)[0]["uuid"], gpus(&b)[0]["uuid"]);
    // Config via env, bad key in it: exit 64 naming the file and key.
    std::fs::write(dir.path().join("bad.yaml"), "version: v1\nprofiel: x\n").unwrap();
    let bad = dir.path().join("bad.yaml");
    let out = nvdra(&["inventory"], &[("NVDRA_CONFIG", bad.to_str().unwrap())]);
    assert_eq!(out.status.code(), Some(64));
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(err.contains("bad.yaml") && err.contains("profiel"), "{err}");
}

#[test]
fn help_and_version() {
    let out = nvdra(&["--version"], &[]);
    assert!(out.status.success());
    assert!(String::from_utf8(out.stdout).unwrap().starts_with("nvdra "));
    let out = nvdra(&["inventory", "--help"], &[]);
    assert!(out.status.success());
    let help = String::from_utf8(out.stdout).unwrap();
    for flag in [
        "--backend",
        "--profile",
        "--topology",
        "--node-name",
        "NVDRA_PROFILE",
    ] {
        assert!(help.contains(flag), "{flag} missing from help");
    }
}
