"""Regression: a hidden size that is a multiple of the vector width, with
buffers that are not 64-byte aligned, once made Halide emit aligned AVX-512
loads of an output buffer that faulted (see pipeline._output)."""
import numpy as np
import pytest

import halstm
from halstm import reference


def _misaligned(a):
    """A C-contiguous float32 copy of `a` whose data sits 4 bytes past a 64-byte boundary."""
    raw = np.empty(a.size + 32, np.float32)
    start = (-raw.ctypes.data % 64) // 4 + 1
    out = raw[start:start + a.size].reshape(a.shape)
    out[...] = a
    assert out.ctypes.data % 64 == 4
    return out


@pytest.mark.parametrize("cls,cell", [(halstm.LSTM, "lstm"), (halstm.GRU, "gru")])
def test_vector_multiple_hidden_size_with_misaligned_arrays(cls, cell, rng):
    m = cls(16, 32, num_layers=2, seed=3)
    x = _misaligned(rng.standard_normal((5, 3, 16)))
    y = m(x)[0]
    g = m.backward(_misaligned(np.ones_like(y)))
    ref = reference.forward(cell, {k: v.astype(np.float64) for k, v in m.state_dict().items()},
                            x.astype(np.float64))
    rg = reference.backward(cell, ref[-1], np.ones(y.shape))
    assert np.abs(y - ref[0]).max() < 1e-5
    for k in rg:
        assert np.abs(g[k] - rg[k]).max() <= 1e-4 * np.abs(rg[k]).max(), k
