//! The demo's GPU of any shape (`--dynamic-mig`): one H100 is prepared whole, then as two MIG
//! devices for two pods (the plugin turns MIG mode on and creates both instances), refused
//! whole while they run, and whole again after both are unprepared (MIG mode off), while
//! another GPU of the node stays shared by memory. Each claim is allocated as `nvdra match`
//! allocates it, against the slices the daemon publishes at that moment and the claims that
//! hold devices already, as the scheduler would.

use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::api::resource::v1::{
    AllocationResult, DeviceAllocationResult, DeviceRequestAllocationResult, ResourceSlice,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use super::{DRIVER, DraClient, NAMESPACE, prepare, unprepare, wait_for_slices};
use crate::inventory::sim::{SimAction, SimBackend};
use crate::matching;

/// The claims of this step, as a user writes them. `{gpu}` is the UUID of the GPU the step
/// reshapes, so that the whole-GPU claims ask for that one.
const CLAIMS: &str = r#"
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: notebook-share}
spec:
  devices:
    requests:
      - name: gpu
        exactly:
          deviceClassName: gpu.nvidia.com
          capacity: {requests: {memory: 20Gi}}
---
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: train-whole}
spec:
  devices:
    requests:
      - name: gpu
        exactly:
          deviceClassName: gpu.nvidia.com
          selectors:
            - cel: {expression: "device.attributes['gpu.nvidia.com'].uuid == '{gpu}'"}
---
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: infer-3g}
spec:
  devices:
    requests:
      - name: gpu
        exactly:
          deviceClassName: mig.nvidia.com
          selectors:
            - cel: {expression: "device.attributes['gpu.nvidia.com'].profile == '3g.40gb' && device.attributes['gpu.nvidia.com'].parentUUID == '{gpu}'"}
---
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: infer-1g}
spec:
  devices:
    requests:
      - name: gpu
        exactly:
          deviceClassName: mig.nvidia.com
          selectors:
            - cel: {expression: "device.attributes['gpu.nvidia.com'].profile == '1g.10gb' && device.attributes['gpu.nvidia.com'].parentUUID == '{gpu}'"}
"#;

/// The scheduler's view: the node's slices now, and the claims allocated so far.
struct Scheduler<'a> {
    root: &'a Path,
    slices_dir: &'a Path,
    objects: matching::Objects,
    /// Allocated claims: (name, uid), with their allocation in `objects.claims`.
    allocated: Vec<(String, String)>,
}

impl Scheduler<'_> {
    /// Allocates the claim `name` as `nvdra match` does, writes it to the API and returns the
    /// device it got; `Err` with the match's reason when it does not fit.
    async fn allocate<T>(
        &mut self,
        name: &str,
        uid: &str,
        daemon: &tokio::task::JoinHandle<T>,
    ) -> Result<std::result::Result<String, String>> {
        let slices = wait_for_slices(self.slices_dir, daemon).await?;
        let env = crate::cel::Environment::new();
        let classes = matching::compile_classes(&self.objects.classes)?;
        let node = matching::Node::from_slices(&env, &slices)?;
        let mut claims: Vec<matching::ClaimInput> = self
            .objects
            .claims
            .iter()
            .filter(|c| c.allocation.is_some())
            .cloned()
            .collect();
        let claim = self
            .objects
            .claims
            .iter()
            .find(|c| c.name == name)
            .with_context(|| format!("the demo has no claim {name}"))?
            .clone();
        claims.push(claim);
        let reports = matching::explain_all(&env, &claims, &classes, &node)?;
        let report = reports.last().context("no report for the claim")?;
        let picked = match (&report.allocation, report.satisfiable) {
            (Some(a), true) => a.first().context("an empty allocation")?.clone(),
            _ => {
                return Ok(Err(report
                    .reason
                    .clone()
                    .unwrap_or_else(|| "does not fit".into())));
            }
        };
        let consumed = (!picked.consumed_capacity.is_empty()).then(|| {
            picked
                .consumed_capacity
                .iter()
                .map(|(k, v)| (k.clone(), Quantity(v.clone())))
                .collect()
        });
        let result = DeviceRequestAllocationResult {
            share_id: consumed
                .as_ref()
                .map(|_| "5f0e0000-0000-4000-8000-000000000101".to_string()),
            consumed_capacity: consumed,
            ..crate::api::allocated_device(
                &picked.request,
                &picked.driver,
                &picked.pool,
                &picked.device,
            )
        };
        let claim =
            crate::api::allocated_claim(NAMESPACE, name, uid, vec![result.clone()], Vec::new());
        crate::api::dir::write_claim(&self.root.join("api"), &claim)?;
        for c in self.objects.claims.iter_mut().filter(|c| c.name == name) {
            c.allocation = Some(AllocationResult {
                devices: Some(DeviceAllocationResult {
                    results: Some(vec![result.clone()]),
                    config: None,
                }),
                ..Default::default()
            });
        }
        self.allocated.push((name.into(), uid.into()));
        Ok(Ok(picked.device))
    }

    /// Unprepares the claim and takes its allocation back, as the scheduler does once its pod
    /// is gone.
    async fn release(&mut self, dra: &mut DraClient, name: &str) -> Result<()> {
        let uid = self
            .allocated
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, u)| u.clone())
            .with_context(|| format!("{name} is not allocated"))?;
        let e = unprepare(dra, name, &uid).await?;
        ensure!(e.is_empty(), "unpreparing {NAMESPACE}/{name} failed: {e}");
        self.allocated.retain(|(n, _)| n != name);
        for c in self.objects.claims.iter_mut().filter(|c| c.name == name) {
            c.allocation = None;
        }
        Ok(())
    }
}

/// The GPU's MIG mode changes the simulated node recorded since `from`, in words.
fn mig_changes(sim: &SimBackend, from: usize) -> Vec<String> {
    sim.actions()
        .into_iter()
        .skip(from)
        .filter(|a| {
            matches!(
                a,
                SimAction::SetMigMode { .. }
                    | SimAction::CreateMig { .. }
                    | SimAction::DestroyMig { .. }
            )
        })
        .map(|a| a.to_string())
        .collect()
}

/// Prepares the claim, failing the demo on an error.
async fn prepared(dra: &mut DraClient, name: &str, uid: &str) -> Result<Vec<String>> {
    let r = prepare(dra, name, uid).await?;
    ensure!(
        r.error.is_empty(),
        "preparing {NAMESPACE}/{name} failed: {}",
        r.error
    );
    Ok(r.devices.into_iter().flat_map(|d| d.cdi_device_ids).collect())
}

#[allow(clippy::too_many_arguments)]
pub async fn run<T>(
    out: &mut (dyn Write + Send),
    root: &Path,
    dra: &mut DraClient,
    slices_dir: &Path,
    daemon: &tokio::task::JoinHandle<T>,
    sim: &SimBackend,
    gpu: (&str, &str),
    step: u32,
) -> Result<()> {
    let (gpu_name, gpu_uuid) = gpu;
    let mut objects = matching::Objects::default();
    matching::input::read_text(
        Path::new("shapes.yaml"),
        &CLAIMS.replace("{gpu}", gpu_uuid),
        &mut objects,
    )?;
    objects.classes = matching::input::builtin_classes();
    let mut s = Scheduler {
        root,
        slices_dir,
        objects,
        allocated: Vec::new(),
    };
    writeln!(
        out,
        "{step}. Any shape on demand (--dynamic-mig): {gpu_name} is published whole and as every \
         MIG placement, from one set of counters; each claim is allocated as `nvdra match` does:"
    )?;

    // Another GPU is shared by memory throughout.
    let share = s
        .allocate("notebook-share", "uid-notebook-share", daemon)
        .await?
        .map_err(|why| anyhow::anyhow!("the demo's share does not fit: {why}"))?;
    prepared(dra, "notebook-share", "uid-notebook-share").await?;
    writeln!(
        out,
        "   {NAMESPACE}/notebook-share (memory 20Gi) -> {share}, shared by memory, held throughout"
    )?;
    ensure!(share != gpu_name, "the share landed on {gpu_name}");

    // Whole.
    let whole = s.allocate("train-whole", "uid-train-whole", daemon).await?;
    ensure!(
        whole.as_deref() == Ok(gpu_name),
        "the whole-GPU claim got {whole:?}"
    );
    let mark = sim.actions().len();
    prepared(dra, "train-whole", "uid-train-whole").await?;
    ensure!(
        mig_changes(sim, mark).is_empty(),
        "a whole GPU changed MIG state"
    );
    writeln!(
        out,
        "   {NAMESPACE}/train-whole -> {gpu_name}: prepared whole, MIG mode off"
    )?;
    s.release(dra, "train-whole").await?;

    // Two MIG devices for two pods: MIG mode on, both instances made.
    let mark = sim.actions().len();
    for (name, uid) in [("infer-3g", "uid-infer-3g"), ("infer-1g", "uid-infer-1g")] {
        let device = s
            .allocate(name, uid, daemon)
            .await?
            .map_err(|why| anyhow::anyhow!("{name} does not fit: {why}"))?;
        let ids = prepared(dra, name, uid).await?;
        writeln!(
            out,
            "   {NAMESPACE}/{name} -> {device}: prepared as {}",
            ids.join(", ")
        )?;
    }
    let changes = mig_changes(sim, mark);
    ensure!(
        changes.iter().filter(|c| c.contains("create")).count() == 2,
        "the two MIG devices were not created: {changes:?}"
    );
    writeln!(out, "   the simulated GPU recorded: {}", changes.join("; "))?;

    // Whole again is refused while they run, with the reason the scheduler would have.
    match s.allocate("train-whole", "uid-train-whole", daemon).await? {
        Ok(d) => bail!("a whole-GPU claim got {d} beside two MIG devices"),
        Err(why) => writeln!(
            out,
            "   {NAMESPACE}/train-whole again: does not fit while they run: {why}"
        )?,
    }

    // Both unprepared: MIG mode off, and the GPU is whole again.
    let mark = sim.actions().len();
    for name in ["infer-3g", "infer-1g"] {
        s.release(dra, name).await?;
    }
    let changes = mig_changes(sim, mark);
    ensure!(
        changes.last().is_some_and(|c| c.contains("off")),
        "MIG mode was not turned off after the last instance: {changes:?}"
    );
    writeln!(
        out,
        "   both unprepared: the simulated GPU recorded: {}",
        changes.join("; ")
    )?;
    // The daemon republishes the GPU whole once its inventory shows MIG mode off.
    let start = Instant::now();
    let whole = loop {
        match s.allocate("train-whole", "uid-train-whole", daemon).await? {
            Ok(d) => break d,
            Err(why) if start.elapsed() > Duration::from_secs(10) => {
                bail!("{gpu_name} was not offered whole again: {why}")
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    };
    ensure!(whole == gpu_name, "the whole-GPU claim got {whole}");
    prepared(dra, "train-whole", "uid-train-whole").await?;
    writeln!(
        out,
        "   {NAMESPACE}/train-whole -> {gpu_name}: prepared whole again\n"
    )?;
    s.release(dra, "train-whole").await?;
    s.release(dra, "notebook-share").await?;
    Ok(())
}

/// The name and UUID of the last GPU of the slices that publishes MIG placements beside
/// itself: the one the step reshapes (shares go to the first, as the allocator fits them).
pub fn reshapeable(slices: &[ResourceSlice]) -> Option<(String, String)> {
    let devices: Vec<_> = slices
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten())
        .collect();
    devices.iter().rev().find_map(|d| {
        let uuid = d
            .attributes
            .as_ref()?
            .get("uuid")?
            .string
            .clone()?;
        let placements = format!("{}-mig-", d.name);
        devices
            .iter()
            .any(|m| m.name.starts_with(&placements))
            .then(|| (d.name.clone(), uuid))
    })
}
