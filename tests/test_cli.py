"""The `halstm` command line: targets, compile, inspect, bench (train and
sample are tested in test_model.py).

Commands run in-process through click's CliRunner, plus one real call of the
installed console script. Compiling is the slow part (each library 3-5 s),
so each kind of folder is compiled once per module (fixtures below) at the
sizes the other tests use (I=13, H=37): a host LSTM with 2 layers (4
libraries), a CUDA one and a cross (arm-64-linux) one with 1 layer (2 each).
"""
import csv
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import halstm
from halstm import bf16, cuda, schedules
from helpers import (B, CUDA_TARGET, H, I, L, T, assert_cli_error, assert_close, ref_run,
                     run_cli)

CROSS_TARGET = "arm-64-linux"


def compile_folder(out, *args):
    result = run_cli("compile", "-i", I, "-H", H, "--out", out, *args)
    return out, result


@pytest.fixture(scope="module")
def host_dir(tmp_path_factory):
    """lstm I=13 H=37, 2 layers, for this machine, with stmt and c_header emitted."""
    out = tmp_path_factory.mktemp("cli") / "host"
    return compile_folder(out, "--layers", L, "--emit", "stmt", "--emit", "c_header")


@pytest.fixture(scope="module")
def cuda_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "cuda"
    return compile_folder(out, "--target", CUDA_TARGET)


@pytest.fixture(scope="module")
def cross_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "cross"
    return compile_folder(out, "--target", CROSS_TARGET)


def manifest(folder):
    return json.loads((Path(folder) / "manifest.json").read_text())


def parts(folder):
    return [(p, Path(folder) / p["dir"]) for p in manifest(folder)["parts"]]


# ---- the entry point and targets --------------------------------------------

def test_console_script_is_installed():
    exe = Path(sys.executable).parent / "halstm"
    exe = str(exe) if exe.exists() else shutil.which("halstm")
    assert exe, "the halstm console script is not installed"
    res = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    for command in ("targets", "compile", "inspect", "bench", "train", "sample"):
        assert command in res.stdout


def test_targets():
    import halide as hl
    out = run_cli("targets").output
    assert f"host target:  {hl.get_host_target()}" in out
    where = bf16.host_products() or "not on this CPU"
    assert f"precisions:   fp32; bf16 {where} (cpu targets)" in out
    lines = out.splitlines()
    listed = lines[lines.index("schedules:") + 1:]
    for name in schedules.names():
        row = next((r for r in listed if r.split()[0] == name), None)
        assert row is not None, f"schedule {name} not listed:\n{out}"
        for fam in schedules.families(name):
            assert fam in row
    defaults = {r.split()[0]: r.split("(default for ")[1] for r in listed if "default" in r}
    assert defaults == {"cpu": "cpu targets)", "cuda": "gpu targets)"}
    assert "cuda:" in out
    machine = next(r for r in lines if r.startswith("machine:"))
    assert f"{len(os.sched_getaffinity(0))} cores" in machine


# ---- compile for this machine -----------------------------------------------

def test_compile_host_manifest(host_dir):
    out, result = host_dir
    assert f"wrote {out}" in result.output
    assert "cannot run here" not in result.output
    top = manifest(out)
    assert (top["cell"], top["input_size"], top["hidden_size"], top["num_layers"]) == \
        ("lstm", I, H, L)
    assert top["loadable_here"] is True and top["schedule"] == "cpu"      # the default
    got = sorted((p["direction"], p["input_size"]) for p in top["parts"])
    assert got == [("bwd", I), ("bwd", H), ("fwd", I), ("fwd", H)]
    for p, d in parts(out):
        assert p["library"], p
        lib = d / p["library"]
        assert lib.is_file() and lib.read_bytes()[:4] == b"\x7fELF"
        assert manifest(d)["direction"] == p["direction"]
    assert not [f for f in out.parent.iterdir() if f.name.startswith(".")], "temporaries left"


def test_load_compiled_folder_matches_reference(host_dir):
    out, _ = host_dir
    m = halstm.load(out, seed=5)
    assert isinstance(m, halstm.LSTM) and m.num_layers == L
    rng = np.random.default_rng(0)
    x = rng.standard_normal((T, B, I)).astype(np.float32)
    dy = rng.standard_normal((T, B, H)).astype(np.float32)
    y, (h_n, c_n) = m(x)
    grads = m.backward(dy)

    ry, (rh, rc), rgrads = ref_run("lstm", m, x, dy=dy)
    for name, got, want in [("y", y, ry), ("h_n", h_n, rh), ("c_n", c_n, rc),
                            *((k, grads[k], rgrads[k]) for k in rgrads)]:
        assert_close(name, got, want)
    # the folder's libraries ran, not freshly compiled ones
    assert {str(lib.path.parent) for lib in m._libs.values()} == {str(d) for _, d in parts(out)}


def test_compile_emit(host_dir):
    out, _ = host_dir
    for p, d in parts(out):
        m = manifest(d)
        assert m["emitted"] == ["c_header", "stmt"]
        for pipeline in m["pipelines"]:
            kind = pipeline.removeprefix("halstm_")
            assert (d / f"{kind}.stmt").stat().st_size > 0
            assert pipeline in (d / f"{kind}.h").read_text()


def test_inspect(host_dir):
    out, _ = host_dir
    text = run_cli("inspect", out).output
    assert "cell:           lstm" in text
    assert f"input_size:     {I}" in text and f"hidden_size:    {H}" in text
    assert f"num_layers:     {L}" in text
    for p, _ in parts(out):
        assert p["dir"] in text
    assert "halstm_forward(" in text and "halstm_backward(" in text


def test_inspect_lists_the_schedule_notes(cuda_dir):
    """The cuda schedule's shape-dependent choices, as in each part's manifest."""
    out, _ = cuda_dir
    text = run_cli("inspect", out).output
    for _, d in parts(out):
        notes = manifest(d)["schedule_notes"]
        assert notes
        for note in notes:
            assert f"  schedule: {note}" in text


def test_inspect_json(host_dir):
    out, _ = host_dir
    data = json.loads(run_cli("inspect", "--json", out).output)
    assert data["model"] == manifest(out)
    assert [p["direction"] for p in data["parts"]] == \
        [p["direction"] for p in data["model"]["parts"]]
    assert all("entry_points" in p for p in data["parts"])


# ---- compile for other targets ----------------------------------------------

def test_compile_cuda(cuda_dir):
    out, result = cuda_dir
    top = manifest(out)
    assert top["schedule"] == "cuda"                                     # the default
    assert "cuda" in top["target"].split("-") and top["loadable_here"] is True
    assert sorted(p["direction"] for p in top["parts"]) == ["bwd", "fwd"]
    for p, d in parts(out):
        assert p["library"], p
        assert (d / p["library"]).read_bytes()[:4] == b"\x7fELF"


@pytest.mark.parametrize("precision", ["tf32", "bf16"])
def test_compile_reduced_precision(precision, tmp_path):
    out = tmp_path / precision
    run_cli("compile", "-i", I, "-H", H, "--target", CUDA_TARGET, "--precision", precision,
            "--out", out)
    top = manifest(out)
    assert (top["precision"], top["gemm"]) == (precision, "cublas")
    for p, d in parts(out):
        m = manifest(d)
        assert (m["precision"], m["gemm"]) == (precision, "cublas") and p["library"]
        assert ("halstm_to_bf16" in m["pipelines"]) == (precision == "bf16")
    shown = run_cli("inspect", out).output
    assert f"precision:      {precision}" in shown and "gemm:           cublas" in shown


def test_compile_cross(cross_dir):
    out, result = cross_dir
    assert "cannot run here" in result.output
    top = manifest(out)
    assert top["loadable_here"] is False and top["target"] == CROSS_TARGET
    assert sorted(p["direction"] for p in top["parts"]) == ["bwd", "fwd"]
    for p, d in parts(out):
        m = manifest(d)
        assert p["library"] is None and m["library"] is None
        for pipeline in m["pipelines"]:
            kind = pipeline.removeprefix("halstm_")
            assert (d / f"{kind}.a").is_file() and (d / f"{kind}.h").is_file()
        for f in ("runtime.a", "driver.cpp", "HalideRuntime.h"):
            assert (d / f).is_file(), f
        assert not list(d.glob("*.so"))
    with pytest.raises(ValueError, match="cannot run here"):
        halstm.load(out)
    text = run_cli("inspect", out).output
    assert "static libraries + driver.cpp" in text and "build: " in text


@pytest.mark.skipif(not shutil.which(os.environ.get("CXX", "c++")), reason="no C++ compiler")
def test_cross_driver_compiles_with_its_manifest_flags(cross_dir, tmp_path):
    """driver.cpp + the defines of "driver_build" compile to an object file
    (with the host compiler; the .a link step needs the cross toolchain)."""
    out, _ = cross_dir
    for p, d in parts(out):
        cmd = shlex.split(manifest(d)["driver_build"].split(" (")[0])
        cmd = cmd[:cmd.index("driver.cpp") + 1]           # drop the .a files
        assert any(a.startswith("-DHALSTM_") for a in cmd) and "-I." in cmd
        cmd[0] = os.environ.get("CXX", cmd[0])
        obj = tmp_path / f"{p['dir']}.o"
        res = subprocess.run(cmd + ["-c", "-o", str(obj)], cwd=d, capture_output=True,
                             text=True, timeout=300)
        assert res.returncode == 0, f"{' '.join(cmd)}\n{res.stderr}"
        assert obj.stat().st_size > 0


# ---- bench ------------------------------------------------------------------

def test_bench_end_to_end(tmp_path):
    paths = {k: tmp_path / f"bench.{k}" for k in ("csv", "json", "png")}
    result = run_cli("bench", "--shapes", "small_128_b16", "--fwd", "--peers", "numpy",
                     "--csv", paths["csv"], "--json", paths["json"], "--plot", paths["png"])
    assert "halstm:" in result.stdout and "numpy" in result.stdout
    assert "fwdbwd" not in result.stdout
    with open(paths["csv"], newline="") as f:
        rows = list(csv.DictReader(f))
    assert sorted(r["impl"] for r in rows) == ["halstm:default", "numpy"]
    assert all(r["shape"] == "small_128_b16" and r["mode"] == "fwd" and float(r["ms"]) > 0
               for r in rows)
    halstm_row = next(r for r in rows if r["impl"].startswith("halstm"))
    assert float(halstm_row["max_rel_err"]) < 1e-3 and float(halstm_row["x_numpy"]) > 0
    data = json.loads(paths["json"].read_text())
    assert len(data["results"]) == 2 and "host_target" in data["meta"]
    meta = data["meta"]                   # the machine every figure was taken on
    assert meta["cores"] == len(os.sched_getaffinity(0)) and meta["cpu"]
    assert ("gpu" in meta) == cuda.available()
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_takes_sizes_for_a_shape(tmp_path):
    """IxHxBxTxL names a shape outside the shared set (the sizes of
    small_128_b16's library, other batch and steps: no new build)."""
    path = tmp_path / "bench.json"
    run_cli("bench", "--shapes", "128x128x3x7x1", "--fwd", "--peers", "", "--rounds", "7",
            "--json", path)
    rows = json.loads(path.read_text())["results"]
    assert [(r["shape"], r["impl"]) for r in rows] == [("128x128x3x7x1", "halstm:default")]
    assert rows[0]["ms"] > 0 and rows[0]["max_rel_err"] < 1e-3
    assert len(rows[0]["rounds_ms"]) >= 7          # --rounds: at least that many rounds


# ---- bad arguments: exit code 2, one clear line, no traceback ----------------

@pytest.fixture
def a_file(tmp_path):
    f = tmp_path / "regular_file"
    f.write_text("")
    return f


SIZES = ["-i", I, "-H", H]

BAD = {
    "unknown cell": (["compile", "--cell", "rnn", *SIZES], ["--cell", "rnn"]),
    "zero input size": (["compile", "-i", 0, "-H", H], ["--input-size", "0"]),
    "negative input size": (["compile", "--input-size=-3", "-H", H], ["--input-size", "-3"]),
    "zero hidden size": (["compile", "-i", I, "-H", 0], ["--hidden-size", "0"]),
    "negative hidden size": (["compile", "-i", I, "--hidden-size=-1"], ["--hidden-size"]),
    "zero layers": (["compile", *SIZES, "--layers", 0], ["--layers"]),
    "non-integer size": (["compile", "-i", "1.5", "-H", H], ["--input-size"]),
    "bad target": (["compile", *SIZES, "--target", "x86-65-nonsense"],
                   ["--target", "x86-65-nonsense"]),
    "unknown schedule": (["compile", *SIZES, "--schedule", "fastest"],
                         ["--schedule", "fastest", *schedules.names()]),
    "gpu schedule for host": (["compile", *SIZES, "--schedule", "cuda"], ["--schedule", "cuda"]),
    "cpu schedule for cuda": (["compile", *SIZES, "--target", CUDA_TARGET, "--schedule", "cpu"],
                              ["--schedule", "'cpu'"]),
    "unknown emit": (["compile", *SIZES, "--emit", "pdf"], ["--emit", "pdf"]),
    "tf32 for host": (["compile", *SIZES, "--precision", "tf32"], ["--precision", "CUDA"]),
    "cublas for host": (["compile", *SIZES, "--gemm", "cublas"], ["--gemm", "CUDA"]),
    "bench unknown variant": (["bench", "--schedules", "cpu@fp16"], ["--schedules", "fp16"]),
    "bench tf32 on host": (["bench", "--schedules", "default@tf32"], ["--schedules", "CUDA"]),
    "bench unknown cell": (["bench", "--cell", "rnn"], ["--cell"]),
    "bench unknown shape": (["bench", "--shapes", "small_128_b16,huge"],
                            ["--shapes", "huge", "small_128_b16", "I x H x B x T x L"]),
    "bench zero size": (["bench", "--shapes", "128x128x0x5x1"], ["--shapes", "128x128x0x5x1"]),
    "bench unknown schedule": (["bench", "--schedules", "cpu,fastest"],
                               ["--schedules", "fastest"]),
    "bench unknown peer": (["bench", "--peers", "numpy,jax"], ["--peers", "jax", "numpy"]),
    "bench zero rounds": (["bench", "--rounds", "0"], ["--rounds", "0"]),
    "bench bad target": (["bench", "--target", "nonsense"], ["--target", "nonsense"]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_arguments(case, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)                   # a compile would write ./lstm_i13_h37
    args, needles = BAD[case]
    assert_cli_error(run_cli(*args, ok=False), *needles)
    assert not list(tmp_path.iterdir()), "a bad command wrote something"


@pytest.mark.parametrize("sub", ["out", "deeper/out"])
def test_compile_unwritable_out(a_file, sub):
    out = a_file / sub                            # a path under a regular file
    assert_cli_error(run_cli("compile", *SIZES, "--out", out, ok=False), "--out", str(out))
    assert a_file.is_file()


def test_compile_out_is_a_file(a_file):
    assert_cli_error(run_cli("compile", *SIZES, "--out", a_file, ok=False), "--out")


def test_inspect_folder_without_manifest(tmp_path):
    line = assert_cli_error(run_cli("inspect", tmp_path, ok=False), "manifest.json", code=1)
    assert str(tmp_path) in line


def test_inspect_missing_folder(tmp_path):
    assert_cli_error(run_cli("inspect", tmp_path / "nope", ok=False), "nope")


# ---- folder handling and failures: clean errors, nothing lost ----------------

def _no_build(spec, out, emit=(), require_loadable=False):
    raise AssertionError("compile built into a folder it should have refused")


def test_compile_keeps_files_of_an_unrelated_out_folder(tmp_path, monkeypatch):
    """A folder with files that `halstm compile` did not write is refused
    before anything is built, and left as it was."""
    monkeypatch.setattr(halstm.aot, "build", _no_build)
    out = tmp_path / "project"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    result = run_cli("compile", *SIZES, "--out", out, "--target", CROSS_TARGET, ok=False)
    assert_cli_error(result, "--out", str(out), "was not written by `halstm compile`")
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    assert (out / "notes.txt").read_text() == "keep me"
    assert [p.name for p in tmp_path.iterdir()] == ["project"]


def test_compile_out_current_folder(tmp_path, monkeypatch):
    """The current folder (which compiling would replace) is refused."""
    monkeypatch.setattr(halstm.aot, "build", _no_build)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("keep me")
    result = run_cli("compile", *SIZES, "--out", ".", "--target", CROSS_TARGET, ok=False)
    assert_cli_error(result, "--out", "is the current folder")
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_inspect_folder_with_missing_part(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps(
        {"cell": "lstm", "input_size": I, "hidden_size": H, "num_layers": 1,
         "target": "host", "target_requested": "host", "schedule": "cpu",
         "loadable_here": True,
         "parts": [{"dir": "fwd_k13", "direction": "fwd", "input_size": I}]}))
    assert_cli_error(run_cli("inspect", tmp_path, ok=False), "fwd_k13", code=1)


def test_inspect_manifest_without_a_field_names_it(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps(
        {"cell": "lstm", "input_size": I, "hidden_size": H, "num_layers": 1,
         "parts": [{"dir": "fwd_k13", "direction": "fwd", "input_size": I}]}))
    line = assert_cli_error(run_cli("inspect", tmp_path, ok=False), "manifest.json",
                            "no 'target'", code=1)
    assert "nothing" not in line


def test_inspect_corrupt_manifest_names_the_file(tmp_path):
    (tmp_path / "manifest.json").write_text("{not json")
    assert_cli_error(run_cli("inspect", tmp_path, ok=False), "manifest.json", code=1)


def test_bench_kernel_error_is_one_line(monkeypatch):
    import halstm.benchmark

    def failing_run(*args, **kwargs):
        raise halstm.KernelError("lstm fwd kernel (host-cuda, schedule cuda) failed with "
                                 "code -21: CUDA API not found: cuInit")
    monkeypatch.setattr(halstm.benchmark, "run", failing_run)
    result = run_cli("bench", "--target", "host-cuda", "--peers", "", "--fwd", ok=False)
    assert_cli_error(result, "cuInit", code=1)
