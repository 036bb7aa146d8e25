"""halstm: fast LSTM and GRU kernels for CPUs and NVIDIA GPUs, generated with Halide."""
from .aot import CompileError
from .compiled import load
from .nn import GRU, LSTM
from .runtime import KernelError

__version__ = "0.1.0"
__all__ = ["LSTM", "GRU", "load", "CompileError", "KernelError"]
