"""Fixtures shared by the tests (plain helpers: helpers.py).

Kernels are compiled into one cache per test run, so each is built once,
also where pytest-xdist's workers share the run (`pytest -n 2`): the
cache's file locks let one worker build a kernel while the others wait
for it. HALSTM_TEST_CACHE names a folder to keep them between runs."""
import os

import numpy as np
import pytest

# torch (where the tests use it) waits passively for work, so that its idle
# OpenMP threads leave the cores to halstm's kernels (docs/torch.md); set
# before any test module imports torch
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.fixture(scope="session", autouse=True)
def kernel_cache(tmp_path_factory):
    """The kernel cache (HALSTM_CACHE) of this test run."""
    path = os.environ.get("HALSTM_TEST_CACHE")
    if not path:
        base = tmp_path_factory.getbasetemp()
        # xdist workers get base/../popen-gwN: their shared parent is the run's
        path = str((base.parent if "PYTEST_XDIST_WORKER" in os.environ else base) / "halstm-cache")
        os.makedirs(path, exist_ok=True)
    old = os.environ.get("HALSTM_CACHE")
    os.environ["HALSTM_CACHE"] = path
    yield path
    if old is None:
        os.environ.pop("HALSTM_CACHE", None)
    else:
        os.environ["HALSTM_CACHE"] = old


@pytest.fixture
def own_threads():
    """CPU libraries on their own threads through the test, not on a shared
    OpenMP team (halstm.runtime.share_openmp); as before afterwards."""
    from halstm import runtime
    before = runtime._openmp
    runtime.share_openmp(None)
    yield
    runtime.share_openmp(before)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture(scope="session")
def model_kernels(kernel_cache):
    """The char LM's head and optimizer kernels for this CPU."""
    from halstm.model.library import kernels
    return kernels("host")
