//! Which pod uses which GPU: the [`Source`] a scrape reads. Allocations come from the one ledger
//! (DRA claims, with the pods they were reserved for) and from the device plugin's holds (what
//! PodResources lists per container); the node, and the share daemons' last round, from the
//! inventory owner's latest publication (its watch); live readings through the owner's handle
//! ([`InventoryHandle::usage`]); XID counts from the health monitor; a process's pod from the pod UID its cgroup names under
//! `/proc` (a root tests replace).
//!
//! Locks: the ledger's only for a copy of its claims, the holds' only for a copy of them; the
//! hardware is read after both are released.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::Source;
use super::families::{Allocation, GpuRow, ProcessRow, Scrape, ShareRow};
use crate::health::MonitorHandle;
use crate::holds::{ContainerHolds, Holder};
use crate::inventory::owner::InventoryHandle;
use crate::inventory::{Inventory, owner};
use crate::ledger::{ClaimEntry, Ledger};

/// The scrape source of a running nvdra.
pub struct Attribution {
    node: owner::Watch,
    /// The owner's handle, for live readings under its deadline.
    readings: InventoryHandle,
    ledger: Option<Ledger>,
    holds: Option<ContainerHolds>,
    monitor: Option<MonitorHandle>,
    proc_root: PathBuf,
    device_plugin_sharing: String,
    share_levels: Option<ShareLevels>,
}

/// Which limit holds each prepared share claim's memory (`container` or `process`).
pub type ShareLevels = Arc<dyn Fn() -> BTreeMap<crate::ids::ClaimUid, &'static str> + Send + Sync>;

impl Attribution {
    /// The node as `node` publishes it, the live readings through `readings`.
    pub fn new(node: owner::Watch, readings: InventoryHandle) -> Self {
        Self {
            node,
            readings,
            ledger: None,
            holds: None,
            monitor: None,
            proc_root: PathBuf::from("/proc"),
            device_plugin_sharing: "exclusive".into(),
            share_levels: None,
        }
    }

    /// Which limit holds each share's memory.
    pub fn with_share_levels(mut self, levels: ShareLevels) -> Self {
        self.share_levels = Some(levels);
        self
    }

    /// The DRA claims.
    pub fn with_ledger(mut self, ledger: Ledger) -> Self {
        self.ledger = Some(ledger);
        self
    }

    /// The device-plugin containers, and how that path shares its devices (`exclusive`,
    /// `timeSlicing`, `mps`: its config's strategy).
    pub fn with_holds(mut self, holds: ContainerHolds, sharing: impl Into<String>) -> Self {
        self.holds = Some(holds);
        self.device_plugin_sharing = sharing.into();
        self
    }

    /// The XID counts.
    pub fn with_monitor(mut self, monitor: MonitorHandle) -> Self {
        self.monitor = Some(monitor);
        self
    }

    /// Where `<pid>/cgroup` is read (default `/proc`; the host's, with `hostPID`).
    pub fn with_proc_root(mut self, root: impl Into<PathBuf>) -> Self {
        self.proc_root = root.into();
        self
    }
}

impl Source for Attribution {
    fn scrape(&self) -> Scrape {
        // Copies under the locks; nothing else is done while they are held.
        let claims: BTreeMap<_, ClaimEntry> = self
            .ledger
            .as_ref()
            .map(|l| l.read(|cp| cp.claims.clone()))
            .unwrap_or_default();
        let holds = self.holds.as_ref().map(ContainerHolds::all);
        let (inv, daemons) = {
            let published = self.node.borrow();
            (published.node(), published.health.daemons_asked.clone())
        };
        let inv = inv.unwrap_or_else(|e| {
            tracing::warn!(error = %crate::report::chain(&e), "cannot read the inventory for a scrape");
            Arc::default()
        });
        let mut allocations = dra_allocations(&claims);
        for (occ, holder) in holds.into_iter().flatten() {
            let Holder::Container(c) = holder else {
                continue; // not yet listed by PodResources: no pod to name
            };
            let mig = occ.mig.as_ref().map(|(uuid, _)| uuid);
            let profile = mig
                .and_then(|u| {
                    inv.gpus
                        .iter()
                        .flat_map(|g| &g.mig.devices)
                        .find(|m| m.uuid == *u)
                })
                .map(|m| m.profile.clone());
            allocations.insert(Allocation {
                device: mig.map_or_else(|| occ.gpu.to_string(), ToString::to_string),
                gpu_uuid: occ.gpu.to_string(),
                mig_profile: profile.unwrap_or_default(),
                pod_namespace: c.namespace,
                pod: c.pod,
                container: c.container,
                path: "device-plugin",
                sharing: self.device_plugin_sharing.clone(),
                ..Allocation::default()
            });
        }
        let (usage, usage_ok) = match self.readings.usage() {
            Ok(u) => (u, true),
            Err(e) => {
                tracing::debug!(error = %crate::report::chain(&e), "cannot read the GPUs' usage");
                (Vec::new(), false)
            }
        };
        // Pod UIDs the ledger knows, to name a process's pod.
        let pods: BTreeMap<&str, (&str, &str)> = claims
            .values()
            .flat_map(|e| {
                e.pods
                    .iter()
                    .map(|p| (p.uid.as_str(), (e.namespace.as_str(), p.name.as_str())))
            })
            .collect();
        let mut processes = Vec::new();
        for u in &usage {
            let gpu = inv.gpus.iter().find(|g| g.uuid == u.gpu);
            for p in &u.processes {
                let mig = p.gpu_instance.and_then(|gi| {
                    gpu?.mig
                        .devices
                        .iter()
                        .find(|m| m.gi_id == gi)
                        .map(|m| m.uuid.to_string())
                });
                let pod_uid = pod_uid_of(&self.proc_root, p.pid).unwrap_or_default();
                let (ns, name) = pods.get(pod_uid.as_str()).copied().unwrap_or_default();
                processes.push(ProcessRow {
                    gpu_uuid: u.gpu.to_string(),
                    mig_uuid: mig.unwrap_or_default(),
                    pid: p.pid,
                    pod_namespace: ns.to_string(),
                    pod: name.to_string(),
                    pod_uid,
                    used_memory_bytes: p.used_memory_bytes.unwrap_or_default(),
                });
            }
        }
        processes.sort();
        processes.dedup_by(|a, b| {
            (&a.gpu_uuid, &a.mig_uuid, a.pid) == (&b.gpu_uuid, &b.mig_uuid, b.pid)
        });
        let levels = self.share_levels.as_ref().map(|f| f()).unwrap_or_default();
        let shares = share_rows(&claims, &processes, &inv, usage_ok, &levels);
        let minors: BTreeMap<_, _> = inv.gpus.iter().map(|g| (&g.uuid, g.minor)).collect();
        let gpus = usage
            .into_iter()
            .map(|usage| GpuRow {
                device: minors
                    .get(&usage.gpu)
                    .map_or_else(String::new, |m| format!("gpu-{m}")),
                usage,
            })
            .collect();
        let xids = self
            .monitor
            .as_ref()
            .map(MonitorHandle::xid_counts)
            .unwrap_or_default()
            .into_iter()
            .map(|((gpu, xid), n)| ((gpu.to_string(), xid), n))
            .collect();
        Scrape {
            share_daemons: daemons
                .into_iter()
                .map(|(gpu, up)| (gpu.to_string(), up))
                .collect(),
            allocations: allocations.into_iter().collect(),
            gpus,
            processes,
            xids,
            shares,
            usage_ok,
        }
    }
}

/// Each share of a GPU held by a claim, with the memory its pods' processes use now: the
/// processes on the share's GPU whose cgroup names one of the claim's pods (by pod UID).
pub fn share_rows(
    claims: &BTreeMap<crate::ids::ClaimUid, ClaimEntry>,
    processes: &[ProcessRow],
    inv: &Inventory,
    usage_ok: bool,
    levels: &BTreeMap<crate::ids::ClaimUid, &'static str>,
) -> Vec<ShareRow> {
    let mut out = Vec::new();
    for (uid, e) in claims {
        let pods: BTreeSet<&str> = e.pods.iter().map(|p| p.uid.as_str()).collect();
        for d in &e.devices {
            let Some(consumed) = d.consumed else {
                continue;
            };
            // A MIG device's share counts only processes on that MIG device.
            let mig = d.mig.as_ref().and_then(|m| m.uuid.as_ref());
            let used = processes
                .iter()
                .filter(|p| p.gpu_uuid == d.gpu.as_str() && pods.contains(p.pod_uid.as_str()))
                .filter(|p| mig.is_none_or(|m| p.mig_uuid == m.as_str()))
                .map(|p| p.used_memory_bytes)
                .sum();
            let gpu = inv.gpu_by_uuid(d.gpu.as_str());
            // What it is held to: its part of the GPU in integer mode, so that `used` above
            // it means the same in every mode (a GPU no longer listed: what it consumed).
            // Of the MIG device's memory for a share of one.
            let total = inv.memory_of(&d.share_target());
            let held = match total {
                Some(total) => consumed.held_memory(crate::ledger::shares::shareable_memory(total)),
                None => (consumed.memory > 0).then_some(consumed.memory),
            };
            // The most it may use: its burst limit, else what it is held to.
            let limit = consumed.burst_limit.or(held);
            out.push(ShareRow {
                namespace: e.namespace.clone(),
                claim: e.name.clone(),
                gpu: gpu.map_or_else(String::new, |g| format!("gpu-{}", g.minor)),
                gpu_uuid: d.gpu.to_string(),
                consumed_bytes: held,
                limit_bytes: limit,
                used_bytes: usage_ok.then_some(used),
                level: levels.get(uid).copied().unwrap_or_default().to_string(),
            });
        }
    }
    out.sort();
    out.dedup();
    out
}

/// One allocation per device of each claim and pod it is reserved for (one without a pod when
/// the claim names none).
pub fn dra_allocations<'a>(
    claims: impl IntoIterator<Item = (&'a crate::ids::ClaimUid, &'a ClaimEntry)>,
) -> BTreeSet<Allocation> {
    let mut out = BTreeSet::new();
    for (_, e) in claims {
        let pods: Vec<&str> = match e.pods.as_slice() {
            [] => vec![""],
            pods => pods.iter().map(|p| p.name.as_str()).collect(),
        };
        for d in &e.devices {
            // A consumable-capacity share (`--shared-capacity`) is MPS underneath, but its
            // sharing is the capacity the scheduler counted.
            let sharing = if d.consumed.is_some() {
                "capacity"
            } else {
                d.sharing.strategy()
            };
            for pod in &pods {
                out.insert(Allocation {
                    device: d.device.to_string(),
                    gpu_uuid: d.gpu.to_string(),
                    mig_profile: d
                        .mig
                        .as_ref()
                        .map(|m| m.profile.clone())
                        .unwrap_or_default(),
                    claim_namespace: e.namespace.clone(),
                    claim_name: e.name.clone(),
                    pod_namespace: if pod.is_empty() {
                        String::new()
                    } else {
                        e.namespace.clone()
                    },
                    pod: (*pod).to_string(),
                    container: String::new(),
                    path: "dra",
                    sharing: sharing.to_string(),
                });
            }
        }
    }
    out
}

/// The pod UID `<proc_root>/<pid>/cgroup` names, if any: the kubelet puts a pod's containers
/// under `…/pod<uid>/…` (cgroupfs driver) or `…-pod<uid with _ for ->.slice/…` (systemd).
pub fn pod_uid_of(proc_root: &Path, pid: u32) -> Option<String> {
    let text = std::fs::read_to_string(proc_root.join(pid.to_string()).join("cgroup")).ok()?;
    text.lines().find_map(pod_uid_in)
}

/// The pod UID in one line of a cgroup file (see [`pod_uid_of`]).
pub fn pod_uid_in(line: &str) -> Option<String> {
    let path = line.splitn(3, ':').nth(2)?;
    path.split('/').find_map(|segment| {
        let segment = segment.strip_suffix(".slice").unwrap_or(segment);
        let at = segment.rfind("pod")?;
        let uid = &segment[at + 3..];
        let is_uid = uid.len() == 36
            && uid
                .chars()
                .all(|c| c.is_ascii_hexdigit() || c == '-' || c == '_');
        is_uid.then(|| uid.replace('_', "-"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::DeviceBackend;

    /// The readings of `sim` through an owner's handle, as `nvdra run` reads them.
    fn readings(sim: &crate::inventory::sim::SimBackend) -> InventoryHandle {
        let hour = std::time::Duration::from_secs(3600);
        let (_owner, handle) = owner::Owner::new(Arc::new(sim.clone()), hour, owner::DEADLINE)
            .expect("the owner's reader thread");
        handle
    }

    /// A share of a MIG device counts only its pods' processes on that MIG device, not those on
    /// the GPU's other MIG devices; its limit is its burst limit, else what it is held to.
    #[test]
    fn a_mig_shares_used_memory_is_its_mig_devices() {
        use crate::ids::{ClaimUid, DeviceName};
        use crate::ledger::shares::Consumed;
        use crate::ledger::{ClaimState, DeviceRecord, MigRecord, PodRef};
        let inv = crate::inventory::topology::load_profile("a100-mig-mixed", "n").unwrap();
        let (gpu, mig) = inv
            .gpus
            .iter()
            .find_map(|g| g.mig.devices.first().map(|m| (g.clone(), m.clone())))
            .expect("a MIG device");
        let record = DeviceRecord {
            requests: vec!["nb".into()],
            pool: "n".into(),
            device: DeviceName::parse("gpu-0").unwrap(),
            cdi_ids: vec![],
            share_id: Some("5f0e0000-0000-4000-8000-000000000001".into()),
            admin_access: false,
            gpu: gpu.uuid.clone(),
            mig: Some(MigRecord {
                uuid: Some(mig.uuid.clone()),
                profile: mig.profile.clone(),
                gi_profile_id: 0,
                placement: mig.placement,
                created: false,
            }),
            consumed: Some(Consumed {
                memory: 1 << 30,
                ..Default::default()
            }),
            sharing: Default::default(),
        };
        let pod = "0f5e2c1a-7b3d-4c2e-9a8b-000000000001";
        let claims = BTreeMap::from([(
            ClaimUid::parse("a").unwrap(),
            ClaimEntry {
                state: ClaimState::PrepareCompleted,
                namespace: "ml".into(),
                name: "nb".into(),
                devices: vec![record],
                pods: vec![PodRef {
                    name: "p".into(),
                    uid: pod.into(),
                }],
                user: None,
                trust_label: None,
            },
        )]);
        let process = |pid, mig_uuid: &str, bytes| ProcessRow {
            gpu_uuid: gpu.uuid.to_string(),
            mig_uuid: mig_uuid.into(),
            pid,
            pod_uid: pod.into(),
            pod_namespace: "ml".into(),
            pod: "p".into(),
            used_memory_bytes: bytes,
        };
        let processes = [
            process(1, mig.uuid.as_str(), 3 << 20),
            process(2, "MIG-another", 5 << 20),
        ];
        let rows = share_rows(&claims, &processes, &inv, true, &BTreeMap::new());
        assert_eq!(rows.len(), 1);
        assert_eq!(rows[0].used_bytes, Some(3 << 20), "its MIG device's only");
        assert_eq!(rows[0].limit_bytes, rows[0].consumed_bytes);
    }

    const UID: &str = "0f5e2c1a-7b3d-4c2e-9a8b-1234567890ab";

    #[test]
    fn pod_uids_are_found_in_both_cgroup_drivers_layouts() {
        let systemd = format!(
            "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{}.slice/cri-containerd-abc.scope",
            UID.replace('-', "_")
        );
        assert_eq!(pod_uid_in(&systemd).as_deref(), Some(UID));
        let cgroupfs = format!("12:memory:/kubepods/burstable/pod{UID}/0123abcd");
        assert_eq!(pod_uid_in(&cgroupfs).as_deref(), Some(UID));
        assert_eq!(
            pod_uid_in("0::/user.slice/user-0.slice/session-1.scope"),
            None
        );
        assert_eq!(
            pod_uid_in("0::/kubepods.slice/kubepods-podnotauid.slice"),
            None
        );
        assert_eq!(pod_uid_in("garbage"), None);
    }

    #[test]
    fn pod_uid_of_reads_the_proc_root_given() {
        let root = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(root.path().join("7")).unwrap();
        std::fs::write(
            root.path().join("7/cgroup"),
            format!("1:name=systemd:/\n0::/kubepods/pod{UID}/c1\n"),
        )
        .unwrap();
        assert_eq!(pod_uid_of(root.path(), 7).as_deref(), Some(UID));
        assert_eq!(pod_uid_of(root.path(), 8), None, "no such process");
    }

    /// A usage read that hangs (NVML stuck) does not hang `/metrics`: the scrape gives up on it
    /// at the backend's deadline and says the readings were not readable
    /// (`nvdra_gpu_usage_readable` 0); the call left running is named.
    #[tokio::test]
    async fn a_scrape_reports_usage_it_could_not_read_in_time_as_unreadable() {
        use crate::inventory::owner::Owner;
        use crate::inventory::sim::{SimBackend, SimCall};

        let sim = SimBackend::from_profile("dgx-h100", "n").unwrap();
        let (mut owner, handle) = Owner::new(
            Arc::new(sim.clone()),
            std::time::Duration::from_secs(3600),
            crate::inventory::owner::DEADLINE,
        )
        .unwrap();
        owner.read().await.unwrap();
        let watched = handle.with_call_deadline(std::time::Duration::from_secs(2));
        let _held = sim.hold(SimCall::Usage);
        let source = Attribution::new(watched.subscribe(), watched.clone());
        let s = tokio::task::spawn_blocking(move || source.scrape())
            .await
            .unwrap();
        assert!(
            !s.usage_ok,
            "a reading past its deadline is reported unreadable"
        );
        assert!(s.gpus.is_empty() && s.processes.is_empty());
        assert_eq!(watched.overdue(), vec!["usage".to_string()]);
    }

    /// A scrape of a simulated node: a claim's device with its pod (the ledger's), a process on
    /// that GPU whose cgroup names the pod (a fake `/proc`), one on another GPU in no pod, and
    /// the readings the backend reports.
    #[tokio::test]
    async fn a_scrape_joins_claims_processes_and_readings() {
        use crate::ids::{ClaimUid, DeviceName};
        use crate::inventory::ProcessUsage;
        use crate::inventory::sim::SimBackend;
        use crate::ledger::{ClaimState, DeviceRecord, PodRef};
        use crate::sharing::{Sharing, TimeSliceInterval};

        let sim = SimBackend::from_profile("dgx-h100", "n").unwrap();
        let inv = sim.snapshot().unwrap();
        let (g2, g3) = (inv.gpus[2].uuid.clone(), inv.gpus[3].uuid.clone());
        let proc_root = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(proc_root.path().join("100")).unwrap();
        std::fs::write(
            proc_root.path().join("100/cgroup"),
            format!("0::/kubepods/besteffort/pod{UID}/abc\n"),
        )
        .unwrap();
        let proc = |pid, gib: u64| ProcessUsage {
            pid,
            used_memory_bytes: Some(gib << 30),
            gpu_instance: None,
        };
        sim.set_processes(&g2, vec![proc(100, 2)]);
        sim.set_processes(&g3, vec![proc(200, 3)]);

        let dir = tempfile::tempdir().unwrap();
        let (ledger, _writer, _) = Ledger::open(dir.path(), "boot", None).unwrap();
        let record = DeviceRecord {
            requests: vec!["gpu".into()],
            pool: "n".into(),
            device: DeviceName::parse("gpu-2").unwrap(),
            cdi_ids: vec![],
            share_id: None,
            admin_access: false,
            gpu: g2.clone(),
            mig: None,
            consumed: None,
            sharing: Sharing::TimeSlicing {
                interval: TimeSliceInterval::Long,
            },
        };
        ledger.update(|c| {
            c.insert(
                ClaimUid::parse("c-1").unwrap(),
                ClaimEntry {
                    state: ClaimState::PrepareCompleted,
                    namespace: "ml".into(),
                    name: "train".into(),
                    devices: vec![record],
                    pods: vec![PodRef {
                        name: "trainer".into(),
                        uid: UID.into(),
                    }],
                    user: None,
                    trust_label: None,
                },
            )
        });
        let node = owner::Published {
            node: Some(Arc::new(inv.clone())),
            ..Default::default()
        };
        let node = tokio::sync::watch::channel(node).1;
        let source = Attribution::new(node, readings(&sim))
            .with_ledger(ledger)
            .with_proc_root(proc_root.path());
        let s = source.scrape();

        assert_eq!(
            s.allocations,
            vec![Allocation {
                device: "gpu-2".into(),
                gpu_uuid: g2.to_string(),
                claim_namespace: "ml".into(),
                claim_name: "train".into(),
                pod_namespace: "ml".into(),
                pod: "trainer".into(),
                path: "dra",
                sharing: "timeSlicing".into(),
                ..Allocation::default()
            }]
        );
        let row =
            |gpu: &crate::inventory::GpuUuid, pid, ns: &str, pod: &str, uid: &str, gib: u64| {
                ProcessRow {
                    gpu_uuid: gpu.to_string(),
                    mig_uuid: String::new(),
                    pid,
                    pod_uid: uid.into(),
                    pod_namespace: ns.into(),
                    pod: pod.into(),
                    used_memory_bytes: gib << 30,
                }
            };
        let mut want = vec![
            row(&g2, 100, "ml", "trainer", UID, 2),
            row(&g3, 200, "", "", "", 3),
        ];
        want.sort();
        assert_eq!(s.processes, want);
        assert!(s.usage_ok);
        assert_eq!(s.gpus.len(), inv.gpus.len());
        assert_eq!(s.gpus[2].device, format!("gpu-{}", inv.gpus[2].minor));
        assert_eq!(s.gpus[2].usage, DeviceBackend::usage(&sim).unwrap()[2]);
        assert_eq!(s.gpus[2].usage.memory_used_bytes, 3 << 30);
    }
}
