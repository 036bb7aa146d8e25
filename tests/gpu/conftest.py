"""GPU tests: they run where a CUDA driver and GPU are usable and skip
elsewhere (CI). HALSTM_GPU_TARGET names the Halide target they compile for
(default helpers.CUDA_TARGET). On a GPU machine:

    HALSTM_TEST_CACHE=/tmp/halstm-gpu .venv/bin/python -m pytest -q tests/gpu

tests/conftest.py's fixtures apply here too; tests/ is on sys.path (pytest
puts a conftest's folder there), so these tests import helpers.
"""
import os

import pytest

from halstm import cuda
from helpers import CUDA_TARGET


def pytest_collection_modifyitems(config, items):
    if cuda.available():
        return
    why = str(getattr(cuda, "_driver_error", None) or "no CUDA GPU")
    skip = pytest.mark.skip(reason=f"needs a CUDA GPU: {why}")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def gpu_target():
    """The Halide target the GPU tests compile for."""
    return os.environ.get("HALSTM_GPU_TARGET", CUDA_TARGET)


@pytest.fixture(scope="session")
def gpu_model_kernels(kernel_cache, gpu_target):
    """The char LM's head and optimizer kernels for the GPU."""
    from halstm.model.library import kernels
    return kernels(gpu_target)
