"""A cell's step written once, as an expression; its backward derived.

    from halstm.cells.language import define, sigmoid, tanh

    def step(x, r, s):      # x, r: per gate, W_ih x + b_ih and W_hh h + b_hh
        z = sigmoid(x.z + r.z)                           # s: the previous states
        return {"h": (1 - z) * tanh(x.n + r.n) + z * s.h}

    CELL = define("mgu", gates="zn", states="h", step=step)      # minimal gated unit

`define` runs `step` once on symbols and keeps the expression graph. The
backward is reverse-mode differentiation of that graph, done here rather
than by Halide's propagate_adjoints: the result is plain pointwise Exprs,
which inline into the pipeline's fused stages as a hand-written backward
does, where propagate_adjoints makes Funcs with update definitions and
generated names that every schedule would have to place.

A cell may declare vector parameters (`vector`: one value per unit, or
per unit of each gate block), read in the step as p.<name> (p.<name>.<gate>),
and may reduce over the hidden units (`mean`, and `layer_norm` built on
it): a value that is the same for every unit of a batch row ("a row
value") is computed once per row. Reverse mode sums a unit value's
adjoint over the units where it flows into a row value.

What a step saves for backward is chosen from the graph: the value of
every activation (sigmoid, tanh, relu, exp) that does not apply to a
state (backward reads the states), every projection that a derivative
needs as it is (a sum of projections, as x.f + r.f, as one value), and
every row value a derivative needs (stored in a channel, the same at
every unit). No halide import here: lowering (lowering.py)
imports it.
"""
from __future__ import annotations

import numbers

from dataclasses import dataclass

ACTIVATIONS = ("sigmoid", "tanh", "relu", "exp")   # their values saved, not their operands'
UNARY = ACTIVATIONS + ("sqrt", "log", "softplus")
BINARY_FUNCS = {"max": "maximum", "min": "minimum"}   # op -> its name in step_function's ops
# what a step may call, from halstm.cells (error messages list them)
FUNCTIONS = UNARY + tuple(BINARY_FUNCS.values()) + ("mean", "layer_norm")
LEAVES = ("x", "r", "s", "v")
REDUCTIONS = ("mean", "usum")     # usum: backward's sum over the units


class CellError(ValueError):
    """A cell definition that cannot be compiled; the message names the cell."""


class Sym:
    """A node of a step's expression graph. op: "x" / "r" (a gate's input
    projection / recurrent product, arg = gate), "s" (a previous state),
    "v" (a vector parameter, arg = "name" or "name.gate"), "const" (arg =
    the value), "units" (H), "+", "-", "*", "/", "neg", "max", "min",
    "sqrt", "log", "softplus", an activation, "mean" (over the units of
    all args) or "usum"."""

    __slots__ = ("op", "args", "arg", "serial")
    __array_priority__ = 1000      # numpy scalars defer to Sym's operators
    _count = 0

    def __init__(self, op, args=(), arg=None):
        self.op, self.args, self.arg = op, tuple(args), arg
        Sym._count += 1
        self.serial = Sym._count   # creation order: saved values in the order written

    def __add__(self, o): return Sym("+", (self, _sym(o)))
    def __radd__(self, o): return Sym("+", (_sym(o), self))
    def __sub__(self, o): return Sym("-", (self, _sym(o)))
    def __rsub__(self, o): return Sym("-", (_sym(o), self))
    def __mul__(self, o): return Sym("*", (self, _sym(o)))
    def __rmul__(self, o): return Sym("*", (_sym(o), self))
    def __truediv__(self, o): return Sym("/", (self, _sym(o)))
    def __rtruediv__(self, o): return Sym("/", (_sym(o), self))
    def __neg__(self): return Sym("neg", (self,))
    def __pos__(self): return self

    def __bool__(self):
        raise CellError("a step cannot branch on a value (if, and, or, comparisons): "
                        "write the math as one expression")

    __lt__ = __le__ = __gt__ = __ge__ = lambda self, o: self.__bool__()

    def __repr__(self):
        if self.op in LEAVES:
            return f"{'p' if self.op == 'v' else self.op}.{self.arg}"
        if self.op == "const":
            return repr(self.arg)
        return f"{self.op}({', '.join(map(repr, self.args))})"


def _sym(v) -> Sym:
    if isinstance(v, Sym):
        return v
    if isinstance(v, numbers.Real) and not isinstance(v, bool):
        return Sym("const", arg=float(v))
    raise CellError(f"a step's expression may combine symbols and numbers only, "
                    f"got {type(v).__name__} {v!r}")


def sigmoid(v) -> Sym:
    return Sym("sigmoid", (_sym(v),))


def tanh(v) -> Sym:
    return Sym("tanh", (_sym(v),))


def relu(v) -> Sym:
    return Sym("relu", (_sym(v),))


def sqrt(v) -> Sym:
    return Sym("sqrt", (_sym(v),))


def exp(v) -> Sym:
    return Sym("exp", (_sym(v),))


def log(v) -> Sym:
    return Sym("log", (_sym(v),))


def softplus(v) -> Sym:
    """log(1 + exp(v)); -softplus(-v) is log(sigmoid(v))."""
    return Sym("softplus", (_sym(v),))


def maximum(a, b) -> Sym:
    """The larger of a and b at each unit (NaN if either is NaN); where they
    are equal, each gets half the gradient, as in torch.maximum."""
    return Sym("max", (_sym(a), _sym(b)))


def minimum(a, b) -> Sym:
    """The smaller of a and b at each unit; as maximum otherwise."""
    return Sym("min", (_sym(a), _sym(b)))


def mean(*values) -> Sym:
    """The mean over the hidden units of the values taken together (each
    one value per unit: mean(a, b) averages 2H numbers); the same for
    every unit of a batch row."""
    if not values:
        raise CellError("mean: expected at least one value")
    return Sym("mean", tuple(_sym(v) for v in values))


def layer_norm(*values, eps: float = 1e-5):
    """(v - mean) / sqrt(var + eps) of each value, mean and the biased
    variance taken over the units of all values together (one value: the
    normalized value; several: a tuple)."""
    m = mean(*values)
    centred = [_sym(v) - m for v in values]
    scale = sqrt(mean(*[c * c for c in centred]) + eps)
    out = tuple(c / scale for c in centred)
    return out[0] if len(out) == 1 else out


@dataclass(frozen=True)
class Vector:
    """A vector parameter: state-dict name `<name>_l<k>`, H values (or G*H
    with per_gate, a block per gate in the gates' order), initialised to
    `init` (a number, or "uniform": torch's uniform(+-1/sqrt(H))); a bias
    (bias=True) is left out, as zeros, with bias=False."""
    name: str
    per_gate: bool = False
    init: object = 0.0
    bias: bool = False


def vector(name: str, per_gate: bool = False, init=0.0, bias: bool = False) -> Vector:
    """Declare a vector parameter for define(vectors=...)."""
    return Vector(name, per_gate, init, bias)


class _Names:
    """x, r, s or p of a step (or a per-gate vector's blocks, p.<name>):
    attribute access gives the leaf, once per name. prefix names it in
    errors; leaves: name -> Sym (or a _Names of blocks)."""

    def __init__(self, cell, prefix, leaves, what):
        self._cell, self._prefix, self._what, self._leaves = cell, prefix, what, leaves

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return self._leaves[name]
        except KeyError:
            raise CellError(f"cell {self._cell!r}: {self._prefix}.{name}: no {self._what} "
                            f"{name!r}; it has {list(self._leaves)}") from None

    def __getitem__(self, name):
        return getattr(self, name)

    def all(self):
        """Every leaf, blocks included."""
        for v in self._leaves.values():
            yield from (v.all() if isinstance(v, _Names) else (v,))


def _leaves(cell, kind, names, what) -> _Names:
    """x, r or s of a step: a leaf Sym(kind, arg=name) per name."""
    return _Names(cell, kind, {n: Sym(kind, arg=n) for n in names}, what)


def _vector_leaves(cell, specs, gates) -> _Names:
    """p of a step: p.<name> a vector's leaf, p.<name>.<gate> a per-gate
    vector's block (arg "name" or "name.gate")."""
    return _Names(cell, "p", {
        v.name: _Names(cell, f"p.{v.name}", {g: Sym("v", arg=f"{v.name}.{g}") for g in gates},
                       "gate") if v.per_gate else Sym("v", arg=v.name)
        for v in specs}, "vector parameter")


def _names(cell: str, what: str, value) -> tuple[str, ...]:
    names = tuple(value) if not isinstance(value, str) else (
        tuple(value.split()) if " " in value or "," in value else tuple(value))
    names = tuple(n.strip(",") for n in names if n.strip(","))
    if not names:
        raise CellError(f"cell {cell!r}: {what}: expected at least one name, got {value!r}")
    for n in names:
        if not n.isidentifier() or n.startswith("_"):
            raise CellError(f"cell {cell!r}: {what}: {n!r} is not a name")
    if len(set(names)) != len(names):
        raise CellError(f"cell {cell!r}: {what}: a name appears twice in {list(names)}")
    return names


def _topo(roots) -> list[Sym]:
    """Every node reachable from roots, children before parents."""
    order, seen = [], set()
    stack = [(r, False) for r in reversed(roots)]
    while stack:
        node, done = stack.pop()
        if done:
            order.append(node)
            continue
        if id(node) in seen:
            continue
        seen.add(id(node))
        stack.append((node, True))
        stack.extend((c, False) for c in reversed(node.args))
    return order


def _rows(nodes) -> set:
    """ids of the row values among nodes (children first): means, and
    what is computed from row values and numbers only."""
    rows = set()
    for n in nodes:
        if n.op in REDUCTIONS or (n.op not in LEAVES and n.args and n.op != "const" and all(
                id(c) in rows or c.op in ("const", "units") for c in n.args)):
            rows.add(id(n))
    return rows


STAGED_OPS = ACTIVATIONS + ("sqrt", "/")


def staged(roots, rows) -> set:
    """ids of the costly unit values (activations, square roots, divisions)
    that are read at more than one unit: by a sum over the units and at
    the output unit, or by two sums (a layer norm of a value computed from
    activations reads it three times). Lowering computes each once per
    batch row, as a Func over the units, where Halide would recompute it
    in every loop that reads it. Read in one place, a value stays inline."""
    where: dict = {id(r): {"out"} for r in roots}
    out = set()
    for n in reversed(_topo(roots)):          # parents before children
        places = where[id(n)]
        if n.op in STAGED_OPS and id(n) not in rows and len(places) > 1:
            out.add(id(n))
        inner = {id(n)} if n.op in REDUCTIONS or id(n) in out else places
        for c in n.args:
            where.setdefault(id(c), set()).update(inner)
    return out


def _vector_specs(cell, vectors) -> tuple:
    specs = tuple(vectors.values()) if isinstance(vectors, dict) else tuple(vectors)
    for v in specs:
        if not isinstance(v, Vector):
            raise CellError(f"cell {cell!r}: vectors: expected halstm.cells.vector(...) "
                            f"declarations, got {type(v).__name__} {v!r}")
        if not v.name.isidentifier() or v.name.startswith("_"):
            raise CellError(f"cell {cell!r}: vectors: {v.name!r} is not a name")
        if not (v.init == "uniform" or (isinstance(v.init, numbers.Real)
                                        and not isinstance(v.init, bool))):
            raise CellError(f"cell {cell!r}: vector parameter {v.name!r}: init: expected a "
                            f"number or 'uniform', got {v.init!r}")
        if v.name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
            raise CellError(f"cell {cell!r}: vector parameter {v.name!r}: the matrices and "
                            f"their biases have that name")
    names = [v.name for v in specs]
    if len(set(names)) != len(names):
        raise CellError(f"cell {cell!r}: vectors: a name appears twice in {names}")
    return specs


def _add(a, b):
    return b if a is None else a if b is None else a + b


def _local_grads(node: Sym, val) -> list:
    """d node / d child for each child, as Syms over val(n) (a node's value)."""
    op, a = node.op, node.args
    if op == "+":
        return [None, None]          # (pass-through: the adjoint itself)
    if op == "-":
        return [None, "neg"]
    if op == "neg":
        return ["neg"]
    if op == "*":
        return [val(a[1]), val(a[0])]
    if op == "/":
        y = val(node)
        return [1.0 / val(a[1]), -y / val(a[1])]
    if op == "mean":
        share = 1.0 / (float(len(a)) * Sym("units"))
        return [share] * len(a)
    if op in ("max", "min"):     # pick(p, q): 1 where p > q, 0.5 where equal, else 0
        (p, q) = (val(a[0]), val(a[1])) if op == "max" else (val(a[1]), val(a[0]))
        return [Sym("pick", (p, q)), Sym("pick", (q, p))]
    if op == "log":
        return [1.0 / val(a[0])]
    if op == "softplus":
        return [Sym("sigmoid", (val(a[0]),))]
    y = val(node)
    if op == "sqrt":
        return [0.5 / y]
    if op == "sigmoid":
        return [y * (1.0 - y)]
    if op == "tanh":
        return [1.0 - y * y]
    if op == "relu":
        return [Sym("step", (y,))]   # 1 where y > 0, else 0
    if op == "exp":
        return [y]
    raise AssertionError(op)


class Definition:
    """A cell defined by its step: the graph, what forward saves and the
    derived backward (adjoints as Syms over "val" leaves)."""

    def __init__(self, name, gates, states, step, doc="", vectors=(), matrix_bias=True):
        if not (isinstance(name, str) and name.isidentifier()):
            raise CellError(f"cell name: expected an identifier, got {name!r}")
        self.name, self.doc = name, doc or (step.__doc__ or "").strip()
        self.file = getattr(getattr(step, "__code__", None), "co_filename", None)
        self.cell_file = None   # the cell file cells.load_file registered it from, if any
        self.gates = _names(name, "gates", gates)
        self.states = _names(name, "states", states)
        self.matrix_bias = bool(matrix_bias)
        if self.states[0] != "h":
            raise CellError(f"cell {name!r}: states: the first state must be 'h' (the "
                            f"output), got {list(self.states)}")
        self.vectors = _vector_specs(name, vectors)
        # the vector channels in order: (name, gate or None); V = len
        self.channels = tuple((v.name, g) for v in self.vectors
                              for g in (self.gates if v.per_gate else (None,)))
        x = _leaves(name, "x", self.gates, "gate")
        r = _leaves(name, "r", self.gates, "gate")
        s = _leaves(name, "s", self.states, "state")
        p = _vector_leaves(name, self.vectors, self.gates)
        try:
            new = step(x, r, s, p) if self.vectors else step(x, r, s)
        except CellError as e:
            raise (e if str(e).startswith("cell ") else CellError(f"cell {name!r}: {e}")) from None
        except Exception as e:
            hint = "" if "Sym" not in str(e) else (
                f" (a step computes with halstm.cells' functions, {', '.join(FUNCTIONS)}, "
                f"not numpy's or torch's)")
            raise CellError(f"cell {name!r}: its step raised {type(e).__name__}: {e}{hint}") \
                from None
        if not isinstance(new, dict):
            raise CellError(f"cell {name!r}: step must return a dict of the new states "
                            f"{list(self.states)}, got {type(new).__name__}")
        if set(new) != set(self.states):
            missing, extra = set(self.states) - set(new), set(new) - set(self.states)
            raise CellError(f"cell {name!r}: step returned states {list(new)}, expected "
                            f"{list(self.states)}" + (f"; missing {sorted(missing)}" if missing
                                                      else "")
                            + (f"; unknown {sorted(extra)}" if extra else ""))
        self.new = {k: _sym(new[k]) for k in self.states}
        for k, v in self.new.items():
            if v.op in ("x", "r", "s", "const"):
                raise CellError(f"cell {name!r}: the new {k!r} is {v!r}; a new state must "
                                f"be computed from it")
        nodes = _topo([self.new[k] for k in self.states])
        used = {(n.op, n.arg) for n in nodes if n.op in ("x", "r", "s")}
        for g in self.gates:
            if ("x", g) not in used and ("r", g) not in used:
                raise CellError(f"cell {name!r}: gate {g!r} is used in no expression (its "
                                f"rows of weight_ih and weight_hh would do nothing)")
        if ("s", "h") not in used and not any(n.op == "r" for n in nodes):
            raise CellError(f"cell {name!r}: nothing depends on the previous h: not recurrent")
        used_v = {n.arg for n in nodes if n.op == "v"}
        for v in self.vectors:
            names = [f"{v.name}.{g}" for g in self.gates] if v.per_gate else [v.name]
            unused = [n for n in names if n not in used_v]
            if unused:
                raise CellError(f"cell {name!r}: vector parameter {v.name!r}: "
                                f"{', '.join('p.' + n for n in unused)} is used in no "
                                f"expression")
        self.leaves = {(n.op, n.arg): n for n in nodes if n.op in LEAVES}
        for leaf in p.all():
            self.leaves.setdefault(("v", leaf.arg), leaf)
        self.rows = _rows(nodes)
        for g in self.gates:     # a gate one side leaves unused still has both weights
            self.leaves.setdefault(("x", g), x[g])
            self.leaves.setdefault(("r", g), r[g])
        for k in self.states:
            self.leaves.setdefault(("s", k), s[k])
        self._derive(nodes)

    # ---- backward -------------------------------------------------------
    def _derive(self, nodes):
        new_ids = {id(v): k for k, v in self.new.items()}
        state_leaf = {id(n) for n in nodes if n.op == "s"}
        # saved: activations not of a state (in forward order)
        self.saved_nodes = sorted((n for n in nodes if n.op in ACTIVATIONS
                                   and id(n) not in new_ids and id(n.args[0]) not in state_leaf
                                   and id(n.args[0]) not in new_ids and id(n) not in self.rows),
                                  key=lambda n: n.serial)
        vals: dict[int, Sym] = {}

        def val(n: Sym) -> Sym:
            v = vals.get(id(n))
            if v is None:
                v = vals[id(n)] = Sym("val", (n,))
            return v

        adj: dict[int, Sym] = {}
        into_row: dict[int, Sym] = {}   # a row node's adjoint terms that are unit values
        for k, v in self.new.items():
            adj[id(v)] = _add(adj.get(id(v)), Sym("dnew", arg=k))
        for node in reversed(nodes):
            if id(node) in into_row:        # every parent is done: one sum over the units
                adj[id(node)] = _add(adj.get(id(node)), Sym("usum", (into_row[id(node)],)))
            d = adj.get(id(node))
            if d is None or not node.args:
                continue
            for child, g in zip(node.args, _local_grads(node, val)):
                if child.op == "const":
                    continue
                term = d if g is None else -d if g == "neg" else d * g
                into = into_row if id(child) in self.rows and id(node) not in self.rows else adj
                into[id(child)] = _add(into.get(id(child)), term)
        self.d_x = {g: adj.get(id(self.leaves["x", g])) for g in self.gates}
        self.d_r = {g: adj.get(id(self.leaves["r", g])) for g in self.gates}
        self.d_prev = {k: adj.get(id(self.leaves["s", k])) for k in self.states}
        self.d_vec = [adj.get(id(self.leaves["v", n if g is None else f"{n}.{g}"]))
                      for n, g in self.channels]
        self.dxp_is_dhg = all(self.d_x[g] is self.d_r[g] for g in self.gates)
        # projections and row values backward needs as they are join the saved values
        saved_ids = {id(n) for n in self.saved_nodes}
        raw = []

        def need(n: Sym):
            if id(n) in saved_ids or id(n) in new_ids or n.op in ("s", "v", "const", "units"):
                return
            if n.op in ("x", "r") or id(n) in self.rows or _projections_sum(n):
                saved_ids.add(id(n))
                raw.append(n)
                return
            for c in n.args:
                need(c)

        for d in _topo([d for d in (*self.d_x.values(), *self.d_r.values(),
                                    *self.d_prev.values(), *self.d_vec) if d is not None]):
            if d.op == "val":
                need(d.args[0])
        self.saved_nodes += sorted(raw, key=lambda n: (id(n) in self.rows, n.serial))
        if not self.saved_nodes:       # the layout holds at least one channel: h' itself
            self.saved_nodes = [self.new["h"]]
        # a channel per unit value; the row values side by side in channels
        # of their own (saved_channels), not each repeated at every unit
        self.unit_saved = [n for n in self.saved_nodes if id(n) not in self.rows]
        self.row_saved = [n for n in self.saved_nodes if id(n) in self.rows]
        self.saved = self.saved_channels(len(self.row_saved) or 1)
        # (backward: the layer-norm LSTM's values read at several places are
        # divisions, which staged as well took no less time on the CPU)
        self.staged_fwd = staged([*self.saved_nodes, *self.new.values()], self.rows)

    def saved_channels(self, H: int) -> tuple[str, ...]:
        """The saved channels' names at H units: one per saved unit value,
        then the row values, H to a channel ("rows", or "rows0", "rows1",
        ... where H is smaller than their count): row value k at unit
        k % H of channel k // H of them."""
        n = -(-len(self.row_saved) // H)
        rows = ("rows",) if n == 1 else tuple(f"rows{m}" for m in range(n))
        return _saved_names(self.unit_saved, self.rows) + rows

    @property
    def reduces(self) -> bool:
        """Whether the step reduces over the hidden units (a step then needs
        every unit of its products before its pointwise work)."""
        return any(n.op == "mean" for n in _topo(list(self.new.values())))

    def step_function(self, ops):
        """The step as a function of arrays: step(xg, hg, states, vectors=None)
        -> new states, xg and hg (B, G*H) with the gates' blocks in order,
        states (B, H) each, vectors {name: (H,) or (G*H,)}. ops gives
        sigmoid, tanh, relu, exp, sqrt, log, softplus, maximum, minimum and
        mean_units (a (B, H) array's mean over axis 1, kept as (B, 1)) for
        the array kind (numpy, torch); + - * / are the arrays' own."""
        H_of = lambda a: a.shape[1] // len(self.gates)   # noqa: E731
        gate = {g: k for k, g in enumerate(self.gates)}
        roots = [self.new[k] for k in self.states]
        order = _topo(roots)

        def step(xg, hg, states, vectors=None):
            H = H_of(xg)
            env = {}
            for n in order:
                if n.op in ("x", "r"):
                    k = gate[n.arg]
                    v = (xg if n.op == "x" else hg)[:, k * H:(k + 1) * H]
                elif n.op == "s":
                    v = states[self.states.index(n.arg)]
                elif n.op == "v":
                    name, _, g = n.arg.partition(".")
                    v = vectors[name] if not g else \
                        vectors[name][gate[g] * H:(gate[g] + 1) * H]
                elif n.op == "const":
                    v = n.arg
                elif n.op == "neg":
                    v = -env[id(n.args[0])]
                elif n.op in UNARY:
                    v = getattr(ops, n.op)(env[id(n.args[0])])
                elif n.op == "mean":
                    v = sum(ops.mean_units(env[id(c)]) for c in n.args) / len(n.args)
                elif n.op in BINARY_FUNCS:
                    v = getattr(ops, BINARY_FUNCS[n.op])(*(env[id(c)] for c in n.args))
                else:
                    a, b = (env[id(c)] for c in n.args)
                    v = a + b if n.op == "+" else a - b if n.op == "-" else a * b \
                        if n.op == "*" else a / b
                env[id(n)] = v
            return tuple(env[id(r)] for r in roots)
        return step

    def signature(self) -> str:
        """The definition as text: equal for equal math (a cache key part)."""
        return (f"{self.name} gates={','.join(self.gates)} states={','.join(self.states)} "
                + (f"vectors={self.vectors!r} " if self.vectors else "")
                + ("" if self.matrix_bias else "matrix_bias=False ")
                + " ".join(f"{k}'={self.new[k]!r}" for k in self.states))

    def describe(self) -> dict:
        return {"name": self.name, "gates": list(self.gates), "states": list(self.states),
                "saved": list(self.saved), "dxp_is_dhg": self.dxp_is_dhg, "doc": self.doc,
                "vectors": [{"name": v.name, "per_gate": v.per_gate, "init": v.init,
                             "bias": v.bias} for v in self.vectors],
                "matrix_bias": self.matrix_bias, "reduces": self.reduces}


def _projections_sum(n: Sym) -> bool:
    """Whether n adds or subtracts two or more projections (x, r) and
    numbers only, as a gate's pre-activation x.f + r.f: saved as one value,
    not each projection."""
    nodes = _topo([n])
    return n.op in ("+", "-") and all(m.op in ("x", "r", "const", "+", "-", "neg")
                                      for m in nodes) \
        and sum(m.op in ("x", "r") for m in nodes) >= 2


def _gates_read(n: Sym) -> set:
    """The gates whose projections n reads, not counting inside activations,
    reductions, max and min."""
    if n.op in ("x", "r"):
        return {n.arg}
    if n.op in ACTIVATIONS or n.op in REDUCTIONS or n.op in BINARY_FUNCS:
        return set()
    return set().union(*(_gates_read(c) for c in n.args)) if n.args else set()


def _saved_names(nodes, rows) -> tuple[str, ...]:
    """A name for each saved value: its gate where an activation reads one
    gate (the LSTM's i, f, g, o), r_<gate> for a recurrent product saved as
    it is, pre_<gates> for a sum of projections (_projections_sum), else
    the activation and its gates; unique."""
    names = []
    for k, n in enumerate(nodes):
        if n.op in ("x", "r"):
            name = f"{n.op}_{n.arg}"
        elif _projections_sum(n):
            name = f"pre_{'_'.join(sorted(_gates_read(n)))}"
        elif id(n) in rows:                # a row value
            name = f"row_{k}"
        else:
            gates = sorted(_gates_read(n.args[0]))
            name = gates[0] if len(gates) == 1 else f"{n.op}_{'_'.join(gates) or k}"
        while name in names:
            name += "_"
        names.append(name)
    return tuple(names)


def define(name: str, gates, states, step, doc: str = "", vectors=(),
           matrix_bias: bool = True) -> Definition:
    """A cell from its step function step(x, r, s) -> {state: new value}
    (step(x, r, s, p) where it declares vectors). gates: names of the
    weight row blocks (in weight_ih's order), e.g. "ifgo" or ("i", "f",
    "g", "o"); states: names, h first. x.<gate> is W_ih x + b_ih's block,
    r.<gate> W_hh h + b_hh's, s.<state> the previous state, p.<name> a
    vector parameter (vectors: `vector(...)` declarations). matrix_bias
    False: no bias_ih, bias_hh (x.<gate> = W_ih x). CellError, naming the
    cell, for a definition that cannot be compiled."""
    return Definition(name, gates, states, step, doc, vectors, matrix_bias)
