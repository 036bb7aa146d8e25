"""LSTM with coupled input and forget gates (CIFG): gate blocks f, g, o.

    f, o = sigmoid(pre_f), sigmoid(pre_o); g = tanh(pre_g); i = 1 - f
    c' = f * c + i * g;  h' = o * tanh(c')      with pre = W_ih x + b_ih + W_hh h + b_hh
"""
from .language import define, sigmoid, tanh


def step(x, r, s):
    f, g, o = sigmoid(x.f + r.f), tanh(x.g + r.g), sigmoid(x.o + r.o)
    c = f * s.c + (1 - f) * g
    return {"h": o * tanh(c), "c": c}


CELL = define("cifg_lstm", gates="fgo", states=("h", "c"), step=step,
              doc="LSTM with coupled gates: i = 1 - f (gate blocks f, g, o)")
