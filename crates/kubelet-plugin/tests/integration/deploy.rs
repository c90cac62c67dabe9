//! The deployable example (`examples/daemonset.rs`) and its manifests (`examples/deploy/`):
//!
//! - the manifests parse with PyYAML (a parser we did not write) into the k8s-openapi types with
//!   no unknown field, and keep the contracts the crate README's "Deploy" states (downward API,
//!   same-path kubelet mounts, surge updates, a readiness probe on the example's port, the
//!   DeviceClass naming the driver);
//! - the example runs as a process against `testing::ApiServer`: it publishes, turns ready,
//!   prepares a claim the test plays the kubelet for, and on SIGTERM stops with its sockets gone;
//!   every request it made is allowed by the ClusterRole, and every verb granted was used.
//!
//! Needs python3 with PyYAML; skips without it unless `KUBELET_PLUGIN_REQUIRE_PYYAML=1`.
#![cfg(feature = "kube")]

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{Namespace, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceSlice};
use kubelet_plugin::Claim;
use kubelet_plugin::testing::{ApiServer, KubeletClient, allocated_claim, allocated_device};
use serde_json::Value;

use crate::{example, require};

const DEPLOY: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/deploy");
const DRIVER: &str = "devices.example.com";
const NODE: &str = "node-1";
const POD_UID: &str = "5b1c0d2e-0000-4000-8000-00000000a001";

/// Every object of every manifest, parsed by PyYAML; `None` (skipped) without it.
fn manifests() -> Option<Vec<Value>> {
    let ok = Command::new("python3")
        .args(["-c", "import yaml"])
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        ok || !require::required("KUBELET_PLUGIN_REQUIRE_PYYAML"),
        "KUBELET_PLUGIN_REQUIRE_PYYAML=1 but python3 cannot import yaml; run: python3 -m pip install pyyaml"
    );
    if !ok {
        eprintln!("skipped: parsing the manifests needs python3 with PyYAML");
        return None;
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(DEPLOY)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    let mut objects = Vec::new();
    for file in files {
        assert_eq!(
            file.extension().and_then(|e| e.to_str()),
            Some("yaml"),
            "{}",
            file.display()
        );
        let out = Command::new("python3")
            .args([
                "-c",
                "import json, sys, yaml; print(json.dumps([d for d in yaml.safe_load_all(open(sys.argv[1])) if d is not None]))",
            ])
            .arg(&file)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}: {}",
            file.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        let docs: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap();
        objects.extend(docs);
    }
    Some(objects)
}

/// `value` read as `T` and written again is `value` itself: no field the type does not know.
fn typed<T: serde::de::DeserializeOwned + serde::Serialize>(value: &Value) -> T {
    let t: T = serde_json::from_value(value.clone())
        .unwrap_or_else(|e| panic!("{e}: {}", value["metadata"]["name"]));
    assert_eq!(
        &serde_json::to_value(&t).unwrap(),
        value,
        "a field the type does not know"
    );
    t
}

fn the<'a>(objects: &'a [Value], kind: &str) -> &'a Value {
    let found: Vec<&Value> = objects.iter().filter(|o| o["kind"] == kind).collect();
    assert_eq!(found.len(), 1, "one {kind}");
    found[0]
}

#[test]
fn the_manifests_keep_the_deploy_contracts() {
    let Some(objects) = manifests() else { return };
    let kinds: BTreeSet<&str> = objects
        .iter()
        .map(|o| o["kind"].as_str().unwrap())
        .collect();
    assert_eq!(
        kinds,
        BTreeSet::from([
            "ClusterRole",
            "ClusterRoleBinding",
            "DaemonSet",
            "DeviceClass",
            "Namespace",
            "ServiceAccount"
        ])
    );
    let ns: Namespace = typed(the(&objects, "Namespace"));
    let sa: ServiceAccount = typed(the(&objects, "ServiceAccount"));
    let role: ClusterRole = typed(the(&objects, "ClusterRole"));
    let binding: ClusterRoleBinding = typed(the(&objects, "ClusterRoleBinding"));
    let ds: DaemonSet = typed(the(&objects, "DaemonSet"));
    let class: DeviceClass = typed(the(&objects, "DeviceClass"));

    assert_eq!(sa.metadata.namespace, ns.metadata.name);
    assert_eq!(ds.metadata.namespace, ns.metadata.name);
    assert_eq!(binding.role_ref.name, role.metadata.name.unwrap());
    let subject = &binding.subjects.as_ref().unwrap()[0];
    assert_eq!(
        (Some(&subject.name), subject.namespace.as_ref()),
        (sa.metadata.name.as_ref(), sa.metadata.namespace.as_ref())
    );

    let spec = ds.spec.unwrap();
    let update = spec.update_strategy.unwrap();
    assert_eq!(update.type_.as_deref(), Some("RollingUpdate"));
    let rolling = update.rolling_update.unwrap();
    use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
    assert_eq!(rolling.max_surge, Some(IntOrString::Int(1)));
    assert_eq!(rolling.max_unavailable, Some(IntOrString::Int(0)));
    let pod = spec.template.spec.unwrap();
    assert_eq!(pod.service_account_name, sa.metadata.name);
    let [c] = &pod.containers[..] else {
        panic!("one container")
    };
    let env = |name: &str| {
        c.env
            .iter()
            .flatten()
            .find(|e| e.name == name)
            .unwrap_or_else(|| panic!("env {name}"))
    };
    let field = |name: &str| {
        env(name)
            .value_from
            .as_ref()
            .and_then(|v| v.field_ref.as_ref())
            .map(|f| f.field_path.clone())
    };
    assert_eq!(field("NODE_NAME").as_deref(), Some("spec.nodeName"));
    assert_eq!(field("POD_UID").as_deref(), Some("metadata.uid"));
    let driver = env("DRIVER_NAME").value.clone().unwrap();
    assert_eq!(driver, DRIVER);
    // The DeviceClass selects the driver's devices.
    let cel = &class.spec.selectors.as_ref().unwrap()[0]
        .cel
        .as_ref()
        .unwrap()
        .expression;
    assert_eq!(cel, &format!("device.driver == \"{driver}\""));
    // The readiness probe asks the port the example answers on.
    let ready_port: i32 = env("READY_ADDR")
        .value
        .as_deref()
        .and_then(|a| a.rsplit_once(':'))
        .map(|(_, p)| p.parse().unwrap())
        .unwrap();
    let probe = c
        .readiness_probe
        .as_ref()
        .unwrap()
        .http_get
        .as_ref()
        .unwrap();
    let port = c
        .ports
        .iter()
        .flatten()
        .find(|p| probe.port == IntOrString::String(p.name.clone().unwrap_or_default()))
        .expect("the probe names a container port");
    assert_eq!(port.container_port, ready_port);
    // The kubelet's directories at the same path inside as on the host.
    for dir in [
        "/var/lib/kubelet/plugins_registry",
        "/var/lib/kubelet/plugins",
    ] {
        let mount = c
            .volume_mounts
            .iter()
            .flatten()
            .find(|m| m.mount_path == dir)
            .unwrap_or_else(|| panic!("no mount at {dir}"));
        let volume = pod
            .volumes
            .iter()
            .flatten()
            .find(|v| v.name == mount.name)
            .unwrap();
        assert_eq!(volume.host_path.as_ref().unwrap().path, dir);
    }
}

/// The readiness endpoint's status code; `None` when nothing answers.
async fn probe(addr: &str) -> Option<u16> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut conn = tokio::net::TcpStream::connect(addr).await.ok()?;
    conn.write_all(b"GET /readyz HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .ok()?;
    let mut answer = String::new();
    conn.read_to_string(&mut answer).await.ok()?;
    answer.split(' ').nth(1)?.parse().ok()
}

/// What RBAC sees of a request: (verb, API group, resource).
fn rbac_request(method: &str, path: &str, query: &str) -> Option<(String, String, String)> {
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (group, rest) = match parts[..] {
        ["api", "v1", ref rest @ ..] => ("", rest),
        ["apis", group, _version, ref rest @ ..] => (group, rest),
        // /version and discovery: non-resource URLs every authenticated client may read.
        _ => return None,
    };
    let rest = match rest {
        ["namespaces", _, rest @ ..] if !rest.is_empty() => rest,
        rest => rest,
    };
    let (resource, named) = match rest {
        [resource] => (resource.to_string(), false),
        [resource, _name] => (resource.to_string(), true),
        [resource, _name, sub] => (format!("{resource}/{sub}"), true),
        _ => panic!("unexpected path {path}"),
    };
    let watch = query
        .split('&')
        .any(|q| q == "watch=true" || q == "watch=1");
    let verb = match (method, named) {
        ("GET", _) if watch => "watch",
        ("GET", true) => "get",
        ("GET", false) => "list",
        ("POST", _) => "create",
        ("PUT", _) => "update",
        ("PATCH", _) => "patch",
        ("DELETE", true) => "delete",
        ("DELETE", false) => "deletecollection",
        _ => panic!("unexpected {method} {path}"),
    };
    Some((verb.into(), group.into(), resource))
}

#[tokio::test(flavor = "multi_thread")]
async fn the_example_publishes_serves_and_stops_on_sigterm_within_its_rbac() {
    let Some(objects) = manifests() else { return };
    let role: ClusterRole = typed(the(&objects, "ClusterRole"));
    let granted: BTreeSet<(String, String, String)> = role
        .rules
        .iter()
        .flatten()
        .flat_map(|r| {
            let groups = r.api_groups.clone().unwrap_or_default();
            let resources = r.resources.clone().unwrap_or_default();
            r.verbs.iter().flat_map(move |v| {
                let resources = resources.clone();
                groups.clone().into_iter().flat_map(move |g| {
                    let v = v.clone();
                    resources
                        .clone()
                        .into_iter()
                        .map(move |r| (v.clone(), g.clone(), r))
                })
            })
        })
        .collect();

    let api = ApiServer::start().await;
    api.seed_node(NODE, "node-uid-1");
    api.seed_claim(allocated_claim(
        "default",
        "claim-a",
        "uid-a",
        vec![allocated_device("gpu", DRIVER, NODE, "dev-1")],
    ));
    // A slice of an earlier version of the driver: obsolete, so the publisher deletes it.
    api.insert_slice(ResourceSlice {
        metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
            name: Some(format!("{NODE}-{DRIVER}-old")),
            ..Default::default()
        },
        spec: k8s_openapi::api::resource::v1::ResourceSliceSpec {
            driver: DRIVER.into(),
            node_name: Some(NODE.into()),
            pool: k8s_openapi::api::resource::v1::ResourcePool {
                name: "old-pool".into(),
                generation: 1,
                resource_slice_count: 1,
            },
            ..Default::default()
        },
    });
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(&kubeconfig, api.kubeconfig()).unwrap();
    let kubelet = dir.path().join("kubelet");
    std::fs::create_dir_all(kubelet.join("plugins_registry")).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let ready_addr = format!("127.0.0.1:{port}");
    let mut child = example::Killed(
        Command::new(example::path("daemonset"))
            .env("KUBECONFIG", &kubeconfig)
            .env_remove("KUBERNETES_SERVICE_HOST")
            .env("NODE_NAME", NODE)
            .env("POD_UID", POD_UID)
            .env("DRIVER_NAME", DRIVER)
            .env("KUBELET_ROOT", &kubelet)
            .env("READY_ADDR", &ready_addr)
            .stdin(Stdio::null())
            .spawn()
            .unwrap(),
    );

    // Ready once it serves and its slices are published (the obsolete one gone).
    let started = Instant::now();
    while probe(&ready_addr).await != Some(200) {
        assert!(child.0.try_wait().unwrap().is_none(), "the example exited");
        assert!(started.elapsed() < Duration::from_secs(30), "never ready");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let slices = api.slices();
    assert_eq!(slices.len(), 1, "{slices:?}");
    let devices: Vec<&str> = slices[0]
        .spec
        .devices
        .iter()
        .flatten()
        .map(|d| d.name.as_str())
        .collect();
    assert_eq!(devices, ["dev-0", "dev-1"]);
    // Someone edits the slice: the publisher puts it back (an update).
    let name = slices[0].metadata.name.clone().unwrap();
    api.edit_slice(&name, |s| {
        s.spec.devices.as_mut().unwrap().pop();
    });
    let put_back = Instant::now();
    while api.slices()[0].spec.devices.as_ref().map(Vec::len) != Some(2) {
        assert!(put_back.elapsed() < Duration::from_secs(30), "not put back");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // The kubelet prepares a claim on the socket named with the pod UID.
    let opts = kubelet_plugin::Options::new(
        DRIVER,
        NODE,
        kubelet_plugin::testing::MemoryClaims::default(),
    )
    .unwrap()
    .kubelet_root(&kubelet)
    .pod_uid(POD_UID);
    let sockets = opts.sockets();
    assert!(sockets.registration.exists());
    let mut client = KubeletClient::connect(&sockets.dra).await.unwrap();
    let answers = client
        .prepare(&[Claim::new("default", "claim-a", "uid-a")])
        .await
        .unwrap();
    assert_eq!(
        answers["uid-a"],
        Ok(vec![format!("k8s.{DRIVER}/device=dev-1")])
    );
    drop(client);

    // SIGTERM: a clean exit, sockets gone, nothing answers the probe.
    let pid = child.0.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    let status = child.0.wait().unwrap();
    assert!(status.success(), "{status}");
    assert!(!sockets.dra.exists() && !sockets.registration.exists());
    assert_eq!(probe(&ready_addr).await, None);

    // Every request within the ClusterRole, and every grant used.
    let mut used = BTreeSet::new();
    for r in api.requests() {
        let Some(request) = rbac_request(&r.method, &r.path, &r.query) else {
            continue;
        };
        assert!(
            granted.contains(&request),
            "{request:?} ({} {}?{}) is not granted by examples/deploy/rbac.yaml",
            r.method,
            r.path,
            r.query
        );
        used.insert(request);
    }
    assert_eq!(
        used,
        granted,
        "granted but never used: {:?}",
        granted.difference(&used).collect::<Vec<_>>()
    );
}
