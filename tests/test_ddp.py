"""examples/ddp_charlm.py under torchrun with 2 CPU processes (gloo): the
gradients after one step equal one process's over the combined batch."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)
from helpers import H, I, assert_close, make_text  # noqa: E402

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "ddp_charlm.py"


def test_two_processes_match_one(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(make_text(3000))
    args = ["--text", str(text), "--steps", "1", "--batch", "4", "--seq", "9", "--embed",
            str(I), "--hidden", str(H), "--layers", "2", "--device", "cpu"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    one = subprocess.run([sys.executable, str(SCRIPT), *args, "--dump-grads",
                          str(tmp_path / "one.npz")], env=env, capture_output=True, text=True)
    assert one.returncode == 0, one.stderr[-3000:]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc_per_node=2", str(SCRIPT), *args, "--dump-grads",
                          str(tmp_path / "two.npz")], env=env, capture_output=True, text=True)
    assert two.returncode == 0, (two.stdout + two.stderr)[-3000:]
    assert "over 2 processes" in two.stdout
    want, got = np.load(tmp_path / "one.npz"), np.load(tmp_path / "two.npz")
    assert sorted(got.files) == sorted(want.files) and "rnn.weight_hh_l1" in got.files
    for k in want.files:
        assert_close(f"d {k}", got[k], want[k])
