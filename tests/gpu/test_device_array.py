"""halstm.cuda.DeviceArray: copies, views, errors and DLPack both ways."""
import numpy as np
import pytest

from halstm import cuda


def test_round_trip_views_and_assignment():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((5, 3, 7)).astype(np.float32)
    d = cuda.DeviceArray.from_numpy(a)
    assert d.shape == (5, 3, 7) and d.dtype == np.float32 and d.nbytes == a.nbytes
    np.testing.assert_array_equal(d.numpy(), a)
    np.testing.assert_array_equal(d[2].numpy(), a[2])            # a view of one row
    np.testing.assert_array_equal(d[1:4].numpy(), a[1:4])
    np.testing.assert_array_equal(d[-1].numpy(), a[-1])
    np.testing.assert_array_equal(d.reshape(15, 7).numpy(), a.reshape(15, 7))
    d[0] = np.full((3, 7), 2.5, np.float32)                      # upload into a view
    d[4] = d[3]                                                  # device to device
    a[0], a[4] = 2.5, a[3]
    np.testing.assert_array_equal(d.numpy(), a)
    c = d.copy()
    c[1] = np.zeros((3, 7), np.float32)
    np.testing.assert_array_equal(d.numpy(), a)                  # the copy is separate
    np.testing.assert_array_equal(cuda.zeros((4, 2)).numpy(), 0)
    np.testing.assert_array_equal(np.asarray(d), a)              # __array__


def test_bad_use_is_a_clear_error():
    d = cuda.zeros((4, 2))
    with pytest.raises(IndexError, match="out of bounds"):
        d[4]
    with pytest.raises(IndexError, match="step 1"):
        d[::2]
    with pytest.raises(ValueError, match=r"expected shape \(2,\)"):
        d[0] = np.zeros(3, np.float32)
    with pytest.raises(ValueError, match="reshape"):
        d.reshape(3, 3)


def test_out_of_memory_raises_and_the_device_stays_usable():
    free, total = cuda.mem_info()
    with pytest.raises(cuda.CudaError, match="OUT_OF_MEMORY"):
        cuda.empty((2 * total // 4,))
    np.testing.assert_array_equal(cuda.DeviceArray.from_numpy(np.ones(3)).numpy(), 1)


def test_dlpack_with_torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    t = torch.arange(12, dtype=torch.float32, device="cuda").reshape(3, 4)
    d = cuda.asarray(t)                                  # a view: no copy
    assert d.ptr == t.data_ptr() and d.shape == (3, 4)
    d[1] = np.full(4, -1, np.float32)
    torch.cuda.synchronize()
    assert t[1].tolist() == [-1.0] * 4
    back = torch.from_dlpack(d)                          # and back again
    assert back.data_ptr() == d.ptr and back.shape == (3, 4)
    with pytest.raises(ValueError, match="C-contiguous"):
        cuda.asarray(t.t())
    with pytest.raises(TypeError, match="float32"):
        cuda.asarray(t.double())


def test_dlpack_with_cupy():
    cp = pytest.importorskip("cupy")
    c = cp.arange(6, dtype=cp.float32).reshape(2, 3)
    d = cuda.asarray(c)
    assert d.ptr == c.data.ptr
    np.testing.assert_array_equal(d.numpy(), np.arange(6).reshape(2, 3))
    e = cp.from_dlpack(cuda.DeviceArray.from_numpy(np.ones((2, 2))))
    assert float(e.sum()) == 4.0
