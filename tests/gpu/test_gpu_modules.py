"""halstm.LSTM / GRU on a CUDA target against the numpy reference, with
numpy and device arrays as input, for every GPU schedule; against cuDNN."""
import numpy as np
import pytest

import halstm
from halstm import cuda, schedules

import test_modules as tm
from conftest import TARGET

GPU = [n for n in schedules.names() if "gpu" in schedules.families(n)]
PUT = {"numpy": lambda a: a, "device": cuda.DeviceArray.from_numpy}


@pytest.mark.parametrize("io", list(PUT))
@pytest.mark.parametrize("case", list(tm.CASES))
@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_cuda_schedule_matches_reference(cell, case, io):
    tm.check_case(cell, case, target=TARGET, schedule="cuda", put=PUT[io])


@pytest.mark.parametrize("case", ["base", "T1", "B1"])
@pytest.mark.parametrize("schedule", [s for s in GPU if s != "cuda"])
def test_autoscheduled_matches_reference(schedule, case):
    tm.check_case("lstm", case, target=TARGET, schedule=schedule)


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_device_input_keeps_everything_on_the_device(cell):
    m = tm.make(cell, target=TARGET)
    assert all(isinstance(v, cuda.DeviceArray) for v in m.state_dict().values())
    x = cuda.DeviceArray.from_numpy(np.ones((tm.T, tm.B, tm.I), np.float32))
    y, finals = tm.call(m, cell, x)
    assert isinstance(y, cuda.DeviceArray) and all(isinstance(f, cuda.DeviceArray) for f in finals)
    grads = tm.backward(m, cell, cuda.DeviceArray.from_numpy(np.ones(y.shape, np.float32)))
    assert all(isinstance(g, cuda.DeviceArray) for g in grads.values())
    # and numpy in gives numpy out
    y2, _ = tm.call(m, cell, x.numpy())
    assert isinstance(y2, np.ndarray)
    np.testing.assert_array_equal(y2, y.numpy())


def test_a_cuda_error_leaves_the_module_usable():
    m = tm.make("lstm", target=TARGET)
    x = np.ones((tm.T, tm.B, tm.I), np.float32)
    want, _ = tm.call(m, "lstm", x)
    free, total = cuda.mem_info()
    # x takes a 20th of the free memory; the layer's workspaces (projected
    # inputs, saved gates, states) need about 40 times x's size
    big = cuda.zeros((tm.T, free // 20 // (4 * tm.T * tm.I), tm.I))
    with pytest.raises(cuda.CudaError, match="OUT_OF_MEMORY"):
        m(big)
    del big
    got, _ = tm.call(m, "lstm", x)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_matches_cudnn(cell):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    tcls = torch.nn.LSTM if cell == "lstm" else torch.nn.GRU
    t = tcls(tm.I, tm.H, num_layers=2).cuda()
    m = tm.make(cell, target=TARGET)
    m.load_state_dict({k: cuda.asarray(v.detach().contiguous()) for k, v in t.state_dict().items()})
    x = torch.randn(tm.T, tm.B, tm.I, device="cuda", requires_grad=True)
    ty, _ = t(x)
    ty.sum().backward()
    y, _ = tm.call(m, cell, x.detach())
    grads = tm.backward(m, cell, torch.ones_like(ty))
    tm.assert_close("y", y.numpy(), ty.detach().cpu().numpy().astype(np.float64))
    tm.assert_close("input", grads["input"].numpy(), x.grad.cpu().numpy().astype(np.float64))
    for k, p in t.named_parameters():
        tm.assert_close(k, grads[k].numpy(), p.grad.cpu().numpy().astype(np.float64))


# The cuda schedule tiles batch rows (4 a thread; 8 from H=512) and N = T*B
# rows (16) with full tiles where the extent allows and single rows
# elsewhere: these (T, B) take both paths, with edge tiles. H=96 and 128
# split the per-step reductions over 8 warps (H=37 cannot be split); H=128
# also gives layer 1 (K=128) four units a thread in dx.
@pytest.mark.parametrize("T,B", [(5, 9), (3, 4), (2, 17), (1, 16), (4, 1)])
@pytest.mark.parametrize("H", [37, 96, 128])
@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_cuda_schedule_batch_tiles(cell, H, T, B):
    rng = np.random.default_rng(T * 100 + B)
    m = tm.CLASSES[cell](tm.I, H, num_layers=2, seed=0, target=TARGET)
    x = rng.standard_normal((T, B, tm.I)).astype(np.float32)
    dy = rng.standard_normal((T, B, H)).astype(np.float32)
    y, finals = tm.call(m, cell, x)
    grads = tm.backward(m, cell, dy)
    ry, rfinals, rgrads = tm.ref_run(cell, m, x, None, dy, None)
    tm.assert_close("y", y, ry)
    for k, g in grads.items():
        tm.assert_close(k, g, rgrads[k])


def test_changing_a_device_output_leaves_backward_alone():
    """y is the caller's own array, not a view of what backward reads."""
    rng = np.random.default_rng(5)
    m = tm.make("lstm", target=TARGET)
    x = rng.standard_normal((tm.T, tm.B, tm.I)).astype(np.float32)
    dy = rng.standard_normal((tm.T, tm.B, tm.H)).astype(np.float32)
    m(x)
    want = m.backward(dy)
    y, _ = m(cuda.DeviceArray.from_numpy(x))
    y[0] = np.zeros((tm.B, tm.H), np.float32)            # the caller reuses its output
    got = m.backward(cuda.DeviceArray.from_numpy(dy))
    for k, g in want.items():
        np.testing.assert_array_equal(got[k].numpy(), g, err_msg=k)
