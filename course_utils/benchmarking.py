"""Honest measurement: timing with warm-up runs, accelerator synchronisation, the median of repeats, ratios; and the bytes autograd saves."""

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from course_utils import check_mode
from course_utils.device import synchronize

MIN_RUNS = 3  # the fewest timed runs a median is taken of, however slow the call


@dataclass
class Timing:
    """Wall-clock seconds of repeated runs of one callable."""

    name: str
    runs: list[float] = field(repr=False)

    @property
    def median(self) -> float:
        return statistics.median(self.runs)

    def __str__(self) -> str:
        spread = f"{min(self.runs) * 1e3:.3g}-{max(self.runs) * 1e3:.3g}"
        return f"{self.name}: median {self.median * 1e3:.3g} ms over {len(self.runs)} runs (range {spread} ms)"


def benchmark(
    fn: Callable[[], object],
    *,
    name: str = "fn",
    warmup: int = 3,
    repeats: int = 20,
    device: torch.device | str = "cpu",
    max_seconds: float = 5.0,
) -> Timing:
    """Time fn(): `warmup` untimed calls, then `repeats` timed ones, each synchronised on `device`; once `max_seconds`
    have passed, fewer of each, down to one warm-up and three timed runs."""
    if check_mode():
        # The checker needs a number, not a precise one.
        warmup, repeats = min(warmup, 1), min(repeats, 3)
    # A call that takes a second (bfloat16 on a CPU without bfloat16 units) needs no twenty repeats to show it.
    started = time.perf_counter()
    for _ in range(warmup):
        fn()
        if time.perf_counter() - started > max_seconds:
            break
    synchronize(device)
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        # Without this, an accelerator returns before its queued kernels finish.
        synchronize(device)
        runs.append(time.perf_counter() - start)
        if len(runs) >= MIN_RUNS and time.perf_counter() - started > max_seconds:
            break
    return Timing(name, runs)


def speedups(timings: list[Timing], baseline: str | None = None) -> dict[str, float]:
    """How many times faster each timing is than the baseline (the first one by default)."""
    if not timings:
        raise ValueError("speedups() needs at least one Timing")
    base = timings[0] if baseline is None else next((t for t in timings if t.name == baseline), None)
    if base is None:
        raise ValueError(f"no timing named {baseline!r}; names are {[t.name for t in timings]}")
    return {t.name: base.median / t.median for t in timings}


def report(timings: list[Timing], baseline: str | None = None) -> str:
    """A small table: name, median ms, and speed-up against the baseline."""
    ratios = speedups(timings, baseline)
    width = max(len(t.name) for t in timings)
    lines = [f"{'':{width}}  median ms  speed-up"]
    for t in timings:
        lines.append(f"{t.name:{width}}  {t.median * 1e3:9.3f}  {ratios[t.name]:7.2f}x")
    return "\n".join(lines)


def saved_activation_bytes(fn, params=()) -> tuple[torch.Tensor, int]:
    """Run fn(); return its result and the bytes of the distinct tensors autograd saved for backward, parameters excluded."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    storages = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(storages.values())
