"""bench/gpu_ab.py with --runtime: each variant in a process of its own,
running the halstm of its own copy of the source (bench/cell_ab.sh)."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import H, I, run_cli

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """lstm I=13 H=37, one layer, for this machine (`halstm compile`)."""
    out = tmp_path_factory.mktemp("ab") / "lstm"
    run_cli("compile", "-i", I, "-H", H, "--out", out)
    return out


def _tree(path: Path) -> Path:
    """A copy of the source as bench/cell_ab.sh makes one: halstm, its
    schedules inside it (the installed package's layout)."""
    skip = shutil.ignore_patterns("__pycache__", "schedules")
    shutil.copytree(ROOT / "halstm", path / "halstm", ignore=skip)
    shutil.copytree(ROOT / "schedules", path / "halstm" / "schedules",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return path


def _ab(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_ab.py"), "--target", "host",
                           "--input-size", str(I), "--hidden-size", str(H), "--batch", "3",
                           "--steps", "4", "--reps", "2", *map(str, args)],
                          capture_output=True, text=True, timeout=600)


def test_each_variant_runs_the_runtime_of_its_tree(folder, tmp_path):
    a, b = _tree(tmp_path / "a"), _tree(tmp_path / "b")
    res = _ab("--runtime", f"a={a}", "--runtime", f"b={b}", f"a={folder}", f"b={folder}")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "each variant its own runtime" in res.stdout, res.stdout
    rows = {line.split()[0]: line for line in res.stdout.splitlines() if line.startswith("  ")}
    assert rows["a"].endswith(f"runtime {a / 'halstm'}"), rows
    assert rows["b"].endswith(f"runtime {b / 'halstm'}"), rows
    for row in rows.values():
        assert "fwd" in row and "bwd" in row, row


def test_a_runtime_is_wanted_for_every_variant(folder, tmp_path):
    res = _ab("--runtime", f"a={tmp_path}", f"a={folder}", f"b={folder}")
    assert res.returncode != 0
    assert "--runtime: expected one for every variant (a, b), got a" in res.stderr, res.stderr
