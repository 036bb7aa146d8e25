"""halstm.LSTM / halstm.GRU against the numpy reference (float64) and PyTorch.

Every test uses the shared sizes I=13, H=37 (helpers.py), so the whole file
needs 8 kernels: {lstm, gru} x {fwd, bwd} x {13, 37}, compiled once per test
run. helpers.check_case runs one CASES entry; tests/gpu runs them too.
"""
import re

import halide as hl
import numpy as np
import pytest

import halstm
from halstm.pipeline import padded
from helpers import (B, CASES, CLASSES, GATES, H, I, L, STATES, T, assert_close, backward, call,
                     check_case, check_lengths_against_alone, check_no_grad, make, ref_run)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_matches_reference(cell, case):
    check_case(cell, case)


AVX2 = "x86-64-linux-avx-avx2-fma-f16c-sse41"


@pytest.mark.skipif(not halstm.aot.loadable_here(hl.Target(AVX2)), reason="the host has no AVX2")
@pytest.mark.parametrize("case", ["base", "B1", "split_rows", "split_rows_12", "wide_rows"])
def test_gate_group_panels_of_avx2_match_reference(case):
    """An AVX2 build, on any host that runs it: the LSTM's weight panels in
    groups of 2 gates (cpu.panel_layout), its steps in tiles of 2 gates x 6
    rows where a batch (or a thread's range of rows) fills them, tiles of
    every gate below."""
    m = check_case("lstm", case, target=AVX2)
    for lib in m._libs.values():
        assert lib.manifest["layout"]["panel_gates"] == 2, lib.manifest["direction"]


@pytest.mark.parametrize("cell, case, threads", [("lstm", "split_rows", 3),
                                                 ("gru", "split_rows", 3),
                                                 ("lstm", "split_rows_12", 2)])
def test_steps_split_over_threads(cell, case, threads, monkeypatch):
    """Three threads asked for: 27 batch rows run as three ranges of rows
    (of 4 rows or more); 12 rows at H=37 as two (the step is worth two
    threads of 2^15 multiply-adds)."""
    monkeypatch.setenv("HL_NUM_THREADS", "3")
    m = check_case(cell, case)
    for lib in m._libs.values():
        assert lib.step_threads() == threads, lib.manifest["direction"]


def test_steps_split_over_units(monkeypatch):
    """Where W_hh is too large for every thread to read each step (H=300:
    1.4 MB, past 512 KB forward and 1 MB backward), three threads take
    ranges of units (19 panels, the last one partial), which meet at a
    spin barrier after every step (two CPUs in CI: with three threads the
    barrier also has to yield); the results stay right."""
    monkeypatch.setenv("HL_NUM_THREADS", "3")
    m = halstm.LSTM(I, 300, seed=3)
    rng = np.random.default_rng(9)
    x = rng.standard_normal((30, 12, I)).astype(np.float32)
    dy = rng.standard_normal((30, 12, 300)).astype(np.float32)
    y, _ = call(m, "lstm", x)
    grads = backward(m, "lstm", dy)
    ry, _, rgrads = ref_run("lstm", m, x, dy=dy)
    assert_close("y", y, ry)
    for k in ("weight_hh_l0", "weight_ih_l0", "input"):
        assert_close(k, grads[k], rgrads[k])
    assert [lib.step_threads() for lib in m._libs.values()] == [3, 3]
    assert all(lib.manifest["split"]["batch_bytes"] < 4 * 300 * 300 * 4
               for lib in m._libs.values())


def test_a_short_loop_stays_on_one_thread(monkeypatch):
    """A step worth 32 threads (H=128, B=16), but one step a call (as when
    sampling): starting a thread would cost more than the loop."""
    monkeypatch.setenv("HL_NUM_THREADS", "3")
    m = halstm.LSTM(I, 128, seed=3)
    x = np.random.default_rng(5).standard_normal((1, 16, I)).astype(np.float32)
    y, _ = call(m, "lstm", x)
    ry, _, _ = ref_run("lstm", m, x)
    assert_close("y", y, ry)
    assert [lib.step_threads() for lib in m._libs.values()] == [1]


@pytest.mark.parametrize("batch", [2, 5])
def test_split_ranges_are_whole_tiles(batch, monkeypatch):
    """H=128, three threads asked for: each range spans whole tiles (none
    overruns into the next), and the results stay right. With AVX-512
    (eight panels) the forward's tiles below 4 rows span two panels (ranges
    of 1, 1 and 2 tiles), the backward's four below 4 rows and where they
    hold 4 rows (two ranges); with AVX2 (16 panels) the backward's wide
    tiles span two, so 5 rows take three ranges. The backward's quanta
    come from its manifest."""
    monkeypatch.setenv("HL_NUM_THREADS", "3")
    m = halstm.LSTM(I, 128, seed=3)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((64, batch, I)).astype(np.float32)
    dy = rng.standard_normal((64, batch, 128)).astype(np.float32)
    y, finals = call(m, "lstm", x)
    grads = backward(m, "lstm", dy)
    ry, _, rgrads = ref_run("lstm", m, x, dy=dy)
    assert_close("y", y, ry)
    for k in ("weight_hh_l0", "weight_ih_l0", "input", "h0", "c0"):
        assert_close(k, grads[k], rgrads[k])
    threads = {lib.manifest["direction"]: lib.step_threads() for lib in m._libs.values()}
    bwd = next(lib.manifest for lib in m._libs.values() if lib.manifest["direction"] == "bwd")
    split = bwd["split"]
    quantum = split["quantum_small"] if batch < split["small_below"] else split["quantum"]
    panels = padded(128, bwd["panel"]) // bwd["panel"]
    assert threads == {"fwd": 3, "bwd": min(3, panels // quantum)}
    assert threads["bwd"] >= 2


@pytest.mark.parametrize("cell", ["lstm", "gru"])
@pytest.mark.parametrize("bias", [True, False])
def test_gradient_keys(cell, bias):
    m = make(cell, 3, bias=bias)
    x = np.random.default_rng(0).standard_normal((T, B, I)).astype(np.float32)
    y, _ = call(m, cell, x)
    grads = backward(m, cell, np.ones_like(y))
    states = {"h0", "c0"} if cell == "lstm" else {"h0"}
    assert set(grads) == set(m.state_dict()) | {"input"} | states
    n_per_layer = 4 if bias else 2
    assert len(m.state_dict()) == 3 * n_per_layer
    assert list(grads)[:len(m.state_dict())] == list(m.state_dict())   # state_dict order first


@pytest.mark.parametrize("cell", ["lstm", "gru"])
@pytest.mark.parametrize("bias", [True, False])
def test_state_dict_names_and_shapes_match_torch(cell, bias):
    torch = pytest.importorskip("torch")
    tcls = torch.nn.LSTM if cell == "lstm" else torch.nn.GRU
    tm = tcls(I, H, num_layers=3, bias=bias)
    m = make(cell, 3, bias=bias)
    want = [(k, tuple(v.shape)) for k, v in tm.state_dict().items()]
    got = [(k, v.shape) for k, v in m.state_dict().items()]
    assert got == want
    assert all(v.dtype == np.float32 for v in m.state_dict().values())


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_state_dict_is_live_and_load_copies(cell):
    m = make(cell)
    other = make(cell, seed=1)
    src = {k: v.copy() for k, v in other.state_dict().items()}
    m.load_state_dict(src)
    for k, v in m.state_dict().items():
        np.testing.assert_array_equal(v, src[k])
    # load_state_dict copied: changing the source afterwards leaves the module alone.
    src["weight_hh_l0"][:] = 5.0
    assert not np.any(m.state_dict()["weight_hh_l0"] == 5.0)
    # state_dict() returns the module's own arrays: in-place updates act on it.
    m.state_dict()["bias_ih_l1"][:] = 0.25
    np.testing.assert_array_equal(m.state_dict()["bias_ih_l1"], 0.25)
    # float64 arrays are accepted and cast.
    m.load_state_dict({k: v.astype(np.float64) for k, v in other.state_dict().items()})
    for k, v in m.state_dict().items():
        assert v.dtype == np.float32
        np.testing.assert_array_equal(v, other.state_dict()[k])


def _snapshot(m):
    return {k: v.copy() for k, v in m.state_dict().items()}


@pytest.mark.parametrize("cell", ["lstm", "gru"])
@pytest.mark.parametrize("problem", ["missing", "unexpected", "wrong_shape", "wrong_shape_1d",
                                     "wrong_layer_shape"])
def test_load_state_dict_strict(cell, problem):
    m = make(cell)
    before = _snapshot(m)
    # Every other entry is valid and different, so a partial load would show.
    sd = {k: v + 1.0 for k, v in before.items()}
    if problem == "missing":
        key = "bias_hh_l1"
        del sd[key]
    elif problem == "unexpected":
        key = "weight_ih_l2"
        sd[key] = np.zeros((GATES[cell] * H, H), np.float32)
    elif problem == "wrong_shape":
        key = "weight_ih_l0"
        sd[key] = np.zeros((GATES[cell] * H, I + 1), np.float32)
    elif problem == "wrong_shape_1d":
        key = "bias_ih_l0"
        sd[key] = np.zeros((GATES[cell] * H, 1), np.float32)
    else:
        key = "weight_ih_l1"        # layer 1 sees the hidden size, not input_size
        sd[key] = np.zeros((GATES[cell] * H, I), np.float32)
    with pytest.raises((KeyError, ValueError)) as info:
        m.load_state_dict(sd)
    assert key in str(info.value)
    for k, v in m.state_dict().items():
        np.testing.assert_array_equal(v, before[k], err_msg=k)


def test_load_state_dict_wrong_dtype_raises_and_leaves_params():
    m = make("lstm")
    before = _snapshot(m)
    sd = {k: v + 1.0 for k, v in before.items()}
    sd["weight_hh_l1"] = np.ones((4 * H, H), np.int32)
    with pytest.raises(TypeError, match="weight_hh_l1"):
        m.load_state_dict(sd)
    for k, v in m.state_dict().items():
        np.testing.assert_array_equal(v, before[k], err_msg=k)


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_init_uniform_and_seeded(cell):
    a, b, c = make(cell, 3, seed=3), make(cell, 3, seed=3), make(cell, 3, seed=4)
    bound = 1.0 / np.sqrt(H)
    all_a = np.concatenate([v.ravel() for v in a.state_dict().values()])
    assert np.abs(all_a).max() <= bound * (1 + 1e-6)
    # Really spread over the interval, not a constant or a narrow normal.
    assert all_a.min() < -0.95 * bound and all_a.max() > 0.95 * bound
    assert abs(all_a.mean()) < 0.05 * bound
    assert 0.9 < all_a.std() / (bound / np.sqrt(3)) < 1.1
    for k in a.state_dict():
        assert not np.all(a.state_dict()[k] == a.state_dict()[k].flat[0]), k
        np.testing.assert_array_equal(a.state_dict()[k], b.state_dict()[k], err_msg=k)
        assert not np.array_equal(a.state_dict()[k], c.state_dict()[k]), k
    # No seed: fresh weights each time.
    d, e = CLASSES[cell](I, H), CLASSES[cell](I, H)
    assert not np.array_equal(d.state_dict()["weight_ih_l0"], e.state_dict()["weight_ih_l0"])


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_deterministic_run_to_run(cell):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((T, B, I)).astype(np.float32)
    dy = rng.standard_normal((T, B, H)).astype(np.float32)
    m1, m2 = make(cell), make(cell)
    runs = []
    for m in (m1, m1, m2):
        y, finals = call(m, cell, x)
        runs.append((y, finals, backward(m, cell, dy)))
    for y, finals, grads in runs[1:]:
        np.testing.assert_array_equal(y, runs[0][0])
        for f, f0 in zip(finals, runs[0][1]):
            np.testing.assert_array_equal(f, f0)
        assert list(grads) == list(runs[0][2])
        for k in grads:
            np.testing.assert_array_equal(grads[k], runs[0][2][k], err_msg=k)


def test_calls_of_alternating_sizes_match_reference():
    """One module called at sizes that grow, shrink and come back (its
    library keeps workspaces per size and reuses the last ones of a size
    seen before): every call's outputs and gradients as the reference's."""
    m = make("lstm", 1)
    rng = np.random.default_rng(11)
    for Tc, Bc in ((5, 3), (9, 4), (5, 3), (1, 1), (9, 4), (5, 3)):
        x = rng.standard_normal((Tc, Bc, I)).astype(np.float32)
        dy = rng.standard_normal((Tc, Bc, H)).astype(np.float32)
        y, finals = call(m, "lstm", x)
        grads = backward(m, "lstm", dy)
        y_ref, finals_ref, grads_ref = ref_run("lstm", m, x, dy=dy)
        assert_close(f"y at T={Tc} B={Bc}", y, y_ref)
        for got, want in zip(finals, finals_ref):
            assert_close(f"final at T={Tc} B={Bc}", got, want)
        assert_close(f"input grad at T={Tc} B={Bc}", grads["input"], grads_ref["input"])
        assert_close(f"weight_hh grad at T={Tc} B={Bc}", grads["weight_hh_l0"],
                     grads_ref["weight_hh_l0"])



def test_kept_call_sizes_are_bounded(monkeypatch):
    """Call sizes that never grow the workspaces (views of the kept ones)
    keep at most runtime.FRAMES frames, and their calls stay right."""
    monkeypatch.setattr(halstm.runtime, "FRAMES", 3)
    m = make("gru", 1)
    rng = np.random.default_rng(12)
    for Tc in (9, 8, 7, 6, 5, 9):
        x = rng.standard_normal((Tc, B, I)).astype(np.float32)
        y, _ = call(m, "gru", x)
        assert_close(f"y at T={Tc}", y, ref_run("gru", m, x)[0])
    (lib,) = m._libs.values()
    assert 1 <= len(lib._frames) <= 3


def _run_all(m, cell, x, hx=None, dy=None, dfinal=None):
    y, finals = call(m, cell, x, hx)
    grads = backward(m, cell, np.ones_like(y) if dy is None else dy, dfinal)
    return [y, *finals, *(grads[k] for k in sorted(grads))]


def _assert_all_equal(a, b):
    assert len(a) == len(b)
    for u, v in zip(a, b):
        np.testing.assert_array_equal(u, v)


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_float64_input_accepted(cell):
    rng = np.random.default_rng(6)
    x64 = rng.standard_normal((T, B, I))
    ns = len(STATES[cell])
    hx64 = [rng.standard_normal((L, B, H)) for _ in range(ns)]
    dy64 = rng.standard_normal((T, B, H))
    d64 = [rng.standard_normal((L, B, H)) for _ in range(ns)]
    f = lambda a: a.astype(np.float32)
    pack = lambda hs: tuple(hs) if cell == "lstm" else hs[0]
    m = make(cell)
    want = _run_all(m, cell, f(x64), pack([f(a) for a in hx64]), f(dy64), [f(a) for a in d64])
    got = _run_all(m, cell, x64, pack(hx64), dy64, d64)
    _assert_all_equal(got, want)
    assert all(a.dtype == np.float32 for a in got)


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_noncontiguous_inputs_accepted(cell):
    rng = np.random.default_rng(8)
    ns = len(STATES[cell])
    pack = lambda hs: tuple(hs) if cell == "lstm" else hs[0]
    big = rng.standard_normal((2 * T, B, 2 * I)).astype(np.float32)
    x = big[::2, :, ::2][:, :, :I]                     # strided in two axes
    assert not x.flags.c_contiguous and x.shape == (T, B, I)
    hx = [rng.standard_normal((B, L, H)).astype(np.float32).transpose(1, 0, 2) for _ in range(ns)]
    dy = np.asfortranarray(rng.standard_normal((T, B, H)).astype(np.float32))
    dfinal = [rng.standard_normal((L, B, 2 * H)).astype(np.float32)[:, :, ::2] for _ in range(ns)]
    c = np.ascontiguousarray
    m = make(cell)
    want = _run_all(m, cell, c(x), pack([c(a) for a in hx]), c(dy), [c(a) for a in dfinal])
    got = _run_all(m, cell, x, pack(hx), dy, dfinal)
    _assert_all_equal(got, want)


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_transposed_view_batch_first(cell):
    """A (T, B, I) array viewed as (B, T, I) feeds a batch_first module; the
    results equal the sequence-major module's, transposed."""
    rng = np.random.default_rng(9)
    x = rng.standard_normal((T, B, I)).astype(np.float32)
    dy = rng.standard_normal((T, B, H)).astype(np.float32)
    seq, bf = make(cell), make(cell, batch_first=True)
    y0, f0 = call(seq, cell, x)
    g0 = backward(seq, cell, dy)
    y1, f1 = call(bf, cell, x.transpose(1, 0, 2))          # a view, not a copy
    g1 = backward(bf, cell, dy.transpose(1, 0, 2))
    np.testing.assert_array_equal(y1, y0.transpose(1, 0, 2))
    for a, b in zip(f1, f0):
        np.testing.assert_array_equal(a, b)
    for k in g0:
        want = g0[k].transpose(1, 0, 2) if k == "input" else g0[k]
        np.testing.assert_array_equal(g1[k], want, err_msg=k)


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_outputs_are_not_views_of_internal_state(cell):
    """Changing what forward returned must not change what backward computes."""
    rng = np.random.default_rng(10)
    x = rng.standard_normal((T, B, I)).astype(np.float32)
    dy = rng.standard_normal((T, B, H)).astype(np.float32)
    m = make(cell)
    call(m, cell, x)
    want = backward(m, cell, dy)
    y, finals = call(m, cell, x)
    y[:] = 100.0
    for f in finals:
        f[:] = 100.0
    got = backward(m, cell, dy)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


# ---- errors ---------------------------------------------------------------

def _shape_str(shape):
    return str(tuple(shape))


@pytest.mark.parametrize("cell", ["lstm", "gru"])
@pytest.mark.parametrize("shape", [(T,), (2, T, B, I), (T, B, I, 1)])
def test_wrong_rank_raises(cell, shape):
    m = make(cell)
    with pytest.raises(ValueError) as info:
        m(np.zeros(shape, np.float32))
    msg = str(info.value)
    assert "input" in msg
    assert _shape_str(shape) in msg                              # received
    assert "(T, B, input_size)" in msg                           # expected


@pytest.mark.parametrize("cell", ["lstm", "gru"])
@pytest.mark.parametrize("batch_first,shape,layout", [
    (False, (T, B, I + 1), "(T, B, input_size)"),
    (True, (B, T, I - 1), "(B, T, input_size)"),
    (False, (T, I + 2), "(T, B, input_size)"),                 # unbatched
    (False, (0, B, I), "(T, B, input_size)"),                  # empty sequence
    (False, (T, 0, I), "(T, B, input_size)"),                  # empty batch
])
def test_wrong_input_size_raises(cell, batch_first, shape, layout):
    m = make(cell, batch_first=batch_first)
    with pytest.raises(ValueError) as info:
        m(np.zeros(shape, np.float32))
    msg = str(info.value)
    assert "input" in msg
    assert _shape_str(shape) in msg                              # received
    assert layout in msg and f"input_size={I}" in msg            # expected


@pytest.mark.parametrize("cell", ["lstm", "gru"])
@pytest.mark.parametrize("dtype", [np.int32, np.int64, bool])
def test_int_input_raises_type_error(cell, dtype):
    m = make(cell)
    with pytest.raises(TypeError, match="input"):
        m(np.ones((T, B, I), dtype))


@pytest.mark.parametrize("which", ["h0", "c0"])
@pytest.mark.parametrize("shape", [(L, B, H + 1), (L + 1, B, H), (L, B + 1, H), (B, H)])
def test_wrong_hx_shape_lstm(which, shape):
    m = make("lstm")
    good = np.zeros((L, B, H), np.float32)
    bad = np.zeros(shape, np.float32)
    hx = (bad, good) if which == "h0" else (good, bad)
    with pytest.raises(ValueError) as info:
        m(np.zeros((T, B, I), np.float32), hx)
    msg = str(info.value)
    assert msg.startswith(which), msg
    assert _shape_str((L, B, H)) in msg and _shape_str(shape) in msg


@pytest.mark.parametrize("shape", [(L, B, H + 1), (L + 1, B, H), (B, H)])
def test_wrong_hx_shape_gru(shape):
    m = make("gru")
    with pytest.raises(ValueError) as info:
        m(np.zeros((T, B, I), np.float32), np.zeros(shape, np.float32))
    msg = str(info.value)
    assert "h0" in msg
    assert _shape_str((L, B, H)) in msg and _shape_str(shape) in msg


def test_wrong_hx_shape_unbatched():
    m = make("gru")
    with pytest.raises(ValueError, match=re.escape(f"h0: expected shape {(L, H)}")):
        m(np.zeros((T, I), np.float32), np.zeros((L, 1, H), np.float32))


def test_int_hx_raises_type_error():
    m = make("lstm")
    good = np.zeros((L, B, H), np.float32)
    with pytest.raises(TypeError, match="c0"):
        m(np.zeros((T, B, I), np.float32), (good, np.zeros((L, B, H), np.int64)))


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_backward_before_forward_raises(cell):
    m = make(cell)
    with pytest.raises(RuntimeError, match="forward"):
        m.backward(np.zeros((T, B, H), np.float32))


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_backward_after_load_state_dict_raises(cell):
    """A recorded forward used the old weights: loading new ones forgets it."""
    m = make(cell)
    call(m, cell, np.zeros((T, B, I), np.float32))
    m.load_state_dict(make(cell, seed=1).state_dict())
    with pytest.raises(RuntimeError):
        m.backward(np.zeros((T, B, H), np.float32))


@pytest.mark.parametrize("cell", ["lstm", "gru"])
@pytest.mark.parametrize("batch_first,shape", [
    (False, (T, B, H + 1)), (False, (T + 1, B, H)), (False, (B, T, H)), (True, (T, B, H)),
    (False, (T, H)),
])
def test_wrong_dy_shape_raises(cell, batch_first, shape):
    m = make(cell, batch_first=batch_first)
    call(m, cell, np.zeros((B, T, I) if batch_first else (T, B, I), np.float32))
    with pytest.raises(ValueError) as info:
        m.backward(np.zeros(shape, np.float32))
    msg = str(info.value)
    assert msg.startswith("dy"), msg
    expected = (B, T, H) if batch_first else (T, B, H)
    assert _shape_str(expected) in msg and _shape_str(shape) in msg


@pytest.mark.parametrize("which", ["dh_n", "dc_n"])
def test_wrong_dstate_shape_raises(which):
    m = make("lstm")
    call(m, "lstm", np.zeros((T, B, I), np.float32))
    kw = {which: np.zeros((L, B, H - 1), np.float32)}
    with pytest.raises(ValueError, match=which):
        m.backward(np.zeros((T, B, H), np.float32), **kw)


@pytest.mark.parametrize("kw", [dict(input_size=0), dict(hidden_size=-1), dict(num_layers=0),
                                dict(hidden_size=3.5), dict(num_layers=True)])
def test_bad_constructor_arguments(kw):
    args = dict(input_size=I, hidden_size=H, num_layers=1) | kw
    with pytest.raises(ValueError, match=next(iter(kw))):
        halstm.LSTM(**args)


# ---- PyTorch --------------------------------------------------------------

@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_matches_torch(cell):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    tcls = torch.nn.LSTM if cell == "lstm" else torch.nn.GRU
    tm = tcls(I, H, num_layers=L)                         # float32
    m = CLASSES[cell](I, H, num_layers=L)
    m.load_state_dict({k: v.detach().numpy() for k, v in tm.state_dict().items()})

    rng = np.random.default_rng(11)
    x = rng.standard_normal((T, B, I)).astype(np.float32)
    ns = len(STATES[cell])
    hx = [0.5 * rng.standard_normal((L, B, H)).astype(np.float32) for _ in range(ns)]
    dy = rng.standard_normal((T, B, H)).astype(np.float32)
    dfinal = [rng.standard_normal((L, B, H)).astype(np.float32) for _ in range(ns)]

    tx = torch.from_numpy(x.copy()).requires_grad_()
    th = [torch.from_numpy(a.copy()).requires_grad_() for a in hx]
    if cell == "lstm":
        ty, (th_n, tc_n) = tm(tx, tuple(th))
        tfinals = [th_n, tc_n]
        y, (h_n, c_n) = m(x, tuple(hx))
        finals = [h_n, c_n]
    else:
        ty, th_n = tm(tx, th[0])
        tfinals = [th_n]
        y, h_n = m(x, hx[0])
        finals = [h_n]
    loss = (ty * torch.from_numpy(dy)).sum()
    for tf, d in zip(tfinals, dfinal):
        loss = loss + (tf * torch.from_numpy(d)).sum()
    loss.backward()
    grads = m.backward(dy, *dfinal)

    assert_close("y", y, ty.detach().numpy())
    for s, f, tf in zip(STATES[cell], finals, tfinals):
        assert_close(f"{s}_n", f, tf.detach().numpy())

    want = {k: p.grad.numpy() for k, p in tm.named_parameters()}
    want["input"] = tx.grad.numpy()
    for s, t in zip(STATES[cell], th):
        want[f"{s}0"] = t.grad.numpy()
    assert set(grads) == set(want)
    for k, g in grads.items():
        assert_close(k, g, want[k])


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_backward_without_input_grad(cell):
    """input_grad=False leaves out the input gradient (the first layer's dx
    GEMM is skipped on a CPU) and changes no other gradient."""
    rng = np.random.default_rng(9)
    m = make(cell)
    x = rng.standard_normal((T, B, I)).astype(np.float32)
    dy = rng.standard_normal((T, B, H)).astype(np.float32)
    call(m, cell, x)
    want = backward(m, cell, dy)
    call(m, cell, x)
    got = m.backward(dy, input_grad=False)
    assert set(got) == set(want) - {"input"}
    for k, g in got.items():
        np.testing.assert_array_equal(g, want[k], err_msg=k)


@pytest.mark.parametrize("schedule", ["cpu", "naive"])
@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_class_index_input_matches_one_hot(cell, schedule):
    """Integer input = one-hot rows given as class indices: the first layer
    gathers W_ih's columns and scatter-adds dW_ih; every result and gradient
    equals the one-hot float input's (there is no input gradient)."""
    rng = np.random.default_rng(5)
    ids = rng.integers(0, I, (T, B))
    x = np.eye(I, dtype=np.float32)[ids]
    m = make(cell, schedule=schedule)
    y1, _ = m(x)
    dy = rng.standard_normal(y1.shape).astype(np.float32)
    g1 = m.backward(dy, input_grad=False)
    y2, _ = m(ids)
    g2 = m.backward(dy)
    assert_close("y", y2, y1, rtol=1e-6, atol=1e-6, per_element=True)
    assert set(g2) == set(g1)
    for k in g1:
        assert_close(k, g2[k], g1[k], rtol=1e-5, atol=1e-6, per_element=True)
    mb = make(cell, num_layers=1, batch_first=True, schedule=schedule)
    assert_close("y batch_first", mb(ids.T)[0], mb(x.transpose(1, 0, 2))[0], rtol=1e-6,
                 atol=1e-6, per_element=True)
    assert_close("y unbatched", mb(ids[:, 0])[0], mb(x[:, 0])[0], rtol=1e-6, atol=1e-6,
                 per_element=True)
    with pytest.raises(ValueError, match=r"\[0, 13\)"):
        m(np.full((T, B), I))


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_no_grad_forward_equals_forward_and_blocks_backward(cell):
    check_no_grad(cell)


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_lengths_match_each_sequence_alone(cell, rng):
    """A batch with lengths (unsorted, one of length 1, one full) equals the
    float64 reference run on each sequence alone: outputs (zero past each
    length), final states and every gradient (dy past a length ignored)."""
    from helpers import ref_run
    T, B = 7, 5
    lengths = np.array([3, 7, 1, 5, 7])
    m = make(cell)
    x = rng.standard_normal((T, B, I)).astype(np.float32)
    hx = [rng.standard_normal((L, B, H)).astype(np.float32) for _ in STATES[cell]]
    dy = rng.standard_normal((T, B, H)).astype(np.float32)
    dfinal = [rng.standard_normal((L, B, H)).astype(np.float32) for _ in STATES[cell]]
    y, finals = call(m, cell, x, hx if cell == "lstm" else hx[0], lengths=lengths)
    grads = backward(m, cell, dy, dfinal)
    want_grads = {}
    for b, n in enumerate(lengths):
        ry, rfinals, rg = ref_run(cell, m, x[:n, b:b + 1], [a[:, b:b + 1] for a in hx],
                                  dy[:n, b:b + 1], [a[:, b:b + 1] for a in dfinal])
        assert_close(f"y of sequence {b}", y[:n, b:b + 1], ry)
        assert not y[n:, b].any(), f"outputs past length {n} of sequence {b}"
        for s, (f, rf) in enumerate(zip(finals, rfinals)):
            assert_close(f"final state {s} of sequence {b}", f[:, b:b + 1], rf)
        assert_close(f"d input of sequence {b}", grads["input"][:n, b:b + 1], rg["input"])
        assert not grads["input"][n:, b].any()
        for s in STATES[cell]:
            assert_close(f"d {s}0 of sequence {b}", grads[f"{s}0"][:, b:b + 1], rg[f"{s}0"])
        for k in m.state_dict():
            want_grads[k] = want_grads.get(k, 0) + rg[k]
    for k, v in want_grads.items():
        assert_close(f"d {k}", grads[k], v)


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_lengths_split_over_threads_and_one_hot(cell, monkeypatch):
    """Lengths where the steps run as three ranges of rows (split_rows'
    sizes; the GEMMs over the steps' rows only, the padding left out), and
    with class-index input: each equals every sequence run alone."""
    monkeypatch.setenv("HL_NUM_THREADS", "3")
    rng = np.random.default_rng(11)
    T, B = 80, 27
    lengths = rng.integers(1, T + 1, B)
    lengths[3] = T
    m = make(cell)
    x = rng.standard_normal((T, B, I)).astype(np.float32)
    hx = [rng.standard_normal((L, B, H)).astype(np.float32) for _ in STATES[cell]]
    dy = rng.standard_normal((T, B, H)).astype(np.float32)
    dfinal = [rng.standard_normal((L, B, H)).astype(np.float32) for _ in STATES[cell]]
    call(m, cell, x, hx if cell == "lstm" else hx[0], lengths=lengths)
    backward(m, cell, dy, dfinal)
    assert {lib.step_threads() for lib in m._libs.values()} == {3}
    check_lengths_against_alone(m, x, lengths, hx, dy, dfinal)
    ids = rng.integers(0, I, (9, 4))
    check_lengths_against_alone(m, ids, np.array([4, 9, 1, 6]), [a[:, :4] for a in hx],
                                dy[:9, :4], [a[:, :4] for a in dfinal])


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_lengths_backward_again_without_final_gradients(cell):
    """A second backward with lengths and no final-state gradients equals
    the first: each sequence's first step reads zeros for the later
    steps' dh, not what the last call left in the fused step's rows."""
    rng = np.random.default_rng(12)
    m = make(cell, num_layers=1)
    x = rng.standard_normal((9, 6, I)).astype(np.float32)
    dy = rng.standard_normal((9, 6, H)).astype(np.float32)
    lengths = np.array([4, 9, 1, 6, 9, 2])
    runs = []
    for _ in range(2):
        m(x, lengths=lengths)
        runs.append(m.backward(dy))
    for k in runs[0]:
        np.testing.assert_array_equal(runs[1][k], runs[0][k], err_msg=k)


def test_lengths_errors():
    m = make("lstm")
    x = np.zeros((7, 3, I), np.float32)
    for bad in ([3, 8, 1], [0, 2, 1], [3, 2], [1.5, 2, 3]):
        with pytest.raises(ValueError, match=r"lengths: expected \(3,\) ints in \[1, 7\]"):
            m(x, lengths=np.array(bad))


# ---- bidirectional, dropout (CPU targets; tests/gpu: CUDA) ---------------------

def _torch_reference(tm, cell, x, hx, dy, dfinal, lengths=None, batch_first=False):
    """torch.nn module tm on x (and packed by lengths): y, finals, grads by name."""
    torch = pytest.importorskip("torch")
    tx = torch.from_numpy(x.copy()).requires_grad_()
    th = [torch.from_numpy(a.copy()).requires_grad_() for a in hx]
    inp = tx
    if lengths is not None:
        inp = torch.nn.utils.rnn.pack_padded_sequence(tx, torch.as_tensor(lengths), batch_first,
                                                      enforce_sorted=False)
    ty, tfin = tm(inp, tuple(th) if cell == "lstm" else th[0])
    if lengths is not None:
        ty, _ = torch.nn.utils.rnn.pad_packed_sequence(ty, batch_first, total_length=T)
    tfin = list(tfin) if cell == "lstm" else [tfin]
    loss = (ty * torch.from_numpy(dy)).sum()
    for f, d in zip(tfin, dfinal):
        loss = loss + (f * torch.from_numpy(d)).sum()
    loss.backward()
    grads = {k: p.grad.numpy() for k, p in tm.named_parameters()}
    grads["input"] = tx.grad.numpy()
    grads |= {f"{s}0": t.grad.numpy() for s, t in zip(STATES[cell], th)}
    return ty.detach().numpy(), [f.detach().numpy() for f in tfin], grads


@pytest.mark.parametrize("cell, lengths, batch_first", [
    ("lstm", None, False), ("lstm", [3, 7, 1], True), ("gru", [7, 2, 5], False)])
def test_bidirectional_matches_torch(cell, lengths, batch_first, rng):
    """Two layers both ways, with and without (unsorted) lengths, against
    torch.nn with the same state dict: outputs, final states, every gradient."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    tm = (torch.nn.LSTM if cell == "lstm" else torch.nn.GRU)(
        I, H, num_layers=L, bidirectional=True, batch_first=batch_first)
    m = make(cell, bidirectional=True, batch_first=batch_first)
    assert list(m.state_dict()) == list(tm.state_dict())
    m.load_state_dict({k: v.detach().numpy() for k, v in tm.state_dict().items()})
    x = rng.standard_normal((B, T, I) if batch_first else (T, B, I)).astype(np.float32)
    hx = [rng.standard_normal((2 * L, B, H)).astype(np.float32) for _ in STATES[cell]]
    dy = rng.standard_normal((B, T, 2 * H) if batch_first else (T, B, 2 * H)).astype(np.float32)
    dfinal = [rng.standard_normal((2 * L, B, H)).astype(np.float32) for _ in STATES[cell]]
    if lengths is not None:            # torch's packed gradients ignore dy past a length
        pad = np.arange(T)[None, :] >= np.array(lengths)[:, None]        # (B, T)
        dy[pad if batch_first else pad.T] = 0
    y, finals = call(m, cell, x, hx if cell == "lstm" else hx[0], lengths=lengths)
    grads = backward(m, cell, dy, dfinal)
    ty, tfinals, want = _torch_reference(tm, cell, x, hx, dy, dfinal, lengths, batch_first)
    assert_close("y", y, ty)
    for s, f, tf in zip(STATES[cell], finals, tfinals):
        assert_close(f"{s}_n", f, tf)
    assert set(grads) == set(want)
    for k, g in grads.items():
        assert_close(f"d {k}", g, want[k])


@pytest.mark.parametrize("bidirectional, lengths, given, batch_first, steps, batch", [
    (False, None, True, False, T, B), (True, [3, 7, 1], True, True, T, B),
    (False, [3, 7, 1], False, False, T, B), (True, None, True, False, 1, 1)])
def test_projection_matches_torch(bidirectional, lengths, given, batch_first, steps, batch, rng):
    """proj_size=I: two layers against torch.nn.LSTM(proj_size=I) with the
    same state dict, every gradient (h0's too when hx is not given: torch's
    at zeros)."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    D, P = 1 + bidirectional, I
    tm = torch.nn.LSTM(I, H, num_layers=L, bidirectional=bidirectional, batch_first=batch_first,
                       proj_size=P)
    m = make("lstm", bidirectional=bidirectional, batch_first=batch_first, proj_size=P)
    assert list(m.state_dict()) == list(tm.state_dict())
    m.load_state_dict({k: v.detach().numpy() for k, v in tm.state_dict().items()})
    x = rng.standard_normal((batch, steps, I) if batch_first else (steps, batch, I))
    x = x.astype(np.float32)
    hx = [rng.standard_normal((D * L, batch, n)).astype(np.float32) * given for n in (P, H)]
    dy = rng.standard_normal(x.shape[:2] + (D * P,)).astype(np.float32)
    dfinal = [rng.standard_normal((D * L, batch, n)).astype(np.float32) for n in (P, H)]
    if lengths is not None:
        pad = np.arange(steps)[None, :] >= np.array(lengths)[:, None]        # (B, T)
        dy[pad if batch_first else pad.T] = 0
    y, finals = call(m, "lstm", x, hx if given else None, lengths=lengths)
    grads = backward(m, "lstm", dy, dfinal)
    ty, tfinals, want = _torch_reference(tm, "lstm", x, hx, dy, dfinal, lengths, batch_first)
    assert_close("y", y, ty)
    for s, f, tf in zip(STATES["lstm"], finals, tfinals):
        assert_close(f"{s}_n", f, tf)
    assert set(grads) == set(want)
    for k, g in grads.items():
        assert_close(f"d {k}", g, want[k])


def test_dropout_applies_the_module_masks(rng, monkeypatch):
    """In training mode each layer's output but the last is multiplied by a
    mask (here fixed) on the way up and on the way down: equal to torch
    layers composed by hand with the same masks, every gradient included."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(1)
    layers = [torch.nn.LSTM(I if k == 0 else 2 * H, H, bidirectional=True) for k in range(L)]
    m = make("lstm", bidirectional=True, dropout=0.5)
    m.load_state_dict({k.replace("_l0", f"_l{i}"): v.detach().numpy()
                       for i, t in enumerate(layers) for k, v in t.state_dict().items()})
    masks = [np.where(rng.random((T, B, 2 * H)) < 0.5, 0, 2).astype(np.float32)]
    monkeypatch.setattr(m, "_dropout_mask", lambda shape: masks[0])
    x = rng.standard_normal((T, B, I)).astype(np.float32)
    dy = rng.standard_normal((T, B, 2 * H)).astype(np.float32)
    y, _ = m(x)
    grads = m.backward(dy)
    tx = torch.from_numpy(x).requires_grad_()
    out, _ = layers[0](tx)
    ty, _ = layers[1](out * torch.from_numpy(masks[0]))
    (ty * torch.from_numpy(dy)).sum().backward()
    assert_close("y", y, ty.detach().numpy())
    assert_close("d input", grads["input"], tx.grad.numpy())
    for i, t in enumerate(layers):
        for k, p in t.named_parameters():
            assert_close(f"d {k} of layer {i}", grads[k.replace("_l0", f"_l{i}")], p.grad.numpy())


def test_dropout_seeded_train_and_eval(rng):
    """Masks come from the module's seed (same seed, same outputs); eval()
    turns dropout off (equal to a module without dropout); p=1 zeroes the
    upper layers' input."""
    x = rng.standard_normal((T, B, I)).astype(np.float32)
    a, b = make("gru", dropout=0.3, seed=5), make("gru", dropout=0.3, seed=5)
    plain = make("gru", seed=5)
    ya, yb = a(x)[0], b(x)[0]
    np.testing.assert_array_equal(ya, yb)
    assert not np.array_equal(ya, plain(x)[0])
    assert not np.array_equal(a(x)[0], ya)             # a new mask each call
    np.testing.assert_array_equal(a.eval()(x)[0], plain(x)[0])
    assert a.train() is a and a.training
    zero = make("gru", dropout=1.0, seed=5)
    np.testing.assert_array_equal(zero(x)[0], zero(np.zeros_like(x))[0])


@pytest.mark.parametrize("kw, match", [
    (dict(dropout=1.5), "dropout: expected a probability"),
    (dict(dropout="0.1"), "dropout: expected a probability"),
    (dict(proj_size=4, target="host-cuda"), "proj_size: runs on CPU targets"),
    (dict(proj_size=H), r"proj_size: expected an int in \[0, hidden_size=37\)")])
def test_layer_feature_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        halstm.LSTM(I, H, num_layers=2, **kw)


def test_bidirectional_directions_run_at_once(monkeypatch, own_threads):
    """Where a layer's steps want half the cores or fewer (here one thread:
    H=37, B=3; four threads asked for), the second call runs the two
    directions at once on two instances of the library; its results equal
    the first call's, which ran them in turn."""
    monkeypatch.setenv("HL_NUM_THREADS", "4")
    m = make("gru", bidirectional=True)
    rng = np.random.default_rng(6)
    x = rng.standard_normal((T, B, I)).astype(np.float32)
    dy = rng.standard_normal((T, B, 2 * H)).astype(np.float32)
    runs = []
    for _ in range(2):
        y, h_n = m(x)
        runs.append((y, h_n, m.backward(dy)))
    assert {k[2] for k in m._libs} == {0, 1}                # lanes: both directions at once
    (y0, h0, g0), (y1, h1, g1) = runs
    np.testing.assert_array_equal(y1, y0)
    np.testing.assert_array_equal(h1, h0)
    for k in g0:
        np.testing.assert_array_equal(g1[k], g0[k], err_msg=k)


def test_bidirectional_hx_shape_error():
    m = make("lstm", bidirectional=True)
    with pytest.raises(ValueError, match=r"h0: expected shape \(4, 3, 37\)"):
        m(np.zeros((T, B, I), np.float32), (np.zeros((L, B, H), np.float32),) * 2)


def test_projection_cell_errors():
    with pytest.raises(ValueError, match="proj_size: cell 'gru' reads h in its step"):
        halstm.Recurrent("gru", I, H, proj_size=4)
    with pytest.raises(ValueError, match="proj_size: cell 'layernorm_lstm' reads its input and "
                                         "recurrent products apart"):
        halstm.Recurrent("layernorm_lstm", I, H, proj_size=4)


def test_fixed_weights_reuses_the_packed_weights():
    """Inside fixed_weights the calls reuse the panels the first one packed:
    the same results (forward and backward) as outside; a weight changed in
    place inside the scope is not seen (as documented), and is after it."""
    m = make("lstm")
    x = np.random.default_rng(5).standard_normal((T, B, I)).astype(np.float32)
    dy = np.random.default_rng(6).standard_normal((T, B, H)).astype(np.float32)
    want_y, _ = call(m, "lstm", x)
    want_g = m.backward(dy)
    w = m.state_dict()["weight_hh_l0"]
    with m.fixed_weights():
        for _ in range(2):
            y, _ = call(m, "lstm", x)
            g = m.backward(dy)
            assert np.array_equal(y, want_y)
            assert all(np.array_equal(g[k], want_g[k]) for k in want_g)
        m.load_state_dict({**m.state_dict(), "weight_hh_l0": w * 2})
        assert np.array_equal(call(m, "lstm", x)[0], want_y)
    assert not np.allclose(call(m, "lstm", x)[0], want_y)
