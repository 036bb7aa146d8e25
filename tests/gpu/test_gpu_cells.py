"""Language cells on the GPU: tests/test_cells.py's checks with a CUDA
build (forward and every gradient against the numpy steps)."""
import pytest

from halstm import reference
from test_cells import check_against_step


@pytest.mark.parametrize("size", ["base", "T1", "B1"])
@pytest.mark.parametrize("cell", ["rnn_tanh", "rnn_relu", "cifg_lstm"])
def test_language_cell_on_the_gpu(cell, size, gpu_target):
    check_against_step(cell, reference.STEPS[cell], size, target=gpu_target)


def test_a_cell_of_three_states_on_the_gpu(gpu_target):
    from test_cells import THREE, _three_states_np
    check_against_step(THREE, _three_states_np, target=gpu_target)


@pytest.mark.parametrize("size", ["base", "B1"])
@pytest.mark.parametrize("cell", ["peephole_lstm", "layernorm_lstm"])
def test_vector_and_reducing_cells_on_the_gpu(cell, size, gpu_target):
    check_against_step(cell, reference.STEPS[cell], size, random_vectors=True,
                       target=gpu_target)


@pytest.mark.parametrize("H", [96, 512])
@pytest.mark.parametrize("cell", ["peephole_lstm", "layernorm_lstm"])
def test_gpu_schedules_of_larger_sizes_match_the_cpu(cell, H, gpu_target):
    """The GPU's tile and lanes paths (H = 96, 512): forward against the
    numpy step in float64, every gradient against the CPU build (itself
    checked by finite differences in tests/test_cells.py)."""
    import numpy as np
    import halstm
    from halstm import benchmark
    from helpers import assert_close
    from test_cells import _randomized
    cpu = _randomized(halstm.Recurrent(cell, 64, H, seed=0), 1)
    gpu = halstm.Recurrent(cell, 64, H, seed=0, target=gpu_target)
    gpu.load_state_dict(cpu.state_dict())
    rng = np.random.default_rng(2)
    x = rng.standard_normal((5, 19, 64)).astype(np.float32)
    dy = rng.standard_normal((5, 19, H)).astype(np.float32)
    y_cpu, _ = cpu(x)
    y_gpu, _ = gpu(x)
    assert benchmark.reference_errors(gpu, cell, x, y_gpu)["y"] < 1e-4
    assert_close("y", y_gpu, y_cpu)
    want, got = cpu.backward(dy), gpu.backward(dy)
    assert set(got) == set(want)
    for k, w in want.items():
        assert_close(k, got[k], w, rtol=1e-4, atol=1e-5)
