"""The vendor-GEMM path (halstm.cublas): the projection and the gradient
GEMMs by cuBLAS, in fp32, TF32 and bf16, against the reference and against
Halide's own GEMMs."""
import ctypes

import numpy as np
import pytest

from halstm import cublas
from helpers import B, H, I, T, call, backward, check_case, make, record_wavefronts

pytestmark = pytest.mark.skipif(cublas.library() is None, reason="cuBLAS is not installed")

# Relative error a reduced precision allows, of max|want|. TF32 keeps 10
# mantissa bits: products good to about 1e-3 relative; sums over K = 13 to
# 37 terms and 7 steps stay within 1e-2. bf16 keeps 7: 8x that.
RTOL = {"fp32": 1e-4, "tf32": 1e-2, "bf16": 8e-2}


@pytest.mark.parametrize("case", ["base", "T1", "B1", "L3", "hx_and_dstate", "no_bias"])
@pytest.mark.parametrize("cell", ["lstm", "gru"])
@pytest.mark.parametrize("gemm", ["halide", "cublas"])
def test_gemm_backends_match_reference(gemm, cell, case, gpu_target):
    m = check_case(cell, case, target=gpu_target, schedule="cuda", gemm=gemm)
    assert m.gemm == gemm


@pytest.mark.parametrize("case", ["base", "T1", "B1"])
@pytest.mark.parametrize("cell", ["lstm", "gru"])
@pytest.mark.parametrize("precision", ["tf32", "bf16"])
def test_reduced_precision_matches_reference_to_its_precision(precision, cell, case,
                                                              gpu_target):
    m = check_case(cell, case, target=gpu_target, schedule="cuda", precision=precision,
                   rtol=RTOL[precision])
    assert m.gemm == "cublas" and m.precision == precision


@pytest.mark.parametrize("case", ["base", "L3", "hx_and_dstate"])
@pytest.mark.parametrize("cell", ["lstm", "gru"])
@pytest.mark.parametrize("precision", ["tf32", "bf16"])
def test_reduced_precision_wavefront_matches_reference(precision, cell, case, gpu_target,
                                                       monkeypatch):
    """A stack in TF32 or bf16 as a wavefront of 3 chunks (halstm.wavefront)."""
    monkeypatch.setenv("HALSTM_WAVEFRONT_CHUNKS", "3")
    seen = record_wavefronts(monkeypatch)
    check_case(cell, case, target=gpu_target, schedule="cuda", precision=precision,
               rtol=RTOL[precision])
    assert seen["forward"] and set(seen["forward"]) == {3}


def test_reduced_precisions_round_as_they_say(gpu_target):
    """TF32 and bf16 round the GEMMs' operands: the outputs differ from
    fp32 cuBLAS's (so the mode is on), by less than their RTOL, and bf16's
    (7 mantissa bits) by more than TF32's (10): the bf16 copies are used."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((T, B, I)).astype(np.float32)
    out = {}
    for p in ("fp32", "tf32", "bf16"):
        m = make("lstm", target=gpu_target, precision=p, gemm="cublas")
        y, _ = call(m, "lstm", x)
        y = np.asarray(y)
        out[p] = (y, np.asarray(backward(m, "lstm", np.ones_like(y))["weight_ih_l0"]))
    err = {p: [np.abs(a - b).max() / np.abs(b).max() for a, b in zip(out[p], out["fp32"])]
           for p in ("tf32", "bf16")}
    for p, errs in err.items():
        assert all(0 < e < RTOL[p] for e in errs), (p, errs)
    assert all(b > 2 * t for t, b in zip(err["tf32"], err["bf16"])), err


@pytest.mark.parametrize("precision", ["tf32", "bf16"])
def test_torch_module_in_reduced_precision(precision, gpu_target):
    torch = pytest.importorskip("torch")
    import halstm.torch as ht
    rtol = RTOL[precision]
    torch.manual_seed(0)
    ref = torch.nn.LSTM(I, H, num_layers=2)
    m = ht.LSTM(I, H, num_layers=2, precision=precision)
    m.load_state_dict(ref.state_dict())
    x = torch.randn(T, B, I)
    want, _ = ref(x)
    want.sum().backward()
    m = m.cuda()
    xc = x.cuda().requires_grad_()
    got, _ = m(xc)
    got.sum().backward()
    scale = want.abs().max().item()
    assert (got.detach().cpu() - want.detach()).abs().max().item() < rtol * scale
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        err = (p.grad.cpu() - q.grad).abs().max().item() / q.grad.abs().max().item()
        assert err < rtol, name
    # on CPU tensors the module computes in fp32, or in bf16 where this CPU
    # runs it (AMX or AVX512-BF16)
    m = m.cpu()
    got, _ = m(x)
    if precision == "bf16" and ht.kernels._cpu_runs_bf16("lstm"):
        assert (got.detach() - want.detach()).abs().max().item() < rtol * scale
    else:
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-5)


def test_the_library_says_where_cublas_is_missing(gpu_target, monkeypatch, tmp_path):
    import halstm
    monkeypatch.setenv("HALSTM_CUBLAS", str(tmp_path / "libcublas_missing.so"))
    # sizes no other test loads: a library already loaded keeps its cuBLAS
    m = halstm.LSTM(3, 5, target=gpu_target, precision="tf32")
    with pytest.raises(Exception, match="cuBLAS: cannot load"):
        m(np.ones((2, 1, 3), np.float32))


# Sizes no other test loads: HALSTM_VENDOR_STEP_ROWS is read when a library
# is first loaded in a process.
VENDOR_SIZES = {("lstm", "fp32"): (19, 45), ("lstm", "tf32"): (21, 47),
                ("gru", "fp32"): (23, 49), ("gru", "tf32"): (25, 51),
                ("layernorm_lstm", "fp32"): (27, 64), ("layernorm_lstm", "tf32"): (29, 96),
                ("lstm", "bf16"): (33, 55), ("gru", "bf16"): (35, 57),
                ("layernorm_lstm", "bf16"): (37, 80),
                # cells of 3 and 1 gate blocks (whose backward keeps 1.5 * 2^26 untested
                # below it: cuda.VENDOR_STEP_BWD_GATES)
                ("cifg_lstm", "fp32"): (43, 67), ("rnn_tanh", "fp32"): (45, 69)}


@pytest.mark.parametrize("cell, precision", list(VENDOR_SIZES))
def test_steps_with_vendor_products_match_the_cpu(cell, precision, gpu_target, monkeypatch):
    """Every step's recurrent product by cuBLAS (forward h W_hh^T into hg,
    backward dhg W_hh added to dh_prev), at a batch past the threshold,
    against the same layer on the CPU; three times: run directly, captured
    into CUDA graphs, replayed."""
    monkeypatch.setenv("HALSTM_VENDOR_STEP_ROWS", "4")
    _two_layers_match_the_cpu(cell, *VENDOR_SIZES[cell, precision], 6, precision, gpu_target)


@pytest.mark.parametrize("cell, K, H", [("lstm", 41, 256), ("gru", 43, 384), ("lstm", 45, 512)])
def test_steps_with_split_vendor_products_match_the_cpu(cell, K, H, gpu_target, monkeypatch):
    """The fp32 forward's vendor products in 2, 3 and 4 slices of h's
    units (cuda.step_splits), summed by the steps, as the vendor steps'
    test."""
    from halstm.schedules import cuda
    assert cuda.step_splits(H) == {256: 2, 384: 3, 512: 4}[H]
    monkeypatch.setenv("HALSTM_VENDOR_STEP_ROWS", "4")
    _two_layers_match_the_cpu(cell, K, H, 6, "fp32", gpu_target)


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
def test_folded_steps_match_the_cpu(precision, gpu_target):
    """A layer-norm LSTM at a batch whose steps fold (a step's blocks fit
    the GPU: pipeline.FOLD_FWD, FOLD_BWD) in each precision, with and
    without the tape, as the vendor steps' test."""
    # (sizes no other test loads)
    _two_layers_match_the_cpu("layernorm_lstm", 39, 70, 3, precision, gpu_target, infer=True)


def _two_layers_match_the_cpu(cell, K, Hs, B, precision, gpu_target, infer=False):
    """Two layers of `cell` (K inputs, Hs units) at batch B on the GPU in
    `precision` against the same layers on the CPU, forward (infer: also
    without the tape) and every gradient, three times: run directly,
    captured into CUDA graphs, replayed."""
    import halstm
    from helpers import assert_close
    cpu = halstm.Recurrent(cell, K, Hs, num_layers=2, seed=3)
    gpu = halstm.Recurrent(cell, K, Hs, num_layers=2, target=gpu_target, precision=precision)
    gpu.load_state_dict(cpu.state_dict())
    rng = np.random.default_rng(1)
    x = rng.standard_normal((9, B, K)).astype(np.float32)
    dy = rng.standard_normal((9, B, Hs)).astype(np.float32)
    want_y, _ = cpu(x)
    want = cpu.backward(dy)
    rtol = RTOL[precision]
    for _ in range(3):
        if infer:
            with halstm.no_grad():
                y, _ = gpu(x)
            assert_close("y without the tape", np.asarray(y), want_y, rtol)
        y, _ = gpu(x)
        got = gpu.backward(dy)
        assert_close("y", np.asarray(y), want_y, rtol)
        for k, g in want.items():
            assert_close(k, np.asarray(got[k]), g, rtol)


def test_directions_side_by_side_keep_their_own_products(gpu_target, monkeypatch):
    """A bidirectional halstm.torch layer runs its two directions on two
    streams at once, through one library: each stream has its own cuBLAS
    workspace and step products (a shared one would mix them up)."""
    torch = pytest.importorskip("torch")
    import halstm.torch as ht
    monkeypatch.setenv("HALSTM_VENDOR_STEP_ROWS", "4")
    K, Hs = 31, 53                       # (sizes no other test loads)
    torch.manual_seed(0)
    m = ht.LSTM(K, Hs, num_layers=2, bidirectional=True)
    x = torch.randn(12, 8, K)
    want, _ = m(x)
    want.sum().backward()
    want_grads = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    m = m.cuda()
    for _ in range(3):                   # direct, captured, replayed
        m.zero_grad()
        got, _ = m(x.cuda())
        got.sum().backward()
        torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-5)
        for p, g in zip(m.parameters(), want_grads):
            torch.testing.assert_close(p.grad.cpu(), g, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_threads_calling_one_library_at_once(precision, gpu_target, monkeypatch):
    """Four threads run layers of one library at once (the GIL is released
    in the kernels' calls), two on torch's default stream and two on
    streams of their own, with the steps' products and the operands' bf16
    copies by cuBLAS: each thread keeps its stream, its graph capture and
    its buffers, and gets the outputs and gradients it gets alone, bit for
    bit."""
    import threading
    torch = pytest.importorskip("torch")
    import halstm.torch as ht
    monkeypatch.setenv("HALSTM_VENDOR_STEP_ROWS", "4")
    K, Hs = {"fp32": (39, 59), "bf16": (41, 61)}[precision]    # (sizes no other test loads)
    torch.manual_seed(0)
    mods = [ht.LSTM(K, Hs, num_layers=2, precision=precision).cuda() for _ in range(4)]
    xs = [torch.randn(11, 8, K, device="cuda") for _ in mods]

    def run(i):
        mods[i].zero_grad()
        y, _ = mods[i](xs[i])
        y.square().sum().backward()
        return [y.detach().clone()] + [p.grad.clone() for p in mods[i].parameters()]
    want = [run(i) for i in range(4)]
    got, errors = [[] for _ in mods], []
    start = threading.Barrier(4)

    def worker(i):
        try:
            stream = torch.cuda.Stream() if i % 2 else torch.cuda.current_stream()
            with torch.cuda.stream(stream):
                start.wait()
                for _ in range(6):          # direct, captured, replayed
                    got[i].append(run(i))
                stream.synchronize()
        except Exception as e:              # (re-raised below, in the test's thread)
            errors.append(e)
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i in range(4):
        for results in got[i]:
            assert all(torch.equal(a, b) for a, b in zip(results, want[i])), i


def test_backward_without_input_gradient_skips_dx(gpu_target):
    """A CUDA layer whose input needs no gradient skips the dx GEMM: the
    weights' gradients bitwise as with it, no input gradient, fewer
    kernels in backward."""
    torch = pytest.importorskip("torch")
    import halstm.torch as ht
    from torch.profiler import ProfilerActivity, profile
    torch.manual_seed(0)
    m = ht.LSTM(13, 37, num_layers=2).cuda()
    x = torch.randn(9, 5, 13, device="cuda")

    def grads(need_dx):
        m.zero_grad()
        xi = x.clone().requires_grad_(need_dx)
        y, _ = m(xi)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as p:
            y.sum().backward()
            torch.cuda.synchronize()
        kernels = [e for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        return [q.grad.clone() for q in m.parameters()], xi.grad, len(kernels)

    with_dx, dx, n_with = grads(True)
    without, no_dx, n_without = grads(False)
    assert dx is not None and no_dx is None
    for a, b in zip(with_dx, without):
        assert torch.equal(a, b)
    assert n_without < n_with, (n_without, n_with)


def test_an_allocation_without_memory_retries_after_the_caches_give_back(gpu_target,
                                                                       monkeypatch):
    """Where a library's own device allocation (cuBLAS's workspace, made at
    a call on a stream new to it) finds no memory, the library calls
    halstm.cuda's hook (its pool's and torch's caches give their blocks
    back) and tries once more: the call succeeds, its results unchanged. A
    second failure is a KernelError naming the allocation."""
    from halstm import cuda
    from halstm.errors import KernelError
    called = []
    monkeypatch.setattr(cuda, "_oom_callbacks", cuda._oom_callbacks + [lambda: called.append(1)])
    m = make("lstm", num_layers=1, target=gpu_target, seed=3)
    lib = m._lib(0, "fwd")
    x = cuda.DeviceArray.from_numpy(
        np.random.default_rng(3).standard_normal((T, B, I)).astype(np.float32))
    streams = []                         # (kept: a live stream's handle is not reused)

    def on_a_new_stream():               # (a workspace of its own)
        streams.append(cuda.Stream())
        streams[-1].after(None)          # (after x's upload on the legacy stream)
        states, _ = lib.forward(x, *m._layer_weights(0), [None, None], save=False,
                                stream=streams[-1].handle)
        cuda.synchronize()
        return states.numpy()
    want = on_a_new_stream()
    fail = lib._lib.halstm_cuda_fail_allocs
    fail.argtypes = [ctypes.c_int]
    try:
        fail(1)
        np.testing.assert_array_equal(on_a_new_stream(), want)
        assert called == [1]
        fail(2)
        with pytest.raises(KernelError, match="cuMemAlloc of cuBLAS's workspace"):
            on_a_new_stream()
        assert called == [1, 1]
    finally:
        fail(0)
