"""Load a compiled halstm library and call it with numpy arrays (CPU
libraries) or halstm.cuda.DeviceArrays (CUDA libraries).

This module owns the numpy <-> Halide axis convention: every array crosses
as a C-contiguous float32 array, and the library's driver views an array
of shape (d0, d1, ..., dn) as a Halide buffer with the axes reversed (dn
innermost, stride 1), e.g. numpy x[t, b, i] is Halide x(i, b, t). A CUDA
library gets device pointers and copies nothing to or from the host.
It never imports halide: a process that only loads cached libraries starts fast.
"""
from __future__ import annotations

import ctypes
import math
import operator
import threading
import weakref
from pathlib import Path

import numpy as np

from . import cache, cublas, memory, openmp
from . import manifest as manifest_schema
from .errors import KernelError, LibraryError

_P = ctypes.c_void_p
_I = ctypes.c_int
FRAMES = 64   # call sizes whose workspaces a library keeps at hand (Library._frames)


def row_lengths(batch_sizes, B: int) -> np.ndarray:
    """Each row's sequence length (B,) from the step batch sizes (T,) of a
    batch sorted longest first (the rows step t runs: batch_sizes[t])."""
    return (np.asarray(batch_sizes)[None, :] > np.arange(B)[:, None]).sum(1)


def step_rows_count(batch_sizes, T: int, B: int, packed: bool) -> int:
    """N, the rows of the arrays over all steps' rows (xp, dxp, dhg; the
    driver's rows.h): T*B, or packed (Library._packed), each step's block
    as large as the step before's (the first: its own)."""
    if not packed:
        return T * B
    return int(batch_sizes[0]) + int(np.sum(batch_sizes[:-1]))


def step_batch_sizes(lengths, T: int) -> np.ndarray:
    """The step batch sizes (T,) of sequences of `lengths` (B,), sorted
    longest first: row_lengths' inverse."""
    return (np.asarray(lengths)[None, :] > np.arange(T)[:, None]).sum(1)


_openmp: tuple[int, ...] | None = None   # share_openmp's
_cpu_libraries = weakref.WeakSet()       # loaded CPU SharedLibrarys


def share_openmp(functions) -> None:
    """CPU libraries, loaded and to come, run their step threads and
    parallel loops on the team of the OpenMP runtime whose openmp.NAMES
    lie at these addresses (openmp.loaded()), from their next call; None:
    on their own threads (the default)."""
    global _openmp
    _openmp = tuple(functions) if functions else None
    for lib in list(_cpu_libraries):
        lib.use_openmp()


def shares_openmp() -> bool:
    """Whether CPU libraries run on a shared OpenMP runtime's team."""
    return _openmp is not None


class SharedLibrary:
    """A loaded libhalstm.so (a layer's, or other kernels linked with the
    driver): its C functions (.lib), where its arrays live (.mem, from
    halstm.memory) and its error reporting (.check)."""

    def __init__(self, path, device: str = "cpu", context: int | None = None):
        self.path, self.device = Path(path), device
        self.lib = ctypes.CDLL(str(path))
        self.lib.halstm_last_error.restype = ctypes.c_char_p
        self.mem = memory.for_device(device)
        if device == "cuda":   # arguments are device pointers in the caller's context
            self.lib.halstm_cuda_init.argtypes = [_P]
            self.lib.halstm_cuda_set_stream.argtypes = [_P]
            # (calls that name no context of their own run in this one:
            # device 0's primary unless given)
            rc = self.lib.halstm_cuda_init(self.mem.context if context is None else context)
            if rc:
                raise KernelError(f"halstm_cuda_init failed with code {rc}")
            hook = getattr(self.lib, "halstm_cuda_set_oom_hook", None)   # (older builds: none)
            if hook is not None:
                from . import cuda      # (imported only where a CUDA library is used)
                hook.argtypes = [_P]
                hook(ctypes.cast(cuda.oom_hook, _P))
        else:
            self.lib.halstm_use_openmp.argtypes = [_P] * len(openmp.NAMES)
            _cpu_libraries.add(self)
            self.use_openmp()

    def use_openmp(self) -> None:
        """A CPU library: share_openmp's runtime from the next call on."""
        self.lib.halstm_use_openmp(*(_openmp or (None,) * len(openmp.NAMES)))

    def check(self, rc: int, what: str) -> None:
        """Raise KernelError naming `what` (and the library's own message)
        if a call returned rc != 0."""
        if rc != 0:
            msg = self.lib.halstm_last_error().decode(errors="replace").strip()
            raise KernelError(f"{what} failed with code {rc}: {msg}")


class Library:
    """One compiled library (one cell, sizes, direction, target, schedule)."""

    def __init__(self, path, manifest: dict | None = None, context: int | None = None):
        """context: a CUDA library's default CUcontext (None: device 0's
        primary); each call runs in its memory's (`mem.context`)."""
        path = Path(path)
        if manifest is None:              # a folder written by `halstm compile`
            manifest = manifest_schema.read(path)
            if manifest["library"] is None:
                raise LibraryError(f"{path}: compiled for {manifest['target']}, which cannot "
                                   f"run here (static libraries only)")
            path = path / manifest["library"]
            if not path.is_file():
                raise LibraryError(f"{path}: missing (named by {path.parent}/manifest.json)")
            if cache.file_sha256(path) != manifest["sha256"]:
                raise LibraryError(f"{path}: damaged: its checksum is not the manifest's; "
                                   f"compile it again (`halstm compile`)")
        self.path, self.manifest = path, manifest
        self.K, self.H = manifest["input_size"], manifest["hidden_size"]
        self.G, self.S = len(manifest["gates"]), len(manifest["saved"])
        self.V = manifest["vectors"]
        self.states = tuple(manifest["states"])
        self.onehot = bool(manifest.get("onehot", False))
        P = self.P = manifest["panel"]
        self.Hp, self.Kp = -(-self.H // P) * P, -(-self.K // P) * P
        self.device = manifest.get("device", "cpu")
        self._shared = SharedLibrary(path, self.device, context)
        self._lib, self.mem = self._shared.lib, self._shared.mem
        self._cuda = self.device == "cuda"
        self._set_call = self._lib.halstm_set_call
        self._set_call.argtypes = [_P, _P, _I, _I]
        self._set_call.restype = None
        self.precision = manifest.get("precision", "fp32")
        if manifest.get("gemm", "halide") == "cublas":
            found = cublas.library()
            if found is None:
                raise KernelError(f"{path}: built with gemm='cublas' (precision "
                                  f"{self.precision!r}), but {cublas.missing_message()}")
            self._lib.halstm_cublas_init.argtypes = [ctypes.c_char_p]
            self._shared.check(self._lib.halstm_cublas_init(found.encode()),
                               f"loading cuBLAS from {found}")
        self._folds = "halstm_step_fold" in manifest["pipelines"]   # (pipeline.FOLD_FWD)
        self._cpu_bf16 = bool(manifest["layout"].get("cpu_bf16"))   # (halstm.bf16)
        if manifest["direction"] == "fwd":
            self._entry = self._lib.halstm_forward
            self._entry.argtypes = [_I, _I] + [_P] * 15
        else:
            self._entry = self._lib.halstm_backward
            self._entry.argtypes = [_I, _I] + [_P] * 23
        # by (memory kind, stream): (pack key, its workspaces) of the last
        # call that packed weights into them (_pack_reused)
        self._packs = {}
        self._entry.restype = _I
        self._ws = {}      # by (memory kind, stream, name)
        # forward's and backward's workspaces and their pointers by
        # (direction, memory kind, stream, T, B, ...): a call of a size seen
        # before reuses them (_frame); emptied whenever _workspace makes an
        # array
        self._frames = {}
        # One call at a time: the workspaces are shared between calls, and
        # ctypes releases the GIL while the library runs.
        self._lock = threading.Lock()

    def _workspace(self, mem, stream, name: str, shape, zeros=False):
        """An array of `mem` that only lives through one call (packed
        weights, the projected inputs, dxp), kept for the next call of the
        same shape on the same stream: fresh ones were faulted in on every
        call (the char LM's backward spent about 15% of its time in page
        faults on the 2-core VM). One per CUDA stream, since calls on two
        streams may run at once (calls on one stream run in turn); a smaller
        one than kept is a view of the kept one's first elements. zeros:
        zero-filled when made (for parts that calls only read; made anew at
        every other shape). A memory
        whose keep_workspaces is False gets fresh ones every call (torch's
        CUDA graphs: memory made while a graph is recorded belongs to its
        pool, and must not outlive the call)."""
        if not mem.keep_workspaces:
            return (mem.zeros if zeros else mem.empty)(tuple(shape))
        key = (mem.kind, stream, name)
        a = self._ws.get(key)
        if a is not None and tuple(a.shape) != tuple(shape) and not zeros:
            n = math.prod(shape)
            if math.prod(a.shape) >= n:
                # a prefix of the larger one: nothing freed while a stream may
                # still use it (halstm.wavefront's last, shorter chunk), the
                # same pointer for the graphs' keys; the larger one is kept
                return a.reshape(-1)[:n].reshape(*shape)
        if a is None or tuple(a.shape) != tuple(shape):
            self._ws.pop(key, None)
            self._frames.clear()
            a = self._ws[key] = (mem.zeros if zeros else mem.empty)(tuple(shape))
        return a

    def _frame(self, key, mem, bs, build) -> tuple:
        """A call's workspaces by name, in the driver's order, and their
        pointers (None where the build has none): those of the last call
        with this key (its direction, memory, stream and size) where
        nothing was made since, without batch sizes and where the memory
        keeps workspaces; else build() (_workspace's arrays), kept for the
        next call of the key, at most FRAMES keys (a size that never grows
        the workspaces gets views of the kept arrays and a frame of its
        own, so that sizes changing call to call would pile them up)."""
        cache = bs is None and mem.keep_workspaces
        found = self._frames.get(key) if cache else None
        if found is None:
            ws = build()
            found = ws, tuple(None if a is None else mem.ptr(a) for a in ws.values())
            if cache:
                if len(self._frames) >= FRAMES:
                    self._frames.clear()
                self._frames[key] = found
        return found

    def _forward_workspaces(self, mem, stream, T: int, B: int, bs, packed: bool) -> tuple:
        """forward's workspaces (wp_ih, wp_hh, xp, x_rows) by _frame."""
        def build():
            K, G, Hp = self.K, self.G, self.Hp
            N = step_rows_count(bs, T, B, packed)
            return {"wp_ih": self._workspace(mem, stream, "wp_ih", self._panels_shape(K)),
                    "wp_hh": self._workspace(mem, stream, "wp_hh", self._panels_shape(self.H)),
                    "xp": self._workspace(mem, stream, "xp", (N, G, Hp)),
                    # x in the steps' rows, or the folded steps' two products
                    "x_rows": (self._workspace(mem, stream, "x_rows",
                                               (N, 1 if self.onehot else K)) if packed
                               else self._workspace(mem, stream, "x_rows", (2, B, G, Hp))
                               if self._folds else None)}
        return self._frame(("fwd", mem.kind, stream, T, B), mem, bs, build)

    def _backward_workspaces(self, mem, stream, T: int, B: int, bs, packed: bool,
                             skip_dx: bool) -> tuple:
        """backward's workspaces (wq_ih, wq_hh, dxp, dhg, fused, dvec_rows,
        rows) by _frame."""
        def build():
            G, H, Hp, Kp, K, V = self.G, self.H, self.Hp, self.Kp, self.K, self.V
            pipelines = self.manifest["pipelines"]
            ws = dict.fromkeys(("wq_ih", "wq_hh", "dxp", "dhg", "fused", "dvec_rows", "rows"))
            if "halstm_step_bwd_fused" in pipelines:   # (driver.cpp halstm_backward)
                ws["fused"] = self._workspace(mem, stream, "fused_bwd",
                                              (3 * B * Hp + 3 * B * G * H + B * V * H,),
                                              zeros=True)
            if "halstm_pack_bwd" in pipelines:   # (else the products read the weights as given)
                # with CPU bf16, wq_hh's panels are followed by W_hh^T's bf16 pair panels
                # over (gate, unit), one "gate" (halstm.bf16)
                wq_hh = ((Hp * G * H + math.prod(self._panels_shape(G * H, gates=1)),)
                         if self._cpu_bf16 else (Hp // self.P, G, H, self.P))
                ws["wq_ih"] = self._workspace(mem, stream, "wq_ih", (Kp // self.P, G, H, self.P))
                ws["wq_hh"] = self._workspace(mem, stream, "wq_hh", wq_hh)
            N = step_rows_count(bs, T, B, packed)
            ws["dxp"] = self._workspace(mem, stream, "dxp", (N, G, H))
            ws["dhg"] = (ws["dxp"] if self.manifest["dxp_is_dhg"] else
                         self._workspace(mem, stream, "dhg", (N, G, H)))
            if V:     # the vector gradients' sums per batch row, two of them
                ws["dvec_rows"] = self._workspace(mem, stream, "dvec_rows", (2, B, V, H))
            if packed:   # x, h_{t-1} and dx in the steps' rows
                ws["rows"] = self._workspace(mem, stream, "rows", (
                    N * ((1 if self.onehot else K) + H + (0 if skip_dx else Kp)),))
            return ws
        return self._frame(("bwd", mem.kind, stream, T, B, skip_dx), mem, bs, build)

    def _pack_reused(self, mem, stream, ws, pack_key) -> bool:
        """Whether this call may skip packing the weights into the workspaces
        ws: pack_key (not None) equals that of the last call that packed into
        these very arrays. Forgets that call's key: _pack_done records this
        one's once it has run."""
        last = self._packs.pop((mem.kind, stream), None)
        return (pack_key is not None and last is not None and last[0] == pack_key
                and len(last[1]) == len(ws) and all(map(operator.is_, last[1], ws)))

    def _pack_done(self, mem, stream, ws, pack_key) -> None:
        if pack_key is not None and mem.keep_workspaces:
            self._packs[(mem.kind, stream)] = (pack_key, tuple(ws))

    @staticmethod
    def _batch_sizes(batch_sizes, T, B):
        """batch_sizes checked: None, or a (T,) int32 numpy array of
        nonincreasing sizes in [1, B] starting at B (sequences sorted by
        length, longest first)."""
        if batch_sizes is None:
            return None
        bs = np.ascontiguousarray(batch_sizes, dtype=np.int32)
        if bs.shape != (T,) or bs[0] != B or bs.min() < 1 or (np.diff(bs) > 0).any():
            raise ValueError(f"batch_sizes: expected ({T},) nonincreasing step batch sizes "
                             f"from {B} down to at least 1 (sequences sorted longest "
                             f"first), got {np.asarray(batch_sizes).tolist()}")
        return bs

    def use_graphs(self, on: bool) -> None:
        """CUDA: run the time loops from captured CUDA graphs (the default
        where the schedule allows it, manifest["cuda_graphs"];
        HALSTM_CUDA_GRAPHS=0 in the environment turns it off) or launch
        every step's kernels directly."""
        self._lib.halstm_cuda_use_graphs(int(bool(on)))

    def graph_stats(self) -> dict:
        """CUDA: how this library's time loops ran so far: from a cached
        graph (replays), captured into a new graph (captures), directly."""
        out = (ctypes.c_longlong * 3)()
        self._lib.halstm_cuda_graph_stats(out)
        return dict(zip(("replays", "captures", "direct"), out))

    def set_num_threads(self, n: int) -> None:
        """Threads for this library's parallel loops and time steps (0:
        HL_NUM_THREADS, else the CPUs this process may use)."""
        self._lib.halstm_set_num_threads(int(n))

    def step_threads(self) -> int:
        """Threads the last time loop's steps ran on, where the driver
        splits steps itself (manifest layout split_steps); else 0."""
        return self._lib.halstm_step_threads()

    def _packed(self, bs) -> bool:
        """Whether the driver keeps the steps' rows packed (rows.h StepRows:
        CPU builds given batch sizes)."""
        return bs is not None and self.device == "cpu"

    def steps_shared(self) -> bool:
        """Whether the last time loop's steps ran on the team of the OpenMP
        runtime that share_openmp named (split_steps builds; else False)."""
        return bool(self._lib.halstm_steps_shared())

    def step_threads_wanted(self) -> int:
        """Threads the last time loop's steps would have run on had every
        CPU been free (their work and parts decide); 0 as step_threads."""
        return self._lib.halstm_step_threads_wanted()

    def _call(self, mem, stream, *args, threads=None, reuse_pack=False) -> None:
        # (the stream is one of mem's device; one settings call, not four)
        self._set_call(mem.context if self._cuda else None, stream, int(threads or 0),
                       reuse_pack)
        rc = self._entry(*args)
        if rc:
            m = self.manifest
            self._shared.check(rc, f"{m['cell']} {m['direction']} kernel "
                                   f"({m['target']}, schedule {m['schedule']})")

    @staticmethod
    def _ptrs(mem, a, n: int) -> ctypes.Array:
        """The driver's per-state arrays: pointers to a[i], i < n, of a list
        of arrays (None: NULL) or of one contiguous (n, ...) array (whose
        views cost microseconds a call on torch tensors)."""
        if isinstance(a, (list, tuple)):
            return (_P * n)(*[None if a[i] is None else mem.ptr(a[i]) for i in range(n)])
        base, step = mem.ptr(a), 4 * math.prod(a.shape[1:])
        return (_P * n)(*[base + i * step for i in range(n)])

    def _out(self, out, bs, save: bool, state_shape: tuple, saved_shape: tuple) -> tuple:
        """forward's `out` checked: (states, saved)."""
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise ValueError(f"out: expected (states, saved), got {type(out).__name__}")
        states, saved = out
        if bs is not None:
            raise ValueError("out: expected None with batch_sizes (the steps' rows then vary)")
        if len(states) != len(self.states) or any(tuple(a.shape) != state_shape
                                                  for a in states):
            raise ValueError(f"out: expected {len(self.states)} states of shape {state_shape}, "
                             f"got {[tuple(a.shape) for a in states]}")
        if save != (saved is not None) or (save and tuple(saved.shape) != saved_shape):
            raise ValueError(f"out: expected saved of shape {saved_shape if save else None}, "
                             f"got {None if saved is None else tuple(saved.shape)}")
        return list(states), saved

    def _initial(self, mem, init, B: int) -> tuple:
        """The initial states (B, H) as the library reads them (contiguous;
        None: zeros), which it copies into states[:, 0]: (those arrays,
        which the call must outlive, the driver's array of their pointers)."""
        if len(init) != len(self.states):
            raise ValueError(f"init: expected {len(self.states)} initial states "
                             f"({', '.join(self.states)}), got {len(init)}")
        arrays = []
        for name, a in zip(self.states, init):
            if a is not None:
                if tuple(a.shape) != (B, self.H):
                    raise ValueError(f"init: expected {name}0 of shape {(B, self.H)}, got "
                                     f"{tuple(a.shape)}")
                a = mem.contiguous(a)
            arrays.append(a)
        return arrays, self._ptrs(mem, arrays, len(arrays))

    def _state_sized(self, mem, a, B: int, what: str):
        """a checked to be (B, H), contiguous (float32 on the host)."""
        if tuple(a.shape) != (B, self.H):
            raise ValueError(f"{what}: expected arrays of shape {(B, self.H)}, got "
                             f"{tuple(a.shape)}")
        return mem.contiguous(a)

    def _finals(self, mem, arrays, bs, B: int) -> ctypes.Array:
        """forward's `finals` checked: the driver's array of their pointers."""
        if bs is not None:
            raise ValueError("finals: expected None with batch_sizes (each row's final "
                             "state is at its own length)")
        if len(arrays) != len(self.states) or any(
                a is not None and tuple(a.shape) != (B, self.H) for a in arrays):
            raise ValueError(f"finals: expected {len(self.states)} arrays (or None) of shape "
                             f"{(B, self.H)}, got "
                             f"{[None if a is None else tuple(a.shape) for a in arrays]}")
        return self._ptrs(mem, arrays, len(arrays))

    def _panels_shape(self, n: int, gates: int | None = None) -> tuple:
        """A packed weight of reduction n and `gates` gates (None: the
        cell's), in float32 elements: (Hp/P, n, G, P), or with precision
        bf16 on a CPU bf16 pair panels (Hp/P, G, NH, P, 2) as (Hp/P, G, NH,
        P) (halstm.bf16)."""
        P, G = self.P, self.G if gates is None else gates
        if self._cpu_bf16:
            return (self.Hp // P, G, -(-n // 32) * 16, P)
        return (self.Hp // P, n, G, P)

    def _x_shape(self, x):
        """(T, B, K) of a layer input: (T, B, K) floats, or for a one-hot
        library (T, B) int32 indices."""
        if self.onehot:
            if x.ndim != 2 or x.dtype != np.int32 or not x.flags.c_contiguous:
                raise ValueError(f"x: expected contiguous (T, B) int32 class indices, got "
                                 f"shape {x.shape} dtype {x.dtype}")
            return x.shape[0], x.shape[1], self.K
        if x.ndim != 3 or x.shape[2] != self.K:
            raise ValueError(f"x: expected (T, B, {self.K}), got {x.shape}")
        return x.shape

    def _x_ptr(self, mem, x) -> int:
        return memory.address(x) if self.onehot else mem.ptr(x)

    def _vec(self, mem, vec):
        """The vector parameters (V, H) checked, or None for a cell without."""
        if not self.V:
            return None
        if vec is None or tuple(vec.shape) != (self.V, self.H):
            raise ValueError(f"vec: expected the vector parameters as one ({self.V}, {self.H}) "
                             f"array, got {None if vec is None else tuple(vec.shape)}")
        return mem.ptr(vec)

    def forward(self, x, w_ih, b_ih, w_hh, b_hh, init, save=True, vec=None, batch_sizes=None,
                mem=None, stream=None, threads=None, pack_key=None, out=None, finals=None):
        """One layer over a sequence. x (T, B, K); weights in PyTorch layout;
        init: one (B, H) array (or None: zeros) per state; vec: the cell's
        vector parameters (V, H), one row per channel (None without).
        Returns (states, saved): states (NS, T+1, B, H), per state its
        initial state at [0]; saved (T, B, S, H) for backward, or None with
        save=False (the steps store nothing else).
        Arrays are numpy for a CPU library, DeviceArrays for a CUDA one, or
        of `mem` where given (halstm.memory's interface, e.g. torch tensors).
        A one-hot library (manifest "onehot") takes x as (T, B) int32 class
        indices in [0, K) instead.
        batch_sizes: None, or (T,) ints, nonincreasing from B: step t runs
        the first batch_sizes[t] rows only (sequences sorted by length,
        longest first); a row's states past its length stay zero.
        stream: a CUDA library's CUstream handle for this call (None: the
        legacy default stream). threads: the most threads this call's
        steps split over (CPU; None: set_num_threads' or the CPUs').
        pack_key: None, or an object whose equality says that w_ih and w_hh
        hold what they held at an earlier call with an equal key (halstm.torch:
        their storages, data pointers and version counters); a call whose
        key equals that of the last call that packed them into this stream's
        workspaces reuses those panels instead of packing again.
        out: None, or (states, saved) to write instead of new arrays (no
        batch_sizes): a list of NS (T+1, B, H) arrays and a (T, B, S, H)
        array (None with save=False); an initial state may be the very
        array states[s][0] (not copied then).
        finals: None, or per state a (B, H) array (None: not wanted) into
        which the call copies that state's final value, states[s][T] (no
        batch_sizes: there each row's final is at its own length)."""
        mem = mem or self.mem
        with self._lock:
            T, B, K = self._x_shape(x)
            bs = self._batch_sizes(batch_sizes, T, B)
            H, S, NS = self.H, self.S, len(self.states)
            packed = self._packed(bs)
            # (packed, the library zeroes the rows past each step's itself)
            if out is None:
                states = (mem.zeros if bs is not None and not packed
                          else mem.empty)((NS, T + 1, B, H))
                saved = mem.empty((T, B, S, H)) if save else None
            else:
                states, saved = self._out(out, bs, save, (T + 1, B, H), (T, B, S, H))
            init, init_ptrs = self._initial(mem, init, B)
            fin_ptrs = None if finals is None else self._finals(mem, finals, bs, B)
            ws, ws_ptrs = self._forward_workspaces(mem, stream, T, B, bs, packed)
            wp = ws["wp_ih"], ws["wp_hh"]
            reuse = self._pack_reused(mem, stream, wp, pack_key)
            self._call(mem, stream, T, B, None if bs is None else bs.ctypes.data,
                       self._x_ptr(mem, x),
                       mem.ptr(w_ih), mem.ptr(b_ih), mem.ptr(w_hh), mem.ptr(b_hh),
                       self._vec(mem, vec), *ws_ptrs,
                       None if saved is None else mem.ptr(saved),
                       self._ptrs(mem, states, NS), init_ptrs, fin_ptrs,
                       threads=threads,
                       reuse_pack=reuse)
            self._pack_done(mem, stream, wp, pack_key)
            return states, saved

    def backward(self, x, w_ih, w_hh, saved, states, dy, dfinal, need_dx=True, vec=None,
                 batch_sizes=None, mem=None, stream=None, threads=None, pack_key=None):
        """BPTT of one layer. states as forward returned them; dy (T, B, H),
        or None: zeros (a loss of the final states alone); dfinal: one
        (B, H) gradient (or None: zeros) per final state; vec, batch_sizes,
        mem, stream, threads and pack_key as forward's (with batch sizes, a row's final-state
        gradient enters at its own last step, and its dy past it is unread).
        Returns dict: dx, dw_ih, db_ih, dw_hh, db_hh, dvec (V, H) for a cell
        with vector parameters, and d<state>0 (B, H).
        need_dx False: no dx in the result, and a CPU library, or a CUDA one
        whose GEMMs are cuBLAS's, skips its GEMM.
        A one-hot library takes x as (T, B) int32 indices and gives no dx."""
        mem = mem or self.mem
        with self._lock:
            T, B, K = self._x_shape(x)
            bs = self._batch_sizes(batch_sizes, T, B)
            G, H, Hp, Kp, V = self.G, self.H, self.Hp, self.Kp, self.V
            if dy is None:   # (read only: zeros kept from call to call)
                dy = self._workspace(mem, stream, "zero_dy", (T, B, H), zeros=True)
            elif tuple(dy.shape) != (T, B, H):
                raise ValueError(f"dy: expected (T, B, {H}) = {(T, B, H)}, got {tuple(dy.shape)}")
            need_dx = need_dx and not self.onehot
            skip_dx = not need_dx and (self.device == "cpu"
                                       or self.manifest.get("gemm") == "cublas")
            packed = self._packed(bs)
            ws, ws_ptrs = self._backward_workspaces(mem, stream, T, B, bs, packed, skip_dx)
            fused, dvec_rows = ws["fused"], ws["dvec_rows"]
            # step t reads a row's state gradient from [(T - 1 - t) & 1], so a
            # row of length n starts from [(T - n) & 1]; the fused step reads
            # step t's dh_add rows from add[(t + 1) & 1]: n's from add[n & 1]
            NS = len(self.states)
            if len(dfinal) != NS:
                raise ValueError(f"dfinal: expected {NS} final-state gradients (or None), got "
                                 f"{len(dfinal)}")
            lengths = None if bs is None else row_lengths(bs, B)
            dfin_ptrs, dfin = None, None
            if lengths is None and (self.device == "cpu" or Hp == H):
                # the driver zeroes dstates and puts the gradients in place
                dstates = mem.empty((NS, 2, B, Hp))
                dfin = [None if d is None else self._state_sized(mem, d, B, "dfinal")
                        for d in dfinal]
                dfin_ptrs = self._ptrs(mem, dfin, NS)
            else:
                add = None   # the fused step's dh_add rows: a row's first call reads zeros or d
                if fused is not None and lengths is not None:
                    add = fused[B * G * H:B * G * H + 2 * B * Hp].reshape(2, B, Hp)
                    mem.zero(add)      # (the last call left its rows there)
                dstates = mem.zeros((NS, 2, B, Hp))   # (one zero-fill for all)
                for s, d in enumerate(dfinal):
                    if d is not None and lengths is None:
                        mem.put_leading(dstates[s][0], d)
                    elif d is not None:
                        mem.scatter_rows(dstates[s], (T - lengths) & 1, d)
                        if add is not None and s == 0:
                            mem.scatter_rows(add, lengths & 1, d)
            wq = ws["wq_ih"], ws["wq_hh"]
            reuse = wq[0] is not None and self._pack_reused(mem, stream, wq, pack_key)
            if bs is not None and not packed:   # rows no step writes enter the sums as zeros
                for a in {id(a): a for a in (ws["dxp"], ws["dhg"])}.values():
                    mem.zero(a)
            if dvec_rows is not None:
                mem.zero(dvec_rows)
            out = {"dx": None if skip_dx else mem.empty((T, B, Kp)), "dw_ih": mem.empty((G * H, K)),
                   "db_ih": mem.empty(G * H), "dw_hh": mem.empty((G * H, H)),
                   "db_hh": mem.empty(G * H), "dvec": mem.empty((V, H)) if V else None}
            self._call(mem, stream, T, B, None if bs is None else bs.ctypes.data,
                       self._x_ptr(mem, x), mem.ptr(w_ih), mem.ptr(w_hh), self._vec(mem, vec),
                       mem.ptr(saved), self._ptrs(mem, states, NS), mem.ptr(dy),
                       self._ptrs(mem, dstates, NS), *ws_ptrs,
                       *[None if a is None else mem.ptr(a) for a in out.values()], dfin_ptrs,
                       threads=threads, reuse_pack=reuse)
            if wq[0] is not None:
                self._pack_done(mem, stream, wq, pack_key)
            if not V:
                del out["dvec"]
            if not need_dx:
                del out["dx"]
            elif Kp != K:
                out["dx"] = mem.leading(out["dx"], K)
            for s, name in enumerate(self.states):   # the driver leaves them in row T & 1
                # (dstates is this call's own: where it has no padding, a view will do)
                a = dstates[s][T & 1]
                out[f"d{name}0"] = a if Hp == H else mem.leading(a, H)
            return out
