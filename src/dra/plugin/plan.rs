//! The pure half of a prepare: from a claim as the API server returned it, the node's inventory
//! and the plugin's settings to the device records to reserve — and from those records to the
//! devices a CDI spec names. No I/O here; every function is a function of its arguments.

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::ResourceClaim;

use super::{ClaimError, ClaimRef, Options};
use crate::cdi::{self, CdiOptions, PreparedDevice};
use crate::dra::mps::Mps;
use crate::dra::slices::{self, PublishedDevice};
use crate::ids::{ClaimUid, DeviceName};
use crate::inventory::{
    self, DeviceUuid, Gpu, GpuUuid, Inventory, MigDevice, Placement, TimeSlice,
};
use crate::ledger::{ClaimEntry, DeviceRecord, MigRecord};
use crate::sharing::{self, DeviceKind, Sharing, TimeSliceInterval};

/// What preparing one claim takes: the devices to reserve, in allocation order, one record per
/// distinct device (a device several requests share is one record naming them all).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Plan {
    pub devices: Vec<DeviceRecord>,
}

impl Plan {
    /// Whether preparing changes GPU state (creates a MIG instance, starts an MPS daemon, sets a
    /// time slice), which must be recorded durably before it happens so that a crash can be
    /// undone.
    pub fn touches_hardware(&self) -> bool {
        self.devices.iter().any(|d| {
            d.mig.as_ref().is_some_and(|m| m.created) || !matches!(d.sharing, Sharing::Exclusive)
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
            let d: &mut DeviceRecord = &mut out[i];
            if !d.requests.contains(&base) {
                d.requests.push(base);
            }
            continue;
        }
        let resolved = resolve_device(inv, &r.device, opts.partitionable).map_err(unknown)?;
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
            request: r.request.clone(),
            source,
        };
        let config =
            sharing::config_for_device(&entries, &opts.driver, &r.request, kind, &r.device)
                .map_err(config_err)?;
        let sharing = sharing::sharing_for(config, kind, &r.device).map_err(config_err)?;
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
            sharing,
        });
    }
    Ok(Plan { devices: out })
}

/// The first of `devices` that another claim in `claims` holds, as that claim's error.
pub(super) fn conflict(
    claims: &BTreeMap<ClaimUid, ClaimEntry>,
    uid: &ClaimUid,
    devices: &[DeviceRecord],
) -> Result<(), ClaimError> {
    for d in devices {
        for (other_uid, other) in claims {
            if other_uid != uid && other.devices.iter().any(|o| conflicts(d, o)) {
                return Err(ClaimError::DeviceInUse {
                    device: d.device.to_string(),
                    namespace: other.namespace.clone(),
                    name: other.name.clone(),
                    uid: other_uid.clone(),
                });
            }
        }
    }
    Ok(())
}

/// The hardware a ledger record occupies.
fn occupies(r: &DeviceRecord) -> (&GpuUuid, Option<Placement>) {
    (&r.gpu, r.mig.as_ref().map(|m| m.placement))
}

fn conflicts(a: &DeviceRecord, b: &DeviceRecord) -> bool {
    if a.admin_access || b.admin_access || (a.share_id.is_some() && b.share_id.is_some()) {
        return false;
    }
    let (ga, pa) = occupies(a);
    let (gb, pb) = occupies(b);
    ga == gb
        && match (pa, pb) {
            (Some(x), Some(y)) => x.overlaps(&y),
            _ => true,
        }
}

/// The UUIDs (GPU or MIG) of a claim's MPS-shared devices, for its MPS daemon.
pub(super) fn mps_devices(devices: &[DeviceRecord]) -> Vec<DeviceUuid> {
    devices
        .iter()
        .filter(|d| matches!(d.sharing, Sharing::Mps(_)))
        .map(|d| match d.mig.as_ref().and_then(|m| m.uuid.clone()) {
            Some(mig) => DeviceUuid::Mig(mig),
            None => DeviceUuid::Gpu(d.gpu.clone()),
        })
        .collect()
}

pub(super) fn time_slice(i: TimeSliceInterval) -> TimeSlice {
    match i {
        TimeSliceInterval::Default => TimeSlice::Default,
        TimeSliceInterval::Short => TimeSlice::Short,
        TimeSliceInterval::Medium => TimeSlice::Medium,
        TimeSliceInterval::Long => TimeSlice::Long,
    }
}

/// The devices of a claim's CDI spec: each record with its GPU, and its MIG device looked up in
/// `inv` or among `created` (the MIG devices this prepare made, which `inv` predates).
pub(super) fn cdi_devices(
    pool: &str,
    uid: &ClaimUid,
    devices: &[DeviceRecord],
    inv: &Inventory,
    created: &[MigDevice],
    mps: &Mps,
) -> Result<Vec<PreparedDevice>, ClaimError> {
    let gone = |d: &DeviceRecord, reason: String| ClaimError::UnknownDevice {
        pool: d.pool.clone(),
        device: d.device.to_string(),
        ours: pool.to_string(),
        reason,
    };
    devices
        .iter()
        .map(|d| {
            let gpu = inv
                .gpu_by_uuid(d.gpu.as_str())
                .ok_or_else(|| gone(d, format!("GPU {} is gone", d.gpu)))?;
            let mig = match &d.mig {
                None => None,
                Some(m) => Some(
                    gpu.mig
                        .devices
                        .iter()
                        .chain(created)
                        .find(|x| Some(&x.uuid) == m.uuid.as_ref())
                        .ok_or_else(|| gone(d, "the MIG device is gone".into()))?
                        .clone(),
                ),
            };
            Ok(PreparedDevice {
                name: d.device.to_string(),
                gpu: gpu.clone(),
                mig,
                mps_pipe_dir: matches!(d.sharing, Sharing::Mps(_)).then(|| mps.pipe_dir(uid)),
                sharing: d.sharing.clone(),
            })
        })
        .collect()
}

/// What an allocated device name stands for on this node.
#[derive(Clone, Copy)]
enum Resolved<'a> {
    Gpu(&'a Gpu),
    Mig(&'a Gpu, &'a MigDevice),
    /// A placement with no instance yet: created at prepare (partitionable mode).
    MigToCreate(&'a Gpu, &'a inventory::MigProfile, Placement),
}

/// Resolves a device name (named as [`DeviceName`] does) to hardware that can be
/// prepared now, or says why not.
fn resolve_device<'a>(
    inv: &'a Inventory,
    name: &str,
    partitionable: bool,
) -> Result<Resolved<'a>, String> {
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
mod tests {
    use std::path::Path;

    use k8s_openapi::api::resource::v1::DeviceRequestAllocationResult;

    use super::*;
    use crate::inventory::topology::load_profile;

    const DRIVER: &str = "gpu.nvidia.com";

    fn opts(partitionable: bool) -> Options {
        Options {
            driver: DRIVER.into(),
            pool: "node-a".into(),
            plugin_dir: "/nonexistent/plugin".into(),
            cdi_root: "/nonexistent/cdi".into(),
            driver_root: "/nonexistent".into(),
            boot_id: "b".into(),
            partitionable,
        }
    }

    fn result(request: &str, driver: &str, device: &str) -> DeviceRequestAllocationResult {
        DeviceRequestAllocationResult {
            request: request.into(),
            driver: driver.into(),
            pool: "node-a".into(),
            device: device.into(),
            ..Default::default()
        }
    }

    fn claim_ref(uid: &str) -> ClaimRef {
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
        let cdi = CdiOptions::resolve(DRIVER, Path::new("/nonexistent")).unwrap();
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

    #[test]
    fn a_conflict_names_the_claim_that_holds_the_device() {
        let inv = load_profile("dgx-h100", "node-a").unwrap();
        let cdi = CdiOptions::resolve(DRIVER, Path::new("/nonexistent")).unwrap();
        let rc = |uid: &str| {
            crate::api::allocated_claim(
                "ns",
                "c",
                uid,
                vec![result("gpu", DRIVER, "gpu-3")],
                vec![],
            )
        };
        let a = plan(&opts(false), &cdi, &claim_ref("a"), &rc("a"), &inv).unwrap();
        let b = plan(&opts(false), &cdi, &claim_ref("b"), &rc("b"), &inv).unwrap();
        let mut claims = BTreeMap::new();
        claims.insert(
            claim_ref("a").uid,
            ClaimEntry {
                state: crate::ledger::ClaimState::PrepareCompleted,
                namespace: "ns".into(),
                name: "holder".into(),
                devices: a.devices.clone(),
            },
        );
        // A claim does not conflict with itself (a retried prepare).
        conflict(&claims, &claim_ref("a").uid, &a.devices).unwrap();
        let e = conflict(&claims, &claim_ref("b").uid, &b.devices).unwrap_err();
        assert!(
            e.to_string()
                .contains("gpu-3 is already prepared for claim ns/holder (a)"),
            "{e}"
        );
    }
}
