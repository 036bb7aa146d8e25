"""The cell language: definitions, their errors, and kernels of language
cells (forward and every gradient) against numpy steps written apart from
halstm.cells, with gradients by central differences in float64. (LSTM
and GRU, cells of the language too, are checked against the hand-written
BPTT of halstm.reference in test_modules.py.)"""
import subprocess
import sys

import numpy as np
import pytest

import halstm
from halstm import cells, reference
from halstm.cells import (CellError, define, exp, log, mean, minimum, relu, sigmoid, softplus,
                          sqrt, tanh, vector)
from helpers import USER_CELL, assert_close, check_lengths_against_alone

I, H = 5, 7            # odd sizes; every kernel here is built once per run
SIZES = {"base": dict(T=4, B=3, L=2), "T1": dict(T=1, B=3, L=2), "B1": dict(T=4, B=1, L=2),
         "L3": dict(T=3, B=2, L=3)}


def _problem(m, names, T, B, L, rng):
    H = m.hidden_size
    x = rng.standard_normal((T, B, I)).astype(np.float32)
    hx = [0.5 * rng.standard_normal((L, B, H)).astype(np.float32) for _ in names]
    dy = rng.standard_normal((T, B, H)).astype(np.float32)
    dfinal = [rng.standard_normal((L, B, H)).astype(np.float32) for _ in names]
    return x, hx, dy, dfinal


def check_against_step(cell, step, size="base", seed=0, random_vectors=False, hidden=H,
                       positive=(), **kw):
    """Module of `cell` against the numpy `step` at SIZES[size] and `hidden`
    units (random_vectors: its vector parameters random, see _randomized;
    positive: states whose initial values are drawn above 0.5)."""
    T, B, L = (SIZES[size][k] for k in "TBL")
    rng = np.random.default_rng(seed)
    m = halstm.Recurrent(cell, I, hidden, num_layers=L, seed=seed, **kw)
    if random_vectors:
        _randomized(m, seed + 1)
    names = m._state_names
    x, hx, dy, dfinal = _problem(m, names, T, B, L, rng)
    hx = [np.abs(a) + np.float32(0.5) if s in positive else a for s, a in zip(names, hx)]
    y, finals = m(x, hx[0] if len(names) == 1 else tuple(hx))
    finals = [finals] if len(names) == 1 else list(finals)
    grads = m.backward(dy, *dfinal)
    p64 = {k: np.asarray(v, np.float64) for k, v in m.state_dict().items()}
    f64 = lambda a: np.asarray(a, np.float64)   # noqa: E731
    ry, rfinals = reference.step_forward(step, p64, f64(x), [f64(a) for a in hx])
    assert_close("y", y, ry)
    for s, got, want in zip(names, finals, rfinals):
        assert_close(f"{s}_n", got, want)
    want = reference.step_gradients(step, p64, f64(x), [f64(a) for a in hx], f64(dy),
                                    [f64(a) for a in dfinal], names)
    assert set(grads) == set(want)
    for k, g in grads.items():
        assert_close(k, g, want[k], rtol=1e-4, atol=1e-6)
    return m


STEP_CELLS = ["rnn_tanh", "rnn_relu", "cifg_lstm", "peephole_lstm", "layernorm_lstm", "slstm"]


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("cell", STEP_CELLS)
def test_builtin_language_cell_matches_its_numpy_step(cell, size):
    # (slstm: the normaliser n starts positive, as it is after any step)
    check_against_step(cell, reference.STEPS[cell], size, positive=("n",))


def test_staged_values_are_the_costly_ones_read_by_a_sum_and_elsewhere():
    """layer_norm(c') reads c' (from the sigmoid of f and i and the tanh of
    g) in two sums and in the cell: those three activations are computed
    once a row; o's, read once, and a cell without sums stage nothing."""
    from halstm.cells.language import _topo
    d = cells.definition("layernorm_lstm")
    nodes = {id(n): n for n in _topo([*d.saved_nodes, *d.new.values()])}
    staged = sorted((nodes[i].op, d.saved[d.saved_nodes.index(nodes[i])]) for i in d.staged_fwd)
    assert staged == [("sigmoid", "f"), ("sigmoid", "i"), ("tanh", "g")]
    assert not cells.definition("lstm").staged_fwd and not cells.definition("gru").staged_fwd


def test_reduction_groups_hold_sums_that_read_none_of_each_other():
    """The layer-norm LSTM's forward sums: the means of the two projections
    (level 1), their variances (2), then c's mean and variance; backward,
    LN(c')'s two sums one after the other, then the two projections' sums
    side by side. A cell without sums has no groups."""
    from halstm import pipeline
    cell = cells.get("layernorm_lstm")
    for kind, sizes in (("step", [2, 2, 1, 1]), ("step_bwd", [1, 1, 2, 2])):
        p = pipeline.build(cell, kind, I, 16)
        assert [len(g) for g in p.reduction_groups] == sizes, kind
        assert sorted(f.name() for g in p.reduction_groups for f in g) == \
            sorted(f.name() for f in p.reductions)
    assert pipeline.build(cells.get("lstm"), "step", I, 16).reduction_groups == []


def _one_row_dh_tiles(hidden):
    """The one-row tiles of a backward product dh = W_hh^T dhg at this
    hidden size (cpu._dh_tiles: 8 panels, at most half of them): 2 at
    H=256 with AVX-512's panels of 16 units, 4 with AVX2's of 8."""
    import halide as hl
    from halstm.schedules import cpu
    panels = hidden // cpu.panel(hl.get_host_target())
    return panels // min(8, panels // 2)


@pytest.mark.parametrize("hidden, batch, split", [(37, 27, {"fwd": 3, "bwd": 3}),
                                                  (256, 27, {"fwd": 3, "bwd": 3}),
                                                  (96, 5, {"fwd": 3, "bwd": 3}),
                                                  (256, 1, {"fwd": 3, "bwd": "tiles"})])
def test_reducing_steps_split_over_rows(hidden, batch, split, monkeypatch):
    """A step that reduces over the units needs all of them: three threads
    asked for, the batch rows run as three ranges of rows backward, and
    forward where W_hh is at most 512 KB, with the results of one thread.
    Where W_hh is that small, a range may be as short as one row (5 rows:
    ranges of 1, 2 and 2). A larger W_hh, or one row, forward: each step in
    two parts, the product on ranges of units, then the rest on ranges of
    rows (pipeline.UNITS_FWD; the same results as one thread's, bit for
    bit). One row backward: ranges of units (step_bwd_units), one a tile
    of the product's one-row tiles at most (two at H=256 with AVX-512)."""
    if split["bwd"] == "tiles":
        split = {**split, "bwd": _one_row_dh_tiles(hidden)}
    m = _randomized(halstm.Recurrent("layernorm_lstm", I, hidden, seed=0), 1)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((60, batch, I)).astype(np.float32)
    dy = rng.standard_normal((60, batch, hidden)).astype(np.float32)
    runs = {}
    for threads in (1, 3):
        monkeypatch.setenv("HL_NUM_THREADS", str(threads))
        y, finals = m(x)
        runs[threads] = (y, *finals), m.backward(dy)
        ran = {lib.manifest["direction"]: lib.step_threads() for lib in m._libs.values()}
        assert ran == {d: min(n, threads) for d, n in split.items()}
    (outs1, grads1), (outs3, grads3) = runs[1], runs[3]
    for name, a, b in zip(("y", "h_n", "c_n"), outs3, outs1):
        if hidden == 256:   # (two parts: the same sums in the same order)
            np.testing.assert_array_equal(a, b, err_msg=name)
        assert_close(name, a, b, rtol=1e-6)
    assert set(grads3) == set(grads1)
    for k in grads1:
        assert_close(k, grads3[k], grads1[k], rtol=1e-5)


@pytest.mark.parametrize("cell", ["peephole_lstm", "layernorm_lstm"])
def test_lengths_match_each_sequence_alone(cell):
    """Cells with vector parameters (their gradients summed over the steps'
    rows) and one that reduces over units, on a batch with lengths
    (unsorted, one of length 1): each sequence as if run alone."""
    m = _randomized(halstm.Recurrent(cell, I, H, num_layers=2, seed=0), 1)
    rng = np.random.default_rng(4)
    x, hx, dy, dfinal = _problem(m, m._state_names, 6, 4, 2, rng)
    check_lengths_against_alone(m, x, np.array([3, 6, 1, 5]), hx, dy, dfinal)


def test_steps_in_two_parts_with_lengths(monkeypatch):
    """Steps in two parts on a batch with lengths, three threads: at H=288
    W_hh (1.3 MB) is past 512 KiB forward and 1 MiB backward, so both
    directions run each step's product on ranges of units and the rest on
    rows (two ranges of 8 rows would give the backward only two threads);
    each step's products and rows are those of its own rows: as each
    sequence alone."""
    monkeypatch.setenv("HL_NUM_THREADS", "3")
    m = _randomized(halstm.Recurrent("layernorm_lstm", I, 288, seed=0), 3)
    rng = np.random.default_rng(5)
    lengths = rng.integers(1, 31, 17)
    lengths[4] = 30
    x, hx, dy, dfinal = _problem(m, m._state_names, 30, 17, 1, rng)
    check_lengths_against_alone(m, x, lengths, hx, dy, dfinal)
    m(x, tuple(hx), lengths=lengths)
    m.backward(dy, *dfinal)
    assert m._lib(0, "fwd").step_threads() == 3 and m._lib(0, "bwd").step_threads() == 3


def test_cell_without_bias():
    m = check_against_step("cifg_lstm", reference.STEPS["cifg_lstm"], bias=False)
    assert not any(k.startswith("bias") for k in m.state_dict())


def _randomized(m, seed):
    """m with every vector parameter random (their initial values are
    ones and zeros, which would hide a mixed-up channel)."""
    rng = np.random.default_rng(seed)
    matrices = ("weight_ih", "weight_hh", "bias_ih", "bias_hh")
    m.load_state_dict({k: (v if k.rsplit("_l", 1)[0] in matrices
                           else 0.5 + rng.standard_normal(v.shape).astype(np.float32))
                       for k, v in m.state_dict().items()})
    return m


@pytest.mark.parametrize("cell", ["peephole_lstm", "layernorm_lstm"])
def test_vector_parameters_of_any_value(cell):
    """Vector parameters away from their initial values, every channel its
    own: forward and every gradient against the numpy step."""
    check_against_step(cell, reference.STEPS[cell], "base", seed=2, random_vectors=True)


def test_vector_parameters_are_the_rows_the_kernels_read():
    """A vector parameter is a view of the (V, H) array the kernels take:
    an in-place change (an optimizer step on state_dict()'s arrays) and a
    loaded one both reach the next call, as they reach a module given the
    same values."""
    m = _randomized(halstm.Recurrent("peephole_lstm", I, H, num_layers=2, seed=0), 1)
    x = np.random.default_rng(6).standard_normal((4, 3, I)).astype(np.float32)
    m.state_dict()["weight_co_l1"][:] += 0.75
    m.load_state_dict(m.state_dict() | {"weight_ci_l0": np.full(H, -0.5, np.float32)})
    fresh = halstm.Recurrent("peephole_lstm", I, H, num_layers=2, seed=1)
    fresh.load_state_dict({k: v.copy() for k, v in m.state_dict().items()})
    for got, want in zip(m(x), fresh(x)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert m._layer_vec(0)[0].tolist() == [-0.5] * H


def test_vector_parameters_names_shapes_and_initial_values():
    G4, L = 4 * H, 2
    peep = halstm.Recurrent("peephole_lstm", I, H, num_layers=L, seed=0).state_dict()
    for k in range(L):
        for w in ("weight_ci", "weight_cf", "weight_co"):
            assert peep[f"{w}_l{k}"].shape == (H,) and not peep[f"{w}_l{k}"].any()
        assert peep[f"bias_ih_l{k}"].shape == (G4,)
    ln = halstm.Recurrent("layernorm_lstm", I, H, num_layers=L, seed=0).state_dict()
    assert sorted(ln) == sorted(f"{n}_l{k}" for k in range(L) for n in (
        "weight_ih", "weight_hh", "bias", "ln_ih_weight", "ln_hh_weight", "ln_c_weight",
        "ln_c_bias"))
    for k in range(L):
        assert (ln[f"ln_ih_weight_l{k}"] == 1).all() and ln[f"ln_ih_weight_l{k}"].shape == (G4,)
        assert (ln[f"ln_c_weight_l{k}"] == 1).all() and ln[f"ln_c_weight_l{k}"].shape == (H,)
        assert not ln[f"ln_c_bias_l{k}"].any() and not ln[f"bias_l{k}"].any()
        assert np.abs(ln[f"weight_hh_l{k}"]).max() <= 1 / np.sqrt(H)


def test_layernorm_lstm_without_bias_drops_bias_only():
    m = check_against_step("layernorm_lstm", reference.STEPS["layernorm_lstm"], bias=False)
    names = {k.rsplit("_l", 1)[0] for k in m.state_dict()}
    assert names == {"weight_ih", "weight_hh", "ln_ih_weight", "ln_hh_weight", "ln_c_weight",
                     "ln_c_bias"}


def _rms_cell(x, r, s, p):
    """A user's cell with a reduction: h scaled by its root mean square."""
    a = tanh(x.a + r.a)
    return {"h": a / sqrt(mean(a * a) + 1.0) * p.gain}


RMS = define("rms_rnn", gates="a", states="h", step=_rms_cell,
             vectors=[vector("gain", init=1.0)])


def _rms_np(xg, hg, s, v):
    a = np.tanh(xg + hg)
    return (a / np.sqrt((a * a).mean(axis=1, keepdims=True) + 1.0) * v["gain"],)


@pytest.mark.parametrize("size", ["base", "B1"])
def test_a_users_cell_with_a_reduction_and_a_vector(size):
    check_against_step(RMS, _rms_np, size, seed=9)


def test_what_a_reducing_cell_saves():
    """Rows (means and scales) are saved once per row value, side by side
    in a channel of their own (two where H is smaller than their count),
    projections as they are: backward recomputes no sum of the forward."""
    d = cells.definition("layernorm_lstm")
    assert d.reduces and not cells.definition("lstm").reduces
    assert len(d.row_saved) == 6 and d.saved[-1] == "rows"
    assert [n for n in d.saved if n[:2] in ("x_", "r_")] == \
        ["x_i", "x_f", "x_g", "x_o", "r_i", "r_f", "r_g", "r_o"]
    assert d.saved_channels(4) == d.saved[:-1] + ("rows0", "rows1")
    assert d.saved_channels(H) == d.saved


@pytest.mark.parametrize("hidden", [4, 6])
def test_row_values_in_two_channels_or_one(hidden):
    """At H = 4 the layer-norm LSTM's 6 row values take two saved channels
    (units 0-3 and 0-1), at H = 6 exactly one: forward and every gradient
    as the numpy step's."""
    m = check_against_step("layernorm_lstm", reference.STEPS["layernorm_lstm"], hidden=hidden,
                           random_vectors=True)
    assert m._lib(0, "fwd").manifest["saved"][-2:] == \
        (["rows0", "rows1"] if hidden == 4 else ["r_o", "rows"])


@pytest.mark.parametrize("nonlinearity", ["tanh", "relu"])
def test_rnn_matches_torch(nonlinearity):
    torch = pytest.importorskip("torch")
    m = halstm.RNN(I, H, num_layers=2, nonlinearity=nonlinearity, seed=3)
    t = torch.nn.RNN(I, H, num_layers=2, nonlinearity=nonlinearity).double()
    t.load_state_dict({k: torch.tensor(np.asarray(v, np.float64))
                       for k, v in m.state_dict().items()})
    rng = np.random.default_rng(4)
    x = rng.standard_normal((6, 3, I)).astype(np.float32)
    h0 = rng.standard_normal((2, 3, H)).astype(np.float32)
    y, h_n = m(x, h0)
    xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    ht = torch.tensor(h0, dtype=torch.float64, requires_grad=True)
    yt, hnt = t(xt, ht)
    assert_close("y", y, yt.detach().numpy())
    assert_close("h_n", h_n, hnt.detach().numpy())
    dy = rng.standard_normal(y.shape).astype(np.float32)
    grads = m.backward(dy)
    yt.backward(torch.tensor(dy, dtype=torch.float64))
    assert_close("input", grads["input"], xt.grad.numpy())
    assert_close("h0", grads["h0"], ht.grad.numpy())
    for k, p in t.named_parameters():
        assert_close(k, grads[k], p.grad.numpy())


def test_what_the_language_saves():
    """LSTM: the four gates; GRU: its gates and W_hn h + b_hn (what
    halstm.reference's hand-written BPTT keeps too)."""
    lstm, gru = cells.definition("lstm"), cells.definition("gru")
    assert lstm.saved == ("i", "f", "g", "o") and lstm.dxp_is_dhg
    assert gru.saved == ("r", "z", "n", "r_n") and not gru.dxp_is_dhg
    rnn = cells.definition("rnn_tanh")
    assert rnn.saved == ("h",) and rnn.dxp_is_dhg     # h' itself (one channel at least)


def _ok(x, r, s):
    return {"h": tanh(x.a + r.a)}


@pytest.mark.parametrize("kwargs,needle", [
    (dict(step=lambda x, r, s: {"h": tanh(x.q + r.a)}), "x.q: no gate 'q'"),
    (dict(step=lambda x, r, s: {"h": tanh(x.a + r.a + s.c)}), "s.c: no state 'c'"),
    (dict(step=lambda x, r, s: {"c": tanh(x.a + r.a)}), "missing ['h']"),
    (dict(step=lambda x, r, s: tanh(x.a + r.a)), "must return a dict"),
    (dict(gates="ab"), "gate 'b' is used in no expression"),
    (dict(step=lambda x, r, s: {"h": tanh(x.a) if x.a > 0 else x.a}), "cannot branch"),
    (dict(step=lambda x, r, s: {"h": tanh(x.a + r.a) * np.ones(3)}), "symbols and numbers"),
    (dict(step=lambda x, r, s: {"h": tanh(x.a)}), "not recurrent"),
    (dict(states="ch", step=_ok), "the first state must be 'h'"),
    (dict(gates="aa"), "appears twice"),
    (dict(step=lambda x, r, s: {"h": s.h}), "a new state must be computed"),
    (dict(step=lambda x, r, s: {"h": np.exp(x.a + r.a)}), "its step raised"),
    (dict(step=lambda x, r, s: {"h": np.tanh(x.a + r.a)}), "halstm.cells' functions, sigmoid"),
])
def test_bad_definitions_are_refused_naming_the_cell(kwargs, needle):
    args = dict(name="mine", gates="a", states="h", step=_ok) | kwargs
    with pytest.raises(CellError, match="cell 'mine'") as e:
        define(**args)
    assert needle in str(e.value), str(e.value)


@pytest.mark.parametrize("gates,vectors,step,needle", [
    ("a", [vector("w")], lambda x, r, s, p: {"h": tanh(x.a + r.a)},
     "p.w is used in no expression"),
    ("ab", [vector("w", per_gate=True)],
     lambda x, r, s, p: {"h": tanh(x.a + r.a * p.w.a + x.b + r.b)},
     "p.w.b is used in no expression"),
    ("a", [vector("w")], lambda x, r, s, p: {"h": tanh(x.a + r.a * p.q)}, "p.q: no vector"),
    ("a", [vector("w", init="ones")], lambda x, r, s, p: {"h": tanh(x.a + r.a * p.w)},
     "init: expected a number or 'uniform'"),
    ("a", [vector("bias_ih")], lambda x, r, s, p: {"h": tanh(x.a + r.a * p.bias_ih)},
     "the matrices and their biases"),
    ("a", [vector("w"), vector("w")], lambda x, r, s, p: {"h": tanh(x.a + r.a * p.w)},
     "appears twice"),
    ("a", ["w"], lambda x, r, s, p: {"h": tanh(x.a + r.a)}, "expected halstm.cells.vector"),
])
def test_bad_vector_parameters_are_refused_naming_them(gates, vectors, step, needle):
    with pytest.raises(CellError, match="cell 'mine'") as e:
        define("mine", gates, "h", step, vectors=vectors)
    assert needle in str(e.value), str(e.value)


def test_register_refuses_a_builtin_name_and_a_different_cell_of_a_known_name():
    with pytest.raises(CellError, match="built-in"):
        cells.register(define("lstm", "a", "h", _ok))
    cells.register(define("mine_once", "a", "h", _ok))
    cells.register(define("mine_once", "a", "h", _ok))        # the same math: fine
    with pytest.raises(CellError, match="a different cell"):
        cells.register(define("mine_once", "a", "h", lambda x, r, s: {"h": relu(x.a + r.a)}))


def _minimal_gru(xg, hg, s):
    H = s[0].shape[1]
    a = xg + hg
    z = 1.0 / (1.0 + np.exp(-a[:, :H]))
    return ((1 - z) * np.tanh(a[:, H:]) + z * s[0],)


def test_a_users_cell_file_trains_like_a_builtin_cell(tmp_path):
    path = tmp_path / "mycell.py"
    path.write_text(USER_CELL)
    assert cells.load_file(path) == ["minimal_gru"]
    assert "minimal_gru" in cells.names()
    check_against_step("minimal_gru", _minimal_gru, seed=5)


def _three_states(x, r, s):
    """An LSTM whose output also reads a running mean m of its outputs."""
    i, f, o = (sigmoid(x[k] + r[k]) for k in "ifo")
    c = f * s.c + i * tanh(x.g + r.g)
    h = o * tanh(c + 0.5 * s.m)
    return {"h": h, "c": c, "m": 0.5 * s.m + 0.5 * h}


THREE = define("three_states", gates="ifgo", states="hcm", step=_three_states)


def _three_states_np(xg, hg, s):
    H = s[0].shape[1]
    a = xg + hg
    i, f, _, o = (1 / (1 + np.exp(-a[:, k * H:(k + 1) * H])) for k in range(4))
    g = np.tanh(a[:, 2 * H:3 * H])
    c = f * s[1] + i * g
    h = o * np.tanh(c + 0.5 * s[2])
    return h, c, 0.5 * s[2] + 0.5 * h


@pytest.mark.parametrize("size", ["base", "T1"])
def test_a_cell_of_three_states(size):
    m = check_against_step(THREE, _three_states_np, size, seed=6)
    assert m._state_names == ("h", "c", "m")


def _chained(x, r, s):
    """Gates that each read the one before: saved values of three levels."""
    a = sigmoid(x.a + r.a)
    n = tanh(x.n + a * r.n)
    z = sigmoid(x.z + r.z + n * s.h)
    return {"h": (1 - z) * n + z * s.h}


CHAINED = define("chained_gates", gates="anz", states="h", step=_chained)


def _chained_np(xg, hg, s):
    H = s[0].shape[1]
    xa, xn, xz = (xg[:, k * H:(k + 1) * H] for k in range(3))
    ra, rn, rz = (hg[:, k * H:(k + 1) * H] for k in range(3))
    a = 1 / (1 + np.exp(-(xa + ra)))
    n = np.tanh(xn + a * rn)
    z = 1 / (1 + np.exp(-(xz + rz + n * s[0])))
    return ((1 - z) * n + z * s[0],)


@pytest.mark.parametrize("size", ["base", "T1"])
def test_saved_values_read_from_lower_levels(size):
    """A saved activation computed from others reads them from the Funcs of
    lower levels (cells.lowering._leveled), here two; the kernels match
    the numpy step, gradients included."""
    import halide as hl
    from halstm import pipeline, schedules
    from halstm.cells.lowering import DefinedCell
    target = hl.get_host_target()
    p = pipeline.build(DefinedCell(CHAINED), "step", I, H,
                       schedules.for_target(target, "cpu").layout(target))
    assert [f.name().split("$")[0] for f in p.saved_levels] == ["chained_gates_saved_level0",
                                                  "chained_gates_saved_level1"]
    check_against_step(CHAINED, _chained_np, size, seed=8)


def test_a_cell_file_without_a_definition_is_refused(tmp_path):
    path = tmp_path / "empty.py"
    path.write_text("x = 1\n")
    with pytest.raises(CellError, match="defines no cell"):
        cells.load_file(path)


def test_cli_lists_and_compiles_a_users_cell(tmp_path):
    from helpers import run_cli
    path = tmp_path / "mycell.py"
    path.write_text(USER_CELL)
    listing = run_cli("cells", "--cell-file", path).output
    assert "minimal_gru  (from a file)" in listing
    assert "cifg_lstm  (built in)" in listing
    out = tmp_path / "built"
    run_cli("compile", "--cell-file", path, "--cell", "minimal_gru", "-i", I, "-H", H,
            "--layers", 2, "--out", out)
    # a process that has not registered the cell is told which file defines it
    r = subprocess.run([sys.executable, "-c", f"import halstm; halstm.load({str(out)!r})"],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "no cell known here" in r.stderr and str(path) in r.stderr
    m = halstm.load(out, seed=0)
    assert isinstance(m, halstm.Recurrent) and m.cell == "minimal_gru"
    x = np.random.default_rng(0).standard_normal((3, 2, I)).astype(np.float32)
    y, h_n = m(x)
    ry, rf = reference.step_forward(_minimal_gru, {k: np.asarray(v, np.float64) for k, v in
                                                  m.state_dict().items()},
                                    x.astype(np.float64), [np.zeros((2, 2, H))])
    assert_close("y", y, ry)


def test_cli_refuses_an_unknown_cell_naming_the_option():
    from helpers import assert_cli_error, run_cli
    result = run_cli("compile", "--cell", "nosuch", "-i", I, "-H", H, ok=False)
    assert_cli_error(result, "--cell", "nosuch", "--cell-file")


def test_char_lm_trains_with_a_language_cell(tmp_path):
    from halstm.model import Config, Trainer
    from helpers import TINY, make_corpus
    config = Config(**(TINY | dict(hidden_size=H)), cell="cifg_lstm", steps=12, eval_every=0)
    trainer = Trainer(config, make_corpus(config))
    trainer.run(progress=False, handle_signals=False)
    losses = trainer.history["train_loss"]
    assert len(losses) == 12 and all(np.isfinite(losses))
    assert np.mean(losses[-4:]) < np.mean(losses[:4]), losses


@pytest.mark.parametrize("cell", STEP_CELLS)
def test_a_definition_evaluated_on_arrays_is_the_numpy_step(cell):
    """step_function: the step the benchmark's numpy check and its torch
    eager peer run."""
    d = cells.definition(cell)
    rng = np.random.default_rng(8)
    G, Bn = len(d.gates), 3
    xg, hg = rng.standard_normal((Bn, G * H)), rng.standard_normal((Bn, G * H))
    states = [rng.standard_normal((Bn, H)) for _ in d.states]
    vectors = {v.name: rng.standard_normal((G if v.per_gate else 1) * H) for v in d.vectors}
    more = (vectors,) if vectors else ()
    want = reference.STEPS[cell](xg, hg, states, *more)
    for got_states in [d.step_function(reference.NumpyOps)(xg, hg, states, *more)]:
        for s, got, w in zip(d.states, got_states, want):
            assert_close(s, got, w, rtol=1e-12)
    torch = pytest.importorskip("torch")
    got_states = d.step_function(reference.torch_ops(torch))(
        *(torch.from_numpy(a) for a in (xg, hg)), [torch.from_numpy(a) for a in states],
        {k: torch.from_numpy(a) for k, a in vectors.items()})
    for s, got, w in zip(d.states, got_states, want):
        assert_close(s, got.numpy(), w, rtol=1e-12)


def test_the_operations_keep_nan_and_give_the_limits_of_infinities():
    """exp, log, softplus, maximum and minimum as lowered to Halide: NaN
    stays NaN, infinities and zeros give numpy's values, and elsewhere
    numpy's within 2e-6 (the polynomials), softplus of a very negative
    value (its log1p of a tiny number) included."""
    import halide as hl
    from halstm.cells import lowering
    specials = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-30, 1e-38, -1.0, 1.0, 0.3, 20.0, -20.0,
                -7.0, 5e-3, 88.0, 89.0, -87.0, -90.0, 1e30, -1e30]
    a = np.array(specials, np.float32)
    b = np.roll(a, 3)
    ea, eb = (hl.Buffer(v) for v in (a, b))
    k = hl.Var("k")
    unary = {"exp": np.exp, "log": np.log, "softplus": lambda v: np.logaddexp(0.0, v)}
    binary = {"max": np.maximum, "min": np.minimum}
    with np.errstate(all="ignore"):
        for op, fn in [*unary.items(), *binary.items()]:
            f = hl.Func(op)
            f[k] = lowering._UNARY[op](ea[k]) if op in unary else \
                lowering._BINARY[op](ea[k], eb[k])
            f.vectorize(k, 8, hl.TailStrategy.GuardWithIf)
            got = np.asarray(f.realize([len(a)])).astype(np.float64)
            want = fn(a.astype(np.float64)) if op in unary else \
                fn(a.astype(np.float64), b.astype(np.float64))
            want = want.astype(np.float32).astype(np.float64)   # (float32's range)
            assert np.array_equal(np.isnan(got), np.isnan(want)), (op, a, got, want)
            finite = np.isfinite(want)
            assert np.array_equal(got[~finite & ~np.isnan(want)],
                                  want[~finite & ~np.isnan(want)]), (op, a, got, want)
            assert np.allclose(got[finite], want[finite], rtol=2e-6, atol=1e-37), \
                (op, a, got, want)


def _min_log_step(x, r, s):
    """A cell of log, minimum, exp and softplus (made up, not a known one)."""
    g = sigmoid(x.g + r.g)
    a = minimum(softplus(x.a + r.a), 1.0 + s.h * s.h)
    return {"h": g * tanh(log(1.0 + exp(-a)) + s.h)}


def _min_log_np(xg, hg, s):
    H = s[0].shape[1]
    pre = xg + hg
    a = np.minimum(np.logaddexp(0.0, pre[:, :H]), 1.0 + s[0] * s[0])
    g = 1 / (1 + np.exp(-pre[:, H:]))
    return (g * np.tanh(np.log(1.0 + np.exp(-a)) + s[0]),)


def test_a_users_cell_of_log_minimum_exp_and_softplus():
    d = define("min_log", gates="ag", states="h", step=_min_log_step)
    cells.register(d)
    check_against_step("min_log", _min_log_np, "base", seed=8)


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_slstm_takes_nan_and_infinities_where_its_numpy_step_does(value):
    """A NaN or an infinity in the input (exp, softplus, maximum and a
    division on the way) gives NaN in exactly the outputs and final
    states where the float64 numpy step has NaN, and its values elsewhere."""
    m = halstm.Recurrent("slstm", I, H, num_layers=2, seed=0)
    x = np.random.default_rng(0).standard_normal((4, 3, I)).astype(np.float32)
    x[1, 1, 2] = value
    y, finals = m(x)
    p64 = {k: np.asarray(v, np.float64) for k, v in m.state_dict().items()}
    with np.errstate(all="ignore"):
        want_y, want_finals = reference.step_forward(
            reference.STEPS["slstm"], p64, x.astype(np.float64), [np.zeros((2, 3, H))] * 4)
    for name, got, want in [("y", y, want_y), *zip("hcnm", finals, want_finals)]:
        assert np.isnan(want).any() and np.array_equal(np.isnan(got), np.isnan(want)), name
        assert_close(name, np.where(np.isnan(got), 0, got), np.where(np.isnan(want), 0, want))


def test_every_function_the_errors_name_is_in_halstm_cells():
    from halstm.cells import language
    assert "exp" in language.FUNCTIONS and "layer_norm" in language.FUNCTIONS
    for name in language.FUNCTIONS:
        assert callable(getattr(cells, name, None)), name
