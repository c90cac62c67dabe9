//! From a ComputeDomain's creation to all its nodes ready (issue 37 item 6): 18 simulated GB200
//! trays, one NVLink clique of the `gb200-nvl72` profile, each with its own `nvdra compute-domain
//! plugin` process, the `nvdra compute-domain controller` process, and a `nvdra compute-domain
//! daemon` process per node running the fake `nvidia-imex` (`tests/data/fake-imex/`) on loopback,
//! all against the test API server (the cluster of `tests/support/cd_cluster.rs`, which the
//! end-to-end test runs with 4 trays). One workload pod per node, each with a claim of the
//! domain's channel template allocated the node's `channel-0`.
//!
//! The same processes, the same fake IMEX and the same defaults (the daemon checks IMEX every 2 s
//! and holds SIGUSR1 to one per 5 s, as IMEX does; the plugin's readiness pass runs every 5 s and
//! whenever a claim changes) in three flows; only the plugins' `--binding-conditions`, the API
//! server's version and the stand-ins for the scheduler and the kubelet differ:
//!
//! - **nvdra**: binding conditions (KEP-5007) on a 1.36 API server. Each pod stays unbound until
//!   the plugin sets `ComputeDomainReady` on its claim's device (its node's daemon is Ready); the
//!   scheduler stand-in sees it as kube-scheduler's PreBind does, polling the claim at once and
//!   then every 5 s (`wait.PollUntilContextTimeout(ctx, 5*time.Second, bindingTimeout, true, …)`,
//!   pkg/scheduler/framework/plugins/dynamicresources/dynamicresources.go), binds the pod, and the
//!   kubelet stand-in prepares it, once.
//! - **kubelet retries**: nvdra's plugin without binding conditions (a 1.35 server): each pod is
//!   bound at once and its prepare fails at once, with the reason, until the daemon is ready; the
//!   kubelet stand-in retries a failed NodePrepareResources on the kubelet's cadence: its pod
//!   worker requeues a pod whose sync failed after `wait.Jitter(backOffPeriod, 0.5)`, 10 to 15 s
//!   (`backOffPeriod = 10 * time.Second`, pkg/kubelet/kubelet.go;
//!   `workerBackOffPeriodJitterFactor = 0.5`, pkg/kubelet/pod_workers.go).
//! - **NVIDIA's shape**: as the previous, but each kubelet call is held the way NVIDIA's
//!   compute-domain plugin holds it (cmd/compute-domain-kubelet-plugin/driver.go: the prepare
//!   retries in a work queue with `DefaultPrepUnprepRateLimiter`, a per-item backoff of 250 ms
//!   doubling to 3 s, pkg/workqueue/workqueue.go, within `ErrorRetryMaxTimeout` = 45 s, after
//!   which the kubelet gets the error and backs off as above). nvdra's prepare answers each
//!   attempt at once; the stand-in repeats it on that schedule, so each of NVIDIA's in-call
//!   attempts costs here what one of nvdra's prepares costs.
//!
//! Figures per flow, from the domain's creation: the domain's `status.status` Ready, all 18
//! channel claims prepared; failed prepare attempts (and, of those, the kubelet calls that
//! returned an error); 409 Conflicts the API server answered; HTTP requests to the API server
//! per node (plugins, daemons and the controller; the stand-ins act on the store directly), with
//! the commonest requests. One run of each flow: seconds of waiting on timers dominate, and the
//! kubelet's jitter is random.
//!
//! Run: `cargo bench --bench compute_domain` (`CD_BENCH_NODES=N` for another node count,
//! `CD_BENCH_FLOWS=nvdra,kubelet,nvidia` for some of the flows).

#[path = "../tests/support/cd_cluster.rs"]
mod cd_cluster;
#[path = "../tests/support/fake_nvml.rs"]
mod fake_nvml;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use cd_cluster::{Cluster, NS, Options};
use kubelet_plugin::Claim;
use kubelet_plugin::testing::KubeletClient;

const DOMAIN: &str = "imex";
const TEMPLATE: &str = "imex-channel";
/// The kubelet's `backOffPeriod` and its pod worker's jitter factor.
const KUBELET_BACKOFF: Duration = Duration::from_secs(10);
const KUBELET_JITTER: f64 = 0.5;
/// NVIDIA's plugin: per-item backoff 250 ms doubling to 3 s, within 45 s per kubelet call.
const NVIDIA_FIRST: Duration = Duration::from_millis(250);
const NVIDIA_MAX: Duration = Duration::from_secs(3);
const NVIDIA_CALL: Duration = Duration::from_secs(45);
/// The binding condition nvdra's plugin sets once the node's daemon is Ready.
const READY_CONDITION: &str = "ComputeDomainReady";
/// How often kube-scheduler's PreBind reads a claim whose binding conditions it waits for.
const PREBIND_POLL: Duration = Duration::from_secs(5);

#[derive(Clone, Copy, PartialEq, Eq)]
enum Flow {
    /// Binding conditions on a 1.36 server.
    Nvdra,
    /// Bound at once, the kubelet retrying a failed prepare.
    KubeletRetries,
    /// Bound at once, each kubelet call held in NVIDIA's retry loop.
    Nvidia,
}

impl Flow {
    fn key(self) -> &'static str {
        match self {
            Flow::Nvdra => "nvdra",
            Flow::KubeletRetries => "kubelet",
            Flow::Nvidia => "nvidia",
        }
    }

    fn title(self) -> &'static str {
        match self {
            Flow::Nvdra => "nvdra: binding conditions (1.36 server), one prepare per pod",
            Flow::KubeletRetries => "bound at once, prepare fails until ready, kubelet retries",
            Flow::Nvidia => "NVIDIA's shape: bound at once, prepare held in NVIDIA's loop",
        }
    }
}

#[derive(Default)]
struct Failures {
    /// Prepare attempts that failed.
    attempts: AtomicU64,
    /// Of those, the kubelet calls that returned an error.
    calls: AtomicU64,
}

struct Figures {
    ready: Duration,
    prepared: Duration,
    failed_attempts: u64,
    failed_calls: u64,
    conflicts: u64,
    requests: u64,
    by_kind: Vec<(String, u64)>,
}

/// The kubelet stand-in for one bound pod: NodePrepareResources until it succeeds, each call
/// held in NVIDIA's loop or not, the kubelet's backoff after a failed call. Returns when the
/// claim was prepared.
async fn kubelet(
    mut client: KubeletClient,
    claim: Claim,
    nvidia_loop: bool,
    failures: Arc<Failures>,
) -> Instant {
    loop {
        let call = Instant::now();
        let mut delay = NVIDIA_FIRST;
        loop {
            if cd_cluster::prepare(&mut client, &claim).await.is_ok() {
                return Instant::now();
            }
            failures.attempts.fetch_add(1, Ordering::Relaxed);
            if !nvidia_loop || call.elapsed() + delay >= NVIDIA_CALL {
                break;
            }
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(NVIDIA_MAX);
        }
        failures.calls.fetch_add(1, Ordering::Relaxed);
        let jitter = 1.0 + KUBELET_JITTER * rand::random::<f64>();
        tokio::time::sleep(KUBELET_BACKOFF.mul_f64(jitter)).await;
    }
}

/// `GET`/`LIST`/`WATCH`/`PUT`/... and the resource of a request (`pods`, `computedomaincliques`,
/// `resourceclaims/status`...).
fn kind(method: &str, path: &str, query: &str) -> String {
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    // `api/v1/...` or `apis/<group>/<version>/...`.
    let mut rest: &[&str] = match segs.first() {
        Some(&"api") => segs.get(2..).unwrap_or_default(),
        _ => segs.get(3..).unwrap_or_default(),
    };
    if rest.first() == Some(&"namespaces") && rest.len() > 2 {
        rest = &rest[2..];
    }
    let resource = rest.first().copied().unwrap_or("?");
    let sub = if rest.get(2) == Some(&"status") {
        "/status"
    } else {
        ""
    };
    let verb = match method {
        "GET" if query.contains("watch=true") || query.contains("watch=1") => "WATCH",
        "GET" if rest.len() == 1 => "LIST",
        m => m,
    };
    format!("{verb} {resource}{sub}")
}

async fn run(flow: Flow, nodes: usize, net: u8) -> Figures {
    let mut c = Cluster::start(Options {
        nodes,
        net,
        binding_conditions: if flow == Flow::Nvdra { "auto" } else { "off" },
        server_minor: if flow == Flow::Nvdra { 36 } else { 35 },
        resync_seconds: None,
        daemon_env: Vec::new(),
        cdi_root: None,
        fake_nvml: fake_nvml::library(),
    })
    .await;
    let before = c.api.counts();
    let first_request = c.api.requests().len();
    let failures = Arc::new(Failures::default());

    let t0 = Instant::now();
    c.create_domain(DOMAIN, nodes, TEMPLATE).await;
    let template = c.template(TEMPLATE).await;
    // Pods waiting for their binding condition: (pod, node index, claim, next PreBind poll).
    let mut waiting = Vec::new();
    let mut kubelets = Vec::new();
    for i in 0..nodes {
        let node = c.nodes[i].name.clone();
        let bound = flow != Flow::Nvdra;
        let pod = c.workload_pod(&format!("worker-{i}"), TEMPLATE, bound.then_some(&node));
        let claim = cd_cluster::allocated_from(&c.api, &template, &pod, &node, "channel-0");
        if bound {
            let client = c.nodes[i].kubelet().await.clone();
            kubelets.push(tokio::spawn(kubelet(
                client,
                claim,
                flow == Flow::Nvidia,
                failures.clone(),
            )));
        } else {
            waiting.push((pod, i, claim, Instant::now()));
        }
    }
    let deadline = t0 + cd_cluster::DEADLINE;
    let mut ready = None;
    loop {
        c.run_daemonsets().await;
        // The scheduler stand-in binds a pod once its PreBind poll finds the claim's binding
        // condition True.
        let mut still = Vec::new();
        for (mut pod, i, claim, poll) in waiting {
            if poll > Instant::now() {
                still.push((pod, i, claim, poll));
            } else if cd_cluster::device_condition(&c.api, &claim, READY_CONDITION) {
                let current = c
                    .api
                    .object("v1", "pods", NS, pod["metadata"]["name"].as_str().unwrap())
                    .unwrap_or(pod);
                pod = current;
                pod["spec"]["nodeName"] = c.nodes[i].name.clone().into();
                c.api.put_object("v1", "pods", pod);
                let client = c.nodes[i].kubelet().await.clone();
                kubelets.push(tokio::spawn(kubelet(
                    client,
                    claim,
                    false,
                    failures.clone(),
                )));
            } else {
                still.push((pod, i, claim, poll + PREBIND_POLL));
            }
        }
        waiting = still;
        if ready.is_none()
            && c.domain(DOMAIN)
                .is_some_and(|d| d["status"]["status"] == "Ready")
        {
            ready = Some(t0.elapsed());
        }
        if ready.is_some() && waiting.is_empty() && kubelets.iter().all(|k| k.is_finished()) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{}: waited {:?} for the domain Ready and every claim prepared ({} pods unbound, \
             {} of {} prepares done; domain {:?}); logs:\n{}",
            flow.key(),
            cd_cluster::DEADLINE,
            waiting.len(),
            kubelets.iter().filter(|k| k.is_finished()).count(),
            kubelets.len(),
            c.domain(DOMAIN),
            c.logs()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut prepared = Duration::ZERO;
    for k in kubelets {
        prepared = prepared.max(k.await.expect("a kubelet stand-in") - t0);
    }
    let after = c.api.counts();
    let mut by_kind: BTreeMap<String, u64> = BTreeMap::new();
    for r in &c.api.requests()[first_request..] {
        *by_kind
            .entry(kind(&r.method, &r.path, &r.query))
            .or_default() += 1;
    }
    let mut by_kind: Vec<(String, u64)> = by_kind.into_iter().collect();
    by_kind.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    Figures {
        ready: ready.unwrap_or_default(),
        prepared,
        failed_attempts: failures.attempts.load(Ordering::Relaxed),
        failed_calls: failures.calls.load(Ordering::Relaxed),
        conflicts: after.conflicts - before.conflicts,
        requests: after.requests - before.requests,
        by_kind,
    }
}

fn secs(d: Duration) -> String {
    format!("{:.1} s", d.as_secs_f64())
}

#[tokio::main]
async fn main() {
    let nodes: usize = std::env::var("CD_BENCH_NODES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(18);
    let wanted = std::env::var("CD_BENCH_FLOWS").unwrap_or_default();
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    println!(
        "compute domain, creation to all {nodes} nodes ready ({cores} cores; one run per flow)"
    );
    // A loopback network of their own per flow: no flow binds where the last one's sockets
    // linger.
    for (flow, net) in [
        (Flow::Nvdra, 62),
        (Flow::KubeletRetries, 63),
        (Flow::Nvidia, 64),
    ] {
        if !wanted.is_empty() && !wanted.split(',').any(|w| w == flow.key()) {
            continue;
        }
        let f = run(flow, nodes, net).await;
        println!("\n{}", flow.title());
        println!("  domain Ready:                 {}", secs(f.ready));
        println!(
            "  all {nodes} channel claims prepared: {}",
            secs(f.prepared)
        );
        println!(
            "  failed prepare attempts:      {} ({} kubelet calls returned an error)",
            f.failed_attempts, f.failed_calls
        );
        println!("  409 Conflicts:                {}", f.conflicts);
        println!(
            "  API requests:                 {} ({:.1} per node)",
            f.requests,
            f.requests as f64 / nodes as f64
        );
        let top: Vec<String> = f
            .by_kind
            .iter()
            .take(10)
            .map(|(k, n)| format!("{k} {n}"))
            .collect();
        println!("    commonest: {}", top.join(", "));
    }
}
