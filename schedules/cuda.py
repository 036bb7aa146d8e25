"""Hand-written CUDA schedules: each pipeline kind's function (pack, proj,
step, step_bwd, grads, ...) schedules its stages from the products of
schedules/cuda_tiles.py (register tiles, one-kernel grids),
schedules/cuda_lanes.py (lanes products, from H = 512) and
schedules/cuda_rows.py (a block a batch row, for cells that reduce over
their units).

The forward step is one kernel: product, cell and every store. Pointwise
and packing stages are one kernel each, every axis on the grid.
"""
from dataclasses import replace

import halide as hl

from .. import machine
from ..layout import Layout
from .cuda_lanes import lanes_fit, lanes_product, lanes_slices
from . import cuda_rows
from .cuda_rows import bwd_row_inputs, row_block, row_inputs, row_threads, row_work
from .cuda_tiles import (GUARD, LANES, MAX_THREADS, even_slices, gate_lane_units, grid_kernel,
                         register_tile, warp_slices)
from .knobs import KNOBS as _KNOBS, value as knob_value

KNOBS = _KNOBS["cuda"]      # what `halstm tune` searches; tuned values come in a spec's knobs



def layout(target: hl.Target) -> Layout:
    """The layout's decisions: weight panels a warp's worth of units wide
    (cuda.LANES); 128 registers a thread (tiles of up to 64 accumulators,
    256-thread blocks fit an SM twice; cuda.max_registers); CUDA graphs
    for the time loops, since the step pipelines allocate no device memory
    (cuda.cuda_graphs; tests/test_cuda_nogpu.py); the pointwise backward
    stored and read back by the product (cuda.step_bwd pointwise); one
    kernel a backward step below H = 512 (cuda.fused_bwd_below); no
    backward packing, the products read the weights as given
    (cuda.raw_bwd_weights). Evidence: bench/RESULTS.md "Schedule
    decisions", the rows named here."""
    return Layout(panel=LANES, dw_cols=LANES, dw_rows=1, max_registers=128, cuda_graphs=True,
                  read_outputs=True, fused_bwd_below=512, raw_bwd_weights=True)


# With vendor GEMMs (halstm.cublas), a step's recurrent product runs as a
# cuBLAS GEMM where it has at least this many multiply-adds (B*G*H*H):
# below, the fused Halide step (one kernel, the product in registers) is
# faster than a GEMM launch plus a pointwise kernel. Forward, its GEMMs in
# slices (step_splits), 2^24 (the LSTM at H=512 B=16 took 0.81x the fused
# step's time), 2^25 for cells that reduce over units (whose own steps at
# 2^24 were 1-5% faster); backward 2^24 too, from VENDOR_STEP_BWD_ROWS
# rows (its GEMM dhg W_hh and a pointwise kernel took 0.67x-0.92x the fused
# step's time from 2^24 to 2^26 multiply-adds at 8 to 128 rows, H = 256 to
# 1024, H100; 0.995x at H=256 B=64; at 2 and 4 rows 1.23x and 1.05x, at 1
# row 0.94x: a GEMM of so few rows leaves most multiprocessors idle; the
# 8 rows keep H = 2048 at 6 and 7 rows, cuBLAS's before, on the fused step,
# not timed)
# (bench/RESULTS.md, "Schedule decisions": cuda.VENDOR_STEP_MACS).
VENDOR_STEP_MACS = KNOBS["step_gemm_mmacs"].default << 20        # 1 << 24
VENDOR_STEP_REDUCING_MACS = KNOBS["step_gemm_reducing_mmacs"].default << 20    # 1 << 25
VENDOR_STEP_BWD_MACS = KNOBS["step_gemm_bwd_mmacs"].default << 20    # 1 << 24
VENDOR_STEP_BWD_ROWS = 8
# ... and 1.5 * 2^26 for cells that reduce over units (their folded
# backward steps were not timed against the GEMM below it); cells of fewer
# than VENDOR_STEP_BWD_GATES gate blocks at least that whatever the knob
# (measured with 3 and 4; a one-gate cell's vendor backward has no GPU test
# below it)
VENDOR_STEP_REDUCING_BWD_MACS = KNOBS["step_gemm_reducing_bwd_mmacs"].default << 20   # 3 << 25
VENDOR_STEP_BWD_GATES = KNOBS["step_gemm_bwd_mmacs"].floor[0]     # 3 (its floor: the above)
# Tensor-core precisions (TF32, bf16) from 2^25: their GEMMs run several
# times faster than fp32's, and from H = fused_bwd_below the Halide
# backward step is two kernels anyway, so the GEMM replaces one of them
# rather than adding a launch.
VENDOR_STEP_MACS_TENSOR = KNOBS["step_gemm_tensor_mmacs"].default << 20    # 1 << 25


def vendor_layout(layout: Layout, gates: int, H: int, direction: str = "fwd",
                  precision: str = "fp32", knobs=None, reduces: bool = False) -> Layout:
    """layout with the projection and gradient GEMMs by cuBLAS, and the
    steps' products too from the batch where they reach VENDOR_STEP_MACS
    (VENDOR_STEP_REDUCING_MACS for a cell that reduces over units,
    VENDOR_STEP_MACS_TENSOR in TF32 or bf16; backward VENDOR_STEP_BWD_MACS
    from VENDOR_STEP_BWD_ROWS rows, VENDOR_STEP_REDUCING_BWD_MACS for cells
    that reduce, at least that for cells of fewer than VENDOR_STEP_BWD_GATES
    gates;
    where tuned, the knobs step_gemm_mmacs, step_gemm_reducing_mmacs,
    step_gemm_tensor_mmacs, with _bwd_ backward, in 2^20)."""
    fp32, fwd = precision == "fp32", direction == "fwd"
    reducing = reduces and fp32
    name = ("step_gemm" + ("" if fp32 else "_tensor") + ("_reducing" if reducing else "")
            + ("" if fwd else "_bwd") + "_mmacs")
    macs = KNOBS[name].effective(knob_value("cuda", knobs, name), gates) << 20
    least = VENDOR_STEP_BWD_ROWS if fp32 and not fwd and not reducing else 1
    return replace(layout, vendor_gemm=True,
                   vendor_step_rows=max(least, -(-macs // (gates * H * H))),
                   vendor_step_splits=step_splits(H) if fwd and fp32 else 1)


# A forward vendor step's product h W_hh^T in fp32 as STEP_SPLITS GEMMs
# over slices of h's units (one batched cuBLAS call, split-K), each slice
# of at least STEP_SPLIT_UNITS units, the partial products summed by the
# step's kernel: at a step's few rows cuBLAS's tiles leave most
# multiprocessors idle (B=64, G*H=2048: 32 tiles of 64 x 64 on 132 SMs)
# and the slices fill them (bench/RESULTS.md, "Schedule decisions":
# cuda.step_splits). Measured in fp32 only: TF32 and bf16 keep one GEMM.
STEP_SPLITS = 4
STEP_SPLIT_UNITS = 128


def step_splits(H: int) -> int:
    """The slices of a forward vendor step's product: the most, up to
    STEP_SPLITS, that divide H into slices of STEP_SPLIT_UNITS units or
    more."""
    return next(s for s in range(STEP_SPLITS, 0, -1)
                if s == 1 or (H % s == 0 and H // s >= STEP_SPLIT_UNITS))


# The forward packs the weights on every call (they may have changed), as
# a transpose through shared memory: reads and writes both coalesced
# (bench/RESULTS.md, "Schedule decisions": cuda.pack).
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


# Rows per thread of the projection and gradient GEMMs (N = T*B rows): 16
# rows x 4 gates (or units) = 64 accumulators, the largest tile that
# max_registers is sized for (bench/RESULTS.md, "Schedule decisions": cuda.ROWS).
ROWS = 16


def _gemm_unroll(H: int) -> tuple[int, int]:
    """How far the projection's, resp. dx's and dW's, reduction loops are
    unrolled: loads of that many steps in flight against global-memory
    latency; 16 and 8 from H = 512, else 4 and 2
    (bench/RESULTS.md, "Schedule decisions": cuda._gemm_unroll)."""
    return (16, 8) if H >= 512 else (4, 2)


# The per-step products unroll their reductions by 8: loads in flight,
# without the register pressure of 16 or 32
# (bench/RESULTS.md, "Schedule decisions": cuda.step unroll).
# Warps that share one register-tile step's reduction: a step has few
# tiles, so 8 warps spread them over more SMs
# (bench/RESULTS.md, "Schedule decisions": cuda.SLICES).
SLICES = 8


def _tile_from(H: int) -> int:
    """The smallest batch whose steps take several rows a thread: below
    H = 512 a batch of up to 16 takes one row a thread, 4x the blocks where
    few unit panels would leave SMs idle
    (bench/RESULTS.md, "Schedule decisions": cuda._tile_from)."""
    return 17 if H < 512 else _batch_rows(H)


def _batch_rows(H: int) -> int:
    """Batch rows per thread of a step: 8 from H = 512, 4 below, so that
    the few unit panels of a small H still spread over enough blocks; 16
    rows on 8 warps would need 64 KB of shared memory for the partial sums
    (bench/RESULTS.md, "Schedule decisions": cuda._batch_rows)."""
    return 8 if H >= 512 else 4


# The GEMMs (projection, dx, dW) run one warp a block: L2 traffic does not
# limit them, and a register tile spanning a multi-warp block becomes local
# memory in Halide 21 (bench/RESULTS.md, "Schedule decisions": cuda.GEMM blocks).
def proj(p, target):
    v = p.vars
    if p.vendor_gemm:     # the bias on every row: the driver's cuBLAS GEMM adds x W_ih^T
        p.notes.append("proj: the bias broadcast on the grid; x W_ih^T by cuBLAS (driver)")
        grid_kernel(p.stage("xp"))
        return
    # A lanes product where H and K are multiples of a warp (x's staged
    # chunks are a warp wide), at every H: register tiles of 16 rows leave
    # most of the GPU idle at small shapes
    # (bench/RESULTS.md, "Schedule decisions": cuda.proj lanes).
    if _lanes_proj(p):
        p.notes.append("proj: a lanes product; a lane holds every gate of one unit for 8 rows "
                     "(T*B) where T*B >= 8, one row otherwise; one warp, x staged in chunks "
                     "in shared memory")
        out = p.stage("xp")
        lanes_product(out, p.stage("xp_acc"), v["j"], v["t"], 8, [v["gate"]], p.rdoms["i"].x,
                      p.K, out.output_buffers()[0].dim(2).extent(), p.stage("x_in"), 1,
                      out_tile=[v["gate"]])
        return
    # Register tiles: 8 rows a thread from H = 512, for more tiles
    # (bench/RESULTS.md, "Schedule decisions": cuda.proj rows).
    rows = ROWS if p.H < 512 else ROWS // 2
    p.notes.append(f"proj: a thread computes every gate of one unit for {rows} rows (T*B) "
                 f"where T*B >= {rows}, one row otherwise")
    register_tile(p.stage("xp"), p.stage("xp_acc"), v["j"],
                  [(v["gate"], None, False), (v["t"], rows, True)], [p.rdoms["i"].x],
                  unroll=_gemm_unroll(p.H)[0])


def _lanes_proj(p) -> bool:
    return p.H % LANES == 0 and p.K % LANES == 0


def _step_tile(p, target):
    """One kernel per step: per thread, every gate of one unit for a few
    batch rows in registers, then the cell and the stores."""
    v = p.vars
    rows, slices = _batch_rows(p.H), warp_slices(p.H, SLICES)
    first = _tile_from(p.H)
    p.notes.append(f"step: one kernel; a thread holds every gate of one unit for {rows} batch "
                 f"rows where B >= {first} (large batch), one row otherwise (small batch); "
                 f"the {p.H}-long reduction split over {slices} warp(s)")
    register_tile(p.stage("out"), p.stage("hg_acc"), v["j"], [(v["b"], rows, True)],
                  [p.rdoms["k"].x], unroll=8, acc_only=[v["gate"]], slices=slices,
                  reduce_extent=p.H, tile_from=first)


# A one-row block of the step's tiles (32 units x every gate) reads its
# units' rows of W_hh, 32 * G * H floats a step, through its one
# multiprocessor's share of L2 bandwidth; from this many bytes that read
# is most of the step's time, and spreading it over LANES /
# gate_lane_units(G) times the blocks (step_narrow: 4 times for 3 or 4
# gates) pays: 128 KiB at G * H = 1024 took 0.84x-0.88x of the step's
# time forward, 64 and 96 KiB 1.0x-1.12x (bench/RESULTS.md, "Schedule
# decisions": cuda.step_narrow).
NARROW_FROM_BYTES = KNOBS["narrow_kib"].default << 10            # 128 KiB


def narrow_layout(layout: Layout, gates: int, H: int, knobs=None) -> Layout:
    """layout with the forward's narrow steps (pipeline.NARROW) where a
    one-row block of step's tiles reads NARROW_FROM_BYTES of W_hh or more
    (the knob narrow_kib, in KiB, where tuned),
    for the batches whose blocks of narrow steps still fit the GPU's
    multiprocessors at once, one block each (machine.gpu_sms; the driver
    calls them for steps of up to narrow_rows rows). None for one gate, or
    from H = 512 (the lanes products). (The gate lanes need a reduction
    over two warps or more: warp_slices gives 8 from H = 8, and the bytes
    rule asks for G * H >= 1024.)"""
    least = knob_value("cuda", knobs, "narrow_kib") << 10
    if gates < 2 or H >= 512 or LANES * gates * H * 4 < least:
        return layout
    rows = machine.gpu_sms() // -(-H // gate_lane_units(gates))
    return replace(layout, narrow_rows=rows) if rows else layout


def step_narrow(p, target):
    """The forward step for few batch rows (narrow_layout): one row and
    one gate of one unit a thread, a warp gate_lane_units(G) units x
    every gate, so that a step has LANES / gate_lane_units(G) times the
    blocks of step's one-row tiles (4 for 3 or 4 gates)."""
    v, slices = p.vars, warp_slices(p.H, SLICES)
    p.notes.append(f"step_narrow: one kernel; a thread holds one gate of one unit for one batch "
                   f"row ({gate_lane_units(p.G)} units a warp); the {p.H}-long reduction split "
                   f"over {slices} warps")
    register_tile(p.stage("out"), p.stage("hg_acc"), v["j"], [(v["b"], 1, True)],
                  [p.rdoms["k"].x], unroll=8, acc_only=[v["gate"]], slices=slices,
                  reduce_extent=p.H, gate_lanes=(v["gate"], p.G))


step_narrow_infer = step_narrow


def loop_layout(layout: Layout, gates: int, H: int, knobs=None) -> Layout:
    """layout with loop_infer (pipeline.LOOP) where W_hh takes at most the
    shared memory one block may have (machine.gpu_block_shared_bytes: 227
    KiB on an H100; the knob loop_shared_pct, in percent of it, where
    tuned): each block, a batch row, keeps the gates of W_hh that fit its
    shared memory there (loop_shared_gates) and reads the others from L1
    every step, while the one-kernel-a-step loop's time hardly moves with
    H at small sizes. The driver calls it for batches of up to one block
    an SM (machine.gpu_sms). (bench/RESULTS.md, "Schedule decisions":
    cuda.loop.)"""
    most = machine.gpu_block_shared_bytes() * knob_value("cuda", knobs, "loop_shared_pct") // 100
    if gates * H * H * 4 > most or H > MAX_THREADS:
        return layout
    return replace(layout, loop_rows=machine.gpu_sms())


# Shared memory loop_infer leaves to Halide's own stagings (the step's xp)
# beyond their G*H floats
LOOP_SHARED_SPARE = 1 << 10
# Loads a thread issues at once while loop_infer copies W_hh into shared
# memory: one at a time, each waiting on the last, the copy of a GRU's
# 192 KiB took 384 global-memory latencies a thread
LOOP_STAGE_LOADS = 32


def _gates_fitting(G: int, H: int, row: int) -> int:
    """The gates of W_hh, H rows of `row` floats each, that fit a block's
    shared memory beside the step's staged xp."""
    room = machine.gpu_block_shared_bytes() - 4 * G * H - LOOP_SHARED_SPARE
    return max(0, min(G, room // (4 * H * row)))


def loop_row_floats(G: int, H: int) -> int:
    """The floats of a unit's row of a W_hh gate in loop_infer's shared
    memory, its H weights consecutive (a thread reads them 16 bytes a
    load): H rounded up to an odd multiple of 4, so that the 8 threads of
    a quarter warp's 16-byte loads read 8 distinct groups of 4 banks.
    Where not every gate fits in such rows, 0: the units innermost, a
    load a weight (the threads of a warp read consecutive units), which
    measured faster where a gate is read through L1 (bench/RESULTS.md,
    "Schedule decisions": cuda.loop)."""
    row = 4 * ((H + 3) // 4 | 1)
    return row if _gates_fitting(G, H, row) == G else 0


def loop_shared_gates(G: int, H: int) -> int:
    """The gates of W_hh loop_infer keeps in a block's shared memory: as
    many as fit beside the step's staged xp (rows of loop_row_floats)."""
    return _gates_fitting(G, H, loop_row_floats(G, H) or H)


def loop_infer(p, target):
    """pipeline.LOOP in one kernel: a block a batch row runs its steps in
    order, a thread a unit (every gate's product as an unrolled sum, the
    cell, the new states). The gates of W_hh that fit (loop_shared_gates)
    are copied into shared memory once, before the steps, and read from
    there every step, a unit's weights of a gate in a row of their own
    where every gate fits so (loop_row_floats: 16 bytes a load, a quarter
    of the loads); the rest are read from global memory through L1. The
    step's xp is staged first (Func xs), a thread a unit with its gates
    unrolled inside: one barrier between it and the step (with the gates
    outside the thread loop, a barrier after each gate, each waiting on
    that gate's global load) and, since Halide closes a block-level loop
    with a barrier only where its body holds one, a barrier after every
    step, before the next reads the new states. More than 48 KiB of
    shared memory needs the driver's opt-in (csrc/cuda_graphs.h)."""
    v, r = p.vars, p.rdoms["loop"]
    out = p.stage("out")
    staged, row = loop_shared_gates(p.G, p.H), loop_row_floats(p.G, p.H)
    p.notes.append(f"loop_infer: one kernel; a block a batch row, a thread one unit's "
                   f"{p.G} gate(s), each an unrolled {p.H}-term product; {staged} gate(s) "
                   f"of W_hh in shared memory, " +
                   (f"a unit's row of {row} floats" if row else "the units innermost"))
    out.gpu_blocks(v["b"])     # (the pure stage, undefined, computes nothing: on the
    #                            device, so that the output needs no host memory)
    out.update(0).allow_race_conditions().reorder(r.x, r.y, v["b"]) \
        .gpu_blocks(v["b"]).gpu_threads(r.x)
    p.stage("xs").compute_at(out, r.y).reorder(v["gate"], v["j"]).gpu_threads(v["j"]) \
        .unroll(v["gate"])
    for g in range(staged):     # a thread a unit, LOOP_STAGE_LOADS loads in flight
        w = p.stage(f"w_loop{g}")
        unit, k = w.args()
        ko, ki = hl.Var(k.name() + "o"), hl.Var(k.name() + "i")
        w.compute_at(out, v["b"]).store_in(hl.MemoryType.GPUShared) \
            .split(k, ko, ki, min(LOOP_STAGE_LOADS, p.H), hl.TailStrategy.GuardWithIf) \
            .reorder(ki, ko, unit).gpu_threads(unit).unroll(ki)
        if row:
            w.reorder_storage(k, unit).align_storage(k, row)


def _step_lanes(p, target):
    """The forward step as a lanes product (see lanes_product), where
    lanes_fit: 8 rows a lane from H = 1024, 4 below, for more blocks where
    unit panels are fewer (bench/RESULTS.md, "Schedule decisions": cuda.step lanes)."""
    v = p.vars
    rows = 8 if p.H >= 1024 else 4
    slices = lanes_slices(p.H, 8)
    p.notes.append(f"step: one kernel; a lane holds every gate of one unit for {rows} batch rows "
                 f"where B >= {rows}, one row otherwise; the {p.H}-long reduction split over "
                 f"{slices} warps, h staged in chunks of {LANES} and shuffled")
    extent = p.stage("out").output_buffers()[0].dim(1).extent()
    lanes_product(p.stage("out"), p.stage("hg_acc"), v["j"], v["b"], rows, [v["gate"]],
                  p.rdoms["k"].x, p.H, extent, p.stage("prev_in_h"), slices)


def _step_rows(p, target):
    """A step that reduces over the units: the recurrent product for every
    unit (register tiles, as _step_tile's), then the sums and the cell in
    one kernel a block a batch row (row_block): 2 kernels."""
    v = p.vars
    p.notes.append(f"step: the product for every unit, then {len(p.reductions)} sums over units "
                   f"and the cell in one kernel, a block a batch row")
    _hg_kernel(p, p.stage("hg").compute_root(), p.param("h_prev").dim(1).extent())
    row_block(p, p.stage("out"), v["j"], v["b"])


def _hg_kernel(p, hg, batch):
    """hg (j, gate, b), the recurrent product for every unit, as one kernel:
    as _step_lanes's product where lanes_fit, else as _step_tile's
    register tiles. batch: its rows' extent."""
    v = p.vars
    rows, slices = _batch_rows(p.H), warp_slices(p.H, SLICES)
    if lanes_fit(p.H):
        rows, slices = (8 if p.H >= 1024 else 4), lanes_slices(p.H, 8)
        lanes_product(hg, p.stage("hg_acc"), v["j"], v["b"], rows, [v["gate"]],
                      p.rdoms["k"].x, p.H, batch, p.stage("prev_in_h"), slices,
                      out_tile=[v["gate"]])
    else:
        register_tile(hg, p.stage("hg_acc"), v["j"],
                      [(v["gate"], None, False), (v["b"], rows, True)], [p.rdoms["k"].x],
                      unroll=8, slices=slices, reduce_extent=p.H, tile_from=_tile_from(p.H),
                      extent=batch)


def reducing_layout(layout: Layout) -> Layout:
    """The layout of a cell whose step reduces over the units: no fused
    backward step (its product needs every unit's pointwise part first);
    folded forward steps, which the driver runs where their blocks fit the
    GPU's multiprocessors (step_fold; csrc/cuda_graphs.h fold_wanted)."""
    return replace(layout.without("fused_bwd_below"), fold_steps=True)


def step_product(p, target):
    """The first step's product before the folded steps (pipeline.FOLD_FWD)."""
    p.notes.append("step_product: the first step's product, one kernel")
    _hg_kernel(p, p.stage("hg"), p.stage("hg").output_buffer().dim(2).extent())


def step_fold(p, target):
    """A folded step (pipeline.FOLD_FWD) as one kernel: blocks over a warp
    of units x one batch row, each computing its row's sums, stagings and
    new h for every unit first (row_work; h in shared memory), then its
    units' states, saved values and, in registers, every gate of the next
    step's product, the reduction split over warps as _step_tile's. The
    blocks of one row redo its row work side by side: the driver folds
    steps only where every block has a multiprocessor of its own
    (bench/RESULTS.md, "Schedule decisions": cuda.step_fold)."""
    v = p.vars
    # twice the warps of _step_tile's reduction: a folded step's blocks
    # have a multiprocessor each (the driver's rule), so a block may take
    # its whole register file (ROW_THREADS x max_registers = 65536)
    # (bench/RESULTS.md, "Schedule decisions": cuda.step_fold slices)
    slices = warp_slices(p.H, 2 * SLICES, even_first=True)
    p.notes.append(f"step_fold: one kernel; a block a batch row and {LANES} units computes the "
                   f"row's {len(p.reductions)} sums over units and h for every unit, then every "
                   f"gate of its units' next product, the reduction split over {slices} warp(s)")
    _fold_kernel(p, p.stage("hg_next_acc"), [p.rdoms["k"].x], [v["gate"]], slices, "h_next")


step_fold_infer = step_fold


def _fold_kernel(p, acc, reduce, acc_only, slices, row_stage):
    """A folded step's kernel (step_fold, step_bwd_fold): out's blocks over
    a warp of units x one batch row, acc its product in registers, the
    reduction split over `slices` warps; at each block's start its row's
    work (row_work) and `row_stage`, the product's operand for every unit
    of the row (shared memory). Returns the block loop over units."""
    v, out = p.vars, p.stage("out")
    register_tile(out, acc, v["j"], [(v["b"], 1, True)], reduce, unroll=8, acc_only=acc_only,
                  slices=slices, reduce_extent=p.H, partial_in_registers=True)
    at = hl.Var(v["j"].name() + "o")     # (tile_loops' block loop over units)
    f = p.stage(row_stage)
    inner = f.args()[1:-1]               # (its gates, if any: a thread's, unrolled)
    fo, fi = hl.Var(row_stage + "_o"), hl.Var(row_stage + "_i")
    f.compute_at(out, at).split(v["j"], fo, fi, row_threads(p.H), GUARD) \
        .reorder(*inner, fi, fo).gpu_threads(fi)
    for c in inner:
        f.unroll(c)
    row_work(p, out, at)
    return at


def step_bwd_fold(p, target):
    """A folded backward step (pipeline.FOLD_BWD) as one kernel: blocks over
    a warp of units x one batch row, each computing its row's inputs (in
    shared memory), sums, stagings and dhg for every unit first (row_work;
    dhg in shared memory), then its units' outputs and, in registers, their
    dh_prev = W_hh^T dhg, the reduction split over warps (below). The
    driver folds these steps where step_fold's would fold."""
    r = p.rdoms["jg"]
    # warps of the product's reduction: as many as the row work's threads
    # hold (at most step_fold's 16), so that no idle warp waits at the row
    # stages' barriers (bench/RESULTS.md, "Schedule decisions":
    # cuda.step_bwd_fold slices)
    want = 2 * SLICES
    while want > 1 and want * LANES > row_threads(p.H):
        want //= 2
    slices = warp_slices(p.H, want, even_first=True)
    p.notes.append(f"step_bwd_fold: one kernel; a block a batch row and {LANES} units computes "
                   f"the row's {len(p.reductions)} sums over units and dhg for every unit, then "
                   f"its units' dh = W_hh^T dhg, the reduction split over {slices} warp(s)")
    at = _fold_kernel(p, p.stage("dh_prev_acc"), [r.x, r.y], [], slices, "dhg_row")
    # (the inputs' shared memory less dhg's and the product's partial sums')
    row_inputs(p, p.stage("out"), at, bwd_row_inputs(p),
                cuda_rows.ROW_INPUT_BYTES - 4 * (p.G * p.H + slices * LANES))


def step(p, target):
    if p.reductions:
        return _step_rows(p, target)
    if lanes_fit(p.H):
        return _step_lanes(p, target)
    return _step_tile(p, target)


# A step that stores the new states only: the same loop nest.
step_infer = step


def to_bf16(p, target):
    grid_kernel(p.stage("a_bf16"))


def step_vendor(p, target):
    """A step whose product the driver ran (a vendor GEMM into hg): the
    cell alone, one kernel on the grid, or a block a batch row where it
    reduces over units (row_block)."""
    if p.reductions:
        p.notes.append("step (vendor product): the sums and the cell in one kernel, a block a "
                       "batch row; h W_hh^T by cuBLAS (driver)")
        row_block(p, p.stage("out"), p.vars["j"], p.vars["b"])
    else:
        p.notes.append("step (vendor product): the cell on the grid; h W_hh^T by cuBLAS (driver)")
        grid_kernel(p.stage("out"))


step_vendor_infer = step_vendor


def step_bwd_vendor(p, target):
    """The pointwise backward of step_bwd without its product (the
    driver adds dhg W_hh to dh_prev by a vendor GEMM): one kernel."""
    p.notes.append("step_bwd (vendor product): the pointwise backward in one kernel, "
                   "dhg W_hh by cuBLAS (driver)")
    _bwd_pointwise(p, p.cell.states)      # (dh_prev's own term too)


def _bwd_pointwise(p, states):
    """The pointwise backward as one kernel storing dxp, with its other
    outputs (dhg, dvec, the gradients of `states`) in the same loops
    (compute_with)."""
    v = p.vars
    others = ([] if p.cell.dxp_is_dhg else [p.stage("dhg_out")]) + \
        [p.stage("dprev_" + s) for s in states] + \
        ([p.stage("dvec_out")] if p.V else []) + \
        ([p.stage("dhg_bf16_out")] if "dhg_bf16_out" in p.stages else [])
    if p.reductions:      # a block a batch row, its sums first (row_block)
        row_block(p, p.stage("dxp_out"), v["j"], v["b"], along=others)
        row_inputs(p, p.stage("dxp_out"), v["b"], bwd_row_inputs(p))
    else:
        pointwise = grid_kernel(p.stage("dxp_out"))
        for f in others:
            grid_kernel(f, along=pointwise)


def step_bwd(p, target):
    # The pointwise backward is inlined into the kernel that stores dxp
    # (and dhg), which the product reads back (layout read_outputs); the
    # other pointwise outputs (dhg, the states' dprev) are computed in the
    # same kernel (compute_with): 2 kernels a step
    # (bench/RESULTS.md, "Schedule decisions": cuda.step_bwd pointwise).
    _bwd_pointwise(p, p.cell.states[1:])
    # (Register tiles, other H: one unit a thread, _batch_rows rows, SLICES
    # warps, as the forward step's
    # (bench/RESULTS.md, "Schedule decisions": cuda.dh tiles).)
    _dh_product(p, p.stage("dprev_h"), p.stage("dh_prev_acc"),
                p.stage("dxp_out" if p.cell.dxp_is_dhg else "dhg_out"), "step_bwd")


def step_bwd_fused(p, target):
    """One kernel a backward step (pipeline/backward.py _step_bwd_fused): the product
    dh = W_hh^T dhg as in step_bwd, and the thread that finishes dh(k, b)
    runs the previous step's pointwise backward at (k, b) and stores it (the
    output Tuple). step_bwd takes two kernels a step. Used below H = 512,
    where a step is short and one launch fewer pays; from 512 the lanes
    product's finishing warp would also run the pointwise part's loads
    (bench/RESULTS.md, "Schedule decisions": cuda.fused_bwd_below)."""
    _dh_product(p, p.stage("out"), p.stage("dh_acc"), p.stage("dhg_in"), "step_bwd_fused")


def _dh_product(p, out, acc, staged, kind):
    """dh = W_hh^T dhg into out(k, b) (acc: its sum; staged: dhg's stage)."""
    v, r = p.vars, p.rdoms["jg"]
    if lanes_fit(p.H):
        # 8 rows a lane; from H = 1024 2 units a lane (one staged value feeds
        # 2 units' FMAs) and 16 warps, as blocks are fewer than SMs there
        # (bench/RESULTS.md, "Schedule decisions": cuda.dh lanes).
        units = even_slices(p.Hp // LANES, 2 if p.H >= 1024 else 1)   # whole blocks of panels
        slices = lanes_slices(p.H, 16 if p.H >= 1024 else 8)
        p.notes.append(f"{kind}: dh = W_hh^T dhg as a lanes product; {units} unit(s) x 8 "
                     f"batch rows a lane where B >= 8, one row otherwise; {slices} warps, "
                     f"dhg staged in chunks of {LANES} and shuffled")
        lanes_product(out, acc, v["k"], v["b"], 8, [], r.x, p.H,
                      out.output_buffers()[0].dim(1).extent(), staged, slices,
                      units=units, gates=r.y, unroll=4)
        return
    rows, slices = _batch_rows(p.H), warp_slices(p.H, SLICES)
    first_rows = _tile_from(p.H)
    p.notes.append(f"{kind}: dh = W_hh^T dhg with {rows} batch rows a thread where B >= {first_rows}, "
                 f"one otherwise; the reduction split over {slices} warp(s)")
    register_tile(out, acc, v["k"], [(v["b"], rows, True)], [r.x, r.y], unroll=8, slices=slices,
                  reduce_extent=p.H, tile_from=first_rows)


# Warps wanted on the grid of a register-tile weight-gradient GEMM: its
# tiles are few where the layer is small (32 at H = K = 128), so its N rows
# are summed in parts until tiles x parts reach about the warps an H100
# holds at once (bench/RESULTS.md, "Schedule decisions": cuda.DW_WARPS).
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
    `inner`; then out's tiles sum the parts (`outer`). extent: see register_tile."""
    whole = part.in_().compute_root()
    register_tile(whole, part, lane, cols + [(u, 1, False)], inner, extent=extent, **kw)
    register_tile(out, acc, lane, cols, outer, **kw)


def _lanes_dw(p, width: int) -> bool:
    """Whether a weight gradient over `width` input units is a lanes
    product (see grads): H a multiple of a warp and 2048 tiles or more."""
    return p.H % LANES == 0 and _dw_tiles(width, p.H) >= 2048


def grads(p, target):
    if p.vendor_gemm:
        p.notes.append("grads: dx, dW_ih and dW_hh by cuBLAS (driver)")
        _bias_sums(p)
        return
    v = p.vars
    i, j, gate, n = v["i"], v["j"], v["gate"], v["t"]
    rg, rn = p.rdoms["jg"], p.rdoms["n"]
    # dx reads whole panels only (Kp): 4 units a thread where they divide it,
    # one broadcast load for 4 FMAs; 8 rows a thread where fewer than 4 warps
    # span K, and from H = 512, for more tiles
    # (bench/RESULTS.md, "Schedule decisions": cuda.dx tiles)
    per_lane = even_slices(p.Kp // LANES, 4)
    dx_rows = ROWS if p.Kp // (LANES * per_lane) >= 4 and p.H < 512 else 8
    unroll = _gemm_unroll(p.H)[1]
    if p.H % LANES:
        p.notes.append(f"grads: dx with {per_lane} input unit(s) x {dx_rows} rows a thread")
    # dx: a lanes product on one warp wherever H is a multiple of a warp
    # (dxp staged in lanes); from H = 512 4 input units a lane, the chunk
    # stored gates innermost (chunk_outer) so that a reduction step's values
    # come in vector shared loads (scalar ones made the 4 x 8 accumulators
    # spill), 1 unit below for more blocks
    # (bench/RESULTS.md, "Schedule decisions": cuda.dx lanes).
    # Other H from 512: each gate's part summed on a grid of its own (4x the
    # tiles), then the four (bench/RESULTS.md, "Schedule decisions": cuda.dx per gate).
    if p.H % LANES == 0:
        big = p.H >= 512
        units = even_slices(p.Kp // LANES, 4 if big else 1)       # whole blocks of panels
        p.notes.append(f"grads: dx = W_ih^T dxp as a lanes product; {units} input unit(s) x 8 rows "
                     f"a lane, one warp, dxp staged in chunks in shared memory")
        out = p.stage("dx")
        lanes_product(out, p.stage("dx_acc"), i, n, 8, [], rg.x, p.H,
                      out.output_buffers()[0].dim(1).extent(), p.stage("dxp_in"),
                      1, units=units, gates=rg.y, unroll=4, chunk_outer=big)
    elif p.H >= 512:
        p.notes.append("grads: dx summed per gate on the grid, then over the gates")
        g = hl.Var("dx_g")
        part = p.stage("dx_acc").update().rfactor(rg.y, g)
        _summed_parts(p.stage("dx"), p.stage("dx_acc"), part, g, i, [(n, dx_rows, True)],
                      [rg.x], [rg.y], extent=p.stage("dx").output_buffers()[0].dim(1).extent(),
                      per_lane=per_lane, unroll=unroll)
    else:
        register_tile(p.stage("dx"), p.stage("dx_acc"), i, [(n, dx_rows, True)], [rg.x, rg.y],
                      per_lane=per_lane, unroll=unroll)
    # Weight gradients: a lanes product on one warp where they have 2048
    # tiles or more (a lane holds 4 input x 4 hidden units x every gate;
    # dxp/dhg staged in 32-row chunks, read back in vector loads)
    # (bench/RESULTS.md, "Schedule decisions": cuda.dW lanes); fewer tiles:
    # register tiles of 4 input x 4 hidden units x every gate a thread, rows
    # summed in parts (bench/RESULTS.md, "Schedule decisions": cuda.dW tiles).
    # The panels stages are inlined (plain reads on a GPU, clamped at the
    # edges).
    rows = p.param("x").dim(1).extent()
    for name, vec, width, d in (("dw_ih", i, p.K, "dxp"), ("dw_hh", v["k"], p.H, "dhg")):
        out, acc = p.stage(name), p.stage(name + "_acc")
        if _lanes_dw(p, width):
            p.notes.append(f"grads: {name} as a lanes product; 4 input units x 4 hidden units x "
                         f"every gate a lane, one warp, {d} staged in chunks in shared memory")
            staged = p.stage(d + "_panels")       # (ji, gate, n, jo)
            lanes_product(out, acc, vec, j, 4, [gate], rn.x, None, p.H, staged, 1,
                          units=even_slices(-(-width // LANES), 4), out_tile=[gate], chunk_arg=2)
            continue
        p.notes.append(f"grads: {name} with 4 input x 4 hidden units x every gate a thread")
        tile = [(j, 4, False), (gate, None, False)]
        parts = _row_parts(width, p.H)
        p.notes.append(f"grads: {name}'s sum over the N rows in {parts} part(s) summed afterwards")
        if parts > 1:
            # part[vec, j, gate, u] = the sum over the u-th of `parts` runs of rows
            ro, ri = hl.RVar(name + "_ro"), hl.RVar(name + "_ri")
            u = hl.Var(name + "_u")
            part = acc.update().split(rn.x, ro, ri, (rows + parts - 1) // parts,
                                      GUARD).rfactor(ro, u)
            _summed_parts(out, acc, part, u, vec, tile, [ri], [ro], per_lane=4, unroll=unroll)
        else:
            register_tile(out, acc, vec, tile, [rn.x], per_lane=4, unroll=unroll)
    _bias_sums(p)


def _bias_sums(p):
    """Bias gradients: sums over N rows, in chunks of 64 rows summed in
    parallel (rfactor), then the chunk sums: a thread a unit would fill
    only a few blocks (bench/RESULTS.md, "Schedule decisions": cuda.bias sums)."""
    j, gate, rn = p.vars["j"], p.vars["gate"], p.rdoms["n"]
    for bias in ("db_ih", "db_hh") + (("dvec",) if p.V else ()):
        if bias + "_acc" not in p.stages:       # db_hh, a copy of db_ih (the LSTM)
            grid_kernel(p.stage(bias))
            continue
        out, acc = p.stage(bias), p.stage(bias + "_acc")
        rows = p.rdoms["v"] if bias == "dvec" else rn     # (dvec: over batch rows)
        ro, ri = hl.RVar(bias + "_ro"), hl.RVar(bias + "_ri")
        u = hl.Var(bias + "_u")
        chunks = acc.update().split(rows.x, ro, ri, 64, GUARD).rfactor(ro, u)
        grid_kernel(chunks.compute_root())
        grid_kernel(chunks, chunks.update())
        register_tile(out, acc, j, [(gate, None, False)], [ro])


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
    # The NaN / Inf scans, a warp per row of W (bad_w) and of y (bad_row): the
    # warp's lanes read 32 consecutive k (rfactor), a thread then takes the
    # max of its row's 32 lanes.
    for name, scan, x, rows in (("bad_w", "w_scan", v, 1), ("bad_row", "y_scan", n, 4)):
        out, f = p.stage(name), p.stage(scan)
        xo, xi = hl.Var(f"{out.name()}_xo"), hl.Var(f"{out.name()}_xi")
        out.compute_root().gpu_tile(x, xo, xi, rows, GUARD)
        ro, ri, u = hl.RVar(f"{f.name()}_ro"), hl.RVar(f"{f.name()}_ri"), hl.Var(f"{f.name()}_u")
        lanes = f.update().split(f.rvars(0)[0], ro, ri, 32, GUARD).rfactor(ri, u)
        f.compute_at(out, xi)
        lanes.compute_at(out, xo).gpu_threads(u, x)
        lanes.update().gpu_threads(u, x)
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


def rows(p, target):
    _model_tile2(p.stage("out"), p.vars["k"], p.vars["m"])


def _elementwise(p, target):
    _model_tile1(p.stage("out"), p.vars["i"], 256)


add = mul = dropout = _elementwise
