//! The prepared device check (`tests/device/mps-limits.sh`) run here end to end, on stand-ins:
//! `nvidia-smi` a script that answers the queries the check makes, `nvidia-cuda-mps-control` the
//! MPS stand-in (a daemon that listens and quits), and no GPU, so every client case reports why
//! it has no result. What is checked is the check itself: that it starts the daemon
//! and stops it again, runs each key form with its environment, writes a report that parses,
//! and exits 0 with the GPU's settings as they were. Its figures only mean something on a GPU.
//!
//! Needs bash and python3 (both in CI's image).

mod support;

use std::os::unix::fs::PermissionsExt;
use std::process::Command;

use serde_json::Value;
use support::mps;

const UUID: &str = "GPU-11111111-2222-3333-4444-555555555555";

#[test]
fn the_mps_limits_check_starts_and_stops_its_daemon_and_reports_every_case() {
    let dir = tempfile::tempdir().unwrap();
    let driver = dir.path().join("driver");
    mps::install_standin(&driver);
    let smi = driver.join("usr/bin/nvidia-smi");
    std::fs::write(
        &smi,
        format!(
            "#!/bin/sh\ncase \"$*\" in\n\
             *query-gpu=uuid*) echo {UUID};;\n\
             *mig.mode.current*) echo Disabled;;\n\
             *compute_mode*) echo Default;;\n\
             *memory.total*) echo 81559;;\n\
             *memory.used*) echo 0;;\n\
             *driver_version*) echo 580.159.03;;\n\
             esac\n"
        ),
    )
    .unwrap();
    std::fs::set_permissions(&smi, std::fs::Permissions::from_mode(0o755)).unwrap();
    let path = format!(
        "{}:{}",
        driver.join("usr/bin").display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let out = Command::new("bash")
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/device/mps-limits.sh"
        ))
        .env("PATH", path)
        .env("OUT", dir.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{}\n{stdout}\n{stderr}", out.status);
    assert!(
        stdout.contains("MPS control daemon answers"),
        "{stdout}\n{stderr}"
    );
    assert!(
        stdout.contains("after: MIG mode Disabled, compute mode Default"),
        "{stdout}"
    );

    let report: Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("mps-limits.json")).unwrap())
            .unwrap_or_else(|e| panic!("the report is not JSON ({e}):\n{stdout}"));
    assert_eq!(report["gpu"], UUID);
    let cases = report["cases"].as_object().unwrap();
    for (case, limit, threads) in [
        ("no-limit", "", ""),
        ("uuid-key", &*format!("{UUID}=2048M"), ""),
        ("index-key", "0=2048M", ""),
        ("index-key-gib", "0=2G", ""),
        ("threads-25", "", "25"),
    ] {
        let c = &cases[case];
        assert_eq!(c["limit_env"], limit, "{case}: {c}");
        assert_eq!(c["thread_env"], threads, "{case}: {c}");
        // Without a GPU the client reports why it has no figure (here: no CUDA library at
        // all; on a host with CUDA and no GPU, CUDA's error), never a figure.
        assert!(
            c["error"].is_string() && c.get("allocated_mib").is_none(),
            "{case}: {c}"
        );
    }
    assert_eq!(report["used_mib_with_one_128mib_client"], Value::Null);

    // The daemon it started answered, then quit when asked.
    let log = mps::log(&driver);
    assert_eq!(log.len(), 2, "{log:?}");
    assert!(log[0].starts_with(&format!("start {UUID} ")), "{log:?}");
    assert!(log[1].starts_with("quit "), "{log:?}");
}
