//! Compute domains end to end (issue 37, Must show), as processes on the simulated cluster of
//! `tests/support/cd_cluster.rs`: simulated GB200 trays, each with its own `nvdra compute-domain
//! plugin` process, the `nvdra compute-domain controller` process and, per node, an `nvdra
//! compute-domain daemon` process running the fake `nvidia-imex`.
//!
//! - A ComputeDomain created in the test API server goes Ready across 4 trays; then a pod's claim
//!   gets a CDI spec with the channel device, which podman turns into a char device of the known
//!   major.
//! - A daemon whose IMEX never gets ready leaves its node's channel tainted and the domain
//!   NotReady with the node and IMEX's error line, and nothing crash-loops: one test for the
//!   three effects together.
//!
//! There is no kube-scheduler, kubelet, resourceclaim or DaemonSet controller here: the tests
//! play them through the API server and the plugins' DRA sockets (see `cd_cluster`). Each
//! workload pod is bound to its node at once (NVIDIA's shape; the plugins run with binding
//! conditions off) and the kubelet's NodePrepareResources is retried while it fails (the daemon
//! is not ready: nvdra's prepare answers at once, never loops, and labels the node so the
//! domain's DaemonSet brings the daemon there).

use std::time::Duration;

use kubelet_plugin::Claim;
use serde_json::Value;

use crate::support::cd_cluster::{self, Cluster, MAJOR, Options};
use crate::support::podman as engine;

const NODES: usize = 4;
const DOMAIN: &str = "imex";
const TEMPLATE: &str = "imex-channel";

/// What makes the daemons quick for a test: readiness checked every 200 ms, SIGUSR1 never held
/// back (the bench keeps the defaults).
fn quick_daemons() -> Vec<(String, String)> {
    [
        ("NVDRA_CD_CHECK_INTERVAL_MS", "200"),
        ("NVDRA_CD_SIGUSR1_INTERVAL_MS", "0"),
        ("FAKE_IMEX_SIGUSR1_WINDOW", "0"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect()
}

fn options(net: u8, cdi_root: Option<std::path::PathBuf>) -> Options {
    Options {
        nodes: NODES,
        net,
        binding_conditions: "off",
        server_minor: 35,
        resync_seconds: Some(1),
        daemon_env: quick_daemons(),
        cdi_root,
        fake_nvml: crate::support::fake_nvml::library(),
    }
}

/// One workload pod per node, bound to it, each with a claim from the domain's template
/// allocated the node's `channel-0`.
async fn workload(c: &mut Cluster) -> Vec<Claim> {
    let template = c.template(TEMPLATE).await;
    let mut claims = Vec::new();
    for i in 0..c.nodes.len() {
        let node = c.nodes[i].name.clone();
        let pod = c.workload_pod(&format!("worker-{i}"), TEMPLATE, Some(&node));
        claims.push(cd_cluster::allocated_from(
            &c.api,
            &template,
            &pod,
            &node,
            "channel-0",
        ));
    }
    claims
}

/// The cluster's loop: the kubelets' prepares (retried while the daemon is not ready) and the
/// DaemonSet controller's pods, until `done` says so (given which claims are prepared).
async fn drive(
    c: &mut Cluster,
    claims: &[Claim],
    prepared: &mut [Option<Vec<String>>],
    what: &str,
    mut done: impl FnMut(&Cluster, &[Option<Vec<String>>]) -> bool,
) {
    let deadline = tokio::time::Instant::now() + cd_cluster::DEADLINE;
    loop {
        for (i, claim) in claims.iter().enumerate() {
            if prepared[i].is_none()
                && let Ok(got) = c.nodes[i].prepare(claim).await
            {
                prepared[i] = Some(got);
            }
        }
        c.run_daemonsets().await;
        if done(c, prepared) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "waited {:?} for {what}, in vain (prepared: {:?}; domain: {:?}); logs:\n{}",
            cd_cluster::DEADLINE,
            prepared.iter().map(Option::is_some).collect::<Vec<_>>(),
            c.domain(DOMAIN),
            c.logs()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[test]
fn a_domain_goes_ready_across_four_plugins_and_a_pod_gets_its_channel_under_podman() {
    engine::with_engine(|e| {
        let rt = tokio::runtime::Runtime::new()?;
        rt.block_on(run(e.has_spec_dir_flag))
    });
}

async fn run(spec_dir_flag: bool) -> anyhow::Result<()> {
    // Without --cdi-spec-dir podman reads the system directory only.
    let cdi_root = (!spec_dir_flag).then(|| std::path::PathBuf::from(engine::SYSTEM_CDI_DIR));
    let mut c = Cluster::start(options(61, cdi_root)).await;
    c.create_domain(DOMAIN, NODES, TEMPLATE).await;
    let claims = workload(&mut c).await;
    let mut prepared = vec![None; NODES];
    drive(
        &mut c,
        &claims,
        &mut prepared,
        "the domain Ready and every channel prepared",
        |c, prepared| {
            prepared.iter().all(Option::is_some)
                && c.domain(DOMAIN)
                    .is_some_and(|d| d["status"]["status"] == "Ready")
        },
    )
    .await;
    let cd = c.domain(DOMAIN).unwrap();
    let nodes_ready = cd["status"]["nodes"]
        .as_array()
        .map(|n| n.iter().filter(|n| n["status"] == "Ready").count());
    anyhow::ensure!(
        nodes_ready == Some(NODES),
        "the domain is Ready with {nodes_ready:?} nodes: {cd}"
    );

    // Every node served the domain's daemon, in the clique the profile gives its GPUs.
    let clique = cd_cluster::clique_of("node-0");
    let cliques = c
        .api
        .objects("resource.nvidia.com/v1beta1", "computedomaincliques");
    let entries: Vec<&Value> = cliques
        .iter()
        .flat_map(|c| c["daemons"].as_array().into_iter().flatten())
        .collect();
    anyhow::ensure!(
        entries.len() == NODES
            && entries
                .iter()
                .all(|d| d["status"] == "Ready" && d["cliqueID"] == clique.as_str()),
        "clique entries: {cliques:?}"
    );

    // The pod on node-0 runs with its channel: the CDI spec's char device, of the known major.
    let ids = prepared[0].clone().unwrap();
    let runner = engine::Engine {
        has_spec_dir_flag: spec_dir_flag,
    };
    let out = runner.run_with_device(
        &c.cdi_root,
        &ids[0],
        "ls -l /dev/nvidia-caps-imex-channels/",
    )?;
    // The workload's claims go as the kubelet would unprepare them (their spec files too).
    for (i, claim) in claims.iter().enumerate() {
        let answers = c.nodes[i]
            .kubelet()
            .await
            .unprepare(std::slice::from_ref(claim))
            .await?;
        anyhow::ensure!(answers[&claim.uid].is_ok(), "{answers:?}");
    }
    let stdout = engine::ok(&out, &format!("podman run --device {}", ids[0]))?;
    let line = stdout
        .lines()
        .find(|l| l.ends_with(" channel0"))
        .ok_or_else(|| anyhow::anyhow!("no channel0 in the container:\n{stdout}"))?;
    anyhow::ensure!(
        line.starts_with('c') && line.contains(&format!("{MAJOR},")) && line.contains(" 0 "),
        "channel0 is not the char device {MAJOR}:0 in the container: {line}"
    );
    Ok(())
}

/// The never-ready Must-show, its three effects in one run: node-3's fake IMEX never gets ready
/// (`FAKE_IMEX_NEVER_READY`, which also logs the error line); the other three nodes go Ready.
/// Then (a) node-3's `channel-0` carries the daemon-not-ready NoSchedule taint and the others'
/// do not, (b) the domain is NotReady, its Ready condition naming node-3 and IMEX's error line,
/// (c) node-3's daemon keeps its pid and started IMEX once over several readiness rounds, and
/// no plugin or daemon exited.
#[test]
fn a_daemon_that_never_gets_ready_taints_its_channel_and_holds_the_domain_not_ready_without_a_crash_loop()
 {
    const LINE: &str = "GPU fabric probe failed: NVLink fabric manager unreachable";
    const TAINT: &str = "compute-domain.nvidia.com/daemon-not-ready";
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut o = options(66, None);
        // The plugins' readiness pass every second, so several pass in the rounds below.
        o.resync_seconds = Some(1);
        let mut c = Cluster::start(o).await;
        let record = c.root.path().join("node-3-imex.record");
        c.nodes[3].daemon_env = vec![
            ("FAKE_IMEX_NEVER_READY".into(), LINE.into()),
            ("FAKE_IMEX_RECORD".into(), record.display().to_string()),
        ];
        c.create_domain(DOMAIN, NODES, TEMPLATE).await;
        let claims = workload(&mut c).await;
        let mut prepared = vec![None; NODES];
        let not_ready = |c: &Cluster| -> Option<Value> {
            let cd = c.domain(DOMAIN)?;
            let ready = cd["status"]["conditions"]
                .as_array()?
                .iter()
                .find(|x| x["type"] == "Ready")?
                .clone();
            (cd["status"]["status"] == "NotReady"
                && ready["status"] == "False"
                && ready["message"]
                    .as_str()
                    .is_some_and(|m| m.contains("node-3") && m.contains(LINE)))
            .then_some(ready)
        };
        let tainted = |c: &Cluster, node: &str| -> bool {
            cd_cluster::device(&c.api, node, "channel-0")
                .and_then(|d| d["taints"].as_array().cloned())
                .into_iter()
                .flatten()
                .any(|t| t["key"] == TAINT && t["effect"] == "NoSchedule")
        };
        // Nodes 0-2 first: node-3's IMEX then starts with every peer listening, so the last
        // error line it logs is the fault's, not a refused connection to a peer starting late.
        drive(
            &mut c,
            &claims[..3],
            &mut prepared[..3],
            "nodes 0-2 prepared",
            |_, prepared| prepared.iter().all(Option::is_some),
        )
        .await;
        drive(
            &mut c,
            &claims,
            &mut prepared,
            "node-3's channel tainted and the domain NotReady with its line",
            |c, prepared| {
                prepared[..3].iter().all(Option::is_some)
                    && c.nodes[3].daemon.is_some()
                    && tainted(c, "node-3")
                    && not_ready(c).is_some()
            },
        )
        .await;
        let daemon = c.nodes[3].daemon.as_ref().unwrap().pid();

        // Several readiness rounds later (the daemon checks every 200 ms, the plugins pass every
        // second, the kubelet keeps retrying node-3's prepare), nothing has changed: ...
        let until = tokio::time::Instant::now() + Duration::from_secs(5);
        while tokio::time::Instant::now() < until {
            drive(&mut c, &claims, &mut prepared, "a round", |_, _| true).await;
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        // (a) node-3's channel alone is tainted, and its prepare still fails with the reason;
        for n in &c.nodes[..3] {
            assert!(
                !tainted(&c, &n.name),
                "{}'s channel is tainted: {:?}",
                n.name,
                cd_cluster::device(&c.api, &n.name, "channel-0")
            );
        }
        let node3 = c.nodes[3].name.clone();
        assert!(
            tainted(&c, &node3),
            "node-3's channel is not tainted: {:?}",
            cd_cluster::device(&c.api, &node3, "channel-0")
        );
        assert!(prepared[3].is_none(), "node-3's channel was prepared");
        let err = c.nodes[3].prepare(&claims[3]).await.unwrap_err();
        assert!(err.contains("not ready"), "{err}");
        // (b) the domain is NotReady, its Ready condition naming node-3 and IMEX's line;
        let ready = not_ready(&c).unwrap_or_else(|| panic!("{:?}", c.domain(DOMAIN)));
        assert_eq!(ready["reason"], "DaemonNotReady", "{ready}");
        // (c) no process exited (c.alive() panics with the log of one that did), node-3's daemon
        // is the same process, and it started IMEX once.
        c.alive();
        assert_eq!(c.nodes[3].daemon.as_ref().unwrap().pid(), daemon);
        let starts = std::fs::read_to_string(&record).unwrap();
        assert_eq!(
            starts.lines().filter(|l| l.starts_with("start ")).count(),
            1,
            "IMEX was started again: {starts}"
        );
    });
}
