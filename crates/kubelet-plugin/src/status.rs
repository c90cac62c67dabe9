//! A claim's `status.devices` (KEP-4817, GA in Kubernetes 1.37): what a driver reports about each
//! device it prepared, for other components to read (monitoring, queueing, the user) without
//! reading ResourceSlices.
//!
//! [`StatusWriter`] writes a driver's entries with server-side apply, as Go drivers do (dranet:
//! `ApplyStatus` with the driver name as field manager, forced): one `PATCH` of the claim's
//! `status` subresource per call, holding every entry of this driver for the claim. The API
//! server keeps each field manager's entries apart (`status.devices` is a map keyed by driver,
//! pool, device and share ID): entries of other drivers stay, and this driver's entries that a
//! call leaves out are removed, so `apply(claim, vec![])` clears them.
//!
//! Invariants:
//! - Every entry is this writer's driver's: an entry naming another driver is refused before
//!   any request.
//! - The claim written is the one named: its UID is sent, and a claim deleted and re-created
//!   under the same name is [`api::Error::Conflict`], not written.
//! - An API server that drops the field (older than 1.32, or the `DRAResourceClaimDeviceStatus`
//!   feature off) answers the write without the entries: that is [`Applied::Dropped`], logged
//!   once at warn (and once at info when a later write is kept), not an error.
//! - No retries here: the caller decides (the write should not hold up a prepare). A write the
//!   API server does not answer within [`WRITE_DEADLINE`] is [`api::Error::Transient`].
//!
//! The API server validates each entry against the claim's allocation (the driver, pool, device
//! and share ID of one of its results), `data` to at most 10 KiB ([`MAX_DATA`]), and at most 8
//! conditions. When the claim is deallocated, it drops the entries of the devices that went.
//!
//! RBAC: `patch` on `resourceclaims/status`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use k8s_openapi::api::resource::v1::AllocatedDeviceStatus;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use serde_json::json;

use crate::Claim;
use crate::api::{self, ClaimStatusApi};

/// The most bytes the API server takes in an entry's `data`.
pub const MAX_DATA: usize = 10 * 1024;

/// How long a write waits for the API server's answer (as a claim's read does,
/// [`claims::READ_DEADLINE`](crate::claims::READ_DEADLINE)).
pub const WRITE_DEADLINE: std::time::Duration = std::time::Duration::from_secs(10);

/// The condition type that says a device is configured as its class and the claim ask.
pub const READY: &str = "Ready";

/// What a write did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Applied {
    /// The API server stored the entries (or, for an empty list, removed this driver's).
    Written,
    /// The API server answered without the entries: it does not keep `status.devices`.
    Dropped,
}

/// Writes one driver's entries in claims' `status.devices`. Cheap to share; one per driver.
pub struct StatusWriter {
    api: Arc<dyn ClaimStatusApi>,
    driver: String,
    field_manager: String,
    dropped: AtomicBool,
}

impl StatusWriter {
    /// A writer of `driver`'s entries, applied with the driver name as field manager.
    pub fn new(api: Arc<dyn ClaimStatusApi>, driver: impl Into<String>) -> Self {
        let driver = driver.into();
        Self {
            api,
            field_manager: driver.clone(),
            driver,
            dropped: AtomicBool::new(false),
        }
    }

    /// Applies as `manager` instead of the driver name.
    pub fn with_field_manager(mut self, manager: impl Into<String>) -> Self {
        self.field_manager = manager.into();
        self
    }

    /// The field manager the entries are applied as.
    pub fn field_manager(&self) -> &str {
        &self.field_manager
    }

    /// An entry for `device` of `pool`, of this writer's driver, with no conditions or data.
    pub fn entry(&self, pool: &str, device: &str, share_id: Option<&str>) -> AllocatedDeviceStatus {
        AllocatedDeviceStatus {
            driver: self.driver.clone(),
            pool: pool.into(),
            device: device.into(),
            share_id: share_id.map(String::from),
            ..Default::default()
        }
    }

    /// Makes `entries` this driver's entries in `claim`'s `status.devices` (one server-side
    /// apply): added or replaced, and this driver's entries not among them removed. An entry
    /// without a driver gets this writer's; one naming another driver, or with `data` over
    /// [`MAX_DATA`], is refused as [`api::Error::Invalid`] before any request.
    pub async fn apply(
        &self,
        claim: &Claim,
        mut entries: Vec<AllocatedDeviceStatus>,
    ) -> api::Result<Applied> {
        let what = |why: String| {
            api::Error::Invalid(
                format!(
                    "status of resourceclaim {}/{}: {why}",
                    claim.namespace, claim.name
                )
                .into(),
            )
        };
        for e in &mut entries {
            if e.driver.is_empty() {
                e.driver.clone_from(&self.driver);
            }
            if e.driver != self.driver {
                return Err(what(format!(
                    "entry for device {} names driver {}; this writer writes {}'s only",
                    e.device, e.driver, self.driver
                )));
            }
            let size = e
                .data
                .as_ref()
                .map_or(0, |d| serde_json::to_vec(&d.0).map_or(0, |v| v.len()));
            if size > MAX_DATA {
                return Err(what(format!(
                    "data of device {} is {size} bytes, more than the {MAX_DATA} the API server \
                     takes",
                    e.device
                )));
            }
        }
        let patch = json!({
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": claim.name, "namespace": claim.namespace, "uid": claim.uid},
            "status": {"devices": entries},
        });
        let write =
            self.api
                .apply_claim_status(&claim.namespace, &claim.name, &self.field_manager, &patch);
        let stored = tokio::time::timeout(WRITE_DEADLINE, write)
            .await
            .map_err(|_| {
                api::Error::Transient(
                    format!(
                        "status of resourceclaim {}/{}: no answer within {} s",
                        claim.namespace,
                        claim.name,
                        WRITE_DEADLINE.as_secs()
                    )
                    .into(),
                )
            })??;
        let kept = stored
            .status
            .as_ref()
            .and_then(|s| s.devices.as_deref())
            .unwrap_or_default();
        let found = |e: &AllocatedDeviceStatus| {
            kept.iter().any(|k| {
                (&k.driver, &k.pool, &k.device, &k.share_id)
                    == (&e.driver, &e.pool, &e.device, &e.share_id)
            })
        };
        if entries.is_empty() || entries.iter().all(found) {
            if self.dropped.swap(false, Ordering::Relaxed) {
                tracing::info!(
                    driver = %self.driver,
                    "the API server keeps ResourceClaim status.devices now"
                );
            }
            return Ok(Applied::Written);
        }
        if entries.iter().any(found) {
            // Some kept, some not: not a server without the field.
            return Err(what(
                "the API server kept some of the entries and not others".into(),
            ));
        }
        if !self.dropped.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                driver = %self.driver,
                claim = %format!("{}/{}", claim.namespace, claim.name),
                "the API server does not keep ResourceClaim status.devices (Kubernetes before \
                 1.32, or the DRAResourceClaimDeviceStatus feature gate off): device status is \
                 not reported; said once"
            );
        }
        Ok(Applied::Dropped)
    }
}

/// A `Ready` condition, `True` as of now: the device is prepared as its class and the claim's
/// configuration ask. `reason` is a CamelCase word (the API server's rule).
pub fn ready(reason: &str, message: impl Into<String>) -> Condition {
    let now = k8s_openapi::jiff::Timestamp::now();
    Condition {
        type_: READY.into(),
        status: "True".into(),
        reason: reason.into(),
        message: message.into(),
        // Whole seconds, as the API server stores them, so a re-read compares equal.
        last_transition_time: Time(
            k8s_openapi::jiff::Timestamp::from_second(now.as_second()).unwrap_or(now),
        ),
        observed_generation: None,
    }
}

#[cfg(all(test, feature = "testing", feature = "kube"))]
mod tests;
