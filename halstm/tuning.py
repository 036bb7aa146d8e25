"""`halstm tune`: measure a schedule's knobs (schedules/<module>.KNOBS) for
one layer on this machine, and keep the fastest for aot.Spec to use.

    report = tune("lstm", K=512, H=512, B=64, T=100, budget=300)

Each knob is tried alone, the others at their defaults: every candidate
value is compiled, its results checked against the default library's on
the same inputs (1e-4 of the largest value), then timed against the
default in alternating rounds (forward for a forward knob, backward for a
backward one). A value is kept only where its median beats the default's
by MIN_GAIN, so a tuning never leaves a slower library in use than the
default. Winners are stored in the kernel cache's tuning.json per machine
(CPU model and count, GPU name for CUDA targets, Halide version) and per
layer (cell, sizes, direction, target, schedule); aot.Spec reads them, so
`compile`, the modules and the char LM use them without being told.
"""
from __future__ import annotations

import datetime
import json
import os
import time
from pathlib import Path

import numpy as np

from . import cache, machine

FILE = "tuning.json"
MIN_GAIN = 0.02           # a value replaces the default where it is this much faster
_read: dict = {}          # path -> (mtime, data)


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
            f"{spec.target} {spec.schedule}" + (" onehot" if spec.onehot else ""))


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


def stored(spec) -> dict:
    """The knobs kept for spec's layer on this machine ({}: the defaults)."""
    data = load()
    if not data:
        return {}
    entry = data.get(machine_key(spec.target), {}).get(layer_key(spec))
    return dict(entry["knobs"]) if entry else {}


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


def _close(got: dict, want: dict) -> bool:
    for k, w in want.items():
        g, w = np.asarray(got[k], np.float64), np.asarray(w, np.float64)
        if g.shape != w.shape or not np.all(np.abs(g - w) <= 1e-4 * np.abs(w).max() + 1e-7):
            return False
    return True


def tune(cell: str, K: int, H: int, B: int, T: int, target: str = "host",
         schedule: str | None = None, names=None, budget: float = 300.0, rounds: int = 7,
         seed: int = 0, progress: bool = True) -> dict:
    """Tune the knobs (all of the schedule's, or `names`) of the layer
    (cell, K, H) at batch B and T steps; store the winners. Returns
    {layer key: entry}, entry: knobs kept, default and best medians (ms),
    what was tried."""
    from tqdm import tqdm

    from . import aot
    from .benchmark import alternating
    from .runtime import Library
    start = time.perf_counter()
    base = {dr: aot.Spec(cell, K, H, dr, target, schedule, knobs=()) for dr in aot.DIRECTIONS}
    spec0 = base["fwd"]
    have = aot.schedule_knobs(spec0.schedule)
    if "cuda" in spec0.target.split("-"):
        raise ValueError(f"target {target!r}: tune measures CPU targets (the CUDA schedules "
                         f"have no knobs yet)")
    unknown = sorted(set(names or ()) - set(have))
    if unknown:
        raise ValueError(f"knob: schedule {spec0.schedule!r} has no knob {unknown[0]!r}; it has "
                         f"{sorted(have) or 'none'}")
    wanted = [n for n in have if names is None or n in names]
    data = _layer_data(spec0, B, T, seed)
    NS, vec, x = data["states"], data["vec"], data["x"]
    fwd0 = Library(*aot.library(base["fwd"]))
    states, saved = fwd0.forward(x, data["w_ih"], data["b_ih"], data["w_hh"], data["b_hh"],
                                 [None] * NS, vec=vec)
    states, saved = np.array(states), np.array(saved)

    def run(lib, direction):
        if direction == "fwd":
            return lambda: lib.forward(x, data["w_ih"], data["b_ih"], data["w_hh"],
                                       data["b_hh"], [None] * NS, vec=vec)
        return lambda: lib.backward(x, data["w_ih"], data["w_hh"], saved, states, data["dy"],
                                    [None] * NS, vec=vec)

    def results(lib, direction):
        out = run(lib, direction)()
        return {"states": out[0]} if direction == "fwd" else {k: v for k, v in out.items()}

    jobs = [(n, v) for n in wanted for v in have[n].candidates if v != have[n].default]
    bar = tqdm(total=len(jobs), disable=not progress, unit="value", desc="tune")
    report = {}
    for direction in aot.DIRECTIONS:
        libs = {"default": fwd0 if direction == "fwd" else Library(*aot.library(base["bwd"]))}
        want = results(libs["default"], direction)
        tried = []
        for name in [n for n in wanted if have[n].direction == direction]:
            for value in (v for v in have[name].candidates if v != have[name].default):
                if time.perf_counter() - start > budget:
                    tried.append({"knobs": {name: value}, "skipped": "time budget spent"})
                    bar.update()
                    continue
                bar.set_postfix_str(f"{direction} {name}={value}")
                lib = Library(*aot.library(aot.Spec(cell, K, H, direction, target, schedule,
                                                    knobs={name: value})))
                ok = _close(results(lib, direction), want)
                tried.append({"knobs": {name: value}, "correct": ok})
                if ok:
                    libs[f"{name}={value}"] = lib
                bar.update()
        if not tried:
            continue
        med = alternating({k: run(lib, direction) for k, lib in libs.items()}, rounds, 2,
                          lambda: None) if len(libs) > 1 else {}
        for t in tried:
            label = ",".join(f"{k}={v}" for k, v in t["knobs"].items())
            if label in med:
                t["ms"] = round(med[label] * 1e3, 3)
        default_ms = med.get("default")
        best = min(med, key=med.get) if med else "default"
        keep = {}
        if best != "default" and med[best] < (1 - MIN_GAIN) * default_ms:
            name, value = best.split("=")
            keep = {name: int(value)}
        spec = base[direction]
        report[layer_key(spec)] = {
            "knobs": keep, "B": B, "T": T, "rounds": rounds,
            "default_ms": None if default_ms is None else round(default_ms * 1e3, 3),
            "best_ms": None if not med else round(med[best] * 1e3, 3),
            "tried": tried, "when": datetime.datetime.now(datetime.timezone.utc).isoformat(
                timespec="seconds")}
    bar.close()
    store(report, spec0.target)
    return report


def report_lines(target: str = "host") -> list[str]:
    """What `halstm tune --report` prints: every layer tuned on this
    machine, what was kept and what each value measured."""
    key = machine_key(target)
    entries = load().get(key, {})
    if not entries:
        return [f"nothing tuned for {key}"]
    lines = [f"machine: {key}"]
    for layer, e in sorted(entries.items()):
        kept = ", ".join(f"{k}={v}" for k, v in e["knobs"].items()) or "defaults"
        lines.append(f"{layer}: {kept} (B={e['B']} T={e['T']}, default {e['default_ms']} ms, "
                     f"best {e['best_ms']} ms, {e['when']})")
        for t in e["tried"]:
            label = ", ".join(f"{k}={v}" for k, v in t["knobs"].items())
            how = (t.get("skipped") or ("wrong results" if not t.get("correct")
                                        else f"{t.get('ms')} ms"))
            lines.append(f"    {label}: {how}")
    return lines
