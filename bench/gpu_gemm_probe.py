"""Probe: can a Halide 21 CUDA schedule reach cuBLAS's SGEMM rate? The
GEMMs of an LSTM layer (projection, dx, dW) are where halstm trails cuDNN
on the large shapes, so this times, on one plain GEMM
out(x, y) = sum_r A(x, r) B(r, y) (x contiguous in A and out, r in B; the
projection's layout), three schedules against torch.mm (TF32 off):

- warp:  halstm's register-tile style: one-warp blocks, a lane XR units (32
         apart) x YR rows in registers, the other operand broadcast from
         global memory (L1).
- chunk: the classic shared-memory GEMM, as far as Halide expresses it:
         the reduction split in chunks of KC (rfactor); per chunk the block
         stages an A slab and a B slab (B transposed) in shared memory,
         each thread sums its XV x YV tile over the chunk in registers from
         float4 shared loads (16 FMAs a load), then adds it to a root
         accumulator (one global load and store per element per chunk).
         Accumulators cannot stay in registers across chunks: a Func in
         MemoryType.Register computed at the block level keeps the
         thread axes in its index and lands in local memory (PTX
         .local depot of the whole block tile; bench/RESULTS.md, "Where
         the GPU time goes").

    python bench/gpu_gemm_probe.py ptx     # here: PTX instruction counts (no GPU)
    python bench/gpu_gemm_probe.py run     # on a GPU: ms and TFLOP/s per schedule

The JIT caps registers at 64 a thread unless HL_CUDA_JIT_MAX_REGISTERS
says otherwise (halstm's driver sets 128): run with
HL_CUDA_JIT_MAX_REGISTERS=128 to compare with halstm's kernels.
"""
import re
import sys
import time

import halide as hl
import numpy as np

SHAPES = [(4096, 1600, 1024), (8192, 1600, 2048), (2048, 6400, 512)]   # (X, Y, R)
CONFIGS = ["torch", "warp", dict(), dict(KC=8), dict(KC=32), dict(XV=4, KC=32), dict(TY=4, KC=32),
           dict(YV=4, TY=16, KC=32), dict(XV=4, YV=16, TY=4, KC=32)]


def _gemm(X, Y, R):
    A = hl.ImageParam(hl.Float(32), 2, "A")
    B = hl.ImageParam(hl.Float(32), 2, "B")
    x, y = hl.Var("x"), hl.Var("y")
    r = hl.RDom([(0, R)], "r")
    prod = hl.Func("prod")
    prod[x, y] = hl.f32(0)
    prod[x, y] += A[x, r] * B[r, y]
    out = hl.Func("out")
    out[x, y] = prod[x, y]
    out.bound(x, 0, X).bound(y, 0, Y)
    A.dim(0).set_bounds(0, X).dim(1).set_bounds(0, R).set_stride(X)
    B.dim(0).set_bounds(0, R).dim(1).set_bounds(0, Y).set_stride(R)
    out.output_buffer().dim(0).set_bounds(0, X).dim(1).set_stride(X)
    return out, prod, A, B, x, y, r


def warp(X, Y, R, XR=4, YR=8, U=8):
    out, prod, A, B, x, y, r = _gemm(X, Y, R)
    xi, yi, xo, yo, xl, xv = [hl.Var(n) for n in "xi yi xo yo xl xv".split()]
    out.tile(x, y, xo, yo, xi, yi, 32 * XR, YR).split(xi, xv, xl, 32)
    out.reorder(xv, yi, xl, xo, yo).gpu_blocks(xo, yo).gpu_threads(xl).unroll(xv).unroll(yi)
    prod.compute_at(out, xl).unroll(x).unroll(y)
    ro, ri = hl.RVar("ro"), hl.RVar("ri")
    prod.update().split(r.x, ro, ri, U).reorder(x, y, ri, ro).unroll(x).unroll(y).unroll(ri)
    return out, A, B


def chunk(X, Y, R, XV=8, YV=8, TY=8, KC=16):
    """Blocks of 32 x TY threads over XT = 32*XV units x YT = TY*YV rows; a
    thread's units are XV/4 runs of 4 neighbours, 128 apart."""
    out, prod, A, B, x, y, r = _gemm(X, Y, R)
    XT, YT = 32 * XV, TY * YV
    ox, oi = hl.Var("ox"), hl.Var("oi")
    out.split(x, ox, oi, 128).gpu_blocks(ox, y).gpu_threads(oi)
    prod.compute_root().split(x, ox, oi, 128).gpu_blocks(ox, y).gpu_threads(oi)
    ro, ri, w = hl.RVar("ro"), hl.RVar("ri"), hl.Var("w")
    inter = prod.update().split(r.x, ro, ri, KC).rfactor(ro, w)   # inter(x, y, w): chunk w's sum
    xo, yo, xi, yi, xl, xv, ty, yv, xq, xr = [hl.Var(n) for n in
                                              "xo yo xi yi xl xv ty yv xq xr".split()]
    u = prod.update()
    u.split(x, xo, xi, XT).split(y, yo, yi, YT).split(xi, xq, xr, 4).split(xq, xv, xl, 32)
    u.split(yi, ty, yv, YV).reorder(xr, yv, xv, xl, ty, ro, xo, yo)
    u.gpu_blocks(xo, yo).gpu_threads(xl, ty).unroll(yv).unroll(xv).vectorize(xr)
    inter.compute_at(prod, xl).store_in(hl.MemoryType.Register)
    ix, iy, _ = inter.args()
    ixo, ixi = hl.Var("ixo"), hl.Var("ixi")
    for s in (inter, inter.update()):
        s.split(ix, ixo, ixi, 4)
    inter.reorder(ixi, iy, ixo).unroll(ixi).unroll(iy).unroll(ixo)
    inter.update().reorder(ixi, iy, ixo, ri).unroll(ixi).unroll(iy).unroll(ixo).unroll(ri)
    a_s, b_s = A.in_(), B.in_()                       # shared-memory slabs, loaded by the block
    ax, ay = a_s.args()
    bx, by = b_s.args()
    ao, ai, ayo, ayi, bq, bw = [hl.Var(n) for n in "ao ai ayo ayi bq bw".split()]
    a_s.compute_at(prod, ro).store_in(hl.MemoryType.GPUShared)
    a_s.split(ax, ao, ai, 32).split(ay, ayo, ayi, TY).reorder(ao, ayo, ai, ayi)
    a_s.gpu_threads(ai, ayi).unroll(ao).unroll(ayo)
    b_s.compute_at(prod, ro).store_in(hl.MemoryType.GPUShared).reorder_storage(by, bx)
    b_s.split(by, bq, bw, 32 // KC).fuse(bx, bw, bx).split(bq, ayo, ayi, TY)
    b_s.reorder(ayo, bx, ayi).gpu_threads(bx, ayi).unroll(ayo)
    ra, rb = a_s.in_(inter), b_s.in_(inter)           # registers: float4 loads from the slabs
    ra.compute_at(inter, ixo).store_in(hl.MemoryType.Register).vectorize(ra.args()[0], 4)
    rb.compute_at(inter, ri).store_in(hl.MemoryType.Register).vectorize(rb.args()[1], 4)
    for f in (ra, rb):
        for a in f.args():
            f.unroll(a)
    return out, A, B


def build(cfg, X, Y, R):
    return warp(X, Y, R) if cfg == "warp" else chunk(X, Y, R, **cfg)


def ptx_counts(cfg, X, Y, R, path="/tmp/gemm_probe.stmt"):
    out, A, B = build(cfg, X, Y, R)
    out.compile_to_lowered_stmt(path, [A, B], hl.StmtOutputFormat.Text,
                                hl.Target("host-cuda-cuda_capability_80"))
    text = open(path, "rb").read().decode("latin1")
    kinds = {"fma": r"fma\.rn\.f32", "ld.global": r"ld\.global", "st.global": r"st\.global",
             "ld.shared.v4": r"ld\.shared\.v4", "bar.sync": r"bar\.sync", "local": r"ld\.local"}
    body = max(text.split(".entry")[1:], key=lambda b: len(re.findall(kinds["fma"], b)))
    return {k: len(re.findall(v, body)) for k, v in kinds.items()}


def time_one(cfg, X, Y, R, target, reps=30):
    if cfg == "torch":
        import torch
        torch.backends.cuda.matmul.allow_tf32 = False
        a, b = torch.randn(R, X, device="cuda"), torch.randn(Y, R, device="cuda")
        torch.mm(b, a)
        torch.cuda.synchronize()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            torch.mm(b, a)
            torch.cuda.synchronize()
            ts.append(time.perf_counter() - t0)
        return float(np.median(ts)), 0.0
    out, A, B = build(cfg, X, Y, R)
    a = np.random.default_rng(0).standard_normal((R, X), np.float32)
    b = np.random.default_rng(1).standard_normal((Y, R), np.float32)
    A.set(hl.Buffer(a))
    B.set(hl.Buffer(b))
    ob = hl.Buffer(hl.Float(32), [X, Y])
    p = hl.Pipeline(out)
    p.compile_jit(target)
    p.realize(ob)
    ob.copy_to_host()
    want = b.astype(np.float64) @ a
    err = float(np.abs(np.asarray(ob) - want).max() / np.abs(want).max())
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        p.realize(ob)
        ob.device_sync()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts)), err


def main():
    mode = sys.argv[1] if len(sys.argv) > 1 else "ptx"
    if mode == "ptx":
        X, Y, R = SHAPES[0]
        for cfg in CONFIGS[1:]:
            print(f"{str(cfg):40s} {ptx_counts(cfg, X, Y, R)}")
        return
    target = hl.Target("host-cuda-cuda_capability_86")
    for X, Y, R in SHAPES:
        for cfg in CONFIGS:
            ms, err = time_one(cfg, X, Y, R, target)
            print(f"{X}x{Y}x{R} {str(cfg):40s} {ms * 1e3:8.3f} ms "
                  f"{2 * X * Y * R / ms / 1e12:6.1f} TFLOP/s  max rel err {err:.1e}", flush=True)


if __name__ == "__main__":
    main()
