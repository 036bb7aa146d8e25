"""Language cells on the GPU: tests/test_cells.py's checks with a CUDA
build (forward and every gradient against the numpy steps)."""
import pytest

from halstm import reference
from test_cells import check_against_step


@pytest.mark.parametrize("size", ["base", "T1", "B1"])
@pytest.mark.parametrize("cell", ["rnn_tanh", "rnn_relu", "cifg_lstm", "slstm"])
def test_language_cell_on_the_gpu(cell, size, gpu_target):
    check_against_step(cell, reference.STEPS[cell], size, target=gpu_target, positive=("n",))


def test_a_cell_of_three_states_on_the_gpu(gpu_target):
    from test_cells import THREE, _three_states_np
    check_against_step(THREE, _three_states_np, target=gpu_target)


@pytest.mark.parametrize("size", ["base", "B1"])
@pytest.mark.parametrize("cell", ["peephole_lstm", "layernorm_lstm"])
def test_vector_and_reducing_cells_on_the_gpu(cell, size, gpu_target):
    check_against_step(cell, reference.STEPS[cell], size, random_vectors=True,
                       target=gpu_target)


@pytest.mark.parametrize("H", [96, 512])
@pytest.mark.parametrize("cell", ["peephole_lstm", "layernorm_lstm", "slstm"])
def test_gpu_schedules_of_larger_sizes_match_the_cpu(cell, H, gpu_target):
    """The GPU's tile and lanes paths (H = 96, 512): forward against the
    numpy step in float64, every gradient against the CPU build (itself
    checked by finite differences in tests/test_cells.py)."""
    import numpy as np
    import halstm
    from halstm import benchmark
    from helpers import assert_close
    from test_cells import _randomized
    cpu = _randomized(halstm.Recurrent(cell, 64, H, seed=0), 1)
    gpu = halstm.Recurrent(cell, 64, H, seed=0, target=gpu_target)
    gpu.load_state_dict(cpu.state_dict())
    rng = np.random.default_rng(2)
    x = rng.standard_normal((5, 19, 64)).astype(np.float32)
    dy = rng.standard_normal((5, 19, H)).astype(np.float32)
    y_cpu, _ = cpu(x)
    y_gpu, _ = gpu(x)
    assert benchmark.reference_errors(gpu, cell, x, y_gpu)["y"] < 1e-4
    assert_close("y", y_gpu, y_cpu)
    want, got = cpu.backward(dy), gpu.backward(dy)
    assert set(got) == set(want)
    for k, w in want.items():
        assert_close(k, got[k], w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("cell,H", [("lstm", 37), ("gru", 128), ("rnn_tanh", 150),
                                    ("peephole_lstm", 61), ("cifg_lstm", 33), ("slstm", 45)])
def test_inference_forward_in_one_kernel(cell, H, gpu_target):
    """Under no_grad, where W_hh fits a block's shared memory (the GRU's
    192 KiB at H = 128: past the 48 KiB a kernel gets without opting in),
    a layer's forward runs every step in one kernel
    (pipeline.LOOP), so no time loop runs (no graph replayed or captured,
    no step launched): y and the final states equal the CPU build's
    (checked against the reference by tests/test_cells.py) and y the
    float64 reference's, at T = 1 and 9, B = 1 and 5, with initial
    states; with lengths the steps run as before."""
    import numpy as np
    import halstm
    from halstm import aot, benchmark
    from helpers import assert_close
    from test_cells import _randomized
    cpu = _randomized(halstm.Recurrent(cell, 13, H, num_layers=2, seed=0), 1)
    gpu = halstm.Recurrent(cell, 13, H, num_layers=2, seed=0, target=gpu_target)
    gpu.load_state_dict(cpu.state_dict())
    for k in (13, H):
        layout = aot.library(aot.Spec(cell, k, H, "fwd", gpu_target))[1]["layout"]
        assert layout["loop_rows"] >= 5, layout
    libs = [gpu._lib(layer, "fwd") for layer in range(2)]
    stats = lambda: [lib.graph_stats() for lib in libs]   # noqa: E731
    rng = np.random.default_rng(3)
    NS = len(gpu._state_names)
    for T, B in ((1, 1), (9, 5)):
        x = rng.standard_normal((T, B, 13)).astype(np.float32)
        hx = tuple(rng.standard_normal((2, B, H)).astype(np.float32) for _ in range(NS))
        # (slstm's normaliser n positive, as after any step)
        hx = tuple(np.abs(a) + np.float32(0.5) if s == "n" else a
                   for s, a in zip(gpu._state_names, hx))
        hx = hx if NS > 1 else hx[0]
        before = stats()
        with halstm.no_grad():
            y, fin = gpu(x, hx)
        assert stats() == before, "a time loop ran"
        want_y, want_fin = cpu(x, hx)
        assert_close(f"y T={T} B={B}", y, want_y)
        for n, (g, w) in enumerate(zip(*(f if isinstance(f, tuple) else (f,)
                                         for f in (fin, want_fin)))):
            assert_close(f"state {n} T={T} B={B}", g, w)
        with halstm.no_grad():
            y0, _ = gpu(x)
        assert benchmark.reference_errors(gpu, cell, x, y0)["y"] < 1e-4
    lengths = np.array([9, 3, 7, 1, 5])
    with halstm.no_grad():
        y, _ = gpu(x, hx, lengths=lengths)
    assert stats() != before, "with lengths the steps run"
    assert_close("y with lengths", y, cpu(x, hx, lengths=lengths)[0])
