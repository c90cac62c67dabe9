//! Prometheus metrics on `/metrics`, and the probes `/healthz` (the process serves) and `/readyz`
//! (the plugin is registered and the first publish went through), on `--metrics-address`.
//!
//! Counters are plain atomics owned by one [`Metrics`] value shared behind an `Arc`; rendering
//! reads them without locks, so scraping never contends with prepare. Each count exists once:
//! the publisher bumps the [`SliceCounters`] this value holds, and both `/metrics` and the
//! publisher's own handle read them.
//!
//! Who holds which GPU, and what the GPUs are doing, is read at scrape time from a [`Source`]
//! ([`attribution::Attribution`]: the ledger, the device plugin's holds, the backend's live
//! readings, the health monitor's XID counts, `/proc` for PIDs' pods). A scrape copies the
//! ledger under its lock and reads everything else after. The text is written by
//! `prometheus-client` ([`families`]).

pub mod attribution;
pub mod families;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use crate::lock::lock;
use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use kubelet_plugin::publisher::SliceCounters;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub use families::{Allocation, Scrape};
use families::{HistogramValue, Snapshot};

/// Upper bounds (seconds) of the latency histogram buckets.
const BUCKETS: [f64; 12] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0,
];

/// A latency histogram with fixed buckets: lock-free observations.
#[derive(Debug, Default)]
pub struct Histogram {
    /// Observations per bucket: each lands in the first bucket that holds it, or in none
    /// (above the last bound; `+Inf` is the count).
    buckets: [AtomicU64; BUCKETS.len()],
    count: AtomicU64,
    sum_micros: AtomicU64,
}

impl Histogram {
    pub fn observe(&self, d: Duration) {
        let secs = d.as_secs_f64();
        if let Some(i) = BUCKETS.iter().position(|bound| secs <= *bound) {
            self.buckets[i].fetch_add(1, Ordering::Relaxed);
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_micros.fetch_add(
            u64::try_from(d.as_micros()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
    }

    fn value(&self) -> HistogramValue {
        HistogramValue {
            buckets: std::array::from_fn(|i| self.buckets[i].load(Ordering::Relaxed)),
            sum_seconds: self.sum_micros.load(Ordering::Relaxed) as f64 / 1e6,
            count: self.count.load(Ordering::Relaxed),
        }
    }
}

/// Reads the node for a scrape: who holds which device, and the GPUs' live readings. Blocking
/// (NVML); the server calls it off the async runtime.
pub trait Source: Send + Sync + 'static {
    fn scrape(&self) -> Scrape;
}

/// Everything nvdra reports.
#[derive(Default)]
pub struct Metrics {
    pub prepare_ok: AtomicU64,
    pub prepare_failed: AtomicU64,
    pub unprepare_ok: AtomicU64,
    pub unprepare_failed: AtomicU64,
    pub prepare_seconds: Histogram,
    pub unprepare_seconds: Histogram,
    /// Shared with the publisher (see [`SliceCounters`]).
    pub slices: Arc<SliceCounters>,
    pub gpus: AtomicU64,
    pub unhealthy_devices: AtomicU64,
    pub registered: Arc<AtomicBool>,
    /// Whether the share daemon of each GPU with shares answered the last probe, by GPU UUID
    /// ([`Metrics::set_share_daemons`]).
    share_daemons: Mutex<BTreeMap<String, bool>>,
    /// Free-form build info labels (version, backend, mode).
    info: Mutex<BTreeMap<&'static str, String>>,
    /// Set once the daemon has wired what a scrape reads ([`Metrics::set_source`]).
    source: OnceLock<Arc<dyn Source>>,
    /// The GPUs whose MIG mode the DRA plugin will not switch now (dynamic MIG), as it records
    /// them ([`Metrics::set_switch_blocks`]).
    switch_blocks: OnceLock<crate::inventory::switch_blocks::SwitchBlocks>,
    /// The first long-lived task that stopped unexpectedly, and why: never ready again.
    stopped: OnceLock<String>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Metrics {
    pub fn new() -> Arc<Self> {
        let m = Self::default();
        m.set_info("version", env!("CARGO_PKG_VERSION"));
        Arc::new(m)
    }

    pub fn set_info(&self, key: &'static str, value: impl Into<String>) {
        lock(&self.info).insert(key, value.into());
    }

    /// The daemon watch's last round: each GPU with shares and whether its daemon answered.
    /// GPUs left out (no share any more) leave the metric.
    pub fn set_share_daemons(&self, up: impl IntoIterator<Item = (String, bool)>) {
        *lock(&self.share_daemons) = up.into_iter().collect();
    }

    /// The DRA plugin's record of the GPUs whose MIG mode it will not switch now, read at each
    /// scrape (`nvdra_mig_switch_blocked`); set once (a second call is ignored).
    pub fn set_switch_blocks(&self, blocks: crate::inventory::switch_blocks::SwitchBlocks) {
        if self.switch_blocks.set(blocks).is_err() {
            tracing::warn!("the metrics already read a record of switch blocks; keeping the first");
        }
    }

    /// What every scrape reads besides the counters; set once (a second call is ignored).
    pub fn set_source(&self, source: Arc<dyn Source>) {
        if self.source.set(source).is_err() {
            tracing::warn!("the metrics already have a scrape source; keeping the first");
        }
    }

    /// A long-lived task stopped unexpectedly (the process is stopping): `/readyz` fails from
    /// now on, naming it. The first one is kept.
    pub fn set_stopped(&self, task: &str, reason: &str) {
        let _ = self.stopped.set(format!("task {task} stopped: {reason}"));
    }

    /// Ready once the kubelet accepted the registration and the slices are published, and
    /// until a task stops unexpectedly.
    pub fn ready(&self) -> bool {
        self.registered.load(Ordering::Relaxed)
            && self.slices.published.load(Ordering::Relaxed)
            && self.stopped.get().is_none()
    }

    /// The Prometheus text exposition format, version 0.0.4. Blocking: it reads the source.
    pub fn render(&self) -> String {
        let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let snapshot = Snapshot {
            info: lock(&self.info)
                .iter()
                .map(|(k, v)| (*k, v.clone()))
                .collect(),
            prepare: [load(&self.prepare_ok), load(&self.prepare_failed)],
            unprepare: [load(&self.unprepare_ok), load(&self.unprepare_failed)],
            prepare_seconds: self.prepare_seconds.value(),
            unprepare_seconds: self.unprepare_seconds.value(),
            slice_writes: [
                ("create", load(&self.slices.creates)),
                ("update", load(&self.slices.updates)),
                ("delete", load(&self.slices.deletes)),
            ],
            api_errors: load(&self.slices.errors),
            gpus: load(&self.gpus),
            unhealthy_devices: load(&self.unhealthy_devices),
            ready: self.ready(),
            share_daemons: lock(&self.share_daemons)
                .iter()
                .map(|(g, up)| (g.clone(), *up))
                .collect(),
            switch_blocks: self
                .switch_blocks
                .get()
                .map(|b| {
                    b.all()
                        .into_iter()
                        .map(|(gpu, block)| (gpu.to_string(), block_reason(&block)))
                        .collect()
                })
                .unwrap_or_default(),
            cdi_hook: cdi_hook_row(),
            scrape: self.source.get().map(|s| s.scrape()),
        };
        encode(snapshot)
    }
}

/// The CDI hook binary discovery found last and the hooks left out for it.
fn cdi_hook_row() -> Option<families::HookBinaryRow> {
    let (path, check) = crate::cdi::toolkit::last_check()?;
    let reason = check.left_out_reason();
    Some(families::HookBinaryRow {
        path: path.display().to_string(),
        version: check.version_label(),
        left_out: reason
            .map(|r| {
                crate::cdi::toolkit::GUARDED_HOOKS
                    .iter()
                    .map(|h| (*h, r.clone()))
                    .collect()
            })
            .unwrap_or_default(),
    })
}

/// The `reason` label of `nvdra_mig_switch_blocked`.
fn block_reason(block: &crate::inventory::SwitchBlock) -> &'static str {
    match block {
        crate::inventory::SwitchBlock::ResetRequired => "reset_required",
        crate::inventory::SwitchBlock::InUse { .. } => "in_use",
    }
}

/// `snapshot` in the Prometheus text format.
fn encode(snapshot: Snapshot) -> String {
    let mut registry = prometheus_client::registry::Registry::default();
    registry.register_collector(Box::new(snapshot));
    let mut out = String::new();
    // Writing to a String cannot fail, and the families encode only valid names.
    if let Err(e) = prometheus_client::encoding::prometheus_text::encode(&mut out, &registry) {
        tracing::error!(error = %e, "cannot encode the metrics");
    }
    out
}

/// The answer to `method path`. Blocking for `/metrics` (the scrape source reads the hardware);
/// the probes only read memory.
fn respond(metrics: &Metrics, method: &Method, path: &str) -> Response<Full<Bytes>> {
    let text = |status: StatusCode, body: String, ctype: &'static str| {
        let mut r = Response::new(Full::new(Bytes::from(body)));
        *r.status_mut() = status;
        if let Ok(v) = hyper::header::HeaderValue::from_str(ctype) {
            r.headers_mut().insert(hyper::header::CONTENT_TYPE, v);
        }
        r
    };
    if method != Method::GET && method != Method::HEAD {
        return text(
            StatusCode::METHOD_NOT_ALLOWED,
            "only GET\n".into(),
            "text/plain",
        );
    }
    match path {
        "/metrics" => text(
            StatusCode::OK,
            metrics.render(),
            prometheus_client::encoding::prometheus_text::CONTENT_TYPE,
        ),
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

/// Binds the metrics listener. Separate from [`serve`] so that a bad address fails at start-up.
pub async fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr).await
}

/// Serves until `shutdown` is cancelled.
pub async fn serve(listener: TcpListener, metrics: Arc<Metrics>, shutdown: CancellationToken) {
    loop {
        let (stream, _) = tokio::select! {
            () = shutdown.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!(error = %e, "metrics accept failed");
                    continue;
                }
            },
        };
        let metrics = metrics.clone();
        let shutdown = shutdown.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                let (metrics, method) = (metrics.clone(), req.method().clone());
                let path = req.uri().path().to_string();
                async move {
                    // Only a scrape reads the hardware; the probes answer from memory, here,
                    // also while the process drains and the blocking pool takes no more work.
                    if path != "/metrics" {
                        return Ok(respond(&metrics, &method, &path));
                    }
                    let resp =
                        tokio::task::spawn_blocking(move || respond(&metrics, &method, &path))
                            .await
                            .unwrap_or_else(|e| {
                                let (status, body) = if e.is_cancelled() {
                                    (StatusCode::SERVICE_UNAVAILABLE, "shutting down\n")
                                } else {
                                    tracing::error!(error = %e, "rendering the metrics panicked");
                                    (StatusCode::INTERNAL_SERVER_ERROR, "internal error\n")
                                };
                                let mut r = Response::new(Full::new(Bytes::from(body)));
                                *r.status_mut() = status;
                                r
                            });
                    Ok::<_, std::convert::Infallible>(resp)
                }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service);
            tokio::select! {
                () = shutdown.cancelled() => {}
                r = conn => if let Err(e) = r {
                    tracing::debug!(error = %e, "metrics connection ended");
                },
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[test]
    fn histogram_buckets_are_cumulative() {
        let m = Metrics::default();
        m.prepare_seconds.observe(Duration::from_micros(300));
        m.prepare_seconds.observe(Duration::from_millis(3));
        m.prepare_seconds.observe(Duration::from_secs(10));
        let out = m.render();
        let x = "nvdra_prepare_duration_seconds";
        for want in [
            format!("{x}_bucket{{le=\"0.0005\"}} 1\n"),
            format!("{x}_bucket{{le=\"0.005\"}} 2\n"),
            format!("{x}_bucket{{le=\"5\"}} 2\n"),
            format!("{x}_bucket{{le=\"+Inf\"}} 3\n"),
            format!("{x}_count 3\n"),
            format!("{x}_sum 10.0033\n"),
        ] {
            assert!(out.contains(&want), "no {want:?} in {out}");
        }
    }

    #[test]
    fn render_has_every_family_with_type_lines() {
        let m = Metrics::new();
        m.prepare_ok.fetch_add(2, Ordering::Relaxed);
        m.slices.creates.fetch_add(1, Ordering::Relaxed);
        m.slices.errors.fetch_add(3, Ordering::Relaxed);
        m.set_info("backend", "simulated \"x\"");
        let text = m.render();
        // Whole sample lines: a `# HELP` line naming the family cannot satisfy these.
        let samples: Vec<&str> = text.lines().filter(|l| !l.starts_with('#')).collect();
        for want in [
            "nvdra_prepare_claims_total{result=\"ok\"} 2",
            "nvdra_resourceslice_writes_total{operation=\"create\"} 1",
            "nvdra_api_errors_total 3",
            "nvdra_ready 0",
        ] {
            assert!(samples.contains(&want), "no sample {want:?} in {text}");
        }
        assert!(text.contains("backend=\"simulated \\\"x\\\"\""), "{text}");
        // Every sample line belongs to a family announced with # TYPE: its name is the family's,
        // or a histogram's `_bucket`, `_sum` or `_count` of it.
        let families: Vec<(&str, &str)> = text
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .filter_map(|l| l.split_once(' '))
            .collect();
        for line in &samples {
            let name = line.split(['{', ' ']).next().unwrap();
            assert!(
                families.iter().any(|&(f, kind)| name == f
                    || (kind == "histogram"
                        && ["_bucket", "_sum", "_count"]
                            .iter()
                            .any(|s| name.strip_suffix(s) == Some(f)))),
                "{name} has no TYPE line"
            );
        }
    }

    #[test]
    fn each_gpu_with_shares_has_its_daemon_up_gauge() {
        let m = Metrics::new();
        let text = m.render();
        assert!(
            !text.lines().any(|l| l.starts_with("nvdra_mps_daemon_up{")),
            "no GPU with shares, no sample: {text}"
        );
        m.set_share_daemons([("GPU-a".to_string(), true), ("GPU-b".to_string(), false)]);
        let text = m.render();
        let samples: Vec<&str> = text.lines().filter(|l| !l.starts_with('#')).collect();
        for want in [
            "nvdra_mps_daemon_up{gpu=\"GPU-a\"} 1",
            "nvdra_mps_daemon_up{gpu=\"GPU-b\"} 0",
        ] {
            assert!(samples.contains(&want), "no sample {want:?} in {text}");
        }
        // A GPU whose last share went leaves the metric.
        m.set_share_daemons([("GPU-b".to_string(), true)]);
        let text = m.render();
        assert!(!text.contains("GPU-a"), "{text}");
    }

    #[test]
    fn each_gpu_whose_mig_mode_is_not_switched_has_its_blocked_gauge() {
        use crate::inventory::{GpuUuid, Holder, HolderKind, SwitchBlock};
        let m = Metrics::new();
        let blocks = crate::inventory::switch_blocks::SwitchBlocks::default();
        m.set_switch_blocks(blocks.clone());
        let text = m.render();
        assert!(
            !text
                .lines()
                .any(|l| l.starts_with("nvdra_mig_switch_blocked{")),
            "no block, no sample: {text}"
        );
        let (a, b) = (GpuUuid("GPU-a".into()), GpuUuid("GPU-b".into()));
        blocks.set(&a, SwitchBlock::ResetRequired);
        let holders = vec![Holder {
            pid: 7,
            name: "nv-hostengine".into(),
            kind: HolderKind::Foreign,
        }];
        blocks.set(&b, SwitchBlock::InUse { holders });
        let text = m.render();
        let samples: Vec<&str> = text.lines().filter(|l| !l.starts_with('#')).collect();
        for want in [
            "nvdra_mig_switch_blocked{gpu=\"GPU-a\",reason=\"reset_required\"} 1",
            "nvdra_mig_switch_blocked{gpu=\"GPU-b\",reason=\"in_use\"} 1",
        ] {
            assert!(samples.contains(&want), "no sample {want:?} in {text}");
        }
        // A block cleared leaves the metric.
        blocks.clear(&b);
        let text = m.render();
        assert!(!text.contains("GPU-b"), "{text}");
        assert!(text.contains("GPU-a"), "{text}");
    }

    async fn get(addr: SocketAddr, path: &str) -> String {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(
            format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await
        .unwrap();
        let mut buf = String::new();
        s.read_to_string(&mut buf).await.unwrap();
        buf
    }

    /// A scrape that reads no further until the test lets it; `entered` once it is stuck.
    struct StuckSource {
        entered: Arc<std::sync::atomic::AtomicBool>,
        release: std::sync::Mutex<std::sync::mpsc::Receiver<()>>,
    }

    impl Source for StuckSource {
        fn scrape(&self) -> Scrape {
            self.entered.store(true, Ordering::SeqCst);
            let _ = lock(&self.release).recv();
            Scrape::default()
        }
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
            let (release, stuck) = std::sync::mpsc::channel();
            let entered = Arc::new(std::sync::atomic::AtomicBool::new(false));
            m.set_source(Arc::new(StuckSource {
                entered: entered.clone(),
                release: std::sync::Mutex::new(stuck),
            }));
            let listener = bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
            let addr = listener.local_addr().unwrap();
            let shutdown = CancellationToken::new();
            tokio::spawn(serve(listener, m.clone(), shutdown.clone()));
            let scrape = tokio::spawn(async move { get(addr, "/metrics").await });
            for _ in 0..500 {
                if entered.load(Ordering::SeqCst) {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            assert!(entered.load(Ordering::SeqCst), "the scrape never started");
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
            shutdown.cancel();
        });
    }

    #[tokio::test]
    async fn endpoints_answer_and_readiness_follows_state() {
        let m = Metrics::new();
        let listener = bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(serve(listener, m.clone(), shutdown.clone()));

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
        assert!(get(addr, "/nope").await.starts_with("HTTP/1.1 404"));
        // A task that stopped unexpectedly: not ready again, and it is named.
        m.set_stopped("checkpoint-writer", "ended");
        let r = get(addr, "/readyz").await;
        assert!(r.starts_with("HTTP/1.1 503"), "{r}");
        assert!(r.contains("task checkpoint-writer stopped: ended"), "{r}");

        shutdown.cancel();
        task.await.unwrap();
    }
}
