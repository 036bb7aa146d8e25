"""The baseline: every stage computed at root, in its pure loop order,
no vectorization, no threads. Every table shows it."""
from ..layout import Layout


def _root(pipe, target):
    for f in pipe.stages.values():
        f.compute_root()


pack = proj = step = step_infer = pack_bwd = step_bwd = grads = gather = grads_ids = _root


def layout(target) -> Layout:
    """Packed operand shapes: all 1, the plain (transposed) layouts."""
    return Layout()
