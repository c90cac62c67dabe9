//! `nvdra compute-domain daemon` (issue 37 item 4) with the fake `nvidia-imex` and
//! `nvidia-imex-ctl` of `tests/data/fake-imex/`: real IMEX stand-in processes talking TCP on
//! loopback (each node its own `127.<test>.0.<node>`), the daemons driven round by round in this
//! process and sharing one clique store ([`MemoryCliques`], with the API server's
//! resourceVersion conflicts). What a node's entry says, what the events on the clique object
//! say, what the fakes recorded (starts, SIGUSR1) and what `nvidia-imex-ctl` answers are the
//! observations; every wait has a deadline and asserts no speed.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use nvdra::computedomain::api::{
    ComputeDomainClique, DAEMON_PEERS_ANNOTATION, DAEMON_REASON_ANNOTATION, STATUS_NOT_READY,
    STATUS_READY,
};
use nvdra::computedomain::controller::status::report;
use nvdra::computedomain::daemon::clique::{Me, MemoryCliques};
use nvdra::computedomain::daemon::imex;
use nvdra::computedomain::daemon::{
    Daemon, EVENT_NOT_READY, FabricProbe, Mode, NoFabricCheck, Report, Settings,
};

use crate::support::apiserver::TestApiServer;
use crate::support::wait::{self, SOON};

const CLIQUE: &str = "6c1f0a3e-0000-4000-8000-000000000001.1";
const OBJECT: &str = "uid-1.6c1f0a3e-0000-4000-8000-000000000001.1";

fn fake(tool: &str) -> String {
    format!("{}/tests/data/fake-imex/{tool}", env!("CARGO_MANIFEST_DIR"))
}

/// IMEX's peer and command ports for this test process: two ports the kernel handed out as free,
/// so that two runs of these tests at once (each node of a test has a fixed loopback address)
/// do not bind each other's `127.<test>.0.<node>:<port>`. Every node of a test shares them, as
/// every IMEX daemon of a domain shares its `SERVER_PORT`.
fn ports() -> (u16, u16) {
    static PORTS: std::sync::OnceLock<(u16, u16)> = std::sync::OnceLock::new();
    *PORTS.get_or_init(|| {
        let a = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let b = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        (
            a.local_addr().unwrap().port(),
            b.local_addr().unwrap().port(),
        )
    })
}

/// One node's files and settings.
struct Node {
    settings: Settings,
    record: PathBuf,
}

/// Node `i` of test `t`: IP `127.<t>.0.<i+1>`, its own config dir (with an NVIDIA-shaped
/// template carrying the fake's knobs) and hosts file.
fn node(dir: &Path, t: u8, i: u8, knobs: &str) -> Node {
    let ip = format!("127.{t}.0.{}", i + 1);
    let root = dir.join(format!("node-{i}"));
    let config_dir = root.join("imexd");
    std::fs::create_dir_all(&config_dir).unwrap();
    let hosts = root.join("hosts");
    std::fs::write(&hosts, "127.0.0.1\tlocalhost\n").unwrap();
    let record = root.join("record");
    std::fs::write(
        config_dir.join("imexd.cfg.tmpl"),
        format!(
            "LOG_FILE_NAME=\nDAEMONIZE=0\nBIND_INTERFACE_IP=\nSERVER_PORT={}\n\
             IMEX_NODE_CONFIG_FILE={{{{ .IMEXDaemonNodesConfigPath }}}}\n\
             IMEX_CMD_ENABLED=1\nIMEX_CMD_BIND_INTERFACE_IP={{{{ .IMEXCmdBindInterfaceIP }}}}\n\
             IMEX_CMD_PORT={}\nFAKE_IMEX_HOSTS={}\nFAKE_IMEX_RECORD={}\n\
             FAKE_IMEX_SIGUSR1_WINDOW=0\n{knobs}",
            ports().0,
            ports().1,
            hosts.display(),
            record.display()
        ),
    )
    .unwrap();
    Node {
        settings: Settings {
            me: Me {
                node_name: format!("node-{i}"),
                ip,
                clique_id: CLIQUE.into(),
                max_nodes: 4,
            },
            object: OBJECT.into(),
            namespace: "nvdra".into(),
            domain_uid: "uid-1".into(),
            mode: Mode::Managed {
                imex: fake("nvidia-imex"),
                ctl: fake("nvidia-imex-ctl"),
            },
            config_dir,
            hosts_file: hosts,
            interval: Duration::from_millis(50),
            usr1_interval: Duration::ZERO,
            max_backoff: Duration::from_secs(2),
        },
        record,
    }
}

/// The lines `event` of a fake's record file, by pid.
fn recorded(record: &Path, event: &str) -> Vec<String> {
    std::fs::read_to_string(record)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.strip_prefix(&format!("{event} ")).map(str::to_string))
        .collect()
}

/// A fabric registration a test completes when it wants.
#[derive(Clone, Default)]
struct Registration(Arc<AtomicBool>);

impl FabricProbe for Registration {
    fn check(&self, clique_id: &str) -> Result<(), String> {
        if self.0.load(Ordering::SeqCst) {
            Ok(())
        } else {
            Err(format!(
                "fabric registration in progress for clique {clique_id}"
            ))
        }
    }
}

/// Steps every daemon, round after round, until `cond` holds of their reports (panics naming
/// `what` after [`SOON`]); returns the last reports.
async fn rounds(
    daemons: &mut [&mut Daemon<MemoryCliques>],
    what: &str,
    cond: impl FnMut(&[Report]) -> bool,
) -> Vec<Report> {
    rounds_within(SOON, daemons, what, cond).await
}

/// [`rounds`] with a deadline of its own.
async fn rounds_within(
    within: Duration,
    daemons: &mut [&mut Daemon<MemoryCliques>],
    what: &str,
    mut cond: impl FnMut(&[Report]) -> bool,
) -> Vec<Report> {
    let deadline = Instant::now() + within;
    loop {
        let mut reports = Vec::new();
        for d in daemons.iter_mut() {
            reports.push(d.step().await);
        }
        if cond(&reports) {
            return reports;
        }
        assert!(
            Instant::now() < deadline,
            "waited {within:?} for {what}, in vain: {reports:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn entry_status(store: &MemoryCliques, node: &str) -> String {
    let c = store.object(OBJECT).expect("the clique object");
    let d = c
        .daemons
        .iter()
        .find(|d| d.node_name == node)
        .expect("the node's entry");
    d.status.clone()
}

fn ctl(settings: &Settings, query: &str) -> String {
    let out = std::process::Command::new(fake("nvidia-imex-ctl"))
        .args([
            "-c",
            &settings.config_dir.join("imexd.cfg").display().to_string(),
            query,
        ])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_flips_to_ready_when_the_peers_connect() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(MemoryCliques::default());
    let (a, b) = (node(dir.path(), 231, 0, ""), node(dir.path(), 231, 1, ""));
    let b_fabric = Registration::default();
    let mut da = Daemon::new(a.settings.clone(), store.clone(), Box::new(NoFabricCheck));
    let mut db = Daemon::new(
        b.settings.clone(),
        store.clone(),
        Box::new(b_fabric.clone()),
    );

    // B's GPUs are still registering with the fabric: B writes its entry, NotReady with that
    // reason, and runs no IMEX; A, which waits for B, is NotReady too.
    let r = rounds(&mut [&mut db], "B's entry", |r| !r[0].status.is_empty()).await;
    assert_eq!(r[0].status, STATUS_NOT_READY);
    assert!(
        r[0].reason.contains("fabric registration in progress"),
        "{r:?}"
    );
    assert_eq!(db.imex_starts(), 0);
    let r = rounds(&mut [&mut da, &mut db], "A waiting for B", |r| {
        r[0].reason.contains("WAITING_FOR_PEERS")
    })
    .await;
    assert_eq!(r[0].status, STATUS_NOT_READY);
    assert_eq!(entry_status(&store, "node-0"), STATUS_NOT_READY);
    assert!(
        store.events().iter().any(|e| e.reason == EVENT_NOT_READY
            && e.message.contains("node-1")
            && e.message.contains("fabric registration in progress")),
        "{:?}",
        store.events()
    );

    // The registration completes: B starts IMEX, both connect, both Ready.
    b_fabric.0.store(true, Ordering::SeqCst);
    rounds(&mut [&mut da, &mut db], "both Ready", |r| {
        r.iter().all(|r| r.status == STATUS_READY)
    })
    .await;
    assert_eq!(entry_status(&store, "node-0"), STATUS_READY);
    assert_eq!(entry_status(&store, "node-1"), STATUS_READY);
    // Each is the other's peer under its per-domain name (B wrote its entry first: index 0),
    // in its own hosts file.
    let hosts = std::fs::read_to_string(&a.settings.hosts_file).unwrap();
    assert!(
        hosts.contains("127.231.0.2\tcompute-domain-daemon-0000\n"),
        "{hosts}"
    );
    assert!(
        hosts.contains("127.231.0.1\tcompute-domain-daemon-0001\n"),
        "{hosts}"
    );
    assert!(hosts.starts_with("127.0.0.1\tlocalhost\n"), "{hosts}");
    // IMEX's node table (`nvidia-imex-ctl -N`, the real tool's shape): each sees the other;
    // the two names no daemon holds do not answer.
    let table = imex::parse_domain_status(&ctl(&a.settings, "-N")).unwrap();
    assert_eq!(table.nodes.len(), 4);
    assert_eq!(table.connected_from(0), ["compute-domain-daemon-0001"]);
    assert_eq!(table.connected_from(1), ["compute-domain-daemon-0000"]);
    assert_eq!(table.links[&(2, 0)], "I");
    assert_eq!(table.nodes[&3].1, "UNAVAILABLE");

    // A's pod ends: its IMEX stops and its entry leaves the object.
    da.stop().await;
    let c = store.object(OBJECT).unwrap();
    assert_eq!(
        c.daemons
            .iter()
            .map(|d| d.node_name.as_str())
            .collect::<Vec<_>>(),
        ["node-1"]
    );
    db.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_joins_is_reached_through_sigusr1_without_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(MemoryCliques::default());
    let (a, b) = (node(dir.path(), 232, 0, ""), node(dir.path(), 232, 1, ""));
    let mut da = Daemon::new(a.settings.clone(), store.clone(), Box::new(NoFabricCheck));
    // A alone: Ready (no peer to wait for).
    rounds(&mut [&mut da], "A Ready alone", |r| {
        r[0].status == STATUS_READY
    })
    .await;
    assert!(recorded(&a.record, "sigusr1").is_empty());

    // B joins. A's IMEX resolved the names when it started, so only the SIGUSR1 the daemon
    // sends on the peer change makes it reach B.
    let mut db = Daemon::new(b.settings.clone(), store.clone(), Box::new(NoFabricCheck));
    rounds(&mut [&mut da, &mut db], "A connected to B", |r| {
        r.iter().all(|r| r.status == STATUS_READY)
            && imex::parse_domain_status(&ctl(&a.settings, "-N"))
                .is_ok_and(|t| t.connected_from(0).contains(&"compute-domain-daemon-0001"))
    })
    .await;
    let starts = recorded(&a.record, "start");
    assert_eq!(starts.len(), 1, "A's IMEX was not restarted");
    assert_eq!(
        recorded(&a.record, "sigusr1"),
        starts,
        "one SIGUSR1, to A's IMEX"
    );
    da.stop().await;
    db.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemon_that_never_gets_ready_reports_why_and_stays_up() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(MemoryCliques::default());
    let a = node(
        dir.path(),
        233,
        0,
        "FAKE_IMEX_NEVER_READY=GPU fabric probe failed: NVLink fabric manager unreachable\n",
    );
    let mut da = Daemon::new(a.settings.clone(), store.clone(), Box::new(NoFabricCheck));
    // (IMEX may write its error line before its command service answers: wait for both.)
    let r = rounds(&mut [&mut da], "the IMEX error in the reason", |r| {
        r[0].reason.contains("fabric manager unreachable")
            && r[0].reason.starts_with("nvidia-imex-ctl -q: INITIALIZING")
    })
    .await;
    assert_eq!(r[0].status, STATUS_NOT_READY);
    assert!(
        r[0].reason
            .starts_with("nvidia-imex-ctl -q: INITIALIZING; last IMEX error: "),
        "{r:?}"
    );
    assert_eq!(entry_status(&store, "node-0"), STATUS_NOT_READY);
    let events = store.events();
    let e = events
        .iter()
        .rfind(|e| e.reason == EVENT_NOT_READY)
        .unwrap();
    assert!(
        e.warning && e.object == OBJECT && e.message.contains("fabric manager unreachable"),
        "{e:?}"
    );

    // Many more rounds: the daemon goes on reporting, IMEX is never restarted (it runs, it is
    // just not ready), and the reason is not written again and again.
    let writes = store.writes();
    let events = store.events().len();
    for _ in 0..20 {
        assert_eq!(da.step().await, r[0]);
    }
    assert_eq!(da.imex_starts(), 1);
    assert_eq!(recorded(&a.record, "start").len(), 1);
    assert_eq!(store.writes(), writes, "no write while nothing changes");
    assert_eq!(
        store.events().len(),
        events,
        "no new event while the reason stays"
    );
    da.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_imex_that_exits_is_started_again_with_a_growing_backoff() {
    // An IMEX that is READY for 2 s and then dies, again and again: each start is seen Ready,
    // and still the wait before the next start grows (1 s, then 2 s). A wait that went back to
    // 1 s on READY would restart a flapping IMEX every second for ever. The maximum wait (10 s)
    // is longer than each run, so no run counts as a healthy one.
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(MemoryCliques::default());
    let mut a = node(dir.path(), 234, 0, "FAKE_IMEX_CRASH_AFTER=2\n");
    a.settings.max_backoff = Duration::from_secs(10);
    let mut da = Daemon::new(a.settings.clone(), store.clone(), Box::new(NoFabricCheck));
    // Two starts and two exits of a Python process each: the longer deadlines are for a loaded
    // machine (they bound a failure, they assert no speed).
    for (n, wait) in [(1, "1s"), (2, "2s")] {
        rounds_within(2 * SOON, &mut [&mut da], &format!("start {n} Ready"), |r| {
            r[0].status == STATUS_READY
        })
        .await;
        let r = rounds_within(2 * SOON, &mut [&mut da], &format!("exit {n}"), |r| {
            r[0].reason.contains("started again after")
        })
        .await;
        assert_eq!(r[0].status, STATUS_NOT_READY);
        assert!(
            r[0].reason.contains(&format!("started again after {wait}")),
            "exit {n}: {r:?}"
        );
        assert!(r[0].reason.contains("exit status: 3"), "{r:?}");
        assert!(
            r[0].reason.contains("last IMEX error: ") && r[0].reason.contains("crashing after"),
            "{r:?}"
        );
    }
    let seen = store.events();
    assert!(
        seen.iter()
            .any(|e| e.message.contains("started again after 1s")),
        "{seen:?}"
    );
    assert_eq!(recorded(&a.record, "crash").len(), 2);
    assert_eq!(da.imex_starts(), 2);
    da.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_imex_is_started_again_and_the_node_gets_ready() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(MemoryCliques::default());
    let a = node(dir.path(), 235, 0, "");
    let mut da = Daemon::new(a.settings.clone(), store.clone(), Box::new(NoFabricCheck));
    rounds(&mut [&mut da], "Ready", |r| r[0].status == STATUS_READY).await;
    let pid: i32 = recorded(&a.record, "start")[0].parse().unwrap();
    std::process::Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status()
        .unwrap();
    rounds(&mut [&mut da], "the exit seen", |r| {
        r[0].reason.contains("signal: 9")
    })
    .await;
    rounds(&mut [&mut da], "Ready again", |r| {
        r[0].status == STATUS_READY
    })
    .await;
    assert_eq!(recorded(&a.record, "start").len(), 2);
    assert_eq!(da.imex_starts(), 2);
    assert_eq!(entry_status(&store, "node-0"), STATUS_READY);
    da.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_managed_only_checks_the_hosts_imex() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(MemoryCliques::default());
    let mut a = node(dir.path(), 236, 0, "");
    // The admin's IMEX, with the admin's config (no template rendering by nvdra).
    let config = dir.path().join("host-imex.cfg");
    std::fs::write(
        &config,
        format!(
            "LOG_FILE_NAME=\nSERVER_PORT={}\nIMEX_NODE_CONFIG_FILE={}\nIMEX_CMD_ENABLED=1\n\
             IMEX_CMD_BIND_INTERFACE_IP=127.236.0.1\nIMEX_CMD_PORT={}\nFAKE_IMEX_RECORD={}\n",
            ports().0,
            dir.path().join("host-nodes.cfg").display(),
            ports().1,
            a.record.display()
        ),
    )
    .unwrap();
    std::fs::write(dir.path().join("host-nodes.cfg"), "127.236.0.1\n").unwrap();
    a.settings.mode = Mode::HostManaged {
        ctl: fake("nvidia-imex-ctl"),
        config: config.clone(),
    };
    let mut da = Daemon::new(a.settings.clone(), store.clone(), Box::new(NoFabricCheck));
    let r = rounds(&mut [&mut da], "NotReady without the host's IMEX", |r| {
        !r[0].status.is_empty()
    })
    .await;
    assert_eq!(r[0].status, STATUS_NOT_READY);
    assert!(r[0].reason.contains("UNAVAILABLE"), "{r:?}");

    let mut host = std::process::Command::new(fake("nvidia-imex"))
        .args(["-c", &config.display().to_string()])
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    rounds(&mut [&mut da], "Ready with the host's IMEX", |r| {
        r[0].status == STATUS_READY
    })
    .await;
    assert_eq!(entry_status(&store, "node-0"), STATUS_READY);
    host.kill().unwrap();
    host.wait().unwrap();
    rounds(&mut [&mut da], "NotReady again", |r| {
        r[0].status == STATUS_NOT_READY
    })
    .await;
    // nvdra started no IMEX and wrote no IMEX files.
    assert_eq!(da.imex_starts(), 0);
    assert_eq!(
        recorded(&a.record, "start").len(),
        1,
        "the admin's start only"
    );
    assert!(!a.settings.config_dir.join("imexd.cfg").exists());
    da.stop().await;
}

// ---------------------------------------------------------------------------------------------
// `nvdra compute-domain daemon` as a process, against the test API server

/// A running `nvdra compute-domain daemon`: SIGTERMed and reaped when dropped, so its IMEX goes
/// too.
struct Process(std::process::Child);

impl Drop for Process {
    fn drop(&mut self) {
        let _ = std::process::Command::new("kill")
            .args(["-TERM", &self.0.id().to_string()])
            .status();
        let _ = self.0.wait();
    }
}

/// `nvdra compute-domain daemon` for `n` with NVIDIA's environment, talking to `server`.
fn spawn(n: &Node, server: &TestApiServer, dir: &Path) -> Process {
    Process(spawn_command(n, server, dir).spawn().unwrap())
}

/// The command of [`spawn`], for a test to add to.
fn spawn_command(n: &Node, server: &TestApiServer, dir: &Path) -> std::process::Command {
    let kubeconfig = dir.join("kubeconfig");
    std::fs::write(&kubeconfig, server.kubeconfig()).unwrap();
    let s = &n.settings;
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_nvdra"));
    cmd.args(["compute-domain", "daemon"])
        .env("CLIQUE_ID", CLIQUE)
        .env("COMPUTE_DOMAIN_UUID", "uid-1")
        .env("COMPUTE_DOMAIN_NAME", "imex-domain")
        .env("COMPUTE_DOMAIN_NAMESPACE", "default")
        .env("NODE_NAME", &s.me.node_name)
        .env("POD_IP", &s.me.ip)
        .env("POD_NAMESPACE", "nvdra")
        .env("MAX_NODES_PER_IMEX_DOMAIN", "4")
        .env("NVDRA_CD_CONFIG_DIR", &s.config_dir)
        .env("NVDRA_CD_HOSTS_FILE", &s.hosts_file)
        .env("NVDRA_CD_IMEX", fake("nvidia-imex"))
        .env("NVDRA_CD_IMEX_CTL", fake("nvidia-imex-ctl"))
        .env("NVDRA_CD_FABRIC_CHECK", "off")
        .env("NVDRA_CD_CHECK_INTERVAL_MS", "100")
        .env("NVDRA_CD_SIGUSR1_INTERVAL_MS", "0")
        .env("KUBECONFIG", &kubeconfig)
        .stderr(std::process::Stdio::null());
    cmd
}

/// The statuses of the clique object's entries, by node, as the API server holds them.
fn statuses(server: &TestApiServer) -> Vec<(String, String)> {
    server
        .get::<ComputeDomainClique>("nvdra", OBJECT)
        .map(|c| {
            c.daemons
                .into_iter()
                .map(|d| (d.node_name, d.status))
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_daemon_processes_form_their_clique_on_the_api_server() {
    let dir = tempfile::tempdir().unwrap();
    let server = TestApiServer::start().await;
    let (a, b) = (node(dir.path(), 241, 0, ""), node(dir.path(), 241, 1, ""));
    let _pa = spawn(&a, &server, dir.path());
    let _pb = spawn(&b, &server, dir.path());
    let ready = |n: &str| (n.to_string(), STATUS_READY.to_string());
    wait::eventually("both entries Ready in the clique object", || {
        let mut s = statuses(&server);
        s.sort();
        s == [ready("node-0"), ready("node-1")]
    })
    .await;
    let c: ComputeDomainClique = server.get("nvdra", OBJECT).unwrap();
    let labels = c.metadata.labels.unwrap_or_default();
    assert_eq!(
        labels
            .get("resource.nvidia.com/computeDomain")
            .map(String::as_str),
        Some("uid-1")
    );
    let mut indices: Vec<i64> = c.daemons.iter().map(|d| d.index).collect();
    indices.sort();
    assert_eq!(indices, [0, 1]);

    // B's pod ends (SIGTERM): its entry leaves the object, and its IMEX stops.
    drop(_pb);
    assert_eq!(statuses(&server), [ready("node-0")]);
    assert_eq!(recorded(&b.record, "stop"), recorded(&b.record, "start"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_never_ready_daemon_process_reports_the_imex_error_and_stays_up() {
    let dir = tempfile::tempdir().unwrap();
    let server = TestApiServer::start().await;
    let a = node(
        dir.path(),
        242,
        0,
        "FAKE_IMEX_NEVER_READY=cannot open /dev/nvidia-caps/nvidia-cap1: no fabric-imex-mgmt\n",
    );
    let mut p = spawn(&a, &server, dir.path());
    let event = wait::until("an event with IMEX's error", SOON, || {
        let found = server.objects("v1", "events").into_iter().find(|e| {
            e["reason"] == EVENT_NOT_READY
                && e["message"]
                    .as_str()
                    .is_some_and(|m| m.contains("no fabric-imex-mgmt"))
        });
        std::future::ready(found)
    })
    .await;
    assert_eq!(event["type"], "Warning");
    assert_eq!(event["involvedObject"]["name"], OBJECT);
    assert_eq!(event["involvedObject"]["kind"], "ComputeDomainClique");
    assert_eq!(
        statuses(&server),
        [("node-0".to_string(), STATUS_NOT_READY.to_string())]
    );

    // It goes on: twenty more rounds (each reads the clique object) and it still runs, with the
    // IMEX it started once, and one event for the one reason.
    let reads = || {
        server
            .requests()
            .iter()
            .filter(|r| r.method == "GET" && r.path.ends_with(OBJECT))
            .count()
    };
    // (An earlier event may say INITIALIZING alone: a round can ask IMEX before its error line
    // is read. The reason with the line stays.)
    let seen = reads();
    let events = server.objects("v1", "events").len();
    wait::eventually("twenty more rounds", || reads() >= seen + 20).await;
    assert!(p.0.try_wait().unwrap().is_none(), "the daemon exited");
    assert_eq!(recorded(&a.record, "start").len(), 1);
    // One event per change of reason, not one per round. Under load a round's query can time out
    // and give another reason (a real change, so an event), but never the same message twice in a
    // row, and far fewer events than rounds.
    let now = server.objects("v1", "events");
    let messages: Vec<&str> = now.iter().filter_map(|e| e["message"].as_str()).collect();
    assert!(
        messages.windows(2).all(|w| w[0] != w[1]),
        "an event repeats the one before it: {messages:#?}"
    );
    assert!(
        now.len() <= events + 3,
        "{} new events in twenty rounds: {messages:#?}",
        now.len() - events
    );
    assert!(
        now.iter().any(|e| e["message"] == event["message"]),
        "the event with IMEX's error line is kept"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fabric_registration_in_progress_is_not_ready_until_it_completes() {
    // The daemon reads the fabric through nvdra's NVML backend, here on the fake NVML (a GB200
    // tray, clique 0b4c…b2e4.1), whose registration a file holds in progress.
    let dir = tempfile::tempdir().unwrap();
    let server = TestApiServer::start().await;
    let lib_dir = dir.path().join("driver/usr/lib64");
    std::fs::create_dir_all(&lib_dir).unwrap();
    std::os::unix::fs::symlink(
        crate::support::fake_nvml::library(),
        lib_dir.join(nvdra::inventory::nvml::LIBRARY),
    )
    .unwrap();
    let fabric = dir.path().join("fabric");
    std::fs::write(&fabric, "in-progress\n").unwrap();
    let a = node(dir.path(), 243, 0, "");
    let clique = "0b4c7e1a-52d3-4f86-9a1e-3c5d7f90b2e4.1";
    let mut cmd = spawn_command(&a, &server, dir.path());
    cmd.env("CLIQUE_ID", clique)
        .env("NVDRA_CD_FABRIC_CHECK", "nvml")
        .env("NVIDIA_DRIVER_ROOT", dir.path().join("driver"))
        .env("FAKE_NVML_PROFILE", "gb200-nvl72")
        .env("FAKE_NVML_SEED", "node-0")
        .env("FAKE_NVML_FABRIC_FILE", &fabric);
    let mut p = Process(cmd.spawn().unwrap());
    let object = format!("uid-1.{clique}");
    let event = wait::until("an event naming the registration", SOON, || {
        let found = server.objects("v1", "events").into_iter().find(|e| {
            e["message"]
                .as_str()
                .is_some_and(|m| m.contains("has not completed its fabric registration"))
        });
        std::future::ready(found)
    })
    .await;
    assert_eq!(event["involvedObject"]["name"], object.as_str());
    let c: ComputeDomainClique = server.get("nvdra", &object).unwrap();
    assert_eq!(c.daemons[0].status, STATUS_NOT_READY);
    assert!(
        recorded(&a.record, "start").is_empty(),
        "no IMEX before the fabric"
    );
    assert!(p.0.try_wait().unwrap().is_none(), "the daemon exited");

    // The fabric manager completes the registration: IMEX starts, the node is Ready.
    std::fs::write(&fabric, "completed\n").unwrap();
    wait::eventually("the entry Ready", || {
        server
            .get::<ComputeDomainClique>("nvdra", &object)
            .is_some_and(|c| c.daemons[0].status == STATUS_READY)
    })
    .await;
    assert_eq!(recorded(&a.record, "start").len(), 1);
}

/// The annotations the controller reads on a daemon's pod: (reason, peers).
fn pod_notes(server: &TestApiServer, pod: &str) -> (Option<String>, Option<String>) {
    let Some(p) = server.get::<Pod>("nvdra", pod) else {
        return (None, None);
    };
    let a = p.metadata.annotations.unwrap_or_default();
    (
        a.get(DAEMON_REASON_ANNOTATION).cloned(),
        a.get(DAEMON_PEERS_ANNOTATION).cloned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_daemon_annotates_its_pod_with_why_and_the_peers_imex_sees() {
    let dir = tempfile::tempdir().unwrap();
    let server = TestApiServer::start().await;
    // A's IMEX cannot reach B (a cut link: the fake reads its fault file at every try).
    let faults = dir.path().join("faults.json");
    std::fs::write(&faults, r#"{"unreachable": ["127.244.0.2"]}"#).unwrap();
    let a = node(
        dir.path(),
        244,
        0,
        &format!("FAKE_IMEX_FAULTS={}\n", faults.display()),
    );
    let b = node(dir.path(), 244, 1, "");
    let mut processes = Vec::new();
    for n in [&a, &b] {
        let pod = format!("daemon-{}", n.settings.me.node_name);
        server.put_object(
            "v1",
            "pods",
            serde_json::json!({
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": pod, "namespace": "nvdra"},
                "spec": {"nodeName": n.settings.me.node_name,
                         "containers": [{"name": "daemon", "image": "nvdra"}]},
            }),
        );
        let mut cmd = spawn_command(n, &server, dir.path());
        cmd.env("POD_NAME", &pod);
        processes.push(Process(cmd.spawn().unwrap()));
    }

    // A says why it is not ready, and its peers lack B; B sees A and is ready.
    wait::eventually("A's pod: the reason, no peer", || {
        let (reason, peers) = pod_notes(&server, "daemon-node-0");
        reason.is_some_and(|r| r.contains("WAITING_FOR_PEERS") && r.contains("no route"))
            && peers.as_deref() == Some("")
    })
    .await;
    wait::eventually("B's pod: ready, A as its peer", || {
        pod_notes(&server, "daemon-node-1") == (Some(String::new()), Some("node-0".into()))
    })
    .await;
    // As the controller reads it.
    let seen = report(&server.get::<Pod>("nvdra", "daemon-node-0").unwrap());
    assert_eq!(seen.peers, Some(Default::default()));
    assert!(
        seen.reason
            .as_deref()
            .is_some_and(|r| r.contains("cannot connect to node")),
        "{seen:?}"
    );

    // Rounds go on (each reads the clique object): the pods are patched on a change only. (A
    // query that times out under load is a change: a few patches, never one per round.)
    let count = |method: &str, tail: &str| {
        server
            .requests()
            .iter()
            .filter(|r| r.method == method && r.path.ends_with(tail))
            .count()
    };
    let patches = || count("PATCH", "/pods/daemon-node-0") + count("PATCH", "/pods/daemon-node-1");
    let (reads, patched) = (count("GET", OBJECT), patches());
    wait::eventually("twenty more rounds", || count("GET", OBJECT) >= reads + 40).await;
    assert!(
        patches() <= patched + 3,
        "{} patches in twenty rounds",
        patches() - patched
    );

    // The link is mended: A is ready, with B as its peer.
    std::fs::write(&faults, "{}").unwrap();
    wait::eventually("A's pod: ready, B as its peer", || {
        pod_notes(&server, "daemon-node-0") == (Some(String::new()), Some("node-1".into()))
    })
    .await;
    let seen = report(&server.get::<Pod>("nvdra", "daemon-node-0").unwrap());
    assert_eq!(seen.reason, None);
    assert_eq!(seen.peers, Some(["node-1".to_string()].into()));
    drop(processes);
}
