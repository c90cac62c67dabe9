//! NVIDIA's CDI hooks, in the form and order nvcdi (nvidia-container-toolkit v1.19, the version
//! NVIDIA's DRA driver vendors) writes them into a claim spec's spec-wide edits:
//!
//! 0. `create-symlinks` for the graphics links (`gbm/nvidia-drm_gbm.so`,
//!    `libnvidia-vulkan-producer.so`, `libglxserver_nvidia.so`), nvcdi's graphics discoverer
//!    coming before its driver one (only when there is a link to make);
//! 1. `create-symlinks --link <target>::<link> …` — the driver's soname and `.so` links, and
//!    `libcuda.so` (only when there is a link to make);
//! 2. `enable-cuda-compat --host-driver-version=<version>` — lets a container whose CUDA is newer
//!    than the driver use its forward-compatibility libraries (only when the version is known);
//! 3. `update-ldcache --folder <dir> …` — the container's ld cache learns the mounted libraries'
//!    directories (only when libraries are mounted);
//! 4. `disable-device-node-modification` — keeps NVML and nvidia-smi from creating device nodes in
//!    the container.
//!
//! Below NVIDIA Container Toolkit 1.17.8, or when the hook binary's version cannot be read,
//! `enable-cuda-compat` and `update-ldcache` are left out (CVE-2025-23266, CVE-2025-23267), and
//! below 1.18.0 `disable-device-node-modification` (older binaries lack it); see
//! [`super::toolkit`]. `create-symlinks` stays.
//!
//! Each is a `createContainer` hook whose path is the hook binary's host path, whose first
//! argument is the binary's name (then `hook` for `nvidia-ctk`, whose hooks are a subcommand),
//! and whose environment is `NVIDIA_CTK_DEBUG=false`.

use std::path::Path;

use super::{DriverFiles, Hook};

/// The OCI hook point of every NVIDIA hook.
const CREATE_CONTAINER: &str = "createContainer";
/// The hooks' environment (nvcdi's default: no debug logging).
const HOOK_ENV: &str = "NVIDIA_CTK_DEBUG=false";

/// The hooks for `files`, given the container directories of the mounted libraries (in mount
/// order); none without a hook binary.
pub(super) fn driver_hooks(files: &DriverFiles, lib_dirs: &[String]) -> Vec<Hook> {
    let Some(binary) = &files.hook else {
        return Vec::new();
    };
    let mut hooks = Vec::new();
    for symlinks in [&files.graphics_symlinks, &files.symlinks] {
        let links: Vec<String> = symlinks
            .iter()
            .flat_map(|l| ["--link".to_string(), l.arg()])
            .collect();
        if !links.is_empty() {
            hooks.push(hook(binary, "create-symlinks", links));
        }
    }
    let allowed = |name: &str| files.hook_check.allows(name);
    if let Some(version) = files
        .version
        .as_ref()
        .filter(|_| allowed("enable-cuda-compat"))
    {
        hooks.push(hook(
            binary,
            "enable-cuda-compat",
            vec![format!("--host-driver-version={version}")],
        ));
    }
    if !lib_dirs.is_empty() && allowed("update-ldcache") {
        let folders = lib_dirs
            .iter()
            .flat_map(|d| ["--folder".to_string(), d.clone()])
            .collect();
        hooks.push(hook(binary, "update-ldcache", folders));
    }
    if allowed("disable-device-node-modification") {
        hooks.push(hook(binary, "disable-device-node-modification", Vec::new()));
    }
    hooks
}

/// A device's own `create-symlinks` hook for `links` (`target::link`); none without a hook
/// binary or links.
pub(super) fn device_links_hook(files: &DriverFiles, links: &[String]) -> Option<Hook> {
    let binary = files.hook.as_ref()?;
    if links.is_empty() {
        return None;
    }
    let args = links
        .iter()
        .flat_map(|l| ["--link".to_string(), l.clone()])
        .collect();
    Some(hook(binary, "create-symlinks", args))
}

fn hook(binary: &Path, name: &str, args: Vec<String>) -> Hook {
    let base = binary
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut all = vec![base.clone()];
    if base == "nvidia-ctk" {
        all.push("hook".into());
    }
    all.push(name.into());
    all.extend(args);
    Hook {
        hook_name: CREATE_CONTAINER.into(),
        path: binary.display().to_string(),
        args: all,
        env: vec![HOOK_ENV.into()],
    }
}
