//! The simulated backend: an [`Inventory`] read from a topology file or a built-in profile, held
//! in memory so tests and demos can change it (health, MIG instances) the way a real node would.
//!
//! MIG mode changes ([`DeviceBackend::set_mig_mode`]) follow NVML's `nvmlDeviceSetMigMode`: the
//! requested mode is recorded as pending, then activated or not. Activation answers `IN_USE`
//! while anything blocking holds the GPU (a process, or a [`Foreign`](HolderKind::Foreign) or
//! [`OwnMps`](HolderKind::OwnMps) holder), `RESET_REQUIRED` before Hopper (compute capability
//! 9.0) or where a test makes a Hopper answer so ([`SimBackend::set_reset_required`], as some
//! hypervisors do), and applies the change at once otherwise. After `IN_USE` and
//! `RESET_REQUIRED` the requested mode stays pending, as NVML leaves it; asking for the
//! current mode withdraws it, and asking again for the pending one tries again. Turning MIG mode
//! off is refused while MIG devices exist (before anything is recorded, as the NVML backend
//! checks first). Only a vGPU guest cannot change it at all (NVML: not supported); a
//! passthrough VM can, with the same rules as bare metal. A change that is applied takes
//! [`SimBackend::set_mig_toggle_delay`] (default none), to model slow toggles. A test can hold
//! other calls ([`SimBackend::hold`]) until it lets them go, to model a driver call that hangs.
//!
//! Processes and holders come from the test ([`SimBackend::set_processes`],
//! [`SimBackend::set_holders`]) and, for a running daemon, from the fault file
//! ([`SimBackend::with_process_file`]): `process <GPU> <pid> [<MiB>]` puts a process on a GPU
//! (named by index or UUID), `holder <GPU> <pid> [<name>]` a holder (its kind from its name, as
//! [`holders::kind_of`](super::holders::kind_of) sorts them: `nv-hostengine` is foreign,
//! `nvidia-persistenced` harmless, `nvidia-cuda-mps-server` nvdra's MPS), `exit <GPU> <pid>`
//! ends either; the file is read whole at each snapshot, MIG mode change and usage reading.
//!
//! Snapshots list each GPU's holders in [`Mig::holders`](super::Mig::holders), as the NVML
//! backend's read finds them; processes are not listed there: a process stands for a CUDA
//! context that the last read did not see (it started since), so a switch meets it unannounced.

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use super::{
    ComputeMode, DeviceBackend, Error, GpuUsage, GpuUuid, HOPPER, Health, Holder, HolderKind,
    Inventory, MigDevice, MigModeChange, MigUuid, NoMigToggle, Placement, ProcessUsage,
    Reconfigure, Result, TimeSlice, Virtualization, holders, on_off, topology,
};

/// A reconfiguration the simulated hardware went through, in order; tests read them with
/// [`SimBackend::actions`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SimAction {
    SetTimeSlice {
        gpu: GpuUuid,
        interval: TimeSlice,
    },
    CreateMig {
        gpu: GpuUuid,
        gi_profile_id: u32,
        placement: Placement,
        uuid: MigUuid,
    },
    DestroyMig {
        gpu: GpuUuid,
        uuid: MigUuid,
    },
    SetComputeMode {
        gpu: GpuUuid,
        mode: ComputeMode,
    },
    /// A MIG mode change applied at once, after waiting `delay`.
    SetMigMode {
        gpu: GpuUuid,
        enabled: bool,
        delay: Duration,
    },
}

impl std::fmt::Display for SimAction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SimAction::SetTimeSlice { gpu, interval } => {
                write!(f, "time slice {interval} on {gpu}")
            }
            SimAction::CreateMig {
                gpu,
                gi_profile_id,
                placement,
                uuid,
            } => write!(
                f,
                "MIG instance {uuid} (profile {gi_profile_id}, slices {}..{}) created on {gpu}",
                placement.start,
                placement.start + placement.size
            ),
            SimAction::DestroyMig { gpu, uuid } => {
                write!(f, "MIG instance {uuid} destroyed on {gpu}")
            }
            SimAction::SetComputeMode { gpu, mode } => {
                write!(f, "compute mode {mode} on {gpu}")
            }
            SimAction::SetMigMode {
                gpu,
                enabled,
                delay,
            } => write!(
                f,
                "MIG mode {} on {gpu} after {}ms",
                on_off(*enabled),
                delay.as_millis()
            ),
        }
    }
}

#[derive(Debug, Default)]
struct Model {
    inventory: Inventory,
    actions: Vec<SimAction>,
    /// Current time slice per GPU (absent: `Default`).
    time_slices: std::collections::BTreeMap<GpuUuid, TimeSlice>,
    /// Current compute mode per GPU (absent: `Default`).
    compute_modes: std::collections::BTreeMap<GpuUuid, ComputeMode>,
    /// The processes a test put on each GPU ([`SimBackend::set_processes`]).
    processes: std::collections::BTreeMap<GpuUuid, Vec<ProcessUsage>>,
    /// How long an applied MIG mode change takes ([`SimBackend::set_mig_toggle_delay`]).
    mig_toggle_delay: Duration,
    /// Where more processes are listed ([`SimBackend::with_process_file`]).
    process_file: Option<std::path::PathBuf>,
    /// Whether the driver partitions memory per cgroup ([`SimBackend::set_memory_limits`]).
    memory_limits: bool,
    /// The holders a test put on each GPU ([`SimBackend::set_holders`]).
    holders: std::collections::BTreeMap<GpuUuid, Vec<Holder>>,
    /// Hopper GPUs that answer a switch with `RESET_REQUIRED`
    /// ([`SimBackend::set_reset_required`]).
    reset_required: BTreeSet<GpuUuid>,
}

impl Model {
    /// The process file's text (empty without one, or where it cannot be read).
    fn process_file(&self) -> String {
        self.process_file
            .as_ref()
            .and_then(|p| std::fs::read_to_string(p).ok())
            .unwrap_or_default()
    }

    /// The processes on `gpu`: the test's and those of `file` (the process file's text).
    fn running(&self, gpu: &GpuUuid, file: &str) -> Vec<ProcessUsage> {
        let mut out = self.processes.get(gpu).cloned().unwrap_or_default();
        for p in file_lines(file, &self.inventory, gpu).processes {
            if out.iter().all(|o| o.pid != p.pid) {
                out.push(p);
            }
        }
        out
    }

    /// The holders of `gpu`: the test's and those of `file`, sorted by pid.
    fn holders(&self, gpu: &GpuUuid, file: &str) -> Vec<Holder> {
        let mut out = self.holders.get(gpu).cloned().unwrap_or_default();
        for h in file_lines(file, &self.inventory, gpu).holders {
            if out.iter().all(|o| o.pid != h.pid) {
                out.push(h);
            }
        }
        out.sort();
        out
    }
}

/// What the lines of a process file leave on one GPU.
#[derive(Default)]
struct FileLines {
    processes: Vec<ProcessUsage>,
    holders: Vec<Holder>,
}

/// The processes and holders the lines of `text` leave on `gpu` (see the module doc); other
/// lines are the fault file's and are skipped.
fn file_lines(text: &str, inv: &Inventory, gpu: &GpuUuid) -> FileLines {
    let names = |w: &str| {
        inv.gpus
            .iter()
            .any(|g| g.uuid == *gpu && (g.uuid.as_str() == w || w.parse() == Ok(g.index)))
    };
    let mut out = FileLines::default();
    for line in text.lines() {
        let line = line.split('#').next().unwrap_or_default();
        let words: Vec<&str> = line.split_whitespace().collect();
        let pid = |w: &str| w.parse::<u32>().ok();
        match words.as_slice() {
            ["process", g, p, rest @ ..] if names(g) => {
                let Some(pid) = pid(p) else { continue };
                let mib = rest.first().and_then(|m| m.parse::<u64>().ok());
                out.processes.retain(|p| p.pid != pid);
                out.processes.push(ProcessUsage {
                    pid,
                    used_memory_bytes: mib.map(|m| m << 20),
                    gpu_instance: None,
                });
            }
            ["holder", g, p, rest @ ..] if names(g) => {
                let Some(pid) = pid(p) else { continue };
                let name = rest.first().copied().unwrap_or_default().to_string();
                out.holders.retain(|h| h.pid != pid);
                out.holders.push(Holder {
                    pid,
                    kind: holders::kind_of(&name),
                    name,
                });
            }
            ["exit", g, p] if names(g) => {
                if let Some(pid) = pid(p) {
                    out.processes.retain(|p| p.pid != pid);
                    out.holders.retain(|h| h.pid != pid);
                }
            }
            _ => {}
        }
    }
    out
}

/// A call of the simulated backend that a test can hold ([`SimBackend::hold`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum SimCall {
    SetTimeSlice,
    ComputeMode,
    SetComputeMode,
    CreateMig,
    DestroyMig,
    SetMigMode,
    Usage,
    Probe,
}

/// The calls held, and the condition their callers wait on.
#[derive(Debug, Default)]
struct Gate {
    held: Mutex<BTreeSet<SimCall>>,
    released: Condvar,
}

/// While alive, every call of its kind waits (outside the model's lock) before it runs; dropping
/// it lets them go.
#[must_use = "the call is held only while the guard lives"]
pub struct Held {
    gate: Arc<Gate>,
    call: SimCall,
}

impl Drop for Held {
    fn drop(&mut self) {
        crate::lock::lock(&self.gate.held).remove(&self.call);
        self.gate.released.notify_all();
    }
}

/// Simulated GPUs. Cloning shares the same model.
#[derive(Clone, Debug)]
pub struct SimBackend {
    model: Arc<Mutex<Model>>,
    gate: Arc<Gate>,
}

impl SimBackend {
    pub fn new(inventory: Inventory) -> Self {
        Self {
            model: Arc::new(Mutex::new(Model {
                inventory,
                ..Model::default()
            })),
            gate: Arc::default(),
        }
    }

    /// Loads a built-in profile; `seed` (the node name) makes its UUIDs unique per node.
    pub fn from_profile(name: &str, seed: &str) -> Result<Self> {
        Ok(Self::new(topology::load_profile(name, seed)?))
    }

    /// Loads a topology file.
    pub fn from_file(path: &Path, seed: &str) -> Result<Self> {
        Ok(Self::new(topology::load_file(path, seed)?))
    }

    /// Changes the simulated hardware, e.g. to mark a GPU unhealthy in a test. The change is seen
    /// by the next snapshot.
    pub fn update<R>(&self, f: impl FnOnce(&mut Inventory) -> R) -> R {
        f(&mut self.lock().inventory)
    }

    /// Every reconfiguration so far, oldest first.
    pub fn actions(&self) -> Vec<SimAction> {
        self.lock().actions.clone()
    }

    /// The time slice a GPU is set to.
    pub fn time_slice(&self, gpu: &GpuUuid) -> TimeSlice {
        self.lock()
            .time_slices
            .get(gpu)
            .copied()
            .unwrap_or_default()
    }

    /// Puts `processes` on `gpu`, as a test's workload would: [`DeviceBackend::usage`] reports
    /// them, and the GPU's memory in use is their sum plus [`sim_usage`]'s baseline.
    pub fn set_processes(&self, gpu: &GpuUuid, processes: Vec<ProcessUsage>) {
        self.lock().processes.insert(gpu.clone(), processes);
    }

    /// Also lists the processes and holders of the lines `process <GPU> <pid> [<MiB>]`,
    /// `holder <GPU> <pid> [<name>]` and `exit <GPU> <pid>` of `file` (the daemon's fault file),
    /// read at each snapshot, MIG mode change and usage reading, so a running daemon's GPUs can
    /// be made busy.
    pub fn with_process_file(self, file: Option<std::path::PathBuf>) -> Self {
        self.lock().process_file = file;
        self
    }

    /// Puts `holders` on `gpu` (replacing the test's earlier ones): snapshots list them in the
    /// GPU's [`Mig::holders`](super::Mig::holders), and those that block a switch
    /// ([`Holder::blocks_switch`], or nvdra's MPS) make a MIG mode change answer `IN_USE`
    /// naming them, until the test takes them away again.
    pub fn set_holders(&self, gpu: &GpuUuid, holders: Vec<Holder>) {
        self.lock().holders.insert(gpu.clone(), holders);
    }

    /// Makes `gpu`, a Hopper or later, answer a MIG mode change with `RESET_REQUIRED` as an
    /// Ampere does (some hypervisors' passthrough GPUs do), or stop doing so.
    pub fn set_reset_required(&self, gpu: &GpuUuid, on: bool) {
        let mut m = self.lock();
        if on {
            m.reset_required.insert(gpu.clone());
        } else {
            m.reset_required.remove(gpu);
        }
    }

    /// Makes every MIG mode change that is applied take `delay` (the calling thread sleeps, as
    /// it blocks in NVML), so tests and benchmarks can model slow toggles. Default: none.
    pub fn set_mig_toggle_delay(&self, delay: Duration) {
        self.lock().mig_toggle_delay = delay;
    }

    /// Makes the simulated driver partition each whole GPU's memory per cgroup (MPS v3 memory
    /// partitioning): [`DeviceBackend::memory_limits`] answers "no limit" for every GPU instead
    /// of "unsupported". Default: off, as on a driver older than R615.
    pub fn set_memory_limits(&self, supported: bool) {
        self.lock().memory_limits = supported;
    }

    /// Holds every `call` until the returned guard is dropped: the calls block as a hung driver
    /// call would (each in its caller's thread).
    pub fn hold(&self, call: SimCall) -> Held {
        crate::lock::lock(&self.gate.held).insert(call);
        Held {
            gate: self.gate.clone(),
            call,
        }
    }

    /// Waits while `call` is held.
    fn pass(&self, call: SimCall) {
        let held = crate::lock::lock(&self.gate.held);
        let _released = self
            .gate
            .released
            .wait_while(held, |h| h.contains(&call))
            // The set is changed in single statements; a poisoned lock still holds a valid one.
            .unwrap_or_else(std::sync::PoisonError::into_inner);
    }

    fn lock(&self) -> MutexGuard<'_, Model> {
        // A panic while holding the lock cannot leave the inventory half-written in a way that
        // matters more than the panic itself; keep serving the last state.
        crate::lock::lock(&self.model)
    }
}

impl DeviceBackend for SimBackend {
    fn name(&self) -> &'static str {
        "simulated"
    }

    fn snapshot(&self) -> Result<Inventory> {
        let m = self.lock();
        let file = m.process_file();
        let mut inv = m.inventory.clone();
        for g in &mut inv.gpus {
            g.mig.holders = m.holders(&g.uuid, &file);
        }
        Ok(inv)
    }

    /// As by default (the GPU is listed and not withdrawn), unless held.
    fn probe(&self, gpu: &GpuUuid) -> std::result::Result<(), String> {
        self.pass(SimCall::Probe);
        match self.lock().inventory.gpu_by_uuid(gpu.as_str()) {
            Some(g) if !g.health.is_withdrawn() => Ok(()),
            Some(g) => Err(g.health.to_string()),
            None => Err("the GPU is no longer listed".into()),
        }
    }

    fn usage(&self) -> Result<Vec<GpuUsage>> {
        self.pass(SimCall::Usage);
        let m = self.lock();
        let file = m.process_file();
        Ok(m.inventory
            .gpus
            .iter()
            .map(|g| sim_usage(g, m.running(&g.uuid, &file)))
            .collect())
    }
}

impl Reconfigure for SimBackend {
    fn unavailable(&self, _what: super::Reconfiguration) -> Option<String> {
        None
    }

    fn set_time_slice(&self, gpu: &GpuUuid, interval: TimeSlice) -> Result<()> {
        self.pass(SimCall::SetTimeSlice);
        let mut m = self.lock();
        if m.inventory.gpu_by_uuid(gpu.as_str()).is_none() {
            return Err(Error::Refused(format!("no GPU with UUID {gpu}")));
        }
        m.time_slices.insert(gpu.clone(), interval);
        m.actions.push(SimAction::SetTimeSlice {
            gpu: gpu.clone(),
            interval,
        });
        Ok(())
    }

    fn compute_mode(&self, gpu: &GpuUuid) -> Result<ComputeMode> {
        self.pass(SimCall::ComputeMode);
        let m = self.lock();
        if m.inventory.gpu_by_uuid(gpu.as_str()).is_none() {
            return Err(Error::Refused(format!("no GPU with UUID {gpu}")));
        }
        Ok(m.compute_modes.get(gpu).copied().unwrap_or_default())
    }

    fn memory_limits(&self, gpu: &GpuUuid, cgroup: &Path) -> Result<super::MemoryLimits> {
        let m = self.lock();
        if !m.memory_limits {
            return Err(Error::Unsupported {
                backend: "simulated",
                operation: "reading per-cgroup memory limits",
            });
        }
        if m.inventory.gpu_by_uuid(gpu.as_str()).is_none() {
            return Err(Error::Refused(format!("no GPU with UUID {gpu}")));
        }
        if !cgroup.is_dir() {
            return Err(Error::Refused(format!(
                "{} is not a cgroup directory",
                cgroup.display()
            )));
        }
        Ok(super::MemoryLimits::NONE)
    }

    fn set_compute_mode(&self, gpu: &GpuUuid, mode: ComputeMode) -> Result<()> {
        self.pass(SimCall::SetComputeMode);
        let mut m = self.lock();
        if m.inventory.gpu_by_uuid(gpu.as_str()).is_none() {
            return Err(Error::Refused(format!("no GPU with UUID {gpu}")));
        }
        m.compute_modes.insert(gpu.clone(), mode);
        m.actions.push(SimAction::SetComputeMode {
            gpu: gpu.clone(),
            mode,
        });
        Ok(())
    }

    fn create_mig(
        &self,
        gpu: &GpuUuid,
        gi_profile_id: u32,
        placement: Placement,
    ) -> Result<MigDevice> {
        self.pass(SimCall::CreateMig);
        let mut m = self.lock();
        let g = m
            .inventory
            .gpus
            .iter_mut()
            .find(|g| g.uuid == *gpu)
            .ok_or_else(|| Error::Refused(format!("no GPU with UUID {gpu}")))?;
        if !g.in_mig_mode() {
            return Err(Error::Refused(format!(
                "GPU {gpu} is not in MIG mode; enable MIG mode before creating MIG devices"
            )));
        }
        let profile = g
            .mig
            .profiles
            .iter()
            .find(|p| p.gi_profile_id == gi_profile_id)
            .ok_or_else(|| {
                Error::Refused(format!(
                    "GPU {gpu} has no GPU-instance profile {gi_profile_id}"
                ))
            })?
            .clone();
        if !profile.placements.contains(&placement) {
            return Err(Error::Refused(format!(
                "{} cannot be placed at {}..{} on GPU {gpu}",
                profile.name,
                placement.start,
                placement.start + placement.size
            )));
        }
        if let Some(other) = g
            .mig
            .devices
            .iter()
            .find(|d| d.placement.overlaps(&placement))
        {
            return Err(Error::Refused(format!(
                "insufficient resources: {} at {} overlaps the existing {} at {} on GPU {gpu}",
                profile.name, placement.start, other.profile, other.placement.start
            )));
        }
        let gi_id = (1..)
            .find(|id| g.mig.devices.iter().all(|d| d.gi_id != *id))
            .unwrap_or(1);
        let uuid = MigUuid(format!(
            "MIG-{}",
            topology::uuid_from(&[gpu.as_str(), &profile.name, &placement.start.to_string()])
        ));
        let device = MigDevice {
            uuid: uuid.clone(),
            profile: profile.name.clone(),
            gi_profile_id,
            gi_id,
            ci_id: 0,
            placement,
            memory_bytes: profile.memory_bytes,
            multiprocessors: profile.multiprocessors,
            engines: profile.engines,
            health: Health::Healthy,
        };
        g.mig.devices.push(device.clone());
        m.actions.push(SimAction::CreateMig {
            gpu: gpu.clone(),
            gi_profile_id,
            placement,
            uuid,
        });
        Ok(device)
    }

    fn destroy_mig(&self, gpu: &GpuUuid, mig: &MigUuid) -> Result<()> {
        self.pass(SimCall::DestroyMig);
        let mut m = self.lock();
        let g = m
            .inventory
            .gpus
            .iter_mut()
            .find(|g| g.uuid == *gpu)
            .ok_or_else(|| Error::Refused(format!("no GPU with UUID {gpu}")))?;
        let before = g.mig.devices.len();
        g.mig.devices.retain(|d| d.uuid != *mig);
        if g.mig.devices.len() != before {
            m.actions.push(SimAction::DestroyMig {
                gpu: gpu.clone(),
                uuid: mig.clone(),
            });
        }
        Ok(())
    }

    fn set_mig_mode(&self, gpu: &GpuUuid, enabled: bool) -> Result<MigModeChange> {
        self.pass(SimCall::SetMigMode);
        let mut m = self.lock();
        let file = m.process_file();
        let running: Vec<u32> = m.running(gpu, &file).iter().map(|p| p.pid).collect();
        // nvdra's MPS blocks the driver as any CUDA client does; only nvdra waits for it.
        let blocking: Vec<Holder> = m
            .holders(gpu, &file)
            .into_iter()
            .filter(Holder::blocks_driver)
            .collect();
        let reset_required = m.reset_required.contains(gpu);
        let Model {
            inventory,
            actions,
            mig_toggle_delay,
            ..
        } = &mut *m;
        let g = inventory
            .gpus
            .iter_mut()
            .find(|g| g.uuid == *gpu)
            .ok_or_else(|| Error::Refused(format!("no GPU with UUID {gpu}")))?;
        let fixed = |reason| Error::MigModeFixed {
            gpu: gpu.clone(),
            reason,
        };
        if g.mig.mode_unknown {
            return Err(fixed(NoMigToggle::ModeUnknown));
        }
        if !g.mig.capable {
            return Err(fixed(NoMigToggle::NotSupported));
        }
        // A vGPU guest's driver refuses (only the host may change it); a passthrough VM owns
        // the whole GPU and may.
        if g.virtualization == Some(Virtualization::VgpuGuest) {
            return Err(fixed(NoMigToggle::Virtualized(Virtualization::VgpuGuest)));
        }
        let current = g.mig.enabled;
        if enabled == current {
            // Asking for the current mode withdraws a pending change, as NVML does.
            g.mig.pending = None;
            return Ok(MigModeChange::Unchanged);
        }
        if !enabled && !g.mig.devices.is_empty() {
            return Err(Error::MigDevicesExist {
                gpu: gpu.clone(),
                devices: g.mig.devices.iter().map(|d| d.uuid.clone()).collect(),
            });
        }
        // NVML records the request, then tries to activate it; what it cannot activate stays
        // pending.
        g.mig.pending = Some(enabled);
        if !running.is_empty() || !blocking.is_empty() {
            let mut processes = running;
            let mut holders = blocking;
            for h in &holders {
                if !processes.contains(&h.pid) {
                    processes.push(h.pid);
                }
            }
            for &pid in &processes {
                if holders.iter().all(|h| h.pid != pid) {
                    holders.push(Holder {
                        pid,
                        name: String::new(),
                        kind: HolderKind::Foreign,
                    });
                }
            }
            holders.sort();
            return Err(Error::InUse {
                gpu: gpu.clone(),
                processes,
                holders,
            });
        }
        if g.cuda_compute_capability < HOPPER || reset_required {
            return Err(Error::ResetRequired {
                gpu: gpu.clone(),
                current,
                pending: enabled,
            });
        }
        let delay = *mig_toggle_delay;
        // The model stays locked for the delay: NVML serializes calls on one GPU too.
        std::thread::sleep(delay);
        g.mig.enabled = enabled;
        g.mig.pending = None;
        g.mig.devices.clear();
        actions.push(SimAction::SetMigMode {
            gpu: gpu.clone(),
            enabled,
            delay,
        });
        Ok(MigModeChange::Applied)
    }
}

/// The simulated readings of `g`: stable functions of its index, so tests assert them — 1 GiB
/// of baseline memory in use plus what its processes use, utilization `10 * index + 5` percent
/// (memory: half that), `100 + 10 * index` W, `40 + index` °C.
pub fn sim_usage(g: &super::Gpu, processes: Vec<ProcessUsage>) -> GpuUsage {
    const GIB: u64 = 1 << 30;
    let used: u64 = processes.iter().filter_map(|p| p.used_memory_bytes).sum();
    GpuUsage {
        gpu: g.uuid.clone(),
        memory_used_bytes: (GIB + used).min(g.memory_bytes),
        memory_total_bytes: g.memory_bytes,
        utilization_percent: Some((10 * g.index + 5) % 100),
        memory_utilization_percent: Some((10 * g.index + 5) % 100 / 2),
        power_milliwatts: Some(100_000 + 10_000 * g.index),
        temperature_celsius: Some(40 + g.index),
        processes,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn updates_show_in_next_snapshot() {
        let sim = SimBackend::from_profile("l40s-pcie", "n").unwrap();
        let before = sim.snapshot().unwrap();
        sim.update(|inv| {
            inv.gpus[1].health = Health::Unhealthy {
                reason: "XID 79".into(),
            }
        });
        let after = sim.snapshot().unwrap();
        assert!(before.gpus[1].health.is_healthy());
        assert!(!after.gpus[1].health.is_healthy());
        assert_eq!(before.gpus[0], after.gpus[0]);
    }

    #[test]
    fn mig_devices_are_created_and_destroyed() {
        let sim = SimBackend::from_profile("a100-mig-mixed", "n").unwrap();
        let inv = sim.snapshot().unwrap();
        // GPU 2 holds 1g.10gb at 0, 2 and 4; slot 6 is free.
        let gpu = inv.gpus[2].clone();
        let profile = gpu
            .mig
            .profiles
            .iter()
            .find(|p| p.name == "1g.10gb")
            .unwrap();
        let free = Placement { start: 6, size: 2 };
        assert!(
            profile.placements.contains(&free),
            "{:?}",
            profile.placements
        );
        let taken = Placement { start: 0, size: 2 };
        let e = sim
            .create_mig(&gpu.uuid, profile.gi_profile_id, taken)
            .unwrap_err();
        assert!(e.to_string().contains("overlaps"), "{e}");
        let dev = sim
            .create_mig(&gpu.uuid, profile.gi_profile_id, free)
            .unwrap();
        assert_eq!(dev.placement, free);
        assert!(dev.uuid.as_str().starts_with("MIG-"));
        let after = sim.snapshot().unwrap();
        assert_eq!(after.gpus[2].mig.devices.len(), gpu.mig.devices.len() + 1);
        sim.destroy_mig(&gpu.uuid, &dev.uuid).unwrap();
        // A second destroy is a no-op, so rollbacks can repeat it.
        sim.destroy_mig(&gpu.uuid, &dev.uuid).unwrap();
        assert_eq!(sim.snapshot().unwrap(), inv);
        assert_eq!(sim.actions().len(), 2);
        assert!(matches!(sim.actions()[1], SimAction::DestroyMig { .. }));
        // Whole GPUs outside MIG mode refuse.
        let e = sim
            .create_mig(&inv.gpus[0].uuid, profile.gi_profile_id, free)
            .unwrap_err();
        assert!(e.to_string().contains("not in MIG mode"), "{e}");
    }

    #[test]
    fn time_slices_are_recorded() {
        let sim = SimBackend::from_profile("l40s-pcie", "n").unwrap();
        let g = sim.snapshot().unwrap().gpus[0].uuid.clone();
        assert_eq!(sim.time_slice(&g), TimeSlice::Default);
        sim.set_time_slice(&g, TimeSlice::Long).unwrap();
        assert_eq!(sim.time_slice(&g), TimeSlice::Long);
        let e = sim
            .set_time_slice(&GpuUuid("GPU-nope".into()), TimeSlice::Short)
            .unwrap_err();
        assert!(e.to_string().contains("GPU-nope"), "{e}");
    }

    #[test]
    fn usage_is_a_stable_function_of_the_index_and_the_processes() {
        let sim = SimBackend::from_profile("dgx-h100", "n").unwrap();
        let inv = sim.snapshot().unwrap();
        let g1 = inv.gpus[1].uuid.clone();
        sim.set_processes(
            &g1,
            vec![ProcessUsage {
                pid: 42,
                used_memory_bytes: Some(3 << 30),
                gpu_instance: None,
            }],
        );
        let usage = sim.usage().unwrap();
        assert_eq!(usage.len(), inv.gpus.len());
        assert_eq!(usage, sim.usage().unwrap(), "the same readings every time");
        let u = &usage[1];
        assert_eq!(u.gpu, g1);
        assert_eq!(u.memory_used_bytes, 4 << 30);
        assert_eq!(u.memory_total_bytes, inv.gpus[1].memory_bytes);
        assert_eq!(u.utilization_percent, Some(15));
        assert_eq!(u.power_milliwatts, Some(110_000));
        assert_eq!(u.temperature_celsius, Some(41));
        assert_eq!(u.processes[0].pid, 42);
        assert_eq!(usage[0].memory_used_bytes, 1 << 30);
        assert!(usage[0].processes.is_empty());
    }

    fn pids(processes: &[u32]) -> Vec<ProcessUsage> {
        processes
            .iter()
            .map(|&pid| ProcessUsage {
                pid,
                used_memory_bytes: Some(1 << 30),
                gpu_instance: None,
            })
            .collect()
    }

    #[test]
    fn hopper_mig_mode_changes_at_once_and_off_needs_no_mig_devices() {
        let sim = SimBackend::from_profile("dgx-h100", "n").unwrap();
        let g = sim.snapshot().unwrap().gpus[0].clone();
        assert_eq!(g.mig_toggle(), Ok(()));

        assert_eq!(
            sim.set_mig_mode(&g.uuid, true).unwrap(),
            MigModeChange::Applied
        );
        let on = sim.snapshot().unwrap().gpus[0].clone();
        assert!(on.mig.enabled && on.mig.devices.is_empty(), "{:?}", on.mig);
        assert_eq!(on.mig.pending, None);
        assert_eq!(on.mig_toggle(), Ok(()));
        assert_eq!(
            sim.set_mig_mode(&g.uuid, true).unwrap(),
            MigModeChange::Unchanged
        );

        let dev = sim
            .create_mig(&g.uuid, 19, Placement { start: 3, size: 1 })
            .unwrap();
        let e = sim.set_mig_mode(&g.uuid, false).unwrap_err();
        assert!(
            matches!(&e, Error::MigDevicesExist { devices, .. } if devices == std::slice::from_ref(&dev.uuid)),
            "{e:?}"
        );
        assert!(e.to_string().contains(dev.uuid.as_str()), "{e}");
        assert!(sim.snapshot().unwrap().gpus[0].mig.enabled);

        sim.destroy_mig(&g.uuid, &dev.uuid).unwrap();
        assert_eq!(
            sim.set_mig_mode(&g.uuid, false).unwrap(),
            MigModeChange::Applied
        );
        assert_eq!(sim.snapshot().unwrap().gpus[0], g);
        let toggles: Vec<_> = sim
            .actions()
            .into_iter()
            .filter_map(|a| match a {
                SimAction::SetMigMode { enabled, delay, .. } => Some((enabled, delay)),
                _ => None,
            })
            .collect();
        assert_eq!(toggles, [(true, Duration::ZERO), (false, Duration::ZERO)]);
    }

    #[test]
    fn ampere_mig_mode_change_is_only_pending() {
        let sim = SimBackend::from_profile("a100-mig-mixed", "n").unwrap();
        // GPU 3 is MIG-capable, not in MIG mode.
        let g = sim.snapshot().unwrap().gpus[3].clone();
        assert!(g.mig.capable && !g.mig.enabled);
        let why = g.mig_toggle().unwrap_err();
        assert_eq!(
            why.to_string(),
            "Ampere (8.0): MIG mode changes only through the operator"
        );

        let e = sim.set_mig_mode(&g.uuid, true).unwrap_err();
        assert!(
            matches!(
                &e,
                Error::ResetRequired {
                    current: false,
                    pending: true,
                    ..
                }
            ),
            "{e:?}"
        );
        assert!(!matches!(e, Error::InUse { .. }));
        assert!(e.to_string().contains("reset"), "{e}");
        let pending = sim.snapshot().unwrap().gpus[3].clone();
        assert!(!pending.mig.enabled);
        assert_eq!(pending.mig.pending, Some(true));
        // Asking again changes nothing; asking for the current mode withdraws the change.
        assert!(matches!(
            sim.set_mig_mode(&g.uuid, true),
            Err(Error::ResetRequired { .. })
        ));
        assert_eq!(
            sim.set_mig_mode(&g.uuid, false).unwrap(),
            MigModeChange::Unchanged
        );
        assert_eq!(sim.snapshot().unwrap().gpus[3], g);
        assert!(sim.actions().is_empty(), "{:?}", sim.actions());
    }

    /// NVML's pending mode on Hopper: one more request for it applies it once the GPU is idle,
    /// one for the current mode withdraws it.
    #[test]
    fn a_pending_change_on_hopper_is_applied_by_asking_again_or_withdrawn() {
        let sim = SimBackend::from_profile("dgx-h100", "n").unwrap();
        sim.update(|inv| {
            inv.gpus[2].mig.pending = Some(true);
            inv.gpus[3].mig.pending = Some(true);
        });
        let inv = sim.snapshot().unwrap();
        assert_eq!(
            sim.set_mig_mode(&inv.gpus[2].uuid, true).unwrap(),
            MigModeChange::Applied
        );
        assert_eq!(
            sim.set_mig_mode(&inv.gpus[3].uuid, false).unwrap(),
            MigModeChange::Unchanged
        );
        let after = sim.snapshot().unwrap();
        assert!(after.gpus[2].mig.enabled);
        assert_eq!(after.gpus[2].mig.pending, None);
        assert!(!after.gpus[3].mig.enabled);
        assert_eq!(after.gpus[3].mig.pending, None);
    }

    #[test]
    fn processes_on_the_gpu_keep_its_mig_mode_and_are_named() {
        let sim = SimBackend::from_profile("dgx-h100", "n").unwrap();
        let g = sim.snapshot().unwrap().gpus[1].uuid.clone();
        sim.set_processes(&g, pids(&[4242, 4343]));
        let e = sim.set_mig_mode(&g, true).unwrap_err();
        assert!(
            matches!(&e, Error::InUse { processes, holders, .. }
                if processes == &[4242, 4343]
                    && holders.iter().map(|h| (h.pid, h.kind)).eq([(4242, HolderKind::Foreign), (4343, HolderKind::Foreign)])),
            "{e:?}"
        );
        assert!(matches!(e, Error::InUse { .. }));
        assert!(e.to_string().contains("4242, 4343"), "{e}");
        // Processes are no read's holders: they started since.
        assert_eq!(sim.snapshot().unwrap().gpus[1].mig.holders, []);
        // As NVML, the request stays pending after IN_USE, for the caller to withdraw.
        let busy = sim.snapshot().unwrap().gpus[1].clone();
        assert!(!busy.mig.enabled);
        assert_eq!(busy.mig.pending, Some(true));
        // Retried once they exit, it succeeds.
        sim.set_processes(&g, Vec::new());
        assert_eq!(sim.set_mig_mode(&g, true).unwrap(), MigModeChange::Applied);
        assert_eq!(sim.snapshot().unwrap().gpus[1].mig.pending, None);
    }

    fn holder(pid: u32, name: &str) -> Holder {
        Holder {
            pid,
            name: name.into(),
            kind: holders::kind_of(name),
        }
    }

    /// DCGM, nvdra's MPS server and the persistence daemon hold an idle GPU: snapshots list
    /// them; the first two make a switch answer IN_USE naming them, leaving the change pending;
    /// the third does not.
    #[test]
    fn holders_are_listed_and_all_but_the_harmless_block_a_switch() {
        let sim = SimBackend::from_profile("dgx-h100", "n").unwrap();
        let g = sim.snapshot().unwrap().gpus[4].uuid.clone();
        let (dcgm, mps, persistenced) = (
            holder(900, "nv-hostengine"),
            holder(77, "nvidia-cuda-mps-server"),
            holder(12, "nvidia-persistenced"),
        );
        assert_eq!(
            (dcgm.kind, mps.kind, persistenced.kind),
            (
                HolderKind::Foreign,
                HolderKind::OwnMps,
                HolderKind::Harmless
            )
        );
        sim.set_holders(&g, vec![dcgm.clone(), mps.clone(), persistenced.clone()]);
        let inv = sim.snapshot().unwrap();
        assert_eq!(
            inv.gpus[4].mig.holders,
            [persistenced.clone(), mps.clone(), dcgm.clone()]
        );
        assert!(inv.gpus[3].mig.holders.is_empty());

        let e = sim.set_mig_mode(&g, true).unwrap_err();
        assert!(
            matches!(&e, Error::InUse { processes, holders, .. }
                if processes == &[77, 900] && holders == &[mps.clone(), dcgm.clone()]),
            "{e:?}"
        );
        assert!(
            e.to_string()
                .contains("processes 77 (nvidia-cuda-mps-server), 900 (nv-hostengine)"),
            "{e}"
        );
        assert_eq!(sim.snapshot().unwrap().gpus[4].mig.pending, Some(true));
        // nvdra's MPS server goes: DCGM alone still blocks.
        sim.set_holders(&g, vec![dcgm.clone(), persistenced.clone()]);
        assert!(matches!(
            sim.set_mig_mode(&g, true),
            Err(Error::InUse { processes, .. }) if processes == [900]
        ));
        // Withdrawn by asking for the current mode.
        assert_eq!(
            sim.set_mig_mode(&g, false).unwrap(),
            MigModeChange::Unchanged
        );
        assert_eq!(sim.snapshot().unwrap().gpus[4].mig.pending, None);
        // The persistence daemon alone lets it switch.
        sim.set_holders(&g, vec![persistenced]);
        assert_eq!(sim.set_mig_mode(&g, true).unwrap(), MigModeChange::Applied);
    }

    /// A cloud H100 is a passthrough VM: it switches as on bare metal. A passthrough A100
    /// records the change and answers RESET_REQUIRED, as does a Hopper whose hypervisor needs
    /// a reset; the change stays pending for the caller to withdraw.
    #[test]
    fn passthrough_gpus_switch_by_architecture_and_reset_required_leaves_the_change_pending() {
        let h100 = SimBackend::from_profile("dgx-h100", "n").unwrap();
        h100.update(|inv| {
            for g in &mut inv.gpus {
                g.virtualization = Some(Virtualization::Passthrough);
            }
        });
        let inv = h100.snapshot().unwrap();
        assert_eq!(
            h100.set_mig_mode(&inv.gpus[0].uuid, true).unwrap(),
            MigModeChange::Applied
        );
        assert!(h100.snapshot().unwrap().gpus[0].mig.enabled);

        let g1 = inv.gpus[1].uuid.clone();
        h100.set_reset_required(&g1, true);
        let e = h100.set_mig_mode(&g1, true).unwrap_err();
        assert!(
            matches!(
                e,
                Error::ResetRequired {
                    current: false,
                    pending: true,
                    ..
                }
            ),
            "{e:?}"
        );
        let pending = h100.snapshot().unwrap().gpus[1].clone();
        assert!(!pending.mig.enabled);
        assert_eq!(pending.mig.pending, Some(true));
        assert_eq!(
            h100.set_mig_mode(&g1, false).unwrap(),
            MigModeChange::Unchanged
        );
        assert_eq!(h100.snapshot().unwrap().gpus[1].mig.pending, None);
        h100.set_reset_required(&g1, false);
        assert_eq!(
            h100.set_mig_mode(&g1, true).unwrap(),
            MigModeChange::Applied
        );

        let a100 = SimBackend::from_profile("a100-mig-mixed", "n").unwrap();
        a100.update(|inv| inv.gpus[3].virtualization = Some(Virtualization::Passthrough));
        let g = a100.snapshot().unwrap().gpus[3].uuid.clone();
        assert!(matches!(
            a100.set_mig_mode(&g, true),
            Err(Error::ResetRequired { pending: true, .. })
        ));
        assert_eq!(a100.snapshot().unwrap().gpus[3].mig.pending, Some(true));
    }

    #[test]
    fn a_vgpu_guest_or_a_gpu_without_mig_does_not_switch() {
        let sim = SimBackend::from_profile("dgx-h100", "n").unwrap();
        sim.update(|inv| {
            inv.gpus[0].virtualization = Some(Virtualization::VgpuGuest);
            inv.gpus[2].virtualization = None;
        });
        let inv = sim.snapshot().unwrap();
        let e = sim.set_mig_mode(&inv.gpus[0].uuid, true).unwrap_err();
        assert!(
            matches!(
                &e,
                Error::MigModeFixed {
                    reason: NoMigToggle::Virtualized(Virtualization::VgpuGuest),
                    ..
                }
            ),
            "{e:?}"
        );
        let g0 = sim.snapshot().unwrap().gpus[0].clone();
        assert!(!g0.mig.enabled);
        assert_eq!(g0.mig.pending, None, "nothing recorded");
        // A GPU whose virtualization NVML does not tell switches by what the driver does.
        assert_eq!(
            sim.set_mig_mode(&inv.gpus[2].uuid, true).unwrap(),
            MigModeChange::Applied
        );

        let l40s = SimBackend::from_profile("l40s-pcie", "n").unwrap();
        let g = l40s.snapshot().unwrap().gpus[0].clone();
        assert!(matches!(
            l40s.set_mig_mode(&g.uuid, true),
            Err(Error::MigModeFixed {
                reason: NoMigToggle::NotSupported,
                ..
            })
        ));
        l40s.update(|inv| inv.gpus[1].mig.mode_unknown = true);
        let unknown = l40s.snapshot().unwrap().gpus[1].clone();
        assert!(matches!(
            l40s.set_mig_mode(&unknown.uuid, true),
            Err(Error::MigModeFixed {
                reason: NoMigToggle::ModeUnknown,
                ..
            })
        ));
        let e = l40s
            .set_mig_mode(&GpuUuid("GPU-nope".into()), true)
            .unwrap_err();
        assert!(e.to_string().contains("GPU-nope"), "{e}");
    }

    #[test]
    fn mig_toggle_delay_is_taken_by_each_applied_change() {
        let sim = SimBackend::from_profile("dgx-h100", "n").unwrap();
        let g = sim.snapshot().unwrap().gpus[0].uuid.clone();
        sim.set_mig_toggle_delay(Duration::from_millis(3));
        sim.set_mig_mode(&g, true).unwrap();
        // Unchanged: nothing applied, nothing waited for.
        sim.set_mig_mode(&g, true).unwrap();
        assert_eq!(
            sim.actions(),
            [SimAction::SetMigMode {
                gpu: g,
                enabled: true,
                delay: Duration::from_millis(3),
            }]
        );
    }

    /// A running daemon's GPUs are made busy through its fault file: `process` lines block a
    /// MIG mode change and show in the usage readings, `holder` lines show in snapshots and
    /// block it unless harmless, `exit` lines end either.
    #[test]
    fn the_process_file_puts_processes_on_gpus() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("faults");
        let sim = SimBackend::from_profile("dgx-h100", "n")
            .unwrap()
            .with_process_file(Some(file.clone()));
        let g = sim.snapshot().unwrap().gpus[2].uuid.clone();
        std::fs::write(
            &file,
            "xid 1 79\nprocess 2 4242 2048 # a job\nprocess 3 77\nholder 2 900 nv-hostengine\n\
             holder 2 12 nvidia-persistenced\nholder 3 5\n",
        )
        .unwrap();
        let e = sim.set_mig_mode(&g, true).unwrap_err();
        assert!(
            matches!(&e, Error::InUse { processes, .. } if processes == &[4242, 900]),
            "{e:?}"
        );
        let usage = sim.usage().unwrap();
        assert_eq!(usage[2].processes[0].used_memory_bytes, Some(2048 << 20));
        assert_eq!(usage[2].processes.len(), 1, "holders are no processes");
        assert_eq!(usage[3].processes[0].pid, 77);
        let inv = sim.snapshot().unwrap();
        assert_eq!(
            inv.gpus[2].mig.holders,
            [
                holder(12, "nvidia-persistenced"),
                holder(900, "nv-hostengine")
            ]
        );
        assert_eq!(inv.gpus[3].mig.holders, [holder(5, "")]);
        std::fs::write(
            &file,
            format!(
                "process 2 4242 2048\nprocess 3 77\nholder 2 900 nv-hostengine\n\
                 holder 2 12 nvidia-persistenced\nexit {g} 4242\nexit 2 900\n"
            ),
        )
        .unwrap();
        assert_eq!(
            sim.snapshot().unwrap().gpus[2].mig.holders,
            [holder(12, "nvidia-persistenced")]
        );
        assert_eq!(sim.set_mig_mode(&g, true).unwrap(), MigModeChange::Applied);
    }
}
