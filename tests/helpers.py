"""What the tests share (fixtures are in conftest.py): the sizes most
kernels are built for, the one check of results against a reference
(assert_close), running a module and the float64 reference on the same
problem, the char LM's tiny corpus, and the command line's error checks.

Most tests use I=13, H=37 (layers above the first see input size 37), so
that the test run's kernel cache builds each (cell, input size, direction)
kernel of a schedule once: {lstm, gru} x {fwd, bwd} x {13, 37}.
"""
from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

import halstm
from halstm import cuda
from halstm import reference

I, H, T, B, L = 13, 37, 7, 3, 2
CLASSES = {"lstm": halstm.LSTM, "gru": halstm.GRU}
GATES = {"lstm": 4, "gru": 3}
STATES = {"lstm": ("h", "c"), "gru": ("h",)}
CUDA_TARGET = "host-cuda-cuda_capability_80"    # compiles here; runs on an A100, H100, H200
RTOL = 1e-4

needs_no_gpu = pytest.mark.skipif(cuda.available(), reason="a CUDA GPU is usable here")


# ---- closeness ----------------------------------------------------------------

def assert_close(name, got, want, rtol=RTOL, atol=1e-7, per_element=False):
    """Assert that `got` (numpy, a DeviceArray, a list) is close to `want`
    (the reference, usually float64), of the same shape.

    Allowed: |got - want| <= rtol * max|want| + atol in every entry, an
    error relative to the reference's largest magnitude (the measure
    halstm.benchmark.reference_errors gives), so that entries near zero
    are held to the accuracy of the large ones. per_element: numpy's rule,
    |got - want| <= atol + rtol * |want| entry by entry. NaN fails.

    The message names the array, says how many entries are off, where the
    worst one is, its values, the largest error absolute and relative to
    max|want|, and the tolerance."""
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        raise AssertionError(f"{name}: shape {got.shape}, expected {want.shape}")
    if want.size == 0:
        return
    g, w = got.astype(np.float64), want.astype(np.float64)
    err = np.abs(g - w)
    scale = float(np.nanmax(np.abs(w)))
    bound = atol + rtol * (np.abs(w) if per_element else scale)
    bad = ~(err <= bound)                          # NaN in either is bad
    if not bad.any():
        return
    with np.errstate(divide="ignore", invalid="ignore"):
        excess = np.where(np.isnan(err), np.inf, err / bound)
    where = np.unravel_index(int(np.argmax(np.where(bad, excess, -1.0))), err.shape)
    at = tuple(int(i) for i in where)
    finite_err = err[~np.isnan(err)]
    worst = float(finite_err.max()) if finite_err.size else float("nan")
    rule = (f"|got - want| <= {atol:g} + {rtol:g} * |want|" if per_element else
            f"|got - want| <= {rtol:g} * max|want| + {atol:g} = {rtol * scale + atol:.3g}")
    nans = int(np.isnan(g).sum())
    raise AssertionError(
        f"{name}: {int(bad.sum())} of {err.size} entries off"
        f"{f' ({nans} NaN)' if nans else ''}; worst at {at}: got {g[where]:.8g}, "
        f"want {w[where]:.8g}; largest error {worst:.3g} "
        f"({worst / scale if scale else float('inf'):.3g} of max|want| {scale:.3g}); "
        f"allowed {rule}")


# ---- modules against the reference --------------------------------------------

def assert_grads_close(got: dict, want: dict, rtol=RTOL):
    """The same gradient names, each close to want's."""
    assert got.keys() == want.keys()
    for k in want:
        assert_close(k, got[k], want[k], rtol=rtol)


def make(cell, num_layers=L, seed=0, **kw):
    """A module of the shared sizes."""
    return CLASSES[cell](I, H, num_layers=num_layers, seed=seed, **kw)


def record_wavefronts(monkeypatch) -> dict:
    """Record the chunk count of every halstm.wavefront.forward and
    backward call from here on: {"forward": [n, ...], "backward": [...]}."""
    from halstm import wavefront
    seen = {"forward": [], "backward": []}
    for name, at in (("forward", 3), ("backward", 2)):      # (n's place in the arguments)
        run = getattr(wavefront, name)
        monkeypatch.setattr(wavefront, name, lambda *a, run=run, name=name, at=at:
                            seen[name].append(a[at]) or run(*a))
    return seen


def call(module, cell, x, hx=None, **kw):
    """Run the module; returns (y, [final states]) in the module's layout."""
    if cell == "lstm":
        y, (h_n, c_n) = module(x, hx, **kw)
        return y, [h_n, c_n]
    y, h_n = module(x, hx, **kw)
    return y, [h_n]


def backward(module, cell, dy, dfinal=None):
    dfinal = dfinal or [None] * len(STATES[cell])
    return module.backward(dy, *dfinal)


def ref_run(cell, module, x, hx=None, dy=None, dfinal=None):
    """The float64 reference with the module's parameters: (y, [finals],
    grads), everything in (T, B, C) / (L, B, H) layout; hx and dfinal one
    array per state or None; grads None without dy."""
    params = {k: np.asarray(v).astype(np.float64) for k, v in module.state_dict().items()}
    x = np.asarray(x).astype(np.float64)
    if hx is not None:
        hx = [np.asarray(a).astype(np.float64) for a in hx]
        hx = tuple(hx) if cell == "lstm" else hx[0]
    if cell == "lstm":
        y, (h_n, c_n), cache = reference.forward(cell, params, x, hx)
        finals = [h_n, c_n]
    else:
        y, h_n, cache = reference.forward(cell, params, x, hx)
        finals = [h_n]
    if dy is None:
        return y, finals, None
    d = [None, None] if dfinal is None else [np.asarray(a).astype(np.float64)
                                             for a in dfinal] + [None]
    grads = reference.backward(cell, cache, np.asarray(dy).astype(np.float64), d[0],
                               d[1] if cell == "lstm" else None)
    return y, finals, grads


def grad_keys(module, cell):
    return set(module.state_dict()) | {f"{s}0" for s in STATES[cell]} | {"input"}


CASES = {
    "base": dict(),
    "T1": dict(T=1),
    "B1": dict(B=1),
    "L1": dict(L=1),
    "L3": dict(L=3),
    "batch_first": dict(batch_first=True),
    "hx_and_dstate": dict(hx=True, dstate=True),
    "batch_first_hx_dstate": dict(batch_first=True, hx=True, dstate=True),
    "unbatched": dict(unbatched=True),
    "unbatched_hx_dstate": dict(unbatched=True, hx=True, dstate=True),
    "unbatched_batch_first": dict(unbatched=True, batch_first=True, hx=True, dstate=True),
    "no_bias": dict(bias=False, hx=True, dstate=True),
    "no_bias_L1": dict(bias=False, L=1),
    # enough work for the driver to run the steps on several threads
    # (schedule cpu: one per 2^15 multiply-adds of a step, up to the CPUs,
    # where the loop has 2^23 or more): batch rows in ranges of 4 or more
    # (the last range takes the rows left over)
    "split_rows": dict(T=80, B=27, hx=True, dstate=True),
    "split_rows_12": dict(T=130, B=12, hx=True, dstate=True),
    # one thread's step of 20 rows: with AVX2's gate groups (schedules/cpu.py
    # panel_layout) tiles of 6 rows, the last shifted inwards
    "wide_rows": dict(T=5, B=20, hx=True, dstate=True),
}


def check_case(cell, case, target="host", schedule=None, put=lambda a: a, rtol=RTOL, **kw):
    """One CASES entry, forward and backward, against the reference.
    put: how the caller's arrays are handed to the module (tests/gpu passes
    device arrays through it); kw: more module arguments (precision, gemm).
    Returns the module."""
    c = dict(T=T, B=B, L=L, batch_first=False, unbatched=False, hx=False, dstate=False,
             bias=True) | CASES[case]
    Tc, Bc, Lc, bf, unb = c["T"], (1 if c["unbatched"] else c["B"]), c["L"], c["batch_first"], c["unbatched"]
    rng = np.random.default_rng(list(CASES).index(case))
    m = make(cell, Lc, bias=c["bias"], batch_first=bf, seed=7, target=target, schedule=schedule,
             **kw)
    ns = len(STATES[cell])

    # Problem in the reference's (T, B, C) / (L, B, H) layout...
    x = rng.standard_normal((Tc, Bc, I)).astype(np.float32)
    hx = [0.5 * rng.standard_normal((Lc, Bc, H)).astype(np.float32) for _ in range(ns)] if c["hx"] else None
    dy = rng.standard_normal((Tc, Bc, H)).astype(np.float32)
    dfinal = [rng.standard_normal((Lc, Bc, H)).astype(np.float32) for _ in range(ns)] if c["dstate"] else None

    # ... and in the module's layout.
    def seq_in(a):
        if unb:
            return put(np.ascontiguousarray(a[:, 0]))
        return put(np.ascontiguousarray(a.transpose(1, 0, 2)) if bf else a)

    def seq_out(a):
        if unb:
            return a[:, None]
        return a.transpose(1, 0, 2) if bf else a

    st_in = (lambda a: put(np.ascontiguousarray(a[:, 0]))) if unb else put
    st_out = (lambda a: a[:, None]) if unb else (lambda a: a)

    m_hx = None
    if hx is not None:
        m_hx = tuple(map(st_in, hx)) if cell == "lstm" else st_in(hx[0])
    y, finals = call(m, cell, seq_in(x), m_hx)
    m_dfinal = [st_in(a) for a in dfinal] if dfinal is not None else None
    grads = backward(m, cell, seq_in(dy), m_dfinal)

    y, finals = np.asarray(y), [np.asarray(f) for f in finals]
    grads = {k: np.asarray(g) for k, g in grads.items()}
    # Shapes as the caller sees them.
    y_shape = (Tc, H) if unb else ((Bc, Tc, H) if bf else (Tc, Bc, H))
    st_shape = (Lc, H) if unb else (Lc, Bc, H)
    assert y.shape == y_shape and y.dtype == np.float32
    assert all(f.shape == st_shape and f.dtype == np.float32 for f in finals)

    ry, rfinals, rgrads = ref_run(cell, m, x, hx, dy, dfinal)
    assert_close("y", seq_out(y), ry, rtol)
    for s, f, rf in zip(STATES[cell], finals, rfinals):
        assert_close(f"{s}_n", st_out(f), rf, rtol)

    # Every gradient key: all state_dict keys + input, h0 (+ c0), nothing else.
    assert set(grads) == grad_keys(m, cell) == set(rgrads)
    if not c["bias"]:
        assert not any(k.startswith("bias") for k in list(m.state_dict()) + list(grads))
    sd = m.state_dict()
    for k, g in grads.items():
        assert g.dtype == np.float32, k
        if k in sd:
            assert g.shape == sd[k].shape, k
            assert_close(k, g, rgrads[k], rtol)
        elif k == "input":
            assert g.shape == np.asarray(seq_in(x)).shape, k
            assert_close(k, seq_out(g), rgrads[k], rtol)
        else:
            assert g.shape == st_shape, k
            assert_close(k, st_out(g), rgrads[k], rtol)
    return m


def check_no_grad(cell, target="host"):
    """Under halstm.no_grad() the steps store only the states (their own
    kernel, step_infer; on a GPU, where W_hh is small, every step in one
    kernel, loop_infer): the results equal a training forward's to float
    rounding (the compiler contracts the cell's math differently when the
    gates are not stored), with an initial state and B=1 too, and backward
    then raises."""
    rng = np.random.default_rng(11)
    m = make(cell, target=target)
    same = dict(rtol=1e-5, atol=1e-6, per_element=True)
    for batch in (B, 1):
        x = rng.standard_normal((T, batch, I)).astype(np.float32)
        hx = [rng.standard_normal((L, batch, H)).astype(np.float32) for _ in STATES[cell]]
        hx = tuple(hx) if cell == "lstm" else hx[0]
        want = call(m, cell, x, hx)
        assert halstm.is_grad_enabled()
        with halstm.no_grad():
            assert not halstm.is_grad_enabled()
            got = call(m, cell, x, hx)
        assert halstm.is_grad_enabled()
        assert_close("y", got[0], want[0], **same)
        for s, g, w in zip(STATES[cell], got[1], want[1]):
            assert_close(f"{s}_n", g, w, **same)
    with pytest.raises(RuntimeError, match=r"no_grad\(\)"):
        backward(m, cell, np.ones((T, 1, H), np.float32))
    call(m, cell, x, hx)                      # a training forward makes backward work again
    backward(m, cell, np.ones((T, 1, H), np.float32))
    # One layer and no initial state: the library zeroes the states' first
    # row itself, and under no_grad the final states are the module's own
    # last rows (views, no copy); twice, so a second call cannot change the
    # first call's results.
    # The caller's float32 input is read in place there, never written; on
    # a CPU y is a view of the module's states and the finals are copies.
    m1 = make(cell, num_layers=1, target=target)
    x2 = rng.standard_normal((T + 2, B, I)).astype(np.float32)
    given = [x.copy(), x2.copy()]
    want = [call(m1, cell, xi) for xi in (x, x2)]
    with halstm.no_grad():
        got = [call(m1, cell, xi) for xi in (x, x2)]
    for xi, gi in zip((x, x2), given):
        np.testing.assert_array_equal(xi, gi)
    for (gy, gf), (wy, wf) in zip(got, want):
        assert_close("y", gy, wy, **same)
        np.testing.assert_array_equal(np.asarray(gf[0][0]), np.asarray(gy[-1]))  # h_n = y[-1]
        for s, g, w in zip(STATES[cell], gf, wf):
            assert_close(f"{s}_n", g, w, **same)
    if target == "host":
        h_n = got[0][1][0].copy()
        got[0][0][:] = 7.0
        np.testing.assert_array_equal(got[0][1][0], h_n)


# ---- the char LM's tiny corpus ---------------------------------------------------

ALPHABET = "abcdefghijklmn \n"            # 16 symbols
WORDS = ["bad", "cab", "fig", "hen", "jam", "kind", "lime", "mile", "can", "dig",
         "aged", "glen", "hale", "mink", "jib", "fen"]
# 16 symbols and 16 hidden units: every layer has K = H = 16, one library
# per cell and direction for every model of this size
TINY = dict(hidden_size=16, layers=2, seq_len=8, batch_size=4, eval_batch_size=8)


def make_text(n_chars: int, seed: int = 0) -> str:
    """Deterministic text over ALPHABET (every symbol present): words and lines."""
    rng = np.random.default_rng(seed)
    out = ["abcdefghijklmn \n"]
    size = len(out[0])
    while size < n_chars:
        line = " ".join(rng.choice(WORDS, size=rng.integers(2, 6))) + "\n"
        out.append(line)
        size += len(line)
    text = "".join(out)[:n_chars]
    assert set(text) == set(ALPHABET)
    return text


def make_corpus(config, n_chars: int = 4000):
    from halstm.model import Corpus
    return Corpus.from_text(make_text(n_chars), "test", config.seq_len, config.batch_size)


# ---- the command line ------------------------------------------------------------

def run_cli(*args, ok=True):
    """`halstm ARGS` in this process; ok: assert that it succeeded. An
    exception other than click's exit propagates, with its traceback."""
    from halstm.cli import main
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    if ok:
        assert result.exit_code == 0, result.output
    return result


def assert_cli_error(result, *needles, code=2, alone=False):
    """Exit code `code` (None: any but 0), exactly one 'Error:' line naming
    every needle, no traceback; alone: nothing else printed. Returns the line."""
    if code is None:
        assert result.exit_code != 0, result.output
    else:
        assert result.exit_code == code, result.output
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("Error:")]
    assert len(errors) == 1, result.output
    if alone:
        assert lines == errors, result.output
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])
    return errors[0]


def check_lengths_against_alone(m, x, lengths, hx, dy, dfinal, rtol=RTOL):
    """m (any cell, numpy API) on a batch with lengths against m on each
    sequence alone, padded path: outputs (zero past each length), final
    states and gradients (the weights' summed over the sequences). x (T, B,
    ...) floats or class indices; hx, dfinal one (L, B, H) array per state."""
    names = m._state_names

    def run(x, hx, dy, dfinal, **kw):
        y, finals = m(x, hx[0] if len(names) == 1 else tuple(hx), **kw)
        finals = [finals] if len(names) == 1 else list(finals)
        return y, finals, m.backward(dy, *dfinal)

    y, finals, grads = run(x, hx, dy, dfinal, lengths=lengths)
    want = {}
    for b, n in enumerate(lengths):
        one = lambda a: np.ascontiguousarray(a[:, b:b + 1])   # noqa: E731
        ry, rfinals, rg = run(one(x[:n]), [one(a) for a in hx], one(dy[:n]),
                              [one(a) for a in dfinal])
        assert_close(f"y of sequence {b}", y[:n, b:b + 1], ry, rtol)
        assert not y[n:, b].any(), f"outputs past length {n} of sequence {b}"
        for s, f, rf in zip(names, finals, rfinals):
            assert_close(f"{s}_n of sequence {b}", f[:, b:b + 1], rf, rtol)
            assert_close(f"d {s}0 of sequence {b}", grads[f"{s}0"][:, b:b + 1], rg[f"{s}0"],
                         rtol)
        if "input" in grads:
            assert_close(f"d input of sequence {b}", grads["input"][:n, b:b + 1],
                         rg["input"], rtol)
            assert not grads["input"][n:, b].any()
        for k in m.state_dict():
            want[k] = want.get(k, 0) + rg[k]
    for k, v in want.items():
        assert_close(f"d {k}", grads[k], v, rtol)


def weighted_loss(y, finals):
    """A torch module's call (y a tensor or PackedSequence, finals a tensor
    or a tuple) as one scalar that weighs every output differently
    (linspace -1..1) plus the finals' squares: a gradient that tells the
    outputs apart."""
    import torch
    y = y.data if isinstance(y, torch.nn.utils.rnn.PackedSequence) else y
    finals = finals if isinstance(finals, tuple) else (finals,)
    w = torch.linspace(-1, 1, y.numel(), device=y.device).reshape(y.shape)
    return (y * w).sum() + sum((f * f).sum() for f in finals)


def host_has_bf16() -> bool:
    """Whether this CPU runs precision "bf16" (AMX or AVX512-BF16)."""
    from halstm import bf16
    return bf16.host_products() is not None


needs_bf16 = pytest.mark.skipif(not host_has_bf16(),
                                reason="this CPU has neither AMX nor AVX512-BF16")


HEAD_FAULTS = ("b", "w", "y", "y_inf", "w_inf")    # which input holds NaN or Inf


def head_fault_case(N, H, V, where):
    """The char LM head's inputs y (N, H), w (V, H), b (V,), targets (N,)
    with one NaN or Inf (HEAD_FAULTS); no target is class 3, which a NaN
    bias holds."""
    rng = np.random.default_rng(N + V)
    y = rng.standard_normal((N, H)).astype(np.float32)
    w = rng.standard_normal((V, H)).astype(np.float32)
    b = rng.standard_normal(V).astype(np.float32)
    t = rng.integers(0, V - 1, N)
    t[t == 3] = V - 1
    array, at, value = {"b": (b, 3, np.nan), "w": (w, (3, 1), np.nan),
                        "y": (y, (N - 2, 1), np.nan), "y_inf": (y, (N // 2, H - 1), -np.inf),
                        "w_inf": (w, (V - 1, 0), np.inf)}[where]
    array[at] = value
    return y, w, b, t


def check_head_faults(where, got, y, w, b, t):
    """got (loss, dw, db, dy) of the head at scale 1/N: a NaN input makes the
    same elements non-finite as numpy's head, an Inf input at least those
    (numpy's softmax takes a -Inf logit as 0; the pipeline makes the row NaN)."""
    from halstm.model.charlm import _log_softmax_nll
    with np.errstate(invalid="ignore", over="ignore"):
        dlogits = y @ w.T + b
        nll = _log_softmax_nll(dlogits, t, grad=1.0 / len(y))
        want = dict(loss=nll, dw=dlogits.T @ y, db=dlogits.sum(0), dy=dlogits @ w)
    for name, out in zip(want, got):
        finite, want_finite = np.isfinite(np.asarray(out)), np.isfinite(want[name])
        assert not want_finite.all(), name            # the input reaches every output
        if where.endswith("_inf"):
            assert not finite[~want_finite].any(), name
        else:
            np.testing.assert_array_equal(finite, want_finite, err_msg=name)


# A user's cell file (tests/test_cells.py, test_tune.py): a minimal GRU
USER_CELL = '''
from halstm.cells import define, sigmoid, tanh


def step(x, r, s):
    """Minimal GRU: one update gate."""
    z = sigmoid(x.z + r.z)
    return {"h": (1 - z) * tanh(x.n + r.n) + z * s.h}


MINIMAL_GRU = define("minimal_gru", gates="zn", states="h", step=step)
'''
