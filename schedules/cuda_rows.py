"""CUDA row blocks: a step of a cell that reduces over its units (layer
norm) as one kernel a batch row, its sums over units split over the
block's threads and lanes (schedules/cuda.py's steps of such cells).
"""
import halide as hl

from .cuda_tiles import GUARD, LANES


def row_block(p, out, j, b, along=()):
    """out(j, [gate,] b) and the cell's reductions as one kernel, a block a
    batch row: the block's threads take the units (a loop over them past
    ROW_THREADS), each sum runs on all of them (strided units, coalesced
    reads; rfactor), then on a warp's lanes, then one thread, every stage
    of the row in turn (shared memory between them); the cell's stagings
    (costly values the sums read) once each, before them. along: more pointwise
    outputs computed in the same loops (compute_with)."""
    threads = row_threads(p.H)
    jo, ji = hl.Var(out.name() + "_jo"), hl.Var(out.name() + "_ji")
    for f in (out, *along):    # a thread stores every gate (channel) of its unit
        f.split(j, jo, ji, threads, GUARD).reorder(*f.args()[1:-1], ji, jo, b)
        f.gpu_blocks(b).gpu_threads(ji)
        for g in f.args()[1:-1]:
            f.unroll(g)
        if f is not out:
            f.compute_with(out, ji)
    row_work(p, out, b)


def row_work(p, out, at):
    """The cell's sums, row values and stagings of one batch row, computed
    at out's block loop `at` (a block's row; every unit) as row_block
    describes."""
    threads = row_threads(p.H)
    b = p.vars["b"]
    for group in p.reduction_groups:
        # a group's sums read none of each other's results: each stage of
        # theirs in one loop, one barrier after it (compute_with)
        stages = [_row_sum(f, out, at, threads, group[0].name()) for f in group]
        for other in stages[1:]:
            for stage, lead, loop in zip(other, stages[0], (ROW_T, ROW_T, b)):
                stage.compute_with(lead, loop)
    # quotients by row values (layer norm's 1 / sqrt(var + eps)): once a
    # row, by one thread, those after the same sums in one loop (else each
    # thread computes them in every stage that reads them)
    for funcs in p.row_func_groups:
        for f in funcs:
            f.compute_at(out, at).gpu_threads(b)
            if f is not funcs[0]:
                f.compute_with(funcs[0], b)
    # costly unit values the sums read: once a row, in shared memory, where
    # they fit in STAGED_SHARED_BYTES (else inline, computed by each reader);
    # those that read none of each other in one loop, one barrier after it
    if len(p.stagings) * p.H * 4 <= STAGED_SHARED_BYTES:
        for n, group in enumerate(p.staging_groups):
            uo, ui = hl.Var(f"staged{n}_uo"), hl.Var(f"staged{n}_ui")
            for f in group:
                u = f.args()[0]
                f.compute_at(out, at).split(u, uo, ui, threads, GUARD).reorder(ui, uo)
                f.gpu_threads(ui)
                if f is not group[0]:
                    f.compute_with(group[0], ui)


def row_threads(H: int) -> int:
    """Threads of a row block: a warp's multiple covering H, at most ROW_THREADS."""
    return min(ROW_THREADS, -(-H // LANES) * LANES)


# the thread loop of _row_sum's first two stages: one name, so that
# the stages of several sums can share loops (compute_with)
ROW_T = hl.Var("row_t")


def _row_sum(f, out, at, threads: int, tag: str):
    """Schedule the sum f(b) over units for row_work, at out's loop `at`:
    every thread sums strided units (4 loads in flight), a warp's lanes
    the threads' sums, one thread the lanes' sums. Each of the three sums
    runs in a register and is copied once to shared memory for the row's
    other threads: returns the three copies (the first two with thread
    loop ROW_T, the last with b; reduction loops named by tag)."""
    r = f.rvars(0)[0]
    ro, ri, u = hl.RVar(tag + "_ro"), hl.RVar(tag + "_ri"), ROW_T
    part = f.update().split(r, ro, ri, threads, GUARD).rfactor(ri, u)
    r2 = f.rvars(0)[0]
    r2o, r2i, w = hl.RVar(tag + "_r2o"), hl.RVar(tag + "_r2i"), ROW_T
    lanes = f.update().split(r2, r2o, r2i, LANES, GUARD).rfactor(r2i, w)
    roo, roi = hl.RVar(tag + "_roo"), hl.RVar(tag + "_roi")
    part.update().split(ro, roo, roi, 4, GUARD).reorder(roi, roo, u).unroll(roi)
    # the short sums (threads / LANES a lane, LANES the last) unrolled,
    # so that their loads issue together; the last one in a thread loop
    # of one (unrolled at block level, Halide would put a barrier after
    # each of its statements).
    lanes.update().reorder(r2o, w).unroll(r2o)
    f.update().unroll(f.rvars(0)[0])
    # Each sum in a register, copied once to shared memory: a sum kept in
    # shared memory shares the block's one shared allocation with the
    # values it reads, so LLVM stores it after every add and orders each
    # next load after that store, and its initial value is a block-level
    # stage with a barrier of its own (bench/RESULTS.md, "Schedule
    # decisions": cuda_rows.row_block).
    # The copies' row loop inside their thread loop, and each sum computed
    # in it: where the block's row range is not provably one row (an
    # output of other row bounds, as the bf16 bits' beside dxp), a sum
    # computed at the thread loop would span that range, a register array
    # of dynamic size.
    b = f.args()[0]
    copies = []
    for stage, loop in ((part, ROW_T), (lanes, ROW_T), (f, b)):
        shared = stage.in_()
        shared.compute_at(out, at)
        if loop is not b:
            shared.reorder(b, loop)
        shared.gpu_threads(loop)
        stage.compute_at(shared, b).store_in(hl.MemoryType.Register)
        copies.append(shared)
    return copies


def row_inputs(p, out, b, names, budget=None):
    """A row block's inputs loaded once into shared memory, where the sums
    and the outputs read them, instead of from global memory in every
    stage: the stages `names` (over (unit, [channel,] row); the vector
    parameters "vec_in" over (unit, channel)) in that order, as many as
    fit in `budget` bytes (default ROW_INPUT_BYTES)."""
    threads = row_threads(p.H)
    channels = {"saved_in": len(p.cell.saved_channels(p.H)), "vec_in": p.V}
    left, first = ROW_INPUT_BYTES if budget is None else budget, {}
    jo, ji = hl.Var("inputs_jo"), hl.Var("inputs_ji")
    for name in (n for n in names if n in p.stages):
        size = p.H * 4 * channels.get(name, 1)
        if size > left or size == 0:
            continue
        left -= size
        f = p.stage(name)
        per_row = name != "vec_in"
        j, inner = f.args()[0], f.args()[1:-1] if per_row else f.args()[1:]
        f.compute_at(out, b).split(j, jo, ji, threads, GUARD).reorder(*inner, ji, jo)
        f.gpu_threads(ji)
        for c in inner:
            f.unroll(c)
        # the row's inputs loaded in one loop (compute_with), one barrier after it
        lead = first.setdefault(per_row, f)
        if lead is not f:
            f.compute_with(lead, ji)


def bwd_row_inputs(p) -> list:
    """The stages a backward step's row block loads first (row_inputs)."""
    return ["saved_in"] + [f"{kind}_{s}" for kind in ("prev_in", "new_in", "dnew")
                           for s in p.cell.states] + ["vec_in"]


# Shared memory the backward row block may give its inputs (row_inputs),
# beside its sums' partial sums: 48 KiB a block without opting in to more.
ROW_INPUT_BYTES = 32 << 10

# Shared memory a row block may give the cell's stagings: half of the
# 48 KiB a block gets without opting in to more.
STAGED_SHARED_BYTES = 24 << 10

# Threads of a block that runs a batch row of a step that reduces over
# units: 512 x 128 registers fill an SM's register file
# (bench/RESULTS.md, "Schedule decisions": cuda_rows.row_block).
ROW_THREADS = 512
