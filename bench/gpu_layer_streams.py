"""Two LSTM layers' forwards (halstm.torch, no_grad) one after the other,
on two CUDA streams at once, and as a wavefront of chunks of steps (layer
2's chunk c on a second stream beside layer 1's chunk c+1, an event
between them), against torch.nn.LSTM of two layers (cuDNN, TF32 off):
whether running the layers side by side would pay.

    python bench/gpu_layer_streams.py --shapes 520x512x64x100,520x512x128x50 --chunks 2,4,10

A shape is I x H x B x T, layer 1 reading I inputs and layer 2 H; I must
differ from H, so that the layers are two libraries (a library's cuBLAS
step buffers serve one call at a time). Prints median ms of 30
interleaved rounds after 5 (halstm.benchmark.alternating), each call
synchronised; "C=n" is the chunks x.chunk(n) gives.
"""
import argparse

import torch

import halstm.torch as ht
from halstm.benchmark import alternating


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="520x512x64x100,520x512x128x50,1032x1024x64x25")
    ap.add_argument("--chunks", default="2,4,10")
    a = ap.parse_args()
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    for shape in a.shapes.split(","):
        K, H, B, T = map(int, shape.split("x"))
        if K == H:
            raise SystemExit(f"--shapes {shape}: expected I other than H (two libraries)")
        m1, m2 = ht.LSTM(K, H).cuda(), ht.LSTM(H, H).cuda()
        cudnn = torch.nn.LSTM(K, H, 2).cuda()   # (its layer 2 reads H, as m2)
        x = torch.randn(T, B, K, device="cuda")
        x2 = torch.randn(T, B, H, device="cuda")    # layer 2's input in the side-by-side runs
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

        def side_by_side():
            cur = torch.cuda.current_stream()
            s1.wait_stream(cur)
            s2.wait_stream(cur)
            with torch.cuda.stream(s1):
                m1(x)
            with torch.cuda.stream(s2):
                m2(x2)
            cur.wait_stream(s1)
            cur.wait_stream(s2)

        def wavefront(chunks):
            cur = torch.cuda.current_stream()
            s1.wait_stream(cur)
            s2.wait_stream(cur)
            h1 = h2 = None
            for xc in x.chunk(chunks):
                with torch.cuda.stream(s1):
                    y1, h1 = m1(xc, h1)
                    done = torch.cuda.Event()
                    done.record(s1)
                s2.wait_event(done)
                y1.record_stream(s2)
                with torch.cuda.stream(s2):
                    _, h2 = m2(y1, h2)
            cur.wait_stream(s1)
            cur.wait_stream(s2)

        calls = {"one layer": lambda: m1(x), "two in turn": lambda: (m1(x), m2(x2)),
                 "two on two streams": side_by_side}
        calls.update({f"wavefront C={len(x.chunk(int(c)))}": lambda c=int(c): wavefront(c)
                      for c in a.chunks.split(",")})
        calls["cuDNN 2 layers"] = lambda: cudnn(x)
        with torch.no_grad():
            ms = alternating(calls, rounds=35, warmup=5, sync=torch.cuda.synchronize)
        print(f"{shape}: " + ", ".join(f"{k} {1e3 * v:.3f} ms" for k, v in ms.items()),
              flush=True)


if __name__ == "__main__":
    main()
