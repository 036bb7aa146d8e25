"""bfloat16 operands: rounding float32 to bf16, and the products of
precision "bf16" on CPUs (Layout.cpu_bf16), written in the form Halide 21
lowers to AMX tile instructions (tdpbf16ps: a 16 x 16 float32 tile += 16 x
32 bf16 rows times 32 x 16 bf16 columns); the same products also lower to
AVX512-BF16 dot products (vdpbf16ps; schedules/bf16_vectors.py).

A weight is stored as bf16 panels of P = 16 units whose reduction axis is
taken in pairs (AMX's layout for the right-hand operand): element (k, j)
of gate g sits at vnni(k % 2, j % P, k / 2 + NH * (g + G * (j / P))), NH =
the reduction's padded extent over 2. The left-hand operand (x or h rows)
is a bf16 copy of its rows, the reduction axis innermost. Sums are float32.
"""
from __future__ import annotations

import functools

import halide as hl

ON_AMX_TILES, AS_DOT_PRODUCTS = "on AMX tiles", "as AVX512-BF16 dot products"
TILE_ROWS = 16   # rows of an AMX tile: batch rows (or rows n) of one product tile
K_CHUNK = 32     # bf16 values of a tile row (64 bytes): the reduction in chunks of 32
AMX = hl.MemoryType(8)   # Halide's MemoryType::AMXTile (the Python bindings do not name it)


def cpu_products(target: hl.Target) -> str | None:
    """Where precision "bf16" runs its products on CPU target `target`:
    ON_AMX_TILES, AS_DOT_PRODUCTS (Halide 21 emits vdpbf16ps from
    avx512_zen4 on; avx512_sapphirerapids implies it), or None (no bf16)."""
    if target.has_feature(hl.TargetFeature.AVX512_SapphireRapids):
        return ON_AMX_TILES
    if target.has_feature(hl.TargetFeature.AVX512_Zen4):
        return AS_DOT_PRODUCTS
    return None


@functools.cache
def host_products() -> str | None:
    """cpu_products of the host CPU's target."""
    return cpu_products(hl.get_host_target())


def bits(x) -> hl.Expr:
    """The bfloat16 nearest float32 x (ties to even), as its uint16 bits; a
    NaN a quiet NaN."""
    b = hl.reinterpret(hl.UInt(32), x)
    rounded = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return hl.u16(hl.select(hl.is_nan(x), (b >> 16) | 0x40, rounded))


def value(x) -> hl.Expr:
    """float32 x rounded to a bfloat16 value (NaN stays NaN)."""
    return hl.reinterpret(hl.BFloat(16), bits(x))


def widened(x) -> hl.Expr:
    """A bfloat16 Expr as float32, exactly, by its bits (hl.f32 of a
    bfloat16 outside a product makes Halide 21 warn that it emulates the
    conversion on CPUs without AMX)."""
    return hl.reinterpret(hl.Float(32), hl.u32(hl.reinterpret(hl.UInt(16), x)) << 16)


def padded_reduction(n, to=K_CHUNK):
    """A reduction of n values padded to whole chunks of `to` values (a
    multiple of a tile row); n and `to` ints or Exprs."""
    if isinstance(n, int) and isinstance(to, int):
        return -(-n // to) * to
    return (n + (to - 1)) / to * to


def _pairs(n, to=K_CHUNK):
    """The pairs of a reduction of n values padded to `to` (ints or Exprs)."""
    half = padded_reduction(n, to)
    return half // 2 if isinstance(half, int) else half / 2


def panels(w, n, H: int, G: int, P: int, name: str, pad=K_CHUNK) -> hl.Func:
    """w(k, j, gate) (k < n, an int or an Expr; j < H) as the bf16 pair
    panels of the module's docstring: f(k2, ji, q), zero past n and H, the
    reduction padded to whole chunks of `pad`. numpy (Hp/P, G, NH, P, 2)."""
    f = hl.Func(name)
    k2, ji, q = hl.Var("k2"), hl.Var("ji"), hl.Var("q")
    nh = _pairs(n, pad)
    k = (q % nh) * 2 + k2
    gate = (q / nh) % G
    j = (q / (nh * G)) * P + ji
    inside = (k < n) & (j < H)
    f[k2, ji, q] = value(hl.select(inside, w[hl.min(k, n - 1), hl.min(j, H - 1), gate],
                                   hl.f32(0)))
    return f


def panels_extents(n: int, G: int, P: int, Hp: int) -> list:
    """The extents (2, P, pairs x G x Hp/P) of panels of a reduction of n
    values (an int) and G gates over Hp units (whole panels of P)."""
    return [2, P, _pairs(n) * G * (Hp // P)]


def chunks(src, n, name: str) -> hl.Func:
    """src(k, row) (k < n, an Expr) as bf16 rows in chunks of a tile row,
    f(kc, row, kq) = src(kq * K_CHUNK + kc, row), zero past n: a tile's
    rows lie K_CHUNK values apart whatever n (rows' row stride is the
    padded n, which Halide 21's AMX lowering takes only when constant)."""
    f = hl.Func(name)
    kc, row, kq = hl.Var("kc"), hl.Var("row"), hl.Var("kq")
    k = kq * K_CHUNK + kc
    f[kc, row, kq] = value(hl.select(k < n, src[hl.min(k, n - 1), row], hl.f32(0)))
    return f


def rows(src, n, name: str) -> hl.Func:
    """src(k, row) (k < n, an int or an Expr) as bf16, zero for k in [n,
    padded_reduction(n))."""
    f = hl.Func(name)
    k, row = hl.Var("k"), hl.Var("row")
    f[k, row] = value(hl.select(k < n, src[hl.min(k, n - 1), row], hl.f32(0)))
    return f


def weight(w, k, ji, gate, jo, n, G: int, pad=K_CHUNK) -> hl.Expr:
    """Element k of unit jo*P + ji of `gate` of a weight in bf16 pair
    panels (panels' layout; n its reduction's true extent, padded to `pad`)."""
    nh = _pairs(n, pad)
    return w[k % 2, ji, k / 2 + nh * (gate + G * jo)]


def product(name: str, a: hl.Func, w, n, G: int, chunk=None) -> tuple:
    """The product tiles acc(ji, row, gate, jo) = sum over k of a(k, row)
    w(k, jo*P + ji, gate), a the bf16 rows (rows; chunks' layout with
    chunk), w the bf16 panels
    (an ImageParam or Func f(k2, ji, q)), n the reduction's true extent (an
    int or an Expr). With chunk (an Expr: a multiple of K_CHUNK), the sums
    over each chunk of that many k apart: acc(ji, row, gate, jo, c) over k
    in [c*chunk, (c+1)*chunk) (w's reduction padded to whole chunks).
    Returns (acc, out, r): acc the float32 accumulator (`name`_bf16sum),
    out its copy in memory (`name`_tile), which consumers read (a schedule
    stores acc in AMX tiles and computes it per 16 x 16 tile of out, or
    keeps a tile of it in vector registers), r the reduction."""
    ji, row, gate, jo = hl.Var("ji"), hl.Var("row"), hl.Var("gate"), hl.Var("jo")
    args, pad = [ji, row, gate, jo], K_CHUNK
    if chunk is not None:   # (k = (c * chunk rows + r.y) * K_CHUNK + r.x: as AMX takes it)
        c = hl.Var("c")
        args, pad = args + [c], chunk
        r = hl.RDom([(0, K_CHUNK), (0, chunk / K_CHUNK)], name + "_r")
        kq = c * (chunk / K_CHUNK) + r.y
        k, left = kq * K_CHUNK + r.x, a[r.x, row, kq]     # (a: chunks' layout)
    else:
        r = hl.RDom([(0, padded_reduction(n))], name + "_r")
        k, left = r.x, a[r.x, row]
    acc = hl.Func(name + "_bf16sum")
    acc[args] = hl.f32(0)
    acc[args] += hl.f32(left) * hl.f32(weight(w, k, ji, gate, jo, n, G, pad))
    out = hl.Func(name + "_tile")
    out[args] = acc[args]
    return acc, out, r


def at(tile, j, row, gate, P: int):
    """A product's value at unit j, row `row`, from its tiles."""
    return tile[j % P, row, gate, j / P]
