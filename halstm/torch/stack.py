"""A CUDA stack's layers as a wavefront (halstm.wavefront) through torch
streams: one autograd Function for the stack."""
from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from .. import wavefront
from .kernels import _library, _lock
from .layer import _PackKey, _state_grad_keys, _wanted


_wavefront_streams: dict = {}     # device -> torch streams, one a layer
_last_main: dict = {}             # device -> the current stream of its last wavefront


def _lanes(device: torch.device, n: int):
    """The lanes of a wavefront of n layers on `device`: _Lanes on a GPU,
    on a CPU the calls in turn (tests run _Stack there)."""
    return _Lanes(device, n) if device.type == "cuda" else wavefront.InTurn()


class _Lanes:
    """wavefront.Lanes over torch streams of a CUDA `device`, after the
    work queued on torch's current stream and before its next. Each
    layer's call runs with its stream current, so that what the library
    allocates comes from that stream's pool (torch's allocator reuses a
    block in the order of the stream it was made on). Arrays made on the
    current stream before open() are freed only after close(), which
    orders the current stream after every lane: they need no
    record_stream. Arrays the lanes make are read on the current stream
    after close(); a lane reuses their blocks only after a later open(),
    which waits for that wavefront's current stream and for the last one's
    (an array the caller keeps is copied on the current stream:
    _Stack.backward's initial-state gradients)."""

    def __init__(self, device: torch.device, n: int):
        self.device, self.main = device, torch.cuda.current_stream(device)
        with _lock:
            made = _wavefront_streams.setdefault(device, [])
            while len(made) < n:
                made.append(torch.cuda.Stream(device))
            self.streams = made[:n]

    def open(self) -> None:
        last = _last_main.get(self.device)
        for s in self.streams:
            s.wait_stream(self.main)
            if last is not None and last != self.main:
                s.wait_stream(last)

    def chain(self, layer: int, on: int) -> None:
        self.streams[layer].wait_stream(self.streams[on])

    def handle(self, layer: int) -> int:
        return self.streams[layer].cuda_stream

    def on(self, layer: int):
        return torch.cuda.stream(self.streams[layer])

    def close(self) -> None:
        for s in self.streams:
            self.main.wait_stream(s)
        _last_main[self.device] = self.main


class _Stack(torch.autograd.Function):
    """A CUDA stack's layers (one direction, no projection, no batch sizes)
    as a wavefront of n chunks, eagerly: halstm.wavefront, as the numpy
    API's. Inputs x (T, B, K), n, the layers' specs, save, the dropout
    masks between layers (L-1 of (T, B, H), or none), then per layer
    w_ih, b_ih, w_hh, b_hh, vec (or None) and per state its initial (B, H)
    (or None). Outputs y (T, B, H), the last layer's h (a view of its
    states), then per layer each state's final (B, H) (copies). Backward
    runs as a wavefront of the same chunks (wavefront.backward), the
    weight gradients summed over the chunks on the current stream."""

    @staticmethod
    def forward(ctx, x, n, specs, save, masks, *flat):
        L, per = len(specs), len(flat) // len(specs)
        layers = [flat[k * per:(k + 1) * per] for k in range(L)]
        libs = [_library(spec, "fwd", x.device) for spec in specs]
        x = x.contiguous()
        T, B = x.shape[0], x.shape[1]
        fed = [torch.empty_like(m) for m in masks]      # fed[k - 1]: layer k's input, masked

        def feed(k, h, t0, t1):                         # (on layer k's lane)
            return torch.mul(h, masks[k - 1][t0:t1], out=fed[k - 1][t0:t1])
        calls = []
        for k, (w_ih, b_ih, w_hh, b_hh, vec, *init) in enumerate(layers):
            lib, mem = libs[k]
            calls.append(wavefront.forward_call(lib, (w_ih, b_ih, w_hh, b_hh), list(init), save,
                                                vec, mem, _PackKey.of(False, w_ih, w_hh)))
        whole = wavefront.forward(
            calls, x, T, n, lambda k: wavefront.whole_loop(libs[k][0], T, B, save, libs[k][1]),
            _lanes(x.device, L), feed if masks else None)
        ctx.set_materialize_grads(False)
        ctx.specs, ctx.L, ctx.chunks, ctx.masks = specs, L, n, masks
        if save:
            keep = []
            for k, (states, saved) in enumerate(whole):
                w_ih, _, w_hh, _, vec, *_ = layers[k]
                inp = x if k == 0 else fed[k - 1] if masks else whole[k - 1][0][0, 1:]
                keep += [inp, w_ih, w_hh, vec, saved, states]
            ctx.save_for_backward(*keep)
        return (whole[-1][0][0, 1:],
                *[states[s, T].clone() for states, _ in whole for s in range(len(states))])

    @staticmethod
    @once_differentiable
    def backward(ctx, dy, *dfinals):
        L, kept = ctx.L, ctx.saved_tensors
        if not kept:
            raise RuntimeError("halstm: backward through a layer run without saving (save=False)")
        NS = len(dfinals) // L
        x0 = kept[0]
        T, B = x0.shape[0], x0.shape[1]
        libs = [_library(spec, "bwd", x0.device) for spec in ctx.specs]
        if dy is None:                   # (a loss of the finals alone)
            dy = x0.new_zeros((T, B, libs[-1][0].H))
        dy = dy.contiguous()
        calls = []
        for k in range(L):
            x, w_ih, w_hh, vec, saved, states = kept[6 * k:6 * k + 6]
            lib, mem = libs[k]
            own = [None if d is None else d.contiguous() for d in dfinals[k * NS:(k + 1) * NS]]
            calls.append(wavefront.backward_call(lib, (x, states, saved), w_ih, w_hh, vec, dy, own,
                                                 k > 0 or ctx.needs_input_grad[0], mem))
        lanes = _lanes(x0.device, L)
        masks = ctx.masks
        done = wavefront.backward(calls, T, ctx.chunks, lanes,
                                  (lambda k, dx, t0, t1: dx * masks[k][t0:t1]) if masks else None)
        grads = [None] * len(ctx.needs_input_grad)
        for k, chunks in enumerate(done):        # (on the current stream, after every lane)
            g = wavefront.gradients(chunks, torch.add, torch.cat,
                                    k == 0 and ctx.needs_input_grad[0])
            first = 5 + k * (5 + NS)              # (after x, n, specs, save, masks)
            # a lane's array the caller keeps is copied on the current stream:
            # recorded there instead, its block would return to the lane's pool
            # at a time the GPU sets, and the next call's arrays (the keys of
            # the lanes' CUDA graphs) would move
            dinit = [g[name].clone() if ctx.needs_input_grad[first + 5 + s] else None
                     for s, name in enumerate(_state_grad_keys(ctx.specs[k]))]
            grads[first:first + 5 + NS] = [g["dw_ih"], g["db_ih"], g["dw_hh"], g["db_hh"],
                                           g.get("dvec"), *dinit]
            if k == 0:
                grads[0] = g.get("dx")
        return _wanted(ctx, tuple(grads))
