//! How long a `/metrics` scrape takes on a full node, and how long it holds the ledger's lock:
//! a simulated DGX A100 (8 GPUs) with 7 MIG devices (1g.10gb) on each, 56 claims prepared in the
//! ledger (one MIG device each, each reserved for a pod), one process per MIG device whose cgroup
//! (a fake `/proc`) names its pod, and 56 XID counts. Timed: rendering the whole text
//! (`Metrics::render`: the ledger copied under its lock, the holds, the readings, `/proc`, the
//! encoding), the ledger's critical section alone (the copy), and a scrape over HTTP through the
//! metrics server on 127.0.0.1. Median and p99 of many runs.
//!
//! Run: `cargo bench --bench metrics`

use std::io::{Read, Write};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nvdra::health::{Event, EventKind, Monitor, Policy};
use nvdra::ids::{ClaimUid, DeviceName};
use nvdra::inventory::owner::{self, Owner};
use nvdra::inventory::sim::SimBackend;
use nvdra::inventory::{DeviceBackend, Placement, ProcessUsage, Reconfigure};
use nvdra::ledger::{ClaimEntry, ClaimState, DeviceRecord, Ledger, MigRecord, PodRef};
use nvdra::metrics::attribution::Attribution;
use nvdra::metrics::{self, Metrics};
use nvdra::sharing::Sharing;
use tokio_util::sync::CancellationToken;

const NODE: &str = "dgx-a100-0";
const RUNS: usize = 2000;

fn pct(v: &mut [Duration], p: f64) -> Duration {
    v.sort();
    v[((v.len() - 1) as f64 * p) as usize]
}

fn us(d: Duration) -> String {
    format!("{:.0} µs", d.as_secs_f64() * 1e6)
}

fn report(what: &str, mut v: Vec<Duration>) {
    println!(
        "{what}: p50 {}, p99 {}, max {} ({} runs)",
        us(pct(&mut v, 0.5)),
        us(pct(&mut v, 0.99)),
        us(pct(&mut v, 1.0)),
        v.len()
    );
}

#[tokio::main]
async fn main() {
    let sim = SimBackend::from_profile("dgx-a100-mig", NODE).expect("profile");
    let dir = tempfile::tempdir().expect("tempdir");
    let proc_root = dir.path().join("proc");
    let (ledger, _writer, _) =
        Ledger::open(&dir.path().join("plugin"), "boot", None).expect("ledger");
    // The owner's handle: the monitor's probes and the scrape's live readings go through it,
    // as in `nvdra run` (its publications are the bench's own, below).
    let hour = Duration::from_secs(3600);
    let (_owner, inventory) =
        Owner::new(Arc::new(sim.clone()), hour, owner::DEADLINE).expect("owner");
    let (monitor, handle) = Monitor::new(Policy::default(), Arc::new(inventory.clone()));
    let stop = CancellationToken::new();
    tokio::spawn(monitor.run(stop.clone()));

    let inv = sim.snapshot().expect("inventory");
    let mut n = 0u32;
    for g in &inv.gpus {
        let mut processes = Vec::new();
        for start in 0..7 {
            let mig = sim
                .create_mig(&g.uuid, 19, Placement { start, size: 1 })
                .expect("MIG device");
            n += 1;
            let pod_uid = format!("00000000-0000-0000-0000-{n:012}");
            let pid = 10_000 + n;
            let cgroup = proc_root.join(pid.to_string());
            std::fs::create_dir_all(&cgroup).expect("proc dir");
            std::fs::write(
                cgroup.join("cgroup"),
                format!(
                    "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{}.slice/cri-containerd-{n}.scope\n",
                    pod_uid.replace('-', "_")
                ),
            )
            .expect("cgroup file");
            processes.push(ProcessUsage {
                pid,
                used_memory_bytes: Some(1 << 30),
                gpu_instance: Some(mig.gi_id),
            });
            let record = DeviceRecord {
                requests: vec!["mig".into()],
                pool: NODE.into(),
                device: DeviceName::parse(&format!("gpu-{}-mig-1g10gb-19-{start}", g.minor))
                    .expect("device name"),
                cdi_ids: vec![],
                share_id: None,
                admin_access: false,
                gpu: g.uuid.clone(),
                mig: Some(MigRecord {
                    uuid: Some(mig.uuid.clone()),
                    profile: mig.profile.clone(),
                    gi_profile_id: 19,
                    placement: mig.placement,
                    created: false,
                }),
                consumed: None,
                sharing: Sharing::Exclusive,
            };
            ledger.update(|c| {
                c.insert(
                    ClaimUid::parse(format!("claim-{n}")).expect("uid"),
                    ClaimEntry {
                        state: ClaimState::PrepareCompleted,
                        namespace: "team".into(),
                        name: format!("claim-{n}"),
                        devices: vec![record],
                        pods: vec![PodRef {
                            name: format!("pod-{n}"),
                            uid: pod_uid,
                        }],
                        user: None,
                        trust_label: None,
                    },
                )
            });
            handle
                .events()
                .send(Event::gpu(
                    g.uuid.clone(),
                    EventKind::Xid(13 + u64::from(start)),
                ))
                .await
                .expect("monitor");
        }
        sim.set_processes(&g.uuid, processes);
    }

    let m = Metrics::new();
    let source = Arc::new(
        Attribution::new(
            tokio::sync::watch::channel(nvdra::inventory::owner::Published {
                node: Some(Arc::new(sim.snapshot().expect("inventory"))),
                ..Default::default()
            })
            .1,
            inventory.clone(),
        )
        .with_ledger(ledger.clone())
        .with_monitor(handle.clone())
        .with_proc_root(&proc_root),
    );
    // The XID events reach the monitor's counts.
    while handle.xid_counts().len() < 56 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let text = m.render(Some(&*source));
    let series = |name: &str| text.lines().filter(|l| l.starts_with(name)).count();
    assert_eq!(series("nvdra_device_allocation_info{"), 56, "{text}");
    assert_eq!(series("nvdra_gpu_process_memory_used_bytes{"), 56, "{text}");
    assert_eq!(series("nvdra_gpu_xid_errors_total{"), 56, "{text}");
    println!(
        "scrape of 8 GPUs × 7 MIG devices, 56 allocations, 56 processes, 56 XID series: {} lines, {} bytes",
        text.lines().count(),
        text.len()
    );

    let rendered = source.clone();
    let render = tokio::task::spawn_blocking(move || {
        let mut render = Vec::with_capacity(RUNS);
        for _ in 0..RUNS {
            let t = Instant::now();
            std::hint::black_box(m.render(Some(&*rendered)));
            render.push(t.elapsed());
        }
        (render, m)
    });
    let (render, m) = render.await.expect("render");
    report("render (Metrics::render)", render);

    let mut locked = Vec::with_capacity(RUNS);
    for _ in 0..RUNS {
        // What a scrape does under the ledger's lock: copy the claims, nothing else.
        let t = Instant::now();
        std::hint::black_box(ledger.read(|cp| cp.claims.clone()));
        locked.push(t.elapsed());
    }
    report("ledger lock held by a scrape (the copy)", locked);

    let listener = metrics::bind("127.0.0.1:0".parse().expect("addr"))
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(metrics::serve(listener, m, Some(source), stop.clone()));
    let http = tokio::task::spawn_blocking(move || {
        let mut http = Vec::with_capacity(RUNS / 4);
        for _ in 0..RUNS / 4 {
            let t = Instant::now();
            let mut s = std::net::TcpStream::connect(addr).expect("connect");
            s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                .expect("request");
            let mut body = Vec::new();
            s.read_to_end(&mut body).expect("response");
            http.push(t.elapsed());
            assert!(body.starts_with(b"HTTP/1.1 200"));
        }
        http
    })
    .await
    .expect("http");
    report(
        "scrape over HTTP (connect, GET /metrics, read to end)",
        http,
    );
    stop.cancel();
}
