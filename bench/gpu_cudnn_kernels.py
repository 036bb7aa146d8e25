"""cuDNN's kernels for one LSTM layer's forward+backward through
torch.nn.LSTM (float32, TF32 off unless --precision tf32; bfloat16 with
--precision bf16), by CUDA time (torch.profiler): which
GEMMs and step kernels it runs, and how long each takes. With --halstm,
halstm's kernels for the same layer too, profiled the same way in the same
process (real clocks, unlike Nsight Compute's locked ones).

    python bench/gpu_cudnn_kernels.py --input-size 2048 --hidden-size 2048 --batch 32 --steps 50 --halstm

--cell NAME profiles that halstm cell (halstm.Recurrent) instead of its LSTM,
beside cuDNN's LSTM: e.g. --cell layernorm_lstm.
"""
import argparse

import torch

from halstm.benchmark import alternating


def profile(name, step, iterations):
    """Warm up, time 10 calls (wall, synchronized), then profile `iterations`
    calls and print the kernels by CUDA time."""
    wall = alternating({name: step}, 12, 2, torch.cuda.synchronize)[name]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iterations):
            step()
        torch.cuda.synchronize()
    busy = sum(e.device_time for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA) / iterations / 1e3
    print(f"== {name}: forward+backward, {iterations} iterations profiled; wall median "
          f"{wall * 1e3:.3f} ms, kernels {busy:.3f} ms an iteration")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20,
                                    max_name_column_width=70))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--input-size", type=int, default=2048)
    ap.add_argument("--hidden-size", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--iterations", type=int, default=2)
    ap.add_argument("--halstm", action="store_true", help="profile halstm's layer too")
    ap.add_argument("--cell", default="lstm", help="halstm's cell (halstm cells lists them)")
    ap.add_argument("--precision", default="fp32", choices=["fp32", "tf32", "bf16"],
                    help="both sides' precision: tf32 turns on cuDNN's TF32 and halstm's; "
                         "bf16 runs cuDNN's LSTM and its tensors in bfloat16, halstm's GEMMs "
                         "in bf16 tensor-core math")
    ap.add_argument("--gemm", default=None, choices=["halide", "cublas"],
                    help="who runs halstm's projection and gradient GEMMs (default: its default)")
    a = ap.parse_args()
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = a.precision == "tf32"
    I, H, B, T = a.input_size, a.hidden_size, a.batch, a.steps
    dtype = torch.bfloat16 if a.precision == "bf16" else torch.float32
    m = torch.nn.LSTM(I, H).to("cuda", dtype)
    x = torch.randn(T, B, I, device="cuda", dtype=dtype, requires_grad=True)
    dy = torch.randn(T, B, H, device="cuda", dtype=dtype)

    def step():
        y, _ = m(x)
        y.backward(dy)
    print(f"I={I} H={H} B={B} T={T}")
    profile("cuDNN", step, a.iterations)
    if a.halstm:
        import halstm
        hm = halstm.Recurrent(a.cell, I, H, target="host-cuda", precision=a.precision,
                              gemm=a.gemm).compile()
        xd = x.detach().float()         # (DLPack exports no tensor that requires grad)
        dyf = dy.float()
        profile(f"halstm {a.cell}", lambda: (hm(xd), hm.backward(dyf)), a.iterations)


if __name__ == "__main__":
    main()
