//! The `resource.nvidia.com/v1beta1` kinds and the names NVIDIA's compute-domain driver uses, so
//! that users' YAML works unchanged and a node can move between NVIDIA's plugin and nvdra's.
//!
//! Field names, defaults and enum values are NVIDIA's (its CRDs under `deployments/helm/*/crds/`);
//! the CRD manifests nvdra ships are checked against these types by tests.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::{Deserialize, Serialize};

/// The API group of the ComputeDomain kinds.
pub const GROUP: &str = "resource.nvidia.com";
/// Their version.
pub const VERSION: &str = "v1beta1";
/// `group/version`, the `apiVersion` of every object and opaque config here.
pub const API_VERSION: &str = "resource.nvidia.com/v1beta1";

/// The DRA driver name of the compute-domain kubelet plugin.
pub const DRIVER_NAME: &str = "compute-domain.nvidia.com";
/// The DeviceClass of a workload's channel (device `type == 'channel'`, `id == 0`).
pub const CHANNEL_CLASS: &str = "compute-domain-default-channel.nvidia.com";
/// The DeviceClass of a node's IMEX daemon (device `type == 'daemon'`).
pub const DAEMON_CLASS: &str = "compute-domain-daemon.nvidia.com";
/// The node label naming the ComputeDomain (its UID) a node's daemon serves.
pub const NODE_LABEL: &str = "resource.nvidia.com/computeDomain";
/// The node label of the NVLink clique a node's GPUs registered with: `<clusterUUID>.<cliqueID>`
/// (as GPU feature discovery sets it).
pub const CLIQUE_LABEL: &str = "nvidia.com/gpu.clique";
/// Where a container finds its IMEX channels: `channel<N>` character devices.
pub const CHANNEL_DIR: &str = "/dev/nvidia-caps-imex-channels";
/// The `/proc/devices` name of the IMEX channels' character-device major.
pub const CHANNEL_MAJOR_NAME: &str = "nvidia-caps-imex-channels";

/// The DeviceClass of nvdra's per-clique channel pools (issue 37 item 5, opt-in per domain): the
/// channels the controller publishes per NVLink clique, each carrying [`ATTR_CLIQUE`]. NVIDIA's
/// controller declares this name but ships no such class. Pool channels are numbered from 1, so
/// that [`CHANNEL_CLASS`] (`id == 0`) never selects one.
pub const CLIQUE_CHANNEL_CLASS: &str = "compute-domain-channel.nvidia.com";

/// The device attributes (in the [`DRIVER_NAME`] domain) the DeviceClasses select on: every
/// device has a [`ATTR_TYPE`] ([`TYPE_CHANNEL`] or [`TYPE_DAEMON`]) and an integer [`ATTR_ID`]
/// (the channel's number; 0 for a node's `channel-0` and `daemon-0`), as NVIDIA publishes them.
pub const ATTR_TYPE: &str = "type";
/// See [`ATTR_TYPE`].
pub const ATTR_ID: &str = "id";
/// A string attribute only the controller's per-clique pool channels carry: their clique,
/// `<clusterUUID>.<cliqueID>` (the value of [`CLIQUE_LABEL`] on the clique's nodes).
/// [`CLIQUE_CHANNEL_CLASS`] selects on its presence.
pub const ATTR_CLIQUE: &str = "cliqueID";
/// `type` of a channel device.
pub const TYPE_CHANNEL: &str = "channel";
/// `type` of a daemon device.
pub const TYPE_DAEMON: &str = "daemon";

/// The CEL of [`CHANNEL_CLASS`], NVIDIA's expression verbatim (the manifests carry it; a test
/// holds them to these constants).
pub const CHANNEL_CLASS_CEL: &str = "device.driver == 'compute-domain.nvidia.com' && device.attributes['compute-domain.nvidia.com'].type == 'channel' && device.attributes['compute-domain.nvidia.com'].id == 0";
/// The CEL of [`DAEMON_CLASS`], NVIDIA's expression verbatim.
pub const DAEMON_CLASS_CEL: &str = "device.driver == 'compute-domain.nvidia.com' && device.attributes['compute-domain.nvidia.com'].type == 'daemon'";
/// The CEL of [`CLIQUE_CHANNEL_CLASS`]: a channel of a clique pool.
pub const CLIQUE_CHANNEL_CLASS_CEL: &str = "device.driver == 'compute-domain.nvidia.com' && device.attributes['compute-domain.nvidia.com'].type == 'channel' && 'cliqueID' in device.attributes['compute-domain.nvidia.com']";

/// The label NVIDIA's controller puts on a domain's objects (and its finalizer): the domain's UID.
/// The same key as [`NODE_LABEL`].
pub const DOMAIN_LABEL: &str = "resource.nvidia.com/computeDomain";
/// The finalizer NVIDIA's controller puts on a domain (the same string as [`DOMAIN_LABEL`]).
pub const FINALIZER: &str = "resource.nvidia.com/computeDomain";
/// The label of a clique object: its clique ID.
pub const CLIQUE_ID_LABEL: &str = "resource.nvidia.com/computeDomain.cliqueID";
/// The label telling a domain's two generated ResourceClaimTemplates apart:
/// [`TARGET_WORKLOAD`] or [`TARGET_DAEMON`].
pub const TEMPLATE_TARGET_LABEL: &str = "resource.nvidia.com/computeDomainTarget";
/// See [`TEMPLATE_TARGET_LABEL`].
pub const TARGET_WORKLOAD: &str = "Workload";
/// See [`TEMPLATE_TARGET_LABEL`].
pub const TARGET_DAEMON: &str = "Daemon";

/// The names of the CRDs nvdra ships (`manifests/components/compute-domains/crds.yaml`).
pub const DOMAIN_CRD: &str = "computedomains.resource.nvidia.com";
/// See [`DOMAIN_CRD`].
pub const CLIQUE_CRD: &str = "computedomaincliques.resource.nvidia.com";

/// nvdra's compute-domain objects, as its manifests name them (none is NVIDIA's, so that NVIDIA's
/// compute-domain half can run beside nvdra's GPU half: README, "Compute domains"). The
/// controller's Deployment, ServiceAccount, ClusterRole and the Lease it elects a leader with, in
/// the driver's namespace.
pub const CONTROLLER_NAME: &str = "nvdra-compute-domain-controller";
/// The ServiceAccount (in the driver's namespace) the controller gives the daemon pods it
/// creates; its ClusterRole and Role are named the same.
pub const DAEMON_SERVICE_ACCOUNT: &str = "nvdra-compute-domain-daemon";
/// The ClusterRole of the compute-domain kubelet plugin (the `compute-domain` container of nvdra's
/// DaemonSet, which runs as nvdra's ServiceAccount).
pub const PLUGIN_ROLE: &str = "nvdra-compute-domain-plugin";
/// The name of the plugin's container in nvdra's DaemonSet.
pub const PLUGIN_CONTAINER: &str = "compute-domain";

/// A domain's or a daemon's readiness, as NVIDIA writes it.
pub const STATUS_READY: &str = "Ready";
/// See [`STATUS_READY`].
pub const STATUS_NOT_READY: &str = "NotReady";

/// What a domain's daemon says about its node beyond its clique entry (whose schema, NVIDIA's,
/// has no room for it), as annotations of its own pod (NVIDIA's daemon may patch its pod): why
/// it is not ready, one line (e.g. the last IMEX log line; empty or absent when ready). The
/// controller puts it in the domain's `Ready` condition.
pub const DAEMON_REASON_ANNOTATION: &str = "compute-domain.nvidia.com/imex-reason";
/// The node names the daemon's `nvidia-imex` is connected to, comma-separated (see
/// [`DAEMON_REASON_ANNOTATION`]); the controller's `PeersConnected` condition names the nodes of
/// a clique a daemon does not see.
pub const DAEMON_PEERS_ANNOTATION: &str = "compute-domain.nvidia.com/imex-peers";

/// `kind: ComputeDomain` (namespaced): a set of pods that share GPU memory over multi-node
/// NVLink. Its spec is immutable.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ComputeDomain {
    #[serde(default = "api_version")]
    pub api_version: String,
    #[serde(default = "compute_domain_kind")]
    pub kind: String,
    #[serde(default)]
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub spec: ComputeDomainSpec,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<ComputeDomainStatus>,
}

/// The spec of a [`ComputeDomain`].
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ComputeDomainSpec {
    /// How many nodes the domain waits for before it is Ready (0: do not wait).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub num_nodes: i64,
    /// The workload's channel: the ResourceClaimTemplate the controller creates for it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub channel: Option<ChannelSpec>,
    /// Any field NVIDIA adds later: kept as it came, so a read-modify-write loses nothing.
    #[serde(flatten)]
    pub other: BTreeMap<String, serde_json::Value>,
}

/// `spec.channel`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ChannelSpec {
    pub resource_claim_template: TemplateRef,
    /// `Single` (default: channel 0) or `All` (every channel of the node).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allocation_mode: Option<AllocationMode>,
    #[serde(flatten)]
    pub other: BTreeMap<String, serde_json::Value>,
}

/// `spec.channel.resourceClaimTemplate`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TemplateRef {
    pub name: String,
}

/// `spec.channel.allocationMode`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum AllocationMode {
    #[default]
    Single,
    All,
}

/// The status of a [`ComputeDomain`].
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ComputeDomainStatus {
    /// [`STATUS_READY`] or [`STATUS_NOT_READY`].
    #[serde(default)]
    pub status: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nodes: Vec<DomainNode>,
    #[serde(flatten)]
    pub other: BTreeMap<String, serde_json::Value>,
}

/// One node of a domain (`status.nodes[]`), and one daemon of a clique (`daemons[]`): the same
/// fields (NVIDIA's `ComputeDomainNode` and `ComputeDomainDaemonInfo`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DomainNode {
    /// For a clique's daemon NVIDIA names this `nodeName`; for a domain's node, `name`.
    #[serde(alias = "nodeName")]
    pub name: String,
    pub ip_address: String,
    #[serde(rename = "cliqueID")]
    pub clique_id: String,
    /// The node's index within its clique: its DNS name there (`(cliqueID, index)` is unique).
    #[serde(default)]
    pub index: i64,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub status: String,
}

/// `kind: ComputeDomainClique` (namespaced, in the driver's namespace, named
/// `<computeDomainUID>.<cliqueID>`): the daemons of one domain in one NVLink clique.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ComputeDomainClique {
    #[serde(default = "api_version")]
    pub api_version: String,
    #[serde(default = "clique_kind")]
    pub kind: String,
    #[serde(default)]
    pub metadata: ObjectMeta,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub daemons: Vec<CliqueDaemon>,
}

/// One entry of a clique's `daemons` (a list map keyed by `nodeName`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CliqueDaemon {
    pub node_name: String,
    pub ip_address: String,
    #[serde(rename = "cliqueID")]
    pub clique_id: String,
    #[serde(default)]
    pub index: i64,
    /// [`STATUS_READY`] or [`STATUS_NOT_READY`] (the CRD's default).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub status: String,
}

/// The opaque config of a workload's channel claim (`kind: ComputeDomainChannelConfig`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ChannelConfig {
    #[serde(default = "api_version")]
    pub api_version: String,
    #[serde(default = "channel_config_kind")]
    pub kind: String,
    /// The domain's UID.
    #[serde(rename = "domainID")]
    pub domain_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allocation_mode: Option<AllocationMode>,
}

/// The opaque config of a daemon's claim (`kind: ComputeDomainDaemonConfig`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DaemonConfig {
    #[serde(default = "api_version")]
    pub api_version: String,
    #[serde(default = "daemon_config_kind")]
    pub kind: String,
    /// The domain's UID.
    #[serde(rename = "domainID")]
    pub domain_id: String,
}

/// The kind of [`ChannelConfig`].
pub const CHANNEL_CONFIG_KIND: &str = "ComputeDomainChannelConfig";
/// The kind of [`DaemonConfig`].
pub const DAEMON_CONFIG_KIND: &str = "ComputeDomainDaemonConfig";

fn api_version() -> String {
    API_VERSION.into()
}
fn compute_domain_kind() -> String {
    "ComputeDomain".into()
}
fn clique_kind() -> String {
    "ComputeDomainClique".into()
}
fn channel_config_kind() -> String {
    CHANNEL_CONFIG_KIND.into()
}
fn daemon_config_kind() -> String {
    DAEMON_CONFIG_KIND.into()
}
fn is_zero(n: &i64) -> bool {
    *n == 0
}

impl ComputeDomain {
    /// A domain named `name` in `namespace` with `spec`, as a user would create it.
    pub fn new(namespace: &str, name: &str, spec: ComputeDomainSpec) -> Self {
        ComputeDomain {
            api_version: api_version(),
            kind: compute_domain_kind(),
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some(namespace.into()),
                ..ObjectMeta::default()
            },
            spec,
            status: None,
        }
    }
}

/// Why the API server refuses a domain, as NVIDIA's CRD (and nvdra's, which is the same) refuses
/// it. The schema's other rule, `allocationMode` one of `Single` and `All`, is the type's:
/// [`AllocationMode`] reads no other value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Invalid {
    #[error(
        "spec.channel: required: a ComputeDomain names its channel's ResourceClaimTemplate in spec.channel.resourceClaimTemplate.name"
    )]
    NoChannel,
    #[error("spec.numNodes: {0} is negative: set 0 (do not wait for a number of nodes) or more")]
    NegativeNumNodes(i64),
    #[error(
        "spec: a ComputeDomain's spec is immutable (self == oldSelf): delete the domain and create it anew to change it"
    )]
    SpecChanged,
}

impl ComputeDomainSpec {
    /// What the CRD's schema requires of a spec.
    pub fn validate(&self) -> Result<(), Invalid> {
        if self.channel.is_none() {
            return Err(Invalid::NoChannel);
        }
        if self.num_nodes < 0 {
            return Err(Invalid::NegativeNumNodes(self.num_nodes));
        }
        Ok(())
    }
}

impl ChannelSpec {
    /// The allocation mode, defaulted as the CRD defaults it.
    pub fn allocation_mode(&self) -> AllocationMode {
        self.allocation_mode.unwrap_or_default()
    }
}

impl ComputeDomain {
    /// What the API server checks of an update of `old` to `self`: the schema, and the
    /// transition rule `self == oldSelf` on the spec (the status subresource does not reach it).
    pub fn validate_update(&self, old: &ComputeDomain) -> Result<(), Invalid> {
        self.spec.validate()?;
        if self.spec != old.spec {
            return Err(Invalid::SpecChanged);
        }
        Ok(())
    }
}

impl ComputeDomainClique {
    /// The name NVIDIA gives a domain's clique object: `<computeDomainUID>.<cliqueID>`.
    pub fn name_for(domain_uid: &str, clique_id: &str) -> String {
        format!("{domain_uid}.{clique_id}")
    }
}

impl k8s_openapi::Resource for ComputeDomain {
    const API_VERSION: &'static str = API_VERSION;
    const GROUP: &'static str = GROUP;
    const KIND: &'static str = "ComputeDomain";
    const VERSION: &'static str = VERSION;
    const URL_PATH_SEGMENT: &'static str = "computedomains";
    type Scope = k8s_openapi::NamespaceResourceScope;
}

impl k8s_openapi::Metadata for ComputeDomain {
    type Ty = ObjectMeta;
    fn metadata(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn metadata_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

impl k8s_openapi::Resource for ComputeDomainClique {
    const API_VERSION: &'static str = API_VERSION;
    const GROUP: &'static str = GROUP;
    const KIND: &'static str = "ComputeDomainClique";
    const VERSION: &'static str = VERSION;
    const URL_PATH_SEGMENT: &'static str = "computedomaincliques";
    type Scope = k8s_openapi::NamespaceResourceScope;
}

impl k8s_openapi::Metadata for ComputeDomainClique {
    type Ty = ObjectMeta;
    fn metadata(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn metadata_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_domain_reads_as_nvidia_writes_it_and_keeps_unknown_fields() {
        let doc = serde_json::json!({
            "apiVersion": "resource.nvidia.com/v1beta1",
            "kind": "ComputeDomain",
            "metadata": {"name": "imex-channel-injection", "namespace": "default"},
            "spec": {
                "numNodes": 2,
                "channel": {"resourceClaimTemplate": {"name": "imex-channel-0"},
                            "allocationMode": "All"},
                "futureField": {"x": 1}
            },
            "status": {"status": "Ready", "nodes": [
                {"name": "node-a", "ipAddress": "10.0.0.1", "cliqueID": "c.1", "index": 3,
                 "status": "Ready"}
            ]}
        });
        let cd: ComputeDomain = serde_json::from_value(doc.clone()).unwrap();
        assert_eq!(cd.spec.num_nodes, 2);
        let channel = cd.spec.channel.as_ref().unwrap();
        assert_eq!(channel.resource_claim_template.name, "imex-channel-0");
        assert_eq!(channel.allocation_mode, Some(AllocationMode::All));
        let status = cd.status.as_ref().unwrap();
        assert_eq!(status.nodes[0].clique_id, "c.1");
        assert_eq!(status.nodes[0].index, 3);
        assert_eq!(serde_json::to_value(&cd).unwrap(), doc);
    }

    #[test]
    fn the_spec_is_validated_as_the_crd_does() {
        let channel = |mode: Option<AllocationMode>| ChannelSpec {
            resource_claim_template: TemplateRef { name: "t".into() },
            allocation_mode: mode,
            other: BTreeMap::new(),
        };
        let spec = |num_nodes, channel| ComputeDomainSpec {
            num_nodes,
            channel,
            other: BTreeMap::new(),
        };
        assert_eq!(spec(0, Some(channel(None))).validate(), Ok(()));
        assert_eq!(spec(0, None).validate(), Err(Invalid::NoChannel));
        assert_eq!(
            spec(-1, Some(channel(None))).validate(),
            Err(Invalid::NegativeNumNodes(-1))
        );
        assert_eq!(channel(None).allocation_mode(), AllocationMode::Single);
        assert_eq!(
            channel(Some(AllocationMode::All)).allocation_mode(),
            AllocationMode::All
        );
        // The enum: no other allocation mode reads.
        let bad =
            serde_json::json!({"resourceClaimTemplate": {"name": "t"}, "allocationMode": "Some"});
        let err = serde_json::from_value::<ChannelSpec>(bad)
            .unwrap_err()
            .to_string();
        assert!(err.contains("Some"), "{err}");
        // Immutability: status may change, the spec may not.
        let old = ComputeDomain::new("ns", "d", spec(2, Some(channel(None))));
        let mut new = old.clone();
        new.status = Some(ComputeDomainStatus {
            status: STATUS_READY.into(),
            ..Default::default()
        });
        new.metadata.labels = Some([("a".to_string(), "b".to_string())].into());
        assert_eq!(new.validate_update(&old), Ok(()));
        new.spec.num_nodes = 3;
        assert_eq!(new.validate_update(&old), Err(Invalid::SpecChanged));
        let mut new = old.clone();
        new.spec.channel = Some(channel(Some(AllocationMode::Single)));
        assert_eq!(new.validate_update(&old), Err(Invalid::SpecChanged));
    }

    #[test]
    fn the_class_cel_selects_what_the_constants_say() {
        // The expressions name the driver and attributes by the constants' values.
        for cel in [
            CHANNEL_CLASS_CEL,
            DAEMON_CLASS_CEL,
            CLIQUE_CHANNEL_CLASS_CEL,
        ] {
            assert!(
                cel.contains(&format!("device.driver == '{DRIVER_NAME}'")),
                "{cel}"
            );
            assert!(cel.contains(&format!(
                "device.attributes['{DRIVER_NAME}'].{ATTR_TYPE} == "
            )));
        }
        assert!(CHANNEL_CLASS_CEL.contains(&format!("== '{TYPE_CHANNEL}'")));
        assert!(CHANNEL_CLASS_CEL.ends_with(&format!(".{ATTR_ID} == 0")));
        assert!(DAEMON_CLASS_CEL.contains(&format!("== '{TYPE_DAEMON}'")));
        assert!(CLIQUE_CHANNEL_CLASS_CEL.contains(&format!("== '{TYPE_CHANNEL}'")));
        assert!(CLIQUE_CHANNEL_CLASS_CEL.ends_with(&format!(
            "'{ATTR_CLIQUE}' in device.attributes['{DRIVER_NAME}']"
        )));
    }

    #[test]
    fn a_clique_reads_its_daemons_by_node_name() {
        let doc = serde_json::json!({
            "apiVersion": "resource.nvidia.com/v1beta1",
            "kind": "ComputeDomainClique",
            "metadata": {"name": "uid.c.1", "namespace": "nvdra"},
            "daemons": [{"nodeName": "node-a", "ipAddress": "10.0.0.1", "cliqueID": "c.1",
                         "index": 0, "status": "NotReady"}]
        });
        let clique: ComputeDomainClique = serde_json::from_value(doc.clone()).unwrap();
        assert_eq!(clique.daemons[0].node_name, "node-a");
        assert_eq!(serde_json::to_value(&clique).unwrap(), doc);
        assert_eq!(ComputeDomainClique::name_for("uid", "c.1"), "uid.c.1");
    }
}
