"""The host pool behind memory.empty: large arrays reuse the blocks of
arrays that are gone, never those of arrays (or views) still alive."""
import gc

import numpy as np

from halstm import memory

BIG = (memory.POOL_FROM // 4 + 1,)       # floats: just past the pool's threshold


def test_a_block_comes_back_once_no_array_uses_it():
    # (from no idle blocks: idle ones left by earlier tests of this process
    # can fill the pool up to its peak, and a's block would then be freed)
    memory.release_host_cache()
    a = memory.empty(BIG)
    where = a.ctypes.data
    a[:] = 1.0
    del a
    gc.collect()
    b = memory.empty(BIG)
    assert b.ctypes.data == where and b.ctypes.data % 64 == 0


def test_live_arrays_and_views_keep_their_blocks():
    a, b = memory.empty(BIG), memory.empty(BIG)
    a[:], b[:] = 1.0, 2.0
    view = a[3:].reshape(-1)[::2]            # a view outlives its array
    where = a.ctypes.data
    del a
    gc.collect()
    c = memory.empty(BIG)
    c[:] = 3.0
    assert c.ctypes.data != where
    assert np.all(view == 1.0) and np.all(b == 2.0)


def test_idle_blocks_stay_under_the_peak_and_can_be_freed():
    pool = memory._HostPool()
    blocks = [pool.take(memory.POOL_GRAIN) for _ in range(3)]
    assert pool.leased == pool.peak == 3 * memory.POOL_GRAIN
    del blocks
    gc.collect()
    assert pool.leased == 0 and pool.idle_bytes == 3 * memory.POOL_GRAIN
    kept = pool.take(memory.POOL_GRAIN)      # an idle block, not a new one
    assert pool.idle_bytes == 2 * memory.POOL_GRAIN and kept.size == memory.POOL_GRAIN
    pool.release()
    assert pool.idle_bytes == 0 and not pool.idle


def test_small_arrays_are_numpy_own():
    a = memory.empty((16,))
    assert a.ctypes.data % 64 == 0 and not isinstance(a.base.base, memory._Lease)


def test_pooled_arrays_have_the_asked_shape_aligned():
    n = memory.POOL_FROM // 4 + 3
    for shape, want in ((n, (n,)), ((3, n), (3, n))):
        a = memory.empty(shape)
        assert a.shape == want and a.dtype == np.float32 and a.flags.c_contiguous
        assert a.flags.writeable and a.ctypes.data % 64 == 0
        assert isinstance(a.base, memory._Lease)      # (a block of the pool)
        a[...] = 7.0
        assert float(a.sum()) == 7.0 * a.size
