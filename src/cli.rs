//! The command line: clap definitions (the source of truth for flags, env names and help) and
//! the dispatch to each subcommand.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::config::{self, Backend, BackendKind, Config, FileConfig, LogFormat, Overrides};
use crate::dra::slices;
use crate::inventory::{self, DeviceBackend, nvml::NvmlBackend, sim::SimBackend};

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

    /// Log format on stderr.
    #[arg(long, env = "NVDRA_LOG_FORMAT", global = true, value_enum)]
    pub log_format: Option<LogFormat>,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Show the node's GPUs, MIG devices and topology.
    Inventory(InventoryArgs),
    /// Run the node agent: the DRA kubelet plugin and the ResourceSlice publisher.
    Run(Box<RunArgs>),
    /// The whole DRA flow on simulated GPUs in a temporary directory, narrated (no cluster,
    /// no GPU).
    Demo,
}

/// Flags of `nvdra run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// dra, device-plugin, both, or auto (DRA where the cluster supports it).
    #[arg(long, env = "NVDRA_MODE", value_enum)]
    pub mode: Option<config::Mode>,

    #[command(flatten)]
    pub backend: BackendArgs,

    /// DRA driver name (also the CDI vendor suffix and the plugin directory name).
    #[arg(long, env = "NVDRA_DRIVER_NAME", value_name = "NAME")]
    pub driver_name: Option<String>,

    /// The kubelet's --root-dir; sockets go to its plugins/ and plugins_registry/.
    #[arg(long, env = "NVDRA_KUBELET_ROOT", value_name = "DIR")]
    pub kubelet_root: Option<PathBuf>,

    /// Where claim CDI specs are written (the container runtime's CDI spec directory).
    #[arg(long, env = "NVDRA_CDI_ROOT", value_name = "DIR")]
    pub cdi_root: Option<PathBuf>,

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

    /// This pod's UID (downward API), for rolling updates: socket names carry it so two
    /// instances can serve side by side.
    #[arg(long, env = "POD_UID", value_name = "UID")]
    pub pod_uid: Option<String>,

    /// Address of /metrics, /healthz and /readyz.
    #[arg(long, env = "NVDRA_METRICS_ADDRESS", value_name = "ADDR")]
    pub metrics_address: Option<String>,

    /// Publish shared counters and every possible MIG placement, creating MIG devices at
    /// prepare (needs the DRAPartitionableDevices feature gate).
    #[arg(
        long,
        env = "NVDRA_PARTITIONABLE",
        value_name = "BOOL",
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true"
    )]
    pub partitionable: Option<bool>,

    /// Read the boot id from this file instead of /proc/sys/kernel/random/boot_id (tests).
    #[arg(long, env = "NVDRA_BOOT_ID_FILE", value_name = "FILE", hide = true)]
    pub boot_id_file: Option<PathBuf>,

    /// Crash tests only: abort at this point of prepare (after-started, after-cdi,
    /// before-completed, after-completed).
    #[arg(long, env = "NVDRA_TEST_CRASH_AT", value_name = "POINT", hide = true)]
    pub test_crash_at: Option<crate::dra::plugin::CrashPoint>,
}

impl RunArgs {
    fn overrides(&self) -> Overrides {
        Overrides {
            mode: self.mode,
            driver_name: self.driver_name.clone(),
            kubelet_root: self.kubelet_root.clone(),
            cdi_root: self.cdi_root.clone(),
            kubeconfig: self.kubeconfig.clone(),
            api_dir: self.api_dir.clone(),
            pod_uid: self.pod_uid.clone(),
            metrics_address: self.metrics_address.clone(),
            partitionable: self.partitionable,
            ..self.backend.overrides()
        }
    }
}

/// Where GPUs come from.
#[derive(Debug, Clone, Args)]
pub struct BackendArgs {
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

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum InventoryOutput {
    Table,
    Json,
    Yaml,
    /// The ResourceSlices a first publish would send, as multi-document YAML.
    Slices,
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

#[derive(Debug, Args)]
pub struct InventoryArgs {
    #[command(flatten)]
    pub backend: BackendArgs,

    /// Output format.
    #[arg(short = 'o', long = "output", value_enum, default_value = "table")]
    pub output: InventoryOutput,

    /// DRA driver name the slices are published under (-o slices).
    #[arg(long, env = "NVDRA_DRIVER_NAME", value_name = "NAME")]
    pub driver_name: Option<String>,

    /// Publish shared counters and every possible MIG placement (needs the
    /// DRAPartitionableDevices feature gate); -o slices shows the result.
    #[arg(
        long,
        env = "NVDRA_PARTITIONABLE",
        value_name = "BOOL",
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true"
    )]
    pub partitionable: Option<bool>,

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

impl BackendArgs {
    fn overrides(&self) -> Overrides {
        Overrides {
            backend: self.backend,
            profile: self.profile.clone(),
            topology: self.topology.clone(),
            driver_root: self.driver_root.clone(),
            node_name: self.node_name.clone(),
            ..Default::default()
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
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure::Config(e)) => {
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

fn load_config(cli: &Cli, mut overrides: Overrides) -> Result<Config, config::Error> {
    let file = cli.config.as_deref().map(FileConfig::load).transpose()?;
    overrides.log_format = cli.log_format;
    config::resolve(overrides, file)
}

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("NVDRA_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Plain => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
}

/// Opens the backend the configuration names.
pub fn open_backend(config: &Config) -> inventory::Result<Arc<dyn DeviceBackend>> {
    Ok(match &config.backend {
        Backend::Nvml { .. } => Arc::new(NvmlBackend::open(&config.driver_root)?),
        Backend::Profile(name) => Arc::new(SimBackend::from_profile(name, &config.node_name)?),
        Backend::Topology(path) => Arc::new(SimBackend::from_file(path, &config.node_name)?),
    })
}

fn run(cli: Cli) -> Result<(), Failure> {
    match &cli.command {
        Command::Inventory(args) => {
            let overrides = Overrides {
                driver_name: args.driver_name.clone(),
                partitionable: args.partitionable,
                ..args.backend.overrides()
            };
            let config = load_config(&cli, overrides)?;
            init_logging(config.log_format);
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
            };
            write_stdout(&text)?;
            Ok(())
        }
        Command::Demo => {
            // Only problems are worth seeing next to the narration.
            let filter = tracing_subscriber::EnvFilter::try_from_env("NVDRA_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("error"));
            let _ = tracing_subscriber::fmt()
                .with_env_filter(filter)
                .with_writer(std::io::stderr)
                .try_init();
            let runtime = crate::daemon::runtime().map_err(anyhow::Error::from)?;
            let mut out = std::io::stdout();
            runtime
                .block_on(crate::demo::run(&mut out))
                .map_err(Failure::Other)
        }
        Command::Run(args) => {
            let config = load_config(&cli, args.overrides())?;
            init_logging(config.log_format);
            let runtime = crate::daemon::runtime().map_err(anyhow::Error::from)?;
            runtime.block_on(async {
                let backend = open_backend(&config)?;
                let api = crate::api::connect(&config.api)
                    .await
                    .map_err(anyhow::Error::from)?;
                let extras = crate::daemon::Extras {
                    boot_id_file: args.boot_id_file.clone(),
                    crash_at: args.test_crash_at,
                };
                crate::daemon::run(config, extras, backend, api, Default::default())
                    .await
                    .map_err(|e| Failure::Other(e.into()))
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
        layout: layout.into(),
    };
    let mut out = String::new();
    for mut spec in slices::desired_slices(inv, &opts)? {
        spec.pool.generation = 1;
        let slice = ResourceSlice {
            metadata: ObjectMeta {
                generate_name: Some(format!("{}-{}-", opts.node_name, opts.driver)),
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

/// An error and its causes on one line, skipping a cause whose text the message already
/// includes (most of ours interpolate their source), so nothing is said twice.
fn one_line(e: &anyhow::Error) -> String {
    let mut msg = e.to_string();
    for cause in e.chain().skip(1) {
        let c = cause.to_string();
        if !msg.contains(&c) {
            msg.push_str(": ");
            msg.push_str(&c);
        }
    }
    msg
}

#[cfg(test)]
mod tests {
    #[test]
    fn causes_already_in_the_message_are_not_repeated() {
        let io = std::io::Error::other("disk on fire");
        let e = anyhow::Error::new(io).context("cannot write /x");
        assert_eq!(super::one_line(&e), "cannot write /x: disk on fire");
        let inner = anyhow::anyhow!("bad placement");
        let e = inner.context("topology t.yaml: bad placement");
        assert_eq!(super::one_line(&e), "topology t.yaml: bad placement");
    }
}
