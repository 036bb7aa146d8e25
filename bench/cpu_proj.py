"""Time the cpu schedule's input projection alone (JIT, this machine) at
several tile shapes, alternating, and print GFLOP/s:

    python bench/cpu_proj.py --input-size 1024 --hidden-size 1024 --rows-total 1600 --tiles 4x2,2x6

--tiles: GATESxROWS for each variant, replacing cpu.proj_tile(target, G)
(GATES divides the cell's gates; default: the schedule's own choice only).
--torch: torch.mm of the same product (MKL or oneDNN, as many threads as
Halide's pool) in the same alternating runs, the peer's rate.
Outputs are checked against numpy first.
"""
import argparse
import statistics
import time

import halide as hl
import numpy as np

from halstm import cells, pipeline
from halstm.schedules import cpu


def build(cell, K, H, target, tile):
    """The projection pipeline, JIT-compiled with tiles of `tile` (gates,
    rows) (None: the schedule's own proj_tile)."""
    own = cpu.proj_tile
    if tile:
        cpu.proj_tile = lambda target, gates: tile
    try:
        p = pipeline.build(cell, "proj", K, H, cpu.layout(target))
        cpu.proj(p, target)
    finally:
        cpu.proj_tile = own
    pl = p.pipeline()
    pl.compile_jit(target)
    return p, pl


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cell", default="lstm")
    ap.add_argument("--input-size", type=int, default=1024)
    ap.add_argument("--hidden-size", type=int, default=1024)
    ap.add_argument("--rows-total", type=int, default=1600, help="T * B")
    ap.add_argument("--tiles", default="", help="comma-separated GATESxROWS; empty: the schedule's")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--torch", action="store_true", help="time torch.mm of the product too")
    a = ap.parse_args()
    K, H, N = a.input_size, a.hidden_size, a.rows_total
    target = hl.get_host_target()
    cell = cells.get(a.cell)
    variants = [tuple(int(n) for n in v.split("x")) for v in a.tiles.split(",") if v] or [None]
    built = {tile: build(cell, K, H, target, tile) for tile in variants}
    G, P = cell.n_gates, cpu.panel(target)
    Hp = pipeline.padded(H, P)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((N, K)).astype(np.float32)
    w = rng.standard_normal((G, H, K)).astype(np.float32)
    b = rng.standard_normal((G, H)).astype(np.float32)
    wp = np.zeros((Hp // P, K, G, P), np.float32)      # panels of P units
    for jo in range(Hp // P):
        units = w[:, jo * P:(jo + 1) * P, :]           # (G, <=P, K)
        wp[jo, :, :, :units.shape[1]] = units.transpose(2, 0, 1)
    want = np.einsum("nk,ghk->ngh", x, w) + b          # (N, G, H)
    bufs = [hl.Buffer(v) for v in (x, wp, b)]
    out = np.zeros((Hp // P, N, G, P), np.float32)
    out_buf = hl.Buffer(out)
    times = {r: [] for r in variants}
    if a.torch:
        import os

        import torch
        torch.set_num_threads(int(os.environ.get("HL_NUM_THREADS", os.cpu_count())))
        tx, tw = torch.from_numpy(x), torch.from_numpy(w.reshape(G * H, K))
        tout = torch.empty(N, G * H)
        times["torch"] = []
    for rep in range(a.reps + 2):
        if a.torch:
            start = time.perf_counter()
            torch.mm(tx, tw.t(), out=tout)
            times["torch"].append(time.perf_counter() - start)
        for r in variants:
            p, pl = built[r]
            for q, buf in zip(p.inputs, bufs):
                q.set(buf)
            start = time.perf_counter()
            pl.realize(out_buf)
            times[r].append(time.perf_counter() - start)
            if rep == 0:
                got = out.transpose(1, 2, 0, 3).reshape(N, G, Hp)[:, :, :H]
                err = np.abs(got - want).max() / np.abs(want).max()
                if not err < 1e-5:
                    raise SystemExit(f"tile {r or 'default'}: max error {err:.1e}")
    if a.torch:
        m = statistics.median(times["torch"][2:])
        print(f"torch.mm {torch.__version__} K={K} N={N} columns={G * H}: {m * 1e3:.2f} ms, "
              f"{2 * N * K * G * H / m / 1e9:.0f} GFLOP/s")
    for r in variants:
        m = statistics.median(times[r][2:])
        gates, rows = r or cpu.proj_tile(target, G)
        print(f"{a.cell} K={K} H={H} N={N} tile {gates} gates x {rows} rows: {m * 1e3:.2f} ms, "
              f"{2 * N * K * G * H / m / 1e9:.0f} GFLOP/s")


if __name__ == "__main__":
    main()
