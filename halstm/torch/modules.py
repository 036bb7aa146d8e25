"""The torch.nn.LSTM / GRU / RNN drop-ins and Recurrent(cell)."""
from __future__ import annotations

import contextlib
import math

import numpy as np
import torch
from torch import Tensor
from torch.nn.utils import rnn as rnn_utils

from .. import cells, machine, memory, wavefront
from ..runtime import row_lengths
from .directions import _Directions, _Rows, _move_rows, _numpy_rows
from .kernels import (_cpu_runs_bf16, _ints, _make_step_function, _side_stream, _spec,
                      _step_functions, _traced, _transformed)
from .layer import _host, _run_layer
from .stack import _Stack


def _check_input(module, x: Tensor) -> Tensor:
    """x checked against the module's parameters (device, dtype); inside a
    torch.autocast region a float16 / bfloat16 x comes back as float32."""
    if not isinstance(x, Tensor):
        raise TypeError(f"input: expected a Tensor or PackedSequence, got {type(x).__name__}")
    if (x.dtype in (torch.float16, torch.bfloat16) and x.device.type in ("cpu", "cuda")
            and torch.is_autocast_enabled(x.device.type)):
        x = x.float()        # autocast: the kernels take float32 (bf16: _call_precision)
    if x.dtype != torch.float32:
        raise TypeError(f"input: halstm's kernels run float32, got {x.dtype} (convert with "
                        f".float())")
    # (a module's own parameters read directly: named_parameters costs
    # microseconds a call, which step-by-step decoding pays every step)
    for name, p in (module.named_parameters() if module._modules else
                    module._parameters.items()):
        if p is None:
            continue
        if p.device != x.device:
            raise ValueError(f"input is on {x.device} but parameter {name} is on "
                             f"{p.device}; move one of them (module.to(device))")
        if p.dtype != torch.float32:
            raise TypeError(f"parameter {name}: halstm's kernels run float32, got {p.dtype} "
                            f"(module.float())")
    return x


def _initialise(params, hidden_size: int, vector_specs) -> None:
    """torch's initialisation of params, (base name, Parameter) pairs (the
    name without a layer suffix): matrices and biases uniform in
    ±1/sqrt(hidden_size); vector parameters as the cell declares."""
    bound = 1.0 / math.sqrt(hidden_size)
    inits = {v.name: v.init for v in vector_specs}
    with torch.no_grad():
        for base, p in params:
            init = inits.get(base, "uniform")
            p.uniform_(-bound, bound) if init == "uniform" else p.fill_(init)


def _not_scriptable(module):
    """torch.jit.script asks each module for a scriptable version first."""
    raise TypeError(f"{type(module).__name__}: halstm.torch layers call their kernels from "
                    f"Python, which TorchScript (torch.jit.script) cannot compile; use "
                    f"torch.compile or torch.export")


class _Recurrent(torch.nn.Module):
    """A stack of layers of one cell with torch.nn.RNNBase's constructor,
    parameters and call."""

    __prepare_scriptable__ = _not_scriptable

    def __init__(self, cell: str, input_size: int, hidden_size: int, num_layers: int = 1,
                 bias: bool = True, batch_first: bool = False, dropout: float = 0.0,
                 bidirectional: bool = False, proj_size: int = 0, device=None, dtype=None,
                 schedule: str | None = None, precision: str = "fp32"):
        super().__init__()
        from halstm import cublas
        if precision not in cublas.PRECISIONS:
            raise ValueError(f"precision: expected one of {cublas.PRECISIONS}, got {precision!r}")
        self.precision = precision
        for name, v in (("input_size", input_size), ("hidden_size", hidden_size),
                        ("num_layers", num_layers)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}: expected a positive int, got {v!r}")
        if not isinstance(dropout, (int, float)) or isinstance(dropout, bool) \
                or not 0 <= dropout <= 1:
            raise ValueError(f"dropout: expected a probability in [0, 1], got {dropout!r}")
        if not isinstance(proj_size, int) or isinstance(proj_size, bool) \
                or not 0 <= proj_size < hidden_size:
            raise ValueError(f"proj_size: expected an int in [0, hidden_size={hidden_size}), "
                             f"got {proj_size!r}")
        if dtype not in (None, torch.float32):
            raise TypeError(f"dtype: halstm's kernels run float32, got {dtype}")
        self.cell = cells.check(cell)
        d = cells.definition(cell)
        self.input_size, self.hidden_size, self.num_layers = input_size, hidden_size, num_layers
        self.bias, self.batch_first, self.dropout = bool(bias), bool(batch_first), float(dropout)
        self.bidirectional, self.proj_size, self.schedule = bool(bidirectional), proj_size, schedule
        if proj_size and d.d_prev["h"] is not None:
            raise ValueError(f"proj_size: cell {cell!r} reads h in its step itself, not only "
                             f"through W_hh h; a projection needs a cell that does not")
        self._states = tuple(d.states)
        _make_step_function(self.cell)
        self._vector_specs = [v for v in d.vectors if self.bias or not v.bias]
        self._all_vectors = d.vectors
        self._matrix_bias = d.matrix_bias
        G, H, D = len(d.gates), hidden_size, 2 if bidirectional else 1
        R = proj_size or H                  # the size of h: the output per direction
        self._gates = G
        self._flat_weights_names = []
        for layer in range(num_layers):
            K = input_size if layer == 0 else R * D
            for sfx in ("", "_reverse")[:D]:
                shapes = {"weight_ih": (G * H, K), "weight_hh": (G * H, R)}
                if self.bias and self._matrix_bias:
                    shapes |= {"bias_ih": (G * H,), "bias_hh": (G * H,)}
                for v in self._vector_specs:
                    shapes[v.name] = ((G if v.per_gate else 1) * H,)
                if proj_size:
                    shapes["weight_hr"] = (R, H)
                for base, shape in shapes.items():
                    name = f"{base}_l{layer}{sfx}"
                    self.register_parameter(name, torch.nn.Parameter(
                        torch.empty(shape, dtype=torch.float32, device=device)))
                    self._flat_weights_names.append(name)
        self._weight_name_set = frozenset(self._flat_weights_names)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """torch's initialisation (_initialise)."""
        _initialise(((name.rsplit("_l", 1)[0], getattr(self, name))     # (weight_ih_l0 ->
                     for name in self._flat_weights_names),             # weight_ih)
                    self.hidden_size, self._vector_specs)

    def __setstate__(self, state) -> None:     # (torch.load, copy.deepcopy)
        super().__setstate__(state)
        _make_step_function(self.cell)
        # (a module pickled before the set existed)
        self._weight_name_set = frozenset(self._flat_weights_names)

    def flatten_parameters(self) -> None:
        """torch.nn.RNNBase's: nothing to do (the kernels take the
        parameters as they are)."""

    @property
    def all_weights(self) -> list[list[Tensor]]:
        n = len(self._flat_weights_names) // (self.num_layers * self._directions)
        names = self._flat_weights_names
        return [[getattr(self, k) for k in names[i:i + n]] for i in range(0, len(names), n)]

    @property
    def _directions(self) -> int:
        return 2 if self.bidirectional else 1

    def extra_repr(self) -> str:
        s = f"{self.input_size}, {self.hidden_size}"
        if self.num_layers != 1:
            s += f", num_layers={self.num_layers}"
        for k, default in (("bias", True), ("batch_first", False), ("dropout", 0.0),
                           ("bidirectional", False), ("proj_size", 0)):
            if getattr(self, k) != default:
                s += f", {k}={getattr(self, k)}"
        return s

    # ---- one layer's parameters ------------------------------------------
    def _weights(self, layer: int, sfx: str, zero: Tensor | None):
        """w_ih, b_ih, w_hh, b_hh, vectors {name: (H,) or (G*H,)} (None
        without), w_hr (None without a projection) of a layer and direction
        (_weights_by)."""
        params, names = self._parameters, self._weight_name_set

        def get(name):
            key = f"{name}_l{layer}{sfx}"
            p = params.get(key)
            # (getattr, which torch.nn.Module answers by exceptions where a name
            # is missing, only for a declared weight that is not a plain
            # parameter: torch.nn.utils.parametrize makes it a property)
            return p if p is not None or key not in names else getattr(self, key, None)
        return self._weights_by(get, zero)

    def _weights_by(self, get, zero: Tensor | None):
        """_weights of parameters get(base name) (None where there is none).
        zero: (G*H,) zeros for the matrix biases they lack (None where they
        have them)."""
        b_ih, b_hh = get("bias_ih"), get("bias_hh")
        vectors = None
        if self._all_vectors:      # a bias left out (bias=False) is zeros
            H = self.hidden_size
            vectors = {v.name: zero.new_zeros(((self._gates if v.per_gate else 1) * H,))
                       if get(v.name) is None else get(v.name) for v in self._all_vectors}
        return (get("weight_ih"), zero if b_ih is None else b_ih, get("weight_hh"),
                zero if b_hh is None else b_hh, vectors, get("weight_hr"))

    def _vec(self, vectors):
        """The vector parameters as one (V, H) tensor (None without)."""
        return None if vectors is None else torch.cat(
            [a.view(-1, self.hidden_size) for a in vectors.values()])

    def _both_directions(self, args, batch_sizes, spec, save):
        """Both directions of a CPU layer without a projection by one
        _Directions call: (y, y_rev), (finals, finals_rev)."""
        flat = [[w_ih, b_ih, w_hh, b_hh, self._vec(vectors), *init_d]
                for _, init_d, (w_ih, b_ih, w_hh, b_hh, vectors, _) in args]
        y0, y1, _, _, *fins = _Directions.apply(args[0][0], args[1][0], batch_sizes, spec, save,
                                                *flat[0], *flat[1])
        NS = len(self._states)
        return (y0, y1), (fins[:NS], fins[NS:])

    def _call_precision(self, device: torch.device) -> str:
        """The precision of a call: the module's, or "bf16" for "fp32"
        inside a torch.autocast(dtype=torch.bfloat16) region where the
        device runs bf16 kernels (CUDA; a CPU with AMX or AVX512-BF16, for
        a cell that does not reduce over its units)."""
        kind = device.type
        if (self.precision == "fp32" and torch.is_autocast_enabled(kind)
                and torch.get_autocast_dtype(kind) == torch.bfloat16
                and (kind == "cuda" or _cpu_runs_bf16(self.cell))):
            return "bf16"
        return self.precision

    def _each_direction(self, args, batch_sizes, save, given, side, precision):
        """Each direction of a layer by its own call (_direction): ys (the
        reverse one in its input's time order) and per direction its
        finals. With a side stream (a CUDA bidirectional layer, eagerly)
        the reverse direction runs on it, with its own library instance
        (lane 1), beside the forward one on the current stream."""
        if side is not None:
            main = torch.cuda.current_stream(args[0][0].device)
            side.wait_stream(main)
        ys, fins = [], []
        for d, (inp, init_d, weights) in enumerate(args):
            beside = side is not None and d == 1
            with torch.cuda.stream(side) if beside else contextlib.nullcontext():
                spec = _spec(self.cell, inp.shape[-1], self.hidden_size, self.schedule,
                             precision, lane=int(beside))
                y, fin = self._direction(inp, init_d, batch_sizes, weights, spec, save, given)
            ys.append(y)
            fins.append(fin)
        if side is not None:     # main reads what side made; side read what main made
            main.wait_stream(side)
            inp, init_d, (*ws, vectors, w_hr) = args[1]
            for a in (inp, *init_d, *ws, *(vectors or {}).values(), w_hr):
                if a is not None:
                    a.record_stream(side)
            for a in (ys[1], *fins[1]):
                a.record_stream(main)
        return ys, fins

    def _direction(self, x, init, batch_sizes, weights, spec, save, given):
        """One layer, one direction over x (T, B, K): y (T, B, R) and each
        state's final (B, R for h, else H).

        With a projection (h = W_hr m, R units), the kernels run the cell
        on m: W_hh h = (W_hh W_hr) m, so the recurrent weight is W_hh W_hr
        (G*H, H), and y = W_hr m over all steps is one product after the
        time loop. A given h_0 has no m: step 0 then runs here, in torch
        (given: hx was passed; without, m_0 = 0 stands for h_0 = 0)."""
        w_ih, b_ih, w_hh, b_hh, vectors, w_hr = weights
        vec = self._vec(vectors)
        if w_hr is None:
            return _run_layer(x, w_ih, b_ih, w_hh, b_hh, vec, init, batch_sizes, spec, save)
        w_m = w_hh @ w_hr
        if not given:      # (init: Nones; m_0 = 0)
            m, finals = _run_layer(x, w_ih, b_ih, w_m, b_hh, vec, init, batch_sizes, spec, save)
        else:
            step = _step_functions[self.cell]
            first = step(x[0] @ w_ih.T + b_ih, init[0] @ w_hh.T + b_hh, init, vectors)
            m, finals = first[0][None], list(first)             # (1, B, H), per state (B, H)
            if len(x) > 1:    # steps 1.. in the kernels, the rows longer than 1 step
                B = len(first[0])
                n = B if batch_sizes is None else int(batch_sizes[1])
                rest, finals = _run_layer(x[1:, :n], w_ih, b_ih, w_m, b_hh, vec,
                                          [a[:n] for a in first],
                                          None if batch_sizes is None else batch_sizes[1:],
                                          spec, save)
                if n < B:           # the rows that ended after step 0
                    rest = torch.cat([rest, rest.new_zeros((len(x) - 1, B - n,
                                                            self.hidden_size))], 1)
                    finals = [torch.cat([f, a[n:]]) for f, a in zip(finals, first)]
                m = torch.cat([m, rest])
        return m @ w_hr.T, [finals[0] @ w_hr.T, *finals[1:]]

    # ---- the call ---------------------------------------------------------
    def _run(self, input, hx):
        """(output, finals: per state (L*D, B, H)) with torch's input forms."""
        if isinstance(input, rnn_utils.PackedSequence):
            return self._run_packed(input, hx)
        input = _check_input(self, input)
        if input.dim() not in (2, 3):
            raise ValueError(f"input: expected a 3-D (seq, batch, input_size) tensor "
                             f"({'batch first' if self.batch_first else 'time first'}) "
                             f"or 2-D unbatched (seq, input_size), got {input.dim()}-D "
                             f"{tuple(input.shape)}")
        unbatched = input.dim() == 2
        x = input.unsqueeze(1) if unbatched else (
            input.transpose(0, 1) if self.batch_first else input)
        if input.shape[-1] != self.input_size or x.shape[0] == 0:
            raise ValueError(f"input: expected input_size {self.input_size} features and at "
                             f"least one time step, got shape {tuple(input.shape)} "
                             f"({'batch first' if self.batch_first else 'time first'})")
        if x.shape[1] == 0:       # an empty batch, as torch.nn: empty outputs
            y, finals = self._empty(x, hx)
        else:
            y, finals = self._layers(x, hx, unbatched)
        if unbatched:
            return y.squeeze(1), [f.squeeze(1) for f in finals]
        return (y.transpose(0, 1) if self.batch_first else y), finals

    @torch.compiler.disable(reason="halstm.torch runs a PackedSequence eagerly: its batch "
                                   "sizes and row indices are host data")
    def _run_packed(self, input, hx):
        """_run of a PackedSequence: its rows scattered into a zero-padded
        (T, B, I) (rows sorted longest first), the output gathered back."""
        rows = _check_input(self, input.data)
        if rows.dim() != 2 or rows.shape[-1] != self.input_size:
            raise ValueError(f"input: expected PackedSequence data (rows, input_size "
                             f"{self.input_size}), got shape {tuple(rows.shape)}")
        bs = input.batch_sizes
        T, B = len(bs), int(bs[0])
        index = self._packed_index(bs)
        move = _move_rows if _transformed() else _Rows.apply   # (torch ops: torch.func)
        x = move(rows, None, index, T * B)
        y, finals = self._layers(x.view(T, B, -1), hx, False, bs, input.sorted_indices)
        data = move(y.reshape(T * B, -1), index, None, len(index))
        out = rnn_utils.PackedSequence(data, input.batch_sizes, input.sorted_indices,
                                       input.unsorted_indices)
        if input.unsorted_indices is not None:
            finals = [f.index_select(1, input.unsorted_indices) for f in finals]
        return out, finals

    def _layers(self, x, hx, unbatched, bs=None, order=None):
        """Every layer and direction over x (T, B, K): y (T, B, D*R) and per
        state its finals (L*D, B, H). bs: a packed batch's step sizes (rows
        sorted longest first; order: the caller's row of each, for hx;
        the callers have checked x's shape)."""
        T, B, _ = x.shape
        L, D, H = self.num_layers, self._directions, self.hidden_size
        lengths = None if bs is None else row_lengths(_host(bs), B)
        batch_sizes = None if bs is None else bs.to(torch.int32)
        init = self._initial(hx, B, unbatched, x)
        if order is not None and hx is not None:    # hx comes in the caller's row order
            init = [s.index_select(1, order) for s in init]
        # (zeros for the matrix biases where the layers lack them)
        zero = (None if "bias_ih_l0" in self._weight_name_set
                else x.new_zeros((self._gates * H,)))
        save = torch.is_grad_enabled()
        rev = None if D == 1 else self._reverse_index(T, B, lengths, x.device)
        finals = [[] for _ in self._states]
        side = _side_stream(x.device) if D == 2 else None   # (CUDA, eager)
        precision = self._call_precision(x.device)
        n = self._wavefront_chunks(x, bs)
        if n > 1:
            return self._wavefront(x, init, zero, n, save, precision)
        for layer in range(L):
            # each direction's input, initial states and weights, made on the
            # current stream (a leaf's gradient then comes back on it)
            args = [(x if d == 0 else self._reverse(x, rev), [s[layer * D + d] for s in init],
                     self._weights(layer, sfx, zero)) for d, sfx in enumerate(("", "_reverse")[:D])]
            if D == 2 and x.device.type == "cpu" and not self.proj_size and not _traced():
                spec = _spec(self.cell, x.shape[-1], H, self.schedule, precision)
                ys, fins = self._both_directions(args, batch_sizes, spec, save)
            else:
                ys, fins = self._each_direction(args, batch_sizes, save, hx is not None, side,
                                                precision)
            for fin in fins:
                for s, a in enumerate(fin):
                    finals[s].append(a)
            x = ys[0] if D == 1 else torch.cat([ys[0], self._reverse(ys[1], rev)], -1)
            if self.dropout and self.training and layer < L - 1:
                # (the mask drawn as _wavefront draws its: on CUDA, dropout's
                # draw depends on its input's alignment, not on its values)
                x = x * torch.nn.functional.dropout(x.new_ones(x.shape), self.dropout,
                                                    training=True)
        # (one layer and direction: its finals are copies already)
        return x, [torch.stack(f) if len(f) > 1 else f[0].unsqueeze(0) for f in finals]

    def _wavefront_chunks(self, x, bs) -> int:
        """The chunks of a CUDA stack's wavefront (halstm.wavefront; 1: none):
        eagerly, one direction, no projection or batch sizes (as the numpy
        API's, nn.Recurrent._wavefront_chunks)."""
        if (x.device.type != "cuda" or self._directions > 1 or self.proj_size or bs is not None
                or _traced()):
            return 1
        return wavefront.chunks(x.shape[0], x.shape[1], self._gates, self.input_size,
                                self.hidden_size, self.num_layers, machine.gpu_sms())

    def _wavefront(self, x, init, zero, n, save, precision):
        """_layers as a wavefront of n chunks (_Stack): y (T, B, H) and per
        state its finals (L, B, H)."""
        L, H, NS = self.num_layers, self.hidden_size, len(self._states)
        masks = ()                       # (drawn as the layers in turn draw theirs)
        if self.dropout and self.training:
            ones = x.new_ones((x.shape[0], x.shape[1], H))
            masks = tuple(torch.nn.functional.dropout(ones, self.dropout, training=True)
                          for _ in range(L - 1))
        specs, flat = [], []
        for layer in range(L):
            w_ih, b_ih, w_hh, b_hh, vectors, _ = self._weights(layer, "", zero)
            specs.append(_spec(self.cell, w_ih.shape[1], H, self.schedule, precision))
            flat += [w_ih, b_ih, w_hh, b_hh, self._vec(vectors), *[s[layer] for s in init]]
        y, *finals = _Stack.apply(x, n, tuple(specs), save, masks, *flat)
        return y, [torch.stack(finals[s::NS]) for s in range(NS)]

    @staticmethod
    def _packed_index(batch_sizes) -> np.ndarray:
        """Where each row of a packed sequence's data lies in the padded
        (T*B) rows: data[n] is padded[t, b] at t*B + b (torch's
        pad_packed_sequence copies step by step)."""
        bs = _host(batch_sizes)
        t = np.repeat(np.arange(len(bs)), bs)
        first = np.cumsum(bs) - bs
        return t * bs[0] + np.arange(len(t)) - first[t]

    @staticmethod
    def _reverse_index(T, B, lengths, device):
        """Each sequence reversed within its length (padding stays in
        place): (rows, steps) with rows the source row in (T*B) of each
        row, for _Rows on a CPU, and steps the (T, B) time indices on
        `device` (None: reverse all T steps)."""
        steps = memory.reversed_steps(T, np.full(B, T) if lengths is None else lengths)
        rows = (steps * B + np.arange(B)).reshape(-1)
        return rows, None if lengths is None else _ints(steps, device)

    @staticmethod
    def _reverse(a: Tensor, rev) -> Tensor:
        """a (T, B, C) reversed in time by _reverse_index's rev."""
        rows, steps = rev
        if _numpy_rows(a):
            T, B, C = a.shape
            return _Rows.apply(a.reshape(T * B, C), rows, None, T * B).view(T, B, C)
        if steps is None:
            return a.flip(0)
        return a.gather(0, steps[:, :, None].expand(a.shape)).contiguous()

    def _empty(self, x, hx):
        """_layers of an empty batch x (T, 0, K): y (T, 0, D*R) and per state
        finals (L*D, 0, size), joined to the parameters' graph (zero
        gradients), hx checked."""
        self._initial(hx, 0, False, x)
        LD, R = self.num_layers * self._directions, self.proj_size or self.hidden_size
        anchor = sum(p.flatten()[:1].sum() for p in self.parameters()) * 0.0
        y = x.new_zeros((x.shape[0], 0, self._directions * R)) + anchor
        return y, [x.new_zeros((LD, 0, R if s == "h" else self.hidden_size)) + anchor
                   for s in self._states]

    def _initial(self, hx, B, unbatched, x):
        """Per state an (L*D, B, H) tensor: the caller's; without hx, L*D
        Nones (zeros, which the kernels make in place)."""
        LD, H = self.num_layers * self._directions, self.hidden_size
        n = len(self._states)
        size = {s: self.proj_size or H if s == "h" else H for s in self._states}
        if hx is None:
            return [[None] * LD for _ in self._states]
        given = (hx,) if n == 1 else hx
        if n > 1 and (not isinstance(hx, (tuple, list)) or len(hx) != n):
            raise TypeError(f"hx: expected None or a tuple of {n} tensors "
                            f"({', '.join(s + '_0' for s in self._states)}), got "
                            f"{type(hx).__name__}")
        out = []
        for s, a in zip(self._states, given):
            want = (LD, size[s]) if unbatched else (LD, B, size[s])
            if not isinstance(a, Tensor) or tuple(a.shape) != want:
                raise ValueError(f"hx: expected {s}_0 of shape {want}, got "
                                 f"{tuple(a.shape) if isinstance(a, Tensor) else type(a).__name__}")
            if a.device != x.device or a.dtype != torch.float32:
                raise ValueError(f"hx: {s}_0 is {a.dtype} on {a.device}; expected float32 on "
                                 f"{x.device}, as the input")
            out.append(a.unsqueeze(1) if unbatched else a)
        return out


class LSTM(_Recurrent):
    """torch.nn.LSTM on halstm's kernels: LSTM(input_size, hidden_size,
    num_layers=1, bias=True, batch_first=False, dropout=0.0,
    bidirectional=False, proj_size=0, device=None, dtype=None); a call
    returns output, (h_n, c_n)."""

    def __init__(self, input_size, hidden_size, num_layers=1, bias=True, batch_first=False,
                 dropout=0.0, bidirectional=False, proj_size=0, device=None, dtype=None,
                 schedule=None, precision="fp32"):
        super().__init__("lstm", input_size, hidden_size, num_layers, bias, batch_first,
                         dropout, bidirectional, proj_size, device, dtype, schedule, precision)

    def forward(self, input, hx=None):
        out, (h, c) = self._run(input, hx)
        return out, (h, c)


class GRU(_Recurrent):
    """torch.nn.GRU on halstm's kernels; a call returns output, h_n."""

    def __init__(self, input_size, hidden_size, num_layers=1, bias=True, batch_first=False,
                 dropout=0.0, bidirectional=False, device=None, dtype=None, schedule=None,
                 precision="fp32"):
        super().__init__("gru", input_size, hidden_size, num_layers, bias, batch_first,
                         dropout, bidirectional, 0, device, dtype, schedule, precision)

    def forward(self, input, hx=None):
        out, (h,) = self._run(input, hx)
        return out, h


class RNN(_Recurrent):
    """torch.nn.RNN (nonlinearity "tanh" or "relu") on halstm's kernels; a
    call returns output, h_n."""

    def __init__(self, input_size, hidden_size, num_layers=1, nonlinearity="tanh", bias=True,
                 batch_first=False, dropout=0.0, bidirectional=False, device=None, dtype=None,
                 schedule=None, precision="fp32"):
        if nonlinearity not in ("tanh", "relu"):
            raise ValueError(f"nonlinearity: expected 'tanh' or 'relu', got {nonlinearity!r}")
        self.nonlinearity = nonlinearity
        super().__init__(f"rnn_{nonlinearity}", input_size, hidden_size, num_layers, bias,
                         batch_first, dropout, bidirectional, 0, device, dtype, schedule,
                         precision)

    forward = GRU.forward


class Recurrent(_Recurrent):
    """Any halstm cell (by name, or a definition from halstm.cells.define)
    as a stack of layers with torch.nn.RNNBase's options. Parameters
    weight_ih_l{k}, weight_hh_l{k}, bias_ih_l{k}, bias_hh_l{k} (not for a
    cell defined with matrix_bias=False) and the cell's vector parameters
    <name>_l{k} (with _reverse for the reverse direction); with proj_size,
    weight_hr_l{k} (a cell that reads h only through W_hh h). A call returns
    output, h_n for a one-state cell, else output, (h_n, s2_n, ...)."""

    def __init__(self, cell, input_size, hidden_size, num_layers=1, bias=True,
                 batch_first=False, dropout=0.0, bidirectional=False, proj_size=0, device=None,
                 dtype=None, schedule=None, precision="fp32"):
        if isinstance(cell, cells.Definition):
            cell = cells.register(cell)
        if not isinstance(cell, str):
            raise TypeError(f"cell: expected a cell name or definition, got "
                            f"{type(cell).__name__}")
        super().__init__(cell, input_size, hidden_size, num_layers, bias, batch_first,
                         dropout, bidirectional, proj_size, device, dtype, schedule, precision)

    def forward(self, input, hx=None):
        out, finals = self._run(input, hx)
        return (out, finals[0]) if len(finals) == 1 else (out, tuple(finals))
