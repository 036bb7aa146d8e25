"""halstm.LSTM / GRU on a CUDA target against the numpy reference, with
numpy and device arrays as input, for every GPU schedule; against cuDNN."""
import numpy as np
import pytest

import halstm
from halstm import cuda, schedules
from helpers import (B, CASES, CLASSES, H, I, L, STATES, T, assert_close, assert_grads_close,
                     backward, call,
                     check_case, check_lengths_against_alone, check_no_grad, make,
                     record_wavefronts, ref_run)

GPU = [n for n in schedules.names() if "gpu" in schedules.families(n)]
PUT = {"numpy": lambda a: a, "device": cuda.DeviceArray.from_numpy}


@pytest.mark.parametrize("io", list(PUT))
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_cuda_schedule_matches_reference(cell, case, io, gpu_target):
    check_case(cell, case, target=gpu_target, schedule="cuda", put=PUT[io])


@pytest.mark.parametrize("case", ["base", "T1", "B1"])
@pytest.mark.parametrize("schedule", [s for s in GPU if s != "cuda"])
def test_autoscheduled_matches_reference(schedule, case, gpu_target):
    check_case("lstm", case, target=gpu_target, schedule=schedule)


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_device_input_keeps_everything_on_the_device(cell, gpu_target):
    m = make(cell, target=gpu_target)
    assert all(isinstance(v, cuda.DeviceArray) for v in m.state_dict().values())
    x = cuda.DeviceArray.from_numpy(np.ones((T, B, I), np.float32))
    y, finals = call(m, cell, x)
    assert isinstance(y, cuda.DeviceArray) and all(isinstance(f, cuda.DeviceArray) for f in finals)
    grads = backward(m, cell, cuda.DeviceArray.from_numpy(np.ones(y.shape, np.float32)))
    assert all(isinstance(g, cuda.DeviceArray) for g in grads.values())
    # and numpy in gives numpy out
    y2, _ = call(m, cell, x.numpy())
    assert isinstance(y2, np.ndarray)
    np.testing.assert_array_equal(y2, y.numpy())


@pytest.mark.parametrize("io", list(PUT))
@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_lengths_match_each_sequence_alone(cell, io, gpu_target):
    """Lengths on a CUDA target (unsorted, one of length 1): each sequence
    as if run alone; device input gives device results."""
    rng = np.random.default_rng(3)
    Tn, Bn = 9, 6
    lengths = np.array([4, 9, 1, 6, 9, 2])
    m = make(cell, target=gpu_target)
    x = rng.standard_normal((Tn, Bn, I)).astype(np.float32)
    hx = [rng.standard_normal((L, Bn, H)).astype(np.float32) for _ in STATES[cell]]
    dy = rng.standard_normal((Tn, Bn, H)).astype(np.float32)
    dfinal = [rng.standard_normal((L, Bn, H)).astype(np.float32) for _ in STATES[cell]]
    check_lengths_against_alone(m, x, lengths, hx, dy, dfinal)
    y, finals = call(m, cell, PUT[io](x), lengths=lengths)
    assert isinstance(y, np.ndarray if io == "numpy" else cuda.DeviceArray)
    want, _ = call(m, cell, x, lengths=lengths)
    np.testing.assert_array_equal(np.asarray(y.numpy() if io == "device" else y), want)


@pytest.mark.parametrize("lengths", [None, [4, 9, 1, 6, 9, 2]])
@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_bidirectional_and_dropout_match_the_cpu(cell, lengths, gpu_target):
    """A bidirectional 2-layer module with dropout on a CUDA target equals
    the same module on the CPU (the CPU's against torch.nn in
    test_modules.py): the same seed gives the same masks; outputs, final
    states and every gradient."""
    rng = np.random.default_rng(8)
    Tn, Bn = 9, 6
    mods = [make(cell, bidirectional=True, dropout=0.3, seed=4, target=t)
            for t in ("host", gpu_target)]
    mods[1].load_state_dict({k: np.asarray(v) for k, v in mods[0].state_dict().items()})
    x = rng.standard_normal((Tn, Bn, I)).astype(np.float32)
    hx = [rng.standard_normal((2 * L, Bn, H)).astype(np.float32) for _ in STATES[cell]]
    dy = rng.standard_normal((Tn, Bn, 2 * H)).astype(np.float32)
    kw = {} if lengths is None else {"lengths": np.array(lengths)}
    runs = []
    for m in mods:
        y, finals = call(m, cell, x, hx if cell == "lstm" else hx[0], **kw)
        runs.append((y, finals, backward(m, cell, dy)))
    (y0, f0, g0), (y1, f1, g1) = runs
    assert_close("y", y1, y0, rtol=1e-4)
    for s, a, b in zip(STATES[cell], f1, f0):
        assert_close(f"{s}_n", a, b, rtol=1e-4)
    assert set(g1) == set(g0)
    for k in g0:
        assert_close(k, g1[k], g0[k], rtol=1e-4)


def test_a_cuda_error_leaves_the_module_usable(gpu_target):
    m = make("lstm", target=gpu_target)
    x = np.ones((T, B, I), np.float32)
    want, _ = call(m, "lstm", x)
    free, total = cuda.mem_info()
    # x takes a 20th of the free memory; the layer's workspaces (projected
    # inputs, saved gates, states) need about 40 times x's size
    big = cuda.zeros((T, free // 20 // (4 * T * I), I))
    with pytest.raises(cuda.CudaError, match="OUT_OF_MEMORY"):
        m(big)
    del big
    got, _ = call(m, "lstm", x)
    np.testing.assert_array_equal(got, want)
    # the blocks m(big) did get went back to this process's pool: free them,
    # or tests running beside this one (pytest -n) find the GPU full
    cuda.empty_cache()


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_matches_cudnn(cell, gpu_target):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    tcls = torch.nn.LSTM if cell == "lstm" else torch.nn.GRU
    t = tcls(I, H, num_layers=2).cuda()
    m = make(cell, target=gpu_target)
    m.load_state_dict({k: cuda.asarray(v.detach().contiguous()) for k, v in t.state_dict().items()})
    x = torch.randn(T, B, I, device="cuda", requires_grad=True)
    ty, _ = t(x)
    ty.sum().backward()
    y, _ = call(m, cell, x.detach())
    grads = backward(m, cell, torch.ones_like(ty))
    assert_close("y", y.numpy(), ty.detach().cpu().numpy().astype(np.float64))
    assert_close("input", grads["input"].numpy(), x.grad.cpu().numpy().astype(np.float64))
    for k, p in t.named_parameters():
        assert_close(k, grads[k].numpy(), p.grad.cpu().numpy().astype(np.float64))


# The cuda schedule tiles batch rows (4 a thread; 8 from H=512) and N = T*B
# rows (16) with full tiles where the extent allows and single rows
# elsewhere: these (T, B) take both paths, with edge tiles. The per-step
# reductions are split over 8 warps: in runs of 12 and 16 at H=96 and 128,
# of 5 and 13 at H=37 and 100, the last run shorter (cuda_tiles.warp_slices);
# H=128 also gives layer 1 (K=128) four units a thread in dx.
# Below H=512 the steps are register tiles; at H=96 and 128 dx (both
# layers) and layer 2's projection (K = H) are lanes products, at H=37 and
# 100 not.
@pytest.mark.parametrize("T,B", [(5, 9), (3, 4), (2, 17), (1, 16), (4, 1)])
@pytest.mark.parametrize("H", [37, 96, 100, 128])
@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_cuda_schedule_batch_tiles(cell, H, T, B, gpu_target):
    rng = np.random.default_rng(T * 100 + B)
    m = CLASSES[cell](I, H, num_layers=2, seed=0, target=gpu_target)
    x = rng.standard_normal((T, B, I)).astype(np.float32)
    dy = rng.standard_normal((T, B, H)).astype(np.float32)
    y, finals = call(m, cell, x)
    grads = backward(m, cell, dy)
    ry, _, rgrads = ref_run(cell, m, x, dy=dy)
    assert_close("y", y, ry)
    for k, g in grads.items():
        assert_close(k, g, rgrads[k])


# Forward steps of few rows run the narrow step kernels
# (cuda.narrow_layout, one gate of one unit a thread: up to 4 rows for the
# LSTM at H=256, 2 for the GRU at H=384 on 132 SMs; at H=261 the
# reduction's last warp has a shorter run), the others the tiles above:
# these lengths take a batch of 8 from 8 rows a step down to 2, across
# both within one call; each sequence alone, and the first two against the
# reference (gradients too), run narrow steps only.
@pytest.mark.parametrize("cell,Hn", [("lstm", 256), ("lstm", 261), ("gru", 384)])
def test_narrow_and_wide_steps_in_one_call(cell, Hn, gpu_target):
    from halstm import aot
    rng = np.random.default_rng(11)
    Tn, Bn = 7, 8
    lengths = np.array([7, 2, 7, 4, 6, 1, 5, 3])
    m = CLASSES[cell](I, Hn, num_layers=2, seed=0, target=gpu_target)
    narrow = aot.library(aot.Spec(cell, Hn, Hn, "fwd", gpu_target))[1]["layout"]["narrow_rows"]
    assert 2 <= narrow < Bn, narrow
    x = rng.standard_normal((Tn, Bn, I)).astype(np.float32)
    hx = [rng.standard_normal((2, Bn, Hn)).astype(np.float32) for _ in STATES[cell]]
    dy = rng.standard_normal((Tn, Bn, Hn)).astype(np.float32)
    dfinal = [rng.standard_normal((2, Bn, Hn)).astype(np.float32) for _ in STATES[cell]]
    check_lengths_against_alone(m, x, lengths, hx, dy, dfinal)
    y, _ = call(m, cell, x)
    ry, _, _ = ref_run(cell, m, x)
    assert_close("y", y, ry)
    y, _ = call(m, cell, x[:, :2])
    grads = backward(m, cell, dy[:, :2])
    ry, _, rgrads = ref_run(cell, m, x[:, :2], dy=dy[:, :2])
    assert_close("y", y, ry)
    for k, g in grads.items():
        assert_close(k, g, rgrads[k])


# From H=512 (a multiple of 32) the per-step products, the projection and
# dx are lanes products (schedules/cuda_lanes.py lanes_product): 8 rows a lane
# (4 in the forward step below H=1024) where there are that many, one row
# otherwise; two units a lane in dh from H=1024, four in dx. These (T, B)
# give whole tiles with a shifted edge tile (9, 17), too few rows for a
# tile (3, and N = T*B = 3), and batch 1 over 20 steps; two layers, so that
# layer 2's projection and dx reduce over K = H. At H=1024 dW_hh (both
# layers) and layer 2's dW_ih are lanes products too, whose chunks of 32
# rows pass N (no N here is a multiple of 32); elsewhere dW's register
# tiles sum their rows in parts.
@pytest.mark.parametrize("T,B", [(3, 9), (1, 3), (20, 1), (2, 17)])
@pytest.mark.parametrize("H", [512, 1024])
@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_cuda_schedule_large_hidden(cell, H, T, B, gpu_target):
    rng = np.random.default_rng(T + B)
    m = CLASSES[cell](I, H, num_layers=2, seed=0, target=gpu_target)
    x = rng.standard_normal((T, B, I)).astype(np.float32)
    dy = rng.standard_normal((T, B, H)).astype(np.float32)
    y, _ = call(m, cell, x)
    grads = backward(m, cell, dy)
    ry, _, rgrads = ref_run(cell, m, x, dy=dy)
    assert_close("y", y, ry)
    for k, g in grads.items():
        assert_close(k, g, rgrads[k])


@pytest.mark.parametrize("dropout", [0.0, 0.5])
def test_changing_a_device_output_leaves_backward_alone(dropout, gpu_target):
    """y is the caller's own array, not a view of what backward reads,
    with dropout between the layers too (two modules of one seed draw the
    same masks)."""
    rng = np.random.default_rng(5)
    ref, m = (make("lstm", target=gpu_target, dropout=dropout) for _ in range(2))
    x = rng.standard_normal((T, B, I)).astype(np.float32)
    dy = rng.standard_normal((T, B, H)).astype(np.float32)
    ref(x)
    want = ref.backward(dy)
    y, _ = m(cuda.DeviceArray.from_numpy(x))
    y[0] = np.zeros((B, H), np.float32)            # the caller reuses its output
    got = m.backward(cuda.DeviceArray.from_numpy(dy))
    for k, g in want.items():
        np.testing.assert_array_equal(got[k].numpy(), g, err_msg=k)


def _libs(m):
    """Each library once (the layers after the first share theirs)."""
    libs = {id(lib): lib for layer in range(m.num_layers) for d in ("fwd", "bwd")
            for lib in [m._lib(layer, d)]}
    return list(libs.values())


def _stats(m):
    total = {"replays": 0, "captures": 0, "direct": 0}
    for lib in _libs(m):
        for k, v in lib.graph_stats().items():
            total[k] += v
    return total


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_time_loops_from_cuda_graphs_equal_direct_launches(cell, gpu_target):
    """The time loops replayed from captured graphs give the same bits as
    launching every step directly, also when the inputs' values change
    under the same pointers (a graph reads memory when it runs) and when
    the batch changes (another graph)."""
    rng = np.random.default_rng(11)
    m = make(cell, target=gpu_target)

    def run(T, B, x, dy):
        y, finals = call(m, cell, x)
        grads = backward(m, cell, dy)
        return [y.numpy()] + [f.numpy() for f in finals] + [g.numpy() for g in grads.values()]

    problems = []
    for steps, rows in [(6, 5), (6, 5), (6, 2), (6, 5)]:
        x = rng.standard_normal((steps, rows, I)).astype(np.float32)
        dy = rng.standard_normal((steps, rows, H)).astype(np.float32)
        problems.append((steps, rows, x, dy))
    xd = cuda.DeviceArray.from_numpy(problems[0][2])
    dyd = cuda.DeviceArray.from_numpy(problems[0][3])

    def results():
        out = []
        for T, B, x, dy in problems:
            if B == 5:   # same device arrays, new values: pointers recur
                xd.copy_from(x)
                dyd.copy_from(dy)
                out.append(run(T, B, xd, dyd))
            else:
                out.append(run(T, B, cuda.DeviceArray.from_numpy(x), cuda.DeviceArray.from_numpy(dy)))
        return out

    m(xd)   # warm, graphs on: a library's first loop in a context runs directly (loads
    m.backward(dyd)   # its kernels); with graphs off none is counted as that first loop
    for lib in _libs(m):
        lib.use_graphs(False)
    want = results()
    before = _stats(m)
    for lib in _libs(m):
        lib.use_graphs(True)
    got = results()
    after = _stats(m)
    for w, g in zip(want, got):
        for a, b in zip(w, g):
            np.testing.assert_array_equal(b, a)
    assert after["direct"] == before["direct"], "graphs were on"
    assert after["captures"] > before["captures"]
    # and the results are the reference's
    T, B, x, dy = problems[-1]
    ry, _, _ = ref_run(cell, m, x)
    assert_close("y", got[-1][0], ry)


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_a_training_loop_replays_its_graphs(cell, gpu_target):
    """At a fixed shape the pointers a loop is given recur (the pool hands
    back the free block at the lowest address), so after a few iterations
    every time loop is a replay: no capture, no direct launch. (On an H100
    the loop below settled at its 8th iteration.)"""
    rng = np.random.default_rng(5)
    m = make(cell, num_layers=3, target=gpu_target)
    counts = []
    for _ in range(14):
        x = cuda.DeviceArray.from_numpy(rng.standard_normal((T, B, I)).astype(np.float32))
        dy = cuda.DeviceArray.from_numpy(rng.standard_normal((T, B, H)).astype(np.float32))
        call(m, cell, x)
        m.backward(dy)
        counts.append(_stats(m))
    last, before = counts[-1], counts[-4]
    assert last["captures"] == before["captures"] and last["direct"] == before["direct"], counts
    # 3 layers, forward and backward, three iterations
    assert last["replays"] - before["replays"] == 18, counts


def test_one_step_loops_run_directly(gpu_target):
    """A time loop of one step (T = 1: what LSTMCell-style modules run,
    with fresh arrays each call) launches its kernels directly, forward
    with the saved channels and backward, and never captures a graph;
    longer loops still do."""
    rng = np.random.default_rng(2)
    m = make("lstm", target=gpu_target)

    def train(steps):
        x = cuda.DeviceArray.from_numpy(rng.standard_normal((steps, B, I)).astype(np.float32))
        dy = cuda.DeviceArray.from_numpy(rng.standard_normal((steps, B, H)).astype(np.float32))
        call(m, "lstm", x)
        backward(m, "lstm", dy)

    train(1)    # (a library's first loop in a context runs directly in any case)
    before = _stats(m)
    for _ in range(3):
        train(1)
    after = _stats(m)
    assert after["captures"] == before["captures"], (before, after)
    assert after["replays"] == before["replays"], (before, after)
    assert after["direct"] - before["direct"] == 3 * 2 * L, (before, after)   # L layers, 2 ways
    train(T)
    assert _stats(m)["captures"] > after["captures"]


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_backward_without_input_grad(cell, gpu_target):
    """input_grad=False leaves out the input gradient, nothing else (on a
    GPU the first layer's dx is still computed, then dropped)."""
    rng = np.random.default_rng(9)
    m = make(cell, target=gpu_target)
    x = rng.standard_normal((T, B, I)).astype(np.float32)
    dy = rng.standard_normal((T, B, H)).astype(np.float32)
    call(m, cell, x)
    want = backward(m, cell, dy)
    call(m, cell, x)
    got = m.backward(dy, input_grad=False)
    assert set(got) == set(want) - {"input"}
    for k, g in got.items():
        np.testing.assert_array_equal(g, want[k], err_msg=k)


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_no_grad_forward_matches_a_training_forward(cell, gpu_target):
    check_no_grad(cell, target=gpu_target)


# Under no_grad a device input is read where it is (no copy: no backward
# will read it) and y may view the module's own states: the results equal a
# training forward's, the caller's input is left alone, and a later
# training forward and backward work.
@pytest.mark.parametrize("batch_first", [False, True])
def test_no_grad_reads_a_device_input_in_place(batch_first, gpu_target):
    rng = np.random.default_rng(5)
    m = make("lstm", target=gpu_target, batch_first=batch_first)
    x = rng.standard_normal((T, B, I)).astype(np.float32)
    for xs in (x, x[:, 0]):                      # batched, unbatched
        xd = cuda.DeviceArray.from_numpy(xs)
        want_y, (want_h, want_c) = m(xd)
        with halstm.no_grad():
            y, (h, c) = m(xd)
        np.testing.assert_array_equal(xd.numpy(), xs)
        for name, g, w in (("y", y, want_y), ("h_n", h, want_h), ("c_n", c, want_c)):
            assert isinstance(g, cuda.DeviceArray)
            assert_close(name, g.numpy(), w.numpy(), rtol=1e-5, atol=1e-6, per_element=True)
    y, _ = m(xd)
    grads = m.backward(cuda.DeviceArray.from_numpy(np.ones(y.shape, np.float32)))
    assert np.all(np.isfinite(grads["weight_hh_l0"].numpy()))


@pytest.mark.parametrize("case", ["base", "L3", "hx_and_dstate", "batch_first_hx_dstate", "B1",
                                  "unbatched_hx_dstate", "no_bias"])
@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_layers_as_a_wavefront_match_reference(cell, case, gpu_target, monkeypatch):
    """The layers in chunks of steps on streams of their own
    (halstm.wavefront), forward and gradients, against the reference."""
    monkeypatch.setenv("HALSTM_WAVEFRONT_CHUNKS", "3")
    seen = record_wavefronts(monkeypatch)
    check_case(cell, case, target=gpu_target, schedule="cuda", put=PUT["device"])
    steps = CASES[case].get("T", T)
    assert seen == {"forward": [min(3, steps)], "backward": [min(3, steps)]}


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_a_wavefront_with_dropout_matches_the_layers_in_turn(cell, gpu_target, monkeypatch):
    """Dropout in training: the masks applied chunk by chunk on the lanes
    (the array kernels on a lane's stream), forward and every gradient
    those of the layers in turn with the same seed (the same masks)."""
    rng = np.random.default_rng(6)
    x = rng.standard_normal((T, B, I)).astype(np.float32)
    dy = rng.standard_normal((T, B, H)).astype(np.float32)
    seen = record_wavefronts(monkeypatch)
    runs = []
    for n in ("1", "3"):
        monkeypatch.setenv("HALSTM_WAVEFRONT_CHUNKS", n)
        m = make(cell, num_layers=3, target=gpu_target, dropout=0.4, seed=7)
        y, finals = call(m, cell, x)
        runs.append(([y, *finals], backward(m, cell, dy)))
    assert seen == {"forward": [3], "backward": [3]}
    (want, want_g), (got, got_g) = runs
    for k, (a, b) in enumerate(zip(got, want)):
        assert_close(f"result {k}", a, b, rtol=1e-5)
    assert_grads_close(got_g, want_g, rtol=1e-5)


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_no_grad_wavefront_matches_a_training_forward(cell, gpu_target, monkeypatch):
    monkeypatch.setenv("HALSTM_WAVEFRONT_CHUNKS", "2")
    check_no_grad(cell, target=gpu_target)


def test_a_wavefront_training_loop_replays_its_graphs(gpu_target, monkeypatch):
    """The chunks of a training loop's forwards and backwards settle into
    replays of cached CUDA graphs, as whole loops do (3 layers x 3 chunks
    forward and backward: 18 loops an iteration, the two upper layers'
    chunks in one library each way)."""
    monkeypatch.setenv("HALSTM_WAVEFRONT_CHUNKS", "3")
    rng = np.random.default_rng(5)
    m = make("lstm", num_layers=3, target=gpu_target)
    counts = []
    for _ in range(14):
        x = cuda.DeviceArray.from_numpy(rng.standard_normal((T, B, I)).astype(np.float32))
        dy = cuda.DeviceArray.from_numpy(rng.standard_normal((T, B, H)).astype(np.float32))
        call(m, "lstm", x)
        m.backward(dy)
        counts.append(_stats(m))
    last, before = counts[-1], counts[-4]
    assert last["captures"] == before["captures"] and last["direct"] == before["direct"], counts
    assert last["replays"] - before["replays"] == 54, counts
