//! Who holds a device: the one rule for whether two uses of a GPU meet (`overlap`) and the one
//! scan of the claims holding a device ([`claims_holding`]), which a claim's reservation, the
//! device plugin's Allocate and ListAndWatch, and the compute-mode release ask. And a node-level
//! fact in `--mode both`: which GPUs (or MIG devices) containers hold through the legacy device
//! plugin. The device plugin records them, and the ledger, DRA's slice sync and
//! the metrics' attribution read them, so they live beside the ledger rather than inside any one
//! of those paths. Kept in memory only, here and not in the ledger (which owns the checkpoint
//! only): the kubelet's PodResources API is the durable record of them, and is read again after
//! a restart.
//!
//! Two sources fill them:
//! - **Allocate** records a *pending* hold at once, atomically with the check that no DRA claim
//!   holds the device ([`ContainerHolds::hold_for_allocate`]); the kubelet's Allocate carries no
//!   pod name, so a pending hold names the device ID it was allocated as.
//! - **PodResources `List`** replaces the *observed* holds ([`ContainerHolds::set_observed`]):
//!   every container of a pod the kubelet still runs with a device of ours. A pending hold ends
//!   when its device is observed (the pod now names it) or after [`PENDING_TTL`] without being
//!   observed (the pod never started); an observed hold ends when its pod no longer lists it.
//!
//! The ledger is handed these holds as its [`HeldElsewhere`]: a claim's reservation consults
//! them under the ledger's lock, and an Allocate checks the claims and records its hold under
//! that same lock ([`Ledger::read`]), so a claim and a container never get one exclusive GPU.
//! Lock order: the ledger's, then the holds'.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::watch;

use crate::ids::ClaimUid;
use crate::inventory::{GpuUuid, MigUuid, Placement};
use crate::ledger::{ClaimEntry, DeviceRecord, HeldBy, HeldElsewhere, Ledger};
use crate::lock::lock;

/// How long an Allocate's hold lasts without its pod appearing in PodResources.
pub const PENDING_TTL: Duration = Duration::from_secs(60);

/// What a device-plugin device occupies: a whole GPU, or one MIG device of it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Occupied {
    pub gpu: GpuUuid,
    pub mig: Option<(MigUuid, Placement)>,
}

/// The hardware one use of a GPU takes: the GPU, and the MIG device (its UUID once it exists)
/// and placement where it is not the GPU whole.
type Footprint<'a> = (&'a GpuUuid, Option<(Option<&'a MigUuid>, Placement)>);

/// The one rule: two uses meet on the same GPU when either takes it whole, or they are the same
/// MIG device, or their placements share a memory slice.
fn overlap((g, m): Footprint, (h, n): Footprint) -> bool {
    g == h
        && match (m, n) {
            (Some((a, pa)), Some((b, pb))) => (a.is_some() && a == b) || pa.overlaps(&pb),
            _ => true,
        }
}

/// What a record takes ([`Footprint`]); `None` for admin access, which holds nothing.
fn footprint(r: &DeviceRecord) -> Option<Footprint<'_>> {
    let mig = r.mig.as_ref().map(|m| (m.uuid.as_ref(), m.placement));
    (!r.admin_access).then_some((&r.gpu, mig))
}

impl Occupied {
    /// Whether a DRA record needs hardware this device takes (`overlap`).
    pub fn overlaps(&self, r: &DeviceRecord) -> bool {
        let mine = self.mig.as_ref().map(|(uuid, p)| (Some(uuid), *p));
        footprint(r).is_some_and(|f| overlap(f, (&self.gpu, mine)))
    }
}

impl DeviceRecord {
    /// Whether `self` and `other` need the same hardware (`overlap`) and may not share it:
    /// they may when both are shares of the same device (whether they fit together is
    /// [`crate::ledger::shares::overcommitted`]'s question). A whole GPU or MIG device allocated
    /// with a `shareID` (all of a shareable device's memory) conflicts with every share of it.
    pub fn conflicts_with(&self, other: &DeviceRecord) -> bool {
        let shares_of_one = self.consumed.is_some()
            && other.consumed.is_some()
            && self.share_target() == other.share_target();
        !shares_of_one
            && matches!((footprint(self), footprint(other)), (Some(a), Some(b)) if overlap(a, b))
    }
}

/// The one scan of who holds what: the claims of `claims`, other than `except`, with a device
/// that `holds` picks, in UID order.
pub fn claims_holding<'a>(
    claims: &'a BTreeMap<ClaimUid, ClaimEntry>,
    except: Option<&'a ClaimUid>,
    holds: impl Fn(&DeviceRecord) -> bool + 'a,
) -> impl Iterator<Item = (&'a ClaimUid, &'a ClaimEntry)> + 'a {
    claims
        .iter()
        .filter(move |(u, e)| Some(*u) != except && e.devices.iter().any(&holds))
}

impl fmt::Display for Occupied {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.mig {
            Some((mig, _)) => write!(f, "MIG device {mig} of GPU {}", self.gpu),
            None => write!(f, "GPU {}", self.gpu),
        }
    }
}

/// A container of a running pod.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ContainerRef {
    pub namespace: String,
    pub pod: String,
    pub container: String,
}

impl fmt::Display for ContainerRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "pod {}/{} container {}",
            self.namespace, self.pod, self.container
        )
    }
}

/// Who holds a device through the device plugin.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Holder {
    Container(ContainerRef),
    /// Allocated by the kubelet, not yet listed by PodResources.
    Allocating {
        resource: String,
        id: String,
    },
}

impl fmt::Display for Holder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Holder::Container(c) => c.fmt(f),
            Holder::Allocating { resource, id } => write!(
                f,
                "a container the kubelet is starting with {resource} device {id}"
            ),
        }
    }
}

/// The claim holding a device, as an Allocate refusal names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClaimHolder {
    pub namespace: String,
    pub name: String,
    pub uid: ClaimUid,
}

impl fmt::Display for ClaimHolder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "resource claim {}/{} ({})",
            self.namespace, self.name, self.uid
        )
    }
}

/// The first claim of `claims` whose devices overlap `occ`.
pub fn claim_holding(
    claims: &BTreeMap<ClaimUid, ClaimEntry>,
    occ: &Occupied,
) -> Option<ClaimHolder> {
    claims_holding(claims, None, |r| occ.overlaps(r))
        .next()
        .map(|(uid, e)| ClaimHolder {
            namespace: e.namespace.clone(),
            name: e.name.clone(),
            uid: uid.clone(),
        })
}

/// The device-plugin holds.
#[derive(Debug, Default)]
pub struct Holds {
    observed: Vec<(Occupied, ContainerRef)>,
    pending: Vec<(Occupied, Holder, Instant)>,
}

impl Holds {
    /// Every hold, observed ones first.
    pub fn all(&self) -> Vec<(Occupied, Holder)> {
        self.observed
            .iter()
            .map(|(o, c)| (o.clone(), Holder::Container(c.clone())))
            .chain(self.pending.iter().map(|(o, h, _)| (o.clone(), h.clone())))
            .collect()
    }

    /// Who holds hardware that `r` needs, if anyone.
    pub fn holder_of(&self, r: &DeviceRecord) -> Option<(Occupied, Holder)> {
        self.all().into_iter().find(|(o, _)| o.overlaps(r))
    }

    fn add_pending(&mut self, occ: Occupied, holder: Holder, now: Instant) {
        self.pending.push((occ, holder, now));
    }

    /// Replaces the observed holds; drops pending ones now observed or older than `ttl`.
    /// Returns whether anything changed.
    fn set_observed(
        &mut self,
        mut observed: Vec<(Occupied, ContainerRef)>,
        now: Instant,
        ttl: Duration,
    ) -> bool {
        observed.sort();
        observed.dedup();
        let before = self.pending.len();
        self.pending.retain(|(o, _, at)| {
            now.duration_since(*at) < ttl && !observed.iter().any(|(seen, _)| seen == o)
        });
        let changed = before != self.pending.len() || observed != self.observed;
        self.observed = observed;
        changed
    }
}

/// The holds of a node, shared: Allocate and the PodResources poll change them, the ledger
/// consults them when a claim reserves devices, the slice sync hides them. Cheap to clone.
#[derive(Clone)]
pub struct ContainerHolds {
    holds: Arc<Mutex<Holds>>,
    /// Bumped on every change, for the slices.
    changes: Arc<watch::Sender<u64>>,
}

impl Default for ContainerHolds {
    fn default() -> Self {
        Self {
            holds: Arc::default(),
            changes: Arc::new(watch::channel(0).0),
        }
    }
}

impl ContainerHolds {
    /// Every hold, observed ones first.
    pub fn all(&self) -> Vec<(Occupied, Holder)> {
        lock(&self.holds).all()
    }

    /// Told after every change of the holds.
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }

    fn changed(&self) {
        self.changes.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// Records the devices of one Allocate as held, unless a claim in `ledger` holds one of
    /// them — then nothing is recorded and the device and its claim are returned — or the
    /// Allocate itself was refused (`allocated` is an error, returned as it is; the claim's
    /// refusal comes first, since a device a claim holds is also unhealthy to the Allocate).
    pub fn hold_for_allocate<T, E>(
        &self,
        ledger: &Ledger,
        devices: Vec<(Occupied, Holder)>,
        allocated: Result<T, E>,
    ) -> Result<Result<T, E>, Box<(Occupied, ClaimHolder)>> {
        let allocated = ledger.read(|cp| {
            for (occ, _) in &devices {
                if let Some(c) = claim_holding(&cp.claims, occ) {
                    return Err(Box::new((occ.clone(), c)));
                }
            }
            if allocated.is_ok() {
                let now = Instant::now();
                let mut held = lock(&self.holds);
                for (occ, h) in devices {
                    held.add_pending(occ, h, now);
                }
            }
            Ok(allocated)
        })?;
        if allocated.is_ok() {
            self.changed();
        }
        Ok(allocated)
    }

    /// Replaces what containers hold with what PodResources lists.
    pub fn set_observed(&self, observed: Vec<(Occupied, ContainerRef)>) {
        let changed = lock(&self.holds).set_observed(observed, Instant::now(), PENDING_TTL);
        if changed {
            self.changed();
        }
    }
}

impl HeldElsewhere for ContainerHolds {
    fn holder_of(&self, r: &DeviceRecord) -> Option<HeldBy> {
        lock(&self.holds).holder_of(r).map(|(held, holder)| HeldBy {
            held: held.to_string(),
            holder: holder.to_string(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::DeviceName;
    use crate::ledger::{ClaimState, MigRecord};
    use crate::sharing::Sharing;

    fn gpu(n: u32) -> GpuUuid {
        GpuUuid(format!("GPU-{n}"))
    }

    fn record(g: u32, mig: Option<(&str, u32, u32)>) -> DeviceRecord {
        DeviceRecord {
            requests: vec!["gpu".into()],
            pool: "node".into(),
            device: DeviceName::parse("gpu-0").unwrap(),
            cdi_ids: vec![],
            share_id: None,
            admin_access: false,
            gpu: gpu(g),
            mig: mig.map(|(u, start, size)| MigRecord {
                uuid: Some(MigUuid(u.into())),
                profile: "1g.10gb".into(),
                gi_profile_id: 19,
                placement: Placement { start, size },
                created: false,
            }),
            consumed: None,
            sharing: Sharing::Exclusive,
        }
    }

    fn whole(g: u32) -> Occupied {
        Occupied {
            gpu: gpu(g),
            mig: None,
        }
    }

    fn mig(g: u32, u: &str, start: u32, size: u32) -> Occupied {
        Occupied {
            gpu: gpu(g),
            mig: Some((MigUuid(u.into()), Placement { start, size })),
        }
    }

    fn pod(name: &str) -> ContainerRef {
        ContainerRef {
            namespace: "default".into(),
            pod: name.into(),
            container: "c".into(),
        }
    }

    #[test]
    fn whole_gpus_overlap_everything_on_them_and_mig_devices_by_placement() {
        assert!(whole(0).overlaps(&record(0, None)));
        assert!(!whole(1).overlaps(&record(0, None)));
        assert!(whole(0).overlaps(&record(0, Some(("MIG-a", 0, 1)))));
        assert!(mig(0, "MIG-a", 0, 1).overlaps(&record(0, None)));
        assert!(mig(0, "MIG-a", 0, 1).overlaps(&record(0, Some(("MIG-a", 0, 1)))));
        assert!(mig(0, "MIG-b", 0, 2).overlaps(&record(0, Some(("MIG-c", 1, 1)))));
        assert!(!mig(0, "MIG-b", 2, 2).overlaps(&record(0, Some(("MIG-c", 0, 2)))));
        let mut admin = record(0, None);
        admin.admin_access = true;
        assert!(!whole(0).overlaps(&admin));
    }

    /// One rule (issue 35 item 4): whether a container's device is held by a claim (the device
    /// plugin's Allocate and ListAndWatch) and whether two claims' devices conflict (a
    /// reservation) agree for every pair of whole GPUs, MIG devices and placements to create.
    #[test]
    fn the_device_plugin_and_the_ledger_answer_who_holds_alike() {
        let occupied = [
            whole(0),
            whole(1),
            mig(0, "MIG-a", 0, 1),
            mig(0, "MIG-b", 0, 2),
            mig(0, "MIG-c", 2, 2),
            mig(0, "MIG-d", 6, 1),
        ];
        let mut records: Vec<DeviceRecord> = vec![
            record(0, None),
            record(1, None),
            record(0, Some(("MIG-a", 0, 1))),
            record(0, Some(("MIG-e", 1, 1))),
            record(0, Some(("MIG-c", 2, 2))),
            record(0, Some(("MIG-f", 4, 2))),
        ];
        let mut to_create = record(0, Some(("", 5, 2)));
        to_create.mig.as_mut().unwrap().uuid = None;
        records.push(to_create);
        // What a container's device is, as a claim's record of the same hardware.
        let as_record = |o: &Occupied| match &o.mig {
            None => record(0, None).with_gpu(&o.gpu),
            Some((u, p)) => record(0, Some((u.0.as_str(), p.start, p.size))).with_gpu(&o.gpu),
        };
        let mut meets = 0;
        for o in &occupied {
            for r in &records {
                let plugin = o.overlaps(r);
                assert_eq!(plugin, as_record(o).conflicts_with(r), "{o} and {r:?}");
                assert_eq!(plugin, r.conflicts_with(&as_record(o)), "{r:?} and {o}");
                meets += usize::from(plugin);
            }
        }
        // Both answers occur: the pairs are not all alike.
        assert!(
            meets > 0 && meets < occupied.len() * records.len(),
            "{meets}"
        );
    }

    impl DeviceRecord {
        fn with_gpu(mut self, gpu: &GpuUuid) -> Self {
            self.gpu = gpu.clone();
            self
        }
    }

    #[test]
    fn pending_holds_end_when_observed_or_expired_and_observed_ones_follow_the_pods() {
        let mut h = Holds::default();
        let t0 = Instant::now();
        let alloc = |id: &str| Holder::Allocating {
            resource: "nvidia.com/gpu".into(),
            id: id.into(),
        };
        h.add_pending(whole(0), alloc("GPU-0"), t0);
        h.add_pending(whole(1), alloc("GPU-1"), t0);
        // GPU 0's pod is listed; GPU 1's is not yet.
        assert!(h.set_observed(vec![(whole(0), pod("p0"))], t0, PENDING_TTL));
        assert_eq!(
            h.all(),
            vec![
                (whole(0), Holder::Container(pod("p0"))),
                (whole(1), alloc("GPU-1"))
            ]
        );
        assert!(!h.set_observed(vec![(whole(0), pod("p0"))], t0, PENDING_TTL));
        // GPU 1's pod never came; p0 ended.
        assert!(h.set_observed(vec![], t0 + PENDING_TTL, PENDING_TTL));
        assert_eq!(h.all(), vec![]);
    }

    #[tokio::test]
    async fn allocate_of_a_claimed_gpu_is_refused_naming_the_claim_and_holds_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let (ledger, _writer, _) = Ledger::open(dir.path(), "boot", None).unwrap();
        let holds = ContainerHolds::default();
        let mut changes = ledger.changes();
        ledger.update(|c| {
            c.insert(
                ClaimUid::parse("uid-1").unwrap(),
                ClaimEntry {
                    state: ClaimState::PrepareCompleted,
                    namespace: "ns".into(),
                    name: "claim-1".into(),
                    devices: vec![record(0, None)],
                    pods: vec![],
                    user: None,
                    trust_label: None,
                },
            )
        });
        assert!(changes.has_changed().unwrap());
        changes.mark_unchanged();
        // From here on, the holds' changes (the ledger's are the claims' only).
        let changes = holds.changes();
        let alloc = Holder::Allocating {
            resource: "nvidia.com/gpu".into(),
            id: "GPU-0".into(),
        };
        let (occ, claim) = *holds
            .hold_for_allocate(
                &ledger,
                vec![(whole(1), alloc.clone()), (whole(0), alloc.clone())],
                Ok::<(), ()>(()),
            )
            .unwrap_err();
        assert_eq!(occ, whole(0));
        assert_eq!(claim.to_string(), "resource claim ns/claim-1 (uid-1)");
        assert_eq!(holds.all(), vec![]);
        assert!(!changes.has_changed().unwrap());
        holds
            .hold_for_allocate(&ledger, vec![(whole(1), alloc.clone())], Ok::<(), ()>(()))
            .unwrap()
            .unwrap();
        assert_eq!(holds.all(), vec![(whole(1), alloc)]);
        assert!(changes.has_changed().unwrap());
    }
}
