"""Host overhead of a halstm module's calls on the GPU. A forward's host
work before its first kernel leaves the GPU idle.

1. A no_grad forward of the whole module against its library's forward
   alone (the driver call with the states it allocates), and the single
   device calls a forward makes (two zeroed (1, B, H) arrays; an allocation
   and a row copy); then the Python functions the module's forward spends
   its time in (cProfile, tottime).
2. The single device calls halstm.cuda makes (memset, device-to-device
   copy, in their synchronous and Async forms on the legacy stream, and an
   allocation from the pool) at three sizes, and in brackets the host time
   of 20 in a row without synchronizing.

Each call is timed from a synchronized device to a synchronized device, in
interleaved rounds (medians; --rounds for part 1, 100 for part 2).

    python bench/gpu_host.py [--rounds 60]
"""
import argparse
import cProfile
import ctypes
import io
import pstats
import time

import numpy as np

import halstm
from halstm import cuda
from halstm.benchmark import alternating


def module_calls(rounds: int) -> None:
    for I, H, B, T in ((128, 128, 16, 100), (1024, 1024, 64, 25)):
        m = halstm.LSTM(I, H, target="host-cuda", seed=0).compile(backward=False)
        rng = np.random.default_rng(0)
        x = cuda.DeviceArray.from_numpy(rng.standard_normal((T, B, I)).astype(np.float32))
        lib, w = m._lib(0, "fwd"), m._layer_weights(0)
        init = [cuda.zeros((B, H)), cuda.zeros((B, H))]

        def full():
            with halstm.no_grad():
                m(x)

        def empty_copy():
            a = cuda.empty((T + 1, B, H))
            a[0] = init[0]
        med = alternating({"module forward": full,
                           "library forward": lambda: lib.forward(x, *w, init, save=False),
                           "2 zeros": lambda: (cuda.zeros((1, B, H)), cuda.zeros((1, B, H))),
                           "empty + row copy": empty_copy,
                           "nothing": lambda: None}, rounds, 5, cuda.synchronize)
        print(f"I={I} H={H} B={B} T={T}: " +
              ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in med.items()))
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            full()
        cuda.synchronize()
        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(12)
        print(out.getvalue()[-3000:])


def device_calls(rounds: int) -> None:
    d = cuda.driver()
    U64, SZ = ctypes.c_uint64, ctypes.c_size_t
    d.lib.cuMemsetD32_v2.argtypes = [U64, ctypes.c_uint, SZ]
    d.lib.cuMemsetD32Async.argtypes = [U64, ctypes.c_uint, SZ, ctypes.c_void_p]
    d.lib.cuMemsetD8Async.argtypes = [U64, ctypes.c_ubyte, SZ, ctypes.c_void_p]
    d.lib.cuMemcpyDtoDAsync_v2.argtypes = [U64, U64, SZ, ctypes.c_void_p]
    for n in (16 * 128, 64 * 1024, 1 << 22):          # floats
        a, b = cuda.empty(n), cuda.empty(n)
        calls = {
            "memsetD8": lambda: d.call("cuMemsetD8_v2", U64(a.ptr), 0, 4 * n),
            "memsetD32": lambda: d.call("cuMemsetD32_v2", U64(a.ptr), 0, n),
            "memsetD8Async(0)": lambda: d.call("cuMemsetD8Async", U64(a.ptr), 0, 4 * n, None),
            "memsetD32Async(0)": lambda: d.call("cuMemsetD32Async", U64(a.ptr), 0, n, None),
            "DtoD": lambda: d.call("cuMemcpyDtoD_v2", U64(a.ptr), U64(b.ptr), 4 * n),
            "DtoDAsync(0)": lambda: d.call("cuMemcpyDtoDAsync_v2", U64(a.ptr), U64(b.ptr),
                                           4 * n, None),
            "empty": lambda: cuda.empty(n),
            "nothing": lambda: None,
        }
        med = alternating(calls, rounds, 10, cuda.synchronize)
        host = {}
        for k, f in calls.items():       # host time only: 20 in a row, no synchronizing
            cuda.synchronize()
            t = time.perf_counter()
            for _ in range(20):
                f()
            host[k] = (time.perf_counter() - t) / 20
            cuda.synchronize()
        print(f"{4 * n} bytes: " + ", ".join(
            f"{k} {med[k] * 1e6:.1f} us (host {host[k] * 1e6:.1f})" for k in calls))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=60, help="rounds of part 1")
    a = ap.parse_args()
    module_calls(a.rounds)
    device_calls(100)


if __name__ == "__main__":
    main()
