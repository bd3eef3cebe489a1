"""Pick the device a lesson runs on: cuda, mps or cpu, overridable by COURSE_DEVICE."""

import os

import torch

ENV_VAR = "COURSE_DEVICE"
KNOWN = ("cpu", "cuda", "mps", "xpu")


def pick_device(override: str | None = None) -> torch.device:
    """Return the accelerator if one is really available, else the CPU.

    `override` (or the COURSE_DEVICE environment variable) forces a choice, e.g. "cpu".
    """
    name = override or os.environ.get(ENV_VAR, "").strip()
    if name:
        device = _parse(name)
        if device.type not in KNOWN:
            raise ValueError(f"{ENV_VAR}={name!r}: expected one of {', '.join(KNOWN)}")
        if device.type != "cpu" and not _type_available(device.type):
            raise RuntimeError(f"{ENV_VAR}={name!r} but torch finds no {device.type} device here")
        return device
    # check_available=True matters: a CUDA build of torch on a machine with no GPU
    # still *reports* cuda as its accelerator when asked without it.
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    return accelerator if accelerator is not None else torch.device("cpu")


def _parse(name: str) -> torch.device:
    # torch.device("tpu") raises a RuntimeError listing 20 backends; say what to set instead.
    try:
        return torch.device(name)
    except RuntimeError:
        raise ValueError(f"{ENV_VAR}={name!r}: expected one of {', '.join(KNOWN)}") from None


def _type_available(device_type: str) -> bool:
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    return accelerator is not None and accelerator.type == device_type


def cuda_available() -> bool:
    """True when a CUDA GPU can be used and COURSE_DEVICE does not force another device."""
    forced = os.environ.get(ENV_VAR, "").strip()
    if forced and _parse(forced).type != "cuda":
        return False
    return torch.cuda.is_available()


def describe(device: torch.device | str | None = None) -> str:
    """One line saying which device was picked and why."""
    device = torch.device(device) if device is not None else pick_device()
    how = f"forced by {ENV_VAR}" if os.environ.get(ENV_VAR, "").strip() else "auto-detected"
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        detail = f"{props.name}, {props.total_memory / 2**30:.0f} GiB"
    elif device.type == "cpu":
        built = "CUDA build of torch" if torch.version.cuda else "CPU build of torch"
        detail = f"{torch.get_num_threads()} threads, no accelerator in use, {built}"
    else:
        detail = device.type
    return f"Using {device} ({detail}; {how})"


def synchronize(device: torch.device | str | None = None) -> None:
    """Wait for queued accelerator work to finish, so that a timer measures it; no-op on the CPU."""
    device = torch.device(device) if device is not None else pick_device()
    if device.type != "cpu":
        torch.accelerator.synchronize(device)
