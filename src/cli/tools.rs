//! The commands for people rather than for the kubelet: `nvdra demo`, `match` and `validate`,
//! with the CEL evaluator they need. Built with the `tools` feature (on by default); the
//! DaemonSet's image leaves them out (`--no-default-features`), so `nvdra run` carries none of
//! their code.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, ValueEnum};

use super::{
    Cli, Failure, LogFormat, init_logging, load_config, one_line, open_backend, write_stdout,
};
use crate::config::{BackendSettings, ClusterSettings, PluginSettings, Settings};
use crate::dra::slices;

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

/// `nvdra demo`: the daemon on simulated GPUs, narrated on stdout.
pub(super) fn run_demo(cli: &Cli) -> Result<(), Failure> {
    // Only problems are worth seeing next to the narration.
    init_logging(LogFormat::Plain, cli.log.log_filter.as_deref(), "error");
    let runtime = crate::daemon::runtime().map_err(anyhow::Error::from)?;
    let mut out = std::io::stdout();
    runtime
        .block_on(crate::demo::run(&mut out))
        .map_err(Failure::Other)
}

/// Exit code of `match` and `validate` for input they cannot use.
const EXIT_BAD_INPUT: u8 = 2;

fn bad_input(e: impl std::fmt::Display) -> ExitCode {
    eprintln!("nvdra: {e}");
    ExitCode::from(EXIT_BAD_INPUT)
}

pub(super) fn run_match(cli: &Cli, args: &MatchArgs) -> ExitCode {
    use crate::matching;
    let mut objects = match matching::input::read_files(&args.files) {
        Ok(o) => o,
        Err(e) => return bad_input(crate::report::chain(&e)),
    };
    // One claim per pod of each workload that names a template, as Kubernetes makes them.
    if let Err(e) = matching::input::expand_workloads(&mut objects) {
        return bad_input(crate::report::chain(&e));
    }
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
    // Per node: (node name or "" for the one node of a backend or a file, its slices).
    let mut withdrawn = Withdrawn::default();
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
                Ok((s, w)) => {
                    withdrawn = w;
                    vec![(String::new(), s)]
                }
                Err(e) => return bad_input(e),
            }
        };
    // The node's --share-trust-domain (flag, env or the --config file), applied as prepare would.
    let rule = match share_trust_domain(cli, args) {
        Ok(r) => r,
        Err(e) => return bad_input(e),
    };
    let trust = matching::Trust {
        rule,
        namespace_labels: std::mem::take(&mut objects.namespace_labels),
    };
    let env = crate::cel::Environment::new();
    let result = matching::compile_classes(&objects.classes).and_then(|classes| {
        let mut reports = Vec::new();
        for (node, slices) in &nodes {
            let devices = matching::Node::from_slices(&env, slices)?.with_withdrawn(
                &env,
                &withdrawn.driver,
                &withdrawn.pool,
                std::mem::take(&mut withdrawn.devices),
            )?;
            for mut r in
                matching::explain_all_on(&env, &objects.claims, &classes, &devices, trust.clone())?
            {
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
        reports.iter().any(|r| {
            r.satisfiable && r.name == c.name && r.kind == c.kind && r.namespace == c.namespace()
        })
    });
    if fits && !reports.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// `--share-trust-domain` for `match`: the flag or its env name, else the `--config` file's
/// `shareTrustDomain`, else off.
fn share_trust_domain(
    cli: &Cli,
    args: &MatchArgs,
) -> Result<crate::sharing::trust::TrustDomain, crate::config::Error> {
    if let Some(rule) = &args.plugin.share_trust_domain {
        return Ok(rule.clone());
    }
    let file = cli
        .config
        .as_deref()
        .map(crate::config::FileConfig::load)
        .transpose()?;
    Ok(file
        .and_then(|f| f.settings.plugin.share_trust_domain)
        .unwrap_or_default())
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

/// The devices a backend's node withdrew from its slices (`--dynamic-mig`: holders block the
/// switch they need), each with why, and the pool they belong to.
#[derive(Default)]
struct Withdrawn {
    driver: String,
    pool: String,
    devices: Vec<(k8s_openapi::api::resource::v1::Device, String)>,
}

/// The node's ResourceSlices: from `--slices`, from the `-f` files when they hold some and no
/// backend is named, or built in-process from the backend as the publisher would (with the
/// devices it withdrew, which slices from elsewhere do not tell). Beside `--slices` or a
/// backend, the `-f` files' slices of other drivers on the same node (a NIC driver's, say)
/// join them, so a claim can ask for a GPU and another driver's device together.
fn node_slices(
    cli: &Cli,
    args: &MatchArgs,
    objects: &crate::matching::Objects,
) -> anyhow::Result<(
    Vec<k8s_openapi::api::resource::v1::ResourceSlice>,
    Withdrawn,
)> {
    use k8s_openapi::api::resource::v1::ResourceSlice;
    if let Some(file) = &args.slices {
        let read = crate::matching::input::read_files(std::slice::from_ref(file))?;
        let node = read.slices.iter().find_map(|s| s.spec.node_name.clone());
        return Ok((
            with_other_drivers(read.slices, &objects.slices, node.as_deref()),
            Withdrawn::default(),
        ));
    }
    let named = args.backend.backend.is_some()
        || args.backend.profile.is_some()
        || args.backend.topology.is_some();
    if !named && !objects.slices.is_empty() {
        return Ok((objects.slices.clone(), Withdrawn::default()));
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
        shared_capacity: config.shared_capacity,
        dynamic_mig: config.dynamic_mig.enabled(),
        mig_profiles: config.mig_profiles.clone(),
        layout: slices::CounterLayout::Separate,
    };
    let withdrawn = Withdrawn {
        driver: opts.driver.clone(),
        pool: opts.node_name.clone(),
        devices: slices::withdrawn_devices(&inv, &opts)?
            .into_iter()
            .map(|w| (w.device, w.reason))
            .collect(),
    };
    let slices = slices::desired_slices(&inv, &opts)?
        .into_iter()
        .map(|spec| ResourceSlice {
            metadata: Default::default(),
            spec,
        })
        .collect();
    Ok((
        with_other_drivers(slices, &objects.slices, Some(&opts.node_name)),
        withdrawn,
    ))
}

/// `own` and those of `given` whose driver has no slice in `own`, and which are `node`'s or
/// not tied to one node (all nodes, a node selector): the other drivers' devices on the node.
fn with_other_drivers(
    mut own: Vec<k8s_openapi::api::resource::v1::ResourceSlice>,
    given: &[k8s_openapi::api::resource::v1::ResourceSlice],
    node: Option<&str>,
) -> Vec<k8s_openapi::api::resource::v1::ResourceSlice> {
    let drivers: std::collections::BTreeSet<String> =
        own.iter().map(|s| s.spec.driver.clone()).collect();
    own.extend(
        given
            .iter()
            .filter(|s| !drivers.contains(&s.spec.driver))
            .filter(|s| match (s.spec.node_name.as_deref(), node) {
                (Some(theirs), Some(ours)) => theirs == ours,
                _ => true,
            })
            .cloned(),
    );
    own
}

pub(super) fn run_validate(args: &ValidateArgs) -> ExitCode {
    let objects = match crate::matching::input::read_files(&args.files) {
        Ok(o) => o,
        Err(e) => return bad_input(crate::report::chain(&e)),
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
