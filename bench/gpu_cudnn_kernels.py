"""cuDNN's kernels for one LSTM layer's forward+backward through
torch.nn.LSTM (float32, TF32 off), by CUDA time (torch.profiler): which
GEMMs and step kernels it runs, and how long each takes.

    python bench/gpu_cudnn_kernels.py --input-size 2048 --hidden-size 2048 --batch 32 --steps 50
"""
import argparse

import torch


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--input-size", type=int, default=2048)
    ap.add_argument("--hidden-size", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--iterations", type=int, default=2)
    a = ap.parse_args()
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    I, H, B, T = a.input_size, a.hidden_size, a.batch, a.steps
    m = torch.nn.LSTM(I, H).cuda()
    x = torch.randn(T, B, I, device="cuda", requires_grad=True)
    dy = torch.randn(T, B, H, device="cuda")

    def step():
        y, _ = m(x)
        y.backward(dy)
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(a.iterations):
            step()
        torch.cuda.synchronize()
    print(f"I={I} H={H} B={B} T={T}, forward+backward, {a.iterations} iterations")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20))


if __name__ == "__main__":
    main()
