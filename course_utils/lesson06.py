"""Lesson 06 (mixed precision): reference solutions and the checks for its exercises."""

import functools
import warnings
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from course_utils.tooling.checks import ExerciseFailed, call, exercise, expect_equal, expect_tensor, type_name, scoreboard_for

scoreboard = scoreboard_for(__name__)  # the lesson's last cell: this session's verdicts


# Reference solutions. The checks compare the learner's answers with these.

def fits_in_range(x: torch.Tensor, dtype: torch.dtype) -> bool:
    """True when casting x to the float dtype overflows nothing: every |value| <= torch.finfo(dtype).max."""
    return bool(x.abs().max() <= torch.finfo(dtype).max)


def autocast_forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """model(x) computed under autocast in bfloat16 on x's device; the model's weights stay float32."""
    with torch.autocast(device_type=x.device.type, dtype=torch.bfloat16):
        return model(x)


def saved_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes of the tensors autograd saves for backward during model(x): each storage once, parameters excluded."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    sizes = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            sizes[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(x)
    return sum(sizes.values())


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


def scaled_step(model: nn.Module, loss: torch.Tensor, optimizer: torch.optim.Optimizer,
                scaler: torch.amp.GradScaler, max_norm: float) -> None:
    """One mixed-precision step: backward on the scaled loss, unscale, clip to max_norm, step (or skip), update the scale."""
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()


def accumulate_scaled(model: nn.Module, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], loss_fn: Callable,
                      optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler) -> None:
    """One optimizer step over all micro-batches: fp16 autocast forward, scaled backward of loss / k each, one step and update."""
    optimizer.zero_grad()
    k = len(micro_batches)
    for inputs, targets in micro_batches:
        with torch.autocast(device_type=inputs.device.type, dtype=torch.float16):
            loss = loss_fn(model(inputs), targets) / k
        scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()


# Shared helpers for the checks.

def _restores_autocast(fn: Callable) -> Callable:
    """Run fn without leaving CPU autocast switched on (@exercise already leaves the RNG alone)."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        enabled, dtype = torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")
        try:
            return fn(*args, **kwargs)
        finally:
            torch.set_autocast_enabled("cpu", enabled)
            torch.set_autocast_dtype("cpu", dtype)
    return run


def _net(seed: int, sizes: tuple[int, ...] = (6, 8, 3)) -> nn.Module:
    torch.manual_seed(seed)  # the check's own stream: @exercise forks the RNG
    layers = []
    for a, b in zip(sizes, sizes[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def _batch(n: int, seed: int, n_features: int = 6, n_classes: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, n_features, generator=g), torch.randint(0, n_classes, (n,), generator=g)


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 1e-6) -> bool:
    return all(torch.allclose(a[k], b[k], atol=atol, rtol=1e-5, equal_nan=True) for k in a)


def _kind(value) -> str:
    kind = type(value)
    return kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__.split('.')[0]}.{kind.__qualname__}"


def _scaler(init_scale: float) -> torch.amp.GradScaler:
    # growth_interval=1: a good step doubles the scale, so a missing update() shows at once.
    return torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=1)


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
        if got is not None and not isinstance(got, bool) and type(got).__name__ in ("bool_", "bool"):
            raise ExerciseFailed(f"{what} is a {_kind(got)}, expected a Python bool: wrap it in bool(...)")
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


@exercise("autocast_forward")
@_restores_autocast
def check_autocast_forward(fn) -> None:
    model = _net(1, (12, 32, 32, 5))
    x = _batch(16, 2, n_features=12)[0]
    expected = autocast_forward(model, x)
    in_fp32 = model(x)
    shown = "model (float32 weights), tensor of shape (16, 12)"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = call(fn, model, x.clone(), shown=shown, hints={
            "must have the same dtype": "the weights and the input differ in dtype: leave the model as it is, autocast casts per op",
        })
    left_on = torch.is_autocast_enabled("cpu")
    if left_on:
        raise ExerciseFailed("autocast was still switched on after your function returned: use it as a `with torch.autocast(...):` block")
    changed = sorted({str(p.dtype) for p in model.parameters() if p.dtype != torch.float32})
    if changed:
        raise ExerciseFailed(
            f"the model's parameters are now {changed[0]}: .to(torch.bfloat16) casts the weights themselves; "
            "autocast keeps them float32 and casts per operation"
        )
    if isinstance(got, torch.Tensor) and got.dtype == torch.float16:
        raise ExerciseFailed("the output is float16: on the CPU use dtype=torch.bfloat16 (float16 matmuls are very slow on most CPUs, section 3)")
    if isinstance(got, torch.Tensor) and got.dtype == torch.float32:
        if any("CUDA is not available" in str(w.message) for w in caught):
            raise ExerciseFailed(
                "autocast was disabled with a warning: device_type='cuda' does nothing for CPU tensors; use device_type=x.device.type"
            )
        if torch.equal(got, expected.float()):
            raise ExerciseFailed("the output was converted back to float32: return the bfloat16 logits as autocast gives them, no .float()")
        raise ExerciseFailed(
            "the output is float32, so nothing ran in lower precision: "
            "call the model inside `with torch.autocast(device_type=x.device.type, dtype=torch.bfloat16):`"
        )
    expect_tensor(got, expected, what=f"autocast_forward({shown})", atol=5e-2, rtol=2e-2)
    if not got.requires_grad:
        raise ExerciseFailed("the output does not require grad: keep autograd recording (no torch.no_grad()), the logits are for training")
    if torch.equal(got, in_fp32.to(torch.bfloat16)) and not torch.equal(expected, in_fp32.to(torch.bfloat16)):
        raise ExerciseFailed(
            "the model ran in float32 and only the result was cast: run the forward itself under torch.autocast, "
            "so that the matmuls compute in bfloat16"
        )


def _saved_records(model: nn.Module, x: torch.Tensor) -> list[tuple[int, int, int, int, bool]]:
    """(storage pointer, storage bytes, numel, element size, is a parameter) of every tensor saved during model(x)."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    records = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        records.append((s.data_ptr(), s.nbytes(), t.numel(), t.element_size(), s.data_ptr() in parameters))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    del out
    return records


def _unique(records, with_params: bool = False):
    seen = {}
    for r in records:
        if with_params or not r[4]:
            seen.setdefault(r[0], r)
    return list(seen.values())


_SAVED_MISTAKES = [
    (lambda rs: sum(r[2] for r in _unique(rs)),
     "that is the number of elements: count bytes, numel() * element_size()"),
    (lambda rs: sum(4 * r[2] for r in _unique(rs)),
     "every element was counted as 4 bytes: under autocast the saved tensors are bfloat16, 2 bytes each; use element_size()"),
    (lambda rs: sum(r[1] for r in rs if not r[4]),
     "the same tensor was counted more than once (e.g. a ReLU output is saved by the ReLU and by the next Linear): "
     "count each storage once, keyed by untyped_storage().data_ptr()"),
    (lambda rs: sum(r[1] for r in _unique(rs, with_params=True)),
     "the model's parameters were counted: they are in memory whether or not autograd saves them; skip them"),
    (lambda rs: sum(r[1] for r in rs),
     "parameters were counted, and tensors saved twice were counted twice: skip the parameters and count each storage once"),
]


@exercise("saved_bytes")
@_restores_autocast
def check_saved_bytes(fn) -> None:
    model = _net(3, (10, 24, 24, 3))
    x = _batch(16, 4, n_features=10)[0]
    for amp in (False, True):
        context = "under CPU bf16 autocast" if amp else "in float32"
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            records = _saved_records(model, x)
            got = call(fn, model, x.clone(), shown="model (Linear, ReLU, Linear, ReLU, Linear), tensor of shape (16, 10)")
        expected = sum(r[1] for r in _unique(records))
        what = f"saved_bytes(model, x) {context}"
        if isinstance(got, torch.Tensor):
            raise ExerciseFailed(f"{what} is a tensor, expected a Python int: call .item() on it")
        if got is None:
            raise ExerciseFailed(f"{what} is None: did you forget to `return` the total?")
        if isinstance(got, bool) or not isinstance(got, (int, float)) or (isinstance(got, float) and not got.is_integer()):
            shown = repr(got) if isinstance(got, (int, float, str)) else f"a {type_name(got)}"
            raise ExerciseFailed(f"{what} is {shown}, expected a whole number of bytes (a Python int)")
        if got == expected:
            continue
        if got == 0:
            raise ExerciseFailed(
                f"{what} is 0: nothing was saved; run model(x) with autograd recording (no torch.no_grad()) "
                "inside torch.autograd.graph.saved_tensors_hooks(pack, unpack)"
            )
        for rule, message in _SAVED_MISTAKES:
            if got == rule(records) != expected:
                raise ExerciseFailed(f"{what} is {int(got):,}, expected {expected:,}: {message}")
        raise ExerciseFailed(f"{what} is {int(got):,}, expected {expected:,} bytes")


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
]

_SCHEDULE_MISTAKES = [
    (dict(reset_on_inf=False), "after an inf/NaN step the count of good steps starts again from 0"),
    (dict(off_by_one=True), "the scale doubles on the growth_interval-th good step in a row, not on the one after it"),
    (dict(reset_on_growth=False), "after the scale doubles, the count of good steps starts again from 0"),
    (dict(before=True), "return the scale after each step's update(), not the scale the step used"),
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


_STEP_LR, _STEP_MAX_NORM, _STEP_SCALE = 0.5, 0.05, 1024.0
_NOT_SCALED = {"_scale is None": "the scaler has not scaled anything yet: call scaler.scale(loss).backward(), not loss.backward()"}


def _step_problem(inf: bool):
    model = _net(7)
    x, y = _batch(8, 8)
    if inf:
        x[0, 0] = float("inf")  # an overflow in the forward: the loss and the gradients become inf/NaN
    return model, x, y


def _step_variant(inf: bool, variant: str) -> dict[str, torch.Tensor]:
    """The weights after one step done right, or done one of the typical wrong ways."""
    model, x, y = _step_problem(inf)
    optimizer = torch.optim.SGD(model.parameters(), lr=_STEP_LR)
    scaler = _scaler(_STEP_SCALE)
    loss = F.cross_entropy(model(x), y)
    clip = lambda: nn.utils.clip_grad_norm_(model.parameters(), _STEP_MAX_NORM)
    scaler.scale(loss).backward()
    if variant == "clip_before_unscale":
        clip()
        scaler.step(optimizer)
        scaler.update()
        return _params(model)
    scaler.unscale_(optimizer)
    if variant != "no_clip":
        clip()
    if variant == "update_before_step":
        scaler.update()
        scaler.step(optimizer)
    else:
        scaler.step(optimizer)
        scaler.update()
    return _params(model)


_STEP_MISTAKES = [
    ("clip_before_unscale",
     "the gradients were clipped while still scaled: call scaler.unscale_(optimizer) before clip_grad_norm_, "
     "or max_norm is compared with gradients scale times too large"),
    ("no_clip", "the gradients were not clipped: call nn.utils.clip_grad_norm_(model.parameters(), max_norm) between unscale_ and step"),
    ("update_before_step", "call scaler.update() after scaler.step(optimizer), not before: update() starts the next step's bookkeeping"),
]


@exercise("scaled_step")
@_restores_autocast
def check_scaled_step(fn) -> None:
    shown = f"model, loss, optimizer, scaler (scale {_STEP_SCALE:g}), max_norm={_STEP_MAX_NORM}"
    for inf in (False, True):
        model, x, y = _step_problem(inf)
        optimizer = torch.optim.SGD(model.parameters(), lr=_STEP_LR)
        scaler = _scaler(_STEP_SCALE)
        before = _params(model)
        loss = F.cross_entropy(model(x), y)
        call(fn, model, loss, optimizer, scaler, _STEP_MAX_NORM, shown=shown, hints={
            "unscale_() has already been called": "call scaler.unscale_(optimizer) once per step, before clipping; scaler.step() knows",
            **_NOT_SCALED,
        })
        after = _params(model)
        if inf:
            if any(not torch.isfinite(p).all() for p in after.values()):
                raise ExerciseFailed(
                    "with an inf/NaN gradient the weights became inf/NaN: step with scaler.step(optimizer), "
                    "which skips the step when unscale_ found an inf or NaN, not optimizer.step()"
                )
            if not _same(after, before, atol=0.0):
                raise ExerciseFailed("with an inf/NaN gradient the weights still changed: the step must be skipped; use scaler.step(optimizer)")
            if scaler.get_scale() != _STEP_SCALE / 2:
                raise ExerciseFailed(
                    f"after a skipped step the scale should halve to {_STEP_SCALE / 2:g}, it is {scaler.get_scale():g}: "
                    "call scaler.update() after scaler.step(optimizer)"
                )
            continue
        if _same(after, before, atol=0.0):
            if all(p.grad is None for p in model.parameters()):
                raise ExerciseFailed("no gradients were computed: call scaler.scale(loss).backward()")
            raise ExerciseFailed("the weights did not change: call scaler.step(optimizer) after clipping")
        if scaler.get_scale() == _STEP_SCALE:
            raise ExerciseFailed(
                f"the scale stayed {_STEP_SCALE:g} after a good step (this scaler doubles it after every good step): "
                "call scaler.update() after scaler.step(optimizer)"
            )
        expected = _step_variant(False, "right")
        if _same(after, expected):
            continue
        for variant, message in _STEP_MISTAKES:
            if _same(after, _step_variant(False, variant)):
                raise ExerciseFailed(message)
        name = next(k for k in expected if not torch.allclose(after[k], expected[k], atol=1e-6))
        expect_tensor(after[name], expected[name], what=f"parameter {name!r} after one scaled_step", atol=1e-6)


_ACC_K, _ACC_SCALE, _ACC_LR = 4, 256.0, 0.5


def _acc_problem():
    model = _net(11)
    micro_batches = [_batch(5, 20 + i) for i in range(_ACC_K)]
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.25)  # gradients left over from an earlier step
    return model, micro_batches


def _acc_variant(variant: str) -> dict[str, torch.Tensor]:
    """The weights after accumulate_scaled done right, or one typical wrong way."""
    model, micro_batches = _acc_problem()
    optimizer = torch.optim.SGD(model.parameters(), lr=_ACC_LR)
    scaler = _scaler(_ACC_SCALE)
    if variant != "no_zero_grad":
        optimizer.zero_grad()
    for inputs, targets in micro_batches:
        if variant == "zero_inside":
            optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(inputs), targets)
        if variant != "undivided":
            loss = loss / _ACC_K
        scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    return _params(model)


_ACC_MISTAKES = [
    ("undivided", f"the step is {_ACC_K}x too large: divide each micro-batch's loss by the number of micro-batches ({_ACC_K}) before scaling it"),
    ("no_zero_grad", "old gradients were still in .grad: call optimizer.zero_grad() once, before the loop"),
    ("zero_inside", "only the last micro-batch's gradient was used: zero the gradients once, before the loop, not inside it"),
]


@exercise("accumulate_scaled")
@_restores_autocast
def check_accumulate_scaled(fn) -> None:
    model, micro_batches = _acc_problem()
    optimizer = torch.optim.SGD(model.parameters(), lr=_ACC_LR)
    scaler = _scaler(_ACC_SCALE)
    steps, dtypes = [], []
    optimizer.register_step_post_hook(lambda *args: steps.append(1))
    model[0].register_forward_hook(lambda module, inputs, output: dtypes.append(output.dtype))
    call(fn, model, [(x.clone(), y.clone()) for x, y in micro_batches], F.cross_entropy, optimizer, scaler,
         shown=f"model, {_ACC_K} micro-batches of 5, F.cross_entropy, optimizer, scaler (scale {_ACC_SCALE:g})",
         hints={"unscale_() has already been called": "step and update once, after all micro-batches", **_NOT_SCALED})
    if not dtypes:
        raise ExerciseFailed("the model was never called: run the forward of every micro-batch")
    if any(d != torch.float16 for d in dtypes):
        found = next(d for d in dtypes if d != torch.float16)
        raise ExerciseFailed(
            f"the forward ran in {found}: run it under `with torch.autocast(device_type=inputs.device.type, dtype=torch.float16):` "
            "(fp16 is what the scaler is for)"
        )
    if len(steps) > 1:
        raise ExerciseFailed(f"the optimizer stepped {len(steps)} times: call scaler.step(optimizer) and scaler.update() once, after the loop")
    if not steps:
        raise ExerciseFailed("the optimizer never stepped: call scaler.step(optimizer) after the loop")
    if scaler.get_scale() == _ACC_SCALE:
        raise ExerciseFailed(
            f"the scale stayed {_ACC_SCALE:g} after a good step (this scaler doubles it after every good step): "
            "call scaler.update() after scaler.step(optimizer)"
        )
    if scaler.get_scale() != 2 * _ACC_SCALE:
        raise ExerciseFailed(f"the scale is {scaler.get_scale():g}, expected {2 * _ACC_SCALE:g}: call scaler.update() once per optimizer step")
    got, expected = _params(model), _acc_variant("right")
    if _same(got, expected, atol=1e-5):
        return
    for variant, message in _ACC_MISTAKES:
        if _same(got, _acc_variant(variant), atol=1e-5):
            raise ExerciseFailed(message)
    name = next(k for k in expected if not torch.allclose(got[k], expected[k], atol=1e-5))
    expect_tensor(got[name], expected[name], what=f"parameter {name!r} after accumulate_scaled", atol=1e-5)

