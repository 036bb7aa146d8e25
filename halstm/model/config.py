"""The char-level language model's hyperparameters."""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields

from .. import cells, cublas

OPTIMIZERS = ("adam", "sgd")
ENGINES = ("halstm", "torch")
LR_SCHEDULES = ("constant", "cosine", "linear")

# Fields that define the network and the data layout a checkpoint's arrays
# (weights, carried state, data position) depend on: a resumed run must not
# change them. Every other field may change on resume (see RESUMABLE).
ARCHITECTURE = ("cell", "hidden_size", "layers")
# Fields a resumed run may change: they change neither array shapes nor what
# the run has done so far (more steps, other evaluation cadence, other device).
RESUMABLE = ("steps", "eval_every", "save_every", "save_minutes", "target", "schedule",
             "precision", "engine")


@dataclass
class Config:
    """Everything a training run depends on. The defaults are the reference
    configuration: LSTM 2 x 256, seq-len 64, batch 32, Adam lr 2e-3, clip 5,
    one-hot input."""

    cell: str = "lstm"               # a name of halstm.cells.names()
    hidden_size: int = 256
    layers: int = 2
    seq_len: int = 64                # truncated-BPTT length
    batch_size: int = 32             # parallel streams of the training text
    steps: int = 2000                # total optimizer steps of the run
    optimizer: str = "adam"          # adam | sgd
    lr: float = 2e-3
    lr_schedule: str = "constant"    # constant | cosine | linear (decay to lr * min_lr_ratio)
    warmup_steps: int = 0            # linear warm-up from 0 before the schedule
    min_lr_ratio: float = 0.1
    beta1: float = 0.9               # Adam
    beta2: float = 0.999
    eps: float = 1e-8
    momentum: float = 0.0            # SGD (PyTorch semantics)
    clip: float = 5.0                # global gradient-norm clip; 0 disables
    eval_every: int = 200            # validation loss every N steps (0: only at the end)
    eval_batch_size: int = 128       # parallel streams over the validation text
    save_every: int = 0              # checkpoint every N steps (0: by time only)
    save_minutes: float = 5.0        # checkpoint when this long has passed since the last
                                     # (0: only by save_every, at the end and on a signal)
    seed: int = 0
    target: str = "host"             # Halide target of the kernels (not part of the model)
    schedule: str | None = None      # kernel schedule name; None: the target's default
    precision: str = "fp32"          # the recurrent layers' products: fp32 | bf16 (a CPU with
                                     # AMX or AVX512-BF16; CUDA: cuBLAS) | tf32 (CUDA)
    engine: str = "halstm"           # halstm: own head and optimizer kernels; torch:
                                     # halstm.torch layers, torch head, autograd, torch.optim

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        def positive_int(name, minimum=1):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
                raise ValueError(f"{name}: expected an int >= {minimum}, got {v!r}")

        def number(name, lo, hi=None, lo_open=False):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"{name}: expected a finite number, got {v!r}")
            if (v <= lo if lo_open else v < lo) or (hi is not None and v > hi):
                rng = f"{'(' if lo_open else '['}{lo}, {hi if hi is not None else 'inf'}]"
                raise ValueError(f"{name}: expected a value in {rng}, got {v!r}")

        def choice(name, options):
            if getattr(self, name) not in options:
                raise ValueError(f"{name}: expected one of {list(options)}, got {getattr(self, name)!r}")

        choice("cell", cells.names())
        choice("optimizer", OPTIMIZERS)
        choice("engine", ENGINES)
        choice("lr_schedule", LR_SCHEDULES)
        choice("precision", cublas.PRECISIONS)
        for name in ("hidden_size", "layers", "seq_len", "batch_size", "steps", "eval_batch_size"):
            positive_int(name)
        for name in ("warmup_steps", "eval_every", "save_every", "seed"):
            positive_int(name, 0)
        number("lr", 0.0, lo_open=True)
        number("min_lr_ratio", 0.0, 1.0)
        number("beta1", 0.0, 1.0)
        number("beta2", 0.0, 1.0)
        number("eps", 0.0, lo_open=True)
        number("momentum", 0.0, 1.0)
        number("clip", 0.0)
        number("save_minutes", 0.0)
        if not isinstance(self.target, str) or not self.target:
            raise ValueError(f"target: expected a Halide target string, got {self.target!r}")
        if self.schedule is not None and not isinstance(self.schedule, str):
            raise ValueError(f"schedule: expected a name or None, got {self.schedule!r}")

    # ---- serialisation ------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> "Config":
        """A config from a dict; unknown keys raise ValueError, missing ones
        take their defaults."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown config keys {unknown}")
        return cls(**d)

    @classmethod
    def from_json(cls, text: str) -> "Config":
        d = json.loads(text)
        if not isinstance(d, dict):
            raise ValueError("config: expected a JSON object")
        return cls.from_dict(d)

    def replace(self, **changes) -> "Config":
        d = asdict(self)
        d.update(changes)
        return Config.from_dict(d)
