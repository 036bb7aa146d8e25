"""NaN and Inf go where PyTorch's arithmetic takes them: a NaN in the
input, an initial state or a weight gives NaN in exactly the outputs and
gradients that the float64 numpy reference has NaN in (nothing is clamped
into a finite value), and an infinity saturates the gates as in the
reference. CPU here; tests/gpu/test_gpu_nan.py runs the same cases on a
GPU."""
import numpy as np
import pytest

from helpers import B, I, STATES, T, assert_close, backward, call, make, ref_run

POISON = {   # where a special value goes: (array, index)
    "input": ("x", (2, 1, 4)),
    "h0": ("h0", (1, 2, 5)),
    "c0": ("c0", (0, 0, 3)),
    "weight_ih_l0": ("weight_ih_l0", (7, 2)),
    "weight_hh_l1": ("weight_hh_l1", (3, 11)),
    "bias_hh_l0": ("bias_hh_l0", (40,)),
}


def _problem(cell, where, value, rng, target="host"):
    """A module (2 layers) and inputs with `value` at `where`."""
    m = make(cell, target=target)
    x = rng.standard_normal((T, B, I)).astype(np.float32)
    hx = [0.5 * rng.standard_normal((2, B, 37)).astype(np.float32) for _ in STATES[cell]]
    name, index = POISON[where]
    if name == "x":
        x[index] = value
    elif name in ("h0", "c0"):
        hx[STATES[cell].index(name[0])][index] = value
    else:
        params = {k: np.array(v) for k, v in m.state_dict().items()}  # (GPU: copies)
        params[name][index] = value
        m.load_state_dict(params)
    return m, x, hx


def _same_specials(name, got, want):
    """NaN where the reference has NaN, and close elsewhere (infinities equal)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.array_equal(np.isnan(got), np.isnan(want)), (
        f"{name}: NaN in {int(np.isnan(got).sum())} entries, the reference in "
        f"{int(np.isnan(want).sum())}")
    inf = np.isinf(want)
    assert np.array_equal(got[inf], want[inf]), f"{name}: infinities differ"
    ok = np.isfinite(want)
    assert_close(name, np.where(ok, got, 0.0), np.where(ok, want, 0.0))


def _cases():
    for cell in ("lstm", "gru"):
        for where in POISON:
            if where == "c0" and cell == "gru":
                continue
            yield cell, where


def check_nan(cell, where, rng, target="host"):
    m, x, hx = _problem(cell, where, np.nan, rng, target)
    y, finals = call(m, cell, x, tuple(hx) if cell == "lstm" else hx[0])
    dy = rng.standard_normal(y.shape).astype(np.float32)
    grads = backward(m, cell, dy)
    ry, rfinals, rgrads = ref_run(cell, m, x, hx, dy)
    assert np.isnan(y).any() and np.isnan(ry).any()
    _same_specials("y", y, ry)
    for s, got, want in zip(STATES[cell], finals, rfinals):
        _same_specials(f"{s}_n", got, want)
    for k, want in rgrads.items():
        _same_specials(k, grads[k], want)


def check_inf(cell, where, value, rng, target="host"):
    m, x, hx = _problem(cell, where, value, rng, target)
    y, finals = call(m, cell, x, tuple(hx) if cell == "lstm" else hx[0])
    ry, rfinals, _ = ref_run(cell, m, x, hx)
    _same_specials("y", y, ry)
    for s, got, want in zip(STATES[cell], finals, rfinals):
        _same_specials(f"{s}_n", got, want)


NAN_CASES = list(_cases())
INF_CASES = [c for c in _cases() if c[1] != "bias_hh_l0"]
INF_VALUES = pytest.mark.parametrize("value", [np.inf, -np.inf], ids=["+inf", "-inf"])


@pytest.mark.parametrize("cell,where", NAN_CASES)
def test_nan_reaches_what_it_reaches_in_the_reference(cell, where, rng):
    check_nan(cell, where, rng)


@INF_VALUES
@pytest.mark.parametrize("cell,where", INF_CASES)
def test_inf_saturates_as_in_the_reference(cell, where, value, rng):
    check_inf(cell, where, value, rng)
