"""Cost of the single device calls halstm.cuda makes (memset, device-to-
device copy, in their synchronous and Async forms on the legacy stream, and
an allocation from the pool) at three sizes: each timed from a synchronized
device to a synchronized device (median of 100, interleaved), and, in
brackets, the host time of 20 in a row without synchronizing.

    python bench/gpu_memops.py
"""
import time, statistics, ctypes
import numpy as np
from halstm import cuda
d = cuda.driver()
L = d.lib
U64, SZ = ctypes.c_uint64, ctypes.c_size_t
L.cuMemsetD32_v2.argtypes = [U64, ctypes.c_uint, SZ]
L.cuMemsetD32Async.argtypes = [U64, ctypes.c_uint, SZ, ctypes.c_void_p]
L.cuMemsetD8Async.argtypes = [U64, ctypes.c_ubyte, SZ, ctypes.c_void_p]
L.cuMemcpyDtoDAsync_v2.argtypes = [U64, U64, SZ, ctypes.c_void_p]
for n in (16 * 128, 64 * 1024, 1 << 22):
    a, b = cuda.empty(n), cuda.empty(n)
    ops = {
        "memsetD8": lambda: d.call("cuMemsetD8_v2", U64(a.ptr), 0, 4 * n),
        "memsetD32": lambda: d.call("cuMemsetD32_v2", U64(a.ptr), 0, n),
        "memsetD8Async(0)": lambda: d.call("cuMemsetD8Async", U64(a.ptr), 0, 4 * n, None),
        "memsetD32Async(0)": lambda: d.call("cuMemsetD32Async", U64(a.ptr), 0, n, None),
        "DtoD": lambda: d.call("cuMemcpyDtoD_v2", U64(a.ptr), U64(b.ptr), 4 * n),
        "DtoDAsync(0)": lambda: d.call("cuMemcpyDtoDAsync_v2", U64(a.ptr), U64(b.ptr), 4 * n, None),
        "empty": lambda: cuda.empty(n),
        "nothing": lambda: None,
    }
    t = {k: [] for k in ops}
    for r in range(100):
        for k, f in ops.items():
            cuda.synchronize(); s = time.perf_counter(); f(); cuda.synchronize(); t[k].append(time.perf_counter() - s)
    # and host-only time (no sync after) of 20 in a row
    h = {}
    for k, f in ops.items():
        cuda.synchronize(); s = time.perf_counter()
        for _ in range(20): f()
        h[k] = (time.perf_counter() - s) / 20; cuda.synchronize()
    print(f"{4*n} bytes: " + ", ".join(f"{k} {statistics.median(v[10:])*1e6:.1f} us (host {h[k]*1e6:.1f})" for k, v in t.items()))
