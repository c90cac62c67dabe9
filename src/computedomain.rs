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
