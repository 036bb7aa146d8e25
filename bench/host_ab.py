"""Host time of halstm.torch's cell calls, the runtime of an older commit
against the tree's, in one process: the loaded libraries' Library class
swapped between `halstm/runtime.py` as it was at REV and as it is, in
alternating rounds, with the kernels' entry a no-op, so that what is timed
is the Python and torch work around the kernels (the part a change to
runtime.py moves), free of the machine's drift between processes.

    python bench/host_ab.py --old REV|FILE [--device cpu|cuda] [--mode infer|train]

A call is an LSTMCell step (I = H = --size, batch --batch): infer, under
torch.no_grad(); train, a loop of 10 steps and the backward of the last h,
per step. Prints the medians of each side (us a step) and the median of
the rounds' ratios new / old. The runtime at REV must have the tree's
Library attributes (its __init__ runs from the tree); it is read with `git
show`, its relative imports made absolute; given dy=None by the tree's
halstm.torch, its backward gets the zeros halstm.torch made before.
"""
import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import halstm.runtime as runtime
import halstm.torch as hnn
import halstm.torch.kernels as kernels

ROOT = Path(__file__).resolve().parent.parent


def old_runtime(rev: str):
    """halstm/runtime.py at rev (a commit, or the path of such a file), as
    a module of its own."""
    if Path(rev).is_file():
        src = Path(rev).read_text()
    else:
        src = subprocess.run(["git", "show", f"{rev}:halstm/runtime.py"], cwd=ROOT,
                             check=True, capture_output=True, text=True).stdout
    src = src.replace("from . import ", "from halstm import ").replace(
        "from .errors import", "from halstm.errors import")
    path = Path(tempfile.mkdtemp()) / "runtime_old.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("runtime_old", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def old_library(module):
    """module's Library, given dy=None (a loss of the finals alone) as the
    zeros halstm.torch made for a runtime that did not take None."""
    class OldLibrary(module.Library):
        def backward(self, x, w_ih, w_hh, saved, states, dy, *args, **kw):
            if dy is None:
                dy = x.new_zeros((states.shape[1] - 1, *states.shape[2:]))
            return super().backward(x, w_ih, w_hh, saved, states, dy, *args, **kw)
    return OldLibrary


class _NoKernels:
    """A library entry that returns at once (success)."""

    def __call__(self, *args):
        return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True,
                    help="the commit whose runtime.py is the old side, or that file's path")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--mode", default="infer", choices=("infer", "train"))
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=3000)
    a = ap.parse_args()
    old = old_runtime(a.old)
    dev, n = torch.device(a.device), a.size
    torch.manual_seed(0)
    cell = hnn.LSTMCell(n, n).to(dev)
    x = torch.randn(a.batch, n, device=dev)
    state = (torch.randn(a.batch, n, device=dev), torch.randn(a.batch, n, device=dev))

    def infer(calls):
        with torch.no_grad():
            for _ in range(calls):
                cell(x, state)
        return calls

    def train(calls):
        for _ in range(calls // 10):
            s = state
            for _ in range(10):
                s = cell(x, s)
            s[0].sum().backward()
        return calls // 10 * 10

    run = infer if a.mode == "infer" else train
    run(20)                                  # (the libraries compiled and loaded)
    libs = [lib for lib, _ in kernels._found.values()]
    for lib in libs:
        lib._entry = _NoKernels()
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    times = {"old": [], "new": []}
    sides = (("old", old_library(old)), ("new", runtime.Library))
    for r in range(a.rounds):
        for name, cls in sides if r % 2 else sides[::-1]:
            for lib in libs:
                lib.__class__ = cls
                lib._frames = {}     # (the two sides' caches of call sizes may differ in form)
            sync()
            t = time.perf_counter()
            steps = run(a.calls)
            sync()
            times[name].append((time.perf_counter() - t) / steps * 1e6)
    o, w = (statistics.median(times[k]) for k in ("old", "new"))
    ratio = statistics.median(b / c for b, c in zip(times["new"], times["old"]))
    where = torch.cuda.get_device_name() if dev.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"# {where}; LSTMCell {n}x{n}x{a.batch} {a.mode}; kernels' entry a no-op; "
          f"runtime.py at {a.old} (old) against the tree's (new); {a.rounds} alternating rounds")
    print(f"old {o:.1f} us a step, new {w:.1f} us a step, new / old {ratio:.3f}")


if __name__ == "__main__":
    sys.exit(main())
