"""course_utils.reproducibility: seeding and deterministic mode."""

import os
import platform
import random
import subprocess
import sys
from pathlib import Path

import nbformat
import numpy as np
import pytest
import torch

from course_utils import reproducibility
from course_utils.reproducibility import deterministic, seed_everything, set_deterministic


@pytest.fixture(autouse=True)
def restore_torch_flags():
    """Start from torch's defaults and leave the global flags as they were found."""
    saved = torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = False, False
    yield
    torch.use_deterministic_algorithms(saved[0])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[1:]


def _draws():
    return torch.randn(5), np.random.rand(5), [random.random() for _ in range(5)]


def test_seed_everything_repeats_every_generator():
    seed_everything(123)
    first = _draws()
    seed_everything(123)
    second = _draws()
    assert torch.equal(first[0], second[0])
    assert np.array_equal(first[1], second[1])
    assert first[2] == second[2]


def test_different_seeds_differ():
    seed_everything(1)
    first = _draws()
    seed_everything(2)
    second = _draws()
    assert not torch.equal(first[0], second[0])
    assert not np.array_equal(first[1], second[1])
    assert first[2] != second[2]


def test_returned_generator_is_reproducible():
    a = torch.randn(4, generator=seed_everything(7))
    b = torch.randn(4, generator=seed_everything(7))
    assert torch.equal(a, b)
    assert torch.equal(a, torch.randn(4, generator=torch.Generator().manual_seed(7)))


def test_returned_generator_is_independent_of_global_stream():
    """Drawing from the global RNG must not move the returned generator."""
    gen = seed_everything(7)
    torch.randn(100)
    assert torch.equal(torch.randn(4, generator=gen), torch.randn(4, generator=torch.Generator().manual_seed(7)))


def test_deterministic_context_enables_and_restores():
    before = torch.are_deterministic_algorithms_enabled()
    assert before is False
    with deterministic():
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.backends.cudnn.deterministic is True
        assert torch.backends.cudnn.benchmark is False
    assert torch.are_deterministic_algorithms_enabled() is before


def test_deterministic_context_restores_after_an_error():
    try:
        with deterministic():
            raise KeyError("boom")
    except KeyError:
        pass
    assert torch.are_deterministic_algorithms_enabled() is False


def test_deterministic_context_restores_cudnn_flags():
    old = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = False, True
    try:
        with deterministic():
            pass
        assert (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark) == (False, True)
    finally:
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = old


def test_set_deterministic_sets_cublas_workspace(monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "placeholder")  # so that monkeypatch restores it afterwards
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    set_deterministic(True)
    assert torch.are_deterministic_algorithms_enabled()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    set_deterministic(False)
    assert not torch.are_deterministic_algorithms_enabled()


def test_set_deterministic_keeps_a_user_cublas_setting(monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    set_deterministic(True)
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


def test_same_kernels_env_pins_the_cpu_kernels_on_x86_with_avx2(monkeypatch):
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    env = reproducibility.same_kernels_env()
    if platform.machine().lower() in ("x86_64", "amd64") and "avx2" in Path("/proc/cpuinfo").read_text().split():
        assert env == {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    else:
        assert env == {}


def test_same_kernels_env_leaves_a_chosen_capability_alone(monkeypatch):
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    assert reproducibility.same_kernels_env() == {}


def test_a_strict_nbval_kernel_runs_on_the_pinned_kernels(tmp_path):
    """Under --nbval (outputs compared) the kernels get the pinning; torch then reports AVX2 as its capability."""
    if not reproducibility.same_kernels_env():
        pytest.skip("not an x86-64 machine with AVX2")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "import os, torch\nprint(os.environ['MKL_CBWR'], torch.backends.cpu.get_cpu_capability())",
        execution_count=1, outputs=[nbformat.v4.new_output("stream", name="stdout", text="AVX2 AVX2\n")])])
    path = tmp_path / "pinned.ipynb"
    nbformat.write(nb, path)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval", "--nbval-current-env", str(path)],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-2000:]
