"""One step of a cell, torch.nn.LSTMCell-style: LSTMCell, GRUCell, RNNCell
and RecurrentCell(cell), for step-by-step decoding."""
from __future__ import annotations

import torch
from torch import Tensor

from .. import cells
from .kernels import _spec
from .layer import _run_layer
from .modules import _Recurrent, _check_input, _initialise, _not_scriptable


class _Cell(torch.nn.Module):
    """One step of a cell, torch.nn.LSTMCell-style: parameters weight_ih,
    weight_hh, bias_ih, bias_hh (and the cell's vector parameters by their
    names); input (B, I) or unbatched (I,)."""

    __prepare_scriptable__ = _not_scriptable

    def __init__(self, cell, input_size, hidden_size, bias=True, device=None, dtype=None):
        super().__init__()
        stack = _Recurrent(cell, input_size, hidden_size, 1, bias, device=device, dtype=dtype)
        self.input_size, self.hidden_size, self.bias = input_size, hidden_size, bool(bias)
        for name in stack._flat_weights_names:          # weight_ih_l0 -> weight_ih
            setattr(self, name[:-3], getattr(stack, name))
        stack._parameters.clear()
        object.__setattr__(self, "_stack", stack)       # (its facts only: not a submodule)

    def reset_parameters(self) -> None:
        """torch's initialisation (_initialise), as Recurrent's."""
        _initialise(self.named_parameters(), self.hidden_size, self._stack._vector_specs)

    def extra_repr(self) -> str:
        return f"{self.input_size}, {self.hidden_size}" + ("" if self.bias else ", bias=False")

    def _step(self, input, hx):
        x = _check_input(self, input)
        if x.dim() not in (1, 2) or x.shape[-1] != self.input_size:
            raise ValueError(f"input: expected (batch, {self.input_size}) or unbatched "
                             f"({self.input_size},), got {tuple(x.shape)}")
        unbatched = x.dim() == 1
        x = x.reshape(1, -1, self.input_size)
        B, H, n = x.shape[1], self.hidden_size, len(self._stack._states)
        if hx is None:           # (zeros, which the kernels make in place)
            hx = [None] * n
        else:
            hx = list(hx) if n > 1 else [hx]
            want = (H,) if unbatched else (B, H)
            for s, a in zip(self._stack._states, hx):
                if not isinstance(a, Tensor) or a.shape != want:
                    raise ValueError(f"hx: expected {s} of shape {want}, "
                                     f"got {tuple(getattr(a, 'shape', ()))}")
                if a.device != x.device or a.dtype != torch.float32:
                    raise ValueError(f"hx: {s} is {a.dtype} on {a.device}; expected float32 "
                                     f"on {x.device}, as the input")
            if unbatched:
                hx = [a.reshape(B, H) for a in hx]
        p = self._parameters
        zero = None if "bias_ih" in p else x.new_zeros((self._stack._gates * H,))
        w_ih, b_ih, w_hh, b_hh, vectors, _ = self._stack._weights_by(p.get, zero)
        spec = _spec(self._stack.cell, self.input_size, H, None)
        _, out = _run_layer(x, w_ih, b_ih, w_hh, b_hh, self._stack._vec(vectors), hx, None, spec,
                            torch.is_grad_enabled(), finals_only=True)
        return [o.reshape(H) for o in out] if unbatched else out


class LSTMCell(_Cell):
    """torch.nn.LSTMCell on halstm's kernels: (h', c') = cell(x, (h, c))."""

    def __init__(self, input_size, hidden_size, bias=True, device=None, dtype=None):
        super().__init__("lstm", input_size, hidden_size, bias, device, dtype)

    def forward(self, input, hx=None):
        h, c = self._step(input, hx)
        return h, c


class GRUCell(_Cell):
    """torch.nn.GRUCell on halstm's kernels: h' = cell(x, h)."""

    def __init__(self, input_size, hidden_size, bias=True, device=None, dtype=None):
        super().__init__("gru", input_size, hidden_size, bias, device, dtype)

    def forward(self, input, hx=None):
        return self._step(input, hx)[0]


class RNNCell(_Cell):
    """torch.nn.RNNCell on halstm's kernels: h' = cell(x, h)."""

    def __init__(self, input_size, hidden_size, bias=True, nonlinearity="tanh", device=None,
                 dtype=None):
        if nonlinearity not in ("tanh", "relu"):
            raise ValueError(f"nonlinearity: expected 'tanh' or 'relu', got {nonlinearity!r}")
        self.nonlinearity = nonlinearity
        super().__init__(f"rnn_{nonlinearity}", input_size, hidden_size, bias, device, dtype)

    forward = GRUCell.forward


class RecurrentCell(_Cell):
    """One step of any halstm cell (by name, or a definition from
    halstm.cells.define), for step-by-step decoding: parameters weight_ih,
    weight_hh, bias_ih, bias_hh and the cell's vector parameters, named as
    Recurrent's without the _l0 suffix. A one-state cell: h' = cell(x, h);
    else (h', s2', ...) = cell(x, (h, s2, ...)); hx None: zeros."""

    def __init__(self, cell, input_size, hidden_size, bias=True, device=None, dtype=None):
        if isinstance(cell, cells.Definition):
            cell = cells.register(cell)
        if not isinstance(cell, str):
            raise TypeError(f"cell: expected a cell name or definition, got "
                            f"{type(cell).__name__}")
        super().__init__(cell, input_size, hidden_size, bias, device, dtype)

    def forward(self, input, hx=None):
        out = self._step(input, hx)
        return out[0] if len(out) == 1 else tuple(out)
