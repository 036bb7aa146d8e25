"""The CPU schedule's AMX parts (precision "bf16", Layout.amx_bf16): the
stages of halstm.bf16's products, as Halide 21 lowers them to AMX tiles.

Halide recognises a product as AMX work only in this form: the accumulator
stored in an AMX tile (MemoryType 8), computed per 16 x 16 tile of its
copy, its update tiled 16 x 16 with the reduction split by 32 innermost,
atomic and vectorized over all three; the copy reads it out of the tile.
Any predicate on the tile's loads or stores defeats it, so the copy's
tile always has 16 rows (rows past the batch are computed from clamped
rows and never stored).
"""
import halide as hl

from .. import bf16

ROWS = bf16.TILE_ROWS
GUARD = hl.TailStrategy.GuardWithIf


def panels(p, target):
    """The bf16 pair panels f(k2, ji, q), q = kk + NH * (gate + G * jo):
    q split so that the indices are affine in (kk, gate, jo); per 8 kk of
    a panel's gate, 32 lanes (k2, ji) (a transpose of the panel's 16 rows x
    16 reduction values); panels in parallel. (JIT, Intel VM, K = H = 1024:
    1.8 ms, where lanes computed from q's divisions were gathers: 5.6 ms.)"""
    for name, n in (("wp_ih", p.K), ("wp_hh", p.H)):
        f = p.stage(name)
        k2, ji, q = f.args()
        qo, kk, jo, gate, ko, ki, lanes = (hl.Var(v) for v in
                                            ("qo", "kk", "jo", "gate", "ko", "ki", "lanes"))
        f.split(q, qo, kk, bf16.padded_reduction(n) // 2).split(qo, jo, gate, p.G)
        f.split(kk, ko, ki, 8).reorder(k2, ji, ki, ko, gate, jo).fuse(k2, ji, lanes)
        f.vectorize(lanes).unroll(ki).parallel(jo)


def rows(f, parallel: bool = True):
    """A bf16 copy of an operand's rows, f(k, row), computed whole: the
    reduction axis vectorized, rows in parallel tiles of 16."""
    k, row = f.args()
    ro, ri = hl.Var("ro"), hl.Var("ri")
    f.compute_root().vectorize(k, bf16.K_CHUNK, GUARD)
    if parallel:
        f.split(row, ro, ri, ROWS, GUARD).parallel(ro)


def product(acc, tile, r, at, at_var, rows_here: bool = False) -> None:
    """acc (AMX) and its copy `tile` (ji, row, gate, jo) computed per tile
    of `at`'s loop `at_var`: 16 units by 16 rows, every gate; r: acc's
    reduction (RDom). rows_here: `at_var` is a loop over panels, and the
    copy holds every row of its panel (in tiles of 16, a gate's tiles in
    turn, so that a gate's panel of the weight is read from L1 by each)."""
    ji, row, gate, jo = tile.args()
    # a row stride of 32: a dense 16 x 16 tile's store would simplify to one
    # 256-wide ramp, which the AMX lowering does not take for a tile store
    tile.compute_at(at, at_var).bound_extent(ji, 16).align_storage(ji, 32)
    if rows_here:
        ro, ri = hl.Var("ro"), hl.Var("ri")
        tile.split(row, ro, ri, ROWS, hl.TailStrategy.RoundUp).reorder(ji, ri, ro, gate, jo)
        tile.vectorize(ji).vectorize(ri)
        acc.compute_at(tile, ro)
    else:
        tile.bound_extent(row, ROWS).vectorize(ji).vectorize(row).unroll(gate)
        acc.compute_at(tile, gate)
    acc.store_in(bf16.AMX)
    a_ji, a_row = acc.args()[:2]
    ii, ri = hl.Var("ii"), hl.Var("ri")
    acc.tile(a_ji, a_row, ii, ri, 16, ROWS).vectorize(ii).vectorize(ri)
    ko, ki = hl.RVar("ko"), hl.RVar("ki")
    acc.update().tile(a_ji, a_row, ii, ri, 16, ROWS, GUARD).split(r.x, ko, ki, bf16.K_CHUNK) \
        .reorder(ki, ii, ri, ko, a_ji, a_row).atomic().vectorize(ki).vectorize(ii).vectorize(ri)
