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
