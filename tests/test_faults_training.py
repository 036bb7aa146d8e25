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
import random
import resource
import signal
import subprocess
import sys
import time
import zipfile
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from halstm.cli import main as cli
from halstm.model import CharLM, CheckpointError, Config, Corpus, Trainer, checkpoint, optim
from halstm.model import commands, outputs, signals
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


# ---- class 1: non-finite loss or gradient --------------------------------------

@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_a_nonfinite_loss_stops_the_run_before_its_update(tmp_path, monkeypatch, value):
    config = Config(**TINY, steps=10, eval_every=0, save_every=0, save_minutes=0)
    trainer = Trainer(config, make_corpus(config))
    out = tmp_path / "c.npz"
    trainer.run(until=3, out=out, progress=False)
    snap = snapshot(trainer)
    hook_steps(monkeypatch, {1: nan_loss(value)})
    with pytest.raises(NonFiniteError, match=rf"non-finite training loss \({value}\) at step 4: "
                                             r"the step was not applied"):
        trainer.run(out=out, progress=False)
    assert trainer.step == 3 and len(trainer.history["train_loss"]) == 3
    assert_same_state(trainer, snap)                  # no update, data position put back
    assert_checkpoint_of(out, trainer, 3)
    assert listing(tmp_path) == ["c.npz"]


@pytest.mark.parametrize("name,value", [("head.weight", np.nan), ("rnn.weight_hh_l1", np.inf),
                                        ("rnn.bias_ih_l0", -np.inf)])
def test_a_nonfinite_gradient_stops_the_run_and_saves_the_last_good_step(
        tmp_path, monkeypatch, name, value):
    config = Config(**TINY, steps=10, eval_every=0, save_minutes=0)
    trainer = Trainer(config, make_corpus(config))
    out = tmp_path / "c.npz"
    hook_steps(monkeypatch, {5: nan_grad(name, value)})
    with pytest.raises(NonFiniteError, match=rf"non-finite gradient \(norm (nan|inf)\) in {name} "
                                             r"at step 5: the step was not applied"):
        trainer.run(out=out, progress=False)
    assert trainer.step == 4
    assert_checkpoint_of(out, trainer, 4)             # the last good step, written on the way out
    # resuming repeats the step exactly (the same batch, the same state)
    resumed = Trainer.resume(checkpoint.load(out), trainer.corpus)
    assert resumed.streams.position() == trainer.streams.position()


@pytest.mark.parametrize("head", ["numpy", "pipeline"])
def test_nan_in_the_head_propagates_to_the_loss_and_stops_the_run(tmp_path, monkeypatch, head):
    """The head's Halide pipeline (the default) and numpy's head
    (CharLM(kernels=False)): the class of the NaN bias is a target or not."""
    if head == "numpy":
        pipeline_head = CharLM.from_config
        monkeypatch.setattr(CharLM, "from_config", staticmethod(
            lambda cfg, vocab_size: pipeline_head(cfg, vocab_size, kernels=False)))
    config = Config(**TINY, steps=10, eval_every=0, save_minutes=0)
    trainer = Trainer(config, make_corpus(config))
    assert (trainer.model.kernels is not None) == (head == "pipeline")
    out = tmp_path / "c.npz"
    trainer.run(until=2, out=out, progress=False)
    before = out.read_bytes()
    trainer.params["head.bias"][3] = np.nan          # the model's own array
    with pytest.raises(NonFiniteError, match=r"non-finite training loss \(nan\) at step 3"):
        trainer.run(out=out, progress=False)
    assert trainer.step == 2 and out.read_bytes() == before     # never a NaN checkpoint
    with pytest.raises(NonFiniteError, match=r"the model holds NaN or Inf \(param/head.bias\)"):
        trainer.save(tmp_path / "other.npz")
    assert listing(tmp_path) == ["c.npz"]


def test_a_nonfinite_validation_loss_stops_the_run_keeping_the_last_save(tmp_path, monkeypatch):
    config = Config(**TINY, steps=10, eval_every=3, save_every=2, save_minutes=0)
    trainer = Trainer(config, make_corpus(config))
    out = tmp_path / "c.npz"
    real = Trainer.evaluate
    monkeypatch.setattr(Trainer, "evaluate",
                        lambda self, stop=None: float("nan") if self.step == 6 else real(self, stop))
    with pytest.raises(NonFiniteError, match=r"non-finite validation loss \(nan\) after step 6"):
        trainer.run(out=out, progress=False)
    assert checkpoint.load(out).step == 4 and trainer.saved_step == 4


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


@pytest.mark.parametrize("at_step,expect", [(4, "holds step 3"), (1, "nothing was written")])
def test_cli_stops_on_a_nonfinite_loss_with_status_3(tmp_path, text_file, monkeypatch,
                                                     at_step, expect):
    out = tmp_path / "o.npz"
    hook_steps(monkeypatch, {at_step: nan_loss()})
    r = run_cli(*TRAIN, text_file, "--steps", 8, "--out", out)
    assert r.exit_code == commands.EXIT_NONFINITE == 3, r.output
    line = error_line(r)
    assert f"non-finite training loss (nan) at step {at_step}: the step was not applied; " \
           f"training stopped; " in line and expect in line, line
    if at_step == 1:
        assert not out.exists()
    else:
        assert checkpoint.load(out).step == at_step - 1
    assert temps(tmp_path) == []


def test_cli_resume_that_fails_at_once_leaves_the_checkpoint_unchanged(tmp_path, text_file,
                                                                       monkeypatch):
    out = tmp_path / "o.npz"
    assert run_cli(*TRAIN, text_file, "--steps", 3, "--out", out).exit_code == 0
    before = out.read_bytes()
    hook_steps(monkeypatch, {1: nan_grad("rnn.weight_ih_l0")})
    r = run_cli(*TRAIN, text_file, "--steps", 6, "--resume", out)
    assert r.exit_code == 3
    assert "in rnn.weight_ih_l0 at step 4" in error_line(r) and f"{out} is unchanged" in r.output
    assert out.read_bytes() == before


# ---- class 4: output paths --------------------------------------------------------

def _link(kind, target, path):
    if kind == "symlink":
        path.symlink_to(target)
    else:
        os.link(target, path)
    return path


@pytest.mark.parametrize("how", ["same", "symlink", "hardlink"])
def test_out_naming_the_training_text_is_refused(tmp_path, text_file, how):
    out = text_file if how == "same" else _link(how, text_file, tmp_path / "alias.npz")
    before = text_file.read_bytes()
    r = run_cli(*TRAIN, text_file, "--steps", 2, "--out", out)
    assert r.exit_code == 1
    assert error_line(r) == (f"Error: --out {out} is the training text ({text_file}): halstm "
                             f"never writes over an input; give another --out")
    assert text_file.read_bytes() == before and temps(tmp_path) == []


def test_plot_naming_an_input_is_refused(tmp_path):
    text = tmp_path / "corpus.png"                  # an odd name, but an input all the same
    text.write_text(make_text(), encoding="utf-8")
    r = run_cli(*TRAIN, text, "--steps", 2, "--out", tmp_path / "o.npz", "--plot", text)
    assert r.exit_code == 1 and "is the training text" in error_line(r)
    assert listing(tmp_path) == ["corpus.png"]


@pytest.mark.parametrize("target,fragment", [
    ("/dev/null", "is not a regular file (a device, pipe or socket)"),
    ("fifo", "is not a regular file (a device, pipe or socket)"),
    ("notes.txt", "exists and is not a halstm checkpoint: refusing to replace it"),
    ("words.txt/o.npz", "is not a folder"),
])
def test_out_paths_that_must_not_be_written(tmp_path, text_file, target, fragment):
    if target == "fifo":
        os.mkfifo(tmp_path / "fifo")
    if target == "notes.txt":
        (tmp_path / "notes.txt").write_text("my notes")
    out = target if target.startswith("/") else tmp_path / target
    r = run_cli(*TRAIN, text_file, "--steps", 2, "--out", out)
    assert r.exit_code == 1 and fragment in error_line(r), r.output
    if target == "notes.txt":
        assert (tmp_path / "notes.txt").read_text() == "my notes"
    assert temps(tmp_path) == []


def test_plot_over_a_file_that_is_no_png_is_refused(tmp_path, text_file):
    (tmp_path / "p.png").write_text("not an image")
    r = run_cli(*TRAIN, text_file, "--steps", 2, "--out", tmp_path / "o.npz",
                "--plot", tmp_path / "p.png")
    assert "--plot" in error_line(r) and "exists and is not a PNG image" in error_line(r)
    assert (tmp_path / "p.png").read_text() == "not an image" and not (tmp_path / "o.npz").exists()


def test_out_and_plot_naming_one_file_are_refused(tmp_path, text_file):
    r = run_cli(*TRAIN, text_file, "--steps", 2, "--out", tmp_path / "x.png",
                "--plot", tmp_path / "x.png")
    assert error_line(r) == f"Error: --out and --plot name the same file {tmp_path / 'x.png'}"


def test_out_naming_a_folder_is_a_usage_error(tmp_path, text_file):
    r = run_cli(*TRAIN, text_file, "--steps", 2, "--out", tmp_path)
    assert r.exit_code == 2 and "is a directory" in r.output


def test_missing_output_folders_are_created(tmp_path, text_file):
    out, plot = tmp_path / "a" / "b" / "o.npz", tmp_path / "c" / "p.png"
    r = run_cli(*TRAIN, text_file, "--steps", 2, "--out", out, "--plot", plot)
    assert r.exit_code == 0, r.output
    assert checkpoint.load(out).step == 2 and plot.read_bytes()[:4] == b"\x89PNG"
    assert temps(out.parent) == [] and temps(plot.parent) == []


def test_nothing_is_created_when_the_input_is_bad(tmp_path):
    bad = tmp_path / "empty.txt"
    bad.write_text("")
    r = run_cli(*TRAIN, bad, "--steps", 2, "--out", tmp_path / "new" / "o.npz")
    assert r.exit_code == 1 and "is empty" in error_line(r)
    assert listing(tmp_path) == ["empty.txt"]


@pytest.mark.parametrize("which", ["--out", "--plot"])
def test_an_output_on_a_read_only_file_system_is_refused_before_training(
        tmp_path, text_file, monkeypatch, which):
    with tmpfs(tmp_path / "ro", "256k") as ro:
        remount(ro, "ro")
        calls = hook_steps(monkeypatch, {})
        paths = {"--out": tmp_path / "o.npz", "--plot": tmp_path / "p.png"}
        paths[which] = ro / "sub" / ("o.npz" if which == "--out" else "p.png")
        r = run_cli(*TRAIN, text_file, "--steps", 2, "--out", paths["--out"],
                    "--plot", paths["--plot"])
        assert r.exit_code == 1
        assert error_line(r) == (f"Error: {which} {paths[which]}: cannot write in {ro}: "
                                 f"Read-only file system")
        assert calls["n"] == 0 and listing(ro) == []
    assert listing(tmp_path) == ["ro", "words.txt"]


def test_a_file_system_too_full_for_one_checkpoint_is_refused_before_training(
        tmp_path, text_file, monkeypatch):
    with tmpfs(tmp_path / "full", "48k") as full:       # a tiny checkpoint is about 70 kB
        calls = hook_steps(monkeypatch, {})
        r = run_cli(*TRAIN, text_file, "--steps", 2, "--out", full / "o.npz")
        assert r.exit_code == 1
        assert error_line(r) == (f"Error: --out {full / 'o.npz'}: a trial checkpoint could not "
                                 f"be written: No space left on device")
        assert calls["n"] == 0 and listing(full) == []


def test_a_disk_that_fills_mid_run_keeps_training_and_saves_again_later(tmp_path):
    config = Config(**TINY, steps=8, eval_every=0, save_every=2, save_minutes=0)
    with tmpfs(tmp_path / "disk", "512k") as disk:
        out = disk / "c.npz"
        trainer = Trainer(config, make_corpus(config))
        messages = []
        trainer.run(until=3, out=out, progress=False, log=messages.append)
        assert checkpoint.load(out).step == 3
        filler = fill(disk)                               # full before the save of step 4
        assert trainer.run(until=5, out=out, progress=False, log=messages.append) == "stopped"
        assert messages == [
            f"warning: could not write the checkpoint {out} at step {n} ({why}): No space left "
            f"on device; the training state is kept in memory and the previous checkpoint left "
            f"as it was; trying again at the next save"
            for n, why in ((4, "periodic save"), (5, "end of the run"))]
        assert trainer.save_error.startswith("could not write") and trainer.saved_step is None
        assert checkpoint.load(out).step == 3                    # the previous one, intact
        assert sorted(listing(disk)) == ["c.npz", "filler"]      # no temporary file left
        filler.unlink()                                          # space again
        assert trainer.run(out=out, progress=False, log=messages.append) == "done"
        assert trainer.save_error is None and len(messages) == 2
        assert_checkpoint_of(out, trainer, 8)
    straight = Trainer(config, make_corpus(config))
    straight.run(progress=False)
    for k, v in straight.params.items():
        np.testing.assert_array_equal(trainer.params[k], v)     # the failed save changed nothing


@pytest.mark.parametrize("fault", ["full", "read-only"])
def test_cli_exits_4_when_the_final_save_fails_keeping_the_previous_checkpoint(
        tmp_path, text_file, monkeypatch, fault):
    with tmpfs(tmp_path / "disk", "512k") as disk:
        out = disk / "o.npz"

        def break_disk(_):
            if fault == "full":
                fill(disk)
            else:
                remount(disk, "ro")
        hook_steps(monkeypatch, {5: break_disk})
        r = run_cli(*TRAIN, text_file, "--steps", 6, "--save-every", 4, "--out", out)
        why = "No space left on device" if fault == "full" else "Read-only file system"
        assert r.exit_code == commands.EXIT_NOT_SAVED == 4, r.output
        assert error_line(r) == (f"Error: could not write the checkpoint {out} at step 6 (end of "
                                 f"the run): {why}; the trained state of step 6 is lost (free "
                                 f"space or fix the folder, then run again)")
        assert f"checkpoint not written ({out} holds step 4 " in r.output
        assert checkpoint.load(out).step == 4
        assert temps(disk) == []


def test_an_unwritable_plot_at_the_end_is_reported_not_a_traceback(tmp_path, text_file,
                                                                   monkeypatch):
    with tmpfs(tmp_path / "disk", "512k") as disk:
        hook_steps(monkeypatch, {2: lambda _: fill(disk)})
        out, plot = tmp_path / "o.npz", disk / "p.png"
        r = run_cli(*TRAIN, text_file, "--steps", 3, "--out", out, "--plot", plot)
        assert r.exit_code == 4, r.output
        assert error_line(r) == (f"Error: could not write the plot {plot}: No space left on "
                                 f"device")
        assert checkpoint.load(out).step == 3 and listing(disk) == ["filler"]


def test_a_plot_that_matplotlib_cannot_draw_is_reported(tmp_path, text_file, monkeypatch):
    from halstm.model import plot as plot_mod

    def broken(*a, **k):
        raise RuntimeError("no renderer")
    monkeypatch.setattr(plot_mod, "plot_curves", broken)
    r = run_cli(*TRAIN, text_file, "--steps", 2, "--out", tmp_path / "o.npz",
                "--plot", tmp_path / "p.png")
    assert r.exit_code == 4
    assert error_line(r) == (f"Error: could not write the plot {tmp_path / 'p.png'}: "
                             f"RuntimeError: no renderer")
    assert checkpoint.load(tmp_path / "o.npz").step == 2


def test_temporary_files_of_dead_writers_are_removed_at_the_start(tmp_path, text_file):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    tag = checkpoint._host_tag()
    stale = tmp_path / f".o.npz.{dead.pid}@{tag}.abc123.tmp"
    live = tmp_path / f".o.npz.{os.getpid()}@{tag}.def456.tmp"
    other_host = tmp_path / f".o.npz.{dead.pid}@{'0' * 8 if tag != '0' * 8 else '1' * 8}.x.tmp"
    for p in (stale, live, other_host):
        p.write_bytes(b"half a checkpoint")
    r = run_cli(*TRAIN, text_file, "--steps", 2, "--out", tmp_path / "o.npz")
    assert r.exit_code == 0, r.output
    assert not stale.exists() and live.exists() and other_host.exists()


def test_output_checks_directly():
    with pytest.raises(outputs.OutputError, match=r"--out '.': expected a file name"):
        outputs.check("", "--out", "checkpoint")
    with pytest.raises(ValueError, match="kind"):
        outputs.check("x", "--out", "zip")


# ---- class 5: signals ----------------------------------------------------------------

@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_signal_during_training_saves_and_exits_with_128_plus_n(tmp_path, text_file,
                                                                  monkeypatch, signum):
    out = tmp_path / "o.npz"
    handlers = {s: signal.getsignal(s) for s in SIG_NAMES}
    hook_steps(monkeypatch, {4: lambda _: os.kill(os.getpid(), signum)})
    r = run_cli(*TRAIN, text_file, "--steps", 50, "--out", out)
    assert r.exit_code == 128 + signum
    assert (f"interrupted by {SIG_NAMES[signum]}: {out} holds step 4; continue with  "
            f"halstm train {text_file} --resume {out}") in r.output
    assert checkpoint.load(out).step == 4 and listing(tmp_path) == ["o.npz", "words.txt"]
    assert {s: signal.getsignal(s) for s in SIG_NAMES} == handlers      # put back


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_setup_or_the_first_step_stops_at_once_writing_nothing(
        tmp_path, text_file, monkeypatch, signum):
    out = tmp_path / "o.npz"
    calls = hook_steps(monkeypatch, {1: lambda _: os.kill(os.getpid(), signum)})
    r = run_cli(*TRAIN, text_file, "--steps", 50, "--out", out)
    assert r.exit_code == 128 + signum and calls["n"] == 1
    assert (f"interrupted by {SIG_NAMES[signum]} (stopped at once): nothing was written to "
            f"{out}") in r.output
    assert listing(tmp_path) == ["words.txt"]
    # while reading the text
    from halstm.model import data
    real = data.load
    monkeypatch.setattr(data, "load", lambda p: (os.kill(os.getpid(), signum), real(p))[1])
    r = run_cli(*TRAIN, text_file, "--steps", 50, "--out", out)
    assert r.exit_code == 128 + signum and "nothing was written" in r.output
    assert listing(tmp_path) == ["words.txt"]


def test_a_second_signal_during_the_save_abandons_it_keeping_the_previous_checkpoint(
        tmp_path, text_file, monkeypatch):
    out = tmp_path / "o.npz"
    assert run_cli(*TRAIN, text_file, "--steps", 3, "--out", out).exit_code == 0
    before = out.read_bytes()
    real, calls = np.savez, []

    def savez(f, **arrays):                    # both signals arrive while the file is written
        calls.append(1)
        if len(calls) == 2:                    # the first is the trial write before training
            f.write(b"partial")
            os.kill(os.getpid(), signal.SIGTERM)   # deferred: the save goes on ...
            os.kill(os.getpid(), signal.SIGINT)    # ... until the second one
        real(f, **arrays)
    monkeypatch.setattr(checkpoint.np, "savez", savez)
    r = run_cli(*TRAIN, text_file, "--steps", 9, "--resume", out, "--save-every", 5)
    assert r.exit_code == 130
    assert f"interrupted by SIGINT (stopped at once): {out} is unchanged" in r.output
    assert out.read_bytes() == before and listing(tmp_path) == ["o.npz", "words.txt"]


def test_a_signal_during_validation_drops_it_and_saves(tmp_path, text_file, monkeypatch):
    out = tmp_path / "o.npz"
    real = Trainer.evaluate

    def evaluate(self, stop=None):
        if self.step == 4:
            os.kill(os.getpid(), signal.SIGHUP)
        return real(self, stop)
    monkeypatch.setattr(Trainer, "evaluate", evaluate)
    r = run_cli(*TRAIN, text_file, "--steps", 50, "--out", out)
    assert r.exit_code == 129
    ckpt = checkpoint.load(out)
    assert ckpt.step == 4 and list(ckpt.history["val_step"]) == [2]     # step 4's dropped


def test_the_trainer_refuses_to_save_a_step_cut_short(tmp_path, monkeypatch):
    config = Config(**TINY, steps=5, eval_every=0, save_minutes=0)
    trainer = Trainer(config, make_corpus(config))
    hook_steps(monkeypatch, {1: lambda _: os.kill(os.getpid(), signal.SIGTERM)})
    with pytest.raises(signals.Interrupted) as e:
        trainer.run(out=tmp_path / "c.npz", progress=False)
    assert e.value.signum == signal.SIGTERM and e.value.exit_status == 143
    with pytest.raises(RuntimeError, match="stopped in the middle of a step"):
        trainer.save(tmp_path / "c.npz")
    assert listing(tmp_path) == []


def test_saves_come_by_time(tmp_path, monkeypatch):
    config = Config(**TINY, steps=7, eval_every=0, save_minutes=1.0)
    trainer = Trainer(config, make_corpus(config))
    clock = {"t": 1000.0}
    monkeypatch.setattr("halstm.model.train._clock", lambda: clock["t"])
    saved = []
    real = Trainer.save

    def save(self, path):
        saved.append(self.step)
        real(self, path)
    monkeypatch.setattr(Trainer, "save", save)

    def tick(_):
        clock["t"] += 25.0                     # each step "takes" 25 s
    hook_steps(monkeypatch, {n: tick for n in range(1, 8)})
    assert trainer.run(out=tmp_path / "c.npz", progress=False) == "done"
    assert saved == [3, 6, 7]                  # 75 s, 150 s, then the end


def _spawn(args, env=None, **kw):
    return subprocess.Popen([sys.executable, "-m", "halstm.cli", *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})}, **kw)


def _wait_for(path, timeout=60):
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.02)


def _finish(proc, timeout=120):
    try:
        return proc.communicate(timeout=timeout)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("signum,seed", [(signal.SIGINT, 0), (signal.SIGTERM, 1),
                                         (signal.SIGHUP, 2), (signal.SIGTERM, 3),
                                         (signal.SIGINT, 4), (signal.SIGHUP, 5)])
def test_real_signals_at_random_points_of_a_real_run(tmp_path, text_file, signum, seed):
    """A `halstm train` process saving every few steps (--save-minutes
    0.0005: 30 ms) and validating often gets a signal at a random moment:
    a step, a validation, a save."""
    out = tmp_path / "o.npz"
    proc = _spawn([*TRAIN, text_file, "--steps", 10 ** 6, "--eval-every", 7,
                   "--save-minutes", "0.0005", "--out", out])
    try:
        header = proc.stderr.readline()
        assert "LSTM 2 x 16" in header, header
        time.sleep(random.Random(seed).uniform(0.0, 1.5))
        proc.send_signal(signum)
    finally:
        err = _finish(proc)
    assert proc.returncode == 128 + signum, err
    assert "Traceback" not in err and f"interrupted by {SIG_NAMES[signum]}" in err
    assert temps(tmp_path) == []
    if out.exists():
        ckpt = checkpoint.load(out)
        assert ckpt.step >= 1 and len(ckpt.history["train_loss"]) == ckpt.step
        assert f"{out} holds step {ckpt.step}; continue with" in err
    else:
        assert "stopped at once" in err and "nothing was written" in err


def test_two_quick_sigterms_end_the_run_with_no_temporary_file(tmp_path, text_file):
    out = tmp_path / "o.npz"
    proc = _spawn([*TRAIN, text_file, "--steps", 10 ** 6, "--save-minutes", "0.0005",
                   "--out", out])
    try:
        _wait_for(out)
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        proc.send_signal(signal.SIGTERM)
    finally:
        err = _finish(proc)
    assert proc.returncode == 143 and "Traceback" not in err, err
    assert temps(tmp_path) == []
    assert checkpoint.load(out).step >= 1                  # a periodic save, whole


def test_a_killed_run_resumes_exactly_like_an_uninterrupted_one(tmp_path, text_file):
    out, straight = tmp_path / "o.npz", tmp_path / "straight.npz"
    proc = _spawn([*TRAIN, text_file, "--steps", 1000, "--eval-every", 50, "--save-every", 100,
                   "--out", out])
    try:
        _wait_for(out)                         # step 100 saved: the run is under way
        proc.send_signal(signal.SIGTERM)
    finally:
        err = _finish(proc)
    if proc.returncode == 0:
        pytest.skip("the run finished before the signal")
    assert proc.returncode == 143, err
    assert 100 <= checkpoint.load(out).step < 1000
    r = subprocess.run([sys.executable, "-m", "halstm.cli", "train", str(text_file), "--resume",
                        str(out), "-q"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert run_cli(*TRAIN, text_file, "--steps", 1000, "--eval-every", 50,
                   "--out", straight).exit_code == 0
    a, b = checkpoint.load(out), checkpoint.load(straight)
    assert a.step == b.step == 1000
    for k in b.params:
        np.testing.assert_array_equal(a.params[k], b.params[k], err_msg=k)
    for k in b.optimizer:
        np.testing.assert_array_equal(a.optimizer[k], b.optimizer[k], err_msg=k)


def test_a_sigkill_loses_at_most_the_work_since_the_last_periodic_save(tmp_path, text_file):
    out = tmp_path / "o.npz"
    proc = _spawn([*TRAIN, text_file, "--steps", 10 ** 6, "--save-minutes", "0.005",
                   "--out", out])
    try:
        _wait_for(out)
        time.sleep(0.5)
        proc.kill()
    finally:
        _finish(proc)
    assert proc.returncode == -signal.SIGKILL
    assert checkpoint.load(out).step >= 1
    # a temporary file it may have left is removed by the next run
    r = run_cli(*TRAIN, text_file, "--resume", out, "--save-minutes", 0, "--eval-every", 0,
                "--steps", checkpoint.load(out).step + 1)
    assert r.exit_code == 0, r.output
    assert listing(tmp_path) == ["o.npz", "words.txt"]


@pytest.mark.parametrize("signum,group", [(signal.SIGINT, False), (signal.SIGTERM, False),
                                          (signal.SIGINT, True)])
def test_a_signal_during_the_first_build_exits_leaving_nothing_half_written(
        tmp_path, text_file, signum, group):
    """A fresh kernel cache: the first step builds the kernels. group: the
    signal goes to the whole process group, as a terminal's Ctrl-C does
    (the compiler and linker children get it too)."""
    cache, out = tmp_path / "cache", tmp_path / "o.npz"
    proc = _spawn([*TRAIN, text_file, "--steps", 5, "--out", out],
                  env={"HALSTM_CACHE": str(cache)}, start_new_session=True)
    def building():
        return cache.exists() and any(p.name.startswith(".tmp-") for p in cache.iterdir())
    try:
        # a build that is still going 0.1 s after it was seen (the first
        # step builds several kernels; one may finish within the wait)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if building():
                time.sleep(0.1)
                if building():
                    break
            time.sleep(0.02)
        assert proc.poll() is None, "the build finished before the test saw it"
        if group:
            os.killpg(proc.pid, signum)
        else:
            proc.send_signal(signum)
    finally:
        err = _finish(proc, timeout=300)
    assert proc.returncode == 128 + signum, err
    assert "Traceback" not in err
    assert f"interrupted by {SIG_NAMES[signum]} (stopped at once): nothing was written" in err
    assert listing(tmp_path) == ["cache", "words.txt"]
    assert [p.name for p in cache.iterdir() if p.name.startswith(".tmp-")] == []
    assert all((p / "manifest.json").exists() for p in cache.iterdir() if p.is_dir())


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
