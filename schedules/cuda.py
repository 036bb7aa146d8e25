"""CUDA schedules: every stage its own kernel, tiled over blocks and threads.

A correct baseline that compiles for any CUDA capability; making it fast
(shared-memory GEMM tiles, a fused per-step kernel, the whole time loop in
one kernel for small sizes) is the CUDA issue's work. Reductions run
serially inside each thread, over its own output element.
"""
import halide as hl


def layout(target: hl.Target) -> dict:
    """Packed operand shapes: weight panels a warp's worth of units wide."""
    return {"panel": 32, "dw_cols": 32, "dw_rows": 1}


def _gpu(stage, args, name):
    """gpu_tile a (Func or update Stage) over its first one or two pure vars."""
    if len(args) >= 2:
        bx, by, tx, ty = (hl.Var(f"{name}_{n}") for n in ("bx", "by", "tx", "ty"))
        stage.gpu_tile(args[0], args[1], bx, by, tx, ty, 32, 8, hl.TailStrategy.GuardWithIf)
    else:
        bx, tx = hl.Var(f"{name}_bx"), hl.Var(f"{name}_tx")
        stage.gpu_tile(args[0], bx, tx, 128, hl.TailStrategy.GuardWithIf)


def _kernels(p, target):
    unique = {f.name(): f for f in p.stages.values()}   # a Func may have two stage names
    for name, f in unique.items():
        f.compute_root()
        args = f.args()
        _gpu(f, args, name)
        for u in range(f.num_update_definitions()):
            _gpu(f.update(u), args, f"{name}_u{u}")


pack = proj = step = pack_bwd = step_bwd = grads = _kernels
