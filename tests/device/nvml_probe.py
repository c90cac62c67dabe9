#!/usr/bin/env python3
"""NVML read through ctypes, for tests/device/mig-readonly.sh: an independent peer of nvdra's
NVML backend (nvml-wrapper), calling libnvidia-ml.so.1 directly.

    python3 nvml_probe.py LIBRARY REPEAT WAIT_MS [INDEX,...]

(the GPUs by NVML index; all of them by default). It only reads: init, handles, UUIDs, minor
numbers, MIG and virtualization modes, the compute processes, the GPU-instance profiles and
their possible placements (NVML's documentation: these are returned "regardless of whether MIG
is enabled or not"), and an event set of its own (created, registered for critical XIDs, waited
on for WAIT_MS, freed). It never calls a setter, never creates or destroys an instance, never
resets. Each read is timed; those worth a figure are repeated REPEAT times.

It prints one tab-separated record per line (the shell script parses them):
    gpu      INDEX UUID MINOR
    virt     UUID RC MODE                       (nvmlGpuVirtualizationMode_t)
    mig      UUID RC CURRENT PENDING
    procs    UUID RC COUNT
    proc     UUID PID USED_BYTES GI CI
    profile  UUID INDEX ID SLICES INSTANCES SMS MIB NAME   (NAME "-" without the V call)
    place    UUID ID START SIZE
    placerc  UUID ID RC                         (a profile whose placements NVML refused)
    event    UUID SUPPORTED_RC MASK REGISTER_RC WAIT_RC WAIT_MS FREE_RC DETAIL
    time     CALL FIRST_MS MEDIAN_MS MAX_MS N
    error    TEXT
RC is NVML's return code as a name (SUCCESS, NOT_SUPPORTED, TIMEOUT, ..., or missing when the
library lacks the symbol).
"""

import ctypes
import sys
import time

RC_NAMES = {
    0: "SUCCESS",
    1: "UNINITIALIZED",
    2: "INVALID_ARGUMENT",
    3: "NOT_SUPPORTED",
    4: "NO_PERMISSION",
    5: "ALREADY_INITIALIZED",
    6: "NOT_FOUND",
    7: "INSUFFICIENT_SIZE",
    8: "INSUFFICIENT_POWER",
    9: "DRIVER_NOT_LOADED",
    10: "TIMEOUT",
    11: "IRQ_ISSUE",
    12: "LIBRARY_NOT_FOUND",
    13: "FUNCTION_NOT_FOUND",
    14: "CORRUPTED_INFOROM",
    15: "GPU_IS_LOST",
    16: "RESET_REQUIRED",
    17: "OPERATING_SYSTEM",
    18: "LIB_RM_VERSION_MISMATCH",
    19: "IN_USE",
    20: "MEMORY",
    21: "NO_DATA",
    22: "VGPU_ECC_NOT_SUPPORTED",
    23: "INSUFFICIENT_RESOURCES",
    24: "FREQ_NOT_SUPPORTED",
    25: "ARGUMENT_VERSION_MISMATCH",
    26: "DEPRECATED",
    27: "NOT_READY",
    999: "UNKNOWN",
}
SUCCESS = 0
INSUFFICIENT_SIZE = 7
# nvmlEventTypeXidCriticalError and nvmlEventTypeDoubleBitEccError (nvml.h): what nvdra watches.
XID_CRITICAL = 0x8
DOUBLE_BIT_ECC = 0x2
# Profile indexes tried: NVML_GPU_INSTANCE_PROFILE_COUNT grows with the driver (17 in R570);
# indexes past it answer INVALID_ARGUMENT.
PROFILE_INDEXES = 32


def rc_name(rc):
    return RC_NAMES.get(rc, str(rc))


class ProfileInfo(ctypes.Structure):
    """nvmlGpuInstanceProfileInfo_t."""

    _fields_ = [
        ("id", ctypes.c_uint),
        ("isP2pSupported", ctypes.c_uint),
        ("sliceCount", ctypes.c_uint),
        ("instanceCount", ctypes.c_uint),
        ("multiprocessorCount", ctypes.c_uint),
        ("copyEngineCount", ctypes.c_uint),
        ("decoderCount", ctypes.c_uint),
        ("encoderCount", ctypes.c_uint),
        ("jpegCount", ctypes.c_uint),
        ("ofaCount", ctypes.c_uint),
        ("memorySizeMB", ctypes.c_ulonglong),
    ]


class ProfileInfoV2(ctypes.Structure):
    """nvmlGpuInstanceProfileInfo_v2_t: the same, with the profile's name."""

    _fields_ = [("version", ctypes.c_uint)] + ProfileInfo._fields_ + [
        ("name", ctypes.c_char * 96)
    ]


class Placement(ctypes.Structure):
    """nvmlGpuInstancePlacement_t."""

    _fields_ = [("start", ctypes.c_uint), ("size", ctypes.c_uint)]


class ProcessInfo(ctypes.Structure):
    """nvmlProcessInfo_t (the _v3 call's)."""

    _fields_ = [
        ("pid", ctypes.c_uint),
        ("usedGpuMemory", ctypes.c_ulonglong),
        ("gpuInstanceId", ctypes.c_uint),
        ("computeInstanceId", ctypes.c_uint),
    ]


class EventData(ctypes.Structure):
    """nvmlEventData_t."""

    _fields_ = [
        ("device", ctypes.c_void_p),
        ("eventType", ctypes.c_ulonglong),
        ("eventData", ctypes.c_ulonglong),
        ("gpuInstanceId", ctypes.c_uint),
        ("computeInstanceId", ctypes.c_uint),
    ]


def out(*fields):
    print("\t".join(str(f) for f in fields), flush=True)


class Probe:
    def __init__(self, lib, repeat):
        self.lib = lib
        self.repeat = max(1, repeat)
        self.times = {}  # call -> [ms, ...], the first call first

    def call(self, name, *args):
        """NVML's NAME(*ARGS), timed; None when the library lacks it."""
        fn = getattr(self.lib, name, None)
        if fn is None:
            return None
        t0 = time.perf_counter()
        rc = fn(*args)
        self.times.setdefault(name, []).append((time.perf_counter() - t0) * 1000.0)
        return rc

    def repeated(self, name, *args):
        """The same call REPEAT times (for its timing); the first answer."""
        rc = self.call(name, *args)
        for _ in range(self.repeat - 1):
            self.call(name, *args)
        return rc

    def report_times(self):
        for name, ms in self.times.items():
            rest = sorted(ms)
            median = rest[len(rest) // 2]
            out("time", name, "%.3f" % ms[0], "%.3f" % median, "%.3f" % max(ms), len(ms))


def rc_or_missing(rc):
    return "missing" if rc is None else rc_name(rc)


def probe_gpu(p, index, wait_ms):
    handle = ctypes.c_void_p()
    rc = p.repeated("nvmlDeviceGetHandleByIndex_v2", index, ctypes.byref(handle))
    if rc != SUCCESS:
        out("error", "nvmlDeviceGetHandleByIndex_v2(%d): %s" % (index, rc_or_missing(rc)))
        return
    buf = ctypes.create_string_buffer(96)
    rc = p.repeated("nvmlDeviceGetUUID", handle, buf, 96)
    if rc != SUCCESS:
        out("error", "nvmlDeviceGetUUID(%d): %s" % (index, rc_or_missing(rc)))
        return
    uuid = buf.value.decode()
    minor = ctypes.c_uint()
    rc = p.call("nvmlDeviceGetMinorNumber", handle, ctypes.byref(minor))
    out("gpu", index, uuid, minor.value if rc == SUCCESS else "-")

    mode = ctypes.c_uint()
    rc = p.repeated("nvmlDeviceGetVirtualizationMode", handle, ctypes.byref(mode))
    out("virt", uuid, rc_or_missing(rc), mode.value if rc == SUCCESS else "-")

    current, pending = ctypes.c_uint(), ctypes.c_uint()
    rc = p.repeated("nvmlDeviceGetMigMode", handle, ctypes.byref(current), ctypes.byref(pending))
    if rc == SUCCESS:
        out("mig", uuid, "SUCCESS", current.value, pending.value)
    else:
        out("mig", uuid, rc_or_missing(rc), "-", "-")

    # The compute processes: ask the count, then the list (it may grow in between).
    count = ctypes.c_uint(0)
    rc = p.repeated("nvmlDeviceGetComputeRunningProcesses_v3", handle, ctypes.byref(count), None)
    procs = []
    if rc == INSUFFICIENT_SIZE:
        room = count.value + 8
        infos = (ProcessInfo * room)()
        count = ctypes.c_uint(room)
        rc = p.call("nvmlDeviceGetComputeRunningProcesses_v3", handle, ctypes.byref(count), infos)
        if rc == SUCCESS:
            procs = infos[: count.value]
    out("procs", uuid, rc_or_missing(rc), count.value if rc == SUCCESS else "-")
    for info in procs:
        out("proc", uuid, info.pid, info.usedGpuMemory, info.gpuInstanceId, info.computeInstanceId)

    probe_profiles(p, handle, uuid)
    probe_events(p, handle, uuid, wait_ms)


def probe_profiles(p, handle, uuid):
    timed_once = False
    has_v = getattr(p.lib, "nvmlDeviceGetGpuInstanceProfileInfoV", None) is not None
    for index in range(PROFILE_INDEXES):
        info = ProfileInfo()
        call = p.repeated if not timed_once else p.call
        rc = call("nvmlDeviceGetGpuInstanceProfileInfo", handle, index, ctypes.byref(info))
        if rc is None:
            out("error", "nvmlDeviceGetGpuInstanceProfileInfo is missing from the library")
            return
        if rc != SUCCESS:
            # Profiles this GPU lacks answer NOT_SUPPORTED; indexes past the driver's count,
            # INVALID_ARGUMENT. Anything else is worth a line.
            if rc not in (2, 3):
                out("error", "nvmlDeviceGetGpuInstanceProfileInfo(%s, %d): %s"
                    % (uuid, index, rc_name(rc)))
            continue
        name = "-"
        if has_v:
            v2 = ProfileInfoV2()
            v2.version = ctypes.sizeof(ProfileInfoV2) | (2 << 24)
            if p.call("nvmlDeviceGetGpuInstanceProfileInfoV", handle, index,
                      ctypes.byref(v2)) == SUCCESS:
                name = v2.name.decode(errors="replace").strip() or "-"
        out("profile", uuid, index, info.id, info.sliceCount, info.instanceCount,
            info.multiprocessorCount, info.memorySizeMB, name.replace(" ", "_"))
        count = ctypes.c_uint(0)
        call = p.repeated if not timed_once else p.call
        rc = call("nvmlDeviceGetGpuInstancePossiblePlacements_v2", handle, info.id, None,
                  ctypes.byref(count))
        timed_once = True
        if rc == SUCCESS and count.value > 0:
            room = count.value
            places = (Placement * room)()
            rc = p.call("nvmlDeviceGetGpuInstancePossiblePlacements_v2", handle, info.id,
                        places, ctypes.byref(count))
            if rc == SUCCESS:
                for pl in places[: count.value]:
                    out("place", uuid, info.id, pl.start, pl.size)
        if rc != SUCCESS:
            out("placerc", uuid, info.id, rc_or_missing(rc))


def probe_events(p, handle, uuid, wait_ms):
    mask = ctypes.c_ulonglong(0)
    supported_rc = p.call("nvmlDeviceGetSupportedEventTypes", handle, ctypes.byref(mask))
    event_set = ctypes.c_void_p()
    create_rc = p.call("nvmlEventSetCreate", ctypes.byref(event_set))
    if create_rc != SUCCESS:
        out("event", uuid, rc_or_missing(supported_rc), "0x%x" % mask.value,
            "create:" + rc_or_missing(create_rc), "-", "-", "-", "-")
        return
    register_rc = p.call("nvmlDeviceRegisterEvents", handle, ctypes.c_ulonglong(XID_CRITICAL),
                         event_set)
    wait_rc, waited, detail = None, 0.0, "-"
    if register_rc == SUCCESS:
        # nvdra's own mask as well (XID and double-bit ECC, where supported), on the same set.
        watched = mask.value & (XID_CRITICAL | DOUBLE_BIT_ECC) if supported_rc == SUCCESS else 0
        if watched & ~XID_CRITICAL:
            both = p.call("nvmlDeviceRegisterEvents", handle, ctypes.c_ulonglong(watched),
                          event_set)
            detail = "nvdra-mask=0x%x:%s" % (watched, rc_or_missing(both))
        data = EventData()
        t0 = time.perf_counter()
        wait_rc = p.call("nvmlEventSetWait_v2", event_set, ctypes.byref(data), wait_ms)
        waited = (time.perf_counter() - t0) * 1000.0
        if wait_rc == SUCCESS:
            detail += ",event type=0x%x data=%d gi=%d ci=%d" % (
                data.eventType, data.eventData, data.gpuInstanceId, data.computeInstanceId)
    free_rc = p.call("nvmlEventSetFree", event_set)
    out("event", uuid, rc_or_missing(supported_rc), "0x%x" % mask.value,
        rc_or_missing(register_rc), rc_or_missing(wait_rc) if wait_rc is not None else "-",
        "%.1f" % waited, rc_or_missing(free_rc), detail)


def main():
    if len(sys.argv) not in (4, 5):
        sys.stderr.write("usage: nvml_probe.py LIBRARY REPEAT WAIT_MS [INDEX,...]\n")
        return 2
    library, repeat, wait_ms = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    only = None
    if len(sys.argv) == 5 and sys.argv[4]:
        only = {int(i) for i in sys.argv[4].split(",")}
    try:
        lib = ctypes.CDLL(library)
    except OSError as e:
        out("error", "cannot load %s: %s" % (library, e))
        return 3
    p = Probe(lib, repeat)
    rc = p.call("nvmlInit_v2")
    if rc != SUCCESS:
        out("error", "nvmlInit_v2: %s" % rc_or_missing(rc))
        return 3
    count = ctypes.c_uint()
    rc = p.call("nvmlDeviceGetCount_v2", ctypes.byref(count))
    if rc != SUCCESS:
        out("error", "nvmlDeviceGetCount_v2: %s" % rc_or_missing(rc))
        count.value = 0
    for index in range(count.value):
        if only is None or index in only:
            probe_gpu(p, index, wait_ms)
    p.call("nvmlShutdown")
    p.report_times()
    return 0


if __name__ == "__main__":
    sys.exit(main())
