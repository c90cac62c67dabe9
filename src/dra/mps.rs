//! MPS control daemons as the plugin asks for them: one per GPU or MIG device for its
//! consumable-capacity shares, one per claim shared with the `MPS` strategy. The plugin runs none of them: it writes
//! requests into the MPS root and the MPS host (`nvdra mps-host`, its own DaemonSet) runs the
//! daemons, so they outlive the plugin's pod ([`crate::mps`] has the directory protocol).
//!
//! **Per shared device** (a GPU, or a MIG device: `CUDA_VISIBLE_DEVICES` is its UUID): the
//! daemon belongs to the device: asked for with the first share ([`Mps::ensure_shares`]),
//! released after the last ([`Mps::stop_shares`], which the caller invokes once the ledger holds
//! no other share of it). A lock per device orders those two writes against each other, so a
//! share prepared while the last other share goes never finds its daemon released. Only the
//! writes run under it: waiting for the daemon to answer does not.
//!
//! **Per claim**: one daemon serves all of the claim's MPS devices (a container has one
//! `CUDA_MPS_PIPE_DIRECTORY`), asked for at prepare and released at unprepare.
//!
//! A daemon counts as running only when it answers `get_server_list` within 2 s
//! ([`crate::mps::control::alive`]). After a request, the caller waits until it answers (10 s by
//! default), or gets an error that says where to look. Releasing does not wait: the host quits
//! the daemon. All methods block (they run processes or write files): call them off the async
//! runtime.

use std::collections::HashMap;
use std::fmt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::ids::ClaimUid;
use crate::inventory::{DeviceUuid, GpuUuid, Inventory, MigUuid};
use crate::lock::lock;
use crate::mps::control;
use crate::mps::dir::{DaemonId, DaemonSpec, Layout};

pub use crate::mps::control::CONTROL;

/// How long a prepare waits for a requested daemon to answer.
pub const START_DEADLINE: Duration = Duration::from_secs(10);
/// How long after its release a daemon counts as quitting ([`Mps::quitting`]) while its
/// directory is there: the host quits it and kills it after its quit deadline (10 s), then
/// removes the directory. Past that the host is not doing it (not running, or stuck), and
/// waiting longer would only hold up whoever waits.
pub const QUIT_WAIT: Duration = Duration::from_secs(15);
/// An answer this recent stands for the daemon being up: a share prepared on a GPU whose daemon
/// just answered (an earlier prepare, or the watch task's probe) runs no process.
const ANSWER_FRESH: Duration = Duration::from_secs(2);

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Control(#[from] control::Error),
    #[error("cannot ask the MPS host for the daemon of {owner}: cannot write {path}")]
    Request {
        owner: Owner,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot ask the MPS host for the daemon of {owner}")]
    Write {
        owner: Owner,
        #[source]
        source: crate::durable::Error,
    },
    #[error(
        "the MPS control daemon of {owner} does not answer after {waited:?}: either the MPS host \
         (the nvdra-mps-host DaemonSet) is not running on this node, or the daemon fails to \
         start (see {log} on the node)"
    )]
    NotAnswering {
        owner: Owner,
        waited: Duration,
        log: PathBuf,
        #[source]
        last: Box<control::Error>,
    },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Whose daemon: a claim's, or a GPU's or MIG device's (its consumable-capacity shares).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Owner {
    Claim(ClaimUid),
    Gpu(GpuUuid),
    Mig(MigUuid),
}

impl Owner {
    /// The owner of the daemon of `device`'s shares.
    fn shares(device: &DeviceUuid) -> Self {
        match device {
            DeviceUuid::Gpu(g) => Owner::Gpu(g.clone()),
            DeviceUuid::Mig(m) => Owner::Mig(m.clone()),
        }
    }

    fn id(&self) -> DaemonId {
        match self {
            Owner::Claim(c) => DaemonId::claim(c),
            Owner::Gpu(g) => DaemonId::gpu(g),
            Owner::Mig(m) => DaemonId::mig(m),
        }
    }
}

impl fmt::Display for Owner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Owner::Claim(c) => write!(f, "claim {c}"),
            Owner::Gpu(g) => write!(f, "the shares of GPU {g}"),
            Owner::Mig(m) => write!(f, "the shares of MIG device {m}"),
        }
    }
}

pub struct Mps {
    layout: Layout,
    /// Where this process reads the driver's files: the control client is there.
    driver_root: PathBuf,
    /// Written into each request, so a host after a reboot knows which directories are stale.
    boot_id: String,
    start_deadline: Duration,
    /// One lock per GPU or MIG device with shares: its request and release exclude each other.
    gpu_locks: Mutex<HashMap<DeviceUuid, Arc<Mutex<()>>>>,
    /// When each daemon last answered.
    answered: Mutex<HashMap<DaemonId, Instant>>,
    /// When this process last wrote each daemon's request.
    requested: Mutex<HashMap<DaemonId, Instant>>,
    /// The daemons this process released, when, and the devices each served, until the host
    /// has quit them and removed their directories ([`Mps::quitting`]).
    released: Mutex<HashMap<DaemonId, (Instant, Vec<String>)>>,
    /// Whether each GPU's or MIG device's share daemon runs in multi-user mode (`-M`): Volta
    /// and later GPUs (a MIG device as its GPU), where one MPS server serves clients of every
    /// UID; learnt from the inventory.
    multi_user: Mutex<HashMap<DeviceUuid, bool>>,
}

impl Mps {
    /// `root`: the MPS root (`--mps-root`).
    pub fn new(root: PathBuf, driver_root: PathBuf, boot_id: String) -> Self {
        Self {
            layout: Layout::new(root),
            driver_root,
            boot_id,
            start_deadline: START_DEADLINE,
            gpu_locks: Mutex::new(HashMap::new()),
            answered: Mutex::new(HashMap::new()),
            requested: Mutex::new(HashMap::new()),
            released: Mutex::new(HashMap::new()),
            multi_user: Mutex::new(HashMap::new()),
        }
    }

    /// Learns from `inv`, and from what the MPS host found of its control daemon (read once
    /// here), which share daemons run in multi-user mode ([`Mps::multi_user`]). Without it pods
    /// of different UIDs on one GPU would wait on each other's server.
    pub fn know_gpus(&self, inv: &Inventory) {
        let host = self.layout.read_capabilities().multi_user;
        let mut m = lock(&self.multi_user);
        for g in &inv.gpus {
            let multi = Self::multi_user_with(g, host);
            m.insert(DeviceUuid::Gpu(g.uuid.clone()), multi);
            for d in &g.mig.devices {
                m.insert(DeviceUuid::Mig(d.uuid.clone()), multi);
            }
        }
    }

    /// Whether `gpu`'s share daemon serves clients of several users at once: a GPU that can
    /// (compute capability 7.0, Volta, and later: [`crate::inventory::Gpu::mps_multi_user`])
    /// with a control daemon that takes `-M` (as the MPS host found at its start; assumed where
    /// it could not tell). One rule for the daemon's `-M` and for refusing a share of another
    /// user. As [`Mps::know_gpus`] learnt it; asked of the host's record for a GPU it did not.
    pub fn multi_user(&self, gpu: &crate::inventory::Gpu) -> bool {
        let known = lock(&self.multi_user)
            .get(&DeviceUuid::Gpu(gpu.uuid.clone()))
            .copied();
        known.unwrap_or_else(|| {
            Self::multi_user_with(gpu, self.layout.read_capabilities().multi_user)
        })
    }

    fn multi_user_with(gpu: &crate::inventory::Gpu, host: Option<bool>) -> bool {
        gpu.mps_multi_user() && host != Some(false)
    }

    /// The claim's `CUDA_MPS_PIPE_DIRECTORY` on the host.
    pub fn pipe_dir(&self, claim: &ClaimUid) -> PathBuf {
        self.layout.pipe(&DaemonId::claim(claim))
    }

    /// The claim's daemon's `/dev/shm` on the host, which its containers mount there too.
    pub fn shm_dir(&self, claim: &ClaimUid) -> PathBuf {
        self.layout.shm(&DaemonId::claim(claim))
    }

    /// The `CUDA_MPS_PIPE_DIRECTORY` of a GPU's or MIG device's shares on the host.
    pub fn shares_pipe_dir(&self, device: &DeviceUuid) -> PathBuf {
        self.layout.pipe(&DaemonId::shares(device))
    }

    /// The `/dev/shm` of a GPU's or MIG device's share daemon and its clients on the host.
    pub fn shares_shm_dir(&self, device: &DeviceUuid) -> PathBuf {
        self.layout.shm(&DaemonId::shares(device))
    }

    /// Asks for the claim's daemon for `devices` (GPU or MIG UUIDs) and waits until it answers;
    /// returns the pipe directory. Asking again for a running daemon changes nothing.
    pub fn start(&self, claim: &ClaimUid, devices: &[DeviceUuid]) -> Result<PathBuf> {
        let owner = Owner::Claim(claim.clone());
        let devices = devices.iter().map(|d| d.as_str().to_string()).collect();
        self.request(&owner, devices)?;
        self.wait(&owner)?;
        Ok(self.pipe_dir(claim))
    }

    /// At start-up, for a prepared claim: asks for its daemon unless it is asked for (after a
    /// reboot, say), without waiting: the host starts it, and a plugin on a node whose host is
    /// down still starts serving.
    pub fn ensure(&self, claim: &ClaimUid, devices: &[DeviceUuid]) -> Result<()> {
        let devices = devices.iter().map(|d| d.as_str().to_string()).collect();
        self.request(&Owner::Claim(claim.clone()), devices)
    }

    /// Asks for the share daemon of `device` (a GPU or a MIG device) unless it is asked for,
    /// and waits until it answers; returns its pipe directory.
    pub fn ensure_shares(&self, device: &DeviceUuid) -> Result<PathBuf> {
        self.request_shares(device)?;
        self.wait(&Owner::shares(device))?;
        Ok(self.shares_pipe_dir(device))
    }

    /// Asks for the share daemon of `device` unless it is asked for, without waiting
    /// (start-up, as [`Mps::ensure`]). Its `CUDA_VISIBLE_DEVICES` is the device's UUID.
    pub fn request_shares(&self, device: &DeviceUuid) -> Result<()> {
        let l = self.gpu_lock(device);
        let _g = lock(&l);
        self.request(&Owner::shares(device), vec![device.as_str().to_string()])
    }

    /// Whether the share daemon of `device` is asked for (its request is written); says
    /// nothing of whether it runs: [`Mps::alive_shares`] does.
    pub fn shares_requested(&self, device: &DeviceUuid) -> bool {
        self.layout.spec(&DaemonId::shares(device)).is_file()
    }

    /// Whether the share daemon of `device` answers now (within 2 s). Takes no lock.
    pub fn alive_shares(&self, device: &DeviceUuid) -> bool {
        self.answers(&Owner::shares(device)).is_ok()
    }

    /// Whether the share daemon of `device` is still starting: this process asked for it less
    /// than the start deadline ago and it has not answered since. A prepare is then waiting for
    /// it, and a watch that does not hear it yet must not call it down.
    pub fn starting_shares(&self, device: &DeviceUuid) -> bool {
        let id = DaemonId::shares(device);
        let Some(asked) = lock(&self.requested).get(&id).copied() else {
            return false;
        };
        let answered_since = lock(&self.answered).get(&id).is_some_and(|t| *t >= asked);
        !answered_since && asked.elapsed() < self.start_deadline
    }

    /// Releases the share daemon of `device` if `still_shared` (asked under the device's lock,
    /// so no share can ask for it in between) says no share of it is left.
    pub fn stop_shares(
        &self,
        device: &DeviceUuid,
        still_shared: impl FnOnce() -> bool,
    ) -> Result<()> {
        let l = self.gpu_lock(device);
        let _g = lock(&l);
        if still_shared() {
            return Ok(());
        }
        self.release(&Owner::shares(device))
    }

    /// Releases the claim's daemon. A claim without one is a no-op.
    pub fn stop(&self, claim: &ClaimUid) -> Result<()> {
        self.release(&Owner::Claim(claim.clone()))
    }

    /// The daemons this process released that serve any of `devices` (GPU or MIG UUIDs) and
    /// that the host has not removed yet: their control daemon or MPS server may still hold the
    /// GPU (the host quits a released daemon asynchronously, killing it after its quit
    /// deadline, then removes its directory). A daemon asked for again since is not quitting,
    /// nor one released more than [`QUIT_WAIT`] ago. Blocking: a `stat` or two per released
    /// daemon.
    pub fn quitting(&self, devices: &[&str]) -> Vec<DaemonId> {
        let mut released = lock(&self.released);
        released.retain(|id, (at, _)| {
            at.elapsed() < QUIT_WAIT
                && self.layout.dir(id).is_dir()
                && !self.layout.spec(id).is_file()
        });
        let mut out: Vec<DaemonId> = released
            .iter()
            .filter(|(_, (_, served))| served.iter().any(|d| devices.contains(&d.as_str())))
            .map(|(id, _)| id.clone())
            .collect();
        out.sort();
        out
    }

    fn gpu_lock(&self, device: &DeviceUuid) -> Arc<Mutex<()>> {
        lock(&self.gpu_locks)
            .entry(device.clone())
            .or_default()
            .clone()
    }

    /// Writes the owner's `daemon.json` unless it already asks for this. A new directory
    /// appears whole: built under a hidden name, then renamed into place.
    fn request(&self, owner: &Owner, devices: Vec<String>) -> Result<()> {
        let id = owner.id();
        let shared = match owner {
            Owner::Gpu(g) => Some(DeviceUuid::Gpu(g.clone())),
            Owner::Mig(m) => Some(DeviceUuid::Mig(m.clone())),
            Owner::Claim(_) => None,
        };
        let multi_user =
            shared.is_some_and(|d| lock(&self.multi_user).get(&d).copied().unwrap_or(false));
        let spec = DaemonSpec {
            devices,
            multi_user,
            owner: owner.to_string(),
            boot_id: Some(self.boot_id.clone()),
        };
        if matches!(self.layout.read_spec(&id), Ok(Some(s)) if s == spec) {
            return Ok(());
        }
        let err = |path: &std::path::Path| {
            let path = path.to_path_buf();
            move |source| Error::Request {
                owner: owner.clone(),
                path,
                source,
            }
        };
        // Serialising a struct of strings and a bool cannot fail.
        let bytes = serde_json::to_vec(&spec).unwrap_or_default();
        let dir = self.layout.dir(&id);
        // The host may be removing a released directory of this daemon right now (it renames it
        // away first): a write into it then finds it gone, and the next try builds a new one.
        let mut tries = 0;
        loop {
            tries += 1;
            if !dir.is_dir() {
                let root = self.layout.root();
                std::fs::create_dir_all(root).map_err(err(root))?;
                let staging = root.join(format!(".new-{id}-{}", std::process::id()));
                let _ = std::fs::remove_dir_all(&staging);
                std::fs::create_dir(&staging).map_err(err(&staging))?;
                Layout::make_subdirs(&staging).map_err(err(&staging))?;
                let spec_path = staging.join(crate::mps::dir::SPEC);
                crate::durable::write(&spec_path, &bytes).map_err(write_err(owner))?;
                match std::fs::rename(&staging, &dir) {
                    Ok(()) => break,
                    // Made meanwhile (a release not yet removed): write the request into it.
                    Err(_) if dir.is_dir() => {
                        let _ = std::fs::remove_dir_all(&staging);
                    }
                    Err(e) => {
                        let _ = std::fs::remove_dir_all(&staging);
                        return Err(err(&dir)(e));
                    }
                }
            }
            match crate::durable::write(&self.layout.spec(&id), &bytes) {
                Ok(()) => break,
                Err(e)
                    if tries < 3
                        && !dir.is_dir()
                        && e.source.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(write_err(owner)(e)),
            }
        }
        tracing::info!(%owner, daemon = %id, "MPS daemon requested");
        lock(&self.requested).insert(id, Instant::now());
        Ok(())
    }

    /// Removes the owner's `daemon.json`: the host quits the daemon and removes its directory.
    fn release(&self, owner: &Owner) -> Result<()> {
        let id = owner.id();
        lock(&self.answered).remove(&id);
        lock(&self.requested).remove(&id);
        let path = self.layout.spec(&id);
        let served = match self.layout.read_spec(&id) {
            Ok(Some(spec)) => spec.devices,
            _ => Vec::new(),
        };
        match crate::durable::remove(&path) {
            Ok(true) => {
                lock(&self.released).insert(id.clone(), (Instant::now(), served));
                tracing::info!(%owner, daemon = %id, "MPS daemon released");
                Ok(())
            }
            Ok(false) => Ok(()),
            Err(e) => Err(write_err(owner)(e)),
        }
    }

    /// Whether the owner's daemon answers now; remembers when it did.
    fn answers(&self, owner: &Owner) -> Result<(), control::Error> {
        let id = owner.id();
        let control = control::find(&self.driver_root)?;
        let r = control::alive(&control, &self.layout.pipe(&id));
        if r.is_ok() {
            lock(&self.answered).insert(id, Instant::now());
        }
        r
    }

    /// Waits until the owner's daemon answers, up to the start deadline.
    fn wait(&self, owner: &Owner) -> Result<()> {
        let id = owner.id();
        if lock(&self.answered)
            .get(&id)
            .is_some_and(|t| t.elapsed() < ANSWER_FRESH)
        {
            return Ok(());
        }
        let start = Instant::now();
        loop {
            let last = match self.answers(owner) {
                Ok(()) => return Ok(()),
                Err(e @ control::Error::NotFound { .. }) => return Err(e.into()),
                Err(e) => e,
            };
            if start.elapsed() >= self.start_deadline {
                return Err(Error::NotAnswering {
                    owner: owner.clone(),
                    waited: start.elapsed(),
                    log: self.layout.log(&id),
                    last: Box::new(last),
                });
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

fn write_err(owner: &Owner) -> impl FnOnce(crate::durable::Error) -> Error + '_ {
    move |source| Error::Write {
        owner: owner.clone(),
        source,
    }
}

#[cfg(test)]
pub(crate) mod tests;
