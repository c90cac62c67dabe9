//! Claim status (KEP-4817): after a prepare succeeds, nvdra's entries in the claim's
//! `status.devices`, one per prepared device, written by the library's
//! [`StatusWriter`] (server-side apply, field manager the driver name, forced). Each entry has a
//! `Ready` condition, `True`, and `data` in the shape of [`DeviceData`] (README, "Claim status").
//!
//! - **Never in the prepare's way.** The write runs on its own task, spawned as the prepare answers;
//!   a failure is logged at warn, never the claim's error. A transient one (5xx, timeouts, no
//!   connection) is tried again within [`ATTEMPTS`] tries, a second apart and doubling; after
//!   that, and after any other failure, the claim's next prepare (a kubelet restart, another pod
//!   of the claim) writes it again. A claim whose entries this process wrote (or is writing) is
//!   not written again at its re-prepares.
//! - **Only by the node that prepared it**: the plugin writes only claims its kubelet asked it to
//!   prepare, and only its own devices (the results for its driver; a prepare refuses any of
//!   another pool). The admission policy `nvdra-resourceclaim-status` holds a node's plugin to
//!   exactly that (manifests/base/admission.yaml).
//! - **Left at unprepare.** The entries stay until the claim is deallocated, when the API server
//!   drops the entries of the devices that went (`dropDeallocatedStatusDevices`), or deleted.
//!   The kubelet unprepares once no pod of the node uses the claim; the resourceclaim controller
//!   then deallocates it as soon as it is reserved for no pod. A write at unprepare would race
//!   that deallocation (and, after it, be refused by the admission policy: the claim is no longer
//!   allocated to the node), for entries that go anyway.
//! - An API server without the field (before 1.32, or the feature gate off) is told apart by the
//!   library and said once, not an error per claim; nothing is written where the API keeps no
//!   claim status (the directory API) or under `--claim-status=false`.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use k8s_openapi::api::resource::v1::{AllocatedDeviceStatus, ResourceClaim};
use k8s_openapi::apimachinery::pkg::runtime::RawExtension;
use kubelet_plugin::status::{Applied, StatusWriter, ready};
use serde::Serialize;

use super::{ClaimRef, Plugin};
use crate::api::{self, ClaimReader, ClaimStatusApi};
use crate::ids::ClaimUid;
use crate::inventory::Inventory;
use crate::ledger::DeviceRecord;
use crate::ledger::shares::{Shares, shareable_memory};
use crate::lock::lock;
use crate::sharing::{Sharing, TimeSliceInterval};

/// How many times a transient failure is tried, in all.
pub(super) const ATTEMPTS: u32 = 5;

/// The `Ready` condition's reason.
const REASON: &str = "DevicePrepared";

/// The plugin's status writer and what it wrote.
pub(super) struct ClaimStatus {
    writer: StatusWriter,
    /// The node (for the condition's message).
    node: String,
    /// Claims whose entries this process wrote, is writing, or found the API server drops.
    written: Mutex<HashSet<ClaimUid>>,
}

impl ClaimStatus {
    /// A writer where `api` keeps claim status, else `None`.
    pub(super) fn new(api: &Arc<dyn ClaimReader>, driver: &str, node: &str) -> Option<Self> {
        api.claim_status()?;
        let via = Arc::new(Via(api.clone()));
        Some(Self {
            writer: StatusWriter::new(via, driver),
            node: node.into(),
            written: Mutex::default(),
        })
    }
}

/// The plugin's API as the library's writer takes it.
struct Via(Arc<dyn ClaimReader>);

impl ClaimStatusApi for Via {
    fn apply_claim_status<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
        field_manager: &'a str,
        patch: &'a serde_json::Value,
    ) -> BoxFuture<'a, api::Result<ResourceClaim>> {
        match self.0.claim_status() {
            Some(api) => api.apply_claim_status(namespace, name, field_manager, patch),
            None => Box::pin(async move {
                Err(api::Error::Invalid(
                    format!("this API cannot write the status of resourceclaim {namespace}/{name}")
                        .into(),
                ))
            }),
        }
    }
}

/// An entry's `data`: what the device is, and what holds a share of it. Documented in the
/// README ("Claim status"); fields are added, never renamed or removed.
#[derive(Debug, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceData {
    /// The UUID the containers get: the GPU's (`GPU-…`) or the MIG device's (`MIG-…`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
    /// The physical GPU's UUID (a MIG device's parent; the same as `uuid` for a whole GPU).
    #[serde(rename = "gpuUUID")]
    pub gpu_uuid: String,
    /// A MIG device's profile (`1g.10gb`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mig_profile: Option<String>,
    /// How the claim's containers share the device: `exclusive`, `timeSlicing` or `mps`.
    pub sharing: &'static str,
    /// Time slicing: the interval set on the GPU.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub time_slice: Option<TimeSliceInterval>,
    /// MPS: the client limits its daemon enforces.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mps: Option<MpsData>,
    /// A share of the device (an allocation with consumed capacity): what holds it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub share: Option<ShareData>,
}

/// The MPS client limits of a device.
#[derive(Debug, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct MpsData {
    /// `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub active_thread_percentage: Option<u32>,
    /// `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` for this device, in bytes: per CUDA process.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pinned_memory_limit: Option<u64>,
}

/// What a share consumes of its device and how it is held to it.
#[derive(Debug, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ShareData {
    /// The memory it is held to, in bytes (its soft limit; absent where it is held to none).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory: Option<u64>,
    /// The most it may use, in bytes: its burst limit, else `memory`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory_limit: Option<u64>,
    /// Which limit holds its memory: `container` (the driver's limit on the container's
    /// cgroup, beside MPS's per process) or `process` (MPS's per-process limit only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub enforcement: Option<&'static str>,
    /// The multiprocessors it asked for.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub multiprocessors: Option<u32>,
    /// `--consumable-shares=N`: how many of the GPU's N shares it holds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shares: Option<Shares>,
}

/// The `data` of `d`, the `index`th device of its claim, on a node listing `inv` (its share's
/// memory where it is a part of the device), its memory held at `enforcement`.
pub fn device_data(
    d: &DeviceRecord,
    index: usize,
    inv: Option<&Inventory>,
    enforcement: Option<&'static str>,
) -> DeviceData {
    let mig_uuid = d.mig.as_ref().and_then(|m| m.uuid.as_ref());
    let uuid = match mig_uuid {
        Some(m) => m.to_string(),
        None => d.gpu.to_string(),
    };
    let (time_slice, mps) = match &d.sharing {
        Sharing::Exclusive => (None, None),
        Sharing::TimeSlicing { interval } => (Some(*interval), None),
        Sharing::Mps(s) => {
            let pinned = s
                .per_device_pinned_memory_limit
                .get(&uuid)
                .or_else(|| s.per_device_pinned_memory_limit.get(&index.to_string()))
                .copied()
                .or(s.pinned_memory_limit);
            let mps = MpsData {
                active_thread_percentage: s.active_thread_percentage,
                pinned_memory_limit: pinned,
            };
            (None, Some(mps))
        }
    };
    let share = d.consumed.map(|c| {
        let total = inv.and_then(|inv| inv.memory_of(&d.share_target()));
        let held = match total {
            Some(total) => c.held_memory(shareable_memory(total)),
            None => (c.memory > 0).then_some(c.memory),
        };
        ShareData {
            memory: held,
            memory_limit: c.burst_limit.or(held),
            enforcement,
            multiprocessors: c.multiprocessors,
            shares: c.shares,
        }
    });
    DeviceData {
        gpu_uuid: d.gpu.to_string(),
        mig_profile: d.mig.as_ref().map(|m| m.profile.clone()),
        uuid: (mig_uuid.is_some() || d.mig.is_none()).then_some(uuid),
        sharing: d.sharing.strategy(),
        time_slice,
        mps,
        share,
    }
}

impl Plugin {
    /// After `claim` was prepared with `devices`: its entries are written on their own task,
    /// unless this process wrote them already, is writing them, or writes none.
    pub(super) fn report_prepared(
        &self,
        claim: &ClaimRef,
        devices: &[DeviceRecord],
        inv: Option<Arc<Inventory>>,
    ) {
        let Some(status) = &self.inner.status else {
            return;
        };
        if devices.is_empty() || !lock(&status.written).insert(claim.uid.clone()) {
            return;
        }
        let (plugin, claim, devices) = (self.clone(), claim.clone(), devices.to_vec());
        tokio::spawn(async move { plugin.write_status(claim, devices, inv).await });
    }

    /// After `uid` was unprepared: its entries are left to the API server (module doc); a
    /// prepare of it again writes them again.
    pub(super) fn forget_status(&self, uid: &ClaimUid) {
        if let Some(status) = &self.inner.status {
            lock(&status.written).remove(uid);
        }
    }

    async fn write_status(
        &self,
        claim: ClaimRef,
        devices: Vec<DeviceRecord>,
        inv: Option<Arc<Inventory>>,
    ) {
        let Some(status) = &self.inner.status else {
            return;
        };
        let level = self
            .inner
            .specs
            .levels()
            .get(&claim.uid)
            .map(|l| l.as_str());
        let message = format!("prepared on node {}", status.node);
        let entries: Vec<AllocatedDeviceStatus> = devices
            .iter()
            .enumerate()
            .map(|(i, d)| {
                let data = device_data(d, i, inv.as_deref(), level);
                AllocatedDeviceStatus {
                    conditions: Some(vec![ready(REASON, message.clone())]),
                    // A struct of strings and numbers: its JSON cannot fail.
                    data: serde_json::to_value(data).ok().map(RawExtension),
                    ..status
                        .writer
                        .entry(&d.pool, d.device.as_str(), d.share_id.as_deref())
                }
            })
            .collect();
        let named = kubelet_plugin::Claim::new(&claim.namespace, &claim.name, claim.uid.as_str());
        let who = format!("{}/{}", claim.namespace, claim.name);
        let mut delay = Duration::from_secs(1);
        for attempt in 1..=ATTEMPTS {
            match status.writer.apply(&named, entries.clone()).await {
                Ok(applied) => {
                    if applied == Applied::Written {
                        tracing::debug!(claim.uid = %claim.uid, claim = %who, devices = entries.len(), "claim status written");
                    }
                    return;
                }
                Err(api::Error::Transient(_)) if attempt < ATTEMPTS => {
                    tokio::time::sleep(delay).await;
                    delay *= 2;
                }
                Err(e) => {
                    tracing::warn!(
                        claim.uid = %claim.uid,
                        claim = %who,
                        error = %crate::report::chain(&e),
                        "cannot write the claim's status.devices (the prepare stands); its next \
                         prepare tries again"
                    );
                    lock(&status.written).remove(&claim.uid);
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
