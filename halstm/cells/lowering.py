"""A language Definition as a Cell: its step and derived backward as
Halide Funcs (pointwise Exprs, inlined unless a schedule names a stage)."""
from __future__ import annotations

import halide as hl

from .base import Cell, _is_nan, gate_func, sigmoid, tanh
from .language import Definition, Sym


def _relu(v):
    return hl.select(_is_nan(v), v, hl.max(v, 0.0))


_UNARY = {"sigmoid": sigmoid, "tanh": tanh, "relu": _relu, "neg": lambda v: -v,
          "step": lambda v: hl.select(v > 0.0, hl.f32(1), hl.f32(0))}
_BINARY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b,
           "/": lambda a, b: a / b}


def _lower(node: Sym, known, memo: dict):
    """node as an Expr; known(node) gives an Expr for nodes read from a
    buffer or Func (None: compute from the children)."""
    e = memo.get(id(node))
    if e is not None:
        return e
    e = known(node)
    if e is None:
        if node.op == "const":
            e = hl.f32(node.arg)
        elif node.op in _UNARY:
            e = _UNARY[node.op](_lower(node.args[0], known, memo))
        elif node.op in _BINARY:
            e = _BINARY[node.op](*(_lower(a, known, memo) for a in node.args))
        else:
            raise AssertionError(f"no value for {node!r}")
    memo[id(node)] = e
    return e


class DefinedCell(Cell):
    """A Cell whose forward is a Definition's step and whose backward is
    the Definition's derived adjoints."""

    def __init__(self, d: Definition):
        self.d = d
        self.name, self.gates, self.states = d.name, d.gates, d.states
        self.saved, self.dxp_is_dhg = d.saved, d.dxp_is_dhg

    def _leaf(self, xp, hg, prev, j, b):
        gate = {g: k for k, g in enumerate(self.gates)}

        def leaf(n):
            if n.op == "x":
                return xp[j, gate[n.arg], b]
            if n.op == "r":
                return hg[j, gate[n.arg], b]
            if n.op == "s":
                return prev[n.arg][j, b]
            return None
        return leaf

    def forward(self, xp, hg, prev, j, b):
        d, leaf = self.d, self._leaf(xp, hg, prev, j, b)
        memo: dict = {}
        saved = gate_func(f"{d.name}_saved", [_lower(n, leaf, memo) for n in d.saved_nodes],
                          j, b)
        slot = {id(n): k for k, n in enumerate(d.saved_nodes)}

        def known(n):   # the states read the saved values back, as one Func
            return saved[j, slot[id(n)], b] if id(n) in slot else leaf(n)
        memo = {}
        new = {}
        for s in self.states:
            new[s] = hl.Func(f"{d.name}_{s}")
            new[s][j, b] = _lower(d.new[s], known, memo)
        return saved, new

    def backward(self, saved, prev, new, dnew, j, b):
        d = self.d
        slot = {id(n): k for k, n in enumerate(d.saved_nodes)}
        new_node = {id(v): s for s, v in d.new.items()}
        values: dict = {}

        def value(n):          # forward values: saved, new or previous states, else recomputed
            if id(n) in slot:
                return saved[j, slot[id(n)], b]
            if id(n) in new_node:
                return new[new_node[id(n)]][j, b]
            if n.op == "s":
                return prev[n.arg][j, b]
            if n.op in ("x", "r"):
                raise AssertionError(f"{n!r} is needed but not saved")
            return None

        def known(n):
            if n.op == "val":
                return _lower(n.args[0], value, values)
            if n.op == "dnew":
                return dnew[n.arg][j, b]
            return None
        memo: dict = {}

        def lower(adjoint):
            return hl.f32(0) if adjoint is None else _lower(adjoint, known, memo)
        dxp = gate_func(f"{d.name}_dxp", [lower(d.d_x[g]) for g in self.gates], j, b)
        dhg = dxp if d.dxp_is_dhg else gate_func(
            f"{d.name}_dhg", [lower(d.d_r[g]) for g in self.gates], j, b)
        dprev = {}
        for s in self.states:
            if d.d_prev[s] is None and s == "h":   # (the pipeline adds W_hh^T dhg)
                dprev[s] = None
                continue
            dprev[s] = hl.Func(f"{d.name}_d{s}_prev")
            dprev[s][j, b] = lower(d.d_prev[s])
        return dxp, dhg, dprev
