"""halstm tune: knobs checked and timed against the default, kept per
machine in the cache's tuning.json, and used by aot.Spec without being
asked. Runs in a cache of its own, so that no other test builds with a
tuned knob."""
import json

import numpy as np
import pytest
from click.testing import CliRunner

import halstm
from halstm import aot, cells, cuda, machine, tuning
from halstm.schedules import cuda as cuda_schedule
from halstm.schedules.knobs import KNOBS
from halstm.cli import main
from helpers import USER_CELL, H, I, assert_close, needs_bf16


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HALSTM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


# the weight-gradient block's default follows the L2 (knobs.dw_block_kib)
DW = KNOBS["cpu"]["dw_block_kib"]


def test_weight_gradient_block_default_follows_the_l2(monkeypatch):
    from halstm.schedules import knobs
    assert DW.default == max(256, machine.l2_bytes() // 4 >> 10)     # this machine's
    assert DW.default in DW.candidates
    for l2, kib in ((512 << 10, 256), (1 << 20, 256), (2 << 20, 512), (4 << 20, 1024)):
        monkeypatch.setattr(machine, "l2_bytes", lambda l2=l2: l2)
        assert knobs.dw_block_kib() == kib


def test_tune_checks_times_and_keeps_no_slower_value(own_cache):
    report = tuning.tune("lstm", I, H, 3, 7, names=["dw_block_kib"], budget=300, rounds=3,
                         progress=False)
    (layer, entry), = report.items()                    # dw_block_kib acts on backward only
    assert layer == tuning.layer_key(aot.Spec("lstm", I, H, "bwd"))
    (step,) = entry["by_knob"]
    assert step["knob"] == "dw_block_kib" and step["base"] == {}
    assert [t["value"] for t in step["tried"]] == [v for v in DW.candidates if v != DW.default]
    assert all(t["correct"] and t["ms"] > 0 for t in step["tried"])
    if step["kept"] != DW.default:
        won = next(t for t in step["tried"] if t["value"] == step["kept"])
        assert won["ms"] < (1 - tuning.MIN_GAIN) * step["base_ms"]
        again = step["again"]                           # (and won its own rounds)
        assert again["value"] == step["kept"]
        assert again["ms"] < (1 - tuning.MIN_GAIN) * again["base_ms"]
    stored = json.loads((own_cache / tuning.FILE).read_text())
    assert stored[tuning.machine_key("host")][layer]["knobs"] == entry["knobs"]
    lines = tuning.report_lines()
    assert lines[0] == f"machine: {tuning.machine_key('host')}"
    other = max(v for v in DW.candidates if v != DW.default)
    assert any(f"dw_block_kib={other}: " in line and " ms" in line for line in lines)


def test_a_win_is_timed_again_before_it_is_kept(own_cache, monkeypatch):
    """A value whose median beats the base among all values is timed again
    against the base alone, and kept only if it wins there too (timings
    scripted: the first rounds crown 128, the second see no gain)."""
    from halstm import benchmark
    rounds = []

    def scripted(calls, n, warmup, sync):
        rounds.append(sorted(map(str, calls)))
        return {k: (0.9e-3 if k == 128 and len(rounds) == 1 else 1e-3) for k in calls}
    monkeypatch.setattr(benchmark, "alternating", scripted)
    report = tuning.tune("lstm", I, H, 3, 7, names=["dw_block_kib"], rounds=3, progress=False)
    (step,) = report[tuning.layer_key(aot.Spec("lstm", I, H, "bwd"))]["by_knob"]
    others = sorted(str(v) for v in DW.candidates if v != DW.default)
    assert rounds == [others + ["base"], ["128", "base"]]
    assert step["again"] == {"value": 128, "ms": 1.0, "base_ms": 1.0}
    assert step["kept"] == DW.default
    assert any(f"dw_block_kib=128 again: 1.0 ms against 1.0): kept {DW.default}" in line
               for line in tuning.report_lines())


def test_tune_starts_from_what_is_kept(own_cache):
    """Tuning one knob keeps another's kept value and measures against it."""
    layer = tuning.layer_key(aot.Spec("lstm", I, H, "bwd"))
    tuning.store({layer: {"knobs": {"dw_block_kib": 128}, "B": 3, "T": 7, "rounds": 3,
                          "by_knob": [], "when": "now"}}, "host")
    report = tuning.tune("lstm", I, H, 3, 7, names=["dh_panel_kib"], budget=300, rounds=3,
                         progress=False)
    (step,) = report[layer]["by_knob"]
    assert step["base"] == {"dw_block_kib": 128}
    assert report[layer]["knobs"]["dw_block_kib"] == 128
    assert ("dw_block_kib", 128) in aot.Spec("lstm", I, H, "bwd").knobs


def test_stored_knobs_reach_spec_and_modules(own_cache, rng):
    """A kept value is in the Spec of its layer and direction (not the
    other's), changes the cache key, and its library computes the same
    gradients as the default's."""
    layer = tuning.layer_key(aot.Spec("lstm", I, H, "bwd"))
    default_key = aot.cache_key(aot.Spec("lstm", I, H, "bwd"))
    x = rng.standard_normal((7, 3, I)).astype(np.float32)
    dy = rng.standard_normal((7, 3, H)).astype(np.float32)
    m = halstm.LSTM(I, H, seed=1)
    m(x)
    want = m.backward(dy)
    tuning.store({layer: {"knobs": {"dw_block_kib": 128}, "B": 3, "T": 7, "rounds": 3,
                          "by_knob": [], "when": "now"}}, "host")
    assert aot.Spec("lstm", I, H, "bwd").knobs == (("dw_block_kib", 128),)
    assert aot.Spec("lstm", I, H, "fwd").knobs == ()
    assert aot.Spec("lstm", I, H, "bwd", knobs=()).knobs == ()       # explicit: defaults
    assert aot.cache_key(aot.Spec("lstm", I, H, "bwd")) != default_key
    tuned = halstm.LSTM(I, H, seed=1)
    tuned(x)
    got = tuned.backward(dy)
    for k in want:
        assert_close(f"d {k}", got[k], want[k])
    _, manifest = aot.library(aot.Spec("lstm", I, H, "bwd"))
    assert manifest["knobs"] == {"dw_block_kib": 128}
    out = own_cache.parent / "model"
    r = CliRunner().invoke(main, ["compile", "-i", str(I), "-H", str(H), "--out", str(out)])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["inspect", str(out)])
    assert r.exit_code == 0 and r.output.count("knobs: dw_block_kib=128") == 1, r.output


def test_a_kept_knob_the_schedule_lost_is_left_out(own_cache):
    """A tuning.json from another halstm version may keep a knob the
    schedule no longer has: it is left out with a warning, not an error."""
    layer = tuning.layer_key(aot.Spec("lstm", I, H, "bwd"))
    tuning.store({layer: {"knobs": {"gone_knob": 2, "dw_block_kib": 128}, "B": 3, "T": 7,
                          "rounds": 3, "by_knob": [], "when": "now"}}, "host")
    with pytest.warns(UserWarning, match="gone_knob .* is no knob of schedule 'cpu'"):
        spec = aot.Spec("lstm", I, H, "bwd")
    assert spec.knobs == (("dw_block_kib", 128),)


def test_knob_errors(own_cache):
    with pytest.raises(ValueError, match="knobs: schedule 'cpu' has no knob 'tile'"):
        aot.Spec("lstm", I, H, "bwd", knobs={"tile": 2})
    with pytest.raises(ValueError, match="knobs: dw_block_kib expects a positive int, got 0"):
        aot.Spec("lstm", I, H, "bwd", knobs={"dw_block_kib": 0})
    # a default value is the default library
    assert aot.Spec("lstm", I, H, "bwd", knobs={"dw_block_kib": DW.default}).knobs == ()
    r = CliRunner().invoke(main, ["tune"])
    assert r.exit_code == 2 and "give --shape NAME or --sizes" in r.output
    r = CliRunner().invoke(main, ["tune", "--sizes", "13,37,3"])
    assert r.exit_code == 2 and "--sizes" in r.output and "4 or 5 positive ints" in r.output
    r = CliRunner().invoke(main, ["tune", "--sizes", "13,37,3,7", "--knob", "tile"])
    assert r.exit_code == 2 and "has no knob 'tile'" in r.output
    r = CliRunner().invoke(main, ["tune", "--sizes", "13,37,3,7", "--schedule", "naive"])
    assert r.exit_code == 2 and "schedule 'naive' has no knobs" in r.output
    r = CliRunner().invoke(main, ["tune", "--report"])
    assert r.exit_code == 0 and "nothing tuned for" in r.output


def test_reducing_forward_rows_knob(own_cache):
    """rows_fwd_kib acts on cells that reduce over units only: their
    forward runs on ranges of rows where W_hh is at most that many KiB (H=37:
    22 KiB), in two parts past it (the driver's limit; the library has both
    ways); other cells drop it, and tune refuses it for them."""
    assert aot.Spec("lstm", I, H, "fwd", knobs={"rows_fwd_kib": 1}).knobs == ()
    for kib in (512, 1):
        path, manifest = aot.library(aot.Spec("layernorm_lstm", I, H, "fwd",
                                              knobs={"rows_fwd_kib": kib}))
        assert manifest["layout"]["split"]["rows_only"] is True
        assert manifest["split"]["batch_bytes"] == kib << 10
        assert "halstm_step_product" in manifest["pipelines"]
    with pytest.raises(ValueError, match="rows_fwd_kib acts on cells that reduce"):
        tuning.tune("lstm", I, H, 3, 7, names=["rows_fwd_kib"], progress=False)


def test_bf16_layers_take_only_their_knobs():
    """A precision "bf16" layer keeps the knobs that act on it (Knob.bf16)
    and drops the others; tune refuses those for it."""
    assert aot.Spec("lstm", I, H, "bwd", knobs={"dw_block_kib": 128},
                    precision="bf16").knobs == ()
    assert aot.Spec("lstm", I, H, "fwd", knobs={"proj_chunk": 8},
                    precision="bf16").knobs == (("proj_chunk", 8),)
    with pytest.raises(ValueError, match="dw_block_kib does not act on precision 'bf16'"):
        tuning.tune("lstm", I, H, 3, 7, names=["dw_block_kib"], precision="bf16",
                    progress=False)


@needs_bf16
def test_tune_keeps_bf16_values_apart(own_cache):
    """`halstm tune --precision bf16` stores a bf16 layer under a key of its
    own, which the bf16 Spec reads and the float32 one does not."""
    r = CliRunner().invoke(main, ["tune", "--sizes", f"{I},{H},3,7", "--precision", "bf16",
                                  "--knob", "proj_chunk", "--rounds", "3"])
    layer = tuning.layer_key(aot.Spec("lstm", I, H, "fwd", precision="bf16"))
    assert r.exit_code == 0 and f"{layer}: " in r.output, r.output
    assert layer.endswith(" bf16") and layer != tuning.layer_key(aot.Spec("lstm", I, H, "fwd"))
    entry = tuning.load()[tuning.machine_key("host")][layer]
    (step,) = entry["by_knob"]
    assert [t["value"] for t in step["tried"]] == [8, 16, 64]
    assert all(t["correct"] for t in step["tried"])
    tuning.store({layer: {**entry, "knobs": {"proj_chunk": 8}}}, "host")
    assert aot.Spec("lstm", I, H, "fwd", precision="bf16").knobs == (("proj_chunk", 8),)
    assert aot.Spec("lstm", I, H, "fwd").knobs == ()


def test_cuda_knobs_shape_the_layout():
    """The CUDA schedule's knobs (no GPU needed to plan a build): narrow_kib
    moves the W_hh size from which a forward of few rows runs the narrow
    steps, step_gemm_(tensor_)(bwd_)mmacs the batch from which a layer's
    step products run as cuBLAS GEMMs, loop_shared_pct the W_hh size up to
    which a forward without a tape runs as one kernel; each acts only where
    it can (direction, cells without sums over units, precision, cuBLAS
    GEMMs), and tune refuses it elsewhere."""
    def layout(cell, H, direction, knobs, **kw):
        spec = aot.Spec(cell, I, H, direction, target="host-cuda", knobs=knobs, **kw)
        return spec.knobs, aot._plan(spec, (), False).layout
    # an LSTM at H = 128 reads 64 KiB of W_hh a one-row block: narrow from 64 KiB, not 128
    assert layout("lstm", 128, "fwd", {})[1].narrow_rows == 0
    assert layout("lstm", 128, "fwd", {"narrow_kib": 64})[1].narrow_rows > 0
    assert layout("lstm", 256, "fwd", {})[1].narrow_rows > 0
    assert layout("lstm", 256, "fwd", {"narrow_kib": 1 << 20})[1].narrow_rows == 0
    G, H = 4, 64
    # (defaults: 2^24 forward, 2^25 for a cell that reduces; backward 2^24, 1.5 * 2^26 for
    # a cell that reduces)
    for cell, direction, name, tuned, default in (
            ("lstm", "fwd", "step_gemm_mmacs", 96, 16),
            ("layernorm_lstm", "fwd", "step_gemm_reducing_mmacs", 96, 32),
            ("lstm", "bwd", "step_gemm_bwd_mmacs", 32, 16),
            ("layernorm_lstm", "bwd", "step_gemm_reducing_bwd_mmacs", 32, 96)):
        knobs, lay = layout(cell, H, direction, {name: tuned}, gemm="cublas")
        assert knobs == ((name, tuned),)
        assert lay.vendor_step_rows == -(-(tuned << 20) // (G * H * H))
        assert layout(cell, H, direction, {}, gemm="cublas")[1].vendor_step_rows == \
            -(-(default << 20) // (G * H * H))
    assert layout("layernorm_lstm", H, "fwd", {"step_gemm_mmacs": 96}, gemm="cublas")[0] == ()
    # a one-gate cell's backward: at least 1.5 * 2^26 whatever the knob, so values below
    # it are the default's library, and tune builds only the values past it
    floor = KNOBS["cuda"]["step_gemm_bwd_mmacs"].floor
    assert floor[1] << 20 == cuda_schedule.VENDOR_STEP_REDUCING_BWD_MACS
    for value in (8, 32, 96):
        knobs_kept, lay = layout("rnn_tanh", H, "bwd", {"step_gemm_bwd_mmacs": value},
                                 gemm="cublas")
        assert knobs_kept == () and lay.vendor_step_rows == -(-(96 << 20) // (H * H))
    assert layout("rnn_tanh", H, "bwd", {"step_gemm_bwd_mmacs": 1 << 20},
                  gemm="cublas")[0] == (("step_gemm_bwd_mmacs", 1 << 20),)
    bwd = KNOBS["cuda"]["step_gemm_bwd_mmacs"]
    assert tuning._values(bwd, 16, 1) == [1 << 20]
    assert tuning._values(bwd, 16, 4) == [8, 32, 96, 1 << 20]
    assert tuning._values(bwd, 1 << 20, 1) == [16]
    # loop_shared_pct: one kernel a forward without a tape up to a block's shared memory
    # by default; 1%: practically never; 150%: the LSTM at H = 128 too (256 KiB) where a
    # block may have 227 KiB (an H100's; without a GPU the default)
    loops = [layout(cell, h, "fwd", knobs)[1].loop_rows > 0
             for cell, h, knobs in (("rnn_tanh", 64, {}), ("rnn_tanh", 64, {"loop_shared_pct": 1}),
                                    ("lstm", 128, {}), ("lstm", 128, {"loop_shared_pct": 150}))]
    if machine.gpu_block_shared_bytes() == 227 << 10:
        assert loops == [True, False, False, True]
    # the tensor-core precisions' own threshold (default 32)
    for precision in ("tf32", "bf16"):
        knobs, lay = layout("lstm", H, "bwd", {"step_gemm_tensor_bwd_mmacs": 8}, gemm="cublas",
                            precision=precision)
        assert knobs == (("step_gemm_tensor_bwd_mmacs", 8),)
        assert lay.vendor_step_rows == -(-(8 << 20) // (G * H * H))
    assert layout("lstm", H, "fwd", {"step_gemm_tensor_mmacs": 8}, gemm="cublas")[0] == ()
    # where a knob cannot act it is dropped: the same library as the default's
    assert layout("lstm", H, "bwd", {"step_gemm_mmacs": 32}, gemm="cublas")[0] == ()
    assert layout("lstm", H, "fwd", {"step_gemm_mmacs": 96}, gemm="halide")[0] == ()
    assert layout("lstm", H, "fwd", {"step_gemm_mmacs": 96}, gemm="cublas",
                  precision="tf32")[0] == ()
    assert layout("layernorm_lstm", H, "fwd", {"narrow_kib": 64})[0] == ()
    with pytest.raises(ValueError, match="step_gemm_tensor_mmacs does not act on "
                                         "(precision 'fp32'|layers without cublas)"):
        tuning.tune("lstm", I, H, 3, 7, "host-cuda", names=["step_gemm_tensor_mmacs"],
                    progress=False)
    with pytest.raises(ValueError, match="narrow_kib acts on cells that do not reduce"):
        tuning.tune("layernorm_lstm", I, H, 3, 7, "host-cuda", names=["narrow_kib"],
                    progress=False)
    if not cuda.available():
        with pytest.raises(ValueError, match="tune times the layers on this machine's GPU"):
            tuning.tune("lstm", I, H, 3, 7, "host-cuda", names=["narrow_kib"], progress=False)
    tune_gemm = aot.Spec("lstm", I, H, "fwd", "host-cuda").gemm   # (cuBLAS where installed)
    if tune_gemm == "halide":
        with pytest.raises(ValueError, match="step_gemm_mmacs does not act on layers without "
                                             "cublas GEMMs"):
            tuning.tune("lstm", I, H, 3, 7, "host-cuda", names=["step_gemm_mmacs"],
                        progress=False)


def _mgu(x, r, s):
    z = cells.sigmoid(x.z + r.z)
    return {"h": (1 - z) * cells.tanh(x.n + r.n) + z * s.h}


def test_builds_in_children_only_where_a_child_can_build(own_cache, monkeypatch, tmp_path):
    """tune's (and precompile's) builds run in child processes for built-in
    cells and cell files' cells, which a child loads again; a cell that a
    program defined itself is built in the calling process, since a child
    would have to run that program again."""
    cells.register(cells.define("inline_mgu", gates="zn", states="h", step=_mgu))
    path = tmp_path / "filecell.py"
    path.write_text(USER_CELL)
    cells.load_file(path)
    children, in_child = [], aot._build_in_child

    def counted(spec, *args):
        children.append(spec.cell)
        return in_child(spec, *args)
    monkeypatch.setattr(aot, "_build_in_child", counted)
    tuning.build_all([aot.Spec(c, I, H, "fwd") for c in ("inline_mgu", "minimal_gru", "rnn_tanh")])
    assert sorted(children) == ["minimal_gru", "rnn_tanh"]
    for c in ("inline_mgu", "minimal_gru", "rnn_tanh"):
        assert aot.read_entry(aot.cache_dir() / aot.cache_key(aot.Spec(c, I, H, "fwd")))
