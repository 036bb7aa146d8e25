"""halstm.wavefront's rule, a library call over a chunk of a time loop
(runtime.Library.forward's `out`), which the GPU's wavefront is made of,
and a CPU stack's forward and backward in chunks (the wavefront's calls,
in turn); the wavefront itself runs in tests/gpu/test_gpu_modules.py."""
import numpy as np
import pytest

from halstm import nn, wavefront
from helpers import (B, H, I, T, assert_close, assert_grads_close, check_case, make,
                     record_wavefronts)


def test_chunks_follow_the_step_size_the_loop_and_the_layers(monkeypatch):
    monkeypatch.delenv("HALSTM_WAVEFRONT_CHUNKS", raising=False)
    charrnn = dict(T=100, B=64, G=4, I=65, H=512, layers=2, sms=132)
    assert wavefront.chunks(**charrnn) == 4
    assert wavefront.chunks(**charrnn | dict(layers=1)) == 1
    assert wavefront.chunks(**charrnn | dict(B=128)) == 4           # 2^27 MACs a step
    assert wavefront.chunks(**charrnn | dict(B=256)) == 1           # 2^28
    assert wavefront.chunks(**charrnn | dict(B=256, sms=264)) == 4
    assert wavefront.chunks(**charrnn | dict(T=50, B=2)) == 2       # 3 chunks: not of equal steps
    assert wavefront.chunks(**charrnn | dict(T=10, B=2)) == 1       # too little work a chunk
    assert wavefront.chunks(**charrnn | dict(I=512, layers=5)) == 2   # graph slots: 3
    assert wavefront.chunks(**charrnn | dict(T=1, B=256, sms=264)) == 1  # no more than T
    monkeypatch.setenv("HALSTM_WAVEFRONT_CHUNKS", "3")
    assert wavefront.chunks(**charrnn | dict(layers=1)) == 3
    assert wavefront.chunks(**charrnn | dict(T=2)) == 2
    monkeypatch.setenv("HALSTM_WAVEFRONT_CHUNKS", "")                   # as unset
    assert wavefront.chunks(**charrnn) == 4
    for bad in ("0", "-2", "abc"):
        monkeypatch.setenv("HALSTM_WAVEFRONT_CHUNKS", bad)
        with pytest.raises(ValueError, match="HALSTM_WAVEFRONT_CHUNKS: expected a positive int"):
            wavefront.chunks(**charrnn)


@pytest.mark.parametrize("T, n", [(7, 3), (100, 4), (5, 4), (1, 1)])
def test_bounds_cover_every_step_once(T, n):
    b = wavefront.bounds(T, n)
    assert b[0] == 0 and b[-1] == T and 2 <= len(b) <= n + 1
    assert all(x < y for x, y in zip(b, b[1:]))
    assert len({y - x for x, y in zip(b, b[1:-1])}) <= 1          # equal chunks but the last


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_a_loop_in_chunks_written_in_place_equals_one_call(cell):
    """Chunks of a layer's time loop, each writing its states and saved
    values into the whole loop's arrays from the previous chunk's last
    state in place, give the one call's results."""
    m = make(cell, num_layers=1)
    lib = m._lib(0, "fwd")
    rng = np.random.default_rng(5)
    x = rng.standard_normal((T, B, I)).astype(np.float32)
    init = [rng.standard_normal((B, m.hidden_size)).astype(np.float32) for _ in lib.states]
    w = m._layer_weights(0)
    want_states, want_saved = (np.array(a) for a in lib.forward(x, *w, init))
    NS, S = len(lib.states), lib.S
    states = np.full((NS, T + 1, B, m.hidden_size), np.nan, np.float32)
    saved = np.full((T, B, S, m.hidden_size), np.nan, np.float32)
    edges = wavefront.bounds(T, 3)
    for t0, t1 in zip(edges, edges[1:]):
        first = init if t0 == 0 else [states[s][t0] for s in range(NS)]
        lib.forward(x[t0:t1], *w, first,
                    out=([states[s][t0:t1 + 1] for s in range(NS)], saved[t0:t1]))
    same = dict(rtol=1e-6, atol=1e-7, per_element=True)
    assert_close("states", states, want_states, **same)
    assert_close("saved", saved, want_saved, **same)


def test_out_of_the_wrong_shape_is_refused():
    m = make("lstm", num_layers=1)
    lib = m._lib(0, "fwd")
    x = np.zeros((T, B, I), np.float32)
    states = [np.zeros((T, B, m.hidden_size), np.float32)] * 2      # T, not T + 1, rows
    saved = np.zeros((T, B, lib.S, m.hidden_size), np.float32)
    with pytest.raises(ValueError, match=r"out: expected 2 states of shape \(8, 3, 37\)"):
        lib.forward(x, *m._layer_weights(0), [None, None], out=(states, saved))
    states = [np.zeros((T + 1, B, m.hidden_size), np.float32)] * 2
    with pytest.raises(ValueError, match="out: expected saved of shape None"):
        lib.forward(x, *m._layer_weights(0), [None, None], save=False, out=(states, saved))


@pytest.mark.parametrize("case", ["base", "L3", "hx_and_dstate", "batch_first_hx_dstate", "T1",
                                  "unbatched_hx_dstate", "no_bias"])
@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_a_stack_in_chunks_matches_reference(cell, case, monkeypatch):
    """A CPU stack's forward and backward as the wavefront's chunks
    (wavefront.forward / backward with InTurn lanes: the chunks' calls in
    turn, the weight gradients summed over the chunks), against the
    reference."""
    monkeypatch.setattr(nn._RNN, "_wavefront_chunks", lambda self, *a: 3)
    seen = record_wavefronts(monkeypatch)
    check_case(cell, case)
    assert seen == {"forward": [3], "backward": [3]}


def test_a_layernorm_stack_in_chunks_matches_one_call(monkeypatch):
    """A cell with vector parameters (their gradients summed over the
    chunks, as the matrices'), a stack without matrix biases: chunks
    against the layers in turn, both on the CPU."""
    import halstm
    rng = np.random.default_rng(3)
    m = halstm.Recurrent("layernorm_lstm", I, 37, num_layers=2, seed=1)
    x = rng.standard_normal((T, B, I)).astype(np.float32)
    h0 = [0.5 * rng.standard_normal((2, B, 37)).astype(np.float32) for _ in range(2)]
    dy = rng.standard_normal((T, B, 37)).astype(np.float32)
    dc = rng.standard_normal((2, B, 37)).astype(np.float32)
    runs = []
    for n in (1, 3):
        monkeypatch.setattr(nn._RNN, "_wavefront_chunks", lambda self, *a, n=n: n)
        y, (h, c) = m(x, tuple(h0))
        runs.append(((y, h, c), m.backward(dy, None, dc)))
    (want, want_g), (got, got_g) = runs
    for name, a, b in zip(("y", "h_n", "c_n"), got, want):
        assert_close(name, a, b, rtol=1e-5)
    assert "ln_c_weight_l1" in got_g
    assert_grads_close(got_g, want_g, rtol=1e-5)


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_a_stack_with_dropout_in_chunks_matches_the_layers_in_turn(cell, monkeypatch):
    """Dropout between layers in training: the chunks take the masks the
    layers in turn take (the same seed), mask each chunk of a layer's input
    and of its dy, and give the same outputs and gradients."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((T, B, I)).astype(np.float32)
    dy = rng.standard_normal((T, B, H)).astype(np.float32)
    runs = []
    for n in (1, 3):
        monkeypatch.setattr(nn._RNN, "_wavefront_chunks", lambda self, *a, n=n: n)
        seen = record_wavefronts(monkeypatch)
        m = make(cell, num_layers=3, dropout=0.4, seed=7)
        y, _ = m(x)
        masks = m._tape[-1]
        assert len(masks) == 2 and all((k == 0).any() and (k != 0).any() for k in masks)
        runs.append((y, m.backward(dy, *[None] * len(m._state_names))))
        assert seen == ({"forward": [], "backward": []} if n == 1 else
                        {"forward": [3], "backward": [3]})
    (want, want_g), (got, got_g) = runs
    assert_close("y", got, want, rtol=1e-5)
    assert_grads_close(got_g, want_g, rtol=1e-5)
