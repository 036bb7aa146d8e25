"""Training: truncated BPTT over parallel streams, validation, checkpoints.

    corpus = Corpus.from_text(*data.load(None), config.seq_len, config.batch_size)
    trainer = Trainer(config, corpus)
    trainer.run(out="charlm.npz")            # Ctrl-C: checkpoint, then return
    trainer = Trainer.resume(checkpoint.load("charlm.npz"), corpus)

A run is deterministic for a given config (seed included): weights start
from CharLM(seed), the data order from Streams(rng(seed, 1)), and a
checkpoint holds all the state that changes, so that a resumed run
continues exactly as an uninterrupted one.
"""
from __future__ import annotations

import collections
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict

import numpy as np
from threadpoolctl import threadpool_limits

from . import checkpoint as ckpt_mod
from . import optim
from .charlm import CharLM
from .config import RESUMABLE, Config
from .data import Corpus, Streams

HISTORY = ("train_step", "train_loss", "val_step", "val_loss")


class Timer:
    """Seconds spent per named section, summed over calls."""

    def __init__(self, sync=None):
        self.seconds = collections.defaultdict(float)
        self.calls = collections.defaultdict(int)
        self.sync = sync      # e.g. halstm.cuda.synchronize: a section ends when the GPU is done

    @contextmanager
    def __call__(self, name):
        t = time.perf_counter()
        try:
            yield
        finally:
            if self.sync is not None:
                self.sync()
            self.seconds[name] += time.perf_counter() - t
            self.calls[name] += 1

    def reset(self):
        self.seconds.clear()
        self.calls.clear()


class Trainer:
    """A model, its optimizer, the data streams and the carried state."""

    def __init__(self, config: Config, corpus: Corpus):
        config.validate()
        self.config, self.corpus, self.vocab = config, corpus, corpus.vocab
        self.model = CharLM.from_config(config, len(self.vocab))
        self.params = self.model.parameters()
        self.optimizer = optim.make(config, self.params, self.model.kernels)
        self.streams = Streams(corpus.train, config.seq_len, config.batch_size,
                               np.random.default_rng([config.seed, 1]))
        self.state = self.model.zero_state(config.batch_size)
        self.step = 0
        self.history = {k: [] for k in HISTORY}
        self.timer = Timer()
        self.train_seconds, self.train_chars = 0.0, 0      # of the last run()
        self._val = None

    # ---- checkpoints -------------------------------------------------------
    def checkpoint(self) -> ckpt_mod.Checkpoint:
        return ckpt_mod.Checkpoint(
            config=self.config, vocab=self.vocab, step=self.step,
            params={k: _host(v) for k, v in self.params.items()},
            optimizer=self.optimizer.state_dict(), state=tuple(_host(s) for s in self.state),
            position=self.streams.position(),
            corpus={"source": self.corpus.source, "sha256": self.corpus.sha256,
                    "length": int(len(self.corpus.train) + len(self.corpus.val))},
            history={k: np.asarray(v, np.int64 if k.endswith("step") else np.float64)
                     for k, v in self.history.items()})

    def save(self, path) -> None:
        ckpt_mod.save(path, self.checkpoint())

    @classmethod
    def resume(cls, ckpt: ckpt_mod.Checkpoint, corpus: Corpus,
               config: Config | None = None) -> "Trainer":
        """A trainer in the state ckpt was saved in. config (default: the
        checkpoint's) may differ from the checkpoint's only in RESUMABLE
        fields. CheckpointError if ckpt does not fit the config or corpus."""
        config = config or ckpt.config
        for f, v in asdict(ckpt.config).items():
            if f not in RESUMABLE and getattr(config, f) != v:
                raise ckpt_mod.CheckpointError(
                    f"the checkpoint was trained with {f} = {v!r}, not {getattr(config, f)!r}")
        if ckpt.vocab != corpus.vocab:
            raise ckpt_mod.CheckpointError(
                f"the checkpoint's vocabulary ({len(ckpt.vocab)} characters) differs from "
                f"that of {corpus.source} ({len(corpus.vocab)} characters)")
        if ckpt.corpus is None or ckpt.corpus.get("sha256") != corpus.sha256:
            src = (ckpt.corpus or {}).get("source", "another text")
            raise ckpt_mod.CheckpointError(
                f"the checkpoint was trained on {src}, not on {corpus.source} (the texts "
                f"differ); give the same text to resume")
        trainer = cls(config, corpus)
        try:
            trainer.model.load_parameters(ckpt.params)
            trainer.optimizer.load_state_dict(ckpt.optimizer)
            expected = trainer.state
            if len(ckpt.state) != len(expected) or any(
                    s.shape != e.shape for s, e in zip(ckpt.state, expected)):
                raise ValueError(f"carried state: expected {len(expected)} arrays of shape "
                                 f"{expected[0].shape}, got {[s.shape for s in ckpt.state]}")
            trainer.state = trainer.model.as_state(ckpt.state)
            if ckpt.position is None:
                raise ValueError("no data position")
            trainer.streams.set_position(ckpt.position)
            trainer.history = {k: ckpt.history.get(k, np.zeros(0)).tolist() for k in HISTORY}
        except (KeyError, ValueError, TypeError) as e:
            raise ckpt_mod.CheckpointError(f"the checkpoint does not fit its own config "
                                           f"(corrupt?): {str(e).splitlines()[0][:200]}") from None
        trainer.step = ckpt.step
        return trainer

    # ---- one step, validation ----------------------------------------------
    def lr(self) -> float:
        return optim.lr_at(self.config, self.step)

    def train_step(self) -> float:
        """One optimizer step on the next batch; returns its mean loss (nats/char)."""
        timer = self.timer
        x, y, new_epoch = self.streams.batch()
        if new_epoch:
            self.state = self.model.zero_state(self.config.batch_size)
        with threadpool_limits(1, user_api="blas"):
            loss, grads, self.state = self.model.loss_and_grads(x, y, self.state, timer)
        with timer("optimizer"):
            self.optimizer.clip_and_step(self.params, grads, self.lr(), self.config.clip)
        self.step += 1
        self.history["train_step"].append(self.step)
        self.history["train_loss"].append(loss)
        return loss

    def _val_streams(self):
        if self._val is None:
            ids, T = self.corpus.val, self.config.seq_len
            n = len(ids) - 1
            E = min(self.config.eval_batch_size, max(1, n // T))
            length = n // E
            idx = np.arange(E)[:, None] * length + np.arange(length)[None, :]
            self._val = (np.ascontiguousarray(ids[idx].T), np.ascontiguousarray(ids[idx + 1].T))
        return self._val

    def evaluate(self, stop=None) -> float | None:
        """Mean cross-entropy (nats/char) over the whole validation text, read
        as eval_batch_size contiguous streams from a zero state, seq_len
        steps at a time with the state carried (the training state is
        untouched). None if stop() turns true on the way."""
        x, y = self._val_streams()
        state = self.model.zero_state(x.shape[1])
        total, T = 0.0, self.config.seq_len
        with threadpool_limits(1, user_api="blas"):
            for t in range(0, x.shape[0], T):
                if stop is not None and stop():
                    return None
                loss, state = self.model.loss(x[t:t + T], y[t:t + T], state)
                total += loss
        return total / y.size

    # ---- the loop ----------------------------------------------------------
    def run(self, until: int | None = None, out=None, progress: bool = True,
            handle_sigint: bool = True) -> str:
        """Train up to step `until` (default and at most config.steps).
        Validates every eval_every steps and at config.steps; with `out`,
        saves every save_every steps, at the end and when interrupted.
        Ctrl-C (SIGINT, main thread) finishes the current step (dropping a
        validation under way), saves and returns "interrupted"; a second
        Ctrl-C aborts at once. Returns
        "done" (config.steps reached) or "stopped" (until reached)."""
        cfg = self.config
        until = cfg.steps if until is None else min(until, cfg.steps)
        interrupted = threading.Event()
        previous = None                       # the SIGINT handler to put back, once replaced
        if handle_sigint and threading.current_thread() is threading.main_thread():
            def on_sigint(signum, frame):
                interrupted.set()
                signal.signal(signal.SIGINT, previous)   # a second Ctrl-C aborts
            previous = signal.getsignal(signal.SIGINT)
            if previous is None:                  # installed from C: restore the default
                previous = signal.SIG_DFL
            signal.signal(signal.SIGINT, on_sigint)
        bar = _progress(cfg.steps, self.step, progress)
        chars = cfg.seq_len * cfg.batch_size
        window = collections.deque(maxlen=20)
        self.train_seconds, self.train_chars = 0.0, 0      # excluding each run's first step
        val = self.history["val_loss"][-1] if self.history["val_loss"] else None
        try:
            first = True
            while self.step < until and not interrupted.is_set():
                t0 = time.perf_counter()
                loss = self.train_step()
                dt = time.perf_counter() - t0
                if not first:                   # the first step may compile kernels
                    self.train_seconds += dt
                    self.train_chars += chars
                    window.append(dt)
                first = False
                if (cfg.eval_every and self.step % cfg.eval_every == 0) or self.step == cfg.steps:
                    with self.timer("validation"):
                        v = self.evaluate(stop=interrupted.is_set)
                    if v is not None:                 # None: Ctrl-C during validation
                        val = v
                        self.history["val_step"].append(self.step)
                        self.history["val_loss"].append(val)
                if out is not None and cfg.save_every and self.step % cfg.save_every == 0:
                    self.save(out)
                if bar is not None:
                    bar.update(1)
                    speed = f"{chars * len(window) / sum(window):,.0f}" if window else "-"
                    bar.set_postfix_str(f"loss {loss:.3f}  val {'-' if val is None else f'{val:.3f}'}"
                                        f"  {speed} chars/s", refresh=False)
        finally:
            if previous is not None:
                signal.signal(signal.SIGINT, previous)
            if bar is not None:
                bar.close()
        if out is not None:
            self.save(out)
        if interrupted.is_set():
            return "interrupted"
        return "done" if self.step >= cfg.steps else "stopped"

    def chars_per_second(self) -> float | None:
        """Training throughput of the last run() (its first step, which may
        compile kernels, and validation excluded)."""
        return self.train_chars / self.train_seconds if self.train_seconds else None


def _host(a) -> np.ndarray:
    """A numpy copy of a DeviceArray; numpy arrays as they are."""
    return a if isinstance(a, np.ndarray) else np.array(a, np.float32)


def _progress(total, initial, enabled):
    if not enabled:
        return None
    from tqdm import tqdm
    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, mininterval=0.5)
