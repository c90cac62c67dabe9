//! The kubelet side of the device plugin: one `v1beta1.DevicePlugin` server per resource on
//! `<kubelet root>/device-plugins/nvidia-<name>.sock`, each registered on `kubelet.sock`, and the
//! inventory poll that feeds their `ListAndWatch` streams.
//!
//! Kubelet restarts: a new kubelet deletes every socket in `device-plugins/` and re-creates
//! `kubelet.sock`. Every [`Settings::watch`] (250 ms) the loop stats its own sockets and
//! `kubelet.sock` (device, inode, mtime): an own socket that is gone or replaced is bound again
//! (its old server and streams stop), and a resource not registered with the `kubelet.sock` that
//! exists now is registered — so a restart is answered within about one tick, without an inotify
//! dependency (polling also sees what inotify misses: a socket directory that was itself
//! re-created, or an event lost in a full queue). A refused or failed registration is logged and
//! retried with exponential backoff (1 s up to 30 s), at once when `kubelet.sock` changes.
//!
//! The inventory is re-read every [`Settings::poll`], at once on every transition of the
//! health monitor when one is given ([`DevicePlugin::with_health`]), and at once on every read
//! the inventory owner publishes when its watch is given ([`DevicePlugin::with_inventory`]: a
//! MIG device created at prepare reaches the lists from the same read as the slices): a changed device list
//! (health, MIG instances) is sent whole to the open streams; a resource that appears (a MIG
//! reconfiguration) gets its server and registration on the next tick; one that disappears is
//! sent empty. The CDI spec is rewritten when the devices (not their health) change.
//!
//! Every server goes through [`socket::incoming`], so the kubelet's `:authority` habits are
//! handled as on the DRA socket. Streams end on shutdown and when their server is replaced.
//!
//! The serving loop ([`DevicePlugin::run`]) waits in one place, `Wakers::next`, for a named
//! reason (`Wake`: the socket tick, a ledger or DeviceClass change of `--mode both` and `auto`,
//! the end of the PodResources poll, a re-read), and hands each to its own method; a mode that
//! waits on something new adds a `Wake` and a handler, not an arm in a long `select!`.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tonic::Status;

use crate::holds::ContainerHolds;
use crate::inventory::{self, DeviceBackend, Inventory};
use crate::ledger::Ledger;
use kubelet_plugin::proto::deviceplugin::v1beta1 as pb;
use kubelet_plugin::proto::deviceplugin::v1beta1::device_plugin_server::DevicePluginServer;
use kubelet_plugin::proto::deviceplugin::v1beta1::registration_client::RegistrationClient;
use kubelet_plugin::socket;

use super::allocate::Context;
use super::auto::Mapped;
use super::both::{Both, PodWatch};
use super::resources::{self, Resource};
use super::service::Service;
use super::{Options, ResourceName, wire};

/// The kubelet's registration socket, in the device-plugin directory.
pub const KUBELET_SOCKET: &str = "kubelet.sock";
/// How often the sockets are checked.
pub const WATCH: Duration = Duration::from_millis(250);
/// How often the inventory is re-read for health and device changes.
pub const POLL: Duration = Duration::from_secs(5);
/// How long one registration may take.
const REGISTER_TIMEOUT: Duration = Duration::from_secs(5);
const BACKOFF_START: Duration = Duration::from_secs(1);
const BACKOFF_MAX: Duration = Duration::from_secs(30);

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

#[derive(Debug, thiserror::Error)]
enum RegisterError {
    #[error("cannot connect to {path}")]
    Connect {
        path: PathBuf,
        #[source]
        source: tonic::transport::Error,
    },
    #[error("no answer from {path} within {REGISTER_TIMEOUT:?}")]
    Timeout { path: PathBuf },
    #[error("the kubelet refused the registration")]
    Refused(#[source] Status),
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
    pub poll: Duration,
}

/// Told `true` once every resource is registered with the current kubelet, `false` when one
/// no longer is.
pub type OnRegistered = Arc<dyn Fn(bool) + Send + Sync>;

/// The device-plugin half of the node agent.
pub struct DevicePlugin {
    settings: Settings,
    options: Options,
    backend: Arc<dyn DeviceBackend>,
    on_registered: Option<OnRegistered>,
    health: Option<crate::health::Watch>,
    inventory: Option<inventory::owner::Watch>,
    /// `--mode both`: the ledger shared with DRA ([`super::both`]).
    both: Option<Both>,
    /// `--mode device-plugin`: what containers hold, read from PodResources for `/metrics` only.
    watched: Option<PodWatch>,
    /// `--mode auto`: the names DeviceClasses map to DRA, which this plugin does not serve.
    mapped: Option<watch::Receiver<Mapped>>,
}

/// The file identity of a socket: device, inode, mtime.
type Identity = (u64, u64, i64, i64);

/// What the serving loop keeps between wake-ups: the servers, and what they last served.
struct State {
    slots: Vec<Slot>,
    kubelet_sock: PathBuf,
    /// Whether every slot was registered at the last tick.
    all_registered: bool,
    /// The resources of the last inventory read (before the overlay and DRA's share).
    last_res: Vec<Resource>,
    /// The devices the CDI spec was last written for.
    last_devices: Vec<(String, u32, Vec<String>)>,
    /// The GPUs the last lists left out (dynamic MIG), so each change is logged once.
    left_out: Vec<resources::LeftOut>,
    /// The served device IDs, for the PodResources poll.
    served_tx: watch::Sender<super::both::Served>,
}

/// What wakes the serving loop; [`Wakers::next`] looks in this order.
enum Wake {
    Shutdown,
    /// Time to check the sockets and registrations ([`Settings::watch`]).
    Tick,
    /// `--mode both`: the ledger changed.
    Ledger,
    /// `--mode auto`: the DeviceClasses' mapping changed.
    Classes,
    /// The PodResources poll ended, with why.
    PodsEnded(String),
    /// Time to re-read the inventory: the poll ([`Settings::poll`]), a health transition, or a
    /// new read of the inventory owner.
    Reread,
}

/// Everything the serving loop waits on; each mode adds its own.
struct Wakers {
    tick: tokio::time::Interval,
    poll: tokio::time::Interval,
    /// `--mode both`: the ledger's changes.
    changes: Option<watch::Receiver<u64>>,
    /// `--mode auto`: the resource names DeviceClasses map to DRA.
    mapped: Option<watch::Receiver<Mapped>>,
    /// The PodResources poll, when one runs.
    pods: Option<JoinHandle<()>>,
    health: Option<crate::health::Watch>,
    published: Option<inventory::owner::Watch>,
}

impl Wakers {
    async fn new(
        plugin: &DevicePlugin,
        changes: Option<watch::Receiver<u64>>,
        pods: Option<JoinHandle<()>>,
    ) -> Self {
        let mut tick = tokio::time::interval(plugin.settings.watch);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut poll = tokio::time::interval(plugin.settings.poll);
        poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        poll.tick().await;
        let mut published = plugin.inventory.clone();
        if let Some(p) = &mut published {
            // The lists the loop starts with are from the latest publication already.
            p.mark_unchanged();
        }
        Wakers {
            tick,
            poll,
            changes,
            mapped: plugin.mapped.clone(),
            pods,
            health: plugin.health.clone(),
            published,
        }
    }

    /// Waits for the next reason to act; shutdown first, then in the order of [`Wake`].
    async fn next(&mut self, shutdown: &CancellationToken) -> Wake {
        tokio::select! {
            biased;
            () = shutdown.cancelled() => Wake::Shutdown,
            _ = self.tick.tick() => Wake::Tick,
            Ok(()) = async {
                match &mut self.changes {
                    Some(c) => c.changed().await,
                    None => std::future::pending().await,
                }
            } => Wake::Ledger,
            Ok(()) = async {
                match &mut self.mapped {
                    Some(m) => m.changed().await,
                    None => std::future::pending().await,
                }
            } => Wake::Classes,
            Some(done) = async {
                match &mut self.pods {
                    Some(p) => Some(p.await),
                    None => std::future::pending().await,
                }
            } => Wake::PodsEnded(match done {
                Ok(()) => "ended".to_string(),
                Err(e) => e.to_string(),
            }),
            _ = self.poll.tick() => Wake::Reread,
            // A health transition re-reads at once instead of at the next poll.
            Some(()) = crate::health::changed(&mut self.health) => {
                self.poll.reset();
                Wake::Reread
            }
            // So does a new read of the inventory owner.
            Some(()) = inventory::owner::changed(&mut self.published) => {
                self.poll.reset();
                Wake::Reread
            }
        }
    }
}

fn identity(path: &Path) -> Option<Identity> {
    std::fs::symlink_metadata(path)
        .ok()
        .map(|m| (m.dev(), m.ino(), m.mtime(), m.mtime_nsec()))
}

/// One resource: its server, and where it stands with the kubelet.
struct Slot {
    name: ResourceName,
    path: PathBuf,
    devices: watch::Sender<Arc<Resource>>,
    server: Option<(CancellationToken, JoinHandle<()>, Identity)>,
    /// The `kubelet.sock` this resource is registered with.
    registered: Option<Identity>,
    /// The `kubelet.sock` of the last failed attempt, when to try again, and the next delay.
    failed: Option<(Identity, Instant, Duration)>,
}

impl Slot {
    fn new(dir: &Path, r: Resource) -> Slot {
        Slot {
            path: dir.join(r.name.socket_file()),
            name: r.name.clone(),
            devices: watch::channel(Arc::new(r)).0,
            server: None,
            registered: None,
            failed: None,
        }
    }
}

/// What the CDI spec depends on: the devices and their nodes, not their health.
fn cdi_identity(inv: &Inventory) -> Vec<(String, u32, Vec<String>)> {
    inv.gpus
        .iter()
        .map(|g| {
            (
                g.uuid.to_string(),
                g.minor,
                g.mig.devices.iter().map(|m| m.uuid.to_string()).collect(),
            )
        })
        .collect()
}

impl DevicePlugin {
    pub fn new(settings: Settings, options: Options, backend: Arc<dyn DeviceBackend>) -> Self {
        Self {
            settings,
            options,
            backend,
            on_registered: None,
            health: None,
            inventory: None,
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
            tracing::info!(resource = %r.name, path = %super::auto::path_for(&mapped, r.name.as_str()), "serving path");
        }
    }

    /// `--mode both`: devices DRA claims hold are sent unhealthy, Allocate holds its devices
    /// (atomically with `ledger`'s claims, which consults these holds in turn), and PodResources
    /// on `pod_resources` says what containers hold.
    pub fn with_ledger(mut self, ledger: Ledger, pod_resources: PathBuf) -> Self {
        self.both = Some(Both::new(ledger, pod_resources));
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
        let res = match self.check().await {
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

    /// Re-reads the inventory (and re-sends changed lists) on every transition of the health
    /// monitor, instead of waiting for the next poll.
    pub fn with_health(mut self, health: crate::health::Watch) -> Self {
        self.health = Some(health);
        self
    }

    /// Re-reads the inventory (and re-sends changed lists) on every read the inventory owner
    /// publishes, instead of waiting for the next poll.
    pub fn with_inventory(mut self, inventory: inventory::owner::Watch) -> Self {
        self.inventory = Some(inventory);
        self
    }

    /// Calls `f` whenever "all resources registered" changes (for readiness).
    pub fn on_registered(mut self, f: OnRegistered) -> Self {
        self.on_registered = Some(f);
        self
    }

    /// The resources for the backend's current inventory; an invalid MIG setup for the
    /// configured strategy is an error here, before anything is served.
    pub async fn check(&self) -> Result<(Inventory, Vec<Resource>), Error> {
        let (inv, lists) = self.read().await?;
        Ok((inv, lists.resources))
    }

    /// The backend's current inventory and its lists, leaving out the GPUs DRA's dynamic MIG
    /// shapes: those that can switch at run time (with `--dynamic-mig`) and, in `both`, those
    /// the shared ledger records as switched on by DRA.
    async fn read(&self) -> Result<(Inventory, resources::Lists), Error> {
        let inv = inventory::refresh(self.backend.clone()).await?;
        let switched = self
            .both
            .as_ref()
            .map(|b| b.ledger.read(|cp| cp.mig_enabled.clone()))
            .unwrap_or_default();
        let lists = resources::lists(&inv, &self.options, &switched)?;
        Ok((inv, lists))
    }

    /// Serves until `shutdown`; then stops every server and removes its socket.
    pub async fn run(self, shutdown: CancellationToken) -> Result<(), Error> {
        let (inv, lists) = self.read().await?;
        let res = lists.resources;
        let mut left_out = Vec::new();
        log_left_out(&mut left_out, lists.left_out);
        let cdi_opts = super::cdi::options(&self.settings.driver, &self.settings.driver_root)?;
        let ctx = Arc::new(Context::new(self.options.clone(), &cdi_opts));
        let wants_cdi = self.options.list_strategies.iter().any(|s| s.is_cdi());
        if wants_cdi {
            self.write_cdi(&cdi_opts, &inv).await?;
        }
        // GPUs left out (dynamic MIG) come back when DRA turns their MIG mode off: serve on.
        if res.is_empty() && left_out.is_empty() {
            tracing::warn!("device plugin: no devices to advertise; waiting");
            shutdown.cancelled().await;
            return Ok(());
        }
        let served_tx = watch::channel(served(&res)).0;
        let changes = self.both.as_ref().map(|b| b.ledger.changes());
        // Part of this task: should it end, the device plugin ends with it, naming it.
        let pods = self.pod_watch().map(|watch| {
            tokio::spawn(super::both::poll_pod_resources(
                watch,
                served_tx.subscribe(),
                shutdown.child_token(),
            ))
        });
        self.log_paths(&res);
        let slots: Vec<Slot> = self
            .unmapped(self.overlaid(res.clone()))
            .into_iter()
            .map(|r| {
                tracing::info!(resource = %r.name, devices = r.devices.len(), "device-plugin resource");
                Slot::new(&self.settings.dir, r)
            })
            .collect();
        let mut st = State {
            slots,
            kubelet_sock: self.settings.dir.join(KUBELET_SOCKET),
            all_registered: false,
            last_res: res,
            last_devices: cdi_identity(&inv),
            left_out,
            served_tx,
        };
        let mut wake = Wakers::new(&self, changes, pods).await;
        let result = loop {
            match wake.next(&shutdown).await {
                Wake::Shutdown => break Ok(()),
                Wake::Tick => {
                    if let Err(e) = self.on_tick(&mut st, &ctx, &shutdown).await {
                        break Err(e);
                    }
                }
                Wake::Ledger => self.on_ledger_change(&mut st),
                Wake::Classes => {
                    let names: Vec<String> = wake
                        .mapped
                        .as_ref()
                        .map(|m| m.borrow().keys().cloned().collect())
                        .unwrap_or_default();
                    self.on_classes_changed(&mut st, &names).await;
                }
                Wake::PodsEnded(reason) => {
                    break Err(Error::Stopped {
                        task: "pod-resources-poll",
                        reason,
                    });
                }
                Wake::Reread => self.reread(&mut st, &cdi_opts, wants_cdi).await,
            }
        };
        let slots = &mut st.slots;
        for slot in slots {
            stop_server(slot).await;
        }
        tracing::info!("device plugin stopped");
        result
    }

    /// [`Wake::Tick`]: serves again the sockets that are gone or replaced, registers what the
    /// current kubelet has not, and tells [`DevicePlugin::on_registered`] when that changes.
    async fn on_tick(
        &self,
        st: &mut State,
        ctx: &Arc<Context>,
        shutdown: &CancellationToken,
    ) -> Result<(), Error> {
        self.ensure_servers(&mut st.slots, ctx, shutdown)?;
        register_all(&mut st.slots, &st.kubelet_sock).await;
        let now = st.slots.iter().all(|s| s.registered.is_some());
        if now != st.all_registered {
            st.all_registered = now;
            if let Some(f) = &self.on_registered {
                f(now);
            }
        }
        Ok(())
    }

    /// [`Wake::Ledger`]: a claim prepared or unprepared: its devices' health changes.
    fn on_ledger_change(&self, st: &mut State) {
        update(
            &mut st.slots,
            &self.settings.dir,
            self.unmapped(self.overlaid(st.last_res.clone())),
        );
    }

    /// [`Wake::Classes`]: DeviceClasses changed: stop serving what DRA now serves (`mapped`, the
    /// resource names they map), serve again what it no longer does.
    async fn on_classes_changed(&self, st: &mut State, mapped: &[String]) {
        self.log_paths(&st.last_res);
        let now = self.unmapped(self.overlaid(st.last_res.clone()));
        let mut kept = Vec::with_capacity(st.slots.len());
        for mut slot in std::mem::take(&mut st.slots) {
            if !mapped.iter().any(|n| n == slot.name.as_str()) {
                kept.push(slot);
            } else {
                tracing::info!(resource = %slot.name, "a DeviceClass maps this resource; the device plugin stops serving it");
                stop_server(&mut slot).await;
            }
        }
        st.slots = kept;
        update(&mut st.slots, &self.settings.dir, now);
    }

    /// [`Wake::Reread`]: reads the inventory again; sends changed device lists, rewrites the CDI
    /// spec when the devices changed, and keeps the last lists when the read fails.
    async fn reread(&self, st: &mut State, cdi_opts: &crate::cdi::CdiOptions, wants_cdi: bool) {
        match self.read().await {
            Ok((inv, lists)) => {
                let res = lists.resources;
                log_left_out(&mut st.left_out, lists.left_out);
                let devices = cdi_identity(&inv);
                if wants_cdi
                    && devices != st.last_devices
                    && let Err(e) = self.write_cdi(cdi_opts, &inv).await
                {
                    tracing::warn!(error = %crate::report::chain(&e), "cannot rewrite the device-plugin CDI spec");
                }
                st.last_devices = devices;
                st.served_tx.send_replace(served(&res));
                st.last_res = res.clone();
                update(
                    &mut st.slots,
                    &self.settings.dir,
                    self.unmapped(self.overlaid(res)),
                );
            }
            Err(e) => {
                tracing::warn!(error = %crate::report::chain(&e), "device plugin: keeping the last device lists")
            }
        }
    }

    async fn write_cdi(&self, opts: &crate::cdi::CdiOptions, inv: &Inventory) -> Result<(), Error> {
        let (root, opts, inv, ids) = (
            self.settings.cdi_root.clone(),
            opts.clone(),
            inv.clone(),
            self.options.clone(),
        );
        let path = tokio::task::spawn_blocking(move || {
            super::cdi::write_with_modes(&root, &opts, &inv, &ids)
        })
        .await
        .map_err(|e| inventory::Error::Invalid(format!("CDI task failed: {e}")))??;
        tracing::info!(spec = %path.display(), "device-plugin CDI spec written");
        Ok(())
    }

    /// (Re)starts the server of every slot whose socket is missing, replaced, or whose server
    /// ended; such a slot must register again.
    fn ensure_servers(
        &self,
        slots: &mut [Slot],
        ctx: &Arc<Context>,
        shutdown: &CancellationToken,
    ) -> Result<(), Error> {
        for slot in slots {
            let healthy = match &slot.server {
                Some((_, handle, id)) => !handle.is_finished() && identity(&slot.path) == Some(*id),
                None => false,
            };
            if healthy {
                continue;
            }
            if let Some((token, _, _)) = slot.server.take() {
                tracing::info!(resource = %slot.name, socket = %slot.path.display(),
                    "device-plugin socket removed or server ended; serving it again");
                token.cancel();
            }
            let listener = socket::bind(&slot.path)?;
            let Some(id) = identity(&slot.path) else {
                // Removed between bind and stat: try again next tick.
                continue;
            };
            let token = shutdown.child_token();
            let service = Service {
                name: slot.name.clone(),
                devices: slot.devices.subscribe(),
                ctx: ctx.clone(),
                both: self.both.clone(),
                shutdown: token.clone(),
            };
            let (path, t) = (slot.path.clone(), token.clone());
            let handle = tokio::spawn(async move {
                let r = tonic::transport::Server::builder()
                    .add_service(DevicePluginServer::new(service))
                    .serve_with_incoming_shutdown(socket::incoming(listener), t.cancelled())
                    .await;
                if let Err(e) = r {
                    tracing::warn!(socket = %path.display(), error = %crate::report::chain(&e), "device-plugin server failed");
                }
            });
            tracing::info!(resource = %slot.name, socket = %slot.path.display(), "device-plugin server listening");
            slot.server = Some((token, handle, id));
            slot.registered = None;
        }
        Ok(())
    }
}

/// Registers every slot not yet registered with the current `kubelet.sock`.
async fn register_all(slots: &mut [Slot], kubelet_sock: &Path) {
    let Some(kubelet) = identity(kubelet_sock) else {
        for slot in slots.iter_mut() {
            slot.registered = None;
        }
        return;
    };
    let now = Instant::now();
    for slot in slots.iter_mut() {
        if slot.registered == Some(kubelet) || slot.server.is_none() {
            continue;
        }
        if let Some((at, when, _)) = slot.failed
            && at == kubelet
            && now < when
        {
            continue;
        }
        let endpoint = slot.name.socket_file();
        match register(kubelet_sock, wire::register_request(&slot.name, &endpoint)).await {
            Ok(()) => {
                tracing::info!(resource = %slot.name, endpoint, "registered with the kubelet");
                slot.registered = Some(kubelet);
                slot.failed = None;
            }
            Err(e) => {
                let delay = match slot.failed {
                    Some((_, _, d)) => d,
                    None => BACKOFF_START,
                };
                tracing::warn!(resource = %slot.name, error = %crate::report::chain(&e),
                    retry_in = ?delay, "device-plugin registration failed");
                slot.failed = Some((
                    kubelet,
                    Instant::now() + delay,
                    (delay * 2).min(BACKOFF_MAX),
                ));
            }
        }
    }
}

async fn register(kubelet_sock: &Path, req: pb::RegisterRequest) -> Result<(), RegisterError> {
    let call = async {
        let channel =
            socket::connect(kubelet_sock)
                .await
                .map_err(|source| RegisterError::Connect {
                    path: kubelet_sock.to_path_buf(),
                    source,
                })?;
        RegistrationClient::new(channel)
            .register(req)
            .await
            .map_err(RegisterError::Refused)?;
        Ok(())
    };
    tokio::time::timeout(REGISTER_TIMEOUT, call)
        .await
        .map_err(|_| RegisterError::Timeout {
            path: kubelet_sock.to_path_buf(),
        })?
}

/// Sends each resource's new device list when it changed. A resource that disappeared is sent
/// empty (the kubelet then lowers its capacity to 0) and stays registered, so it returns without
/// a new registration; a new one (a MIG reconfiguration) gets a slot, whose server the next tick
/// starts and registers.
fn update(slots: &mut Vec<Slot>, dir: &Path, res: Vec<Resource>) {
    for slot in slots.iter() {
        let new = res
            .iter()
            .find(|r| r.name == slot.name)
            .cloned()
            .unwrap_or_else(|| Resource {
                name: slot.name.clone(),
                devices: Vec::new(),
                fail_requests_greater_than_one: false,
            });
        slot.devices.send_if_modified(|cur| {
            if **cur == new {
                return false;
            }
            tracing::info!(resource = %slot.name, devices = new.devices.len(),
                unhealthy = new.devices.iter().filter(|d| !d.health.is_healthy()).count(),
                "device list changed");
            *cur = Arc::new(new);
            true
        });
    }
    for r in res {
        if !slots.iter().any(|s| s.name == r.name) {
            tracing::info!(resource = %r.name, devices = r.devices.len(), "new device-plugin resource");
            slots.push(Slot::new(dir, r));
        }
    }
}

async fn stop_server(slot: &mut Slot) {
    if let Some((token, handle, id)) = slot.server.take() {
        token.cancel();
        let _ = handle.await;
        // Only our own socket: a newer instance may have bound the path since.
        if identity(&slot.path) == Some(id) {
            let _ = std::fs::remove_file(&slot.path);
        }
    }
}

/// Logs each GPU that `now` leaves out of the lists and `before` did not (with why), and each
/// that is back, then remembers `now`: once per change, not once per read.
fn log_left_out(before: &mut Vec<resources::LeftOut>, now: Vec<resources::LeftOut>) {
    for l in now.iter().filter(|l| !before.contains(l)) {
        tracing::info!(gpu = l.index, uuid = %l.uuid, why = %l.why,
            "device plugin: leaving the GPU out of its lists");
    }
    for l in before
        .iter()
        .filter(|l| !now.iter().any(|n| n.uuid == l.uuid))
    {
        tracing::info!(gpu = l.index, uuid = %l.uuid, "device plugin: the GPU is back in its lists");
    }
    *before = now;
}

/// The device IDs of each resource (health aside), for reading PodResources.
fn served(res: &[Resource]) -> super::both::Served {
    res.iter()
        .map(|r| (r.name.clone(), Arc::new(r.clone())))
        .collect()
}
