//! `/metrics` of a running `nvdra run --mode both` on simulated GPUs, read by a Prometheus parser
//! we did not write (Python `prometheus_client`, tests/support/promclient.rs): which pod holds
//! which GPU — a DRA claim prepared through the grpcio kubelet stand-in and a device-plugin
//! container that the stand-in's PodResources lists — and each GPU's readings, equal to what the
//! simulated backend reports. Also: every metric the Grafana dashboard under `manifests/`
//! queries is one a real scrape exports.
//!
//! Needs python3 with `prometheus_client` (skipped unless `NVDRA_REQUIRE_PROMCLIENT` is set) and,
//! for the `both` test, the stand-in's grpcio packages (as tests/integration/both_grpcio.rs).

use crate::support;

use std::collections::BTreeMap;
use std::process::Child;
use std::time::{Duration, Instant};

use k8s_openapi::api::resource::v1::ResourceClaimConsumerReference;
use nvdra::inventory::{DeviceBackend, sim::SimBackend};
use serde_json::{Value, json};
use support::grpcio::{NodeStandin, have_grpcio};
use support::promclient::{self, Family, Sample, have_promclient};

const NODE: &str = "node-a";
const DRIVER: &str = "gpu.nvidia.com";
const PROFILE: &str = "dgx-h100";
/// How long a change may take to reach `/metrics` (PodResources is polled every second; not a
/// speed test).
const WAIT: Duration = Duration::from_secs(30);
const CLAIM_UID: &str = "44444444-0000-0000-0000-000000000004";
const POD_UID: &str = "55555555-0000-0000-0000-000000000005";

/// Kills the children when dropped.
struct Procs(Vec<Child>);

impl Drop for Procs {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// `nvdra run` on simulated GPUs, and the port of its `/metrics`.
fn nvdra(root: &std::path::Path, mode: &str) -> (Child, u16) {
    nvdra_with(root, mode, &["--profile", PROFILE])
}

/// `nvdra run` with `backend` (the backend flags), its files under `root`, and the port of its
/// `/metrics`: the sandbox binds `127.0.0.1:0` and the port the kernel gave is read back, so no
/// other test takes it between a pick and the bind.
fn nvdra_with(root: &std::path::Path, mode: &str, backend: &[&str]) -> (Child, u16) {
    let child = support::daemon::nvdra_run(root, mode, NODE)
        .args(backend)
        .env("NVDRA_PROC_ROOT", root.join("proc"))
        .spawn()
        .unwrap();
    let port = support::daemon::metrics_address(child.id()).port();
    (child, port)
}

/// The grpcio kubelet stand-in against the daemon nvdra runs under `root`.
fn standin(root: &std::path::Path) -> NodeStandin {
    NodeStandin::start(
        &root.join("kubelet"),
        &root.join(format!("kubelet/plugins/{DRIVER}/dra.sock")),
    )
}

/// Scrapes until `pred` holds on the parsed families; fails with the last scrape.
fn scrape_until(port: u16, what: &str, pred: impl Fn(&[Family]) -> bool) -> Vec<Family> {
    let deadline = Instant::now() + WAIT;
    let addr = format!("127.0.0.1:{port}");
    let mut last = String::new();
    loop {
        if let Ok((status, body)) = promclient::get(&addr, "/metrics") {
            assert!(status.contains(" 200 "), "{status}\n{body}");
            let families = promclient::parse(&body);
            if pred(&families) {
                return families;
            }
            last = body;
        }
        assert!(
            Instant::now() < deadline,
            "/metrics never {what} within {WAIT:?}:\n{last}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn allocations(families: &[Family]) -> Vec<BTreeMap<String, String>> {
    promclient::samples(families)
        .into_iter()
        .filter(|s| s.name == "nvdra_device_allocation_info")
        .map(|s| {
            assert_eq!(s.value, 1.0, "{s:?}");
            s.labels
        })
        .collect()
}

fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// The one sample of `name` whose `gpu_uuid` is `uuid`.
fn gpu_value(samples: &[Sample], name: &str, uuid: &str) -> f64 {
    let found: Vec<&Sample> = samples
        .iter()
        .filter(|s| s.name == name && s.labels.get("gpu_uuid").map(String::as_str) == Some(uuid))
        .collect();
    assert_eq!(found.len(), 1, "{name} of {uuid}: {found:?}");
    found[0].value
}

/// A DRA claim (reserved for pod `ml/trainer`) prepared through the kubelet stand-in, and a
/// device-plugin container that PodResources lists: both are on `/metrics` with their pods,
/// once each, no series twice, and the GPUs' readings are the simulated backend's.
#[test]
fn a_claim_and_a_device_plugin_container_are_attributed_to_their_pods() {
    if !have_promclient() || !have_grpcio() {
        return;
    }
    let root = tempfile::tempdir().unwrap();
    let p = |s: &str| root.path().join(s);
    std::fs::write(p("boot_id"), "boot-1\n").unwrap();
    let mut claim = nvdra::api::allocated_claim(
        "ml",
        "train",
        CLAIM_UID,
        vec![nvdra::api::allocated_device("gpu", DRIVER, NODE, "gpu-0")],
        vec![],
    );
    claim.status.as_mut().unwrap().reserved_for = Some(vec![ResourceClaimConsumerReference {
        api_group: None,
        resource: "pods".into(),
        name: "trainer".into(),
        uid: POD_UID.into(),
    }]);
    nvdra::api::dir::write_claim(&p("api"), &claim).unwrap();

    let mut standin = standin(root.path());
    let mut call = |cmd: Value| standin.ok(cmd);
    call(json!({"op": "pods", "pods": [], "wait": false}));

    let (child, port) = nvdra(root.path(), "both");
    let _nvdra = Procs(vec![child]);
    call(json!({"op": "registered", "names": ["nvidia.com/gpu"]}));

    let sim = SimBackend::from_profile(PROFILE, NODE).unwrap();
    let inv = sim.snapshot().unwrap();
    let (g0, g1) = (inv.gpus[0].uuid.to_string(), inv.gpus[1].uuid.to_string());

    let prepared = call(json!({"op": "prepare", "claims": [
        {"namespace": "ml", "name": "train", "uid": CLAIM_UID}
    ]}));
    assert_eq!(prepared["claims"][CLAIM_UID]["error"], "", "{prepared}");
    let allocated = call(json!({"op": "allocate", "resource": "nvidia.com/gpu", "ids": [g1]}));
    assert_eq!(allocated["allocated"], true, "{allocated}");
    call(
        json!({"op": "pods", "pods": [{"namespace": "default", "name": "legacy", "containers": [
            {"name": "cuda", "devices": [{"resource": "nvidia.com/gpu", "ids": [g1]}]}
        ]}]}),
    );

    let families = scrape_until(port, "showed both allocations", |f| {
        allocations(f).len() == 2
    });
    let dra = labels(&[
        ("device", "gpu-0"),
        ("gpu_uuid", &g0),
        ("mig_profile", ""),
        ("claim_namespace", "ml"),
        ("claim_name", "train"),
        ("pod_namespace", "ml"),
        ("pod", "trainer"),
        ("container", ""),
        ("path", "dra"),
        ("sharing", "exclusive"),
    ]);
    let device_plugin = labels(&[
        ("device", &g1),
        ("gpu_uuid", &g1),
        ("mig_profile", ""),
        ("claim_namespace", ""),
        ("claim_name", ""),
        ("pod_namespace", "default"),
        ("pod", "legacy"),
        ("container", "cuda"),
        ("path", "device-plugin"),
        ("sharing", "exclusive"),
    ]);
    let mut found = allocations(&families);
    found.sort();
    let mut want = vec![dra, device_plugin];
    want.sort();
    assert_eq!(found, want);
    assert_eq!(promclient::duplicates(&families), Vec::<String>::new());

    // Each GPU's readings are the simulated backend's (it has no processes: 1 GiB baseline).
    let samples = promclient::samples(&families);
    let usage = sim.usage().unwrap();
    assert_eq!(usage.len(), 8);
    for u in &usage {
        let uuid = u.gpu.to_string();
        let v = |name: &str| gpu_value(&samples, name, &uuid);
        assert_eq!(v("nvdra_gpu_memory_used_bytes"), u.memory_used_bytes as f64);
        assert_eq!(
            v("nvdra_gpu_memory_total_bytes"),
            u.memory_total_bytes as f64
        );
        let pct = |x: Option<u32>| f64::from(x.unwrap());
        assert_eq!(
            v("nvdra_gpu_utilization_percent"),
            pct(u.utilization_percent)
        );
        assert_eq!(
            v("nvdra_gpu_memory_utilization_percent"),
            pct(u.memory_utilization_percent)
        );
        assert_eq!(v("nvdra_gpu_power_watts"), pct(u.power_milliwatts) / 1000.0);
        assert_eq!(
            v("nvdra_gpu_temperature_celsius"),
            pct(u.temperature_celsius)
        );
    }
    assert!(
        samples
            .iter()
            .any(|s| s.name == "nvdra_gpu_usage_readable" && s.value == 1.0),
        "{samples:?}"
    );
    assert!(
        samples
            .iter()
            .any(|s| s.name == "nvdra_prepare_claims_total"
                && s.labels.get("result").map(String::as_str) == Some("ok")
                && s.value == 1.0),
        "the prepare is counted: {samples:?}"
    );

    // Unprepared: the claim's series goes, the container's stays.
    let unprepared = call(json!({"op": "unprepare", "claims": [
        {"namespace": "ml", "name": "train", "uid": CLAIM_UID}
    ]}));
    assert_eq!(unprepared["claims"][CLAIM_UID]["error"], "", "{unprepared}");
    let families = scrape_until(port, "dropped the claim", |f| allocations(f).len() == 1);
    assert_eq!(allocations(&families)[0]["path"], "device-plugin");
}

/// In `--mode device-plugin` (no DRA, no ledger), the containers PodResources lists are on
/// `/metrics` too, with the device plugin's sharing.
#[test]
fn device_plugin_mode_attributes_the_containers_podresources_lists() {
    if !have_promclient() || !have_grpcio() {
        return;
    }
    let root = tempfile::tempdir().unwrap();
    std::fs::write(root.path().join("boot_id"), "boot-1\n").unwrap();
    let mut standin = standin(root.path());
    let inv = SimBackend::from_profile(PROFILE, NODE)
        .unwrap()
        .snapshot()
        .unwrap();
    let g2 = inv.gpus[2].uuid.to_string();
    standin.ok(
        json!({"op": "pods", "pods": [{"namespace": "default", "name": "legacy", "containers": [
        {"name": "cuda", "devices": [{"resource": "nvidia.com/gpu", "ids": [g2]}]}
    ]}], "wait": false}),
    );
    let (child, port) = nvdra(root.path(), "device-plugin");
    let _nvdra = Procs(vec![child]);
    standin.ok(json!({"op": "registered", "names": ["nvidia.com/gpu"]}));
    let families = scrape_until(port, "showed the container", |f| allocations(f).len() == 1);
    assert_eq!(
        allocations(&families),
        vec![labels(&[
            ("device", &g2),
            ("gpu_uuid", &g2),
            ("mig_profile", ""),
            ("claim_namespace", ""),
            ("claim_name", ""),
            ("pod_namespace", "default"),
            ("pod", "legacy"),
            ("container", "cuda"),
            ("path", "device-plugin"),
            ("sharing", "exclusive"),
        ])]
    );
    assert_eq!(promclient::duplicates(&families), Vec::<String>::new());
    // The pod ends: its series goes.
    standin.ok(json!({"op": "pods", "pods": []}));
    scrape_until(port, "dropped the container", |f| allocations(f).is_empty());
}

/// On the NVML backend (the fake library under the driver root), each GPU's readings and each
/// process's memory on `/metrics` are what the fake NVML reports, the process's pod UID read
/// from its cgroup under the (fake) proc root, and its MIG device named.
#[test]
fn nvml_readings_on_metrics_are_what_the_fake_nvml_reports() {
    if !have_promclient() {
        return;
    }
    let root = tempfile::tempdir().unwrap();
    let p = |s: &str| root.path().join(s);
    std::fs::write(p("boot_id"), "boot-1\n").unwrap();
    let lib_dir = p("driver/usr/lib64");
    std::fs::create_dir_all(&lib_dir).unwrap();
    std::os::unix::fs::symlink(
        support::fake_nvml::library(),
        lib_dir.join(nvdra::inventory::nvml::LIBRARY),
    )
    .unwrap();
    // PID 4000 (the fake's process on GPU 0) is in a pod; the others in none.
    std::fs::create_dir_all(p("proc/4000")).unwrap();
    let cgroup = format!(
        "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{}.slice/cri-containerd-1.scope\n",
        POD_UID.replace('-', "_")
    );
    std::fs::write(p("proc/4000/cgroup"), cgroup).unwrap();

    let (child, port) = nvdra_with(root.path(), "dra", &["--backend", "nvml"]);
    let _procs = Procs(vec![child]);
    let families = scrape_until(port, "showed the GPUs' readings", |f| {
        promclient::samples(f)
            .iter()
            .any(|s| s.name == "nvdra_gpu_temperature_celsius")
    });
    assert_eq!(promclient::duplicates(&families), Vec::<String>::new());
    let samples = promclient::samples(&families);
    let gpus = fake_nvml::model::a100_l40s();
    for (i, g) in gpus.iter().enumerate() {
        let want = fake_nvml::usage::readings(i, g);
        let v = |name: &str| gpu_value(&samples, name, &g.uuid);
        assert_eq!(v("nvdra_gpu_memory_used_bytes"), want.memory_used() as f64);
        assert_eq!(v("nvdra_gpu_memory_total_bytes"), g.memory_bytes as f64);
        assert_eq!(
            v("nvdra_gpu_utilization_percent"),
            f64::from(want.utilization_gpu)
        );
        assert_eq!(
            v("nvdra_gpu_memory_utilization_percent"),
            f64::from(want.utilization_memory)
        );
        assert_eq!(
            v("nvdra_gpu_power_watts"),
            f64::from(want.power_milliwatts) / 1000.0
        );
        assert_eq!(
            v("nvdra_gpu_temperature_celsius"),
            f64::from(want.temperature_celsius)
        );
        let proc = &want.processes[0];
        let mig = g
            .instance(proc.gpu_instance)
            .map(|gi| gi.compute[0].uuid.clone())
            .unwrap_or_default();
        let pod_uid = if proc.pid == 4000 { POD_UID } else { "" };
        let want_labels = labels(&[
            ("gpu_uuid", &g.uuid),
            ("mig_uuid", &mig),
            ("pid", &proc.pid.to_string()),
            ("pod_uid", pod_uid),
            ("pod_namespace", ""),
            ("pod", ""),
        ]);
        let found: Vec<&Sample> = samples
            .iter()
            .filter(|s| {
                s.name == "nvdra_gpu_process_memory_used_bytes"
                    && s.labels.get("gpu_uuid") == Some(&g.uuid)
            })
            .collect();
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(found[0].labels, want_labels);
        assert_eq!(found[0].value, proc.used_bytes as f64);
    }
    assert!(
        !fake_nvml::model::a100_l40s()[0].instances.is_empty(),
        "GPU 0 has a MIG device for its process"
    );
}

/// The metric names a PromQL expression refers to: identifiers that start with `nvdra_`.
fn metric_names(expr: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = expr;
    while let Some(at) = rest.find("nvdra_") {
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
            .unwrap_or(tail.len());
        out.push(tail[..end].to_string());
        rest = &tail[end..];
    }
    out
}

/// Every `expr` of every panel (nested rows included).
fn exprs(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::Object(m) => {
            for (k, v) in m {
                match (k.as_str(), v) {
                    ("expr", Value::String(e)) => out.push(e.clone()),
                    _ => exprs(v, out),
                }
            }
        }
        Value::Array(a) => a.iter().for_each(|v| exprs(v, out)),
        _ => {}
    }
}

/// The Grafana dashboard's queries name only metrics a real scrape of nvdra exports (the
/// families' names as the parser reads them, with their samples' names: `_total`, `_bucket`,
/// `_info`).
#[test]
fn the_grafana_dashboard_queries_only_metrics_nvdra_exports() {
    if !have_promclient() {
        return;
    }
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/manifests/grafana/nvdra-dashboard.json"
    );
    let dashboard: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let mut all = Vec::new();
    exprs(&dashboard, &mut all);
    assert!(all.len() >= 5, "the dashboard has queries: {all:?}");

    let root = tempfile::tempdir().unwrap();
    std::fs::write(root.path().join("boot_id"), "boot-1\n").unwrap();
    let (child, port) = nvdra(root.path(), "dra");
    let _procs = Procs(vec![child]);
    let families = scrape_until(port, "answered", |f| !f.is_empty());
    let mut exported: Vec<String> = families
        .iter()
        .flat_map(|f| {
            let mut names: Vec<String> = f.samples.iter().map(|s| s.name.clone()).collect();
            names.push(f.name.clone());
            // A family with no sample yet: its samples' names are the family's with the suffix.
            match f.kind.as_str() {
                "counter" => names.push(format!("{}_total", f.name)),
                "histogram" => {
                    names.extend(["_bucket", "_sum", "_count"].map(|s| format!("{}{s}", f.name)))
                }
                _ => {}
            }
            names
        })
        .collect();
    exported.sort();
    exported.dedup();
    for expr in &all {
        let names = metric_names(expr);
        assert!(!names.is_empty(), "{expr:?} queries no nvdra metric");
        for name in names {
            assert!(
                exported.binary_search(&name).is_ok(),
                "the dashboard queries {name} ({expr:?}), which nvdra does not export: {exported:?}"
            );
        }
    }
}

/// Each share of a GPU is on `/metrics` with what the scheduler counted for it and what its
/// pods' processes use now (NVML per process, joined to the claim through the pods' cgroups),
/// as Python's parser reads the text: a share whose two processes outgrew it, one within its
/// share, and a process in no claim's pod counted for none. A share of `--consumable-shares=4`
/// shows the quarter of the GPU it is held to; an `unlimited` one that asked for no memory shows
/// what it uses and nothing to exceed.
#[test]
fn each_share_shows_its_used_memory_beside_what_it_consumed() {
    use nvdra::ids::{ClaimUid, DeviceName};
    use nvdra::inventory::ProcessUsage;
    use nvdra::inventory::owner::{self, Owner};
    use nvdra::ledger::{ClaimEntry, ClaimState, Consumed, DeviceRecord, Ledger, PodRef, Shares};
    use nvdra::metrics::{Metrics, attribution::Attribution};
    use std::sync::Arc;

    if !have_promclient() {
        return;
    }
    const POD_A: &str = "aaaaaaaa-0000-4000-8000-00000000000a";
    const POD_B: &str = "bbbbbbbb-0000-4000-8000-00000000000b";
    let sim = SimBackend::from_profile(PROFILE, NODE).unwrap();
    let inv = sim.snapshot().unwrap();
    let gpu = inv.gpus[0].uuid.clone();
    let proc_root = tempfile::tempdir().unwrap();
    for (pid, pod) in [(10, POD_A), (11, POD_A), (20, POD_B), (30, "")] {
        let dir = proc_root.path().join(pid.to_string());
        std::fs::create_dir_all(&dir).unwrap();
        let cgroup = if pod.is_empty() {
            "0::/system.slice/other.service\n".to_string()
        } else {
            format!("0::/kubepods/besteffort/pod{pod}/c\n")
        };
        std::fs::write(dir.join("cgroup"), cgroup).unwrap();
    }
    let gib = |n: u64| n << 30;
    let process = |pid, bytes| ProcessUsage {
        pid,
        used_memory_bytes: Some(bytes),
        gpu_instance: None,
    };
    sim.set_processes(
        &gpu,
        vec![
            process(10, gib(6)),
            process(11, gib(5)),
            process(20, gib(2)),
            process(30, gib(1)),
        ],
    );
    let dir = tempfile::tempdir().unwrap();
    let (ledger, _writer, _) = Ledger::open(dir.path(), "boot", None).unwrap();
    let share = |memory, shares| DeviceRecord {
        requests: vec!["nb".into()],
        pool: NODE.into(),
        device: DeviceName::parse("gpu-0").unwrap(),
        cdi_ids: vec![],
        share_id: Some("5f0e0000-0000-4000-8000-000000000001".into()),
        admin_access: false,
        gpu: gpu.clone(),
        mig: None,
        consumed: Some(Consumed {
            memory,
            shares,
            // "a" (8Gi) may burst to 16Gi.
            burst_limit: (memory == gib(8)).then(|| gib(16)),
            ..Default::default()
        }),
        sharing: Default::default(),
    };
    ledger.update(|c| {
        let quarter = Some(Shares { count: 1, of: 4 });
        for (uid, name, pod, memory, shares) in [
            ("a", "nb-a", POD_A, gib(8), None),
            ("b", "nb-b", POD_B, gib(4), None),
            (
                "c",
                "nb-c",
                "cccccccc-0000-4000-8000-00000000000c",
                0,
                quarter,
            ),
            ("d", "nb-d", "dddddddd-0000-4000-8000-00000000000d", 0, None),
        ] {
            c.insert(
                ClaimUid::parse(uid).unwrap(),
                ClaimEntry {
                    state: ClaimState::PrepareCompleted,
                    namespace: "ml".into(),
                    name: name.into(),
                    devices: vec![share(memory, shares)],
                    pods: vec![PodRef {
                        name: format!("pod-{uid}"),
                        uid: pod.into(),
                    }],
                    user: None,
                    trust_label: None,
                },
            );
        }
    });
    let metrics = Metrics::new();
    let node = nvdra::inventory::owner::Published {
        node: Some(Arc::new(inv.clone())),
        ..Default::default()
    };
    let node = tokio::sync::watch::channel(node).1;
    // Live readings through an owner's handle over `sim`, as `nvdra run` reads them.
    let hour = Duration::from_secs(3600);
    let (_owner, readings) = Owner::new(Arc::new(sim), hour, owner::DEADLINE).unwrap();
    let source = Arc::new(
        Attribution::new(node, readings)
            .with_ledger(ledger)
            .with_proc_root(proc_root.path())
            // One share whose container the driver limits, one limited per process only.
            .with_share_levels(Arc::new(|| {
                [("a", "container"), ("b", "process")]
                    .into_iter()
                    .map(|(uid, level)| (ClaimUid::parse(uid).unwrap(), level))
                    .collect()
            })),
    );
    let families = promclient::parse(&metrics.render(Some(&*source)));
    let samples = promclient::samples(&families);
    for (claim, level) in [("nb-a", "container"), ("nb-b", "process")] {
        let found: Vec<&Sample> = samples
            .iter()
            .filter(|s| s.name == "nvdra_share_enforcement" && s.labels["claim"] == claim)
            .collect();
        assert_eq!(found.len(), 1, "{claim}: {samples:?}");
        assert_eq!(found[0].labels["level"], level, "{claim}");
        assert_eq!(found[0].value, 1.0);
    }
    let value = |name: &str, claim: &str| {
        let found: Vec<&Sample> = samples
            .iter()
            .filter(|s| s.name == name && s.labels["claim"] == claim)
            .collect();
        assert_eq!(found.len(), 1, "{name} {claim}: {samples:?}");
        assert_eq!(
            found[0].labels,
            labels(&[
                ("namespace", "ml"),
                ("claim", claim),
                ("gpu", "gpu-0"),
                ("gpu_uuid", gpu.as_str()),
            ])
        );
        found[0].value
    };
    assert_eq!(
        value("nvdra_share_memory_consumed_bytes", "nb-a"),
        gib(8) as f64
    );
    assert_eq!(
        value("nvdra_share_memory_used_bytes", "nb-a"),
        gib(11) as f64
    );
    assert_eq!(
        value("nvdra_share_memory_consumed_bytes", "nb-b"),
        gib(4) as f64
    );
    assert_eq!(
        value("nvdra_share_memory_used_bytes", "nb-b"),
        gib(2) as f64
    );
    // 1 of 4 shares of an 80Gi GPU: held to 20Gi.
    assert_eq!(
        value("nvdra_share_memory_consumed_bytes", "nb-c"),
        gib(20) as f64
    );
    assert_eq!(value("nvdra_share_memory_used_bytes", "nb-d"), 0.0);
    // What each may use: the burst limit, else what it is held to; nothing bounds "d".
    assert_eq!(
        value("nvdra_share_memory_limit_bytes", "nb-a"),
        gib(16) as f64
    );
    assert_eq!(
        value("nvdra_share_memory_limit_bytes", "nb-b"),
        gib(4) as f64
    );
    assert_eq!(
        value("nvdra_share_memory_limit_bytes", "nb-c"),
        gib(20) as f64
    );
    assert!(
        !samples
            .iter()
            .any(|s| s.name == "nvdra_share_memory_limit_bytes" && s.labels["claim"] == "nb-d")
    );
    assert!(
        !samples
            .iter()
            .any(|s| s.name == "nvdra_share_memory_consumed_bytes" && s.labels["claim"] == "nb-d"),
        "an unlimited share that asked for no memory is held to nothing: {samples:?}"
    );
    assert_eq!(promclient::duplicates(&families), Vec::<String>::new());
}
