"""Optimizers (Adam, SGD with momentum, both with PyTorch's update rules),
global gradient-norm clipping and the learning-rate schedule. All updates
are in place on the parameter arrays, in float32, with preallocated scratch,
so that a step allocates nothing. Adam and SGD run in numpy; KernelAdam
and KernelSGD run the same rules as Halide pipelines (model/kernels.py) on
a target's arrays (numpy arrays on a CPU, DeviceArrays on a GPU): the char
LM's trainer uses those on every target.

Every optimizer refuses a non-finite gradient: clip_and_step raises
NonFiniteError, naming the parameters whose gradients hold NaN or Inf,
before it changes any parameter or moment (docs/reliability.md)."""
from __future__ import annotations

import math

import numpy as np


def lr_at(config, step: int) -> float:
    """The learning rate of optimizer step `step` (0-based): a linear warm-up
    over warmup_steps, then constant, or a cosine / linear decay reaching
    lr * min_lr_ratio at config.steps."""
    lr, warm = config.lr, config.warmup_steps
    if step < warm:
        return lr * (step + 1) / warm
    if config.lr_schedule == "constant":
        return lr
    span = max(1, config.steps - warm)
    frac = min(1.0, (step - warm) / span)
    floor = lr * config.min_lr_ratio
    if config.lr_schedule == "cosine":
        return floor + (lr - floor) * 0.5 * (1.0 + math.cos(math.pi * frac))
    return lr - (lr - floor) * frac                      # linear


class NonFiniteError(FloatingPointError):
    """A loss or gradient that is NaN or infinite (training stops on it)."""


def _check_finite(names, sumsq) -> float:
    """The global norm from per-parameter sums of squares; NonFiniteError
    naming the parameters whose sum is NaN or Inf (a NaN or Inf in the
    gradient, or squares beyond float32's range)."""
    bad = [k for k, s in zip(names, sumsq) if not math.isfinite(s)]
    if bad:
        worst = next((s for s in sumsq if math.isnan(s)), math.inf)
        raise NonFiniteError(f"non-finite gradient (norm {worst}) in {', '.join(bad)}")
    return math.sqrt(sum(sumsq))


def clip_grad_norm(grads: dict, max_norm: float) -> float:
    """Scale grads in place so that their global L2 norm is at most max_norm
    (0: no clipping), as torch.nn.utils.clip_grad_norm_. Returns the norm
    before clipping."""
    total = math.sqrt(sum(float(np.dot(g.ravel(), g.ravel())) for g in grads.values()))
    if max_norm > 0:
        coef = max_norm / (total + 1e-6)
        if coef < 1.0:
            for g in grads.values():
                g *= np.float32(coef)
    return total


class Optimizer:
    """Per-parameter slots (arrays shaped like the parameters) plus a step count."""

    slots: tuple[str, ...] = ()

    def __init__(self, params: dict):
        for k, p in params.items():
            if not (p.flags.c_contiguous and p.flags.writeable and p.dtype == np.float32):
                raise ValueError(f"parameter {k}: expected a writable C-contiguous float32 array")
        self.t = 0
        self.state = {s: {k: np.zeros_like(p) for k, p in params.items()} for s in self.slots}
        self._tmp = {k: np.empty_like(p) for k, p in params.items()}

    def state_dict(self) -> dict[str, np.ndarray]:
        """Flat name -> array: "t" and "<slot>/<param>"."""
        out = {"t": np.array(self.t, np.int64)}
        for s, arrays in self.state.items():
            out.update({f"{s}/{k}": a for k, a in arrays.items()})
        return out

    def load_state_dict(self, d: dict) -> None:
        """Strict: every slot of every parameter, with its shape."""
        expected = {f"{s}/{k}": tuple(a.shape) for s, arrays in self.state.items()
                    for k, a in arrays.items()}
        missing = sorted(set(expected) - set(d) - {"t"})
        if missing or "t" not in d:
            raise KeyError(f"optimizer state: missing {missing or ['t']}")
        for name, shape in expected.items():
            if np.shape(d[name]) != shape:
                raise ValueError(f"optimizer state {name}: expected shape {shape}, got {np.shape(d[name])}")
        for name in expected:
            s, k = name.split("/", 1)
            self._put(self.state[s][k], d[name])
        self.t = int(d["t"])

    @staticmethod
    def _put(dst, value) -> None:
        """Copy a loaded slot into the optimizer's own array."""
        np.copyto(dst, value, casting="unsafe")

    def step(self, params: dict, grads: dict, lr: float) -> None:
        self.t += 1
        for k, p in params.items():
            self._update(k, p, grads[k], lr)

    def clip_and_step(self, params: dict, grads: dict, lr: float, max_norm: float) -> float:
        """clip_grad_norm(grads, max_norm) (in place), then step. Returns the
        norm before clipping; NonFiniteError, with nothing changed, if it is
        not finite."""
        total = _check_finite(list(grads), [float(np.dot(g.ravel(), g.ravel()))
                                            for g in grads.values()])
        if max_norm > 0:
            coef = max_norm / (total + 1e-6)
            if coef < 1.0:
                for g in grads.values():
                    g *= np.float32(coef)
        self.step(params, grads, lr)
        return total


class SGD(Optimizer):
    """p -= lr * g, or with momentum m: buf = m * buf + g; p -= lr * buf."""

    def __init__(self, params: dict, momentum: float = 0.0):
        self.momentum = float(momentum)
        self.slots = ("momentum",) if self.momentum else ()
        super().__init__(params)

    def _update(self, k, p, g, lr):
        if self.momentum:
            buf = self.state["momentum"][k]
            if self.t == 1:
                np.copyto(buf, g)
            else:
                buf *= np.float32(self.momentum)
                buf += g
            g = buf
        tmp = self._tmp[k]
        np.multiply(g, np.float32(lr), out=tmp)
        p -= tmp


class Adam(Optimizer):
    """torch.optim.Adam (no weight decay, no amsgrad). The slots hold the
    moments scaled, m / (1 - beta1) and v / (1 - beta2), which saves three
    of the update's 13 array passes (the update is memory-bound: 10 passes
    over the default model's 900k parameters took 4-5 ms on the dev machine)."""

    slots = ("m", "v")
    # Elements per block: the passes run block by block so that the five
    # arrays' blocks stay in L2 (measured 4.5 against 5.1 ms for whole arrays).
    BLOCK = 1 << 16

    def __init__(self, params: dict, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8):
        self.beta1, self.beta2, self.eps = float(beta1), float(beta2), float(eps)
        super().__init__(params)

    def _update(self, k, p, g, lr):
        b1, b2 = self.beta1, self.beta2
        # p -= lr / bc1 * m / (sqrt(v / bc2) + eps), with m = (1 - b1) M, v = (1 - b2) V:
        # p -= c * M / (sqrt(V) + e), s = sqrt((1 - b2) / bc2), c = lr (1 - b1) / (bc1 s), e = eps / s
        s = math.sqrt((1.0 - b2) / (1.0 - b2 ** self.t))
        c = np.float32(lr * (1.0 - b1) / ((1.0 - b1 ** self.t) * s))
        e = np.float32(self.eps / s)
        f1, f2 = np.float32(b1), np.float32(b2)
        arrays = [a.reshape(-1) for a in (p, g, self.state["m"][k], self.state["v"][k], self._tmp[k])]
        for i in range(0, arrays[0].size, self.BLOCK):
            p_, g_, m, v, tmp = (a[i:i + self.BLOCK] for a in arrays)
            m *= f1                          # M = b1 M + g
            m += g_
            np.multiply(g_, g_, out=tmp)     # V = b2 V + g^2
            v *= f2
            v += tmp
            np.sqrt(v, out=tmp)
            tmp += e
            np.divide(m, tmp, out=tmp)
            tmp *= c
            p_ -= tmp


class _KernelOptimizer(Optimizer):
    """An optimizer whose update is a Halide pipeline of `kernels` (a
    model.library.Kernels); params and slots are that target's arrays. The
    global gradient norm is reduced on the target (one sumsq call per
    parameter into a (P,) array that the update reads), so a step never
    waits for the device."""

    def __init__(self, params: dict, kernels):
        self.kernels, mem = kernels, kernels.mem
        for k, p in params.items():
            if isinstance(p, np.ndarray) == kernels.on_gpu or (
                    isinstance(p, np.ndarray) and not (p.flags.c_contiguous and p.flags.writeable
                                                       and p.dtype == np.float32)):
                want = "a DeviceArray" if kernels.on_gpu else "a writable C-contiguous float32 array"
                raise ValueError(f"parameter {k}: expected {want} (target {kernels.target}), "
                                 f"got {type(p).__name__}")
        self.t = 0
        self.state = {s: {k: mem.zeros(tuple(p.shape)) for k, p in params.items()}
                      for s in self.slots}
        self._sq = mem.zeros((max(len(params), 1),))

    def state_dict(self) -> dict[str, np.ndarray]:
        """As Optimizer's, with host (numpy) copies of the slots."""
        out = {"t": np.array(self.t, np.int64)}
        for s, arrays in self.state.items():
            out.update({f"{s}/{k}": np.array(a, np.float32) for k, a in arrays.items()})
        return out

    @staticmethod
    def _put(dst, value) -> None:
        """Copy a loaded slot into a host or device array."""
        a = np.asarray(value, np.float32)
        if isinstance(dst, np.ndarray):
            np.copyto(dst, a)
        else:
            dst.copy_from(a)

    def step(self, params: dict, grads: dict, lr: float) -> None:
        self.clip_and_step(params, grads, lr, 0.0)

    def clip_and_step(self, params: dict, grads: dict, lr: float, max_norm: float) -> float:
        """One update with the gradients clipped to global norm max_norm
        (0: none); grads are left as they are. Returns the norm before
        clipping; NonFiniteError, with nothing changed, if it is not finite.
        The per-parameter sums of squares are read back (P floats) to check
        them before the update is queued: one wait for the device a step,
        after the backward that the loss read already waited for."""
        for i, k in enumerate(params):
            self.kernels.sumsq(grads[k], self._sq[i:i + 1])
        total = _check_finite(list(params), np.asarray(self._sq, np.float64).tolist())
        self.t += 1
        for k, p in params.items():
            self._update(k, p, grads[k], lr, max_norm)
        return total


class KernelAdam(_KernelOptimizer):
    """Adam's rule as Adam's (the same scaled moments), on the target."""

    slots = ("m", "v")

    def __init__(self, params: dict, kernels, beta1: float = 0.9, beta2: float = 0.999,
                 eps: float = 1e-8):
        self.beta1, self.beta2, self.eps = float(beta1), float(beta2), float(eps)
        super().__init__(params, kernels)

    def _update(self, k, p, g, lr, max_norm):
        b1, b2 = self.beta1, self.beta2
        s = math.sqrt((1.0 - b2) / (1.0 - b2 ** self.t))
        c = lr * (1.0 - b1) / ((1.0 - b1 ** self.t) * s)
        self.kernels.adam(p, g, self.state["m"][k], self.state["v"][k], self._sq, c,
                          self.eps / s, b1, b2, max_norm)


class KernelSGD(_KernelOptimizer):
    """SGD's rule (PyTorch's momentum), on the target."""

    def __init__(self, params: dict, kernels, momentum: float = 0.0):
        self.momentum = float(momentum)
        self.slots = ("momentum",) if self.momentum else ()
        super().__init__(params, kernels)
        # without momentum the buffer is scratch: buf = 0 * buf + g
        self._scratch = {} if self.momentum else {
            k: kernels.mem.zeros(tuple(p.shape)) for k, p in params.items()}

    def _update(self, k, p, g, lr, max_norm):
        if self.momentum:
            buf, mom = self.state["momentum"][k], (0.0 if self.t == 1 else self.momentum)
        else:
            buf, mom = self._scratch[k], 0.0
        self.kernels.sgd(p, g, buf, self._sq, lr, mom, max_norm)


def make(config, params: dict, kernels=None) -> Optimizer:
    """config's optimizer over params: numpy, or with `kernels` (a
    model.library.Kernels) the Halide pipelines on that target."""
    if kernels is not None:
        if config.optimizer == "adam":
            return KernelAdam(params, kernels, config.beta1, config.beta2, config.eps)
        return KernelSGD(params, kernels, config.momentum)
    if config.optimizer == "adam":
        return Adam(params, config.beta1, config.beta2, config.eps)
    return SGD(params, config.momentum)
