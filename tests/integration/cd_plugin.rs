//! The compute-domain kubelet plugin (`nvdra compute-domain plugin`, issue 37 item 2) against the
//! test API server through kube::Client (ComputeDomains, cliques, claims, Nodes, slices), the
//! kubelet played by the library's `KubeletClient` and by the grpcio stand-in:
//!
//! - it publishes NVIDIA's `channel-0` and `daemon-0` (binding conditions on a 1.36 server);
//! - a channel claim's CDI spec runs under podman: the container sees the char device with the
//!   major of `/proc/devices` and the channel's number as minor;
//! - a node whose daemon is not ready has its channel tainted, and a prepare returns at once
//!   with the reason;
//! - a restart keeps prepared claims (the same answer, the spec written again, unprepare works);
//! - a daemon claim gets what NVIDIA's daemon container gets.

use std::path::{Path, PathBuf};
use std::time::Duration;

use k8s_openapi::api::resource::v1::{
    DeviceAllocationConfiguration, OpaqueDeviceConfiguration, ResourceClaim, ResourceSlice,
};
use k8s_openapi::apimachinery::pkg::runtime::RawExtension;
use kubelet_plugin::Claim;
use kubelet_plugin::testing::{KubeletClient, allocated_claim, allocated_device};
use nvdra::computedomain::api::{
    ChannelSpec, CliqueDaemon, ComputeDomain, ComputeDomainClique, ComputeDomainSpec, DRIVER_NAME,
    NODE_LABEL, TemplateRef,
};
use nvdra::computedomain::plugin::{self, Args, BindingConditions};
use tokio_util::sync::CancellationToken;

use crate::support::apiserver::TestApiServer;
use crate::support::grpcio::{NodeStandin, have_grpcio};
use crate::support::podman as engine;

const NODE: &str = "node-a";
const NS: &str = "team-a";
const DRIVER_NS: &str = "nvdra";
const CLIQUE: &str = "c0ffee00-0000-4000-8000-000000000001.1";
const MAJOR: u32 = 239;
const CAPS_MAJOR: u32 = 240;

/// A node: its directories, the API server with a domain in it, and the plugin while it runs.
struct Node {
    dir: tempfile::TempDir,
    cdi_root: PathBuf,
    api: TestApiServer,
    domain: String,
    stop: CancellationToken,
    plugin: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
}

impl Node {
    async fn new(cdi_root: Option<PathBuf>) -> Node {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("devices"),
            format!(
                "Character devices:\n  1 mem\n195 nvidia\n{MAJOR} nvidia-caps-imex-channels\n\
                 {CAPS_MAJOR} nvidia-caps\n\nBlock devices:\n  8 sd\n"
            ),
        )
        .unwrap();
        std::fs::create_dir_all(dir.path().join("caps")).unwrap();
        std::fs::write(
            dir.path().join("caps/fabric-imex-mgmt"),
            "DeviceFileMinor: 2\nDeviceFileMode: 256\nDeviceFileModify: 1\n",
        )
        .unwrap();
        fake_driver(&dir.path().join("driver"));
        let cdi_root = cdi_root.unwrap_or_else(|| dir.path().join("cdi"));
        let api = TestApiServer::start().await;
        api.seed_node(NODE, "node-a-uid");
        let spec = ComputeDomainSpec {
            channel: Some(ChannelSpec {
                resource_claim_template: TemplateRef {
                    name: "imex-channel".into(),
                },
                ..ChannelSpec::default()
            }),
            ..ComputeDomainSpec::default()
        };
        let d = api.put(&ComputeDomain::new(NS, "imex", spec));
        let domain = d.metadata.uid.unwrap();
        Node {
            dir,
            cdi_root,
            api,
            domain,
            stop: CancellationToken::new(),
            plugin: None,
        }
    }

    fn kubelet_root(&self) -> PathBuf {
        self.dir.path().join("kubelet")
    }

    fn plugin_dir(&self) -> PathBuf {
        self.kubelet_root().join("plugins").join(DRIVER_NAME)
    }

    fn args(&self, binding_conditions: BindingConditions) -> Args {
        Args {
            node_name: NODE.into(),
            pod_uid: None,
            namespace: DRIVER_NS.into(),
            kubelet_root: self.kubelet_root(),
            cdi_root: self.cdi_root.clone(),
            proc_devices: self.dir.path().join("devices"),
            capabilities_root: self.dir.path().join("caps"),
            driver_root: self.dir.path().join("driver"),
            dev_root: None,
            driver_root_ctr_path: None,
            clique_id: Some(CLIQUE.into()),
            binding_conditions,
            resync_seconds: 1,
            kubeconfig: None,
        }
    }

    /// Starts the plugin in this process and connects to its DRA socket.
    async fn start(&mut self, bc: BindingConditions) -> KubeletClient {
        self.stop = CancellationToken::new();
        let args = self.args(bc);
        let client = self.api.client().unwrap();
        self.plugin = Some(tokio::spawn(plugin::serve(args, client, self.stop.clone())));
        // The socket's file exists from its bind, before it listens: connect until it answers
        // (the deadline only bounds a failure).
        let socket = self.plugin_dir().join("dra.sock");
        let mut tries = 0;
        loop {
            match KubeletClient::connect(&socket).await {
                Ok(client) => return client,
                Err(_) if tries < 400 => {
                    tries += 1;
                    tokio::time::sleep(Duration::from_millis(25)).await;
                }
                Err(e) => panic!(
                    "the plugin's DRA socket {} never answered: {e}",
                    socket.display()
                ),
            }
        }
    }

    async fn stop(&mut self) {
        self.stop.cancel();
        if let Some(p) = self.plugin.take() {
            p.await.unwrap().unwrap();
        }
    }

    /// The domain's clique with this node's daemon `status`.
    fn daemon(&self, status: &str) {
        self.clique_object(&self.domain.clone(), status);
    }

    /// The per-clique daemon's object (`fabric.<clique>`) with this node's entry `status`.
    fn fabric(&self, status: &str) {
        self.clique_object("fabric", status);
    }

    fn clique_object(&self, object: &str, status: &str) {
        let mut c = ComputeDomainClique::default();
        c.metadata.namespace = Some(DRIVER_NS.into());
        c.metadata.name = Some(ComputeDomainClique::name_for(object, CLIQUE));
        c.daemons = vec![CliqueDaemon {
            node_name: NODE.into(),
            ip_address: "10.0.0.1".into(),
            clique_id: CLIQUE.into(),
            index: 0,
            status: status.into(),
        }];
        self.api.put(&c);
    }

    /// A claim allocated `device` of `pool` with the domain's config of `kind`; seeded in the
    /// namespace the controller would create it in (a daemon's in the driver's, a channel's in
    /// the domain's).
    fn claim(
        &self,
        name: &str,
        pool: &str,
        device: &str,
        kind: &str,
        extra: serde_json::Value,
    ) -> Claim {
        let ns = if kind == "ComputeDomainDaemonConfig" {
            DRIVER_NS
        } else {
            NS
        };
        self.claim_in(ns, name, pool, device, kind, extra)
    }

    /// [`Node::claim`] in namespace `ns`.
    fn claim_in(
        &self,
        ns: &str,
        name: &str,
        pool: &str,
        device: &str,
        kind: &str,
        extra: serde_json::Value,
    ) -> Claim {
        let uid = format!("cd-plugin-{name}-{:08x}", rand::random::<u32>());
        let mut c: ResourceClaim = allocated_claim(
            ns,
            name,
            &uid,
            vec![allocated_device("req", DRIVER_NAME, pool, device)],
        );
        let mut params = serde_json::json!({
            "apiVersion": "resource.nvidia.com/v1beta1",
            "kind": kind,
            "domainID": self.domain,
        });
        if let (Some(p), Some(e)) = (params.as_object_mut(), extra.as_object()) {
            p.extend(e.clone());
        }
        let alloc = c.status.as_mut().unwrap().allocation.as_mut().unwrap();
        alloc.devices.as_mut().unwrap().config = Some(vec![DeviceAllocationConfiguration {
            source: "FromClass".into(),
            requests: None,
            opaque: Some(OpaqueDeviceConfiguration {
                driver: DRIVER_NAME.into(),
                parameters: RawExtension(params),
            }),
        }]);
        self.api.seed_claim(c);
        Claim::new(ns, name, uid)
    }

    fn channel_claim(&self, name: &str) -> Claim {
        self.claim(
            name,
            NODE,
            "channel-0",
            "ComputeDomainChannelConfig",
            serde_json::json!({}),
        )
    }

    fn node_label(&self) -> Option<String> {
        self.api
            .node(NODE)
            .and_then(|n| n.metadata.labels)
            .and_then(|l| l.get(NODE_LABEL).cloned())
    }

    fn channel_device(&self) -> Option<k8s_openapi::api::resource::v1::Device> {
        let slices: Vec<ResourceSlice> = self.api.slices();
        slices
            .into_iter()
            .filter(|s| s.spec.driver == DRIVER_NAME)
            .flat_map(|s| s.spec.devices.unwrap_or_default())
            .find(|d| d.name == "channel-0")
    }

    async fn wait(&self, what: &str, pred: impl Fn(&Node) -> bool) {
        for _ in 0..400 {
            if pred(self) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!("timed out waiting for {what}");
    }
}

/// A driver root as the node's: its device nodes under `dev/` (links to the host's own
/// character devices, whose numbers are known: `/dev/zero` is 1:5, `/dev/full` 1:7, `/dev/null`
/// 1:3, `/dev/urandom` 1:9), one NVSwitch node nvcdi's management mode leaves out, the driver's
/// libraries and its binaries (scripts saying their name).
fn fake_driver(root: &Path) {
    let dev = root.join("dev");
    std::fs::create_dir_all(&dev).unwrap();
    for (name, host) in [
        ("nvidiactl", "/dev/zero"),
        ("nvidia-uvm", "/dev/full"),
        ("nvidia0", "/dev/null"),
        ("nvidia1", "/dev/urandom"),
        ("nvidia-nvswitch0", "/dev/random"),
    ] {
        std::os::unix::fs::symlink(host, dev.join(name)).unwrap();
    }
    let lib = root.join("usr/lib/x86_64-linux-gnu");
    std::fs::create_dir_all(&lib).unwrap();
    for name in ["libcuda.so.550.54.15", "libnvidia-ml.so.550.54.15"] {
        std::fs::write(lib.join(name), b"").unwrap();
    }
    let bin = root.join("usr/bin");
    std::fs::create_dir_all(&bin).unwrap();
    for name in ["nvidia-smi", "nvidia-imex", "nvidia-imex-ctl"] {
        let path = bin.join(name);
        std::fs::write(&path, format!("#!/bin/sh\necho {name} ran\n")).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
}

fn spec_path(cdi_root: &Path, uid: &str) -> PathBuf {
    cdi_root.join(format!("k8s.compute-domain.nvidia.com-claim_{uid}.yaml"))
}

#[tokio::test]
async fn it_publishes_nvidias_devices_with_binding_conditions_on_a_1_36_server() {
    let mut node = Node::new(None).await;
    node.api.set_server_version(36, 0);
    let _kubelet = node.start(BindingConditions::Auto).await;
    node.wait("the node's slice", |n| n.channel_device().is_some())
        .await;
    let slices = node.api.slices();
    let devices: Vec<_> = slices
        .iter()
        .filter(|s| s.spec.driver == DRIVER_NAME && s.spec.node_name.as_deref() == Some(NODE))
        .flat_map(|s| s.spec.devices.clone().unwrap_or_default())
        .collect();
    let names: Vec<&str> = devices.iter().map(|d| d.name.as_str()).collect();
    assert_eq!(names, ["channel-0", "daemon-0"]);
    let attr = |d: &k8s_openapi::api::resource::v1::Device, k: &str| {
        d.attributes.as_ref().unwrap()[k].clone()
    };
    assert_eq!(attr(&devices[0], "type").string.as_deref(), Some("channel"));
    assert_eq!(attr(&devices[0], "id").int, Some(0));
    assert_eq!(attr(&devices[1], "type").string.as_deref(), Some("daemon"));
    assert_eq!(
        devices[0].binding_conditions.as_deref(),
        Some(&["ComputeDomainReady".to_string()][..])
    );
    assert!(devices[0].taints.is_none() && devices[1].binding_conditions.is_none());
    node.stop().await;

    // A 1.35 server: no binding conditions.
    let mut old = Node::new(None).await;
    old.api.set_server_version(35, 0);
    let _kubelet = old.start(BindingConditions::Auto).await;
    old.wait("the node's slice", |n| n.channel_device().is_some())
        .await;
    assert!(old.channel_device().unwrap().binding_conditions.is_none());
    old.stop().await;
}

#[tokio::test]
async fn a_node_whose_daemon_is_not_ready_taints_its_channel_and_prepare_answers_at_once() {
    let mut node = Node::new(None).await;
    let mut kubelet = node.start(BindingConditions::Off).await;
    let claim = node.channel_claim("workload");
    // The first workload lands: the node is labelled for its domain, the prepare fails at once
    // (no daemon yet), and says why.
    let answers = kubelet.prepare(std::slice::from_ref(&claim)).await.unwrap();
    let e = answers[&claim.uid].clone().unwrap_err();
    assert!(e.contains("is not ready on node node-a"), "{e}");
    assert!(e.contains("does not wait"), "{e}");
    assert_eq!(node.node_label().as_deref(), Some(node.domain.as_str()));
    assert!(!spec_path(&node.cdi_root, &claim.uid).exists());
    // Its daemon started and is not ready: the channel is tainted, the prepare still fails.
    node.daemon("NotReady");
    node.wait("the taint", |n| {
        n.channel_device().and_then(|d| d.taints).is_some_and(|t| {
            t.iter().any(|t| {
                t.key == "compute-domain.nvidia.com/daemon-not-ready" && t.effect == "NoSchedule"
            })
        })
    })
    .await;
    let answers = kubelet.prepare(std::slice::from_ref(&claim)).await.unwrap();
    let e = answers[&claim.uid].clone().unwrap_err();
    assert!(e.contains("is NotReady in ComputeDomainClique"), "{e}");
    // Ready: the taint goes, the prepare succeeds.
    node.daemon("Ready");
    node.wait("the taint removed", |n| {
        n.channel_device().is_some_and(|d| d.taints.is_none())
    })
    .await;
    let answers = kubelet.prepare(std::slice::from_ref(&claim)).await.unwrap();
    let ids = answers[&claim.uid].clone().unwrap();
    assert_eq!(
        ids,
        [format!(
            "k8s.compute-domain.nvidia.com/claim={}-channel-0",
            claim.uid
        )]
    );
    node.stop().await;
}

#[tokio::test]
async fn a_restart_keeps_prepared_claims_and_unprepare_works_after_it() {
    let mut node = Node::new(None).await;
    node.daemon("Ready");
    let mut kubelet = node.start(BindingConditions::Off).await;
    let claim = node.channel_claim("workload");
    let all = node.claim(
        "all",
        "pool-of-clique",
        "channel-7",
        "ComputeDomainChannelConfig",
        serde_json::json!({"allocationMode": "All"}),
    );
    // A clique pool's channel waits for the node's per-clique daemon (`fabric.<clique>`), not
    // the domain's.
    let first = kubelet.prepare(std::slice::from_ref(&all)).await.unwrap();
    let e = first[&all.uid].clone().unwrap_err();
    assert!(
        e.contains(&format!("no ComputeDomainClique nvdra/fabric.{CLIQUE}")),
        "{e}"
    );
    node.fabric("Ready");
    let first = kubelet
        .prepare(&[claim.clone(), all.clone()])
        .await
        .unwrap();
    let ids = first[&claim.uid].clone().unwrap();
    assert!(first[&all.uid].is_ok(), "{first:?}");
    let spec = spec_path(&node.cdi_root, &claim.uid);
    let text = std::fs::read_to_string(&spec).unwrap();
    assert!(
        text.contains("/dev/nvidia-caps-imex-channels/channel0"),
        "{text}"
    );
    assert!(text.contains(&format!("major: {MAJOR}")), "{text}");
    let all_text = std::fs::read_to_string(spec_path(&node.cdi_root, &all.uid)).unwrap();
    assert!(
        all_text.contains("channel2047"),
        "allocationMode All injects every channel"
    );
    node.stop().await;

    // The CDI directory emptied (a reboot's tmpfs), the daemon no longer ready: after the
    // restart the prepared claim gets the same answer from the checkpoint, its spec written
    // again.
    std::fs::remove_file(&spec).unwrap();
    node.daemon("NotReady");
    let mut kubelet = node.start(BindingConditions::Off).await;
    assert!(spec.exists(), "the spec is written again at start-up");
    let again = kubelet.prepare(std::slice::from_ref(&claim)).await.unwrap();
    assert_eq!(again[&claim.uid].clone().unwrap(), ids);
    let gone = kubelet
        .unprepare(&[claim.clone(), all.clone()])
        .await
        .unwrap();
    assert!(gone.values().all(|r| r.is_ok()), "{gone:?}");
    assert!(!spec.exists());
    assert_eq!(
        node.node_label(),
        None,
        "the last claim of the domain took the label with it"
    );
    // Unprepare again (the kubelet retries): nothing left, still fine.
    let gone = kubelet
        .unprepare(std::slice::from_ref(&claim))
        .await
        .unwrap();
    assert!(gone[&claim.uid].is_ok());
    node.stop().await;
}

#[tokio::test]
async fn a_daemon_claim_gets_what_nvidias_daemon_container_gets() {
    let mut node = Node::new(None).await;
    let mut kubelet = node.start(BindingConditions::Off).await;
    // The daemon device carries the node's IMEX management capability: a workload namespace
    // cannot have it, only the driver's, where the controller creates the daemons' claims.
    let stray = node.claim_in(
        NS,
        "stray-daemon",
        NODE,
        "daemon-0",
        "ComputeDomainDaemonConfig",
        serde_json::json!({}),
    );
    let refused = kubelet.prepare(std::slice::from_ref(&stray)).await.unwrap();
    let err = refused[&stray.uid].clone().unwrap_err();
    assert!(
        err.contains("daemon claims are served only in the driver's namespace nvdra"),
        "{err}"
    );
    let claim = node.claim(
        "daemon",
        NODE,
        "daemon-0",
        "ComputeDomainDaemonConfig",
        serde_json::json!({}),
    );
    let answers = kubelet.prepare(std::slice::from_ref(&claim)).await.unwrap();
    assert_eq!(
        answers[&claim.uid].clone().unwrap(),
        [format!(
            "k8s.compute-domain.nvidia.com/claim={}-daemon-0",
            claim.uid
        )]
    );
    let text = std::fs::read_to_string(spec_path(&node.cdi_root, &claim.uid)).unwrap();
    let spec: serde_json::Value = nvdra::yaml::from_str(&text).unwrap();
    let edits = &spec["devices"][0]["containerEdits"];
    let env: Vec<&str> = edits["env"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert_eq!(
        env,
        [
            format!("CLIQUE_ID={CLIQUE}"),
            format!("COMPUTE_DOMAIN_UUID={}", node.domain),
            "COMPUTE_DOMAIN_NAME=imex".into(),
            format!("COMPUTE_DOMAIN_NAMESPACE={NS}"),
            "NVIDIA_VISIBLE_DEVICES=void".into(),
        ]
    );
    let dir = node.plugin_dir().join("domains").join(&node.domain);
    assert!(dir.is_dir());
    assert_eq!(edits["mounts"][0]["hostPath"], dir.display().to_string());
    assert_eq!(edits["mounts"][0]["containerPath"], "/imexd");
    let mgmt = &edits["deviceNodes"][0];
    assert_eq!(mgmt["path"], "/dev/nvidia-caps/nvidia-cap2");
    assert_eq!(
        (mgmt["major"].as_u64(), mgmt["minor"].as_u64()),
        (Some(u64::from(CAPS_MAJOR)), Some(2))
    );
    // NVIDIA's base spec: the node's NVIDIA device nodes (not the NVSwitch's) with the host's
    // numbers, and the driver's files at their path under the driver root.
    let nodes: Vec<(&str, u64, u64)> = edits["deviceNodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| {
            (
                n["path"].as_str().unwrap(),
                n["major"].as_u64().unwrap(),
                n["minor"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        nodes,
        [
            ("/dev/nvidia-caps/nvidia-cap2", u64::from(CAPS_MAJOR), 2),
            ("/dev/nvidia-uvm", 1, 7),
            ("/dev/nvidia0", 1, 3),
            ("/dev/nvidia1", 1, 9),
            ("/dev/nvidiactl", 1, 5),
        ]
    );
    let mounts: Vec<&str> = edits["mounts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["containerPath"].as_str().unwrap())
        .collect();
    for path in [
        "/usr/bin/nvidia-imex",
        "/usr/bin/nvidia-imex-ctl",
        "/usr/bin/nvidia-smi",
        "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.550.54.15",
    ] {
        assert!(mounts.contains(&path), "{path} not in {mounts:?}");
    }
    // The IMEX config template, in the domain's directory as NVIDIA's plugin writes it.
    let template = std::fs::read_to_string(dir.join("imexd.cfg.tmpl")).unwrap();
    assert!(template.contains("IMEX_CMD_PORT=50005"), "{template}");
    // A daemon claim never labels the node (its domain's workload does).
    assert_eq!(node.node_label(), None);
    node.stop().await;
}

#[test]
fn podman_sees_the_channel_as_a_char_device_with_the_known_major_and_minor() {
    engine::with_engine(|e| {
        let rt = tokio::runtime::Runtime::new()?;
        rt.block_on(async {
            // Without --cdi-spec-dir podman reads the system directory only.
            let cdi_root = (!e.has_spec_dir_flag).then(|| PathBuf::from(engine::SYSTEM_CDI_DIR));
            let mut node = Node::new(cdi_root).await;
            node.fabric("Ready");
            let mut kubelet = node.start(BindingConditions::Off).await;
            let claim = node.claim(
                "pool",
                "pool-of-clique",
                "channel-5",
                "ComputeDomainChannelConfig",
                serde_json::json!({}),
            );
            let answers = kubelet.prepare(std::slice::from_ref(&claim)).await?;
            let ids = answers[&claim.uid].clone().map_err(anyhow::Error::msg)?;
            let out = e.run_with_device(
                &node.cdi_root,
                &ids[0],
                "ls -l /dev/nvidia-caps-imex-channels/",
            )?;
            let unprepared = kubelet.unprepare(std::slice::from_ref(&claim)).await?;
            node.stop().await;
            let stdout = engine::ok(&out, &format!("podman run --device {}", ids[0]))?;
            eprintln!("container output:\n{stdout}");
            let line = stdout
                .lines()
                .find(|l| l.ends_with(" channel5"))
                .ok_or_else(|| anyhow::anyhow!("no channel5 in the container:\n{stdout}"))?;
            anyhow::ensure!(
                line.starts_with('c')
                    && line.contains(&format!("{MAJOR},"))
                    && line.contains(" 5 "),
                "channel5 is not the char device {MAJOR}:5 in the container: {line}"
            );
            anyhow::ensure!(unprepared[&claim.uid].is_ok(), "{unprepared:?}");
            Ok(())
        })
    });
}

#[test]
fn the_grpcio_kubelet_prepares_and_unprepares_a_channel() {
    if !have_grpcio() {
        return;
    }
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut node = Node::new(None).await;
        node.daemon("Ready");
        let _kubelet = node.start(BindingConditions::Off).await;
        let claim = node.channel_claim("workload");
        let socket = node.plugin_dir().join("dra.sock");
        let root = node.dir.path().join("standin");
        let claims = serde_json::json!([{"namespace": claim.namespace, "name": claim.name, "uid": claim.uid}]);
        let (prepared, unprepared) = tokio::task::spawn_blocking(move || {
            let mut standin = NodeStandin::start(&root, &socket);
            let p = standin.ok(serde_json::json!({"op": "prepare", "claims": claims}));
            let u = standin.ok(serde_json::json!({"op": "unprepare", "claims": claims}));
            (p, u)
        })
        .await
        .unwrap();
        let answer = &prepared["claims"][&claim.uid];
        assert_eq!(answer["error"], "", "{prepared}");
        assert_eq!(answer["devices"], serde_json::json!(["channel-0"]));
        assert_eq!(
            answer["cdi_device_ids"],
            serde_json::json!([[format!("k8s.compute-domain.nvidia.com/claim={}-channel-0", claim.uid)]])
        );
        assert_eq!(unprepared["claims"][&claim.uid]["error"], "", "{unprepared}");
        assert!(!spec_path(&node.cdi_root, &claim.uid).exists());
        node.stop().await;
    });
}

#[tokio::test]
async fn the_clique_comes_from_the_gpu_drivers_slices_and_labels_the_node() {
    use k8s_openapi::api::resource::v1::{
        Device, DeviceAttribute, ResourcePool, ResourceSliceSpec,
    };
    let mut node = Node::new(None).await;
    let attr = |s: Option<&str>, i: Option<i64>| DeviceAttribute {
        string: s.map(String::from),
        int: i,
        ..DeviceAttribute::default()
    };
    let gpu = |name: &str| Device {
        name: name.into(),
        attributes: Some(
            [
                (
                    "fabricClusterUUID".to_string(),
                    attr(Some("7c2f0a55-1111-4222-8333-944455556666"), None),
                ),
                ("fabricCliqueID".to_string(), attr(None, Some(3))),
            ]
            .into(),
        ),
        ..Device::default()
    };
    node.api.insert_slice(ResourceSlice {
        metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
            name: Some("node-a-gpu".into()),
            ..Default::default()
        },
        spec: ResourceSliceSpec {
            driver: "gpu.nvidia.com".into(),
            node_name: Some(NODE.into()),
            pool: ResourcePool {
                name: NODE.into(),
                generation: 1,
                resource_slice_count: 1,
            },
            devices: Some(vec![gpu("gpu-0"), gpu("gpu-1")]),
            ..ResourceSliceSpec::default()
        },
    });
    let mut args = node.args(BindingConditions::Off);
    args.clique_id = None;
    node.stop = CancellationToken::new();
    node.plugin = Some(tokio::spawn(plugin::serve(
        args,
        node.api.client().unwrap(),
        node.stop.clone(),
    )));
    let want = "7c2f0a55-1111-4222-8333-944455556666.3";
    node.wait("the clique label", |n| {
        n.api
            .node(NODE)
            .and_then(|x| x.metadata.labels)
            .and_then(|l| l.get("nvidia.com/gpu.clique").cloned())
            .as_deref()
            == Some(want)
    })
    .await;
    node.stop().await;
}

/// The API server's requests for computedomains: (lists, watches).
fn domain_requests(api: &TestApiServer) -> (usize, usize) {
    let reads: Vec<_> = api
        .requests()
        .into_iter()
        .filter(|r| r.method == "GET" && r.path.ends_with("/computedomains"))
        .collect();
    let watches = reads
        .iter()
        .filter(|r| r.query.contains("watch=true"))
        .count();
    (reads.len() - watches, watches)
}

#[tokio::test]
async fn prepares_read_domains_from_the_watch_and_find_a_domain_created_after_start() {
    let mut node = Node::new(None).await;
    node.daemon("Ready");
    let mut kubelet = node.start(BindingConditions::Off).await;
    // The watch starts once its list is stored.
    node.wait("the computedomains watch", |n| {
        domain_requests(&n.api).1 > 0
    })
    .await;
    let (lists, _) = domain_requests(&node.api);
    for i in 0..10 {
        let claim = node.channel_claim(&format!("workload-{i}"));
        let answers = kubelet.prepare(std::slice::from_ref(&claim)).await.unwrap();
        assert!(answers[&claim.uid].is_ok(), "{answers:?}");
        let gone = kubelet
            .unprepare(std::slice::from_ref(&claim))
            .await
            .unwrap();
        assert!(gone[&claim.uid].is_ok(), "{gone:?}");
    }
    assert_eq!(
        domain_requests(&node.api).0,
        lists,
        "10 prepares listed computedomains"
    );

    // A domain created now, its claim prepared at once: found (from the watch, or the one list
    // a store that has not seen it yet makes).
    let spec = ComputeDomainSpec {
        channel: Some(ChannelSpec {
            resource_claim_template: TemplateRef {
                name: "later-channel".into(),
            },
            ..ChannelSpec::default()
        }),
        ..ComputeDomainSpec::default()
    };
    let later = node.api.put(&ComputeDomain::new(NS, "later", spec));
    let later_uid = later.metadata.uid.unwrap();
    node.clique_object(&later_uid, "Ready");
    let claim = node.claim(
        "later",
        NODE,
        "channel-0",
        "ComputeDomainChannelConfig",
        serde_json::json!({"domainID": later_uid}),
    );
    let answers = kubelet.prepare(std::slice::from_ref(&claim)).await.unwrap();
    assert!(answers[&claim.uid].is_ok(), "{answers:?}");
    assert!(domain_requests(&node.api).0 <= lists + 1);
    assert_eq!(node.node_label().as_deref(), Some(later_uid.as_str()));
    node.stop().await;
}

/// An API server that accepts connections and never answers: every call of the plugin's fails at
/// its deadline with an error naming it, and a prepare answers instead of hanging. Paused time:
/// the deadline passes without the test waiting for it.
#[tokio::test(start_paused = true)]
async fn a_prepare_against_a_stalled_api_server_fails_at_the_deadline_naming_the_call() {
    use kubelet_plugin::Driver;
    use nvdra::computedomain::plugin::cluster::{CALL_DEADLINE, KubeCluster};
    use nvdra::computedomain::plugin::prepare::{Paths, Plugin};

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let held = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((conn, _)) = listener.accept().await {
            held.push(conn);
        }
    });
    let config = kube::Config::new(format!("http://{addr}").parse().unwrap());
    let client = kube::Client::try_from(config).unwrap();
    let node = Node::new(None).await;
    let stop = CancellationToken::new();
    let cluster = KubeCluster::start(client, DRIVER_NS, NODE, stop.clone());
    let paths = Paths {
        plugin_dir: node.plugin_dir(),
        cdi_root: node.cdi_root.clone(),
        proc_devices: node.dir.path().join("devices"),
        capabilities_root: node.dir.path().join("caps"),
        driver_root: nvdra::cdi::DriverRoot::at(&node.dir.path().join("driver")),
    };
    let plugin = Plugin::new(NODE, DRIVER_NS, Some(CLIQUE.into()), paths, cluster).unwrap();
    let claim = node.channel_claim("workload");
    let rc = node.api.claim(NS, "workload").unwrap();
    let prepare = kubelet_plugin::claims::check(claim.clone(), rc, DRIVER_NAME).unwrap();

    let start = tokio::time::Instant::now();
    // Bounded here too, so that a call without a deadline fails the test instead of hanging it.
    let answers = tokio::time::timeout(CALL_DEADLINE * 3, plugin.prepare(vec![prepare]))
        .await
        .expect("the prepare answers")
        .unwrap();
    assert!(start.elapsed() >= CALL_DEADLINE);
    let e = answers[0].1.as_ref().unwrap_err().to_string();
    assert!(
        e.contains("the API server did not answer the call to list computedomains within 10s"),
        "{e}"
    );
    stop.cancel();
    held.abort();
}

#[test]
fn podman_runs_the_drivers_imex_in_a_daemon_claims_container_with_the_nodes_devices() {
    engine::with_engine(|e| {
        let rt = tokio::runtime::Runtime::new()?;
        rt.block_on(async {
            let cdi_root = (!e.has_spec_dir_flag).then(|| PathBuf::from(engine::SYSTEM_CDI_DIR));
            let mut node = Node::new(cdi_root).await;
            let mut kubelet = node.start(BindingConditions::Off).await;
            let claim = node.claim(
                "daemon",
                NODE,
                "daemon-0",
                "ComputeDomainDaemonConfig",
                serde_json::json!({}),
            );
            let answers = kubelet.prepare(std::slice::from_ref(&claim)).await?;
            let ids = answers[&claim.uid].clone().map_err(anyhow::Error::msg)?;
            let out = e.run_with_device(
                &node.cdi_root,
                &ids[0],
                "ls -l /dev/nvidiactl /dev/nvidia-uvm /dev/nvidia0 /dev/nvidia1 \
                 /dev/nvidia-caps/nvidia-cap2 && /usr/bin/nvidia-imex && /usr/bin/nvidia-imex-ctl \
                 && cat /imexd/imexd.cfg.tmpl",
            )?;
            let unprepared = kubelet.unprepare(std::slice::from_ref(&claim)).await?;
            node.stop().await;
            let stdout = engine::ok(&out, &format!("podman run --device {}", ids[0]))?;
            eprintln!("container output:\n{stdout}");
            for (path, major, minor) in [
                ("/dev/nvidiactl", 1, 5),
                ("/dev/nvidia-uvm", 1, 7),
                ("/dev/nvidia0", 1, 3),
                ("/dev/nvidia1", 1, 9),
                ("/dev/nvidia-caps/nvidia-cap2", CAPS_MAJOR, 2),
            ] {
                let line = stdout
                    .lines()
                    .find(|l| l.ends_with(&format!(" {path}")))
                    .ok_or_else(|| anyhow::anyhow!("no {path} in the container:\n{stdout}"))?;
                anyhow::ensure!(
                    line.starts_with('c')
                        && line.contains(&format!(" {major},"))
                        && line.contains(&format!(" {minor} ")),
                    "{path} is not the char device {major}:{minor} in the container: {line}"
                );
            }
            for ran in [
                "nvidia-imex ran",
                "nvidia-imex-ctl ran",
                "IMEX_CMD_PORT=50005",
            ] {
                anyhow::ensure!(stdout.contains(ran), "no {ran:?} in:\n{stdout}");
            }
            anyhow::ensure!(unprepared[&claim.uid].is_ok(), "{unprepared:?}");
            Ok(())
        })
    });
}
