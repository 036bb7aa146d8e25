"""The char LM's head and optimizer, and the array operations the modules
need on a GPU, as Halide algorithms (no schedules).

    head   y (N, H), W (V, H), b (V,), targets (N,) int32, scale
           -> loss (N,) = -log softmax(y W^T + b)[target], and the gradients
              of scale * sum(loss): dW (V, H), db (V,), dy (N, H)
    sumsq  g (n,) -> out (1,) = sum g^2 (one parameter's share of the
           global gradient norm)
    adam   p, g, m, v (n,), sq (P,) the parameters' sumsq, scalars
           -> p, m, v updated (optim.Adam's scaled-moment rule, the gradient
              clipped by the global norm sqrt(sum sq) to max_norm)
    sgd    p, g, buf (n,), sq (P,), scalars -> p, buf updated (optim.SGD)
    onehot ids (N,) int32 -> x (N, V) one-hot rows (V: the output's width)
    rows   src (R, n), idx (M,) int32 -> out (M, n) = src[idx[m]], zero
           where idx[m] < 0 (time reversal, batch reorders)
    add    a, b (n,) -> out (n,) = a + b
    mul    a, b (n,) -> out (n,) = a * b (dropout masks)
    dropout key0, key1, threshold (uint32), scale -> out (n,) = scale where
           hash(key, i) >> 8 >= threshold, else 0: a dropout mask of
           P(0) = threshold / 2^24, the same bits on every target
           (halstm.dropout: its hash, and its masks in numpy)

Shapes above are numpy's; Halide's axes are the reverse (runtime.py). Sizes
are runtime values: one compiled library serves every model. Stages are
named for the schedules (schedules/cpu.py, schedules/cuda.py: functions
of the same names).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import halide as hl

from ..pipeline import Stages
from ..dropout import hash32

KINDS = ("head", "sumsq", "adam", "sgd", "onehot", "rows", "add", "mul", "dropout")
SUMSQ_LANES = 1024     # sumsq: partial sums over g(j), g(j + LANES), ...


@dataclass
class Pipe(Stages):
    """A built pipeline: arguments in C ABI order (inputs, then the output
    Funcs' buffers), named stages and their Vars."""

    kind: str
    args: list = field(default_factory=list)      # ImageParams and Params
    outputs: list = field(default_factory=list)   # Funcs
    stages: dict = field(default_factory=dict)
    vars: dict = field(default_factory=dict)


def _dense(p: hl.ImageParam) -> hl.ImageParam:
    """Dense strides (numpy C order, reversed) and zero minima."""
    stride = 1
    for d in range(p.dimensions()):
        p.dim(d).set_min(0).set_stride(stride)
        stride = stride * p.dim(d).extent()
    return p


def _f32(name, dims):
    return _dense(hl.ImageParam(hl.Float(32), dims, name))


def build(kind: str) -> Pipe:
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")
    return globals()[f"_{kind}"]()


def _nonfinite(x: hl.Expr) -> hl.Expr:
    """1 (UInt(8)) where float x is NaN or +-Inf: exponent bits all ones. An
    integer test of a loaded value: LLVM's no-NaN flags, under which Halide
    compiles float arithmetic, fold float NaN tests and let max and exp
    drop a NaN (hl.exp(NaN) is 0 on CPUs)."""
    exp_bits = hl.reinterpret(hl.UInt(32), x) & 0x7F800000
    return hl.select(exp_bits == 0x7F800000, hl.u8(1), hl.u8(0))


def _nan_where(bad: hl.Expr, x: hl.Expr) -> hl.Expr:
    """x, or a quiet NaN where bad != 0, selected on the bits."""
    bits = hl.select(bad != 0, hl.u32(0x7FC00000), hl.reinterpret(hl.UInt(32), x))
    return hl.reinterpret(hl.Float(32), bits)


def _head() -> Pipe:
    y, w, b = _f32("y", 2), _f32("w", 2), _f32("b", 1)         # y(k, n), w(k, v), b(v)
    targets = _dense(hl.ImageParam(hl.Int(32), 1, "targets"))  # targets(n)
    scale = hl.Param(hl.Float(32), "scale")
    H, N, V = y.dim(0).extent(), y.dim(1).extent(), w.dim(1).extent()
    k, v, n = hl.Var("k"), hl.Var("v"), hl.Var("n")
    rk, rv, rn = hl.RDom([(0, H)], "rk"), hl.RDom([(0, V)], "rv"), hl.RDom([(0, N)], "rn")
    # A row whose logits meet a NaN or Inf input (its y row, any of W, b)
    # gets NaN loss and NaN dlogits, so NaN reaches loss, dW, db and that
    # row of dy as numpy's head gives it, whatever max and exp make of it.
    w_scan, y_scan = hl.Func("w_scan"), hl.Func("y_scan")   # w_scan(v), y_scan(n):
    w_scan[v] = hl.u8(0)                                    # any of W's row v, y's row n
    w_scan[v] = hl.max(w_scan[v], _nonfinite(w[rk, v]))    # not finite
    y_scan[n] = hl.u8(0)
    y_scan[n] = hl.max(y_scan[n], _nonfinite(y[rk, n]))
    bad_w = hl.Func("bad_w")               # bad_w(v): W's row v or b(v) not finite
    bad_w[v] = hl.max(_nonfinite(b[v]), w_scan[v])
    bad_row = hl.Func("bad_row")           # bad_row(n): row n's logits meet one
    bad_row[n] = hl.max(hl.maximum(bad_w[rv]), y_scan[n])
    # W^T and W read past V and H as zeros: a product's register tile may
    # compute whole vectors past the edge (schedules/cpu.py head)
    wt, w_pad = hl.Func("wt"), hl.Func("w_pad")    # wt(v, k) = w_pad(k, v) = W(v, k)
    wt[v, k] = hl.select(v < V, w[k, hl.min(v, V - 1)], hl.f32(0))
    w_pad[k, v] = hl.select(k < H, w[hl.min(k, H - 1), v], hl.f32(0))
    logits_acc = hl.Func("logits_acc")    # logits(v, n) = b(v) + sum_k y(k, n) W(v, k)
    logits_acc[v, n] = hl.select(v < V, b[hl.min(v, V - 1)], hl.f32(0))
    logits_acc[v, n] += y[rk, n] * wt[v, rk]
    logits = hl.Func("logits")
    logits[v, n] = logits_acc[v, n]
    mx = hl.Func("mx")
    mx[n] = hl.maximum(logits[rv, n])
    total = hl.Func("total")
    total[n] = hl.sum(hl.exp(logits[rv, n] - mx[n]))
    t = hl.Func("t")
    t[n] = hl.clamp(targets[n], 0, V - 1)
    loss = hl.Func("loss")
    loss[n] = _nan_where(bad_row[n], hl.log(total[n]) - (logits[t[n], n] - mx[n]))
    dlogits = hl.Func("dlogits")           # d(scale * sum loss) / d logits
    dlogits[v, n] = _nan_where(bad_row[n],
                               scale * (hl.exp(logits[v, n] - mx[n]) / total[n]
                                        - hl.select(v == t[n], hl.f32(1), hl.f32(0))))
    dw_acc, dy_acc = hl.Func("dw_acc"), hl.Func("dy_acc")
    dw_acc[k, v] = hl.f32(0)               # dW(v, k) = sum_n dlogits(v, n) y(k, n)
    dw_acc[k, v] += dlogits[v, rn] * y[k, rn]
    dy_acc[k, n] = hl.f32(0)               # dy(k, n) = sum_v dlogits(v, n) W(v, k)
    dy_acc[k, n] += dlogits[rv, n] * w_pad[k, rv]
    dw, db, dy = hl.Func("dw"), hl.Func("db"), hl.Func("dy")
    dw[k, v] = dw_acc[k, v]
    db[v] = hl.sum(dlogits[v, rn])
    dy[k, n] = dy_acc[k, n]
    # by the names given (Halide renames a Func whose name a process already used)
    stages = dict(w_scan=w_scan, y_scan=y_scan, bad_w=bad_w, bad_row=bad_row, wt=wt,
                  w_pad=w_pad, logits_acc=logits_acc, logits=logits, mx=mx, total=total, t=t,
                  loss=loss, dlogits=dlogits, dw_acc=dw_acc, dw=dw, db=db, dy_acc=dy_acc, dy=dy)
    return Pipe("head", [y, w, b, targets, scale], [loss, dw, db, dy], stages,
                {"k": k, "v": v, "n": n})


def _sumsq() -> Pipe:
    g = _f32("g", 1)
    n = g.dim(0).extent()
    j, x = hl.Var("j"), hl.Var("x")
    L = SUMSQ_LANES
    r = hl.RDom([(0, (n + L - 1) // L)], "r")
    i = j + r.x * L
    partial = hl.Func("partial")           # lane j: g(j)^2 + g(j + L)^2 + ...
    gi = g[hl.min(i, n - 1)]
    partial[j] = hl.sum(hl.select(i < n, gi * gi, hl.f32(0)))
    rj = hl.RDom([(0, L)], "rj")
    out = hl.Func("out")
    out[x] = hl.sum(partial[rj])
    return Pipe("sumsq", [g], [out], {"partial": partial, "out": out}, {"j": j, "x": x})


def _clip_coef(sq: hl.ImageParam, max_norm: hl.Param) -> hl.Expr:
    """min(1, max_norm / (global norm + 1e-6)) as clip_grad_norm; 1 if max_norm <= 0."""
    rp = hl.RDom([(0, sq.dim(0).extent())], "rp")
    norm = hl.sqrt(hl.sum(sq[rp]))
    return hl.select(max_norm > 0, hl.min(hl.f32(1), max_norm / (norm + hl.f32(1e-6))),
                     hl.f32(1))


def _adam() -> Pipe:
    p, g, m, v, sq = (_f32(s, 1) for s in ("p", "g", "m", "v", "sq"))
    c, e, b1, b2, max_norm = (hl.Param(hl.Float(32), s) for s in ("c", "e", "b1", "b2", "max_norm"))
    i = hl.Var("i")
    gc = g[i] * _clip_coef(sq, max_norm)
    m2 = b1 * m[i] + gc                    # the moments scaled as optim.Adam's slots
    v2 = b2 * v[i] + gc * gc
    update = hl.Func("update")
    update[i] = (p[i] - c * m2 / (hl.sqrt(v2) + e), m2, v2)
    return Pipe("adam", [p, g, m, v, sq, c, e, b1, b2, max_norm], [update],
                {"update": update}, {"i": i})


def _onehot() -> Pipe:
    ids = _dense(hl.ImageParam(hl.Int(32), 1, "ids"))
    v, n = hl.Var("v"), hl.Var("n")
    x = hl.Func("x")
    x[v, n] = hl.select(v == ids[n], hl.f32(1), hl.f32(0))
    return Pipe("onehot", [ids], [x], {"x": x}, {"v": v, "n": n})


def _rows() -> Pipe:
    src = _f32("src", 2)                                    # src(k, r)
    idx = _dense(hl.ImageParam(hl.Int(32), 1, "idx"))       # idx(m)
    k, m = hl.Var("k"), hl.Var("m")
    out = hl.Func("out")
    row = hl.clamp(idx[m], 0, src.dim(1).extent() - 1)
    out[k, m] = hl.select(idx[m] >= 0, src[k, row], hl.f32(0))
    return Pipe("rows", [src, idx], [out], {"out": out}, {"k": k, "m": m})


def _elementwise(kind, op) -> Pipe:
    a, b = _f32("a", 1), _f32("b", 1)
    i = hl.Var("i")
    out = hl.Func("out")
    out[i] = op(a[i], b[i])
    return Pipe(kind, [a, b], [out], {"out": out}, {"i": i})


def _add() -> Pipe:
    return _elementwise("add", lambda a, b: a + b)


def _mul() -> Pipe:
    return _elementwise("mul", lambda a, b: a * b)


def _dropout() -> Pipe:
    key0, key1, threshold = (hl.Param(hl.UInt(32), s) for s in ("key0", "key1", "threshold"))
    scale = hl.Param(hl.Float(32), "scale")
    i = hl.Var("i")
    u = hash32(hl.cast(hl.UInt(32), i), key0, key1, hl.u32)
    out = hl.Func("out")
    out[i] = hl.select((u >> 8) >= threshold, scale, hl.f32(0))
    return Pipe("dropout", [key0, key1, threshold, scale], [out], {"out": out}, {"i": i})


def _sgd() -> Pipe:
    p, g, buf, sq = (_f32(s, 1) for s in ("p", "g", "buf", "sq"))
    lr, momentum, max_norm = (hl.Param(hl.Float(32), s) for s in ("lr", "momentum", "max_norm"))
    i = hl.Var("i")
    b2 = momentum * buf[i] + g[i] * _clip_coef(sq, max_norm)
    update = hl.Func("update")
    update[i] = (p[i] - lr * b2, b2)
    return Pipe("sgd", [p, g, buf, sq, lr, momentum, max_norm], [update],
                {"update": update}, {"i": i})
