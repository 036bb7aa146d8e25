"""The CPU schedules' register tiles: a product's `*_acc` stage computed
per output tile, its unit axis vectorized in panels of one vector's lanes,
the other tile axes unrolled and the reduction outside them (see
schedules/cpu.py); the vector and register sizes of a target; a knob's
value for a pipe.
"""
import halide as hl

from . import knobs

SHIFT = hl.TailStrategy.ShiftInwards
GUARD = hl.TailStrategy.GuardWithIf
ROUND = hl.TailStrategy.RoundUp


def panel(target: hl.Target) -> int:
    """One native float vector: the width of a weight panel, so that one
    reduction step of a tile reads one vector of a panel."""
    return 16 if target.has_feature(hl.TargetFeature.AVX512) else 8


def registers(target: hl.Target) -> int:
    """The vector register file in panel-wide vectors: 32 with AVX-512
    (zmm), 16 with AVX (ymm), 8 with SSE alone, 16 on ARM (32 NEON
    registers, two a panel)."""
    if target.arch == hl.TargetArch.ARM:
        size = 32 * 16
    elif target.has_feature(hl.TargetFeature.AVX512):
        size = 32 * 64
    else:
        size = 16 * (32 if target.has_feature(hl.TargetFeature.AVX) else 16)
    return size // (4 * panel(target))


def vector_width(target, extent: int) -> int:
    return min(panel(target), extent)


def register_tile(out, acc, vec, vec_w, cols, reduce, par=None, vec_tail=ROUND, small=None,
                  panels=1, chunk=None, extent=None, unroll_out=True, wide=None):
    """Register-tile out(vec, ...): vec split by vec_w * panels, each
    vec_w-wide panel vectorized and the panels unrolled; each (var, factor,
    tail) in cols split (factor None: the whole small axis) and unrolled;
    acc computed per tile with `reduce` (RVars) outside the tile loops;
    `par`: the name of an outer loop to run in parallel.

    A col whose tail is GUARD has a runtime extent: the tiled schedule is
    specialized to extent >= factor (with ShiftInwards, so every tile is
    full and its accumulators have a constant size), and smaller extents
    get a tile of 1 along it. `small`: (condition, panels, par) for a tile
    of that many panels and no batch tiling where condition holds (tiny
    batches, where a batch tile would waste FMAs). extent: the GUARD col's
    extent where out is not an output (else its buffer's). unroll_out
    False: out's own tile loops (not acc's) stay loops, for an out whose
    per-element work is large (less code to compile). wide: (factor,
    condition), a factor for the GUARD col tried first, where condition
    holds."""
    runtime = [(v, f) for v, f, tail in cols if tail is GUARD]
    tiled_cols = [(v, f, SHIFT if tail is GUARD else tail) for v, f, tail in cols]
    untiled = [(v, 1, ROUND) if tail in (GUARD, ROUND) and f else (v, f, tail)
               for v, f, tail in cols]
    if small is not None:
        cond, small_panels, small_par = small
        tile_loops(out.specialize(cond), out, vec, vec_w, small_panels, untiled, small_par,
                   vec_tail, unroll=unroll_out)
    if runtime:
        dims = {a.name(): d for d, a in enumerate(out.args())}
        buf = out.output_buffers()[0] if extent is None else None
        cond = None
        for v, f in runtime:
            c = (buf.dim(dims[v.name()]).extent() if extent is None else extent) >= f
            cond = c if cond is None else (cond & c)
        if wide is not None:
            (v, _), = runtime
            factor, wide_cond = wide
            wide_cols = [(c, factor, t) if c.name() == v.name() else (c, f, t)
                         for c, f, t in tiled_cols]
            tile_loops(out.specialize(wide_cond), out, vec, vec_w, panels, wide_cols, par, vec_tail,
                       chunk, unroll_out)
        tile_loops(out.specialize(cond), out, vec, vec_w, panels, tiled_cols, par, vec_tail, chunk,
                   unroll_out)
        tile_loops(out, out, vec, vec_w, panels, untiled, par, vec_tail, chunk, unroll_out)
    else:
        tile_loops(out, out, vec, vec_w, panels, tiled_cols, par, vec_tail, chunk, unroll_out)
    # per tile: inside the innermost tile loop (all specializations name it alike)
    innermost = next((hl.Var(v.name() + "o") for v, f, _ in cols if f is not None),
                     hl.Var(vec.name() + "o"))
    acc.compute_at(out, innermost)
    tile_vars = [c[0] for c in cols]
    vp, vv = hl.Var(vec.name() + "p"), hl.Var(vec.name() + "v")
    for stage in (acc, acc.update()):
        stage.split(vec, vp, vv, vec_w, ROUND).vectorize(vv).unroll(vp)
        for v in tile_vars:
            stage.unroll(v)
    acc.update().reorder(*([vv, vp] + tile_vars + list(reduce)))
    return out


def tile_loops(stage, func, vec, vec_w, panels, cols, par, vec_tail, chunk=None, unroll=True):
    """The loop nest of one (specialization of a) tiled stage."""
    vo, vi = hl.Var(vec.name() + "o"), hl.Var(vec.name() + "i")
    vp, vv = hl.Var(vec.name() + "p"), hl.Var(vec.name() + "v")
    stage.split(vec, vo, vi, vec_w * panels, vec_tail).split(vi, vp, vv, vec_w)
    inner, outer = [vv, vp], []
    for v, f, tail in cols:
        if f is None:
            inner.append(v)
            continue
        o, i = hl.Var(v.name() + "o"), hl.Var(v.name() + "i")
        if chunk is not None and chunk[0].name() == v.name():
            full, oc = hl.Var(v.name() + "of"), hl.Var(v.name() + "oc")
            stage.split(v, full, i, f, tail).split(full, oc, o, chunk[1], GUARD)
            chunks = [oc]
        else:
            stage.split(v, o, i, f, tail)
        inner.append(i)
        outer.append(o)
    tiled = {x.name() for x in [vec] + [c[0] for c in cols]}
    rest = [a for a in func.args() if a.name() not in tiled]
    # the weight-panel loop outermost: a panel stays in cache across the
    # batch tiles and time steps that use it; with `chunk` (var, tiles),
    # that var's tiles run in chunks outside the panel loop, so that a
    # chunk of rows stays in L2 while every panel passes
    outer += rest + [vo]
    if chunk is not None:
        outer += chunks
    stage.reorder(*(inner + outer)).vectorize(vv)
    for i in inner[1:] if unroll else ():
        stage.unroll(i)
    if par is not None and chunk is not None and par == vo.name():
        # one parallel loop over (chunk, panel) pairs, chunk-major: the
        # threads share a chunk's rows, and there is no join per chunk
        # (bench/RESULTS.md, "Schedule decisions": cpu.proj parallel loop).
        stage.fuse(vo, chunks[0], vo).parallel(vo)
    elif par is not None:
        stage.parallel({v.name(): v for v in outer}[par])


def tile_panels(extent: int, P: int, want: int) -> int:
    """Panels per tile: at most `want`, dividing the extent's panel count."""
    n = max(1, min(want, extent // P))
    while (extent // P) % n:
        n -= 1
    return n


def knob(p, name: str):
    """A cpu knob's value for pipe p: tuned (halstm tune), else its default."""
    return knobs.value("cpu", p.knobs, name)
