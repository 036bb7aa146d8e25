"""The char-level language model: one-hot characters -> a stack of halstm
recurrent layers (any cell, LSTM by default) -> linear -> softmax
cross-entropy.

The recurrent layers run in halstm's compiled kernels (halstm.Recurrent).
The head (a (T*B, H) x (H, V) product, the softmax and their gradients)
runs as the Halide pipeline of model/kernels.py (model/library.py compiles
it), on every target; CharLM(kernels=False) runs it in numpy on a CPU
target instead. On a CUDA target ("host-cuda") every parameter, activation
and gradient stays on the GPU (halstm.cuda.DeviceArray), and the one-hot
rows are built there by the onehot pipeline. The optimizer runs as the
adam / sgd pipelines on every target (optim.KernelAdam, KernelSGD;
model/train.py).

Parameter names follow a PyTorch module with attributes `rnn` (a torch.nn
recurrent module) and `head` (nn.Linear): rnn.weight_ih_l0, ...,
head.weight, head.bias.
"""
from __future__ import annotations

import numpy as np

from .. import cells, cuda
from ..nn import Recurrent, no_grad


def parameter_shapes(vocab_size: int, cell: str, hidden_size: int, layers: int) -> dict:
    """name -> shape of every parameter of CharLM(vocab_size, cell,
    hidden_size, layers), in parameters() order, computed without
    allocating anything (a checkpoint's header is checked against it)."""
    V, H, G = int(vocab_size), int(hidden_size), len(cells.info(cells.check(cell))["gates"])
    shapes = {}
    for k in range(int(layers)):
        shapes[f"rnn.weight_ih_l{k}"] = (G * H, V if k == 0 else H)
        shapes[f"rnn.weight_hh_l{k}"] = (G * H, H)
        shapes[f"rnn.bias_ih_l{k}"] = (G * H,)
        shapes[f"rnn.bias_hh_l{k}"] = (G * H,)
    shapes["head.weight"] = (V, H)
    shapes["head.bias"] = (V,)
    return shapes


class CharLM:
    """vocab_size one-hot inputs, `layers` recurrent layers of `hidden_size`
    units, a linear head over the vocabulary. Initialised as PyTorch does
    (every matrix and its bias uniform in +-1/sqrt(hidden_size)) from
    `seed`; a cell's vector parameters start at their declared values.
    kernels: run the head as a Halide pipeline (model/kernels.py), on
    every core; the default on every target. False: numpy's head (BLAS),
    CPU targets only."""

    def __init__(self, vocab_size: int, cell: str = "lstm", hidden_size: int = 256,
                 layers: int = 2, target: str = "host", schedule: str | None = None,
                 seed: int = 0, kernels: bool | None = None, precision: str = "fp32"):
        cells.check(cell)
        from halstm import schedules
        self.on_gpu = schedules.family(target) == "gpu"
        if self.on_gpu and "cuda" not in str(target).split("-"):
            raise ValueError(f"target: the char-level model trains on CPU and CUDA targets, "
                             f"got {target!r}")
        if kernels is False and self.on_gpu:
            raise ValueError("kernels: a CUDA target runs the head and optimizer as kernels; "
                             "kernels=False fits CPU targets only")
        self.V, self.H, self.L, self.cell = int(vocab_size), int(hidden_size), int(layers), cell
        # the module's own initialisation from seed (matrices and their
        # biases uniform, a cell's vectors as declared: a layer norm's gains
        # 1), then the head from the same generator
        self.rnn = Recurrent(cell, self.V, self.H, num_layers=self.L, target=target,
                             schedule=schedule, seed=seed, precision=precision)
        self.n_states = len(self.rnn._state_names)
        rng = self.rnn._rng
        bound = 1.0 / np.sqrt(self.H)

        def uniform(shape):
            return rng.uniform(-bound, bound, shape).astype(np.float32)

        self.head = {"weight": uniform((self.V, self.H)), "bias": uniform((self.V,))}
        self.kernels = None
        if kernels is not False:
            from . import library
            self.kernels = library.kernels(target)
        if self.on_gpu:
            self.head = {k: cuda.DeviceArray.from_numpy(v) for k, v in self.head.items()}

    @classmethod
    def from_config(cls, config, vocab_size: int, kernels: bool | None = None) -> "CharLM":
        return cls(vocab_size, config.cell, config.hidden_size, config.layers,
                   config.target, config.schedule, config.seed, kernels=kernels,
                   precision=config.precision)

    # ---- parameters --------------------------------------------------------
    def parameters(self) -> dict[str, np.ndarray]:
        """Every parameter by name: the model's own arrays (in-place updates act
        on the model)."""
        params = {f"rnn.{k}": v for k, v in self.rnn.state_dict().items()}
        params.update({f"head.{k}": v for k, v in self.head.items()})
        return params

    def load_parameters(self, params: dict) -> None:
        """Copy parameters in (strict: same names and shapes, else KeyError/ValueError)."""
        own = self.parameters()
        if set(params) != set(own):
            raise KeyError(f"parameters: missing {sorted(set(own) - set(params))}, "
                           f"unexpected {sorted(set(params) - set(own))}")
        for k, a in params.items():
            if np.shape(a) != own[k].shape:
                raise ValueError(f"parameter {k}: expected shape {own[k].shape}, got {np.shape(a)}")
        self.rnn.load_state_dict({k[4:]: params[k] for k in own if k.startswith("rnn.")})
        for k in self.head:
            if self.on_gpu:
                self.head[k].copy_from(np.asarray(params[f"head.{k}"], np.float32))
            else:
                np.copyto(self.head[k], params[f"head.{k}"], casting="unsafe")

    # ---- state -------------------------------------------------------------
    def zero_state(self, batch_size: int) -> tuple:
        """The recurrent state, one (layers, B, H) array per state (LSTM: h, c);
        DeviceArrays on a CUDA target."""
        return self.as_state(np.zeros((self.L, batch_size, self.H), np.float32)
                             for _ in range(self.n_states))

    def as_state(self, arrays) -> tuple:
        """Host arrays (a checkpoint's) as this model's state arrays."""
        if self.on_gpu:
            return tuple(cuda.DeviceArray.from_numpy(a) for a in arrays)
        return tuple(np.array(a, np.float32) for a in arrays)

    # ---- forward / backward ------------------------------------------------
    def one_hot(self, ids: np.ndarray) -> np.ndarray:
        """int ids (T, B) -> float32 one-hot (T, B, V)."""
        T, B = ids.shape
        x = np.zeros((T * B, self.V), np.float32)
        x[np.arange(T * B), ids.ravel()] = 1.0
        return x.reshape(T, B, self.V)

    def hidden(self, ids: np.ndarray, state, timer=None) -> tuple[np.ndarray, tuple]:
        """The top layer's outputs (T, B, H) and the final state."""
        timer = timer or _no_timer
        with timer("one-hot input"):
            if self.on_gpu:
                # the CUDA layers have no class-index pipelines: the first
                # layer takes one-hot rows (its projection one GEMM of K = V),
                # built on the device from the uploaded indices (T*B int32)
                # by the onehot kernel; building them here and uploading
                # T*B*V floats took 0.30 ms of an 8.9 ms step (H100, default
                # size, the section synchronised)
                T, B = np.shape(ids)
                if np.min(ids) < 0 or np.max(ids) >= self.V:
                    raise ValueError(f"ids: class indices must lie in [0, {self.V}), got "
                                     f"values from {np.min(ids)} to {np.max(ids)}")
                k = self.kernels
                x = k.onehot(k.targets(ids), self.V).reshape(T, B, self.V)
            else:
                # the class indices themselves: on a CPU target the first layer
                # gathers columns of W_ih (and backward scatter-adds dW_ih)
                # instead of a GEMM with one-hot rows
                x = np.ascontiguousarray(ids, dtype=np.int32)
        with timer("rnn forward"):
            return self._rnn(x, state)

    def _rnn(self, x, state):
        if self.n_states > 1:
            y, finals = self.rnn(x, tuple(state))
            return y, tuple(finals)
        y, h = self.rnn(x, state[0])
        return y, (h,)

    def logits(self, y: np.ndarray) -> np.ndarray:
        """(T, B, H) -> logits (T*B, V). CPU targets (sampling runs there)."""
        if self.on_gpu:
            raise ValueError("logits: CPU targets only; sample from a checkpoint on the CPU")
        out = y.reshape(-1, self.H) @ self.head["weight"].T
        out += self.head["bias"]
        return out

    def loss(self, ids: np.ndarray, targets: np.ndarray, state) -> tuple[float, tuple]:
        """Summed cross-entropy (nats) of predicting targets (T, B) from ids
        (T, B), and the final state. Forward only: nothing is kept for a
        backward (halstm.no_grad)."""
        with no_grad():
            y, state = self.hidden(ids, state)
        targets = self._check_targets(targets, *y.shape[:2])
        if self.on_gpu:
            nll = np.asarray(self._head(y, targets, 0.0)[0])
        else:               # numpy: the logits alone (the pipeline makes gradients too)
            nll = _log_softmax_nll(self.logits(y), targets.ravel())
        return float(nll.sum(dtype=np.float64)), state

    def _check_targets(self, targets, T: int, B: int) -> np.ndarray:
        targets = np.asarray(targets)
        if targets.shape != (T, B):
            raise ValueError(f"targets: expected shape {(T, B)}, got {targets.shape}")
        if targets.min() < 0 or targets.max() >= self.V:
            raise ValueError(f"targets: class indices must lie in [0, {self.V}), got values "
                             f"from {targets.min()} to {targets.max()}")
        return targets

    def _head(self, y, targets, scale):
        """The head pipeline: loss rows (N,), dW, db, dy (T, B, H); targets
        checked (_check_targets)."""
        T, B, H = y.shape
        k = self.kernels
        loss, dw, db, dy = k.head(y.reshape(T * B, H), self.head["weight"], self.head["bias"],
                                  k.targets(targets), scale)
        return loss, dw, db, dy.reshape(T, B, H)

    def loss_and_grads(self, ids: np.ndarray, targets: np.ndarray, state, timer=None):
        """Mean cross-entropy over the T*B predictions, the gradient of every
        parameter (by parameters() name), and the final state (to carry to
        the next batch; truncated BPTT: no gradient flows into it)."""
        timer = timer or _no_timer
        y, state = self.hidden(ids, state, timer)
        targets = self._check_targets(targets, *y.shape[:2])
        if self.kernels is not None:
            with timer("head"):
                rows, dw, db, dy = self._head(y, targets, 1.0 / (y.shape[0] * y.shape[1]))
            grads = {"head.weight": dw, "head.bias": db}
            with timer("rnn backward"):
                g = self.rnn.backward(dy, input_grad=False)
            # read after backward is queued: the copy waits for the GPU, which
            # then already has the backward's kernels to run
            loss = float(np.asarray(rows).mean(dtype=np.float64))
            for k in self.rnn.state_dict():
                grads[f"rnn.{k}"] = g[k]
            return loss, {k: grads[k] for k in self.parameters()}, state
        with timer("head"):
            loss, dw, db, dy = numpy_head(y.reshape(-1, self.H), self.head["weight"],
                                          self.head["bias"], targets.ravel())
            grads = {"head.weight": dw, "head.bias": db}
            dy = dy.reshape(y.shape)
        with timer("rnn backward"):
            g = self.rnn.backward(dy, input_grad=False)   # one-hot input: no gradient wanted
        for k in self.rnn.state_dict():
            grads[f"rnn.{k}"] = g[k]
        return loss, {k: grads[k] for k in self.parameters()}, state


def numpy_head(y: np.ndarray, w: np.ndarray, b: np.ndarray, targets: np.ndarray):
    """The head in numpy (BLAS), CharLM(kernels=False)'s: y (N, H), w (V, H),
    b (V,), targets (N,) -> the mean loss, dW (V, H), db (V,), dy (N, H)."""
    logits = y @ w.T
    logits += b
    loss = float(_log_softmax_nll(logits, targets, grad=1.0 / len(targets))
                 .mean(dtype=np.float64))
    dlogits = logits                       # overwritten with d(mean loss)/d logits
    return loss, dlogits.T @ y, dlogits.sum(axis=0), dlogits @ w


def _log_softmax_nll(logits: np.ndarray, targets: np.ndarray, grad: float | None = None) -> np.ndarray:
    """Per-row -log softmax(logits)[target] (float32, length N). With grad
    (a scale), logits (N, V) is overwritten with grad * (softmax(logits) -
    one_hot(targets)), the gradient of grad * the summed loss."""
    rows = np.arange(len(targets))
    z = logits if grad is not None else logits.copy()
    z -= z.max(axis=1, keepdims=True)
    picked = z[rows, targets]
    np.exp(z, out=z)
    total = z.sum(axis=1)
    nll = np.log(total) - picked
    if grad is not None:
        z *= (np.float32(grad) / total)[:, None]
        z[rows, targets] -= np.float32(grad)
    return nll


class _NoTimer:
    def __call__(self, name):
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_no_timer = _NoTimer()
