"""Hand-written schedules for x86-64 (AVX2 / AVX-512) and ARM CPUs.

Every product is a register-tiled GEMM: the `*_acc` stage is computed per
output tile, its vector axis (the contiguous unit axis) vectorized, the
other tile axes unrolled, the reduction outside them, so that the tile's
accumulators stay in registers. Unit axes (fixed sizes) split with
ShiftInwards; batch axes (runtime sizes) split with GuardWithIf (the
pipeline clamps batch reads, so a tile may overrun B).
"""
import halide as hl

SHIFT = hl.TailStrategy.ShiftInwards
GUARD = hl.TailStrategy.GuardWithIf


def _lanes(target: hl.Target) -> int:
    return 16 if target.has_feature(hl.TargetFeature.AVX512) else 8


def _vw(target, extent: int, vectors: int = 1) -> int:
    """Vector tile width: `vectors` native vectors, at most the extent."""
    return min(_lanes(target) * vectors, extent)


def _gemm(out, acc, vec, vec_w, cols, reduce, par=None):
    """Register-tile out(vec, ...): vec split by vec_w and vectorized; each
    (var, factor, tail) in cols split and its inner part unrolled; acc
    computed per tile with `reduce` (RVars) outside the tile loops."""
    vo, vi = hl.Var(vec.name() + "o"), hl.Var(vec.name() + "i")
    out.split(vec, vo, vi, vec_w, SHIFT)
    inner, outer = [vi], [vo]
    for v, f, tail in cols:
        if f is None:             # the whole (small, fixed) axis in the tile
            inner.append(v)
            continue
        o, i = hl.Var(v.name() + "o"), hl.Var(v.name() + "i")
        out.split(v, o, i, f, tail)
        inner.append(i)
        outer.append(o)
    rest = [a for a in out.args() if a.name() not in {x.name() for x in [vec] + [c[0] for c in cols]}]
    out.reorder(*(inner + outer + rest)).vectorize(vi)
    for i in inner[1:]:
        out.unroll(i)
    if par is not None:
        out.parallel(par if isinstance(par, hl.Var) else {v.name(): v for v in outer + rest}[par])
    acc.compute_at(out, vo).vectorize(vec)
    tile_vars = [vec] + [c[0] for c in cols]
    for v in tile_vars[1:]:
        acc.unroll(v)
    upd = acc.update()
    upd.reorder(*(tile_vars + list(reduce))).vectorize(vec)
    for v in tile_vars[1:]:
        upd.unroll(v)
    return out


def pack(p, target):
    j, k = p.vars["j"], p.vars["k"]
    for name in ("wih_t", "whh_t"):
        p.stage(name).vectorize(j, _vw(target, p.H)).parallel(k)


def proj(p, target):
    v = p.vars
    _gemm(p.stage("xp"), p.stage("xp_acc"), v["j"], _vw(target, p.H),
          [(v["gate"], None, None), (v["b"], 4, GUARD)], [p.rdoms["i"].x], par="t")


def step(p, target):
    v, H = p.vars, p.H
    j, b = v["j"], v["b"]
    hg, hg_acc = p.stage("hg"), p.stage("hg_acc")
    hg.compute_root()
    # Large steps go parallel over unit tiles; small ones stay on one thread,
    # where a fork would cost more than the step.
    _gemm(hg, hg_acc, j, _vw(target, H), [(v["gate"], None, None), (b, 4, hl.TailStrategy.RoundUp)],
          [p.rdoms["k"].x], par="jo" if H >= 256 else None)
    vw = _vw(target, H)
    act = p.stage("saved")                      # the cell's gate activations
    act.compute_root().vectorize(j, vw).unroll(act.args()[1])
    out = p.stage("saved_out")
    out.vectorize(j, vw).unroll(out.args()[1])
    for s in p.cell.states:                     # new states: inlined into their copies
        p.stage(f"new_{s}_out").vectorize(j, vw)


def step_bwd(p, target):
    v, H = p.vars, p.H
    j, k, b = v["j"], v["k"], v["b"]
    names = ("dxp",) if p.cell.dxp_is_dhg else ("dxp", "dhg")
    for name in names:
        for f in (p.stage(name).compute_root(), p.stage(name + "_out")):
            f.vectorize(f.args()[0], _vw(target, H)).unroll(f.args()[1])
    r = p.rdoms["jg"]
    _gemm(p.stage("dprev_h"), p.stage("dh_prev_acc"), k, _vw(target, H, 2),
          [(b, 4, GUARD)], [r.x, r.y], par="ko" if H >= 256 else None)
    for s in p.cell.states[1:]:
        p.stage("dprev_" + s).vectorize(j, _vw(target, H))


def grads(p, target):
    v, K, H = p.vars, p.K, p.H
    i, j, k, gate, b = (v[n] for n in ("i", "j", "k", "gate", "b"))
    rg, rn = p.rdoms["jg"], p.rdoms["bt"]
    _gemm(p.stage("dx"), p.stage("dx_acc"), i, _vw(target, K, 2),
          [(b, 4, GUARD)], [rg.x, rg.y], par="t")
    for w, vec, n in (("dw_ih", i, K), ("dw_hh", k, H)):
        out = _gemm(p.stage(w), p.stage(w + "_acc"), vec, _vw(target, n, 2),
                    [(j, min(6, H), SHIFT)], [rn.x, rn.y])
        jo = hl.Var("jo")
        out.fuse(jo, gate, jo).parallel(jo)
    for bias in ("db_ih", "db_hh"):
        _gemm(p.stage(bias), p.stage(bias + "_acc"), j, _vw(target, H), [], [rn.x, rn.y],
              par="gate")
