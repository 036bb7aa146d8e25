"""Time variants of one layer of a cell against each other, interleaved
round by round, so that the machine's drift (10-15% between processes on
the shared H100s) falls on every variant alike.

A variant NAME is a cache folder holding a library compiled under that
variant's settings (bench/gpu_variants.sh with COMPILE_ONLY=1 makes them:
/tmp/halstm-variant-NAME); NAME=DIR is a folder written by `halstm compile`
(e.g. by a copy of the source with one change: bench/cell_ab.sh). The GPU
by default; --target host times the CPU. Every variant is checked against the numpy
reference (forward and gradients) before timing; then each repetition runs
every variant once, in turn, and the medians are printed with their ratio
to the first variant's:

    python bench/gpu_ab.py --hidden-size 128 --batch 16 --steps 100 base B C

--infer times a forward that no backward follows (under halstm.no_grad(),
as `halstm bench --fwd` does) in place of the training forward and the
backward, and checks that forward's output against the reference too
(it may run other kernels: pipeline.LOOP).

--runtime NAME=TREE (for every variant): each variant runs in a process
of its own whose `halstm` package is TREE's (a copy of the source with
the variant's change, as bench/cell_ab.sh makes), so that a variant may
change the runtime (the Python side of the library calls) or the
manifest; the rounds still alternate, one variant's call at a time, each
call timed in its own process.
"""
import argparse
import functools
import json
import os
import subprocess
import sys
import time

import numpy as np

import halstm
from halstm import cuda
from halstm.benchmark import alternating, reference_errors


def _args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variants", nargs="+", help="names; the libraries come from "
                    "--cache-prefix + NAME")
    ap.add_argument("--cache-prefix", default="/tmp/halstm-variant-")
    ap.add_argument("--input-size", type=int, default=None, help="default: the hidden size")
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--cell", default="lstm", help="any cell of halstm.cells")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--target", default="host-cuda")
    ap.add_argument("--infer", action="store_true", help="time the no_grad forward only")
    ap.add_argument("--runtime", action="append", default=[], metavar="NAME=TREE",
                    help="run variant NAME in a process of its own, halstm from TREE")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


class Variant:
    """One variant's module, checked against the reference, and its calls:
    mode -> function (infer, or fwd and bwd)."""

    def __init__(self, a, variant: str):
        I, H, B, T = a.input_size or a.hidden_size, a.hidden_size, a.batch, a.steps
        self.gpu = "cuda" in a.target
        put = cuda.DeviceArray.from_numpy if self.gpu else (lambda v: v)
        rng = np.random.default_rng(0)
        x = put(rng.standard_normal((T, B, I)).astype(np.float32))
        dy = put(rng.standard_normal((T, B, H)).astype(np.float32))
        name, _, folder = variant.partition("=")
        os.environ["HALSTM_CACHE"] = a.cache_prefix + name
        m = (halstm.load(folder, seed=0) if folder else
             halstm.Recurrent(a.cell, I, H, target=a.target, seed=0).compile())
        if (m.input_size, m.hidden_size) != (I, H):
            raise ValueError(f"{folder} holds I={m.input_size} H={m.hidden_size}")
        self.err = max(reference_errors(m, m.cell, x, m(x)[0], dy).values())
        if a.infer:      # (the path --infer times: a forward without a tape)
            with halstm.no_grad():
                y = m(x)[0]
            self.err = max(self.err, reference_errors(m, m.cell, x, y)["y"])
        self.module = m
        if a.infer:
            self.calls = {"infer": halstm.no_grad()(lambda: m(x))}
        else:
            self.calls = {"fwd": lambda: m(x), "bwd": lambda: m.backward(dy)}
        self.sync = cuda.synchronize if self.gpu else (lambda: None)

    def captures(self) -> int:
        libs = self.module._libs.values()
        return sum(lib.graph_stats()["captures"] for lib in libs) if self.gpu else 0

    def timed(self, mode: str) -> float:
        """Seconds of one call, from sync() to sync()."""
        self.sync()
        t = time.perf_counter()
        self.calls[mode]()
        self.sync()
        return time.perf_counter() - t


def _serve(a):
    """A worker's loop (--serve, one variant): its check and the folder of
    the halstm it runs as one JSON line, then per line of stdin "run MODE" the seconds of one call, "captures"
    the graphs captured, "quit"."""
    try:
        v = Variant(a, a.variants[0])
        print(json.dumps({"err": v.err, "runtime": os.path.dirname(halstm.__file__)}),
              flush=True)
    except Exception as e:
        print(json.dumps({"failed": str(e)}), flush=True)
        return
    for line in sys.stdin:
        cmd, _, mode = line.strip().partition(" ")
        if cmd == "quit":
            return
        print(v.timed(mode) if cmd == "run" else v.captures(), flush=True)


class _Worker:
    """A variant in a process of its own (_serve), halstm from `tree`."""

    def __init__(self, variant: str, tree: str, argv: list):
        self.name = variant.partition("=")[0]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [os.path.abspath(tree)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve",
                                      *argv, variant], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, text=True)
        reply = json.loads(self.proc.stdout.readline() or '{"failed": "no reply"}')
        if "failed" in reply:
            self.quit()
            raise RuntimeError(reply["failed"])
        self.err, self.runtime = reply["err"], reply["runtime"]

    def ask(self, line: str) -> str:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        reply = self.proc.stdout.readline()
        if not reply:       # (its error went to stderr)
            raise RuntimeError(f"the worker of {self.name} ended (exit code {self.proc.wait()})")
        return reply

    def timed(self, mode: str) -> float:
        return float(self.ask(f"run {mode}"))

    def captures(self) -> int:
        return int(self.ask("captures"))

    def quit(self):
        if self.proc.poll() is None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            self.proc.wait()


def _shape_argv(a) -> list:
    argv = ["--cache-prefix", a.cache_prefix, "--hidden-size", str(a.hidden_size),
            "--batch", str(a.batch), "--steps", str(a.steps), "--cell", a.cell,
            "--target", a.target]
    if a.input_size:
        argv += ["--input-size", str(a.input_size)]
    return argv + (["--infer"] if a.infer else [])


def main():
    a = _args()
    if a.serve:
        return _serve(a)
    I, H, B, T = a.input_size or a.hidden_size, a.hidden_size, a.batch, a.steps
    trees = dict(r.partition("=")[::2] for r in a.runtime)
    names = [v.partition("=")[0] for v in a.variants]
    if trees and set(trees) != set(names):
        raise SystemExit(f"--runtime: expected one for every variant ({', '.join(names)}), "
                         f"got {', '.join(sorted(trees))}")
    runs = {}
    for variant, name in zip(a.variants, names):   # a variant that fails or differs is left out
        try:
            v = _Worker(variant, trees[name], _shape_argv(a)) if trees else Variant(a, variant)
        except Exception as e:
            print(f"  {name}: failed: {e}")
            continue
        if not v.err < 1e-3:
            print(f"  {name}: differs from the reference by {v.err:.2e}")
            continue
        runs[name] = v
    first = names[0]
    if first not in runs:
        raise SystemExit(f"the first variant, {first}, is needed for the ratios")
    modes = ("infer",) if a.infer else ("fwd", "bwd")
    # each variant times its own calls (in its process, with --runtime);
    # the first round warms up
    calls = {(n, k): functools.partial(v.timed, k) for n, v in runs.items() for k in modes}
    med = {k: s * 1e3 for k, s in
           alternating(calls, a.reps + 1, 1, None, self_timed=True).items()}
    print(f"{a.target} {a.cell} I={I} H={H} B={B} T={T}, {a.reps} interleaved rounds, medians in ms "
          f"(ratio to {first})" + (", each variant its own runtime" if trees else ""))
    for n, v in runs.items():
        times = "  ".join(f"{k} {med[n, k]:8.3f} ({med[n, k] / med[first, k]:.3f})" for k in modes)
        runtime = f"  runtime {v.runtime}" if trees else ""
        print(f"  {n:12s} {times}  graphs captured {v.captures()}{runtime}")
    for v in runs.values():
        if isinstance(v, _Worker):
            v.quit()


if __name__ == "__main__":
    main()
