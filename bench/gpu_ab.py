"""Time schedule variants of one LSTM layer against each other on the GPU,
interleaved in one process, so that the machine's drift (10-15% between
processes on the shared H100s) falls on every variant alike.

Each variant is a cache folder holding a library compiled under that
variant's settings (bench/gpu_variants.sh with COMPILE_ONLY=1 makes them:
/tmp/halstm-variant-NAME). Every variant is checked against the numpy
reference (forward and gradients) before timing; then each repetition runs
every variant once, in turn, and the medians are printed with their ratio
to the first variant's:

    python bench/gpu_ab.py --hidden-size 128 --batch 16 --steps 100 base B C
"""
import argparse
import os

import numpy as np

import halstm
from halstm import cuda
from halstm.benchmark import alternating, reference_errors


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variants", nargs="+", help="names; the libraries come from "
                    "--cache-prefix + NAME")
    ap.add_argument("--cache-prefix", default="/tmp/halstm-variant-")
    ap.add_argument("--input-size", type=int, default=None, help="default: the hidden size")
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--cell", choices=["lstm", "gru"], default="lstm")
    ap.add_argument("--reps", type=int, default=30)
    a = ap.parse_args()
    I, H, B, T = a.input_size or a.hidden_size, a.hidden_size, a.batch, a.steps
    cls = halstm.LSTM if a.cell == "lstm" else halstm.GRU
    rng = np.random.default_rng(0)
    x = cuda.DeviceArray.from_numpy(rng.standard_normal((T, B, I)))
    dy = cuda.DeviceArray.from_numpy(rng.standard_normal((T, B, H)))
    mods = {}
    for name in a.variants:       # a variant that fails or differs is reported and left out
        os.environ["HALSTM_CACHE"] = a.cache_prefix + name
        try:
            m = cls(I, H, target="host-cuda", seed=0).compile()
            err = max(reference_errors(m, a.cell, x, m(x)[0], dy).values())
        except Exception as e:
            print(f"  {name}: failed: {e}")
            continue
        if not err < 1e-3:
            print(f"  {name}: differs from the reference by {err:.2e}")
            continue
        mods[name] = m
    if a.variants[0] not in mods:
        raise SystemExit(f"the first variant, {a.variants[0]}, is needed for the ratios")
    calls = {}
    for n, m in mods.items():             # (m=m: each call its own module)
        calls[n, "fwd"] = lambda m=m: m(x)
        calls[n, "bwd"] = lambda m=m: m.backward(dy)
    # the first round warms up
    med = {k: s * 1e3 for k, s in alternating(calls, a.reps + 1, 1, cuda.synchronize).items()}
    first = a.variants[0]
    print(f"{a.cell} I={I} H={H} B={B} T={T}, {a.reps} interleaved rounds, medians in ms "
          f"(ratio to {first})")
    for n, m in mods.items():
        captures = sum(lib.graph_stats()["captures"] for lib in m._libs.values())
        print(f"  {n:12s} fwd {med[n, 'fwd']:8.3f} ({med[n, 'fwd'] / med[first, 'fwd']:.3f})  "
              f"bwd {med[n, 'bwd']:8.3f} ({med[n, 'bwd'] / med[first, 'bwd']:.3f})  "
              f"graphs captured {captures}")


if __name__ == "__main__":
    main()
