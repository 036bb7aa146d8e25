"""precision "bf16" on a CPU with AMX or AVX512-BF16: the products of the
forward (projection and steps) and of the backward (steps, dx and weight
gradients) on AMX tiles or as vdpbf16ps dot products, bf16 operands,
float32 sums, cell and states.

Checked against halstm.reference's step with the same operands rounded to
bf16 (reference.round_bf16; float64 sums). After the first step the
kernel's h and the reference's differ by float32 rounding, so an h near a
bf16 halfway point may round the other way in one of them: one step and
one layer are held to 2e-5, longer runs to 5e-4 and to a fifth of their
distance from the unrounded float32 result. The tests of errors and of
the lowered code run everywhere; the rest only on a CPU with AMX or
AVX512-BF16 (AMX tiles on Intel Sapphire Rapids and later, dot products on
AMD Zen 4 and Zen 5)."""
import re

import numpy as np
import pytest

import halstm
from halstm import reference
from halstm.errors import CompileError
from halstm.schedules import amx
from helpers import assert_close, needs_bf16

I, H = 37, 45      # odd sizes: a reduction past whole 32-chunks, units past whole panels
NO_BF16 = "x86-64-linux-avx-avx2-f16c-fma-sse41"


def _lstm(xg, hg, s):
    a = xg + hg
    n = a.shape[1] // 4
    i, f = reference._sigmoid(a[:, :n]), reference._sigmoid(a[:, n:2 * n])
    g, o = np.tanh(a[:, 2 * n:3 * n]), reference._sigmoid(a[:, 3 * n:])
    c = f * s[1] + i * g
    return o * np.tanh(c), c


def _gru(xg, hg, s):
    n = xg.shape[1] // 3
    r = reference._sigmoid(xg[:, :n] + hg[:, :n])
    z = reference._sigmoid(xg[:, n:2 * n] + hg[:, n:2 * n])
    cand = np.tanh(xg[:, 2 * n:] + r * hg[:, 2 * n:])
    return ((1 - z) * cand + z * s[0],)


def _rnn_tanh(xg, hg, s):
    return (np.tanh(xg + hg),)


STEPS = {"lstm": _lstm, "gru": _gru, "rnn_tanh": _rnn_tanh}


def _run(m, cell, T, B, seed=0):
    """m's output and the reference's with bf16 operands and without:
    (y, y_bf16_reference, y_fp32_reference)."""
    rng = np.random.default_rng(seed)
    L = m.num_layers
    x = rng.standard_normal((T, B, I)).astype(np.float32)
    hx = [0.5 * rng.standard_normal((L, B, H)).astype(np.float32) for _ in m._state_names]
    y, _ = m(x, tuple(hx) if len(hx) > 1 else hx[0])
    p64 = {k: np.asarray(v, np.float64) for k, v in m.state_dict().items()}
    f64 = lambda a: np.asarray(a, np.float64)   # noqa: E731
    args = (STEPS[cell], p64, f64(x), [f64(a) for a in hx])
    want, _ = reference.step_forward(*args, operand=reference.round_bf16)
    plain, _ = reference.step_forward(*args)
    return y, want, plain


def _rel(a, b):
    return float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())


@pytest.fixture(scope="module")
def lstm1():
    return halstm.LSTM(I, H, seed=0, precision="bf16")


@needs_bf16
@pytest.mark.parametrize("cell", ["lstm", "gru", "rnn_tanh"])
# B = 1: step_narrow (up to amx.NARROW_ROWS rows); 4: one tile of rows (an
# AMX tile of 16, or a register tile); 17: two or more, the last ragged
@pytest.mark.parametrize("B", [1, 4, 17])
def test_bf16_step_equals_the_reference_with_bf16_operands(cell, B):
    m = halstm.Recurrent(cell, I, H, seed=0, precision="bf16")
    y, want, plain = _run(m, cell, T=1, B=B)
    assert_close("y", y, want, rtol=2e-5)
    assert _rel(y, plain) > 5e-4      # (the products did round their operands)


@needs_bf16
@pytest.mark.parametrize("cell", ["lstm", "gru", "rnn_tanh"])
def test_bf16_layers_over_time_follow_the_reference(cell):
    m = halstm.Recurrent(cell, I, H, num_layers=2, seed=0, precision="bf16")
    y, want, plain = _run(m, cell, T=5, B=20, seed=1)
    err = _rel(y, want)
    assert err < 5e-4 and err < _rel(y, plain) / 5, (err, _rel(y, plain))


@needs_bf16
def test_bf16_one_hot_indices_equal_one_hot_rows(lstm1):
    ids = np.random.default_rng(2).integers(0, I, (6, 5)).astype(np.int32)
    y_ids, _ = lstm1(ids)                                   # the gather of W_ih's columns
    y_rows, _ = lstm1(np.eye(I, dtype=np.float32)[ids])     # the bf16 projection
    assert_close("y", y_ids, y_rows, rtol=1e-6)


@needs_bf16
def test_bf16_nan_stays_nan_in_its_row(lstm1):
    x = np.random.default_rng(3).standard_normal((3, 4, I)).astype(np.float32)
    x[1, 2, 5] = np.nan
    with halstm.no_grad():
        y, _ = lstm1(x)
    assert np.isnan(y[1:, 2]).all() and not np.isnan(y[0]).any()
    assert not np.isnan(np.delete(y, 2, axis=1)).any()


def _lstm_step_gradients(x, h0, c0, p, dy, operand, dh_operand=None):
    """One LSTM step's gradients (float64) with operand() applied to the
    products' operands: the forward's (x, h0, W_ih, W_hh), and the
    backward's (the gate gradients da, x, h0, W_ih), and dh_operand (default
    operand) to dh0's (da, W_hh)."""
    dh_operand = dh_operand or operand
    f32 = lambda a: np.asarray(a, np.float32)   # noqa: E731
    w_ih, w_hh = p["weight_ih_l0"], p["weight_hh_l0"]
    a = (operand(f32(x)) @ operand(f32(w_ih)).T + operand(f32(h0)) @ operand(f32(w_hh)).T
         + p["bias_ih_l0"] + p["bias_hh_l0"])
    n = a.shape[1] // 4
    i, f = reference._sigmoid(a[:, :n]), reference._sigmoid(a[:, n:2 * n])
    g, o = np.tanh(a[:, 2 * n:3 * n]), reference._sigmoid(a[:, 3 * n:])
    c = f * c0 + i * g
    tc = np.tanh(c)
    dc = dy * o * (1 - tc * tc)
    da = np.concatenate([dc * g * i * (1 - i), dc * c0 * f * (1 - f), dc * i * (1 - g * g),
                         dy * tc * o * (1 - o)], axis=1)                   # (B, 4H)
    dar = operand(f32(da))
    return {"weight_ih_l0": dar.T @ operand(f32(x)), "weight_hh_l0": dar.T @ operand(f32(h0)),
            "bias_ih_l0": da.sum(0), "bias_hh_l0": da.sum(0),
            "input": dar @ operand(f32(w_ih)), "h0": dh_operand(f32(da)) @ dh_operand(f32(w_hh)), "c0": dc * f}


@needs_bf16
@pytest.mark.parametrize("B", [2, 17])
def test_bf16_backward_equals_the_reference_with_bf16_operands(B):
    """The backward's products in bf16 (dx, the weight gradients and, with
    more than amx.NARROW_ROWS rows, the step's dh = W_hh^T da; B = 2 runs
    the float32 step): one step, B = 17 (tiles of rows, the last ragged)
    and 2, against the float64
    gradients with every product's operands rounded to bf16 as the kernels
    round them. The kernel rounds its own float32 gate gradients, and one
    that lies at a bf16 halfway point may round the other way than the
    reference's: the products are held to 5e-4 and to a fifth of their
    distance from the unrounded gradients (so a backward that did not
    round fails), the rest to 2e-5."""
    rng = np.random.default_rng(5)
    m = halstm.LSTM(I, H, seed=0, precision="bf16")
    x = rng.standard_normal((1, B, I)).astype(np.float32)
    h0, c0 = (0.5 * rng.standard_normal((1, B, H)).astype(np.float32) for _ in range(2))
    dy = rng.standard_normal((1, B, H)).astype(np.float32)
    m(x, (h0, c0))
    got = m.backward(dy)
    p = {k: np.asarray(v, np.float64) for k, v in m.state_dict().items()}
    args = (x[0], h0[0], c0[0], p, dy[0].astype(np.float64))
    f64 = lambda a: np.asarray(a, np.float64)   # noqa: E731
    bf16_step = B > amx.NARROW_ROWS            # (else dh0 from the float32 step)
    want = _lstm_step_gradients(*args, operand=reference.round_bf16,
                                dh_operand=None if bf16_step else f64)
    plain = _lstm_step_gradients(*args, operand=f64)
    rounded = ("weight_ih_l0", "weight_hh_l0", "input") + (("h0",) if bf16_step else ())
    for k, w in want.items():
        g = np.asarray(got[k]).reshape(w.shape)
        err = _rel(g, w)
        if k in rounded:
            assert err < 5e-4 and err < _rel(g, plain[k]) / 5, (k, err, _rel(g, plain[k]))
        else:
            assert err < 2e-5, (k, err)


@needs_bf16
@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_bf16_trains_close_to_fp32(cell):
    """Forward and backward products in bf16, two layers: the gradients are
    the float32 layers' to bf16's accuracy (the GRU's gate gradients of
    the input and of h differ: two operands of the weight gradients)."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((4, 19, I)).astype(np.float32)
    dy = rng.standard_normal((4, 19, H)).astype(np.float32)
    grads = {}
    for precision in ("bf16", "fp32"):
        m = halstm.Recurrent(cell, I, H, num_layers=2, seed=0, precision=precision)
        m(x)
        grads[precision] = m.backward(dy)
    assert set(grads["bf16"]) == set(grads["fp32"])
    for k, g in grads["bf16"].items():
        assert np.isfinite(g).all(), k
        assert _rel(g, grads["fp32"][k]) < 3e-2, k


@needs_bf16
def test_bf16_on_a_cpu_refuses_cells_that_reduce_over_units():
    with pytest.raises(CompileError, match="cells that reduce over units"):
        halstm.Recurrent("layernorm_lstm", I, H, precision="bf16").compile(backward=False)


def test_bf16_on_a_cpu_without_avx512_bf16_is_a_clear_error():
    with pytest.raises(CompileError, match="needs AVX512-BF16 or Intel AMX"):
        halstm.LSTM(I, H, target=NO_BF16, precision="bf16").compile(backward=False)


def test_tf32_stays_a_cuda_mode():
    with pytest.raises(ValueError, match="precision: 'tf32' runs on CUDA targets only"):
        halstm.LSTM(I, H, precision="tf32")



@needs_bf16
def test_bf16_weight_gradients_in_chunks_of_rows_sum_every_chunk(monkeypatch):
    """The weight gradients' sums over the rows in chunks (cpu.bf16_layout:
    at most as many rows as the L2's size gives): with an L2 of 64 KiB, at
    most 352 rows, so T*B = 800 rows are three chunks of 288, the last
    ragged; the gradients equal those of one chunk (another library) up to
    the sums' order."""
    rng = np.random.default_rng(6)
    x = rng.standard_normal((20, 40, I)).astype(np.float32)
    dy = rng.standard_normal((20, 40, H)).astype(np.float32)
    grads = []
    for l2 in (None, 64 << 10):
        if l2:
            monkeypatch.setattr(halstm.machine, "l2_bytes", lambda: l2)
        m = halstm.LSTM(I, H, seed=0, precision="bf16")
        m(x)
        grads.append(m.backward(dy))
    assert cpu_amx_rows(64 << 10) == 352
    for k in ("weight_ih_l0", "weight_hh_l0"):
        assert _rel(grads[1][k], np.asarray(grads[0][k], np.float64)) < 1e-5, k


def cpu_amx_rows(l2: int) -> int:
    """The chunk rows cpu.bf16_layout gives a backward of I, H with that L2."""
    from unittest import mock
    import halide as hl
    from halstm.schedules import cpu
    with mock.patch.object(halstm.machine, "l2_bytes", lambda: l2):
        target = hl.get_host_target()
        layout = cpu.bf16_layout(cpu.layout(target), "bwd", I, H, target)
    return layout.bf16_dw_rows


AMX_TARGET = ("x86-64-linux-avx-avx2-avx512-avx512_cannonlake-avx512_sapphirerapids-"
              "avx512_skylake-f16c-fma-sse41")


@pytest.mark.parametrize("cell,kind,products", [
    ("lstm", "grads", {"dx", "dw_ih", "dw_hh"}), ("gru", "grads", {"dx", "dw_ih", "dw_hh"}),
    ("lstm", "grads_ids", {"dw_hh"}), ("gru", "step_bwd_bf16", {"dh"})])
def test_bf16_backward_products_lower_to_amx_tiles(cell, kind, products, tmp_path):
    """The pipelines of a bf16 backward (compiled for an AMX target on any
    machine): dx and both weight gradients are AMX tile products (one hot:
    no dx, dW_ih a scatter-add), and so is the step's dh = W_hh^T dhg."""
    import halide as hl
    from halstm import cells, pipeline
    from halstm.schedules import cpu
    target = hl.Target(AMX_TARGET)
    layout = cpu.bf16_layout(cpu.layout(target), "bwd", I, H, target)
    p = pipeline.build(cells.get(cell), kind, I, H, layout)
    getattr(cpu, kind)(p, target)
    path = tmp_path / "k.stmt"
    p.pipeline().compile_to({hl.OutputFileType.stmt: str(path)}, [hl.Argument(q) for q in p.inputs],
                            "k", target.with_feature(hl.TargetFeature.NoRuntime))
    stmt = path.read_text()
    # (a second pipeline built in this process has its Funcs named name$1)
    amx = set(re.findall(r"allocate (\w+)_bf16sum(?:\$\d+)?\.amx\[float32x256 \* 1\] in AMXTile",
                         stmt))
    assert amx == products
    assert "tile_matmul" in stmt


ZEN4_TARGET = ("x86-64-linux-avx-avx2-avx512-avx512_cannonlake-avx512_skylake-avx512_zen4-"
               "f16c-fma-sse41")


@pytest.mark.parametrize("cell,kind,direction", [
    ("lstm", "proj", "fwd"), ("gru", "step", "fwd"), ("rnn_tanh", "step", "fwd"),
    ("rnn_tanh", "proj", "fwd"), ("lstm", "step_narrow", "fwd"),
    ("gru", "step_bwd_bf16", "bwd"), ("lstm", "grads", "bwd"), ("gru", "grads_ids", "bwd")])
def test_bf16_products_without_amx_are_dot_products(cell, kind, direction, tmp_path):
    """Without AMX (compiled for a Zen 4 target on any machine) every
    product of bf16 operands is vdpbf16ps dot products, loaded whole: no
    element-wise gathers (vpinsrw) of its operands."""
    import halide as hl
    from halstm import cells, pipeline
    from halstm.schedules import cpu
    target = hl.Target(ZEN4_TARGET)
    layout = cpu.bf16_layout(cpu.layout(target), direction, I, H, target)
    assert layout.cpu_bf16 and not layout.amx_tiles
    p = pipeline.build(cells.get(cell), kind, I, H, layout)
    getattr(cpu, kind)(p, target)
    path = tmp_path / "k.s"
    p.pipeline().compile_to({hl.OutputFileType.assembly: str(path)},
                            [hl.Argument(q) for q in p.inputs], "k",
                            target.with_feature(hl.TargetFeature.NoRuntime))
    # the assembly's functions: their names and bodies
    functions = dict(re.findall(r"\n(\w+):[^\n]*\n(.*?)\n\t\.size", path.read_text(), re.S))
    products = {name: body for name, body in functions.items() if "vdpbf16ps" in body}
    assert products, sorted(functions)
    for name, body in products.items():
        assert "vpinsrw" not in body, name


@pytest.mark.parametrize("target,where", [
    (AMX_TARGET, "on AMX tiles"), (ZEN4_TARGET, "as AVX512-BF16 dot products"), (NO_BF16, None)])
def test_where_cpu_bf16_runs_follows_the_target(target, where):
    import halide as hl
    from halstm import bf16
    assert bf16.cpu_products(hl.Target(target)) == where


def test_the_bf16_gather_compiles_without_emulated_conversions(tmp_path, capfd):
    """The one-hot gather reads W_ih's bf16 panels as float32 by their bits:
    Halide warns of no emulated bfloat16 operation (as it did for hl.f32)."""
    import halide as hl
    from halstm import cells, pipeline
    from halstm.schedules import cpu
    target = hl.Target(ZEN4_TARGET)
    layout = cpu.bf16_layout(cpu.layout(target), "fwd", I, H, target)
    p = pipeline.build(cells.get("lstm"), "gather", I, H, layout)
    cpu.gather(p, target)
    p.pipeline().compile_to({hl.OutputFileType.assembly: str(tmp_path / "k.s")},
                            [hl.Argument(q) for q in p.inputs], "k",
                            target.with_feature(hl.TargetFeature.NoRuntime))
    out, err = capfd.readouterr()             # (Halide's Python bindings warn on stdout)
    assert "emulated" not in out + err
