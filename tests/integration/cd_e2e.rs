//! Compute domains end to end (issue 37, Must show): a ComputeDomain created in the test API
//! server goes Ready across 4 simulated GB200 trays, each with its own `nvdra compute-domain
//! plugin` process, the `nvdra compute-domain controller` process and, per node, an `nvdra
//! compute-domain daemon` process running the fake `nvidia-imex`; then a pod's claim gets a CDI
//! spec with the channel device, which podman turns into a char device of the known major.
//!
//! There is no kube-scheduler, kubelet, resourceclaim or DaemonSet controller here: the test
//! plays them, as they would act, through the API server and the plugins' DRA sockets:
//!
//! - the nodes carry `nvidia.com/gpu.clique` as nvdra's GPU plugin sets it from the
//!   `gb200-nvl72` profile (`nvdra inventory --profile gb200-nvl72 --node-name node-N`);
//! - a workload pod per node, bound to it; its claim made from the domain's template (as the
//!   resourceclaim controller does) and allocated the node's `channel-0` with the template's
//!   config (as the scheduler does, once the node's slice publishes the device);
//! - the kubelet's NodePrepareResources, retried while it fails (the daemon is not ready: nvdra's
//!   prepare answers at once, never loops), which in NVIDIA's shape also labels the node;
//! - the DaemonSet controller: a daemon pod on each node the domain's DaemonSet selects, its
//!   claim from the daemon template, allocated the node's `daemon-0`, prepared by the plugin,
//!   and the container started as the kubelet would: the DaemonSet's environment (downward API
//!   filled in) plus the claim's CDI edits (its environment, its `/imexd` mount's host path).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use kubelet_plugin::Claim;
use kubelet_plugin::testing::KubeletClient;
use nvdra::computedomain::api::{CLIQUE_LABEL, DRIVER_NAME};
use serde_json::{Value, json};

use crate::support::apiserver::TestApiServer;
use crate::support::podman as engine;
use crate::support::wait;

const NODES: usize = 4;
const NS: &str = "team-a";
const DRIVER_NS: &str = "nvdra";
const DOMAIN: &str = "imex";
const TEMPLATE: &str = "imex-channel";
const MAJOR: u32 = 239;
const CAPS_MAJOR: u32 = 240;
/// The second octet of this test's loopback addresses (`127.61.0.<node+1>`).
const NET: u8 = 61;
/// Bounds a failure only (a hang); asserts no speed.
const DEADLINE: Duration = Duration::from_secs(180);

/// A process killed (and reaped) when dropped, its output in a log file.
struct Proc {
    child: Child,
    log: PathBuf,
}

impl Proc {
    fn spawn(mut cmd: Command, log: PathBuf) -> Proc {
        let out = std::fs::File::create(&log).unwrap();
        cmd.stdout(out.try_clone().unwrap()).stderr(out);
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {cmd:?}: {e}"));
        Proc { child, log }
    }

    /// Panics with its log if it exited.
    fn alive(&mut self) {
        if let Some(status) = self.child.try_wait().unwrap() {
            panic!(
                "{} exited ({status}):\n{}",
                self.log.display(),
                std::fs::read_to_string(&self.log).unwrap_or_default()
            );
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn nvdra() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_nvdra"));
    cmd.env("NVDRA_LOG", "info").stdin(Stdio::null());
    for var in [
        "NVDRA_CONFIG",
        "NODE_NAME",
        "KUBECONFIG",
        "NAMESPACE",
        "CLIQUE_ID",
    ] {
        cmd.env_remove(var);
    }
    cmd
}

/// The node's clique as the `gb200-nvl72` profile registers its GPUs:
/// `<clusterUUID>.<cliqueID>`, the `nvidia.com/gpu.clique` label's value.
fn clique_of(node: &str) -> String {
    let out = nvdra()
        .args(["inventory", "--profile", "gb200-nvl72", "--node-name", node])
        .args(["-o", "json"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let inv: Value = serde_json::from_slice(&out.stdout).unwrap();
    let f = &inv["gpus"][0]["fabric"];
    format!("{}.{}", f["clusterUuid"].as_str().unwrap(), f["cliqueId"])
}

fn fake_imex(tool: &str) -> String {
    format!("{}/tests/data/fake-imex/{tool}", env!("CARGO_MANIFEST_DIR"))
}

/// One simulated node: its directories, its plugin process and DRA socket, its daemon.
struct Node {
    name: String,
    dir: PathBuf,
    cdi_root: PathBuf,
    plugin: Proc,
    kubelet: Option<KubeletClient>,
    daemon: Option<Proc>,
}

impl Node {
    fn start(i: usize, root: &Path, cdi_root: &Path, kubeconfig: &Path) -> Node {
        let name = format!("node-{i}");
        let dir = root.join(&name);
        std::fs::create_dir_all(dir.join("caps")).unwrap();
        // The kernel's device list, with the IMEX channels' major where the test knows it.
        std::fs::write(
            dir.join("devices"),
            format!(
                "Character devices:\n  1 mem\n195 nvidia\n{MAJOR} nvidia-caps-imex-channels\n\
                 {CAPS_MAJOR} nvidia-caps\n\nBlock devices:\n  8 sd\n"
            ),
        )
        .unwrap();
        std::fs::write(
            dir.join("caps/fabric-imex-mgmt"),
            "DeviceFileMinor: 2\nDeviceFileMode: 256\nDeviceFileModify: 1\n",
        )
        .unwrap();
        let mut cmd = nvdra();
        cmd.args(["compute-domain", "plugin", "--node-name", &name])
            .args(["--namespace", DRIVER_NS])
            .arg("--kubelet-root")
            .arg(dir.join("kubelet"))
            .arg("--cdi-root")
            .arg(cdi_root)
            .arg("--proc-devices")
            .arg(dir.join("devices"))
            .arg("--capabilities-root")
            .arg(dir.join("caps"))
            .args(["--binding-conditions", "off", "--resync-seconds", "1"])
            .arg("--kubeconfig")
            .arg(kubeconfig);
        let plugin = Proc::spawn(cmd, dir.join("plugin.log"));
        Node {
            name,
            dir,
            cdi_root: cdi_root.to_path_buf(),
            plugin,
            kubelet: None,
            daemon: None,
        }
    }

    fn ip(&self) -> String {
        let i: u8 = self.name.trim_start_matches("node-").parse().unwrap();
        format!("127.{NET}.0.{}", i + 1)
    }

    async fn kubelet(&mut self) -> &mut KubeletClient {
        if self.kubelet.is_none() {
            let socket = self
                .dir
                .join("kubelet/plugins")
                .join(DRIVER_NAME)
                .join("dra.sock");
            let s = socket.clone();
            wait::until("the plugin's DRA socket", DEADLINE, || {
                std::future::ready(s.exists().then_some(()))
            })
            .await;
            self.kubelet = Some(KubeletClient::connect(&socket).await.unwrap());
        }
        self.kubelet.as_mut().unwrap()
    }

    /// The kubelet's NodePrepareResources of one claim: its CDI device IDs, or the error.
    async fn prepare(&mut self, claim: &Claim) -> Result<Vec<String>, String> {
        self.plugin.alive();
        let answers = self
            .kubelet()
            .await
            .prepare(std::slice::from_ref(claim))
            .await
            .map_err(|e| e.to_string())?;
        answers[&claim.uid].clone()
    }
}

/// `claim` of a pod, made from `template` (as the resourceclaim controller does) and allocated
/// `device` of `node`'s pool with the template's config (as the scheduler does).
fn allocated_from(
    api: &TestApiServer,
    template: &Value,
    pod: &Value,
    node: &str,
    device: &str,
) -> Claim {
    let ns = pod["metadata"]["namespace"].as_str().unwrap();
    let pod_name = pod["metadata"]["name"].as_str().unwrap();
    let spec = template["spec"]["spec"].clone();
    let request = spec["devices"]["requests"][0]["name"]
        .as_str()
        .unwrap()
        .to_string();
    let config: Vec<Value> = spec["devices"]["config"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .into_iter()
        .map(|mut c| {
            c["source"] = "FromClaim".into();
            c
        })
        .collect();
    let name = format!("{pod_name}-{request}");
    let claim = json!({
        "metadata": {
            "name": name, "namespace": ns,
            "annotations": {"resource.kubernetes.io/pod-claim-name": request},
            "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": pod_name,
                                 "uid": pod["metadata"]["uid"], "controller": true}],
        },
        "spec": spec,
        "status": {
            "allocation": {
                "devices": {
                    "results": [{"request": request, "driver": DRIVER_NAME, "pool": node,
                                 "device": device}],
                    "config": config,
                },
                "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                    {"key": "metadata.name", "operator": "In", "values": [node]}]}]},
            },
            "reservedFor": [{"resource": "pods", "name": pod_name, "uid": pod["metadata"]["uid"]}],
        },
    });
    let stored = api.put_object("resource.k8s.io/v1", "resourceclaims", claim);
    Claim::new(ns, &name, stored["metadata"]["uid"].as_str().unwrap())
}

/// Whether `node`'s published slice has `device` (the scheduler allocates only what is there).
fn published(api: &TestApiServer, node: &str, device: &str) -> bool {
    api.slices().iter().any(|s| {
        s.spec.driver == DRIVER_NAME
            && s.spec.node_name.as_deref() == Some(node)
            && s.spec
                .devices
                .iter()
                .flatten()
                .any(|d| d.name == device && d.taints.is_none())
    })
}

fn labels_match(selector: &Value, labels: &Value) -> bool {
    selector
        .as_object()
        .is_some_and(|s| s.iter().all(|(k, v)| labels.get(k) == Some(v)))
}

/// The daemon container's environment as the kubelet gives it: the DaemonSet's (downward API
/// filled in), then the claim's CDI edits.
fn daemon_env(ds: &Value, pod: &Value, cdi: &Value) -> Vec<(String, String)> {
    let mut env = Vec::new();
    for e in ds["spec"]["template"]["spec"]["containers"][0]["env"]
        .as_array()
        .cloned()
        .unwrap_or_default()
    {
        let name = e["name"].as_str().unwrap().to_string();
        let value = match e["valueFrom"]["fieldRef"]["fieldPath"].as_str() {
            Some(path) => {
                let mut v = pod;
                for part in path.split('.') {
                    v = &v[part];
                }
                v.as_str().unwrap_or_default().to_string()
            }
            None => e["value"].as_str().unwrap_or_default().to_string(),
        };
        env.push((name, value));
    }
    for e in cdi["devices"][0]["containerEdits"]["env"]
        .as_array()
        .cloned()
        .unwrap_or_default()
    {
        let (k, v) = e.as_str().unwrap().split_once('=').unwrap();
        env.push((k.into(), v.into()));
    }
    env
}

/// The DaemonSet controller's and the kubelet's part for one daemon pod: pod, claim, prepare,
/// and the container as a process. Returns false while the prepare fails.
async fn start_daemon(
    api: &TestApiServer,
    ds: &Value,
    node: &mut Node,
    kubeconfig: &Path,
    driver_root: &Path,
) -> bool {
    let ds_name = ds["metadata"]["name"].as_str().unwrap();
    let pod_name = format!("{ds_name}-{}", node.name);
    let template_name =
        ds["spec"]["template"]["spec"]["resourceClaims"][0]["resourceClaimTemplateName"]
            .as_str()
            .unwrap();
    let pod = match api.object("v1", "pods", DRIVER_NS, &pod_name) {
        Some(p) => p,
        None => {
            let mut spec = ds["spec"]["template"]["spec"].clone();
            spec["nodeName"] = node.name.clone().into();
            api.put_object(
                "v1",
                "pods",
                json!({
                    "metadata": {
                        "name": pod_name, "namespace": DRIVER_NS,
                        "labels": ds["spec"]["template"]["metadata"]["labels"],
                        "ownerReferences": [{"apiVersion": "apps/v1", "kind": "DaemonSet",
                            "name": ds_name, "uid": ds["metadata"]["uid"], "controller": true}],
                    },
                    "spec": spec,
                    "status": {"phase": "Pending", "podIP": node.ip(), "podIPs": [{"ip": node.ip()}],
                               "hostIP": node.ip()},
                }),
            )
        }
    };
    let Some(template) = api.object(
        "resource.k8s.io/v1",
        "resourceclaimtemplates",
        DRIVER_NS,
        template_name,
    ) else {
        return false;
    };
    if !published(api, &node.name, "daemon-0") {
        return false;
    }
    let claim = match api.object(
        "resource.k8s.io/v1",
        "resourceclaims",
        DRIVER_NS,
        &format!("{pod_name}-daemon"),
    ) {
        Some(c) => Claim::new(
            DRIVER_NS,
            c["metadata"]["name"].as_str().unwrap(),
            c["metadata"]["uid"].as_str().unwrap(),
        ),
        None => allocated_from(api, &template, &pod, &node.name.clone(), "daemon-0"),
    };
    if node.prepare(&claim).await.is_err() {
        return false;
    }
    let spec_file = node.cdi_root.join(format!(
        "k8s.compute-domain.nvidia.com-claim_{}.yaml",
        claim.uid
    ));
    let cdi: Value = nvdra::yaml::from_str(&std::fs::read_to_string(&spec_file).unwrap()).unwrap();
    let mounts = cdi["devices"][0]["containerEdits"]["mounts"]
        .as_array()
        .unwrap();
    let imexd = mounts
        .iter()
        .find(|m| m["containerPath"] == "/imexd")
        .expect("the daemon claim mounts /imexd")["hostPath"]
        .as_str()
        .unwrap()
        .to_string();
    let hosts = node.dir.join("hosts");
    std::fs::write(&hosts, "127.0.0.1\tlocalhost\n").unwrap();
    let mut cmd = nvdra();
    cmd.args(["compute-domain", "daemon"])
        .envs(daemon_env(ds, &pod, &cdi))
        // What the container's image and mounts give it, here on the host.
        .env("NVDRA_CD_CONFIG_DIR", &imexd)
        .env("NVDRA_CD_HOSTS_FILE", &hosts)
        .env("NVDRA_CD_IMEX", fake_imex("nvidia-imex"))
        .env("NVDRA_CD_IMEX_CTL", fake_imex("nvidia-imex-ctl"))
        .env("NVDRA_CD_CHECK_INTERVAL_MS", "200")
        .env("NVDRA_CD_SIGUSR1_INTERVAL_MS", "0")
        .env("FAKE_IMEX_HOSTS", &hosts)
        .env("FAKE_IMEX_SIGUSR1_WINDOW", "0")
        // The fabric check reads the node's GPUs through NVML: the fake, as the profile.
        .env("NVDRA_CD_FABRIC_CHECK", "nvml")
        .env("NVIDIA_DRIVER_ROOT", driver_root)
        .env("FAKE_NVML_PROFILE", "gb200-nvl72")
        .env("FAKE_NVML_SEED", &node.name)
        .env_remove("FAKE_NVML_NODE")
        .env_remove("FAKE_NVML_TOPOLOGY")
        .env_remove("FAKE_NVML_STATE")
        .env("KUBECONFIG", kubeconfig);
    node.daemon = Some(Proc::spawn(cmd, node.dir.join("daemon.log")));
    let mut running = api.object("v1", "pods", DRIVER_NS, &pod_name).unwrap();
    running["status"]["phase"] = "Running".into();
    running["status"]["containerStatuses"] = json!([{"name": "compute-domain-daemon", "ready": true,
        "restartCount": 0, "image": "nvdra", "imageID": "", "state": {"running": {}}}]);
    api.put_object("v1", "pods", running);
    true
}

fn logs(nodes: &[Node], controller: &Path) -> String {
    let mut out = String::new();
    let mut files: Vec<PathBuf> = vec![controller.to_path_buf()];
    for n in nodes {
        files.push(n.plugin.log.clone());
        if let Some(d) = &n.daemon {
            files.push(d.log.clone());
        }
    }
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap_or_default();
        let tail: Vec<&str> = text.lines().rev().take(15).collect();
        out += &format!("--- {}\n", f.display());
        for l in tail.into_iter().rev() {
            out += l;
            out.push('\n');
        }
    }
    out
}

#[test]
fn a_domain_goes_ready_across_four_plugins_and_a_pod_gets_its_channel_under_podman() {
    engine::with_engine(|e| {
        let rt = tokio::runtime::Runtime::new()?;
        rt.block_on(run(e.has_spec_dir_flag))
    });
}

async fn run(spec_dir_flag: bool) -> anyhow::Result<()> {
    let root = tempfile::tempdir()?;
    // Without --cdi-spec-dir podman reads the system directory only.
    let cdi_root = if spec_dir_flag {
        root.path().join("cdi")
    } else {
        PathBuf::from(engine::SYSTEM_CDI_DIR)
    };
    std::fs::create_dir_all(&cdi_root)?;
    let driver_root = root.path().join("driver");
    std::fs::create_dir_all(driver_root.join("usr/lib64"))?;
    std::os::unix::fs::symlink(
        crate::support::fake_nvml::library(),
        driver_root
            .join("usr/lib64")
            .join(nvdra::inventory::nvml::LIBRARY),
    )?;

    let api = TestApiServer::start().await;
    let kubeconfig = root.path().join("kubeconfig");
    std::fs::write(&kubeconfig, api.kubeconfig())?;
    for i in 0..NODES {
        let name = format!("node-{i}");
        api.seed_node(&name, &format!("uid-{name}"));
        api.set_node_label(&name, CLIQUE_LABEL, &clique_of(&name));
    }
    let mut nodes: Vec<Node> = (0..NODES)
        .map(|i| Node::start(i, root.path(), &cdi_root, &kubeconfig))
        .collect();
    let mut cmd = nvdra();
    cmd.args(["compute-domain", "controller", "--namespace", DRIVER_NS])
        .args(["--image-name", "nvdra:e2e", "--pod-name", "controller-0"])
        .args(["--leader-election-retry-period", "1s"])
        .arg("--kubeconfig")
        .arg(&kubeconfig);
    let controller_log = root.path().join("controller.log");
    let mut controller = Proc::spawn(cmd, controller_log.clone());

    // The user's domain (NVIDIA's demo shape), through kube::Client as kubectl would.
    let client = api.client()?;
    let gvk = kube::core::GroupVersionKind::gvk("resource.nvidia.com", "v1beta1", "ComputeDomain");
    let ar = kube::core::ApiResource::from_gvk_with_plural(&gvk, "computedomains");
    let domains: kube::Api<kube::core::DynamicObject> = kube::Api::namespaced_with(client, NS, &ar);
    let cd: kube::core::DynamicObject = serde_json::from_value(json!({
        "apiVersion": "resource.nvidia.com/v1beta1", "kind": "ComputeDomain",
        "metadata": {"name": DOMAIN, "namespace": NS},
        "spec": {"numNodes": NODES, "channel": {"resourceClaimTemplate": {"name": TEMPLATE}}},
    }))?;
    domains.create(&Default::default(), &cd).await?;

    // The workload: one pod per node, each with a claim from the domain's template.
    let mut workload: Vec<(Claim, Option<Vec<String>>)> = Vec::new();
    let deadline = tokio::time::Instant::now() + DEADLINE;
    let fail = |what: &str, nodes: &[Node]| -> anyhow::Error {
        anyhow::anyhow!(
            "waited {DEADLINE:?} for {what}, in vain; logs:\n{}",
            logs(nodes, &controller_log)
        )
    };
    let template = loop {
        controller.alive();
        if let Some(t) = api.object("resource.k8s.io/v1", "resourceclaimtemplates", NS, TEMPLATE) {
            break t;
        }
        if tokio::time::Instant::now() > deadline {
            return Err(fail("the controller's workload template", &nodes));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    for (i, node) in nodes.iter().enumerate() {
        loop {
            if published(&api, &node.name, "channel-0") {
                break;
            }
            if tokio::time::Instant::now() > deadline {
                return Err(fail("the nodes' channel-0", &nodes));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let pod = api.put_object(
            "v1",
            "pods",
            json!({
                "metadata": {"name": format!("worker-{i}"), "namespace": NS},
                "spec": {"nodeName": node.name, "containers": [{"name": "w", "image": "busybox",
                          "resources": {"claims": [{"name": "channel"}]}}],
                         "resourceClaims": [{"name": "channel", "resourceClaimTemplateName": TEMPLATE}]},
            }),
        );
        workload.push((
            allocated_from(&api, &template, &pod, &node.name, "channel-0"),
            None,
        ));
    }

    // The cluster's loop: kubelet prepares (retried while the daemon is not ready), the
    // DaemonSet controller's pods where the domain's DaemonSet selects, until every pod has its
    // channel and the domain is Ready.
    loop {
        controller.alive();
        for (i, (claim, ids)) in workload.iter_mut().enumerate() {
            if ids.is_none()
                && let Ok(got) = nodes[i].prepare(claim).await
            {
                *ids = Some(got);
            }
        }
        for ds in api.objects("apps/v1", "daemonsets") {
            let selector = &ds["spec"]["template"]["spec"]["nodeSelector"];
            for node in nodes.iter_mut() {
                let labels = api
                    .object("v1", "nodes", "", &node.name)
                    .map(|n| n["metadata"]["labels"].clone())
                    .unwrap_or_default();
                if node.daemon.is_none() && labels_match(selector, &labels) {
                    start_daemon(&api, &ds, node, &kubeconfig, &driver_root).await;
                }
            }
        }
        for node in nodes.iter_mut() {
            if let Some(d) = node.daemon.as_mut() {
                d.alive();
            }
        }
        let cd = api.object("resource.nvidia.com/v1beta1", "computedomains", NS, DOMAIN);
        let ready = cd
            .as_ref()
            .is_some_and(|c| c["status"]["status"] == "Ready");
        if ready && workload.iter().all(|(_, ids)| ids.is_some()) {
            let cd = cd.unwrap();
            let nodes_ready = cd["status"]["nodes"]
                .as_array()
                .map(|n| n.iter().filter(|n| n["status"] == "Ready").count());
            anyhow::ensure!(
                nodes_ready == Some(NODES),
                "the domain is Ready with {nodes_ready:?} nodes: {cd}"
            );
            break;
        }
        if tokio::time::Instant::now() > deadline {
            let state: Vec<(String, bool)> = workload
                .iter()
                .map(|(c, ids)| (c.name.clone(), ids.is_some()))
                .collect();
            return Err(fail(
                &format!("the domain Ready and every channel prepared ({state:?}; domain {cd:?})"),
                &nodes,
            ));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // Every node served the domain's daemon, in the clique the profile gives its GPUs.
    let clique = clique_of("node-0");
    let cliques = api.objects("resource.nvidia.com/v1beta1", "computedomaincliques");
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
    let ids = workload[0].1.clone().unwrap();
    let runner = engine::Engine {
        has_spec_dir_flag: spec_dir_flag,
    };
    let out =
        runner.run_with_device(&cdi_root, &ids[0], "ls -l /dev/nvidia-caps-imex-channels/")?;
    // The workload's claims go as the kubelet would unprepare them (their spec files too).
    for (i, (claim, _)) in workload.iter().enumerate() {
        let answers = nodes[i]
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
    drop(controller);
    drop(nodes);
    Ok(())
}
