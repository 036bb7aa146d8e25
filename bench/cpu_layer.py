"""Time one layer's forward (saving for backward) and backward on the CPU
with numpy arrays, and count the page faults a call takes (the char LM's
LSTM layer by default):

    python bench/cpu_layer.py --input-size 84 --hidden-size 256 --batch 32 --steps 64
    python bench/cpu_layer.py --cell layernorm_lstm --input-size 128 --hidden-size 128 --batch 16 --steps 100

Prints median milliseconds of each direction and minor page faults per
forward+backward.
"""
import argparse
import resource
import statistics
import time

import numpy as np

import halstm


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cell", default="lstm")
    ap.add_argument("--input-size", type=int, default=84)
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    m = halstm.Recurrent(a.cell, a.input_size, a.hidden_size, seed=0)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((a.steps, a.batch, a.input_size)).astype(np.float32)
    dy = rng.standard_normal((a.steps, a.batch, a.hidden_size)).astype(np.float32)
    m(x)
    m.backward(dy)
    fwd, bwd = [], []
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(a.reps):
        t = time.perf_counter()
        m(x)
        fwd.append(time.perf_counter() - t)
        t = time.perf_counter()
        m.backward(dy)
        bwd.append(time.perf_counter() - t)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    print(f"{a.cell} K={a.input_size} H={a.hidden_size} B={a.batch} T={a.steps}: "
          f"forward {1e3 * statistics.median(fwd):.2f} ms, backward "
          f"{1e3 * statistics.median(bwd):.2f} ms, {faults / a.reps:.0f} page faults "
          f"a forward+backward")


if __name__ == "__main__":
    main()
