"""Training: truncated BPTT over parallel streams, validation, checkpoints.

    corpus = Corpus.from_text(*data.load(None), config.seq_len, config.batch_size)
    trainer = Trainer(config, corpus)
    trainer.run(out="charlm.npz")            # SIGINT/TERM/HUP: checkpoint, then return
    trainer = Trainer.resume(checkpoint.load("charlm.npz"), corpus)

A run is deterministic for a given config (seed included): weights start
from CharLM(seed), the data order from Streams(rng(seed, 1)), and a
checkpoint holds all the state that changes, so that a resumed run
continues exactly as an uninterrupted one.

What a run guarantees (docs/reliability.md): it saves every
config.save_minutes (and save_every steps), at the end and on a signal,
so that a kill loses at most the work since the last save; a save that
fails (disk full, folder gone read-only) keeps the previous checkpoint,
is reported, and is tried again at the next save; a non-finite loss or
gradient stops the run before the update, with the state of the last
good step saved; a checkpoint never holds NaN or Inf.
"""
from __future__ import annotations

import collections
import math
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict

import numpy as np
from threadpoolctl import threadpool_limits

from . import checkpoint as ckpt_mod
from . import library, optim, signals
from .charlm import CharLM
from .config import RESUMABLE, Config
from .data import Corpus, Streams
from .optim import NonFiniteError

HISTORY = ("train_step", "train_loss", "val_step", "val_loss")
_clock = time.monotonic          # of the periodic saves (tests replace it)


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
        if config.engine == "torch":
            try:
                from . import torch_engine
            except ImportError as e:
                raise ValueError(f"engine: 'torch' needs PyTorch (pip install "
                                 f"'halstm[torch]'): {e}") from None
            self.model = torch_engine.TorchCharLM.from_config(config, len(self.vocab))
            self.params = self.model.parameters()
            self.optimizer = torch_engine.TorchOptimizer(config, self.params)
        else:
            self.model = CharLM.from_config(config, len(self.vocab))
            self.params = self.model.parameters()
            # the optimizer as Halide pipelines on every target: on a CPU they
            # use every core where numpy's update runs on one (bench/RESULTS.md,
            # "The char LM's engines"); the model's own where it has them (GPU)
            self.optimizer = optim.make(config, self.params,
                                        self.model.kernels or library.kernels(config.target))
        self.streams = Streams(corpus.train, config.seq_len, config.batch_size,
                               np.random.default_rng([config.seed, 1]))
        self.state = self.model.zero_state(config.batch_size)
        self.step = 0
        self.history = {k: [] for k in HISTORY}
        self.timer = Timer()
        self.train_seconds, self.train_chars = 0.0, 0      # of the last run()
        self._val = None
        self._consistent = True       # False while a step is under way (or was cut short)
        # of the last run(): the signal that stopped it, the step its last
        # successful save wrote, and the last failed save's message (None
        # once a save succeeds again)
        self.interrupted_by: int | None = None
        self.saved_step: int | None = None
        self.save_error: str | None = None

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
        """Write the checkpoint to path (atomically). NonFiniteError, writing
        nothing, if a parameter, moment or carried state holds NaN or Inf;
        RuntimeError if a step was cut short (the state is half updated)."""
        ckpt = self._checked_checkpoint()
        ckpt_mod.save(path, ckpt)

    def _checked_checkpoint(self) -> ckpt_mod.Checkpoint:
        if not self._consistent:
            raise RuntimeError("the trainer was stopped in the middle of a step: its state is "
                               "half updated and cannot be saved")
        ckpt = self.checkpoint()
        arrays = {**{f"param/{k}": v for k, v in ckpt.params.items()},
                  **{f"opt/{k}": v for k, v in ckpt.optimizer.items()},
                  **{f"state/{i}": v for i, v in enumerate(ckpt.state)}}
        bad = [k for k, v in arrays.items() if not np.isfinite(v).all()]
        if bad:
            raise NonFiniteError(f"the model holds NaN or Inf ({', '.join(bad[:4])}"
                                 f"{', ...' if len(bad) > 4 else ''}): not saved")
        return ckpt

    def probe_save(self, path) -> int:
        """Write a checkpoint beside path and delete it (path untouched):
        OSError where saving to path would fail now. Returns its size."""
        return ckpt_mod.probe(path, self.checkpoint())

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
        """One optimizer step on the next batch; returns its mean loss (nats/char).
        NonFiniteError if the loss or the gradient is NaN or Inf: then
        nothing changes (no update; the data position and carried state put
        back), so that the trainer stays in its last good state."""
        timer = self.timer
        position, state = self.streams.position(), self.state
        self._consistent = False
        try:
            x, y, new_epoch = self.streams.batch()
            if new_epoch:
                state = self.model.zero_state(self.config.batch_size)
            with threadpool_limits(1, user_api="blas"):
                loss, grads, new_state = self.model.loss_and_grads(x, y, state, timer)
            if not math.isfinite(loss):
                raise NonFiniteError(f"non-finite training loss ({loss})")
            with timer("optimizer"):
                self.optimizer.clip_and_step(self.params, grads, self.lr(), self.config.clip)
        except NonFiniteError as e:
            self.streams.set_position(position)     # nothing was updated: undo the batch
            self._consistent = True
            raise NonFiniteError(f"{e} at step {self.step + 1}: the step was not applied") from None
        self.state = new_state
        self.step += 1
        self.history["train_step"].append(self.step)
        self.history["train_loss"].append(loss)
        self._consistent = True
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
            handle_signals: bool = True, log=None, handle_sigint: bool | None = None) -> str:
        """Train up to step `until` (default and at most config.steps).
        Validates every eval_every steps and at config.steps. With `out`,
        saves every save_every steps, whenever save_minutes have passed since
        the last save, at the end and when a signal stops the run; a run that
        completed no step writes nothing.

        Signals (SIGINT, SIGTERM, SIGHUP; main thread, handle_signals): once
        a step is done, the first finishes the current step (dropping a
        validation under way), saves and returns "interrupted"
        (interrupted_by says which); during the run's first step (which may
        build kernels) it raises signals.Interrupted at once, writing
        nothing; a second signal raises Interrupted at once (a save under
        way is abandoned, the previous checkpoint kept).

        A save that fails (OSError: disk full, read-only folder) is reported
        through log (a callable taking one line; default: stderr, above the
        progress bar), the previous checkpoint is
        kept and training goes on; the next save tries again. save_error
        holds the message while the last save failed, saved_step the step
        of the last successful save of this run.

        A non-finite loss or gradient raises NonFiniteError: the step's
        update is not applied; the last good state is saved first (if this
        run completed a step). A non-finite validation loss raises it too,
        saving nothing (that step's update is already applied).

        Returns "done" (config.steps reached), "stopped" (until reached) or
        "interrupted". handle_sigint: the former name of handle_signals."""
        if handle_sigint is not None:
            handle_signals = handle_sigint
        cfg = self.config
        until = cfg.steps if until is None else min(until, cfg.steps)
        bar = _progress(cfg.steps, self.step, progress)
        if log is None:            # above the progress bar, or a line on stderr
            log = (lambda msg: bar.write(msg, file=sys.stderr)) if bar is not None else _stderr

        def say(msg):
            _safe(log, msg)
        chars = cfg.seq_len * cfg.batch_size
        window = collections.deque(maxlen=20)
        self.train_seconds, self.train_chars = 0.0, 0      # excluding each run's first step
        self.interrupted_by, self.saved_step, self.save_error = None, None, None
        val = self.history["val_loss"][-1] if self.history["val_loss"] else None
        start = self.step
        save_seconds = cfg.save_minutes * 60.0
        last_save = _clock()

        def save(why: str) -> bool:
            nonlocal last_save
            last_save = _clock()
            if self.saved_step == self.step:
                return True
            try:
                self.save(out)
            except OSError as e:
                self.save_error = (f"could not write the checkpoint {out} at step {self.step} "
                                   f"({why}): {_oserror(e)}")
                say(f"warning: {self.save_error}; the training state is kept in memory and "
                    f"the previous checkpoint left as it was; trying again at the next save")
                return False
            self.saved_step, self.save_error = self.step, None
            return True

        with signals.guard(handle_signals) as sig:
            try:
                first = True
                while self.step < until and sig.signum is None:
                    # the run's first step may build kernels: a signal then
                    # stops it at once (nothing done yet to save)
                    sig.deferred = not first
                    t0 = time.perf_counter()
                    try:
                        loss = self.train_step()
                    except NonFiniteError:
                        if out is not None and self.step > start:
                            try:
                                save("the last good step, before the non-finite one")
                            except NonFiniteError:
                                pass     # the weights were already bad: nothing written
                        raise
                    sig.deferred = True
                    dt = time.perf_counter() - t0
                    if not first:                   # the first step may compile kernels
                        self.train_seconds += dt
                        self.train_chars += chars
                        window.append(dt)
                    first = False
                    if (cfg.eval_every and self.step % cfg.eval_every == 0) or self.step == cfg.steps:
                        with self.timer("validation"):
                            v = self._validate(sig)
                        if v is not None:                 # None: a signal during validation
                            if not math.isfinite(v):
                                raise NonFiniteError(
                                    f"non-finite validation loss ({v}) after step {self.step}: "
                                    f"the weights of step {self.step} are not saved")
                            val = v
                            self.history["val_step"].append(self.step)
                            self.history["val_loss"].append(val)
                    if out is not None and sig.signum is None and (
                            (cfg.save_every and self.step % cfg.save_every == 0) or
                            (save_seconds and _clock() - last_save >= save_seconds)):
                        save("periodic save")
                    if bar is not None:
                        speed = f"{chars * len(window) / sum(window):,.0f}" if window else "-"
                        _safe(bar.set_postfix_str, f"loss {loss:.3f}  val "
                              f"{'-' if val is None else f'{val:.3f}'}  {speed} chars/s",
                              refresh=False)
                        _safe(bar.update, 1)
                if out is not None and self.step > start:
                    save("signal" if sig.signum is not None else "end of the run")
            finally:
                if bar is not None:
                    _safe(bar.close)
            self.interrupted_by = sig.signum
        if self.interrupted_by is not None:
            return "interrupted"
        return "done" if self.step >= cfg.steps else "stopped"

    def _validate(self, sig):
        """evaluate(), stopping early on a signal. A failure after a signal
        (a kernel build killed by the terminal's Ctrl-C) counts as the
        signal's, not as an error."""
        try:
            return self.evaluate(stop=lambda: sig.signum is not None)
        except Exception:
            if sig.signum is not None:
                return None
            raise

    def chars_per_second(self) -> float | None:
        """Training throughput of the last run() (its first step, which may
        compile kernels, and validation excluded)."""
        return self.train_chars / self.train_seconds if self.train_seconds else None


def _host(a) -> np.ndarray:
    """A numpy copy of a DeviceArray or a torch tensor; numpy arrays as they are."""
    if hasattr(a, "detach"):                      # torch (engine "torch")
        return a.detach().cpu().numpy().copy()
    return a if isinstance(a, np.ndarray) else np.array(a, np.float32)


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _safe(fn, *args, **kwargs) -> None:
    """Report or draw, ignoring a closed or hung-up terminal (SIGHUP)."""
    try:
        fn(*args, **kwargs)
    except (OSError, ValueError):
        pass


def _oserror(e: OSError) -> str:
    return e.strerror or str(e) or type(e).__name__


def _progress(total, initial, enabled):
    if not enabled:
        return None
    from tqdm import tqdm
    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, mininterval=0.5)
