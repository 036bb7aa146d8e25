"""The CPU schedule's bf16 products in vector registers (precision "bf16"
on a CPU with AVX512-BF16 and no AMX: Layout.cpu_bf16 without amx_tiles):
halstm.bf16's products (the projection, the steps, the backward's steps,
dx and the weight gradients) as AVX512-BF16 dot products (vdpbf16ps: 16
float32 sums += 16 pairs of bf16 products).

Halide 21 emits vdpbf16ps for an update whose reduction is split by 2
innermost, atomic and vectorized with 16 units of the pair panels: a row's
pair of bf16 values broadcast to 16 lanes times one 32-lane load of a
panel's pairs. A tile's accumulators (rows x gates x panels vectors of 16
units) stay in registers over the reduction, as the float32 tiles' do.
"""
import halide as hl

from . import amx

GUARD = hl.TailStrategy.GuardWithIf
# A tile's columns (gates x panels): at least this many vectors, so that a
# row's broadcast serves as many dot products (one gate: 4 panels)
COLUMNS = 4


def tile_shape(registers: int, gates: int) -> tuple:
    """(rows, panels) of a product tile of `gates` gates: panels enough for
    COLUMNS vectors, and the most rows whose accumulators, the columns'
    panel vectors and a row's broadcast fit in `registers` vector registers
    (AVX-512: 4 gates x 6 rows, 3 gates x 9, one gate 4 panels x 6)."""
    panels = max(1, COLUMNS // gates)
    columns = gates * panels
    return max(1, (registers - 1 - columns) // columns), panels


def fixed_panels(w: hl.ImageParam, P: int) -> None:
    """A weight's bf16 pair panels (bf16.panels) with the strides they are
    packed with: a panel's 16 units' pairs are then one dense load."""
    w.dim(1).set_stride(2).dim(2).set_stride(2 * P)


def product(acc, tile, r, level: hl.LoopLevel, rows: int, panels: int = 1) -> None:
    """acc and its copy `tile` (ji, row, gate, jo[, c]) computed at `level`:
    16 units x `rows` rows x every gate x `panels` panels, the accumulators
    in registers, the reduction r's pairs as dot products."""
    ji, row, gate, jo = tile.args()[:4]
    tile.compute_at(level).bound_extent(ji, 16).bound_extent(row, rows).bound_extent(jo, panels)
    tile.vectorize(ji).unroll(row).unroll(gate).unroll(jo)
    acc.compute_at(tile, tile.args()[-1])
    a_ji, a_row, a_gate, a_jo = acc.args()[:4]
    acc.vectorize(a_ji).unroll(a_row).unroll(a_gate).unroll(a_jo)
    ko, ki = hl.RVar("ko"), hl.RVar("ki")
    outer = [ko] + ([r.y] if r.dimensions() > 1 else [])    # (a chunk's tile rows: r.y)
    acc.update().split(r.x, ko, ki, 2).reorder(ki, a_ji, a_gate, a_jo, a_row, *outer).atomic() \
        .vectorize(ki).vectorize(a_ji).unroll(a_gate).unroll(a_jo).unroll(a_row)


def proj(p, rows: int, panels: int, chunk: int) -> None:
    """The projection: tiles of `rows` rows x every gate of `panels`
    panels, rows in chunks of `chunk` tiles; one parallel loop over (chunk,
    tile of panels) pairs, chunk-major, as the float32 projection's
    (`panels` must divide Hp / P: W_ih's panels are read unclamped)."""
    out = p.stage("xp")
    ji, gate, n, jo = out.args()
    nf, no, ni, nc, jt, jp = (hl.Var(name) for name in ("nf", "no", "ni", "nc", "jt", "jp"))
    fixed_panels(p.param("wp_ih"), p.P)
    amx.rows(p.stage("x_bf"))
    out.split(n, nf, ni, rows, GUARD).split(nf, nc, no, chunk, GUARD).split(jo, jt, jp, panels)
    out.reorder(ji, gate, jp, ni, no, jt, nc).vectorize(ji).unroll(gate).unroll(jp)
    out.fuse(jt, nc, jt).parallel(jt)
    product(p.stage("xp_bf16sum"), p.stage("xp_tile"), p.rdoms["i"], hl.LoopLevel(out, no), rows,
            panels)


def step(p, rows: int, panels: int) -> None:
    """A step: per tile of `panels` panels of units x `rows` batch rows,
    every gate's product in registers, then the cell on the tile; h's bf16
    rows first, once a call. The driver's threads take ranges of tiles
    (`panels` must divide Hp / P: W_hh's panels are read unclamped)."""
    j, P = p.vars["j"], p.P
    out, bo = _tiles(p, j, rows, panels, "wp_hh", "h_bf")
    product(p.stage("hg_bf16sum"), p.stage("hg_tile"), p.rdoms["k"], hl.LoopLevel(out, bo), rows,
            panels)
    # whole panels at the guarded edge too (the cell's reads are clamped)
    for f in p.saved_stages():
        f.compute_at(out, bo).bound_extent(j, P * panels).vectorize(j, P).unroll(f.args()[1])
    p.split_batch_bytes = 0


def step_bwd(p, rows: int, panels: int) -> None:
    """A backward step (pipeline/backward.py _step_bwd_bf16): per tile of `panels`
    panels of units x `rows` rows, the product dh = W_hh^T dhg_next in
    registers, then the pointwise backward on the tile; dhg_next's bf16
    rows first, once a call. The driver's threads take ranges of tiles
    (`panels` must divide Hp / P: W_hh^T's panels are read unclamped)."""
    out, bo = _tiles(p, p.vars["k"], rows, panels, "wt_hh", "dhg_bf")
    product(p.stage("dh_bf16sum"), p.stage("dh_tile"), p.rdoms["jg"], hl.LoopLevel(out, bo), rows,
            panels)


def _tiles(p, unit, rows: int, panels: int, weight: str, bf_rows: str) -> tuple:
    """A step's out(unit, b) in tiles of `panels` panels x `rows` rows
    (amx.step_tiles), `weight`'s panels read with their packed strides; the
    driver's threads take ranges of tiles. Returns (out, the rows' loop)."""
    fixed_panels(p.param(weight), p.P)
    out, _, bo = amx.step_tiles(p, unit, rows, panels, bf_rows)
    p.split_quantum = panels
    return out, bo


def grads(p, rows: int, panels: int, chunk: int) -> None:
    """The backward's products (pipeline.grads._bf16_grads): the operands in bf16
    first, as amx.grads; dx in tiles of `rows` rows x `panels` panels of
    inputs, rows in chunks of `chunk` tiles, one parallel loop over (chunk,
    tile of panels); dW the rows' chunks outermost (the layout's
    bf16_dw_rows), in each a tile of `panels` panels of inputs x `rows`
    units of one gate added to dW, the tasks over (unit tile, gate)."""
    ids = amx.grad_operands(p)
    if not ids:
        out = p.stage("dx")
        i, n = out.args()
        io, ii, ip, iv, nf, no, ni, nc = (hl.Var(v) for v in
                                          ("io", "ii", "ip", "iv", "nf", "no", "ni", "nc"))
        out.split(n, nf, ni, rows, GUARD).split(nf, nc, no, chunk, GUARD)
        out.split(i, io, ii, p.P * panels, GUARD).split(ii, ip, iv, p.P)
        out.reorder(iv, ip, ni, no, io, nc).vectorize(iv)
        out.fuse(io, nc, io).parallel(io)
        product(p.stage("dx_bf16sum"), p.stage("dx_tile"), p.rdoms["dx"], hl.LoopLevel(out, no),
                rows, panels)
    for name in ("dw_hh",) if ids else ("dw_ih", "dw_hh"):
        out = p.stage(name)
        v, j, gate = out.args()
        rc = p.rdoms[name + "_chunks"].x
        vo, vi, vp, vv, jo, ji = (hl.Var(x) for x in ("vo", "vi", "vp", "vv", "jo", "ji"))
        out.vectorize(v, p.P, GUARD).parallel(gate)
        u = out.update()
        u.split(v, vo, vi, p.P * panels, GUARD).split(vi, vp, vv, p.P).split(j, jo, ji, rows, GUARD)
        u.reorder(vv, vp, ji, vo, jo, gate, rc).vectorize(vv).fuse(jo, gate, jo).parallel(jo)
        product(p.stage(name + "_bf16sum"), p.stage(name + "_tile"), p.rdoms[name],
                hl.LoopLevel(out, vo), rows, panels)
