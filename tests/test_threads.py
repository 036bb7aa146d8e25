"""Calls from several threads at once: one module (each thread's backward
follows its own forward) and one loaded library (its workspaces are shared
between calls, and ctypes releases the GIL while it runs) give exactly the
results of the same calls made one after another."""
import ctypes.util
import importlib
import os
import threading
import time

import numpy as np
import pytest

import halstm
from halstm import openmp, runtime
from helpers import B, H, I, STATES, T, backward, call, make

THREADS, ROUNDS = 4, 6


def _inputs(n, seed):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((T + i % 3, B, I)).astype(np.float32),
             rng.standard_normal((T + i % 3, B, 37)).astype(np.float32)) for i in range(n)]


def _run_threads(work, n):
    """work(i) on n threads started together; the first exception re-raised."""
    errors, start = [], threading.Barrier(n)

    def run(i):
        try:
            start.wait()
            work(i)
        except BaseException as e:      # noqa: BLE001 - re-raised in the caller
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_one_module_from_several_threads(cell):
    m = make(cell)
    problems = _inputs(THREADS * ROUNDS, seed=7)

    def one(x, dy):
        y, finals = call(m, cell, x)
        return y, finals, backward(m, cell, dy)

    want = [one(x, dy) for x, dy in problems]           # one after another
    got = [None] * len(problems)

    def work(i):
        for r in range(ROUNDS):
            k = r * THREADS + i
            got[k] = one(*problems[k])

    _run_threads(work, THREADS)
    for k, ((y, finals, grads), (wy, wfinals, wgrads)) in enumerate(zip(got, want)):
        assert np.array_equal(y, wy), f"problem {k}: y differs"
        for s, a, b in zip(STATES[cell], finals, wfinals):
            assert np.array_equal(a, b), f"problem {k}: {s}_n differs"
        for name in wgrads:
            assert np.array_equal(grads[name], wgrads[name]), f"problem {k}: {name} differs"


def test_backward_follows_the_threads_own_forward():
    """A forward in another thread between this thread's forward and
    backward does not change what this backward differentiates."""
    m = make("lstm")
    (x1, dy1), (x2, _) = _inputs(2, seed=3)[0], _inputs(2, seed=4)[1]
    call(m, "lstm", x1)
    want = backward(m, "lstm", dy1)
    call(m, "lstm", x1)
    other = threading.Thread(target=lambda: call(m, "lstm", x2))
    other.start()
    other.join()
    got = backward(m, "lstm", dy1)
    for name in want:
        assert np.array_equal(got[name], want[name]), name


def test_backward_in_a_thread_without_a_forward_raises():
    m = make("gru")
    call(m, "gru", _inputs(1, seed=5)[0][0])
    err = []
    t = threading.Thread(target=lambda: err.append(_raises(lambda: backward(m, "gru", None))))
    t.start()
    t.join()
    assert err and isinstance(err[0], RuntimeError) and "forward first" in str(err[0])


def _raises(f):
    try:
        f()
    except Exception as e:   # noqa: BLE001 - the test inspects it
        return e
    return None


def test_one_library_from_several_threads():
    """runtime.Library itself, the object halstm.load and the modules share."""
    m = make("lstm", num_layers=1)
    lib = m._lib(0, "fwd")
    w = m.state_dict()
    problems = _inputs(THREADS * ROUNDS, seed=11)
    args = (w["weight_ih_l0"], w["bias_ih_l0"], w["weight_hh_l0"], w["bias_hh_l0"])

    def one(x):
        states, saved = lib.forward(x, *args, [None, None])
        return states, saved

    want = [one(x) for x, _ in problems]
    got = [None] * len(problems)

    def work(i):
        for r in range(ROUNDS):
            k = r * THREADS + i
            got[k] = one(problems[k][0])

    _run_threads(work, THREADS)
    for k, ((states, saved), (wstates, wsaved)) in enumerate(zip(got, want)):
        assert all(np.array_equal(a, b) for a, b in zip(states, wstates)), k
        assert np.array_equal(saved, wsaved), k


def test_a_pack_key_reuses_the_packed_weights():
    """Library.forward / backward with pack_key: an equal key skips packing
    (the panels of the weights the key was given with are used), another
    key packs again."""
    m = make("lstm", num_layers=1)
    w = m.state_dict()
    w_ih, b_ih, w_hh, b_hh = (w[k + "_l0"].copy() for k in ("weight_ih", "bias_ih",
                                                             "weight_hh", "bias_hh"))
    x = np.random.default_rng(3).standard_normal((4, 2, I)).astype(np.float32)
    dy = np.random.default_rng(4).standard_normal((4, 2, H)).astype(np.float32)
    fwd, bwd = m._lib(0, "fwd"), m._lib(0, "bwd")

    def run(key, scale=1.0):
        a, b = w_ih * scale, w_hh * scale
        states, saved = fwd.forward(x, a, b_ih, b, b_hh, [None, None], pack_key=key)
        g = bwd.backward(x, a, b, saved, states, dy, [None, None], pack_key=key)
        return states, g["dx"]

    base, doubled = run(None), run(None, 2.0)
    assert not np.allclose(base[0], doubled[0])
    run(("k", 1))
    # the same key with other weights: the panels of the first call's
    reused = run(("k", 1), 2.0)
    for a, b in zip(reused, base):
        assert np.array_equal(a, b)
    for a, b in zip(run(("k", 2), 2.0), doubled):
        assert np.array_equal(a, b)


@pytest.fixture
def openmp_team():
    """The functions of an OpenMP runtime loaded in this process (torch's
    where torch is installed, else the system's libgomp); CPU libraries run
    as before afterwards."""
    try:
        importlib.import_module("torch")   # (loads its OpenMP runtime)
    except ImportError:
        name = ctypes.util.find_library("gomp")
        if name is None:
            pytest.skip("no OpenMP runtime to share")
        ctypes.CDLL(name)
    functions = openmp.loaded()
    assert functions is not None and all(functions)
    before = runtime._openmp
    yield functions
    runtime.share_openmp(before)


@pytest.mark.parametrize("hidden, batch, T", [(37, 27, 80), (300, 12, 30)])
def test_steps_on_a_shared_openmp_team(hidden, batch, T, openmp_team, monkeypatch):
    """Steps split over three threads of a shared OpenMP team (ranges of
    rows at H=37; at H=300 ranges of units, meeting after every step) give
    bitwise the results of the driver's own threads."""
    monkeypatch.setenv("HL_NUM_THREADS", "3")
    m = halstm.LSTM(I, hidden, seed=3)
    rng = np.random.default_rng(11)
    x = rng.standard_normal((T, batch, I)).astype(np.float32)
    dy = rng.standard_normal((T, batch, hidden)).astype(np.float32)
    runs = []
    for team in (None, openmp_team):
        runtime.share_openmp(team)
        y, finals = call(m, "lstm", x)
        grads = backward(m, "lstm", dy)
        libs = list(m._libs.values())
        assert [lib.step_threads() for lib in libs] == [3, 3]
        assert [lib.steps_shared() for lib in libs] == [team is not None] * 2
        runs.append((y, finals, grads))
    (y, finals, grads), (y2, finals2, grads2) = runs
    assert np.array_equal(y, y2)
    assert all(np.array_equal(a, b) for a, b in zip(finals, finals2))
    for name in grads:
        assert np.array_equal(grads[name], grads2[name]), name


def _layer_on_the_team(team, monkeypatch, seed):
    """An LSTM layer (H=37) whose steps split over three threads, called
    once on the shared team: (module, x, y, its library)."""
    monkeypatch.setenv("HL_NUM_THREADS", "3")
    m = halstm.LSTM(I, 37, seed=3)
    x = np.random.default_rng(seed).standard_normal((80, 27, I)).astype(np.float32)
    runtime.share_openmp(team)
    y, _ = call(m, "lstm", x)
    (lib,) = m._libs.values()
    assert lib.step_threads() == 3 and lib.steps_shared()
    return m, x, y, lib


def test_calls_with_their_own_cores_keep_their_own_threads(openmp_team, monkeypatch):
    """A call given its share of the cores (threads=: a bidirectional
    layer's two directions at once) runs on the driver's own threads."""
    m, x, y, lib = _layer_on_the_team(openmp_team, monkeypatch, seed=12)
    sd = m.state_dict()
    states, _ = lib.forward(x, *(sd[k] for k in ("weight_ih_l0", "bias_ih_l0", "weight_hh_l0",
                                                  "bias_hh_l0")), [None, None], save=False,
                                threads=3)
    assert lib.step_threads() == 3 and not lib.steps_shared()
    assert np.array_equal(states[0, 1:], y)


def test_short_calls_split_their_steps_on_a_shared_openmp_team(openmp_team, monkeypatch):
    """A time loop of too few multiply-adds to start threads for
    (cpu.SPLIT_CALL_MACS: one step of 4.3 M) runs its steps on one thread
    of its own, and over three on a shared OpenMP team, whose threads are
    started, with the same results."""
    monkeypatch.setenv("HL_NUM_THREADS", "3")
    m = halstm.LSTM(I, 300, seed=3)
    x = np.random.default_rng(13).standard_normal((1, 12, I)).astype(np.float32)
    runs = []
    for team, threads in ((None, 1), (openmp_team, 3)):
        runtime.share_openmp(team)
        y, finals = call(m, "lstm", x)
        (lib,) = m._libs.values()
        assert lib.step_threads() == threads and lib.steps_shared() == (team is not None)
        runs.append((y, *finals))
    for a, b in zip(*runs):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_directions_in_turn_on_a_shared_openmp_team(openmp_team, monkeypatch):
    """Where the kernels share an OpenMP team, a bidirectional layer whose
    steps want half the cores or fewer runs its directions one after the
    other on that team (at once they would run on threads of their own:
    test_modules' test_bidirectional_directions_run_at_once), with the
    same results."""
    monkeypatch.setenv("HL_NUM_THREADS", "4")
    rng = np.random.default_rng(6)
    x = rng.standard_normal((T, B, I)).astype(np.float32)
    dy = rng.standard_normal((T, B, 2 * H)).astype(np.float32)
    runs = []
    for team in (None, openmp_team):
        runtime.share_openmp(team)
        m = make("gru", bidirectional=True)
        for _ in range(2):
            y, h_n = m(x)
            grads = m.backward(dy)
        runs.append((y, h_n, grads, {k[2] for k in m._libs}))
    (y0, h0, g0, lanes0), (y1, h1, g1, lanes1) = runs
    assert lanes0 == {0, 1} and lanes1 == {0}
    np.testing.assert_array_equal(y1, y0)
    np.testing.assert_array_equal(h1, h0)
    for k in g0:
        np.testing.assert_array_equal(g1[k], g0[k], err_msg=k)


def test_a_forked_child_runs_on_its_own_threads(openmp_team, monkeypatch):
    """A fork's child (a DataLoader's worker, say) of a process whose
    kernels ran on the shared team runs its steps on the driver's own
    threads: libgomp's team in a child waits for its parent's threads
    forever (the child hung before)."""
    m, x, y, lib = _layer_on_the_team(openmp_team, monkeypatch, seed=13)
    pid = os.fork()
    if pid == 0:   # the child: exit code 0 if right
        code = 1
        try:
            y2, _ = call(m, "lstm", x)
            code = 0 if np.array_equal(y, y2) and lib.step_threads() == 3 \
                and not lib.steps_shared() else 2
        finally:
            os._exit(code)
    for _ in range(600):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.1)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung")
    assert os.waitstatus_to_exitcode(status) == 0
