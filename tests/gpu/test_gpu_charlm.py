"""The char-level LM trained on a CUDA target: its head and optimizer
kernels against numpy, training against the CPU run, checkpoints."""
import numpy as np
import pytest

from halstm import cuda
from halstm.model import CharLM, Config, Trainer, checkpoint, optim
from halstm.model.charlm import _log_softmax_nll
from helpers import (HEAD_FAULTS, TINY, assert_close, check_head_faults, head_fault_case,
                     make_corpus)


def test_head_kernel_matches_numpy(gpu_model_kernels):
    k = gpu_model_kernels
    rng = np.random.default_rng(0)
    N, H, V = 300, 64, 67
    y, w = (rng.standard_normal(s).astype(np.float32) for s in ((N, H), (V, H)))
    b, t = rng.standard_normal(V).astype(np.float32), rng.integers(0, V, N)
    put = cuda.DeviceArray.from_numpy
    loss, dw, db, dy = k.head(put(y), put(w), put(b), k.targets(t), 1.0 / N)
    assert all(isinstance(a, cuda.DeviceArray) for a in (loss, dw, db, dy))
    dl = y @ w.T + b
    nll = _log_softmax_nll(dl, t, grad=1.0 / N)
    assert_close("loss", loss.numpy(), nll, rtol=1e-5, atol=1e-5, per_element=True)
    assert_close("dw", dw.numpy(), dl.T @ y, rtol=1e-4, atol=1e-6, per_element=True)
    assert_close("db", db.numpy(), dl.sum(0), rtol=1e-4, atol=1e-6, per_element=True)
    assert_close("dy", dy.numpy(), dl @ w, rtol=1e-4, atol=1e-6, per_element=True)


@pytest.mark.parametrize("where", HEAD_FAULTS)
def test_head_kernel_keeps_nan_and_inf_where_numpy_does(gpu_model_kernels, where):
    k, put = gpu_model_kernels, cuda.DeviceArray.from_numpy
    y, w, b, t = head_fault_case(37, 19, 11, where)
    check_head_faults(where, k.head(put(y), put(w), put(b), k.targets(t), 1.0 / 37), y, w, b, t)


def test_onehot_kernel_on_the_device(gpu_model_kernels):
    k = gpu_model_kernels
    ids = np.random.default_rng(2).integers(0, 84, 2048)
    x = k.onehot(k.targets(ids), 84)
    assert isinstance(x, cuda.DeviceArray)
    np.testing.assert_array_equal(x.numpy(), np.eye(84, dtype=np.float32)[ids])


@pytest.mark.parametrize("name", ["adam", "sgd"])
def test_optimizer_kernel_matches_numpy(name, gpu_model_kernels):
    rng = np.random.default_rng(1)
    host = {"a": rng.standard_normal((256, 64)).astype(np.float32),
            "b": rng.standard_normal(70001).astype(np.float32)}
    dev = {n: cuda.DeviceArray.from_numpy(a) for n, a in host.items()}
    cfg = Config(optimizer=name, momentum=0.9)
    want, got = optim.make(cfg, host), optim.make(cfg, dev, gpu_model_kernels)
    for _ in range(4):
        g = {n: 3 * rng.standard_normal(a.shape).astype(np.float32) for n, a in host.items()}
        got.clip_and_step(dev, {n: cuda.DeviceArray.from_numpy(a) for n, a in g.items()},
                          1e-2, 5.0)
        want.clip_and_step(host, g, 1e-2, 5.0)
    for n in host:
        assert_close(n, dev[n].numpy(), host[n], rtol=1e-4, atol=1e-5, per_element=True)


@pytest.mark.parametrize("name,value", [("adam", np.nan), ("sgd", np.inf)])
def test_optimizer_kernel_refuses_a_nonfinite_gradient_changing_nothing(name, value,
                                                                     gpu_model_kernels):
    rng = np.random.default_rng(3)
    host = {"a": rng.standard_normal((64, 16)).astype(np.float32),
            "b": rng.standard_normal(1001).astype(np.float32)}
    dev = {n: cuda.DeviceArray.from_numpy(a) for n, a in host.items()}
    o = optim.make(Config(optimizer=name, momentum=0.9), dev, gpu_model_kernels)
    g = {n: np.ones_like(a) for n, a in host.items()}
    g["b"][500] = value
    for clip in (5.0, 0.0):              # also unclipped: the norm is checked all the same
        with pytest.raises(optim.NonFiniteError,
                           match=r"non-finite gradient \(norm (nan|inf)\) in b$"):
            o.clip_and_step(dev, {n: cuda.DeviceArray.from_numpy(a) for n, a in g.items()},
                            1e-2, clip)
    assert o.t == 0
    for n in host:
        np.testing.assert_array_equal(dev[n].numpy(), host[n], err_msg=n)
    for n, a in o.state_dict().items():
        assert n == "t" or not a.any(), n


def test_training_on_the_gpu_stops_on_a_nonfinite_loss(tmp_path, gpu_target):
    config = Config(**TINY, steps=10, eval_every=0, save_minutes=0, target=gpu_target)
    gpu = Trainer(config, make_corpus(config))
    gpu.run(until=3, out=tmp_path / "c.npz", progress=False, handle_signals=False)
    w = gpu.params["head.weight"].numpy()     # NaN reaches the loss or dy = dlogits @ W
    w[2, 0] = np.nan
    gpu.params["head.weight"].copy_from(w)
    with pytest.raises(optim.NonFiniteError, match="at step 4: the step was not applied"):
        gpu.run(out=tmp_path / "c.npz", progress=False, handle_signals=False)
    assert gpu.step == 3 and checkpoint.load(tmp_path / "c.npz").step == 3


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_training_on_the_gpu_matches_the_cpu(cell, tmp_path, gpu_target):
    config = Config(**TINY, cell=cell, steps=30, eval_every=15, clip=1.0)
    corpus = make_corpus(config)
    cpu = Trainer(config, corpus)
    cpu.run(progress=False, handle_sigint=False)
    gpu = Trainer(config.replace(target=gpu_target), corpus)
    assert all(isinstance(p, cuda.DeviceArray) for p in gpu.params.values())
    gpu.run(until=15, out=tmp_path / "c.npz", progress=False, handle_sigint=False)
    assert all(isinstance(s, cuda.DeviceArray) for s in gpu.state)
    gpu.run(progress=False, handle_sigint=False)
    for key in ("train_loss", "val_loss"):
        assert_close(key, gpu.history[key], cpu.history[key], rtol=2e-3, atol=0,
                     per_element=True)
    losses = gpu.history["train_loss"]
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.05, losses   # 2.76 -> 2.66 (lstm)
    # the checkpoint resumes on the GPU exactly, and loads on the CPU
    ckpt = checkpoint.load(tmp_path / "c.npz")
    resumed = Trainer.resume(ckpt, corpus)
    resumed.run(progress=False, handle_sigint=False)
    assert_close("train_loss", resumed.history["train_loss"], gpu.history["train_loss"],
                 rtol=1e-6, atol=0, per_element=True)
    on_cpu = Trainer.resume(ckpt, corpus, ckpt.config.replace(target="host"))
    on_cpu.run(progress=False, handle_sigint=False)
    assert_close("train_loss", on_cpu.history["train_loss"], gpu.history["train_loss"],
                 rtol=2e-3, atol=0, per_element=True)
    model = CharLM.from_config(ckpt.config.replace(target="host"), len(corpus.vocab))
    model.load_parameters(ckpt.params)


def test_dropout_kernel_gives_the_cpu_bits(gpu_model_kernels):
    """The GPU's dropout masks are the CPU's (halstm.dropout.mask)
    bit for bit."""
    from halstm import dropout
    for p in (0.2, 0.7):
        threshold, scale = dropout.params(p)
        got = gpu_model_kernels.dropout((33, 5, 129), 77, 2**31 + 5, threshold, scale)
        np.testing.assert_array_equal(got.numpy(), dropout.mask((33, 5, 129), p, 77, 2**31 + 5))
