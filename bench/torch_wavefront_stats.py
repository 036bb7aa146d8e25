"""halstm.torch's charrnn_512x2 LSTM on the GPU in training mode, dropout
0 and 0.3, the layers in turn (1 chunk) and as a wavefront (4): the mean
time of 20 forward+backward calls and of 20 forwards (no_grad), each after
5 warm-up calls, and how the libraries' time loops ran over the 20
training calls (CUDA graph replays, captures, direct launches; counts
shown per cell and direction, one library's where the two layers' differ).
Captures that grow with every call mean a loop's pointers never recur.

    python bench/torch_wavefront_stats.py
"""
import os
import time

import torch

import halstm.torch as hnn



def stats() -> dict:
    return {k: lib.graph_stats() for k, lib in hnn.kernels._libs.items()}


for p in (0.0, 0.3):
    torch.manual_seed(0)
    m = hnn.LSTM(65, 512, num_layers=2, dropout=p).cuda()
    x = torch.randn(100, 64, 65, device="cuda")
    dy = torch.randn(100, 64, 512, device="cuda")
    for chunks in ("1", "4"):
        os.environ["HALSTM_WAVEFRONT_CHUNKS"] = chunks

        def step():
            y = m(x)[0]
            y.backward(dy)
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        before = stats()
        t = time.perf_counter()
        for _ in range(20):
            step()
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t) / 20 * 1e3
        after = stats()
        delta = {k[0].split("|")[0] + "|" + k[1]:        # (spec's cell | direction)
                 {s: after[k][s] - before.get(k, {}).get(s, 0) for s in after[k]}
                 for k in after if after[k] != before.get(k)}
        print(f"dropout {p} chunks {chunks}: fwdbwd {dt:.3f} ms; graphs over 20 calls: {delta}",
              flush=True)
        with torch.no_grad():
            for _ in range(5):
                m(x)
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(20):
                m(x)
            torch.cuda.synchronize()
        print(f"dropout {p} chunks {chunks}: fwd {(time.perf_counter() - t) / 20 * 1e3:.3f} ms",
              flush=True)
