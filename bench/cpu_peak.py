"""Measure this CPU's peak float32 FMA rate with a Halide kernel: per
thread, A independent accumulator vectors (native width), each updated by
N fused multiply-adds in a loop, no memory traffic. The fractions of peak in
bench/RESULTS.md are halstm's GFLOP/s over this figure.

    .venv/bin/python bench/cpu_peak.py            # 1 thread and all threads

Prints GFLOP/s (2 FLOPs an FMA), median of 9 runs, per thread count.
"""
import argparse
import os
import time

import halide as hl
import numpy as np


def kernel(lanes: int, accumulators: int, steps: int, target) -> hl.Pipeline:
    """out(v, a, t) = accumulator a of task t after `steps` FMAs a*x + y."""
    v, a, t = hl.Var("v"), hl.Var("a"), hl.Var("t")
    r = hl.RDom([(0, steps)], "r")
    acc = hl.Func("acc")
    # start values that depend on every axis, so nothing folds
    acc[v, a, t] = hl.f32(v + a + t) * hl.f32(1e-3)
    # the multiplier names r (an update without it has no loop over r); the
    # select is the same for every accumulator: one scalar per step
    n = hl.Param(hl.Int(32), "n", steps)
    mul = hl.select(r.x < n, hl.f32(0.999999), hl.f32(0.999998))
    acc[v, a, t] = acc[v, a, t] * mul + hl.f32(1e-7)
    out = hl.Func("out")
    out[v, a, t] = acc[v, a, t]
    out.bound(v, 0, lanes).bound(a, 0, accumulators)
    out.vectorize(v).unroll(a).parallel(t)
    acc.compute_at(out, t).vectorize(v).unroll(a)
    acc.update().reorder(v, a, r.x).vectorize(v).unroll(a)
    p = hl.Pipeline(out)
    p.compile_jit(target)
    return p


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--accumulators", type=int, default=12,
                    help="independent FMA chains a thread (hide the FMA latency)")
    ap.add_argument("--steps", type=int, default=2_000_000)
    a = ap.parse_args()
    target = hl.get_host_target()
    lanes = 16 if target.has_feature(hl.TargetFeature.AVX512) else 8
    p = kernel(lanes, a.accumulators, a.steps, target)
    cores = os.cpu_count()
    print(f"target {target}, {lanes} float lanes, {a.accumulators} accumulators, {cores} CPUs")
    for threads in sorted({1, cores}):
        buf = hl.Buffer(hl.Float(32), [lanes, a.accumulators, threads])
        p.realize(buf)
        times = []
        for _ in range(9):
            t0 = time.perf_counter()
            p.realize(buf)
            times.append(time.perf_counter() - t0)
        flops = 2.0 * lanes * a.accumulators * a.steps * threads
        med = float(np.median(times))
        print(f"{threads} thread(s): {flops / med / 1e9:7.1f} GFLOP/s median "
              f"(best {flops / min(times) / 1e9:.1f})")


if __name__ == "__main__":
    main()
