"""Where a char LM training step's time goes (the halstm engine): ms a step
in each section of the trainer's timer (one-hot input, rnn forward, head,
rnn backward, optimizer). Variants: `pipelines` (the default: the head
and the optimizer as Halide pipelines), `numpy-optimizer` (optim.Adam's
numpy update), `numpy-head` (CharLM(kernels=False): numpy's head, CPU
targets); each in a process of its own, alternating; the first 10 steps
are left out.

    python bench/train_sections.py TEXT --steps 40 --rounds 3 [--target host] [--variants a,b]
"""
import argparse
import subprocess
import sys
import time

from halstm import machine

VARIANTS = ("pipelines", "numpy-optimizer", "numpy-head")


def one_run(text: str, target: str, steps: int, variant: str) -> None:
    """Train `steps` steps after 10 (default config) and print the sections."""
    from halstm.model import CharLM, optim
    from halstm.model import train as train_mod
    from halstm.model.config import Config
    from halstm.model.data import Corpus
    if variant == "numpy-optimizer":
        make = optim.make
        train_mod.optim.make = lambda config, params, kernels=None: make(config, params, None)
    if variant == "numpy-head":
        pipeline_head = CharLM.from_config
        CharLM.from_config = staticmethod(lambda c, vocab: pipeline_head(c, vocab, kernels=False))
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
    print(f"{variant:15s} {ms:7.2f} ms a step, {chars / ms * 1e3:9,.0f} chars/s | {parts}",
          flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("text")
    ap.add_argument("--target", default="host")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--one", choices=VARIANTS, help=argparse.SUPPRESS)   # (a child run)
    a = ap.parse_args()
    if a.one:
        return one_run(a.text, a.target, a.steps, a.one)
    variants = a.variants.split(",")
    if not set(variants) <= set(VARIANTS):
        ap.error(f"--variants: expected names from {', '.join(VARIANTS)}, got {a.variants!r}")
    print(f"# {machine.summary()}; target {a.target}; {a.steps} steps a run after 10; "
          f"sections in ms a step")
    for _ in range(a.rounds):
        for v in variants:
            subprocess.run([sys.executable, __file__, a.text, "--target", a.target,
                            "--steps", str(a.steps), "--one", v], check=True)


if __name__ == "__main__":
    main()
