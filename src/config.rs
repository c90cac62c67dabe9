//! Configuration: flags and their environment names (parsed by clap in `cli`), an optional
//! versioned YAML file, and defaults — merged once, CLI > env > file > defaults, into a validated
//! [`Config`] that the rest of the program reads without further checks.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::inventory::topology;

/// The config file version this build reads.
pub const FILE_VERSION: &str = "v1";

pub const DEFAULT_DRIVER_NAME: &str = "gpu.nvidia.com";
pub const DEFAULT_KUBELET_ROOT: &str = "/var/lib/kubelet";
pub const DEFAULT_CDI_ROOT: &str = "/var/run/cdi";
/// 8496: not the default of anything else found on a GPU node (8080 is everyone's; 9090-9999 is
/// Prometheus' exporter range, with node-exporter on 9100 and dcgm-exporter on 9400; 10250-10259
/// the kubelet and control plane; 30000-32767 NodePorts; 32768 and up the ephemeral range).
pub const DEFAULT_METRICS_ADDRESS: &str = "0.0.0.0:8496";

/// A configuration problem. `key` names the flag, variable or file key at fault.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("invalid configuration: {key}: {message}")]
pub struct Error {
    pub key: String,
    pub message: String,
}

fn invalid(key: &str, message: impl Into<String>) -> Error {
    Error {
        key: key.to_string(),
        message: message.into(),
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum BackendKind {
    /// NVML when it loads, otherwise an error.
    Auto,
    Nvml,
    Simulated,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    Auto,
    Dra,
    DevicePlugin,
    Both,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum LogFormat {
    #[default]
    Plain,
    Json,
}

/// Where GPUs come from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Backend {
    /// NVML; `required` is false for `auto` (only the error message differs).
    Nvml { auto: bool },
    /// A built-in profile.
    Profile(String),
    /// A topology file.
    Topology(PathBuf),
}

/// Which API server nvdra talks to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Api {
    /// In-cluster config, or the given kubeconfig.
    Kube { kubeconfig: Option<PathBuf> },
    /// The directory-backed API (`--api-dir`).
    Dir(PathBuf),
}

/// The optional config file (`--config`). Every key is optional; unknown keys are errors.
#[derive(Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FileConfig {
    pub version: String,
    pub mode: Option<Mode>,
    pub backend: Option<BackendKind>,
    pub profile: Option<String>,
    pub topology: Option<PathBuf>,
    pub node_name: Option<String>,
    pub driver_name: Option<String>,
    pub driver_root: Option<PathBuf>,
    pub kubelet_root: Option<PathBuf>,
    pub cdi_root: Option<PathBuf>,
    pub kubeconfig: Option<PathBuf>,
    pub api_dir: Option<PathBuf>,
    pub metrics_address: Option<String>,
    pub log_format: Option<LogFormat>,
    pub partitionable: Option<bool>,
}

impl FileConfig {
    pub fn load(path: &Path) -> Result<Self> {
        let key = format!("--config {}", path.display());
        let text = std::fs::read_to_string(path)
            .map_err(|e| invalid(&key, format!("cannot read the config file: {e}")))?;
        let file: FileConfig = crate::yaml::from_str(&text)
            .map_err(|e| invalid(&format!("{}: {}", path.display(), e.path), e.to_string()))?;
        if file.version != FILE_VERSION {
            return Err(invalid(
                &format!("{}: version", path.display()),
                format!(
                    "unsupported config version {:?}; this nvdra reads {FILE_VERSION:?}",
                    file.version
                ),
            ));
        }
        Ok(file)
    }
}

/// Values given on the command line or in the environment (clap merges those two).
#[derive(Clone, Debug, Default)]
pub struct Overrides {
    pub mode: Option<Mode>,
    pub backend: Option<BackendKind>,
    pub profile: Option<String>,
    pub topology: Option<PathBuf>,
    pub node_name: Option<String>,
    pub driver_name: Option<String>,
    pub driver_root: Option<PathBuf>,
    pub kubelet_root: Option<PathBuf>,
    pub cdi_root: Option<PathBuf>,
    pub kubeconfig: Option<PathBuf>,
    pub api_dir: Option<PathBuf>,
    pub metrics_address: Option<String>,
    pub log_format: Option<LogFormat>,
    pub partitionable: Option<bool>,
    pub pod_uid: Option<String>,
}

/// The validated configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    pub mode: Mode,
    pub backend: Backend,
    pub node_name: String,
    pub driver_name: String,
    pub driver_root: PathBuf,
    pub kubelet_root: PathBuf,
    pub cdi_root: PathBuf,
    pub api: Api,
    pub metrics_address: SocketAddr,
    pub log_format: LogFormat,
    /// Publish shared counters and every possible MIG placement (DRAPartitionableDevices).
    pub partitionable: bool,
    /// Set for rolling updates: socket names carry it.
    pub pod_uid: Option<String>,
}

impl Config {
    /// Where the plugin keeps its sockets, checkpoint and locks.
    pub fn plugin_dir(&self) -> PathBuf {
        self.kubelet_root.join("plugins").join(&self.driver_name)
    }

    pub fn registry_dir(&self) -> PathBuf {
        self.kubelet_root.join("plugins_registry")
    }
}

/// Merges CLI/env values over the file over defaults and validates the result.
pub fn resolve(cli: Overrides, file: Option<FileConfig>) -> Result<Config> {
    let file = file.unwrap_or_default();
    macro_rules! pick {
        ($field:ident) => {
            cli.$field.clone().or(file.$field.clone())
        };
    }

    let profile = pick!(profile);
    let topology = pick!(topology);
    // A profile or topology given at a higher level wins over one from a lower level, so that
    // `--topology x` overrides `profile:` from the file instead of conflicting with it.
    let (profile, topology) = match (
        &cli.profile,
        &cli.topology,
        profile.is_some() && topology.is_some(),
    ) {
        (Some(_), Some(_), _) => {
            return Err(invalid(
                "--profile/--topology",
                "give a built-in profile or a topology file, not both",
            ));
        }
        (Some(_), None, true) => (profile, None),
        (None, Some(_), true) => (None, topology),
        (None, None, true) => {
            return Err(invalid(
                "profile/topology",
                "the config file sets both; keep one",
            ));
        }
        _ => (profile, topology),
    };
    let backend_kind = pick!(backend);
    let backend = match (backend_kind, profile, topology) {
        (Some(BackendKind::Nvml), Some(_), _) | (Some(BackendKind::Nvml), _, Some(_)) => {
            return Err(invalid(
                "--backend",
                "nvml reads real GPUs; --profile and --topology need --backend simulated (or no --backend)",
            ));
        }
        (_, Some(p), None) => {
            if topology::builtin(&p).is_none() {
                return Err(invalid(
                    "--profile",
                    format!(
                        "no built-in profile named {p:?}; choose one of: {}",
                        topology::profile_names().join(", ")
                    ),
                ));
            }
            Backend::Profile(p)
        }
        (_, None, Some(t)) => Backend::Topology(t),
        (Some(BackendKind::Simulated), None, None) => {
            return Err(invalid(
                "--backend",
                format!(
                    "the simulated backend needs --profile NAME or --topology FILE (profiles: {})",
                    topology::profile_names().join(", ")
                ),
            ));
        }
        (Some(BackendKind::Nvml), None, None) => Backend::Nvml { auto: false },
        (Some(BackendKind::Auto) | None, None, None) => Backend::Nvml { auto: true },
        (_, Some(_), Some(_)) => unreachable!("resolved above"),
    };

    let node_name = match pick!(node_name) {
        Some(n) => n,
        None => hostname().ok_or_else(|| {
            invalid(
                "--node-name",
                "not given and the host name could not be read; set --node-name or NODE_NAME",
            )
        })?,
    };
    check_dns_subdomain("--node-name", &node_name, 253)?;

    let driver_name = pick!(driver_name).unwrap_or_else(|| DEFAULT_DRIVER_NAME.into());
    check_dns_subdomain("--driver-name", &driver_name, 63)?;

    let api = match (pick!(api_dir), pick!(kubeconfig)) {
        (Some(_), Some(_)) if cli.api_dir.is_some() && cli.kubeconfig.is_some() => {
            return Err(invalid(
                "--api-dir/--kubeconfig",
                "give a kubeconfig or an API directory, not both",
            ));
        }
        (Some(dir), _) if cli.kubeconfig.is_none() => Api::Dir(dir),
        (_, kubeconfig) => Api::Kube { kubeconfig },
    };

    let metrics = pick!(metrics_address).unwrap_or_else(|| DEFAULT_METRICS_ADDRESS.into());
    let metrics_address: SocketAddr = metrics.parse().map_err(|_| {
        invalid(
            "--metrics-address",
            format!("{metrics:?} is not an address like {DEFAULT_METRICS_ADDRESS}"),
        )
    })?;

    let mut paths = [
        (
            "--driver-root",
            pick!(driver_root).unwrap_or_else(|| "/".into()),
        ),
        (
            "--kubelet-root",
            pick!(kubelet_root).unwrap_or_else(|| DEFAULT_KUBELET_ROOT.into()),
        ),
        (
            "--cdi-root",
            pick!(cdi_root).unwrap_or_else(|| DEFAULT_CDI_ROOT.into()),
        ),
    ];
    for (key, p) in &mut paths {
        if !p.is_absolute() {
            *p = std::env::current_dir()
                .map_err(|e| invalid(key, format!("relative path and no working directory: {e}")))?
                .join(&*p);
        }
    }
    let [(_, driver_root), (_, kubelet_root), (_, cdi_root)] = paths;

    if let Some(uid) = &cli.pod_uid
        && (uid.is_empty()
            || uid.len() > 64
            || !uid.chars().all(|c| c.is_ascii_alphanumeric() || c == '-'))
    {
        return Err(invalid(
            "--pod-uid",
            format!("{uid:?} is not a pod UID (letters, digits and dashes)"),
        ));
    }

    Ok(Config {
        mode: pick!(mode).unwrap_or(Mode::Auto),
        backend,
        node_name,
        driver_name,
        driver_root,
        kubelet_root,
        cdi_root,
        api,
        metrics_address,
        log_format: pick!(log_format).unwrap_or_default(),
        partitionable: pick!(partitionable).unwrap_or(false),
        pod_uid: cli.pod_uid,
    })
}

/// Lower-case RFC 1123 subdomain: labels of `[a-z0-9-]`, not starting or ending with `-`.
pub fn check_dns_subdomain(key: &str, value: &str, max: usize) -> Result<()> {
    if crate::dns::is_subdomain(value, max) {
        Ok(())
    } else {
        Err(invalid(
            key,
            format!("{value:?} is not a lower-case DNS subdomain of at most {max} characters"),
        ))
    }
}

fn hostname() -> Option<String> {
    let raw = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())?;
    let name = raw.trim().to_ascii_lowercase();
    (!name.is_empty()).then_some(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> Overrides {
        Overrides {
            node_name: Some("node-a".into()),
            ..Default::default()
        }
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
    }

    #[test]
    fn profile_implies_simulated() {
        let c = resolve(
            Overrides {
                profile: Some("dgx-h100".into()),
                ..base()
            },
            None,
        )
        .unwrap();
        assert_eq!(c.backend, Backend::Profile("dgx-h100".into()));
    }

    #[test]
    fn cli_beats_file_beats_default() {
        let f = file(
            "version: v1\ndriverName: file.example.com\ncdiRoot: /etc/cdi\nprofile: l40s-pcie\n",
        )
        .unwrap();
        let c = resolve(
            Overrides {
                driver_name: Some("cli.example.com".into()),
                ..base()
            },
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
            Overrides {
                topology: Some("/t.yaml".into()),
                ..base()
            },
            Some(f),
        )
        .unwrap();
        assert_eq!(c.backend, Backend::Topology("/t.yaml".into()));
    }

    #[test]
    fn invalid_values_name_the_key() {
        let cases = [
            (
                Overrides {
                    driver_name: Some("GPU_NVIDIA".into()),
                    ..base()
                },
                "--driver-name",
            ),
            (
                Overrides {
                    profile: Some("nope".into()),
                    ..base()
                },
                "--profile",
            ),
            (
                Overrides {
                    metrics_address: Some("eight".into()),
                    ..base()
                },
                "--metrics-address",
            ),
            (
                Overrides {
                    backend: Some(BackendKind::Simulated),
                    ..base()
                },
                "--backend",
            ),
            (
                Overrides {
                    backend: Some(BackendKind::Nvml),
                    profile: Some("dgx-h100".into()),
                    ..base()
                },
                "--backend",
            ),
            (
                Overrides {
                    profile: Some("dgx-h100".into()),
                    topology: Some("/x".into()),
                    ..base()
                },
                "--profile/--topology",
            ),
            (
                Overrides {
                    node_name: Some("Node_A".into()),
                    ..Default::default()
                },
                "--node-name",
            ),
            (
                Overrides {
                    pod_uid: Some("a/b".into()),
                    ..base()
                },
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
    fn api_dir_and_kubeconfig() {
        let c = resolve(
            Overrides {
                api_dir: Some("/tmp/api".into()),
                ..base()
            },
            None,
        )
        .unwrap();
        assert_eq!(c.api, Api::Dir("/tmp/api".into()));
        let f = file("version: v1\napiDir: /tmp/api\n").unwrap();
        let c = resolve(
            Overrides {
                kubeconfig: Some("/k".into()),
                ..base()
            },
            Some(f),
        )
        .unwrap();
        assert_eq!(
            c.api,
            Api::Kube {
                kubeconfig: Some("/k".into())
            }
        );
    }
}
