"""Recurrent cells: algorithms only (Funcs in, named Funcs out).

A built-in cell is one module here defining its step with
language.define (backward derived), plus a line in _BUILTIN. A user's
cell is a Python file of definitions: load_file registers them by name.
Nothing here imports halide: lowering a definition to Funcs does
(lowering.py), and only a build needs it.
"""
from __future__ import annotations

import importlib
import importlib.util
import threading
from pathlib import Path

from .language import (CellError, Definition, define, exp, layer_norm, log,  # noqa: F401
                       maximum, mean, minimum, relu, sigmoid, softplus, sqrt, tanh, vector)

# name -> (module, attribute): its language Definition
_BUILTIN = {"lstm": ("lstm", "CELL"), "gru": ("gru", "CELL"),
            "rnn_tanh": ("rnn", "TANH"), "rnn_relu": ("rnn", "RELU"),
            "cifg_lstm": ("cifg_lstm", "CELL"), "peephole_lstm": ("peephole_lstm", "CELL"),
            "layernorm_lstm": ("layernorm_lstm", "CELL"), "slstm": ("slstm", "CELL")}
NAMES = tuple(_BUILTIN)
_user: dict[str, Definition] = {}
_lock = threading.Lock()


def names() -> tuple[str, ...]:
    """Every cell a build can name: the built-in ones, then the registered."""
    return NAMES + tuple(n for n in _user if n not in _BUILTIN)


def check(name: str) -> str:
    if name not in _BUILTIN and name not in _user:
        raise ValueError(f"cell: expected one of {list(names())}, got {name!r}"
                         + ("" if _user else " (a cell of your own: halstm.cells.load_file)"))
    return name


def _builtin(name: str):
    module, attr = _BUILTIN[name]
    return getattr(importlib.import_module(f"{__name__}.{module}"), attr)


def definition(name: str) -> Definition:
    """The language definition of cell `name`."""
    if name in _user:
        return _user[name]
    return _builtin(check(name))


def info(name: str) -> dict:
    """name, gates, states (h first), saved, dxp_is_dhg and doc of cell `name`."""
    return definition(name).describe()


def get(name: str):
    """The cell called `name` as a Cell (Funcs; imports halide)."""
    from .lowering import DefinedCell
    return DefinedCell(definition(name))


def register(d: Definition) -> str:
    """Make definition d buildable by its name; the same name again must
    be the same math. Returns the name."""
    if not isinstance(d, Definition):
        raise TypeError(f"register: expected a cell definition (halstm.cells.define), "
                        f"got {type(d).__name__}")
    with _lock:
        if d.name in _BUILTIN:
            raise CellError(f"cell {d.name!r}: a built-in cell has that name; choose another")
        old = _user.get(d.name)
        if old is not None and old.signature() != d.signature():
            raise CellError(f"cell {d.name!r}: a different cell of that name is registered "
                            f"(from {old.file})")
        _user[d.name] = d
    return d.name


def load_file(path) -> list[str]:
    """Register every cell definition at the top level of the Python file
    `path`; returns their names. CellError if it defines none."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"cell file: {path} does not exist")
    spec = importlib.util.spec_from_file_location(f"halstm_user_cell_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except CellError as e:
        raise CellError(f"{path}: {e}") from None
    found = [v for v in vars(module).values() if isinstance(v, Definition)]
    if not found:
        raise CellError(f"{path}: defines no cell (expected NAME = halstm.cells.define(...) "
                        f"at the top level)")
    for d in found:
        d.cell_file = str(path)
    return [register(d) for d in found]
