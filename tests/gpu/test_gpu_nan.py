"""tests/test_nan.py's cases on the GPU: NaN and Inf reach the outputs and
gradients of a CUDA build as they reach the float64 reference's."""
import pytest

from test_nan import INF_CASES, INF_VALUES, NAN_CASES, check_inf, check_nan


@pytest.mark.parametrize("cell,where", NAN_CASES)
def test_nan_on_the_gpu(cell, where, rng, gpu_target):
    check_nan(cell, where, rng, gpu_target)


@INF_VALUES
@pytest.mark.parametrize("cell,where", INF_CASES)
def test_inf_on_the_gpu(cell, where, value, rng, gpu_target):
    check_inf(cell, where, value, rng, gpu_target)
