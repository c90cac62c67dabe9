//! The command line: clap definitions (the source of truth for flags, env names and help) and
//! the dispatch to each subcommand.

use std::ffi::OsStr;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::config::{
    self, ApiSettings, Backend, BackendSettings, ClusterSettings, Config, DaemonSettings,
    FileConfig, HealthSettings, KubeletSettings, LogFormat, LogSettings, PluginSettings,
    ServeSettings, Settings,
};
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
    Demo,
    /// Which of the node's devices a ResourceClaim (or template) can get, and why not. Exit
    /// code 0: satisfiable; 1: not; 2: bad input.
    Match(Box<MatchArgs>),
    /// Compile every CEL selector in DeviceClasses, ResourceClaims and templates. Exit code 0:
    /// all compile; 1: some do not; 2: bad input.
    Validate(ValidateArgs),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum MatchOutput {
    Table,
    Json,
}

/// Flags of `nvdra match`.
#[derive(Debug, Args)]
#[command(mut_arg("kubeconfig", match_kubeconfig))]
pub struct MatchArgs {
    /// ResourceClaims, ResourceClaimTemplates and DeviceClasses (YAML or JSON, multi-document).
    #[arg(short = 'f', long = "filename", value_name = "FILE", required = true)]
    pub files: Vec<PathBuf>,

    /// The node's devices from ResourceSlices (as `nvdra inventory -o slices` prints them)
    /// instead of a backend.
    #[arg(long, env = "NVDRA_SLICES", value_name = "FILE", conflicts_with_all = ["profile", "topology"])]
    pub slices: Option<PathBuf>,

    #[command(flatten)]
    pub cluster: ClusterSettings,

    /// With --kubeconfig: only this node's ResourceSlices.
    #[arg(
        long = "node",
        env = "NVDRA_MATCH_NODE",
        value_name = "NAME",
        requires = "kubeconfig"
    )]
    pub node: Option<String>,

    #[command(flatten)]
    pub backend: BackendSettings,

    #[command(flatten)]
    pub plugin: PluginSettings,

    /// Output format.
    #[arg(short = 'o', long = "output", value_enum, default_value = "table")]
    pub output: MatchOutput,
}

/// `--kubeconfig` ([`ClusterSettings`]) as `match` uses it: a cluster to read instead of a
/// backend or a slices file.
fn match_kubeconfig(arg: clap::Arg) -> clap::Arg {
    arg.help(
        "Read the ResourceSlices and DeviceClasses of a live cluster (read-only) and explain \
         the claim per node",
    )
    .conflicts_with_all(["slices", "profile", "topology"])
}

/// Flags of `nvdra validate`.
#[derive(Debug, Args)]
pub struct ValidateArgs {
    /// DeviceClasses, ResourceClaims and ResourceClaimTemplates (YAML or JSON, multi-document).
    #[arg(short = 'f', long = "filename", value_name = "FILE", required = true)]
    pub files: Vec<PathBuf>,
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

    /// Read the boot id from this file instead of /proc/sys/kernel/random/boot_id (tests).
    #[arg(long, env = "NVDRA_BOOT_ID_FILE", value_name = "FILE", hide = true)]
    pub boot_id_file: Option<PathBuf>,
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
    match &cli.command {
        Command::Match(args) => return run_match(&cli, args),
        Command::Validate(args) => return run_validate(args),
        _ => {}
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

/// `settings` (the command line and environment) over the `--config` file, validated.
fn load_config(cli: &Cli, settings: Settings) -> Result<Config, config::Error> {
    let file = cli.config.as_deref().map(FileConfig::load).transpose()?;
    config::resolve(settings, file)
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
                        .block_on(crate::deviceplugin::auto::render_paths(&config, &inv))
                        .map_err(anyhow::Error::from)?
                }
            };
            write_stdout(&text)?;
            Ok(())
        }
        Command::Demo => {
            // Only problems are worth seeing next to the narration.
            init_logging(LogFormat::Plain, cli.log.log_filter.as_deref(), "error");
            let runtime = crate::daemon::runtime().map_err(anyhow::Error::from)?;
            let mut out = std::io::stdout();
            runtime
                .block_on(crate::demo::run(&mut out))
                .map_err(Failure::Other)
        }
        // Dispatched by `main` before `run`: they have exit codes of their own.
        Command::Match(_) | Command::Validate(_) => Ok(()),
        Command::Run(args) => {
            let config = load_config(&cli, args.settings(&cli.log))?;
            init_logging(config.log_format, cli.log.log_filter.as_deref(), "info");
            let runtime = crate::daemon::runtime().map_err(anyhow::Error::from)?;
            runtime.block_on(async {
                let backend = open_backend(&config)?;
                let api = crate::api::connect(&config.api)
                    .await
                    .map_err(anyhow::Error::from)?;
                let extras = crate::daemon::Extras {
                    boot_id_file: args.boot_id_file.clone(),
                    #[cfg(feature = "crash-points")]
                    crash_at: crate::dra::plugin::crash::from_env()
                        .map_err(|e| Failure::Usage(e.to_string()))?,
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

/// Exit code of `match` and `validate` for input they cannot use.
const EXIT_BAD_INPUT: u8 = 2;

fn bad_input(e: impl std::fmt::Display) -> ExitCode {
    eprintln!("nvdra: {e}");
    ExitCode::from(EXIT_BAD_INPUT)
}

fn run_match(cli: &Cli, args: &MatchArgs) -> ExitCode {
    use crate::matching;
    let objects = match matching::input::read_files(&args.files) {
        Ok(o) => o,
        Err(e) => return bad_input(kubelet_plugin::report::chain(&e)),
    };
    if objects.claims.is_empty() {
        return bad_input(format!(
            "no ResourceClaim or ResourceClaimTemplate in {}",
            args.files
                .iter()
                .map(|f| f.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    let mut objects = objects;
    // Per node: (node name or "" for the one node of a backend or a file, its slices).
    let nodes: Vec<(String, Vec<k8s_openapi::api::resource::v1::ResourceSlice>)> =
        if let Some(kubeconfig) = &args.cluster.kubeconfig {
            match live_slices(kubeconfig, args.node.as_deref()) {
                Ok((slices, classes)) => {
                    // Classes given with -f win over the cluster's.
                    objects.classes.extend(classes.into_iter().map(|c| {
                        (
                            c,
                            matching::Origin {
                                file: kubeconfig.clone(),
                                doc: 0,
                                line: 0,
                            },
                        )
                    }));
                    matching::group_by_node(slices)
                }
                Err(e) => return bad_input(one_line(&e)),
            }
        } else {
            match node_slices(cli, args, &objects) {
                Ok(s) => vec![(String::new(), s)],
                Err(e) => return bad_input(e),
            }
        };
    let env = crate::cel::Environment::new();
    let result = matching::compile_classes(&objects.classes).and_then(|classes| {
        let mut reports = Vec::new();
        for (node, slices) in &nodes {
            let devices = matching::candidates(&env, slices)?;
            for c in &objects.claims {
                let mut r = matching::explain(&env, c, &classes, &devices)?;
                if !node.is_empty() {
                    r.node = Some(node.clone());
                }
                reports.push(r);
            }
        }
        Ok(reports)
    });
    let reports = match result {
        Ok(r) => r,
        Err(e) => return bad_input(e),
    };
    let text = match args.output {
        MatchOutput::Table => matching::render_table(&reports),
        MatchOutput::Json => match serde_json::to_string_pretty(&reports) {
            Ok(s) => s + "\n",
            Err(e) => return bad_input(e),
        },
    };
    if let Err(e) = write_stdout(&text) {
        eprintln!("nvdra: {e}");
        return ExitCode::FAILURE;
    }
    // Satisfiable when every claim fits on some node.
    let fits = objects.claims.iter().all(|c| {
        reports
            .iter()
            .any(|r| r.satisfiable && r.name == c.name && r.kind == c.kind)
    });
    if fits && !reports.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// The cluster's ResourceSlices (of `node`, when named) and DeviceClasses, read only.
fn live_slices(
    kubeconfig: &std::path::Path,
    node: Option<&str>,
) -> anyhow::Result<(
    Vec<k8s_openapi::api::resource::v1::ResourceSlice>,
    Vec<k8s_openapi::api::resource::v1::DeviceClass>,
)> {
    let runtime = crate::daemon::runtime()?;
    runtime.block_on(async {
        let api = crate::api::kube::KubeApi::new(Some(kubeconfig)).await?;
        Ok(api.list_for_match(node).await?)
    })
}

/// The node's ResourceSlices: from `--slices`, from the `-f` files when they hold some and no
/// backend is named, or built in-process from the backend as the publisher would.
fn node_slices(
    cli: &Cli,
    args: &MatchArgs,
    objects: &crate::matching::Objects,
) -> anyhow::Result<Vec<k8s_openapi::api::resource::v1::ResourceSlice>> {
    use k8s_openapi::api::resource::v1::ResourceSlice;
    if let Some(file) = &args.slices {
        let read = crate::matching::input::read_files(std::slice::from_ref(file))?;
        return Ok(read.slices);
    }
    let named = args.backend.backend.is_some()
        || args.backend.profile.is_some()
        || args.backend.topology.is_some();
    if !named && !objects.slices.is_empty() {
        return Ok(objects.slices.clone());
    }
    let settings = Settings {
        backend: args.backend.clone(),
        plugin: args.plugin.clone(),
        log: cli.log.clone(),
        ..Settings::default()
    };
    let config = load_config(cli, settings)?;
    let inv = open_backend(&config)?.snapshot()?;
    let opts = slices::SliceOptions {
        driver: config.driver_name.clone(),
        node_name: config.node_name.clone(),
        partitionable: config.partitionable,
        layout: slices::CounterLayout::Separate,
    };
    Ok(slices::desired_slices(&inv, &opts)?
        .into_iter()
        .map(|spec| ResourceSlice {
            metadata: Default::default(),
            spec,
        })
        .collect())
}

fn run_validate(args: &ValidateArgs) -> ExitCode {
    let objects = match crate::matching::input::read_files(&args.files) {
        Ok(o) => o,
        Err(e) => return bad_input(kubelet_plugin::report::chain(&e)),
    };
    let problems = crate::matching::validate(&objects);
    let mut text = String::new();
    for p in &problems {
        text.push_str(&format!("{p}\n"));
    }
    let n = objects.classes.len() + objects.claims.len();
    if problems.is_empty() {
        text.push_str(&format!("{n} objects, every CEL expression compiles\n"));
    }
    if let Err(e) = write_stdout(&text) {
        eprintln!("nvdra: {e}");
        return ExitCode::FAILURE;
    }
    if problems.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
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
    kubelet_plugin::report::chain(e.as_ref()).to_string()
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
