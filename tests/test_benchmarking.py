"""course_utils.benchmarking: warm-up, repeats, medians and speed-ups; the bytes autograd saves."""

import pytest
import torch
from torch import nn

from course_utils import benchmarking
from course_utils.benchmarking import Timing, benchmark, report, saved_activation_bytes, speedups


@pytest.fixture(autouse=True)
def not_check_mode(monkeypatch):
    monkeypatch.delenv("COURSE_CHECK_MODE", raising=False)


def _counter():
    calls = []
    return calls, lambda: calls.append(1)


def test_benchmark_runs_warmup_plus_repeats():
    calls, fn = _counter()
    timing = benchmark(fn, name="noop", warmup=4, repeats=7)
    assert len(calls) == 11
    assert len(timing.runs) == 7
    assert timing.name == "noop"


def test_median_of_fake_clock(monkeypatch):
    """With a fake clock each call takes a known time: the median must be the middle one."""
    durations = iter([0.005, 0.001, 0.003, 0.100, 0.002])
    now = [0.0]

    def fake_counter():
        return now[0]

    def fn():
        now[0] += next(durations)

    monkeypatch.setattr(benchmarking.time, "perf_counter", fake_counter)
    timing = benchmark(fn, warmup=0, repeats=5)
    assert timing.runs == pytest.approx([0.005, 0.001, 0.003, 0.100, 0.002])
    assert timing.median == pytest.approx(0.003)


def _slow_calls(monkeypatch, seconds: float):
    """A fake clock on which each call of the returned fn takes `seconds`; and the list of its calls."""
    now, calls = [0.0], []
    monkeypatch.setattr(benchmarking.time, "perf_counter", lambda: now[0])

    def fn():
        calls.append(1)
        now[0] += seconds

    return calls, fn


def test_a_slow_call_stops_once_the_time_is_spent(monkeypatch):
    calls, fn = _slow_calls(monkeypatch, 2.0)
    timing = benchmark(fn, warmup=3, repeats=15, max_seconds=5.0)
    # warm-ups at 2 and 4 s, the third ends at 6 s (past 5): then the three timed runs a median needs
    assert len(timing.runs) == benchmarking.MIN_RUNS and len(calls) == 3 + benchmarking.MIN_RUNS
    assert timing.median == pytest.approx(2.0)


def test_a_call_slower_than_the_budget_gets_one_warm_up(monkeypatch):
    calls, fn = _slow_calls(monkeypatch, 7.0)
    timing = benchmark(fn, warmup=3, repeats=15, max_seconds=5.0)
    assert len(calls) == 1 + benchmarking.MIN_RUNS and len(timing.runs) == benchmarking.MIN_RUNS


def test_within_the_budget_every_repeat_runs(monkeypatch):
    calls, fn = _slow_calls(monkeypatch, 0.125)  # exact in binary: no rounding at the budget's edge
    timing = benchmark(fn, warmup=3, repeats=30, max_seconds=5.0)
    assert len(calls) == 33 and len(timing.runs) == 30  # 4.125 s
    calls, fn = _slow_calls(monkeypatch, 0.125)
    assert len(benchmark(fn, warmup=3, repeats=60, max_seconds=5.0).runs) == 38  # 5.0 s after 37 runs is not past it


def test_check_mode_shrinks_repeats(monkeypatch):
    monkeypatch.setenv("COURSE_CHECK_MODE", "1")
    calls, fn = _counter()
    timing = benchmark(fn, warmup=5, repeats=50)
    assert len(timing.runs) <= 3
    assert len(calls) <= 4


def test_check_mode_off_for_other_values(monkeypatch):
    monkeypatch.setenv("COURSE_CHECK_MODE", "0")
    calls, fn = _counter()
    assert len(benchmark(fn, warmup=0, repeats=10).runs) == 10


def test_timing_median_and_str():
    t = Timing("slow", [0.010, 0.030, 0.020])
    assert t.median == pytest.approx(0.020)
    assert str(t) == "slow: median 20 ms over 3 runs (range 10-30 ms)"


def test_speedups_against_first_by_default():
    timings = [Timing("loop", [0.4]), Timing("vector", [0.1]), Timing("half", [0.2])]
    assert speedups(timings) == pytest.approx({"loop": 1.0, "vector": 4.0, "half": 2.0})


def test_speedups_against_named_baseline():
    timings = [Timing("loop", [0.4]), Timing("vector", [0.1])]
    assert speedups(timings, baseline="vector") == pytest.approx({"loop": 0.25, "vector": 1.0})


def test_speedups_needs_timings():
    with pytest.raises(ValueError, match="at least one Timing"):
        speedups([])


def test_speedups_unknown_baseline_is_a_clear_error():
    with pytest.raises(ValueError, match="nope"):
        speedups([Timing("loop", [0.4])], baseline="nope")


def test_report_lists_names_and_ratios():
    text = report([Timing("loop", [0.4]), Timing("vector", [0.1])])
    lines = text.splitlines()
    assert len(lines) == 3
    assert "median ms" in lines[0]
    assert lines[1].split()[0] == "loop" and lines[1].endswith("1.00x")
    assert lines[2].split()[0] == "vector" and lines[2].endswith("4.00x")
    assert "400.000" in lines[1] and "100.000" in lines[2]


def test_saved_activation_bytes_counts_distinct_storages_without_parameters():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8, bias=False), nn.ReLU(), nn.Linear(8, 2, bias=False))
    x = torch.randn(5, 4)
    _, nbytes = saved_activation_bytes(lambda: net(x), net.parameters())
    # Linear 1 saves x (5x4); ReLU saves its result (5x8), which Linear 2 saves too: one storage.
    assert nbytes == (5 * 4 + 5 * 8) * 4
