"""The char LM on halstm.torch (config.engine "torch"): the same network,
initial weights, data order and checkpoints as CharLM, trained with torch's
autograd, nn.Linear head and torch.optim (Adam / SGD). The recurrent layers
are halstm.torch modules, so they run halstm's kernels either way; what
differs is everything around them. A checkpoint of one engine resumes in
the other (the optimizer state is stored in halstm.model.optim's form).

Needs PyTorch (pip install halstm[torch]). The device follows the target:
a CUDA target trains on cuda:0, any other on the CPU. Importing this
module before torch sets OMP_WAIT_POLICY=PASSIVE (unless set).
"""
from __future__ import annotations

import math
import os
import sys

import numpy as np

# torch's OpenMP threads wait passively in this process, unless torch is
# loaded already (libgomp reads the setting once) or the user chose
# otherwise: with torch's default, halstm.torch runs its kernels on
# torch's team instead, and the two took the same time within the 16-core
# Xeon's spread (bench/RESULTS.md, "On torch's OpenMP team").
if "torch" not in sys.modules:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402

from ..torch import Recurrent
from .charlm import CharLM
from .optim import NonFiniteError


class TorchCharLM:
    """CharLM's interface (parameters, state, loss, loss_and_grads) over a
    torch.nn.Module with attributes rnn (halstm.torch.Recurrent) and head
    (nn.Linear), initialised exactly as CharLM(seed)."""

    kernels = None

    def __init__(self, vocab_size: int, cell: str = "lstm", hidden_size: int = 256,
                 layers: int = 2, target: str = "host", schedule: str | None = None,
                 seed: int = 0, precision: str = "fp32"):
        own = CharLM(vocab_size, cell, hidden_size, layers, seed=seed)   # CPU: the init only
        self.V, self.H, self.L, self.cell = own.V, own.H, own.L, cell
        self.n_states = own.n_states
        self.device = torch.device("cuda" if "cuda" in str(target).split("-") else "cpu")
        self.net = torch.nn.Module()
        self.net.rnn = Recurrent(cell, self.V, self.H, num_layers=self.L, schedule=schedule,
                                 precision=precision)
        self.net.head = torch.nn.Linear(self.H, self.V)
        self.net.to(self.device)
        self.load_parameters(own.parameters())

    @classmethod
    def from_config(cls, config, vocab_size: int) -> "TorchCharLM":
        return cls(vocab_size, config.cell, config.hidden_size, config.layers, config.target,
                   config.schedule, config.seed, config.precision)

    # ---- parameters, state ---------------------------------------------------
    def parameters(self) -> dict[str, torch.nn.Parameter]:
        """Every parameter by CharLM's name: the module's own tensors."""
        return dict(self.net.named_parameters())

    def load_parameters(self, params: dict) -> None:
        """Strict, as CharLM.load_parameters."""
        own = self.parameters()
        if set(params) != set(own):
            raise KeyError(f"parameters: missing {sorted(set(own) - set(params))}, "
                           f"unexpected {sorted(set(params) - set(own))}")
        with torch.no_grad():
            for k, p in own.items():
                a = torch.as_tensor(np.asarray(params[k], np.float32))
                if a.shape != p.shape:
                    raise ValueError(f"parameter {k}: expected shape {tuple(p.shape)}, got "
                                     f"{tuple(a.shape)}")
                p.copy_(a)

    def zero_state(self, batch_size: int) -> tuple:
        """One (layers, B, H) tensor per state, zeros."""
        return tuple(torch.zeros(self.L, batch_size, self.H, device=self.device)
                     for _ in range(self.n_states))

    def as_state(self, arrays) -> tuple:
        return tuple(torch.as_tensor(np.asarray(a, np.float32), device=self.device)
                     for a in arrays)

    # ---- forward / backward ------------------------------------------------
    def _logits(self, ids, state):
        """ids (T, B) -> logits (T*B, V), final state (detached)."""
        ids = torch.as_tensor(np.asarray(ids, np.int64), device=self.device)
        x = torch.nn.functional.one_hot(ids, self.V).float()          # (T, B, V)
        y, finals = self.net.rnn(x, state[0] if self.n_states == 1 else tuple(state))
        finals = (finals,) if self.n_states == 1 else tuple(finals)
        return self.net.head(y.reshape(-1, self.H)), tuple(f.detach() for f in finals)

    def _targets(self, targets):
        return torch.as_tensor(np.asarray(targets, np.int64).ravel(), device=self.device)

    def loss(self, ids, targets, state) -> tuple[float, tuple]:
        """Summed cross-entropy (nats) and the final state; no backward."""
        with torch.no_grad():
            logits, state = self._logits(ids, state)
            nll = torch.nn.functional.cross_entropy(logits, self._targets(targets),
                                                    reduction="sum")
        return float(nll), state

    def loss_and_grads(self, ids, targets, state, timer=None):
        """Mean cross-entropy, the gradients (each parameter's .grad, by
        name) and the final state, as CharLM.loss_and_grads."""
        for p in self.net.parameters():
            p.grad = None
        logits, state = self._logits(ids, state)
        loss = torch.nn.functional.cross_entropy(logits, self._targets(targets))
        loss.backward()
        return float(loss.detach()), {k: p.grad for k, p in self.parameters().items()}, state


class TorchOptimizer:
    """torch.optim.Adam or SGD over a TorchCharLM, with halstm.model.optim's
    interface and state-dict form ("t", "m/<name>" = exp_avg / (1 - beta1),
    "v/<name>" = exp_avg_sq / (1 - beta2); "momentum/<name>")."""

    def __init__(self, config, params: dict):
        self.names, self.params = list(params), list(params.values())
        self.adam = config.optimizer == "adam"
        self.beta1, self.beta2 = config.beta1, config.beta2
        if self.adam:
            self.opt = torch.optim.Adam(self.params, lr=config.lr,
                                        betas=(config.beta1, config.beta2), eps=config.eps)
            self.slots = {"m": ("exp_avg", 1 - config.beta1),
                          "v": ("exp_avg_sq", 1 - config.beta2)}
        else:
            self.opt = torch.optim.SGD(self.params, lr=config.lr, momentum=config.momentum)
            self.slots = {"momentum": ("momentum_buffer", 1.0)} if config.momentum else {}
        self.t = 0

    def clip_and_step(self, params: dict, grads: dict, lr: float, max_norm: float) -> float:
        """Clip the gradients' global norm to max_norm (0: no clipping),
        then step; NonFiniteError, with nothing changed, if the norm is
        NaN or Inf. Returns the norm before clipping."""
        sumsq = [float(p.grad.double().square().sum()) for p in self.params]
        bad = [k for k, s in zip(self.names, sumsq) if not math.isfinite(s)]
        if bad:
            raise NonFiniteError(f"non-finite gradient in {', '.join(bad)}")
        total = math.sqrt(sum(sumsq))
        if max_norm > 0:
            coef = max_norm / (total + 1e-6)
            if coef < 1.0:
                for p in self.params:
                    p.grad.mul_(coef)
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.step()
        self.t += 1
        return total

    def state_dict(self) -> dict[str, np.ndarray]:
        out = {"t": np.array(self.t, np.int64)}
        for slot, (key, scale) in self.slots.items():
            for k, p in zip(self.names, self.params):
                s = self.opt.state.get(p, {}).get(key)
                out[f"{slot}/{k}"] = (np.zeros(tuple(p.shape), np.float32) if s is None else
                                      (s / scale).cpu().numpy())
        return out

    def load_state_dict(self, d: dict) -> None:
        """Strict: every slot of every parameter, with its shape."""
        missing = [f"{s}/{k}" for s in self.slots for k in self.names
                   if f"{s}/{k}" not in d] + ([] if "t" in d else ["t"])
        if missing:
            raise KeyError(f"optimizer state: missing {missing}")
        self.t = int(d["t"])
        for k, p in zip(self.names, self.params):
            state = {}
            for slot, (key, scale) in self.slots.items():
                a = np.asarray(d[f"{slot}/{k}"], np.float32)
                if a.shape != tuple(p.shape):
                    raise ValueError(f"optimizer state {slot}/{k}: expected shape "
                                     f"{tuple(p.shape)}, got {a.shape}")
                state[key] = torch.as_tensor(a * np.float32(scale), device=p.device)
            if self.t and state:
                if self.adam:
                    state["step"] = torch.tensor(float(self.t))
                self.opt.state[p] = state
