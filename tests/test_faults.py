"""Faults around loading and the cache (issue classes 3 and 7): a damaged
library or manifest is a clear error before anything is loaded (loading a
shared library runs its code), a damaged cache entry is rebuilt, the cache
folder must be this user's and private, and misuse of the API names the
argument, what was expected and what came. Training faults are in
test_faults_training.py; NaN in test_nan.py; threads in test_threads.py."""
import json
import os
import shutil
import stat

import numpy as np
import pytest

import halstm
from halstm import aot, cache, manifest
from halstm.runtime import Library
from helpers import B, I, T, make, run_cli

SPEC = aot.Spec("lstm", I, 37, "fwd")       # built by every test run's first module call


@pytest.fixture(scope="module")
def entry():
    """A cache entry of SPEC: (folder, its manifest)."""
    path, man = aot.library(SPEC)
    return path.parent, man


@pytest.fixture
def lib_dir(entry, tmp_path):
    """A private copy of the entry, to damage."""
    d = tmp_path / "lib"
    shutil.copytree(entry[0], d)
    return d


def _flip(data: bytes, i: int) -> bytes:
    return data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1:]


def _edit(folder, change):
    m = json.loads((folder / "manifest.json").read_text())
    change(m)
    (folder / "manifest.json").write_text(json.dumps(m))


# ---- a damaged library folder given by the user ----------------------------------

def test_an_intact_copy_loads(lib_dir):
    lib = Library(lib_dir)
    assert lib.manifest["cell"] == "lstm"


@pytest.mark.parametrize("damage,message", [
    (lambda so: so.write_bytes(so.read_bytes()[: so.stat().st_size // 2]), "checksum"),
    (lambda so: so.write_bytes(b""), "checksum"),
    (lambda so: so.write_bytes(_flip(so.read_bytes(), 100)), "checksum"),
    (lambda so: so.write_bytes(b"#!/bin/sh\necho not a library\n"), "checksum"),
    (lambda so: so.unlink(), "missing"),
], ids=["truncated", "empty", "one_byte", "a_script", "missing"])
def test_a_damaged_library_is_refused_before_loading(lib_dir, damage, message):
    damage(lib_dir / "libhalstm.so")
    with pytest.raises(halstm.LibraryError) as info:
        Library(lib_dir)
    assert message in str(info.value) and str(lib_dir) in str(info.value)


@pytest.mark.parametrize("key", sorted(manifest.FIELDS))
def test_a_manifest_without_a_field_names_it(lib_dir, key):
    _edit(lib_dir, lambda m: m.pop(key))
    with pytest.raises(halstm.LibraryError) as info:
        Library(lib_dir)
    assert f"'{key}'" in str(info.value) and "manifest.json" in str(info.value)


@pytest.mark.parametrize("key,value", [
    ("format", 1), ("cell", ""), ("cell", 3), ("input_size", "13"), ("input_size", -1),
    ("input_size", True), ("hidden_size", 10 ** 9), ("direction", "up"), ("gates", []),
    ("saved", ["a", ""]), ("panel", 0), ("device", "tpu"), ("library", "../libhalstm.so"),
    ("library", "/lib/x86_64-linux-gnu/libc.so.6"), ("sha256", "abc"), ("dxp_is_dhg", "yes"),
    ("pipelines", "halstm_step"),
])
def test_a_manifest_field_of_the_wrong_kind_is_refused(lib_dir, key, value):
    _edit(lib_dir, lambda m: m.__setitem__(key, value))
    with pytest.raises(halstm.LibraryError) as info:
        Library(lib_dir)
    assert f"'{key}'" in str(info.value) and repr(value) in str(info.value)


@pytest.mark.parametrize("text,message", [
    ("", "not valid JSON"), ("{", "not valid JSON"), ("[]", "expected a JSON object"),
    ("null", "expected a JSON object"), ('"lstm"', "expected a JSON object"),
])
def test_a_malformed_manifest_is_a_clear_error(lib_dir, text, message):
    (lib_dir / "manifest.json").write_text(text)
    with pytest.raises(halstm.LibraryError) as info:
        Library(lib_dir)
    assert message in str(info.value)


def test_a_manifest_that_is_not_text(lib_dir):
    (lib_dir / "manifest.json").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(halstm.LibraryError):
        Library(lib_dir)


def test_no_manifest(lib_dir):
    (lib_dir / "manifest.json").unlink()
    with pytest.raises(FileNotFoundError, match="not a folder written by `halstm compile`"):
        Library(lib_dir)


# ---- a damaged compiled model folder: halstm.load, halstm inspect -------------------

@pytest.fixture
def model_dir(entry, tmp_path):
    """A one-layer folder as `halstm compile` writes it, from cache entries."""
    out = tmp_path / "model"
    parts = []
    for direction in aot.DIRECTIONS:
        path, _ = aot.library(aot.Spec("lstm", I, 37, direction))
        shutil.copytree(path.parent, out / f"{direction}_k{I}")
        parts.append({"dir": f"{direction}_k{I}", "direction": direction, "input_size": I,
                      "library": "libhalstm.so", "compile_seconds": 0})
    top = {"cell": "lstm", "input_size": I, "hidden_size": 37, "num_layers": 1,
           "target": SPEC.target, "target_requested": "host", "schedule": "cpu",
           "halide_version": cache.halide_version(), "loadable_here": True, "parts": parts}
    (out / "manifest.json").write_text(json.dumps(top))
    return out


def test_an_intact_model_folder_loads_and_runs(model_dir):
    m = halstm.load(model_dir)
    y, _ = m(np.ones((T, B, I), np.float32))
    assert y.shape == (T, B, 37) and np.isfinite(y).all()


@pytest.mark.parametrize("key,value", [
    ("cell", "no cell"), ("num_layers", 0), ("num_layers", "1"), ("hidden_size", None),
    ("parts", []), ("parts", [{"dir": "../fwd_k13", "direction": "fwd", "input_size": I}]),
    ("parts", [{"dir": "fwd_k13", "direction": "sideways", "input_size": I}]),
    ("loadable_here", "yes"), ("target", 7),
])
def test_load_refuses_a_damaged_model_manifest(model_dir, key, value):
    _edit(model_dir, lambda m: m.__setitem__(key, value))
    with pytest.raises(halstm.LibraryError) as info:
        halstm.load(model_dir)
    assert f"'{key}'" in str(info.value)
    result = run_cli("inspect", model_dir, ok=False)
    assert result.exit_code == 1 and f"'{key}'" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("cell", ["gru", "nosuch"])
def test_load_refuses_a_manifest_naming_another_cell(model_dir, cell):
    _edit(model_dir, lambda m: m.__setitem__("cell", cell))
    with pytest.raises(halstm.LibraryError, match="'cell'"):
        halstm.load(model_dir)


def test_load_refuses_a_damaged_part(model_dir):
    so = model_dir / f"bwd_k{I}" / "libhalstm.so"
    so.write_bytes(so.read_bytes()[:4096])
    with pytest.raises(halstm.LibraryError, match="checksum"):
        halstm.load(model_dir)


@pytest.mark.parametrize("text", ["", "{}", "[1, 2]", "{\"parts\": 3}"])
def test_inspect_a_malformed_top_manifest(model_dir, text):
    (model_dir / "manifest.json").write_text(text)
    result = run_cli("inspect", model_dir, ok=False)
    assert result.exit_code == 1 and "manifest.json" in result.output
    assert "Traceback" not in result.output


# ---- the cache ---------------------------------------------------------------------

TINY = aot.Spec("gru", 3, 5, "fwd", "host", "naive")     # quick to build


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("HALSTM_CACHE", str(d))
    return d


@pytest.mark.parametrize("damage", [
    lambda e: (e / "libhalstm.so").write_bytes(b"\x7fELF broken"),
    lambda e: (e / "manifest.json").write_text("{}"),
    lambda e: _edit(e, lambda m: m.__setitem__("hidden_size", "5")),
    lambda e: (shutil.rmtree(e), e.write_text("a plain file where the entry was")),
], ids=["library", "empty_manifest", "manifest_field", "entry_is_a_file"])
def test_a_damaged_cache_entry_is_rebuilt(own_cache, damage):
    path, man = aot.library(TINY)
    damage(path.parent)
    path2, man2 = aot.library(TINY)
    assert path2 == path and cache.file_sha256(path2) == man2["sha256"]
    lib = Library(path2, man2)                          # (a rebuild need not be bitwise the same)
    states, _ = lib.forward(np.ones((2, 1, 3), np.float32), *_gru_weights(), [None])
    assert lib.manifest["hidden_size"] == 5 and np.isfinite(states[0]).all()
    assert not list(own_cache.glob(".tmp-*"))          # nothing half-written left


def _gru_weights():
    w = np.full((15, 3), 0.1, np.float32), np.zeros(15, np.float32)
    return w[0], w[1], np.full((15, 5), 0.1, np.float32), w[1]


def test_a_new_cache_folder_is_private(own_cache):
    assert cache.root() == own_cache
    assert stat.S_IMODE(own_cache.stat().st_mode) == 0o700


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o757, 0o722])
def test_a_cache_folder_others_can_write_is_refused(own_cache, mode):
    own_cache.mkdir()
    own_cache.chmod(mode)
    with pytest.raises(halstm.CacheError) as info:
        aot.library(TINY)
    assert str(own_cache) in str(info.value) and f"{mode:o}" in str(info.value)
    assert not any(own_cache.iterdir())                 # nothing loaded, nothing written


def test_a_cache_folder_that_is_a_file(own_cache):
    own_cache.write_text("not a folder")
    with pytest.raises(halstm.CacheError, match="expected a folder, got a file"):
        aot.library(TINY)


def test_a_cache_folder_under_a_file(tmp_path, monkeypatch):
    (tmp_path / "f").write_text("x")
    monkeypatch.setenv("HALSTM_CACHE", str(tmp_path / "f" / "cache"))
    with pytest.raises(halstm.CacheError, match="expected a folder, got a file"):
        aot.library(TINY)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root")
def test_a_cache_folder_of_another_user_is_refused(own_cache):
    own_cache.mkdir(mode=0o700)
    os.chown(own_cache, 65534, 65534)
    with pytest.raises(halstm.CacheError, match="uid 65534"):
        aot.library(TINY)


def test_an_unusable_cache_is_one_line_from_the_cli_and_the_api(own_cache):
    own_cache.write_text("not a folder")
    result = run_cli("bench", "--shapes", "small_128_b16", "--fwd", "--peers", "numpy", ok=False)
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert f"Error: the kernel cache folder {own_cache}" in result.output
    with pytest.raises(halstm.CacheError):
        make("gru", num_layers=1)(np.ones((2, 1, I), np.float32))


# ---- misuse of the API: one line naming the argument --------------------------------

@pytest.mark.parametrize("value", [None, [1, 2], "weights", 42, np.zeros(3)])
def test_load_state_dict_wants_a_mapping(value):
    m = make("lstm", num_layers=1)
    before = {k: v.copy() for k, v in m.state_dict().items()}
    with pytest.raises(TypeError) as info:
        m.load_state_dict(value)
    assert "state_dict: expected a mapping" in str(info.value)
    assert type(value).__name__ in str(info.value)
    assert all(np.array_equal(before[k], v) for k, v in m.state_dict().items())


@pytest.mark.parametrize("hx,message", [
    (np.zeros((1, B, 37), np.float32), "hx: expected None or a pair (h0, c0)"),
    ((np.zeros((1, B, 37), np.float32),), "hx: expected None or a pair (h0, c0)"),
    ((np.zeros((2, B, 37), np.float32), np.zeros((1, B, 37), np.float32)), "expected shape"),
    ((np.zeros((1, B, 36), np.float32), np.zeros((1, B, 37), np.float32)), "expected shape"),
    ((np.array([["a"]]), np.zeros((1, B, 37), np.float32)), "h0"),
    ((np.zeros((1, B, 37), np.int64), np.zeros((1, B, 37), np.float32)), "h0"),
])
def test_hx_of_the_wrong_shape_or_type(hx, message):
    m = make("lstm", num_layers=1)
    with pytest.raises((TypeError, ValueError)) as info:
        m(np.ones((T, B, I), np.float32), hx)
    text = str(info.value)
    assert message in text and "\n" not in text
