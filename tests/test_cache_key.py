"""The cache key follows the code, not its text: an edit of comments or
docstrings keeps every compiled library in the cache, a change of code
does not. Checked on a copy of the installed package, keys computed in a
fresh interpreter, as a user's next session would."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import halstm
import halstm.schedules
from halstm import cache
from helpers import CUDA_TARGET

SPECS = "[aot.Spec('lstm', 13, 37, d, 'x86-64-linux-avx2') for d in ('fwd', 'bwd')]"


def _keys(tmp_path, name, edit=None) -> list[str]:
    """Cache keys of SPECS (and the char LM kernels' key material) computed
    by a copy of halstm under tmp_path/name, after edit(copy's halstm dir)."""
    root = tmp_path / name
    pkg = root / "halstm"
    skip = shutil.ignore_patterns("__pycache__")
    shutil.copytree(Path(halstm.__file__).parent, pkg, ignore=skip)
    shutil.copytree(Path(halstm.schedules.__file__).parent, pkg / "schedules", ignore=skip,
                    dirs_exist_ok=True)
    if edit:
        edit(pkg)
    code = ("import json, halstm; from halstm import aot, cache; from halstm.model import library; "
            f"print(json.dumps([halstm.__file__] + [aot.cache_key(s) for s in {SPECS}] + "
            "[cache.source_hash(library.code_files())]))")
    res = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(root)})
    assert res.returncode == 0, res.stderr
    where, *keys = json.loads(res.stdout)
    assert Path(where).parent == pkg         # the copy ran, not the installed package
    return keys


def _append(path: Path, text: str) -> None:
    path.write_text(path.read_text() + text)


def _reword_docstrings_and_comments(pkg: Path) -> None:
    cell = pkg / "cells" / "lstm.py"
    text = cell.read_text()
    first_quote = text.index('"""')
    cell.write_text(text[:first_quote + 3] + "Reworded. " + text[first_quote + 3:]
                    + "\n# a comment at the end\n")
    _append(pkg / "schedules" / "cpu.py", "\n# a note on a decision\n")
    _append(pkg / "csrc" / "forward.h", "\n// a note\n/* and a block\n   comment */\n")
    pipe = pkg / "pipeline" / "forward.py"
    pipe.write_text(pipe.read_text().replace("\n\n\ndef ", "\n\n\n# note\ndef ", 1))


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return _keys(tmp_path_factory.mktemp("keys"), "pristine")


def test_comment_and_docstring_edits_keep_the_cache_warm(tmp_path, pristine):
    assert _keys(tmp_path, "reworded", _reword_docstrings_and_comments) == pristine


@pytest.mark.parametrize("edit", [
    lambda pkg: _append(pkg / "cells" / "lstm.py", "\nUNUSED = 1\n"),
    lambda pkg: _append(pkg / "schedules" / "cpu.py", "\nUNUSED = 1\n"),
    lambda pkg: _append(pkg / "csrc" / "forward.h", "\nstatic int unused_symbol;\n"),
    lambda pkg: _append(pkg / "bf16.py", "\nUNUSED = 1\n"),
], ids=["cell", "schedule", "driver", "bf16 products"])
def test_code_edits_change_the_key(tmp_path, pristine, edit):
    keys = _keys(tmp_path, "edited", edit)
    assert keys[0] != pristine[0] and keys[1] != pristine[1]     # both directions' libraries


def test_the_model_kernels_key_follows_the_driver_and_schedules(tmp_path, pristine):
    keys = _keys(tmp_path, "edited",
                 lambda pkg: _append(pkg / "csrc" / "model.h", "\nstatic int unused_symbol;\n"))
    assert keys[2] != pristine[2] and keys[:2] != pristine[:2]


def test_source_hash_reads_code_not_text(tmp_path):
    a, b, c = (tmp_path / v / "src" for v in "abc")   # a file counts by its folder and name
    for d in (a, b, c):
        d.mkdir(parents=True)
    (a / "m.py").write_text('"""Doc."""\nX = 1  # one\n\n\ndef f():\n    """Doc."""\n    return "#x"\n')
    (b / "m.py").write_text('"""Other doc."""\nX = 1\n\ndef f():\n    return "#x"\n')
    (c / "m.py").write_text('"""Doc."""\nX = 1\n\n\ndef f():\n    return "#y"\n')   # a string
    (a / "d.h").write_text('int x = 1; // one\nconst char *s = "// not a comment";\n')
    (b / "d.h").write_text('/* block */ int x = 1;\n\n  const char *s = "// not a comment";\n')
    (c / "d.h").write_text('int x = 1;\nconst char *s = "// other";\n')
    h = {d.parent.name: cache.source_hash([d / "m.py", d / "d.h"]) for d in (a, b, c)}
    assert h["a"] == h["b"] != h["c"]


def test_an_autoscheduled_build_is_keyed_by_the_machines_parallelism(monkeypatch):
    """The autoschedulers search for this machine's cores (CPU) or SMs
    (CUDA), so their libraries are cached per count; so are the cpu
    schedule's backward libraries (the weight gradients' tasks; and per
    L2 size, their blocks' default and bf16's weight-gradient chunks) and the
    cuda schedule's forward ones (the steps' gate lanes), not the others
    (knobs.MACHINE_FACTS)."""
    from halstm import aot, machine
    from halstm.schedules import auto
    assert auto.parallelism("cpu") == len(os.sched_getaffinity(0))
    auto_spec = aot.Spec("lstm", 13, 37, "fwd", "x86-64-linux-avx2", "auto:Adams2019")
    hand_spec = aot.Spec("lstm", 13, 37, "fwd", "x86-64-linux-avx2", "cpu")
    hand_bwd = aot.Spec("lstm", 13, 37, "bwd", "x86-64-linux-avx2", "cpu")
    before = aot.cache_key(auto_spec), aot.cache_key(hand_spec), aot.cache_key(hand_bwd)
    monkeypatch.setattr(machine, "cores", lambda: 97)
    assert auto.parallelism("cpu") == 97
    assert aot.cache_key(auto_spec) != before[0] and aot.cache_key(hand_spec) == before[1]
    assert aot.cache_key(hand_bwd) != before[2]
    before = aot.cache_key(hand_spec), aot.cache_key(hand_bwd)
    monkeypatch.setattr(machine, "l2_bytes", lambda: 3 << 20)   # (dW blocks, bf16's chunks)
    assert (aot.cache_key(hand_spec), aot.cache_key(hand_bwd) != before[1]) == (before[0], True)
    cuda = [aot.Spec("lstm", 13, 37, d, CUDA_TARGET, "cuda") for d in ("fwd", "bwd")]
    monkeypatch.setattr(machine, "gpu_sms", lambda: 132)
    before = [aot.cache_key(s) for s in cuda]
    monkeypatch.setattr(machine, "gpu_sms", lambda: 7)
    assert auto.parallelism("cuda") == 7
    assert [aot.cache_key(s) == b for s, b in zip(cuda, before)] == [False, True]
