"""CPU: bench/torch_layers.py's variants at one shape, each timed over 4
forward+backward calls after 2 warm-up calls: ms a call, ms inside the
compiled kernels' calls (cProfile), minor page faults and system CPU
seconds a call (getrusage).

    python bench/torch_cpu_faults.py charrnn_512x2 "kernels,halstm.torch"
"""
import cProfile
import pstats
import resource
import sys
import time

import torch_layers
from halstm import benchmark


def main():
    variants, _ = torch_layers.variants(benchmark.shapes()[sys.argv[1]], "cpu")
    for name in sys.argv[2].split(","):
        f = variants[name]
        for _ in range(2):
            f()
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        prof = cProfile.Profile()
        prof.enable()
        t = time.perf_counter()
        for _ in range(4):
            f()
        dt = (time.perf_counter() - t) / 4
        prof.disable()
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        stats = pstats.Stats(prof).stats
        in_calls = sum(v[2] for k, v in stats.items() if k[2] == "_call") / 4
        print(f"{name:16s} {dt * 1e3:8.1f} ms/call; in kernel calls {in_calls * 1e3:8.1f} ms; "
              f"minor faults/call {(r1.ru_minflt - r0.ru_minflt) / 4:,.0f}; sys s/call "
              f"{(r1.ru_stime - r0.ru_stime) / 4:.3f}", flush=True)


if __name__ == "__main__":
    main()
