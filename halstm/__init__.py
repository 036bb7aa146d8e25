"""halstm: fast LSTM and GRU kernels for CPUs and NVIDIA GPUs, generated with Halide."""
from .aot import CompileError
from .compiled import load
from .nn import GRU, LSTM, is_grad_enabled, no_grad
from .runtime import KernelError

__version__ = "0.1.0"
__all__ = ["LSTM", "GRU", "load", "no_grad", "is_grad_enabled", "CompileError", "KernelError"]
