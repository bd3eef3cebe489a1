"""course_utils.device: which device a lesson runs on, and how it says so."""

import pytest
import torch

from course_utils import device

needs_no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")


@pytest.fixture(autouse=True)
def no_forced_device(monkeypatch):
    """Start every test with COURSE_DEVICE unset, whatever the shell says."""
    monkeypatch.delenv(device.ENV_VAR, raising=False)


@needs_no_gpu
def test_pick_device_is_cpu_without_accelerator():
    assert device.pick_device() == torch.device("cpu")


def test_env_var_forces_cpu(monkeypatch):
    monkeypatch.setenv(device.ENV_VAR, "cpu")
    assert device.pick_device() == torch.device("cpu")


def test_override_argument_forces_cpu():
    assert device.pick_device("cpu").type == "cpu"


def test_unknown_device_type_raises_value_error(monkeypatch):
    """torch.device("tpu") raises a RuntimeError of its own; the course turns it into a ValueError."""
    monkeypatch.setenv(device.ENV_VAR, "tpu")
    with pytest.raises(ValueError, match=r"COURSE_DEVICE='tpu': expected one of cpu, cuda"):
        device.pick_device()


def test_unknown_device_type_in_cuda_available_is_value_error(monkeypatch):
    monkeypatch.setenv(device.ENV_VAR, "tpu")
    with pytest.raises(ValueError, match="COURSE_DEVICE='tpu'"):
        device.cuda_available()


def test_known_but_unsupported_type_raises_value_error(monkeypatch):
    """A device string torch parses but the course does not know (meta) is a ValueError naming the variable."""
    monkeypatch.setenv(device.ENV_VAR, "meta")
    with pytest.raises(ValueError, match="COURSE_DEVICE='meta'"):
        device.pick_device()


@needs_no_gpu
def test_forcing_cuda_without_gpu_raises(monkeypatch):
    monkeypatch.setenv(device.ENV_VAR, "cuda")
    with pytest.raises(RuntimeError, match="no cuda device"):
        device.pick_device()


@needs_no_gpu
def test_describe_auto_detected_is_one_line():
    text = device.describe()
    assert "\n" not in text
    assert "cpu" in text
    assert "auto-detected" in text
    assert "forced by" not in text


def test_describe_forced_is_one_line(monkeypatch):
    monkeypatch.setenv(device.ENV_VAR, "cpu")
    text = device.describe()
    assert "\n" not in text
    assert text.startswith("Using cpu")
    assert "forced by COURSE_DEVICE" in text


@needs_no_gpu
def test_cuda_available_false_here():
    assert device.cuda_available() is False


def test_cuda_available_false_when_forced_to_cpu(monkeypatch):
    monkeypatch.setenv(device.ENV_VAR, "cpu")
    assert device.cuda_available() is False


@needs_no_gpu
def test_bare_current_accelerator_is_not_trusted():
    """A CUDA build may *report* cuda with no GPU; only check_available=True tells the truth."""
    bare = torch.accelerator.current_accelerator()
    checked = torch.accelerator.current_accelerator(check_available=True)
    if torch.version.cuda:
        assert bare is not None and bare.type == "cuda"
    assert checked is None or checked.type != "cuda"
    assert device.pick_device().type != "cuda"


def test_synchronize_on_cpu_is_a_no_op():
    assert device.synchronize("cpu") is None
