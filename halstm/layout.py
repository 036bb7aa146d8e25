"""What a schedule decides beyond its stages' loops: the operands' packed
shapes, which pipelines a layer is made of, and how the library's driver
runs the time loop. A schedule module's `layout(target)` returns one
Layout; aot passes it to pipeline.build and turns it into the driver's
build (driver.py); the manifest records it.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace


@dataclass(frozen=True)
class StepSplit:
    """CPU: the driver runs each time step in ranges of units (or of batch
    rows) on threads of its own (csrc/threads.h run_split)."""

    macs: int         # a thread per this many multiply-adds of a step ...
    call_macs: int    # ... where the whole time loop has at least this many
    rows: int         # batch rows a thread takes at least, where it takes rows
    rows_only: bool = False   # ranges of rows or one thread, never of units (a step
                              # that reduces over units needs them all)
    pool_macs: int = 0        # Halide's parallel loops: a pool thread per this many
                              # multiply-adds of the pipeline call (csrc/threads.h
                              # PoolWork; 0: every thread)


@dataclass(frozen=True)
class Layout:
    panel: int = 1                 # P: weights packed in panels of P units
    panel_gates: int = 0           # PG: a panel's gates in groups of PG, each group's
    #                                reduction contiguous (0: every gate side by side)
    dw_cols: int = 1               # weight-gradient tile: input units ...
    dw_rows: int = 1               # ... by hidden units
    xp_panels: bool = False        # the projected inputs stored in panels of P units
    read_outputs: bool = False     # a stage may read back a pipeline output (step_bwd's dhg)
    raw_bwd_weights: bool = False  # the backward reads W_ih, W_hh as given (no pack_bwd)
    fused_bwd_below: int = 0       # hidden sizes below this: one backward kernel a step
    split: StepSplit | None = None  # CPU: steps split over the driver's threads
    max_registers: int = 64        # CUDA: registers a thread may use (the JIT's limit)
    cuda_graphs: bool = False      # CUDA: the step pipelines allocate nothing; loops may be graphs
    vendor_gemm: bool = False      # CUDA: the driver runs the projection's and the gradients'
    #                                GEMMs by cuBLAS; the pipelines add the biases (halstm.cublas)
    vendor_step_rows: int = 0      # ... and the steps' products too where the batch has this
    #                                many rows or more (0: never; HALSTM_VENDOR_STEP_ROWS overrides)
    vendor_step_splits: int = 1    # ... the forward's in this many GEMMs over slices of h's
    #                                units (split-K), their partial products summed by the step
    vendor_bf16: bool = False      # ... their operands rounded to bfloat16 copies first
    #                                (pipeline to_bf16; precision "bf16")
    fold_steps: bool = False       # CUDA, a step that reduces over units: the forward
    #                                also has steps that compute the next step's product
    #                                (pipeline.FOLD_FWD), run where the driver finds them fit
    narrow_rows: int = 0           # steps of up to this many batch rows run the narrow
    #                                step pipelines (pipeline.NARROW: CUDA and CPU bf16
    #                                forwards; with cpu_bf16, backward: step_bwd_fused; 0: none)
    loop_rows: int = 0             # CUDA forward: inference of up to this many batch rows
    #                                runs every step in one pipeline (pipeline.LOOP; 0: none)
    cpu_bf16: bool = False         # CPU (precision "bf16"): the products of the projection,
    #                                the steps and the grads pipeline of bf16 operands
    #                                (halstm.bf16; pipeline.BF16_BWD), the weight gradients'
    bf16_dw_rows: int = 0          # ... sums over rows in chunks of this many rows (a
    #                                multiple of 32; 0: one chunk) ...
    amx_tiles: bool = False        # ... on AMX tiles (else AVX512-BF16 dot products)

    def __post_init__(self):
        for name in ("panel", "dw_cols", "dw_rows", "max_registers"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"Layout.{name}: expected a positive int, got {v!r}")

    def to_dict(self) -> dict:
        """The layout as JSON data (manifests)."""
        return asdict(self)

    def without(self, *names: str) -> "Layout":
        """This layout with the named fields at their defaults."""
        return replace(self, **{n: Layout.__dataclass_fields__[n].default for n in names})
