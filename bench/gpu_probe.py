"""Time one LSTM layer's forward and backward on the GPU, device-resident,
for profiling one shape (e.g. under Nsight Compute):

    python bench/gpu_probe.py --input-size 128 --hidden-size 128 --batch 16 --steps 100
    ncu --metrics gpu__time_duration.sum --print-summary per-kernel \\
        python bench/gpu_probe.py ... --reps 1

Prints the median forward and backward milliseconds and the same per step.
"""
import argparse
import statistics
import time

import numpy as np

import halstm
from halstm import cuda
from halstm.benchmark import reference_errors


def median_ms(fn, reps):
    fn()
    cuda.synchronize()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--input-size", type=int, default=256)
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--cell", choices=["lstm", "gru"], default="lstm")
    ap.add_argument("--target", default="host-cuda")
    ap.add_argument("--schedule", default=None)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--forward-only", action="store_true", help="time the forward pass only")
    ap.add_argument("--check", action="store_true",
                    help="compare the forward's output (and, unless --forward-only, the "
                         "gradients) with the numpy reference first")
    a = ap.parse_args()
    cls = halstm.LSTM if a.cell == "lstm" else halstm.GRU
    m = cls(a.input_size, a.hidden_size, target=a.target, schedule=a.schedule, seed=0)
    rng = np.random.default_rng(0)
    x = cuda.DeviceArray.from_numpy(rng.standard_normal((a.steps, a.batch, a.input_size)))
    dy = cuda.DeviceArray.from_numpy(rng.standard_normal((a.steps, a.batch, a.hidden_size)))
    if a.check:      # y, then every gradient, relative to its largest reference value
        errs = reference_errors(m, a.cell, x, m(x)[0], None if a.forward_only else dy)
        err = errs.pop("y")
        print(f"forward max relative error {err:.2e}")
        if not err < 1e-4:
            raise SystemExit(f"forward differs from the reference by {err:.2e}")
        if errs:
            worst = max(errs, key=errs.get)
            print(f"backward max relative error {errs[worst]:.2e} ({worst})")
            if not errs[worst] < 1e-3:
                raise SystemExit(f"backward differs from the reference: {errs}")
    fwd = median_ms(lambda: m(x), a.reps)
    bwd = float("nan") if a.forward_only else median_ms(lambda: m.backward(dy), a.reps)
    lib = m._lib(0, "fwd")
    print(f"{a.cell} I={a.input_size} H={a.hidden_size} B={a.batch} T={a.steps} "
          f"target {lib.manifest['target']}, schedule {lib.manifest['schedule']}")
    print(f"forward  {fwd:9.3f} ms  {1e3 * fwd / a.steps:8.2f} us/step")
    print(f"backward {bwd:9.3f} ms  {1e3 * bwd / a.steps:8.2f} us/step")


if __name__ == "__main__":
    main()
