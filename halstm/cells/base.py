"""What a recurrent cell provides to the pipeline builder.

A cell is pointwise math only. The pipeline owns the matrix products:

    xp(j, gate, b) = W_ih x + b_ih      (input projection, all steps at once)
    hg(j, gate, b) = W_hh h + b_hh      (recurrent product, per step)

and hands both to the cell, which turns them and the previous states into
new states plus the per-gate values that backward needs ("saved").
Axes are Halide's, innermost first: j = hidden unit, gate, b = batch.
A cell never calls a schedule: intermediate Funcs it creates are inlined
unless a schedule names them through the pipeline's stages.
"""
from __future__ import annotations

import halide as hl


# Halide lowers exp and tanh of float vectors to one libm call per lane;
# fast_exp is a vectorized polynomial (about 2 ulp), valid while its result
# stays a normal float, so arguments past +-80 take the function's limit
# (the LSTM backward step's pointwise stage took 7.9 ms of a 20 ms step at
# deepbench_1024 with libm tanh). NaN passes through, and +-Inf gives the
# exact limits, as in PyTorch: sigmoid(-inf) = 0, so that 0 * inf stays NaN.

def _is_nan(e):
    """NaN test on the bits (exponent all ones, mantissa not zero): Halide
    compiles float arithmetic with LLVM's no-NaN flag, which lets LLVM fold
    a floating-point NaN test of such a result to false."""
    return (hl.reinterpret(hl.UInt(32), e) & 0x7FFFFFFF) > 0x7F800000


def sigmoid(e):
    return hl.select(_is_nan(e), e, e < -80.0, hl.f32(0), e > 80.0, hl.f32(1),
                     1.0 / (1.0 + hl.fast_exp(-e)))


def tanh(e):
    """tanh through one fast exp: 1 - 2 / (1 + exp(2e)); absolute error
    about 1e-7 (relative error grows near 0, where the result is tiny)."""
    return hl.select(_is_nan(e), e, e < -40.0, hl.f32(-1), e > 40.0, hl.f32(1),
                     1.0 - 2.0 / (1.0 + hl.fast_exp(2.0 * e)))


class Cell:
    """Base class: subclasses set the names below and define forward/backward."""

    name: str = ""
    gates: tuple[str, ...] = ()   # row blocks of weight_ih / weight_hh, PyTorch order
    states: tuple[str, ...] = ()  # carried state, "h" first; each (j, b)
    saved: tuple[str, ...] = ()   # channels of the saved Func (j, s, b)
    dxp_is_dhg: bool = False      # backward's dxp and dhg are one Func
    matrix_bias: bool = True      # b_ih and b_hh are parameters (their gradients summed)

    @property
    def n_gates(self) -> int:
        return len(self.gates)

    def saved_channels(self, H: int) -> tuple[str, ...]:
        """The saved channels at H units (their count is the layout's S)."""
        return self.saved

    channels: tuple = ()          # vector parameter channels (name, gate or None); V = len
    reduces: bool = False         # the step reduces over the units (see reductions)
    reductions: list = []         # Funcs over b of the last forward/backward built
    stagings: list = []           # its Funcs over (unit, b) computed once per row, if placed
    saved_levels: list = []       # Funcs (j, channel, b) the saved Func reads (forward)

    def reduction_groups(self) -> list[list]:
        """reductions in groups whose sums read none of each other's
        results, in an order that computes every group after those it reads."""
        return [[f] for f in self.reductions]

    def row_func_groups(self) -> list[list]:
        """Funcs over b of row values (quotients by row values) in groups
        that read none of each other, each group after those it reads."""
        return []

    def staging_groups(self) -> list[list]:
        """stagings in groups that read none of each other, each group after
        those it reads."""
        return [[f] for f in self.stagings]

    def forward(self, xp, hg, prev, vec, H, j, b):
        """xp, hg: Func(j, gate, b); prev: {state: Func(j, b)}; vec:
        Func(j, channel) of the vector parameters; H: units.

        Returns (saved Func(j, s, b), {state: Func(j, b)} new states)."""
        raise NotImplementedError

    def backward(self, saved, prev, new, dnew, vec, H, j, b):
        """Pointwise backward of one step.

        saved: Func(j, s, b); prev/new: {state: Func(j, b)} before/after the
        step; dnew: {state: Func(j, b)} total gradient w.r.t. the new states.
        Returns (dxp, dhg, dprev, dvec): gradients w.r.t. xp and hg as
        Func(j, gate, b) (the same Func when they are equal, as for LSTM),
        {state: Func(j, b) or None}, the pointwise part of each previous
        state's gradient (the pipeline adds W_hh^T dhg to "h"), and the
        vector parameters' per-row gradients Func(j, channel, b) (None
        without vectors)."""
        raise NotImplementedError


def gate_func(name, exprs, j, b):
    """Func(j, gate, b) whose gate-th plane is exprs[gate]."""
    f = hl.Func(name)
    g = hl.Var("gate")
    f[j, g, b] = hl.mux(g, list(exprs))
    return f
