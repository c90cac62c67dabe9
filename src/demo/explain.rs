//! The demo's `nvdra match`: a claim the node cannot satisfy — two GPUs of at least 100Gi each in
//! one NVLink domain, on H100s of 80Gi — explained against the slices the daemon just published,
//! device by device, as `nvdra match -f claim.yaml --slices FILE` prints it.

use std::io::Write;
use std::path::Path;

use anyhow::{Result, ensure};
use k8s_openapi::api::resource::v1::ResourceSlice;

use crate::matching;

/// The claim, as a user would write it.
const CLAIM: &str = r#"apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata:
  name: big-training
  namespace: demo
spec:
  devices:
    requests:
      - name: gpus
        exactly:
          deviceClassName: gpu.nvidia.com
          count: 2
          selectors:
            - cel:
                expression: device.capacity["gpu.nvidia.com"].memory.compareTo(quantity("100Gi")) >= 0
    constraints:
      - requests: [gpus]
        matchAttribute: gpu.nvidia.com/nvlinkDomain
"#;

pub fn run(out: &mut (dyn Write + Send), slices: &[ResourceSlice], step: u32) -> Result<()> {
    let mut objects = matching::Objects::default();
    matching::input::read_text(Path::new("big-training.yaml"), CLAIM, &mut objects)?;
    let env = crate::cel::Environment::new();
    let classes = matching::compile_classes(&objects.classes)?;
    let node = matching::Node::from_slices(&env, slices)?;
    let report = matching::explain(
        &env,
        &objects.claims[0],
        &classes,
        &node,
        &matching::Held::default(),
    )?;
    ensure!(
        !report.satisfiable,
        "the demo's oversized claim fits the node"
    );
    writeln!(
        out,
        "{step}. Why would a pod wait? `nvdra match` on a claim for two GPUs of >= 100Gi in one NVLink domain:"
    )?;
    // MIG placements (`--dynamic-mig`) are not of the class: one line for them all.
    let mut placements = 0;
    for line in matching::render_table(std::slice::from_ref(&report)).lines() {
        if line.contains(r#"type "mig" != "gpu""#) {
            placements += 1;
            continue;
        }
        writeln!(out, "   {line}")?;
    }
    if placements > 0 {
        writeln!(
            out,
            "   ({placements} MIG placements left out: class gpu.nvidia.com wants type \"gpu\")"
        )?;
    }
    writeln!(out)?;
    Ok(())
}
