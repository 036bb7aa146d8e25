"""The baseline: every stage computed at root, in its pure loop order,
no vectorization, no threads. Every table shows it."""


def _root(pipe, target):
    for f in pipe.stages.values():
        f.compute_root()


pack = proj = step = pack_bwd = step_bwd = grads = _root


def panel(target) -> int:
    """Weight panel width: 1, the plain transposed layout."""
    return 1
