"""runtime.Library's final states and their gradients in the call itself:
forward's `finals` (each state's last value copied out by the library) and
backward's final-state gradients put in place by the library where the
call has no batch sizes, against the same calls where the runtime places
them (batch sizes of every row's full length)."""
import numpy as np
import pytest

from helpers import B, H, I, T, assert_close, make


def _call(cell, seed=3):
    m = make(cell, num_layers=1)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, B, I)).astype(np.float32)
    init = [rng.standard_normal((B, H)).astype(np.float32) for _ in m._lib(0, "fwd").states]
    return m, x, init, m._layer_weights(0)


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_finals_are_the_last_states_copied(cell):
    m, x, init, w = _call(cell)
    lib = m._lib(0, "fwd")
    finals = [np.full((B, H), np.nan, np.float32) for _ in lib.states]
    if len(finals) > 1:
        finals[-1] = None                                           # a state not wanted
    states, _ = lib.forward(x, *w, init, finals=finals)
    for s, f in enumerate(finals):
        if f is not None:
            np.testing.assert_array_equal(f, states[s][T])
            assert not np.shares_memory(f, states)


def test_finals_with_batch_sizes_or_of_the_wrong_shape_are_refused():
    m, x, init, w = _call("lstm")
    lib = m._lib(0, "fwd")
    good = [np.zeros((B, H), np.float32) for _ in range(2)]
    with pytest.raises(ValueError, match="finals: expected None with batch_sizes"):
        lib.forward(x, *w, init, batch_sizes=np.full(T, B), finals=good)
    with pytest.raises(ValueError, match=r"finals: expected 2 arrays \(or None\) of shape "
                                         r"\(3, 37\), got \[\(3, 37\), \(37,\)\]"):
        lib.forward(x, *w, init, finals=[good[0], np.zeros(H, np.float32)])
    with pytest.raises(ValueError, match="finals: expected 2 arrays"):
        lib.forward(x, *w, init, finals=good[:1])


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_final_gradients_placed_by_the_library_match_the_runtimes(cell):
    """dfinal given, None (zeros) and mixed: the library's placement (no
    batch sizes) against the runtime's (batch sizes of full rows); every
    gradient the same to rounding."""
    m, x, init, w = _call(cell)
    fwd, bwd = m._lib(0, "fwd"), m._lib(0, "bwd")
    rng = np.random.default_rng(4)
    dy = rng.standard_normal((T, B, H)).astype(np.float32)
    d = [rng.standard_normal((B, H)).astype(np.float32) for _ in fwd.states]
    full = np.full(T, B, np.int32)
    for dfinal in (d, [None] * len(d), [None] + d[1:]):
        got, want = ({k: np.array(v) for k, v in bwd.backward(
            x, w[0], w[2], saved, states, dy, list(dfinal), batch_sizes=bs).items()}
            for states, saved, bs in [(*fwd.forward(x, *w, init), None),
                                      (*fwd.forward(x, *w, init, batch_sizes=full), full)])
        assert got.keys() == want.keys()
        for k in got:
            assert_close(k, got[k], want[k], rtol=1e-5)


def test_final_gradients_of_the_wrong_count_or_shape_are_refused():
    m, x, init, w = _call("lstm")
    states, saved = m._lib(0, "fwd").forward(x, *w, init)
    bwd, dy = m._lib(0, "bwd"), np.zeros((T, B, H), np.float32)
    with pytest.raises(ValueError, match="dfinal: expected 2 final-state gradients"):
        bwd.backward(x, w[0], w[2], saved, states, dy, [None])
    with pytest.raises(ValueError, match=r"dfinal: expected arrays of shape \(3, 37\), got "
                                         r"\(3, 36\)"):
        bwd.backward(x, w[0], w[2], saved, states, dy, [None, np.zeros((B, H - 1), np.float32)])
