"""CUDA lanes products: register tiles (schedules/cuda_tiles.py) whose
tile is a block-level register allocation striped across the lanes
(Halide's gpu_lanes), so the reduction can run in chunks around the
lanes: each chunk of the broadcast operand is loaded by the lanes
together (coalesced) and handed out by warp shuffles (in one-warp
products, through shared memory). The forward step and dh = W_hh^T dhg
use them from H = 512 where H is a multiple of 32; the projection and dx
wherever H (and K, for the projection) is one (`lanes_fit`).
"""
import halide as hl

from .cuda_tiles import GUARD, LANES, SHIFT


def lanes_product(out, acc, lane, rows_var, rows, tile, reduce, reduce_extent, extent,
                  staged, slices, units=1, gates=None, chunk=LANES, unroll=8, out_tile=(),
                  chunk_arg=0, chunk_outer=False):
    """A product in the style of Halide's apps/conv_layer: blocks of
    `slices` warps over (32*units units x `rows` batch rows); each warp sums
    one slice of the reduction for the block's whole tile in registers
    striped across its lanes (MemoryType.Register at block level with
    gpu_lanes: every lane keeps its units' accumulators, units lane + 32*u),
    chunk by chunk; each chunk of the broadcast operand (`staged`, chunk x
    ... x rows values) is loaded by the lanes together, coalesced, and
    handed out by warp shuffles, where the register-tile schedule issued a
    broadcast load per value per reduction step. The warps' sums meet in
    shared memory and warp 0 finishes (bias, cell, stores). With one warp
    (slices 1) each chunk goes through shared memory instead: every lane
    stores its column and reads each value back (a broadcast load), 8 shared
    loads and no shuffles per reduction step
    (bench/RESULTS.md, "Schedule decisions": cuda.lanes one warp).
    out(lane, rows_var) or acc's copy; acc(lane, *tile, rows_var): the
    accumulator, its update over `reduce` (extent reduce_extent, split into
    slices and chunks) and `gates` (a second, small RVar, unrolled); extent:
    the runtime extent of rows_var, or its fixed extent (an int). Below
    `rows` rows, one row a block. chunk_arg: the argument of `staged` the
    chunks run along (the lanes load one value of it each); chunk_outer:
    store each staged chunk with that axis outermost, so that the values one
    reduction step reads lie together (vector shared loads)."""
    lo, li = hl.Var(lane.name() + "o"), hl.Var(lane.name() + "i")
    lu = hl.Var(lane.name() + "u")
    bo, bi = hl.Var(rows_var.name() + "o"), hl.Var(rows_var.name() + "i")
    if isinstance(extent, int):         # a fixed extent: one loop nest
        tiles = [(out, rows if extent >= rows else 1)]
    else:
        tiles = [(out.specialize(extent >= rows), rows), (out, 1)]
    for stage, f in tiles:
        stage.split(lane, lo, li, LANES * units, GUARD).split(li, lu, li, LANES) \
             .split(rows_var, bo, bi, f, SHIFT) \
             .reorder(bi, *out_tile, lu, li, lo, bo).gpu_blocks(lo, bo).gpu_lanes(li) \
             .unroll(bi).unroll(lu)
        for v in out_tile:
            stage.unroll(v)
    inner = list(tile) + [rows_var]
    if units > 1:
        acc.bound_extent(lane, LANES * units)      # a guarded edge block still computes it all
    ro, ri = hl.RVar(acc.name() + "_ro"), hl.RVar(acc.name() + "_ri")
    rko, rki, rkii = (hl.RVar(acc.name() + n) for n in ("_rko", "_rki", "_rkii"))
    u = hl.Var(acc.name() + "_u")
    g = [] if gates is None else [gates]

    def lanes(stage, *outer):
        """lane split into in-lane units and the lanes, the lanes outermost
        of the listed loops (one thread loop, no barrier between elements)"""
        stage.split(lane, lu, li, LANES).reorder(*inner, lu, li, *outer) \
             .gpu_lanes(li).unroll(lu)
        for v in inner:
            stage.unroll(v)
        return stage

    def by_chunks(f, r, memory, *warp):
        """f's update summed over r chunk by chunk, the lanes inside, each
        chunk of `staged` loaded by the lanes into `memory` first"""
        pu = f.update()
        pu.split(r, rko, rki, chunk, GUARD).split(rki, rki, rkii, unroll, GUARD)
        lanes(pu, *warp, *g, rkii, rki, rko).unroll(rkii)
        for v in (*warp, *g):
            pu.unroll(v)
        sv = staged.args()
        along = sv[chunk_arg]
        st = staged.in_(f).compute_at(f, rko).store_in(memory) \
            .bound_extent(along, chunk).gpu_lanes(along)
        for v in sv:
            if v.name() != along.name():
                st.unroll(v)
        if chunk_outer:
            st.reorder_storage(*[v for v in sv if v.name() != along.name()], along)

    acc.compute_at(out, lo).store_in(hl.MemoryType.Register)
    lanes(acc)
    if slices == 1:
        # One warp: the chunks go through shared memory (each lane stores its
        # column, every lane reads each value back, a broadcast), not shuffles.
        # A block of lane loops only has no thread loops, and Halide 21 then
        # inserts no barrier between the stores and the loads (it takes one
        # warp's lanes as synchronous: FuseGPUThreadLoops). Scalar loads:
        # 4 values at a time (ld.shared.v4, rows innermost) are no faster
        # (bench/results/gpu_ab_s8_smem.txt).
        by_chunks(acc, reduce, hl.MemoryType.GPUShared)
        return out
    part = acc.update().split(reduce, ro, ri, -(-reduce_extent // slices), GUARD).rfactor(ro, u)
    whole = part.in_(acc)               # the warps' sums (shared memory)
    lanes(acc.update(), ro).unroll(ro)
    whole.compute_at(out, lo)
    lanes(whole, u).gpu_threads(u)
    part.compute_at(whole, u).store_in(hl.MemoryType.Register)
    lanes(part, u).unroll(u)
    by_chunks(part, ri, hl.MemoryType.Register, u)    # each warp's chunks shuffled
    return out


def lanes_slices(H: int, want: int) -> int:
    """Warps a lanes product's reduction is split over: at most `want`, and
    each slice at least a warp's width (a chunk staged in lanes)."""
    while want > 1 and H < want * LANES:
        want //= 2
    return want


def lanes_fit(H: int) -> bool:
    """Where the products use lanes_product: from H = 512, where they beat
    the register tiles, and H a multiple of a warp (at other H Halide cannot
    stripe a 3-gate step's accumulator across the lanes: its index is not
    affine in the lane) (bench/RESULTS.md, "Schedule decisions": cuda_lanes.lanes_fit)."""
    return H >= 512 and H % LANES == 0


# The lanes products' shapes (rows and units a lane, warps a block) are
# the fastest of the alternatives timed on an H100 (bench/RESULTS.md,
# "Schedule decisions": cuda.step lanes; cuda.dh lanes; cuda.proj lanes;
# cuda.dx lanes; cuda.dW lanes).
