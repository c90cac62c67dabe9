//! Every family `/metrics` exports, written through `prometheus-client`'s Prometheus text
//! encoder (version 0.0.4): it owns the format — `# HELP`/`# TYPE` lines, label escaping, the
//! `_total` suffix of counters, cumulative histogram buckets — and this file owns the names.
//!
//! A [`Snapshot`] is what one scrape saw: the counters' values and the [`Scrape`] of the node
//! (allocations, GPU readings), owned, so encoding takes no lock at all.

use std::collections::BTreeMap;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

use super::BUCKETS;

/// One allocation of one device: a DRA claim's device (one per pod it is reserved for) or a
/// device-plugin container's. The labels of `nvdra_device_allocation_info`, in order.
#[derive(Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct Allocation {
    /// The DRA device name (`gpu-0`, `gpu-0-mig-1g10gb-19-0`) or, on the device-plugin path,
    /// the UUID of the GPU or MIG device the container holds.
    pub device: String,
    /// The physical GPU (the parent of a MIG device).
    pub gpu_uuid: String,
    /// The MIG profile (`1g.10gb`); empty for a whole GPU.
    pub mig_profile: String,
    pub claim_namespace: String,
    pub claim_name: String,
    pub pod_namespace: String,
    pub pod: String,
    /// Empty for a DRA claim (claims belong to pods, not containers).
    pub container: String,
    /// `dra` or `device-plugin`.
    pub path: &'static str,
    /// How the allocation shares the device, as the ledger spells the strategy (`exclusive`,
    /// `timeSlicing`, `mps`, …) or, on the device-plugin path, as its config does.
    pub sharing: String,
}

impl Allocation {
    fn labels(&self) -> [(&'static str, &str); 10] {
        [
            ("device", &self.device),
            ("gpu_uuid", &self.gpu_uuid),
            ("mig_profile", &self.mig_profile),
            ("claim_namespace", &self.claim_namespace),
            ("claim_name", &self.claim_name),
            ("pod_namespace", &self.pod_namespace),
            ("pod", &self.pod),
            ("container", &self.container),
            ("path", self.path),
            ("sharing", &self.sharing),
        ]
    }
}

/// One GPU's readings with its device name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuRow {
    /// `gpu-<minor>`, the DRA device name of the whole GPU.
    pub device: String,
    pub usage: crate::inventory::GpuUsage,
}

/// A process on a GPU, with the pod its cgroup names (empty strings where none).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct ProcessRow {
    pub gpu_uuid: String,
    pub mig_uuid: String,
    pub pid: u32,
    pub pod_uid: String,
    pub pod_namespace: String,
    pub pod: String,
    pub used_memory_bytes: u64,
}

/// One share of a GPU (a claim's consumable-capacity device): the memory it is held to and what
/// its pods' processes use now. The MPS memory limit applies to each CUDA process, so `used`
/// above `consumed` is a claim whose processes together outgrew its share.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct ShareRow {
    pub namespace: String,
    pub claim: String,
    /// The device name (`gpu-0`).
    pub gpu: String,
    pub gpu_uuid: String,
    /// The memory the share is held to: what the scheduler counted for it, or in integer mode
    /// (`--consumable-shares=N`) its part of the GPU; `None` for an `unlimited` share that asked
    /// for none, which nothing bounds.
    pub consumed_bytes: Option<u64>,
    /// The most it may use: its burst limit (`mpsConfig.defaultPinnedDeviceMemoryLimit`), else
    /// what it is held to; `None` where nothing bounds it.
    pub limit_bytes: Option<u64>,
    /// The sum over the processes on the GPU whose cgroup names one of the claim's pods; `None`
    /// when the readings could not be read this scrape.
    pub used_bytes: Option<u64>,
    /// Which limit holds the share's memory: `container` (the driver's per-cgroup limits on its
    /// container) or `process` (the MPS per-process limit only); empty when not known.
    pub level: String,
}

/// The hook binary nvdra names in CDI specs (`nvidia-cdi-hook` or `nvidia-ctk`): its host path,
/// the NVIDIA Container Toolkit version it reported (`unreadable` where it reported none nvdra
/// could read), and each hook left out of the specs for it, with why
/// ([`crate::cdi::toolkit`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HookBinaryRow {
    pub path: String,
    pub version: String,
    /// `(hook, reason)`: `("enable-cuda-compat", "toolkit 1.17.7 below 1.17.8")`.
    pub left_out: Vec<(&'static str, String)>,
}

/// What a scrape reads from the node ([`super::Source`]).
#[derive(Clone, Debug, Default)]
pub struct Scrape {
    /// Sorted and without duplicates (each is one series).
    pub allocations: Vec<Allocation>,
    pub gpus: Vec<GpuRow>,
    pub processes: Vec<ProcessRow>,
    /// XID events per (GPU UUID, XID).
    pub xids: BTreeMap<(String, u64), u64>,
    /// The GPU shares of DRA claims, sorted.
    pub shares: Vec<ShareRow>,
    /// Whether the GPUs' readings could be read (`false`: none are exported this scrape).
    pub usage_ok: bool,
    /// Each GPU (or MIG device) with shares (UUID) and whether its share daemon answered the
    /// last probe.
    pub share_daemons: Vec<(String, bool)>,
}

/// A histogram's state: the count per bucket (not cumulative; the encoder sums them), sum, count.
#[derive(Clone, Debug)]
pub struct HistogramValue {
    pub buckets: [u64; BUCKETS.len()],
    pub sum_seconds: f64,
    pub count: u64,
}

/// The values one scrape encodes.
#[derive(Clone, Debug)]
pub struct Snapshot {
    pub info: Vec<(&'static str, String)>,
    pub prepare: [u64; 2],
    pub unprepare: [u64; 2],
    pub prepare_seconds: HistogramValue,
    pub unprepare_seconds: HistogramValue,
    pub slice_writes: [(&'static str, u64); 3],
    pub api_errors: u64,
    pub gpus: u64,
    pub unhealthy_devices: u64,
    pub ready: bool,
    /// Each GPU whose MIG mode the DRA plugin will not switch now (UUID), and why
    /// (`reset_required`, `in_use`).
    pub switch_blocks: Vec<(String, &'static str)>,
    /// The CDI hook binary, when one is installed.
    pub cdi_hook: Option<HookBinaryRow>,
    pub scrape: Option<Scrape>,
}

type Fmt = Result<(), std::fmt::Error>;

fn counter(e: &mut DescriptorEncoder, name: &str, help: &str, v: u64) -> Fmt {
    let c = ConstCounter::new(v);
    c.encode(e.encode_descriptor(name, help, None, MetricType::Counter)?)
}

fn gauge<N: prometheus_client::encoding::EncodeGaugeValue>(
    e: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    v: N,
) -> Fmt {
    ConstGauge::new(v).encode(e.encode_descriptor(name, help, None, MetricType::Gauge)?)
}

/// A gauge family with one sample per item of `rows` that has a value.
fn gauges<'a, T: 'a, L, N>(
    e: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    rows: impl IntoIterator<Item = &'a T>,
    labels: impl Fn(&T) -> L,
    value: impl Fn(&T) -> Option<N>,
) -> Fmt
where
    L: prometheus_client::encoding::EncodeLabelSet,
    N: prometheus_client::encoding::EncodeGaugeValue,
{
    let mut m = e.encode_descriptor(name, help, None, MetricType::Gauge)?;
    for row in rows {
        if let Some(v) = value(row) {
            ConstGauge::new(v).encode(m.encode_family(&labels(row))?)?;
        }
    }
    Ok(())
}

fn histogram(e: &mut DescriptorEncoder, name: &str, help: &str, h: &HistogramValue) -> Fmt {
    let buckets: Vec<(f64, u64)> = BUCKETS.iter().copied().zip(h.buckets).collect();
    e.encode_descriptor(name, help, None, MetricType::Histogram)?
        .encode_histogram::<prometheus_client::encoding::NoLabelSet>(
            h.sum_seconds,
            h.count,
            &buckets,
            None,
        )
}

impl Collector for Snapshot {
    fn encode(&self, mut e: DescriptorEncoder) -> Fmt {
        let mut m = e.encode_descriptor(
            "nvdra_build",
            "Build and run information.",
            None,
            MetricType::Info,
        )?;
        m.encode_info(&self.info)?;
        for (name, help, [ok, error]) in [
            (
                "nvdra_prepare_claims",
                "Claims handled by NodePrepareResources, by result.",
                self.prepare,
            ),
            (
                "nvdra_unprepare_claims",
                "Claims handled by NodeUnprepareResources, by result.",
                self.unprepare,
            ),
        ] {
            let mut m = e.encode_descriptor(name, help, None, MetricType::Counter)?;
            for (result, v) in [("ok", ok), ("error", error)] {
                ConstCounter::new(v).encode(m.encode_family(&[("result", result)])?)?;
            }
        }
        histogram(
            &mut e,
            "nvdra_prepare_duration_seconds",
            "Time to prepare one claim.",
            &self.prepare_seconds,
        )?;
        histogram(
            &mut e,
            "nvdra_unprepare_duration_seconds",
            "Time to unprepare one claim.",
            &self.unprepare_seconds,
        )?;
        let mut m = e.encode_descriptor(
            "nvdra_resourceslice_writes",
            "ResourceSlice writes to the API server, by operation.",
            None,
            MetricType::Counter,
        )?;
        for (op, v) in self.slice_writes {
            ConstCounter::new(v).encode(m.encode_family(&[("operation", op)])?)?;
        }
        counter(
            &mut e,
            "nvdra_api_errors",
            "Failed ResourceSlice reconciles (API server errors and conflicts).",
            self.api_errors,
        )?;
        gauge(&mut e, "nvdra_gpus", "GPUs in the inventory.", self.gpus)?;
        gauge(
            &mut e,
            "nvdra_unhealthy_devices",
            "Devices currently unhealthy.",
            self.unhealthy_devices,
        )?;
        gauge(
            &mut e,
            "nvdra_ready",
            "1 when registered with the kubelet and slices are published.",
            u64::from(self.ready),
        )?;
        gauges(
            &mut e,
            "nvdra_mps_daemon_up",
            "1 when the MPS daemon of a GPU's shares answered its last probe, 0 when it did not \
             (the GPU is then tainted mps-daemon-down and refuses new shares).",
            self.scrape.iter().flat_map(|s| &s.share_daemons),
            |(gpu, _)| [("gpu", gpu.clone())],
            |(_, up)| Some(u64::from(*up)),
        )?;
        gauges(
            &mut e,
            "nvdra_mig_switch_blocked",
            "1 for a GPU whose MIG mode the DRA plugin no longer switches (reason \
             reset_required: the driver answered a switch with RESET_REQUIRED, until nvdra \
             restarts) or not now (in_use: processes held it at a switch, until they are gone).",
            &self.switch_blocks,
            |(gpu, reason)| [("gpu", gpu.clone()), ("reason", reason.to_string())],
            |_| Some(1u64),
        )?;
        if let Some(hook) = &self.cdi_hook {
            let mut m = e.encode_descriptor(
                "nvdra_cdi_hook_toolkit",
                "The hook binary CDI specs name (nvidia-cdi-hook or nvidia-ctk) and the NVIDIA \
                 Container Toolkit version it reported (unreadable: none nvdra could read).",
                None,
                MetricType::Info,
            )?;
            m.encode_info(&[("path", hook.path.as_str()), ("version", &hook.version)])?;
        }
        gauges(
            &mut e,
            "nvdra_cdi_hook_left_out",
            "1 for each of NVIDIA's hooks left out of every CDI spec, and why: below NVIDIA \
             Container Toolkit 1.17.8 (CVE-2025-23266, CVE-2025-23267), or with its version \
             unreadable, enable-cuda-compat and update-ldcache are not run; below 1.18.0 \
             disable-device-node-modification, which older hook binaries lack. Upgrade the \
             toolkit and restart nvdra.",
            self.cdi_hook.iter().flat_map(|h| &h.left_out),
            |(hook, reason)| [("hook", hook.to_string()), ("reason", reason.clone())],
            |_| Some(1u64),
        )?;
        match &self.scrape {
            Some(s) => encode_scrape(&mut e, s),
            None => Ok(()),
        }
    }
}

fn encode_scrape(e: &mut DescriptorEncoder, s: &Scrape) -> Fmt {
    let mut m = e.encode_descriptor(
        "nvdra_device_allocation",
        "1 for every device allocated to a DRA claim or a device-plugin container, with who holds it.",
        None,
        MetricType::Info,
    )?;
    for a in &s.allocations {
        m.encode_info(&a.labels())?;
    }
    gauge(
        e,
        "nvdra_gpu_usage_readable",
        "1 when the GPUs' live readings could be read at this scrape.",
        u64::from(s.usage_ok),
    )?;
    let gpu = |r: &GpuRow| {
        [
            ("gpu", r.device.clone()),
            ("gpu_uuid", r.usage.gpu.to_string()),
        ]
    };
    type Reading = fn(&GpuRow) -> Option<f64>;
    let readings: [(&str, &str, Reading); 6] = [
        (
            "nvdra_gpu_memory_used_bytes",
            "Device memory in use.",
            |r| Some(r.usage.memory_used_bytes as f64),
        ),
        (
            "nvdra_gpu_memory_total_bytes",
            "Device memory in all.",
            |r| Some(r.usage.memory_total_bytes as f64),
        ),
        (
            "nvdra_gpu_utilization_percent",
            "Percent of the last sample period a kernel ran.",
            |r| r.usage.utilization_percent.map(f64::from),
        ),
        (
            "nvdra_gpu_memory_utilization_percent",
            "Percent of the last sample period device memory was read or written.",
            |r| r.usage.memory_utilization_percent.map(f64::from),
        ),
        ("nvdra_gpu_power_watts", "Power draw.", |r| {
            r.usage.power_milliwatts.map(|mw| f64::from(mw) / 1000.0)
        }),
        (
            "nvdra_gpu_temperature_celsius",
            "GPU core temperature.",
            |r| r.usage.temperature_celsius.map(f64::from),
        ),
    ];
    for (name, help, value) in readings {
        gauges(e, name, help, &s.gpus, gpu, value)?;
    }
    let mut m = e.encode_descriptor(
        "nvdra_gpu_xid_errors",
        "XID events each GPU reported since nvdra started, ignored XIDs included.",
        None,
        MetricType::Counter,
    )?;
    for ((uuid, xid), n) in &s.xids {
        let xid = xid.to_string();
        let labels = [("gpu_uuid", uuid.as_str()), ("xid", xid.as_str())];
        ConstCounter::new(*n).encode(m.encode_family(&labels)?)?;
    }
    let share = |r: &ShareRow| {
        [
            ("namespace", r.namespace.clone()),
            ("claim", r.claim.clone()),
            ("gpu", r.gpu.clone()),
            ("gpu_uuid", r.gpu_uuid.clone()),
        ]
    };
    gauges(
        e,
        "nvdra_share_memory_consumed_bytes",
        "GPU memory a share is held to: what the scheduler counted for it (its claim's consumed \
         memory), or with --consumable-shares=N its part of the GPU; none for an unlimited share \
         that asked for no memory.",
        &s.shares,
        share,
        |r| r.consumed_bytes,
    )?;
    gauges(
        e,
        "nvdra_share_memory_limit_bytes",
        "GPU memory a share may use: its burst limit (hard limit), else what it is held to; \
         none where nothing bounds it. Used above it means its processes together outgrew it \
         (the MPS limit applies per process).",
        &s.shares,
        share,
        |r| r.limit_bytes,
    )?;
    gauges(
        e,
        "nvdra_share_enforcement",
        "Which limit holds a share's GPU memory (1 for its level): container (the driver's soft \
         and hard limits on its container's cgroup, MPS v3 memory partitioning) or process (the \
         MPS limit on each CUDA process only).",
        &s.shares,
        |r: &ShareRow| {
            let mut labels = share(r).to_vec();
            labels.push(("level", r.level.clone()));
            labels
        },
        |r| (!r.level.is_empty()).then_some(1),
    )?;
    gauges(
        e,
        "nvdra_share_memory_used_bytes",
        "GPU memory a share's pods' processes use now (NVML, per process, summed). The MPS \
         limit applies per process, so more than consumed means its processes outgrew the share.",
        &s.shares,
        share,
        |r| r.used_bytes,
    )?;
    gauges(
        e,
        "nvdra_gpu_process_memory_used_bytes",
        "Device memory each process uses, with the pod its cgroup names.",
        &s.processes,
        |p| {
            [
                ("gpu_uuid", p.gpu_uuid.clone()),
                ("mig_uuid", p.mig_uuid.clone()),
                ("pid", p.pid.to_string()),
                ("pod_uid", p.pod_uid.clone()),
                ("pod_namespace", p.pod_namespace.clone()),
                ("pod", p.pod.clone()),
            ]
        },
        |p| Some(p.used_memory_bytes),
    )
}
