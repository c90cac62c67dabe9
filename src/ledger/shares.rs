//! Consumable-capacity shares of a GPU (`--shared-capacity`, `--consumable-shares`): the modes,
//! the request policies a shareable GPU publishes in each, what each share consumes, the memory
//! limit CUDA gets for it, and the check, made when a claim is reserved, that the shares of one
//! GPU fit in it.
//!
//! A shareable GPU is one device, `gpu-<minor>`, that the scheduler may allocate many times
//! (`allowMultipleAllocations`). Each allocation consumes every capacity the device publishes:
//! what the claim asks, else the policy's default ([`ConsumableShares`] says which in each mode).
//! `multiprocessors` defaults to 0 in every mode, so a share that asks for none is charged none;
//! what one asks the node applies as a cap. In `memory` mode (`--shared-capacity`) `memory`
//! defaults to the whole GPU, so a claim that asks for none is exclusive: an allocation that
//! consumes less than the whole memory is a share, run under the GPU's MPS daemon with a pinned
//! memory limit, one that consumes all of it is the GPU, exclusive, with no MPS. In `unlimited`
//! and integer mode `memory` defaults to 0 and every allocation is a share.
//!
//! The scheduler counts memory the same way, so a share that does not fit here is an allocation
//! made against slices that have changed since (or a scheduler bug); the node refuses it rather
//! than promise memory the GPU does not have.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use super::{ClaimEntry, DeviceRecord};
use crate::ids::ClaimUid;
use crate::inventory::{DeviceUuid, MemoryLimits, quantity};

/// The step of the published memory policy and the unit of the limit MPS takes (MiB), as in
/// NVIDIA's driver (`consumable_shares.go`).
pub const MEMORY_STEP: u64 = 1 << 20;
/// Most clients one MPS server serves on Volta and later GPUs: no policy allows more shares of a
/// GPU than this (see [`min_share`]).
pub const MAX_SHARES: u64 = 48;
/// The GPU memory the MPS server itself takes, per GPU, out of what its shares consume: each
/// share's CUDA limit is its consumed memory scaled by `(total - MPS_RESERVE) / total`, so that
/// the shares' limits together leave this much for the server. An estimate (the server's
/// context and the per-client state it keeps); the device check (`nvdra` issue 24, item 9)
/// measures it on a real GPU.
pub const MPS_RESERVE: u64 = 1 << 30;

/// How GPUs are published shareable: the values of NVIDIA's DRA driver's `--consumable-shares`
/// (env `CONSUMABLE_SHARES`), which nvdra takes as a drop-in; `memory` is also
/// `--shared-capacity`. The scheduler counts what each mode publishes; the node holds each share
/// to it as far as the mode allows ([`held_memory`], [`shares_thread_percentage`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ConsumableShares {
    /// GPUs are published plain, allocated whole.
    #[default]
    Disabled,
    /// `memory` defaults to the whole GPU (a claim that asks for none gets it exclusively); a
    /// claim asks for a share by memory.
    Memory,
    /// `memory` defaults to 0, so claims that ask for nothing share a GPU without bound (up to
    /// the clients MPS serves); one that asks for memory is held to it.
    Unlimited,
    /// A `shares` capacity of N per GPU, 1 per claim unless it asks for more; `memory` defaults
    /// to 0 as in [`ConsumableShares::Unlimited`].
    Count(ShareCount),
}

/// The `N` of integer mode: 1 to [`MAX_SHARES`], as no more clients fit one MPS server.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct ShareCount(u32);

impl ShareCount {
    /// `n` when it is 1 to [`MAX_SHARES`].
    pub fn new(n: u32) -> Option<Self> {
        (1..=MAX_SHARES as u32).contains(&n).then_some(Self(n))
    }

    pub fn get(self) -> u32 {
        self.0
    }
}

impl ConsumableShares {
    /// Whether GPUs are published shareable at all.
    pub fn enabled(self) -> bool {
        self != ConsumableShares::Disabled
    }

    /// Whether an allocation that consumes all of a GPU's memory is the GPU whole (only in
    /// `memory` mode, where nothing else fits beside it); in the other modes a claim that asks
    /// for nothing consumes no memory, and every allocation is a share.
    pub fn all_memory_is_whole(self) -> bool {
        self == ConsumableShares::Memory
    }
}

impl fmt::Display for ConsumableShares {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConsumableShares::Disabled => f.write_str("disabled"),
            ConsumableShares::Memory => f.write_str("memory"),
            ConsumableShares::Unlimited => f.write_str("unlimited"),
            ConsumableShares::Count(n) => write!(f, "{}", n.get()),
        }
    }
}

impl FromStr for ConsumableShares {
    type Err = String;

    /// NVIDIA's spellings: `disabled`, `memory`, `unlimited`, or a positive integer (here at
    /// most [`MAX_SHARES`]).
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "disabled" => Ok(ConsumableShares::Disabled),
            "memory" => Ok(ConsumableShares::Memory),
            "unlimited" => Ok(ConsumableShares::Unlimited),
            n if !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) => {
                match n.parse::<u32>().ok().and_then(ShareCount::new) {
                    Some(n) => Ok(ConsumableShares::Count(n)),
                    None => Err(format!(
                        "{n} shares per GPU: give 1 to {MAX_SHARES}, as one MPS server serves at \
                         most {MAX_SHARES} clients per GPU"
                    )),
                }
            }
            other => Err(format!(
                "{other:?} is not a mode: give disabled, memory, unlimited or a number of shares \
                 per GPU (1 to {MAX_SHARES})"
            )),
        }
    }
}

impl Serialize for ConsumableShares {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// A string as NVIDIA's Helm value renders it, or a bare number (`consumableShares: 4`).
impl<'de> Deserialize<'de> for ConsumableShares {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Text(String),
            Number(u64),
        }
        let text = match Raw::deserialize(d)? {
            Raw::Text(t) => t,
            Raw::Number(n) => n.to_string(),
        };
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// The memory a shareable GPU publishes: its memory rounded down to a [`MEMORY_STEP`], so that
/// the policy's maximum and default lie on a step, as the API server requires.
pub fn shareable_memory(memory_bytes: u64) -> u64 {
    memory_bytes / MEMORY_STEP * MEMORY_STEP
}

/// Whether a GPU of this much memory is published shareable: it must hold the MPS server's
/// reserve and at least as much again for shares.
pub fn is_shareable(memory_bytes: u64) -> bool {
    shareable_memory(memory_bytes) > 2 * MPS_RESERVE
}

/// The smallest share of a GPU publishing `value` bytes (the policy's `validRange.min`): the
/// smallest whole number of MiB such that at most [`MAX_SHARES`] shares fit, i.e. such that
/// `MAX_SHARES + 1` of them exceed the GPU.
pub fn min_share(value: u64) -> u64 {
    (value / ((MAX_SHARES + 1) * MEMORY_STEP) + 1) * MEMORY_STEP
}

/// The pinned device memory limit CUDA gets for a share consuming `consumed` of a GPU publishing
/// `total`: scaled by `(total - MPS_RESERVE) / total` (see [`MPS_RESERVE`]), rounded down to a
/// MiB (the unit MPS takes).
pub fn cuda_limit(consumed: u64, total: u64) -> u64 {
    if total == 0 {
        return 0;
    }
    let usable = total.saturating_sub(MPS_RESERVE);
    // u128: 80 GiB × 80 GiB overflows u64.
    let scaled = u128::from(consumed) * u128::from(usable) / u128::from(total);
    // At most `consumed`, so it fits a u64.
    (scaled as u64) / MEMORY_STEP * MEMORY_STEP
}

/// `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` for a share that asks for `asked` of `total` SMs: the
/// smallest whole percentage that covers them, 1..=100.
pub fn thread_percentage(asked: u32, total: u32) -> u32 {
    if total == 0 {
        return 100;
    }
    (u64::from(asked) * 100)
        .div_ceil(u64::from(total))
        .clamp(1, 100) as u32
}

/// A share's part in integer mode: `count` of the `of` shares its GPU publishes (what the
/// allocation's `consumedCapacity` says of `shares`, and the mode's N when it was prepared).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Shares {
    pub count: u32,
    pub of: u32,
}

impl fmt::Display for Shares {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} of {} shares", self.count, self.of)
    }
}

/// The memory a share is held to, in bytes, of a GPU publishing `total`: what it consumed (what
/// the scheduler counted), else in integer mode its part of the GPU (`count` of `of`, rounded
/// down to a MiB), else none (an `unlimited` share that asked for no memory: MPS runs it
/// without a memory limit, as the scheduler promised it nothing).
pub fn held_memory(consumed: u64, shares: Option<Shares>, total: u64) -> Option<u64> {
    if consumed > 0 {
        return Some(consumed);
    }
    let Shares { count, of } = shares.filter(|s| s.of > 0)?;
    let part = u128::from(total) * u128::from(count.min(of)) / u128::from(of);
    // At most `total`, so it fits a u64.
    Some((part as u64) / MEMORY_STEP * MEMORY_STEP)
}

/// `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` for a share of `s`: the smallest whole percentage that
/// covers its part of the GPU, 1..=100 (25 for 1 of 4, 34 for 1 of 3).
pub fn shares_thread_percentage(s: Shares) -> u32 {
    if s.of == 0 {
        return 100;
    }
    (u64::from(s.count) * 100)
        .div_ceil(u64::from(s.of))
        .clamp(1, 100) as u32
}

/// What one share consumes of its GPU: the allocation's `consumedCapacity`.
///
/// Checkpoints of version 2 also carry `compute` (percent of the SMs, counted before compute
/// became a cap); it is read and dropped.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Consumed {
    /// GPU memory in bytes.
    pub memory: u64,
    /// SMs the claim asked for (counted by the scheduler, applied here as a cap through the
    /// thread percentage; the node does not count them); absent when it asked for none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub multiprocessors: Option<u32>,
    /// Integer mode (`--consumable-shares=N`): the shares it consumed, of how many. Absent in
    /// the other modes, and in records of builds before it (which read it as absent and drop
    /// it: it decides only the limits of a rewritten CDI spec, and the metrics).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shares: Option<Shares>,
    /// The share's burst limit in bytes, where its config asks for one
    /// (`mpsConfig.defaultPinnedDeviceMemoryLimit`, checked at prepare to lie between what it
    /// is held to and the GPU's memory): the most it may use, its hard limit. Not consumed: the
    /// scheduler packs by `memory` alone. Absent without one, and in records of builds before
    /// it (which read it as absent and drop it: a CDI spec they rewrite holds the container to
    /// its soft limit as its hard one, while the per-process limit in the record's `sharing`
    /// keeps the burst).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub burst_limit: Option<u64>,
}

impl Consumed {
    /// The memory this share is held to on a GPU publishing `total` ([`held_memory`]).
    pub fn held_memory(&self, total: u64) -> Option<u64> {
        held_memory(self.memory, self.shares, total)
    }

    /// The share's memory limits on a GPU publishing `total`: soft, the memory it is held to
    /// ([`Consumed::held_memory`], what the scheduler counted; 0 where that is nothing), and
    /// hard, its burst limit, else the soft one. `None` for a share held to nothing that asks
    /// for no burst limit either (an `unlimited` share that asked for no memory). Never soft
    /// above hard, whatever the record says.
    pub fn memory_limits(&self, total: u64) -> Option<MemoryLimits> {
        let soft = self.held_memory(total);
        let hard = self.burst_limit.or(soft)?;
        let soft = soft.unwrap_or(0);
        Some(MemoryLimits {
            soft,
            hard: hard.max(soft),
        })
    }
}

impl fmt::Display for Consumed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} memory", quantity(self.memory))?;
        if let Some(sms) = self.multiprocessors {
            write!(f, ", {sms} multiprocessors")?;
        }
        if let Some(s) = self.shares {
            write!(f, ", {s}")?;
        }
        if let Some(b) = self.burst_limit {
            write!(f, ", burst limit {}", quantity(b))?;
        }
        Ok(())
    }
}

/// A share that does not fit beside the others on its GPU or MIG device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Overcommit {
    /// The device the share is of (`gpu-<minor>`, or a MIG device's name).
    pub device: String,
    /// Its UUID ([`DeviceRecord::share_target`]).
    pub gpu: DeviceUuid,
    /// Memory the share consumes, in bytes.
    pub wanted: u64,
    /// The device's memory, in bytes.
    pub total: u64,
    /// What the other shares hold, in all, in bytes.
    pub held: u64,
    /// The holders, `namespace/name (uid): <consumed>`, in claim order.
    pub holders: Vec<String>,
}

/// The first share of `devices` (a claim `uid` is about to reserve) that does not fit on its GPU
/// or MIG device ([`DeviceRecord::share_target`]) beside the shares other claims hold there, and
/// beside the claim's own earlier shares of it. Only memory is counted: multiprocessors are a
/// cap. `memory_of` gives a shared device's memory; a device it does not know is not checked
/// (the plan already refused devices that are not on this node).
pub fn overcommitted(
    claims: &BTreeMap<ClaimUid, ClaimEntry>,
    uid: &ClaimUid,
    devices: &[DeviceRecord],
    memory_of: impl Fn(&DeviceUuid) -> Option<u64>,
) -> Option<Overcommit> {
    for (i, d) in devices.iter().enumerate() {
        let Some(wanted) = d.consumed else {
            continue;
        };
        let target = d.share_target();
        let Some(total) = memory_of(&target) else {
            continue;
        };
        let mut held = 0u64;
        let mut holders = Vec::new();
        for (other_uid, other) in claims.iter().filter(|(u, _)| *u != uid) {
            let theirs: u64 = other
                .devices
                .iter()
                .filter(|o| o.share_target() == target)
                .filter_map(|o| o.consumed)
                .map(|c| c.memory)
                .fold(0, u64::saturating_add);
            if theirs > 0 {
                held = held.saturating_add(theirs);
                holders.push(format!(
                    "{}/{} ({other_uid}): {}",
                    other.namespace,
                    other.name,
                    quantity(theirs)
                ));
            }
        }
        for own in devices[..i].iter().filter(|o| o.share_target() == target) {
            let theirs = own.consumed.map_or(0, |c| c.memory);
            held = held.saturating_add(theirs);
            holders.push(format!("this claim's earlier share: {}", quantity(theirs)));
        }
        if held.saturating_add(wanted.memory) > total {
            return Some(Overcommit {
                device: d.device.to_string(),
                gpu: target,
                wanted: wanted.memory,
                total,
                held,
                holders,
            });
        }
    }
    None
}

/// The first GPU or MIG device of `devices` (a claim `uid` is about to reserve) on which its
/// shares, beside those of the other claims, would be more than [`MAX_SHARES`]: the device and
/// how many shares it would hold (a MIG device's shares have an MPS server of their own). One MPS server serves at most that many clients; `memory` mode's smallest
/// share already keeps a GPU under it, but in `unlimited` mode claims that ask for nothing
/// consume nothing, and the scheduler allocates them without bound.
pub fn too_many_shares(
    claims: &BTreeMap<ClaimUid, ClaimEntry>,
    uid: &ClaimUid,
    devices: &[DeviceRecord],
) -> Option<(DeviceUuid, usize)> {
    for (i, d) in devices.iter().enumerate() {
        if d.consumed.is_none() {
            continue;
        }
        let target = d.share_target();
        let on = |o: &&DeviceRecord| o.consumed.is_some() && o.share_target() == target;
        let others: usize = claims
            .iter()
            .filter(|(u, _)| *u != uid)
            .map(|(_, e)| e.devices.iter().filter(on).count())
            .sum();
        let held = others + devices[..=i].iter().filter(on).count();
        if held > MAX_SHARES as usize {
            return Some((target, held));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    const H100: u64 = 80 << 30;

    #[test]
    fn the_policy_allows_at_most_the_clients_mps_serves() {
        for memory in [H100, 81559 << 20, (94 << 30) + 12345, 16 << 30, 3 << 30] {
            let value = shareable_memory(memory);
            assert_eq!(value % MEMORY_STEP, 0);
            assert!(value <= memory && memory - value < MEMORY_STEP);
            let min = min_share(value);
            assert_eq!(min % MEMORY_STEP, 0, "{memory}");
            assert!(
                value / min <= MAX_SHARES,
                "{memory}: {} shares",
                value / min
            );
            // And no larger than that: one MiB less would let a 49th share in.
            assert!(value / (min - MEMORY_STEP) > MAX_SHARES, "{memory}");
        }
        // 81920 MiB: 48 × 1672 MiB fit, 49 do not (49 × 1671 MiB would).
        assert_eq!(min_share(H100), 1672 << 20);
        assert!(is_shareable(H100));
        assert!(!is_shareable(2 << 30));
    }

    #[test]
    fn a_shares_cuda_limit_leaves_the_reserve_for_the_server() {
        // 24Gi of 80Gi: 24576 MiB × 79/80 = 24268.8 MiB, rounded down.
        assert_eq!(cuda_limit(24 << 30, H100), 24268 << 20);
        // The whole GPU's worth of shares leaves exactly the reserve.
        assert_eq!(cuda_limit(H100, H100), H100 - MPS_RESERVE);
        let three = 3 * cuda_limit(H100 / 3 / MEMORY_STEP * MEMORY_STEP, H100);
        assert!(three <= H100 - MPS_RESERVE, "{three}");
        assert_eq!(cuda_limit(1 << 30, 0), 0);
    }

    #[test]
    fn modes_read_as_nvidia_spells_them_and_refuse_what_mps_cannot_serve() {
        let parse = |s: &str| s.parse::<ConsumableShares>();
        assert_eq!(parse("disabled"), Ok(ConsumableShares::Disabled));
        assert_eq!(parse("memory"), Ok(ConsumableShares::Memory));
        assert_eq!(parse(" unlimited "), Ok(ConsumableShares::Unlimited));
        let four = ShareCount::new(4).unwrap();
        assert_eq!(parse("4"), Ok(ConsumableShares::Count(four)));
        assert_eq!(parse("48").unwrap().to_string(), "48");
        for bad in ["0", "49", "99999999999", "-1", "Memory", "", "4.5"] {
            assert!(parse(bad).is_err(), "{bad}");
        }
        assert!(parse("49").unwrap_err().contains("at most 48 clients"));
        for m in ["disabled", "memory", "unlimited", "7"] {
            assert_eq!(parse(m).unwrap().to_string(), m);
        }
        // The file may give the number bare, as YAML reads `consumableShares: 4`.
        let from_yaml = |t: &str| serde_json::from_str::<ConsumableShares>(t);
        assert_eq!(from_yaml("4").unwrap(), ConsumableShares::Count(four));
        assert_eq!(from_yaml("\"4\"").unwrap(), ConsumableShares::Count(four));
        assert_eq!(
            from_yaml("\"unlimited\"").unwrap(),
            ConsumableShares::Unlimited
        );
        assert!(from_yaml("0").is_err());
        assert_eq!(
            serde_json::to_string(&ConsumableShares::Count(four)).unwrap(),
            "\"4\""
        );
        assert!(ConsumableShares::Unlimited.enabled() && !ConsumableShares::Disabled.enabled());
        assert!(ConsumableShares::Memory.all_memory_is_whole());
        assert!(!ConsumableShares::Count(four).all_memory_is_whole());
        assert!(!ConsumableShares::Unlimited.all_memory_is_whole());
    }

    #[test]
    fn a_share_is_held_to_its_memory_else_its_part_of_the_gpu_else_nothing() {
        let of = |count, of| Some(Shares { count, of });
        // Asked memory wins, in any mode.
        assert_eq!(held_memory(8 << 30, of(1, 4), H100), Some(8 << 30));
        assert_eq!(held_memory(8 << 30, None, H100), Some(8 << 30));
        // k of N shares: k/N of the GPU, in whole MiB.
        assert_eq!(held_memory(0, of(1, 4), H100), Some(20 << 30));
        assert_eq!(held_memory(0, of(2, 4), H100), Some(40 << 30));
        assert_eq!(held_memory(0, of(1, 3), H100), Some(27306 << 20));
        assert_eq!(held_memory(0, of(3, 3), H100), Some(H100));
        // More than N cannot be allocated; a record that says so is held to the GPU.
        assert_eq!(held_memory(0, of(9, 4), H100), Some(H100));
        // unlimited, asking nothing (and a broken record): no memory limit.
        assert_eq!(held_memory(0, None, H100), None);
        assert_eq!(held_memory(0, of(1, 0), H100), None);
        let c = Consumed {
            memory: 0,
            multiprocessors: None,
            shares: of(1, 4),
            burst_limit: None,
        };
        assert_eq!(c.held_memory(H100), Some(20 << 30));
        assert_eq!(c.to_string(), "0 memory, 1 of 4 shares");
        let pct = |count, of| shares_thread_percentage(Shares { count, of });
        assert_eq!(pct(1, 4), 25);
        assert_eq!(pct(1, 3), 34);
        assert_eq!(pct(4, 4), 100);
        assert_eq!(pct(0, 4), 1);
        assert_eq!(pct(1, 0), 100);
    }

    /// Soft: what the share is held to (what the scheduler counted); hard: its burst limit,
    /// else the soft one. The hook refuses soft above hard, so no record may give that.
    #[test]
    fn a_shares_limits_are_what_it_is_held_to_and_its_burst() {
        let c = |memory, shares, burst_limit| Consumed {
            memory,
            multiprocessors: None,
            shares,
            burst_limit,
        };
        let limits = |soft, hard| Some(MemoryLimits { soft, hard });
        assert_eq!(
            c(24 << 30, None, None).memory_limits(H100),
            limits(24 << 30, 24 << 30)
        );
        assert_eq!(
            c(24 << 30, None, Some(40 << 30)).memory_limits(H100),
            limits(24 << 30, 40 << 30)
        );
        // 1 of 4 shares: a fourth of the GPU guaranteed, up to its burst.
        let quarter = Some(Shares { count: 1, of: 4 });
        assert_eq!(
            c(0, quarter, Some(H100)).memory_limits(H100),
            limits(20 << 30, H100)
        );
        // unlimited, asking nothing: no limit, unless it caps itself (nothing guaranteed).
        assert_eq!(c(0, None, None).memory_limits(H100), None);
        assert_eq!(
            c(0, None, Some(8 << 30)).memory_limits(H100),
            limits(0, 8 << 30)
        );
        // A record with its burst below what it consumed (prepare refuses that): the soft.
        assert_eq!(
            c(24 << 30, None, Some(8 << 30)).memory_limits(H100),
            limits(24 << 30, 24 << 30)
        );
        assert_eq!(
            c(24 << 30, None, Some(40 << 30)).to_string(),
            "24Gi memory, burst limit 40Gi"
        );
    }

    #[test]
    fn asked_multiprocessors_become_the_smallest_percentage_covering_them() {
        assert_eq!(thread_percentage(132, 132), 100);
        assert_eq!(thread_percentage(33, 132), 25);
        assert_eq!(thread_percentage(34, 132), 26);
        assert_eq!(thread_percentage(1, 132), 1);
        assert_eq!(thread_percentage(0, 132), 1);
        assert_eq!(thread_percentage(500, 132), 100);
    }

    /// Shares are counted per shared device: a MIG device's shares against its own memory and
    /// MPS server, apart from its GPU's other MIG devices; a share of one MIG device does not
    /// conflict with a share of another, but does with the MIG device whole and with a share of
    /// the whole GPU.
    #[test]
    fn shares_of_a_mig_device_are_counted_and_exclusive_per_mig_device() {
        use crate::ids::DeviceName;
        use crate::inventory::{GpuUuid, MigUuid, Placement};
        use crate::ledger::{ClaimState, MigRecord};
        let gpu = GpuUuid("GPU-a".into());
        let record = |mig: Option<(&str, u32)>, memory: Option<u64>| DeviceRecord {
            requests: vec!["r".into()],
            pool: "node-a".into(),
            device: DeviceName::parse("gpu-0").unwrap(),
            cdi_ids: vec![],
            share_id: None,
            admin_access: false,
            gpu: gpu.clone(),
            mig: mig.map(|(uuid, start)| MigRecord {
                uuid: Some(MigUuid(uuid.into())),
                profile: "3g.40gb".into(),
                gi_profile_id: 9,
                placement: Placement { start, size: 4 },
                created: false,
            }),
            consumed: memory.map(|memory| Consumed {
                memory,
                ..Default::default()
            }),
            sharing: crate::sharing::Sharing::Exclusive,
        };
        let (m0, m4) = (Some(("MIG-0", 0)), Some(("MIG-4", 4)));
        let share = |mig, gib: u64| record(mig, Some(gib << 30));
        assert!(!share(m0, 8).conflicts_with(&share(m0, 8)));
        assert!(!share(m0, 8).conflicts_with(&share(m4, 8)));
        assert!(
            share(m0, 8).conflicts_with(&record(m0, None)),
            "whole MIG device"
        );
        assert!(
            !share(m0, 8).conflicts_with(&record(m4, None)),
            "another one"
        );
        assert!(
            share(m0, 8).conflicts_with(&share(None, 8)),
            "a share of the GPU"
        );
        assert_eq!(
            share(m0, 8).share_target(),
            DeviceUuid::Mig(MigUuid("MIG-0".into()))
        );
        assert_eq!(share(None, 8).share_target(), DeviceUuid::Gpu(gpu.clone()));

        let claims: BTreeMap<ClaimUid, ClaimEntry> = [("a", m0), ("b", m4)]
            .into_iter()
            .map(|(uid, mig)| {
                let e = ClaimEntry {
                    state: ClaimState::PrepareCompleted,
                    namespace: "ns".into(),
                    name: uid.into(),
                    devices: vec![share(mig, 30)],
                    pods: vec![],
                    user: None,
                    trust_label: None,
                };
                (ClaimUid::parse(uid).unwrap(), e)
            })
            .collect();
        let memory_of = |d: &DeviceUuid| match d {
            DeviceUuid::Mig(_) => Some(40 << 30),
            DeviceUuid::Gpu(_) => Some(80 << 30),
        };
        let me = ClaimUid::parse("c").unwrap();
        // 30Gi + 10Gi fit a 40Gi MIG device; the other MIG device's 30Gi are not counted.
        assert_eq!(
            overcommitted(&claims, &me, &[share(m0, 10)], memory_of),
            None
        );
        let o = overcommitted(&claims, &me, &[share(m0, 11)], memory_of).unwrap();
        assert_eq!(o.gpu, DeviceUuid::Mig(MigUuid("MIG-0".into())));
        assert_eq!((o.held, o.total), (30 << 30, 40 << 30));
        assert_eq!(o.holders.len(), 1, "{:?}", o.holders);
        // One share each so far: the cap counts per MIG device.
        let mut many = claims.clone();
        for i in 0..MAX_SHARES - 1 {
            let uid = ClaimUid::parse(format!("m{i}")).unwrap();
            let mut e = many[&ClaimUid::parse("a").unwrap()].clone();
            e.devices = vec![share(m0, 0)];
            many.insert(uid, e);
        }
        assert_eq!(
            too_many_shares(&many, &me, &[share(m4, 0)]),
            None,
            "MIG-4 holds 1"
        );
        assert_eq!(
            too_many_shares(&many, &me, &[share(m0, 0)]),
            Some((DeviceUuid::Mig(MigUuid("MIG-0".into())), 49))
        );
    }
}
