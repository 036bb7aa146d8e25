"""Load a compiled halstm library and call it with numpy arrays.

This module owns the numpy <-> Halide axis convention: every array crosses
as a C-contiguous float32 numpy array, and the library's driver views a
numpy array of shape (d0, d1, ..., dn) as a Halide buffer with the axes
reversed (dn innermost, stride 1), e.g. numpy x[t, b, i] is Halide x(i, b, t).
It never imports halide: a process that only loads cached libraries starts fast.
"""
from __future__ import annotations

import ctypes
import json
from pathlib import Path

import numpy as np

_P = ctypes.c_void_p
_I = ctypes.c_int


class KernelError(RuntimeError):
    """A compiled pipeline reported an error."""


def f32(a) -> np.ndarray:
    """a as a C-contiguous float32 array (no copy when it already is one)."""
    return np.ascontiguousarray(a, dtype=np.float32)


def _ptr(a: np.ndarray) -> int:
    assert a.dtype == np.float32 and a.flags.c_contiguous, "runtime arrays must be contiguous f32"
    return a.ctypes.data


def _ptrs(arrays) -> ctypes.Array:
    return (_P * len(arrays))(*[_ptr(a) for a in arrays])


class Library:
    """One compiled library (one cell, sizes, direction, target, schedule)."""

    def __init__(self, path, manifest: dict | None = None):
        path = Path(path)
        if manifest is None:              # a folder written by `halstm compile`
            manifest = json.loads((path / "manifest.json").read_text())
            path = path / manifest["library"]
        self.path, self.manifest = path, manifest
        self.K, self.H = manifest["input_size"], manifest["hidden_size"]
        self.G, self.S = len(manifest["gates"]), len(manifest["saved"])
        self.states = tuple(manifest["states"])
        self._lib = ctypes.CDLL(str(path))
        self._lib.halstm_last_error.restype = ctypes.c_char_p
        if manifest["direction"] == "fwd":
            self._entry = self._lib.halstm_forward
            self._entry.argtypes = [_I, _I] + [_P] * 10
        else:
            self._entry = self._lib.halstm_backward
            self._entry.argtypes = [_I, _I] + [_P] * 14
        self._entry.restype = _I

    def set_num_threads(self, n: int) -> None:
        self._lib.halstm_set_num_threads(int(n))

    def _call(self, *args) -> None:
        rc = self._entry(*args)
        if rc != 0:
            msg = self._lib.halstm_last_error().decode(errors="replace").strip()
            raise KernelError(f"{self.manifest['cell']} {self.manifest['direction']} kernel "
                              f"({self.manifest['target']}, schedule "
                              f"{self.manifest['schedule']}) failed with code {rc}: {msg}")

    def forward(self, x, w_ih, b_ih, w_hh, b_hh, init):
        """One layer over a sequence. x (T, B, K); weights in PyTorch layout;
        init: one (B, H) array per state. Returns (states, saved): states
        each (T+1, B, H) with the initial state at [0]; saved (T, B, S, H)."""
        T, B, _ = x.shape
        G, H, K, S = self.G, self.H, self.K, self.S
        states = []
        for s0 in init:
            st = np.empty((T + 1, B, H), np.float32)
            st[0] = s0
            states.append(st)
        saved = np.empty((T, B, S, H), np.float32)
        ws = [np.empty((K, G, H), np.float32), np.empty((H, G, H), np.float32),
              np.empty((T, B, G, H), np.float32)]
        self._call(T, B, _ptr(x), _ptr(w_ih), _ptr(b_ih), _ptr(w_hh), _ptr(b_hh),
                   *map(_ptr, ws), _ptr(saved), _ptrs(states))
        return states, saved

    def backward(self, x, w_ih, w_hh, saved, states, dy, dfinal):
        """BPTT of one layer. dfinal: one (B, H) gradient per final state.
        Returns dict: dx, dw_ih, db_ih, dw_hh, db_hh and d<state>0 (B, H)."""
        T, B, K = x.shape
        G, H = self.G, self.H
        dstate = []
        for d in dfinal:
            a = np.empty((2, B, H), np.float32)
            a[0] = d
            dstate.append(a)
        dxp = np.empty((T, B, G, H), np.float32)
        dhg = dxp if self.manifest["dxp_is_dhg"] else np.empty_like(dxp)
        out = {"dx": np.empty((T, B, K), np.float32),
               "dw_ih": np.empty((G * H, K), np.float32), "db_ih": np.empty(G * H, np.float32),
               "dw_hh": np.empty((G * H, H), np.float32), "db_hh": np.empty(G * H, np.float32)}
        self._call(T, B, _ptr(x), _ptr(w_ih), _ptr(w_hh), _ptr(saved), _ptrs(states),
                   _ptr(dy), _ptrs(dstate), _ptr(dxp), _ptr(dhg), *map(_ptr, out.values()))
        for s, a in zip(self.states, dstate):
            out[f"d{s}0"] = a[0].copy()
        return out
