"""Time variants of one layer of a cell against each other, interleaved
in one process, so that the machine's drift (10-15% between processes on
the shared H100s) falls on every variant alike.

A variant NAME is a cache folder holding a library compiled under that
variant's settings (bench/gpu_variants.sh with COMPILE_ONLY=1 makes them:
/tmp/halstm-variant-NAME); NAME=DIR is a folder written by `halstm compile`
(e.g. by a copy of the source with one change: bench/cell_ab.sh). The GPU
by default; --target host times the CPU. Every variant is checked against the numpy
reference (forward and gradients) before timing; then each repetition runs
every variant once, in turn, and the medians are printed with their ratio
to the first variant's:

    python bench/gpu_ab.py --hidden-size 128 --batch 16 --steps 100 base B C

--infer times a forward that no backward follows (under halstm.no_grad(),
as `halstm bench --fwd` does) in place of the training forward and the
backward, and checks that forward's output against the reference too
(it may run other kernels: pipeline.LOOP).
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
    ap.add_argument("--cell", default="lstm", help="any cell of halstm.cells")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--target", default="host-cuda")
    ap.add_argument("--infer", action="store_true", help="time the no_grad forward only")
    a = ap.parse_args()
    I, H, B, T = a.input_size or a.hidden_size, a.hidden_size, a.batch, a.steps
    def cls(I, H, **kw):
        return halstm.Recurrent(a.cell, I, H, **kw)
    gpu = "cuda" in a.target
    put = cuda.DeviceArray.from_numpy if gpu else (lambda v: v)
    rng = np.random.default_rng(0)
    x = put(rng.standard_normal((T, B, I)).astype(np.float32))
    dy = put(rng.standard_normal((T, B, H)).astype(np.float32))
    mods = {}
    for variant in a.variants:   # a variant that fails or differs is reported and left out
        name, _, folder = variant.partition("=")
        os.environ["HALSTM_CACHE"] = a.cache_prefix + name
        try:
            m = (halstm.load(folder, seed=0) if folder else
                 cls(I, H, target=a.target, seed=0).compile())
            if (m.input_size, m.hidden_size) != (I, H):
                raise ValueError(f"{folder} holds I={m.input_size} H={m.hidden_size}")
            err = max(reference_errors(m, m.cell, x, m(x)[0], dy).values())
            if a.infer:      # (the path --infer times: a forward without a tape)
                with halstm.no_grad():
                    y = m(x)[0]
                err = max(err, reference_errors(m, m.cell, x, y)["y"])
        except Exception as e:
            print(f"  {name}: failed: {e}")
            continue
        if not err < 1e-3:
            print(f"  {name}: differs from the reference by {err:.2e}")
            continue
        mods[name] = m
    first = a.variants[0].partition("=")[0]
    if first not in mods:
        raise SystemExit(f"the first variant, {first}, is needed for the ratios")
    calls = {}
    modes = ("infer",) if a.infer else ("fwd", "bwd")
    for n, m in mods.items():             # (m=m: each call its own module)
        if a.infer:
            calls[n, "infer"] = halstm.no_grad()(lambda m=m: m(x))
        else:
            calls[n, "fwd"] = lambda m=m: m(x)
            calls[n, "bwd"] = lambda m=m: m.backward(dy)
    # the first round warms up
    sync = cuda.synchronize if gpu else (lambda: None)
    med = {k: s * 1e3 for k, s in alternating(calls, a.reps + 1, 1, sync).items()}
    print(f"{a.target} {a.cell} I={I} H={H} B={B} T={T}, {a.reps} interleaved rounds, medians in ms "
          f"(ratio to {first})")
    for n, m in mods.items():
        captures = sum(lib.graph_stats()["captures"] for lib in m._libs.values()) if gpu else 0
        times = "  ".join(f"{k} {med[n, k]:8.3f} ({med[n, k] / med[first, k]:.3f})" for k in modes)
        print(f"  {n:12s} {times}  graphs captured {captures}")



if __name__ == "__main__":
    main()
