//! The graphics and display files of the driver, found as NVIDIA's toolkit finds them
//! (nvidia-container-toolkit `internal/discover/graphics.go`, used by nvcdi for every spec), so
//! that Vulkan, EGL, OptiX and X workloads work in a claim's container as they do under NVIDIA's
//! driver. Only what exists under the driver root is taken; an absent file adds nothing.
//!
//! - **Configs**, first found under `etc/`, `usr/local/share/`, `usr/share/` (nvcdi's config
//!   search path), mounted at the standard location whatever the host's: the GLVND EGL vendor
//!   file, the EGL external-platform files, `nvoptix.bin` and the X configs at `/usr/share/<name>`;
//!   the OpenCL ICD at `/etc/<name>`; the Vulkan ICD and layer files (also looked for at the driver
//!   root itself, as on GKE) at `/etc/<name>`.
//! - **Libraries**, at their host paths: the EGL platform libraries (`libnvidia-egl-gbm.so.*.*`,
//!   `-wayland`, `-wayland2`, `-xcb`, `-xlib`: their own versions, not the driver's) and
//!   `libnvidia-vulkan-producer.so.<version>`, in the first library directory that has them.
//! - **X driver modules**, at their host paths, first found in the X module directories beside
//!   `libcuda` and the system ones: `nvidia_drv.so` and `libglxserver_nvidia.so.<version>`.
//! - **Binary**: `nvidia-xconfig`.
//! - **Links** a `create-symlinks` hook of their own makes (nvcdi's graphics hook, the first of a
//!   spec): `gbm/nvidia-drm_gbm.so` → `../libnvidia-allocator.so.1`,
//!   `libnvidia-vulkan-producer.so` and `libglxserver_nvidia.so` → their versioned files.
//! - (Each GPU's **DRM nodes**, per device, are the claim spec builder's: `builder::drm_nodes`.)
//!
//! nvcdi reads `XDG_DATA_DIRS` of its own process for the share directories; nvdra uses the
//! default (`/usr/local/share:/usr/share`), the value on the hosts NVIDIA's driver runs on.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use super::lookup::{BIN_DIRS, LIB_DIRS, Symlink, matching_in, soname_link};

/// A file mounted read-only at `container`, from `host` (a host path).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileMount {
    pub host: PathBuf,
    pub container: String,
}

/// Where nvcdi looks for driver configs: `/etc`, then `XDG_DATA_DIRS`' default.
const CONFIG_DIRS: [&str; 3] = ["etc", "usr/local/share", "usr/share"];
/// Configs mounted under `/usr/share`.
const SHARE_CONFIGS: [&str; 9] = [
    "glvnd/egl_vendor.d/10_nvidia.json",
    "egl/egl_external_platform.d/15_nvidia_gbm.json",
    "egl/egl_external_platform.d/10_nvidia_wayland.json",
    "egl/egl_external_platform.d/09_nvidia_wayland2.json",
    "egl/egl_external_platform.d/20_nvidia_xcb.json",
    "egl/egl_external_platform.d/20_nvidia_xlib.json",
    "nvidia/nvoptix.bin",
    "X11/xorg.conf.d/10-nvidia.conf",
    "X11/xorg.conf.d/nvidia-drm-outputclass.conf",
];
/// Configs mounted under `/etc`.
const ETC_CONFIGS: [&str; 1] = ["OpenCL/vendors/nvidia.icd"];
/// The Vulkan files, mounted under `/etc`; RPM packages name the ICD by architecture.
const VULKAN_CONFIGS: [&str; 4] = [
    "vulkan/icd.d/nvidia_icd.json",
    "vulkan/icd.d/nvidia_layers.json",
    "vulkan/implicit_layer.d/nvidia_layers.json",
    if cfg!(target_arch = "aarch64") {
        "vulkan/icd.d/nvidia_icd.aarch64.json"
    } else {
        "vulkan/icd.d/nvidia_icd.x86_64.json"
    },
];
/// The EGL platform libraries: `<prefix><X.Y…>`, versioned apart from the driver.
const EGL_PLATFORM_LIBS: [&str; 5] = [
    "libnvidia-egl-gbm.so.",
    "libnvidia-egl-wayland.so.",
    "libnvidia-egl-wayland2.so.",
    "libnvidia-egl-xcb.so.",
    "libnvidia-egl-xlib.so.",
];
/// X module directories under each library directory of the driver, then the system ones.
const XORG_UNDER_LIB_DIR: [&str; 5] = [
    "nvidia/xorg",
    "xorg/modules/drivers",
    "xorg/modules/extensions",
    "xorg/modules/updates/drivers",
    "xorg/modules/updates/extensions",
];
const XORG_LIB_ROOTS: [&str; 4] = [
    "usr/lib/xorg",
    "usr/lib64/xorg",
    "usr/X11R6/lib",
    "usr/X11R6/lib64",
];
const XORG_MODULE_DIRS: [&str; 4] = [
    "modules/drivers",
    "modules/extensions",
    "modules/updates/drivers",
    "modules/updates/extensions",
];

/// What [`discover`] finds: the mounts (read paths), the graphics hook's links and, for specs
/// without hooks, the soname links of the EGL platform libraries (read paths).
#[derive(Default)]
pub(super) struct Found {
    pub mounts: Vec<(PathBuf, String)>,
    pub symlinks: Vec<Symlink>,
    pub soname_links: Vec<PathBuf>,
}

/// The graphics files under `base` (the driver root where nvdra reads it), for the driver
/// `version` whose `libcuda` is in `lib_dir` (a read path).
pub(super) fn discover(base: &Path, version: &str, lib_dir: &Path) -> Found {
    let mut found = Found::default();
    let mut seen = BTreeSet::new();
    let in_container = |read: &Path| -> String {
        Path::new("/")
            .join(read.strip_prefix(base).unwrap_or(read))
            .display()
            .to_string()
    };
    let mut add = |found: &mut Found, read: PathBuf, container: String| {
        if seen.insert(read.clone()) {
            found.mounts.push((read, container));
        }
    };

    for (names, to) in [
        (&SHARE_CONFIGS[..], "/usr/share"),
        (&ETC_CONFIGS[..], "/etc"),
    ] {
        for name in names {
            if let Some(read) = first_file(CONFIG_DIRS.iter().map(|d| base.join(d).join(name))) {
                add(&mut found, read, format!("{to}/{name}"));
            }
        }
    }
    for name in VULKAN_CONFIGS {
        let candidates = CONFIG_DIRS
            .iter()
            .map(|d| base.join(d).join(name))
            .chain([base.join(name)]);
        if let Some(read) = first_file(candidates) {
            add(&mut found, read, format!("/etc/{name}"));
        }
    }

    // Library directories: libcuda's first, then the usual ones, each once.
    let mut lib_dirs = Vec::new();
    let mut canonical = BTreeSet::new();
    for dir in std::iter::once(lib_dir.to_path_buf()).chain(LIB_DIRS.iter().map(|d| base.join(d))) {
        if let Ok(c) = dir.canonicalize()
            && canonical.insert(c)
        {
            lib_dirs.push(dir);
        }
    }
    let first_dir_with = |wanted: &dyn Fn(&str) -> bool| -> Vec<PathBuf> {
        lib_dirs
            .iter()
            .map(|d| matching_in(d, wanted))
            .find(|m| !m.is_empty())
            .unwrap_or_default()
    };
    // nvcdi's graphics libraries, in its order: the links below follow it.
    let mut libraries: Vec<PathBuf> = Vec::new();
    for prefix in EGL_PLATFORM_LIBS {
        libraries.extend(first_dir_with(&|n: &str| {
            n.strip_prefix(prefix).is_some_and(|v| v.contains('.'))
        }));
    }
    let allocator = format!("libnvidia-allocator.so.{version}");
    let producer = format!("libnvidia-vulkan-producer.so.{version}");
    for name in [&allocator, &producer] {
        libraries.extend(first_dir_with(&|n: &str| n == name.as_str()));
    }
    let glxserver = format!("libglxserver_nvidia.so.{version}");
    let xorg_dirs: Vec<PathBuf> = XORG_UNDER_LIB_DIR
        .iter()
        .map(|d| lib_dir.join(d))
        .chain(XORG_LIB_ROOTS.iter().flat_map(|root| {
            XORG_MODULE_DIRS
                .iter()
                .map(move |d| base.join(root).join(d))
        }))
        .collect();
    for name in ["nvidia_drv.so", glxserver.as_str()] {
        libraries.extend(first_file(xorg_dirs.iter().map(|d| d.join(name))));
    }

    for read in libraries {
        let (Some(dir), Some(name)) = (read.parent(), read.file_name().and_then(|n| n.to_str()))
        else {
            continue;
        };
        let at = |file: &str| in_container(&dir.join(file));
        if name == allocator {
            // nvcdi leaves the allocator's mount to the driver libraries (it is one of them).
            found.symlinks.push(Symlink {
                target: "../libnvidia-allocator.so.1".into(),
                link: at("gbm/nvidia-drm_gbm.so"),
            });
            continue;
        }
        if name == producer {
            found.symlinks.push(Symlink {
                target: name.into(),
                link: at("libnvidia-vulkan-producer.so"),
            });
        } else if name == glxserver {
            found.symlinks.push(Symlink {
                target: name.into(),
                link: at("libglxserver_nvidia.so"),
            });
        } else if EGL_PLATFORM_LIBS.iter().any(|p| name.starts_with(p))
            && let Some(soname) = soname_link(dir, name)
        {
            found.soname_links.push(dir.join(soname));
        }
        let container = in_container(&read);
        add(&mut found, read, container);
    }

    if let Some(read) = first_file(BIN_DIRS.iter().map(|d| base.join(d).join("nvidia-xconfig"))) {
        let container = in_container(&read);
        add(&mut found, read, container);
    }
    found
}

fn first_file(candidates: impl IntoIterator<Item = PathBuf>) -> Option<PathBuf> {
    candidates.into_iter().find(|p| p.is_file())
}
