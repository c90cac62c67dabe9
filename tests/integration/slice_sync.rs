//! Inventory → slices → publisher → test API server: changes in the (simulated) hardware reach the
//! API server as one update, and a server that drops the partitionable fields gets the plain
//! layout instead; with `--shared-capacity`, the shareable GPUs as the server stores them, and
//! plain whole GPUs where the server drops consumable capacity. With `--dynamic-mig`: a
//! passthrough H100 offered and switched at prepare, a holder that blocks a switch withdrawing
//! its GPU's placements at the next read, and a prepare that met `IN_USE` tainting them.

use crate::support;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::resource::v1::ResourceSlice;
use kubelet_plugin::publisher::{Options, Publisher, PublisherHandle};
use nvdra::api::ClusterApi;
use nvdra::api::kube::KubeApi;
use nvdra::dra::plugin::{ClaimRef, Options as PluginOptions, Plugin};
use nvdra::dra::slices::{ConsumableShares, CounterLayout, SliceOptions, desired_slices};
use nvdra::dra::sync::{SliceSync, layout_for};
use nvdra::ids::ClaimUid;
use nvdra::inventory::owner::{InventoryHandle, Owner, Writes};
use nvdra::inventory::sim::SimBackend;
use nvdra::inventory::switch_blocks::SwitchBlocks;
use nvdra::inventory::{
    self, DeviceBackend, Health, Holder, HolderKind, Inventory, MigDevice, MigUuid, Placement,
    ProcessUsage, SwitchBlock, Virtualization,
};
use support::apiserver::TestApiServer;
use support::wait::{SOON, eventually};
use tokio_util::sync::CancellationToken;

const DRIVER: &str = "gpu.nvidia.com";
const NODE: &str = "node-a";

struct Node {
    server: TestApiServer,
    sim: SimBackend,
    /// The inventory owner the sync follows.
    sync: InventoryHandle,
    publisher: PublisherHandle,
    /// Inventory reads so far.
    reads: tokio::sync::watch::Receiver<u64>,
    token: CancellationToken,
}

/// The simulated backend, counting inventory reads: the event that proves the sync looked.
struct Counting {
    sim: SimBackend,
    reads: tokio::sync::watch::Sender<u64>,
}

impl DeviceBackend for Counting {
    fn name(&self) -> &'static str {
        self.sim.name()
    }
    fn snapshot(&self) -> inventory::Result<Inventory> {
        let inv = self.sim.snapshot();
        self.reads.send_modify(|n| *n += 1);
        inv
    }
}

impl Node {
    /// Announces a change and waits until the sync has fully handled it. The sync handles one
    /// announcement at a time, so once the read of a second announcement (sent after the
    /// first one's read) has started, the first is done, a new desired state included.
    async fn announce_and_wait(&mut self) {
        for _ in 0..2 {
            let n = *self.reads.borrow_and_update();
            self.sync.request();
            tokio::time::timeout(SOON, self.reads.wait_for(|r| *r > n))
                .await
                .expect("the sync reads the inventory")
                .expect("the backend lives");
        }
    }

    /// Asserts that an announced change that is none publishes nothing: no new desired state,
    /// no write request.
    async fn assert_announcing_writes_nothing(&mut self) {
        let seq = self.publisher.desired_seq();
        let writes = self.server.counts().write_requests;
        self.announce_and_wait().await;
        assert_eq!(self.publisher.desired_seq(), seq, "a new desired state");
        assert_eq!(self.server.counts().write_requests, writes);
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.token.cancel();
    }
}

async fn start(profile: &str, partitionable: bool, prepare: impl FnOnce(&TestApiServer)) -> Node {
    start_with(profile, partitionable, false, prepare).await
}

async fn start_with(
    profile: &str,
    partitionable: bool,
    shared_capacity: bool,
    prepare: impl FnOnce(&TestApiServer),
) -> Node {
    start_opts(
        profile,
        |o| {
            o.partitionable = partitionable;
            o.shared_capacity = if shared_capacity {
                ConsumableShares::Memory
            } else {
                ConsumableShares::Disabled
            };
        },
        prepare,
    )
    .await
}

/// Starts a node whose slice options `shape` sets (all switches off before it).
async fn start_opts(
    profile: &str,
    shape: impl FnOnce(&mut SliceOptions),
    prepare: impl FnOnce(&TestApiServer),
) -> Node {
    let sim = SimBackend::from_profile(profile, NODE).unwrap();
    start_sim(sim, shape, prepare, |_| None).await
}

/// Starts a node on `sim`, publishing with the switch blocks `blocks` gives (a plugin's, made
/// over the node's inventory owner) where it gives some.
async fn start_sim(
    sim: SimBackend,
    shape: impl FnOnce(&mut SliceOptions),
    prepare: impl FnOnce(&TestApiServer),
    blocks: impl FnOnce(&InventoryHandle) -> Option<SwitchBlocks>,
) -> Node {
    let server = TestApiServer::start().await;
    server.seed_node(NODE, "uid-node-a");
    prepare(&server);
    let api = Arc::new(KubeApi::from_url(server.url()).unwrap());
    let layout = layout_for(api.server_version().await.unwrap().map(|v| v.minor));
    let options = Options {
        settle: Duration::from_millis(20),
        backoff_base: Duration::from_millis(20),
        backoff_cap: Duration::from_millis(200),
        conflict_retries: 5,
        ..Options::default()
    };
    let (publisher, handle) = Publisher::with_options(api, DRIVER, NODE, options);
    let (reads_tx, reads) = tokio::sync::watch::channel(0);
    let backend = Counting {
        sim: sim.clone(),
        reads: reads_tx,
    };
    let mut slice_options = SliceOptions {
        driver: DRIVER.into(),
        node_name: NODE.into(),
        partitionable: false,
        shared_capacity: ConsumableShares::Disabled,
        dynamic_mig: false,
        mig_profiles: None,
        layout,
    };
    shape(&mut slice_options);
    let token = CancellationToken::new();
    // A rescan long enough that only announced changes are picked up during a test.
    let hour = Duration::from_secs(3600);
    let (mut owner, sync_handle) =
        Owner::new(Arc::new(backend), hour, nvdra::inventory::owner::DEADLINE).unwrap();
    // Its first read taken before anything reads the publication, as `nvdra run` does: a
    // plugin's recovery must not find the node not yet read.
    let _ = owner.read().await;
    tokio::spawn(owner.run(nvdra::testing::no_health(), token.clone()));
    let sync = SliceSync::new(sync_handle.subscribe(), handle.clone(), slice_options);
    let sync = match blocks(&sync_handle) {
        Some(b) => sync.with_switch_blocks(b),
        None => sync,
    };
    tokio::spawn(publisher.run(token.clone()));
    tokio::spawn(sync.run(token.clone()));
    Node {
        server,
        sim,
        sync: sync_handle,
        publisher: handle,
        reads,
        token,
    }
}

fn device_names(slices: &[ResourceSlice]) -> BTreeSet<String> {
    slices
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten())
        .map(|d| d.name.clone())
        .collect()
}

fn generations(slices: &[ResourceSlice]) -> BTreeSet<i64> {
    slices.iter().map(|s| s.spec.pool.generation).collect()
}

fn gpus(n: u32) -> BTreeSet<String> {
    (0..n).map(|i| format!("gpu-{i}")).collect()
}

#[tokio::test]
async fn an_unhealthy_gpu_is_one_update_that_keeps_the_generation() {
    let mut node = start("dgx-h100", false, |_| {}).await;
    eventually("first publish", || {
        device_names(&node.server.slices()) == gpus(8)
    })
    .await;
    let before = node.server.counts();
    assert_eq!(generations(&node.server.slices()), BTreeSet::from([1]));

    node.sim.update(|inv| {
        inv.gpus[3].health = Health::Unhealthy {
            reason: "XID 79".into(),
        }
    });
    node.sync.request();
    let mut expected = gpus(8);
    expected.remove("gpu-3");
    eventually("gpu-3 withdrawn", || {
        device_names(&node.server.slices()) == expected
    })
    .await;
    let after = node.server.counts();
    assert_eq!(after.updates - before.updates, 1, "{after:?}");
    assert_eq!(after.creates, before.creates);
    assert_eq!(after.deletes, before.deletes);
    // One slice rewritten is one atomic write: the pool keeps its generation (as Go's
    // resourceslice controller has it), so the scheduler never sees it half old, half new.
    assert_eq!(generations(&node.server.slices()), BTreeSet::from([1]));

    // Announcing a change that is not one writes nothing.
    node.assert_announcing_writes_nothing().await;
}

#[tokio::test]
async fn a_new_mig_device_is_published() {
    let node = start("a100-mig-mixed", false, |_| {}).await;
    eventually("first publish", || {
        device_names(&node.server.slices()).contains("gpu-2-mig-1g10gb-15-4")
    })
    .await;
    let before = node.server.counts();

    node.sim.update(|inv| {
        let gpu = &mut inv.gpus[2];
        let profile = gpu
            .mig
            .profiles
            .iter()
            .find(|p| p.name == "1g.10gb")
            .unwrap()
            .clone();
        gpu.mig.devices.push(MigDevice {
            uuid: MigUuid("MIG-new".into()),
            profile: profile.name,
            gi_profile_id: profile.gi_profile_id,
            gi_id: 9,
            ci_id: 0,
            placement: Placement { start: 6, size: 2 },
            memory_bytes: profile.memory_bytes,
            multiprocessors: profile.multiprocessors,
            engines: profile.engines,
            health: Health::Healthy,
        });
    });
    node.sync.request();
    eventually("the new MIG device", || {
        device_names(&node.server.slices()).contains("gpu-2-mig-1g10gb-15-6")
    })
    .await;
    let after = node.server.counts();
    assert_eq!(after.updates - before.updates, 1, "{after:?}");
    assert_eq!(after.creates, before.creates);
}

#[tokio::test]
async fn dropped_partitionable_fields_fall_back_to_the_plain_layout() {
    let mut node = start("a100-mig-mixed", true, |server| {
        server.drop_field("sharedCounters");
        server.drop_field("devices[].consumesCounters");
    })
    .await;
    // The plain layout: whole GPUs not in MIG mode and the existing MIG devices.
    let plain = desired_slices(
        &node.sim.snapshot().unwrap(),
        &SliceOptions {
            driver: DRIVER.into(),
            node_name: NODE.into(),
            partitionable: false,
            shared_capacity: ConsumableShares::Disabled,
            dynamic_mig: false,
            mig_profiles: None,
            layout: CounterLayout::Separate,
        },
    )
    .unwrap();
    let expected: BTreeSet<String> = plain
        .iter()
        .flat_map(|s| s.devices.iter().flatten())
        .map(|d| d.name.clone())
        .collect();
    assert!(expected.contains("gpu-0") && expected.contains("gpu-1-mig-3g20gb-9-4"));
    // Settled means the plain layout only: the counter slices of the first attempt are gone too.
    eventually("the plain layout", || {
        let slices = node.server.slices();
        slices.len() == 1 && device_names(&slices) == expected
    })
    .await;
    let slices = node.server.slices();
    assert!(slices.iter().all(|s| s.spec.shared_counters.is_none()));
    // Settled: no further writes.
    node.assert_announcing_writes_nothing().await;
}

#[tokio::test]
async fn partitionable_devices_are_published_where_the_server_keeps_them() {
    let node = start("dgx-a100-mig", true, |_| {}).await;
    eventually("placements of every GPU", || {
        let names = device_names(&node.server.slices());
        names.len() == 8 * 25 && names.contains("gpu-7-mig-7g80gb-0-0")
    })
    .await;
    let slices = node.server.slices();
    assert!(slices.iter().any(|s| s.spec.shared_counters.is_some()));
    // 1.35 (the test server's default): counters never share a slice with devices.
    assert!(
        slices
            .iter()
            .all(|s| s.spec.shared_counters.is_none() || s.spec.devices.is_none())
    );
}

#[tokio::test]
async fn a_1_34_server_gets_counters_and_devices_together() {
    let node = start("dgx-a100-mig", true, |server| server.set_server_minor(34)).await;
    eventually("placements of every GPU", || {
        device_names(&node.server.slices()).len() == 8 * 25
    })
    .await;
    let slices = node.server.slices();
    assert!(slices.iter().any(|s| {
        s.spec.shared_counters.is_some() && s.spec.devices.as_ref().is_some_and(|d| !d.is_empty())
    }));
    assert_eq!(layout_for(Some(34)), CounterLayout::Together);
}

/// `--dynamic-mig` on the test API server: every H100 whole and in each of its 25 MIG
/// placements, one counter set each, stored as sent (the server checks the API's rules), in the
/// 1.35 layout and in the 1.34 one.
#[tokio::test]
async fn dynamic_mig_publishes_every_gpu_whole_and_in_placements() {
    for minor in [35, 34] {
        let node = start_opts(
            "dgx-h100",
            |o| o.dynamic_mig = true,
            |server| server.set_server_minor(minor),
        )
        .await;
        eventually("every GPU whole and in placements", || {
            let names = device_names(&node.server.slices());
            names.len() == 8 * 26 && gpus(8).is_subset(&names)
        })
        .await;
        let slices = node.server.slices();
        let sets: Vec<&str> = slices
            .iter()
            .flat_map(|s| s.spec.shared_counters.iter().flatten())
            .map(|c| c.name.as_str())
            .collect();
        assert_eq!(sets.len(), 8, "1.{minor}: {sets:?}");
        let consuming = slices
            .iter()
            .flat_map(|s| s.spec.devices.iter().flatten())
            .filter(|d| d.consumes_counters.as_ref().is_some_and(|c| !c.is_empty()))
            .count();
        assert_eq!(consuming, 8 * 26, "1.{minor}");
    }
}

/// The devices of GPU `minor` (whole and MIG) in `slices`, each with its taints as
/// `key[=value]:effect`.
fn of_gpu(slices: &[ResourceSlice], minor: u32) -> BTreeMap<String, Vec<String>> {
    let whole = format!("gpu-{minor}");
    let mig = format!("gpu-{minor}-mig-");
    slices
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten())
        .filter(|d| d.name == whole || d.name.starts_with(&mig))
        .map(|d| {
            let taints = d
                .taints
                .iter()
                .flatten()
                .map(|t| match &t.value {
                    Some(v) => format!("{}={v}:{}", t.key, t.effect),
                    None => format!("{}:{}", t.key, t.effect),
                })
                .collect();
            (d.name.clone(), taints)
        })
        .collect()
}

/// Whether any device of `slices` is tainted.
fn any_taint(slices: &[ResourceSlice]) -> bool {
    slices
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten())
        .any(|d| d.taints.as_ref().is_some_and(|t| !t.is_empty()))
}

/// `desired` as the slices the server would store.
fn as_slices(desired: &kubelet_plugin::publisher::Resources) -> Vec<ResourceSlice> {
    desired
        .pools
        .values()
        .flat_map(|p| &p.slices)
        .map(|s| ResourceSlice {
            metadata: Default::default(),
            spec: k8s_openapi::api::resource::v1::ResourceSliceSpec {
                devices: Some(s.devices.clone()),
                shared_counters: Some(s.shared_counters.clone()),
                ..Default::default()
            },
        })
        .collect()
}

/// A MIG mode change pending on a Hopper GPU (someone's `nvidia-smi -mig`, or a crash before
/// nvdra withdrew a refused switch) reaches the API server as one update: that GPU is published
/// by its current mode, whole only, and nothing is tainted (the plugin withdraws the change);
/// once it is withdrawn, the GPU is offered both ways again.
#[tokio::test]
async fn a_pending_mig_mode_change_on_hopper_is_published_untainted() {
    let mut node = start_opts("dgx-h100", |o| o.dynamic_mig = true, |_| {}).await;
    eventually("every GPU whole and in placements", || {
        device_names(&node.server.slices()).len() == 8 * 26
    })
    .await;
    node.sim.update(|inv| inv.gpus[0].mig.pending = Some(true));
    node.announce_and_wait().await;
    eventually("GPU 0 whole only, untainted", || {
        let slices = node.server.slices();
        let gpu0: Vec<String> = of_gpu(&slices, 0).into_keys().collect();
        device_names(&slices).len() == 7 * 26 + 1 && gpu0 == ["gpu-0"] && !any_taint(&slices)
    })
    .await;
    node.sim.update(|inv| inv.gpus[0].mig.pending = None);
    node.announce_and_wait().await;
    eventually("offered both ways again", || {
        device_names(&node.server.slices()).len() == 8 * 26
    })
    .await;
}

/// A DCGM-like holder (`nv-hostengine`) appearing on an idle GPU that could switch withdraws
/// the GPU's placements at the inventory read that finds it: that read's desired slices offer
/// the GPU whole only (a claim allocated a placement there could not be prepared), and the
/// server gets them. The persistence daemon withdraws nothing. Once the holder is gone, the
/// placements are back.
#[tokio::test]
async fn a_dcgm_like_holder_withdraws_its_gpus_placements_within_one_publish() {
    let mut node = start_opts("dgx-h100", |o| o.dynamic_mig = true, |_| {}).await;
    eventually("every GPU whole and in placements", || {
        device_names(&node.server.slices()).len() == 8 * 26
    })
    .await;
    let inv = node.sim.snapshot().unwrap();
    node.sim.set_holders(
        &inv.gpus[0].uuid,
        vec![Holder {
            pid: 4242,
            name: "nv-hostengine".into(),
            kind: HolderKind::Foreign,
        }],
    );
    node.sim.set_holders(
        &inv.gpus[1].uuid,
        vec![Holder {
            pid: 17,
            name: "nvidia-persistenced".into(),
            kind: HolderKind::Harmless,
        }],
    );
    let seq = node.publisher.desired_seq();
    node.announce_and_wait().await;
    assert_eq!(
        node.publisher.desired_seq(),
        seq.map(|n| n + 1),
        "one new desired state"
    );
    let desired = as_slices(&node.publisher.desired().unwrap());
    let gpu0: Vec<String> = of_gpu(&desired, 0).into_keys().collect();
    assert_eq!(gpu0, ["gpu-0"], "whole only");
    assert_eq!(
        of_gpu(&desired, 1).len(),
        26,
        "persistenced withdraws nothing"
    );
    assert_eq!(device_names(&desired).len(), 7 * 26 + 1);
    assert!(!any_taint(&desired));
    eventually("the server has them", || {
        device_names(&node.server.slices()) == device_names(&desired)
    })
    .await;

    node.sim.set_holders(&inv.gpus[0].uuid, Vec::new());
    node.announce_and_wait().await;
    eventually("the placements are back", || {
        device_names(&node.server.slices()).len() == 8 * 26
    })
    .await;
}

/// The switch blocks given to the sync are published with each read: after a prepare met
/// `IN_USE` on GPU 0 its placements are tainted `mig-switch-blocked:NoExecute`, valued with the
/// holder's name, the whole GPU not; where the server drops device taints they are withdrawn
/// instead (the GPU whole only). Clearing the block offers them again.
#[tokio::test]
async fn a_switch_block_is_published_tainted_or_withdrawn_where_taints_are_dropped() {
    for drops_taints in [false, true] {
        let blocks = SwitchBlocks::default();
        let sim = SimBackend::from_profile("dgx-h100", NODE).unwrap();
        let mut node = start_sim(
            sim,
            |o| o.dynamic_mig = true,
            |server| {
                if drops_taints {
                    server.drop_field("devices[].taints");
                }
            },
            |_| Some(blocks.clone()),
        )
        .await;
        eventually("every GPU whole and in placements", || {
            device_names(&node.server.slices()).len() == 8 * 26
        })
        .await;
        if drops_taints {
            // The publisher reports the dropped field once it has written a tainted device; make
            // it write one (a health taint), then let it heal.
            node.sim.update(|inv| {
                inv.gpus[7].health = Health::Tainted {
                    reason: "XID 79".into(),
                    taint: inventory::Taint {
                        key: inventory::TaintKey::Xid(79),
                        effect: inventory::TaintEffect::NoSchedule,
                    },
                }
            });
            node.announce_and_wait().await;
            eventually("the tainted GPU withdrawn", || {
                !device_names(&node.server.slices()).contains("gpu-7")
            })
            .await;
            node.sim.update(|inv| inv.gpus[7].health = Health::Healthy);
            node.announce_and_wait().await;
        }
        let g0 = node.sim.snapshot().unwrap().gpus[0].uuid.clone();
        assert!(blocks.set(
            &g0,
            SwitchBlock::InUse {
                holders: vec![Holder {
                    pid: 4242,
                    name: "nv-hostengine".into(),
                    kind: HolderKind::Foreign,
                }],
            },
        ));
        node.announce_and_wait().await;
        let blocked = format!("{DRIVER}/mig-switch-blocked=nv-hostengine:NoExecute");
        if drops_taints {
            eventually("GPU 0 whole only", || {
                let gpu0: Vec<String> = of_gpu(&node.server.slices(), 0).into_keys().collect();
                gpu0 == ["gpu-0"]
            })
            .await;
        } else {
            eventually("GPU 0's placements tainted", || {
                let gpu0 = of_gpu(&node.server.slices(), 0);
                gpu0.len() == 26
                    && gpu0.iter().all(|(name, taints)| {
                        (name == "gpu-0") == taints.is_empty()
                            && (taints.is_empty() || taints == std::slice::from_ref(&blocked))
                    })
            })
            .await;
        }
        assert!(blocks.clear(&g0));
        node.announce_and_wait().await;
        eventually("offered again, untainted", || {
            let slices = node.server.slices();
            of_gpu(&slices, 0).len() == 26 && !any_taint(&slices)
        })
        .await;
    }
}

fn claim_ref(uid: &str) -> ClaimRef {
    ClaimRef {
        namespace: "default".into(),
        name: format!("claim-{uid}"),
        uid: ClaimUid::parse(uid).unwrap(),
    }
}

/// A cloud H100 node (every GPU in a passthrough VM) with the plugin beside the slice sync, wired
/// as `nvdra run --dynamic-mig` wires them (the plugin's switch blocks and inventory hook): every
/// GPU is published whole and in placements; a prepare of a placement switches its GPU into MIG
/// mode, and the slices follow. A prepare whose switch meets `IN_USE` (a process that no read
/// saw) taints that GPU's placements `mig-switch-blocked:NoExecute`, so the pod allocated there
/// is evicted, the whole GPU untainted; the kubelet's retry after the process exits switches it,
/// and the taint goes.
#[tokio::test]
async fn a_passthrough_h100_switches_at_prepare_and_in_use_taints_its_placements() {
    let sim = SimBackend::from_profile("dgx-h100", NODE).unwrap();
    sim.update(|inv| {
        for g in &mut inv.gpus {
            g.virtualization = Some(Virtualization::Passthrough);
        }
    });
    let dir = tempfile::tempdir().unwrap();
    let api_dir = dir.path().join("api");
    for (uid, device) in [
        ("a", "gpu-0-mig-1g10gb-19-0"),
        ("b", "gpu-1-mig-1g10gb-19-0"),
    ] {
        let c = nvdra::api::allocated_claim(
            "default",
            &format!("claim-{uid}"),
            uid,
            vec![nvdra::api::allocated_device("mig", DRIVER, NODE, device)],
            vec![],
        );
        nvdra::api::dir::write_claim(&api_dir, &c).unwrap();
    }
    let api = Arc::new(nvdra::api::dir::DirApi::new(&api_dir).unwrap());
    let opts = PluginOptions {
        driver: DRIVER.into(),
        pool: NODE.into(),
        plugin_dir: dir.path().join("plugin"),
        cdi_root: dir.path().join("cdi"),
        driver_root: nvdra::cdi::DriverRoot::at(&dir.path().join("driver")),
        boot_id: "test".into(),
        partitionable: false,
        shared_capacity: ConsumableShares::Disabled,
        mps_root: dir.path().join("mps"),
        dynamic_mig: true,
        keep_mig_on: false,
        share_trust_domain: Default::default(),
        proc_root: None,
        claim_status: false,
    };
    // The plugin writes through the node's inventory owner and asks it for reads, as in `nvdra
    // run`; the sync follows its publications.
    let mut made = None;
    let node = start_sim(
        sim.clone(),
        |o| o.dynamic_mig = true,
        |_| {},
        |owner| {
            let writes = Writes::new(Arc::new(sim.clone()), owner.clone());
            let made = made.insert(
                Plugin::new(opts, api, writes, nvdra::metrics::Metrics::new(), None).unwrap(),
            );
            Some(made.0.switch_blocks())
        },
    )
    .await;
    let (plugin, writer, _) = made.unwrap();
    let stop = CancellationToken::new();
    tokio::spawn(writer.run(stop.clone()));
    plugin.recover().await.unwrap();
    eventually("every GPU whole and in placements, untainted", || {
        let slices = node.server.slices();
        device_names(&slices).len() == 8 * 26 && !any_taint(&slices)
    })
    .await;

    let r = plugin.prepare(vec![claim_ref("a")]).await;
    if let Err(e) = &r[0].1 {
        panic!("prepare a: {e}");
    }
    assert!(sim.snapshot().unwrap().gpus[0].mig.enabled, "switched on");
    eventually("GPU 0 in MIG mode: its instance, not the whole GPU", || {
        let gpu0 = of_gpu(&node.server.slices(), 0);
        gpu0.contains_key("gpu-0-mig-1g10gb-19-0") && !gpu0.contains_key("gpu-0")
    })
    .await;

    let g1 = sim.snapshot().unwrap().gpus[1].uuid.clone();
    sim.set_processes(
        &g1,
        vec![ProcessUsage {
            pid: 4242,
            used_memory_bytes: None,
            gpu_instance: None,
        }],
    );
    let r = plugin.prepare(vec![claim_ref("b")]).await;
    let e = r[0].1.as_ref().expect_err("IN_USE");
    assert!(e.to_string().contains("4242"), "{e}");
    assert!(!sim.snapshot().unwrap().gpus[1].mig.enabled);
    let blocked = format!("{DRIVER}/mig-switch-blocked:NoExecute");
    eventually(
        "GPU 1's placements tainted NoExecute, the whole GPU not",
        || {
            let gpu1 = of_gpu(&node.server.slices(), 1);
            gpu1.len() == 26
                && gpu1.iter().all(|(name, taints)| {
                    if name == "gpu-1" {
                        taints.is_empty()
                    } else {
                        taints == std::slice::from_ref(&blocked)
                    }
                })
        },
    )
    .await;

    sim.set_processes(&g1, Vec::new());
    let r = plugin.prepare(vec![claim_ref("b")]).await;
    if let Err(e) = &r[0].1 {
        panic!("prepare b again: {e}");
    }
    assert!(sim.snapshot().unwrap().gpus[1].mig.enabled, "switched on");
    eventually("untainted again", || !any_taint(&node.server.slices())).await;
    stop.cancel();
}

/// `--dynamic-mig` where the server drops the counter fields: a GPU offered whole and in MIG
/// placements without counters could be handed out both ways at once, so the node falls back
/// to each GPU by its current mode (whole, on dgx-h100), and settles.
#[tokio::test]
async fn dynamic_mig_falls_back_to_whole_gpus_where_the_server_drops_counters() {
    let mut node = start_opts(
        "dgx-h100",
        |o| o.dynamic_mig = true,
        |server| {
            server.drop_field("sharedCounters");
            server.drop_field("devices[].consumesCounters");
        },
    )
    .await;
    eventually("whole GPUs only", || {
        let slices = node.server.slices();
        slices.len() == 1 && device_names(&slices) == gpus(8)
    })
    .await;
    assert!(
        node.server
            .slices()
            .iter()
            .all(|s| s.spec.shared_counters.is_none())
    );
    node.assert_announcing_writes_nothing().await;
}

/// `--shared-capacity` on the test API server: dgx-h100 publishes its 8 GPUs once each, every
/// one allocatable many times, with the request policies of its consumable capacities (memory:
/// the whole GPU unless asked; multiprocessors: none unless asked), and what the server stores
/// passes the API's rules.
#[tokio::test]
async fn shareable_gpus_are_published_with_their_capacities() {
    let node = start_with("dgx-h100", false, true, |_| {}).await;
    eventually("8 shareable devices", || {
        let slices = node.server.slices();
        device_names(&slices) == gpus(8)
            && slices
                .iter()
                .flat_map(|s| s.spec.devices.iter().flatten())
                .all(|d| d.allow_multiple_allocations == Some(true))
    })
    .await;
    let slices = node.server.slices();
    let specs: Vec<_> = slices.iter().map(|s| s.spec.clone()).collect();
    for s in &specs {
        assert_eq!(nvdra::dra::slices::validate(s), vec![], "{s:?}");
        assert!(s.shared_counters.is_none(), "no counters for shares");
    }
    assert_eq!(nvdra::dra::slices::validate_pool(&specs), vec![]);
    let devices: Vec<_> = specs
        .iter()
        .flat_map(|s| s.devices.iter().flatten())
        .collect();
    assert_eq!(devices.len(), 8, "no twins");
    for d in devices {
        assert_eq!(d.consumes_counters, None, "{}", d.name);
        let caps = d.capacity.as_ref().unwrap();
        for (name, value, default, min, step) in [
            ("memory", "80Gi", "80Gi", "1672Mi", "1Mi"),
            ("multiprocessors", "132", "0", "0", "1"),
        ] {
            let c = &caps[name];
            let p = c.request_policy.as_ref().expect("a request policy");
            let r = p.valid_range.as_ref().unwrap();
            assert_eq!(c.value.0, value, "{} {name}", d.name);
            assert_eq!(p.default.as_ref().unwrap().0, default);
            assert_eq!(r.min.0, min);
            assert_eq!(r.max.as_ref().unwrap().0, value);
            assert_eq!(r.step.as_ref().unwrap().0, step);
        }
        assert!(
            caps.iter()
                .filter(|(k, _)| !["memory", "multiprocessors"].contains(&k.as_str()))
                .all(|(_, c)| c.request_policy.is_none())
        );
    }
}

/// A server without DRAConsumableCapacity drops what shares need: each GPU is published as a
/// plain whole GPU, the slices the switch off gives, settled.
#[tokio::test]
async fn dropped_consumable_capacity_falls_back_to_whole_gpus() {
    let mut node = start_with("dgx-h100", false, true, |server| {
        server.drop_field("devices[].allowMultipleAllocations");
        server.drop_field("devices[].capacity.memory.requestPolicy");
        server.drop_field("devices[].capacity.multiprocessors.requestPolicy");
    })
    .await;
    let plain = desired_slices(
        &node.sim.snapshot().unwrap(),
        &SliceOptions {
            driver: DRIVER.into(),
            node_name: NODE.into(),
            partitionable: false,
            shared_capacity: ConsumableShares::Disabled,
            dynamic_mig: false,
            mig_profiles: None,
            layout: CounterLayout::Separate,
        },
    )
    .unwrap();
    eventually("plain whole GPUs desired", || {
        node.publisher
            .desired()
            .is_some_and(|d| *d == nvdra::dra::sync::pools(plain.clone()))
    })
    .await;
    eventually("plain whole GPUs stored", || {
        let slices = node.server.slices();
        slices.len() == 1 && slices[0].spec.devices == plain[0].devices
    })
    .await;
    node.assert_announcing_writes_nothing().await;
}
