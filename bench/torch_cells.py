"""Step-by-step decoding: halstm.torch's LSTMCell / GRUCell against
torch.nn's, and any other cell (RecurrentCell, e.g. layernorm_lstm)
against its step in PyTorch eager (the matrix products and the cell's
pointwise ops and sums as torch ops, what such a cell runs as without
halstm): a loop of --steps calls, each step's output fed back as the
next state; inference (torch.no_grad) and training (the loop, then
backward of its last h), interleaved in one process (medians of
alternating rounds; ratio halstm over the peer per mode).

    python bench/torch_cells.py --device cpu
    python bench/torch_cells.py --device cuda --cells lstm,layernorm_lstm --json out.json

Sizes are input x hidden x batch. halstm's outputs are checked against
the peer's before timing.
"""
import argparse
import json
import platform

import torch

import halstm.torch as hnn
from halstm import cells, reference
from halstm.benchmark import alternating

SIZES = ["256x256x1", "128x128x16", "512x512x64"]
CELLS = {"lstm": (hnn.LSTMCell, torch.nn.LSTMCell), "gru": (hnn.GRUCell, torch.nn.GRUCell)}


class EagerCell(torch.nn.Module):
    """A halstm cell's step in PyTorch eager with the parameters of `like`
    (a halstm.torch RecurrentCell, copied): x W_ih^T + b_ih and h W_hh^T +
    b_hh, then the cell's step function on torch tensors."""

    def __init__(self, name, like):
        super().__init__()
        self.definition = cells.definition(name)
        self.step = self.definition.step_function(reference.torch_ops(torch))
        self.params = torch.nn.ParameterDict(
            {k: torch.nn.Parameter(v.detach().clone()) for k, v in like.named_parameters()})

    def forward(self, x, hx):
        p, d = self.params, self.definition
        states = list(hx) if isinstance(hx, tuple) else [hx]
        xg = x @ p["weight_ih"].T + (p["bias_ih"] if "bias_ih" in p else 0)
        hg = states[0] @ p["weight_hh"].T + (p["bias_hh"] if "bias_hh" in p else 0)
        out = self.step(xg, hg, states, {v.name: p[v.name] for v in d.vectors})
        return out[0] if len(out) == 1 else tuple(out)


def _cells(name, I, H):
    """(halstm's cell, the peer, the peer's name) for a cell name, the peer
    with the same parameters: torch.nn's cell for lstm and gru, else
    EagerCell."""
    if name in CELLS:
        mine, theirs = CELLS[name]
        ref = theirs(I, H)
        m = mine(I, H)
        m.load_state_dict(ref.state_dict())
        return m, ref, "torch.nn"
    m = hnn.RecurrentCell(name, I, H)
    return m, EagerCell(name, m), "torch eager"


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
    print(f"{'cell':14} {'size':11} {'mode':6} {'halstm':>9} {'peer':>9} {'ratio':>6}  peer")
    for name in a.cells.split(","):
        for size in a.sizes.split(","):
            I, H, B = (int(v) for v in size.split("x"))
            torch.manual_seed(0)
            m, ref, peer = _cells(name, I, H)
            m, ref = m.to(dev), ref.to(dev)
            x = torch.randn(B, I, device=dev)
            n = len(cells.definition(name).states)
            if name in CELLS:
                state = tuple(torch.randn(B, H, device=dev) for _ in range(n))
            else:   # a state the cell reaches: one step from zeros (random ones
                with torch.no_grad():   # can sit where it is ill-conditioned)
                    state = m(x)
                state = tuple(a.clone() for a in (state if n > 1 else (state,)))
            state = state[0] if n == 1 else state
            with torch.no_grad():
                got, want = m(x, state), ref(x, state)
            got, want = (got, want) if n > 1 else ((got,), (want,))
            err = max(float((g - w).abs().max() / w.abs().max()) for g, w in zip(got, want))
            if err > 1e-4:
                raise SystemExit(f"{name} {size}: halstm differs from {peer} by {err:.1e}")
            for mode, grad in (("infer", False), ("train", True)):
                t = alternating({"halstm": _loop(m, x, state, a.steps, grad),
                                 "torch": _loop(ref, x, state, a.steps, grad)},
                                a.rounds, 2, sync)
                us = {k: 1e6 * v / a.steps for k, v in t.items()}
                ratio = us["halstm"] / us["torch"]
                print(f"{name:14} {size:11} {mode:6} {us['halstm']:9.1f} {us['torch']:9.1f} "
                      f"{ratio:5.2f}x  {peer}", flush=True)
                out["results"].append({"cell": name, "size": size, "mode": mode, "peer": peer,
                                       "halstm_us": us["halstm"], "torch_us": us["torch"],
                                       "ratio": ratio, "max_rel_err": err})
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
