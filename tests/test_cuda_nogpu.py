"""halstm.cuda where no CUDA GPU is usable (CI): clear errors, targets kept
as written, the memory pool's size classes, what the cuda schedule's step
pipelines lower to. tests/gpu covers the GPU."""
import re
import shutil
import subprocess

import pytest

import halstm
from halstm import cuda
from helpers import CUDA_TARGET, assert_cli_error, needs_no_gpu, run_cli


@needs_no_gpu
def test_gpu_module_without_gpu_is_a_clear_error():
    with pytest.raises(cuda.CudaError, match="target 'host-cuda' needs a usable CUDA GPU"):
        halstm.LSTM(4, 8, target="host-cuda")
    assert issubclass(cuda.CudaError, halstm.KernelError)


@needs_no_gpu
def test_bench_on_a_gpu_target_without_gpu_exits_with_one_line():
    r = run_cli("bench", "--target", "host-cuda", "--shapes", "small_128_b16", "--peers", "",
                ok=False)
    assert_cli_error(r, "needs a usable CUDA GPU", code=1)


@needs_no_gpu
def test_host_cuda_is_kept_as_written_without_gpu():
    assert cuda.host_target("host-cuda") == "host-cuda"


def test_explicit_or_cpu_targets_are_never_changed():
    for t in ("host", CUDA_TARGET, "x86-64-linux-cuda", "arm-64-linux"):
        assert cuda.host_target(t) == t


def test_pool_size_classes():
    size = cuda._Pool.size
    assert size(1) == size(512) == 512 and size(513) == 1024
    assert size(1 << 20) == 1 << 20 and size((1 << 20) + 1) == 2 << 20
    assert size(5 << 20) == 6 << 20


def test_a_lane_takes_only_blocks_freed_before_its_wavefront():
    """A wavefront's lanes waited for the legacy stream's work queued
    before it began, so an allocation inside a lane takes only a block
    freed before then (another thread's later free may still be in use
    on the legacy stream); the lowest address first otherwise."""
    pool = cuda._Pool()
    pool.give(0x3000, 512)
    epoch = pool.next_epoch()           # a wavefront begins
    pool.give(0x1000, 512)              # freed after it began
    pool.give(0x2000, 512)
    assert pool.take(512, before=epoch) == 0x3000
    assert pool.take(512) == 0x1000 and pool.take(512) == 0x2000


@pytest.mark.parametrize("cell", ["lstm", "gru"])
@pytest.mark.parametrize("H", [37, 128, 512])
def test_cuda_step_pipelines_allocate_no_device_memory(cell, H, tmp_path):
    """The cuda schedule's per-step pipelines keep every stage in registers
    or shared memory at every size (the libraries built with it capture
    their time loops into CUDA graphs: test_schedules.py), so a graph
    (driver.cpp) bakes in only the caller's pointers, never one of Halide's
    allocations; nor does the one-kernel forward of small sizes (loop_infer,
    which a caller's graph may capture). (Lowers, needs no GPU.)"""
    import halide as hl
    from halstm import cells, pipeline, schedules
    target = hl.Target(CUDA_TARGET)
    module = schedules.for_target(target, "cuda")
    layout = module.layout(target)
    for kind in ("step", "step_bwd", "step_bwd_fused") + (("loop_infer",) if H < 64 else ()):
        p = pipeline.build(cells.get(cell), kind, 13, H, layout)
        getattr(module, kind)(p, target)
        stmt = tmp_path / f"{kind}.stmt"
        p.pipeline().compile_to_lowered_stmt(str(stmt), [hl.Argument(q) for q in p.inputs],
                                             hl.StmtOutputFormat.Text, target)
        text = stmt.read_text(errors="replace")
        assert "halide_cuda_run" in text or "gpu_block" in text, "no GPU kernel in " + kind
        assert "halide_device_malloc" not in text, f"{kind} allocates device memory"


def _one_pass_norm_cell(x, r, s):
    """An LSTM with its recurrent products normalized by a one-pass layer
    norm (variance = mean of squares - squared mean)."""
    from halstm.cells.language import mean, sigmoid, sqrt, tanh
    gates = [r[g] for g in "ifgo"]
    m = mean(*gates)
    scale = sqrt(mean(*[v * v for v in gates]) - m * m + 1e-5)
    i, f, g, o = ((x[k] + (v - m) / scale) for k, v in zip("ifgo", gates))
    c = sigmoid(f) * s.c + sigmoid(i) * tanh(g)
    return {"h": sigmoid(o) * tanh(c), "c": c}


def test_cuda_backward_of_sums_of_negated_terms(tmp_path):
    """A backward sum over units whose terms are all negated (the one-pass
    norm's mean adjoint) is lowered as the negation of a plain sum, which
    the cuda schedule's rfactor can prove associative (Halide rejects
    f + (0 - a) + (0 - b)); sums that read only saved row values wait for
    no other sum: one level of sums forward and backward. (Lowers, needs
    no GPU.)"""
    import halide as hl
    from halstm import pipeline, schedules
    from halstm.cells.language import define
    from halstm.cells.lowering import DefinedCell
    cell = DefinedCell(define("one_pass_norm", gates="ifgo", states="hc",
                              step=_one_pass_norm_cell))
    target = hl.Target(CUDA_TARGET)
    module = schedules.for_target(target, "cuda")
    levels = {}
    for kind in ("step", "step_bwd"):
        p = pipeline.build(cell, kind, 13, 64, module.layout(target))
        getattr(module, kind)(p, target)
        levels[kind] = [len(g) for g in p.reduction_groups]
        p.pipeline().compile_to_lowered_stmt(str(tmp_path / f"{kind}.stmt"),
                                             [hl.Argument(q) for q in p.inputs],
                                             hl.StmtOutputFormat.Text, target)
    assert levels == {"step": [2], "step_bwd": [2]}


def test_cuda_forward_library_has_narrow_steps(tmp_path):
    """A CUDA LSTM's forward library at H = 256 has the narrow steps
    (pipeline.NARROW) for up to 4 rows on a GPU of 132 SMs (the count
    assumed without a GPU) and its driver links with them; the backward
    has none. (Builds, needs no GPU; tests/gpu runs them.)"""
    import json
    from halstm import machine
    run_cli("compile", "-i", 13, "-H", 256, "--target", CUDA_TARGET, "--out", tmp_path / "l")
    (fwd,) = (tmp_path / "l").glob("fwd_*")
    (bwd,) = (tmp_path / "l").glob("bwd_*")
    m, mb = (json.loads((f / "manifest.json").read_text()) for f in (fwd, bwd))
    assert {"halstm_step_narrow", "halstm_step_narrow_infer"} <= set(m["pipelines"])
    assert m["layout"]["narrow_rows"] == machine.gpu_sms() // 32
    assert mb["layout"]["narrow_rows"] == 0
    assert not any("narrow" in k for k in mb["pipelines"])
    assert m["library"] and (fwd / m["library"]).is_file()
    # Halide's runtime finds libcuda's entry points through the driver's own
    # halide_cuda_get_symbol (a defined symbol, not the runtime's weak
    # default): its cuLaunchKernel opts kernels in to more than 48 KiB of
    # shared memory (cuda.loop_infer)
    if shutil.which("nm"):
        symbols = subprocess.run(["nm", "-D", str(fwd / m["library"])], capture_output=True,
                                 text=True, check=True).stdout
        assert re.search(r" T halide_cuda_get_symbol$", symbols, re.M), \
            [line for line in symbols.splitlines() if "get_symbol" in line]


def test_cuda_library_of_a_reducing_cell_has_folded_steps(tmp_path):
    """A CUDA layer-norm LSTM's libraries have the folded steps
    (pipeline.FOLD_FWD, FOLD_BWD) and their drivers link with them.
    (Builds, needs no GPU; tests/gpu runs them.)"""
    import json
    run_cli("compile", "--cell", "layernorm_lstm", "-i", 13, "-H", 40, "--target", CUDA_TARGET,
            "--out", tmp_path / "ln")
    (fwd,) = (tmp_path / "ln").glob("fwd_*")
    (bwd,) = (tmp_path / "ln").glob("bwd_*")
    m = json.loads((fwd / "manifest.json").read_text())
    assert {"halstm_step_product", "halstm_step_fold", "halstm_step_fold_infer"} <= \
        set(m["pipelines"])
    assert any(a.startswith("ws x_rows") and "halstm_step_fold" in a
               for a in m["entry_points"]["halstm_forward"])
    mb = json.loads((bwd / "manifest.json").read_text())
    assert "halstm_step_bwd_fold" in mb["pipelines"] and "halstm_step_bwd" in mb["pipelines"]
    # (a host-cuda target links here: the drivers compiled and found them)
    for folder, manifest in ((fwd, m), (bwd, mb)):
        assert manifest["library"] and (folder / manifest["library"]).is_file()
        assert manifest["layout"]["fold_steps"] is True
