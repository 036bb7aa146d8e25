"""halstm.torch against the kernels called directly (halstm.LSTM), against
torch.nn.LSTM (cuDNN on the GPU), and packed variable-length batches
against the same batch padded, forward+backward, interleaved in one
process (medians of alternating rounds; ratios to torch.nn in the same run).

    python bench/torch_layers.py --device cpu --shapes small_128_b16,charrnn_512x2
    python bench/torch_layers.py --device cuda --json out.json

Variants per shape: kernels (halstm.LSTM with numpy / CUDA arrays),
halstm.torch, torch.nn; packed: lengths uniform in 1..T (seeded; the
first T), the batch as a PackedSequence, through halstm.torch and
torch.nn, with the lengths' share of the padded steps (the work a packed
batch keeps, which packed / padded approaches); bidirectional
halstm.torch and torch.nn; proj_size H/2 through halstm.torch and
torch.nn; both modules called inside torch.autocast(dtype=torch.bfloat16)
(halstm.torch then runs its bf16 kernels where the device has them;
torch.nn its bf16 LSTM), backward outside it. Each halstm.torch variant's
output is checked against torch.nn's before timing (autocast against
torch.nn's float32, to bf16's accuracy).
"""
import argparse
import json
import platform

import numpy as np
import torch

import halstm
import halstm.torch as hnn
from halstm import benchmark
from halstm.benchmark import alternating


def _check(name, got, want, tol=1e-3):
    err = float((got - want).abs().max() / want.abs().max())
    if not err <= tol:
        raise SystemExit(f"{name}: output differs from torch.nn's by {err:.2e} (> {tol})")


def variants(s, device, seed=0, only=""):
    """name -> a function running forward+backward once (the names that
    contain one of `only`'s comma-separated parts)."""
    I, H, B, T, L = s["I"], s["H"], s["B"], s["T"], s["L"]
    torch.manual_seed(seed)
    ref = torch.nn.LSTM(I, H, L).to(device)
    mine = hnn.LSTM(I, H, L).to(device)
    mine.load_state_dict(ref.state_dict())
    target = "host-cuda" if device == "cuda" else "host"
    kern = halstm.LSTM(I, H, L, target=target)
    kern.load_state_dict({k: v.detach().cpu().numpy() for k, v in ref.state_dict().items()})
    x = torch.randn(T, B, I, device=device)
    dy = torch.randn(T, B, H, device=device)
    g = torch.Generator().manual_seed(seed + 1)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = T
    packed = torch.nn.utils.rnn.pack_padded_sequence(x, lengths, enforce_sorted=False)
    bi_ref = torch.nn.LSTM(I, H, L, bidirectional=True).to(device)
    bi = hnn.LSTM(I, H, L, bidirectional=True).to(device)
    bi.load_state_dict(bi_ref.state_dict())
    P = H // 2                     # proj_size: h = W_hr m of H/2 units
    pj_ref = torch.nn.LSTM(I, H, L, proj_size=P).to(device)
    pj = hnn.LSTM(I, H, L, proj_size=P).to(device)
    pj.load_state_dict(pj_ref.state_dict())
    dyp = torch.randn(T, B, P, device=device)
    xk = x if device == "cuda" else x.numpy()
    dyk = dy if device == "cuda" else dy.numpy()

    def module(m, inp, d, autocast=False):
        def run():
            with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
                y, _ = m(inp)
            y = y.data if isinstance(y, torch.nn.utils.rnn.PackedSequence) else y
            y.backward(d.to(y.dtype))
        return run

    def kernels():
        kern(xk)
        kern.backward(dyk)

    dpk = torch.randn(packed.data.shape[0], H, device=device)
    calls = {"kernels": kernels, "halstm.torch": module(mine, x, dy),
             "torch.nn": module(ref, x, dy),
             "halstm.torch packed": module(mine, packed, dpk),
             "torch.nn packed": module(ref, packed, dpk),
             "halstm.torch bidir": module(bi, x, torch.cat([dy, dy], -1)),
             "torch.nn bidir": module(bi_ref, x, torch.cat([dy, dy], -1)),
             "halstm.torch proj": module(pj, x, dyp), "torch.nn proj": module(pj_ref, x, dyp),
             "halstm.torch autocast": module(mine, x, dy, True),
             "torch.nn autocast": module(ref, x, dy, True)}
    calls = {k: v for k, v in calls.items() if any(
        k == o[:-1] if o.endswith("$") else o in k for o in only.split(","))}
    with torch.no_grad():
        for name, m, r, inp in (("halstm.torch", mine, ref, x), ("halstm.torch packed", mine,
                                ref, packed), ("halstm.torch bidir", bi, bi_ref, x),
                                ("halstm.torch proj", pj, pj_ref, x)):
            if name in calls:
                y, want = m(inp)[0], r(inp)[0]
                _check(name, getattr(y, "data", y), getattr(want, "data", want))
        if "halstm.torch autocast" in calls:
            with torch.autocast(device, dtype=torch.bfloat16):
                y = mine(x)[0]
            _check("halstm.torch autocast", y.float(), ref(x)[0], tol=3e-2)
    return calls, lengths


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--shapes", default="small_128_b16,charrnn_512x2,deepbench_1024")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json", help="write the medians here")
    ap.add_argument("--only", default="", help="the variants whose name contains one of "
                    "these (comma-separated; a name ending in $ is matched whole)")
    a = ap.parse_args()
    shapes = benchmark.shapes()
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    torch.backends.cudnn.allow_tf32 = False     # fp32 against fp32 (torch's default: TF32)
    machine = (torch.cuda.get_device_name() if a.device == "cuda" else
               f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads")
    out = {"device": a.device, "machine": machine, "torch": torch.__version__, "shapes": {}}
    print(f"# {machine}; torch {torch.__version__}; forward+backward, median ms "
          f"of {a.rounds - a.warmup} alternating rounds")
    for name in a.shapes.split(","):
        calls, lengths = variants(shapes[name], a.device, only=a.only)
        med = {k: v * 1e3 for k, v in alternating(calls, a.rounds, a.warmup, sync).items()}
        out["shapes"][name] = {"ms": med, "lengths_mean": float(lengths.float().mean())}
        print(f"\n## {name} {shapes[name]}")
        for k, v in med.items():
            print(f"  {k:22s} {v:9.3f} ms")
        pairs = {"halstm.torch / kernels": ("halstm.torch", "kernels"),
                 "halstm.torch / torch.nn": ("halstm.torch", "torch.nn"),
                 "packed / padded (halstm.torch)": ("halstm.torch packed", "halstm.torch"),
                 "packed: halstm.torch / torch.nn": ("halstm.torch packed", "torch.nn packed"),
                 "bidir: halstm.torch / torch.nn": ("halstm.torch bidir", "torch.nn bidir"),
                 "proj: halstm.torch / torch.nn": ("halstm.torch proj", "torch.nn proj"),
                 "autocast: halstm.torch / torch.nn": ("halstm.torch autocast",
                                                       "torch.nn autocast")}
        r = {k: med[a] / med[b] for k, (a, b) in pairs.items() if a in med and b in med}
        out["shapes"][name]["ratios"] = r
        for k, v in r.items():
            print(f"  {k:34s} {v:6.3f}")
        if "packed / padded (halstm.torch)" in r:   # (the work a packed batch keeps)
            print(f"  {'lengths / padded steps':34s} "
                  f"{out['shapes'][name]['lengths_mean'] / shapes[name]['T']:6.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
