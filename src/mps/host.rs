//! `nvdra mps-host`: runs one `nvidia-cuda-mps-control -f` per `<root>/<id>/daemon.json`
//! ([`super::dir`]) and keeps it running while it is wanted.
//!
//! One loop on one thread owns every daemon: every [`SCAN`] it reads the root and moves each
//! daemon towards what the directory says:
//!
//! - wanted and not running: start it (in its own mount namespace, `/dev/shm` = `<id>/shm`);
//! - running and exited by itself: start it again after a backoff (0.5 s doubling to 30 s; reset
//!   once it ran a minute), logging how it ended;
//! - running and not answering: every `probe_interval` it is asked `get_server_list` (off the
//!   loop's thread, with a deadline); after [`PROBE_MISSES`] unanswered questions in a row it is
//!   killed (SIGKILL: a daemon that does not answer may not obey `quit` either) and started
//!   again as one that exited. A process that is alive but stuck, stopped, or deadlocked is as
//!   useless to its shares as a dead one, and any tenant may cause it;
//! - answering with no MPS server while its clients had one before (a restarted daemon): a
//!   server is started at once for the user the last one served, so that a GPU in
//!   `EXCLUSIVE_PROCESS` refuses a CUDA process outside MPS from then on, not only from the next
//!   client on;
//! - released (`daemon.json` gone): `quit` with a deadline, SIGKILL after it, then the directory
//!   is removed — all off the loop's thread, so one daemon slow to quit holds up no other.
//!
//! Before each start the daemon's pipe and shm directories are emptied: a killed daemon leaves
//! its sockets, pid files and shared-memory segments, and its clients died with it.
//!
//! What the host reads and writes on `/run` is bounded: a request (`daemon.json`) is read only
//! when it is a regular file of at most [`super::dir::SPEC_LIMIT`] bytes, and one that cannot be
//! read is warned about once, and again only when the file or the reason changes (not at every
//! scan). Every [`LOG_CHECK`] the files of each daemon's log directory (the daemon's own
//! `control.log` and `server.log`, which nvdra cannot tell it to rotate, and [`OUT_LOG`]) are
//! cut back once over [`LOG_LIMIT`]: their newest [`LOG_KEEP`] bytes go to `<name>.1` and the
//! file is truncated in place (logrotate's `copytruncate`: the daemon keeps its file open, so a
//! rename would not reach it).
//!
//! At start-up the root's `boot_id` tells whether the node rebooted since the host last ran:
//! if so, every directory whose request was written in another boot is removed (its daemon died
//! with that boot, and no claim of it is prepared any more). On SIGTERM the host quits every
//! daemon and leaves the requests in place: the next host starts them again. The daemons are
//! the host's children and die with it (PR_SET_PDEATHSIG), as they do with its container.

use std::collections::BTreeMap;
use std::fs::OpenOptions;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::control;
use super::dir::{DaemonId, DaemonSpec, Layout};

/// How often the root is read.
pub const SCAN: Duration = Duration::from_millis(200);
const BACKOFF_FIRST: Duration = Duration::from_millis(500);
const BACKOFF_MAX: Duration = Duration::from_secs(30);
/// A daemon that ran this long before it exited starts again without waiting.
const HEALTHY_RUN: Duration = Duration::from_secs(60);
/// The file in a daemon's log directory that gets its stdout and stderr and the host's notes.
pub const OUT_LOG: &str = "control.out";
/// Unanswered probes in a row after which a running daemon is killed and started again.
pub const PROBE_MISSES: u32 = 3;
/// How often the daemons' log files are measured.
pub const LOG_CHECK: Duration = Duration::from_secs(10);
/// The size past which a file of a daemon's log directory is cut back.
pub const LOG_LIMIT: u64 = 1024 * 1024;
/// What is kept of a file cut back, in `<name>.1`: its newest bytes.
pub const LOG_KEEP: u64 = 256 * 1024;

#[derive(Clone, Debug)]
pub struct Options {
    /// `--mps-root`.
    pub root: PathBuf,
    /// Where this process reads the driver's files (the control binary is under it).
    pub driver_root: PathBuf,
    pub boot_id_file: PathBuf,
    pub quit_deadline: Duration,
    /// How often a running daemon is asked whether it answers.
    pub probe_interval: Duration,
    /// Give each daemon its own `/dev/shm` (needs CAP_SYS_ADMIN); off only for demos and tests
    /// without the privilege.
    pub private_shm: bool,
    /// With `private_shm`: the size of the tmpfs each daemon gets as `<id>/shm` (its and its
    /// clients' `/dev/shm`), in bytes.
    pub shm_size: u64,
}

/// The default size of a daemon's `/dev/shm` tmpfs.
pub const DEFAULT_SHM_SIZE: &str = "1Gi";

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot prepare the MPS root {path}")]
    Root {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot read this boot's id")]
    BootId(#[source] crate::ledger::Error),
    #[error("cannot record the boot id")]
    WriteBootId(#[source] crate::durable::Error),
    #[error("cannot install signal handlers")]
    Signals(#[source] std::io::Error),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Runs the host until SIGTERM or SIGINT, on a runtime of one thread: the daemons are spawned
/// from it, and die when it ends.
pub fn main(opts: Options) -> Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(Error::Signals)?;
    runtime.block_on(async {
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = signal(SignalKind::terminate()).map_err(Error::Signals)?;
        let mut int = signal(SignalKind::interrupt()).map_err(Error::Signals)?;
        let stop = CancellationToken::new();
        let s = stop.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
            tracing::info!("signal received; quitting the MPS daemons");
            s.cancel();
        });
        Host::start(opts)?.run(stop).await;
        Ok(())
    })
}

enum State {
    Running {
        child: Child,
        since: Instant,
        probe: Probe,
    },
    /// Not running; (re)started at `until`.
    Waiting { until: Instant },
    /// Quitting (and, for a released daemon, its directory being removed).
    Stopping(JoinHandle<()>),
}

struct Daemon {
    state: State,
    /// Exits in a row without a healthy run, for the backoff.
    failures: u32,
    /// The user of the MPS server it last had, read from `/proc` (the host runs in the host PID
    /// namespace): a restarted daemon gets a server for that user at once.
    server_uid: Option<u32>,
}

/// The questions asked of one running daemon.
struct Probe {
    /// The question being asked now: the servers' pids, or why it was not answered.
    asking: Option<JoinHandle<Result<Vec<u32>, String>>>,
    /// When the last question was asked (or the daemon started).
    last: Instant,
    /// Unanswered questions in a row.
    misses: u32,
    /// A server was asked for since this start (asked once).
    server_asked: bool,
}

impl Probe {
    fn new(now: Instant) -> Self {
        Self {
            asking: None,
            last: now,
            misses: 0,
            server_asked: false,
        }
    }
}

pub struct Host {
    opts: Options,
    layout: Layout,
    boot_id: String,
    /// Whether the control daemon takes `-M`, as found at start ([`multi_user_support`]).
    multi_user: Option<bool>,
    daemons: BTreeMap<DaemonId, Daemon>,
    /// The requests that could not be read, as last warned about.
    unreadable: BTreeMap<DaemonId, Unreadable>,
    /// When the log directories were last measured.
    logs_checked: Option<Instant>,
}

/// A request that could not be read, as warned about: warned again only when this changes.
#[derive(Debug, PartialEq, Eq)]
struct Unreadable {
    error: String,
    /// The file's inode, size and modification time, where it has them.
    file: Option<(u64, u64, std::time::SystemTime)>,
}

impl Unreadable {
    fn of(path: &Path, error: String) -> Self {
        use std::os::unix::fs::MetadataExt;
        let file = std::fs::symlink_metadata(path)
            .ok()
            .and_then(|m| Some((m.ino(), m.len(), m.modified().ok()?)));
        Self { error, file }
    }
}

impl Host {
    /// Prepares the root: created if missing, stale directories of another boot removed, this
    /// boot recorded.
    pub fn start(opts: Options) -> Result<Host> {
        let layout = Layout::new(&opts.root);
        let root_err = |source| Error::Root {
            path: opts.root.clone(),
            source,
        };
        std::fs::create_dir_all(&opts.root).map_err(root_err)?;
        let boot_id = crate::ledger::read_boot_id(&opts.boot_id_file).map_err(Error::BootId)?;
        let recorded = std::fs::read_to_string(layout.boot_id())
            .ok()
            .map(|s| s.trim().to_string());
        if let Some(old) = recorded.filter(|old| *old != boot_id) {
            for id in layout.daemons().map_err(root_err)? {
                let written = layout.read_spec(&id).ok().flatten().and_then(|s| s.boot_id);
                if written.as_deref() == Some(boot_id.as_str()) {
                    continue;
                }
                let dir = layout.dir(&id);
                match std::fs::remove_dir_all(&dir) {
                    Ok(()) => {
                        tracing::info!(daemon = %id, boot.old = %old, "removed the directory of a daemon of another boot")
                    }
                    Err(e) => {
                        tracing::warn!(daemon = %id, error = %e, "cannot remove the directory of a daemon of another boot")
                    }
                }
            }
        }
        remove_leftovers(&opts.root);
        let multi_user = multi_user_support(&opts.driver_root);
        let caps = super::dir::HostCapabilities { multi_user };
        crate::durable::write(
            &layout.capabilities(),
            &serde_json::to_vec(&caps).unwrap_or_default(),
        )
        .map_err(Error::WriteBootId)?;
        crate::durable::write(&layout.boot_id(), format!("{boot_id}\n").as_bytes())
            .map_err(Error::WriteBootId)?;
        tracing::info!(root = %opts.root.display(), boot.id = %boot_id, multi_user = ?multi_user, "MPS host started");
        Ok(Host {
            opts,
            layout,
            boot_id,
            multi_user,
            daemons: BTreeMap::new(),
            unreadable: BTreeMap::new(),
            logs_checked: None,
        })
    }

    /// Keeps the daemons as the root asks until `stop`; then quits them all.
    pub async fn run(mut self, stop: CancellationToken) {
        let mut tick = tokio::time::interval(SCAN);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                biased;
                _ = stop.cancelled() => break,
                _ = tick.tick() => self.reconcile(),
            }
        }
        let mut stopping = Vec::new();
        for (id, d) in std::mem::take(&mut self.daemons) {
            match d.state {
                State::Running { child, .. } => {
                    let (opts, pipe) = (self.opts.clone(), self.layout.pipe(&id));
                    stopping.push(tokio::task::spawn_blocking(move || {
                        quit(&opts, &id, &pipe, child);
                    }));
                }
                State::Stopping(h) => stopping.push(h),
                State::Waiting { .. } => {}
            }
        }
        for h in stopping {
            let _ = h.await;
        }
        tracing::info!(boot.id = %self.boot_id, "MPS host stopped");
    }

    /// One pass: each daemon one step towards what the root asks.
    fn reconcile(&mut self) {
        let now = Instant::now();
        let ids = match self.layout.daemons() {
            Ok(ids) => ids,
            Err(e) => {
                tracing::warn!(root = %self.opts.root.display(), error = %e, "cannot read the MPS root");
                return;
            }
        };
        self.daemons.retain(|id, d| match &d.state {
            State::Stopping(h) if h.is_finished() => {
                tracing::debug!(daemon = %id, "stopped");
                false
            }
            _ => true,
        });
        if self
            .logs_checked
            .is_none_or(|t| now.duration_since(t) >= LOG_CHECK)
        {
            self.logs_checked = Some(now);
            for id in &ids {
                trim_logs(&self.layout.log(id), LOG_LIMIT, LOG_KEEP);
            }
        }
        self.unreadable.retain(|id, _| ids.contains(id));
        let mut seen = Vec::new();
        for id in ids {
            let spec = match self.layout.read_spec(&id) {
                Ok(spec) => spec,
                Err(e) => {
                    let error = crate::report::chain(&e).to_string();
                    let now = Unreadable::of(&self.layout.spec(&id), error);
                    if self.unreadable.get(&id) != Some(&now) {
                        tracing::warn!(daemon = %id, error = %now.error, "cannot read the daemon's request; leaving it as it is (warned again when the file changes)");
                        self.unreadable.insert(id.clone(), now);
                    }
                    seen.push(id);
                    continue;
                }
            };
            if self.unreadable.remove(&id).is_some() {
                tracing::info!(daemon = %id, "the daemon's request is readable again");
            }
            seen.push(id.clone());
            match spec {
                Some(spec) => self.want(id, &spec, now),
                None => self.release(id),
            }
        }
        // A directory removed by someone else: its daemon has nowhere to serve.
        for (id, d) in self.daemons.iter_mut() {
            if seen.contains(id) {
                continue;
            }
            if let State::Running { .. } | State::Waiting { .. } = d.state {
                tracing::warn!(daemon = %id, "the daemon's directory is gone; stopping it");
                let child = take_running(&mut d.state);
                d.state = stopping(&self.opts, &self.layout, id, child, false);
            }
        }
    }

    fn want(&mut self, id: DaemonId, spec: &DaemonSpec, now: Instant) {
        let d = self.daemons.entry(id.clone()).or_insert(Daemon {
            state: State::Waiting { until: now },
            failures: 0,
            server_uid: None,
        });
        match &mut d.state {
            State::Running {
                child,
                since,
                probe,
            } => {
                let status = match child.try_wait() {
                    Ok(Some(status)) => status,
                    Ok(None) => {
                        let (opts, layout) = (&self.opts, &self.layout);
                        if !probe_running(opts, layout, &id, probe, &mut d.server_uid, now) {
                            tracing::error!(daemon = %id, owner = %spec.owner, pid = child.id(), misses = PROBE_MISSES, "MPS control daemon runs but does not answer; killing it and starting a new one");
                            note(
                                &layout.log(&id),
                                &format!(
                                    "daemon {} did not answer {PROBE_MISSES} probes in a row; killed",
                                    child.id()
                                ),
                            );
                            let _ = child.kill();
                            let _ = child.wait();
                            d.failures += 1;
                            let delay = backoff(d.failures);
                            d.state = State::Waiting { until: now + delay };
                        }
                        return;
                    }
                    Err(e) => {
                        tracing::warn!(daemon = %id, error = %e, "cannot check the daemon");
                        return;
                    }
                };
                if since.elapsed() >= HEALTHY_RUN {
                    d.failures = 0;
                }
                d.failures += 1;
                let delay = backoff(d.failures);
                tracing::warn!(daemon = %id, owner = %spec.owner, %status, retry_in = ?delay, "MPS control daemon exited while wanted; restarting it");
                note(
                    &self.layout.log(&id),
                    &format!("daemon exited ({status}); restarting in {delay:?}"),
                );
                d.state = State::Waiting { until: now + delay };
            }
            State::Waiting { until } if *until <= now => {
                match spawn(&self.opts, &self.layout, &id, spec, self.multi_user) {
                    Ok(child) => {
                        tracing::info!(daemon = %id, owner = %spec.owner, devices = %spec.devices.join(","), multi_user = spec.multi_user, pid = child.id(), "MPS control daemon started");
                        d.state = State::Running {
                            child,
                            since: now,
                            probe: Probe::new(now),
                        };
                    }
                    Err(e) => {
                        d.failures += 1;
                        let delay = backoff(d.failures);
                        let msg = crate::report::chain(&e).to_string();
                        tracing::error!(daemon = %id, owner = %spec.owner, error = %msg, retry_in = ?delay, "cannot start the MPS control daemon");
                        note(&self.layout.log(&id), &format!("cannot start: {msg}"));
                        d.state = State::Waiting { until: now + delay };
                    }
                }
            }
            State::Waiting { .. } | State::Stopping(_) => {}
        }
    }

    fn release(&mut self, id: DaemonId) {
        let d = self.daemons.entry(id.clone()).or_insert(Daemon {
            state: State::Waiting {
                until: Instant::now(),
            },
            failures: 0,
            server_uid: None,
        });
        if let State::Stopping(_) = d.state {
            return;
        }
        let child = take_running(&mut d.state);
        if child.is_some() {
            tracing::info!(daemon = %id, "released; quitting its MPS control daemon");
        }
        d.state = stopping(&self.opts, &self.layout, &id, child, true);
    }
}

/// One step of the questions to a running daemon: takes the answer of the question asked
/// before, if it came, and asks the next one when it is time. `false` once the daemon missed
/// [`PROBE_MISSES`] in a row.
fn probe_running(
    opts: &Options,
    layout: &Layout,
    id: &DaemonId,
    probe: &mut Probe,
    server_uid: &mut Option<u32>,
    now: Instant,
) -> bool {
    use futures::FutureExt;
    if let Some(asking) = probe.asking.take_if(|h| h.is_finished()) {
        let answer = match asking.now_or_never() {
            Some(Ok(answer)) => answer,
            Some(Err(e)) => Err(format!("the probe failed: {e}")),
            None => Err("the probe did not finish".into()),
        };
        match answer {
            Ok(servers) => {
                if probe.misses > 0 {
                    tracing::info!(daemon = %id, missed = probe.misses, "MPS control daemon answers again");
                }
                probe.misses = 0;
                match servers.first().and_then(|pid| Some((*pid, uid_of(*pid)?))) {
                    Some((pid, uid)) => {
                        if *server_uid != Some(uid) {
                            note(
                                &layout.log(id),
                                &format!("MPS server {pid} serves uid {uid}"),
                            );
                        }
                        *server_uid = Some(uid);
                    }
                    None if servers.is_empty() && !probe.server_asked => {
                        if let Some(uid) = *server_uid {
                            probe.server_asked = true;
                            start_server(opts, layout, id, uid);
                        }
                    }
                    None => {}
                }
            }
            Err(e) => {
                probe.misses += 1;
                tracing::warn!(daemon = %id, error = %e, misses = probe.misses, "MPS control daemon did not answer");
                if probe.misses >= PROBE_MISSES {
                    return false;
                }
            }
        }
    }
    if probe.asking.is_none() && now.duration_since(probe.last) >= opts.probe_interval {
        probe.last = now;
        let (driver_root, pipe) = (opts.driver_root.clone(), layout.pipe(id));
        probe.asking = Some(tokio::task::spawn_blocking(move || {
            let control = control::find(&driver_root).map_err(|e| e.to_string())?;
            let list = control::ask(&control, &pipe, "get_server_list", control::ALIVE_DEADLINE)
                .map_err(|e| crate::report::chain(&e).to_string())?;
            Ok(control::server_pids(&list))
        }));
    }
    true
}

/// Asks the daemon for a server for `uid`, off the loop's thread; the outcome is logged.
fn start_server(opts: &Options, layout: &Layout, id: &DaemonId, uid: u32) {
    let (driver_root, pipe, id) = (opts.driver_root.clone(), layout.pipe(id), id.clone());
    tokio::task::spawn_blocking(move || {
        let asked = control::find(&driver_root).and_then(|c| {
            control::ask(
                &c,
                &pipe,
                &format!("start_server -uid {uid}"),
                control::ALIVE_DEADLINE,
            )
        });
        match asked {
            Ok(answer) => {
                tracing::info!(daemon = %id, uid, answer = %answer.trim(), "MPS server started again for the user it served")
            }
            Err(e) => {
                tracing::warn!(daemon = %id, uid, error = %crate::report::chain(&e), "cannot start an MPS server again for the user it served")
            }
        }
    });
}

/// The real user of process `pid`, from `/proc/<pid>/status`.
fn uid_of(pid: u32) -> Option<u32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Removes everything in `dir` (not `dir` itself): what a killed daemon and its clients left.
fn clear(dir: &Path) -> std::io::Result<()> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    for e in entries {
        let e = e?;
        let path = e.path();
        let removed = if e.file_type()?.is_dir() {
            std::fs::remove_dir_all(&path)
        } else {
            std::fs::remove_file(&path)
        };
        match removed {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
    }
    Ok(())
}

/// Whether the driver's control daemon takes `-M`, from its usage text (`-h`): `None` when it
/// cannot be told (no binary, no usage text within the deadline). NVIDIA documents `-M` for
/// multi-user MPS servers, but it is not among the flags of every driver's MPS.
fn multi_user_support(driver_root: &Path) -> Option<bool> {
    let control = control::find(driver_root).ok()?;
    let mut cmd = Command::new(&control);
    cmd.arg("-h");
    let out = crate::child::output_fed(&mut cmd, "-h", None, control::ALIVE_DEADLINE).ok()?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if text.trim().is_empty() {
        return None;
    }
    let takes_m = text
        .split(|c: char| c.is_whitespace() || matches!(c, '[' | ']' | '|' | ','))
        .any(|w| w == "-M");
    if !takes_m {
        tracing::warn!(control = %control.display(), "this driver's nvidia-cuda-mps-control does not list -M: every daemon runs single-user, and a share whose pod runs as another user than the GPU's others is refused");
    }
    Some(takes_m)
}

/// Quits `child` (if any) off the loop's thread, then removes the directory when `remove`.
fn stopping(
    opts: &Options,
    layout: &Layout,
    id: &DaemonId,
    child: Option<Child>,
    remove: bool,
) -> State {
    let (opts, layout, id) = (opts.clone(), layout.clone(), id.clone());
    State::Stopping(tokio::task::spawn_blocking(move || {
        if let Some(child) = child {
            quit(&opts, &id, &layout.pipe(&id), child);
        }
        if remove {
            remove_released(&layout, &id);
        }
    }))
}

fn take_running(state: &mut State) -> Option<Child> {
    match std::mem::replace(
        state,
        State::Waiting {
            until: Instant::now(),
        },
    ) {
        State::Running { child, .. } => Some(child),
        other => {
            *state = other;
            None
        }
    }
}

fn backoff(failures: u32) -> Duration {
    BACKOFF_FIRST
        .saturating_mul(1 << failures.saturating_sub(1).min(16))
        .min(BACKOFF_MAX)
}

#[derive(Debug, thiserror::Error)]
enum SpawnError {
    #[error(transparent)]
    Control(#[from] control::Error),
    #[error("cannot prepare {path}")]
    Dir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "cannot give the daemon a private /dev/shm ({shm}): the MPS host needs CAP_SYS_ADMIN \
         to unshare a mount namespace and bind-mount it (its DaemonSet grants it)"
    )]
    NotPermitted {
        shm: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot run {}", control.display())]
    Spawn {
        control: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

fn spawn(
    opts: &Options,
    layout: &Layout,
    id: &DaemonId,
    spec: &DaemonSpec,
    multi_user: Option<bool>,
) -> Result<Child, SpawnError> {
    let control = control::find(&opts.driver_root)?;
    let dir = layout.dir(id);
    let dir_err = |source| SpawnError::Dir {
        path: dir.clone(),
        source,
    };
    Layout::make_subdirs(&dir).map_err(dir_err)?;
    // The daemon's and its clients' /dev/shm: a tmpfs of its own, sized, so that no tenant can
    // fill the node's /run, mounted where the host's mount namespace sees it (the MPS root is
    // mounted with Bidirectional propagation) for the share containers' bind mounts.
    let shm = layout.shm(id);
    if opts.private_shm {
        super::ns::ensure_tmpfs(&shm, opts.shm_size).map_err(|source| {
            if source.raw_os_error() == Some(libc::EPERM) {
                SpawnError::NotPermitted {
                    shm: shm.clone(),
                    source,
                }
            } else {
                SpawnError::Dir {
                    path: shm.clone(),
                    source,
                }
            }
        })?;
    }
    // No daemon of this directory runs (this host starts them, one at a time): whatever is in its
    // pipe and shm directories is a dead daemon's.
    for stale in [layout.pipe(id), layout.shm(id)] {
        clear(&stale).map_err(|source| SpawnError::Dir {
            path: stale.clone(),
            source,
        })?;
    }
    let out_path = layout.log(id).join(OUT_LOG);
    let out = OpenOptions::new()
        .create(true)
        .append(true)
        .open(&out_path)
        .map_err(|source| SpawnError::Dir {
            path: out_path.clone(),
            source,
        })?;
    let err = out.try_clone().map_err(|source| SpawnError::Dir {
        path: out_path,
        source,
    })?;
    let mut cmd = Command::new(&control);
    cmd.arg("-f");
    // A daemon that does not know `-M` would exit at every start and fail every share: it runs
    // single-user instead, and the plugin, which reads the same finding, refuses a share whose
    // pod runs as another user than the GPU's others.
    if spec.multi_user && multi_user != Some(false) {
        cmd.arg("-M");
    }
    cmd.env("CUDA_VISIBLE_DEVICES", spec.devices.join(","))
        .env("CUDA_MPS_PIPE_DIRECTORY", layout.pipe(id))
        .env("CUDA_MPS_LOG_DIRECTORY", layout.log(id))
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err);
    if opts.private_shm {
        super::ns::private_shm(&mut cmd, &shm).map_err(|source| SpawnError::Dir {
            path: shm.clone(),
            source,
        })?;
    } else {
        super::ns::die_with_parent(&mut cmd);
    }
    cmd.spawn().map_err(|source| {
        if opts.private_shm && source.raw_os_error() == Some(libc::EPERM) {
            SpawnError::NotPermitted { shm, source }
        } else {
            SpawnError::Spawn { control, source }
        }
    })
}

/// `quit` through the control client, then SIGKILL when the daemon has not exited by the
/// deadline (a daemon whose clients hang on may never quit).
fn quit(opts: &Options, id: &DaemonId, pipe: &Path, mut child: Child) {
    let start = Instant::now();
    let asked = control::find(&opts.driver_root)
        .and_then(|c| control::ask(&c, pipe, "quit", opts.quit_deadline));
    if let Err(e) = asked {
        tracing::warn!(daemon = %id, error = %crate::report::chain(&e), "quit was not answered");
    }
    loop {
        match child.try_wait() {
            Ok(Some(status)) => {
                tracing::info!(daemon = %id, %status, "MPS control daemon quit");
                return;
            }
            Ok(None) if start.elapsed() < opts.quit_deadline => {
                std::thread::sleep(Duration::from_millis(20));
            }
            _ => break,
        }
    }
    tracing::warn!(daemon = %id, pid = child.id(), deadline = ?opts.quit_deadline, "MPS control daemon did not quit in time; killing it");
    let _ = child.kill();
    let _ = child.wait();
}

/// Removes a released daemon's directory, unless it was asked for again meanwhile. It is renamed
/// away first, so a request written from now on makes a new directory instead of landing in one
/// being removed; a request that landed before the rename is put back.
fn remove_released(layout: &Layout, id: &DaemonId) {
    let dir = layout.dir(id);
    if layout.spec(id).exists() {
        return;
    }
    // Its clients are gone with the daemon: the tmpfs goes (lazily, should one still hold it).
    if let Err(e) = super::ns::unmount(&layout.shm(id)) {
        tracing::warn!(daemon = %id, error = %e, "cannot unmount the released daemon's /dev/shm");
    }
    let gone = layout
        .root()
        .join(format!(".gone-{id}-{}", std::process::id()));
    match std::fs::rename(&dir, &gone) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return,
        Err(e) => {
            tracing::warn!(daemon = %id, error = %e, "cannot remove the released daemon's directory");
            return;
        }
    }
    if gone.join(super::dir::SPEC).exists() && std::fs::rename(&gone, &dir).is_ok() {
        return;
    }
    match std::fs::remove_dir_all(&gone) {
        Ok(()) => tracing::info!(daemon = %id, "released daemon's directory removed"),
        Err(e) => {
            tracing::warn!(daemon = %id, error = %e, "cannot remove the released daemon's directory")
        }
    }
}

/// Directories a host that died while removing one left behind (`.gone-*`), and requests a
/// plugin that died while building one left behind (`.new-*`, a minute old: a younger one may be
/// a request being built now).
fn remove_leftovers(root: &Path) {
    let Ok(entries) = std::fs::read_dir(root) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let stale_request = name.starts_with(".new-")
            && e.metadata()
                .and_then(|m| m.modified())
                .is_ok_and(|t| t.elapsed().is_ok_and(|age| age > Duration::from_secs(60)));
        if name.starts_with(".gone-") || stale_request {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// Cuts back each file of the log directory `log` over `limit` bytes: its newest `keep` bytes
/// replace `<name>.1`, and it is truncated in place, so that its writer, which keeps it open,
/// writes on from its start (with `O_APPEND`, as the host's [`OUT_LOG`]) or past a hole that
/// takes no space. Returns the files cut back. The `.1` files themselves are left alone.
fn trim_logs(log: &Path, limit: u64, keep: u64) -> Vec<PathBuf> {
    let mut cut = Vec::new();
    let Ok(entries) = std::fs::read_dir(log) else {
        return cut;
    };
    for e in entries.flatten() {
        let path = e.path();
        let is_log =
            e.file_type().is_ok_and(|t| t.is_file()) && path.extension().is_none_or(|x| x != "1");
        let size = e.metadata().map(|m| m.len()).unwrap_or(0);
        if !is_log || size <= limit {
            continue;
        }
        match trim_log(&path, size, keep) {
            Ok(()) => {
                tracing::info!(file = %path.display(), bytes = size, kept = keep, "cut back a daemon's log file over its limit; its newest bytes are in <name>.1");
                cut.push(path);
            }
            Err(e) => {
                tracing::warn!(file = %path.display(), error = %e, "cannot cut back a daemon's log file")
            }
        }
    }
    cut
}

fn trim_log(path: &Path, size: u64, keep: u64) -> std::io::Result<()> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = OpenOptions::new().read(true).write(true).open(path)?;
    f.seek(SeekFrom::Start(size.saturating_sub(keep)))?;
    let mut tail = Vec::new();
    (&mut f).take(keep).read_to_end(&mut tail)?;
    let mut old = path.as_os_str().to_owned();
    old.push(".1");
    std::fs::write(PathBuf::from(old), &tail)?;
    f.set_len(0)
}

/// A line for whoever reads the daemon's log directory (the plugin's error points there).
fn note(log: &Path, line: &str) {
    let path = log.join(OUT_LOG);
    if let Ok(mut f) = OpenOptions::new().create(true).append(true).open(path) {
        let _ = writeln!(f, "nvdra mps-host: {line}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    /// The log lines written while `f` runs, as `tracing`'s fmt layer writes them.
    fn logged<T>(f: impl FnOnce() -> T) -> (T, String) {
        #[derive(Clone, Default)]
        struct Buf(Arc<Mutex<Vec<u8>>>);
        impl Write for Buf {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                crate::lock::lock(&self.0).extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let buf = Buf::default();
        let sink = buf.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || sink.clone())
            .with_ansi(false)
            .finish();
        let out = tracing::subscriber::with_default(subscriber, f);
        let text = String::from_utf8(crate::lock::lock(&buf.0).clone()).unwrap();
        (out, text)
    }

    fn host(dir: &Path) -> Host {
        std::fs::write(dir.join("boot_id"), "boot-1\n").unwrap();
        Host::start(Options {
            root: dir.join("mps"),
            // No control binary there: no daemon is started.
            driver_root: dir.join("driver"),
            boot_id_file: dir.join("boot_id"),
            quit_deadline: Duration::from_secs(10),
            probe_interval: Duration::from_secs(5),
            private_shm: false,
            shm_size: 0,
        })
        .unwrap()
    }

    #[test]
    fn an_unreadable_request_is_warned_about_once_until_it_changes() {
        let dir = tempfile::tempdir().unwrap();
        let mut host = host(dir.path());
        let id = DaemonId::parse("g-0123456789ab").unwrap();
        std::fs::create_dir_all(host.layout.dir(&id)).unwrap();
        let spec = host.layout.spec(&id);
        std::fs::write(&spec, "not json").unwrap();
        let warned = |host: &mut Host, scans: usize| {
            let ((), text) = logged(|| (0..scans).for_each(|_| host.reconcile()));
            text.lines()
                .filter(|l| l.contains("cannot read the daemon's request"))
                .count()
        };
        // A minute of scans (every 200 ms): one warning, not 300.
        assert_eq!(warned(&mut host, 300), 1);
        assert_eq!(warned(&mut host, 10), 0);
        // Another file in its place (another inode, another size): warned about again, once.
        std::fs::remove_file(&spec).unwrap();
        std::fs::write(&spec, "not json either").unwrap();
        assert_eq!(warned(&mut host, 10), 1);
        // Too large: refused naming the file, once.
        std::fs::write(
            &spec,
            " ".repeat(super::super::dir::SPEC_LIMIT as usize + 1),
        )
        .unwrap();
        let ((), text) = logged(|| (0..10).for_each(|_| host.reconcile()));
        let lines: Vec<&str> = text.lines().filter(|l| l.contains("WARN")).collect();
        assert_eq!(lines.len(), 1, "{text}");
        assert!(
            lines[0].contains(&format!(
                "{} is larger than 65536 bytes, which no daemon request is",
                spec.display()
            )),
            "{text}"
        );
        // Gone and back: it is a new finding.
        std::fs::remove_dir_all(host.layout.dir(&id)).unwrap();
        host.reconcile();
        assert!(host.unreadable.is_empty());
        std::fs::create_dir_all(host.layout.dir(&id)).unwrap();
        std::fs::write(&spec, "not json").unwrap();
        assert_eq!(warned(&mut host, 10), 1);
    }

    #[test]
    fn a_log_over_its_limit_is_cut_back_to_its_newest_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path();
        // The daemon's log, appended to through a handle it keeps open, as MPS does.
        let control = log.join("control.log");
        let mut writer = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&control)
            .unwrap();
        let lines: String = (0..300).map(|i| format!("line {i:04}\n")).collect();
        writer.write_all(lines.as_bytes()).unwrap(); // 3000 bytes
        std::fs::write(log.join("server.log"), "short\n").unwrap();
        std::fs::write(log.join("control.log.1"), "x".repeat(5000)).unwrap();
        let cut = trim_logs(log, 1000, 100);
        assert_eq!(cut, vec![control.clone()]);
        assert_eq!(std::fs::read_to_string(&control).unwrap(), "");
        // The newest 100 bytes: the last ten lines.
        let kept = std::fs::read_to_string(log.join("control.log.1")).unwrap();
        let last: String = (290..300).map(|i| format!("line {i:04}\n")).collect();
        assert_eq!(kept, last);
        assert_eq!(
            std::fs::read_to_string(log.join("server.log")).unwrap(),
            "short\n"
        );
        // Its writer goes on at the file's new start.
        writer.write_all(b"after\n").unwrap();
        assert_eq!(std::fs::read_to_string(&control).unwrap(), "after\n");
        assert!(trim_logs(log, 1000, 100).is_empty());
    }

    #[test]
    fn the_scan_cuts_back_the_logs_of_every_daemon_directory() {
        let dir = tempfile::tempdir().unwrap();
        let mut host = host(dir.path());
        let id = DaemonId::parse("c-0123456789ab").unwrap();
        let log = host.layout.log(&id);
        std::fs::create_dir_all(&log).unwrap();
        // A request the host leaves alone (unreadable): only the logs are at stake.
        std::fs::write(host.layout.spec(&id), "not json").unwrap();
        std::fs::write(log.join("control.log"), vec![b'x'; LOG_LIMIT as usize + 1]).unwrap();
        host.reconcile();
        assert_eq!(std::fs::metadata(log.join("control.log")).unwrap().len(), 0);
        assert_eq!(
            std::fs::metadata(log.join("control.log.1")).unwrap().len(),
            LOG_KEEP
        );
        // Measured again only after LOG_CHECK.
        std::fs::write(log.join("control.log"), vec![b'x'; LOG_LIMIT as usize + 1]).unwrap();
        host.reconcile();
        assert_eq!(
            std::fs::metadata(log.join("control.log")).unwrap().len(),
            LOG_LIMIT + 1
        );
    }
}
