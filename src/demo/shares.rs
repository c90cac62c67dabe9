//! The demo's fractional GPU: two pods, each with a claim from the template of
//! `manifests/examples/gpu-share-20gi.yaml` (20Gi of memory and half the compute of a GPU),
//! allocated as `nvdra match` allocates them one after another — both on `gpu-0-shared` — and
//! prepared: one MPS daemon for the GPU, each claim's CDI spec with its own pinned device memory
//! limit and thread percentage. The GPUs are simulated, so a stand-in for
//! `nvidia-cuda-mps-control` under the driver root records what nvdra asks of it.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::resource::v1::{DeviceRequestAllocationResult, ResourceSlice};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use super::{DRIVER, DraClient, NAMESPACE, prepare, unprepare};
use crate::matching;

const EXAMPLE: &str = include_str!("../../manifests/examples/gpu-share-20gi.yaml");

/// The pods' claims: (name, uid).
const CLAIMS: [(&str, &str); 2] = [
    ("gpu-share-20gi-1", "uid-share-1"),
    ("gpu-share-20gi-2", "uid-share-2"),
];

/// Writes the stand-in MPS control under `driver_root`: `-d` records the start and creates the
/// daemon's control pipe (a file here), a command on stdin (`quit`) is recorded and removes it.
pub fn install_mps_stand_in(driver_root: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let bin = driver_root.join("usr/bin");
    std::fs::create_dir_all(&bin).with_context(|| format!("cannot create {}", bin.display()))?;
    let log = driver_root.join("mps.log");
    let script = format!(
        "#!/bin/sh\n# nvdra demo: a stand-in for the driver's MPS control on simulated GPUs.\n\
         if [ \"$1\" = -d ]; then echo \"start $CUDA_VISIBLE_DEVICES\" >> '{log}'; \
         : > \"$CUDA_MPS_PIPE_DIRECTORY/control\"; \
         else while read l; do \
         if [ \"$l\" = get_server_list ]; then [ -e \"$CUDA_MPS_PIPE_DIRECTORY/control\" ] || exit 1; continue; fi; \
         echo \"$l\" >> '{log}'; rm -f \"$CUDA_MPS_PIPE_DIRECTORY/control\"; done; fi\n",
        log = log.display()
    );
    let path = bin.join(crate::dra::mps::CONTROL);
    std::fs::write(&path, script).with_context(|| format!("cannot write {}", path.display()))?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))?;
    Ok(())
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
    let template = objects
        .claims
        .first()
        .context("the example has no claim template")?;
    let claims: Vec<matching::ClaimInput> = CLAIMS
        .iter()
        .map(|(name, _)| matching::ClaimInput {
            kind: "ResourceClaim",
            name: name.to_string(),
            spec_path: "spec",
            ..template.clone()
        })
        .collect();
    let env = crate::cel::Environment::new();
    let classes = matching::compile_classes(&objects.classes)?;
    let node = matching::Node::from_slices(&env, slices)?;
    let reports = matching::explain_all(&env, &claims, &classes, &node)?;
    writeln!(
        out,
        "{step}. Two pods share one GPU by memory: each gets a claim from gpu-share-20gi \
         (class gpu-shared.nvidia.com, memory 20Gi, compute 50), allocated as `nvdra match` does:"
    )?;
    for (i, (report, (name, uid))) in reports.iter().zip(CLAIMS).enumerate() {
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
        let claim = crate::api::allocated_claim(NAMESPACE, name, uid, vec![result], Vec::new());
        crate::api::dir::write_claim(&root.join("api"), &claim)?;
        let taken: Vec<String> = picked
            .consumed_capacity
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect();
        writeln!(
            out,
            "   {NAMESPACE}/{name} -> {} ({})",
            picked.device,
            taken.join(", ")
        )?;
    }
    ensure!(
        reports[0].allocation.as_ref().map(|a| &a[0].device)
            == reports[1].allocation.as_ref().map(|a| &a[0].device),
        "the two shares landed on different devices"
    );

    // The kubelet's part: prepare both; each CDI spec carries its own limits.
    writeln!(out, "   The kubelet prepares both:")?;
    for (name, uid) in CLAIMS {
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
        writeln!(
            out,
            "   {NAMESPACE}/{name}: {}, {}",
            env_line("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=")?,
            env_line("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=")?
        )?;
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
    for (name, uid) in CLAIMS {
        let e = unprepare(dra, name, uid).await?;
        ensure!(e.is_empty(), "unpreparing {NAMESPACE}/{name} failed: {e}");
    }
    let stopped = std::fs::read_to_string(&log).unwrap_or_default();
    ensure!(
        stopped.lines().last() == Some("quit"),
        "the MPS daemon was not stopped: {stopped:?}"
    );
    writeln!(
        out,
        "   Both unprepared: the daemon is told to quit after the last share.\n"
    )?;
    Ok(())
}
