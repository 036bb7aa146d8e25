"""examples/ddp_charlm.py under torchrun with 2 CPU processes (gloo), and
on GPUs a process a GPU (NCCL; one where the machine has one): the
gradients after one step equal one process's over the combined batch."""
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)
from helpers import H, I, assert_close, make_text  # noqa: E402

# A run takes seconds; a hang (seen once in torch's gloo teardown) fails
# the test instead of stalling the suite.
TIMEOUT_S = 300
SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "ddp_charlm.py"


def run(cmd, env):
    """Run cmd in a process group of its own; on a hang, kill the whole group
    (torchrun's workers hold the pipes) and fail."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{cmd[1:4]} still running after {TIMEOUT_S} s:\n{(out + err)[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_processes_match_one(device, tmp_path):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    n = 2 if device == "cpu" else min(2, torch.cuda.device_count())
    text = tmp_path / "text.txt"
    text.write_text(make_text(3000))
    args = ["--text", str(text), "--steps", "1", "--batch", "4", "--seq", "9", "--embed",
            str(I), "--hidden", str(H), "--layers", "2", "--device", device]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    one = run([sys.executable, str(SCRIPT), *args, "--dump-grads", str(tmp_path / "one.npz")],
              env)
    assert one.returncode == 0, one.stderr[-3000:]
    two = run([sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={n}", str(SCRIPT), *args, "--dump-grads",
               str(tmp_path / "two.npz")], env)
    assert two.returncode == 0, (two.stdout + two.stderr)[-3000:]
    assert f"over {n} process" in two.stdout
    want, got = np.load(tmp_path / "one.npz"), np.load(tmp_path / "two.npz")
    assert sorted(got.files) == sorted(want.files) and "rnn.weight_hh_l1" in got.files
    for k in want.files:
        assert_close(f"d {k}", got[k], want[k])
