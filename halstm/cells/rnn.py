"""Elman RNN with torch.nn.RNN's semantics: one gate block.

    h' = tanh(W_ih x + b_ih + W_hh h + b_hh)      (nonlinearity="tanh")
    h' = relu(W_ih x + b_ih + W_hh h + b_hh)      (nonlinearity="relu")
"""
from .language import define, relu, tanh

TANH = define("rnn_tanh", gates="h", states="h", step=lambda x, r, s: {"h": tanh(x.h + r.h)},
              doc="Elman RNN, h' = tanh(W_ih x + b_ih + W_hh h + b_hh)")
RELU = define("rnn_relu", gates="h", states="h", step=lambda x, r, s: {"h": relu(x.h + r.h)},
              doc="Elman RNN, h' = relu(W_ih x + b_ih + W_hh h + b_hh)")
