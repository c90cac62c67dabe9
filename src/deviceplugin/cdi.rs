//! The CDI spec for devices handed out through the device plugin (`cdi-annotations` and
//! `cdi-cri` strategies): one file per node, `<cdi root>/k8s.<driver>-gpu_device-plugin.yaml`,
//! kind `k8s.<driver>/gpu`, with one CDI device per GPU and MIG device, named by its device-plugin
//! ID without a replica suffix (the GPU or MIG UUID, or its index), as NVIDIA's plugin names the
//! devices of its `k8s.device-plugin.nvidia.com/gpu` spec.
//!
//! Built by the DRA builder ([`crate::cdi::claim_spec`]) so both paths inject the same device
//! nodes, driver files and hooks; two things differ from a claim's spec: device names carry no
//! claim prefix, and there is no spec-wide `NVIDIA_VISIBLE_DEVICES` (a spec-wide value would list
//! every GPU of the node for any one device; as with NVIDIA's plugin in CDI mode, the container
//! gets none). The class is `gpu`, not `claim`, so the DRA plugin's cleanup of stale claim specs
//! never touches this file.

use std::path::{Path, PathBuf};

use crate::cdi::{self, CdiOptions, DriverFiles, PreparedDevice, Spec};
use crate::inventory::Inventory;
use crate::sharing::Sharing;

use super::IdStrategy;

/// The CDI class of device-plugin devices.
pub const CLASS: &str = "gpu";
/// Stands where a claim UID stands in a claim spec's file name.
pub const SPEC_NAME: &str = "device-plugin";

/// CDI options for `driver`: vendor `k8s.<driver>`, class [`CLASS`].
pub fn options(driver: &str, driver_root: &Path) -> cdi::Result<CdiOptions> {
    let mut opts = CdiOptions::resolve(driver, driver_root)?;
    opts.class = CLASS.into();
    cdi::validate_class(&opts.class)?;
    Ok(opts)
}

/// The spec naming every GPU and MIG device of `inv` by its device-plugin ID.
pub fn spec(
    opts: &CdiOptions,
    inv: &Inventory,
    ids: IdStrategy,
    files: &DriverFiles,
) -> cdi::Result<Spec> {
    let mut devices = Vec::new();
    for g in &inv.gpus {
        devices.push(PreparedDevice {
            name: match ids {
                IdStrategy::Uuid => g.uuid.0.clone(),
                IdStrategy::Index => g.index.to_string(),
            },
            gpu: g.clone(),
            mig: None,
            sharing: Sharing::Exclusive,
            mps_pipe_dir: None,
        });
        for (j, m) in g.mig.devices.iter().enumerate() {
            devices.push(PreparedDevice {
                name: match ids {
                    IdStrategy::Uuid => m.uuid.0.clone(),
                    IdStrategy::Index => format!("{}:{j}", g.index),
                },
                gpu: g.clone(),
                mig: Some(m.clone()),
                sharing: Sharing::Exclusive,
                mps_pipe_dir: None,
            });
        }
    }
    let mut spec = cdi::claim_spec(opts, SPEC_NAME, &devices, files)?;
    let prefix = format!("{SPEC_NAME}-");
    for d in &mut spec.devices {
        if let Some(rest) = d.name.strip_prefix(&prefix) {
            d.name = rest.to_string();
        }
    }
    spec.container_edits
        .env
        .retain(|e| !e.starts_with("NVIDIA_VISIBLE_DEVICES="));
    Ok(spec)
}

/// Builds and writes the spec (blocking: reads the host's device nodes, writes atomically).
pub fn write(
    cdi_root: &Path,
    opts: &CdiOptions,
    inv: &Inventory,
    ids: IdStrategy,
) -> cdi::Result<PathBuf> {
    let files = cdi::discover_driver_files(&opts.driver_root);
    let spec = spec(opts, inv, ids, &files)?;
    cdi::write_spec(cdi_root, opts, SPEC_NAME, &spec)
}
