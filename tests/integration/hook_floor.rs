//! `nvdra run` on a node whose NVIDIA Container Toolkit is below 1.17.8 (a stand-in
//! `nvidia-cdi-hook` under the driver root answering `--version` as NVIDIA's does): it warns
//! once at start, naming the version, the CVEs and the fix, and `/metrics` (read by Python's
//! `prometheus_client`, a parser nvdra did not write) says which hooks are left out and why. On
//! 1.17.8 no warning, and only the hook 1.17.8 lacks is left out; from 1.18.0 none. The warning
//! is counted in the process's own stderr.

use crate::support;

use std::io::Read;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use support::promclient::{self, Sample, have_promclient};

const NODE: &str = "node-a";
/// How long the daemon may take to serve `/metrics` (not a speed test).
const WAIT: Duration = Duration::from_secs(60);

/// Starts `nvdra run --mode dra` on simulated GPUs with a stand-in hook of toolkit `version`,
/// scrapes `/metrics` until it names the hook binary, stops the daemon, and returns the
/// samples of the `nvdra_cdi_hook_*` families and the daemon's stderr.
fn start_with_toolkit(version: &str) -> (Vec<Sample>, String) {
    let root = tempfile::tempdir().unwrap();
    let hook = root.path().join("driver/usr/bin/nvidia-cdi-hook");
    std::fs::create_dir_all(hook.parent().unwrap()).unwrap();
    std::fs::write(
        &hook,
        format!(
            "#!/bin/sh\nif [ \"$1\" = --version ]; then \
             printf 'NVIDIA CDI Hook version {version}\\ncommit: 0000000\\n'; exit 0; fi\n\
             cat >/dev/null\n"
        ),
    )
    .unwrap();
    std::fs::set_permissions(&hook, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let mut child: Child = support::daemon::nvdra_run(root.path(), "dra", NODE)
        .args(["--profile", "dgx-h100"])
        .env("NVDRA_LOG", "warn")
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text);
        text
    });
    let addr = support::daemon::metrics_address(child.id()).to_string();
    let deadline = Instant::now() + WAIT;
    let mut last = String::new();
    let samples = loop {
        if let Ok((status, body)) = promclient::get(&addr, "/metrics") {
            assert!(status.contains(" 200 "), "{status}\n{body}");
            let families = promclient::parse(&body);
            let samples: Vec<Sample> = promclient::samples(&families)
                .into_iter()
                .filter(|s| s.name.starts_with("nvdra_cdi_hook_"))
                .collect();
            if samples
                .iter()
                .any(|s| s.name == "nvdra_cdi_hook_toolkit_info")
            {
                break samples;
            }
            last = body;
        }
        if let Ok(Some(status)) = child.try_wait() {
            panic!("nvdra exited with {status}: {}", reader.join().unwrap());
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!(
                "/metrics never named the hook binary within {WAIT:?}:\n{last}\nstderr:\n{}",
                reader.join().unwrap()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let _ = child.kill();
    let _ = child.wait();
    (samples, reader.join().unwrap())
}

fn warnings(stderr: &str) -> Vec<&str> {
    stderr
        .lines()
        .filter(|l| l.contains("WARN") && l.contains("CVE-2025-23266"))
        .collect()
}

#[test]
fn below_1_17_8_nvdra_warns_once_and_says_so_on_metrics() {
    if !have_promclient() {
        return;
    }
    let (samples, stderr) = start_with_toolkit("1.17.7");
    let found = warnings(&stderr);
    assert_eq!(found.len(), 1, "stderr:\n{stderr}");
    for part in [
        "1.17.7",
        "below 1.17.8",
        "CVE-2025-23266",
        "CVE-2025-23267",
        "enable-cuda-compat and update-ldcache",
        "upgrade the NVIDIA Container Toolkit",
    ] {
        assert!(found[0].contains(part), "no {part:?} in {}", found[0]);
    }
    let info: Vec<&Sample> = samples
        .iter()
        .filter(|s| s.name == "nvdra_cdi_hook_toolkit_info")
        .collect();
    assert_eq!(info.len(), 1, "{samples:?}");
    assert_eq!(info[0].labels["version"], "1.17.7");
    assert!(
        info[0].labels["path"].ends_with("/driver/usr/bin/nvidia-cdi-hook"),
        "{info:?}"
    );
    assert_eq!(
        left_out(&samples),
        [
            (
                "disable-device-node-modification",
                "toolkit 1.17.7 below 1.18.0"
            ),
            ("enable-cuda-compat", "toolkit 1.17.7 below 1.17.8"),
            ("update-ldcache", "toolkit 1.17.7 below 1.17.8"),
        ]
    );
}

/// `(hook, reason)` of each `nvdra_cdi_hook_left_out` sample (each 1), sorted.
fn left_out(samples: &[Sample]) -> Vec<(&str, &str)> {
    let mut found: Vec<(&str, &str)> = samples
        .iter()
        .filter(|s| s.name == "nvdra_cdi_hook_left_out")
        .map(|s| {
            assert_eq!(s.value, 1.0, "{s:?}");
            assert_eq!(s.labels.len(), 2, "{s:?}");
            (s.labels["hook"].as_str(), s.labels["reason"].as_str())
        })
        .collect();
    found.sort();
    found
}

fn versions(samples: &[Sample]) -> Vec<&str> {
    samples
        .iter()
        .filter(|s| s.name == "nvdra_cdi_hook_toolkit_info")
        .map(|s| s.labels["version"].as_str())
        .collect()
}

/// 1.17.8 has the fixes: no warning; only disable-device-node-modification (from 1.18.0) is
/// left out. From 1.18.0 nothing is.
#[test]
fn from_1_17_8_nothing_is_warned_and_from_1_18_0_nothing_left_out() {
    if !have_promclient() {
        return;
    }
    let (samples, stderr) = start_with_toolkit("1.17.8");
    assert_eq!(warnings(&stderr), Vec::<&str>::new(), "stderr:\n{stderr}");
    assert_eq!(versions(&samples), ["1.17.8"]);
    assert_eq!(
        left_out(&samples),
        [(
            "disable-device-node-modification",
            "toolkit 1.17.8 below 1.18.0"
        )]
    );
    let (samples, stderr) = start_with_toolkit("1.19.1");
    assert_eq!(warnings(&stderr), Vec::<&str>::new(), "stderr:\n{stderr}");
    assert_eq!(versions(&samples), ["1.19.1"]);
    assert_eq!(left_out(&samples), []);
}
