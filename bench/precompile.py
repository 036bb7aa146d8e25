"""Build every library a `halstm bench` run of these cells and shapes
needs into the cache, many at once (each build runs in a child process),
so that the timed run starts with a warm cache:

    python bench/precompile.py --cells layernorm_lstm,lstm --shapes all --target host-cuda
    python bench/precompile.py --shapes deepbench_1024,512x512x128x50x2 --precisions fp32,tf32,bf16 --target host-cuda
"""
import argparse
import os
from concurrent.futures import ThreadPoolExecutor

from halstm import aot, benchmark


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", default="lstm")
    ap.add_argument("--shapes", default="all")
    ap.add_argument("--target", default="host")
    ap.add_argument("--precisions", default="fp32", help="comma-separated: fp32, tf32, bf16")
    ap.add_argument("--jobs", type=int, default=os.cpu_count())
    a = ap.parse_args()
    names = list(benchmark.shapes()) if a.shapes == "all" else a.shapes.split(",")
    specs = {aot.Spec(cell, K, s["H"], d, a.target, precision=p)
             for cell in a.cells.split(",") for s in map(benchmark.shape, names)
             for K in {s["I"], s["H"]} if K == s["I"] or s["L"] > 1 for d in aot.DIRECTIONS
             for p in a.precisions.split(",")}
    with ThreadPoolExecutor(a.jobs) as pool:
        built = pool.map(lambda s: aot.library(s, in_child=True), specs)
        for spec, (path, _) in zip(specs, built):
            print(f"{spec.describe()}: {path}")


if __name__ == "__main__":
    main()
