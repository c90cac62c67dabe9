//! Where the kubelet looks for plugins, under its root directory (`--root-dir`,
//! `/var/lib/kubelet` by default). The kubelet's layout, declared once.

use std::path::{Path, PathBuf};

/// The kubelet's default root directory.
pub const DEFAULT_KUBELET_ROOT: &str = "/var/lib/kubelet";

/// `<root>/plugins/<driver>`: a DRA driver's socket directory, and its own data directory.
pub fn plugin_dir(root: &Path, driver: &str) -> PathBuf {
    root.join("plugins").join(driver)
}

/// `<root>/plugins_registry`, which the kubelet watches for registration sockets.
pub fn registry_dir(root: &Path) -> PathBuf {
    root.join("plugins_registry")
}

/// `<root>/device-plugins`, where the kubelet's `kubelet.sock` and device plugins' sockets are.
pub fn device_plugin_dir(root: &Path) -> PathBuf {
    root.join("device-plugins")
}

/// `<root>/pod-resources/kubelet.sock`, the kubelet's PodResources API.
pub fn pod_resources_socket(root: &Path) -> PathBuf {
    root.join("pod-resources").join("kubelet.sock")
}
