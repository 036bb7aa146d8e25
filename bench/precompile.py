"""Build every library a `halstm bench` run of these cells and shapes
needs into the cache, many at once (each build runs in a child process),
so that the timed run starts with a warm cache:

    python bench/precompile.py --cells layernorm_lstm,lstm --shapes all --target host-cuda
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
    ap.add_argument("--jobs", type=int, default=os.cpu_count())
    a = ap.parse_args()
    known = benchmark.shapes()
    names = list(known) if a.shapes == "all" else a.shapes.split(",")
    specs = {aot.Spec(cell, K, s["H"], d, a.target)
             for cell in a.cells.split(",") for s in (known[n] for n in names)
             for K in {s["I"], s["H"]} if K == s["I"] or s["L"] > 1 for d in aot.DIRECTIONS}
    with ThreadPoolExecutor(a.jobs) as pool:
        built = pool.map(lambda s: aot.library(s, in_child=True), specs)
        for spec, (path, _) in zip(specs, built):
            print(f"{spec.describe()}: {path}")


if __name__ == "__main__":
    main()
