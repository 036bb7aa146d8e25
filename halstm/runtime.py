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
import threading
from pathlib import Path

import numpy as np

from . import cache, memory
from . import manifest as manifest_schema
from .errors import KernelError, LibraryError

_P = ctypes.c_void_p
_I = ctypes.c_int


class SharedLibrary:
    """A loaded libhalstm.so (a layer's, or other kernels linked with the
    driver): its C functions (.lib), where its arrays live (.mem, from
    halstm.memory) and its error reporting (.check)."""

    def __init__(self, path, device: str = "cpu"):
        self.path, self.device = Path(path), device
        self.lib = ctypes.CDLL(str(path))
        self.lib.halstm_last_error.restype = ctypes.c_char_p
        self.mem = memory.for_device(device)
        if device == "cuda":   # arguments are device pointers in the caller's context
            self.lib.halstm_cuda_init.argtypes = [_P]
            rc = self.lib.halstm_cuda_init(self.mem.cuda.driver().context)
            if rc:
                raise KernelError(f"halstm_cuda_init failed with code {rc}")

    def check(self, rc: int, what: str) -> None:
        """Raise KernelError naming `what` (and the library's own message)
        if a call returned rc != 0."""
        if rc != 0:
            msg = self.lib.halstm_last_error().decode(errors="replace").strip()
            raise KernelError(f"{what} failed with code {rc}: {msg}")


class Library:
    """One compiled library (one cell, sizes, direction, target, schedule)."""

    def __init__(self, path, manifest: dict | None = None):
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
        self._shared = SharedLibrary(path, self.device)
        self._lib, self.mem = self._shared.lib, self._shared.mem
        if manifest["direction"] == "fwd":
            self._entry = self._lib.halstm_forward
            self._entry.argtypes = [_I, _I] + [_P] * 11
        else:
            self._entry = self._lib.halstm_backward
            self._entry.argtypes = [_I, _I] + [_P] * 20
        self._entry.restype = _I
        self._ws = {}
        # One call at a time: the workspaces are shared between calls, and
        # ctypes releases the GIL while the library runs.
        self._lock = threading.Lock()

    def _workspace(self, name: str, shape, zeros=False):
        """An array that only lives through one call (packed weights, the
        projected inputs, dxp), kept for the next call of the same shape:
        fresh ones were faulted in on every call (the char LM's backward
        spent about 15% of its time in page faults on the 2-core VM).
        zeros: zero-filled when made (for parts that calls only read)."""
        a = self._ws.get(name)
        if a is None or a.shape != tuple(shape):
            self._ws.pop(name, None)
            a = self._ws[name] = (self.mem.zeros if zeros else self.mem.empty)(tuple(shape))
        return a

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

    def _call(self, *args) -> None:
        m = self.manifest
        self._shared.check(self._entry(*args), f"{m['cell']} {m['direction']} kernel "
                                               f"({m['target']}, schedule {m['schedule']})")

    def _ptrs(self, arrays) -> ctypes.Array:
        return (_P * len(arrays))(*[self.mem.ptr(a) for a in arrays])

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

    def _x_ptr(self, x) -> int:
        return x.ctypes.data if self.onehot else self.mem.ptr(x)

    def _vec(self, vec):
        """The vector parameters (V, H) checked, or None for a cell without."""
        if not self.V:
            return None
        if vec is None or tuple(vec.shape) != (self.V, self.H):
            raise ValueError(f"vec: expected the vector parameters as one ({self.V}, {self.H}) "
                             f"array, got {None if vec is None else tuple(vec.shape)}")
        return self.mem.ptr(vec)

    def forward(self, x, w_ih, b_ih, w_hh, b_hh, init, save=True, vec=None):
        """One layer over a sequence. x (T, B, K); weights in PyTorch layout;
        init: one (B, H) array (or None: zeros) per state; vec: the cell's
        vector parameters (V, H), one row per channel (None without). Returns (states, saved): states
        each (T+1, B, H) with the initial state at [0]; saved (T, B, S, H)
        for backward, or None with save=False (the steps store nothing else).
        Arrays are numpy for a CPU library, DeviceArrays for a CUDA one.
        A one-hot library (manifest "onehot") takes x as (T, B) int32 class
        indices in [0, K) instead."""
        with self._lock:
            T, B, K = self._x_shape(x)
            G, H, S, mem = self.G, self.H, self.S, self.mem
            states = []
            for s0 in init:
                st = mem.empty((T + 1, B, H))
                if s0 is None:
                    mem.zero(st[0])
                else:
                    st[0] = s0
                states.append(st)
            saved = mem.empty((T, B, S, H)) if save else None
            Hp, P = self.Hp, self.P
            ws = [self._workspace("wp_ih", (Hp // P, K, G, P)),
                  self._workspace("wp_hh", (Hp // P, H, G, P)),
                  self._workspace("xp", (T, B, G, Hp))]
            self._call(T, B, self._x_ptr(x), *map(mem.ptr, (w_ih, b_ih, w_hh, b_hh)),
                       self._vec(vec), *map(mem.ptr, ws),
                       None if saved is None else mem.ptr(saved), self._ptrs(states))
            return states, saved

    def backward(self, x, w_ih, w_hh, saved, states, dy, dfinal, need_dx=True, vec=None):
        """BPTT of one layer. dfinal: one (B, H) gradient (or None: zeros) per
        final state; vec as forward's.
        Returns dict: dx, dw_ih, db_ih, dw_hh, db_hh, dvec (V, H) for a cell
        with vector parameters, and d<state>0 (B, H).
        need_dx False: no dx in the result, and a CPU library skips its GEMM.
        A one-hot library takes x as (T, B) int32 indices and gives no dx."""
        with self._lock:
            T, B, K = self._x_shape(x)
            G, H, Hp, Kp, P, mem = self.G, self.H, self.Hp, self.Kp, self.P, self.mem
            if dy.shape != (T, B, H):
                raise ValueError(f"dy: expected (T, B, {H}) = {(T, B, H)}, got {dy.shape}")
            need_dx = need_dx and not self.onehot
            dstate = []
            for d in dfinal:
                a = mem.zeros((2, B, Hp))
                if d is not None:
                    mem.put_leading(a[0], d)
                dstate.append(a)
            ws = [None, None]       # no pack_bwd: the products read the weights as given
            if "halstm_pack_bwd" in self.manifest["pipelines"]:
                ws = [self._workspace("wq_ih", (Kp // P, G, H, P)),
                      self._workspace("wq_hh", (Hp // P, G, H, P))]
            dxp = self._workspace("dxp", (T, B, G, H))
            dhg = dxp if self.manifest["dxp_is_dhg"] else self._workspace("dhg", (T, B, G, H))
            fused = None       # the fused backward step's workspace (driver.cpp halstm_backward)
            if "halstm_step_bwd_fused" in self.manifest["pipelines"]:
                fused = self._workspace("fused_bwd", (3 * B * Hp + 3 * B * G * H
                                                      + B * self.V * H,), zeros=True)
            vec_ptr = self._vec(vec)
            dvec_rows = self._workspace("dvec_rows", (T, B, self.V, H)) if self.V else None
            skip_dx = not need_dx and self.device == "cpu"
            out = {"dx": None if skip_dx else mem.empty((T, B, Kp)), "dw_ih": mem.empty((G * H, K)),
                   "db_ih": mem.empty(G * H), "dw_hh": mem.empty((G * H, H)),
                   "db_hh": mem.empty(G * H), "dvec": mem.empty((self.V, H)) if self.V else None}
            self._call(T, B, self._x_ptr(x), *map(mem.ptr, (w_ih, w_hh)), vec_ptr,
                       mem.ptr(saved), self._ptrs(states), mem.ptr(dy), self._ptrs(dstate),
                       *[None if a is None else mem.ptr(a) for a in (*ws, dxp, dhg, fused,
                                                                     dvec_rows, *out.values())])
            if not self.V:
                del out["dvec"]
            if not need_dx:
                del out["dx"]
            elif Kp != K:
                out["dx"] = mem.leading(out["dx"], K)
            for s, a in zip(self.states, dstate):   # the driver leaves them in row T & 1
                # (a is this call's own: where it has no padding, a view will do)
                out[f"d{s}0"] = a[T & 1] if Hp == H else mem.leading(a[T & 1], H)
            return out
