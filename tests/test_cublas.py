"""The GEMM backend and precision of a layer (halstm.cublas): how they are
chosen and checked, and what a cuBLAS build is made of. Runs without a GPU
(the GPU side: tests/gpu/test_gpu_cublas.py)."""
import subprocess

import numpy as np

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
    assert cublas.resolve(True, "bf16", None) == "cublas"


@pytest.mark.parametrize("target, precision, gemm, needle", [
    ("host", "tf32", None, "precision: 'tf32' runs on CUDA targets only"),
    ("host", "fp32", "cublas", "gemm: 'cublas' needs a CUDA target"),
    (CUDA_TARGET, "tf32", "halide", "gemm: precision 'tf32' needs gemm 'cublas'"),
    (CUDA_TARGET, "bf16", "halide", "gemm: precision 'bf16' needs gemm 'cublas'"),
    (CUDA_TARGET, "fp16", None, "precision: expected one of ('fp32', 'tf32', 'bf16'), "
                                "got 'fp16'"),
    (CUDA_TARGET, "fp32", "cutlass", "gemm: expected one of ('halide', 'cublas') or None"),
])
def test_bad_precision_or_gemm_names_the_argument(target, precision, gemm, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        aot.Spec("lstm", I, H, "fwd", target, precision=precision, gemm=gemm)
    with pytest.raises(ValueError, match=needle.split(":")[0]):
        halstm.LSTM(I, H, target=target, precision=precision, gemm=gemm)


def test_precision_and_gemm_are_in_the_cache_key(some_cublas):
    keys = {aot.cache_key(aot.Spec("lstm", I, H, "bwd", CUDA_TARGET, precision=p, gemm=g))
            for p, g in (("fp32", "halide"), ("fp32", "cublas"), ("tf32", None),
                         ("bf16", None))}
    assert len(keys) == 4
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
    CUDA toolkit: cuBLAS is loaded when the library is); a TF32 forward and
    a bf16 backward."""
    for direction, precision in (("fwd", "tf32"), ("bwd", "bf16")):
        spec = aot.Spec("gru", I, H, direction, CUDA_TARGET, precision=precision)
        (tmp_path / direction).mkdir()
        m = aot.build(spec, tmp_path / direction)
        assert (m["precision"], m["gemm"]) == (precision, "cublas")
        assert m["layout"]["vendor_gemm"] is True
        assert ("halstm_to_bf16" in m["pipelines"]) == (precision == "bf16")
        # the steps' products by cuBLAS from the batch where they reach 2^25
        # multiply-adds in a tensor-core precision (2^24 in fp32)
        macs = 1 << 25
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
    """tf32 is a CUDA mode: CPU tensors compute in fp32 (bf16 on a CPU:
    test_torch.py test_bf16_on_cpu_tensors_runs_where_the_cpu_has_it)."""
    torch = pytest.importorskip("torch")
    import halstm.torch as ht
    with pytest.raises(ValueError, match="precision: expected one of"):
        ht.LSTM(I, H, precision="fp16")
    torch.manual_seed(0)
    ref = torch.nn.LSTM(I, H)
    m = ht.LSTM(I, H, precision="tf32")
    m.load_state_dict(ref.state_dict())
    x = torch.randn(5, 3, I)
    torch.testing.assert_close(m(x)[0], ref(x)[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("cell", ["lstm", "gru", "layernorm_lstm"])
@pytest.mark.parametrize("precision, H", [("fp32", 64), ("bf16", 64), ("fp32", 256)])
def test_vendor_steps_allocate_no_device_memory(cell, precision, H, tmp_path):
    """The steps around a vendor product are captured into CUDA graphs as
    the others are: they may not allocate device memory (test_cuda_nogpu.py).
    In bf16 they also store the product's operand as bf16 bits, in the
    same kernel; at H = 256 in fp32 the forward's sums its product's two
    slices (cuda.step_splits) in that kernel. (Lowers, needs no GPU.)"""
    import dataclasses
    import halide as hl
    from halstm import cells, schedules
    target = hl.Target(CUDA_TARGET)
    module = schedules.for_target(target, "cuda")
    c = cells.get(cell)
    layout = dataclasses.replace(module.vendor_layout(module.layout(target), 4, H, "fwd",
                                                      precision, reduces=c.reduces),
                                 vendor_bf16=precision == "bf16")
    assert layout.vendor_step_splits == (2 if H == 256 else 1)
    for kind in ("step_vendor", "step_vendor_infer", "step_bwd_vendor"):
        p = pipeline.build(c, kind, 13, H, layout)
        split = layout.vendor_step_splits > 1 and kind != "step_bwd_vendor"
        assert "hg" not in [q.name() for q in p.inputs] or \
            p.param("hg").dimensions() == (4 if split else 3), kind
        bits = [b for f in p.outputs for b in f.output_buffers() if b.type() == hl.UInt(16)]
        assert len(bits) == (precision == "bf16"), kind
        getattr(module, kind)(p, target)
        stmt = tmp_path / f"{kind}.stmt"
        p.pipeline().compile_to_lowered_stmt(str(stmt), [hl.Argument(q) for q in p.inputs],
                                             hl.StmtOutputFormat.Text, target)
        text = stmt.read_text(errors="replace")
        assert text.count("halide_cuda_run(") == 1, kind       # one kernel, bits included
        assert "halide_device_malloc" not in text, f"{kind} allocates device memory"
        names = [q.name() for q in p.inputs]
        assert "wp_hh" not in names and "w_hh" not in names, names


@pytest.mark.parametrize("precision, compute", [("fp32", 68), ("tf32", 77), ("bf16", 68)])
def test_the_driver_gets_cublas_compute_type(precision, compute):
    """cuBLAS's cublasComputeType_t values: COMPUTE_32F, COMPUTE_32F_FAST_TF32
    (cublas_api.h); bf16 is COMPUTE_32F on bf16 copies of the operands."""
    from halstm import driver
    from halstm.layout import Layout
    layer = driver.Layer(direction="fwd", states=2, gates=4, saved=4, vectors=0,
                         dxp_is_dhg=False, input_size=I, hidden_size=H, onehot=False,
                         layout=Layout(vendor_gemm=True, vendor_bf16=precision == "bf16"),
                         cuda=True, fused_bwd=False, pack_bwd=False, cublas=True,
                         precision=precision)
    assert layer.defines()["HALSTM_COMPUTE"] == compute
    assert layer.defines().get("HALSTM_BF16", 0) == (precision == "bf16")


def _bf16_nearest(a):
    """The bfloat16 bits nearest each float32 of a (ties to the even one),
    chosen between the two neighbours by their distance (float64); NaN a
    quiet NaN."""
    bits = a.view(np.uint32)
    lo = (bits >> 16).astype(np.uint32)                     # truncated: toward zero
    hi = lo + 1                                             # one bf16 step away from zero

    def as_f(b):   # bf16 bits -> float64; past the largest finite one: +-2^128
        f = (b << 16).astype(np.uint32).view(np.float32).astype(np.float64)
        return np.where(np.isinf(f), np.sign(f) * 2.0 ** 128, f)
    with np.errstate(invalid="ignore", over="ignore"):
        x = a.astype(np.float64)
        d_lo, d_hi = np.abs(x - as_f(lo)), np.abs(as_f(hi) - x)
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (lo % 2 == 1))
    out = np.where(pick_hi, hi, lo)
    out = np.where(np.isinf(a), lo, out)                    # infinities exactly
    return np.where(np.isnan(a), (bits >> 16) | 0x40, out).astype(np.uint16)


def test_to_bf16_rounds_to_nearest_even_and_keeps_nan():
    """pipeline to_bf16 (the bf16 precision's operand copies), run on the
    CPU, against the nearest bfloat16 by distance."""
    import halide as hl
    from halstm import cells
    p = pipeline.build(cells.get("lstm"), "to_bf16", I, H)
    rng = np.random.default_rng(0)
    special = np.array([0.0, -0.0, 1.0, np.inf, -np.inf, np.nan, -np.nan, 3.4e38, -3.4e38,
                        1e-40, 1 + 2 ** -8, 1 + 3 * 2 ** -8, 1 + 2 ** -8 + 2 ** -20],
                       np.float32)
    a = np.concatenate([special, rng.standard_normal(4000).astype(np.float32) * 100,
                        rng.integers(0, 2 ** 32, 4000, dtype=np.uint32).view(np.float32)])
    p.inputs[0].set(hl.Buffer(a))
    got = np.asarray(p.pipeline().realize([a.size]))
    want = _bf16_nearest(a)
    assert np.array_equal(got, want), np.flatnonzero(got != want)[:5]
    assert np.isnan((got[5:7].astype(np.uint32) << 16).view(np.float32)).all()
    assert got[7] == 0x7F80 and got[8] == 0xFF80         # 3.4e38 rounds to infinity


@pytest.mark.parametrize("gates, H, precision, rows", [
    (4, 512, "fp32", 16), (3, 512, "fp32", 22), (1, 512, "fp32", 384), (4, 512, "tf32", 32),
    (3, 512, "bf16", 43), (4, 2048, "fp32", 8), (4, 128, "tf32", 512)])
def test_steps_products_go_to_cublas_from_a_size(gates, H, precision, rows):
    """cuda.vendor_layout: a step's product by cuBLAS from 2^25
    multiply-adds (B*G*H*H) in TF32 and bf16 both ways, from 2^24 in
    fp32 backward and 8 rows (1.5 * 2^26 with one gate; rows: the
    backward's), and forward in fp32 from 2^24
    (2^25 for a cell that reduces over units), where its GEMMs run over 4
    slices of h's units (128 units or more each; one GEMM in TF32 and
    bf16)."""
    import dataclasses
    from halstm.layout import Layout
    from halstm.schedules import cuda
    bwd = cuda.vendor_layout(Layout(), gates, H, "bwd", precision)
    assert bwd.vendor_gemm and bwd.vendor_step_rows == rows and bwd.vendor_step_splits == 1
    for reduces in (False, True):
        macs = 1 << (24 if precision == "fp32" and not reduces else 25)
        fwd = cuda.vendor_layout(Layout(), gates, H, "fwd", precision, reduces=reduces)
        assert fwd == dataclasses.replace(bwd, vendor_step_rows=-(-macs // (gates * H * H)),
                                          vendor_step_splits=4 if H >= 512 and
                                          precision == "fp32" else 1)


@pytest.mark.parametrize("H, splits", [(2048, 4), (512, 4), (300, 2), (257, 1), (256, 2),
                                       (255, 1), (128, 1), (45, 1)])
def test_forward_vendor_products_split_into_slices_of_128_units(H, splits):
    """cuda.step_splits: the most slices, up to 4, that divide H into
    slices of 128 units or more; the step pipeline then reads that many
    partial products."""
    import dataclasses
    from halstm import cells
    from halstm.layout import Layout
    from halstm.schedules import cuda
    assert cuda.step_splits(H) == splits
    lay = dataclasses.replace(Layout(vendor_gemm=True), vendor_step_splits=splits)
    p = pipeline.build(cells.get("lstm"), "step_vendor_infer", 7, H, lay)
    assert p.param("hg").dimensions() == (4 if splits > 1 else 3)
    if splits == 1:
        return
    # run on the CPU (unscheduled): the partial products' sum is the product
    import halide as hl
    rng = np.random.default_rng(H)
    B, G = 3, 4
    xp, b_hh = (rng.standard_normal(s).astype(np.float32) for s in ((B, G, H), (G, H)))
    h, c = (rng.standard_normal((B, H)).astype(np.float32) for _ in range(2))
    parts = rng.standard_normal((splits, B, G, H)).astype(np.float32)
    whole = pipeline.build(cells.get("lstm"), "step_vendor_infer", 7, H, Layout(vendor_gemm=True))

    def run(q, hg):
        for name, a in (("xp", xp), ("hg", hg), ("b_hh", b_hh), ("h_prev", h), ("c_prev", c)):
            q.param(name).set(hl.Buffer(a))
        return [np.asarray(b) for b in q.pipeline().realize([H, B])]
    for got, want in zip(run(p, parts), run(whole, parts.sum(0))):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
