"""Kernels of one layer on the GPU by CUDA time (torch.profiler): each
kernel's total, calls and time a call, per iteration. cuDNN's LSTM
(cudnn) and GRU (cudnn_gru) and halstm's cells; the forward without a
tape (torch.no_grad, halstm.no_grad), and with --fwdbwd also the forward
with its backward.

    python bench/gpu_fwd_kernels.py [--cells cudnn,lstm,cudnn_gru,gru,peephole_lstm] [--fwdbwd] IxHxBxT ...
"""
import argparse

import torch

import halstm
from halstm import cuda

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False


def prof(name, fn, iters=4):
    for _ in range(5): fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
        for _ in range(iters): fn()
        torch.cuda.synchronize()
    print(f"== {name}")
    rows = {}
    for e in p.key_averages():
        if e.device_time_total > 0:
            rows[e.key] = (e.device_time_total / iters, e.count / iters)
    tot = sum(v[0] for v in rows.values())
    print(f"   total {tot:.1f} us an iteration")
    for k, (t, n) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:12]:
        print(f"   {t:9.1f} us  {n:6.0f} calls  {t/n:7.2f} us/call  {k[:90]}")


CUDNN = {"cudnn": ("LSTM", torch.nn.LSTM), "cudnn_gru": ("GRU", torch.nn.GRU)}


def cudnn(name, I, H, x, dy, fwdbwd):
    label, module = CUDNN[name]
    m = module(I, H).cuda()
    with torch.no_grad():
        prof(f"cuDNN {label} fwd", lambda: m(x))
    if fwdbwd:
        xg = x.clone().requires_grad_()
        prof(f"cuDNN {label} fwdbwd", lambda: m(xg)[0].backward(dy))


def cell(name, I, H, x, dy, fwdbwd):
    m = halstm.Recurrent(name, I, H, target="host-cuda", seed=0).compile(backward=fwdbwd)
    with halstm.no_grad():
        prof(f"halstm {name} fwd", lambda: m(x))
    if fwdbwd:
        xd, dyd = cuda.DeviceArray.from_numpy(x.cpu().numpy()), cuda.DeviceArray.from_numpy(dy.cpu().numpy())
        prof(f"halstm {name} fwdbwd", lambda: (m(xd), m.backward(dyd)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", default="cudnn,lstm")
    ap.add_argument("--fwdbwd", action="store_true")
    ap.add_argument("shapes", nargs="+", metavar="IxHxBxT")
    a = ap.parse_args()
    for I, H, B, T in (tuple(map(int, s.split("x"))) for s in a.shapes):
        print(f"I={I} H={H} B={B} T={T}", flush=True)
        x = torch.randn(T, B, I, device="cuda")
        dy = torch.randn(T, B, H, device="cuda")
        for name in a.cells.split(","):
            (cudnn if name in CUDNN else cell)(name, I, H, x, dy, a.fwdbwd)


if __name__ == "__main__":
    main()
