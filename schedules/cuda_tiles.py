"""CUDA register tiles and one-kernel grids: the products and pointwise
stages of schedules/cuda.py are built from these.

Register tiles (`register_tile`): blocks of one warp (or a few sharing one
reduction), a lane per output unit along the packed axis (weight panels
are a warp wide, so the 32 lanes read one coalesced 128-byte row of a
panel per reduction step), and per lane a tile of every gate x a few
batch rows (or time x batch rows) in registers. The other operand's
values are the same for every lane: one broadcast load each, per step.
Pointwise and packing stages are one kernel each, every axis on the grid
(`grid_kernel`).
"""
import halide as hl

LANES = 32                      # a warp; also the weight panel width
MAX_THREADS = 1024              # a CUDA block's threads at most
SHIFT = hl.TailStrategy.ShiftInwards
GUARD = hl.TailStrategy.GuardWithIf


def gate_lane_units(G: int) -> int:
    """Units a warp of a narrow step holds with every gate on a lane of
    its own: the largest power of two whose G gates fit a warp (8 for 4
    gates and for 3): a divisor of the weight panels' 32, so that
    a block's units never pass the last panel."""
    return 1 << ((LANES // G).bit_length() - 1)


def register_tile(out, acc, lane, cols, reduce, unroll=4, acc_only=(), slices=1,
                  reduce_extent=None, per_lane=1, tile_from=None, extent=None,
                  partial_in_registers=False, gate_lanes=None):
    """Register-tile out(lane, ...): lane split across a warp's threads,
    blocks over the tiles. cols: (var, factor, runtime) per other axis of
    out, in-thread and unrolled; factor None takes the whole (small, fixed)
    axis. A runtime axis (batch, rows) is tiled by `factor` with
    ShiftInwards where its extent allows (every tile full, so the
    accumulators have constant size) and by 1 elsewhere; a fixed axis is
    guarded at its edge. acc is computed per thread, reduction outermost,
    its innermost reduction axis unrolled by `unroll` so that the loads of
    several steps are in flight at once
    (bench/RESULTS.md, "Schedule decisions": cuda.unroll). acc_only: axes
    of acc that out lacks (the step's gates), also in-thread and unrolled.
    slices > 1 (warp_slices of reduce_extent, the extent of reduce[0]): the
    reduction is split across that many warps of the block (rfactor), in
    runs of ceil(reduce_extent / slices), whose partial tiles meet in
    shared memory; for the per-step products, whose few
    tiles would otherwise leave most of the GPU idle. per_lane > 1: each
    thread takes that many neighbouring units along `lane` (a warp then
    covers 32 * per_lane), so that one broadcast load of the other operand
    feeds per_lane more FMAs. tile_from: the smallest extent of the
    runtime axis that gets tiles (default: the factor); below it, one row
    a thread. extent: the runtime axis' extent where out is not an output.
    partial_in_registers: each thread sums its slice's tile in registers
    and stores it to shared memory once, where a kernel's other shared
    stages would have LLVM store it after every add (as cuda_rows' sums).
    gate_lanes: (gate, G), an acc_only axis of extent G, with slices > 1
    and tiles of one row: that axis on the lanes too, a warp holding
    gate_lane_units(G) units x every gate, one accumulator a thread."""
    lanes = LANES if gate_lanes is None else gate_lane_units(gate_lanes[1])
    runtime = [(v, f) for v, f, rt in cols if rt]
    assert gate_lanes is None or (slices > 1 and all(f == 1 for _, f in runtime)), \
        "gate lanes: a reduction over warps, one row a thread"
    assert len(runtime) <= 1, "one runtime axis per tile"
    if runtime:
        v, f = runtime[0]
        if extent is None:   # out is an output: the extent of its buffer
            dims = {a.name(): d for d, a in enumerate(out.args())}
            extent = out.output_buffers()[0].dim(dims[v.name()]).extent()
        if f > 1:
            tile_loops(out.specialize(extent >= max(f, tile_from or f)), out, lane, cols, f,
                       per_lane)
        tile_loops(out, out, lane, cols, 1, per_lane, lanes)
    else:
        tile_loops(out, out, lane, cols, None, per_lane, lanes)
    acc.compute_at(out, hl.Var(lane.name() + "i"))
    tile_vars = [v for v, f, rt in cols] + list(acc_only)
    if per_lane > 1:
        assert slices == 1
        acc.bound_extent(lane, per_lane)     # reads past the edge must be safe
        tile_vars = [lane] + tile_vars
    for v, f, rt in cols:
        if f is not None and not rt:
            acc.bound_extent(v, f)      # a guarded edge tile still computes f
    for stage in (acc, acc.update()):
        for v in tile_vars:
            stage.unroll(v)
    ro, ri = hl.RVar(acc.name() + "_ro"), hl.RVar(acc.name() + "_ri")
    if slices == 1:
        acc.update().split(reduce[0], ro, ri, unroll, GUARD).unroll(ri)
        order = ([] if per_lane > 1 else [lane]) + tile_vars + [ri, ro] + list(reduce[1:])
        acc.update().reorder(*order)
        return out
    # partial[lane, tile..., u] = the sum over slice u of the reduction
    u = hl.Var(acc.name() + "_u")
    run = -(-reduce_extent // slices)
    assert -(-reduce_extent // run) == slices, "every warp's run holds part of the reduction"
    upd = acc.update().split(reduce[0], ro, ri, run, GUARD)
    partial = upd.rfactor(ro, u)
    acc.update().reorder(*([lane] + tile_vars + [ro])).unroll(ro)
    kio, kii = hl.RVar(acc.name() + "_kio"), hl.RVar(acc.name() + "_kii")
    threads = [lane, u]
    if partial_in_registers:     # a thread's tile in registers, stored once (shared)
        # (lanes and slices fused into one thread axis: the block's other
        # stages' threads run along the first, whose extent Halide takes
        # as the largest of any stage's; a second would multiply it)
        t = hl.Var(acc.name() + "_t")
        shared = partial.in_(acc).compute_at(out, hl.Var(lane.name() + "o")) \
            .bound_extent(lane, LANES).bound_extent(u, slices) \
            .reorder(*(tile_vars + threads)).fuse(lane, u, t) \
            .gpu_threads(t)
        for v in tile_vars:
            shared.unroll(v)
        partial.compute_at(shared, t).store_in(hl.MemoryType.Register) \
            .bound_extent(lane, 1).bound_extent(u, 1)
        threads = []
    else:
        partial.compute_at(out, hl.Var(lane.name() + "o")).bound_extent(lane, lanes)
    pu = partial.update()
    pu.split(ri, kio, kii, unroll, GUARD).unroll(kii)
    lane_axes = [lane]
    if gate_lanes is not None:
        # thread (unit, gate): units first, so that a warp's loads of one
        # gate's weights are contiguous
        gate, G = gate_lanes
        partial.bound_extent(gate, G)
        tile_vars = [v for v in tile_vars if v.name() != gate.name()]
        lane_axes = [lane, gate]
    partial.reorder(*(tile_vars + lane_axes + [u]))
    pu.reorder(*(tile_vars + [kii, kio] + list(reduce[1:]) + lane_axes + [u]))
    if gate_lanes is not None:
        t = hl.Var(acc.name() + "_t")
        partial.fuse(lane, gate, t)
        pu.fuse(lane, gate, t)
        threads = [t, u]
    if threads:
        partial.gpu_threads(*threads)
        pu.gpu_threads(*threads)
    for stage in (partial, pu):
        for v in tile_vars:
            stage.unroll(v)
    return out


def even_slices(extent: int, want: int) -> int:
    """The largest of want, want/2, ..., 1 that divides extent (units a
    thread takes of whole panels)."""
    n = want
    while n > 1 and extent % n:
        n //= 2
    return n


def warp_slices(extent: int, want: int, even_first: bool = False) -> int:
    """Warps a register tile's reduction of `extent` is split over (register_tile's
    slices): `want` where it divides extent; else as many runs of
    ceil(extent / want) as extent fills, the last one shorter (guarded).
    even_first: the largest power of two up to want that divides extent,
    where that is 2 or more (even_slices). A split by a divisor alone left odd
    H on one warp: the steps took 1.7x-1.9x the split's time forward and
    2.0x-3.2x backward at H = 85, 650 (H200), and the folded steps' product
    lost to more, shorter runs where a divisor gave several warps
    (bench/RESULTS.md, "Schedule decisions": cuda.warp slices)."""
    even = even_slices(extent, want)
    if even == want or (even_first and even > 1):
        return even
    run = -(-extent // want)
    return -(-extent // run)


def tile_loops(stage, func, lane, cols, runtime_factor, per_lane=1, lanes=LANES):
    lo, li = hl.Var(lane.name() + "o"), hl.Var(lane.name() + "i")
    stage.split(lane, lo, li, lanes * per_lane, GUARD)
    inner, blocks = [], [lo]
    if per_lane > 1:
        lv = hl.Var(lane.name() + "v")
        stage.split(li, li, lv, per_lane)
        inner.append(lv)
    for v, f, rt in cols:
        if f is None:
            inner.append(v)
            continue
        o, i = hl.Var(v.name() + "o"), hl.Var(v.name() + "i")
        stage.split(v, o, i, runtime_factor if rt else f, SHIFT if rt else GUARD)
        inner.append(i)
        blocks.append(o)
    tiled = {lane.name()} | {c[0].name() for c in cols}
    assert all(a.name() in tiled for a in func.args()), "every axis of out is tiled"
    stage.reorder(*(inner + [li] + blocks)).gpu_threads(li).gpu_blocks(*blocks)
    for i in inner:
        stage.unroll(i)


def grid_kernel(f, stage=None, along=None):
    """A pointwise or copy stage (f's pure definition, or `stage` of f) as
    one kernel: every axis fused into one (the first innermost, so that
    neighbouring threads touch neighbouring elements), 128 threads a block.
    One grid axis: the second and third allow only 65535 blocks. along: a Func scheduled
    by grid_kernel whose kernel also computes f (compute_with; the two may differ
    in size)."""
    stage = f if stage is None else stage
    args = f.args()
    x = args[0]
    for a in args[1:]:
        stage.fuse(x, a, x)
    name = (along or f).name()
    xo = hl.Var(f"{name}_xo")
    stage.gpu_tile(x, xo, hl.Var(f"{name}_xi"), 128, GUARD)
    if along is not None:
        stage.compute_with(along, xo)
    return f
