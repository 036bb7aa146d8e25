"""A folder of compiled kernels for one model (`halstm compile --out DIR`):

    DIR/manifest.json            cell, sizes, layers, target, schedule, parts
    DIR/<direction>_k<K>/        one library (or, for a cross target, static
                                 libraries, headers and driver.cpp) + manifest

Written through a temporary folder renamed into place, so a failed or
interrupted compile leaves DIR as it was.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from . import aot, cells, manifest
from .errors import LibraryError

MANIFEST = "manifest.json"


def input_sizes(input_size: int, hidden_size: int, layers: int) -> list[int]:
    """The distinct layer input sizes of a stack: layer 0 takes input_size,
    the others hidden_size."""
    return sorted({input_size} | ({hidden_size} if layers > 1 else set()))


def compile_model(cell, input_size, hidden_size, layers, target, schedule, out, emit=(),
                  progress=None, precision="fp32", gemm=None) -> dict:
    """Build every library a model needs, both directions, into `out`."""
    out = Path(out)
    check_out(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        parts = []
        for direction in aot.DIRECTIONS:
            for k in input_sizes(input_size, hidden_size, layers):
                spec = aot.Spec(cell, k, hidden_size, direction, target, schedule,
                                precision=precision, gemm=gemm)
                name = f"{direction}_k{k}"
                (tmp / name).mkdir()
                m = aot.build(spec, tmp / name, emit)
                parts.append({"dir": name, "direction": direction, "input_size": k,
                              "library": m["library"], "compile_seconds": m["compile_seconds"]})
                if progress:
                    progress(name, m)
        top = {"cell": cell, "input_size": input_size, "hidden_size": hidden_size,
               "num_layers": layers, "target": m["target"], "target_requested": target,
               "schedule": m["schedule"], "precision": m["precision"], "gemm": m["gemm"],
               "halide_version": m["halide_version"],
               "loadable_here": m["library"] is not None, "parts": parts}
        d = cells.definition(cell)
        top["cell_definition"] = d.signature()
        if cell not in cells.NAMES:     # (a program's own cell: the file that defines it)
            top["cell_file"] = d.cell_file or d.file
        (tmp / MANIFEST).write_text(json.dumps(top, indent=2))
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.rename(out, old / out.name)
            os.rename(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out)
        return top
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def check_out(out: Path) -> None:
    """Refuse an output folder that compiling would wrongly replace: one
    holding other files, or the current folder or one above it."""
    out = Path(out)
    if not out.exists():
        return
    if not out.is_dir():
        raise ValueError(f"{out} exists and is not a folder")
    resolved, cwd = out.resolve(), Path.cwd().resolve()
    if resolved == cwd or resolved in cwd.parents:
        raise ValueError(f"{out} is the current folder or contains it; name a new folder")
    if any(out.iterdir()):
        try:
            read(out)
        except (FileNotFoundError, ValueError):
            raise ValueError(f"{out} exists and was not written by `halstm compile`; "
                             f"name a new or empty folder") from None


def read(path) -> dict:
    """The checked manifest of a compiled folder, or of one library's
    folder in it (manifest.check); LibraryError (a ValueError) naming the
    file and the field where it is damaged."""
    path = Path(path) / MANIFEST
    try:
        top = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path.parent}: no {MANIFEST}; not a folder written by "
                                f"`halstm compile`") from None
    except (ValueError, OSError) as e:
        raise LibraryError(f"{path}: not a valid manifest ({e})") from None
    if isinstance(top, dict) and "parts" not in top:      # one library's folder
        return manifest.check(top, str(path))
    _check_top(top, str(path))
    return top


def _check_top(top, where: str) -> None:
    def bad(key, what):
        if isinstance(top, dict) and key not in top:
            raise LibraryError(f"{where}: no {key!r} (expected {what})")
        got = top[key] if isinstance(top, dict) else top
        raise LibraryError(f"{where}: {key!r}: expected {what}, got {got!r}")
    if not isinstance(top, dict):
        bad("(top)", "a JSON object")
    if not isinstance(top.get("cell"), str) or not top["cell"].isidentifier():
        bad("cell", "a cell name")
    for key in ("input_size", "hidden_size", "num_layers"):
        v = top.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or not 0 < v < 1 << 24:
            bad(key, "a positive int")
    for key in ("target", "target_requested", "schedule"):
        if not isinstance(top.get(key), str):
            bad(key, "a string")
    if not isinstance(top.get("loadable_here"), bool):
        bad("loadable_here", "true or false")
    parts = top.get("parts")
    if not isinstance(parts, list) or not parts:
        bad("parts", "a list of the compiled libraries")
    for part in parts:
        if (not isinstance(part, dict) or not isinstance(part.get("dir"), str)
                or Path(part["dir"]).name != part["dir"] or part["dir"] in ("", ".", "..")
                or part.get("direction") not in manifest.DIRECTIONS
                or not isinstance(part.get("input_size"), int)):
            bad("parts", "entries with a folder name, a direction and an input size")


def load(path, seed=None):
    """The cell's module (halstm.nn.module) running the kernels compiled
    into `path`."""
    from .nn import module
    from .runtime import Library
    path = Path(path)
    top = read(path)
    if not top.get("loadable_here"):
        raise ValueError(f"{path}: compiled for {top['target']}, which cannot run here")
    cell = top["cell"]
    if cell not in cells.names():
        raise LibraryError(f"{path / MANIFEST}: 'cell': {cell!r} is no cell known here; "
                           f"register its definition first (halstm.cells.load_file of its "
                           f"cell file, or halstm.cells.register; it was defined in "
                           f"{top.get('cell_file', 'an unnamed file')!r})")
    kw = dict(num_layers=top["num_layers"], target=top["target_requested"],
              schedule=top["schedule"], seed=seed, precision=top.get("precision", "fp32"),
              gemm=top.get("gemm"))
    m = module(cell, top["input_size"], top["hidden_size"], **kw)
    for part in top["parts"]:
        lib = Library(path / part["dir"])
        if lib.manifest["cell"] != cell:
            raise LibraryError(f"{path / MANIFEST}: 'cell': {cell!r}, but {part['dir']} holds "
                               f"kernels of cell {lib.manifest['cell']!r}")
        m._libs[(part["input_size"], part["direction"], 0)] = lib   # (lane 0: nn._RNN._lib)
    return m
