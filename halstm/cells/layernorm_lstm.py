"""Layer-normalized LSTM (Ba et al. 2016), as Haste's LayerNormLSTM.

    pre = LN(W_ih x) * g_ih + LN(W_hh h) * g_hh + b    (LN over all 4H values)
    c' = sigmoid(f) * c + sigmoid(i) * tanh(g);  h' = sigmoid(o) * tanh(LN(c') * g_c + b_c)
    LN(v) = (v - mean) / sqrt(var + 1e-5), the biased variance; gains start
    at 1, shifts at 0; no bias_ih / bias_hh (bias_l{k} (4H) instead)
"""
from .language import define, layer_norm, sigmoid, tanh, vector


def step(x, r, s, p):
    gates = "ifgo"
    nx = layer_norm(*(x[g] for g in gates))
    nr = layer_norm(*(r[g] for g in gates))
    pre = {g: nx[k] * p.ln_ih_weight[g] + nr[k] * p.ln_hh_weight[g] + p.bias[g]
           for k, g in enumerate(gates)}
    c = sigmoid(pre["f"]) * s.c + sigmoid(pre["i"]) * tanh(pre["g"])
    h = sigmoid(pre["o"]) * tanh(layer_norm(c) * p.ln_c_weight + p.ln_c_bias)
    return {"h": h, "c": c}


CELL = define("layernorm_lstm", gates="ifgo", states=("h", "c"), step=step, matrix_bias=False,
              vectors=[vector("bias", per_gate=True, bias=True),
                       vector("ln_ih_weight", per_gate=True, init=1.0),
                       vector("ln_hh_weight", per_gate=True, init=1.0),
                       vector("ln_c_weight", init=1.0), vector("ln_c_bias")],
              doc="LSTM with layer norm on both products and on c (Ba et al. 2016)")
