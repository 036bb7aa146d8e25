"""The GEMM backend and precision of a layer (halstm.cublas): how they are
chosen and checked, and what a cuBLAS build is made of. Runs without a GPU
(the GPU side: tests/gpu/test_gpu_cublas.py)."""
import subprocess

import pytest

import halstm
from halstm import aot, cublas, pipeline
from helpers import CUDA_TARGET, H, I


@pytest.fixture
def no_cublas(monkeypatch):
    monkeypatch.setattr(cublas, "library", lambda: None)


@pytest.fixture
def some_cublas(monkeypatch):
    monkeypatch.setattr(cublas, "library", lambda: "libcublas.so.12")


def test_default_gemm_follows_the_target_and_what_is_installed(no_cublas, monkeypatch):
    assert cublas.resolve(False, "fp32", None) == "halide"
    assert cublas.resolve(True, "fp32", None) == "halide"          # no cuBLAS here
    monkeypatch.setattr(cublas, "library", lambda: "libcublas.so.12")
    assert cublas.resolve(True, "fp32", None) == "cublas"
    assert cublas.resolve(True, "fp32", "halide") == "halide"
    assert cublas.resolve(True, "tf32", None) == "cublas"


@pytest.mark.parametrize("target, precision, gemm, needle", [
    ("host", "tf32", None, "precision: 'tf32' runs on CUDA targets only"),
    ("host", "fp32", "cublas", "gemm: 'cublas' needs a CUDA target"),
    (CUDA_TARGET, "tf32", "halide", "gemm: precision 'tf32' needs gemm 'cublas'"),
    (CUDA_TARGET, "fp16", None, "precision: expected one of ('fp32', 'tf32'), got 'fp16'"),
    (CUDA_TARGET, "fp32", "cutlass", "gemm: expected one of ('halide', 'cublas') or None"),
])
def test_bad_precision_or_gemm_names_the_argument(target, precision, gemm, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        aot.Spec("lstm", I, H, "fwd", target, precision=precision, gemm=gemm)
    with pytest.raises(ValueError, match=needle.split(":")[0]):
        halstm.LSTM(I, H, target=target, precision=precision, gemm=gemm)


def test_precision_and_gemm_are_in_the_cache_key(some_cublas):
    keys = {aot.cache_key(aot.Spec("lstm", I, H, "bwd", CUDA_TARGET, precision=p, gemm=g))
            for p, g in (("fp32", "halide"), ("fp32", "cublas"), ("tf32", None))}
    assert len(keys) == 3
    # a default resolves before the key is made: the same library as the explicit value
    assert (aot.cache_key(aot.Spec("lstm", I, H, "bwd", CUDA_TARGET)) ==
            aot.cache_key(aot.Spec("lstm", I, H, "bwd", CUDA_TARGET, gemm="cublas")))


def test_library_is_found_from_the_environment_first(monkeypatch, tmp_path):
    monkeypatch.setenv("HALSTM_CUBLAS", str(tmp_path / "libcublas.so.12"))
    assert cublas.library() == str(tmp_path / "libcublas.so.12")


@pytest.mark.parametrize("cell", ["lstm", "layernorm_lstm"])
def test_vendor_pipelines_leave_the_gemms_to_the_driver(cell):
    """With vendor_gemm the projection is the bias alone and the gradients
    pipeline sums rows only: x, W_ih and h are not its inputs, and dx, dW
    are not its outputs."""
    from halstm import cells
    from halstm.layout import Layout
    c = cells.get(cell)
    proj = pipeline.build(c, "proj", I, H, Layout(vendor_gemm=True))
    assert [q.name() for q in proj.inputs] == ["b_ih"]
    grads = pipeline.build(c, "grads", I, H, Layout(vendor_gemm=True))
    names = [q.name() for q in grads.inputs]
    assert "x" not in names and "hs" not in names and "w_ih" not in names
    outs = [f.name().split("$")[0] for f in grads.outputs]    # (Halide numbers repeated names)
    assert outs == ["db_ih", "db_hh"] + (["dvec"] if c.channels else [])
    full = pipeline.build(c, "grads", I, H, Layout())
    assert [f.name().split("$")[0] for f in full.outputs][:2] == ["dx", "dw_ih"]


def test_a_cublas_build_links_and_says_so(tmp_path):
    """A CUDA library with cuBLAS GEMMs builds and links here (no GPU, no
    CUDA toolkit: cuBLAS is loaded when the library is)."""
    for direction in ("fwd", "bwd"):
        spec = aot.Spec("gru", I, H, direction, CUDA_TARGET, precision="tf32")
        (tmp_path / direction).mkdir()
        m = aot.build(spec, tmp_path / direction)
        assert (m["precision"], m["gemm"]) == ("tf32", "cublas")
        assert m["layout"]["vendor_gemm"] is True
        # the steps' products by cuBLAS from the batch where they reach 2^27
        # multiply-adds, 2^25 in a TF32 backward
        macs = 1 << (27 if direction == "fwd" else 25)
        assert m["layout"]["vendor_step_rows"] == -(-macs // (3 * H * H))
        vendor = {"fwd": ["halstm_step_vendor", "halstm_step_vendor_infer"],
                  "bwd": ["halstm_step_bwd_vendor"]}[direction]
        assert set(vendor) <= set(m["pipelines"])
        assert "halstm_cublas_init" in m["entry_points"]
        assert any("cuBLAS" in n for n in m["schedule_notes"])
        syms = subprocess.run(["nm", "-D", str(tmp_path / direction / m["library"])],
                              capture_output=True, text=True).stdout
        assert " T halstm_cublas_init" in syms


def test_torch_modules_check_the_precision_and_run_cpu_tensors_in_fp32():
    torch = pytest.importorskip("torch")
    import halstm.torch as ht
    with pytest.raises(ValueError, match="precision: expected one of"):
        ht.LSTM(I, H, precision="bf16")
    torch.manual_seed(0)
    ref = torch.nn.LSTM(I, H)
    m = ht.LSTM(I, H, precision="tf32")      # a CUDA mode: CPU tensors compute in fp32
    m.load_state_dict(ref.state_dict())
    x = torch.randn(5, 3, I)
    torch.testing.assert_close(m(x)[0], ref(x)[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("cell", ["lstm", "gru", "layernorm_lstm"])
def test_vendor_steps_allocate_no_device_memory(cell, tmp_path):
    """The steps around a vendor product are captured into CUDA graphs as
    the others are: they may not allocate device memory (test_cuda_nogpu.py).
    (Lowers, needs no GPU.)"""
    import halide as hl
    from halstm import cells, schedules
    target = hl.Target(CUDA_TARGET)
    module = schedules.for_target(target, "cuda")
    layout = module.vendor_layout(module.layout(target), 4, 64)
    for kind in ("step_vendor", "step_vendor_infer", "step_bwd_vendor"):
        p = pipeline.build(cells.get(cell), kind, 13, 64, layout)
        getattr(module, kind)(p, target)
        stmt = tmp_path / f"{kind}.stmt"
        p.pipeline().compile_to_lowered_stmt(str(stmt), [hl.Argument(q) for q in p.inputs],
                                             hl.StmtOutputFormat.Text, target)
        text = stmt.read_text(errors="replace")
        assert "halide_cuda_run" in text, kind
        assert "halide_device_malloc" not in text, f"{kind} allocates device memory"
        names = [q.name() for q in p.inputs]
        assert "wp_hh" not in names and "w_hh" not in names, names
