"""torch.nn drop-ins running halstm's kernels: LSTM, GRU, RNN and
Recurrent(cell) as torch.nn.Modules with torch.nn's constructor, parameter
names, call and autograd (needs PyTorch: pip install halstm[torch]).

    import halstm.torch as hnn
    lstm = hnn.LSTM(13, 37, num_layers=2, bidirectional=True, dropout=0.1)
    lstm.load_state_dict(torch.nn.LSTM(13, 37, 2, bidirectional=True).state_dict())
    y, (h_n, c_n) = lstm(x)                  # x (T, B, 13) float32, CPU or CUDA
    y.sum().backward()                       # gradients into lstm's parameters

Each layer and direction is one call of a compiled layer: eagerly through a
torch.autograd.Function, under torch.compile as the custom operator
halstm::layer (backward: halstm::layer_backward), so torch.compile(
fullgraph=True) traces through it. Tensors go to the kernels
in place: CPU tensors to the host build, CUDA tensors (device 0) to the
CUDA build, on torch's current stream, with every array from torch's
allocator. Packed sequences run inside the kernels: step t runs only the
sequences longer than t.

Inside: kernels (the compiled layers by what they are compiled for, and
tensors as their arrays), layer (one layer as operators), stack (a CUDA
stack's wavefront), directions (a bidirectional layer's two at once),
modules (LSTM, GRU, RNN, Recurrent), cell_modules (LSTMCell and others).
"""
from .cell_modules import GRUCell, LSTMCell, RecurrentCell, RNNCell
from .kernels import PerformanceWarning
from .modules import GRU, LSTM, RNN, Recurrent

__all__ = ["LSTM", "GRU", "RNN", "Recurrent", "LSTMCell", "GRUCell", "RNNCell",
           "RecurrentCell", "PerformanceWarning"]
