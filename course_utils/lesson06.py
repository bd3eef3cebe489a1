"""Lesson 06 (mixed precision): reference solutions, the checks for its exercises, and the memory demo's helpers."""

import copy
import functools
import math
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from course_utils.tooling.checks import (
    ExerciseFailed,
    call,
    exercise,
    expect_equal,
    expect_tensor,
    scoreboard_for,
    type_name,
)

scoreboard = scoreboard_for(__name__)  # the lesson's last cell: this session's verdicts

HALF_DTYPES = (torch.bfloat16, torch.float16)


# Reference solutions. The checks compare the learner's answers with these.

def fits_in_range(x: torch.Tensor, dtype: torch.dtype) -> bool:
    """True when casting x to the float dtype overflows nothing: every |value| <= torch.finfo(dtype).max."""
    return bool(x.abs().max() <= torch.finfo(dtype).max)


def run_in_float32(fn: Callable, *args: Any) -> Any:
    """fn(*args) computed in float32 inside any autocast region: autocast off, 16-bit float tensors cast to float32."""
    device_type = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")
    cast = [a.float() if isinstance(a, torch.Tensor) and a.dtype in HALF_DTYPES else a for a in args]
    with torch.autocast(device_type=device_type, enabled=False):
        return fn(*cast)


def loss_scale_schedule(found_inf: list[bool], init_scale: float, growth_interval: int) -> list[float]:
    """The GradScaler scale after each step's update(): halve on inf/NaN, double after growth_interval good steps in a row."""
    scale, good_steps, scales = init_scale, 0, []
    for inf in found_inf:
        if inf:
            scale *= 0.5          # backoff_factor
            good_steps = 0
        else:
            good_steps += 1
            if good_steps == growth_interval:
                scale *= 2.0      # growth_factor
                good_steps = 0
        scales.append(scale)
    return scales


def amp_step(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, loss_fn: Callable,
             optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, dtype: torch.dtype, max_norm: float) -> bool:
    """One training step in float32, bfloat16 or float16, clipped, skipped on inf/NaN; True when the weights were updated."""
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast(device_type=inputs.device.type, dtype=dtype, enabled=dtype != torch.float32):
        loss = loss_fn(model(inputs), targets)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)                  # the real gradients from here on; a no-op when the scaler is disabled
    norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    finite = bool(torch.isfinite(norm))         # the norm is inf or NaN exactly when some gradient is
    if finite:
        scaler.step(optimizer)
    scaler.update()                             # with float16, a skipped step still halves the scale
    return finite


def save_amp_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                        scaler: torch.amp.GradScaler, step: int) -> None:
    """Save model, optimizer and scaler state and the step number, in a file torch.load(weights_only=True) reads."""
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scaler": scaler.state_dict(), "step": step}, path)


def resume_amp(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler) -> int:
    """Load a save_amp_checkpoint() file into the given model, optimizer and scaler; return its step number."""
    checkpoint = torch.load(path, weights_only=True)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    scaler.load_state_dict(checkpoint["scaler"])  # a no-op for a disabled scaler
    return checkpoint["step"]


# Helpers of the memory demo (section 4). Hooks are lesson 08's subject; here they only measure.

def saved_tensors(model: nn.Sequential, x: torch.Tensor) -> list[dict]:
    """One row per tensor autograd saves during model(x): the layer that saved it, its shape, size and storage."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    rows, seen, current = [], set(), {}
    handles = [layer.register_forward_pre_hook(lambda m, args, i=i: current.update(layer=f"{i} {type(m).__name__}"))
               for i, layer in enumerate(model)]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key = tensor.untyped_storage().data_ptr()
        kind = "parameter" if key in parameters else ("again" if key in seen else "new")
        rows.append({"saved by": current["layer"], "shape": tuple(tensor.shape), "dtype": str(tensor.dtype).replace("torch.", ""),
                     "KiB": tensor.untyped_storage().nbytes() // 1024, "storage": kind})
        seen.add(key)
        return tensor

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            model(x)
    finally:
        for handle in handles:
            handle.remove()
    return rows


# Shared helpers of the checks.

def _restores_autocast(fn: Callable) -> Callable:
    """Run fn on one thread and leave CPU autocast and the thread count as they were (@exercise leaves the RNG alone)."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        enabled, dtype, threads = torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), torch.get_num_threads()
        torch.set_num_threads(1)  # the checks' tensors are tiny: on a busy machine, waking threads costs more than the math
        try:
            return fn(*args, **kwargs)
        finally:
            torch.set_autocast_enabled("cpu", enabled)
            torch.set_autocast_dtype("cpu", dtype)
            torch.set_num_threads(threads)
    return run


def _kind(value) -> str:
    kind = type(value)
    return kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__.split('.')[0]}.{kind.__qualname__}"


def _short(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _same_tree(a: Any, b: Any, atol: float = 0.0) -> bool:
    """Equal nested dicts/lists/tuples of tensors and plain values (tensors compared by value, NaN equal to NaN)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.shape != b.shape or a.dtype != b.dtype:
            return False
        return bool(torch.allclose(a, b, atol=atol, rtol=0.0, equal_nan=True)) if a.is_floating_point() else bool(torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_tree(a[k], b[k], atol) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_tree(x, y, atol) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _first_difference(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], atol: float) -> str | None:
    return next((k for k in expected if not torch.allclose(got[k], expected[k], atol=atol, rtol=0.0, equal_nan=True)), None)


# Checks, one per exercise, in notebook order.

_RANGE_CASES = [
    (torch.tensor([0.5, -3.0, 1e-3]), torch.float16),
    (torch.tensor([1e-4, -2e-4]), torch.float16),
    (torch.tensor([1.0, -70000.0]), torch.float16),
    (torch.tensor([65504.0, -2.0]), torch.float16),
    (torch.tensor([-1e-30, 2e-8, 7.0]), torch.float16),
    (torch.tensor([70000.0, -1e30]), torch.bfloat16),
    (torch.tensor([3e38], dtype=torch.float64), torch.bfloat16),
    (torch.tensor([1e39, 1.0], dtype=torch.float64), torch.float32),
    (torch.tensor([-1e39], dtype=torch.float64), torch.float32),
]

_RANGE_MISTAKES = [  # (wrong rule, what it gets wrong)
    (lambda x, d: bool(x.abs().max() <= torch.finfo(d).eps),
     "you compared with torch.finfo(dtype).eps, the gap between 1.0 and the next number; the largest finite value is torch.finfo(dtype).max"),
    (lambda x, d: bool(x.abs().max() <= torch.finfo(d).tiny),
     "you compared with torch.finfo(dtype).tiny, the smallest normal number; the largest finite value is torch.finfo(dtype).max"),
    (lambda x, d: bool(x.max() <= torch.finfo(d).max),
     "a large negative value overflows too: compare the magnitude, x.abs().max(), with torch.finfo(dtype).max"),
    (lambda x, d: bool(x.abs().max() < torch.finfo(d).max),
     "torch.finfo(dtype).max itself fits: use <=, not <"),
    (lambda x, d: bool(x.abs().max() <= 65504),
     "65504 is float16's limit only: read the limit of the dtype you were given from torch.finfo(dtype).max"),
    (lambda x, d: bool((x.abs().max() <= torch.finfo(d).max) & (x.abs().min() >= torch.finfo(d).tiny)),
     "values below finfo(dtype).tiny do not overflow (they round to a subnormal or to 0): only the largest magnitude decides here"),
]


@exercise("fits_in_range")
@_restores_autocast
def check_fits_in_range(fn) -> None:
    answers = []
    for x, dtype in _RANGE_CASES:
        what = f"fits_in_range(torch.tensor({x.tolist()}), {dtype})"
        got = call(fn, x.clone(), dtype, shown=f"torch.tensor({x.tolist()}), {dtype}")
        if isinstance(got, torch.Tensor):
            raise ExerciseFailed(f"{what} is a tensor, expected a Python bool: wrap the comparison in bool(...) or call .item()")
        if isinstance(got, (np.generic, np.ndarray)):
            raise ExerciseFailed(f"{what} is a {type_name(got)}, expected a Python bool: wrap it in bool(...)")
        if not isinstance(got, bool):
            expect_equal(got, fits_in_range(x.clone(), dtype), what=what)
        answers.append(got)
    expected = [fits_in_range(x, d) for x, d in _RANGE_CASES]
    if answers == expected:
        return
    for rule, message in _RANGE_MISTAKES:
        if answers == [rule(x, d) for x, d in _RANGE_CASES]:
            raise ExerciseFailed(message)
    (x, dtype), got, want = next((case, a, e) for case, a, e in zip(_RANGE_CASES, answers, expected) if a != e)
    expect_equal(got, want, what=f"fits_in_range(torch.tensor({x.tolist()}), {dtype})")


# run_in_float32: the check hands the learner's function a probe of its own as fn. The probe records the autocast
# state and the arguments it receives, then computes squared distances the way that needs float32: through the
# expansion |a|^2 + |b|^2 - 2 a.b, whose matmul autocast would run in 16 bits and whose subtraction cancels.

class _ProbeError(Exception):
    """What the raising probe raises: the learner's function must let it through."""


class _Probe:
    """An fn for run_in_float32: records what it receives, returns distances picked by an index tensor, times a number."""

    def __init__(self, raises: bool = False):
        self.raises = raises
        self.calls: list[dict] = []

    def __call__(self, *args):
        self.calls.append({
            "autocast": torch.is_autocast_enabled("cpu"),
            "kinds": [_expected_kind(a, cast=False) for a in args],
        })
        if self.raises:
            raise _ProbeError("fn raised (as the check's fn does on purpose)")
        if len(args) != 4:
            raise TypeError(f"fn takes 4 arguments (a, b, index, weight), got {len(args)}")
        a, b, index, weight = args
        common = torch.promote_types(a.dtype, b.dtype)   # the probe runs on whatever it is given, never raises a dtype error
        a, b = a.to(common), b.to(common)
        squared = (a * a).sum(dim=1, keepdim=True) + (b * b).sum(dim=1) - 2 * (a @ b.T)
        return weight * squared.gather(1, index.long())  # index.long(): the probe still runs if index arrives cast


def _distance_case(seed: int, a_dtype: torch.dtype, b_dtype: torch.dtype, n: int = 5, m: int = 4, d: int = 24):
    g = torch.Generator().manual_seed(seed)
    centre = torch.randn(1, d, generator=g) * 40          # far from 0, close together: the expansion cancels badly
    a = (centre + 0.05 * torch.randn(n, d, generator=g)).to(a_dtype).requires_grad_()
    b = (centre + 0.05 * torch.randn(m, d, generator=g)).to(b_dtype)
    index = torch.randint(0, m, (n, 2), generator=g)
    return a, b, index, 0.5


def _expected_distances(a: torch.Tensor, b: torch.Tensor, index: torch.Tensor, weight: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The probe's result computed in float32 (float64 stays float64) with autocast off, and its gradient for a."""
    a = a.detach().clone().requires_grad_()
    with torch.autocast("cpu", enabled=False):
        probe = _Probe()
        out = probe(*[t.float() if isinstance(t, torch.Tensor) and t.dtype in HALF_DTYPES else t for t in (a, b, index, weight)])
    (grad,) = torch.autograd.grad(out.sum(), a)
    return out.detach(), grad


# (autocast dtype of the caller or None, dtype of a, dtype of b): every kind of argument the prompt names.
_F32_CASES = [
    (torch.bfloat16, torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16, torch.float32),
    (None, torch.bfloat16, torch.float64),
    (torch.bfloat16, torch.float64, torch.float64),
]


def _expected_kind(value: Any, cast: bool = True) -> Any:
    """What fn should receive for an argument: a tensor's dtype (16-bit floats as float32 when cast), a number itself."""
    if isinstance(value, torch.Tensor):
        return torch.float32 if cast and value.dtype in HALF_DTYPES else value.dtype
    if type(value) in (int, float):
        return value
    return f"a {type_name(value)}"  # a string: compares safely with anything


def _kind_name(kind: Any) -> str:
    return _short(kind) if isinstance(kind, torch.dtype) else kind if isinstance(kind, str) else repr(kind)


@exercise("run_in_float32")
@_restores_autocast
def check_run_in_float32(fn) -> None:
    for seed, (caller, a_dtype, b_dtype) in enumerate(_F32_CASES, start=61):
        a, b, index, weight = _distance_case(seed, a_dtype, b_dtype)
        region = f"inside torch.autocast('cpu', dtype={caller})" if caller else "outside autocast"
        shown = f"fn, a ({_short(a_dtype)}), b ({_short(b_dtype)}), index (int64), {weight}"
        what = f"run_in_float32({shown}) {region}"
        probe = _Probe()
        with torch.autocast("cpu", dtype=caller or torch.bfloat16, enabled=caller is not None), \
                warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = call(fn, probe, a, b, index, weight, name="run_in_float32", shown=shown)
            still_on, dtype_after = torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")
        if any("target dtype is not supported" in str(w.message) for w in caught):
            raise ExerciseFailed(f"{what}: torch.autocast(..., dtype=torch.float32) warned and switched itself off: "
                                 "switch autocast off with enabled=False instead")
        if not probe.calls:
            raise ExerciseFailed(f"{what}: fn was never called: call fn on the (cast) arguments and return its result")
        if len(probe.calls) > 1:
            raise ExerciseFailed(f"{what}: fn was called {len(probe.calls)} times: call it once")
        seen = probe.calls[0]
        expected_kinds = [_expected_kind(v) for v in (a, b, index, weight)]
        if caller and seen["autocast"]:
            if seen["kinds"] == expected_kinds:
                raise ExerciseFailed(
                    f"{what}: autocast was still on while fn ran, so its matmul ran in {_short(caller)} although you passed float32 "
                    "tensors: ops on autocast's lower-precision list are cast whatever their inputs; switch autocast off around fn "
                    "for the tensors' device type"
                )
            raise ExerciseFailed(f"{what}: autocast was still on while fn ran: switch it off around fn, for the tensors' device type")
        for name, kind, want in zip(("a", "b", "index", "weight"), seen["kinds"], expected_kinds):
            if kind == want:
                continue
            if want == torch.float32 and kind in HALF_DTYPES:
                raise ExerciseFailed(
                    f"{what}: fn received {name} as {_short(kind)}: with autocast off each op runs in its inputs' dtype, "
                    f"so cast the 16-bit tensors to float32"
                )
            if isinstance(want, torch.dtype) and isinstance(kind, torch.dtype):
                raise ExerciseFailed(
                    f"{what}: fn received {name} ({_short(want)} in the call) as {_short(kind)}: cast only bfloat16 and float16 "
                    "tensors to float32, and leave every other tensor as it is"
                )
            raise ExerciseFailed(f"{what}: fn received {name} as {_kind_name(kind)}, expected {_kind_name(want)}: pass it on unchanged")
        if caller and not still_on:
            raise ExerciseFailed(f"{what}: autocast was off after your function returned: switch it off for fn only, e.g. with a `with` block")
        if caller and dtype_after != caller:
            raise ExerciseFailed(f"{what}: autocast's dtype was {_short(dtype_after)} after your function returned, "
                                 f"expected {_short(caller)} as before: leave the caller's autocast as it was")
        if not caller and still_on:
            raise ExerciseFailed(f"{what}: autocast was on after your function returned, though it was off before: leave it as it was")
        expected, expected_grad = _expected_distances(a, b, index, weight)
        expect_tensor(got, expected, what=what, atol=1e-5, rtol=1e-6)
        if not got.requires_grad:
            raise ExerciseFailed(f"{what}: the result does not require grad, so no gradient reaches a: cast with .float() or "
                                 ".to(torch.float32), which autograd records, and do not detach")
        (grad,) = torch.autograd.grad(got.sum(), a, allow_unused=True)
        if grad is None:
            raise ExerciseFailed(f"{what}: no gradient reaches the caller's tensor a: do not detach it")
        expect_tensor(grad, expected_grad.to(a.dtype), what=f"the gradient of a after {what}", atol=1e-2, rtol=1e-2)
    # fn raises: the error reaches the caller, and autocast is as it was.
    probe = _Probe(raises=True)

    def raise_through(*args):
        try:
            fn(*args)
        except _ProbeError:
            return "raised"
        return "returned"

    a, b, index, weight = _distance_case(70, torch.bfloat16, torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outcome = call(raise_through, probe, a, b, index, weight, name="run_in_float32",
                       shown="an fn that raises, a, b, index, 0.5")
        still_on = torch.is_autocast_enabled("cpu")
    if outcome == "returned":
        raise ExerciseFailed("when fn raised, your function returned normally: let fn's error reach your caller")
    if not still_on:
        raise ExerciseFailed("when fn raised, autocast stayed switched off in the caller: "
                             "restore it even on an error (a `with torch.autocast(...)` block does)")


def _gradscaler_scales(found_inf: list[bool], init_scale: float, growth_interval: int) -> list[float]:
    """Ask torch's own GradScaler: the scale after each update(), with an inf injected where found_inf says."""
    p = nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([p], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
    scales = []
    for inf in found_inf:
        optimizer.zero_grad()
        scaler.scale(p.sum()).backward()
        if inf:
            p.grad.fill_(float("inf"))
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


def _schedule_variant(found_inf, init_scale, growth_interval, *, reset_on_inf=True, off_by_one=False, reset_on_growth=True, before=False):
    scale, good, scales = init_scale, 0, []
    for inf in found_inf:
        if before:
            scales.append(scale)
        if inf:
            scale *= 0.5
            if reset_on_inf:
                good = 0
        else:
            good += 1
            if (good > growth_interval) if off_by_one else (good >= growth_interval):
                scale *= 2.0
                if reset_on_growth:
                    good = 0
        if not before:
            scales.append(scale)
    return scales


_SCHEDULE_CASES = [
    ([False, False, False, True, False, False, True, True, False], 8.0, 2),
    ([False] * 7, 1024.0, 3),
    ([True, True, False, False, False, False, False], 65536.0, 2),
    ([False, True, False, True, False, False, False, True, False, False, False], 4.0, 3),
    ([False, False, False, False], 16.0, 1),
    ([True], 2.0, 5),
    ([True, True, False, True], 2.0, 3),
    ([], 512.0, 2),
]

_SCHEDULE_MISTAKES = [
    ({"reset_on_inf": False}, "after an inf/NaN step the count of good steps starts again from 0"),
    ({"off_by_one": True}, "the scale doubles on the growth_interval-th good step in a row, not on the one after it"),
    ({"reset_on_growth": False}, "after the scale doubles, the count of good steps starts again from 0"),
    ({"before": True}, "return the scale after each step's update(), not the scale the step used"),
]


@exercise("loss_scale_schedule")
@_restores_autocast
def check_loss_scale_schedule(fn) -> None:
    for found_inf, init_scale, growth_interval in _SCHEDULE_CASES:
        what = f"loss_scale_schedule({found_inf}, init_scale={init_scale:g}, growth_interval={growth_interval})"
        got = call(fn, list(found_inf), init_scale, growth_interval)
        if got is None:
            raise ExerciseFailed(f"{what} is None: did you forget to `return` the list?")
        if isinstance(got, torch.Tensor):
            got = got.tolist()
        if not isinstance(got, (list, tuple)):
            raise ExerciseFailed(f"{what} is a {_kind(got)}, expected a list of floats, one per step")
        expected = _gradscaler_scales(found_inf, init_scale, growth_interval)
        if len(got) != len(expected):
            raise ExerciseFailed(f"{what} has {len(got)} values, expected {len(expected)}: one scale per step")
        if list(got) == expected:
            continue
        for options, message in _SCHEDULE_MISTAKES:
            if list(got) == _schedule_variant(found_inf, init_scale, growth_interval, **options):
                raise ExerciseFailed(f"{what}: {message}")
        step = next(i for i, (a, b) in enumerate(zip(got, expected)) if a != b)
        raise ExerciseFailed(f"{what}: after step {step} (found_inf={found_inf[step]}) the scale should be {expected[step]:g}, got {got[step]!r}")


# amp_step: the learner's step and the reference step train twin models side by side, in each precision, on batches
# the learner never sees. Some steps go wrong in ways the learner's code cannot predict: a batch whose loss is NaN,
# a gradient that overflows to inf in backward while the loss stays finite, and, with float16, the scaler's own
# overflow as its scale grows (growth_interval=1: every good step doubles it).

_AMP_STEPS, _AMP_LR, _AMP_MAX_NORM, _AMP_STALE = 8, 0.1, 0.5, 5e3
_AMP_ATOL = 2e-4
_AMP_ORDER = (torch.float16, torch.bfloat16, torch.float32)


def _amp_model(seed: int = 5) -> nn.Sequential:
    torch.manual_seed(seed)  # the check's own stream: @exercise forks the RNG
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))
    model[0].bias.requires_grad_(False)  # a frozen parameter: its .grad stays None
    return model


def _amp_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=_AMP_LR, momentum=0.9, weight_decay=0.01)


def _amp_scaler(dtype: torch.dtype, init_scale: float = 2.0 ** 17, growth_interval: int = 1) -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval, enabled=dtype == torch.float16)


class _AmpRun:
    """A model, its optimizer and scaler for one precision, with an overflow in backward that the check switches on."""

    def __init__(self, dtype: torch.dtype, seed: int = 5):
        self.dtype = dtype
        self.model = _amp_model(seed)
        self.optimizer = _amp_optimizer(self.model)
        self.scaler = _amp_scaler(dtype)
        self.overflow = False
        self.model[2].weight.register_hook(self._maybe_overflow)
        for p in self.model.parameters():
            if p.requires_grad:
                p.grad = torch.full_like(p, _AMP_STALE)  # gradients left over from an earlier step

    def _maybe_overflow(self, grad: torch.Tensor) -> torch.Tensor:
        if not self.overflow:
            return grad
        grad = grad.clone()
        grad[3, 5] = float("inf")
        return grad

    def state(self) -> dict:
        grads = {n: None if p.grad is None else p.grad.clone() for n, p in self.model.named_parameters()}
        return {"model": copy.deepcopy(self.model.state_dict()), "optimizer": copy.deepcopy(self.optimizer.state_dict()),
                "scaler": self.scaler.state_dict(), "grads": grads}

    @classmethod
    def from_state(cls, dtype: torch.dtype, state: dict) -> "_AmpRun":
        run = cls(dtype)
        run.model.load_state_dict(state["model"])
        run.optimizer.load_state_dict(state["optimizer"])
        run.scaler.load_state_dict(state["scaler"])
        for n, p in run.model.named_parameters():
            p.grad = None if state["grads"][n] is None else state["grads"][n].clone()
        return run


def _amp_batches(dtype: torch.dtype) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], int, int]:
    """The hidden batches of one precision, and the steps whose loss is NaN and whose backward overflows."""
    g = torch.Generator().manual_seed(600 + _AMP_ORDER.index(dtype))
    batches = [(3 * torch.randn(9, 6, generator=g), torch.randint(0, 3, (9,), generator=g)) for _ in range(_AMP_STEPS)]
    nan_step, overflow_step = (1 + torch.randperm(_AMP_STEPS - 1, generator=g)[:2]).tolist()
    batches[nan_step][0][4, 2] = float("inf")  # an inf input: the loss is NaN
    return batches, nan_step, overflow_step


def _amp_variant(run: _AmpRun, x, y, variant: str) -> None:
    """One step done one of the typical wrong ways (the diagnosis compares the learner's weights with these)."""
    model, optimizer, scaler, dtype = run.model, run.optimizer, run.scaler, run.dtype
    if variant != "no_zero_grad":
        optimizer.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    clip = lambda: nn.utils.clip_grad_norm_(model.parameters(), _AMP_MAX_NORM)
    if variant == "clip_before_unscale":
        clip()
        scaler.unscale_(optimizer)
    elif variant == "clip_each":
        scaler.unscale_(optimizer)
        for p in model.parameters():
            if p.grad is not None:
                nn.utils.clip_grad_norm_(p, _AMP_MAX_NORM)
    else:
        scaler.unscale_(optimizer)
        if variant != "no_clip":
            clip()
    scaler.step(optimizer)
    scaler.update()


_AMP_MISTAKES = [
    ("no_clip", "the gradients were not clipped: clip their total norm to max_norm with nn.utils.clip_grad_norm_, in every precision"),
    ("clip_before_unscale", ("the gradients were clipped while still scaled: call scaler.unscale_(optimizer) before clipping, "
                             "or max_norm is compared with gradients `scale` times too large")),
    ("clip_each", "each parameter's gradient was clipped on its own: clip the total norm of all the gradients together"),
    ("no_zero_grad", "old gradients were still in .grad: clear them at the start of the step"),
]


def _skip_cause(step: int, nan_step: int, overflow_step: int) -> str:
    if step == nan_step:
        return "the loss was NaN (an inf in the batch)"
    if step == overflow_step:
        return "the loss was finite, but a gradient overflowed to inf in backward"
    return "the scale was too large, so the float16 backward overflowed to inf"


class _Watch:
    """What the learner's step does to the check's objects: optimizer steps, the forward's dtype, the loss's dtype."""

    def __init__(self, run: _AmpRun):
        self.steps, self.forward_dtypes, self.losses = 0, [], []
        run.optimizer.register_step_post_hook(self._on_step)
        run.model[0].register_forward_hook(self._on_forward)

    def _on_step(self, *args) -> None:
        self.steps += 1

    def _on_forward(self, module, args, output) -> None:
        self.forward_dtypes.append(output.dtype)

    def cross_entropy(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """F.cross_entropy itself, noting the dtype it ran in: the loss_fn the learner's step is given."""
        loss = F.cross_entropy(logits, targets)
        self.losses.append((logits.dtype, loss.dtype))
        return loss

    def clear(self) -> None:
        self.steps = 0
        self.forward_dtypes.clear()
        self.losses.clear()


_AMP_HINTS = {
    "_scale is None": "the scaler has not scaled anything yet: call scaler.scale(loss).backward(), not loss.backward()",
    "unscale_() has already been called": "call scaler.unscale_(optimizer) once per step, before clipping",
    "step() has already been called": "call scaler.step(optimizer) at most once per step",
    "Attempting to unscale FP16 gradients": "the parameters are float16: autocast keeps the weights float32 and casts per "
                                            "operation; do not cast the model",
}


@exercise("amp_step")
@_restores_autocast
def check_amp_step(fn) -> None:
    for dtype in _AMP_ORDER:
        _check_amp_precision(fn, dtype)


def _check_amp_precision(fn: Callable, dtype: torch.dtype) -> None:
    batches, nan_step, overflow_step = _amp_batches(dtype)
    mine, ref = _AmpRun(dtype), _AmpRun(dtype)
    watch = _Watch(mine)
    scaler_note = "enabled" if dtype == torch.float16 else "disabled"
    shown = f"model, inputs, targets, F.cross_entropy, optimizer, scaler ({scaler_note}), {dtype}, max_norm={_AMP_MAX_NORM}"
    for step, (x, y) in enumerate(batches):
        before = ref.state()
        mine.overflow = ref.overflow = step == overflow_step
        want = amp_step(ref.model, x.clone(), y.clone(), F.cross_entropy, ref.optimizer, ref.scaler, dtype, _AMP_MAX_NORM)
        watch.clear()
        weights_before, scale_before = _params(mine.model), mine.scaler.get_scale()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = call(fn, mine.model, x.clone(), y.clone(), watch.cross_entropy, mine.optimizer, mine.scaler, dtype,
                       _AMP_MAX_NORM, name="amp_step", shown=shown, hints=_AMP_HINTS)
        mine.overflow = False
        what = f"amp_step with dtype={dtype}, step {step}"
        _judge_amp_step(what, dtype, step, mine, ref, got, want, watch, caught, weights_before,
                        scale_before, before, x, y, nan_step, overflow_step)


def _judge_amp_step(what, dtype, step, mine, ref, got, want, watch, caught, weights_before,
                    scale_before, before, x, y, nan_step, overflow_step) -> None:
    messages = [str(w.message) for w in caught]
    cast = sorted({_short(p.dtype) for p in mine.model.parameters() if p.dtype != torch.float32})
    if cast:
        raise ExerciseFailed(f"{what}: the model's parameters are now {cast[0]}: autocast keeps the weights float32 "
                             "and casts per operation; do not cast the model")
    if any("target dtype is not supported" in m for m in messages):
        raise ExerciseFailed(f"{what}: torch.autocast(..., dtype=torch.float32) warned and switched itself off: "
                             "for float32, run the forward without autocast (enabled=False)")
    if not watch.forward_dtypes:
        raise ExerciseFailed(f"{what}: the model was never called: run the forward pass on the inputs")
    ran = watch.forward_dtypes[0]
    if ran != dtype:
        if ran == torch.float32 and any("CUDA is not available" in m for m in messages):
            raise ExerciseFailed(f"{what}: autocast was switched off with a warning: device_type='cuda' does nothing for CPU "
                                 "tensors; use the inputs' device type, inputs.device.type")
        if ran == torch.float32:
            raise ExerciseFailed(f"{what}: the forward ran in float32: run the model and the loss under torch.autocast "
                                 "in the dtype you were given, on the inputs' device type")
        if dtype == torch.float32:
            raise ExerciseFailed(f"{what}: the forward ran in {_short(ran)}: with dtype=torch.float32 run it without autocast")
        raise ExerciseFailed(f"{what}: the forward ran in {_short(ran)}: use the dtype you were given, {_short(dtype)}")
    if not watch.losses:
        raise ExerciseFailed(f"{what}: loss_fn was never called: compute the loss with the loss_fn you were given")
    logits_dtype, loss_dtype = watch.losses[0]
    if loss_dtype in HALF_DTYPES:
        overflow = (f"; scaling a float16 loss by {scale_before:g}, above float16's largest value 65504, overflows its "
                    "gradient to inf" if loss_dtype == torch.float16 and scale_before > 65504 else "")
        raise ExerciseFailed(f"{what}: the loss came out {_short(loss_dtype)}: it was computed outside autocast on "
                             f"{_short(logits_dtype)} logits{overflow}; compute it inside the autocast block, where "
                             "autocast runs the loss in float32, or on logits.float()")
    if not isinstance(got, bool):
        raise ExerciseFailed(f"{what} returned {type_name(got) if got is not None else 'None'}, expected a Python bool: "
                             "True when the weights were updated, False when the step was skipped")
    after = _params(mine.model)
    changed = not all(torch.equal(after[k], weights_before[k]) for k in after)
    if not want:  # the reference skipped this step
        cause = _skip_cause(step, nan_step, overflow_step)
        advice = ("step with scaler.step(optimizer), which skips such a step, and never call optimizer.step() yourself"
                  if dtype == torch.float16 else
                  "a disabled scaler skips nothing, so check that the gradients are finite (clip_grad_norm_ returns their "
                  "total norm) and do not step when they are not")
        if watch.steps or changed:
            raise ExerciseFailed(f"{what}: {cause}, and the optimizer {'stepped' if watch.steps else 'changed the weights'} "
                                 f"anyway: {advice}")
        if got:
            raise ExerciseFailed(f"{what}: {cause}, and the step was rightly skipped, but you returned True: return False for a skipped step")
        if mine.scaler.get_scale() != ref.scaler.get_scale():
            raise ExerciseFailed(f"{what}: {cause}; after this skipped step the scale should back off from {scale_before:g} to "
                                 f"{ref.scaler.get_scale():g}, it is {mine.scaler.get_scale():g}: call scaler.update() on skipped steps too")
        return
    expected = _params(ref.model)
    name = _first_difference(after, expected, _AMP_ATOL)
    if name is not None or watch.steps != 1:
        for variant, message in _AMP_MISTAKES:  # a typical mistake, when it gives exactly the learner's weights
            if variant == "clip_before_unscale" and dtype != torch.float16:
                continue
            simulated = _AmpRun.from_state(dtype, before)
            _amp_variant(simulated, x.clone(), y.clone(), variant)
            if _first_difference(after, _params(simulated.model), _AMP_ATOL) is None:
                raise ExerciseFailed(f"{what}: {message}")
    if not watch.steps:
        raise ExerciseFailed(f"{what}: the loss and the gradients of this step are finite in the reference solution, but your "
                             "optimizer did not step: skip only the steps whose loss or gradients are inf or NaN")
    if watch.steps > 1:
        raise ExerciseFailed(f"{what}: the optimizer stepped {watch.steps} times: step it once per call")
    if not got:
        raise ExerciseFailed(f"{what}: the weights were updated, but you returned False: return True when the step was taken")
    if name is not None:
        expect_tensor(after[name], expected[name], what=f"parameter {name!r} after {what}", atol=_AMP_ATOL, rtol=0.0)
    if mine.scaler.get_scale() != ref.scaler.get_scale():
        raise ExerciseFailed(f"{what}: the scale is {mine.scaler.get_scale():g}, expected {ref.scaler.get_scale():g} "
                             "(this scaler doubles it after every good step): call scaler.update() once per step, "
                             "after scaler.step(optimizer)")


# save_amp_checkpoint and resume_amp: a float16 run in mid-training (its scale backed off, good steps counted, momentum
# buffers filled), saved at a step number the learner never sees; the real test is that a run resumed from the file
# goes on exactly as the uninterrupted run does.

_CKPT_KEYS = ("model", "optimizer", "scaler", "step")


def _trained_run(dtype: torch.dtype, steps: int, seed: int = 5, init_scale: float = 2.0 ** 18) -> _AmpRun:
    run = _AmpRun(dtype, seed)
    run.scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=3, enabled=dtype == torch.float16)
    g = torch.Generator().manual_seed(800)
    for _ in range(steps):
        x, y = 3 * torch.randn(9, 6, generator=g), torch.randint(0, 3, (9,), generator=g)
        amp_step(run.model, x, y, F.cross_entropy, run.optimizer, run.scaler, dtype, _AMP_MAX_NORM)
    return run


def _continue(run: _AmpRun, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = 3 * torch.randn(9, 6, generator=g), torch.randint(0, 3, (9,), generator=g)
        amp_step(run.model, x, y, F.cross_entropy, run.optimizer, run.scaler, run.dtype, _AMP_MAX_NORM)


def _load_learner_file(path: Path, what: str) -> Any:
    if not path.exists():
        raise ExerciseFailed(f"{what}: nothing was written to the path you were given: torch.save(..., path)")
    try:
        return torch.load(path, weights_only=True)
    except Exception as err:  # noqa: BLE001 -- whatever torch.load makes of the learner's file is the file's fault
        text = str(err)
        if "GradScaler" in text:
            raise ExerciseFailed(f"{what}: the file holds the GradScaler object itself, which torch.load(weights_only=True) refuses: "
                                 "save scaler.state_dict(), a dict of plain numbers") from None
        if "torch.nn.modules" in text:
            raise ExerciseFailed(f"{what}: the file holds a model object, which torch.load(weights_only=True) refuses: "
                                 "save model.state_dict()") from None
        if "torch.optim" in text:
            raise ExerciseFailed(f"{what}: the file holds an optimizer object, which torch.load(weights_only=True) refuses: "
                                 "save optimizer.state_dict()") from None
        line = text.strip().splitlines()[0] if text.strip() else type(err).__name__
        raise ExerciseFailed(f"{what}: torch.load(path, weights_only=True) cannot read the file ({line[:120]}): "
                             "save a dict of state dicts and numbers with torch.save") from None


@exercise("save_amp_checkpoint")
@_restores_autocast
def check_save_amp_checkpoint(fn) -> None:
    run, step = _trained_run(torch.float16, 7), 7
    scaler_state = run.scaler.state_dict()
    assert scaler_state["scale"] != 2.0 ** 16 and scaler_state["_growth_tracker"] != 0  # the hidden state is not a default one
    model_state, optimizer_state = copy.deepcopy(run.model.state_dict()), copy.deepcopy(run.optimizer.state_dict())
    shown = f"path, model, optimizer, scaler (scale {scaler_state['scale']:g}), step={step}"
    what = f"save_amp_checkpoint({shown})"
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "amp.pt"
        call(fn, path, run.model, run.optimizer, run.scaler, step, name="save_amp_checkpoint", shown=shown)
        if run.scaler.state_dict() != scaler_state:
            raise ExerciseFailed(f"{what} changed the scaler's state: saving must only read it")
        if not _same_tree(run.model.state_dict(), model_state) or not _same_tree(run.optimizer.state_dict(), optimizer_state):
            raise ExerciseFailed(f"{what} changed the model or the optimizer: saving must only read them")
        checkpoint = _load_learner_file(path, what)
        if not isinstance(checkpoint, dict):
            raise ExerciseFailed(f"{what}: the file holds {type_name(checkpoint)}, expected a dict with the keys {list(_CKPT_KEYS)}")
        missing = [k for k in _CKPT_KEYS if k not in checkpoint]
        if missing:
            hint = ": save scaler.state_dict() under 'scaler', or a resumed run starts its scale afresh" if "scaler" in missing else ""
            raise ExerciseFailed(f"{what}: the checkpoint has no {missing[0]!r} entry (keys: {sorted(map(str, checkpoint))}){hint}")
        saved = checkpoint["scaler"]
        if isinstance(saved, (float, int, torch.Tensor)) and not isinstance(saved, bool):
            value = saved.item() if isinstance(saved, torch.Tensor) and saved.numel() == 1 else saved
            if value == scaler_state["scale"]:
                raise ExerciseFailed(f"{what}: checkpoint['scaler'] holds only the scale: save scaler.state_dict(), which also "
                                     "holds the count of good steps since the last growth and the growth settings")
        if not isinstance(saved, dict):
            raise ExerciseFailed(f"{what}: checkpoint['scaler'] is {type_name(saved)}, expected scaler.state_dict()")
        if not _same_tree(saved, scaler_state):
            raise ExerciseFailed(f"{what}: checkpoint['scaler'] is {saved}, expected scaler.state_dict(), {scaler_state}")
        if not isinstance(checkpoint["model"], dict) or not _same_tree(dict(checkpoint["model"]), dict(model_state)):
            raise ExerciseFailed(f"{what}: checkpoint['model'] is not the model's state_dict()")
        if not isinstance(checkpoint["optimizer"], dict) or not _same_tree(checkpoint["optimizer"], optimizer_state):
            raise ExerciseFailed(f"{what}: checkpoint['optimizer'] is not the optimizer's state_dict() "
                                 "(its momentum buffers and settings)")
        expect_equal(checkpoint["step"], step, what=f"{what}: checkpoint['step']", returned=False)
        # The real test: a run resumed from the learner's file goes on as the uninterrupted one.
        resumed = _AmpRun(torch.float16, seed=9)
        resumed.scaler = torch.amp.GradScaler("cpu")
        resume_amp(path, resumed.model, resumed.optimizer, resumed.scaler)
    _continue(run, 4, seed=801)
    _continue(resumed, 4, seed=801)
    if not _same_tree(_params(resumed.model), _params(run.model)) or resumed.scaler.state_dict() != run.scaler.state_dict():
        raise ExerciseFailed(f"{what}: a run resumed from your file does not go on as the uninterrupted run does")


# (dtype of the run, steps before the checkpoint): a float16 run with its scaler, and a bfloat16 run whose scaler is
# disabled (its state_dict() is {}, and loading {} into a disabled scaler does nothing).
_RESUME_CASES = [(torch.float16, 5), (torch.bfloat16, 3)]


@exercise("resume_amp")
@_restores_autocast
def check_resume_amp(fn) -> None:
    for dtype, step in _RESUME_CASES:
        original = _trained_run(dtype, step)
        fresh_scaler = torch.amp.GradScaler("cpu", enabled=dtype == torch.float16)
        shown = f"path, model, optimizer, scaler ({'fresh' if dtype == torch.float16 else 'disabled'})"
        what = f"resume_amp({shown}) of a {_short(dtype)} run saved at step {step}"
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "amp.pt"
            save_amp_checkpoint(path, original.model, original.optimizer, original.scaler, step)
            saved = torch.load(path, weights_only=True)
            resumed = _AmpRun(dtype, seed=9)
            resumed.scaler = fresh_scaler
            got = call(fn, path, resumed.model, resumed.optimizer, resumed.scaler, name="resume_amp", shown=shown)
        if isinstance(got, torch.Tensor) and got.numel() == 1 and got.item() == step:
            raise ExerciseFailed(f"{what} returned a tensor, expected the Python int {step}")
        if isinstance(got, int) and not isinstance(got, bool) and got == step + 1:
            raise ExerciseFailed(f"{what} returned {got}, expected {step}: return the step stored in the checkpoint, not the next one")
        expect_equal(got, step, what=what)
        if not _same_tree(resumed.model.state_dict(), saved["model"]):
            raise ExerciseFailed(f"{what}: the model's weights are not the saved ones: load checkpoint['model'] into the model you were given")
        if not _same_tree(resumed.optimizer.state_dict(), saved["optimizer"]):
            raise ExerciseFailed(f"{what}: the optimizer's state (its momentum buffers) is not the saved one: "
                                 "load checkpoint['optimizer'] into the optimizer you were given")
        if resumed.scaler.state_dict() != saved["scaler"]:
            got_scale = resumed.scaler.get_scale()
            if got_scale == 2.0 ** 16 and saved["scaler"]["scale"] != got_scale:
                raise ExerciseFailed(f"{what}: the scaler you were given still has a fresh scaler's scale, 65536, not the saved "
                                     f"{saved['scaler']['scale']:g}: load checkpoint['scaler'] into it with load_state_dict")
            raise ExerciseFailed(f"{what}: the scaler's state is {resumed.scaler.state_dict()}, expected the saved {saved['scaler']}")
        _continue(original, 4, seed=802)
        _continue(resumed, 4, seed=802)
        if not _same_tree(_params(resumed.model), _params(original.model)) or resumed.scaler.state_dict() != original.scaler.state_dict():
            raise ExerciseFailed(f"{what}: the resumed run does not go on as the uninterrupted run does")
