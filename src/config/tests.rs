use std::collections::BTreeMap;
use std::path::Path;

use super::file::{file_keys, keys_of};
use super::*;

fn base() -> Settings {
    let mut s = Settings::default();
    s.backend.node_name = Some("node-a".into());
    s
}

/// `base()` changed by `f`.
fn with(f: impl FnOnce(&mut Settings)) -> Settings {
    let mut s = base();
    f(&mut s);
    s
}

fn file(text: &str) -> Result<FileConfig> {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("c.yaml");
    std::fs::write(&p, text).unwrap();
    FileConfig::load(&p)
}

#[test]
fn defaults() {
    let c = resolve(base(), None).unwrap();
    assert_eq!(c.backend, Backend::Nvml { auto: true });
    assert_eq!(c.driver_name, "gpu.nvidia.com");
    assert_eq!(c.kubelet_root, PathBuf::from("/var/lib/kubelet"));
    assert_eq!(c.cdi_root, PathBuf::from("/var/run/cdi"));
    assert_eq!(c.api, Api::Kube { kubeconfig: None });
    assert_eq!(c.mode, Mode::Auto);
    assert!(!c.partitionable);
    assert_eq!(
        c.plugin_dir(),
        PathBuf::from("/var/lib/kubelet/plugins/gpu.nvidia.com")
    );
    assert_eq!(c.driver_root, crate::cdi::DriverRoot::at(Path::new("/")));
    assert_eq!(c.metrics_address.to_string(), DEFAULT_METRICS_ADDRESS);
    assert_eq!(c.log_format, LogFormat::Plain);
}

/// The GPU Operator's layout: the host path CDI specs name, the path nvdra reads, and the device
/// root, each defaulting to the driver root.
#[test]
fn driver_root_splits_into_host_container_and_device_roots() {
    use crate::cdi::DriverRoot;
    let c = resolve(
        with(|s| {
            s.backend.driver_root = Some("/run/nvidia/driver".into());
            s.backend.driver_root_ctr_path = Some("/driver-root".into());
        }),
        None,
    )
    .unwrap();
    assert_eq!(
        c.driver_root,
        DriverRoot::new(
            "/run/nvidia/driver".into(),
            "/driver-root".into(),
            "/run/nvidia/driver".into()
        )
    );
    assert_eq!(
        c.driver_root
            .read_path(Path::new("/run/nvidia/driver/usr/bin/nvidia-smi")),
        Path::new("/driver-root/usr/bin/nvidia-smi")
    );
    let f = file("version: v1\ndevRoot: /\n").unwrap();
    let c = resolve(base(), Some(f)).unwrap();
    assert_eq!(
        c.driver_root,
        DriverRoot::new("/".into(), "/".into(), "/".into())
    );
}

#[test]
fn profile_implies_simulated() {
    let c = resolve(with(|s| s.backend.profile = Some("dgx-h100".into())), None).unwrap();
    assert_eq!(c.backend, Backend::Profile("dgx-h100".into()));
}

#[test]
fn cli_beats_file_beats_default() {
    let f =
        file("version: v1\ndriverName: file.example.com\ncdiRoot: /etc/cdi\nprofile: l40s-pcie\n")
            .unwrap();
    let c = resolve(
        with(|s| s.plugin.driver_name = Some("cli.example.com".into())),
        Some(f),
    )
    .unwrap();
    assert_eq!(c.driver_name, "cli.example.com");
    assert_eq!(c.cdi_root, PathBuf::from("/etc/cdi"));
    assert_eq!(c.backend, Backend::Profile("l40s-pcie".into()));
    assert_eq!(c.kubelet_root, PathBuf::from("/var/lib/kubelet"));
}

#[test]
fn cli_topology_overrides_file_profile() {
    let f = file("version: v1\nprofile: l40s-pcie\n").unwrap();
    let c = resolve(
        with(|s| s.backend.topology = Some("/t.yaml".into())),
        Some(f),
    )
    .unwrap();
    assert_eq!(c.backend, Backend::Topology("/t.yaml".into()));
}

#[test]
fn invalid_values_name_the_key() {
    let cases: [(Settings, &str); 8] = [
        (
            with(|s| s.plugin.driver_name = Some("GPU_NVIDIA".into())),
            "--driver-name",
        ),
        (
            with(|s| s.backend.profile = Some("nope".into())),
            "--profile",
        ),
        (
            with(|s| s.daemon.metrics_address = Some("eight".into())),
            "--metrics-address",
        ),
        (
            with(|s| s.backend.backend = Some(BackendKind::Simulated)),
            "--backend",
        ),
        (
            with(|s| {
                s.backend.backend = Some(BackendKind::Nvml);
                s.backend.profile = Some("dgx-h100".into());
            }),
            "--backend",
        ),
        (
            with(|s| {
                s.backend.profile = Some("dgx-h100".into());
                s.backend.topology = Some("/x".into());
            }),
            "--profile/--topology",
        ),
        (
            with(|s| s.backend.node_name = Some("Node_A".into())),
            "--node-name",
        ),
        (
            with(|s| s.kubelet.pod_uid = Some("a/b".into())),
            "--pod-uid",
        ),
    ];
    for (o, key) in cases {
        let e = resolve(o, None).unwrap_err();
        assert_eq!(e.key, key, "{e}");
    }
}

#[test]
fn file_errors_name_file_and_key() {
    let e = file("version: v1\ncdiroot: /x\n").unwrap_err();
    assert!(
        e.key.ends_with("c.yaml: cdiroot") || e.key.ends_with("c.yaml: ."),
        "{e}"
    );
    assert!(e.message.contains("unknown field `cdiroot`"), "{e}");
    let e = file("version: v2\n").unwrap_err();
    assert!(e.key.ends_with("c.yaml: version"), "{e}");
    let e = file("version: v1\nmode: sideways\n").unwrap_err();
    assert!(e.key.ends_with("c.yaml: mode"), "{e}");
    let e = FileConfig::load(Path::new("/nonexistent.yaml")).unwrap_err();
    assert!(e.key.contains("/nonexistent.yaml"), "{e}");
}

#[test]
fn file_value_errors_keep_line_and_expected_keys() {
    // The value is read by the file's own deserializer: the line is known.
    let e = file("version: v1\nnodeName: n\npartitionable: maybe\n").unwrap_err();
    assert!(e.key.ends_with("c.yaml: partitionable"), "{e}");
    assert!(e.message.contains("line 3"), "{e}");
    // An unknown key lists the keys there are.
    let e = file("version: v1\ncdiroot: /x\n").unwrap_err();
    assert!(e.message.contains("cdiRoot"), "{e}");
    let e = file("nodeName: n\n").unwrap_err();
    assert!(e.message.contains("missing field `version`"), "{e}");
    // A key given twice (refused by the parser, so the first one cannot be dropped silently).
    let e = file("version: v1\ncdiRoot: /a\ncdiRoot: /b\n").unwrap_err();
    assert!(
        e.message.contains("duplicate") && e.message.contains("cdiRoot"),
        "{e}"
    );
}

#[test]
fn a_file_may_not_set_both_of_two_alternatives() {
    let e = file("version: v1\nprofile: dgx-h100\ntopology: /t.yaml\n").unwrap_err();
    assert!(e.key.ends_with("c.yaml: profile/topology"), "{e}");
    let e = file("version: v1\napiDir: /api\nkubeconfig: /k\n").unwrap_err();
    assert!(e.key.ends_with("c.yaml: apiDir/kubeconfig"), "{e}");
}

#[test]
fn api_dir_and_kubeconfig() {
    let c = resolve(with(|s| s.api.api_dir = Some("/tmp/api".into())), None).unwrap();
    assert_eq!(c.api, Api::Dir("/tmp/api".into()));
    let f = file("version: v1\napiDir: /tmp/api\n").unwrap();
    let c = resolve(
        with(|s| s.api.cluster.kubeconfig = Some("/k".into())),
        Some(f),
    )
    .unwrap();
    assert_eq!(
        c.api,
        Api::Kube {
            kubeconfig: Some("/k".into())
        }
    );
    // And the other way round: the command line's directory replaces the file's kubeconfig.
    let f = file("version: v1\nkubeconfig: /k\n").unwrap();
    let c = resolve(with(|s| s.api.api_dir = Some("/tmp/api".into())), Some(f)).unwrap();
    assert_eq!(c.api, Api::Dir("/tmp/api".into()));
}

#[test]
fn every_file_key_lands_in_the_struct_that_declares_it() {
    let cases = [
        ("backend: simulated", "backend"),
        ("profile: dgx-h100", "profile"),
        ("topology: /t.yaml", "topology"),
        ("driverRoot: /run/nvidia/driver", "driverRoot"),
        ("devRoot: /", "devRoot"),
        ("driverRootCtrPath: /driver-root", "driverRootCtrPath"),
        ("nodeName: n1", "nodeName"),
        ("driverName: gpu.example.com", "driverName"),
        ("partitionable: true", "partitionable"),
        ("sharedCapacity: true", "sharedCapacity"),
        ("consumableShares: 4", "consumableShares"),
        ("dynamicMig: keep-on", "dynamicMig"),
        ("migProfiles: [1g.10gb]", "migProfiles"),
        ("shareTrustDomain: namespace", "shareTrustDomain"),
        ("kubeletRoot: /k", "kubeletRoot"),
        ("cdiRoot: /etc/cdi", "cdiRoot"),
        ("deviceMetadata: true", "deviceMetadata"),
        ("kubeconfig: /kc", "kubeconfig"),
        ("apiDir: /api", "apiDir"),
        ("mode: dra", "mode"),
        ("metricsAddress: 127.0.0.1:1", "metricsAddress"),
        ("logFormat: json", "logFormat"),
        ("devicePluginConfig: /dp.yaml", "devicePluginConfig"),
        ("devicePluginGpuMemory: true", "devicePluginGpuMemory"),
        ("ignoredXids: \"13\"", "ignoredXids"),
        ("xidOverrides: 94=ignore", "xidOverrides"),
        ("healthQuietPeriod: 1m", "healthQuietPeriod"),
        ("healthProbeInterval: 5s", "healthProbeInterval"),
        ("faultFile: /faults", "faultFile"),
        ("mpsProbeInterval: 2s", "mpsProbeInterval"),
        ("nodeLabels: true", "nodeLabels"),
        ("claimStatus: false", "claimStatus"),
        ("mpsRoot: /run/mps", "mpsRoot"),
    ];
    let mut covered: Vec<&str> = vec!["version"];
    for (line, key) in cases {
        let s = file(&format!("version: v1\n{line}\n")).unwrap().settings;
        let set = match key {
            "backend" => s.backend.backend.is_some(),
            "profile" => s.backend.profile.is_some(),
            "topology" => s.backend.topology.is_some(),
            "driverRoot" => s.backend.driver_root.is_some(),
            "devRoot" => s.backend.dev_root.is_some(),
            "driverRootCtrPath" => s.backend.driver_root_ctr_path.is_some(),
            "nodeName" => s.backend.node_name.is_some(),
            "driverName" => s.plugin.driver_name.is_some(),
            "partitionable" => s.plugin.partitionable == Some(true),
            "sharedCapacity" => s.plugin.shared_capacity == Some(true),
            "consumableShares" => s
                .plugin
                .consumable_shares
                .is_some_and(|m| m.to_string() == "4"),
            "dynamicMig" => s.plugin.dynamic_mig == Some(DynamicMig::KeepOn),
            "migProfiles" => s.plugin.mig_profiles == Some(vec!["1g.10gb".into()]),
            "shareTrustDomain" => s.plugin.share_trust_domain == Some(TrustDomain::Namespace),
            "kubeletRoot" => s.kubelet.kubelet_root.is_some(),
            "cdiRoot" => s.kubelet.cdi_root.is_some(),
            "deviceMetadata" => s.kubelet.device_metadata == Some(true),
            "kubeconfig" => s.api.cluster.kubeconfig.is_some(),
            "apiDir" => s.api.api_dir.is_some(),
            "mode" => s.serve.mode == Some(Mode::Dra),
            "metricsAddress" => s.daemon.metrics_address.is_some(),
            "devicePluginConfig" => s.serve.device_plugin_config.is_some(),
            "devicePluginGpuMemory" => s.daemon.device_plugin_gpu_memory == Some(true),
            "nodeLabels" => s.daemon.node_labels.is_some(),
            "claimStatus" => s.daemon.claim_status == Some(false),
            "logFormat" => s.log.log_format == Some(LogFormat::Json),
            "ignoredXids" => s.health.ignored_xids.as_deref() == Some("13"),
            "xidOverrides" => s.health.xid_overrides.is_some(),
            "healthQuietPeriod" => s.health.health_quiet_period.is_some(),
            "healthProbeInterval" => s.health.health_probe_interval.is_some(),
            "faultFile" => s.health.fault_file.is_some(),
            "mpsRoot" => s.mps.mps_root.is_some(),
            "mpsProbeInterval" => s.health.mps_probe_interval.is_some(),
            _ => unreachable!(),
        };
        assert!(set, "{line}: {s:?}");
        // Exactly one struct picked the value up.
        let unset = Settings::default().sections();
        let changed = s
            .sections()
            .iter()
            .zip(&unset)
            .filter(|(a, b)| a != b)
            .count();
        assert_eq!(changed, 1, "{line}");
        covered.push(key);
    }
    covered.sort_unstable();
    let mut keys = file_keys().to_vec();
    keys.sort_unstable();
    assert_eq!(covered, keys, "a file key without a case here");
}

#[test]
fn keys_come_from_the_derive() {
    assert_eq!(
        keys_of::<PluginSettings>(),
        [
            "driverName",
            "partitionable",
            "sharedCapacity",
            "consumableShares",
            "dynamicMig",
            "migProfiles",
            "shareTrustDomain"
        ]
    );
    // Skipped fields are not file keys.
    assert_eq!(
        keys_of::<KubeletSettings>(),
        ["kubeletRoot", "cdiRoot", "deviceMetadata"]
    );
}

// ---------------------------------------------------------------------------------------------
// The README's configuration table against the declarations

/// One row of the README's configuration table.
#[derive(Debug)]
struct Row {
    flag: String,
    /// `(run)` or `(inventory)` after the flag: a flag of that subcommand only.
    only: Option<String>,
    env: String,
    key: Option<String>,
    default: String,
}

fn readme_rows() -> Vec<Row> {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    let section = readme
        .split("\n## Configuration\n")
        .nth(1)
        .expect("a Configuration section");
    let code = |cell: &str| -> Option<String> {
        let cell = cell.trim();
        let rest = cell.strip_prefix('`')?;
        Some(rest[..rest.find('`')?].to_string())
    };
    section
        .lines()
        .skip_while(|l| !l.starts_with("| flag |"))
        .skip(2)
        .take_while(|l| l.starts_with('|'))
        .map(|line| {
            // `\|` inside a cell is a literal bar.
            let line = line.replace("\\|", "\u{0}");
            let cells: Vec<String> = line
                .trim_matches('|')
                .split('|')
                .map(|c| c.replace('\u{0}', "|").trim().to_string())
                .collect();
            assert_eq!(cells.len(), 4, "{line}");
            let flag_cell = code(&cells[0]).unwrap_or_else(|| panic!("no flag in {line}"));
            // `--partitionable[=BOOL]`, `--log-format plain|json`: the name ends at what is not one.
            let flag: String = flag_cell
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
                .collect();
            let after = cells[0].rsplit('`').next().unwrap().trim();
            let only = (!after.is_empty()).then(|| after.trim_matches(['(', ')']).to_string());
            Row {
                flag,
                only,
                env: code(&cells[1]).unwrap_or_else(|| panic!("no env in {line}")),
                key: code(&cells[2]),
                default: cells[3].clone(),
            }
        })
        .collect()
}

/// `driver_root` → `driverRoot`: the `rename_all = "camelCase"` every settings struct has.
fn camel(id: &str) -> String {
    let mut out = String::new();
    let mut upper = false;
    for c in id.chars() {
        if c == '_' {
            upper = true;
        } else if upper {
            out.push(c.to_ascii_uppercase());
            upper = false;
        } else {
            out.push(c);
        }
    }
    out
}

/// A flag as clap declares it.
struct Flag<'a> {
    /// The subcommands it belongs to; `""` for a global flag.
    scopes: Vec<&'a str>,
    env: String,
    clap_default: Option<String>,
    /// The field name (snake_case).
    id: String,
}

#[test]
fn readme_configuration_table_matches_the_declarations() {
    use clap::CommandFactory;

    let cli = crate::cli::Cli::command();
    // Every flag with an env name, by its long name.
    let mut flags: BTreeMap<String, Flag> = BTreeMap::new();
    let scopes = [("", &cli)]
        .into_iter()
        .chain(cli.get_subcommands().map(|c| (c.get_name(), c)));
    for (scope, cmd) in scopes {
        for arg in cmd.get_arguments() {
            let (Some(long), Some(env)) = (arg.get_long(), arg.get_env()) else {
                continue;
            };
            if arg.is_hide_set() {
                continue;
            }
            let clap_default = arg
                .get_default_values()
                .first()
                .map(|v| v.to_string_lossy().into_owned());
            let flag = flags.entry(format!("--{long}")).or_insert(Flag {
                scopes: Vec::new(),
                env: env.to_string_lossy().into_owned(),
                clap_default,
                id: arg.get_id().to_string(),
            });
            flag.scopes.push(scope);
        }
    }
    let subcommands = cli
        .get_subcommands()
        .filter(|c| c.get_arguments().count() > 0)
        .count();

    let mut defaults = serde_json::Map::new();
    let d = Settings::defaults();
    for section in d.sections() {
        let serde_json::Value::Object(m) = section else {
            panic!("a settings struct serializes to a map");
        };
        defaults.extend(m);
    }

    let rows = readme_rows();
    let mut keys_seen = vec!["version".to_string()];
    for row in &rows {
        let Flag {
            scopes,
            env,
            clap_default,
            id,
        } = flags.get(&row.flag).unwrap_or_else(|| {
            panic!(
                "README lists {}, which is not a flag with an env name",
                row.flag
            )
        });
        assert_eq!(&row.env, env, "{}: env name", row.flag);
        // A flag of every subcommand (or a global one) carries no marker; one of a single
        // subcommand says which.
        let only = (!scopes.contains(&"") && scopes.len() < subcommands).then(|| scopes.join(", "));
        assert_eq!(
            row.only, only,
            "{}: the subcommands it belongs to",
            row.flag
        );
        let key = camel(id);
        let file_key = file_keys().contains(&key.as_str()).then_some(key.clone());
        assert_eq!(row.key, file_key, "{}: file key", row.flag);
        if let Some(k) = &file_key {
            keys_seen.push(k.clone());
        }
        let default = match defaults.get(&key) {
            Some(serde_json::Value::String(s)) => Some(s.clone()),
            Some(serde_json::Value::Null) | None => clap_default.clone(),
            Some(v) => Some(v.to_string()),
        };
        match default {
            Some(v) => assert!(
                row.default.starts_with(&format!("`{v}`")),
                "{}: README says the default is {:?}, the code {v:?}",
                row.flag,
                row.default
            ),
            None => assert!(
                !row.default.starts_with('`'),
                "{}: README gives a default ({}) the code does not have",
                row.flag,
                row.default
            ),
        }
    }
    for flag in flags.keys() {
        assert!(
            rows.iter().any(|r| &r.flag == flag),
            "{flag} is missing from the README's configuration table"
        );
    }
    keys_seen.sort_unstable();
    let mut keys = file_keys().to_vec();
    keys.sort_unstable();
    assert_eq!(keys_seen, keys, "file keys in the README");
}

#[test]
fn health_settings_resolve_into_the_policy_or_name_the_key() {
    let base = || Settings {
        backend: BackendSettings {
            profile: Some("dgx-h100".into()),
            node_name: Some("n".into()),
            ..Default::default()
        },
        ..Default::default()
    };
    let c = resolve(base(), None).unwrap();
    assert_eq!(c.health, crate::health::Policy::default());
    assert_eq!(c.fault_file, None);

    let mut s = base();
    s.health.ignored_xids = Some("".into());
    s.health.xid_overrides = Some("79=NoExecute".into());
    s.health.health_quiet_period = Some("90s".into());
    s.health.fault_file = Some("/run/faults".into());
    let c = resolve(s, None).unwrap();
    assert!(c.health.ignored.is_empty());
    assert_eq!(
        c.health.rule(79),
        crate::health::XidRule::Critical(crate::inventory::TaintEffect::NoExecute)
    );
    assert_eq!(c.health.quiet_period, std::time::Duration::from_secs(90));
    assert_eq!(c.mps_probe_interval, std::time::Duration::from_secs(5));
    assert_eq!(
        c.fault_file.as_deref(),
        Some(std::path::Path::new("/run/faults"))
    );

    for (set, key) in [
        (
            (|s: &mut Settings| s.health.ignored_xids = Some("13,x".into())) as fn(&mut Settings),
            "--ignored-xids",
        ),
        (
            |s: &mut Settings| s.health.xid_overrides = Some("79".into()),
            "--xid-overrides",
        ),
        (
            |s: &mut Settings| s.health.health_quiet_period = Some("soon".into()),
            "--health-quiet-period",
        ),
        (
            |s: &mut Settings| s.health.health_probe_interval = Some("0s".into()),
            "--health-probe-interval",
        ),
        (
            |s: &mut Settings| s.health.mps_probe_interval = Some("0s".into()),
            "--mps-probe-interval",
        ),
        (
            |s: &mut Settings| {
                s.backend.profile = None;
                s.backend.backend = Some(BackendKind::Nvml);
                s.health.fault_file = Some("/f".into());
            },
            "--fault-file",
        ),
    ] {
        let mut s = base();
        set(&mut s);
        assert_eq!(resolve(s, None).unwrap_err().key, key);
    }
}

#[test]
fn dynamic_mig_is_off_by_default_and_a_bare_flag_turns_it_on() {
    assert_eq!(resolve(base(), None).unwrap().dynamic_mig, DynamicMig::Off);
    let c = resolve(
        with(|s| s.plugin.dynamic_mig = Some(DynamicMig::KeepOn)),
        None,
    )
    .unwrap();
    assert!(c.dynamic_mig.enabled());
}

#[test]
fn mig_profiles_are_checked_and_kept_once_each() {
    let set = |v: &[&str]| {
        resolve(
            with(|s| s.plugin.mig_profiles = Some(v.iter().map(|s| s.to_string()).collect())),
            None,
        )
    };
    assert_eq!(resolve(base(), None).unwrap().mig_profiles, None);
    assert_eq!(
        set(&["1g.10gb", " 3g.40gb", "1g.10gb", "1g.20gb+me"])
            .unwrap()
            .mig_profiles,
        Some(vec![
            "1g.10gb".into(),
            "3g.40gb".into(),
            "1g.20gb+me".into()
        ])
    );
    for bad in [&["1G.10GB"][..], &["gpu"], &["1g10gb"], &[]] {
        let e = set(bad).unwrap_err().to_string();
        assert!(e.contains("--mig-profiles"), "{bad:?}: {e}");
    }
}

/// `--consumable-shares` takes NVIDIA's modes; `--shared-capacity` is its `memory` and keeps
/// meaning that alone; the two saying different modes is an error naming both.
#[test]
fn shared_capacity_is_the_memory_mode_and_contradicting_it_names_both_flags() {
    let mode = |shared: Option<bool>, mode: Option<&str>| {
        resolve(
            with(|s| {
                s.plugin.shared_capacity = shared;
                s.plugin.consumable_shares = mode.map(|m| m.parse().unwrap());
            }),
            None,
        )
        .map(|c| c.shared_capacity.to_string())
    };
    assert_eq!(mode(None, None).unwrap(), "disabled");
    assert_eq!(mode(Some(true), None).unwrap(), "memory");
    assert_eq!(mode(Some(true), Some("memory")).unwrap(), "memory");
    assert_eq!(mode(None, Some("memory")).unwrap(), "memory");
    assert_eq!(mode(None, Some("unlimited")).unwrap(), "unlimited");
    assert_eq!(mode(Some(false), Some("4")).unwrap(), "4");
    for other in ["unlimited", "4"] {
        let e = mode(Some(true), Some(other)).unwrap_err();
        assert_eq!(e.key, "--shared-capacity/--consumable-shares");
        assert!(
            e.message.contains(&format!("--consumable-shares={other}")),
            "{e}"
        );
    }
    // The file takes NVIDIA's Helm spelling (a string) and a bare number; a bad mode is an
    // error at the key.
    let c = resolve(
        base(),
        Some(file("version: v1\nconsumableShares: \"8\"\n").unwrap()),
    );
    assert_eq!(c.unwrap().shared_capacity.to_string(), "8");
    let e = file("version: v1\nconsumableShares: 64\n").unwrap_err();
    assert!(e.to_string().contains("consumableShares"), "{e}");
    assert!(e.to_string().contains("at most 48"), "{e}");
    // From the file too, against --shared-capacity on the command line.
    let e = resolve(
        with(|s| s.plugin.shared_capacity = Some(true)),
        Some(file("version: v1\nconsumableShares: unlimited\n").unwrap()),
    )
    .unwrap_err();
    assert_eq!(e.key, "--shared-capacity/--consumable-shares");
}

/// The flag and NVIDIA's environment name, as clap reads them.
#[test]
fn consumable_shares_is_read_from_the_flag_and_nvidias_env_name() {
    use clap::Parser;
    let cli = crate::cli::Cli::try_parse_from([
        "nvdra",
        "inventory",
        "--profile",
        "dgx-h100",
        "--consumable-shares=4",
    ])
    .unwrap();
    let crate::cli::Command::Inventory(args) = &cli.command else {
        panic!("inventory");
    };
    assert_eq!(
        args.plugin
            .consumable_shares
            .map(|m| m.to_string())
            .as_deref(),
        Some("4")
    );
    let e = crate::cli::Cli::try_parse_from(["nvdra", "inventory", "--consumable-shares=0"])
        .unwrap_err()
        .to_string();
    assert!(e.contains("1 to 48"), "{e}");
}

/// `--share-trust-domain`: off by default; the flag, `NVDRA_SHARE_TRUST_DOMAIN` and the file
/// key `shareTrustDomain` take `off`, `namespace` or `label:<key>`; a bad rule is an error that
/// names the flag or the file key.
#[test]
fn share_trust_domain_is_off_by_default_and_a_bad_rule_names_its_key() {
    use clap::Parser;
    let c = resolve(base(), None).unwrap();
    assert_eq!(c.share_trust_domain, TrustDomain::Off);
    let c = resolve(
        base(),
        Some(file("version: v1\nshareTrustDomain: label:example.com/tenant\n").unwrap()),
    )
    .unwrap();
    assert_eq!(
        c.share_trust_domain,
        TrustDomain::Label("example.com/tenant".into())
    );
    // The command line over the file.
    let c = resolve(
        with(|s| s.plugin.share_trust_domain = Some(TrustDomain::Namespace)),
        Some(file("version: v1\nshareTrustDomain: \"off\"\n").unwrap()),
    )
    .unwrap();
    assert_eq!(c.share_trust_domain, TrustDomain::Namespace);
    // A bad value in the file names the key, its line and what to give.
    let e = file("version: v1\nshareTrustDomain: tenant\n")
        .unwrap_err()
        .to_string();
    assert!(e.contains("shareTrustDomain"), "{e}");
    assert!(e.contains("off, namespace, or label:<key>"), "{e}");
    let e = file("version: v1\nshareTrustDomain: \"label:-x\"\n")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("shareTrustDomain") && e.contains("label:-x"),
        "{e}"
    );
    // On the command line, clap names the flag.
    let cli = crate::cli::Cli::try_parse_from([
        "nvdra",
        "run",
        "--profile",
        "dgx-h100",
        "--share-trust-domain=namespace",
    ])
    .unwrap();
    let crate::cli::Command::Run(args) = &cli.command else {
        panic!("run");
    };
    assert_eq!(args.plugin.share_trust_domain, Some(TrustDomain::Namespace));
    let e = crate::cli::Cli::try_parse_from(["nvdra", "run", "--share-trust-domain=team"])
        .unwrap_err()
        .to_string();
    assert!(e.contains("--share-trust-domain"), "{e}");
    assert!(e.contains("not a trust domain"), "{e}");
}

/// The device-plugin path's GPU-memory units go to pods of any namespace (its Allocate names
/// none): with a trust domain that is refused, naming both flags, unless only DRA serves.
#[test]
fn share_trust_domain_beside_device_plugin_gpu_memory_names_both_flags() {
    let both = |mode: Mode| {
        resolve(
            with(|s| {
                s.plugin.share_trust_domain = Some(TrustDomain::Namespace);
                s.daemon.device_plugin_gpu_memory = Some(true);
                s.serve.mode = Some(mode);
            }),
            None,
        )
    };
    let e = both(Mode::Both).unwrap_err();
    assert_eq!(e.key, "--share-trust-domain/--device-plugin-gpu-memory");
    assert!(e.message.contains("--share-trust-domain=namespace"), "{e}");
    assert!(both(Mode::Auto).is_err());
    assert!(both(Mode::Dra).is_ok());
}
