//! The device plugin's side of `--mode both`: the one [`Ledger`] it shares with DRA.
//!
//! - A device a DRA claim holds is sent `Unhealthy` in `ListAndWatch` while the claim is
//!   prepared ([`overlay`]), so the device manager does not hand it to a container; the lists are
//!   sent again whenever the ledger changes.
//! - Allocate of a device a claim holds fails naming the claim; otherwise its devices are held
//!   ([`crate::holds`]) at once ([`hold`]), before the kubelet's PodResources lists the pod.
//! - [`poll_pod_resources`] reads the kubelet's PodResources `List` (on
//!   [`Config::pod_resources_socket`](crate::config::Config::pod_resources_socket)) every
//!   [`POD_RESOURCES_POLL`] and after each Allocate, and records what each container holds; the
//!   slice sync hides it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{Notify, watch};
use tokio_util::sync::CancellationToken;

use crate::holds::{ContainerHolds, ContainerRef, Holder, Occupied, claim_holding};
use crate::inventory::Health;
use crate::ledger::Ledger;
use kubelet_plugin::proto::podresources::v1 as pr;
use kubelet_plugin::proto::podresources::v1::pod_resources_lister_client::PodResourcesListerClient;
use kubelet_plugin::socket;

use super::ResourceName;
use super::resources::Resource;

/// How often PodResources is read (besides after each Allocate).
pub const POD_RESOURCES_POLL: Duration = Duration::from_secs(1);
/// How long one `List` may take.
const LIST_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum ListError {
    #[error("cannot connect to the kubelet's PodResources socket {path}")]
    Connect {
        path: PathBuf,
        #[source]
        source: tonic::transport::Error,
    },
    #[error("PodResources List on {path} failed")]
    List {
        path: PathBuf,
        #[source]
        source: tonic::Status,
    },
    #[error("no answer from PodResources on {path} within {LIST_TIMEOUT:?}")]
    Timeout { path: PathBuf },
}

/// What the device-plugin half needs in `both`: the shared ledger and its own holds.
#[derive(Clone)]
pub struct Both {
    pub ledger: Ledger,
    /// What containers hold; the ledger consults them (it was opened with them).
    pub holds: ContainerHolds,
    pub pod_resources: PathBuf,
    /// Poked after each Allocate: read PodResources now.
    pub poke: Arc<Notify>,
}

impl Both {
    /// `holds`: those `ledger` was opened to consult whenever a claim reserves devices.
    pub fn new(ledger: Ledger, holds: ContainerHolds, pod_resources: PathBuf) -> Self {
        Both {
            ledger,
            holds,
            pod_resources,
            poke: Arc::new(Notify::new()),
        }
    }
}

/// What the PodResources poll needs: the holds it fills, the socket it reads, and the poke that
/// makes it read at once. In `both` it is [`Both`]'s; in `device-plugin` mode the holds are only
/// reported (`/metrics`: which pod uses which GPU), never consulted.
#[derive(Clone)]
pub struct PodWatch {
    pub holds: ContainerHolds,
    pub pod_resources: PathBuf,
    pub poke: Arc<Notify>,
}

impl PodWatch {
    /// Holds of their own, read from `pod_resources`.
    pub fn new(pod_resources: PathBuf) -> Self {
        PodWatch {
            holds: ContainerHolds::default(),
            pod_resources,
            poke: Arc::new(Notify::new()),
        }
    }
}

impl Both {
    /// The poll's view of these holds.
    pub fn pod_watch(&self) -> PodWatch {
        PodWatch {
            holds: self.holds.clone(),
            pod_resources: self.pod_resources.clone(),
            poke: self.poke.clone(),
        }
    }
}

/// `res` with every device a DRA claim holds marked unhealthy (naming the claim).
pub fn overlay(ledger: &Ledger, mut res: Vec<Resource>) -> Vec<Resource> {
    for r in &mut res {
        for d in &mut r.devices {
            let occ = Resource::occupied(d);
            if let Some(c) = ledger.read(|cp| claim_holding(&cp.claims, &occ)) {
                d.health = Health::Unhealthy {
                    reason: format!("prepared for DRA {c}"),
                };
            }
        }
    }
    res
}

/// Why an Allocate is refused in `both`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{resource} device {id} ({occupied}) is prepared for DRA {claim}; the device manager must not \
     allocate it while that claim holds it"
)]
pub struct HeldByClaim {
    pub resource: String,
    pub id: String,
    pub occupied: String,
    pub claim: String,
}

/// Holds the devices `ids` of `resource` for the containers of one Allocate, unless a claim
/// holds one of them (the refusal names the first such ID) or `allocated`, what the containers
/// get, is a refusal of its own: returned as it is, holding nothing. The only check of the
/// claims an Allocate makes, atomic with recording the holds.
pub fn hold<T, E>(
    both: &Both,
    resource: &Resource,
    ids: &[String],
    allocated: Result<T, E>,
) -> Result<Result<T, E>, HeldByClaim> {
    let devices: Vec<(Occupied, Holder, String)> = ids
        .iter()
        .filter_map(|id| resource.device(id).map(|d| (id, d)))
        .map(|(id, d)| {
            let holder = Holder::Allocating {
                resource: resource.name.to_string(),
                id: id.clone(),
            };
            (Resource::occupied(d), holder, id.clone())
        })
        .collect();
    // Replicas share hardware: name the first ID of it, as the request lists them.
    let mut ids_by: BTreeMap<Occupied, String> = BTreeMap::new();
    for (o, _, id) in &devices {
        ids_by.entry(o.clone()).or_insert_with(|| id.clone());
    }
    both.holds
        .hold_for_allocate(
            &both.ledger,
            devices.into_iter().map(|(o, h, _)| (o, h)).collect(),
            allocated,
        )
        .map_err(|held| {
            let (occ, claim) = *held;
            HeldByClaim {
                resource: resource.name.to_string(),
                id: ids_by.get(&occ).cloned().unwrap_or_default(),
                occupied: occ.to_string(),
                claim: claim.to_string(),
            }
        })
}

/// The device IDs of each resource this plugin serves, as PodResources names them.
pub type Served = BTreeMap<ResourceName, Arc<Resource>>;

/// What each container holds of `served`, from one PodResources answer.
pub fn observed(
    list: &pr::ListPodResourcesResponse,
    served: &Served,
) -> Vec<(Occupied, ContainerRef)> {
    let mut out = Vec::new();
    for pod in &list.pod_resources {
        for c in &pod.containers {
            for devs in &c.devices {
                let Some(r) = served
                    .iter()
                    .find(|(n, _)| n.as_str() == devs.resource_name)
                    .map(|(_, r)| r)
                else {
                    continue;
                };
                for id in &devs.device_ids {
                    if let Some(d) = r.device(id) {
                        out.push((
                            Resource::occupied(d),
                            ContainerRef {
                                namespace: pod.namespace.clone(),
                                pod: pod.name.clone(),
                                container: c.name.clone(),
                            },
                        ));
                    }
                }
            }
        }
    }
    out
}

/// One PodResources `List`.
pub async fn list(path: &Path) -> Result<pr::ListPodResourcesResponse, ListError> {
    let call = async {
        let channel = socket::connect(path)
            .await
            .map_err(|source| ListError::Connect {
                path: path.to_path_buf(),
                source,
            })?;
        PodResourcesListerClient::new(channel)
            .list(pr::ListPodResourcesRequest {})
            .await
            .map(tonic::Response::into_inner)
            .map_err(|source| ListError::List {
                path: path.to_path_buf(),
                source,
            })
    };
    tokio::time::timeout(LIST_TIMEOUT, call)
        .await
        .map_err(|_| ListError::Timeout {
            path: path.to_path_buf(),
        })?
}

/// Reads PodResources every [`POD_RESOURCES_POLL`] and when poked, until `shutdown`, and gives
/// the holds what containers hold. A failed read keeps the last holds (logged once per run of
/// failures): forgetting them would publish GPUs that containers still use.
pub async fn poll_pod_resources(
    both: PodWatch,
    served: watch::Receiver<Served>,
    shutdown: CancellationToken,
) {
    let mut tick = tokio::time::interval(POD_RESOURCES_POLL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut failing = false;
    loop {
        tokio::select! {
            biased;
            () = shutdown.cancelled() => return,
            () = both.poke.notified() => {}
            _ = tick.tick() => {}
        }
        match list(&both.pod_resources).await {
            Ok(answer) => {
                if failing {
                    tracing::info!(socket = %both.pod_resources.display(), "PodResources answers again");
                    failing = false;
                }
                let held = observed(&answer, &served.borrow());
                both.holds.set_observed(held);
            }
            Err(e) if !failing => {
                tracing::warn!(error = %crate::report::chain(&e),
                    "cannot read which containers hold GPUs; keeping the last known holds");
                failing = true;
            }
            Err(_) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::{ClaimUid, DeviceName};
    use crate::inventory::sim::SimBackend;
    use crate::inventory::{DeviceBackend, DeviceUuid};
    use crate::ledger::{ClaimEntry, ClaimState, DeviceRecord, MigRecord};
    use crate::sharing::Sharing;

    fn resources() -> (crate::inventory::Inventory, Vec<Resource>) {
        let inv = SimBackend::from_profile("a100-mig-mixed", "n")
            .unwrap()
            .snapshot()
            .unwrap();
        let opts = super::super::Options {
            mig_strategy: super::super::MigStrategy::Mixed,
            ..Default::default()
        };
        let res = super::super::resources::resources(&inv, &opts).unwrap();
        (inv, res)
    }

    fn claim(ledger: &Ledger, uid: &str, record: DeviceRecord) {
        ledger.update(|c| {
            c.insert(
                ClaimUid::parse(uid).unwrap(),
                ClaimEntry {
                    state: ClaimState::PrepareCompleted,
                    namespace: "ns".into(),
                    name: format!("claim-{uid}"),
                    devices: vec![record],
                    pods: vec![],
                    user: None,
                    trust_label: None,
                },
            )
        });
    }

    fn record(
        gpu: &crate::inventory::Gpu,
        mig: Option<&crate::inventory::MigDevice>,
    ) -> DeviceRecord {
        DeviceRecord {
            requests: vec!["gpu".into()],
            pool: "n".into(),
            device: DeviceName::parse("gpu-0").unwrap(),
            cdi_ids: vec![],
            share_id: None,
            admin_access: false,
            gpu: gpu.uuid.clone(),
            mig: mig.map(|m| MigRecord {
                uuid: Some(m.uuid.clone()),
                profile: m.profile.clone(),
                gi_profile_id: m.gi_profile_id,
                placement: m.placement,
                created: false,
            }),
            consumed: None,
            sharing: Sharing::Exclusive,
        }
    }

    fn unhealthy(res: &[Resource]) -> Vec<String> {
        res.iter()
            .flat_map(|r| &r.devices)
            .filter(|d| !d.health.is_healthy())
            .map(|d| d.uuid.to_string())
            .collect()
    }

    #[test]
    fn a_claimed_mig_device_or_its_whole_gpu_is_unhealthy_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let (ledger, _w, _) = Ledger::open(dir.path(), "boot", None).unwrap();
        let (inv, res) = resources();
        let mig_gpu = inv.gpus.iter().find(|g| g.mig.devices.len() > 1).unwrap();
        let (m0, m1) = (&mig_gpu.mig.devices[0], &mig_gpu.mig.devices[1]);
        claim(&ledger, "a", record(mig_gpu, Some(m0)));
        let out = overlay(&ledger, res.clone());
        assert_eq!(unhealthy(&out), vec![m0.uuid.to_string()]);
        let d = out
            .iter()
            .flat_map(|r| &r.devices)
            .find(|d| d.uuid == DeviceUuid::Mig(m0.uuid.clone()))
            .unwrap();
        assert_eq!(
            d.health,
            Health::Unhealthy {
                reason: "prepared for DRA resource claim ns/claim-a (a)".into()
            }
        );

        // A whole-GPU claim on the MIG GPU: every MIG device of it.
        ledger.update(|c| c.clear());
        claim(&ledger, "b", record(mig_gpu, None));
        let mut got = unhealthy(&overlay(&ledger, res));
        got.sort();
        let mut want: Vec<String> = mig_gpu
            .mig
            .devices
            .iter()
            .map(|m| m.uuid.to_string())
            .collect();
        want.sort();
        assert_eq!(got, want);
        assert!(got.contains(&m1.uuid.to_string()));
    }

    /// One ledger: a GPU shared by capacity (a share of `gpu-<minor>`) is held for the
    /// device-plugin path as a whole claim's GPU is, naming the claim.
    #[test]
    fn a_gpu_with_a_capacity_share_is_held_for_the_device_plugin() {
        let dir = tempfile::tempdir().unwrap();
        let (ledger, _w, _) = Ledger::open(dir.path(), "boot", None).unwrap();
        let (inv, res) = resources();
        let whole = inv.gpus.iter().find(|g| !g.in_mig_mode()).unwrap();
        let share = DeviceRecord {
            device: DeviceName::gpu(whole.minor),
            share_id: Some("0b6a4c1e-0000-4000-8000-000000000001".into()),
            consumed: Some(crate::ledger::Consumed {
                memory: 4 << 30,
                multiprocessors: None,
                shares: None,
                burst_limit: None,
            }),
            ..record(whole, None)
        };
        claim(&ledger, "s", share);
        let out = overlay(&ledger, res);
        assert_eq!(unhealthy(&out), vec![whole.uuid.to_string()]);
        let d = out
            .iter()
            .flat_map(|r| &r.devices)
            .find(|d| d.uuid == DeviceUuid::Gpu(whole.uuid.clone()))
            .unwrap();
        assert_eq!(
            d.health,
            Health::Unhealthy {
                reason: "prepared for DRA resource claim ns/claim-s (s)".into()
            }
        );
    }

    /// Dynamic MIG: a claim's MIG instance on a GPU the device plugin lists whole (its MIG mode
    /// switched after the list was read, or the instance not created yet: no UUID) holds the
    /// GPU for the device-plugin path; and a container holding the GPU whole keeps a claim of a
    /// placement of it from being reserved, before its mode would switch.
    #[test]
    fn a_dynamic_mig_instance_holds_its_whole_gpu_both_ways() {
        let dir = tempfile::tempdir().unwrap();
        let (ledger, _w, _) = Ledger::open(dir.path(), "boot", None).unwrap();
        let (inv, res) = resources();
        let whole = inv.gpus.iter().find(|g| !g.in_mig_mode()).unwrap();
        let p = &whole.mig.profiles[0];
        for uuid in [Some(crate::inventory::MigUuid("MIG-x".into())), None] {
            ledger.update(|c| c.clear());
            let placed = DeviceRecord {
                mig: Some(MigRecord {
                    uuid: uuid.clone(),
                    profile: p.name.clone(),
                    gi_profile_id: p.gi_profile_id,
                    placement: p.placements[0],
                    created: true,
                }),
                ..record(whole, None)
            };
            claim(&ledger, "m", placed.clone());
            assert_eq!(
                unhealthy(&overlay(&ledger, res.clone())),
                vec![whole.uuid.to_string()],
                "{uuid:?}"
            );
            // The other way: a container's whole GPU overlaps the placement.
            let held = crate::holds::Occupied {
                gpu: whole.uuid.clone(),
                mig: None,
            };
            assert!(held.overlaps(&placed));
        }
    }

    #[test]
    fn pod_resources_map_to_the_hardware_of_our_ids_only() {
        let (inv, res) = resources();
        let served: Served = res
            .iter()
            .map(|r| (r.name.clone(), Arc::new(r.clone())))
            .collect();
        let whole = inv.gpus.iter().find(|g| !g.in_mig_mode()).unwrap();
        let list = pr::ListPodResourcesResponse {
            pod_resources: vec![pr::PodResources {
                name: "p".into(),
                namespace: "ns".into(),
                containers: vec![pr::ContainerResources {
                    name: "c".into(),
                    devices: vec![
                        pr::ContainerDevices {
                            resource_name: "nvidia.com/gpu".into(),
                            device_ids: vec![whole.uuid.to_string(), "GPU-not-ours".into()],
                            topology: None,
                        },
                        pr::ContainerDevices {
                            resource_name: "example.com/nic".into(),
                            device_ids: vec![whole.uuid.to_string()],
                            topology: None,
                        },
                    ],
                    ..Default::default()
                }],
            }],
        };
        let held = observed(&list, &served);
        assert_eq!(
            held,
            vec![(
                Occupied {
                    gpu: whole.uuid.clone(),
                    mig: None
                },
                ContainerRef {
                    namespace: "ns".into(),
                    pod: "p".into(),
                    container: "c".into()
                }
            )]
        );
    }
}
