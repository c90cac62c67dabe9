"""A CUDA client for tests/device/mps-limits.sh: allocates device memory in chunks until CUDA
refuses or a cap is reached, and prints one JSON line with what it got. With HOLD_SECONDS set it
first prints the same line with "holding": true and keeps its memory that long, so that the check
can look at the GPU and the MPS daemon meanwhile. Its pid and uid are in the line, to be found in
the daemon's logs.

It uses the CUDA runtime from NVIDIA's PyPI wheel (`nvidia-cuda-runtime`, as PyTorch and CuPy
install it) through ctypes, so it needs no compiler and no framework; where that wheel is missing
it falls back to the driver API in libcuda.so.1. Either way the limits under test are applied by
the driver and the MPS server, not by this program.
"""

import ctypes
import glob
import json
import os
import sys
import time

MIB = 1 << 20


def load_cudart():
    roots = []
    for p in sys.path:
        roots += glob.glob(os.path.join(p, "nvidia", "cuda_runtime", "lib", "libcudart.so*"))
        roots += glob.glob(os.path.join(p, "nvidia", "cu*", "lib", "libcudart.so*"))
    for path in sorted(roots, reverse=True):
        try:
            return ctypes.CDLL(path), path
        except OSError:
            continue
    return None, None


def run_runtime(lib, cap_mib, chunk_mib):
    count = ctypes.c_int()
    err = lib.cudaGetDeviceCount(ctypes.byref(count))
    if err != 0:
        return {"error": f"cudaGetDeviceCount returned {err}"}
    sms = ctypes.c_int()
    # cudaDevAttrMultiProcessorCount = 16
    lib.cudaDeviceGetAttribute(ctypes.byref(sms), 16, 0)
    got, ptrs, last = 0, [], 0
    while got + chunk_mib <= cap_mib:
        p = ctypes.c_void_p()
        last = lib.cudaMalloc(ctypes.byref(p), ctypes.c_size_t(chunk_mib * MIB))
        if last != 0:
            break
        ptrs.append(p)
        got += chunk_mib
    out = {"api": "runtime", "devices": count.value, "multiprocessors": sms.value,
           "allocated_mib": got, "stopped_by": "cap" if last == 0 else f"cudaMalloc error {last}"}
    hold(out)
    for p in ptrs:
        lib.cudaFree(p)
    return out


def run_driver(cap_mib, chunk_mib):
    lib = ctypes.CDLL("libcuda.so.1")
    if lib.cuInit(0) != 0:
        return {"error": "cuInit failed"}
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    lib.cuDeviceGet(ctypes.byref(dev), 0)
    err = lib.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev)
    if err != 0:
        return {"error": f"cuCtxCreate returned {err}"}
    sms = ctypes.c_int()
    # CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16
    lib.cuDeviceGetAttribute(ctypes.byref(sms), 16, dev)
    got, last = 0, 0
    while got + chunk_mib <= cap_mib:
        p = ctypes.c_uint64()
        last = lib.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(chunk_mib * MIB))
        if last != 0:
            break
        got += chunk_mib
    out = {"api": "driver", "multiprocessors": sms.value, "allocated_mib": got,
           "stopped_by": "cap" if last == 0 else f"cuMemAlloc error {last}"}
    # The context and its memory go with the process.
    hold(out)
    return out


def hold(out):
    """Keeps what was allocated for HOLD_SECONDS, once said so on a line of its own."""
    seconds = float(os.environ.get("HOLD_SECONDS", "0"))
    if seconds:
        print(json.dumps(dict(out, holding=True, **ids())), flush=True)
        time.sleep(seconds)


def ids():
    return {"pid": os.getpid(), "uid": os.getuid()}


def main():
    cap_mib = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
    chunk_mib = int(sys.argv[2]) if len(sys.argv) > 2 else 128
    lib, path = load_cudart()
    try:
        out = run_runtime(lib, cap_mib, chunk_mib) if lib else run_driver(cap_mib, chunk_mib)
    except OSError as e:
        # No CUDA library at all: still one JSON line, so the check's report stays readable.
        out = {"error": f"cannot load CUDA: {e}"}
    out.update(ids())
    out["library"] = path or "libcuda.so.1"
    out["limit_env"] = os.environ.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "")
    out["thread_env"] = os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "")
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
