//! Configuration: flags, their environment names, an optional versioned YAML file and defaults,
//! merged once (CLI > env > file > defaults) into a validated [`Config`] that the rest of the
//! program reads without further checks.
//!
//! Each setting is declared once, as an optional field of the struct of its concern
//! ([`BackendSettings`], [`PluginSettings`], [`KubeletSettings`], [`ApiSettings`],
//! [`DaemonSettings`], [`LogSettings`]): its clap attributes give the flag, the env name and the
//! help (`cli` flattens the structs into its subcommands), its serde name the file key (the file
//! is one flat map over every struct, read by [`file`]), and [`Section::defaults`] the default.
//! Clap merges the command line over the environment; [`resolve`] layers that over the file over
//! the defaults with [`Section::or`] (and [`Section::under`] for settings that are alternatives)
//! and validates the result once. The README's configuration table is checked against these
//! declarations by a test.

use std::net::SocketAddr;
use std::path::PathBuf;

use serde::Deserialize;

use crate::inventory::topology;

mod file;

pub use file::FileConfig;

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
#[cfg_attr(test, derive(serde::Serialize))]
#[serde(rename_all = "kebab-case")]
pub enum BackendKind {
    /// NVML when it loads, otherwise an error.
    Auto,
    Nvml,
    Simulated,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[cfg_attr(test, derive(serde::Serialize))]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    Auto,
    Dra,
    DevicePlugin,
    Both,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[cfg_attr(test, derive(serde::Serialize))]
#[serde(rename_all = "kebab-case")]
pub enum LogFormat {
    #[default]
    Plain,
    Json,
}

// ---------------------------------------------------------------------------------------------
// The settings, one struct per concern

/// One concern's settings, every field optional so that levels can be layered.
pub trait Section: Default + serde::de::DeserializeOwned {
    /// The built-in values; `None` where there is none, or where validation computes it.
    fn defaults() -> Self;
    /// `self`, each unset setting taken from `lower`.
    fn or(self, lower: Self) -> Self;
    /// `self` as a lower level under `higher`: of two alternatives (`--profile` and
    /// `--topology`), either one given at a higher level replaces both, so `--topology x`
    /// overrides `profile:` from the file instead of conflicting with it.
    fn under(self, _higher: &Self) -> Self {
        self
    }
}

/// Where GPUs come from, and the node they belong to.
#[derive(Clone, Debug, Default, PartialEq, Eq, clap::Args, Deserialize)]
#[cfg_attr(test, derive(serde::Serialize))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct BackendSettings {
    /// auto: NVML when it loads. --profile or --topology imply simulated.
    #[arg(long, env = "NVDRA_BACKEND", value_enum)]
    pub backend: Option<BackendKind>,

    /// A built-in simulated node: dgx-a100, dgx-a100-mig, dgx-h100, hgx-h200, l40s-pcie,
    /// a100-mig-mixed, pcie-pairs.
    #[arg(
        long,
        env = "NVDRA_PROFILE",
        value_name = "NAME",
        conflicts_with = "topology"
    )]
    pub profile: Option<String>,

    /// A simulated topology file (YAML, version: v1).
    #[arg(long, env = "NVDRA_TOPOLOGY", value_name = "FILE")]
    pub topology: Option<PathBuf>,

    /// Root of the NVIDIA driver installation (where libnvidia-ml.so.1 and the device nodes are).
    #[arg(long, env = "NVIDIA_DRIVER_ROOT", value_name = "DIR")]
    pub driver_root: Option<PathBuf>,

    /// This node's name; defaults to the host name.
    #[arg(long, env = "NODE_NAME", value_name = "NAME")]
    pub node_name: Option<String>,
}

impl Section for BackendSettings {
    fn defaults() -> Self {
        Self {
            backend: Some(BackendKind::Auto),
            driver_root: Some("/".into()),
            ..Self::default()
        }
    }

    fn or(self, lower: Self) -> Self {
        let Self {
            backend,
            profile,
            topology,
            driver_root,
            node_name,
        } = self;
        Self {
            backend: backend.or(lower.backend),
            profile: profile.or(lower.profile),
            topology: topology.or(lower.topology),
            driver_root: driver_root.or(lower.driver_root),
            node_name: node_name.or(lower.node_name),
        }
    }

    fn under(mut self, higher: &Self) -> Self {
        if higher.profile.is_some() || higher.topology.is_some() {
            (self.profile, self.topology) = (None, None);
        }
        self
    }
}

/// What the plugin publishes and under which name.
#[derive(Clone, Debug, Default, PartialEq, Eq, clap::Args, Deserialize)]
#[cfg_attr(test, derive(serde::Serialize))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PluginSettings {
    /// DRA driver name (also the CDI vendor suffix and the plugin directory name).
    #[arg(long, env = "NVDRA_DRIVER_NAME", value_name = "NAME")]
    pub driver_name: Option<String>,

    /// Publish shared counters and every possible MIG placement, creating MIG devices at
    /// prepare (needs the DRAPartitionableDevices feature gate); inventory -o slices shows the
    /// result.
    #[arg(
        long,
        env = "NVDRA_PARTITIONABLE",
        value_name = "BOOL",
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true"
    )]
    pub partitionable: Option<bool>,
}

impl Section for PluginSettings {
    fn defaults() -> Self {
        Self {
            driver_name: Some(DEFAULT_DRIVER_NAME.into()),
            partitionable: Some(false),
        }
    }

    fn or(self, lower: Self) -> Self {
        let Self {
            driver_name,
            partitionable,
        } = self;
        Self {
            driver_name: driver_name.or(lower.driver_name),
            partitionable: partitionable.or(lower.partitionable),
        }
    }
}

/// Where the kubelet and the container runtime look for what the plugin writes.
#[derive(Clone, Debug, Default, PartialEq, Eq, clap::Args, Deserialize)]
#[cfg_attr(test, derive(serde::Serialize))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct KubeletSettings {
    /// The kubelet's --root-dir; sockets go to its plugins/ and plugins_registry/.
    #[arg(long, env = "NVDRA_KUBELET_ROOT", value_name = "DIR")]
    pub kubelet_root: Option<PathBuf>,

    /// Where claim CDI specs are written (the container runtime's CDI spec directory).
    #[arg(long, env = "NVDRA_CDI_ROOT", value_name = "DIR")]
    pub cdi_root: Option<PathBuf>,

    /// This pod's UID (downward API), for rolling updates: socket names carry it so two
    /// instances can serve side by side.
    // Not a file key: it differs for every pod of the DaemonSet.
    #[arg(long, env = "POD_UID", value_name = "UID")]
    #[serde(skip)]
    pub pod_uid: Option<String>,
}

impl Section for KubeletSettings {
    fn defaults() -> Self {
        Self {
            kubelet_root: Some(DEFAULT_KUBELET_ROOT.into()),
            cdi_root: Some(DEFAULT_CDI_ROOT.into()),
            pod_uid: None,
        }
    }

    fn or(self, lower: Self) -> Self {
        let Self {
            kubelet_root,
            cdi_root,
            pod_uid,
        } = self;
        Self {
            kubelet_root: kubelet_root.or(lower.kubelet_root),
            cdi_root: cdi_root.or(lower.cdi_root),
            pod_uid: pod_uid.or(lower.pod_uid),
        }
    }
}

/// Which API server nvdra talks to.
#[derive(Clone, Debug, Default, PartialEq, Eq, clap::Args, Deserialize)]
#[cfg_attr(test, derive(serde::Serialize))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ApiSettings {
    /// Talk to the API server of this kubeconfig instead of the in-cluster config.
    #[arg(
        long,
        env = "NVDRA_KUBECONFIG",
        value_name = "FILE",
        conflicts_with = "api_dir"
    )]
    pub kubeconfig: Option<PathBuf>,

    /// Use a directory as the API (claims read from DIR/resourceclaims, slices written to
    /// DIR/resourceslices), for runs without a cluster.
    #[arg(long, env = "NVDRA_API_DIR", value_name = "DIR")]
    pub api_dir: Option<PathBuf>,
}

impl Section for ApiSettings {
    fn defaults() -> Self {
        Self::default()
    }

    fn or(self, lower: Self) -> Self {
        let Self {
            kubeconfig,
            api_dir,
        } = self;
        Self {
            kubeconfig: kubeconfig.or(lower.kubeconfig),
            api_dir: api_dir.or(lower.api_dir),
        }
    }

    fn under(mut self, higher: &Self) -> Self {
        if higher.kubeconfig.is_some() || higher.api_dir.is_some() {
            (self.kubeconfig, self.api_dir) = (None, None);
        }
        self
    }
}

/// What the node agent serves, and where its metrics are.
#[derive(Clone, Debug, Default, PartialEq, Eq, clap::Args, Deserialize)]
#[cfg_attr(test, derive(serde::Serialize))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DaemonSettings {
    /// dra, device-plugin, both, or auto (DRA where the cluster supports it).
    #[arg(long, env = "NVDRA_MODE", value_enum)]
    pub mode: Option<Mode>,

    /// Address of /metrics, /healthz and /readyz.
    #[arg(long, env = "NVDRA_METRICS_ADDRESS", value_name = "ADDR")]
    pub metrics_address: Option<String>,
}

impl Section for DaemonSettings {
    fn defaults() -> Self {
        Self {
            mode: Some(Mode::Auto),
            metrics_address: Some(DEFAULT_METRICS_ADDRESS.into()),
        }
    }

    fn or(self, lower: Self) -> Self {
        let Self {
            mode,
            metrics_address,
        } = self;
        Self {
            mode: mode.or(lower.mode),
            metrics_address: metrics_address.or(lower.metrics_address),
        }
    }
}

/// How nvdra logs (every subcommand).
#[derive(Clone, Debug, Default, PartialEq, Eq, clap::Args, Deserialize)]
#[cfg_attr(test, derive(serde::Serialize))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LogSettings {
    /// Log format on stderr.
    #[arg(long, env = "NVDRA_LOG_FORMAT", global = true, value_enum)]
    pub log_format: Option<LogFormat>,
}

impl Section for LogSettings {
    fn defaults() -> Self {
        Self {
            log_format: Some(LogFormat::Plain),
        }
    }

    fn or(self, lower: Self) -> Self {
        let Self { log_format } = self;
        Self {
            log_format: log_format.or(lower.log_format),
        }
    }
}

/// Every setting, by concern: one level (the command line and environment, or the file).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Settings {
    pub backend: BackendSettings,
    pub plugin: PluginSettings,
    pub kubelet: KubeletSettings,
    pub api: ApiSettings,
    pub daemon: DaemonSettings,
    pub log: LogSettings,
}

impl Settings {
    pub fn defaults() -> Self {
        Self {
            backend: Section::defaults(),
            plugin: Section::defaults(),
            kubelet: Section::defaults(),
            api: Section::defaults(),
            daemon: Section::defaults(),
            log: Section::defaults(),
        }
    }

    /// `self`, each unset setting taken from `lower`.
    pub fn or(self, lower: Self) -> Self {
        let Self {
            backend,
            plugin,
            kubelet,
            api,
            daemon,
            log,
        } = self;
        Self {
            backend: backend.or(lower.backend),
            plugin: plugin.or(lower.plugin),
            kubelet: kubelet.or(lower.kubelet),
            api: api.or(lower.api),
            daemon: daemon.or(lower.daemon),
            log: log.or(lower.log),
        }
    }

    /// `self` as a lower level under `higher` (see [`Section::under`]).
    pub fn under(self, higher: &Self) -> Self {
        let Self {
            backend,
            plugin,
            kubelet,
            api,
            daemon,
            log,
        } = self;
        Self {
            backend: backend.under(&higher.backend),
            plugin: plugin.under(&higher.plugin),
            kubelet: kubelet.under(&higher.kubelet),
            api: api.under(&higher.api),
            daemon: daemon.under(&higher.daemon),
            log: log.under(&higher.log),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The validated configuration

/// Where GPUs come from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Backend {
    /// NVML; `auto` is true when no backend was chosen (only the error message differs).
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

/// Layers the command line and environment (`cli`, as clap merged them) over the file over the
/// defaults, and validates the result.
pub fn resolve(cli: Settings, file: Option<FileConfig>) -> Result<Config> {
    let file = file.map(|f| f.settings).unwrap_or_default().under(&cli);
    let merged = cli.or(file);
    let defaults = Settings::defaults().under(&merged);
    validate(merged.or(defaults))
}

/// The one place settings are checked and turned into a [`Config`].
fn validate(settings: Settings) -> Result<Config> {
    let Settings {
        backend,
        plugin,
        kubelet,
        api,
        daemon,
        log,
    } = settings;

    let names = || topology::profile_names().join(", ");
    let backend_kind = need(backend.backend, "--backend")?;
    let source = match (backend_kind, backend.profile, backend.topology) {
        (_, Some(_), Some(_)) => {
            return Err(invalid(
                "--profile/--topology",
                "give a built-in profile or a topology file, not both",
            ));
        }
        (BackendKind::Nvml, Some(_), None) | (BackendKind::Nvml, None, Some(_)) => {
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
                        names()
                    ),
                ));
            }
            Backend::Profile(p)
        }
        (_, None, Some(t)) => Backend::Topology(t),
        (BackendKind::Simulated, None, None) => {
            return Err(invalid(
                "--backend",
                format!(
                    "the simulated backend needs --profile NAME or --topology FILE (profiles: {})",
                    names()
                ),
            ));
        }
        (BackendKind::Nvml, None, None) => Backend::Nvml { auto: false },
        (BackendKind::Auto, None, None) => Backend::Nvml { auto: true },
    };

    let node_name = match backend.node_name {
        Some(n) => n,
        None => hostname().ok_or_else(|| {
            invalid(
                "--node-name",
                "not given and the host name could not be read; set --node-name or NODE_NAME",
            )
        })?,
    };
    check_dns_subdomain("--node-name", &node_name, 253)?;

    let driver_name = need(plugin.driver_name, "--driver-name")?;
    check_dns_subdomain("--driver-name", &driver_name, 63)?;

    let api = match (api.api_dir, api.kubeconfig) {
        (Some(_), Some(_)) => {
            return Err(invalid(
                "--api-dir/--kubeconfig",
                "give a kubeconfig or an API directory, not both",
            ));
        }
        (Some(dir), None) => Api::Dir(dir),
        (None, kubeconfig) => Api::Kube { kubeconfig },
    };

    let metrics = need(daemon.metrics_address, "--metrics-address")?;
    let metrics_address: SocketAddr = metrics.parse().map_err(|_| {
        invalid(
            "--metrics-address",
            format!("{metrics:?} is not an address like {DEFAULT_METRICS_ADDRESS}"),
        )
    })?;

    let driver_root = absolute("--driver-root", need(backend.driver_root, "--driver-root")?)?;
    let kubelet_root = absolute(
        "--kubelet-root",
        need(kubelet.kubelet_root, "--kubelet-root")?,
    )?;
    let cdi_root = absolute("--cdi-root", need(kubelet.cdi_root, "--cdi-root")?)?;

    if let Some(uid) = &kubelet.pod_uid
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
        mode: need(daemon.mode, "--mode")?,
        backend: source,
        node_name,
        driver_name,
        driver_root,
        kubelet_root,
        cdi_root,
        api,
        metrics_address,
        log_format: need(log.log_format, "--log-format")?,
        partitionable: need(plugin.partitionable, "--partitionable")?,
        pod_uid: kubelet.pod_uid,
    })
}

/// A setting that [`Settings::defaults`] fills; `None` only if a default was forgotten there
/// (the `defaults` test resolves an empty configuration, so that cannot ship).
fn need<T>(value: Option<T>, key: &str) -> Result<T> {
    value.ok_or_else(|| invalid(key, "has no value and no default"))
}

/// `path`, relative to the working directory if it is not absolute.
fn absolute(key: &str, path: PathBuf) -> Result<PathBuf> {
    if path.is_absolute() {
        return Ok(path);
    }
    let cwd = std::env::current_dir()
        .map_err(|e| invalid(key, format!("relative path and no working directory: {e}")))?;
    Ok(cwd.join(path))
}

/// Lower-case RFC 1123 subdomain: labels of `[a-z0-9-]`, not starting or ending with `-`.
pub fn check_dns_subdomain(key: &str, value: &str, max: usize) -> Result<()> {
    let ok = !value.is_empty()
        && value.len() <= max
        && value.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        });
    if ok {
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
mod tests;
