"""The char LM's head and optimizer pipelines, and the modules' array
operations on a GPU (halstm/model/kernels.py),
compiled ahead of time into one library per target and cached on disk like
the recurrent layers' (halstm.cache): the same cache folder, lock, checksum
and driver (halstm.driver.Model), so that a CUDA build takes
device pointers (halstm.cuda.DeviceArray) and copies nothing to the host.

    k = kernels("host-cuda")                  # built on first use, then cached
    loss, dw, db, dy = k.head(y, w, b, targets, scale)
    k.sumsq(g, sq[i:i + 1]); k.adam(p, g, m, v, sq, c, e, b1, b2, max_norm)
    x = k.onehot(k.targets(ids), V)           # (N, V) one-hot rows
    out = k.rows(src, k.targets(idx)); k.add(a, b); k.mul(a, b)   # array operations

Arrays are numpy (CPU targets) or DeviceArrays (CUDA), float32, C-contiguous;
targets int32 (numpy, uploaded on a CUDA target).
"""
from __future__ import annotations

import ctypes
import time
from functools import lru_cache
from pathlib import Path

import numpy as np

from .. import aot, cache, cuda, driver, schedules
from ..errors import CompileError
from ..runtime import SharedLibrary

FORMAT = "halstm-model-kernels/3"
_HERE = Path(__file__).resolve().parent
_P, _I, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float


def code_files() -> list[Path]:
    """The sources that decide the kernels' code."""
    sdir = Path(schedules.__file__).parent
    return [_HERE / "kernels.py", _HERE / "library.py", _HERE.parent / "dropout.py",
            sdir / "cpu.py", sdir / "cuda.py",
            *map(Path, (driver.__file__, *driver.sources()))]


def build(target: str, out: Path) -> dict:
    """Compile every kernels.KINDS pipeline for target into out/libhalstm.so
    with the driver; writes out/manifest.json last."""
    import halide as hl
    from . import kernels
    start = time.perf_counter()
    t = hl.Target(target)
    if not aot.loadable_here(t):
        raise CompileError(f"model kernels: code for target {t} cannot run on this machine")
    module = schedules.for_target(t)     # the family default defines the kernels' schedules
    lowered = t.with_feature(hl.TargetFeature.NoRuntime)
    objects = []
    try:
        for kind in kernels.KINDS:
            p = kernels.build(kind)
            getattr(module, kind)(p, t)
            args = [hl.Argument(a) for a in p.args]
            p.pipeline().compile_to({hl.OutputFileType.object: str(out / f"{kind}.o")}, args,
                                    f"halstm_model_{kind}", lowered)
            objects.append(out / f"{kind}.o")
        hl.compile_standalone_runtime(str(out / "runtime.o"), t)
        objects.append(out / "runtime.o")
    except Exception as e:   # Halide raises HalideError, RuntimeError and others
        raise CompileError(f"Halide failed to compile the char LM's head and optimizer "
                           f"for target {t}:\n{e}") from e
    on_gpu = t.has_feature(hl.TargetFeature.CUDA)
    res = driver.link(driver.Model(cuda=on_gpu), objects, out / aot.LIBRARY)
    if res.returncode != 0:
        raise CompileError(f"linking the char LM's kernels for {t} failed:\n"
                           f"{' '.join(res.args)}\n{res.stderr}")
    for o in objects:
        o.unlink()
    manifest = {"format": FORMAT, "target": str(t), "device": "cuda" if on_gpu else "cpu",
                "pipelines": [f"halstm_model_{k}" for k in kernels.KINDS],
                "halide_version": cache.halide_version(),
                "code": cache.source_hash(code_files()),
                "library": aot.LIBRARY, "sha256": cache.file_sha256(out / aot.LIBRARY),
                "compile_seconds": round(time.perf_counter() - start, 3)}
    cache.write_manifest(out, manifest)
    return manifest


def library(target: str) -> tuple[Path, dict]:
    """The cached library for target (built first if missing or damaged)."""
    target = cuda.host_target(target)
    key = cache.key({"code": cache.source_hash(code_files()), "format": FORMAT}, target,
                    prefix="model-")
    return cache.entry(key, FORMAT, lambda folder: build(target, folder))


class Kernels:
    """The loaded library of one target; see the module docstring."""

    def __init__(self, target: str):
        path, self.manifest = library(target)
        self.target = target
        self.on_gpu = self.manifest["device"] == "cuda"
        self._shared = SharedLibrary(path, self.manifest["device"])
        self._lib, self.mem = self._shared.lib, self._shared.mem
        L = self._lib
        L.halstm_head.argtypes = [_I, _I, _I, _P, _P, _P, _P, _F, _P, _P, _P, _P]
        L.halstm_sumsq.argtypes = [_I, _P, _P]
        L.halstm_adam.argtypes = [_I, _P, _P, _P, _P, _I, _P, _F, _F, _F, _F, _F]
        L.halstm_sgd.argtypes = [_I, _P, _P, _P, _I, _P, _F, _F, _F]
        L.halstm_onehot.argtypes = [_I, _I, _P, _P]
        L.halstm_rows.argtypes = [_I, _I, _I, _P, _P, _P]
        L.halstm_add.argtypes = L.halstm_mul.argtypes = [_I, _P, _P, _P]
        L.halstm_dropout.argtypes = [_I, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_uint32, _F,
                                     _P]

    def _call(self, name, *args):
        if self.on_gpu:     # (a wavefront's lane inside cuda.on_stream, else the legacy stream)
            self._lib.halstm_cuda_set_stream(cuda.lane_stream())
        self._shared.check(getattr(self._lib, name)(*args),
                           f"char LM kernel {name} ({self.manifest['target']})")

    def _check(self, name, a, shape):
        if tuple(a.shape) != tuple(shape):
            raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(a.shape)}")
        return self.mem.ptr(a)

    def targets(self, t: np.ndarray):
        """int class indices (any shape) as this library's int32 argument."""
        t = np.ascontiguousarray(t, dtype=np.int32).reshape(-1)
        return cuda.IntArray(t) if self.on_gpu else t

    @staticmethod
    def _indices(name, a) -> int:
        """The pointer of a, checked to be an (N,) result of .targets()."""
        if not isinstance(a, (np.ndarray, cuda.IntArray)) or len(a.shape) != 1:
            raise TypeError(f"{name}: expected the (N,) result of Kernels.targets()")
        return a.ctypes.data if isinstance(a, np.ndarray) else a.ptr

    def onehot(self, ids, V: int):
        """ids (from .targets(), N) -> (N, V) one-hot rows."""
        ptr = self._indices("ids", ids)
        out = self.mem.empty((ids.shape[0], int(V)))
        self._call("halstm_onehot", ids.shape[0], int(V), ptr, self.mem.ptr(out))
        return out

    def rows(self, src, idx):
        """src (R, n), idx (from .targets(), M) -> (M, n): row idx[m] of
        src, zeros where idx[m] < 0."""
        ptr = self._indices("idx", idx)
        R, n = src.shape
        out = self.mem.empty((idx.shape[0], n))
        self._call("halstm_rows", R, idx.shape[0], n, self.mem.ptr(src), ptr, self.mem.ptr(out))
        return out

    def add(self, a, b):
        """a + b, a new array of their shape."""
        return self._elementwise("halstm_add", a, b)

    def mul(self, a, b, out=None):
        """a * b, into out (of their shape) or a new array."""
        return self._elementwise("halstm_mul", a, b, out)

    def dropout(self, shape, key0: int, key1: int, threshold: int, scale: float):
        """A new dropout mask of shape (see kernels.py: dropout)."""
        out = self.mem.empty(tuple(shape))
        self._call("halstm_dropout", out.size, key0, key1, threshold, float(scale),
                   self.mem.ptr(out))
        return out

    def _elementwise(self, name, a, b, out=None):
        out = self.mem.empty(tuple(a.shape)) if out is None else out
        self._call(name, a.size, self.mem.ptr(a), self._check("b", b, a.shape),
                   self._check("out", out, a.shape))
        return out

    def head(self, y, w, b, targets, scale: float):
        """y (N, H), w (V, H), b (V,), targets (from .targets(), N) ->
        loss (N,), dw (V, H), db (V,), dy (N, H)."""
        N, H = y.shape
        V = w.shape[0]
        if not isinstance(targets, (np.ndarray, cuda.IntArray)):
            raise TypeError("targets: expected the result of Kernels.targets()")
        args = [self._check("y", y, (N, H)), self._check("w", w, (V, H)),
                self._check("b", b, (V,))]
        if tuple(targets.shape) != (N,):
            raise ValueError(f"targets: expected shape {(N,)}, got {tuple(targets.shape)}")
        tptr = targets.ctypes.data if isinstance(targets, np.ndarray) else targets.ptr
        out = [self.mem.empty((N,)), self.mem.empty((V, H)), self.mem.empty((V,)),
               self.mem.empty((N, H))]
        self._call("halstm_head", N, H, V, *args, tptr, float(scale),
                   *map(self.mem.ptr, out))
        return tuple(out)

    def sumsq(self, g, out) -> None:
        """out (1,) = sum of g's squares."""
        self._call("halstm_sumsq", g.size, self.mem.ptr(g), self._check("out", out, (1,)))

    def adam(self, p, g, m, v, sq, c, e, b1, b2, max_norm) -> None:
        """optim.Adam's update of p, m, v in place (see kernels.py)."""
        n = p.size
        ptrs = [self._check(k, a, p.shape) for k, a in (("p", p), ("g", g), ("m", m), ("v", v))]
        self._call("halstm_adam", n, *ptrs, sq.size, self.mem.ptr(sq),
                   *(float(x) for x in (c, e, b1, b2, max_norm)))

    def sgd(self, p, g, buf, sq, lr, momentum, max_norm) -> None:
        """optim.SGD's update of p and buf in place."""
        ptrs = [self._check(k, a, p.shape) for k, a in (("p", p), ("g", g), ("buf", buf))]
        self._call("halstm_sgd", p.size, *ptrs, sq.size, self.mem.ptr(sq),
                   *(float(x) for x in (lr, momentum, max_norm)))


@lru_cache(maxsize=None)
def kernels(target: str) -> Kernels:
    """The loaded kernels of target (one per process and target)."""
    return Kernels(target)
