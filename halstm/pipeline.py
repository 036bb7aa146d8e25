"""One recurrent layer over a sequence, as Halide pipelines built from a cell.

A layer runs as a few pipelines that the compiled library's driver
(aot.py) calls; the time loop lives in that C++ driver, never in Python:

    forward:   pack     (once)    PyTorch weights -> transposed panels
               proj     (once)    xp = W_ih x + b_ih for all T steps (one GEMM)
               step     (T times) hg = W_hh h + b_hh, then the cell
    backward:  pack_bwd (once)    PyTorch weights -> panels along the input axis
               step_bwd (T times, reversed) cell backward, dh_prev = W_hh^T dhg
               grads    (once)    dx, dW_ih, db_ih, dW_hh, db_hh over all steps
    one-hot:   gather   (once)    xp = W_ih[:, ids] + b_ih (instead of proj)
               grads_ids (once)   as grads, dW_ih a scatter-add over ids, no dx

Axes are Halide's, innermost first; the numpy shape of the same buffer is
the reverse (runtime.py owns that convention). K = the layer's input size,
H = hidden size, G = the cell's gate count, S = its saved channel count,
V = its vector parameters' channel count (each H values; the steps take
them as one input, numpy (V, H), and step_bwd writes their per-row
gradients, which grads sums).
T and B are runtime values: one library serves every sequence length and
batch. Stages are named so that schedules can find them (Pipe.stage).
Weights are packed in panels of P units (P chosen by the schedule, a
vector's lanes), so that a P-unit tile of a product reads one contiguous
block; buffers written along a packed axis are padded to a multiple of P.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import halide as hl

from . import bf16
from .cells.base import Cell
from .layout import Layout

KINDS = ("pack", "proj", "step", "step_infer", "pack_bwd", "step_bwd", "step_bwd_fused",
         "step_bwd_units", "grads", "gather", "grads_ids", "step_vendor", "step_vendor_infer",
         "step_bwd_vendor", "to_bf16", "step_product", "step_cell", "step_cell_infer",
         "step_bwd_cell", "step_bwd_product", "step_fold", "step_fold_infer", "step_bwd_fold",
         "step_narrow", "step_narrow_infer", "loop_infer", "step_bwd_bf16")
# step_infer: a step that stores the new states only (a forward pass that
# no backward follows: halstm.no_grad())
FORWARD = ("pack", "proj", "step", "step_infer")
BACKWARD = ("pack_bwd", "step_bwd", "grads")
# A layer fed one-hot vectors given as class indices (a char LM's first
# layer): the projection is a gather of W_ih's columns, dW_ih a scatter-add
# of the rows of dxp, and there is no input gradient.
FORWARD_IDS = ("pack", "gather", "step", "step_infer")
BACKWARD_IDS = ("pack_bwd", "step_bwd", "grads_ids")
# A schedule whose layout sets fused_bwd_below runs the backward time loop
# of hidden sizes below it as step_bwd_fused, one kernel a step, instead of
# step_bwd (see there).
FUSED_BWD = {"step_bwd": "step_bwd_fused"}
# Where the driver's threads take a backward step's batch rows only (a cell
# that reduces over units: Layout split rows_only), step_bwd_units is the
# same step on ranges of units: each thread computes the pointwise part of
# every unit (its sums need them all) and its own units' outputs and
# product. The driver calls it where the batch has too few rows for two
# ranges. Where ranges of rows would each read too large a W_hh, a step
# runs in two parts instead: step_bwd_cell, the pointwise part on ranges of
# rows (its dh_prev the pointwise term alone), then step_bwd_product,
# dh_prev = that term + W_hh^T dhg, on ranges of units.
UNITS_BWD = ("step_bwd_units", "step_bwd_cell", "step_bwd_product")
# ... and forward, a step may run in two parts: step_product, the recurrent
# product on ranges of units, then, once every thread's units are in,
# step_cell (step_cell_infer) on ranges of rows: the rest of the step,
# reading that product. The driver calls them where ranges of rows would
# be too few or would each read too large a W_hh.
UNITS_FWD = ("step_product", "step_cell", "step_cell_infer")
# On a GPU a step that reduces over units is two kernels (the product for
# every unit, then a block a batch row). Where the layout folds steps
# (Layout.fold_steps), step_fold is one: the rest of step t on the product
# the last call left, then step t+1's product on the new h, each block of
# the product's grid computing its batch row's rest (every unit) first.
# The driver's loop: step_product (the first step's product), then
# step_fold (step_fold_infer) once a step.
FOLD_FWD = ("step_product", "step_fold", "step_fold_infer")
# ... and backward, step_bwd_fold is step_bwd as one kernel: each block of
# its product dh_prev = W_hh^T dhg computes its batch row's pointwise
# backward (every unit) first. The driver calls it in step_bwd's place.
FOLD_BWD = ("step_bwd_fold",)
# Where the layout has narrow_rows, the forward also has step_narrow and
# step_narrow_infer: step and step_infer themselves, scheduled for steps of
# few batch rows; the driver calls them for steps of up to narrow_rows rows.
NARROW = ("step_narrow", "step_narrow_infer")
# With bf16 products (Layout.cpu_bf16), a backward of fused steps also has
# step_bwd_bf16: step_bwd_fused with its product of bf16 operands, which the
# driver calls for steps of more than narrow_rows rows.
BF16_BWD = ("step_bwd_bf16",)
# Where the layout has loop_rows, the forward also has loop_infer: a
# forward that no backward follows with every step in one pipeline, for a
# cell without sums over units; the driver calls it once, in place of the
# steps, for batches of up to loop_rows rows without batch sizes.
LOOP = ("loop_infer",)
# With vendor GEMMs (Layout.vendor_gemm) a layer also has steps whose
# recurrent product the driver runs (h W_hh^T, dhg W_hh) as a vendor GEMM:
# the pipelines are the pointwise rest, used where a step has many rows.
VENDOR_STEPS = {"fwd": ("step_vendor", "step_vendor_infer"), "bwd": ("step_bwd_vendor",)}
# With Layout.vendor_bf16, to_bf16 rounds the vendor GEMMs' operands to
# bfloat16 copies (the driver calls it before each GEMM that needs one),
# and the vendor steps store their product's operand (h, dhg) in bf16 too.


class Stages:
    """Lookup of a built pipeline's named stages (kind, stages and outputs
    are the subclass's fields), for schedules, which name stages only."""

    def stage(self, name: str) -> hl.Func:
        try:
            return self.stages[name]
        except KeyError:
            raise KeyError(f"pipeline {self.kind!r} has no stage {name!r}; "
                           f"it has {sorted(self.stages)}") from None

    def pipeline(self) -> hl.Pipeline:
        return hl.Pipeline(self.outputs)


@dataclass
class Pipe(Stages):
    """A built pipeline: its arguments in C ABI order and its named stages.

    P is the panel width of the packed weights (set by the schedule: a
    vector's lanes); Hp and Kp are H and K rounded up to P."""

    kind: str
    cell: Cell
    K: int
    H: int
    P: int = 1
    panel_gates: int = 0  # a weight panel's gates in groups of this many (layout; 0: all)
    dw_cols: int = 1     # weight-gradient tile: input units per tile (a panel of x or h)
    dw_rows: int = 1     # ... and hidden units per tile (a panel of dxp)
    read_outputs: bool = False   # later stages may read an output (see _step_bwd)
    split_steps: bool = False    # the driver runs a step's units in ranges (see _unit_range)
    xp_panels: bool = False      # xp stored in panels of P units (see _xp_out)
    raw_bwd: bool = False        # the backward reads w_ih, w_hh as given (see _bwd_weight)
    split_rows_only: bool = False  # split_steps in ranges of rows only: every unit (layout)
    split_quantum: int = 1       # (set by the schedule) panels the driver's ranges are made of
    split_quantum_small: int = 0  # (set by the schedule) ... where a step may have fewer
    split_small_below: int = 0    # rows than this (0: split_quantum whatever the rows)
    split_batch_bytes: int = 0   # (set by the schedule) ranges of rows up to this size of W_hh
    vendor_gemm: bool = False    # the driver runs the GEMMs of proj and grads (see _proj)
    vendor_bf16: bool = False    # ... on bf16 operands: vendor steps also store h (dhg) in bf16
    vendor_splits: int = 1       # forward vendor steps: partial products (vendor_step_splits)
    cpu_bf16: bool = False       # CPU: products of bf16 operands (bf16.py) ...
    amx_tiles: bool = False      # ... on AMX tiles (else in vector registers)
    bf16_dw_rows: int = 0         # ... the weight gradients' rows in chunks of (_bf16_grads)
    inputs: list = field(default_factory=list)   # ImageParams, argument order
    outputs: list = field(default_factory=list)  # Funcs, argument order
    stages: dict = field(default_factory=dict)   # name -> Func
    vars: dict = field(default_factory=dict)     # name -> Var
    rdoms: dict = field(default_factory=dict)    # name -> RDom
    shapes: dict = field(default_factory=dict)   # input/output name -> extents (None: runtime)
    notes: list = field(default_factory=list)    # the schedule's shape-dependent choices (manifest)
    reductions: list = field(default_factory=list)  # the cell's Funcs over b (sums over units)
    reduction_groups: list = field(default_factory=list)  # them by level (Cell.reduction_groups)
    stagings: list = field(default_factory=list)    # its Funcs over (unit, b) (cells.lowering)
    staging_groups: list = field(default_factory=list)   # them as Cell.staging_groups
    row_func_groups: list = field(default_factory=list)  # Cell.row_func_groups: Funcs over b
    knobs: dict = field(default_factory=dict)    # the schedule's knob values other than its defaults

    @property
    def G(self) -> int:
        return self.cell.n_gates

    @property
    def V(self) -> int:
        return len(self.cell.channels)

    @property
    def Hp(self) -> int:
        return padded(self.H, self.P)

    @property
    def Kp(self) -> int:
        return padded(self.K, self.P)

    @property
    def PG(self) -> int:
        """Gates a weight panel's group holds (layout panel_gates)."""
        return self.panel_gates or self.G

    def panel_extents(self, n: int) -> list:
        """A forward weight of reduction n in panels (pack's wp_ih, wp_hh):
        numpy (Hp/P, G/PG, n, PG, P), as Halide extents with the groups and
        the reduction as one axis (each group's reduction contiguous)."""
        return [self.P, self.PG, self.G // self.PG * n, self.Hp // self.P]

    def panel_weight(self, w, j, n: int):
        """w (panel_extents(n)) at unit j, as a function of (gate, k)."""
        P, PG = self.P, self.PG
        if PG == self.G:
            return lambda gate, k: w[j % P, gate, k, j / P]
        return lambda gate, k: w[j % P, gate % PG, gate / PG * n + k, j / P]

    def param(self, name: str) -> hl.ImageParam:
        """The input called `name`."""
        for q in self.inputs:
            if q.name() == name:
                return q
        raise KeyError(f"pipeline {self.kind!r} has no input {name!r}")


def padded(n: int, p: int) -> int:
    return -(-n // p) * p


def _param(p: "Pipe", name: str, extents, strides=None) -> hl.ImageParam:
    """A float32 input of pipe p, its extents recorded in p.shapes.
    extents: innermost first; an int fixes that extent (and the stride of
    the next dense dimension), None leaves it free. strides: explicit
    strides overriding the dense ones (None entries free)."""
    q = hl.ImageParam(hl.Float(32), len(extents), name)
    _constrain(q, extents, strides)
    p.shapes[name] = list(extents)
    return q


def _constrain(buf, extents, strides=None, bounds=True) -> None:
    """Set strides (dense unless given) and, with bounds, the fixed extents.
    (A Tuple's outputs after the first share the first's bounds.)"""
    stride = 1
    for d, e in enumerate(extents):
        if strides is not None and strides[d] is not None:
            stride = strides[d]
        if stride is not None:
            buf.dim(d).set_stride(stride)
        if e is None:
            stride = None
        else:
            if bounds:
                buf.dim(d).set_bounds(0, e)
            stride = stride * e if stride is not None else None


def _fix_output(p: "Pipe", f: hl.Func, extents, strides=None) -> None:
    """Constrain an output buffer of pipe p like _param constrains an input."""
    _constrain(f.output_buffer(), extents, strides)
    p.shapes[f.name()] = list(extents)


def _output(f: hl.Func) -> hl.Func:
    """A copy of f to be the pipeline's output, so that no stage reads an
    output buffer: Halide 21 assumes such reads are vector-aligned (as for
    its own allocations) and emitted aligned AVX-512 loads that faulted on a
    numpy-owned buffer (seen at H=32)."""
    out = hl.Func(f.name() + "_out")
    out[f.args()] = f[f.args()]
    return out


def _clamp(p: hl.ImageParam, dims) -> hl.Func:
    """p with the indices of `dims` clamped into range, so that a schedule
    may round batch (or unit) loops up without reading out of bounds."""
    f = hl.Func(p.name() + "_in")
    # named as the pipelines' unit and row variables (first and last), so
    # that a schedule may load several inputs in one loop (compute_with
    # fuses loops of the same names)
    n = p.dimensions()
    args = [hl.Var("j" if d == 0 else "b" if d == n - 1 else f"a{d}") for d in range(n)]
    idx = [hl.clamp(a, 0, p.dim(d).extent() - 1) if d in dims else a
           for d, a in enumerate(args)]
    f[args] = p[idx]
    return f


def _matmul(name, args, init, term):
    """A sum as two stages: `name_acc` (init, then += term() over the RDom
    inside term) and `name`, a copy of it, so that a schedule can keep a tile
    of the accumulator in registers and store it once."""
    acc = hl.Func(name + "_acc")
    acc[args] = init
    acc[args] += term()
    out = hl.Func(name)
    out[args] = acc[args]
    return acc, out


def _hg_product(p: "Pipe", wp_hh, b_hh, h_in, r, name: str = "hg") -> tuple:
    """hg (B, G, Hp) = b_hh + h W_hh^T over r (h's units) as _matmul's
    `name_acc` and `name`; step, step_product and step_fold all sum it so,
    for the same results."""
    j, gate, b = (p.vars[n] for n in ("j", "gate", "b"))
    w = p.panel_weight(wp_hh, j, p.H)
    return _matmul(name, [j, gate, b], b_hh[hl.min(j, p.H - 1), gate],
                   lambda: w(gate, r.x) * h_in[r.x, b])


def _dh_product(p: "Pipe", w, init, dhg_in, r, unit: str = "k") -> tuple:
    """dh_prev (B, Hp) = init + W_hh^T dhg over r (dhg's units, gates) as
    _matmul's `dh_prev_acc` and `dh_prev` over (unit, b); step_bwd,
    step_bwd_product and step_bwd_fold all sum it so."""
    return _matmul("dh_prev", [p.vars[unit], p.vars["b"]], init,
                   lambda: w(r.x, r.y) * dhg_in[r.x, r.y, p.vars["b"]])


def build(cell: Cell, kind: str, K: int, H: int, layout: Layout = Layout()) -> Pipe:
    """Build pipeline `kind` (one of KINDS) for `cell` with input size K,
    its operands packed as the schedule's layout says (default: unpacked)."""
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")
    p = Pipe(kind, cell, K, H, layout.panel, layout.panel_gates, layout.dw_cols, layout.dw_rows,
             layout.read_outputs, layout.split is not None, layout.xp_panels,
             layout.raw_bwd_weights,
             split_rows_only=layout.split is not None and layout.split.rows_only,
             vendor_gemm=layout.vendor_gemm, vendor_bf16=layout.vendor_bf16,
             vendor_splits=layout.vendor_step_splits, cpu_bf16=layout.cpu_bf16,
             amx_tiles=layout.amx_tiles, bf16_dw_rows=layout.bf16_dw_rows)
    p.vars = {n: hl.Var(n) for n in ("i", "j", "k", "gate", "s", "b", "t")}
    globals()["_" + kind](p)
    return p


def _panels(w: hl.ImageParam, n: int, P: int, name: str) -> hl.Func:
    """w(k, j, gate) with k (extent n) split into panels:
    f(ki, j, gate, ko) = w(ko*P + ki, j, gate), zero past n."""
    f = hl.Func(name)
    ki, j, gate, ko = hl.Var("ki"), hl.Var("j"), hl.Var("gate"), hl.Var("ko")
    k = ko * P + ki
    f[ki, j, gate, ko] = hl.select(k < n, w[hl.min(k, n - 1), j, gate], hl.f32(0))
    return f


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


def _packed(w, j, P):
    """Read a panel-packed weight at unit j: w(j % P, ..., j / P)."""
    return lambda *mid: w[[j % P, *mid, j / P]]


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


def _bf16_weight(p: Pipe, name: str, n: int, gates: int = 0) -> hl.ImageParam:
    """A weight packed in bf16 pair panels (bf16.panels) by _pack (or
    _pack_bwd), n its reduction, `gates` its gates (0: the cell's)."""
    q = hl.ImageParam(hl.BFloat(16), 3, name)
    # only the innermost stride fixed: with every stride constant Halide 21
    # no longer recognises the product as an AMX tile product (schedules
    # without AMX fix the others: bf16_vectors.fixed_panels)
    q.dim(0).set_stride(1)
    p.shapes[name] = bf16.panels_extents(n, gates or p.G, p.P, p.Hp)
    return q


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


def _ids_param(p: "Pipe") -> hl.ImageParam:
    """Class indices, one per row n = t*B + b (int32; numpy (N,))."""
    ids = hl.ImageParam(hl.Int(32), 1, "ids")
    ids.dim(0).set_stride(1)
    p.shapes["ids"] = [None]
    return ids


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


def _vec(p: Pipe) -> tuple:
    """The vector parameters: ([the input] or [] without any, Func(j,
    channel) with units clamped)."""
    if not p.V:
        none = hl.Func("no_vec")
        none[hl.Var("j"), hl.Var("c")] = hl.f32(0)
        return [], none
    vec = _param(p, "vec", [p.H, p.V])                   # numpy (V, H)
    return [vec], _clamp(vec, (0,))


def _dvec_sums(p: Pipe, dims) -> tuple:
    """A backward step's input of the vector gradients so far: ([the
    input] or [] without vector parameters, Func(j, channel, b) with
    `dims` clamped). Numpy (B, V, H): per batch row, its sums over the
    steps after this one; a step's output adds its own (the driver
    alternates two such arrays), so the gradients' pipeline sums B rows,
    not T*B."""
    if not p.V:
        return [], None
    sums = _param(p, "dvec_sums", [p.H, p.V, None])
    return [sums], _clamp(sums, dims)


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
    p.row_func_groups = cell.row_func_groups()
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


def _unit_range(p: Pipe, bufs) -> None:
    """With split_steps, a step computes the units of panels [panel0,
    panel0 + panels) only: the driver calls it on each of its threads with
    output views cropped to that range (inputs whole), so that the threads
    meet at a spin barrier between steps rather than in a thread pool's
    fork and join (or with the whole range and a crop of batch rows: see
    driver.cpp run_split). The range starts at a multiple of P, which the compiler
    then knows (a panel's units stay aligned). bufs: (output buffer, its
    whole extent along units)."""
    panel0, panels = hl.Param(hl.Int(32), "panel0"), hl.Param(hl.Int(32), "panels")
    p.inputs += [panel0, panels]
    if p.split_rows_only:   # every unit, known statically (clamped unit reads vectorize)
        for q, extent in bufs:
            q.dim(0).set_bounds(0, extent)
        return
    start = p.P * panel0
    for q, extent in bufs:
        q.dim(0).set_bounds(start, hl.min(p.P * panels, extent - start))


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
    per state its values after each step (T, B, H), a Func whose update
    runs the steps in order. Halide lets an update read its own Func only
    with its pure variables in place, so the units are an RVar (the step
    reads every unit of the state before it) and the step's product is,
    per gate, b_hh plus an H-term sum written out: Exprs, not a Func that
    would read the update's own output (DefinedCell.step_exprs)."""
    cell, G, H, P = p.cell, p.G, p.H, p.P
    j, gate, b, t = (p.vars[n] for n in ("j", "gate", "b", "t"))
    NS = len(cell.states)
    xp = _xp_param(p)                  # N = T*B rows, row t*B + b: step t's row b
    wp_hh = _param(p, "wp_hh", p.panel_extents(H))          # numpy (Hp/P, G/PG, H, PG, P)
    b_hh = _param(p, "b_hh", [H, G])                         # numpy (G, H)
    init = [_param(p, s + "_0", [H, None]) for s in cell.states]   # (B, H)
    vec, vec_in = _vec(p)
    f32 = hl.Float(32)
    out = hl.Func("loop_out")
    out[j, b, t] = hl.undef(f32) if NS == 1 else tuple(hl.undef(f32) for _ in range(NS))
    first = out.output_buffers()[0]
    B, T = first.dim(1).extent(), first.dim(2).extent()
    xs = hl.Func("xs")           # step t's xp (a stage of the step loop: see cuda.loop_infer)
    row = t * B + b
    xs[j, gate, b, t] = (xp[j % P, gate, row, j / P] if p.xp_panels else xp[j, gate, row])
    r = hl.RDom([(0, H), (0, T)], "r_loop")
    unit, step = r.x, r.y

    def prev(s, k):   # state s of unit k before the step
        last = out[k, b, hl.max(step - 1, 0)]
        return hl.select(step == 0, init[s][k, b], last if NS == 1 else last[s])

    def product(u, g):   # b_hh + W_hh h at unit u, gate g
        w = p.panel_weight(wp_hh, u, H)
        return sum((w(g, k) * prev(0, k) for k in range(H)), b_hh[u, g])
    new = cell.step_exprs(_At(lambda u, g, _: xs[u, g, b, step]), _At(lambda u, g, _: product(u, g)),
                          {s: _At(lambda u, _, n=n: prev(n, u)) for n, s in enumerate(cell.states)},
                          vec_in, H, unit, b)
    values = [new[s] for s in cell.states]
    out[unit, b, step] = values[0] if NS == 1 else hl.Tuple(values)
    # each state (T, B, H): the states array's steps 1..T
    for n, q in enumerate(out.output_buffers()):
        _constrain(q, [H, None, None], bounds=n == 0)
    p.inputs = [xp, wp_hh, b_hh] + init + vec
    p.outputs = [out]
    p.shapes[out.name()] = [H, None, None]
    p.stages = {"out": out, "xs": xs}
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


def _bwd_weight(p: Pipe, name: str, n: int, unit):
    """The weight a backward product reads along its n input units (dh =
    W_hh^T dhg, dx = W_ih^T dxp) at input unit `unit` (up to Hp, resp. Kp):
    (its ImageParam, w(j, gate)). Panels of P input units (pack_bwd's wq,
    zero past n); or, with the layout's raw_bwd_weights, the weight as
    given, its input units clamped at n (a GPU reads it along them just as
    well: no pack_bwd; the results past n are never used)."""
    G, H, P = p.G, p.H, p.P
    if p.raw_bwd:
        w = _param(p, name, [n, H, G])                  # numpy (G*H, n): PyTorch's weight
        return w, lambda j, gate: w[hl.min(unit, n - 1), j, gate]
    wq = _param(p, name.replace("w_", "wq_"), [P, H, G, padded(n, P) // P])  # (np/P, G, H, P)
    return wq, _packed(wq, unit, P)


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


def _gate_rows(d, G: int, H: int, name: str) -> hl.Func:
    """d(j, gate, row) as f(gate*H + j, row): a row's gates one after
    another, the reduction of a product over (gate, unit)."""
    f = hl.Func(name)
    kg, row = hl.Var("kg"), hl.Var("row")
    f[kg, row] = d[kg % H, hl.min(kg / H, G - 1), row]
    return f


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
