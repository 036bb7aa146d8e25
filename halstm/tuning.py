"""`halstm tune`: measure a schedule's knobs (schedules/knobs.py KNOBS) for
one layer on this machine, and keep the fastest for aot.Spec to use.

    report = tune("lstm", K=512, H=512, B=64, T=100, budget=300)

One knob after another, starting from what is kept for the layer (the
defaults at first): every candidate value is compiled (a knob's values at
once, each in a child process), its results checked against the default
library's on the same inputs (1e-4 of the largest value in float32,
_check_rtol), then timed against the current choice in alternating rounds
(forward for a forward knob, without its tape for one that acts only
there, Knob.infer; backward for a backward one). A value replaces the
current one only where its median beats it by MIN_GAIN, and again in
rounds of the two alone, so a tuning never leaves a slower library in use
than the one before. Winners are stored in
the kernel cache's tuning.json per machine (CPU model and count, GPU name
for CUDA targets, Halide version) and per layer (cell, sizes, direction,
target, schedule); aot.Spec reads them, so `compile`, the modules and the
char LM use them without being told.
"""
from __future__ import annotations

import datetime
import json
import os
import time
import warnings
from pathlib import Path

import numpy as np

from . import cache, machine

FILE = "tuning.json"
MIN_GAIN = 0.03           # a value replaces the current one where it is this much faster
#                           (alternating rounds of one layer vary by about 2% on the 2-core VMs)
_read: dict = {}          # path -> (mtime, data)
_warned: set = set()      # (path, layer key) whose stale knobs were warned of


def machine_key(target: str) -> str:
    """This machine as a tuning is kept for it: CPU model and count, GPU
    name for a CUDA target, Halide version."""
    f = machine.facts()
    key = f"{f['cpu']} x{f['cores']}"
    if "cuda" in str(target).split("-"):
        key += f" | {f.get('gpu', 'no GPU')}"
    return f"{key} | halide {cache.halide_version()}"


def layer_key(spec) -> str:
    return (f"{spec.cell} K={spec.input_size} H={spec.hidden_size} {spec.direction} "
            f"{spec.target} {spec.schedule}" + (" onehot" if spec.onehot else "")
            + (f" {spec.precision}" if spec.precision != "fp32" else ""))


def _path() -> Path:
    return cache.cache_dir() / FILE


def load() -> dict:
    """The tuning file: {machine key: {layer key: entry}} ({} if none)."""
    path = _path()
    try:
        mtime = path.stat().st_mtime_ns
    except OSError:           # none, or an unusable cache (cache.root says which, when used)
        return {}
    hit = _read.get(str(path))
    if hit is None or hit[0] != mtime:
        try:
            hit = (mtime, json.loads(path.read_text()))
        except (OSError, ValueError) as e:
            raise cache.CacheError(f"the tuning file {path} cannot be read ({e}); delete it "
                                   f"to go back to the schedules' defaults") from None
        _read[str(path)] = hit
    return hit[1]


def this_machine() -> dict:
    """What is kept for this machine, its CPU and (where tuned) CUDA
    targets: {machine key: {layer key: entry}}."""
    data = load()
    keys = {machine_key("host"), machine_key("host-cuda")}
    return {k: v for k, v in data.items() if k in keys}


def stored(spec) -> dict:
    """The knobs kept for spec's layer on this machine ({}: the defaults).
    A kept knob its schedule no longer has (tuned by another version of
    halstm) is left out, with a warning."""
    data = load()
    if not data:
        return {}
    entry = data.get(machine_key(spec.target), {}).get(layer_key(spec))
    if not entry:
        return {}
    from .aot import schedule_knobs
    have = schedule_knobs(spec.schedule)
    stale = sorted(k for k in entry["knobs"] if k not in have)
    where = (str(_path()), layer_key(spec))
    if stale and where not in _warned:
        _warned.add(where)
        warnings.warn(f"{where[0]}: {', '.join(stale)} (kept for {where[1]}) is no knob "
                      f"of schedule {spec.schedule!r} any more, so it is not used; "
                      f"`halstm tune` this layer again", stacklevel=2)
    return {k: v for k, v in entry["knobs"].items() if k in have}


def store(entries: dict, target: str) -> None:
    """Add {layer key: entry} for this machine, atomically under a lock."""
    from filelock import FileLock
    root = cache.root()
    with FileLock(str(root / (FILE + ".lock"))):
        data = json.loads((root / FILE).read_text()) if (root / FILE).exists() else {}
        data.setdefault(machine_key(target), {}).update(entries)
        tmp = root / f"{FILE}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, root / FILE)


def _layer_data(spec, B: int, T: int, seed: int):
    """Inputs and parameters for one layer of spec's sizes (numpy)."""
    from . import cells
    d = cells.definition(spec.cell)
    G, K, H = len(d.gates), spec.input_size, spec.hidden_size
    V = len(cells.get(spec.cell).channels)
    rng = np.random.default_rng(seed)
    u = lambda *shape: rng.uniform(-1 / np.sqrt(H), 1 / np.sqrt(H), shape).astype(np.float32)  # noqa: E731
    return {"x": rng.standard_normal((T, B, K)).astype(np.float32),
            "w_ih": u(G * H, K), "b_ih": u(G * H), "w_hh": u(G * H, H), "b_hh": u(G * H),
            "vec": np.ones((V, H), np.float32) if V else None,
            "dy": rng.standard_normal((T, B, H)).astype(np.float32), "states": len(d.states)}


def _check_rtol(precision: str) -> float:
    """How far a value's results may be from the default's, relative to the
    largest value: float32 layers differ by their summation order; in a
    TF32 or bf16 layer a value may move a product between float32 and the
    tensor-core precision (the steps by cuBLAS or the fused float32 step),
    so those get the float64 reference check's tolerance."""
    from .benchmark import TOLERANCE
    return 1e-4 if precision == "fp32" else TOLERANCE[precision]


def _close(got: dict, want: dict, rtol: float) -> bool:
    for k, w in want.items():
        g, w = np.asarray(got[k], np.float64), np.asarray(w, np.float64)
        if g.shape != w.shape or not np.all(np.abs(g - w) <= rtol * np.abs(w).max() + 1e-7):
            return False
    return True


def build_all(specs: list) -> None:
    """Build the libraries of specs into the cache at once, each in a child
    process, as many at a time as there are CPUs."""
    from concurrent.futures import ThreadPoolExecutor

    from . import aot
    with ThreadPoolExecutor(max(1, min(len(specs), os.cpu_count() or 1))) as pool:
        list(pool.map(lambda s: aot.library(s, in_child=True), specs))


def tune(cell: str, K: int, H: int, B: int, T: int, target: str = "host",
         schedule: str | None = None, names=None, budget: float = 300.0, rounds: int = 11,
         seed: int = 0, progress: bool = True, precision: str = "fp32") -> dict:
    """Tune the knobs (all of the schedule's, or `names`, that act on
    `precision`) of the layer (cell, K, H) at batch B and T steps, one knob
    after another from what is kept (the defaults at first): each knob's
    values against the current choice, the winner kept for the next knob.
    Stores and returns {layer key: entry}; entry: the knobs kept, and per
    knob the base knobs, their median (ms) and each value tried."""
    from tqdm import tqdm

    from . import aot
    from .benchmark import alternating
    from .runtime import Library
    start = time.perf_counter()

    def spec(direction, knobs):
        return aot.Spec(cell, K, H, direction, target, schedule, knobs=knobs,
                        precision=precision)
    spec0 = spec("fwd", ())
    have = aot.schedule_knobs(spec0.schedule)
    unknown = sorted(set(names or ()) - set(have))
    if unknown:
        raise ValueError(f"knob: schedule {spec0.schedule!r} has no knob {unknown[0]!r}; it has "
                         f"{sorted(have) or 'none'}")
    from . import cells
    reduces = cells.definition(cell).reduces
    for n in names or ():
        if have[n].reducing and not reduces:
            raise ValueError(f"knob: {n} acts on cells that reduce over units; {cell!r} does not")
        if have[n].pointwise and reduces:
            raise ValueError(f"knob: {n} acts on cells that do not reduce over units; "
                             f"{cell!r} does")
        if not have[n].acts_on(reduces, spec0.precision, spec0.gemm):
            why = (f"layers without {have[n].gemm} GEMMs (these: {spec0.gemm})"
                   if have[n].gemm not in (None, spec0.gemm)
                   else f"precision {spec0.precision!r} layers")
            raise ValueError(f"knob: {n} does not act on {why}")
    wanted = [n for n in have if (names is None or n in names)
              and have[n].acts_on(reduces, spec0.precision, spec0.gemm)]
    if not wanted:
        raise ValueError(f"schedule {spec0.schedule!r} has no knobs" if not have else
                         f"none of schedule {spec0.schedule!r}'s knobs ({', '.join(have)}) act "
                         f"on {cell!r} layers in {spec0.precision} with {spec0.gemm} GEMMs")
    gpu = "cuda" in spec0.target.split("-")
    data = _layer_data(spec0, B, T, seed)
    if gpu:         # the library's arrays on the GPU, results read back to compare
        from .cuda import CudaError, DeviceArray, driver, synchronize
        try:
            driver()
        except CudaError as e:
            raise ValueError(f"target {target!r}: tune times the layers on this machine's "
                             f"GPU, and there is none usable ({e})") from None
        data = {k: DeviceArray.from_numpy(v) if isinstance(v, np.ndarray) else v
                for k, v in data.items()}
    sync = synchronize if gpu else (lambda: None)
    NS, vec, x = data["states"], data["vec"], data["x"]

    libs_made: dict = {}

    def lib_for(direction, knobs):
        s = spec(direction, knobs)
        key = (direction, s.knobs)
        if key not in libs_made:
            libs_made[key] = Library(*aot.library(s))
        return libs_made[key]
    fwd0 = lib_for("fwd", ())
    states, saved = fwd0.forward(x, data["w_ih"], data["b_ih"], data["w_hh"], data["b_hh"],
                                 [None] * NS, vec=vec)
    if not gpu:       # (a CPU library's outputs are views of its workspaces)
        states, saved = np.array(states), np.array(saved)

    def run(lib, direction, infer=False):
        """A call of lib (infer: a forward without a tape)."""
        if direction == "fwd":
            return lambda: lib.forward(x, data["w_ih"], data["b_ih"], data["w_hh"],
                                       data["b_hh"], [None] * NS, vec=vec, save=not infer)
        return lambda: lib.backward(x, data["w_ih"], data["w_hh"], saved, states, data["dy"],
                                    [None] * NS, vec=vec)

    def results(lib, direction, infer=False):
        out = run(lib, direction, infer)()
        out = {"states": out[0]} if direction == "fwd" else dict(out)
        return {k: v.numpy() if gpu else v for k, v in out.items()}

    gates = len(cells.definition(cell).gates)
    bar = tqdm(total=sum(len(_values(have[n], have[n].default, gates)) for n in wanted),
               disable=not progress, unit="value", desc="tune")
    report = {}
    for direction in aot.DIRECTIONS:
        names_here = [n for n in wanted if have[n].direction == direction]
        if not names_here:
            continue
        layer = layer_key(spec(direction, ()))
        kept = stored(spec(direction, ()))
        base = lib_for(direction, kept)
        wants = {}      # the defaults' results, with the tape and without (Knob.infer)
        by_knob = []
        for name in names_here:
            infer = have[name].infer
            if infer not in wants:
                wants[infer] = results(lib_for(direction, ()), direction, infer)
            now = kept.get(name, have[name].default)
            libs, tried = {"base": base}, []
            values = _values(have[name], now, gates)
            if time.perf_counter() - start <= budget:
                bar.set_postfix_str(f"{direction} {name}: building {len(values)} libraries")
                build_all([spec(direction, {**kept, name: v}) for v in values])
            for value in values:
                bar.update()
                if time.perf_counter() - start > budget:
                    tried.append({"value": value, "skipped": "time budget spent"})
                    continue
                bar.set_postfix_str(f"{direction} {name}={value}")
                lib = lib_for(direction, {**kept, name: value})
                ok = _close(results(lib, direction, infer), wants[infer],
                            _check_rtol(spec0.precision))
                tried.append({"value": value, "correct": ok})
                if ok:
                    libs[value] = lib
            med = alternating({k: run(lib, direction, infer) for k, lib in libs.items()},
                              rounds, 2, sync) if len(libs) > 1 else {}
            # ms as the report shows them; the choice is made on these, so
            # that a kept value beats the base by MIN_GAIN in the report too
            ms = {k: round(v * 1e3, 3) for k, v in med.items()}
            for t in tried:
                if t["value"] in ms:
                    t["ms"] = ms[t["value"]]
            step = {"knob": name, "base": dict(kept), "tried": tried,
                    "base_ms": ms.get("base"), "infer": infer}
            best = min(ms, key=ms.get) if ms else "base"
            if best != "base" and ms[best] < (1 - MIN_GAIN) * ms["base"]:
                # a win among several values may be one lucky median: the
                # winner and the base again, in rounds of their own
                again = alternating({k: run(libs[k], direction, infer) for k in ("base", best)},
                                    rounds, 2, sync)
                step["again"] = {"value": best, "ms": round(again[best] * 1e3, 3),
                                 "base_ms": round(again["base"] * 1e3, 3)}
                if again[best] < (1 - MIN_GAIN) * again["base"]:
                    kept = {**kept, name: best}
                    base = libs[best]
            step["kept"] = kept.get(name, have[name].default)
            by_knob.append(step)
        report[layer] = {"knobs": {k: v for k, v in kept.items() if v != have[k].default},
                         "B": B, "T": T, "rounds": rounds, "by_knob": by_knob,
                         "when": datetime.datetime.now(datetime.timezone.utc).isoformat(
                             timespec="seconds")}
    bar.close()
    store(report, spec0.target)
    return report


def _values(knob, now: int, gates: int) -> list:
    """The candidates of `knob` that tune builds against the value `now`
    in a cell of `gates` gate blocks: one for each library the schedule
    makes of them (Knob.effective) other than now's, the default standing
    for its own."""
    seen, out = {knob.effective(now, gates)}, []
    for v in sorted(knob.candidates, key=lambda v: v != knob.default):   # the default first
        e = knob.effective(v, gates)
        if e not in seen:
            seen.add(e)
            out.append(v)
    return out


def report_lines(target: str = "host") -> list[str]:
    """What `halstm tune --report` prints: every layer tuned on this
    machine, what was kept and what each value measured."""
    key = machine_key(target)
    entries = load().get(key, {})
    if not entries:
        return [f"nothing tuned for {key}"]
    lines = [f"machine: {key}"]
    for layer, e in sorted(entries.items()):
        lines.append(f"{layer}: {_knobs_text(e['knobs'])} (B={e['B']} T={e['T']}, {e['when']})")
        for step in e["by_knob"]:
            timed = " without a tape" if step.get("infer") else ""
            a = step.get("again")
            again = (f"; {step['knob']}={a['value']} again: {a['ms']} ms against "
                     f"{a['base_ms']}" if a else "")
            lines.append(f"    {step['knob']}, from {_knobs_text(step['base'])} "
                         f"({step['base_ms']} ms{timed}{again}): kept {step['kept']}")
            for t in step["tried"]:
                how = (t.get("skipped") or ("wrong results" if not t.get("correct")
                                            else f"{t.get('ms')} ms"))
                lines.append(f"        {step['knob']}={t['value']}: {how}")
    return lines


def _knobs_text(knobs: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in knobs.items()) or "defaults"
