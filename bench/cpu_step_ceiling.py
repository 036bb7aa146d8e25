"""The ceiling of a step's product on one CPU core: out = W_hh h over
`--panels` weight panels of 16 units x 4 gates (AVX-512), every batch row
in tiles of 4 rows x 4 gates (16 accumulators; `--tile-rows` to try
others, the batch a multiple of them), the panel loop outermost, as
schedules/cpu.py's step tiles it, but with no cell, no xp and no state
stores. `--k-block N`: the reduction in blocks of N outside the row tiles
(a panel's accumulators for every row kept in memory between blocks, so
that a block of the panel is read from L1 by every row tile after the
first). Prints microseconds a call and the share of one core's peak
(`--peak`, GFLOP/s of one core from bench/cpu_peak.py).

    python bench/cpu_step_ceiling.py --hidden 512 --batch 64 --panels 16

16 panels at H = 512 is one thread's half of a K=H=512 B=64 step.
"""
import argparse
import time

import halide as hl
import numpy as np


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512, help="the reduction (H)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--panels", type=int, default=16)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--peak", type=float, default=265.0)
    ap.add_argument("--tile-rows", type=int, default=4)
    ap.add_argument("--k-block", type=int, default=0)
    a = ap.parse_args()
    if a.batch % a.tile_rows:
        ap.error(f"--batch: expected a multiple of --tile-rows {a.tile_rows}, got {a.batch}")
    P, G, K, B = 16, 4, a.hidden, a.batch
    w = hl.ImageParam(hl.Float(32), 4, "w")   # numpy (panels, K, G, P)
    h = hl.ImageParam(hl.Float(32), 2, "h")   # numpy (B, K)
    j, g, b, jo = hl.Var("j"), hl.Var("g"), hl.Var("b"), hl.Var("jo")
    bo, bi = hl.Var("bo"), hl.Var("bi")
    r = hl.RDom([(0, K)])
    acc, out = hl.Func("acc"), hl.Func("out")
    acc[j, g, b, jo] = hl.f32(0)
    acc[j, g, b, jo] += w[j, g, r.x, jo] * h[r.x, b]
    out[j, g, b, jo] = acc[j, g, b, jo]
    out.bound(j, 0, P).bound(g, 0, G).bound(b, 0, B).bound(jo, 0, a.panels)
    if a.k_block:
        ro, ri = hl.RVar("ro"), hl.RVar("ri")
        out.reorder(j, g, b, jo).vectorize(j).unroll(g)
        acc.compute_at(out, jo).vectorize(j).unroll(g)
        acc.update().split(r.x, ro, ri, a.k_block).split(b, bo, bi, a.tile_rows) \
            .reorder(j, g, bi, ri, bo, ro).vectorize(j).unroll(g).unroll(bi)
    else:
        out.split(b, bo, bi, a.tile_rows).reorder(j, g, bi, bo, jo).vectorize(j).unroll(g) \
            .unroll(bi)
        acc.compute_at(out, bo).vectorize(j).unroll(g).unroll(b)
        acc.update().reorder(j, g, b, r.x).vectorize(j).unroll(g).unroll(b)
    out.compile_jit(hl.get_host_target())
    rng = np.random.default_rng(0)
    # the arrays must outlive the Buffers that view them
    w_np = rng.random((a.panels, K, G, P), dtype=np.float32)
    h_np = rng.random((B, K), dtype=np.float32)
    w.set(hl.Buffer(w_np))
    h.set(hl.Buffer(h_np))
    o = hl.Buffer(hl.Float(32), [P, G, B, a.panels])
    out.realize(o)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(a.reps):
            out.realize(o)
        best = min(best, (time.perf_counter() - t) / a.reps)
    gflops = 2 * P * G * B * K * a.panels / best / 1e9
    print(f"H={K} B={B} panels={a.panels} tile rows {a.tile_rows} k block {a.k_block or K}: "
          f"{best * 1e6:.1f} us a call, "
          f"{gflops:.1f} GFLOP/s, {100 * gflops / a.peak:.0f}% of one core's {a.peak:g}")


if __name__ == "__main__":
    main()
