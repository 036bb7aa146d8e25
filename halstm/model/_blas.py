"""Run numpy's OpenBLAS on one thread while halstm's kernels train.

The head's products are small ((T*B, H) x (H, V)); with OpenBLAS's default
of one thread per core, its workers keep spinning after each call and fight
Halide's thread pool for the same cores. Measured on the 2-core dev machine
(default config, 20 steps, load average 1.3): 14,000 chars/s with one BLAS
thread, 8,000-10,000 with two (the head alone 5 against 5-31 ms a step, and
the kernels' backward 97-101 against 147-169 ms).
Works like threadpoolctl: find the OpenBLAS that this process loaded and
call its set_num_threads; where there is none (another BLAS, another OS),
nothing changes.
"""
from __future__ import annotations

import ctypes
from contextlib import contextmanager
from functools import lru_cache

import numpy  # noqa: F401  (loads the BLAS that _openblas looks for)

_PREFIXES = ("scipy_openblas", "openblas")
_SUFFIXES = ("64_", "")


@lru_cache(maxsize=None)
def _openblas():
    """(get_num_threads, set_num_threads) of the loaded OpenBLAS, or None."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "openblas" in line.lower() and ".so" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for prefix in _PREFIXES:
            for suffix in _SUFFIXES:
                get = getattr(lib, f"{prefix}_get_num_threads{suffix}", None)
                set_ = getattr(lib, f"{prefix}_set_num_threads{suffix}", None)
                if get is not None and set_ is not None:
                    get.restype = ctypes.c_int
                    set_.argtypes = [ctypes.c_int]
                    return get, set_
    return None


@contextmanager
def single_threaded():
    """numpy's BLAS on one thread inside the block (restored after)."""
    fns = _openblas()
    if fns is None:
        yield
        return
    get, set_ = fns
    before = get()
    if before == 1:
        yield
        return
    set_(1)
    try:
        yield
    finally:
        set_(before)
