//! `nvdra compute-domain controller` against the test API server, as its own process: NVIDIA's
//! generated objects with NVIDIA's names, the status following the domain's cliques (NotReady
//! with the daemon's own reason, the peer matrix), events, the finalizer's cleanup, the sweep of
//! a gone domain's objects without the domain, the clique channel pools and a clique domain's
//! one shared claim (which `nvdra match` then allocates: two domains, two channels), and two
//! controllers with one leader (the leader SIGKILLed: the other takes over).

use crate::support;

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Event as CoreEvent, Node, Pod};
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceClaimTemplate, ResourceSlice};
use kube::Api;
use kube::api::{DeleteParams, PostParams};
use nvdra::computedomain::api::{
    ChannelSpec, ComputeDomain, ComputeDomainClique, ComputeDomainSpec, TemplateRef,
};
use serde_json::{Value, json};
use support::apiserver::TestApiServer;
use tokio::process::{Child, Command};

const NS: &str = "nvdra";
const WAIT: Duration = Duration::from_secs(30);

struct Env {
    server: TestApiServer,
    _dir: tempfile::TempDir,
    kubeconfig: PathBuf,
}

async fn env() -> Env {
    let server = TestApiServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(&kubeconfig, server.kubeconfig()).unwrap();
    Env {
        server,
        _dir: dir,
        kubeconfig,
    }
}

/// Waits as `wait_until`, but fails at once, with its exit status, when the controller exits
/// first: a leader that cannot renew its lease within the renew deadline exits by design (its
/// Deployment restarts it), and nothing reconciles after it here.
async fn alive(
    ctl: &mut Child,
    s: &TestApiServer,
    what: &str,
    pred: impl Fn(&TestApiServer) -> bool,
) {
    tokio::select! {
        () = s.wait_until(WAIT, what, pred) => {}
        status = ctl.wait() => panic!("the controller exited ({status:?}) while waiting for {what}"),
    }
}

impl Env {
    /// A controller process (killed when dropped) named `pod`, with the default lease timings
    /// (a renew deadline of 10 s: a loaded machine does not make the leader give up).
    fn controller(&self, pod: &str, extra: &[&str]) -> Child {
        self.controller_with(pod, &[], extra)
    }

    /// A controller with short lease timings, for the takeover: a lease of 4 s, renewed every
    /// 250 ms and given up after 3 s without renewal.
    fn controller_short_lease(&self, pod: &str) -> Child {
        let lease = [
            "--leader-election-lease-duration",
            "4s",
            "--leader-election-renew-deadline",
            "3s",
            "--leader-election-retry-period",
            "250ms",
        ];
        self.controller_with(pod, &lease, &[])
    }

    fn controller_with(&self, pod: &str, lease: &[&str], extra: &[&str]) -> Child {
        Command::new(env!("CARGO_BIN_EXE_nvdra"))
            .args(["compute-domain", "controller", "--kubeconfig"])
            .arg(&self.kubeconfig)
            .args([
                "--namespace",
                NS,
                "--image-name",
                "registry.example/nvdra:test",
                "--pod-name",
                pod,
            ])
            .args(lease)
            .args(extra)
            .env_remove("KUBECONFIG")
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("start nvdra compute-domain controller")
    }

    fn client(&self) -> kube::Client {
        self.server.client().unwrap()
    }

    fn domain(&self, ns: &str, name: &str) -> Option<ComputeDomain> {
        self.server.get::<ComputeDomain>(ns, name)
    }

    async fn create_domain(
        &self,
        name: &str,
        num_nodes: i64,
        annotations: &[(&str, &str)],
    ) -> String {
        let mut cd = ComputeDomain::new(
            "default",
            name,
            ComputeDomainSpec {
                num_nodes,
                channel: Some(ChannelSpec {
                    resource_claim_template: TemplateRef {
                        name: format!("{name}-channel"),
                    },
                    ..Default::default()
                }),
                ..Default::default()
            },
        );
        if !annotations.is_empty() {
            cd.metadata.annotations = Some(
                annotations
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            );
        }
        let created = Api::<ComputeDomain>::namespaced(self.client(), "default")
            .create(&PostParams::default(), &cd)
            .await
            .unwrap();
        created.metadata.uid.unwrap()
    }
}

fn clique(uid: &str, clique_id: &str, daemons: &[(&str, &str)]) -> ComputeDomainClique {
    serde_json::from_value(json!({
        "metadata": {"name": format!("{uid}.{clique_id}"), "namespace": NS,
                     "labels": {"resource.nvidia.com/computeDomain": uid}},
        "daemons": daemons.iter().enumerate().map(|(i, (node, status))| json!({
            "nodeName": node, "ipAddress": format!("10.0.0.{i}"), "cliqueID": clique_id,
            "index": i, "status": status,
        })).collect::<Vec<_>>(),
    }))
    .unwrap()
}

fn ready_condition(cd: &ComputeDomain) -> Option<Value> {
    let conditions = cd
        .status
        .as_ref()?
        .other
        .get("conditions")?
        .as_array()?
        .clone();
    conditions.into_iter().find(|c| c["type"] == "Ready")
}

fn events(server: &TestApiServer, name: &str) -> Vec<(String, String)> {
    server
        .objects("events.k8s.io/v1", "events")
        .into_iter()
        .filter(|e| e["regarding"]["name"] == name)
        .map(|e| {
            (
                e["reason"].as_str().unwrap_or_default().to_string(),
                e["note"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect()
}

/// A domain gets NVIDIA's three objects, its finalizer and events; its status follows its
/// cliques, NotReady with the daemon's own line; deleting it removes them all.
#[tokio::test]
async fn a_domain_gets_nvidias_objects_its_status_follows_the_cliques_and_deletion_cleans_up() {
    let env = env().await;
    let mut ctl = env.controller("ctl-a", &[]);
    let uid = env.create_domain("job", 2, &[]).await;
    let s = &env.server;

    alive(
        &mut ctl,
        s,
        "the workload template, daemon template and DaemonSet",
        |s| {
            s.get::<ResourceClaimTemplate>("default", "job-channel")
                .is_some()
                && s.get::<ResourceClaimTemplate>(NS, &format!("computedomain-daemon-{uid}"))
                    .is_some()
                && s.get::<DaemonSet>(NS, &format!("computedomain-daemon-{uid}"))
                    .is_some()
        },
    )
    .await;
    let t = s
        .get::<ResourceClaimTemplate>("default", "job-channel")
        .unwrap();
    assert_eq!(
        t.metadata.labels.as_ref().unwrap()["resource.nvidia.com/computeDomain"],
        uid
    );
    assert_eq!(
        t.metadata.finalizers,
        Some(vec!["resource.nvidia.com/computeDomain".into()])
    );
    let ds = s
        .get::<DaemonSet>(NS, &format!("computedomain-daemon-{uid}"))
        .unwrap();
    let pod = ds.spec.unwrap().template.spec.unwrap();
    assert_eq!(
        pod.node_selector.unwrap()["resource.nvidia.com/computeDomain"],
        uid
    );
    assert_eq!(
        pod.containers[0].image.as_deref(),
        Some("registry.example/nvdra:test")
    );
    assert_the_daemon_reads_its_env(&pod.containers[0]);
    alive(&mut ctl, s, "the finalizer and a NotReady status", |s| {
        s.get::<ComputeDomain>("default", "job").is_some_and(|cd| {
            cd.metadata.finalizers == Some(vec!["resource.nvidia.com/computeDomain".into()])
                && cd.status.as_ref().is_some_and(|st| st.status == "NotReady")
        })
    })
    .await;
    let c = ready_condition(&env.domain("default", "job").unwrap()).unwrap();
    assert_eq!(c["reason"], "WaitingForNodes");
    assert!(
        c["message"].as_str().unwrap().starts_with("0 of 2 nodes"),
        "{c}"
    );

    // The daemons register in their clique: Ready.
    s.put(&clique(&uid, "c.1", &[("n1", "Ready"), ("n2", "Ready")]));
    alive(&mut ctl, s, "the domain Ready", |s| {
        s.get::<ComputeDomain>("default", "job")
            .and_then(|cd| cd.status)
            .is_some_and(|st| st.status == "Ready" && st.nodes.len() == 2)
    })
    .await;

    // One daemon loses its IMEX domain and says why, as nvdra's daemon does: an event on its
    // clique object; its pod says which peers it sees.
    let line = "nvidia-imex-ctl -q: UNAVAILABLE; last error: [ERROR] connection to n1 refused";
    s.put::<Pod>(
        &serde_json::from_value(json!({
            "metadata": {"name": format!("computedomain-daemon-{uid}-x2"), "namespace": NS,
                         "labels": {"resource.nvidia.com/computeDomain": uid},
                         "annotations": {"compute-domain.nvidia.com/imex-peers": ""}},
            "spec": {"nodeName": "n2", "containers": [{"name": "compute-domain-daemon"}]},
        }))
        .unwrap(),
    );
    s.put::<CoreEvent>(
        &serde_json::from_value(json!({
            "metadata": {"name": format!("{uid}.c.1.1"), "namespace": NS},
            "involvedObject": {"apiVersion": "resource.nvidia.com/v1beta1",
                               "kind": "ComputeDomainClique", "name": format!("{uid}.c.1"),
                               "namespace": NS},
            "reason": "NotReady", "type": "Warning", "message": format!("node n2: {line}"),
            "source": {"component": "nvdra-compute-domain-daemon", "host": "n2"},
            "lastTimestamp": "2026-01-01T00:00:00Z",
        }))
        .unwrap(),
    );
    s.put(&clique(&uid, "c.1", &[("n1", "Ready"), ("n2", "NotReady")]));
    alive(
        &mut ctl,
        s,
        "the domain NotReady with the daemon's line",
        |s| {
            s.get::<ComputeDomain>("default", "job").is_some_and(|cd| {
                ready_condition(&cd).is_some_and(|c| c["message"] == format!("n2: {line}"))
            })
        },
    )
    .await;
    let cd = env.domain("default", "job").unwrap();
    assert_eq!(cd.status.as_ref().unwrap().status, "NotReady");
    let conditions = cd.status.unwrap().other["conditions"].clone();
    let peers = conditions
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == "PeersConnected")
        .unwrap()
        .clone();
    assert!(
        peers["message"]
            .as_str()
            .unwrap()
            .starts_with("n2 does not see n1"),
        "{peers}"
    );
    alive(&mut ctl, s, "the events", |s| {
        let ev = events(s, "job");
        ev.iter().any(|(r, _)| r == "Created")
            && ev.iter().any(|(r, _)| r == "WaitingForNodes")
            && ev.iter().any(|(r, _)| r == "AllNodesReady")
            && ev
                .iter()
                .any(|(r, n)| r == "DaemonNotReady" && n.contains(line))
    })
    .await;

    // Deleting the domain removes what was made for it, then the domain.
    Api::<ComputeDomain>::namespaced(env.client(), "default")
        .delete("job", &DeleteParams::default())
        .await
        .unwrap();
    alive(&mut ctl, s, "the domain and its objects gone", |s| {
        s.get::<ComputeDomain>("default", "job").is_none()
            && s.get::<ResourceClaimTemplate>("default", "job-channel")
                .is_none()
            && s.get::<ResourceClaimTemplate>(NS, &format!("computedomain-daemon-{uid}"))
                .is_none()
            && s.get::<DaemonSet>(NS, &format!("computedomain-daemon-{uid}"))
                .is_none()
            && s.get::<ComputeDomainClique>(NS, &format!("{uid}.c.1"))
                .is_none()
    })
    .await;
}

/// Objects of a domain that is gone (deleted while no controller ran, its finalizer forced off)
/// are found by label and UID and removed; a live domain's stay.
#[tokio::test]
async fn a_gone_domains_objects_are_swept_without_the_domain() {
    let env = env().await;
    let s = &env.server;
    let gone = "0000-gone";
    let finalizer = json!(["resource.nvidia.com/computeDomain"]);
    let labels = json!({"resource.nvidia.com/computeDomain": gone,
                        "resource.nvidia.com/computeDomainTarget": "Workload"});
    s.put::<ResourceClaimTemplate>(
        &serde_json::from_value(json!({
            "metadata": {"name": "old-channel", "namespace": "team", "labels": labels,
                         "finalizers": finalizer},
            "spec": {"spec": {}},
        }))
        .unwrap(),
    );
    s.put::<DaemonSet>(
        &serde_json::from_value(json!({
            "metadata": {"name": format!("computedomain-daemon-{gone}"), "namespace": NS,
                         "labels": {"resource.nvidia.com/computeDomain": gone},
                         "finalizers": finalizer},
            "spec": {"selector": {}, "template": {}},
        }))
        .unwrap(),
    );
    s.put(&clique(gone, "c.1", &[("n1", "Ready")]));
    s.put::<Node>(
        &serde_json::from_value(json!({"metadata": {"name": "n1",
            "labels": {"resource.nvidia.com/computeDomain": gone, "keep": "me"}}}))
        .unwrap(),
    );

    let mut ctl = env.controller("ctl-a", &[]);
    let live = env.create_domain("live", 0, &[]).await;
    alive(&mut ctl, s, "the gone domain's objects removed", |s| {
        s.get::<ResourceClaimTemplate>("team", "old-channel")
            .is_none()
            && s.get::<DaemonSet>(NS, &format!("computedomain-daemon-{gone}"))
                .is_none()
            && s.get::<ComputeDomainClique>(NS, &format!("{gone}.c.1"))
                .is_none()
            && s.get::<Node>("", "n1").is_some_and(|n| {
                let l = n.metadata.labels.unwrap_or_default();
                !l.contains_key("resource.nvidia.com/computeDomain") && l.contains_key("keep")
            })
    })
    .await;
    alive(&mut ctl, s, "the live domain's objects", |s| {
        s.get::<DaemonSet>(NS, &format!("computedomain-daemon-{live}"))
            .is_some()
            && s.get::<ComputeDomain>("default", "live")
                .and_then(|cd| cd.status)
                .is_some_and(|st| st.status == "Ready")
    })
    .await;
}

/// Two controllers, one leader: only the leader acts; SIGKILLed, the other takes the lease
/// once it expires and acts.
#[tokio::test]
async fn two_controllers_one_leader_and_the_other_takes_over() {
    let env = env().await;
    let s = &env.server;
    let holder = |s: &TestApiServer| -> String {
        s.get::<Lease>(NS, "nvdra-compute-domain-controller")
            .and_then(|l| l.spec)
            .and_then(|sp| sp.holder_identity)
            .unwrap_or_default()
    };
    let mut a = env.controller_short_lease("ctl-a");
    s.wait_until(WAIT, "ctl-a leads", |s| holder(s).starts_with("ctl-a_"))
        .await;
    let _b = env.controller_short_lease("ctl-b");
    let first = env.create_domain("one", 0, &[]).await;
    s.wait_until(WAIT, "the leader reconciles", |s| {
        s.get::<DaemonSet>(NS, &format!("computedomain-daemon-{first}"))
            .is_some()
    })
    .await;
    // ctl-b is a candidate, not a leader: every event says ctl-a.
    let reporters: Vec<String> = s
        .objects("events.k8s.io/v1", "events")
        .iter()
        .map(|e| {
            e["reportingInstance"]
                .as_str()
                .unwrap_or_default()
                .to_string()
        })
        .collect();
    assert!(
        !reporters.is_empty() && reporters.iter().all(|r| r.starts_with("ctl-a_")),
        "{reporters:?}"
    );
    assert!(holder(s).starts_with("ctl-a_"));

    a.start_kill().unwrap();
    a.wait().await.unwrap();
    s.wait_until(WAIT, "ctl-b takes the lease over", |s| {
        holder(s).starts_with("ctl-b_")
    })
    .await;
    let lease = s
        .get::<Lease>(NS, "nvdra-compute-domain-controller")
        .unwrap();
    assert_eq!(lease.spec.unwrap().lease_transitions, Some(1));
    let second = env.create_domain("two", 0, &[]).await;
    s.wait_until(WAIT, "the new leader reconciles", |s| {
        s.get::<DaemonSet>(NS, &format!("computedomain-daemon-{second}"))
            .is_some()
    })
    .await;
}

/// Nodes a1 and a2 in clique `<cluster>.1`, b1 in `<cluster>.2` (by the label nvdra's plugin
/// sets); returns the two cliques.
fn two_cliques(s: &TestApiServer, cluster: &str) -> (String, String) {
    let (a, b) = (format!("{cluster}.1"), format!("{cluster}.2"));
    for (node, clique) in [("a1", &a), ("a2", &a), ("b1", &b)] {
        s.put::<Node>(
            &serde_json::from_value(json!({"metadata": {"name": node,
                "labels": {"nvidia.com/gpu.clique": clique}}}))
            .unwrap(),
        );
    }
    (a, b)
}

/// With `--clique-channels`, each clique of labelled nodes gets a pool of channels; a domain
/// with the clique annotation gets one shared ResourceClaim of the clique channel class and no
/// DaemonSet. Two such claims, matched against the published pools by `nvdra match` as the
/// scheduler allocates them one after the other, get different channels, each of one pool
/// (whose node selector then holds every pod sharing the claim to that clique).
#[cfg(feature = "tools")]
#[tokio::test]
async fn clique_pools_and_one_shared_claim_per_domain() {
    let env = env().await;
    let s = &env.server;
    let (a, _) = two_cliques(s, "9c0ffee0-0000-4000-8000-000000000001");
    let a = a.as_str();
    let mut ctl = env.controller("ctl-a", &["--clique-channels", "4"]);
    let pool_slices = |s: &TestApiServer| -> Vec<ResourceSlice> {
        s.slices()
            .into_iter()
            .filter(|sl| sl.spec.pool.name.starts_with("clique-"))
            .collect()
    };
    alive(&mut ctl, s, "two clique pools", |s| {
        pool_slices(s).len() == 2
    })
    .await;
    let slices = pool_slices(s);
    for sl in &slices {
        assert_eq!(sl.spec.devices.as_ref().unwrap().len(), 4);
        assert_eq!(sl.spec.driver, "compute-domain.nvidia.com");
    }

    let one = env
        .create_domain(
            "one",
            4,
            &[("compute-domain.nvidia.com/channels", "clique")],
        )
        .await;
    let two = env
        .create_domain(
            "two",
            4,
            &[("compute-domain.nvidia.com/channels", "clique")],
        )
        .await;
    alive(&mut ctl, s, "a shared claim per domain", |s| {
        s.get::<ResourceClaim>("default", "one-channel").is_some()
            && s.get::<ResourceClaim>("default", "two-channel").is_some()
            && s.get::<ComputeDomain>("default", "two")
                .and_then(|cd| cd.status)
                .is_some_and(|st| st.status == "Ready")
    })
    .await;
    assert!(
        s.get::<DaemonSet>(NS, &format!("computedomain-daemon-{one}"))
            .is_none()
    );
    assert!(
        s.get::<ResourceClaimTemplate>("default", "one-channel")
            .is_none()
    );
    let _ = two;

    // A rack gone: its pool goes.
    Api::<Node>::all(env.client())
        .delete("b1", &DeleteParams::default())
        .await
        .unwrap();
    alive(&mut ctl, s, "one clique pool left", |s| {
        pool_slices(s).len() == 1
    })
    .await;

    // The scheduler's view: the two claims, the clique channel class, the published pool.
    let dir = tempfile::tempdir().unwrap();
    let class = json!({"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
        "metadata": {"name": nvdra::computedomain::api::CLIQUE_CHANNEL_CLASS},
        "spec": {"selectors": [{"cel": {"expression":
            nvdra::computedomain::api::CLIQUE_CHANNEL_CLASS_CEL}}]}});
    let mut docs = vec![class];
    for name in ["one-channel", "two-channel"] {
        let mut claim =
            serde_json::to_value(s.get::<ResourceClaim>("default", name).unwrap()).unwrap();
        claim["apiVersion"] = json!("resource.k8s.io/v1");
        claim["kind"] = json!("ResourceClaim");
        docs.push(claim);
    }
    let claims = dir.path().join("claims.yaml");
    std::fs::write(&claims, documents(&docs)).unwrap();
    let slices_file = dir.path().join("slices.yaml");
    let items: Vec<Value> = pool_slices(s)
        .iter()
        .map(|sl| {
            let mut v = serde_json::to_value(sl).unwrap();
            v["apiVersion"] = json!("resource.k8s.io/v1");
            v["kind"] = json!("ResourceSlice");
            v
        })
        .collect();
    std::fs::write(&slices_file, documents(&items)).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_nvdra"))
        .args(["match", "-f"])
        .arg(&claims)
        .arg("--slices")
        .arg(&slices_file)
        .args(["-o", "json"])
        .env("NODE_NAME", "a1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: Value = serde_json::from_str(&stdout).unwrap();
    let allocated = allocations(&report);
    assert_eq!(allocated.len(), 2, "{report:#}");
    assert_ne!(
        allocated[0], allocated[1],
        "two domains, one channel: {report:#}"
    );
    for (pool, _) in &allocated {
        assert_eq!(pool, &format!("clique-{a}"));
    }
}

/// The controller runs a DaemonSet of per-clique IMEX daemons per clique (with
/// `--clique-channels`), and a clique-channel domain whose claim is allocated follows the
/// per-clique daemons of its channel's clique (`fabric.<clique>`): NotReady with the node and
/// its daemon's line, Ready once enough of them are.
#[tokio::test]
async fn a_clique_domain_follows_the_per_clique_daemons_of_its_channels_clique() {
    let env = env().await;
    let s = &env.server;
    let (a, b) = two_cliques(s, "9c0ffee0-0000-4000-8000-000000000002");
    let (a, b) = (a.as_str(), b.as_str());
    let mut ctl = env.controller("ctl-a", &["--clique-channels", "4"]);
    let daemons = |clique: &str| format!("computedomain-daemon-fabric.{clique}");
    alive(&mut ctl, s, "a per-clique DaemonSet per clique", |s| {
        s.get::<DaemonSet>(NS, &daemons(a)).is_some()
            && s.get::<DaemonSet>(NS, &daemons(b)).is_some()
    })
    .await;
    let ds = s.get::<DaemonSet>(NS, &daemons(a)).unwrap();
    assert!(
        !ds.metadata
            .labels
            .unwrap()
            .contains_key("resource.nvidia.com/computeDomain"),
        "no domain's: the domains' cleanup leaves it alone"
    );
    let pod = ds.spec.unwrap().template.spec.unwrap();
    assert_eq!(pod.node_selector.unwrap()["nvidia.com/gpu.clique"], a);
    let c = &pod.containers[0];
    assert_eq!(c.image.as_deref(), Some("registry.example/nvdra:test"));
    let env_of = |name: &str| {
        c.env
            .iter()
            .flatten()
            .find(|e| e.name == name)
            .and_then(|e| e.value.clone())
    };
    assert_eq!(env_of("CLIQUE_ID").as_deref(), Some(a));
    assert_the_daemon_reads_its_env(c);
    assert_eq!(
        c.command.as_deref().unwrap().last().map(String::as_str),
        Some("--per-clique")
    );

    env.create_domain(
        "job",
        2,
        &[("compute-domain.nvidia.com/channels", "clique")],
    )
    .await;
    let reason = |s: &TestApiServer| {
        s.get::<ComputeDomain>("default", "job")
            .and_then(|cd| ready_condition(&cd))
            .map(|c| {
                (
                    c["reason"].as_str().unwrap_or_default().to_string(),
                    c["message"].as_str().unwrap_or_default().to_string(),
                )
            })
            .unwrap_or_default()
    };
    alive(&mut ctl, s, "the claim, not allocated yet", |s| {
        reason(s).0 == "ChannelNotAllocated"
    })
    .await;

    // The scheduler allocates the claim to channel 3 of clique a's pool; no daemon of the
    // clique has registered yet.
    let mut claim = s.get::<ResourceClaim>("default", "job-channel").unwrap();
    claim.status = Some(
        serde_json::from_value(json!({"allocation": {"devices": {"results": [{
            "request": "channel", "driver": "compute-domain.nvidia.com",
            "pool": format!("clique-{a}"), "device": "channel-3"}]}}}))
        .unwrap(),
    );
    s.put(&claim);
    alive(&mut ctl, s, "waiting for the clique's daemons", |s| {
        let (r, m) = reason(s);
        r == "WaitingForNodes"
            && m.starts_with(&format!("channel-3 of pool clique-{a}: 0 of the 2"))
    })
    .await;

    // The per-clique daemons register in fabric.<a>; a2's is not ready and says why.
    let fabric = |daemons: &[(&str, &str)]| {
        let mut c = clique("fabric", a, daemons);
        c.metadata.labels = None;
        c
    };
    let line = "nvidia-imex-ctl -q: UNAVAILABLE; last error: [ERROR] bind failed";
    s.put::<CoreEvent>(
        &serde_json::from_value(json!({
            "metadata": {"name": format!("fabric.{a}.1"), "namespace": NS},
            "involvedObject": {"apiVersion": "resource.nvidia.com/v1beta1",
                               "kind": "ComputeDomainClique", "name": format!("fabric.{a}"),
                               "namespace": NS},
            "reason": "NotReady", "type": "Warning", "message": format!("node a2: {line}"),
            "source": {"component": "nvdra-compute-domain-daemon", "host": "a2"},
            "lastTimestamp": "2026-01-01T00:00:00Z",
        }))
        .unwrap(),
    );
    s.put(&fabric(&[("a1", "Ready"), ("a2", "NotReady")]));
    alive(&mut ctl, s, "NotReady with a2's line", |s| {
        let (r, m) = reason(s);
        r == "DaemonNotReady" && m.ends_with(&format!("a2: {line}"))
    })
    .await;
    let st = env.domain("default", "job").unwrap().status.unwrap();
    assert_eq!(st.status, "NotReady");
    assert_eq!(
        st.nodes.iter().map(|n| n.name.as_str()).collect::<Vec<_>>(),
        ["a1", "a2"]
    );

    // A rack gone: its per-clique DaemonSet goes. (Also the pause that lets the reconcile
    // its own status write caused finish, so that only the clique object's change below can
    // make the domain Ready.)
    Api::<Node>::all(env.client())
        .delete("b1", &DeleteParams::default())
        .await
        .unwrap();
    alive(&mut ctl, s, "clique b's DaemonSet gone", |s| {
        s.get::<DaemonSet>(NS, &daemons(b)).is_none()
            && s.get::<DaemonSet>(NS, &daemons(a)).is_some()
    })
    .await;
    assert_eq!(reason(s).0, "DaemonNotReady");

    // Both ready: the domain is, on the clique object's change alone.
    s.put(&fabric(&[("a1", "Ready"), ("a2", "Ready")]));
    alive(&mut ctl, s, "Ready", |s| {
        reason(s).0 == "CliqueReady"
            && s.get::<ComputeDomain>("default", "job")
                .and_then(|cd| cd.status)
                .is_some_and(|st| st.status == "Ready")
    })
    .await;
}

/// Every variable a daemon container gets is one `nvdra compute-domain daemon` reads (its
/// `--help` lists `[env: NAME=]`), but for NVIDIA's container toolkit's and `POD_UID` (NVIDIA's
/// daemon's, kept in the pod template); POD_NAME and POD_NAMESPACE among them, for the daemon's
/// patch of its own pod.
fn assert_the_daemon_reads_its_env(c: &k8s_openapi::api::core::v1::Container) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_nvdra"))
        .args(["compute-domain", "daemon", "--help"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    let names: Vec<&str> = c.env.iter().flatten().map(|e| e.name.as_str()).collect();
    for name in &names {
        if name.starts_with("NVIDIA_VISIBLE") || *name == "POD_UID" {
            continue;
        }
        assert!(
            help.contains(&format!("[env: {name}=")),
            "the daemon gets {name}, which `nvdra compute-domain daemon` does not read"
        );
    }
    for name in ["POD_NAME", "POD_NAMESPACE", "NODE_NAME", "POD_IP"] {
        assert!(names.contains(&name), "{name} missing: {names:?}");
    }
}

/// Multi-document YAML (each document JSON, which is YAML).
fn documents(docs: &[Value]) -> String {
    docs.iter()
        .map(|d| serde_json::to_string(d).unwrap())
        .collect::<Vec<_>>()
        .join("\n---\n")
}

/// (pool, device) of every allocated device in `nvdra match -o json`'s report.
fn allocations(report: &Value) -> Vec<(String, String)> {
    let mut out = Vec::new();
    fn walk(v: &Value, out: &mut Vec<(String, String)>) {
        match v {
            Value::Object(m) => {
                if let (Some(Value::String(p)), Some(Value::String(d))) =
                    (m.get("pool"), m.get("device"))
                {
                    out.push((p.clone(), d.clone()));
                }
                m.values().for_each(|x| walk(x, out));
            }
            Value::Array(a) => a.iter().for_each(|x| walk(x, out)),
            _ => {}
        }
    }
    walk(report, &mut out);
    out
}
