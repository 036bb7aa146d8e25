"""Hand-written schedules for x86-64 (AVX2 / AVX-512) and ARM CPUs.

Every product is a register-tiled GEMM over weights packed in panels of one
vector's lanes (P): the `*_acc` stage is computed per output tile, its unit
axis vectorized, the other tile axes unrolled and the reduction outside
them, so that the tile's accumulators stay in registers and each reduction
step reads one contiguous block of the panel. Batch axes (runtime sizes)
split with GuardWithIf; the pipeline clamps batch reads, so a tile may
overrun B. The tiles are schedules/cpu_tiles.py's; the weight-gradient
pipeline's schedule is schedules/cpu_grads.py's.
"""
import math
from dataclasses import replace

import halide as hl

from .. import bf16, machine
from . import amx, bf16_vectors, cpu_grads
from ..layout import Layout, StepSplit
from .cpu_tiles import (GUARD, ROUND, SHIFT, knob, panel, register_tile, registers, tile_panels,
                        vector_width)


def step_rows(target: hl.Target) -> int:
    """Batch rows per register tile of the forward steps whose batch does
    not fill proj_tile's tiles (see step), tiles of every gate of one
    panel: 4 gates x rows accumulators fill half the vector registers, 4
    rows with AVX-512 and 2 with AVX2, where 4 rows (16 accumulators, no
    register left for the operands) spill
    (bench/RESULTS.md, "Schedule decisions": cpu.step_rows)."""
    return max(1, registers(target) // 8)


def layout(target: hl.Target) -> Layout:
    """Packed operand shapes: weight panels one vector wide; weight-gradient
    tiles of vectors x 6 units whose accumulators fill three quarters of the
    vector registers (4 vectors with AVX-512, 2 with AVX2)
    (bench/RESULTS.md, "Schedule decisions": cpu.layout); xp stored in
    panels, so that a step's rows of one panel are one contiguous run
    (bench/RESULTS.md, "Schedule decisions": cpu.layout (xp)); the steps
    split over the driver's threads (SPLIT_MACS, SPLIT_CALL_MACS,
    SPLIT_ROWS)."""
    P = panel(target)
    return Layout(panel=P, dw_cols=registers(target) * 3 // 4 // 6 * P, dw_rows=6, xp_panels=True,
                  split=StepSplit(macs=SPLIT_MACS, call_macs=SPLIT_CALL_MACS, rows=SPLIT_ROWS,
                                  pool_macs=POOL_MACS),
                  fused_bwd_below=FUSED_BWD_BELOW)


def reducing_layout(layout: Layout) -> Layout:
    """The layout of a cell whose step reduces over the units: every unit
    of a row's products comes before its pointwise work, so a step's
    threads do not take ranges of units. The driver's threads take ranges
    of batch rows (split rows_only; each thread reads all of W_hh every
    step). Where the rows give too few ranges, the backward step runs on
    ranges of units, each thread computing the pointwise part of every
    unit (step_bwd_units); forward, and backward past 1 MiB of W_hh, a
    step runs in two parts, its product on ranges of units and the rest on
    ranges of rows (pipeline.UNITS_FWD, UNITS_BWD); forward also past the
    knob rows_fwd_kib (default 512 KiB: on 16 cores, 8 threads that each
    read a 4 or 16 MB W_hh took 1.5-2.1x the time of Halide's pool)
    (bench/RESULTS.md, "Schedule decisions": cpu.step rows). Ranges of at
    least REDUCING_ROWS rows where W_hh is large (the driver's ranges go
    down to one row where it is small)."""
    layout = layout.without("fused_bwd_below")
    if layout.split is None:
        return layout
    return replace(layout, split=replace(layout.split, rows_only=True, rows=REDUCING_ROWS))


# A reducing step's threads each read all of W_hh every step: past the
# split_batch_bytes, ranges of 8 rows, whatever the tile. On the 16-core
# Xeon ranges of 4 took the layer-norm LSTM's backward 0.86x at K=H=512
# B=64 (W_hh 4 MB) and 1.13x at K=H=1024 (16 MB): more threads reading a
# large W_hh each step cost more than they add (bench/RESULTS.md,
# "Schedule decisions": cpu.split rows).
REDUCING_ROWS = 8


# The LSTM's ranges of rows forward up to this size of W_hh (see SPLIT_ROWS).
ROWS_FWD_BYTES = 512 << 10


# The time steps run on the driver's threads, not Halide's pool, which
# would fork and join a parallel loop every step (layout split_steps; see
# driver.cpp run_split): one thread per SPLIT_MACS multiply-adds of a
# step, up to the threads available, each on its own range of unit panels,
# meeting at a spin barrier between steps. From 2^15 MACs a step pays for
# a second core's barrier; 2^14 (H=64) stays on one
# (bench/RESULTS.md, "Schedule decisions": cpu.SPLIT_MACS).
SPLIT_MACS = 1 << 15
# ... and only where the whole time loop has SPLIT_CALL_MACS multiply-adds
# or more: starting a thread costs about 25 us a call, the time 3 M MACs
# take on one core (bench/RESULTS.md, "Schedule decisions": cpu.SPLIT_CALL_MACS).
SPLIT_CALL_MACS = 1 << 23
# Halide's parallel loops (the projection, the gradient GEMMs, a step run
# whole) wake one of the pool's threads per POOL_MACS multiply-adds of
# the pipeline call at most (csrc/threads.h PoolWork): on the 16-core
# Xeon, a T=1 backward at 256 units B=1 took 0.68x (LSTM) and 0.80x
# (layer-norm LSTM) the time of all 16 threads; larger calls, and the
# 2-core VMs (whose loops of 2^18 MACs or more keep both threads), are
# unchanged (bench/RESULTS.md, "Schedule decisions": cpu.POOL_MACS).
POOL_MACS = 1 << 17
# Batch rows are independent through a whole time loop: where each thread
# gets SPLIT_ROWS rows or more and W_hh (G*H*H floats, read whole by every
# thread each step) is small enough (the step pipelines set the pipe's
# split_batch_bytes), the driver's threads take ranges of rows and never
# meet, rather than ranges of units that meet after every step (and,
# backward, each compute the pointwise part for all units): rows up to 512
# KB of W_hh forward, 1 MB backward (bench/RESULTS.md, "Schedule
# decisions": cpu.split rows).
# 4 rows: the backward's dh tiles are 4 rows by panels (4 x 4 with
# AVX-512, 2 x 4 with AVX2, see step_bwd); ranges of the forward tile's 2
# rows (AVX2) left the backward a tile of 1 row and lost.
SPLIT_ROWS = 4
# Every hidden size: one backward step pipeline a step, step_bwd_fused (see
# there); a cell that reduces over units keeps step_bwd (reducing_layout).
FUSED_BWD_BELOW = 1 << 30


def _pointwise(f, vw):
    """A pointwise stage f(j, [gate,] b): vectorize units (guarded: the
    driver may ask for fewer units than a vector, split_steps), unroll
    gates."""
    args = f.args()
    f.vectorize(args[0], vw, GUARD)
    if len(args) == 3:
        f.unroll(args[1])
    return f


def _pack(f, target):
    """A panel-packing stage f(u, a, b, uo): vectorize the panel axis."""
    u, _, _, uo = f.args()
    f.vectorize(u).parallel(uo)


def pack(p, target):
    """wp(ji, gate, k, jo) = w(k, jo*P + ji, gate): a transpose of P x P
    blocks, P reduction steps unrolled per vector of units, so that each of
    a block's P rows is read once along a cache line rather than each
    vector gathered from P rows
    (bench/RESULTS.md, "Schedule decisions": cpu.pack)."""
    if p.cpu_bf16:
        return amx.panels(p, target)
    for name, n in (("wp_ih", p.K), ("wp_hh", p.H)):
        f = p.stage(name)
        ji, gate, k, jo = f.args()
        ko, ki = hl.Var("ko"), hl.Var("ki")
        outer = []
        if p.PG < p.G:     # (group, reduction) as two loops: k % n and k / n fold away
            kg, kr = hl.Var("kg"), hl.Var("kr")
            f.split(k, kg, kr, n, ROUND)
            k, outer = kr, [kg]
        f.split(k, ko, ki, p.P, GUARD).reorder(ji, ki, gate, ko, *outer, jo)
        f.vectorize(ji).unroll(ki).parallel(jo)


def panel_layout(layout: Layout, gates: int, target: hl.Target) -> Layout:
    """layout with the weight panels' gates in the groups of proj_tile's
    tiles (panel_gates), so that a tile of a group reads one contiguous
    run of its panel, not every other run of G gates' interleaved ones."""
    group = proj_tile(target, gates)[0]
    return replace(layout, panel_gates=group if group < gates else 0)


def pack_bwd(p, target):
    for name in ("wq_ih", "wq_hh"):
        _pack(p.stage(name), target)
    if p.cpu_bf16:     # (W_hh^T's bf16 pair panels, for step_bwd_bf16)
        amx.weight_panels(p.stage("wt_hh"), p.G * p.H, 1)


def proj_rows(target: hl.Target) -> int:
    """Rows per input-projection tile of every gate (see proj_tile): the
    most whose 4 gates x rows accumulators, the 4 gates' weight vectors and
    a row's broadcast fit in the vector registers: 6 with AVX-512 (24 + 4 +
    1 of 32), 2 with AVX2 (8 + 4 + 1 of 16), where 6 rows spilled and ran
    at half the speed (bench/RESULTS.md, "Schedule decisions":
    cpu.proj_rows)."""
    return max(1, (registers(target) - 1) // 4 - 1)


# A projection tile's accumulators hide the FMA's latency where they are at
# least this many: two FMA pipes times a latency of 4 (Intel) to 5 (AMD Zen)
# cycles is 8 to 10 products in flight.
PROJ_LEAST_ACCUMULATORS = 12
# ... and its rows are at most this many: a tile reads its rows of x at a
# stride of K floats, and at K = 1024 (4 KiB) 8 or more rows share one set
# of an 8-way L1 (Zen 2, AVX2, 2 threads: the RNN's projection at K = 1024
# 78 GFLOP/s with 6 rows, 70 with 8, 37 with 12; bench/RESULTS.md,
# "Schedule decisions": cpu.proj_tile).
PROJ_MOST_ROWS = 6


def proj_tile(target: hl.Target, gates: int) -> tuple:
    """(gates, rows) of an input-projection tile of one panel: every gate
    and proj_rows rows where those are at least PROJ_LEAST_ACCUMULATORS
    accumulators (AVX-512 with 3 or 4 gates); else the gates in groups (a
    divisor of `gates`) of the most whose tile of PROJ_LEAST_ACCUMULATORS
    accumulators (PROJ_MOST_ROWS rows at most), a weight vector a gate and
    a row's broadcast fit the vector registers: AVX2 2 gates x 6 rows for
    cells of 4 gates, 3 x 4 for 3 gates, 1 x 6 for one
    (bench/RESULTS.md, "Schedule decisions": cpu.proj_tile)."""
    rows = proj_rows(target)
    if gates * rows >= PROJ_LEAST_ACCUMULATORS:
        return gates, rows
    for group in range(gates, 0, -1):
        rows = min(PROJ_MOST_ROWS, -(-PROJ_LEAST_ACCUMULATORS // group))
        if gates % group == 0 and group * rows + group + 1 <= registers(target):
            return group, rows
    return gates, proj_rows(target)


# Rows in chunks of knob proj_chunk tiles (default 32: 192 rows with
# AVX-512's 6-row tiles) outside the panel loop, so that a chunk of x stays
# in L2 while every weight panel passes (bench/RESULTS.md, "Schedule
# decisions": cpu.proj_chunk).


# A projection of fewer multiply-adds than knob proj_serial_kmacs * 2^10
# (default 2^21) runs on the calling thread where its call runs on the
# driver's own threads (csrc/threads.h PoolWork): waking Halide's pool's
# sleeping workers costs more than a second core gives back. On the Zen 5
# VM one LSTMCell call (no_grad) took 10-13 us less serial at 256 units
# B=1, 128 units B=16 and B=32 (0.26-2 M MACs), 3-10 us more at 512 units
# B=2 (2 M, W_ih 4 MB); larger ones lost by tens of us. On the Intel VM 256
# units B=1 took 29 us more serial, where two cores read W_ih faster than
# one. On a shared OpenMP team (halstm.torch under torch's default wait
# policy) the threads are awake, and every projection runs in parallel
# (bench/RESULTS.md, "Schedule decisions": cpu.PROJ_SERIAL_MACS; "Tuned
# knobs").


def proj(p, target):
    """Tiles of proj_tile's rows x gates of one panel (xp_panels: a tile
    of every gate is one contiguous run of xp), rows in chunks of
    proj_chunk tiles; one parallel loop over (chunk, panel) pairs,
    chunk-major, which the driver runs on the calling thread below knob
    proj_serial_kmacs * 2^10 multiply-adds (p.proj_serial_macs)."""
    if p.cpu_bf16:
        if p.amx_tiles:
            return amx.proj(p)
        return bf16_vectors.proj(p, *_bf16_tile(p, target, p.G), knob(p, "proj_chunk"))
    out, acc = p.stage("xp"), p.stage("xp_acc")
    ji, gate, n, jo = out.args()
    j, r = p.vars["j"], p.rdoms["i"].x
    rows = out.output_buffer().dim(2).extent()
    nf, no, ni, nc, go, gi = (hl.Var(name) for name in ("nf", "no", "ni", "nc", "go", "gi"))
    group, tile = proj_tile(target, p.G)
    p.proj_serial_macs = knob(p, "proj_serial_kmacs") << 10
    for stage, f in ((out.specialize(rows >= tile), tile), (out, 1)):
        stage.split(n, nf, ni, f, SHIFT).split(nf, nc, no, knob(p, "proj_chunk"), GUARD)
        stage.split(gate, go, gi, group)            # (group == G: go has extent 1)
        stage.reorder(ji, gi, ni, go, no, jo, nc).vectorize(ji).unroll(gi).unroll(ni)
        stage.fuse(jo, nc, jo).parallel(jo)
    acc.compute_at(out, go)
    for stage in (acc, acc.update()):
        stage.vectorize(j, p.P).unroll(gate).unroll(n)
    acc.update().reorder(j, gate, n, r)


def bf16_layout(layout: Layout, direction: str, input_size: int, hidden_size: int,
                target: hl.Target) -> Layout:
    """layout for precision bf16 (halstm.bf16). With AMX: steps of up to
    amx.NARROW_ROWS rows run without AMX (step_narrow forward, the float32
    step_bwd_fused backward), the others on AMX tiles (step, step_bwd_bf16),
    as do the projection and the backward's dx and weight gradients; those
    sum over the rows in chunks whose x or h pairs (the wider) fill half
    the L2 (machine.l2_bytes; bench/RESULTS.md, "Schedule decisions":
    cpu.amx backward). Without AMX (AVX512-BF16) the same products run as
    dot products in vector registers (bf16_vectors), with the same rules."""
    amx_tiles = bf16.cpu_products(target) == bf16.ON_AMX_TILES
    layout = replace(layout, cpu_bf16=True, amx_tiles=amx_tiles, narrow_rows=amx.NARROW_ROWS)
    if direction == "fwd":
        return layout
    rows = machine.l2_bytes() // 2 // (2 * max(input_size, hidden_size))
    return replace(layout, bf16_dw_rows=max(1, rows // 32) * 32)


def step_narrow(p, target):
    """A step of few rows with precision bf16 (bf16_layout): amx.step_narrow,
    in tiles of two panels where H allows whole aligned tiles."""
    amx.step_narrow(p, tile_panels(p.Hp, p.P, 2) if p.H % p.P == 0 else 1)


step_narrow_infer = step_narrow


def step_bwd_bf16(p, target):
    """A backward step with its product of bf16 operands (bf16_layout):
    amx.step_bwd on AMX tiles, else bf16_vectors.step_bwd in tiles of
    panels that divide Hp / P."""
    if p.amx_tiles:
        return amx.step_bwd(p)
    bf16_vectors.step_bwd(p, *_bf16_tile(p, target, 1))


def _bf16_tile(p, target, gates: int) -> tuple:
    """(rows, panels) of a bf16 product's register tile over the layer's
    units (bf16_vectors.tile_shape), its panels dividing Hp / P."""
    rows, panels = bf16_vectors.tile_shape(registers(target), gates)
    return rows, tile_panels(p.Hp, p.P, panels)


def _row_sums(p, at, at_var, vw):
    """The cell's reductions over units (Funcs over b): each computed per
    batch row at loop at_var of `at` (None: its own root loop over rows,
    in parallel), its sum split into vw partial sums, vectorized
    (rfactor), then added up as a tree."""
    for f in p.reductions:
        r = f.rvars(0)[0]
        ro, ri, u = hl.RVar(r.name() + "o"), hl.RVar(r.name() + "i"), hl.Var("u")
        f.update().split(r, ro, ri, vw, GUARD)
        if at is None:
            f.compute_root().parallel(f.args()[0])
        else:
            f.compute_at(at, at_var)
        try:
            partial = f.update().rfactor(ri, u)
        except Exception:   # a sum Halide cannot prove associative: one lane
            p.notes.append(f"{f.name()}: summed in one lane (no rfactor)")
            continue
        partial.compute_at(f, f.args()[0]).vectorize(u)
        partial.update().vectorize(u)
        # the lanes added as a tree of vector halves (Halide's VectorReduce),
        # not one after another: 3-4% of a layer-norm LSTM layer's forward
        # and backward (bench/RESULTS.md, "Schedule decisions": cpu.step rows)
        f.update().atomic().vectorize(f.rvars(0)[0])


def _row_stagings(p, at, at_var, vw):
    """The cell's costly unit values read by its sums and elsewhere (Funcs
    over (unit, b)): every unit of a batch row at loop at_var of `at`,
    vectorized, so that the sums and the cell read them instead of
    computing them again (bench/RESULTS.md, "Schedule decisions": cpu.step
    rows)."""
    for f in p.stagings:
        f.compute_at(at, at_var).vectorize(f.args()[0], vw, GUARD)


def _step_rows(p, target):
    """A step that reduces over the units: the recurrent product for every
    unit first (register tiles), then per batch row the reductions and the
    cell, units vectorized. One thread where the driver splits the steps
    (by rows: layout split rows_only); else in parallel, over unit panels
    and then rows (bench/RESULTS.md, "Schedule decisions": cpu.step rows)."""
    _product_tiles(p, target, p.stage("hg").compute_root(), None if p.split_steps else "jo",
                   p.param("h_prev").dim(1).extent(),
                   p.stage("out").output_buffers()[0].dim(1).extent())
    _cell_rows(p)


def _product_tiles(p, target, hg, par, extent=None, out_rows=None) -> None:
    """A step's recurrent product in the register tiles of the LSTM's step
    (cpu.step): proj_tile's where the rows fill them, else every gate x
    step_rows rows; one load of each h value feeds a tile's gates' FMAs;
    below step_rows rows, tiles of two panels and one row. Sets the
    driver's ranges of units to whole tiles. extent: the rows where hg is
    not an output; out_rows: the rows the call computes (h_prev may hold
    more), default hg's."""
    v, P = p.vars, p.P
    j, b, gate = v["j"], v["b"], v["gate"]
    acc, k = p.stage("hg_acc"), p.rdoms["k"].x
    batch = p.param("h_prev").dim(1).extent()
    group, rows = p.PG, step_rows(target)
    if out_rows is None:
        out_rows = hg.output_buffers()[0].dim(2).extent()
    wide = _wide(target, p.G, group, rows, out_rows)
    small_panels = tile_panels(p.Hp, P, 2) if p.H % P == 0 else 1
    register_tile(hg, acc, j, P, [(gate, None, ROUND), (b, rows, GUARD)], [k], par=par,
                  extent=extent, small=(batch < rows, small_panels, par), wide=wide)
    if wide is not None:
        _group_passes(hg, acc, j, gate, b, k, p.G, group, hl.Var("bo"), wide[1])
    p.split_quantum = small_panels


def _cell_rows(p) -> None:
    """The cell after its product, per batch row: the row's sums, its
    stagings and the cell, units vectorized; rows in parallel unless the
    driver splits the steps. Where the driver takes ranges of rows, W_hh
    may be as large as the knob rows_fwd_kib (csrc/threads.h; past it, the
    driver runs the step as step_product and step_cell), and ranges go
    down to one row."""
    j, b, P = p.vars["j"], p.vars["b"], p.P
    out = p.stage("out")
    p.split_batch_bytes = knob(p, "rows_fwd_kib") << 10
    jo, ji = hl.Var("jo"), hl.Var("ji")
    out.split(j, jo, ji, P, GUARD).vectorize(ji)
    if not p.split_steps:
        out.parallel(b)
    _row_sums(p, out, b, P)
    _row_stagings(p, out, b, P)
    for f in p.saved_stages():
        f.compute_at(out, jo).vectorize(j, P, GUARD).unroll(f.args()[1])


def step_product(p, target):
    """The product of a step run in two parts (pipeline.UNITS_FWD), on the
    driver's ranges of units: a whole step's register tiles."""
    _product_tiles(p, target, p.stage("hg"), None)


def step_cell(p, target):
    """The rest of a step run in two parts (pipeline.UNITS_FWD), on the
    driver's ranges of rows: the product with its bias is read, not
    computed; the rest as a whole step's."""
    _cell_rows(p)


step_cell_infer = step_cell


def step(p, target):
    """The whole step in one loop nest over tiles of the output: per tile
    (P units x proj_tile's rows and gate group where the batch fills them,
    else x step_rows rows and every gate), the recurrent product in
    registers, then the cell on it, then the stores of new states and
    saved gates."""
    if p.reductions:
        return _step_rows(p, target)
    if p.cpu_bf16:
        if p.amx_tiles:
            return amx.step(p)
        return bf16_vectors.step(p, *_bf16_tile(p, target, p.G))
    v, H, P = p.vars, p.H, p.P
    j, b, gate = v["j"], v["b"], v["gate"]
    out, acc = p.stage("out"), p.stage("hg_acc")
    batch = p.param("h_prev").dim(1).extent()
    # units past H (when P does not divide H) are computed and not stored
    j_tail = ROUND if H % P == 0 else GUARD
    group, rows = p.PG, step_rows(target)
    # batches that fill the projection tile's rows with few extra
    # (_few_extra_rows) take its tiles where they hold more rows: a group
    # of gates (the panels' groups, panel_layout) x those rows, one pass
    # over h a group (_group_passes)
    # (the output's rows: h_prev may hold more, as the driver's ranges of rows)
    wide = _wide(target, p.G, group, rows, out.output_buffers()[0].dim(1).extent())
    # Batches under `rows`: one row per tile, and two panels (8 accumulators,
    # enough to hide the FMA latency) where H allows whole aligned tiles
    # (bench/RESULTS.md, "Schedule decisions": cpu.step small batch).
    aligned = H % P == 0
    small_panels = tile_panels(p.Hp, P, 2) if aligned else 1
    # one thread: the driver runs ranges of units on its threads (split_steps)
    register_tile(out, acc, j, P, [(b, rows, GUARD)], [p.rdoms["k"].x], vec_tail=j_tail,
                  small=(batch < rows, small_panels, None), wide=wide)
    p.split_quantum = small_panels     # the driver's ranges: whole tiles
    p.split_batch_bytes = ROWS_FWD_BYTES   # ranges of rows below (see SPLIT_ROWS)
    at = hl.Var("bo")                  # the innermost tile loop (see register_tile)
    if not aligned:                    # whole panels at the guarded edge too
        for f in (acc, *p.saved_stages()):
            f.bound_extent(j, P)
    acc.unroll(gate)
    acc.update().unroll(gate)
    if wide is not None:    # the product a gate group at a time, each its own pass over k
        _group_passes(out, acc, j, gate, b, p.rdoms["k"].x, p.G, group, at, wide[1])
    for f in p.saved_stages():
        f.compute_at(out, at).vectorize(j, P).unroll(f.args()[1]).unroll(b)


def _wide(target, gates: int, group: int, rows: int, out_rows):
    """register_tile's `wide` for forward-step tiles: proj_tile's rows where its
    tile is of the panels' gate group and holds more rows than `rows`, and
    the call's rows (out_rows) fill them with few extra (_few_extra_rows);
    else None."""
    tile_gates, most = proj_tile(target, gates)
    if tile_gates != group or most <= rows:
        return None
    return most, _few_extra_rows(out_rows, most)


# Wide step tiles (proj_tile's) run where they compute at
# most this share of rows more than the batch has (a last tile shifted
# inwards repeats rows): their product runs about 1.3x the rate of the
# tiles of every gate (bench/RESULTS.md, "Schedule decisions":
# cpu.step_groups), so 8 rows in tiles of 6 (12 computed) would lose.
WIDE_EXTRA_ROWS = 0.25


def _few_extra_rows(batch, rows: int):
    """Whether the batch fills tiles of `rows` and they compute at most
    WIDE_EXTRA_ROWS more rows than it has (a Halide condition on the batch
    extent)."""
    quarters = round(1 / WIDE_EXTRA_ROWS)
    return (batch >= rows) & (((batch + rows - 1) / rows) * rows * quarters
                              <= batch * (quarters + 1))


def _group_passes(out, acc, j, gate, b, k, gates, group, at, wide_rows):
    """Where wide_rows holds (the wide tiles), a tile's product one gate
    group at a time, else every gate in one pass: acc computed per group
    inside a copy of the tile's sums (acc.in_) whose loop over the groups
    stays a loop, so that the copy is indexed at run time and a finished
    group's sums wait in memory, not in the registers the next group's
    pass needs (one allocation of every group's sums, which LLVM promotes
    to registers, spilled inside the second pass's loop). One group (every
    gate): the update's order alone."""
    # a row's broadcast of h feeds its gates' FMAs one after the other (with
    # the gates outside the rows every row's broadcast stays live: spills)
    jp, jv = hl.Var(j.name() + "p"), hl.Var(j.name() + "v")
    acc.update().reorder(jv, jp, gate, b, k)
    if group == gates:
        return
    go, gi = hl.Var("gate_o"), hl.Var("gate_i")
    sums = acc.in_().compute_at(out, at)
    for stage, f in ((sums.specialize(wide_rows), group), (sums, gates)):
        stage.split(gate, go, gi, f, ROUND).reorder(j, gi, b, go).vectorize(j).unroll(gi).unroll(b)
    acc.compute_at(sums, go)


# A step that stores the new states only: the same loop nest.
step_infer = step


def step_bwd(p, target):
    """The backward step of a cell that reduces over units (reducing_layout
    has no fused step; the other cells run step_bwd_fused). One thread
    where the driver runs ranges of rows on its threads (split_steps), else
    rows in parallel: one loop over rows for the pointwise part and its
    sums, outputs other than the product's operand computed in it rather
    than copied, then dh_prev = W_hh^T dhg (bench/RESULTS.md, "Schedule
    decisions": cpu.step rows)."""
    assert p.reductions, "step_bwd: a cell that reduces over units (the others: step_bwd_fused)"
    _bwd_rows(p, target, "dxp" if p.cell.dxp_is_dhg else "dhg", p.cell.states[1:])
    _dh_product(p, target, p.param("saved").dim(2).extent(), own=not p.split_steps)


def _dh_product(p, target, batch, own: bool) -> None:
    """dh_prev = its term + W_hh^T dhg in _dh_tiles' register tiles over
    `batch` rows; own: in parallel over the tiles (else the driver's threads
    take ranges of them)."""
    k, b = p.vars["k"], p.vars["b"]
    r = p.rdoms["jg"]
    out = p.stage("dprev_h")
    wide, rows, narrow = _dh_tiles(p, target)
    register_tile(out, p.stage("dh_prev_acc"), k, p.P, [(b, rows, GUARD)], [r.x, r.y],
                  panels=wide, small=(batch < rows, narrow, "ko" if own else None),
                  par="ko" if own else None, wide=_dh_wide(out, target, wide, rows))


def _bwd_rows(p, target, product_in, states) -> None:
    """A backward step's pointwise part: one loop over rows, each row's
    sums inside its iteration, every output (the state gradients of
    `states` too) computed in it; product_in (the product's operand, or
    None) computed whole first, then copied out."""
    b = p.vars["b"]
    vw = vector_width(target, p.H)
    names = tuple(n for n in (product_in, "dxp", "dhg" if not p.cell.dxp_is_dhg else None,
                              "dvec" if p.V else None) if n)
    names = tuple(dict.fromkeys(names))
    own = not p.split_steps
    first = None
    for name in names:
        copy = _pointwise(p.stage(name + "_out"), vw)
        if name != product_in:   # an output only: computed in the loop, no copy
            f = copy
        else:
            f = _pointwise(p.stage(name).compute_root(), vw)
            if own:
                copy.parallel(b)
        if own:
            f.parallel(b)
        if first is None:
            first = f
        else:
            f.compute_with(first, b)
    for s in states:
        d = p.stage("dprev_" + s).compute_with(first, b)
        if own:
            d.parallel(b)
    _row_sums(p, first, b, vw)   # each row's sums inside its iteration
    for s in states:
        _pointwise(p.stage("dprev_" + s), vw)


def step_bwd_cell(p, target):
    """The pointwise part of a backward step in two parts (pipeline.UNITS_BWD)
    on the driver's ranges of rows: step_bwd's loop over rows, dh_prev's
    pointwise term in it, no product."""
    _bwd_rows(p, target, None, p.cell.states)
    _dh_tiles(p, target)     # (the driver's ranges of units: the product's)


def step_bwd_product(p, target):
    """The product of a backward step in two parts (pipeline.UNITS_BWD) on the
    driver's ranges of units: step_bwd's tiles."""
    _dh_product(p, target, p.param("dhg").dim(2).extent(), own=False)


# The same step on the driver's ranges of units (pipeline.UNITS_BWD, a
# batch of too few rows to split): the pointwise part of every unit on each
# thread, the product's tiles of its own units.
step_bwd_units = step_bwd


def _dh_tiles(p, target, narrow=True) -> tuple:
    """(wide, rows, narrow): tiles of the backward product dh = W_hh^T dhg,
    wide panels x rows, or narrow panels x 1 row below that many rows.
    The accumulators fill half the vector registers (16 with AVX-512, 8
    with AVX2): 4 x 4 or 2 x 4, fewer panels and more rows (up to 8) where
    those panels of W_hh^T (G*H*P floats each) would not fit in half a 1 MiB
    L2 (knob dh_panel_kib, 512 KiB; they are read once per row tile); below
    that many rows, 8 panels x 1 row (one row is FMA latency-bound); where
    the rows fill them, tiles of 6 rows (_dh_wide). Tiles
    span panels that divide Hp / P and leave the driver at least two
    ranges of whole tiles (bench/RESULTS.md, "Schedule decisions":
    cpu.step_bwd tiles). Sets the driver's ranges: whole tiles of `wide`
    panels where every step of the loop has `rows` rows or more, else of
    whole tiles of both kinds (more threads where the wide tiles are
    narrower, e.g. 8 instead of 4 at H=512 with AVX-512); ranges of rows
    up to 1 MiB of W_hh (see SPLIT_ROWS). narrow False: below `rows` rows,
    tiles of wide panels x 1 row."""
    half = max(1, p.Hp // p.P // 2)
    fit = max(1, (knob(p, "dh_panel_kib") << 10) // (p.G * p.H * p.P * 4))
    accumulators = registers(target) // 2
    wide = tile_panels(p.Hp, p.P, min(accumulators // 4, half, fit))
    rows = min(8, accumulators // wide)
    narrow = tile_panels(p.Hp, p.P, min(8, half)) if narrow else wide
    p.split_quantum, p.split_quantum_small = wide, math.lcm(wide, narrow)
    p.split_small_below = rows
    p.split_batch_bytes = 1 << 20
    return wide, rows, narrow


def step_bwd_fused(p, target):
    """A backward step as one loop nest over tiles of its units k and rows
    (pipeline/backward.py _step_bwd_fused): per tile, the product dh = W_hh^T
    dhg_next in registers (the tiles of step_bwd's product), then the
    pointwise backward of those units and rows and its stores. Each of the
    driver's threads computes the pointwise part of its own units only
    (step_bwd's threads each compute it for every unit, since their product
    reads them all), with one barrier a step as before
    (bench/RESULTS.md, "Schedule decisions": cpu.step_bwd_fused)."""
    k, b = p.vars["k"], p.vars["b"]
    r = p.rdoms["jg"]
    out, acc = p.stage("out"), p.stage("dh_acc")
    batch = p.param("saved").dim(2).extent()
    # units past H (when P does not divide H) are computed and not stored:
    # the tiles at that edge are whole, one kind of them
    aligned = p.H % p.P == 0
    wide, rows, narrow = _dh_tiles(p, target, narrow=aligned)
    if not aligned:
        acc.bound_extent(k, p.P * wide)
    register_tile(out, acc, k, p.P, [(b, rows, GUARD)], [r.x, r.y], panels=wide,
                  vec_tail=ROUND if aligned else GUARD, small=(batch < rows, narrow, None),
                  par=None if p.split_steps else "ko", unroll_out=False,
                  wide=_dh_wide(out, target, wide, rows))
    # the costly forward values several outputs read (the LSTM's tanh(c'):
    # every gate's adjoint and dc; cells.lowering._read_by_several), once a
    # tile, before its outputs
    at = hl.Var(b.name() + "o")        # the innermost tile loop (register_tile)
    # (guarded: the pointwise inputs are read unclamped, at stored units only)
    for f in p.stagings:
        f.compute_at(out, at).vectorize(f.args()[0], p.P, GUARD)


def _dh_wide(out, target, panels: int, rows: int):
    """register_tile's `wide` for dh tiles of `panels` x `rows` that hold fewer than
    PROJ_LEAST_ACCUMULATORS accumulators (too few to hide the FMA latency:
    AVX2's 2 x 4; AVX-512's 4 x 4 hold 16): the most rows (PROJ_MOST_ROWS
    at most) whose accumulators, a weight vector a panel and a broadcast
    fit the vector registers (AVX2 2 panels x 6 rows), where the call's
    rows (out's) fill them with few extra (_few_extra_rows); else None."""
    most = min(PROJ_MOST_ROWS, (registers(target) - panels - 1) // panels)
    if panels * rows >= PROJ_LEAST_ACCUMULATORS or most <= rows:
        return None
    return most, _few_extra_rows(out.output_buffers()[0].dim(1).extent(), most)


def gather(p, target):
    """The one-hot projection: a class's block of W_ih's panels (with the
    bias) copied into xp's panels, 64 rows a task."""
    xp = p.stage("xp")
    ji, gate, n, jo = xp.args()
    no, ni = hl.Var("no"), hl.Var("ni")
    xp.reorder(ji, gate, jo, n).vectorize(ji).unroll(gate)
    xp.split(n, no, ni, 64, GUARD).parallel(no)


# The weight-gradient pipelines' schedules (schedules/cpu_grads.py).
grads, grads_ids = cpu_grads.grads, cpu_grads.grads_ids


# ---- the char LM's head and optimizer (halstm/model/kernels.py) -----------
# CPU training runs both as these pipelines, on every core (the head took
# 0.59x-0.64x of numpy's BLAS head on one thread: bench/RESULTS.md, "The
# char LM's engines").

def _head_product(out, acc, vec, row, reduce, target, rows, out_tail):
    """out(vec, row) = acc, a sum over `reduce`: register tiles of C vectors
    of vec by R rows (R = step_rows, C*R = three quarters of the vector
    registers; one row where rows < R), acc computed per tile over all C
    vectors (bound_extent; the algorithm reads zeros past the edge), the
    reduction outside the tile, the row tiles in parallel."""
    L, R = panel(target), step_rows(target)
    C = registers(target) * 3 // 4 // R
    name = out.name()
    vo, vi = hl.Var(f"{name}_vo"), hl.Var(f"{name}_vi")
    ro, ri = hl.Var(f"{name}_ro"), hl.Var(f"{name}_ri")
    for stage, r in ((out.specialize(rows >= R), R), (out, 1)):
        stage.split(vec, vo, vi, C * L, out_tail).split(row, ro, ri, r, SHIFT) \
            .reorder(vi, ri, vo, ro).vectorize(vi, L, GUARD).unroll(ri).parallel(ro)
    acc.compute_at(out, vo).bound_extent(vec, C * L).reorder_storage(vec, row)
    vp, vv = hl.Var(f"{name}_vp"), hl.Var(f"{name}_vv")
    for stage in (acc, acc.update()):
        stage.split(vec, vp, vv, L).vectorize(vv).unroll(vp).unroll(row)
    acc.update().reorder(vv, vp, row, *reduce)


def _rows_parallel(f, n, rows, L):
    """A stage over rows n: chunks of `rows` rows a task, n vectorized."""
    no, ni = hl.Var(f"{f.name()}_no"), hl.Var(f"{f.name()}_ni")
    f.split(n, no, ni, rows, GUARD).parallel(no).vectorize(ni, L, GUARD)


def head(p, target):
    """The three products as register tiles (_head_product); the softmax's
    row stages in chunks of 64 rows a task."""
    L = panel(target)
    v, n, k = p.vars["v"], p.vars["n"], p.vars["k"]
    y = p.args[0]
    H, N = y.dim(0).extent(), y.dim(1).extent()
    # The NaN / Inf tests take no vector tail: a predicated tail loads its
    # floats through phis that carry LLVM's no-NaN / no-Inf flags, and LLVM
    # then folds the test (found with V = 5, 16 lanes). y's rows are scanned
    # in whole vectors where H is a multiple of the vector, else one by one.
    p.stage("bad_w").compute_root()
    no = hl.Var("bad_row_no")
    p.stage("bad_row").compute_root().split(n, no, n, 64, GUARD).parallel(no)
    y_scan = p.stage("y_scan")
    rk, ko, ki = y_scan.rvars(0)[0], hl.RVar("y_scan_ko"), hl.RVar("y_scan_ki")
    y_scan.update().specialize(H % L == 0).split(rk, ko, ki, L, GUARD).atomic().vectorize(ki)
    p.stage("wt").compute_root().vectorize(v, L, ROUND)
    p.stage("w_pad").compute_root().vectorize(k, L, ROUND)
    _head_product(p.stage("logits").compute_root(), p.stage("logits_acc"), v, n,
                  p.stage("logits_acc").rvars(0), target, N, ROUND)
    for name in ("mx", "total"):
        _rows_parallel(p.stage(name).compute_root(), n, 64, L)
    _rows_parallel(p.stage("loss"), n, 64, L)
    dno = hl.Var("dlogits_no")
    p.stage("dlogits").compute_root().split(n, dno, n, 8, GUARD).parallel(dno) \
        .vectorize(v, L, ROUND)
    _head_product(p.stage("dw"), p.stage("dw_acc"), v, k, p.stage("dw_acc").rvars(0), target,
                  H, GUARD)
    p.stage("db").vectorize(v, L, GUARD)
    _head_product(p.stage("dy"), p.stage("dy_acc"), k, n, p.stage("dy_acc").rvars(0), target,
                  N, GUARD)


def sumsq(p, target):
    p.stage("partial").compute_root().vectorize(p.vars["j"], panel(target))


def _flat(f, i, target):
    """A 1-D stage in parallel chunks of 2^14, vectorized."""
    io = hl.Var("io")
    f.split(i, io, i, 1 << 14, GUARD).parallel(io).vectorize(i, panel(target), GUARD)


def _update(p, target):
    _flat(p.stage("update"), p.vars["i"], target)


def _elementwise(p, target):
    _flat(p.stage("out"), p.vars["i"], target)


adam = sgd = _update
add = mul = dropout = _elementwise


def rows(p, target):
    p.stage("out").parallel(p.vars["m"]).vectorize(p.vars["k"], panel(target), GUARD)


def onehot(p, target):
    p.stage("x").parallel(p.vars["n"]).vectorize(p.vars["v"], panel(target), GUARD)
