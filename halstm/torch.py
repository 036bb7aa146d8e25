"""torch.nn drop-ins running halstm's kernels: LSTM, GRU, RNN and
Recurrent(cell) as torch.nn.Modules with torch.nn's constructor, parameter
names, call and autograd (needs PyTorch: pip install halstm[torch]).

    import halstm.torch as hnn
    lstm = hnn.LSTM(13, 37, num_layers=2, bidirectional=True, dropout=0.1)
    lstm.load_state_dict(torch.nn.LSTM(13, 37, 2, bidirectional=True).state_dict())
    y, (h_n, c_n) = lstm(x)                  # x (T, B, 13) float32, CPU or CUDA
    y.sum().backward()                       # gradients into lstm's parameters

Each layer and direction is one call of a compiled layer: eagerly through a
torch.autograd.Function, under torch.compile as the custom operator
halstm::layer (backward: halstm::layer_backward), so torch.compile(
fullgraph=True) traces through it. Tensors go to the kernels
in place: CPU tensors to the host build, CUDA tensors (device 0) to the
CUDA build, on torch's current stream, with every array from torch's
allocator. Packed sequences run inside the kernels: step t runs only the
sequences longer than t.
"""
from __future__ import annotations

import contextlib
import functools
import math
import os
import threading
import warnings

import numpy as np
import torch
from torch import Tensor
from torch.autograd.function import once_differentiable
from torch.nn.utils import rnn as rnn_utils

from . import aot, cells, cuda, machine, memory, nn, openmp, runtime, wavefront
from .reference import torch_ops
from .runtime import Library, row_lengths

__all__ = ["LSTM", "GRU", "RNN", "Recurrent", "LSTMCell", "GRUCell", "RNNCell",
           "RecurrentCell", "PerformanceWarning"]


class PerformanceWarning(UserWarning):
    """A setting that makes halstm's kernels run slower than they can."""


# ---- the kernels, keyed by what they are compiled for ----------------------

class _Tensors:
    """halstm.memory's interface over torch tensors of one device: the
    library's arrays come from torch's allocator. keep_workspaces False:
    a library's workspaces are made for each call (the custom operators on
    a GPU: torch.compile(mode="reduce-overhead") records them into a CUDA
    graph whose memory pool must not hold arrays kept past a call)."""

    def __init__(self, device: torch.device, keep_workspaces: bool = True):
        self.device, self.kind = device, f"torch:{device}"
        self.keep_workspaces = keep_workspaces
        self._cpu = device.type == "cpu"
        self.context = None if self._cpu else _context(device)

    def empty(self, shape):
        if self._cpu and (shape if isinstance(shape, int) else
                          math.prod(shape)) >= memory.POOL_FROM // 4:
            # numpy's memory (memory.empty): numpy asks the kernel for huge
            # pages for large arrays, torch's CPU allocator does not, and
            # a layer's fresh outputs then cost a page fault every 4 KiB
            # inside the kernels' threads (charrnn_512x2, 16-core Xeon:
            # 350k faults a forward+backward); smaller ones from torch's
            # allocator (64-byte aligned, as memory.empty's)
            return torch.from_numpy(memory.empty(shape))
        return torch.empty(shape, dtype=torch.float32, device=self.device)

    def zeros(self, shape):
        a = self.empty(shape)
        a.zero_()
        return a

    @staticmethod
    def zero(a):
        a.zero_()

    @staticmethod
    def ptr(a) -> int:
        assert a.dtype == torch.float32 and a.is_contiguous(), "kernel arrays: contiguous f32"
        return a.data_ptr()

    @staticmethod
    def contiguous(a):
        return a.contiguous()

    @staticmethod
    def put_leading(dst, src):
        dst[:, :src.shape[-1]] = src

    @staticmethod
    def leading(a, w):
        return a[..., :w].contiguous()

    def scatter_rows(self, dst, slot, src):
        dst[_ints(slot, self.device), _ints(np.arange(len(slot)), self.device),
            :src.shape[-1]] = src


def _context(device: torch.device) -> int:
    """A CUDA device's primary context (torch's own): the kernels' calls
    for its tensors run in it."""
    index = torch.cuda.current_device() if device.index is None else device.index
    return cuda.driver().context_of(index)


_libs: dict = {}
_mems: dict = {}
_lock = threading.Lock()


def _spec(cell: str, K: int, H: int, schedule: str | None, precision: str = "fp32",
          lane: int = 0) -> str:
    """A layer's kernels as a string (what the custom operators take).
    lane: which instance of the library (its own workspaces), so that two
    layers of one size can run at once on two streams."""
    return f"{cell}|{K}|{H}|{schedule or ''}|{precision}|{lane}"


def _unspec(spec: str):
    cell, K, H, schedule, precision, _ = spec.split("|")
    return cell, int(K), int(H), schedule or None, precision


_found: dict = {}    # _library's answers by its arguments


def _library(spec: str, direction: str, device: torch.device,
             per_call: bool = False) -> tuple[Library, _Tensors]:
    """The compiled library of spec for a tensor on `device`, and its memory
    (per_call: whose workspaces are made for each call on a GPU)."""
    key = (spec, direction, device, per_call)
    found = _found.get(key)
    if found is None:
        found = _found[key] = _load(spec, direction, device, per_call)
    if found[1]._cpu and _threads is None:
        _choose_threads()
    return found


def _load(spec: str, direction: str, device: torch.device,
          per_call: bool) -> tuple[Library, _Tensors]:
    cell, K, H, schedule, precision = _unspec(spec)
    if device.type == "cuda":
        target = "host-cuda"
    elif device.type == "cpu":
        target = "host"
    else:
        raise ValueError(f"input: expected a CPU or CUDA tensor, got one on {device}")
    key = (spec, direction, target)
    with _lock:
        if key not in _libs:
            if target == "host":
                precision = _cpu_precision(cell, precision)
            spec = aot.Spec(cell, K, H, direction, target, schedule, precision=precision)
            _libs[key] = Library(*aot.library(spec),
                                 context=None if target == "host" else _context(device))
        kept = not (per_call and device.type == "cuda")
        if (device, kept) not in _mems:
            _mems[device, kept] = _Tensors(device, kept)
        return _libs[key], _mems[device, kept]


def _cpu_precision(cell: str, precision: str) -> str:
    """The precision CPU tensors compute in: "bf16" where asked, the host
    CPU has AMX or AVX512-BF16 and the cell does not reduce over its units;
    else "fp32" (tf32 is a CUDA mode, as torch's allow_tf32 flags are; a
    bf16 this CPU cannot run warns)."""
    if precision != "bf16":
        return "fp32"
    if _cpu_runs_bf16(cell):
        return "bf16"
    why = (f"cell {cell!r} reduces over its units" if _host_bf16()
           else "this CPU has neither AMX nor AVX512-BF16")
    warnings.warn(f"halstm.torch: precision 'bf16' on CPU tensors computes in float32 ({why})",
                  stacklevel=4)
    return "fp32"


def _host_bf16() -> bool:
    """Whether the host CPU has AMX or AVX512-BF16."""
    from . import bf16
    return bf16.host_products() is not None


@torch.compiler.assume_constant_result     # (Dynamo cannot trace halide's calls)
def _cpu_runs_bf16(cell: str) -> bool:
    """Whether CPU tensors of `cell` can run precision "bf16"."""
    return _host_bf16() and not cells.definition(cell).reduces


_threads = None   # _choose_threads' answer: "openmp" or "own"


def _choose_threads() -> None:
    """Once, at the first CPU layer: which threads halstm's CPU kernels run
    their steps and parallel loops on. torch's CPU ops run on an OpenMP
    team whose threads, waiting actively (libgomp's default), spin after
    each parallel op on the cores the kernels need: there the kernels run
    on that team ("openmp", runtime.share_openmp); under
    OMP_WAIT_POLICY=PASSIVE, or with one torch thread, on their own
    ("own"). HALSTM_TORCH_THREADS=openmp|own decides instead. Warns where
    the team is wanted but its runtime cannot be found."""
    global _threads
    wanted = os.environ.get("HALSTM_TORCH_THREADS", "").lower()
    if wanted not in ("", "openmp", "own"):
        raise ValueError(f"HALSTM_TORCH_THREADS: expected 'openmp' or 'own', got {wanted!r}")
    if not wanted:
        spins = (os.environ.get("OMP_WAIT_POLICY", "").upper() != "PASSIVE"
                 and torch.get_num_threads() >= 2
                 and "parallel backend: OpenMP" in torch.__config__.parallel_info())
        wanted = "openmp" if spins else "own"
    functions = None
    if wanted == "openmp":
        here = os.path.dirname(torch.__file__)
        functions = openmp.loaded(prefer=(here, here + ".libs"))
        if functions is None:
            warnings.warn("halstm.torch on the CPU: torch's OpenMP runtime was not found, so "
                          "halstm's kernels run on threads of their own, beside torch's, "
                          "which spin after each torch op (forward+backward measured up to "
                          "2.5x slower on a 16-core CPU; docs/torch.md). Start Python with "
                          "OMP_WAIT_POLICY=PASSIVE, or call torch.set_num_threads(1) if the "
                          "model's torch ops are small.", PerformanceWarning, stacklevel=3)
    runtime.share_openmp(functions)
    _threads = "own" if functions is None else "openmp"


def _to(a: Tensor, device) -> Tensor:
    """A small CPU tensor (indices) on `device` without waiting for the
    device's queued work (a blocking copy would; so may one from pageable
    memory)."""
    if torch.device(device).type != "cuda":
        return a.to(device)
    return a.pin_memory().to(device, non_blocking=True)


def _ints(a, device) -> Tensor:
    """Small integers (a packed batch's index arrays, numpy) as an int64
    tensor on `device` (on a GPU by _uploaded)."""
    a = np.ascontiguousarray(a, dtype=np.int64)
    device = torch.device(device)
    if device.type != "cuda":
        return torch.from_numpy(a)
    return _uploaded(device, a.shape, a.tobytes())


@functools.lru_cache(maxsize=64)
def _uploaded(device: torch.device, shape: tuple, content: bytes) -> Tensor:
    """int64 values (their bytes) on a GPU, each content uploaded once and
    kept (the last 64; read-only): a packed batch's indices recur between
    its forward and backward and from call to call, and each upload costs
    the host tens of microseconds (pinning, copy, launch)."""
    return _to(torch.from_numpy(np.frombuffer(content, dtype=np.int64).reshape(shape).copy()),
               device)


_TorchOps = torch_ops(torch)     # the cell language's operations on tensors
_step_functions: dict = {}       # cell -> its step on tensors (made before torch.compile traces)


def _make_step_function(cell: str) -> None:
    if cell not in _step_functions:
        _step_functions[cell] = cells.definition(cell).step_function(_TorchOps)


_side_streams: dict = {}


def _side_stream(device: torch.device):
    """The stream a bidirectional layer's reverse direction runs on while
    the forward direction runs on the current one: CUDA, eager only (None
    elsewhere)."""
    if device.type != "cuda" or _traced():
        return None
    with _lock:
        if device not in _side_streams:
            _side_streams[device] = torch.cuda.Stream(device)
        return _side_streams[device]


# torch's own accessor of the current stream's handle (Dynamo's too): a
# Stream object costs about 10 us a call on the GPU machine's host
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _stream(device: torch.device):
    if device.type != "cuda":
        return None
    if _raw_stream is not None and device.index is not None:
        return _raw_stream(device.index)
    return torch.cuda.current_stream(device).cuda_stream


def _sizes(spec: str, H: int):
    """(states, saved channels at H units, gate blocks, vector rows) of spec's cell."""
    d = cells.definition(_unspec(spec)[0])
    return (len(d.states), len(d.saved_channels(H)), len(d.gates),
            sum(len(d.gates) if v.per_gate else 1 for v in d.vectors))


# ---- one layer, one direction: the kernels as operators ---------------------
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
    states, saved = _library_forward(x, w_ih, b_ih, w_hh, b_hh, vec, init, batch_sizes, spec,
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
                     per_call=False, threads=None) -> tuple[Tensor, Tensor]:
    """_forward_impl, with saved None where not save; per_call as
    _library's; threads as Library.forward's."""
    lib, mem = _library(spec, "fwd", x.device, per_call)
    bs = None if batch_sizes is None else _host(batch_sizes)
    states, saved = lib.forward(x.contiguous(), w_ih, b_ih, w_hh, b_hh, list(init), save=save,
                                vec=vec, batch_sizes=bs, mem=mem, stream=_stream(x.device),
                                threads=threads, pack_key=_PackKey.of(per_call, w_ih, w_hh))
    return states, saved


def _library_backward(x, w_ih, w_hh, vec, saved, states, dy, dfinal, batch_sizes, spec,
                      need_dx, per_call=False, threads=None) -> dict:
    """BPTT of one layer: the library's gradients (runtime.Library.backward);
    dfinal: per state its final's gradient, or None for none; per_call as
    _library's; threads as Library.backward's."""
    lib, mem = _library(spec, "bwd", x.device, per_call)
    bs = None if batch_sizes is None else _host(batch_sizes)
    if dy is None:                       # (a loss of the finals alone)
        dy = x.new_zeros((states.shape[1] - 1, *states.shape[2:]))
    return lib.backward(x.contiguous(), w_ih, w_hh, saved, states, dy.contiguous(),
                        [None if d is None else d.contiguous() for d in dfinal],
                        need_dx=need_dx, vec=vec, batch_sizes=bs, mem=mem,
                        stream=_stream(x.device), threads=threads,
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


def _state_grad_keys(spec: str) -> list[str]:
    return [f"d{s}0" for s in cells.definition(_unspec(spec)[0]).states]


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
        states, saved = _library_forward(x, w_ih, b_ih, w_hh, b_hh, vec, list(init),
                                         batch_sizes, spec, save)
        saved = x.new_empty((0,)) if saved is None else saved
        ctx.set_materialize_grads(False)
        ctx.spec, ctx.saved = spec, save
        ctx.save_for_backward(x, w_ih, w_hh, vec, saved, states, batch_sizes)
        ctx.mark_non_differentiable(saved)
        return (states[0, 1:], saved, *_finals(states, batch_sizes))

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


# ---- a CUDA stack's layers as a wavefront (halstm.wavefront) ---------------

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
    (a caller that keeps such an array longer records it on its stream:
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
            dinit = [g[n] for n in _state_grad_keys(ctx.specs[k])]
            for a in dinit if x0.device.type == "cuda" else ():
                a.record_stream(lanes.main)  # (a lane's array, kept by the caller)
            first = 5 + k * (5 + NS)              # (after x, n, specs, save, masks)
            grads[first:first + 5 + NS] = [g["dw_ih"], g["db_ih"], g["dw_hh"], g["db_hh"],
                                           g.get("dvec"), *dinit]
            if k == 0:
                grads[0] = g.get("dx")
        return _wanted(ctx, tuple(grads))


def _wanted(ctx, grads: tuple) -> tuple:
    """grads with None for each input that needs none (a None initial
    state, a vec of a cell without vector parameters, an input not
    requiring grad)."""
    return tuple(g if need else None for g, need in zip(grads, ctx.needs_input_grad))


def _transformed() -> bool:
    """Whether torch.func transforms (grad, vmap, vjp, jacrev, ...) are
    active: a layer then runs as _FuncLayer, the form torch.func takes."""
    return torch._C._are_functorch_transforms_active()


def _traced() -> bool:
    """Whether the layers run as traced torch ops (torch.compile's custom
    operators, torch.func's Functions) rather than the eager paths' own
    Functions, side streams and numpy row moves."""
    return torch.compiler.is_compiling() or _transformed()


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
        states, _ = _library_forward(x, w_ih, b_ih, w_hh, b_hh, vec, init, batch_sizes, spec,
                                     False)
        if finals_only and batch_sizes is None:
            T = states.shape[1] - 1
            return None, [states[s, T] for s in range(states.shape[0])]
        return states[0, 1:], _finals(states, batch_sizes)
    y, _, *finals = _Layer.apply(x, w_ih, b_ih, w_hh, b_hh, vec, batch_sizes, spec, save, *init)
    return y, finals


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
                                    threads=threads)

        (states0, saved0), (states1, saved1) = nn.run_directions(
            one, _library(spec, "fwd", x.device)[0])
        if not save:
            saved0 = saved1 = x.new_empty((0,))
        ctx.set_materialize_grads(False)
        ctx.spec, ctx.saved, ctx.states = spec, save, len(states0)
        ctx.save_for_backward(x, x_rev, batch_sizes, states0, saved0, states1, saved1,
                              *[a for d in (0, 1) for a in (per[d][0], per[d][2], per[d][4])])
        ctx.mark_non_differentiable(saved0, saved1)
        return (states0[0, 1:], states1[0, 1:], saved0, saved1,
                *_finals(states0, batch_sizes), *_finals(states1, batch_sizes))

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


# ---- the modules ------------------------------------------------------------

def _check_input(module, x: Tensor) -> Tensor:
    """x checked against the module's parameters (device, dtype); inside a
    torch.autocast region a float16 / bfloat16 x comes back as float32."""
    if not isinstance(x, Tensor):
        raise TypeError(f"input: expected a Tensor or PackedSequence, got {type(x).__name__}")
    if (x.dtype in (torch.float16, torch.bfloat16) and x.device.type in ("cpu", "cuda")
            and torch.is_autocast_enabled(x.device.type)):
        x = x.float()        # autocast: the kernels take float32 (bf16: _call_precision)
    if x.dtype != torch.float32:
        raise TypeError(f"input: halstm's kernels run float32, got {x.dtype} (convert with "
                        f".float())")
    # (a module's own parameters read directly: named_parameters costs
    # microseconds a call, which step-by-step decoding pays every step)
    for name, p in (module.named_parameters() if module._modules else
                    module._parameters.items()):
        if p is None:
            continue
        if p.device != x.device:
            raise ValueError(f"input is on {x.device} but parameter {name} is on "
                             f"{p.device}; move one of them (module.to(device))")
        if p.dtype != torch.float32:
            raise TypeError(f"parameter {name}: halstm's kernels run float32, got {p.dtype} "
                            f"(module.float())")
    return x


def _initialise(params, hidden_size: int, vector_specs) -> None:
    """torch's initialisation of params, (base name, Parameter) pairs (the
    name without a layer suffix): matrices and biases uniform in
    ±1/sqrt(hidden_size); vector parameters as the cell declares."""
    bound = 1.0 / math.sqrt(hidden_size)
    inits = {v.name: v.init for v in vector_specs}
    with torch.no_grad():
        for base, p in params:
            init = inits.get(base, "uniform")
            p.uniform_(-bound, bound) if init == "uniform" else p.fill_(init)


def _not_scriptable(module):
    """torch.jit.script asks each module for a scriptable version first."""
    raise TypeError(f"{type(module).__name__}: halstm.torch layers call their kernels from "
                    f"Python, which TorchScript (torch.jit.script) cannot compile; use "
                    f"torch.compile or torch.export")


class _Recurrent(torch.nn.Module):
    """A stack of layers of one cell with torch.nn.RNNBase's constructor,
    parameters and call."""

    __prepare_scriptable__ = _not_scriptable

    def __init__(self, cell: str, input_size: int, hidden_size: int, num_layers: int = 1,
                 bias: bool = True, batch_first: bool = False, dropout: float = 0.0,
                 bidirectional: bool = False, proj_size: int = 0, device=None, dtype=None,
                 schedule: str | None = None, precision: str = "fp32"):
        super().__init__()
        from halstm import cublas
        if precision not in cublas.PRECISIONS:
            raise ValueError(f"precision: expected one of {cublas.PRECISIONS}, got {precision!r}")
        self.precision = precision
        for name, v in (("input_size", input_size), ("hidden_size", hidden_size),
                        ("num_layers", num_layers)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}: expected a positive int, got {v!r}")
        if not isinstance(dropout, (int, float)) or isinstance(dropout, bool) \
                or not 0 <= dropout <= 1:
            raise ValueError(f"dropout: expected a probability in [0, 1], got {dropout!r}")
        if not isinstance(proj_size, int) or isinstance(proj_size, bool) \
                or not 0 <= proj_size < hidden_size:
            raise ValueError(f"proj_size: expected an int in [0, hidden_size={hidden_size}), "
                             f"got {proj_size!r}")
        if dtype not in (None, torch.float32):
            raise TypeError(f"dtype: halstm's kernels run float32, got {dtype}")
        self.cell = cells.check(cell)
        d = cells.definition(cell)
        self.input_size, self.hidden_size, self.num_layers = input_size, hidden_size, num_layers
        self.bias, self.batch_first, self.dropout = bool(bias), bool(batch_first), float(dropout)
        self.bidirectional, self.proj_size, self.schedule = bool(bidirectional), proj_size, schedule
        if proj_size and d.d_prev["h"] is not None:
            raise ValueError(f"proj_size: cell {cell!r} reads h in its step itself, not only "
                             f"through W_hh h; a projection needs a cell that does not")
        self._states = tuple(d.states)
        _make_step_function(self.cell)
        self._vector_specs = [v for v in d.vectors if self.bias or not v.bias]
        self._all_vectors = d.vectors
        self._matrix_bias = d.matrix_bias
        G, H, D = len(d.gates), hidden_size, 2 if bidirectional else 1
        R = proj_size or H                  # the size of h: the output per direction
        self._gates = G
        self._flat_weights_names = []
        for layer in range(num_layers):
            K = input_size if layer == 0 else R * D
            for sfx in ("", "_reverse")[:D]:
                shapes = {"weight_ih": (G * H, K), "weight_hh": (G * H, R)}
                if self.bias and self._matrix_bias:
                    shapes |= {"bias_ih": (G * H,), "bias_hh": (G * H,)}
                for v in self._vector_specs:
                    shapes[v.name] = ((G if v.per_gate else 1) * H,)
                if proj_size:
                    shapes["weight_hr"] = (R, H)
                for base, shape in shapes.items():
                    name = f"{base}_l{layer}{sfx}"
                    self.register_parameter(name, torch.nn.Parameter(
                        torch.empty(shape, dtype=torch.float32, device=device)))
                    self._flat_weights_names.append(name)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """torch's initialisation (_initialise)."""
        _initialise(((name.rsplit("_l", 1)[0], getattr(self, name))     # (weight_ih_l0 ->
                     for name in self._flat_weights_names),             # weight_ih)
                    self.hidden_size, self._vector_specs)

    def __setstate__(self, state) -> None:     # (torch.load, copy.deepcopy)
        super().__setstate__(state)
        _make_step_function(self.cell)

    def flatten_parameters(self) -> None:
        """torch.nn.RNNBase's: nothing to do (the kernels take the
        parameters as they are)."""

    @property
    def all_weights(self) -> list[list[Tensor]]:
        n = len(self._flat_weights_names) // (self.num_layers * self._directions)
        names = self._flat_weights_names
        return [[getattr(self, k) for k in names[i:i + n]] for i in range(0, len(names), n)]

    @property
    def _directions(self) -> int:
        return 2 if self.bidirectional else 1

    def extra_repr(self) -> str:
        s = f"{self.input_size}, {self.hidden_size}"
        if self.num_layers != 1:
            s += f", num_layers={self.num_layers}"
        for k, default in (("bias", True), ("batch_first", False), ("dropout", 0.0),
                           ("bidirectional", False), ("proj_size", 0)):
            if getattr(self, k) != default:
                s += f", {k}={getattr(self, k)}"
        return s

    # ---- one layer's parameters ------------------------------------------
    def _weights(self, layer: int, sfx: str, zero: Tensor | None):
        """w_ih, b_ih, w_hh, b_hh, vectors {name: (H,) or (G*H,)} (None
        without), w_hr (None without a projection) of a layer and direction
        (_weights_by)."""
        return self._weights_by(lambda name: getattr(self, f"{name}_l{layer}{sfx}", None), zero)

    def _weights_by(self, get, zero: Tensor | None):
        """_weights of parameters get(base name) (None where there is none).
        zero: (G*H,) zeros for the matrix biases they lack (None where they
        have them)."""
        b_ih, b_hh = get("bias_ih"), get("bias_hh")
        vectors = None
        if self._all_vectors:      # a bias left out (bias=False) is zeros
            H = self.hidden_size
            vectors = {v.name: zero.new_zeros(((self._gates if v.per_gate else 1) * H,))
                       if get(v.name) is None else get(v.name) for v in self._all_vectors}
        return (get("weight_ih"), zero if b_ih is None else b_ih, get("weight_hh"),
                zero if b_hh is None else b_hh, vectors, get("weight_hr"))

    def _vec(self, vectors):
        """The vector parameters as one (V, H) tensor (None without)."""
        return None if vectors is None else torch.cat(
            [a.view(-1, self.hidden_size) for a in vectors.values()])

    def _both_directions(self, args, batch_sizes, spec, save):
        """Both directions of a CPU layer without a projection by one
        _Directions call: (y, y_rev), (finals, finals_rev)."""
        flat = [[w_ih, b_ih, w_hh, b_hh, self._vec(vectors), *init_d]
                for _, init_d, (w_ih, b_ih, w_hh, b_hh, vectors, _) in args]
        y0, y1, _, _, *fins = _Directions.apply(args[0][0], args[1][0], batch_sizes, spec, save,
                                                *flat[0], *flat[1])
        NS = len(self._states)
        return (y0, y1), (fins[:NS], fins[NS:])

    def _call_precision(self, device: torch.device) -> str:
        """The precision of a call: the module's, or "bf16" for "fp32"
        inside a torch.autocast(dtype=torch.bfloat16) region where the
        device runs bf16 kernels (CUDA; a CPU with AMX or AVX512-BF16, for
        a cell that does not reduce over its units)."""
        kind = device.type
        if (self.precision == "fp32" and torch.is_autocast_enabled(kind)
                and torch.get_autocast_dtype(kind) == torch.bfloat16
                and (kind == "cuda" or _cpu_runs_bf16(self.cell))):
            return "bf16"
        return self.precision

    def _each_direction(self, args, batch_sizes, save, given, side, precision):
        """Each direction of a layer by its own call (_direction): ys (the
        reverse one in its input's time order) and per direction its
        finals. With a side stream (a CUDA bidirectional layer, eagerly)
        the reverse direction runs on it, with its own library instance
        (lane 1), beside the forward one on the current stream."""
        if side is not None:
            main = torch.cuda.current_stream(args[0][0].device)
            side.wait_stream(main)
        ys, fins = [], []
        for d, (inp, init_d, weights) in enumerate(args):
            beside = side is not None and d == 1
            with torch.cuda.stream(side) if beside else contextlib.nullcontext():
                spec = _spec(self.cell, inp.shape[-1], self.hidden_size, self.schedule,
                             precision, lane=int(beside))
                y, fin = self._direction(inp, init_d, batch_sizes, weights, spec, save, given)
            ys.append(y)
            fins.append(fin)
        if side is not None:     # main reads what side made; side read what main made
            main.wait_stream(side)
            inp, init_d, (*ws, vectors, w_hr) = args[1]
            for a in (inp, *init_d, *ws, *(vectors or {}).values(), w_hr):
                if a is not None:
                    a.record_stream(side)
            for a in (ys[1], *fins[1]):
                a.record_stream(main)
        return ys, fins

    def _direction(self, x, init, batch_sizes, weights, spec, save, given):
        """One layer, one direction over x (T, B, K): y (T, B, R) and each
        state's final (B, R for h, else H).

        With a projection (h = W_hr m, R units), the kernels run the cell
        on m: W_hh h = (W_hh W_hr) m, so the recurrent weight is W_hh W_hr
        (G*H, H), and y = W_hr m over all steps is one product after the
        time loop. A given h_0 has no m: step 0 then runs here, in torch
        (given: hx was passed; without, m_0 = 0 stands for h_0 = 0)."""
        w_ih, b_ih, w_hh, b_hh, vectors, w_hr = weights
        vec = self._vec(vectors)
        if w_hr is None:
            return _run_layer(x, w_ih, b_ih, w_hh, b_hh, vec, init, batch_sizes, spec, save)
        w_m = w_hh @ w_hr
        if not given:      # (init: Nones; m_0 = 0)
            m, finals = _run_layer(x, w_ih, b_ih, w_m, b_hh, vec, init, batch_sizes, spec, save)
        else:
            step = _step_functions[self.cell]
            first = step(x[0] @ w_ih.T + b_ih, init[0] @ w_hh.T + b_hh, init, vectors)
            m, finals = first[0][None], list(first)             # (1, B, H), per state (B, H)
            if len(x) > 1:    # steps 1.. in the kernels, the rows longer than 1 step
                B = len(first[0])
                n = B if batch_sizes is None else int(batch_sizes[1])
                rest, finals = _run_layer(x[1:, :n], w_ih, b_ih, w_m, b_hh, vec,
                                          [a[:n] for a in first],
                                          None if batch_sizes is None else batch_sizes[1:],
                                          spec, save)
                if n < B:           # the rows that ended after step 0
                    rest = torch.cat([rest, rest.new_zeros((len(x) - 1, B - n,
                                                            self.hidden_size))], 1)
                    finals = [torch.cat([f, a[n:]]) for f, a in zip(finals, first)]
                m = torch.cat([m, rest])
        return m @ w_hr.T, [finals[0] @ w_hr.T, *finals[1:]]

    # ---- the call ---------------------------------------------------------
    def _run(self, input, hx):
        """(output, finals: per state (L*D, B, H)) with torch's input forms."""
        if isinstance(input, rnn_utils.PackedSequence):
            return self._run_packed(input, hx)
        input = _check_input(self, input)
        if input.dim() not in (2, 3):
            raise ValueError(f"input: expected a 3-D (seq, batch, input_size) tensor "
                             f"({'batch first' if self.batch_first else 'time first'}) "
                             f"or 2-D unbatched (seq, input_size), got {input.dim()}-D "
                             f"{tuple(input.shape)}")
        unbatched = input.dim() == 2
        x = input.unsqueeze(1) if unbatched else (
            input.transpose(0, 1) if self.batch_first else input)
        if input.shape[-1] != self.input_size or x.shape[0] == 0:
            raise ValueError(f"input: expected input_size {self.input_size} features and at "
                             f"least one time step, got shape {tuple(input.shape)} "
                             f"({'batch first' if self.batch_first else 'time first'})")
        if x.shape[1] == 0:       # an empty batch, as torch.nn: empty outputs
            y, finals = self._empty(x, hx)
        else:
            y, finals = self._layers(x, hx, unbatched)
        if unbatched:
            return y.squeeze(1), [f.squeeze(1) for f in finals]
        return (y.transpose(0, 1) if self.batch_first else y), finals

    @torch.compiler.disable(reason="halstm.torch runs a PackedSequence eagerly: its batch "
                                   "sizes and row indices are host data")
    def _run_packed(self, input, hx):
        """_run of a PackedSequence: its rows scattered into a zero-padded
        (T, B, I) (rows sorted longest first), the output gathered back."""
        rows = _check_input(self, input.data)
        if rows.dim() != 2 or rows.shape[-1] != self.input_size:
            raise ValueError(f"input: expected PackedSequence data (rows, input_size "
                             f"{self.input_size}), got shape {tuple(rows.shape)}")
        bs = input.batch_sizes
        T, B = len(bs), int(bs[0])
        index = self._packed_index(bs)
        move = _move_rows if _transformed() else _Rows.apply   # (torch ops: torch.func)
        x = move(rows, None, index, T * B)
        y, finals = self._layers(x.view(T, B, -1), hx, False, bs, input.sorted_indices)
        data = move(y.reshape(T * B, -1), index, None, len(index))
        out = rnn_utils.PackedSequence(data, input.batch_sizes, input.sorted_indices,
                                       input.unsorted_indices)
        if input.unsorted_indices is not None:
            finals = [f.index_select(1, input.unsorted_indices) for f in finals]
        return out, finals

    def _layers(self, x, hx, unbatched, bs=None, order=None):
        """Every layer and direction over x (T, B, K): y (T, B, D*R) and per
        state its finals (L*D, B, H). bs: a packed batch's step sizes (rows
        sorted longest first; order: the caller's row of each, for hx;
        the callers have checked x's shape)."""
        T, B, _ = x.shape
        L, D, H = self.num_layers, self._directions, self.hidden_size
        lengths = None if bs is None else row_lengths(_host(bs), B)
        batch_sizes = None if bs is None else bs.to(torch.int32)
        init = self._initial(hx, B, unbatched, x)
        if order is not None and hx is not None:    # hx comes in the caller's row order
            init = [s.index_select(1, order) for s in init]
        # (zeros for the matrix biases where the layers lack them)
        zero = (None if getattr(self, "bias_ih_l0", None) is not None
                else x.new_zeros((self._gates * H,)))
        save = torch.is_grad_enabled()
        rev = None if D == 1 else self._reverse_index(T, B, lengths, x.device)
        finals = [[] for _ in self._states]
        side = _side_stream(x.device) if D == 2 else None   # (CUDA, eager)
        precision = self._call_precision(x.device)
        n = self._wavefront_chunks(x, bs)
        if n > 1:
            return self._wavefront(x, init, zero, n, save, precision)
        for layer in range(L):
            # each direction's input, initial states and weights, made on the
            # current stream (a leaf's gradient then comes back on it)
            args = [(x if d == 0 else self._reverse(x, rev), [s[layer * D + d] for s in init],
                     self._weights(layer, sfx, zero)) for d, sfx in enumerate(("", "_reverse")[:D])]
            if D == 2 and x.device.type == "cpu" and not self.proj_size and not _traced():
                spec = _spec(self.cell, x.shape[-1], H, self.schedule, precision)
                ys, fins = self._both_directions(args, batch_sizes, spec, save)
            else:
                ys, fins = self._each_direction(args, batch_sizes, save, hx is not None, side,
                                                precision)
            for fin in fins:
                for s, a in enumerate(fin):
                    finals[s].append(a)
            x = ys[0] if D == 1 else torch.cat([ys[0], self._reverse(ys[1], rev)], -1)
            if self.dropout and self.training and layer < L - 1:
                x = torch.nn.functional.dropout(x, self.dropout, training=True)
        # (one layer and direction: its finals are copies already)
        return x, [torch.stack(f) if len(f) > 1 else f[0].unsqueeze(0) for f in finals]

    def _wavefront_chunks(self, x, bs) -> int:
        """The chunks of a CUDA stack's wavefront (halstm.wavefront; 1: none):
        eagerly, one direction, no projection or batch sizes (as the numpy
        API's, nn.Recurrent._wavefront_chunks)."""
        if (x.device.type != "cuda" or self._directions > 1 or self.proj_size or bs is not None
                or _traced()):
            return 1
        return wavefront.chunks(x.shape[0], x.shape[1], self._gates, self.input_size,
                                self.hidden_size, self.num_layers, machine.gpu_sms())

    def _wavefront(self, x, init, zero, n, save, precision):
        """_layers as a wavefront of n chunks (_Stack): y (T, B, H) and per
        state its finals (L, B, H)."""
        L, H, NS = self.num_layers, self.hidden_size, len(self._states)
        masks = ()                       # (drawn as the layers in turn draw theirs)
        if self.dropout and self.training:
            ones = x.new_ones((x.shape[0], x.shape[1], H), dtype=torch.float32)
            masks = tuple(torch.nn.functional.dropout(ones, self.dropout, training=True)
                          for _ in range(L - 1))
        specs, flat = [], []
        for layer in range(L):
            w_ih, b_ih, w_hh, b_hh, vectors, _ = self._weights(layer, "", zero)
            specs.append(_spec(self.cell, w_ih.shape[1], H, self.schedule, precision))
            flat += [w_ih, b_ih, w_hh, b_hh, self._vec(vectors), *[s[layer] for s in init]]
        y, *finals = _Stack.apply(x, n, tuple(specs), save, masks, *flat)
        return y, [torch.stack(finals[s::NS]) for s in range(NS)]

    @staticmethod
    def _packed_index(batch_sizes) -> np.ndarray:
        """Where each row of a packed sequence's data lies in the padded
        (T*B) rows: data[n] is padded[t, b] at t*B + b (torch's
        pad_packed_sequence copies step by step)."""
        bs = _host(batch_sizes)
        t = np.repeat(np.arange(len(bs)), bs)
        first = np.cumsum(bs) - bs
        return t * bs[0] + np.arange(len(t)) - first[t]

    @staticmethod
    def _reverse_index(T, B, lengths, device):
        """Each sequence reversed within its length (padding stays in
        place): (rows, steps) with rows the source row in (T*B) of each
        row, for _Rows on a CPU, and steps the (T, B) time indices on
        `device` (None: reverse all T steps)."""
        steps = memory.reversed_steps(T, np.full(B, T) if lengths is None else lengths)
        rows = (steps * B + np.arange(B)).reshape(-1)
        return rows, None if lengths is None else _ints(steps, device)

    @staticmethod
    def _reverse(a: Tensor, rev) -> Tensor:
        """a (T, B, C) reversed in time by _reverse_index's rev."""
        rows, steps = rev
        if _numpy_rows(a):
            T, B, C = a.shape
            return _Rows.apply(a.reshape(T * B, C), rows, None, T * B).view(T, B, C)
        if steps is None:
            return a.flip(0)
        return a.gather(0, steps[:, :, None].expand(a.shape)).contiguous()

    def _empty(self, x, hx):
        """_layers of an empty batch x (T, 0, K): y (T, 0, D*R) and per state
        finals (L*D, 0, size), joined to the parameters' graph (zero
        gradients), hx checked."""
        self._initial(hx, 0, False, x)
        LD, R = self.num_layers * self._directions, self.proj_size or self.hidden_size
        anchor = sum(p.flatten()[:1].sum() for p in self.parameters()) * 0.0
        y = x.new_zeros((x.shape[0], 0, self._directions * R)) + anchor
        return y, [x.new_zeros((LD, 0, R if s == "h" else self.hidden_size)) + anchor
                   for s in self._states]

    def _initial(self, hx, B, unbatched, x):
        """Per state an (L*D, B, H) tensor: the caller's; without hx, L*D
        Nones (zeros, which the kernels make in place)."""
        LD, H = self.num_layers * self._directions, self.hidden_size
        n = len(self._states)
        size = {s: self.proj_size or H if s == "h" else H for s in self._states}
        if hx is None:
            return [[None] * LD for _ in self._states]
        given = (hx,) if n == 1 else hx
        if n > 1 and (not isinstance(hx, (tuple, list)) or len(hx) != n):
            raise TypeError(f"hx: expected None or a tuple of {n} tensors "
                            f"({', '.join(s + '_0' for s in self._states)}), got "
                            f"{type(hx).__name__}")
        out = []
        for s, a in zip(self._states, given):
            want = (LD, size[s]) if unbatched else (LD, B, size[s])
            if not isinstance(a, Tensor) or tuple(a.shape) != want:
                raise ValueError(f"hx: expected {s}_0 of shape {want}, got "
                                 f"{tuple(a.shape) if isinstance(a, Tensor) else type(a).__name__}")
            if a.device != x.device or a.dtype != torch.float32:
                raise ValueError(f"hx: {s}_0 is {a.dtype} on {a.device}; expected float32 on "
                                 f"{x.device}, as the input")
            out.append(a.unsqueeze(1) if unbatched else a)
        return out


class LSTM(_Recurrent):
    """torch.nn.LSTM on halstm's kernels: LSTM(input_size, hidden_size,
    num_layers=1, bias=True, batch_first=False, dropout=0.0,
    bidirectional=False, proj_size=0, device=None, dtype=None); a call
    returns output, (h_n, c_n)."""

    def __init__(self, input_size, hidden_size, num_layers=1, bias=True, batch_first=False,
                 dropout=0.0, bidirectional=False, proj_size=0, device=None, dtype=None,
                 schedule=None, precision="fp32"):
        super().__init__("lstm", input_size, hidden_size, num_layers, bias, batch_first,
                         dropout, bidirectional, proj_size, device, dtype, schedule, precision)

    def forward(self, input, hx=None):
        out, (h, c) = self._run(input, hx)
        return out, (h, c)


class GRU(_Recurrent):
    """torch.nn.GRU on halstm's kernels; a call returns output, h_n."""

    def __init__(self, input_size, hidden_size, num_layers=1, bias=True, batch_first=False,
                 dropout=0.0, bidirectional=False, device=None, dtype=None, schedule=None,
                 precision="fp32"):
        super().__init__("gru", input_size, hidden_size, num_layers, bias, batch_first,
                         dropout, bidirectional, 0, device, dtype, schedule, precision)

    def forward(self, input, hx=None):
        out, (h,) = self._run(input, hx)
        return out, h


class RNN(_Recurrent):
    """torch.nn.RNN (nonlinearity "tanh" or "relu") on halstm's kernels; a
    call returns output, h_n."""

    def __init__(self, input_size, hidden_size, num_layers=1, nonlinearity="tanh", bias=True,
                 batch_first=False, dropout=0.0, bidirectional=False, device=None, dtype=None,
                 schedule=None, precision="fp32"):
        if nonlinearity not in ("tanh", "relu"):
            raise ValueError(f"nonlinearity: expected 'tanh' or 'relu', got {nonlinearity!r}")
        self.nonlinearity = nonlinearity
        super().__init__(f"rnn_{nonlinearity}", input_size, hidden_size, num_layers, bias,
                         batch_first, dropout, bidirectional, 0, device, dtype, schedule,
                         precision)

    forward = GRU.forward


class Recurrent(_Recurrent):
    """Any halstm cell (by name, or a definition from halstm.cells.define)
    as a stack of layers with torch.nn.RNNBase's options. Parameters
    weight_ih_l{k}, weight_hh_l{k}, bias_ih_l{k}, bias_hh_l{k} (not for a
    cell defined with matrix_bias=False) and the cell's vector parameters
    <name>_l{k} (with _reverse for the reverse direction); with proj_size,
    weight_hr_l{k} (a cell that reads h only through W_hh h). A call returns
    output, h_n for a one-state cell, else output, (h_n, s2_n, ...)."""

    def __init__(self, cell, input_size, hidden_size, num_layers=1, bias=True,
                 batch_first=False, dropout=0.0, bidirectional=False, proj_size=0, device=None,
                 dtype=None, schedule=None, precision="fp32"):
        if isinstance(cell, cells.Definition):
            cell = cells.register(cell)
        if not isinstance(cell, str):
            raise TypeError(f"cell: expected a cell name or definition, got "
                            f"{type(cell).__name__}")
        super().__init__(cell, input_size, hidden_size, num_layers, bias, batch_first,
                         dropout, bidirectional, proj_size, device, dtype, schedule, precision)

    def forward(self, input, hx=None):
        out, finals = self._run(input, hx)
        return (out, finals[0]) if len(finals) == 1 else (out, tuple(finals))


class _Cell(torch.nn.Module):
    """One step of a cell, torch.nn.LSTMCell-style: parameters weight_ih,
    weight_hh, bias_ih, bias_hh (and the cell's vector parameters by their
    names); input (B, I) or unbatched (I,)."""

    __prepare_scriptable__ = _not_scriptable

    def __init__(self, cell, input_size, hidden_size, bias=True, device=None, dtype=None):
        super().__init__()
        stack = _Recurrent(cell, input_size, hidden_size, 1, bias, device=device, dtype=dtype)
        self.input_size, self.hidden_size, self.bias = input_size, hidden_size, bool(bias)
        for name in stack._flat_weights_names:          # weight_ih_l0 -> weight_ih
            setattr(self, name[:-3], getattr(stack, name))
        stack._parameters.clear()
        object.__setattr__(self, "_stack", stack)       # (its facts only: not a submodule)

    def reset_parameters(self) -> None:
        """torch's initialisation (_initialise), as Recurrent's."""
        _initialise(self.named_parameters(), self.hidden_size, self._stack._vector_specs)

    def extra_repr(self) -> str:
        return f"{self.input_size}, {self.hidden_size}" + ("" if self.bias else ", bias=False")

    def _step(self, input, hx):
        x = _check_input(self, input)
        if x.dim() not in (1, 2) or x.shape[-1] != self.input_size:
            raise ValueError(f"input: expected (batch, {self.input_size}) or unbatched "
                             f"({self.input_size},), got {tuple(x.shape)}")
        unbatched = x.dim() == 1
        x = x.reshape(1, -1, self.input_size)
        B, H, n = x.shape[1], self.hidden_size, len(self._stack._states)
        if hx is None:           # (zeros, which the kernels make in place)
            hx = [None] * n
        else:
            hx = list(hx) if n > 1 else [hx]
            want = (H,) if unbatched else (B, H)
            for s, a in zip(self._stack._states, hx):
                if not isinstance(a, Tensor) or a.shape != want:
                    raise ValueError(f"hx: expected {s} of shape {want}, "
                                     f"got {tuple(getattr(a, 'shape', ()))}")
                if a.device != x.device or a.dtype != torch.float32:
                    raise ValueError(f"hx: {s} is {a.dtype} on {a.device}; expected float32 "
                                     f"on {x.device}, as the input")
            if unbatched:
                hx = [a.reshape(B, H) for a in hx]
        p = self._parameters
        zero = None if "bias_ih" in p else x.new_zeros((self._stack._gates * H,))
        w_ih, b_ih, w_hh, b_hh, vectors, _ = self._stack._weights_by(p.get, zero)
        spec = _spec(self._stack.cell, self.input_size, H, None)
        _, out = _run_layer(x, w_ih, b_ih, w_hh, b_hh, self._stack._vec(vectors), hx, None, spec,
                            torch.is_grad_enabled(), finals_only=True)
        return [o.reshape(H) for o in out] if unbatched else out


class LSTMCell(_Cell):
    """torch.nn.LSTMCell on halstm's kernels: (h', c') = cell(x, (h, c))."""

    def __init__(self, input_size, hidden_size, bias=True, device=None, dtype=None):
        super().__init__("lstm", input_size, hidden_size, bias, device, dtype)

    def forward(self, input, hx=None):
        h, c = self._step(input, hx)
        return h, c


class GRUCell(_Cell):
    """torch.nn.GRUCell on halstm's kernels: h' = cell(x, h)."""

    def __init__(self, input_size, hidden_size, bias=True, device=None, dtype=None):
        super().__init__("gru", input_size, hidden_size, bias, device, dtype)

    def forward(self, input, hx=None):
        return self._step(input, hx)[0]


class RNNCell(_Cell):
    """torch.nn.RNNCell on halstm's kernels: h' = cell(x, h)."""

    def __init__(self, input_size, hidden_size, bias=True, nonlinearity="tanh", device=None,
                 dtype=None):
        if nonlinearity not in ("tanh", "relu"):
            raise ValueError(f"nonlinearity: expected 'tanh' or 'relu', got {nonlinearity!r}")
        self.nonlinearity = nonlinearity
        super().__init__(f"rnn_{nonlinearity}", input_size, hidden_size, bias, device, dtype)

    forward = GRUCell.forward


class RecurrentCell(_Cell):
    """One step of any halstm cell (by name, or a definition from
    halstm.cells.define), for step-by-step decoding: parameters weight_ih,
    weight_hh, bias_ih, bias_hh and the cell's vector parameters, named as
    Recurrent's without the _l0 suffix. A one-state cell: h' = cell(x, h);
    else (h', s2', ...) = cell(x, (h, s2, ...)); hx None: zeros."""

    def __init__(self, cell, input_size, hidden_size, bias=True, device=None, dtype=None):
        if isinstance(cell, cells.Definition):
            cell = cells.register(cell)
        if not isinstance(cell, str):
            raise TypeError(f"cell: expected a cell name or definition, got "
                            f"{type(cell).__name__}")
        super().__init__(cell, input_size, hidden_size, bias, device, dtype)

    def forward(self, input, hx=None):
        out = self._step(input, hx)
        return out[0] if len(out) == 1 else tuple(out)
