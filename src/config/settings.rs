//! The settings, one struct per concern. Each setting is one optional field: its clap attributes
//! give the flag, env name and help, its serde name (camelCase) the file key, and the
//! struct's [`Section::defaults`] the default. Every field is an `Option` so that levels (command
//! line and environment, file, defaults) can be layered; [`super::resolve`] does that and
//! validates the result.

use std::ffi::OsString;
use std::path::PathBuf;

use serde::Deserialize;

pub use crate::ledger::shares::ConsumableShares;
pub use crate::sharing::trust::TrustDomain;

use super::{
    BackendKind, DEFAULT_CDI_ROOT, DEFAULT_DRIVER_NAME, DEFAULT_KUBELET_ROOT,
    DEFAULT_METRICS_ADDRESS, DEFAULT_MPS_ROOT, DynamicMig, LogFormat, Mode,
};

/// One concern's settings, every field optional so that levels can be layered.
pub trait Section: Layer + Default + serde::de::DeserializeOwned {
    /// The built-in values; `None` where there is none, or where validation computes it.
    fn defaults() -> Self;
    /// `self` as a lower level under `higher`: of two alternatives (`--profile` and
    /// `--topology`), either one given at a higher level replaces both, so `--topology x`
    /// overrides `profile:` from the file instead of conflicting with it.
    fn under(self, _higher: &Self) -> Self {
        self
    }
}

/// Two levels of a setting, or of a struct of settings, merged.
pub trait Layer {
    /// `self`, each unset setting taken from `lower`.
    fn or(self, lower: Self) -> Self;
}

impl<T> Layer for Option<T> {
    fn or(self, lower: Self) -> Self {
        Option::or(self, lower)
    }
}

/// Declares a struct of settings as written, and its [`Layer`]: field by field, so that a new
/// setting is one field (with its flag, env name, help and file key) and nothing else here.
macro_rules! settings_struct {
    (
        $(#[$meta:meta])*
        pub struct $name:ident {
            $(
                $(#[$field_meta:meta])*
                pub $field:ident: $ty:ty,
            )*
        }
    ) => {
        $(#[$meta])*
        pub struct $name {
            $(
                $(#[$field_meta])*
                pub $field: $ty,
            )*
        }

        impl Layer for $name {
            fn or(self, lower: Self) -> Self {
                Self {
                    $($field: Layer::or(self.$field, lower.$field),)*
                }
            }
        }
    };
}

settings_struct! {
    /// Where GPUs come from, and the node they belong to.
    #[derive(Clone, Debug, Default, PartialEq, Eq, clap::Args, Deserialize)]
    #[cfg_attr(test, derive(serde::Serialize))]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    pub struct BackendSettings {
        /// auto: NVML when it loads. --profile or --topology imply simulated.
        #[arg(long, env = "NVDRA_BACKEND", value_enum)]
        pub backend: Option<BackendKind>,

        /// A built-in simulated node: dgx-a100, dgx-a100-mig, dgx-h100, hgx-h200, l40s-pcie,
        /// a100-mig-mixed, pcie-pairs, gb200-nvl72.
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

        /// Root of the NVIDIA driver installation on the host: `/`, or `/run/nvidia/driver` with
        /// the GPU Operator's driver container. CDI specs name host paths under it.
        #[arg(long, env = "NVIDIA_DRIVER_ROOT", value_name = "DIR")]
        pub driver_root: Option<PathBuf>,

        /// Host root whose dev/ holds the NVIDIA device nodes (/dev when it has none); defaults to
        /// the driver root.
        #[arg(long, env = "NVIDIA_DEV_ROOT", value_name = "DIR")]
        pub dev_root: Option<PathBuf>,

        /// Where the host's driver root is mounted in nvdra's container, i.e. where nvdra reads
        /// the driver's files (libnvidia-ml.so.1, nvidia-smi, ...); defaults to the driver root.
        #[arg(long, env = "DRIVER_ROOT_CTR_PATH", value_name = "DIR")]
        pub driver_root_ctr_path: Option<PathBuf>,

        /// This node's name; defaults to the host name.
        #[arg(long, env = "NODE_NAME", value_name = "NAME")]
        pub node_name: Option<String>,
    }
}

impl Section for BackendSettings {
    fn defaults() -> Self {
        Self {
            backend: Some(BackendKind::Auto),
            driver_root: Some("/".into()),
            ..Self::default()
        }
    }

    fn under(mut self, higher: &Self) -> Self {
        if higher.profile.is_some() || higher.topology.is_some() {
            (self.profile, self.topology) = (None, None);
        }
        self
    }
}

settings_struct! {
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

        /// Publish each GPU outside MIG mode as one device the scheduler may allocate many times:
        /// a claim asking `capacity.requests.memory` below the whole GPU gets a share of it,
        /// enforced at prepare with the GPU's MPS daemon; one asking no memory gets the GPU whole
        /// (needs the DRAConsumableCapacity feature gate).
        #[arg(
            long,
            env = "NVDRA_SHARED_CAPACITY",
            value_name = "BOOL",
            num_args = 0..=1,
            require_equals = true,
            default_missing_value = "true"
        )]
        pub shared_capacity: Option<bool>,

        /// NVIDIA's consumable-shares modes, as its DRA driver takes them: `memory` (what
        /// --shared-capacity publishes), `unlimited` (`memory` defaults to 0: claims that ask for
        /// nothing share a GPU, each MPS client without a memory limit), or a number N of
        /// `shares` per GPU (1 per claim unless it asks more; each share held to its part of the
        /// GPU's memory and SMs); `disabled` publishes GPUs whole. Needs DRAConsumableCapacity.
        #[arg(long, env = "CONSUMABLE_SHARES", value_name = "MODE")]
        pub consumable_shares: Option<ConsumableShares>,

        /// Dynamic MIG: publish each GPU that can switch MIG mode at run time (Hopper and later,
        /// on bare metal) whole and as every MIG placement, from one counter set; prepare turns
        /// MIG mode on for the first placement and off after the last (`keep-on` leaves it on).
        #[arg(
            long,
            env = "NVDRA_DYNAMIC_MIG",
            value_name = "MODE",
            value_enum,
            num_args = 0..=1,
            require_equals = true,
            default_missing_value = "on"
        )]
        pub dynamic_mig: Option<DynamicMig>,

        /// MIG profiles whose placements are published (comma-separated, e.g. `1g.10gb,3g.40gb`);
        /// all of them when unset. Fewer placements keep the scheduler's work per node small.
        #[arg(
            long,
            env = "NVDRA_MIG_PROFILES",
            value_name = "PROFILES",
            value_delimiter = ','
        )]
        pub mig_profiles: Option<Vec<String>>,

        /// Who may hold shares of one GPU (one MPS daemon) together: `off` (anyone), `namespace`
        /// (claims of one namespace), or `label:<key>` (claims of namespaces with one value of that
        /// label on the Namespace; a namespace without it shares with itself only). A share of
        /// another domain is refused at prepare, naming the GPU's holders.
        #[arg(long, env = "NVDRA_SHARE_TRUST_DOMAIN", value_name = "RULE")]
        pub share_trust_domain: Option<TrustDomain>,
    }
}

impl Section for PluginSettings {
    fn defaults() -> Self {
        Self {
            driver_name: Some(DEFAULT_DRIVER_NAME.into()),
            partitionable: Some(false),
            shared_capacity: Some(false),
            consumable_shares: Some(ConsumableShares::Disabled),
            dynamic_mig: Some(DynamicMig::Off),
            mig_profiles: None,
            share_trust_domain: Some(TrustDomain::Off),
        }
    }
}

settings_struct! {
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

        /// Write each prepared claim's device metadata files (KEP-5304, beta in Kubernetes 1.37)
        /// that its containers read: one per request, bind-mounted by a CDI spec in --cdi-root.
        #[arg(
            long,
            env = "NVDRA_DEVICE_METADATA",
            value_name = "BOOL",
            num_args = 0..=1,
            require_equals = true,
            default_missing_value = "true"
        )]
        pub device_metadata: Option<bool>,

        /// This pod's UID (downward API), for rolling updates: socket names carry it so two
        /// instances can serve side by side.
        // Not a file key: it differs for every pod of the DaemonSet.
        #[arg(long, env = "POD_UID", value_name = "UID")]
        #[serde(skip)]
        pub pod_uid: Option<String>,
    }
}

impl Section for KubeletSettings {
    fn defaults() -> Self {
        Self {
            kubelet_root: Some(DEFAULT_KUBELET_ROOT.into()),
            cdi_root: Some(DEFAULT_CDI_ROOT.into()),
            device_metadata: Some(false),
            pod_uid: None,
        }
    }
}

settings_struct! {
    /// A kubeconfig: the one declaration of `--kubeconfig`, flattened into [`ApiSettings`] and into
    /// `nvdra match` (which reads a live cluster through it), as kubert's client arguments are.
    // Transparent, and renamed where ApiSettings holds it: in the file `kubeconfig` stays a key of
    // the flat map, read by ApiSettings' derive like its other keys.
    #[derive(Clone, Debug, Default, PartialEq, Eq, clap::Args, Deserialize)]
    #[cfg_attr(test, derive(serde::Serialize))]
    #[serde(transparent)]
    pub struct ClusterSettings {
        /// Talk to the API server of this kubeconfig instead of the in-cluster config.
        #[arg(long, env = "NVDRA_KUBECONFIG", value_name = "FILE")]
        pub kubeconfig: Option<PathBuf>,
    }
}

settings_struct! {
    /// Which API server nvdra talks to.
    #[derive(Clone, Debug, Default, PartialEq, Eq, clap::Args, Deserialize)]
    #[cfg_attr(test, derive(serde::Serialize))]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    pub struct ApiSettings {
        #[command(flatten)]
        #[serde(default, rename = "kubeconfig")]
        pub cluster: ClusterSettings,

        /// Use a directory as the API (claims read from DIR/resourceclaims, slices written to
        /// DIR/resourceslices), for runs without a cluster.
        #[arg(
            long,
            env = "NVDRA_API_DIR",
            value_name = "DIR",
            conflicts_with = "kubeconfig"
        )]
        pub api_dir: Option<PathBuf>,
    }
}

impl Section for ApiSettings {
    fn defaults() -> Self {
        Self::default()
    }

    fn under(mut self, higher: &Self) -> Self {
        if higher.cluster.kubeconfig.is_some() || higher.api_dir.is_some() {
            (self.cluster.kubeconfig, self.api_dir) = (None, None);
        }
        self
    }
}

settings_struct! {
    /// Which path serves the GPUs to the kubelet: DRA, the device plugin, or both, and the device
    /// plugin's config. `nvdra run` serves them; `nvdra inventory -o paths` says what it would serve.
    #[derive(Clone, Debug, Default, PartialEq, Eq, clap::Args, Deserialize)]
    #[cfg_attr(test, derive(serde::Serialize))]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    pub struct ServeSettings {
        /// dra, device-plugin, both, or auto (DRA where the cluster supports it).
        #[arg(long, env = "NVDRA_MODE", value_enum)]
        pub mode: Option<Mode>,

        /// NVIDIA's device-plugin config file (version v1: flags.migStrategy, deviceListStrategy,
        /// deviceIDStrategy, sharing.timeSlicing/mps, ...), for the device-plugin path.
        #[arg(long, env = "NVDRA_DEVICE_PLUGIN_CONFIG", value_name = "FILE")]
        pub device_plugin_config: Option<PathBuf>,
    }
}

impl Section for ServeSettings {
    fn defaults() -> Self {
        Self {
            mode: Some(Mode::Auto),
            device_plugin_config: None,
        }
    }
}

settings_struct! {
    /// What only the node agent does: where its metrics are, and what it adds to the device-plugin
    /// path and the Node.
    #[derive(Clone, Debug, Default, PartialEq, Eq, clap::Args, Deserialize)]
    #[cfg_attr(test, derive(serde::Serialize))]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    pub struct DaemonSettings {
        /// Address of /metrics, /healthz and /readyz.
        #[arg(long, env = "NVDRA_METRICS_ADDRESS", value_name = "ADDR")]
        pub metrics_address: Option<String>,

        /// Advertise each whole GPU no sharing entry selects as nvidia.com/gpu-memory instead of
        /// nvidia.com/gpu on the device-plugin path: one device per GiB, Allocate of k units setting
        /// the GPU's MPS pinned-memory limit to kG (nvdra's extension; NVIDIA's file has no key).
        #[arg(
            long,
            env = "NVDRA_DEVICE_PLUGIN_GPU_MEMORY",
            value_name = "BOOL",
            num_args = 0..=1,
            require_equals = true,
            default_missing_value = "true"
        )]
        pub device_plugin_gpu_memory: Option<bool>,

        /// Keep gpu-feature-discovery's nvidia.com/ labels (gpu.product, gpu.count, gpu.memory, ...)
        /// on the Node current, so nodeSelectors written for GFD keep working.
        #[arg(
            long,
            env = "NVDRA_NODE_LABELS",
            value_name = "BOOL",
            num_args = 0..=1,
            require_equals = true,
            default_missing_value = "true"
        )]
        pub node_labels: Option<bool>,

        /// After a prepare, write nvdra's entries in the claim's status.devices (a Ready
        /// condition and the device's UUIDs and share limits), for other components to read.
        #[arg(
            long,
            env = "NVDRA_CLAIM_STATUS",
            value_name = "BOOL",
            num_args = 0..=1,
            require_equals = true,
            default_missing_value = "true"
        )]
        pub claim_status: Option<bool>,
    }
}

impl Section for DaemonSettings {
    fn defaults() -> Self {
        Self {
            metrics_address: Some(DEFAULT_METRICS_ADDRESS.into()),
            device_plugin_gpu_memory: Some(false),
            node_labels: Some(false),
            claim_status: Some(true),
        }
    }
}

settings_struct! {
    /// How GPU health events are judged, how unhealthy GPUs recover, and (simulated GPUs) where
    /// faults are injected.
    #[derive(Clone, Debug, Default, PartialEq, Eq, clap::Args, Deserialize)]
    #[cfg_attr(test, derive(serde::Serialize))]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    pub struct HealthSettings {
        /// XIDs that never make a GPU unhealthy (comma-separated; empty for none): application
        /// errors by default.
        #[arg(long, env = "NVDRA_IGNORED_XIDS", value_name = "LIST")]
        pub ignored_xids: Option<String>,

        /// Per-XID rules over the ignore list: XID=ignore, XID=NoSchedule or XID=NoExecute (the
        /// taint effect), comma-separated, e.g. 94=ignore,79=NoExecute.
        #[arg(long, env = "NVDRA_XID_OVERRIDES", value_name = "LIST")]
        pub xid_overrides: Option<String>,

        /// How long an unhealthy GPU must answer its probe with no new critical event before it is
        /// healthy again (500ms, 30s, 5m, 1h).
        #[arg(long, env = "NVDRA_HEALTH_QUIET_PERIOD", value_name = "DURATION")]
        pub health_quiet_period: Option<String>,

        /// How often unhealthy GPUs are probed.
        #[arg(long, env = "NVDRA_HEALTH_PROBE_INTERVAL", value_name = "DURATION")]
        pub health_probe_interval: Option<String>,

        /// Simulated GPUs only: a file whose appended lines inject faults at run time (xid GPU XID,
        /// ecc GPU, lost GPU, back GPU).
        #[arg(long, env = "NVDRA_FAULT_FILE", value_name = "FILE")]
        pub fault_file: Option<PathBuf>,

        /// How often the MPS daemon of each GPU that holds shares is asked whether it answers; one
        /// that does not taints its GPU and refuses new shares until it answers again.
        #[arg(long, env = "NVDRA_MPS_PROBE_INTERVAL", value_name = "DURATION")]
        pub mps_probe_interval: Option<String>,
    }
}

impl Section for HealthSettings {
    fn defaults() -> Self {
        Self {
            ignored_xids: Some(
                crate::health::DEFAULT_IGNORED_XIDS
                    .map(|x| x.to_string())
                    .join(","),
            ),
            xid_overrides: None,
            health_quiet_period: Some("5m".into()),
            health_probe_interval: Some("30s".into()),
            fault_file: None,
            mps_probe_interval: Some("5s".into()),
        }
    }
}

settings_struct! {
    /// Where the MPS control daemons of shared GPUs live: `nvdra mps-host` runs them there, `nvdra
    /// run` asks for them there (`crate::mps::dir` describes the directory protocol).
    #[derive(Clone, Debug, Default, PartialEq, Eq, clap::Args, Deserialize)]
    #[cfg_attr(test, derive(serde::Serialize))]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    pub struct MpsRootSettings {
        /// The host directory (a tmpfs, short: a socket path holds at most 107 bytes) that holds
        /// one directory per MPS control daemon, shared by the plugin and the MPS host.
        #[arg(long, env = "NVDRA_MPS_ROOT", value_name = "DIR")]
        pub mps_root: Option<PathBuf>,
    }
}

impl Section for MpsRootSettings {
    fn defaults() -> Self {
        Self {
            mps_root: Some(DEFAULT_MPS_ROOT.into()),
        }
    }
}

settings_struct! {
    /// How nvdra logs (every subcommand).
    #[derive(Clone, Debug, Default, PartialEq, Eq, clap::Args, Deserialize)]
    #[cfg_attr(test, derive(serde::Serialize))]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    pub struct LogSettings {
        /// Log format on stderr.
        #[arg(long, env = "NVDRA_LOG_FORMAT", global = true, value_enum)]
        pub log_format: Option<LogFormat>,

        /// What is logged: a tracing filter (`debug`, `nvdra=debug,kube=warn`). Unset, or not a
        /// filter: `info` (`error` for the demo), the subcommand's default.
        // Raw, not a `String`: a value that is not UTF-8 falls back to the default as an invalid
        // filter does. Hidden, and not a file key: it is known as NVDRA_LOG, which the README
        // documents with --log-format.
        #[arg(
            long = "log",
            env = "NVDRA_LOG",
            global = true,
            value_name = "FILTER",
            hide = true
        )]
        #[serde(skip)]
        pub log_filter: Option<OsString>,
    }
}

impl Section for LogSettings {
    fn defaults() -> Self {
        Self {
            log_format: Some(LogFormat::Plain),
            // The default is the subcommand's (`cli::init_logging`).
            log_filter: None,
        }
    }
}

/// Declares [`Settings`] from its list of sections, and what goes through every section:
/// defaults, layering, and the config file's keys and entries (`config/file.rs`).
macro_rules! sections {
    ($($(#[$meta:meta])* $field:ident: $ty:ty,)*) => {
        /// Every setting, by concern: one level (the command line and environment, or the file).
        #[derive(Clone, Debug, Default, PartialEq, Eq)]
        pub struct Settings {
            $($(#[$meta])* pub $field: $ty,)*
        }

        impl Settings {
            pub fn defaults() -> Self {
                Self {
                    $($field: Section::defaults(),)*
                }
            }

            /// `self`, each unset setting taken from `lower`.
            pub fn or(self, lower: Self) -> Self {
                Self {
                    $($field: Layer::or(self.$field, lower.$field),)*
                }
            }

            /// `self` as a lower level under `higher` (see [`Section::under`]).
            pub fn under(self, higher: &Self) -> Self {
                Self {
                    $($field: self.$field.under(&higher.$field),)*
                }
            }

            /// The file keys of each section, in order.
            pub(super) fn section_keys() -> Vec<&'static [&'static str]> {
                vec![$(super::file::keys_of::<$ty>(),)*]
            }

            /// Reads the value of `key` into the section that declares it; false if none does.
            pub(super) fn read_entry<'de, A: serde::de::MapAccess<'de>>(
                &mut self,
                key: &str,
                map: &mut A,
            ) -> Result<bool, A::Error> {
                $(if super::file::read_into(&mut self.$field, key, map)? {
                    return Ok(true);
                })*
                Ok(false)
            }

            /// Each section as JSON, in order (the tests compare and list them).
            #[cfg(test)]
            pub(super) fn sections(&self) -> Vec<serde_json::Value> {
                vec![$(serde_json::to_value(&self.$field).expect("settings serialize"),)*]
            }
        }
    };
}

// The one list of sections; the order is the file keys' order in the config file's errors.
sections! {
    backend: BackendSettings,
    plugin: PluginSettings,
    kubelet: KubeletSettings,
    api: ApiSettings,
    serve: ServeSettings,
    daemon: DaemonSettings,
    log: LogSettings,
    health: HealthSettings,
    mps: MpsRootSettings,
}
