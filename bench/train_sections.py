"""Where a char LM training step's time goes (the halstm engine): ms a step
in each section of the trainer's timer (one-hot input, rnn forward, head,
rnn backward, optimizer), with the optimizer as Halide pipelines (the
default, optim.KernelAdam) or in numpy (optim.Adam), each variant in a
process of its own, alternating; the first 10 steps are left out.

    python bench/train_sections.py TEXT --steps 40 --rounds 3 [--target host]
"""
import argparse
import subprocess
import sys
import time

from halstm import machine

VARIANTS = ("numpy", "kernels")


def one_run(text: str, target: str, steps: int, optimizer: str) -> None:
    """Train `steps` steps after 10 (default config) and print the sections."""
    from halstm.model import optim
    from halstm.model import train as train_mod
    from halstm.model.config import Config
    from halstm.model.data import Corpus
    if optimizer == "numpy":
        make = optim.make
        train_mod.optim.make = lambda config, params, kernels=None: make(config, params, None)
    config = Config(target=target)
    with open(text) as f:
        corpus = Corpus.from_text(f.read(), text, config.seq_len, config.batch_size)
    trainer = train_mod.Trainer(config, corpus)
    for _ in range(10):
        trainer.train_step()
    trainer.timer.reset()
    start = time.perf_counter()
    for _ in range(steps):
        trainer.train_step()
    ms = (time.perf_counter() - start) / steps * 1e3
    chars = config.seq_len * config.batch_size
    parts = ", ".join(f"{k} {v / steps * 1e3:.2f}" for k, v in trainer.timer.seconds.items())
    print(f"{optimizer:8s} {ms:7.2f} ms a step, {chars / ms * 1e3:9,.0f} chars/s | {parts}",
          flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("text")
    ap.add_argument("--target", default="host")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--one", choices=VARIANTS, help=argparse.SUPPRESS)   # (a child run)
    a = ap.parse_args()
    if a.one:
        return one_run(a.text, a.target, a.steps, a.one)
    print(f"# {machine.summary()}; target {a.target}; {a.steps} steps a run after 10; "
          f"sections in ms a step")
    for _ in range(a.rounds):
        for v in VARIANTS:
            subprocess.run([sys.executable, __file__, a.text, "--target", a.target,
                            "--steps", str(a.steps), "--one", v], check=True)


if __name__ == "__main__":
    main()
