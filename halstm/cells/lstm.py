"""LSTM cell with PyTorch's semantics: gates i, f, g, o.

    i, f, o = sigmoid(pre_i), sigmoid(pre_f), sigmoid(pre_o); g = tanh(pre_g)
    c' = f * c + i * g;  h' = o * tanh(c')      with pre = W_ih x + b_ih + W_hh h + b_hh
"""
from .language import define, sigmoid, tanh


def step(x, r, s):
    i, f = sigmoid(x.i + r.i), sigmoid(x.f + r.f)
    g, o = tanh(x.g + r.g), sigmoid(x.o + r.o)
    c = f * s.c + i * g
    return {"h": o * tanh(c), "c": c}


CELL = define("lstm", gates="ifgo", states=("h", "c"), step=step,
              doc="LSTM cell with PyTorch's semantics: gates i, f, g, o")
