//! Which processes hold a GPU open: what makes the driver answer a MIG mode switch with
//! `IN_USE` (it switches only a GPU no process has open, nvdra's own NVML handle aside).
//!
//! A GPU is held through its device file `/dev/nvidia<minor>`, so the scan reads every process's
//! open files under a proc root (`/proc`, or the host's `/proc` mounted into nvdra's container:
//! `--proc-root`, `NVDRA_PROC_ROOT`, the manifests' `/host/proc`). An open file is the GPU's when
//! it leads to the character device of the NVIDIA driver's major (195) and the GPU's minor, the
//! same whatever path the holder's mount namespace gives it (a container's `/dev/nvidia0` is a
//! node of its own, with the same device number), or, where a device directory is given, when it
//! is that directory's `nvidia<minor>` file itself (a test's stand-in for the node). NVML's list
//! of a GPU's compute processes adds those it knows (a CUDA context always holds the file too,
//! but the scan cannot read every process where nvdra is not root).
//!
//! Each holder is named by `/proc/<pid>/comm` and sorted by whose it is ([`kind_of`]): nvdra's
//! own process is left out; `nvidia-persistenced` is [`Harmless`](HolderKind::Harmless)
//! (persistence mode is what MIG mode needs: NVIDIA's DGX guide stops `nvsm` and DCGM before
//! `nvidia-smi -mig 1`, never the persistence daemon); an MPS control daemon or server
//! (`nvidia-cuda-mps-*`) is nvdra's own ([`OwnMps`](HolderKind::OwnMps), which nvdra waits
//! for); anything else is [`Foreign`](HolderKind::Foreign). A process that cannot be read (it
//! exited meanwhile, or belongs to someone nvdra may not inspect) is skipped silently.
//!
//! Cost: one walk of the proc root per [`HolderScan::scan`] (its process directories, each
//! process's `fd/` and one `readlink` per open file; a `stat` only for files named `nvidia*`),
//! whatever the number of GPUs.

use std::collections::BTreeMap;
use std::fs;
use std::io::Read;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use super::{Holder, HolderKind};

/// The character-device major of the NVIDIA driver's GPU nodes (`/dev/nvidia<minor>`), fixed
/// by the driver (`NV_MAJOR_DEVICE_NUMBER`).
pub const NVIDIA_MAJOR: u32 = 195;

/// Where `nvidia-persistenced` runs, the kernel keeps the first 15 bytes of a program's name as
/// its `comm` (`TASK_COMM_LEN` is 16 with the NUL).
const COMM_LEN: usize = 15;

/// How much of a process's `cmdline` is read for its program's name (`PATH_MAX`).
const CMDLINE_HEAD: u64 = 4096;

/// Where and how to look for the holders of GPUs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HolderScan {
    proc_root: PathBuf,
    device_dir: Option<PathBuf>,
}

impl Default for HolderScan {
    fn default() -> Self {
        Self::new("/proc")
    }
}

impl HolderScan {
    /// Scans the processes under `proc_root` (`/proc`, or the host's mounted elsewhere).
    pub fn new(proc_root: impl Into<PathBuf>) -> Self {
        Self {
            proc_root: proc_root.into(),
            device_dir: None,
        }
    }

    /// Also counts an open file as GPU `m`'s when it is `<dir>/nvidia<m>` itself (the same file,
    /// by device and inode): the directory where nvdra sees the device nodes, or a test's
    /// directory of stand-in files.
    pub fn with_device_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.device_dir = Some(dir.into());
        self
    }

    pub fn proc_root(&self) -> &Path {
        &self.proc_root
    }

    /// The holders of each GPU of `minors`, by minor (every minor asked for has an entry, empty
    /// when nothing holds it), each list sorted by pid. nvdra's own process is left out.
    pub fn scan(&self, minors: &[u32]) -> BTreeMap<u32, Vec<Holder>> {
        let mut out: BTreeMap<u32, Vec<Holder>> = minors.iter().map(|m| (*m, vec![])).collect();
        if minors.is_empty() {
            return out;
        }
        let stand_ins = self.stand_ins(minors);
        let own = own_pid(&self.proc_root);
        let Ok(entries) = fs::read_dir(&self.proc_root) else {
            return out;
        };
        for entry in entries.flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|n| n.parse::<u32>().ok())
            else {
                continue;
            };
            if pid == own {
                continue;
            }
            let held = self.held_minors(pid, minors, &stand_ins);
            if held.is_empty() {
                continue;
            }
            let holder = self.holder(pid);
            for m in held {
                if let Some(list) = out.get_mut(&m) {
                    list.push(holder.clone());
                }
            }
        }
        for list in out.values_mut() {
            list.sort();
        }
        out
    }

    /// `holders` with each of `pids` (NVML's compute processes of the same GPU) not among them
    /// added, described as the scan describes a process, sorted by pid; nvdra's own process
    /// is left out.
    pub fn with_processes(&self, mut holders: Vec<Holder>, pids: &[u32]) -> Vec<Holder> {
        let own = own_pid(&self.proc_root);
        for &pid in pids {
            if pid != own && holders.iter().all(|h| h.pid != pid) {
                holders.push(self.holder(pid));
            }
        }
        holders.sort();
        holders
    }

    /// Process `pid` as a holder: its name (empty where unreadable) and kind.
    pub fn holder(&self, pid: u32) -> Holder {
        let name = process_name(&self.proc_root.join(pid.to_string()));
        Holder {
            pid,
            kind: kind_of(&name),
            name,
        }
    }

    /// The (device, inode) of `<device dir>/nvidia<m>` for each minor whose file exists.
    fn stand_ins(&self, minors: &[u32]) -> Vec<((u64, u64), u32)> {
        let Some(dir) = &self.device_dir else {
            return Vec::new();
        };
        minors
            .iter()
            .filter_map(|m| {
                let meta = fs::metadata(dir.join(format!("nvidia{m}"))).ok()?;
                Some(((meta.dev(), meta.ino()), *m))
            })
            .collect()
    }

    /// The minors of `minors` whose device file process `pid` holds open (none when its open
    /// files cannot be read).
    fn held_minors(&self, pid: u32, minors: &[u32], stand_ins: &[((u64, u64), u32)]) -> Vec<u32> {
        let fd_dir = self.proc_root.join(pid.to_string()).join("fd");
        let Ok(fds) = fs::read_dir(&fd_dir) else {
            return Vec::new();
        };
        let mut held = Vec::new();
        for fd in fds.flatten() {
            let path = fd.path();
            // The cheap filter first: most open files are sockets, pipes and other files.
            let Ok(target) = fs::read_link(&path) else {
                continue;
            };
            if !target
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("nvidia"))
            {
                continue;
            }
            // Through the proc link: the file the process holds, wherever its namespace has it.
            let Ok(meta) = fs::metadata(&path) else {
                continue;
            };
            let minor = if meta.file_type().is_char_device() {
                gpu_minor(meta.rdev())
            } else {
                stand_ins
                    .iter()
                    .find(|(id, _)| *id == (meta.dev(), meta.ino()))
                    .map(|(_, m)| *m)
            };
            if let Some(m) = minor.filter(|m| minors.contains(m) && !held.contains(m)) {
                held.push(m);
            }
        }
        held
    }
}

/// `pids` as holders known by nothing but their pid (no scan to name them): foreign, sorted.
pub fn unnamed(pids: &[u32]) -> Vec<Holder> {
    let mut out: Vec<Holder> = pids
        .iter()
        .map(|&pid| Holder {
            pid,
            name: String::new(),
            kind: HolderKind::Foreign,
        })
        .collect();
    out.sort();
    out.dedup();
    out
}

/// The GPU minor of device number `rdev` when it is a GPU node of the NVIDIA driver (major 195,
/// minors below 254: 254 is `nvidia-modeset`, 255 `nvidiactl`).
pub fn gpu_minor(rdev: u64) -> Option<u32> {
    // glibc's gnu_dev_major/gnu_dev_minor.
    let major = (((rdev >> 32) & 0xffff_f000) | ((rdev >> 8) & 0x0000_0fff)) as u32;
    let minor = (((rdev >> 12) & 0xffff_ff00) | (rdev & 0x0000_00ff)) as u32;
    (major == NVIDIA_MAJOR && minor < 254).then_some(minor)
}

/// Whose a process named `comm` is (see the module doc). An empty (unreadable) name is
/// foreign: nothing says it will go by itself.
pub fn kind_of(comm: &str) -> HolderKind {
    if is_program(comm, "nvidia-persistenced") {
        HolderKind::Harmless
    } else if comm.starts_with("nvidia-cuda-mps") {
        HolderKind::OwnMps
    } else {
        HolderKind::Foreign
    }
}

/// Whether `comm` is `program`'s name, whole or as the kernel keeps it (its first 15 bytes).
fn is_program(comm: &str, program: &str) -> bool {
    comm == program || (comm.len() == COMM_LEN && program.starts_with(comm))
}

/// nvdra's pid as the proc root numbers it: `<root>/self` (the host's pid where the root is
/// the host's `/proc` seen from a container), else this process's own.
pub fn own_pid(proc_root: &Path) -> u32 {
    fs::read_link(proc_root.join("self"))
        .ok()
        .and_then(|t| t.to_str().and_then(|s| s.parse().ok()))
        .unwrap_or_else(std::process::id)
}

/// `<dir>/comm`, or, where the kernel cut it to 15 bytes, the file name of the program
/// `<dir>/cmdline` names when that begins with it (`nvidia-persistenced`, not
/// `nvidia-persiste`); empty where unreadable.
fn process_name(dir: &Path) -> String {
    let comm = fs::read_to_string(dir.join("comm"))
        .map(|c| c.trim_end_matches('\n').to_string())
        .unwrap_or_default();
    if comm.len() < COMM_LEN {
        return comm;
    }
    // A process sets its own command line, of any length: read only as far as a program's
    // path goes.
    let mut head = Vec::new();
    let read = fs::File::open(dir.join("cmdline"))
        .and_then(|f| f.take(CMDLINE_HEAD).read_to_end(&mut head));
    let full = read.ok().and_then(|_| {
        let argv0 = head.split(|b| *b == 0).next()?;
        let name = Path::new(std::str::from_utf8(argv0).ok()?).file_name()?;
        name.to_str().map(str::to_string)
    });
    match full {
        Some(f) if f.starts_with(&comm) => f,
        _ => comm,
    }
}

#[cfg(test)]
mod tests;
