//! What prepare changes on a GPU through the NVML backend: MIG devices created at a placement and
//! destroyed (through NVML), and the compute time slice (through `nvidia-smi` under the driver
//! root, as NVIDIA's DRA driver sets it on bare metal: NVML has no call for it).
//!
//! MIG mode is turned on and off with `nvmlDeviceSetMigMode` ([`set_mig_mode`]).
//!
//! A MIG device is a GPU instance with one compute instance spanning it. Creation makes the GPU
//! instance, then the compute instance, and destroys the GPU instance again when the second step
//! fails. A GPU instance without any compute instance is what a crash between the two steps
//! leaves, but also what an operator's `nvidia-smi mig -cgi` makes before its `-cci`: nvdra
//! destroys one only at exactly the placement and profile it is creating (the same allocation's
//! retry after a crash: the kubelet prepares the claim again, and the scheduler's allocation,
//! placement included, does not change), where the instance it makes would take the same slices
//! anyway. Elsewhere such an instance is named in the error and left alone: NVML gives no
//! creation time or creator by which to tell nvdra's from an operator's.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use nvml_wrapper::error::NvmlError;
use nvml_wrapper::{Device, Nvml};

use super::capture::{read_gi_profiles, read_mig_devices};
use super::ffi;
use super::mapping::map_mig_device;
use crate::inventory::holders::HolderScan;
use crate::inventory::{
    ComputeMode, Error, GpuUuid, Holder, MigDevice, MigModeChange, MigUuid, NoMigToggle, Placement,
    Result, TimeSlice,
};

/// Where `nvidia-smi` is looked for under the driver root, in order (the layout of the host's
/// `/` and of NVIDIA's driver container).
const BIN_DIRS: &[&str] = &["usr/bin", "usr/sbin", "bin", "sbin", "usr/local/bin"];

/// `nvidia-smi` under `driver_root`, if there is one.
pub(super) fn find_nvidia_smi(driver_root: &Path) -> Option<PathBuf> {
    BIN_DIRS
        .iter()
        .map(|d| driver_root.join(d).join("nvidia-smi"))
        .find(|p| p.is_file())
}

/// Why time slicing cannot be set under `driver_root`.
pub(super) fn no_nvidia_smi(driver_root: &Path) -> String {
    format!(
        "no nvidia-smi under the driver root {} (looked in {})",
        driver_root.display(),
        BIN_DIRS.join(", ")
    )
}

/// How long one `nvidia-smi` run may take before it is killed (it answers in a second or two;
/// one that hangs, on a driver that does, must not hold a prepare for good).
pub(super) const NVIDIA_SMI_DEADLINE: Duration = Duration::from_secs(20);

/// `nvidia-smi compute-policy --set-timeslice` takes 0 (default), 1 (short), 2 (medium) and 3
/// (long), the values of NVIDIA's `TimeSlicingConfig.interval`.
fn timeslice_value(interval: TimeSlice) -> u32 {
    match interval {
        TimeSlice::Default => 0,
        TimeSlice::Short => 1,
        TimeSlice::Medium => 2,
        TimeSlice::Long => 3,
    }
}

/// Sets the time slice of a whole GPU as NVIDIA's DRA driver does: compute mode `DEFAULT` (time
/// slicing needs processes to share the GPU), then the compute policy. `library` is the NVML
/// library nvdra loaded, preloaded into `nvidia-smi` so a containerized driver's tool finds its
/// own library.
pub(super) fn set_time_slice(
    nvidia_smi: &Path,
    library: Option<&Path>,
    gpu: &GpuUuid,
    interval: TimeSlice,
    deadline: Duration,
) -> Result<()> {
    let slice = format!("--set-timeslice={}", timeslice_value(interval));
    for args in [
        vec!["-i", gpu.as_str(), "-c", "DEFAULT"],
        vec!["compute-policy", "-i", gpu.as_str(), &slice],
    ] {
        let mut cmd = Command::new(nvidia_smi);
        cmd.args(&args);
        if let Some(lib) = library {
            let mut preload = lib.as_os_str().to_owned();
            if let Some(old) = std::env::var_os("LD_PRELOAD").filter(|v| !v.is_empty()) {
                preload.push(":");
                preload.push(old);
            }
            cmd.env("LD_PRELOAD", preload);
        }
        let command = format!("{} {}", nvidia_smi.display(), args.join(" "));
        let out = crate::child::output(&mut cmd, &command, deadline).map_err(|e| match e {
            crate::child::Error::Spawn { command, source } => Error::Command { command, source },
            crate::child::Error::Deadline { command, after } => {
                Error::CommandDeadline { command, after }
            }
            crate::child::Error::TooMuchOutput {
                command,
                stream,
                limit,
            } => Error::CommandFailed {
                command,
                status: "killed".into(),
                output: format!("it wrote more than {limit} bytes to its {stream}"),
            },
        })?;
        if !out.status.success() {
            let mut said = String::from_utf8_lossy(&out.stdout).trim().to_string();
            let stderr = String::from_utf8_lossy(&out.stderr);
            if !stderr.trim().is_empty() {
                if !said.is_empty() {
                    said.push_str("; ");
                }
                said.push_str(stderr.trim());
            }
            // nvidia-smi's refusal without CAP_SYS_ADMIN ("Insufficient Permissions").
            if said
                .to_ascii_lowercase()
                .contains("insufficient permissions")
            {
                said.push_str("; ");
                said.push_str(NEEDS_SYS_ADMIN);
            }
            return Err(Error::CommandFailed {
                command,
                status: out.status.to_string(),
                output: said,
            });
        }
    }
    Ok(())
}

/// The compute mode of a whole GPU.
pub(super) fn compute_mode(nvml: &Nvml, gpu: &GpuUuid) -> Result<ComputeMode> {
    use nvml_wrapper::enum_wrappers::device::ComputeMode as Nvml;
    let d = parent(nvml, gpu)?;
    match d.compute_mode() {
        Ok(Nvml::Default) => Ok(ComputeMode::Default),
        Ok(Nvml::ExclusiveProcess) => Ok(ComputeMode::ExclusiveProcess),
        Ok(Nvml::Prohibited) => Ok(ComputeMode::Prohibited),
        // EXCLUSIVE_THREAD is gone from every driver nvdra runs with; it admits one context,
        // which is what the record needs to put back.
        Ok(Nvml::ExclusiveThread) => Ok(ComputeMode::ExclusiveProcess),
        Err(e) => Err(Error::Nvml {
            call: "nvmlDeviceGetComputeMode".into(),
            reason: format!("GPU {gpu}: {e}"),
        }),
    }
}

/// Sets the compute mode of a whole GPU; a refusal says what the node needs.
pub(super) fn set_compute_mode(nvml: &Nvml, gpu: &GpuUuid, mode: ComputeMode) -> Result<()> {
    use nvml_wrapper::enum_wrappers::device::ComputeMode as Nvml;
    let mut d = parent(nvml, gpu)?;
    let to = match mode {
        ComputeMode::Default => Nvml::Default,
        ComputeMode::ExclusiveProcess => Nvml::ExclusiveProcess,
        ComputeMode::Prohibited => Nvml::Prohibited,
    };
    d.set_compute_mode(to).map_err(|e| match e {
        NvmlError::NoPermission => Error::Refused(format!(
            "cannot set GPU {gpu} to compute mode {mode}: NVML says no permission; \
             {NEEDS_SYS_ADMIN}"
        )),
        NvmlError::NotSupported => Error::Refused(format!(
            "GPU {gpu} does not support compute mode {mode} (NVML: not supported)"
        )),
        e => Error::Nvml {
            call: "nvmlDeviceSetComputeMode".into(),
            reason: format!("GPU {gpu} to {mode}: {e}; check the GPU with nvidia-smi -q -i {gpu}"),
        },
    })
}

/// Turns MIG mode on or off. `nvmlDeviceSetMigMode` (nvml.h) records the requested mode as
/// pending, returns `NVML_SUCCESS`, and reports through its `activationStatus` out-parameter
/// whether the change took effect: `NVML_SUCCESS`; `NVML_ERROR_IN_USE` when the GPU is not idle
/// ("the caller of this API is expected to idle the device and retry"); or
/// `NVML_ERROR_RESET_REQUIRED` where only a reset (a VM reboot) applies it. Some drivers return
/// IN_USE as the call's own return code instead: nvdra treats both forms alike. After IN_USE and
/// RESET_REQUIRED the change is left pending, as NVML leaves it: the caller withdraws it (one
/// more call, for the current mode: [`Error::InUse`], [`Error::ResetRequired`]), so that the
/// plugin records its intent around the withdrawal. `holders` (where configured) names what
/// holds the GPU in an IN_USE error, beside NVML's compute processes.
pub(super) fn set_mig_mode(
    nvml: &Nvml,
    gpu: &GpuUuid,
    enabled: bool,
    holders: Option<&HolderScan>,
) -> Result<MigModeChange> {
    use nvml_wrapper_sys::bindings::{
        NVML_DEVICE_MIG_ENABLE, nvmlReturn_enum_NVML_ERROR_IN_USE as IN_USE,
        nvmlReturn_enum_NVML_ERROR_RESET_REQUIRED as RESET_REQUIRED,
        nvmlReturn_enum_NVML_SUCCESS as SUCCESS,
    };
    let d = parent(nvml, gpu)?;
    let fixed = |reason| Error::MigModeFixed {
        gpu: gpu.clone(),
        reason,
    };
    let (current, pending) = match d.mig_mode() {
        Ok(m) => (
            m.current == NVML_DEVICE_MIG_ENABLE,
            m.pending == NVML_DEVICE_MIG_ENABLE,
        ),
        Err(NvmlError::NotSupported) => return Err(fixed(NoMigToggle::NotSupported)),
        Err(e) => return Err(nvml_error("nvmlDeviceGetMigMode", e)),
    };
    if current == enabled && pending == enabled {
        return Ok(MigModeChange::Unchanged);
    }
    if !enabled && current {
        let index = d.index().map_err(|e| nvml_error("nvmlDeviceGetIndex", e))?;
        let devices = mig_devices(nvml, &d, index, gpu);
        if !devices.is_empty() {
            return Err(Error::MigDevicesExist {
                gpu: gpu.clone(),
                devices: devices.into_iter().map(|m| m.uuid).collect(),
            });
        }
        // A GPU instance without a compute instance is no MIG device, yet it keeps the mode on
        // (the change would answer IN_USE naming no process). It may be an operator's being
        // made: named, never destroyed here.
        let orphans = orphans(nvml, &d, None)?;
        if !orphans.is_empty() {
            return Err(Error::Refused(format!(
                "cannot turn MIG mode off on GPU {gpu}: {} without a compute instance exist{} \
                 (an operator's creation in progress, or left by an interrupted one); nvdra \
                 destroys none it cannot tell is its own: finish or destroy {} ({})",
                describe_orphans(&orphans),
                if orphans.len() == 1 { "s" } else { "" },
                if orphans.len() == 1 { "it" } else { "them" },
                destroy_command(gpu, &orphans),
            )));
        }
    }
    let status = match d.set_mig_mode(enabled) {
        Ok(status) => status,
        // Some drivers answer a GPU that is not idle with IN_USE as the call's return code
        // rather than its activation status: the same refusal, handled as one.
        Err(NvmlError::InUse) => IN_USE,
        Err(NvmlError::NotSupported) => return Err(fixed(NoMigToggle::NotSupported)),
        Err(e) => return Err(nvml_error("nvmlDeviceSetMigMode", e)),
    };
    match status {
        SUCCESS if current == enabled => Ok(MigModeChange::Unchanged),
        SUCCESS => Ok(MigModeChange::Applied),
        IN_USE => {
            let compute: Vec<u32> = super::usage::compute_processes(&d)
                .map(|ps| ps.into_iter().map(|p| p.pid).collect())
                .unwrap_or_default();
            let (processes, holders) = in_use(&d, compute, holders);
            Err(Error::InUse {
                gpu: gpu.clone(),
                processes,
                holders,
            })
        }
        RESET_REQUIRED => Err(Error::ResetRequired {
            gpu: gpu.clone(),
            current,
            pending: enabled,
        }),
        other => Err(Error::Nvml {
            call: "nvmlDeviceSetMigMode".into(),
            reason: format!("GPU {gpu}: activation status {other}"),
        }),
    }
}

/// What holds `d` after an IN_USE answer: every pid in the way (NVML's compute processes
/// first, then the other holders the scan finds) and those of them that block, described.
/// Without a scan, the compute processes only, unnamed.
fn in_use(d: &Device<'_>, compute: Vec<u32>, scan: Option<&HolderScan>) -> (Vec<u32>, Vec<Holder>) {
    let found = match (scan, d.minor_number()) {
        (Some(scan), Ok(minor)) => {
            let held = scan.scan(&[minor]).remove(&minor).unwrap_or_default();
            scan.with_processes(held, &compute)
        }
        _ => crate::inventory::holders::unnamed(&compute),
    };
    let holders: Vec<Holder> = found.into_iter().filter(Holder::blocks_driver).collect();
    let mut processes = compute;
    processes.retain(|p| holders.iter().any(|h| h.pid == *p));
    for h in &holders {
        if !processes.contains(&h.pid) {
            processes.push(h.pid);
        }
    }
    (processes, holders)
}

/// What a refused change needs: the deployments give nvdra's container `CAP_SYS_ADMIN`, which
/// the driver asks of whoever changes MIG devices, MIG mode or a compute mode, only where MIG or
/// shares are switched on.
const NEEDS_SYS_ADMIN: &str = "changing a GPU (MIG devices, MIG mode, compute mode) needs \
    CAP_SYS_ADMIN in nvdra's container: deploy with the kustomize component \
    components/mig-and-shares, or the Helm value migAndShares=true";

/// Why this process cannot change GPUs for want of `CAP_SYS_ADMIN`, read from its
/// `/proc/self/status` text (`CapEff:`, hex; the capability is bit 21); `None` when it has it or
/// the line is missing (not Linux's format: nothing to say).
pub(super) fn lacks_sys_admin(status: &str) -> Option<String> {
    const CAP_SYS_ADMIN: u32 = 21;
    let hex = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))?
        .trim();
    let caps = u64::from_str_radix(hex, 16).ok()?;
    (caps & (1 << CAP_SYS_ADMIN) == 0).then(|| NEEDS_SYS_ADMIN.to_string())
}

/// [`lacks_sys_admin`] of this process.
pub(super) fn lacks_sys_admin_now() -> Option<String> {
    lacks_sys_admin(&std::fs::read_to_string("/proc/self/status").ok()?)
}

fn nvml_error(call: &str, e: NvmlError) -> Error {
    let reason = match e {
        NvmlError::NoPermission => format!("{e}; {NEEDS_SYS_ADMIN}"),
        e => e.to_string(),
    };
    Error::Nvml {
        call: call.into(),
        reason,
    }
}

fn parent<'n>(nvml: &'n Nvml, gpu: &GpuUuid) -> Result<Device<'n>> {
    nvml.device_by_uuid(gpu.as_str()).map_err(|e| match e {
        NvmlError::NotFound | NvmlError::InvalidArg => {
            Error::Refused(format!("no GPU with UUID {gpu}"))
        }
        e => nvml_error("nvmlDeviceGetHandleByUUID", e),
    })
}

/// The MIG devices of `parent` as the inventory lists them.
fn mig_devices(nvml: &Nvml, parent: &Device<'_>, index: u32, uuid: &GpuUuid) -> Vec<MigDevice> {
    let profiles = read_gi_profiles(nvml, parent);
    let total = parent.memory_info().map(|m| m.total).unwrap_or_default();
    read_mig_devices(nvml, parent)
        .into_iter()
        .filter_map(|d| map_mig_device(index, uuid.as_str(), d, &profiles, total))
        .collect()
}

/// Creates a GPU instance of `gi_profile_id` at `placement` and one compute instance spanning
/// it; returns the MIG device as the inventory will list it.
pub(super) fn create_mig(
    nvml: &Nvml,
    gpu: &GpuUuid,
    gi_profile_id: u32,
    placement: Placement,
) -> Result<MigDevice> {
    let d = parent(nvml, gpu)?;
    match d.mig_mode() {
        Ok(m) if m.current == nvml_wrapper_sys::bindings::NVML_DEVICE_MIG_ENABLE => {}
        Ok(_) => {
            return Err(Error::Refused(format!(
                "GPU {gpu} is not in MIG mode; enable MIG mode before creating MIG devices"
            )));
        }
        Err(NvmlError::NotSupported) => {
            return Err(Error::Refused(format!("GPU {gpu} cannot do MIG")));
        }
        Err(e) => return Err(nvml_error("nvmlDeviceGetMigMode", e)),
    }
    let at = || format!("{}..{}", placement.start, placement.start + placement.size);
    let gi = match ffi::create_gpu_instance(nvml, &d, gi_profile_id, placement) {
        Ok(gi) => gi,
        Err(e) if no_room(&e) && remove_orphan_at(nvml, &d, gpu, gi_profile_id, placement)? => {
            ffi::create_gpu_instance(nvml, &d, gi_profile_id, placement)
                .map_err(|e| refused_create(gpu, gi_profile_id, &at(), e))?
        }
        Err(e) if no_room(&e) => {
            let orphans = orphans(nvml, &d, Some(placement))?;
            if orphans.is_empty() {
                return Err(refused_create(gpu, gi_profile_id, &at(), e));
            }
            return Err(Error::Refused(format!(
                "insufficient resources: GPU-instance profile {gi_profile_id} at {} on GPU {gpu} \
                 overlaps {} without a compute instance (an operator's creation in progress, or \
                 left by an interrupted one); nvdra destroys such an instance only at exactly \
                 the placement and profile it creates: finish or destroy it ({})",
                at(),
                describe_orphans(&orphans),
                destroy_command(gpu, &orphans),
            )));
        }
        Err(e) => return Err(refused_create(gpu, gi_profile_id, &at(), e)),
    };
    let undo = |e: Error| {
        if let Err(de) = ffi::destroy_gpu_instance(nvml, gi) {
            tracing::error!(gpu.uuid = %gpu, error = %de, "cannot destroy the GPU instance of a failed MIG creation; it is removed when a new instance needs its slices");
        }
        e
    };
    let gi_id = ffi::gpu_instance_id_of(nvml, gi)
        .map_err(|e| undo(nvml_error("nvmlGpuInstanceGetInfo", e)))?;
    let ci_profile = ffi::spanning_compute_profile(nvml, gi).map_err(|e| {
        undo(nvml_error(
            "nvmlGpuInstanceGetComputeInstanceProfileInfo",
            e,
        ))
    })?;
    let (ci, ci_id) = ffi::create_compute_instance(nvml, gi, ci_profile)
        .map_err(|e| undo(nvml_error("nvmlGpuInstanceCreateComputeInstance", e)))?;
    let index = d.index().unwrap_or_default();
    match mig_devices(nvml, &d, index, gpu)
        .into_iter()
        .find(|m| m.gi_id == gi_id && m.ci_id == ci_id)
    {
        Some(m) => Ok(m),
        None => {
            let _ = ffi::destroy_compute_instance(nvml, ci);
            Err(undo(Error::Nvml {
                call: "nvmlDeviceGetMigDeviceHandleByIndex".into(),
                reason: format!(
                    "the MIG device of GPU instance {gi_id}, compute instance {ci_id} on GPU {gpu} is not listed after its creation"
                ),
            }))
        }
    }
}

/// `NVML_ERROR_INSUFFICIENT_RESOURCES` (which nvml-wrapper 0.13 does not name) or `IN_USE`:
/// the slices are taken.
fn no_room(e: &NvmlError) -> bool {
    use nvml_wrapper_sys::bindings::nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_RESOURCES as NO_ROOM;
    matches!(e, NvmlError::InUse) || matches!(e, NvmlError::UnexpectedVariant(c) if *c == NO_ROOM)
}

fn refused_create(gpu: &GpuUuid, profile: u32, at: &str, e: NvmlError) -> Error {
    match e {
        e if no_room(&e) => Error::Refused(format!(
            "insufficient resources: GPU-instance profile {profile} at {at} overlaps an existing instance on GPU {gpu}"
        )),
        NvmlError::InvalidArg | NvmlError::NotSupported => Error::Refused(format!(
            "GPU-instance profile {profile} cannot be placed at {at} on GPU {gpu}"
        )),
        e => nvml_error("nvmlDeviceCreateGpuInstanceWithPlacement", e),
    }
}

/// A GPU instance holding no compute instance: (GPU-instance id, profile id, placement).
type Orphan = (u32, u32, Placement);

/// The GPU instances of `d` overlapping `within` (`None`: anywhere) that hold no compute
/// instance.
fn orphans(nvml: &Nvml, d: &Device<'_>, within: Option<Placement>) -> Result<Vec<Orphan>> {
    let mut out = Vec::new();
    for p in read_gi_profiles(nvml, d) {
        let gis = match ffi::gpu_instances(nvml, d, p.info.id) {
            Ok(gis) => gis,
            Err(NvmlError::NotFound | NvmlError::NotSupported | NvmlError::InvalidArg) => continue,
            Err(e) => return Err(nvml_error("nvmlDeviceGetGpuInstances", e)),
        };
        for (gi, id, at) in gis {
            if within.is_some_and(|w| !at.overlaps(&w)) {
                continue;
            }
            let cis = ffi::compute_instance_count(nvml, gi)
                .map_err(|e| nvml_error("nvmlGpuInstanceGetComputeInstances", e))?;
            if cis == 0 {
                out.push((id, p.info.id, at));
            }
        }
    }
    out.sort();
    Ok(out)
}

/// `GPU instance 3 (profile 19 at 0..1)`, for each.
fn describe_orphans(orphans: &[Orphan]) -> String {
    let one = |(id, profile, at): &Orphan| {
        format!(
            "GPU instance {id} (profile {profile} at {}..{})",
            at.start,
            at.start + at.size
        )
    };
    orphans.iter().map(one).collect::<Vec<_>>().join(", ")
}

/// The `nvidia-smi` command that destroys `orphans`.
fn destroy_command(gpu: &GpuUuid, orphans: &[Orphan]) -> String {
    let ids: Vec<String> = orphans.iter().map(|(id, ..)| id.to_string()).collect();
    format!("nvidia-smi mig -dgi -gi {} -i {gpu}", ids.join(","))
}

/// Destroys the GPU instance of `profile_id` at exactly `placement` if it holds no compute
/// instance: what an interrupted creation of this same MIG device left (see the module doc);
/// returns whether there was one.
fn remove_orphan_at(
    nvml: &Nvml,
    d: &Device<'_>,
    gpu: &GpuUuid,
    profile_id: u32,
    placement: Placement,
) -> Result<bool> {
    let gis = match ffi::gpu_instances(nvml, d, profile_id) {
        Ok(gis) => gis,
        Err(NvmlError::NotFound | NvmlError::NotSupported | NvmlError::InvalidArg) => {
            return Ok(false);
        }
        Err(e) => return Err(nvml_error("nvmlDeviceGetGpuInstances", e)),
    };
    for (gi, id, at) in gis {
        if at != placement {
            continue;
        }
        let cis = ffi::compute_instance_count(nvml, gi)
            .map_err(|e| nvml_error("nvmlGpuInstanceGetComputeInstances", e))?;
        if cis > 0 {
            return Ok(false);
        }
        ffi::destroy_gpu_instance(nvml, gi).map_err(|e| nvml_error("nvmlGpuInstanceDestroy", e))?;
        tracing::warn!(
            gpu.uuid = %gpu,
            gi.id = id,
            profile = profile_id,
            start = at.start,
            size = at.size,
            "destroyed a GPU instance without compute instances at the placement being created (left by an interrupted creation of the same MIG device)"
        );
        return Ok(true);
    }
    Ok(false)
}

/// Destroys MIG device `mig` of `gpu`: its compute instance, then its GPU instance. One that no
/// longer exists (or whose instances are already gone) is not an error.
pub(super) fn destroy_mig(nvml: &Nvml, gpu: &GpuUuid, mig: &MigUuid) -> Result<()> {
    let d = parent(nvml, gpu)?;
    let found = read_mig_devices(nvml, &d)
        .into_iter()
        .find(|m| m.uuid.as_deref() == Ok(mig.as_str()));
    let Some(m) = found else {
        return Ok(());
    };
    let gi_id = m.gi_id.clone().map_err(|e| Error::Nvml {
        call: "nvmlDeviceGetGpuInstanceId".into(),
        reason: format!("MIG device {mig}: {e}"),
    })?;
    let ci_id = m.ci_id.clone().map_err(|e| Error::Nvml {
        call: "nvmlDeviceGetComputeInstanceId".into(),
        reason: format!("MIG device {mig}: {e}"),
    })?;
    let gi = match ffi::gpu_instance_by_id(nvml, &d, gi_id) {
        Ok(gi) => gi,
        Err(NvmlError::NotFound) => return Ok(()),
        Err(e) => return Err(nvml_error("nvmlDeviceGetGpuInstanceById", e)),
    };
    match ffi::compute_instance_by_id(nvml, gi, ci_id) {
        Ok(ci) => match ffi::destroy_compute_instance(nvml, ci) {
            Ok(()) | Err(NvmlError::NotFound) => {}
            Err(e) => return Err(nvml_error("nvmlComputeInstanceDestroy", e)),
        },
        Err(NvmlError::NotFound) => {}
        Err(e) => return Err(nvml_error("nvmlGpuInstanceGetComputeInstanceById", e)),
    }
    match ffi::destroy_gpu_instance(nvml, gi) {
        Ok(()) | Err(NvmlError::NotFound) => Ok(()),
        Err(e) => Err(nvml_error("nvmlGpuInstanceDestroy", e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The base deployments leave `CAP_SYS_ADMIN` out: a change the driver refuses for it names
    /// the switch that adds it, whichever call was refused.
    #[test]
    fn a_refusal_for_permission_names_the_switch_that_grants_it() {
        let e = nvml_error(
            "nvmlDeviceCreateGpuInstanceWithPlacement",
            NvmlError::NoPermission,
        );
        let msg = e.to_string();
        for want in [
            "nvmlDeviceCreateGpuInstanceWithPlacement",
            "CAP_SYS_ADMIN",
            "components/mig-and-shares",
            "migAndShares=true",
        ] {
            assert!(msg.contains(want), "no {want:?} in {msg}");
        }
        let other = nvml_error("nvmlDeviceGetMigMode", NvmlError::GpuLost).to_string();
        assert!(!other.contains("CAP_SYS_ADMIN"), "{other}");
        let gi = refused_create(&GpuUuid("GPU-1".into()), 9, "0", NvmlError::NoPermission);
        assert!(gi.to_string().contains("migAndShares=true"), "{gi}");
    }
    use std::os::unix::fs::PermissionsExt;

    fn script(dir: &Path, body: &str) -> PathBuf {
        let bin = dir.join("usr/bin");
        std::fs::create_dir_all(&bin).unwrap();
        let p = bin.join("nvidia-smi");
        std::fs::write(&p, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        p
    }

    #[test]
    fn the_capability_is_read_from_the_effective_set() {
        let status = |eff: &str| {
            format!(
                "Name:\tnvdra\nCapInh:\t0000000000000000\nCapPrm:\t00000000a80425fb\nCapEff:\t{eff}\n"
            )
        };
        // Docker's default set (no SYS_ADMIN), then the same with bit 21.
        let why = lacks_sys_admin(&status("00000000a80425fb")).unwrap();
        assert!(why.contains("components/mig-and-shares"), "{why}");
        assert_eq!(lacks_sys_admin(&status("00000000a82425fb")), None);
        assert_eq!(lacks_sys_admin(&status("000001ffffffffff")), None);
        assert!(lacks_sys_admin(&status("0000000000000000")).is_some());
        // Not the format: nothing said.
        assert_eq!(lacks_sys_admin("Name:\tnvdra\n"), None);
        assert_eq!(lacks_sys_admin(&status("zz")), None);
    }

    /// nvidia-smi's own words for a refused change (it prints them on stdout and exits 4) get
    /// the switch that grants the capability.
    #[test]
    fn an_nvidia_smi_refused_for_permission_names_the_switch() {
        let root = tempfile::tempdir().unwrap();
        let smi = script(
            root.path(),
            "echo 'Setting compute mode to DEFAULT for GPU 00000000:18:00.0: Insufficient Permissions'; exit 4",
        );
        let gpu = GpuUuid("GPU-1".into());
        let e = set_time_slice(&smi, None, &gpu, TimeSlice::Short, NVIDIA_SMI_DEADLINE)
            .unwrap_err()
            .to_string();
        assert!(e.contains("Insufficient Permissions"), "{e}");
        assert!(e.contains("components/mig-and-shares"), "{e}");
        let smi = script(root.path(), "echo 'GPU is lost'; exit 15");
        let e = set_time_slice(&smi, None, &gpu, TimeSlice::Short, NVIDIA_SMI_DEADLINE)
            .unwrap_err()
            .to_string();
        assert!(!e.contains("CAP_SYS_ADMIN"), "{e}");
    }

    #[test]
    fn nvidia_smi_is_found_under_the_driver_root_only() {
        let root = tempfile::tempdir().unwrap();
        assert_eq!(find_nvidia_smi(root.path()), None);
        let why = no_nvidia_smi(root.path());
        assert!(why.contains(&root.path().display().to_string()), "{why}");
        let p = script(root.path(), "exit 0");
        assert_eq!(find_nvidia_smi(root.path()), Some(p));
    }

    #[test]
    fn each_interval_is_set_with_its_number_and_a_failure_names_the_command_and_output() {
        let root = tempfile::tempdir().unwrap();
        let log = root.path().join("log");
        let smi = script(root.path(), &format!("echo \"$*\" >> {}", log.display()));
        let gpu = GpuUuid("GPU-1".into());
        for i in [
            TimeSlice::Default,
            TimeSlice::Short,
            TimeSlice::Medium,
            TimeSlice::Long,
        ] {
            set_time_slice(&smi, None, &gpu, i, NVIDIA_SMI_DEADLINE).unwrap();
        }
        let text = std::fs::read_to_string(&log).unwrap();
        let slices: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("compute-policy"))
            .collect();
        assert_eq!(
            slices,
            [0, 1, 2, 3].map(|n| format!("compute-policy -i GPU-1 --set-timeslice={n}"))
        );
        assert_eq!(
            text.lines().filter(|l| *l == "-i GPU-1 -c DEFAULT").count(),
            4
        );

        let smi = script(root.path(), "echo 'Insufficient Permissions'; exit 4");
        let e = set_time_slice(&smi, None, &gpu, TimeSlice::Long, NVIDIA_SMI_DEADLINE).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("nvidia-smi -i GPU-1 -c DEFAULT")
                && msg.contains("Insufficient Permissions")
                && msg.contains("4"),
            "{msg}"
        );
    }

    #[test]
    fn an_nvidia_smi_that_hangs_is_killed_and_named_with_its_deadline() {
        let root = tempfile::tempdir().unwrap();
        // `exec`, so the kill reaches the sleep itself; a minute against a fifth of a second.
        let smi = script(root.path(), "exec sleep 60");
        let gpu = GpuUuid("GPU-1".into());
        let e = set_time_slice(
            &smi,
            None,
            &gpu,
            TimeSlice::Long,
            Duration::from_millis(200),
        )
        .unwrap_err();
        assert!(matches!(e, Error::CommandDeadline { .. }), "{e:?}");
        assert_eq!(
            e.to_string(),
            format!(
                "{} -i GPU-1 -c DEFAULT did not finish within 200ms and was killed",
                smi.display()
            )
        );
    }
}
