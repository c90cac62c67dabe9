//! The kubelet side of the device plugin: one `v1beta1.DevicePlugin` server per resource on
//! `<kubelet root>/device-plugins/nvidia-<name>.sock`, each registered on `kubelet.sock`, and the
//! inventory reads that feed their `ListAndWatch` streams. Its parts:
//! - this file: the [`DevicePlugin`] of each mode (its builders) and how it reads the inventory
//!   into the lists it serves;
//! - `serving.rs`: the serving loop ([`DevicePlugin::run`]) and what each re-read changes;
//! - `wake.rs`: what the loop waits on, one named reason at a time;
//! - `sockets.rs`: one gRPC server per resource, bound again when its socket goes;
//! - `registration.rs`: registration on `kubelet.sock`, retried with backoff.
//!
//! Kubelet restarts: a new kubelet deletes every socket in `device-plugins/` and re-creates
//! `kubelet.sock`. Every [`Settings::watch`] (250 ms) the loop stats its own sockets and
//! `kubelet.sock` (device, inode, mtime): an own socket that is gone or replaced is bound again
//! (its old server and streams stop), and a resource not registered with the `kubelet.sock` that
//! exists now is registered — so a restart is answered within about one tick, without an inotify
//! dependency (polling also sees what inotify misses: a socket directory that was itself
//! re-created, or an event lost in a full queue).
//!
//! The lists follow the inventory owner's publications (the node with health applied): each
//! one, a read or a health transition, is looked at once (a MIG device created at prepare
//! reaches the lists from the same read as the slices): a changed device list (health, MIG
//! instances) is sent whole to the open streams; a resource that appears
//! (a MIG reconfiguration) gets its server and registration on the next tick; one that
//! disappears is sent empty. The CDI spec is rewritten when the devices (not their health)
//! change. Streams end on shutdown and when their server is replaced.

mod registration;
mod serving;
mod sockets;
mod wake;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use kubelet_plugin::socket;
use tokio::sync::watch;

use crate::holds::ContainerHolds;
use crate::inventory::{self, Inventory, owner};
use crate::ledger::Ledger;

use super::both::{Both, PodWatch};
use super::resources::{self, Resource};
use super::{Mapped, Options};

/// How often the sockets are checked.
pub const WATCH: Duration = Duration::from_millis(250);
/// How often the inventory owner re-reads the hardware where the device plugin runs (the
/// plugin's own poll before there was one owner).
pub const POLL: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot read the inventory")]
    Inventory(#[from] inventory::Error),
    #[error("cannot compute the device-plugin resources")]
    Resources(#[from] resources::Error),
    #[error("cannot write the device-plugin CDI spec")]
    Cdi(#[from] crate::cdi::Error),
    #[error(transparent)]
    Socket(#[from] socket::Error),
    #[error("the device plugin's {task} stopped unexpectedly: {reason}")]
    Stopped { task: &'static str, reason: String },
}

/// Where the device plugin lives and what it writes.
#[derive(Clone, Debug)]
pub struct Settings {
    /// `<kubelet root>/device-plugins`.
    pub dir: PathBuf,
    /// The DRA driver name: the CDI vendor is `k8s.<driver>`.
    pub driver: String,
    pub driver_root: crate::cdi::DriverRoot,
    pub cdi_root: PathBuf,
    pub watch: Duration,
}

/// Told `true` once every resource is registered with the current kubelet, `false` when one
/// no longer is.
pub type OnRegistered = Arc<dyn Fn(bool) + Send + Sync>;

/// The device-plugin half of the node agent.
pub struct DevicePlugin {
    settings: Settings,
    options: Options,
    /// The inventory owner's publications: the node the lists are computed from.
    node: owner::Watch,
    on_registered: Option<OnRegistered>,
    /// `--mode both`: the ledger shared with DRA ([`super::both`]).
    both: Option<Both>,
    /// `--mode device-plugin`: what containers hold, read from PodResources for `/metrics` only.
    watched: Option<PodWatch>,
    /// `--mode auto`: the names DeviceClasses map to DRA, which this plugin does not serve.
    mapped: Option<watch::Receiver<Mapped>>,
}

impl DevicePlugin {
    /// A plugin serving the node the inventory owner publishes on `node`.
    pub fn new(settings: Settings, options: Options, node: owner::Watch) -> Self {
        Self {
            settings,
            options,
            node,
            on_registered: None,
            both: None,
            watched: None,
            mapped: None,
        }
    }

    /// `--mode auto`: serve only the resources no DeviceClass in `mapped` maps, following it.
    pub fn with_mapped(mut self, mapped: watch::Receiver<Mapped>) -> Self {
        self.mapped = Some(mapped);
        self
    }

    /// `res` without the names DRA serves (in `auto`).
    fn unmapped(&self, mut res: Vec<Resource>) -> Vec<Resource> {
        if let Some(m) = &self.mapped {
            let m = m.borrow();
            res.retain(|r| !m.contains_key(r.name.as_str()));
        }
        res
    }

    /// Logs which path serves each resource name.
    fn log_paths(&self, res: &[Resource]) {
        let mapped = self
            .mapped
            .as_ref()
            .map(|m| m.borrow().clone())
            .unwrap_or_default();
        for r in res {
            tracing::info!(resource = %r.name, path = %super::path_for(&mapped, r.name.as_str()), "serving path");
        }
    }

    /// `--mode both`: devices DRA claims hold are sent unhealthy, Allocate holds its devices
    /// in `holds` (atomically with `ledger`'s claims, which was opened to consult `holds` in
    /// turn), and PodResources on `pod_resources` says what containers hold.
    pub fn with_ledger(
        mut self,
        ledger: Ledger,
        holds: ContainerHolds,
        pod_resources: PathBuf,
    ) -> Self {
        self.both = Some(Both::new(ledger, holds, pod_resources));
        self
    }

    /// `--mode device-plugin`: read which containers hold which devices from PodResources on
    /// `pod_resources` (polled like `both`'s), to report them ([`DevicePlugin::holds`]); nothing
    /// is decided on them.
    pub fn with_pod_resources(mut self, pod_resources: PathBuf) -> Self {
        self.watched = Some(PodWatch::new(pod_resources));
        self
    }

    /// What containers hold through this path: in `both`, for the slices to hide and the
    /// ledger to consult; with [`DevicePlugin::with_pod_resources`], to report.
    pub fn holds(&self) -> Option<ContainerHolds> {
        self.pod_watch().map(|w| w.holds)
    }

    fn pod_watch(&self) -> Option<PodWatch> {
        match &self.both {
            Some(b) => Some(b.pod_watch()),
            None => self.watched.clone(),
        }
    }

    /// How this path shares its devices, spelled as the ledger spells a claim's strategy
    /// (`exclusive`, `timeSlicing`, `mps`), for `/metrics`.
    pub fn sharing_name(&self) -> &'static str {
        match self.options.sharing.as_ref().map(|s| &s.kind) {
            None => "exclusive",
            Some(super::ShareKind::TimeSlicing) => "timeSlicing",
            Some(super::ShareKind::Mps) => "mps",
        }
    }

    /// `both`: reads PodResources once and records what containers hold, so that neither the
    /// first slices nor the first prepares offer a GPU a container kept across our restart.
    /// A kubelet that does not answer is logged; the poll catches up when it does.
    pub async fn observe_once(&self) {
        let Some(both) = &self.both else { return };
        let res = match self.check() {
            Ok((_, res)) => res,
            Err(e) => {
                tracing::warn!(error = %crate::report::chain(&e), "cannot compute the device-plugin resources");
                return;
            }
        };
        match super::both::list(&both.pod_resources).await {
            Ok(answer) => {
                let held = super::both::observed(&answer, &served(&res));
                tracing::info!(
                    devices = held.len(),
                    "containers hold devices of the device-plugin path"
                );
                both.holds.set_observed(held);
            }
            Err(e) => tracing::warn!(error = %crate::report::chain(&e),
                "cannot read which containers hold GPUs yet (is the kubelet up?); the poll retries"),
        }
    }

    /// The resources with the DRA claims' devices marked unhealthy (in `both`).
    fn overlaid(&self, res: Vec<Resource>) -> Vec<Resource> {
        match &self.both {
            Some(b) => super::both::overlay(&b.ledger, res),
            None => res,
        }
    }

    /// Calls `f` whenever "all resources registered" changes (for readiness).
    pub fn on_registered(mut self, f: OnRegistered) -> Self {
        self.on_registered = Some(f);
        self
    }

    /// The resources for the owner's latest publication; an invalid MIG setup for the
    /// configured strategy is an error here, before anything is served.
    pub fn check(&self) -> Result<(Arc<Inventory>, Vec<Resource>), Error> {
        let (inv, lists) = self.read()?;
        Ok((inv, lists.resources))
    }

    /// The owner's latest publication and its lists, leaving out the GPUs DRA's dynamic MIG
    /// shapes: those that can switch at run time (with `--dynamic-mig`) and, in `both`, those
    /// the shared ledger records as switched on by DRA.
    fn read(&self) -> Result<(Arc<Inventory>, resources::Lists), Error> {
        let inv = self.node.borrow().node()?;
        let switched = self
            .both
            .as_ref()
            .map(|b| b.ledger.read(|cp| cp.mig_enabled.clone()))
            .unwrap_or_default();
        let lists = resources::lists(&inv, &self.options, &switched)?;
        Ok((inv, lists))
    }
}

/// The device IDs of each resource (health aside), for reading PodResources.
fn served(res: &[Resource]) -> super::both::Served {
    res.iter()
        .map(|r| (r.name.clone(), Arc::new(r.clone())))
        .collect()
}
