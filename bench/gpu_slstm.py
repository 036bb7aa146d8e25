"""The sLSTM (xLSTM's scalar-memory LSTM) on the GPU: halstm's `slstm` cell
through halstm.torch against FlashRNN's sLSTM kernels (the only fused sLSTM
we know of; its input projection by torch, as in ../shared/tools/
gpu_flashrnn.py), torch.nn.LSTM (cuDNN's vanilla LSTM, the bar a variant
is held to) and halstm's LSTM, float32 (TF32 off), one process, rounds
interleaved (benchmark.alternating: the order rotates); medians, ratios
the median of the per-round ratios.

FlashRNN gets halstm's weights (gate order i, f, z, o for both), and its
y is checked against halstm's before timing: the two differ only where
xLSTM's code takes m = i~ at n = 0 (the first step), which scales c, n
and m but not h. FlashRNN's fused kernel is tried first, its cuBLAS +
pointwise backend ("cuda") where the fused one fails (or only that one
with --flashrnn cuda).

    python bench/gpu_slstm.py [--shapes small_128_b16,...] [--rounds 15] [--json F]
"""
import argparse
import json
import statistics
import time

import torch

import halstm.torch as hnn
from halstm import benchmark, machine


def _flashrnn_layers(m, L, H):
    """halstm.torch module m's weights as FlashRNN's (Wx weights, R, b) per
    layer: R (4, 1, H, H), R[g, 0] = W_hh's block of gate g as it is (the
    orientation whose outputs matched halstm's, FlashRNN's torch backend
    "vanilla" on a CPU: 1e-7)."""
    out = []
    for k in range(L):
        w_ih, w_hh = getattr(m, f"weight_ih_l{k}"), getattr(m, f"weight_hh_l{k}")
        b = getattr(m, f"bias_ih_l{k}") + getattr(m, f"bias_hh_l{k}")
        R = w_hh.detach().reshape(4, 1, H, H).clone()
        out.append((w_ih.detach().clone().requires_grad_(True), R.requires_grad_(True),
                    b.detach().view(4, 1, H).clone().requires_grad_(True)))
    return out


def _flashrnn(layers, backend, B, T, H):
    import importlib
    from flashrnn import flashrnn
    # FlashRNN's own device query does not build against CUDA 13 (cudaDeviceProp
    # lost fields); its fused kernels need these four facts, which torch knows
    # (as ../shared/tools/gpu_flashrnn.py does)
    if torch.cuda.is_available():
        pr = torch.cuda.get_device_properties(0)
        importlib.import_module("flashrnn.flashrnn.flashrnn").get_gpu_info = lambda device_id: {
            "maxThreadsPerBlock": 1024,
            "regsPerMultiprocessor": getattr(pr, "regs_per_multiprocessor", 65536),
            "multiProcessorCount": pr.multi_processor_count,
            "sharedMemPerBlockOptin": getattr(pr, "shared_memory_per_block_optin", 232448)}

    def run(x):                                   # x (B, T, I)
        h = x
        for w, R, b in layers:
            wx = (h @ w.T).view(B, T, 4, 1, H)
            out, _ = flashrnn(wx, R, b, function="slstm", backend=backend, dtype="float32")
            h = out[0].reshape(B, T, H)
        return h
    return run


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _no_grad(fwd):
    with torch.no_grad():
        fwd()


def one_shape(name, I, H, B, T, L, rounds, backends, dev="cuda"):
    torch.manual_seed(0)
    x = torch.randn(T, B, I, device=dev)
    xb = x.transpose(0, 1).contiguous()            # FlashRNN's (B, T, I)
    dy = torch.randn(T, B, H, device=dev)
    dyb = dy.transpose(0, 1).contiguous()
    sl = hnn.Recurrent("slstm", I, H, num_layers=L).to(dev)
    impls = {"halstm-slstm": (lambda: sl(x)[0], dy)}
    lstm = hnn.LSTM(I, H, num_layers=L).to(dev)
    impls["halstm-lstm"] = (lambda: lstm(x)[0], dy)
    cudnn = torch.nn.LSTM(I, H, num_layers=L).to(dev)
    impls["cudnn-lstm"] = (lambda: cudnn(x)[0], dy)
    notes = {}
    y_ref = sl(x)[0].detach().transpose(0, 1)
    for backend in backends:
        try:
            run = _flashrnn(_flashrnn_layers(sl, L, H), backend, B, T, H)
            t0 = time.perf_counter()
            y = run(xb)
            _sync()
            err = float((y.detach() - y_ref).abs().max() / y_ref.abs().max())
            notes[f"flashrnn-{backend}"] = {"first_call_s": round(time.perf_counter() - t0, 1),
                                           "max_rel_diff_vs_halstm": err}
            impls[f"flashrnn-{backend}"] = (lambda run=run: run(xb), dyb)
            break
        except Exception as e:                      # (the next backend, if any)
            notes[f"flashrnn-{backend}"] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    calls = {}
    for k, (fwd, g) in impls.items():
        calls[k, "fwd"] = lambda fwd=fwd: _no_grad(fwd)
        calls[k, "fwdbwd"] = lambda fwd=fwd, g=g: fwd().backward(g)
    # (the first two rounds: warm-up)
    times = benchmark.alternating(calls, rounds + 2, 2, _sync, per_round=True)
    rows = []
    for mode in ("fwd", "fwdbwd"):
        ours = times["halstm-slstm", mode]
        for k in impls:
            t = times[k, mode]
            rows.append({"shape": name, "mode": mode, "impl": k,
                         "ms": round(1e3 * statistics.median(t), 4),
                         "slstm_over_this": round(statistics.median(
                             a / b for a, b in zip(ours, t)), 3)})
    return rows, notes


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="small_128_b16,latency_256_b1,charrnn_512x2,"
                    "deepbench_1024,large_2048")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--flashrnn", default="cuda_fused,cuda",
                    help="FlashRNN backends to try in turn")
    ap.add_argument("--device", default="cuda", help="cuda; cpu for a quick check of the script")
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    gpu = torch.cuda.get_device_name(0) if a.device == "cuda" else None
    out = {"machine": {**machine.facts(), "gpu": gpu, "torch": torch.__version__,
                       "cudnn": torch.backends.cudnn.version()},
           "rows": [], "notes": {}}
    print(f"# {out['machine']}", flush=True)
    print(f"{'shape':16} {'mode':7} {'impl':20} {'ms':>9}  slstm/this", flush=True)
    for name in a.shapes.split(","):
        I, H, B, T, L = (benchmark.shape(name)[k] for k in "IHBTL")
        rows, notes = one_shape(name, I, H, B, T, L, a.rounds, a.flashrnn.split(","), a.device)
        out["rows"] += rows
        out["notes"][name] = notes
        print(f"# {name}: {json.dumps(notes)}", flush=True)
        for r in rows:
            print(f"{r['shape']:16} {r['mode']:7} {r['impl']:20} {r['ms']:9.3f}  "
                  f"{r['slstm_over_this']:.3f}x", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
