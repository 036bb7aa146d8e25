"""Ahead-of-time compilation and the on-disk kernel cache (halstm.aot), and the
runtime's numpy <-> Halide axis convention (halstm.runtime).

Real compiles cost seconds each, so most tests reuse the test run's cached
I=13, H=37 kernels (the shared sizes of helpers.py); only the tests that must
build into a cache of their own (a concurrent build, a rebuild of a corrupt
entry) compile, one kernel each.
"""
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import halstm
from halstm import aot, cache
from halstm import reference as ref
from halstm.runtime import Library
from helpers import H, I, assert_close

SPEC = aot.Spec("gru", I, H, "fwd")            # the kernel most tests here use


# ---- helpers ----------------------------------------------------------------

def entries(root: Path) -> list[Path]:
    """Cache entry folders (not lock files, not temporary build folders)."""
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))


def leftovers(root: Path, keys=None) -> list[str]:
    """Anything a build may have left behind: temporary folders or files;
    with `keys`, only those of these cache entries (a shared cache may hold
    other test workers' builds in progress)."""
    return sorted(p.name for p in root.iterdir()
                  if (p.name.startswith(".tmp") or p.name.endswith(".tmp"))
                  and (keys is None or any(k in p.name for k in keys)))


def gru_layer_reference(lib: Library, T=5, B=3, seed=0):
    """Run one GRU layer through `lib` and through the reference; returns
    (got states[0], want y)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, B, I)).astype(np.float32)
    w_ih = rng.uniform(-0.3, 0.3, (3 * H, I)).astype(np.float32)
    w_hh = rng.uniform(-0.3, 0.3, (3 * H, H)).astype(np.float32)
    b_ih = rng.uniform(-0.3, 0.3, 3 * H).astype(np.float32)
    b_hh = rng.uniform(-0.3, 0.3, 3 * H).astype(np.float32)
    h0 = rng.standard_normal((B, H)).astype(np.float32)
    states, _ = lib.forward(x, w_ih, b_ih, w_hh, b_hh, [h0])
    d = lambda a: a.astype(np.float64)
    y, _, _ = ref.gru_layer_forward(d(x), d(h0), d(w_ih), d(w_hh), d(b_ih), d(b_hh))
    return states[0], y


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    """An empty cache of this test's own, as HALSTM_CACHE."""
    root = tmp_path / "cache"
    monkeypatch.setenv("HALSTM_CACHE", str(root))
    return root


@pytest.fixture
def pristine(kernel_cache, tmp_path, monkeypatch):
    """A copy (new files, never loaded by this process) of SPEC's intact
    entry from the test run's cache, outside any cache."""
    with monkeypatch.context() as mp:           # whatever own_cache set up
        mp.setenv("HALSTM_CACHE", kernel_cache)
        path, manifest = aot.library(SPEC)      # the run's cache: built at most once
    assert path.parent == Path(kernel_cache) / aot.cache_key(SPEC)
    copy = tmp_path / "pristine"
    shutil.copytree(path.parent, copy)
    return copy


# ---- (a) a fresh process loads a cached kernel without compiling --------------

CHILD = textwrap.dedent("""
    import json, sys, time
    t0 = time.perf_counter()
    import numpy as np
    import halstm
    from halstm import aot
    x = np.load(sys.argv[1])
    m = halstm.GRU(13, 37, num_layers=2, seed=0)
    y, h_n = m(x)
    g = m.backward(np.ones_like(y))
    seconds = time.perf_counter() - t0
    np.savez(sys.argv[2], y=y, h_n=h_n, **g)
    print(json.dumps({"halide_imported": "halide" in sys.modules, "seconds": seconds,
                      "key": aot.cache_key(aot.Spec("gru", 13, 37, "fwd"))}))
""")


def test_fresh_process_loads_cached_kernel_without_compiling(kernel_cache, tmp_path):
    m = halstm.GRU(I, H, num_layers=2, seed=0).compile()      # every kernel it needs, cached
    root = Path(kernel_cache)
    before = {p.name: (p / aot.MANIFEST).stat().st_mtime_ns for p in entries(root)}

    x = np.random.default_rng(0).standard_normal((7, 3, I)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = dict(os.environ, HALSTM_CACHE=str(root))
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, str(script), str(tmp_path / "x.npy"),
                          str(tmp_path / "out.npz")], env=env, capture_output=True, text=True,
                         timeout=120)
    wall = time.perf_counter() - t0
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout.strip().splitlines()[-1])

    assert report["halide_imported"] is False          # halide is only imported to build
    assert report["seconds"] < 3.0, report             # a compile alone takes ~3 s per kernel
    assert wall < 15.0
    assert report["key"] == aot.cache_key(SPEC)        # keys are stable across processes
    # Nothing rewritten; the child built nothing (it never imported halide).
    # Other test workers may add entries to the shared cache meanwhile.
    after = {p.name: (p / aot.MANIFEST).stat().st_mtime_ns for p in entries(root)}
    assert {k: after.get(k) for k in before} == before
    assert not leftovers(root, keys=before)

    # Same results as this process, bit for bit.
    y, h_n = m(x)
    g = m.backward(np.ones_like(y))
    out = np.load(tmp_path / "out.npz")
    np.testing.assert_array_equal(out["y"], y)
    np.testing.assert_array_equal(out["h_n"], h_n)
    for k, v in g.items():
        np.testing.assert_array_equal(out[k], v, err_msg=k)


# ---- (b) corrupt entries are detected and rebuilt ------------------------------

def _corrupt(entry: Path, how: str):
    lib, man = entry / aot.LIBRARY, entry / aot.MANIFEST
    if how == "truncate":
        data = lib.read_bytes()
        lib.write_bytes(data[: len(data) // 2])
    elif how == "overwrite":                 # same size, same name: only the checksum tells
        with open(lib, "r+b") as f:
            f.seek(lib.stat().st_size // 2)
            f.write(b"\xde\xad\xbe\xef" * 16)
    elif how == "empty_library":
        lib.write_bytes(b"")
    elif how == "no_library":
        lib.unlink()
    elif how == "no_manifest":
        man.unlink()
    elif how == "bad_json":
        man.write_text(man.read_text()[:40])
    elif how == "wrong_format":
        m = json.loads(man.read_text())
        m["format"] = aot.FORMAT + 1
        man.write_text(json.dumps(m))
    elif how == "wrong_checksum":
        m = json.loads(man.read_text())
        m["sha256"] = "0" * 64
        man.write_text(json.dumps(m))
    else:  # pragma: no cover
        raise AssertionError(how)


CORRUPTIONS = ["truncate", "overwrite", "empty_library", "no_library", "no_manifest",
               "bad_json", "wrong_format", "wrong_checksum"]


def test_intact_entry_is_reused(own_cache, pristine, monkeypatch):
    own_cache.mkdir()
    shutil.copytree(pristine, own_cache / aot.cache_key(SPEC))
    assert aot.read_entry(own_cache / aot.cache_key(SPEC)) is not None

    def no_build(spec, out):
        raise AssertionError("an intact entry was rebuilt")
    monkeypatch.setattr(aot, "build", no_build)
    path, manifest = aot.library(SPEC)
    assert path == own_cache / aot.cache_key(SPEC) / aot.LIBRARY
    assert manifest == json.loads((pristine / aot.MANIFEST).read_text())


@pytest.mark.parametrize("how", CORRUPTIONS)
def test_corrupt_entry_is_detected_and_replaced(own_cache, pristine, monkeypatch, how):
    """library() rebuilds a corrupt entry and swaps it in. The build itself is
    replaced by a copy of an intact entry here (a real rebuild: below)."""
    own_cache.mkdir()
    entry = own_cache / aot.cache_key(SPEC)
    shutil.copytree(pristine, entry)
    _corrupt(entry, how)
    assert aot.read_entry(entry) is None

    calls = []

    def fake_build(spec, out, emit=(), require_loadable=False):
        calls.append((spec, out))
        assert out.parent == own_cache and out.name.startswith(".tmp-")
        for f in pristine.iterdir():
            shutil.copy(f, out / f.name)
        return json.loads((out / aot.MANIFEST).read_text())
    monkeypatch.setattr(aot, "build", fake_build)

    path, manifest = aot.library(SPEC)
    assert len(calls) == 1 and calls[0][0] == SPEC
    assert path == entry / aot.LIBRARY
    assert aot.read_entry(entry) == manifest
    assert sorted(p.name for p in entry.iterdir()) == sorted(p.name for p in pristine.iterdir())
    assert entries(own_cache) == [entry] and not leftovers(own_cache)
    aot.library(SPEC)                       # and now it is reused
    assert len(calls) == 1


def test_corrupt_entry_real_rebuild_gives_correct_results(own_cache, pristine):
    own_cache.mkdir()
    entry = own_cache / aot.cache_key(SPEC)
    shutil.copytree(pristine, entry)
    _corrupt(entry, "overwrite")
    corrupt_sha = hashlib.sha256((entry / aot.LIBRARY).read_bytes()).hexdigest()

    path, manifest = aot.library(SPEC)                    # compiles
    assert path == entry / aot.LIBRARY
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    assert sha == manifest["sha256"] != corrupt_sha
    assert aot.read_entry(entry) == manifest
    assert entries(own_cache) == [entry] and not leftovers(own_cache)

    # This path was never loaded by this process, so this runs the rebuilt code.
    got, want = gru_layer_reference(Library(path, manifest))
    assert_close("h", got[1:], want)


# ---- (c) concurrent builders ----------------------------------------------------

BUILDER = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    from halstm import aot
    ready, go = Path(sys.argv[1]), Path(sys.argv[2])
    ready.touch()
    while not go.exists():
        time.sleep(0.005)
    path, manifest = aot.library(aot.Spec("gru", 13, 37, "fwd"))
    print(json.dumps({"path": str(path), "sha256": manifest["sha256"],
                      "built": "halide" in sys.modules}))
""")


def test_concurrent_builds_of_one_key(own_cache, tmp_path):
    script = tmp_path / "builder.py"
    script.write_text(BUILDER)
    go = tmp_path / "go"
    env = dict(os.environ, HALSTM_CACHE=str(own_cache))
    procs, readies = [], []
    for n in range(2):
        ready = tmp_path / f"ready{n}"
        readies.append(ready)
        procs.append(subprocess.Popen([sys.executable, str(script), str(ready), str(go)],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    deadline = time.monotonic() + 60
    while not all(r.exists() for r in readies):
        assert time.monotonic() < deadline, "builders did not start"
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        time.sleep(0.01)
    go.touch()                                   # both start library() together
    outs = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stderr
        outs.append(json.loads(stdout.strip().splitlines()[-1]))

    entry = own_cache / aot.cache_key(SPEC)
    assert [o["path"] for o in outs] == [str(entry / aot.LIBRARY)] * 2
    assert outs[0]["sha256"] == outs[1]["sha256"]
    assert sum(o["built"] for o in outs) == 1    # one built, the other waited and reused
    assert entries(own_cache) == [entry]
    assert not leftovers(own_cache), leftovers(own_cache)
    manifest = aot.read_entry(entry)
    assert manifest is not None and manifest["sha256"] == outs[0]["sha256"]


# ---- (d) failed builds ---------------------------------------------------------

def _assert_nothing_left(root: Path):
    """No entry and no temporary folder; only lock files may remain."""
    if root.exists():
        assert entries(root) == [] and not leftovers(root)
        assert all(p.name.endswith(".lock") for p in root.iterdir()), list(root.iterdir())


def _names_spec(msg: str, cell: str, target: str, schedule: str):
    assert cell in msg and target in msg and schedule in msg, msg


def test_failed_halide_compile_raises_compile_error_and_leaves_nothing(own_cache, monkeypatch):
    pipeline = pytest.importorskip("halstm.pipeline")
    tmp_seen = []

    def boom(*args, **kwargs):
        tmp_seen.extend(p for p in own_cache.iterdir() if p.name.startswith(".tmp-"))
        raise RuntimeError("injected pipeline failure")
    monkeypatch.setattr(pipeline, "build", boom)
    spec = aot.Spec("lstm", I, H, "bwd", "host", "naive")
    with pytest.raises(halstm.CompileError) as info:
        aot.library(spec)
    msg = str(info.value)
    _names_spec(msg, "lstm", "host", "naive")
    assert "injected pipeline failure" in msg
    assert tmp_seen, "the build should have run in a temporary folder"
    assert not any(p.exists() for p in tmp_seen)
    _assert_nothing_left(own_cache)


def test_interrupted_build_leaves_nothing(own_cache, monkeypatch):
    pipeline = pytest.importorskip("halstm.pipeline")

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(pipeline, "build", interrupt)
    with pytest.raises(KeyboardInterrupt):
        aot.library(SPEC)
    _assert_nothing_left(own_cache)


def test_unknown_schedule_is_rejected_before_any_build(own_cache):
    with pytest.raises(ValueError, match="schedule.*nosuchschedule"):
        aot.Spec("gru", I, H, "fwd", "host", "nosuchschedule")
    with pytest.raises(ValueError, match="schedule.*nosuchschedule"):
        halstm.LSTM(I, H, schedule="nosuchschedule")
    _assert_nothing_left(own_cache)


def test_schedule_that_does_not_fit_the_target_is_rejected():
    with pytest.raises(ValueError, match="schedule.*'cpu'.*gpu"):
        aot.Spec("gru", I, H, "fwd", "host-cuda", "cpu")


BAD_TARGET = "x86-64-linux-nosuchfeature"


def test_invalid_target_leaves_nothing(own_cache):
    with pytest.raises(Exception):
        aot.library(aot.Spec("gru", I, H, "fwd", BAD_TARGET))
    _assert_nothing_left(own_cache)


def test_invalid_target_raises_compile_error(own_cache):
    with pytest.raises(halstm.CompileError) as info:
        aot.library(aot.Spec("gru", I, H, "fwd", BAD_TARGET))
    _names_spec(str(info.value), "gru", BAD_TARGET, "cpu")     # the resolved default


@pytest.mark.parametrize("kw", [dict(cell="rnn"), dict(direction="sideways"),
                                dict(input_size=0), dict(hidden_size=2.0), dict(target="")])
def test_spec_validation(kw):
    args = dict(cell="gru", input_size=I, hidden_size=H, direction="fwd") | kw
    with pytest.raises(ValueError, match=next(iter(kw))):
        aot.Spec(**args)


# ---- (e) manifest --------------------------------------------------------------

@pytest.mark.parametrize("cell,direction", [("lstm", "fwd"), ("lstm", "bwd"),
                                            ("gru", "fwd"), ("gru", "bwd")])
def test_manifest_fields(kernel_cache, cell, direction):
    spec = aot.Spec(cell, I, H, direction)
    path, manifest = aot.library(spec)
    assert path.parent == Path(kernel_cache) / aot.cache_key(spec)
    on_disk = json.loads((path.parent / aot.MANIFEST).read_text())
    assert on_disk == manifest

    assert manifest["cell"] == cell
    assert manifest["input_size"] == I and manifest["hidden_size"] == H
    assert manifest["direction"] == direction
    # The full target string, not "host": a "host" build is only good for this CPU.
    import halide as hl
    assert manifest["target_requested"] == "host"
    assert manifest["target"] == str(hl.get_host_target())
    assert re.fullmatch(r"[a-z0-9_]+-(32|64)-[a-z]+(-[a-z0-9_]+)*", manifest["target"])
    assert manifest["target"] != "host"
    assert manifest["schedule"] == "cpu"          # the resolved default, not None
    assert manifest["halide_version"] == importlib.metadata.version("halide")
    entry = "halstm_forward" if direction == "fwd" else "halstm_backward"
    assert list(manifest["entry_points"]) == [entry]
    assert all(isinstance(a, str) for a in manifest["entry_points"][entry])
    assert isinstance(manifest["compile_seconds"], float) and manifest["compile_seconds"] > 0
    assert manifest["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert manifest["library"] == aot.LIBRARY == path.name
    assert manifest["format"] == aot.FORMAT
    gates = {"lstm": ["i", "f", "g", "o"], "gru": ["r", "z", "n"]}[cell]
    assert manifest["gates"] == gates
    assert manifest["states"] == (["h", "c"] if cell == "lstm" else ["h"])


# ---- (f) cache keys ------------------------------------------------------------

def test_cache_key_depends_on_target_and_schedule():
    def key(**kw):
        return aot.cache_key(aot.Spec(**(dict(cell="gru", input_size=I, hidden_size=H,
                                                direction="fwd") | kw)))
    assert key() == key() == key(target="host", schedule=None)      # stable
    assert key() == aot.cache_key(SPEC)
    targets = ["host", "x86-64-linux", "x86-64-linux-avx2",
               "x86-64-linux-avx2-fma", "arm-64-linux"]
    assert len({key(target=t) for t in targets}) == len(targets)
    assert key(schedule=None) == key(schedule="cpu")    # the default is named in the key
    assert key(schedule="naive") != key(schedule="cpu")
    assert key(target="x86-64-linux", schedule="naive") != key(target="x86-64-linux")
    # Every other field too.
    others = [key(), key(cell="lstm"), key(input_size=I + 1), key(hidden_size=H + 1),
              key(direction="bwd")]
    assert len(set(others)) == len(others)
    assert all(re.fullmatch(r"[0-9a-f]+", k) for k in others)


def test_cache_key_depends_on_halide_code_and_host(monkeypatch):
    host, explicit = SPEC, aot.Spec("gru", I, H, "fwd", "x86-64-linux-avx2")
    k_host, k_explicit = aot.cache_key(host), aot.cache_key(explicit)
    with monkeypatch.context() as mp:
        mp.setattr(cache, "halide_version", lambda: "0.0.0")
        assert aot.cache_key(host) != k_host and aot.cache_key(explicit) != k_explicit
    with monkeypatch.context() as mp:
        mp.setattr(aot, "code_hash", lambda: "another-code")
        assert aot.cache_key(host) != k_host and aot.cache_key(explicit) != k_explicit
    with monkeypatch.context() as mp:     # another CPU: "host" means something else
        mp.setattr(cache, "host_fingerprint", lambda: "another-cpu")
        assert aot.cache_key(host) != k_host
        assert aot.cache_key(explicit) == k_explicit


def test_cache_dir_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("HALSTM_CACHE", str(tmp_path / "x"))
    assert aot.cache_dir() == tmp_path / "x"


# ---- (g) runtime: the numpy <-> Halide axis convention -------------------------

def test_runtime_axis_convention_non_square():
    """One LSTM layer through runtime.Library with every extent distinct
    (T=5, B=3, K=13, H=37, G=4): any swapped axis in the numpy -> Halide views
    would mix up time, batch, unit or gate and fail against the reference."""
    T, B = 5, 3
    rng = np.random.default_rng(42)
    f = lambda *s: rng.uniform(-0.4, 0.4, s).astype(np.float32)
    x = rng.standard_normal((T, B, I)).astype(np.float32)
    w_ih, w_hh, b_ih, b_hh = f(4 * H, I), f(4 * H, H), f(4 * H), f(4 * H)
    h0, c0 = f(B, H), f(B, H)
    dy = rng.standard_normal((T, B, H)).astype(np.float32)
    dh_n, dc_n = f(B, H), f(B, H)

    fwd = Library(*aot.library(aot.Spec("lstm", I, H, "fwd")))
    bwd = Library(*aot.library(aot.Spec("lstm", I, H, "bwd")))
    states, saved = fwd.forward(x, w_ih, b_ih, w_hh, b_hh, [h0, c0])
    assert [s.shape for s in states] == [(T + 1, B, H)] * 2
    assert saved.shape == (T, B, len(fwd.manifest["saved"]), H)

    d = lambda a: a.astype(np.float64)
    y, h_n, c_n, cache = ref.lstm_layer_forward(d(x), d(h0), d(c0), d(w_ih), d(w_hh),
                                                d(b_ih), d(b_hh))
    np.testing.assert_array_equal(states[0][0], h0)
    np.testing.assert_array_equal(states[1][0], c0)
    assert_close("h", states[0][1:], y)
    assert_close("c", states[1][1:], np.stack(cache["cs"][1:]))
    assert fwd.manifest["saved"] == ["i", "f", "g", "o"]
    assert_close("saved gates", saved, np.stack(cache["gates"]).reshape(T, B, 4, H))

    g = bwd.backward(x, w_ih, w_hh, saved, states, dy, [dh_n, dc_n])
    want = ref.lstm_layer_backward(d(dy), d(dh_n), d(dc_n), cache)
    for k in ("dx", "dw_ih", "db_ih", "dw_hh", "db_hh", "dh0", "dc0"):
        assert_close(k, g[k], want[k])


def test_runtime_loads_an_entry_folder():
    path, manifest = aot.library(SPEC)
    lib = Library(path.parent)                     # folder form: reads manifest.json
    assert lib.manifest == manifest and lib.path == path
    assert (lib.K, lib.H, lib.G, lib.states) == (I, H, 3, ("h",))
    got, want = gru_layer_reference(lib, T=4, B=2, seed=3)
    assert_close("h", got[1:], want)
