//! The listener of `/metrics`, `/healthz` and `/readyz`: reachable by every pod on the pod
//! network, so nothing a peer does on it may slow a prepare or starve the kubelet's probes.
//!
//! - **At most [`MAX_CONNECTIONS`] connections**, each one task and one socket. When all are
//!   taken, the connection that has waited longest for a request is closed to make room: idle
//!   and half-sent connections cannot lock out the kubelet, whose probe sends its request as
//!   soon as it connects and is answered from memory. A connection that is being answered is
//!   never closed for room; scrapes waiting for a render are capped at [`MAX_WAITING_SCRAPES`],
//!   so most places always belong to connections that can be closed or finish at once.
//! - **A request head within [`HEADER_TIMEOUT`]**, the first one and each next one on a kept-alive
//!   connection (hyper's header read timeout, which restarts whenever it waits for a head: it is
//!   also the idle timeout), and **no connection older than [`CONNECTION_LIFETIME`]** (a reader
//!   too slow to take its answer).
//! - **Backoff on accept errors**: out of file descriptors (or any error other than a peer that
//!   went away), the loop sleeps from [`ACCEPT_BACKOFF_FIRST`] doubling to [`ACCEPT_BACKOFF_MAX`]
//!   instead of spinning, and warns at most once per [`ACCEPT_LOG_EVERY`].
//! - **A thread of its own** ([`serve`]): the listener and its connections run on a
//!   single-threaded runtime there, never on the daemon's workers that serve the kubelet's gRPC.
//! - **Scrapes rendered on one thread of their own** ([`Renderer`]), never on the runtime's
//!   blocking pool that prepares use for NVML and fsync'd writes; a render serves every scrape
//!   that asks within [`CACHE_FOR`] of it, so N scrapes at once cost one render.
//!
//! Each limit is a constant, and [`Limits`] carries them so that the tests can shrink them.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, Semaphore, watch};
use tokio_util::sync::CancellationToken;

use super::{Metrics, Source};
use crate::lock::lock;

/// Connections served at once: Prometheus (two in an HA pair), the kubelet's two probes and
/// someone's `curl` need a handful; 32 leave room for all of them while bounding the sockets and
/// tasks a peer can make the daemon hold.
pub const MAX_CONNECTIONS: usize = 32;
/// How long a connection may take to send a request head, and stay idle between requests. The
/// kubelet and Prometheus send a head in one write right after connecting.
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(5);
/// The longest a connection lives, whatever it does: bounds a reader that takes its answer a
/// byte at a time. Prometheus reconnects for its next scrape.
pub const CONNECTION_LIFETIME: Duration = Duration::from_secs(60);
/// Scrapes that may wait for a render at once; more get `503` at once. A quarter of
/// [`MAX_CONNECTIONS`]: even with the hardware stuck mid-render, the other places stay free for
/// the probes.
pub const MAX_WAITING_SCRAPES: usize = 8;
/// How long a scrape waits for its render before it gets `503` (Prometheus' default scrape
/// timeout: it would give up then anyway).
pub const RENDER_WAIT: Duration = Duration::from_secs(10);
/// How old a render may be and still answer a scrape: N scrapes within this interval cost one
/// render. Far below any scrape interval.
pub const CACHE_FOR: Duration = Duration::from_secs(1);
/// The first pause after a failed accept; it doubles with each failure in a row.
pub const ACCEPT_BACKOFF_FIRST: Duration = Duration::from_millis(10);
/// The longest pause after failed accepts.
pub const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);
/// Failed accepts in a row warn once per this interval, with the count since the last warning.
pub const ACCEPT_LOG_EVERY: Duration = Duration::from_secs(10);

/// The listener's limits: the constants above, which tests shrink.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub connections: usize,
    pub header_timeout: Duration,
    pub lifetime: Duration,
    pub waiting_scrapes: usize,
    pub render_wait: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            connections: MAX_CONNECTIONS,
            header_timeout: HEADER_TIMEOUT,
            lifetime: CONNECTION_LIFETIME,
            waiting_scrapes: MAX_WAITING_SCRAPES,
            render_wait: RENDER_WAIT,
        }
    }
}

/// Binds the metrics listener. Separate from [`serve`] so that a bad address fails at start-up.
pub async fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr).await
}

/// Serves with the default [`Limits`] until `shutdown` is cancelled; each render reads `source`
/// besides the counters ([`Metrics::render`]).
///
/// The listener runs on a thread of its own with a single-threaded runtime: whatever a peer makes
/// it do (accepts, heads, closes, answers) runs there, never on the daemon's two workers that
/// serve the kubelet's gRPC. This future only waits for that thread to end.
pub async fn serve(
    listener: TcpListener,
    metrics: Arc<Metrics>,
    source: Option<Arc<dyn Source>>,
    shutdown: CancellationToken,
) {
    let listener = match listener.into_std() {
        Ok(l) => l,
        Err(e) => {
            tracing::error!(error = %e, "cannot hand the metrics listener to its thread");
            return;
        }
    };
    let (done, ended) = tokio::sync::oneshot::channel::<()>();
    let thread = std::thread::Builder::new()
        .name("nvdra-metrics-io".into())
        .spawn(move || {
            let runtime = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    tracing::error!(error = %e, "cannot start the metrics listener's runtime");
                    return;
                }
            };
            runtime.block_on(async move {
                // Registered with this thread's runtime (it is non-blocking, as into_std left it).
                match TcpListener::from_std(listener) {
                    Ok(l) => serve_with(l, metrics, source, Limits::default(), shutdown).await,
                    Err(e) => tracing::error!(error = %e, "cannot register the metrics listener"),
                }
            });
            drop(done);
        });
    if let Err(e) = thread {
        // The task ends, which stops the daemon naming it: a node out of threads.
        tracing::error!(error = %e, "cannot start the metrics listener thread");
        return;
    }
    // Ends when the thread's serving ends (shutdown, or a failure logged above).
    let _ = ended.await;
}

/// Serves until `shutdown` is cancelled; connections still open are closed then.
pub async fn serve_with(
    listener: TcpListener,
    metrics: Arc<Metrics>,
    source: Option<Arc<dyn Source>>,
    limits: Limits,
    shutdown: CancellationToken,
) {
    let slots = Arc::new(Slots::new(limits.connections));
    serve_on(listener, metrics, source, limits, slots, shutdown).await;
}

async fn serve_on(
    listener: TcpListener,
    metrics: Arc<Metrics>,
    source: Option<Arc<dyn Source>>,
    limits: Limits,
    slots: Arc<Slots>,
    shutdown: CancellationToken,
) {
    let renderer = match Renderer::start(metrics.clone(), source) {
        Ok(r) => Arc::new(r),
        Err(e) => {
            // The task ends, which stops the daemon naming it: a node out of threads.
            tracing::error!(error = %e, "cannot start the metrics renderer thread");
            return;
        }
    };
    let scrapes = Arc::new(Semaphore::new(limits.waiting_scrapes));
    let mut backoff = AcceptBackoff::default();
    loop {
        let stream = tokio::select! {
            () = shutdown.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    if let Some(errors) = backoff.succeeded() {
                        tracing::info!(errors, "metrics listener accepts again");
                    }
                    stream
                }
                Err(e) => {
                    let failed = backoff.failed(&e, Instant::now());
                    if let Some(errors) = failed.log {
                        tracing::warn!(
                            error = %e, errors, pause = ?failed.pause,
                            "metrics listener cannot accept connections; pausing"
                        );
                    }
                    if !failed.pause.is_zero() {
                        tokio::select! {
                            () = shutdown.cancelled() => return,
                            () = tokio::time::sleep(failed.pause) => {}
                        }
                    }
                    continue;
                }
            },
        };
        slots.accepted.fetch_add(1, Ordering::Relaxed);
        // The one accepted socket waits here for a place; no more are accepted meanwhile.
        let slot = tokio::select! {
            () = shutdown.cancelled() => return,
            slot = slots.admit() => slot,
        };
        let (metrics, renderer, scrapes) = (metrics.clone(), renderer.clone(), scrapes.clone());
        let shutdown = shutdown.clone();
        tokio::spawn(async move {
            connection(stream, slot, metrics, renderer, scrapes, limits, shutdown).await;
        });
    }
}

/// Serves one connection in its place until it ends, is closed for room, outlives its
/// lifetime, or the listener shuts down.
async fn connection(
    stream: TcpStream,
    slot: Slot,
    metrics: Arc<Metrics>,
    renderer: Arc<Renderer>,
    scrapes: Arc<Semaphore>,
    limits: Limits,
    shutdown: CancellationToken,
) {
    // Running now: from here the connection can be closed for room while it waits for a head.
    slot.tracker.set(IDLE);
    let tracker = slot.tracker.clone();
    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
        let busy = tracker.busy();
        let (metrics, renderer, scrapes) = (metrics.clone(), renderer.clone(), scrapes.clone());
        async move {
            let response = handle(&req, &metrics, &renderer, &scrapes, limits.render_wait).await;
            drop(busy);
            Ok::<_, std::convert::Infallible>(response)
        }
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .serve_connection(TokioIo::new(stream), service);
    tokio::select! {
        () = shutdown.cancelled() => {}
        () = slot.tracker.conn.evict.cancelled() => {
            tracing::debug!("metrics connection closed to make room");
        }
        r = tokio::time::timeout(limits.lifetime, conn) => match r {
            Err(_) => tracing::debug!("metrics connection closed at the end of its lifetime"),
            Ok(Err(e)) => tracing::debug!(error = %e, "metrics connection ended"),
            Ok(Ok(())) => {}
        },
    }
}

/// The answer to one request: a scrape from the [`Renderer`], anything else from memory.
async fn handle(
    req: &Request<Incoming>,
    metrics: &Metrics,
    renderer: &Renderer,
    scrapes: &Semaphore,
    render_wait: Duration,
) -> Response<Full<Bytes>> {
    let (method, path) = (req.method(), req.uri().path());
    let is_get = method == Method::GET || method == Method::HEAD;
    if path != "/metrics" || !is_get {
        return respond(metrics, method, path);
    }
    let Ok(_waiting) = scrapes.try_acquire() else {
        return text(
            StatusCode::SERVICE_UNAVAILABLE,
            "too many scrapes at once; try again\n".into(),
            "text/plain",
        );
    };
    match tokio::time::timeout(render_wait, renderer.text()).await {
        Ok(Ok(body)) => {
            let mut r = Response::new(Full::new(body));
            let ctype = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;
            if let Ok(v) = hyper::header::HeaderValue::from_str(ctype) {
                r.headers_mut().insert(hyper::header::CONTENT_TYPE, v);
            }
            r
        }
        Ok(Err(e)) => {
            tracing::error!(error = %e, "cannot render the metrics");
            text(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("{e}\n"),
                "text/plain",
            )
        }
        Err(_) => text(
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "the metrics took longer than {render_wait:?} to render (the GPUs are slow to \
                 answer); try again\n"
            ),
            "text/plain",
        ),
    }
}

fn text(status: StatusCode, body: String, ctype: &'static str) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    r.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static(ctype),
    );
    r
}

/// The answer to `method path` for everything but a scrape: the probes read only memory.
fn respond(metrics: &Metrics, method: &Method, path: &str) -> Response<Full<Bytes>> {
    if method != Method::GET && method != Method::HEAD {
        return text(
            StatusCode::METHOD_NOT_ALLOWED,
            "only GET\n".into(),
            "text/plain",
        );
    }
    match path {
        "/healthz" => text(StatusCode::OK, "ok\n".into(), "text/plain"),
        "/readyz" if metrics.ready() => text(StatusCode::OK, "ready\n".into(), "text/plain"),
        "/readyz" => {
            let mut why = Vec::new();
            if let Some(stopped) = metrics.stopped.get() {
                why.push(stopped.as_str());
            }
            if !metrics.registered.load(Ordering::Relaxed) {
                why.push("not registered with the kubelet");
            }
            if !metrics.slices.published.load(Ordering::Relaxed) {
                why.push("ResourceSlices not published yet");
            }
            text(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("not ready: {}\n", why.join("; ")),
                "text/plain",
            )
        }
        _ => text(StatusCode::NOT_FOUND, "not found\n".into(), "text/plain"),
    }
}

/// Why a scrape has no text.
#[derive(Debug, thiserror::Error)]
enum RenderError {
    #[error("the metrics renderer thread is gone; the daemon needs a restart")]
    Gone,
    #[error("rendering the metrics panicked; see the log")]
    Panicked,
}

/// One render: when it started, and its text (none if it panicked).
#[derive(Debug, Clone)]
struct Rendered {
    started: Instant,
    text: Option<Bytes>,
}

/// Whether `r` answers a scrape asked at `asked`: started at most [`CACHE_FOR`] before.
fn fresh(r: &Option<Rendered>, asked: Instant) -> bool {
    r.as_ref()
        .is_some_and(|r| asked.saturating_duration_since(r.started) <= CACHE_FOR)
}

/// Renders the metrics on a thread of its own (`nvdra-metrics`) when a scrape finds the last
/// render stale; every scrape waiting meanwhile gets that render. The thread ends when the
/// listener and its connections are gone (or stays stuck in a hung read of the hardware,
/// harming nothing else).
struct Renderer {
    /// Asks for a render; one ask pending at most (more find the channel full: already asked).
    asks: std::sync::mpsc::SyncSender<()>,
    rendered: watch::Receiver<Option<Rendered>>,
}

impl Renderer {
    fn start(metrics: Arc<Metrics>, source: Option<Arc<dyn Source>>) -> std::io::Result<Self> {
        let (asks, asked) = std::sync::mpsc::sync_channel::<()>(1);
        let (publish, rendered) = watch::channel(None);
        std::thread::Builder::new()
            .name("nvdra-metrics".into())
            .spawn(move || {
                while asked.recv().is_ok() {
                    // Asked while the last render was under way: that one may do.
                    if fresh(&publish.borrow(), Instant::now()) {
                        continue;
                    }
                    let started = Instant::now();
                    let render = std::panic::AssertUnwindSafe(|| metrics.render(source.as_deref()));
                    let text = std::panic::catch_unwind(render).ok().map(Bytes::from);
                    if text.is_none() {
                        tracing::error!("rendering the metrics panicked");
                    }
                    publish.send_replace(Some(Rendered { started, text }));
                }
            })?;
        Ok(Self { asks, rendered })
    }

    /// The metrics text, rendered at most [`CACHE_FOR`] before now (or after).
    async fn text(&self) -> Result<Bytes, RenderError> {
        let asked = Instant::now();
        let mut rendered = self.rendered.clone();
        if !fresh(&rendered.borrow_and_update(), asked) {
            match self.asks.try_send(()) {
                Ok(()) | Err(std::sync::mpsc::TrySendError::Full(())) => {}
                Err(std::sync::mpsc::TrySendError::Disconnected(())) => {
                    return Err(RenderError::Gone);
                }
            }
        }
        let r = rendered
            .wait_for(|r| fresh(r, asked))
            .await
            .map_err(|_| RenderError::Gone)?;
        r.as_ref()
            .and_then(|r| r.text.clone())
            .ok_or(RenderError::Panicked)
    }
}

/// A connection's state, as the places see it: only an idle one may be closed for room.
const NEW: u8 = 0;
/// Waiting for a request head (the first, or the next one on a kept-alive connection), or
/// writing an answer out.
const IDLE: u8 = 1;
/// A request is being answered.
const BUSY: u8 = 2;

struct Conn {
    state: AtomicU8,
    /// Cancelled to close the connection for room.
    evict: CancellationToken,
}

/// The places of the listener's connections, oldest first.
struct Slots {
    cap: usize,
    open: Mutex<Open>,
    /// A place freed, or a connection's state changed.
    changed: Notify,
    /// Connections accepted (tests).
    accepted: AtomicU64,
}

#[derive(Default)]
struct Open {
    next: u64,
    conns: BTreeMap<u64, Arc<Conn>>,
}

impl Slots {
    fn new(cap: usize) -> Self {
        Self {
            cap: cap.max(1),
            open: Mutex::default(),
            changed: Notify::new(),
            accepted: AtomicU64::new(0),
        }
    }

    /// Connections holding a place.
    #[cfg_attr(not(test), allow(dead_code))]
    fn open(&self) -> usize {
        lock(&self.open).conns.len()
    }

    /// A place for a new connection: a free one, else the one of the connection that has waited
    /// longest for a request, once it is closed.
    async fn admit(self: &Arc<Self>) -> Slot {
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if let Some(slot) = self.try_admit() {
                return slot;
            }
            changed.await;
        }
    }

    fn try_admit(self: &Arc<Self>) -> Option<Slot> {
        let mut open = lock(&self.open);
        if open.conns.len() < self.cap {
            let id = open.next;
            open.next += 1;
            let conn = Arc::new(Conn {
                state: AtomicU8::new(NEW),
                evict: CancellationToken::new(),
            });
            open.conns.insert(id, conn.clone());
            return Some(Slot {
                id,
                tracker: Tracker {
                    slots: self.clone(),
                    conn,
                },
            });
        }
        // One closing at a time: its place goes to this connection.
        if open.conns.values().any(|c| c.evict.is_cancelled()) {
            return None;
        }
        // Lowest id first: the oldest.
        if let Some(c) = open
            .conns
            .values()
            .find(|c| c.state.load(Ordering::Acquire) == IDLE)
        {
            c.evict.cancel();
        }
        None
    }
}

/// Marks its connection's state, waking the accept loop waiting for a place.
#[derive(Clone)]
struct Tracker {
    slots: Arc<Slots>,
    conn: Arc<Conn>,
}

impl Tracker {
    fn set(&self, state: u8) {
        self.conn.state.store(state, Ordering::Release);
        self.slots.changed.notify_waiters();
    }

    /// Busy until the guard is dropped.
    fn busy(&self) -> Busy {
        self.set(BUSY);
        Busy(self.clone())
    }
}

struct Busy(Tracker);

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.set(IDLE);
    }
}

/// A connection's place; freed when dropped.
struct Slot {
    id: u64,
    tracker: Tracker,
}

impl Drop for Slot {
    fn drop(&mut self) {
        lock(&self.tracker.slots.open).conns.remove(&self.id);
        self.tracker.slots.changed.notify_waiters();
    }
}

/// What to do after a failed accept.
#[derive(Debug, PartialEq, Eq)]
struct Failed {
    /// How long to wait before accepting again.
    pause: Duration,
    /// Warn now, with this many failures since the last warning.
    log: Option<u64>,
}

/// The pause and the warnings after failed accepts in a row.
#[derive(Debug, Default)]
struct AcceptBackoff {
    /// The last pause; none after a success.
    pause: Option<Duration>,
    /// Failures in a row.
    errors: u64,
    /// Failures since the last warning, and when that was.
    unlogged: u64,
    logged: Option<Instant>,
    /// Whether this run of failures was warned of.
    warned: bool,
}

impl AcceptBackoff {
    /// A failed accept at `now`. A peer that went away before its connection was accepted
    /// leaves nothing pending: accept again at once. Anything else (out of descriptors or
    /// memory) would fail again at once: pause.
    fn failed(&mut self, e: &std::io::Error, now: Instant) -> Failed {
        use std::io::ErrorKind::{ConnectionAborted, ConnectionReset, Interrupted};
        self.errors += 1;
        self.unlogged += 1;
        let pause = if matches!(e.kind(), ConnectionAborted | ConnectionReset | Interrupted) {
            Duration::ZERO
        } else {
            let next = self
                .pause
                .map_or(ACCEPT_BACKOFF_FIRST, |p| (p * 2).min(ACCEPT_BACKOFF_MAX));
            self.pause = Some(next);
            next
        };
        let log = self
            .logged
            .is_none_or(|at| now.saturating_duration_since(at) >= ACCEPT_LOG_EVERY)
            .then(|| {
                self.logged = Some(now);
                self.warned = true;
                std::mem::take(&mut self.unlogged)
            });
        Failed { pause, log }
    }

    /// An accept succeeded: the next failure starts from the first pause. The failures in a
    /// row that this ends, if any were warned of.
    fn succeeded(&mut self) -> Option<u64> {
        self.pause = None;
        let errors = std::mem::take(&mut self.errors);
        std::mem::take(&mut self.warned).then_some(errors)
    }
}

#[cfg(test)]
mod tests;
