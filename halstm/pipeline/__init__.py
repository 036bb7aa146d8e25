"""One recurrent layer over a sequence, as Halide pipelines built from a cell.

A layer runs as a few pipelines that the compiled library's driver
(aot.py) calls; the time loop lives in that C++ driver, never in Python:

    forward:   pack     (once)    PyTorch weights -> transposed panels
               proj     (once)    xp = W_ih x + b_ih for all T steps (one GEMM)
               step     (T times) hg = W_hh h + b_hh, then the cell
    backward:  pack_bwd (once)    PyTorch weights -> panels along the input axis
               step_bwd (T times, reversed) cell backward, dh_prev = W_hh^T dhg
               grads    (once)    dx, dW_ih, db_ih, dW_hh, db_hh over all steps
    one-hot:   gather   (once)    xp = W_ih[:, ids] + b_ih (instead of proj)
               grads_ids (once)   as grads, dW_ih a scatter-add over ids, no dx

Axes are Halide's, innermost first; the numpy shape of the same buffer is
the reverse (runtime.py owns that convention). K = the layer's input size,
H = hidden size, G = the cell's gate count, S = its saved channel count,
V = its vector parameters' channel count (each H values; the steps take
them as one input, numpy (V, H), and step_bwd writes their per-row
gradients, which grads sums).
T and B are runtime values: one library serves every sequence length and
batch. Stages are named so that schedules can find them (Pipe.stage).
The builders live in common (what the pipelines share), forward,
backward and grads.
Weights are packed in panels of P units (P chosen by the schedule, a
vector's lanes), so that a P-unit tile of a product reads one contiguous
block; buffers written along a packed axis are padded to a multiple of P.
"""
from __future__ import annotations

import halide as hl

from ..cells.base import Cell
from ..layout import Layout
from . import backward, forward, grads
from .common import Pipe, Stages, padded

__all__ = ["KINDS", "FORWARD", "BACKWARD", "FORWARD_IDS", "BACKWARD_IDS", "FUSED_BWD", "UNITS_BWD",
           "UNITS_FWD", "FOLD_FWD", "FOLD_BWD", "NARROW", "BF16_BWD", "LOOP", "VENDOR_STEPS",
           "Pipe", "Stages", "padded", "build"]

KINDS = ("pack", "proj", "step", "step_infer", "pack_bwd", "step_bwd", "step_bwd_fused",
         "step_bwd_units", "grads", "gather", "grads_ids", "step_vendor", "step_vendor_infer",
         "step_bwd_vendor", "to_bf16", "step_product", "step_cell", "step_cell_infer",
         "step_bwd_cell", "step_bwd_product", "step_fold", "step_fold_infer", "step_bwd_fold",
         "step_narrow", "step_narrow_infer", "loop_infer", "step_bwd_bf16")
# step_infer: a step that stores the new states only (a forward pass that
# no backward follows: halstm.no_grad())
FORWARD = ("pack", "proj", "step", "step_infer")
BACKWARD = ("pack_bwd", "step_bwd", "grads")
# A layer fed one-hot vectors given as class indices (a char LM's first
# layer): the projection is a gather of W_ih's columns, dW_ih a scatter-add
# of the rows of dxp, and there is no input gradient.
FORWARD_IDS = ("pack", "gather", "step", "step_infer")
BACKWARD_IDS = ("pack_bwd", "step_bwd", "grads_ids")
# A schedule whose layout sets fused_bwd_below runs the backward time loop
# of hidden sizes below it as step_bwd_fused, one kernel a step, instead of
# step_bwd (see there).
FUSED_BWD = {"step_bwd": "step_bwd_fused"}
# Where the driver's threads take a backward step's batch rows only (a cell
# that reduces over units: Layout split rows_only), step_bwd_units is the
# same step on ranges of units: each thread computes the pointwise part of
# every unit (its sums need them all) and its own units' outputs and
# product. The driver calls it where the batch has too few rows for two
# ranges. Where ranges of rows would each read too large a W_hh, a step
# runs in two parts instead: step_bwd_cell, the pointwise part on ranges of
# rows (its dh_prev the pointwise term alone), then step_bwd_product,
# dh_prev = that term + W_hh^T dhg, on ranges of units.
UNITS_BWD = ("step_bwd_units", "step_bwd_cell", "step_bwd_product")
# ... and forward, a step may run in two parts: step_product, the recurrent
# product on ranges of units, then, once every thread's units are in,
# step_cell (step_cell_infer) on ranges of rows: the rest of the step,
# reading that product. The driver calls them where ranges of rows would
# be too few or would each read too large a W_hh.
UNITS_FWD = ("step_product", "step_cell", "step_cell_infer")
# On a GPU a step that reduces over units is two kernels (the product for
# every unit, then a block a batch row). Where the layout folds steps
# (Layout.fold_steps), step_fold is one: the rest of step t on the product
# the last call left, then step t+1's product on the new h, each block of
# the product's grid computing its batch row's rest (every unit) first.
# The driver's loop: step_product (the first step's product), then
# step_fold (step_fold_infer) once a step.
FOLD_FWD = ("step_product", "step_fold", "step_fold_infer")
# ... and backward, step_bwd_fold is step_bwd as one kernel: each block of
# its product dh_prev = W_hh^T dhg computes its batch row's pointwise
# backward (every unit) first. The driver calls it in step_bwd's place.
FOLD_BWD = ("step_bwd_fold",)
# Where the layout has narrow_rows, the forward also has step_narrow and
# step_narrow_infer: step and step_infer themselves, scheduled for steps of
# few batch rows; the driver calls them for steps of up to narrow_rows rows.
NARROW = ("step_narrow", "step_narrow_infer")
# With bf16 products (Layout.cpu_bf16), a backward of fused steps also has
# step_bwd_bf16: step_bwd_fused with its product of bf16 operands, which the
# driver calls for steps of more than narrow_rows rows.
BF16_BWD = ("step_bwd_bf16",)
# Where the layout has loop_rows, the forward also has loop_infer: a
# forward that no backward follows with every step in one pipeline, for a
# cell without sums over units; the driver calls it once, in place of the
# steps, for batches of up to loop_rows rows without batch sizes.
LOOP = ("loop_infer",)
# With vendor GEMMs (Layout.vendor_gemm) a layer also has steps whose
# recurrent product the driver runs (h W_hh^T, dhg W_hh) as a vendor GEMM:
# the pipelines are the pointwise rest, used where a step has many rows.
VENDOR_STEPS = {"fwd": ("step_vendor", "step_vendor_infer"), "bwd": ("step_bwd_vendor",)}
# With Layout.vendor_bf16, to_bf16 rounds the vendor GEMMs' operands to
# bfloat16 copies (the driver calls it before each GEMM that needs one),
# and the vendor steps store their product's operand (h, dhg) in bf16 too.


def build(cell: Cell, kind: str, K: int, H: int, layout: Layout = Layout()) -> Pipe:
    """Build pipeline `kind` (one of KINDS) for `cell` with input size K,
    its operands packed as the schedule's layout says (default: unpacked)."""
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")
    p = Pipe(kind, cell, K, H, layout.panel, layout.panel_gates, layout.dw_cols, layout.dw_rows,
             layout.read_outputs, layout.split is not None, layout.xp_panels,
             layout.raw_bwd_weights,
             split_rows_only=layout.split is not None and layout.split.rows_only,
             vendor_gemm=layout.vendor_gemm, vendor_bf16=layout.vendor_bf16,
             vendor_splits=layout.vendor_step_splits, cpu_bf16=layout.cpu_bf16,
             amx_tiles=layout.amx_tiles, bf16_dw_rows=layout.bf16_dw_rows)
    p.vars = {n: hl.Var(n) for n in ("i", "j", "k", "gate", "s", "b", "t")}
    next(getattr(m, "_" + kind) for m in (forward, backward, grads)
         if hasattr(m, "_" + kind))(p)
    return p
