"""Dropout masks as the array kernels make them (halstm/model/kernels.py:
dropout), in numpy: the same bits on every target, for tests and for
reading. An element is kept where a hash of its index under a key
(two uint32 that the module's seeded generator draws) has its top 24 bits
at or above a threshold, then scaled by 1 / (1 - p)."""
from __future__ import annotations

import numpy as np


def hash32(i, key0, key1, u32=np.uint32):
    """A uint32 of element i under the key (key0, key1): murmur3's 32-bit
    finalizer twice, i xor key0 through the first, plus key1 through the
    second; uint32 arithmetic, which wraps (numpy uint32 arrays, or Halide
    Exprs with u32=hl.u32)."""
    def fmix(x):
        x = x ^ (x >> 16)
        x = x * u32(0x85EBCA6B)
        x = x ^ (x >> 13)
        x = x * u32(0xC2B2AE35)
        return x ^ (x >> 16)
    return fmix(fmix(i ^ key0) + key1)


def params(p: float) -> tuple[int, np.float32]:
    """(threshold, scale) of a mask that zeroes with probability p:
    threshold round(p * 2^24), scale 1 / (1 - p) (0 where p = 1)."""
    threshold = min(1 << 24, round(p * (1 << 24)))
    return threshold, (np.float32(1) / np.float32(1 - p) if p < 1 else np.float32(0))


def mask(shape, p: float, key0: int, key1: int) -> np.ndarray:
    """The kernel's dropout mask of shape (float32)."""
    threshold, scale = params(p)
    i = np.arange(int(np.prod(shape)), dtype=np.uint32)
    u = hash32(i, np.uint32(key0), np.uint32(key1))
    return np.where((u >> np.uint32(8)) >= np.uint32(threshold), scale,
                    np.float32(0)).astype(np.float32).reshape(shape)
