"""Ahead-of-time compilation: (cell, sizes, direction, target, schedule) ->
a shared library plus manifest.json, cached on disk.

The cache lives in the user cache directory (HALSTM_CACHE overrides it),
one folder per key; the key hashes everything that changes the code: cell,
sizes, direction, the target string (for "host" targets, this machine's CPU
as well), schedule, Halide's version and halstm's own compiler sources.
Builds go to a temporary folder renamed into place under a file lock, so
concurrent builders of one key both succeed, a failed or interrupted build
leaves nothing behind, and an entry whose library does not match its
manifest's checksum is rebuilt. Halide is imported only to build.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

from filelock import FileLock

from . import cells

DIRECTIONS = ("fwd", "bwd")
LIBRARY = "libhalstm.so"
MANIFEST = "manifest.json"
FORMAT = 1
_HERE = Path(__file__).resolve().parent

# What each direction's C entry point takes (numpy shapes), for manifests.
# HP, KP: H and K rounded up to the panel width P.
ENTRY_POINTS = {
    "fwd": {"halstm_forward": [
        "int T", "int B", "x (T, B, K)", "w_ih (G*H, K)", "b_ih (G*H,)", "w_hh (G*H, H)",
        "b_hh (G*H,)", "ws wp_ih (HP/P, K, G, P)", "ws wp_hh (HP/P, H, G, P)",
        "ws xp (T, B, G, HP)",
        "out saved (T, B, S, H), or NULL where no backward follows (halstm_step_infer runs)", "inout states[NS] (T+1, B, H)"]},
    "bwd": {"halstm_backward": [
        "int T", "int B", "x (T, B, K)", "w_ih (G*H, K)", "w_hh (G*H, H)",
        "saved (T, B, S, H)", "states[NS] (T+1, B, H)", "dy (T, B, H)",
        "inout dstate[NS] (2, B, HP): in [0], out [T & 1]",
        "ws wq_ih (KP/P, G, H, P) (unused, NULL, where the pipelines lack halstm_pack_bwd)",
        "ws wq_hh (HP/P, G, H, P) (unused, NULL, where the pipelines lack halstm_pack_bwd)",
        "ws dxp (T, B, G, H)", "ws dhg (T, B, G, H)",
        "ws fused_bwd: 3*B*HP + 3*B*G*H floats, the first B*G*H zero, where the manifest's "
        "pipelines include halstm_step_bwd_fused (else unused)",
        "out dx (T, B, KP), or NULL on a CPU target where dx is not wanted", "out dw_ih (G*H, K)", "out db_ih (G*H,)",
        "out dw_hh (G*H, H)", "out db_hh (G*H,)"]},
}


def _entry_points(spec) -> dict:
    """ENTRY_POINTS for spec; a one-hot library takes class indices for x."""
    if not spec.onehot:
        return ENTRY_POINTS[spec.direction]
    ids = "ids (T, B) int32: one-hot input rows as class indices in [0, K)"
    return {name: [ids if a.startswith("x ") else
                   "dx: unused (NULL)" if a.startswith("out dx") else a for a in args]
            for name, args in ENTRY_POINTS[spec.direction].items()}


def pipeline_kinds(spec, layout: dict) -> tuple:
    """The pipelines (pipeline.KINDS) a library of spec is made of, given its
    schedule's layout."""
    from . import pipeline
    if spec.onehot:
        kinds = pipeline.FORWARD_IDS if spec.direction == "fwd" else pipeline.BACKWARD_IDS
    else:
        kinds = pipeline.FORWARD if spec.direction == "fwd" else pipeline.BACKWARD
    if spec.hidden_size < layout.get("fused_bwd_below", 0) and not spec.onehot:
        kinds = tuple(pipeline.FUSED_BWD.get(k, k) for k in kinds)
    if layout.get("raw_bwd_weights"):       # the backward reads the weights as given
        kinds = tuple(k for k in kinds if k != "pack_bwd")
    return kinds


class CompileError(RuntimeError):
    """A pipeline failed to compile; the message names cell, target and schedule."""


@dataclass(frozen=True)
class Spec:
    cell: str
    input_size: int
    hidden_size: int
    direction: str
    target: str = "host"
    schedule: str | None = None   # None: the target family's default (resolved here)
    onehot: bool = False          # input: one-hot rows given as class indices (CPU targets)

    def __post_init__(self):
        cells.check(self.cell)
        for name in ("input_size", "hidden_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}: expected a positive int, got {v!r}")
        if self.direction not in DIRECTIONS:
            raise ValueError(f"direction: expected one of {DIRECTIONS}, got {self.direction!r}")
        if not isinstance(self.onehot, bool):
            raise ValueError(f"onehot: expected a bool, got {self.onehot!r}")
        if not isinstance(self.target, str) or not self.target:
            raise ValueError(f"target: expected a Halide target string, got {self.target!r}")
        from halstm import cuda, schedules   # named in full: one cache key per meaning
        object.__setattr__(self, "target", cuda.host_target(self.target))
        object.__setattr__(self, "schedule", schedules.resolve(self.target, self.schedule))

    def describe(self) -> str:
        return (f"cell {self.cell} ({self.direction}, "
                f"{'one-hot indices of ' if self.onehot else ''}input {self.input_size}, hidden "
                f"{self.hidden_size}), target {self.target}, schedule "
                f"{self.schedule or 'default'}")


def cache_dir() -> Path:
    env = os.environ.get("HALSTM_CACHE")
    if env:
        return Path(env)
    import platformdirs
    return Path(platformdirs.user_cache_dir("halstm"))


@lru_cache(maxsize=None)
def code_hash() -> str:
    """Hash of the sources that decide the generated code."""
    h = hashlib.sha256()
    files = [_HERE / "pipeline.py", _HERE / "driver.cpp", _HERE / "aot.py"]
    files += sorted((_HERE / "cells").glob("*.py"))
    import halstm.schedules as sched
    files += sorted(Path(sched.__file__).parent.glob("*.py"))
    for f in files:
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


@lru_cache(maxsize=None)
def host_fingerprint() -> str:
    """What "host" means here: the CPU's model and feature flags."""
    info = platform.machine() + platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "flags", "Features", "CPU part")):
                    info += line
                if line.strip() == "":
                    break
    except OSError:
        pass
    return hashlib.sha256(info.encode()).hexdigest()[:16]


@lru_cache(maxsize=None)
def halide_version() -> str:
    """Halide's version, from the package metadata or, for a Halide copied
    without it (the GPU machines' bundle), from its CMake package files."""
    try:
        return importlib.metadata.version("halide")
    except importlib.metadata.PackageNotFoundError:
        import re
        spec = importlib.util.find_spec("halide")
        if spec is None or not spec.origin:
            raise
        cfg = Path(spec.origin).parent / "lib64/cmake/Halide/HalideConfigVersion.cmake"
        m = re.search(r'set\(PACKAGE_VERSION "([^"]+)"\)', cfg.read_text())
        if m is None:
            raise
        return m.group(1)


def cache_key(spec: Spec) -> str:
    material = {**asdict(spec), "halide": halide_version(), "code": code_hash(), "format": FORMAT}
    if "host" in spec.target.split("-"):
        material["host"] = host_fingerprint()
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:24]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_entry(folder: Path) -> dict | None:
    """The manifest of a complete, intact entry, else None."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        if manifest.get("format") != FORMAT:
            return None
        if _sha256(folder / manifest["library"]) != manifest["sha256"]:
            return None
        return manifest
    except (OSError, ValueError, KeyError, TypeError):
        return None


def library(spec: Spec) -> tuple[Path, dict]:
    """The cached library for spec, built first if missing or corrupt.
    Returns (path of the .so, manifest)."""
    root = cache_dir()
    key = cache_key(spec)
    entry = root / key
    manifest = read_entry(entry)
    if manifest is not None:
        return entry / manifest["library"], manifest
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale_builds(root)
    with FileLock(str(root / f"{key}.lock")):
        manifest = read_entry(entry)          # another process may have built it
        if manifest is None:
            tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{key}-", dir=root))
            try:
                manifest = build(spec, tmp, require_loadable=True)
                if entry.exists():            # a corrupt entry: replace it
                    shutil.rmtree(entry)
                os.rename(tmp, entry)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return entry / manifest["library"], manifest


def _remove_stale_builds(root: Path, age_s: float = 3600) -> None:
    """Delete temporary build folders that a killed process left behind."""
    now = time.time()
    for tmp in root.glob(".tmp-*"):
        try:
            if now - tmp.stat().st_mtime > age_s:
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError:
            pass


# `halstm compile --emit` names -> Halide output files (suffix per pipeline)
EMIT = {"c_header": ".h", "static_library": ".a", "assembly": ".s", "stmt": ".stmt",
        "stmt_html": ".stmt.html", "schedule": ".schedule.h"}
_ISA_PREFIXES = ("SSE", "AVX", "FMA", "F16C", "X86APX", "ARM", "SVE", "VSX", "POWER", "RVV")


def loadable_here(target) -> bool:
    """Whether code for `target` (a halide.Target) can be loaded and run on
    this machine's CPU: same architecture, bits and OS, and every ISA
    extension it uses present here."""
    import halide as hl
    host = hl.get_host_target()
    if (target.arch, target.bits, target.os) != (host.arch, host.bits, host.os):
        return False
    return all(host.has_feature(f) or not target.has_feature(f)
               for name, f in hl.TargetFeature.__members__.items()
               if name.upper().startswith(_ISA_PREFIXES))


def build(spec: Spec, out: Path, emit=(), require_loadable: bool = False) -> dict:
    """Compile spec's pipelines into `out` (see _build). An autoscheduled
    build runs in a child process: Halide's autoscheduler plugins can crash
    the process (auto:Anderson2021 died of SIGFPE on a projection), and a
    crash must become a CompileError, not the end of the caller."""
    if spec.schedule and spec.schedule.startswith("auto:"):
        return _build_in_child(spec, Path(out), tuple(emit), require_loadable)
    return _build(spec, Path(out), emit, require_loadable)


def _build_in_child(spec: Spec, out: Path, emit, require_loadable) -> dict:
    import signal
    import sys
    args = json.dumps([asdict(spec), str(out), list(emit), require_loadable])
    code = ("import json, sys; from halstm import aot; s, o, e, r = json.loads(sys.argv[1]); "
            "aot._build(aot.Spec(**s), aot.Path(o), e, r)")
    res = subprocess.run([sys.executable, "-c", code, args], capture_output=True, text=True)
    if res.returncode != 0:
        if res.returncode < 0:
            why = f"the compiler crashed ({signal.Signals(-res.returncode).name})"
        else:
            lines = res.stderr.strip().splitlines()
            why = "\n".join(lines[-12:])
        raise CompileError(f"Halide failed to compile {spec.describe()}: {why}")
    return json.loads((out / MANIFEST).read_text())


def _build(spec: Spec, out: Path, emit=(), require_loadable: bool = False) -> dict:
    """Compile spec's pipelines into `out` and write out/manifest.json last
    (so that a manifest means a finished build). Where the target runs on
    this machine, pipelines, runtime and driver are linked into
    out/libhalstm.so; otherwise (a cross target) out gets one static library
    and header per pipeline, the runtime, and driver.cpp with the defines to
    build it with, for embedding in a C or C++ program. `emit`: more of
    Halide's outputs per pipeline (keys of EMIT)."""
    try:
        import halide as hl
    except ImportError as e:  # pragma: no cover - a dependency
        raise CompileError(f"{spec.describe()}: halide is not importable: {e}") from e
    from . import pipeline
    from halstm import schedules

    start = time.perf_counter()
    cell = cells.get(spec.cell)
    try:
        target = hl.Target(spec.target)
        schedule = spec.schedule          # resolved and checked by Spec
        unknown = sorted(set(emit) - set(EMIT))
        if unknown:
            raise ValueError(f"emit: expected some of {sorted(EMIT)}, got {unknown}")
    except Exception as e:  # halide.HalideError derives from Exception only
        raise CompileError(f"{spec.describe()}: {e}") from e
    link = loadable_here(target)
    if require_loadable and not link:
        raise CompileError(f"{spec.describe()}: code for target {target} cannot run on this "
                           f"machine ({hl.get_host_target()}); `halstm compile --out DIR` "
                           f"writes static libraries and headers for it")
    objects = []
    try:
        lowered = target.with_feature(hl.TargetFeature.NoRuntime)
        module = schedules.for_target(target, schedule)
        layout = module.layout(target)
        kinds = pipeline_kinds(spec, layout)
        missing = [k for k in kinds if not callable(getattr(module, k, None))]
        if missing or (spec.onehot and target.has_feature(hl.TargetFeature.CUDA)):
            raise ValueError(f"one-hot index input: schedule {schedule!r} on this target "
                             f"has no {', '.join(missing) or 'CUDA'} pipelines")
        panel = layout["panel"]
        quantum = 1    # split_steps: the driver's ranges are made of this many panels
        batch_bytes = 0  # ... or of batch rows, where W_hh is at most this size
        for kind in kinds:
            p = pipeline.build(cell, kind, spec.input_size, spec.hidden_size, layout)
            getattr(module, kind)(p, target)
            quantum = math.lcm(quantum, p.split_quantum)
            batch_bytes = max(batch_bytes, p.split_batch_bytes)
            files = {getattr(hl.OutputFileType, e): str(out / f"{kind}{EMIT[e]}") for e in emit}
            if link:
                files[hl.OutputFileType.object] = str(out / f"{kind}.o")
                objects.append(out / f"{kind}.o")
            else:
                files[hl.OutputFileType.static_library] = str(out / f"{kind}.a")
                files[hl.OutputFileType.c_header] = str(out / f"{kind}.h")
            p.pipeline().compile_to(files, [hl.Argument(q) for q in p.inputs],
                                    f"halstm_{kind}", lowered)
        if link:
            hl.compile_standalone_runtime(str(out / "runtime.o"), target)
            objects.append(out / "runtime.o")
        else:
            hl.compile_standalone_runtime({hl.OutputFileType.static_library:
                                           str(out / "runtime.a")}, target)
    except Exception as e:  # Halide raises HalideError, RuntimeError and others
        raise CompileError(f"Halide failed to compile {spec.describe()} "
                           f"(schedule {schedule}):\n{e}") from e
    defines = {"NS": len(cell.states), "G": cell.n_gates, "S": len(cell.saved),
               "K": spec.input_size, "H": spec.hidden_size, "P": panel,
               "DXP_IS_DHG": int(cell.dxp_is_dhg), "HALSTM_ONEHOT": int(spec.onehot),
               "HALSTM_FORWARD" if spec.direction == "fwd" else "HALSTM_BACKWARD": 1}
    if layout.get("split_steps"):   # the driver splits each step over threads
        defines["HALSTM_SPLIT"] = 1
        defines["HALSTM_SPLIT_MACS"] = int(layout["split_macs"])
        defines["HALSTM_SPLIT_QUANTUM"] = quantum
        defines["HALSTM_SPLIT_ROWS"] = int(layout["split_rows"])
        defines["HALSTM_SPLIT_CALL_MACS"] = int(layout["split_call_macs"])
        defines["HALSTM_SPLIT_BATCH_BYTES"] = batch_bytes
    if layout.get("xp_panels"):     # xp stored in panels of P units
        defines["HALSTM_XP_PANELS"] = 1
    if "step_bwd_fused" in kinds:   # one call a backward step (pipeline.py _step_bwd_fused)
        defines["HALSTM_FUSED_BWD"] = 1
    if spec.direction == "bwd" and "pack_bwd" not in kinds:   # (layout raw_bwd_weights)
        defines["HALSTM_RAW_BWD"] = 1
    cuda = target.has_feature(hl.TargetFeature.CUDA)
    if cuda:                 # the driver passes device pointers (see driver.cpp)
        defines["HALSTM_CUDA"] = 1
        defines["HALSTM_CUDA_MAX_REGISTERS"] = f'"{layout.get("max_registers", 64)}"'
        defines["HALSTM_CUDA_GRAPHS"] = int(bool(layout.get("cuda_graphs", False)))
    flags = [f"-D{k}={v}" for k, v in defines.items()]
    if link:
        cmd = [os.environ.get("CXX", "c++"), "-O2", "-std=c++17", "-shared", "-fPIC",
               f"-I{Path(hl.__file__).parent / 'include'}", *flags,
               str(_HERE / "driver.cpp"), *map(str, objects), "-o", str(out / LIBRARY),
               "-lpthread", "-ldl", "-lm"]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise CompileError(f"linking {spec.describe()} (schedule {schedule}) failed:\n"
                               f"{' '.join(cmd)}\n{res.stderr}")
        for obj in objects:
            obj.unlink()
    else:
        shutil.copy(_HERE / "driver.cpp", out / "driver.cpp")
        shutil.copy(Path(hl.__file__).parent / "include" / "HalideRuntime.h",
                    out / "HalideRuntime.h")
    manifest = {
        "format": FORMAT, "cell": spec.cell, "input_size": spec.input_size,
        "hidden_size": spec.hidden_size, "direction": spec.direction,
        "gates": list(cell.gates), "states": list(cell.states), "saved": list(cell.saved),
        "dxp_is_dhg": cell.dxp_is_dhg, "onehot": spec.onehot, "panel": panel, "layout": layout,
        "device": "cuda" if cuda else "cpu",
        **({"cuda_graphs": bool(layout.get("cuda_graphs", False))} if cuda else {}),
        "target": str(target), "target_requested": spec.target, "schedule": schedule,
        "halide_version": halide_version(), "halstm_code": code_hash(),
        "entry_points": _entry_points(spec) | (
            {"halstm_cuda_init": ["void *context: the CUcontext to run in; call first. "
                                  "Every array argument is then a device pointer"]}
            if cuda else {}),
        "pipelines": [f"halstm_{k}" for k in kinds],
        "emitted": sorted(emit),
        "schedule_notes": list(getattr(module, "notes", [])),
        "compile_seconds": round(time.perf_counter() - start, 3),
    }
    if link:
        manifest |= {"library": LIBRARY, "sha256": _sha256(out / LIBRARY)}
    else:
        manifest |= {"library": None, "loadable_here": False,
                     "driver_build": "c++ -O2 -std=c++17 -I. " + " ".join(map(shlex.quote, flags)) +
                     " driver.cpp " + " ".join(f"{k}.a" for k in kinds) + " runtime.a"
                     " (add -shared -fPIC -o libhalstm.so for a shared library)"}
    tmp = out / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2))
    os.replace(tmp, out / MANIFEST)
    return manifest
