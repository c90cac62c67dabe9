//! ComputeDomains: multi-node NVLink (GB200/GB300 NVL72 racks) through IMEX daemons and IMEX
//! channels, as a drop-in for NVIDIA's `compute-domain.nvidia.com` driver.
//!
//! - [`api`]: the `resource.nvidia.com/v1beta1` kinds (ComputeDomain, ComputeDomainClique, the
//!   opaque channel and daemon configs) and the names users' YAML and NVIDIA's nodes rely on.
//! - [`plugin`]: the second kubelet plugin (driver `compute-domain.nvidia.com`) on the
//!   kubelet-plugin library: channel and daemon devices, their CDI specs, its own checkpoint.
//! - [`controller`]: the leader-elected controller: per-domain templates, daemon placement,
//!   status, finalizers and cleanup.
//! - [`daemon`]: the per-node IMEX daemon supervisor (`nodes.cfg`, the host's `nvidia-imex`,
//!   readiness from `nvidia-imex-ctl -q`), or the check of a host-managed one.
//!
//! Each runs as `nvdra compute-domain <plugin|controller|daemon>` from nvdra's image.

use std::process::ExitCode;

pub mod api;
pub mod controller;
pub mod daemon;
pub mod plugin;

/// `nvdra compute-domain …`.
#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// The compute-domain kubelet plugin (driver compute-domain.nvidia.com) for this node.
    Plugin(Box<plugin::Args>),
    /// The leader-elected ComputeDomain controller (one Deployment per cluster).
    Controller(Box<controller::Args>),
    /// One node's IMEX daemon for a ComputeDomain (or the check of a host-managed one).
    Daemon(Box<daemon::Args>),
}

/// Runs one of the three; the process exit code comes back.
pub fn main(command: Command) -> ExitCode {
    let (name, result) = match command {
        Command::Plugin(args) => ("plugin", plugin::run(*args)),
        Command::Controller(args) => ("controller", controller::run(*args)),
        Command::Daemon(args) => ("daemon", daemon::run(*args)),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("nvdra compute-domain {name}: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// The README's flag table of one subcommand (after `<!-- compute-domain NAME flags -->`) is
/// its flags: a row per flag naming its env name and its default (an empty default reads as
/// anything, `false` as `off`), and no row for a flag that does not exist.
#[cfg(test)]
fn assert_readme_lists_the_flags<A: clap::Args>(name: &str) {
    let command = A::augment_args(clap::Command::new("compute-domain"));
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md"))
        .expect("README.md reads");
    let marker = format!("<!-- compute-domain {name} flags -->");
    let table: Vec<&str> = readme
        .split(&marker)
        .nth(1)
        .unwrap_or_else(|| panic!("README has the {name}'s flag table after {marker}"))
        .lines()
        .skip_while(|l| !l.starts_with("| flag |"))
        .skip(2)
        .take_while(|l| l.starts_with('|'))
        .collect();
    let mut rows = 0;
    for arg in command.get_arguments() {
        let Some(long) = arg.get_long() else { continue };
        let row = table
            .iter()
            .find(|l| l.starts_with(&format!("| `--{long}`")))
            .unwrap_or_else(|| panic!("README has no row for {name} --{long}"));
        let env = arg
            .get_env()
            .unwrap_or_else(|| panic!("{name} --{long} has no env name"))
            .to_string_lossy();
        assert!(
            row.contains(&format!("`{env}`")),
            "{name} --{long}: env {env} in {row}"
        );
        match arg
            .get_default_values()
            .first()
            .map(|d| d.to_string_lossy())
        {
            None => {}
            Some(d) if d.is_empty() => {}
            Some(d) if d == "false" => {
                assert!(row.contains("off"), "{name} --{long}: default off in {row}")
            }
            Some(d) => assert!(
                row.contains(&format!("`{d}`")),
                "{name} --{long}: default `{d}` in {row}"
            ),
        }
        rows += 1;
    }
    assert_eq!(
        rows,
        table.len(),
        "a README row of the {name} names no flag"
    );
}

/// The README's tables of the three parts' flags are their flags.
#[cfg(test)]
#[test]
fn the_readme_tables_list_every_flag() {
    assert_readme_lists_the_flags::<plugin::Args>("plugin");
    assert_readme_lists_the_flags::<controller::Args>("controller");
    assert_readme_lists_the_flags::<daemon::Args>("daemon");
}
