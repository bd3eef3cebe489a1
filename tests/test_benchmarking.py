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
