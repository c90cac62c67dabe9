//! A share's memory limits on its whole container, set by NVIDIA's driver: MPS v3 memory
//! partitioning (driver R615 / CUDA 13.4 or later, cgroup v2 at `/sys/fs/cgroup`, whole GPUs:
//! MIG devices are not supported), through NVML's `nvmlDeviceSetMemoryLimits_v1`, the interface
//! NVIDIA documents for it on both of its backends (`dmem`, kernel 6.14+, and `misc`). NVIDIA
//! says never to write the `dmem.*` files directly: the driver keeps the ancestors'
//! reservations, which direct writes bypass.
//!
//! Per cgroup and GPU the driver holds a **soft** limit (memory guaranteed; past it the cgroup
//! "borrows" and MPS may evict it under contention) and a **hard** one (an allocation past it
//! fails). A share's soft limit is the memory the scheduler counted for it, its hard limit its
//! burst limit ([`MemoryLimits`] on [`PreparedDevice::memory_limits`]; equal unless the claim
//! asks to burst). `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`, per CUDA process, stays in every share's
//! spec beside them: it is the only limit where partitioning is missing.
//!
//! The container's cgroup does not exist when the kubelet prepares the claim, so the limits are
//! a CDI `createRuntime` hook ([`Partitioning::hooks`]): the runtime runs it on the host after
//! it made the container's cgroup and before the container's process runs, with the OCI state
//! (the init's pid) on stdin, at every start of the container (restarts included). The hook is
//! nvdra's own binary (`nvdra memory-limit-hook`, [`hook_main`]) installed on the host
//! ([`super::install_hook`]); it finds the container's own leaf cgroup from `/proc/<pid>/cgroup`,
//! loads the driver's `libnvidia-ml.so` from the path the plugin wrote into the spec, sets both
//! limits on the leaf and reads them back. Any failure exits non-zero naming the cgroup, the GPU
//! and NVML's error, and the runtime then does not start the container: a share whose promised
//! limit cannot be applied does not run.
//!
//! **Undo.** NVIDIA's docs ask, with the `dmem` backend, for the soft limit to be zeroed before
//! the leaf cgroup is removed, or each ancestor keeps the reservation. The only OCI hook after
//! the container's process exits is `poststop`, and runc (`libcontainer/state_linux.go`,
//! `destroy`: `cgroupManager.Destroy()` then `runPoststopHooks`) and crun
//! (`container_delete_internal`: `libcrun_cgroup_destroy` then `run_poststop_hooks`) both remove
//! the cgroup first, and give the hook no pid. So the spec also has a `poststop` hook
//! (`--release`) that clears the limits (soft 0, hard max) where the leaf still exists, finding
//! it in a record the `createRuntime` hook leaves in the container's bundle directory
//! ([`RECORD`]), and does nothing where the runtime already removed it, which with runc and crun
//! is always: there the ancestors' reservations stay (see the README).
//!
//! Which limit holds for a share is [`enforcement`]: `container` where its spec carries the
//! hook, `process` where only the per-process MPS limit does.

use std::collections::BTreeSet;
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, anyhow, bail};
use nvml_wrapper::Nvml;
use nvml_wrapper::error::NvmlError;

use super::{CdiOptions, Hook, OciState, PreparedDevice};
use crate::inventory::nvml::memory_limits::{
    GET_MEMORY_LIMITS, SET_MEMORY_LIMITS, memory_limits, set_memory_limits,
};
use crate::inventory::{GpuUuid, MemoryLimits};

/// The hook's subcommand of nvdra.
pub const SUBCOMMAND: &str = "memory-limit-hook";
/// The subcommand of the direct `dmem.max` writer this hook replaced, still named by specs an
/// older plugin wrote; it refuses ([`legacy_main`]).
pub const LEGACY_SUBCOMMAND: &str = "dmem-hook";
/// The OCI hook point that sets the limits: on the host, after the container's cgroup exists,
/// before its process runs.
const CREATE_RUNTIME: &str = "createRuntime";
/// The OCI hook point that clears them: after the container's process exited.
const POSTSTOP: &str = "poststop";
/// The file in the container's bundle directory naming the cgroup the limits were set on, for
/// the `poststop` hook (whose OCI state has no pid).
pub const RECORD: &str = "nvdra-memory-limits";

/// Which limit holds a share's memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Enforcement {
    /// The driver's per-cgroup limits on the container's own cgroup (the spec's hook), beside
    /// the per-process one.
    Container,
    /// Only the MPS client limit, per CUDA process (`CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`).
    Process,
}

impl Enforcement {
    /// `container` or `process`: a metric label's value.
    pub fn as_str(self) -> &'static str {
        match self {
            Enforcement::Container => "container",
            Enforcement::Process => "process",
        }
    }
}

impl std::fmt::Display for Enforcement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// MPS v3 memory partitioning on this node, as the plugin found it at start (host paths).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Partitioning {
    /// nvdra's binary installed on the host ([`super::install_hook`]).
    pub binary: PathBuf,
    /// The driver's NVML library on the host, which the hook loads.
    pub nvml: PathBuf,
    /// The whole GPUs whose memory the driver partitions per cgroup.
    pub gpus: BTreeSet<GpuUuid>,
    /// The driver's `dmem` backend is in use (the root cgroup's `dmem.capacity` lists NVIDIA
    /// regions). Its soft limit is the cgroup's `dmem.min`, a reservation every ancestor keeps
    /// unless it is zeroed before the cgroup is removed — which no hook can do: runc and crun
    /// remove the container's cgroup before they run `poststop` hooks. So on `dmem` only the
    /// hard limit is set (soft 0), and the scheduler's packing stands in for the guarantee.
    pub dmem: bool,
}

impl Partitioning {
    /// The spec's hooks for `limits`, on cgroups under `cgroup_root` (a host path): the
    /// `createRuntime` one that sets them, then the `poststop` one that clears them.
    pub fn hooks(&self, cgroup_root: &Path, limits: &[GpuLimit]) -> [Hook; 2] {
        let args = |release: bool| {
            let mut args = vec!["nvdra".to_string(), SUBCOMMAND.into()];
            if release {
                args.push("--release".into());
            }
            args.extend([
                "--nvml".into(),
                self.nvml.display().to_string(),
                "--cgroup-root".into(),
                cgroup_root.display().to_string(),
            ]);
            args.extend(limits.iter().map(|l| {
                let mut l = l.clone();
                if self.dmem {
                    l.limits.soft = 0;
                }
                l.arg()
            }));
            args
        };
        let hook = |hook_name: &str, release| Hook {
            hook_name: hook_name.into(),
            path: self.binary.display().to_string(),
            args: args(release),
            env: Vec::new(),
        };
        [hook(CREATE_RUNTIME, false), hook(POSTSTOP, true)]
    }
}

/// Which limit holds `device`'s memory under `opts`; `None` for a device that is not a share.
/// The builder adds the hook exactly where this says [`Enforcement::Container`].
pub fn enforcement(opts: &CdiOptions, device: &PreparedDevice) -> Option<Enforcement> {
    device.memory_limits?;
    Some(match &opts.partitioning {
        Some(p) if device.mig.is_none() && p.gpus.contains(&device.gpu.uuid) => {
            Enforcement::Container
        }
        _ => Enforcement::Process,
    })
}

/// Whether a written spec carries the memory-limit hook: [`Enforcement::Container`] if so
/// (what the builder's tests check a spec by).
#[cfg(test)]
pub fn spec_enforcement(spec: &super::Spec) -> Enforcement {
    let hooked = spec
        .container_edits
        .hooks
        .iter()
        .chain(spec.devices.iter().flat_map(|d| &d.container_edits.hooks))
        .any(|h| {
            h.hook_name == CREATE_RUNTIME && h.args.get(1).map(String::as_str) == Some(SUBCOMMAND)
        });
    if hooked {
        Enforcement::Container
    } else {
        Enforcement::Process
    }
}

/// One GPU's limits, as the hook takes them: `<GPU UUID>=<soft bytes>:<hard bytes>`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuLimit {
    pub gpu: GpuUuid,
    pub limits: MemoryLimits,
}

impl GpuLimit {
    fn arg(&self) -> String {
        format!(
            "{}={}:{}",
            self.gpu.as_str(),
            self.limits.soft,
            self.limits.hard
        )
    }

    fn parse_arg(arg: &str) -> Result<Self> {
        let bad = || anyhow!("limit {arg:?} is not <GPU UUID>=<soft bytes>:<hard bytes>");
        let (gpu, limits) = arg.rsplit_once('=').ok_or_else(bad)?;
        let (soft, hard) = limits.split_once(':').ok_or_else(bad)?;
        if gpu.is_empty() || gpu.chars().any(char::is_whitespace) {
            return Err(bad());
        }
        let bytes = |s: &str| {
            s.parse::<u64>()
                .with_context(|| format!("limit {arg:?}: {s:?} is not a number of bytes"))
        };
        let limits = MemoryLimits {
            soft: bytes(soft)?,
            hard: bytes(hard)?,
        };
        if limits.soft > limits.hard {
            bail!("limit {arg:?}: the soft limit is above the hard one");
        }
        Ok(Self {
            gpu: GpuUuid(gpu.into()),
            limits,
        })
    }
}

/// The hook's arguments.
#[derive(Debug, PartialEq, Eq)]
struct Args {
    /// `poststop`: clear the limits instead of setting them.
    release: bool,
    nvml: PathBuf,
    cgroup_root: PathBuf,
    /// Where `<pid>/cgroup` is read: `/proc`, another only in tests.
    proc_root: PathBuf,
    limits: Vec<GpuLimit>,
}

const USAGE: &str = "usage: nvdra memory-limit-hook [--release] --nvml LIBRARY [--cgroup-root DIR] \
                     <GPU UUID>=<soft bytes>:<hard bytes>...";

impl Args {
    fn parse(args: Vec<String>) -> Result<Self> {
        let mut out = Self {
            release: false,
            nvml: PathBuf::new(),
            cgroup_root: PathBuf::from("/sys/fs/cgroup"),
            proc_root: PathBuf::from("/proc"),
            limits: Vec::new(),
        };
        let mut args = args.into_iter();
        while let Some(arg) = args.next() {
            let mut value = |flag: &str| {
                args.next()
                    .map(PathBuf::from)
                    .ok_or_else(|| anyhow!("{flag} needs a value; {USAGE}"))
            };
            match arg.as_str() {
                "--release" => out.release = true,
                "--nvml" => out.nvml = value("--nvml")?,
                "--cgroup-root" => out.cgroup_root = value("--cgroup-root")?,
                "--proc-root" => out.proc_root = value("--proc-root")?,
                _ => out.limits.push(GpuLimit::parse_arg(&arg)?),
            }
        }
        if out.nvml.as_os_str().is_empty() {
            bail!("no NVML library given; {USAGE}");
        }
        if out.limits.is_empty() {
            bail!("no limit given; {USAGE}");
        }
        Ok(out)
    }
}

/// `nvdra memory-limit-hook [--release] --nvml LIBRARY [--cgroup-root DIR] <GPU>=<soft>:<hard>...`,
/// run by the container runtime with the container's OCI state on stdin. Exit code 0: the limits
/// are set (or cleared); 1: not, and the runtime does not start the container (the message says
/// why).
pub fn hook_main(args: Vec<String>) -> Result<()> {
    let args = Args::parse(args)?;
    let state = OciState::from_stdin()?;
    if args.release {
        return release(&args, &state);
    }
    let cgroup = container_cgroup(&args.cgroup_root, &args.proc_root, state.pid()?)?;
    apply(&args.nvml, &cgroup, &args.limits)?;
    if let Some(bundle) = &state.bundle {
        // Only the clearing after the container needs it: a failure here does not stop it.
        let record = bundle.join(RECORD);
        if let Err(e) = std::fs::write(&record, cgroup.as_os_str().as_bytes()) {
            eprintln!(
                "nvdra {SUBCOMMAND}: cannot write {}: {e}; the limits will not be cleared \
                 when the container stops",
                record.display()
            );
        }
    }
    eprintln!(
        "nvdra {SUBCOMMAND}: {} limited to {}",
        cgroup.display(),
        args.limits
            .iter()
            .map(|l| format!("{} on {}", l.limits, l.gpu.as_str()))
            .collect::<Vec<_>>()
            .join(", ")
    );
    Ok(())
}

/// `nvdra dmem-hook ...`: refuses. The direct `dmem.max` writer it named is gone (NVIDIA's driver
/// keeps the ancestors' reservations, which direct writes bypass); the plugin rewrites the specs
/// of prepared claims with [`SUBCOMMAND`] when it starts, so the container starts at the
/// kubelet's next try after that.
pub fn legacy_main(_args: Vec<String>) -> Result<()> {
    bail!(
        "this container's CDI spec names `nvdra {LEGACY_SUBCOMMAND}`, the direct dmem.max writer of \
         an older nvdra, which is gone: memory limits are set through NVML now. The plugin \
         rewrites the claim's spec when it starts; the container starts once it has"
    )
}

/// The container's own cgroup v2 directory under `cgroup_root`: `<pid>`'s `0::` line in
/// `proc_root`.
pub fn container_cgroup(cgroup_root: &Path, proc_root: &Path, pid: u32) -> Result<PathBuf> {
    let path = proc_root.join(pid.to_string()).join("cgroup");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let rel = text
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .map(|p| p.trim().trim_start_matches('/'))
        .ok_or_else(|| {
            anyhow!(
                "{} has no cgroup v2 entry (0::): the process is not in a cgroup v2 hierarchy",
                path.display()
            )
        })?;
    let dir = cgroup_root.join(rel);
    if rel.is_empty() || !dir.is_dir() {
        bail!(
            "process {pid}'s cgroup {} is not a cgroup below {}",
            dir.display(),
            cgroup_root.display()
        );
    }
    Ok(dir)
}

/// Loads NVML from `library` and sets each GPU's limits on `cgroup` (its full path), reading
/// each back.
pub fn apply(library: &Path, cgroup: &Path, limits: &[GpuLimit]) -> Result<()> {
    let nvml = open(library)?;
    for l in limits {
        set(&nvml, library, cgroup, l.gpu.as_str(), l.limits)?;
    }
    Ok(())
}

/// The `poststop` side: clears the limits of the cgroup the record names, where it still exists.
fn release(args: &Args, state: &OciState) -> Result<()> {
    let Some(bundle) = &state.bundle else {
        return Ok(());
    };
    let record = bundle.join(RECORD);
    let cgroup = match std::fs::read(&record) {
        Ok(bytes) => PathBuf::from(OsStr::from_bytes(bytes.trim_ascii())),
        // Never set (the hook failed, or the container was created before it existed).
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e).with_context(|| format!("reading {}", record.display())),
    };
    if !cgroup.starts_with(&args.cgroup_root) {
        bail!(
            "{} names {}, not a cgroup below {}",
            record.display(),
            cgroup.display(),
            args.cgroup_root.display()
        );
    }
    if cgroup.is_dir() {
        let nvml = open(&args.nvml)?;
        for l in &args.limits {
            set(
                &nvml,
                &args.nvml,
                &cgroup,
                l.gpu.as_str(),
                MemoryLimits::NONE,
            )?;
        }
        eprintln!("nvdra {SUBCOMMAND}: limits of {} cleared", cgroup.display());
    } else {
        eprintln!(
            "nvdra {SUBCOMMAND}: {} is gone: the runtime removed it before this hook ran, and \
             its limits with it",
            cgroup.display()
        );
    }
    let _ = std::fs::remove_file(&record);
    Ok(())
}

/// The driver's NVML, loaded from `library`.
fn open(library: &Path) -> Result<Nvml> {
    Nvml::builder()
        .lib_path(library.as_os_str())
        .init()
        .with_context(|| format!("loading NVML from {}", library.display()))
}

/// Sets `limits` on `cgroup` for `gpu` and reads them back.
fn set(nvml: &Nvml, library: &Path, cgroup: &Path, gpu: &str, limits: MemoryLimits) -> Result<()> {
    let what = || format!("GPU {gpu}, cgroup {}", cgroup.display());
    let device = nvml
        .device_by_uuid(gpu)
        .with_context(|| format!("{}: nvmlDeviceGetHandleByUUID", what()))?;
    set_memory_limits(nvml, &device, cgroup, limits)
        .map_err(|e| nvml_error(e, library))
        .with_context(|| format!("{}: {SET_MEMORY_LIMITS} ({limits})", what()))?;
    let (read, _used) = memory_limits(nvml, &device, cgroup)
        .map_err(|e| nvml_error(e, library))
        .with_context(|| format!("{}: {GET_MEMORY_LIMITS} after setting {limits}", what()))?;
    if read != limits {
        bail!(
            "{}: {GET_MEMORY_LIMITS} reads {read} after {SET_MEMORY_LIMITS} set {limits}",
            what()
        );
    }
    Ok(())
}

/// NVML's error, with what a missing call means.
fn nvml_error(e: NvmlError, library: &Path) -> anyhow::Error {
    match e {
        NvmlError::FailedToLoadSymbol(_) | NvmlError::FunctionNotFound => anyhow!(
            "{e}: {} has no per-cgroup memory limits (a driver older than R615)",
            library.display()
        ),
        e => anyhow::Error::new(e),
    }
}

#[cfg(test)]
mod tests;
