"""The char LM's head and optimizer pipelines (halstm/model/kernels.py),
compiled ahead of time into one library per target and cached on disk like
the recurrent layers' (halstm.aot): the same cache folder, lock, checksum
and driver (driver.cpp built with -DHALSTM_MODEL), so that a CUDA build takes
device pointers (halstm.cuda.DeviceArray) and copies nothing to the host.

    k = kernels("host-cuda")                  # built on first use, then cached
    loss, dw, db, dy = k.head(y, w, b, targets, scale)
    k.sumsq(g, sq[i:i + 1]); k.adam(p, g, m, v, sq, c, e, b1, b2, max_norm)
    x = k.onehot(k.targets(ids), V)           # (N, V) one-hot rows

Arrays are numpy (CPU targets) or DeviceArrays (CUDA), float32, C-contiguous;
targets int32 (numpy, uploaded on a CUDA target).
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from functools import lru_cache
from pathlib import Path

import numpy as np

from .. import aot
from ..runtime import KernelError, _Device, _Host

FORMAT = "halstm-model-kernels/1"
_HERE = Path(__file__).resolve().parent
_P, _I, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float


def _code_hash() -> str:
    import halstm.schedules as sched
    h = hashlib.sha256()
    sdir = Path(sched.__file__).parent
    for f in (_HERE / "kernels.py", _HERE / "library.py", _HERE.parent / "driver.cpp",
              sdir / "cpu.py", sdir / "cuda.py"):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def _schedule_module(target):
    """The target family's default schedule module (cpu or cuda), which
    defines head, sumsq, adam and sgd."""
    from halstm import schedules
    return schedules.for_target(target)


def build(target: str, out: Path) -> dict:
    """Compile every kernels.KINDS pipeline for target into out/libhalstm.so
    with the driver; writes out/manifest.json last."""
    import halide as hl
    from . import kernels
    start = time.perf_counter()
    t = hl.Target(target)
    if not aot.loadable_here(t):
        raise aot.CompileError(f"model kernels: code for target {t} cannot run on this machine")
    module = _schedule_module(t)
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
        raise aot.CompileError(f"Halide failed to compile the char LM's head and optimizer "
                               f"for target {t}:\n{e}") from e
    cuda = t.has_feature(hl.TargetFeature.CUDA)
    flags = ["-DHALSTM_MODEL=1"]
    if cuda:
        flags += ["-DHALSTM_CUDA=1", '-DHALSTM_CUDA_MAX_REGISTERS="64"', "-DHALSTM_CUDA_GRAPHS=0"]
    cmd = [os.environ.get("CXX", "c++"), "-O2", "-std=c++17", "-shared", "-fPIC",
           f"-I{Path(hl.__file__).parent / 'include'}", *flags, str(_HERE.parent / "driver.cpp"),
           *map(str, objects), "-o", str(out / aot.LIBRARY), "-lpthread", "-ldl", "-lm"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise aot.CompileError(f"linking the char LM's kernels for {t} failed:\n"
                               f"{' '.join(cmd)}\n{res.stderr}")
    for o in objects:
        o.unlink()
    manifest = {"format": FORMAT, "target": str(t), "device": "cuda" if cuda else "cpu",
                "pipelines": [f"halstm_model_{k}" for k in kernels.KINDS],
                "halide_version": aot.halide_version(), "code": _code_hash(),
                "library": aot.LIBRARY, "sha256": aot._sha256(out / aot.LIBRARY),
                "compile_seconds": round(time.perf_counter() - start, 3)}
    (out / "manifest.json.tmp").write_text(json.dumps(manifest, indent=2))
    os.replace(out / "manifest.json.tmp", out / "manifest.json")
    return manifest


def _read(folder: Path) -> dict | None:
    try:
        m = json.loads((folder / "manifest.json").read_text())
        if m.get("format") != FORMAT or aot._sha256(folder / m["library"]) != m["sha256"]:
            return None
        return m
    except (OSError, ValueError, KeyError, TypeError):
        return None


def library(target: str) -> tuple[Path, dict]:
    """The cached library for target (built first if missing or corrupt)."""
    from filelock import FileLock
    from .. import cuda
    target = cuda.host_target(target)
    material = {"target": target, "halide": aot.halide_version(), "code": _code_hash(),
                "format": FORMAT}
    if "host" in target.split("-"):
        material["host"] = aot.host_fingerprint()
    key = "model-" + hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:20]
    root = aot.cache_dir()
    entry = root / key
    m = _read(entry)
    if m is not None:
        return entry / m["library"], m
    root.mkdir(parents=True, exist_ok=True)
    aot._remove_stale_builds(root)
    with FileLock(str(root / f"{key}.lock")):
        m = _read(entry)
        if m is None:
            tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{key}-", dir=root))
            try:
                m = build(target, tmp)
                if entry.exists():
                    shutil.rmtree(entry)
                os.rename(tmp, entry)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return entry / m["library"], m


class _Ints:
    """int32 class indices in device memory (DeviceArray holds float32 only)."""

    def __init__(self, a: np.ndarray):
        from .. import cuda
        self.shape = a.shape
        self._alloc = cuda._Allocation(max(a.nbytes, 4))
        self.ptr = self._alloc.ptr
        cuda.driver().call("cuMemcpyHtoD_v2", cuda._U64(self.ptr), a.ctypes.data, a.nbytes)


class Kernels:
    """The loaded library of one target; see the module docstring."""

    def __init__(self, target: str):
        path, self.manifest = library(target)
        self.target = target
        self._lib = ctypes.CDLL(str(path))
        self._lib.halstm_last_error.restype = ctypes.c_char_p
        self.on_gpu = self.manifest["device"] == "cuda"
        if self.on_gpu:
            self.mem = _Device()
            self._lib.halstm_cuda_init.argtypes = [_P]
            rc = self._lib.halstm_cuda_init(self.mem.cuda.driver().context)
            if rc:
                raise KernelError(f"halstm_cuda_init failed with code {rc}")
        else:
            self.mem = _Host()
        L = self._lib
        L.halstm_head.argtypes = [_I, _I, _I, _P, _P, _P, _P, _F, _P, _P, _P, _P]
        L.halstm_sumsq.argtypes = [_I, _P, _P]
        L.halstm_adam.argtypes = [_I, _P, _P, _P, _P, _I, _P, _F, _F, _F, _F, _F]
        L.halstm_sgd.argtypes = [_I, _P, _P, _P, _I, _P, _F, _F, _F]
        L.halstm_onehot.argtypes = [_I, _I, _P, _P]

    def _call(self, name, *args):
        rc = getattr(self._lib, name)(*args)
        if rc != 0:
            msg = self._lib.halstm_last_error().decode(errors="replace").strip()
            raise KernelError(f"char LM kernel {name} ({self.manifest['target']}) failed with "
                              f"code {rc}: {msg}")

    def _check(self, name, a, shape):
        if tuple(a.shape) != tuple(shape):
            raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(a.shape)}")
        return self.mem.ptr(a)

    def targets(self, t: np.ndarray):
        """int class indices (any shape) as this library's int32 argument."""
        t = np.ascontiguousarray(t, dtype=np.int32).reshape(-1)
        return _Ints(t) if self.on_gpu else t

    def onehot(self, ids, V: int):
        """ids (from .targets(), N) -> (N, V) one-hot rows."""
        if not isinstance(ids, (np.ndarray, _Ints)) or len(ids.shape) != 1:
            raise TypeError("ids: expected the (N,) result of Kernels.targets()")
        out = self.mem.empty((ids.shape[0], int(V)))
        ptr = ids.ctypes.data if isinstance(ids, np.ndarray) else ids.ptr
        self._call("halstm_onehot", ids.shape[0], int(V), ptr, self.mem.ptr(out))
        return out

    def head(self, y, w, b, targets, scale: float):
        """y (N, H), w (V, H), b (V,), targets (from .targets(), N) ->
        loss (N,), dw (V, H), db (V,), dy (N, H)."""
        N, H = y.shape
        V = w.shape[0]
        if not isinstance(targets, (np.ndarray, _Ints)):
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
