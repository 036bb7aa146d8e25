"""A step's product as one cuBLAS GEMM against split-K slices: fp32 (TF32
off) C(M, N) = A(M, K) B(N, K)^T by torch.mm, and as torch.bmm over S
slices of K (the partial products left unsummed), us a call inside a CUDA
graph of 200 calls, median of 7 replays: the shapes of the steps' products
(M: the batch, K: H, N: G*H).

    python bench/gpu_gemm_splits.py
"""
import torch
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False

def timed(fn, reps=200):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3): fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps): fn()
    ts = []
    for _ in range(7):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / reps)
    ts.sort(); return ts[3]

for (M, K, N) in [(128, 512, 2048), (64, 512, 2048), (128, 512, 1536), (64, 512, 1536),
                  (64, 1024, 4096), (32, 2048, 8192), (16, 128, 512)]:
    A = torch.randn(M, K, device="cuda"); B = torch.randn(N, K, device="cuda")
    C = torch.empty(M, N, device="cuda")
    base = timed(lambda: torch.mm(A, B.t(), out=C))
    line = f"M={M} K={K} N={N}: mm {base:.2f} us ({2*M*N*K/base/1e6:.1f} TFLOP/s)"
    for s in (2, 4, 8):
        if K % s: continue
        As = A.view(M, s, K // s).permute(1, 0, 2)      # (s, M, K/s)
        Bs = B.view(N, s, K // s).permute(1, 2, 0)      # (s, K/s, N)
        Cs = torch.empty(s, M, N, device="cuda")
        t = timed(lambda: torch.bmm(As, Bs, out=Cs))
        line += f"; split {s}: {t:.2f} us"
    print(line, flush=True)
