"""The CPU schedule's AMX parts (precision "bf16", Layout.cpu_bf16 with
amx_tiles): the packing, projection and steps of halstm.bf16's products,
as Halide 21 lowers them to AMX tiles, and the steps of few rows without
AMX. The packing, the bf16 rows, the narrow steps and the backward's
operands serve bf16_vectors (CPUs without AMX) too.

Halide recognises a product as AMX work only in this form: the accumulator
stored in an AMX tile (MemoryType 8), computed per 16 x 16 tile of its
copy, its update tiled 16 x 16 with the reduction split by 32 innermost,
atomic and vectorized over all three; the copy reads it out of the tile.
Any predicate on the tile's loads or stores defeats it, so the copy's
tile always has 16 rows (rows past the batch are computed from clamped
rows and never stored).
"""
import halide as hl

from .. import bf16

ROWS = bf16.TILE_ROWS
GUARD = hl.TailStrategy.GuardWithIf


def panels(p, target):
    """The bf16 pair panels f(k2, ji, q), q = kk + NH * (gate + G * jo):
    q split so that the indices are affine in (kk, gate, jo); per 8 kk of
    a panel's gate, 32 lanes (k2, ji) (a transpose of the panel's 16 rows x
    16 reduction values); panels in parallel (bench/RESULTS.md, "Schedule
    decisions": cpu.amx pack)."""
    for name, n in (("wp_ih", p.K), ("wp_hh", p.H)):
        weight_panels(p.stage(name), n, p.G)


def weight_panels(f, n: int, G: int) -> None:
    """panels' schedule of one weight's pair panels f, n its reduction, G
    its gates."""
    k2, ji, q = f.args()
    qo, kk, jo, gate, ko, ki, lanes = (hl.Var(v) for v in
                                        ("qo", "kk", "jo", "gate", "ko", "ki", "lanes"))
    f.split(q, qo, kk, bf16.padded_reduction(n) // 2).split(qo, jo, gate, G)
    f.split(kk, ko, ki, 8).reorder(k2, ji, ki, ko, gate, jo).fuse(k2, ji, lanes)
    f.vectorize(lanes).unroll(ki).parallel(jo)


def rows(f, parallel: bool = True):
    """A bf16 copy of an operand's rows, f(k, row), computed whole: the
    reduction axis vectorized, rows in parallel tiles of 16."""
    k, row = f.args()
    ro, ri = hl.Var("ro"), hl.Var("ri")
    f.compute_root().vectorize(k, bf16.K_CHUNK, GUARD)
    if parallel:
        f.split(row, ro, ri, ROWS, GUARD).parallel(ro)


def product(acc, tile, r, level: hl.LoopLevel, rows_here: bool = False) -> None:
    """acc (AMX) and its copy `tile` (ji, row, gate, jo) computed at `level`:
    16 units by 16 rows, every gate; r: acc's reduction (RDom). rows_here:
    `level` is a loop over panels, and the copy holds every row of its
    panel (in tiles of 16, a gate's tiles in turn) (bench/RESULTS.md,
    "Schedule decisions": cpu.amx tiles)."""
    ji, row, gate, jo = tile.args()[:4]
    # a row stride of 32: a dense 16 x 16 tile's store would simplify to one
    # 256-wide ramp, which the AMX lowering does not take for a tile store
    tile.compute_at(level).bound_extent(ji, 16).align_storage(ji, 32)
    if rows_here:
        ro, ri = hl.Var("ro"), hl.Var("ri")
        tile.split(row, ro, ri, ROWS, hl.TailStrategy.RoundUp).reorder(ji, ri, ro, gate, jo)
        tile.vectorize(ji).vectorize(ri)
        acc.compute_at(tile, ro)
    else:
        tile.bound_extent(row, ROWS).vectorize(ji).vectorize(row).unroll(gate)
        acc.compute_at(tile, gate)
    acc.store_in(bf16.AMX)
    a_ji, a_row = acc.args()[:2]
    ii, ri = hl.Var("ii"), hl.Var("ri")
    acc.tile(a_ji, a_row, ii, ri, 16, ROWS).vectorize(ii).vectorize(ri)
    ko, ki = hl.RVar("ko"), hl.RVar("ki")
    acc.update().tile(a_ji, a_row, ii, ri, 16, ROWS, GUARD).split(r.x, ko, ki, bf16.K_CHUNK) \
        .reorder(ki, ii, ri, ko, a_ji, a_row).atomic().vectorize(ki).vectorize(ii).vectorize(ri)


# The projection's rows in chunks of this many tiles of 16 (192 rows, the
# fp32 projection's default chunk; bench/RESULTS.md, "Schedule decisions":
# cpu.amx tiles).
CHUNK_TILES = 12
# Steps of up to this many batch rows run step_narrow: the same bf16
# products in vector registers, one row at a time, where an AMX tile's 16
# rows would be mostly idle (bench/RESULTS.md, "Schedule decisions":
# cpu.amx narrow rows).
NARROW_ROWS = 3


def proj(p):
    """The projection on AMX tiles: tiles of 16 rows x one panel, every
    gate, rows in chunks; one parallel loop over (chunk, panel) pairs,
    chunk-major, as the fp32 projection's."""
    out = p.stage("xp")
    ji, gate, n, jo = out.args()
    nf, no, ni, nc = (hl.Var(name) for name in ("nf", "no", "ni", "nc"))
    rows(p.stage("x_bf"))
    out.split(n, nf, ni, ROWS, GUARD).split(nf, nc, no, CHUNK_TILES, GUARD)
    out.reorder(ji, gate, ni, no, jo, nc).vectorize(ji).unroll(gate)
    out.fuse(jo, nc, jo).parallel(jo)
    product(p.stage("xp_bf16sum"), p.stage("xp_tile"), p.rdoms["i"], hl.LoopLevel(out, no))


def step(p):
    """A step on AMX tiles: per panel, the gates' products for every row
    (tiles of 16 rows, a gate's in turn), then the cell on tiles of one
    panel x 16 rows; h's bf16 rows first, once a call. The driver's
    threads take ranges of panels only (a range of fewer rows would leave
    an AMX tile's rows idle) (bench/RESULTS.md, "Schedule decisions":
    cpu.amx tiles)."""
    out, bo = _per_panel(p, p.vars["j"], "h_bf", "hg", "k")
    # whole panels at the guarded edge too (the cell's reads are clamped)
    for f in p.saved_stages():
        f.compute_at(out, bo).bound_extent(p.vars["j"], p.P).vectorize(p.vars["j"])
        f.unroll(f.args()[1])
    p.split_quantum = 1
    p.split_batch_bytes = 0


def step_bwd(p):
    """A backward step with its product on AMX tiles (pipeline/backward.py
    _step_bwd_bf16), as step: per panel of units, the product for every
    row (tiles of 16 rows), then the pointwise backward on tiles of one
    panel x 16 rows; dhg_next's bf16 rows first, once a call. The driver's
    threads take ranges of panels (and of rows where its layout says)."""
    _per_panel(p, p.vars["k"], "dhg_bf", "dh", "jg")
    p.split_quantum = 1


def _per_panel(p, unit, bf_rows: str, name: str, rdom: str) -> tuple:
    """A step's out(unit, b) per panel of P units, in tiles of 16 rows
    (step_tiles); the product `name` (its stages name_bf16sum, name_tile,
    reduction p.rdoms[rdom]) per panel for every row. Returns (out, the
    loop over row tiles)."""
    out, uo, bo = step_tiles(p, unit, ROWS, 1, bf_rows)
    product(p.stage(name + "_bf16sum"), p.stage(name + "_tile"), p.rdoms[rdom],
            hl.LoopLevel(out, uo), rows_here=True)
    return out, bo


def step_tiles(p, unit, tile_rows: int, panels: int, bf_rows: str) -> tuple:
    """A step's out(unit, b) in tiles of `panels` panels of P units x
    `tile_rows` rows, in parallel over the tiles of units unless the driver
    splits the step; its product's bf16 rows bf_rows computed whole first,
    once a call. Returns (out, the loop over tiles of units, the loop over
    tiles of rows)."""
    out, b, u = p.stage("out"), p.vars["b"], unit.name()
    uo, ui, bo, bi = hl.Var(u + "o"), hl.Var(u + "i"), hl.Var("bo"), hl.Var("bi")
    rows(p.stage(bf_rows), parallel=not p.split_steps)
    out.split(unit, uo, ui, p.P * panels, GUARD)
    lanes = [ui]
    if panels > 1:      # a vector of each of the tile's panels
        up, uv = hl.Var(u + "p"), hl.Var(u + "v")
        out.split(ui, up, uv, p.P)
        lanes = [uv, up]
    out.split(b, bo, bi, tile_rows, GUARD).reorder(*lanes, bi, bo, uo).vectorize(lanes[0])
    if not p.split_steps:
        out.parallel(uo)
    return out, uo, bo


def step_narrow(p, panels: int):
    """A step of few rows with AMX's operands, without AMX: per row and
    tile of `panels` panels, every gate's accumulators in registers, the
    reduction's pairs unrolled; the cell on the tile."""
    out = p.stage("out")
    acc, tile = p.stage("hg_bf16sum"), p.stage("hg_tile")
    j, b, P = p.vars["j"], p.vars["b"], p.P
    r = p.rdoms["k"].x
    jo, ji, jp, jv = (hl.Var(name) for name in ("jo", "ji", "jp", "jv"))
    # the panels' strides as packed (the AMX products leave them free):
    # a vector of a gate's units is then one strided load, not a gather
    p.param("wp_hh").dim(1).set_stride(2).dim(2).set_stride(2 * P)
    # h's row in bf16 per tile, a buffer of constant size on the stack:
    # with all of h once a call (a heap buffer) the 16-core Xeon's layer at
    # H = 256 B = 1 on 8 threads took 10.2 ms (fp32: 5.2); per tile 5.25
    h_bf = p.stage("h_bf")
    h_bf.compute_at(out, b).vectorize(h_bf.args()[0], bf16.K_CHUNK, GUARD)
    out.split(j, jo, ji, P * panels, GUARD).split(ji, jp, jv, P).reorder(jv, jp, b, jo)
    out.vectorize(jv).unroll(jp)
    t_ji, t_row, t_gate, t_jo = tile.args()
    tile.compute_at(out, b).bound_extent(t_ji, P).vectorize(t_ji).unroll(t_gate).unroll(t_jo)
    acc.compute_at(out, b)
    a_ji, a_row, a_gate, a_jo = acc.args()
    ro, ri = hl.RVar("ro"), hl.RVar("ri")
    acc.vectorize(a_ji).unroll(a_gate).unroll(a_jo)
    acc.update().split(r, ro, ri, 2).reorder(ri, a_ji, a_gate, a_jo, ro, a_row).atomic() \
        .vectorize(ri).vectorize(a_ji).unroll(a_gate).unroll(a_jo)
    for f in p.saved_stages():
        f.compute_at(out, b).bound_extent(j, P * panels).vectorize(j, P).unroll(f.args()[1])
    p.split_quantum = panels
    p.split_batch_bytes = 0


def grad_operands(p) -> bool:
    """The backward's product operands in bf16 (pipeline.grads._bf16_grads), each
    computed whole: d^T and the x and h pairs in tiles of 16 rows, their
    transposes in registers; W_ih^T's panels and dxp's rows (unless the
    input is one-hot: returns whether it is)."""
    ids = "dx" not in p.stages
    for name in {p.stage(v).name(): v for v in ("dxp_t", "dhg_t")}.values():
        f = p.stage(name)
        kc, row, kq = f.args()
        ro, ri = hl.Var("ro"), hl.Var("ri")
        f.compute_root().split(row, ro, ri, 16).reorder(kc, ri, ro, kq).vectorize(kc, 16)
        f.unroll(ri).parallel(kq)
    for name in ("hs_pairs",) + (() if ids else ("x_pairs",)):
        f = p.stage(name)
        k2, ji, q = f.args()
        lanes, qo, qi = hl.Var("lanes"), hl.Var("qo"), hl.Var("qi")
        f.compute_root().fuse(k2, ji, lanes).vectorize(lanes).split(q, qo, qi, 64, GUARD)
        f.parallel(qo)
    if not ids:
        weight_panels(p.stage("w_ih_panels").compute_root(), p.G * p.H, 1)
        rows(p.stage("dxp_bf"))
    return ids


def grads(p):
    """The backward's products on AMX tiles (pipeline.grads._bf16_grads): the
    operands in bf16 first (grad_operands); dx as the projection (tiles of
    16 rows x one panel of inputs, rows in chunks, one parallel loop over
    (chunk, panel)); dW the rows' chunks outermost (the layout's
    bf16_dw_rows), in each a tile of 16 inputs x 16 units of one gate added
    to dW, the tasks over (unit tile, gate), the inputs' tiles in turn
    (bench/RESULTS.md, "Schedule decisions": cpu.amx backward)."""
    ids = grad_operands(p)
    if not ids:
        out = p.stage("dx")
        i, n = out.args()
        io, ii, nf, no, ni, nc = (hl.Var(v) for v in ("io", "ii", "nf", "no", "ni", "nc"))
        out.split(n, nf, ni, ROWS, GUARD).split(nf, nc, no, CHUNK_TILES, GUARD)
        out.split(i, io, ii, p.P).reorder(ii, ni, no, io, nc).vectorize(ii)
        out.fuse(io, nc, io).parallel(io)
        product(p.stage("dx_bf16sum"), p.stage("dx_tile"), p.rdoms["dx"], hl.LoopLevel(out, no))
    for name in ("dw_hh",) if ids else ("dw_ih", "dw_hh"):
        out = p.stage(name)
        v, j, gate = out.args()
        rc = p.rdoms[name + "_chunks"].x
        vo, vi, jo, ji = (hl.Var(x) for x in ("vo", "vi", "jo", "ji"))
        out.vectorize(v, p.P, GUARD).parallel(gate)
        # the chunks of rows outermost: a chunk of x's (h's) pair panels is
        # read by every tile from L2
        u = out.update()
        u.split(v, vo, vi, p.P, GUARD).split(j, jo, ji, ROWS, GUARD)
        u.reorder(vi, ji, vo, jo, gate, rc).vectorize(vi).fuse(jo, gate, jo).parallel(jo)
        product(p.stage(name + "_bf16sum"), p.stage(name + "_tile"), p.rdoms[name],
                hl.LoopLevel(out, vo))
