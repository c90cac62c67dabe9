//! Consumable-capacity shares of a GPU (`--shared-capacity`): what each share consumes, and the
//! check, made when a claim is reserved, that the shares of one GPU fit in it.
//!
//! The scheduler counts the same quantities, so a share that does not fit here is a scheduler
//! bug or an allocation made against slices that have changed since; the node refuses it rather
//! than promise memory the GPU does not have.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use super::{ClaimEntry, DeviceRecord};
use crate::ids::ClaimUid;
use crate::inventory::{GpuUuid, quantity};

/// All of a GPU's compute, in percent of its SMs: the published `compute` capacity, and what a
/// share takes when its claim does not ask (the request policy's default).
pub const FULL_COMPUTE: u32 = 100;
/// The smallest share of a GPU's memory and the step between shares (1 GiB), also what a share
/// takes when its claim does not ask (the request policy's default).
pub const MEMORY_STEP: u64 = 1 << 30;

/// What one share consumes of its GPU: the allocation's `consumedCapacity`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Consumed {
    /// GPU memory in bytes.
    pub memory: u64,
    /// Percent of the GPU's SMs, 1..=100.
    pub compute: u32,
}

impl Consumed {
    fn plus(self, other: Consumed) -> Consumed {
        Consumed {
            memory: self.memory.saturating_add(other.memory),
            compute: self.compute.saturating_add(other.compute),
        }
    }
}

impl fmt::Display for Consumed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} memory, {}% compute",
            quantity(self.memory),
            self.compute
        )
    }
}

/// A share that does not fit beside the others on its GPU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Overcommit {
    /// The device the share is of (`gpu-<minor>-shared`).
    pub device: String,
    pub gpu: GpuUuid,
    pub wanted: Consumed,
    /// What the GPU has in all: its memory, and 100% compute.
    pub total: Consumed,
    /// What the other shares hold, in all.
    pub held: Consumed,
    /// The holders, `namespace/name (uid): <consumed>`, in claim order.
    pub holders: Vec<String>,
}

/// The first share of `devices` (a claim `uid` is about to reserve) that does not fit on its GPU
/// beside the shares other claims hold there, and beside the claim's own earlier shares of it.
/// `memory_of` gives a GPU's memory; a GPU it does not know is not checked (the plan already
/// refused devices that are not on this node).
pub fn overcommitted(
    claims: &BTreeMap<ClaimUid, ClaimEntry>,
    uid: &ClaimUid,
    devices: &[DeviceRecord],
    memory_of: impl Fn(&GpuUuid) -> Option<u64>,
) -> Option<Overcommit> {
    for (i, d) in devices.iter().enumerate() {
        let Some(wanted) = d.consumed else {
            continue;
        };
        let Some(memory) = memory_of(&d.gpu) else {
            continue;
        };
        let mut held = Consumed::default();
        let mut holders = Vec::new();
        for (other_uid, other) in claims.iter().filter(|(u, _)| *u != uid) {
            let mut theirs = Consumed::default();
            for c in other.devices.iter().filter(|o| o.gpu == d.gpu) {
                theirs = theirs.plus(c.consumed.unwrap_or_default());
            }
            if theirs != Consumed::default() {
                held = held.plus(theirs);
                holders.push(format!(
                    "{}/{} ({other_uid}): {theirs}",
                    other.namespace, other.name
                ));
            }
        }
        for own in devices[..i].iter().filter(|o| o.gpu == d.gpu) {
            let theirs = own.consumed.unwrap_or_default();
            held = held.plus(theirs);
            holders.push(format!("this claim's earlier share: {theirs}"));
        }
        let after = held.plus(wanted);
        if after.memory > memory || after.compute > FULL_COMPUTE {
            return Some(Overcommit {
                device: d.device.to_string(),
                gpu: d.gpu.clone(),
                wanted,
                total: Consumed {
                    memory,
                    compute: FULL_COMPUTE,
                },
                held,
                holders,
            });
        }
    }
    None
}
