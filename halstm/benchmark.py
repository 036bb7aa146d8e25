"""Benchmark halstm schedules against peers (numpy, PyTorch) on named shapes.

Every measurement first checks halstm's result against the numpy reference,
warms up, then reports the median of repeated runs. Peers are measured in the
same process and run, so ratios are meaningful on a noisy machine.
"""
from __future__ import annotations

import importlib.resources
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np

from . import reference
from .nn import GRU, LSTM

MODULES = {"lstm": LSTM, "gru": GRU}
PEERS = ("numpy", "torch", "torch_tf32")   # torch_tf32: cuDNN with TF32 on (GPU context)


def shapes() -> dict[str, dict]:
    """The shared benchmark shapes: name -> {I, H, B, T, L}."""
    text = importlib.resources.files("halstm").joinpath("bench_shapes.json").read_text()
    return json.loads(text)["shapes"]


def flops(cell: str, s: dict, mode: str) -> float:
    """Multiply-add FLOPs of the GEMMs (forward; backward counted as 2x)."""
    G = {"lstm": 4, "gru": 3}[cell]
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

    def row(self) -> dict:
        return asdict(self)


def _median_ms(fn, min_runs=3, min_seconds=1.0, max_runs=50) -> tuple[float, int]:
    fn()                                   # warm-up
    times = []
    start = time.perf_counter()
    while len(times) < min_runs or (time.perf_counter() - start < min_seconds
                                    and len(times) < max_runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3, len(times)


def _inputs(cell, s, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((s["T"], s["B"], s["I"])).astype(np.float32)
    dy = rng.standard_normal((s["T"], s["B"], s["H"])).astype(np.float32)
    return x, dy


def _rel(a, b) -> float:
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def bench_halstm(cell, name, s, schedule, mode, target="host", check=True, tol=1e-3) -> Result:
    m = MODULES[cell](s["I"], s["H"], num_layers=s["L"], target=target, schedule=schedule, seed=0)
    m.compile(backward=mode == "fwdbwd")
    x, dy = _inputs(cell, s)
    err = None
    if check:
        y = np.asarray(m(x)[0])
        params = {k: np.asarray(v).astype(np.float64) for k, v in m.state_dict().items()}
        ref = reference.forward(cell, params, x.astype(np.float64))
        err = _rel(y, ref[0])
        if mode == "fwdbwd":
            g = m.backward(dy)
            rg = reference.backward(cell, ref[-1], dy.astype(np.float64))
            err = max(err, *(_rel(np.asarray(g[k]), rg[k]) for k in rg))
        if not err < tol:
            raise AssertionError(f"{cell} {name} schedule {schedule}: max relative error "
                                 f"{err:.2e} vs the reference exceeds {tol:g}")
    sync = lambda: None
    if m.on_gpu:        # time the kernels on device-resident data, not host copies
        from . import cuda
        x, dy, sync = cuda.DeviceArray.from_numpy(x), cuda.DeviceArray.from_numpy(dy), cuda.synchronize
    step = (lambda: m(x)) if mode == "fwd" else (lambda: (m(x), m.backward(dy)))
    ms, runs = _median_ms(lambda: (step(), sync()))
    return Result(name, cell, mode, f"halstm:{schedule or 'default'}", ms,
                  flops(cell, s, mode) / ms / 1e6, runs, err)


def bench_numpy(cell, name, s, mode) -> Result:
    """The numpy reference itself, in float32, stepping over time in Python."""
    x, dy = _inputs(cell, s)
    m = MODULES[cell](s["I"], s["H"], num_layers=s["L"], seed=0)
    params = m.state_dict()

    def run():
        out = reference.forward(cell, params, x)
        if mode == "fwdbwd":
            reference.backward(cell, out[-1], dy)
    ms, runs = _median_ms(run)
    return Result(name, cell, mode, "numpy", ms, flops(cell, s, mode) / ms / 1e6, runs)


def bench_torch(cell, name, s, mode, device="cpu", tf32=False) -> Result | None:
    try:
        import torch
    except ImportError:
        return None
    if device != "cpu" and not torch.cuda.is_available():
        return None
    torch.backends.cudnn.allow_tf32 = tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    cls = {"lstm": torch.nn.LSTM, "gru": torch.nn.GRU}[cell]
    m = cls(s["I"], s["H"], num_layers=s["L"]).to(device)
    x_np, dy_np = _inputs(cell, s)
    x = torch.from_numpy(x_np).to(device)
    dy = torch.from_numpy(dy_np).to(device)
    sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)

    def run():
        if mode == "fwd":
            with torch.no_grad():
                m(x)
        else:
            xr = x.detach().requires_grad_()
            y, _ = m(xr)
            y.backward(dy)
        sync()
    ms, runs = _median_ms(run)
    impl = "torch" if device == "cpu" else f"torch-{device}" + ("-tf32" if tf32 else "")
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    return Result(name, cell, mode, impl, ms, flops(cell, s, mode) / ms / 1e6, runs)


def run(names, cell, scheds, target="host", peers=PEERS, modes=("fwd", "fwdbwd"),
        progress=False):
    """Measure every (shape, mode): peers first, then each schedule.
    Returns (results, notes); a peer that is not installed is skipped with a note."""
    from tqdm import tqdm
    known = shapes()
    notes, results = [], []
    device = "cuda" if "cuda" in target.split("-") else "cpu"
    jobs = [(n, m, impl) for n in names for m in modes for impl in [*peers, *scheds]]
    bar = tqdm(jobs, disable=not progress, unit="run", file=sys.stderr)
    for name, mode, impl in bar:
        bar.set_description(f"{name} {mode} {impl or 'default'}")
        s = known[name]
        if impl == "numpy":
            results.append(bench_numpy(cell, name, s, mode))
        elif impl in ("torch", "torch_tf32"):
            if impl == "torch_tf32" and device == "cpu":
                continue                 # TF32 is a GPU mode
            r = bench_torch(cell, name, s, mode, device, tf32=impl == "torch_tf32")
            if r is None:
                why = f"torch{' with CUDA' if device == 'cuda' else ''} is not installed; skipped"
                if why not in notes:
                    notes.append(why)
            else:
                results.append(r)
        else:
            results.append(bench_halstm(cell, name, s, impl, mode, target))
    return results, notes


def ratios(results) -> list[dict]:
    """Rows with, for each halstm result, its time over each peer's (same
    shape and mode): below 1 means halstm is faster."""
    rows = []
    peers = {(r.shape, r.mode, r.impl): r.ms for r in results if not r.impl.startswith("halstm")}
    for r in results:
        row = r.row()
        if r.impl.startswith("halstm"):
            for (shape, mode, impl), ms in peers.items():
                if shape == r.shape and mode == r.mode:
                    row[f"x_{impl}"] = r.ms / ms
        rows.append(row)
    return rows


def table(results) -> str:
    rows = ratios(results)
    peer_cols = sorted({k for row in rows for k in row if k.startswith("x_")})
    head = ["shape", "mode", "impl", "ms", "GFLOP/s", *[f"vs {c[2:]}" for c in peer_cols],
            "max rel err"]
    lines = [head]
    for row in rows:
        err = row["max_rel_err"]
        lines.append([row["shape"], row["mode"], row["impl"], f"{row['ms']:.3f}",
                      f"{row['gflops']:.1f}",
                      *[f"{row[c]:.2f}x" if c in row else "" for c in peer_cols],
                      f"{err:.1e}" if err is not None else ""])
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
    meta = {"machine": platform.machine(), "processor": platform.processor(),
            "python": platform.python_version(), "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        import halide as hl
        meta["host_target"] = str(hl.get_host_target())
    except ImportError:  # pragma: no cover
        pass
    with open(path, "w") as f:
        json.dump({"meta": meta, "results": ratios(results)}, f, indent=2)


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
