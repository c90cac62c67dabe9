//! NVML health events: one event set for every GPU (critical XID errors and double-bit ECC
//! errors, as far as each GPU supports them), waited on by a thread of its own with
//! `nvmlEventSetWait_v2`; and the recovery probe (a GPU answers when NVML finds it by UUID).
//!
//! One GPU's NVML failure touches only that GPU: a GPU whose registration fails is reported
//! [`EventKind::Unmonitored`] and the others stay registered (registration goes through
//! `ffi::register_events`, because nvml-wrapper frees the whole set when one registration
//! fails); a GPU that cannot register because it is too old (`NOT_SUPPORTED`) is logged and left
//! alone, as NVIDIA's plugin does (and a driver without event sets at all is logged, not
//! tainted). A wait that answers `GPU_IS_LOST` names no GPU, so every
//! watched GPU is probed and only those NVML no longer finds are reported lost — never "every
//! device unhealthy" for one error (NVIDIA device plugin #669). A wait NVML refuses for good
//! (`UNINITIALIZED`, `INVALID_ARGUMENT`: the library or the event set is gone, as after a driver
//! reload) ends the thread with that error, which stops the daemon (a supervised thread, see
//! `src/daemon/supervise.rs`); other wait errors are logged once per kind and retried.
//!
//! An XID that the driver attributes to a MIG instance (the event's `gpuInstanceId`, and
//! `computeInstanceId` where it names one, read through `ffi::wait_event`: nvml-wrapper's wait
//! drops them) is sent with that [`Instance`] and the UUIDs of the MIG devices it names, read
//! from NVML at once, so the monitor taints that instance rather than the whole GPU.

use nvml_wrapper::Nvml;
use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;
use std::sync::Arc;

use super::ffi;
use crate::inventory::events::{Event, EventKind, EventSink, EventThread, Instance};
use crate::inventory::{GpuUuid, MigUuid};

/// How long one wait blocks; also how soon the thread notices that nobody listens any more.
const WAIT_MS: u32 = 500;
/// The event types watched, where a GPU supports them.
const WATCHED: EventTypes = EventTypes::CRITICAL_XID_ERROR.union(EventTypes::DOUBLE_BIT_ECC_ERROR);
/// NVML's XID for "an XID it could not read".
const UNKNOWN_XID: u64 = 999;
/// An event's `gpuInstanceId` or `computeInstanceId` when it names no instance
/// (`NVML_GPU_INSTANCE_ID_ANY`, `NVML_COMPUTE_INSTANCE_ID_ANY`).
const NO_INSTANCE: u32 = u32::MAX;

/// Starts the event thread.
pub(super) fn start(nvml: Arc<Nvml>, sink: Box<dyn EventSink>) -> std::io::Result<EventThread> {
    std::thread::Builder::new()
        .name("nvml-events".into())
        .spawn(move || run(&nvml, sink.as_ref()))
}

/// Whether NVML still finds `gpu`: its handle by UUID, and its UUID read back.
pub(super) fn probe(nvml: &Nvml, gpu: &GpuUuid) -> Result<(), NvmlError> {
    let d = nvml.device_by_uuid(gpu.as_str())?;
    d.uuid().map(|_| ())
}

/// Watches until nobody listens (`Ok`, also when there is nothing to watch), or until NVML
/// refuses the wait for good (`Err` naming the error).
fn run(nvml: &Nvml, sink: &dyn EventSink) -> Result<(), String> {
    let gpus = gpus(nvml);
    let set = match nvml.create_event_set() {
        Ok(set) => set,
        // A driver without events is a driver without health checks, not a broken node:
        // tainting every GPU for it would make the node unschedulable for a missing feature.
        Err(
            e @ (NvmlError::FailedToLoadSymbol(_)
            | NvmlError::FunctionNotFound
            | NvmlError::NotSupported),
        ) => {
            tracing::warn!(error = %e, "this driver reports no GPU health events; GPU health is not monitored");
            return Ok(());
        }
        Err(e) => {
            let reason = format!("nvmlEventSetCreate failed: {e}");
            tracing::warn!(%reason, "GPU health events cannot be watched");
            for g in gpus {
                if !sink.send(Event::gpu(g, EventKind::Unmonitored(reason.clone()))) {
                    return Ok(());
                }
            }
            return Ok(());
        }
    };
    let mut watched = Vec::new();
    for uuid in gpus {
        match register(nvml, &uuid, &set) {
            Ok(Some(types)) => {
                tracing::debug!(gpu.uuid = %uuid, events = ?types, "watching GPU health events");
                watched.push(uuid);
            }
            Ok(None) => tracing::info!(
                gpu.uuid = %uuid,
                "the GPU reports no critical XID or ECC events (too old for health checks); not monitored"
            ),
            Err(e) => {
                let kind = match e {
                    NvmlError::GpuLost => EventKind::GpuLost,
                    e => EventKind::Unmonitored(format!("nvmlDeviceRegisterEvents failed: {e}")),
                };
                if !sink.send(Event::gpu(uuid, kind)) {
                    return Ok(());
                }
            }
        }
    }
    let mut last_error: Option<String> = None;
    while !sink.is_closed() {
        let events = match ffi::wait_event(nvml, &set, WAIT_MS) {
            Ok((data, gi, ci)) => {
                let Ok(uuid) = data.device.uuid() else {
                    tracing::warn!(
                        "a GPU health event names a GPU whose UUID NVML cannot read; skipped"
                    );
                    continue;
                };
                let gpu = GpuUuid(uuid);
                let mut out = Vec::new();
                if data.event_type.contains(EventTypes::CRITICAL_XID_ERROR) {
                    let xid = match data.event_data {
                        Some(XidError::Value(x)) => x,
                        Some(XidError::Unknown) | None => UNKNOWN_XID,
                    };
                    out.push(Event {
                        gpu: gpu.clone(),
                        kind: EventKind::Xid(xid),
                        instance: instance(nvml, &data.device, gi, ci),
                    });
                }
                if data.event_type.contains(EventTypes::DOUBLE_BIT_ECC_ERROR) {
                    // NVML attributes only XIDs to an instance; an ECC error is the GPU's.
                    out.push(Event::gpu(gpu, EventKind::DoubleBitEcc));
                }
                out
            }
            Err(NvmlError::Timeout) => continue,
            Err(NvmlError::GpuLost) => watched
                .iter()
                .filter(|g| {
                    matches!(
                        probe(nvml, g),
                        Err(NvmlError::GpuLost | NvmlError::NotFound)
                    )
                })
                .map(|g| Event::gpu(g.clone(), EventKind::GpuLost))
                .collect(),
            Err(e @ (NvmlError::Uninitialized | NvmlError::InvalidArg)) => {
                return Err(format!(
                    "NVML refuses to wait for GPU health events ({e}): the event set or the \
                     library is gone, and a restart opens NVML again"
                ));
            }
            Err(e) => {
                let text = e.to_string();
                if last_error.as_deref() != Some(text.as_str()) {
                    tracing::warn!(error = %text, "waiting for GPU health events failed; retrying");
                    last_error = Some(text);
                }
                // Do not spin on an error that answers at once.
                std::thread::sleep(std::time::Duration::from_millis(u64::from(WAIT_MS)));
                continue;
            }
        };
        for ev in events {
            if !sink.send(ev) {
                return Ok(());
            }
        }
    }
    tracing::debug!("GPU health-event thread stopped");
    Ok(())
}

/// The UUIDs of the GPUs NVML lists (a GPU whose UUID cannot be read is left out, as the
/// inventory leaves it out).
fn gpus(nvml: &Nvml) -> Vec<GpuUuid> {
    let count = nvml.device_count().unwrap_or_default();
    (0..count)
        .filter_map(|i| nvml.device_by_index(i).ok()?.uuid().ok())
        .map(GpuUuid)
        .collect()
}

/// Registers the watched events `gpu` supports; `None` when it supports none.
fn register(
    nvml: &Nvml,
    gpu: &GpuUuid,
    set: &nvml_wrapper::EventSet<'_>,
) -> Result<Option<EventTypes>, NvmlError> {
    let d = nvml.device_by_uuid(gpu.as_str())?;
    let types = match d.supported_event_types() {
        Ok(t) => t & WATCHED,
        Err(NvmlError::NotSupported) => return Ok(None),
        Err(e) => return Err(e),
    };
    if types.is_empty() {
        return Ok(None);
    }
    match ffi::register_events(nvml, &d, types.bits(), set) {
        Ok(()) => Ok(Some(types)),
        Err(NvmlError::NotSupported) => Ok(None),
        Err(e) => Err(e),
    }
}

/// The MIG instance an event of `parent` names (`gi`, `ci` as NVML gave them), with the MIG
/// devices that instance has now; `None` for a GPU-wide event. Read at once, while the
/// instance the driver meant still exists: its ids may name another one after it is destroyed.
fn instance(nvml: &Nvml, parent: &nvml_wrapper::Device<'_>, gi: u32, ci: u32) -> Option<Instance> {
    if gi == NO_INSTANCE {
        return None;
    }
    let compute_instance = (ci != NO_INSTANCE).then_some(ci);
    let max = parent.mig_device_count().unwrap_or(0);
    let devices = (0..max)
        // Empty slots answer NotFound (or InvalidArg on some drivers).
        .filter_map(|slot| parent.mig_device_by_index(slot).ok())
        .filter(|m| ffi::gpu_instance_id(nvml, m).is_ok_and(|id| id == gi))
        .filter(|m| {
            compute_instance
                .is_none_or(|ci| ffi::compute_instance_id(nvml, m).is_ok_and(|id| id == ci))
        })
        .filter_map(|m| m.uuid().ok().map(MigUuid))
        .collect();
    Some(Instance {
        gpu_instance: gi,
        compute_instance,
        devices,
    })
}
