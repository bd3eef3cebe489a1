"""Seeding and deterministic mode, so that a notebook prints the same numbers on every run."""

import os
import random
from contextlib import contextmanager
from typing import Iterator

import numpy as np
import torch


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
