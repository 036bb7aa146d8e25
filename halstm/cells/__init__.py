"""Recurrent cells: algorithms only (Funcs in, named Funcs out).

A new cell is one module here defining a Cell subclass, plus a line in
_CELLS. Cells are imported lazily: halide is only needed to build.
"""
import importlib

_CELLS = {"lstm": ("lstm", "LSTMCell"), "gru": ("gru", "GRUCell")}
NAMES = tuple(_CELLS)


def check(name: str) -> str:
    if name not in _CELLS:
        raise ValueError(f"cell: expected one of {list(NAMES)}, got {name!r}")
    return name


def get(name: str):
    """An instance of the cell called `name`."""
    module, cls = _CELLS[check(name)]
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)()
