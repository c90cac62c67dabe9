//! Device nodes as the host has them: whether a node exists where nvdra reads the host, and
//! its type, numbers and mode, for a CDI `deviceNodes` entry. Shared by the claim spec builder
//! and the graphics discovery (DRM nodes).

use std::fs;
use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::Path;

use super::{CdiOptions, DeviceNode};

/// [`existing_node`] for the host path `host`, read where nvdra sees it.
pub fn host_node(opts: &CdiOptions, host: &Path, container_path: &str) -> Option<DeviceNode> {
    existing_node(&opts.root.read_path(host), host, container_path)
}

/// A device node with host path `host` if `read` (where nvdra sees it) exists and is a device
/// (symlinks are followed), with its type, numbers and mode read from the host so dynamic majors
/// (`nvidia-uvm`) are right.
pub fn existing_node(read: &Path, host: &Path, container_path: &str) -> Option<DeviceNode> {
    let meta = match fs::metadata(read) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return None,
        Err(e) => {
            tracing::warn!(path = %read.display(), error = %e, "cannot inspect device node; skipped");
            return None;
        }
    };
    let file_type = meta.file_type();
    let node_type = if file_type.is_char_device() {
        "c"
    } else if file_type.is_block_device() {
        "b"
    } else {
        tracing::warn!(path = %read.display(), "not a device node; skipped");
        return None;
    };
    let (major, minor) = split_dev(meta.rdev());
    Some(DeviceNode {
        path: container_path.to_string(),
        host_path: Some(host.display().to_string()),
        node_type: Some(node_type.into()),
        major: Some(major),
        minor: Some(minor),
        file_mode: Some(meta.mode() & 0o777),
        permissions: Some("rwm".into()),
    })
}

/// Linux (glibc) `dev_t` encoding, as `major(3)`/`minor(3)` decode it.
pub(super) fn split_dev(dev: u64) -> (i64, i64) {
    let major = ((dev >> 8) & 0xfff) | ((dev >> 32) & 0xffff_f000);
    let minor = (dev & 0xff) | ((dev >> 12) & 0xffff_ff00);
    // Both are at most 32 bits wide after the masks, so they fit in i64.
    (major as i64, minor as i64)
}
