"""halstm tune on a CUDA target: each value checked against the default's
results and timed on the GPU, the winner kept for this GPU and read by
aot.Spec. Runs in a cache of its own, so that no other test builds with a
tuned knob."""
import pytest

from halstm import aot, tuning


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HALSTM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_tune_measures_the_cuda_knobs(own_cache, gpu_target):
    # I=64, H=128, one row: narrow steps from 64 KiB of W_hh (the candidate 64),
    # not from the default 128 KiB nor ever (1 << 20)
    report = tuning.tune("lstm", 64, 128, 1, 20, gpu_target, names=["narrow_kib"], rounds=3,
                         progress=False)
    spec = aot.Spec("lstm", 64, 128, "fwd", gpu_target)
    (layer, entry), = report.items()
    assert layer == tuning.layer_key(spec)
    (step,) = entry["by_knob"]
    assert [t["value"] for t in step["tried"]] == [64, 1 << 20]
    assert all(t["correct"] and t["ms"] > 0 for t in step["tried"])
    if step["kept"] != 128:
        won = next(t for t in step["tried"] if t["value"] == step["kept"])
        assert won["ms"] < (1 - tuning.MIN_GAIN) * step["base_ms"]
        assert aot.Spec("lstm", 64, 128, "fwd", gpu_target).knobs == \
            (("narrow_kib", step["kept"]),)
    assert tuning.machine_key(gpu_target) != tuning.machine_key("host")   # (the GPU's name)
    assert tuning.load()[tuning.machine_key(gpu_target)][layer]["knobs"] == entry["knobs"]


def test_tune_times_a_forward_without_tape_for_the_loop_knob(own_cache, gpu_target):
    """loop_shared_pct acts on forwards without a tape (Knob.infer): tune
    checks and times those. An RNN at H = 64 (16 KiB of W_hh) runs every
    step in one kernel by default; at 1% it runs the steps."""
    report = tuning.tune("rnn_tanh", 32, 64, 4, 20, gpu_target, names=["loop_shared_pct"],
                         rounds=3, progress=False)
    (step,) = report[tuning.layer_key(aot.Spec("rnn_tanh", 32, 64, "fwd", gpu_target))]["by_knob"]
    assert step["infer"] and [t["value"] for t in step["tried"]] == [1, 50, 150]
    assert all(t["correct"] and t["ms"] > 0 for t in step["tried"])
    assert any("loop_shared_pct, from defaults (" in line and "without a tape" in line
               for line in tuning.report_lines(gpu_target))
