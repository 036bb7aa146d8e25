"""halstm.benchmark's timing: interleaved rounds and paired ratios (no kernels)."""
import os
import time

from halstm import benchmark as B


def test_rounds_interleave_in_rotating_order():
    calls = []
    timed = [B._Timed(name, lambda name=name: calls.append(name)) for name in "abc"]
    times, rounds = B._interleaved(timed, min_runs=3, min_seconds=0, max_runs=1)
    # two warm-ups each, then per round one block each (a short run's block starts untimed)
    assert calls[:6] == ["a", "a", "b", "b", "c", "c"]
    assert all(len(t.warmup_ms) == 2 for t in timed)
    blocks = [calls[i:i + 2] for i in range(6, len(calls), 2)]
    assert all(b[0] == b[1] for b in blocks)
    assert [b[0] for b in blocks] == list("abc" "bca" "cab")
    assert [len(t) for t in times] == [3, 3, 3] and [len(r) for r in rounds] == [3, 3, 3]


def test_blocks_fill_block_seconds_and_runs_stop_at_max_runs():
    fast = B._Timed("fast", lambda: None)
    slow = B._Timed("slow", lambda: time.sleep(0.004))
    times, rounds = B._interleaved([fast, slow], min_runs=2, min_seconds=10, max_runs=40,
                                   block_seconds=0.02)
    assert len(rounds[0]) == len(rounds[1]) >= 2
    assert len(times[0]) >= 40                    # the fast one's blocks are full
    assert 1 <= len(times[1]) / len(rounds[1]) <= 5   # about 0.02 s / 4 ms runs a block
    assert min(times[1]) >= 4.0


def test_a_slow_first_call_does_not_shrink_the_blocks():
    state = {"calls": 0}

    def first_call_slow():        # as first calls that set up plans or workspaces
        state["calls"] += 1
        time.sleep(0.05 if state["calls"] <= 2 else 0.001)
    timed = [B._Timed("setup", first_call_slow)]
    times, rounds = B._interleaved(timed, min_runs=2, min_seconds=0, max_runs=100,
                                   block_seconds=0.02)
    assert len(times[0]) / len(rounds[0]) >= 5    # blocks sized by the warm run, ~1 ms
    assert state["calls"] == 3 + len(rounds[0]) + len(times[0])   # 3 warm-ups, untimed starts
    slow1, slow2, warm = timed[0].warmup_ms       # a loaded machine's sleeps overshoot
    assert slow1 >= 49 and slow2 >= 49 and warm < min(slow1, slow2) / 2


def test_a_slow_run_is_timed_after_three_warm_up_calls():
    calls = []
    timed = [B._Timed("slow", lambda: (calls.append(1), time.sleep(0.03)))]
    times, rounds = B._interleaved(timed, min_runs=2, min_seconds=0, max_runs=100,
                                   block_seconds=0.02)
    assert len(calls) == 3 + 2                    # no untimed start for a block of one run
    assert [len(t) for t in times] == [2]


def test_alternating_runs_each_call_once_a_round_between_syncs():
    log = []
    calls = {k: (lambda k=k: (log.append(k), time.sleep(0.002 if k == "slow" else 0)))
             for k in ("fast", "slow")}
    med = B.alternating(calls, rounds=4, warmup=1, sync=lambda: log.append("|"))
    # each call once a round between two syncs, the order rotating
    fast_first, slow_first = ["|", "fast", "|", "|", "slow", "|"], ["|", "slow", "|", "|", "fast", "|"]
    assert log == (fast_first + slow_first) * 2
    assert med["slow"] >= 0.002 > med["fast"]


def test_alternating_takes_the_seconds_self_timed_calls_return():
    log = []
    calls = {k: (lambda k=k, sec=sec: (log.append(k), sec)[1])
             for k, sec in (("a", 1.0), ("b", 3.0))}
    med = B.alternating(calls, rounds=4, warmup=1, sync=None, self_timed=True)
    assert log == ["a", "b", "b", "a"] * 2         # the order rotating, as timed calls'
    assert med == {"a": 1.0, "b": 3.0}


def test_ratio_pairs_rounds():
    def result(impl, rounds):
        return B.Result("s", "lstm", "fwd", impl, sorted(rounds)[1], 1.0, 3, None, None, None,
                        list(rounds), list(rounds))
    peer = result("torch", [2.0, 20.0, 20.0])     # a burst of load in rounds 2 and 3
    ours = result("halstm:cpu", [1.0, 10.0, 10.0])
    assert B._ratio(ours, peer) == 0.5            # the medians' ratio would also be 0.5
    late = result("halstm:cpu", [1.0, 1.0, 10.0])  # the burst hit ours only in round 3
    assert B._ratio(late, peer) == 0.5            # medians: 1.0 / 20.0 = 0.05
    row = B.ratios([peer, late])[1]
    assert row["x_torch"] == 0.5 and "times_ms" not in row


def test_steal_share_from_proc_stat(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 50 800 10 0 5 35 0 0\ncpu0 1 2 3\n")
    before = B._cpu_jiffies(str(stat))
    assert before == (35, 1000, 155)
    stat.write_text("cpu  300 0 50 1000 10 0 5 135 0 0\n")
    after = B._cpu_jiffies(str(stat))
    assert B._steal(before, after) == 100 / 500      # 100 of the 500 jiffies since
    assert B._steal(before, before) is None and B._cpu_jiffies(str(tmp_path / "none")) is None
    hz = os.sysconf("SC_CLK_TCK")                   # 200 busy jiffies, this process 50 of them
    assert B._others(before, after, 0.0, 50 / hz) == 150 / 500
    assert B._others(before, after, 0.0, 400 / hz) == 0.0   # never below zero
