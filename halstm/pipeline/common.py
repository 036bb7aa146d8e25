"""What the pipelines of a layer share: Pipe (a built pipeline and its
named stages), the argument and output constraints, the products' and
weights' panel helpers, the vector parameters' inputs."""
from __future__ import annotations

from dataclasses import dataclass, field

import halide as hl

from .. import bf16
from ..cells.base import Cell


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
    proj_serial_macs: int = 0    # (set by the schedule) a projection of fewer MACs runs on the
    #                              calling thread, unless on a shared OpenMP team (0: never)
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
    saved_levels: list = field(default_factory=list)  # Funcs (j, channel, b) "saved" reads
    row_func_groups: list = field(default_factory=list)  # Cell.row_func_groups: Funcs over b
    knobs: dict = field(default_factory=dict)    # the schedule's knob values other than its defaults

    @property
    def G(self) -> int:
        return self.cell.n_gates

    def saved_stages(self) -> list:
        """The forward step's saved values: the Funcs of their lower levels
        (cells.lowering, DefinedCell._leveled), then "saved"; a schedule
        places them alike."""
        return [*self.saved_levels, self.stage("saved")]

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


def _panels(w: hl.ImageParam, n: int, P: int, name: str) -> hl.Func:
    """w(k, j, gate) with k (extent n) split into panels:
    f(ki, j, gate, ko) = w(ko*P + ki, j, gate), zero past n."""
    f = hl.Func(name)
    ki, j, gate, ko = hl.Var("ki"), hl.Var("j"), hl.Var("gate"), hl.Var("ko")
    k = ko * P + ki
    f[ki, j, gate, ko] = hl.select(k < n, w[hl.min(k, n - 1), j, gate], hl.f32(0))
    return f


def _packed(w, j, P):
    """Read a panel-packed weight at unit j: w(j % P, ..., j / P)."""
    return lambda *mid: w[[j % P, *mid, j / P]]


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


def _ids_param(p: "Pipe") -> hl.ImageParam:
    """Class indices, one per row n = t*B + b (int32; numpy (N,))."""
    ids = hl.ImageParam(hl.Int(32), 1, "ids")
    ids.dim(0).set_stride(1)
    p.shapes["ids"] = [None]
    return ids


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


def _gate_rows(d, G: int, H: int, name: str) -> hl.Func:
    """d(j, gate, row) as f(gate*H + j, row): a row's gates one after
    another, the reduction of a product over (gate, unit)."""
    f = hl.Func(name)
    kg, row = hl.Var("kg"), hl.Var("row")
    f[kg, row] = d[kg % H, hl.min(kg / H, G - 1), row]
    return f
