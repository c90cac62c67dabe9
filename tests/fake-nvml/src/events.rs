//! Health events of the fake library, and the hooks a test drives them with.
//!
//! NVML side: `nvmlEventSetCreate`, `nvmlDeviceGetSupportedEventTypes` (critical XID, single-
//! and double-bit ECC on every GPU), `nvmlDeviceRegisterEvents`, `nvmlEventSetWait_v2` (blocks
//! up to its timeout on a condition variable, then answers `NVML_ERROR_TIMEOUT`),
//! `nvmlEventSetFree`, and `nvmlDeviceGetHandleByUUID` (the recovery probe's call: a lost GPU
//! answers `NVML_ERROR_GPU_IS_LOST`).
//!
//! Test side, C symbols a test resolves from the loaded library (the library's state is shared
//! only through the very copy NVML loaded, not through the rlib):
//! - `fake_nvml_inject_event(gpu_index, event_type, event_data)`: every event set that
//!   registered that GPU for that type gets the event, GPU-wide (`gpuInstanceId` and
//!   `computeInstanceId` `0xFFFFFFFF`);
//! - `fake_nvml_inject_instance_event(gpu_index, event_type, event_data, gpu_instance_id,
//!   compute_instance_id)`: the same, attributed to a MIG instance as the driver attributes an
//!   XID (`compute_instance_id` `0xFFFFFFFF` for the GPU instance alone). As NVML documents, only
//!   a critical XID of a GPU in MIG mode is attributed, to an instance that exists: anything else
//!   answers `NVML_ERROR_INVALID_ARGUMENT`, so a test cannot make the fake say what the driver
//!   would not;
//! - `fake_nvml_set_lost(gpu_index, lost)`: the GPU's handle lookup by UUID fails (or not);
//! - `fake_nvml_fail_registration(gpu_index, code)`: `nvmlDeviceRegisterEvents` answers `code`
//!   for that GPU (`NVML_SUCCESS` to undo);
//! - `fake_nvml_registrations(gpu_index)`: how many live event sets registered the GPU (a test
//!   waits for its monitor's registration before injecting).
//!
//! Across processes: `FAKE_NVML_EVENT_WAIT_ERROR=<file>` makes every `nvmlEventSetWait_v2` answer
//! at once the NVML return code the file holds, while it exists (as a driver that lost its event
//! sets answers `NVML_ERROR_INVALID_ARGUMENT`): a test of a running daemon writes it.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::os::raw::{c_int, c_uint, c_ulonglong};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use nvml_wrapper_sys::bindings::*;

use super::{INVALID, SUCCESS, gpu_count, gpu_handle, gpu_index_of, handle, has_instance};

const TIMEOUT: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_TIMEOUT;
pub(crate) const GPU_IS_LOST: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_GPU_IS_LOST;
const SET_BASE: usize = 0x5000;
const SUPPORTED: c_ulonglong = (nvmlEventTypeXidCriticalError
    | nvmlEventTypeDoubleBitEccError
    | nvmlEventTypeSingleBitEccError) as c_ulonglong;

/// An event waiting in a set: GPU index, type, data, GPU instance id, compute instance id.
type Queued = (usize, c_ulonglong, c_ulonglong, c_uint, c_uint);

#[derive(Default)]
struct Set {
    /// GPU index → registered event types.
    registered: BTreeMap<usize, c_ulonglong>,
    queue: VecDeque<Queued>,
}

#[derive(Default)]
struct State {
    next: usize,
    sets: BTreeMap<usize, Set>,
    lost: BTreeSet<usize>,
    refuse: BTreeMap<usize, nvmlReturn_t>,
}

static STATE: Mutex<State> = Mutex::new(State {
    next: 0,
    sets: BTreeMap::new(),
    lost: BTreeSet::new(),
    refuse: BTreeMap::new(),
});
static ARRIVED: Condvar = Condvar::new();

fn state() -> MutexGuard<'static, State> {
    STATE.lock().unwrap_or_else(|p| p.into_inner())
}

fn set_id(set: nvmlEventSet_t) -> Option<usize> {
    set.addr().checked_sub(SET_BASE)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetCreate(out: *mut nvmlEventSet_t) -> nvmlReturn_t {
    let id = {
        let mut st = state();
        let id = st.next;
        st.next += 1;
        st.sets.insert(id, Set::default());
        id
    };
    unsafe { super::put(out, handle(SET_BASE + id)) }
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlEventSetFree(set: nvmlEventSet_t) -> nvmlReturn_t {
    match set_id(set).and_then(|id| state().sets.remove(&id)) {
        Some(_) => SUCCESS,
        None => INVALID,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetSupportedEventTypes(
    d: nvmlDevice_t,
    out: *mut c_ulonglong,
) -> nvmlReturn_t {
    match gpu_index_of(d) {
        Some(_) => unsafe { super::put(out, SUPPORTED) },
        None => INVALID,
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceRegisterEvents(
    d: nvmlDevice_t,
    types: c_ulonglong,
    set: nvmlEventSet_t,
) -> nvmlReturn_t {
    let Some(gpu) = gpu_index_of(d) else {
        return INVALID;
    };
    let mut st = state();
    if let Some(code) = st.refuse.get(&gpu) {
        return *code;
    }
    if types & !SUPPORTED != 0 {
        return nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED;
    }
    match set_id(set).and_then(|id| st.sets.get_mut(&id)) {
        Some(s) => {
            *s.registered.entry(gpu).or_default() |= types;
            SUCCESS
        }
        None => INVALID,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetWait_v2(
    set: nvmlEventSet_t,
    data: *mut nvmlEventData_t,
    timeout_ms: c_uint,
) -> nvmlReturn_t {
    let Some(id) = set_id(set) else {
        return INVALID;
    };
    if let Some(code) = wait_error() {
        return code;
    }
    let deadline = Instant::now() + Duration::from_millis(u64::from(timeout_ms));
    let mut st = state();
    loop {
        let Some(s) = st.sets.get_mut(&id) else {
            return INVALID;
        };
        if let Some((gpu, kind, value, gi, ci)) = s.queue.pop_front() {
            drop(st);
            let ev = nvmlEventData_t {
                device: gpu_handle(gpu),
                eventType: kind,
                eventData: value,
                gpuInstanceId: gi,
                computeInstanceId: ci,
            };
            return unsafe { super::put(data, ev) };
        }
        let now = Instant::now();
        if now >= deadline {
            return TIMEOUT;
        }
        st = ARRIVED
            .wait_timeout(st, deadline - now)
            .unwrap_or_else(|p| p.into_inner())
            .0;
    }
}

/// The return code in the file `FAKE_NVML_EVENT_WAIT_ERROR` names, while it exists.
fn wait_error() -> Option<nvmlReturn_t> {
    let file = std::env::var_os("FAKE_NVML_EVENT_WAIT_ERROR")?;
    std::fs::read_to_string(file).ok()?.trim().parse().ok()
}

/// Whether a test marked GPU `index` lost (`nvmlDeviceGetHandleByUUID` then answers
/// `NVML_ERROR_GPU_IS_LOST`, as the driver does for a GPU that fell off the bus).
pub(crate) fn lost(index: usize) -> bool {
    state().lost.contains(&index)
}

/// Test hook: an event of `event_type` (an `nvmlEventType*` bit) with `event_data` (the XID)
/// on GPU `gpu_index`, delivered to every set that registered it for that type.
#[unsafe(no_mangle)]
pub extern "C" fn fake_nvml_inject_event(
    gpu_index: c_uint,
    event_type: c_ulonglong,
    event_data: c_ulonglong,
) -> nvmlReturn_t {
    inject(gpu_index, event_type, event_data, NO_INSTANCE, NO_INSTANCE)
}

/// `gpuInstanceId` and `computeInstanceId` of an event attributed to no instance.
const NO_INSTANCE: c_uint = c_uint::MAX;

/// Test hook: as [`fake_nvml_inject_event`], attributed to GPU instance `gpu_instance_id`
/// (and compute instance `compute_instance_id`, unless `0xFFFFFFFF`) of the GPU; see the
/// module doc for what is refused.
#[unsafe(no_mangle)]
pub extern "C" fn fake_nvml_inject_instance_event(
    gpu_index: c_uint,
    event_type: c_ulonglong,
    event_data: c_ulonglong,
    gpu_instance_id: c_uint,
    compute_instance_id: c_uint,
) -> nvmlReturn_t {
    let xid = event_type == nvmlEventTypeXidCriticalError as c_ulonglong;
    if !xid || !has_instance(gpu_index as usize, gpu_instance_id, compute_instance_id) {
        return INVALID;
    }
    inject(
        gpu_index,
        event_type,
        event_data,
        gpu_instance_id,
        compute_instance_id,
    )
}

fn inject(
    gpu: c_uint,
    kind: c_ulonglong,
    data: c_ulonglong,
    gi: c_uint,
    ci: c_uint,
) -> nvmlReturn_t {
    let gpu = gpu as usize;
    if gpu >= gpu_count() {
        return INVALID;
    }
    let mut st = state();
    for s in st.sets.values_mut() {
        if s.registered.get(&gpu).is_some_and(|t| t & kind != 0) {
            s.queue.push_back((gpu, kind, data, gi, ci));
        }
    }
    drop(st);
    ARRIVED.notify_all();
    SUCCESS
}

/// Test hook: GPU `gpu_index` is lost (its lookup by UUID fails) while `lost` is non-zero.
#[unsafe(no_mangle)]
pub extern "C" fn fake_nvml_set_lost(gpu_index: c_uint, lost: c_int) -> nvmlReturn_t {
    let mut st = state();
    if lost != 0 {
        st.lost.insert(gpu_index as usize);
    } else {
        st.lost.remove(&(gpu_index as usize));
    }
    SUCCESS
}

/// Test hook: `nvmlDeviceRegisterEvents` answers `code` for GPU `gpu_index` (success undoes it).
#[unsafe(no_mangle)]
pub extern "C" fn fake_nvml_fail_registration(
    gpu_index: c_uint,
    code: nvmlReturn_t,
) -> nvmlReturn_t {
    let mut st = state();
    if code == SUCCESS {
        st.refuse.remove(&(gpu_index as usize));
    } else {
        st.refuse.insert(gpu_index as usize, code);
    }
    SUCCESS
}

/// Test hook: the number of live event sets that registered GPU `gpu_index`.
#[unsafe(no_mangle)]
pub extern "C" fn fake_nvml_registrations(gpu_index: c_uint) -> c_uint {
    let n = state()
        .sets
        .values()
        .filter(|s| s.registered.contains_key(&(gpu_index as usize)))
        .count();
    c_uint::try_from(n).unwrap_or(c_uint::MAX)
}
