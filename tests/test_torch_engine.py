"""The char LM's torch engine (halstm train --engine torch): the same
model, data and optimizer semantics as the halstm engine, so both follow
the same loss curve and a checkpoint of one resumes in the other."""
import json

import numpy as np
import pytest

pytest.importorskip("torch")
from halstm.model import Config  # noqa: E402
from halstm.model.train import Trainer  # noqa: E402
from helpers import TINY, make_corpus, make_text, run_cli  # noqa: E402


def _losses(trainer, n):
    return np.array([trainer.train_step() for _ in range(n)])


@pytest.mark.parametrize("cell, optimizer", [("lstm", "adam"), ("gru", "sgd")])
def test_engines_follow_the_same_curve_and_resume_in_each_other(cell, optimizer):
    """Three steps in each engine (same seed) give the same losses and
    validation loss; each engine's checkpoint continues in the other as in
    itself for three more steps (parameters and optimizer state carried)."""
    config = Config(**TINY, cell=cell, optimizer=optimizer, steps=6, eval_every=0,
                    momentum=0.9 if optimizer == "sgd" else 0.0)
    corpus = make_corpus(config)
    runs = {e: Trainer(config.replace(engine=e), corpus) for e in ("halstm", "torch")}
    first = {e: _losses(t, 3) for e, t in runs.items()}
    np.testing.assert_allclose(first["torch"], first["halstm"], rtol=1e-5)
    np.testing.assert_allclose(runs["torch"].evaluate(), runs["halstm"].evaluate(), rtol=1e-5)
    for engine, other in (("halstm", "torch"), ("torch", "halstm")):
        ckpt = runs[engine].checkpoint()
        moved = Trainer.resume(ckpt, corpus, config.replace(engine=other))
        np.testing.assert_allclose(_losses(moved, 3), _losses(runs[engine], 3), rtol=1e-5,
                                   err_msg=f"{engine} checkpoint continued in {other}")


def test_cli_train_with_torch_engine_then_sample(tmp_path):
    text = tmp_path / "words.txt"
    text.write_text(make_text(4000), encoding="utf-8")
    out = tmp_path / "t.npz"
    run_cli("train", text, "--hidden-size", 16, "--layers", 2, "--seq-len", 8, "--batch-size",
            4, "--steps", 4, "--eval-every", 2, "-q", "--engine", "torch", "--out", out)
    meta = json.loads(str(np.load(out)["meta"]))
    assert meta["step"] == 4 and meta["config"]["engine"] == "torch"
    s = run_cli("sample", out, "--prime", "cab ", "--length", 20, "--seed", 3)
    assert s.output.startswith("cab ") and len(s.output) == 25
