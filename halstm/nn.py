"""PyTorch-compatible LSTM and GRU modules running halstm's compiled kernels.

    lstm = halstm.LSTM(13, 37, num_layers=2, seed=0)
    lstm.load_state_dict({k: v.numpy() for k, v in torch_lstm.state_dict().items()})
    y, (h_n, c_n) = lstm(x)                  # x (T, B, 13), float32
    grads = lstm.backward(dy)                # state_dict keys + input, h0, c0
    with halstm.no_grad():                   # inference: nothing kept for backward
        y, _ = lstm(x)

Kernels are compiled on first use (forward on the first call, backward on
the first backward) and cached on disk (see halstm.aot).

On a CUDA target (target="host-cuda") the parameters live on the GPU as
halstm.cuda.DeviceArrays (state_dict() returns them; load_state_dict
uploads), and so does everything between forward and backward. Results
come back where the input came from: numpy in, numpy out (one upload and
one download per call); a DeviceArray or a CUDA DLPack array (PyTorch,
CuPy) in, DeviceArrays out, with no host round trip.

precision="tf32" or "bf16" (CUDA targets): the GEMMs cuBLAS runs (the
projection, the gradients, a large batch's step products) in TF32 / bf16
tensor-core math with fp32 accumulation; storage, the states and the cell
stay fp32. gemm="halide" or "cublas" picks who runs
them (None: the target's default; see halstm.cublas). precision="bf16" on
a CPU with AMX or AVX512-BF16: every product of forward and backward with
bf16 operands and fp32 sums, on AMX tiles or as vdpbf16ps dot products
(halstm.bf16).

lengths= (a length per sequence), bidirectional=True and dropout=p
(between layers, in training mode: train() / eval(); masks hashed where
the layers run from keys numpy's generator seeded by `seed` draws, the
same on every target) run on every
target; proj_size=P (LSTM: h = W_hr m of P units, see halstm.projected)
on CPU targets (on a GPU, halstm.torch has it).
"""
from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from . import aot, cuda, machine
from . import memory, projected, runtime, wavefront
from .runtime import Library, step_batch_sizes

_PARAMS = ("weight_ih", "weight_hh", "bias_ih", "bias_hh")
_GRAD = threading.local()


def is_grad_enabled() -> bool:
    """False inside halstm.no_grad() (per thread)."""
    return getattr(_GRAD, "enabled", True)


@contextlib.contextmanager
def no_grad():
    """Forward passes inside keep nothing for backward, as under
    torch.no_grad(): the time steps store the new states only (not the
    activated gates backward reads), and backward() after such a pass
    raises. Also a decorator."""
    before = is_grad_enabled()
    _GRAD.enabled = False
    try:
        yield
    finally:
        _GRAD.enabled = before


def _positive_int(name, v):
    if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
        raise ValueError(f"{name}: expected a positive int, got {v!r}")
    return int(v)


def _on_device(a) -> bool:
    return isinstance(a, cuda.DeviceArray) or cuda._is_cuda_dlpack(a)


def _float_array(name, a):
    """a as a floating-point numpy array, or as a DeviceArray if it is on the GPU."""
    if _on_device(a):
        try:
            return cuda.asarray(a)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{name}: {e}") from None
    a = np.asarray(a)
    if not np.issubdtype(a.dtype, np.floating):
        raise TypeError(f"{name}: expected a floating-point array, got dtype {a.dtype}")
    return a


def _check_shape(name, a, expected):
    if tuple(a.shape) != tuple(expected):
        raise ValueError(f"{name}: expected shape {tuple(expected)}, got {tuple(a.shape)}")


def _layer(a, layer):
    """a[layer] of an (L, B, H) state array, or None for None (zeros)."""
    return None if a is None else a[layer]


class _RNN:
    cell = ""

    def __init__(self, input_size, hidden_size, num_layers=1, bias=True, batch_first=False,
                 dropout=0.0, bidirectional=False, target="host", schedule=None, seed=None,
                 proj_size=0, precision="fp32", gemm=None):
        self.input_size = _positive_int("input_size", input_size)
        self.hidden_size = _positive_int("hidden_size", hidden_size)
        self.num_layers = _positive_int("num_layers", num_layers)
        self.bias, self.batch_first = bool(bias), bool(batch_first)
        if (isinstance(dropout, bool) or not isinstance(dropout, (int, float))
                or not 0 <= dropout <= 1):
            raise ValueError(f"dropout: expected a probability in [0, 1], got {dropout!r}")
        self.dropout, self.bidirectional = float(dropout), bool(bidirectional)
        self.num_directions = 2 if self.bidirectional else 1
        self.training = True
        self.target, self.schedule, self.precision = target, schedule, precision
        self.gemm = aot.Spec(self.cell, self.input_size, self.hidden_size, "fwd", target,
                             schedule, precision=precision, gemm=gemm).gemm
        if (isinstance(proj_size, bool) or not isinstance(proj_size, (int, np.integer))
                or not 0 <= proj_size < self.hidden_size):
            raise ValueError(f"proj_size: expected an int in [0, hidden_size="
                             f"{self.hidden_size}), got {proj_size!r}")
        self.proj_size = int(proj_size)
        self.on_gpu = "cuda" in str(target).split("-")
        if self.on_gpu:
            if self.proj_size:
                raise ValueError(f"proj_size: runs on CPU targets in this API (got target "
                                 f"{target!r}); on a GPU use halstm.torch")
            try:
                cuda.driver()
            except cuda.CudaError as e:
                raise cuda.CudaError(f"target {target!r} needs a usable CUDA GPU: {e}") from None
        self._mem = memory.for_device("cuda" if self.on_gpu else "cpu")
        G, H = self.n_gates, self.hidden_size
        from . import cells
        d = cells.definition(self.cell)
        if self.proj_size and d.d_prev["h"] is not None:
            raise ValueError(f"proj_size: cell {self.cell!r} reads h in its step itself, not "
                             f"only through W_hh h; a projection needs a cell that does not")
        if self.proj_size and not d.dxp_is_dhg:   # (step 0 adds W_hh h_0 to the input's)
            raise ValueError(f"proj_size: cell {self.cell!r} reads its input and recurrent "
                             f"products apart, not only as their sum; halstm.torch projects "
                             f"such a cell")
        self._matrix_bias = d.matrix_bias
        # the vector parameters by base name: (channels, init); the kernels
        # take them as one (V, H) array, in declaration order
        self._vectors = {v.name: (G if v.per_gate else 1, v.init) for v in d.vectors
                         if self.bias or not v.bias}
        self._vector_specs = d.vectors
        rng = np.random.default_rng(seed)
        bound = 1.0 / np.sqrt(H)       # PyTorch: uniform(-1/sqrt(H), 1/sqrt(H))
        self._params: dict = {}
        for layer in range(self.num_layers):
            for name, shape in self._param_shapes(layer).items():
                init = self._vectors.get(name.rsplit("_l", 1)[0], (0, "uniform"))[1]
                self._params[name] = self._array(
                    rng.uniform(-bound, bound, shape).astype(np.float32) if init == "uniform"
                    else np.full(shape, init, np.float32))
        self._vec_rows = self._vector_storage()
        self._zero_bias = self._array(np.zeros(G * H, np.float32))
        self._rng = rng            # and then the dropout masks
        self._libs: dict = {}
        self._libs_lock = threading.Lock()
        # What backward reads is kept per thread: each thread's backward
        # follows its own last forward. load_state_dict bumps the version,
        # which voids every thread's tape.
        self._local = threading.local()
        self._version = 0
        self._fixed = None         # fixed_weights' token while its scope lasts

    @property
    def _tape(self):
        tape = getattr(self._local, "tape", None)
        return tape[1] if tape is not None and tape[0] == self._version else None

    @_tape.setter
    def _tape(self, value):
        self._local.tape = None if value is None else (self._version, value)

    @contextlib.contextmanager
    def fixed_weights(self):
        """A scope in which the weights do not change (sampling, evaluation
        loops): calls inside it reuse the weights' packed panels, which a
        library otherwise makes anew at every call (for one step at a time,
        most of the call's work). A weight changed inside the scope is not
        seen by the calls after it."""
        outer, self._fixed = self._fixed, object()
        try:
            yield self
        finally:
            self._fixed = outer

    def _pack_key(self, layer, d):
        """runtime.Library's pack_key for layer and direction d: inside
        fixed_weights, the scope's; else None (pack every call)."""
        return None if self._fixed is None else (self._fixed, layer, d)

    def train(self, mode: bool = True) -> "_RNN":
        """Training mode (dropout between layers on) or not, as torch's."""
        self.training = bool(mode)
        return self

    def eval(self) -> "_RNN":
        return self.train(False)

    # ---- parameters -------------------------------------------------------
    @staticmethod
    def _suffix(layer, d) -> str:
        """A parameter's suffix: layer `layer`, direction d (1: reverse)."""
        return f"_l{layer}" + ("_reverse" if d else "")

    @property
    def _h_size(self) -> int:
        """Units of h, the output of a direction: proj_size, else hidden_size."""
        return self.proj_size or self.hidden_size

    def _input_size(self, layer) -> int:
        return self.input_size if layer == 0 else self.num_directions * self._h_size

    def _param_shapes(self, layer) -> dict:
        G, H, K, R = self.n_gates, self.hidden_size, self._input_size(layer), self._h_size
        shapes = {}
        for d in range(self.num_directions):
            x = self._suffix(layer, d)
            shapes |= {f"weight_ih{x}": (G * H, K), f"weight_hh{x}": (G * H, R)}
            if self.bias and self._matrix_bias:
                shapes |= {f"bias_ih{x}": (G * H,), f"bias_hh{x}": (G * H,)}
            for name, (channels, _) in self._vectors.items():
                shapes[f"{name}{x}"] = (channels * H,)
            if self.proj_size:
                shapes[f"weight_hr{x}"] = (R, H)
        return shapes

    def _array(self, a):
        """a (numpy or device) as an array of this module's kind, copied."""
        if self.on_gpu:
            return cuda.asarray(a).copy() if _on_device(a) else cuda.DeviceArray.from_numpy(a)
        return np.array(a, dtype=np.float32, order="C")

    def _result(self, a, host: bool):
        """An internal array handed to the caller: numpy if host, else as is."""
        return a.numpy() if host and self.on_gpu else a

    def state_dict(self) -> dict:
        """The parameters by PyTorch's names: the module's own arrays (numpy,
        or DeviceArrays on a CUDA target), so an in-place update (an
        optimizer step) acts on the module."""
        return dict(self._params)

    def load_state_dict(self, state_dict, strict: bool = True) -> None:
        """Copy parameters in. Any missing, unexpected or wrongly shaped key
        raises (strict) before anything changes."""
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict: expected a mapping of parameter names to arrays "
                            f"(as state_dict() returns), got {type(state_dict).__name__}")
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
            if self.on_gpu:
                self._params[k].copy_from(a)     # numpy (cast to float32) or device
            else:
                np.copyto(self._params[k], np.asarray(a), casting="unsafe")
        self._version += 1

    # ---- kernels ----------------------------------------------------------
    def _lib(self, layer: int, direction: str, onehot: bool = False, extra: int = 0,
             lane: int = 0) -> Library:
        """The library of `layer`'s input size (plus `extra` inputs); lane:
        which instance (its own workspaces and lock: two directions at once)."""
        K = self._input_size(layer) + extra
        key = (K, direction, lane) + (("onehot",) if onehot else ())
        with self._libs_lock:
            if key not in self._libs:
                spec = aot.Spec(self.cell, K, self.hidden_size, direction, self.target,
                                self.schedule, onehot, precision=self.precision,
                                gemm=self.gemm)
                self._libs[key] = Library(*aot.library(spec))
        return self._libs[key]

    def _onehot_ok(self) -> bool:
        """Whether this target and schedule have the one-hot index pipelines
        (gather, grads_ids: CPU targets, schedules.ONEHOT); elsewhere integer
        input is expanded to one-hot rows."""
        from halstm import schedules
        return (not self.on_gpu and not self.proj_size and
                schedules.resolve(self.target, self.schedule) in schedules.ONEHOT)

    def compile(self, backward: bool = True) -> "_RNN":
        """Build (or load from the cache) every kernel now rather than on first use."""
        for layer in range(min(self.num_layers, 2)):
            self._lib(layer, "fwd")
            if backward:
                self._lib(layer, "bwd")
        return self

    def _layer_weights(self, layer, d=0):
        p, x = self._params, self._suffix(layer, d)
        b_ih = p.get(f"bias_ih{x}", self._zero_bias)
        b_hh = p.get(f"bias_hh{x}", self._zero_bias)
        return p[f"weight_ih{x}"], b_ih, p[f"weight_hh{x}"], b_hh

    def _layer_proj(self, layer, d=0):
        """The layer's W_hr (proj_size, H)."""
        return self._params[f"weight_hr{self._suffix(layer, d)}"]

    def _vector_rows(self, layer, d) -> list:
        """(name, first, count): the rows of the kernels' (V, H) array each of
        the layer's vector parameters takes, in declaration order; a bias
        left out (bias=False) keeps its rows, named None."""
        out, r = [], 0
        for v in self._vector_specs:
            n = self.n_gates if v.per_gate else 1
            out.append((f"{v.name}{self._suffix(layer, d)}" if v.name in self._vectors else None,
                        r, n))
            r += n
        return out

    def _vector_storage(self) -> dict:
        """Per (layer, direction), the (V, H) array the kernels take the
        vector parameters in (_vector_rows; a bias left out: zeros); the
        vector parameters are views of its rows, so that a call passes it
        as it is, with no allocation or copy."""
        if not self._vector_specs:
            return {}
        H, out = self.hidden_size, {}
        for layer in range(self.num_layers):
            for d in range(self.num_directions):
                rows = self._vector_rows(layer, d)
                vec = self._mem.zeros((sum(n for _, _, n in rows), H))
                for name, r, n in rows:
                    if name is not None:
                        vec[r:r + n] = self._params[name].reshape(n, H)
                        self._params[name] = vec[r:r + n].reshape(n * H)
                out[layer, d] = vec
        return out

    def _layer_vec(self, layer, d=0):
        """The layer's vector parameters as the kernels take them: one (V, H)
        array (_vector_storage); None for a cell without."""
        return self._vec_rows.get((layer, d))

    def _vector_grads(self, layer, d, dvec) -> dict:
        """dvec (V, H) split into the layer's vector parameters' gradients."""
        return {name: dvec[r:r + n].reshape(n * self.hidden_size)
                for name, r, n in self._vector_rows(layer, d) if name is not None}

    # ---- forward / backward ----------------------------------------------
    def _ids(self, x):
        """Integer input: class indices of one-hot rows, (T, B) ((B, T) with
        batch_first) or unbatched (T,), as a fresh (T, B) int32 array."""
        layout = "(B, T)" if self.batch_first else "(T, B)"
        if x.ndim not in (1, 2):
            raise TypeError(f"input: expected floating-point input, or integer class indices "
                            f"{layout} or unbatched (T,), got dtype {x.dtype} shape {x.shape}")
        if 0 in x.shape:
            raise ValueError(f"input: class indices with an empty axis: shape {x.shape}")
        if x.min() < 0 or x.max() >= self.input_size:
            raise ValueError(f"input: class indices must lie in [0, {self.input_size}), got "
                             f"values from {x.min()} to {x.max()}")
        unbatched = x.ndim == 1
        ids = x.reshape(-1, 1) if unbatched else (x.T if self.batch_first else x)
        return np.ascontiguousarray(ids, dtype=np.int32), unbatched

    def _input(self, x):
        """x as a fresh (T, B, I) array of this module's kind (or, for integer
        class indices with a one-hot library, a (T, B) int32 array), whether
        it came unbatched, and whether it came from the host."""
        if isinstance(x, np.ndarray) and np.issubdtype(x.dtype, np.integer):
            ids, unbatched = self._ids(x)
            if self._onehot_ok():
                return ids, unbatched, True
            x = np.eye(self.input_size, dtype=np.float32)[ids]     # (T, B, I) one-hot rows
            return self._array(x), unbatched, True
        x = _float_array("input", x)
        host = isinstance(x, np.ndarray)
        layout = "(B, T, input_size)" if self.batch_first else "(T, B, input_size)"
        if x.ndim not in (2, 3):
            raise ValueError(f"input: expected a 3-D array {layout} or a 2-D unbatched "
                             f"(T, input_size), got shape {x.shape}")
        if x.shape[-1] != self.input_size or 0 in x.shape:
            raise ValueError(f"input: expected {layout} or unbatched (T, input_size), with "
                             f"input_size={self.input_size} and no empty axis, got shape {x.shape}")
        unbatched = x.ndim == 2
        # a copy where backward reads it (the caller may change theirs meanwhile);
        # under no_grad no backward will
        return self._seq_in(x, unbatched, in_place=not is_grad_enabled()), unbatched, host

    def _seq_in(self, a, unbatched, in_place=False):
        """A caller's sequence (batch_first / unbatched as given) as a new (T, B, n)
        array. in_place: a sequence in time-major order that needs no
        conversion is used itself (a view), not copied: a CPU module's
        float32 C-ordered numpy array (the library reads it only during the
        call), a GPU module's device array (the library reads it only in
        kernels queued before the call returns, on the default stream, as
        PyTorch's and CuPy's work runs, so a later write waits for them)."""
        host = isinstance(a, np.ndarray)
        as_is = (not host if self.on_gpu
                 else host and a.dtype == np.float32 and a.flags.c_contiguous)
        if in_place and not self.batch_first and as_is:
            return a.reshape(a.shape[0], 1, a.shape[1]) if unbatched else a
        if unbatched:
            return self._array(a).reshape(a.shape[0], 1, a.shape[1])
        if self.batch_first:
            return self._mem.swap01(a) if self.on_gpu else self._array(a.transpose(1, 0, 2))
        return self._array(a)

    def _seq_out(self, y, host, taped=True, fresh=False):
        """(T, B, n) internal -> the caller's layout, as a new array (never a
        view of the tape, which backward still reads; taped False: no
        backward will, and a device array may be a view of it; fresh: y
        is a new numpy array nothing else holds, handed out as is where
        its layout is the caller's)."""
        unbatched = self._tape[1]
        if self.batch_first and not unbatched:
            y = self._mem.swap01(y) if self.on_gpu else y.transpose(1, 0, 2)
        elif self.on_gpu and not host and taped:
            y = y.copy()
        if unbatched:
            y = y.reshape(y.shape[0], y.shape[2])
        if self.on_gpu:
            return self._result(y, host)
        return y if fresh and y.flags.c_contiguous else np.array(y, order="C")

    def _initial(self, name, a, B, unbatched):
        """A caller's initial state (or state gradient) as an (L*D, B, H)
        array (D directions; row layer*D + d; h: (L*D, B, proj_size) with
        a projection), or None for None (zeros: the library fills them in)."""
        LD = self.num_layers * self.num_directions
        H = self._h_size if name in ("h0", "dh_n") else self.hidden_size
        if a is None:
            return None
        a = _float_array(name, a)
        _check_shape(name, a, (LD, H) if unbatched else (LD, B, H))
        return self._array(a).reshape(LD, B, H)

    def _rows(self, lengths, T, B, unbatched):
        """None without lengths, else the batch sorted longest first:
        (order, inverse, sorted lengths, step batch sizes (T,))."""
        if lengths is None:
            return None
        if unbatched:
            raise ValueError("lengths: expected a batch (an unbatched input has one sequence)")
        n = np.asarray(lengths)
        if (n.shape != (B,) or not np.issubdtype(n.dtype, np.integer) or n.min() < 1
                or n.max() > T):
            raise ValueError(f"lengths: expected ({B},) ints in [1, {T}] (a length per "
                             f"sequence), got {n.tolist()}")
        order = np.argsort(-n, kind="stable")
        ls = n[order]
        return order, np.argsort(order), ls, step_batch_sizes(ls, T)

    def _dropout_mask(self, shape):
        """A dropout mask of this module's kind: 0 with probability p, else
        1/(1-p), made where the layers run from a key the module's seeded
        generator draws (the same bits on every target:
        halstm.dropout.mask)."""
        key0, key1 = (int(k) for k in self._rng.integers(0, 1 << 32, size=2, dtype=np.uint64))
        return self._mem.dropout_mask(shape, self.dropout, key0, key1)

    def _each_direction(self, fn, lib) -> list:
        """[fn(d, threads) for every direction d]: a CPU module's two
        directions without a projection by run_directions, others one
        after the other (threads None)."""
        D = self.num_directions
        if D == 1 or self.on_gpu or self.proj_size:
            return [fn(d, None) for d in range(D)]
        return run_directions(fn, lib)

    def _forward(self, x, init, lengths=None):
        """Run every layer and direction; init: per state an (L*D, B, H)
        array; lengths: None, or each sequence's length (B,): the kernels
        run a step for the sequences longer than it only, and outputs past a
        length are zero."""
        x, unbatched, host = self._input(x)
        T, B = x.shape[0], x.shape[1]
        ids = x.ndim == 2                            # one-hot rows as class indices
        init = [self._initial(n, a, B, unbatched) for n, a in init]
        rows = self._rows(lengths, T, B, unbatched)
        bs, ns = None, None
        if rows is not None:                         # sorted longest first
            order, _, ns, bs = rows
            x = self._mem.take(x, order)
            init = [None if a is None else self._mem.take(a, order) for a in init]
        D, L, save = self.num_directions, self.num_layers, is_grad_enabled()
        tape, masks, inp = [], [], x                 # tape[layer * D + d]
        ends = []                                    # [layer * D + d][state]: (B, H) or None
        n = self._wavefront_chunks(T, B, ids, rows)
        if n > 1:
            inp = self._wavefront(x, init, n, save, tape, ends, masks)
        else:
            for layer in range(L):
                def one(d, threads):
                    """Direction d of this layer: (y (T, B, H) in time order, tape, end)."""
                    inp_d = inp if d == 0 else self._mem.reverse_time(inp, ns)
                    init_d = [_layer(s, layer * D + d) for s in init]
                    if self.proj_size:
                        y, end, t = projected.forward(
                            self._lib(layer, "fwd", extra=self.proj_size), self._lib(layer, "fwd"),
                            inp_d, self._layer_weights(layer, d), self._layer_proj(layer, d),
                            init_d, self._layer_vec(layer, d), save, bs)
                    else:
                        w_ih, b_ih, w_hh, b_hh = self._layer_weights(layer, d)
                        lib = self._lib(layer, "fwd", ids and layer == 0, lane=d if threads else 0)
                        states, saved = lib.forward(
                            inp_d, w_ih, b_ih, w_hh, b_hh, init_d, save=save,
                            vec=self._layer_vec(layer, d), batch_sizes=bs, threads=threads,
                            pack_key=self._pack_key(layer, d))
                        t, end = (inp_d, states, saved), None
                        y = states[0][1:]                # this direction's h over time (T, B, H)
                    return (y if d == 0 else self._mem.reverse_time(y, ns)), t, end

                ys = []
                for y, t, end in self._each_direction(one, self._lib(layer, "fwd",
                                                                      ids and layer == 0)):
                    ys.append(y)
                    tape.append(t)
                    ends.append(end)
                inp = ys[0] if D == 1 else self._mem.concat(ys)   # (T, B, D*H)
                if self.dropout and self.training and layer < L - 1:
                    masks.append(self._dropout_mask(tuple(inp.shape)))
                    inp = self._mem.mul(inp, masks[-1])
        self._tape = (tape, unbatched, ids, rows, masks)
        finals = []
        for s in range(len(init)):
            units = self._h_size if s == 0 else self.hidden_size
            if self.proj_size:
                f = np.stack([e[s] for e in ends])
            elif len(tape) == 1 and not save and rows is None:   # no backward reads them: a view
                f = tape[0][1][s][-1:]
                f = f if self.on_gpu else f.copy()   # (apart from y, itself a view on a CPU)
            else:
                f = self._mem.empty((L * D, B, units))
                for i, t in enumerate(tape):
                    f[i] = t[1][s][-1] if rows is None else self._mem.pick(t[1][s], ns)
            if rows is not None:
                f = self._mem.take(f, rows[1])
            f = f.reshape(L * D, units) if unbatched else f
            finals.append(self._result(f, host))
        if rows is not None:
            return self._seq_out(self._mem.take(inp, rows[1]), host, False, fresh=True), finals
        # (without a tape, a CPU module's inp is a new array or a view of one
        # that only the tape, never read again, shares: handed out as is)
        return self._seq_out(inp, host, taped=save and D == 1,
                             fresh=not save and not self.on_gpu), finals

    def _wavefront_chunks(self, T, B, ids, rows) -> int:
        """The chunks of a GPU stack's wavefront (halstm.wavefront; 1:
        none): one direction, no projection, lengths or one-hot class
        indices."""
        if (not self.on_gpu or self.num_directions > 1
                or self.proj_size or ids or rows is not None):
            return 1
        return wavefront.chunks(T, B, self.n_gates, self.input_size, self.hidden_size,
                                self.num_layers, machine.gpu_sms())

    def _lanes(self):
        """The streams a wavefront's layers run on: one a layer on a GPU, on
        a CPU the calls in turn (tests run the chunks there)."""
        return wavefront.Lanes(self.num_layers) if self.on_gpu else wavefront.InTurn()

    def _wavefront(self, x, init, n, save, tape, ends, masks):
        """_forward's layers as a wavefront of n chunks (halstm.wavefront):
        fills tape, ends and, with dropout in training, masks as the layers
        one after the other would, and returns the last layer's h over time
        (T, B, H)."""
        T, B, L = x.shape[0], x.shape[1], self.num_layers
        fed = []                         # fed[l - 1]: layer l's input (T, B, H), masked
        if self.dropout and self.training:
            for _ in range(L - 1):       # (the masks of the layers in turn, in their order)
                masks.append(self._dropout_mask((T, B, self.hidden_size)))
                fed.append(self._mem.empty((T, B, self.hidden_size)))

        def feed(layer, h, t0, t1):
            return self._mem.mul(h, masks[layer - 1][t0:t1], out=fed[layer - 1][t0:t1])
        libs = [self._lib(layer, "fwd") for layer in range(L)]
        calls = [wavefront.forward_call(libs[layer], self._layer_weights(layer),
                                        [_layer(a, layer) for a in init], save,
                                        self._layer_vec(layer))
                 for layer in range(L)]
        whole = wavefront.forward(calls, x, T, n,
                                  lambda layer: wavefront.whole_loop(libs[layer], T, B, save,
                                                                     self._mem),
                                  self._lanes(), feed if fed else None)
        for layer, (states, saved) in enumerate(whole):
            inp = x if layer == 0 else fed[layer - 1] if fed else whole[layer - 1][0][0][1:]
            tape.append((inp, states, saved))
            ends.append(None)
        return whole[-1][0][0][1:]

    def _wavefront_backward(self, tape, dy, dfinal, n, input_grad, masks) -> list:
        """The layers' gradients as a wavefront of n chunks
        (wavefront.backward): per layer the library's dict, the weight
        gradients summed over the chunks, layer 0's dx (input_grad) joined;
        masks: the forward's dropout masks (layer l's dy is layer l+1's dx
        times masks[l])."""
        T, L = dy.shape[0], self.num_layers
        calls = []
        for layer in range(L):
            w_ih, _, w_hh, _ = self._layer_weights(layer)
            calls.append(wavefront.backward_call(
                self._lib(layer, "bwd"), tape[layer], w_ih, w_hh, self._layer_vec(layer), dy,
                [_layer(a, layer) for a in dfinal], input_grad or layer > 0))
        feed = (lambda layer, dx, t0, t1: self._mem.mul(dx, masks[layer][t0:t1])) if masks else None
        done = wavefront.backward(calls, T, n, self._lanes(), feed)
        return [wavefront.gradients(chunks, self._mem.add, self._mem.join_time,  # (after the lanes)
                                    layer == 0 and input_grad)
                for layer, chunks in enumerate(done)]

    def _backward(self, dy, dfinal, input_grad=True):
        if self._tape is None:
            raise RuntimeError("backward: call the module forward first (no forward pass "
                               "recorded since construction or load_state_dict)")
        tape, unbatched, ids, rows, masks = self._tape
        if (tape[0].first[1] if self.proj_size else tape[0][2]) is None:
            raise RuntimeError("backward: the last forward ran under halstm.no_grad(), which "
                               "keeps nothing for backward; run it outside no_grad()")
        D, L, H = self.num_directions, self.num_layers, self._h_size
        T, B = (tape[0].x if self.proj_size else tape[0][0]).shape[:2]   # (the first input)
        shape = (T, D * H) if unbatched else ((B, T, D * H) if self.batch_first else (T, B, D * H))
        dy = _float_array("dy", dy)
        host = isinstance(dy, np.ndarray)
        _check_shape("dy", dy, shape)
        dy = self._seq_in(dy, unbatched, in_place=True)     # (the library only reads it)
        dfinal = [self._initial(n, a, B, unbatched) for n, a in dfinal]
        bs, ns = None, None
        if rows is not None:                                # the forward's row order
            order, _, ns, bs = rows
            dy = self._mem.take(dy, order)
            dfinal = [None if a is None else self._mem.take(a, order) for a in dfinal]
        # one layer and direction: the library's own state gradients are the
        # result (no copy)
        grads = {}
        sizes = [H] + [self.hidden_size] * (len(dfinal) - 1)    # h's units, the others'
        dinit = [None if L * D == 1 else self._mem.empty((L * D, B, n)) for n in sizes]
        n_chunks = self._wavefront_chunks(T, B, ids, rows)
        chunked = (self._wavefront_backward(tape, dy, dfinal, n_chunks, input_grad, masks)
                   if n_chunks > 1 else None)      # per layer its gradients (dx: layer 0's)
        for layer in reversed(range(L)):
            def one(d, threads):
                """Direction d of this layer's gradients (the library's keys;
                dx in time order)."""
                dy_d = dy if D == 1 else self._mem.columns(dy, d * H, H)
                if d:
                    dy_d = self._mem.reverse_time(dy_d, ns)
                dfinal_d = [_layer(a, layer * D + d) for a in dfinal]
                if self.proj_size:
                    g = projected.backward(
                        self._lib(layer, "bwd", extra=self.proj_size), self._lib(layer, "bwd"),
                        tape[layer * D + d], self._layer_weights(layer, d),
                        self._layer_proj(layer, d), dy_d, dfinal_d, self._layer_vec(layer, d),
                        bs, need_dx=input_grad or layer > 0)
                else:
                    inp, states, saved = tape[layer * D + d]
                    w_ih, _, w_hh, _ = self._layer_weights(layer, d)
                    lib = self._lib(layer, "bwd", ids and layer == 0, lane=d if threads else 0)
                    g = lib.backward(inp, w_ih, w_hh, saved, states, dy_d, dfinal_d,
                                     need_dx=input_grad or layer > 0,
                                     vec=self._layer_vec(layer, d), batch_sizes=bs,
                                     threads=threads, pack_key=self._pack_key(layer, d))
                if d and "dx" in g:
                    g["dx"] = self._mem.reverse_time(g["dx"], ns)
                return g

            dx = None                                       # (T, B, K) summed over directions
            gs = ([chunked[layer]] if chunked is not None else
                  self._each_direction(one, self._lib(layer, "bwd", ids and layer == 0)))
            for d, g in enumerate(gs):
                sfx = self._suffix(layer, d)
                if "dw_hr" in g:
                    grads[f"weight_hr{sfx}"] = g["dw_hr"]
                grads[f"weight_ih{sfx}"], grads[f"weight_hh{sfx}"] = g["dw_ih"], g["dw_hh"]
                if self.bias and self._matrix_bias:
                    grads[f"bias_ih{sfx}"], grads[f"bias_hh{sfx}"] = g["db_ih"], g["db_hh"]
                if "dvec" in g:
                    grads |= self._vector_grads(layer, d, g["dvec"])
                for i, s in enumerate(self._state_names[:len(dinit)]):
                    if L * D == 1:
                        dinit[i] = g[f"d{s}0"].reshape(1, B, sizes[i])
                    else:
                        dinit[i][layer * D + d] = g[f"d{s}0"]
                if "dx" in g:
                    dx = g["dx"] if dx is None else self._mem.add(dx, g["dx"])
            if masks and layer and dx is not None:      # (chunks: layer 0's dx alone)
                dx = self._mem.mul(dx, masks[layer - 1])
            dy = dx
        grads = {k: self._result(grads[k], host) for k in self._params}   # state_dict order
        if rows is not None:                                # back to the caller's order
            dinit = [self._mem.take(d, rows[1]) for d in dinit]
            dy = None if dy is None else self._mem.take(dy, rows[1])
        if input_grad and not ids:
            grads["input"] = self._seq_out(dy, host, fresh=True)   # (the library's dx, or made here)
        for d, s, n in zip(dinit, self._state_names, sizes):
            grads[f"{s}0"] = self._result(d.reshape(L * D, n) if unbatched else d, host)
        return grads


def run_directions(fn, lib) -> list:
    """[fn(0, threads), fn(1, threads)]: a CPU layer's two directions, at
    once where the last call of their library (lib) would have split its
    steps over half the cores or fewer (the reverse one on a thread of its
    own, each call's steps on its half of the cores: threads), else one
    after the other (threads None: all of them). One after the other too
    where the kernels run on a shared OpenMP team (runtime.share_openmp:
    a call with its own share of the cores would run on threads beside
    that team's, which spin on the same cores). fn(1, n) must call a
    library instance of its own (a lane) when n is given."""
    cores = _cores()
    wanted = lib.step_threads_wanted()
    if runtime.shares_openmp() or not 0 < wanted <= cores // 2:
        return [fn(0, None), fn(1, None)]
    with ThreadPoolExecutor(1) as pool:
        reverse = pool.submit(fn, 1, cores - cores // 2)
        return [fn(0, cores // 2), reverse.result()]


def _cores() -> int:
    """Threads halstm's CPU kernels may use: HL_NUM_THREADS, else the CPUs
    this process may run on (as the driver counts them)."""
    n = int(os.environ.get("HL_NUM_THREADS") or 0)
    return n if n > 0 else machine.cores()


class LSTM(_RNN):
    """Multi-layer LSTM with torch.nn.LSTM's semantics, parameters and
    layout; proj_size=P (CPU targets): h = W_hr m of P units, weight_hr_l{k}
    (P, H), as torch.nn.LSTM(proj_size=P)."""

    cell, n_gates, _state_names = "lstm", 4, ("h", "c")

    def __call__(self, x, hx=None, *, lengths=None):
        """x (T, B, I) (batch_first: (B, T, I)); hx None or (h0, c0) each
        (L*D, B, H), D = 2 if bidirectional else 1. Returns y (T, B, D*H),
        (h_n, c_n) each (L*D, B, H), rows layer*D + direction as torch's.
        lengths: each sequence's length (B,) in [1, T]; a
        sequence's steps past it are not run, its outputs there are zero,
        its final states are those after its last step, and backward
        ignores dy past it."""
        if hx is not None and (not isinstance(hx, (tuple, list)) or len(hx) != 2):
            raise TypeError(f"hx: expected None or a pair (h0, c0) of (num_layers, batch, "
                            f"hidden_size) arrays, got {type(hx).__name__}"
                            + (f" of length {len(hx)}" if isinstance(hx, (tuple, list)) else ""))
        h0, c0 = (None, None) if hx is None else hx
        y, (h_n, c_n) = self._forward(x, [("h0", h0), ("c0", c0)], lengths)
        return y, (h_n, c_n)

    def backward(self, dy, dh_n=None, dc_n=None, *, input_grad=True) -> dict[str, np.ndarray]:
        """Gradients of the last forward call given dL/dy (and optionally
        dL/dh_n, dL/dc_n): every state_dict key, plus input, h0, c0.
        input_grad=False: no input gradient (on a CPU target it is not
        computed at all, like a PyTorch input without requires_grad)."""
        return self._backward(dy, [("dh_n", dh_n), ("dc_n", dc_n)], input_grad)


class GRU(_RNN):
    """Multi-layer GRU with torch.nn.GRU's semantics, parameters and layout."""

    cell, n_gates, _state_names = "gru", 3, ("h",)

    def __call__(self, x, hx=None, *, lengths=None):
        """x (T, B, I) (batch_first: (B, T, I)); hx None or h0 (L*D, B, H).
        Returns y (T, B, D*H), h_n (L*D, B, H). lengths: as LSTM's."""
        y, (h_n,) = self._forward(x, [("h0", hx)], lengths)
        return y, h_n

    def backward(self, dy, dh_n=None, *, input_grad=True) -> dict[str, np.ndarray]:
        """Gradients of the last forward call: every state_dict key, plus
        input (unless input_grad=False, as for LSTM.backward), h0."""
        return self._backward(dy, [("dh_n", dh_n)], input_grad)


class RNN(_RNN):
    """Multi-layer Elman RNN with torch.nn.RNN's semantics, parameters and
    layout: h' = tanh (or relu) of W_ih x + b_ih + W_hh h + b_hh."""

    n_gates, _state_names = 1, ("h",)

    def __init__(self, input_size, hidden_size, num_layers=1, nonlinearity="tanh", bias=True,
                 batch_first=False, dropout=0.0, bidirectional=False, target="host",
                 schedule=None, seed=None, precision="fp32", gemm=None):
        if nonlinearity not in ("tanh", "relu"):
            raise ValueError(f"nonlinearity: expected 'tanh' or 'relu', got {nonlinearity!r}")
        self.nonlinearity, self.cell = nonlinearity, f"rnn_{nonlinearity}"
        super().__init__(input_size, hidden_size, num_layers, bias, batch_first, dropout,
                         bidirectional, target, schedule, seed, precision=precision, gemm=gemm)

    __call__, backward = GRU.__call__, GRU.backward


class Recurrent(_RNN):
    """A multi-layer recurrent network of any cell by name (halstm.cells:
    built in, or registered from a user's file) or of a cell definition.
    Parameters weight_ih_l{k} (G*H, I), weight_hh_l{k} (G*H, H), bias_ih_l{k}
    and bias_hh_l{k} (G*H), G the cell's gate blocks (the biases not for a
    cell defined with matrix_bias=False), and the cell's vector parameters
    <name>_l{k}, (H,) or (G*H,) per gate; bidirectional, each again with
    the suffix _reverse, and layers past the first read 2H inputs. A call returns
    y, h_n for a cell of one state, else y, (h_n, s2_n, ...), states in the
    cell's order; backward takes one d<state>_n per state."""

    def __init__(self, cell, input_size, hidden_size, num_layers=1, bias=True,
                 batch_first=False, dropout=0.0, bidirectional=False, target="host",
                 schedule=None, seed=None, proj_size=0, precision="fp32", gemm=None):
        from . import cells
        if isinstance(cell, cells.Definition):
            cell = cells.register(cell)
        if not isinstance(cell, str):
            raise TypeError(f"cell: expected a cell name or definition, got "
                            f"{type(cell).__name__}")
        desc = cells.info(cells.check(cell))
        self.cell, self.n_gates = cell, len(desc["gates"])
        self._state_names = tuple(desc["states"])
        super().__init__(input_size, hidden_size, num_layers, bias, batch_first, dropout,
                         bidirectional, target, schedule, seed, proj_size, precision, gemm)

    def __call__(self, x, hx=None, *, lengths=None):
        """x (T, B, I) (batch_first: (B, T, I)); hx None, or per state an
        (L*D, B, H) array: h0 alone for a one-state cell, else a tuple;
        lengths: as LSTM's."""
        names = self._state_names
        if len(names) == 1:
            hx = [("h0", hx)]
        else:
            if hx is not None and (not isinstance(hx, (tuple, list)) or len(hx) != len(names)):
                raise TypeError(f"hx: expected None or a tuple of {len(names)} arrays "
                                f"({', '.join(s + '0' for s in names)}), each (num_layers, "
                                f"batch, hidden_size), got {type(hx).__name__}")
            hx = [(s + "0", None if hx is None else a) for s, a in zip(names, hx or names)]
        y, finals = self._forward(x, hx, lengths)
        return (y, finals[0]) if len(names) == 1 else (y, tuple(finals))

    def backward(self, dy, *dfinal, input_grad=True) -> dict:
        """Gradients of the last forward call given dL/dy and optionally
        dL/d(final state), one per state in order: every state_dict key,
        plus input and <state>0."""
        names = self._state_names
        if len(dfinal) > len(names):
            raise TypeError(f"backward: expected at most {len(names)} final-state gradients "
                            f"({', '.join('d' + s + '_n' for s in names)}), got {len(dfinal)}")
        dfinal = list(dfinal) + [None] * (len(names) - len(dfinal))
        return self._backward(dy, [("d" + s + "_n", d) for s, d in zip(names, dfinal)],
                              input_grad)


def module(cell: str, input_size, hidden_size, **kw) -> _RNN:
    """The public module of a cell: halstm.LSTM, halstm.GRU or halstm.RNN
    for the cells torch ships, else halstm.Recurrent(cell, ...)."""
    if cell == "lstm":
        return LSTM(input_size, hidden_size, **kw)
    if cell == "gru":
        return GRU(input_size, hidden_size, **kw)
    if cell in ("rnn_tanh", "rnn_relu"):
        return RNN(input_size, hidden_size, nonlinearity=cell[4:], **kw)
    return Recurrent(cell, input_size, hidden_size, **kw)
