//! A simulated compute-domain cluster (issue 37), shared by the end-to-end tests
//! (`tests/integration/cd_e2e.rs`) and the bench (`benches/compute_domain.rs`): the test API
//! server, one `nvdra compute-domain plugin` process per simulated GB200 tray of the
//! `gb200-nvl72` profile, the `nvdra compute-domain controller` process and, per node whose
//! DaemonSet selects it, an `nvdra compute-domain daemon` process running the fake `nvidia-imex`
//! (`tests/data/fake-imex/`), all on loopback.
//!
//! There is no kube-scheduler, kubelet, resourceclaim or DaemonSet controller: the caller plays
//! them, as they would act, through the API server and the plugins' DRA sockets. Here are the
//! parts every caller plays alike:
//!
//! - the nodes carry `nvidia.com/gpu.clique` as nvdra's GPU plugin sets it from the profile
//!   (`nvdra inventory --profile gb200-nvl72 --node-name node-N`);
//! - a claim made from a template (as the resourceclaim controller does) and allocated a node's
//!   device with the template's config and the device's binding conditions (as the scheduler
//!   does, once the node's slice publishes the device untainted): [`allocated_from`];
//! - the DaemonSet controller and the kubelet for the daemons ([`Cluster::run_daemonsets`]): a
//!   daemon pod on each node the domain's DaemonSet selects, its claim from the daemon template,
//!   allocated the node's `daemon-0`, prepared by the plugin, and the container started as the
//!   kubelet would: the DaemonSet's environment (downward API filled in) plus the claim's CDI
//!   edits (its environment, its `/imexd` mount's host path).
// The integration binary and the bench each use what they need.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use kubelet_plugin::Claim;
use kubelet_plugin::testing::{ApiServer, KubeletClient};
use nvdra::computedomain::api::{CLIQUE_LABEL, DRIVER_NAME};
use serde_json::{Value, json};

/// The workload's namespace.
pub const NS: &str = "team-a";
/// The driver's namespace (the daemons, their cliques, the controller's Lease).
pub const DRIVER_NS: &str = "nvdra";
/// The IMEX channels' major in each node's `/proc/devices`.
pub const MAJOR: u32 = 239;
const CAPS_MAJOR: u32 = 240;
/// Bounds a failure only (a hang); asserts no speed.
pub const DEADLINE: Duration = Duration::from_secs(180);

/// A process killed (and reaped) when dropped, its output in a log file.
pub struct Proc {
    pub child: Child,
    pub log: PathBuf,
}

impl Proc {
    pub fn spawn(mut cmd: Command, log: PathBuf) -> Proc {
        let out = std::fs::File::create(&log).unwrap();
        cmd.stdout(out.try_clone().unwrap()).stderr(out);
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {cmd:?}: {e}"));
        Proc { child, log }
    }

    /// Panics with its log if it exited.
    pub fn alive(&mut self) {
        if let Some(status) = self.child.try_wait().unwrap() {
            panic!(
                "{} exited ({status}):\n{}",
                self.log.display(),
                std::fs::read_to_string(&self.log).unwrap_or_default()
            );
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The `nvdra` binary cargo built for this test or bench, with a clean environment.
pub fn nvdra() -> Command {
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
pub fn clique_of(node: &str) -> String {
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

pub fn fake_imex(tool: &str) -> String {
    format!("{}/tests/data/fake-imex/{tool}", env!("CARGO_MANIFEST_DIR"))
}

/// How to start a [`Cluster`].
pub struct Options {
    pub nodes: usize,
    /// The second octet of the nodes' loopback addresses (`127.<net>.0.<node+1>`): one per
    /// cluster that may run beside another.
    pub net: u8,
    /// The plugins' `--binding-conditions`.
    pub binding_conditions: &'static str,
    /// The API server's minor version (binding conditions `auto` are on from 36).
    pub server_minor: u32,
    /// The plugins' `--resync-seconds` (None: the default).
    pub resync_seconds: Option<u64>,
    /// Environment of every daemon on top of what the cluster gives it (timings, fault knobs).
    pub daemon_env: Vec<(String, String)>,
    /// Where CDI specs go (None: a directory of the cluster's own).
    pub cdi_root: Option<PathBuf>,
    /// The fake NVML library (`tests/fake-nvml`) the daemons' fabric check loads.
    pub fake_nvml: PathBuf,
}

/// One simulated node: its directories, its plugin process and DRA socket, its daemon.
pub struct Node {
    pub name: String,
    pub dir: PathBuf,
    pub cdi_root: PathBuf,
    pub net: u8,
    pub plugin: Proc,
    pub kubelet: Option<KubeletClient>,
    pub daemon: Option<Proc>,
    /// This node's daemon's environment on top of [`Options::daemon_env`].
    pub daemon_env: Vec<(String, String)>,
}

impl Node {
    fn start(i: usize, root: &Path, cdi_root: &Path, kubeconfig: &Path, o: &Options) -> Node {
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
            .args(["--binding-conditions", o.binding_conditions])
            .arg("--kubeconfig")
            .arg(kubeconfig);
        if let Some(s) = o.resync_seconds {
            cmd.args(["--resync-seconds", &s.to_string()]);
        }
        let plugin = Proc::spawn(cmd, dir.join("plugin.log"));
        Node {
            name,
            dir,
            cdi_root: cdi_root.to_path_buf(),
            net: o.net,
            plugin,
            kubelet: None,
            daemon: None,
            daemon_env: Vec::new(),
        }
    }

    pub fn ip(&self) -> String {
        let i: u8 = self.name.trim_start_matches("node-").parse().unwrap();
        format!("127.{}.0.{}", self.net, i + 1)
    }

    /// The kubelet's client of this node's plugin, connected once its DRA socket answers.
    pub async fn kubelet(&mut self) -> &mut KubeletClient {
        if self.kubelet.is_none() {
            let socket = self
                .dir
                .join("kubelet/plugins")
                .join(DRIVER_NAME)
                .join("dra.sock");
            let deadline = tokio::time::Instant::now() + DEADLINE;
            // The socket's file appears at bind, before listen: connect until it answers.
            let client = loop {
                self.plugin.alive();
                if let Ok(c) = KubeletClient::connect(&socket).await {
                    break c;
                }
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "{}'s DRA socket {} does not answer",
                    self.name,
                    socket.display()
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            };
            self.kubelet = Some(client);
        }
        self.kubelet.as_mut().unwrap()
    }

    /// The kubelet's NodePrepareResources of one claim: its CDI device IDs, or the error.
    pub async fn prepare(&mut self, claim: &Claim) -> Result<Vec<String>, String> {
        self.plugin.alive();
        prepare(self.kubelet().await, claim).await
    }
}

/// NodePrepareResources of one claim through `kubelet`: its CDI device IDs, or the error.
pub async fn prepare(kubelet: &mut KubeletClient, claim: &Claim) -> Result<Vec<String>, String> {
    let answers = kubelet
        .prepare(std::slice::from_ref(claim))
        .await
        .map_err(|e| e.to_string())?;
    answers[&claim.uid].clone()
}

/// The published device `device` of `node`'s pool, if any.
pub fn device(api: &ApiServer, node: &str, device: &str) -> Option<Value> {
    api.slices()
        .iter()
        .filter(|s| s.spec.driver == DRIVER_NAME && s.spec.node_name.as_deref() == Some(node))
        .flat_map(|s| s.spec.devices.iter().flatten())
        .find(|d| d.name == device)
        .map(|d| serde_json::to_value(d).unwrap())
}

/// Whether `node`'s published slice has `device` untainted (the scheduler allocates only that).
pub fn published(api: &ApiServer, node: &str, name: &str) -> bool {
    device(api, node, name).is_some_and(|d| d.get("taints").is_none_or(Value::is_null))
}

/// `claim` of a pod, made from `template` (as the resourceclaim controller does) and allocated
/// `device` of `node`'s pool with the template's config and the device's binding conditions
/// (as the scheduler does).
pub fn allocated_from(
    api: &ApiServer,
    template: &Value,
    pod: &Value,
    node: &str,
    device_name: &str,
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
    let mut result = json!({"request": request, "driver": DRIVER_NAME, "pool": node,
                            "device": device_name});
    let published = device(api, node, device_name).unwrap_or_default();
    for key in ["bindingConditions", "bindingFailureConditions"] {
        if let Some(c) = published.get(key).filter(|c| !c.is_null()) {
            result[key] = c.clone();
        }
    }
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
                "devices": {"results": [result], "config": config},
                "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                    {"key": "metadata.name", "operator": "In", "values": [node]}]}]},
            },
            "reservedFor": [{"resource": "pods", "name": pod_name, "uid": pod["metadata"]["uid"]}],
        },
    });
    let stored = api.put_object("resource.k8s.io/v1", "resourceclaims", claim);
    Claim::new(ns, &name, stored["metadata"]["uid"].as_str().unwrap())
}

/// Whether the claim's device carries the condition `kind` with status True (as a binding
/// condition the scheduler waits for).
pub fn device_condition(api: &ApiServer, claim: &Claim, kind: &str) -> bool {
    api.object(
        "resource.k8s.io/v1",
        "resourceclaims",
        &claim.namespace,
        &claim.name,
    )
    .and_then(|c| c["status"]["devices"].as_array().cloned())
    .into_iter()
    .flatten()
    .flat_map(|d| d["conditions"].as_array().cloned().unwrap_or_default())
    .any(|c| c["type"] == kind && c["status"] == "True")
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

/// The cluster: API server, plugins, controller, and the daemons the DaemonSets bring.
pub struct Cluster {
    pub root: tempfile::TempDir,
    pub api: ApiServer,
    pub kubeconfig: PathBuf,
    pub cdi_root: PathBuf,
    pub driver_root: PathBuf,
    pub nodes: Vec<Node>,
    pub controller: Proc,
    daemon_env: Vec<(String, String)>,
}

impl Cluster {
    /// Starts the API server (with the nodes, labelled with their clique), a plugin per node and
    /// the controller; returns once every node publishes its `channel-0` and the controller
    /// holds its Lease, so what the caller times next is the domain's flow alone.
    pub async fn start(o: Options) -> Cluster {
        let root = tempfile::tempdir().unwrap();
        let cdi_root = o
            .cdi_root
            .clone()
            .unwrap_or_else(|| root.path().join("cdi"));
        std::fs::create_dir_all(&cdi_root).unwrap();
        let driver_root = root.path().join("driver");
        std::fs::create_dir_all(driver_root.join("usr/lib64")).unwrap();
        std::os::unix::fs::symlink(
            &o.fake_nvml,
            driver_root
                .join("usr/lib64")
                .join(nvdra::inventory::nvml::LIBRARY),
        )
        .unwrap();

        let api = ApiServer::start().await;
        api.set_server_minor(o.server_minor);
        let kubeconfig = root.path().join("kubeconfig");
        std::fs::write(&kubeconfig, api.kubeconfig()).unwrap();
        for i in 0..o.nodes {
            let name = format!("node-{i}");
            api.seed_node(&name, &format!("uid-{name}"));
            api.set_node_label(&name, CLIQUE_LABEL, &clique_of(&name));
        }
        let nodes: Vec<Node> = (0..o.nodes)
            .map(|i| Node::start(i, root.path(), &cdi_root, &kubeconfig, &o))
            .collect();
        let mut cmd = nvdra();
        cmd.args(["compute-domain", "controller", "--namespace", DRIVER_NS])
            .args(["--image-name", "nvdra:e2e", "--pod-name", "controller-0"])
            .args(["--leader-election-retry-period", "1s"])
            .arg("--kubeconfig")
            .arg(&kubeconfig);
        let controller = Proc::spawn(cmd, root.path().join("controller.log"));
        let mut cluster = Cluster {
            root,
            api,
            kubeconfig,
            cdi_root,
            driver_root,
            nodes,
            controller,
            daemon_env: o.daemon_env,
        };
        cluster
            .wait("every node's channel-0 and the controller's Lease", |c| {
                let led = c
                    .api
                    .objects("coordination.k8s.io/v1", "leases")
                    .iter()
                    .any(|l| {
                        l["spec"]["holderIdentity"]
                            .as_str()
                            .is_some_and(|h| !h.is_empty())
                    });
                (led && c
                    .nodes
                    .iter()
                    .all(|n| published(&c.api, &n.name, "channel-0")))
                .then_some(())
            })
            .await;
        cluster
    }

    /// Polls `probe` (every 100 ms, checking that no process exited) until it answers; panics
    /// with the processes' logs after [`DEADLINE`].
    pub async fn wait<T>(&mut self, what: &str, mut probe: impl FnMut(&Cluster) -> Option<T>) -> T {
        let deadline = tokio::time::Instant::now() + DEADLINE;
        loop {
            self.alive();
            if let Some(v) = probe(self) {
                return v;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "waited {DEADLINE:?} for {what}, in vain; logs:\n{}",
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Panics with its log if a process exited.
    pub fn alive(&mut self) {
        self.controller.alive();
        for n in &mut self.nodes {
            n.plugin.alive();
            if let Some(d) = n.daemon.as_mut() {
                d.alive();
            }
        }
    }

    /// Creates the user's ComputeDomain (NVIDIA's demo shape) through kube::Client, as kubectl
    /// would.
    pub async fn create_domain(&self, name: &str, num_nodes: usize, template: &str) {
        let client = self.api.client().unwrap();
        let gvk =
            kube::core::GroupVersionKind::gvk("resource.nvidia.com", "v1beta1", "ComputeDomain");
        let ar = kube::core::ApiResource::from_gvk_with_plural(&gvk, "computedomains");
        let domains: kube::Api<kube::core::DynamicObject> =
            kube::Api::namespaced_with(client, NS, &ar);
        let cd: kube::core::DynamicObject = serde_json::from_value(json!({
            "apiVersion": "resource.nvidia.com/v1beta1", "kind": "ComputeDomain",
            "metadata": {"name": name, "namespace": NS},
            "spec": {"numNodes": num_nodes, "channel": {"resourceClaimTemplate": {"name": template}}},
        }))
        .unwrap();
        domains.create(&Default::default(), &cd).await.unwrap();
    }

    /// The domain as stored.
    pub fn domain(&self, name: &str) -> Option<Value> {
        self.api
            .object("resource.nvidia.com/v1beta1", "computedomains", NS, name)
    }

    /// The workload template the controller made for the domain.
    pub async fn template(&mut self, name: &str) -> Value {
        self.wait("the controller's workload template", |c| {
            c.api
                .object("resource.k8s.io/v1", "resourceclaimtemplates", NS, name)
        })
        .await
    }

    /// A workload pod using `template`'s claim, bound to `node` or (None) not yet bound.
    pub fn workload_pod(&self, name: &str, template: &str, node: Option<&str>) -> Value {
        let mut spec = json!({"containers": [{"name": "w", "image": "busybox",
                               "resources": {"claims": [{"name": "channel"}]}}],
                              "resourceClaims": [{"name": "channel", "resourceClaimTemplateName": template}]});
        if let Some(n) = node {
            spec["nodeName"] = n.into();
        }
        self.api.put_object(
            "v1",
            "pods",
            json!({"metadata": {"name": name, "namespace": NS}, "spec": spec}),
        )
    }

    /// One pass of the DaemonSet controller and the daemons' kubelet: a daemon wherever a
    /// domain's DaemonSet selects a node that has none yet.
    pub async fn run_daemonsets(&mut self) {
        self.alive();
        for ds in self.api.objects("apps/v1", "daemonsets") {
            let selector = &ds["spec"]["template"]["spec"]["nodeSelector"];
            for i in 0..self.nodes.len() {
                let labels = self
                    .api
                    .object("v1", "nodes", "", &self.nodes[i].name)
                    .map(|n| n["metadata"]["labels"].clone())
                    .unwrap_or_default();
                if self.nodes[i].daemon.is_none() && labels_match(selector, &labels) {
                    self.start_daemon(&ds, i).await;
                }
            }
        }
    }

    /// The DaemonSet controller's and the kubelet's part for one daemon pod: pod, claim,
    /// prepare, and the container as a process. Returns false while the prepare fails.
    async fn start_daemon(&mut self, ds: &Value, i: usize) -> bool {
        let api = &self.api;
        let node = &mut self.nodes[i];
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
                        "status": {"phase": "Pending", "podIP": node.ip(),
                                   "podIPs": [{"ip": node.ip()}], "hostIP": node.ip()},
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
        let cdi: Value =
            nvdra::yaml::from_str(&std::fs::read_to_string(&spec_file).unwrap()).unwrap();
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
            .env("FAKE_IMEX_HOSTS", &hosts)
            // The fabric check reads the node's GPUs through NVML: the fake, as the profile.
            .env("NVDRA_CD_FABRIC_CHECK", "nvml")
            .env("NVIDIA_DRIVER_ROOT", &self.driver_root)
            .env("FAKE_NVML_PROFILE", "gb200-nvl72")
            .env("FAKE_NVML_SEED", &node.name)
            .env_remove("FAKE_NVML_NODE")
            .env_remove("FAKE_NVML_TOPOLOGY")
            .env_remove("FAKE_NVML_STATE")
            .envs(self.daemon_env.iter().cloned())
            .envs(node.daemon_env.iter().cloned())
            .env("KUBECONFIG", &self.kubeconfig);
        node.daemon = Some(Proc::spawn(cmd, node.dir.join("daemon.log")));
        let mut running = api.object("v1", "pods", DRIVER_NS, &pod_name).unwrap();
        running["status"]["phase"] = "Running".into();
        running["status"]["containerStatuses"] = json!([{"name": "compute-domain-daemon",
            "ready": true, "restartCount": 0, "image": "nvdra", "imageID": "",
            "state": {"running": {}}}]);
        api.put_object("v1", "pods", running);
        true
    }

    /// The last lines of every process's log.
    pub fn logs(&self) -> String {
        let mut out = String::new();
        let mut files: Vec<PathBuf> = vec![self.controller.log.clone()];
        for n in &self.nodes {
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
}
