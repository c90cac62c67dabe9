//! Prepare and unprepare: the plugin as the library's [`Driver`].
//!
//! A claim's devices are all channels (a workload's claim, `ComputeDomainChannelConfig`) or all
//! daemons (`ComputeDomainDaemonConfig`), each config picked as NVIDIA picks it (the last one of
//! this driver whose `requests` is empty or names the device's request). A channel is the node's
//! `channel-0` (NVIDIA's shape: prepare labels the node for the domain, so the domain's DaemonSet
//! places its daemon here) or `channel-<N>` of a clique pool (the controller's, issue 37 item 5:
//! no label, channel N injected).
//!
//! Never a loop: a channel whose node's daemon is not Ready in the domain's ComputeDomainClique
//! fails at once with an error that says so, and the kubelet retries the prepare (with binding
//! conditions the scheduler holds the pod until it is ready, so that error is the exception).
//!
//! Idempotent through the checkpoint: a claim prepared before (also before a restart) gets the
//! same answer, its CDI spec written again; unprepare of a claim the checkpoint does not hold
//! succeeds.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, anyhow, bail, ensure};
use k8s_openapi::api::resource::v1::{DeviceRequestAllocationResult, ResourceClaim};
use kubelet_plugin::claims::base_request;
use kubelet_plugin::{
    BoxError, Claim, Driver, PrepareClaim, PrepareResults, PreparedDevice, UnprepareResults,
};

use super::checkpoint::{self, Checkpoint, Prepared};
use super::cluster::Cluster;
use super::devices::{self, CAPS_MAJOR_NAME, FABRIC_IMEX_MGMT, Kind};
use crate::cdi::{ContainerEdits, Device, DriverRoot, Mount, Spec};
use crate::computedomain::api::{
    API_VERSION, AllocationMode, CHANNEL_CONFIG_KIND, CHANNEL_MAJOR_NAME, CLIQUE_LABEL,
    ChannelConfig, ComputeDomain, ComputeDomainClique, DAEMON_CONFIG_KIND, DRIVER_NAME,
    DaemonConfig, NODE_LABEL, STATUS_READY,
};
use crate::computedomain::daemon::clique::PER_CLIQUE_PREFIX;
use crate::durable::Durability;
use crate::ids::ClaimUid;

/// The CDI vendor of the plugin's specs (NVIDIA's `k8s.compute-domain.nvidia.com`).
pub const CDI_VENDOR: &str = "k8s.compute-domain.nvidia.com";
/// The CDI class of a claim's spec.
pub const CDI_CLASS: &str = "claim";
/// The CDI spec version written.
const CDI_VERSION: &str = "0.5.0";
/// Where the daemon container finds its domain's directory (NVIDIA's `/imexd`).
pub const DAEMON_DIR: &str = "/imexd";
/// The subdirectory of the plugin's directory holding one directory per domain (NVIDIA's).
pub const DOMAINS_DIR: &str = "domains";
/// The IMEX config template the plugin writes into a domain's directory (NVIDIA's file name),
/// which the daemon renders into `imexd.cfg`.
pub const CONFIG_TEMPLATE: &str = "imexd.cfg.tmpl";

/// Where the plugin reads and writes on its node.
#[derive(Clone, Debug)]
pub struct Paths {
    /// The plugin's directory (`<kubelet root>/plugins/compute-domain.nvidia.com`): checkpoint,
    /// the domains' daemon directories. The same path on the host and in the container.
    pub plugin_dir: PathBuf,
    /// The CDI spec directory.
    pub cdi_root: PathBuf,
    /// `/proc/devices` (or a test's file).
    pub proc_devices: PathBuf,
    /// `/proc/driver/nvidia/capabilities` (or a test's directory).
    pub capabilities_root: PathBuf,
    /// The NVIDIA driver's root and device nodes, for what a daemon's container gets
    /// ([`super::base`]).
    pub driver_root: DriverRoot,
}

/// The plugin's node side.
pub struct Plugin {
    node: String,
    /// The driver's namespace, where the ComputeDomainCliques are.
    namespace: String,
    /// The node's clique when set by flag; else the node's `nvidia.com/gpu.clique` label.
    clique_override: Option<String>,
    paths: Paths,
    cluster: Arc<dyn Cluster>,
    store: checkpoint::Store,
    state: tokio::sync::Mutex<Checkpoint>,
}

impl Plugin {
    /// The plugin of `node`, with its checkpoint read (a claim it holds gets its CDI spec written
    /// again, as a reboot empties the CDI directory).
    pub fn new(
        node: &str,
        namespace: &str,
        clique_override: Option<String>,
        paths: Paths,
        cluster: Arc<dyn Cluster>,
    ) -> anyhow::Result<Self> {
        let store = checkpoint::Store::new(&paths.plugin_dir)?;
        let cp = store.load()?;
        for (uid, p) in &cp.claims {
            write_spec(&paths.cdi_root, uid, &p.spec)?;
        }
        if !cp.claims.is_empty() {
            tracing::info!(
                claims = cp.claims.len(),
                "prepared claims read from the checkpoint"
            );
        }
        Ok(Self {
            node: node.into(),
            namespace: namespace.into(),
            clique_override: clique_override.filter(|c| !c.is_empty()),
            paths,
            cluster,
            store,
            state: tokio::sync::Mutex::new(cp),
        })
    }

    /// The node's name.
    pub fn node(&self) -> &str {
        &self.node
    }

    /// The driver's namespace.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// The cluster the plugin works with.
    pub fn cluster(&self) -> &Arc<dyn Cluster> {
        &self.cluster
    }

    /// The prepared claims, as the checkpoint holds them, locked: prepares and unprepares wait
    /// while the guard lives.
    pub async fn prepared(&self) -> tokio::sync::MutexGuard<'_, Checkpoint> {
        self.state.lock().await
    }

    /// The node's clique (`<clusterUUID>.<cliqueID>`), empty where the node has none (its GPUs
    /// are on no multi-node NVLink fabric): the flag, else what nvdra's GPU driver publishes for
    /// the node's GPUs, else the node's label.
    pub async fn clique_id(&self) -> anyhow::Result<String> {
        if let Some(c) = &self.clique_override {
            return Ok(c.clone());
        }
        if let Some(c) = self.cluster.gpu_clique(&self.node).await? {
            return Ok(c);
        }
        let labels = self.cluster.node_labels(&self.node).await?;
        Ok(labels.get(CLIQUE_LABEL).cloned().unwrap_or_default())
    }

    /// Whether the node's daemon is Ready in the clique object `<object>.<clique>` (`object`: the
    /// domain's UID, or [`PER_CLIQUE_PREFIX`] for the one daemon of a fabric node that serves the
    /// clique pools' channels); `Err` says why not, in words.
    pub async fn daemon_ready(
        &self,
        domain: &str,
        clique: &str,
    ) -> anyhow::Result<Result<(), String>> {
        let name = ComputeDomainClique::name_for(domain, clique);
        let Some(obj) = self.cluster.clique(&self.namespace, &name).await? else {
            return Ok(Err(format!(
                "no ComputeDomainClique {}/{name} yet: no IMEX daemon of the domain has started in \
                 this clique",
                self.namespace
            )));
        };
        match obj.daemons.iter().find(|d| d.node_name == self.node) {
            None => Ok(Err(format!(
                "ComputeDomainClique {}/{name} has no daemon of node {} yet",
                self.namespace, self.node
            ))),
            Some(d) if d.status == STATUS_READY => Ok(Ok(())),
            Some(d) => Ok(Err(format!(
                "the daemon of node {} is {} in ComputeDomainClique {}/{name}",
                self.node,
                if d.status.is_empty() {
                    "NotReady"
                } else {
                    &d.status
                },
                self.namespace
            ))),
        }
    }

    async fn prepare_claim(
        &self,
        cp: &mut Checkpoint,
        c: &PrepareClaim,
    ) -> anyhow::Result<Vec<PreparedDevice>> {
        let uid = ClaimUid::parse(c.claim.uid.as_str())?;
        if let Some(p) = cp.claims.get(uid.as_str()) {
            write_spec(&self.paths.cdi_root, uid.as_str(), &p.spec)?;
            return Ok(answer(&p.devices));
        }
        ensure!(
            !c.results.is_empty(),
            "the claim has no device of {DRIVER_NAME}"
        );
        let configs = configs(&c.resource_claim)?;
        let mut picked = Vec::new();
        for r in &c.results {
            let kind = Kind::parse(&r.device).ok_or_else(|| {
                anyhow!(
                    "device {} of pool {} is no compute-domain device (channel-<N> or daemon-<N>)",
                    r.device,
                    r.pool
                )
            })?;
            picked.push((r, kind, pick(&configs, &r.request).cloned()));
        }
        let channel = matches!(picked[0].1, Kind::Channel(_));
        let mut domain_uid: Option<String> = None;
        for (r, kind, config) in &picked {
            let uid = match (kind, config) {
                (Kind::Channel(_), Some(Config::Channel(cfg))) => &cfg.domain_id,
                (Kind::Daemon(_), Some(Config::Daemon(cfg))) => &cfg.domain_id,
                (_, None) => bail!(
                    "request {} has no {} config of {DRIVER_NAME}: claims for compute-domain devices \
                     come from a ComputeDomain's ResourceClaimTemplate",
                    r.request,
                    if channel {
                        CHANNEL_CONFIG_KIND
                    } else {
                        DAEMON_CONFIG_KIND
                    }
                ),
                (Kind::Channel(_), Some(_)) => bail!(
                    "request {} got channel {} but its config is a {DAEMON_CONFIG_KIND}",
                    r.request,
                    r.device
                ),
                (Kind::Daemon(_), Some(_)) => bail!(
                    "request {} got daemon {} but its config is a {CHANNEL_CONFIG_KIND}",
                    r.request,
                    r.device
                ),
            };
            ensure!(
                matches!(kind, Kind::Channel(_)) == channel,
                "the claim mixes channels and daemons; a ComputeDomain's templates ask for one kind"
            );
            ensure!(
                !uid.is_empty(),
                "the config of request {} names no domainID",
                r.request
            );
            match &domain_uid {
                None => domain_uid = Some(uid.clone()),
                Some(d) => ensure!(
                    d == uid,
                    "the claim's configs name two ComputeDomains ({d} and {uid}); one claim serves one"
                ),
            }
        }
        let domain_uid = domain_uid.unwrap_or_default();
        let domain = self.domain(&domain_uid, &c.claim, channel).await?;
        let clique = self.clique_id().await?;
        let prepared = if channel {
            self.prepare_channels(cp, c, &uid, &domain, &clique, &picked)
                .await?
        } else {
            self.prepare_daemon(c, &uid, &domain, &clique)?
        };
        write_spec(&self.paths.cdi_root, uid.as_str(), &prepared.spec)?;
        let devices = answer(&prepared.devices);
        cp.claims.insert(uid.to_string(), prepared);
        if let Err(e) = self.store.save(cp) {
            cp.claims.remove(uid.as_str());
            return Err(e);
        }
        Ok(devices)
    }

    /// The domain `uid`. A channel claim must be in the domain's namespace (a workload uses only
    /// its own namespace's domains); a daemon claim must be in the driver's, where the
    /// controller creates the daemons' templates: the daemon device carries the node's IMEX
    /// management capability, which no workload namespace may ask for.
    async fn domain(
        &self,
        uid: &str,
        claim: &Claim,
        channel: bool,
    ) -> anyhow::Result<ComputeDomain> {
        let domain = self.cluster.domain(uid).await?.ok_or_else(|| {
            anyhow!("ComputeDomain {uid} (the claim's domainID) does not exist (yet)")
        })?;
        let ns = domain.metadata.namespace.clone().unwrap_or_default();
        if channel {
            ensure!(
                ns == claim.namespace,
                "ComputeDomain {uid} is in namespace {ns}, the claim in {}: a claim may only use \
                 a domain of its own namespace",
                claim.namespace
            );
        } else {
            ensure!(
                claim.namespace == self.namespace,
                "a daemon claim for ComputeDomain {uid} is in namespace {}: daemon claims are \
                 served only in the driver's namespace {}",
                claim.namespace,
                self.namespace
            );
        }
        Ok(domain)
    }

    async fn prepare_channels(
        &self,
        cp: &Checkpoint,
        c: &PrepareClaim,
        uid: &ClaimUid,
        domain: &ComputeDomain,
        clique: &str,
        picked: &[(&DeviceRequestAllocationResult, Kind, Option<Config>)],
    ) -> anyhow::Result<Prepared> {
        let domain_uid = domain.metadata.uid.clone().unwrap_or_default();
        let domain_name = format!(
            "{}/{}",
            domain.metadata.namespace.as_deref().unwrap_or_default(),
            domain.metadata.name.as_deref().unwrap_or_default()
        );
        for (r, _, _) in picked {
            if let Some((other, _)) = cp.claims.iter().find(|(other, p)| {
                other.as_str() != uid.as_str()
                    && p.devices
                        .iter()
                        .any(|d| d.pool == r.pool && d.device == r.device)
            }) {
                bail!(
                    "{} of pool {} is prepared for claim {other} already; it is handed to one claim \
                     at a time (the scheduler allocated it twice, or that claim's pod is still \
                     being torn down)",
                    r.device,
                    r.pool
                );
            }
        }
        // NVIDIA's shape: the node's own channel brings the domain's daemon here, through the
        // node label its DaemonSet selects on.
        let node_channel = picked.iter().any(|(r, _, _)| r.pool == self.node);
        if node_channel {
            let labels = self.cluster.node_labels(&self.node).await?;
            match labels.get(NODE_LABEL) {
                Some(v) if v == &domain_uid => {}
                Some(v) => bail!(
                    "node {} serves ComputeDomain {v} (label {NODE_LABEL}); a node serves one \
                     domain at a time in this mode, so ComputeDomain {domain_name} ({domain_uid}) \
                     cannot use it until that domain's workload has left",
                    self.node
                ),
                None => {
                    self.cluster
                        .set_node_label(&self.node, NODE_LABEL, Some(&domain_uid))
                        .await?
                }
            }
        }
        // A clique pool's channel is served by the node's per-clique daemon, whose entry is in
        // `fabric.<clique>`; the node's own channel by the domain's daemon.
        let object = if node_channel {
            domain_uid.as_str()
        } else {
            PER_CLIQUE_PREFIX
        };
        if let Err(why) = self.daemon_ready(object, clique).await? {
            return Err(anyhow!(
                "ComputeDomain {domain_name} ({domain_uid}) is not ready on node {}: {why}; this \
                 prepare does not wait, the kubelet retries it",
                self.node
            ));
        }
        let major = if clique.is_empty() {
            None
        } else {
            Some(devices::read_major(
                &self.paths.proc_devices,
                CHANNEL_MAJOR_NAME,
            )?)
        };
        let mut spec_devices = Vec::new();
        let mut answered = Vec::new();
        for (r, kind, config) in picked {
            let Kind::Channel(n) = kind else {
                unreachable!("checked above: all channels")
            };
            let all = matches!(
                config,
                Some(Config::Channel(ChannelConfig {
                    allocation_mode: Some(AllocationMode::All),
                    ..
                }))
            );
            let channels: Vec<u32> = if all {
                (0..devices::CHANNEL_COUNT).collect()
            } else {
                vec![*n]
            };
            let mut cdi_ids = Vec::new();
            // A node on no fabric gets no channel nodes (as NVIDIA's): the claim still
            // succeeds, so a domain's pods run on single-node systems too.
            if let Some(major) = major {
                let name = format!("{uid}-{}", r.device);
                cdi_ids.push(format!("{CDI_VENDOR}/{CDI_CLASS}={name}"));
                spec_devices.push(Device {
                    name,
                    container_edits: ContainerEdits {
                        device_nodes: channels
                            .iter()
                            .map(|n| devices::channel_node(major, *n))
                            .collect(),
                        ..ContainerEdits::default()
                    },
                });
            }
            answered.push(device(r, cdi_ids));
        }
        Ok(Prepared {
            namespace: c.claim.namespace.clone(),
            name: c.claim.name.clone(),
            domain: domain_uid,
            channel: true,
            labelled: node_channel,
            devices: answered,
            spec: spec(spec_devices),
        })
    }

    /// What NVIDIA's plugin hands the daemon container: the domain in the environment, the
    /// domain's directory at `/imexd` with the IMEX config template in it, (on a fabric node)
    /// the `fabric-imex-mgmt` capability node that lets `nvidia-imex` run, and the node's NVIDIA
    /// device nodes and driver files ([`super::base`]).
    fn prepare_daemon(
        &self,
        c: &PrepareClaim,
        uid: &ClaimUid,
        domain: &ComputeDomain,
        clique: &str,
    ) -> anyhow::Result<Prepared> {
        let domain_uid = domain.metadata.uid.clone().unwrap_or_default();
        let dir = self.paths.plugin_dir.join(DOMAINS_DIR).join(&domain_uid);
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("cannot create the daemon's directory {}", dir.display()))?;
        // As NVIDIA's plugin: written at each prepare, the daemon reads it when IMEX starts.
        let template = dir.join(CONFIG_TEMPLATE);
        crate::durable::write_as(
            &template,
            crate::computedomain::daemon::files::DEFAULT_TEMPLATE.as_bytes(),
            Durability::Atomic,
        )?;
        let mut edits = ContainerEdits {
            env: vec![
                format!("CLIQUE_ID={clique}"),
                format!("COMPUTE_DOMAIN_UUID={domain_uid}"),
                format!(
                    "COMPUTE_DOMAIN_NAME={}",
                    domain.metadata.name.as_deref().unwrap_or_default()
                ),
                format!(
                    "COMPUTE_DOMAIN_NAMESPACE={}",
                    domain.metadata.namespace.as_deref().unwrap_or_default()
                ),
            ],
            mounts: vec![Mount {
                host_path: dir.display().to_string(),
                container_path: DAEMON_DIR.into(),
                options: ["rw", "nosuid", "nodev", "bind"].map(String::from).to_vec(),
            }],
            ..ContainerEdits::default()
        };
        if !clique.is_empty() {
            let file = self.paths.capabilities_root.join(FABRIC_IMEX_MGMT);
            let text = std::fs::read_to_string(&file).with_context(|| {
                format!(
                    "cannot read {} (the IMEX daemon's capability; pass the driver's capabilities \
                     directory with --capabilities-root)",
                    file.display()
                )
            })?;
            let major = devices::read_major(&self.paths.proc_devices, CAPS_MAJOR_NAME)?;
            let node = devices::capability_node(&text, major)
                .ok_or_else(|| anyhow!("{} names no DeviceFileMinor", file.display()))?;
            edits.device_nodes.push(node);
        }
        let base = super::base::edits(&self.paths.driver_root);
        for node in base.device_nodes {
            // The capability node above is the one IMEX needs; the base lists it too.
            if !edits.device_nodes.iter().any(|n| n.path == node.path) {
                edits.device_nodes.push(node);
            }
        }
        edits.env.extend(base.env);
        edits.mounts.extend(base.mounts);
        let mut spec_devices = Vec::new();
        let mut answered = Vec::new();
        for r in &c.results {
            let name = format!("{uid}-{}", r.device);
            answered.push(device(r, vec![format!("{CDI_VENDOR}/{CDI_CLASS}={name}")]));
            spec_devices.push(Device {
                name,
                container_edits: edits.clone(),
            });
        }
        Ok(Prepared {
            namespace: c.claim.namespace.clone(),
            name: c.claim.name.clone(),
            domain: domain_uid,
            channel: false,
            labelled: false,
            devices: answered,
            spec: spec(spec_devices),
        })
    }

    async fn unprepare_claim(&self, cp: &mut Checkpoint, claim: &Claim) -> anyhow::Result<()> {
        let Some(p) = cp.claims.get(&claim.uid).cloned() else {
            return Ok(());
        };
        if p.labelled {
            let others = cp
                .claims
                .iter()
                .any(|(u, o)| u != &claim.uid && o.labelled && o.domain == p.domain);
            if !others {
                let labels = self.cluster.node_labels(&self.node).await?;
                if labels.get(NODE_LABEL) == Some(&p.domain) {
                    self.cluster
                        .set_node_label(&self.node, NODE_LABEL, None)
                        .await?;
                }
            }
        }
        remove_spec(&self.paths.cdi_root, &claim.uid)?;
        cp.claims.remove(&claim.uid);
        if let Err(e) = self.store.save(cp) {
            cp.claims.insert(claim.uid.clone(), p);
            return Err(e);
        }
        Ok(())
    }
}

/// One opaque config of this driver, decoded.
#[derive(Clone, Debug)]
pub(super) enum Config {
    Channel(ChannelConfig),
    Daemon(DaemonConfig),
}

/// This driver's opaque configs of the allocation, in order (the class's first, then the
/// claim's, as the allocation lists them), each with the requests it applies to.
pub(super) fn configs(claim: &ResourceClaim) -> anyhow::Result<Vec<(Vec<String>, Config)>> {
    let list = claim
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .and_then(|a| a.devices.as_ref())
        .and_then(|d| d.config.clone())
        .unwrap_or_default();
    let mut out = Vec::new();
    for c in list {
        let Some(opaque) = c.opaque else { continue };
        if opaque.driver != DRIVER_NAME {
            continue;
        }
        let v = opaque.parameters.0;
        let kind = v.get("kind").and_then(|k| k.as_str()).unwrap_or_default();
        let api = v
            .get("apiVersion")
            .and_then(|k| k.as_str())
            .unwrap_or_default();
        ensure!(
            api == API_VERSION,
            "a config of {DRIVER_NAME} has apiVersion {api:?}; this plugin reads {API_VERSION}"
        );
        let config = match kind {
            CHANNEL_CONFIG_KIND => Config::Channel(
                serde_json::from_value(v)
                    .with_context(|| format!("invalid {CHANNEL_CONFIG_KIND}"))?,
            ),
            DAEMON_CONFIG_KIND => Config::Daemon(
                serde_json::from_value(v)
                    .with_context(|| format!("invalid {DAEMON_CONFIG_KIND}"))?,
            ),
            other => bail!(
                "a config of {DRIVER_NAME} has kind {other:?}; this plugin knows \
                 {CHANNEL_CONFIG_KIND} and {DAEMON_CONFIG_KIND}"
            ),
        };
        out.push((c.requests.unwrap_or_default(), config));
    }
    Ok(out)
}

/// The config that applies to a result of `request`: the last whose `requests` is empty or names
/// it (a `request/subrequest` by its base name).
pub(super) fn pick<'a>(configs: &'a [(Vec<String>, Config)], request: &str) -> Option<&'a Config> {
    let request = base_request(request);
    configs
        .iter()
        .rev()
        .find(|(requests, _)| requests.is_empty() || requests.iter().any(|q| q == request))
        .map(|(_, cfg)| cfg)
}

fn device(r: &DeviceRequestAllocationResult, cdi_ids: Vec<String>) -> checkpoint::Device {
    checkpoint::Device {
        requests: vec![base_request(&r.request).to_string()],
        pool: r.pool.clone(),
        device: r.device.clone(),
        cdi_ids,
    }
}

fn answer(devices: &[checkpoint::Device]) -> Vec<PreparedDevice> {
    devices
        .iter()
        .map(|d| PreparedDevice::new(d.requests.clone(), &d.pool, &d.device, d.cdi_ids.clone()))
        .collect()
}

fn spec(devices: Vec<Device>) -> Spec {
    Spec {
        cdi_version: CDI_VERSION.into(),
        kind: format!("{CDI_VENDOR}/{CDI_CLASS}"),
        devices,
        container_edits: ContainerEdits::default(),
    }
}

/// `<cdi root>/k8s.compute-domain.nvidia.com-claim_<uid>.yaml`.
pub fn spec_path(cdi_root: &Path, uid: &str) -> PathBuf {
    cdi_root.join(format!("{CDI_VENDOR}-{CDI_CLASS}_{uid}.yaml"))
}

/// Writes a claim's spec (none for a spec without devices: a claim on a node without a fabric).
fn write_spec(cdi_root: &Path, uid: &str, spec: &Spec) -> anyhow::Result<()> {
    if spec.devices.is_empty() {
        return Ok(());
    }
    std::fs::create_dir_all(cdi_root)
        .with_context(|| format!("cannot create the CDI directory {}", cdi_root.display()))?;
    let text = spec.to_yaml()?;
    // Rebuilt from the checkpoint at start-up: atomic is enough.
    crate::durable::write_as(
        &spec_path(cdi_root, uid),
        text.as_bytes(),
        Durability::Atomic,
    )?;
    Ok(())
}

fn remove_spec(cdi_root: &Path, uid: &str) -> anyhow::Result<()> {
    crate::durable::remove_as(&spec_path(cdi_root, uid), Durability::Atomic)?;
    Ok(())
}

impl Driver for Plugin {
    async fn prepare(&self, claims: Vec<PrepareClaim>) -> Result<PrepareResults, BoxError> {
        let mut cp = self.state.lock().await;
        let mut out = Vec::new();
        for c in claims {
            let r = self.prepare_claim(&mut cp, &c).await;
            if let Ok(devices) = &r {
                tracing::info!(claim = %c.claim.uid, devices = devices.len(), "prepared");
            }
            out.push((c.claim.uid.clone(), r.map_err(|e| format!("{e:#}").into())));
        }
        Ok(out)
    }

    async fn unprepare(&self, claims: Vec<Claim>) -> Result<UnprepareResults, BoxError> {
        let mut cp = self.state.lock().await;
        let mut out = Vec::new();
        for c in claims {
            let r = self.unprepare_claim(&mut cp, &c).await;
            out.push((c.uid.clone(), r.map_err(|e| format!("{e:#}").into())));
        }
        Ok(out)
    }
}
