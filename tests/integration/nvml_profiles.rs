//! The NVML backend over the fake library driven by each built-in profile reads back the
//! inventory the simulated backend gives for that profile, field by field.
//!
//! The fake picks its node when the library initializes, from the environment, so each profile
//! is read in a child process: this test binary again, running only
//! [`child_reads_one_profile`] with `FAKE_NVML_PROFILE` set.
//!
//! Three differences are of form, not of fact, and are applied to the expected side: NVSwitches
//! are named in a topology but known by PCI address to NVML (the fake numbers them, see
//! `fake_nvml::profile::switch_bus_id`); NVML lists GPU-instance profiles by its profile index,
//! the catalog in its own order (both sides are sorted by profile id); and the NVML backend
//! lists MIG devices by placement, a topology in the order it names them. PCIe root and NUMA
//! node come from sysfs, which the child lays out from the profile.

use crate::support;

use std::path::Path;
use std::process::Command;

use nvdra::inventory::nvml::{LIBRARY, NvmlBackend};
use nvdra::inventory::sim::SimBackend;
use nvdra::inventory::{DeviceBackend, Inventory, NvLinkPeer, topology};

const NODE: &str = "profile-node";
/// Set in the child: the profile it reads.
const CHILD: &str = "NVDRA_TEST_FAKE_NVML_CHILD";

/// A sysfs tree placing each GPU under its PCIe root with its NUMA node, as the profile says.
fn sysfs_for(inv: &Inventory, root: &Path) {
    let devices = root.join("bus/pci/devices");
    std::fs::create_dir_all(&devices).unwrap();
    for g in &inv.gpus {
        let bus = g.pci_bus_id.as_str();
        let pcie = g.pcie_root.clone().unwrap_or_else(|| "pci0000:ff".into());
        let rel = format!("devices/{pcie}/{pcie}-port/{bus}");
        let dir = root.join(&rel);
        std::fs::create_dir_all(&dir).unwrap();
        if let Some(n) = g.numa_node {
            std::fs::write(dir.join("numa_node"), format!("{n}\n")).unwrap();
        }
        std::os::unix::fs::symlink(format!("../../../{rel}"), devices.join(bus)).unwrap();
    }
}

/// The simulated inventory in NVML's form (see the module doc).
fn as_nvml_reports_it(mut inv: Inventory) -> Inventory {
    let switches = fake_nvml::profile::switch_names(&inv);
    for g in &mut inv.gpus {
        g.mig
            .devices
            .sort_by_key(|m| (m.placement, m.gi_id, m.ci_id));
        g.nvlink_peers = std::mem::take(&mut g.nvlink_peers)
            .into_iter()
            .map(|p| match p {
                NvLinkPeer::Switch(name) => {
                    let ordinal = switches.iter().position(|s| *s == name).unwrap();
                    NvLinkPeer::Switch(fake_nvml::profile::switch_bus_id(ordinal))
                }
                gpu => gpu,
            })
            .collect();
    }
    sorted_profiles(inv)
}

fn sorted_profiles(mut inv: Inventory) -> Inventory {
    for g in &mut inv.gpus {
        g.mig.profiles.sort_by_key(|p| p.gi_profile_id);
    }
    inv
}

/// Runs in the child only (a no-op otherwise): reads the fake through the NVML backend and
/// compares with the simulated backend.
#[test]
fn child_reads_one_profile() {
    let Ok(profile) = std::env::var(CHILD) else {
        return;
    };
    let sim = SimBackend::from_profile(&profile, NODE)
        .unwrap()
        .snapshot()
        .unwrap();
    let driver_root = tempfile::tempdir().unwrap();
    let lib_dir = driver_root.path().join("usr/lib64");
    std::fs::create_dir_all(&lib_dir).unwrap();
    std::os::unix::fs::symlink(support::fake_nvml::library(), lib_dir.join(LIBRARY)).unwrap();
    let sysfs = tempfile::tempdir().unwrap();
    sysfs_for(&sim, sysfs.path());

    let nvml = NvmlBackend::open(driver_root.path())
        .unwrap()
        .with_sysfs_root(sysfs.path());
    let got = sorted_profiles(nvml.snapshot().unwrap());
    let want = as_nvml_reports_it(sim);
    assert_eq!(got.gpus.len(), want.gpus.len(), "{profile}: GPU count");
    for (g, w) in got.gpus.iter().zip(&want.gpus) {
        assert_eq!(g, w, "{profile}: GPU {}", w.index);
    }
    assert_eq!(got, want, "{profile}");
    println!("profile {profile} reads back equal");
}

/// `nvdra inventory -o json` with `args`, as a JSON value.
fn inventory_json(args: &[&str], env: &[(&str, &str)]) -> serde_json::Value {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_nvdra"));
    cmd.args(["inventory", "--node-name", NODE, "-o", "json"])
        .args(args)
        .env("NVDRA_LOG", "error");
    for var in [
        "NVDRA_CONFIG",
        "NVDRA_BACKEND",
        "NVDRA_PROFILE",
        "NVDRA_TOPOLOGY",
        "NODE_NAME",
        "NVIDIA_DRIVER_ROOT",
        "FAKE_NVML_NODE",
        "FAKE_NVML_TOPOLOGY",
        "FAKE_NVML_STATE",
    ] {
        cmd.env_remove(var);
    }
    cmd.envs(env.iter().copied());
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn nvdra_inventory_on_the_fake_equals_the_profile() {
    if std::env::var(CHILD).is_ok() {
        return;
    }
    let driver_root = tempfile::tempdir().unwrap();
    let lib_dir = driver_root.path().join("usr/lib64");
    std::fs::create_dir_all(&lib_dir).unwrap();
    std::os::unix::fs::symlink(support::fake_nvml::library(), lib_dir.join(LIBRARY)).unwrap();
    let root = driver_root.path().to_str().unwrap();
    for name in topology::profile_names() {
        let sim = inventory_json(&["--profile", name], &[]);
        let mut want: Inventory = serde_json::from_value(sim).unwrap();
        want = as_nvml_reports_it(want);
        let nvml = inventory_json(
            &["--backend", "nvml", "--driver-root", root],
            &[("FAKE_NVML_PROFILE", name), ("FAKE_NVML_SEED", NODE)],
        );
        let mut got = sorted_profiles(serde_json::from_value(nvml).unwrap());
        for g in want.gpus.iter_mut().chain(got.gpus.iter_mut()) {
            (g.pcie_root, g.numa_node) = (None, None);
        }
        assert_eq!(got, want, "{name}");
    }
}

#[test]
fn every_builtin_profile_reads_back_equal_through_nvml() {
    if std::env::var(CHILD).is_ok() {
        return;
    }
    let names = topology::profile_names();
    assert!(names.len() >= 7, "{names:?}");
    for name in names {
        let out = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                &support::test_name(module_path!(), "child_reads_one_profile"),
                "--nocapture",
            ])
            .env(CHILD, name)
            .env("FAKE_NVML_PROFILE", name)
            .env("FAKE_NVML_SEED", NODE)
            .env_remove("FAKE_NVML_NODE")
            .env_remove("FAKE_NVML_TOPOLOGY")
            .env_remove("FAKE_NVML_STATE")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains(&format!("profile {name} reads back equal")),
            "{name}:\n{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
