//! NVLink fabric registrations in transition (NVIDIA's plugin crashed on them, its issue 1264),
//! through the fake NVML's `FAKE_NVML_FABRIC_FILE`: while a GPU's registration is not started,
//! in progress, completed with a not-ready status, or its call answers not ready, nvdra's NVML
//! backend publishes no fabric for it, says so in one log line, fails nothing, and a later read
//! of the same process picks the completed registration up.
//!
//! The fake picks its node when the library initializes, so the reads run in a child: this test
//! binary again, running only [`child_reads_the_fabric_as_it_moves_on`].

use crate::support;

use std::path::Path;
use std::process::Command;

use nvdra::inventory::DeviceBackend;
use nvdra::inventory::nvml::{LIBRARY, NvmlBackend};

/// Set in the child: the fabric file it rewrites.
const CHILD: &str = "NVDRA_TEST_FABRIC_CHILD";

fn driver_root(dir: &Path) {
    let lib_dir = dir.join("usr/lib64");
    std::fs::create_dir_all(&lib_dir).unwrap();
    std::os::unix::fs::symlink(support::fake_nvml::library(), lib_dir.join(LIBRARY)).unwrap();
}

/// The clique of each GPU as read, `None` where no fabric is published.
fn cliques(nvml: &NvmlBackend) -> Vec<Option<u32>> {
    let inv = nvml
        .snapshot()
        .expect("a read in transition still succeeds");
    inv.gpus
        .iter()
        .map(|g| g.fabric.as_ref().map(|f| f.clique_id))
        .collect()
}

#[test]
fn child_reads_the_fabric_as_it_moves_on() {
    let Ok(file) = std::env::var(CHILD) else {
        return;
    };
    let root = tempfile::tempdir().unwrap();
    driver_root(root.path());
    let nvml = NvmlBackend::open(root.path()).unwrap();
    std::fs::write(
        &file,
        "in-progress\ngpu=1 not-started\ngpu=2 state=completed status=not-ready\ngpu=3 call=not-ready\n",
    )
    .unwrap();
    assert_eq!(cliques(&nvml), [None, None, None, None]);
    // The fabric manager completes GPUs 0 and 2; 1 and 3 still move.
    std::fs::write(&file, "gpu=1 in-progress\ngpu=3 call=not-ready\n").unwrap();
    assert_eq!(cliques(&nvml), [Some(2), None, Some(2), None]);
    std::fs::write(&file, "").unwrap();
    assert_eq!(cliques(&nvml), [Some(2); 4]);
    println!("the fabric moved on");
}

#[test]
fn a_registration_in_transition_is_published_on_a_later_read() {
    if std::env::var(CHILD).is_ok() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            &support::test_name(module_path!(), "child_reads_the_fabric_as_it_moves_on"),
            "--nocapture",
        ])
        .env(CHILD, dir.path().join("fabric"))
        .env("FAKE_NVML_FABRIC_FILE", dir.path().join("fabric"))
        .env("FAKE_NVML_PROFILE", "gb200-nvl72")
        // Tray 20: the second clique.
        .env("FAKE_NVML_SEED", "node-20")
        .env_remove("FAKE_NVML_NODE")
        .env_remove("FAKE_NVML_TOPOLOGY")
        .env_remove("FAKE_NVML_STATE")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("the fabric moved on"),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn nvdra_inventory_in_transition_succeeds_and_says_why_there_is_no_fabric() {
    if std::env::var(CHILD).is_ok() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    driver_root(dir.path());
    let fabric = dir.path().join("fabric");
    std::fs::write(&fabric, "in-progress\n").unwrap();
    let run = || {
        let out = Command::new(env!("CARGO_BIN_EXE_nvdra"))
            .args(["inventory", "--node-name", "node-3", "-o", "json"])
            .args(["--backend", "nvml", "--driver-root"])
            .arg(dir.path())
            .env("NVDRA_LOG", "info")
            .env("FAKE_NVML_PROFILE", "gb200-nvl72")
            .env("FAKE_NVML_SEED", "node-3")
            .env("FAKE_NVML_FABRIC_FILE", &fabric)
            .env_remove("NVDRA_CONFIG")
            .env_remove("NVDRA_PROFILE")
            .env_remove("NVDRA_BACKEND")
            .env_remove("FAKE_NVML_NODE")
            .env_remove("FAKE_NVML_STATE")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "{stderr}");
        let inv: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let fabrics: Vec<serde_json::Value> = inv["gpus"]
            .as_array()
            .unwrap()
            .iter()
            .map(|g| g["fabric"].clone())
            .collect();
        (fabrics, stderr)
    };
    let (fabrics, stderr) = run();
    assert!(fabrics.iter().all(|f| f.is_null()), "{fabrics:?}");
    assert!(stderr.contains("in transition"), "{stderr}");
    std::fs::write(&fabric, "completed\n").unwrap();
    let (fabrics, _) = run();
    assert!(fabrics.iter().all(|f| f["cliqueId"] == 1), "{fabrics:?}");
}
