//! The manifests' objects and the checks every build of them must pass, whoever builds them:
//! `kubectl kustomize` (tests/integration/manifests.rs) or `helm template`
//! (tests/integration/helm.rs).
// Each test binary uses what it needs.
#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

/// Where the Helm chart mounts a driver root other than `/` in nvdra's container.
pub const DRIVER_ROOT_CTR_PATH: &str = "/driver-root";

pub fn manifests() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("manifests")
}

pub fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The documents of a multi-document YAML text (empty documents left out).
pub fn documents(text: &str, origin: &str) -> Vec<Value> {
    let docs: Vec<Value> =
        serde_saphyr::from_multiple(text).unwrap_or_else(|e| panic!("{origin}: not YAML: {e}"));
    docs.into_iter().filter(|d| !d.is_null()).collect()
}

pub fn str_at<'a>(v: &'a Value, pointer: &str) -> &'a str {
    v.pointer(pointer).and_then(Value::as_str).unwrap_or("")
}

/// `kind/name` of an object, for messages and lookups.
pub fn id(v: &Value) -> String {
    format!("{}/{}", str_at(v, "/kind"), str_at(v, "/metadata/name"))
}

// ---------------------------------------------------------------------------------------------
// Typed round trip.

/// Deserializes `doc` as `T`, serializes it back and lists where the two differ.
pub fn round_trip<T>(doc: &Value) -> Result<Vec<String>, String>
where
    T: serde::de::DeserializeOwned + serde::Serialize,
{
    let typed: T = serde_json::from_value(doc.clone()).map_err(|e| e.to_string())?;
    let back = serde_json::to_value(&typed).map_err(|e| e.to_string())?;
    let mut diffs = Vec::new();
    diff(doc, &back, String::new(), &mut diffs);
    Ok(diffs)
}

/// Where `input` and `output` differ. A number written where the type holds a string (a
/// quantity `1`, which k8s-openapi keeps as `"1"`) or a float is the same value.
pub fn diff(input: &Value, output: &Value, path: String, out: &mut Vec<String>) {
    match (input, output) {
        (Value::Object(a), Value::Object(b)) => {
            for (k, v) in a {
                let p = format!("{path}.{k}");
                match b.get(k) {
                    Some(w) => diff(v, w, p, out),
                    None => out.push(format!("{p}: unknown field (dropped by the typed read)")),
                }
            }
            for k in b.keys().filter(|k| !a.contains_key(*k)) {
                out.push(format!("{path}.{k}: added by the typed read"));
            }
        }
        (Value::Array(a), Value::Array(b)) if a.len() == b.len() => {
            for (i, (v, w)) in a.iter().zip(b).enumerate() {
                diff(v, w, format!("{path}[{i}]"), out);
            }
        }
        (Value::Number(n), Value::String(s)) if n.to_string() == *s => {}
        // A number the type holds as a float (a CRD schema's `minimum: 0`, read back `0.0`).
        (Value::Number(a), Value::Number(b)) if a.as_f64() == b.as_f64() => {}
        (a, b) if a == b => {}
        (a, b) => out.push(format!("{path}: {a} became {b}")),
    }
}

/// The typed round trip for every kind the manifests may hold; an unknown kind is an error.
pub fn check_typed(doc: &Value) -> Result<Vec<String>, String> {
    use k8s_openapi::api::admissionregistration::v1 as admission;
    use k8s_openapi::api::apps::v1 as apps;
    use k8s_openapi::api::core::v1 as core;
    use k8s_openapi::api::networking::v1 as networking;
    use k8s_openapi::api::rbac::v1 as rbac;
    use k8s_openapi::api::resource::v1 as resource;
    match (str_at(doc, "/apiVersion"), str_at(doc, "/kind")) {
        ("v1", "Namespace") => round_trip::<core::Namespace>(doc),
        ("v1", "ServiceAccount") => round_trip::<core::ServiceAccount>(doc),
        ("v1", "ConfigMap") => round_trip::<core::ConfigMap>(doc),
        ("v1", "Service") => round_trip::<core::Service>(doc),
        ("v1", "Pod") => round_trip::<core::Pod>(doc),
        ("apps/v1", "DaemonSet") => round_trip::<apps::DaemonSet>(doc),
        ("apps/v1", "Deployment") => round_trip::<apps::Deployment>(doc),
        ("rbac.authorization.k8s.io/v1", "Role") => round_trip::<rbac::Role>(doc),
        ("rbac.authorization.k8s.io/v1", "RoleBinding") => round_trip::<rbac::RoleBinding>(doc),
        ("apiextensions.k8s.io/v1", "CustomResourceDefinition") => {
            round_trip::<k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition>(doc)
        }
        ("rbac.authorization.k8s.io/v1", "ClusterRole") => round_trip::<rbac::ClusterRole>(doc),
        ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding") => {
            round_trip::<rbac::ClusterRoleBinding>(doc)
        }
        ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicy") => {
            round_trip::<admission::ValidatingAdmissionPolicy>(doc)
        }
        ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicyBinding") => {
            round_trip::<admission::ValidatingAdmissionPolicyBinding>(doc)
        }
        ("resource.k8s.io/v1", "DeviceClass") => round_trip::<resource::DeviceClass>(doc),
        ("networking.k8s.io/v1", "NetworkPolicy") => round_trip::<networking::NetworkPolicy>(doc),
        ("resource.k8s.io/v1", "ResourceClaim") => round_trip::<resource::ResourceClaim>(doc),
        ("resource.k8s.io/v1", "ResourceClaimTemplate") => {
            round_trip::<resource::ResourceClaimTemplate>(doc)
        }
        (api_version, kind) => Err(format!(
            "{api_version} {kind} is not a kind this test knows; add it to check_typed"
        )),
    }
}

/// Every object of `docs` reads back unchanged; panics listing every difference.
pub fn assert_typed(docs: &[Value], origin: &str) {
    let mut problems = Vec::new();
    for doc in docs {
        match check_typed(doc) {
            Ok(diffs) => problems.extend(diffs.into_iter().map(|d| format!("{}{d}", id(doc)))),
            Err(e) => problems.push(format!("{}: {e}", id(doc))),
        }
    }
    assert!(
        problems.is_empty(),
        "{origin}:\n  {}",
        problems.join("\n  ")
    );
}

// ---------------------------------------------------------------------------------------------
// Kustomize.

pub fn kubectl() -> Option<&'static str> {
    let required = super::require::required("NVDRA_REQUIRE_KUBECTL");
    let found = Command::new("kubectl")
        .args(["version", "--client"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !found && required {
        panic!(
            "NVDRA_REQUIRE_KUBECTL requires kubectl but `kubectl version --client` does not run"
        );
    }
    found.then_some("kubectl")
}

/// `kubectl kustomize dir`, parsed.
pub fn kustomize(kubectl: &str, dir: &Path) -> Vec<Value> {
    let out = Command::new(kubectl)
        .arg("kustomize")
        .arg(dir)
        .output()
        .expect("kubectl runs");
    assert!(
        out.status.success(),
        "kubectl kustomize {}: {}",
        dir.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).expect("kustomize prints UTF-8");
    let docs = documents(&text, &dir.display().to_string());
    assert_typed(&docs, &format!("kubectl kustomize {}", dir.display()));
    docs
}

pub fn overlay(kubectl: &str, name: &str) -> Vec<Value> {
    kustomize(kubectl, &manifests().join("overlays").join(name))
}

pub fn find<'a>(docs: &'a [Value], kind: &str, name: &str) -> Option<&'a Value> {
    docs.iter()
        .find(|d| str_at(d, "/kind") == kind && str_at(d, "/metadata/name") == name)
}

pub fn kinds(docs: &[Value]) -> BTreeMap<String, usize> {
    let mut m = BTreeMap::new();
    for d in docs {
        *m.entry(str_at(d, "/kind").to_string()).or_default() += 1;
    }
    m
}

pub fn container(docs: &[Value]) -> &Value {
    let ds = find(docs, "DaemonSet", "nvdra").expect("the DaemonSet");
    &ds["spec"]["template"]["spec"]["containers"][0]
}

/// Every (apiGroup, resource, verb) the ClusterRoles of `docs` grant.
pub fn grants(docs: &[Value]) -> BTreeSet<(String, String, String)> {
    let mut out = BTreeSet::new();
    for role in docs.iter().filter(|d| str_at(d, "/kind") == "ClusterRole") {
        for rule in role["rules"].as_array().into_iter().flatten() {
            let list = |k: &str| -> Vec<String> {
                rule[k]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|v| v.as_str().map(String::from))
                    .collect()
            };
            for g in list("apiGroups") {
                for r in list("resources") {
                    for v in list("verbs") {
                        out.insert((g.clone(), r.clone(), v));
                    }
                }
            }
        }
    }
    out
}

/// What every overlay's DaemonSet must keep, whatever the overlay changes.
pub fn assert_daemonset_contracts(docs: &[Value], origin: &str) {
    let ds = find(docs, "DaemonSet", "nvdra").expect("the DaemonSet");
    let pod = &ds["spec"]["template"]["spec"];
    let c = container(docs);
    // The kubelet's directories at the same paths: the socket paths are handed over verbatim.
    let volumes: BTreeMap<&str, &Value> = pod["volumes"]
        .as_array()
        .expect("volumes")
        .iter()
        .map(|v| (str_at(v, "/name"), v))
        .collect();
    let mut host_mounts = 0;
    let mut host_proc = None;
    for m in c["volumeMounts"].as_array().expect("volume mounts") {
        let v = volumes[str_at(m, "/name")];
        if let Some(host) = v.pointer("/hostPath/path") {
            if host == "/proc" {
                // The host's processes, for /metrics' attribution (a GPU process's pod from
                // its cgroup), read-only and elsewhere than the container's own /proc.
                assert_eq!(
                    m["readOnly"], true,
                    "{origin}: the host's /proc is read-only"
                );
                assert_ne!(m["mountPath"], "/proc", "{origin}");
                host_proc = Some(str_at(m, "/mountPath"));
            } else if m["mountPath"] == DRIVER_ROOT_CTR_PATH {
                // The one host directory mounted elsewhere (the chart's driverRoot other than /):
                // nvdra only reads the driver's files there.
                assert_eq!(
                    m["readOnly"], true,
                    "{origin}: the driver root is read-only"
                );
            } else {
                assert_eq!(
                    host, &m["mountPath"],
                    "{origin}: {} not at its host path",
                    m["name"]
                );
            }
            host_mounts += 1;
        }
        // nvdra mounts nothing, and Bidirectional propagation needs a privileged container;
        // HostToContainer (the driver root, which the GPU Operator's driver container may mount
        // after nvdra started) does not.
        assert!(
            m.get("mountPropagation")
                .is_none_or(|p| p == "HostToContainer"),
            "{origin}: {} propagates mounts back to the host",
            m["name"]
        );
    }
    assert!(host_mounts >= 2, "{origin}: {host_mounts} host mounts");
    // The downward API.
    let env: BTreeMap<&str, &Value> = c["env"]
        .as_array()
        .expect("env")
        .iter()
        .map(|e| (str_at(e, "/name"), e))
        .collect();
    // Attribution as shipped: nvdra reads GPU processes' cgroups where the host's /proc is.
    assert_eq!(
        env.get("NVDRA_PROC_ROOT").map(|e| str_at(e, "/value")),
        Some(host_proc.expect("the host's /proc is mounted (per-share and per-pod metrics)")),
        "{origin}: NVDRA_PROC_ROOT names the host's /proc mount"
    );
    assert_eq!(
        str_at(env["NODE_NAME"], "/valueFrom/fieldRef/fieldPath"),
        "spec.nodeName"
    );
    assert_eq!(
        str_at(env["POD_UID"], "/valueFrom/fieldRef/fieldPath"),
        "metadata.uid"
    );
    // glibc's malloc as benches/rss.rs measured it (no thread caches, two arenas).
    assert_eq!(
        str_at(env["GLIBC_TUNABLES"], "/value"),
        "glibc.malloc.tcache_count=0:glibc.malloc.arena_max=2",
        "{origin}"
    );
    // Surge updates: the new pod is up before the old one goes.
    let rolling = &ds["spec"]["updateStrategy"]["rollingUpdate"];
    assert_eq!(rolling["maxSurge"], 1, "{origin}");
    assert_eq!(rolling["maxUnavailable"], 0, "{origin}");
    // Probes on the metrics port, which is nvdra's default metrics port.
    let port = c["ports"]
        .as_array()
        .expect("ports")
        .iter()
        .find(|p| p["name"] == "metrics")
        .expect("a metrics port");
    let default_port = nvdra::config::DEFAULT_METRICS_ADDRESS
        .rsplit(':')
        .next()
        .and_then(|p| p.parse::<u64>().ok());
    assert_eq!(port["containerPort"].as_u64(), default_port, "{origin}");
    for (probe, path) in [("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")] {
        assert_eq!(
            str_at(c, &format!("/{probe}/httpGet/path")),
            path,
            "{origin}"
        );
        assert_eq!(
            str_at(c, &format!("/{probe}/httpGet/port")),
            "metrics",
            "{origin}"
        );
    }
    // No wider than it needs: none of the host's PID, IPC or network namespaces (only the MPS
    // host shares the host's PIDs), not privileged, every capability dropped, SYS_ADMIN (and
    // the host's cgroup root) added back only for MIG and shares ([`mig_and_shares`]).
    for namespace in ["hostPID", "hostIPC", "hostNetwork"] {
        assert!(
            pod.get(namespace).is_none_or(|v| v == false),
            "{origin}: the plugin's pod has {namespace}"
        );
    }
    let sc = &c["securityContext"];
    assert_eq!(sc["privileged"], false, "{origin}");
    assert_eq!(
        sc["capabilities"]["drop"],
        serde_json::json!(["ALL"]),
        "{origin}"
    );
    mig_and_shares(docs, origin);
    assert_eq!(sc["readOnlyRootFilesystem"], true, "{origin}");
    assert_image(docs, origin);
    // GPU nodes only.
    assert_eq!(
        str_at(pod, "/nodeSelector/nvidia.com~1gpu.present"),
        "true",
        "{origin}"
    );
    // Sized from benches/rss.rs: 15 MiB resident after load; a request below that would be a lie.
    let mib = |q: &str| q.strip_suffix("Mi").and_then(|n| n.parse::<u64>().ok());
    let request = mib(str_at(c, "/resources/requests/memory")).expect("a memory request in Mi");
    let limit = mib(str_at(c, "/resources/limits/memory")).expect("a memory limit in Mi");
    assert!(
        (15..=limit).contains(&request),
        "{origin}: {request}Mi / {limit}Mi"
    );
    // The identity the policy and the binding name is the pod's.
    let sa = str_at(pod, "/serviceAccountName");
    let ns = str_at(ds, "/metadata/namespace");
    assert!(
        find(docs, "ServiceAccount", sa).is_some(),
        "{origin}: no ServiceAccount {sa}"
    );
    if let Some(crb) = find(docs, "ClusterRoleBinding", "nvdra") {
        assert_eq!(str_at(crb, "/subjects/0/name"), sa, "{origin}");
        assert_eq!(str_at(crb, "/subjects/0/namespace"), ns, "{origin}");
    }
    if let Some(vap) = find(docs, "ValidatingAdmissionPolicy", "nvdra-resourceslices") {
        let user = format!("system:serviceaccount:{ns}:{sa}");
        let condition = str_at(vap, "/spec/matchConditions/0/expression");
        assert!(
            condition.contains(&format!("\"{user}\"")),
            "{origin}: {condition}"
        );
        let binding = find(
            docs,
            "ValidatingAdmissionPolicyBinding",
            "nvdra-resourceslices",
        )
        .expect("the policy's binding");
        assert_eq!(str_at(binding, "/spec/policyName"), "nvdra-resourceslices");
        assert_eq!(
            binding["spec"]["validationActions"],
            serde_json::json!(["Deny"])
        );
    }
}

/// Whether nvdra's container has what MIG and shares need (components/mig-and-shares, the
/// chart's migAndShares): SYS_ADMIN and the host's cgroup root, read-only, both or neither;
/// without them, no capability at all and no privilege escalation.
pub fn mig_and_shares(docs: &[Value], origin: &str) -> bool {
    let c = container(docs);
    let sc = &c["securityContext"];
    let cgroup = c["volumeMounts"]
        .as_array()
        .expect("volume mounts")
        .iter()
        .find(|m| m["mountPath"] == "/sys/fs/cgroup");
    match sc["capabilities"].get("add") {
        Some(add) => {
            assert_eq!(add, &serde_json::json!(["SYS_ADMIN"]), "{origin}");
            // The API server refuses allowPrivilegeEscalation: false beside SYS_ADMIN.
            assert!(sc.get("allowPrivilegeEscalation").is_none(), "{origin}");
            let m = cgroup.unwrap_or_else(|| panic!("{origin}: SYS_ADMIN without the cgroup root"));
            assert_eq!(
                m["readOnly"], true,
                "{origin}: the cgroup root is read-only"
            );
            true
        }
        None => {
            assert_eq!(sc["allowPrivilegeEscalation"], false, "{origin}");
            assert!(
                cgroup.is_none(),
                "{origin}: the host's cgroup root without MIG and shares"
            );
            false
        }
    }
}

/// The image of both DaemonSets: one image, by version (never `latest`, never untagged), and
/// by digest where one is given (`repository:tag@sha256:<64 hex>`). Returns (repository, tag,
/// digest).
pub fn assert_image(docs: &[Value], origin: &str) -> (String, String, Option<String>) {
    let image = str_at(container(docs), "/image").to_string();
    if let Some(host) = find(docs, "DaemonSet", "nvdra-mps-host") {
        assert_eq!(
            str_at(host, "/spec/template/spec/containers/0/image"),
            image,
            "{origin}: the MPS host runs another image"
        );
    }
    let (name, digest) = match image.split_once('@') {
        Some((name, digest)) => {
            let hex = digest.strip_prefix("sha256:").unwrap_or("");
            assert!(
                hex.len() == 64
                    && hex
                        .bytes()
                        .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()),
                "{origin}: {image}: not a sha256 digest"
            );
            (name, Some(digest.to_string()))
        }
        None => (image.as_str(), None),
    };
    let (repository, tag) = name
        .rsplit_once(':')
        .filter(|(_, tag)| !tag.contains('/'))
        .unwrap_or_else(|| panic!("{origin}: {image} has no tag"));
    assert!(!tag.is_empty() && tag != "latest", "{origin}: {image}");
    (repository.to_string(), tag.to_string(), digest)
}

/// What the MPS host's DaemonSet must keep: replaced only on purpose (OnDelete: it ends every
/// share of the node), node-critical, the privileges MPS needs and nothing more, the MPS root at
/// its host path, shared with the plugin's DaemonSet.
pub fn assert_mps_host_contracts(docs: &[Value], origin: &str) {
    let ds = find(docs, "DaemonSet", "nvdra-mps-host").expect("the MPS host's DaemonSet");
    let pod = &ds["spec"]["template"]["spec"];
    assert_eq!(
        str_at(ds, "/spec/updateStrategy/type"),
        "OnDelete",
        "{origin}"
    );
    assert_eq!(
        str_at(pod, "/priorityClassName"),
        "system-node-critical",
        "{origin}"
    );
    assert_eq!(
        pod["automountServiceAccountToken"], false,
        "{origin}: no API access"
    );
    // The host PID namespace, as NVIDIA runs its MPS daemons (README, "The MPS host"); no
    // host IPC: clients and servers share memory through each daemon's own /dev/shm.
    assert_eq!(
        pod["hostPID"], true,
        "{origin}: the MPS host is not in the host PID namespace"
    );
    assert!(
        pod.get("hostIPC").is_none_or(|v| v == false),
        "{origin}: the MPS host shares the host's IPC namespace"
    );
    let [c] = pod["containers"].as_array().expect("containers").as_slice() else {
        panic!("{origin}: one container");
    };
    assert_eq!(c["args"][0], "mps-host", "{origin}");
    // The daemons and servers live in this container's cgroup: a memory limit would let one
    // OOM kill end every share of the node.
    assert!(
        c["resources"]["limits"].get("memory").is_none(),
        "{origin}: the MPS host has a memory limit"
    );
    assert!(
        c["resources"]["requests"].get("memory").is_some(),
        "{origin}: the MPS host reserves no memory"
    );
    // Privileged, for the one thing capabilities cannot grant: each daemon's /dev/shm tmpfs
    // propagated to the node (Bidirectional), where the share containers bind it.
    let sc = &c["securityContext"];
    assert_eq!(sc["privileged"], true, "{origin}");
    assert_eq!(sc["readOnlyRootFilesystem"], true, "{origin}");
    // The MPS root: a host directory at the same path in both pods.
    let root = nvdra::config::DEFAULT_MPS_ROOT;
    for (name, container) in [("nvdra-mps-host", c), ("nvdra", container(docs))] {
        let d = find(docs, "DaemonSet", name).unwrap();
        let mount = container["volumeMounts"]
            .as_array()
            .expect("volume mounts")
            .iter()
            .find(|m| m["mountPath"] == root)
            .unwrap_or_else(|| panic!("{origin}: {name} does not mount {root}"));
        let volume = d["spec"]["template"]["spec"]["volumes"]
            .as_array()
            .expect("volumes")
            .iter()
            .find(|v| v["name"] == mount["name"])
            .expect("the mount's volume");
        assert_eq!(str_at(volume, "/hostPath/path"), root, "{origin}: {name}");
        // The host's tmpfs mounts reach the node; the plugin mounts nothing.
        let propagation = mount.get("mountPropagation").and_then(Value::as_str);
        if name == "nvdra-mps-host" {
            assert_eq!(propagation, Some("Bidirectional"), "{origin}: {name}");
        } else {
            assert!(
                propagation.is_none_or(|p| p == "HostToContainer"),
                "{origin}: {name}"
            );
        }
    }
}

pub fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.path().is_dir() {
            copy_tree(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

/// nvdra's Helm chart.
pub fn chart() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("deployments/helm/nvdra")
}

/// `helm`, when it runs here (required with `NVDRA_REQUIRE_HELM`).
pub fn helm() -> Option<&'static str> {
    let required = super::require::required("NVDRA_REQUIRE_HELM");
    let found = Command::new("helm")
        .args(["version", "--short"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !found && required {
        panic!(
            "NVDRA_REQUIRE_HELM requires helm but `helm version` does not run (bash .ci/helm installs it)"
        );
    }
    if !found {
        eprintln!("helm is not installed: skipped (bash .ci/helm installs it)");
    }
    found.then_some("helm")
}

/// `helm template nvdra <chart> --namespace <ns> <args>`: the objects, or helm's error.
pub fn template(helm: &str, namespace: &str, args: &[&str]) -> Result<Vec<Value>, String> {
    let out = Command::new(helm)
        .args(["template", "nvdra"])
        .arg(chart())
        .args(["--namespace", namespace])
        .args(args)
        .output()
        .expect("helm runs");
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    let text = String::from_utf8(out.stdout).expect("helm prints UTF-8");
    Ok(documents(&text, &format!("helm template {args:?}")))
}
