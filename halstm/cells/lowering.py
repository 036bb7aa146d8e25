"""A language Definition as a Cell: its step and derived backward as
Halide Funcs (pointwise Exprs, inlined unless a schedule names a stage).

A row value that reduces (mean, usum) becomes a Func over the batch row,
sum over an RDom of the units of its operands lowered at the RDom's unit;
the Funcs made are listed in `reductions`, children first, for the
schedules to place (a Func with an update cannot be inlined). A costly
unit value read by a sum and elsewhere (language.staged) becomes a Func
over (unit, row), listed in `stagings`: inlined unless a schedule
computes it once per row. A quotient by a row value that is not a
number (layer norm's 1 / sqrt(var + eps)) becomes a Func over the row
(of the quotient where both are row values, else of the reciprocal),
listed in `row_funcs`: inlined unless a schedule computes it once."""
from __future__ import annotations

import itertools
import math

import halide as hl

from .base import Cell, _is_nan, gate_func, sigmoid, tanh
from .language import REDUCTIONS, STAGED_OPS, Definition, Sym, _rows, _topo


def _relu(v):
    return hl.select(_is_nan(v), v, hl.max(v, 0.0))


# exp and log by Halide's polynomials (base.py: libm is one call per lane),
# about 2e-6 relative error; each select keeps NaN and gives the exact
# value where the polynomial does not hold (past exp's float range, log's
# zero, negatives and infinity).
_INF, _NAN = hl.f32(float("inf")), hl.reinterpret(hl.Float(32), hl.u32(0x7FC00000))


def _exp(v):
    return hl.select(_is_nan(v), v, v > hl.f32(88.72), _INF, v < -87.5, hl.f32(0), hl.fast_exp(v))


def _log(v):
    # (+Inf tested on the bits: LLVM may fold a float comparison with infinity)
    inf = hl.reinterpret(hl.UInt(32), v) == 0x7F800000
    # a subnormal v (below 2^-126) scaled by 2^24 first: the polynomial needs a normal float
    small = v < hl.f32(2.0 ** -126)
    scaled = hl.fast_log(hl.select(small, v * hl.f32(2.0 ** 24), v)) \
        - hl.select(small, hl.f32(24 * math.log(2.0)), hl.f32(0))
    return hl.select(_is_nan(v), v, v < 0.0, _NAN, v == 0.0, -_INF, inf, _INF, scaled)


def _softplus(v):
    """max(v, 0) + log1p(exp(-|v|)); log1p(e) by its series below e = 0.01,
    where log(1 + e) would lose e's digits to the rounding of 1 + e."""
    e = hl.fast_exp(-hl.min(hl.abs(v), 87.0))
    series = e * (1.0 - e * (0.5 - e * (hl.f32(1 / 3) - e * 0.25)))
    log1p = hl.select(e < hl.f32(0.01), series, hl.fast_log(1.0 + e))
    return hl.select(_is_nan(v), v, hl.max(v, 0.0) + log1p)


def _extreme(pick):
    """max or min that keeps a NaN of either operand."""
    return lambda a, b: hl.select(_is_nan(a), a, _is_nan(b), b, pick(a, b))


def _pick(p, q):
    """The derivative of max(p, q) by p: 1 where p > q, 0.5 where equal."""
    return hl.select(p > q, hl.f32(1), p == q, hl.f32(0.5), hl.f32(0))


_UNARY = {"sigmoid": sigmoid, "tanh": tanh, "relu": _relu, "neg": lambda v: -v,
          "sqrt": hl.sqrt, "exp": _exp, "log": _log, "softplus": _softplus,
          "step": lambda v: hl.select(v > 0.0, hl.f32(1), hl.f32(0))}
_BINARY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b,
           "/": lambda a, b: a / b, "max": _extreme(hl.max), "min": _extreme(hl.min),
           "pick": _pick}


_serial = itertools.count()


def _sign(node: Sym) -> tuple[bool, Sym]:
    """(whether node is the negation of t, t): the signs of a product's or
    quotient's factors taken out (-a * b as -(a * b)), and of a sum whose
    terms are all negated (-a + -b as -(a + b))."""
    if node.op == "neg":
        negated, inner = _sign(node.args[0])
        return not negated, inner
    if node.op in ("*", "/"):
        (n0, a), (n1, b) = _sign(node.args[0]), \
            (_sign(node.args[1]) if node.op == "*" else (False, node.args[1]))
        if n0 or n1:
            return n0 != n1, Sym(node.op, (a, b))
    if node.op == "+":
        (n0, a), (n1, b) = _sign(node.args[0]), _sign(node.args[1])
        if n0 and n1:
            return True, Sym("+", (a, b))
    return False, node


def _number(node: Sym) -> bool:
    """Whether node is computed from numbers alone (const, units)."""
    return all(n.op in ("const", "units") or (n.args and n.op not in REDUCTIONS)
               for n in _topo([node]))


def _shared() -> dict:
    return {"row_funcs": {}, "quotients": {}, "keys": {}}


class _Lowering:
    """Exprs of a Definition's nodes at unit u (a Var, or a reduction's
    RVar) and batch row b. known(node, u) gives an Expr for a node read
    from a buffer or Func (None: compute it from its children)."""

    def __init__(self, name: str, H: int, b, known, reductions: list, rows: dict,
                 staged=frozenset(), stagings=None, levels=None, stored=lambda n: False,
                 shared=None):
        self.name, self.H, self.b, self.known = name, H, b, known
        self.reductions, self.rows = reductions, rows    # shared: one Func per row node
        self.staged = staged                 # ids of the nodes lowered as Funcs (unit, row)
        self.stagings = {} if stagings is None else stagings   # shared: id -> Func
        self.levels = {} if levels is None else levels  # shared: reduction Func name -> level
        self.stored = stored                 # whether a node is read from memory, not computed
        # shared: "row_funcs" Expr text -> Func over b (_row_func); "quotients"
        # id -> the Func of that quotient node; "keys" Func name -> (level,
        # depth) of a staging or row Func: those of one key read none of each other
        self.shared = _shared() if shared is None else shared
        self.per_row: dict = {}              # id -> whether a row value (_per_row)
        self.memo: dict = {}

    def __call__(self, node: Sym, u):
        key = (id(node), u.name())
        e = self.memo.get(key)
        if e is None:
            e = self.memo[key] = self._expr(node, u)
        return e

    def _expr(self, node: Sym, u):
        e = self.known(node, u)
        if e is not None:
            return e
        op = node.op
        if op == "const":
            return hl.f32(node.arg)
        if op == "units":
            return hl.f32(self.H)
        if op in ("mean", "usum"):
            return self._row(node)[self.b]
        if id(node) in self.staged:
            return self._staged(node)[u, self.b]
        return self._computed(node, u)

    def _computed(self, node: Sym, u):
        op = node.op
        if op == "/" and self._per_row(node.args[1]):
            # by a row value (layer norm's scale): a unit value times the
            # reciprocal, which the unit loop computes once; unless the
            # divisor is a number, that reciprocal, or a quotient of two
            # row values, is a Func over b (_row_func)
            number = _number(node.args[1])
            if self._per_row(node.args[0]):
                if not number:
                    return self._row_func(node, self(node.args[0], u) / self(node.args[1], u),
                                          quotient=True)
            else:
                rcp = 1.0 / self(node.args[1], u)
                return self(node.args[0], u) * (rcp if number else self._row_func(node.args[1], rcp))
        if op in _UNARY:
            return _UNARY[op](self(node.args[0], u))
        if op in _BINARY:
            return _BINARY[op](*(self(a, u) for a in node.args))
        raise AssertionError(f"no value for {node!r}")

    def _staged(self, node: Sym) -> hl.Func:
        f = self.stagings.get(id(node))
        if f is None:
            f = hl.Func(f"{self.name}_{node.op}{next(_serial)}")
            u = hl.Var("u")
            f[u, self.b] = self._computed(node, u)
            self.stagings[id(node)] = f
            self._key(f, node, [self.stagings[id(n)] for n in _topo([node])
                                if n is not node and id(n) in self.stagings])
        return f

    def _key(self, f: hl.Func, node: Sym, inner: list) -> None:
        """f's key: the level of node, and 1 + the most depth of the Funcs
        of its kind that it reads (inner)."""
        keys = self.shared["keys"]
        depth = 1 + max((keys[g.name()][1] for g in inner), default=0)
        keys[f.name()] = (self._level(node), depth)

    def _row_func(self, node: Sym, value: hl.Expr, quotient: bool = False):
        """A row value (no unit in value) as a Func over b, one for equal
        Exprs (the adjoints repeat them): node's value where quotient, else
        node's reciprocal."""
        funcs, quotients = self.shared["row_funcs"], self.shared["quotients"]
        f = funcs.get(str(value))
        if f is None:
            f = funcs[str(value)] = hl.Func(f"{self.name}_row{next(_serial)}")
            f[self.b] = value
            # (a row Func reads others only as quotients: a reciprocal multiplies unit values)
            self._key(f, node, [quotients[id(n)] for n in _topo([node]) if id(n) in quotients])
        if quotient:
            quotients[id(node)] = f
        return f[self.b]

    def _row(self, node: Sym) -> hl.Func:
        """The reduction at node as a Func over b: the sum over the units of
        its operands (mean: divided by their count)."""
        f = self.rows.get(id(node))
        if f is not None:
            return f
        k = next(_serial)      # (names unique in a pipeline: nested sums are made first)
        r = hl.RDom([(0, self.H)], f"r_u{k}")
        at_r = _Lowering(self.name, self.H, self.b, self.known, self.reductions, self.rows,
                         self.staged, self.stagings, self.levels, self.stored, self.shared)
        args, scale = node.args, 1.0 / (len(node.args) * self.H) if node.op == "mean" else 1.0
        if len(args) == 1:
            # sum(-t) as -sum(t): Halide simplifies f + (0 - t) to f - t, whose
            # associativity rfactor cannot prove
            negated, term = _sign(args[0])
            args, scale = (term,), -scale if negated else scale
        total = sum((at_r(a, r.x) for a in args[1:]), at_r(args[0], r.x))
        f = hl.Func(f"{self.name}_{node.op}{k}")
        f[self.b] = hl.f32(0)
        f[self.b] += total
        self.reductions.append(f)
        self.levels[f.name()] = self._level(node)
        if scale != 1.0:
            out = hl.Func(f"{self.name}_{node.op}{k}_out")
            out[self.b] = f[self.b] * hl.f32(scale)
            f = out
        self.rows[id(node)] = f
        return f


    def _per_row(self, node: Sym) -> bool:
        """Whether node has one value per batch row (the same at every unit):
        a row value (language._rows: a forward value through its val too),
        or a number."""
        if id(node) not in self.per_row:
            order = _topo([node])
            rows = _rows(order)
            for n in order:
                self.per_row.setdefault(id(n), id(n) in rows or n.op in ("const", "units"))
        return self.per_row[id(node)]

    def _level(self, node: Sym) -> int:
        """1 + the most reductions over units that node's operands wait for
        one after another (0 under a stored value): sums of one level read
        none of each other's results."""
        depth: dict = {}
        for n in _topo([node]):
            depth[id(n)] = 0 if self.stored(n) else (
                max((depth[id(c)] for c in n.args), default=0) + (n.op in REDUCTIONS))
        return depth[id(node)]


def _saved_levels(nodes) -> dict:
    """id -> level of each saved unit value: 0 unless it is computed from
    other saved values that are costly (language.STAGED_OPS), else 1 + the
    highest level among those."""
    ids = {id(n) for n in nodes}
    levels, reach = {}, {}       # reach: the level a value computed from a node has
    for n in _topo(nodes):
        level = max((reach[id(c)] for c in n.args), default=0)
        if id(n) in ids:
            levels[id(n)] = level
        reach[id(n)] = level + 1 if id(n) in ids and n.op in STAGED_OPS else level
    return levels


def _read_by_several(outputs, stored) -> frozenset:
    """ids of the costly forward values (language.STAGED_OPS) that backward
    computes (not stored) for more than one of its outputs: the LSTM's
    tanh(c'), read by every gate's adjoint and by dc. Each output is a
    store of its own (a Tuple element, a gate's plane), where Halide
    would compute it again."""
    readers: dict = {}
    for k, out in enumerate(outputs):
        seen: set = set()
        stack = [n.args[0] for n in _topo([out]) if n.op == "val"]
        while stack:
            n = stack.pop()
            if id(n) in seen or stored(n):
                continue
            seen.add(id(n))
            if n.op in STAGED_OPS:
                readers.setdefault(id(n), set()).add(k)
            stack.extend(n.args)
    return frozenset(i for i, ks in readers.items() if len(ks) > 1)


class DefinedCell(Cell):
    """A Cell whose forward is a Definition's step and whose backward is
    the Definition's derived adjoints."""

    def __init__(self, d: Definition):
        self.d = d
        self.name, self.gates, self.states = d.name, d.gates, d.states
        self.saved, self.dxp_is_dhg = d.saved, d.dxp_is_dhg
        self.saved_channels = d.saved_channels
        self.matrix_bias = d.matrix_bias
        self.channels, self.reduces = d.channels, d.reduces
        self.reductions: list = []     # the reduction Funcs of the last forward or backward
        self.levels: dict = {}         # their levels by name (_Lowering._level)
        self.stagings: list = []       # its Funcs over (unit, row) (_Lowering)
        self.saved_levels: list = []   # Funcs (j, channel, b) that saved reads (_leveled)
        self.row_funcs: list = []      # its Funcs over the row (_Lowering._row_func)
        self.keys: dict = {}           # the stagings' and row Funcs' (level, depth) by name

    def reduction_groups(self) -> list[list]:
        """reductions in groups by level (_Lowering._level), lowest first."""
        groups: dict = {}
        for f in self.reductions:
            groups.setdefault(self.levels[f.name()], []).append(f)
        return [groups[k] for k in sorted(groups)]

    def row_func_groups(self) -> list[list]:
        return self._groups(self.row_funcs)

    def staging_groups(self) -> list[list]:
        return self._groups(self.stagings)

    def _groups(self, funcs: list) -> list[list]:
        """funcs by key (_Lowering._key): groups that read none of each
        other, each after those it reads."""
        groups: dict = {}
        for f in funcs:
            groups.setdefault(self.keys[f.name()], []).append(f)
        return [groups[k] for k in sorted(groups)]

    def _lowered(self, shared: dict) -> None:
        self.row_funcs = list(shared["row_funcs"].values())
        self.keys = dict(shared["keys"])

    def _leaf(self, xp, hg, prev, vec, b):
        gate = {g: k for k, g in enumerate(self.gates)}
        channel = {(n if g is None else f"{n}.{g}"): c for c, (n, g) in enumerate(self.channels)}

        def leaf(n, u):
            if n.op == "x":
                return xp[u, gate[n.arg], b]
            if n.op == "r":
                return hg[u, gate[n.arg], b]
            if n.op == "s":
                return prev[n.arg][u, b]
            if n.op == "v":
                return vec[u, channel[n.arg]]
            return None
        return leaf

    def forward(self, xp, hg, prev, vec, H, j, b):
        d, leaf = self.d, self._leaf(xp, hg, prev, vec, b)
        self.reductions, rows, stagings, self.levels = [], {}, {}, {}
        shared = _shared()

        def lowering(known):
            return _Lowering(d.name, H, b, known, self.reductions, rows, d.staged_fwd, stagings,
                             self.levels, shared=shared)
        direct = lowering(leaf)
        row_values = [direct(n, j) for n in d.row_saved]       # (the same at every unit)
        packed = [hl.select(*[e for k, r in enumerate(row_values[m:m + H]) for e in (j == k, r)],
                            hl.f32(0)) for m in range(0, len(row_values), H)]
        saved = gate_func(f"{d.name}_saved", self._leveled(lowering, leaf, j, b) + packed,
                          j, b)
        slot = {id(n): k for k, n in enumerate(d.unit_saved)}

        def known(n, u):   # at unit j the states read the saved values back, as one Func
            if id(n) in slot and u.name() == j.name():
                return saved[u, slot[id(n)], b]
            return leaf(n, u)
        lower = _Lowering(d.name, H, b, known, self.reductions, rows, d.staged_fwd, stagings,
                          self.levels, shared=shared)
        new = {}
        for s in self.states:
            new[s] = hl.Func(f"{d.name}_{s}")
            new[s][j, b] = lower(d.new[s], j)
        self.stagings = list(stagings.values())
        self._lowered(shared)
        return saved, new

    def _leveled(self, lowering, leaf, j, b) -> list:
        """The saved unit values' Exprs at unit j. A saved value computed
        from another's activation (peephole's o from c', from i, f, g)
        reads it from a Func of the values of a lower level (saved_levels:
        Funcs (j, channel, b), each of values that read none of the later
        ones) instead of computing it again: on a CPU each saved channel
        is a loop of its own. lowering(known): a _Lowering at unit j."""
        d = self.d
        levels = _saved_levels(d.unit_saved)
        at: dict = {}                 # id -> (Func, its channel) of a lower level

        def known(n, u):
            if id(n) in at and u.name() == j.name():
                f, k = at[id(n)]
                return f[u, k, b]
            return leaf(n, u)
        self.saved_levels = []
        for level in range(max(levels.values(), default=0)):
            lower = lowering(known)
            nodes = [n for n in d.unit_saved if levels[id(n)] == level]
            f = gate_func(f"{d.name}_saved_level{level}", [lower(n, j) for n in nodes], j, b)
            self.saved_levels.append(f)
            at.update({id(n): (f, k) for k, n in enumerate(nodes)})
        lower = lowering(known)
        return [at[id(n)][0][j, at[id(n)][1], b] if id(n) in at else lower(n, j)
                for n in d.unit_saved]

    def step_exprs(self, xp, hg, prev, vec, H, u, b) -> dict:
        """The new states as Exprs at unit u (a Var or an RVar) and row b,
        the inputs read as forward's (xp[u, gate, b], hg[u, gate, b],
        prev[s][u, b], vec[u, channel]): one step with no Func of its own,
        for a pipeline whose update computes each step in place (pipeline
        LOOP). A cell without sums over units only."""
        if self.reduces:
            raise ValueError(f"cell {self.name!r} sums over units: no step as Exprs")
        lower = _Lowering(self.d.name, H, b, self._leaf(xp, hg, prev, vec, b), [], {})
        return {s: lower(self.d.new[s], u) for s in self.states}

    def backward(self, saved, prev, new, dnew, vec, H, j, b):
        d = self.d
        slot = {id(n): k for k, n in enumerate(d.unit_saved)}
        U = len(d.unit_saved)         # row value k: channel U + k // H, unit k % H
        row_at = {id(n): (k % H, U + k // H) for k, n in enumerate(d.row_saved)}
        new_node = {id(v): s for s, v in d.new.items()}
        leaf = self._leaf(None, None, prev, vec, b)

        def value(n, u):       # forward values: saved, new or previous states, else recomputed
            if id(n) in slot:
                return saved[u, slot[id(n)], b]
            if id(n) in row_at:
                return saved[row_at[id(n)][0], row_at[id(n)][1], b]
            if id(n) in new_node:
                return new[new_node[id(n)]][u, b]
            if n.op in ("x", "r"):
                raise AssertionError(f"{n!r} is needed but not saved")
            return leaf(n, u)
        self.reductions, rows, stagings, self.levels = [], {}, {}, {}
        stored = lambda n: id(n) in slot or id(n) in row_at or id(n) in new_node   # noqa: E731
        shared = _shared()
        # (each output once: with dxp_is_dhg a gate's d_x is its d_r, one store)
        outputs = list({id(a): a for a in (*d.d_x.values(), *d.d_r.values(),
                                           *d.d_prev.values(), *d.d_vec) if a is not None}.values())
        # (a cell that reduces keeps its values inline: staged as well, the
        # layer-norm LSTM's took no less time on the CPU)
        staged = frozenset() if self.reduces else _read_by_several(outputs, stored)
        values = _Lowering(d.name + "_val", H, b, value, self.reductions, {}, staged, stagings,
                           levels=self.levels, stored=stored, shared=shared)

        def known(n, u):
            if n.op == "val":
                return values(n.args[0], u)
            if n.op == "dnew":
                return dnew[n.arg][u, b]
            return None
        lower_at = _Lowering(d.name + "_adj", H, b, known, self.reductions, rows,
                             levels=self.levels, stored=stored, shared=shared)

        def lower(adjoint):
            return hl.f32(0) if adjoint is None else lower_at(adjoint, j)
        dxp = gate_func(f"{d.name}_dxp", [lower(d.d_x[g]) for g in self.gates], j, b)
        dhg = dxp if d.dxp_is_dhg else gate_func(
            f"{d.name}_dhg", [lower(d.d_r[g]) for g in self.gates], j, b)
        dprev = {}
        for s in self.states:
            if d.d_prev[s] is None and s == "h":   # (the pipeline adds W_hh^T dhg)
                dprev[s] = None
                continue
            dprev[s] = hl.Func(f"{d.name}_d{s}_prev")
            dprev[s][j, b] = lower(d.d_prev[s])
        dvec = None
        if self.channels:
            dvec = gate_func(f"{d.name}_dvec", [lower(a) for a in d.d_vec], j, b)
        self.stagings = list(stagings.values())
        self._lowered(shared)
        return dxp, dhg, dprev, dvec
