"""One layer, one direction: the kernels as torch operators (eagerly a
torch.autograd.Function, under torch.compile custom operators, under
torch.func Functions with vmap rules)."""
from __future__ import annotations

import functools

import numpy as np
import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .. import cells
from ..runtime import row_lengths
from .kernels import _ints, _library, _sizes, _stream, _transformed, _unspec


# Eagerly, a layer is a torch.autograd.Function (_Layer); under torch.compile
# it is the custom operator halstm::layer, whose backward is the custom
# operator halstm::layer_backward. Both call the same two functions; the
# Function's dispatch costs less (a custom operator's is about 0.4 ms a
# forward and backward in Python).

def _forward_impl(x: Tensor, w_ih: Tensor, b_ih: Tensor, w_hh: Tensor, b_hh: Tensor,
                  vec: Tensor | None, init: list[Tensor], batch_sizes: Tensor | None, spec: str,
                  save: bool) -> tuple[Tensor, Tensor]:
    """x (T, B, K) -> states (NS, T+1, B, H) (initial states at [:, 0]),
    saved (T, B, S, H) for backward (save), else (0,). (The custom
    operator's: workspaces per call.)"""
    states, saved, _ = _library_forward(x, w_ih, b_ih, w_hh, b_hh, vec, init, batch_sizes, spec,
                                        save, per_call=True)
    return states, x.new_empty((0,)) if saved is None else saved


class _PackKey:
    """What a library's packed weights were packed from (runtime's
    pack_key): each weight's storage, data pointer, shape, strides and
    version counter. The storages are held, so that their memory cannot
    come back as another tensor's at the same address; a change in place
    bumps the version (optimizers, load_state_dict, copy_ under no_grad),
    except one made through `.data`, which torch does not count."""
    __slots__ = ("facts", "storages")

    def __init__(self, w_ih: Tensor, w_hh: Tensor):
        self.facts = (w_ih.data_ptr(), w_ih.shape, w_ih.stride(), w_ih._version,
                      w_hh.data_ptr(), w_hh.shape, w_hh.stride(), w_hh._version)
        self.storages = (w_ih.untyped_storage(), w_hh.untyped_storage())

    def __eq__(self, other) -> bool:
        return isinstance(other, _PackKey) and other.facts == self.facts

    @classmethod
    def of(cls, per_call: bool, w_ih: Tensor, w_hh: Tensor):
        """A key for an eager call's weights; None for a custom operator's
        call (workspaces per call) or tensors without version counters
        (made in inference mode)."""
        if per_call or w_ih.is_inference() or w_hh.is_inference():
            return None
        return cls(w_ih, w_hh)


def _library_forward(x, w_ih, b_ih, w_hh, b_hh, vec, init, batch_sizes, spec, save,
                     per_call=False, threads=None, finals=False) -> tuple:
    """_forward_impl, with saved None where not save, and with `finals`
    each state's final (B, H) (_finals'; without batch sizes, new tensors
    the library copies them into, not a torch op each), else None.
    per_call as _library's; threads as Library.forward's."""
    device = x.device
    lib, mem = _library(spec, "fwd", device, per_call)
    bs = None if batch_sizes is None else _host(batch_sizes)
    fin = None
    if finals and bs is None:
        fin = [mem.empty((x.shape[1], lib.H)) for _ in lib.states]
    states, saved = lib.forward(x.contiguous(), w_ih, b_ih, w_hh, b_hh, list(init), save=save,
                                vec=vec, batch_sizes=bs, mem=mem, stream=_stream(device),
                                threads=threads, pack_key=_PackKey.of(per_call, w_ih, w_hh),
                                finals=fin)
    if finals and fin is None:      # (batch sizes: each row's own last step)
        fin = _finals(states, batch_sizes)
    return states, saved, fin


def _library_backward(x, w_ih, w_hh, vec, saved, states, dy, dfinal, batch_sizes, spec,
                      need_dx, per_call=False, threads=None) -> dict:
    """BPTT of one layer: the library's gradients (runtime.Library.backward);
    dfinal: per state its final's gradient, or None for none; per_call as
    _library's; threads as Library.backward's."""
    device = x.device
    lib, mem = _library(spec, "bwd", device, per_call)
    bs = None if batch_sizes is None else _host(batch_sizes)
    return lib.backward(x.contiguous(), w_ih, w_hh, saved, states,
                        None if dy is None else dy.contiguous(),   # (None: a loss of the finals)
                        list(dfinal),
                        need_dx=need_dx, vec=vec, batch_sizes=bs, mem=mem,
                        stream=_stream(device), threads=threads,
                        pack_key=_PackKey.of(per_call, w_ih, w_hh))


def _backward_impl(x: Tensor, w_ih: Tensor, w_hh: Tensor, vec: Tensor | None, saved: Tensor,
                   states: Tensor, dy: Tensor, dfinal: list[Tensor],
                   batch_sizes: Tensor | None, spec: str,
                   need_dx: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """BPTT of one layer: dx (T, B, K) (need_dx, else (0,)), dw_ih, db_ih,
    dw_hh, db_hh, dvec (V, H) (or (0,)), dinit (NS, B, H)."""
    g = _library_backward(x, w_ih, w_hh, vec, saved, states, dy, dfinal, batch_sizes, spec,
                          need_dx, per_call=True)
    dinit = torch.stack([g[k] for k in _state_grad_keys(spec)])
    return (g["dx"] if need_dx else x.new_empty((0,)), g["dw_ih"], g["db_ih"], g["dw_hh"],
            g["db_hh"], g["dvec"] if "dvec" in g else x.new_empty((0,)), dinit)


@functools.lru_cache(maxsize=None)
def _state_grad_keys(spec: str) -> tuple[str, ...]:
    return tuple(f"d{s}0" for s in cells.definition(_unspec(spec)[0]).states)


def _host(a: Tensor) -> np.ndarray:
    """A small CPU tensor of host data (batch sizes) as numpy; under
    torch.func transforms by its values (there torch refuses .numpy())."""
    return np.asarray(a.tolist()) if _transformed() else a.numpy()


def _finals(states: Tensor, batch_sizes: Tensor | None) -> list[Tensor]:
    """Each state's final (B, H) from states (NS, T+1, B, H): after the last
    step, or with batch sizes after each row's own last step. Copies, so
    that a caller may change them in place (as torch.nn's h_n, c_n)."""
    T = states.shape[1] - 1
    if batch_sizes is None:
        return [states[s, T].clone() for s in range(len(states))]
    steps, rows = _row_ends(batch_sizes, states.shape[2], states.device)
    return [states[s][steps, rows] for s in range(len(states))]


def _row_ends(batch_sizes: Tensor, B: int, device) -> tuple[Tensor, Tensor]:
    """Indices (step, row) on `device` of each of the B rows' state after
    its own last step, into arrays over (T+1, B, ...): a packed batch's
    finals (_finals) and their gradients (_grads)."""
    return _ints(row_lengths(_host(batch_sizes), B), device), _ints(np.arange(B), device)


_layer = torch.library.custom_op("halstm::layer", _forward_impl, mutates_args=())
_layer_backward = torch.library.custom_op("halstm::layer_backward", _backward_impl,
                                          mutates_args=())


@_layer.register_fake
def _(x, w_ih, b_ih, w_hh, b_hh, vec, init, batch_sizes, spec, save):
    H = w_hh.shape[1]
    NS, S, _, _ = _sizes(spec, H)
    T, B, _ = x.shape
    return x.new_empty((NS, T + 1, B, H)), x.new_empty((T, B, S, H) if save else (0,))


@_layer_backward.register_fake
def _(x, w_ih, w_hh, vec, saved, states, dy, dfinal, batch_sizes, spec, need_dx):
    H = w_hh.shape[1]
    NS, _, G, V = _sizes(spec, H)
    T, B, K = x.shape
    return (x.new_empty((T, B, K) if need_dx else (0,)), x.new_empty((G * H, K)),
            x.new_empty((G * H,)), x.new_empty((G * H, H)), x.new_empty((G * H,)),
            x.new_empty((V, H) if V else (0,)), x.new_empty((NS, B, H)))


def _check_saved(ctx) -> None:
    if not ctx.saved:
        raise RuntimeError("halstm: backward through a layer run without saving (save=False)")


def _grads(ctx, dstates, backward):
    """The gradients of a layer's inputs from those of its states (NS, T+1,
    B, H): y is states[0, 1:], the final states are states[:, T] (or at
    each row's length) and states[:, 0] is the initial state, so every
    gradient lands in dstates. h's final
    gradient is part of dy at the row's last step; the other states' are
    read where each row ends. Returns (dx or None, dw_ih, db_ih, dw_hh,
    db_hh, dvec or None, dinit (NS, B, H))."""
    _check_saved(ctx)
    x, w_ih, w_hh, vec, saved, states, batch_sizes = ctx.saved_tensors
    T, B = x.shape[0], x.shape[1]
    if batch_sizes is None:
        ends = [dstates[s, T] for s in range(1, len(dstates))]
    else:
        steps, rows = _row_ends(batch_sizes, B, dstates.device)
        ends = [dstates[s][steps, rows] for s in range(1, len(dstates))]
    dfinal = [torch.zeros_like(dstates[0, 0])] + ends
    need_dx = ctx.needs_input_grad[0]
    dx, dw_ih, db_ih, dw_hh, db_hh, dvec, dinit = backward(
        x, w_ih, w_hh, vec, saved, states, dstates[0, 1:], dfinal, batch_sizes, ctx.spec,
        need_dx)
    return (dx if need_dx else None, dw_ih, db_ih, dw_hh, db_hh,
            dvec if vec is not None else None, dinit + dstates[:, 0])   # (states[:, 0] is init)


def _setup_context(ctx, inputs, output):
    x, w_ih, _, w_hh, _, vec, init, batch_sizes, spec, save = inputs
    ctx.spec, ctx.saved = spec, save
    ctx.save_for_backward(x, w_ih, w_hh, vec, output[1], output[0], batch_sizes)


def _op_backward(ctx, dstates, dsaved):
    *g, dinit = _grads(ctx, dstates, _layer_backward)
    return (*g, list(dinit.unbind(0)), None, None, None)


_layer.register_autograd(_op_backward, setup_context=_setup_context)


class _Layer(torch.autograd.Function):
    """One layer, one direction, eagerly: outputs y (T, B, H) (a view of the
    kernels' states), saved (for backward) and each state's final (B, H).
    Backward gets only the gradients the loss made (None for the others)
    and hands them to the library as they are: dy, and each final's, which
    the library adds at each row's last step. The finals are copies, and
    may be changed in place; y, where autograd records it, may not (torch
    raises at once; torch.nn's LSTM keeps y for backward and raises at
    backward()); under torch.no_grad it may."""

    @staticmethod
    def forward(ctx, x, w_ih, b_ih, w_hh, b_hh, vec, batch_sizes, spec, save, *init):
        states, saved, finals = _library_forward(x, w_ih, b_ih, w_hh, b_hh, vec, list(init),
                                                 batch_sizes, spec, save, finals=True)
        saved = x.new_empty((0,)) if saved is None else saved
        ctx.set_materialize_grads(False)
        ctx.spec, ctx.saved = spec, save
        ctx.save_for_backward(x, w_ih, w_hh, vec, saved, states, batch_sizes)
        ctx.mark_non_differentiable(saved)
        return (states[0, 1:], saved, *finals)

    @staticmethod
    @once_differentiable          # the kernels' backward has no backward
    def backward(ctx, dy, dsaved, *dfinal):
        _check_saved(ctx)
        x, w_ih, w_hh, vec, saved, states, batch_sizes = ctx.saved_tensors
        need_dx = ctx.needs_input_grad[0]
        g = _library_backward(x, w_ih, w_hh, vec, saved, states, dy, list(dfinal), batch_sizes,
                              ctx.spec, need_dx)
        return _wanted(ctx, (g.get("dx"), g["dw_ih"], g["db_ih"], g["dw_hh"], g["db_hh"],
                             g.get("dvec"), None, None, None,
                             *[g[k] for k in _state_grad_keys(ctx.spec)]))


def _wanted(ctx, grads: tuple) -> tuple:
    """grads with None for each input that needs none (a None initial
    state, a vec of a cell without vector parameters, an input not
    requiring grad)."""
    return tuple(g if need else None for g, need in zip(grads, ctx.needs_input_grad))


def _each_slice(apply, info, in_dims, args):
    """A vmap rule: `apply` on each slice of the vmapped dimension in turn,
    its outputs stacked along dimension 0."""
    outs = [apply(*[a if d is None else a.select(d, i).contiguous()
                    for a, d in zip(args, in_dims)]) for i in range(info.batch_size)]
    return tuple(torch.stack(o) for o in zip(*outs)), (0,) * len(outs[0])


def _rows_folded(a, d, V: int, lead: int):
    """a's vmapped dimension d (None: a is the same for all V) merged into
    its batch rows, which follow `lead` leading dimensions: (..., B, ...)
    -> (..., V*B, ...), row v*B + b."""
    if d is None:
        a = a.unsqueeze(lead).expand(*a.shape[:lead], V, *a.shape[lead:])
    else:
        a = a.movedim(d, lead)
    return a.reshape(*a.shape[:lead], -1, *a.shape[lead + 2:])


def _layer_vmap(info, in_dims, *args):
    """_FuncLayer's vmap rule. Where only the input and the initial states
    are vmapped (not the weights) and the batch is not packed, the V
    slices' rows run as one batch of V*B rows, one call; else each slice
    in turn."""
    x, w_ih, b_ih, w_hh, b_hh, vec, batch_sizes, spec, save, *init = args
    if any(d is not None for d in in_dims[1:6]) or batch_sizes is not None:
        return _each_slice(_FuncLayer.apply, info, in_dims, args)
    V = info.batch_size
    B = [n for i, n in enumerate(x.shape) if i != in_dims[0]][1]   # (x's logical (T, B, K))
    init = [None if a is None else _rows_folded(a, d, V, 0) for a, d in zip(init, in_dims[9:])]
    states, saved = _FuncLayer.apply(_rows_folded(x, in_dims[0], V, 1), w_ih, b_ih, w_hh, b_hh,
                                     vec, None, spec, save, *init)
    states = states.unflatten(2, (V, B))                     # (NS, T+1, V, B, H)
    if not save:
        return (states, saved), (2, None)
    return (states, saved.unflatten(1, (V, B))), (2, 1)      # (T, V, B, S, H)


class _FuncBackward(torch.autograd.Function):
    """_backward_impl as a Function torch.func can vmap (per-sample
    gradients: vmap(grad(f))); it has no backward of its own."""

    @staticmethod
    def forward(x, w_ih, w_hh, vec, saved, states, dy, batch_sizes, spec, need_dx, *dfinal):
        return _backward_impl(x, w_ih, w_hh, vec, saved, states, dy, list(dfinal), batch_sizes,
                              spec, need_dx)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError("halstm: a layer's gradient has no gradient of its own "
                           "(torch.func: first-order transforms only)")

    @staticmethod
    def vmap(info, in_dims, *args):
        return _each_slice(_FuncBackward.apply, info, in_dims, args)


class _FuncLayer(torch.autograd.Function):
    """One layer, one direction, under torch.func transforms: the custom
    operator's outputs, states (NS, T+1, B, H) and saved, in the form
    torch.func takes (setup_context; vmap: _layer_vmap). Reverse mode only
    (grad, vjp, jacrev)."""

    @staticmethod
    def forward(x, w_ih, b_ih, w_hh, b_hh, vec, batch_sizes, spec, save, *init):
        return _forward_impl(x, w_ih, b_ih, w_hh, b_hh, vec, list(init), batch_sizes, spec, save)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, w_ih, _, w_hh, _, vec, batch_sizes, spec, save, *_ = inputs
        ctx.spec, ctx.saved = spec, save
        ctx.mark_non_differentiable(output[1])
        ctx.save_for_backward(x, w_ih, w_hh, vec, output[1], output[0], batch_sizes)

    @staticmethod
    def backward(ctx, dstates, dsaved):
        *g, dinit = _grads(ctx, dstates, _func_backward)
        return _wanted(ctx, (*g, None, None, None, *dinit.unbind(0)))

    vmap = staticmethod(_layer_vmap)


def _func_backward(x, w_ih, w_hh, vec, saved, states, dy, dfinal, batch_sizes, spec, need_dx):
    return _FuncBackward.apply(x, w_ih, w_hh, vec, saved, states, dy, batch_sizes, spec,
                               need_dx, *dfinal)


def _run_layer(x, w_ih, b_ih, w_hh, b_hh, vec, init, batch_sizes, spec, save,
               finals_only=False):
    """One layer over x (see _forward_impl): y (T, B, H) and each state's
    final (B, H) (at each row's length, with batch sizes). finals_only: the
    caller keeps only the finals (y None; without a graph, the finals are
    views of the states array, which nothing else holds)."""
    if torch.compiler.is_compiling():
        init = [x.new_zeros((x.shape[1], w_hh.shape[1])) if a is None else a for a in init]
        states = _layer(x, w_ih, b_ih, w_hh, b_hh, vec, init, batch_sizes, spec, save)[0]
        return states[0, 1:], _finals(states, batch_sizes)
    if _transformed():
        states = _FuncLayer.apply(x, w_ih, b_ih, w_hh, b_hh, vec, batch_sizes, spec, save,
                                  *init)[0]
        return states[0, 1:], _finals(states, batch_sizes)
    if not torch.is_grad_enabled():     # no graph to record: the kernels directly
        views = finals_only and batch_sizes is None    # (the finals as views of the states)
        states, _, finals = _library_forward(x, w_ih, b_ih, w_hh, b_hh, vec, init, batch_sizes,
                                             spec, False, finals=not views)
        if views:
            return None, states[:, states.shape[1] - 1].unbind(0)
        return states[0, 1:], finals
    y, _, *finals = _Layer.apply(x, w_ih, b_ih, w_hh, b_hh, vec, batch_sizes, spec, save, *init)
    return y, finals
