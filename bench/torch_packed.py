"""Packed batches against the same batch padded, through halstm.torch.LSTM,
forward+backward: padded; lengths uniform in 1..T (packed uniform); every
sequence full length (packed full: the packed path's own cost). Each alone,
then interleaved (medians of alternating rounds); on CUDA, the graph counters
of the libraries used.

    python bench/torch_packed.py cuda I H B T L     # e.g. cuda 128 128 16 100 1
"""
import sys
import torch
import halstm.torch as hnn
from halstm.benchmark import alternating
torch.backends.cudnn.allow_tf32 = False
dev = sys.argv[1]
I, H, B, T, L = map(int, sys.argv[2:7])
torch.manual_seed(0)
m = hnn.LSTM(I, H, L).to(dev)
x = torch.randn(T, B, I, device=dev); dy = torch.randn(T, B, H, device=dev)
lengths = torch.randint(1, T + 1, (B,), generator=torch.Generator().manual_seed(1)); lengths[0] = T
p = torch.nn.utils.rnn.pack_padded_sequence(x, lengths, enforce_sorted=False)
dp = torch.randn(p.data.shape[0], H, device=dev)
full = torch.nn.utils.rnn.pack_padded_sequence(x, torch.full((B,), T), enforce_sorted=False)
dfull = torch.randn(full.data.shape[0], H, device=dev)
def run(inp, d):
    def f():
        y, _ = m(inp); (y.data if isinstance(y, torch.nn.utils.rnn.PackedSequence) else y).backward(d)
    return f
sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
calls = {"padded": run(x, dy), "packed uniform": run(p, dp), "packed full": run(full, dfull)}
for k in calls:
    med = alternating({k: calls[k]}, 8, 2, sync)
    print(f"{k:16s} alone {med[k]*1e3:8.3f} ms")
med = alternating(calls, 8, 2, sync)
for k, v in med.items(): print(f"{k:16s} interleaved {v*1e3:8.3f} ms")
if dev == "cuda":
    for key, lib in hnn.kernels._libs.items(): print(key, lib.graph_stats())
