"""Text generation from a trained CharLM."""
from __future__ import annotations

import numpy as np
from threadpoolctl import threadpool_limits

from ..nn import no_grad
from .charlm import CharLM
from .data import Vocab


def generate(model: CharLM, vocab: Vocab, prime: str, length: int,
             temperature: float = 1.0, seed: int | None = None) -> str:
    """prime followed by `length` sampled characters. The prime is read in
    one forward call; each new character is drawn from softmax(logits /
    temperature) with a numpy Generator seeded by `seed` (temperature 0:
    the most likely character). ValueError if prime is empty or has
    characters outside the vocabulary."""
    if not prime:
        raise ValueError("prime: expected at least one character")
    missing = vocab.missing(prime)
    if missing:
        raise ValueError(f"prime has characters outside the model's vocabulary: {missing!r}")
    if temperature < 0 or temperature != temperature:
        raise ValueError(f"temperature: expected a value >= 0, got {temperature!r}")
    rng = np.random.default_rng(seed)
    ids = vocab.encode(prime).reshape(-1, 1)
    state = model.zero_state(1)
    out = []
    # numpy's BLAS on one thread, entered once: it cost 1 ms a character
    # inside the loop (sampling took 3.2 ms a character, now 1.1, at 2x256)
    # the weights stay as they are: the kernels pack them once, not per character
    with threadpool_limits(1, user_api="blas"), no_grad(), model.rnn.fixed_weights():
        for _ in range(length):
            nxt, state = _next(model, ids, state, temperature, rng)
            out.append(nxt)
            ids = np.array([[nxt]], np.int32)
    return prime + vocab.decode(out)


def _next(model, ids, state, temperature, rng):
    """The next character id after reading ids (T, 1), and the new state."""
    y, state = model.hidden(ids, state)
    logits = model.logits(y[-1:]).astype(np.float64)[0]
    if temperature == 0:
        return int(np.argmax(logits)), state
    z = logits / temperature
    p = np.exp(z - z.max())
    cdf = np.cumsum(p)
    return min(int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right")), len(p) - 1), state
