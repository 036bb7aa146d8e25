"""Step-by-step cells on a GPU: how their library calls ran (from a
cached CUDA graph, captured into a new one, directly: the driver's
graph_stats) in one loop of 50 steps, and us a step with the libraries'
graphs on and off (Library.use_graphs) against torch.nn's cell,
alternating rounds. Inference (torch.no_grad) and training (the loop, then
the backward of its last h); every call of a training loop gets new state
arrays, so its graphs are captured, not replayed.

    python bench/cuda_cells_graphs.py
"""
import statistics
import time

import torch

import halstm.torch as hnn
import halstm.torch.kernels as kernels

CASES = [("lstm", 256, 1), ("lstm", 128, 16), ("gru", 256, 1)]   # cell, I = H, batch
CLASSES = {"lstm": (hnn.LSTMCell, torch.nn.LSTMCell), "gru": (hnn.GRUCell, torch.nn.GRUCell)}
STEPS = 50


def loops(cell, x, state):
    def infer():
        s = state
        with torch.no_grad():
            for _ in range(STEPS):
                s = cell(x, s)

    def train():
        s = state
        for _ in range(STEPS):
            s = cell(x, s)
        (s[0] if isinstance(s, tuple) else s).sum().backward()
    return {"infer": infer, "train": train}


def graph_counts(libs) -> list:
    """replays, captures, direct runs so far, summed over libs."""
    return [sum(lib.graph_stats()[k] for lib in libs) for k in ("replays", "captures", "direct")]


def main():
    for name, n, B in CASES:
        torch.manual_seed(0)
        mine, theirs = (c(n, n).cuda() for c in CLASSES[name])
        mine.load_state_dict(theirs.state_dict())
        x = torch.randn(B, n, device="cuda")
        h = torch.randn(B, n, device="cuda")
        state = (h, torch.randn(B, n, device="cuda")) if name == "lstm" else h
        ours, ref = loops(mine, x, state), loops(theirs, x, state)
        for mode in ("infer", "train"):
            for f in (ours[mode], ours[mode], ref[mode]):
                f()
            libs = [lib for lib, _ in kernels._found.values()]
            before = graph_counts(libs)
            ours[mode]()
            torch.cuda.synchronize()
            runs = [b - a for a, b in zip(before, graph_counts(libs))]
            times = {"graphs": [], "direct": [], "torch.nn": []}
            for _ in range(9):
                for k in times:
                    for lib in libs:
                        lib.use_graphs(k != "direct")
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    for _ in range(5):
                        (ref if k == "torch.nn" else ours)[mode]()
                    torch.cuda.synchronize()
                    times[k].append((time.perf_counter() - t) / (5 * STEPS) * 1e6)
            for lib in libs:
                lib.use_graphs(True)
            print(f"{name} {n}x{n}x{B} {mode}: a loop's calls replayed / captured / direct "
                  f"{runs}; us a step: " + ", ".join(f"{k} {statistics.median(v):.1f}"
                                                     for k, v in times.items()), flush=True)


if __name__ == "__main__":
    main()
