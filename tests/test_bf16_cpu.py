"""precision "bf16" on a CPU with AMX: the forward's products (projection
and steps) on AMX tiles, bf16 operands, float32 sums, cell and states.

Checked against halstm.reference's step with the same operands rounded to
bf16 (reference.round_bf16; float64 sums). After the first step the
kernel's h and the reference's differ by float32 rounding, so an h near a
bf16 halfway point may round the other way in one of them: one step and
one layer are held to 2e-5, longer runs to 5e-4 and to a fifth of their
distance from the unrounded float32 result. The tests of what runs where
AMX is missing run everywhere; the rest only on a CPU with AMX."""
import numpy as np
import pytest

import halstm
from halstm import reference
from halstm.errors import CompileError
from helpers import assert_close

I, H = 37, 45      # odd sizes: a reduction past whole 32-chunks, units past whole panels
NO_AMX = "x86-64-linux-avx-avx2-f16c-fma-sse41"


def _amx_here() -> bool:
    import halide as hl
    return hl.get_host_target().has_feature(hl.TargetFeature.AVX512_SapphireRapids)


needs_amx = pytest.mark.skipif(not _amx_here(), reason="this CPU has no AMX")


def _lstm(xg, hg, s):
    a = xg + hg
    n = a.shape[1] // 4
    i, f = reference._sigmoid(a[:, :n]), reference._sigmoid(a[:, n:2 * n])
    g, o = np.tanh(a[:, 2 * n:3 * n]), reference._sigmoid(a[:, 3 * n:])
    c = f * s[1] + i * g
    return o * np.tanh(c), c


def _gru(xg, hg, s):
    n = xg.shape[1] // 3
    r = reference._sigmoid(xg[:, :n] + hg[:, :n])
    z = reference._sigmoid(xg[:, n:2 * n] + hg[:, n:2 * n])
    cand = np.tanh(xg[:, 2 * n:] + r * hg[:, 2 * n:])
    return ((1 - z) * cand + z * s[0],)


STEPS = {"lstm": _lstm, "gru": _gru}


def _run(m, cell, T, B, seed=0):
    """m's output and the reference's with bf16 operands and without:
    (y, y_bf16_reference, y_fp32_reference)."""
    rng = np.random.default_rng(seed)
    L = m.num_layers
    x = rng.standard_normal((T, B, I)).astype(np.float32)
    hx = [0.5 * rng.standard_normal((L, B, H)).astype(np.float32) for _ in m._state_names]
    y, _ = m(x, tuple(hx) if len(hx) > 1 else hx[0])
    p64 = {k: np.asarray(v, np.float64) for k, v in m.state_dict().items()}
    f64 = lambda a: np.asarray(a, np.float64)   # noqa: E731
    args = (STEPS[cell], p64, f64(x), [f64(a) for a in hx])
    want, _ = reference.step_forward(*args, operand=reference.round_bf16)
    plain, _ = reference.step_forward(*args)
    return y, want, plain


def _rel(a, b):
    return float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())


@pytest.fixture(scope="module")
def lstm1():
    return halstm.LSTM(I, H, seed=0, precision="bf16")


@needs_amx
@pytest.mark.parametrize("cell", ["lstm", "gru"])
# B = 1: the steps without AMX (step_narrow, up to cpu.AMX_NARROW_ROWS rows);
# 4: one AMX tile of rows; 17: two, the second ragged
@pytest.mark.parametrize("B", [1, 4, 17])
def test_bf16_step_equals_the_reference_with_bf16_operands(cell, B):
    m = halstm.Recurrent(cell, I, H, seed=0, precision="bf16")
    y, want, plain = _run(m, cell, T=1, B=B)
    assert_close("y", y, want, rtol=2e-5)
    assert _rel(y, plain) > 5e-4      # (the products did round their operands)


@needs_amx
@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_bf16_layers_over_time_follow_the_reference(cell):
    m = halstm.Recurrent(cell, I, H, num_layers=2, seed=0, precision="bf16")
    y, want, plain = _run(m, cell, T=5, B=20, seed=1)
    err = _rel(y, want)
    assert err < 5e-4 and err < _rel(y, plain) / 5, (err, _rel(y, plain))


@needs_amx
def test_bf16_one_hot_indices_equal_one_hot_rows(lstm1):
    ids = np.random.default_rng(2).integers(0, I, (6, 5)).astype(np.int32)
    y_ids, _ = lstm1(ids)                                   # the gather of W_ih's columns
    y_rows, _ = lstm1(np.eye(I, dtype=np.float32)[ids])     # the AMX projection
    assert_close("y", y_ids, y_rows, rtol=1e-6)


@needs_amx
def test_bf16_nan_stays_nan_in_its_row(lstm1):
    x = np.random.default_rng(3).standard_normal((3, 4, I)).astype(np.float32)
    x[1, 2, 5] = np.nan
    with halstm.no_grad():
        y, _ = lstm1(x)
    assert np.isnan(y[1:, 2]).all() and not np.isnan(y[0]).any()
    assert not np.isnan(np.delete(y, 2, axis=1)).any()


@needs_amx
def test_bf16_forward_trains_with_fp32_backward(lstm1):
    """Backward computes in float32 from the bf16 forward's saved values:
    the gradients are the float32 layer's to bf16's accuracy."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((4, 3, I)).astype(np.float32)
    dy = rng.standard_normal((4, 3, H)).astype(np.float32)
    fp32 = halstm.LSTM(I, H, seed=0)
    grads = {}
    for name, m in (("bf16", lstm1), ("fp32", fp32)):
        m(x)
        grads[name] = m.backward(dy)
    assert set(grads["bf16"]) == set(grads["fp32"])
    for k, g in grads["bf16"].items():
        assert np.isfinite(g).all(), k
        assert _rel(g, grads["fp32"][k]) < 3e-2, k


@needs_amx
def test_bf16_on_a_cpu_refuses_cells_that_reduce_over_units():
    with pytest.raises(CompileError, match="cells that reduce over units"):
        halstm.Recurrent("layernorm_lstm", I, H, precision="bf16").compile(backward=False)


def test_bf16_on_a_cpu_without_amx_is_a_clear_error():
    with pytest.raises(CompileError, match="needs Intel AMX"):
        halstm.LSTM(I, H, target=NO_AMX, precision="bf16").compile(backward=False)


def test_tf32_stays_a_cuda_mode():
    with pytest.raises(ValueError, match="precision: 'tf32' runs on CUDA targets only"):
        halstm.LSTM(I, H, precision="tf32")
