//! Prometheus metrics on `/metrics`, and the probes `/healthz` (the process serves) and `/readyz`
//! (the plugin is registered and the first publish went through), on `--metrics-address`.
//!
//! Counters are plain atomics owned by one [`Metrics`] value shared behind an `Arc`; rendering
//! reads them without locks, so scraping never contends with prepare. Each count exists once:
//! the publisher bumps the [`SliceCounters`] this value holds, and both `/metrics` and the
//! publisher's own handle read them.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use kubelet_plugin::publisher::SliceCounters;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// Upper bounds (seconds) of the latency histogram buckets.
const BUCKETS: [f64; 12] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0,
];

/// A latency histogram with fixed buckets.
#[derive(Debug, Default)]
pub struct Histogram {
    buckets: [AtomicU64; BUCKETS.len()],
    count: AtomicU64,
    sum_micros: AtomicU64,
}

impl Histogram {
    pub fn observe(&self, d: Duration) {
        let secs = d.as_secs_f64();
        for (bound, bucket) in BUCKETS.iter().zip(&self.buckets) {
            if secs <= *bound {
                bucket.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_micros.fetch_add(
            u64::try_from(d.as_micros()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
    }

    fn render(&self, out: &mut String, name: &str, labels: &str) {
        let sep = if labels.is_empty() { "" } else { "," };
        for (bound, bucket) in BUCKETS.iter().zip(&self.buckets) {
            let _ = writeln!(
                out,
                "{name}_bucket{{{labels}{sep}le=\"{bound}\"}} {}",
                bucket.load(Ordering::Relaxed)
            );
        }
        let count = self.count.load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {count}");
        let sum = self.sum_micros.load(Ordering::Relaxed) as f64 / 1e6;
        let braces = |s: &str| {
            if s.is_empty() {
                String::new()
            } else {
                format!("{{{s}}}")
            }
        };
        let _ = writeln!(out, "{name}_sum{} {sum}", braces(labels));
        let _ = writeln!(out, "{name}_count{} {count}", braces(labels));
    }
}

/// Everything nvdra reports.
#[derive(Debug, Default)]
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
    /// Free-form build info labels (version, backend, mode).
    info: Mutex<BTreeMap<&'static str, String>>,
}

impl Metrics {
    pub fn new() -> Arc<Self> {
        let m = Self::default();
        m.set_info("version", env!("CARGO_PKG_VERSION"));
        Arc::new(m)
    }

    pub fn set_info(&self, key: &'static str, value: impl Into<String>) {
        self.info
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key, value.into());
    }

    /// Ready once the kubelet accepted the registration and the slices are published.
    pub fn ready(&self) -> bool {
        self.registered.load(Ordering::Relaxed) && self.slices.published.load(Ordering::Relaxed)
    }

    /// The Prometheus text exposition format, version 0.0.4.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let info: Vec<String> = self
            .info
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|(k, v)| format!("{k}=\"{}\"", escape(v)))
            .collect();
        let _ = writeln!(out, "# HELP nvdra_build_info Build and run information.");
        let _ = writeln!(out, "# TYPE nvdra_build_info gauge");
        let _ = writeln!(out, "nvdra_build_info{{{}}} 1", info.join(","));

        for (name, help, pairs) in [
            (
                "nvdra_prepare_claims_total",
                "Claims handled by NodePrepareResources, by result.",
                [(&self.prepare_ok, "ok"), (&self.prepare_failed, "error")],
            ),
            (
                "nvdra_unprepare_claims_total",
                "Claims handled by NodeUnprepareResources, by result.",
                [
                    (&self.unprepare_ok, "ok"),
                    (&self.unprepare_failed, "error"),
                ],
            ),
        ] {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} counter");
            for (c, result) in pairs {
                let _ = writeln!(out, "{name}{{result=\"{result}\"}} {}", load(c));
            }
        }
        for (name, help, h) in [
            (
                "nvdra_prepare_duration_seconds",
                "Time to prepare one claim.",
                &self.prepare_seconds,
            ),
            (
                "nvdra_unprepare_duration_seconds",
                "Time to unprepare one claim.",
                &self.unprepare_seconds,
            ),
        ] {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} histogram");
            h.render(&mut out, name, "");
        }
        let _ = writeln!(
            out,
            "# HELP nvdra_resourceslice_writes_total ResourceSlice writes to the API server, by operation."
        );
        let _ = writeln!(out, "# TYPE nvdra_resourceslice_writes_total counter");
        for (op, c) in [
            ("create", &self.slices.creates),
            ("update", &self.slices.updates),
            ("delete", &self.slices.deletes),
        ] {
            let _ = writeln!(
                out,
                "nvdra_resourceslice_writes_total{{operation=\"{op}\"}} {}",
                load(c)
            );
        }
        for (name, help, kind, value) in [
            (
                "nvdra_api_errors_total",
                "Failed ResourceSlice reconciles (API server errors and conflicts).",
                "counter",
                load(&self.slices.errors),
            ),
            (
                "nvdra_gpus",
                "GPUs in the inventory.",
                "gauge",
                load(&self.gpus),
            ),
            (
                "nvdra_unhealthy_devices",
                "Devices currently unhealthy.",
                "gauge",
                load(&self.unhealthy_devices),
            ),
            (
                "nvdra_ready",
                "1 when registered with the kubelet and slices are published.",
                "gauge",
                u64::from(self.ready()),
            ),
        ] {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} {kind}");
            let _ = writeln!(out, "{name} {value}");
        }
        out
    }
}

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn respond(metrics: &Metrics, req: &Request<Incoming>) -> Response<Full<Bytes>> {
    let text = |status: StatusCode, body: String, ctype: &'static str| {
        let mut r = Response::new(Full::new(Bytes::from(body)));
        *r.status_mut() = status;
        if let Ok(v) = hyper::header::HeaderValue::from_str(ctype) {
            r.headers_mut().insert(hyper::header::CONTENT_TYPE, v);
        }
        r
    };
    if req.method() != Method::GET && req.method() != Method::HEAD {
        return text(
            StatusCode::METHOD_NOT_ALLOWED,
            "only GET\n".into(),
            "text/plain",
        );
    }
    match req.uri().path() {
        "/metrics" => text(
            StatusCode::OK,
            metrics.render(),
            "text/plain; version=0.0.4",
        ),
        "/healthz" => text(StatusCode::OK, "ok\n".into(), "text/plain"),
        "/readyz" if metrics.ready() => text(StatusCode::OK, "ready\n".into(), "text/plain"),
        "/readyz" => {
            let mut why = Vec::new();
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
                let resp = respond(&metrics, &req);
                async move { Ok::<_, std::convert::Infallible>(resp) }
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
        let h = Histogram::default();
        h.observe(Duration::from_micros(300));
        h.observe(Duration::from_millis(3));
        h.observe(Duration::from_secs(10));
        let mut out = String::new();
        h.render(&mut out, "x", "");
        assert!(out.contains("x_bucket{le=\"0.0005\"} 1\n"), "{out}");
        assert!(out.contains("x_bucket{le=\"0.005\"} 2\n"), "{out}");
        assert!(out.contains("x_bucket{le=\"5\"} 2\n"), "{out}");
        assert!(out.contains("x_bucket{le=\"+Inf\"} 3\n"), "{out}");
        assert!(out.contains("x_count 3\n"), "{out}");
        assert!(out.contains("x_sum 10.0033\n"), "{out}");
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

        shutdown.cancel();
        task.await.unwrap();
    }
}
