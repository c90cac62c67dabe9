//! Whether a GPU's MIG mode can change at run time ("dynamic MIG": MIG mode turned on at the
//! first MIG claim and off after the last), and why not.
//!
//! Only Hopper and later apply a MIG mode change at once; on Ampere NVML records the change as
//! *pending* until the GPU is reset, which nvdra never does under running pods, so there MIG
//! mode stays the operator's business (as NVIDIA's DRA driver has it). Hopper and later switch
//! without a reset on bare metal and in a passthrough VM alike (the cloud's H100 and H200
//! nodes), as NVIDIA's driver allows them (its issue 1006, PR 1018); a vGPU guest cannot switch
//! at all.

use std::fmt;

use serde::{Deserialize, Serialize};

use super::{ComputeCapability, Gpu, MigUuid};

/// How a GPU is virtualized, as NVML's `nvmlDeviceGetVirtualizationMode` reports it
/// (`nvmlGpuVirtualizationMode_t`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Virtualization {
    /// `NVML_GPU_VIRTUALIZATION_MODE_NONE`: bare metal.
    BareMetal,
    /// `…_PASSTHROUGH`: the whole GPU passed through to this VM.
    Passthrough,
    /// `…_VGPU`: a vGPU inside a VM.
    VgpuGuest,
    /// `…_HOST_VGPU`: the hypervisor, serving vGPUs.
    VgpuHost,
    /// `…_HOST_VSGA`: the hypervisor, in vSGA mode.
    VsgaHost,
}

impl fmt::Display for Virtualization {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Virtualization::BareMetal => "bare metal",
            Virtualization::Passthrough => "a passthrough VM",
            Virtualization::VgpuGuest => "a vGPU guest",
            Virtualization::VgpuHost => "a vGPU host",
            Virtualization::VsgaHost => "a vSGA host",
        })
    }
}

/// Why a GPU's MIG mode cannot change at run time ([`Gpu::mig_toggle`]).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum NoMigToggle {
    /// The GPU has no MIG.
    #[error("MIG not supported")]
    NotSupported,
    /// NVML could not read the MIG mode.
    #[error("MIG mode unknown")]
    ModeUnknown,
    /// Before Hopper a change is applied only by a GPU reset.
    #[error("{}: MIG mode changes only through the operator", before_hopper(.architecture, .compute_capability))]
    BeforeHopper {
        architecture: Option<String>,
        compute_capability: ComputeCapability,
    },
    /// A vGPU guest, or a hypervisor serving vGPUs ([`Gpu::mig_toggle`] says why).
    #[error("{0}")]
    Virtualized(Virtualization),
    /// NVML could not tell whether the GPU is virtualized.
    #[error("virtualization mode unknown")]
    VirtualizationUnknown,
    /// A change waits for a GPU reset.
    #[error("MIG mode change pending (current {}, pending {}): reset required", on_off(*.current), on_off(*.pending))]
    Pending { current: bool, pending: bool },
    /// The driver answered a switch of this GPU with `RESET_REQUIRED`
    /// ([`SwitchBlock::ResetRequired`]): nvdra withdrew the change and leaves the mode to the
    /// operator until it restarts.
    #[error("the driver answered a switch with RESET_REQUIRED: MIG mode left to the operator")]
    ResetRequired,
}

fn before_hopper(architecture: &Option<String>, cc: &ComputeCapability) -> String {
    match architecture {
        Some(a) => format!("{a} ({cc})"),
        None => format!("compute capability {cc}"),
    }
}

/// `on` or `off`, as `nvidia-smi` shows a MIG mode.
pub fn on_off(enabled: bool) -> &'static str {
    if enabled { "on" } else { "off" }
}

/// The first compute capability whose MIG mode changes without a GPU reset.
pub const HOPPER: ComputeCapability = ComputeCapability { major: 9, minor: 0 };

impl Gpu {
    /// Whether nvdra may change this GPU's MIG mode at run time; `Err` says why not. Read from
    /// the inventory alone: MIG support and mode, compute capability, virtualization, any
    /// pending change and whether the driver answered a switch with `RESET_REQUIRED`
    /// ([`Mig::switch_block`](super::Mig::switch_block)). The first reason found is given, in
    /// that order.
    ///
    /// Virtualization: bare metal and a passthrough VM switch alike (the whole GPU is the
    /// guest's, and Hopper needs no reset, which a guest could not do); NVIDIA's driver
    /// excludes only vGPU guests. Kept out besides NVIDIA's rule: a vGPU guest (its MIG shape
    /// is the vGPU profile the hypervisor gave it), and both host modes, `VgpuHost` and
    /// `VsgaHost`: there the GPU (and its MIG instances, for MIG-backed vGPUs) serves the
    /// hypervisor's VMs, whose use NVML's process lists on the host do not show, so a switch
    /// would take the GPU from under running VMs or be refused for reasons nvdra cannot name.
    ///
    /// A pending change keeps the GPU out (on Hopper the plugin withdraws it, and the GPU is
    /// offered again at the next read); so does a switch block of `RESET_REQUIRED`. An
    /// `IN_USE` block does not: the GPU can switch once its holders are gone.
    pub fn mig_toggle(&self) -> Result<(), NoMigToggle> {
        self.mig_toggle_by_hardware()?;
        if self.mig.switch_block == Some(SwitchBlock::ResetRequired) {
            return Err(NoMigToggle::ResetRequired);
        }
        Ok(())
    }

    /// [`Gpu::mig_toggle`] by what the GPU reports alone, whatever the driver answered a
    /// switch: whether the GPU would switch at run time but for a `RESET_REQUIRED` answer.
    pub fn mig_toggle_by_hardware(&self) -> Result<(), NoMigToggle> {
        if self.mig.mode_unknown {
            return Err(NoMigToggle::ModeUnknown);
        }
        if !self.mig.capable {
            return Err(NoMigToggle::NotSupported);
        }
        if self.cuda_compute_capability < HOPPER {
            return Err(NoMigToggle::BeforeHopper {
                architecture: self.architecture.clone(),
                compute_capability: self.cuda_compute_capability,
            });
        }
        match self.virtualization {
            None => return Err(NoMigToggle::VirtualizationUnknown),
            Some(Virtualization::BareMetal | Virtualization::Passthrough) => {}
            // A vGPU guest, a vGPU or vSGA host.
            Some(v) => return Err(NoMigToggle::Virtualized(v)),
        }
        if let Some(pending) = self.mig.pending {
            return Err(NoMigToggle::Pending {
                current: self.mig.enabled,
                pending,
            });
        }
        Ok(())
    }
}

/// What [`DeviceBackend::set_mig_mode`](super::DeviceBackend::set_mig_mode) did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MigModeChange {
    /// The GPU was already in that mode (with no other change pending).
    Unchanged,
    /// The mode changed and is in effect now. Turning MIG mode on leaves no MIG devices.
    Applied,
}

/// The UUIDs of `devices`, comma-separated, for an error naming the MIG devices in the way.
pub fn mig_uuids<'a>(devices: impl IntoIterator<Item = &'a MigUuid>) -> String {
    devices
        .into_iter()
        .map(MigUuid::as_str)
        .collect::<Vec<_>>()
        .join(", ")
}

/// Process ids, comma-separated, each with its name where `holders` give one:
/// `4242 (nv-hostengine), 4343`.
pub fn in_use_by(processes: &[u32], holders: &[Holder]) -> String {
    processes
        .iter()
        .map(|pid| match holders.iter().find(|h| h.pid == *pid) {
            Some(h) if !h.name.is_empty() => format!("{pid} ({})", h.name),
            _ => pid.to_string(),
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// A process holding a GPU open, as a backend read finds it: by the GPU's device file
/// (`/dev/nvidia<minor>` among the process's open files) or by NVML's list of the GPU's compute
/// processes.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Holder {
    /// The PID in the host's PID namespace.
    pub pid: u32,
    /// The process's name (`/proc/<pid>/comm`), e.g. `nv-hostengine`; empty where unreadable.
    pub name: String,
    pub kind: HolderKind,
}

/// Whose a [`Holder`] is, which decides whether it keeps nvdra from switching the GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum HolderKind {
    /// Not nvdra's: a DCGM host engine, dcgm-exporter, a monitoring agent, a stray CUDA
    /// context. The driver refuses a switch while it holds the GPU.
    Foreign,
    /// nvdra's own MPS control daemon or server, which exits once its last share is released
    /// (asynchronously): nvdra waits for it before it switches or destroys an instance.
    OwnMps,
    /// Holds the device file without keeping the driver from switching: `nvidia-persistenced`
    /// (persistence mode is what MIG mode needs).
    Harmless,
}

impl Holder {
    /// Whether this holder keeps the driver from switching the GPU's MIG mode now, and nvdra
    /// does not expect it to go by itself.
    pub fn blocks_switch(&self) -> bool {
        self.kind == HolderKind::Foreign
    }

    /// Whether the driver refuses a switch (`IN_USE`) while this holder holds the GPU: every
    /// holder but a [`HolderKind::Harmless`] one (nvdra's MPS too, until it exits).
    pub fn blocks_driver(&self) -> bool {
        self.kind != HolderKind::Harmless
    }
}

impl fmt::Display for Holder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.name.is_empty() {
            write!(f, "pid {}", self.pid)
        } else {
            write!(f, "pid {} ({})", self.pid, self.name)
        }
    }
}

/// Why nvdra does not switch a GPU's MIG mode now, though the GPU could at run time
/// ([`Mig::switch_block`](super::Mig::switch_block)).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", tag = "reason")]
pub enum SwitchBlock {
    /// The driver answered a switch with `RESET_REQUIRED`: the change was withdrawn, and nvdra
    /// does not switch this GPU again (until it restarts); the GPU is published as one whose
    /// MIG mode is the operator's.
    ResetRequired,
    /// A prepare met `IN_USE` from these holders: the devices of the GPU that need a switch are
    /// tainted `NoExecute` until the holders are gone, so a claim allocated on one is evicted
    /// and rescheduled rather than retried for ever.
    InUse { holders: Vec<Holder> },
}
