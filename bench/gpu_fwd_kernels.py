"""Kernels of a forward without a tape (torch.no_grad, halstm.no_grad), one
layer, cuDNN's LSTM and halstm's, by CUDA time (torch.profiler): each
kernel's total, calls and time a call, per iteration.

    python bench/gpu_fwd_kernels.py IxHxBxT [IxHxBxT ...]
"""
import sys
import torch
import halstm
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

for (I, H, B, T) in [tuple(map(int, s.split("x"))) for s in sys.argv[1:]]:
    print(f"I={I} H={H} B={B} T={T}", flush=True)
    m = torch.nn.LSTM(I, H).cuda()
    x = torch.randn(T, B, I, device="cuda")
    with torch.no_grad():
        prof("cuDNN fwd", lambda: m(x))
    hm = halstm.Recurrent("lstm", I, H, target="host-cuda").compile()
    with halstm.no_grad():
        prof("halstm fwd", lambda: hm(x))
