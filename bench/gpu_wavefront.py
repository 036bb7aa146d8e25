"""A GPU stack's layers as a wavefront of chunks (halstm.wavefront) against
the layers one after the other: halstm.Recurrent on device arrays, forward
(no_grad) and forward+backward, each chunk count in interleaved rounds
(halstm.benchmark.alternating, per-round ratios to 1 chunk), results
checked against the 1-chunk run first.

    python bench/gpu_wavefront.py --shapes 65x512x64x100x2,512x512x128x50x2 --chunks 1,2,4

A shape is I x H x B x T x L; "auto" in --chunks is wavefront.chunks' choice;
--precision fp32, tf32 or bf16 (results checked to that precision's tolerance);
--dropout P between layers (training mode; each check on a fresh module of
the same seed: the same masks); --api torch: halstm.torch on CUDA tensors.
"""
import argparse
import os
import statistics

import numpy as np

import halstm
from halstm import cuda, machine, wavefront
from halstm.benchmark import alternating


def kernels_api(cell, I, H, L, B, T, a):
    """(make a module, fwd(m), fwdbwd(m) -> (y, {name: grad}) as numpy) of
    halstm.Recurrent on device arrays."""
    rng = np.random.default_rng(0)
    x = cuda.DeviceArray.from_numpy(rng.standard_normal((T, B, I)).astype(np.float32))
    dy = cuda.DeviceArray.from_numpy(rng.standard_normal((T, B, H)).astype(np.float32))

    def make():
        return halstm.Recurrent(cell, I, H, num_layers=L, target="host-cuda", seed=0,
                                precision=a.precision, dropout=a.dropout)

    def fwd(m):
        with halstm.no_grad():
            return m(x)[0]

    def fwdbwd(m):
        return m(x)[0], m.backward(dy)

    def host(r):
        return r[0].numpy(), {k: np.asarray(v) for k, v in r[1].items()}
    return make, fwd, fwdbwd, host


def torch_api(cell, I, H, L, B, T, a):
    """As kernels_api, of halstm.torch on CUDA tensors (masks from torch's
    generator, seeded before each call)."""
    import torch
    import halstm.torch as hnn
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, B, I, generator=g).cuda()
    dy = torch.randn(T, B, H, generator=g).cuda()

    def make():
        torch.manual_seed(0)
        return hnn.Recurrent(cell, I, H, num_layers=L, dropout=a.dropout,
                             precision=a.precision).cuda()

    def fwd(m):
        with torch.no_grad():
            return m(x)[0]

    def fwdbwd(m):
        torch.manual_seed(1)
        m.zero_grad(set_to_none=False)
        y = m(x)[0]
        y.backward(dy)
        return y, {n: p.grad for n, p in m.named_parameters()}

    def host(r):
        return r[0].detach().cpu().numpy(), {k: v.cpu().numpy() for k, v in r[1].items()}
    return make, fwd, fwdbwd, host


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="65x512x64x100x2,512x512x128x50x2")
    ap.add_argument("--cells", default="lstm")
    ap.add_argument("--chunks", default="1,2,4,auto")
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--precision", default="fp32", choices=("fp32", "tf32", "bf16"))
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--api", default="kernels", choices=("kernels", "torch"))
    a = ap.parse_args()
    sync = cuda.synchronize
    if a.api == "torch":
        import torch
        sync = torch.cuda.synchronize
    for cell in a.cells.split(","):
        for shape in a.shapes.split(","):
            I, H, B, T, L = map(int, shape.split("x"))
            make, fwd, fwdbwd, host = (kernels_api if a.api == "kernels" else torch_api)(
                cell, I, H, L, B, T, a)
            m = make()
            auto = wavefront.chunks(T, B, m.n_gates if a.api == "kernels" else m._gates,
                                    I, H, L, machine.gpu_sms())

            def with_chunks(n, fn):
                def run():
                    os.environ["HALSTM_WAVEFRONT_CHUNKS"] = str(auto if n == "auto" else n)
                    try:
                        return fn()
                    finally:
                        del os.environ["HALSTM_WAVEFRONT_CHUNKS"]
                return run

            ns = a.chunks.split(",")
            want = host(with_chunks(1, lambda: fwdbwd(make()))())
            for n in ns:
                y, g = host(with_chunks(n, lambda: fwdbwd(make()))())
                scale = np.abs(want[0]).max()
                err = np.abs(y - want[0]).max() / scale
                gerr = max(np.abs(v - want[1][k]).max() / np.abs(want[1][k]).max()
                           for k, v in g.items())
                tol = {"fp32": 1e-4, "tf32": 1e-2, "bf16": 8e-2}[a.precision]
                assert err < tol and gerr < tol, (shape, n, err, gerr)
            for mode, fn in (("fwd", fwd), ("fwdbwd", fwdbwd)):
                times = alternating({n: with_chunks(n, lambda fn=fn: fn(m)) for n in ns},
                                    a.rounds, 3, sync, per_round=True)
                line = [f"{cell} {a.precision} {shape} {mode}"
                        + (f" dropout {a.dropout}" if a.dropout else "")
                        + (" halstm.torch" if a.api == "torch" else "") + ":"]
                for n in ns:
                    ratio = statistics.median(t / b for t, b in zip(times[n], times[ns[0]]))
                    label = f"auto={auto}" if n == "auto" else f"C={n}"
                    line.append(f"{label} {statistics.median(times[n]) * 1e3:.3f} ms "
                                f"({ratio:.3f}x)")
                print(" ".join(line), flush=True)


if __name__ == "__main__":
    main()
