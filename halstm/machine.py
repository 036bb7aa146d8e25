"""Facts about the machine at hand, the ones schedules and benchmarks name:
CPU model, usable cores, cache sizes, and the GPU's name, SM count, shared
memory and driver. Read from the OS and the CUDA driver; no halide import.

    halstm.machine.facts()   # {'cpu': 'AMD EPYC ...', 'cores': 2, 'l2_bytes': ..., 'gpu': ...}
"""
from __future__ import annotations

import ctypes
import os
import platform
from functools import lru_cache
from pathlib import Path


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "Model", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cores() -> int:
    """CPUs this process may run on (its affinity), else the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


# An L2 of this size where sysfs does not say (a common size a core).
L2_BYTES_UNKNOWN = 1 << 20


def l2_bytes() -> int:
    """The L2 (data or unified) cache of CPU 0, bytes (Linux sysfs), else
    L2_BYTES_UNKNOWN."""
    return _caches().get("l2_bytes", L2_BYTES_UNKNOWN)


def _size(text: str) -> int | None:
    text = text.strip().upper()
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    try:
        return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)
    except (ValueError, IndexError):
        return None


def _caches() -> dict:
    """Data/unified cache sizes of CPU 0 by level, bytes (Linux sysfs)."""
    out = {}
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            if (index / "type").read_text().strip() == "Instruction":
                continue
            level = int((index / "level").read_text())
            size = _size((index / "size").read_text())
        except (OSError, ValueError):
            continue
        if size:
            out[f"l{level}_bytes"] = size
    return out


@lru_cache(maxsize=None)
def _gpu() -> dict:
    """Device 0 of the CUDA driver, or {} without one."""
    from . import cuda
    if not cuda.available():
        return {}
    d = cuda.driver()
    attribute = d.attribute

    version = ctypes.c_int()
    d.check(d.lib.cuDriverGetVersion(ctypes.byref(version)), "cuDriverGetVersion")
    major, minor = cuda.capability()
    return {"gpu": d.name, "gpu_capability": f"{major}.{minor}",
            "gpu_sms": attribute(16),                    # CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
            "gpu_shared_bytes_per_block": attribute(97),  # ..._MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
            "gpu_shared_bytes_per_sm": attribute(81),     # ..._MAX_SHARED_MEMORY_PER_MULTIPROCESSOR
            "cuda_driver": f"{version.value // 1000}.{version.value % 1000 // 10}"}


# SMs and shared memory a block may have, assumed for a CUDA build where
# no GPU is at hand (an H100's)
SMS_WITHOUT_GPU = 132
BLOCK_SHARED_BYTES_WITHOUT_GPU = 227 << 10


def gpu_sms() -> int:
    """The multiprocessors of the CUDA GPU at hand, else SMS_WITHOUT_GPU:
    what a CUDA build is shaped for (a cache key of such a build holds it)."""
    return _gpu().get("gpu_sms", SMS_WITHOUT_GPU)


def gpu_block_shared_bytes() -> int:
    """The shared memory one block may have on the CUDA GPU at hand (past
    the 48 KiB a kernel gets without opting in; the driver opts in), else
    BLOCK_SHARED_BYTES_WITHOUT_GPU; a cache key of a build shaped by it
    holds it."""
    return _gpu().get("gpu_shared_bytes_per_block", BLOCK_SHARED_BYTES_WITHOUT_GPU)


@lru_cache(maxsize=None)
def facts() -> dict:
    """What this machine is, as JSON data."""
    return {"cpu": _cpu_model(), "cores": cores(), **_caches(), "arch": platform.machine(),
            "python": platform.python_version(), **_gpu()}


def summary() -> str:
    """facts() in one line, for the head of a report."""
    f = facts()
    cpu = f"{f['cpu']}, {f['cores']} cores"
    if "l2_bytes" in f:
        cpu += f", L2 {f['l2_bytes'] >> 10} KiB"
    if "l3_bytes" in f:
        cpu += f", L3 {f['l3_bytes'] >> 20} MiB"
    gpu = (f"; {f['gpu']} ({f['gpu_sms']} SMs, capability {f['gpu_capability']}, "
           f"CUDA driver {f['cuda_driver']})" if "gpu" in f else "; no CUDA GPU")
    return cpu + gpu
