//! The command line: clap definitions (the source of truth for flags, env names and help) and
//! the dispatch to each subcommand.

use std::ffi::OsStr;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::config::{
    self, ApiSettings, Backend, BackendSettings, Config, DaemonSettings, FileConfig,
    HealthSettings, KubeletSettings, LogFormat, LogSettings, MpsRootSettings, PluginSettings,
    ServeSettings, Settings,
};
use crate::dra::slices;
#[cfg(feature = "tools")]
pub use tools::{MatchArgs, MatchOutput, ValidateArgs};

/// `nvdra demo`, `match` and `validate`: in the default build, not in the DaemonSet's image.
#[cfg(feature = "tools")]
mod tools;
use crate::inventory::{self, nvml::NvmlBackend, sim::SimBackend};

/// Exit code for invalid configuration (EX_USAGE).
pub const EXIT_CONFIG: u8 = 64;

#[derive(Debug, Parser)]
#[command(
    name = "nvdra",
    version,
    about = "NVIDIA GPUs for Kubernetes: a DRA kubelet plugin with a device-plugin fallback",
    long_about = "nvdra publishes a node's NVIDIA GPUs and MIG devices as resource.k8s.io/v1 \
ResourceSlices, prepares ResourceClaims for the kubelet through CDI, and serves the legacy \
device-plugin API from the same inventory.\n\nWithout a GPU, try: nvdra inventory --profile dgx-h100"
)]
pub struct Cli {
    /// Optional YAML config file (version: v1); flags and environment override it.
    #[arg(long, env = "NVDRA_CONFIG", global = true, value_name = "FILE")]
    pub config: Option<PathBuf>,

    #[command(flatten)]
    pub log: LogSettings,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Show the node's GPUs, MIG devices and topology.
    Inventory(Box<InventoryArgs>),
    /// Run the node agent: the DRA kubelet plugin and the ResourceSlice publisher.
    Run(Box<RunArgs>),
    /// The whole DRA flow on simulated GPUs in a temporary directory, narrated (no cluster,
    /// no GPU).
    #[cfg(feature = "tools")]
    Demo,
    /// Which of the node's devices a ResourceClaim (or template) can get, and why not. Exit
    /// code 0: satisfiable; 1: not; 2: bad input.
    #[cfg(feature = "tools")]
    Match(Box<MatchArgs>),
    /// Compile every CEL selector in DeviceClasses, ResourceClaims and templates. Exit code 0:
    /// all compile; 1: some do not; 2: bad input.
    #[cfg(feature = "tools")]
    Validate(ValidateArgs),
    /// Run the node's MPS control daemons (for shared GPUs) in their own DaemonSet: one per
    /// request the plugin writes under --mps-root, restarted when it exits, quit when released.
    MpsHost(Box<MpsHostArgs>),
    /// ComputeDomains (multi-node NVLink through IMEX): the compute-domain kubelet plugin, its
    /// controller and the per-node IMEX daemon, as NVIDIA's compute-domain driver runs them.
    #[command(subcommand)]
    ComputeDomain(crate::computedomain::Command),
    /// The container runtime's hooks that set a GPU share's memory limits on its container's
    /// own cgroup through NVML (`createRuntime`) and clear them (`poststop`), written into share
    /// specs by the plugin where the driver partitions memory per cgroup.
    #[command(hide = true, disable_help_flag = true)]
    MemoryLimitHook {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// What specs of an older nvdra name: refuses, so that such a container does not start
    /// without its limit before the plugin rewrote its spec.
    #[command(hide = true, disable_help_flag = true)]
    DmemHook {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// The container runtime's `createRuntime` hook that lets a container of an MPS claim start
    /// only while its MPS daemon answers with a server up (written into MPS claims' specs).
    #[command(hide = true, disable_help_flag = true)]
    MpsGate {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// A stand-in for nvidia-cuda-mps-control (daemon, server, client, CUDA client) as real
    /// processes, for tests and the demo.
    #[cfg(feature = "tools")]
    #[command(hide = true, disable_help_flag = true)]
    MpsStandin {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
}

/// Flags of `nvdra run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub serve: ServeSettings,

    #[command(flatten)]
    pub daemon: DaemonSettings,

    #[command(flatten)]
    pub backend: BackendSettings,

    #[command(flatten)]
    pub plugin: PluginSettings,

    #[command(flatten)]
    pub kubelet: KubeletSettings,

    #[command(flatten)]
    pub api: ApiSettings,

    #[command(flatten)]
    pub health: HealthSettings,

    #[command(flatten)]
    pub mps: MpsRootSettings,

    /// Read the boot id from this file instead of /proc/sys/kernel/random/boot_id (tests).
    #[arg(long, env = "NVDRA_BOOT_ID_FILE", value_name = "FILE", hide = true)]
    pub boot_id_file: Option<PathBuf>,

    /// Read a GPU process's cgroup from <DIR>/<pid>/cgroup instead of /proc: the host's /proc
    /// mounted read-only (the manifests mount it at /host/proc), so that /metrics names the pod
    /// of each GPU process without the host PID namespace; with --dynamic-mig, also where the
    /// processes holding each GPU's device file open are found.
    #[arg(long, env = "NVDRA_PROC_ROOT", value_name = "DIR")]
    pub proc_root: Option<PathBuf>,
}

impl RunArgs {
    fn settings(&self, log: &LogSettings) -> Settings {
        Settings {
            backend: self.backend.clone(),
            plugin: self.plugin.clone(),
            kubelet: self.kubelet.clone(),
            api: self.api.clone(),
            serve: self.serve.clone(),
            daemon: self.daemon.clone(),
            log: log.clone(),
            health: self.health.clone(),
            mps: self.mps.clone(),
        }
    }
}

/// Flags of `nvdra mps-host`: the MPS root, and the driver root where the control binary is.
#[derive(Debug, Args)]
#[command(
    mut_arg("backend", |a| a.hide(true)),
    mut_arg("profile", |a| a.hide(true)),
    mut_arg("topology", |a| a.hide(true)),
    mut_arg("dev_root", |a| a.hide(true)),
    mut_arg("node_name", |a| a.hide(true))
)]
pub struct MpsHostArgs {
    #[command(flatten)]
    pub backend: BackendSettings,

    #[command(flatten)]
    pub mps: MpsRootSettings,

    /// Read the boot id from this file instead of /proc/sys/kernel/random/boot_id (tests).
    #[arg(long, env = "NVDRA_BOOT_ID_FILE", value_name = "FILE", hide = true)]
    pub boot_id_file: Option<PathBuf>,

    /// How long a released daemon may take to quit before it is killed.
    #[arg(
        long,
        env = "NVDRA_MPS_QUIT_DEADLINE",
        value_name = "DURATION",
        default_value = "10s",
        hide = true
    )]
    pub quit_deadline: String,

    /// How often each running daemon is asked whether it answers; one that misses three
    /// questions in a row is killed and started again.
    #[arg(
        long,
        env = "NVDRA_MPS_HOST_PROBE_INTERVAL",
        value_name = "DURATION",
        default_value = "5s"
    )]
    pub probe_interval: String,

    /// The size of each daemon's /dev/shm, a tmpfs of its own that its share containers mount
    /// as theirs (a quantity: 1Gi, 512Mi).
    #[arg(
        long,
        env = "NVDRA_MPS_SHM_SIZE",
        value_name = "QUANTITY",
        default_value = crate::mps::host::DEFAULT_SHM_SIZE
    )]
    pub shm_size: String,

    /// Give each daemon its own /dev/shm (needs CAP_SYS_ADMIN). `false` only for demos and
    /// tests without that privilege: daemons then share the host's /dev/shm.
    #[arg(
        long,
        env = "NVDRA_MPS_PRIVATE_SHM",
        value_name = "BOOL",
        default_value_t = true,
        action = clap::ArgAction::Set,
        hide = true
    )]
    pub private_shm: bool,
}

impl MpsHostArgs {
    fn settings(&self, log: &LogSettings) -> Settings {
        Settings {
            backend: self.backend.clone(),
            mps: self.mps.clone(),
            log: log.clone(),
            ..Settings::default()
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum InventoryOutput {
    Table,
    Json,
    Yaml,
    /// The ResourceSlices a first publish would send, as multi-document YAML.
    Slices,
    /// Which path (DRA or the device plugin) serves each resource name under --mode; `auto`
    /// asks the API server (--api-dir or --kubeconfig) for resource.k8s.io/v1 and DeviceClasses.
    Paths,
}

/// Which Kubernetes layout shared counters take in `-o slices --partitionable`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum CounterLayoutArg {
    /// Kubernetes 1.34: counters and devices in one slice per GPU.
    Together,
    /// Kubernetes 1.35 and later: a counters-only slice, then device slices.
    Separate,
}

impl From<CounterLayoutArg> for slices::CounterLayout {
    fn from(l: CounterLayoutArg) -> Self {
        match l {
            CounterLayoutArg::Together => slices::CounterLayout::Together,
            CounterLayoutArg::Separate => slices::CounterLayout::Separate,
        }
    }
}

/// Flags of `nvdra inventory`.
#[derive(Debug, Args)]
#[command(
    mut_arg("mode", paths_mode),
    mut_arg("device_plugin_config", paths_device_plugin_config)
)]
pub struct InventoryArgs {
    #[command(flatten)]
    pub backend: BackendSettings,

    /// Output format.
    #[arg(short = 'o', long = "output", value_enum, default_value = "table")]
    pub output: InventoryOutput,

    #[command(flatten)]
    pub plugin: PluginSettings,

    #[command(flatten)]
    pub serve: ServeSettings,

    /// The API `-o paths` asks in `--mode auto`.
    #[command(flatten)]
    pub api: ApiSettings,

    /// Slice layout of shared counters with --partitionable: together (Kubernetes 1.34) or
    /// separate (1.35 and later).
    #[arg(
        long,
        env = "NVDRA_COUNTER_LAYOUT",
        value_enum,
        default_value = "separate"
    )]
    pub counter_layout: CounterLayoutArg,
}

/// `--mode` ([`ServeSettings`]) as `inventory -o paths` uses it.
fn paths_mode(arg: clap::Arg) -> clap::Arg {
    arg.help("The mode `-o paths` answers for (as `nvdra run --mode`)")
}

/// `--device-plugin-config` ([`ServeSettings`]) as `inventory -o paths` uses it.
fn paths_device_plugin_config(arg: clap::Arg) -> clap::Arg {
    arg.help("NVIDIA's device-plugin config file `-o paths` computes the resources from")
}

impl InventoryArgs {
    fn settings(&self, log: &LogSettings) -> Settings {
        Settings {
            backend: self.backend.clone(),
            plugin: self.plugin.clone(),
            serve: self.serve.clone(),
            api: self.api.clone(),
            log: log.clone(),
            ..Settings::default()
        }
    }
}

/// Parses arguments and runs the command; the process exit code comes back.
pub fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return match e.kind() {
                clap::error::ErrorKind::DisplayHelp
                | clap::error::ErrorKind::DisplayVersion
                | clap::error::ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
                    ExitCode::SUCCESS
                }
                _ => ExitCode::from(EXIT_CONFIG),
            };
        }
    };
    #[cfg(feature = "tools")]
    match &cli.command {
        Command::Match(args) => return tools::run_match(&cli, args),
        Command::Validate(args) => return tools::run_validate(args),
        Command::MpsStandin { args } => return crate::mps::standin::main(args),
        _ => {}
    }
    if let Command::MemoryLimitHook { args } | Command::DmemHook { args } = &cli.command {
        use crate::cdi::memlimit;
        let (name, r) = match &cli.command {
            Command::DmemHook { .. } => (
                memlimit::LEGACY_SUBCOMMAND,
                memlimit::legacy_main(args.clone()),
            ),
            _ => (memlimit::SUBCOMMAND, memlimit::hook_main(args.clone())),
        };
        // The runtime shows this message when it refuses to start the container.
        return match r {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("nvdra {name}: {e:#}");
                ExitCode::FAILURE
            }
        };
    }
    if let Command::MpsGate { args } = &cli.command {
        // The runtime shows this message when it refuses to start the container.
        return match crate::mps::gate::main(args.clone()) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("nvdra mps-gate: {e:#}");
                ExitCode::FAILURE
            }
        };
    }
    if let Command::ComputeDomain(command) = cli.command {
        init_logging(
            cli.log.log_format.unwrap_or(LogFormat::Plain),
            cli.log.log_filter.as_deref(),
            "info",
        );
        return crate::computedomain::main(command);
    }
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure::Config(e)) => {
            eprintln!("nvdra: {e}");
            ExitCode::from(EXIT_CONFIG)
        }
        Err(Failure::Usage(e)) => {
            eprintln!("nvdra: {e}");
            ExitCode::from(EXIT_CONFIG)
        }
        Err(Failure::Other(e)) => {
            eprintln!("nvdra: {}", one_line(&e));
            ExitCode::FAILURE
        }
    }
}

enum Failure {
    Config(config::Error),
    /// A bad setting outside the configuration (exit code 64 too).
    #[cfg_attr(not(feature = "crash-points"), allow(dead_code))]
    Usage(String),
    Other(anyhow::Error),
}

impl From<config::Error> for Failure {
    fn from(e: config::Error) -> Self {
        Failure::Config(e)
    }
}

impl From<anyhow::Error> for Failure {
    fn from(e: anyhow::Error) -> Self {
        Failure::Other(e)
    }
}

impl From<inventory::Error> for Failure {
    fn from(e: inventory::Error) -> Self {
        Failure::Other(e.into())
    }
}

/// `settings` (the command line and environment) over the `--config` file, over the driver
/// roots NVIDIA's device-plugin config names (`--device-plugin-config`), validated.
fn load_config(cli: &Cli, settings: Settings) -> Result<Config, config::Error> {
    let file = cli.config.as_deref().map(FileConfig::load).transpose()?;
    let nvidia_file = settings.serve.device_plugin_config.clone().or_else(|| {
        file.as_ref()
            .and_then(|f| f.settings.serve.device_plugin_config.clone())
    });
    let backend = nvidia_file
        .as_deref()
        .map(crate::deviceplugin::nvconfig::driver_roots)
        .unwrap_or_default();
    config::resolve_over(
        settings,
        file,
        Settings {
            backend,
            ..Settings::default()
        },
    )
}

/// Logs to stderr in `format`, filtered by `filter` (`--log`, `NVDRA_LOG`) or, where that is
/// unset or not a filter, by the subcommand's `default`.
fn init_logging(format: LogFormat, filter: Option<&OsStr>, default: &str) {
    use tracing_subscriber::EnvFilter;
    let filter = filter
        .and_then(OsStr::to_str)
        .and_then(|f| EnvFilter::try_new(f).ok())
        .unwrap_or_else(|| EnvFilter::new(default));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Plain => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
}

/// Opens the backend the configuration names.
pub fn open_backend(config: &Config) -> inventory::Result<Arc<dyn inventory::Backend>> {
    open_backend_with(config, None)
}

/// Opens the backend the configuration names; with `--dynamic-mig`, the NVML backend's reads
/// list each GPU's holders, found under `proc_root` (`--proc-root`; default `/proc`).
pub fn open_backend_with(
    config: &Config,
    proc_root: Option<&std::path::Path>,
) -> inventory::Result<Arc<dyn inventory::Backend>> {
    Ok(match &config.backend {
        Backend::Nvml { .. } => {
            let backend = NvmlBackend::open(config.driver_root.ctr())?;
            Arc::new(if config.dynamic_mig.enabled() {
                let root = &config.driver_root;
                let scan = inventory::holders::HolderScan::new(
                    proc_root.unwrap_or(std::path::Path::new("/proc")),
                )
                .with_device_dir(root.read_path(&root.dev_dir()));
                backend.with_holders(scan)
            } else {
                backend
            })
        }
        // The fault file may also put processes on simulated GPUs.
        Backend::Profile(name) => Arc::new(
            SimBackend::from_profile(name, &config.node_name)?
                .with_process_file(config.fault_file.clone()),
        ),
        Backend::Topology(path) => Arc::new(
            SimBackend::from_file(path, &config.node_name)?
                .with_process_file(config.fault_file.clone()),
        ),
    })
}

fn run(cli: Cli) -> Result<(), Failure> {
    match &cli.command {
        Command::Inventory(args) => {
            let config = load_config(&cli, args.settings(&cli.log))?;
            init_logging(config.log_format, cli.log.log_filter.as_deref(), "info");
            let backend = open_backend(&config)?;
            let inv = backend.snapshot()?;
            let text = match args.output {
                InventoryOutput::Table => inventory::table::render(&inv),
                InventoryOutput::Json => {
                    let mut s = serde_json::to_string_pretty(&inv).map_err(anyhow::Error::from)?;
                    s.push('\n');
                    s
                }
                InventoryOutput::Yaml => {
                    crate::yaml::to_string(&inv).map_err(anyhow::Error::from)?
                }
                InventoryOutput::Slices => render_slices(&config, args.counter_layout, &inv)?,
                InventoryOutput::Paths => {
                    let runtime = crate::daemon::runtime().map_err(anyhow::Error::from)?;
                    runtime
                        .block_on(crate::daemon::auto::render_paths(&config, &inv))
                        .map_err(anyhow::Error::from)?
                }
            };
            write_stdout(&text)?;
            Ok(())
        }
        #[cfg(feature = "tools")]
        Command::Demo => tools::run_demo(&cli),
        // Dispatched by `main` before `run`: they have exit codes of their own.
        #[cfg(feature = "tools")]
        Command::Match(_) | Command::Validate(_) | Command::MpsStandin { .. } => Ok(()),
        Command::MemoryLimitHook { .. }
        | Command::DmemHook { .. }
        | Command::MpsGate { .. }
        | Command::ComputeDomain(_) => Ok(()),
        Command::MpsHost(args) => {
            let config = load_config(&cli, args.settings(&cli.log))?;
            init_logging(config.log_format, cli.log.log_filter.as_deref(), "info");
            let quit_deadline =
                crate::health::parse_duration(&args.quit_deadline).map_err(|e| {
                    Failure::Config(config::Error {
                        key: "--quit-deadline".into(),
                        message: e.to_string(),
                    })
                })?;
            let probe_interval =
                crate::health::parse_duration(&args.probe_interval).map_err(|e| {
                    Failure::Config(config::Error {
                        key: "--probe-interval".into(),
                        message: e.to_string(),
                    })
                })?;
            let shm_size = crate::inventory::parse_quantity(&args.shm_size)
                .filter(|b| *b >= 1 << 20)
                .ok_or_else(|| {
                    Failure::Config(config::Error {
                        key: "--shm-size".into(),
                        message: format!(
                            "{:?} is not a size of at least 1Mi (a quantity such as 1Gi or 512Mi)",
                            args.shm_size
                        ),
                    })
                })?;
            crate::mps::host::main(crate::mps::host::Options {
                root: config.mps_root.clone(),
                driver_root: config.driver_root.ctr().to_path_buf(),
                boot_id_file: args
                    .boot_id_file
                    .clone()
                    .unwrap_or_else(|| PathBuf::from(crate::ledger::BOOT_ID_PATH)),
                quit_deadline,
                probe_interval,
                private_shm: args.private_shm,
                shm_size,
            })
            .map_err(|e| Failure::Other(e.into()))
        }
        Command::Run(args) => {
            let config = load_config(&cli, args.settings(&cli.log))?;
            init_logging(config.log_format, cli.log.log_filter.as_deref(), "info");
            let runtime = crate::daemon::runtime().map_err(anyhow::Error::from)?;
            runtime.block_on(async {
                let backend = open_backend_with(&config, args.proc_root.as_deref())?;
                let api = crate::api::connect(&config.api)
                    .await
                    .map_err(anyhow::Error::from)?;
                let extras = crate::daemon::Extras {
                    boot_id_file: args.boot_id_file.clone(),
                    proc_root: args.proc_root.clone(),
                    #[cfg(feature = "crash-points")]
                    crash_at: crate::dra::plugin::crash::from_env()
                        .map_err(|e| Failure::Usage(e.to_string()))?,
                    #[cfg(feature = "crash-points")]
                    kill_task: std::env::var(crate::daemon::KILL_ENV).ok(),
                };
                crate::daemon::run(config, extras, backend, api, Default::default())
                    .await
                    .map_err(|e| match e {
                        // A bad device-plugin config file is a configuration error (exit 64).
                        crate::daemon::Error::DevicePluginConfig(c) => {
                            Failure::Config(config::Error {
                                key: format!("--device-plugin-config {}: {}", c.file, c.key),
                                message: c.message,
                            })
                        }
                        e => Failure::Other(e.into()),
                    })
            })
        }
    }
}

/// The ResourceSlice objects a first publish would create, as multi-document YAML: pool
/// generation 1, names generated by the API server from `<node>-<driver>-`.
fn render_slices(
    config: &Config,
    layout: CounterLayoutArg,
    inv: &inventory::Inventory,
) -> anyhow::Result<String> {
    use k8s_openapi::api::resource::v1::ResourceSlice;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    let opts = slices::SliceOptions {
        driver: config.driver_name.clone(),
        node_name: config.node_name.clone(),
        partitionable: config.partitionable,
        shared_capacity: config.shared_capacity,
        dynamic_mig: config.dynamic_mig.enabled(),
        mig_profiles: config.mig_profiles.clone(),
        layout: layout.into(),
    };
    let mut out = String::new();
    let specs = slices::desired_slices(inv, &opts)?;
    let count = specs.len();
    for (index, mut spec) in specs.into_iter().enumerate() {
        spec.pool.generation = 1;
        let slice = ResourceSlice {
            metadata: ObjectMeta {
                // As the publisher names them: the index first, so the order is the scheduler's.
                generate_name: Some(kubelet_plugin::publisher::generate_name(
                    index,
                    count,
                    &opts.driver,
                    &opts.node_name,
                )),
                ..Default::default()
            },
            spec,
        };
        out.push_str("---\n");
        out.push_str(&crate::yaml::to_string(&slice)?);
    }
    Ok(out)
}

fn write_stdout(text: &str) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        // `nvdra inventory | head` closes the pipe early; that is not an error.
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        r => Ok(r?),
    }
}

/// An error and its causes on one line, each said once (messages do not repeat their source).
fn one_line(e: &anyhow::Error) -> String {
    crate::report::chain(e.as_ref()).to_string()
}

#[cfg(test)]
mod tests {
    #[test]
    fn causes_already_in_the_message_are_not_repeated() {
        let io = std::io::Error::other("disk on fire");
        let e = anyhow::Error::new(io).context("cannot write /x");
        assert_eq!(super::one_line(&e), "cannot write /x: disk on fire");
        // Messages do not repeat their source, so the chain is said once, outermost first.
        let inner = anyhow::anyhow!("bad placement");
        let e = inner.context("topology t.yaml");
        assert_eq!(super::one_line(&e), "topology t.yaml: bad placement");
    }
}
