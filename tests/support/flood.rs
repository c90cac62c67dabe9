//! A flood of the metrics port such as any pod on the pod network can send: connections that
//! send nothing, connections that send a request head a byte at a time and never finish it,
//! and scrapes back to back. A connection the server closes is opened again after a short
//! pause, so the pressure lasts. Shared by `tests/integration/metrics_flood.rs` and
//! `benches/metrics_flood.rs` (included by `#[path]`), with the probe the kubelet sends.
// Each user takes what it needs.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use kubelet_plugin::proto::dra::v1::dra_plugin_client::DraPluginClient;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

/// The daemon under the flood, killed however the test or bench ends.
pub struct Daemon(pub Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `cmd` (a sandboxed `nvdra run`, `super::daemon`'s, with `/metrics` on `127.0.0.1:0`)
/// started and serving: its DRA socket `dra_socket` is there and its listener answers
/// `/healthz` (ready would need a kubelet's registration, which none gives here). The daemon,
/// the address the kernel gave its listener, and a client of its DRA socket.
pub async fn serving(
    mut cmd: Command,
    dra_socket: &Path,
) -> (
    Daemon,
    SocketAddr,
    DraPluginClient<tonic::transport::Channel>,
) {
    let mut daemon = Daemon(cmd.spawn().expect("start nvdra"));
    let addr = super::daemon::metrics_address(daemon.0.id());
    super::wait::until("the daemon to serve", super::wait::SOON, || {
        if let Some(status) = daemon.0.try_wait().expect("daemon status") {
            panic!("the daemon exited ({status}) before it served");
        }
        let socket = dra_socket.exists();
        async move {
            let healthz = get(addr, "/healthz").await;
            healthz.filter(|r| socket && r.starts_with("HTTP/1.1 200"))
        }
    })
    .await;
    let dra = DraPluginClient::new(
        kubelet_plugin::socket::connect(dra_socket)
            .await
            .expect("connect to the DRA socket"),
    );
    (daemon, addr, dra)
}

/// How many of each kind of connection the flood keeps open.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    /// Connect and send nothing.
    pub idle: usize,
    /// Send `GET /metrics HTTP/1.1` and then one byte of a header every [`SLOW_BYTE`].
    pub slow: usize,
    /// `GET /metrics` one after another, each on a new connection.
    pub scrapers: usize,
}

/// Between two bytes of a slow connection.
pub const SLOW_BYTE: Duration = Duration::from_millis(200);
/// Before a closed connection is opened again.
pub const REOPEN: Duration = Duration::from_millis(100);

/// What the flood saw.
#[derive(Debug, Default)]
pub struct Counts {
    /// Connections opened.
    pub opened: AtomicU64,
    /// Idle and slow connections the server closed.
    pub closed_by_server: AtomicU64,
    /// Scrapes answered 200, and answered otherwise (503: too many at once) or not at all.
    pub scrapes_ok: AtomicU64,
    pub scrapes_not_ok: AtomicU64,
}

impl Counts {
    pub fn summary(&self) -> String {
        let n = |c: &AtomicU64| c.load(Ordering::Relaxed);
        format!(
            "{} connections opened, {} idle or slow ones closed by the server, scrapes: {} \
             answered, {} refused or unanswered",
            n(&self.opened),
            n(&self.closed_by_server),
            n(&self.scrapes_ok),
            n(&self.scrapes_not_ok)
        )
    }
}

pub struct Flood {
    stop: CancellationToken,
    tasks: tokio::task::JoinSet<()>,
    pub counts: Arc<Counts>,
}

impl Flood {
    /// Starts the flood against `addr` on the current runtime.
    pub fn start(addr: SocketAddr, shape: Shape) -> Self {
        let stop = CancellationToken::new();
        let counts = Arc::new(Counts::default());
        let mut tasks = tokio::task::JoinSet::new();
        for _ in 0..shape.idle {
            tasks.spawn(reopened(addr, false, stop.clone(), counts.clone()));
        }
        for _ in 0..shape.slow {
            tasks.spawn(reopened(addr, true, stop.clone(), counts.clone()));
        }
        for _ in 0..shape.scrapers {
            let (stop, counts) = (stop.clone(), counts.clone());
            tasks.spawn(async move {
                while !stop.is_cancelled() {
                    counts.opened.fetch_add(1, Ordering::Relaxed);
                    let answer = tokio::select! {
                        () = stop.cancelled() => return,
                        a = get(addr, "/metrics") => a,
                    };
                    let ok = answer.is_some_and(|a| a.starts_with("HTTP/1.1 200"));
                    let c = if ok {
                        &counts.scrapes_ok
                    } else {
                        &counts.scrapes_not_ok
                    };
                    c.fetch_add(1, Ordering::Relaxed);
                }
            });
        }
        Self {
            stop,
            tasks,
            counts,
        }
    }

    /// Stops the flood; every socket it opened is closed when this returns.
    pub async fn stop(mut self) -> Arc<Counts> {
        self.stop.cancel();
        while let Some(r) = self.tasks.join_next().await {
            r.expect("a flood task panicked");
        }
        self.counts
    }
}

/// One idle or slow connection, opened again whenever the server closes it.
async fn reopened(addr: SocketAddr, slow: bool, stop: CancellationToken, counts: Arc<Counts>) {
    while !stop.is_cancelled() {
        counts.opened.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut s) = TcpStream::connect(addr).await {
            let closed = tokio::select! {
                () = stop.cancelled() => false,
                () = hold(&mut s, slow) => true,
            };
            if closed {
                counts.closed_by_server.fetch_add(1, Ordering::Relaxed);
            }
        }
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(REOPEN) => {}
        }
    }
}

/// Holds `s` open until the server closes it: silent, or sending a head that never ends.
async fn hold(s: &mut TcpStream, slow: bool) {
    let (mut read, mut write) = s.split();
    let closed = async {
        let mut buf = [0u8; 512];
        while matches!(read.read(&mut buf).await, Ok(n) if n > 0) {}
    };
    let trickle = async {
        if !slow {
            return std::future::pending().await;
        }
        if write
            .write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            .await
            .is_err()
        {
            return;
        }
        loop {
            tokio::time::sleep(SLOW_BYTE).await;
            if write.write_all(b"a").await.is_err() {
                return;
            }
        }
    };
    tokio::select! {
        () = closed => {}
        () = trickle => {}
    }
}

/// `GET path` on a new connection, `Connection: close`; the whole answer, or none if the
/// connection failed or closed unanswered.
pub async fn get(addr: SocketAddr, path: &str) -> Option<String> {
    let mut s = TcpStream::connect(addr).await.ok()?;
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes())
        .await
        .ok()?;
    let mut buf = Vec::new();
    let _ = s.read_to_end(&mut buf).await;
    (!buf.is_empty()).then(|| String::from_utf8_lossy(&buf).into_owned())
}

/// The kubelet's probe: `GET path` answered within `timeout` (the probe's `timeoutSeconds`,
/// 1 s unless set); the status line, or none.
pub async fn probe(addr: SocketAddr, path: &str, timeout: Duration) -> Option<String> {
    let answer = tokio::time::timeout(timeout, get(addr, path))
        .await
        .ok()??;
    answer.lines().next().map(str::to_string)
}

/// Open file descriptors of process `pid`.
pub fn fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or_else(|e| panic!("cannot list /proc/{pid}/fd: {e}"))
}
