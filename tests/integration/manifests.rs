//! The manifests users apply, kept honest.
//!
//! - Every file under `manifests/` and every kustomize overlay's output parses into the
//!   k8s-openapi types with no unknown field: each object is deserialized typed, serialized
//!   again and compared with the input, so a field the types do not know (a typo, a field of
//!   another API version) shows up as a difference at its path.
//! - Every file is accounted for: a kustomization, a resource or patch one names, or an example.
//! - The overlays do what they say (extended resources only in their overlay, nothing of DRA in
//!   device-plugin-only, the Node patch only with the node-labels component), and the
//!   DaemonSet keeps its contracts (same-path kubelet mounts, downward API, surge updates,
//!   probes on the metrics port, no privileged container, no host PID/IPC/network namespace,
//!   sizes from the RSS benchmark), and so does the MPS host's (OnDelete, node-critical, the
//!   host PID namespace as NVIDIA runs MPS but no host IPC, no privileged container, only the
//!   capabilities MPS needs, the MPS root shared with the plugin).
//! - The ClusterRole allows every request nvdra's API client makes (recorded on the test API
//!   server, one call of every `ClusterApi` method), and grants nothing that no call uses.
//! - Each example states which built-in profiles it fits in one `# nvdra-match:` line.
//!
//! The overlays are built with `kubectl kustomize`; without kubectl those tests skip, unless
//! `NVDRA_REQUIRE_KUBECTL=1` (which `.ci/run` sets) makes them fail.

use crate::support;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use futures::StreamExt;
use futures::future::BoxFuture;
use futures::stream::BoxStream;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use nvdra::api::kube::KubeApi;
use nvdra::api::{self, ClaimReader, ClaimSource, ClusterApi, SliceApi, SliceEvent};
use serde_json::Value;
use support::apiserver::{RecordedRequest, TestApiServer};
use support::manifests::*;

#[test]
fn the_round_trip_finds_unknown_and_misplaced_fields() {
    // The check itself: a typo, a field at the wrong level and a wrong type are all caught.
    let class: Value = serde_json::json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
        "metadata": {"name": "c"},
        "spec": {"selector": [{"cel": {"expression": "true"}}]},
    });
    let diffs = check_typed(&class).unwrap();
    assert_eq!(
        diffs,
        [".spec.selector: unknown field (dropped by the typed read)"]
    );
    let ds: Value = serde_json::json!({
        "apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": "d"},
        "spec": {"selector": {}, "maxSurge": 1, "template": {"spec": {"containers": []}}},
    });
    assert_eq!(
        check_typed(&ds).unwrap(),
        [".spec.maxSurge: unknown field (dropped by the typed read)"]
    );
    let bad: Value = serde_json::json!({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
        "spec": {"containers": [{"name": "c", "ports": [{"containerPort": "x"}]}]},
    });
    assert!(check_typed(&bad).is_err());
    let unknown: Value = serde_json::json!({"apiVersion": "v9", "kind": "Gadget"});
    assert!(check_typed(&unknown).unwrap_err().contains("Gadget"));
    // A quantity written as a number is the same value.
    let pod: Value = serde_json::json!({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
        "spec": {"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": 1}}}]},
    });
    assert_eq!(check_typed(&pod).unwrap(), Vec::<String>::new());
}

// ---------------------------------------------------------------------------------------------
// The files.

/// What the kustomizations under `manifests/` name: (resource files, patch files, all of them).
struct Layout {
    resources: BTreeSet<PathBuf>,
    patches: BTreeSet<PathBuf>,
    kustomizations: BTreeSet<PathBuf>,
}

fn yaml_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            yaml_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "yaml" || e == "yml") {
            out.push(path);
        }
    }
}

fn layout() -> Layout {
    let mut files = Vec::new();
    yaml_files(&manifests(), &mut files);
    let mut layout = Layout {
        resources: BTreeSet::new(),
        patches: BTreeSet::new(),
        kustomizations: BTreeSet::new(),
    };
    for k in files.iter().filter(|f| f.ends_with("kustomization.yaml")) {
        layout.kustomizations.insert(k.clone());
        let dir = k.parent().expect("a kustomization is in a directory");
        let doc = &documents(&read(k), &k.display().to_string())[0];
        for r in doc["resources"].as_array().into_iter().flatten() {
            let path = dir.join(r.as_str().expect("a resource is a path"));
            if path.is_file() {
                layout.resources.insert(path);
            } else {
                assert!(
                    path.is_dir(),
                    "{}: resource {r} does not exist",
                    k.display()
                );
            }
        }
        for p in doc["patches"].as_array().into_iter().flatten() {
            if let Some(path) = p["path"].as_str() {
                let path = dir.join(path);
                assert!(
                    path.is_file(),
                    "{}: patch {} does not exist",
                    k.display(),
                    path.display()
                );
                layout.patches.insert(path);
            }
        }
    }
    layout
}

#[test]
fn every_manifest_parses_typed_with_no_unknown_field() {
    let layout = layout();
    let examples = manifests().join("examples");
    let mut files = Vec::new();
    yaml_files(&manifests(), &mut files);
    let mut checked = 0;
    for file in &files {
        let origin = file.display().to_string();
        if layout.kustomizations.contains(file) {
            continue;
        }
        let docs = documents(&read(file), &origin);
        if layout.patches.contains(file) {
            // Partial objects: what they touch is checked in the overlays' output.
            for d in &docs {
                assert!(
                    !str_at(d, "/kind").is_empty(),
                    "{origin}: a patch without a kind"
                );
            }
            continue;
        }
        assert!(
            layout.resources.contains(file) || file.starts_with(&examples),
            "{origin} is neither named by a kustomization nor an example: add it or remove it"
        );
        assert!(!docs.is_empty(), "{origin}: no object");
        assert_typed(&docs, &origin);
        checked += docs.len();
    }
    // The base alone has 13 objects; the examples add more.
    assert!(checked > 20, "only {checked} objects checked");
}

// ---------------------------------------------------------------------------------------------
// Kustomize.

#[test]
fn the_plain_overlay_is_dra_without_options() {
    let Some(kubectl) = kubectl() else { return };
    let docs = overlay(kubectl, "plain");
    assert_daemonset_contracts(&docs, "plain");
    assert_mps_host_contracts(&docs, "plain");
    let expected: BTreeMap<String, usize> = [
        ("ClusterRole", 1),
        ("ClusterRoleBinding", 1),
        ("DaemonSet", 2),
        ("DeviceClass", 4),
        ("Namespace", 1),
        ("ServiceAccount", 1),
        // Slices, and claims' status.
        ("ValidatingAdmissionPolicy", 2),
        ("ValidatingAdmissionPolicyBinding", 2),
    ]
    .into_iter()
    .map(|(k, n)| (k.to_string(), n))
    .collect();
    assert_eq!(kinds(&docs), expected);
    for class in docs.iter().filter(|d| str_at(d, "/kind") == "DeviceClass") {
        assert!(
            class["spec"].get("extendedResourceName").is_none(),
            "{}",
            id(class)
        );
    }
    assert!(
        !grants(&docs)
            .iter()
            .any(|(_, r, v)| r == "nodes" && v == "patch")
    );
    // Neither SYS_ADMIN nor the host's cgroup root without MIG and shares.
    assert!(!mig_and_shares(&docs, "plain"));
    // The release's version (the digest is the user's overlay's: see below).
    let (repository, tag, digest) = assert_image(&docs, "plain");
    assert_eq!(
        (repository.as_str(), tag.as_str(), digest),
        ("ghcr.io/nvdra/nvdra", env!("CARGO_PKG_VERSION"), None)
    );
    // The namespace at the one Pod Security level that admits what runs in it.
    let ns = find(&docs, "Namespace", "nvdra").expect("the Namespace");
    assert_eq!(
        ns["metadata"]["labels"],
        serde_json::json!({"pod-security.kubernetes.io/enforce": "privileged"})
    );
    // Where the overlay comes from: what the tests below compare the other overlays with.
    assert_eq!(docs, kustomize(kubectl, &manifests().join("base")));
}

#[test]
fn the_extended_resources_overlay_adds_only_the_extended_resource_name() {
    let Some(kubectl) = kubectl() else { return };
    let plain = overlay(kubectl, "plain");
    let mut docs = overlay(kubectl, "extended-resources");
    assert_daemonset_contracts(&docs, "extended-resources");
    assert_mps_host_contracts(&docs, "extended-resources");
    let class = docs
        .iter_mut()
        .find(|d| id(d) == "DeviceClass/gpu.nvidia.com")
        .expect("the gpu.nvidia.com class");
    let spec = class["spec"].as_object_mut().expect("a spec");
    assert_eq!(
        spec.remove("extendedResourceName"),
        Some("nvidia.com/gpu".into())
    );
    assert_eq!(docs, plain, "anything else differs from the plain overlay");
}

#[test]
fn the_device_plugin_only_overlay_has_nothing_of_dra() {
    let Some(kubectl) = kubectl() else { return };
    let docs = overlay(kubectl, "device-plugin-only");
    assert_daemonset_contracts(&docs, "device-plugin-only");
    let expected: BTreeMap<String, usize> =
        [("DaemonSet", 1), ("Namespace", 1), ("ServiceAccount", 1)]
            .into_iter()
            .map(|(k, n)| (k.to_string(), n))
            .collect();
    assert_eq!(
        kinds(&docs),
        expected,
        "no RBAC, admission policy or DeviceClass"
    );
    let c = container(&docs);
    let args: Vec<&str> = c["args"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(args, ["run", "--mode", "device-plugin"]);
    let mounts: Vec<&str> = c["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| str_at(m, "/mountPath"))
        .collect();
    assert!(
        mounts.contains(&"/var/lib/kubelet/device-plugins"),
        "{mounts:?}"
    );
    assert!(
        !mounts
            .iter()
            .any(|m| m.starts_with("/var/lib/kubelet/plugins")),
        "{mounts:?}"
    );
}

#[test]
fn the_node_patch_comes_only_with_the_node_labels_component() {
    let Some(kubectl) = kubectl() else { return };
    // An overlay of the user's: the plain one plus the component, in a copy of manifests/
    // (kustomize reads nothing outside the tree it builds).
    let tmp = tempfile::tempdir().unwrap();
    let copy = tmp.path().join("manifests");
    copy_tree(&manifests(), &copy);
    let mine = copy.join("overlays/mine");
    std::fs::create_dir_all(&mine).unwrap();
    std::fs::write(
        mine.join("kustomization.yaml"),
        "resources: [../plain]\ncomponents: [../../components/node-labels]\n",
    )
    .unwrap();
    let docs = kustomize(kubectl, &mine);
    assert_daemonset_contracts(&docs, "node-labels");
    let patch = ("".to_string(), "nodes".to_string(), "patch".to_string());
    assert!(grants(&docs).contains(&patch));
    let crb = find(&docs, "ClusterRoleBinding", "nvdra-node-labels").expect("its binding");
    assert_eq!(str_at(crb, "/roleRef/name"), "nvdra-node-labels");
    let env = container(&docs)["env"].as_array().unwrap();
    assert!(
        env.iter()
            .any(|e| e["name"] == "NVDRA_NODE_LABELS" && e["value"] == "true")
    );
    // With the policy that narrows the patch to this Node's own labels
    // (tests/integration/admission.rs evaluates it), bound, for the pod's service account.
    let vap = find(&docs, "ValidatingAdmissionPolicy", "nvdra-node-labels").expect("its policy");
    assert_eq!(
        str_at(vap, "/spec/matchConditions/0/expression"),
        "request.userInfo.username == \"system:serviceaccount:nvdra:nvdra\""
    );
    assert_eq!(str_at(vap, "/spec/failurePolicy"), "Fail");
    let binding = find(
        &docs,
        "ValidatingAdmissionPolicyBinding",
        "nvdra-node-labels",
    )
    .expect("the policy's binding");
    assert_eq!(str_at(binding, "/spec/policyName"), "nvdra-node-labels");
    assert_eq!(
        binding["spec"]["validationActions"],
        serde_json::json!(["Deny"])
    );
    // And nowhere else.
    for o in ["plain", "extended-resources", "device-plugin-only"] {
        let docs = overlay(kubectl, o);
        assert!(!grants(&docs).contains(&patch), "{o}");
        assert!(find(&docs, "ValidatingAdmissionPolicy", "nvdra-node-labels").is_none());
    }
}

/// An overlay of the user's over a copy of manifests/: `kustomization` in overlays/mine.
fn user_overlay(kubectl: &str, kustomization: &str) -> Vec<Value> {
    let tmp = tempfile::tempdir().unwrap();
    let copy = tmp.path().join("manifests");
    copy_tree(&manifests(), &copy);
    let mine = copy.join("overlays/mine");
    std::fs::create_dir_all(&mine).unwrap();
    std::fs::write(mine.join("kustomization.yaml"), kustomization).unwrap();
    kustomize(kubectl, &mine)
}

#[test]
fn sys_admin_and_the_cgroup_root_come_only_with_mig_and_shares() {
    let Some(kubectl) = kubectl() else { return };
    let with = |base: &str| {
        user_overlay(
            kubectl,
            &format!("resources: [../{base}]\ncomponents: [../../components/mig-and-shares]\n"),
        )
    };
    for base in ["plain", "device-plugin-only"] {
        let docs = with(base);
        assert_daemonset_contracts(&docs, base);
        assert!(mig_and_shares(&docs, base), "{base} with mig-and-shares");
        // Nothing else changes: the plain overlay's objects less what the component adds.
        let mut docs = docs;
        let c = &mut docs
            .iter_mut()
            .find(|d| id(d) == "DaemonSet/nvdra")
            .unwrap()["spec"]["template"]["spec"];
        c["volumes"]
            .as_array_mut()
            .unwrap()
            .retain(|v| v["name"] != "cgroup");
        let c = &mut c["containers"][0];
        c["volumeMounts"]
            .as_array_mut()
            .unwrap()
            .retain(|m| m["name"] != "cgroup");
        let sc = c["securityContext"].as_object_mut().unwrap();
        sc["capabilities"].as_object_mut().unwrap().remove("add");
        sc.insert("allowPrivilegeEscalation".into(), false.into());
        assert_eq!(
            docs,
            overlay(kubectl, base),
            "{base}: more than SYS_ADMIN and the cgroup root"
        );
    }
    for o in ["plain", "extended-resources", "device-plugin-only"] {
        assert!(!mig_and_shares(&overlay(kubectl, o), o), "{o}");
    }
}

#[test]
fn the_metrics_network_policy_admits_the_named_scrapers_on_the_metrics_port() {
    let Some(kubectl) = kubectl() else { return };
    let docs = user_overlay(
        kubectl,
        "resources: [../plain]\ncomponents: [../../components/metrics-network-policy]\n",
    );
    let np = find(&docs, "NetworkPolicy", "nvdra-metrics").expect("the NetworkPolicy");
    assert_eq!(str_at(np, "/metadata/namespace"), "nvdra");
    // It selects nvdra's pods (not the MPS host's, which listens on nothing).
    let ds = find(&docs, "DaemonSet", "nvdra").unwrap();
    assert_eq!(
        np["spec"]["podSelector"]["matchLabels"],
        ds["spec"]["template"]["metadata"]["labels"]
    );
    assert_eq!(np["spec"]["policyTypes"], serde_json::json!(["Ingress"]));
    let [rule] = np["spec"]["ingress"].as_array().unwrap().as_slice() else {
        panic!("one ingress rule");
    };
    // Only the metrics port, by the name the probes use too.
    assert_eq!(
        rule["ports"],
        serde_json::json!([{"port": "metrics", "protocol": "TCP"}])
    );
    assert!(
        container(&docs)["ports"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["name"] == "metrics")
    );
    // Named peers, each narrowed by namespace and pod: never everyone.
    let peers = rule["from"].as_array().expect("named peers");
    assert!(!peers.is_empty());
    for p in peers {
        assert!(
            p.get("namespaceSelector").is_some() && p.get("podSelector").is_some(),
            "{p}"
        );
    }
    // Off by default.
    for o in ["plain", "extended-resources", "device-plugin-only"] {
        assert!(
            find(&overlay(kubectl, o), "NetworkPolicy", "nvdra-metrics").is_none(),
            "{o}"
        );
    }
}

/// The release's image pinned by digest, as the base's kustomization says: both DaemonSets run
/// `repository:version@sha256:...`.
#[test]
fn an_overlay_pins_the_image_by_version_and_digest() {
    let Some(kubectl) = kubectl() else { return };
    let digest = format!("sha256:{}", "0123456789abcdef".repeat(4));
    let version = env!("CARGO_PKG_VERSION");
    let docs = user_overlay(
        kubectl,
        &format!(
            "resources: [../plain]\nimages: [{{name: ghcr.io/nvdra/nvdra, newTag: \"{version}\", digest: \"{digest}\"}}]\n"
        ),
    );
    assert_eq!(
        str_at(container(&docs), "/image"),
        format!("ghcr.io/nvdra/nvdra:{version}@{digest}")
    );
    let (_, tag, got) = assert_image(&docs, "digest overlay");
    assert_eq!(
        (tag.as_str(), got.as_deref()),
        (version, Some(digest.as_str()))
    );
}

/// The Containerfile's base images are pinned by digest (a tag for the reader, the digest for
/// the pull), and .ci/image still replaces both with its local stand-ins.
#[test]
fn the_containerfile_pins_its_base_images_by_digest() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = read(&root.join("Containerfile"));
    for arg in ["BUILDER", "RUNTIME"] {
        let line = text
            .lines()
            .find_map(|l| l.strip_prefix(&format!("ARG {arg}=")))
            .unwrap_or_else(|| panic!("Containerfile: no ARG {arg}="));
        let (name, digest) = line
            .split_once("@sha256:")
            .unwrap_or_else(|| panic!("Containerfile: ARG {arg}={line} is not pinned by digest"));
        assert!(name.contains(':'), "{arg}: {name} names no tag");
        assert!(
            digest.len() == 64 && digest.bytes().all(|b| b.is_ascii_hexdigit()),
            "{arg}: {digest}"
        );
        assert!(
            read(&root.join(".ci/image")).contains(&format!("--build-arg {arg}=localhost/")),
            ".ci/image no longer passes a stand-in for {arg}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// RBAC against the calls.

/// Every `ClusterApi` method (`SliceApi` included), delegated: a method added to the trait without a default fails to
/// compile here, which is where its call (and its RBAC rule) must be added.
struct EveryCall(KubeApi);

impl ClaimSource for EveryCall {
    fn get_claim<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, api::Result<ResourceClaim>> {
        self.0.get_claim(namespace, name)
    }
}

impl ClaimReader for EveryCall {
    fn get_pod<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, api::Result<k8s_openapi::api::core::v1::Pod>> {
        self.0.get_pod(namespace, name)
    }

    fn get_namespace<'a>(
        &'a self,
        name: &'a str,
    ) -> BoxFuture<'a, api::Result<k8s_openapi::api::core::v1::Namespace>> {
        self.0.get_namespace(name)
    }

    fn claim_status(&self) -> Option<&dyn api::ClaimStatusApi> {
        self.0.claim_status()
    }
}

impl SliceApi for EveryCall {
    fn list_slices<'a>(
        &'a self,
        driver: &'a str,
        node: &'a str,
    ) -> BoxFuture<'a, api::Result<Vec<ResourceSlice>>> {
        self.0.list_slices(driver, node)
    }
    fn create_slice<'a>(
        &'a self,
        slice: &'a ResourceSlice,
    ) -> BoxFuture<'a, api::Result<ResourceSlice>> {
        self.0.create_slice(slice)
    }
    fn replace_slice<'a>(
        &'a self,
        slice: &'a ResourceSlice,
    ) -> BoxFuture<'a, api::Result<ResourceSlice>> {
        self.0.replace_slice(slice)
    }
    fn delete_slice<'a>(
        &'a self,
        name: &'a str,
        preconditions: &'a k8s_openapi::apimachinery::pkg::apis::meta::v1::Preconditions,
    ) -> BoxFuture<'a, api::Result<()>> {
        self.0.delete_slice(name, preconditions)
    }
    fn watch_slices<'a>(
        &'a self,
        driver: &'a str,
        node: &'a str,
    ) -> BoxStream<'a, api::Result<SliceEvent>> {
        self.0.watch_slices(driver, node)
    }
    fn get_node<'a>(&'a self, name: &'a str) -> BoxFuture<'a, api::Result<Node>> {
        self.0.get_node(name)
    }
}

impl ClusterApi for EveryCall {
    fn server_version(&self) -> BoxFuture<'_, api::Result<Option<nvdra::versions::KubeVersion>>> {
        self.0.server_version()
    }
    fn patch_node_labels<'a>(
        &'a self,
        name: &'a str,
        labels: &'a BTreeMap<String, Option<String>>,
    ) -> BoxFuture<'a, api::Result<()>> {
        self.0.patch_node_labels(name, labels)
    }
    fn dra_served(&self) -> BoxFuture<'_, api::Result<bool>> {
        self.0.dra_served()
    }
    fn watch_device_classes(
        &self,
    ) -> BoxStream<'_, api::Result<Vec<k8s_openapi::api::resource::v1::DeviceClass>>> {
        self.0.watch_device_classes()
    }
}

/// One call of every method, as the daemon makes them (publisher, prepare, start-up).
async fn drive(api: &EveryCall, server: &TestApiServer) {
    let (driver, node) = ("gpu.nvidia.com", "node-a");
    server.seed_node(node, "node-uid");
    server.seed_claim(api::allocated_claim(
        "team-a",
        "claim-1",
        "uid-1",
        vec![],
        vec![],
    ));
    assert!(api.server_version().await.unwrap().is_some());
    // `--mode auto`: API discovery, then the DeviceClass list and watch.
    assert!(api.dra_served().await.unwrap());
    server.seed_device_class(
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "gpu.nvidia.com"}, "spec": {}}))
        .unwrap(),
    );
    let mut classes = api.watch_device_classes();
    assert_eq!(classes.next().await.unwrap().unwrap().len(), 1);
    // The watch request follows the list: drive the stream until the server has seen it.
    let watching = || {
        server
            .requests()
            .iter()
            .any(|r| r.path.ends_with("/deviceclasses") && r.query.contains("watch="))
    };
    tokio::select! {
        _ = classes.next() => panic!("the DeviceClasses changed without a change"),
        () = support::wait::eventually("the DeviceClass watch request", watching) => {}
    }
    drop(classes);
    api.get_node(node).await.unwrap();
    api.get_claim("team-a", "claim-1").await.unwrap();
    // After a prepare: nvdra's entries in the claim's status.devices (server-side apply).
    let status = api
        .claim_status()
        .expect("the Kubernetes API keeps claim status");
    let patch = serde_json::json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": "claim-1", "namespace": "team-a", "uid": "uid-1"},
        "status": {"devices": []},
    });
    status
        .apply_claim_status("team-a", "claim-1", driver, &patch)
        .await
        .unwrap();
    // A share before Volta: its pod's user (the test server holds no pods).
    assert!(matches!(
        api.get_pod("team-a", "pod-1").await,
        Err(api::Error::NotFound(_))
    ));
    // A share under --share-trust-domain=label:<key>: its claim's Namespace (the test server
    // holds none).
    assert!(matches!(
        api.get_namespace("team-a").await,
        Err(api::Error::NotFound(_))
    ));
    let mut watch = api.watch_slices(driver, node);
    assert_eq!(watch.next().await.unwrap().unwrap(), SliceEvent::Restarted);
    let slice: ResourceSlice = serde_json::from_value(serde_json::json!({
        "metadata": {"generateName": "node-a-gpu.nvidia.com-"},
        "spec": {"driver": driver, "nodeName": node, "devices": [],
                 "pool": {"name": node, "generation": 1, "resourceSliceCount": 1}},
    }))
    .unwrap();
    let mut created = api.create_slice(&slice).await.unwrap();
    // The watcher lists first; its watch request follows, and reports the create.
    let name = created.metadata.name.clone().unwrap();
    assert_eq!(
        watch.next().await.unwrap().unwrap(),
        SliceEvent::Applied(name)
    );
    assert_eq!(api.list_slices(driver, node).await.unwrap().len(), 1);
    created.spec.pool.generation = 2;
    let replaced = api.replace_slice(&created).await.unwrap();
    // As the publisher deletes: only the slice it read.
    let held = k8s_openapi::apimachinery::pkg::apis::meta::v1::Preconditions {
        uid: replaced.metadata.uid.clone(),
        resource_version: replaced.metadata.resource_version.clone(),
    };
    api.delete_slice(replaced.metadata.name.as_deref().unwrap(), &held)
        .await
        .unwrap();
    // `--node-labels` (the node-labels component's rule).
    let labels = BTreeMap::from([("nvidia.com/gpu.count".to_string(), Some("8".to_string()))]);
    api.patch_node_labels(node, &labels).await.unwrap();
}

/// The authorization attributes of a request, as the API server derives them.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Access {
    Resource {
        group: String,
        resource: String,
        verb: &'static str,
    },
    NonResource(String),
}

fn access(r: &RecordedRequest) -> Access {
    let segs: Vec<&str> = r.path.trim_matches('/').split('/').collect();
    let (group, rest) = match segs.as_slice() {
        ["api", _version, rest @ ..] => ("", rest),
        ["apis", group, _version, rest @ ..] => (*group, rest),
        _ => return Access::NonResource(r.path.clone()),
    };
    let rest = match rest {
        ["namespaces", _ns, rest @ ..] if !rest.is_empty() => rest,
        rest => rest,
    };
    let (resource, named) = match rest {
        // A group-version's discovery document (`/apis/resource.k8s.io/v1`).
        [] => return Access::NonResource(r.path.clone()),
        [resource] => (resource.to_string(), false),
        [resource, _name] => (resource.to_string(), true),
        [resource, _name, sub] => (format!("{resource}/{sub}"), true),
        _ => panic!("unexpected path {}", r.path),
    };
    let watch = r
        .query
        .split('&')
        .any(|kv| kv == "watch=true" || kv == "watch=1");
    let verb = match (r.method.as_str(), named) {
        ("GET", true) => "get",
        ("GET", false) if watch => "watch",
        ("GET", false) => "list",
        ("POST", _) => "create",
        ("PUT", _) => "update",
        ("PATCH", _) => "patch",
        ("DELETE", true) => "delete",
        ("DELETE", false) => "deletecollection",
        (m, _) => panic!("unexpected method {m}"),
    };
    Access::Resource {
        group: group.into(),
        resource,
        verb,
    }
}

/// Non-resource URLs every authenticated user may GET (the default `system:public-info-viewer`
/// role: `/version`; `system:discovery`: `/api`, `/api/*`, `/apis`, `/apis/*`), so nvdra's role
/// need not grant them.
fn public(path: &str) -> bool {
    path == "/version"
        || ["/api", "/apis"]
            .iter()
            .any(|p| path == *p || path.starts_with(&format!("{p}/")))
}

#[tokio::test]
async fn the_cluster_role_allows_every_call_and_nothing_else() {
    let server = TestApiServer::start().await;
    let api = EveryCall(KubeApi::from_url(server.url()).unwrap());
    drive(&api, &server).await;
    let requests = server.requests();
    let used: BTreeSet<Access> = requests.iter().map(access).collect();
    // The recording saw every kind of call the driver made.
    assert!(used.len() >= 8, "{used:?}");

    let base = documents(&read(&manifests().join("base/rbac.yaml")), "base/rbac.yaml");
    let granted = grants(&base);
    // The Node patch is granted only with the node-labels component (its own ClusterRole).
    let labels_file = manifests().join("components/node-labels/rbac.yaml");
    let labels_grants = grants(&documents(
        &read(&labels_file),
        "components/node-labels/rbac.yaml",
    ));
    let node_patch = (String::new(), "nodes".to_string(), "patch".to_string());
    assert!(labels_grants.contains(&node_patch), "{labels_grants:?}");
    let mut missing = Vec::new();
    let mut needed = BTreeSet::new();
    for a in &used {
        match a {
            Access::Resource {
                group,
                resource,
                verb,
            } => {
                let key = (group.clone(), resource.clone(), verb.to_string());
                if key == node_patch {
                    continue;
                }
                if !granted.contains(&key) {
                    missing.push(format!("{verb} {resource} (group {group:?})"));
                }
                needed.insert(key);
            }
            Access::NonResource(path) if public(path) => {}
            Access::NonResource(path) => missing.push(format!("GET {path}")),
        }
    }
    assert!(
        missing.is_empty(),
        "calls the ClusterRole does not allow: {missing:?}"
    );
    let unused: Vec<_> = granted.difference(&needed).collect();
    assert!(unused.is_empty(), "granted but never used: {unused:?}");
    assert!(
        !granted
            .iter()
            .any(|(g, r, v)| g == "*" || r == "*" || v == "*")
    );
}

#[test]
fn requests_map_to_the_verbs_the_api_server_authorizes() {
    let req = |method: &str, path: &str, query: &str| RecordedRequest {
        method: method.into(),
        path: path.into(),
        query: query.into(),
    };
    let res = |group: &str, resource: &str, verb| Access::Resource {
        group: group.into(),
        resource: resource.into(),
        verb,
    };
    let slices = "/apis/resource.k8s.io/v1/resourceslices";
    assert_eq!(
        access(&req("GET", slices, "fieldSelector=x")),
        res("resource.k8s.io", "resourceslices", "list")
    );
    assert_eq!(
        access(&req("GET", slices, "watch=true&x=1")),
        res("resource.k8s.io", "resourceslices", "watch")
    );
    assert_eq!(
        access(&req("PUT", &format!("{slices}/s"), "")),
        res("resource.k8s.io", "resourceslices", "update")
    );
    assert_eq!(
        access(&req(
            "GET",
            "/apis/resource.k8s.io/v1/namespaces/n/resourceclaims/c",
            ""
        )),
        res("resource.k8s.io", "resourceclaims", "get")
    );
    assert_eq!(
        access(&req(
            "PUT",
            "/apis/resource.k8s.io/v1/namespaces/n/resourceclaims/c/status",
            ""
        )),
        res("resource.k8s.io", "resourceclaims/status", "update")
    );
    assert_eq!(
        access(&req("PATCH", "/api/v1/nodes/n", "")),
        res("", "nodes", "patch")
    );
    assert_eq!(
        access(&req("GET", "/version", "")),
        Access::NonResource("/version".into())
    );
}

// ---------------------------------------------------------------------------------------------
// The examples' match lines.

/// `# nvdra-match: fits=a,b fails=c,d [flags=--x,--y=z]` or `# nvdra-match: skip (reason)`:
/// which built-in profiles (`nvdra inventory --profile NAME`, default flags or the given ones)
/// can satisfy the example's claims.
#[derive(Debug, PartialEq)]
enum MatchLine {
    Expect {
        fits: Vec<String>,
        fails: Vec<String>,
        flags: Vec<String>,
    },
    Skip,
}

fn match_line(text: &str) -> Result<MatchLine, String> {
    let lines: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# nvdra-match:"))
        .collect();
    let [line] = lines.as_slice() else {
        return Err(format!("{} `# nvdra-match:` lines, want 1", lines.len()));
    };
    let line = line.trim();
    if line.starts_with("skip (") && line.ends_with(')') {
        return Ok(MatchLine::Skip);
    }
    let mut fields: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    for word in line.split_whitespace() {
        let (k, v) = word
            .split_once('=')
            .ok_or(format!("{word:?} is not key=value"))?;
        let names = v
            .split(',')
            .filter(|n| !n.is_empty())
            .map(String::from)
            .collect();
        if fields.insert(k, names).is_some() {
            return Err(format!("{k} twice"));
        }
    }
    let flags = fields.remove("flags").unwrap_or_default();
    let keys: Vec<&str> = fields.keys().copied().collect();
    if keys != ["fails", "fits"] {
        return Err(format!("{line:?}: want fits=... fails=... [flags=...]"));
    }
    if let Some(f) = flags.iter().find(|f| !f.starts_with("--")) {
        return Err(format!("flags: {f:?} is not a --flag"));
    }
    let fits = fields.remove("fits").unwrap_or_default();
    let fails = fields.remove("fails").unwrap_or_default();
    Ok(MatchLine::Expect { fits, fails, flags })
}

#[test]
fn match_lines_parse() {
    assert_eq!(
        match_line("x\n# nvdra-match: fits=a,b fails=c\n").unwrap(),
        MatchLine::Expect {
            fits: vec!["a".into(), "b".into()],
            fails: vec!["c".into()],
            flags: vec![],
        }
    );
    assert_eq!(
        match_line("# nvdra-match: fits=a fails=c flags=--x,--y=1").unwrap(),
        MatchLine::Expect {
            fits: vec!["a".into()],
            fails: vec!["c".into()],
            flags: vec!["--x".into(), "--y=1".into()],
        }
    );
    assert!(match_line("# nvdra-match: fits=a fails=c flags=x").is_err());
    assert_eq!(
        match_line("# nvdra-match: skip (no claim)").unwrap(),
        MatchLine::Skip
    );
    assert!(match_line("# nothing").is_err());
    assert!(match_line("# nvdra-match: fits=a\n# nvdra-match: fits=b fails=c").is_err());
    assert!(match_line("# nvdra-match: fits=a").is_err());
    assert!(match_line("# nvdra-match: fits=a fails=b extra=c").is_err());
}

#[test]
fn every_example_says_which_profiles_it_fits() {
    let profiles: BTreeSet<&str> = nvdra::inventory::topology::profile_names()
        .into_iter()
        .collect();
    let mut files = Vec::new();
    yaml_files(&manifests().join("examples"), &mut files);
    assert!(files.len() >= 8, "{files:?}");
    let classes: BTreeSet<String> = documents(
        &read(&manifests().join("base/deviceclasses.yaml")),
        "deviceclasses",
    )
    .iter()
    .map(|d| str_at(d, "/metadata/name").to_string())
    .collect();
    for file in files {
        let origin = file.display().to_string();
        let text = read(&file);
        let docs = documents(&text, &origin);
        let claims = docs
            .iter()
            .filter(|d| {
                matches!(
                    str_at(d, "/kind"),
                    "ResourceClaim" | "ResourceClaimTemplate"
                )
            })
            .count();
        match match_line(&text).unwrap_or_else(|e| panic!("{origin}: {e}")) {
            MatchLine::Skip => assert_eq!(claims, 0, "{origin}: skips, but has claims"),
            MatchLine::Expect { fits, fails, .. } => {
                assert!(claims > 0, "{origin}: a match line without a claim");
                for p in fits.iter().chain(&fails) {
                    assert!(
                        profiles.contains(p.as_str()),
                        "{origin}: no built-in profile {p}"
                    );
                }
                assert!(
                    !fits.iter().any(|p| fails.contains(p)),
                    "{origin}: fits and fails"
                );
                assert!(!fits.is_empty() && !fails.is_empty(), "{origin}: say both");
            }
        }
        // Every class an example names is one the manifests install, or one it defines itself
        // (another driver's, as that driver's users create it).
        let mut named = Vec::new();
        for d in &docs {
            class_names(d, &mut named);
        }
        let own: BTreeSet<&str> = docs
            .iter()
            .filter(|d| str_at(d, "/kind") == "DeviceClass")
            .map(|d| str_at(d, "/metadata/name"))
            .collect();
        for name in named {
            assert!(
                classes.contains(&name) || own.contains(name.as_str()),
                "{origin}: DeviceClass {name} is not in base/ nor in the example"
            );
        }
    }
}

/// Every `deviceClassName` in `v`.
fn class_names(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::Object(m) => {
            for (k, w) in m {
                match (k.as_str(), w) {
                    ("deviceClassName", Value::String(name)) => out.push(name.clone()),
                    _ => class_names(w, out),
                }
            }
        }
        Value::Array(a) => a.iter().for_each(|w| class_names(w, out)),
        _ => {}
    }
}

/// kubectl reads every example as it reads what users apply: each file, as a kustomize resource,
/// comes out with the same objects, equal to ours (a peer's YAML parser, not serde's).
#[test]
fn kubectl_reads_every_example_as_nvdra_does() {
    let Some(kubectl) = kubectl() else {
        eprintln!("kubectl not found: skipping (NVDRA_REQUIRE_KUBECTL=1 makes this fail)");
        return;
    };
    let mut files = Vec::new();
    yaml_files(&manifests().join("examples"), &mut files);
    let dir = tempfile::tempdir().unwrap();
    for file in files {
        let name = file.file_name().unwrap().to_string_lossy().into_owned();
        let origin = file.display().to_string();
        let ours = documents(&read(&file), &origin);
        let sub = dir.path().join(name.trim_end_matches(".yaml"));
        std::fs::create_dir(&sub).unwrap();
        std::fs::copy(&file, sub.join(&name)).unwrap();
        std::fs::write(
            sub.join("kustomization.yaml"),
            format!("resources: [{name}]\n"),
        )
        .unwrap();
        let theirs = kustomize(kubectl, &sub);
        assert_eq!(theirs.len(), ours.len(), "{origin}");
        for d in &ours {
            let t = theirs
                .iter()
                .find(|t| id(t) == id(d))
                .unwrap_or_else(|| panic!("{origin}: kubectl lost {}", id(d)));
            assert_eq!(t, d, "{origin}: {} as kubectl reads it", id(d));
        }
    }
}

/// `nvdra match` agrees with every example's `# nvdra-match:` line: exit 0 on each profile it
/// fits, 1 on each it does not, with the installed DeviceClasses.
#[test]
fn nvdra_match_agrees_with_every_example() {
    let mut files = Vec::new();
    yaml_files(&manifests().join("examples"), &mut files);
    let classes = manifests().join("base/deviceclasses.yaml");
    let mut checked = 0;
    for file in files {
        let MatchLine::Expect { fits, fails, flags } =
            match_line(&read(&file)).unwrap_or_else(|e| panic!("{}: {e}", file.display()))
        else {
            continue;
        };
        for (profile, want) in fits
            .iter()
            .map(|p| (p, 0))
            .chain(fails.iter().map(|p| (p, 1)))
        {
            let out = Command::new(env!("CARGO_BIN_EXE_nvdra"))
                .arg("match")
                .arg("-f")
                .arg(&file)
                .arg("-f")
                .arg(&classes)
                .args(["--profile", profile, "--node-name", "node-a"])
                .args(&flags)
                .env_remove("NVDRA_LOG")
                .output()
                .expect("nvdra runs");
            assert_eq!(
                out.status.code(),
                Some(want),
                "nvdra match -f {} --profile {profile} {}: want exit {want}\n{}\n{}",
                file.display(),
                flags.join(" "),
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            checked += 1;
        }
    }
    assert!(checked >= 40, "only {checked} example × profile checks");
}

/// Every CEL expression in the manifests (DeviceClasses, example claims, and every overlay's
/// output) compiles in nvdra's CEL environment.
#[test]
fn every_cel_expression_in_the_manifests_compiles() {
    let mut files = Vec::new();
    yaml_files(&manifests(), &mut files);
    let dir = tempfile::tempdir().unwrap();
    if let Some(kubectl) = kubectl() {
        for name in ["plain", "extended-resources", "device-plugin-only"] {
            let docs = overlay(kubectl, name);
            let text: String = docs
                .iter()
                .map(|d| format!("---\n{}\n", serde_json::to_string(d).unwrap()))
                .collect();
            let path = dir.path().join(format!("{name}.yaml"));
            std::fs::write(&path, text).unwrap();
            files.push(path);
        }
    }
    // Kustomizations and patches are not Kubernetes objects nvdra reads.
    files.retain(|f| {
        let text = read(f);
        !text.contains("kind: Kustomization") && !text.contains("kind: Component")
    });
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_nvdra"));
    cmd.arg("validate");
    for f in &files {
        cmd.arg("-f").arg(f);
    }
    let out = cmd.env_remove("NVDRA_LOG").output().expect("nvdra runs");
    assert!(
        out.status.success(),
        "nvdra validate over {} files:\n{}\n{}",
        files.len(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
