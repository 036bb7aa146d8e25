"""NumPy reference (oracle) for multi-layer LSTM / GRU forward and backward.

Semantics follow torch.nn.LSTM / torch.nn.GRU (unidirectional, sequence-major
input, no dropout, no projections). Everything is computed in the dtype of the
inputs; the tests use float64. BPTT is written out by hand.

Shapes: T time steps, B batch, I input size, H hidden size, L layers.
"""
import re

import numpy as np


def _sigmoid(a):
    # Overflow-free form of 1 / (1 + exp(-a)).
    return 0.5 * (1.0 + np.tanh(0.5 * a))


# ----------------------------------------------------------------------------
# LSTM, one layer.  Gate row blocks of the weights/biases: i, f, g, o.
# ----------------------------------------------------------------------------

def lstm_layer_forward(x, h0, c0, w_ih, w_hh, b_ih, b_hh):
    """x (T, B, I), h0/c0 (B, H). Returns y (T, B, H), h_n (B, H), c_n (B, H), cache."""
    T = x.shape[0]
    H = h0.shape[1]
    hs = [h0]        # hs[t] = h before step t, (B, H)
    cs = [c0]        # cs[t] = c before step t, (B, H)
    gates = []       # activated gates [i, f, g, o] per step, each (B, 4H)
    for t in range(T):
        a = x[t] @ w_ih.T + b_ih + hs[t] @ w_hh.T + b_hh      # (B, 4H)
        i = _sigmoid(a[:, 0 * H:1 * H])
        f = _sigmoid(a[:, 1 * H:2 * H])
        g = np.tanh(a[:, 2 * H:3 * H])
        o = _sigmoid(a[:, 3 * H:4 * H])
        c = f * cs[t] + i * g                                 # (B, H)
        h = o * np.tanh(c)                                    # (B, H)
        gates.append(np.concatenate([i, f, g, o], axis=1))
        hs.append(h)
        cs.append(c)
    y = np.stack(hs[1:])                                      # (T, B, H)
    cache = dict(x=x, hs=hs, cs=cs, gates=gates, w_ih=w_ih, w_hh=w_hh)
    return y, hs[-1], cs[-1], cache


def lstm_layer_backward(dy, dh_n, dc_n, cache):
    """Returns dict with keys dx (T,B,I), dh0, dc0 (B,H), dw_ih, dw_hh, db_ih, db_hh (shapes of the params)."""
    x, hs, cs, gates = cache["x"], cache["hs"], cache["cs"], cache["gates"]
    w_ih, w_hh = cache["w_ih"], cache["w_hh"]
    T, H = x.shape[0], hs[0].shape[1]
    dx = np.zeros_like(x)                                     # (T, B, I)
    dw_ih, dw_hh = np.zeros_like(w_ih), np.zeros_like(w_hh)   # (4H, I), (4H, H)
    db = np.zeros(4 * H, dtype=w_ih.dtype)                    # (4H,)
    dh = dh_n.copy()                                          # (B, H) grad wrt h_t
    dc = dc_n.copy()                                          # (B, H) grad wrt c_t
    for t in reversed(range(T)):
        i, f, g, o = (gates[t][:, k * H:(k + 1) * H] for k in range(4))
        dh = dh + dy[t]
        tc = np.tanh(cs[t + 1])
        dc = dc + dh * o * (1.0 - tc * tc)
        # Gradients wrt the gate pre-activations, (B, 4H).
        da = np.concatenate([
            dc * g * i * (1.0 - i),             # i
            dc * cs[t] * f * (1.0 - f),         # f
            dc * i * (1.0 - g * g),             # g
            dh * tc * o * (1.0 - o),            # o
        ], axis=1)
        dw_ih += da.T @ x[t]
        dw_hh += da.T @ hs[t]
        db += da.sum(axis=0)
        dx[t] = da @ w_ih                                     # (B, I)
        dh = da @ w_hh                                        # (B, H)
        dc = dc * f                                           # (B, H)
    return dict(dx=dx, dh0=dh, dc0=dc, dw_ih=dw_ih, dw_hh=dw_hh,
                db_ih=db, db_hh=db.copy())


# ----------------------------------------------------------------------------
# GRU, one layer.  Gate row blocks: r, z, n.
# ----------------------------------------------------------------------------

def gru_layer_forward(x, h0, w_ih, w_hh, b_ih, b_hh):
    """x (T, B, I), h0 (B, H). Returns y (T, B, H), h_n (B, H), cache."""
    T = x.shape[0]
    H = h0.shape[1]
    hs = [h0]        # hs[t] = h before step t, (B, H)
    steps = []       # (r, z, n, hn) per step, each (B, H); hn = W_hn h + b_hn
    for t in range(T):
        gi = x[t] @ w_ih.T + b_ih                             # (B, 3H)
        gh = hs[t] @ w_hh.T + b_hh                            # (B, 3H)
        r = _sigmoid(gi[:, :H] + gh[:, :H])
        z = _sigmoid(gi[:, H:2 * H] + gh[:, H:2 * H])
        hn = gh[:, 2 * H:]
        n = np.tanh(gi[:, 2 * H:] + r * hn)
        hs.append((1.0 - z) * n + z * hs[t])
        steps.append((r, z, n, hn))
    y = np.stack(hs[1:])                                      # (T, B, H)
    cache = dict(x=x, hs=hs, steps=steps, w_ih=w_ih, w_hh=w_hh)
    return y, hs[-1], cache


def gru_layer_backward(dy, dh_n, cache):
    """Returns dict with keys dx (T,B,I), dh0 (B,H), dw_ih, dw_hh, db_ih, db_hh (shapes of the params)."""
    x, hs, steps = cache["x"], cache["hs"], cache["steps"]
    w_ih, w_hh = cache["w_ih"], cache["w_hh"]
    T = x.shape[0]
    dx = np.zeros_like(x)                                     # (T, B, I)
    dw_ih, dw_hh = np.zeros_like(w_ih), np.zeros_like(w_hh)   # (3H, I), (3H, H)
    db_ih = np.zeros(w_ih.shape[0], dtype=w_ih.dtype)         # (3H,)
    db_hh = np.zeros(w_hh.shape[0], dtype=w_hh.dtype)         # (3H,)
    dh = dh_n.copy()                                          # (B, H) grad wrt h_t
    for t in reversed(range(T)):
        r, z, n, hn = steps[t]
        dh = dh + dy[t]
        dan = dh * (1.0 - z) * (1.0 - n * n)                  # wrt n pre-activation
        daz = dh * (hs[t] - n) * z * (1.0 - z)                # wrt z pre-activation
        dar = dan * hn * r * (1.0 - r)                        # wrt r pre-activation
        dgi = np.concatenate([dar, daz, dan], axis=1)         # (B, 3H)
        dgh = np.concatenate([dar, daz, dan * r], axis=1)     # (B, 3H)
        dw_ih += dgi.T @ x[t]
        dw_hh += dgh.T @ hs[t]
        db_ih += dgi.sum(axis=0)
        db_hh += dgh.sum(axis=0)
        dx[t] = dgi @ w_ih                                    # (B, I)
        dh = dh * z + dgh @ w_hh                              # (B, H)
    return dict(dx=dx, dh0=dh, dw_ih=dw_ih, dw_hh=dw_hh, db_ih=db_ih, db_hh=db_hh)


# ----------------------------------------------------------------------------
# Multi-layer stacks with PyTorch state_dict parameter names.
# ----------------------------------------------------------------------------

def _num_layers(params):
    layers = [int(m.group(1)) for k in params
              if (m := re.fullmatch(r"weight_ih_l(\d+)", k))]
    if sorted(layers) != list(range(len(layers))) or not layers:
        raise ValueError(f"bad layer keys in params: {sorted(params)}")
    return len(layers)


def _layer_params(params, k):
    w_ih, w_hh = params[f"weight_ih_l{k}"], params[f"weight_hh_l{k}"]
    zeros = np.zeros(w_ih.shape[0], dtype=w_ih.dtype)
    return (w_ih, w_hh, params.get(f"bias_ih_l{k}", zeros),
            params.get(f"bias_hh_l{k}", zeros))


class NumpyOps:
    """The operations of halstm.cells.language for numpy arrays."""
    sigmoid = staticmethod(_sigmoid)
    tanh = staticmethod(np.tanh)
    relu = staticmethod(lambda a: np.maximum(a, 0.0))
    exp, sqrt, log = staticmethod(np.exp), staticmethod(np.sqrt), staticmethod(np.log)
    softplus = staticmethod(lambda a: np.logaddexp(0.0, a))
    maximum, minimum = staticmethod(np.maximum), staticmethod(np.minimum)
    mean_units = staticmethod(lambda a: a.mean(axis=1, keepdims=True))


def torch_ops(torch):
    """The operations of halstm.cells.language for torch tensors."""
    class TorchOps:
        sigmoid, tanh, relu, sqrt = torch.sigmoid, torch.tanh, torch.relu, torch.sqrt
        exp, log, maximum, minimum = torch.exp, torch.log, torch.maximum, torch.minimum
        softplus = staticmethod(torch.nn.functional.softplus)   # (x itself past 20)
        mean_units = staticmethod(lambda a: a.mean(dim=1, keepdim=True))
    return TorchOps


def forward(cell, params, x, hx=None):
    """Multi-layer forward; x (T, B, I), hx None (zeros), (h0, c0) for lstm or h0 for gru, each (L, B, H).

    Returns (y, (h_n, c_n), cache) for lstm, (y, h_n, cache) for gru; y (T, B, H), h_n/c_n (L, B, H).
    """
    if cell not in ("lstm", "gru"):
        raise ValueError(f"unknown cell {cell!r}")
    L = _num_layers(params)
    H = params["weight_hh_l0"].shape[1]
    B = x.shape[1]
    if hx is None:
        zeros = np.zeros((L, B, H), dtype=x.dtype)
        hx = (zeros, zeros) if cell == "lstm" else zeros
    h0, c0 = hx if cell == "lstm" else (hx, None)
    layer_caches, h_n, c_n = [], [], []
    inp = x
    for k in range(L):
        p = _layer_params(params, k)
        if cell == "lstm":
            inp, h, c, lc = lstm_layer_forward(inp, h0[k], c0[k], *p)
            c_n.append(c)
        else:
            inp, h, lc = gru_layer_forward(inp, h0[k], *p)
        h_n.append(h)
        layer_caches.append(lc)
    cache = dict(cell=cell, L=L, keys=list(params), layers=layer_caches)
    if cell == "lstm":
        return inp, (np.stack(h_n), np.stack(c_n)), cache
    return inp, np.stack(h_n), cache


def backward(cell, cache, dy, dh_n=None, dc_n=None):
    """Gradients of `forward` given dy (T,B,H) and dh_n/dc_n (L,B,H) or None (zeros).

    Returns a dict: each key of params -> its gradient, plus 'input' (T,B,I),
    'h0' (L,B,H) and, for lstm, 'c0' (L,B,H).
    """
    if cell != cache["cell"]:
        raise ValueError(f"cache is for {cache['cell']!r}, not {cell!r}")
    L = cache["L"]
    B, H = dy.shape[1], dy.shape[2]
    if dh_n is None:
        dh_n = np.zeros((L, B, H), dtype=dy.dtype)
    if cell == "lstm" and dc_n is None:
        dc_n = np.zeros((L, B, H), dtype=dy.dtype)
    grads, dh0, dc0 = {}, [None] * L, [None] * L
    d_out = dy                                     # grad wrt output of layer k, (T, B, H)
    for k in reversed(range(L)):
        lc = cache["layers"][k]
        if cell == "lstm":
            g = lstm_layer_backward(d_out, dh_n[k], dc_n[k], lc)
            dc0[k] = g["dc0"]
        else:
            g = gru_layer_backward(d_out, dh_n[k], lc)
        dh0[k] = g["dh0"]
        for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
            key = f"{name}_l{k}"
            if key in cache["keys"]:
                grads[key] = g["d" + name.replace("weight", "w").replace("bias", "b")]
        d_out = g["dx"]                            # feeds layer k-1 (or the input)
    grads["input"] = d_out
    grads["h0"] = np.stack(dh0)
    if cell == "lstm":
        grads["c0"] = np.stack(dc0)
    return grads


# ----------------------------------------------------------------------------
# Any cell given as a numpy step; gradients by central differences.
# ----------------------------------------------------------------------------

def _rnn_tanh(xg, hg, s):
    return (np.tanh(xg + hg),)


def _rnn_relu(xg, hg, s):
    return (np.maximum(xg + hg, 0.0),)


def _cifg_lstm(xg, hg, s):
    H = s[0].shape[1]
    a = xg + hg                                   # (B, 3H): f, g, o
    f, g, o = _sigmoid(a[:, :H]), np.tanh(a[:, H:2 * H]), _sigmoid(a[:, 2 * H:])
    c = f * s[1] + (1.0 - f) * g
    return o * np.tanh(c), c


def _peephole_lstm(xg, hg, s, v):
    H, c = s[0].shape[1], s[1]
    a = xg + hg                                   # (B, 4H): i, f, g, o
    i = _sigmoid(a[:, :H] + v["weight_ci"] * c)
    f = _sigmoid(a[:, H:2 * H] + v["weight_cf"] * c)
    c_new = f * c + i * np.tanh(a[:, 2 * H:3 * H])
    o = _sigmoid(a[:, 3 * H:] + v["weight_co"] * c_new)
    return o * np.tanh(c_new), c_new


def _layer_norm(a, eps=1e-5):
    """(a - mean) / sqrt(var + eps) over axis 1, the biased variance."""
    m = a.mean(axis=1, keepdims=True)
    return (a - m) / np.sqrt(((a - m) ** 2).mean(axis=1, keepdims=True) + eps)


def _layernorm_lstm(xg, hg, s, v):
    H = s[0].shape[1]                             # xg, hg (B, 4H) without biases
    a = (_layer_norm(xg) * v["ln_ih_weight"] + _layer_norm(hg) * v["ln_hh_weight"]
         + v.get("bias", 0.0))                    # (B, 4H): i, f, g, o
    i, f, g, o = (a[:, k * H:(k + 1) * H] for k in range(4))
    c = _sigmoid(f) * s[1] + _sigmoid(i) * np.tanh(g)
    h = _sigmoid(o) * np.tanh(_layer_norm(c) * v["ln_c_weight"] + v["ln_c_bias"])
    return h, c


def _slstm(xg, hg, s):
    H = s[0].shape[1]
    a = xg + hg                                   # (B, 4H): i, f, z, o
    i, f, z, o = (a[:, k * H:(k + 1) * H] for k in range(4))
    log_f = -np.logaddexp(0.0, -f)                # log(sigmoid(f))
    m = np.maximum(log_f + s[3], i)
    i_gate, f_gate = np.exp(i - m), np.exp(log_f + s[3] - m)
    c = f_gate * s[1] + i_gate * np.tanh(z)
    n = f_gate * s[2] + i_gate
    return _sigmoid(o) * c / n, c, n, m


# cell -> step(xg (B, G*H) = x W_ih^T + b_ih, hg (B, G*H) = h W_hh^T + b_hh,
# states (h, ...) each (B, H)[, v: the layer's vector parameters by name,
# for a cell that has them]) -> new states; written apart from halstm.cells
STEPS = {"rnn_tanh": _rnn_tanh, "rnn_relu": _rnn_relu, "cifg_lstm": _cifg_lstm,
         "peephole_lstm": _peephole_lstm, "layernorm_lstm": _layernorm_lstm, "slstm": _slstm}
# the cells with a hand-written BPTT above (forward / backward)
BPTT = ("lstm", "gru")
# cell -> (torch.nn class name, keyword arguments): PyTorch's own module
TORCH = {"lstm": ("LSTM", {}), "gru": ("GRU", {}), "rnn_tanh": ("RNN", {"nonlinearity": "tanh"}),
         "rnn_relu": ("RNN", {"nonlinearity": "relu"})}


def round_bf16(a):
    """a (float32 values) rounded to the nearest bfloat16 (ties to even), as
    float64; NaN stays NaN."""
    a = np.asarray(a, dtype=np.float32)
    bits = a.view(np.uint32).astype(np.uint64)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    out = (bits & 0xFFFFFFFF).astype(np.uint32).view(np.float32).astype(np.float64)
    return np.where(np.isnan(a), np.nan, out)


def step_forward(step, params, x, states0, operand=None):
    """Multi-layer forward of a numpy step; x (T, B, I), states0 one (L, B, H)
    array per state. Returns y (T, B, H) and the final states, each (L, B, H).
    operand: applied to each product's operands (x, h, W_ih, W_hh) first,
    e.g. round_bf16 for precision "bf16"."""
    op = operand or (lambda a: a)
    finals = []
    inp = x
    for k in range(_num_layers(params)):
        w_ih, w_hh, b_ih, b_hh = _layer_params(params, k)
        w_ih, w_hh = op(w_ih), op(w_hh)
        vectors = {m.group(1): a for key, a in params.items()
                   if (m := re.fullmatch(rf"(\w+)_l{k}", key)) and m.group(1) not in
                   ("weight_ih", "weight_hh", "bias_ih", "bias_hh")}
        more = (vectors,) if vectors else ()
        s, ys = tuple(a[k] for a in states0), []
        for t in range(inp.shape[0]):
            s = step(op(inp[t]) @ w_ih.T + b_ih, op(s[0]) @ w_hh.T + b_hh, s, *more)
            ys.append(s[0])
        finals.append(s)
        inp = np.stack(ys)
    return inp, [np.stack([f[i] for f in finals]) for i in range(len(states0))]


def numeric_grad(f, a, eps=1e-6):
    """Central differences of scalar f() wrt array a, perturbed in place."""
    g = np.zeros_like(a)
    for i in np.ndindex(a.shape):
        keep = a[i]
        a[i] = keep + eps
        up = f()
        a[i] = keep - eps
        down = f()
        a[i] = keep
        g[i] = (up - down) / (2 * eps)
    return g


def step_gradients(step, params, x, states0, dy, dfinal, names, eps=1e-6):
    """Gradients of sum(dy * y) + sum(dfinal * finals) by central
    differences (float64 in, float64 out): every key of params, 'input'
    and '<state>0' for each state of `names`."""
    def loss(p, xx, ss):
        y, fin = step_forward(step, p, xx, ss)
        return float((dy * y).sum() + sum((d * f).sum() for d, f in zip(dfinal, fin)))

    def f():
        return loss(params, x, states0)
    grads = {k: numeric_grad(f, v, eps) for k, v in params.items()}
    grads["input"] = numeric_grad(f, x, eps)
    for name, s in zip(names, states0):
        grads[f"{name}0"] = numeric_grad(f, s, eps)
    return grads

