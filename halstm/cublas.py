"""Vendor GEMMs on CUDA targets: the precision a layer computes in and
where its non-recurrent GEMMs come from.

A layer's input projection (x W_ih^T over all steps) and its gradient
GEMMs (dx, dW_ih, dW_hh) are plain matrix products outside the time loop.
On a CUDA target they run either as Halide kernels (`gemm="halide"`) or,
called by the library's driver, as cuBLAS GEMMs (`gemm="cublas"`); with
cuBLAS, a large batch's step products too (schedules/cuda.py
VENDOR_STEP_MACS), the cell around them in Halide kernels. Halide 21 emits
no tensor-core instructions, so the reduced precisions need cuBLAS:
`precision="tf32"` (operands rounded to TF32 by cuBLAS) and
`precision="bf16"` (operands rounded to bfloat16 copies, which the GEMMs
read), both on tensor cores with fp32 accumulation and fp32 results. The
arrays a layer takes and returns, its states and its cell stay fp32.

cuBLAS is loaded when a library built with it is first loaded, from the
first of: $HALSTM_CUBLAS (a path), the `nvidia-cublas-cu12` wheel that
PyTorch's CUDA builds bring, or `libcublas.so.12` / `libcublas.so` on the
loader's path. No halide import.
"""
from __future__ import annotations

import glob
import importlib.util
import os
from pathlib import Path

# cuBLAS's compute type of each precision (cublasComputeType_t: COMPUTE_32F,
# COMPUTE_32F_FAST_TF32), fp32 C. bf16: the driver rounds A and B to
# bfloat16 copies (pipeline to_bf16) for a COMPUTE_32F GEMM; cuBLAS's
# COMPUTE_32F_FAST_16BF on fp32 operands ran TF32 kernels on an H100
# (bench/RESULTS.md, "Schedule decisions": cublas.COMPUTE_TYPES).
COMPUTE_TYPES = {"fp32": 68, "tf32": 77, "bf16": 68}
PRECISIONS = tuple(COMPUTE_TYPES)
GEMMS = ("halide", "cublas")
_SONAMES = ("libcublas.so.12", "libcublas.so.13", "libcublas.so")


def library() -> str | None:
    """The cuBLAS shared library to load (a path or a soname the loader
    finds), or None where there is none."""
    env = os.environ.get("HALSTM_CUBLAS")
    if env:
        return env
    try:
        spec = importlib.util.find_spec("nvidia.cublas")
    except (ImportError, ValueError):
        spec = None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        found = sorted(glob.glob(str(Path(folder) / "lib" / "libcublas.so.*")))
        if found:
            return found[0]
    import ctypes
    for name in _SONAMES:
        try:
            ctypes.CDLL(name)
            return name
        except OSError:
            continue
    return None


def missing_message() -> str:
    return ("cuBLAS was not found: install PyTorch with CUDA or the nvidia-cublas-cu12 "
            "package, or set HALSTM_CUBLAS to the path of libcublas.so")


def resolve(cuda: bool, precision: str, gemm: str | None) -> str:
    """The GEMM backend of a layer: `gemm` checked against the target and
    the precision, or where None, the default: cuBLAS on a CUDA target
    where the precision needs it or where cuBLAS is found (bench/RESULTS.md,
    "Schedule decisions": cublas.resolve), else Halide."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision: expected one of {PRECISIONS}, got {precision!r}")
    if gemm is not None and gemm not in GEMMS:
        raise ValueError(f"gemm: expected one of {GEMMS} or None, got {gemm!r}")
    if not cuda:
        if precision == "tf32":
            raise ValueError("precision: 'tf32' runs on CUDA targets only (a tensor-core "
                             "mode); CPU targets compute in 'fp32' or, with AMX, 'bf16'")
        if gemm == "cublas":
            raise ValueError("gemm: 'cublas' needs a CUDA target; CPU targets use 'halide'")
        return "halide"
    if precision != "fp32":
        if gemm == "halide":
            raise ValueError(f"gemm: precision {precision!r} needs gemm 'cublas' (Halide 21 "
                             f"emits no tensor-core instructions), got 'halide'")
        return "cublas"
    if gemm is None:
        return "cublas" if library() is not None else "halide"
    return gemm
