"""halstm: fast LSTM and GRU kernels for CPUs and NVIDIA GPUs, generated with Halide."""
from .errors import CacheError, CompileError, KernelError, LibraryError
from .compiled import load
from .nn import GRU, LSTM, is_grad_enabled, no_grad

__version__ = "0.1.0"
__all__ = ["LSTM", "GRU", "load", "no_grad", "is_grad_enabled", "CompileError", "KernelError",
           "CacheError", "LibraryError"]
