"""Host overhead of a halstm module's forward on the GPU: a no_grad forward
of the whole module against its library's forward alone (the driver call
with the states it allocates), and the single device calls a forward makes
(two zeroed (1, B, H) arrays; an allocation and a row copy), each timed
from a synchronized device to a synchronized device, in interleaved rounds;
then the Python functions the module's forward spends its time in
(cProfile, tottime). A forward's host work before its first kernel leaves
the GPU idle.

    python bench/gpu_host.py [--rounds 60]
"""
import argparse
import cProfile
import io
import pstats
import statistics
import time

import numpy as np

import halstm
from halstm import cuda


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=60)
    a = ap.parse_args()
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
        calls = {"module forward": full,
                 "library forward": lambda: lib.forward(x, *w, init, save=False),
                 "2 zeros": lambda: (cuda.zeros((1, B, H)), cuda.zeros((1, B, H))),
                 "empty + row copy": empty_copy,
                 "nothing": lambda: None}
        times = {k: [] for k in calls}
        for _ in range(a.rounds):
            for k, f in calls.items():
                cuda.synchronize()
                t = time.perf_counter()
                f()
                cuda.synchronize()
                times[k].append(time.perf_counter() - t)
        print(f"I={I} H={H} B={B} T={T}: " + ", ".join(
            f"{k} {statistics.median(v[5:]) * 1e6:.1f} us" for k, v in times.items()))
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            full()
        cuda.synchronize()
        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(12)
        print(out.getvalue()[-3000:])


if __name__ == "__main__":
    main()
