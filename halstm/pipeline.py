"""One recurrent layer over a sequence, as Halide pipelines built from a cell.

A layer runs as a few pipelines that the compiled library's driver
(aot.py) calls; the time loop lives in that C++ driver, never in Python:

    forward:   pack  (once)   PyTorch weights -> transposed panels
               proj  (once)   xp = W_ih x + b_ih for all T steps (one GEMM)
               step  (T times) hg = W_hh h + b_hh, then the cell
    backward:  step_bwd (T times, reversed)  cell backward, dh_prev = W_hh^T dhg
               grads (once)   dx, dW_ih, db_ih, dW_hh, db_hh over all steps

Axes are Halide's, innermost first; the numpy shape of the same buffer is
the reverse (runtime.py owns that convention). K = the layer's input size,
H = hidden size, G = the cell's gate count, S = its saved channel count.
T and B are runtime values: one library serves every sequence length and
batch. Stages are named so that schedules can find them (Pipe.stage).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import halide as hl

from .cells.base import Cell

KINDS = ("pack", "proj", "step", "step_bwd", "grads")
FORWARD = ("pack", "proj", "step")
BACKWARD = ("step_bwd", "grads")


@dataclass
class Pipe:
    """A built pipeline: its arguments in C ABI order and its named stages."""

    kind: str
    cell: Cell
    K: int
    H: int
    inputs: list = field(default_factory=list)   # ImageParams, argument order
    outputs: list = field(default_factory=list)  # Funcs, argument order
    stages: dict = field(default_factory=dict)   # name -> Func
    vars: dict = field(default_factory=dict)     # name -> Var
    rdoms: dict = field(default_factory=dict)    # name -> RDom

    @property
    def G(self) -> int:
        return self.cell.n_gates

    def stage(self, name: str) -> hl.Func:
        try:
            return self.stages[name]
        except KeyError:
            raise KeyError(f"pipeline {self.kind!r} has no stage {name!r}; "
                           f"it has {sorted(self.stages)}") from None

    def pipeline(self) -> hl.Pipeline:
        return hl.Pipeline(self.outputs)


def _param(name: str, extents) -> hl.ImageParam:
    """A float32 input. extents: innermost first; an int fixes that extent
    (and the stride of the next dense dimension), None leaves it free."""
    p = hl.ImageParam(hl.Float(32), len(extents), name)
    stride = 1
    for d, e in enumerate(extents):
        if stride is not None:
            p.dim(d).set_stride(stride)
        if e is None:
            stride = None
        else:
            p.dim(d).set_bounds(0, e)
            stride = stride * e if stride is not None else None
    return p


def _fix_output(f: hl.Func, extents) -> None:
    """Constrain an output buffer like _param constrains an input."""
    buf = f.output_buffer()
    stride = 1
    for d, e in enumerate(extents):
        if stride is not None:
            buf.dim(d).set_stride(stride)
        if e is None:
            stride = None
        else:
            buf.dim(d).set_bounds(0, e)
            stride = stride * e if stride is not None else None


def _output(f: hl.Func) -> hl.Func:
    """A copy of f to be the pipeline's output, so that no stage reads an
    output buffer: Halide 21 assumes such reads are vector-aligned (as for
    its own allocations) and emitted aligned AVX-512 loads that faulted on a
    numpy-owned buffer (seen at H=32)."""
    out = hl.Func(f.name() + "_out")
    out[f.args()] = f[f.args()]
    return out


def _clamp_b(p: hl.ImageParam, bdim: int) -> hl.Func:
    """p with its batch index clamped into range, so that a schedule may
    round batch loops up without reading out of bounds."""
    f = hl.Func(p.name() + "_in")
    args = [hl.Var(f"a{d}") for d in range(p.dimensions())]
    idx = list(args)
    idx[bdim] = hl.clamp(args[bdim], 0, p.dim(bdim).extent() - 1)
    f[args] = p[idx]
    return f


def _matmul(name, args, init, term):
    """A sum as two stages: `name_acc` (init, then += term() over the RDom
    inside term) and `name`, a copy of it, so that a schedule can keep a tile
    of the accumulator in registers and store it once."""
    acc = hl.Func(name + "_acc")
    acc[args] = init
    acc[args] += term()
    out = hl.Func(name)
    out[args] = acc[args]
    return acc, out


def build(cell: Cell, kind: str, K: int, H: int) -> Pipe:
    """Build pipeline `kind` (one of KINDS) for `cell` with input size K."""
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")
    p = Pipe(kind, cell, K, H)
    p.vars = {n: hl.Var(n) for n in ("i", "j", "k", "gate", "s", "b", "t")}
    globals()["_" + kind](p)
    return p


def _pack(p: Pipe) -> None:
    j, k, gate = p.vars["j"], p.vars["k"], p.vars["gate"]
    G, K, H = p.G, p.K, p.H
    w_ih = _param("w_ih", [K, H, G])      # numpy (G*H, K): PyTorch weight_ih
    w_hh = _param("w_hh", [H, H, G])      # numpy (G*H, H): PyTorch weight_hh
    wih_t = hl.Func("wih_t")              # numpy (K, G, H)
    wih_t[j, gate, k] = w_ih[k, j, gate]
    whh_t = hl.Func("whh_t")              # numpy (H, G, H)
    whh_t[j, gate, k] = w_hh[k, j, gate]
    p.inputs = [w_ih, w_hh]
    p.outputs = [wih_t, whh_t]
    _fix_output(wih_t, [H, G, K])
    _fix_output(whh_t, [H, G, H])
    p.stages = {"wih_t": wih_t, "whh_t": whh_t}


def _proj(p: Pipe) -> None:
    j, gate, b, t = (p.vars[n] for n in ("j", "gate", "b", "t"))
    G, K, H = p.G, p.K, p.H
    x = _param("x", [K, None, None])          # numpy (T, B, K)
    wih_t = _param("wih_t", [H, G, K])        # numpy (K, G, H)
    b_ih = _param("b_ih", [H, G])             # numpy (G, H)
    r = hl.RDom([(0, K)], "r_i")
    xin = _clamp_b(x, 1)
    xp_acc, xp = _matmul("xp", [j, gate, b, t], b_ih[j, gate],   # numpy (T, B, G, H)
                         lambda: wih_t[j, gate, r.x] * xin[r.x, b, t])
    p.inputs = [x, wih_t, b_ih]
    p.outputs = [xp]
    _fix_output(xp, [H, G, None, None])
    p.stages = {"xp_acc": xp_acc, "xp": xp}
    p.rdoms = {"i": r}


def _step(p: Pipe) -> None:
    cell, G, H = p.cell, p.G, p.H
    j, k, gate, b = (p.vars[n] for n in ("j", "k", "gate", "b"))
    xp = _param("xp", [H, G, None])                  # numpy (B, G, H): xp[t]
    whh_t = _param("whh_t", [H, G, H])               # numpy (H, G, H)
    b_hh = _param("b_hh", [H, G])                    # numpy (G, H)
    prev = {s: _param(s + "_prev", [H, None]) for s in cell.states}  # (B, H)
    prev_in = {s: _clamp_b(q, 1) for s, q in prev.items()}
    r = hl.RDom([(0, H)], "r_k")
    hg_acc, hg = _matmul("hg", [j, gate, b], b_hh[j, gate],      # numpy (B, G, H)
                         lambda: whh_t[j, gate, r.x] * prev_in["h"][r.x, b])
    saved, new = cell.forward(_clamp_b(xp, 2), hg, prev_in, j, b)
    p.inputs = [xp, whh_t, b_hh] + [prev[s] for s in cell.states]
    outs = {"saved": saved, **{"new_" + s: new[s] for s in cell.states}}
    p.stages = {"hg_acc": hg_acc, "hg": hg, **outs}
    p.stages |= {n + "_out": _output(f) for n, f in outs.items()}
    p.outputs = [p.stages[n + "_out"] for n in outs]          # (B, S, H), (B, H)...
    _fix_output(p.outputs[0], [H, len(cell.saved), None])
    for f in p.outputs[1:]:
        _fix_output(f, [H, None])
    p.rdoms = {"k": r}


def _step_bwd(p: Pipe) -> None:
    cell, G, H = p.cell, p.G, p.H
    j, k, b = p.vars["j"], p.vars["k"], p.vars["b"]
    S = len(cell.saved)
    saved = _param("saved", [H, S, None])            # numpy (B, S, H): saved[t]
    prev = {s: _param(s + "_prev", [H, None]) for s in cell.states}
    new = {s: _param(s + "_new", [H, None]) for s in cell.states}
    dy = _param("dy", [H, None])                     # numpy (B, H): dy[t]
    dnext = {s: _param("d" + s + "_next", [H, None]) for s in cell.states}
    w_hh = _param("w_hh", [H, H, G])                 # numpy (G*H, H): PyTorch
    ins = {s: _clamp_b(q, 1) for s, q in [*prev.items()]}
    dnew = {}
    for s in cell.states:
        f = hl.Func("d" + s + "_new")
        dn = _clamp_b(dnext[s], 1)
        f[j, b] = dn[j, b] + (_clamp_b(dy, 1)[j, b] if s == "h" else 0.0)
        dnew[s] = f
    dxp, dhg, dprev = cell.backward(_clamp_b(saved, 2), ins,
                                    {s: _clamp_b(q, 1) for s, q in new.items()},
                                    dnew, j, b)
    r = hl.RDom([(0, H), (0, G)], "r_jg")
    init = dprev["h"][k, b] if dprev["h"] is not None else hl.f32(0)
    dh_acc, dh_prev = _matmul("dh_prev", [k, b], init,             # numpy (B, H)
                              lambda: w_hh[k, r.x, r.y] * dhg[r.x, r.y, b])
    dprev = {**dprev, "h": dh_prev}
    p.inputs = ([saved] + [prev[s] for s in cell.states] + [new[s] for s in cell.states]
                + [dy] + [dnext[s] for s in cell.states] + [w_hh])
    assert (dhg is dxp) == cell.dxp_is_dhg, "cell.dxp_is_dhg disagrees with its backward"
    p.stages = {"dxp": dxp, "dhg": dhg, "dh_prev_acc": dh_acc, "dxp_out": _output(dxp),
                **{"dprev_" + s: dprev[s] for s in cell.states}}
    if not cell.dxp_is_dhg:
        p.stages["dhg_out"] = _output(dhg)
    p.outputs = ([p.stages["dxp_out"]] + ([] if cell.dxp_is_dhg else [p.stages["dhg_out"]])
                 + [dprev[s] for s in cell.states])
    for f in p.outputs:
        _fix_output(f, [H, G, None] if f.dimensions() == 3 else [H, None])
    p.rdoms = {"jg": r}


def _grads(p: Pipe) -> None:
    cell, G, K, H = p.cell, p.G, p.K, p.H
    i, j, k, gate, b, t = (p.vars[n] for n in ("i", "j", "k", "gate", "b", "t"))
    x = _param("x", [K, None, None])                 # numpy (T, B, K)
    hs = _param("hs", [H, None, None])               # numpy (T+1, B, H): h_{t-1} at [t]
    dxp = _param("dxp", [H, G, None, None])          # numpy (T, B, G, H)
    shared = cell.dxp_is_dhg
    dhg = dxp if shared else _param("dhg", [H, G, None, None])
    w_ih = _param("w_ih", [K, H, G])                 # numpy (G*H, K): PyTorch
    B, T = x.dim(1).extent(), x.dim(2).extent()
    rn = hl.RDom([(0, B), (0, T)], "r_bt")
    rg = hl.RDom([(0, H), (0, G)], "r_jg")
    zero = hl.f32(0)
    stages = {}
    for name, args, term in [
        ("dx", [i, b, t], lambda: w_ih[i, rg.x, rg.y] * dxp[rg.x, rg.y, b, t]),      # (T, B, K)
        ("dw_ih", [i, j, gate], lambda: dxp[j, gate, rn.x, rn.y] * x[i, rn.x, rn.y]),  # (G*H, K)
        ("db_ih", [j, gate], lambda: dxp[j, gate, rn.x, rn.y]),                      # (G*H,)
        ("dw_hh", [k, j, gate], lambda: dhg[j, gate, rn.x, rn.y] * hs[k, rn.x, rn.y]),  # (G*H, H)
        ("db_hh", [j, gate], lambda: dhg[j, gate, rn.x, rn.y]),                      # (G*H,)
    ]:
        stages[name + "_acc"], stages[name] = _matmul(name, args, zero, term)
    p.inputs = [x, hs, dxp] + ([] if shared else [dhg]) + [w_ih]
    p.outputs = [stages[n] for n in ("dx", "dw_ih", "db_ih", "dw_hh", "db_hh")]
    for f, ext in zip(p.outputs, ([K, None, None], [K, H, G], [H, G], [H, H, G], [H, G])):
        _fix_output(f, ext)
    p.stages = stages
    p.rdoms = {"bt": rn, "jg": rg}

