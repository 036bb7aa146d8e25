"""Output paths of `halstm train` (--out, --plot), checked before the first
step so that a run never trains for hours and then cannot save, and never
writes over one of its inputs.

    check(out, "--out", "checkpoint", inputs={"the training text": text})
    ...                                    # inputs read, trainer built
    prepare(out)                           # folders created, stale temp files removed

A path passes when: it is not a folder, not a device, pipe or socket (a
replace would put a file where /dev/null was), not the same file as an
input (also through a link), not an existing file of another kind (an
existing --out must be a halstm checkpoint or empty, an existing --plot a
PNG or empty: halstm replaces only its own outputs), and its folder exists
or can be created: the nearest existing folder above it is a folder in
which a file can be created now (a trial file, removed at once: a
read-only file system or a folder without write permission fails here).
"""
from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from . import checkpoint as ckpt_mod

KINDS = {"checkpoint": "a halstm checkpoint", "png": "a PNG image"}
_PNG = b"\x89PNG\r\n\x1a\n"


class OutputError(ValueError):
    """An output path that cannot or must not be written."""


def _is_kind(path: Path, kind: str) -> bool:
    if kind == "checkpoint":
        return ckpt_mod.is_checkpoint(path)
    try:
        with open(path, "rb") as f:
            return f.read(len(_PNG)) == _PNG
    except OSError:
        return False


def _nearest_existing(folder: Path) -> Path:
    p = folder
    while not os.path.lexists(p) and p != p.parent:
        p = p.parent
    return p


def check(path, option: str, kind: str, inputs: dict | None = None,
          replaces: bool = False) -> None:
    """OutputError (one line naming option, path and why) unless path can be
    written as described in the module docstring. inputs: description ->
    path of every file the run reads that path must not be. replaces: path
    is meant to be replaced whatever it holds (the --resume checkpoint,
    which the run continues in and load() checks)."""
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {list(KINDS)}, got {kind!r}")
    path = Path(path)
    if not str(path) or path.name in ("", ".", ".."):
        raise OutputError(f"{option} {str(path)!r}: expected a file name")
    where = f"{option} {path}"
    for what, inp in (inputs or {}).items():
        if inp is None:
            continue
        try:
            same = os.path.samefile(path, inp)
        except OSError:
            same = Path(os.path.abspath(path)) == Path(os.path.abspath(inp))
        if same:
            raise OutputError(f"{where} is {what} ({inp}): halstm never writes over an input; "
                              f"give another {option}")
    try:
        st = os.stat(path)
    except FileNotFoundError:
        st = None
    except NotADirectoryError:
        st = None                      # a parent is a file: reported below
    except OSError as e:
        raise OutputError(f"{where}: cannot examine it: {e.strerror or e}") from None
    if st is not None:
        if stat.S_ISDIR(st.st_mode):
            raise OutputError(f"{where} is a folder: give a file name")
        if not stat.S_ISREG(st.st_mode):
            raise OutputError(f"{where} is not a regular file (a device, pipe or socket): "
                              f"give a file name")
        if st.st_size and not replaces and not _is_kind(path, kind):
            raise OutputError(f"{where} exists and is not {KINDS[kind]}: refusing to replace "
                              f"it; remove it or give another {option}")
    folder = Path(os.path.abspath(path)).parent
    base = _nearest_existing(folder)
    if not base.is_dir():
        raise OutputError(f"{where}: {base} is not a folder")
    try:
        fd, probe = tempfile.mkstemp(prefix=".halstm-probe-", dir=base)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise OutputError(f"{where}: cannot write in {base}: {e.strerror or e}") from None


def check_distinct(paths: dict) -> None:
    """OutputError if two outputs (option -> path or None) name one file."""
    seen = {}
    for option, p in paths.items():
        if p is None:
            continue
        key = Path(os.path.abspath(p))
        if key in seen:
            raise OutputError(f"{seen[key]} and {option} name the same file {p}")
        seen[key] = option


def prepare(path, option: str) -> None:
    """Create path's folders (checked by check()) and remove the temporary
    files that a killed writer left beside it."""
    path = Path(path)
    try:
        Path(os.path.abspath(path)).parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"{option} {path}: cannot create its folder: {e.strerror or e}") from None
    ckpt_mod.remove_stale_temps(path)
