"""Hand-written CUDA schedules.

Two kinds of product:

- Register tiles (`_tile`): blocks of one warp (or a few sharing one
  reduction), a lane per output unit along the packed axis (weight panels
  are a warp wide, so the 32 lanes read one coalesced 128-byte row of a
  panel per reduction step), and per lane a tile of every gate x a few
  batch rows (or time x batch rows) in registers. The other operand's
  values are the same for every lane: one broadcast load each, per step.
- Lanes products (`_lanes_product`): the same lanes and tiles, but the
  tile is a block-level register allocation striped across the lanes
  (Halide's gpu_lanes), so the reduction can run in chunks around the
  lanes: each chunk of the broadcast operand is loaded by the lanes
  together (coalesced) and handed out by warp shuffles (in one-warp
  products, through shared memory). The forward step
  and dh = W_hh^T dhg use them from H = 512 where H is a multiple of 32;
  the projection and dx wherever H (and K, for the projection) is one.

The forward step is one kernel: product, cell and every store. Pointwise
and packing stages are one kernel each, every axis on the grid.
"""
import halide as hl

from ..layout import Layout

LANES = 32                      # a warp; also the weight panel width
SHIFT = hl.TailStrategy.ShiftInwards
GUARD = hl.TailStrategy.GuardWithIf


notes: list[str] = []   # the shape-dependent choices of the build in progress (manifest)


def layout(target: hl.Target) -> Layout:
    """(Called first in every build: it starts a new list of notes.)
    Packed operand shapes: weight panels a warp's worth of units wide;
    registers a thread may use (the JIT's limit, set by the driver): the
    tiles below hold up to 64 accumulators, and 256-thread blocks of 128
    registers still fit an SM's 65536. cuda_graphs: the step pipelines
    allocate no device memory of their own (every stage lives in registers
    or shared memory), so the driver may capture a time loop into a CUDA
    graph, which bakes in every pointer its kernels use (tested in
    tests/test_cuda_nogpu.py). fused_bwd_below: below this hidden size
    the backward time loop runs step_bwd_fused, one kernel a step (see
    there for what it measured). raw_bwd_weights: the backward products
    read W_ih and W_hh as given, along their input units (coalesced, as
    from the panels), with no pack_bwd. At large_2048 (H100) pack_bwd's two
    copies took 2 x 82 us a call, 2 x 45 as copies of 8 elements a thread
    (results/ncu_s10_pack.txt); against the latter, the layer backward
    without pack_bwd took 0.986x the time at H=2048 B=32 T=50, 0.990x at
    H=1024 B=64 T=25, within 1% either way at H=512 (K=65), H=128 and the
    GRU at H=1024 (bench/gpu_ab.py, results/gpu_ab_s10_raw_bwd.txt)."""
    notes.clear()
    return Layout(panel=LANES, dw_cols=LANES, dw_rows=1, max_registers=128, cuda_graphs=True,
                  read_outputs=True, fused_bwd_below=512, raw_bwd_weights=True)


def _tile(out, acc, lane, cols, reduce, unroll=4, acc_only=(), slices=1, reduce_extent=None,
          per_lane=1, tile_from=None, extent=None):
    """Register-tile out(lane, ...): lane split across a warp's threads,
    blocks over the tiles. cols: (var, factor, runtime) per other axis of
    out, in-thread and unrolled; factor None takes the whole (small, fixed)
    axis. A runtime axis (batch, rows) is tiled by `factor` with
    ShiftInwards where its extent allows (every tile full, so the
    accumulators have constant size) and by 1 elsewhere; a fixed axis is
    guarded at its edge. acc is computed per thread, reduction outermost,
    its innermost reduction axis unrolled by `unroll` so that the loads of
    several steps are in flight at once (without it, each step waited for
    its loads: 49 us a step at latency_256_b1 on an H100). acc_only: axes
    of acc that out lacks (the step's gates), also in-thread and unrolled.
    slices > 1 (it must divide reduce_extent, the extent of reduce[0]): the reduction is
    split across that many warps of the block (rfactor), whose partial
    tiles meet in shared memory; for the per-step products, whose few
    tiles would otherwise leave most of the GPU idle. per_lane > 1: each
    thread takes that many neighbouring units along `lane` (a warp then
    covers 32 * per_lane), so that one broadcast load of the other operand
    feeds per_lane more FMAs. tile_from: the smallest extent of the
    runtime axis that gets tiles (default: the factor); below it, one row
    a thread. extent: the runtime axis' extent where out is not an output."""
    runtime = [(v, f) for v, f, rt in cols if rt]
    assert len(runtime) <= 1, "one runtime axis per tile"
    if runtime:
        v, f = runtime[0]
        if extent is None:   # out is an output: the extent of its buffer
            dims = {a.name(): d for d, a in enumerate(out.args())}
            extent = out.output_buffers()[0].dim(dims[v.name()]).extent()
        _loops(out.specialize(extent >= max(f, tile_from or f)), out, lane, cols, f, per_lane)
        _loops(out, out, lane, cols, 1, per_lane)
    else:
        _loops(out, out, lane, cols, None, per_lane)
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
    upd = acc.update().split(reduce[0], ro, ri, reduce_extent // slices)
    partial = upd.rfactor(ro, u)
    acc.update().reorder(*([lane] + tile_vars + [ro])).unroll(ro)
    partial.compute_at(out, hl.Var(lane.name() + "o")).bound_extent(lane, LANES)
    kio, kii = hl.RVar(acc.name() + "_kio"), hl.RVar(acc.name() + "_kii")
    partial.reorder(*(tile_vars + [lane, u])).gpu_threads(lane, u)
    pu = partial.update()
    pu.split(ri, kio, kii, unroll, GUARD).unroll(kii)
    pu.reorder(*(tile_vars + [kii, kio] + list(reduce[1:]) + [lane, u])).gpu_threads(lane, u)
    for stage in (partial, pu):
        for v in tile_vars:
            stage.unroll(v)
    return out


def _slices(extent: int, want: int) -> int:
    """The largest of want, want/2, ..., 1 that divides extent (warps a
    reduction is split over; units a thread takes of whole panels)."""
    n = want
    while n > 1 and extent % n:
        n //= 2
    return n


def _loops(stage, func, lane, cols, runtime_factor, per_lane=1):
    lo, li = hl.Var(lane.name() + "o"), hl.Var(lane.name() + "i")
    stage.split(lane, lo, li, LANES * per_lane, GUARD)
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


def _grid(f, stage=None, along=None):
    """A pointwise or copy stage (f's pure definition, or `stage` of f) as
    one kernel: every axis fused into one (the first innermost, so that
    neighbouring threads touch neighbouring elements), 128 threads a block.
    One grid axis: the second and third allow only 65535 blocks. along: a Func scheduled
    by _grid whose kernel also computes f (compute_with; the two may differ
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


# The forward's weight packing, on every call (the weights may have
# changed): at large_2048 (H100, ncu) one fused-grid thread per element took
# 135 us per weight, 26% of DRAM's bandwidth; the transpose below 43 us
# (78%). Layer forward (bench/gpu_ab.py, interleaved,
# results/gpu_ab_s10_pack.txt): 0.963x at H=2048 B=32 T=50, 0.951x at
# H=1024 B=64 T=25; within 2% either way at H=512 (K=65) and H=128. (Eight
# elements a thread along k, without shared memory: 89 us, 0.979x / 0.963x.)
def _transpose(f, w):
    """wp(ji, gate, k, jo) = w(k, jo*P + ji, gate) through shared memory:
    a block of 32 x 8 threads moves a 32 (k) x 32 (ji) tile; w's rows are
    read along k and the panel's rows written along ji, both coalesced; the
    staged tile is padded to 33 columns, so that reading it across does not
    conflict in the shared memory banks."""
    ji, gate, k, jo = f.args()
    ko, ki, kt, ku = (hl.Var(f.name() + n) for n in ("_ko", "_ki", "_kt", "_ku"))
    b0, b = hl.Var(f.name() + "_b0"), hl.Var(f.name() + "_b")
    f.split(k, ko, ki, LANES, GUARD).split(ki, kt, ku, 4, GUARD) \
     .reorder(ku, ji, kt, gate, ko, jo).fuse(gate, ko, b0).fuse(b0, jo, b) \
     .gpu_blocks(b).gpu_threads(ji, kt).unroll(ku)
    tile = w.in_(f)                     # tile(k, j, gate)
    k_, j_, gate_ = tile.args()
    jt, ju = hl.Var(f.name() + "_jt"), hl.Var(f.name() + "_ju")
    tile.compute_at(f, b).align_storage(k_, LANES + 1) \
        .split(j_, jt, ju, 4, GUARD).reorder(ju, k_, jt, gate_).gpu_threads(k_, jt).unroll(ju)


def pack(p, target):
    for name, w in zip(("wp_ih", "wp_hh"), p.inputs):     # inputs: w_ih, w_hh
        _transpose(p.stage(name), w)


# Rows per thread of the projection and gradient GEMMs (N = T*B rows).
ROWS = 16


def _gemm_unroll(H: int) -> tuple[int, int]:
    """How far the projection's, resp. dx's and dW's, reduction loops are
    unrolled (loads of that many steps in flight). From H = 512, 16 and 8
    (with 8 rows a thread in dx) rather than 4 and 2 (H100,
    bench/gpu_probe.py, two runs, results/gpu_gemm_unroll.txt): forward
    1.81/1.72 -> 1.69/1.71 ms at H=1024 B=64 T=25, 6.47/6.42 -> 6.10/6.08 at
    H=2048 B=32 T=50, 2.57/2.62 -> 2.50/2.51 at H=512 B=64 T=100; backward
    4.04/3.91 -> 3.80/3.77, 13.65/13.70 -> 13.21/13.11, 4.60/4.60 ->
    4.41/4.49. Unrolling by 2 and 1 was 3-20% slower; 4 rows a thread in
    the projection 5-20% slower."""
    return (16, 8) if H >= 512 else (4, 2)
# The per-step products unroll their reductions by 8. Tried from H = 512
# (H100, bench/gpu_probe.py, two runs, results/gpu_step_unroll.txt): 16 or
# 32 made the forward step 40-75% slower (register pressure), 4 was within
# 5% either way; the backward product within 5% at 4, 16 and 32.
# Warps that share one tile's reduction in the per-step products. Tried
# below H = 512 (H100, bench/gpu_probe.py, two runs,
# results/gpu_step_slices_unroll.txt): 16 or 4 warps, and the reduction
# unrolled by 16 rather than 8; at small_128_b16 every variant fell within
# the runs' spread (forward 4.2-6.1 us a step, backward 8.8-11.5), at
# latency_256_b1 16 warps gained 5-10% (3.3 against 3.5-3.9 us forward).
SLICES = 8


def _tile_from(H: int) -> int:
    """The smallest batch whose steps take several rows a thread. Below
    H = 512 a batch of up to 16 takes one row a thread, 4x the blocks: a
    forward step of small_128_b16 took 4.5 us instead of 7.5 with 4 rows
    (H100, bench/gpu_probe.py, results/gpu_small_variants.txt; 2 rows 6.9)."""
    return 17 if H < 512 else _batch_rows(H)


def _batch_rows(H: int) -> int:
    """Batch rows per thread of a step: fewer at small H, so that the few
    unit panels still spread over enough blocks.

    Tried at H >= 512 (H100, bench/gpu_probe.py forward / backward ms, one
    run each; 8 rows and 8 warps measured 2.68/7.40 at H=512 B=64 T=100,
    1.89/4.50 at H=1024 B=64 T=25, 7.27/14.78 at H=2048 B=32 T=50): 16 rows
    with 8 warps does not launch (its 64 KB of partial sums pass the 48 KB
    of shared memory); 16 rows, 4 warps: 6.73/9.35, 3.92/5.09,
    16.8/18.5; 4 rows: 2.47/7.07, 2.23/4.56, 7.87/16.6; 4 rows, 16 warps:
    2.86/6.82, 2.65/4.86, 9.94/16.2; 8 rows, 4 warps: 3.21/8.23, 2.30/4.86,
    9.67/17.5; 2 rows: 3.05/7.50, 2.86/4.98, 13.2/20.3. Loading the
    broadcast operand (h, dhg, x) 16 bytes at a time into registers first
    (ld.global.v4; 84 -> 36 loads per 256 FMAs in the projection) measured
    no faster either: 2.66/7.16, 2.02/4.90, 6.67/14.8."""
    return 8 if H >= 512 else 4


# Tried (H100, bench/gpu_probe.py forward/backward ms, two runs each,
# results/gpu_share_warps.txt): blocks of 2, 4 or 8 warps whose tiles are
# neighbours along the rows (projection, dx) or the hidden units (dW), so
# that the weight panel they share comes from L1 rather than L2 (ncu showed
# an L1 hit rate of 35% and 25% occupancy in the projection at
# deepbench_1024). Slower or the same everywhere: H=1024 B=64 T=25
# 1.69-1.75/3.92-4.27 with one warp, 1.78-1.94/5.13-5.53 with 2-8; H=2048
# B=32 T=50 6.45-6.66/13.9 against 6.61-7.29/18.3-18.9; H=128 B=16 T=100
# 0.50/1.06 against 0.44-0.64/0.94-1.17. L2 traffic does not limit them.
def proj(p, target):
    v = p.vars
    # Where H and K are multiples of a warp (the chunks of x staged in lanes
    # are a warp wide, and x is clamped along its rows only), at every H:
    # below H = 512 too, the lanes projection measured faster than the
    # register tiles of 16 rows a thread, whose few tiles (400 warps at
    # small_128_b16) left most of the GPU idle (H100, bench/gpu_ab.py,
    # interleaved, results/gpu_ab_s8_small.txt: with dx as a lanes product
    # too, the layer's forward 0.961-0.987x and backward 0.939-0.943x the
    # register tiles' at H=128 B=16 T=100 in two runs; at H=256 B=1 T=1000
    # forward 1.004-1.008x, backward 0.981-0.985x).
    if _lanes_proj(p):
        notes.append("proj: a lanes product; a lane holds every gate of one unit for 8 rows "
                     "(T*B) where T*B >= 8, one row otherwise; one warp, x staged in chunks "
                     "in shared memory")
        out = p.stage("xp")
        _lanes_product(out, p.stage("xp_acc"), v["j"], v["t"], 8, [v["gate"]], p.rdoms["i"].x,
                       p.K, out.output_buffers()[0].dim(2).extent(), p.stage("x_in"), 1,
                       out_tile=[v["gate"]])
        return
    rows = ROWS if p.H < 512 else ROWS // 2      # more tiles (see DW_WARPS)
    notes.append(f"proj: a thread computes every gate of one unit for {rows} rows (T*B) "
                 f"where T*B >= {rows}, one row otherwise")
    _tile(p.stage("xp"), p.stage("xp_acc"), v["j"],
          [(v["gate"], None, False), (v["t"], rows, True)], [p.rdoms["i"].x],
          unroll=_gemm_unroll(p.H)[0])


def _lanes_proj(p) -> bool:
    return p.H % LANES == 0 and p.K % LANES == 0


def _step_tile(p, target):
    """One kernel per step: per thread, every gate of one unit for a few
    batch rows in registers, then the cell and the stores."""
    v = p.vars
    rows, slices = _batch_rows(p.H), _slices(p.H, SLICES)
    first = _tile_from(p.H)
    notes.append(f"step: one kernel; a thread holds every gate of one unit for {rows} batch "
                 f"rows where B >= {first} (large batch), one row otherwise (small batch); "
                 f"the {p.H}-long reduction split over {slices} warp(s)")
    _tile(p.stage("out"), p.stage("hg_acc"), v["j"], [(v["b"], rows, True)],
          [p.rdoms["k"].x], unroll=8, acc_only=[v["gate"]], slices=slices, reduce_extent=p.H,
          tile_from=first)


def _lanes_product(out, acc, lane, rows_var, rows, tile, reduce, reduce_extent, extent,
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
    loads and no shuffles per reduction step. The layer forward measured
    0.91-0.95x with it at H = 512, 1024 and 2048 (the projection; H100,
    bench/gpu_ab.py, two copies, results/gpu_ab_s8_smem.txt); at H = 128
    and 256, with dx too, forward 0.97-0.99x, backward 1.02x at H=128 B=16
    and 0.98-0.99x at H=256 B=1.
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
        # warp's lanes as synchronous: FuseGPUThreadLoops). Loading the
        # values 4 at a time (ld.shared.v4, rows innermost) measured no
        # faster (results/gpu_ab_s8_smem.txt).
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


def _lanes_slices(H: int, want: int) -> int:
    """Warps a lanes product's reduction is split over: at most `want`, and
    each slice at least a warp's width (a chunk staged in lanes)."""
    while want > 1 and H < want * LANES:
        want //= 2
    return want


def _step_lanes(p, target):
    """The forward step as a lanes product (see _lanes_product); used where
    it measured faster than the register tiles (_step_tile; see _lanes_fit)."""
    v = p.vars
    rows = 8 if p.H >= 1024 else 4
    slices = _lanes_slices(p.H, 8)
    notes.append(f"step: one kernel; a lane holds every gate of one unit for {rows} batch rows "
                 f"where B >= {rows}, one row otherwise; the {p.H}-long reduction split over "
                 f"{slices} warps, h staged in chunks of {LANES} and shuffled")
    extent = p.stage("out").output_buffers()[0].dim(1).extent()
    _lanes_product(p.stage("out"), p.stage("hg_acc"), v["j"], v["b"], rows, [v["gate"]],
                   p.rdoms["k"].x, p.H, extent, p.stage("prev_in_h"), slices)


def _lanes_fit(H: int) -> bool:
    """Where the products use _lanes_product: from H = 512 (below it the
    register tiles were faster: small_128_b16's forward step 4.2 -> 11.6 us
    a step, H100), and H a multiple of a warp (at other H Halide refused to
    stripe the GRU step's accumulator across the lanes: its index was not
    affine in the lane)."""
    return H >= 512 and H % LANES == 0


# What the lanes products measured (H100, bench/gpu_variants.sh, forward /
# backward ms of one layer, bench/gpu_probe.py; each run also timed the
# register tiles; results/gpu_lanes_variants_{step,dh,proj_dx}.txt):
# - forward step, 8 warps: at H=2048 B=32 T=50 6.03-6.25 -> 5.12 with 8 rows
#   a lane (4 rows 6.46, 16 rows on 4 warps 14.3); at H=512 B=64 T=100
#   2.38-2.58 -> 2.08 with 4 rows (8 rows 2.41); at H=1024 B=64 T=25
#   1.58-1.68 -> 1.61 with 8 rows (no gain; 4 rows 1.94); at H=128 B=16
#   0.42 -> 0.69-1.56 (so not below H=512).
# - dh, 8 rows a lane: backward at H=1024 3.88 -> 3.50 with 2 units a lane
#   (4 units 3.80, 1 unit 3.75; 4 units x 4 rows 3.48, the same), at H=2048
#   13.12 -> 12.03 (2 units; 4: 14.71, 4 x 4 rows: 12.46), at H=512 4.50 ->
#   4.05 (1 unit; 2: 4.44). With 2 units a lane, 8 warps made 128 blocks at
#   H=1024 and 2048 (under one per SM; Nsight: 95.8 us a step at H=2048);
#   16 warps took the backward 3.36 -> 3.20 at H=1024 and 11.65 -> 10.59 at
#   H=2048 (results/gpu_lanes_variants_dh_slices.txt).
# - projection, one warp a block: 8 rows a lane took the forward 1.75 ->
#   1.54 at H=1024, 5.29 -> 5.09 at H=2048, 2.17 -> 2.11 at H=512 (16 rows:
#   1.86, 6.36, 2.31; 2 units x 8 rows: 1.61, 5.41, 2.15).
# - Tried in the eighth session (bench/gpu_ab.py, variants interleaved in one
#   process, results/gpu_ab_s8_step.txt), all slower at H=512, 1024 and
#   2048: the forward step with 4 rows a lane (1.19-1.22x the time) or 2
#   units x 4 rows a lane on 8 or 4 warps (1.15-1.28x); the projection with
#   4 rows a lane or 2 units a lane (0.99-1.00x, no gain). 2 units x 8 rows
#   on 8 warps, or 8 rows on 16 warps, do not launch (64 KB of shared
#   memory for the warps' sums).
# - dx: 4 units x 8 rows a lane on 2 warps took the backward 3.31 -> 3.05
#   at H=1024, 11.69 -> 11.23 at H=2048, 3.85 -> 3.84 at H=512 (one warp:
#   3.23, 11.49, 3.73; 2 units x 16 rows: 3.36, 12.07, 3.99).
# - Tried in the tenth session (bench/gpu_ab.py, interleaved, layer ratios
#   at H=2048 B=32 T=50 / H=1024 B=64 T=25 / H=512 B=64 T=100): bigger
#   one-warp tiles with up to 255 registers a thread (the driver set the
#   JIT's limit for the projection and grads pipelines alone; the limit
#   took, 231-255 registers under ncu). The same tiles at 255: backward
#   1.06x / 1.19x / 1.08x (ptxas takes the registers, occupancy halves);
#   dW 8 input x 4 hidden units a lane 1.00x / 1.03x / 1.07x, 4 x 8 1.11x /
#   1.14x / 1.06x; dx 4 units x 16 rows 1.04x / 1.14x / 1.08x, 8 x 8 1.04x /
#   1.15x / 1.07x; projection 1 unit x 16 rows or 2 x 8 forward 1.10x /
#   1.10x / 1.03-1.04x (results/gpu_ab_s10_regs_run{1,2}.txt). At 128
#   registers, against the same code otherwise (the third shape there
#   K=65): dx 2 units x 16 rows (unrolled by 2: by 4 it spilled) 1.04x /
#   1.04x / 1.01x, 1 x 32 1.14x / 1.14x / 1.02x, dx unrolled by 8 1.00x /
#   1.00x / 1.00x (results/gpu_ab_s10_pack.txt). Under ncu at large_2048 the
#   projection, dx and dW issue 2.1-2.7 instructions a cycle, 82-87% of them
#   FMAs in dx and dW, at 21-24% occupancy; the stalls are spread (dispatch, long
#   scoreboard, not selected), no one unit is saturated
#   (results/ncu_s10_gemm_large.txt, ncu_s10_dw_dx_large.txt).


def step(p, target):
    if _lanes_fit(p.H):
        return _step_lanes(p, target)
    return _step_tile(p, target)


# A step that stores the new states only: the same loop nest.
step_infer = step


def step_bwd(p, target):
    v = p.vars
    # the pointwise backward inlined into the kernels that store dxp (and
    # dhg); the product reads them back (layout read_outputs): 3 kernels a
    # step, was 4 (each about 4-5 us at latency_256_b1). The other
    # pointwise outputs (the GRU's dhg, the LSTM's dc_prev) are computed in
    # the same kernel (compute_with): 2 kernels a step for both cells. A
    # backward step (H100, bench/gpu_probe.py, results/gpu_probe_fused_pointwise.txt)
    # 9.4-11.5 -> 8.3 us at small_128_b16, 6.2-6.8 -> 5.5 us at latency_256_b1.
    # (Tenth session: 2 or 4 elements a thread in that kernel, a block's
    # 128-element runs in turn: layer backward 1.00-1.05x and 1.02-1.14x at
    # H=2048, 1024 and 512 (K=65); Halide put a barrier between the runs.
    # dh's reduction unrolled by 8 or 2 rather than 4: 0.996-1.024x and
    # 1.009-1.031x. bench/gpu_ab.py, results/gpu_ab_s10_pointwise_dh.txt.)
    pointwise = _grid(p.stage("dxp_out"))
    others = ([] if p.cell.dxp_is_dhg else [p.stage("dhg_out")]) + \
        [p.stage("dprev_" + s) for s in p.cell.states[1:]]
    for f in others:
        _grid(f, along=pointwise)
    r = p.rdoms["jg"]
    # (Register tiles, below.) Tried: 2-4 units a thread (where 8 unit blocks remain, 4 batch
    # rows), so that a broadcast load of dhg feeds more FMAs: no gain on an
    # H100 (deepbench_1024 forward+backward 6.27 ms against 6.19, large_2048
    # 22.45 against 21.64), so one unit a thread stays.
    # (16 warps rather than 8 from H = 512: 4.77 -> 4.69, 4.19 -> 3.99,
    # 13.79 -> 14.58 ms backward at H = 512, 1024, 2048; results/gpu_dx_variants.txt.
    # 16 batch rows a thread rather than 8, each weight panel read by half
    # the blocks: 4.54 -> 5.45, 3.88 -> 3.81, 13.81 -> 13.81; 32 rows: 7.79,
    # 5.18, 20.5; results/gpu_dh_rows_variants.txt)
    _dh_product(p, p.stage("dprev_h"), p.stage("dh_prev_acc"),
                p.stage("dxp_out" if p.cell.dxp_is_dhg else "dhg_out"), "step_bwd")


def step_bwd_fused(p, target):
    """One kernel a backward step (pipeline.py _step_bwd_fused): the product
    dh = W_hh^T dhg as in step_bwd, and the thread that finishes dh(k, b)
    runs the previous step's pointwise backward at (k, b) and stores it (the
    output Tuple). step_bwd takes two kernels a step: the pointwise part
    (every unit's dhg) before the product. Used below H = 512 (layout
    fused_bwd_below): the layer backward (H100, bench/gpu_ab.py, interleaved,
    results/gpu_ab_s8_fused.txt) took 0.884-0.887x step_bwd's time at H=128
    B=16 T=100 and 0.869-0.881x at H=256 B=1 T=1000, but 1.07-1.09x at H=512
    B=64 T=100 and 1.04-1.06x at H=1024 B=64 T=25, where the lanes product's
    finishing warp (one of 8 or 16) also runs the pointwise part's loads."""
    _dh_product(p, p.stage("out"), p.stage("dh_acc"), p.stage("dhg_in"), "step_bwd_fused")


def _dh_product(p, out, acc, staged, kind):
    """dh = W_hh^T dhg into out(k, b) (acc: its sum; staged: dhg's stage)."""
    v, r = p.vars, p.rdoms["jg"]
    if _lanes_fit(p.H):
        units = _slices(p.Hp // LANES, 2 if p.H >= 1024 else 1)   # whole blocks of panels
        slices = _lanes_slices(p.H, 16 if p.H >= 1024 else 8)
        notes.append(f"{kind}: dh = W_hh^T dhg as a lanes product; {units} unit(s) x 8 "
                     f"batch rows a lane where B >= 8, one row otherwise; {slices} warps, "
                     f"dhg staged in chunks of {LANES} and shuffled")
        _lanes_product(out, acc, v["k"], v["b"], 8, [], r.x, p.H,
                       out.output_buffers()[0].dim(1).extent(), staged, slices,
                       units=units, gates=r.y, unroll=4)
        return
    rows, slices = _batch_rows(p.H), _slices(p.H, SLICES)
    first_rows = _tile_from(p.H)
    notes.append(f"{kind}: dh = W_hh^T dhg with {rows} batch rows a thread where B >= {first_rows}, "
                 f"one otherwise; the reduction split over {slices} warp(s)")
    _tile(out, acc, v["k"], [(v["b"], rows, True)], [r.x, r.y], unroll=8, slices=slices,
          reduce_extent=p.H, tile_from=first_rows)


# Warps wanted on the grid of a weight-gradient GEMM: its tiles are few where
# the layer is small (32 at H = K = 128), and each one-warp tile summing all
# N rows in turn waited on its loads. Splitting the rows into parts (with
# dx's 4 rows a thread at small K) took a backward step (bench/gpu_probe.py,
# H100) from 15.3-16.9 to 11.6 us at small_128_b16 and from 71-74 to 50 us
# at H=512 B=64 T=100; `halstm bench` forward+backward against cuDNN:
# small_128_b16 2.21x -> 1.53x, charrnn_512x2 2.02x -> 1.22x. Then (forward /
# backward ms, bench/gpu_probe.py at H = 128, 512, 1024, 2048 as in
# bench/results/gpu_grads_variants.txt): 8192 warps rather than 2048 (four
# parts at deepbench_1024) 4.76 -> 4.47 and 16.2 -> 14.9 backward at H =
# 1024 and 2048, the same elsewhere; dx with 8 rows rather than 4 at small K
# 1.13 -> 1.02 backward at H = 128; the projection with 8 rows rather than
# 16 from H = 512: 2.77 -> 2.67, 1.86 -> 1.67, 7.10 -> 6.73 forward.
DW_WARPS = 8192


def _dw_tiles(width: int, H: int) -> int:
    """Tiles of a weight gradient over `width` input units: 4*LANES input
    units x 4 hidden units each."""
    return -(-width // (4 * LANES)) * -(-H // 4)


def _row_parts(width: int, H: int) -> int:
    """Parts (a power of two, at most 16) to split a weight gradient's sum
    over the N rows into, so that its tiles times the parts reach about
    DW_WARPS."""
    tiles = _dw_tiles(width, H)
    parts = 1
    while parts < 16 and tiles * parts * 2 <= DW_WARPS:
        parts *= 2
    return parts


def _summed_parts(out, acc, part, u, lane, cols, inner, outer, extent=None, **kw):
    """out = the sum over u of `part` (acc's update rfactored over u): every
    part a tile of its own on the grid (stored in device memory), reducing
    `inner`; then out's tiles sum the parts (`outer`). extent: see _tile."""
    whole = part.in_().compute_root()
    _tile(whole, part, lane, cols + [(u, 1, False)], inner, extent=extent, **kw)
    _tile(out, acc, lane, cols, outer, **kw)


def _lanes_dw(p, width: int) -> bool:
    """Whether a weight gradient over `width` input units is a lanes
    product (see grads): H a multiple of a warp and 2048 tiles or more."""
    return p.H % LANES == 0 and _dw_tiles(width, p.H) >= 2048


def grads(p, target):
    v = p.vars
    i, j, gate, n = v["i"], v["j"], v["gate"], v["t"]
    rg, rn = p.rdoms["jg"], p.rdoms["n"]
    # dx reads whole panels only (Kp): 4 units a thread where they divide it
    # (1.8 ms with 1 unit a thread at deepbench_1024 on an H100)
    per_lane = _slices(p.Kp // LANES, 4)
    # and fewer rows a thread where fewer than 4 warps span K, for more tiles
    # (and from H = 512 too: see _gemm_unroll)
    dx_rows = ROWS if p.Kp // (LANES * per_lane) >= 4 and p.H < 512 else 8
    unroll = _gemm_unroll(p.H)[1]
    if p.H % LANES:
        notes.append(f"grads: dx with {per_lane} input unit(s) x {dx_rows} rows a thread")
    # From H = 512, dx sums each gate's part on the grid of its own (4x the
    # tiles), then the four parts: backward (bench/gpu_probe.py, H100,
    # results/gpu_dx_variants.txt) 5.48 -> 4.19 ms at H=1024 B=64 T=25
    # (4.45-4.48 in other runs), 14.87 -> 13.79 at H=2048 B=32 T=50, 4.90 ->
    # 4.77 at H=512 B=64 T=100.
    # dx as a lanes product wherever H is a multiple of a warp (the chunks of
    # dxp staged in lanes), on one warp: from H = 512 4 input units a lane,
    # below it 1 unit, for more blocks (see proj for the figures). From 512
    # the staged chunk is stored gates innermost (chunk_outer), so that a
    # reduction step's values come in vector shared loads: with scalar ones
    # the 4 x 8 accumulators spilled (100 bytes at 128 registers), which is
    # why this was 2 warps a block, shuffling, until the ninth session. On
    # one warp the layer backward took 0.978x / 0.958x / 0.975x the 2-warp
    # form's time at H=1024 B=64 T=25, H=2048 B=32 T=50, H=512 B=64 T=100
    # (H100, bench/gpu_ab.py, interleaved, both with dW as below;
    # results/gpu_ab_s9_grads.txt: dx48 against dw; 2 units a lane, dx28:
    # 0.995x, 0.993x, 0.997x). With dW's change: 0.929x, 0.935x, 0.976x.
    if p.H % LANES == 0:
        big = p.H >= 512
        units = _slices(p.Kp // LANES, 4 if big else 1)       # whole blocks of panels
        notes.append(f"grads: dx = W_ih^T dxp as a lanes product; {units} input unit(s) x 8 rows "
                     f"a lane, one warp, dxp staged in chunks in shared memory")
        out = p.stage("dx")
        _lanes_product(out, p.stage("dx_acc"), i, n, 8, [], rg.x, p.H,
                       out.output_buffers()[0].dim(1).extent(), p.stage("dxp_in"),
                       1, units=units, gates=rg.y, unroll=4, chunk_outer=big)
    elif p.H >= 512:
        notes.append("grads: dx summed per gate on the grid, then over the gates")
        g = hl.Var("dx_g")
        part = p.stage("dx_acc").update().rfactor(rg.y, g)
        _summed_parts(p.stage("dx"), p.stage("dx_acc"), part, g, i, [(n, dx_rows, True)],
                      [rg.x], [rg.y], extent=p.stage("dx").output_buffers()[0].dim(1).extent(),
                      per_lane=per_lane, unroll=unroll)
    else:
        _tile(p.stage("dx"), p.stage("dx_acc"), i, [(n, dx_rows, True)], [rg.x, rg.y],
              per_lane=per_lane, unroll=unroll)
    # Weight gradients: where they have 2048 tiles or more (below, the
    # register tiles' sums in parts), a lanes product on one warp: a lane
    # holds 4 input units x 4 hidden units x every gate, dxp (dhg) staged in
    # chunks of 32 rows in shared memory and read back in vector loads (4
    # loads of 4 values and 4 of x per 64 FMAs, where the register tiles made
    # 16 broadcast loads from global memory). Layer backward (H100,
    # bench/gpu_ab.py, interleaved; results/gpu_ab_s9_dw.txt and
    # gpu_ab_s9_grads.txt, dw4 or dw against base, three runs): 0.942-0.950x at H=1024 B=64 T=25, 0.949-0.976x at
    # H=2048 B=32 T=50; at H=512 B=64 T=100 (512 tiles) 1.21-1.22x, at
    # H=128 B=16 T=100 1.28-1.38x, so not there; 2 input units a lane
    # 1.14-1.16x. Splitting its rows into parts as the register tiles do
    # made Halide put barriers (and guards) inside the chunk loop: not used.
    # Otherwise: lanes over input units, per thread 4 input units x
    # 4 hidden units x every gate (1.56 ms with 1 input unit, deepbench_1024);
    # the panels stages are inlined (plain reads on a GPU, clamped at the edges).
    rows = p.param("x").dim(1).extent()
    for name, vec, width, d in (("dw_ih", i, p.K, "dxp"), ("dw_hh", v["k"], p.H, "dhg")):
        out, acc = p.stage(name), p.stage(name + "_acc")
        if _lanes_dw(p, width):
            notes.append(f"grads: {name} as a lanes product; 4 input units x 4 hidden units x "
                         f"every gate a lane, one warp, {d} staged in chunks in shared memory")
            staged = p.stage(d + "_panels")       # (ji, gate, n, jo)
            _lanes_product(out, acc, vec, j, 4, [gate], rn.x, None, p.H, staged, 1,
                           units=_slices(-(-width // LANES), 4), out_tile=[gate], chunk_arg=2)
            continue
        notes.append(f"grads: {name} with 4 input x 4 hidden units x every gate a thread")
        tile = [(j, 4, False), (gate, None, False)]
        parts = _row_parts(width, p.H)
        notes.append(f"grads: {name}'s sum over the N rows in {parts} part(s) summed afterwards")
        if parts > 1:
            # part[vec, j, gate, u] = the sum over the u-th of `parts` runs of rows
            ro, ri = hl.RVar(name + "_ro"), hl.RVar(name + "_ri")
            u = hl.Var(name + "_u")
            part = acc.update().split(rn.x, ro, ri, (rows + parts - 1) // parts,
                                      GUARD).rfactor(ro, u)
            _summed_parts(out, acc, part, u, vec, tile, [ri], [ro], per_lane=4, unroll=unroll)
        else:
            _tile(out, acc, vec, tile, [rn.x], per_lane=4, unroll=unroll)
    # Bias gradients: sums over N rows. One thread a unit summed all N rows
    # in 225 us (deepbench_1024, H100: 32 blocks); chunks of 64 rows are
    # summed in parallel first (rfactor), then the chunk sums.
    for bias in ("db_ih", "db_hh"):
        if bias + "_acc" not in p.stages:       # db_hh, a copy of db_ih (the LSTM)
            _grid(p.stage(bias))
            continue
        out, acc = p.stage(bias), p.stage(bias + "_acc")
        ro, ri = hl.RVar(bias + "_ro"), hl.RVar(bias + "_ri")
        u = hl.Var(bias + "_u")
        chunks = acc.update().split(rn.x, ro, ri, 64, GUARD).rfactor(ro, u)
        _grid(chunks.compute_root())
        _grid(chunks, chunks.update())
        _tile(out, acc, j, [(gate, None, False)], [ro])


# ---- the char LM's head and optimizer (halstm/model/kernels.py) -----------
# One kernel per stage, a thread per output element, reductions serial in
# the thread; lanes along the contiguous axis (v for logits / dlogits, k
# for dW and dy), so that a warp's loads of W^T, y and dlogits coalesce or
# broadcast. Not tuned: the recurrent layers dominate a training step.

def _model_tile2(f, x, y, cols=32, rows=8):
    xo, yo = hl.Var(f"{f.name()}_xo"), hl.Var(f"{f.name()}_yo")
    xi, yi = hl.Var(f"{f.name()}_xi"), hl.Var(f"{f.name()}_yi")
    f.gpu_tile(x, y, xo, yo, xi, yi, cols, rows, GUARD)


def _model_tile1(f, x, threads=128):
    f.gpu_tile(x, hl.Var(f"{f.name()}_xo"), hl.Var(f"{f.name()}_xi"), threads, GUARD)


def head(p, target):
    v, n, k = p.vars["v"], p.vars["n"], p.vars["k"]
    _model_tile2(p.stage("wt").compute_root(), v, k)
    for name in ("logits", "dlogits"):
        _model_tile2(p.stage(name).compute_root(), v, n)
    for name in ("mx", "total"):
        _model_tile1(p.stage(name).compute_root(), n)
    _model_tile1(p.stage("loss"), n)
    _model_tile2(p.stage("dw"), k, v)
    _model_tile1(p.stage("db"), v, 32)
    _model_tile2(p.stage("dy"), k, n)


def sumsq(p, target):
    _model_tile1(p.stage("partial").compute_root(), p.vars["j"])
    _model_tile1(p.stage("out"), p.vars["x"], 1)


def _update(p, target):
    _model_tile1(p.stage("update"), p.vars["i"], 256)


adam = sgd = _update


def onehot(p, target):
    _model_tile2(p.stage("x"), p.vars["v"], p.vars["n"])
