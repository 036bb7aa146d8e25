"""A dropout mask's cost on the host: numpy's generator (the numpy API's
masks before the hash kernel: rng.random, compare, scale) against the
host's array kernel (halstm.memory.Host.dropout_mask), interleaved, the
median of each.

    python bench/dropout_masks.py --shape 100x64x512 --rounds 15
"""
import argparse

import numpy as np

from halstm import memory
from halstm.benchmark import alternating


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="100x64x512")
    ap.add_argument("--p", type=float, default=0.3)
    ap.add_argument("--rounds", type=int, default=15)
    a = ap.parse_args()
    shape = tuple(int(n) for n in a.shape.split("x"))
    rng, host = np.random.default_rng(0), memory.Host()

    def numpy_mask():
        keep = rng.random(shape, dtype=np.float32) >= a.p
        return keep.astype(np.float32) / np.float32(1 - a.p)

    def kernel_mask():
        return host.dropout_mask(shape, a.p, *(int(k) for k in rng.integers(0, 1 << 32, 2)))
    # (a first round left out: the kernels' library loads)
    med = {k: v * 1e3 for k, v in alternating({"numpy": numpy_mask, "kernel": kernel_mask},
                                               a.rounds + 1, 1, lambda: None).items()}
    print(f"{a.shape} p={a.p}: numpy {med['numpy']:.3f} ms, kernel {med['kernel']:.3f} ms "
          f"({med['kernel'] / med['numpy']:.3f}x)")


if __name__ == "__main__":
    main()
