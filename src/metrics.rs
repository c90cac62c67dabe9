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
//!
//! The listener ([`server`]) is open to the pod network: it caps its connections, times out
//! slow ones, backs off when accepts fail, and renders scrapes on a thread of its own (at most
//! once a second, whoever asks), never on the blocking pool that prepares use.

pub mod attribution;
pub mod families;
pub mod server;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use crate::inventory::switch_blocks::SwitchBlocks;
use std::time::Duration;

use crate::lock::lock;
use kubelet_plugin::publisher::SliceCounters;

pub use families::{Allocation, Scrape};
use families::{HistogramValue, Snapshot};
pub use server::{bind, serve};

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
/// (NVML); the server calls it on its renderer thread, with no tokio runtime.
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
    /// Free-form build info labels (version, backend, mode).
    info: Mutex<BTreeMap<&'static str, String>>,
    /// The GPUs whose MIG mode the DRA plugin will not switch now (dynamic MIG): shared with
    /// the plugin, which records them in it.
    pub switch_blocks: SwitchBlocks,
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

    /// The Prometheus text exposition format, version 0.0.4, with what `source` reads besides
    /// the counters (the daemon's [`attribution::Attribution`]). Blocking: it reads the source.
    pub fn render(&self, source: Option<&dyn Source>) -> String {
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
            switch_blocks: self
                .switch_blocks
                .all()
                .into_iter()
                .map(|(gpu, block)| (gpu.to_string(), block_reason(&block)))
                .collect(),
            cdi_hook: cdi_hook_row(),
            scrape: source.map(|s| s.scrape()),
        };
        encode(snapshot)
    }
}

/// The CDI hook binary discovery found last and the hooks left out for it.
fn cdi_hook_row() -> Option<families::HookBinaryRow> {
    let (path, check) = crate::cdi::toolkit::last_check()?;
    Some(families::HookBinaryRow {
        path: path.display().to_string(),
        version: check.version_label(),
        left_out: check.left_out(),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let m = Metrics::default();
        m.prepare_seconds.observe(Duration::from_micros(300));
        m.prepare_seconds.observe(Duration::from_millis(3));
        m.prepare_seconds.observe(Duration::from_secs(10));
        let out = m.render(None);
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
        let text = m.render(None);
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

    /// The gauge follows the owner's publications: each GPU the share-daemon watch asked in
    /// its last round, as the published health carries it.
    #[test]
    fn each_gpu_with_shares_has_its_daemon_up_gauge() {
        use crate::inventory::{DeviceUuid, GpuUuid, owner};
        let sim = crate::inventory::sim::SimBackend::from_profile("dgx-h100", "n").unwrap();
        let (tx, node) = tokio::sync::watch::channel(owner::Published::default());
        // Live readings through an owner's handle over `sim`; the publications are the test's.
        let hour = std::time::Duration::from_secs(3600);
        let (_owner, readings) = owner::Owner::new(Arc::new(sim), hour, owner::DEADLINE).unwrap();
        let source = attribution::Attribution::new(node, readings);
        let round = |answers: &[(&str, bool)]| {
            tx.send_modify(|p| {
                p.health.daemons_asked = answers
                    .iter()
                    .map(|(g, up)| (DeviceUuid::Gpu(GpuUuid((*g).into())), *up))
                    .collect();
            })
        };
        let m = Metrics::new();
        let text = m.render(Some(&source));
        assert!(
            !text.lines().any(|l| l.starts_with("nvdra_mps_daemon_up{")),
            "no GPU with shares, no sample: {text}"
        );
        round(&[("GPU-a", true), ("GPU-b", false)]);
        let text = m.render(Some(&source));
        let samples: Vec<&str> = text.lines().filter(|l| !l.starts_with('#')).collect();
        for want in [
            "nvdra_mps_daemon_up{gpu=\"GPU-a\"} 1",
            "nvdra_mps_daemon_up{gpu=\"GPU-b\"} 0",
        ] {
            assert!(samples.contains(&want), "no sample {want:?} in {text}");
        }
        // A GPU whose last share went leaves the metric.
        round(&[("GPU-b", true)]);
        let text = m.render(Some(&source));
        assert!(!text.contains("gpu=\"GPU-a\""), "{text}");
    }

    #[test]
    fn each_gpu_whose_mig_mode_is_not_switched_has_its_blocked_gauge() {
        use crate::inventory::{GpuUuid, Holder, HolderKind, SwitchBlock};
        let m = Metrics::new();
        let blocks = m.switch_blocks.clone();
        let text = m.render(None);
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
        let text = m.render(None);
        let samples: Vec<&str> = text.lines().filter(|l| !l.starts_with('#')).collect();
        for want in [
            "nvdra_mig_switch_blocked{gpu=\"GPU-a\",reason=\"reset_required\"} 1",
            "nvdra_mig_switch_blocked{gpu=\"GPU-b\",reason=\"in_use\"} 1",
        ] {
            assert!(samples.contains(&want), "no sample {want:?} in {text}");
        }
        // A block cleared leaves the metric.
        blocks.clear(&b);
        let text = m.render(None);
        assert!(!text.contains("GPU-b"), "{text}");
        assert!(text.contains("GPU-a"), "{text}");
    }
}
