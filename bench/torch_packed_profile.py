"""halstm.torch packed against padded forward+backward on CUDA: synchronised
and queued per-call times, then torch.profiler tables of host and GPU
time by op.

    python bench/torch_packed_profile.py I H B T L      # e.g. 1024 1024 64 25 1
"""
import sys, time
import torch
import halstm.torch as hnn
from torch.profiler import profile, ProfilerActivity
torch.backends.cudnn.allow_tf32 = False
I, H, B, T, L = map(int, sys.argv[1:6])
torch.manual_seed(0)
m = hnn.LSTM(I, H, L).cuda()
x = torch.randn(T, B, I, device="cuda"); dy = torch.randn(T, B, H, device="cuda")
lengths = torch.randint(1, T + 1, (B,), generator=torch.Generator().manual_seed(1)); lengths[0] = T
p = torch.nn.utils.rnn.pack_padded_sequence(x, lengths, enforce_sorted=False)
dp = torch.randn(p.data.shape[0], H, device="cuda")
def run(inp, d):
    y, _ = m(inp); (y.data if isinstance(y, torch.nn.utils.rnn.PackedSequence) else y).backward(d)
for name, inp, d in (("padded", x, dy), ("packed", p, dp)):
    for _ in range(5): run(inp, d)
    torch.cuda.synchronize()
    ts = []
    for _ in range(20):
        t0 = time.perf_counter(); run(inp, d); torch.cuda.synchronize(); ts.append(time.perf_counter() - t0)
    ts.sort(); print(f"{name}: median {ts[10]*1e3:.3f} ms, min {ts[0]*1e3:.3f}")
    t0 = time.perf_counter()
    for _ in range(20): run(inp, d)
    torch.cuda.synchronize(); print(f"{name}: host-queued 20 calls {(time.perf_counter()-t0)*1e3/20:.3f} ms a call")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5): run(inp, d)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=40))
for key, lib in hnn.kernels._libs.items(): print(key, lib.graph_stats())
