"""The shape of a layer library's manifest.json, checked before anything
loads the library it names (loading a shared library runs its code). No
halide import: the runtime checks manifests too.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from .errors import LibraryError

FORMAT = 6     # 3: vector parameters (the entry points take vec); 4: halstm_forward takes init;
               # 5: halstm_forward takes finals, halstm_backward dfinal; 6: halstm_set_call
DIRECTIONS = ("fwd", "bwd")

_STR, _INT, _BOOL, _LIST = "a string", "a positive int", "true or false", "a list of strings"
_COUNT = "an int >= 0"
# key -> what it must be
FIELDS = {"format": "the format number", "cell": _STR, "input_size": _INT,
          "hidden_size": _INT, "direction": "'fwd' or 'bwd'", "gates": _LIST,
          "states": _LIST, "saved": _LIST, "dxp_is_dhg": _BOOL, "vectors": _COUNT, "onehot": _BOOL,
          "panel": _INT, "device": "'cpu' or 'cuda'", "target": _STR, "schedule": _STR,
          "pipelines": _LIST, "library": "a file name in the folder, or null",
          "sha256": "64 hex digits"}


def _ok(key: str, v, manifest: dict) -> bool:
    what = FIELDS[key]
    if key == "format":
        return v == FORMAT
    if what == _STR:
        return isinstance(v, str) and bool(v)
    if what == _INT:
        return isinstance(v, int) and not isinstance(v, bool) and 0 < v < 1 << 24
    if what == _COUNT:
        return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 24
    if what == _BOOL:
        return isinstance(v, bool)
    if what == _LIST:
        return isinstance(v, list) and all(isinstance(s, str) and s for s in v) and bool(v)
    if key == "direction":
        return v in DIRECTIONS
    if key == "device":
        return v in ("cpu", "cuda")
    if key == "library":
        return v is None or (isinstance(v, str) and v != "" and Path(v).name == v
                             and v not in (".", ".."))
    if key == "sha256":
        return manifest.get("library") is None or (isinstance(v, str) and
                                                   re.fullmatch(r"[0-9a-f]{64}", v) is not None)
    raise AssertionError(key)


def check(manifest, where: str = "manifest") -> dict:
    """manifest, if it has every field of FIELDS as described; else
    LibraryError naming `where`, the field, what was expected and what came."""
    if not isinstance(manifest, dict):
        raise LibraryError(f"{where}: expected a JSON object, got {type(manifest).__name__}")
    for key, what in FIELDS.items():
        if key not in manifest:
            if key == "sha256" and manifest.get("library") is None:
                continue
            raise LibraryError(f"{where}: no {key!r} (expected {what}); not a halstm "
                               f"library manifest of format {FORMAT}")
        if not _ok(key, manifest[key], manifest):
            raise LibraryError(f"{where}: {key!r}: expected {what}, got {manifest[key]!r}")
    return manifest


def read(folder) -> dict:
    """The checked manifest of a library folder; LibraryError (or
    FileNotFoundError) naming the folder if it is missing or damaged."""
    path = Path(folder) / "manifest.json"
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise FileNotFoundError(f"{folder}: no manifest.json; not a folder written by "
                                f"`halstm compile`") from None
    except (OSError, UnicodeDecodeError) as e:
        raise LibraryError(f"{path}: cannot read it ({e})") from None
    try:
        data = json.loads(text)
    except ValueError as e:
        raise LibraryError(f"{path}: not valid JSON ({e})") from None
    return check(data, str(path))
