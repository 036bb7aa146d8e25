"""Halide's autoschedulers as named schedules: auto:<name>.

CPU targets: Adams2019, Li2018, Mullapudi2016; CUDA targets: Anderson2021,
Li2018 (schedules/__init__.py says why not Mullapudi2016). Each pipeline is
scheduled whole by the autoscheduler, with estimates from the layer's sizes (K, H fixed). The
runtime axes (batch, sequence length) are estimated at 1: the
autoschedulers split outputs with ShiftInwards by factors drawn from the
estimates, and such a schedule fails on any smaller extent (seen: T=5
against an estimate of 50, "x is accessed at -20"); one library must serve
every T and B. Adams2019 searches with a beam of 4 (ADAMS_BEAM: its default
of 32 took 28.6 s on one pipeline). The packed
operand layouts are those of the hand-written family schedule, so that a
comparison is between schedules of the same algorithm.

On CUDA targets the weight-packing pipeline (pack: a layout copy, run
once per call) uses the hand-written cuda schedule: an autoscheduler may
leave it on the host, which device-resident buffers cannot serve. (The
cuda layout has no pack_bwd: the backward reads the weights as given.)
Departures are appended to the notes of the pipeline scheduled (p.notes),
which reach each library's manifest.
"""
from __future__ import annotations

from functools import lru_cache

import halide as hl

B_EST, T_EST = 1, 1       # runtime axes: batch, sequence length (rows N = B*T)
# Anderson2021 cannot schedule these pipelines itself (Halide 21); Li2018 does:
#   step:  its cost model dies of SIGFPE on the step's Tuple output;
#   grads: at estimates of 1 it emits an invalid GPU loop nest ("Funcs cannot
#          be scheduled in between GPU block loops"); at estimates of
#          B=32, T=50 the schedule failed at run time on smaller batches
#          ("Input buffer dxp is accessed at -43", seen on an H100).
ADAMS_BEAM = 4            # Adams2019's beam search width (see _apply)
ANDERSON_FALLBACK = {"step": "SIGFPE in its cost model on the step's Tuple output",
                     "step_infer": "SIGFPE in its cost model on the step's Tuple output",
                     "grads": "an invalid GPU loop nest at estimates of 1"}


def parallelism(family: str) -> int:
    """The autoschedulers' parallelism: this machine's usable cores (CPU),
    the GPU's SM count (CUDA; machine.gpu_sms). A cache key of an
    autoscheduled build includes it."""
    from .. import machine
    if family == "cpu":
        return machine.cores()
    return machine.gpu_sms()


@lru_cache(maxsize=None)
def _load(name: str) -> None:
    hl.load_plugin(f"{hl.install_dir()}/lib64/libautoschedule_{name.lower()}.so")


class Auto:
    """A schedule module-alike running one autoscheduler."""

    def __init__(self, name: str, family: str):
        self.name, self.family = name, family

    def layout(self, target):
        """The family's packed layout; the pipelines as the CPU has them (no
        output read back: Anderson2021 fails with an empty error on such a
        step_bwd, Halide 21); no CUDA graphs (an autoscheduler may give a
        step a stage of its own in device memory); no steps split over the
        driver's threads (an autoscheduler parallelizes the step itself); no
        fused backward step (step_bwd as above)."""
        from . import cpu, cuda
        layout = (cuda if self.family == "gpu" else cpu).layout(target)
        return layout.without("read_outputs", "cuda_graphs", "split", "fused_bwd_below")

    def __getattr__(self, kind):
        if kind in ("pack", "proj", "step", "step_infer", "pack_bwd", "step_bwd", "grads",
                    "to_bf16"):
            return self._apply
        raise AttributeError(kind)

    def _apply(self, p, target):
        if self.family == "gpu" and p.kind in ("pack", "to_bf16"):
            from . import cuda
            p.notes.append(f"{p.kind} pipeline: the hand-written cuda schedule")
            return getattr(cuda, p.kind)(p, target)
        _estimate(p)
        name = self.name
        if name == "Anderson2021" and p.kind in ANDERSON_FALLBACK:
            name = "Li2018"
            p.notes.append(f"{p.kind} pipeline scheduled by Li2018: Anderson2021 gives "
                           f"{ANDERSON_FALLBACK[p.kind]}")
        _load(name)
        params = {"parallelism": str(parallelism("cpu"))} if self.family == "cpu" else {}
        if name == "Adams2019":
            # Its default beam of 32 spent 28.6 s on the grads pipeline at
            # H=1024 (over the 20 s bar for one pipeline); a beam of 4 spent
            # 4.0 s, and at small_128_b16 its kernels ran no slower (forward
            # 30 ms against 43, backward 49 against 51, alternating runs on
            # the 2-core VM; the whole layer compiled in 10.5 s, was 26.5).
            params["beam_size"] = str(ADAMS_BEAM)
        if name == "Anderson2021":
            params = {"parallelism": str(parallelism("gpu"))}
        p.pipeline().apply_autoscheduler(target, hl.AutoschedulerParams(name, params))


def _estimate(p) -> None:
    """Estimates for every input and output: fixed extents as they are;
    runtime ones: the batch, or rows N = B*T (projection, gradients)."""
    rows = {"step": [B_EST], "step_infer": [B_EST], "step_bwd": [B_EST], "proj": [B_EST * T_EST],
            "grads": [B_EST * T_EST]}.get(p.kind, [])
    for q in p.inputs:
        q.set_estimates(_extents(p.shapes[q.name()], rows))
    for f in p.outputs:
        f.set_estimates(_extents(p.shapes[f.name()], rows))


def _extents(shape, rows):
    runtime = iter(rows)
    return [(0, e if e is not None else next(runtime)) for e in shape]
