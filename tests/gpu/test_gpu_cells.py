"""Language cells on the GPU: tests/test_cells.py's checks with a CUDA
build (forward and every gradient against the numpy steps; the derived
LSTM and GRU against the hand-written ones)."""
import pytest

from halstm import reference
from test_cells import check_against_step, check_derived


@pytest.mark.parametrize("size", ["base", "T1", "B1"])
@pytest.mark.parametrize("cell", ["rnn_tanh", "rnn_relu", "cifg_lstm"])
def test_language_cell_on_the_gpu(cell, size, gpu_target):
    check_against_step(cell, reference.STEPS[cell], size, target=gpu_target)


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_derived_lstm_and_gru_on_the_gpu(cell, gpu_target):
    check_derived(cell, gpu_target)
