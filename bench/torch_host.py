"""Host time of a small layer's forward and backward on the GPU: halstm.torch
against the kernels called directly (halstm.LSTM with CUDA tensors),
torch.nn.LSTM (cuDNN), and a bare torch.autograd.Function of the same
inputs and outputs that runs no kernel (the floor of any module built on
one: its forward allocates the states and copies the finals, as
halstm.torch's does; its backward returns empty gradients).

Each variant runs `--calls` forwards, then as many forward+backward, in a
row without synchronising; "host" is the time until the last call returns
over the calls, "all" until the device is idle again. Where host > the
GPU's own time the layer is bound by the host. Also: the host time of the
library calls themselves (runtime.Library.forward / backward, of which the
driver call `_call`) inside halstm.torch's. Medians of alternating rounds.

    python bench/torch_host.py [--shape small_128_b16] [--rounds 15]
"""
import argparse
import collections
import statistics
import time

import torch

import halstm
import halstm.torch as hnn
from halstm import benchmark, runtime


class _Bare(torch.autograd.Function):
    """halstm.torch's _Layer without the kernels: the states array, y a view
    of it, two finals copied; backward allocates the weights' gradients."""

    @staticmethod
    def forward(ctx, x, w_ih, b_ih, w_hh, b_hh):
        ctx.save_for_backward(x, w_ih, w_hh)
        T, B, H = x.shape[0], x.shape[1], w_hh.shape[1]
        states = x.new_empty((2, T + 1, B, H))
        return states[0, 1:], states[0, T].clone(), states[1, T].clone()

    @staticmethod
    def backward(ctx, dy, dh, dc):
        x, w_ih, w_hh = ctx.saved_tensors
        return (None, torch.empty_like(w_ih), w_ih.new_empty(len(w_ih)),
                torch.empty_like(w_hh), w_hh.new_empty(len(w_hh)))


# the library calls' host time inside halstm.torch's (seconds, summed)
_spent = collections.defaultdict(float)


def _timed(cls, name, tag):
    f = getattr(cls, name)

    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            _spent[tag] += time.perf_counter() - t
    setattr(cls, name, timed)


def variants(s):
    I, H, B, T, L = s["I"], s["H"], s["B"], s["T"], s["L"]
    torch.manual_seed(0)
    ref = torch.nn.LSTM(I, H, L).cuda()
    mine = hnn.LSTM(I, H, L).cuda()
    mine.load_state_dict(ref.state_dict())
    kern = halstm.LSTM(I, H, L, target="host-cuda")
    kern.load_state_dict({k: v.detach().cpu().numpy() for k, v in ref.state_dict().items()})
    x = torch.randn(T, B, I, device="cuda")
    dy = torch.randn(T, B, H, device="cuda")
    ws = [ref.weight_ih_l0, ref.bias_ih_l0, ref.weight_hh_l0, ref.bias_hh_l0]

    def module(m):
        return (lambda: m(x), lambda: m(x)[0].backward(dy))

    return {"kernels": (lambda: kern(x), lambda: (kern(x), kern.backward(dy))),
            "halstm.torch": module(mine), "torch.nn": module(ref),
            "bare Function": (lambda: _Bare.apply(x, *ws),
                              lambda: _Bare.apply(x, *ws)[0].backward(dy))}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="small_128_b16")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=10)
    a = ap.parse_args()
    s = benchmark.shapes()[a.shape]
    torch.backends.cudnn.allow_tf32 = False
    calls = variants(s)
    for fwd, both in calls.values():      # (kernels compiled, graphs captured)
        for _ in range(3):
            fwd(), both()
    _timed(runtime.Library, "forward", "Library.forward")
    _timed(runtime.Library, "backward", "Library.backward")
    _timed(runtime.Library, "_call", "driver calls")
    times = {(k, m, w): [] for k in calls for m in ("fwd", "fwdbwd") for w in ("host", "all")}
    spent = collections.defaultdict(list)
    order = list(calls)
    for r in range(a.rounds):
        for k in order[r % len(order):] + order[:r % len(order)]:
            for mode, f in zip(("fwd", "fwdbwd"), calls[k]):
                _spent.clear()
                torch.cuda.synchronize()
                t = time.perf_counter()
                for _ in range(a.calls):
                    f()
                host = time.perf_counter() - t
                torch.cuda.synchronize()
                times[(k, mode, "host")].append(host / a.calls)
                times[(k, mode, "all")].append((time.perf_counter() - t) / a.calls)
                if k == "halstm.torch" and mode == "fwdbwd":
                    for tag, v in _spent.items():
                        spent[tag].append(v / a.calls)
    med = {key: statistics.median(v) * 1e6 for key, v in times.items()}
    print(f"# {torch.cuda.get_device_name()}; torch {torch.__version__}; {a.shape} {s}; "
          f"us a call, medians of {a.rounds} alternating rounds of {a.calls} calls in a row")
    print(f"{'variant':16s} {'fwd host':>9s} {'fwd all':>9s} {'fwdbwd host':>12s} "
          f"{'fwdbwd all':>11s}")
    for k in calls:
        print(f"{k:16s} {med[(k, 'fwd', 'host')]:9.1f} {med[(k, 'fwd', 'all')]:9.1f} "
              f"{med[(k, 'fwdbwd', 'host')]:12.1f} {med[(k, 'fwdbwd', 'all')]:11.1f}")
    print("halstm.torch's forward+backward, host us in: " + ", ".join(
        f"{tag} {statistics.median(v) * 1e6:.1f}" for tag, v in spent.items()))


if __name__ == "__main__":
    main()
