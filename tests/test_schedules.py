"""Every schedule in the registry against the numpy reference, and the registry itself.

CPU schedules (family "cpu") run forward and backward for both cells and
must match halstm.reference; GPU schedules (family "gpu") must at least
compile for a CUDA target (no GPU needed). Schedules are found through
schedules.names() / schedules.families(), so a new one is tested without
editing this file.

Sizes are the shared ones of helpers.py (I=13, H=37, L=2: input sizes 13
and 37), so the default schedule's kernels are shared through the test
run's cache; each other CPU schedule costs 8 kernels ({lstm, gru} x {fwd,
bwd} x {13, 37}), shared by every batch size below.
"""
import numpy as np
import pytest

import halstm
from halstm import aot, schedules
from helpers import CLASSES, CUDA_TARGET, STATES, H, I, L, T, assert_close, ref_run

CPU = [n for n in schedules.names() if "cpu" in schedules.families(n)]
GPU = [n for n in schedules.names() if "gpu" in schedules.families(n)]
CPU_ONLY = [n for n in CPU if n not in GPU]      # auto:Li2018 fits both
GPU_ONLY = [n for n in GPU if n not in CPU]

# Autoscheduled kernels take longest to build: one layer (input size 13
# only) and one cell on the GPU side keep their cost down.
def layers_for(schedule):
    return 1 if schedule.startswith("auto:") else L


def cells_for(schedule):
    return ["lstm"] if schedule.startswith("auto:") else ["lstm", "gru"]


# The cpu schedule specializes batch < rows (no batch tile) and batch >=
# rows (row tiles; rows = 6 with AVX-512, 3 with AVX2, and 4-row tiles in
# the backward step): these batches take both paths, whole tiles and tails.
BATCHES = (1, 3, 4, 5, 6, 7)


def test_registry_is_not_empty():
    """The discovery above must find the schedules known today (else every
    parametrized test below would silently run for nothing)."""
    assert {"cpu", "naive"} <= set(CPU)
    assert "cuda" in GPU
    for name in schedules.names():
        assert schedules.families(name) and schedules.families(name) <= {"cpu", "gpu"}, name


# ---- CPU schedules against the reference ------------------------------------

@pytest.mark.parametrize("B", BATCHES)
@pytest.mark.parametrize("schedule,cell", [(s, c) for s in CPU for c in cells_for(s)])
def test_cpu_schedule_matches_reference(schedule, cell, B):
    rng = np.random.default_rng(100 * B + len(cell))
    ns = len(STATES[cell])
    L = layers_for(schedule)
    m = CLASSES[cell](I, H, num_layers=L, schedule=schedule, seed=3)
    x = rng.standard_normal((T, B, I)).astype(np.float32)
    hx = [0.5 * rng.standard_normal((L, B, H)).astype(np.float32) for _ in range(ns)]
    dy = rng.standard_normal((T, B, H)).astype(np.float32)
    dfinal = [rng.standard_normal((L, B, H)).astype(np.float32) for _ in range(ns)]

    if cell == "lstm":
        y, finals = m(x, tuple(hx))
    else:
        y, h_n = m(x, hx[0])
        finals = (h_n,)
    grads = m.backward(dy, *dfinal)

    # the kernels that ran are this schedule's
    assert m._libs, "no kernels were loaded"
    for (k, direction, _), lib in m._libs.items():
        assert lib.manifest["schedule"] == schedule, (k, direction)
    assert {key[1] for key in m._libs} == {"fwd", "bwd"}

    ry, rfinals, rgrads = ref_run(cell, m, x, hx, dy, dfinal)
    assert_close("y", y, ry)
    for s, f, rf in zip(STATES[cell], finals, rfinals):
        assert_close(f"{s}_n", f, rf)
    assert set(grads) == set(rgrads)
    for k in rgrads:
        assert grads[k].dtype == np.float32, k
        assert_close(k, grads[k], rgrads[k])


def test_cpu_weight_gradients_in_blocks_of_unit_tiles():
    """From K, H >= the weight-gradient tile (64 x 6 with AVX-512, 16 x 6
    with AVX2), the cpu schedule sums dW in blocks of unit tiles, the rows
    in chunks (cpu_grads._dw_blocks); the sizes above are below it. Here 65 and
    70 units: partial tiles along both axes, two layers; 23 x 3 rows (a
    tile a task over all rows, the edge tile of inputs on a panel boundary,
    partly past K) and 129 x 65 (past DW_PASS_BYTES: blocks of several
    tiles, the last shifted inwards, whole chunks of rows and a partial
    one)."""
    rng = np.random.default_rng(7)
    m = halstm.LSTM(65, 70, num_layers=2, schedule="cpu", seed=4)
    for steps, batch in ((23, 3), (129, 65)):
        x = rng.standard_normal((steps, batch, 65)).astype(np.float32)
        dy = rng.standard_normal((steps, batch, 70)).astype(np.float32)
        m(x)
        grads = m.backward(dy)
        _, _, rgrads = ref_run("lstm", m, x, dy=dy)
        for k in rgrads:
            assert_close(f"{k} (T={steps}, B={batch})", grads[k], rgrads[k])


AVX512_TARGET = "x86-64-linux-avx-avx2-avx512-avx512_skylake-fma-f16c-sse41"
AVX2_TARGET = "x86-64-linux-avx-avx2-fma-f16c-sse41"


# The fused backward step at a hidden size off the panels (H=100: its last
# tile of units runs past H): it stores units below H only, and reads its
# pointwise inputs unclamped along units, so that the edge tile loads them
# as predicated vectors, not as clamped gathers (one layer's backward at
# H=85 took 0.82x the time: bench/RESULTS.md, "Schedule decisions":
# cpu.step_bwd edge).
# dh_add, the product's initial value, is read at whole tiles (clamped).
@pytest.mark.parametrize("target", [AVX512_TARGET, AVX2_TARGET])
def test_cpu_fused_backward_edge_tile_loads_no_clamped_vectors(target):
    import re
    import halide as hl
    t = hl.Target(target)
    stmt = _lowered(_scheduled_pipe(t, "cpu", "lstm", "step_bwd_fused", 64, 100), t)
    clamped = set(re.findall(r"(\w+)\[(?:max\()?min\(ramp", stmt))
    assert "dstep" in stmt and clamped <= {"dh_add"}, clamped


# proj_tiles: the cells' gate counts (RNN 1, GRU 3, LSTM 4) -> (gates, rows)
@pytest.mark.parametrize("target,registers,step_rows,proj_rows,proj_tiles,dw_vectors", [
    (AVX512_TARGET, 32, 4, 6, {1: (1, 6), 3: (3, 6), 4: (4, 6)}, 4),
    (AVX2_TARGET, 16, 2, 2, {1: (1, 6), 3: (3, 4), 4: (2, 6)}, 2),
    ("x86-64-linux-sse41", 8, 1, 1, {1: (1, 6), 3: (1, 6), 4: (1, 6)}, 1),
    ("arm-64-linux", 16, 2, 2, {1: (1, 6), 3: (3, 4), 4: (2, 6)}, 2),
])
def test_cpu_register_tiles_follow_the_register_file(target, registers, step_rows, proj_rows,
                                                     proj_tiles, dw_vectors):
    """The cpu schedule's register tiles are sized from the target's vector
    registers (counted in panel-wide vectors): a forward step's tile of 4
    gates x rows fills half of them; a projection tile's accumulators,
    weight vectors and broadcast fit them, every gate where that gives 12
    accumulators or more, else groups of gates; a weight-gradient tile of
    vectors x 6 units fills three quarters."""
    import halide as hl
    from halstm.schedules import cpu
    t = hl.Target(target)
    assert cpu.registers(t) == registers
    assert cpu.step_rows(t) == step_rows
    assert cpu.proj_rows(t) == proj_rows
    tiles = {gates: cpu.proj_tile(t, gates) for gates in proj_tiles}
    assert tiles == proj_tiles
    for gates, (group, rows) in tiles.items():
        assert gates % group == 0 and group * rows + group + 1 <= registers
    assert cpu.layout(t).dw_cols == dw_vectors * cpu.panel(t)
    # the weight panels' gates grouped as the projection tiles take them
    groups = {gates: cpu.panel_layout(cpu.layout(t), gates, t).panel_gates for gates in tiles}
    assert groups == {gates: (0 if group == gates else group) for gates, (group, _) in tiles.items()}


@pytest.mark.parametrize("kmacs", [2048, 1])
def test_cpu_projection_serial_size_goes_to_the_driver(kmacs, capfd):
    """The input projection is one parallel loop in every branch; knob
    proj_serial_kmacs reaches the driver as the multiply-adds below which
    it runs that loop on the calling thread (p.proj_serial_macs,
    HALSTM_PROJ_SERIAL_MACS: csrc/threads.h PoolWork; the shared OpenMP
    team's calls run it in parallel: test_threads)."""
    import halide as hl
    from halstm import cells, pipeline
    from halstm.schedules import cpu
    target = hl.Target(AVX512_TARGET)
    p = pipeline.build(cells.get("lstm"), "proj", 256, 256, cpu.layout(target))
    p.knobs = {"proj_serial_kmacs": kmacs}
    cpu.proj(p, target)
    assert p.proj_serial_macs == kmacs << 10
    capfd.readouterr()
    p.stage("xp").print_loop_nest()
    nest = "".join(capfd.readouterr())        # (Halide's stream: stdout or stderr)
    outer = [line.strip() for line in nest.splitlines() if line.startswith("  ") and
             not line.startswith("   ") and "jo" in line]      # each branch's outer loop
    assert len(outer) == 2 and all(line.startswith("parallel") for line in outer), nest


# tiles: (panel width, gates, rows) of accumulators the lowered pipeline holds
@pytest.mark.parametrize("target, cell, kind, tiles", [
    (AVX512_TARGET, "lstm", "step", {(16, 4, 6), (16, 4, 4)}),
    (AVX512_TARGET, "gru", "step", {(16, 3, 6), (16, 3, 4)}),
    (AVX2_TARGET, "lstm", "step", {(8, 2, 6), (8, 4, 2)}),
    (AVX2_TARGET, "gru", "step", {(8, 3, 4), (8, 3, 2)}),
    (AVX512_TARGET, "layernorm_lstm", "step_product", {(16, 4, 6), (16, 4, 4)}),
    (AVX2_TARGET, "layernorm_lstm", "step", {(8, 2, 6), (8, 4, 2)}),
])
def test_cpu_forward_steps_take_the_projection_tiles(target, cell, kind, tiles):
    """A forward step's product (a whole step's, or the product of a step
    that reduces over units) has cpu.proj_tile's register tiles, its gate
    group x its rows, for batches that fill them, and tiles of every gate
    x cpu.step_rows rows for the others: the lowered pipeline allocates
    accumulators of both shapes."""
    found = _accumulator_tiles(target, cell, kind, r"hg_acc\S*", 3)
    assert tiles <= found, found


# tiles: (units, rows) of dh's accumulators
@pytest.mark.parametrize("target, cell, kind, tiles", [
    (AVX2_TARGET, "lstm", "step_bwd_fused", {(16, 6), (16, 4)}),
    (AVX2_TARGET, "layernorm_lstm", "step_bwd", {(16, 6), (16, 4)}),
    (AVX2_TARGET, "layernorm_lstm", "step_bwd_product", {(16, 6), (16, 4)}),
    (AVX512_TARGET, "lstm", "step_bwd_fused", {(32, 8)}),
])
def test_cpu_backward_dh_tiles_hide_the_fma_latency(target, cell, kind, tiles):
    """dh = W_hh^T dhg in tiles of 6 rows where the base tiles hold fewer
    than 12 accumulators (AVX2's 2 panels x 4 rows) and the rows fill them;
    AVX-512's tiles (here 2 panels x 8 rows at H=64) as they are."""
    found = _accumulator_tiles(target, cell, kind, r"dh\w*acc\S*", 2)
    assert tiles == found, found


def _accumulator_tiles(target, cell, kind, name, dims) -> set:
    """The extents of every allocation of accumulators `name` (a regex) in
    pipeline `kind` of `cell` at K=H=64, lowered for `target` with the cpu
    schedule and its panel layout."""
    import re
    import halide as hl
    from halstm import cells, pipeline
    from halstm.schedules import cpu
    t = hl.Target(target)
    c = cells.get(cell)
    p = pipeline.build(c, kind, 64, 64, cpu.panel_layout(cpu.layout(t), c.n_gates, t))
    getattr(cpu, kind)(p, t)
    extents = r" \* ".join([r"(\d+)"] * dims)
    return {tuple(map(int, m)) for m in re.findall(
        rf"allocate {name}\[float32 \* {extents}\]", _lowered(p, t))}


# ---- GPU schedules compile --------------------------------------------------

@pytest.fixture(scope="module")
def cuda_build(tmp_path_factory):
    """build(schedule, cell, direction) -> (manifest, folder): aot.build for
    CUDA_TARGET at I, H with every pipeline's lowered statement emitted
    (<kind>.stmt), each built once for this module."""
    built = {}

    def build(schedule, cell, direction):
        key = (schedule, cell, direction)
        if key not in built:
            out = tmp_path_factory.mktemp("cuda")
            spec = aot.Spec(cell, I, H, direction, CUDA_TARGET, schedule)
            built[key] = aot.build(spec, out, emit=("stmt",)), out
        return built[key]
    return build


@pytest.mark.parametrize("direction", aot.DIRECTIONS)
@pytest.mark.parametrize("schedule,cell", [(s, c) for s in GPU for c in cells_for(s)])
def test_gpu_schedule_compiles_for_cuda(schedule, cell, direction, cuda_build):
    m, out = cuda_build(schedule, cell, direction)
    assert (out / aot.MANIFEST).is_file()
    assert m["schedule"] == schedule
    assert "cuda" in m["target"].split("-") and "cuda_capability_80" in m["target"].split("-")
    assert m["library"], m                      # this CPU can load host-cuda code
    lib = out / m["library"]
    assert lib.suffix == ".so" and lib.read_bytes()[:4] == b"\x7fELF"
    if schedule == "cuda":      # its shape-dependent choices are in the manifest
        want = "step:" if direction == "fwd" else "step_bwd_fused:"    # (H < 512)
        assert any(n.startswith(want) for n in m["schedule_notes"]), m["schedule_notes"]
    if schedule == "auto:Anderson2021":     # and an autoscheduler's departures
        want = "pack pipeline:" if direction == "fwd" else "grads pipeline scheduled by Li2018"
        assert any(n.startswith(want) for n in m["schedule_notes"]), m["schedule_notes"]


@pytest.mark.parametrize("schedule,cell", [(s, c) for s in GPU for c in cells_for(s)])
def test_cuda_graphs_only_where_steps_allocate_no_device_memory(schedule, cell, cuda_build):
    """A CUDA library runs its time loops from captured CUDA graphs where
    its manifest says cuda_graphs (aot compiles its driver from the same
    decision). A graph bakes in every pointer its kernels use, and Halide
    may free a stage's device allocation while a graph still uses it, so a
    library with graphs must have step pipelines that allocate no device
    memory: checked in the lowered statements of what was built (the
    autoschedulers' steps do allocate). The hand-written cuda schedule
    keeps every step's stages in registers or shared memory, and its
    libraries do use graphs."""
    for direction in aot.DIRECTIONS:
        m, out = cuda_build(schedule, cell, direction)
        steps = [p.removeprefix("halstm_") for p in m["pipelines"] if p.startswith("halstm_step")]
        assert steps, m["pipelines"]
        stmts = {k: (out / f"{k}.stmt").read_text(errors="replace") for k in steps}
        assert all("halide_cuda_run" in t for t in stmts.values()), "a step runs no GPU kernel"
        allocating = [k for k, t in stmts.items() if "halide_device_malloc" in t]
        if m["cuda_graphs"]:
            assert not allocating, f"{direction}: graphs over steps that allocate: {allocating}"
        if schedule == "cuda":
            assert m["cuda_graphs"] is True, direction


def _scheduled_pipe(target, schedule, cell, kind, K, H):
    """Pipeline `kind` for the Halide target `target` with `schedule`
    applied (nothing compiled)."""
    from halstm import cells, pipeline
    mod = schedules.for_target(target, schedule)
    p = pipeline.build(cells.get(cell), kind, K, H, mod.layout(target))
    getattr(mod, kind)(p, target)
    return p


def _cuda_pipe(cell, kind, K, H):
    """Pipeline `kind` with the cuda schedule applied (nothing compiled) and
    the notes the schedule wrote for it."""
    import halide as hl
    target = hl.Target(CUDA_TARGET)
    p = _scheduled_pipe(target, "cuda", cell, kind, K, H)
    return p, list(p.notes), target


# Below H=512 the cuda schedule's backward time loop is one kernel a step
# (step_bwd_fused); from 512, and for the autoschedulers, two (step_bwd).
# On CUDA the backward reads the weights as given (no pack_bwd; the
# autoschedulers take the cuda schedule's layout).
@pytest.mark.parametrize("schedule", GPU)
def test_fused_backward_step_below_h512_on_cuda_everywhere_on_cpu(schedule):
    import halide as hl
    layout = schedules.for_target(CUDA_TARGET, schedule).layout(hl.Target(CUDA_TARGET))
    for hidden, fused in ((37, True), (511, True), (512, False), (1024, False)):
        kinds = aot.pipeline_kinds(aot.Spec("lstm", I, hidden, "bwd", CUDA_TARGET, schedule),
                                   layout)
        want = "step_bwd_fused" if fused and schedule == "cuda" else "step_bwd"
        assert kinds == (want, "grads"), (hidden, kinds)
        assert aot.pipeline_kinds(aot.Spec("lstm", I, hidden, "fwd", CUDA_TARGET, schedule),
                                  layout) == ("pack", "proj", "step", "step_infer")
    # the cpu schedule: one backward step pipeline a step at every hidden size
    cpu = schedules.for_target("host", "cpu").layout(hl.Target("host"))
    for hidden in (37, 512, 1024):
        assert (aot.pipeline_kinds(aot.Spec("lstm", I, hidden, "bwd"), cpu)
                == ("pack_bwd", "step_bwd_fused", "grads"))


# The cuda schedule computes the per-step products as lanes products
# (accumulators striped across a warp's lanes, the shared operand handed out
# by warp shuffles) from H=512 where H is a multiple of 32, and the
# projection and dx wherever H (and, for the projection, K) is a multiple of
# 32; elsewhere register tiles. The choice is in the notes.
@pytest.mark.parametrize("kind,lanes_from", [("proj", 32), ("grads", 32), ("step", 512),
                                             ("step_infer", 512), ("step_bwd", 512)])
def test_cuda_lanes_products_where_the_warps_fit(kind, lanes_from):
    for hidden in (128, 528, 512, 1024):
        _, notes, _ = _cuda_pipe("lstm", kind, 64, hidden)
        lanes = hidden % 32 == 0 and hidden >= lanes_from
        assert any("staged in chunks" in n for n in notes) == lanes, (hidden, notes)
    _, notes, _ = _cuda_pipe("lstm", kind, 65, 128)     # K not a multiple of 32
    assert any("staged in chunks" in n for n in notes) == (kind == "grads"), notes


# The weight gradients are lanes products where they have 2048 tiles (4
# input x 4 hidden units) or more, register tiles summed in parts elsewhere.
def test_cuda_weight_gradients_as_lanes_products_from_2048_tiles():
    for K, hidden, lanes in ((64, 1024, {"dw_hh"}), (1024, 1024, {"dw_ih", "dw_hh"}),
                             (2048, 512, {"dw_ih"}), (512, 512, set()), (1000, 1000, set())):
        _, notes, _ = _cuda_pipe("lstm", "grads", K, hidden)
        got = {n.split()[1] for n in notes if "as a lanes product" in n and " dw_" in n}
        assert got == lanes, (K, hidden, notes)


# A register-tile step's reduction is split over 8 warps at every H, in
# runs of ceil(H / 8) (the last shorter) where 8 does not divide H; the
# folded steps keep an even split where one gives 2 warps or more
# (cuda_tiles.warp_slices). The odd H lower to PTX with no local memory.
@pytest.mark.parametrize("cell,kind,H,warps", [
    ("lstm", "step", 85, 8), ("gru", "step_infer", 37, 8), ("lstm", "step_bwd_fused", 100, 8),
    ("lstm", "step_bwd", 650, 8), ("lstm", "step_narrow", 261, 8),
    ("layernorm_lstm", "step_fold", 85, 15), ("layernorm_lstm", "step_fold", 100, 4),
    ("layernorm_lstm", "step_bwd_fold", 37, 2)])
def test_cuda_step_reductions_split_over_warps_at_odd_sizes(cell, kind, H, warps):
    import re
    p, notes, target = _cuda_pipe(cell, kind, 64, H)
    assert any(re.search(rf"split over {warps} warp", n) for n in notes), notes
    if kind in ("step", "step_bwd_fused"):
        ptx = _lowered(p, target)
        assert ".entry" in ptx and "ld.local" not in ptx and "st.local" not in ptx


# Lowered for a CUDA target (no GPU needed): a lanes product's kernel uses
# warp shuffles, or on one warp (the projection, dx, the weight gradients)
# shared memory and no shuffles, and never local memory. Local memory would
# mean Halide no longer keeps the striped tile in registers (a per-thread
# copy of the whole tile).
@pytest.mark.parametrize("cell,kind,H,stage,one_warp", [
    ("lstm", "step", 512, "step_out", False), ("lstm", "step_bwd", 512, "dh_prev", False),
    ("lstm", "proj", 512, "xp", True), ("lstm", "grads", 512, "dx", True),
    ("gru", "step", 512, "step_out", False), ("lstm", "proj", 128, "xp", True),
    ("lstm", "grads", 128, "dx", True), ("lstm", "grads", 1024, "dw_hh", True),
    ("gru", "grads", 1024, "dw_hh", True)])
def test_cuda_lanes_products_lower_to_registers(cell, kind, H, stage, one_warp):
    import re
    p, _, target = _cuda_pipe(cell, kind, 64, H)
    ptx = _lowered(p, target)
    kernels = {m.group(1): m.group(2) for m in
               re.finditer(r"\.entry\s+(\S+)\((.*?)\n}\n", ptx, re.S)}
    # (names made unique within the process: xp, xp_1, xp__1, ...)
    mine = [body for name, body in kernels.items()
            if re.match(rf"_kernel_{stage}(_+\d+)?_s0", name)]
    assert mine, sorted(kernels)
    for body in mine:
        assert ("shfl.sync" in body) != one_warp
        assert ("ld.shared" in body) or not one_warp
        assert "ld.local" not in body and "st.local" not in body


# A step that reduces over units runs a block a batch row (cuda_rows.row_block):
# the sums of one level share their loops and barriers (4 levels of the
# layer-norm LSTM's 6 sums, each way), the short sums are unrolled into
# registers (no local memory), and the backward loads its saved values,
# states and vector parameters into shared memory once where they fit, in
# one loop (cuda_rows.row_inputs: at H = 512, 14 saved channels in 28 KiB, not
# at 640), instead of from global memory in every stage.
def _row_kernel(kind, H):
    import re
    p, _, target = _cuda_pipe("layernorm_lstm", kind, 64, H)
    text = _lowered(p, target)
    row = [m.group(2) for m in re.finditer(r"\.entry\s+(\S+)\((.*?)\n}\n", text, re.S)
           if re.match(r"_kernel_(step_out|layernorm_lstm_dxp_\w*out)", m.group(1))]
    assert len(row) == 1, re.findall(r"\.entry\s+(\S+)\(", text)
    return row[0]


@pytest.mark.parametrize("kind,H,barriers,staged", [
    ("step", 256, 15, False), ("step_bwd", 256, 15, True), ("step_bwd", 512, 14, True),
    ("step_bwd", 640, 14, False)])
def test_cuda_row_block_of_the_layer_norm_lstm(kind, H, barriers, staged, monkeypatch):
    from halstm.schedules import cuda_rows
    body = _row_kernel(kind, H)
    assert body.count("bar.sync") == barriers
    assert "ld.local" not in body and "st.local" not in body
    # quotients by row values once a row (by one thread), not in every
    # stage that reads them: the forward's square roots are its three
    # 1 / sqrt(var + eps) and the three it saves; the backward's IEEE
    # divisions and reciprocals 6 (31 with the quotients inlined)
    if kind == "step":
        assert body.count("sqrt.rn") == 6
    else:
        assert body.count("div.rn") + body.count("rcp.rn") == 6
    if kind == "step_bwd" and H == 256:
        # every input in one loop: global loads in 3 of the barriers' stages
        # (the inputs, the vector parameters, the output stage)
        stages = body.split("bar.sync")
        assert sum("ld.global" in s for s in stages) == 3, [s.count("ld.global") for s in stages]
    if kind == "step_bwd":
        monkeypatch.setattr(cuda_rows, "ROW_INPUT_BYTES", 0)
        unstaged = _row_kernel(kind, H).count("ld.global")
        assert (body.count("ld.global") * 3 < unstaged * 2) == staged, (body.count("ld.global"),
                                                                         unstaged)


@pytest.mark.parametrize("kind,H", [("step_fold", 72), ("step_fold", 256), ("step_fold", 512),
                                    ("step_bwd_fold", 72), ("step_bwd_fold", 256),
                                    ("step_bwd_fold", 2048)])
def test_cuda_folded_step_of_the_layer_norm_lstm(kind, H):
    """step_fold (pipeline.FOLD_FWD) and step_bwd_fold (FOLD_BWD) are one
    kernel each: a block's row work and its units' product, one axis of at
    most ROW_THREADS threads (the row stages' and the product's thread
    loops share it), the product's partial sums in registers (not stored
    to shared memory after every multiply-add), at most the 48 KiB of
    shared memory a block gets without opting in, no local or device
    memory."""
    import re
    from halstm.schedules import cuda_rows
    p, notes, target = _cuda_pipe("layernorm_lstm", kind, 64, H)
    assert any(f"{kind}: one kernel" in n for n in notes), notes
    text = _lowered(p, target)
    assert len(re.findall(r"\.entry\s", text)) == 1
    launch = re.findall(r'halide_cuda_run\(cuda\[0\], "[^"]*", ([^,]+), ([^,]+), ([^,]+), '
                        r'(\d+), (\d+), (\d+), 0 \+ \((\d+)\*4\)', text)
    assert len(launch) == 1, launch
    assert int(launch[0][3]) <= cuda_rows.ROW_THREADS and launch[0][4:6] == ("1", "1"), launch
    assert int(launch[0][6]) * 4 <= 48 << 10, launch
    assert "ld.local" not in text and "st.local" not in text
    assert "halide_device_malloc" not in text
    # (without registers: 34 at H=256 forward; the rest are single stores
    # of values computed once: stagings, dhg)
    stored = re.findall(r"fma\.rn\.f32[^\n]*\n\s*st\.shared", text)
    assert len(stored) <= 5, len(stored)
    if kind == "step_fold":
        assert text.count("sqrt.rn") == 6        # the row values once, as the step's
    else:
        assert text.count("div.rn") + text.count("rcp.rn") == 6    # as step_bwd's


def _driver_pipe():
    """A stand-in for a built pipe: what aot's driver build reads of the
    pipes, at the values a schedule leaves unset."""
    from types import SimpleNamespace
    return SimpleNamespace(split_quantum=1, split_quantum_small=0, split_small_below=0,
                           split_batch_bytes=0, proj_serial_macs=0)


def test_folded_steps_only_for_cells_that_reduce_on_cuda():
    """A CUDA library of a reducing cell has the folded steps of its
    direction, and its driver is built to run them; an LSTM's and a CPU's
    have neither."""
    from halstm import pipeline
    pipe = _driver_pipe()
    for cell, target, folds in (("layernorm_lstm", CUDA_TARGET, True), ("lstm", CUDA_TARGET, False),
                                ("layernorm_lstm", "host", False)):
        for direction, fold, define in (("fwd", pipeline.FOLD_FWD, "HALSTM_FOLD_FWD"),
                                        ("bwd", pipeline.FOLD_BWD, "HALSTM_FOLD_BWD")):
            spec = aot.Spec(cell, I, 64, direction, target)
            plan = aot._plan(spec, (), False)
            assert all(k in plan.kinds for k in fold) == folds, (cell, target, plan.kinds)
            assert ("step_fold" in plan.kinds or "step_bwd_fold" in plan.kinds) == folds
            defines = aot._driver_build(spec, plan, [pipe]).defines()
            assert (defines.get(define) == 1) == folds, (cell, target, direction)
            assert not {"HALSTM_FOLD_FWD", "HALSTM_FOLD_BWD"} - {define} & set(defines)


def test_narrow_steps_where_their_blocks_fit_the_multiprocessors(monkeypatch):
    """A CUDA forward library of a cell with several gates below H = 512,
    whose one-row step blocks read 128 KiB of W_hh or more, has the
    narrow step pipelines, for batches whose blocks of 8 units fit the
    GPU's SMs (machine.gpu_sms) at once, and its driver is built to call
    them up to that batch; their kernels take one gate of one unit a
    thread (8 units x 4 gates a warp for the LSTM at H = 256: 32 blocks a
    row, 32 x 8 threads, no local memory). Smaller products, one-gate
    cells, reducing cells, H = 512, backward libraries and CPU targets
    have none."""
    import re
    from halstm import machine, pipeline
    monkeypatch.setattr(machine, "gpu_sms", lambda: 132)
    pipe = _driver_pipe()
    for cell, hidden, direction, target, rows in (
            ("lstm", 256, "fwd", CUDA_TARGET, 132 // 32), ("lstm", 384, "fwd", CUDA_TARGET, 2),
            ("gru", 384, "fwd", CUDA_TARGET, 132 // 48), ("peephole_lstm", 256, "fwd", CUDA_TARGET, 4),
            ("lstm", 128, "fwd", CUDA_TARGET, 0), ("gru", 256, "fwd", CUDA_TARGET, 0),
            ("lstm", 256, "bwd", CUDA_TARGET, 0), ("lstm", 512, "fwd", CUDA_TARGET, 0),
            ("rnn_tanh", 256, "fwd", CUDA_TARGET, 0), ("layernorm_lstm", 256, "fwd", CUDA_TARGET, 0),
            ("lstm", 256, "fwd", "host", 0)):
        spec = aot.Spec(cell, I, hidden, direction, target)
        plan = aot._plan(spec, (), False)
        assert plan.layout.narrow_rows == rows, (cell, hidden, direction, target)
        assert all(k in plan.kinds for k in pipeline.NARROW) == bool(rows)
        defines = aot._driver_build(spec, plan, [pipe]).defines()
        assert defines.get("HALSTM_NARROW_ROWS", 0) == rows
    monkeypatch.setattr(machine, "gpu_sms", lambda: 16)     # a smaller GPU: fewer rows
    assert aot._plan(aot.Spec("lstm", I, 256, "fwd", CUDA_TARGET), (), False) \
        .layout.narrow_rows == 0
    p, notes, target = _cuda_pipe("lstm", "step_narrow", I, 256)
    assert any("one gate of one unit" in n for n in notes), notes
    text = _lowered(p, target)
    runs = re.findall(r'halide_cuda_run\(cuda\[0\], "\w+", (\w+), [^,]+, 1, (\w+), (\w+), 1,', text)
    assert runs == [("32", "32", "8")], runs
    assert ".local" not in text


def _lowered(p, target) -> str:
    """p compiled for target: the lowered statement with the PTX."""
    import tempfile
    import halide as hl
    with tempfile.TemporaryDirectory() as d:
        path = f"{d}/k.stmt"
        p.pipeline().compile_to({hl.OutputFileType.stmt: path}, [hl.Argument(q) for q in p.inputs],
                                "k", target.with_feature(hl.TargetFeature.NoRuntime))
        with open(path, "rb") as f:
            return f.read().decode("latin1")


@pytest.mark.parametrize("kind", ["step_infer", "step_bwd_fused"])
def test_cpu_steps_compute_each_costly_value_once(kind):
    """On a CPU each saved channel of a forward step is a loop of its own,
    and each output of a backward step a store of its own. peephole_lstm's
    o reads c', which reads i, f and g: o reads them back from a Func of
    the lower level (cells.lowering, DefinedCell._leveled); its backward's
    outputs read tanh(c') from a Func computed once a tile
    (_read_by_several). So peephole's steps evaluate as many exponentials
    as the LSTM's (on AVX2 before: forward 99 against 63, backward 96
    against 60, where the LSTM's backward computed tanh(c') for every
    output; now 12)."""
    import halide as hl
    target = hl.get_host_target()
    exps = {cell: _lowered(_scheduled_pipe(target, "cpu", cell, kind, 128, 128),
                           target).count("floor_f32") for cell in ("lstm", "peephole_lstm")}
    assert exps["peephole_lstm"] == exps["lstm"] > 0


def _nested_rows_step(x, r, s):
    from halstm.cells import mean, sqrt, tanh
    scale = mean(x.i) / (sqrt(mean(x.i * x.i)) + 1.0)      # a row value over a row value
    return {"h": tanh(x.i / (scale * scale + 1.0) + r.i)}  # a unit value over one built on it


@pytest.mark.parametrize("kind", ["step", "step_bwd"])
def test_cuda_row_values_that_read_each_other(kind):
    """A cell's quotients by row values where one reads another: the
    cuda row block computes them in loops of their own, in order (in one
    loop, Halide refuses them: "Invalid compute_with")."""
    import halide as hl
    from halstm import pipeline
    from halstm.cells import define
    from halstm.cells.lowering import DefinedCell
    cell = DefinedCell(define("nested_rows", gates="i", states=("h",), step=_nested_rows_step))
    target = hl.Target(CUDA_TARGET)
    mod = schedules.for_target(target, "cuda")
    p = pipeline.build(cell, kind, 32, 64, mod.layout(target))
    if kind == "step":
        assert [len(g) for g in p.row_func_groups] == [1, 1]
    getattr(mod, kind)(p, target)
    _lowered(p, target)


# ---- the registry -----------------------------------------------------------

@pytest.mark.parametrize("target,default", [
    ("host", "cpu"), ("arm-64-linux", "cpu"), ("host-cuda", "cuda"), (CUDA_TARGET, "cuda"),
])
def test_default_schedule(target, default):
    """A target's default schedule, and it fits the target when asked for
    by name."""
    assert schedules.resolve(target) == default
    assert schedules.resolve(target, default) == default
    assert schedules.for_target(target).__name__ == f"halstm.schedules.{default}"
    assert "auto:Adams2019" in schedules.names() and "auto:Anderson2021" in schedules.names()
    assert aot.Spec("lstm", I, H, "fwd", target).schedule == default


def test_default_schedule_of_a_halide_target_object():
    import halide as hl
    assert schedules.resolve(hl.Target("host")) == "cpu"
    assert schedules.resolve(hl.Target(CUDA_TARGET)) == "cuda"


@pytest.mark.parametrize("name", schedules.names())
def test_every_schedule_module_covers_every_pipeline_it_is_given(name):
    """Every pipeline a build with this schedule is made of, on each family
    it fits (both directions, a hidden size below and above where the
    backward step changes, class-index input where offered), has its
    function in the schedule module."""
    import halide as hl
    for fam in sorted(schedules.families(name)):
        target = "host" if fam == "cpu" else CUDA_TARGET
        mod = schedules.for_target(target, name)
        layout = mod.layout(hl.Target(target))
        onehot = (False, True) if fam == "cpu" and name in schedules.ONEHOT else (False,)
        specs = [aot.Spec("lstm", I, h, d, target, name, ids)
                 for d in aot.DIRECTIONS for h in (H, 1024) for ids in onehot]
        built = {k for spec in specs for k in aot.pipeline_kinds(spec, layout)}
        assert {"proj", "step", "step_infer", "grads"} <= built, built
        for kind in sorted(built):
            assert callable(getattr(mod, kind, None)), f"{name} ({fam}) lacks {kind}"


@pytest.mark.parametrize("target", ["host-cuda", CUDA_TARGET])
@pytest.mark.parametrize("name", CPU_ONLY)
def test_cpu_schedule_for_cuda_target_raises(name, target):
    with pytest.raises(ValueError, match=repr(name)):
        schedules.resolve(target, name)
    with pytest.raises(ValueError, match=repr(name)):
        aot.Spec("lstm", I, H, "fwd", target, name)
    with pytest.raises(ValueError, match=repr(name)):
        halstm.GRU(I, H, target=target, schedule=name)


@pytest.mark.parametrize("target", ["host", "arm-64-linux"])
@pytest.mark.parametrize("name", GPU_ONLY)
def test_gpu_schedule_for_cpu_target_raises(name, target):
    with pytest.raises(ValueError, match=repr(name)):
        schedules.resolve(target, name)
    with pytest.raises(ValueError, match=repr(name)):
        aot.Spec("lstm", I, H, "fwd", target, name)
    with pytest.raises(ValueError, match=repr(name)):
        halstm.LSTM(I, H, target=target, schedule=name)


@pytest.mark.parametrize("target", ["host", CUDA_TARGET])
def test_unknown_schedule_raises_listing_known_ones(target):
    for call in (lambda: schedules.resolve(target, "fastest"),
                 lambda: schedules.for_target(target, "fastest"),
                 lambda: aot.Spec("lstm", I, H, "fwd", target, "fastest")):
        with pytest.raises(ValueError) as info:
            call()
        msg = str(info.value)
        assert "fastest" in msg
        for known in schedules.names():
            assert repr(known) in msg or known in msg, (known, msg)



# ---- one kernel a forward (cuda.loop) -----------------------------------------

def _layer_states(cell, w, vectors, x, states0):
    """Each state after every step of one layer, (T, B, H) each, by the
    float64 reference: w (w_ih, w_hh, b_ih, b_hh), vectors by name."""
    from halstm import reference
    if cell == "lstm":
        cache = reference.lstm_layer_forward(x, *states0, *w)[3]
        return [np.stack(cache["hs"][1:]), np.stack(cache["cs"][1:])]
    if cell == "gru":
        return [reference.gru_layer_forward(x, *states0, *w)[0]]
    w_ih, w_hh, b_ih, b_hh = w
    s, out = tuple(states0), []
    for t in range(x.shape[0]):
        s = reference.STEPS[cell](x[t] @ w_ih.T + b_ih, s[0] @ w_hh.T + b_hh, s,
                                  *((vectors,) if vectors else ()))
        out.append(s)
    return [np.stack([o[n] for o in out]) for n in range(len(states0))]


@pytest.mark.parametrize("cell", ["lstm", "gru", "rnn_relu", "cifg_lstm", "peephole_lstm"])
def test_loop_pipeline_matches_the_reference(cell):
    """pipeline.LOOP's algorithm (every step of an inference forward in
    one pipeline), run here on the CPU as Halide's default schedule
    leaves it, against the float64 reference: T = 1 and several steps,
    B = 1 and several rows, 11 units in panels of 4 (the last one
    padded), a vector parameter (peephole_lstm)."""
    import halide as hl
    from halstm import cells, pipeline
    from halstm.layout import Layout
    d = cells.definition(cell)
    G, NS, K, Hs, P = len(d.gates), len(d.states), 5, 11, 4
    Hp = -(-Hs // P) * P
    rng = np.random.default_rng(7)
    p = pipeline.build(cells.get(cell), "loop_infer", K, Hs, Layout(panel=P))
    f = p.pipeline()
    for steps, B in ((1, 1), (6, 3)):
        w = [rng.uniform(-0.5, 0.5, shape) for shape in ((G * Hs, K), (G * Hs, Hs), (G * Hs,),
                                                         (G * Hs,))]
        vectors = {v.name: rng.uniform(-0.5, 0.5, Hs) for v in d.vectors}
        x = rng.standard_normal((steps, B, K))
        states0 = [rng.uniform(-1, 1, (B, Hs)) for _ in range(NS)]
        xp = np.zeros((steps * B, G, Hp))                   # (N, G, Hp), units past H zero
        xp[:, :, :Hs] = (x @ w[0].T + w[2]).reshape(steps * B, G, Hs)
        wp = np.zeros((Hp // P, Hs, G, P))              # wp[jo, k, g, ji] = W_hh[g*H + jo*P + ji, k]
        for g in range(G):
            for j in range(Hs):
                wp[j // P, :, g, j % P] = w[1][g * Hs + j]
        inputs = {"xp": xp, "wp_hh": wp, "b_hh": w[3].reshape(G, Hs)}
        if d.vectors:
            inputs["vec"] = np.stack([vectors[v.name] for v in d.vectors])
        arrays = {n: np.ascontiguousarray(a, np.float32) for n, a in inputs.items()}
        for name, a in arrays.items():      # (a Buffer of an array does not keep it alive)
            p.param(name).set(hl.Buffer(a))
        # each state (T+1, B, H) in numpy's order, step 0 the initial state
        whole = [np.concatenate([a[None], np.zeros((steps, B, Hs))]).astype(np.float32)
                 for a in states0]
        f.realize([hl.Buffer(a) for a in whole])      # (Buffers of the arrays: written in place)
        want = _layer_states(cell, w, vectors, x, states0)
        for s, got, a0, ref in zip(d.states, whole, states0, want):
            assert_close(f"{cell} {s} T={steps} B={B}", got[1:], ref)
            assert np.array_equal(got[0], a0.astype(np.float32)), "step 0 written"


def test_loop_rows_hold_16_byte_loads_without_bank_conflicts(monkeypatch):
    """cuda.loop_row_floats: a unit's row of a gate in loop_infer's
    shared memory holds its H weights in whole 16-byte words, and the 8
    threads of a quarter warp (consecutive units), each loading one word
    of its row, hit 8 distinct groups of 4 of the 32 banks; where not
    every gate fits in such rows (on an H100 the GRU past H = 136, the
    LSTM past 116), none: the units innermost."""
    from halstm import machine
    from halstm.schedules import cuda
    monkeypatch.setattr(machine, "gpu_block_shared_bytes", lambda: 227 << 10)
    for units in range(1, 257):
        row = cuda.loop_row_floats(3, units)
        if not row:
            assert units > 136, units
            continue
        assert row % 4 == 0 and units <= row <= units + 7, (units, row)
        for k in range(0, units, 4):
            groups = {(unit * row + k) // 4 % 8 for unit in range(8)}
            assert len(groups) == 8, (units, row, k)
    assert [cuda.loop_row_floats(4, n) for n in (112, 116, 117, 120)] == [116, 116, 0, 0]
    assert cuda.loop_shared_gates(4, 116) == 4 and cuda.loop_shared_gates(4, 120) == 3
    assert cuda.loop_row_floats(3, 137) == 0 and cuda.loop_shared_gates(3, 137) == 3


def test_one_kernel_inference_where_w_hh_fits_a_block(monkeypatch):
    """A CUDA forward library of a cell without sums over units whose W_hh
    fits the shared memory of one block (machine.gpu_block_shared_bytes:
    227 KiB on an H100) has pipeline.LOOP, its driver built to call it for
    batches of up to one block an SM (machine.gpu_sms); a larger W_hh, a
    reducing cell, a backward library and a CPU target have none. Its
    kernel: a block a batch row, a thread a unit, barriers in the step
    loop, no local memory, and the gates of W_hh that fit beside the
    step's xp read from shared memory (all of them, 16 bytes a load, or on
    a GPU of less shared memory as many as fit)."""
    import re
    from halstm import machine, pipeline
    monkeypatch.setattr(machine, "gpu_sms", lambda: 132)
    monkeypatch.setattr(machine, "gpu_block_shared_bytes", lambda: 227 << 10)
    pipe = _driver_pipe()
    for cell, hidden, direction, target, rows in (
            ("lstm", 120, "fwd", CUDA_TARGET, 132), ("lstm", 121, "fwd", CUDA_TARGET, 0),
            ("gru", 139, "fwd", CUDA_TARGET, 132), ("gru", 140, "fwd", CUDA_TARGET, 0),
            ("rnn_tanh", 241, "fwd", CUDA_TARGET, 132), ("rnn_tanh", 242, "fwd", CUDA_TARGET, 0),
            ("peephole_lstm", 64, "fwd", CUDA_TARGET, 132),
            ("layernorm_lstm", 64, "fwd", CUDA_TARGET, 0), ("lstm", 64, "bwd", CUDA_TARGET, 0),
            ("lstm", 64, "fwd", "host", 0)):
        spec = aot.Spec(cell, I, hidden, direction, target)
        plan = aot._plan(spec, (), False)
        assert plan.layout.loop_rows == rows, (cell, hidden, direction, target)
        assert ("loop_infer" in plan.kinds) == bool(rows) and pipeline.LOOP == ("loop_infer",)
        defines = aot._driver_build(spec, plan, [pipe]).defines()
        assert defines.get("HALSTM_LOOP_ROWS", 0) == rows
    for block_kib, staged in ((227, 3), (99, 2)):     # an H100's; a GPU of 99 KiB a block
        monkeypatch.setattr(machine, "gpu_block_shared_bytes", lambda: block_kib << 10)
        p, notes, target = _cuda_pipe("gru", "loop_infer", I, 96)
        assert any(f"{staged} gate(s) of W_hh in shared memory" in n for n in notes), notes
        text = _lowered(p, target)
        runs = re.findall(r'halide_cuda_run\(cuda\[0\], "\w+", ([^,]+), 1, 1, (\d+), 1, 1, '
                          r'([^,]+),', text)
        assert [(blocks.split(".")[-2:], threads) for blocks, threads, _ in runs] == \
            [(["extent", "1"], "96")], runs        # (blocks: the output's rows)
        shared = eval(runs[0][2].replace("(", "").replace(")", ""))   # e.g. 0 + (n*4)
        assert staged * 96 * 96 * 4 <= shared <= block_kib << 10, (shared, staged)
        # each step reads its staged gates' 96 x 96 weights from shared
        # memory: with every gate there, a unit's row (100 floats) 4
        # weights a load; else the units innermost, a weight a load
        loads = (text.count("ld.shared.v4"), text.count("ld.shared.b32"))
        if staged == 3:
            assert staged * 96 * 100 * 4 <= shared and loads[0] >= staged * 96 // 4, loads
        else:
            assert loads[0] == 0 and loads[1] >= staged * 96, loads
        assert text.count("bar.sync") >= 2 and ".local" not in text
    monkeypatch.setattr(machine, "gpu_block_shared_bytes", lambda: 99 << 10)
    assert aot._plan(aot.Spec("gru", I, 96, "fwd", CUDA_TARGET), (), False).layout.loop_rows == 0
    assert "halide_error_host_is_null" not in text   # (device pointers only, as the driver's)


@pytest.mark.parametrize("cell,hidden", [("gru", 128), ("gru", 37), ("lstm", 116),
                                         ("lstm", 120)])
def test_one_kernel_step_stores_nothing_into_the_staged_weights(cell, hidden, monkeypatch):
    """Halide packs a kernel's shared allocations by their live ranges in
    the order its stages run (FuseGPUThreadLoops' reuse of shared memory,
    halide/Halide#1089), and does not carry the range of one made
    before the step loop (the staged gates of W_hh, read every step)
    around the loop: a step stage produced after the product may be
    placed inside W_hh's rows, and the next step reads them overwritten.
    loop_infer's step stores (its staged xp) must lie past the staged
    gates' bytes."""
    import re
    from halstm import machine
    from halstm.schedules import cuda
    monkeypatch.setattr(machine, "gpu_block_shared_bytes", lambda: 227 << 10)
    p, _, target = _cuda_pipe(cell, "loop_infer", I, hidden)
    G = 4 if cell == "lstm" else 3
    staged, row = cuda.loop_shared_gates(G, hidden), cuda.loop_row_floats(G, hidden) or hidden
    assert staged, (cell, hidden)
    ptx = _lowered(p, target).replace("\0", "")
    ptx = ptx[ptx.index(".entry"):]
    head = re.search(r'%"\d+_for_loop_out\S*?\.s1\.r_loop\S*?\$y', ptx)
    tail = re.search(r'%"\d+_end_for_loop_out\S*?\.s1\.r_loop\S*?\$y', ptx)
    # (each store's address: a thread's offset, then its allocation's start)
    stores = re.findall(r"st\.shared\S*\s+\[([^\]]+)\]", ptx[head.end():tail.start()])
    starts = [re.fullmatch(r"%rd\d+\+(\d+)", s) for s in stores]
    assert stores and all(starts), stores
    assert min(int(m.group(1)) for m in starts) >= staged * hidden * row * 4, (stores, staged, row)


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_one_kernel_step_holds_two_barriers(cell):
    """loop_infer's step loop, in its PTX, holds two barriers whatever the
    cell's gate count: one after the step's staged xp (every gate of a
    unit in one thread loop, its loads all in flight) and one closing the
    step."""
    import re
    p, _, target = _cuda_pipe(cell, "loop_infer", I, 37)
    ptx = _lowered(p, target)
    ptx = ptx[ptx.index(".entry"):]
    # (the loop's name: loop_out.s1.r_loop$y, with Halide's suffix where a
    # process built another pipeline of those names first)
    head = re.search(r'^(\$L\w+):\s*//\s*%"\d+_for_loop_out\S*?\.s1\.r_loop\S*?\$y', ptx, re.M)
    assert head, "no step loop in the PTX"
    body = ptx[head.end():re.search(r"bra\s+" + re.escape(head.group(1)) + ";", ptx).start()]
    assert body.count("bar.sync") == 2, body.count("bar.sync")
