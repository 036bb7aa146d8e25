"""GPU tests: they run where a CUDA driver and GPU are usable and skip
elsewhere (CI). HALSTM_GPU_TARGET names the Halide target they compile for
(default host-cuda-cuda_capability_80). On a GPU machine:

    HALSTM_TEST_CACHE=/tmp/halstm-gpu .venv/bin/python -m pytest -q tests/gpu
"""
import os
import sys
from pathlib import Path

import pytest

from halstm import cuda

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # test_modules' helpers

TARGET = os.environ.get("HALSTM_GPU_TARGET", "host-cuda-cuda_capability_80")


def pytest_collection_modifyitems(config, items):
    if cuda.available():
        return
    why = str(getattr(cuda, "_driver_error", None) or "no CUDA GPU")
    skip = pytest.mark.skip(reason=f"needs a CUDA GPU: {why}")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(skip)
