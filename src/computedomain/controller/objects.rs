//! What the controller creates for a domain, as pure functions of the domain and the settings:
//! NVIDIA's objects with NVIDIA's names and labels (its `templates/compute-domain-*.tmpl.yaml`),
//! so that a cluster can move between NVIDIA's controller and nvdra's, and, for a domain that
//! opts in to clique channels, the one ResourceClaim all its pods share.
//!
//! - the workload ResourceClaimTemplate: in the domain's namespace, named by
//!   `spec.channel.resourceClaimTemplate.name`, class [`CHANNEL_CLASS`], opaque
//!   `ComputeDomainChannelConfig` (`domainID` = the domain's UID, `allocationMode`);
//! - the daemon ResourceClaimTemplate and the DaemonSet, both `computedomain-daemon-<UID>` in
//!   the driver's namespace; the DaemonSet's pods go to the nodes labelled
//!   `resource.nvidia.com/computeDomain=<UID>` (which the kubelet plugin labels when a workload's
//!   channel is prepared there) and run `nvdra compute-domain daemon` from nvdra's image;
//! - each carries the label `resource.nvidia.com/computeDomain=<UID>` (the templates also
//!   `resource.nvidia.com/computeDomainTarget`) and the finalizer `resource.nvidia.com/computeDomain`,
//!   which only this controller removes: by them it finds what is left of a domain that is gone.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceClaimTemplate};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::de::DeserializeOwned;
use serde_json::json;

use crate::computedomain::api::{
    API_VERSION, AllocationMode, CHANNEL_CLASS, CHANNEL_CONFIG_KIND, CLIQUE_CHANNEL_CLASS,
    CLIQUE_LABEL, ComputeDomain, DAEMON_CLASS, DAEMON_CONFIG_KIND, DOMAIN_LABEL, DRIVER_NAME,
    FINALIZER, TARGET_DAEMON, TARGET_WORKLOAD, TEMPLATE_TARGET_LABEL,
};

/// The annotation by which a domain opts in to a channel from its clique's pool (issue 37 item
/// 5): `compute-domain.nvidia.com/channels: clique`. An annotation, so NVIDIA's CRD schema stays
/// as it is; read when the domain is reconciled, so set it when creating the domain.
pub const CHANNELS_ANNOTATION: &str = "compute-domain.nvidia.com/channels";
/// The value of [`CHANNELS_ANNOTATION`] that opts in.
pub const CHANNELS_CLIQUE: &str = "clique";

/// The name of the container (and of its claim) in a domain's daemon pods, as NVIDIA names it.
pub const DAEMON_CONTAINER: &str = "compute-domain-daemon";

/// How a domain gets its channel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChannelMode {
    /// NVIDIA's: a ResourceClaimTemplate (one claim per pod, channel 0 of its node), a
    /// DaemonSet of IMEX daemons on the domain's nodes.
    PerNode,
    /// nvdra's opt-in: one ResourceClaim for one channel of a clique's pool, shared by every pod
    /// of the domain; no DaemonSet (the clique's nodes run long-running IMEX daemons).
    Clique,
}

/// The domain's channel mode, from [`CHANNELS_ANNOTATION`]; an unknown value is an error naming it.
pub fn channel_mode(cd: &ComputeDomain) -> Result<ChannelMode, String> {
    match cd
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(CHANNELS_ANNOTATION))
        .map(String::as_str)
    {
        None => Ok(ChannelMode::PerNode),
        Some(CHANNELS_CLIQUE) => Ok(ChannelMode::Clique),
        Some(other) => Err(format!(
            "annotation {CHANNELS_ANNOTATION}={other:?} is not known: remove it (NVIDIA's \
             per-node channels) or set it to {CHANNELS_CLIQUE:?} (one channel of a clique's pool)"
        )),
    }
}

/// What the controller needs to know to render a domain's objects.
#[derive(Clone, Debug, PartialEq)]
pub struct Settings {
    /// The driver's namespace: the DaemonSets, daemon templates and cliques live there.
    pub namespace: String,
    /// The image of the daemon pods (nvdra's own).
    pub image: String,
    /// The daemon pods' ServiceAccount.
    pub daemon_service_account: String,
    /// `imagePullSecrets` of the daemon pods.
    pub image_pull_secrets: Vec<String>,
    /// `MAX_NODES_PER_IMEX_DOMAIN` of the daemons (18 on GB200/GB300).
    pub max_nodes_per_imex_domain: u32,
    /// The host's driver root, mounted read-only into the per-clique daemons at
    /// [`CLIQUE_DAEMON_DRIVER_ROOT`]: their `nvidia-imex`, `nvidia-imex-ctl` and NVML.
    pub clique_daemon_driver_root: String,
}

/// The label on a per-clique daemon's DaemonSet and pods: its clique (a node label's value, so
/// a label value too).
pub const CLIQUE_DAEMON_LABEL: &str = "compute-domain.nvidia.com/clique";
/// Where a per-clique daemon sees the host's driver root.
pub const CLIQUE_DAEMON_DRIVER_ROOT: &str = "/driver-root";
/// The host directory of a per-clique IMEX daemon's state (`/var/run/nvidia-imex` in its
/// container: IMEX's `persist.dat`); nvdra's own, not the host IMEX service's.
pub const CLIQUE_DAEMON_STATE_DIR: &str = "/var/lib/nvdra/compute-domain/imex";
/// The annotation on a per-clique DaemonSet with a digest of what the controller rendered: a
/// different digest (a new image, driver root…) means the controller replaces it.
pub const CLIQUE_DAEMON_DIGEST: &str = "compute-domain.nvidia.com/rendered";

/// `computedomain-daemon-<UID>`: the DaemonSet and its claim template, as NVIDIA names them.
pub fn daemon_name(uid: &str) -> String {
    format!("computedomain-daemon-{uid}")
}

/// The domain's UID; a domain read from the API server always has one.
pub fn uid(cd: &ComputeDomain) -> Option<&str> {
    cd.metadata.uid.as_deref()
}

/// The domain's labels on everything made for it.
pub fn domain_labels(uid: &str) -> BTreeMap<String, String> {
    BTreeMap::from([(DOMAIN_LABEL.to_string(), uid.to_string())])
}

/// The object from its JSON form. Infallible for the literals below: each has its type's shape,
/// which the unit tests of every builder check.
fn typed<T: DeserializeOwned>(v: serde_json::Value) -> T {
    serde_json::from_value(v).expect("a builder's literal has its type's shape (unit-tested)")
}

fn meta(namespace: &str, name: &str, labels: BTreeMap<String, String>) -> ObjectMeta {
    ObjectMeta {
        namespace: Some(namespace.into()),
        name: Some(name.into()),
        labels: Some(labels),
        finalizers: Some(vec![FINALIZER.into()]),
        ..ObjectMeta::default()
    }
}

fn channel_parameters(uid: &str, mode: AllocationMode) -> serde_json::Value {
    json!({
        "apiVersion": API_VERSION,
        "kind": CHANNEL_CONFIG_KIND,
        "domainID": uid,
        "allocationMode": mode,
    })
}

fn claim_spec(request: &str, class: &str, parameters: serde_json::Value) -> serde_json::Value {
    json!({"devices": {
        "requests": [{"name": request, "exactly": {"deviceClassName": class}}],
        "config": [{"requests": [request], "opaque": {"driver": DRIVER_NAME, "parameters": parameters}}],
    }})
}

/// The workload ResourceClaimTemplate of a domain in NVIDIA's per-node mode; `None` without a
/// UID or `spec.channel`.
pub fn workload_template(cd: &ComputeDomain) -> Option<ResourceClaimTemplate> {
    let uid = uid(cd)?;
    let channel = cd.spec.channel.as_ref()?;
    let namespace = cd.metadata.namespace.as_deref()?;
    let mut labels = domain_labels(uid);
    labels.insert(TEMPLATE_TARGET_LABEL.into(), TARGET_WORKLOAD.into());
    let spec = claim_spec(
        "channel",
        CHANNEL_CLASS,
        channel_parameters(uid, channel.allocation_mode()),
    );
    Some(ResourceClaimTemplate {
        metadata: meta(namespace, &channel.resource_claim_template.name, labels),
        spec: typed(json!({ "spec": spec })),
    })
}

/// The one ResourceClaim every pod of a clique-channel domain shares: one channel of a clique's
/// pool ([`CLIQUE_CHANNEL_CLASS`]), in the domain's namespace, named as the template would be.
/// The scheduler allocates it once, to a channel of one clique's pool, whose node selector then
/// binds every pod that shares the claim to that clique; another domain's claim cannot get the
/// same channel.
pub fn clique_claim(cd: &ComputeDomain) -> Option<ResourceClaim> {
    let uid = uid(cd)?;
    let channel = cd.spec.channel.as_ref()?;
    let namespace = cd.metadata.namespace.as_deref()?;
    let mut labels = domain_labels(uid);
    labels.insert(TEMPLATE_TARGET_LABEL.into(), TARGET_WORKLOAD.into());
    let spec = claim_spec(
        "channel",
        CLIQUE_CHANNEL_CLASS,
        channel_parameters(uid, AllocationMode::Single),
    );
    Some(ResourceClaim {
        metadata: meta(namespace, &channel.resource_claim_template.name, labels),
        spec: typed(spec),
        status: None,
    })
}

/// The daemon pods' ResourceClaimTemplate (driver's namespace).
pub fn daemon_template(uid: &str, settings: &Settings) -> ResourceClaimTemplate {
    let mut labels = domain_labels(uid);
    labels.insert(TEMPLATE_TARGET_LABEL.into(), TARGET_DAEMON.into());
    let parameters =
        json!({"apiVersion": API_VERSION, "kind": DAEMON_CONFIG_KIND, "domainID": uid});
    ResourceClaimTemplate {
        metadata: meta(&settings.namespace, &daemon_name(uid), labels),
        spec: typed(json!({"spec": claim_spec("daemon", DAEMON_CLASS, parameters)})),
    }
}

/// The image pull secrets of a daemon pod.
fn pull_secrets(settings: &Settings) -> Vec<serde_json::Value> {
    settings
        .image_pull_secrets
        .iter()
        .map(|name| json!({ "name": name }))
        .collect()
}

/// Every taint tolerated, as NVIDIA's daemons do: a daemon must run where the workload does.
fn tolerate_all() -> Vec<serde_json::Value> {
    ["NoSchedule", "NoExecute", "PreferNoSchedule"]
        .iter()
        .map(|effect| json!({"operator": "Exists", "effect": effect}))
        .collect()
}

/// What every daemon container gets (the downward API's node, IP and pod names, which it
/// writes into its clique entry and its pod's annotations; no GPU from the container runtime's
/// NVIDIA hook), then `extra`.
fn daemon_env<const N: usize>(
    settings: &Settings,
    extra: [serde_json::Value; N],
) -> serde_json::Value {
    let field = |path: &str| json!({"fieldRef": {"fieldPath": path}});
    let mut env = vec![
        json!({"name": "MAX_NODES_PER_IMEX_DOMAIN",
               "value": settings.max_nodes_per_imex_domain.to_string()}),
        json!({"name": "NODE_NAME", "valueFrom": field("spec.nodeName")}),
        json!({"name": "POD_IP", "valueFrom": field("status.podIP")}),
        json!({"name": "POD_UID", "valueFrom": field("metadata.uid")}),
        json!({"name": "POD_NAME", "valueFrom": field("metadata.name")}),
        json!({"name": "POD_NAMESPACE", "valueFrom": field("metadata.namespace")}),
        json!({"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}),
    ];
    env.extend(extra);
    serde_json::Value::Array(env)
}

/// The DaemonSet of a domain's IMEX daemons (driver's namespace): on the nodes labelled with the
/// domain's UID, `nvdra compute-domain daemon` with the daemon claim, tolerating every taint (as
/// NVIDIA's: a daemon must run where the workload does).
pub fn daemon_set(uid: &str, settings: &Settings) -> DaemonSet {
    let labels = domain_labels(uid);
    let (pull_secrets, tolerations) = (pull_secrets(settings), tolerate_all());
    let spec = json!({
        "selector": {"matchLabels": labels},
        "template": {
            "metadata": {"labels": labels},
            "spec": {
                "serviceAccountName": settings.daemon_service_account,
                "imagePullSecrets": pull_secrets,
                "nodeSelector": labels,
                "containers": [{
                    "name": DAEMON_CONTAINER,
                    "image": settings.image,
                    "command": ["nvdra", "compute-domain", "daemon"],
                    "env": daemon_env(settings, []),
                    "resources": {"claims": [{"name": DAEMON_CONTAINER}]},
                }],
                "tolerations": tolerations,
                "resourceClaims": [{
                    "name": DAEMON_CONTAINER,
                    "resourceClaimTemplateName": daemon_name(uid),
                }],
            },
        },
    });
    DaemonSet {
        metadata: meta(&settings.namespace, &daemon_name(uid), labels),
        spec: Some(typed(spec)),
        status: None,
    }
}

/// `computedomain-daemon-fabric.<clique>`: the DaemonSet of a clique's long-running daemons,
/// named after the clique object they write (`fabric.<clique>`).
pub fn clique_daemon_name(clique: &str) -> String {
    format!("computedomain-daemon-fabric.{clique}")
}

/// The DaemonSet of one NVLink clique's long-running IMEX daemons (issue 37 item 5; driver's
/// namespace): on every node labelled `nvidia.com/gpu.clique=<clique>`, `nvdra compute-domain
/// daemon --per-clique`, which writes its entry in `fabric.<clique>` and serves every
/// clique-channel domain of the clique. The controller makes one per clique because the daemon
/// needs its clique's ID (`CLIQUE_ID`), which a static pod template cannot give: the downward
/// API has no node labels, and there is no daemon claim to carry it.
///
/// Privileged with the host's driver root mounted read-only: with no daemon claim, nothing hands
/// it the `fabric-imex-mgmt` capability node, the channel nodes or the host's `nvidia-imex`
/// (the per-domain daemons get the first from their claim). Tolerates every taint, as the
/// per-domain daemons do.
pub fn clique_daemon_set(clique: &str, settings: &Settings) -> DaemonSet {
    let labels = BTreeMap::from([(CLIQUE_DAEMON_LABEL.to_string(), clique.to_string())]);
    let (pull_secrets, tolerations) = (pull_secrets(settings), tolerate_all());
    let tool = |name: &str| format!("{CLIQUE_DAEMON_DRIVER_ROOT}/usr/bin/{name}");
    let spec = json!({
        "selector": {"matchLabels": labels},
        "template": {
            "metadata": {"labels": labels},
            "spec": {
                "serviceAccountName": settings.daemon_service_account,
                "imagePullSecrets": pull_secrets,
                "priorityClassName": "system-node-critical",
                "nodeSelector": {CLIQUE_LABEL: clique},
                "containers": [{
                    "name": DAEMON_CONTAINER,
                    "image": settings.image,
                    "command": ["nvdra", "compute-domain", "daemon", "--per-clique"],
                    "env": daemon_env(settings, [
                        json!({"name": "CLIQUE_ID", "value": clique}),
                        json!({"name": "NVIDIA_DRIVER_ROOT", "value": CLIQUE_DAEMON_DRIVER_ROOT}),
                        json!({"name": "NVDRA_CD_IMEX", "value": tool("nvidia-imex")}),
                        json!({"name": "NVDRA_CD_IMEX_CTL", "value": tool("nvidia-imex-ctl")}),
                        json!({"name": "NVDRA_CD_CONFIG_DIR", "value": "/imexd"}),
                    ]),
                    "securityContext": {"privileged": true},
                    "volumeMounts": [
                        {"name": "driver-root", "mountPath": CLIQUE_DAEMON_DRIVER_ROOT,
                         "readOnly": true},
                        {"name": "imexd", "mountPath": "/imexd"},
                        {"name": "imex-state", "mountPath": "/var/run/nvidia-imex"},
                    ],
                }],
                "volumes": [
                    {"name": "driver-root", "hostPath": {
                        "path": settings.clique_daemon_driver_root, "type": "Directory"}},
                    {"name": "imexd", "emptyDir": {}},
                    // IMEX's persist.dat (the nodes that imported memory from it): kept on
                    // the host, so a daemon restarted after an unclean stop waits for them to
                    // reconnect and clean up, as the IMEX guide's recovery quorum describes.
                    {"name": "imex-state", "hostPath": {
                        "path": CLIQUE_DAEMON_STATE_DIR, "type": "DirectoryOrCreate"}},
                ],
                "tolerations": tolerations,
            },
        },
    });
    let mut ds = DaemonSet {
        metadata: ObjectMeta {
            namespace: Some(settings.namespace.clone()),
            name: Some(clique_daemon_name(clique)),
            labels: Some(labels),
            ..ObjectMeta::default()
        },
        spec: Some(typed(spec)),
        status: None,
    };
    let digest = digest(&ds);
    ds.metadata.annotations = Some(BTreeMap::from([(CLIQUE_DAEMON_DIGEST.into(), digest)]));
    ds
}

/// A digest of what was rendered (FNV-1a over its JSON): stable across processes and builds.
fn digest(ds: &DaemonSet) -> String {
    let text = serde_json::to_string(ds).unwrap_or_default();
    let hash = text.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    format!("{hash:016x}")
}

#[cfg(test)]
mod tests;
