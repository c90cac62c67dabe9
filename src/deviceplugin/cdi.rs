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
//!
//! Each enabled extra driver capability ([`DriverMode`]) gets a spec of its own, as NVIDIA's
//! plugin writes one per nvcdi mode: kind `k8s.<driver>/<mode>`, one device `all`, holding the
//! mode's device nodes found on the host (GDS also mounts `/etc/cufile.json` and `/run/udev`
//! from the driver root). A mode whose nodes are absent gets no spec (a stale one is removed),
//! and Allocate does not name it — NVIDIA drops empty mode specs the same way.

use std::path::{Path, PathBuf};

use crate::cdi::{self, CdiOptions, DriverFiles, DriverRoot, PreparedDevice, Spec};
use crate::durable::Durability;
use crate::ids::ClaimUid;
use crate::inventory::Inventory;
use crate::sharing::Sharing;

use super::{DriverMode, IdStrategy, Options};

/// The CDI class of device-plugin devices.
pub const CLASS: &str = "gpu";
/// Stands where a claim UID stands in a claim spec's file name.
pub const SPEC_NAME: &str = "device-plugin";

/// [`SPEC_NAME`] as the CDI writer takes it.
pub fn spec_name() -> ClaimUid {
    // A constant that follows the claim-UID grammar (every write of the spec in the tests
    // passes through here), so parsing cannot fail.
    ClaimUid::parse(SPEC_NAME).expect("the device-plugin spec name is a valid claim UID")
}

/// CDI options for `driver`: vendor `k8s.<driver>`, class [`CLASS`].
pub fn options(driver: &str, driver_root: &DriverRoot) -> cdi::Result<CdiOptions> {
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
            mps_shm_dir: None,
            memory_limits: None,
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
                mps_shm_dir: None,
                memory_limits: None,
            });
        }
    }
    let mut spec = cdi::claim_spec(opts, SPEC_NAME, &devices, files)?;
    let prefix = format!("{SPEC_NAME}-");
    for (d, prepared) in spec.devices.iter_mut().zip(&devices) {
        if let Some(rest) = d.name.strip_prefix(&prefix) {
            d.name = rest.to_string();
        }
        // NVIDIA's device plugin gives a MIG device no DRM nodes (nvcdi's MIG discoverer adds
        // them only for `+gfx` profiles); a claim's MIG device has its parent's, as NVIDIA's DRA
        // driver writes it.
        if prepared.mig.is_some() {
            d.container_edits
                .device_nodes
                .retain(|n| !n.path.starts_with("/dev/dri/"));
            // A device's only hook makes its DRM nodes' by-path links.
            d.container_edits.hooks.clear();
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
    let files = cdi::discover_driver_files(&opts.root);
    let spec = spec(opts, inv, ids, &files)?;
    cdi::write_spec(cdi_root, opts, &spec_name(), &spec, Durability::Durable)
}

/// [`write`], then the spec of every enabled mode that has device nodes; the spec of an
/// enabled mode that has none is removed. Returns the GPU spec's path.
pub fn write_with_modes(
    cdi_root: &Path,
    opts: &CdiOptions,
    inv: &Inventory,
    options: &Options,
) -> cdi::Result<PathBuf> {
    let path = write(cdi_root, opts, inv, options.id_strategy)?;
    for &mode in &options.modes {
        let mode_opts = mode_options(opts, mode)?;
        match mode_spec(opts, mode) {
            Some(s) => {
                cdi::write_spec(cdi_root, &mode_opts, &spec_name(), &s, Durability::Durable)?;
            }
            None => {
                tracing::warn!(
                    mode = mode.class(),
                    "no device nodes for this driver capability on the host; its CDI device is not offered"
                );
                cdi::remove_spec(cdi_root, &mode_opts, &spec_name(), Durability::Durable)?;
            }
        }
    }
    Ok(path)
}

/// The options of a mode's spec: the GPU spec's vendor and roots, the mode as the class.
pub fn mode_options(opts: &CdiOptions, mode: DriverMode) -> cdi::Result<CdiOptions> {
    let mut o = opts.clone();
    o.class = mode.class().into();
    cdi::validate_class(&o.class)?;
    Ok(o)
}

/// `<vendor>/<mode>=all`, the CDI device Allocate names for an enabled mode.
pub fn mode_device(opts: &CdiOptions, mode: DriverMode) -> String {
    format!("{}/{}=all", opts.vendor, mode.class())
}

/// The spec of `mode` from the host's device nodes under `opts.dev_root` (and, for GDS, files
/// under the driver root); `None` when the host has none of the mode's device nodes.
pub fn mode_spec(opts: &CdiOptions, mode: DriverMode) -> Option<Spec> {
    let dev = &opts.dev_root;
    // (directory under the device root, file-name prefix, whole name?)
    let patterns: &[(&str, &str, bool)] = match mode {
        DriverMode::Gdrcopy => &[("", "gdrdrv", true)],
        DriverMode::Gds => &[("", "nvidia-fs", false)],
        DriverMode::Mofed => &[
            ("infiniband", "uverbs", false),
            ("infiniband", "rdma_cm", true),
        ],
    };
    let mut edits = cdi::ContainerEdits::default();
    for &(sub, prefix, whole) in patterns {
        let dir = dev.join(sub);
        let mut names: Vec<String> = match std::fs::read_dir(opts.root.read_path(&dir)) {
            Ok(rd) => rd
                .filter_map(|e| e.ok())
                .filter_map(|e| e.file_name().into_string().ok())
                .filter(|n| {
                    if whole {
                        n == prefix
                    } else {
                        n.starts_with(prefix)
                    }
                })
                .collect(),
            Err(_) => Vec::new(),
        };
        names.sort();
        for n in names {
            let container = if sub.is_empty() {
                format!("/dev/{n}")
            } else {
                format!("/dev/{sub}/{n}")
            };
            if let Some(node) = cdi::host_node(opts, &dir.join(&n), &container) {
                edits.device_nodes.push(node);
            }
        }
    }
    if edits.device_nodes.is_empty() {
        return None;
    }
    if mode == DriverMode::Gds {
        for p in ["etc/cufile.json", "run/udev"] {
            let host = opts.root.host().join(p);
            if opts.root.read_path(&host).exists() {
                edits.mounts.push(cdi::Mount {
                    host_path: host.display().to_string(),
                    container_path: format!("/{p}"),
                    options: cdi::READ_ONLY_MOUNT.iter().map(|s| s.to_string()).collect(),
                });
            }
        }
    }
    Some(Spec {
        cdi_version: cdi::CDI_VERSION.into(),
        kind: format!("{}/{}", opts.vendor, mode.class()),
        devices: vec![cdi::Device {
            name: "all".into(),
            container_edits: edits,
        }],
        container_edits: cdi::ContainerEdits::default(),
    })
}

#[cfg(test)]
mod drm_tests {
    use std::os::unix::fs::symlink;

    use super::*;
    use crate::inventory::topology::load_profile;

    /// A GPU's device has its DRM nodes; its MIG devices have none, as in NVIDIA's device
    /// plugin.
    #[test]
    fn mig_devices_of_the_device_plugin_spec_have_no_drm_nodes() {
        let inv = load_profile("a100-mig-mixed", "n").unwrap();
        let gpu = inv.gpus.iter().find(|g| !g.mig.devices.is_empty()).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        std::fs::create_dir_all(root.join("dev/dri")).unwrap();
        symlink("/dev/null", root.join("dev/dri/card1")).unwrap();
        std::fs::create_dir_all(
            root.join("sys/bus/pci/devices")
                .join(&gpu.pci_bus_id.0)
                .join("drm/card1"),
        )
        .unwrap();
        std::fs::create_dir_all(root.join("dev/dri/by-path")).unwrap();
        symlink(
            "../card1",
            root.join(format!("dev/dri/by-path/pci-{}-card", gpu.pci_bus_id.0)),
        )
        .unwrap();
        let files = DriverFiles {
            hook: Some(root.join("usr/bin/nvidia-cdi-hook")),
            ..Default::default()
        };
        let opts = options("gpu.nvidia.com", &DriverRoot::at(root)).unwrap();
        let spec = spec(&opts, &inv, IdStrategy::Uuid, &files).unwrap();
        // (DRM nodes, by-path link hooks) of a device.
        let dri = |name: &str| -> (usize, usize) {
            let d = spec.devices.iter().find(|d| d.name == name).unwrap();
            let nodes = d
                .container_edits
                .device_nodes
                .iter()
                .filter(|n| n.path == "/dev/dri/card1")
                .count();
            (nodes, d.container_edits.hooks.len())
        };
        assert_eq!(dri(gpu.uuid.as_str()), (1, 1));
        for m in &gpu.mig.devices {
            assert_eq!(dri(m.uuid.as_str()), (0, 0), "{}", m.uuid);
        }
    }
}
