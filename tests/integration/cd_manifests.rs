//! Compute domains as a drop-in for NVIDIA's (issue 37 items 1 and 7), on peers nvdra did not
//! write:
//!
//! - NVIDIA's own demo objects (`tests/data/compute-domains/nvidia-demo/`, verbatim) read into
//!   nvdra's types, and each ComputeDomain is accepted by nvdra's CRD: its openAPIV3Schema checked
//!   by Python's `jsonschema`, its `x-kubernetes-validations` evaluated by Google's CEL
//!   (`tests/support/crd.py`) as the API server does: an update that changes the spec is
//!   refused, one that keeps it accepted. A bad allocation mode, a missing template name or a
//!   negative node count is refused naming the field.
//! - nvdra's CRDs have NVIDIA's schemas (its CRD files vendored beside the demo), descriptions
//!   aside; the DeviceClasses NVIDIA's names and CEL.
//! - `components/compute-domains` and the chart's `computeDomains.enabled` build the same
//!   objects (kubectl kustomize, helm template, helm lint), are off by default, and give each of
//!   the plugin, the controller and the daemons what it touches, by name and verb.
//! - Item 7: nvdra's chart as it is shares nothing with NVIDIA's compute-domain half (the names
//!   NVIDIA's chart renders, vendored in `tests/data/compute-domains/nvidia-chart-objects.yaml`).
//!
//! Without `jsonschema` or `cel-expr-python` the schema tests skip, unless
//! `NVDRA_REQUIRE_JSONSCHEMA=1` / `NVDRA_REQUIRE_CEL=1` (which `.ci/run` sets); without kubectl
//! or helm the build tests skip unless `NVDRA_REQUIRE_KUBECTL=1` / `NVDRA_REQUIRE_HELM=1`.

use crate::support;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use k8s_openapi::api::core::v1::{Pod, PodTemplateSpec};
use nvdra::computedomain::api;
use serde_json::{Value, json};
use support::manifests::*;

/// What CI installs (`.ci/run`).
const PIP: &str = "python3 -m pip install jsonschema==4.26.0 cel-expr-python==0.1.3";

fn data() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/compute-domains")
}

fn component() -> PathBuf {
    manifests().join("components/compute-domains")
}

fn have_checkers() -> bool {
    static SCHEMA: OnceLock<Result<(), String>> = OnceLock::new();
    static CEL: OnceLock<Result<(), String>> = OnceLock::new();
    support::python::have(
        &SCHEMA,
        "import jsonschema",
        "Python's jsonschema",
        "NVDRA_REQUIRE_JSONSCHEMA",
        PIP,
    ) && support::python::have(
        &CEL,
        "from cel_expr_python import cel; from cel_expr_python.ext import ext_optional, ext_strings",
        "Google's CEL for Python (cel-expr-python)",
        "NVDRA_REQUIRE_CEL",
        PIP,
    )
}

/// nvdra's CRD named `name` (the component's file, which the chart renders too).
fn crd(name: &str) -> Value {
    let docs = documents(&read(&component().join("crds.yaml")), "crds.yaml");
    find(&docs, "CustomResourceDefinition", name)
        .unwrap_or_else(|| panic!("no CRD {name}"))
        .clone()
}

/// The CRD's verdict on each (object, old object): the errors, empty when accepted.
fn admit(crd: &Value, samples: &[(Value, Option<Value>)]) -> Vec<Vec<String>> {
    let objects: Vec<Value> = samples
        .iter()
        .map(|(o, old)| json!({"object": o, "oldObject": old}))
        .collect();
    let input = json!({"crd": crd, "objects": objects}).to_string();
    let out = support::python::json_of(
        include_str!("../support/crd.py"),
        &[],
        &input,
        "the CRD checker",
    );
    out.as_array()
        .expect("one answer per object")
        .iter()
        .map(|a| {
            a["errors"]
                .as_array()
                .expect("errors")
                .iter()
                .map(|e| e.as_str().expect("a message").to_string())
                .collect()
        })
        .collect()
}

/// Every document of NVIDIA's demo files, with its file's name.
fn demo() -> Vec<(String, Value)> {
    let dir = data().join("nvidia-demo");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    assert_eq!(files.len(), 6, "{files:?}");
    let mut out = Vec::new();
    for f in files {
        let name = f.file_name().unwrap().to_string_lossy().into_owned();
        for d in documents(&read(&f), &name) {
            out.push((name.clone(), d));
        }
    }
    out
}

fn domains() -> Vec<(String, Value)> {
    demo()
        .into_iter()
        .filter(|(_, d)| str_at(d, "/kind") == "ComputeDomain")
        .collect()
}

// ---------------------------------------------------------------------------------------------
// NVIDIA's demo objects.

#[test]
fn nvidias_demo_objects_read_into_nvdras_types_unchanged() {
    let mut domains = 0;
    let mut claims = 0;
    for (file, doc) in demo() {
        let all = demo();
        // The templates the file's domains generate: what its pods may claim.
        let templates: BTreeSet<String> = all
            .iter()
            .filter(|(f, d)| *f == file && str_at(d, "/kind") == "ComputeDomain")
            .map(|(_, d)| str_at(d, "/spec/channel/resourceClaimTemplate/name").to_string())
            .collect();
        let pods: Vec<Value> = match str_at(&doc, "/kind") {
            "ComputeDomain" => {
                let diffs = round_trip::<api::ComputeDomain>(&doc).unwrap();
                assert!(diffs.is_empty(), "{file}: {diffs:?}");
                let cd: api::ComputeDomain = serde_json::from_value(doc.clone()).unwrap();
                assert_eq!(cd.spec.validate(), Ok(()), "{file}");
                let channel = cd.spec.channel.as_ref().unwrap();
                let want = match str_at(&doc, "/spec/channel/allocationMode") {
                    "All" => api::AllocationMode::All,
                    "" | "Single" => api::AllocationMode::Single,
                    other => panic!("{file}: {other}"),
                };
                assert_eq!(channel.allocation_mode(), want, "{file}");
                assert!(cd.spec.num_nodes > 0, "{file}");
                domains += 1;
                continue;
            }
            "Pod" => {
                let diffs = round_trip::<Pod>(&doc).unwrap();
                assert!(diffs.is_empty(), "{file}: {diffs:?}");
                vec![doc["spec"].clone()]
            }
            // Kubeflow's MPIJob: its replicas' pod templates are Kubernetes' PodTemplateSpec.
            "MPIJob" => doc["spec"]["mpiReplicaSpecs"]
                .as_object()
                .expect("replica specs")
                .values()
                .map(|r| {
                    let t: PodTemplateSpec = serde_json::from_value(r["template"].clone())
                        .unwrap_or_else(|e| panic!("{file}: {e}"));
                    serde_json::to_value(t.spec.expect("a pod spec")).unwrap()
                })
                .collect(),
            other => panic!("{file}: a {other} in NVIDIA's demo"),
        };
        for pod in pods {
            for c in pod["resourceClaims"].as_array().into_iter().flatten() {
                let t = str_at(c, "/resourceClaimTemplateName");
                assert!(
                    templates.contains(t),
                    "{file}: a pod claims template {t}, which no domain of the file generates"
                );
                claims += 1;
            }
        }
    }
    assert_eq!(domains, 5);
    assert_eq!(claims, 5);
}

#[test]
fn nvidias_demo_domains_are_accepted_by_nvdras_crd() {
    if !have_checkers() {
        return;
    }
    let crd = crd(api::DOMAIN_CRD);
    let domains = domains();
    let samples: Vec<(Value, Option<Value>)> =
        domains.iter().map(|(_, d)| (d.clone(), None)).collect();
    for ((file, _), errors) in domains.iter().zip(admit(&crd, &samples)) {
        assert!(errors.is_empty(), "{file}: {errors:?}");
    }
    // And with the status the controller writes (the status subresource's schema).
    let mut with_status = domains[0].1.clone();
    with_status["status"] = json!({"status": "Ready", "nodes": [
        {"name": "node-a", "ipAddress": "10.0.0.1", "cliqueID": "c.1", "index": 0, "status": "Ready"}
    ]});
    assert_eq!(admit(&crd, &[(with_status, None)]), [Vec::<String>::new()]);
}

#[test]
fn the_spec_is_immutable_as_the_api_server_holds_it() {
    if !have_checkers() {
        return;
    }
    let crd = crd(api::DOMAIN_CRD);
    for (file, old) in domains() {
        let same = old.clone();
        let mut relabelled = old.clone();
        relabelled["metadata"]["labels"] = json!({"team": "a"});
        relabelled["status"] = json!({"status": "NotReady"});
        let mut more_nodes = old.clone();
        more_nodes["spec"]["numNodes"] = json!(old["spec"]["numNodes"].as_i64().unwrap() + 1);
        let mut renamed = old.clone();
        renamed["spec"]["channel"]["resourceClaimTemplate"]["name"] = json!("other");
        let answers = admit(
            &crd,
            &[
                (same.clone(), Some(old.clone())),
                (relabelled.clone(), Some(old.clone())),
                (more_nodes.clone(), Some(old.clone())),
                (renamed.clone(), Some(old.clone())),
            ],
        );
        assert!(answers[0].is_empty(), "{file}: {:?}", answers[0]);
        assert!(answers[1].is_empty(), "{file}: {:?}", answers[1]);
        for a in &answers[2..] {
            assert_eq!(a, &["spec: A computeDomain.spec is immutable"], "{file}");
        }
        // nvdra's own check agrees (the test API server's and the controller's).
        let typed = |v: &Value| serde_json::from_value::<api::ComputeDomain>(v.clone()).unwrap();
        let old = typed(&old);
        assert_eq!(typed(&same).validate_update(&old), Ok(()));
        assert_eq!(typed(&relabelled).validate_update(&old), Ok(()));
        for changed in [&more_nodes, &renamed] {
            assert_eq!(
                typed(changed).validate_update(&old),
                Err(api::Invalid::SpecChanged)
            );
        }
    }
}

#[test]
fn a_bad_domain_is_refused_naming_the_field() {
    if !have_checkers() {
        return;
    }
    let crd = crd(api::DOMAIN_CRD);
    let good = domains()[0].1.clone();
    let with = |pointer: &str, value: Option<Value>| {
        let mut d = good.clone();
        let (parent, key) = pointer.rsplit_once('/').unwrap();
        let obj = d.pointer_mut(parent).unwrap().as_object_mut().unwrap();
        match value {
            Some(v) => obj.insert(key.to_string(), v),
            None => obj.remove(key),
        };
        d
    };
    let cases = [
        (
            with("/spec/channel/allocationMode", Some(json!("Some"))),
            "spec.channel.allocationMode: 'Some' is not one of ['All', 'Single']",
        ),
        (
            with("/spec/channel/resourceClaimTemplate/name", None),
            "spec.channel.resourceClaimTemplate: 'name' is a required property",
        ),
        (
            with("/spec/channel", None),
            "spec: 'channel' is a required property",
        ),
        (
            with("/spec/numNodes", Some(json!(-1))),
            "spec.numNodes: -1 is less than the minimum of 0",
        ),
    ];
    let samples: Vec<(Value, Option<Value>)> =
        cases.iter().map(|(d, _)| (d.clone(), None)).collect();
    for ((doc, want), errors) in cases.iter().zip(admit(&crd, &samples)) {
        assert_eq!(errors, [want.to_string()], "{doc}");
    }
    // nvdra's types refuse the same.
    let err = serde_json::from_value::<api::ComputeDomain>(cases[0].0.clone()).unwrap_err();
    assert!(err.to_string().contains("Some"), "{err}");
    assert!(serde_json::from_value::<api::ComputeDomain>(cases[1].0.clone()).is_err());
    let typed = |v: &Value| serde_json::from_value::<api::ComputeDomain>(v.clone()).unwrap();
    assert_eq!(
        typed(&cases[2].0).spec.validate(),
        Err(api::Invalid::NoChannel)
    );
    assert_eq!(
        typed(&cases[3].0).spec.validate(),
        Err(api::Invalid::NegativeNumNodes(-1))
    );
}

#[test]
fn a_clique_as_nvidias_daemon_writes_it_is_accepted() {
    if !have_checkers() {
        return;
    }
    let crd = crd(api::CLIQUE_CRD);
    let clique = json!({
        "apiVersion": api::API_VERSION, "kind": "ComputeDomainClique",
        "metadata": {"name": "uid.c.1", "namespace": "nvdra"},
        "daemons": [{"nodeName": "node-a", "ipAddress": "10.0.0.1", "cliqueID": "c.1",
                     "index": 0, "status": "Ready"}],
    });
    let mut bad = clique.clone();
    bad["daemons"][0]["status"] = json!("Up");
    let mut nameless = clique.clone();
    nameless["daemons"][0]
        .as_object_mut()
        .unwrap()
        .remove("nodeName");
    let answers = admit(
        &crd,
        &[(clique.clone(), None), (bad, None), (nameless, None)],
    );
    assert!(answers[0].is_empty(), "{:?}", answers[0]);
    assert_eq!(
        answers[1],
        ["daemons[0].status: 'Up' is not one of ['Ready', 'NotReady']"]
    );
    assert_eq!(
        answers[2],
        ["daemons[0]: 'nodeName' is a required property"]
    );
    assert!(
        round_trip::<api::ComputeDomainClique>(&clique)
            .unwrap()
            .is_empty()
    );
}

/// `v` with every `description` left out.
fn without_descriptions(v: &Value) -> Value {
    match v {
        Value::Object(m) => Value::Object(
            m.iter()
                .filter(|(k, _)| *k != "description")
                .map(|(k, w)| (k.clone(), without_descriptions(w)))
                .collect(),
        ),
        Value::Array(a) => Value::Array(a.iter().map(without_descriptions).collect()),
        other => other.clone(),
    }
}

#[test]
fn nvdras_crds_are_nvidias_but_for_the_descriptions_and_the_domains_conditions() {
    for (name, file) in [
        (api::DOMAIN_CRD, "resource.nvidia.com_computedomains.yaml"),
        (
            api::CLIQUE_CRD,
            "resource.nvidia.com_computedomaincliques.yaml",
        ),
    ] {
        let theirs = &documents(&read(&data().join("nvidia-crds").join(file)), file)[0];
        let mut ours = crd(name);
        // nvdra's one addition: the domain's conditions (the controller's reasons), which
        // NVIDIA's schema would prune.
        if name == api::DOMAIN_CRD {
            let status = ours
                .pointer_mut("/spec/versions/0/schema/openAPIV3Schema/properties/status/properties")
                .and_then(Value::as_object_mut)
                .expect("the domain CRD has status properties");
            assert!(
                status.remove("conditions").is_some(),
                "no status.conditions"
            );
        }
        assert_eq!(
            without_descriptions(&ours["spec"]),
            without_descriptions(&theirs["spec"]),
            "{name}"
        );
        assert_eq!(ours["metadata"]["name"], theirs["metadata"]["name"]);
        assert_eq!(str_at(&ours, "/spec/group"), api::GROUP);
        assert_eq!(str_at(&ours, "/spec/versions/0/name"), api::VERSION);
    }
    // The URL paths and kinds of nvdra's types are the CRDs'.
    use k8s_openapi::Resource;
    let domain = crd(api::DOMAIN_CRD);
    assert_eq!(
        str_at(&domain, "/spec/names/plural"),
        api::ComputeDomain::URL_PATH_SEGMENT
    );
    assert_eq!(
        str_at(&domain, "/spec/names/kind"),
        api::ComputeDomain::KIND
    );
    let clique = crd(api::CLIQUE_CRD);
    assert_eq!(
        str_at(&clique, "/spec/names/plural"),
        api::ComputeDomainClique::URL_PATH_SEGMENT
    );
    assert_eq!(
        str_at(&clique, "/spec/names/kind"),
        api::ComputeDomainClique::KIND
    );
}

// ---------------------------------------------------------------------------------------------
// The component and the chart.

/// The plain overlay with the compute-domains component.
fn with_component(kubectl: &str) -> Vec<Value> {
    with_components(kubectl, &["compute-domains"])
}

/// The plain overlay with these components.
fn with_components(kubectl: &str, components: &[&str]) -> Vec<Value> {
    let tmp = tempfile::tempdir().unwrap();
    let copy = tmp.path().join("manifests");
    copy_tree(&manifests(), &copy);
    let mine = copy.join("overlays/mine");
    std::fs::create_dir_all(&mine).unwrap();
    let list: Vec<String> = components
        .iter()
        .map(|c| format!("../../components/{c}"))
        .collect();
    std::fs::write(
        mine.join("kustomization.yaml"),
        format!("resources: [../plain]\ncomponents: [{}]\n", list.join(", ")),
    )
    .unwrap();
    kustomize(kubectl, &mine)
}

fn helm_template(helm: &str, namespace: &str, args: &[&str]) -> Vec<Value> {
    let docs =
        template(helm, namespace, args).unwrap_or_else(|e| panic!("helm template {args:?}: {e}"));
    assert_typed(&docs, &format!("helm template {args:?}"));
    docs
}

/// Helm's objects are kustomize's (but its Namespace, which the chart leaves to helm), keyed
/// by namespace, kind and name.
fn assert_same_objects(helm: &[Value], kustomize: &[Value]) {
    let key = |d: &Value| format!("{} {}", str_at(d, "/metadata/namespace"), id(d));
    let h: BTreeMap<String, &Value> = helm.iter().map(|d| (key(d), d)).collect();
    let k: BTreeMap<String, &Value> = kustomize
        .iter()
        .filter(|d| str_at(d, "/kind") != "Namespace")
        .map(|d| (key(d), d))
        .collect();
    assert_eq!(
        h.keys().collect::<Vec<_>>(),
        k.keys().collect::<Vec<_>>(),
        "helm and kustomize build other objects"
    );
    for (name, object) in &k {
        assert_eq!(&h[name], object, "{name} (left: helm, right: kustomize)");
    }
}

/// A container's env: each name with its value, or the pod field it comes from.
fn env_of(container: &Value) -> BTreeMap<&str, &str> {
    let entries = container["env"].as_array().expect("the container has env");
    entries
        .iter()
        .map(|e| {
            let v = e
                .pointer("/valueFrom/fieldRef/fieldPath")
                .or(e.get("value"));
            (str_at(e, "/name"), v.and_then(Value::as_str).unwrap_or(""))
        })
        .collect()
}

/// (apiGroup, resource, verb) of the rules of one Role or ClusterRole.
fn rules(role: &Value) -> BTreeSet<(String, String, String)> {
    grants(&[json!({"kind": "ClusterRole", "rules": role["rules"].clone()})])
}

fn set(rows: &[(&str, &str, &[&str])]) -> BTreeSet<(String, String, String)> {
    let mut out = BTreeSet::new();
    for (group, resource, verbs) in rows {
        for v in *verbs {
            out.insert((group.to_string(), resource.to_string(), v.to_string()));
        }
    }
    out
}

const READ: &[&str] = &["get", "list", "watch"];

/// What every build with compute domains on must hold; `ns` the driver's namespace.
fn assert_compute_domains(docs: &[Value], ns: &str, origin: &str) {
    assert_daemonset_contracts(docs, origin);
    // The CRDs, the DeviceClasses with NVIDIA's names and CEL (and the clique pool's class).
    for name in [api::DOMAIN_CRD, api::CLIQUE_CRD] {
        assert_eq!(
            find(docs, "CustomResourceDefinition", name),
            Some(&crd(name)),
            "{origin}"
        );
    }
    for (class, cel) in [
        (api::CHANNEL_CLASS, api::CHANNEL_CLASS_CEL),
        (api::DAEMON_CLASS, api::DAEMON_CLASS_CEL),
        (api::CLIQUE_CHANNEL_CLASS, api::CLIQUE_CHANNEL_CLASS_CEL),
    ] {
        let c = find(docs, "DeviceClass", class).unwrap_or_else(|| panic!("{origin}: {class}"));
        assert_eq!(
            str_at(c, "/spec/selectors/0/cel/expression"),
            cel,
            "{origin}"
        );
    }
    // The plugin: a second container of nvdra's pod, on nvdra's image, with what it reads.
    let ds = find(docs, "DaemonSet", "nvdra").unwrap();
    let image = str_at(container(docs), "/image");
    let containers = ds["spec"]["template"]["spec"]["containers"]
        .as_array()
        .unwrap();
    let plugin = containers
        .iter()
        .find(|c| c["name"] == api::PLUGIN_CONTAINER)
        .unwrap_or_else(|| panic!("{origin}: no {} container", api::PLUGIN_CONTAINER));
    assert_eq!(str_at(plugin, "/image"), image, "{origin}");
    assert_eq!(
        plugin["args"],
        json!(["compute-domain", "plugin"]),
        "{origin}"
    );
    let env = env_of(plugin);
    assert_eq!(env.get("NODE_NAME"), Some(&"spec.nodeName"), "{origin}");
    assert_eq!(env.get("POD_UID"), Some(&"metadata.uid"), "{origin}");
    // NVIDIA's variable: the driver's namespace, where the clique objects are.
    assert_eq!(
        env.get("NAMESPACE"),
        Some(&"metadata.namespace"),
        "{origin}"
    );
    let sc = &plugin["securityContext"];
    assert_eq!(sc["privileged"], false, "{origin}");
    assert_eq!(sc["allowPrivilegeEscalation"], false, "{origin}");
    assert_eq!(sc["capabilities"], json!({"drop": ["ALL"]}), "{origin}");
    assert_eq!(sc["readOnlyRootFilesystem"], true, "{origin}");
    // The host's driver root, read-only at the path its DRIVER_ROOT_CTR_PATH names, the volume
    // the host path its NVIDIA_DRIVER_ROOT names: a daemon claim's base spec (NVIDIA's
    // device=all) lists the node's NVIDIA device nodes under its dev/ and the driver's files
    // there. No NVIDIA_DEV_ROOT: a dev root outside the driver root would be read at the
    // container's own /dev, which has no NVIDIA node (NVIDIA_VISIBLE_DEVICES=void).
    let ctr_path = env.get("DRIVER_ROOT_CTR_PATH").copied();
    assert_eq!(ctr_path, Some(DRIVER_ROOT_CTR_PATH), "{origin}");
    assert!(!env.contains_key("NVIDIA_DEV_ROOT"), "{origin}");
    let driver_root = plugin["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| Some(str_at(m, "/mountPath")) == ctr_path)
        .unwrap_or_else(|| panic!("{origin}: the plugin does not mount the driver root"));
    assert_eq!(driver_root["readOnly"], true, "{origin}: the driver root");
    assert_eq!(
        driver_root["mountPropagation"], "HostToContainer",
        "{origin}: the driver root"
    );
    let volume = ds["spec"]["template"]["spec"]["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == driver_root["name"])
        .unwrap_or_else(|| panic!("{origin}: no volume {}", driver_root["name"]));
    assert_eq!(
        Some(str_at(volume, "/hostPath/path")),
        env.get("NVIDIA_DRIVER_ROOT").copied(),
        "{origin}: the driver root's volume"
    );
    // The kubelet's directories at the paths the GPU container mounts them (same-path mounts);
    // the driver root the GPU container mounts only when it is not / (its toolkit injects it).
    let gpu_mounts: BTreeMap<&str, &str> = container(docs)["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| (str_at(m, "/name"), str_at(m, "/mountPath")))
        .collect();
    for m in plugin["volumeMounts"].as_array().unwrap() {
        let name = str_at(m, "/name");
        if name == str_at(driver_root, "/name") && !gpu_mounts.contains_key(name) {
            continue;
        }
        assert_eq!(
            gpu_mounts.get(name),
            Some(&str_at(m, "/mountPath")),
            "{origin}: {name}"
        );
    }
    for name in ["plugins-registry", "plugins", "cdi"] {
        assert!(
            plugin["volumeMounts"]
                .as_array()
                .unwrap()
                .iter()
                .any(|m| m["name"] == name),
            "{origin}: the plugin does not mount {name}"
        );
    }
    // The controller: its Deployment, on the same image, as its own ServiceAccount.
    let dep = find(docs, "Deployment", api::CONTROLLER_NAME).expect("the controller");
    assert_eq!(str_at(dep, "/metadata/namespace"), ns, "{origin}");
    let pod = &dep["spec"]["template"]["spec"];
    assert_eq!(
        str_at(pod, "/serviceAccountName"),
        api::CONTROLLER_NAME,
        "{origin}"
    );
    let [c] = pod["containers"].as_array().unwrap().as_slice() else {
        panic!("{origin}: one controller container");
    };
    assert_eq!(str_at(c, "/image"), image, "{origin}");
    assert_eq!(
        c["args"],
        json!(["compute-domain", "controller"]),
        "{origin}"
    );
    let env = env_of(c);
    // NVIDIA's variables, which `nvdra compute-domain controller` reads: its identity in the
    // election, its namespace, and the daemons' image, its own.
    assert_eq!(env.get("POD_NAME"), Some(&"metadata.name"), "{origin}");
    assert_eq!(
        env.get("NAMESPACE"),
        Some(&"metadata.namespace"),
        "{origin}"
    );
    assert_eq!(env.get("IMAGE_NAME"), Some(&image), "{origin}");
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true, "{origin}");
    assert_eq!(
        c["securityContext"]["capabilities"],
        json!({"drop": ["ALL"]})
    );
    for namespace in ["hostPID", "hostIPC", "hostNetwork"] {
        assert!(pod.get(namespace).is_none(), "{origin}: {namespace}");
    }
    assert!(
        pod.get("volumes").is_none(),
        "{origin}: the controller mounts nothing"
    );
    // RBAC: each identity, bound to its ServiceAccount, with what it touches.
    let sa = |name: &str| {
        assert!(
            docs.iter()
                .any(|d| id(d) == format!("ServiceAccount/{name}")
                    && str_at(d, "/metadata/namespace") == ns),
            "{origin}: no ServiceAccount {ns}/{name}"
        );
    };
    sa("nvdra");
    sa(api::CONTROLLER_NAME);
    sa(api::DAEMON_SERVICE_ACCOUNT);
    let role = |kind: &str, name: &str, subject: &str| {
        let r = find(docs, kind, name).unwrap_or_else(|| panic!("{origin}: {kind} {name}"));
        let binding_kind = format!("{kind}Binding");
        let b = find(docs, &binding_kind, name)
            .unwrap_or_else(|| panic!("{origin}: {binding_kind} {name}"));
        assert_eq!(str_at(b, "/roleRef/kind"), kind, "{origin}: {name}");
        assert_eq!(str_at(b, "/roleRef/name"), name, "{origin}");
        assert_eq!(
            b["subjects"],
            json!([{"kind": "ServiceAccount", "name": subject, "namespace": ns}]),
            "{origin}: {kind}Binding {name}"
        );
        if kind == "Role" {
            assert_eq!(str_at(r, "/metadata/namespace"), ns, "{origin}: {name}");
            assert_eq!(str_at(b, "/metadata/namespace"), ns, "{origin}: {name}");
        }
        rules(r)
    };
    let cd = "resource.nvidia.com";
    assert_eq!(
        role("ClusterRole", api::PLUGIN_ROLE, "nvdra"),
        set(&[
            (cd, "computedomains", READ),
            ("resource.k8s.io", "resourceclaims", &["list", "watch"]),
            ("", "nodes", &["patch"]),
        ]),
        "{origin}: the plugin"
    );
    assert_eq!(
        role("Role", api::PLUGIN_ROLE, "nvdra"),
        set(&[(cd, "computedomaincliques", READ)]),
        "{origin}: the plugin in its namespace"
    );
    let write = &["get", "list", "watch", "create", "update", "delete"];
    assert_eq!(
        role("ClusterRole", api::CONTROLLER_NAME, api::CONTROLLER_NAME),
        set(&[
            (
                cd,
                "computedomains",
                &["get", "list", "watch", "update", "patch"]
            ),
            (cd, "computedomains/status", &["update", "patch"]),
            ("resource.k8s.io", "resourceclaimtemplates", write),
            ("resource.k8s.io", "resourceclaims", write),
            ("resource.k8s.io", "resourceslices", write),
            ("", "nodes", &["get", "list", "watch", "patch"]),
            ("", "pods", READ),
            ("events.k8s.io", "events", &["create", "patch"]),
        ]),
        "{origin}: the controller"
    );
    assert_eq!(
        role("Role", api::CONTROLLER_NAME, api::CONTROLLER_NAME),
        set(&[
            (
                "apps",
                "daemonsets",
                &[
                    "get", "list", "watch", "create", "update", "patch", "delete"
                ]
            ),
            (
                cd,
                "computedomaincliques",
                &["get", "list", "watch", "update", "delete"]
            ),
            (
                "coordination.k8s.io",
                "leases",
                &["get", "create", "update"]
            ),
            ("", "events", &["list", "watch"]),
        ]),
        "{origin}: the controller in its namespace"
    );
    assert_eq!(
        role(
            "ClusterRole",
            api::DAEMON_SERVICE_ACCOUNT,
            api::DAEMON_SERVICE_ACCOUNT
        ),
        set(&[(cd, "computedomains", READ)]),
        "{origin}: the daemons"
    );
    assert_eq!(
        role(
            "Role",
            api::DAEMON_SERVICE_ACCOUNT,
            api::DAEMON_SERVICE_ACCOUNT
        ),
        set(&[
            (
                cd,
                "computedomaincliques",
                &["get", "list", "watch", "create", "update", "patch"],
            ),
            ("", "events", &["create"]),
            ("", "pods", &["patch"]),
        ]),
        "{origin}: the daemons in their namespace"
    );
    // nvdra's slice and claim-status policies accept the second driver's objects.
    for (policy, index) in [
        ("nvdra-resourceslices", 2),
        ("nvdra-resourceclaim-status", 3),
    ] {
        let vap = find(docs, "ValidatingAdmissionPolicy", policy).unwrap();
        let expression = str_at(vap, &format!("/spec/validations/{index}/expression"));
        assert!(
            expression.contains(&format!("in [variables.driver, \"{}\"]", api::DRIVER_NAME)),
            "{origin}: {policy}: {expression}"
        );
    }
}

/// Nothing of compute domains: the default.
fn assert_no_compute_domains(docs: &[Value], origin: &str) {
    let text = serde_json::to_string(docs).unwrap();
    for name in [
        api::DRIVER_NAME,
        api::GROUP,
        api::CONTROLLER_NAME,
        api::DAEMON_SERVICE_ACCOUNT,
        "compute-domain",
    ] {
        assert!(
            !text.contains(name),
            "{origin}: {name} with compute domains off"
        );
    }
}

#[test]
fn the_component_adds_compute_domains_and_is_off_by_default() {
    let Some(kubectl) = kubectl() else { return };
    let docs = with_component(kubectl);
    assert_compute_domains(&docs, "nvdra", "plain + compute-domains");
    // Nothing else changes but the two policies' driver checks and the added container.
    let plain = overlay(kubectl, "plain");
    for d in &plain {
        let k = id(d);
        if k.starts_with("ValidatingAdmissionPolicy/") || k == "DaemonSet/nvdra" {
            continue;
        }
        assert_eq!(
            docs.iter()
                .find(|o| id(o) == k && o["metadata"]["namespace"] == d["metadata"]["namespace"]),
            Some(d),
            "{k}"
        );
    }
    let mut ds = find(&docs, "DaemonSet", "nvdra").unwrap().clone();
    ds["spec"]["template"]["spec"]["containers"]
        .as_array_mut()
        .unwrap()
        .retain(|c| c["name"] != api::PLUGIN_CONTAINER);
    // And its volume, the host's driver root (the GPU container's toolkit injects the driver).
    ds["spec"]["template"]["spec"]["volumes"]
        .as_array_mut()
        .unwrap()
        .retain(|v| v["name"] != "driver-root");
    assert_eq!(Some(&ds), find(&plain, "DaemonSet", "nvdra"));
    for o in ["plain", "extended-resources", "device-plugin-only"] {
        assert_no_compute_domains(&overlay(kubectl, o), o);
    }
}

#[test]
fn the_chart_renders_the_component_and_is_off_by_default() {
    let (Some(helm), Some(kubectl)) = (helm(), kubectl()) else {
        return;
    };
    let on = helm_template(helm, "nvdra", &["--set", "computeDomains.enabled=true"]);
    assert_same_objects(&on, &with_component(kubectl));
    // In another namespace, everything follows it.
    let elsewhere = helm_template(helm, "gpu", &["--set", "computeDomains.enabled=true"]);
    assert_compute_domains(&elsewhere, "gpu", "helm, namespace gpu");
    // The GPU Operator's driver root: one volume of it, which both containers mount (and the
    // device root only nvdra's, whose toolkit puts the nodes in its own /dev).
    let operator = helm_template(
        helm,
        "nvdra",
        &[
            "--set",
            "computeDomains.enabled=true,driverRoot=/run/nvidia/driver,devRoot=/",
        ],
    );
    assert_compute_domains(&operator, "nvdra", "helm, GPU Operator");
    let ds = find(&operator, "DaemonSet", "nvdra").unwrap();
    let roots: Vec<&str> = ds["spec"]["template"]["spec"]["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|v| v["name"] == "driver-root")
        .map(|v| str_at(v, "/hostPath/path"))
        .collect();
    assert_eq!(roots, ["/run/nvidia/driver"]);
    assert_no_compute_domains(&helm_template(helm, "nvdra", &[]), "helm defaults");
    // Lint, and the value refused beside the device plugin alone or with a typo.
    let lint = Command::new(helm)
        .args(["lint", "--strict"])
        .arg(chart())
        .args(["--set", "computeDomains.enabled=true"])
        .output()
        .unwrap();
    assert!(
        lint.status.success(),
        "{}",
        String::from_utf8_lossy(&lint.stdout)
    );
    for (set, says) in [
        (
            "computeDomains.enabled=true,mode=device-plugin",
            "computeDomains.enabled",
        ),
        ("computeDomains.enable=true", "computeDomains"),
        ("computeDomains.enabled=yes", "computeDomains"),
    ] {
        let out = Command::new(helm)
            .args(["template", "nvdra"])
            .arg(chart())
            .args(["--set", set])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(says), "{set}: {err}");
    }
}

/// The controller container's variables, by name.
fn controller_env(docs: &[Value], origin: &str) -> BTreeMap<String, String> {
    let dep = find(docs, "Deployment", api::CONTROLLER_NAME)
        .unwrap_or_else(|| panic!("{origin}: no controller"));
    dep["spec"]["template"]["spec"]["containers"][0]["env"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            let value = e["value"].as_str().unwrap_or("(from a field)").to_string();
            (str_at(e, "/name").to_string(), value)
        })
        .collect()
}

/// The per-clique IMEX daemons (issue 37 item 5) are opt-in: components/compute-domain-cliques
/// and computeDomains.cliqueChannels turn on the controller's clique pools and per-clique
/// DaemonSets, and change nothing else; off by default in both.
#[test]
fn the_per_clique_daemons_are_opt_in_and_the_same_from_helm_and_kustomize() {
    let Some(kubectl) = kubectl() else { return };
    let off = with_component(kubectl);
    let on = with_components(kubectl, &["compute-domains", "compute-domain-cliques"]);
    let clique_vars = |env: &BTreeMap<String, String>| -> Vec<(String, String)> {
        env.iter()
            .filter(|(k, _)| k.starts_with("CLIQUE_"))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    };
    assert_eq!(clique_vars(&controller_env(&off, "kustomize")), []);
    assert_eq!(
        clique_vars(&controller_env(&on, "kustomize, cliques")),
        [
            ("CLIQUE_CHANNELS".to_string(), "127".to_string()),
            ("CLIQUE_DAEMON_DRIVER_ROOT".to_string(), "/".to_string()),
        ]
    );
    // Nothing else differs: the same objects, the controller's other variables kept.
    assert_eq!(
        off.iter().map(id).collect::<Vec<_>>(),
        on.iter().map(id).collect::<Vec<_>>()
    );
    for d in &off {
        if id(d) != format!("Deployment/{}", api::CONTROLLER_NAME) {
            assert!(on.contains(d), "{}", id(d));
        }
    }
    let mut rest = controller_env(&on, "kustomize, cliques");
    rest.retain(|k, _| !k.starts_with("CLIQUE_"));
    assert_eq!(rest, controller_env(&off, "kustomize"));
    // The component alone (without compute-domains) adds nothing: it only patches the
    // controller.
    let tmp = tempfile::tempdir().unwrap();
    let copy = tmp.path().join("manifests");
    copy_tree(&manifests(), &copy);
    let alone = copy.join("overlays/alone");
    std::fs::create_dir_all(&alone).unwrap();
    std::fs::write(
        alone.join("kustomization.yaml"),
        "resources: [../plain]\ncomponents: [../../components/compute-domain-cliques]\n",
    )
    .unwrap();
    assert_eq!(kustomize(kubectl, &alone), overlay(kubectl, "plain"));

    let Some(helm) = helm() else { return };
    let chart_on = helm_template(
        helm,
        "nvdra",
        &[
            "--set",
            "computeDomains.enabled=true,computeDomains.cliqueChannels=127",
        ],
    );
    assert_same_objects(&chart_on, &on);
    let chart_off = helm_template(helm, "nvdra", &["--set", "computeDomains.enabled=true"]);
    assert_eq!(clique_vars(&controller_env(&chart_off, "helm")), []);
    // The chart's driver root reaches the per-clique daemons.
    let moved = helm_template(
        helm,
        "nvdra",
        &[
            "--set",
            "computeDomains.enabled=true,computeDomains.cliqueChannels=8,driverRoot=/run/nvidia/driver",
        ],
    );
    assert_eq!(
        clique_vars(&controller_env(&moved, "helm, driver root")),
        [
            ("CLIQUE_CHANNELS".to_string(), "8".to_string()),
            (
                "CLIQUE_DAEMON_DRIVER_ROOT".to_string(),
                "/run/nvidia/driver".to_string()
            ),
        ]
    );
    let lint = Command::new(helm)
        .args(["lint", "--strict"])
        .arg(chart())
        .args([
            "--set",
            "computeDomains.enabled=true,computeDomains.cliqueChannels=127",
        ])
        .output()
        .unwrap();
    assert!(
        lint.status.success(),
        "{}",
        String::from_utf8_lossy(&lint.stdout)
    );
    for set in [
        "computeDomains.enabled=true,computeDomains.cliqueChannels=-1",
        "computeDomains.enabled=true,computeDomains.cliqueChannels=2048",
        "computeDomains.enabled=true,computeDomains.cliqueChannels=many",
    ] {
        let out = Command::new(helm)
            .args(["template", "nvdra"])
            .arg(chart())
            .args(["--set", set])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains("cliqueChannels"),
            "{set}: {err}"
        );
    }
}

#[test]
fn every_cel_expression_of_the_component_compiles_in_nvdras_cel() {
    let out = Command::new(env!("CARGO_BIN_EXE_nvdra"))
        .arg("validate")
        .arg("-f")
        .arg(component().join("deviceclasses.yaml"))
        .env_remove("NVDRA_LOG")
        .output()
        .expect("nvdra runs");
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

// ---------------------------------------------------------------------------------------------
// Item 7: NVIDIA's compute-domain half beside nvdra.

#[test]
fn nvdras_chart_shares_nothing_with_nvidias_compute_domain_half() {
    let facts = &documents(
        &read(&data().join("nvidia-chart-objects.yaml")),
        "nvidia-chart-objects.yaml",
    )[0];
    let theirs = facts["objects"].as_array().unwrap();
    assert!(theirs.len() > 15, "{theirs:?}");
    // The values file shipped for NVIDIA's chart sets keys that chart has, GPU half off.
    let values = &documents(
        &read(
            &Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("deployments/nvidia-compute-domains/values.yaml"),
        ),
        "values.yaml",
    )[0];
    let mut set = BTreeMap::new();
    flatten("", values, &mut set);
    let known: BTreeSet<&str> = facts["values"]
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    for k in set.keys() {
        assert!(
            known.contains(k.as_str()),
            "NVIDIA's chart has no value {k}"
        );
    }
    assert_eq!(set.get("resources.gpus.enabled"), Some(&json!(false)));
    assert_eq!(
        set.get("resources.computeDomains.enabled"),
        Some(&json!(true))
    );
    let Some(helm) = helm() else { return };
    // nvdra's chart as it is, in its namespace and in NVIDIA's (the worst case for names).
    for ns in ["nvdra", "dra-driver-nvidia-gpu"] {
        let ours = helm_template(helm, ns, &[]);
        assert_no_compute_domains(&ours, "nvdra's chart as it is");
        for o in &ours {
            let (kind, name) = (str_at(o, "/kind"), str_at(o, "/metadata/name"));
            for t in theirs {
                // Same kind and name collide when cluster-scoped or in one namespace; names
                // are kept apart whatever the namespaces.
                assert!(
                    !(t["kind"] == kind && t["name"] == name),
                    "{kind} {name} is NVIDIA's too"
                );
                // And no object of one kind names the other's (a ServiceAccount, a class).
                assert!(
                    t["name"] != name,
                    "{kind} {name}: NVIDIA has a {} of that name",
                    t["kind"]
                );
            }
        }
        let text = serde_json::to_string(&ours).unwrap();
        for list in ["drivers", "cdiVendors", "kubeletPluginDirs"] {
            for name in facts[list].as_array().unwrap() {
                assert!(!text.contains(name.as_str().unwrap()), "{list}: {name}");
            }
        }
        for lease in facts["leases"].as_array().unwrap() {
            assert!(!text.contains(str_at(lease, "/name")), "{lease}");
        }
        // nvdra's admission policies bind nvdra's own ServiceAccount only, so none of them
        // judges what NVIDIA's plugin or controller writes.
        for vap in ours
            .iter()
            .filter(|d| str_at(d, "/kind") == "ValidatingAdmissionPolicy")
        {
            assert_eq!(
                str_at(vap, "/spec/matchConditions/0/expression"),
                format!("request.userInfo.username == \"system:serviceaccount:{ns}:nvdra\""),
                "{}",
                id(vap)
            );
        }
    }
    // With nvdra's compute domains on, the two collide exactly where the README says to
    // install one or the other: the CRDs, the two NVIDIA DeviceClasses, the driver.
    let on = helm_template(helm, "nvdra", &["--set", "computeDomains.enabled=true"]);
    let mut common: Vec<String> = on
        .iter()
        .filter(|o| {
            theirs
                .iter()
                .any(|t| t["kind"] == o["kind"] && t["name"] == o["metadata"]["name"])
        })
        .map(id)
        .collect();
    common.sort();
    assert_eq!(
        common,
        [
            format!("CustomResourceDefinition/{}", api::CLIQUE_CRD),
            format!("CustomResourceDefinition/{}", api::DOMAIN_CRD),
            format!("DeviceClass/{}", api::DAEMON_CLASS),
            format!("DeviceClass/{}", api::CHANNEL_CLASS),
        ]
    );
}

/// `a.b.c` → value for every leaf of a values file.
fn flatten(prefix: &str, v: &Value, out: &mut BTreeMap<String, Value>) {
    match v {
        Value::Object(m) => {
            for (k, w) in m {
                let key = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                flatten(&key, w, out);
            }
        }
        other => {
            out.insert(prefix.to_string(), other.clone());
        }
    }
}

/// The variables each compute-domain container gets are ones its `nvdra compute-domain`
/// subcommand reads (its `--help` lists `[env: NAME=]`), but for the NVIDIA container toolkit's.
#[test]
fn every_variable_the_containers_get_is_one_nvdra_declares() {
    let Some(kubectl) = kubectl() else { return };
    let mut builds = vec![
        ("kustomize", with_component(kubectl)),
        (
            "kustomize, cliques",
            with_components(kubectl, &["compute-domains", "compute-domain-cliques"]),
        ),
    ];
    if let Some(helm) = helm() {
        let args = [
            "--set",
            "computeDomains.enabled=true,computeDomains.cliqueChannels=4,kubeletRoot=/var/lib/k0s/kubelet",
        ];
        builds.push(("helm, k0s", helm_template(helm, "gpu", &args)));
    }
    for (origin, docs) in builds {
        let ds = find(&docs, "DaemonSet", "nvdra").unwrap();
        let plugin = ds["spec"]["template"]["spec"]["containers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["name"] == api::PLUGIN_CONTAINER)
            .unwrap();
        let dep = find(&docs, "Deployment", api::CONTROLLER_NAME).unwrap();
        let controller = &dep["spec"]["template"]["spec"]["containers"][0];
        for (sub, c) in [("plugin", plugin), ("controller", controller)] {
            let out = Command::new(env!("CARGO_BIN_EXE_nvdra"))
                .args(["compute-domain", sub, "--help"])
                .output()
                .expect("nvdra runs");
            let help = String::from_utf8_lossy(&out.stdout);
            assert!(out.status.success(), "nvdra compute-domain {sub} --help");
            let mut checked = 0;
            for e in c["env"].as_array().unwrap() {
                let name = str_at(e, "/name");
                if name.starts_with("NVIDIA_") {
                    continue;
                }
                assert!(
                    help.contains(&format!("[env: {name}=")),
                    "{origin}: the {sub} gets {name}, which `nvdra compute-domain {sub}` does not read"
                );
                checked += 1;
            }
            assert!(checked >= 3, "{origin}: {sub}: {checked}");
        }
        // The kubelet's root where the chart moves it, for the plugin too.
        if origin.starts_with("helm") {
            let root = plugin["env"]
                .as_array()
                .unwrap()
                .iter()
                .find(|e| e["name"] == "KUBELET_ROOT")
                .map(|e| str_at(e, "/value"));
            assert_eq!(root, Some("/var/lib/k0s/kubelet"), "{origin}");
            assert!(
                plugin["volumeMounts"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|m| m["mountPath"] == "/var/lib/k0s/kubelet/plugins"),
                "{origin}"
            );
        }
    }
}

/// The admission request the API server builds for nvdra's plugin on `node` (its pod-bound token).
fn nvdra_request(node: &str, operation: &str, resource: (&str, &str, &str)) -> Value {
    let (group, resource, sub) = resource;
    json!({
        "operation": operation,
        "resource": {"group": group, "version": "v1", "resource": resource},
        "subResource": sub,
        "userInfo": {
            "username": "system:serviceaccount:nvdra:nvdra",
            "groups": ["system:serviceaccounts"],
            "extra": {"authentication.kubernetes.io/node-name": [node]},
        },
    })
}

/// Whether `policy` allows each sample (Google's CEL, `tests/support/vap.py`).
fn allows(policy: &Value, samples: &[Value]) -> Vec<bool> {
    let input = json!({"policy": policy, "requests": samples}).to_string();
    let out = support::python::json_of(
        include_str!("../support/vap.py"),
        &[],
        &input,
        "the CEL evaluator",
    );
    out.as_array()
        .unwrap()
        .iter()
        .map(|a| {
            assert_eq!(a["matched"], true, "{a}");
            a["allowed"] == true
        })
        .collect()
}

/// nvdra's admission policies let the compute-domain plugin (nvdra's ServiceAccount) write what
/// it writes, with the component and not without: its node's slices of its driver, its entries
/// in the status of claims allocated on its node, and its two labels on its own Node (with the
/// node-labels component's policy too). Still not another node's, nor a third driver's.
#[test]
fn nvdras_policies_admit_the_compute_domain_plugins_writes() {
    let Some(kubectl) = kubectl() else { return };
    if !have_checkers() {
        return;
    }
    let plain = overlay(kubectl, "plain");
    let on = with_component(kubectl);
    let slice = |node: &str, driver: &str| {
        json!({"request": nvdra_request("node-a", "CREATE", ("resource.k8s.io", "resourceslices", "")),
               "object": {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
                          "metadata": {"name": "s"},
                          "spec": {"driver": driver, "nodeName": node, "devices": [],
                                   "pool": {"name": node, "generation": 1, "resourceSliceCount": 1}}}})
    };
    let slices = [
        slice("node-a", api::DRIVER_NAME),
        slice("node-a", "gpu.nvidia.com"),
        slice("node-b", api::DRIVER_NAME),
        slice("node-a", "other.example.com"),
    ];
    let policy = |docs: &[Value], name: &str| {
        find(docs, "ValidatingAdmissionPolicy", name)
            .unwrap_or_else(|| panic!("{name}"))
            .clone()
    };
    assert_eq!(
        allows(&policy(&on, "nvdra-resourceslices"), &slices),
        [true, true, false, false]
    );
    assert_eq!(
        allows(&policy(&plain, "nvdra-resourceslices"), &slices),
        [false, true, false, false]
    );
    let claim = |devices: Value| {
        json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
               "metadata": {"name": "c", "namespace": "team"},
               "status": {"allocation": {"nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                   {"key": "metadata.name", "operator": "In", "values": ["node-a"]}]}]}},
                          "devices": devices}})
    };
    let entry = |driver: &str| json!({"driver": driver, "pool": "node-a", "device": "channel-0"});
    let status = |driver: &str| {
        json!({"request": nvdra_request("node-a", "UPDATE", ("resource.k8s.io", "resourceclaims", "status")),
               "object": claim(json!([entry(driver)])), "oldObject": claim(json!([]))})
    };
    let statuses = [status(api::DRIVER_NAME), status("other.example.com")];
    assert_eq!(
        allows(&policy(&on, "nvdra-resourceclaim-status"), &statuses),
        [true, false]
    );
    assert_eq!(
        allows(&policy(&plain, "nvdra-resourceclaim-status"), &statuses),
        [false, false]
    );
    // The node label NVIDIA's plugin sets, and the clique label, pass the node-labels policy.
    let labels = documents(
        &read(&manifests().join("components/node-labels/admission.yaml")),
        "node-labels/admission.yaml",
    );
    let node = |labels: Value| {
        json!({"apiVersion": "v1", "kind": "Node",
               "metadata": {"name": "node-a", "labels": labels}, "spec": {}})
    };
    let old = node(json!({"kubernetes.io/hostname": "node-a"}));
    let update = |labels: Value| {
        json!({"request": nvdra_request("node-a", "UPDATE", ("", "nodes", "")),
               "object": node(labels), "oldObject": old.clone()})
    };
    assert_eq!(
        allows(
            &policy(&labels, "nvdra-node-labels"),
            &[
                update(json!({"kubernetes.io/hostname": "node-a", api::NODE_LABEL: "uid-1"})),
                update(json!({"kubernetes.io/hostname": "node-a", api::CLIQUE_LABEL: "c.1"})),
                update(
                    json!({"kubernetes.io/hostname": "node-a", "resource.nvidia.com/other": "x"})
                ),
            ]
        ),
        [true, true, false]
    );
}
