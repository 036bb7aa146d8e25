"""PyTorch-compatible LSTM and GRU modules running halstm's compiled kernels.

    lstm = halstm.LSTM(13, 37, num_layers=2, seed=0)
    lstm.load_state_dict({k: v.numpy() for k, v in torch_lstm.state_dict().items()})
    y, (h_n, c_n) = lstm(x)                  # x (T, B, 13), float32
    grads = lstm.backward(dy)                # state_dict keys + input, h0, c0

Kernels are compiled on first use (forward on the first call, backward on
the first backward) and cached on disk (see halstm.aot).
"""
from __future__ import annotations

import numpy as np

from . import aot
from .runtime import Library, f32

_PARAMS = ("weight_ih", "weight_hh", "bias_ih", "bias_hh")


def _positive_int(name, v):
    if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
        raise ValueError(f"{name}: expected a positive int, got {v!r}")
    return int(v)


def _float_array(name, a) -> np.ndarray:
    a = np.asarray(a)
    if not np.issubdtype(a.dtype, np.floating):
        raise TypeError(f"{name}: expected a floating-point array, got dtype {a.dtype}")
    return a


def _check_shape(name, a, expected):
    if tuple(a.shape) != tuple(expected):
        raise ValueError(f"{name}: expected shape {tuple(expected)}, got {tuple(a.shape)}")


class _RNN:
    cell = ""

    def __init__(self, input_size, hidden_size, num_layers=1, bias=True, batch_first=False,
                 target="host", schedule=None, seed=None):
        self.input_size = _positive_int("input_size", input_size)
        self.hidden_size = _positive_int("hidden_size", hidden_size)
        self.num_layers = _positive_int("num_layers", num_layers)
        self.bias, self.batch_first = bool(bias), bool(batch_first)
        self.target, self.schedule = target, schedule
        aot.Spec(self.cell, self.input_size, self.hidden_size, "fwd", target, schedule)
        G, H = self.n_gates, self.hidden_size
        rng = np.random.default_rng(seed)
        bound = 1.0 / np.sqrt(H)       # PyTorch: uniform(-1/sqrt(H), 1/sqrt(H))
        self._params: dict[str, np.ndarray] = {}
        for layer in range(self.num_layers):
            for name, shape in self._param_shapes(layer).items():
                self._params[name] = rng.uniform(-bound, bound, shape).astype(np.float32)
        self._zero_bias = np.zeros(G * H, np.float32)
        self._libs: dict = {}
        self._tape = None

    # ---- parameters -------------------------------------------------------
    def _param_shapes(self, layer) -> dict:
        G, H = self.n_gates, self.hidden_size
        K = self.input_size if layer == 0 else H
        shapes = {f"weight_ih_l{layer}": (G * H, K), f"weight_hh_l{layer}": (G * H, H)}
        if self.bias:
            shapes |= {f"bias_ih_l{layer}": (G * H,), f"bias_hh_l{layer}": (G * H,)}
        return shapes

    def state_dict(self) -> dict[str, np.ndarray]:
        """The parameters by PyTorch's names: the module's own arrays, so an
        in-place update (an optimizer step) acts on the module."""
        return dict(self._params)

    def load_state_dict(self, state_dict, strict: bool = True) -> None:
        """Copy parameters in. Any missing, unexpected or wrongly shaped key
        raises (strict) before anything changes."""
        expected = {k: s for layer in range(self.num_layers)
                    for k, s in self._param_shapes(layer).items()}
        missing = sorted(set(expected) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(expected))
        if strict and (missing or unexpected):
            raise KeyError(f"state_dict: missing keys {missing}, unexpected keys {unexpected}")
        new = {}
        for k in expected.keys() & state_dict.keys():
            a = _float_array(f"state_dict[{k!r}]", state_dict[k])
            _check_shape(f"state_dict[{k!r}]", a, expected[k])
            new[k] = a
        for k, a in new.items():
            np.copyto(self._params[k], a, casting="unsafe")
        self._tape = None

    # ---- kernels ----------------------------------------------------------
    def _lib(self, layer: int, direction: str) -> Library:
        K = self.input_size if layer == 0 else self.hidden_size
        key = (K, direction)
        if key not in self._libs:
            spec = aot.Spec(self.cell, K, self.hidden_size, direction, self.target, self.schedule)
            self._libs[key] = Library(*aot.library(spec))
        return self._libs[key]

    def compile(self, backward: bool = True) -> "_RNN":
        """Build (or load from the cache) every kernel now rather than on first use."""
        for layer in range(min(self.num_layers, 2)):
            self._lib(layer, "fwd")
            if backward:
                self._lib(layer, "bwd")
        return self

    def _layer_weights(self, layer):
        p = self._params
        b_ih = p.get(f"bias_ih_l{layer}", self._zero_bias)
        b_hh = p.get(f"bias_hh_l{layer}", self._zero_bias)
        return p[f"weight_ih_l{layer}"], b_ih, p[f"weight_hh_l{layer}"], b_hh

    # ---- forward / backward ----------------------------------------------
    def _input(self, x):
        """x as a (T, B, I) float32 array, and whether it came unbatched."""
        x = _float_array("input", x)
        layout = "(B, T, input_size)" if self.batch_first else "(T, B, input_size)"
        if x.ndim not in (2, 3):
            raise ValueError(f"input: expected a 3-D array {layout} or a 2-D unbatched "
                             f"(T, input_size), got shape {x.shape}")
        if x.shape[-1] != self.input_size or 0 in x.shape:
            raise ValueError(f"input: expected {layout} or unbatched (T, input_size), with "
                             f"input_size={self.input_size} and no empty axis, got shape {x.shape}")
        unbatched = x.ndim == 2
        if unbatched:
            x = x[:, None, :]
        elif self.batch_first:
            x = x.transpose(1, 0, 2)
        # a copy: backward reads it, and the caller may change theirs meanwhile
        return np.array(x, dtype=np.float32, order="C"), unbatched

    def _initial(self, name, a, B, unbatched):
        L, H = self.num_layers, self.hidden_size
        if a is None:
            return np.zeros((L, B, H), np.float32)
        a = _float_array(name, a)
        _check_shape(name, a, (L, H) if unbatched else (L, B, H))
        return f32(a.reshape(L, B, H))

    def _forward(self, x, init):
        """Run every layer; init: per state an (L, B, H) array."""
        x, unbatched = self._input(x)
        B = x.shape[1]
        init = [self._initial(n, a, B, unbatched) for n, a in init]
        tape, inp = [], x
        for layer in range(self.num_layers):
            w_ih, b_ih, w_hh, b_hh = self._layer_weights(layer)
            states, saved = self._lib(layer, "fwd").forward(
                inp, w_ih, b_ih, w_hh, b_hh, [s[layer] for s in init])
            tape.append((inp, states, saved))
            inp = states[0][1:]                      # this layer's h over time (T, B, H)
        self._tape = (tape, unbatched)
        finals = [np.stack([t[1][s][-1] for t in tape]) for s in range(len(init))]
        return self._out_seq(inp), [f[:, 0] if unbatched else f for f in finals]

    def _out_seq(self, y):
        """(T, B, H) internal -> the caller's layout, as a new array."""
        unbatched = self._tape[1]
        if unbatched:
            return y[:, 0].copy()
        return np.ascontiguousarray(y.transpose(1, 0, 2)) if self.batch_first else y.copy()

    def _backward(self, dy, dfinal):
        if self._tape is None:
            raise RuntimeError("backward: call the module forward first (no forward pass "
                               "recorded since construction or load_state_dict)")
        tape, unbatched = self._tape
        T, B, H = tape[-1][1][0].shape[0] - 1, tape[0][0].shape[1], self.hidden_size
        L = self.num_layers
        shape = (T, H) if unbatched else ((B, T, H) if self.batch_first else (T, B, H))
        dy = _float_array("dy", dy)
        _check_shape("dy", dy, shape)
        dy = dy.reshape(T, 1, H) if unbatched else (dy.transpose(1, 0, 2) if self.batch_first else dy)
        dy = f32(dy)
        dfinal = [self._initial(n, a, B, unbatched) for n, a in dfinal]
        grads, dinit = {}, [np.empty((L, B, H), np.float32) for _ in dfinal]
        for layer in reversed(range(L)):
            inp, states, saved = tape[layer]
            w_ih, _, w_hh, _ = self._layer_weights(layer)
            g = self._lib(layer, "bwd").backward(inp, w_ih, w_hh, saved, states, dy,
                                                 [d[layer] for d in dfinal])
            grads[f"weight_ih_l{layer}"], grads[f"weight_hh_l{layer}"] = g["dw_ih"], g["dw_hh"]
            if self.bias:
                grads[f"bias_ih_l{layer}"], grads[f"bias_hh_l{layer}"] = g["db_ih"], g["db_hh"]
            for d, s in zip(dinit, self._state_names):
                d[layer] = g[f"d{s}0"]
            dy = f32(g["dx"])
        grads = {k: grads[k] for k in self._params}          # state_dict order
        x_grad = dy[:, 0] if unbatched else (dy.transpose(1, 0, 2) if self.batch_first else dy)
        grads["input"] = np.ascontiguousarray(x_grad)
        for d, s in zip(dinit, self._state_names):
            grads[f"{s}0"] = d[:, 0].copy() if unbatched else d
        return grads


class LSTM(_RNN):
    """Multi-layer LSTM with torch.nn.LSTM's semantics, parameters and layout."""

    cell, n_gates, _state_names = "lstm", 4, ("h", "c")

    def __call__(self, x, hx=None):
        """x (T, B, I) (batch_first: (B, T, I)); hx None or (h0, c0) each
        (L, B, H). Returns y (T, B, H), (h_n, c_n) each (L, B, H)."""
        h0, c0 = (None, None) if hx is None else hx
        y, (h_n, c_n) = self._forward(x, [("h0", h0), ("c0", c0)])
        return y, (h_n, c_n)

    def backward(self, dy, dh_n=None, dc_n=None) -> dict[str, np.ndarray]:
        """Gradients of the last forward call given dL/dy (and optionally
        dL/dh_n, dL/dc_n): every state_dict key, plus input, h0, c0."""
        return self._backward(dy, [("dh_n", dh_n), ("dc_n", dc_n)])


class GRU(_RNN):
    """Multi-layer GRU with torch.nn.GRU's semantics, parameters and layout."""

    cell, n_gates, _state_names = "gru", 3, ("h",)

    def __call__(self, x, hx=None):
        """x (T, B, I) (batch_first: (B, T, I)); hx None or h0 (L, B, H).
        Returns y (T, B, H), h_n (L, B, H)."""
        y, (h_n,) = self._forward(x, [("h0", hx)])
        return y, h_n

    def backward(self, dy, dh_n=None) -> dict[str, np.ndarray]:
        """Gradients of the last forward call: every state_dict key, plus input, h0."""
        return self._backward(dy, [("dh_n", dh_n)])
