"""The char LM's head and optimizer, and the modules' array operations, as
Halide pipelines (halstm/model/kernels.py, library.py): the CPU schedule
against numpy (charlm's head, optim's Adam, SGD and clipping, rows, add,
mul); the CUDA schedule compiles here (runs in tests/gpu)."""
import numpy as np
import pytest

from halstm.model import CharLM, Config, optim
from halstm.model.charlm import _log_softmax_nll
from helpers import (CUDA_TARGET, HEAD_FAULTS, TINY, assert_close, check_head_faults,
                     head_fault_case, make_corpus)


@pytest.fixture
def k(model_kernels):
    return model_kernels


@pytest.mark.parametrize("N,H,V", [(37, 19, 11), (64, 16, 65), (1, 3, 1), (45, 96, 100),
                                   (2, 200, 3)])
def test_head_matches_numpy(k, N, H, V):
    rng = np.random.default_rng(N)
    y = rng.standard_normal((N, H)).astype(np.float32)
    w = rng.standard_normal((V, H)).astype(np.float32)
    b = rng.standard_normal(V).astype(np.float32)
    t = rng.integers(0, V, N)
    loss, dw, db, dy = k.head(y, w, b, k.targets(t), 1.0 / N)
    dlogits = y @ w.T + b
    nll = _log_softmax_nll(dlogits, t, grad=1.0 / N)     # dlogits now d(mean)/d logits
    assert_close("loss", loss, nll, rtol=1e-5, atol=1e-5, per_element=True)
    assert_close("dw", dw, dlogits.T @ y, rtol=1e-4, atol=1e-6, per_element=True)
    assert_close("db", db, dlogits.sum(0), rtol=1e-4, atol=1e-6, per_element=True)
    assert_close("dy", dy, dlogits @ w, rtol=1e-4, atol=1e-6, per_element=True)


@pytest.mark.parametrize("where", HEAD_FAULTS)
@pytest.mark.parametrize("N,H,V", [(37, 19, 11), (8, 4, 5), (64, 16, 16), (45, 96, 100)])
def test_head_keeps_nan_and_inf_where_numpy_does(k, N, H, V, where):
    """Sizes off the vector width too: Halide's max and exp on CPUs drop NaN."""
    y, w, b, t = head_fault_case(N, H, V, where)
    check_head_faults(where, k.head(y, w, b, k.targets(t), 1.0 / N), y, w, b, t)


def test_head_wrong_shape_names_the_argument(k):
    y = np.zeros((4, 3), np.float32)
    with pytest.raises(ValueError, match=r"b: expected shape \(5,\), got \(4,\)"):
        k.head(y, np.zeros((5, 3), np.float32), np.zeros(4, np.float32),
               k.targets(np.zeros(4)), 1.0)


@pytest.mark.parametrize("n", [1, 1023, 1025, 70000])
def test_sumsq(k, n):
    g = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    out = np.zeros(1, np.float32)
    k.sumsq(g, out)
    assert out[0] == pytest.approx(float(np.dot(g.astype(np.float64), g)), rel=1e-5)


def _params(seed=0):
    rng = np.random.default_rng(seed)
    shapes = {"a": (64, 16), "b": (64,), "c": (3000,)}
    return ({n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()},
            lambda: {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()})


@pytest.mark.parametrize("clip", [0.0, 5.0, 1e3])
@pytest.mark.parametrize("name", ["adam", "sgd", "sgd_momentum"])
def test_optimizer_steps_match_numpy(k, name, clip):
    """Five steps, 4x-scaled gradients (so that clip 5 clips every step)."""
    p0, grads = _params()
    cfg = Config(optimizer="sgd" if name.startswith("sgd") else "adam",
                 momentum=0.9 if name == "sgd_momentum" else 0.0)
    want = {n: a.copy() for n, a in p0.items()}
    got = {n: a.copy() for n, a in p0.items()}
    numpy_opt, kernel_opt = optim.make(cfg, want), optim.make(cfg, got, k)
    assert type(kernel_opt).__name__.startswith("Kernel")
    for step in range(5):
        g = {n: 4 * a for n, a in grads().items()}
        g_copy = {n: a.copy() for n, a in g.items()}
        numpy_opt.clip_and_step(want, g, 1e-2, clip)
        kernel_opt.clip_and_step(got, g_copy, 1e-2, clip)
    for n in p0:
        assert_close(n, got[n], want[n], rtol=2e-5, atol=2e-6, per_element=True)
    sd, sd2 = numpy_opt.state_dict(), kernel_opt.state_dict()
    assert sorted(sd) == sorted(sd2)
    for key in sd:
        assert_close(key, sd2[key], sd[key], rtol=2e-5, atol=2e-6, per_element=True)
    # and the state goes back in
    other = optim.make(cfg, {n: a.copy() for n, a in p0.items()}, k)
    other.load_state_dict(sd)
    assert other.t == 5


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_charlm_head_pipeline_matches_numpy_head(cell):
    """The head pipeline (the default on every target) against numpy's."""
    a = CharLM(16, cell, hidden_size=16, layers=2, seed=3, kernels=False)
    b = CharLM(16, cell, hidden_size=16, layers=2, seed=3)
    assert a.kernels is None and b.kernels is not None
    rng = np.random.default_rng(0)
    ids, targets = (rng.integers(0, 16, (6, 3)).astype(np.int32) for _ in range(2))
    state = a.zero_state(3)
    la, ga, _ = a.loss_and_grads(ids, targets, state)
    lb, gb, _ = b.loss_and_grads(ids, targets, state)
    assert lb == pytest.approx(la, rel=1e-5)
    assert list(ga) == list(gb)
    for key in ga:
        assert_close(key, gb[key], ga[key], rtol=1e-4, atol=1e-6, per_element=True)
    assert b.loss(ids, targets, state)[0] == pytest.approx(a.loss(ids, targets, state)[0],
                                                           rel=1e-5)


def test_cuda_schedules_compile_without_gpu(tmp_path):
    from halstm.model import library
    m = library.build(CUDA_TARGET, tmp_path)
    assert m["device"] == "cuda" and (tmp_path / m["library"]).is_file()
    assert m["pipelines"] == [f"halstm_model_{x}" for x in ("head", "sumsq", "adam", "sgd", "onehot",
                                                             "rows", "add", "mul", "dropout")]


def test_trainer_with_the_head_pipeline_matches_numpy_and_resumes(monkeypatch, tmp_path):
    """Trainer with the head's pipeline (the default): numpy's head's losses
    (CharLM(kernels=False)); a checkpoint saved mid-run resumes exactly.
    The optimizer is the adam pipeline either way."""
    from halstm.model import Trainer, checkpoint
    config = Config(**TINY, steps=6, eval_every=3, clip=0.5)
    corpus = make_corpus(config)
    pipeline_head = CharLM.from_config
    with monkeypatch.context() as m:
        m.setattr(CharLM, "from_config", staticmethod(
            lambda cfg, vocab_size: pipeline_head(cfg, vocab_size, kernels=False)))
        plain = Trainer(config, corpus)
        assert plain.model.kernels is None and type(plain.optimizer).__name__ == "KernelAdam"
        plain.run(progress=False, handle_sigint=False)
    fused = Trainer(config, corpus)
    assert fused.model.kernels is not None and type(fused.optimizer).__name__ == "KernelAdam"
    fused.run(until=3, progress=False, handle_sigint=False)
    fused.save(tmp_path / "c.npz")
    fused.run(progress=False, handle_sigint=False)
    for key in ("train_loss", "val_loss"):
        assert_close(key, fused.history[key], plain.history[key], rtol=1e-4, atol=0,
                     per_element=True)
    resumed = Trainer.resume(checkpoint.load(tmp_path / "c.npz"), corpus)
    resumed.run(progress=False, handle_sigint=False)
    assert_close("train_loss", resumed.history["train_loss"], fused.history["train_loss"],
                 rtol=1e-6, atol=0, per_element=True)


@pytest.mark.parametrize("kernels", [None, False])
def test_model_checks_targets(kernels):
    m = CharLM(16, "lstm", hidden_size=16, layers=1, seed=0, kernels=kernels)
    ids = np.zeros((4, 2), np.int32)
    with pytest.raises(ValueError, match=r"targets: class indices must lie in \[0, 16\)"):
        m.loss_and_grads(ids, np.full((4, 2), 16), m.zero_state(2))
    with pytest.raises(ValueError, match=r"targets: expected shape \(4, 2\), got \(8,\)"):
        m.loss(ids, np.zeros(8, np.int32), m.zero_state(2))


def test_onehot_kernel(k):
    ids = np.array([3, 0, 6, 6, 1], np.int32)
    np.testing.assert_array_equal(k.onehot(k.targets(ids), 7), np.eye(7, dtype=np.float32)[ids])


@pytest.mark.parametrize("R, M, n", [(7, 5, 3), (1, 1, 1), (300, 700, 37)])
def test_array_operations_match_numpy(k, R, M, n):
    """rows gathers (zeros for a negative index, NaN kept), add and mul
    are numpy's."""
    rng = np.random.default_rng(R)
    src = rng.standard_normal((R, n)).astype(np.float32)
    src[0, 0] = np.nan
    idx = rng.integers(-1, R, M)
    got = k.rows(src, k.targets(idx))
    want = np.where(idx[:, None] >= 0, src[np.maximum(idx, 0)], 0)
    np.testing.assert_array_equal(got, want.astype(np.float32))
    a, b = src[:M % R + 1], rng.standard_normal((M % R + 1, n)).astype(np.float32)
    np.testing.assert_array_equal(k.add(a, b), a + b)
    np.testing.assert_array_equal(k.mul(a, b), a * b)
    with pytest.raises(ValueError, match=r"b: expected shape"):
        k.add(a, b[:, :0])


@pytest.mark.parametrize("p", [0.0, 0.3, 0.5, 0.9, 1.0])
def test_dropout_masks_are_the_reference_bits_and_keep_one_minus_p(k, p):
    """The dropout kernel's mask equals halstm.dropout.mask bit for
    bit (so every target's does), keeps a 1 - p share of the elements at
    1 / (1 - p), and another key gives another mask."""
    from halstm import dropout
    shape = (50, 7, 301)                 # 105350 elements: a share within 0.005 of 1 - p
    threshold, scale = dropout.params(p)
    got = k.dropout(shape, 12345, 4294967295, threshold, scale)
    np.testing.assert_array_equal(got, dropout.mask(shape, p, 12345, 4294967295))
    kept = got != 0
    assert abs(kept.mean() - (1 - p)) < 0.005
    assert np.all(got[kept] == scale) and (p < 1 or scale == 0)
    if 0 < p < 1:
        other = k.dropout(shape, 12346, 4294967295, threshold, scale)
        assert 0.3 < np.mean((other != 0) == kept) < 0.99      # (near independent)
