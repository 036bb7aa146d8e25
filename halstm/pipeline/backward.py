"""The backward steps: pack_bwd, step_bwd (whole, in two parts, on
units, folded, vendor product, fused, bf16 product)."""
from __future__ import annotations

import halide as hl

from .. import bf16
from .common import (_bf16_weight, _bwd_weight, _clamp, _constrain, _dh_product, _dvec_sums,
                     _fix_output, _gate_rows, _matmul, _output, _panels, _param, Pipe, _unit_range,
                     _vec)


def _pack_bwd(p: Pipe) -> None:
    G, K, H, P = p.G, p.K, p.H, p.P
    w_ih = _param(p, "w_ih", [K, H, G])      # numpy (G*H, K): PyTorch weight_ih
    w_hh = _param(p, "w_hh", [H, H, G])      # numpy (G*H, H): PyTorch weight_hh
    # Panels of P input units with every (gate, unit) row: the transposed
    # products dx = W_ih^T dxp and dh = W_hh^T dhg read them contiguously.
    wq_ih = _panels(w_ih, K, P, "wq_ih")          # numpy (Kp/P, G, H, P)
    wq_hh = _panels(w_hh, H, P, "wq_hh")          # numpy (Hp/P, G, H, P)
    p.inputs = [w_ih, w_hh]
    p.outputs = [wq_ih, wq_hh]
    _fix_output(p, wq_ih, [P, H, G, p.Kp // P])
    _fix_output(p, wq_hh, [P, H, G, p.Hp // P])
    p.stages = {"wq_ih": wq_ih, "wq_hh": wq_hh}
    if p.cpu_bf16:   # and for step_bwd_bf16, W_hh^T's bf16 pair panels: numpy (Hp/P, 1, NH, P, 2)
        k, kg, g0 = hl.Var("k"), hl.Var("kg"), hl.Var("g0")
        w_t = hl.Func("w_hh_t")             # w_t(g*H + j, k, 0) = W_hh[g*H + j, k]
        w_t[kg, k, g0] = w_hh[k, kg % H, hl.min(kg / H, G - 1)]
        wt_hh = bf16.panels(w_t, G * H, H, 1, P, "wt_hh")
        p.outputs.append(wt_hh)
        _fix_output(p, wt_hh, bf16.panels_extents(G * H, 1, P, p.Hp))
        p.stages["wt_hh"] = wt_hh


class _Reads(dict):
    """A dict that records the keys read (read)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.read: set = set()

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)


def _step_bwd_inputs(p: Pipe, states) -> tuple:
    """The inputs of a backward step (step_bwd, step_bwd_fused): saved[t],
    the states before and after step t, dy[t], the incoming gradients of
    `states` (W_hh comes from _bwd_weight)."""
    cell, H, Hp = p.cell, p.H, p.Hp
    saved = _param(p, "saved", [H, len(cell.saved_channels(H)), None])   # numpy (B, S, H): saved[t]
    prev = {s: _param(p, s + "_prev", [H, None]) for s in cell.states}
    new = {s: _param(p, s + "_new", [H, None]) for s in cell.states}
    dy = _param(p, "dy", [H, None])                     # numpy (B, H): dy[t]
    # state gradients live in (B, Hp) rows
    dnext = {s: _param(p, "d" + s + "_next", [H, None], [1, Hp]) for s in states}
    return saved, prev, new, dy, dnext


def _step_bwd_vendor(p: Pipe) -> None:
    _step_bwd(p, vendor=True)


# the pointwise part of a backward step in two parts (see UNITS_BWD): a
# vendor step's pipeline, the product left to step_bwd_product
_step_bwd_cell = _step_bwd_vendor


def _step_bwd_product(p: Pipe) -> None:
    """The product of a backward step in two parts (see UNITS_BWD): dh_prev
    = dh_own + W_hh^T dhg on the driver's ranges of units, summed as
    step_bwd's; dhg (B, G, H) (dxp where the cell's are one), dh_own (B,
    Hp) rows, H used (step_bwd_cell's dh_prev); out numpy (B, Hp)."""
    G, H, Hp = p.G, p.H, p.Hp
    k, b = p.vars["k"], p.vars["b"]
    p.split_rows_only = False
    dhg = _param(p, "dhg", [H, G, None])                    # numpy (B, G, H)
    w_hh, w = _bwd_weight(p, "w_hh", H, k)
    own = _param(p, "dh_own", [H, None], [1, Hp])
    dhg_in, own_in = _clamp(dhg, (2,)), _clamp(own, (0, 1))
    r = hl.RDom([(0, H), (0, G)], "r_jg")
    dh_acc, dh_prev = _dh_product(p, w, own_in[k, b], dhg_in, r)
    p.inputs, p.outputs = [dhg, w_hh, own], [dh_prev]
    _constrain(dh_prev.output_buffer(), [Hp, None], bounds=False)    # (units: _unit_range's)
    p.shapes[dh_prev.name()] = [Hp, None]
    _unit_range(p, [(dh_prev.output_buffer(), Hp)])
    p.stages = {"dh_prev_acc": dh_acc, "dprev_h": dh_prev, "dhg_in": dhg_in}
    p.rdoms = {"jg": r}


def _step_bwd(p: Pipe, vendor: bool = False, fold: bool = False) -> None:
    """One backward step: the pointwise backward, then dh_prev = its own
    term + W_hh^T dhg. vendor: without that product, which the driver adds
    to dh_prev (a vendor GEMM, beta = 1), and without the w_hh input. fold
    (FOLD_BWD): the same inputs, the outputs one Func over (j, b) (see
    _fold_bwd_outputs)."""
    cell, G, H, Hp = p.cell, p.G, p.H, p.Hp
    j, k, b, gate = p.vars["j"], p.vars["k"], p.vars["b"], p.vars["gate"]
    # (dh is computed over all Hp)
    saved, prev, new, dy, dnext = _step_bwd_inputs(p, cell.states)
    if not vendor:    # (the param: panels, or the weight as given)
        w_hh, w = _bwd_weight(p, "w_hh", H, j if fold else k)
    dnew = {}
    for s in cell.states:
        f = hl.Func("d" + s + "_new")
        dn = _clamp(dnext[s], (1,))
        f[j, b] = dn[j, b] + (_clamp(dy, (1,))[j, b] if s == "h" else 0.0)
        dnew[s] = f
    vec, vec_in = _vec(p)
    # the pointwise part's inputs, as Funcs a schedule may place (those it reads)
    prev_in = _Reads({s: _clamp(q, (1,)) for s, q in prev.items()})
    new_in = _Reads({s: _clamp(q, (1,)) for s, q in new.items()})
    dnew = _Reads(dnew)
    saved_in = _clamp(saved, (2,))
    dxp, dhg, dprev, dvec = cell.backward(saved_in, prev_in, new_in, dnew, vec_in, H, j, b)
    inputs = {"saved_in": saved_in, **{f"{kind}_{s}": d[s] for kind, d in
                                       (("prev_in", prev_in), ("new_in", new_in), ("dnew", dnew))
                                       for s in sorted(d.read)}}
    p.reductions, p.stagings = list(cell.reductions), list(cell.stagings)
    p.reduction_groups, p.staging_groups = cell.reduction_groups(), cell.staging_groups()
    p.row_func_groups = cell.row_func_groups()
    sums, sums_in = _dvec_sums(p, (2,))
    r = hl.RDom([(0, H), (0, G)], "r_jg")
    p.inputs = ([saved] + [prev[s] for s in cell.states] + [new[s] for s in cell.states]
                + [dy] + [dnext[s] for s in cell.states] + ([] if vendor else [w_hh]) + vec
                + sums)
    p.rdoms = {"jg": r}
    assert (dhg is dxp) == cell.dxp_is_dhg, "cell.dxp_is_dhg disagrees with its backward"
    if fold:
        return _fold_bwd_outputs(p, w, dxp, dhg, dprev, dvec, sums_in,
                                 {**inputs, "vec_in": vec_in})
    outs = {"dxp_out": _output(dxp)}
    if not cell.dxp_is_dhg:
        outs["dhg_out"] = _output(dhg)
    if dvec is not None:   # (not a copy of dvec: it reads no output buffer)
        outs["dvec_out"] = hl.Func("dvec_out")
        outs["dvec_out"][dvec.args()] = sums_in[dvec.args()] + dvec[dvec.args()]
    if vendor and p.vendor_bf16:   # dhg's bf16 bits: the driver's product reads them
        outs["dhg_bf16_out"] = hl.Func("dhg_bf16_out")
        outs["dhg_bf16_out"][j, gate, b] = bf16.bits(dhg[j, gate, b])
    # With read_outputs (a GPU layout), the product reads dhg back from the
    # output just written: the pointwise backward runs once, in the kernel
    # that stores it, instead of a kernel of its own plus a copy. CPU
    # schedules must not (Halide assumes an output read is aligned, above).
    dhg_in = outs["dxp_out" if cell.dxp_is_dhg else "dhg_out"] if p.read_outputs else dhg
    if vendor:       # dh_prev's own term (B, Hp) rows, H used; the driver adds the product
        dh_prev = hl.Func("dh_prev")
        dh_prev[j, b] = dprev["h"][j, b] if dprev["h"] is not None else hl.f32(0)
    else:
        init = dprev["h"][hl.min(k, H - 1), b] if dprev["h"] is not None else hl.f32(0)
        dh_acc, dh_prev = _dh_product(p, w, init, dhg_in, r)          # numpy (B, Hp)
    dprev = {**dprev, "h": dh_prev}
    p.stages = {"dxp": dxp, "dhg": dhg, **outs, **({} if vendor else {"dh_prev_acc": dh_acc}),
                **{"dprev_" + s: dprev[s] for s in cell.states}, **inputs, "vec_in": vec_in}
    if dvec is not None:
        p.stages["dvec"] = dvec
    p.outputs = ([p.stages["dxp_out"]] + ([] if cell.dxp_is_dhg else [p.stages["dhg_out"]])
                 + [dprev[s] for s in cell.states]
                 + ([p.stages["dvec_out"]] if dvec is not None else [])
                 + ([outs["dhg_bf16_out"]] if "dhg_bf16_out" in outs else []))
    for f in p.outputs[:1 + (not cell.dxp_is_dhg)]:
        _fix_output(p, f, [H, G, None])                 # numpy (B, G, H)
    if "dhg_bf16_out" in outs:
        _fix_output(p, outs["dhg_bf16_out"], [H, G, None])     # (B, G, H) bf16 bits
    if dvec is not None:
        _fix_output(p, p.stages["dvec_out"], [H, p.V, None])   # numpy (B, V, H): the sums
    if vendor:
        _fix_output(p, dh_prev, [H, None], [1, Hp])     # (B, Hp) rows, H used
    else:
        _fix_output(p, dh_prev, [Hp, None])             # numpy (B, Hp)
    for s in cell.states[1:]:
        _fix_output(p, dprev[s], [H, None], [1, Hp])    # (B, Hp) rows, H used
    if p.split_steps:   # with ranges of units, each thread computes the pointwise part for all
        _unit_range(p, [(f.output_buffer(), Hp if f is dh_prev else H) for f in p.outputs])


def _fold_bwd_outputs(p: Pipe, w, dxp, dhg, dprev, dvec, sums_in, inputs) -> None:
    """step_bwd's outputs as one Func over (j, b), j < H, whose Tuple holds
    dxp a gate an element, dhg so (unless dxp is dhg), dh_prev, the other
    states' gradients and the vector sums a channel an element; dh_prev's
    product reads dhg_row, the row's dhg for every unit, a stage of its own
    (a GPU block computes it for its row, then its units' products)."""
    cell, G, H, Hp, V = p.cell, p.G, p.H, p.Hp, p.V
    j, b, gate = p.vars["j"], p.vars["b"], p.vars["gate"]
    assert not p.split_steps, "folded backward steps run whole"
    dhg_row = hl.Func("dhg_row")
    dhg_row[j, gate, b] = dhg[j, gate, b]
    init = dprev["h"][hl.min(j, H - 1), b] if dprev["h"] is not None else hl.f32(0)
    dh_acc, dh_prev = _dh_product(p, w, init, dhg_row, p.rdoms["jg"], "j")
    planes = [dhg_row] if cell.dxp_is_dhg else [dxp, dhg_row]
    out = hl.Func("dstep")
    out[j, b] = hl.Tuple([f[j, g, b] for f in planes for g in range(G)] + [dh_prev[j, b]]
                         + [dprev[s][j, b] for s in cell.states[1:]]
                         + [sums_in[j, c, b] + dvec[j, c, b] for c in range(V)])
    p.outputs = [out]
    # dxp and dhg: a gate's plane of (B, G, H); the states' gradients (B,
    # Hp) rows, H used; the vector sums: a channel's plane of (B, V, H)
    strides = [G * H] * (G * len(planes)) + [Hp] * len(cell.states) + [V * H] * V
    for n, (q, stride) in enumerate(zip(out.output_buffers(), strides)):
        _constrain(q, [H, None], [1, stride], bounds=n == 0)
    p.shapes["dstep"] = [H, None]
    p.stages = {"out": out, "dhg_row": dhg_row, "dh_prev_acc": dh_acc, "dxp": dxp, "dhg": dhg,
                **inputs}


def _step_bwd_fold(p: Pipe) -> None:
    _step_bwd(p, fold=True)


def _step_bwd_units(p: Pipe) -> None:
    """step_bwd on the driver's ranges of units (see UNITS_BWD)."""
    p.split_rows_only = False
    _step_bwd(p)


def _step_bwd_bf16(p: Pipe) -> None:
    """step_bwd_fused with its product of bf16 operands (precision bf16 on a
    CPU): dhg_next's rows rounded to bf16 (the reduction over gate and
    unit innermost) times W_hh's bf16 pair panels over that reduction
    (pack_bwd's wt_hh)."""
    _step_bwd_fused(p, bf16_product=True)


def _step_bwd_fused(p: Pipe, bf16_product: bool = False) -> None:
    """step_bwd turned around, so that a step is one kernel on a GPU (its
    product needs every unit's dhg, so step_bwd's pointwise part and its
    product are two): call t finishes step t+1's product,

        dh(k, b) = dh_add(k, b) + sum over (j, gate) of W_hh[j, gate, k] dhg_next(j, gate, b),

    which is the recurrent part of dL/dh_t, and with it runs step t's
    pointwise backward at the same unit k and row b. dh_add is step t+1's
    pointwise term (the part of dL/dh_t that does not pass through W_hh;
    zero for a cell that reads h only through it), or dL/dh_T for the
    first call. The outputs are one Tuple over (k, b), k < H: dh, dxp per
    gate, dhg per gate (unless dxp is dhg), the pointwise parts of the
    other states' gradients (e.g. dc_{t-1}), the vector parameters'
    gradients of the row per channel and the next call's dh_add. The driver calls it T + 1 times: first with dhg_next = 0, last
    for dh_0 alone (its pointwise results, from step 0's inputs, unused)."""
    cell, G, H, Hp = p.cell, p.G, p.H, p.Hp
    k, b = p.vars["k"], p.vars["b"]
    saved, prev, new, dy, dnext = _step_bwd_inputs(p, cell.states[1:])
    dh_add = _param(p, "dh_add", [H, None], [1, Hp])    # a row of (B, Hp)
    dhg_next = _param(p, "dhg_next", [H, G, None])      # numpy (B, G, H): dhg[t+1]
    r = hl.RDom([(0, H), (0, G)], "r_jg")
    dhg_in = _clamp(dhg_next, (2,))
    init = _clamp(dh_add, (0, 1))[k, b]                  # (k clamped: whole tiles)
    if bf16_product:
        w_hh = _bf16_weight(p, "wt_hh", G * H, 1)
        dhg_bf = bf16.rows(_gate_rows(dhg_in, G, H, "dhg_flat"), G * H, "dhg_bf")
        acc, tile, r = bf16.product("dh", dhg_bf, w_hh, G * H, 1)
        dh = hl.Func("dh")
        dh[k, b] = init + bf16.at(tile, k, b, 0, p.P)
        product_stages = {"dhg_bf": dhg_bf, "dh_bf16sum": acc, "dh_tile": tile}
    else:
        w_hh, w = _bwd_weight(p, "w_hh", H, k)   # (the param: panels, or the weight as given)
        dh_acc, dh = _matmul("dh", [k, b], init, lambda: w(r.x, r.y) * dhg_in[r.x, r.y, b])
        product_stages = {"dh_acc": dh_acc}
    # The pointwise inputs are read at the stored units only (k < H: the
    # schedules guard the edge tile), so unclamped along units: the edge
    # tile's loads are then predicated vectors where clamped ones were
    # gathers (bench/RESULTS.md, "Schedule decisions": cpu.step_bwd edge).
    dnew = {"h": hl.Func("dh_new")}
    dnew["h"][k, b] = dh[k, b] + _clamp(dy, (1,))[k, b]
    for s in cell.states[1:]:
        dnew[s] = _clamp(dnext[s], (1,))
    vec, vec_in = _vec(p)
    dxp, dhg, dprev, dvec = cell.backward(_clamp(saved, (2,)),
                                          {s: _clamp(q, (1,)) for s, q in prev.items()},
                                          {s: _clamp(q, (1,)) for s, q in new.items()},
                                          dnew, vec_in, H, k, b)
    assert not cell.reductions, "a step that reduces over units has no fused backward"
    assert (dhg is dxp) == cell.dxp_is_dhg, "cell.dxp_is_dhg disagrees with its backward"
    p.stagings = list(cell.stagings)    # (Funcs over (k, b) several outputs read)
    values = [dh[k, b]] + [dxp[k, g, b] for g in range(G)]
    if not cell.dxp_is_dhg:
        values += [dhg[k, g, b] for g in range(G)]
    planes = len(values) - 1
    values += [dprev[s][k, b] for s in cell.states[1:]]
    sums, sums_in = _dvec_sums(p, (2,))
    values += [sums_in[k, c, b] + dvec[k, c, b] for c in range(p.V)]
    values.append(dprev["h"][k, b] if dprev["h"] is not None else hl.f32(0))
    out = hl.Func("dstep")
    out[k, b] = hl.Tuple(values)
    p.inputs = ([saved] + [prev[s] for s in cell.states] + [new[s] for s in cell.states]
                + [dy] + [dnext[s] for s in cell.states[1:]] + [dh_add, dhg_next, w_hh] + vec
                + sums)
    p.stages = {"out": out, "dhg_in": dhg_in, **product_stages}
    p.outputs = [out]
    # dh and the state rows: (B, Hp) rows; dxp and dhg: a gate's plane of
    # (B, G, H); dvec: a channel's plane of (B, V, H)
    strides = ([Hp] + [G * H] * planes + [Hp] * (len(cell.states) - 1)
               + [p.V * H] * p.V + [Hp])
    for n, (q, stride) in enumerate(zip(out.output_buffers(), strides)):
        _constrain(q, [H, None], [1, stride], bounds=n == 0 and not p.split_steps)
    p.shapes["dstep"] = [H, None]
    if p.split_steps:
        _unit_range(p, [(out.output_buffers()[0], H)])
    p.rdoms = {"jg": r}
