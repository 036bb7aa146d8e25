"""Time the char LM's head pipeline (halstm/model/kernels.py) alone: ms a
call, median and minimum of ROUNDS rounds of 10 calls (a GPU synchronised
after each round), at shapes N,H,V (rows, hidden units, vocabulary).
Run it once from each of two copies of the tree to compare their code.

    python bench/head_time.py --target host-cuda --shapes 2048,256,84 6400,512,65 --rounds 15
"""
import argparse
import time

import numpy as np

from halstm import cuda, machine
from halstm.model import library


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="host")
    ap.add_argument("--shapes", nargs="+", default=["2048,256,84"], metavar="N,H,V")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--label", default="", help="a name printed on each line")
    args = ap.parse_args()
    k = library.kernels(args.target)
    put = cuda.DeviceArray.from_numpy if k.on_gpu else np.asarray
    sync = cuda.synchronize if k.on_gpu else (lambda: None)
    print(f"# {machine.summary()}; target {args.target}")
    for shape in args.shapes:
        N, H, V = (int(s) for s in shape.split(","))
        rng = np.random.default_rng(0)
        y = put(rng.standard_normal((N, H)).astype(np.float32))
        w = put((0.05 * rng.standard_normal((V, H))).astype(np.float32))
        b = put(rng.standard_normal(V).astype(np.float32))
        t = k.targets(rng.integers(0, V, N).astype(np.int32))
        for _ in range(5):
            k.head(y, w, b, t, 1.0 / N)
        sync()
        times = []
        for _ in range(args.rounds):
            start = time.perf_counter()
            for _ in range(10):
                k.head(y, w, b, t, 1.0 / N)
            sync()
            times.append((time.perf_counter() - start) / 10 * 1e3)
        print(f"{args.label} N={N} H={H} V={V} head ms median {np.median(times):.3f} "
              f"min {min(times):.3f}")


if __name__ == "__main__":
    main()
