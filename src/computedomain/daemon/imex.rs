//! The host's `nvidia-imex` as a child of the daemon, and `nvidia-imex-ctl -q`.
//!
//! - A child that exits is started again after a backoff (1 s, doubling to the configured
//!   maximum): the daemon stays up and reports, it never exits because IMEX does (no crash loop
//!   of the pod). The backoff goes back to 1 s only for a child that ran at least that maximum
//!   before it exited, as the kubelet resets a container's restart backoff after a long enough
//!   run: an IMEX that is READY for a moment and then dies is not started again every second.
//! - A change of the peers is a `SIGUSR1` (IMEX restarts its outgoing connections, resolving
//!   the names again) instead of a restart. IMEX handles at most one `SIGUSR1` every 5 seconds
//!   and drops the others, so a change within that window is held and signalled when it ends.
//! - Its output (IMEX logs to stderr in the daemon's config) is copied to the daemon's log,
//!   and its last error line is kept: it is the reason people read when the node is NotReady.

use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
use tokio::process::{Child, Command};
use tokio::time::Instant;

/// The first restart delay; it doubles per exit up to the configured maximum.
pub const FIRST_BACKOFF: Duration = Duration::from_secs(1);

/// The longest an `nvidia-imex-ctl -q` may take before it is killed.
pub const CTL_DEADLINE: Duration = Duration::from_secs(10);

/// The last error line IMEX wrote, shared with the tasks that read its output.
#[derive(Clone, Default)]
pub struct LastError(Arc<Mutex<Option<String>>>);

impl LastError {
    pub fn get(&self) -> Option<String> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn set(&self, line: &str) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(line.to_string());
    }
}

/// Whether a line of IMEX's log is an error worth showing (`[ERROR]`, `[CRITICAL]`, a fatal).
pub fn is_error_line(line: &str) -> bool {
    let l = line.to_ascii_lowercase();
    l.contains("[error]") || l.contains("[critical]") || l.contains("fatal")
}

/// What happened to the child since the last look.
#[derive(Debug, PartialEq, Eq)]
pub enum Exit {
    Running,
    /// It exited (status as the OS tells it); the next start waits `retry_in`.
    Exited {
        status: String,
        retry_in: Duration,
    },
    NotStarted,
}

/// The supervised `nvidia-imex`.
pub struct Imex {
    program: String,
    args: Vec<String>,
    child: Option<Child>,
    /// When the running child was started.
    started_at: Instant,
    backoff: Duration,
    max_backoff: Duration,
    not_before: Instant,
    usr1_interval: Duration,
    last_usr1: Option<Instant>,
    reload_pending: bool,
    last_error: LastError,
    starts: u64,
}

impl Imex {
    pub fn new(
        program: String,
        args: Vec<String>,
        max_backoff: Duration,
        usr1_interval: Duration,
    ) -> Self {
        Self {
            program,
            args,
            child: None,
            started_at: Instant::now(),
            backoff: FIRST_BACKOFF,
            max_backoff: max_backoff.max(FIRST_BACKOFF),
            not_before: Instant::now(),
            usr1_interval,
            last_usr1: None,
            reload_pending: false,
            last_error: LastError::default(),
            starts: 0,
        }
    }

    pub fn last_error(&self) -> Option<String> {
        self.last_error.get()
    }

    /// How often it was started.
    pub fn starts(&self) -> u64 {
        self.starts
    }

    /// Reaps a child that exited and schedules its restart.
    pub fn poll(&mut self) -> Exit {
        let Some(child) = self.child.as_mut() else {
            return Exit::NotStarted;
        };
        match child.try_wait() {
            Ok(None) => Exit::Running,
            Ok(Some(status)) => self.exited(status.to_string()),
            Err(e) => self.exited(format!("unknown ({e})")),
        }
    }

    fn exited(&mut self, status: String) -> Exit {
        self.child = None;
        // A long run is a fresh start; a short one (ready or not) grows the wait.
        if self.started_at.elapsed() >= self.max_backoff {
            self.backoff = FIRST_BACKOFF;
        }
        let retry_in = self.backoff;
        self.not_before = Instant::now() + retry_in;
        self.backoff = (self.backoff * 2).min(self.max_backoff);
        tracing::warn!(%status, retry_in = ?retry_in, "nvidia-imex exited; starting it again after the backoff");
        Exit::Exited { status, retry_in }
    }

    /// Starts the child unless it runs or its backoff has not passed; `Ok(true)` when it was
    /// started now (a fresh IMEX reads the peers itself: no reload needed).
    pub fn ensure_started(&mut self) -> std::io::Result<bool> {
        if self.child.is_some() || Instant::now() < self.not_before {
            return Ok(false);
        }
        let mut cmd = Command::new(&self.program);
        cmd.args(&self.args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        // IMEX ends with the daemon even when the daemon is SIGKILLed (no orphan IMEX holding
        // the node's ports for the next daemon to trip over).
        // SAFETY: prctl(2) is async-signal-safe and touches no memory of the parent.
        unsafe {
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) == 0 {
                    Ok(())
                } else {
                    Err(std::io::Error::last_os_error())
                }
            });
        }
        let mut child = cmd.spawn().inspect_err(|_| {
            self.not_before = Instant::now() + self.backoff;
            self.backoff = (self.backoff * 2).min(self.max_backoff);
        })?;
        if let Some(out) = child.stdout.take() {
            tokio::spawn(copy_log(out, self.last_error.clone()));
        }
        if let Some(err) = child.stderr.take() {
            tokio::spawn(copy_log(err, self.last_error.clone()));
        }
        tracing::info!(pid = child.id(), program = %self.program, "nvidia-imex started");
        self.child = Some(child);
        self.started_at = Instant::now();
        self.starts += 1;
        self.reload_pending = false;
        Ok(true)
    }

    /// The peers changed: IMEX must reconnect (see [`Imex::flush_reload`]).
    pub fn request_reload(&mut self) {
        if self.child.is_some() {
            self.reload_pending = true;
        }
    }

    /// Sends the pending `SIGUSR1` unless the last one is too recent for IMEX to take another;
    /// true when it was sent.
    pub fn flush_reload(&mut self) -> bool {
        if !self.reload_pending {
            return false;
        }
        if self
            .last_usr1
            .is_some_and(|t| t.elapsed() < self.usr1_interval)
        {
            return false;
        }
        let Some(pid) = self.child.as_ref().and_then(Child::id) else {
            self.reload_pending = false;
            return false;
        };
        self.reload_pending = false;
        self.last_usr1 = Some(Instant::now());
        match signal(pid, libc::SIGUSR1) {
            Ok(()) => {
                tracing::info!(pid, "peers changed: SIGUSR1 sent to nvidia-imex");
                true
            }
            Err(e) => {
                // The child exited meanwhile: the next poll restarts it, and a fresh one reads
                // the peers itself.
                tracing::warn!(pid, error = %e, "cannot send SIGUSR1 to nvidia-imex");
                false
            }
        }
    }

    /// SIGTERM, then SIGKILL after `grace`.
    pub async fn stop(&mut self, grace: Duration) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        if let Some(pid) = child.id() {
            let _ = signal(pid, libc::SIGTERM);
        }
        match tokio::time::timeout(grace, child.wait()).await {
            Ok(status) => tracing::info!(status = ?status, "nvidia-imex stopped"),
            Err(_) => {
                tracing::warn!(grace = ?grace, "nvidia-imex did not stop after SIGTERM: killing it");
                let _ = child.kill().await;
            }
        }
    }
}

fn signal(pid: u32, sig: libc::c_int) -> std::io::Result<()> {
    let pid = libc::pid_t::try_from(pid).map_err(std::io::Error::other)?;
    // SAFETY: kill(2) takes two integers and touches no memory of this process.
    if unsafe { libc::kill(pid, sig) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

async fn copy_log(stream: impl AsyncRead + Unpin, last_error: LastError) {
    let mut lines = BufReader::new(stream).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        if is_error_line(&line) {
            last_error.set(&line);
            tracing::warn!(target: "nvidia-imex", "{line}");
        } else {
            tracing::info!(target: "nvidia-imex", "{line}");
        }
    }
}

/// What `nvidia-imex-ctl -q` said.
#[derive(Debug, PartialEq, Eq)]
pub enum Readiness {
    Ready,
    /// Its state (`WAITING_FOR_PEERS`, `INIT_GPU`, `UNAVAILABLE`, …) or why it gave none.
    NotReady(String),
}

/// Reads the answer of `nvidia-imex-ctl -q`: ready only on exit status 0 and `READY`.
pub fn readiness(output: Result<crate::child::Output, crate::child::Error>) -> Readiness {
    match output {
        Ok(o) => {
            let text = String::from_utf8_lossy(&o.stdout).trim().to_string();
            if o.status.success() && text == "READY" {
                Readiness::Ready
            } else if text.is_empty() {
                let err = String::from_utf8_lossy(&o.stderr).trim().to_string();
                Readiness::NotReady(
                    format!("nvidia-imex-ctl -q: {} {err}", o.status)
                        .trim_end()
                        .to_string(),
                )
            } else {
                Readiness::NotReady(format!("nvidia-imex-ctl -q: {text}"))
            }
        }
        Err(e) => Readiness::NotReady(format!("{e}")),
    }
}

/// Runs `<ctl> -c <config> -q` with [`CTL_DEADLINE`] on the blocking pool.
pub async fn query(ctl: &str, config: &str) -> Readiness {
    let (ctl, config) = (ctl.to_string(), config.to_string());
    let out = tokio::task::spawn_blocking(move || {
        let mut cmd = std::process::Command::new(&ctl);
        cmd.args(["-c", &config, "-q"]);
        crate::child::output(&mut cmd, &format!("{ctl} -q"), CTL_DEADLINE)
    })
    .await;
    match out {
        Ok(o) => readiness(o),
        Err(e) => Readiness::NotReady(format!("nvidia-imex-ctl -q did not finish: {e}")),
    }
}

/// What `nvidia-imex-ctl -N` says about the IMEX domain: each node of the nodes config (its
/// address as written there, and its state) and the table of who is connected to whom.
///
/// The text's shape (IMEX's; the legend lines are skipped):
/// ```text
/// Nodes:
/// Node #0   - 172.31.48.81    - READY                - Version: 570.172
/// Node #1   - 172.31.48.98    - READY                - Version: 570.172
///
///  Nodes From\To  0   1
///        0        C   C
///        1        C   C
///
/// Domain State: UP
/// ```
/// A cell is `C` (connected), `N` (never connected), `I` (the node did not answer), `R`, `D`,
/// `A` or `!V!`/`!M!` (version or node-map mismatch).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DomainStatus {
    /// By node index: its address and its state.
    pub nodes: std::collections::BTreeMap<i64, (String, String)>,
    /// By (from, to): the table's cell.
    pub links: std::collections::BTreeMap<(i64, i64), String>,
}

impl DomainStatus {
    /// The index of the node with one of `addresses`.
    pub fn index_of(&self, addresses: &[&str]) -> Option<i64> {
        self.nodes
            .iter()
            .find(|(_, (a, _))| addresses.contains(&a.as_str()))
            .map(|(i, _)| *i)
    }

    /// The addresses of the nodes `from` is connected to (`C`), itself left out.
    pub fn connected_from(&self, from: i64) -> Vec<&str> {
        self.nodes
            .iter()
            .filter(|(to, _)| **to != from)
            .filter(|(to, _)| self.links.get(&(from, **to)).is_some_and(|c| c == "C"))
            .map(|(_, (a, _))| a.as_str())
            .collect()
    }
}

/// Reads the text of `nvidia-imex-ctl -N` (see [`DomainStatus`]); an error names what is
/// missing and quotes the text's first line.
pub fn parse_domain_status(text: &str) -> Result<DomainStatus, String> {
    let mut status = DomainStatus::default();
    let mut columns: Option<Vec<i64>> = None;
    for line in text.lines().map(str::trim) {
        if let Some(rest) = line.strip_prefix("Node #") {
            let parts: Vec<&str> = rest.split(" - ").map(str::trim).collect();
            let (Some(index), Some(address), Some(state)) = (
                parts.first().and_then(|i| i.parse::<i64>().ok()),
                parts.get(1).and_then(|a| a.split_whitespace().next()),
                parts.get(2),
            ) else {
                return Err(format!(
                    "nvidia-imex-ctl -N: cannot read the node line {line:?}"
                ));
            };
            status
                .nodes
                .insert(index, (address.to_string(), state.to_string()));
        } else if let Some(rest) = line.strip_prefix("Nodes From\\To") {
            columns = Some(
                rest.split_whitespace()
                    .map(|c| c.parse::<i64>())
                    .collect::<Result<_, _>>()
                    .map_err(|e| format!("nvidia-imex-ctl -N: the table's header {line:?}: {e}"))?,
            );
        } else if line.starts_with("Domain State:") {
            columns = None;
        } else if let Some(columns) = &columns {
            let mut cells = line.split_whitespace();
            let Some(from) = cells.next().and_then(|f| f.parse::<i64>().ok()) else {
                continue;
            };
            for (to, cell) in columns.iter().zip(cells) {
                status.links.insert((from, *to), cell.to_string());
            }
        }
    }
    if status.nodes.is_empty() {
        let first = text.lines().find(|l| !l.trim().is_empty()).unwrap_or("");
        return Err(format!(
            "nvidia-imex-ctl -N printed no node list (first line: {first:?})"
        ));
    }
    Ok(status)
}

/// Runs `<ctl> -c <config> -N` with [`CTL_DEADLINE`] on the blocking pool.
pub async fn domain_status(ctl: &str, config: &str) -> Result<DomainStatus, String> {
    let (ctl, config) = (ctl.to_string(), config.to_string());
    let out = tokio::task::spawn_blocking(move || {
        let mut cmd = std::process::Command::new(&ctl);
        cmd.args(["-c", &config, "-N"]);
        crate::child::output(&mut cmd, &format!("{ctl} -N"), CTL_DEADLINE)
    })
    .await
    .map_err(|e| format!("nvidia-imex-ctl -N did not finish: {e}"))?
    .map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err(format!(
            "nvidia-imex-ctl -N: {} {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    parse_domain_status(&String::from_utf8_lossy(&out.stdout))
}
