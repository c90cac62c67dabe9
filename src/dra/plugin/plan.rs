//! The pure half of a prepare: from a claim as the API server returned it, the node's inventory
//! and the plugin's settings to the device records to reserve. No I/O here; every function is a
//! function of its arguments. A claim's prepare calls [`plan`] once and works from the records it
//! returns: what the GPU changes and what the CDI spec names are functions of records (the
//! [effects](super::effects)), which recovery and a repeated prepare read from the checkpoint,
//! and whether another claim holds a device is the ledger's answer at reservation.

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::{DeviceRequestAllocationResult, ResourceClaim};

use super::{ClaimError, ClaimRef, Options};
use crate::cdi::{self, CdiOptions};
use crate::dra::slices::{self, PublishedDevice};
use crate::ids::DeviceName;
use crate::inventory::{self, Gpu, Inventory, MigDevice, Placement};
use crate::ledger::shares::{FULL_COMPUTE, MEMORY_STEP};
use crate::ledger::{Consumed, DeviceRecord, MigRecord, PodRef};
use crate::sharing::{self, DeviceKind, MpsSettings, Sharing};

/// What preparing one claim takes: the devices to reserve, in allocation order, one record per
/// distinct device (a device several requests share is one record naming them all).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Plan {
    pub devices: Vec<DeviceRecord>,
    /// The pods the claim is reserved for, recorded for `/metrics`' attribution only.
    pub pods: Vec<PodRef>,
}

impl Plan {
    /// Whether preparing changes GPU state (creates a MIG instance, starts the claim's MPS
    /// daemon, sets a time slice), which must be recorded durably before it happens so that a
    /// crash can be undone. A share of a GPU (`consumed`) does not count: its daemon is the GPU's,
    /// usually running already, and started only once the claim's completed record is durable
    /// (`Plugin::ensure_share_daemons`), which start-up then completes rather than undoes.
    pub fn touches_hardware(&self) -> bool {
        self.devices.iter().any(|d| {
            d.mig.as_ref().is_some_and(|m| m.created)
                || (!matches!(d.sharing, Sharing::Exclusive) && d.consumed.is_none())
        })
    }
}

/// Checks that `rc` is the claim the kubelet named and is allocated, and turns the results of
/// our driver into device records.
pub(super) fn plan(
    opts: &Options,
    cdi: &CdiOptions,
    claim: &ClaimRef,
    rc: &ResourceClaim,
    inv: &Inventory,
) -> Result<Plan, ClaimError> {
    let found = rc.metadata.uid.as_deref().unwrap_or_default();
    if found != claim.uid.as_str() {
        return Err(ClaimError::UidChanged {
            namespace: claim.namespace.clone(),
            name: claim.name.clone(),
            expected: claim.uid.to_string(),
            found: found.to_string(),
        });
    }
    let allocation = rc.status.as_ref().and_then(|s| s.allocation.as_ref());
    let Some((allocation, results)) =
        allocation.and_then(|a| a.devices.as_ref().map(|d| (a, d.results.as_deref())))
    else {
        return Err(ClaimError::NotAllocated {
            namespace: claim.namespace.clone(),
            name: claim.name.clone(),
        });
    };
    let entries = sharing::from_allocation(allocation);
    let mut out: Vec<DeviceRecord> = Vec::new();
    let mut index: BTreeMap<(&str, &str), usize> = BTreeMap::new();
    for r in results.unwrap_or_default() {
        if r.driver != opts.driver {
            continue;
        }
        let unknown = |reason: String| ClaimError::UnknownDevice {
            pool: r.pool.clone(),
            device: r.device.clone(),
            ours: opts.pool.clone(),
            reason,
        };
        if r.pool != opts.pool {
            return Err(unknown("the pool is another node's".into()));
        }
        let base = r
            .request
            .split('/')
            .next()
            .unwrap_or(&r.request)
            .to_string();
        if let Some(&i) = index.get(&(r.pool.as_str(), r.device.as_str())) {
            if out[i].consumed.is_some() {
                return Err(ClaimError::BadShare {
                    device: r.device.clone(),
                    request: r.request.clone(),
                    reason: format!(
                        "the claim already has a share of it (request {}); a container sees \
                         one memory and compute limit per GPU, so ask for one share of the sum",
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
        // The name the inventory gives the device: the allocation's name, parsed.
        let name = match resolved {
            Resolved::Gpu(g) => DeviceName::gpu(g.minor),
            Resolved::Shared(g) => DeviceName::shared(g.minor),
            Resolved::Mig(g, m) => {
                DeviceName::mig(g.minor, &m.profile, m.gi_profile_id, m.placement.start)
            }
            Resolved::MigToCreate(g, p, placement) => {
                DeviceName::mig(g.minor, &p.name, p.gi_profile_id, placement.start)
            }
        };
        let (gpu, mig, kind) = match resolved {
            Resolved::Gpu(g) | Resolved::Shared(g) => (g, None, DeviceKind::Gpu),
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
            request: r.request.clone(),
            source,
        };
        let config =
            sharing::config_for_device(&entries, &opts.driver, &r.request, kind, &r.device)
                .map_err(config_err)?;
        let mut sharing = sharing::sharing_for(config, kind, &r.device).map_err(config_err)?;
        let mut consumed = None;
        if let Resolved::Shared(g) = resolved {
            let share = share(r, g, &sharing, &out)?;
            consumed = Some(share);
            // The share's limits are its MPS client settings, behind the GPU's daemon.
            sharing = Sharing::Mps(MpsSettings {
                active_thread_percentage: Some(share.compute),
                pinned_memory_limit: Some(share.memory),
                per_device_pinned_memory_limit: BTreeMap::new(),
            });
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
    })
}

/// The pods of `rc`'s `status.reservedFor` (entries of other resources are left out).
fn reserved_pods(rc: &ResourceClaim) -> Vec<PodRef> {
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

/// What a share of `gpu-<minor>-shared` consumes, from its allocation result: `consumedCapacity`
/// (`memory` in bytes, `compute` in percent), the published request policy's default where the
/// scheduler left one out. Refused: a result without a `shareID` (not a consumable-capacity
/// allocation), a claim config that asks for another sharing (the share's sharing is its
/// capacity), quantities that are not the published kind, and a second GPU's share beside the
/// claim's first (a container has one MPS pipe directory).
fn share(
    r: &DeviceRequestAllocationResult,
    gpu: &Gpu,
    configured: &Sharing,
    earlier: &[DeviceRecord],
) -> Result<Consumed, ClaimError> {
    let bad = |reason: String| ClaimError::BadShare {
        device: r.device.clone(),
        request: r.request.clone(),
        reason,
    };
    if r.share_id.is_none() {
        return Err(bad(
            "the allocation has no shareID; the scheduler did not allocate it as a \
             consumable-capacity share (is the DRAConsumableCapacity feature gate on in the \
             scheduler?)"
                .into(),
        ));
    }
    if !matches!(configured, Sharing::Exclusive) {
        return Err(bad(
            "a claim config sets its sharing, but a share is shared by its consumed capacity \
             (MPS per GPU); drop the sharing config for this request"
                .into(),
        ));
    }
    if let Some(other) = earlier
        .iter()
        .find(|d| d.consumed.is_some() && d.gpu != gpu.uuid)
    {
        return Err(bad(format!(
            "the claim already has a share of another GPU ({}); a container has one MPS pipe \
             directory, so one claim's shares must be of one GPU",
            other.device
        )));
    }
    let consumed = r.consumed_capacity.as_ref();
    let get = |name: &str| consumed.and_then(|c| c.get(name)).map(|q| q.0.as_str());
    let memory = match get("memory") {
        None => MEMORY_STEP,
        Some(q) => inventory::parse_quantity(q)
            .ok_or_else(|| bad(format!("consumed memory {q:?} is not a quantity of bytes")))?,
    };
    let compute = match get("compute") {
        None => FULL_COMPUTE,
        Some(q) => q
            .parse::<u32>()
            .ok()
            .filter(|c| (1..=FULL_COMPUTE).contains(c))
            .ok_or_else(|| {
                bad(format!(
                    "consumed compute {q:?} is not a whole percent from 1 to {FULL_COMPUTE}"
                ))
            })?,
    };
    if memory == 0 {
        return Err(bad("the share consumes no memory".into()));
    }
    Ok(Consumed { memory, compute })
}

/// What an allocated device name stands for on this node.
#[derive(Clone, Copy)]
enum Resolved<'a> {
    Gpu(&'a Gpu),
    /// A share of a whole GPU (`gpu-<minor>-shared`).
    Shared(&'a Gpu),
    Mig(&'a Gpu, &'a MigDevice),
    /// A placement with no instance yet: created at prepare (partitionable mode).
    MigToCreate(&'a Gpu, &'a inventory::MigProfile, Placement),
}

/// Resolves a device name (named as [`DeviceName`] does) to hardware that can be
/// prepared now, or says why not.
fn resolve_device<'a>(
    inv: &'a Inventory,
    name: &str,
    opts: &Options,
) -> Result<Resolved<'a>, String> {
    let partitionable = opts.partitionable;
    match slices::find_device(inv, name) {
        None => Err(
            "no such GPU, MIG device or MIG placement (names look like gpu-<minor> \
                     or gpu-<minor>-mig-<profile>-<giProfileId>-<start>)"
                .into(),
        ),
        Some(PublishedDevice::Gpu(g)) if g.in_mig_mode() => Err(format!(
            "GPU {} is in MIG mode and is handed out only as MIG devices",
            g.minor
        )),
        Some(PublishedDevice::Gpu(g)) => Ok(Resolved::Gpu(g)),
        Some(PublishedDevice::Shared(_)) if !opts.shared_capacity => Err(
            "shareable GPUs are published, and their shares prepared, only with \
             --shared-capacity"
                .into(),
        ),
        Some(PublishedDevice::Shared(g)) if g.in_mig_mode() => Err(format!(
            "GPU {} is in MIG mode and is not shared by capacity",
            g.minor
        )),
        Some(PublishedDevice::Shared(g)) => Ok(Resolved::Shared(g)),
        Some(PublishedDevice::Mig {
            parent,
            existing: Some(m),
            ..
        }) => Ok(Resolved::Mig(parent, m)),
        Some(PublishedDevice::Mig { parent, .. }) if !parent.in_mig_mode() => {
            Err(format!("GPU {} is not in MIG mode", parent.minor))
        }
        Some(PublishedDevice::Mig { .. }) if !partitionable => Err(
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
            shared_capacity: true,
            mps_root: "/nonexistent/mps".into(),
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
        let p = plan(&opts(true), &cdi, &claim_ref("u1"), &rc, &inv).unwrap();
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
        let p = plan(&opts(false), &cdi, &claim_ref("u2"), &rc, &inv).unwrap();
        assert!(!p.touches_hardware());

        // The claim must be the one the kubelet named.
        let e = plan(&opts(false), &cdi, &claim_ref("u3"), &rc, &inv).unwrap_err();
        assert!(matches!(e, ClaimError::UidChanged { .. }), "{e}");
    }
}
