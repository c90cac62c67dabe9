use super::*;
use crate::metrics::Scrape;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Polls until `cond` holds; panics naming `what` after 30 s (a bound on a failure, not a speed).
mod wait {
    pub async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
        let poll = async {
            while !cond() {
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            }
        };
        if tokio::time::timeout(std::time::Duration::from_secs(30), poll)
            .await
            .is_err()
        {
            panic!("waited 30s for {what}, in vain");
        }
    }
}

/// A scrape that reads no further until the test lets it (one message per scrape); `entered`
/// once it is stuck; `calls` counts the scrapes.
#[derive(Default)]
struct StuckSource {
    entered: Arc<std::sync::atomic::AtomicBool>,
    calls: Arc<AtomicU64>,
    release: Option<Mutex<std::sync::mpsc::Receiver<()>>>,
}

impl StuckSource {
    /// The source, and what lets its scrapes go.
    fn new() -> (Self, std::sync::mpsc::Sender<()>) {
        let (release, stuck) = std::sync::mpsc::channel();
        let source = Self {
            release: Some(Mutex::new(stuck)),
            ..Self::default()
        };
        (source, release)
    }
}

impl Source for StuckSource {
    fn scrape(&self) -> Scrape {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.entered.store(true, Ordering::SeqCst);
        if let Some(release) = &self.release {
            let _ = lock(release).recv();
        }
        Scrape::default()
    }
}

struct Server {
    addr: SocketAddr,
    slots: Arc<Slots>,
    shutdown: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl Server {
    async fn start(metrics: Arc<Metrics>, source: Option<Arc<dyn Source>>, limits: Limits) -> Self {
        let listener = bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let slots = Arc::new(Slots::new(limits.connections));
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(serve_on(
            listener,
            metrics,
            source,
            limits,
            slots.clone(),
            shutdown.clone(),
        ));
        Self {
            addr,
            slots,
            shutdown,
            task,
        }
    }

    async fn stop(self) {
        self.shutdown.cancel();
        self.task.await.unwrap();
    }

    /// Connections in the state `state`.
    fn count(&self, state: u8) -> usize {
        lock(&self.slots.open)
            .conns
            .values()
            .filter(|c| c.state.load(Ordering::SeqCst) == state)
            .count()
    }
}

async fn get(addr: SocketAddr, path: &str) -> String {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes())
        .await
        .unwrap();
    read_all(&mut s).await
}

async fn read_all(s: &mut TcpStream) -> String {
    let mut buf = Vec::new();
    // A reset (the server closed with unread input) ends the answer as an EOF does.
    let _ = s.read_to_end(&mut buf).await;
    String::from_utf8_lossy(&buf).into_owned()
}

/// One request on a kept-alive connection and its whole answer (head and body).
async fn request_on(s: &mut TcpStream, path: &str) -> String {
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut buf = Vec::new();
    loop {
        let mut chunk = [0u8; 4096];
        let n = s.read(&mut chunk).await.unwrap();
        assert!(n > 0, "the connection closed mid-answer: {buf:?}");
        buf.extend_from_slice(&chunk[..n]);
        let text = String::from_utf8_lossy(&buf).into_owned();
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let len: usize = head
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length: ")
                        .map(|v| v.trim().parse().unwrap())
                })
                .expect("a content-length");
            if body.len() >= len {
                return text;
            }
        }
    }
}

/// Whether the server closed `s`: the next read ends (EOF or reset) instead of waiting.
async fn closed(s: &mut TcpStream) -> bool {
    let mut b = [0u8; 1];
    !matches!(s.read(&mut b).await, Ok(n) if n > 0)
}

/// The kubelet's probes never wait behind a scrape: with the only blocking thread held by
/// a scrape stuck in the hardware, `/healthz` and `/readyz` still answer at once.
#[test]
fn the_probes_answer_while_a_scrape_is_stuck() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .max_blocking_threads(1)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let m = Metrics::new();
        let (source, release) = StuckSource::new();
        let entered = source.entered.clone();
        let source: Arc<dyn Source> = Arc::new(source);
        // The blocking pool's one thread is taken for as long as the test runs: scrapes must
        // not need it.
        let (hold, held) = std::sync::mpsc::channel::<()>();
        let blocker = tokio::task::spawn_blocking(move || held.recv());
        let server = Server::start(m.clone(), Some(source), Limits::default()).await;
        let addr = server.addr;
        let scrape = tokio::spawn(async move { get(addr, "/metrics").await });
        wait::eventually("the scrape to start", || entered.load(Ordering::SeqCst)).await;
        // Not registered yet: ready says no, and why.
        for (path, want) in [("/healthz", "HTTP/1.1 200"), ("/readyz", "HTTP/1.1 503")] {
            let r = tokio::time::timeout(Duration::from_secs(5), get(addr, path))
                .await
                .unwrap_or_else(|_| panic!("{path} waited behind the stuck scrape"));
            assert!(r.starts_with(want), "{path}: {r}");
        }
        assert!(!scrape.is_finished(), "the scrape answered while stuck");
        release.send(()).unwrap();
        let r = scrape.await.unwrap();
        assert!(r.starts_with("HTTP/1.1 200"), "{r}");
        hold.send(()).unwrap();
        blocker.await.unwrap().unwrap();
        server.stop().await;
    });
}

#[tokio::test]
async fn endpoints_answer_and_readiness_follows_state() {
    let m = Metrics::new();
    let server = Server::start(m.clone(), None, Limits::default()).await;
    let addr = server.addr;

    assert!(get(addr, "/healthz").await.starts_with("HTTP/1.1 200"));
    let r = get(addr, "/readyz").await;
    assert!(r.starts_with("HTTP/1.1 503"), "{r}");
    assert!(r.contains("not registered with the kubelet"), "{r}");
    m.registered.store(true, Ordering::Relaxed);
    let r = get(addr, "/readyz").await;
    assert!(r.contains("ResourceSlices not published yet"), "{r}");
    m.slices.published.store(true, Ordering::Relaxed);
    assert!(get(addr, "/readyz").await.starts_with("HTTP/1.1 200"));
    let r = get(addr, "/metrics").await;
    // The sample line, not the HELP line ("# HELP nvdra_ready 1 when registered ...").
    assert!(r.lines().any(|l| l == "nvdra_ready 1"), "{r}");
    assert!(r.contains("content-type: text/plain; version=0.0.4"), "{r}");
    assert!(get(addr, "/nope").await.starts_with("HTTP/1.1 404"));
    // A task that stopped unexpectedly: not ready again, and it is named.
    m.set_stopped("checkpoint-writer", "ended");
    let r = get(addr, "/readyz").await;
    assert!(r.starts_with("HTTP/1.1 503"), "{r}");
    assert!(r.contains("task checkpoint-writer stopped: ended"), "{r}");

    // Shutdown closes what is still open.
    let mut idle = TcpStream::connect(addr).await.unwrap();
    wait::eventually("the idle connection to be served", || {
        server.count(IDLE) == 1
    })
    .await;
    server.stop().await;
    assert!(closed(&mut idle).await);
}

/// Scrapes that arrive while a render is under way wait for it: five scrapes, one render.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_scrapes_share_one_render() {
    let m = Metrics::new();
    let (source, release) = StuckSource::new();
    let (entered, calls) = (source.entered.clone(), source.calls.clone());
    let source: Arc<dyn Source> = Arc::new(source);
    let server = Server::start(m.clone(), Some(source), Limits::default()).await;
    let addr = server.addr;
    let first = tokio::spawn(async move { get(addr, "/metrics").await });
    wait::eventually("the first scrape to start", || {
        entered.load(Ordering::SeqCst)
    })
    .await;
    let more: Vec<_> = (0..4)
        .map(|_| tokio::spawn(async move { get(addr, "/metrics").await }))
        .collect();
    wait::eventually("all five scrapes to wait", || server.count(BUSY) == 5).await;
    release.send(()).unwrap();
    let first = first.await.unwrap();
    assert!(first.starts_with("HTTP/1.1 200"), "{first}");
    let body = |r: &str| r.split_once("\r\n\r\n").unwrap().1.to_string();
    for r in more {
        let r = r.await.unwrap();
        assert!(r.starts_with("HTTP/1.1 200"), "{r}");
        assert_eq!(body(&r), body(&first));
    }
    assert_eq!(calls.load(Ordering::SeqCst), 1, "one render for all five");
    // Within the cache interval, a new scrape is answered from the same render too (the
    // source would block it otherwise: nothing more is sent on `release`).
    let r = get(addr, "/metrics").await;
    assert!(r.starts_with("HTTP/1.1 200"), "{r}");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    drop(release);
    server.stop().await;
}

/// With every scrape place waiting on a stuck render, one more scrape is refused at once, and
/// a probe still answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scrapes_over_the_cap_are_refused_at_once() {
    let m = Metrics::new();
    let (source, release) = StuckSource::new();
    let source: Arc<dyn Source> = Arc::new(source);
    let limits = Limits {
        waiting_scrapes: 2,
        ..Limits::default()
    };
    let server = Server::start(m.clone(), Some(source), limits).await;
    let addr = server.addr;
    let waiting: Vec<_> = (0..2)
        .map(|_| tokio::spawn(async move { get(addr, "/metrics").await }))
        .collect();
    wait::eventually("two scrapes to wait", || server.count(BUSY) == 2).await;
    let r = get(addr, "/metrics").await;
    assert!(r.starts_with("HTTP/1.1 503"), "{r}");
    assert!(r.contains("too many scrapes at once"), "{r}");
    assert!(get(addr, "/healthz").await.starts_with("HTTP/1.1 200"));
    release.send(()).unwrap();
    for r in waiting {
        let r = r.await.unwrap();
        assert!(r.starts_with("HTTP/1.1 200"), "{r}");
    }
    drop(release);
    server.stop().await;
}

/// A render stuck in the hardware answers `503` after [`RENDER_WAIT`], not never.
#[tokio::test(start_paused = true)]
async fn a_stuck_render_answers_unavailable_after_the_render_wait() {
    let m = Metrics::new();
    let (source, release) = StuckSource::new();
    let source: Arc<dyn Source> = Arc::new(source);
    let server = Server::start(m.clone(), Some(source), Limits::default()).await;
    let start = tokio::time::Instant::now();
    let r = get(server.addr, "/metrics").await;
    assert!(r.starts_with("HTTP/1.1 503"), "{r}");
    assert!(r.contains("took longer than 10s to render"), "{r}");
    assert!(start.elapsed() >= RENDER_WAIT);
    drop(release);
    server.stop().await;
}

/// Slowloris: half a request head, then nothing. The connection is closed after
/// [`HEADER_TIMEOUT`] (paused time: the clock only moves when everything waits).
#[tokio::test(start_paused = true)]
async fn half_a_head_is_closed_after_the_header_timeout() {
    let server = Server::start(Metrics::new(), None, Limits::default()).await;
    let mut s = TcpStream::connect(server.addr).await.unwrap();
    s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        .await
        .unwrap();
    let start = tokio::time::Instant::now();
    let r = read_all(&mut s).await;
    let waited = start.elapsed();
    assert!(!r.contains("200"), "{r}");
    assert!(
        waited >= HEADER_TIMEOUT && waited < CONNECTION_LIFETIME,
        "closed after {waited:?}"
    );
    // Its place is free again.
    wait::eventually("the place to be freed", || server.slots.open() == 0).await;
    server.stop().await;
}

/// A kept-alive connection that sends nothing more is closed after [`HEADER_TIMEOUT`]: the
/// header timeout runs again while it waits for the next request.
#[tokio::test(start_paused = true)]
async fn an_idle_kept_alive_connection_is_closed_after_the_header_timeout() {
    let server = Server::start(Metrics::new(), None, Limits::default()).await;
    let mut s = TcpStream::connect(server.addr).await.unwrap();
    for _ in 0..2 {
        let r = request_on(&mut s, "/healthz").await;
        assert!(r.starts_with("HTTP/1.1 200"), "{r}");
    }
    let start = tokio::time::Instant::now();
    assert!(closed(&mut s).await);
    let waited = start.elapsed();
    assert!(
        waited >= HEADER_TIMEOUT && waited < CONNECTION_LIFETIME,
        "closed after {waited:?}"
    );
    server.stop().await;
}

/// A connection that keeps asking, within the header timeout each time, is still closed once
/// [`CONNECTION_LIFETIME`] is up.
#[tokio::test(start_paused = true)]
async fn a_busy_connection_is_closed_at_the_end_of_its_lifetime() {
    let server = Server::start(Metrics::new(), None, Limits::default()).await;
    let mut s = TcpStream::connect(server.addr).await.unwrap();
    let start = tokio::time::Instant::now();
    let mut answered = 0;
    loop {
        let _ = s
            .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            .await;
        let mut buf = [0u8; 1024];
        match s.read(&mut buf).await {
            Ok(n) if n > 0 => answered += 1,
            _ => break,
        }
        tokio::time::sleep(HEADER_TIMEOUT / 2).await;
    }
    let lived = start.elapsed();
    assert!(answered > 1, "{answered}");
    assert!(lived >= CONNECTION_LIFETIME, "closed after {lived:?}");
    server.stop().await;
}

/// With every place taken by connections that send nothing, a new connection takes the place
/// of the oldest, and a probe is answered; the connections never outnumber the places.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_connection_takes_the_place_of_the_oldest_idle_one() {
    let limits = Limits {
        connections: 3,
        ..Limits::default()
    };
    let server = Server::start(Metrics::new(), None, limits).await;
    let addr = server.addr;
    let mut idle = Vec::new();
    for _ in 0..3 {
        idle.push(TcpStream::connect(addr).await.unwrap());
    }
    wait::eventually("three idle connections", || server.count(IDLE) == 3).await;
    let mut fourth = TcpStream::connect(addr).await.unwrap();
    assert!(closed(&mut idle[0]).await, "the oldest was closed for room");
    wait::eventually("the fourth to be served", || {
        server.slots.accepted.load(Ordering::SeqCst) == 4 && server.count(IDLE) == 3
    })
    .await;
    assert_eq!(server.slots.open(), 3);
    // The kubelet's probe gets in too, in the second one's place.
    let r = get(addr, "/healthz").await;
    assert!(r.starts_with("HTTP/1.1 200"), "{r}");
    assert!(
        closed(&mut idle[1]).await,
        "the next oldest was closed for room"
    );
    // The third is still served: room is made oldest first.
    let r = request_on(&mut idle[2], "/healthz").await;
    assert!(r.starts_with("HTTP/1.1 200"), "{r}");
    let r = request_on(&mut fourth, "/readyz").await;
    assert!(r.starts_with("HTTP/1.1 503"), "{r}");
    assert!(server.slots.open() <= 3);
    server.stop().await;
}

/// With every place answering a request, a new connection is accepted but gets no place (no
/// task) until one is free; then it is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_the_cap_a_connection_waits_for_a_place() {
    let m = Metrics::new();
    let (source, release) = StuckSource::new();
    let source: Arc<dyn Source> = Arc::new(source);
    let limits = Limits {
        connections: 2,
        waiting_scrapes: 2,
        ..Limits::default()
    };
    let server = Server::start(m, Some(source), limits).await;
    let addr = server.addr;
    let scrapes: Vec<_> = (0..2)
        .map(|_| tokio::spawn(async move { get(addr, "/metrics").await }))
        .collect();
    wait::eventually("two scrapes to wait", || server.count(BUSY) == 2).await;
    let probe = tokio::spawn(async move { get(addr, "/healthz").await });
    wait::eventually("the third connection to be accepted", || {
        server.slots.accepted.load(Ordering::SeqCst) == 3
    })
    .await;
    // Accepted, and still no place: the places are the two busy ones.
    assert_eq!(server.slots.open(), 2);
    assert_eq!(server.count(BUSY), 2);
    assert!(!probe.is_finished());
    release.send(()).unwrap();
    for r in scrapes {
        assert!(r.await.unwrap().starts_with("HTTP/1.1 200"));
    }
    let r = probe.await.unwrap();
    assert!(r.starts_with("HTTP/1.1 200"), "{r}");
    drop(release);
    server.stop().await;
}

fn emfile() -> std::io::Error {
    std::io::Error::from_raw_os_error(libc::EMFILE)
}

#[test]
fn accept_errors_back_off_doubling_to_a_second_and_warn_rarely() {
    let mut b = AcceptBackoff::default();
    let t0 = Instant::now();
    let mut pauses = Vec::new();
    let mut warnings = Vec::new();
    for i in 0..10u32 {
        let f = b.failed(&emfile(), t0 + Duration::from_millis(100) * i);
        pauses.push(f.pause.as_millis());
        warnings.push(f.log);
    }
    assert_eq!(pauses, [10, 20, 40, 80, 160, 320, 640, 1000, 1000, 1000]);
    // The first failure warns; the next nine within 10 s do not.
    assert_eq!(warnings[0], Some(1));
    assert!(warnings[1..].iter().all(Option::is_none), "{warnings:?}");
    // 10 s after the last warning: one warning counting the failures since.
    let f = b.failed(&emfile(), t0 + ACCEPT_LOG_EVERY);
    assert_eq!(f.log, Some(10));
    assert_eq!(f.pause, ACCEPT_BACKOFF_MAX);
    // A success ends the run (and says so, as it was warned of), and the pause starts over.
    assert_eq!(b.succeeded(), Some(11));
    assert_eq!(b.succeeded(), None);
    let f = b.failed(&emfile(), t0 + ACCEPT_LOG_EVERY + Duration::from_secs(1));
    assert_eq!(f.pause, ACCEPT_BACKOFF_FIRST);
    assert_eq!(f.log, None, "still within 10 s of the last warning");
    // Flapping within the interval warns of nothing, so it does not say it recovered either.
    assert_eq!(b.succeeded(), None);
}

#[test]
fn a_peer_that_went_away_is_not_a_reason_to_pause() {
    let mut b = AcceptBackoff::default();
    let aborted = std::io::Error::from(std::io::ErrorKind::ConnectionAborted);
    assert_eq!(b.failed(&aborted, Instant::now()).pause, Duration::ZERO);
    // Nor does it count as a pause to double.
    assert_eq!(
        b.failed(&emfile(), Instant::now()).pause,
        ACCEPT_BACKOFF_FIRST
    );
}
