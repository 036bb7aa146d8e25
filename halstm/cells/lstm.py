"""LSTM cell with PyTorch's semantics: gates i, f, g, o.

    i, f, o = sigmoid(pre_i), sigmoid(pre_f), sigmoid(pre_o); g = tanh(pre_g)
    c' = f * c + i * g;  h' = o * tanh(c')      with pre = xp + hg
"""
import halide as hl

from .base import Cell, gate_func, sigmoid, tanh


class LSTMCell(Cell):
    name = "lstm"
    gates = ("i", "f", "g", "o")
    states = ("h", "c")
    saved = ("i", "f", "g", "o")  # the activated gates
    dxp_is_dhg = True

    def forward(self, xp, hg, prev, j, b):
        def pre(k):
            return xp[j, k, b] + hg[j, k, b]

        act = gate_func("lstm_act", [sigmoid(pre(0)), sigmoid(pre(1)),
                                     tanh(pre(2)), sigmoid(pre(3))], j, b)
        c = hl.Func("lstm_c")
        c[j, b] = act[j, 1, b] * prev["c"][j, b] + act[j, 0, b] * act[j, 2, b]
        h = hl.Func("lstm_h")
        h[j, b] = act[j, 3, b] * tanh(c[j, b])
        return act, {"h": h, "c": c}

    def backward(self, saved, prev, new, dnew, j, b):
        i, f, g, o = (saved[j, k, b] for k in range(4))
        tc = tanh(new["c"][j, b])
        dh = dnew["h"][j, b]
        dc = hl.Func("lstm_dc")                       # total dL/dc_t
        dc[j, b] = dnew["c"][j, b] + dh * o * (1 - tc * tc)
        d = dc[j, b]
        dpre = gate_func("lstm_dpre", [d * g * i * (1 - i),
                                       d * prev["c"][j, b] * f * (1 - f),
                                       d * i * (1 - g * g),
                                       dh * tc * o * (1 - o)], j, b)
        dc_prev = hl.Func("lstm_dc_prev")
        dc_prev[j, b] = d * f
        return dpre, dpre, {"h": None, "c": dc_prev}
