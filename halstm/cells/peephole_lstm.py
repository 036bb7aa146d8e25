"""LSTM with peephole connections (Gers and Schmidhuber): the gates see c.

    i = sigmoid(pre_i + w_ci * c), f = sigmoid(pre_f + w_cf * c), g = tanh(pre_g)
    c' = f * c + i * g;  o = sigmoid(pre_o + w_co * c');  h' = o * tanh(c')
    with pre = W_ih x + b_ih + W_hh h + b_hh; w_ci, w_cf, w_co (H,), zero at first
"""
from .language import define, sigmoid, tanh, vector


def step(x, r, s, p):
    i = sigmoid(x.i + r.i + p.weight_ci * s.c)
    f = sigmoid(x.f + r.f + p.weight_cf * s.c)
    c = f * s.c + i * tanh(x.g + r.g)
    o = sigmoid(x.o + r.o + p.weight_co * c)
    return {"h": o * tanh(c), "c": c}


CELL = define("peephole_lstm", gates="ifgo", states=("h", "c"), step=step,
              vectors=[vector("weight_ci"), vector("weight_cf"), vector("weight_co")],
              doc="LSTM with peephole weights w_ci, w_cf, w_co (H,) on c")
