//! The pure half of a prepare: from a claim as the API server returned it, the node's inventory
//! and the plugin's settings to the device records to reserve. No I/O here; every function is a
//! function of its arguments. A claim's prepare calls [`plan`] once and works from the records it
//! returns: what the GPU changes and what the CDI spec names are functions of records (the
//! [effects](super::effects) and the [specs](super::specs)), which recovery and a repeated
//! prepare read from the checkpoint, and whether another claim holds a device is the ledger's
//! answer at reservation.

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::{DeviceRequestAllocationResult, ResourceClaim};
use kubelet_plugin::PrepareClaim;

use super::{ClaimError, ClaimRef, Options};
use crate::cdi::{self, CdiOptions};
use crate::ids::{DeviceName, PublishedDevice, find_device};
use crate::inventory::{self, DeviceUuid, Gpu, GpuUuid, Inventory, MigDevice, Placement, quantity};
use crate::ledger::shares::{self, ConsumableShares, Shares};
use crate::ledger::{Consumed, DeviceRecord, MigRecord, PodRef};
use crate::sharing::{self, DeviceKind, MpsSettings, Sharing};

/// What preparing one claim takes: the devices to reserve, in allocation order, one record per
/// distinct device (a device several requests share is one record naming them all).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Plan {
    pub devices: Vec<DeviceRecord>,
    /// The pods the claim is reserved for, recorded for `/metrics`' attribution only.
    pub pods: Vec<PodRef>,
    /// The user its pod runs as, for a share of a GPU whose MPS serves one user at a time
    /// (set by prepare, which reads the pod).
    pub user: Option<crate::ledger::ShareUser>,
    /// Under `--share-trust-domain=label:<key>`, for a share: the value of that label on the
    /// claim's namespace (set by prepare, which reads the Namespace; `None` without the label).
    pub trust_label: Option<crate::sharing::trust::TrustLabel>,
    /// Dynamic MIG: the GPUs whose MIG mode this prepare switches, each once, in order of
    /// their first device: on (`true`) for a placement on a GPU outside MIG mode, off for a
    /// GPU in MIG mode allocated whole.
    pub mig_modes: Vec<(GpuUuid, bool)>,
}

impl Plan {
    /// Whether the claim holds shares of a GPU or MIG device (`consumed`): only then do their
    /// checks, their daemon and their GPU's compute mode concern it.
    pub fn has_shares(&self) -> bool {
        self.devices.iter().any(|d| d.consumed.is_some())
    }

    /// Whether preparing changes GPU state (creates a MIG instance, starts the claim's MPS
    /// daemon, sets a time slice), which must be recorded durably before it happens so that a
    /// crash can be undone. A share of a GPU (`consumed`) does not count: its daemon is the GPU's,
    /// usually running already, and started only once the claim's completed record is durable
    /// (`Plugin::ensure_share_daemons`), which start-up then completes rather than undoes.
    pub fn touches_hardware(&self) -> bool {
        self.devices.iter().any(|d| {
            d.mig.as_ref().is_some_and(|m| m.created)
                || (!matches!(d.sharing, Sharing::Exclusive) && d.consumed.is_none())
        }) || !self.mig_modes.is_empty()
    }
}

/// Turns the claim's results into device records. The claim was checked and its results for
/// this driver picked where it was read (`kubelet_plugin::claims::check`: the claim the kubelet
/// named, allocated), so neither is done again here.
pub(super) fn plan(
    opts: &Options,
    cdi: &CdiOptions,
    claim: &ClaimRef,
    read: &PrepareClaim,
    inv: &Inventory,
) -> Result<Plan, ClaimError> {
    let rc = &read.resource_claim;
    let allocation = rc.status.as_ref().and_then(|s| s.allocation.as_ref());
    let entries = allocation.map(sharing::from_allocation).unwrap_or_default();
    let mut out: Vec<DeviceRecord> = Vec::new();
    let mut mig_modes: Vec<(GpuUuid, bool)> = Vec::new();
    let mut index: BTreeMap<(&str, &str), usize> = BTreeMap::new();
    for r in &read.results {
        let unknown = |reason: String| ClaimError::UnknownDevice {
            pool: r.pool.clone(),
            device: r.device.clone(),
            ours: opts.pool.clone(),
            reason,
        };
        if r.pool != opts.pool {
            return Err(unknown("the pool is another node's".into()));
        }
        let base = kubelet_plugin::claims::base_request(&r.request).to_string();
        if let Some(&i) = index.get(&(r.pool.as_str(), r.device.as_str())) {
            if out[i].share_id.is_some() || r.share_id.is_some() {
                return Err(ClaimError::BadShare {
                    device: r.device.clone(),
                    request: r.request.clone(),
                    reason: format!(
                        "the claim already has an allocation of it (request {}); a container \
                         sees one memory limit per GPU, so ask for one share of the sum",
                        out[i].requests.join(", ")
                    ),
                });
            }
            let d: &mut DeviceRecord = &mut out[i];
            if !d.requests.contains(&base) {
                d.requests.push(base);
            }
            continue;
        }
        let resolved = resolve_device(inv, &r.device, opts).map_err(unknown)?;
        if r.admin_access == Some(true)
            && let Some(why) = admin_access_changes(resolved)
        {
            return Err(ClaimError::AdminAccessNeedsChange {
                device: r.device.clone(),
                why,
            });
        }
        // The name the inventory gives the device: the allocation's name, parsed.
        let name = match resolved {
            Resolved::Gpu(g) => DeviceName::gpu(g.minor),
            Resolved::Mig(g, m) => {
                DeviceName::mig(g.minor, &m.profile, m.gi_profile_id, m.placement.start)
            }
            Resolved::MigToCreate(g, p, placement) => {
                DeviceName::mig(g.minor, &p.name, p.gi_profile_id, placement.start)
            }
        };
        // Dynamic MIG: the GPU's mode follows what it is allocated as.
        let mode = match resolved {
            Resolved::Gpu(g) if g.in_mig_mode() => Some((g, false)),
            Resolved::MigToCreate(g, ..) if !g.in_mig_mode() => Some((g, true)),
            _ => None,
        };
        if let Some((g, enable)) = mode {
            match mig_modes.iter().find(|(u, _)| *u == g.uuid) {
                None => mig_modes.push((g.uuid.clone(), enable)),
                Some((_, e)) if *e == enable => {}
                Some(_) => {
                    return Err(unknown(format!(
                        "the claim asks for GPU {} whole and for a MIG device of it; a GPU is \
                         either whole or in MIG mode",
                        g.minor
                    )));
                }
            }
        }
        let (gpu, mig, kind) = match resolved {
            Resolved::Gpu(g) => (g, None, DeviceKind::Gpu),
            Resolved::Mig(g, m) => (
                g,
                Some(MigRecord {
                    uuid: Some(m.uuid.clone()),
                    profile: m.profile.clone(),
                    gi_profile_id: m.gi_profile_id,
                    placement: m.placement,
                    created: false,
                }),
                DeviceKind::Mig,
            ),
            Resolved::MigToCreate(g, p, placement) => (
                g,
                Some(MigRecord {
                    uuid: None,
                    profile: p.name.clone(),
                    gi_profile_id: p.gi_profile_id,
                    placement,
                    created: true,
                }),
                DeviceKind::Mig,
            ),
        };
        let config_err = |source| ClaimError::Config {
            claim: format!("{}/{}", claim.namespace, claim.name),
            request: r.request.clone(),
            source,
        };
        let config =
            sharing::config_for_device(&entries, &opts.driver, &r.request, kind, &r.device)
                .map_err(config_err)?;
        let mut sharing = sharing::sharing_for(config, kind, &r.device).map_err(config_err)?;
        let mut consumed = None;
        // Only a GPU or a MIG device that exists is published shareable.
        let shareable = match resolved {
            Resolved::Gpu(g) => Some(Shareable {
                memory_bytes: g.memory_bytes,
                multiprocessors: g.multiprocessors,
                target: DeviceUuid::Gpu(g.uuid.clone()),
            }),
            Resolved::Mig(_, m) => Some(Shareable {
                memory_bytes: m.memory_bytes,
                multiprocessors: Some(m.multiprocessors),
                target: DeviceUuid::Mig(m.uuid.clone()),
            }),
            Resolved::MigToCreate(..) => None,
        };
        if let Some(shareable) = shareable
            && let Some((share, settings)) = share(opts, claim, r, &shareable, &sharing, &out)?
        {
            consumed = Some(share);
            // The share's limits are its MPS client settings, behind the device's daemon.
            sharing = Sharing::Mps(settings);
        }
        index.insert((r.pool.as_str(), r.device.as_str()), out.len());
        out.push(DeviceRecord {
            requests: vec![base],
            pool: r.pool.clone(),
            cdi_ids: vec![cdi::device_id(cdi, claim.uid.as_str(), name.as_str())],
            device: name,
            share_id: r.share_id.clone(),
            admin_access: r.admin_access.unwrap_or(false),
            gpu: gpu.uuid.clone(),
            mig,
            consumed,
            sharing,
        });
    }
    Ok(Plan {
        devices: out,
        pods: reserved_pods(rc),
        user: None,
        trust_label: None,
        mig_modes,
    })
}

/// The pods of `rc`'s `status.reservedFor` (entries of other resources are left out).
pub(super) fn reserved_pods(rc: &ResourceClaim) -> Vec<PodRef> {
    let mut pods: Vec<PodRef> = rc
        .status
        .iter()
        .flat_map(|s| s.reserved_for.iter().flatten())
        .filter(|r| r.resource == "pods" && r.api_group.as_deref().unwrap_or_default().is_empty())
        .map(|r| PodRef {
            name: r.name.clone(),
            uid: r.uid.clone(),
        })
        .collect();
    pods.sort();
    pods.dedup();
    pods
}

/// What a share divides: a GPU, or an existing MIG device (whose share runs under the MIG
/// device's own MPS daemon, held per process: NVIDIA's memory partitioning excludes MIG).
struct Shareable {
    memory_bytes: u64,
    multiprocessors: Option<u32>,
    /// What the share's daemon, count and memory are keyed by ([`DeviceRecord::share_target`]).
    target: DeviceUuid,
}

/// Whether result `r` of a GPU or MIG device (`gpu`) is a share of it, and if so what it
/// consumes and the MPS client settings that enforce it; `None` for the device whole.
///
/// Without a `shareID` the allocation is a plain one, and an admin-access allocation is never a
/// share. Which allocation with a `shareID` is a share depends on the mode
/// (`opts.shared_capacity`):
/// - `memory` (`--shared-capacity`): one whose `consumedCapacity` holds less `memory` than the
///   GPU publishes; without `memory`, or with all of it, it took the policy's default, the whole
///   GPU: exclusive, with no MPS.
/// - `unlimited` and integer `N` (`--consumable-shares`): every one, as the policy's default
///   memory is 0 and others may be allocated beside it.
///
/// A share's memory limits are soft, the memory it is held to ([`Consumed::held_memory`]: what
/// it consumed, else in integer mode its `shares` part of the GPU, else none), and hard, its
/// burst limit where its config asks for one (NVIDIA's `mpsConfig.defaultPinnedDeviceMemoryLimit`,
/// between the soft limit and the GPU's memory: [`sharing::ShareConfig::hard_limit`]), else the
/// soft one ([`Consumed::memory_limits`]). Its CUDA memory limit, per process, is the hard limit
/// less its part of the MPS server's own ([`shares::cuda_limit`]): where the driver does not
/// partition memory per cgroup it is the only cap. Its thread percentage comes from its config
/// (`mpsConfig.defaultActiveThreadPercentage`), else from the multiprocessors it asked for, else
/// in integer mode from its shares, else it has none. Refused: a share where the GPU is not
/// published shareable, memory below the `memory` mode's minimum or above the GPU, `shares`
/// above N or outside integer mode, quantities that are not the published kind, a config the
/// share cannot follow ([`sharing::share_config`]) or a burst limit outside those bounds, each
/// naming the claim and the field, and a second GPU's share beside the claim's first (a
/// container has one MPS pipe directory).
fn share(
    opts: &Options,
    claim: &ClaimRef,
    r: &DeviceRequestAllocationResult,
    gpu: &Shareable,
    configured: &Sharing,
    earlier: &[DeviceRecord],
) -> Result<Option<(Consumed, MpsSettings)>, ClaimError> {
    let bad = |reason: String| ClaimError::BadShare {
        device: r.device.clone(),
        request: r.request.clone(),
        reason,
    };
    let again = "the allocation was made against other slices: delete the pod so the scheduler \
                 places it again";
    // Admin access (monitoring) reaches the GPU beside whoever uses it, outside its MPS daemon.
    if r.share_id.is_none() || r.admin_access == Some(true) {
        return Ok(None);
    }
    let mode = opts.shared_capacity;
    let consumed = r.consumed_capacity.as_ref();
    let get = |name: &str| consumed.and_then(|c| c.get(name)).map(|q| q.0.as_str());
    let memory = match get("memory") {
        None => None,
        Some(q) => Some(
            inventory::parse_quantity(q)
                .ok_or_else(|| bad(format!("consumed memory {q:?} is not a quantity of bytes")))?,
        ),
    };
    let total = shares::shareable_memory(gpu.memory_bytes);
    // Where a claim that asks for no memory takes all of it, all of it is the GPU whole.
    if (!mode.enabled() || mode.all_memory_is_whole()) && memory.is_none_or(|m| m >= total) {
        return Ok(None);
    }
    let memory = memory.unwrap_or(0);
    if !mode.enabled() {
        return Err(bad(format!(
            "it consumes {} of the GPU's memory, a share, but shares are prepared only with \
             --shared-capacity or --consumable-shares (was the switch turned off after the \
             claim was allocated?); delete the pod so the scheduler places it again",
            quantity(memory)
        )));
    }
    if !shares::is_shareable(gpu.memory_bytes) {
        return Err(bad(format!(
            "it is a share ({} of the GPU's memory), but the GPU ({} of memory) is too small to \
             be shared and is not published shareable; delete the pod so the scheduler places \
             it again",
            quantity(memory),
            quantity(gpu.memory_bytes)
        )));
    }
    if memory > total {
        return Err(bad(format!(
            "it consumes {} of the GPU's memory, more than the GPU publishes ({}); {again}",
            quantity(memory),
            quantity(total)
        )));
    }
    let min = shares::min_share(total);
    if mode == ConsumableShares::Memory && memory < min {
        return Err(bad(format!(
            "it consumes {} of the GPU's memory, less than the smallest share the GPU publishes \
             ({}, so that at most {} shares fit, as many as MPS serves); {again}",
            quantity(memory),
            quantity(min),
            shares::MAX_SHARES
        )));
    }
    let shares = match (mode, get("shares")) {
        (ConsumableShares::Count(n), q) => {
            // Absent only where an allocation was written without it: the policy's default.
            let count = match q {
                None => 1,
                Some(q) => inventory::parse_quantity(q)
                    .and_then(|k| u32::try_from(k).ok())
                    .filter(|k| *k > 0)
                    .ok_or_else(|| {
                        bad(format!(
                            "consumed shares {q:?} is not a whole number of shares of at least 1"
                        ))
                    })?,
            };
            if count > n.get() {
                return Err(bad(format!(
                    "it consumes {count} shares, more than the {} the GPU publishes; {again}",
                    n.get()
                )));
            }
            Some(Shares { count, of: n.get() })
        }
        (_, None) => None,
        (_, Some(q)) => {
            return Err(bad(format!(
                "it consumes shares ({q}), but GPUs publish shares only with \
                 --consumable-shares=<N>, and this node runs --consumable-shares={mode}; {again}"
            )));
        }
    };
    if let Some(other) = earlier
        .iter()
        .find(|d| d.consumed.is_some() && d.share_target() != gpu.target)
    {
        return Err(bad(format!(
            "the claim already has a share of another GPU ({}); a container has one MPS pipe \
             directory, so one claim's shares must be of one GPU",
            other.device
        )));
    }
    let multiprocessors = match get("multiprocessors") {
        None => None,
        Some(q) => {
            let n = inventory::parse_quantity(q)
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| {
                    bad(format!(
                        "consumed multiprocessors {q:?} is not a whole number of SMs"
                    ))
                })?;
            (n > 0).then_some(n)
        }
    };
    let config_err = |source| ClaimError::Config {
        claim: format!("{}/{}", claim.namespace, claim.name),
        request: r.request.clone(),
        source,
    };
    let configured = sharing::share_config(configured).map_err(config_err)?;
    let active_thread_percentage = configured
        .active_thread_percentage
        .or_else(|| {
            let total = gpu.multiprocessors?;
            multiprocessors.map(|k| shares::thread_percentage(k, total))
        })
        .or_else(|| shares.map(shares::shares_thread_percentage));
    let mut consumed = Consumed {
        memory,
        multiprocessors,
        shares,
        burst_limit: None,
    };
    // Checked against what the share is held to, and recorded: the spec rewritten at start
    // needs it.
    configured
        .hard_limit(consumed.held_memory(total), total)
        .map_err(config_err)?;
    consumed.burst_limit = configured.burst_limit;
    Ok(Some((
        consumed,
        MpsSettings {
            active_thread_percentage,
            pinned_memory_limit: consumed
                .memory_limits(total)
                .map(|l| shares::cuda_limit(l.hard, total)),
            per_device_pinned_memory_limit: BTreeMap::new(),
        },
    )))
}

/// What an allocated device name stands for on this node.
#[derive(Clone, Copy)]
enum Resolved<'a> {
    /// A whole GPU, or (`--shared-capacity`) a share of it: its allocation result says which.
    Gpu(&'a Gpu),
    Mig(&'a Gpu, &'a MigDevice),
    /// A placement with no instance yet: created at prepare (partitionable mode).
    MigToCreate(&'a Gpu, &'a inventory::MigProfile, Placement),
}

/// What preparing `resolved` would change on the GPU, which admin access must not: it is outside
/// every conflict check (the scheduler allocates it beside other claims, and the ledger lets it
/// overlap them), so an instance it created or a MIG mode it switched could land under a claim
/// already prepared, e.g. turn MIG mode on under a whole-GPU claim whose pod has not started.
/// `None` for a device that exists as it is allocated: a GPU outside MIG mode, or a MIG device.
fn admin_access_changes(resolved: Resolved<'_>) -> Option<String> {
    match resolved {
        Resolved::MigToCreate(g, ..) if !g.in_mig_mode() => Some(format!(
            "no MIG device exists at this placement and GPU {} is not in MIG mode, so preparing \
             it would turn MIG mode on and create the instance",
            g.minor
        )),
        Resolved::MigToCreate(..) => Some(
            "no MIG device exists at this placement, so preparing it would create the instance"
                .into(),
        ),
        Resolved::Gpu(g) if g.in_mig_mode() => Some(format!(
            "GPU {} is in MIG mode, so preparing it whole would turn MIG mode off",
            g.minor
        )),
        Resolved::Gpu(_) | Resolved::Mig(..) => None,
    }
}

/// Resolves a device name (named as [`DeviceName`] does) to hardware that can be
/// prepared now, or says why not.
fn resolve_device<'a>(
    inv: &'a Inventory,
    name: &str,
    opts: &Options,
) -> Result<Resolved<'a>, String> {
    // Whether prepare may switch `g`'s MIG mode, or why not (`None` without dynamic MIG).
    let toggle = |g: &Gpu| opts.dynamic_mig.then(|| g.mig_toggle());
    // Dynamic MIG creates the placements of a GPU it may switch, as partitionable mode does.
    let creates = |g: &Gpu| opts.partitionable || matches!(toggle(g), Some(Ok(())));
    match find_device(inv, name) {
        None => Err(
            "no such GPU, MIG device or MIG placement (names look like gpu-<minor> \
                     or gpu-<minor>-mig-<profile>-<giProfileId>-<start>)"
                .into(),
        ),
        Some(PublishedDevice::Gpu(g)) if g.in_mig_mode() => match toggle(g) {
            Some(Ok(())) => Ok(Resolved::Gpu(g)),
            Some(Err(why)) => Err(format!(
                "GPU {} is in MIG mode and its MIG mode cannot change at run time ({why}), so \
                 it is handed out only as MIG devices",
                g.minor
            )),
            None => Err(format!(
                "GPU {} is in MIG mode and is handed out only as MIG devices",
                g.minor
            )),
        },
        Some(PublishedDevice::Gpu(g)) => Ok(Resolved::Gpu(g)),
        Some(PublishedDevice::Mig {
            parent,
            existing: Some(m),
            ..
        }) => Ok(Resolved::Mig(parent, m)),
        Some(PublishedDevice::Mig { parent, .. })
            if !parent.in_mig_mode() && !matches!(toggle(parent), Some(Ok(()))) =>
        {
            Err(match toggle(parent) {
                Some(Err(why)) => format!(
                    "GPU {} is not in MIG mode, and its MIG mode cannot change at run time: {why}",
                    parent.minor
                ),
                _ => format!("GPU {} is not in MIG mode", parent.minor),
            })
        }
        Some(PublishedDevice::Mig { parent, .. }) if !creates(parent) => Err(
            "no MIG device exists at this placement, and creating MIG devices at prepare needs \
             partitionable mode"
                .into(),
        ),
        Some(PublishedDevice::Mig {
            parent,
            existing: None,
            profile: Some(p),
            placement,
        }) => Ok(Resolved::MigToCreate(parent, p, placement)),
        Some(PublishedDevice::Mig { profile: None, .. }) => {
            Err("the GPU does not list this MIG profile".into())
        }
    }
}

#[cfg(test)]
pub(super) mod tests {
    use std::path::Path;

    use super::*;
    use crate::ids::ClaimUid;
    use crate::inventory::topology::load_profile;

    pub(in crate::dra::plugin) const DRIVER: &str = "gpu.nvidia.com";

    pub(in crate::dra::plugin) fn opts(partitionable: bool) -> Options {
        Options {
            driver: DRIVER.into(),
            pool: "node-a".into(),
            plugin_dir: "/nonexistent/plugin".into(),
            cdi_root: "/nonexistent/cdi".into(),
            driver_root: crate::cdi::DriverRoot::at(std::path::Path::new("/nonexistent")),
            boot_id: "b".into(),
            partitionable,
            shared_capacity: crate::ledger::shares::ConsumableShares::Memory,
            mps_root: "/nonexistent/mps".into(),
            dynamic_mig: false,
            keep_mig_on: false,
            share_trust_domain: Default::default(),
            proc_root: None,
            claim_status: false,
        }
    }

    pub(in crate::dra::plugin) fn result(
        request: &str,
        driver: &str,
        device: &str,
    ) -> DeviceRequestAllocationResult {
        DeviceRequestAllocationResult {
            request: request.into(),
            driver: driver.into(),
            pool: "node-a".into(),
            device: device.into(),
            ..Default::default()
        }
    }

    pub(in crate::dra::plugin) fn claim_ref(uid: &str) -> ClaimRef {
        ClaimRef {
            namespace: "ns".into(),
            name: "c".into(),
            uid: ClaimUid::parse(uid).unwrap(),
        }
    }

    /// `rc` as the library hands it over: checked, with its results for [`DRIVER`].
    pub(in crate::dra::plugin) fn checked(rc: ResourceClaim) -> PrepareClaim {
        let m = &rc.metadata;
        let (ns, name, uid) = (m.namespace.clone(), m.name.clone(), m.uid.clone());
        let claim = kubelet_plugin::Claim::new(
            ns.unwrap_or_default(),
            name.unwrap_or_default(),
            uid.unwrap_or_default(),
        );
        kubelet_plugin::claims::check(claim, rc, DRIVER).unwrap()
    }

    /// The plan is a function of its arguments: no API, no files, no GPU.
    #[test]
    fn plans_our_results_once_per_device_and_says_what_touches_the_gpu() {
        let inv = load_profile("a100-mig-mixed", "node-a").unwrap();
        let cdi = CdiOptions::resolve(
            DRIVER,
            &crate::cdi::DriverRoot::at(Path::new("/nonexistent")),
        )
        .unwrap();
        let rc = crate::api::allocated_claim(
            "ns",
            "c",
            "u1",
            vec![
                result("pair/a", DRIVER, "gpu-0"),
                result("other", "net.example.com", "eth0"),
                result("x", DRIVER, "gpu-0"),
                result("mig", DRIVER, "gpu-2-mig-1g10gb-15-6"),
            ],
            vec![],
        );
        let p = plan(&opts(true), &cdi, &claim_ref("u1"), &checked(rc), &inv).unwrap();
        let names: Vec<_> = p
            .devices
            .iter()
            .map(|d| (d.device.as_str(), d.requests.clone()))
            .collect();
        assert_eq!(
            names,
            vec![
                ("gpu-0", vec!["pair".to_string(), "x".to_string()]),
                ("gpu-2-mig-1g10gb-15-6", vec!["mig".to_string()]),
            ]
        );
        let mig = p.devices[1].mig.as_ref().unwrap();
        assert!(mig.created && mig.uuid.is_none());
        assert!(p.touches_hardware(), "a MIG instance is created");
        assert_eq!(
            p.devices[0].cdi_ids,
            vec![format!("k8s.{DRIVER}/claim=u1-gpu-0")]
        );

        // Whole GPUs, exclusive: nothing changes on the GPU.
        let rc = crate::api::allocated_claim(
            "ns",
            "c",
            "u2",
            vec![result("gpu", DRIVER, "gpu-0")],
            vec![],
        );
        let p = plan(&opts(false), &cdi, &claim_ref("u2"), &checked(rc), &inv).unwrap();
        assert!(!p.touches_hardware());
    }

    /// The device name of placement `i` of profile `p` of GPU `g`, as the slices publish it.
    fn placement_name(g: &Gpu, p: usize, i: usize) -> String {
        let p = &g.mig.profiles[p];
        DeviceName::mig(g.minor, &p.name, p.gi_profile_id, p.placements[i].start).to_string()
    }

    fn admin(device: &str) -> DeviceRequestAllocationResult {
        let mut r = result("mon", DRIVER, device);
        r.admin_access = Some(true);
        r
    }

    fn plan_of(
        opts: &Options,
        inv: &Inventory,
        results: Vec<DeviceRequestAllocationResult>,
    ) -> Result<Plan, ClaimError> {
        let cdi = CdiOptions::resolve(
            DRIVER,
            &crate::cdi::DriverRoot::at(Path::new("/nonexistent")),
        )
        .unwrap();
        let rc = crate::api::allocated_claim("ns", "c", "u1", results, vec![]);
        plan(opts, &cdi, &claim_ref("u1"), &checked(rc), inv)
    }

    /// Admin access is outside every conflict check, so it must not change a GPU: a placement
    /// without an instance (partitionable or dynamic MIG) and, with dynamic MIG, a GPU whose
    /// mode a whole allocation would switch are refused naming the device and why; devices
    /// that exist as allocated stay allowed.
    #[test]
    fn admin_access_is_refused_where_prepare_would_create_an_instance_or_switch_mig_mode() {
        let refused = |e: ClaimError, device: &str, why: &str| {
            let msg = e.to_string();
            assert!(
                matches!(&e, ClaimError::AdminAccessNeedsChange { device: d, .. } if d == device),
                "{e:?}"
            );
            assert!(msg.contains(why), "{msg}");
            assert!(
                msg.contains(
                    "admin access does not create MIG instances or switch MIG mode; ask for \
                     an existing device"
                ),
                "{msg}"
            );
        };

        // Partitionable: an A100 in MIG mode with instances, and placements without one.
        let inv = load_profile("a100-mig-mixed", "node-a").unwrap();
        let g = inv
            .gpus
            .iter()
            .find(|g| g.in_mig_mode() && !g.mig.devices.is_empty())
            .unwrap();
        let m = &g.mig.devices[0];
        let existing =
            DeviceName::mig(g.minor, &m.profile, m.gi_profile_id, m.placement.start).to_string();
        let whole = inv.gpus.iter().find(|g| !g.in_mig_mode()).unwrap();
        let ok = plan_of(
            &opts(true),
            &inv,
            vec![
                admin(&existing),
                admin(&DeviceName::gpu(whole.minor).to_string()),
            ],
        )
        .unwrap();
        assert_eq!(ok.devices.len(), 2);
        assert!(ok.devices.iter().all(|d| d.admin_access));
        assert!(!ok.touches_hardware(), "{ok:?}");
        let free = inv
            .gpus
            .iter()
            .filter(|g| g.in_mig_mode())
            .flat_map(|g| (0..g.mig.profiles.len()).map(move |p| (g, p)))
            .flat_map(|(g, p)| {
                (0..g.mig.profiles[p].placements.len()).map(move |i| placement_name(g, p, i))
            })
            .find(|n| {
                matches!(
                    find_device(&inv, n),
                    Some(PublishedDevice::Mig { existing: None, .. })
                )
            })
            .unwrap();
        // Without admin access it is planned as a creation; with it, refused.
        let created = plan_of(&opts(true), &inv, vec![result("m", DRIVER, &free)]).unwrap();
        assert!(created.devices[0].mig.as_ref().unwrap().created);
        refused(
            plan_of(&opts(true), &inv, vec![admin(&free)]).unwrap_err(),
            &free,
            "no MIG device exists at this placement, so preparing it would create the instance",
        );

        // Dynamic MIG on an H100 outside MIG mode: its placement would switch the mode on.
        let mut dynamic = opts(false);
        dynamic.dynamic_mig = true;
        let mut inv = load_profile("dgx-h100", "node-a").unwrap();
        let placement = placement_name(&inv.gpus[0], 0, 0);
        let planned = plan_of(&dynamic, &inv, vec![result("m", DRIVER, &placement)]).unwrap();
        assert_eq!(planned.mig_modes, vec![(inv.gpus[0].uuid.clone(), true)]);
        refused(
            plan_of(&dynamic, &inv, vec![admin(&placement)]).unwrap_err(),
            &placement,
            "GPU 0 is not in MIG mode, so preparing it would turn MIG mode on and create the \
             instance",
        );
        // The whole GPU exists as allocated.
        let whole = plan_of(&dynamic, &inv, vec![admin("gpu-0")]).unwrap();
        assert!(whole.mig_modes.is_empty() && !whole.touches_hardware());

        // A GPU in MIG mode with no instance: whole, it would switch the mode off.
        inv.gpus[1].mig.enabled = true;
        let name = DeviceName::gpu(inv.gpus[1].minor).to_string();
        let planned = plan_of(&dynamic, &inv, vec![result("g", DRIVER, &name)]).unwrap();
        assert_eq!(planned.mig_modes, vec![(inv.gpus[1].uuid.clone(), false)]);
        refused(
            plan_of(&dynamic, &inv, vec![admin(&name)]).unwrap_err(),
            &name,
            &format!(
                "GPU {} is in MIG mode, so preparing it whole would turn MIG mode off",
                inv.gpus[1].minor
            ),
        );
    }
}
