use super::*;
use crate::api;
use crate::dra::mps;
use crate::inventory::sim::{SimAction, SimBackend};
use crate::inventory::{DeviceBackend, Reconfigure, TimeSlice};
use crate::ledger::shares::ConsumableShares;
use crate::ledger::{ClaimState, DeviceRecord};
use crate::lock::lock;
use crate::sharing::{Sharing, TimeSliceInterval};
use futures::future::BoxFuture;
use k8s_openapi::api::resource::v1::ResourceClaim;
use k8s_openapi::api::resource::v1::{
    DeviceAllocationConfiguration, DeviceRequestAllocationResult, OpaqueDeviceConfiguration,
};
use k8s_openapi::apimachinery::pkg::runtime::RawExtension;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use tokio_util::sync::CancellationToken;

const DRIVER: &str = "gpu.nvidia.com";
const NODE: &str = "node-a";

/// Claims by namespace/name; counts GETs.
#[derive(Default)]
struct FakeApi {
    claims: Mutex<BTreeMap<(String, String), ResourceClaim>>,
    pods: Mutex<BTreeMap<(String, String), k8s_openapi::api::core::v1::Pod>>,
    namespaces: Mutex<BTreeMap<String, k8s_openapi::api::core::v1::Namespace>>,
    gets: AtomicUsize,
    /// Namespace GETs (`--share-trust-domain=label:<key>`).
    namespace_gets: AtomicUsize,
    /// Reads never answered: `claim <ns>/<name>`, `pod <ns>/<name>`, `namespace <name>`.
    silent: Mutex<std::collections::BTreeSet<String>>,
}

impl FakeApi {
    /// Whether the read of `what` is never answered.
    fn silent(&self, what: String) -> bool {
        lock(&self.silent).contains(&what)
    }
}

impl api::ClaimSource for FakeApi {
    fn get_claim<'a>(
        &'a self,
        ns: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, api::Result<ResourceClaim>> {
        self.gets.fetch_add(1, Ordering::SeqCst);
        if self.silent(format!("claim {ns}/{name}")) {
            return Box::pin(futures::future::pending());
        }
        let r = lock(&self.claims)
            .get(&(ns.to_string(), name.to_string()))
            .cloned()
            .ok_or_else(|| api::Error::NotFound(format!("{ns}/{name}").into()));
        Box::pin(async move { r })
    }
}

impl ClaimReader for FakeApi {
    fn get_pod<'a>(
        &'a self,
        ns: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, api::Result<k8s_openapi::api::core::v1::Pod>> {
        if self.silent(format!("pod {ns}/{name}")) {
            return Box::pin(futures::future::pending());
        }
        let r = lock(&self.pods)
            .get(&(ns.to_string(), name.to_string()))
            .cloned()
            .ok_or_else(|| api::Error::NotFound(format!("pod {ns}/{name}").into()));
        Box::pin(async move { r })
    }

    fn get_namespace<'a>(
        &'a self,
        name: &'a str,
    ) -> BoxFuture<'a, api::Result<k8s_openapi::api::core::v1::Namespace>> {
        self.namespace_gets.fetch_add(1, Ordering::SeqCst);
        if self.silent(format!("namespace {name}")) {
            return Box::pin(futures::future::pending());
        }
        let r = lock(&self.namespaces)
            .get(name)
            .cloned()
            .ok_or_else(|| api::Error::NotFound(format!("namespace {name}").into()));
        Box::pin(async move { r })
    }
}

struct Env {
    plugin: Plugin,
    api: Arc<FakeApi>,
    sim: SimBackend,
    dir: tempfile::TempDir,
    _stop: Running,
}

/// What keeps a test plugin going: its checkpoint writer's and inventory owner's stop, and
/// the owner's inputs. The plugin reads the node as `nvdra run`'s does, from an inventory owner
/// over the simulated hardware: a test that changes the hardware behind the plugin's back has
/// the owner read it ([`Env::reread`]); the tests' share-daemon rounds land in the health
/// state the owner lays over its publications, as the health monitor's record does
/// ([`publish_round`], [`Env::settled`]).
struct Running {
    _stop: tokio_util::sync::DropGuard,
    health: tokio::sync::watch::Sender<crate::inventory::health::HealthState>,
    inventory: crate::inventory::owner::InventoryHandle,
}

impl Running {
    /// Until the owner published the health state as the tests last set it.
    async fn settled(&self) {
        let want = self.health.borrow().clone();
        let mut node = self.inventory.subscribe();
        node.wait_for(|p| p.health == want).await.unwrap();
    }
}

/// A share-daemon round as `nvdra run` publishes it: the health monitor's record, laid by the
/// owner over its next publication, where the plugin reads it back ([`Running::settled`]).
fn publish_round(
    health: &tokio::sync::watch::Sender<crate::inventory::health::HealthState>,
    up: &crate::health::DaemonsAsked,
    down: &crate::health::DaemonsDown,
) {
    health.send_modify(|h| {
        h.daemons_asked = up.clone();
        h.daemons_down = down.clone();
    });
}

/// `f`, with a paused clock (the tests with paused time) held still meanwhile: the owner reads
/// on a thread of its own, which a paused clock does not wait for; a running blocking task
/// holds it.
async fn clock_held<T>(f: impl Future<Output = T>) -> T {
    let (release, held) = std::sync::mpsc::channel::<()>();
    let hold = tokio::task::spawn_blocking(move || held.recv());
    let out = f.await;
    drop(release);
    let _ = hold.await;
    out
}

/// An inventory owner over `hardware`, after its first read, and the write handle over
/// `gpus`, as `nvdra run` wires them: the write handle, the owner's handle and health input,
/// and its stop.
async fn owned(
    hardware: Arc<dyn crate::inventory::DeviceBackend>,
    gpus: Arc<dyn crate::inventory::Reconfigure>,
) -> (
    crate::inventory::owner::Writes,
    crate::inventory::owner::InventoryHandle,
    tokio::sync::watch::Sender<crate::inventory::health::HealthState>,
    CancellationToken,
) {
    use crate::inventory::owner::{self, Owner, Writes};
    let (mut owner, handle) = Owner::new(
        hardware,
        std::time::Duration::from_secs(3600),
        owner::DEADLINE,
    )
    .unwrap();
    clock_held(owner.read()).await.unwrap();
    let (health, watch) = tokio::sync::watch::channel(Default::default());
    let stop = CancellationToken::new();
    tokio::spawn(owner.run(watch, stop.clone()));
    (Writes::new(gpus, handle.clone()), handle, health, stop)
}

impl Env {
    /// A model of the MPS host for this plugin's MPS root (`mps::tests::FakeHost`).
    fn mps_host(&self) -> mps::tests::FakeHost {
        mps::tests::FakeHost::start(
            &self.dir.path().join("driver"),
            &self.dir.path().join("mps"),
        )
    }
    fn cdi_root(&self) -> PathBuf {
        self.dir.path().join("cdi")
    }
    fn spec(&self, uid: &str) -> PathBuf {
        self.cdi_root()
            .join(format!("k8s.{DRIVER}-claim_{uid}.yaml"))
    }
    fn add(&self, c: ResourceClaim) {
        let key = (
            c.metadata.namespace.clone().unwrap(),
            c.metadata.name.clone().unwrap(),
        );
        lock(&self.api.claims).insert(key, c);
    }
    fn state(&self, uid: &str) -> Option<ClaimState> {
        self.plugin.ledger().read(|c| {
            c.claims
                .get(&ClaimUid::parse(uid).unwrap())
                .map(|e| e.state)
        })
    }
    async fn prepare(&self, uid: &str) -> Result<Vec<DeviceRecord>, ClaimError> {
        let mut r = self.plugin.prepare(vec![cref(uid)]).await;
        assert_eq!(r.len(), 1);
        r.pop().unwrap().1
    }
    async fn unprepare(&self, uid: &str) -> Result<(), ClaimError> {
        let mut r = self.plugin.unprepare(vec![cref(uid)]).await;
        r.pop().unwrap().1
    }
    /// A second plugin on the same directories, as after a restart.
    async fn restart(&self, sim: SimBackend) -> (Plugin, Recovery, Running) {
        start(self.dir.path(), self.api.clone(), sim).await
    }
    /// Has the owner read the simulated hardware a test just changed, and waits for its
    /// publication: what the plugin sees next.
    async fn reread(&self) {
        clock_held(self._stop.inventory.refresh()).await.unwrap();
    }
    /// Until the owner published the tests' last share-daemon round.
    async fn settled(&self) {
        self._stop.settled().await;
    }
}

fn cref(uid: &str) -> ClaimRef {
    ClaimRef {
        namespace: "default".into(),
        name: format!("claim-{uid}"),
        uid: ClaimUid::parse(uid).unwrap(),
    }
}

async fn start(
    dir: &std::path::Path,
    api: Arc<FakeApi>,
    sim: SimBackend,
) -> (Plugin, Recovery, Running) {
    start_with(dir, api, sim, |_| {}).await
}

/// [`start`] with `tweak` applied to the options.
async fn start_with(
    dir: &std::path::Path,
    api: Arc<FakeApi>,
    sim: SimBackend,
    tweak: impl FnOnce(&mut Options),
) -> (Plugin, Recovery, Running) {
    let (hardware, gpus) = (Arc::new(sim.clone()), Arc::new(sim));
    start_over(dir, api, hardware, gpus, tweak).await
}

/// [`start_with`] over any hardware and write side (test doubles of either).
async fn start_over(
    dir: &std::path::Path,
    api: Arc<FakeApi>,
    hardware: Arc<dyn crate::inventory::DeviceBackend>,
    gpus: Arc<dyn crate::inventory::Reconfigure>,
    tweak: impl FnOnce(&mut Options),
) -> (Plugin, Recovery, Running) {
    let mut opts = Options {
        driver: DRIVER.into(),
        pool: NODE.into(),
        plugin_dir: dir.join("plugin"),
        cdi_root: dir.join("cdi"),
        driver_root: crate::cdi::DriverRoot::at(&dir.join("driver")),
        boot_id: "boot-1".into(),
        partitionable: true,
        shared_capacity: ConsumableShares::Memory,
        mps_root: dir.join("mps"),
        dynamic_mig: false,
        keep_mig_on: false,
        share_trust_domain: Default::default(),
        proc_root: None,
        claim_status: false,
    };
    tweak(&mut opts);
    let (writes, inventory, health, stop) = owned(hardware, gpus).await;
    let (plugin, writer, outcome) = Plugin::new(opts, api, writes, Metrics::new(), None).unwrap();
    tokio::spawn(writer.run(stop.clone()));
    let mut rec = plugin.recover().await.unwrap();
    rec.loaded = Some(outcome);
    let running = Running {
        _stop: stop.drop_guard(),
        health,
        inventory,
    };
    (plugin, rec, running)
}

async fn env(profile: &str) -> Env {
    env_tweaked(profile, |_| {}).await
}

/// [`env`] with the plugin's options changed by `tweak` first (a mode, a rule).
async fn env_tweaked(profile: &str, tweak: impl FnOnce(&mut Options)) -> Env {
    let dir = tempfile::tempdir().unwrap();
    let api = Arc::new(FakeApi::default());
    let sim = SimBackend::from_profile(profile, NODE).unwrap();
    let (plugin, _, stop) = start_with(dir.path(), api.clone(), sim.clone(), tweak).await;
    Env {
        plugin,
        api,
        sim,
        dir,
        _stop: stop,
    }
}

fn result(request: &str, device: &str) -> DeviceRequestAllocationResult {
    DeviceRequestAllocationResult {
        request: request.into(),
        driver: DRIVER.into(),
        pool: NODE.into(),
        device: device.into(),
        ..Default::default()
    }
}

fn claim(uid: &str, results: Vec<DeviceRequestAllocationResult>) -> ResourceClaim {
    claim_with(uid, results, vec![])
}

fn claim_with(
    uid: &str,
    results: Vec<DeviceRequestAllocationResult>,
    config: Vec<DeviceAllocationConfiguration>,
) -> ResourceClaim {
    crate::api::allocated_claim("default", &format!("claim-{uid}"), uid, results, config)
}

fn opaque(requests: &[&str], params: serde_json::Value) -> DeviceAllocationConfiguration {
    DeviceAllocationConfiguration {
        source: "FromClaim".into(),
        requests: Some(requests.iter().map(|s| s.to_string()).collect()),
        opaque: Some(OpaqueDeviceConfiguration {
            driver: DRIVER.into(),
            parameters: RawExtension(params),
        }),
    }
}

#[tokio::test]
async fn prepares_single_and_multi_device_claims() {
    let e = env("dgx-h100").await;
    e.add(claim("u1", vec![result("gpu", "gpu-0")]));
    let d = e.prepare("u1").await.unwrap();
    assert_eq!(d.len(), 1);
    assert_eq!(d[0].device, "gpu-0");
    assert_eq!(d[0].pool, NODE);
    assert_eq!(d[0].requests, vec!["gpu".to_string()]);
    assert_eq!(d[0].cdi_ids, vec![format!("k8s.{DRIVER}/claim=u1-gpu-0")]);
    assert!(e.spec("u1").exists());
    assert_eq!(e.state("u1"), Some(ClaimState::PrepareCompleted));

    // Subrequests are reported under their base request; other drivers' results are skipped.
    let mut foreign = result("nic", "eth0");
    foreign.driver = "net.example.com".into();
    e.add(claim(
        "u2",
        vec![
            result("pair/a100", "gpu-1"),
            result("pair/a100", "gpu-2"),
            foreign,
            result("x", "gpu-1"),
        ],
    ));
    let d = e.prepare("u2").await.unwrap();
    let names: Vec<_> = d
        .iter()
        .map(|d| (d.device.as_str(), d.requests.clone()))
        .collect();
    assert_eq!(
        names,
        vec![
            ("gpu-1", vec!["pair".to_string(), "x".to_string()]),
            ("gpu-2", vec!["pair".to_string()])
        ]
    );
    let spec: crate::cdi::Spec =
        serde_saphyr::from_slice(&std::fs::read(e.spec("u2")).unwrap()).unwrap();
    assert_eq!(spec.kind, format!("k8s.{DRIVER}/claim"));
    let devs: Vec<_> = spec.devices.iter().map(|d| d.name.as_str()).collect();
    assert_eq!(devs, vec!["u2-gpu-1", "u2-gpu-2"]);
}

#[tokio::test]
async fn prepare_is_idempotent_without_rewriting() {
    let e = env("dgx-h100").await;
    e.add(claim("u1", vec![result("gpu", "gpu-3")]));
    let first = e.prepare("u1").await.unwrap();
    let meta = std::fs::metadata(e.spec("u1")).unwrap();
    let writes = e.plugin.ledger().writes();
    let second = e.prepare("u1").await.unwrap();
    assert_eq!(first, second);
    assert_eq!(
        e.api.gets.load(Ordering::SeqCst),
        1,
        "answered from the ledger"
    );
    assert_eq!(e.plugin.ledger().writes(), writes, "no checkpoint write");
    let again = std::fs::metadata(e.spec("u1")).unwrap();
    use std::os::unix::fs::MetadataExt;
    assert_eq!(
        (meta.ino(), meta.mtime_nsec()),
        (again.ino(), again.mtime_nsec())
    );

    // A vanished spec (tmpfs after a crash of the runtime) is rewritten on re-prepare.
    std::fs::remove_file(e.spec("u1")).unwrap();
    assert_eq!(e.prepare("u1").await.unwrap(), first);
    assert!(e.spec("u1").exists());
}

#[tokio::test]
async fn every_error_names_the_problem() {
    let e = env("a100-mig-mixed").await;
    // Not found.
    let err = e.prepare("nope").await.unwrap_err();
    assert!(
        err.to_string().contains("default/claim-nope not found"),
        "{err}"
    );
    // UID changed.
    let mut c = claim("u-new", vec![result("gpu", "gpu-0")]);
    c.metadata.name = Some("claim-old".into());
    e.add(c);
    let err = e.prepare("old").await.unwrap_err();
    assert!(
        matches!(
            err,
            ClaimError::Claim(kubelet_plugin::claims::Error::UidChanged { .. })
        ),
        "{err}"
    );
    assert!(
        err.to_string().contains("now has UID u-new, not old"),
        "{err}"
    );
    // Not allocated.
    let mut c = claim("na", vec![]);
    c.status = None;
    e.add(c);
    let err = e.prepare("na").await.unwrap_err();
    assert!(err.to_string().contains("is not allocated"), "{err}");
    // Unknown devices, with the reason.
    for (dev, why) in [
        ("gpu-9", "no such GPU"),
        ("eth0", "names look like"),
        ("gpu-1", "is in MIG mode"),
        ("gpu-1-mig-9g99gb-1-0", "no such GPU, MIG device"),
        ("gpu-0-mig-1g5gb-19-0", "not in MIG mode"),
    ] {
        let uid = format!("unk-{dev}");
        e.add(claim(&uid, vec![result("gpu", dev)]));
        let err = e.prepare(&uid).await.unwrap_err();
        assert!(err.to_string().contains(why), "{dev}: {err}");
        assert!(err.to_string().contains(dev), "{dev}: {err}");
        assert_eq!(e.state(&uid), None);
    }
    // Another node's pool.
    let mut r = result("gpu", "gpu-0");
    r.pool = "node-b".into();
    e.add(claim("pool", vec![r]));
    let err = e.prepare("pool").await.unwrap_err();
    assert!(err.to_string().contains("another node"), "{err}");
    // Bad config, naming the key; nothing is left behind.
    e.add(claim_with(
        "cfg",
        vec![result("gpu", "gpu-0")],
        vec![opaque(&[], serde_json::json!({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig", "sharing": {"strategy": "Sometimes"}}))],
    ));
    let err = e.prepare("cfg").await.unwrap_err();
    let err = crate::report::chain(&err).to_string();
    assert!(err.contains("request gpu"), "{err}");
    assert!(err.contains("claim config #0: sharing.strategy"), "{err}");
    assert_eq!(e.state("cfg"), None);
    assert!(!e.spec("cfg").exists());
}

#[tokio::test]
async fn a_device_is_never_prepared_for_two_claims() {
    let e = env("a100-mig-mixed").await;
    e.add(claim("a", vec![result("gpu", "gpu-0")]));
    e.add(claim(
        "b",
        vec![result("gpu", "gpu-3"), result("gpu", "gpu-0")],
    ));
    e.prepare("a").await.unwrap();
    let err = e.prepare("b").await.unwrap_err();
    assert!(
        err.to_string()
            .contains("gpu-0 is already prepared for claim default/claim-a (a)"),
        "{err}"
    );
    // b left nothing behind, so gpu-3 is still free.
    assert_eq!(e.state("b"), None);
    e.add(claim("c", vec![result("gpu", "gpu-3")]));
    e.prepare("c").await.unwrap();

    // After a is unprepared, b's devices... gpu-3 is c's now; a fresh claim gets gpu-0.
    e.unprepare("a").await.unwrap();
    e.add(claim("d", vec![result("gpu", "gpu-0")]));
    e.prepare("d").await.unwrap();

    // Admin access and shared allocations may overlap.
    let mut admin = result("gpu", "gpu-0");
    admin.admin_access = Some(true);
    e.add(claim("admin", vec![admin]));
    e.prepare("admin").await.unwrap();
}

/// A shareID without consumed memory is an allocation of the policy's default, the whole GPU:
/// recorded, and exclusive (shares are `shares.rs`).
#[tokio::test]
async fn share_ids_are_recorded_and_a_whole_allocation_stays_exclusive() {
    let e = env("dgx-h100").await;
    let shared = |id: &str| {
        let mut r = result("gpu", "gpu-0");
        r.share_id = Some(id.into());
        r
    };
    e.add(claim("s1", vec![shared("aaa")]));
    e.add(claim("s2", vec![shared("bbb")]));
    let d1 = e.prepare("s1").await.unwrap();
    assert_eq!(d1[0].share_id.as_deref(), Some("aaa"));
    assert_eq!(d1[0].consumed, None);
    assert!(matches!(
        e.prepare("s2").await.unwrap_err(),
        ClaimError::DeviceInUse { .. }
    ));
    e.add(claim("x", vec![result("gpu", "gpu-0")]));
    assert!(matches!(
        e.prepare("x").await.unwrap_err(),
        ClaimError::DeviceInUse { .. }
    ));
}

#[tokio::test]
async fn concurrent_claims_race_for_one_device_and_one_wins() {
    let e = env("dgx-h100").await;
    let uids: Vec<String> = (0..8).map(|i| format!("r{i}")).collect();
    for u in &uids {
        e.add(claim(u, vec![result("gpu", "gpu-5")]));
    }
    let results = e
        .plugin
        .prepare(uids.iter().map(|u| cref(u)).collect())
        .await;
    assert_eq!(results.len(), 8);
    let ok = results.iter().filter(|(_, r)| r.is_ok()).count();
    assert_eq!(ok, 1, "{results:?}");
    let specs = std::fs::read_dir(e.cdi_root()).unwrap().count();
    assert_eq!(specs, 1);
}

#[tokio::test]
async fn unprepare_removes_everything_and_unknown_claims_succeed() {
    let e = env("dgx-h100").await;
    e.unprepare("never-seen").await.unwrap();
    e.add(claim("u", vec![result("gpu", "gpu-0")]));
    e.prepare("u").await.unwrap();
    e.unprepare("u").await.unwrap();
    assert_eq!(e.state("u"), None);
    assert!(!e.spec("u").exists());
    e.unprepare("u").await.unwrap();
    // Unprepare works from the ledger alone: the claim may be gone from the API.
    e.add(claim("v", vec![result("gpu", "gpu-1")]));
    e.prepare("v").await.unwrap();
    lock(&e.api.claims).clear();
    e.unprepare("v").await.unwrap();
    assert!(!e.spec("v").exists());
}

#[tokio::test]
async fn existing_and_created_mig_devices() {
    let e = env("a100-mig-mixed").await;
    let inv = e.sim.snapshot().unwrap();
    let existing = &inv.gpus[1].mig.devices[0];
    let name = crate::ids::DeviceName::mig(
        inv.gpus[1].minor,
        &existing.profile,
        existing.gi_profile_id,
        existing.placement.start,
    );
    assert_eq!(name.as_str(), "gpu-1-mig-3g20gb-9-4");
    e.add(claim("m1", vec![result("mig", name.as_str())]));
    let d = e.prepare("m1").await.unwrap();
    assert_eq!(
        d[0].mig.as_ref().unwrap().uuid.as_ref(),
        Some(&existing.uuid)
    );
    assert!(!d[0].mig.as_ref().unwrap().created);

    // A placement with no instance is created at prepare and destroyed at unprepare.
    e.add(claim("m2", vec![result("mig", "gpu-2-mig-1g10gb-15-6")]));
    let d = e.prepare("m2").await.unwrap();
    let rec = d[0].mig.clone().unwrap();
    assert!(rec.created);
    let uuid = rec.uuid.clone().unwrap();
    assert!(
        e.sim.snapshot().unwrap().gpus[2]
            .mig
            .devices
            .iter()
            .any(|m| m.uuid == uuid)
    );
    // The spec gives the MIG device by its CDI device (parent and capability nodes), not by a
    // UUID list: its env is NVIDIA's `void`.
    let spec = std::fs::read_to_string(e.spec("m2")).unwrap();
    assert!(spec.contains("-gpu-2-mig-1g10gb-15-6"), "{spec}");
    assert!(spec.contains("NVIDIA_VISIBLE_DEVICES=void"), "{spec}");
    // An overlapping placement is refused while it is held.
    e.add(claim("m3", vec![result("mig", "gpu-2-mig-1g5gb-19-6")]));
    let err = e.prepare("m3").await.unwrap_err();
    assert!(matches!(err, ClaimError::DeviceInUse { .. }), "{err}");
    e.unprepare("m2").await.unwrap();
    assert!(
        !e.sim.snapshot().unwrap().gpus[2]
            .mig
            .devices
            .iter()
            .any(|m| m.uuid == uuid)
    );
    assert_eq!(
        e.sim
            .actions()
            .into_iter()
            .filter(|a| matches!(
                a,
                SimAction::CreateMig { .. } | SimAction::DestroyMig { .. }
            ))
            .count(),
        2
    );
    // Existing devices are not destroyed at unprepare.
    e.unprepare("m1").await.unwrap();
    assert!(
        e.sim.snapshot().unwrap().gpus[1]
            .mig
            .devices
            .iter()
            .any(|m| m.uuid == existing.uuid)
    );
}

/// An existing MIG device and one created at prepare (`--partitionable`) both get their
/// capability nodes as NVIDIA's DRA driver writes them, from procfs under the device root: the
/// `nvidia-caps` major of `proc/devices`, the minors of the instances' `access` files.
#[tokio::test]
async fn mig_capability_nodes_come_from_procfs_for_existing_and_created_devices() {
    let dir = tempfile::tempdir().unwrap();
    let proc = dir.path().join("driver/proc");
    std::fs::create_dir_all(&proc).unwrap();
    std::fs::write(
        proc.join("devices"),
        "Character devices:\n195 nvidia\n238 nvidia-caps\n",
    )
    .unwrap();
    // Minor 1000·gpu + 10·gi for a GPU instance, + ci + 1 for a compute instance.
    for gpu in 0..8u32 {
        for gi in 0..15u32 {
            let gi_dir = proc.join(format!("driver/nvidia/capabilities/gpu{gpu}/mig/gi{gi}"));
            for ci in 0..8u32 {
                let ci_dir = gi_dir.join(format!("ci{ci}"));
                std::fs::create_dir_all(&ci_dir).unwrap();
                std::fs::write(
                    ci_dir.join("access"),
                    format!(
                        "DeviceFileMinor: {}\nDeviceFileMode: 292\n",
                        1000 * gpu + 10 * gi + ci + 1
                    ),
                )
                .unwrap();
            }
            std::fs::write(
                gi_dir.join("access"),
                format!(
                    "DeviceFileMinor: {}\nDeviceFileMode: 292\n",
                    1000 * gpu + 10 * gi
                ),
            )
            .unwrap();
        }
    }
    let api = Arc::new(FakeApi::default());
    let sim = SimBackend::from_profile("a100-mig-mixed", NODE).unwrap();
    let (plugin, _, _stop) = start(dir.path(), api.clone(), sim.clone()).await;
    let e = Env {
        plugin,
        api,
        sim,
        dir,
        _stop,
    };
    let inv = e.sim.snapshot().unwrap();
    let existing = &inv.gpus[1].mig.devices[0];
    let name = crate::ids::DeviceName::mig(
        inv.gpus[1].minor,
        &existing.profile,
        existing.gi_profile_id,
        existing.placement.start,
    );
    e.add(claim("m1", vec![result("mig", name.as_str())]));
    e.add(claim("m2", vec![result("mig", "gpu-2-mig-1g10gb-15-6")]));
    for uid in ["m1", "m2"] {
        e.prepare(uid).await.unwrap();
        let inv = e.sim.snapshot().unwrap();
        let spec = std::fs::read_to_string(e.spec(uid)).unwrap();
        let gpu = if uid == "m1" {
            &inv.gpus[1]
        } else {
            &inv.gpus[2]
        };
        // The claim's instance: the one whose GI minor the spec names.
        let named: Vec<(u32, u32)> = gpu
            .mig
            .devices
            .iter()
            .map(|m| (m.gi_id, m.ci_id))
            .filter(|(gi, _)| {
                spec.contains(&format!(
                    "/dev/nvidia-caps/nvidia-cap{}\n",
                    1000 * gpu.minor + 10 * gi
                ))
            })
            .collect();
        assert_eq!(named.len(), 1, "{uid}: {spec}");
        let (gi, ci) = named[0];
        let ci_minor = 1000 * gpu.minor + 10 * gi + ci + 1;
        assert!(
            spec.contains(&format!("/dev/nvidia-caps/nvidia-cap{ci_minor}\n")),
            "{uid}: {spec}"
        );
        assert_eq!(spec.matches("major: 238").count(), 2, "{uid}: {spec}");
    }
}
#[tokio::test]
async fn failed_prepare_rolls_back_created_mig_devices() {
    let e = env("a100-mig-mixed").await;
    // The second device's MPS needs a control binary that is not there.
    e.add(claim_with(
        "f",
        vec![result("a", "gpu-2-mig-1g10gb-15-6"), result("b", "gpu-1-mig-1g5gb-19-2")],
        vec![opaque(&["b"], serde_json::json!({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "MigDeviceConfig", "sharing": {"strategy": "MPS"}}))],
    ));
    let err = e.prepare("f").await.unwrap_err();
    assert!(err.to_string().contains("nvidia-cuda-mps-control"), "{err}");
    let actions = e.sim.actions();
    assert!(
        matches!(
            actions.as_slice(),
            [SimAction::CreateMig { .. }, SimAction::DestroyMig { .. }]
        ),
        "{actions:?}"
    );
    assert_eq!(e.state("f"), None);
    assert!(!e.spec("f").exists());
}

#[tokio::test]
async fn time_slicing_is_applied_and_reset() {
    let e = env("dgx-h100").await;
    let gpu = e.sim.snapshot().unwrap().gpus[0].uuid.clone();
    e.add(claim_with(
        "t",
        vec![result("gpu", "gpu-0")],
        vec![
            DeviceAllocationConfiguration {
                source: "FromClass".into(),
                ..opaque(&[], serde_json::json!({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig", "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Short"}}}))
            },
            opaque(&["gpu"], serde_json::json!({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig", "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}})),
        ],
    ));
    let d = e.prepare("t").await.unwrap();
    assert_eq!(
        d[0].sharing,
        Sharing::TimeSlicing {
            interval: TimeSliceInterval::Long
        }
    );
    assert_eq!(e.sim.time_slice(&gpu), TimeSlice::Long);
    e.unprepare("t").await.unwrap();
    assert_eq!(e.sim.time_slice(&gpu), TimeSlice::Default);
}

#[tokio::test]
async fn mps_daemon_per_claim() {
    let e = env("dgx-h100").await;
    let _host = e.mps_host();
    let cfg = || {
        opaque(
            &[],
            serde_json::json!({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig", "sharing": {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 25}}}),
        )
    };
    e.add(claim_with(
        "p",
        vec![result("gpu", "gpu-4"), result("gpu", "gpu-5")],
        vec![cfg()],
    ));
    e.prepare("p").await.unwrap();
    let spec = std::fs::read_to_string(e.spec("p")).unwrap();
    assert!(spec.contains("CUDA_MPS_PIPE_DIRECTORY="), "{spec}");
    assert!(
        spec.contains("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25"),
        "{spec}"
    );
    let pipe = e.plugin.inner.mps.pipe_dir(&ClaimUid::parse("p").unwrap());
    assert!(
        spec.contains(pipe.to_str().unwrap()),
        "the pipe directory is mounted: {spec}"
    );
    e.unprepare("p").await.unwrap();
    mps::tests::eventually("the host removes the released daemon", || !pipe.exists());
    let log = std::fs::read_to_string(e.dir.path().join("driver/mps.log")).unwrap();
    let inv = e.sim.snapshot().unwrap();
    assert_eq!(
        log.lines().collect::<Vec<_>>(),
        vec![
            format!(
                "start {},{} {}",
                inv.gpus[4].uuid,
                inv.gpus[5].uuid,
                pipe.display()
            ),
            format!("quit {}", pipe.display()),
        ]
    );
    assert!(!pipe.exists());
}

#[tokio::test]
async fn empty_requests_are_cheap() {
    let e = env("dgx-h100").await;
    assert!(e.plugin.prepare(vec![]).await.is_empty());
    assert!(e.plugin.unprepare(vec![]).await.is_empty());
    assert_eq!(e.plugin.ledger().writes(), 1, "only recovery wrote");
}

#[tokio::test]
async fn mig_placements_are_created_only_in_partitionable_mode() {
    let dir = tempfile::tempdir().unwrap();
    let api = Arc::new(FakeApi::default());
    let sim = SimBackend::from_profile("a100-mig-mixed", NODE).unwrap();
    let opts = Options {
        driver: DRIVER.into(),
        pool: NODE.into(),
        plugin_dir: dir.path().join("plugin"),
        cdi_root: dir.path().join("cdi"),
        driver_root: crate::cdi::DriverRoot::at(&dir.path().join("driver")),
        boot_id: "b".into(),
        partitionable: false,
        shared_capacity: ConsumableShares::Disabled,
        mps_root: dir.path().join("mps"),
        dynamic_mig: false,
        keep_mig_on: false,
        share_trust_domain: Default::default(),
        proc_root: None,
        claim_status: false,
    };
    let (writes, _, _health, stop) = owned(Arc::new(sim.clone()), Arc::new(sim.clone())).await;
    let (plugin, writer, _) = Plugin::new(opts, api.clone(), writes, Metrics::new(), None).unwrap();
    tokio::spawn(writer.run(stop.clone()));
    let c = claim("x", vec![result("mig", "gpu-2-mig-1g10gb-15-6")]);
    lock(&api.claims).insert(("default".into(), "claim-x".into()), c);
    let r = plugin.prepare(vec![cref("x")]).await;
    let err = r[0].1.as_ref().unwrap_err();
    assert!(err.to_string().contains("partitionable mode"), "{err}");
    assert!(sim.actions().is_empty());
    stop.cancel();
}

/// Two instances on one node (a rolling update): each sees the other's claims through the
/// checkpoint, so neither hands out a device the other prepared, and either can unprepare.
#[tokio::test]
async fn outcomes_are_counted_in_metrics() {
    use std::sync::atomic::Ordering::Relaxed;
    let dir = tempfile::tempdir().unwrap();
    let api = Arc::new(FakeApi::default());
    let sim = SimBackend::from_profile("l40s-pcie", NODE).unwrap();
    let metrics = Metrics::new();
    let opts = Options {
        driver: DRIVER.into(),
        pool: NODE.into(),
        plugin_dir: dir.path().join("plugin"),
        cdi_root: dir.path().join("cdi"),
        driver_root: crate::cdi::DriverRoot::at(&dir.path().join("driver")),
        boot_id: "b".into(),
        partitionable: false,
        shared_capacity: ConsumableShares::Disabled,
        mps_root: dir.path().join("mps"),
        dynamic_mig: false,
        keep_mig_on: false,
        share_trust_domain: Default::default(),
        proc_root: None,
        claim_status: false,
    };
    let (writes, _, _health, stop) = owned(Arc::new(sim.clone()), Arc::new(sim)).await;
    let (plugin, writer, _) =
        Plugin::new(opts, api.clone(), writes, metrics.clone(), None).unwrap();
    tokio::spawn(writer.run(stop.clone()));
    let c = claim("ok", vec![result("gpu", "gpu-1")]);
    lock(&api.claims).insert(("default".into(), "claim-ok".into()), c);
    plugin.prepare(vec![cref("ok"), cref("missing")]).await;
    plugin.unprepare(vec![cref("ok")]).await;
    assert_eq!(metrics.prepare_ok.load(Relaxed), 1);
    assert_eq!(metrics.prepare_failed.load(Relaxed), 1);
    assert_eq!(metrics.unprepare_ok.load(Relaxed), 1);
    assert_eq!(metrics.unprepare_failed.load(Relaxed), 0);
    let text = metrics.render(None);
    assert!(text.contains("prepare"), "{text}");
    stop.cancel();
}

mod admin_access;
mod api_deadlines;
mod deadlines;
mod dynamic_mig;
mod enforce;
mod mig_shares;
mod recovery;
mod share_modes;
mod shares;
mod trust;
mod wrapper;
