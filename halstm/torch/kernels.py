"""halstm.torch's compiled layers, keyed by what they are compiled for
(cell, sizes, schedule, precision, device), and the torch-side plumbing
of a call: tensors as the libraries' arrays, streams, threads."""
from __future__ import annotations

import functools
import math
import os
import threading
import warnings

import numpy as np
import torch
from torch import Tensor

from .. import aot, cells, cuda, memory, openmp, runtime
from ..reference import torch_ops
from ..runtime import Library


class PerformanceWarning(UserWarning):
    """A setting that makes halstm's kernels run slower than they can."""


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
        if self._cpu:     # (a device argument costs a microsecond a call)
            return torch.empty(shape, dtype=torch.float32)
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


def _torch_empty_cache() -> None:
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


# A library's own device allocation (cuBLAS's workspace) that finds no
# memory retries after torch's allocator gives back the blocks it caches.
cuda.on_out_of_memory(_torch_empty_cache)

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
    from .. import bf16
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


def _transformed() -> bool:
    """Whether torch.func transforms (grad, vmap, vjp, jacrev, ...) are
    active: a layer then runs as _FuncLayer, the form torch.func takes."""
    return torch._C._are_functorch_transforms_active()


def _traced() -> bool:
    """Whether the layers run as traced torch ops (torch.compile's custom
    operators, torch.func's Functions) rather than the eager paths' own
    Functions, side streams and numpy row moves."""
    return torch.compiler.is_compiling() or _transformed()
