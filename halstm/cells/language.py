"""A cell's step written once, as an expression; its backward derived.

    from halstm.cells.language import define, sigmoid, tanh

    def step(x, r, s):      # x, r: per gate, W_ih x + b_ih and W_hh h + b_hh
        z = sigmoid(x.z + r.z)                           # s: the previous states
        return {"h": (1 - z) * tanh(x.n + r.n) + z * s.h}

    CELL = define("minimal_gru", gates="zn", states="h", step=step)

`define` runs `step` once on symbols and keeps the expression graph. The
backward is reverse-mode differentiation of that graph, done here rather
than by Halide's propagate_adjoints: the result is plain pointwise Exprs,
which inline into the pipeline's fused stages as a hand-written backward
does, where propagate_adjoints makes Funcs with update definitions and
generated names that every schedule would have to place.

What a step saves for backward is chosen from the graph: the value of
every activation (sigmoid, tanh, relu) that does not apply to a state
(backward reads the states) and every projection that a derivative needs
as it is. No halide import here: lowering (`halide_cell`) imports it.
"""
from __future__ import annotations

import numbers

ACTIVATIONS = ("sigmoid", "tanh", "relu")


class CellError(ValueError):
    """A cell definition that cannot be compiled; the message names the cell."""


class Sym:
    """A node of a step's expression graph. op: "x" / "r" (a gate's input
    projection / recurrent product, arg = gate), "s" (a previous state),
    "const" (arg = the value), "+", "-", "*", "/", "neg", or an activation."""

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
        if self.op in ("x", "r", "s"):
            return f"{self.op}.{self.arg}"
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


class _Names:
    """x, r or s of a step: attribute access gives the leaf, once per name."""

    def __init__(self, cell, kind, names, what):
        self._cell, self._kind, self._what = cell, kind, what
        self._leaves = {n: Sym(kind, arg=n) for n in names}

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return self._leaves[name]
        except KeyError:
            raise CellError(f"cell {self._cell!r}: {self._kind}.{name}: no {self._what} "
                            f"{name!r}; it has {list(self._leaves)}") from None

    def __getitem__(self, name):
        return getattr(self, name)


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
    y = val(node)
    if op == "sigmoid":
        return [y * (1.0 - y)]
    if op == "tanh":
        return [1.0 - y * y]
    if op == "relu":
        return [Sym("step", (y,))]   # 1 where y > 0, else 0
    raise AssertionError(op)


class Definition:
    """A cell defined by its step: the graph, what forward saves and the
    derived backward (adjoints as Syms over "val" leaves)."""

    def __init__(self, name, gates, states, step, doc=""):
        if not (isinstance(name, str) and name.isidentifier()):
            raise CellError(f"cell name: expected an identifier, got {name!r}")
        self.name, self.doc = name, doc or (step.__doc__ or "").strip()
        self.file = getattr(getattr(step, "__code__", None), "co_filename", None)
        self.gates = _names(name, "gates", gates)
        self.states = _names(name, "states", states)
        if self.states[0] != "h":
            raise CellError(f"cell {name!r}: states: the first state must be 'h' (the "
                            f"output), got {list(self.states)}")
        x = _Names(name, "x", self.gates, "gate")
        r = _Names(name, "r", self.gates, "gate")
        s = _Names(name, "s", self.states, "state")
        try:
            new = step(x, r, s)
        except CellError as e:
            raise (e if str(e).startswith("cell ") else CellError(f"cell {name!r}: {e}")) from None
        except Exception as e:
            raise CellError(f"cell {name!r}: its step raised {type(e).__name__}: {e}") from None
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
        self.leaves = {(n.op, n.arg): n for n in nodes if n.op in ("x", "r", "s")}
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
                                   and id(n.args[0]) not in new_ids), key=lambda n: n.serial)
        vals: dict[int, Sym] = {}

        def val(n: Sym) -> Sym:
            v = vals.get(id(n))
            if v is None:
                v = vals[id(n)] = Sym("val", (n,))
            return v

        adj: dict[int, Sym] = {}
        for k, v in self.new.items():
            adj[id(v)] = _add(adj.get(id(v)), Sym("dnew", arg=k))
        for node in reversed(nodes):
            d = adj.get(id(node))
            if d is None or not node.args:
                continue
            for child, g in zip(node.args, _local_grads(node, val)):
                if child.op == "const":
                    continue
                term = d if g is None else -d if g == "neg" else d * g
                adj[id(child)] = _add(adj.get(id(child)), term)
        self.d_x = {g: adj.get(id(self.leaves["x", g])) for g in self.gates}
        self.d_r = {g: adj.get(id(self.leaves["r", g])) for g in self.gates}
        self.d_prev = {k: adj.get(id(self.leaves["s", k])) for k in self.states}
        self.dxp_is_dhg = all(self.d_x[g] is self.d_r[g] for g in self.gates)
        # projections backward needs as they are join the saved values
        saved_ids = {id(n) for n in self.saved_nodes}
        raw = []

        def need(n: Sym):
            if id(n) in saved_ids or id(n) in new_ids or n.op in ("s", "const"):
                return
            if n.op in ("x", "r"):
                saved_ids.add(id(n))
                raw.append(n)
                return
            for c in n.args:
                need(c)

        for d in _topo([d for d in (*self.d_x.values(), *self.d_r.values(),
                                    *self.d_prev.values()) if d is not None]):
            if d.op == "val":
                need(d.args[0])
        self.saved_nodes += raw
        if not self.saved_nodes:       # the layout holds at least one channel: h' itself
            self.saved_nodes = [self.new["h"]]
        self.saved = _saved_names(self.saved_nodes)

    def step_function(self, ops):
        """The step as a function of arrays: step(xg, hg, states) -> new
        states, xg and hg (B, G*H) with the gates' blocks in order, states
        (B, H) each. ops gives sigmoid, tanh and relu for the array kind
        (numpy, torch); + - * / are the arrays' own."""
        H_of = lambda a: a.shape[1] // len(self.gates)   # noqa: E731
        gate = {g: k for k, g in enumerate(self.gates)}
        roots = [self.new[k] for k in self.states]
        order = _topo(roots)

        def step(xg, hg, states):
            H = H_of(xg)
            env = {}
            for n in order:
                if n.op in ("x", "r"):
                    k = gate[n.arg]
                    v = (xg if n.op == "x" else hg)[:, k * H:(k + 1) * H]
                elif n.op == "s":
                    v = states[self.states.index(n.arg)]
                elif n.op == "const":
                    v = n.arg
                elif n.op == "neg":
                    v = -env[id(n.args[0])]
                elif n.op in ACTIVATIONS:
                    v = getattr(ops, n.op)(env[id(n.args[0])])
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
                + " ".join(f"{k}'={self.new[k]!r}" for k in self.states))

    def describe(self) -> dict:
        return {"name": self.name, "gates": list(self.gates), "states": list(self.states),
                "saved": list(self.saved), "dxp_is_dhg": self.dxp_is_dhg, "doc": self.doc}


def _gates_read(n: Sym) -> set:
    """The gates whose projections n reads, not counting inside activations."""
    if n.op in ("x", "r"):
        return {n.arg}
    if n.op in ACTIVATIONS:
        return set()
    return set().union(*(_gates_read(c) for c in n.args)) if n.args else set()


def _saved_names(nodes) -> tuple[str, ...]:
    """A name for each saved value: its gate where an activation reads one
    gate (the LSTM's i, f, g, o), r_<gate> for a recurrent product saved as
    it is, else the activation and its gates; unique."""
    names = []
    for k, n in enumerate(nodes):
        if n.op in ("x", "r"):
            name = f"{n.op}_{n.arg}"
        else:
            gates = sorted(_gates_read(n.args[0]))
            name = gates[0] if len(gates) == 1 else f"{n.op}_{'_'.join(gates) or k}"
        while name in names:
            name += "_"
        names.append(name)
    return tuple(names)


def define(name: str, gates, states, step, doc: str = "") -> Definition:
    """A cell from its step function step(x, r, s) -> {state: new value}.
    gates: names of the weight row blocks (in weight_ih's order), e.g.
    "ifgo" or ("i", "f", "g", "o"); states: names, h first. x.<gate> is
    W_ih x + b_ih's block, r.<gate> W_hh h + b_hh's, s.<state> the previous
    state. CellError, naming the cell, for a definition that cannot be
    compiled."""
    return Definition(name, gates, states, step, doc)
