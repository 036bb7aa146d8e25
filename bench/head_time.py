"""Time the char LM's head pipeline (halstm/model/kernels.py) alone: ms a
call, median and minimum of ROUNDS rounds of 10 calls (a GPU synchronised
after each round), at shapes N,H,V (rows, hidden units, vocabulary); with
--numpy, numpy's head (CharLM's CPU training path, BLAS on one thread as
the trainer runs it) in the same rounds, interleaved. Run it once from
each of two copies of the tree to compare their code.

    python bench/head_time.py --target host-cuda --shapes 2048,256,84 6400,512,65 --rounds 15
    python bench/head_time.py --shapes 2048,256,84 --numpy
"""
import argparse
import statistics
import time

import numpy as np
from threadpoolctl import threadpool_limits

from halstm import cuda, machine
from halstm.model import library
from halstm.model.charlm import numpy_head


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="host")
    ap.add_argument("--shapes", nargs="+", default=["2048,256,84"], metavar="N,H,V")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--numpy", action="store_true", help="time numpy's head beside it")
    ap.add_argument("--label", default="", help="a name printed on each line")
    args = ap.parse_args()
    k = library.kernels(args.target)
    put = cuda.DeviceArray.from_numpy if k.on_gpu else np.asarray
    sync = cuda.synchronize if k.on_gpu else (lambda: None)
    print(f"# {machine.summary()}; target {args.target}")
    for shape in args.shapes:
        N, H, V = (int(s) for s in shape.split(","))
        rng = np.random.default_rng(0)
        host = dict(y=rng.standard_normal((N, H)).astype(np.float32),
                    w=(0.05 * rng.standard_normal((V, H))).astype(np.float32),
                    b=rng.standard_normal(V).astype(np.float32))
        ids = rng.integers(0, V, N).astype(np.int32)
        y, w, b = (put(host[a]) for a in ("y", "w", "b"))
        t = k.targets(ids)
        calls = {"halstm": lambda: k.head(y, w, b, t, 1.0 / N)}
        if args.numpy:
            calls["numpy"] = lambda: numpy_head(host["y"], host["w"], host["b"], ids)
        times = {name: [] for name in calls}
        with threadpool_limits(1, user_api="blas"):
            for name, call in calls.items():
                for _ in range(3):
                    call()
            sync()
            for _ in range(args.rounds):
                for name, call in calls.items():
                    start = time.perf_counter()
                    for _ in range(10):
                        call()
                    sync()
                    times[name].append((time.perf_counter() - start) / 10 * 1e3)
        line = f"{args.label} N={N} H={H} V={V}".strip()
        for name, ms in times.items():
            line += f"  {name} ms median {statistics.median(ms):.3f} min {min(ms):.3f}"
        if args.numpy:
            ratios = [a / b for a, b in zip(times["halstm"], times["numpy"])]
            line += f"  halstm/numpy {statistics.median(ratios):.2f}x"
        print(line)


if __name__ == "__main__":
    main()
