"""A forward step's product alone on one CPU core, in tiles of a gate
group: out = W_hh h over `--panels` weight panels of P units (the host's
vector width) x 4 gates, every batch row, the panel loop outermost, tiles
of `--gs` gates x `--rows` rows (the reduction inside, its accumulators in
registers). `--layout interleaved`: panels (panels, K, G, P), every gate of
a reduction step side by side (the layout before cpu.panel_layout);
`grouped`: (panels, G/gs, K, gs, P), each group's reduction contiguous.
Prints microseconds a call and GFLOP/s.

    python bench/cpu_step_groups.py --hidden 1024 --batch 48 --gs 2 --rows 6 --layout grouped
"""
import argparse
import time

import halide as hl
import numpy as np


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024, help="the reduction (H)")
    ap.add_argument("--batch", type=int, default=48, help="rows, a multiple of --rows")
    ap.add_argument("--panels", type=int, default=16)
    ap.add_argument("--gs", type=int, default=4, help="gates a tile (a divisor of 4)")
    ap.add_argument("--rows", type=int, default=2, help="rows a tile")
    ap.add_argument("--layout", choices=("interleaved", "grouped"), default="interleaved")
    ap.add_argument("--order", choices=("panel", "group"), default="panel",
                    help="outside the panel loop: the row tiles, then the groups (panel) "
                         "or the groups, then the row tiles (group)")
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args()
    G, K, B, gs = 4, a.hidden, a.batch, a.gs
    if G % gs or B % a.rows:
        ap.error(f"--gs must divide 4 and --rows the batch; got --gs {gs}, --rows {a.rows}, "
                 f"--batch {B}")
    t = hl.get_host_target()
    P = 16 if t.has_feature(hl.TargetFeature.AVX512) else 8
    NG = G // gs
    j, gi, go, b, jo = (hl.Var(n) for n in ("j", "gi", "go", "b", "jo"))
    bo, bi = hl.Var("bo"), hl.Var("bi")
    r = hl.RDom([(0, K)])
    if a.layout == "interleaved":
        w = hl.ImageParam(hl.Float(32), 4, "w")   # numpy (panels, K, G, P)
        shape = (a.panels, K, G, P)

        def wv(u, g, k, panel):
            return w[u, g, k, panel]
    else:
        w = hl.ImageParam(hl.Float(32), 5, "w")   # numpy (panels, NG, K, gs, P)
        shape = (a.panels, NG, K, gs, P)

        def wv(u, g, k, panel):
            return w[u, g % gs, k, g / gs, panel]
    h = hl.ImageParam(hl.Float(32), 2, "h")       # numpy (B, K)
    acc, out = hl.Func("acc"), hl.Func("out")
    acc[j, gi, b, go, jo] = hl.f32(0)
    acc[j, gi, b, go, jo] += wv(j, gi + go * gs, r.x, jo) * h[r.x, b]
    out[j, gi, b, go, jo] = acc[j, gi, b, go, jo]
    out.bound(j, 0, P).bound(gi, 0, gs).bound(go, 0, NG).bound(b, 0, B).bound(jo, 0, a.panels)
    outer = [bo, go, jo] if a.order == "panel" else [go, bo, jo]
    out.split(b, bo, bi, a.rows).reorder(j, gi, bi, *outer).vectorize(j).unroll(gi).unroll(bi)
    acc.compute_at(out, outer[0]).vectorize(j).unroll(gi).unroll(b)
    acc.update().reorder(j, gi, b, r.x).vectorize(j).unroll(gi).unroll(b)
    out.compile_jit(t)
    rng = np.random.default_rng(0)
    # the arrays must outlive the Buffers that view them
    w_np = rng.random(shape, dtype=np.float32)
    h_np = rng.random((B, K), dtype=np.float32)
    w.set(hl.Buffer(w_np))
    h.set(hl.Buffer(h_np))
    o = hl.Buffer(hl.Float(32), [P, gs, B, NG, a.panels])
    out.realize(o)
    best = float("inf")
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(a.reps):
            out.realize(o)
        best = min(best, (time.perf_counter() - t0) / a.reps)
    gflops = 2 * P * G * B * K * a.panels / best / 1e9
    print(f"gs={gs} rows={a.rows} layout={a.layout} order={a.order} H={K} B={B} "
          f"panels={a.panels}: {best * 1e6:.0f} us, {gflops:.1f} GFLOP/s")


if __name__ == "__main__":
    main()
