"""Arrays whose data does not start on a vector boundary, read by the kernels
where they are.

runtime.Library hands a C-contiguous float32 array's own pointer to the
library (memory.f32 and np.ascontiguousarray keep such an array as it is,
wherever it starts), so a caller's array at any address reaches the
compiled code. Halide assumes its own allocations are vector-aligned: a
pipeline that read back an output buffer as if it were one emitted aligned
AVX-512 loads that faulted on a buffer numpy owned, at a hidden size that
is a multiple of the vector width (see pipeline.common._output).

The modules copy a caller's float arrays (to 16-byte boundaries, as numpy
allocates), so the layer test below calls runtime.Library itself: every
array the libraries read (x, weights, biases, states, saved gates, dy)
starts 1 to 9 floats (4 to 36 bytes) past a 64-byte boundary, most of them
off any 16-byte boundary, and the results must equal the reference's and,
bit for bit, those of the same arrays on 64-byte boundaries. Through a
module, class indices and the upper layers' inputs reach the libraries
misaligned.
"""
import ctypes

import numpy as np
import pytest

import halstm
from halstm import aot, memory, reference, runtime
from helpers import B, I, STATES, T, assert_close, make, ref_run

HV = 32      # a multiple of the vector width (8 floats with AVX2, 16 with AVX-512)
OFFSETS = (1, 2, 3, 4, 7)    # floats past a 64-byte boundary


def at_offset(a, n, dtype=np.float32):
    """A C-contiguous copy of `a` (as dtype) whose data starts n elements
    past a 64-byte boundary (n=0: on one), n < 64 / itemsize."""
    a = np.asarray(a, dtype)
    size = np.dtype(dtype).itemsize
    raw = np.empty(a.size + 2 * 64 // size, dtype)
    start = (-raw.ctypes.data % 64) // size + n
    out = raw[start:start + a.size].reshape(a.shape)
    out[...] = a
    assert out.flags.c_contiguous and out.ctypes.data % 64 == n * size
    return out


def test_f32_keeps_a_misaligned_array_where_it_is():
    """What the runtime does with such an array: nothing (no copy to an
    aligned buffer), so the kernels read it at its own address."""
    a = at_offset(np.arange(24.0).reshape(2, 3, 4), 1)
    assert a.ctypes.data % 16 == 4
    for same in (memory.f32(a), np.ascontiguousarray(a), np.ascontiguousarray(a, np.float32)):
        assert same.ctypes.data == a.ctypes.data
    assert memory.empty((2, 3, 4)).ctypes.data % 64 == 0       # the runtime's own arrays


def _record_pointers(lib):
    """Wrap the library's C entry point to record the pointers it is given
    (arguments after T and B, and the arrays of state pointers)."""
    seen, entry = [], lib._entry

    def record(*args):
        for a in args[2:]:
            seen.extend(a if isinstance(a, ctypes.Array) else [a])
        return entry(*args)
    lib._entry = record
    return seen


def _layer_problem(cell, K, seed):
    rng = np.random.default_rng(seed)
    G, ns = {"lstm": 4, "gru": 3}[cell], len(STATES[cell])
    f = lambda *s: rng.uniform(-0.4, 0.4, s).astype(np.float32)
    return dict(x=rng.standard_normal((T, B, K)).astype(np.float32), w_ih=f(G * HV, K),
                b_ih=f(G * HV), w_hh=f(G * HV, HV), b_hh=f(G * HV),
                init=[f(B, HV) for _ in range(ns)],
                dy=rng.standard_normal((T, B, HV)).astype(np.float32),
                dfinal=[f(B, HV) for _ in range(ns)])


def _run_layer(fwd, bwd, p, place):
    """Forward and backward of one layer, every array the libraries read
    given through place(a, i), i numbering the arrays."""
    x, w_ih, b_ih, w_hh, b_hh = (place(p[k], i) for i, k in
                                 enumerate(("x", "w_ih", "b_ih", "w_hh", "b_hh")))
    init = [place(a, 5 + i) for i, a in enumerate(p["init"])]
    states, saved = fwd.forward(x, w_ih, b_ih, w_hh, b_hh, init)
    # backward reads forward's outputs too: hand them back misplaced as well
    states_in = [place(s, 7 + i) for i, s in enumerate(states)]
    saved_in, dy = place(saved, 9), place(p["dy"], 10)
    grads = bwd.backward(x, w_ih, w_hh, saved_in, states_in, dy,
                         [place(a, 11 + i) for i, a in enumerate(p["dfinal"])])
    inputs = [x, w_ih, b_ih, w_hh, b_hh, saved_in, *states_in, dy]
    return states, saved, grads, inputs


@pytest.mark.parametrize("offset", OFFSETS)
@pytest.mark.parametrize("K", [16, HV])
@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_library_reads_misaligned_arrays(cell, K, offset):
    fwd = runtime.Library(*aot.library(aot.Spec(cell, K, HV, "fwd")))
    bwd = runtime.Library(*aot.library(aot.Spec(cell, K, HV, "bwd")))
    p = _layer_problem(cell, K, seed=offset)
    seen = _record_pointers(fwd), _record_pointers(bwd)

    # each array `offset` floats past a boundary, plus 0-2 more so that
    # neighbours differ; never a multiple of 16 floats (64 bytes)
    mis = lambda a, i: at_offset(a, offset + i % 3)
    states, saved, grads, inputs = _run_layer(fwd, bwd, p, mis)
    assert all(a.ctypes.data % 64 for a in inputs)
    assert sum(a.ctypes.data % 16 != 0 for a in inputs) >= len(inputs) // 2
    # the libraries got these very pointers (no aligned copies on the way)
    read = set(seen[0]) | set(seen[1])
    missing = [a.ctypes.data % 64 for a in inputs if a.ctypes.data not in read]
    assert not missing, f"arrays at these offsets were not read in place: {missing}"

    # against the float64 reference
    d = lambda a: np.asarray(a, np.float64)
    if cell == "lstm":
        y, _, _, cache = reference.lstm_layer_forward(
            d(p["x"]), *map(d, p["init"]), d(p["w_ih"]), d(p["w_hh"]), d(p["b_ih"]), d(p["b_hh"]))
        want = reference.lstm_layer_backward(d(p["dy"]), *map(d, p["dfinal"]), cache)
        assert_close("c", states[1][1:], np.stack(cache["cs"][1:]))
    else:
        y, _, cache = reference.gru_layer_forward(
            d(p["x"]), d(p["init"][0]), d(p["w_ih"]), d(p["w_hh"]), d(p["b_ih"]), d(p["b_hh"]))
        want = reference.gru_layer_backward(d(p["dy"]), d(p["dfinal"][0]), cache)
    assert_close("h", states[0][1:], y)
    for k, w in want.items():
        assert_close(k, grads[k], w)

    # and bit for bit what the same arrays give on 64-byte boundaries
    a_states, a_saved, a_grads, _ = _run_layer(fwd, bwd, p, lambda a, i: at_offset(a, 0))
    for got, exp in zip([*states, saved], [*a_states, a_saved]):
        np.testing.assert_array_equal(got, exp)
    for k in a_grads:
        np.testing.assert_array_equal(grads[k], a_grads[k], err_msg=k)


def test_library_copies_the_initial_states():
    """halstm_forward copies each initial state into states[s][0] (zeros
    for None); the runtime hands over non-contiguous or float64 ones as
    contiguous float32, and refuses a wrong count or shape by name."""
    fwd = runtime.Library(*aot.library(aot.Spec("lstm", 16, HV, "fwd")))
    p = _layer_problem("lstm", 16, seed=5)
    args = [p[k] for k in ("x", "w_ih", "b_ih", "w_hh", "b_hh")]
    h0 = np.asfortranarray(p["init"][0].astype(np.float64))    # (B, HV), not C-contiguous
    states, _ = fwd.forward(*args, [h0, None], save=False)
    assert np.array_equal(states[0][0], h0.astype(np.float32))
    assert not states[1][0].any()
    same, _ = fwd.forward(*args, [h0.astype(np.float32), np.zeros((B, HV), np.float32)],
                          save=False)
    np.testing.assert_array_equal(states, same)
    with pytest.raises(ValueError, match=r"init: expected c0 of shape \(%d, %d\), got \(%d,\)"
                       % (B, HV, HV)):
        fwd.forward(*args, [None, np.zeros(HV, np.float32)])
    with pytest.raises(ValueError, match=r"init: expected 2 initial states \(h, c\), got 1"):
        fwd.forward(*args, [None])


@pytest.mark.parametrize("cls,cell", [(halstm.LSTM, "lstm"), (halstm.GRU, "gru")])
def test_module_with_misaligned_arrays(cls, cell):
    """The modules take misaligned arrays of every kind a caller gives (the
    float ones they copy before the kernels read them)."""
    rng = np.random.default_rng(3)
    m = cls(16, HV, num_layers=2, seed=3)
    ns = len(STATES[cell])
    x = at_offset(rng.standard_normal((5, 3, 16)), 1)
    hx = [at_offset(0.5 * rng.standard_normal((2, 3, HV)), 2 + i) for i in range(ns)]
    dy = at_offset(rng.standard_normal((5, 3, HV)), 3)
    dfinal = [at_offset(rng.standard_normal((2, 3, HV)), 5 + i) for i in range(ns)]
    y, finals = m(x, tuple(hx) if cell == "lstm" else hx[0])
    finals = finals if cell == "lstm" else (finals,)
    g = m.backward(dy, *dfinal)
    ry, rfinals, rg = ref_run(cell, m, x, hx, dy, dfinal)
    assert_close("y", y, ry)
    for s, f, rf in zip(STATES[cell], finals, rfinals):
        assert_close(f"{s}_n", f, rf)
    for k in rg:
        assert_close(k, g[k], rg[k])


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_class_indices_and_upper_layers_read_in_place(cell, monkeypatch):
    """Class-index input goes to the first layer's library as the caller's
    own int32 array, and each upper layer reads the layer below's states
    in place (a view T rows past its start: B * 37 floats, not a multiple
    of 16): misaligned arrays in the middle of a module's run."""
    rng = np.random.default_rng(4)
    ids = rng.integers(0, I, (T, B))
    m = make(cell)
    got_x = []
    forward = runtime.Library.forward

    def spy(self, x, *args, **kw):
        got_x.append(x.ctypes.data)
        return forward(self, x, *args, **kw)
    monkeypatch.setattr(runtime.Library, "forward", spy)

    want_y, _ = m(at_offset(ids, 0, np.int32))
    want_g = m.backward(np.ones_like(want_y))
    for offset in (1, 3):
        mis = at_offset(ids, offset, np.int32)
        got_x.clear()
        y, _ = m(mis)
        assert got_x[0] == mis.ctypes.data and mis.ctypes.data % 16
        assert all(p % 16 for p in got_x[1:]), [p % 64 for p in got_x]
        g = m.backward(np.ones_like(y))
        np.testing.assert_array_equal(y, want_y)
        for k in want_g:
            np.testing.assert_array_equal(g[k], want_g[k], err_msg=k)
    dense_y, _ = m(np.eye(I, dtype=np.float32)[ids])
    assert_close("y", y, dense_y, rtol=1e-6, atol=1e-6, per_element=True)
