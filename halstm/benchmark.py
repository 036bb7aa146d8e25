"""Benchmark halstm schedules against peers (numpy, PyTorch) on named shapes.

Every halstm implementation is first checked against the numpy reference.
Then, per (shape, mode), every implementation (peers and schedules) is
warmed up and timed in interleaved rounds: each round runs each one for a
block of about 0.1 s, in an order that rotates from round to round. A
result is the median of its runs; a ratio to a peer is the median over
rounds of the two blocks' median ratio, so a burst of load on a shared
machine slows both sides of a pair instead of whichever happened to be
timed during it. Each (shape, mode) also records the share of CPU time
the hypervisor stole while it was timed (Linux /proc/stat; column
"steal": other guests of the host) and the share other processes of this
machine used (column "others": a build or test run beside the bench):
where either is high, every figure of that group is slower than this
machine's own.
"""
from __future__ import annotations

import importlib.resources
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from . import cells, reference
from .nn import Recurrent, no_grad

# torch_tf32: cuDNN with TF32 on (GPU targets); torch_bf16: torch.nn with
# the module and its input in bfloat16 (cuDNN, or oneDNN on a CPU);
# torch_eager: the step in PyTorch eager, stepped from Python
PEERS = ("numpy", "torch", "torch_tf32", "torch_bf16", "torch_eager", "torch_lstm", "lstm")
# torch_lstm: torch.nn.LSTM at the same shape whatever the cell (cuDNN's or
# oneDNN's vanilla LSTM: the bar for a variant no vendor ships); lstm:
# halstm's own LSTM at the same shape (what a variant costs over it)


def shapes() -> dict[str, dict]:
    """The shared benchmark shapes: name -> {I, H, B, T, L}."""
    text = importlib.resources.files("halstm").joinpath("bench_shapes.json").read_text()
    return json.loads(text)["shapes"]


def shape(name: str) -> dict:
    """A shape by name: a shared one (shapes()), or written I x H x B x T x L,
    e.g. 512x512x128x50x2. ValueError naming what was expected."""
    known = shapes()
    if name in known:
        return known[name]
    sizes = name.split("x")
    if len(sizes) == 5 and all(v.isdigit() and int(v) > 0 for v in sizes):
        return dict(zip("IHBTL", map(int, sizes)))
    raise ValueError(f"shape {name!r}: expected one of {', '.join(known)} or I x H x B x T x L "
                     f"as positive integers, e.g. 512x512x128x50x2")


def flops(cell: str, s: dict, mode: str) -> float:
    """Multiply-add FLOPs of the GEMMs (forward; backward counted as 2x)."""
    G = len(cells.info(cell)["gates"])
    fwd = sum(2.0 * s["T"] * s["B"] * G * s["H"] * ((s["I"] if l == 0 else s["H"]) + s["H"])
              for l in range(s["L"]))
    return fwd if mode == "fwd" else 3 * fwd


@dataclass
class Result:
    shape: str
    cell: str
    mode: str           # "fwd" or "fwdbwd"
    impl: str           # "halstm:<schedule>", "numpy", "torch"
    ms: float           # median
    gflops: float
    runs: int
    max_rel_err: float | None = None   # vs the reference (halstm only)
    steal: float | None = None   # share of CPU time the hypervisor took while this group ran
    others: float | None = None  # share of CPU time other processes of this machine used meanwhile
    times_ms: list = field(default_factory=list, repr=False)   # every timed run
    rounds_ms: list = field(default_factory=list, repr=False)  # each round's median
    warmup_ms: list = field(default_factory=list, repr=False)  # the untimed warm-up calls

    def row(self) -> dict:
        row = asdict(self)
        del row["times_ms"], row["rounds_ms"], row["warmup_ms"]
        return row


@dataclass
class _Timed:
    """An implementation ready to time: fn runs it once (synchronised)."""
    impl: str
    fn: object
    max_rel_err: float | None = None
    warmup_ms: list = field(default_factory=list)   # set by _interleaved


def _interleaved(timed: list, min_runs=3, min_seconds=1.0, max_runs=50,
                 block_seconds=0.1) -> tuple[list, list]:
    """Time each of `timed` in interleaved rounds after two or three
    warm-up calls each (the third only where both took block_seconds or
    more: a first call, and at times a second, may set up plans,
    workspaces or caches; they land in its warmup_ms, and the shortest
    is its run's length). A round gives each one a block of runs (as many
    as fit in block_seconds, at least one), in an order that rotates from
    round to round; a block of short runs starts with one untimed run,
    since the other runtime's worker threads (PyTorch's OpenMP pool spins
    after its work) can still hold the cores when the switch happens. Rounds go on until every one has min_runs
    rounds and min_seconds of timed runs, or max_runs runs.
    Returns (times, rounds): per implementation every run's ms, and each
    round's median ms."""
    estimate = []
    for t in timed:
        t.warmup_ms = []
        while len(t.warmup_ms) < 2 or (len(t.warmup_ms) < 3
                                       and min(t.warmup_ms) >= block_seconds * 1e3):
            start = time.perf_counter()
            t.fn()
            t.warmup_ms.append((time.perf_counter() - start) * 1e3)
        estimate.append(min(t.warmup_ms) / 1e3)
    per_block = [max(1, min(max_runs, int(block_seconds / max(e, 1e-9)))) for e in estimate]
    times, rounds = [[] for _ in timed], [[] for _ in timed]
    spent = [0.0] * len(timed)
    r = 0
    while r < min_runs or (min(spent) < min_seconds and min(map(len, times)) < max_runs):
        for k in range(len(timed)):
            i = (r + k) % len(timed)
            if estimate[i] < block_seconds:
                timed[i].fn()
            block = []
            for _ in range(per_block[i]):
                start = time.perf_counter()
                timed[i].fn()
                dt = time.perf_counter() - start
                spent[i] += dt
                block.append(dt * 1e3)
            times[i] += block
            rounds[i].append(statistics.median(block))
        r += 1
    return times, rounds


def alternating(calls: dict, rounds: int, warmup: int, sync, per_round: bool = False,
                self_timed: bool = False) -> dict:
    """Median seconds of each of `calls` (name -> function), timed from
    sync() to sync(), over `rounds` rounds that run every call once, the
    first `warmup` rounds left out (bench/gpu_ab.py, bench/gpu_host.py);
    per_round: each round's seconds instead, for ratios per round;
    self_timed: each call returns its own seconds (timed where it runs,
    e.g. in another process; sync unused).
    The order rotates from round to round: on a CPU a fixed order favoured
    one side by up to 7% between variants whose code was the same."""
    times = {k: [] for k in calls}
    order = list(calls)
    for r in range(rounds):
        for k in order[r % len(order):] + order[:r % len(order)]:
            f = calls[k]
            if self_timed:
                times[k].append(f())
                continue
            sync()
            t = time.perf_counter()
            f()
            sync()
            times[k].append(time.perf_counter() - t)
    if per_round:
        return {k: v[warmup:] for k, v in times.items()}
    return {k: statistics.median(v[warmup:]) for k, v in times.items()}


def _inputs(cell, s, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((s["T"], s["B"], s["I"])).astype(np.float32)
    dy = rng.standard_normal((s["T"], s["B"], s["H"])).astype(np.float32)
    return x, dy


def _rel(a, b) -> float:
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def numpy_step(cell):
    """The numpy step of a cell without a hand-written BPTT: halstm.reference's
    own where it has one (written apart from the definition), else the
    definition evaluated with numpy."""
    if cell in reference.STEPS:
        return reference.STEPS[cell]
    return cells.definition(cell).step_function(reference.NumpyOps)


# Steps of y a cell without a hand-written BPTT is checked over: a
# recurrence may amplify float32 rounding step after step (the layer-norm
# LSTM at charrnn_512x2 with random weights: numpy's own float32 step
# differs from float64 by 3e-5 after 25 steps, 1.4e-3 after 100), which
# would hide a wrong kernel behind a loose tolerance, or fail a right one.
CHECK_STEPS = 10


def reference_errors(m, cell, x, y, dy=None) -> dict:
    """The largest relative error of module m's output y for input x
    (numpy or device arrays, (T, B, I)) against the numpy reference in
    float64, key "y", and given dy, of each gradient of m.backward(dy)
    (which needs m's last forward to have been a training one). A cell
    without a hand-written BPTT (reference.BPTT) is checked forward only,
    over its first CHECK_STEPS steps: tests/test_cells.py checks its
    gradients by central differences."""
    params = {k: np.asarray(v, np.float64) for k, v in m.state_dict().items()}
    x64 = np.asarray(x, np.float64)
    if cell not in reference.BPTT:
        x64 = x64[:CHECK_STEPS]
        zeros = [np.zeros((m.num_layers, x64.shape[1], m.hidden_size))] * len(m._state_names)
        want, _ = reference.step_forward(numpy_step(cell), params, x64, zeros)
        return {"y": _rel(np.asarray(y)[:CHECK_STEPS], want)}
    ref = reference.forward(cell, params, x64)
    errs = {"y": _rel(np.asarray(y), ref[0])}
    if dy is not None:
        got = m.backward(dy)
        want = reference.backward(cell, ref[-1], np.asarray(dy, np.float64))
        errs |= {k: _rel(np.asarray(got[k]), w) for k, w in want.items()}
    return errs


# A variant's options after the schedule name (`halstm bench --schedules
# cuda@tf32`): the precision, or who runs the non-recurrent GEMMs.
VARIANT_OPTIONS = {"fp32": ("precision", "fp32"), "tf32": ("precision", "tf32"),
                   "bf16": ("precision", "bf16"),
                   "halide": ("gemm", "halide"), "cublas": ("gemm", "cublas")}
# Largest relative error against the float64 reference a check allows, by precision
TOLERANCE = {"fp32": 1e-3, "tf32": 3e-2, "bf16": 1e-1}


def variant(impl: str | None) -> tuple[str | None, dict]:
    """`SCHEDULE[@OPTION...]` (SCHEDULE 'default' or '' for the target's)
    -> (schedule or None, module keyword arguments); ValueError naming an
    unknown option."""
    name, *opts = (impl or "").split("@")
    kw = {}
    for o in opts:
        if o not in VARIANT_OPTIONS:
            raise ValueError(f"schedule variant {impl!r}: unknown option {o!r}; expected "
                             f"{', '.join(VARIANT_OPTIONS)}")
        key, value = VARIANT_OPTIONS[o]
        kw[key] = value
    return (None if name in ("", "default") else name), kw


def prepare_halstm(cell, name, s, schedule, mode, target="host", check=True, tol=None) -> _Timed:
    """halstm with `schedule` (a variant: see `variant`), checked against
    the reference (max relative error at most tol, by default the
    precision's TOLERANCE, else AssertionError). Mode fwd runs under
    halstm.no_grad(), as PyTorch's forward runs under torch.no_grad():
    nothing is kept for a backward."""
    label = schedule
    schedule, kw = variant(schedule)
    tol = TOLERANCE[kw.get("precision", "fp32")] if tol is None else tol
    m = Recurrent(cell, s["I"], s["H"], num_layers=s["L"], target=target, schedule=schedule,
                  seed=0, **kw)
    m.compile(backward=mode == "fwdbwd")
    x, dy = _inputs(cell, s)
    err = None
    def forward():
        if mode == "fwd":
            with no_grad():
                return m(x)
        return m(x)
    if check:
        err = max(reference_errors(m, cell, x, forward()[0],
                                   dy if mode == "fwdbwd" else None).values())
        if not err < tol:
            raise AssertionError(f"{cell} {name} schedule {schedule}: max relative error "
                                 f"{err:.2e} vs the reference exceeds {tol:g}")
    sync = lambda: None
    if m.on_gpu:        # time the kernels on device-resident data, not host copies
        from . import cuda
        x, dy, sync = cuda.DeviceArray.from_numpy(x), cuda.DeviceArray.from_numpy(dy), cuda.synchronize
    step = forward if mode == "fwd" else (lambda: (m(x), m.backward(dy)))
    return _Timed(f"halstm:{label or 'default'}", lambda: (step(), sync()), err)


def prepare_numpy(cell, name, s, mode) -> _Timed | None:
    """The numpy reference itself, in float32, stepping over time in Python
    (forward only for a cell without a hand-written BPTT: None for fwdbwd)."""
    if cell not in reference.BPTT and mode == "fwdbwd":
        return None
    x, dy = _inputs(cell, s)
    m = Recurrent(cell, s["I"], s["H"], num_layers=s["L"], seed=0)
    params = m.state_dict()
    zeros = [np.zeros((s["L"], s["B"], s["H"]), np.float32)] * len(m._state_names)

    def run():
        if cell not in reference.BPTT:
            reference.step_forward(numpy_step(cell), params, x, zeros)
            return
        out = reference.forward(cell, params, x)
        if mode == "fwdbwd":
            reference.backward(cell, out[-1], dy)
    return _Timed("numpy", run)


def _torch(device):
    """torch, or None where it (with CUDA, for a GPU device) is not installed."""
    try:
        import torch
    except ImportError:
        return None
    return None if device != "cpu" and not torch.cuda.is_available() else torch


def prepare_torch(cell, name, s, mode, device="cpu", precision="fp32") -> _Timed | None:
    """PyTorch's own module for the cell (reference.TORCH: oneDNN on
    CPU, cuDNN on GPU) in `precision` (fp32; tf32: TF32 on; bf16: module
    and tensors in bfloat16), or None where torch (with CUDA, for a GPU
    device) is not installed or has no module for the cell."""
    torch = _torch(device)
    if torch is None or cell not in reference.TORCH:
        return None
    cls, kw = reference.TORCH[cell]
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    m = getattr(torch.nn, cls)(s["I"], s["H"], num_layers=s["L"], **kw).to(device, dtype)
    x_np, dy_np = _inputs(cell, s)
    x = torch.from_numpy(x_np).to(device, dtype)
    dy = torch.from_numpy(dy_np).to(device, dtype)
    tf32 = precision == "tf32"
    sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)

    def run():
        # TF32 is a global switch: set for each run, since runs interleave
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = tf32
        try:
            if mode == "fwd":
                with torch.no_grad():
                    m(x)
            else:
                xr = x.detach().requires_grad_()
                y, _ = m(xr)
                y.backward(dy)
            sync()
        finally:
            torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    impl = ("torch" if device == "cpu" else f"torch-{device}") + (
        "" if precision == "fp32" else f"-{precision}")
    return _Timed(impl, run)


def prepare_torch_eager(cell, name, s, mode, device="cpu") -> _Timed | None:
    """The cell's step in PyTorch eager, stepped over time from Python (what
    a cell that no vendor library ships runs as): the input projection of
    all steps one GEMM a layer, then per step the recurrent GEMM and the
    step's pointwise ops; autograd for the backward. None without torch."""
    torch = _torch(device)
    if torch is None:
        return None
    d = cells.definition(cell)
    step = d.step_function(reference.torch_ops(torch))
    G, H, L = len(d.gates), s["H"], s["L"]
    gen = torch.Generator().manual_seed(0)
    bound = 1.0 / H ** 0.5

    def param(*shape, init="uniform"):
        a = ((torch.rand(*shape, generator=gen) * 2 - 1) * bound if init == "uniform"
             else torch.full(shape, float(init)))
        return a.to(device).requires_grad_()

    def bias():
        return param(G * H) if d.matrix_bias else torch.zeros(G * H, device=device)
    layers = [(param(G * H, s["I"] if k == 0 else H), param(G * H, H), bias(), bias(),
               {v.name: param((G if v.per_gate else 1) * H, init=v.init) for v in d.vectors})
              for k in range(L)]
    x_np, dy_np = _inputs(cell, s)
    x, dy = torch.from_numpy(x_np).to(device), torch.from_numpy(dy_np).to(device)
    sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)

    def forward():
        inp = x
        for w_ih, w_hh, b_ih, b_hh, vectors in layers:
            xg = inp @ w_ih.T + b_ih                       # (T, B, G*H)
            states = [torch.zeros(s["B"], H, device=device) for _ in d.states]
            ys = []
            for t in range(s["T"]):
                states = step(xg[t], states[0] @ w_hh.T + b_hh, states, vectors)
                ys.append(states[0])
            inp = torch.stack(ys)
        return inp

    def run():
        if mode == "fwd":
            with torch.no_grad():
                forward()
        else:
            forward().backward(dy)
        sync()
    return _Timed("torch-eager" if device == "cpu" else f"torch-eager-{device}", run)


def run(names, cell, scheds, target="host", peers=("numpy", "torch"), modes=("fwd", "fwdbwd"),
        progress=False, timing=None):
    """Measure every (shape, mode): peers and schedules prepared (halstm
    checked), then timed in interleaved rounds (see the module docstring).
    Returns (results, notes); a peer that is not installed is skipped with a
    note. timing: keyword arguments for the rounds (min_runs, min_seconds,
    max_runs)."""
    from tqdm import tqdm
    notes, results = [], []
    device = "cuda" if "cuda" in target.split("-") else "cpu"
    jobs = [(n, m) for n in names for m in modes]
    bar = tqdm(jobs, disable=not progress, unit="shape", file=sys.stderr)
    for name, mode in bar:
        s, timed = shape(name), []
        for impl in [*peers, *scheds]:
            bar.set_description(f"{name} {mode}: {impl or 'default'}")
            if impl == "numpy":
                t = prepare_numpy(cell, name, s, mode)
                if t is None:
                    why = f"numpy: no hand-written backward of {cell}; fwdbwd skipped"
                    if why not in notes:
                        notes.append(why)
                else:
                    timed.append(t)
            elif impl in ("torch_lstm", "lstm"):
                t = (prepare_torch("lstm", name, s, mode, device) if impl == "torch_lstm" else
                     prepare_halstm("lstm", name, s, None, mode, target))
                if t is None:
                    why = f"{impl}: torch is not installed; skipped"
                    if why not in notes:
                        notes.append(why)
                else:
                    t.impl = t.impl.replace("torch", "torch-lstm", 1) if impl == "torch_lstm" \
                        else "lstm-" + t.impl.replace(":default", "")
                    timed.append(t)
            elif impl == "torch_eager":
                t = prepare_torch_eager(cell, name, s, mode, device)
                if t is None:
                    why = "torch_eager: torch is not installed; skipped"
                    if why not in notes:
                        notes.append(why)
                else:
                    timed.append(t)
            elif impl in ("torch", "torch_tf32", "torch_bf16"):
                if impl == "torch_tf32" and device == "cpu":
                    continue                 # TF32 is a GPU mode
                t = prepare_torch(cell, name, s, mode, device,
                                  precision=impl.partition("_")[2] or "fp32")
                if t is None:
                    why = (f"torch: no torch.nn module for {cell}; skipped"
                           if cell not in reference.TORCH else
                           f"torch{' with CUDA' if device == 'cuda' else ''} is not installed; "
                           f"skipped")
                    if why not in notes:
                        notes.append(why)
                else:
                    timed.append(t)
            else:
                timed.append(prepare_halstm(cell, name, s, impl, mode, target))
        bar.set_description(f"{name} {mode}: timing {len(timed)} interleaved")
        before, own = _cpu_jiffies(), _own_seconds()
        measured = _interleaved(timed, **(timing or {}))
        after = _cpu_jiffies()
        steal, others = _steal(before, after), _others(before, after, own, _own_seconds())
        for t, times, rounds in zip(timed, *measured):
            ms = statistics.median(times)
            results.append(Result(name, cell, mode, t.impl, ms, flops(cell, s, mode) / ms / 1e6,
                                  len(times), t.max_rel_err, steal, others, times, rounds,
                                  t.warmup_ms))
    return results, notes


def _cpu_jiffies(path="/proc/stat"):
    """(steal, total, busy) CPU time since boot from /proc/stat's first
    line (busy: user, nice, system, irq, softirq), or None where there is
    none (not Linux)."""
    try:
        with open(path) as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    fields += [0] * (8 - len(fields))
    busy = fields[0] + fields[1] + fields[2] + fields[5] + fields[6]
    return fields[7], sum(fields[:8]), busy


def _own_seconds() -> float:
    """CPU time this process (all its threads) has used."""
    t = os.times()
    return t.user + t.system


def _others(before, after, own_before, own_after) -> float | None:
    """The share of all CPUs' time that processes other than this one used
    between two readings: other jobs on this machine (a build, a test run)
    slow every figure measured meanwhile, and steal does not show them."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    hz = os.sysconf("SC_CLK_TCK")
    busy = (after[2] - before[2]) / hz - (own_after - own_before)
    return max(0.0, busy / ((after[1] - before[1]) / hz))


def _steal(before, after) -> float | None:
    """The share of CPU time stolen by the hypervisor between two
    _cpu_jiffies readings: other guests on the host, which slow every
    figure measured meanwhile."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


def _ratio(r: Result, peer: Result) -> float:
    """r's time over peer's: the median over rounds of the two round medians'
    ratio where both were timed in the same rounds, else the ratio of medians."""
    if r.rounds_ms and len(r.rounds_ms) == len(peer.rounds_ms):
        return statistics.median(a / b for a, b in zip(r.rounds_ms, peer.rounds_ms))
    return r.ms / peer.ms


def ratios(results) -> list[dict]:
    """Rows with, for each halstm result, its time over each peer's (same
    shape and mode; see _ratio): below 1 means halstm is faster."""
    rows = []
    peers = [r for r in results if not r.impl.startswith("halstm")]
    for r in results:
        row = r.row()
        if r.impl.startswith("halstm"):
            for p in peers:
                if (p.shape, p.mode) == (r.shape, r.mode):
                    row[f"x_{p.impl}"] = _ratio(r, p)
        rows.append(row)
    return rows


def table(results) -> str:
    rows = ratios(results)
    peer_cols = sorted({k for row in rows for k in row if k.startswith("x_")})
    head = ["shape", "mode", "impl", "ms", "GFLOP/s", *[f"vs {c[2:]}" for c in peer_cols],
            "max rel err", "steal", "others"]
    lines = [head]
    for row in rows:
        err = row["max_rel_err"]
        lines.append([row["shape"], row["mode"], row["impl"], f"{row['ms']:.3f}",
                      f"{row['gflops']:.1f}",
                      *[f"{row[c]:.2f}x" if c in row else "" for c in peer_cols],
                      f"{err:.1e}" if err is not None else "",
                      *[f"{100 * row[k]:.0f}%" if row[k] is not None else ""
                        for k in ("steal", "others")]])
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(str(c).rjust(w) if i >= 3 else str(c).ljust(w)
                               for i, (c, w) in enumerate(zip(line, widths)))
                     for line in lines)


def write_csv(results, path) -> None:
    import csv
    rows = ratios(results)
    cols = list(dict.fromkeys(k for row in rows for k in row))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        w.writerows(rows)


def write_json(results, path) -> None:
    import platform
    from . import machine
    meta = {"machine": platform.machine(), "processor": platform.processor(),
            "python": platform.python_version(), "time": time.strftime("%Y-%m-%d %H:%M:%S"),
            **machine.facts()}
    try:
        import torch
        meta["torch"] = torch.__version__
        meta["cudnn"] = torch.backends.cudnn.version() if torch.cuda.is_available() else None
    except ImportError:
        pass
    try:
        import halide as hl
        meta["host_target"] = str(hl.get_host_target())
    except ImportError:  # pragma: no cover
        pass
    from . import tuning      # the knobs `halstm tune` kept on this machine, in effect here
    meta["tuning"] = tuning.this_machine()
    with open(path, "w") as f:
        rows = [row | {"times_ms": [round(t, 4) for t in r.times_ms],
                       "rounds_ms": [round(t, 4) for t in r.rounds_ms],
                       "warmup_ms": [round(t, 4) for t in r.warmup_ms]}
                for row, r in zip(ratios(results), results)]
        json.dump({"meta": meta, "results": rows}, f, indent=2)


def plot(results, path) -> None:
    """One panel per mode: median ms per shape (log scale), a bar per implementation."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    modes = list(dict.fromkeys(r.mode for r in results))
    names = list(dict.fromkeys(r.shape for r in results))
    impls = list(dict.fromkeys(r.impl for r in results))
    fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4.5), squeeze=False)
    width = 0.8 / len(impls)
    for ax, mode in zip(axes[0], modes):
        for k, impl in enumerate(impls):
            xs, ys = [], []
            for i, n in enumerate(names):
                for r in results:
                    if (r.shape, r.mode, r.impl) == (n, mode, impl):
                        xs.append(i + k * width)
                        ys.append(r.ms)
            ax.bar(xs, ys, width, label=impl)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names, rotation=20)
        ax.set_yscale("log")
        ax.set_ylabel("median ms (log)")
        ax.set_title(f"{results[0].cell} {mode}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
