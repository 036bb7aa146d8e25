"""Where a compiled library's arrays live: numpy arrays for CPU libraries
(Host), halstm.cuda.DeviceArrays for CUDA ones (Device). Both offer the
same small set of operations the runtime and the modules need, so that
their code does not branch on the device.
"""
from __future__ import annotations

import ctypes
import functools
import math
import threading

import numpy as np


def f32(a) -> np.ndarray:
    """a as a C-contiguous float32 array (no copy when it already is one)."""
    return np.ascontiguousarray(a, dtype=np.float32)


def address(a: np.ndarray) -> int:
    """Where a's data starts: ctypes' view of its buffer (0.16 us a call
    on the Zen 5 VM, a.ctypes.data 0.8: a layer's call reads a dozen),
    else (read-only or empty arrays) a.ctypes.data."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(a))
    except (TypeError, ValueError):
        return a.ctypes.data


def empty(shape) -> np.ndarray:
    """An uninitialised float32 array whose data starts on a 64-byte boundary
    (a cache line; an AVX-512 vector); from 1 MiB, memory of _pool."""
    shape = tuple(shape) if hasattr(shape, "__len__") else (int(shape),)
    n = math.prod(shape)
    if n * 4 >= POOL_FROM:
        return _pool.take(n * 4 + 64, shape)
    raw = np.empty(n * 4 + 64, np.uint8)
    start = -address(raw) % 64
    return raw[start:start + n * 4].view(np.float32).reshape(shape)


# Arrays from this size come from the pool; its blocks are multiples of
# POOL_GRAIN (a huge page).
POOL_FROM, POOL_GRAIN = 1 << 20, 2 << 20


class _Lease:
    """A block handed out: numpy arrays over it keep it alive (their base);
    when the last one goes, the block goes back to its pool (__del__: a
    weakref.finalize cost about 3 us a lease)."""

    __slots__ = ("__array_interface__", "_back")

    def __init__(self, block: np.ndarray, address: int, back, shape):
        # the block's bytes, or float32 of `shape` from its first 64-byte boundary
        start, typestr = (0, "|u1") if shape is None else (-address % 64, "<f4")
        self.__array_interface__ = {"data": (address + start, False), "typestr": typestr,
                                    "shape": block.shape if shape is None else shape,
                                    "version": 3}
        self._back = back, block, address

    def __del__(self):
        back, block, address = self._back
        back(block, address)


class _HostPool:
    """Large host arrays kept for reuse once no array uses them. A freshly
    allocated array costs a page fault every 4 KiB (or a huge page's
    zeroing and compaction) the first time the kernels write it, on every
    call: the tape, the states and the gradients are made anew each call
    (the layer-norm LSTM's forward at K=H=1024 B=64 T=25, Intel VM: 134 ms
    with fresh memory, 115 with reused, against 110 without a tape). Idle
    blocks are kept up to the most bytes ever leased at once, so the
    process holds no more than its peak; release() frees them."""

    def __init__(self):
        self.lock = threading.RLock()   # (a lease's __del__ may run inside take)
        self.idle: dict[int, list] = {}
        self.idle_bytes = self.leased = self.peak = 0

    def take(self, nbytes: int, shape: tuple | None = None) -> np.ndarray:
        """A uint8 array of at least nbytes, of a block no live array uses;
        with shape, a float32 array of that shape in it, from its first
        64-byte boundary (nbytes: room for that)."""
        size = -(-nbytes // POOL_GRAIN) * POOL_GRAIN
        with self.lock:
            blocks = self.idle.get(size)
            found = blocks.pop() if blocks else None     # (block, its address)
            if found is not None:
                self.idle_bytes -= size
            self.leased += size
            self.peak = max(self.peak, self.leased)
        if found is None:
            block = np.empty(size, np.uint8)
            found = block, block.ctypes.data
        return np.asarray(_Lease(*found, self._give_back, shape))

    def _give_back(self, block: np.ndarray, address: int) -> None:
        size = block.size
        with self.lock:
            self.leased -= size
            if self.idle_bytes + size <= self.peak:
                self.idle.setdefault(size, []).append((block, address))
                self.idle_bytes += size

    def release(self) -> None:
        """Free every idle block."""
        with self.lock:
            self.idle.clear()
            self.idle_bytes = 0


_pool = _HostPool()
release_host_cache = _pool.release


def reversed_steps(T: int, lengths) -> np.ndarray:
    """(T, B) int: the step each (t, b) of a time reversal reads, each row
    reversed within its length (lengths (B,)); steps past a length keep
    their place, so the map is its own inverse."""
    t = np.arange(T)[:, None]
    return np.where(t < lengths, lengths - 1 - t, t)


def ptr(a: np.ndarray) -> int:
    assert a.dtype == np.float32 and a.flags.c_contiguous, "runtime arrays must be contiguous f32"
    return address(a)


class Host:
    """Arrays of a CPU library: numpy."""

    kind = "cpu"
    keep_workspaces = True       # (runtime.Library._workspace)
    empty, ptr, contiguous = staticmethod(empty), staticmethod(ptr), staticmethod(f32)

    @staticmethod
    def zero(a):
        a[...] = 0
        return a

    @classmethod
    def zeros(cls, shape):
        return cls.zero(empty(shape))

    @staticmethod
    def put_leading(dst, src):
        """dst (R, W)[:, :w] = src (R, w)."""
        dst[:, :src.shape[-1]] = src

    @staticmethod
    def leading(a, w):
        """A contiguous copy of a[..., :w]."""
        return np.ascontiguousarray(a[..., :w])

    @staticmethod
    def scatter_rows(dst, slot, src):
        """dst (S, B, W)[slot[b], b, :w] = src (B, w)[b] for every row b."""
        dst[slot, np.arange(len(slot)), :src.shape[-1]] = src

    @staticmethod
    def take(a, index):
        """A new (A, len(index), ...) array: a (A, B, ...)[:, index]."""
        return np.take(a, index, axis=1)

    @staticmethod
    def pick(a, steps):
        """A new (B, n) array: a (S, B, n)[steps[b], b] for every row b."""
        return a[steps, np.arange(len(steps))]

    @staticmethod
    def reverse_time(a, lengths):
        """A new (T, B, ...) array: a's rows each reversed in time within
        the row's length (lengths (B,); None: all T); see reversed_steps."""
        if lengths is None:
            return np.ascontiguousarray(a[::-1])
        src = reversed_steps(a.shape[0], lengths)
        return np.take_along_axis(a, src.reshape(src.shape + (1,) * (a.ndim - 2)), axis=0)

    @staticmethod
    def concat(arrays):
        """A new array: arrays joined along the last axis."""
        return np.concatenate(arrays, axis=-1)

    @staticmethod
    def join_time(arrays):
        """A new array: arrays (T_i, ...) joined along the first axis."""
        return np.concatenate(arrays, axis=0)

    @staticmethod
    def columns(a, start, w):
        """A contiguous copy of a[..., start:start + w]."""
        return np.ascontiguousarray(a[..., start:start + w])

    @staticmethod
    def add(a, b):
        return a + b

    @staticmethod
    def mul(a, b, out=None):
        return np.multiply(a, b, out=out)

    @staticmethod
    def dropout_mask(shape, p: float, key0: int, key1: int):
        """A dropout mask (halstm.dropout.mask), by the host's
        array kernels (halstm.model.library)."""
        from .model import library
        return _dropout_mask(library.kernels("host"), shape, p, key0, key1)


class Device:
    """Arrays of a CUDA library: halstm.cuda.DeviceArray."""

    kind = "cuda"
    keep_workspaces = True

    def __init__(self):
        from . import cuda   # (imported only where a CUDA library is used)
        self.cuda = cuda
        self.empty, self.zeros = cuda.empty, cuda.zeros

    @property
    def context(self) -> int:
        """The CUcontext the arrays live in: device 0's primary."""
        return self.cuda.driver().context

    @staticmethod
    def zero(a):
        a.zero_()

    @staticmethod
    def ptr(a) -> int:
        return a.ptr

    @staticmethod
    def contiguous(a):
        return a           # (DeviceArrays are C-contiguous float32)

    def put_leading(self, dst, src):
        W, w = dst.shape[-1], src.shape[-1]
        self.cuda.copy_2d(dst, W, src, w, w, src.size // max(w, 1))

    def swap01(self, a):
        """A new (B, A, n) array from a (A, B, n): batch_first <-> time first."""
        a = self.cuda.asarray(a)
        A, B, n = a.shape
        out = self.cuda.empty((B, A, n))
        for i in range(A):   # out[:, i] = a[i]
            self.cuda.copy_2d(out, A * n, a, n, n, B, dst_offset=i * n, src_offset=i * B * n)
        return out

    def scatter_rows(self, dst, slot, src):
        """As Host.scatter_rows (through the host: dst is a few rows)."""
        a = dst.numpy()
        Host.scatter_rows(a, slot, src if isinstance(src, np.ndarray) else src.numpy())
        dst.copy_from(a)

    def take(self, a, index):
        """As Host.take, a copy per taken column (a is (A, B, n))."""
        A, B, n = a.shape
        out = self.cuda.empty((A, len(index), n))
        for j, b in enumerate(index):
            self.cuda.copy_2d(out, len(index) * n, a, B * n, n, A, dst_offset=j * n,
                              src_offset=int(b) * n)
        return out

    def pick(self, a, steps):
        """As Host.pick, a copy per row."""
        S, B, n = a.shape
        out = self.cuda.empty((B, n))
        for b, s in enumerate(steps):
            self.cuda.copy_2d(out, n, a, n, n, 1, dst_offset=b * n, src_offset=(int(s) * B + b) * n)
        return out

    def leading(self, a, w):
        return self.columns(a, 0, w)

    def columns(self, a, start, w):
        W = a.shape[-1]
        out = self.cuda.empty(a.shape[:-1] + (w,))
        self.cuda.copy_2d(out, w, a, W, w, a.size // max(W, 1), src_offset=start)
        return out

    def concat(self, arrays):
        """As Host.concat: a copy per array."""
        W = sum(a.shape[-1] for a in arrays)
        out, start = self.cuda.empty(arrays[0].shape[:-1] + (W,)), 0
        for a in arrays:
            w = a.shape[-1]
            self.cuda.copy_2d(out, W, a, w, w, a.size // max(w, 1), dst_offset=start)
            start += w
        return out

    def join_time(self, arrays):
        """As Host.join_time: a copy per array."""
        out = self.cuda.empty((sum(a.shape[0] for a in arrays),) + arrays[0].shape[1:])
        row, start = out.size // max(out.shape[0], 1), 0      # floats a step
        for a in arrays:
            self.cuda.copy_2d(out, row, a, row, row, a.shape[0], dst_offset=start)
            start += a.size
        return out

    @staticmethod
    def _ops():
        """The array kernels (halstm.model.library) of this machine's GPU."""
        from .model import library
        return library.kernels("host-cuda")

    def _indices(self, idx):
        """idx (numpy ints) as the array kernels' int32 argument (_uploaded)."""
        return _uploaded(np.ascontiguousarray(idx, dtype=np.int32).reshape(-1).tobytes())

    def reverse_time(self, a, lengths):
        """As Host.reverse_time, by one gather of (t, b) rows."""
        T, B = a.shape[:2]
        src = np.broadcast_to(np.arange(T)[::-1, None], (T, B)) if lengths is None else \
            reversed_steps(T, lengths)
        rows = self._indices(src * B + np.arange(B))
        return self._ops().rows(a.reshape(T * B, -1), rows).reshape(*a.shape)

    def add(self, a, b):
        return self._ops().add(a, b)

    def mul(self, a, b, out=None):
        return self._ops().mul(a, b, out)

    def dropout_mask(self, shape, p: float, key0: int, key1: int):
        """As Host.dropout_mask, on the GPU."""
        return _dropout_mask(self._ops(), shape, p, key0, key1)


def _dropout_mask(kernels, shape, p: float, key0: int, key1: int):
    from . import dropout
    threshold, scale = dropout.params(p)
    return kernels.dropout(shape, key0, key1, threshold, scale)


def for_device(device: str):
    """The arrays of a library whose manifest says `device` ("cpu", "cuda")."""
    if device == "cuda":
        return Device()
    if device == "cpu":
        return Host()
    raise ValueError(f"device: expected 'cpu' or 'cuda', got {device!r}")


@functools.lru_cache(maxsize=64)
def _uploaded(content: bytes):
    """int32 indices (their bytes) on the GPU, each content uploaded once
    and kept (the last 64; read-only): a batch's reversal recurs from
    forward to backward and call to call, and an upload from pageable
    memory waits for the GPU's queue."""
    return Device._ops().targets(np.frombuffer(content, dtype=np.int32))
