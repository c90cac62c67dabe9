//! MIG mode through the NVML backend against the fake NVML (`tests/fake-nvml`): which GPUs can
//! toggle (a Hopper, an Ampere, a vGPU guest, a Hopper with a change pending) and
//! `DeviceBackend::set_mig_mode` (IN_USE naming the processes and leaving the change pending,
//! success, off refused while MIG devices exist, reset required on Ampere), and the GPU
//! instances without a compute instance (removed only at the placement being created, named and
//! kept elsewhere). On a cloud node of passthrough GPUs: the holders a read lists and a switch
//! meets (real processes holding the fake's device files), RESET_REQUIRED on an Ampere and on a
//! Hopper whose hypervisor needs a reset, and minors that change across a switch. IN_USE in
//! both of NVML's forms (activation status, return code) gives the same refusal.
//!
//! The fake's node is process-wide and these checks change it, so they run in a child process
//! of this test binary with a topology of its own (`FAKE_NVML_TOPOLOGY`), one after another.

use crate::support;

use std::ffi::OsStr;
use std::path::Path;
use std::process::Command;

use nvdra::inventory::holders::HolderScan;
use nvdra::inventory::nvml::{LIBRARY, NvmlBackend};
use nvdra::inventory::{
    DeviceBackend, Error, MigModeChange, NoMigToggle, Placement, Reconfigure, Virtualization,
};

const CHILD: &str = "NVDRA_TEST_MIG_MODE_CHILD";
const DONE: &str = "mig mode checks passed";

/// GPU 0: Hopper; 1: Ampere; 2: Hopper, made a vGPU guest; 3: Hopper in MIG mode with one MIG
/// device; 4: Hopper, left with a change pending.
const TOPOLOGY: &str = r#"
version: v1
driverVersion: "570.124.06"
cudaDriverVersion: "12.8"
gpus:
  - {index: 0, model: H100-SXM5-80GB, pciBusId: "0000:1A:00.0", numaNode: 0}
  - {index: 1, model: A100-SXM4-40GB, pciBusId: "0000:2A:00.0", numaNode: 0}
  - {index: 2, model: H100-SXM5-80GB, pciBusId: "0000:3A:00.0", numaNode: 0}
  - index: 3
    model: H100-SXM5-80GB
    pciBusId: "0000:4A:00.0"
    numaNode: 0
    mig:
      enabled: true
      devices:
        - {profile: 1g.10gb, placement: 0}
  - {index: 4, model: H100-SXM5-80GB, pciBusId: "0000:5A:00.0", numaNode: 0}
"#;

/// The fake's test hooks, from the copy NVML loaded.
struct Hooks(libloading::Library);

impl Hooks {
    fn set_idle(&self, gpu: u32, idle: bool) {
        // SAFETY: the hook's C signature as the fake's `mig_mode.rs` declares it.
        let f: libloading::Symbol<extern "C" fn(u32, i32) -> u32> =
            unsafe { self.0.get(b"fake_nvml_set_idle") }.unwrap();
        assert_eq!(f(gpu, i32::from(idle)), 0);
    }

    fn set_reset_required(&self, gpu: u32, on: bool) {
        // SAFETY: as above.
        let f: libloading::Symbol<extern "C" fn(u32, i32) -> u32> =
            unsafe { self.0.get(b"fake_nvml_set_reset_required") }.unwrap();
        assert_eq!(f(gpu, i32::from(on)), 0);
    }

    fn set_virtualization(&self, gpu: u32, mode: u32) {
        // SAFETY: as above.
        let f: libloading::Symbol<extern "C" fn(u32, u32) -> u32> =
            unsafe { self.0.get(b"fake_nvml_set_virtualization") }.unwrap();
        assert_eq!(f(gpu, mode), 0);
    }
}

/// H100's `1g.10gb` and `2g.20gb` GPU-instance profile ids.
const PROFILE_1G: u32 = 19;
const PROFILE_2G: u32 = 14;

/// A GPU instance of `profile` (one slice) at slice `start` of GPU `index`, with no compute
/// instance in it, made through the NVML the backend loaded, as `nvidia-smi mig -cgi` makes
/// one.
fn empty_gpu_instance(
    backend: &NvmlBackend,
    index: u32,
    profile: u32,
    start: u32,
) -> nvml_wrapper_sys::bindings::nvmlGpuInstance_t {
    use nvml_wrapper_sys::bindings::{
        nvmlGpuInstance_t, nvmlGpuInstancePlacement_t, nvmlReturn_enum_NVML_SUCCESS,
    };
    let nvml = backend.nvml();
    let device = nvml.device_by_index(index).unwrap();
    let create = nvml
        .lib()
        .nvmlDeviceCreateGpuInstanceWithPlacement
        .as_ref()
        .unwrap();
    let at = nvmlGpuInstancePlacement_t { start, size: 1 };
    let mut gi: nvmlGpuInstance_t = std::ptr::null_mut();
    // SAFETY: NVML's signature; a live device handle, a placement NVML only reads and a valid
    // out-pointer.
    let r = unsafe { create(device.handle(), profile, &at, &mut gi) };
    assert_eq!(r, nvmlReturn_enum_NVML_SUCCESS);
    gi
}

/// A compute instance spanning one-slice GPU instance `gi`, as `nvidia-smi mig -cci` makes one.
fn complete_gpu_instance(backend: &NvmlBackend, gi: nvml_wrapper_sys::bindings::nvmlGpuInstance_t) {
    use nvml_wrapper_sys::bindings::{
        NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE, nvmlComputeInstance_t, nvmlReturn_enum_NVML_SUCCESS,
    };
    let create = backend
        .nvml()
        .lib()
        .nvmlGpuInstanceCreateComputeInstance
        .as_ref()
        .unwrap();
    let mut ci: nvmlComputeInstance_t = std::ptr::null_mut();
    // SAFETY: NVML's signature; a live GPU-instance handle and a valid out-pointer.
    let r = unsafe { create(gi, NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE, &mut ci) };
    assert_eq!(r, nvmlReturn_enum_NVML_SUCCESS);
}

/// (profile id, GPU-instance id, compute instances) of each GPU instance of GPU `index`, as
/// NVML lists them for the one-slice profile.
fn gpu_instances(backend: &NvmlBackend, index: u32) -> Vec<(u32, u32, u32)> {
    use nvml_wrapper_sys::bindings::{
        NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE, nvmlComputeInstance_t, nvmlGpuInstance_t,
        nvmlGpuInstanceInfo_t,
    };
    let nvml = backend.nvml();
    let lib = nvml.lib();
    let device = nvml.device_by_index(index).unwrap();
    let mut out = Vec::new();
    for profile in [PROFILE_1G, PROFILE_2G] {
        let mut gis: [nvmlGpuInstance_t; 8] = [std::ptr::null_mut(); 8];
        let mut count = gis.len() as u32;
        // SAFETY: NVML's signature; `gis` holds `count` writable slots.
        unsafe {
            (lib.nvmlDeviceGetGpuInstances.as_ref().unwrap())(
                device.handle(),
                profile,
                gis.as_mut_ptr(),
                &mut count,
            )
        };
        for gi in &gis[..count as usize] {
            // SAFETY: as above, for a live GPU-instance handle.
            let mut info: nvmlGpuInstanceInfo_t = unsafe { std::mem::zeroed() };
            unsafe { (lib.nvmlGpuInstanceGetInfo.as_ref().unwrap())(*gi, &mut info) };
            let mut cis: [nvmlComputeInstance_t; 8] = [std::ptr::null_mut(); 8];
            let mut n = cis.len() as u32;
            unsafe {
                (lib.nvmlGpuInstanceGetComputeInstances.as_ref().unwrap())(
                    *gi,
                    NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE,
                    cis.as_mut_ptr(),
                    &mut n,
                )
            };
            out.push((info.profileId, info.id, n));
        }
    }
    out
}

/// The NVML backend over the fake (linked into a driver root of its own, with a sysfs root of
/// its own and, where `dev` names the fake's device directory, holders read there through
/// `/proc`), and the fake's test hooks. The two directories go with the first element: bound
/// first, they outlive the backend and the hooks.
fn fake_backend(dev: Option<&Path>) -> ([tempfile::TempDir; 2], NvmlBackend, Hooks) {
    let driver_root = tempfile::tempdir().unwrap();
    let lib_dir = driver_root.path().join("usr/lib64");
    std::fs::create_dir_all(&lib_dir).unwrap();
    let lib = lib_dir.join(LIBRARY);
    std::os::unix::fs::symlink(support::fake_nvml::library(), &lib).unwrap();
    let sysfs = tempfile::tempdir().unwrap();
    let mut backend = NvmlBackend::open(driver_root.path())
        .unwrap()
        .with_sysfs_root(sysfs.path());
    if let Some(dev) = dev {
        backend = backend.with_holders(HolderScan::new("/proc").with_device_dir(dev));
    }
    // SAFETY: the fake's initialisers are Rust statics; loading it again returns the copy NVML
    // already loaded.
    let hooks = Hooks(unsafe { libloading::Library::new(&lib) }.unwrap());
    ([driver_root, sysfs], backend, hooks)
}

/// Runs this binary's test `test` alone (`--exact`, `--nocapture`) as a child process with
/// `child` set, `FAKE_NVML_TOPOLOGY` naming `topology` written into `dir`, this process's
/// `FAKE_NVML_NODE`, `FAKE_NVML_PROFILE` and `FAKE_NVML_STATE` removed and then each of `env`
/// set; and asserts that it passed and printed [`DONE`].
fn run_child(child: &str, test: &str, dir: &Path, topology: &str, env: &[(&str, &OsStr)]) {
    let path = dir.join("topology.yaml");
    std::fs::write(&path, topology).unwrap();
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            &support::test_name(module_path!(), test),
            "--nocapture",
        ])
        .env(child, "1")
        .env("FAKE_NVML_TOPOLOGY", &path)
        .env_remove("FAKE_NVML_NODE")
        .env_remove("FAKE_NVML_PROFILE")
        .env_remove("FAKE_NVML_STATE")
        .envs(env.iter().copied())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains(DONE),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn child_toggles_mig_mode() {
    if std::env::var(CHILD).is_err() {
        return;
    }
    let (_dirs, backend, hooks) = fake_backend(None);

    // A Hopper with a process on it: nvidia-smi (or any NVML client) asking for MIG mode leaves
    // the change pending (activation status IN_USE).
    let status = backend
        .nvml()
        .device_by_index(4)
        .unwrap()
        .set_mig_mode(true)
        .unwrap();
    assert_eq!(
        status,
        nvml_wrapper_sys::bindings::nvmlReturn_enum_NVML_ERROR_IN_USE
    );
    // NVML_GPU_VIRTUALIZATION_MODE_VGPU.
    hooks.set_virtualization(2, 2);

    let inv = backend.snapshot().unwrap();
    let gpu = |i: usize| inv.gpus[i].clone();
    assert_eq!(gpu(0).virtualization, Some(Virtualization::BareMetal));
    assert_eq!(gpu(0).mig_toggle(), Ok(()));
    assert_eq!(
        gpu(1).mig_toggle().unwrap_err().to_string(),
        "Ampere (8.0): MIG mode changes only through the operator"
    );
    assert_eq!(gpu(2).virtualization, Some(Virtualization::VgpuGuest));
    assert_eq!(
        gpu(2).mig_toggle(),
        Err(NoMigToggle::Virtualized(Virtualization::VgpuGuest))
    );
    assert_eq!(gpu(3).mig_toggle(), Ok(()));
    assert_eq!(gpu(4).mig.pending, Some(true));
    assert_eq!(
        gpu(4).mig_toggle().unwrap_err().to_string(),
        "MIG mode change pending (current off, pending on): reset required"
    );

    // Asking for the current mode withdraws the pending change.
    assert_eq!(
        backend.set_mig_mode(&gpu(4).uuid, false).unwrap(),
        MigModeChange::Unchanged
    );
    assert_eq!(backend.snapshot().unwrap().gpus[4].mig.pending, None);

    // GPU 0's process (pid 4000) keeps its MIG mode. The change stays pending, as NVML leaves
    // it, for the caller to withdraw: one more request, for the current mode.
    let e = backend.set_mig_mode(&gpu(0).uuid, true).unwrap_err();
    assert!(
        matches!(&e, Error::InUse { processes, .. } if processes == &[4000]),
        "{e:?}"
    );
    assert!(matches!(e, Error::InUse { .. }));
    assert!(e.to_string().contains("4000"), "{e}");
    let after = backend.snapshot().unwrap();
    assert!(!after.gpus[0].mig.enabled);
    assert_eq!(after.gpus[0].mig.pending, Some(true));
    assert_eq!(
        backend.set_mig_mode(&gpu(0).uuid, false).unwrap(),
        MigModeChange::Unchanged
    );
    assert_eq!(backend.snapshot().unwrap().gpus[0].mig.pending, None);

    // Once it exits, the change applies at once (Hopper), leaving no MIG devices.
    hooks.set_idle(0, true);
    assert_eq!(
        backend.set_mig_mode(&gpu(0).uuid, true).unwrap(),
        MigModeChange::Applied
    );
    let on = backend.snapshot().unwrap().gpus[0].clone();
    assert!(on.mig.enabled && on.mig.devices.is_empty(), "{:?}", on.mig);
    assert_eq!(on.mig.pending, None);
    assert_eq!(
        backend.set_mig_mode(&gpu(0).uuid, true).unwrap(),
        MigModeChange::Unchanged
    );

    // A MIG creation that stopped between its GPU instance and its compute instance (a crash,
    // an NVML error) leaves a GPU instance that is no MIG device but holds its slices. The
    // kubelet prepares the same claim again, at the same placement: there nvdra removes it.
    empty_gpu_instance(&backend, 0, PROFILE_1G, 0);
    let m = backend
        .create_mig(&gpu(0).uuid, PROFILE_1G, Placement { start: 0, size: 1 })
        .unwrap();
    assert_eq!(m.placement, Placement { start: 0, size: 1 });
    assert_eq!(gpu_instances(&backend, 0), [(PROFILE_1G, 1, 1)]);
    backend.destroy_mig(&gpu(0).uuid, &m.uuid).unwrap();
    // One elsewhere may be an operator's being made (`nvidia-smi mig -cgi` before `-cci`):
    // a creation it overlaps at another placement or profile is refused naming it, and it is
    // kept.
    let operator = empty_gpu_instance(&backend, 0, PROFILE_1G, 3);
    let e = backend
        .create_mig(&gpu(0).uuid, PROFILE_2G, Placement { start: 2, size: 2 })
        .unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("GPU instance 1 (profile 19 at 3..4) without a compute instance")
            && msg.contains(&format!("nvidia-smi mig -dgi -gi 1 -i {}", gpu(0).uuid)),
        "{msg}"
    );
    assert_eq!(gpu_instances(&backend, 0), [(PROFILE_1G, 1, 0)]);
    // And it keeps MIG mode from going off, which names it and destroys nothing.
    assert!(backend.snapshot().unwrap().gpus[0].mig.devices.is_empty());
    let e = backend.set_mig_mode(&gpu(0).uuid, false).unwrap_err();
    assert!(
        e.to_string()
            .contains("GPU instance 1 (profile 19 at 3..4) without a compute instance exists"),
        "{e}"
    );
    assert_eq!(gpu_instances(&backend, 0), [(PROFILE_1G, 1, 0)]);
    let g0 = backend.snapshot().unwrap().gpus[0].clone();
    assert!(g0.mig.enabled);
    assert_eq!(g0.mig.pending, None, "nothing asked of NVML");
    // The operator finishes it: a MIG device nvdra lists, and keeps.
    complete_gpu_instance(&backend, operator);
    let listed = backend.snapshot().unwrap().gpus[0].mig.devices.clone();
    assert_eq!(listed.len(), 1);
    assert!(matches!(
        backend.set_mig_mode(&gpu(0).uuid, false),
        Err(Error::MigDevicesExist { .. })
    ));
    backend.destroy_mig(&gpu(0).uuid, &listed[0].uuid).unwrap();
    assert_eq!(
        backend.set_mig_mode(&gpu(0).uuid, false).unwrap(),
        MigModeChange::Applied
    );
    assert!(!backend.snapshot().unwrap().gpus[0].mig.enabled);

    // MIG mode stays on while a MIG device exists, which the error names.
    let mig = gpu(3).mig.devices[0].uuid.clone();
    let e = backend.set_mig_mode(&gpu(3).uuid, false).unwrap_err();
    assert!(
        matches!(&e, Error::MigDevicesExist { devices, .. } if devices == std::slice::from_ref(&mig)),
        "{e:?}"
    );
    assert!(backend.snapshot().unwrap().gpus[3].mig.enabled);

    // Ampere: only pending, a reset required.
    hooks.set_idle(1, true);
    let e = backend.set_mig_mode(&gpu(1).uuid, true).unwrap_err();
    assert!(
        matches!(
            &e,
            Error::ResetRequired {
                current: false,
                pending: true,
                ..
            }
        ),
        "{e:?}"
    );
    assert!(!matches!(e, Error::InUse { .. }));
    let a100 = backend.snapshot().unwrap().gpus[1].clone();
    assert!(!a100.mig.enabled);
    assert_eq!(a100.mig.pending, Some(true));

    // A vGPU guest cannot change it.
    let e = backend.set_mig_mode(&gpu(2).uuid, true).unwrap_err();
    assert!(
        matches!(
            &e,
            Error::MigModeFixed {
                reason: NoMigToggle::NotSupported,
                ..
            }
        ),
        "{e:?}"
    );
    println!("{DONE}");
}

#[test]
fn mig_mode_through_nvml_on_the_fake() {
    if std::env::var(CHILD).is_ok() || std::env::var(HOLDERS_CHILD).is_ok() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    run_child(
        CHILD,
        "child_toggles_mig_mode",
        dir.path(),
        TOPOLOGY,
        // Exercises the setting; what it does is not timed here.
        &[("FAKE_NVML_MIG_TOGGLE_DELAY_MS", "1".as_ref())],
    );
}

const HOLDERS_CHILD: &str = "NVDRA_TEST_MIG_HOLDERS_CHILD";

/// A cloud node: every GPU passed through to the VM (`FAKE_NVML_VIRTUALIZATION`). GPU 0: a
/// Hopper that DCGM, nvdra's MPS server and the persistence daemon hold; 1: an Ampere; 2: a
/// Hopper whose hypervisor needs a reset (`FAKE_NVML_RESET_REQUIRED`); 3: a Hopper. Minors
/// change across each switch (`FAKE_NVML_MINOR_XOR=64`).
const CLOUD: &str = r#"
version: v1
driverVersion: "570.124.06"
cudaDriverVersion: "12.8"
gpus:
  - {index: 0, model: H100-SXM5-80GB, pciBusId: "0000:1A:00.0", numaNode: 0}
  - {index: 1, model: A100-SXM4-40GB, pciBusId: "0000:2A:00.0", numaNode: 0}
  - {index: 2, model: H100-SXM5-80GB, pciBusId: "0000:3A:00.0", numaNode: 0}
  - {index: 3, model: H100-SXM5-80GB, pciBusId: "0000:4A:00.0", numaNode: 0}
"#;

/// Real processes, named by the links they were started through, each holding a file open as
/// its stdin; killed at the end.
struct Holders {
    dir: tempfile::TempDir,
    running: Vec<std::process::Child>,
}

impl Holders {
    fn start(&mut self, name: &str, file: &std::path::Path) -> u32 {
        let link = self.dir.path().join(name);
        let sleep = ["/usr/bin/sleep", "/bin/sleep"]
            .into_iter()
            .find(|p| std::path::Path::new(p).exists())
            .expect("a sleep binary");
        std::os::unix::fs::symlink(sleep, &link).unwrap();
        let child = Command::new(&link)
            .arg("600")
            .stdin(std::fs::File::open(file).unwrap())
            .spawn()
            .unwrap();
        let pid = child.id();
        self.running.push(child);
        pid
    }

    fn stop(&mut self, pid: u32) {
        let i = self.running.iter().position(|c| c.id() == pid).unwrap();
        let mut c = self.running.remove(i);
        c.kill().unwrap();
        c.wait().unwrap();
    }
}

impl Drop for Holders {
    fn drop(&mut self) {
        for c in &mut self.running {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

#[test]
fn child_holders_passthrough_and_minors() {
    use nvdra::inventory::{Holder, HolderKind};
    if std::env::var(HOLDERS_CHILD).is_err() {
        return;
    }
    let dev = std::path::PathBuf::from(std::env::var("FAKE_NVML_DEV_DIR").unwrap());
    let (_dirs, backend, hooks) = fake_backend(Some(&dev));

    let inv = backend.snapshot().unwrap();
    let uuid = |i: usize| inv.gpus[i].uuid.clone();
    assert!(
        inv.gpus
            .iter()
            .all(|g| g.virtualization == Some(Virtualization::Passthrough)),
        "{:?}",
        inv.gpus
            .iter()
            .map(|g| g.virtualization)
            .collect::<Vec<_>>()
    );
    // The fake holds every GPU's node for this process, as NVML does: nvdra is no holder.
    assert!(dev.join("nvidia0").exists());
    assert!(inv.gpus.iter().all(|g| g.mig.holders.is_empty()));

    let mut holders = Holders {
        dir: tempfile::tempdir().unwrap(),
        running: Vec::new(),
    };
    let node0 = dev.join("nvidia0");
    let dcgm = holders.start("nv-hostengine", &node0);
    let mps = holders.start("nvidia-cuda-mps-server", &node0);
    let persistenced = holders.start("nvidia-persistenced", &node0);
    let holder = |pid, name: &str, kind| Holder {
        pid,
        name: name.into(),
        kind,
    };
    let (h_dcgm, h_mps, h_pers) = (
        holder(dcgm, "nv-hostengine", HolderKind::Foreign),
        holder(mps, "nvidia-cuda-mps-server", HolderKind::OwnMps),
        holder(persistenced, "nvidia-persistenced", HolderKind::Harmless),
    );
    let mut all = vec![h_dcgm.clone(), h_mps.clone(), h_pers.clone()];
    all.sort();
    let listed = backend.snapshot().unwrap();
    assert_eq!(listed.gpus[0].mig.holders, all);
    assert!(listed.gpus[1].mig.holders.is_empty());

    // The driver refuses while DCGM or the MPS server holds the GPU, the change left pending;
    // the persistence daemon does not keep it.
    let e = backend.set_mig_mode(&uuid(0), true).unwrap_err();
    let mut blocking = vec![h_dcgm.clone(), h_mps.clone()];
    blocking.sort();
    let pids: Vec<u32> = blocking.iter().map(|h| h.pid).collect();
    assert!(
        matches!(&e, Error::InUse { processes, holders, .. } if processes == &pids && holders == &blocking),
        "{e:?}"
    );
    assert!(
        e.to_string().contains(&format!("{dcgm} (nv-hostengine)")),
        "{e}"
    );
    assert_eq!(backend.snapshot().unwrap().gpus[0].mig.pending, Some(true));
    holders.stop(dcgm);
    assert!(matches!(
        backend.set_mig_mode(&uuid(0), true),
        Err(Error::InUse { processes, .. }) if processes == [mps]
    ));
    holders.stop(mps);
    // A passthrough Hopper switches at once; its minor changes (0 ^ 64).
    assert_eq!(
        backend.set_mig_mode(&uuid(0), true).unwrap(),
        MigModeChange::Applied
    );
    let g0 = backend.snapshot().unwrap().gpus[0].clone();
    assert!(g0.mig.enabled);
    assert_eq!(g0.mig.pending, None);
    assert_eq!(g0.minor, 64);
    // The persistence daemon holds the old node, no longer this GPU's.
    assert_eq!(g0.mig.holders, []);

    // A passthrough Ampere records the change and needs a reset; so does the Hopper whose
    // hypervisor says so. Neither withdraws it: one more request, for the current mode, does.
    for i in [1, 2] {
        let e = backend.set_mig_mode(&uuid(i), true).unwrap_err();
        assert!(
            matches!(
                e,
                Error::ResetRequired {
                    current: false,
                    pending: true,
                    ..
                }
            ),
            "GPU {i}: {e:?}"
        );
        let g = backend.snapshot().unwrap().gpus[i].clone();
        assert_eq!(
            (g.mig.enabled, g.mig.pending, g.minor),
            (false, Some(true), i as u32)
        );
        assert_eq!(
            backend.set_mig_mode(&uuid(i), false).unwrap(),
            MigModeChange::Unchanged
        );
        assert_eq!(backend.snapshot().unwrap().gpus[i].mig.pending, None);
    }
    hooks.set_reset_required(2, false);
    assert_eq!(
        backend.set_mig_mode(&uuid(2), true).unwrap(),
        MigModeChange::Applied
    );
    hooks.set_reset_required(2, true);
    assert!(matches!(
        backend.set_mig_mode(&uuid(2), false),
        Err(Error::ResetRequired { .. })
    ));

    // Minors change each way: 3, 67, 3.
    backend.set_mig_mode(&uuid(3), true).unwrap();
    assert_eq!(backend.snapshot().unwrap().gpus[3].minor, 67);
    backend.set_mig_mode(&uuid(3), false).unwrap();
    assert_eq!(backend.snapshot().unwrap().gpus[3].minor, 3);
    backend.set_mig_mode(&uuid(3), true).unwrap();
    println!("{DONE}");
}

#[test]
fn holders_passthrough_and_minors_on_the_fake() {
    if std::env::var(HOLDERS_CHILD).is_ok() || std::env::var(CHILD).is_ok() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let dev = dir.path().join("dev");
    run_child(
        HOLDERS_CHILD,
        "child_holders_passthrough_and_minors",
        dir.path(),
        CLOUD,
        &[
            ("FAKE_NVML_STATE", state.as_ref()),
            ("FAKE_NVML_DEV_DIR", dev.as_ref()),
            ("FAKE_NVML_MINOR_XOR", "64".as_ref()),
            ("FAKE_NVML_RESET_REQUIRED", "2".as_ref()),
            ("FAKE_NVML_VIRTUALIZATION", "passthrough".as_ref()),
            ("FAKE_NVML_IDLE", "1".as_ref()),
        ],
    );
    // The GPUs keep what the switches did beyond the process: modes and minors.
    assert_eq!(
        fake_nvml::state::minors(&state),
        [(0, 64), (1, 1), (2, 66), (3, 67)]
    );
    assert_eq!(
        fake_nvml::state::mig_modes(&state),
        [(0, 1, 1), (1, 0, 0), (2, 1, 0), (3, 1, 1)]
    );
}

const IN_USE_CHILD: &str = "NVDRA_TEST_MIG_IN_USE_CHILD";

impl Hooks {
    fn set_in_use_as_return(&self, on: bool) {
        // SAFETY: the hook's C signature as the fake's `mig_mode.rs` declares it.
        let f: libloading::Symbol<extern "C" fn(i32) -> u32> =
            unsafe { self.0.get(b"fake_nvml_set_in_use_as_return") }.unwrap();
        assert_eq!(f(i32::from(on)), 0);
    }
}

/// NVML answers a GPU that is not idle with IN_USE in either of two forms: the activation status
/// (nvml.h) or, on some drivers, the call's own return code. The child starts with the second
/// (`FAKE_NVML_IN_USE_AS_RETURN=1`) and switches the fake to the first: each refusal nvdra
/// reports is the same in both, holders and processes named, the change left pending for the
/// caller to withdraw.
#[test]
fn child_in_use_both_forms() {
    use nvdra::inventory::{Holder, HolderKind};
    use nvml_wrapper::error::NvmlError;
    use nvml_wrapper_sys::bindings::nvmlReturn_enum_NVML_ERROR_IN_USE as IN_USE;
    if std::env::var(IN_USE_CHILD).is_err() {
        return;
    }
    let dev = std::path::PathBuf::from(std::env::var("FAKE_NVML_DEV_DIR").unwrap());
    let (_dirs, backend, hooks) = fake_backend(Some(&dev));
    let inv = backend.snapshot().unwrap();
    let uuid = |i: usize| inv.gpus[i].uuid.clone();

    // GPU 0: DCGM holds its device file; GPU 3: its process runs.
    let mut holders = Holders {
        dir: tempfile::tempdir().unwrap(),
        running: Vec::new(),
    };
    let dcgm = holders.start("nv-hostengine", &dev.join("nvidia0"));
    hooks.set_idle(3, false);

    // What NVML itself answers, in the form the environment picked, then in the other.
    let raw = |i: u32| {
        backend
            .nvml()
            .device_by_index(i)
            .unwrap()
            .set_mig_mode(true)
    };
    assert!(matches!(raw(0), Err(NvmlError::InUse)), "{:?}", raw(0));
    hooks.set_in_use_as_return(false);
    assert_eq!(raw(0).unwrap(), IN_USE);
    // Withdrawn again: each form below starts from no change pending.
    for i in [0, 3] {
        assert_eq!(
            backend.set_mig_mode(&uuid(i), false).unwrap(),
            MigModeChange::Unchanged
        );
    }

    let mut outcomes = Vec::new();
    for as_return in [true, false] {
        hooks.set_in_use_as_return(as_return);
        let mut seen = Vec::new();
        for i in [0, 3] {
            let e = backend.set_mig_mode(&uuid(i), true).unwrap_err();
            assert!(matches!(&e, Error::InUse { .. }), "GPU {i}: {e:?}");
            assert!(matches!(e, Error::InUse { .. }), "{e:?}");
            let pending = backend.snapshot().unwrap().gpus[i].mig.pending;
            assert_eq!(pending, Some(true), "GPU {i}, as return code: {as_return}");
            assert_eq!(
                backend.set_mig_mode(&uuid(i), false).unwrap(),
                MigModeChange::Unchanged
            );
            assert_eq!(backend.snapshot().unwrap().gpus[i].mig.pending, None);
            seen.push((format!("{e:?}"), e.to_string()));
            if i == 0 {
                let h_dcgm = Holder {
                    pid: dcgm,
                    name: "nv-hostengine".into(),
                    kind: HolderKind::Foreign,
                };
                assert!(
                    matches!(&e, Error::InUse { processes, holders, .. }
                        if processes == &[dcgm] && holders == std::slice::from_ref(&h_dcgm)),
                    "{e:?}"
                );
            } else {
                assert!(
                    matches!(&e, Error::InUse { processes, .. } if !processes.is_empty()),
                    "{e:?}"
                );
            }
        }
        outcomes.push(seen);
    }
    assert_eq!(outcomes[0], outcomes[1]);
    println!("{DONE}");
}

#[test]
fn in_use_as_return_code_on_the_fake() {
    if std::env::var(IN_USE_CHILD).is_ok()
        || std::env::var(HOLDERS_CHILD).is_ok()
        || std::env::var(CHILD).is_ok()
    {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let dev = dir.path().join("dev");
    run_child(
        IN_USE_CHILD,
        "child_in_use_both_forms",
        dir.path(),
        CLOUD,
        &[
            ("FAKE_NVML_DEV_DIR", dev.as_ref()),
            ("FAKE_NVML_IDLE", "1".as_ref()),
            ("FAKE_NVML_IN_USE_AS_RETURN", "1".as_ref()),
        ],
    );
}
