//! What a daemon claim's container gets besides its domain (NVIDIA's base spec): the node's
//! NVIDIA device nodes and the driver's files, as NVIDIA's compute-domain plugin hands its daemon
//! through `k8s.compute-domain.nvidia.com/device=all`, a spec nvidia-container-toolkit's `nvcdi`
//! builds in management mode, so that `nvidia-imex` and `nvidia-imex-ctl` run in the container.
//!
//! - **Device nodes**: the character devices `<dev>/nvidia*` (`nvidiactl`, `nvidia-uvm`,
//!   `nvidia-uvm-tools`, `nvidia-modeset`, each GPU's `nvidia<N>`) and `<dev>/nvidia-caps/nvidia-cap*`,
//!   found on the node without NVML, but for `nvidia-fs*`, `nvidia-nvswitch*` and
//!   `nvidia-nvlink*` (nvcdi's management discoverer and its block list).
//! - **Driver files**: nvdra's discovery ([`crate::cdi::discover_driver_files`]): the libraries
//!   with their soname links, the firmware, the IPC sockets and the binaries (`nvidia-smi`,
//!   `nvidia-imex`, `nvidia-imex-ctl`, ...), mounted read-only at their path under the driver
//!   root; `NVIDIA_VISIBLE_DEVICES=void`.
//!
//! Put in the claim's own device rather than a second spec, so a daemon claim is one CDI device
//! as every other claim of the plugin. Read at each prepare: a driver upgraded since start-up is
//! what the daemon gets. Unlike NVIDIA's, no `create-symlinks`/`update-ldcache` hooks: the
//! soname links are mounted as files (the GPU driver's specs do the same without a hook binary).

use std::os::unix::fs::FileTypeExt;
use std::path::Path;

use crate::cdi::{
    ContainerEdits, DeviceNode, DriverRoot, IPC_MOUNT, Mount, READ_ONLY_MOUNT,
    VISIBLE_DEVICES_VOID, discover_driver_files, existing_node,
};

/// Device nodes nvcdi's management mode leaves out.
const BLOCKED: [&str; 3] = ["nvidia-fs", "nvidia-nvswitch", "nvidia-nvlink"];

/// The base edits of a daemon's container on the node whose driver is at `root`.
pub fn edits(root: &DriverRoot) -> ContainerEdits {
    let mut edits = ContainerEdits {
        env: vec![VISIBLE_DEVICES_VOID.into()],
        device_nodes: device_nodes(root),
        ..ContainerEdits::default()
    };
    let files = discover_driver_files(root);
    let to_container = |host: &Path| {
        host.strip_prefix(root.host())
            .ok()
            .map(|rel| Path::new("/").join(rel).display().to_string())
    };
    let mount = |host: &Path, options: &[&str]| {
        to_container(host).map(|container_path| Mount {
            host_path: host.display().to_string(),
            container_path,
            options: options.iter().map(|o| o.to_string()).collect(),
        })
    };
    let read_only = files
        .libraries
        .iter()
        .chain(&files.soname_links)
        .chain(&files.firmware)
        .chain(&files.binaries);
    edits
        .mounts
        .extend(read_only.filter_map(|f| mount(f, &READ_ONLY_MOUNT)));
    edits
        .mounts
        .extend(files.ipc.iter().filter_map(|f| mount(f, &IPC_MOUNT)));
    edits
}

/// The node's NVIDIA character devices (see the module docs), in name order.
fn device_nodes(root: &DriverRoot) -> Vec<DeviceNode> {
    let dev = root.dev_dir();
    let mut names = Vec::new();
    for (dir, prefix) in [("", "nvidia"), ("nvidia-caps", "nvidia-cap")] {
        let Ok(entries) = std::fs::read_dir(root.read_path(&dev.join(dir))) else {
            continue;
        };
        for e in entries.flatten() {
            let Ok(name) = e.file_name().into_string() else {
                continue;
            };
            // Followed: a driver container's nodes may be links.
            let char_device =
                std::fs::metadata(e.path()).is_ok_and(|m| m.file_type().is_char_device());
            if char_device
                && name.starts_with(prefix)
                && !BLOCKED.iter().any(|b| name.starts_with(b))
            {
                names.push(Path::new(dir).join(name));
            }
        }
    }
    names.sort();
    names
        .iter()
        .filter_map(|rel| {
            let host = dev.join(rel);
            existing_node(
                &root.read_path(&host),
                &host,
                &Path::new("/dev").join(rel).display().to_string(),
            )
        })
        .collect()
}
