//! CDI tests: a fake host (driver root with device nodes, libraries and binaries) and shared
//! fixtures; the tests themselves live in one file per area.

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::{MetadataExt, symlink};
use std::path::{Path, PathBuf};

use super::builder::parse_mig_minors;
use super::inputs::split_dev;
use super::*;
use crate::inventory::Gpu;
use crate::inventory::topology::load_profile;
use crate::sharing::{MpsSettings, Sharing, TimeSliceInterval};

mod builder;
mod inputs;
mod names;
mod nvidia_form;
mod toolkit;
mod writer;

const UID: &str = "dab5ab50-1111-2222-3333-444455556666";

/// A fake host: a driver root with device nodes (symlinks to /dev/null, a real char device),
/// driver libraries and binaries.
struct Host {
    dir: tempfile::TempDir,
    opts: CdiOptions,
}

impl Host {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().to_path_buf();
        fs::create_dir_all(root.join("dev")).unwrap();
        let opts = CdiOptions::resolve("gpu.nvidia.com", &DriverRoot::at(&root)).unwrap();
        Self { dir, opts }
    }

    fn root(&self) -> &Path {
        self.dir.path()
    }

    fn node(&self, rel: &str) {
        let path = self.root().join("dev").join(rel);
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        symlink("/dev/null", path).unwrap();
    }

    fn file(&self, rel: &str) -> PathBuf {
        let path = self.root().join(rel);
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(&path, rel).unwrap();
        path
    }

    /// A stand-in hook binary at `rel` (`…/nvidia-cdi-hook` or `…/nvidia-ctk`) that answers
    /// `--version` as NVIDIA's toolkit `version` does.
    fn hook(&self, rel: &str, version: &str) -> PathBuf {
        let name = rel.rsplit('/').next().unwrap();
        self.script(
            rel,
            &format!("printf '%s' '{}'", version_output(name, version)),
        )
    }

    /// An executable `/bin/sh` script at `rel` running `body`.
    fn script(&self, rel: &str, body: &str) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let path = self.root().join(rel);
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
        fs::set_permissions(&path, fs::Permissions::from_mode(0o755)).unwrap();
        path
    }
}

/// What NVIDIA's hook binary `name` prints for `--version`: urfave/cli's
/// `<name> version <version>`, the version string of `internal/info` (the version, then a
/// `commit:` line).
fn version_output(name: &str, version: &str) -> String {
    let app = match name {
        "nvidia-ctk" => "NVIDIA Container Toolkit CLI",
        _ => "NVIDIA CDI Hook",
    };
    format!("{app} version {version}\ncommit: f202b80a1b2c3d4e5f60718293a4b5c6d7e8f901\n")
}

/// The toolkit version stand-in hooks report unless a test says otherwise.
const TOOLKIT: &str = "1.19.1";

fn null_numbers() -> (i64, i64, u32) {
    let m = fs::metadata("/dev/null").unwrap();
    let (major, minor) = split_dev(m.rdev());
    (major, minor, m.mode() & 0o777)
}

fn h100(index: usize) -> Gpu {
    load_profile("dgx-h100", "n").unwrap().gpus[index].clone()
}

fn gpu_device(index: usize, sharing: Sharing) -> PreparedDevice {
    let gpu = h100(index);
    PreparedDevice {
        name: format!("gpu-{}", gpu.minor),
        gpu,
        mig: None,
        sharing,
        mps_pipe_dir: None,
        mps_shm_dir: None,
        memory_limits: None,
    }
}

fn mig_device(mig_index: usize) -> PreparedDevice {
    let inv = load_profile("a100-mig-mixed", "n").unwrap();
    let gpu = inv.gpus[1].clone();
    let mig = gpu.mig.devices[mig_index].clone();
    PreparedDevice {
        name: format!(
            "gpu-{}-mig-{}-{}-{}",
            gpu.minor,
            mig.profile.replace('.', ""),
            mig.gi_profile_id,
            mig.placement.start
        ),
        gpu,
        mig: Some(mig),
        sharing: Sharing::Exclusive,
        mps_pipe_dir: None,
        mps_shm_dir: None,
        memory_limits: None,
    }
}

fn env_of<'a>(edits: &'a ContainerEdits, name: &str) -> Vec<&'a str> {
    edits
        .env
        .iter()
        .filter_map(|e| e.strip_prefix(name)?.strip_prefix('='))
        .collect()
}
