//! `nvdra mps-host` with `nvdra run` and the stand-in MPS (`nvdra mps-standin`) as real
//! processes: the faults a node goes through, each with the state after it.
//!
//! - the plugin SIGKILLed and restarted, then replaced by a second instance (a rolling update):
//!   a CUDA client of a share stays connected, and its daemon is the same process;
//! - the plugin stopped and restarted leaves the host's daemons alone, and the last share's
//!   unprepare has the host quit its daemon and remove its directory;
//! - the daemon SIGKILLed: its client fails, as CUDA's do, and the host starts a new daemon that
//!   answers and serves new clients;
//! - a reboot (a new boot id): the host removes the directories of the old boot and keeps one
//!   requested in the new boot;
//! - a `quit` that hangs: the daemon is killed after the deadline and its directory removed;
//! - a daemon serves a second UID only when the request asks for multi-user mode (`-M`).
//!
//! Runs as root (the host gives each daemon its own mount namespace), as the CI does.

use crate::support;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use nvdra::inventory::DeviceBackend;
use support::dra::{prepare_at, terminate, unprepare_at, wait_exit, wait_ready_at};
use support::mps::{self, CudaClient, Host};

const DRIVER: &str = "gpu.nvidia.com";
const NODE: &str = "node-a";
const PROFILE: &str = "dgx-h100";
/// GPU 0, shareable with `--shared-capacity`.
const DEVICE: &str = "gpu-0";

/// A node's directories: API (with share claims), kubelet root, CDI root, driver root with the
/// stand-in MPS, MPS root, boot id file.
struct Node {
    root: tempfile::TempDir,
}

/// `nvdra run`, SIGKILLed when dropped.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Node {
    /// Claims `claim-<uid>` in `default`, each a 16Gi share of GPU 0.
    fn new(shares: &[&str]) -> Node {
        let n = Node {
            root: tempfile::tempdir().unwrap(),
        };
        n.set_boot("boot-1");
        mps::install_standin(&n.p("driver"));
        for (i, uid) in shares.iter().enumerate() {
            mps::write_share_claim(
                &n.p("api"),
                DRIVER,
                NODE,
                uid,
                DEVICE,
                &format!("5f0e0000-0000-4000-8000-{i:012}"),
                "16Gi",
            );
        }
        n
    }

    fn p(&self, s: &str) -> PathBuf {
        self.root.path().join(s)
    }

    fn set_boot(&self, id: &str) {
        std::fs::write(self.p("boot_id"), format!("{id}\n")).unwrap();
    }

    fn host(&self, env: &[(&str, &str)]) -> Host {
        Host::start(&self.p("mps"), &self.p("driver"), &self.p("boot_id"), env)
    }

    fn reg(&self, pod: &str) -> PathBuf {
        self.p(&format!("kubelet/plugins_registry/{DRIVER}-{pod}-reg.sock"))
    }

    fn dra(&self, pod: &str) -> PathBuf {
        self.p(&format!("kubelet/plugins/{DRIVER}/dra-{pod}.sock"))
    }

    /// `nvdra run` as the pod `pod`, serving.
    async fn run(&self, pod: &str) -> Running {
        let mut r = Running(
            support::daemon::nvdra_run(self.root.path(), "dra", NODE)
                .args(["--profile", PROFILE, "--shared-capacity", "--pod-uid", pod])
                .spawn()
                .unwrap(),
        );
        wait_ready_at(&self.reg(pod), &mut r.0).await;
        r
    }

    async fn prepare(&self, pod: &str, uid: &str) {
        let r = prepare_at(&self.dra(pod), uid).await.unwrap();
        assert_eq!(r.error, "", "prepare {uid} through {pod}");
    }

    fn gpu(&self, index: usize) -> String {
        nvdra::inventory::sim::SimBackend::from_profile(PROFILE, NODE)
            .unwrap()
            .snapshot()
            .unwrap()
            .gpus[index]
            .uuid
            .to_string()
    }

    /// GPU 0's share daemon's directory.
    fn gpu0_dir(&self) -> PathBuf {
        mps::gpu_dir(&self.p("mps"), &self.gpu(0))
    }

    fn gpu0_pipe(&self) -> PathBuf {
        self.gpu0_dir().join("pipe")
    }

    fn driver(&self) -> PathBuf {
        self.p("driver")
    }

    /// The share's limits from its claim's CDI spec, as a container's environment has them.
    fn limits(&self, uid: &str) -> Vec<(String, String)> {
        let text =
            std::fs::read_to_string(self.p(&format!("cdi/k8s.{DRIVER}-claim_{uid}.yaml"))).unwrap();
        let spec: nvdra::cdi::Spec = nvdra::yaml::from_str(&text).unwrap();
        std::iter::once(&spec.container_edits)
            .chain(spec.devices.iter().map(|d| &d.container_edits))
            .flat_map(|e| e.env.iter())
            .filter_map(|kv| kv.split_once('='))
            .filter(|(k, _)| k.starts_with("CUDA_MPS_") && *k != "CUDA_MPS_PIPE_DIRECTORY")
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    /// A CUDA client of `uid`'s share, with the share's limits.
    fn client(&self, uid: &str) -> CudaClient {
        let limits = self.limits(uid);
        let env: Vec<(&str, &str)> = limits
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        CudaClient::start(&self.driver(), &self.gpu0_pipe(), &env)
    }
}

fn sigkill(pid: u32) {
    let ok = Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status()
        .unwrap();
    assert!(ok.success());
}

#[tokio::test]
async fn a_client_stays_connected_through_a_plugin_crash_and_a_rolling_update() {
    let n = Node::new(&["s1", "s2", "s3"]);
    let _host = n.host(&[]);
    let first = n.run("pod-1").await;
    n.prepare("pod-1", "s1").await;
    let daemons = mps::daemon_pids(&n.gpu0_dir());
    assert_eq!(daemons.len(), 1, "one daemon for the GPU");
    let mut client = n.client("s1");
    let limit = &n.limits("s1");
    assert!(
        limit
            .iter()
            .any(|(k, _)| k == "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"),
        "{limit:?}"
    );
    for (k, v) in limit {
        let short = match k.as_str() {
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" => "pinned",
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" => "threads",
            _ => continue,
        };
        assert!(
            client.connected.contains(&format!("{short}={v}")),
            "{}",
            client.connected
        );
    }
    let servers = mps::ask(&n.driver(), &n.gpu0_pipe(), "get_server_list").unwrap();
    assert_eq!(
        servers.lines().count(),
        1,
        "the client's server: {servers:?}"
    );

    // The plugin is SIGKILLed (an OOM kill) and its pod restarted.
    let mut first = first;
    sigkill(first.0.id());
    wait_exit(&mut first.0).await;
    let second = n.run("pod-1").await;
    n.prepare("pod-1", "s1").await;
    n.prepare("pod-1", "s2").await;

    // A rolling update: the new pod serves beside the old one, which then stops.
    let _third = n.run("pod-2").await;
    n.prepare("pod-2", "s3").await;
    let mut second = second;
    assert!(terminate(&mut second.0).await.success());
    assert_eq!(unprepare_at(&n.dra("pod-2"), "s2").await, "");

    assert!(client.connected(), "the client lost its server");
    assert_eq!(mps::daemon_pids(&n.gpu0_dir()), daemons, "the same daemon");
    assert!(mps::runs(daemons[0]));
    assert_eq!(
        mps::ask(&n.driver(), &n.gpu0_pipe(), "get_server_list").as_deref(),
        Some(servers.as_str()),
        "the same server"
    );
    assert_eq!(mps::count(&n.driver(), "start"), 1);
    assert_eq!(mps::count(&n.driver(), "quit"), 0);
}

#[tokio::test]
async fn a_plugin_restart_leaves_the_daemons_alone_and_the_last_unprepare_releases_them() {
    let n = Node::new(&["s1"]);
    let _host = n.host(&[]);
    let mut p = n.run("pod-1").await;
    n.prepare("pod-1", "s1").await;
    let daemons = mps::daemon_pids(&n.gpu0_dir());
    assert_eq!(daemons.len(), 1);
    assert!(terminate(&mut p.0).await.success());
    assert!(
        mps::runs(daemons[0]),
        "a stopped plugin does not stop the daemon"
    );
    let _p = n.run("pod-1").await;
    // The restarted plugin's recovery found the request in place: nothing restarted.
    assert_eq!(mps::daemon_pids(&n.gpu0_dir()), daemons);
    assert!(mps::runs(daemons[0]));
    assert!(mps::ask(&n.driver(), &n.gpu0_pipe(), "get_server_list").is_some());
    assert_eq!(
        mps::log(&n.driver()).len(),
        1,
        "{:?}",
        mps::log(&n.driver())
    );

    // The last share goes: the host quits the daemon and removes its directory.
    assert_eq!(unprepare_at(&n.dra("pod-1"), "s1").await, "");
    mps::eventually("the released directory is removed", || {
        !n.gpu0_dir().exists()
    });
    assert!(!mps::runs(daemons[0]));
    assert_eq!(
        mps::log(&n.driver()),
        vec![
            format!("start {} {}", n.gpu(0), n.gpu0_pipe().display()),
            format!("quit {}", n.gpu0_pipe().display()),
        ]
    );
}

#[tokio::test]
async fn a_killed_daemon_fails_its_clients_and_the_host_starts_a_new_one() {
    let n = Node::new(&["s1", "s2"]);
    let _host = n.host(&[]);
    let _p = n.run("pod-1").await;
    n.prepare("pod-1", "s1").await;
    let old = mps::daemon_pids(&n.gpu0_dir());
    assert_eq!(old.len(), 1);
    let mut client = n.client("s1");

    sigkill(old[0]);
    // Its client fails, as a CUDA client of a dead MPS server does (806/810): no reattaching.
    let status = client.child.wait().unwrap();
    assert!(!status.success(), "{status}");
    // The host starts a new daemon, which answers and serves new clients.
    mps::eventually("a new daemon", || {
        mps::daemon_pids(&n.gpu0_dir()).len() == 2
    });
    let new = mps::daemon_pids(&n.gpu0_dir())[1];
    assert_ne!(new, old[0]);
    mps::eventually("the new daemon answers", || {
        mps::ask(&n.driver(), &n.gpu0_pipe(), "get_server_list").is_some()
    });
    assert!(mps::runs(new) && !mps::runs(old[0]));
    n.prepare("pod-1", "s2").await;
    let mut again = n.client("s2");
    assert!(again.connected());
    assert_eq!(mps::count(&n.driver(), "start"), 2);
}

#[tokio::test]
async fn after_a_reboot_the_host_removes_the_old_boots_directories() {
    use nvdra::mps::dir::{DaemonId, DaemonSpec, Layout};
    let n = Node::new(&["s1"]);
    {
        let _host = n.host(&[]);
        let _p = n.run("pod-1").await;
        n.prepare("pod-1", "s1").await;
        assert!(n.gpu0_dir().join("daemon.json").exists());
    }
    // The node reboots into boot-2 (the MPS root is not a tmpfs here, so it survived), and the
    // plugin of the new boot asked for a daemon for GPU 1 before the host started.
    n.set_boot("boot-2");
    let layout = Layout::new(n.p("mps"));
    let gpu1 = DaemonId::gpu(&nvdra::inventory::GpuUuid(n.gpu(1)));
    let staging = n.p("mps/.new");
    std::fs::create_dir(&staging).unwrap();
    Layout::make_subdirs(&staging).unwrap();
    let spec = DaemonSpec {
        devices: vec![n.gpu(1)],
        multi_user: false,
        owner: "the shares of GPU 1".into(),
        boot_id: Some("boot-2".into()),
    };
    std::fs::write(
        staging.join("daemon.json"),
        serde_json::to_vec(&spec).unwrap(),
    )
    .unwrap();
    std::fs::rename(&staging, layout.dir(&gpu1)).unwrap();

    let _host = n.host(&[]);
    assert!(
        !n.gpu0_dir().exists(),
        "the old boot's directory is removed"
    );
    assert_eq!(
        std::fs::read_to_string(n.p("mps/boot_id")).unwrap().trim(),
        "boot-2"
    );
    let pipe1 = layout.pipe(&gpu1);
    mps::eventually("the new boot's daemon answers", || {
        mps::ask(&n.driver(), &pipe1, "get_server_list").is_some()
    });
    assert_eq!(
        mps::log(&n.driver()).last().unwrap(),
        &format!("start {} {}", n.gpu(1), pipe1.display())
    );
}

#[tokio::test]
async fn a_daemon_whose_quit_hangs_is_killed_after_the_deadline() {
    let n = Node::new(&["s1"]);
    let _host = n.host(&[
        ("STANDIN_QUIT_HANGS", "1"),
        ("NVDRA_MPS_QUIT_DEADLINE", "300ms"),
    ]);
    let _p = n.run("pod-1").await;
    n.prepare("pod-1", "s1").await;
    let daemons = mps::daemon_pids(&n.gpu0_dir());
    assert_eq!(daemons.len(), 1);
    assert_eq!(unprepare_at(&n.dra("pod-1"), "s1").await, "");
    mps::eventually("the released directory is removed", || {
        !n.gpu0_dir().exists()
    });
    assert!(!mps::runs(daemons[0]), "killed");
    assert_eq!(
        mps::count(&n.driver(), "quit"),
        0,
        "it never quit by itself"
    );
}

/// A MIG device's share daemon (`m-<hash>`, as the plugin asks for one) is found and run by the
/// host like a GPU's, with the MIG device alone visible to it (`CUDA_VISIBLE_DEVICES` is its
/// UUID), beside the daemon of the MIG device's GPU, and quit and removed at its release.
#[test]
fn a_mig_devices_daemon_sees_only_the_mig_device_and_goes_at_release() {
    use nvdra::inventory::{GpuUuid, MigUuid};
    use nvdra::mps::dir::{DaemonId, DaemonSpec, Layout};
    let n = Node::new(&[]);
    let _host = n.host(&[]);
    let layout = Layout::new(n.p("mps"));
    let mig = "MIG-4ffe6c46-91e5-b61e-75a5-cef31121ee0d";
    let (m, g) = (
        DaemonId::mig(&MigUuid(mig.into())),
        DaemonId::gpu(&GpuUuid(n.gpu(0))),
    );
    for (id, device) in [(&m, mig.to_string()), (&g, n.gpu(0))] {
        mps::request(
            &n.p("mps"),
            id,
            &DaemonSpec {
                devices: vec![device],
                multi_user: true,
                owner: format!("the shares of {id}"),
                boot_id: Some("boot-1".into()),
            },
        );
    }
    let (pipe, gpu_pipe) = (layout.pipe(&m), layout.pipe(&g));
    mps::eventually("both daemons answer", || {
        mps::ask(&n.driver(), &pipe, "get_server_list").is_some()
            && mps::ask(&n.driver(), &gpu_pipe, "get_server_list").is_some()
    });
    let log = mps::log(&n.driver());
    assert!(
        log.contains(&format!("start {mig} {}", pipe.display())),
        "{log:?}"
    );
    std::fs::remove_file(layout.spec(&m)).unwrap();
    mps::eventually("the released directory is removed", || {
        !layout.dir(&m).exists()
    });
    assert!(mps::ask(&n.driver(), &pipe, "get_server_list").is_none());
    assert!(
        mps::ask(&n.driver(), &gpu_pipe, "get_server_list").is_some(),
        "the GPU's daemon stays"
    );
}

/// The stand-in daemon serves one UID at a time, as MPS does, unless the request asks for
/// multi-user mode, which the host passes on as `-M`.
#[test]
fn a_daemon_serves_another_uid_only_in_multi_user_mode() {
    use nvdra::mps::dir::{DaemonId, DaemonSpec, Layout};
    let n = Node::new(&[]);
    let _host = n.host(&[]);
    let layout = Layout::new(n.p("mps"));
    for (i, multi_user) in [false, true].into_iter().enumerate() {
        let id = DaemonId::gpu(&nvdra::inventory::GpuUuid(n.gpu(i)));
        let staging = n.p(&format!("mps/.new-{i}"));
        std::fs::create_dir(&staging).unwrap();
        Layout::make_subdirs(&staging).unwrap();
        let spec = DaemonSpec {
            devices: vec![n.gpu(i)],
            multi_user,
            owner: format!("test {i}"),
            boot_id: Some("boot-1".into()),
        };
        std::fs::write(
            staging.join("daemon.json"),
            serde_json::to_vec(&spec).unwrap(),
        )
        .unwrap();
        std::fs::rename(&staging, layout.dir(&id)).unwrap();
        let pipe = layout.pipe(&id);
        mps::eventually("the daemon answers", || {
            mps::ask(&n.driver(), &pipe, "get_server_list").is_some()
        });
        let first = mps::ask(&n.driver(), &pipe, "start_server -uid 1000").unwrap();
        assert!(first.trim().parse::<u32>().is_ok(), "{first:?}");
        let second = mps::ask(&n.driver(), &pipe, "start_server -uid 1001").unwrap();
        if multi_user {
            assert!(second.trim().parse::<u32>().is_ok(), "{second:?}");
            assert_ne!(first, second);
        } else {
            assert!(second.contains("uid 1000 is running"), "{second:?}");
        }
        let servers = mps::ask(&n.driver(), &pipe, "get_server_list").unwrap();
        assert_eq!(
            servers.lines().count(),
            1 + usize::from(multi_user),
            "{servers:?}"
        );
    }
}

/// A driver whose `nvidia-cuda-mps-control` does not take `-M` (its usage text does not list it):
/// the host says so in `host.json` (which the plugin reads to refuse shares of different users)
/// and starts a daemon asked for multi-user mode without `-M`, which serves, instead of one that
/// exits at every start and fails every share. Where it takes `-M`, `host.json` says so.
#[test]
fn a_control_daemon_without_multi_user_mode_runs_single_user_instead_of_failing() {
    use nvdra::mps::dir::{DaemonId, DaemonSpec, HostCapabilities, Layout};
    for supported in [true, false] {
        let n = Node::new(&[]);
        let env: &[(&str, &str)] = if supported {
            &[]
        } else {
            &[("STANDIN_NO_MULTI_USER", "1")]
        };
        let host = n.host(env);
        let layout = Layout::new(n.p("mps"));
        assert_eq!(
            layout.read_capabilities(),
            HostCapabilities {
                multi_user: Some(supported)
            }
        );
        let id = DaemonId::gpu(&nvdra::inventory::GpuUuid(n.gpu(0)));
        mps::request(
            &n.p("mps"),
            &id,
            &DaemonSpec {
                devices: vec![n.gpu(0)],
                multi_user: true,
                owner: "test".into(),
                boot_id: Some("boot-1".into()),
            },
        );
        let pipe = layout.pipe(&id);
        mps::eventually("the daemon answers", || {
            mps::ask(&n.driver(), &pipe, "get_server_list").is_some()
        });
        mps::ask(&n.driver(), &pipe, "start_server -uid 1000").unwrap();
        let second = mps::ask(&n.driver(), &pipe, "start_server -uid 1001").unwrap();
        assert_eq!(
            second.trim().parse::<u32>().is_ok(),
            supported,
            "a second user's server: {second:?}"
        );
        assert_eq!(mps::count(&n.driver(), "start"), 1, "started once");
        drop(host);
    }
}

/// Without CAP_SYS_ADMIN the host cannot give a daemon its own `/dev/shm`: it starts none, and
/// says why in the daemon's log directory, where the plugin's error points.
#[test]
fn without_cap_sys_admin_the_daemon_is_not_started_and_its_log_says_why() {
    use nvdra::mps::dir::{DaemonId, DaemonSpec, Layout};
    if !support::setpriv() {
        return;
    }
    let n = Node::new(&[]);
    let mut cmd = Command::new("setpriv");
    cmd.args(["--bounding-set", "-sys_admin", "--"])
        .arg(env!("CARGO_BIN_EXE_nvdra"));
    Host::args(&mut cmd, &n.p("mps"), &n.driver(), &n.p("boot_id"), &[]);
    let _host = Host::started(cmd, &n.p("mps"), &n.p("boot_id"));
    let id = DaemonId::gpu(&nvdra::inventory::GpuUuid(n.gpu(0)));
    let spec = DaemonSpec {
        devices: vec![n.gpu(0)],
        multi_user: false,
        owner: "test".into(),
        boot_id: Some("boot-1".into()),
    };
    mps::request(&n.p("mps"), &id, &spec);
    let log = Layout::new(n.p("mps")).log(&id).join("control.out");
    mps::eventually("the host notes why", || {
        std::fs::read_to_string(&log).is_ok_and(|l| l.contains("CAP_SYS_ADMIN"))
    });
    assert!(mps::log(&n.driver()).is_empty(), "no daemon started");
    assert!(
        mps::ask(
            &n.driver(),
            &Layout::new(n.p("mps")).pipe(&id),
            "get_server_list"
        )
        .is_none()
    );
}

fn signal(sig: &str, pid: u32) {
    let ok = Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .unwrap();
    assert!(ok.success());
}

/// A daemon that is alive but does not answer (SIGSTOPped here; a deadlock, or a tenant's doing,
/// on a node) is as useless to its shares as a dead one: the host's probes notice, kill it, clear
/// what it left in its pipe and shm directories, start a new one, and start a server for the
/// user the old one served without waiting for a client — so that on a GPU in
/// `EXCLUSIVE_PROCESS` (the stand-in's `STANDIN_GPU_DIR`) a CUDA process that misses MPS is
/// refused before and after, and never gets a plain context.
#[tokio::test]
async fn a_daemon_that_stops_answering_is_replaced_and_its_server_started_again() {
    let n = Node::new(&["s1", "s2"]);
    let gpu_state = n.p("gpu-state");
    std::fs::create_dir_all(&gpu_state).unwrap();
    let gpu_env = gpu_state.display().to_string();
    let _host = n.host(&[
        ("STANDIN_GPU_DIR", gpu_env.as_str()),
        ("NVDRA_MPS_HOST_PROBE_INTERVAL", "200ms"),
    ]);
    let _p = n.run("pod-1").await;
    n.prepare("pod-1", "s1").await;
    let mut client = n.client("s1");
    let first = mps::daemon_pids(&n.gpu0_dir());
    assert_eq!(first.len(), 1);
    let out_log = n.gpu0_dir().join("log/control.out");
    mps::eventually("the host's probe sees the server's user", || {
        std::fs::read_to_string(&out_log).is_ok_and(|l| l.contains("serves uid 0"))
    });
    // A CUDA process that finds no daemon (a pipe directory with none) while the server holds
    // the GPU: refused, as EXCLUSIVE_PROCESS refuses a second context.
    let nowhere = n.p("no-daemon");
    std::fs::create_dir_all(&nowhere).unwrap();
    let outside = [("STANDIN_GPU_DIR", gpu_env.as_str())];
    match CudaClient::try_start(&n.driver(), &nowhere, &outside) {
        mps::Started::Failed(status) => assert_eq!(status.code(), Some(4), "{status}"),
        mps::Started::Plain(c) => panic!("a plain context beside the MPS server: {}", c.connected),
        mps::Started::Mps(_) => panic!("connected through no daemon"),
    }

    signal("-STOP", first[0]);
    std::fs::write(n.gpu0_pipe().join("stale.pid"), "1\n").unwrap();
    std::fs::write(n.gpu0_dir().join("shm/stale-segment"), "x").unwrap();
    mps::eventually("the host replaces the daemon that does not answer", || {
        mps::daemon_pids(&n.gpu0_dir()).len() == 2
    });
    assert!(!mps::runs(first[0]), "the stopped daemon was killed");
    mps::eventually("the client of the old daemon fails", || !client.connected());
    assert!(
        !n.gpu0_pipe().join("stale.pid").exists()
            && !n.gpu0_dir().join("shm/stale-segment").exists(),
        "the dead daemon's files were cleared before the new one started"
    );
    let log = std::fs::read_to_string(&out_log).unwrap();
    assert!(
        log.contains(&format!(
            "daemon {} did not answer {} probes in a row; killed",
            first[0],
            nvdra::mps::host::PROBE_MISSES
        )),
        "{log}"
    );
    // A server for the user the old one served (root, here), with no client asking.
    mps::eventually("the new daemon has a server", || {
        mps::ask(&n.driver(), &n.gpu0_pipe(), "get_server_list")
            .is_some_and(|l| l.split_whitespace().count() == 1)
    });
    match CudaClient::try_start(&n.driver(), &nowhere, &outside) {
        mps::Started::Failed(status) => assert_eq!(status.code(), Some(4), "{status}"),
        mps::Started::Plain(c) => panic!("a plain context beside the MPS server: {}", c.connected),
        mps::Started::Mps(_) => panic!("connected through no daemon"),
    }
    // The plugin's own watch saw the daemon down meanwhile and refuses new shares until its
    // next probe hears it; the kubelet retries.
    let start = std::time::Instant::now();
    loop {
        let r = prepare_at(&n.dra("pod-1"), "s2").await.unwrap();
        if r.error.is_empty() {
            break;
        }
        assert!(
            start.elapsed() < std::time::Duration::from_secs(30),
            "{}",
            r.error
        );
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    let mut again = n.client("s2");
    assert!(again.connected());
}

/// Each daemon's `/dev/shm` (its clients' too) is a tmpfs of its own of `--shm-size`, not a
/// directory of the node's `/run`: a tenant that fills it fills only its GPU's, and it is gone
/// with the daemon's release.
#[tokio::test]
async fn a_daemons_dev_shm_is_a_sized_tmpfs_of_its_own_gone_at_release() {
    let n = Node::new(&["s1"]);
    let _host = n.host(&[("NVDRA_MPS_SHM_SIZE", "8Mi")]);
    let _p = n.run("pod-1").await;
    n.prepare("pod-1", "s1").await;
    let shm = n.gpu0_dir().join("shm");
    let (fs, size) = statfs(&shm);
    assert_eq!(fs, libc::TMPFS_MAGIC, "{} is not a tmpfs", shm.display());
    assert_eq!(size, 8 << 20);
    assert_ne!(
        statfs_dev(&n.gpu0_dir()),
        statfs_dev(&shm),
        "on the daemon directory's filesystem"
    );
    // The daemon sees it as its /dev/shm (its marker is there).
    let pids = mps::daemon_pids(&n.gpu0_dir());
    assert!(
        shm.join(format!("nvdra-standin-control.{}", pids[0]))
            .exists()
    );
    // Filling it fails at its size, and nothing beyond.
    let big = vec![0u8; 9 << 20];
    let err = std::fs::write(shm.join("fill"), &big).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::ENOSPC), "{err}");
    std::fs::remove_file(shm.join("fill")).unwrap();

    assert_eq!(unprepare_at(&n.dra("pod-1"), "s1").await, "");
    mps::eventually("the released directory is removed", || {
        !n.gpu0_dir().exists()
    });
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(
        !mounts.contains(&shm.display().to_string()),
        "the tmpfs outlived its release"
    );
}

/// The filesystem type and size in bytes of the filesystem `path` is on.
fn statfs(path: &std::path::Path) -> (i64, u64) {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).unwrap();
    let mut s: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: a valid C string and a statfs buffer, both live across the call.
    assert_eq!(unsafe { libc::statfs(c.as_ptr(), &mut s) }, 0);
    (s.f_type, s.f_blocks * s.f_bsize as u64)
}

fn statfs_dev(path: &std::path::Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).unwrap().dev()
}

/// The stand-in control daemon of a temporary pipe directory, killed when dropped.
struct StandinDaemon(Child);

impl Drop for StandinDaemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A command the control daemon does not know is refused, not answered with an empty list: a
/// misspelled `get_server_list` would otherwise read as "no servers" and pass for alive. The
/// stand-in's client exits non-zero with the refusal on stderr, and nvdra's control client
/// reports it as a failure naming the command and the refusal.
#[test]
fn an_unknown_command_is_refused_and_nvdras_client_names_it() {
    let n = Node::new(&[]);
    let pipe = n.p("pipe");
    std::fs::create_dir_all(&pipe).unwrap();
    let _daemon = StandinDaemon(
        Command::new(mps::control(&n.driver()))
            .arg("-f")
            .env("CUDA_MPS_PIPE_DIRECTORY", &pipe)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    mps::eventually("the daemon answers", || {
        mps::ask(&n.driver(), &pipe, "get_server_list").is_some()
    });

    let mut c = Command::new(mps::control(&n.driver()))
        .env("CUDA_MPS_PIPE_DIRECTORY", &pipe)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::io::Write::write_all(&mut c.stdin.take().unwrap(), b"get_sever_list\n").unwrap();
    let out = c.wait_with_output().unwrap();
    assert!(!out.status.success(), "an unknown command was answered");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "");
    assert_eq!(
        String::from_utf8_lossy(&out.stderr).trim(),
        "unknown command: get_sever_list"
    );

    let control = nvdra::mps::control::find(&n.driver()).unwrap();
    let e = nvdra::mps::control::ask(
        &control,
        &pipe,
        "get_sever_list",
        std::time::Duration::from_secs(30),
    )
    .unwrap_err();
    assert!(
        matches!(e, nvdra::mps::control::Error::Failed { .. }),
        "{e:?}"
    );
    assert_eq!(
        e.to_string(),
        "\"get_sever_list\" failed (exit status: 1): unknown command: get_sever_list"
    );
    // A known command still answers.
    assert!(nvdra::mps::control::alive(&control, &pipe).is_ok());
}
