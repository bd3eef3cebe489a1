"""Seeding and deterministic mode, so that a notebook prints the same numbers on every run."""

import os
import platform
import random
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np
import torch


# The solution copies' saved outputs are compared digit for digit (`make test` runs strict nbval).
# torch, Inductor, MKL and oneDNN choose their CPU kernels from the processor's instructions when they
# load, so a machine with AVX-512 adds floats in another order than one with AVX2 only, and a chaotic
# demo (a long training run) prints other last digits. The course's own strict runs (`make test`,
# `build --execute`) therefore pin all four to AVX2, which every x86-64 processor of the last decade has.
SAME_KERNELS = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def same_kernels_env() -> dict[str, str]:
    """Environment that pins torch's, Inductor's, MKL's and oneDNN's CPU kernels to AVX2; empty where that cannot apply."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return {}
    if os.environ.get("ATEN_CPU_CAPABILITY") not in (None, "avx2"):
        return {}  # the caller chose other kernels on purpose
    try:
        flags = Path("/proc/cpuinfo").read_text().split()  # read, not asked of torch: the caller may not import it
    except OSError:
        return {}  # not Linux
    return dict(SAME_KERNELS) if "avx2" in flags else {}  # an x86-64 without AVX2 would be asked for what it lacks


def seed_everything(seed: int = 0) -> torch.Generator:
    """Seed Python, NumPy and torch (every device); return a torch.Generator seeded the same."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA / MPS device
    return torch.Generator().manual_seed(seed)


def set_deterministic(enabled: bool = True) -> None:
    """Make torch refuse or replace nondeterministic kernels (slower, but bit-for-bit repeatable)."""
    if enabled:
        # cuBLAS needs a fixed workspace to be deterministic; harmless on the CPU.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(enabled)
    torch.backends.cudnn.deterministic = enabled
    torch.backends.cudnn.benchmark = False  # autotuning picks kernels by timing: never repeatable


@contextmanager
def deterministic(enabled: bool = True) -> Iterator[None]:
    """Context manager form of set_deterministic that restores the previous setting."""
    previous = (
        torch.are_deterministic_algorithms_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    set_deterministic(enabled)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous[0])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = previous[1:]
