//! `nvdra mps-host`: runs one `nvidia-cuda-mps-control -f` per `<root>/<id>/daemon.json`
//! ([`super::dir`]) and keeps it running while it is wanted.
//!
//! One loop on one thread owns every daemon: every [`SCAN`] it reads the root and moves each
//! daemon towards what the directory says:
//!
//! - wanted and not running: start it (in its own mount namespace, `/dev/shm` = `<id>/shm`);
//! - running and exited by itself: start it again after a backoff (0.5 s doubling to 30 s; reset
//!   once it ran a minute), logging how it ended;
//! - released (`daemon.json` gone): `quit` with a deadline, SIGKILL after it, then the directory
//!   is removed — all off the loop's thread, so one daemon slow to quit holds up no other.
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
/// How long a released daemon gets to quit before it is killed.
pub const QUIT_DEADLINE: Duration = Duration::from_secs(10);
const BACKOFF_FIRST: Duration = Duration::from_millis(500);
const BACKOFF_MAX: Duration = Duration::from_secs(30);
/// A daemon that ran this long before it exited starts again without waiting.
const HEALTHY_RUN: Duration = Duration::from_secs(60);
/// The file in a daemon's log directory that gets its stdout and stderr and the host's notes.
pub const OUT_LOG: &str = "control.out";

#[derive(Clone, Debug)]
pub struct Options {
    /// `--mps-root`.
    pub root: PathBuf,
    /// Where this process reads the driver's files (the control binary is under it).
    pub driver_root: PathBuf,
    pub boot_id_file: PathBuf,
    pub quit_deadline: Duration,
    /// Give each daemon its own `/dev/shm` (needs CAP_SYS_ADMIN); off only for demos and tests
    /// without the privilege.
    pub private_shm: bool,
}

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
    },
    /// Not running; (re)started at `until`.
    Waiting {
        until: Instant,
    },
    /// Quitting (and, for a released daemon, its directory being removed).
    Stopping(JoinHandle<()>),
}

struct Daemon {
    state: State,
    /// Exits in a row without a healthy run, for the backoff.
    failures: u32,
}

pub struct Host {
    opts: Options,
    layout: Layout,
    boot_id: String,
    daemons: BTreeMap<DaemonId, Daemon>,
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
        crate::durable::write(&layout.boot_id(), format!("{boot_id}\n").as_bytes())
            .map_err(Error::WriteBootId)?;
        tracing::info!(root = %opts.root.display(), boot.id = %boot_id, "MPS host started");
        Ok(Host {
            opts,
            layout,
            boot_id,
            daemons: BTreeMap::new(),
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
        let mut seen = Vec::new();
        for id in ids {
            let spec = match self.layout.read_spec(&id) {
                Ok(spec) => spec,
                Err(e) => {
                    tracing::warn!(daemon = %id, error = %crate::report::chain(&e), "cannot read the daemon's request; leaving it as it is");
                    seen.push(id);
                    continue;
                }
            };
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
        });
        match &mut d.state {
            State::Running { child, since } => {
                let status = match child.try_wait() {
                    Ok(Some(status)) => status,
                    Ok(None) => return,
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
                match spawn(&self.opts, &self.layout, &id, spec) {
                    Ok(child) => {
                        tracing::info!(daemon = %id, owner = %spec.owner, devices = %spec.devices.join(","), multi_user = spec.multi_user, pid = child.id(), "MPS control daemon started");
                        d.state = State::Running { child, since: now };
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
) -> Result<Child, SpawnError> {
    let control = control::find(&opts.driver_root)?;
    let dir = layout.dir(id);
    let dir_err = |source| SpawnError::Dir {
        path: dir.clone(),
        source,
    };
    Layout::make_subdirs(&dir).map_err(dir_err)?;
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
    if spec.multi_user {
        cmd.arg("-M");
    }
    cmd.env("CUDA_VISIBLE_DEVICES", spec.devices.join(","))
        .env("CUDA_MPS_PIPE_DIRECTORY", layout.pipe(id))
        .env("CUDA_MPS_LOG_DIRECTORY", layout.log(id))
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err);
    let shm = layout.shm(id);
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

/// A line for whoever reads the daemon's log directory (the plugin's error points there).
fn note(log: &Path, line: &str) {
    let path = log.join(OUT_LOG);
    if let Ok(mut f) = OpenOptions::new().create(true).append(true).open(path) {
        let _ = writeln!(f, "nvdra mps-host: {line}");
    }
}
