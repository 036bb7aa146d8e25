"""cuBLAS against cuBLASLt, and a weight read transposed ('tn') against a
transposed copy of it ('nn'), for the GEMMs halstm's CUDA driver runs by
cuBLAS: C = A W^T, A (M x K), W (N x K), float32 with TF32 off, through
torch.mm (torch.backends.cuda.preferred_blas_library picks the library).
Times are CUDA-event medians of 7 blocks of 200 calls; the copy is made
beforehand (not timed). Then the kernels each library runs for the first
shape (torch.profiler).

    python bench/gpu_gemm_orientation.py
"""
import torch

# name: (M, K, N)
SHAPES = {
    "step fwd B128 H512 (h W_hh^T)": (128, 512, 2048),
    "step fwd B64 H1024": (64, 1024, 4096),
    "step fwd B32 H2048": (32, 2048, 8192),
    "proj large_2048 (x W_ih^T)": (1600, 2048, 8192),
    "proj deepbench": (1600, 1024, 4096),
    "proj B128 H512": (6400, 512, 2048),
}


def median_us(f, reps=200, blocks=7):
    for _ in range(10):
        f()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(blocks):
        start.record()
        for _ in range(reps):
            f()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / reps * 1e3)
    return sorted(times)[blocks // 2]


def main():
    torch.backends.cuda.matmul.allow_tf32 = False
    for name, (M, K, N) in SHAPES.items():
        a, w = torch.randn(M, K, device="cuda"), torch.randn(N, K, device="cuda")
        wt = w.t().contiguous()
        cols = []
        for lib in ("cublas", "cublaslt"):
            torch.backends.cuda.preferred_blas_library(lib)
            for op, f in (("tn", lambda: torch.mm(a, w.t())), ("nn", lambda: torch.mm(a, wt))):
                us = median_us(f)
                cols.append(f"{lib} {op} {us:9.2f}us {2 * M * N * K / us / 1e6:5.1f}TF")
        print(f"{name:34s} " + "  ".join(cols), flush=True)
    M, K, N = next(iter(SHAPES.values()))
    a, w = torch.randn(M, K, device="cuda"), torch.randn(N, K, device="cuda")
    for lib in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(lib)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                torch.mm(a, w.t())
            torch.cuda.synchronize()
        print(lib, [e.key[:60] for e in prof.key_averages() if "gemm" in e.key.lower()])
    torch.backends.cuda.preferred_blas_library("cublas")


if __name__ == "__main__":
    main()
