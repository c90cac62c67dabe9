//! The MPS start gate with a real container engine: a share's container is started and
//! restarted by podman (runc), whose `createRuntime` hook is the `nvdra mps-gate` that the plugin
//! wrote into the claim's CDI spec. The container runs the stand-in CUDA process, which, as CUDA
//! does, falls back to a plain context when no MPS daemon answers; the GPU is in
//! `EXCLUSIVE_PROCESS` (the stand-in's `STANDIN_GPU_DIR`).
//!
//! The daemon is SIGKILLed and cannot come back for a while (`STANDIN_START_FAILS_WHILE`): the
//! container's process fails with its server, and a restart of the container meanwhile does not
//! start — the runtime shows the gate's reason — instead of running outside MPS. Once the daemon
//! is back the container starts and connects through MPS. Then the MPS host itself is replaced
//! without a drain (SIGKILLed, its daemons with it): the same, until a new host runs. No CUDA
//! process of the test ever runs outside MPS.
//!
//! Needs root, podman, runc and busybox-static (see `.ci/run`); skips without them unless
//! `NVDRA_REQUIRE_PODMAN` is set.

use crate::support;
use crate::support::podman as engine;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use engine::*;
use support::dra::{prepare_at, wait_ready_at};
use support::mps;

const DRIVER: &str = "podman-gate.nvdra.io";
const NODE: &str = "node-a";

#[test]
fn a_share_container_restarted_while_its_daemon_is_down_does_not_start_until_it_is_back() {
    with_engine(check_gate);
}

/// Polls `f` every 200 ms for up to `secs` seconds.
fn until(what: &str, secs: u64, mut f: impl FnMut() -> Result<bool>) -> Result<()> {
    let start = Instant::now();
    while !f()? {
        if start.elapsed() > Duration::from_secs(secs) {
            bail!("never: {what}");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    Ok(())
}

fn check_gate(engine: &Engine) -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let root = tmp.path();
    let driver_root = root.join("driver");
    mps::install_standin(&driver_root);
    let gpu = nvdra::inventory::topology::load_profile("dgx-h100", NODE)?.gpus[0].clone();
    for node in [format!("dev/nvidia{}", gpu.minor), "dev/nvidiactl".into()] {
        mknod(&driver_root.join(node))?;
    }
    // The driver's binaries beside the MPS ones: a share gets the former only.
    std::fs::write(driver_root.join("usr/bin/nvidia-smi"), "fake nvidia-smi\n")?;
    std::fs::write(
        driver_root.join("usr/bin/nvidia-cuda-mps-server"),
        "fake server\n",
    )?;
    let uid = format!("gate-{:012x}", rand::random::<u64>() >> 16);
    let device = format!("gpu-{}", gpu.minor);
    mps::write_share_claim(
        &root.join("api"),
        DRIVER,
        NODE,
        &uid,
        &device,
        "5f0e0000-0000-4000-8000-000000000001",
        "24Gi",
    );
    let cdi_root = if engine.has_spec_dir_flag {
        root.join("cdi")
    } else {
        PathBuf::from(SYSTEM_CDI_DIR)
    };
    // The GPU's compute mode and the daemon's restarts, as the stand-in models them.
    let gpu_state = root.join("gpu-state");
    std::fs::create_dir_all(&gpu_state)?;
    let blocked = root.join("daemon-cannot-start");
    let (gpu_env, blocked_env) = (
        gpu_state.display().to_string(),
        blocked.display().to_string(),
    );
    let mps_root = root.join("mps");
    std::fs::write(root.join("boot_id"), "boot-1\n")?;
    let host_env = [
        ("STANDIN_GPU_DIR", gpu_env.as_str()),
        ("STANDIN_START_FAILS_WHILE", blocked_env.as_str()),
        ("NVDRA_MPS_HOST_PROBE_INTERVAL", "200ms"),
    ];
    let start_host = || mps::Host::start(&mps_root, &driver_root, &root.join("boot_id"), &host_env);
    let mut host = Some(start_host());
    let mut plugin = support::daemon::nvdra_run(root, "dra", NODE)
        .args(["--profile", "dgx-h100", "--driver-name", DRIVER])
        .args(["--shared-capacity", "--pod-uid", "pod-1"])
        .arg("--cdi-root")
        .arg(&cdi_root)
        .spawn()
        .context("cannot start nvdra run")?;
    let name = format!("nvdra-gate-{}", std::process::id());
    let spec_file = cdi_root.join(format!("k8s.{DRIVER}-claim_{uid}.yaml"));

    let result = (|| -> Result<()> {
        let rt = tokio::runtime::Runtime::new()?;
        let kubelet = root.join("kubelet");
        rt.block_on(wait_ready_at(
            &kubelet.join(format!("plugins_registry/{DRIVER}-pod-1-reg.sock")),
            &mut plugin,
        ));
        let dra = kubelet.join(format!("plugins/{DRIVER}/dra-pod-1.sock"));
        let prepared = rt.block_on(prepare_at(&dra, &uid))?;
        ensure!(prepared.error.is_empty(), "prepare: {}", prepared.error);
        let id = prepared
            .devices
            .first()
            .and_then(|d| d.cdi_device_ids.first())
            .context("no CDI id")?
            .clone();
        let spec = std::fs::read_to_string(&spec_file)?;
        ensure!(
            spec.contains("createRuntime") && spec.contains("mps-gate"),
            "the share's spec has no start gate:\n{spec}"
        );
        let parsed: nvdra::cdi::Spec = nvdra::yaml::from_str(&spec)?;
        let mounts: Vec<&str> = std::iter::once(&parsed.container_edits)
            .chain(parsed.devices.iter().map(|d| &d.container_edits))
            .flat_map(|e| &e.mounts)
            .map(|m| m.container_path.as_str())
            .collect();
        ensure!(
            mounts.contains(&"/usr/bin/nvidia-smi")
                && !mounts.iter().any(|m| m.contains("nvidia-cuda-mps")),
            "the share's container gets the MPS control client (or no driver binaries): \
             {mounts:?}"
        );

        // The container runs the stand-in CUDA process (nvdra, with the host's C library).
        let nvdra = env!("CARGO_BIN_EXE_nvdra");
        let libs = std::fs::canonicalize("/lib/x86_64-linux-gnu")?;
        let loader = std::fs::canonicalize("/lib64/ld-linux-x86-64.so.2")?;
        let dir_arg = cdi_root.display().to_string();
        let global: Vec<&str> = if engine.has_spec_dir_flag {
            vec!["--cdi-spec-dir", &dir_arg]
        } else {
            vec![]
        };
        let vol = |host: &Path, ctr: &str| format!("{}:{ctr}:ro", host.display());
        let (v_nvdra, v_libs, v_loader, v_gpu) = (
            vol(Path::new(nvdra), "/nvdra"),
            vol(&libs, "/lib/x86_64-linux-gnu"),
            vol(&loader, "/lib64/ld-linux-x86-64.so.2"),
            format!("{gpu_env}:{gpu_env}"),
        );
        let env_gpu = format!("STANDIN_GPU_DIR={gpu_env}");
        let out = podman(
            &global,
            &[
                "run",
                "-d",
                "--name",
                &name,
                "--network",
                "none",
                "--device",
                &id,
                "-v",
                &v_nvdra,
                "-v",
                &v_libs,
                "-v",
                &v_loader,
                "-v",
                &v_gpu,
                "-e",
                &env_gpu,
                IMAGE,
                "/nvdra",
                "mps-standin",
                "cuda-client",
            ],
        )?;
        ok(&out, "podman run -d (the share's container)")?;
        let logs = || -> Result<String> {
            let out = podman(&global, &["logs", &name])?;
            Ok(format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ))
        };
        let connected = |n: usize| move |l: &str| l.matches("connected server=").count() >= n;
        until(
            "the container's CUDA process connects through MPS",
            60,
            || Ok(connected(1)(&logs()?)),
        )?;

        // The daemon is SIGKILLed and cannot start again for now.
        std::fs::write(&blocked, "")?;
        let dir = mps::gpu_dir(&mps_root, gpu.uuid.as_str());
        let first = mps::daemon_pids(&dir);
        ensure!(first.len() == 1, "daemons {first:?}");
        let killed = std::process::Command::new("kill")
            .args(["-KILL", &first[0].to_string()])
            .status()?;
        ensure!(killed.success());
        let running = || -> Result<bool> {
            let out = podman(&global, &["inspect", "-f", "{{.State.Running}}", &name])?;
            Ok(ok(&out, "podman inspect")?.trim() == "true")
        };
        until("the container's process fails with its server", 60, || {
            Ok(!running()?)
        })?;

        // Restarted while the daemon is down: the gate refuses, the container does not run.
        let out = podman(&global, &["start", &name])?;
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        ensure!(
            !out.status.success() && err.contains("does not answer"),
            "a restart while the daemon is down: {:?}\n{err}",
            out.status
        );
        ensure!(!running()?, "the container runs while its daemon is down");

        // The daemon can start again: the host brings it back, and the container starts (the
        // kubelet retries a container that failed to start, with its back-off).
        std::fs::remove_file(&blocked)?;
        until("the restarted container connects through MPS", 90, || {
            let out = podman(&global, &["start", &name])?;
            Ok(out.status.success() && connected(2)(&logs()?))
        })?;
        let text = logs()?;
        ensure!(
            !text.contains("plain-context"),
            "a CUDA process ran outside MPS:\n{text}"
        );
        let now = mps::daemon_pids(&dir);
        ensure!(
            now.len() >= 2 && now.last() != first.first(),
            "a new daemon serves: {first:?} then {now:?}"
        );

        // The MPS host itself is replaced without a drain (SIGKILLed: its daemons die with it):
        // the container fails, does not start again while no host runs, and starts once a new
        // host brought the daemon back.
        drop(host.take());
        until("the container's process fails with its host", 60, || {
            Ok(!running()?)
        })?;
        let out = podman(&global, &["start", &name])?;
        ensure!(
            !out.status.success()
                && String::from_utf8_lossy(&out.stderr).contains("does not answer"),
            "a restart while no MPS host runs: {:?}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        host = Some(start_host());
        until(
            "the container connects through the new host's daemon",
            90,
            || {
                let out = podman(&global, &["start", &name])?;
                Ok(out.status.success() && connected(3)(&logs()?))
            },
        )?;
        let logs = logs()?;
        ensure!(
            !logs.contains("plain-context"),
            "a CUDA process ran outside MPS:\n{logs}"
        );
        drop(host);
        Ok(())
    })();

    let _ = podman(&[], &["rm", "-f", &name]);
    let _ = std::process::Command::new("kill")
        .args(["-TERM", &plugin.id().to_string()])
        .status();
    let _ = plugin.wait();
    let _ = std::fs::remove_file(&spec_file);
    result
}
