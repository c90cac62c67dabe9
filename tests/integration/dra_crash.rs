//! The real binary as a process: `nvdra run` is made to abort at each step of a prepare
//! (`NVDRA_TEST_CRASH_AT`), restarted, and the kubelet's retry must then leave the claim prepared
//! exactly once — no device in two claims, no orphan CDI spec, one checkpoint entry. Also: a
//! reboot (new boot id), a corrupt checkpoint at start-up, two instances during a rolling update,
//! SIGTERM twice, bad flags, and starts that fail (one line, no socket left behind). `shares`:
//! the same for consumable-capacity shares of a GPU and their MPS daemon, unprepare included;
//! `dynamic_mig`: for a GPU's MIG mode switched by its claims (`--dynamic-mig`);
//! `compute_mode`: a share's `EXCLUSIVE_PROCESS` on the fake NVML across a SIGKILL; `fsync`:
//! what no SIGKILL shows, that a prepare syncs its checkpoint (under strace).

use crate::support;

mod compute_mode;
mod dynamic_mig;
mod fsync;
mod shares;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use kubelet_plugin::proto::dra::v1;
use support::dra::{prepare_at, terminate, unprepare_at, unprepare_call, wait_exit, wait_ready_at};

const DRIVER: &str = "gpu.nvidia.com";
const NODE: &str = "node-a";

struct Dirs {
    root: tempfile::TempDir,
    /// Run with `--partitionable`.
    partitionable: bool,
    profile: &'static str,
    metrics_address: String,
    /// Run the NVML backend over the fake library serving `profile` (MIG instances kept in
    /// `nvml-state`, `nvidia-smi` a script under the driver root logging to `nvidia-smi.log`),
    /// instead of the simulated backend.
    nvml: bool,
    /// Run with `--shared-capacity` (shares of GPUs: `shares`).
    shared_capacity: bool,
    /// `nvdra mps-host` over the MPS root `mps`, for shares.
    mps_host: Option<support::mps::Host>,
    /// Run with `--dynamic-mig`, the fake's GPUs idle (`dynamic_mig`).
    dynamic_mig: bool,
}

impl Dirs {
    fn new() -> Self {
        let d = Dirs {
            root: tempfile::tempdir().unwrap(),
            partitionable: false,
            profile: "dgx-h100",
            metrics_address: "127.0.0.1:0".into(),
            nvml: false,
            shared_capacity: false,
            mps_host: None,
            dynamic_mig: false,
        };
        std::fs::write(d.boot_file(), "boot-1\n").unwrap();
        d
    }
    fn p(&self, s: &str) -> PathBuf {
        self.root.path().join(s)
    }
    fn boot_file(&self) -> PathBuf {
        self.p("boot_id")
    }
    fn reg_socket(&self) -> PathBuf {
        self.p(&format!("kubelet/plugins_registry/{DRIVER}-reg.sock"))
    }
    fn dra_socket(&self) -> PathBuf {
        self.p(&format!("kubelet/plugins/{DRIVER}/dra.sock"))
    }
    fn checkpoint(&self) -> PathBuf {
        self.p(&format!("kubelet/plugins/{DRIVER}/checkpoint.json"))
    }
    fn specs(&self) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(self.p("cdi"))
            .map(|rd| {
                rd.map(|e| e.unwrap().file_name().into_string().unwrap())
                    .collect()
            })
            .unwrap_or_default();
        v.sort();
        v
    }
    fn spec_name(uid: &str) -> String {
        format!("k8s.{DRIVER}-claim_{uid}.yaml")
    }
    fn nvml_state(&self) -> PathBuf {
        self.p("nvml-state")
    }

    /// The MIG instances the fake's GPUs hold: (GPU index, profile id, first slice, MIG UUIDs).
    fn mig_instances(&self) -> Vec<(usize, u32, u32, Vec<String>)> {
        let mut v: Vec<_> = fake_nvml::state::instances(&self.nvml_state())
            .into_iter()
            .map(|i| (i.gpu, i.profile_id, i.start, i.mig_uuids))
            .collect();
        v.sort();
        v
    }

    fn nvidia_smi_log(&self) -> String {
        std::fs::read_to_string(self.p("driver/usr/bin/nvidia-smi.log")).unwrap_or_default()
    }

    /// `driver/`: the fake NVML library and an `nvidia-smi` that logs its arguments and the
    /// library it was given.
    fn fake_driver_root(&self) {
        let lib_dir = self.p("driver/usr/lib64");
        let bin_dir = self.p("driver/usr/bin");
        if lib_dir.join("libnvidia-ml.so.1").symlink_metadata().is_ok() {
            return;
        }
        std::fs::create_dir_all(&lib_dir).unwrap();
        std::fs::create_dir_all(&bin_dir).unwrap();
        std::os::unix::fs::symlink(
            support::fake_nvml::library(),
            lib_dir.join("libnvidia-ml.so.1"),
        )
        .unwrap();
        let script = bin_dir.join("nvidia-smi");
        std::fs::write(
            &script,
            "#!/bin/sh\necho \"$* LD_PRELOAD=$LD_PRELOAD\" >> \"$(dirname \"$0\")/nvidia-smi.log\"\n",
        )
        .unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    }

    fn checkpoint_json(&self) -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(self.checkpoint()).unwrap()).unwrap()
    }

    fn add_claim(&self, uid: &str, device: &str) {
        self.add_claim_with(uid, device, vec![]);
    }

    fn add_claim_with(
        &self,
        uid: &str,
        device: &str,
        config: Vec<k8s_openapi::api::resource::v1::DeviceAllocationConfiguration>,
    ) {
        let c = nvdra::api::allocated_claim(
            "default",
            &format!("claim-{uid}"),
            uid,
            vec![nvdra::api::allocated_device("gpu", DRIVER, NODE, device)],
            config,
        );
        nvdra::api::dir::write_claim(&self.p("api"), &c).unwrap();
    }

    fn spawn(&self, crash_at: Option<&str>) -> Child {
        self.command(crash_at).spawn().unwrap()
    }

    fn command(&self, crash_at: Option<&str>) -> Command {
        let mut cmd = support::daemon::nvdra_run(self.root.path(), "dra", NODE);
        if self.nvml {
            self.fake_driver_root();
            cmd.args(["--backend", "nvml"])
                .env("FAKE_NVML_PROFILE", self.profile)
                .env("FAKE_NVML_SEED", NODE)
                .env("FAKE_NVML_STATE", self.nvml_state())
                .env_remove("FAKE_NVML_NODE")
                .env_remove("FAKE_NVML_TOPOLOGY");
        } else {
            cmd.args(["--profile", self.profile]);
        }
        cmd.args(["--metrics-address", &self.metrics_address])
            .env("NVDRA_LOG", "warn");
        if let Some(at) = crash_at {
            cmd.env("NVDRA_TEST_CRASH_AT", at);
        }
        if self.partitionable {
            cmd.arg("--partitionable");
        }
        if self.shared_capacity {
            cmd.arg("--shared-capacity");
        }
        if self.dynamic_mig {
            cmd.arg("--dynamic-mig").env("FAKE_NVML_IDLE", "1");
        }
        cmd
    }
}

/// Waits until the process answers GetInfo on its registration socket (so its DRA socket
/// serves), failing if it exits or 30 s pass.
async fn wait_ready(d: &Dirs, child: &mut Child) {
    wait_ready_at(&d.reg_socket(), child).await
}

async fn prepare(d: &Dirs, uid: &str) -> Result<v1::NodePrepareResourceResponse, tonic::Status> {
    prepare_at(&d.dra_socket(), uid).await
}

async fn unprepare(d: &Dirs, uid: &str) -> String {
    unprepare_at(&d.dra_socket(), uid).await
}

/// Waits for `child` to stop at `point` and SIGKILLs it there, as the kernel's OOM killer or a
/// node failure would: no chance to clean up.
async fn kill_at_crash_point(d: &Dirs, child: &mut Child, point: &str) {
    use std::os::unix::process::ExitStatusExt;
    let marker = d.p(&format!(
        "kubelet/plugins/{DRIVER}/{}",
        nvdra::dra::plugin::crash::CRASH_MARKER
    ));
    for _ in 0..3000 {
        if marker.exists() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        marker.exists(),
        "{point}: the crash point was never reached"
    );
    let killed = Command::new("kill")
        .args(["-KILL", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let status = wait_exit(child).await;
    assert_eq!(status.signal(), Some(SIGKILL), "{point}: {status}");
    std::fs::remove_file(&marker).unwrap();
}

/// Kills the daemon at `point` while it prepares claim `a` for `device`, restarts it, and checks
/// the kubelet's retry prepares `a` exactly once and keeps `device` from claim `b`.
/// `partitionable` devices are MIG placements whose instance prepare creates: the slow path that
/// records its intent durably before touching the GPU.
async fn crash_then_retry(point: &str, device: &str, partitionable: bool) {
    crash_then_retry_on(point, device, partitionable, false).await;
}

/// [`crash_then_retry`], on the NVML backend over the fake library when `nvml`: the MIG
/// instances then outlive the killed process, as on a GPU, and none may be left over.
async fn crash_then_retry_on(point: &str, device: &str, partitionable: bool, nvml: bool) {
    let mut d = Dirs::new();
    d.nvml = nvml;
    if partitionable {
        // GPU 2 of this profile is in MIG mode with slices 0-5 in use; 6-7 are free.
        d.partitionable = true;
        d.profile = "a100-mig-mixed";
    }
    d.add_claim("a", device);
    d.add_claim("b", device);

    let mut first = d.spawn(Some(point));
    wait_ready(&d, &mut first).await;
    let dra_socket = d.dra_socket();
    let call = tokio::spawn(async move { prepare_at(&dra_socket, "a").await });
    // The process stops at the crash point; kill it there.
    kill_at_crash_point(&d, &mut first, point).await;
    let r = call.await.unwrap();
    assert!(r.is_err(), "{point}: the process died mid-call: {r:?}");

    // What the crash left: the claim's record and its spec, as far as they got.
    let (state, spec) = left_behind(point, partitionable);
    let cp = d.checkpoint_json();
    assert_eq!(cp["claims"]["a"]["state"].as_str(), state, "{point}: {cp}");
    assert_eq!(d.specs() == vec![Dirs::spec_name("a")], spec, "{point}");
    // What the profile's GPUs hold before any claim: GPU 1's four instances, GPU 2's three.
    let original = |d: &Dirs| {
        d.mig_instances()
            .into_iter()
            .filter(|(_, profile, start, _)| !(*profile == 15 && *start == 6))
            .collect::<Vec<_>>()
    };
    let before_restart = d.mig_instances();
    if nvml && partitionable && point != "after-started" {
        // The killed process created the instance: it is still on the GPU.
        assert_eq!(before_restart.len(), 8, "{point}: {before_restart:?}");
        assert!(
            before_restart
                .iter()
                .any(|(g, p, s, _)| (*g, *p, *s) == (2, 15, 6)),
            "{point}: {before_restart:?}"
        );
    }

    let mut second = d.spawn(None);
    wait_ready(&d, &mut second).await;
    if nvml && partitionable {
        let now = d.mig_instances();
        if state == Some("PrepareCompleted") {
            // A completed claim keeps its instance.
            assert_eq!(now, before_restart, "{point}");
        } else {
            // Recovery destroyed the interrupted prepare's instance before serving.
            assert_eq!(now, original(&d), "{point}: leaked {now:?}");
            assert_eq!(now.len(), 7, "{point}: {now:?}");
        }
    }
    let claims = d.checkpoint_json()["claims"].as_object().unwrap().len();
    if state == Some("PrepareCompleted") {
        // A completed claim is kept; recovery rewrote its spec if the crash came before it.
        assert_eq!(claims, 1, "{point}");
        assert_eq!(d.specs(), vec![Dirs::spec_name("a")], "{point}");
    } else {
        // Recovery rolled the interrupted prepare back before serving.
        assert!(d.specs().is_empty(), "{point}: {:?}", d.specs());
        assert_eq!(claims, 0, "{point}");
    }
    // The kubelet retries.
    let r = prepare(&d, "a").await.unwrap();
    assert_eq!(r.error, "", "{point}");
    assert_eq!(r.devices.len(), 1);
    assert_eq!(
        r.devices[0].cdi_device_ids,
        vec![format!("k8s.{DRIVER}/claim=a-{device}")]
    );
    assert_eq!(d.specs(), vec![Dirs::spec_name("a")], "{point}");
    let cp = d.checkpoint_json();
    let claims = cp["claims"].as_object().unwrap();
    assert_eq!(claims.len(), 1, "{point}: {cp}");
    assert_eq!(claims["a"]["state"], "PrepareCompleted");
    // The device is not handed to a second claim.
    let r = prepare(&d, "b").await.unwrap();
    assert!(
        r.error
            .contains("already prepared for claim default/claim-a"),
        "{point}: {}",
        r.error
    );
    assert_eq!(d.specs(), vec![Dirs::spec_name("a")]);

    assert_eq!(unprepare(&d, "a").await, "");
    assert!(d.specs().is_empty());
    if nvml && partitionable {
        assert_eq!(
            d.mig_instances().len(),
            7,
            "{point}: {:?}",
            d.mig_instances()
        );
    }
    let r = prepare(&d, "b").await.unwrap();
    assert_eq!(r.error, "", "{point}: freed by the unprepare");
    if nvml && partitionable {
        assert_eq!(unprepare(&d, "b").await, "");
        assert_eq!(
            d.mig_instances(),
            original(&d),
            "{point}: every instance a claim created is gone"
        );
        assert_eq!(d.mig_instances().len(), 7);
    }
    let status = terminate(&mut second).await;
    assert!(status.success(), "{point}: clean exit on SIGTERM: {status}");
    assert!(!d.reg_socket().exists() && !d.dra_socket().exists());
}

/// What a crash at `point` leaves on disk: the claim's checkpoint state and whether its CDI spec
/// exists. A claim that creates a MIG instance (`reconfigures`) records `PrepareStarted` durably
/// before anything else; one that changes nothing on the GPU writes its completed record and its
/// spec in parallel, and each crash point is one of the four states that can leave.
fn left_behind(point: &str, reconfigures: bool) -> (Option<&'static str>, bool) {
    const STARTED: Option<&str> = Some("PrepareStarted");
    const COMPLETED: Option<&str> = Some("PrepareCompleted");
    match (point, reconfigures) {
        ("after-started", true) => (STARTED, false),
        ("after-cdi" | "before-completed", true) => (STARTED, true),
        ("after-started", false) => (None, false),
        ("after-cdi", false) => (None, true),
        ("before-completed", false) => (COMPLETED, false),
        ("after-completed", _) => (COMPLETED, true),
        _ => panic!("unknown crash point {point}"),
    }
}

/// SIGKILL is 9 on every Linux architecture.
const SIGKILL: i32 = 9;

#[tokio::test]
async fn crash_after_started() {
    crash_then_retry("after-started", "gpu-2", false).await;
}

#[tokio::test]
async fn crash_after_started_creating_a_mig_instance() {
    crash_then_retry("after-started", "gpu-2-mig-1g10gb-15-6", true).await;
}

#[tokio::test]
async fn crash_after_cdi() {
    crash_then_retry("after-cdi", "gpu-2", false).await;
}

#[tokio::test]
async fn crash_after_cdi_creating_a_mig_instance() {
    crash_then_retry("after-cdi", "gpu-2-mig-1g10gb-15-6", true).await;
}

#[tokio::test]
async fn crash_before_completed() {
    crash_then_retry("before-completed", "gpu-2", false).await;
}

#[tokio::test]
async fn crash_before_completed_creating_a_mig_instance() {
    crash_then_retry("before-completed", "gpu-2-mig-1g10gb-15-6", true).await;
}

#[tokio::test]
async fn crash_after_completed() {
    crash_then_retry("after-completed", "gpu-2", false).await;
}

#[tokio::test]
async fn crash_after_completed_creating_a_mig_instance() {
    crash_then_retry("after-completed", "gpu-2-mig-1g10gb-15-6", true).await;
}

/// The NVML backend over the fake library prepares what the simulated one does: a MIG device
/// at a placement nobody created (partitionable mode), created through NVML and destroyed at
/// unprepare, and a whole GPU time-sliced with the driver root's `nvidia-smi`, as NVIDIA's DRA
/// driver sets it, and reset at unprepare.
#[tokio::test]
async fn nvml_prepare_creates_mig_devices_and_sets_time_slices() {
    use k8s_openapi::api::resource::v1::{
        DeviceAllocationConfiguration, OpaqueDeviceConfiguration,
    };
    use k8s_openapi::apimachinery::pkg::runtime::RawExtension;
    let mut d = Dirs::new();
    d.nvml = true;
    d.partitionable = true;
    d.profile = "a100-mig-mixed";
    let sim = nvdra::inventory::sim::SimBackend::from_profile(d.profile, NODE).unwrap();
    let inv = nvdra::inventory::DeviceBackend::snapshot(&sim).unwrap();
    let gpu0 = inv.gpus[0].uuid.to_string();
    d.add_claim("mig", "gpu-2-mig-1g10gb-15-6");
    d.add_claim_with(
        "sliced",
        "gpu-0",
        vec![DeviceAllocationConfiguration {
            source: "FromClaim".into(),
            requests: None,
            opaque: Some(OpaqueDeviceConfiguration {
                driver: DRIVER.into(),
                parameters: RawExtension(serde_json::json!({
                    "apiVersion": "resource.nvidia.com/v1beta1",
                    "kind": "GpuConfig",
                    "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Short"}}
                })),
            }),
        }],
    );
    let mut p = d.spawn(None);
    wait_ready(&d, &mut p).await;
    let original = d.mig_instances();
    assert_eq!(original.len(), 7, "{original:?}");

    let r = prepare(&d, "mig").await.unwrap();
    assert_eq!(r.error, "");
    let now = d.mig_instances();
    let created: Vec<_> = now.iter().filter(|i| !original.contains(i)).collect();
    assert_eq!(created.len(), 1, "{now:?}");
    let (gpu, profile, start, uuids) = created[0];
    assert_eq!((*gpu, *profile, *start), (2, 15, 6));
    assert_eq!(
        uuids.len(),
        1,
        "one compute instance spanning the GPU instance"
    );
    // The claim's CDI spec gives the MIG device as a CDI device (its env is NVIDIA's `void`,
    // not a UUID list).
    let spec = std::fs::read_to_string(d.p("cdi").join(Dirs::spec_name("mig"))).unwrap();
    assert!(spec.contains("-gpu-2-mig-1g10gb-15-6"), "{spec}");
    assert!(spec.contains("NVIDIA_VISIBLE_DEVICES=void"), "{spec}");

    let r = prepare(&d, "sliced").await.unwrap();
    assert_eq!(r.error, "");
    let lib = d.p("driver/usr/lib64/libnvidia-ml.so.1");
    let log = d.nvidia_smi_log();
    assert_eq!(
        log.lines().collect::<Vec<_>>(),
        [
            format!("-i {gpu0} -c DEFAULT LD_PRELOAD={}", lib.display()),
            format!(
                "compute-policy -i {gpu0} --set-timeslice=1 LD_PRELOAD={}",
                lib.display()
            ),
        ],
        "{log}"
    );

    assert_eq!(unprepare(&d, "mig").await, "");
    assert_eq!(
        d.mig_instances(),
        original,
        "the created instance is destroyed"
    );
    assert_eq!(unprepare(&d, "sliced").await, "");
    let log = d.nvidia_smi_log();
    assert!(
        log.lines()
            .last()
            .is_some_and(|l| l.starts_with(&format!("compute-policy -i {gpu0} --set-timeslice=0"))),
        "back to the default: {log}"
    );
    assert!(terminate(&mut p).await.success());
}

/// A crash between the two NVML steps of a MIG creation leaves a GPU instance without a
/// compute instance: no MIG device lists it, so recovery cannot find it by placement. The next
/// creation over its slices destroys it and goes on.
#[tokio::test]
async fn nvml_a_half_created_mig_instance_is_destroyed_when_its_slices_are_needed() {
    let mut d = Dirs::new();
    d.nvml = true;
    d.partitionable = true;
    d.profile = "a100-mig-mixed";
    d.add_claim("a", "gpu-2-mig-1g10gb-15-6");
    let mut p = d.spawn(None);
    wait_ready(&d, &mut p).await;
    assert!(terminate(&mut p).await.success());
    let original = d.mig_instances();
    // GPU instance 9 of profile 15 (1g.10gb) at slices 6-7, with no compute instance.
    let mut state = std::fs::read_to_string(d.nvml_state()).unwrap();
    state.push_str("gi 2 9 15 6\n");
    std::fs::write(d.nvml_state(), state).unwrap();
    assert!(d.mig_instances().contains(&(2, 15, 6, vec![])));

    let mut p = d.spawn(None);
    wait_ready(&d, &mut p).await;
    let r = prepare(&d, "a").await.unwrap();
    assert_eq!(r.error, "");
    let now = d.mig_instances();
    let at6: Vec<_> = now.iter().filter(|i| (i.0, i.2) == (2, 6)).collect();
    assert_eq!(at6.len(), 1, "{now:?}");
    assert_eq!(
        at6[0].3.len(),
        1,
        "the new instance has its compute instance: {now:?}"
    );
    assert_eq!(unprepare(&d, "a").await, "");
    assert_eq!(d.mig_instances(), original);
    assert!(terminate(&mut p).await.success());
}

/// Without `nvidia-smi` under the driver root the NVML backend says so once at start-up, and a
/// TimeSlicing claim fails to prepare naming the cause, changing nothing.
#[tokio::test]
async fn nvml_without_nvidia_smi_refuses_time_slicing_naming_the_cause() {
    use k8s_openapi::api::resource::v1::{
        DeviceAllocationConfiguration, OpaqueDeviceConfiguration,
    };
    use k8s_openapi::apimachinery::pkg::runtime::RawExtension;
    let mut d = Dirs::new();
    d.nvml = true;
    d.profile = "l40s-pcie";
    d.fake_driver_root();
    std::fs::remove_file(d.p("driver/usr/bin/nvidia-smi")).unwrap();
    d.add_claim_with(
        "sliced",
        "gpu-1",
        vec![DeviceAllocationConfiguration {
            source: "FromClaim".into(),
            requests: None,
            opaque: Some(OpaqueDeviceConfiguration {
                driver: DRIVER.into(),
                parameters: RawExtension(serde_json::json!({
                    "apiVersion": "resource.nvidia.com/v1beta1",
                    "kind": "GpuConfig",
                    "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}
                })),
            }),
        }],
    );
    let mut p = d
        .command(None)
        .env("NVDRA_LOG", "warn")
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_ready(&d, &mut p).await;
    let r = prepare(&d, "sliced").await.unwrap();
    assert!(
        r.error.contains("no nvidia-smi under the driver root"),
        "{}",
        r.error
    );
    assert!(d.specs().is_empty());
    assert!(terminate(&mut p).await.success());
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut p.stderr.take().unwrap(), &mut stderr).unwrap();
    let said: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("time slicing is unavailable"))
        .collect();
    assert_eq!(said.len(), 1, "{stderr}");
    assert!(
        said[0].contains(&d.p("driver").display().to_string()),
        "{stderr}"
    );
}

#[tokio::test]
async fn nvml_crash_after_started_creating_a_mig_instance() {
    crash_then_retry_on("after-started", "gpu-2-mig-1g10gb-15-6", true, true).await;
}

#[tokio::test]
async fn nvml_crash_after_cdi_creating_a_mig_instance() {
    crash_then_retry_on("after-cdi", "gpu-2-mig-1g10gb-15-6", true, true).await;
}

#[tokio::test]
async fn nvml_crash_before_completed_creating_a_mig_instance() {
    crash_then_retry_on("before-completed", "gpu-2-mig-1g10gb-15-6", true, true).await;
}

#[tokio::test]
async fn nvml_crash_after_completed_creating_a_mig_instance() {
    crash_then_retry_on("after-completed", "gpu-2-mig-1g10gb-15-6", true, true).await;
}

#[tokio::test]
async fn reboot_clears_claims_and_orphan_specs() {
    let d = Dirs::new();
    d.add_claim("a", "gpu-0");
    let mut p = d.spawn(None);
    wait_ready(&d, &mut p).await;
    assert_eq!(prepare(&d, "a").await.unwrap().error, "");
    assert_eq!(d.specs(), vec![Dirs::spec_name("a")]);
    assert!(terminate(&mut p).await.success());

    // Same boot: the claim survives a restart and is served from the checkpoint.
    let mut p = d.spawn(None);
    wait_ready(&d, &mut p).await;
    assert_eq!(d.checkpoint_json()["claims"].as_object().unwrap().len(), 1);
    assert!(terminate(&mut p).await.success());

    // New boot: the checkpoint's claims and the CDI spec are gone.
    std::fs::write(d.boot_file(), "boot-2\n").unwrap();
    let mut p = d.spawn(None);
    wait_ready(&d, &mut p).await;
    assert!(d.specs().is_empty(), "{:?}", d.specs());
    let cp = d.checkpoint_json();
    assert_eq!(cp["bootId"], "boot-2");
    assert!(cp["claims"].as_object().unwrap().is_empty());
    assert!(terminate(&mut p).await.success());
}

#[tokio::test]
async fn corrupt_checkpoint_is_moved_aside() {
    let d = Dirs::new();
    std::fs::create_dir_all(d.checkpoint().parent().unwrap()).unwrap();
    std::fs::write(d.checkpoint(), "{\"version\": 1, \"claims\": {\"a\": tru").unwrap();
    d.add_claim("a", "gpu-1");
    let mut p = d.spawn(None);
    wait_ready(&d, &mut p).await;
    let aside: Vec<_> = std::fs::read_dir(d.checkpoint().parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.starts_with("checkpoint.json.corrupt-"))
        .collect();
    assert_eq!(aside.len(), 1);
    assert_eq!(prepare(&d, "a").await.unwrap().error, "");
    assert!(terminate(&mut p).await.success());
}

/// A rollback: the checkpoint was written by a newer nvdra. The start fails naming the file and
/// the version, and the file — the newer pod's claims — is left exactly as it was.
#[test]
fn a_newer_checkpoint_fails_the_start_and_is_left_in_place() {
    let d = Dirs::new();
    let dir = d.checkpoint().parent().unwrap().to_path_buf();
    std::fs::create_dir_all(&dir).unwrap();
    let v = nvdra::ledger::VERSION + 1;
    let newer = format!(
        r#"{{"version": {v}, "bootId": "b", "claims": {{"a": {{"somethingNew": true}}}}}}"#
    );
    std::fs::write(d.checkpoint(), &newer).unwrap();
    let err = assert_failed_start(&d, &d.checkpoint().display().to_string());
    assert!(err.contains(&format!("version {v}")), "{err}");
    assert_eq!(std::fs::read_to_string(d.checkpoint()).unwrap(), newer);
    let stray: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.starts_with("checkpoint.json") && n != "checkpoint.json")
        .collect();
    assert!(stray.is_empty(), "{stray:?}");
}

/// A rolling update towards a newer nvdra: once the new pod has written a newer version, this
/// one answers the kubelet with an error naming the file, and changes nothing.
#[tokio::test]
async fn a_running_instance_refuses_a_newer_checkpoint_written_beside_it() {
    let d = Dirs::new();
    d.add_claim("a", "gpu-1");
    let mut p = d.spawn(None);
    wait_ready(&d, &mut p).await;
    let v = nvdra::ledger::VERSION + 1;
    let newer = format!(r#"{{"version": {v}, "bootId": "b", "claims": {{}}}}"#);
    std::fs::write(d.checkpoint(), &newer).unwrap();
    let r = prepare(&d, "a").await.unwrap();
    assert!(
        r.error.contains(&d.checkpoint().display().to_string())
            && r.error.contains(&format!("version {v}")),
        "{}",
        r.error
    );
    assert_eq!(std::fs::read_to_string(d.checkpoint()).unwrap(), newer);
    assert!(d.specs().is_empty(), "{:?}", d.specs());
    assert!(terminate(&mut p).await.success());
}

#[tokio::test]
async fn a_second_signal_exits_without_waiting_for_a_stuck_client() {
    use std::io::BufRead;
    use std::os::unix::process::ExitStatusExt;
    let d = Dirs::new();
    let mut p = d
        .command(None)
        .env("NVDRA_LOG", "info")
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let stderr = p.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    wait_ready(&d, &mut p).await;
    // A client that connects and never speaks holds up the graceful drain, once the server has
    // accepted it: one still in the listen backlog when the first signal comes does not (the
    // run then ends gracefully, with no second signal to see), so wait for its descriptor.
    let sockets = |pid: u32| {
        std::fs::read_dir(format!("/proc/{pid}/fd"))
            .map(|fds| {
                fds.filter_map(|fd| std::fs::read_link(fd.ok()?.path()).ok())
                    .filter(|l| l.to_string_lossy().starts_with("socket:"))
                    .count()
            })
            .unwrap_or(0)
    };
    let pid = p.id();
    let before = sockets(pid);
    let _stuck = std::os::unix::net::UnixStream::connect(d.dra_socket()).unwrap();
    let deadline = std::time::Instant::now() + support::wait::SOON;
    while sockets(pid) <= before {
        assert!(
            std::time::Instant::now() < deadline,
            "the DRA server never accepted the client"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let term = || {
        let ok = Command::new("kill")
            .args(["-TERM", &p.id().to_string()])
            .status()
            .unwrap();
        assert!(ok.success());
    };
    term();
    // Wait until the first signal was taken, so the second is a separate event.
    while let Some(line) = rx.recv().await {
        if line.contains("SIGTERM: shutting down") {
            break;
        }
    }
    term();
    let mut forced = false;
    while let Some(line) = rx.recv().await {
        forced |= line.contains("second signal");
    }
    let status = wait_exit(&mut p).await;
    assert!(forced, "the exit names the second signal");
    assert_eq!(
        status.code(),
        Some(1),
        "a forced exit is a failure: {status}"
    );
    assert_eq!(status.signal(), None);
    assert!(!d.reg_socket().exists() && !d.dra_socket().exists());
}

#[test]
fn bad_flags_exit_64_naming_the_flag() {
    let d = Dirs::new();
    let out = d
        .command(None)
        .args(["--pod-uid", "a/b"])
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(64));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--pod-uid"), "{err}");

    let out = d
        .command(Some("sometime"))
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(64));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("after-started"), "{err}");

    // NVIDIA's device-plugin config file is checked strictly: an unknown key is named.
    let dp_config = d.p("dp-config.yaml");
    std::fs::write(&dp_config, "version: v1\nflags:\n  migStrategyy: mixed\n").unwrap();
    let out = support::daemon::nvdra_run(d.root.path(), "device-plugin", NODE)
        .args(["--profile", "l40s-pcie"])
        .arg("--device-plugin-config")
        .arg(&dp_config)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(64));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--device-plugin-config") && err.contains("migStrategyy"),
        "{err}"
    );
    assert!(
        !d.p("kubelet/device-plugins").exists(),
        "nothing served before the config was read"
    );
}

/// A rolling update: the old and the new pod serve side by side (sockets named by pod UID),
/// share one checkpoint, and the kubelet may unprepare through either.
#[tokio::test]
async fn two_instances_during_a_rolling_update() {
    let d = Dirs::new();
    d.add_claim("a", "gpu-4");
    d.add_claim("b", "gpu-4");
    let reg = |pod: &str| d.p(&format!("kubelet/plugins_registry/{DRIVER}-{pod}-reg.sock"));
    let dra = |pod: &str| d.p(&format!("kubelet/plugins/{DRIVER}/dra-{pod}.sock"));
    let mut old = d
        .command(None)
        .args(["--pod-uid", "old-pod"])
        .spawn()
        .unwrap();
    wait_ready_at(&reg("old-pod"), &mut old).await;
    assert_eq!(prepare_at(&dra("old-pod"), "a").await.unwrap().error, "");

    let mut new = d
        .command(None)
        .args(["--pod-uid", "new-pod"])
        .spawn()
        .unwrap();
    wait_ready_at(&reg("new-pod"), &mut new).await;
    // The new instance knows the old one's claim: the device is taken, the claim is prepared.
    let r = prepare_at(&dra("new-pod"), "b").await.unwrap();
    assert!(
        r.error
            .contains("already prepared for claim default/claim-a"),
        "{}",
        r.error
    );
    let r = prepare_at(&dra("new-pod"), "a").await.unwrap();
    assert_eq!(r.error, "");
    assert_eq!(d.specs(), vec![Dirs::spec_name("a")]);
    // The old pod goes away, removing only its own sockets.
    assert!(terminate(&mut old).await.success());
    assert!(!reg("old-pod").exists() && !dra("old-pod").exists());
    assert!(reg("new-pod").exists() && dra("new-pod").exists());
    assert_eq!(unprepare_at(&dra("new-pod"), "a").await, "");
    assert_eq!(prepare_at(&dra("new-pod"), "b").await.unwrap().error, "");
    assert!(terminate(&mut new).await.success());
}

/// Runs a start that must fail: non-zero exit, exactly one line on stderr (logs at `warn`) that
/// contains `cause`, and no socket file anywhere under the kubelet root.
fn assert_failed_start(d: &Dirs, cause: &str) -> String {
    let out = d.command(None).stderr(Stdio::piped()).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "{err}");
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "one line on stderr: {err}");
    assert!(lines[0].contains(cause), "{cause:?} not named: {err}");
    let sockets = sockets_under(&d.p("kubelet"));
    assert!(sockets.is_empty(), "left behind: {sockets:?}");
    err
}

fn sockets_under(dir: &Path) -> Vec<PathBuf> {
    use std::os::unix::fs::FileTypeExt;
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut found = Vec::new();
    for e in entries {
        let e = e.unwrap();
        let kind = e.file_type().unwrap();
        if kind.is_dir() {
            found.extend(sockets_under(&e.path()));
        } else if kind.is_socket() {
            found.push(e.path());
        }
    }
    found
}

#[test]
fn a_taken_metrics_port_fails_the_start_and_leaves_no_socket() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let mut d = Dirs::new();
    d.metrics_address = taken.local_addr().unwrap().to_string();
    assert_failed_start(&d, &d.metrics_address);
}

#[test]
fn an_unreadable_checkpoint_fails_the_start_and_leaves_no_socket() {
    let d = Dirs::new();
    std::fs::create_dir_all(d.checkpoint()).unwrap();
    assert_failed_start(&d, &d.checkpoint().display().to_string());
}

#[test]
fn an_unusable_api_dir_fails_the_start_and_leaves_no_socket() {
    let d = Dirs::new();
    std::fs::write(d.p("api"), "not a directory\n").unwrap();
    assert_failed_start(&d, &d.p("api").display().to_string());
}

/// The DRA socket is bound before the registration socket; when the second cannot be, the first
/// must go too.
#[test]
fn a_failed_registration_socket_removes_the_dra_socket() {
    let d = Dirs::new();
    std::fs::create_dir_all(d.p("kubelet")).unwrap();
    std::fs::write(d.p("kubelet/plugins_registry"), "not a directory\n").unwrap();
    assert_failed_start(&d, &d.reg_socket().display().to_string());
    assert!(!d.dra_socket().exists());
    assert!(
        d.dra_socket().parent().unwrap().is_dir(),
        "the DRA socket was created first"
    );
}

/// `GET /readyz` on `addr`: the status line and body, or `None` when nothing answers.
async fn readyz(addr: &str) -> Option<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
    s.write_all(b"GET /readyz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .ok()?;
    let mut buf = String::new();
    s.read_to_string(&mut buf).await.ok()?;
    // Accepted by the kernel after the endpoint stopped: closed unanswered.
    (!buf.is_empty()).then_some(buf)
}

/// The checkpoint writer dies under a ready plugin (the crash-points hook: SIGUSR1 makes the task
/// `NVDRA_TEST_KILL_TASK` names panic): `/readyz` stops answering 200 — a 503 names the task —
/// and the process exits non-zero naming it, instead of serving prepares that cannot be recorded.
#[tokio::test]
async fn a_dead_checkpoint_writer_fails_readyz_and_the_process_names_it() {
    let mut d = Dirs::new();
    let mut cmd = d.command(None);
    cmd.env("NVDRA_TEST_KILL_TASK", "checkpoint-writer");
    dies_when_ready(&mut d, cmd, "checkpoint-writer", |child| {
        let ok = Command::new("kill")
            .args(["-USR1", &child.id().to_string()])
            .status()
            .unwrap();
        assert!(ok.success());
    })
    .await;
}

/// NVML's health-event thread dies under a ready plugin (the fake NVML refuses its wait for good,
/// as a driver that lost the event set does): `/readyz` stops answering 200 and the process exits
/// non-zero naming it and NVML's error, instead of serving on with no GPU health monitored.
#[tokio::test]
async fn a_dead_nvml_event_thread_fails_readyz_and_the_process_names_it() {
    const NVML_ERROR_INVALID_ARGUMENT: u32 = 2;
    let mut d = Dirs::new();
    d.nvml = true;
    let wait_error = d.p("nvml-wait-error");
    let mut cmd = d.command(None);
    cmd.env("FAKE_NVML_EVENT_WAIT_ERROR", &wait_error);
    let err = dies_when_ready(&mut d, cmd, "health-events", |_| {
        std::fs::write(&wait_error, NVML_ERROR_INVALID_ARGUMENT.to_string()).unwrap();
    })
    .await;
    assert!(
        err.contains(
            "NVML refuses to wait for GPU health events (a supplied argument was invalid)"
        ),
        "the cause is not named: {err}"
    );
}

/// Starts `cmd` (the daemon of `d`), waits until it is registered and `/readyz` answers 200, has
/// `kill` kill the task (or thread) named `task`, then asserts that `/readyz` stops answering 200
/// (a 503 names the task) and the process exits non-zero naming it, leaving no socket. Its
/// stderr.
async fn dies_when_ready(
    d: &mut Dirs,
    mut cmd: Command,
    task: &str,
    kill: impl FnOnce(&Child),
) -> String {
    use kubelet_plugin::proto::pluginregistration::{
        RegistrationStatus, registration_client::RegistrationClient,
    };
    let mut child = cmd.stderr(Stdio::piped()).spawn().unwrap();
    // Bound on `127.0.0.1:0`: the port the kernel gave, read back, so no other test takes it
    // between a pick and the bind.
    d.metrics_address = support::daemon::metrics_address(child.id()).to_string();
    wait_ready(d, &mut child).await;
    let reg = support::dra::unix_channel(&d.reg_socket()).await.unwrap();
    RegistrationClient::new(reg)
        .notify_registration_status(RegistrationStatus {
            plugin_registered: true,
            error: String::new(),
        })
        .await
        .unwrap();
    let mut ready = false;
    for _ in 0..3000 {
        if readyz(&d.metrics_address)
            .await
            .is_some_and(|r| r.starts_with("HTTP/1.1 200"))
        {
            ready = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(ready, "/readyz did not answer 200 within 30 s");

    kill(&child);
    let mut failed = None;
    for _ in 0..3000 {
        match readyz(&d.metrics_address).await {
            Some(r) if r.starts_with("HTTP/1.1 200") => {}
            other => {
                failed = Some(other);
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let failed =
        failed.unwrap_or_else(|| panic!("/readyz still answers 200 30 s after {task} died"));
    // `None`: the process drained and exited before a poll landed (no hook holds its drain
    // here). The 503 itself is asserted unconditionally in-process, with the drain held:
    // `daemon::supervise::tests::while_the_others_drain_readyz_answers_503_naming_the_dead_task`.
    if let Some(answer) = failed {
        // Answered while the other tasks drain: it says why.
        assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
        assert!(answer.contains(&format!("task {task} stopped")), "{answer}");
    }
    let status = wait_exit(&mut child).await;
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert!(!status.success(), "{status}: {err}");
    assert!(
        err.contains(&format!("task {task} stopped unexpectedly")),
        "the task is not named: {err}"
    );
    let sockets = sockets_under(&d.p("kubelet"));
    assert!(sockets.is_empty(), "left behind: {sockets:?}");
    err
}
