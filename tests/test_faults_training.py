"""Fault injection for training (issue 23, the training side): non-finite
losses and gradients, output paths, signals, damaged and hostile
checkpoints. Every case asserts the exact outcome: the error and its
message, the exit status, the files left behind, the checkpoint still
loadable (or byte for byte unchanged).

Models are tiny (16 units, a 16-character vocabulary) and share the
kernels of tests/test_model.py. Read-only and full file systems are small
tmpfs mounts, which need root: those cases skip elsewhere.
"""
import io
import json
import os
import resource
import signal
import subprocess
import sys
import zipfile
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from halstm.cli import main as cli
from halstm.model import CharLM, CheckpointError, Config, Corpus, checkpoint, optim
from halstm.model.charlm import parameter_shapes
from halstm.model.optim import NonFiniteError

ALPHABET = "abcdefghijklmn \n"            # 16 symbols
WORDS = ["bad", "cab", "fig", "hen", "jam", "kind", "lime", "mile", "can", "dig",
         "aged", "glen", "hale", "mink", "jib", "fen"]
TINY = dict(hidden_size=16, layers=2, seq_len=8, batch_size=4, eval_batch_size=8)
TRAIN = ["train", "--hidden-size", "16", "--layers", "2", "--seq-len", "8", "--batch-size", "4",
         "--eval-every", "2", "-q"]
SIG_NAMES = {signal.SIGINT: "SIGINT", signal.SIGTERM: "SIGTERM", signal.SIGHUP: "SIGHUP"}


def make_text(n_chars: int = 4000, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    out, size = [ALPHABET], len(ALPHABET)
    while size < n_chars:
        line = " ".join(rng.choice(WORDS, size=rng.integers(2, 6))) + "\n"
        out.append(line)
        size += len(line)
    return "".join(out)[:n_chars]


def make_corpus(config):
    return Corpus.from_text(make_text(), "test", config.seq_len, config.batch_size)


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "words.txt"
    path.write_text(make_text(), encoding="utf-8")
    return path


def run_cli(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def error_line(result) -> str:
    """The result's one non-empty line starting with "Error: "."""
    lines = [ln for ln in result.output.splitlines() if ln.startswith("Error: ")]
    assert len(lines) == 1, result.output
    assert "Traceback" not in result.output, result.output
    return lines[0]


def listing(folder) -> list:
    return sorted(p.name for p in Path(folder).iterdir())


def temps(folder) -> list:
    return [n for n in listing(folder) if n.endswith(".tmp") or ".halstm-probe-" in n]


def snapshot(trainer):
    return ({k: np.array(v) for k, v in trainer.params.items()},
            {k: np.array(v) for k, v in trainer.optimizer.state_dict().items()},
            trainer.streams.position(), [np.array(s) for s in trainer.state])


def assert_same_state(trainer, snap):
    params, opt, position, state = snap
    for k, v in trainer.params.items():
        np.testing.assert_array_equal(v, params[k], err_msg=k)
    for k, v in trainer.optimizer.state_dict().items():
        np.testing.assert_array_equal(v, opt[k], err_msg=k)
    assert trainer.streams.position() == position
    for a, b in zip(trainer.state, state):
        np.testing.assert_array_equal(a, b)


def assert_checkpoint_of(path, trainer, step):
    """path loads, holds `step`, and equals the trainer's state."""
    ckpt = checkpoint.load(path)
    assert ckpt.step == step == trainer.step
    for k, v in trainer.params.items():
        np.testing.assert_array_equal(ckpt.params[k], v, err_msg=k)
    for k, v in trainer.optimizer.state_dict().items():
        np.testing.assert_array_equal(ckpt.optimizer[k], v, err_msg=k)
    assert ckpt.position == trainer.streams.position()
    assert list(ckpt.history["train_loss"]) == trainer.history["train_loss"]
    return ckpt


@contextmanager
def tmpfs(path: Path, size: str):
    """A tmpfs of `size` mounted at path (root only; skip otherwise)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    path.mkdir(exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def remount(path: Path, mode: str):
    subprocess.run(["mount", "-o", f"remount,{mode}", str(path)], check=True, capture_output=True)


def fill(folder: Path, leave: int = 0) -> Path:
    """Fill the file system of folder until at most `leave` bytes are free."""
    filler = folder / "filler"
    st = os.statvfs(folder)
    free = st.f_bavail * st.f_frsize
    with open(filler, "ab") as f:
        try:
            f.write(b"\0" * max(0, free - leave))
            f.flush()
            os.fsync(f.fileno())
        except OSError:
            pass
    return filler


def hook_steps(monkeypatch, actions: dict):
    """Run actions[n]() (n: 1-based call count) inside CharLM.loss_and_grads,
    after the forward and backward of that call; an action may return a
    replacement (loss, grads, state)."""
    real = CharLM.loss_and_grads
    calls = {"n": 0}

    def patched(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        calls["n"] += 1
        act = actions.get(calls["n"])
        if act is not None:
            replaced = act(out)
            if isinstance(replaced, tuple):
                out = replaced
        return out
    monkeypatch.setattr(CharLM, "loss_and_grads", patched)
    return calls


def nan_loss(value=np.nan):
    return lambda out: (float(value), out[1], out[2])


def nan_grad(name, value=np.nan):
    def act(out):
        grads = dict(out[1])
        g = np.array(grads[name])
        g.reshape(-1)[0] = value
        grads[name] = g
        return out[0], grads, out[2]
    return act


# ---- class 1: non-finite gradients in the optimizers ---------------------------

@pytest.mark.parametrize("opt,momentum,value", [("adam", 0.0, np.nan), ("adam", 0.0, np.inf),
                                                ("sgd", 0.0, np.nan), ("sgd", 0.9, -np.inf)])
def test_the_numpy_optimizers_refuse_a_nonfinite_gradient_changing_nothing(opt, momentum, value):
    rng = np.random.default_rng(0)
    params = {"a": rng.standard_normal((4, 3)).astype(np.float32),
              "b": rng.standard_normal(5).astype(np.float32)}
    o = optim.make(Config(optimizer=opt, momentum=momentum), params)
    o.clip_and_step(params, {k: np.ones_like(p) for k, p in params.items()}, 0.1, 1.0)
    before = ({k: p.copy() for k, p in params.items()},
              {k: np.array(v) for k, v in o.state_dict().items()})
    grads = {k: np.ones_like(p) for k, p in params.items()}
    grads["b"][2] = value
    with pytest.raises(NonFiniteError, match=r"non-finite gradient \(norm (nan|inf)\) in b$"):
        o.clip_and_step(params, grads, 0.1, 1.0)
    for k, p in params.items():
        np.testing.assert_array_equal(p, before[0][k])
    for k, v in o.state_dict().items():
        np.testing.assert_array_equal(v, before[1][k])
    assert o.t == 1


@pytest.mark.parametrize("opt,clip", [("adam", 5.0), ("sgd", 0.0)])
def test_the_kernel_optimizers_refuse_a_nonfinite_gradient_changing_nothing(opt, clip):
    from halstm.model import library
    k = library.kernels("host")
    rng = np.random.default_rng(1)
    params = {"a": rng.standard_normal((4, 3)).astype(np.float32),
              "b": rng.standard_normal(7).astype(np.float32)}
    o = optim.make(Config(optimizer=opt, momentum=0.5), params, k)
    before = ({n: p.copy() for n, p in params.items()},
              {n: np.array(v) for n, v in o.state_dict().items()})
    grads = {n: np.ones_like(p) for n, p in params.items()}
    grads["a"][1, 2] = np.nan
    with pytest.raises(NonFiniteError, match=r"non-finite gradient \(norm nan\) in a$"):
        o.clip_and_step(params, grads, 0.1, clip)
    for n, p in params.items():
        np.testing.assert_array_equal(p, before[0][n])
    for n, v in o.state_dict().items():
        np.testing.assert_array_equal(v, before[1][n])
    grads["a"][1, 2] = 1.0                            # and a finite step still works
    assert o.clip_and_step(params, grads, 0.1, clip) == pytest.approx(np.sqrt(19), rel=1e-6)
    assert o.t == 1 and not np.array_equal(params["a"], before[0]["a"])


# ---- class 6: damaged and hostile checkpoints -------------------------------------------

@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A checkpoint of 3 steps and the text it was trained on."""
    folder = tmp_path_factory.mktemp("good")
    text = folder / "words.txt"
    text.write_text(make_text(), encoding="utf-8")
    path = folder / "good.npz"
    r = run_cli(*TRAIN, text, "--steps", 3, "--out", path)
    assert r.exit_code == 0, r.output
    return path, text


def read_arrays(path) -> dict:
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


def with_meta(arrays, **config_changes):
    arrays = dict(arrays)
    meta = json.loads(str(arrays["meta"]))
    for k, v in config_changes.items():
        if k in ("vocab", "step", "position"):
            meta[k] = v
        else:
            meta["config"][k] = v
    arrays["meta"] = np.array(json.dumps(meta))
    return arrays


def write(path, arrays, compressed=False):
    (np.savez_compressed if compressed else np.savez)(path, **arrays)
    return path


def assert_refused(path, good_text, fragment):
    """load, sample and train --resume all refuse path with one line that
    names it and `fragment`; the file is left as it was."""
    before = Path(path).read_bytes()
    with pytest.raises(CheckpointError) as e:
        checkpoint.load(path)
    assert str(path) in str(e.value) and fragment in str(e.value), str(e.value)
    assert "\n" not in str(e.value)
    for args in (["sample", path], ["train", good_text, "--resume", path, "--steps", 9, "-q"]):
        r = run_cli(*args)
        assert r.exit_code == 1, r.output
        assert error_line(r) == f"Error: {e.value}"
    assert Path(path).read_bytes() == before


@pytest.mark.parametrize("change,fragment", [
    ({"hidden_size": 10 ** 6}, "array 'param/rnn.weight_ih_l0' has shape (64, 16), but the "
                               "header's config (lstm, hidden_size 1000000, layers 2"),
    ({"layers": 1000}, "array 'param/rnn.weight_ih_l2' is missing"),
    ({"batch_size": 10 ** 9}, "array 'state/0' has shape (2, 4, 16), but"),
    ({"cell": "gru"}, "unexpected array 'state/1' (not part of a checkpoint of the header's "
                      "config (gru, hidden_size 16"),
    ({"optimizer": "sgd", "momentum": 0.9}, "unexpected array 'opt/m/head.bias'"),
    ({"lr": "Infinity"}, "corrupt header: lr: expected a finite number, got inf"),
    ({"warmup_steps": -1}, "corrupt header: warmup_steps: expected an int >= 0"),
    ({"vocab": ["a"]}, "corrupt header: vocab: expected a string, got list"),
    ({"step": -3}, "corrupt header: step: expected an int >= 0, got -3"),
    ({"surprise": 1}, "corrupt header: unknown config keys ['surprise']"),
])
def test_a_tampered_header_names_what_does_not_fit(tmp_path, good, change, fragment):
    path, text = good
    arrays = read_arrays(path)
    if change.get("lr") == "Infinity":
        meta = str(arrays["meta"]).replace('"lr": 0.002', '"lr": Infinity')
        arrays["meta"] = np.array(meta)
    else:
        arrays = with_meta(arrays, **change)
    assert_refused(write(tmp_path / "t.npz", arrays), text, fragment)


def _set_npy_header(member: bytes, shape) -> bytes:
    """An .npy member whose header claims another shape, data unchanged."""
    f = io.BytesIO(member)
    version = np.lib.format.read_magic(f)
    _, fortran, dtype = np.lib.format.read_array_header_1_0(f)
    data = member[f.tell():]
    out = io.BytesIO()
    np.lib.format.write_array_header_1_0(out, {"descr": np.lib.format.dtype_to_descr(dtype),
                                               "fortran_order": fortran, "shape": shape})
    assert version == (1, 0)
    return out.getvalue() + data


def rewrite_member(src, dst, name, fn):
    with zipfile.ZipFile(src) as zi, zipfile.ZipFile(dst, "w") as zo:
        for info in zi.infolist():
            data = zi.read(info)
            if info.filename == name + ".npy":
                data = fn(data)
            zo.writestr(info.filename, data)
    return dst


@pytest.mark.parametrize("shape,fragment", [
    ((10 ** 6, 10 ** 6), "claims shape (1000000, 1000000) (4000000000000 bytes of float32) but "
                         "the file holds 1024 bytes for it (damaged or tampered)"),
    ((16, 8), "claims shape (16, 8) (512 bytes of float32) but the file holds 1024 bytes"),
])
def test_an_array_header_that_lies_about_its_size_is_refused(tmp_path, good, shape, fragment):
    path, text = good
    bad = rewrite_member(path, tmp_path / "t.npz", "param/head.weight",
                         lambda m: _set_npy_header(m, shape))
    assert_refused(bad, text, fragment)


@pytest.mark.parametrize("damage,fragment", [
    ("truncated-10", "not a readable halstm checkpoint"),
    ("truncated-50", "not a readable halstm checkpoint"),
    ("truncated-99", "not a readable halstm checkpoint"),
    ("missing-last-byte", "not a readable halstm checkpoint"),
    ("flipped-data-byte", "Bad CRC-32"),
    ("empty", "not a readable halstm checkpoint"),
    ("appended-garbage", ""),
])
def test_damaged_files_are_refused(tmp_path, good, damage, fragment):
    path, text = good
    data = path.read_bytes()
    with zipfile.ZipFile(path) as z:
        info = z.getinfo("param/head.weight.npy")
    start = info.header_offset + 30 + len(info.filename) + 128 + 40   # inside the array's data
    bad = {"truncated-10": data[: len(data) // 10], "truncated-50": data[: len(data) // 2],
           "truncated-99": data[: len(data) * 99 // 100], "missing-last-byte": data[:-1],
           "flipped-data-byte": data[:start] + bytes([data[start] ^ 0x40]) + data[start + 1:],
           "empty": b"", "appended-garbage": data + b"\0" * 100}[damage]
    p = tmp_path / "bad.npz"
    p.write_bytes(bad)
    if damage == "appended-garbage":               # zip readers allow trailing data: it loads
        assert checkpoint.load(p).step == 3
        return
    assert_refused(p, text, fragment)


@pytest.mark.parametrize("edit,fragment", [
    ("float64", "array 'param/head.bias' is float64, expected float32"),
    ("drop", "array 'param/head.bias' is missing (the header's config (lstm, hidden_size 16"),
    ("extra", "unexpected array 'param/rnn.weight_ih_l7'"),
    ("object", "holds Python objects"),
    ("compressed", "array 'format' is compressed (checkpoints are written uncompressed)"),
    ("history", "history/train_step has 3 entries but history/train_loss 2"),
    ("no-meta", "has no header (array 'meta')"),
    ("format", "is not a halstm char-LM checkpoint (format 'halstm-charlm/99'"),
    ("opt-t", "array 'opt/t' is int32, expected int64"),
])
def test_wrong_arrays_are_named(tmp_path, good, edit, fragment):
    path, text = good
    arrays = read_arrays(path)
    compressed = False
    if edit == "float64":
        arrays["param/head.bias"] = arrays["param/head.bias"].astype(np.float64)
    elif edit == "drop":
        del arrays["param/head.bias"]
    elif edit == "extra":
        arrays["param/rnn.weight_ih_l7"] = np.zeros(3, np.float32)
    elif edit == "object":
        p = tmp_path / "t.npz"
        del arrays["param/head.bias"]
        write(p, arrays)
        with zipfile.ZipFile(p, "a") as z:
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.array([{"x": 1}], dtype=object), allow_pickle=True)
            z.writestr("param/head.bias.npy", buf.getvalue())
        assert_refused(p, text, fragment)
        return
    elif edit == "compressed":
        compressed = True
    elif edit == "history":
        arrays["history/train_loss"] = arrays["history/train_loss"][:2]
    elif edit == "no-meta":
        del arrays["meta"]
    elif edit == "format":
        arrays["format"] = np.array("halstm-charlm/99")
    elif edit == "opt-t":
        arrays["opt/t"] = arrays["opt/t"].astype(np.int32)
    assert_refused(write(tmp_path / "t.npz", arrays, compressed), text, fragment)


@pytest.mark.parametrize("what,fragment", [
    ("folder", "is a folder, not a checkpoint file"),
    ("device", "not a regular file"),
    ("text", "not a readable halstm checkpoint (corrupt or another kind of file: not an .npz"),
])
def test_files_that_are_no_checkpoint_at_all(tmp_path, good, what, fragment):
    path, text = good
    p = {"folder": tmp_path, "device": Path("/dev/zero"), "text": text}[what]
    with pytest.raises(CheckpointError) as e:
        checkpoint.load(p)
    assert fragment in str(e.value)
    r = run_cli("sample", p)
    assert r.exit_code != 0 and "Traceback" not in r.output


def test_a_resume_whose_data_position_does_not_fit_is_refused(tmp_path, good):
    path, text = good
    arrays = read_arrays(path)
    meta = json.loads(str(arrays["meta"]))
    meta["position"]["index"] = 10 ** 9
    arrays["meta"] = np.array(json.dumps(meta))
    p = write(tmp_path / "t.npz", arrays)
    r = run_cli("train", text, "--resume", p, "--steps", 9, "-q")
    assert r.exit_code == 1
    assert "does not fit its own config (corrupt?): data position" in error_line(r)
    assert run_cli("sample", p, "--length", 5, "--seed", 1).exit_code == 0   # weights are fine


@pytest.mark.parametrize("option,value,fragment", [
    ("--cell", "gru", "--cell gru differs from the checkpoint's 'lstm'"),
    ("--seq-len", "16", "--seq-len 16 differs from the checkpoint's 8"),
    ("--lr", "0.5", "--lr 0.5 differs from the checkpoint's 0.002"),
])
def test_resume_with_another_config_names_the_option(tmp_path, good, option, value, fragment):
    path, text = good
    copy = tmp_path / "c.npz"
    copy.write_bytes(path.read_bytes())
    r = run_cli("train", text, "--resume", copy, "--steps", 9, option, value)
    assert r.exit_code == 1 and fragment in error_line(r)
    assert copy.read_bytes() == path.read_bytes()


def test_a_tampered_size_never_allocates_it(tmp_path, good):
    """hidden_size 30000 (the weights alone would take 29 GB) in a process
    limited to 3 GB of address space: a one-line error, not a MemoryError."""
    path, text = good
    bad = write(tmp_path / "t.npz", with_meta(read_arrays(path), hidden_size=30000))

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
    cmd = [sys.executable, "-m", "halstm.cli", "sample"]
    ok = subprocess.run(cmd + [str(path), "--length", "5"], capture_output=True, text=True,
                        preexec_fn=limit)
    if ok.returncode != 0:
        pytest.skip(f"sampling does not run in 3 GB here: {ok.stderr[-300:]}")
    r = subprocess.run(cmd + [str(bad)], capture_output=True, text=True, preexec_fn=limit)
    assert r.returncode == 1 and r.stderr.startswith("Error: ") and "Memory" not in r.stderr
    assert "hidden_size 30000" in r.stderr and r.stderr.count("\n") == 1


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_the_expected_shapes_are_the_model_s_own(cell):
    model = CharLM(16, cell, hidden_size=16, layers=3, seed=0)
    assert parameter_shapes(16, cell, 16, 3) == {k: v.shape for k, v in model.parameters().items()}
