"""The hand schedules' knobs that `halstm tune` searches (halstm/tuning.py):
per schedule name, knob name -> Knob. No halide import: aot.Spec checks
knobs before anything is built, and loading a cached library imports no
halide."""
from __future__ import annotations

from typing import NamedTuple

from .. import machine


class Knob(NamedTuple):
    direction: str        # the layer direction whose pipelines it acts on
    default: int          # the schedule's constant
    candidates: tuple     # the values tune tries
    reducing: bool = False    # acts only on cells whose step reduces over units
    bf16: bool = False        # acts on precision "bf16" layers too
    pointwise: bool = False   # acts only on cells whose step does not reduce over units
    fp32_only: bool = False   # acts on precision "fp32" layers only
    tensor_only: bool = False  # acts on the tensor-core precisions ("tf32", "bf16") only
    gemm: str | None = None   # acts only on layers whose non-recurrent GEMMs are this one's
    infer: bool = False       # acts on forwards without a tape only: tune times those
    floor: tuple | None = None  # (gates, least): in a cell of fewer gate blocks, a value
    #                             below least acts as least

    def effective(self, value: int, gates: int) -> int:
        """The value the schedule uses for `value` in a cell of `gates`
        gate blocks."""
        if self.floor is not None and gates < self.floor[0]:
            return max(value, self.floor[1])
        return value

    def acts_on(self, reduces: bool, precision: str, gemm: str = "halide") -> bool:
        """Whether it acts on a layer of a cell that reduces over its
        units (or not) in `precision` with `gemm`'s GEMMs (either
        direction)."""
        return ((reduces or not self.reducing) and not (reduces and self.pointwise)
                and (precision != "bf16" or self.bf16)
                and (precision == "fp32" or not self.fp32_only)
                and (precision != "fp32" or not self.tensor_only)
                and (self.gemm is None or gemm == self.gemm))


# The weight-gradient blocks' default (KiB, cpu_grads._dw_blocks): a
# quarter of the L2, so that a block's accumulators stay there beside the
# chunks of rows it reads, and no less than DW_BLOCK_LEAST_KIB. Each block
# reads all of the layer's input (N rows x K), so larger blocks, fewer,
# read less.
# On the Intel VM (L2 2 MiB) 512 KiB against 256 took one layer's
# backward 0.95x-0.99x (LSTM, GRU; K=H=1024 B=64 T=25, K=512 and 65 H=512
# B=64 T=100); on the 16-core Xeon (L2 2 MiB) 512 led 256 in four of six
# such layers' tune rounds; 128 KiB lost on the Intel VM and the Zen 2 VM
# (L2 512 KiB) (bench/RESULTS.md, "Schedule decisions": cpu.dw blocks).
DW_BLOCK_LEAST_KIB = 256


def dw_block_kib() -> int:
    """This machine's default of the knob dw_block_kib (KiB)."""
    return max(DW_BLOCK_LEAST_KIB, machine.l2_bytes() // 4 >> 10)


# cpu (schedules/cpu.py): the accumulators of a weight-gradient block
# (KiB), the projection's row chunk (tiles), the multiply-adds (in 2^10)
# below which the float32 projection runs on the calling thread where the
# call runs on threads of its own, not on a shared OpenMP team (1: only a
# layer of fewer than 1024 input weights), the backward product's panel
# budget (KiB; see cpu._dh_tiles) and, for a cell that reduces over units,
# the W_hh size up to which its forward takes ranges of batch rows (in
# KiB: 1 never, 1 GiB always; cpu._cell_rows; past it, steps in two
# parts). In a precision "bf16" layer the projection's row chunk acts
# where its products run as AVX512-BF16 dot products (not on AMX tiles),
# and the backward product's panels in the float32 steps of up to
# amx.NARROW_ROWS rows; the others do not act (its weight gradients'
# chunks follow the L2). Which value is fastest depends on the machine:
# ranges of rows forward past 512 KiB of W_hh lost to Halide's pool on 16
# cores and won on 2 (bench/RESULTS.md, "cpu.step rows", "Tuned knobs").
_DW_BLOCK_KIB = dw_block_kib()      # (this machine's, read once)
KNOBS = {"cpu": {"dw_block_kib": Knob("bwd", _DW_BLOCK_KIB,
                                       tuple(sorted({128, 256, 512, 1024, _DW_BLOCK_KIB}))),
                 "proj_chunk": Knob("fwd", 32, (8, 16, 32, 64), bf16=True),
                 "proj_serial_kmacs": Knob("fwd", 2048, (1, 2048, 8192)),
                 "dh_panel_kib": Knob("bwd", 512, (256, 512, 1024, 2048), bf16=True),
                 "rows_fwd_kib": Knob("fwd", 512, (1, 512, 1 << 20), reducing=True)},
# cuda (schedules/cuda.py): the W_hh bytes (KiB) a one-row block of step
# tiles reads from which a forward's steps of few rows run the narrow steps
# (cuda.narrow_layout; 1 << 20: never); in layers with cuBLAS GEMMs the
# multiply-adds (in 2^20) of a step's product from which it runs as a
# cuBLAS GEMM, forward and backward, in fp32 and in the tensor-core
# precisions apart, the fp32 steps of cells that reduce over units apart
# too (cuda.vendor_layout; 1 << 20: never; the fp32 backward of cells that
# do not reduce from 8 rows, and for cells of fewer than 3 gate blocks not
# below the default of cells that reduce: Knob.floor, so that tune builds
# none of the values below it there);
# the W_hh size, in percent of the shared memory one block may have, up
# to which a forward without a tape runs every step in one kernel
# (cuda.loop_layout, cuda.loop_infer; 1: a W_hh of 2 KiB on an H100,
# about never). Their
# defaults were measured on an H100 (bench/RESULTS.md, "Schedule
# decisions": cuda.step_narrow, cuda.VENDOR_STEP_MACS, cuda.loop).
        "cuda": {"narrow_kib": Knob("fwd", 128, (64, 128, 1 << 20), pointwise=True),
                 "step_gemm_mmacs": Knob("fwd", 16, (8, 16, 32, 96, 1 << 20), pointwise=True,
                                         fp32_only=True, gemm="cublas"),
                 "step_gemm_reducing_mmacs": Knob("fwd", 32, (16, 32, 96, 1 << 20),
                                                  reducing=True, fp32_only=True, gemm="cublas"),
                 "step_gemm_bwd_mmacs": Knob("bwd", 16, (8, 16, 32, 96, 1 << 20), pointwise=True,
                                             fp32_only=True, gemm="cublas",
                                             floor=(3, 96)),   # step_gemm_reducing_bwd_mmacs'
                 "step_gemm_reducing_bwd_mmacs": Knob("bwd", 96, (32, 96, 1 << 20),
                                                      reducing=True, fp32_only=True,
                                                      gemm="cublas"),
                 "step_gemm_tensor_mmacs": Knob("fwd", 32, (8, 32, 1 << 20), bf16=True,
                                                tensor_only=True, gemm="cublas"),
                 "step_gemm_tensor_bwd_mmacs": Knob("bwd", 32, (8, 32, 1 << 20), bf16=True,
                                                    tensor_only=True, gemm="cublas"),
                 "loop_shared_pct": Knob("fwd", 100, (1, 50, 100, 150), pointwise=True,
                                         infer=True)}}


def value(schedule: str, knobs, name: str) -> int:
    """Knob `name` of `schedule` among a layer's tuned knobs (a mapping,
    or None: none tuned): the tuned value (halstm tune), else the
    knob's default."""
    return (knobs or {}).get(name, KNOBS[schedule][name].default)


# Per schedule and direction, the facts of the machine that compiles them
# (halstm.machine's functions of those names) that shape its libraries:
# their cache keys hold them. cpu: the core count, the weight gradients'
# tasks (cpu_grads._dw_blocks), and the L2's size, the weight-gradient
# blocks' default (dw_block_kib above) and the rows of the bf16 weight
# gradients' chunks (cpu.bf16_layout); cuda: the SM count, the batches whose forward
# steps put the gates on the lanes (cuda.narrow_layout) or whose forward
# runs as one kernel (cuda.loop_layout), and a block's shared memory, the
# weights that forward may hold (cuda.loop_layout, cuda.loop_infer).
MACHINE_FACTS = {"cpu": {"bwd": ("cores", "l2_bytes")},
                 "cuda": {"fwd": ("gpu_sms", "gpu_block_shared_bytes")}}
