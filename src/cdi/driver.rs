//! The driver's files, found the way NVIDIA's CDI library (`nvcdi`, nvidia-container-toolkit)
//! finds them, under the driver root read at its container path and reported as host paths:
//!
//! - **Libraries**: every regular file `*.so.<driver version>` in the directory of
//!   `libcuda.so.<version>` and its `vdpau/` subdirectory (no fixed list), plus the legacy
//!   `libnvidia-nvvm70.so.*`. The version is the suffix of `libcuda.so.<version>` (else of
//!   `libnvidia-ml.so.<version>`), as nvcdi infers it when NVML does not tell.
//! - **Links** the `create-symlinks` hook makes in the container: `libcuda.so` → `libcuda.so.1`,
//!   `libnvidia-opticalflow.so` → `libnvidia-opticalflow.so.1` and `libGLX_indirect.so.0` →
//!   `libGLX_nvidia.so.<version>` whenever those libraries are found, and for each library its soname link and its `.so` link when the host directory has
//!   them. nvcdi reads the soname from the ELF `DT_SONAME` and emits the link only when a link of
//!   that name exists beside the library; nvdra takes the link in that directory that points at
//!   the library (what ldconfig made from the soname), so the two agree wherever NVIDIA emits one.
//! - **Firmware**: `nvidia/<version>/gsp*.bin` under `lib/firmware/updates/<kernel>`,
//!   `lib/firmware/updates`, `lib/firmware/<kernel>` and `lib/firmware`.
//! - **IPC**: the persistenced and fabric-manager sockets (first of `run/`, `var/run/`). Not the
//!   host's MPS pipe directory `tmp/nvidia-mps`: nvcdi lists it but its file lookup skips
//!   directories, so NVIDIA's specs never carry it, and mounting it made every GPU container a
//!   client of whatever MPS daemon the host runs. Only a claim shared with MPS gets a pipe
//!   directory, its own daemon's (the builder's MPS edits).
//! - **Binaries**: `nvidia-smi`, `nvidia-debugdump`, `nvidia-persistenced`, the MPS control and
//!   server, `nvidia-imex` and `nvidia-imex-ctl`, first found in the bin directories.
//! - **The hook binary**: `nvidia-cdi-hook`, else `nvidia-ctk` (whose hooks are under `hook`),
//!   first found in the bin directories and the toolkit's `usr/local/nvidia/toolkit`, and on
//!   GPU Operator nodes in the host's toolkit directory ([`find_hook`]); its toolkit version is
//!   read by running it with `--version` ([`super::toolkit`]).
//!
//! - **Graphics and display** files and links: see [`super::graphics`] (each GPU's DRM nodes
//!   are per device, in the claim spec builder).
//!
//! Without a hook binary the soname links are mounted as files instead (as before hooks), so
//! `libcuda.so.1` still resolves in the container; with one, only the versioned files are
//! mounted and the hook makes the links, as NVIDIA's specs do.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use super::DriverRoot;
use super::graphics::{self, FileMount};
use super::lookup::Symlink;
use super::lookup::{BIN_DIRS, LIB_DIRS, matching_in, soname_link};
use super::toolkit::{self, HookCheck};

/// Where the GPU Operator's toolkit installs `nvidia-cdi-hook` and `nvidia-ctk`.
const TOOLKIT_DIR: &str = "usr/local/nvidia/toolkit";
/// The binaries nvcdi mounts.
pub(super) const BINARIES: [&str; 7] = [
    "nvidia-smi",
    "nvidia-debugdump",
    "nvidia-persistenced",
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
    "nvidia-imex",
    "nvidia-imex-ctl",
];
/// The hook binaries, in the order they are looked for.
const HOOK_BINARIES: [&str; 2] = ["nvidia-cdi-hook", "nvidia-ctk"];
/// The IPC sockets (under `run/` or `var/run/`).
const SOCKETS: [&str; 2] = ["nvidia-persistenced/socket", "nvidia-fabricmanager/socket"];

/// The driver's files, as host paths (under [`DriverRoot::host`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DriverFiles {
    /// The driver version the libraries were found by, e.g. `550.163.01`.
    pub version: Option<String>,
    /// The versioned library files (`libcuda.so.550.163.01`), in nvcdi's order.
    pub libraries: Vec<PathBuf>,
    /// The soname links beside them (`libcuda.so.1`), mounted only when there is no hook.
    pub soname_links: Vec<PathBuf>,
    /// What `create-symlinks` makes, in nvcdi's order.
    pub symlinks: Vec<Symlink>,
    pub firmware: Vec<PathBuf>,
    /// The IPC sockets.
    pub ipc: Vec<PathBuf>,
    pub binaries: Vec<PathBuf>,
    /// `nvidia-cdi-hook` or `nvidia-ctk`, if installed.
    pub hook: Option<PathBuf>,
    /// The hook binary's toolkit version: below 1.17.8 or unreadable, the spec leaves out
    /// `enable-cuda-compat` and `update-ldcache` ([`super::toolkit`]).
    pub hook_check: HookCheck,
    /// The graphics and display files ([`super::graphics`]), each at its container path.
    pub graphics: Vec<FileMount>,
    /// What the graphics `create-symlinks` hook makes, in nvcdi's order.
    pub graphics_symlinks: Vec<Symlink>,
}

/// Whether "no hook binary" was logged already: once per process is enough.
static NO_HOOK_LOGGED: AtomicBool = AtomicBool::new(false);

/// Finds the driver's files under `root` (see the module docs). Missing directories and files
/// are skipped: on a node without the driver this is empty.
pub fn discover_driver_files(root: &DriverRoot) -> DriverFiles {
    let base = root.ctr();
    let mut files = DriverFiles::default();
    if let Some((version, dir)) = find_version(base) {
        let mut libs = versioned_in(&dir, &version);
        libs.extend(versioned_in(&dir.join("vdpau"), &version));
        libs.extend(matching_in(&dir, |n| n.starts_with("libnvidia-nvvm70.so.")));
        let mut seen = BTreeSet::new();
        libs.retain(|l| seen.insert(l.clone()));
        for lib in &libs {
            let (links, soname_link) = links_for(base, lib);
            for link in links {
                if !files.symlinks.contains(&link) {
                    files.symlinks.push(link);
                }
            }
            files
                .soname_links
                .extend(soname_link.map(|l| root.host_path(&l)));
        }
        files.libraries = libs.iter().map(|l| root.host_path(l)).collect();
        files.firmware = firmware(base, &version)
            .iter()
            .map(|f| root.host_path(f))
            .collect();
        let graphics = graphics::discover(base, &version, &dir);
        files.graphics = graphics
            .mounts
            .iter()
            .map(|(read, container)| FileMount {
                host: root.host_path(read),
                container: container.clone(),
            })
            .collect();
        files.graphics_symlinks = graphics.symlinks;
        files
            .soname_links
            .extend(graphics.soname_links.iter().map(|l| root.host_path(l)));
        files.version = Some(version);
    }
    for socket in SOCKETS {
        if let Some(found) = ["run", "var/run"]
            .iter()
            .map(|d| base.join(d).join(socket))
            .find(|p| p.exists())
        {
            files.ipc.push(root.host_path(&found));
        }
    }
    files.binaries = BINARIES
        .iter()
        .filter_map(|b| first_in(base, &BIN_DIRS, b))
        .map(|p| root.host_path(&p))
        .collect();
    files.hook = find_hook(root, Path::new("/").join(TOOLKIT_DIR).as_path());
    files.hook_check = files
        .hook
        .as_ref()
        .map(|host| toolkit::check_hook(&root.read_path(host), host))
        .unwrap_or_default();
    if files.hook.is_none() && !NO_HOOK_LOGGED.swap(true, Ordering::Relaxed) {
        // Info, not a warning: specs without hooks work (the links are mounted instead), and
        // most nodes without NVIDIA's container toolkit are meant to be so.
        tracing::info!(
            driver_root = %root.host().display(),
            "neither nvidia-cdi-hook nor nvidia-ctk is installed under the driver root's bin \
             directories or {TOOLKIT_DIR}: CDI specs get no create-symlinks, enable-cuda-compat, \
             update-ldcache or disable-device-node-modification hook (the driver's soname links \
             are mounted instead; CUDA forward compatibility and the container's ld cache are \
             left to the image)"
        );
    }
    files
}

/// `nvidia-cdi-hook`, else `nvidia-ctk`, under the driver root's bin directories or toolkit
/// directory, as a host path. On GPU Operator nodes the toolkit installs them on the host, beside
/// and not in the driver container's root: when nvdra reads the driver root elsewhere than at its
/// host path (a pod's mount), `host_toolkit` (the host's `/usr/local/nvidia/toolkit`) is looked
/// at too, at the same path, where the pod sees it when it mounts that host directory there.
fn find_hook(root: &DriverRoot, host_toolkit: &Path) -> Option<PathBuf> {
    let dirs: Vec<&str> = BIN_DIRS.iter().copied().chain([TOOLKIT_DIR]).collect();
    let under_root = HOOK_BINARIES
        .iter()
        .find_map(|b| first_in(root.ctr(), &dirs, b))
        .map(|p| root.host_path(&p));
    under_root.or_else(|| {
        if root.host() == root.ctr() {
            return None;
        }
        HOOK_BINARIES
            .iter()
            .map(|b| host_toolkit.join(b))
            .find(|p| p.is_file())
    })
}

/// The driver version and its library directory (read side): the suffix of the regular file
/// `libcuda.so.<version>`, else `libnvidia-ml.so.<version>`, in the first library directory
/// that has one. With several versions (a stale install beside the new one), the one the soname
/// link points at wins.
fn find_version(base: &Path) -> Option<(String, PathBuf)> {
    let mut seen = BTreeSet::new();
    for lib in ["libcuda.so", "libnvidia-ml.so"] {
        for dir in LIB_DIRS {
            let dir = base.join(dir);
            let Ok(canonical) = dir.canonicalize() else {
                continue;
            };
            if !seen.insert((lib, canonical)) {
                continue;
            }
            let prefix = format!("{lib}.");
            let versions: Vec<String> = matching_in(&dir, |n| {
                n.strip_prefix(&prefix).is_some_and(|v| v.contains('.'))
            })
            .iter()
            .filter_map(|p| p.file_name()?.to_str()?.strip_prefix(&prefix))
            .map(str::to_string)
            .collect();
            let linked = fs::read_link(dir.join(format!("{lib}.1")))
                .ok()
                .and_then(|t| {
                    t.file_name()?
                        .to_str()?
                        .strip_prefix(&prefix)
                        .map(str::to_string)
                });
            let chosen = match linked {
                Some(v) if versions.contains(&v) => Some(v),
                _ => versions.last().cloned(),
            };
            if let Some(v) = chosen {
                return Some((v, dir));
            }
        }
    }
    None
}

/// The regular files `*.so.<version>` in `dir`, sorted (a glob's order).
fn versioned_in(dir: &Path, version: &str) -> Vec<PathBuf> {
    let suffix = format!(".so.{version}");
    matching_in(dir, |n| n.ends_with(&suffix) && n.len() > suffix.len())
}

/// `<base>/<dir>/<name>` of the first `dir` that has it as a file.
fn first_in(base: &Path, dirs: &[&str], name: &str) -> Option<PathBuf> {
    dirs.iter()
        .map(|d| base.join(d).join(name))
        .find(|p| p.is_file())
}

/// The links `create-symlinks` makes for the library `lib` (read path), in nvcdi's order, and
/// the soname link beside it (read path), if any.
fn links_for(base: &Path, lib: &Path) -> (Vec<Symlink>, Option<PathBuf>) {
    let (Some(dir), Some(name)) = (lib.parent(), lib.file_name().and_then(|n| n.to_str())) else {
        return (Vec::new(), None);
    };
    let container_dir = Path::new("/").join(dir.strip_prefix(base).unwrap_or(dir));
    let at = |file: &str| container_dir.join(file).display().to_string();
    let mut links = Vec::new();
    // nvcdi's fixed links, before the soname links (`getLinksForMount` in its
    // `internal/discover/symlinks.go`): applications dlopen `libcuda.so` and
    // `libnvidia-opticalflow.so`, which only development packages would provide, and GLVND
    // needs `libGLX_indirect.so.0` for indirect GLX.
    if name.starts_with("libcuda.so.") {
        links.push(Symlink {
            target: "libcuda.so.1".into(),
            link: at("libcuda.so"),
        });
    } else if name.starts_with("libGLX_nvidia.so.") {
        links.push(Symlink {
            target: name.into(),
            link: at("libGLX_indirect.so.0"),
        });
    } else if name.starts_with("libnvidia-opticalflow.so.") {
        links.push(Symlink {
            target: "libnvidia-opticalflow.so.1".into(),
            link: at("libnvidia-opticalflow.so"),
        });
    }
    let soname = soname_link(dir, name);
    if let Some(soname) = &soname {
        links.push(Symlink {
            target: name.into(),
            link: at(soname),
        });
    }
    let target = soname.clone().unwrap_or_else(|| name.to_string());
    let dev_link = dot_so(&target);
    if dev_link != target && is_symlink(&dir.join(dev_link)) {
        links.push(Symlink {
            target: target.clone(),
            link: at(dev_link),
        });
    }
    (links, soname.map(|s| dir.join(s)))
}

/// `libfoo.so` for `libfoo.so.1.2`: the name cut after its `.so`.
fn dot_so(name: &str) -> &str {
    match name.find(".so") {
        Some(i) if name[i + 3..].is_empty() || name[i + 3..].starts_with('.') => &name[..i + 3],
        _ => name,
    }
}

fn is_symlink(path: &Path) -> bool {
    fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink())
}

/// GSP firmware of `version` (read paths), searched where the kernel loads firmware from.
fn firmware(base: &Path, version: &str) -> Vec<PathBuf> {
    let kernel = fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_string())
        .unwrap_or_default();
    let mut dirs = Vec::new();
    for top in ["lib/firmware/updates", "lib/firmware"] {
        if !kernel.is_empty() {
            dirs.push(base.join(top).join(&kernel));
        }
        dirs.push(base.join(top));
    }
    let mut seen = BTreeSet::new();
    let mut found = Vec::new();
    for dir in dirs {
        let dir = dir.join("nvidia").join(version);
        let Ok(canonical) = dir.canonicalize() else {
            continue;
        };
        if seen.insert(canonical) {
            found.extend(matching_in(&dir, |n| {
                n.starts_with("gsp") && n.ends_with(".bin")
            }));
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The Operator's toolkit is on the host, not in the driver container's root.
    #[test]
    fn the_hook_is_found_under_the_driver_root_then_in_the_hosts_toolkit_directory() {
        let dir = tempfile::tempdir().unwrap();
        let ctr = dir.path().join("driver-root");
        let toolkit = dir.path().join("toolkit");
        std::fs::create_dir_all(ctr.join("usr/bin")).unwrap();
        std::fs::create_dir_all(&toolkit).unwrap();
        std::fs::write(toolkit.join("nvidia-ctk"), "ctk").unwrap();
        let operator = DriverRoot::new("/run/nvidia/driver".into(), ctr.clone(), "/".into());
        assert_eq!(
            find_hook(&operator, &toolkit),
            Some(toolkit.join("nvidia-ctk"))
        );
        std::fs::write(toolkit.join("nvidia-cdi-hook"), "hook").unwrap();
        assert_eq!(
            find_hook(&operator, &toolkit),
            Some(toolkit.join("nvidia-cdi-hook"))
        );
        // One under the driver root comes first, named by its host path.
        std::fs::write(ctr.join("usr/bin/nvidia-ctk"), "ctk").unwrap();
        assert_eq!(
            find_hook(&operator, &toolkit),
            Some(PathBuf::from("/run/nvidia/driver/usr/bin/nvidia-ctk"))
        );
        // A driver root read at its host path has the host's toolkit directory under it, if any.
        let host = DriverRoot::at(&dir.path().join("empty"));
        assert_eq!(find_hook(&host, &toolkit), None);
    }
}
