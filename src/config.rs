//! Configuration: flags, their environment names, an optional versioned YAML file and defaults,
//! merged once (CLI > env > file > defaults) into a validated [`Config`] that the rest of the
//! program reads without further checks.
//!
//! Each setting is declared once (`config/settings.rs`), as an optional field of the struct of
//! its concern (a section, such as [`BackendSettings`]): its clap attributes give the flag, the
//! env name and the help (`cli` flattens the structs into the subcommands that take them), its
//! serde name the file key (the file is one flat map over every struct, read by
//! `config/file.rs`), and [`Section::defaults`] the default. The sections are listed once, in
//! [`Settings`]; what goes through all of them (defaults, layering, the file's keys) is derived
//! from that list.
//! Clap merges the command line over the environment; [`resolve`] layers that over the file over
//! the defaults with [`Layer::or`] (and [`Section::under`] for settings that are alternatives)
//! and validates the result once. The README's configuration table is checked against these
//! declarations by a test.

use std::net::SocketAddr;
use std::path::PathBuf;

use serde::Deserialize;

use crate::cdi::DriverRoot;
use crate::inventory::topology;

mod file;
mod settings;

pub use file::FileConfig;
// Every section, `Settings` and the traits that layer them.
pub use settings::*;

/// The config file version this build reads.
pub const FILE_VERSION: &str = "v1";

pub const DEFAULT_DRIVER_NAME: &str = "gpu.nvidia.com";
pub const DEFAULT_KUBELET_ROOT: &str = kubelet_plugin::paths::DEFAULT_KUBELET_ROOT;
pub const DEFAULT_CDI_ROOT: &str = "/var/run/cdi";
/// 8496: not the default of anything else found on a GPU node (8080 is everyone's; 9090-9999 is
/// Prometheus' exporter range, with node-exporter on 9100 and dcgm-exporter on 9400; 10250-10259
/// the kubelet and control plane; 30000-32767 NodePorts; 32768 and up the ephemeral range).
pub const DEFAULT_METRICS_ADDRESS: &str = "0.0.0.0:8496";
/// A tmpfs on every Linux host (`/run`), and short: `<root>/<id>/pipe/control` stays far under
/// the 107 bytes a socket path may hold.
pub const DEFAULT_MPS_ROOT: &str = "/run/nvdra/mps";

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

/// Whether GPUs switch MIG mode at run time (`--dynamic-mig`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[cfg_attr(test, derive(serde::Serialize))]
#[serde(rename_all = "kebab-case")]
pub enum DynamicMig {
    /// MIG mode is the operator's: GPUs publish what their mode offers.
    #[default]
    Off,
    /// MIG mode on at a GPU's first MIG claim, off after its last.
    On,
    /// As `on`, but MIG mode stays on after the last MIG claim (for GPUs slow to toggle).
    KeepOn,
}

impl DynamicMig {
    /// Whether GPUs switch MIG mode at run time at all.
    pub fn enabled(self) -> bool {
        self != DynamicMig::Off
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
    /// The driver's root on the host, where nvdra reads it, and the device nodes' root.
    pub driver_root: DriverRoot,
    pub kubelet_root: PathBuf,
    pub cdi_root: PathBuf,
    /// Write device metadata files for prepared claims (`--device-metadata`).
    pub device_metadata: bool,
    pub api: Api,
    pub metrics_address: SocketAddr,
    pub log_format: LogFormat,
    /// Publish shared counters and every possible MIG placement (DRAPartitionableDevices).
    pub partitionable: bool,
    /// How GPUs are published shareable (DRAConsumableCapacity): `--consumable-shares`, or
    /// `memory` for `--shared-capacity`; [`ConsumableShares::Disabled`] publishes them whole.
    pub shared_capacity: ConsumableShares,
    /// Switch MIG mode at run time on GPUs that can (`--dynamic-mig`).
    pub dynamic_mig: DynamicMig,
    /// The MIG profiles whose placements are published; all when `None` (`--mig-profiles`).
    pub mig_profiles: Option<Vec<String>>,
    /// Who may hold shares of one GPU together (`--share-trust-domain`).
    pub share_trust_domain: crate::sharing::trust::TrustDomain,
    /// Set for rolling updates: socket names carry it.
    pub pod_uid: Option<String>,
    /// NVIDIA's device-plugin config file; read when the device-plugin path starts.
    pub device_plugin_config: Option<PathBuf>,
    /// Advertise `nvidia.com/gpu-memory` on the device-plugin path.
    pub device_plugin_gpu_memory: bool,
    /// How health events are judged and unhealthy GPUs recover.
    pub health: crate::health::Policy,
    /// Simulated backend only: the fault-injection file (`crate::health::faults`).
    pub fault_file: Option<PathBuf>,
    /// How often each GPU's share daemon is asked whether it answers.
    pub mps_probe_interval: std::time::Duration,
    /// Keep gpu-feature-discovery's labels on the Node current.
    pub node_labels: bool,
    /// After a prepare, write the claim's `status.devices` entries.
    pub claim_status: bool,
    /// Where the MPS control daemons' directories are (`crate::mps::dir`).
    pub mps_root: PathBuf,
}

/// Every path under the kubelet's root directory is derived here, from `kubelet_root`, by the
/// library's [`kubelet_plugin::paths`] (the kubelet's layout, declared once).
impl Config {
    /// Where the plugin keeps its sockets, checkpoint and locks.
    pub fn plugin_dir(&self) -> PathBuf {
        kubelet_plugin::paths::plugin_dir(&self.kubelet_root, &self.driver_name)
    }

    /// `<kubelet root>/device-plugins`, where `kubelet.sock` and the device-plugin sockets are.
    pub fn device_plugin_dir(&self) -> PathBuf {
        kubelet_plugin::paths::device_plugin_dir(&self.kubelet_root)
    }

    /// `<kubelet root>/plugins_registry`, where the kubelet discovers plugins by inotify.
    pub fn registry_dir(&self) -> PathBuf {
        kubelet_plugin::paths::registry_dir(&self.kubelet_root)
    }

    /// The kubelet's PodResources socket, which `--mode both` reads for what containers hold.
    pub fn pod_resources_socket(&self) -> PathBuf {
        kubelet_plugin::paths::pod_resources_socket(&self.kubelet_root)
    }
}

/// Layers the command line and environment (`cli`, as clap merged them) over the file over the
/// defaults, and validates the result.
pub fn resolve(cli: Settings, file: Option<FileConfig>) -> Result<Config> {
    resolve_over(cli, file, Settings::default())
}

/// [`resolve`] with one more level between the file and the defaults: settings another
/// program's config gives (the driver roots of NVIDIA's device-plugin config).
pub fn resolve_over(cli: Settings, file: Option<FileConfig>, below: Settings) -> Result<Config> {
    let file = file
        .map(|f| f.settings)
        .unwrap_or_default()
        .or(below)
        .under(&cli);
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
        serve,
        daemon,
        log,
        health,
        mps,
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

    let api = match (api.api_dir, api.cluster.kubeconfig) {
        (Some(_), Some(_)) => {
            return Err(invalid(
                "--api-dir/--kubeconfig",
                "give a kubeconfig or an API directory, not both",
            ));
        }
        (Some(dir), None) => Api::Dir(dir),
        (None, kubeconfig) => Api::Kube { kubeconfig },
    };

    let metrics = need(daemon.metrics_address.clone(), "--metrics-address")?;
    let metrics_address: SocketAddr = metrics.parse().map_err(|_| {
        invalid(
            "--metrics-address",
            format!("{metrics:?} is not an address like {DEFAULT_METRICS_ADDRESS}"),
        )
    })?;

    let host_root = absolute("--driver-root", need(backend.driver_root, "--driver-root")?)?;
    // Both default to the driver root: a host install, read at the same path.
    let dev_root = match backend.dev_root {
        Some(d) => absolute("--dev-root", d)?,
        None => host_root.clone(),
    };
    let ctr_root = match backend.driver_root_ctr_path {
        Some(d) => absolute("--driver-root-ctr-path", d)?,
        None => host_root.clone(),
    };
    let driver_root = DriverRoot::new(host_root, ctr_root, dev_root);
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

    let mode = need(serve.mode, "--mode")?;
    let share_trust_domain = need(plugin.share_trust_domain, "--share-trust-domain")?;
    let device_plugin_gpu_memory = need(
        daemon.device_plugin_gpu_memory,
        "--device-plugin-gpu-memory",
    )?;
    // The device-plugin path's Allocate names no pod: its GPU-memory units of one GPU go to pods
    // of any namespace, which the rule forbids.
    if share_trust_domain.enabled() && device_plugin_gpu_memory && mode != Mode::Dra {
        return Err(invalid(
            "--share-trust-domain/--device-plugin-gpu-memory",
            format!(
                "--device-plugin-gpu-memory shares each GPU between pods of the device-plugin \
                 path, whose Allocate names no pod or namespace, so --share-trust-domain=\
                 {share_trust_domain} cannot hold there: give one of them (or --mode dra)"
            ),
        ));
    }
    fn bad(key: &'static str) -> impl Fn(crate::health::Error) -> Error {
        move |e| invalid(key, e.to_string())
    }
    let policy = crate::health::Policy {
        ignored: crate::health::parse_xids(&need(health.ignored_xids, "--ignored-xids")?)
            .map_err(bad("--ignored-xids"))?,
        overrides: crate::health::parse_overrides(health.xid_overrides.as_deref().unwrap_or(""))
            .map_err(bad("--xid-overrides"))?,
        quiet_period: crate::health::parse_duration(&need(
            health.health_quiet_period,
            "--health-quiet-period",
        )?)
        .map_err(bad("--health-quiet-period"))?,
        probe_interval: crate::health::parse_duration(&need(
            health.health_probe_interval,
            "--health-probe-interval",
        )?)
        .map_err(bad("--health-probe-interval"))?,
    };
    if policy.probe_interval.is_zero() {
        return Err(invalid("--health-probe-interval", "must be longer than 0s"));
    }
    let mps_probe_interval =
        crate::health::parse_duration(&need(health.mps_probe_interval, "--mps-probe-interval")?)
            .map_err(bad("--mps-probe-interval"))?;
    if mps_probe_interval.is_zero() {
        return Err(invalid("--mps-probe-interval", "must be longer than 0s"));
    }
    if health.fault_file.is_some() && matches!(source, Backend::Nvml { .. }) {
        return Err(invalid(
            "--fault-file",
            "injects faults into simulated GPUs; it needs --profile or --topology",
        ));
    }
    let fault_file = health
        .fault_file
        .map(|p| absolute("--fault-file", p))
        .transpose()?;

    Ok(Config {
        health: policy,
        fault_file,
        mps_probe_interval,
        mode,
        backend: source,
        node_name,
        driver_name,
        driver_root,
        kubelet_root,
        cdi_root,
        device_metadata: need(kubelet.device_metadata, "--device-metadata")?,
        api,
        metrics_address,
        log_format: need(log.log_format, "--log-format")?,
        partitionable: need(plugin.partitionable, "--partitionable")?,
        shared_capacity: consumable_shares(
            need(plugin.shared_capacity, "--shared-capacity")?,
            need(plugin.consumable_shares, "--consumable-shares")?,
        )?,
        dynamic_mig: need(plugin.dynamic_mig, "--dynamic-mig")?,
        mig_profiles: mig_profiles(plugin.mig_profiles)?,
        share_trust_domain,
        pod_uid: kubelet.pod_uid,
        device_plugin_config: serve
            .device_plugin_config
            .map(|p| absolute("--device-plugin-config", p))
            .transpose()?,
        device_plugin_gpu_memory,
        node_labels: need(daemon.node_labels, "--node-labels")?,
        claim_status: need(daemon.claim_status, "--claim-status")?,
        mps_root: absolute("--mps-root", need(mps.mps_root, "--mps-root")?)?,
    })
}

/// A setting that [`Settings::defaults`] fills; `None` only if a default was forgotten there
/// (the `defaults` test resolves an empty configuration, so that cannot ship).
fn need<T>(value: Option<T>, key: &str) -> Result<T> {
    value.ok_or_else(|| invalid(key, "has no value and no default"))
}

/// The share mode of `--shared-capacity` and `--consumable-shares` together: the former is the
/// latter's `memory`, so both may say `memory`; any other mode beside `--shared-capacity` is a
/// contradiction, named rather than settled by a rule the user has to guess.
fn consumable_shares(shared_capacity: bool, mode: ConsumableShares) -> Result<ConsumableShares> {
    match (shared_capacity, mode) {
        (false, mode) => Ok(mode),
        (true, ConsumableShares::Disabled | ConsumableShares::Memory) => {
            Ok(ConsumableShares::Memory)
        }
        (true, other) => Err(invalid(
            "--shared-capacity/--consumable-shares",
            format!(
                "--shared-capacity shares GPUs by memory (--consumable-shares=memory), but \
                 --consumable-shares={other} asks for another mode; give one of them"
            ),
        )),
    }
}

/// The `--mig-profiles` allowlist: MIG profile names as NVML and `nvidia-smi` spell them
/// (`1g.10gb`, `1g.20gb+me`, `7g.80gb`), each once. An empty list is refused: it would publish
/// no placement, which is what leaving out `--partitionable` and `--dynamic-mig` says.
fn mig_profiles(list: Option<Vec<String>>) -> Result<Option<Vec<String>>> {
    let Some(list) = list else { return Ok(None) };
    let key = "--mig-profiles";
    let mut out: Vec<String> = Vec::new();
    for name in list.iter().map(|n| n.trim()) {
        let shaped = name.split_once('g').is_some_and(|(n, rest)| {
            !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) && rest.starts_with('.')
        }) && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"+.".contains(&b));
        if !shaped {
            return Err(invalid(
                key,
                format!("{name:?} is not a MIG profile name (such as 1g.10gb or 3g.40gb)"),
            ));
        }
        if !out.iter().any(|o| o == name) {
            out.push(name.to_string());
        }
    }
    if out.is_empty() {
        return Err(invalid(key, "lists no profile"));
    }
    Ok(Some(out))
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
mod tests;
