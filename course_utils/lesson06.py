"""Lesson 06 (mixed precision): reference solutions, the checks for its exercises, and the memory demo's helpers."""

import contextlib
import copy
import functools
import math
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

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
    first_line,
    scoreboard_for,
    type_name,
)
from course_utils.tooling.language import N_, _, ngettext

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
    """Load a checkpoint of a run in any precision into this run's model, optimizer and scaler; return its step number."""
    checkpoint = torch.load(path, weights_only=True)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    if checkpoint["scaler"]:  # {} from a run whose scaler was disabled (bfloat16, float32): keep this run's fresh scaler
        scaler.load_state_dict(checkpoint["scaler"])  # and into a disabled scaler, load_state_dict does nothing
    return checkpoint["step"]


def accumulate_step(model: nn.Module, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], loss_fn: Callable,
                    optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, dtype: torch.dtype, max_norm: float) -> bool:
    """One step over several micro-batches, as one step on all their samples: clipped, skipped on inf/NaN; True if taken."""
    optimizer.zero_grad(set_to_none=True)
    total = sum(len(targets) for _inputs, targets in micro_batches)
    for inputs, targets in micro_batches:
        with torch.autocast(device_type=inputs.device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = loss_fn(model(inputs), targets) * (len(targets) / total)  # its share of the step's samples
        scaler.scale(loss).backward()  # every micro-batch with the same scale: update() waits for the step
    scaler.unscale_(optimizer)         # once, after the last micro-batch
    norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    finite = bool(torch.isfinite(norm))
    if finite:
        scaler.step(optimizer)
    scaler.update()
    return finite


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


# The figure of section 5: gradients against float16's range.

def float16_zones(values: torch.Tensor) -> dict[str, float]:
    """The share of values that float16 turns into 0, keeps as subnormals (digits lost), keeps as normal numbers, or makes inf."""
    magnitude = values.detach().abs().double().flatten()
    smallest_subnormal = 2.0 ** -24
    tiny, largest = torch.finfo(torch.float16).tiny, torch.finfo(torch.float16).max
    zones = {
        "become 0": magnitude < smallest_subnormal / 2,  # round to nearest: below half the smallest subnormal
        "subnormal": (magnitude >= smallest_subnormal / 2) & (magnitude < tiny),
        "normal": (magnitude >= tiny) & (magnitude <= largest),
        "inf": magnitude > largest,
    }
    return {name: zone.double().mean().item() for name, zone in zones.items()}


def plot_float16_range(gradients: torch.Tensor, scale: float):
    """Histogram of log2|gradient|, unscaled and times `scale`, over float16's zones; returns the figure and the zones' shares."""
    import matplotlib.pyplot as plt  # here, not at the top: the checker imports this module and draws nothing

    values = gradients.detach().double().flatten()
    values = values[values != 0]
    shifted = math.log2(scale)
    fig, ax = plt.subplots(figsize=(7, 3.2))
    edges = np.arange(-40, 20.5, 0.5)
    bands = [(-40, -25, "tab:red", "becomes 0"), (-25, -14, "tab:orange", "subnormal: digits lost"),
             (math.log2(torch.finfo(torch.float16).max), 20, "tab:red", "inf")]
    for low, high, color, label in bands:
        ax.axvspan(low, high, color=color, alpha=0.12, label=f"float16: {label}")
    ax.hist(values.abs().log2().numpy(), bins=edges, color="tab:blue", alpha=0.7, label="gradients")
    ax.hist(values.abs().log2().numpy() + shifted, bins=edges, color="tab:green", alpha=0.7, label=f"gradients x 2**{shifted:g}")
    ax.set_xlabel("log2 |gradient|")
    ax.set_ylabel("count")
    ax.set_title("the loss scale lifts float16's gradients out of the underflow zone", fontsize=10)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    shares = {"gradients": float16_zones(values), f"gradients x 2**{shifted:g}": float16_zones(values * scale)}
    return fig, shares


# Shared helpers of the checks.

def _restores_autocast(fn: Callable) -> Callable:
    """Run fn on one thread and leave autocast (CPU and CUDA) and the thread count as they were (@exercise leaves the RNG alone)."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        states = {d: (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")}
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # the checks' tensors are tiny: on a busy machine, waking threads costs more than the math
        try:
            return fn(*args, **kwargs)
        finally:
            for device_type, (enabled, dtype) in states.items():
                torch.set_autocast_enabled(device_type, enabled)
                torch.set_autocast_dtype(device_type, dtype)
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

_INF = float("inf")
_RANGE_CASES = [
    (torch.tensor([0.5, -3.0, 1e-3]), torch.float16),
    (torch.tensor([1e-4, -2e-4]), torch.float16),
    (torch.tensor([1.0, -70000.0]), torch.float16),
    (torch.tensor([65504.0, -2.0]), torch.float16),
    (torch.tensor([-65504.0]), torch.float16),                       # the limit itself, alone
    (torch.tensor([-1e-30, 2e-8, 7.0]), torch.float16),
    (torch.tensor([40000.0, -40000.0, 30000.0]), torch.float16),     # each fits; their sum would not
    (torch.tensor([65530.0, 1.0]), torch.float16),                   # past the sliver that rounds down: the cast gives inf
    (torch.tensor([[1.0, -2.0], [3e4, 0.5]]), torch.float16),        # any shape
    (torch.tensor([[0.25, 9e4], [-1.0, 2.0]]), torch.float16),
    (torch.tensor(1e5), torch.bfloat16),                             # a 0-d tensor
    (torch.tensor([2.0, _INF]), torch.float16),                      # an inf already in x stays inf
    (torch.tensor([-_INF, 1.0]), torch.float32),
    (torch.tensor([70000.0, -1e30]), torch.bfloat16),
    (torch.tensor([3e38], dtype=torch.float64), torch.bfloat16),
    (torch.tensor([-3.4e38], dtype=torch.float64), torch.bfloat16),  # above bfloat16's 3.3895e38 (and its rounding), below float32's limit
    (torch.tensor([3.4e38, 0.0], dtype=torch.float64), torch.float32),
    (torch.tensor([1e39, 1.0], dtype=torch.float64), torch.float32),
    (torch.tensor([-1e39], dtype=torch.float64), torch.float32),
]

_RANGE_MISTAKES = [  # (wrong rule, what it gets wrong): the cases tell every rule from the others and from the right one
    (lambda x, d: bool(x.abs().max() <= torch.finfo(d).eps),
     N_("you compared with torch.finfo(dtype).eps, the gap between 1.0 and the next number; "
        "the largest finite value is torch.finfo(dtype).max")),
    (lambda x, d: bool(x.abs().max() <= torch.finfo(d).tiny),
     N_("you compared with torch.finfo(dtype).tiny, the smallest normal number; the largest finite value is torch.finfo(dtype).max")),
    (lambda x, d: bool(x.max() <= torch.finfo(d).max),
     N_("a large negative value overflows too: compare the magnitude, x.abs().max(), with torch.finfo(dtype).max")),
    (lambda x, d: bool(x.abs().max() < torch.finfo(d).max),
     N_("torch.finfo(dtype).max itself fits: use <=, not <")),
    (lambda x, d: bool(x.abs().max() <= 65504),
     N_("65504 is float16's limit only: read the limit of the dtype you were given from torch.finfo(dtype).max")),
    (lambda x, d: bool(x.abs().max() <= torch.finfo(torch.bfloat16).max),
     N_("you compared every dtype with bfloat16's limit, torch.finfo(torch.bfloat16).max: read the limit of the dtype you were given")),
    (lambda x, d: bool(x.abs().max() <= torch.finfo(torch.float32).max),
     N_("you compared every dtype with float32's limit, torch.finfo(torch.float32).max: read the limit of the dtype you were given")),
    (lambda x, d: bool(x.abs().max() <= torch.finfo(x.dtype).max),
     N_("you read the limit of x's own dtype, torch.finfo(x.dtype).max: the limit that matters is the target's, torch.finfo(dtype).max")),
    (lambda x, d: bool(x.abs().sum() <= torch.finfo(d).max),
     N_("you compared the sum of the magnitudes with the limit: each value is cast on its own, so only the largest magnitude matters")),
    (lambda x, d: not bool(x.abs().max() <= torch.finfo(d).max),
     N_("your function returns True when a value overflows and False when every value fits: the opposite of what is asked")),
]


def _range_reason(x: torch.Tensor, dtype: torch.dtype, fits: bool) -> str:
    """Why x does or does not fit: its largest magnitude against the dtype's limit, named."""
    peak, limit = x.abs().max().item(), torch.finfo(dtype).max
    if fits:
        return _("its largest magnitude, {peak:.6g}, is at most torch.finfo({dtype}).max = {limit:.6g}").format(
            peak=peak, dtype=dtype, limit=limit)
    if math.isinf(peak):
        return _("x already holds an inf, which stays inf in any float dtype: it does not fit")
    return _("|{peak:.6g}| is above torch.finfo({dtype}).max = {limit:.6g}, so the cast gives inf").format(
        peak=peak, dtype=dtype, limit=limit)


def _counts_tiny_values(fn: Callable) -> bool:
    """True when fn accepts an ordinary value but rejects values that only underflow (they give 0 or a subnormal, no inf)."""
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        if fn(torch.tensor([1.0, -2.0]), dtype) is True and fn(torch.tensor([1.0, 1e-30, -2.0]), dtype) is False:
            return True
    return False


def _shown_tensor(x: torch.Tensor) -> str:
    if x.dim() == 1:
        return f"torch.tensor({x.tolist()})"
    return _("torch.tensor({values}) (shape {shape})").format(values=x.tolist(), shape=tuple(x.shape))


@exercise("fits_in_range")
@_restores_autocast
def check_fits_in_range(fn) -> None:
    answers = []
    for x, dtype in _RANGE_CASES:
        what = f"fits_in_range({_shown_tensor(x)}, {dtype})"
        given, before = x.clone(), x.clone()
        try:
            got = call(fn, given, dtype, shown=f"{_shown_tensor(x)}, {dtype}")
        except ExerciseFailed as err:
            # err.__context__: what the learner's function raised (call() says "raised" in the learner's language)
            if x.dim() == 1 or err.__context__ is None or not answers:
                raise
            raise ExerciseFailed(_("{error} (x here is {dim}-D, and your function ran on the 1-D tensors before it: "
                                   "x can have any shape, so work on the tensor as a whole, e.g. x.abs().max())").format(
                error=err, dim=x.dim())) from None
        if given.dtype != before.dtype:
            raise ExerciseFailed(_("{what} changed the caller's tensor x (now {dtype} {values}): "
                                   "only read it; compare a copy, not x itself cast in place").format(
                what=what, dtype=_short(given.dtype), values=given.tolist()))
        if not torch.equal(given, before):
            raise ExerciseFailed(_("{what} changed the values of the caller's tensor x in place (now {values}): "
                                   "only read it; use out-of-place operations such as x.abs(), not x.abs_()").format(
                what=what, values=given.tolist()))
        if isinstance(got, torch.Tensor):
            raise ExerciseFailed(_("{what} is a tensor, expected a Python bool: wrap the comparison in bool(...) or call .item()").format(
                what=what))
        if isinstance(got, (np.generic, np.ndarray)):
            raise ExerciseFailed(_("{what} is a {type}, expected a Python bool: wrap it in bool(...)").format(
                what=what, type=type_name(got)))
        if not isinstance(got, bool):
            expect_equal(got, fits_in_range(x.clone(), dtype), what=what)
        answers.append(got)
    expected = [fits_in_range(x, d) for x, d in _RANGE_CASES]
    if answers == expected:
        return
    for rule, message in _RANGE_MISTAKES:
        if answers == [rule(x, d) for x, d in _RANGE_CASES]:
            raise ExerciseFailed(_(message))
    probe = lambda x, d: call(fn, x, d, shown=f"{_shown_tensor(x)}, {d}")
    if _counts_tiny_values(probe):
        raise ExerciseFailed(_("values far below finfo(dtype).tiny do not overflow (they round to a subnormal or to 0), yet your "
                               "function rejects them: only magnitudes above torch.finfo(dtype).max count against x"))
    (x, dtype), got, want = next((case, a, e) for case, a, e in zip(_RANGE_CASES, answers, expected) if a != e)
    raise ExerciseFailed(_("{call} returned {got}, expected {expected}: {reason}").format(
        call=f"fits_in_range({_shown_tensor(x)}, {dtype})", got=got, expected=want, reason=_range_reason(x, dtype, want)))


# run_in_float32: the check hands the learner's function a probe of its own as fn. The probe records the autocast
# state and the arguments it receives, then computes squared distances the way that needs float32: through the
# expansion |a|^2 + |b|^2 - 2 a.b, whose matmul autocast would run in 16 bits and whose subtraction cancels.

class _ProbeError(Exception):
    """What the raising probe raises: the learner's function must let it through."""


class _OnCuda(torch.Tensor):
    """A CPU tensor that says it is on a CUDA device: on a machine without a GPU, how the check sees which device type's
    autocast the learner's function switches off (autocast is per device type; the probe computes on the CPU either way)."""

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", 0)

    @property
    def is_cuda(self) -> bool:
        return True


def _plain(value: Any) -> Any:
    return value.as_subclass(torch.Tensor) if isinstance(value, _OnCuda) else value


_ORDER = ("a", "b", "index", "weight")


class _Probe:
    """An fn for run_in_float32: records what it receives, returns distances picked by an index tensor, times a number."""

    def __init__(self, order: tuple[str, ...] = _ORDER, device_type: str = "cpu", raises: bool = False):
        self.order, self.device_type, self.raises = order, device_type, raises
        self.calls: list[dict] = []
        self.returned: Any = None

    def __call__(self, *args):
        self.calls.append({
            "autocast": torch.is_autocast_enabled(self.device_type),
            "grad_enabled": torch.is_grad_enabled(),
            "kinds": [_expected_kind(a, cast=False) for a in args],
            "requires_grad": [isinstance(a, torch.Tensor) and a.requires_grad for a in args],
        })
        if self.raises:
            raise _ProbeError(_("fn raised (as the check's fn does on purpose)"))
        if len(args) != 4:
            raise TypeError(_("fn takes 4 arguments ({names}), got {n}").format(names=", ".join(self.order), n=len(args)))
        named = dict(zip(self.order, args))
        a, b, index, weight = (named[k] for k in _ORDER)
        common = torch.promote_types(a.dtype, b.dtype)   # the probe runs on whatever it is given, never raises a dtype error
        a, b = a.to(common), b.to(common)
        squared = (a * a).sum(dim=1, keepdim=True) + (b * b).sum(dim=1) - 2 * (a @ b.T)
        self.returned = weight * squared.gather(1, index.long())  # index.long(): the probe still runs if index arrives cast
        return self.returned


def _distance_case(seed: int, a_dtype: torch.dtype, b_dtype: torch.dtype, n: int = 5, m: int = 4, d: int = 24,
                   device_type: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    centre = torch.randn(1, d, generator=g) * 40          # far from 0, close together: the expansion cancels badly
    a = (centre + 0.05 * torch.randn(n, d, generator=g)).to(a_dtype)
    b = (centre + 0.05 * torch.randn(m, d, generator=g)).to(b_dtype)
    index = torch.randint(0, m, (n, 2), generator=g)
    if device_type == "cuda":
        a, b, index = a.as_subclass(_OnCuda), b.as_subclass(_OnCuda), index.as_subclass(_OnCuda)
    return a.requires_grad_(), b, index, 0.5


def _expected_distances(a: torch.Tensor, b: torch.Tensor, index: torch.Tensor, weight: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The probe's result computed in float32 (float64 stays float64) with autocast off, and its gradient for a."""
    a = _plain(a).detach().clone().requires_grad_()
    with torch.autocast("cpu", enabled=False):
        probe = _Probe()
        out = probe(*[t.float() if isinstance(t, torch.Tensor) and t.dtype in HALF_DTYPES else t
                      for t in (a, _plain(b), _plain(index), weight)])
    (grad,) = torch.autograd.grad(out.sum(), a)
    return out.detach(), grad


# (autocast dtype of the caller or None, dtype of a, dtype of b, the order of the arguments, the tensors' device type):
# every kind of argument the prompt names, a plain number first, and tensors on another device type than the CPU.
_F32_CASES = [
    (torch.bfloat16, torch.bfloat16, torch.bfloat16, _ORDER, "cpu"),
    (torch.float16, torch.float16, torch.float32, _ORDER, "cpu"),
    (None, torch.bfloat16, torch.float64, _ORDER, "cpu"),
    (torch.bfloat16, torch.float64, torch.float64, _ORDER, "cpu"),
    (torch.bfloat16, torch.bfloat16, torch.float16, ("weight", "index", "a", "b"), "cpu"),
    (torch.float16, torch.float16, torch.float16, _ORDER, "cuda"),
]


@contextlib.contextmanager
def _caller_autocast(device_type: str, dtype: torch.dtype | None):
    """The caller's autocast: torch.autocast on the CPU; for CUDA, which this machine may lack, its flags set by hand."""
    if device_type == "cpu":
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            yield
        return
    enabled, before = torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
    torch.set_autocast_enabled(device_type, dtype is not None)
    torch.set_autocast_dtype(device_type, dtype or before)
    try:
        yield
    finally:
        torch.set_autocast_enabled(device_type, enabled)
        torch.set_autocast_dtype(device_type, before)


def _expected_kind(value: Any, cast: bool = True) -> Any:
    """What fn should receive for an argument: a tensor's dtype (16-bit floats as float32 when cast), a number itself."""
    if isinstance(value, torch.Tensor):
        return torch.float32 if cast and value.dtype in HALF_DTYPES else value.dtype
    if type(value) in (int, float):
        return value
    return _("a {type}").format(type=type_name(value))  # a string: compares safely with anything


def _expect_arguments_unchanged(what: str, originals: dict[str, tuple[torch.Tensor, torch.Tensor, bool]]) -> None:
    """The caller's tensors keep their dtype, values and requires_grad: the cast must make new tensors."""
    for name, (tensor, before, requires_grad) in originals.items():
        if tensor.dtype != before.dtype:
            raise ExerciseFailed(_("{what}: the caller's tensor {name} is now {dtype}, it was {before}: "
                                   "cast into new tensors (a.float() returns one) and leave the caller's tensors as they were").format(
                what=what, name=name, dtype=_short(tensor.dtype), before=_short(before.dtype)))
        if tensor.shape != before.shape or not torch.equal(_plain(tensor).detach(), _plain(before)):
            raise ExerciseFailed(_("{what}: the values of the caller's tensor {name} changed: leave the caller's tensors as they were").format(
                what=what, name=name))
        if tensor.requires_grad != requires_grad:
            raise ExerciseFailed(_("{what}: the caller's tensor {name} now has requires_grad={requires_grad}: "
                                   "leave the caller's tensors as they were").format(
                what=what, name=name, requires_grad=tensor.requires_grad))


def _kind_name(kind: Any) -> str:
    return _short(kind) if isinstance(kind, torch.dtype) else kind if isinstance(kind, str) else repr(kind)


_NUMBER_AS_TENSOR = N_("not every argument is a tensor, and a plain number is among them here: test isinstance(arg, torch.Tensor) "
                       "before using a tensor's attributes, and take the device type from a tensor argument")  # call() translates hints
_F32_HINTS = {"'float' object has no attribute": _NUMBER_AS_TENSOR, "'int' object has no attribute": _NUMBER_AS_TENSOR}


@exercise("run_in_float32")
@_restores_autocast
def check_run_in_float32(fn) -> None:
    for seed, (caller, a_dtype, b_dtype, order, device_type) in enumerate(_F32_CASES, start=61):
        a, b, index, weight = _distance_case(seed, a_dtype, b_dtype, device_type=device_type)
        values = {"a": a, "b": b, "index": index, "weight": weight}
        args = [values[k] for k in order]
        labels = {"a": f"a ({_short(a_dtype)})", "b": f"b ({_short(b_dtype)})", "index": "index (int64)", "weight": str(weight)}
        shown = f"fn, {', '.join(labels[k] for k in order)}"
        if device_type != "cpu":
            shown = _("{arguments}, every tensor on a {device} device").format(arguments=shown, device=device_type.upper())
        if caller:
            what = _("run_in_float32({arguments}) inside torch.autocast('{device_type}', dtype={dtype})").format(
                arguments=shown, device_type=device_type, dtype=caller)
        else:
            what = _("run_in_float32({arguments}) outside autocast").format(arguments=shown)
        probe = _Probe(order, device_type)
        originals = {"a": (a, a.detach().clone(), a.requires_grad), "b": (b, b.clone(), b.requires_grad),
                     "index": (index, index.clone(), False)}
        with _caller_autocast(device_type, caller), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = call(fn, probe, *args, name="run_in_float32", shown=shown, hints=_F32_HINTS)
            still_on, dtype_after = torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
        _expect_arguments_unchanged(what, originals)
        if any("target dtype is not supported" in str(w.message) for w in caught):
            raise ExerciseFailed(_("{what}: torch.autocast(..., dtype=torch.float32) warned and switched itself off: "
                                   "switch autocast off with enabled=False instead").format(what=what))
        if not probe.calls:
            raise ExerciseFailed(_("{what}: fn was never called: call fn on the (cast) arguments and return its result").format(what=what))
        if len(probe.calls) > 1:
            raise ExerciseFailed(_("{what}: fn was called {n} times: call it once").format(what=what, n=len(probe.calls)))
        seen = probe.calls[0]
        if not seen["grad_enabled"]:
            raise ExerciseFailed(_("{what}: gradient recording was off while fn ran (torch.no_grad() or torch.inference_mode() "
                                   "around it), so no gradient can flow back to the caller's tensors: leave it on").format(what=what))
        expected_kinds = [_expected_kind(v) for v in args]
        if caller and seen["autocast"]:
            if device_type != "cpu":
                raise ExerciseFailed(
                    _("{what}: these tensors are on a {device} device (a.device.type is '{device_type}'), and autocast "
                      "for '{device_type}' was still on while fn ran: switch autocast off for the device type of the tensors, "
                      "read from them").format(what=what, device=device_type.upper(), device_type=device_type)
                )
            if seen["kinds"] == expected_kinds:
                raise ExerciseFailed(
                    _("{what}: autocast was still on while fn ran, so its matmul ran in {dtype} although you passed float32 "
                      "tensors: ops on autocast's lower-precision list are cast whatever their inputs; switch autocast off around fn "
                      "for the tensors' device type").format(what=what, dtype=_short(caller))
                )
            raise ExerciseFailed(_("{what}: autocast was still on while fn ran: switch it off around fn, for the tensors' device type").format(
                what=what))
        for name, kind, want in zip(order, seen["kinds"], expected_kinds):
            if kind == want:
                continue
            if want == torch.float32 and kind in HALF_DTYPES:
                raise ExerciseFailed(
                    _("{what}: fn received {name} as {dtype}: with autocast off each op runs in its inputs' dtype, "
                      "so cast the 16-bit tensors to float32").format(what=what, name=name, dtype=_short(kind))
                )
            if isinstance(want, torch.dtype) and isinstance(kind, torch.dtype):
                raise ExerciseFailed(
                    _("{what}: fn received {name} ({expected} in the call) as {got}: cast only bfloat16 and float16 "
                      "tensors to float32, and leave every other tensor as it is").format(
                        what=what, name=name, expected=_short(want), got=_short(kind))
                )
            raise ExerciseFailed(_("{what}: fn received {name} as {got}, expected {expected}: pass it on unchanged").format(
                what=what, name=name, got=_kind_name(kind), expected=_kind_name(want)))
        if not seen["requires_grad"][order.index("a")]:
            raise ExerciseFailed(_("{what}: fn received a detached copy of a (requires_grad=False), so no gradient reaches the "
                                   "caller's a: cast with .float() or .to(torch.float32), which autograd records, and do not detach").format(
                what=what))
        if caller and not still_on:
            raise ExerciseFailed(_("{what}: autocast was off after your function returned: switch it off for fn only, "
                                   "e.g. with a `with` block").format(what=what))
        if caller and dtype_after != caller:
            raise ExerciseFailed(_("{what}: autocast's dtype was {got} after your function returned, "
                                   "expected {expected} as before: leave the caller's autocast as it was").format(
                what=what, got=_short(dtype_after), expected=_short(caller)))
        if not caller and still_on:
            raise ExerciseFailed(_("{what}: autocast was on after your function returned, though it was off before: "
                                   "leave it as it was").format(what=what))
        returned = probe.returned
        if isinstance(got, torch.Tensor) and got is not returned and got.dtype != returned.dtype:
            raise ExerciseFailed(_("{what}: fn returned a {returned} tensor, and your function returned it converted "
                                   "to {got}: return what fn returns, as it is").format(
                what=what, returned=_short(returned.dtype), got=_short(got.dtype)))
        expected, expected_grad = _expected_distances(a, b, index, weight)
        expect_tensor(_plain(got), expected, what=what, atol=1e-5, rtol=1e-6)
        if not got.requires_grad:
            raise ExerciseFailed(_("{what}: the result does not require grad, so no gradient reaches a: cast with .float() or "
                                   ".to(torch.float32), which autograd records, and do not detach").format(what=what))
        (grad,) = torch.autograd.grad(got.sum(), a, allow_unused=True)
        if grad is None:
            raise ExerciseFailed(_("{what}: no gradient reaches the caller's tensor a: do not detach it").format(what=what))
        expect_tensor(_plain(grad), expected_grad.to(a.dtype), what=_("the gradient of a after {what}").format(what=what),
                      atol=1e-2, rtol=1e-2)
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
                       shown=_("an fn that raises, a, b, index, 0.5"), hints=_F32_HINTS)
        still_on = torch.is_autocast_enabled("cpu")
    if outcome == "returned":
        raise ExerciseFailed(_("when fn raised, your function returned normally: let fn's error reach your caller"))
    if not still_on:
        raise ExerciseFailed(_("when fn raised, autocast stayed switched off in the caller: "
                               "restore it even on an error (a `with torch.autocast(...)` block does)"))


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


def _schedule_variant(found_inf, init_scale, growth_interval, *, reset_on_inf=True, off_by_one=False, reset_on_growth=True, before=False,
                      inverted=False):
    scale, good, scales = init_scale, 0, []
    for inf in found_inf:
        inf = inf != inverted
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
    ([True, False, False, True, True, False, False, False, False, False], 3.0, 2),  # not a power of two
    ([], 512.0, 2),
]

_SCHEDULE_MISTAKES = [  # the messages are translated where they are raised
    ({"reset_on_inf": False}, N_("after an inf/NaN step the count of good steps starts again from 0")),
    ({"off_by_one": True}, N_("the scale doubles on the growth_interval-th good step in a row, not on the one after it")),
    ({"reset_on_growth": False}, N_("after the scale doubles, the count of good steps starts again from 0")),
    ({"before": True}, N_("return the scale after each step's update(), not the scale the step used")),
    ({"inverted": True}, N_("you read found_inf=True as a good step: True means that the step found an inf/NaN, which halves the scale")),
]


@exercise("loss_scale_schedule")
@_restores_autocast
def check_loss_scale_schedule(fn) -> None:
    for found_inf, init_scale, growth_interval in _SCHEDULE_CASES:
        what = f"loss_scale_schedule({found_inf}, init_scale={init_scale:g}, growth_interval={growth_interval})"
        given = list(found_inf)
        got = call(fn, given, init_scale, growth_interval)
        if given != found_inf:
            raise ExerciseFailed(_("{what} changed the caller's list found_inf (now {now}): only read it").format(what=what, now=given))
        if got is None:
            raise ExerciseFailed(_("{what} is None: did you forget to `return` the list?").format(what=what))
        if isinstance(got, torch.Tensor):
            got = got.tolist()
        if not isinstance(got, (list, tuple)):
            raise ExerciseFailed(_("{what} is a {type}, expected a list of floats, one per step").format(what=what, type=_kind(got)))
        expected = _gradscaler_scales(found_inf, init_scale, growth_interval)
        if len(got) != len(expected):
            raise ExerciseFailed(_("{what} has {got} values, expected {expected}: one scale per step").format(
                what=what, got=len(got), expected=len(expected)))
        if list(got) == expected:
            continue
        for options, message in _SCHEDULE_MISTAKES:
            if list(got) == _schedule_variant(found_inf, init_scale, growth_interval, **options):
                raise ExerciseFailed(_("{what}: {problem}").format(what=what, problem=_(message)))
        step = next(i for i, (a, b) in enumerate(zip(got, expected)) if a != b)
        if (isinstance(got[step], (int, float)) and expected[step] % 1 and got[step] == math.floor(expected[step])
                and (step == 0 or got[step - 1] == expected[step - 1])):
            raise ExerciseFailed(_("{what}: after step {step} the scale should be {expected:g}, got {got!r}: the value was "
                                   "rounded down, as // and int() do; halve with / 2 or * 0.5, which keep the fraction, "
                                   "and return floats").format(
                what=what, step=step, expected=expected[step], got=got[step]))
        raise ExerciseFailed(_("{what}: after step {step} (found_inf={found_inf}) the scale should be {expected:g}, "
                               "got {got!r}: {rule}").format(
            what=what, step=step, found_inf=found_inf[step], expected=expected[step], got=got[step],
            rule=_schedule_rule(found_inf, init_scale, growth_interval, expected, step)))


def _schedule_rule(found_inf: list[bool], init_scale: float, growth_interval: int, expected: list[float], step: int) -> str:
    """The rule of the schedule that decides the scale after `step`, with the numbers of this case."""
    before = init_scale if step == 0 else expected[step - 1]
    if found_inf[step]:
        return _("a step with an inf/NaN halves the scale (backoff_factor 0.5), from {before:g} to {after:g}").format(
            before=before, after=expected[step])
    if expected[step] > before:
        return _("this step completes growth_interval={growth_interval} good steps in a row (counted since the last inf/NaN "
                 "step or the last growth), so the scale doubles (growth_factor 2.0), from {before:g} to {after:g}").format(
            growth_interval=growth_interval, before=before, after=expected[step])
    run = next((i for i in range(step, -1, -1) if found_inf[i]), -1)  # the good steps counted since then, at most
    if run < 0:
        return _("a good step leaves the scale at {before:g} until growth_interval={growth_interval} good steps in a row "
                 "are complete (the count starts again from 0 after an inf/NaN step and after each growth)").format(
            before=before, growth_interval=growth_interval)
    return _("a good step leaves the scale at {before:g} until growth_interval={growth_interval} good steps in a row "
             "are complete (the count starts again from 0 after an inf/NaN step and after each growth); "
             "the last inf/NaN step was step {last}").format(before=before, growth_interval=growth_interval, last=run)


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
        self.grads_at_step: dict[str, torch.Tensor] | None = None  # what the optimizer's last step read
        self.model[2].weight.register_hook(self._maybe_overflow)
        self.optimizer.register_step_pre_hook(self._record_grads)
        for p in self.model.parameters():
            if p.requires_grad:
                p.grad = torch.full_like(p, _AMP_STALE)  # gradients left over from an earlier step

    def _record_grads(self, *args) -> None:
        self.grads_at_step = {n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None}

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
        run.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))  # load_state_dict keeps the tensors it is given
        run.scaler.load_state_dict(state["scaler"])
        for n, p in run.model.named_parameters():
            p.grad = None if state["grads"][n] is None else state["grads"][n].clone()
        return run


def _amp_batches(dtype: torch.dtype) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], int, int]:
    """The hidden batches of one precision, and the steps whose loss is NaN and whose backward overflows."""
    g = torch.Generator().manual_seed(600 + _AMP_ORDER.index(dtype))
    batches = [(3 * torch.randn(9, 6, generator=g), torch.randint(0, 3, (9,), generator=g)) for _step in range(_AMP_STEPS)]
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


_AMP_MISTAKES = [  # the messages are translated where they are raised
    ("no_clip", N_("the gradients were not clipped: clip their total norm to max_norm with nn.utils.clip_grad_norm_, in every precision")),
    ("clip_before_unscale", N_("the gradients were clipped while still scaled: call scaler.unscale_(optimizer) before clipping, "
                               "or max_norm is compared with gradients `scale` times too large")),
    ("clip_each", N_("each parameter's gradient was clipped on its own: clip the total norm of all the gradients together")),
    ("no_zero_grad", N_("old gradients were still in .grad: clear them at the start of the step")),
]


def _skip_cause(step: int, nan_step: int, overflow_step: int) -> str:
    """Why the reference skipped this step, in English (_judge_skip reads it, then translates it)."""
    if step == nan_step:
        return N_("the loss was NaN (an inf in the batch)")
    if step == overflow_step:
        return N_("the loss was finite, but a gradient overflowed to inf in backward")
    return N_("the scale was too large, so the float16 backward overflowed to inf")


class _ScalerLog:
    """Wraps the learner's scaler: the order of its scale, unscale_, step and update calls, and direct optimizer steps."""

    def __init__(self, scaler: torch.amp.GradScaler):
        self.events: list[str] = []
        self.depth = 0  # inside one of the scaler's own methods (step calls unscale_): not the learner's call
        for name in ("scale", "unscale_", "step", "update"):
            setattr(scaler, name, self._recorded(name, getattr(scaler, name)))

    def _recorded(self, name: str, method: Callable) -> Callable:
        def run(*args, **kwargs):
            if not self.depth:
                self.events.append(name)
            self.depth += 1
            try:
                return method(*args, **kwargs)
            finally:
                self.depth -= 1
        return run

    def optimizer_stepped(self, *args) -> None:
        if not self.depth:
            self.events.append("optimizer.step")

    def count(self, name: str) -> int:
        return self.events.count(name)


class _Watch:
    """What the learner's step does to the check's objects: optimizer steps, the forward's dtype, the loss's dtype."""

    def __init__(self, run: _AmpRun):
        self.run = run
        self.steps, self.backwards, self.forward_dtypes, self.forward_rows, self.losses = 0, 0, [], [], []
        self.weight_dtypes, self.backward_autocast, self.loss_grads = [], [], []
        self.log = _ScalerLog(run.scaler)
        run.optimizer.register_step_pre_hook(self.log.optimizer_stepped)
        run.optimizer.register_step_post_hook(self._on_step)
        run.model[0].register_forward_hook(self._on_forward)
        run.model[-1].weight.register_hook(self._on_backward)

    def _on_step(self, *args) -> None:
        self.steps += 1

    def _on_backward(self, grad: torch.Tensor) -> None:
        self.backwards += 1
        self.backward_autocast.append(torch.is_autocast_enabled("cpu"))

    def _on_forward(self, module, args, output) -> None:
        self.forward_dtypes.append(output.dtype)
        self.forward_rows.append(len(args[0]))
        self.weight_dtypes.append(module.weight.dtype)

    def cross_entropy(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """F.cross_entropy itself, noting the dtype it ran in and whether backward reached it: the loss_fn the learner is given."""
        loss = F.cross_entropy(logits, targets)
        self.losses.append((logits.dtype, loss.dtype))
        self.loss_grads.append(False)
        if loss.requires_grad:
            i = len(self.loss_grads) - 1
            loss.register_hook(lambda grad: self.loss_grads.__setitem__(i, True))
        return loss

    def clear(self) -> None:
        self.steps = self.backwards = 0
        for record in (self.forward_dtypes, self.forward_rows, self.losses, self.weight_dtypes, self.backward_autocast,
                       self.loss_grads, self.log.events):
            record.clear()
        self.run.grads_at_step = None


_AMP_HINTS = {  # {torch's words: advice}; call() translates the advice when it shows it
    "_scale is None": N_("the scaler has not scaled anything yet: call scaler.scale(loss).backward(), not loss.backward()"),
    "unscale_() has already been called": N_("call scaler.unscale_(optimizer) once per step, before clipping"),
    "unscale_() is being called after step()": N_("scaler.step(optimizer) reads the unscaled gradients, so unscale_ (and the "
                                                  "clipping after it) must come before scaler.step(optimizer)"),
    "step() has already been called": N_("call scaler.step(optimizer) at most once per step"),
    "Attempting to unscale FP16 gradients": N_("the parameters are float16: autocast keeps the weights float32 and casts per "
                                               "operation; do not cast the model"),
    "'NoneType' object has no attribute": N_("usually a parameter's .grad, which is None for a parameter that gets no gradient "
                                             "(a frozen one, requires_grad=False): skip those"),
    "not NoneType": N_("usually a parameter's .grad, which is None for a parameter that gets no gradient (a frozen one, "
                       "requires_grad=False): skip those"),
}


def _no_inf_check_advice(watch: _Watch, per_micro_batch: bool = False) -> str:
    """Why scaler.update() found no inf check in this step, read from the order of the learner's calls."""
    log = watch.log
    if log.count("update") > 1:
        return _("scaler.update() was called twice in one step: call it once per step, after scaler.step(optimizer)")
    if "unscale_" in log.events or "step" in log.events:
        return _("scaler.update() found no inf check for this step")
    if not watch.backwards:
        return _("scaler.update() needs this step's inf check, which scaler.unscale_(optimizer) or scaler.step(optimizer) records: "
                 "on a step you skip, still run scaler.scale(loss).backward() and scaler.unscale_(optimizer), skip only the "
                 "optimizer step, then call update()")
    if "optimizer.step" in log.events:
        return _("you stepped with optimizer.step() and never called scaler.unscale_(optimizer) or scaler.step(optimizer), which "
                 "record the inf check update() needs: step with scaler.step(optimizer)")
    if per_micro_batch:
        return _("scaler.update() ran before this step's scaler.unscale_(optimizer): update once per step, after the last "
                 "micro-batch, unscale_ and step, never per micro-batch")
    return _("scaler.update() ran before this step's scaler.unscale_(optimizer) or scaler.step(optimizer), which record the inf "
             "check it needs: call it last, after scaler.step(optimizer)")


def _call_step(fn: Callable, args: tuple, name: str, shown: str, watch: _Watch, hints: dict, per_micro_batch: bool = False):
    """The learner's step through call(), with advice for update()'s 'No inf checks' error read from the order of their calls."""
    try:
        return call(fn, *args, name=name, shown=shown, hints=hints)
    except ExerciseFailed as err:
        if "No inf checks were recorded" not in str(err):
            raise
        raise ExerciseFailed(f"{err} ({_no_inf_check_advice(watch, per_micro_batch)})") from None


@exercise("amp_step")
@_restores_autocast
def check_amp_step(fn) -> None:
    for dtype in _AMP_ORDER:
        _check_amp_precision(fn, dtype)


def _check_amp_precision(fn: Callable, dtype: torch.dtype) -> None:
    batches, nan_step, overflow_step = _amp_batches(dtype)
    mine, ref = _AmpRun(dtype), _AmpRun(dtype)
    watch = _Watch(mine)
    scaler_note = _("scaler (enabled)") if dtype == torch.float16 else _("scaler (disabled)")
    shown = f"model, inputs, targets, F.cross_entropy, optimizer, {scaler_note}, {dtype}, max_norm={_AMP_MAX_NORM}"
    for step, (x, y) in enumerate(batches):
        before = ref.state()
        mine.overflow = ref.overflow = step == overflow_step
        want = amp_step(ref.model, x.clone(), y.clone(), F.cross_entropy, ref.optimizer, ref.scaler, dtype, _AMP_MAX_NORM)
        watch.clear()
        weights_before, scale_before = _params(mine.model), mine.scaler.get_scale()
        given_x, given_y = x.clone(), y.clone()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = _call_step(fn, (mine.model, given_x, given_y, watch.cross_entropy, mine.optimizer, mine.scaler, dtype,
                                  _AMP_MAX_NORM), "amp_step", shown, watch, _AMP_HINTS)
        mine.overflow = False
        what = _("amp_step with dtype={dtype}, step {step}").format(dtype=dtype, step=step)
        if given_x.dtype != x.dtype or not torch.equal(given_x, x) or not torch.equal(given_y, y):
            raise ExerciseFailed(_("{what}: the caller's inputs or targets changed: leave them as they were").format(what=what))
        _judge_amp_step(what, dtype, step, mine, ref, got, want, watch, caught, weights_before,
                        scale_before, before, x, y, nan_step, overflow_step)


def _judge_precision(what: str, dtype: torch.dtype, mine: _AmpRun, watch: "_Watch", messages: list[str],
                     scale_before: float) -> None:
    """What one step must get right in every precision: float32 weights, the forward and the loss in the right dtype."""
    cast = sorted({_short(p.dtype) for p in mine.model.parameters() if p.dtype != torch.float32})
    if cast:
        raise ExerciseFailed(_("{what}: the model's parameters are now {dtype}: autocast keeps the weights float32 "
                               "and casts per operation; do not cast the model").format(what=what, dtype=cast[0]))
    if any(d != torch.float32 for d in watch.weight_dtypes):
        low = next(d for d in watch.weight_dtypes if d != torch.float32)
        raise ExerciseFailed(_("{what}: the model's weights were {dtype} during the forward pass: autocast keeps the "
                               "weights float32 and casts per operation; do not cast the model, not even for the forward pass").format(
            what=what, dtype=_short(low)))
    if any("target dtype is not supported" in m for m in messages):
        raise ExerciseFailed(_("{what}: torch.autocast(..., dtype=torch.float32) warned and switched itself off: "
                               "for float32, run the forward without autocast (enabled=False)").format(what=what))
    if not watch.forward_dtypes:
        raise ExerciseFailed(_("{what}: the model was never called: run the forward pass on the inputs").format(what=what))
    ran = watch.forward_dtypes[0]
    if ran != dtype:
        if ran == torch.float32 and any("CUDA is not available" in m for m in messages):
            raise ExerciseFailed(_("{what}: autocast was switched off with a warning: device_type='cuda' does nothing for CPU "
                                   "tensors; use the inputs' device type, inputs.device.type").format(what=what))
        if ran == torch.float32:
            raise ExerciseFailed(_("{what}: the forward ran in float32: run the model and the loss under torch.autocast "
                                   "in the dtype you were given, on the inputs' device type").format(what=what))
        if dtype == torch.float32:
            raise ExerciseFailed(_("{what}: the forward ran in {dtype}: with dtype=torch.float32 run it without autocast").format(
                what=what, dtype=_short(ran)))
        raise ExerciseFailed(_("{what}: the forward ran in {dtype}: use the dtype you were given, {expected}").format(
            what=what, dtype=_short(ran), expected=_short(dtype)))
    if not watch.losses:
        raise ExerciseFailed(_("{what}: loss_fn was never called: compute the loss with the loss_fn you were given").format(what=what))
    logits_dtype, loss_dtype = watch.losses[0]
    if loss_dtype in HALF_DTYPES:
        overflow = ""
        if loss_dtype == torch.float16 and scale_before > 65504:
            overflow = _("; scaling a float16 loss by {scale:g}, above float16's largest value 65504, overflows its "
                         "gradient to inf").format(scale=scale_before)
        raise ExerciseFailed(_("{what}: the loss came out {loss_dtype}: it was computed outside autocast on "
                               "{logits_dtype} logits{overflow}; compute it inside the autocast block, where "
                               "autocast runs the loss in float32, or on logits.float()").format(
            what=what, loss_dtype=_short(loss_dtype), logits_dtype=_short(logits_dtype), overflow=overflow))
    if any(watch.backward_autocast):
        raise ExerciseFailed(_("{what}: the backward pass ran inside the autocast block: autocast is for the forward pass and "
                               "the loss; close the block before scaler.scale(loss).backward() (backward runs each op in the "
                               "dtype its forward used)").format(what=what))


def _judge_order(what: str, dtype: torch.dtype, watch: "_Watch") -> None:
    """The order of the scaler's calls within one step, where it changes what happens (an enabled scaler)."""
    log = watch.log
    if dtype != torch.float16:
        return
    if log.count("update") > 1:
        raise ExerciseFailed(_("{what}: scaler.update() ran {n} times in one call: update once per step, "
                               "after scaler.step(optimizer)").format(what=what, n=log.count("update")))
    if "update" in log.events and "step" in log.events and log.events.index("update") < log.events.index("step"):
        raise ExerciseFailed(_("{what}: scaler.update() ran before scaler.step(optimizer): update() picks the next step's scale "
                               "and forgets this step's unscale_, so step() then divided the gradients again; call update() "
                               "last, after step()").format(what=what))


def _judge_skip(what: str, dtype: torch.dtype, cause: str, mine: _AmpRun, ref: _AmpRun, got: Any, watch: "_Watch",
                weights_before: dict[str, torch.Tensor], scale_before: float) -> None:
    """A step the reference skipped: no optimizer step, False returned, and with float16 the scale backed off.

    cause is English (an N_ constant), read here and translated for the messages.
    """
    after = _params(mine.model)
    changed = not all(torch.equal(after[k], weights_before[k]) for k in weights_before)
    log = watch.log
    reason = _(cause)
    if watch.steps or changed:
        if watch.losses and not all(watch.loss_grads) and "NaN" in cause:
            if watch.steps:
                message = _("{what}: {cause}; you left that loss out of backward and the optimizer stepped on the rest: "
                            "skip the whole step when any loss or gradient is inf or NaN")
            else:
                message = _("{what}: {cause}; you left that loss out of backward and the optimizer changed the weights on the rest: "
                            "skip the whole step when any loss or gradient is inf or NaN")
            raise ExerciseFailed(message.format(what=what, cause=reason))
        if "optimizer.step" in log.events and dtype == torch.float16:
            advice = _("step with scaler.step(optimizer), which skips such a step, and never call optimizer.step() yourself")
        elif dtype == torch.float16:
            advice = _("scaler.step(optimizer) found no inf or NaN in the gradients it was given: the step must be skipped "
                       "when the loss or any gradient of this step is inf or NaN")
        else:
            advice = _("a disabled scaler skips nothing, so check that the gradients are finite (clip_grad_norm_ returns their "
                       "total norm) and do not step when they are not")
        if watch.steps:
            message = _("{what}: {cause}, and the optimizer stepped anyway: {advice}")
        else:
            message = _("{what}: {cause}, and the optimizer changed the weights anyway: {advice}")
        raise ExerciseFailed(message.format(what=what, cause=reason, advice=advice))
    if got:
        raise ExerciseFailed(_("{what}: {cause}, and the step was rightly skipped, but you returned True: "
                               "return False for a skipped step").format(what=what, cause=reason))
    if mine.scaler.get_scale() != ref.scaler.get_scale():
        if "unscale_" not in log.events and "step" not in log.events:
            where = _("before backward") if not watch.backwards else _("before scaler.unscale_(optimizer)")
            raise ExerciseFailed(
                _("{what}: {cause}, and you skipped the step {where}, so the scale stayed {scale:g} "
                  "instead of backing off to {expected:g}. update() backs it off only from this step's inf check, "
                  "which scaler.unscale_(optimizer) records: run scaler.scale(loss).backward() and unscale_ even when the loss "
                  "is not finite, skip only the optimizer step, then call scaler.update()").format(
                    what=what, cause=reason, where=where, scale=mine.scaler.get_scale(), expected=ref.scaler.get_scale()))
        if "update" not in log.events:
            raise ExerciseFailed(_("{what}: {cause}; after this skipped step the scale should back off from {before:g} to "
                                   "{expected:g}, it is {got:g}: call scaler.update() on skipped steps too").format(
                what=what, cause=reason, before=scale_before, expected=ref.scaler.get_scale(), got=mine.scaler.get_scale()))
        raise ExerciseFailed(_("{what}: {cause}; after this skipped step the scale should be {expected:g}, "
                               "it is {got:g}").format(
            what=what, cause=reason, expected=ref.scaler.get_scale(), got=mine.scaler.get_scale()))


def _judge_amp_step(what, dtype, step, mine, ref, got, want, watch, caught, weights_before,
                    scale_before, before, x, y, nan_step, overflow_step) -> None:
    _judge_precision(what, dtype, mine, watch, [str(w.message) for w in caught], scale_before)
    if not isinstance(got, bool):
        raise ExerciseFailed(_("{what} returned {type}, expected a Python bool: "
                               "True when the weights were updated, False when the step was skipped").format(
            what=what, type=type_name(got) if got is not None else "None"))
    _judge_order(what, dtype, watch)
    if not want:  # the reference skipped this step
        _judge_skip(what, dtype, _skip_cause(step, nan_step, overflow_step), mine, ref, got, watch, weights_before, scale_before)
        return
    after, expected = _params(mine.model), _params(ref.model)
    name = _first_difference(after, expected, _AMP_ATOL)
    if name is not None or watch.steps != 1:
        for variant, message in _AMP_MISTAKES:  # a typical mistake, when it gives exactly the learner's weights
            if variant == "clip_before_unscale" and dtype != torch.float16:
                continue
            simulated = _AmpRun.from_state(dtype, before)
            _amp_variant(simulated, x.clone(), y.clone(), variant)
            if _same_step(mine, after, simulated):
                raise ExerciseFailed(_("{what}: {problem}").format(what=what, problem=_(message)))
    _judge_good_step(what, got, watch, mine, ref, name, after, expected, _AMP_MAX_NORM, scale_before)


def _same_step(mine: _AmpRun, after: dict[str, torch.Tensor], simulated: _AmpRun) -> bool:
    """The learner's step is the simulated one: the same weights after it, and the same gradients read by the optimizer."""
    if _first_difference(after, _params(simulated.model), _AMP_ATOL) is not None:
        return False
    return _same_grads(mine.grads_at_step, simulated.grads_at_step)


def _same_grads(got: dict[str, torch.Tensor] | None, expected: dict[str, torch.Tensor] | None) -> bool:
    """Equal gradients, relative to the size of the expected ones (a mistake can make them thousands of times smaller)."""
    if got is None or expected is None or got.keys() != expected.keys():
        return got is None and expected is None
    size = max((g.abs().max().item() for g in expected.values()), default=0.0)
    return all(torch.allclose(got[k], expected[k], rtol=1e-2, atol=1e-2 * size + 1e-30) for k in expected)


def _total_norm(grads: dict[str, torch.Tensor]) -> float:
    return nn.utils.get_total_norm(list(grads.values())).item() if grads else 0.0


def _judge_good_step(what: str, got: bool, watch: "_Watch", mine: _AmpRun, ref: _AmpRun, name: str | None,
                     after: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], max_norm: float, scale: float) -> None:
    """A step the reference took: one optimizer step, True returned, the reference's weights and scale."""
    if not watch.steps:
        raise ExerciseFailed(_("{what}: the loss and the gradients of this step are finite in the reference solution, but your "
                               "optimizer did not step: skip only the steps whose loss or gradients are inf or NaN").format(what=what))
    if watch.steps > 1:
        raise ExerciseFailed(_("{what}: the optimizer stepped {n} times: step it once per call").format(what=what, n=watch.steps))
    if not got:
        raise ExerciseFailed(_("{what}: the weights were updated, but you returned False: "
                               "return True when the step was taken").format(what=what))
    if name is not None:
        if not _same_grads(mine.grads_at_step, ref.grads_at_step):
            norm, want = _total_norm(mine.grads_at_step), _total_norm(ref.grads_at_step)
            if mine.scaler.is_enabled() and math.isclose(norm, max_norm / scale, rel_tol=1e-2):
                raise ExerciseFailed(_("{what}: the gradients the optimizer stepped with have a total norm of {norm:.4g}, which is "
                                       "max_norm / scale = {max_norm:g} / {scale:g}: they were clipped while still scaled, then "
                                       "unscaled; call scaler.unscale_(optimizer) first (after the last backward), then clip").format(
                    what=what, norm=norm, max_norm=max_norm, scale=scale))
            if norm == 0:
                raise ExerciseFailed(_("{what}: the gradients the optimizer stepped with were all 0, expected a total norm of "
                                       "{expected:.4g} (after clipping to max_norm)").format(what=what, expected=want))
            raise ExerciseFailed(_("{what}: the gradients the optimizer stepped with have a total norm of {norm:.4g}, expected "
                                   "{expected:.4g} (after clipping to max_norm)").format(what=what, norm=norm, expected=want))
        expect_tensor(after[name], expected[name], what=_("parameter {name!r} after {what}").format(name=name, what=what),
                      atol=_AMP_ATOL, rtol=0.0)
    if mine.scaler.get_scale() != ref.scaler.get_scale():
        raise ExerciseFailed(_("{what}: the scale is {got:g}, expected {expected:g} "
                               "(this scaler doubles it after every good step): call scaler.update() once per step, "
                               "after scaler.step(optimizer)").format(
            what=what, got=mine.scaler.get_scale(), expected=ref.scaler.get_scale()))


# resume_amp: checkpoints written by a run in one precision, resumed by a run in another. The caller's fresh scaler is
# built with settings of its own (not torch's defaults), so that replacing it, resetting it or loading into it all show.

_CKPT_KEYS = ("model", "optimizer", "scaler", "step")


def _trained_run(dtype: torch.dtype, steps: int, seed: int = 5, init_scale: float = 2.0 ** 18) -> _AmpRun:
    run = _AmpRun(dtype, seed)
    run.scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=3, enabled=dtype == torch.float16)
    g = torch.Generator().manual_seed(800)
    for _step in range(steps):
        x, y = 3 * torch.randn(9, 6, generator=g), torch.randint(0, 3, (9,), generator=g)
        amp_step(run.model, x, y, F.cross_entropy, run.optimizer, run.scaler, dtype, _AMP_MAX_NORM)
    return run


def _continue(run: _AmpRun, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _step in range(steps):
        x, y = 3 * torch.randn(9, 6, generator=g), torch.randint(0, 3, (9,), generator=g)
        amp_step(run.model, x, y, F.cross_entropy, run.optimizer, run.scaler, run.dtype, _AMP_MAX_NORM)


# (precision of the run that saved, precision of the run that resumes, steps before the save)
_RESUME_CASES = [(torch.float16, torch.float16, 7), (torch.bfloat16, torch.float16, 4), (torch.float16, torch.bfloat16, 5),
                 (torch.float32, torch.float16, 3)]
_RESUME_INIT_SCALE, _RESUME_GROWTH_INTERVAL = 2.0 ** 12, 5

_RESUME_HINTS = {  # {torch's words: advice}; call() translates the advice (never formatted: its {} is an empty dict)
    "The source state dict is empty": N_("this checkpoint comes from a run without loss scaling (bfloat16 or float32), whose "
                                         "disabled scaler saved {}; an enabled scaler refuses it: load the scaler's state only "
                                         "when the checkpoint holds one, and otherwise keep the fresh scaler you were given"),
    "Unexpected key(s) in state_dict": N_("each object takes its own entry: model.load_state_dict(checkpoint['model']), and so on"),
    "Weights only load failed": N_("the file holds only tensors, dicts and numbers: torch.load(path, weights_only=True) reads it"),
    "_scale is None": N_("the scaler you were given is fresh and has no scale yet, so update() cannot set one: restore its whole "
                         "state with scaler.load_state_dict(checkpoint['scaler'])"),
    "on a CUDA device but torch.cuda.is_available() is False": N_("this machine has no GPU: load to the CPU, map_location='cpu'"),
}


class _LoadLog:
    """Wraps the load_state_dict of the caller's model, optimizer and scaler: which ran, and what each raised."""

    def __init__(self, **objects: Any):
        self.calls: list[tuple[str, BaseException | None]] = []
        for name, obj in objects.items():
            obj.load_state_dict = self._recorded(name, obj.load_state_dict)

    def _recorded(self, name: str, method: Callable) -> Callable:
        def run(*args, **kwargs):
            try:
                result = method(*args, **kwargs)
            except BaseException as err:
                self.calls.append((name, err))
                raise
            self.calls.append((name, None))
            return result
        return run

    def swallowed(self) -> str:
        """The first error a load_state_dict raised inside the learner's function, which their code caught; '' if none."""
        name, err = next(((n, e) for n, e in self.calls if e is not None), ("", None))
        if err is None:
            return ""
        return _("; inside your function, {name}.load_state_dict raised {error} ({message}), and your code "
                 "caught it, so what came after it never ran").format(name=name, error=type(err).__name__, message=first_line(err))


class _LoadWatch:
    """Stands in for torch.load during a check, recording the weights_only argument of every call."""

    def __init__(self):
        self.weights_only: list[Any] = []
        self.real = torch.load

    def __call__(self, *args, **kwargs):
        self.weights_only.append(kwargs.get("weights_only", "default"))
        return self.real(*args, **kwargs)


def _resume_fault(what: str, resumed: _AmpRun, saved: dict, fresh_state: dict, resume_dtype: torch.dtype, swallowed: str = "") -> None:
    """The model, the optimizer and the scaler after resume_amp, against what each should hold."""
    if not _same_tree(resumed.model.state_dict(), saved["model"]):
        raise ExerciseFailed(_("{what}: the model's weights are not the saved ones{swallowed}: load checkpoint['model'] into the "
                               "model you were given").format(what=what, swallowed=swallowed))
    if not _same_tree(resumed.optimizer.state_dict(), saved["optimizer"]):
        raise ExerciseFailed(_("{what}: the optimizer's state (its momentum buffers) is not the saved one{swallowed}: "
                               "load checkpoint['optimizer'] into the optimizer you were given").format(what=what, swallowed=swallowed))
    state = resumed.scaler.state_dict()
    if resume_dtype != torch.float16:
        if resumed.scaler.is_enabled():
            raise ExerciseFailed(_("{what}: the scaler you were given is now enabled: this run needs no loss scaling; "
                                   "leave it disabled").format(what=what))
        return
    if saved["scaler"]:
        if state == saved["scaler"]:
            return
        if state == fresh_state:
            raise ExerciseFailed(_("{what}: the scaler you were given still has its fresh state (scale {fresh:g}), "
                                   "not the saved one (scale {saved:g}): load checkpoint['scaler'] into it").format(
                what=what, fresh=fresh_state["scale"], saved=saved["scaler"]["scale"]))
        key = next(k for k in saved["scaler"] if state.get(k) != saved["scaler"][k])
        raise ExerciseFailed(_("{what}: the scaler's {key!r} is {got!r}, saved {saved!r}: "
                               "load the whole of checkpoint['scaler'] with scaler.load_state_dict").format(
            what=what, key=key, got=state.get(key), saved=saved["scaler"][key]))
    if state != fresh_state:
        raise ExerciseFailed(_("{what}: this checkpoint holds no scaler state (its run had no loss scaling), so the fresh scaler "
                               "you were given should stay as it was, {fresh}; it is now {state}").format(
            what=what, fresh=fresh_state, state=state))


def _call_resume(fn: Callable, args: tuple, shown: str, resumed: _AmpRun, resume_dtype: torch.dtype) -> Any:
    """The learner's resume_amp through call(), with what their own objects show about an error it raised."""
    try:
        return call(fn, *args, name="resume_amp", shown=shown, hints=_RESUME_HINTS)
    except ExerciseFailed as err:
        if resume_dtype != torch.float16 and resumed.scaler.is_enabled():
            raise ExerciseFailed(_("{error} (the scaler you were given, disabled for this {dtype} run, was switched "
                                   "on: leave it disabled; loading into a disabled scaler does nothing)").format(
                error=err, dtype=_short(resume_dtype))) from None
        # err.__context__: what the learner's function raised (call() says "raised" in the learner's language)
        if type(err.__context__) is KeyError:
            raise ExerciseFailed(_("{error} (save_amp_checkpoint's keys are 'model', 'optimizer', 'scaler' and 'step')").format(
                error=err)) from None
        raise


@exercise("resume_amp")
@_restores_autocast
def check_resume_amp(fn) -> None:
    for saved_dtype, resume_dtype, step in _RESUME_CASES:
        original = _trained_run(saved_dtype, step)
        if resume_dtype == torch.float16:
            shown = _("path (a {saved_dtype} run's checkpoint, step {step}), model, optimizer, "
                      "scaler (fresh, for a {resume_dtype} run)")
        else:
            shown = _("path (a {saved_dtype} run's checkpoint, step {step}), model, optimizer, "
                      "scaler (disabled, for a {resume_dtype} run)")
        shown = shown.format(saved_dtype=_short(saved_dtype), step=step, resume_dtype=_short(resume_dtype))
        what = f"resume_amp({shown})"
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "amp.pt"
            save_amp_checkpoint(path, original.model, original.optimizer, original.scaler, step)
            saved = torch.load(path, weights_only=True)
            resumed = _AmpRun(resume_dtype, seed=9)
            resumed.scaler = torch.amp.GradScaler("cpu", init_scale=_RESUME_INIT_SCALE, growth_interval=_RESUME_GROWTH_INTERVAL,
                                                  enabled=resume_dtype == torch.float16)
            fresh_state = resumed.scaler.state_dict()
            parameters = list(resumed.model.parameters())
            loads = _LoadWatch()
            log = _LoadLog(model=resumed.model, optimizer=resumed.optimizer, scaler=resumed.scaler)
            with mock.patch.object(torch, "load", loads):
                got = _call_resume(fn, (path, resumed.model, resumed.optimizer, resumed.scaler), shown, resumed, resume_dtype)
        if False in loads.weights_only:
            raise ExerciseFailed(_("{what}: you read the file with torch.load(..., weights_only=False), which runs whatever code "
                                   "a file carries: this one holds only tensors, dicts and numbers, so read it with weights_only=True").format(
                what=what))
        if "default" in loads.weights_only:
            raise ExerciseFailed(_("{what}: you called torch.load without weights_only=True: pass it, as the exercise asks; it is "
                                   "the default only since torch 2.6, and saying it keeps a file from running code on any version").format(
                what=what))
        if isinstance(got, torch.Tensor) and got.numel() == 1 and got.item() == step:
            raise ExerciseFailed(_("{what} returned a tensor, expected the Python int {step}").format(what=what, step=step))
        if isinstance(got, int) and not isinstance(got, bool) and got == step + 1:
            raise ExerciseFailed(_("{what} returned {got}, expected {step}: return the step stored in the checkpoint, "
                                   "not the next one").format(what=what, got=got, step=step))
        expect_equal(got, step, what=what)
        if any(p is not q for p, q in zip(resumed.model.parameters(), parameters)) or len(list(resumed.model.parameters())) != len(parameters):
            raise ExerciseFailed(_("{what}: the model's parameters were replaced by new tensors (load_state_dict(..., assign=True) "
                                   "does that), so the optimizer you were given no longer holds them and would train nothing: "
                                   "load without assign, which copies the saved values into the existing parameters").format(what=what))
        if any(not m.training for m in resumed.model.modules()):
            raise ExerciseFailed(_("{what}: the model is now in eval mode; it was in training mode: a resumed run goes on "
                                   "training, so leave the model's mode as the caller set it").format(what=what))
        _resume_fault(what, resumed, saved, fresh_state, resume_dtype, log.swallowed())
        if saved_dtype == resume_dtype:  # the real test: the resumed run goes on exactly as the uninterrupted one
            _continue(original, 4, seed=802)
            try:
                _continue(resumed, 4, seed=802)
            except Exception as err:  # noqa: BLE001 -- what the learner's resumed objects did, reported as theirs
                raise ExerciseFailed(_("{what}: after your resume_amp, training on raised {error}: {message}").format(
                    what=what, error=type(err).__name__, message=first_line(err))) from None
            if not _same_tree(_params(resumed.model), _params(original.model)) or resumed.scaler.state_dict() != original.scaler.state_dict():
                raise ExerciseFailed(_("{what}: the resumed run does not go on as the uninterrupted run does").format(what=what))


# accumulate_step: as amp_step, over micro-batches of different sizes (the last one is often smaller). The same steps go
# wrong on purpose: an inf in one micro-batch, an overflow in backward, and float16's own overflows as its scale grows.

_ACC_SIZES = [(6, 6, 3), (4, 4, 4, 4), (7, 2), (5,), (3, 5, 4), (2, 6)]
_ACC_MAX_NORM = 0.8


def _accumulate_batches(dtype: torch.dtype) -> tuple[list[list[tuple[torch.Tensor, torch.Tensor]]], int, int]:
    """The hidden micro-batches of one precision, step by step, and the steps whose loss is NaN and whose backward overflows."""
    g = torch.Generator().manual_seed(700 + _AMP_ORDER.index(dtype))
    steps = [[(3 * torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)) for n in sizes] for sizes in _ACC_SIZES]
    nan_step, overflow_step = (1 + torch.randperm(len(steps) - 1, generator=g)[:2]).tolist()
    steps[nan_step][-1][0][0, 2] = float("inf")  # an inf input in the last micro-batch: its loss is NaN
    return steps, nan_step, overflow_step


def _accumulate_variant(run: _AmpRun, micro: list, variant: str) -> None:
    """One accumulation step done one of the typical wrong ways (the diagnosis compares the learner's step with these)."""
    model, optimizer, scaler, dtype = run.model, run.optimizer, run.scaler, run.dtype
    total, k = sum(len(y) for _x, y in micro), len(micro)
    weight = {"mean_of_means": lambda n: 1 / k, "sum_of_means": lambda n: 1.0,
              "over_total": lambda n: 1 / total}.get(variant, lambda n: n / total)
    if variant != "no_zero":
        optimizer.zero_grad(set_to_none=True)
    for x, y in micro:
        if variant == "zero_each":
            optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            loss = F.cross_entropy(model(x), y) * weight(len(y))
        scaler.scale(loss).backward()
    if variant == "clip_before_unscale":
        nn.utils.clip_grad_norm_(model.parameters(), _ACC_MAX_NORM)
        scaler.unscale_(optimizer)
    else:
        scaler.unscale_(optimizer)
        if variant != "no_clip":
            nn.utils.clip_grad_norm_(model.parameters(), _ACC_MAX_NORM)
    scaler.step(optimizer)
    scaler.update()


def _accumulate_mistakes(micro: list) -> list[tuple[str, str]]:
    sizes, k, total = [len(y) for _x, y in micro], len(micro), sum(len(y) for _x, y in micro)
    return [
        ("mean_of_means", _("each micro-batch's loss was divided by the number of micro-batches, {k}, which weights every sample of a "
                            "smaller micro-batch more (sizes here: {sizes}): weight each loss by its share of the samples, "
                            "len(targets) / (all the samples of the step)").format(k=k, sizes=sizes)),
        ("sum_of_means", _("the {k} micro-batch losses were added up unweighted, so the gradient is that of their sum, not of the "
                           "mean over all the samples: weight each loss by its share of the samples").format(k=k)),
        ("over_total", _("each micro-batch's loss, already a mean over its own samples, was divided by all the samples of the step, "
                         "{total}: weight it by its share instead, len(targets) / {total}").format(total=total)),
        ("zero_each", _("the gradients were cleared before each micro-batch, so only the last one counted: clear them once, "
                        "before the first micro-batch")),
        ("no_clip", _("the gradients were not clipped: clip their total norm to max_norm after the last micro-batch")),
        ("no_zero", _("old gradients were still in .grad: clear them once, at the start of the step")),
        ("clip_before_unscale", _("the gradients were clipped while still scaled: call scaler.unscale_(optimizer) once, after the "
                                  "last micro-batch's backward, then clip")),
    ]


_ACC_HINTS = {**_AMP_HINTS,  # call() translates the advice
              "unscale_() has already been called": N_("unscale_ once per step, after the last micro-batch's backward: "
                                                       "the scaled gradients of every micro-batch must be added up first")}


@exercise("accumulate_step")
@_restores_autocast
def check_accumulate_step(fn) -> None:
    for dtype in _AMP_ORDER:
        _check_accumulate_precision(fn, dtype)


def _check_accumulate_precision(fn: Callable, dtype: torch.dtype) -> None:
    steps, nan_step, overflow_step = _accumulate_batches(dtype)
    mine, ref = _AmpRun(dtype), _AmpRun(dtype)
    watch = _Watch(mine)
    scaler_note = _("scaler (enabled)") if dtype == torch.float16 else _("scaler (disabled)")
    for step, micro in enumerate(steps):
        sizes = [len(y) for _x, y in micro]
        batches = ngettext("{n} micro-batch of {sizes} rows", "{n} micro-batches of {sizes} rows", len(micro))
        shown = (f"model, {batches.format(n=len(micro), sizes=', '.join(map(str, sizes)))}, "
                 "F.cross_entropy, optimizer, "
                 f"{scaler_note}, {dtype}, max_norm={_ACC_MAX_NORM}")
        what = _("accumulate_step with dtype={dtype}, step {step} ({batches})").format(
            dtype=dtype, step=step, batches=batches.format(n=len(micro), sizes=sizes))
        before = mine.state()  # the mistakes are simulated from the learner's own state, which may differ within tolerance
        mine.overflow = ref.overflow = step == overflow_step
        want = accumulate_step(ref.model, [(x.clone(), y.clone()) for x, y in micro], F.cross_entropy, ref.optimizer,
                               ref.scaler, dtype, _ACC_MAX_NORM)
        watch.clear()
        weights_before, scale_before = _params(mine.model), mine.scaler.get_scale()
        given = [(x.clone(), y.clone()) for x, y in micro]
        listed = list(given)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = _call_step(fn, (mine.model, listed, watch.cross_entropy, mine.optimizer, mine.scaler, dtype, _ACC_MAX_NORM),
                             "accumulate_step", shown, watch, _ACC_HINTS, per_micro_batch=True)
        mine.overflow = False
        if listed != given or any(not torch.equal(a, x) or not torch.equal(b, y) for (a, b), (x, y) in zip(given, micro)):
            raise ExerciseFailed(_("{what}: the caller's list of micro-batches, or a tensor in it, changed: "
                                   "leave them as they were").format(what=what))
        _judge_precision(what, dtype, mine, watch, [str(w.message) for w in caught], scale_before)
        if watch.forward_rows != sizes:
            if sum(watch.forward_rows) == sum(sizes) and len(watch.forward_rows) < len(sizes):
                raise ExerciseFailed(_("{what}: the model ran on {rows} rows at a time: run it on each micro-batch "
                                       "on its own ({sizes} rows), as accumulation exists so that a large batch never has to be "
                                       "in memory at once").format(what=what, rows=watch.forward_rows, sizes=sizes))
            raise ExerciseFailed(_("{what}: the model ran on batches of {rows} rows, expected one call per "
                                   "micro-batch, {sizes}").format(what=what, rows=watch.forward_rows, sizes=sizes))
        if not isinstance(got, bool):
            raise ExerciseFailed(_("{what} returned {type}, expected a Python bool: "
                                   "True when the weights were updated, False when the step was skipped").format(
                what=what, type=type_name(got) if got is not None else "None"))
        if watch.steps > 1:
            raise ExerciseFailed(_("{what}: the optimizer stepped {n} times in one call: step once, after the last micro-batch").format(
                what=what, n=watch.steps))
        if watch.log.count("update") > 1:
            raise ExerciseFailed(_("{what}: scaler.update() ran {n} times in one call: every micro-batch "
                                   "of a step must be scaled by the same scale, so update once, after the step").format(
                what=what, n=watch.log.count("update")))
        _judge_order(what, dtype, watch)
        if not want:
            cause = (N_("the loss of one micro-batch was NaN (an inf in its inputs)") if step == nan_step else
                     _skip_cause(step, nan_step, overflow_step))  # English: _judge_skip reads it, then translates it
            _judge_skip(what, dtype, cause, mine, ref, got, watch, weights_before, scale_before)
            continue
        after, expected = _params(mine.model), _params(ref.model)
        name = _first_difference(after, expected, _AMP_ATOL)
        if name is not None:
            for variant, message in _accumulate_mistakes(micro):
                if (variant == "clip_before_unscale" and dtype != torch.float16) or (variant != "no_clip" and len(micro) == 1
                                                                                     and variant != "clip_before_unscale"):
                    continue
                simulated = _AmpRun.from_state(dtype, before)
                _accumulate_variant(simulated, [(x.clone(), y.clone()) for x, y in micro], variant)
                if _same_step(mine, after, simulated):
                    raise ExerciseFailed(_("{what}: {problem}").format(what=what, problem=message))
        _judge_good_step(what, got, watch, mine, ref, name, after, expected, _ACC_MAX_NORM, scale_before)
