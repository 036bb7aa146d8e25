"""halstm: fast recurrent kernels (LSTM, GRU, RNN and cells of your own) for
CPUs and NVIDIA GPUs, generated with Halide."""
from .errors import CacheError, CompileError, KernelError, LibraryError
from .compiled import load
from .nn import GRU, LSTM, RNN, Recurrent, is_grad_enabled, no_grad
from .cells.language import CellError

__version__ = "0.1.0"
__all__ = ["LSTM", "GRU", "RNN", "Recurrent", "CellError", "load", "no_grad", "is_grad_enabled", "CompileError", "KernelError",
           "CacheError", "LibraryError"]
