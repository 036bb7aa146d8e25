"""The forward pipelines: pack, proj and gather (the input projection),
the steps (whole, in two parts, folded, narrow, vendor products) and
loop_infer (every step in one pipeline)."""
from __future__ import annotations

import halide as hl

from .. import bf16
from .common import (_bf16_weight, _clamp, _constrain, _fix_output, _hg_product, _ids_param,
                     _matmul, _param, Pipe, _unit_range, _vec)


def _pack(p: Pipe) -> None:
    G, K, H, P = p.G, p.K, p.H, p.P
    w_ih = _param(p, "w_ih", [K, H, G])      # numpy (G*H, K): PyTorch weight_ih
    w_hh = _param(p, "w_hh", [H, H, G])      # numpy (G*H, H): PyTorch weight_hh
    if p.cpu_bf16:   # bf16 pair panels (bf16.panels): numpy (Hp/P, G, KH, P, 2), (Hp/P, G, HH, P, 2)
        wp_ih = bf16.panels(w_ih, K, H, G, P, "wp_ih")
        wp_hh = bf16.panels(w_hh, H, H, G, P, "wp_hh")
        p.inputs, p.outputs = [w_ih, w_hh], [wp_ih, wp_hh]
        for f, n in ((wp_ih, K), (wp_hh, H)):
            _fix_output(p, f, bf16.panels_extents(n, G, P, p.Hp))
        p.stages = {"wp_ih": wp_ih, "wp_hh": wp_hh}
        return
    # Panels of P units with all gates and the whole reduction axis, the
    # gates in groups of PG (layout panel_gates), so that a P-unit tile of
    # the product of a group's gates reads one contiguous block.
    wp_ih = _transposed_panels(p, w_ih, K, "wp_ih")   # numpy (Hp/P, G/PG, K, PG, P)
    wp_hh = _transposed_panels(p, w_hh, H, "wp_hh")   # numpy (Hp/P, G/PG, H, PG, P)
    p.inputs = [w_ih, w_hh]
    p.outputs = [wp_ih, wp_hh]
    _fix_output(p, wp_ih, p.panel_extents(K))
    _fix_output(p, wp_hh, p.panel_extents(H))
    p.stages = {"wp_ih": wp_ih, "wp_hh": wp_hh}


def _transposed_panels(p: Pipe, w, n: int, name: str):
    """w(k, j, gate) (reduction n) -> f(ji, gi, k, jo) = w(k % n, jo*P + ji,
    gi + PG * (k / n)) (p.panel_extents(n)), zero past H."""
    f = hl.Func(name)
    ji, gate, k, jo = hl.Var("ji"), hl.Var("gate"), hl.Var("k"), hl.Var("jo")
    P, H = p.P, p.H
    j = jo * P + ji
    red, g = (k, gate) if p.PG == p.G else (k % n, gate + p.PG * (k / n))
    f[ji, gate, k, jo] = hl.select(j < H, w[red, hl.min(j, H - 1), g], hl.f32(0))
    return f


def _proj(p: Pipe) -> None:
    """Input projection of every step, batch and time merged into rows
    n = t*B + b (the driver passes 2-D views), so that row tiles fill up
    whatever the batch."""
    j, gate, n = (p.vars[v] for v in ("j", "gate", "t"))
    G, K, H = p.G, p.K, p.H
    b_ih = _param(p, "b_ih", [H, G])                     # numpy (G, H)
    if p.vendor_gemm:
        # xp = the bias on every row; the driver then adds x W_ih^T (a vendor
        # GEMM with beta = 1). Units past H (padding) are never read.
        xp = hl.Func("xp")
        xp[j, gate, n] = b_ih[hl.min(j, H - 1), gate]
        p.inputs = [b_ih]
        p.stages = {"xp": _xp_out(p, xp)}
        return
    x = _param(p, "x", [K, None])                        # numpy (N, K)
    if p.cpu_bf16:
        return _proj_bf16(p, x, b_ih)
    wp_ih = _param(p, "wp_ih", p.panel_extents(K))     # numpy (Hp/P, G/PG, K, PG, P)
    r = hl.RDom([(0, K)], "r_i")
    xin, w = _clamp(x, (1,)), p.panel_weight(wp_ih, j, K)
    # xp rows past H (padding) hold only a bias and are never read.
    xp_acc, xp = _matmul("xp", [j, gate, n], b_ih[hl.min(j, H - 1), gate],
                         lambda: w(gate, r.x) * xin[r.x, n])
    p.inputs = [x, wp_ih, b_ih]
    p.stages = {"xp_acc": xp_acc, "xp": _xp_out(p, xp), "x_in": xin}
    p.rdoms = {"i": r}


def _proj_bf16(p: Pipe, x: hl.ImageParam, b_ih: hl.ImageParam) -> None:
    """_proj with its product of bf16 operands: x's rows rounded to bf16
    (rows past N clamped: a tile has 16 rows, and its rows past N are
    never stored), times W_ih's bf16 panels."""
    j, gate, n = (p.vars[v] for v in ("j", "gate", "t"))
    G, K, H, P = p.G, p.K, p.H, p.P
    wp_ih = _bf16_weight(p, "wp_ih", K)
    x_bf = bf16.rows(_clamp(x, (1,)), K, "x_bf")
    acc, tile, r = bf16.product("xp", x_bf, wp_ih, K, G)
    xp = hl.Func("xp")
    xp[j, gate, n] = bf16.at(tile, j, n, gate, P) + b_ih[hl.min(j, H - 1), gate]
    p.inputs = [x, wp_ih, b_ih]
    p.stages = {"x_bf": x_bf, "xp_bf16sum": acc, "xp_tile": tile, "xp": _xp_out(p, xp)}
    p.rdoms = {"i": r}


def _xp_out(p: Pipe, xp: hl.Func) -> hl.Func:
    """The projection's output (stage "xp"): xp(j, gate, n) itself, numpy
    (N, G, Hp); or with xp_panels, xp_panels(ji, gate, n, jo) = xp(jo*P + ji,
    gate, n), numpy (Hp/P, N, G, P): a step's rows of one panel are then
    one contiguous block (B*G*P floats) read in order, and a tile of the
    projection writes one contiguous run, where the plain layout scatters
    both over lines G*Hp floats apart. A K=H=512 B=64 step spent about 10%
    of its time on its reads of xp (host-profile, 0.367 against 0.331 ms
    with xp replaced by a formula)."""
    G, P = p.G, p.P
    if p.xp_panels:
        j, gate, n = xp.args()
        ji, jo = hl.Var("ji"), hl.Var("jo")
        out = hl.Func("xp_panels")
        out[ji, gate, n, jo] = xp[jo * P + ji, gate, n]
        _fix_output(p, out, [P, G, None, p.Hp // P])
    else:
        out = xp
        _fix_output(p, out, [p.Hp, G, None])
    p.outputs = [out]
    return out


def _gather(p: Pipe) -> None:
    """The projection of one-hot rows given as indices: xp(j, gate, n) =
    w_ih(ids(n), j, gate) + b_ih(j, gate), read from the panels halstm_pack
    made of W_ih (numpy (Hp/P, G/PG, K, PG, P)), where a class's P units of a
    gate group are one contiguous block."""
    j, gate, n = (p.vars[v] for v in ("j", "gate", "t"))
    G, K, H, P = p.G, p.K, p.H, p.P
    ids = _ids_param(p)                                # numpy (N,)
    b_ih = _param(p, "b_ih", [H, G])                     # numpy (G, H)
    c = hl.clamp(ids[n], 0, K - 1)
    if p.cpu_bf16:   # the class's column of W_ih's bf16 panels (bf16.panels)
        wp_ih = _bf16_weight(p, "wp_ih", K)
        column = bf16.widened(bf16.weight(wp_ih, c, j % P, gate, j / P, K, G))
    else:
        wp_ih = _param(p, "wp_ih", p.panel_extents(K))   # numpy (Hp/P, G/PG, K, PG, P)
        column = p.panel_weight(wp_ih, j, K)(gate, c)
    xp = hl.Func("xp")
    xp[j, gate, n] = column + b_ih[hl.min(j, H - 1), gate]   # (units past H: never read)
    p.inputs = [ids, wp_ih, b_ih]
    p.stages = {"xp": _xp_out(p, xp)}


def _xp_param(p: Pipe) -> hl.ImageParam:
    """xp, the projected inputs of a step's rows or of every step's (N
    rows), as the driver hands them: numpy (N, G, Hp), or with xp_panels
    (Hp/P, N, G, P) (see _xp_out)."""
    if p.xp_panels:
        return _param(p, "xp", [p.P, p.G, None, p.Hp // p.P])
    return _param(p, "xp", [p.Hp, p.G, None])


def _step(p: Pipe, save: bool = True, product: str = "", fold: bool = False) -> None:
    """One time step. Its outputs are one Func over (j, b) whose Tuple holds
    the new states and (save) the saved channels, so that a schedule can
    compute the recurrent product, the cell and every store in one loop
    nest. product "input": the product is an input (hg, in place of
    wp_hh), the driver's vendor GEMM; "biased": an input with b_hh added
    (step_product's; no b_hh input). fold (with "biased"): the Tuple also
    holds the next step's product on the new h, one element a gate
    (FOLD_FWD), whose inputs wp_hh and b_hh come last."""
    vendor = bool(product)
    cell, G, H, P = p.cell, p.G, p.H, p.P
    j, gate, b = (p.vars[n] for n in ("j", "gate", "b"))
    S = len(cell.saved_channels(H))
    xp = _xp_param(p)                  # step t's rows: xp[:, t] or xp[t]
    if p.xp_panels:
        xp_in = hl.Func("xp_in")
        xb = _clamp(xp, (2,))
        xp_in[j, gate, b] = xb[j % P, gate, b, j / P]
    else:
        xp_in = _clamp(xp, (2,))
    b_hh = [] if product == "biased" else [_param(p, "b_hh", [H, G])]     # numpy (G, H)
    if vendor:   # the driver's vendor GEMM gives h W_hh^T: numpy (B, G, Hp), H used
        # (product "input" with vendor_splits: numpy (splits, B, G, Hp), the
        # products of slices of h's units, summed here)
        splits = p.vendor_splits if product == "input" else 1
        recurrent = _param(p, "hg", [p.Hp, G, None] + ([splits] if splits > 1 else []))
        hg_in = _clamp(recurrent, (2,))
        total = hg_in[j, gate, b] if splits == 1 else sum(
            (hg_in[j, gate, b, s] for s in range(1, splits)), hg_in[j, gate, b, 0])
        hg = hl.Func("hg")
        hg[j, gate, b] = total + b_hh[0][hl.min(j, H - 1), gate] if b_hh else total
    elif p.cpu_bf16:
        recurrent = _bf16_weight(p, "wp_hh", H)
    else:
        recurrent = _param(p, "wp_hh", p.panel_extents(H))    # numpy (Hp/P, G/PG, H, PG, P)
    prev = {s: _param(p, s + "_prev", [H, None]) for s in cell.states}  # (B, H)
    # unit and batch reads clamped: a tile may overrun H (up to Hp) and B
    prev_in = {s: _clamp(q, (0, 1)) for s, q in prev.items()}
    r = hl.RDom([(0, H)], "r_k")
    product_stages = {}
    if p.cpu_bf16:   # h's rows in bf16 times W_hh's bf16 panels
        h_bf = bf16.rows(prev_in["h"], H, "h_bf")
        hg_bf16sum, hg_tile, r = bf16.product("hg", h_bf, recurrent, H, G)
        hg = hl.Func("hg")
        hg[j, gate, b] = bf16.at(hg_tile, j, b, gate, P) + b_hh[0][hl.min(j, H - 1), gate]
        product_stages = {"h_bf": h_bf, "hg_bf16sum": hg_bf16sum, "hg_tile": hg_tile}
    elif not vendor:
        hg_acc, hg = _hg_product(p, recurrent, b_hh[0], prev_in["h"], r)     # (B, G, Hp)
        product_stages = {"hg_acc": hg_acc}
    vec, vec_in = _vec(p)
    saved, new = cell.forward(xp_in, hg, prev_in, vec_in, H, j, b)
    p.reductions, p.stagings = list(cell.reductions), list(cell.stagings)
    p.reduction_groups, p.staging_groups = cell.reduction_groups(), cell.staging_groups()
    p.row_func_groups, p.saved_levels = cell.row_func_groups(), list(cell.saved_levels)
    folded, nexts = [], []
    if fold:     # the next step's product on the new h, itself a stage
        folded = [_param(p, "wp_hh", p.panel_extents(H)),     # numpy (Hp/P, G/PG, H, PG, P)
                  _param(p, "b_hh", [H, G])]                     # numpy (G, H)
        h_next = hl.Func("h_next")
        h_next[j, b] = new["h"][j, b]
        new = {**new, "h": h_next}
        next_acc, next_hg = _hg_product(p, folded[0], folded[1], h_next, r, "hg_next")
        nexts = [next_hg[j, g, b] for g in range(G)]
    # with bf16 vendor GEMMs, also h's bf16 bits: the next step's product reads them
    bits = product == "input" and p.vendor_bf16
    out = hl.Func("step_out")
    out[j, b] = hl.Tuple([new[s][j, b] for s in cell.states] +
                         [saved[j, c, b] for c in range(S if save else 0)] +
                         ([bf16.bits(new["h"][j, b])] if bits else []) + nexts)
    p.inputs = [xp, recurrent] + b_hh + [prev[s] for s in cell.states] + vec + folded
    p.outputs = [out]
    # new states (B, H) rows of (T+1, B, H); saved channel c: (B, H) rows
    # of saved[t] (B, S, H), so a row stride of S*H; h's bits (B, H); the
    # next product's gate g: (B, H) of its (B, G, Hp), a row stride of G*Hp
    bufs = out.output_buffers()
    for n, q in enumerate(bufs):
        dense = n < len(cell.states) or (bits and n == len(bufs) - 1)
        stride = G * p.Hp if n >= len(bufs) - len(nexts) else None if dense else S * H
        _constrain(q, [H, None], None if stride is None else [1, stride],
                   bounds=n == 0 and not p.split_steps)
    p.shapes[out.name()] = [H, None]
    if p.split_steps:
        _unit_range(p, [(out.output_buffers()[0], H)])
    p.stages = {"hg": hg, "saved": saved, "out": out, **product_stages,
                **({"h_next": h_next, "hg_next_acc": next_acc} if fold else {}),
                **{"new_" + s: new[s] for s in cell.states},
                **{"prev_in_" + s: prev_in[s] for s in cell.states}}   # (a schedule may stage h)
    p.rdoms = {"k": r}


def _step_infer(p: Pipe) -> None:
    """A step that stores the new states only (no saved channels)."""
    _step(p, save=False)


_step_narrow, _step_narrow_infer = _step, _step_infer


class _At:
    """f[args] as fn(*args): an indexable of Exprs (DefinedCell.step_exprs
    reads its inputs by index)."""

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, args):
        return self.fn(*args)


def _loop_infer(p: Pipe) -> None:
    """Every step of a forward that no backward follows (LOOP): output
    per state the states array (T+1, B, H), step 0 the initial state (read,
    not written), a Func whose update runs steps 1..T in order. Halide lets
    an update read its own Func only with its pure variables in place, so
    the units are an RVar (the step reads every unit of the state before
    it) and the step's product is, per gate, b_hh plus an H-term sum
    written out: Exprs, not a Func that would read the update's own output
    (DefinedCell.step_exprs)."""
    cell, G, H, P = p.cell, p.G, p.H, p.P
    j, gate, b, t = (p.vars[n] for n in ("j", "gate", "b", "t"))
    NS = len(cell.states)
    xp = _xp_param(p)                  # N = T*B rows, row t*B + b: step t+1's row b
    wp_hh = _param(p, "wp_hh", p.panel_extents(H))          # numpy (Hp/P, G/PG, H, PG, P)
    b_hh = _param(p, "b_hh", [H, G])                         # numpy (G, H)
    vec, vec_in = _vec(p)
    f32 = hl.Float(32)
    out = hl.Func("loop_out")       # (the pure definition writes nothing: step 0 stays)
    out[j, b, t] = hl.undef(f32) if NS == 1 else tuple(hl.undef(f32) for _ in range(NS))
    first = out.output_buffers()[0]
    B, T, t0 = first.dim(1).extent(), first.dim(2).extent() - 1, first.dim(2).min()
    xs = hl.Func("xs")           # step t's xp (a stage of the step loop: see cuda.loop_infer)
    row = (t - t0 - 1) * B + b
    xs[j, gate, b, t] = (xp[j % P, gate, row, j / P] if p.xp_panels else xp[j, gate, row])
    r = hl.RDom([(0, H), (t0 + 1, T)], "r_loop")
    unit, step = r.x, r.y

    def prev(s, k):   # state s of unit k before the step
        # (max: step - 1 whatever the step, but Halide cannot prove that the
        # read misses the step's own write, so it computes every state of a
        # cell before storing any: with the states' stores apart, each state
        # recomputed the products it shares with the others)
        last = out[k, b, hl.max(step - 1, t0)]
        return last if NS == 1 else last[s]

    # W_hh's gate g (H, H): w_loop[g][j, k] = W_hh[g*H + j, k]; a stage of
    # its own a gate, so that a schedule may keep some gates on chip
    kv = hl.Var("k")
    w = p.panel_weight(wp_hh, j, H)
    w_loop = [hl.Func(f"w_loop{g}") for g in range(G)]
    for g, f in enumerate(w_loop):
        f[j, kv] = w(g, kv)

    def product(u, g):   # b_hh + W_hh h at unit u, gate g
        return sum((w_loop[g][u, k] * prev(0, k) for k in range(H)), b_hh[u, g])
    new = cell.step_exprs(_At(lambda u, g, _: xs[u, g, b, step]), _At(lambda u, g, _: product(u, g)),
                          {s: _At(lambda u, _, n=n: prev(n, u)) for n, s in enumerate(cell.states)},
                          vec_in, H, unit, b)
    values = [new[s] for s in cell.states]
    out[unit, b, step] = values[0] if NS == 1 else hl.Tuple(values)
    for n, q in enumerate(out.output_buffers()):     # each state (T+1, B, H)
        _constrain(q, [H, None, None], bounds=n == 0)
    p.inputs = [xp, wp_hh, b_hh] + vec
    p.outputs = [out]
    p.shapes[out.name()] = [H, None, None]
    p.stages = {"out": out, "xs": xs, **{f"w_loop{g}": f for g, f in enumerate(w_loop)}}
    p.rdoms = {"loop": r}


def _step_vendor(p: Pipe) -> None:
    _step(p, product="input")


def _step_vendor_infer(p: Pipe) -> None:
    _step(p, save=False, product="input")


def _step_cell(p: Pipe) -> None:
    _step(p, product="biased")


def _step_cell_infer(p: Pipe) -> None:
    _step(p, save=False, product="biased")


def _step_fold(p: Pipe) -> None:
    _step(p, product="biased", fold=True)


def _step_fold_infer(p: Pipe) -> None:
    _step(p, save=False, product="biased", fold=True)


def _step_product(p: Pipe) -> None:
    """A step's recurrent product alone, hg = b_hh + h W_hh^T (summed as
    step's, so that the results are the same), on the driver's ranges of
    units (see UNITS_FWD), or on every unit without split steps: numpy (B,
    G, Hp)."""
    G, H = p.G, p.H
    p.split_rows_only = False
    wp_hh = _param(p, "wp_hh", p.panel_extents(H))          # numpy (Hp/P, G/PG, H, PG, P)
    h = _param(p, "h_prev", [H, None])                        # numpy (B, H)
    b_hh = _param(p, "b_hh", [H, G])                          # numpy (G, H)
    h_in = _clamp(h, (0, 1))    # (a tile may overrun B)
    r = hl.RDom([(0, H)], "r_k")
    hg_acc, hg = _hg_product(p, wp_hh, b_hh, h_in, r)
    p.inputs, p.outputs = [wp_hh, b_hh, h], [hg]
    _constrain(hg.output_buffer(), [p.Hp, G, None], bounds=False)
    hg.output_buffer().dim(1).set_bounds(0, G)
    p.shapes[hg.name()] = [p.Hp, G, None]
    if p.split_steps:     # the units of _unit_range's panels
        _unit_range(p, [(hg.output_buffer(), p.Hp)])
    else:                 # every unit (the first of folded steps: FOLD_FWD)
        hg.output_buffer().dim(0).set_bounds(0, p.Hp)
    p.stages = {"hg_acc": hg_acc, "hg": hg, "prev_in_h": h_in}
    p.rdoms = {"k": r}
