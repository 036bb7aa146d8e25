"""Step-by-step decoding: halstm.torch's LSTMCell / GRUCell against
torch.nn's, a loop of --steps calls, each step's output fed back as the
next state; inference (torch.no_grad) and training (the loop, then
backward of its last h), interleaved in one process (medians of
alternating rounds; ratio halstm over torch.nn per mode).

    python bench/torch_cells.py --device cpu
    python bench/torch_cells.py --device cuda --json out.json

Sizes are input x hidden x batch. halstm's outputs are checked against
torch.nn's before timing.
"""
import argparse
import json
import platform

import torch

import halstm.torch as hnn
from halstm.benchmark import alternating

SIZES = ["256x256x1", "128x128x16", "512x512x64"]
CELLS = {"lstm": (hnn.LSTMCell, torch.nn.LSTMCell), "gru": (hnn.GRUCell, torch.nn.GRUCell)}


def _loop(cell, x, state, steps, grad):
    def run():
        s = state
        with torch.set_grad_enabled(grad):
            for _ in range(steps):
                s = cell(x, s)
            if grad:
                (s[0] if isinstance(s, tuple) else s).sum().backward()
        return s
    return run


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--cells", default="lstm,gru")
    ap.add_argument("--sizes", default=",".join(SIZES))
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--json")
    a = ap.parse_args()
    dev = torch.device(a.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    machine = (torch.cuda.get_device_name() if dev.type == "cuda" else
               f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads")
    out = {"device": a.device, "machine": machine, "torch": torch.__version__,
           "steps": a.steps, "results": []}
    print(f"# {machine}; torch {torch.__version__}; {a.steps} steps a loop, median us a step")
    print(f"{'cell':5} {'size':11} {'mode':6} {'halstm':>9} {'torch.nn':>9} {'ratio':>6}")
    for name in a.cells.split(","):
        mine, theirs = CELLS[name]
        for size in a.sizes.split(","):
            I, H, B = (int(v) for v in size.split("x"))
            torch.manual_seed(0)
            ref = theirs(I, H).to(dev)
            m = mine(I, H).to(dev)
            m.load_state_dict(ref.state_dict())
            x = torch.randn(B, I, device=dev)
            h = torch.randn(B, H, device=dev)
            state = (h, torch.randn(B, H, device=dev)) if name == "lstm" else h
            with torch.no_grad():
                got, want = m(x, state), ref(x, state)
            got, want = (got, want) if name == "lstm" else ((got,), (want,))
            err = max(float((g - w).abs().max() / w.abs().max()) for g, w in zip(got, want))
            if err > 1e-4:
                raise SystemExit(f"{name} {size}: halstm differs from torch.nn by {err:.1e}")
            for mode, grad in (("infer", False), ("train", True)):
                t = alternating({"halstm": _loop(m, x, state, a.steps, grad),
                                 "torch": _loop(ref, x, state, a.steps, grad)},
                                a.rounds, 2, sync)
                us = {k: 1e6 * v / a.steps for k, v in t.items()}
                ratio = us["halstm"] / us["torch"]
                print(f"{name:5} {size:11} {mode:6} {us['halstm']:9.1f} {us['torch']:9.1f} "
                      f"{ratio:5.2f}x", flush=True)
                out["results"].append({"cell": name, "size": size, "mode": mode,
                                       "halstm_us": us["halstm"], "torch_us": us["torch"],
                                       "ratio": ratio, "max_rel_err": err})
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
