"""GRU cell with PyTorch's semantics: gates r, z, n.

    r = sigmoid(xp_r + hg_r); z = sigmoid(xp_z + hg_z)
    n = tanh(xp_n + r * hg_n)          (hg_n = W_hn h + b_hn)
    h' = (1 - z) * n + z * h
"""
import halide as hl

from .base import Cell, gate_func, sigmoid, tanh


class GRUCell(Cell):
    name = "gru"
    gates = ("r", "z", "n")
    states = ("h",)
    saved = ("r", "z", "n", "hn")  # activations, and hg_n which backward needs

    def forward(self, xp, hg, prev, j, b):
        r = sigmoid(xp[j, 0, b] + hg[j, 0, b])
        z = sigmoid(xp[j, 1, b] + hg[j, 1, b])
        n = tanh(xp[j, 2, b] + r * hg[j, 2, b])
        saved = gate_func("gru_saved", [r, z, n, hg[j, 2, b]], j, b)
        h = hl.Func("gru_h")
        z_, n_ = saved[j, 1, b], saved[j, 2, b]
        h[j, b] = (1 - z_) * n_ + z_ * prev["h"][j, b]
        return saved, {"h": h}

    def backward(self, saved, prev, new, dnew, j, b):
        r, z, n, hn = (saved[j, k, b] for k in range(4))
        dh = dnew["h"][j, b]
        dn = hl.Func("gru_dn")                        # dL/d(pre-activation of n)
        dn[j, b] = dh * (1 - z) * (1 - n * n)
        dr = dn[j, b] * hn * r * (1 - r)
        dz = dh * (prev["h"][j, b] - n) * z * (1 - z)
        dxp = gate_func("gru_dxp", [dr, dz, dn[j, b]], j, b)
        dhg = gate_func("gru_dhg", [dr, dz, dn[j, b] * r], j, b)
        dh_prev = hl.Func("gru_dh_prev_pointwise")
        dh_prev[j, b] = dh * z
        return dxp, dhg, {"h": dh_prev}
