//! The NVML backend end to end against `tests/fake-nvml`, a fake `libnvidia-ml.so`: library
//! loading under a driver root, every NVML call `read_raw` makes (including the raw MIG, NVLink
//! and fabric calls), the mapping to an `Inventory`, and the ResourceSlices `nvdra inventory`
//! computes from it.
//!
//! In this process the fake serves its default three-GPU node. The HGX H100 node with NVSwitches
//! at the invalid PCI address is chosen by `FAKE_NVML_NODE`, which only the `nvdra` child
//! processes get: the library (and so its node) is shared by every test of this process.

mod support;

use std::collections::BTreeMap;
use std::process::Command;

use k8s_openapi::api::resource::v1::{Device, ResourceSlice};
use nvdra::inventory::nvml::{self, CallError, LIBRARY, NvmlBackend, RemoteDevice};
use nvdra::inventory::{DeviceBackend, NODE_NVSWITCHES, NvLinkPeer, Placement, Reconfigure};
use serde_json::Value;

/// A driver root whose `usr/lib64/libnvidia-ml.so.1` is the fake, and a sysfs tree placing the
/// two A100s under `pci0000:00` (NUMA 0) and the L40S under `pci0000:80` (NUMA 1).
struct Node {
    driver_root: tempfile::TempDir,
    sysfs: tempfile::TempDir,
}

fn fake_node() -> Node {
    let driver_root = tempfile::tempdir().unwrap();
    let lib_dir = driver_root.path().join("usr/lib64");
    std::fs::create_dir_all(&lib_dir).unwrap();
    std::os::unix::fs::symlink(support::fake_nvml::library(), lib_dir.join(LIBRARY)).unwrap();

    let sysfs = tempfile::tempdir().unwrap();
    let devices = sysfs.path().join("bus/pci/devices");
    std::fs::create_dir_all(&devices).unwrap();
    for (bus, root, numa) in [
        ("0000:07:00.0", "pci0000:00", "0"),
        ("0000:0f:00.0", "pci0000:00", "0"),
        ("0000:b1:00.0", "pci0000:80", "1"),
    ] {
        let rel = format!("devices/{root}/{root}-port/{bus}");
        let dir = sysfs.path().join(&rel);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("numa_node"), format!("{numa}\n")).unwrap();
        std::os::unix::fs::symlink(format!("../../../{rel}"), devices.join(bus)).unwrap();
    }
    Node { driver_root, sysfs }
}

fn open(node: &Node) -> NvmlBackend {
    NvmlBackend::open(node.driver_root.path())
        .expect("the fake NVML under the driver root loads")
        .with_sysfs_root(node.sysfs.path())
}

#[test]
fn read_raw_captures_every_answer_including_failures() {
    let node = fake_node();
    let backend = open(&node);
    let raw = nvml::read_raw(backend.nvml()).unwrap();
    assert_eq!(raw.driver_version.as_deref(), Ok("550.163.01"));
    assert_eq!(raw.cuda_driver_version, Ok(12040));
    assert_eq!(raw.gpus.len(), 3);
    assert!(raw.unreadable.is_empty());

    let a100 = &raw.gpus[0];
    assert_eq!(a100.pci_bus_id.as_deref(), Ok("00000000:07:00.0"));
    assert_eq!(a100.memory_total_bytes, Ok(40960 << 20));
    assert_eq!(
        a100.attributes.as_ref().err(),
        Some(&CallError::NotSupported)
    );
    // The fake does not export nvmlDeviceGetNumaNodeId, like a driver older than the call.
    assert!(
        matches!(a100.numa_node, Err(CallError::Missing(_))),
        "{:?}",
        a100.numa_node
    );
    // Seven supported profiles out of NVML's 17 indices, each with its placements (read through
    // the raw two-call protocol).
    let profiles: Vec<(u32, u32, usize)> = a100
        .gi_profiles
        .iter()
        .map(|p| {
            (
                p.profile,
                p.info.id,
                p.placements.as_ref().map_or(0, Vec::len),
            )
        })
        .collect();
    assert_eq!(
        profiles,
        [
            (0, 19, 7),
            (1, 14, 3),
            (2, 9, 2),
            (3, 5, 1),
            (4, 0, 1),
            (7, 20, 7),
            (9, 15, 4)
        ]
    );
    // MIG slots 0 and 2 are filled, slot 1 is empty (NotFound) and skipped.
    let slots: Vec<(u32, Result<u32, CallError>)> = a100
        .mig_devices
        .iter()
        .map(|m| (m.slot, m.gi_id.clone()))
        .collect();
    assert_eq!(slots, [(0, Ok(1)), (2, Ok(7))]);
    let gi = a100.mig_devices[1].gpu_instance.clone().unwrap();
    assert_eq!(gi.profile_id, 19);
    assert_eq!(gi.placement, Placement { start: 6, size: 1 });
    // 12 active links, then InvalidArg for links 12..18 is not an error.
    assert_eq!(a100.nvlinks.len(), 12);
    let remote = a100.nvlinks[7].remote_pci.as_ref().unwrap();
    assert_eq!(
        (
            remote.bus_id.as_str(),
            remote.domain,
            remote.bus,
            remote.device
        ),
        ("00000000:02:00.0", 0, 2, 0)
    );
    assert!(!remote.is_sentinel());
    assert_eq!(a100.nvlinks[7].remote_type, Ok(RemoteDevice::Switch));
    // Ampere has no fabric registration: the versioned call answers NotSupported.
    assert_eq!(a100.fabric, Err(CallError::NotSupported));

    let l40s = &raw.gpus[2];
    assert_eq!(l40s.mig_mode, Err(CallError::NotSupported));
    assert!(l40s.gi_profiles.is_empty() && l40s.mig_devices.is_empty());
    assert!(l40s.nvlinks.is_empty());
}

#[test]
fn snapshot_of_the_fake_node() {
    let node = fake_node();
    let backend = open(&node);
    assert_eq!(backend.name(), "nvml");
    let inv = backend.snapshot().unwrap();
    assert_eq!(inv.gpus.len(), 3);

    let g0 = &inv.gpus[0];
    assert_eq!(g0.product_name, "NVIDIA A100-SXM4-40GB");
    assert_eq!(
        (g0.brand.as_deref(), g0.architecture.as_deref()),
        (Some("Nvidia"), Some("Ampere"))
    );
    assert_eq!(g0.cuda_compute_capability.to_string(), "8.0");
    assert_eq!(
        (g0.driver_version.as_str(), g0.cuda_driver_version.as_str()),
        ("550.163.01", "12.4")
    );
    assert_eq!(g0.pci_bus_id.as_str(), "0000:07:00.0");
    assert_eq!(g0.pcie_root.as_deref(), Some("pci0000:00"));
    assert_eq!(g0.numa_node, Some(0));
    assert_eq!(g0.memory_bytes, 40 << 30);
    assert_eq!(g0.multiprocessors, Some(108));
    assert_eq!(g0.fabric, None);
    assert_eq!(g0.nvlink_peers.len(), 6);
    assert!(
        g0.nvlink_peers
            .contains(&NvLinkPeer::Switch("0000:01:00.0".into()))
    );

    assert!(g0.in_mig_mode());
    assert_eq!(g0.mig.memory_slices, 8);
    let profiles: Vec<&str> = g0.mig.profiles.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(
        profiles,
        [
            "1g.5gb",
            "2g.10gb",
            "3g.20gb",
            "4g.20gb",
            "7g.40gb",
            "1g.5gb+me",
            "1g.10gb"
        ]
    );
    let devices: Vec<(&str, &str, u32, u32, u32, u64)> = g0
        .mig
        .devices
        .iter()
        .map(|d| {
            (
                d.uuid.as_str(),
                d.profile.as_str(),
                d.gi_profile_id,
                d.gi_id,
                d.placement.start,
                d.memory_bytes >> 20,
            )
        })
        .collect();
    assert_eq!(
        devices,
        [
            (
                "MIG-f00d0000-0000-5000-8000-000000000001",
                "3g.20gb",
                9,
                1,
                0,
                19968
            ),
            (
                "MIG-f00d0000-0000-5000-8000-000000000007",
                "1g.5gb",
                19,
                7,
                6,
                4864
            ),
        ]
    );
    assert_eq!(g0.mig.devices[0].multiprocessors, 42);

    let g1 = &inv.gpus[1];
    assert!(g1.mig.capable && !g1.mig.enabled && g1.mig.devices.is_empty());

    let g2 = &inv.gpus[2];
    assert_eq!((g2.index, g2.minor), (2, 5));
    assert_eq!(g2.architecture.as_deref(), Some("Ada Lovelace"));
    assert_eq!(g2.multiprocessors, Some(142));
    assert_eq!(
        (g2.pcie_root.as_deref(), g2.numa_node),
        (Some("pci0000:80"), Some(1))
    );
    assert!(!g2.mig.capable);

    // The A100s share the NVSwitch fabric; the L40S is on its own.
    let domains: Vec<u32> = inv.gpus.iter().map(|g| g.nvlink_domain).collect();
    assert_eq!(domains, [0, 0, 2]);
}

// ------------------------------------------------------------------------------------------------
// The HGX H100 node: NVSwitches at the invalid PCI address, fabric registrations, SM counts
// ------------------------------------------------------------------------------------------------

/// `nvdra inventory --backend nvml` against the fake under a driver root, its node chosen by
/// `FAKE_NVML_NODE` (and its fabric API by `FAKE_NVML_FABRIC_API`) in the child only. Returns
/// stdout and stderr.
fn nvdra_inventory(node: &str, fabric_api: &str, output: &str) -> (String, String) {
    let root = fake_node();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_nvdra"));
    cmd.args([
        "inventory",
        "--backend",
        "nvml",
        "--node-name",
        "hgx-1",
        "-o",
        output,
    ])
    .arg("--driver-root")
    .arg(root.driver_root.path());
    for var in [
        "NVDRA_CONFIG",
        "NVDRA_BACKEND",
        "NVDRA_PROFILE",
        "NVDRA_TOPOLOGY",
        "NVDRA_DRIVER_NAME",
        "NVDRA_PARTITIONABLE",
        "NODE_NAME",
        "NVIDIA_DRIVER_ROOT",
        "NVDRA_LOG_FORMAT",
    ] {
        cmd.env_remove(var);
    }
    cmd.env("FAKE_NVML_NODE", node)
        .env("FAKE_NVML_FABRIC_API", fabric_api)
        .env("NVDRA_LOG", "info")
        .env("NVDRA_LOG_FORMAT", "json");
    let out = cmd.output().expect("run nvdra");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    assert!(out.status.success(), "nvdra inventory failed: {stderr}");
    (stdout, stderr)
}

/// The devices of `nvdra inventory -o slices`, by name.
fn published_devices(node: &str, fabric_api: &str) -> (BTreeMap<String, Device>, String) {
    let (yaml, stderr) = nvdra_inventory(node, fabric_api, "slices");
    let mut devices = BTreeMap::new();
    let slices: Vec<ResourceSlice> =
        serde_saphyr::from_str_multiple(&yaml).expect("ResourceSlices");
    for slice in slices {
        for d in slice.spec.devices.into_iter().flatten() {
            devices.insert(d.name.clone(), d);
        }
    }
    (devices, stderr)
}

/// The NVSwitch sentinel test: on an HGX H100 whose every switch link reports the remote PCI
/// address `FFFFFFFF:FF:FF.0` with remote type SWITCH (the bus-id string reading three different
/// ways), all eight GPUs form ONE NVLink domain, as `nvdra inventory` shows and publishes it.
#[test]
fn nvswitch_sentinel_links_form_one_domain() {
    let (json, _) = nvdra_inventory("hgx-h100-sentinel", "v3", "json");
    let inv: Value = serde_json::from_str(&json).expect("inventory JSON");
    let gpus = inv["gpus"].as_array().unwrap();
    assert_eq!(gpus.len(), 8);
    let domains: Vec<u64> = gpus
        .iter()
        .map(|g| g["nvlinkDomain"].as_u64().unwrap())
        .collect();
    assert_eq!(domains, [0; 8], "one domain for the whole baseboard");
    for g in gpus {
        assert_eq!(
            g["nvlinkPeers"],
            serde_json::json!([{"kind": "switch", "id": NODE_NVSWITCHES}]),
            "{}",
            g["uuid"]
        );
    }

    let (devices, _) = published_devices("hgx-h100-sentinel", "v3");
    assert_eq!(devices.len(), 8);
    for (name, d) in &devices {
        let attrs = d.attributes.as_ref().unwrap();
        assert_eq!(attrs["nvlinkDomain"].int, Some(0), "{name}");
    }
}

#[test]
fn completed_fabric_registrations_are_published_through_every_fabric_api() {
    // v3: the driver takes the newest struct; v2: it refuses v3 (as R550 does) and the backend
    // retries with v2; v1: it lacks the versioned call and the backend uses the old one.
    for api in ["v3", "v2", "v1"] {
        let (devices, _) = published_devices("hgx-h100-sentinel", api);
        for minor in 0..8 {
            let name = format!("gpu-{minor}");
            let attrs = devices[&name].attributes.as_ref().unwrap();
            let uuid = attrs
                .get("fabricClusterUUID")
                .and_then(|a| a.string.clone());
            let clique = attrs.get("fabricCliqueID").and_then(|a| a.int);
            if minor < 6 {
                assert_eq!(
                    uuid.as_deref(),
                    Some("6c1f3a52-8d2e-4b7a-9f10-0123456789ab"),
                    "{api} {name}"
                );
                assert_eq!(
                    clique,
                    Some(i64::from(fake_nvml::CLIQUE_ID)),
                    "{api} {name}"
                );
            } else {
                // GPU 6 is still registering, GPU 7 has no fabric support: nothing invented.
                assert_eq!((uuid, clique), (None, None), "{api} {name}");
            }
        }
    }
    let (json, _) = nvdra_inventory("hgx-h100-sentinel", "v3", "json");
    let inv: Value = serde_json::from_str(&json).unwrap();
    assert_eq!(
        inv["gpus"][0]["fabric"],
        serde_json::json!({
            "clusterUuid": "6c1f3a52-8d2e-4b7a-9f10-0123456789ab",
            "cliqueId": fake_nvml::CLIQUE_ID,
        })
    );
    assert!(inv["gpus"][6].get("fabric").is_none());
    let (table, _) = nvdra_inventory("hgx-h100-sentinel", "v3", "table");
    let gpu0 = table.lines().find(|l| l.starts_with("gpu-0 ")).unwrap();
    assert!(
        gpu0.contains("6c1f3a52-8d2e-4b7a-9f10-0123456789ab.32766"),
        "{table}"
    );
}

#[test]
fn sm_counts_nvml_cannot_give_are_omitted_never_zero() {
    let (devices, stderr) = published_devices("hgx-h100-sentinel", "v3");
    let sms = |name: &str| {
        devices[name]
            .capacity
            .as_ref()
            .unwrap()
            .get("multiprocessors")
            .map(|c| c.value.0.clone())
    };
    for minor in 0..6 {
        assert_eq!(
            sms(&format!("gpu-{minor}")).as_deref(),
            Some("132"),
            "from CUDA cores"
        );
    }
    assert_eq!(
        sms("gpu-6").as_deref(),
        Some("132"),
        "no cores, but the device's attributes"
    );
    assert_eq!(sms("gpu-7"), None, "neither: omitted");
    for (name, d) in &devices {
        for (cap, v) in d.capacity.iter().flatten() {
            assert_ne!(v.value.0, "0", "{name} publishes {cap}: 0");
        }
    }
    // Said once, as a warning naming the GPU and the field.
    let omitted: Vec<Value> = stderr
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|e| e["fields"]["field"] == "multiprocessors")
        .collect();
    assert_eq!(omitted.len(), 1, "{stderr}");
    assert_eq!(omitted[0]["level"], "WARN", "{stderr}");
    assert_eq!(omitted[0]["fields"]["gpu.index"], 7, "{stderr}");
    // The default node's slices have no zero SM count either.
    let (devices, _) = published_devices("a100-l40s", "v3");
    for (name, d) in &devices {
        if let Some(c) = d.capacity.as_ref().and_then(|c| c.get("multiprocessors")) {
            assert_ne!(c.value.0, "0", "{name}");
        }
    }
}

/// The deployments give nvdra `CAP_SYS_ADMIN` only with MIG or shares switched on: `nvdra run
/// --partitionable` without it (dropped from the bounding set by util-linux's setpriv, as a
/// container without the capability has it) says so at start and publishes no placement that
/// every prepare would refuse, naming the switch that grants it.
#[test]
fn partitionable_without_cap_sys_admin_is_turned_off_naming_the_switch() {
    use std::io::{BufRead, BufReader};
    if !support::setpriv() {
        return;
    }
    let node = fake_node();
    let sandbox = tempfile::tempdir().unwrap();
    let run = support::daemon::nvdra_run(sandbox.path(), "dra", "node-a");
    let mut cmd = Command::new("setpriv");
    cmd.args(["--bounding-set", "-sys_admin", "--"])
        .arg(run.get_program())
        .args(run.get_args())
        .args(["--backend", "nvml", "--partitionable", "--driver-root"])
        .arg(node.driver_root.path());
    for (k, v) in run.get_envs() {
        match v {
            Some(v) => cmd.env(k, v),
            None => cmd.env_remove(k),
        };
    }
    let mut child = cmd
        .env("NVDRA_LOG", "warn")
        .env("NVDRA_LOG_FORMAT", "plain")
        .env_remove("FAKE_NVML_NODE")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("setpriv runs nvdra");
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut seen = Vec::new();
    let found = loop {
        match rx.recv_timeout(std::time::Duration::from_secs(60)) {
            Ok(line) if line.contains("partitionable mode is off") => break Some(line),
            Ok(line) => seen.push(line),
            Err(_) => break None,
        }
    };
    let _ = child.kill();
    let _ = child.wait();
    let line = found.unwrap_or_else(|| panic!("no warning; stderr:\n{}", seen.join("\n")));
    for want in [
        "CAP_SYS_ADMIN",
        "components/mig-and-shares",
        "migAndShares=true",
    ] {
        assert!(line.contains(want), "no {want:?} in {line}");
    }
}

/// MIG creation through NVML refuses what the GPU cannot do, naming the GPU, and changes
/// nothing; destroying a MIG device that is not there succeeds (rollbacks repeat it). Only
/// failing calls here: the default node is shared by every test of this process.
#[test]
fn mig_creation_refusals_name_the_gpu_and_change_nothing() {
    use nvdra::inventory::{GpuUuid, MigUuid, Reconfiguration};
    let node = fake_node();
    let backend = open(&node);
    assert_eq!(backend.unavailable(Reconfiguration::Mig), None);
    let before = backend.snapshot().unwrap();
    let gpu = |i: usize| GpuUuid(format!("GPU-f00d0000-0000-4000-8000-00000000000{i}"));
    let one_slice = |start| Placement { start, size: 1 };

    // Slices 0-3 hold the 3g.20gb instance.
    let e = backend.create_mig(&gpu(0), 19, one_slice(2)).unwrap_err();
    assert!(
        e.to_string().contains("insufficient resources") && e.to_string().contains(gpu(0).as_str()),
        "{e}"
    );
    // A 1g.5gb is one slice wide: two is no placement of it.
    let e = backend
        .create_mig(&gpu(0), 19, Placement { start: 4, size: 2 })
        .unwrap_err();
    assert!(e.to_string().contains("cannot be placed at 4..6"), "{e}");
    let e = backend.create_mig(&gpu(1), 19, one_slice(0)).unwrap_err();
    assert!(e.to_string().contains("not in MIG mode"), "{e}");
    let e = backend.create_mig(&gpu(2), 19, one_slice(0)).unwrap_err();
    assert!(e.to_string().contains("cannot do MIG"), "{e}");
    let e = backend
        .create_mig(&GpuUuid("GPU-nope".into()), 19, one_slice(0))
        .unwrap_err();
    assert!(e.to_string().contains("GPU-nope"), "{e}");

    backend
        .destroy_mig(&gpu(0), &MigUuid("MIG-not-there".into()))
        .unwrap();
    assert_eq!(backend.snapshot().unwrap(), before);
}

/// The compute mode is read and set through NVML on the whole GPU; an unknown GPU is named.
/// GPU 2 (the L40S) is used by no other test of this process, and is put back.
#[test]
fn compute_mode_is_read_and_set_through_nvml() {
    use nvdra::inventory::{ComputeMode, GpuUuid};
    let node = fake_node();
    let backend = open(&node);
    let gpu = GpuUuid("GPU-f00d0000-0000-4000-8000-000000000002".into());
    assert_eq!(backend.compute_mode(&gpu).unwrap(), ComputeMode::Default);
    for mode in [
        ComputeMode::ExclusiveProcess,
        ComputeMode::Prohibited,
        ComputeMode::Default,
    ] {
        backend.set_compute_mode(&gpu, mode).unwrap();
        assert_eq!(backend.compute_mode(&gpu).unwrap(), mode);
    }
    let nope = GpuUuid("GPU-nope".into());
    let e = backend
        .set_compute_mode(&nope, ComputeMode::ExclusiveProcess)
        .unwrap_err();
    assert!(e.to_string().contains("GPU-nope"), "{e}");
    let e = backend.compute_mode(&nope).unwrap_err();
    assert!(e.to_string().contains("GPU-nope"), "{e}");
}

/// The live readings (`DeviceBackend::usage`) are what the fake answers — its stable
/// `usage::readings` — memory in use included, with the process of the MIG-enabled A100 in its
/// first GPU instance.
#[test]
fn usage_reads_what_the_fake_reports() {
    let node = fake_node();
    let backend = open(&node);
    let usage = backend.usage().unwrap();
    let gpus = fake_nvml::model::a100_l40s();
    assert_eq!(usage.len(), gpus.len());
    for (i, (u, g)) in usage.iter().zip(&gpus).enumerate() {
        let want = fake_nvml::usage::readings(i, g);
        assert_eq!(u.gpu.as_str(), g.uuid);
        assert_eq!(u.memory_total_bytes, g.memory_bytes);
        assert_eq!(u.memory_used_bytes, want.memory_used());
        assert_eq!(u.utilization_percent, Some(want.utilization_gpu));
        assert_eq!(u.memory_utilization_percent, Some(want.utilization_memory));
        assert_eq!(u.power_milliwatts, Some(want.power_milliwatts));
        assert_eq!(u.temperature_celsius, Some(want.temperature_celsius));
        let procs: Vec<(u32, Option<u64>, Option<u32>)> = u
            .processes
            .iter()
            .map(|p| (p.pid, p.used_memory_bytes, p.gpu_instance))
            .collect();
        let expected: Vec<(u32, Option<u64>, Option<u32>)> = want
            .processes
            .iter()
            .map(|p| {
                let gi =
                    (p.gpu_instance != fake_nvml::usage::NO_INSTANCE).then_some(p.gpu_instance);
                (p.pid, Some(p.used_bytes), gi)
            })
            .collect();
        assert_eq!(procs, expected, "GPU {i}");
    }
    // GPU 0 has MIG instances: its process runs in one; the others' do not.
    assert!(usage[0].processes[0].gpu_instance.is_some());
    assert_eq!(usage[1].processes[0].gpu_instance, None);
}

// ------------------------------------------------------------------------------------------------
// Holders
// ------------------------------------------------------------------------------------------------

/// `nvdra inventory --backend nvml -o json` lists the processes holding a GPU's device file
/// (here a DCGM-like `nv-hostengine`, a real process holding the stand-in node under the
/// driver root's `dev/`, where the fake keeps its device files: `FAKE_NVML_DEV_DIR`) and
/// NVML's compute processes only with `--dynamic-mig`; without it the read is as before.
/// nvdra itself, which holds every node through NVML, is none; a GPU without MIG has none
/// read.
#[test]
fn holders_are_read_only_with_dynamic_mig() {
    let root = fake_node();
    let dev = root.driver_root.path().join("dev");
    std::fs::create_dir_all(&dev).unwrap();
    for minor in [0, 5] {
        std::fs::write(dev.join(format!("nvidia{minor}")), "").unwrap();
    }
    let links = tempfile::tempdir().unwrap();
    let sleep = ["/usr/bin/sleep", "/bin/sleep"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists())
        .expect("a sleep binary");
    let link = links.path().join("nv-hostengine");
    std::os::unix::fs::symlink(sleep, &link).unwrap();
    let mut children = Vec::new();
    // GPU 0 (an A100) and GPU 2 (minor 5, an L40S without MIG).
    for minor in [0, 5] {
        let node = std::fs::File::open(dev.join(format!("nvidia{minor}"))).unwrap();
        children.push(Command::new(&link).arg("600").stdin(node).spawn().unwrap());
    }
    let dcgm = children[0].id();
    let holders = |dynamic: bool| -> Vec<Value> {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_nvdra"));
        cmd.args([
            "inventory",
            "--backend",
            "nvml",
            "--node-name",
            "n1",
            "-o",
            "json",
        ])
        .arg("--driver-root")
        .arg(root.driver_root.path());
        if dynamic {
            cmd.arg("--dynamic-mig");
        }
        for var in [
            "NVDRA_CONFIG",
            "NVDRA_BACKEND",
            "NVDRA_PROFILE",
            "NVDRA_TOPOLOGY",
            "NVDRA_DYNAMIC_MIG",
            "NODE_NAME",
            "NVIDIA_DRIVER_ROOT",
            "NVIDIA_DEV_ROOT",
            "FAKE_NVML_NODE",
        ] {
            cmd.env_remove(var);
        }
        let out = cmd.env("FAKE_NVML_DEV_DIR", &dev).output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let inv: Value = serde_json::from_slice(&out.stdout).unwrap();
        inv["gpus"]
            .as_array()
            .unwrap()
            .iter()
            .map(|g| g["mig"]["holders"].clone())
            .collect()
    };
    let with = holders(true);
    let without = holders(false);
    for mut c in children {
        c.kill().unwrap();
        c.wait().unwrap();
    }
    // GPU 0: the fake's process on it (pid 4000, from NVML's compute processes) and DCGM; GPU
    // 1: its process (4001).
    let pids = |h: &Value| -> Vec<(u64, String)> {
        h.as_array()
            .into_iter()
            .flatten()
            .map(|h| (h["pid"].as_u64().unwrap(), h["kind"].to_string()))
            .collect()
    };
    let foreign = "\"foreign\"".to_string();
    // Listed by PID: the DCGM stand-in's PID may be below or above the fake's 4000.
    let mut want = vec![(4000, foreign.clone()), (u64::from(dcgm), foreign.clone())];
    want.sort();
    assert_eq!(pids(&with[0]), want);
    let named = with[0]
        .as_array()
        .into_iter()
        .flatten()
        .find(|h| h["pid"].as_u64() == Some(u64::from(dcgm)))
        .expect("the DCGM stand-in among the holders");
    assert_eq!(named["name"], "nv-hostengine");
    assert_eq!(pids(&with[1]), [(4001, foreign)]);
    assert_eq!(with[2], Value::Null, "no MIG: no holders read");
    assert_eq!(without, [Value::Null, Value::Null, Value::Null]);
}
