"""Sampling speed of a trained char LM: microseconds a character of
`generate`, with the weights packed once (fixed_weights, the default)
and packed at every call, in alternating rounds (medians).

    python bench/lm_sample.py shakespeare.npz --chars 2000 --rounds 5
"""
import argparse
import contextlib
import statistics
import time

from halstm.model import checkpoint
from halstm.model.charlm import CharLM
from halstm.model.sample import generate


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--chars", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    ckpt = checkpoint.load(a.checkpoint)
    model = CharLM.from_config(ckpt.config, len(ckpt.vocab))
    model.load_parameters(ckpt.params)
    fixed = model.rnn.fixed_weights
    ways = {"packed once": fixed, "packed every call": contextlib.nullcontext}
    texts, times = {}, {k: [] for k in ways}
    for _ in range(a.rounds):
        for name, scope in ways.items():
            model.rnn.fixed_weights = scope
            t = time.perf_counter()
            texts[name] = generate(model, ckpt.vocab, "\n", a.chars, 1.0, 1)
            times[name].append((time.perf_counter() - t) / a.chars * 1e6)
    assert len(set(texts.values())) == 1, "the two ways sampled different text"
    c = ckpt.config
    print(f"# {c.cell} {c.layers}x{c.hidden_size}, {a.chars} characters, {a.rounds} rounds")
    for name, v in times.items():
        print(f"{name:18} {statistics.median(v):7.1f} us a character")


if __name__ == "__main__":
    main()
