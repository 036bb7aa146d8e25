"""Ahead-of-time compilation: (cell, sizes, direction, target, schedule) ->
a shared library plus manifest.json, cached on disk (cache.py).

A build runs in stages: plan (the target, the schedule module and its
layout, the pipelines), compile the pipelines, link them with the driver
(driver.py) or, for a target that cannot run here, write static libraries
and the driver's sources, and write the manifest last. The cache key
hashes the spec, the code that decides the generated code (without its
comments), the target and Halide's version. Halide is imported only to
build.
"""
from __future__ import annotations

import dataclasses
import json
import math
import shlex
import subprocess
import time
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

from . import cache, cells, driver, machine
from . import manifest as manifest_schema
from .errors import CompileError
from .layout import Layout

DIRECTIONS = ("fwd", "bwd")
LIBRARY = "libhalstm.so"
MANIFEST = cache.MANIFEST
FORMAT = manifest_schema.FORMAT
_HERE = Path(__file__).resolve().parent

# What each direction's C entry point takes (numpy shapes), for manifests.
# HP, KP: H and K rounded up to the panel width P.
ENTRY_POINTS = {
    "fwd": {"halstm_forward": [
        "int T", "int B", "batch_sizes (T,) int32, or NULL", "x (T, B, K)", "w_ih (G*H, K)", "b_ih (G*H,)", "w_hh (G*H, H)",
        "b_hh (G*H,)", "vec (V, H): the vector parameters (unused, NULL, with V = 0)",
        "ws wp_ih (HP/P, G/PG, K, PG, P) (PG: the layout's panel_gates, else G); precision "
        "bf16 on a CPU: bf16 (HP/P, G, KH, P, 2)",
        "ws wp_hh (HP/P, G/PG, H, PG, P); precision bf16 on a CPU: bf16 (HP/P, G, HH, P, 2)",
        "ws xp (N, G, HP): N = T*B, or on a CPU given batch_sizes bs, bs[0] + sum(bs[:-1]) "
        "(runtime.step_rows_count)",
        "ws x_rows (N, K) (one-hot: (N,) int32), on a CPU given batch_sizes; (2, B, G, HP) "
        "where the pipelines include halstm_step_fold (else unused, NULL)",
        "out saved (T, B, S, H), or NULL where no backward follows (halstm_step_infer runs)",
        "out states[NS] (T+1, B, H): [0] the initial state, [t+1] the state after step t",
        "init[NS] (B, H): each state's initial value, or NULL: zeros",
        "out finals[NS] (B, H): each state's final value, states[s][T] (NULL: not wanted), "
        "or NULL; NULL with batch_sizes"]},
    "bwd": {"halstm_backward": [
        "int T", "int B", "batch_sizes (T,) int32, or NULL", "x (T, B, K)", "w_ih (G*H, K)", "w_hh (G*H, H)",
        "vec (V, H) (unused, NULL, with V = 0)", "saved (T, B, S, H)", "states[NS] (T+1, B, H)", "dy (T, B, H)",
        "inout dstate[NS] (2, B, HP): in [0] (unless dfinal), out [T & 1]",
        "ws wq_ih (KP/P, G, H, P) (unused, NULL, where the pipelines lack halstm_pack_bwd)",
        "ws wq_hh (HP/P, G, H, P) (unused, NULL, where the pipelines lack halstm_pack_bwd)",
        "ws dxp (N, G, H)", "ws dhg (N, G, H)",
        "ws fused_bwd: 3*B*HP + 3*B*G*H + B*V*H floats, the first B*G*H zero, where the manifest's "
        "pipelines include halstm_step_bwd_fused (else unused)",
        "ws dvec_rows (2, B, V, H) (unused, NULL, with V = 0)",
        "ws rows: N*(K + H + KP) floats (one-hot: N*(1 + H)), on a CPU given batch_sizes "
        "(else unused, NULL)",
        "out dx (T, B, KP), or NULL on a CPU target where dx is not wanted", "out dw_ih (G*H, K)", "out db_ih (G*H,)",
        "out dw_hh (G*H, H)", "out db_hh (G*H,)", "out dvec (V, H) (unused, NULL, with V = 0)",
        "dfinal[NS] (B, H): each final state's gradient (NULL: zeros), put into dstate by the "
        "call; or NULL: the caller has (dstate zeros but for them); NULL with batch_sizes, and "
        "on a CUDA target where HP != H"]},
}


def _entry_points(spec) -> dict:
    """ENTRY_POINTS for spec; a one-hot library takes class indices for x."""
    if not spec.onehot:
        return ENTRY_POINTS[spec.direction]
    ids = "ids (T, B) int32: one-hot input rows as class indices in [0, K)"
    return {name: [ids if a.startswith("x ") else
                   "dx: unused (NULL)" if a.startswith("out dx") else a for a in args]
            for name, args in ENTRY_POINTS[spec.direction].items()}


def pipeline_kinds(spec, layout: Layout) -> tuple:
    """The pipelines (pipeline.KINDS) a library of spec is made of, given its
    schedule's layout."""
    from . import pipeline
    if spec.onehot:
        kinds = pipeline.FORWARD_IDS if spec.direction == "fwd" else pipeline.BACKWARD_IDS
    else:
        kinds = pipeline.FORWARD if spec.direction == "fwd" else pipeline.BACKWARD
    if spec.hidden_size < layout.fused_bwd_below:
        kinds = tuple(pipeline.FUSED_BWD.get(k, k) for k in kinds)
    if layout.split is not None and layout.split.rows_only:   # (where rows give too few ranges)
        kinds += pipeline.UNITS_BWD if "step_bwd" in kinds else pipeline.UNITS_FWD
    if layout.fold_steps:
        kinds += pipeline.FOLD_FWD if spec.direction == "fwd" else pipeline.FOLD_BWD
    if layout.narrow_rows and spec.direction == "fwd":
        kinds += pipeline.NARROW
    if layout.cpu_bf16 and "step_bwd_fused" in kinds:   # (its narrow steps: step_bwd_fused)
        kinds += pipeline.BF16_BWD
    if layout.loop_rows:             # (the same)
        kinds += pipeline.LOOP
    if layout.raw_bwd_weights:       # the backward reads the weights as given
        kinds = tuple(k for k in kinds if k != "pack_bwd")
    if layout.vendor_gemm and layout.vendor_step_rows:   # steps whose product is a vendor GEMM
        kinds += pipeline.VENDOR_STEPS[spec.direction]
    if layout.vendor_bf16:           # the vendor GEMMs' operands rounded to bf16 first
        kinds += ("to_bf16",)
    return kinds


@dataclass(frozen=True)
class Spec:
    cell: str
    input_size: int
    hidden_size: int
    direction: str
    target: str = "host"
    schedule: str | None = None   # None: the target family's default (resolved here)
    onehot: bool = False          # input: one-hot rows given as class indices (CPU targets)
    knobs: tuple | None = None    # the schedule's knobs as ((name, value), ...); None: tuned
    #                               for this machine by `halstm tune` (halstm.tuning), else defaults
    precision: str = "fp32"       # "tf32", "bf16": tensor-core math in the GEMMs (halstm.cublas)
    gemm: str | None = None       # the non-recurrent GEMMs: "halide" or "cublas"; None: the
    #                               target's default (resolved here; halstm.cublas.resolve)

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
        from halstm import cublas
        auto = self.schedule.startswith("auto:") and self.gemm is None and self.precision == "fp32"
        object.__setattr__(self, "gemm", "halide" if auto else cublas.resolve(
            "cuda" in self.target.split("-"), self.precision, self.gemm))
        knobs = self.knobs
        if knobs is None:
            from halstm import tuning
            knobs = tuning.stored(self)
        object.__setattr__(self, "knobs", _checked_knobs(self, knobs))

    def describe(self) -> str:
        knobs = ", ".join(f"{k}={v}" for k, v in self.knobs)
        return (f"cell {self.cell} ({self.direction}, "
                f"{'one-hot indices of ' if self.onehot else ''}input {self.input_size}, hidden "
                f"{self.hidden_size}), target {self.target}, schedule "
                f"{self.schedule or 'default'}" + (f" ({knobs})" if knobs else "")
                + (f", {self.precision}" if self.precision != "fp32" else "")
                + (f", {self.gemm} GEMMs" if self.gemm != "halide" else ""))


def schedule_knobs(schedule: str) -> dict:
    """The knobs of a schedule: name -> schedules.knobs.Knob (direction it
    acts on, default, candidate values); {} for a schedule without."""
    from halstm.schedules.knobs import KNOBS
    return dict(KNOBS.get(schedule, {}))


def _checked_knobs(spec: Spec, knobs) -> tuple:
    """knobs (a mapping or pairs) as sorted pairs: the ones that act on
    spec's direction, cell (whether its step reduces over units),
    precision and GEMMs (Knob.acts_on) and differ from their defaults in
    what the schedule makes of them (Knob.effective: so that a default
    value, or one that acts as the default, is the same library as none);
    an unknown name or a
    value that is not a positive int raises ValueError."""
    have = schedule_knobs(spec.schedule)
    reduces = (cells.definition(spec.cell).reduces
               if any(k.reducing or k.pointwise for k in have.values()) else False)
    gates = (len(cells.definition(spec.cell).gates)
             if any(k.floor for k in have.values()) else 0)
    out = {}
    for name, value in (knobs.items() if isinstance(knobs, dict) else knobs):
        if name not in have:
            raise ValueError(f"knobs: schedule {spec.schedule!r} has no knob {name!r}; it has "
                             f"{sorted(have) or 'none'}")
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"knobs: {name} expects a positive int, got {value!r}")
        k = have[name]
        if (k.direction == spec.direction
                and k.effective(value, gates) != k.effective(k.default, gates)
                and k.acts_on(reduces, spec.precision, spec.gemm)):
            out[name] = value
    return tuple(sorted(out.items()))


def code_files() -> list[Path]:
    """The sources that decide a layer library's code."""
    import halstm.schedules as sched
    files = [_HERE / "aot.py", _HERE / "layout.py", _HERE / "driver.py", _HERE / "bf16.py"]
    files += sorted((_HERE / "pipeline").glob("*.py"))
    files += sorted((_HERE / "cells").glob("*.py"))
    files += sorted(Path(sched.__file__).parent.glob("*.py"))
    return files + driver.sources()


@lru_cache(maxsize=None)
def code_hash() -> str:
    """Hash of the code (not the comments) that decides the generated code."""
    return cache.source_hash(code_files())


def cache_key(spec: Spec) -> str:
    material = {**asdict(spec), "code": code_hash(), "format": FORMAT}
    if spec.cell not in cells.NAMES:   # a user's cell is in no code file: its math is
        material["cell_definition"] = cells.definition(spec.cell).signature()   # the key
    if spec.schedule.startswith("auto:"):     # its search depends on the machine's parallelism
        from halstm import schedules
        from halstm.schedules import auto
        material["parallelism"] = auto.parallelism(schedules.family(spec.target))
    from halstm.schedules.knobs import MACHINE_FACTS
    for fact in MACHINE_FACTS.get(spec.schedule, {}).get(spec.direction, ()):
        material[fact] = getattr(machine, fact)()
    return cache.key(material, spec.target)


cache_dir = cache.cache_dir


def read_entry(folder: Path) -> dict | None:
    """The manifest of a complete, intact layer library in folder, else None."""
    return cache.read_entry(folder, FORMAT, manifest_schema.check)


def library(spec: Spec, in_child: bool = False) -> tuple[Path, dict]:
    """The cached library for spec, built first if missing or damaged (in a
    child process with in_child where one can build it, _child_can_build:
    Halide's compiler holds the GIL, so builds on several threads run at
    once only so). Returns (path of the .so, manifest)."""
    make = _build_in_child if in_child and _child_can_build(spec) else build
    return cache.entry(cache_key(spec), FORMAT,
                       lambda folder: make(spec, Path(folder), (), True),
                       manifest_schema.check)


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
    build runs in a child process where one can build it
    (_child_can_build): Halide's autoscheduler plugins can crash the
    process (auto:Anderson2021 died of SIGFPE on a projection), and a
    crash must become a CompileError, not the end of the caller."""
    if spec.schedule and spec.schedule.startswith("auto:") and _child_can_build(spec):
        return _build_in_child(spec, Path(out), tuple(emit), require_loadable)
    return _build(spec, Path(out), emit, require_loadable)


def _child_can_build(spec: Spec) -> bool:
    """Whether a child process can build spec: its cell is a built-in, or
    cells.load_file registered it (the child loads that file again). A cell
    a program defined itself is built in this process: a child would have
    to run that program again."""
    return spec.cell in cells.NAMES or cells.definition(spec.cell).cell_file is not None


def _build_in_child(spec: Spec, out: Path, emit, require_loadable) -> dict:
    import signal
    import sys
    d = None if spec.cell in cells.NAMES else cells.definition(spec.cell)
    files = [d.cell_file] if d is not None else []
    args = json.dumps([asdict(spec), str(out), list(emit), require_loadable, files])
    code = ("import json, sys; from halstm import aot, cells; s, o, e, r, f = "
            "json.loads(sys.argv[1]); [cells.load_file(p) for p in f]; "
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
    and header per pipeline, the runtime, and the driver's sources with the
    command to build them, for embedding in a C or C++ program. `emit`: more
    of Halide's outputs per pipeline (keys of EMIT)."""
    start = time.perf_counter()
    plan = _plan(spec, emit, require_loadable)
    objects, pipes = _compile_pipelines(spec, plan, out, emit)
    layer = _driver_build(spec, plan, pipes)
    if plan.link:
        res = driver.link(layer, objects, out / LIBRARY)
        if res.returncode != 0:
            raise CompileError(f"linking {spec.describe()} (schedule {spec.schedule}) failed:\n"
                               f"{' '.join(res.args)}\n{res.stderr}")
        for obj in objects:
            obj.unlink()
    else:
        driver.write_sources(out)
    manifest = _manifest(spec, plan, layer, pipes, out, emit)
    manifest["compile_seconds"] = round(time.perf_counter() - start, 3)
    cache.write_manifest(out, manifest)
    return manifest


@dataclass(frozen=True)
class _Plan:
    """What a build makes: the Halide target, the schedule module, its
    layout, the pipelines, and whether the result is linked here."""
    target: object          # halide.Target
    module: object          # the schedule module (or an autoscheduler's stand-in)
    layout: Layout
    kinds: tuple
    link: bool
    cuda: bool


def _plan(spec: Spec, emit, require_loadable: bool) -> _Plan:
    try:
        import halide as hl
    except ImportError as e:  # pragma: no cover - a dependency
        raise CompileError(f"{spec.describe()}: halide is not importable: {e}") from e
    from halstm import schedules
    try:
        target = hl.Target(spec.target)
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
    cuda = target.has_feature(hl.TargetFeature.CUDA)
    d = cells.definition(spec.cell)
    cpu_bf16 = spec.precision == "bf16" and not cuda
    if cpu_bf16:
        _check_cpu_bf16(spec, target, d, hl)
    try:
        module = schedules.for_target(target, spec.schedule)
        layout = module.layout(target)
        if cpu_bf16:
            layout = module.bf16_layout(layout, spec.direction, spec.input_size,
                                        spec.hidden_size, target)
        elif getattr(module, "panel_layout", None):   # the weight panels' gate groups
            layout = module.panel_layout(layout, len(d.gates), target)
        if d.reduces:
            # a step that reduces over units needs every unit of its products
            # first: no ranges of units for a whole step on the driver's
            # threads (the schedule may keep ranges of rows, and steps in
            # parts), no backward step that finishes the product and the
            # pointwise part in one
            reducing = getattr(module, "reducing_layout", None)
            layout = (reducing(layout) if reducing
                      else layout.without("split", "fused_bwd_below"))
        narrow = getattr(module, "narrow_layout", None)
        if narrow and not d.reduces and spec.direction == "fwd":   # steps of few rows
            layout = narrow(layout, len(d.gates), spec.hidden_size, dict(spec.knobs))
        loop = getattr(module, "loop_layout", None)
        if loop and not d.reduces and spec.direction == "fwd":     # one kernel a forward
            layout = loop(layout, len(d.gates), spec.hidden_size, dict(spec.knobs))
        if spec.gemm == "cublas":    # the schedule's rule for the steps' products, if it has one
            vendor = getattr(module, "vendor_layout", None)
            layout = (vendor(layout, len(d.gates), spec.hidden_size, spec.direction,
                             spec.precision, dict(spec.knobs), d.reduces) if vendor
                      else dataclasses.replace(layout, vendor_gemm=True))
            layout = dataclasses.replace(layout, vendor_bf16=spec.precision == "bf16")
        kinds = pipeline_kinds(spec, layout)
        missing = [k for k in kinds if not callable(getattr(module, k, None))]
        if missing or (spec.onehot and cuda):
            raise ValueError(f"one-hot index input: schedule {spec.schedule!r} on this target "
                             f"has no {', '.join(missing) or 'CUDA'} pipelines")
    except Exception as e:
        raise CompileError(f"Halide failed to compile {spec.describe()} "
                           f"(schedule {spec.schedule}):\n{e}") from e
    return _Plan(target, module, layout, kinds, link, cuda)


def _check_cpu_bf16(spec: Spec, target, d, hl) -> None:
    """precision "bf16" on a CPU target: its products run on AMX tiles or
    as AVX512-BF16 dot products (bf16.cpu_products)."""
    from . import bf16
    if bf16.cpu_products(target) is None:
        raise CompileError(f"{spec.describe()}: precision 'bf16' on a CPU needs AVX512-BF16 "
                           f"or Intel AMX (Halide target feature avx512_zen4, avx512_zen5 or "
                           f"avx512_sapphirerapids), which target {target} lacks; use "
                           f"precision 'fp32'")
    if d.reduces:
        raise CompileError(f"{spec.describe()}: precision 'bf16' on a CPU: cells that reduce "
                           f"over units ({spec.cell}) compute in 'fp32' only")
    if spec.schedule != "cpu":
        raise CompileError(f"{spec.describe()}: precision 'bf16' on a CPU needs schedule "
                           f"'cpu', got {spec.schedule!r}")


def _compile_pipelines(spec: Spec, plan: _Plan, out: Path, emit) -> tuple[list, list]:
    """Build, schedule and compile every pipeline of the plan into out:
    object files (linked here) or static libraries and headers. Returns
    (object files, the scheduled pipes)."""
    import halide as hl
    from . import pipeline
    cell = cells.get(spec.cell)
    lowered = plan.target.with_feature(hl.TargetFeature.NoRuntime)
    objects, pipes = [], []
    try:
        for kind in plan.kinds:
            p = pipeline.build(cell, kind, spec.input_size, spec.hidden_size, plan.layout)
            p.knobs = dict(spec.knobs)
            getattr(plan.module, kind)(p, plan.target)
            pipes.append(p)
            files = {getattr(hl.OutputFileType, e): str(out / f"{kind}{EMIT[e]}") for e in emit}
            if plan.link:
                files[hl.OutputFileType.object] = str(out / f"{kind}.o")
                objects.append(out / f"{kind}.o")
            else:
                files[hl.OutputFileType.static_library] = str(out / f"{kind}.a")
                files[hl.OutputFileType.c_header] = str(out / f"{kind}.h")
            p.pipeline().compile_to(files, [hl.Argument(q) for q in p.inputs],
                                    f"halstm_{kind}", lowered)
        if plan.link:
            hl.compile_standalone_runtime(str(out / "runtime.o"), plan.target)
            objects.append(out / "runtime.o")
        else:
            hl.compile_standalone_runtime({hl.OutputFileType.static_library:
                                           str(out / "runtime.a")}, plan.target)
    except Exception as e:  # Halide raises HalideError, RuntimeError and others
        raise CompileError(f"Halide failed to compile {spec.describe()} "
                           f"(schedule {spec.schedule}):\n{e}") from e
    return objects, pipes


def _driver_build(spec: Spec, plan: _Plan, pipes) -> driver.Layer:
    cell = cells.get(spec.cell)
    return driver.Layer(
        direction=spec.direction, states=len(cell.states), gates=cell.n_gates,
        saved=len(cell.saved_channels(spec.hidden_size)), vectors=len(cell.channels), dxp_is_dhg=cell.dxp_is_dhg, input_size=spec.input_size,
        hidden_size=spec.hidden_size, onehot=spec.onehot, layout=plan.layout, cuda=plan.cuda,
        fused_bwd="step_bwd_fused" in plan.kinds, pack_bwd="pack_bwd" in plan.kinds,
        units_bwd="step_bwd_units" in plan.kinds, units_fwd="step_cell" in plan.kinds,
        fold_fwd="step_fold" in plan.kinds, fold_bwd="step_bwd_fold" in plan.kinds,
        split_quantum=math.lcm(*(p.split_quantum for p in pipes)),
        split_quantum_small=math.lcm(*(p.split_quantum_small or p.split_quantum for p in pipes)),
        split_small_below=max(p.split_small_below for p in pipes),
        split_batch_bytes=max(p.split_batch_bytes for p in pipes),
        proj_serial_macs=max(p.proj_serial_macs for p in pipes),
        cublas=plan.layout.vendor_gemm, precision=spec.precision)


def _manifest(spec: Spec, plan: _Plan, layer: driver.Layer, pipes, out: Path, emit) -> dict:
    cell = cells.get(spec.cell)
    manifest = {
        "format": FORMAT, "cell": spec.cell, "input_size": spec.input_size,
        "hidden_size": spec.hidden_size, "direction": spec.direction,
        "gates": list(cell.gates), "states": list(cell.states), "saved": list(cell.saved_channels(spec.hidden_size)),
        "dxp_is_dhg": cell.dxp_is_dhg, "vectors": len(cell.channels),
        "onehot": spec.onehot, "panel": plan.layout.panel,
        "layout": plan.layout.to_dict(), "device": "cuda" if plan.cuda else "cpu",
        **({"cuda_graphs": plan.layout.cuda_graphs} if plan.cuda else {}),
        "target": str(plan.target), "target_requested": spec.target, "schedule": spec.schedule,
        "halide_version": cache.halide_version(), "halstm_code": code_hash(),
        "entry_points": _entry_points(spec) | (
            {"halstm_cuda_init": ["void *context: the CUcontext to run in; call first. "
                                  "Every array argument is then a device pointer"],
             "halstm_cuda_set_context": ["void *context: the CUcontext of the calling "
                                         "thread's next calls (NULL: halstm_cuda_init's)"]}
            if plan.cuda else {}) | (
            {"halstm_cublas_init": ["const char *library: cuBLAS's shared library (a path or "
                                    "soname); call after halstm_cuda_init"]}
            if plan.layout.vendor_gemm else {}),
        "pipelines": [f"halstm_{k}" for k in plan.kinds],
        "emitted": sorted(emit),
        "schedule_notes": [n for p in pipes for n in p.notes],
        "knobs": dict(spec.knobs), "precision": spec.precision, "gemm": spec.gemm,
    }
    if plan.layout.split is not None:   # how the driver's threads take a time loop's steps
        manifest["split"] = {"quantum": layer.split_quantum,
                             "quantum_small": layer.split_quantum_small,
                             "small_below": layer.split_small_below,
                             "batch_bytes": layer.split_batch_bytes}
    if plan.link:
        manifest |= {"library": LIBRARY, "sha256": cache.file_sha256(out / LIBRARY)}
    else:
        manifest |= {"library": None, "loadable_here": False,
                     "driver_build": "c++ -O2 -std=c++17 -I. "
                     + " ".join(map(shlex.quote, driver.flags(layer)))
                     + f" {driver.MAIN} " + " ".join(f"{k}.a" for k in plan.kinds) + " runtime.a"
                     " (add -shared -fPIC -o libhalstm.so for a shared library)"}
    return manifest
