"""A plain GEMM of the projection's form on this CPU (JIT), in schedule
variants that block it as BLAS libraries do, against torch.mm:

    python bench/cpu_gemm_probe.py --rows 1536 --depth 1024 --panels 64 --variants tile,kblock256,packed --torch

out (panels, N, C) = x (N, K) . w (panels, K, C), C = --vectors vectors (4:
a panel of 4 gates x one vector of units, as schedules/cpu.py's proj tiles
it with AVX-512; AVX2's tiles take 2 gates). Variants (ROWS: rows a
register tile, default 6; vectors x ROWS accumulators):
  tileROWS        every tile's accumulators over the whole K (the schedule's form)
  kblockKC[xROWS] K in blocks of KC outside the row tiles, so that a panel's
                  block is read from L1 by every row tile of a chunk; the
                  tiles' sums kept in out between blocks
  packed[ROWS]    x's rows packed ROWS at a time (N/ROWS, K, ROWS): a tile's
                  broadcasts from one stream
  any of them + h K's two halves a step of the reduction loop, unrolled
                  (tileh, kblock256h: a loop of K/2 steps, each 2 x the tile's FMAs)
Rows in chunks of 32 tiles (fewer where N is smaller), (chunk, panel)
pairs in parallel. Outputs are checked against numpy first; prints ms and
GFLOP/s, medians of --reps.
"""
import argparse
import os
import re
import statistics
import time

import halide as hl
import numpy as np

CHUNK_TILES = 32


def _halves(acc, r, extent):
    """acc's reduction over r as extent / 2 steps, each step's two halves
    unrolled (k = h * extent / 2 + l: each row's address its base plus a
    constant; in the schedules, whose rows are clamped, k = 2 ko + ki let
    LLVM compute the rows' addresses in vector registers)."""
    if extent % 2:
        raise SystemExit(f"the halves need an even reduction, got {extent}")
    rh, rl = hl.RVar(r.name() + "h"), hl.RVar(r.name() + "l")
    acc.update().split(r, rh, rl, extent // 2).reorder(rh, rl).unroll(rh)


def build(variant, N, K, target, vectors):
    """The GEMM pipeline of `variant` compiled for target: (func, x, w,
    rows a tile, whether x is packed)."""
    kind, a, b, halves = re.fullmatch(r"(tile|kblock|packed)(\d*)(?:x(\d+))?(h?)",
                                        variant).groups()
    V = target.natural_vector_size(hl.Float(32))
    rows = int(b or (a if kind in ("tile", "packed") and a else 6))
    packed = kind == "packed"
    x = hl.ImageParam(hl.Float(32), 3 if packed else 2, "x")   # x[k, n]; packed x[i, k, n / rows]
    w = hl.ImageParam(hl.Float(32), 3, "w")                    # w[c, k, panel]
    c, n, jo = hl.Var("c"), hl.Var("n"), hl.Var("jo")
    no, nt, ni = hl.Var("no"), hl.Var("nt"), hl.Var("ni")
    xk = hl.Func("xk")
    kv = hl.Var("k")
    xk[kv, n] = x[n % rows, kv, n / rows] if packed else x[kv, n]
    out = hl.Func("out")
    chunk = min(rows * CHUNK_TILES, N)   # (rows in chunks of whole tiles, or one chunk)
    if kind != "kblock":
        r = hl.RDom([(0, K)])
        acc = hl.Func("acc")
        acc[c, n, jo] = 0.0
        acc[c, n, jo] += xk[r.x, n] * w[c, r.x, jo]
        out[c, n, jo] = acc[c, n, jo]
        out.split(n, no, n, chunk, hl.TailStrategy.ShiftInwards)
        out.split(n, nt, ni, rows, hl.TailStrategy.ShiftInwards)
        out.reorder(c, ni, nt, jo, no).fuse(jo, no, no).parallel(no)
        out.vectorize(c, V).unroll(c).unroll(ni)
        acc.compute_at(out, nt)
        for stage in (acc, acc.update()):
            stage.vectorize(c, V).unroll(c).unroll(n)
        acc.update().reorder(c, n, r.x, jo)
        if halves:
            _halves(acc, r.x, K)
    else:
        kc = int(a)
        if K % kc:
            raise SystemExit(f"--depth {K}: expected a multiple of the block {kc}")
        ri, ro = hl.RDom([(0, kc)]), hl.RDom([(0, K // kc)])
        part, ko = hl.Func("part"), hl.Var("ko")
        part[c, n, jo, ko] = 0.0
        part[c, n, jo, ko] += xk[ko * kc + ri.x, n] * w[c, ko * kc + ri.x, jo]
        out[c, n, jo] = hl.undef(hl.Float(32))
        # (block 0 selects 0 over out's unwritten value: no pass of zeros)
        out[c, n, jo] = hl.select(ro.x == 0, 0.0, out[c, n, jo]) + part[c, n, jo, ro.x]
        u = out.update()
        u.split(n, no, n, chunk, hl.TailStrategy.GuardWithIf)
        u.split(n, nt, ni, rows, hl.TailStrategy.GuardWithIf)
        u.vectorize(c, V).unroll(c).unroll(ni)
        u.reorder(c, ni, nt, ro.x, jo, no).fuse(jo, no, no).parallel(no)
        part.compute_at(out, nt)
        for stage in (part, part.update()):
            stage.vectorize(c, V).unroll(c).unroll(n)
        part.update().reorder(c, n, ri.x, jo, ko)
        if halves:
            _halves(part, ri.x, kc)
    C = vectors * V
    out.bound(c, 0, C)
    if packed:
        x.dim(0).set_bounds(0, rows).dim(1).set_stride(rows)
    else:
        x.dim(1).set_stride(K)
    w.dim(0).set_bounds(0, C).dim(1).set_stride(C)
    out.output_buffer().dim(1).set_stride(C)
    out.compile_jit(target)
    return out, x, w, rows, packed


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1536, help="N (T * B)")
    ap.add_argument("--depth", type=int, default=1024, help="K")
    ap.add_argument("--panels", type=int, default=64,
                    help="column panels (4*H/16 with AVX-512 and 4 vectors)")
    ap.add_argument("--variants", default="tile,kblock256,packed")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--torch", action="store_true", help="time torch.mm of the product too")
    ap.add_argument("--vectors", type=int, default=4, help="vectors a panel (a tile's columns)")
    ap.add_argument("--target", default="host",
                    help="Halide target (this CPU must run it), e.g. an AVX2 one")
    a = ap.parse_args()
    target = hl.get_host_target() if a.target == "host" else hl.Target(a.target)
    N, K, panels = a.rows, a.depth, a.panels
    C = a.vectors * target.natural_vector_size(hl.Float(32))
    rng = np.random.default_rng(0)
    xa = rng.standard_normal((N, K)).astype(np.float32)
    wa = rng.standard_normal((panels, K, C)).astype(np.float32)
    want = np.einsum("nk,pkc->pnc", xa, wa)
    runs = {}
    for v in a.variants.split(","):
        f, x, w, rows, packed = build(v, N, K, target, a.vectors)
        if (packed or v.startswith("kblock")) and N % rows:
            raise SystemExit(f"--rows {N}: {v} needs a multiple of {rows}")
        xs = (np.ascontiguousarray(xa.reshape(N // rows, rows, K).transpose(0, 2, 1))
              if packed else xa)                          # packed: (N/rows, K, rows)
        out = np.zeros((panels, N, C), np.float32)

        def run(f=f, x=x, w=w, xb=hl.Buffer(xs), wb=hl.Buffer(wa), ob=hl.Buffer(out)):
            x.set(xb), w.set(wb)
            f.realize(ob)
        run()
        err = np.abs(out - want).max() / np.abs(want).max()
        if not err < 1e-5:
            raise SystemExit(f"{v}: max relative error {err:.1e}")
        runs[v] = run
    if a.torch:
        import torch
        torch.set_num_threads(int(os.environ.get("HL_NUM_THREADS", os.cpu_count())))
        tx = torch.from_numpy(xa)
        tw = torch.from_numpy(np.ascontiguousarray(wa.transpose(0, 2, 1).reshape(panels * C, K)))
        tout = torch.empty(N, panels * C)
        runs[f"torch.mm {torch.__version__}"] = lambda: torch.mm(tx, tw.t(), out=tout)
    times = {v: [] for v in runs}
    for _ in range(a.reps + 2):              # alternating; the first two left out
        for v, run in runs.items():
            start = time.perf_counter()
            run()
            times[v].append(time.perf_counter() - start)
    flops = 2 * N * K * C * panels
    print(f"N={N} K={K} columns={C * panels}, {a.reps} alternating runs, medians")
    for v, ts in times.items():
        m = statistics.median(ts[2:])
        print(f"  {v:22s} {m * 1e3:8.2f} ms {flops / m / 1e9:6.0f} GFLOP/s")


if __name__ == "__main__":
    main()
