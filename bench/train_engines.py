"""The char LM's two engines, halstm (own head and optimizer kernels) and
torch (halstm.torch layers, torch autograd, nn.Linear, torch.optim), each
trained by `halstm train` in its own process, alternating, on the same
text and config; prints each run's training chars/s (the first step and
validation excluded, as `halstm train` reports it) and the medians.

    python bench/train_engines.py TEXT --target host --steps 150 --rounds 2 --json out.json
"""
import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile

from halstm import machine

ENGINES = ("halstm", "torch")


def one_run(text, target, engine, steps, out):
    cmd = [sys.executable, "-m", "halstm.cli", "train", text, "--steps", str(steps),
           "--target", target, "--engine", engine, "--eval-every", "0", "--save-minutes", "0",
           "-q", "--out", out]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    last = done.stderr.strip().splitlines()[-1]
    return float(re.search(r"([\d,]+) chars/s", last).group(1).replace(",", "")), last


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("text")
    ap.add_argument("--target", default="host")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json")
    a = ap.parse_args()
    print(f"# {machine.summary()}; target {a.target}; {a.steps} steps a run")
    runs = {e: [] for e in ENGINES}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(a.rounds):
            for e in ENGINES:
                cps, line = one_run(a.text, a.target, e, a.steps, f"{tmp}/{e}.npz")
                runs[e].append(cps)
                print(f"{e:7s} {line.split('; checkpoint')[0]}", flush=True)
    med = {e: statistics.median(v) for e, v in runs.items()}
    print(f"median chars/s: halstm {med['halstm']:,.0f}, torch {med['torch']:,.0f}; "
          f"torch / halstm {med['torch'] / med['halstm']:.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"target": a.target, "steps": a.steps, "machine": machine.facts(),
                       "chars_per_s": runs, "median": med}, f, indent=1)


if __name__ == "__main__":
    main()
