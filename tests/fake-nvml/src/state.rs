//! MIG instances, compute modes, MIG modes and per-cgroup memory limits kept in a file
//! (`FAKE_NVML_STATE`), as a GPU keeps them across the processes that use it: a daemon killed
//! after creating an instance, setting a compute mode or switching a MIG mode leaves it for the
//! next one to find, and the limits a container hook set are there for the test to read.
//!
//! One line per instance, compute mode other than DEFAULT, MIG-capable GPU and limited cgroup,
//! rewritten whole (through a temporary file and a rename) after every change:
//!
//! ```text
//! created <n>
//! gi <gpu index> <gpu-instance id> <profile id> <start>
//! ci <gpu index> <gpu-instance id> <compute-instance id> <compute profile> <slices> <slot> <uuid>
//! mode <gpu index> <NVML_COMPUTEMODE_* value>
//! mig <gpu index> <current MIG mode> <pending MIG mode>
//! minor <gpu index> <minor>
//! limits <gpu index> <soft bytes> <hard bytes> <cgroup path>
//! ```
//!
//! A file without `mig` lines (written before they existed) leaves the GPUs' MIG modes as the
//! node has them; one without `minor` lines (written where minors do not change:
//! `FAKE_NVML_MINOR_XOR` unset), their minors.

use std::os::raw::c_uint;
use std::path::Path;

use crate::model::{ComputeInstance, GpuInstance, Model};

/// A GPU instance as the state file lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Instance {
    pub gpu: usize,
    pub gi_id: c_uint,
    pub profile_id: c_uint,
    pub start: c_uint,
    /// The UUIDs of its compute instances (MIG devices).
    pub mig_uuids: Vec<String>,
}

/// The GPU instances a state file holds (none when it does not exist).
pub fn instances(path: &Path) -> Vec<Instance> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let mut out: Vec<Instance> = Vec::new();
    for line in text.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        let n = |i: usize| f.get(i).and_then(|s| s.parse::<c_uint>().ok()).unwrap_or(0);
        match f.first() {
            Some(&"gi") => out.push(Instance {
                gpu: n(1) as usize,
                gi_id: n(2),
                profile_id: n(3),
                start: n(4),
                mig_uuids: Vec::new(),
            }),
            Some(&"ci") => {
                if let Some(gi) = out
                    .iter_mut()
                    .find(|gi| gi.gpu == n(1) as usize && gi.gi_id == n(2))
                {
                    gi.mig_uuids
                        .push(f.get(7).copied().unwrap_or_default().to_string());
                }
            }
            _ => {}
        }
    }
    out
}

/// The MIG modes a state file holds: (GPU index, current, pending), 1 for on.
pub fn mig_modes(path: &Path) -> Vec<(usize, c_uint, c_uint)> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.lines()
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            let n = |i: usize| f.get(i).and_then(|s| s.parse::<c_uint>().ok());
            (f.first() == Some(&"mig")).then_some(())?;
            Some((n(1)? as usize, n(2)?, n(3)?))
        })
        .collect()
}

/// The minors a state file holds: (GPU index, minor).
pub fn minors(path: &Path) -> Vec<(usize, c_uint)> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.lines()
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            let n = |i: usize| f.get(i).and_then(|s| s.parse::<c_uint>().ok());
            (f.first() == Some(&"minor")).then_some(())?;
            Some((n(1)? as usize, n(2)?))
        })
        .collect()
}

/// A cgroup's memory limits on one GPU, as the state file lists them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CgroupLimits {
    pub gpu: usize,
    /// The `nameSpace` they were set on: the cgroup's full path.
    pub cgroup: String,
    pub soft: u64,
    pub hard: u64,
}

/// The per-cgroup memory limits a state file holds (none when it does not exist).
pub fn memory_limits(path: &Path) -> Vec<CgroupLimits> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.lines().filter_map(limits_line).collect()
}

/// `limits <gpu> <soft> <hard> <cgroup>` (the path last: it may hold spaces).
fn limits_line(line: &str) -> Option<CgroupLimits> {
    let mut f = line.splitn(5, ' ');
    (f.next()? == "limits").then_some(())?;
    Some(CgroupLimits {
        gpu: f.next()?.parse().ok()?,
        soft: f.next()?.parse().ok()?,
        hard: f.next()?.parse().ok()?,
        cgroup: f.next()?.to_string(),
    })
}

/// Replaces the model's MIG instances by those of the state file, if it exists.
pub fn load(path: &Path, m: &mut Model) {
    let Ok(text) = std::fs::read_to_string(path) else {
        return;
    };
    for g in &mut m.gpus {
        g.instances.clear();
    }
    m.compute_modes.clear();
    m.memory_limits = text
        .lines()
        .filter_map(limits_line)
        .filter(|l| l.gpu < m.gpus.len())
        .map(|l| ((l.gpu, l.cgroup), (l.soft, l.hard)))
        .collect();
    for line in text.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        let n = |i: usize| f.get(i).and_then(|s| s.parse::<u64>().ok()).unwrap_or(0);
        match f.first() {
            Some(&"created") => m.created = n(1),
            Some(&"mode") if (n(1) as usize) < m.gpus.len() => {
                m.compute_modes.insert(n(1) as usize, n(2) as c_uint);
            }
            Some(&"minor") => {
                if let Some(g) = m.gpus.get_mut(n(1) as usize) {
                    g.minor = n(2) as c_uint;
                }
            }
            Some(&"mig") => {
                if let Some(g) = m.gpus.get_mut(n(1) as usize)
                    && g.mig_mode.is_some()
                {
                    g.mig_mode = Some((n(2) as c_uint, n(3) as c_uint));
                }
            }
            Some(&"gi") => {
                let Some(g) = m.gpus.get_mut(n(1) as usize) else {
                    continue;
                };
                let Some(profile) = g.profiles.iter().position(|p| u64::from(p.id) == n(3)) else {
                    continue;
                };
                g.instances.push(GpuInstance {
                    id: n(2) as c_uint,
                    profile,
                    start: n(4) as c_uint,
                    compute: Vec::new(),
                });
            }
            Some(&"ci") => {
                let Some(gi) = m
                    .gpus
                    .get_mut(n(1) as usize)
                    .and_then(|g| g.instance_mut(n(2) as c_uint))
                else {
                    continue;
                };
                gi.compute.push(ComputeInstance {
                    id: n(3) as c_uint,
                    profile: n(4) as c_uint,
                    slices: n(5) as c_uint,
                    slot: n(6) as c_uint,
                    uuid: f.get(7).copied().unwrap_or_default().to_string(),
                });
            }
            _ => {}
        }
    }
}

/// Writes the model's MIG instances, modes and memory limits. A failure is reported on stderr: the fake has no other
/// channel, and the test reading the file will see what is missing.
pub fn save(path: &Path, m: &Model) {
    let mut text = format!("created {}\n", m.created);
    for (i, g) in m.gpus.iter().enumerate() {
        for gi in &g.instances {
            let profile_id = g.profiles.get(gi.profile).map_or(0, |p| p.id);
            text.push_str(&format!("gi {i} {} {profile_id} {}\n", gi.id, gi.start));
            for ci in &gi.compute {
                text.push_str(&format!(
                    "ci {i} {} {} {} {} {} {}\n",
                    gi.id, ci.id, ci.profile, ci.slices, ci.slot, ci.uuid
                ));
            }
        }
    }
    for (i, mode) in &m.compute_modes {
        text.push_str(&format!("mode {i} {mode}\n"));
    }
    for (i, g) in m.gpus.iter().enumerate() {
        if let Some((current, pending)) = g.mig_mode {
            text.push_str(&format!("mig {i} {current} {pending}\n"));
        }
    }
    if m.switching.minor_xor != 0 {
        for (i, g) in m.gpus.iter().enumerate() {
            text.push_str(&format!("minor {i} {}\n", g.minor));
        }
    }
    for ((i, cgroup), (soft, hard)) in &m.memory_limits {
        text.push_str(&format!("limits {i} {soft} {hard} {cgroup}\n"));
    }
    let tmp = path.with_extension("tmp");
    if let Err(e) = std::fs::write(&tmp, text).and_then(|()| std::fs::rename(&tmp, path)) {
        eprintln!("fake-nvml: cannot write {}: {e}", path.display());
    }
}
