"""The gradients over all steps: grads and grads_ids (dx, dW_ih, db_ih,
dW_hh, db_hh, the vector parameters' sums), their bf16 form, and to_bf16."""
from __future__ import annotations

import halide as hl

from .. import bf16
from .common import (_bwd_weight, _clamp, _fix_output, _gate_rows, _ids_param, _matmul, padded,
                     _param, Pipe)


def _grads(p: Pipe) -> None:
    _all_grads(p, ids=False)


def _grads_ids(p: Pipe) -> None:
    _all_grads(p, ids=True)


def _all_grads(p: Pipe, ids: bool) -> None:
    """Gradients over all steps, with batch and time merged into one axis
    n = t*B + b of N rows (the driver passes 2-D views). ids: the layer's
    input is one-hot rows given as indices, numpy (N,): dW_ih is a
    scatter-add of the rows of dxp, and there is no dx."""
    cell, G, K, H = p.cell, p.G, p.K, p.H
    C, R = p.dw_cols, p.dw_rows
    i, j, k, gate, n = (p.vars[v] for v in ("i", "j", "k", "gate", "t"))
    dxp = _param(p, "dxp", [H, G, None])                # numpy (N, G, H)
    shared = cell.dxp_is_dhg
    dhg = dxp if shared else _param(p, "dhg", [H, G, None])
    vendor = p.vendor_gemm and not ids   # dx and dW: the driver's vendor GEMMs (see _proj)
    if not vendor:
        x = _ids_param(p) if ids else _param(p, "x", [K, None])   # numpy (N,) or (N, K)
        hs = _param(p, "hs", [H, None])                 # numpy (N, H): h_{t-1} for row t*B+b
    N = dxp.dim(2).extent() if vendor else x.dim(0 if ids else 1).extent()
    rn = hl.RDom([(0, N)], "r_n")
    rg = hl.RDom([(0, H), (0, G)], "r_jg")
    # dxp and dhg with the rows clamped: a schedule may load a chunk of rows
    # past N (staged, unused past N)
    dxp_in = _clamp(dxp, (2,))
    dhg_in = dxp_in if shared else _clamp(dhg, (2,))
    stages = {"dxp_in": dxp_in, "dhg_in": dhg_in}
    if vendor:
        p.inputs = [dxp] + ([] if shared else [dhg])
        p.rdoms = {"n": rn}
        _bias_grads(p, stages, rn, dxp, dhg, ())
        return
    if p.cpu_bf16:
        return _bf16_grads(p, stages, x, hs, dxp, dhg, rn, ids)
    if not ids:
        w_ih, w = _bwd_weight(p, "w_ih", K, i)
        stages["dx_acc"], stages["dx"] = _matmul(                                # (N, Kp)
            "dx", [i, n], hl.f32(0), lambda: w(rg.x, rg.y) * dxp_in[rg.x, rg.y, n])
    # Weight gradients dW[g, v] = sum_n d[n, g] * a[n, v]: both operands are
    # first packed into panels contiguous along n (C input units, resp. R
    # hidden units with all gates), so that a tile streams two dense blocks.
    panels = {"hs": _row_panels(hs, H, C, "hs_panels"),
              "dxp": _unit_panels(dxp_in, H, R, "dxp_panels")}
    if not ids:
        panels["x"] = _row_panels(x, K, C, "x_panels")
    panels["dhg"] = panels["dxp"] if shared else _unit_panels(dhg_in, H, R, "dhg_panels")
    if ids:
        _scattered_dw_ih(p, stages, x, dxp, rn)
    for name, d, a, v in (("dw_ih", "dxp", "x", i), ("dw_hh", "dhg", "hs", k)):
        if name == "dw_ih" and ids:
            continue
        acc = hl.Func(name + "_acc")
        acc[v, j, gate] = hl.f32(0)
        acc[v, j, gate] += (panels[d][j % R, gate, rn.x, j / R] *
                            panels[a][v % C, rn.x, v / C])
        tiles = hl.Func(name + "_tiles")          # whole tiles, past the edges
        tiles[v, j, gate] = acc[v, j, gate]
        out = hl.Func(name)
        out[v, j, gate] = tiles[v, j, gate]
        stages |= {name + "_acc": acc, name + "_tiles": tiles, name: out}
    stages |= {"hs_panels": panels["hs"], "dxp_panels": panels["dxp"],
               "dhg_panels": panels["dhg"]}
    if not ids:
        stages["x_panels"] = panels["x"]
    p.inputs = [x, hs, dxp] + ([] if shared else [dhg]) + ([] if ids else [w_ih])
    p.rdoms = {"n": rn, "jg": rg}
    _bias_grads(p, stages, rn, dxp, dhg, ("dw_ih", "dw_hh") if ids else ("dx", "dw_ih", "dw_hh"))


def _scattered_dw_ih(p: Pipe, stages: dict, ids, dxp, rn) -> None:
    """dW_ih of one-hot rows given as indices: dW_ih[g, k] = the sum of
    dxp[n, g] over the rows n with ids[n] == k."""
    i, j, gate = (p.vars[v] for v in ("i", "j", "gate"))
    acc = hl.Func("dw_ih_acc")                    # numpy (K, G, H)
    acc[j, gate, i] = hl.f32(0)
    acc[j, gate, hl.clamp(ids[rn.x], 0, p.K - 1)] += dxp[j, gate, rn.x]
    out = hl.Func("dw_ih")
    out[i, j, gate] = acc[j, gate, i]
    stages |= {"dw_ih_acc": acc, "dw_ih": out}


def _bf16_grads(p: Pipe, stages: dict, x, hs, dxp, dhg, rn, ids: bool) -> None:
    """_all_grads with dx and the weight gradients of bf16 operands
    (precision bf16 on a CPU; bf16.product): their operands rounded to bf16, float32
    sums. dx = dxp's bf16 rows (reduction over gate and unit) times W_ih's
    bf16 panels over that reduction (made here from wq_ih); dW_ih = dxp^T's
    bf16 rows in chunks (a gate's units padded to whole tiles of 16 rows,
    over n) times x's bf16 panels over n; dW_hh the same with dhg^T and h.
    The weight gradients sum over the rows n in chunks of at most the
    layout's bf16_dw_rows rows (0: one chunk), each chunk's tiles added to
    dW."""
    G, K, H, P = p.G, p.K, p.H, p.P
    i, j, gate, n = (p.vars[v] for v in ("i", "j", "gate", "t"))
    dxp_in, dhg_in = stages["dxp_in"], stages["dhg_in"]
    N = dxp.dim(2).extent()
    # the weight gradients' rows in chunks of at most bf16_dw_rows, as equal
    # as whole tile rows allow: chunk (an Expr) of `chunks`
    most = p.bf16_dw_rows or bf16.padded_reduction(N)
    chunks = (N + most - 1) / most
    chunk = bf16.padded_reduction((N + chunks - 1) / chunks)
    Hr = padded(H, bf16.TILE_ROWS)
    d_rows = {}      # d^T in bf16 chunks: rows n of f(n, gate*Hr + j), zero past H

    def transposed(d, name):
        f = hl.Func(name + "_src")
        k, row = hl.Var("k"), hl.Var("row")
        u, g = row % Hr, row / Hr      # (rows past G*Hr: zero, for tiles that overrun)
        f[k, row] = hl.select((u < H) & (g < G), d[hl.min(u, H - 1), hl.min(g, G - 1), k],
                              hl.f32(0))
        return bf16.chunks(f, N, name)
    d_rows["dxp"] = transposed(dxp_in, "dxp_t")
    d_rows["dhg"] = d_rows["dxp"] if p.cell.dxp_is_dhg else transposed(dhg_in, "dhg_t")
    stages |= {"dxp_t": d_rows["dxp"], "dhg_t": d_rows["dhg"]}
    a_rows = {"hs": hs}
    if not ids:
        a_rows["x"] = x
    products = ()
    if ids:
        _scattered_dw_ih(p, stages, x, dxp, rn)
        products += ("dw_ih",)
    else:
        wq, w = _bwd_weight(p, "w_ih", K, i)
        wt = hl.Func("w_ih_t")          # wt(k, i, 0) = W_ih at input unit i, k = gate*H + j
        k, g0 = hl.Var("k"), hl.Var("g0")
        wt[k, i, g0] = w(k % H, k / H)
        wt_pan = bf16.panels(wt, G * H, K, 1, P, "w_ih_panels")
        # dxp's rows in bf16, the reduction (gate, unit) innermost
        dxp_bf = bf16.rows(_gate_rows(dxp_in, G, H, "dxp_flat"), G * H, "dxp_bf")
        acc, tile, r = bf16.product("dx", dxp_bf, wt_pan, G * H, 1)
        dx = hl.Func("dx")
        dx[i, n] = bf16.at(tile, i, n, 0, P)
        stages |= {"w_ih_panels": wt_pan, "dxp_bf": dxp_bf, "dx_bf16sum": acc, "dx_tile": tile,
                   "dx": dx}
        p.rdoms["dx"] = r
        products += ("dx",)
    for name, d, a, v, width in (("dw_ih", "dxp", "x", i, K), ("dw_hh", "dhg", "hs", p.vars["k"],
                                                                    H)):
        if name == "dw_ih" and ids:
            continue
        src = hl.Func(a + "_src")       # a's rows n as the reduction: src(n, v, 0) = a(v, n)
        kn, vv, g0 = hl.Var("kn"), hl.Var("vv"), hl.Var("g0")
        src[kn, vv, g0] = a_rows[a][vv, kn]
        pr = bf16.panels(src, N, width, 1, P, a + "_pairs", pad=chunk)
        acc, tile, r = bf16.product(name, d_rows[d], pr, N, 1, chunk=chunk)
        # out(v, j, gate): the sum over the chunks c of tile(v % P, gate*Hr + j, 0, v / P, c)
        rc = hl.RDom([(0, chunks)], name + "_rc")
        out = hl.Func(name)
        out[v, j, gate] = hl.f32(0)
        out[v, j, gate] += tile[v % P, gate * Hr + j, 0, v / P, rc.x]
        stages |= {a + "_pairs": pr, name + "_bf16sum": acc, name + "_tile": tile, name: out}
        p.rdoms[name], p.rdoms[name + "_chunks"] = r, rc
        products += (name,)
    shared = p.cell.dxp_is_dhg
    p.inputs = [x, hs, dxp] + ([] if shared else [dhg]) + ([] if ids else [wq])
    p.rdoms["n"] = rn
    _bias_grads(p, stages, rn, dxp, dhg, products)


def _bias_grads(p: Pipe, stages: dict, rn, dxp, dhg, products: tuple) -> None:
    """The sums over rows (db_ih, db_hh, dvec) into stages, then the grads
    pipeline's outputs: products (the stages dx, dw_ih, dw_hh it computes)
    in that order, each followed by its bias."""
    G, K, H = p.G, p.K, p.H
    j, gate = p.vars["j"], p.vars["gate"]
    for name, d in (("db_ih", dxp), ("db_hh", dhg)):
        if not p.cell.matrix_bias:     # (no such parameters: zeros, no sums)
            stages[name] = hl.Func(name)
            stages[name][j, gate] = hl.f32(0)
            continue
        if name == "db_hh" and p.cell.dxp_is_dhg:   # dhg is dxp (the LSTM): the same sums
            stages[name] = hl.Func(name)
            stages[name][j, gate] = stages["db_ih"][j, gate]
            continue
        stages[name + "_acc"], stages[name] = _matmul(name, [j, gate], hl.f32(0),
                                                      lambda: d[j, gate, rn.x])
    order = ("dx", "dw_ih", "db_ih", "dw_hh", "db_hh")
    names = tuple(v for v in order if v in products or v.startswith("db"))
    extents = {"dx": [p.Kp, None], "dw_ih": [K, H, G], "db_ih": [H, G], "dw_hh": [H, H, G],
               "db_hh": [H, G], "dvec": [H, p.V]}
    if p.V:   # the vector parameters' gradients: the steps' sums per batch row, summed
        dvec = _param(p, "dvec_rows", [H, p.V, None])     # numpy (B, V, H)
        p.inputs.append(dvec)
        rv = p.rdoms["v"] = hl.RDom([(0, dvec.dim(2).extent())], "r_v")
        stages["dvec_acc"], stages["dvec"] = _matmul("dvec", [j, gate], hl.f32(0),
                                                     lambda: dvec[j, gate, rv.x])
        names += ("dvec",)
    p.outputs = [stages[v] for v in names]
    for v in names:
        _fix_output(p, stages[v], extents[v])
    p.stages = stages


def _row_panels(a: hl.ImageParam, n: int, C: int, name: str) -> hl.Func:
    """a(v, row) -> f(vi, row, vo) = a(vo*C + vi, row), zero past n."""
    f = hl.Func(name)
    vi, row, vo = hl.Var("vi"), hl.Var("row"), hl.Var("vo")
    v = vo * C + vi
    f[vi, row, vo] = hl.select(v < n, a[hl.min(v, n - 1), row], hl.f32(0))
    return f


def _unit_panels(d: hl.Func, H: int, R: int, name: str) -> hl.Func:
    """d(j, gate, row) -> f(ji, gate, row, jo) = d(jo*R + ji, gate, row)
    (units past H repeat the last; their results are never stored)."""
    f = hl.Func(name)
    ji, gate, row, jo = hl.Var("ji"), hl.Var("gate"), hl.Var("row"), hl.Var("jo")
    f[ji, gate, row, jo] = d[hl.min(jo * R + ji, H - 1), gate, row]
    return f


def _to_bf16(p: Pipe) -> None:
    """a_bf16 (n) = the bfloat16 bits of a (n), rounded to nearest even, as
    uint16 (Halide 21's CUDA backend cannot store bfloat16 itself); a NaN
    stays a (quiet) NaN, where rounding its bits could make it infinite."""
    i = p.vars["i"]
    a = _param(p, "a", [None])
    out = hl.Func("a_bf16")
    out[i] = bf16.bits(a[i])
    p.inputs, p.outputs = [a], [out]
    _fix_output(p, out, [None])
    p.stages = {"a_bf16": out}
