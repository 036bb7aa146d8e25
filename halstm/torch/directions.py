"""A bidirectional layer's two directions side by side, and the row moves
of packed batches."""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .. import memory, nn
from .kernels import _ints, _library, _traced, _transformed
from .layer import (_check_saved, _library_backward, _library_forward, _state_grad_keys,
                    _wanted)


class _Rows(torch.autograd.Function):
    """Rows moved: out (n, C) with out[dst] = a[src] (None: every row in
    order; distinct indices, numpy), zeros elsewhere; backward the inverse
    move. On the CPU by numpy on the calling thread, where a torch op of
    this size would wake torch's OpenMP threads, which then spin
    (libgomp's default) on the cores halstm's kernel threads need next; on
    a GPU by index_select / index_copy_ (index_select's own backward adds
    rows, index_add, several times slower)."""

    @staticmethod
    def forward(ctx, a, src, dst, n):
        ctx.src, ctx.dst, ctx.rows = src, dst, len(a)
        return _move_rows(a, src, dst, n)

    @staticmethod
    @once_differentiable          # the kernels' backward has no backward
    def backward(ctx, d):
        return _move_rows(d, ctx.dst, ctx.src, ctx.rows), None, None, None


def _move_rows(a: Tensor, src, dst, n: int) -> Tensor:
    if a.device.type != "cpu" or _transformed():
        if src is not None:
            a = a.index_select(0, _ints(src, a.device))
        if dst is None:
            return a
        return a.new_zeros((n, a.shape[1])).index_copy_(0, _ints(dst, a.device), a)
    a = a.detach().numpy()                           # (rows, C)
    if dst is None:
        out = memory.empty((n, a.shape[1]))
        np.take(a, np.arange(len(a)) if src is None else src, axis=0, out=out, mode="clip")
    else:
        out = np.zeros((n, a.shape[1]), np.float32)
        out[dst] = a if src is None else a[src]
    return torch.from_numpy(out)


def _numpy_rows(a: Tensor) -> bool:
    """Whether _reverse moves a's rows by _Rows (CPU, eager; a GPU or
    torch.compile: flip or gather)."""
    return a.device.type == "cpu" and not _traced()


def _lane(spec: str, lane: int) -> str:
    return spec[:spec.rindex("|") + 1] + str(lane)


class _Directions(torch.autograd.Function):
    """Both directions of a CPU layer without a projection, eagerly, in
    one Function, so that nn.run_directions can run them at once in
    forward and in backward (autograd runs a CPU graph's nodes one after
    the other). Inputs: x, x_rev (x reversed in time within each row's
    length), batch_sizes, spec, save, then per direction w_ih, b_ih, w_hh,
    b_hh, vec and its initial states. Outputs: per direction y (T, B, H)
    (the reverse one in x_rev's time order) and saved, then per direction
    its finals (as _Layer's)."""

    @staticmethod
    def forward(ctx, x, x_rev, batch_sizes, spec, save, *flat):
        n = len(flat) // 2
        per = [flat[:n], flat[n:]]          # per direction: w_ih, b_ih, w_hh, b_hh, vec, *init

        def one(d, threads):
            w_ih, b_ih, w_hh, b_hh, vec, *init = per[d]
            return _library_forward((x, x_rev)[d], w_ih, b_ih, w_hh, b_hh, vec, init,
                                    batch_sizes, _lane(spec, d if threads else 0), save,
                                    threads=threads, finals=True)

        (states0, saved0, fin0), (states1, saved1, fin1) = nn.run_directions(
            one, _library(spec, "fwd", x.device)[0])
        if not save:
            saved0 = saved1 = x.new_empty((0,))
        ctx.set_materialize_grads(False)
        ctx.spec, ctx.saved, ctx.states = spec, save, len(states0)
        ctx.save_for_backward(x, x_rev, batch_sizes, states0, saved0, states1, saved1,
                              *[a for d in (0, 1) for a in (per[d][0], per[d][2], per[d][4])])
        ctx.mark_non_differentiable(saved0, saved1)
        return (states0[0, 1:], states1[0, 1:], saved0, saved1, *fin0, *fin1)

    @staticmethod
    @once_differentiable          # the kernels' backward has no backward
    def backward(ctx, dy0, dy1, ds0, ds1, *dfinal):
        _check_saved(ctx)
        x, x_rev, batch_sizes, states0, saved0, states1, saved1, *w = ctx.saved_tensors
        NS = ctx.states
        inputs = [(x, states0, saved0, dy0, dfinal[:NS]), (x_rev, states1, saved1, dy1,
                                                           dfinal[NS:])]

        def one(d, threads):
            inp, states, saved, dy, dfin = inputs[d]
            w_ih, w_hh, vec = w[3 * d:3 * d + 3]
            return _library_backward(inp, w_ih, w_hh, vec, saved, states, dy, list(dfin),
                                     batch_sizes, _lane(ctx.spec, d if threads else 0),
                                     ctx.needs_input_grad[d], threads=threads)

        gs = nn.run_directions(one, _library(ctx.spec, "bwd", x.device)[0])
        keys = _state_grad_keys(ctx.spec)
        out = [g.get("dx") for g in gs] + [None, None, None]
        for g in gs:
            out += [g["dw_ih"], g["db_ih"], g["dw_hh"], g["db_hh"], g.get("dvec"),
                    *[g[k] for k in keys]]
        return _wanted(ctx, tuple(out))
