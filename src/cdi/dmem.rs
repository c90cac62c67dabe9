//! A share's memory limit for its whole container, through the cgroup v2 `dmem` controller.
//!
//! `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` caps each CUDA process of a container, not the container:
//! two processes of one pod each get the whole limit. Where the node has MPS memory partitioning
//! (NVIDIA driver r615 / CUDA 13.4 or later on a kernel with the `dmem` controller, 6.14 or later)
//! the driver registers each GPU's memory as a `dmem` region, listed in the root cgroup's
//! `dmem.capacity` as `nvidia/<pci bus id>/vidmem <bytes>`, and a cgroup's `dmem.max` line for
//! that region is a hard limit on all device memory its processes allocate (NVIDIA's "MPS v3
//! memory partitioning"). nvdra then adds this limit to a share's container as well as the
//! per-process one, which stays (it is what CUDA applies where `dmem` is missing).
//!
//! The container's cgroup does not exist when the kubelet prepares the claim, so the limit is a
//! CDI `createRuntime` hook ([`hook`]): the runtime runs it on the host after it made the
//! container's cgroup and before the container starts, with the container's OCI state (its
//! init's pid) on stdin. The hook is nvdra's own binary (`nvdra dmem-hook`, [`hook_main`]),
//! installed under the plugin's host directory at start ([`install_hook`]). It finds the
//! container's cgroup from `/proc/<pid>/cgroup`, enables `dmem` on the cgroups above it where
//! it is not enabled yet, writes the limit and reads it back. When it cannot, the runtime does
//! not start the container: a share whose promised limit cannot be applied does not run.
//!
//! Where `dmem.capacity` lists no region of a share's GPU (older drivers and kernels, cgroup v1,
//! or a plugin that cannot see the host's root cgroup) the spec has no hook and the per-process
//! limit alone applies.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, anyhow, bail};

use super::Hook;
use crate::inventory::PciBusId;

/// The OCI hook point: on the host, after the container's cgroup exists, before it starts.
const CREATE_RUNTIME: &str = "createRuntime";

/// The root cgroup's list of device memory regions and their sizes.
pub const CAPACITY_FILE: &str = "dmem.capacity";

/// A device memory region of the `dmem` controller and a limit on it, in bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Limit {
    /// The region as `dmem.capacity` names it, e.g. `nvidia/0000:3b:00.0/vidmem`.
    pub region: String,
    pub bytes: u64,
}

impl Limit {
    /// `<region>=<bytes>`: the hook's argument form.
    fn arg(&self) -> String {
        format!("{}={}", self.region, self.bytes)
    }

    fn parse_arg(arg: &str) -> Result<Self> {
        let (region, bytes) = arg
            .rsplit_once('=')
            .ok_or_else(|| anyhow!("limit {arg:?} is not <region>=<bytes>"))?;
        if region.is_empty() || region.chars().any(char::is_whitespace) {
            bail!("limit {arg:?} names no region (or one with white space)");
        }
        let bytes = bytes
            .parse()
            .with_context(|| format!("limit {arg:?}: {bytes:?} is not a number of bytes"))?;
        Ok(Self {
            region: region.into(),
            bytes,
        })
    }
}

/// The NVIDIA GPU memory regions `cgroup_root`'s `dmem.capacity` lists, as (PCI bus id,
/// region name). Empty when the file is missing (no `dmem` controller, cgroup v1, or not the
/// root cgroup); lines of other drivers and other NVIDIA regions are left out.
pub fn gpu_regions(cgroup_root: &Path) -> Result<Vec<(PciBusId, String)>> {
    let path = cgroup_root.join(CAPACITY_FILE);
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    Ok(text
        .lines()
        .filter_map(|line| {
            let region = line.split_whitespace().next()?;
            let mut parts = region.split('/');
            match (parts.next(), parts.next(), parts.next(), parts.next()) {
                (Some("nvidia"), Some(pci), Some("vidmem"), None) => {
                    Some((PciBusId::normalize(pci)?, region.to_string()))
                }
                _ => None,
            }
        })
        .collect())
}

/// The `createRuntime` hook that applies `limits` to the container's cgroup under
/// `cgroup_root` (a host path), run as `binary` (nvdra's installed copy).
pub fn hook(binary: &Path, cgroup_root: &Path, limits: &[Limit]) -> Hook {
    let mut args = vec![
        "nvdra".to_string(),
        "dmem-hook".into(),
        "--cgroup-root".into(),
        cgroup_root.display().to_string(),
    ];
    args.extend(limits.iter().map(Limit::arg));
    Hook {
        hook_name: CREATE_RUNTIME.into(),
        path: binary.display().to_string(),
        args,
        env: Vec::new(),
    }
}

/// Copies the running binary to `dir/nvdra` (a host directory: the hook runs on the host) unless
/// an identical copy is there, atomically, so a container being created meanwhile runs either
/// the old or the new binary, never half of one. Returns the installed path.
pub fn install_hook(dir: &Path) -> Result<PathBuf> {
    let exe = std::env::current_exe().context("finding nvdra's own binary")?;
    let binary = std::fs::read(&exe).with_context(|| format!("reading {}", exe.display()))?;
    let target = dir.join("nvdra");
    if std::fs::read(&target).is_ok_and(|old| old == binary) {
        return Ok(target);
    }
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let tmp = dir.join(".nvdra.tmp");
    let write = || -> std::io::Result<()> {
        use std::os::unix::fs::OpenOptionsExt;
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o755)
            .open(&tmp)?;
        f.write_all(&binary)?;
        f.sync_all()?;
        std::fs::rename(&tmp, &target)
    };
    write().with_context(|| format!("installing the dmem hook at {}", target.display()))?;
    Ok(target)
}

/// The container's cgroup v2 path (relative to the root) from `/proc/<pid>/cgroup`'s `0::`
/// line.
fn cgroup_of(proc_root: &Path, pid: u32) -> Result<String> {
    let path = proc_root.join(pid.to_string()).join("cgroup");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    text.lines()
        .find_map(|l| l.strip_prefix("0::"))
        .map(|p| p.trim().trim_start_matches('/').to_string())
        .ok_or_else(|| {
            anyhow!(
                "{} has no cgroup v2 entry (0::): the process is not in a cgroup v2 hierarchy",
                path.display()
            )
        })
}

/// Whether `cgroup` has `dmem` in its `cgroup.subtree_control` (its children may limit it).
fn delegates_dmem(cgroup: &Path) -> Result<bool> {
    let path = cgroup.join("cgroup.subtree_control");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    Ok(text.split_whitespace().any(|c| c == "dmem"))
}

/// Applies `limits` to the cgroup v2 of process `pid` under `cgroup_root` (reading the pid's
/// cgroup under `proc_root`): enables `dmem` on each cgroup from the root down to the
/// container's parent where it is not yet, writes one `dmem.max` line per limit and reads them
/// back. Returns the container's cgroup directory.
pub fn apply(cgroup_root: &Path, proc_root: &Path, pid: u32, limits: &[Limit]) -> Result<PathBuf> {
    let rel = cgroup_of(proc_root, pid)?;
    let dir = cgroup_root.join(&rel);
    if rel.is_empty() || !dir.is_dir() {
        bail!(
            "process {pid}'s cgroup {} is not a cgroup below {}",
            dir.display(),
            cgroup_root.display()
        );
    }
    let controllers = cgroup_root.join("cgroup.controllers");
    let available = std::fs::read_to_string(&controllers)
        .with_context(|| format!("reading {}", controllers.display()))?;
    if !available.split_whitespace().any(|c| c == "dmem") {
        bail!(
            "cannot limit {}: {} does not list dmem (the kernel has no dmem cgroup controller)",
            dir.display(),
            controllers.display()
        );
    }
    let mut cgroup = cgroup_root.to_path_buf();
    for part in Path::new(&rel)
        .parent()
        .into_iter()
        .flat_map(Path::components)
    {
        enable_dmem(&cgroup)?;
        cgroup.push(part);
    }
    enable_dmem(&cgroup)?;

    let max = dir.join("dmem.max");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .open(&max)
        .with_context(|| format!("opening {}", max.display()))?;
    for l in limits {
        // One write per line: the kernel parses each write on its own.
        f.write_all(format!("{} {}\n", l.region, l.bytes).as_bytes())
            .with_context(|| format!("writing {} {} to {}", l.region, l.bytes, max.display()))?;
    }
    drop(f);
    let set =
        std::fs::read_to_string(&max).with_context(|| format!("reading {}", max.display()))?;
    for l in limits {
        let applied = set.lines().any(|line| {
            let mut f = line.split_whitespace();
            f.next() == Some(l.region.as_str()) && f.next() == Some(l.bytes.to_string().as_str())
        });
        if !applied {
            bail!(
                "{} does not show {} {} after writing it (it reads {:?}): the driver may not \
                 have registered the region",
                max.display(),
                l.region,
                l.bytes,
                set.trim()
            );
        }
    }
    Ok(dir)
}

/// Writes `+dmem` to `cgroup`'s `cgroup.subtree_control` unless it delegates `dmem` already.
fn enable_dmem(cgroup: &Path) -> Result<()> {
    if delegates_dmem(cgroup)? {
        return Ok(());
    }
    let path = cgroup.join("cgroup.subtree_control");
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .and_then(|mut f| f.write_all(b"+dmem"))
        .with_context(|| format!("enabling dmem in {}", path.display()))
}

/// `nvdra dmem-hook [--cgroup-root DIR] <region>=<bytes>...`, run by the container runtime as a
/// `createRuntime` hook with the container's OCI state on stdin. Exit code 0: applied; 1: not
/// (the runtime then does not start the container; the message says why).
pub fn hook_main(args: Vec<String>) -> Result<()> {
    let mut cgroup_root = PathBuf::from("/sys/fs/cgroup");
    let mut limits = Vec::new();
    let mut args = args.into_iter();
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--cgroup-root" => {
                cgroup_root = args
                    .next()
                    .ok_or_else(|| anyhow!("--cgroup-root needs a directory"))?
                    .into();
            }
            _ => limits.push(Limit::parse_arg(&arg)?),
        }
    }
    if limits.is_empty() {
        bail!("no limit given: usage: nvdra dmem-hook [--cgroup-root DIR] <region>=<bytes>...");
    }
    let mut state = String::new();
    std::io::stdin()
        .read_to_string(&mut state)
        .context("reading the container's OCI state from stdin")?;
    let pid = oci_state_pid(&state)?;
    let dir = apply(&cgroup_root, Path::new("/proc"), pid, &limits)?;
    eprintln!(
        "nvdra dmem-hook: {} limited to {}",
        dir.display(),
        limits.iter().map(Limit::arg).collect::<Vec<_>>().join(", ")
    );
    Ok(())
}

/// The container's init pid from its OCI state (the runtime spec's `State`: `pid` is set once
/// the container is created).
fn oci_state_pid(state: &str) -> Result<u32> {
    let v: serde_json::Value =
        serde_json::from_str(state).context("the OCI state on stdin is not JSON")?;
    v.get("pid")
        .and_then(serde_json::Value::as_u64)
        .and_then(|p| u32::try_from(p).ok())
        .filter(|p| *p > 0)
        .ok_or_else(|| anyhow!("the OCI state on stdin has no pid: {}", state.trim()))
}

#[cfg(test)]
mod tests;
