"""Probe: a layer's whole forward time loop as one CUDA kernel, a block a
batch row. Batch rows never meet, so a block can run all T steps of its
row with no grid-wide barrier: a thread a unit, each step every gate's
product of W_hh with the row's h (an H-term sum, unrolled), the cell, the
new state stored, then a block barrier. halstm's steps are one kernel a
step instead (graph-launched), whose time at small sizes hardly depends
on H; this measures what one launch a layer would give, and where W_hh,
read whole by every block every step, stops fitting it.

Halide's own rules shape the Func: an update may read itself only with
its pure variables in place, so the units are an RVar (race conditions
allowed: each thread writes its own unit); Halide puts a barrier at the
end of a block-level serial loop only when the loop body holds a barrier
already, so the step's xp is staged (Func `xs`, computed at the step
loop), which puts one between the staging and the step's thread loop
and one at the end of every step.

    python bench/gpu_loop_probe.py ptx H CELL            # here: the kernel's barriers (no GPU)
    python bench/gpu_loop_probe.py run H B T CELL...     # on a GPU: us a layer, checked

CELL: gru, lstm, rnn (tanh). Run with HL_CUDA_JIT_MAX_REGISTERS=128, the
register cap halstm's driver sets (the JIT's default is 64).
"""
import sys
import time

import halide as hl
import numpy as np

sys.path.insert(0, ".")
from halstm.cells.base import sigmoid, tanh  # noqa: E402

GATES = {"gru": 3, "lstm": 4, "rnn": 1}


def build(cell: str, H: int):
    """The loop Func and its inputs: xp (T, B, G, H), w (H, G, H) with
    w[k, g, j] = W_hh[g*H + j, k], b_hh (G, H), h0 (B, H) [, c0 (B, H)];
    output (T, B, H) per state, the states after each step."""
    G, NS = GATES[cell], 2 if cell == "lstm" else 1
    f32 = hl.Float(32)
    xp, w = hl.ImageParam(f32, 4, "xp"), hl.ImageParam(f32, 3, "w")
    bh, h0 = hl.ImageParam(f32, 2, "b_hh"), hl.ImageParam(f32, 2, "h0")
    init = [h0] + ([hl.ImageParam(f32, 2, "c0")] if NS == 2 else [])
    j, g, b, t = hl.Var("j"), hl.Var("g"), hl.Var("b"), hl.Var("t")
    xs = hl.Func("xs")
    xs[j, g, b, t] = xp[j, g, b, t]
    out = hl.Func("states")
    out[j, b, t] = hl.undef(f32) if NS == 1 else tuple(hl.undef(f32) for _ in range(NS))
    rd = hl.RDom([(0, H), (0, xp.dim(3).extent())], "rd")
    rj, rt = rd.x, rd.y

    def prev(k, s=0):   # state s of unit k before step rt
        last = out[k, b, hl.max(rt - 1, 0)]
        return hl.select(rt == 0, init[s][k, b], last if NS == 1 else last[s])

    hg = []
    for gi in range(G):
        acc = bh[rj, gi]
        for k in range(H):
            acc = acc + w[rj, gi, k] * prev(k)
        hg.append(acc)
    x = [xs[rj, gi, b, rt] for gi in range(G)]
    if cell == "gru":
        r, z = sigmoid(x[0] + hg[0]), sigmoid(x[1] + hg[1])
        out[rj, b, rt] = (1 - z) * tanh(x[2] + r * hg[2]) + z * prev(rj)
    elif cell == "rnn":
        out[rj, b, rt] = tanh(x[0] + hg[0])
    else:
        i, f = sigmoid(x[0] + hg[0]), sigmoid(x[1] + hg[1])
        c = f * prev(rj, 1) + i * tanh(x[2] + hg[2])
        out[rj, b, rt] = (sigmoid(x[3] + hg[3]) * tanh(c), c)
    out.update(0).allow_race_conditions().reorder(rj, rt, b).gpu_blocks(b).gpu_threads(rj)
    xs.compute_at(out, rt).gpu_threads(j).unroll(g)
    for p in [xp, w, bh] + init:
        for d in range(p.dimensions()):
            p.dim(d).set_min(0)
        p.dim(0).set_bounds(0, H)
    w.dim(1).set_bounds(0, G).dim(1).set_stride(H).dim(2).set_bounds(0, H).dim(2).set_stride(G * H)
    xp.dim(1).set_bounds(0, G).dim(1).set_stride(H).dim(2).set_stride(G * H)
    for p in [bh] + init:
        p.dim(1).set_stride(H)
    first = out.output_buffers()[0]
    first.dim(0).set_bounds(0, H).dim(1).set_min(0).dim(2).set_min(0)
    for q in out.output_buffers():
        q.dim(1).set_stride(H)
    return out, [xp, w, bh] + init


def reference(cell, xp, W, bh, h0, c0=None):
    """float64 states (T, B, H) after each step (h; the LSTM's h)."""
    T, B, G, H = xp.shape
    sig = lambda v: 1 / (1 + np.exp(-v))
    h, c, hs = h0.astype(np.float64), None if c0 is None else c0.astype(np.float64), []
    for s in range(T):
        hg = (h @ W.reshape(H, G * H) + bh.reshape(-1)).reshape(B, G, H)
        a = xp[s] + hg
        if cell == "gru":
            r, z = sig(a[:, 0]), sig(a[:, 1])
            h = (1 - z) * np.tanh(xp[s][:, 2] + r * hg[:, 2]) + z * h
        elif cell == "rnn":
            h = np.tanh(a[:, 0])
        else:
            c = sig(a[:, 1]) * c + sig(a[:, 0]) * np.tanh(a[:, 2])
            h = sig(a[:, 3]) * np.tanh(c)
        hs.append(h)
    return np.stack(hs)


def ptx(H, cell):
    out, args = build(cell, H)
    path = f"/tmp/gpu_loop_probe_{cell}{H}.stmt"
    hl.Pipeline(out).compile_to_lowered_stmt(path, args, hl.StmtOutputFormat.Text,
                                             hl.Target("host-cuda-cuda_capability_80-no_runtime"))
    text = open(path, errors="replace").read()
    print(f"{cell} H={H}: {text.count('bar.sync')} bar.sync in the kernel ({path})")


def run(H, B, T, cell, reps=30):
    G = GATES[cell]
    out, params = build(cell, H)
    target = hl.get_host_target().with_feature(hl.TargetFeature.CUDA) \
        .with_feature(hl.TargetFeature.CUDACapability80)
    out.compile_jit(target)
    rng = np.random.default_rng(0)
    s = 1 / np.sqrt(H)
    arrays = [rng.uniform(-1, 1, (T, B, G, H)), rng.uniform(-s, s, (H, G, H)),
              rng.uniform(-s, s, (G, H)), rng.uniform(-1, 1, (B, H)), rng.uniform(-1, 1, (B, H))]
    arrays = [a.astype(np.float32) for a in arrays[:len(params)]]
    for p, a in zip(params, arrays):
        p.set(hl.Buffer(a))
    res = [hl.Buffer(hl.Float(32), [H, B, T]) for _ in out.output_buffers()]
    realize = lambda: out.realize(res if len(res) > 1 else res[0], target)
    realize()
    res[0].copy_to_host()
    err = float(np.abs(np.asarray(res[0]) - reference(cell, *arrays)).max())
    times = []
    for _ in range(reps):
        res[0].device_sync()
        t0 = time.perf_counter()
        realize()
        res[0].device_sync()
        times.append(time.perf_counter() - t0)
    us = np.median(times) * 1e6
    print(f"{cell} H={H} B={B} T={T}: W_hh {G * H * H * 4 >> 10} KiB, {us:.1f} us a layer "
          f"(median of {reps}), {us / T:.2f} us a step; max abs error {err:.1e}")


if __name__ == "__main__":
    if sys.argv[1] == "ptx":
        ptx(int(sys.argv[2]), sys.argv[3])
    else:
        H, B, T = (int(a) for a in sys.argv[2:5])
        for cell in sys.argv[5:]:
            run(H, B, T, cell)
