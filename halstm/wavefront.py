"""The layers of a GPU stack as a wavefront: the time loop in chunks of
steps, each layer on a CUDA stream of its own, layer l's chunk c queued
after layer l-1's chunk c, so that it runs beside layer l-1's chunk c+1.
A step of one layer leaves most of an H100 idle at charrnn_512x2's sizes;
two layers' steps at once fill more of it (bench/RESULTS.md, "Schedule
decisions": `wavefront.chunks`).

Each chunk is one library call that writes its steps' states and saved
values into the whole loop's arrays, its initial state the previous
chunk's last (in place), so the tape is the one of a call over every step.
Backward runs the same way from the last chunk down (backward): a chunk's
call takes the chunk's rows of the tape and the state gradients the chunk
after it left, and gives the chunk's dx and its share of the weight
gradients, which the caller sums.
"""
from __future__ import annotations

import contextlib
import functools
import os
import threading

# A step's product of at most STEP_MACS_PER_SM multiply-adds (B*G*H*H) a
# multiprocessor (2^27 on 132 SMs, the largest measured: it paid there) ...
STEP_MACS_PER_SM = 1 << 20
# ... in chunks of at least CHUNK_MACS multiply-adds of steps' products a
# layer (each chunk is a library call, with its host time and a projection
# GEMM of its own: at 2^25 they still paid, at 2^24.6 not), at most
# MOST_CHUNKS, of equal steps where a count divides T (a chunk's
# workspaces are kept per shape).
CHUNK_MACS = 1 << 25
MOST_CHUNKS = 4
# A library's .so keeps 64 time loops' CUDA graphs (csrc/cuda_graphs.h
# SLOTS), each under its pointers, for every module using it: the chunks
# of the layers that share a library take at most GRAPHS keys a set of
# saved states, a quarter (training alternates two sets).
GRAPHS = 16

_streams: list = []     # one a layer, shared by every module (cuBLAS keeps memory per stream)
_streams_lock = threading.Lock()


def chunks(T: int, B: int, G: int, I: int, H: int, layers: int, sms: int) -> int:
    """How many chunks the time loop of a stack of `layers` layers of
    input size I (the first) and H (the others) takes (1: the layers one
    after the other). HALSTM_WAVEFRONT_CHUNKS in the environment sets it (for
    measuring; 1 turns the wavefront off; a stack of one layer then runs
    in chunks too)."""
    forced = os.environ.get("HALSTM_WAVEFRONT_CHUNKS")
    if forced is not None and forced.strip():
        n = int(forced) if forced.strip().isdigit() else 0
        if n < 1:
            raise ValueError(f"HALSTM_WAVEFRONT_CHUNKS: expected a positive int, got {forced!r}")
        return min(n, T)
    step = B * G * H * H
    if layers < 2 or step > STEP_MACS_PER_SM * sms:
        return 1
    shared = layers - 1 if I != H else layers       # the most layers of one library
    n = min(MOST_CHUNKS, GRAPHS // shared, T * step // CHUNK_MACS, T)
    return next((k for k in range(n, 1, -1) if T % k == 0), n) if n > 1 else 1


def bounds(T: int, n: int) -> list:
    """The first step of each chunk, then T: chunks of ceil(T / n) steps,
    the last the rest (fewer than n where n does not fit T so)."""
    size = -(-T // n)
    return sorted({min(T, size * c) for c in range(n)} | {T})


def streams(n: int) -> list:
    """The first n of the process's wavefront streams (made as needed)."""
    from . import cuda
    with _streams_lock:
        while len(_streams) < n:
            _streams.append(cuda.Stream())
        return _streams[:n]


class Lanes:
    """The streams a wavefront's layers run on, one a layer: halstm.cuda's
    own, after the legacy default stream's work and before its next.
    (halstm.torch's lanes are torch streams, after and before torch's
    current one.)"""

    def __init__(self, n: int):
        self.streams = streams(n)

    def open(self) -> None:
        from . import cuda
        cuda.lanes_open()               # (the pool's blocks: until close)
        for s in self.streams:          # after what the legacy stream has queued (x, init)
            s.after(None)

    def chain(self, layer: int, on: int) -> None:
        """Layer `layer`'s stream after what layer `on`'s has queued so far."""
        self.streams[layer].after(self.streams[on])

    def handle(self, layer: int) -> int:
        return self.streams[layer].handle

    def on(self, layer: int):
        """A context in which layer `layer`'s call runs: the array fills and
        copies a library call makes around its kernels queue on its stream."""
        from . import cuda
        return cuda.on_stream(self.streams[layer].handle)

    def close(self) -> None:            # (the arrays' memory returns to the legacy stream's pool)
        from . import cuda
        waited = False
        try:
            cuda.legacy_after(self.streams)
            waited = True
        finally:
            cuda.lanes_close(waited)


class InTurn:
    """Lanes without streams: the chunks' calls one after the other (a CPU
    stack's, which tests run)."""

    def open(self) -> None:
        pass

    def chain(self, layer: int, on: int) -> None:
        pass

    def handle(self, layer: int) -> None:
        return None

    def on(self, layer: int):
        return contextlib.nullcontext()

    def close(self) -> None:
        pass


def forward(calls, x, T: int, n: int, make, lanes=None, feed=None) -> list:
    """Run a stack's layers in n chunks of T steps. calls[l](inp, init,
    out, stream, pack_key) runs layer l over the steps of inp (init: its
    initial states, None for layer l's own; out: the (states, saved) views
    to write); make(l) returns layer l's whole-loop (states (NS, T+1, B,
    H), saved (T, B, S, H) or None); lanes: the streams (Lanes' interface;
    None: Lanes); feed(l, h, t0, t1), where given, makes layer l's input
    of steps [t0, t1) from layer l-1's h of those steps (h (t1-t0, B, H);
    dropout), on layer l's lane. Returns [(states, saved)] a layer."""
    L = len(calls)
    whole = [make(layer) for layer in range(L)]
    lanes = lanes or Lanes(L)
    key = object()                      # chunks after the first reuse the packed weights
    edges = bounds(T, n)
    try:
        lanes.open()
        for c, (t0, t1) in enumerate(zip(edges, edges[1:])):
            for layer, (states, saved) in enumerate(whole):
                NS = states.shape[0]
                inp = x[t0:t1] if layer == 0 else whole[layer - 1][0][0][t0 + 1:t1 + 1]
                if layer:
                    lanes.chain(layer, layer - 1)
                init = None if c == 0 else [states[s][t0] for s in range(NS)]
                out = ([states[s][t0:t1 + 1] for s in range(NS)],
                       None if saved is None else saved[t0:t1])
                with lanes.on(layer):
                    if layer and feed is not None:
                        inp = feed(layer, inp, t0, t1)
                    calls[layer](inp, init, out, lanes.handle(layer), (key, layer))
    finally:
        lanes.close()
    return whole


def forward_call(lib, weights, init, save: bool, vec, mem=None, pack_key=None):
    """forward()'s calls[l] for a layer of library lib: weights (w_ih,
    b_ih, w_hh, b_hh), init its initial states (its first chunk's), vec,
    mem as Library.forward's; pack_key the caller's (None: the
    wavefront's, one a forward)."""
    def call(inp, first, out, stream, key):
        return lib.forward(inp, *weights, init if first is None else first, save=save, vec=vec,
                           mem=mem, stream=stream, pack_key=pack_key or key, out=out)
    return call


def whole_loop(lib, T: int, B: int, save: bool, mem):
    """forward()'s make(l) for a layer of library lib: its whole loop's
    states (NS, T+1, B, H) and saved (T, B, S, H) (None without save)."""
    return (mem.empty((len(lib.states), T + 1, B, lib.H)),
            mem.empty((T, B, lib.S, lib.H)) if save else None)


def backward_call(lib, tape, w_ih, w_hh, vec, dy, dfinal, need_dx: bool, mem=None):
    """backward()'s calls[l] for a layer of library lib: tape its (x (T, B,
    K), states (NS, T+1, B, H), saved (T, B, S, H)); dy (T, B, H) the
    caller's (read by the top layer's calls); dfinal its final states'
    gradients (its last chunk's); vec, need_dx, mem as Library.backward's."""
    x, states, saved = tape
    NS, names = len(lib.states), [f"d{s}0" for s in lib.states]

    def call(t0, t1, dy_chunk, after, stream, key):
        return lib.backward(x[t0:t1], w_ih, w_hh, saved[t0:t1],
                            [states[s][t0:t1 + 1] for s in range(NS)],
                            dy[t0:t1] if dy_chunk is None else dy_chunk,
                            dfinal if after is None else [after[k] for k in names],
                            need_dx=need_dx, vec=vec, mem=mem, stream=stream, pack_key=key)
    return call


def backward(calls, T: int, n: int, lanes=None, feed=None) -> list:
    """A stack's backward in n chunks of T steps, the top layer's last
    chunk first: calls[l](t0, t1, dy, after, stream, pack_key) runs layer
    l's backward over steps [t0, t1) and returns the library's dict (dy:
    None for the top layer, the caller's; below it the layer above's dx of
    the chunk; after: the dict of layer l's chunk after this one, whose
    d<state>0 are this chunk's final-state gradients, None for the last
    chunk). Layer l's chunk c is queued after layer l+1's chunk c, so that
    it runs beside layer l+1's chunk c-1. Each chunk's dict is kept until
    close() orders the caller's stream after every lane (lanes' interface
    as forward's). feed(l, dx, t0, t1), where given, makes layer l's dy of
    steps [t0, t1) from layer l+1's dx of those steps (dropout's mask), on
    layer l's lane. Returns per layer its chunks' dicts in time order
    (gradients() makes a layer's whole-loop gradients of them)."""
    L = len(calls)
    lanes = lanes or Lanes(L)
    edges = bounds(T, n)
    C = len(edges) - 1
    done = [[None] * C for _ in range(L)]
    key = object()                      # chunks after the first reuse the packed weights
    try:
        lanes.open()
        for c in reversed(range(C)):
            for layer in reversed(range(L)):
                dy = None
                if layer < L - 1:
                    lanes.chain(layer, layer + 1)
                    dy = done[layer + 1][c]["dx"]
                with lanes.on(layer):
                    if dy is not None and feed is not None:
                        dy = feed(layer, dy, edges[c], edges[c + 1])
                    done[layer][c] = calls[layer](edges[c], edges[c + 1], dy,
                                                  done[layer][c + 1] if c < C - 1 else None,
                                                  lanes.handle(layer), (key, layer))
    finally:
        lanes.close()
    return done


def gradients(chunks, add, join, dx: bool) -> dict:
    """One layer's gradients from its chunks' dicts (time order): the
    weight gradients (dw_ih, db_ih, dw_hh, db_hh, dvec) summed by add, the
    initial states' (d<state>0) the first chunk's, and with dx the
    chunks' dx joined along time by join."""
    g = {k: v for k, v in chunks[0].items() if k != "dx"}
    for k in ("dw_ih", "db_ih", "dw_hh", "db_hh", "dvec"):
        if k in g:
            g[k] = functools.reduce(add, [c[k] for c in chunks])
    if dx:
        g["dx"] = join([c["dx"] for c in chunks])
    return g
