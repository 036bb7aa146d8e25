"""sLSTM, the scalar-memory LSTM of xLSTM (Beck et al. 2024), with one head
(dense W_hh) and a sigmoid forget gate, in the log-space stabilised form:

    log_f = log(sigmoid(f~));  m' = max(log_f + m, i~)
    i = exp(i~ - m');  f = exp(log_f + m - m')
    c' = f * c + i * tanh(z~);  n' = f * n + i;  h' = sigmoid(o~) * c' / n'

x~ = W_ih x + b_ih + W_hh h + b_hh per gate, gate order i, f, z, o. The
states c and n are kept scaled by exp(-m), so h' does not depend on the
stabiliser m; with the zero initial states n' is i > 0 from the first
step. (xLSTM's reference code sets m' = i~ where n is 0; h' and c' / n'
are the same either way, c', n' and m' themselves differ by that scale.)
"""
from .language import define, exp, maximum, sigmoid, softplus, tanh


def step(x, r, s):
    i_pre = x.i + r.i
    log_f = -softplus(-(x.f + r.f))
    m = maximum(log_f + s.m, i_pre)
    i = exp(i_pre - m)
    f = exp(log_f + s.m - m)
    c = f * s.c + i * tanh(x.z + r.z)
    n = f * s.n + i
    return {"h": sigmoid(x.o + r.o) * (c / n), "c": c, "n": n, "m": m}


CELL = define("slstm", gates="ifzo", states=("h", "c", "n", "m"), step=step,
              doc="sLSTM of xLSTM: exponential input gate, normaliser n, stabiliser m")
