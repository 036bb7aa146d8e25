"""Shared fixtures: one kernel cache per test session (or HALSTM_TEST_CACHE,
to keep compiled kernels between runs while developing)."""
import os

import numpy as np
import pytest


@pytest.fixture(scope="session", autouse=True)
def kernel_cache(tmp_path_factory):
    path = os.environ.get("HALSTM_TEST_CACHE") or str(tmp_path_factory.mktemp("halstm-cache"))
    old = os.environ.get("HALSTM_CACHE")
    os.environ["HALSTM_CACHE"] = path
    yield path
    if old is None:
        os.environ.pop("HALSTM_CACHE", None)
    else:
        os.environ["HALSTM_CACHE"] = old


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
