"""The compiled library's C++ driver (csrc/): its sources, the settings it
is compiled with, and the link of a library.

The driver owns the time loop (one call from Python runs a whole layer)
and is compiled together with a build's Halide pipelines and one Halide
runtime into libhalstm.so. What it needs to know about a build (the
cell's counts, the sizes, the layout's choices) it gets as preprocessor
defines, made here and nowhere else (Build.defines).
"""
from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from . import cublas
from .layout import Layout

SOURCES = Path(__file__).resolve().parent / "csrc"
MAIN = "driver.cpp"


def sources() -> list[Path]:
    """Every file of the driver (driver.cpp includes the others)."""
    return sorted(SOURCES.glob("*.cpp")) + sorted(SOURCES.glob("*.h"))


@dataclass(frozen=True)
class Layer:
    """A recurrent layer library's driver: one direction of one cell at
    fixed sizes, built for a schedule's layout."""

    direction: str        # "fwd" or "bwd"
    states: int           # NS: the cell's states (h first)
    gates: int            # G
    saved: int            # S: channels the forward saves for backward
    vectors: int          # NV: the vector parameters' channels
    dxp_is_dhg: bool      # backward: the cell's dxp and dhg coincide
    input_size: int       # K
    hidden_size: int      # H
    onehot: bool          # x given as int32 class indices
    layout: Layout
    cuda: bool
    fused_bwd: bool       # the backward steps run step_bwd_fused
    pack_bwd: bool        # the backward packs its weights (pack_bwd)
    units_bwd: bool = False      # the backward also has step_bwd_units (pipeline.UNITS_BWD)
    units_fwd: bool = False      # the forward also has steps in two parts (pipeline.UNITS_FWD)
    fold_fwd: bool = False       # the forward also has folded steps (pipeline.FOLD_FWD)
    fold_bwd: bool = False       # the backward also has folded steps (pipeline.FOLD_BWD)
    split_quantum: int = 1       # split steps: ranges of this many panels ...
    split_quantum_small: int = 1  # ... or of this many, where a step has fewer rows
    split_small_below: int = 0    # than this
    split_batch_bytes: int = 0   # ... or of batch rows, where W_hh is at most this size
    proj_serial_macs: int = 0    # a projection of fewer MACs on the calling thread (csrc/threads.h)
    cublas: bool = False         # CUDA: the non-recurrent GEMMs by cuBLAS (csrc/cublas.h)
    precision: str = "fp32"      # ... in this precision (halstm.cublas.COMPUTE_TYPES)

    def defines(self) -> dict:
        lay = self.layout
        d = {"NS": self.states, "G": self.gates, "S": self.saved, "NV": self.vectors,
             "K": self.input_size, "H": self.hidden_size, "P": lay.panel, "PG": lay.panel_gates or self.gates,
             "DXP_IS_DHG": int(self.dxp_is_dhg), "HALSTM_ONEHOT": int(self.onehot),
             "HALSTM_FORWARD" if self.direction == "fwd" else "HALSTM_BACKWARD": 1}
        if lay.split is not None:
            d |= {"HALSTM_SPLIT": 1, "HALSTM_SPLIT_MACS": lay.split.macs,
                  "HALSTM_SPLIT_QUANTUM": self.split_quantum,
                  "HALSTM_SPLIT_QUANTUM_SMALL": self.split_quantum_small,
                  "HALSTM_SPLIT_SMALL_BELOW": self.split_small_below,
                  "HALSTM_SPLIT_ROWS": lay.split.rows,
                  "HALSTM_SPLIT_CALL_MACS": lay.split.call_macs,
                  "HALSTM_POOL_MACS": lay.split.pool_macs,
                  "HALSTM_SPLIT_BATCH_BYTES": self.split_batch_bytes,
                  "HALSTM_PROJ_SERIAL_MACS": self.proj_serial_macs,
                  "HALSTM_SPLIT_ROWS_ONLY": int(lay.split.rows_only)}
        if lay.xp_panels:
            d["HALSTM_XP_PANELS"] = 1
        if self.fused_bwd:
            d["HALSTM_FUSED_BWD"] = 1
        if self.units_bwd:
            d["HALSTM_UNITS_BWD"] = 1
        if self.units_fwd:
            d["HALSTM_UNITS_FWD"] = 1
        if self.fold_fwd:
            d["HALSTM_FOLD_FWD"] = 1
        if self.fold_bwd:
            d["HALSTM_FOLD_BWD"] = 1
        if lay.narrow_rows:
            d["HALSTM_NARROW_ROWS"] = lay.narrow_rows
        if lay.loop_rows:
            d["HALSTM_LOOP_ROWS"] = lay.loop_rows
        if lay.cpu_bf16:
            d["HALSTM_CPU_BF16"] = 1
        if lay.amx_tiles:
            d["HALSTM_AMX_TILES"] = 1
        if self.direction == "bwd" and not self.pack_bwd:
            d["HALSTM_RAW_BWD"] = 1
        if self.cuda:
            d |= _cuda_defines(lay)
        if self.cublas:
            d |= {"HALSTM_CUBLAS": 1, "HALSTM_COMPUTE": cublas.COMPUTE_TYPES[self.precision]}
            if lay.vendor_step_rows:    # the library has the vendor steps (pipeline.VENDOR_STEPS)
                d["HALSTM_VENDOR_STEP_ROWS"] = lay.vendor_step_rows
                d["HALSTM_STEP_SPLITS"] = lay.vendor_step_splits
            if lay.vendor_bf16:         # the GEMMs' operands rounded to bf16 (pipeline to_bf16)
                d["HALSTM_BF16"] = 1
        return d


@dataclass(frozen=True)
class Model:
    """The char LM's head and optimizer library's driver (sizes at run time)."""

    cuda: bool

    def defines(self) -> dict:
        return {"HALSTM_MODEL": 1, **(_cuda_defines(Layout()) if self.cuda else {})}


def _cuda_defines(layout: Layout) -> dict:
    """The driver passes device pointers (csrc/cuda_graphs.h)."""
    return {"HALSTM_CUDA": 1, "HALSTM_CUDA_MAX_REGISTERS": f'"{layout.max_registers}"',
            "HALSTM_CUDA_GRAPHS": int(layout.cuda_graphs)}


def flags(build) -> list[str]:
    return [f"-D{k}={v}" for k, v in build.defines().items()]


def link(build, objects, library: Path) -> subprocess.CompletedProcess:
    """Compile the driver for `build` and link it with `objects` (the
    pipelines and the runtime) into `library`; returns the finished
    process (its returncode, and stderr to report)."""
    import halide as hl
    cmd = [os.environ.get("CXX", "c++"), "-O2", "-std=c++17", "-shared", "-fPIC",
           f"-I{Path(hl.__file__).parent / 'include'}", *flags(build), str(SOURCES / MAIN),
           *map(str, objects), "-o", str(library), "-lpthread", "-ldl", "-lm"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    res.args = cmd
    return res


def write_sources(out: Path) -> None:
    """The driver's sources and Halide's runtime header, into out, for a
    build of a target that cannot run here."""
    import halide as hl
    for f in sources():
        shutil.copy(f, out / f.name)
    shutil.copy(Path(hl.__file__).parent / "include" / "HalideRuntime.h", out / "HalideRuntime.h")
