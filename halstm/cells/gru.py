"""GRU cell with PyTorch's semantics: gates r, z, n.

    r = sigmoid(xp_r + hg_r); z = sigmoid(xp_z + hg_z)
    n = tanh(xp_n + r * hg_n)          (hg_n = W_hn h + b_hn)
    h' = (1 - z) * n + z * h
"""
from .language import define, sigmoid, tanh


def step(x, r, s):
    reset, z = sigmoid(x.r + r.r), sigmoid(x.z + r.z)
    n = tanh(x.n + reset * r.n)
    return {"h": (1 - z) * n + z * s.h}


CELL = define("gru", gates="rzn", states="h", step=step,
              doc="GRU cell with PyTorch's semantics: gates r, z, n")
