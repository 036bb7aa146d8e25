"""A projected layer (proj_size, torch's LSTMP) on the compiled kernels,
numpy arrays on CPU targets (halstm.nn; halstm.torch has its own, through
autograd).

The cell's h is h = W_hr m (P units), so W_hh h = (W_hh W_hr) m and the
kernels run the cell on m (H units) with the recurrent weight W_hh W_hr
(G*H, H); y = W_hr m is one product after the time loop. h_0 has no m:
step 0 runs as a call of its own on [x_0, h_0] with input weight
[W_ih | W_hh] (a library of input size K + P) from m_0 = 0 (so the cell
must read its input and recurrent products only as their sum, x.g + r.g:
Definition.dxp_is_dhg), and steps
1..T-1 run from its states with the layer's own library (the rows longer
than one step: rows are sorted longest first). Backward runs the two
calls' BPTT in reverse and composes the products' gradients.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .runtime import row_lengths


@dataclass
class Tape:
    """What backward reads of one layer and direction."""
    x: np.ndarray            # (T, B, K) the layer's input
    x0: np.ndarray           # (1, B, K+P) [x_0, h_0]
    w0: np.ndarray           # (G*H, K+P) [W_ih | W_hh], step 0's input weight
    w_m: np.ndarray          # (G*H, H) W_hh W_hr, the recurrent weight
    m: np.ndarray            # (T, B, H) m after each step, zero past a row's length
    first: tuple             # step 0's (states (NS, 2, B, H), saved)
    rest: tuple | None       # steps 1..: (states (NS, T, n, H), saved), or None (T = 1)
    n: int                   # rows longer than one step


def _c(a):
    return np.ascontiguousarray(a)


def forward(lib0, lib, x, weights, w_hr, init, vec, save, bs):
    """x (T, B, K); weights (w_ih, b_ih, w_hh (G*H, P), b_hh); w_hr (P, H);
    init per state (B, P) for h, (B, H) others, None: zeros; bs None or the
    step batch sizes (T,). Returns y (T, B, P), the final states (h (B, P),
    others (B, H)) at each row's length, and the Tape."""
    w_ih, b_ih, w_hh, b_hh = weights
    (T, B, _), (P, H) = x.shape, w_hr.shape
    w_m = _c(w_hh @ w_hr)                                       # (G*H, H)
    h0 = np.zeros((B, P), np.float32) if init[0] is None else init[0]
    x0 = _c(np.concatenate([x[:1], h0[None]], axis=2))          # (1, B, K+P)
    w0 = _c(np.concatenate([w_ih, w_hh], axis=1))               # (G*H, K+P)
    first = lib0.forward(x0, w0, b_ih, w_m, b_hh, [np.zeros((B, H), np.float32), *init[1:]],
                         save=save, vec=vec)
    n = B if bs is None or T == 1 else int(bs[1])
    rest = None
    if T > 1:
        rest = lib.forward(_c(x[1:, :n]), w_ih, b_ih, w_m, b_hh,
                           [_c(first[0][s, 1, :n]) for s in range(len(first[0]))], save=save,
                           vec=vec, batch_sizes=None if bs is None else _c(bs[1:]))
    m = _m(first, rest, n, T, B, H)                             # (T, B, H)
    y = m @ w_hr.T                                              # (T, B, P); 0 past a length
    end = _ends(T, B, bs)
    finals = [y[end]]
    for s in range(1, len(first[0])):
        f = first[0][s, 1].copy()
        if rest is not None:
            f[:n] = rest[0][s][end[0][:n], np.arange(n)]
        finals.append(f)
    return y, finals, Tape(x, x0, w0, w_m, m, first, rest, n)


def _m(first, rest, n, T, B, H):
    """m after each step (T, B, H), zero past a row's length."""
    m = np.zeros((T, B, H), np.float32)
    m[0] = first[0][0, 1]
    if rest is not None:
        m[1:, :n] = rest[0][0, 1:]
    return m


def _ends(T, B, bs):
    """(step index, row) of each row's last step."""
    lengths = np.full(B, T) if bs is None else row_lengths(bs, B)
    return lengths - 1, np.arange(B)


def backward(lib0, lib, tape, weights, w_hr, dy, dfinal, vec, bs, need_dx):
    """BPTT of the layer forward ran: dy (T, B, P); dfinal per state (h: (B,
    P), others (B, H); None: zeros). Returns the library's gradient keys
    (dx (T, B, K) with need_dx, dw_ih, db_ih, dw_hh (G*H, P), db_hh, dvec,
    d<state>0 with dh0 (B, P)) and dw_hr (P, H)."""
    w_ih, _, w_hh, _ = weights
    x, first, rest, n, w_m = tape.x, tape.first, tape.rest, tape.n, tape.w_m
    (T, B, K), (P, H) = x.shape, w_hr.shape
    NS = len(first[0])
    dy = np.array(dy, np.float32)                               # y's total gradient
    if dfinal[0] is not None:
        dy[_ends(T, B, bs)] += dfinal[0]
    dw_hr = dy.reshape(-1, P).T @ tape.m.reshape(-1, H)         # y = m W_hr^T
    dm = dy @ w_hr                                              # (T, B, H)
    dnext = [None] + [None if a is None else _c(a) for a in dfinal[1:]]
    dx = np.zeros((T, B, K), np.float32) if need_dx else None
    g = None
    if rest is not None:
        g = lib.backward(_c(x[1:, :n]), w_ih, w_m, rest[1], rest[0], _c(dm[1:, :n]),
                         [None if a is None else _c(a[:n]) for a in dnext], need_dx=need_dx,
                         vec=vec, batch_sizes=None if bs is None else _c(bs[1:]))
        if need_dx:
            dx[1:, :n] = g["dx"]
        # the rows that run on: their step-0 gradients come from the later steps
        dm[0, :n] += g["dh0"]
        dnext = [None] + [_merge(g[f"d{s}0"], a, n, B, H) for s, a in
                          zip(lib.states[1:], dnext[1:])]
    g0 = lib0.backward(tape.x0, tape.w0, w_m, first[1], first[0], _c(dm[:1]), dnext,
                       need_dx=True, vec=vec)
    if need_dx:
        dx[0] = g0["dx"][0, :, :K]
    dw_m = g0["dw_hh"] + (0 if g is None else g["dw_hh"])       # W_m = W_hh W_hr
    out = {"dw_ih": g0["dw_ih"][:, :K] + (0 if g is None else g["dw_ih"]),
           "db_ih": g0["db_ih"] + (0 if g is None else g["db_ih"]),
           "db_hh": g0["db_hh"] + (0 if g is None else g["db_hh"]),
           "dw_hh": dw_m @ w_hr.T + g0["dw_ih"][:, K:],
           "dw_hr": dw_hr + w_hh.T @ dw_m, "dh0": _c(g0["dx"][0, :, K:])}
    if "dvec" in g0:
        out["dvec"] = g0["dvec"] + (0 if g is None else g["dvec"])
    if need_dx:
        out["dx"] = dx
    for s in lib.states[1:NS]:
        out[f"d{s}0"] = g0[f"d{s}0"]
    return out


def _merge(head, tail, n, B, H):
    """(B, H): rows [0, n) from head (n, H), the others from tail (B, H) or zeros."""
    out = np.zeros((B, H), np.float32) if tail is None else tail.copy()
    out[:n] = head
    return out
