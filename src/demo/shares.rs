//! The demo's fractional GPU: two pods, each with a claim from the template of
//! `manifests/examples/gpu-share-20gi.yaml` (class `gpu.nvidia.com`, 20Gi of memory), and a
//! third with a burstable claim from `manifests/examples/gpu-share-burst.yaml` (20Gi counted,
//! up to 40Gi used), allocated as `nvdra match` allocates them one after another — all on
//! `gpu-0`, which `--shared-capacity` publishes allocatable many times, the burstable one packed
//! by its 20Gi — and prepared: one MPS daemon for the GPU, run by `nvdra mps-host` beside the
//! plugin, each claim's CDI spec with its own pinned device memory limit (the burstable one's
//! from its burst). The GPUs are simulated, so the daemon is the stand-in for
//! `nvidia-cuda-mps-control` (`nvdra mps-standin`), which records its starts and quits.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::resource::v1::{
    DeviceAllocationConfiguration, DeviceRequestAllocationResult, ResourceSlice,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use super::{DRIVER, DraClient, NAMESPACE, prepare, unprepare};
use crate::matching;

const EXAMPLE: &str = include_str!("../../manifests/examples/gpu-share-20gi.yaml");
const BURST_EXAMPLE: &str = include_str!("../../manifests/examples/gpu-share-burst.yaml");

/// The pods' claims: (name, uid, the template it is made from).
const CLAIMS: [(&str, &str, &str); 3] = [
    ("gpu-share-20gi-1", "uid-share-1", "gpu-share-20gi"),
    ("gpu-share-20gi-2", "uid-share-2", "gpu-share-20gi"),
    ("gpu-share-burst", "uid-share-burst", "gpu-share-burst"),
];

/// The stand-in for the driver's MPS (`nvdra mps-standin`: a control daemon, servers and
/// clients as real processes on unix sockets) under `driver_root`, logging to
/// `<driver_root>/mps.log`, and `nvdra mps-host` running its daemons under `mps_root`, as the
/// MPS host's DaemonSet does beside the plugin on a node. The host dies with the returned child.
pub fn start_mps_host(driver_root: &Path, mps_root: &Path) -> Result<Child> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let nvdra = std::env::current_exe().context("cannot find the nvdra binary")?;
    let bin = driver_root.join("usr/bin");
    std::fs::create_dir_all(&bin).with_context(|| format!("cannot create {}", bin.display()))?;
    let script = format!(
        "#!/bin/sh\n# nvdra demo: a stand-in for the driver's MPS control on simulated GPUs.\n\
         STANDIN_LOG='{log}' exec '{nvdra}' mps-standin \"$@\"\n",
        log = driver_root.join("mps.log").display(),
        nvdra = nvdra.display()
    );
    let path = bin.join(crate::dra::mps::CONTROL);
    std::fs::write(&path, script).with_context(|| format!("cannot write {}", path.display()))?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))?;
    // A private /dev/shm per daemon needs CAP_SYS_ADMIN; a demo run by a user shares the host's.
    let root = std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0);
    let mut host = Command::new(nvdra)
        .arg("mps-host")
        .arg("--mps-root")
        .arg(mps_root)
        .arg("--driver-root")
        .arg(driver_root)
        .env("NVDRA_MPS_PRIVATE_SHM", root.to_string())
        .env("NVDRA_LOG", "error")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .context("cannot start nvdra mps-host")?;
    // Ready once it recorded the boot.
    let start = Instant::now();
    while !mps_root.join("boot_id").exists() {
        if let Some(status) = host.try_wait()? {
            anyhow::bail!("nvdra mps-host exited: {status}");
        }
        ensure!(
            start.elapsed() < Duration::from_secs(10),
            "nvdra mps-host did not start within 10 s"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(host)
}

pub async fn run(
    out: &mut (dyn Write + Send),
    root: &Path,
    dra: &mut DraClient,
    slices: &[ResourceSlice],
    step: u32,
) -> Result<()> {
    // The scheduler's part: each pod's claim from the template, allocated in turn.
    let mut objects = matching::Objects::default();
    matching::input::read_text(Path::new("gpu-share-20gi.yaml"), EXAMPLE, &mut objects)?;
    matching::input::read_text(
        Path::new("gpu-share-burst.yaml"),
        BURST_EXAMPLE,
        &mut objects,
    )?;
    let claims = CLAIMS
        .iter()
        .map(|(name, _, template)| {
            let template = objects
                .claims
                .iter()
                .find(|c| c.name == *template)
                .with_context(|| format!("the examples have no claim template {template}"))?;
            Ok(matching::ClaimInput {
                kind: "ResourceClaim",
                name: name.to_string(),
                spec_path: "spec",
                ..template.clone()
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let env = crate::cel::Environment::new();
    let classes = matching::compile_classes(&objects.classes)?;
    let node = matching::Node::from_slices(&env, slices)?;
    let reports = matching::explain_all(&env, &claims, &classes, &node)?;
    writeln!(
        out,
        "{step}. Two pods share one GPU by memory: each gets a claim from gpu-share-20gi \
         (class gpu.nvidia.com, memory 20Gi); a third's claim from gpu-share-burst asks 20Gi \
         that may burst to 40Gi (its GpuConfig's defaultPinnedDeviceMemoryLimit), and is \
         packed by its 20Gi. Allocated as `nvdra match` does:"
    )?;
    for (i, ((report, claim), (name, uid, _))) in
        reports.iter().zip(&claims).zip(CLAIMS).enumerate()
    {
        let picked = match (&report.allocation, report.satisfiable) {
            (Some(a), true) => a.first().context("an empty allocation")?,
            _ => anyhow::bail!(
                "the demo's share {name} does not fit: {}",
                report.reason.as_deref().unwrap_or("?")
            ),
        };
        let consumed: BTreeMap<String, Quantity> = picked
            .consumed_capacity
            .iter()
            .map(|(k, v)| (k.clone(), Quantity(v.clone())))
            .collect();
        let result = DeviceRequestAllocationResult {
            // The scheduler makes a random UUID; the demo's are fixed.
            share_id: Some(format!("5f0e0000-0000-4000-8000-00000000000{}", i + 1)),
            consumed_capacity: Some(consumed),
            ..crate::api::allocated_device(
                &picked.request,
                &picked.driver,
                &picked.pool,
                &picked.device,
            )
        };
        // The scheduler copies the claim's configs into the allocation (the burst limit of
        // gpu-share-burst is one), where prepare reads them.
        let config = claim
            .spec
            .devices
            .iter()
            .flat_map(|d| d.config.iter().flatten())
            .map(|c| DeviceAllocationConfiguration {
                source: "FromClaim".into(),
                requests: c.requests.clone(),
                opaque: c.opaque.clone(),
            })
            .collect();
        let claim = crate::api::allocated_claim(NAMESPACE, name, uid, vec![result], config);
        crate::api::dir::write_claim(&root.join("api"), &claim)?;
        let mut taken: Vec<String> = picked
            .consumed_capacity
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect();
        if let Some(limit) = &picked.burst_limit {
            taken.push(format!("may burst to {limit}"));
        }
        writeln!(
            out,
            "   {NAMESPACE}/{name} -> {} ({})",
            picked.device,
            taken.join(", ")
        )?;
    }
    let device = |r: &matching::ClaimReport| r.allocation.as_ref().map(|a| a[0].device.clone());
    ensure!(
        reports.iter().all(|r| device(r) == device(&reports[0])),
        "the shares landed on different devices"
    );

    // The kubelet's part: prepare all three; each CDI spec carries its own limits.
    writeln!(out, "   The kubelet prepares them:")?;
    for (name, uid, template) in CLAIMS {
        let r = prepare(dra, name, uid).await?;
        ensure!(
            r.error.is_empty(),
            "preparing {NAMESPACE}/{name} failed: {}",
            r.error
        );
        let spec_path = root
            .join("cdi")
            .join(format!("k8s.{DRIVER}-claim_{uid}.yaml"));
        let spec = std::fs::read_to_string(&spec_path)
            .with_context(|| format!("prepare wrote no CDI spec at {}", spec_path.display()))?;
        let env_line = |key: &str| -> Result<String> {
            spec.lines()
                .map(|l| l.trim().trim_start_matches("- ").trim_matches('"'))
                .find(|l| l.starts_with(key))
                .map(String::from)
                .with_context(|| format!("the CDI spec of {name} has no {key}"))
        };
        // No SM cap: the claim asked for no multiprocessors and its config sets none.
        ensure!(
            !spec.contains("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE="),
            "the CDI spec of {name} caps the SMs, which the claim did not ask"
        );
        let limit = env_line("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=")?;
        if template == "gpu-share-burst" {
            // The simulated driver does not partition memory per cgroup: the per-process limit
            // is its only cap, so it carries the burst.
            writeln!(
                out,
                "   {NAMESPACE}/{name}: {limit} (its 40Gi burst limit less its part of what MPS \
                 itself takes: the hard limit, per CUDA process here; where the driver \
                 partitions memory its container also gets soft 20Gi, hard 40Gi), no SM cap",
            )?;
        } else {
            writeln!(
                out,
                "   {NAMESPACE}/{name}: {limit} (20Gi less its part of what MPS itself takes), no \
                 SM cap",
            )?;
        }
    }
    let log = root.join("driver/mps.log");
    let started = std::fs::read_to_string(&log).unwrap_or_default();
    ensure!(
        started.lines().filter(|l| l.starts_with("start")).count() == 1,
        "not one MPS daemon for the GPU: {started:?}"
    );
    writeln!(
        out,
        "   One MPS control daemon serves the GPU's shares ({}).",
        started.trim()
    )?;
    for (name, uid, _) in CLAIMS {
        let e = unprepare(dra, name, uid).await?;
        ensure!(e.is_empty(), "unpreparing {NAMESPACE}/{name} failed: {e}");
    }
    // The host notices the release on its next scan, quits the daemon and removes its
    // directory.
    let start = Instant::now();
    loop {
        let stopped = std::fs::read_to_string(&log).unwrap_or_default();
        if stopped
            .lines()
            .last()
            .is_some_and(|l| l.starts_with("quit"))
        {
            break;
        }
        ensure!(
            start.elapsed() < Duration::from_secs(10),
            "the MPS daemon was not stopped: {stopped:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    writeln!(
        out,
        "   All unprepared: the MPS host has the daemon quit after the last share.\n"
    )?;
    Ok(())
}
