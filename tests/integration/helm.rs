//! The Helm chart (`deployments/helm/nvdra`), rendered by helm itself and held to the Kustomize
//! base, which stays the one source of truth:
//!
//! - `helm lint --strict` passes, with the default values and with every value set.
//! - `helm template` with the default values renders the objects of `kubectl kustomize
//!   manifests/overlays/plain`, object for object, but for the Namespace, and each switch the
//!   objects of its overlay (`mode: device-plugin`, `extendedResources`, `nodeLabels`).
//!   The Namespace is the one exception, on purpose: a Kustomize build is applied as it is, so the
//!   base must carry its Namespace, but a Helm release owns every object its chart renders, and
//!   `helm uninstall` would delete the namespace with whatever else lives in it. The chart leaves
//!   it to `helm install --create-namespace`, as Helm's docs and NVIDIA's charts do, and renders it
//!   only with `createNamespace: true` (for `helm template | kubectl apply`), which then equals the
//!   base's in full.
//! - With every value set, the objects still pass the manifest checks (typed round trip with no
//!   unknown field, the DaemonSet's contracts: no privileged container, no host PID/IPC
//!   namespace, same-path kubelet mounts; the MPS host's contracts: the host PID namespace, no
//!   privileged container, with the plugin's image, nodes and driver root; RBAC no wider than
//!   the base's and the node-labels rule; the admission policy
//!   naming the release's service account), every value lands where it should, every flag and
//!   variable the chart renders is one `nvdra run` declares, and nvdra reads the device-plugin
//!   config the chart writes.
//! - Bad values are refused with the value's name (the chart's values.schema.json).
//!
//! helm is the genuine binary `.ci/helm` installs. Without helm (or kubectl) these tests skip,
//! unless `NVDRA_REQUIRE_HELM=1` (or `NVDRA_REQUIRE_KUBECTL=1`), which `.ci/run` sets.

use crate::support;

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;

use serde_json::Value;
use support::manifests::*;

/// The objects keyed by what the API server keys them by.
fn by_key(docs: &[Value], origin: &str) -> BTreeMap<String, Value> {
    let mut out = BTreeMap::new();
    for d in docs {
        let key = format!(
            "{} {} {}/{}",
            str_at(d, "/apiVersion"),
            str_at(d, "/kind"),
            str_at(d, "/metadata/namespace"),
            str_at(d, "/metadata/name")
        );
        assert!(
            out.insert(key.clone(), d.clone()).is_none(),
            "{origin}: {key} twice"
        );
    }
    out
}

/// The two builds hold the same objects, each equal field for field.
fn assert_same_objects(helm: &[Value], kustomize: &[Value], origin: &str) {
    let (h, k) = (by_key(helm, "helm"), by_key(kustomize, "kustomize"));
    let only_helm: Vec<_> = h.keys().filter(|key| !k.contains_key(*key)).collect();
    let only_kustomize: Vec<_> = k.keys().filter(|key| !h.contains_key(*key)).collect();
    assert!(
        only_helm.is_empty() && only_kustomize.is_empty(),
        "{origin}: only helm renders {only_helm:?}; only kustomize builds {only_kustomize:?}"
    );
    for (key, object) in &k {
        assert_eq!(
            &h[key], object,
            "{origin}: {key} differs (left: helm, right: kustomize)"
        );
    }
    assert!(!k.is_empty());
}

/// A Kustomize build less its Namespace (`nvdra`), which it must have: what the chart renders by
/// default (see the module doc for why the two differ there).
fn without_namespace(mut kustomized: Vec<Value>) -> Vec<Value> {
    let before = kustomized.len();
    kustomized.retain(|d| str_at(d, "/kind") != "Namespace");
    assert_eq!(
        before - kustomized.len(),
        1,
        "the Kustomize build has one Namespace"
    );
    kustomized
}

/// `kubectl kustomize` of the plain overlay with a component added, in a copy of manifests/
/// (kustomize reads nothing outside the tree it builds).
fn plain_with_component(kubectl: &str, component: &str) -> Vec<Value> {
    let tmp = tempfile::tempdir().unwrap();
    let copy = tmp.path().join("manifests");
    copy_tree(&manifests(), &copy);
    let mine = copy.join("overlays/mine");
    std::fs::create_dir_all(&mine).unwrap();
    std::fs::write(
        mine.join("kustomization.yaml"),
        format!("resources: [../plain]\ncomponents: [../../components/{component}]\n"),
    )
    .unwrap();
    kustomize(kubectl, &mine)
}

#[test]
fn the_default_values_render_the_kustomize_base_object_for_object() {
    let (Some(helm), Some(kubectl)) = (helm(), kubectl()) else {
        return;
    };
    let rendered = template(helm, "nvdra", &[]).unwrap();
    assert_typed(&rendered, "helm template (defaults)");
    // Held by helm's own rendering too, not only through the comparison below.
    assert_daemonset_contracts(&rendered, "helm template (defaults)");
    assert_mps_host_contracts(&rendered, "helm template (defaults)");
    // The one exception (see the module doc): the release must not own its namespace, so the
    // default chart has no Namespace, while the Kustomize base, applied as it is, carries one.
    assert!(
        !rendered.iter().any(|d| str_at(d, "/kind") == "Namespace"),
        "the default chart renders a Namespace: the release would own it"
    );
    assert_same_objects(
        &rendered,
        &without_namespace(overlay(kubectl, "plain")),
        "defaults",
    );
    // The image by the chart's appVersion, which is nvdra's version; no SYS_ADMIN.
    let app_version = read(&chart().join("Chart.yaml"))
        .lines()
        .find_map(|l| l.strip_prefix("appVersion: "))
        .map(|v| v.trim_matches('"').to_string())
        .expect("Chart.yaml has an appVersion");
    assert_eq!(app_version, env!("CARGO_PKG_VERSION"));
    let (_, tag, digest) = assert_image(&rendered, "defaults");
    assert_eq!((tag, digest), (app_version, None));
    assert!(!mig_and_shares(&rendered, "defaults"));
    // Shares turn on what they need by themselves.
    for set in ["sharedCapacity=true", "consumableShares=4"] {
        let docs = template(helm, "nvdra", &["--set", set]).unwrap();
        assert!(mig_and_shares(&docs, set), "{set}");
    }
    // What the comparison covers: the whole base, every kind of object, the Namespace alone
    // left out.
    let kinds: BTreeSet<&str> = rendered.iter().map(|d| str_at(d, "/kind")).collect();
    for kind in [
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "DaemonSet",
        "DeviceClass",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    ] {
        assert!(
            kinds.contains(kind),
            "the defaults render no {kind}: {kinds:?}"
        );
    }
}

#[test]
fn create_namespace_renders_the_base_namespace_too() {
    let (Some(helm), Some(kubectl)) = (helm(), kubectl()) else {
        return;
    };
    let rendered = template(helm, "nvdra", &["--set", "createNamespace=true"]).unwrap();
    assert_typed(&rendered, "createNamespace=true");
    assert_same_objects(
        &rendered,
        &overlay(kubectl, "plain"),
        "createNamespace=true",
    );
    assert!(find(&rendered, "Namespace", "nvdra").is_some());
}

#[test]
fn each_switch_renders_its_overlay_object_for_object() {
    let (Some(helm), Some(kubectl)) = (helm(), kubectl()) else {
        return;
    };
    let cases = [
        ("mode=device-plugin", overlay(kubectl, "device-plugin-only")),
        (
            "extendedResources=true",
            overlay(kubectl, "extended-resources"),
        ),
        (
            "nodeLabels=true",
            plain_with_component(kubectl, "node-labels"),
        ),
        (
            "migAndShares=true",
            plain_with_component(kubectl, "mig-and-shares"),
        ),
        (
            "metrics.networkPolicy.enabled=true",
            plain_with_component(kubectl, "metrics-network-policy"),
        ),
    ]
    .map(|(set, kustomized)| (set, without_namespace(kustomized)));
    for (set, kustomized) in cases {
        let rendered = template(helm, "nvdra", &["--set", set]).unwrap();
        assert_typed(&rendered, set);
        assert_daemonset_contracts(&rendered, set);
        assert_same_objects(&rendered, &kustomized, set);
    }
}

#[test]
fn helm_lints_the_chart_strictly() {
    let Some(helm) = helm() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let values = tmp.path().join("values.yaml");
    std::fs::write(&values, EVERY_VALUE).unwrap();
    for extra in [vec![], vec!["-f".to_string(), values.display().to_string()]] {
        let out = Command::new(helm)
            .args(["lint", "--strict"])
            .arg(chart())
            .args(&extra)
            .output()
            .expect("helm runs");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "helm lint --strict {extra:?}:\n{text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(text.contains("0 chart(s) failed"), "{text}");
    }
}

/// Every value of values.yaml set to something other than its default.
const EVERY_VALUE: &str = r#"
image:
  repository: registry.example.com/nvdra
  tag: v0.1.0
  digest: sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef
  pullPolicy: IfNotPresent
createNamespace: true
mode: both
extendedResources: true
nodeLabels: true
computeDomains: {enabled: true}
sharedCapacity: true
consumableShares: memory
devicePluginConfig:
  flags: {migStrategy: single, plugin: {deviceListStrategy: cdi-cri}}
sharing:
  timeSlicing:
    resources: [{name: nvidia.com/gpu, replicas: 4}]
kubeletRoot: /var/lib/k0s/kubelet
driverRoot: /run/nvidia/driver
devRoot: /
priorityClassName: gpu-agents
nodeSelector: {nvidia.com/gpu.present: "true", pool: gpu}
tolerations: [{operator: Exists}]
affinity:
  nodeAffinity:
    requiredDuringSchedulingIgnoredDuringExecution:
      nodeSelectorTerms: [{matchExpressions: [{key: pool, operator: In, values: [gpu]}]}]
resources:
  requests: {cpu: 20m, memory: 48Mi}
  limits: {memory: 256Mi}
migAndShares: true
metrics:
  serviceMonitor: {enabled: true, interval: 15s, labels: {release: prometheus}}
  networkPolicy:
    enabled: true
    from:
      - {namespaceSelector: {matchLabels: {team: obs}}, podSelector: {matchLabels: {app: vm}}}
      - ipBlock: {cidr: 10.0.0.0/16}
"#;

fn every_value(helm: &str) -> Vec<Value> {
    let tmp = tempfile::tempdir().unwrap();
    let values = tmp.path().join("values.yaml");
    std::fs::write(&values, EVERY_VALUE).unwrap();
    template(helm, "gpu-system", &["-f", values.to_str().unwrap()]).unwrap()
}

fn strings(v: &Value) -> Vec<&str> {
    v.as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect()
}

fn env<'a>(c: &'a Value, name: &str) -> Option<&'a str> {
    c["env"]
        .as_array()?
        .iter()
        .find(|e| e["name"] == name)
        .and_then(|e| e["value"].as_str())
}

#[test]
fn every_value_lands_where_it_should_and_keeps_the_contracts() {
    let Some(helm) = helm() else { return };
    let docs = every_value(helm);
    let origin = "every value";
    // The ServiceMonitor is a custom resource k8s-openapi has no type for: checked below.
    let (monitors, core): (Vec<Value>, Vec<Value>) = docs
        .iter()
        .cloned()
        .partition(|d| str_at(d, "/kind") == "ServiceMonitor");
    assert_typed(&core, origin);
    assert_daemonset_contracts(&docs, origin);
    assert_mps_host_contracts(&docs, origin);
    // The release's Namespace, asked for; everything namespaced is in it.
    assert!(find(&docs, "Namespace", "gpu-system").is_some());
    for d in &docs {
        let ns = str_at(d, "/metadata/namespace");
        assert!(ns.is_empty() || ns == "gpu-system", "{}: {ns}", id(d));
    }
    // RBAC: the base's rules and the node-labels rule, nothing more.
    let mut allowed = grants(&documents(
        &read(&manifests().join("base/rbac.yaml")),
        "base/rbac.yaml",
    ));
    allowed.extend(grants(&documents(
        &read(&manifests().join("components/node-labels/rbac.yaml")),
        "node-labels/rbac.yaml",
    )));
    // And the compute-domain plugin's, controller's and daemons' (tests/integration/cd_manifests.rs
    // holds each to what it touches).
    allowed.extend(grants(&documents(
        &read(&manifests().join("components/compute-domains/rbac.yaml")),
        "compute-domains/rbac.yaml",
    )));
    assert_eq!(grants(&docs), allowed);
    let vap = find(&docs, "ValidatingAdmissionPolicy", "nvdra-resourceslices").unwrap();
    assert!(
        str_at(vap, "/spec/matchConditions/0/expression")
            .ends_with("== \"system:serviceaccount:gpu-system:nvdra\"")
    );
    let class = find(&docs, "DeviceClass", "gpu.nvidia.com").unwrap();
    assert_eq!(
        str_at(class, "/spec/extendedResourceName"),
        "nvidia.com/gpu"
    );

    let ds = find(&docs, "DaemonSet", "nvdra").unwrap();
    let pod = &ds["spec"]["template"]["spec"];
    let c = container(&docs);
    assert_eq!(
        c["image"],
        "registry.example.com/nvdra:v0.1.0@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
    );
    assert!(mig_and_shares(&docs, origin));
    // Every node-labels object the chart renders names the release's service account.
    let labels_vap = find(&docs, "ValidatingAdmissionPolicy", "nvdra-node-labels").unwrap();
    assert!(
        str_at(labels_vap, "/spec/matchConditions/0/expression")
            .ends_with("== \"system:serviceaccount:gpu-system:nvdra\"")
    );
    // The Namespace with its Pod Security level.
    assert_eq!(
        str_at(
            find(&docs, "Namespace", "gpu-system").unwrap(),
            "/metadata/labels/pod-security.kubernetes.io~1enforce"
        ),
        "privileged"
    );
    // The NetworkPolicy: the given peers, on the metrics port, in the release's namespace.
    let np = find(&docs, "NetworkPolicy", "nvdra-metrics").unwrap();
    assert_eq!(str_at(np, "/metadata/namespace"), "gpu-system");
    let rule = &np["spec"]["ingress"][0];
    assert_eq!(rule["from"][1]["ipBlock"]["cidr"], "10.0.0.0/16");
    assert_eq!(rule["from"][0]["podSelector"]["matchLabels"]["app"], "vm");
    assert_eq!(rule["ports"][0]["port"], "metrics");
    assert_eq!(c["imagePullPolicy"], "IfNotPresent");
    assert_eq!(
        strings(&c["args"]),
        [
            "run",
            "--mode",
            "both",
            "--kubelet-root",
            "/var/lib/k0s/kubelet",
            "--device-plugin-config",
            "/etc/nvdra/device-plugin/config.yaml",
            "--shared-capacity"
        ]
    );
    assert_eq!(env(c, "NVDRA_NODE_LABELS"), Some("true"));
    assert_eq!(env(c, "CONSUMABLE_SHARES"), Some("memory"));
    assert_eq!(env(c, "NVIDIA_DRIVER_ROOT"), Some("/run/nvidia/driver"));
    assert_eq!(env(c, "DRIVER_ROOT_CTR_PATH"), Some(DRIVER_ROOT_CTR_PATH));
    assert_eq!(env(c, "NVIDIA_DEV_ROOT"), Some("/"));
    assert_eq!(pod["priorityClassName"], "gpu-agents");
    assert_eq!(pod["nodeSelector"]["pool"], "gpu");
    assert_eq!(
        pod["tolerations"],
        serde_json::json!([{"operator": "Exists"}])
    );
    assert_eq!(
        pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
            [0]["matchExpressions"][0]["key"],
        "pool"
    );
    assert_eq!(c["resources"]["limits"]["memory"], "256Mi");
    // Volumes: the kubelet's directories under its root, the driver root, the config.
    let volumes: BTreeMap<&str, &Value> = pod["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| (str_at(v, "/name"), v))
        .collect();
    let mounts: BTreeMap<&str, &Value> = c["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| (str_at(m, "/name"), m))
        .collect();
    assert_eq!(
        volumes.keys().collect::<BTreeSet<_>>(),
        mounts.keys().collect::<BTreeSet<_>>()
    );
    for dir in ["plugins_registry", "plugins", "device-plugins"] {
        let path = format!("/var/lib/k0s/kubelet/{dir}");
        assert!(
            volumes
                .values()
                .any(|v| str_at(v, "/hostPath/path") == path),
            "{path}"
        );
    }
    assert_eq!(
        str_at(volumes["driver-root"], "/hostPath/path"),
        "/run/nvidia/driver"
    );
    assert_eq!(
        str_at(mounts["driver-root"], "/mountPath"),
        DRIVER_ROOT_CTR_PATH
    );
    assert_eq!(
        str_at(volumes["device-plugin-config"], "/configMap/name"),
        "nvdra-device-plugin"
    );
    assert_eq!(
        str_at(mounts["device-plugin-config"], "/mountPath"),
        "/etc/nvdra/device-plugin"
    );
    // The config, and a new one rolls the pods.
    let cm = find(&docs, "ConfigMap", "nvdra-device-plugin").unwrap();
    let config = str_at(cm, "/data/config.yaml");
    assert!(config.contains("replicas: 4"), "{config}");
    let checksum = str_at(
        ds,
        "/spec/template/metadata/annotations/checksum~1device-plugin-config",
    );
    assert_eq!(checksum.len(), 64, "{checksum:?}");

    // The MPS host: the same image, nodes and driver root as the plugin.
    let host = find(&docs, "DaemonSet", "nvdra-mps-host").unwrap();
    let host_pod = &host["spec"]["template"]["spec"];
    let hc = &host_pod["containers"][0];
    assert_eq!(hc["image"], c["image"]);
    assert_eq!(hc["imagePullPolicy"], "IfNotPresent");
    assert_eq!(host_pod["nodeSelector"], pod["nodeSelector"]);
    assert_eq!(host_pod["tolerations"], pod["tolerations"]);
    assert_eq!(host_pod["affinity"], pod["affinity"]);
    assert_eq!(env(hc, "NVIDIA_DRIVER_ROOT"), Some("/run/nvidia/driver"));
    assert_eq!(env(hc, "DRIVER_ROOT_CTR_PATH"), Some(DRIVER_ROOT_CTR_PATH));
    let host_mount = hc["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["name"] == "driver-root")
        .expect("the driver root in the MPS host");
    assert_eq!(str_at(host_mount, "/mountPath"), DRIVER_ROOT_CTR_PATH);
    assert_eq!(host_mount["readOnly"], true);

    // The ServiceMonitor scrapes the Service, which selects the pods by their metrics port.
    let [monitor] = monitors.as_slice() else {
        panic!("{} ServiceMonitors", monitors.len())
    };
    assert_eq!(str_at(monitor, "/apiVersion"), "monitoring.coreos.com/v1");
    assert_eq!(str_at(monitor, "/metadata/labels/release"), "prometheus");
    let service = find(&docs, "Service", "nvdra-metrics").unwrap();
    let labels = &service["metadata"]["labels"];
    for (k, v) in monitor["spec"]["selector"]["matchLabels"]
        .as_object()
        .unwrap()
    {
        assert_eq!(
            &labels[k], v,
            "the monitor's selector misses the Service: {k}"
        );
    }
    assert_eq!(
        strings(&monitor["spec"]["namespaceSelector"]["matchNames"]),
        ["gpu-system"]
    );
    let endpoint = &monitor["spec"]["endpoints"][0];
    assert_eq!(endpoint["path"], "/metrics");
    assert_eq!(endpoint["interval"], "15s");
    let port = &service["spec"]["ports"][0];
    assert_eq!(endpoint["port"], port["name"]);
    assert_eq!(port["targetPort"], "metrics");
    let pod_labels = &ds["spec"]["template"]["metadata"]["labels"];
    for (k, v) in service["spec"]["selector"].as_object().unwrap() {
        assert_eq!(
            &pod_labels[k], v,
            "the Service does not select the pods: {k}"
        );
    }
}

/// Variables the chart sets for the NVIDIA container toolkit and glibc, not for nvdra.
const NOT_NVDRA: &[&str] = &[
    "NVIDIA_VISIBLE_DEVICES",
    "NVIDIA_DRIVER_CAPABILITIES",
    "NVIDIA_MIG_CONFIG_DEVICES",
    "NVIDIA_MIG_MONITOR_DEVICES",
    "GLIBC_TUNABLES",
];

#[test]
fn every_flag_and_variable_the_chart_renders_is_one_nvdra_run_declares() {
    let Some(helm) = helm() else { return };
    let out = Command::new(env!("CARGO_BIN_EXE_nvdra"))
        .args(["run", "--help"])
        .output()
        .expect("nvdra runs");
    let help = String::from_utf8(out.stdout).unwrap();
    let words: BTreeSet<&str> = help
        .split(|c: char| c.is_whitespace() || matches!(c, '[' | ']' | '=' | ','))
        .collect();
    let declared = |name: &str| {
        if name.starts_with("--") {
            words.contains(name)
        } else {
            help.contains(&format!("[env: {name}="))
        }
    };
    let mut checked = 0;
    let trust = template(
        helm,
        "nvdra",
        &[
            "--set",
            "mode=dra,shareTrustDomain=label:example.com/tenant",
        ],
    )
    .unwrap();
    for docs in [
        every_value(helm),
        template(helm, "nvdra", &[]).unwrap(),
        trust,
    ] {
        let c = container(&docs);
        let args = strings(&c["args"]);
        assert_eq!(args[0], "run");
        let flags = args.iter().filter(|a| a.starts_with("--")).copied();
        let vars = c["env"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| str_at(e, "/name"))
            .filter(|n| !NOT_NVDRA.contains(n));
        for name in flags.chain(vars) {
            assert!(
                declared(name),
                "the chart renders {name}, which nvdra run does not declare"
            );
            checked += 1;
        }
    }
    assert!(checked >= 12, "only {checked} names checked");
}

/// `shareTrustDomain` reaches nvdra as the variable it reads, and only when set: off renders
/// nothing, and nvdra run accepts what the chart writes (a rule it refuses fails its check).
#[test]
fn the_share_trust_domain_is_rendered_only_when_set_and_nvdra_accepts_it() {
    let Some(helm) = helm() else { return };
    for (set, want) in [
        ("shareTrustDomain=", None),
        ("shareTrustDomain=off", None),
        ("shareTrustDomain=namespace", Some("namespace")),
        (
            "shareTrustDomain=label:example.com/tenant",
            Some("label:example.com/tenant"),
        ),
    ] {
        let docs = template(helm, "nvdra", &["--set", set]).unwrap();
        let c = container(&docs);
        assert_eq!(env(c, "NVDRA_SHARE_TRUST_DOMAIN"), want, "{set}");
        let Some(rule) = want else { continue };
        // nvdra reads it as the chart wrote it (`nvdra match` takes the rule from the same
        // variable as `nvdra run`); the value the schema lets through but nvdra refuses
        // would exit 64 here.
        let example = manifests().join("examples/one-gpu.yaml");
        let out = Command::new(env!("CARGO_BIN_EXE_nvdra"))
            .args(["match", "--profile", "dgx-h100", "-f"])
            .arg(&example)
            .env("NVDRA_SHARE_TRUST_DOMAIN", rule)
            .output()
            .expect("nvdra runs");
        assert!(
            out.status.success(),
            "{set}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // The check above can fail: a rule nvdra refuses.
    let out = Command::new(env!("CARGO_BIN_EXE_nvdra"))
        .args(["match", "--profile", "dgx-h100", "-f"])
        .arg(manifests().join("examples/one-gpu.yaml"))
        .env("NVDRA_SHARE_TRUST_DOMAIN", "tenant")
        .output()
        .expect("nvdra runs");
    assert_eq!(out.status.code(), Some(64));
}

#[test]
fn nvdra_reads_the_device_plugin_config_the_chart_writes() {
    let Some(helm) = helm() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let check = |sets: &[&str]| {
        let mut args = vec!["--set", "mode=device-plugin"];
        for s in sets {
            args.extend(["--set", s]);
        }
        let docs = template(helm, "nvdra", &args).unwrap();
        let cm = find(&docs, "ConfigMap", "nvdra-device-plugin").expect("the config");
        let file = tmp.path().join("config.yaml");
        std::fs::write(&file, str_at(cm, "/data/config.yaml")).unwrap();
        Command::new(env!("CARGO_BIN_EXE_nvdra"))
            .args(["inventory", "--profile", "dgx-a100", "-o", "paths"])
            .args(["--mode", "device-plugin", "--device-plugin-config"])
            .arg(&file)
            .env_remove("NVDRA_LOG")
            .output()
            .expect("nvdra runs")
    };
    let replicas = "sharing.timeSlicing.resources[0].replicas";
    let name = "sharing.timeSlicing.resources[0].name=nvidia.com/gpu";
    let good = check(&[
        name,
        &format!("{replicas}=4"),
        "devicePluginConfig.flags.migStrategy=none",
    ]);
    assert!(
        good.status.success(),
        "{}",
        String::from_utf8_lossy(&good.stderr)
    );
    // nvdra reads what the chart wrote: a value it refuses is refused through the chart too.
    let bad = check(&[name, &format!("{replicas}=1")]);
    assert!(!bad.status.success());
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(err.contains(replicas), "{err}");
}

#[test]
fn bad_values_are_refused_naming_the_value() {
    let Some(helm) = helm() else { return };
    for (set, names) in [
        ("mode=dra-only", "/mode"),
        ("kubeletRoot=var/lib/kubelet", "/kubeletRoot"),
        ("driverRoot=run/nvidia/driver", "/driverRoot"),
        ("sharedCapacity=yes", "/sharedCapacity"),
        ("consumableShares=some", "/consumableShares"),
        ("consumableShares=49", "/consumableShares"),
        (
            "metrics.serviceMonitor.interval=soon",
            "/metrics/serviceMonitor/interval",
        ),
        ("sharing.timeslicing.replicas=2", "timeslicing"),
        (
            "devicePluginConfigMap=mine,sharing.mps.resources=x",
            "devicePluginConfigMap",
        ),
        (
            "sharing.mps.resources=x,devicePluginConfig.sharing.mps.resources=y",
            "devicePluginConfig.sharing, not both",
        ),
        ("image.tag=latest", "/image/tag"),
        ("image.tag=v1:x", "/image/tag"),
        ("image.digest=sha256:abc", "/image/digest"),
        ("image.digest=latest", "/image/digest"),
        (
            "metrics.networkPolicy.from[0].ipBlock.except[0]=x",
            "/metrics/networkPolicy/from/0/ipBlock",
        ),
        ("imageTag=v1", "imageTag"),
        ("shareTrustDomain=tenant", "/shareTrustDomain"),
        ("shareTrustDomain=label:a/b/c", "/shareTrustDomain"),
        // The device plugin's replicas name no namespace: nvdra would refuse to start.
        (
            "shareTrustDomain=namespace,sharing.timeSlicing.resources[0].replicas=2",
            "shareTrustDomain: the device plugin's shares",
        ),
    ] {
        let err = template(helm, "nvdra", &["--set", set]).expect_err(set);
        assert!(err.contains(names), "--set {set}: {err}");
    }
    // resource.k8s.io/v1 (DeviceClasses, ResourceSlices) is served from Kubernetes 1.34 on.
    let err = template(helm, "nvdra", &["--kube-version", "1.33.5"]).unwrap_err();
    assert!(err.contains("kubeVersion"), "{err}");
    template(helm, "nvdra", &["--kube-version", "1.34.0"]).unwrap();
}
