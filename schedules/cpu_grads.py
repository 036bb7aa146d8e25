"""The CPU schedule of the weight-gradient pipeline (grads): dx, dW_ih,
dW_hh and the bias sums of a layer's backward, register tiles
(schedules/cpu_tiles.py) over the rows of every step.
"""
import math

import halide as hl

from .. import machine
from . import amx, bf16_vectors
from .cpu_tiles import GUARD, ROUND, SHIFT, knob, register_tile, registers, tile_loops, vector_width


def grads_ids(p, target):
    """As grads, dW_ih a scatter-add: one gate a task, each row of dxp added
    to its class's row (vectorized along units)."""
    grads(p, target, ids=True)
    j, gate, rn = p.vars["j"], p.vars["gate"], p.rdoms["n"]
    acc, out = p.stage("dw_ih_acc"), p.stage("dw_ih")
    vw = vector_width(target, p.H)
    tail = ROUND if p.H % vw == 0 else GUARD
    acc.compute_root().vectorize(j, vw, tail).parallel(gate)
    acc.update().reorder(j, rn.x, gate).vectorize(j, vw, tail).parallel(gate)
    out.parallel(gate)


# dx's rows in chunks of this many row tiles (192 rows), as the
# projection's (proj_chunk): its parallel loop then runs over (chunk, tile
# of panels) pairs, not over the tiles of panels alone, of which K = 96
# has 3 and K = 512 has 16 for 2 and 16 threads (bench/RESULTS.md,
# "Schedule decisions": cpu.grads dx chunks).
DX_CHUNK_TILES = 32


def grads(p, target, ids=False):
    if p.cpu_bf16:
        if p.amx_tiles:
            amx.grads(p)
        else:
            rows, panels = bf16_vectors.tile_shape(registers(target), 1)
            bf16_vectors.grads(p, rows, panels, DX_CHUNK_TILES)
        return _bias_sums(p, target)
    v, H = p.vars, p.H
    i, j, gate, n = v["i"], v["j"], v["gate"], v["t"]
    rg, rn = p.rdoms["jg"], p.rdoms["n"]
    if not ids:
        # dx: tiles of 6 rows x 2 panels, 12 accumulators (AVX2's 16
        # registers hold them too); an odd number of input panels (dx is Kp
        # wide) has its last tile shifted inwards by a panel, so that its
        # loads stay on panel boundaries
        # (bench/RESULTS.md, "Schedule decisions": cpu.grads dx tile); the
        # rows in chunks of DX_CHUNK_TILES tiles, one parallel loop over
        # (chunk, tile of panels) pairs (cpu.grads dx chunks)
        dx_panels = min(2, p.Kp // p.P)
        register_tile(p.stage("dx"), p.stage("dx_acc"), i, p.P, [(n, 6, GUARD)], [rg.x, rg.y],
                      par="io", panels=dx_panels, chunk=(n, DX_CHUNK_TILES),
                      vec_tail=ROUND if (p.Kp // p.P) % dx_panels == 0 else SHIFT)
    for name in ("hs_panels",) if ids else ("x_panels", "hs_panels"):
        f = p.stage(name)
        vi, row, vo = f.args()
        f.compute_root().vectorize(vi, min(p.dw_cols, 4 * p.P)).parallel(vo)
    for f in {p.stage("dxp_panels").name(): p.stage("dxp_panels"),
              p.stage("dhg_panels").name(): p.stage("dhg_panels")}.values():
        ji, g, row, jo = f.args()
        ro, ri = hl.Var("ro"), hl.Var("ri")
        # Chunks of 64 rows in parallel, every panel of a chunk in turn: each
        # row of dxp is read from L2 once, and each (panel, gate) block is
        # stored as contiguous 6-unit rows (storage ji, row, gate, jo), so a
        # weight-gradient tile of one gate broadcasts from a dense stream
        # (bench/RESULTS.md, "Schedule decisions": cpu.grads dxp panels).
        f.compute_root().reorder_storage(ji, row, g, jo)
        f.split(row, ro, ri, 64, GUARD).reorder(ji, g, ri, jo, ro).unroll(ji).unroll(g)
        f.parallel(ro)
    # Weight gradients: dw_cols x dw_rows register tiles in blocks of unit
    # tiles, one block a task, the rows in chunks outermost within it
    # (_dw_blocks); K or H below a tile: whole tiles, copied out.
    for name, vec in (("dw_hh", v["k"]),) if ids else (("dw_ih", i), ("dw_hh", v["k"])):
        width = p.K if vec is i else H
        if width >= p.dw_cols and H >= p.dw_rows:
            _dw_blocks(p, p.stage(name), p.stage(name + "_acc"), vec, width, rn)
            continue
        tiles = p.stage(name + "_tiles").compute_root()
        register_tile(tiles, p.stage(name + "_acc"), vec, p.dw_cols, [(j, p.dw_rows, ROUND)],
                      [rn.x])
        tiles.fuse(jo, gate, jo).parallel(jo)
        # the copy out of whole tiles, one gate a task, in parallel
        # (bench/RESULTS.md, "Schedule decisions": cpu.grads dW copy-out)
        p.stage(name).vectorize(vec, vector_width(target, width)).parallel(gate)
    _bias_sums(p, target)


def _bias_sums(p, target):
    """The grads pipeline's sums over rows (the biases', the vector
    parameters')."""
    j, gate, H, rn = p.vars["j"], p.vars["gate"], p.H, p.rdoms["n"]
    for bias in ("db_ih", "db_hh") + (("dvec",) if p.V else ()):
        if bias + "_acc" not in p.stages:       # db_hh, a copy of db_ih (the LSTM)
            p.stage(bias).vectorize(j, vector_width(target, H), GUARD)
            continue
        rows = p.rdoms["v"] if bias == "dvec" else rn     # (dvec: over batch rows)
        _bias(p.stage(bias), p.stage(bias + "_acc"), j, gate, rows, vector_width(target, H), H)


# The rows of a dW block's chunk: its x (or h) panel's chunk, dw_cols x
# rows floats, fills 16 KiB, a third of a 48 KiB L1 (half of 32 KiB), so
# that every unit tile of the block reads it from L1.
DW_CHUNK_BYTES = 16 << 10
# Below blocks: a tile a task over all N rows, DW_PASS_PANELS input panels
# per pass over the tiles, where a pass's panels (N rows each) fit in
# DW_PASS_BYTES (a 1 MiB L2), so that a thread's tiles read them from L2.
DW_PASS_PANELS = 4
DW_PASS_BYTES = 1 << 20


def _dw_blocks(p, out, acc, vec, width, rn) -> None:
    """dW(vec, j, gate) = sum over rows n of a(n, vec) d(n, j, gate) in
    dw_cols x dw_rows register tiles of one gate. Where the rows N are
    many, in blocks of tiles, one block a task: in a block the rows run in
    chunks (DW_CHUNK_BYTES) outermost, then the input panels (dw_cols
    inputs), then the block's tiles, each tile's accumulators in registers
    for one chunk; a block's accumulators (width x units floats) fill at
    most the knob dw_block_kib (default a quarter of the L2, knobs.dw_block_kib),
    in at least two blocks a core. Every operand is then read from L1 or
    L2, where a tile summing all N rows at once streams its input panels
    from memory (1.6 MB each at N = 6400). Fewer rows (DW_PASS_BYTES): a
    tile a task, straight into dW, the edge tiles shifted inwards
    (bench/RESULTS.md, "Schedule decisions": cpu.dw blocks)."""
    j, gate = p.vars["j"], p.vars["gate"]
    C, R = p.dw_cols, p.dw_rows
    panels = -(-width // C)
    few_rows = rn.x.extent() * (min(DW_PASS_PANELS, panels) * C * 4) <= DW_PASS_BYTES
    jb = hl.Var("jb")       # the loop acc is computed in: a block, or a tile's pass
    # few rows: register_tile's loops, the input panels in passes; the pass's tile loop is jb
    tiled = out.specialize(few_rows)
    # the edge tile of inputs starts on a panel boundary, its inputs past
    # `width` computed from the panels' zero padding and not stored:
    # shifted inwards it would straddle two panels of a / d, a gather a row
    tile_loops(tiled, out, vec, C, 1, [(j, R, SHIFT)], None, SHIFT if width % C == 0 else GUARD)
    vo, voo, voi, jo = (hl.Var(n) for n in (vec.name() + "o", vec.name() + "oo",
                                            vec.name() + "oi", "jo"))
    tiled.split(vo, voo, voi, DW_PASS_PANELS, GUARD).reorder(voi, jo, gate).rename(voi, jb)
    tiled.fuse(jo, gate, jo).parallel(jo)
    # blocks: at least two a core, in whole rounds of the cores where the
    # tiles allow (knobs.MACHINE_FACTS: the core count is in the cache key)
    most = max(1, min((knob(p, "dw_block_kib") << 10) // (panels * C * R * 4), p.H // R))
    cores = machine.cores()
    blocks = max(-(-p.H // (R * most)), -(-2 * cores // p.G))
    whole_rounds = cores // math.gcd(cores, p.G)
    blocks = min(-(-blocks // whole_rounds) * whole_rounds, -(-p.H // R))
    units = R * -(-p.H // (R * blocks))       # the fewest tiles a block for that many blocks
    jt, vi = hl.Var("jt"), hl.Var(vec.name() + "i")
    out.split(j, jb, jt, units, SHIFT).split(vec, vo, vi, p.P, SHIFT).vectorize(vi)
    out.reorder(vi, vo, jt, jb, gate).fuse(jb, gate, jb).parallel(jb)
    acc.compute_at(out, jb)
    vp, vv = hl.Var(vec.name() + "p"), hl.Var(vec.name() + "v")
    tile_acc, tile_update = acc.specialize(few_rows), acc.update().specialize(few_rows)
    for stage in (tile_acc, tile_update):
        stage.split(vec, vp, vv, C, ROUND).vectorize(vv).unroll(vp).unroll(j)
    tile_update.reorder(vv, vp, j, rn.x)
    acc.vectorize(vec, p.P)
    wo, wv, to, ti = (hl.Var(n) for n in ("dw_o", "dw_v", "dw_to", "dw_ti"))
    no, ni = hl.RVar("dw_no"), hl.RVar("dw_ni")
    chunk = max(1, DW_CHUNK_BYTES // (C * 4))
    acc.update().split(vec, wo, wv, C).split(j, to, ti, R).split(rn.x, no, ni, chunk, GUARD) \
        .reorder(wv, ti, ni, to, wo, no).vectorize(wv).unroll(ti)


def _bias(out, acc, j, gate, rn, vw, H):
    """db(j, gate) = sum over rows of d(j, gate, n): rows outer, units
    vectorized inner, so that each row is read once, contiguously, and the
    accumulator row (G*H floats) stays in L1; one gate a task
    (bench/RESULTS.md, "Schedule decisions": cpu.grads bias sums)."""
    acc.compute_at(out, gate)
    tail = ROUND if H % vw == 0 else GUARD
    for stage in (acc, acc.update()):
        stage.vectorize(j, vw, tail)
    acc.update().reorder(j, rn.x)
    out.vectorize(j, vw, SHIFT).parallel(gate)
