"""GPU memory for halstm's CUDA libraries: the CUDA driver API through
ctypes, and DeviceArray, a float32 array that lives on the GPU.

    a = halstm.cuda.DeviceArray.from_numpy(x)     # upload once
    y = a.numpy()                                 # copy back when asked
    b = halstm.cuda.asarray(torch_cuda_tensor)    # DLPack: no host round trip

DeviceArrays live on device 0 and run in its primary context (the one
PyTorch and CuPy use), on the legacy default stream, so that halstm's
kernels, these copies and a peer library's work are ordered with one
another (a stack's layers may run on streams of their own in between,
halstm.wavefront, whose work the legacy stream then waits for);
halstm.torch runs a CUDA tensor's layer in the primary context of the
tensor's device (context_of), on torch's current stream. A device's
context is retained at its first use, never before. Errors from
the driver raise CudaError with the driver's own name and message. No
halide import: a process that only runs cached libraries stays light.
"""
from __future__ import annotations

import ctypes
import math
import threading

import numpy as np

from .errors import KernelError

_U64, _SZ, _P, _I = ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_int


class CudaError(KernelError):
    """The CUDA driver reported an error (or there is no usable driver/GPU).
    A KernelError: whoever handles failed kernel runs handles these too."""


class _Driver:
    """libcuda loaded once; each device's primary context retained at its
    first use (context_of)."""

    def __init__(self):
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise CudaError(f"no CUDA driver: cannot load libcuda.so.1 ({e})") from None
        self.check(self.lib.cuInit(0), "cuInit")
        count = _I()
        self.check(self.lib.cuDeviceGetCount(ctypes.byref(count)), "cuDeviceGetCount")
        if count.value < 1:
            raise CudaError("the CUDA driver sees no GPU")
        self.count = count.value
        self.device = _I()
        self.check(self.lib.cuDeviceGet(ctypes.byref(self.device), 0), "cuDeviceGet")
        self._contexts: dict[int, int] = {}
        self._contexts_lock = threading.Lock()
        name = ctypes.create_string_buffer(256)
        self.check(self.lib.cuDeviceGetName(name, 256, self.device), "cuDeviceGetName")
        self.name = name.value.decode()
        for fn in ("cuMemcpyHtoD_v2", "cuMemcpyDtoH_v2", "cuMemcpyDtoD_v2"):
            getattr(self.lib, fn).argtypes = [_U64 if "DtoH" not in fn else _P,
                                              _P if "HtoD" in fn else _U64, _SZ]
        self.lib.cuMemAlloc_v2.argtypes = [ctypes.POINTER(_U64), _SZ]
        self.lib.cuMemFree_v2.argtypes = [_U64]
        self.lib.cuMemsetD8_v2.argtypes = [_U64, ctypes.c_ubyte, _SZ]
        self.lib.cuMemsetD8Async.argtypes = [_U64, ctypes.c_ubyte, _SZ, _P]
        self.lib.cuMemcpy2D_v2.argtypes = [ctypes.c_void_p]
        self.lib.cuMemcpy2DAsync_v2.argtypes = [ctypes.c_void_p, _P]
        self.lib.cuMemGetInfo_v2.argtypes = [ctypes.POINTER(_SZ), ctypes.POINTER(_SZ)]
        self._current = threading.local()

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            name, text = ctypes.c_char_p(), ctypes.c_char_p()
            self.lib.cuGetErrorName(rc, ctypes.byref(name))
            self.lib.cuGetErrorString(rc, ctypes.byref(text))
            raise CudaError(f"{what} failed: {(name.value or b'?').decode()} "
                            f"({(text.value or b'unknown error').decode()}, code {rc})")

    @property
    def context(self) -> int:
        """Device 0's primary context (DeviceArrays')."""
        return self.context_of(0)

    def context_of(self, index: int) -> int:
        """The primary context of device `index` (a CUcontext as an int),
        retained at the first call for that device."""
        ctx = self._contexts.get(index)
        if ctx is not None:
            return ctx
        with self._contexts_lock:
            if index not in self._contexts:
                if not 0 <= index < self.count:
                    raise CudaError(f"device: expected a CUDA device index in [0, {self.count}), "
                                    f"got {index}")
                dev, ctx = _I(), _P()
                self.check(self.lib.cuDeviceGet(ctypes.byref(dev), index), "cuDeviceGet")
                self.check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev),
                           "cuDevicePrimaryCtxRetain")
                self._contexts[index] = ctx.value
            return self._contexts[index]

    def attribute(self, number: int) -> int:
        """CUdevice_attribute `number` of device 0 (no context needed)."""
        value = _I()
        self.check(self.lib.cuDeviceGetAttribute(ctypes.byref(value), number, self.device),
                   "cuDeviceGetAttribute")
        return value.value

    def call(self, fn: str, *args) -> None:
        """Call a driver function with device 0's primary context current."""
        if getattr(self._current, "set", False) is False:
            self.check(self.lib.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")
            self._current.set = True
        self.check(getattr(self.lib, fn)(*args), fn)


_driver: _Driver | None = None
_driver_error: CudaError | None = None
_lock = threading.Lock()


def driver() -> _Driver:
    """The loaded driver; raises CudaError (the same one every time) if there is none."""
    global _driver, _driver_error
    if _driver is not None:          # (every device call asks: no lock once loaded)
        return _driver
    with _lock:
        if _driver is None and _driver_error is None:
            try:
                _driver = _Driver()
            except CudaError as e:
                _driver_error = e
        if _driver_error is not None:
            raise CudaError(str(_driver_error))
        return _driver


def available() -> bool:
    """Whether a CUDA driver and a GPU are usable here."""
    try:
        driver()
        return True
    except CudaError:
        return False


def capability() -> tuple[int, int]:
    """Device 0's compute capability, e.g. (9, 0) for an H100 (the
    libraries' target: every device of a machine is taken to be of one
    kind)."""
    d = driver()
    return d.attribute(75), d.attribute(76)   # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, _MINOR


# Halide's CUDA capability features (target strings say cuda_capability_NN)
HALIDE_CAPABILITIES = (30, 32, 35, 50, 61, 70, 75, 80, 86)


def host_target(target: str) -> str:
    """A "host" CUDA target string with no cuda_capability_NN gets this
    GPU's (the newest Halide knows that does not exceed it): without one,
    Halide generates code for compute capability 2.0. Other strings, and
    machines without a usable GPU, keep the target as written."""
    parts = target.split("-")
    if ("cuda" not in parts or "host" not in parts
            or any(p.startswith("cuda_capability") for p in parts) or not available()):
        return target
    major, minor = capability()
    have = [c for c in HALIDE_CAPABILITIES if c <= 10 * major + minor]
    return target + (f"-cuda_capability_{have[-1]}" if have else "")


def synchronize() -> None:
    driver().call("cuCtxSynchronize")


class Stream:
    """A CUDA stream of device 0's primary context that does not wait for
    the legacy default stream (CU_STREAM_NON_BLOCKING): work queued on two
    such streams may run at once. after(other) orders it after the work
    queued so far on `other` (a Stream, or None: the legacy stream)."""

    def __init__(self):
        self.handle = None
        h = _P()
        driver().call("cuStreamCreate", ctypes.byref(h), 1)
        self.handle = h.value

    def after(self, other: "Stream | None") -> None:
        _wait(self.handle, other.handle if other else None)

    def __del__(self):
        if _driver is not None and self.handle:
            _driver.lib.cuStreamDestroy_v2(_P(self.handle))


_on = threading.local()      # .stream: this thread's stream for fills and copies


class on_stream:
    """A context in which this thread's array fills and device copies
    (DeviceArray.zero_, copy_2d) are queued on stream `handle` (None: the
    legacy stream, as outside), as a library call on that stream is, and
    its allocations take blocks as lanes_open says: a wavefront's lane
    (halstm.wavefront)."""

    def __init__(self, handle: int | None):
        self.handle = handle

    def __enter__(self):
        self.before = lane_stream()
        _on.stream = self.handle

    def __exit__(self, *exc):
        _on.stream = self.before


def lane_stream() -> int | None:
    """The stream of this thread's on_stream context (None: the legacy one)."""
    return getattr(_on, "stream", None)


def legacy_after(streams) -> None:
    """Order the legacy default stream after the work queued on `streams`."""
    for s in streams:
        _wait(None, s.handle)


def _wait(waiter, on) -> None:
    """Stream `waiter` waits for the work queued so far on stream `on`
    (handles; None: the legacy stream), through an event."""
    d = driver()
    ev = _P()
    d.call("cuEventCreate", ctypes.byref(ev), 2)          # CU_EVENT_DISABLE_TIMING
    try:
        d.call("cuEventRecord", ev, _P(on))
        d.call("cuStreamWaitEvent", _P(waiter), ev, 0)
    finally:
        d.lib.cuEventDestroy_v2(ev)     # (released once the wait is done)


def mem_info() -> tuple[int, int]:
    """(free, total) bytes of device memory."""
    free, total = _SZ(), _SZ()
    driver().call("cuMemGetInfo_v2", ctypes.byref(free), ctypes.byref(total))
    return free.value, total.value


class _Pool:
    """Device memory blocks kept for reuse, by size (rounded up to 512
    bytes; 2 MiB above 1 MiB), as PyTorch's caching allocator does:
    cuMemFree waits for the whole device and cuMemAlloc costs tens of
    microseconds, and every forward call allocates its states and
    workspaces. A block returns to the pool when its last array goes away;
    an allocation that fails empties the pool and tries once more. Of the
    free blocks of a size, the one at the lowest address is taken, so that
    a loop of calls at one shape gets the same few pointers back in a short
    cycle (a last-in-first-out pool permuted them): the CUDA graphs of the
    time loops are cached under their pointers."""

    def __init__(self):
        self.free: dict[int, list[tuple[int, int]]] = {}   # size -> [(ptr, epoch freed)]
        self.epoch = 0                  # wavefronts begun (lanes_open)
        self.lock = threading.Lock()

    @staticmethod
    def size(nbytes: int) -> int:
        step = 2 << 20 if nbytes > 1 << 20 else 512
        return max(-(-int(nbytes) // step) * step, step)

    def take(self, nbytes: int, before: int | None = None) -> int:
        """A block of nbytes; before: one freed before that epoch only."""
        size = self.size(nbytes)
        with self.lock:
            blocks = self.free.get(size)
            fit = [b for b in blocks or () if before is None or b[1] < before]
            if fit:
                blocks.remove(block := min(fit))
                return block[0]
        ptr = _U64()
        try:
            driver().call("cuMemAlloc_v2", ctypes.byref(ptr), size)
        except CudaError:
            self.release()
            driver().call("cuMemAlloc_v2", ctypes.byref(ptr), size)
        return ptr.value

    def give(self, ptr: int, nbytes: int) -> None:
        with self.lock:
            self.free.setdefault(self.size(nbytes), []).append((ptr, self.epoch))

    def next_epoch(self) -> int:
        with self.lock:
            self.epoch += 1
            return self.epoch

    def release(self, free=None) -> None:
        """Free every cached block (they are unused); free(ptr) frees one
        (default: cuMemFree in device 0's primary context). A block whose
        free fails stays cached."""
        free = free or (lambda p: driver().call("cuMemFree_v2", _U64(p)))
        with self.lock:
            blocks = [(size, b) for size, bs in self.free.items() for b in bs]
            self.free.clear()
        kept = []
        for size, b in blocks:
            try:
                free(b[0])
            except CudaError:   # (a broken context at exit)
                kept.append((size, b))
        with self.lock:
            for size, b in kept:
                self.free.setdefault(size, []).append(b)


_pool = _Pool()
empty_cache = _pool.release


def _release_in_a_call() -> None:
    """The pool's release from a library's hook, on a thread whose current
    context is whatever its caller's is: device 0's primary context pushed
    for the frees, then popped (the thread's context as it was)."""
    d = driver()
    d.check(d.lib.cuCtxPushCurrent_v2(_P(d.context)), "cuCtxPushCurrent")
    try:
        _pool.release(lambda p: d.check(d.lib.cuMemFree_v2(_U64(p)), "cuMemFree"))
    finally:
        d.lib.cuCtxPopCurrent_v2(ctypes.byref(_P()))


_oom_callbacks = [_release_in_a_call]


def on_out_of_memory(fn) -> None:
    """fn() runs, with this pool's release, where a library's own device
    allocation (cuBLAS's workspace, its buffers) finds no memory, before
    the library tries once more: an allocator that caches blocks gives them
    back (halstm.torch: torch.cuda.empty_cache). It runs inside the
    library's call and must not call a halstm library."""
    _oom_callbacks.append(fn)


@ctypes.CFUNCTYPE(None)
def oom_hook() -> None:
    """The libraries' hook (halstm_cuda_set_oom_hook): every callback."""
    for fn in _oom_callbacks:
        try:
            fn()
        except Exception:   # (a callback's failure leaves the retry to fail alone)
            pass


class _Allocation:
    """One pooled device block, returned when the last array viewing it goes away."""

    def __init__(self, nbytes: int):
        lane = lane_stream() is not None
        self.ptr = _pool.take(nbytes, getattr(_on, "epoch", None) if lane else None)
        self.nbytes = nbytes

    def __del__(self):
        # (not weakref.finalize: a forward makes several arrays, and its
        # bookkeeping cost about 3 us each, before the kernels could start)
        try:
            held = getattr(_on, "held", None)
            if held is not None:       # (freed while lanes may still use it: lanes_open)
                held.append((self.ptr, self.nbytes))
            else:
                _pool.give(self.ptr, self.nbytes)
        except Exception:      # interpreter shutdown: the pool may be gone already
            pass


def lanes_open() -> None:
    """A wavefront begins on this thread (halstm.wavefront.Lanes.open),
    before its lanes wait for the legacy stream. The pool is ordered by the
    legacy stream alone, so until lanes_close() the blocks this thread
    frees stay out of it (a lane may still use them: a library call's
    temporary), and an allocation inside a lane (on_stream) takes only a
    block freed before this call, whose uses on the legacy stream, by any
    thread, the lanes wait for. (A wavefront's peak memory holds those
    temporaries.)"""
    _on.held = []
    _on.epoch = _pool.next_epoch()


def lanes_close(waited: bool) -> None:
    """The wavefront ends: the blocks held since lanes_open() go back to the
    pool once the legacy stream waits for the lanes (waited); else (a
    failed wait) they are dropped."""
    held, _on.held, _on.epoch = getattr(_on, "held", None) or [], None, None
    for ptr, nbytes in held if waited else ():
        _pool.give(ptr, nbytes)


class DeviceArray:
    """A C-contiguous float32 array in GPU memory.

    Supports what halstm needs and a user expects to pass around: shape,
    indexing and slicing along the first axis (views), reshape, copy,
    assignment from numpy or device arrays, .numpy() (a host copy), and
    DLPack both ways (halstm.cuda.asarray(obj) takes any CUDA DLPack array;
    torch.from_dlpack(a) / cupy.from_dlpack(a) take this one)."""

    dtype = np.dtype(np.float32)

    def __init__(self, ptr: int, shape, owner):
        self.ptr, self.shape, self._owner = int(ptr), tuple(int(s) for s in shape), owner
        self.size = math.prod(self.shape)

    # ---- creation ---------------------------------------------------------
    @classmethod
    def empty(cls, shape) -> "DeviceArray":
        shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
        alloc = _Allocation(4 * math.prod(int(s) for s in shape))
        return cls(alloc.ptr, shape, alloc)

    @classmethod
    def zeros(cls, shape) -> "DeviceArray":
        return cls.empty(shape).zero_()

    def zero_(self) -> "DeviceArray":
        """Fill with zeros, in place; returns self."""
        stream = lane_stream()
        if self.size and stream is None:
            driver().call("cuMemsetD8_v2", _U64(self.ptr), 0, self.nbytes)
        elif self.size:
            driver().call("cuMemsetD8Async", _U64(self.ptr), 0, self.nbytes, _P(stream))
        return self

    @classmethod
    def from_numpy(cls, a) -> "DeviceArray":
        a = np.ascontiguousarray(a, dtype=np.float32)
        d = cls.empty(a.shape)
        driver().call("cuMemcpyHtoD_v2", _U64(d.ptr), a.ctypes.data, a.nbytes)
        return d

    # ---- numpy-like surface -----------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return 4 * self.size

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"DeviceArray(shape={self.shape}, dtype=float32, ptr=0x{self.ptr:x})"

    def numpy(self) -> np.ndarray:
        out = np.empty(self.shape, np.float32)
        if out.nbytes:
            driver().call("cuMemcpyDtoH_v2", out.ctypes.data, _U64(self.ptr), out.nbytes)
        return out

    def __array__(self, dtype=None, copy=None):
        a = self.numpy()
        return a if dtype is None else a.astype(dtype)

    def reshape(self, *shape) -> "DeviceArray":
        shape = shape[0] if len(shape) == 1 and not isinstance(shape[0], int) else shape
        shape = list(shape)
        if shape.count(-1) == 1:
            rest = math.prod(s for s in shape if s != -1)
            shape[shape.index(-1)] = self.size // max(rest, 1)
        if math.prod(shape) != self.size:
            raise ValueError(f"reshape: cannot view {self.shape} as {tuple(shape)}")
        return DeviceArray(self.ptr, shape, self)

    def _rows(self, key) -> tuple[int, int]:
        """(first, count) of the rows along axis 0 that key selects."""
        n = self.shape[0]
        if isinstance(key, (int, np.integer)):
            i = int(key) + (n if key < 0 else 0)
            if not 0 <= i < n:
                raise IndexError(f"index {key} is out of bounds for axis 0 with size {n}")
            return i, 1
        if isinstance(key, slice):
            start, stop, step = key.indices(n)
            if step != 1:
                raise IndexError("DeviceArray supports only contiguous slices (step 1)")
            return start, max(stop - start, 0)
        raise IndexError(f"DeviceArray supports an int or a slice on axis 0, got {key!r}")

    def __getitem__(self, key) -> "DeviceArray":
        first, count = self._rows(key)
        row = self.nbytes // max(self.shape[0], 1)
        shape = self.shape[1:] if isinstance(key, (int, np.integer)) else (count,) + self.shape[1:]
        return DeviceArray(self.ptr + first * row, shape, self)

    def __setitem__(self, key, value) -> None:
        self[key].copy_from(value)

    def copy_from(self, src) -> None:
        """Overwrite with src (numpy array, DeviceArray or CUDA DLPack array)
        of this shape."""
        if not isinstance(src, DeviceArray) and not _is_cuda_dlpack(src):
            src = np.ascontiguousarray(src, dtype=np.float32)
            if src.shape != self.shape:
                raise ValueError(f"copy: expected shape {self.shape}, got {src.shape}")
            driver().call("cuMemcpyHtoD_v2", _U64(self.ptr), src.ctypes.data, src.nbytes)
            return
        src = asarray(src)
        if src.shape != self.shape:
            raise ValueError(f"copy: expected shape {self.shape}, got {src.shape}")
        if self.nbytes:
            driver().call("cuMemcpyDtoD_v2", _U64(self.ptr), _U64(src.ptr), self.nbytes)

    def copy(self) -> "DeviceArray":
        out = DeviceArray.empty(self.shape)
        out.copy_from(self)
        return out

    # ---- DLPack export ----------------------------------------------------
    def __dlpack_device__(self):
        return (_KDL_CUDA, 0)

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        return _export(self)


class IntArray:
    """C-contiguous int32 values (class indices) copied to GPU memory, for
    the kernels that take them; DeviceArray holds float32 only."""

    dtype = np.dtype(np.int32)

    def __init__(self, a):
        a = np.ascontiguousarray(a, dtype=np.int32)
        self.shape = a.shape
        self._alloc = _Allocation(max(a.nbytes, 4))
        self.ptr = self._alloc.ptr
        driver().call("cuMemcpyHtoD_v2", _U64(self.ptr), a.ctypes.data, a.nbytes)


def empty(shape) -> DeviceArray:
    return DeviceArray.empty(shape)


def zeros(shape) -> DeviceArray:
    return DeviceArray.zeros(shape)


def copy_2d(dst: DeviceArray, dst_pitch: int, src: DeviceArray, src_pitch: int,
            width: int, height: int, dst_offset: int = 0, src_offset: int = 0) -> None:
    """Copy `height` rows of `width` floats between strided device layouts
    (pitches and offsets in floats)."""
    if width == 0 or height == 0:
        return
    m = _Memcpy2D(srcMemoryType=2, srcDevice=src.ptr + 4 * src_offset, srcPitch=4 * src_pitch,
                  dstMemoryType=2, dstDevice=dst.ptr + 4 * dst_offset, dstPitch=4 * dst_pitch,
                  WidthInBytes=4 * width, Height=height)
    stream = lane_stream()
    if stream is None:
        driver().call("cuMemcpy2D_v2", ctypes.byref(m))
    else:
        driver().call("cuMemcpy2DAsync_v2", ctypes.byref(m), _P(stream))


class _Memcpy2D(ctypes.Structure):
    _fields_ = [("srcXInBytes", _SZ), ("srcY", _SZ), ("srcMemoryType", _I), ("srcHost", _P),
                ("srcDevice", _U64), ("srcArray", _P), ("srcPitch", _SZ),
                ("dstXInBytes", _SZ), ("dstY", _SZ), ("dstMemoryType", _I), ("dstHost", _P),
                ("dstDevice", _U64), ("dstArray", _P), ("dstPitch", _SZ),
                ("WidthInBytes", _SZ), ("Height", _SZ)]


# ---- DLPack (https://dmlc.github.io/dlpack/latest/c_api.html) -------------
_KDL_CUDA, _KDL_CUDA_MANAGED, _KDL_FLOAT = 2, 13, 2


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", _I), ("device_id", _I)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", _P), ("device", _DLDevice), ("ndim", _I), ("dtype", _DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", _U64)]


_Deleter = ctypes.CFUNCTYPE(None, _P)


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", _P), ("deleter", _Deleter)]


_api = ctypes.pythonapi
_api.PyCapsule_GetPointer.restype = _P
_api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_New.restype = ctypes.py_object
_api.PyCapsule_New.argtypes = [_P, ctypes.c_char_p, _P]
_api.PyCapsule_IsValid.restype = _I
_api.PyCapsule_IsValid.argtypes = [ctypes.py_object, ctypes.c_char_p]


def _is_cuda_dlpack(obj) -> bool:
    try:
        return obj.__dlpack_device__()[0] in (_KDL_CUDA, _KDL_CUDA_MANAGED)
    except (AttributeError, TypeError, ValueError):
        return False


def asarray(obj) -> DeviceArray:
    """obj as a DeviceArray: a DeviceArray itself, a view of a CUDA DLPack
    array (CuPy, a PyTorch CUDA tensor; C-contiguous float32 on device 0;
    the source is kept alive), or an upload of anything numpy takes."""
    if isinstance(obj, DeviceArray):
        return obj
    if not _is_cuda_dlpack(obj):
        return DeviceArray.from_numpy(obj)
    capsule = obj.__dlpack__()
    if not _api.PyCapsule_IsValid(capsule, b"dltensor"):
        raise TypeError(f"{type(obj).__name__}.__dlpack__ returned no usable 'dltensor' capsule")
    t = _DLManagedTensor.from_address(_api.PyCapsule_GetPointer(capsule, b"dltensor")).dl_tensor
    shape = tuple(t.shape[d] for d in range(t.ndim))
    what = type(obj).__name__
    if (t.dtype.code, t.dtype.bits, t.dtype.lanes) != (_KDL_FLOAT, 32, 1):
        raise TypeError(f"{what}: expected float32, got DLPack dtype code {t.dtype.code}, "
                        f"{t.dtype.bits} bits")
    if t.device.device_id != 0:
        raise ValueError(f"{what}: expected an array on CUDA device 0, got device "
                         f"{t.device.device_id}")
    if t.strides:
        dense, stride = True, 1
        for d in reversed(range(t.ndim)):
            if shape[d] != 1 and t.strides[d] != stride:
                dense = False
            stride *= shape[d]
        if not dense:
            raise ValueError(f"{what}: expected a C-contiguous array, got strides "
                             f"{tuple(t.strides[d] for d in range(t.ndim))} for shape {shape}")
    return DeviceArray((t.data or 0) + t.byte_offset, shape, (obj, capsule))


_exported: dict[int, tuple] = {}   # DLManagedTensor address -> what keeps it valid


@_Deleter
def _release(managed: int) -> None:
    _exported.pop(managed, None)


def _export(a: DeviceArray):
    """A 'dltensor' capsule viewing a; the consumer's deleter call releases it."""
    shape = (ctypes.c_int64 * max(a.ndim, 1))(*a.shape)
    m = _DLManagedTensor()
    m.dl_tensor = _DLTensor(data=a.ptr, device=_DLDevice(_KDL_CUDA, 0), ndim=a.ndim,
                            dtype=_DLDataType(_KDL_FLOAT, 32, 1), shape=shape, strides=None,
                            byte_offset=0)
    m.deleter = _release
    addr = ctypes.addressof(m)
    _exported[addr] = (m, shape, a)
    return _api.PyCapsule_New(addr, b"dltensor", None)
