"""The numpy API's bidirectional LSTM layer on the CPU: its directions one
after the other ("in turn") against as the module runs them (at once where
a direction's steps want half the cores or fewer), forward+backward,
medians of alternating rounds; then torch.nn's bidirectional LSTM in
rounds of its own (its OpenMP threads spin after its work and would slow
whatever runs next).

    python bench/cpu_bidir.py I H B T      # e.g. 128 128 16 100
"""
import sys
import time

import numpy as np
import torch

import halstm
from halstm import nn


def main():
    I, H, B, T = map(int, sys.argv[1:5])
    m = halstm.LSTM(I, H, 1, bidirectional=True, seed=0)
    ref = torch.nn.LSTM(I, H, 1, bidirectional=True)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((T, B, I)).astype(np.float32)
    dy = rng.standard_normal((T, B, 2 * H)).astype(np.float32)
    xt, dyt = torch.from_numpy(x), torch.from_numpy(dy)
    as_module = nn._RNN._each_direction

    def in_turn(self, fn, lib):
        return [fn(d, None) for d in range(self.num_directions)]

    def ours(each):
        def run():
            nn._RNN._each_direction = each
            m(x)
            m.backward(dy)
        return run

    def torch_nn():
        y, _ = ref(xt)
        y.backward(dyt)

    med = {}
    for calls in ({"in turn": ours(in_turn), "module": ours(as_module)}, {"torch.nn": torch_nn}):
        for f in calls.values():
            f()
            f()
        times = {k: [] for k in calls}
        for _ in range(11):
            for k, f in calls.items():
                t0 = time.perf_counter()
                f()
                times[k].append(time.perf_counter() - t0)
        med |= {k: 1e3 * np.median(v) for k, v in times.items()}
    threads = {f"{k[1]} lane {k[2]}": (lib.step_threads(), lib.step_threads_wanted())
               for k, lib in m._libs.items()}
    print(f"I={I} H={H} B={B} T={T}:", ", ".join(f"{k} {v:.2f} ms" for k, v in med.items()),
          f"| module / in turn {med['module'] / med['in turn']:.3f}, "
          f"module / torch.nn {med['module'] / med['torch.nn']:.3f} | step threads "
          f"(ran, wanted) {threads}")


if __name__ == "__main__":
    main()
