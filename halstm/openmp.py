"""The OpenMP runtime this process has loaded (PyTorch's): where its
functions lie, so that CPU kernels can run their threads on its team
(runtime.share_openmp) instead of beside it."""
from __future__ import annotations

import ctypes
import os
import re
from pathlib import Path

# The GNU OpenMP ABI's functions the driver calls (threads.h, struct OpenMP);
# libgomp, LLVM's libomp and Intel's libiomp5 all export them.
NAMES = ("GOMP_parallel", "omp_get_thread_num", "omp_get_num_threads", "omp_in_parallel",
         "omp_get_max_threads")
_RUNTIME = re.compile(r"lib(gomp|iomp5|omp)[-.]")


def loaded(prefer: tuple[str, ...] = ()) -> tuple[int, ...] | None:
    """The addresses of NAMES in an OpenMP runtime this process has loaded
    (one under a folder of `prefer` first), or None: none is loaded, or the
    system has no /proc/self/maps (Linux only)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    paths = []
    for line in maps.splitlines():
        fields = line.split(None, 5)   # address, perms, offset, dev, inode, path
        if len(fields) == 6 and _RUNTIME.match(os.path.basename(fields[5])) \
                and fields[5] not in paths:
            paths.append(fields[5])
    paths.sort(key=lambda p: not any(p.startswith(d.rstrip("/") + "/") for d in prefer))
    for path in paths:
        try:   # (RTLD_NOLOAD: the copy already loaded, never a second one)
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            return tuple(ctypes.cast(getattr(lib, n), ctypes.c_void_p).value for n in NAMES)
        except (OSError, AttributeError):
            continue
    return None
