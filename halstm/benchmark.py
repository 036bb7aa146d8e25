"""Benchmark halstm schedules against peers (numpy, PyTorch) on named shapes.

Every measurement first checks halstm's result against the numpy reference,
warms up, then reports the median of repeated runs. Peers are measured in the
same process and run, so ratios are meaningful on a noisy machine.
"""
from __future__ import annotations

import importlib.resources
import json
import statistics
import time
from dataclasses import asdict, dataclass

import numpy as np

from . import reference
from .nn import GRU, LSTM

MODULES = {"lstm": LSTM, "gru": GRU}
PEERS = ("numpy", "torch")


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
        y = m(x)[0]
        params = {k: v.astype(np.float64) for k, v in m.state_dict().items()}
        ref = reference.forward(cell, params, x.astype(np.float64))
        err = _rel(y, ref[0])
        if mode == "fwdbwd":
            g = m.backward(dy)
            rg = reference.backward(cell, ref[-1], dy.astype(np.float64))
            err = max(err, *(_rel(g[k], rg[k]) for k in rg))
        if not err < tol:
            raise AssertionError(f"{cell} {name} schedule {schedule}: max relative error "
                                 f"{err:.2e} vs the reference exceeds {tol:g}")
    fn = (lambda: m(x)) if mode == "fwd" else (lambda: (m(x), m.backward(dy)))
    ms, runs = _median_ms(fn)
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


def bench_torch(cell, name, s, mode, device="cpu") -> Result | None:
    try:
        import torch
    except ImportError:
        return None
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
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
    return Result(name, cell, mode, "torch" if device == "cpu" else f"torch-{device}", ms,
                  flops(cell, s, mode) / ms / 1e6, runs)
