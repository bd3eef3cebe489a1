"""Lesson 08 (hooks and debugging): reference solutions and the checks for its exercises."""

import functools
import math
import os
import re
import warnings
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.profiler_util import EventList, FunctionEventAvg
from torch.utils.checkpoint import checkpoint
from torch.utils.hooks import RemovableHandle

from course_utils.tooling.checks import ExerciseFailed, call, exercise, expect_tensor, expect_unchanged, type_name, scoreboard_for

scoreboard = scoreboard_for(__name__)  # the lesson's last cell: this session's verdicts


# Reference solutions. The checks compare the learner's answers with these.

def capture_activations(model: nn.Module, x: torch.Tensor, layer_names: list[str]) -> dict[str, torch.Tensor]:
    """Run model(x) once; return {name: that sub-module's output, detached} for each name, with every hook removed."""
    modules = dict(model.named_modules())
    captured: dict[str, torch.Tensor] = {}
    handles = []
    try:
        for name in layer_names:
            def hook(module, args, output, name=name):  # name=name: bind this loop's name, not the last one
                captured[name] = output.detach()
            handles.append(modules[name].register_forward_hook(hook))
        model(x)
    finally:
        for handle in handles:
            handle.remove()
    return captured


def grad_norms(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable) -> dict[str, float]:
    """Zero the gradients, backpropagate loss_fn(model(x), y), return {parameter name: L2 norm of its .grad}."""
    model.zero_grad()
    loss_fn(model(x), y).backward()
    return {name: p.grad.norm().item() for name, p in model.named_parameters() if p.grad is not None}


def clip_tensor_grad(t: torch.Tensor, max_abs: float) -> RemovableHandle:
    """Register a hook that clamps every element of t's gradient to [-max_abs, max_abs]; return its handle."""
    return t.register_hook(lambda grad: grad.clamp(-max_abs, max_abs))


def find_nan_op(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> str | None:
    """The name of the backward function that first returns NaN for fn(x).sum().backward(), or None."""
    x = x.detach().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # anomaly mode warns with a forward traceback; the name is enough here
        try:
            with torch.autograd.detect_anomaly():
                fn(x).sum().backward()
        except RuntimeError as err:
            found = re.search(r"Function '(\w+)' returned nan", str(err))
            if found:
                return found.group(1)
            raise
    return None


def slowest_op(prof) -> str:
    """The name of the operator with the largest self CPU time in a finished torch.profiler.profile."""
    return max(prof.key_averages(), key=lambda event: event.self_cpu_time_total).key


def checkpointed_forward(blocks: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    """Run x through each block in turn, each inside its own non-reentrant activation checkpoint."""
    for block in blocks:
        x = checkpoint(block, x, use_reentrant=False)
    return x


# Helpers of the checks.

def _kind(value) -> str:
    kind = type(value)
    return kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__.split('.')[0]}.{kind.__qualname__}"


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


class _Probe(nn.Module):
    """A small model with named, nested sub-modules."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(6, 8)
        self.act = nn.ReLU()
        self.block = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.block(self.act(self.stem(x))))


def _probe(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return _Probe()


def _inputs_and_outputs(model: nn.Module, x: torch.Tensor, names: list[str]) -> tuple[dict, dict]:
    modules = dict(model.named_modules())
    inputs, outputs = {}, {}

    def hook(module, args, output, name):  # returns None: a forward hook that returns a value replaces the output
        inputs[name], outputs[name] = args[0].detach(), output.detach()

    handles = [modules[n].register_forward_hook(functools.partial(hook, name=n)) for n in names]
    with torch.no_grad():
        model(x)
    for h in handles:
        h.remove()
    return inputs, outputs


def _backward(loss: torch.Tensor, what: str) -> None:
    """loss.backward(), with an error raised by the learner's hook reported in one line."""
    try:
        loss.backward()
    except Exception as err:
        text = str(err).strip().splitlines()
        raise ExerciseFailed(f"backward() through {what} raised {type(err).__name__}: {text[0] if text else '(no message)'}") from None


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a.float(), b.float(), atol=1e-6)


def _hooked_modules(model: nn.Module) -> list[str]:
    return [name or "the model itself" for name, m in model.named_modules() if m._forward_hooks or m._forward_pre_hooks]


# Checks, one per exercise, in notebook order.

@exercise("capture_activations")
def check_capture_activations(fn) -> None:
    model = _probe(0)
    g = torch.Generator().manual_seed(1)
    for names in (["stem", "block.1", "head"], ["act", "block"]):
        x = torch.randn(5, 6, generator=g)
        x_before = x.clone()
        what = f"capture_activations(model, tensor of shape (5, 6), {names})"
        inputs, expected = _inputs_and_outputs(model, x, names)
        got = call(fn, model, x, list(names), shown=f"model, tensor of shape (5, 6), {names}")
        left = _hooked_modules(model)
        if left:
            for m in model.modules():  # clean up, so that the next case starts from a clean model
                m._forward_hooks.clear()
                m._forward_pre_hooks.clear()
            raise ExerciseFailed(
                f"{what} left hooks on {left}: they run on every later call; "
                "keep each handle that register_forward_hook returns and call handle.remove() (in a finally: block)"
            )
        expect_unchanged(x_before, x, what="capture_activations")
        if got is None:
            raise ExerciseFailed(f"{what} returned None: did you forget to `return` the dict?")
        if not isinstance(got, dict):
            raise ExerciseFailed(f"{what} returned a {_kind(got)}, expected a dict {{name: activation}}")
        if len(got) == 1 and len(names) > 1 and next(iter(got)) == names[-1]:
            raise ExerciseFailed(
                f"{what} returned only the key {names[-1]!r}: every hook used the loop variable's last value; "
                "bind each name when you define the hook, e.g. def hook(module, args, output, name=name)"
            )
        if set(got) != set(names):
            raise ExerciseFailed(f"{what} returned the keys {sorted(got, key=str)}, expected {sorted(names)} (the names you were given)")
        for name in names:
            value = got[name]
            if isinstance(value, (tuple, list)) and torch.is_tensor(value[0] if value else None):
                raise ExerciseFailed(f"{what}[{name!r}] is a {type(value).__name__}: store the hook's output, a tensor (the inputs come as a tuple)")
            if not isinstance(value, torch.Tensor):
                raise ExerciseFailed(f"{what}[{name!r}] is a {_kind(value)}, expected a tensor (the sub-module's output)")
            if value.requires_grad:
                raise ExerciseFailed(
                    f"{what}[{name!r}] still requires grad, so it keeps the whole graph of the forward pass alive: store output.detach()"
                )
            if _same(value, inputs[name]) and not _same(inputs[name], expected[name]):
                raise ExerciseFailed(f"{what}[{name!r}] is the module's input: a forward hook is called as hook(module, args, output); store output")
            expect_tensor(value, expected[name], what=f"{what}[{name!r}]", atol=1e-6)


def _grad_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


@exercise("grad_norms")
def check_grad_norms(fn) -> None:
    model = _grad_model(2)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(9, 5, generator=g), torch.randint(0, 3, (9,), generator=g)
    expected = grad_norms(_grad_model(2), x, y, F.cross_entropy)
    weights = {name: p.detach().norm().item() for name, p in model.named_parameters()}
    shown = "model, inputs of shape (9, 5), targets of shape (9,), F.cross_entropy"
    what = f"grad_norms({shown})"

    def judge(got, call_number: str) -> dict[str, float]:
        if got is None:
            raise ExerciseFailed(f"{what} returned None: did you forget to `return` the dict?")
        if not isinstance(got, dict):
            raise ExerciseFailed(f"{what} returned a {_kind(got)}, expected a dict {{parameter name: gradient norm}}")
        if set(got) != set(expected):
            raise ExerciseFailed(f"{what} returned the keys {sorted(got, key=str)}, expected {sorted(expected)} (from model.named_parameters())")
        for name, value in got.items():
            if isinstance(value, torch.Tensor):
                raise ExerciseFailed(f"{what}[{name!r}] is a tensor, expected a Python float: call .item() on the norm")
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ExerciseFailed(f"{what}[{name!r}] is a {_kind(value)}, expected a Python float")
        if all(math.isclose(got[k], weights[k], rel_tol=1e-5) for k in got):
            raise ExerciseFailed(f"{what} returned the norms of the parameters themselves: take the norm of each parameter's gradient, p.grad")
        if call_number == "second" and all(math.isclose(got[k], 2 * expected[k], rel_tol=1e-4) for k in got):
            raise ExerciseFailed(
                f"{what} doubled on its second call with the same batch: backward() adds into .grad, so zero the gradients first (model.zero_grad())"
            )
        for name in expected:
            if not math.isclose(got[name], expected[name], rel_tol=1e-4, abs_tol=1e-7):
                raise ExerciseFailed(f"{what}[{name!r}] is {got[name]:.6g} on the {call_number} call, expected {expected[name]:.6g}")
        return got

    judge(call(fn, model, x, y, F.cross_entropy, shown=shown), "first")
    judge(call(fn, model, x, y, F.cross_entropy, shown=shown), "second")


@exercise("clip_tensor_grad")
def check_clip_tensor_grad(fn) -> None:
    upstream = torch.tensor([[4.0, -3.0, 0.5], [-0.25, 2.0, -6.0]])
    max_abs = 1.0
    clipped = upstream.clamp(-max_abs, max_abs)

    # A leaf that feeds an addition: autograd hands the same gradient tensor to both of its inputs.
    a = torch.zeros(2, 3, requires_grad=True)
    b = torch.zeros(2, 3, requires_grad=True)
    what = "clip_tensor_grad(t, 1.0)"
    handle = call(fn, a, max_abs, shown="t, 1.0")
    if handle is None:
        raise ExerciseFailed(f"{what} returned None: return the handle that t.register_hook(...) gives you, so the hook can be removed")
    if not isinstance(handle, RemovableHandle):
        raise ExerciseFailed(f"{what} returned a {_kind(handle)}: return the handle that t.register_hook(...) gives you")
    _backward(((a + b) * upstream).sum(), f"the hook of {what}")
    if a.grad is None:
        raise ExerciseFailed(f"after {what} and backward(), t.grad is None: the hook must return the new gradient, not None")
    if torch.allclose(a.grad, upstream):
        raise ExerciseFailed(f"after {what}, t's gradient was not clipped: register the hook with t.register_hook(hook), and let the hook return grad.clamp(...)")
    if not torch.allclose(b.grad, upstream):
        raise ExerciseFailed(
            "another tensor's gradient was clipped too: your hook modified the gradient in place (clamp_), and autograd shares that tensor; "
            "return a new one, grad.clamp(-max_abs, max_abs)"
        )
    if torch.allclose(a.grad, upstream.clamp(max=max_abs)):
        raise ExerciseFailed(f"after {what}, gradients below -max_abs were not clipped: clamp to both sides, grad.clamp(-max_abs, max_abs)")
    if torch.allclose(a.grad, upstream * max_abs / upstream.norm()):
        raise ExerciseFailed(f"after {what}, the whole gradient was rescaled to norm max_abs: clamp each element instead, grad.clamp(-max_abs, max_abs)")
    expect_tensor(a.grad, clipped, what=f"t.grad after {what} and backward()")

    # A tensor in the middle of a graph: the clipped gradient is what flows on to the weights.
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(2, 4, generator=g), torch.randn(4, 3, generator=g, requires_grad=True)
    h = x @ w
    call(fn, h, 0.5, shown="h, 0.5 (h = x @ w, in the middle of a graph)")
    _backward((h * upstream).sum(), "the hook of clip_tensor_grad(h, 0.5)")
    expect_tensor(w.grad, x.T @ upstream.clamp(-0.5, 0.5), what="w.grad after clip_tensor_grad(h, 0.5) on h = x @ w: the clipped gradient should flow on to w", atol=1e-5)

    # The handle removes the hook.
    handle.remove()
    a.grad = None
    _backward(((a + b) * upstream).sum(), "t after handle.remove()")
    if not torch.allclose(a.grad, upstream):
        raise ExerciseFailed("after handle.remove(), the gradient was still clipped: return the handle of the hook that clips")


def _nan_cases() -> list[tuple[str, Callable, torch.Tensor, str | None]]:
    points = torch.tensor([[0.0, 1.0], [1.0, 0.0], [2.0, 2.0]])
    values = torch.tensor([4.0, 1.0, 0.0, 2.0])
    return [
        ("pairwise distances", lambda p: ((p[:, None] - p[None]) ** 2).sum(-1).sqrt(), points, "PowBackward0"),
        ("torch.where(x > 0, x.log(), 0.0)", lambda v: torch.where(v > 0, v.log(), 0.0), values, "LogBackward0"),
        ("x ** 2 (no NaN)", lambda v: v**2, values, None),
        ("torch.where(x > 0, x.sqrt(), 0.0)", lambda v: torch.where(v > 0, v.sqrt(), 0.0), values, "SqrtBackward0"),
    ]


@exercise("find_nan_op")
def check_find_nan_op(fn) -> None:
    hints = {
        "returned nan values": "catch the RuntimeError that detect_anomaly raises and return the function's name from its message",
        "only for scalar outputs": "call backward() on fn(x).sum()",
        "does not require grad": "call fn on x.detach().requires_grad_()",
    }
    try:
        for label, f, x, expected in _nan_cases():
            what = f"find_nan_op({label}, tensor of shape {tuple(x.shape)})"
            before = x.clone()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                got = call(fn, f, x, shown=f"{label}, tensor of shape {tuple(x.shape)}", hints=hints)
            if torch.is_anomaly_enabled():
                raise ExerciseFailed(
                    "anomaly detection is still on after find_nan_op returned: use the context manager "
                    "`with torch.autograd.detect_anomaly():`, not set_detect_anomaly(True)"
                )
            expect_unchanged(before, x, what="find_nan_op")
            if x.requires_grad or x.grad is not None:
                raise ExerciseFailed(f"{what} switched on requires_grad on the caller's tensor: work on a copy, x.detach().requires_grad_()")
            if got is not None and not isinstance(got, str):
                raise ExerciseFailed(f"{what} returned a {type_name(got)}, expected a function's name (a str) or None")
            if got == expected:
                continue
            if expected is None:
                raise ExerciseFailed(f"{what} returned {got!r}, expected None: this function's gradient has no NaN")
            if got is None:
                raise ExerciseFailed(
                    f"{what} returned None, but its gradient has NaN: run fn(x).sum().backward() inside "
                    "`with torch.autograd.detect_anomaly():`, which raises a RuntimeError at the first backward function that returns NaN"
                )
            if isinstance(got, str) and expected in got:
                raise ExerciseFailed(f"{what} returned {got[:80]!r}: return only the function's name, {expected!r}")
            if isinstance(got, str) and got.lower() in expected.lower():
                raise ExerciseFailed(f"{what} returned the forward op {got!r}: return the name of the backward function, {expected!r}")
            raise ExerciseFailed(f"{what} returned {got!r}, expected {expected!r}")
    finally:
        torch.autograd.set_detect_anomaly(False)


def _event(key: str, self_us: int, total_us: int, count: int = 1, annotation: bool = False) -> FunctionEventAvg:
    event = FunctionEventAvg()
    event.key, event.count = key, count
    event.self_cpu_time_total, event.cpu_time_total = self_us, total_us
    event.is_user_annotation = annotation
    return event


class _FakeProfile:
    """Stands in for a finished torch.profiler.profile: key_averages() returns fixed, made-up statistics."""

    def __init__(self, events: list[FunctionEventAvg]):
        self._events = events

    def key_averages(self, *args, **kwargs) -> EventList:
        return EventList(self._events)


def _fake_profiles() -> list[_FakeProfile]:
    return [
        _FakeProfile([
            _event("aten::t", 30, 45, count=3),
            _event("forward", 400, 2_600, annotation=True),     # a record_function region: large total, small self
            _event("aten::linear", 60, 2_100, count=3),
            _event("aten::relu", 150, 150, count=2),
            _event("aten::addmm", 1_900, 1_950, count=3),
            _event("aten::empty", 5, 5, count=9),
        ]),
        _FakeProfile([
            _event("aten::conv2d", 20, 3_000, count=2),
            _event("aten::convolution", 25, 2_980, count=2),
            _event("aten::mkldnn_convolution", 2_800, 2_900, count=2),
            _event("aten::max_pool2d_with_indices", 1_600, 1_620, count=1),  # the slowest per call, not in total
            _event("aten::add_", 900, 900, count=40),
            _event("step", 300, 4_500, annotation=True),
            _event("aten::zero_", 1, 1, count=1),
        ]),
    ]


def _real_profile():
    """A small profile of a matrix product, so that the learner's code meets real profiler objects."""
    from torch.profiler import ProfilerActivity, profile, record_function

    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # the profiler's C++ backend stays quiet on stderr
    a, b = torch.randn(96, 96), torch.randn(96, 96)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("work"):
            for _ in range(3):
                (a @ b).relu()
    return prof


@exercise("slowest_op")
def check_slowest_op(fn) -> None:
    for prof in [*_fake_profiles(), _real_profile()]:
        events = list(prof.key_averages())
        fake = isinstance(prof, _FakeProfile)
        what = "slowest_op(prof)" if fake else "slowest_op(a real profile)"
        expected = slowest_op(prof)
        got = call(fn, prof, shown="prof")
        if isinstance(got, FunctionEventAvg):
            raise ExerciseFailed(f"{what} returned the whole FunctionEventAvg: return its name, event.key")
        if got is None:
            raise ExerciseFailed(f"{what} returned None: did you forget to `return` the name?")
        if not isinstance(got, str):
            raise ExerciseFailed(f"{what} returned a {_kind(got)}, expected the operator's name, a str such as 'aten::mm'")
        if got == expected:
            continue
        if not fake:
            raise ExerciseFailed(f"{what} returned {got!r}, expected {expected!r}: the event with the largest self_cpu_time_total")
        by_total = max(events, key=lambda e: e.cpu_time_total).key
        if got == by_total:
            raise ExerciseFailed(
                f"{what} returned {got!r}, the largest *total* CPU time, which includes the operators it calls: "
                "compare self_cpu_time_total"
            )
        if got == min(events, key=lambda e: e.self_cpu_time_total).key:
            raise ExerciseFailed(f"{what} returned {got!r}, the fastest operator: take the max, or sort in descending order")
        if got == max(events, key=lambda e: e.self_cpu_time_total / e.count).key:
            raise ExerciseFailed(f"{what} returned {got!r}, the slowest per call: compare self_cpu_time_total, the sum over all calls")
        if got == events[0].key:
            raise ExerciseFailed(f"{what} returned {got!r}, the first event: key_averages() is not sorted; take max(..., key=lambda e: e.self_cpu_time_total)")
        raise ExerciseFailed(f"{what} returned {got!r}, expected {expected!r}")


def _blocks(seed: int) -> nn.ModuleList:
    torch.manual_seed(seed)
    return nn.ModuleList([nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16), nn.Tanh()) for _ in range(3)])


@exercise("checkpointed_forward")
def check_checkpointed_forward(fn) -> None:
    blocks = _blocks(5)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(6))  # a batch: it does not require grad
    what = "checkpointed_forward(blocks, tensor of shape (8, 16))"

    def plain() -> torch.Tensor:
        h = x
        for block in blocks:
            h = block(h)
        return h

    expected, plain_bytes = saved_activation_bytes(plain, blocks.parameters())
    expected.sum().backward()
    expected_grads = {name: p.grad.clone() for name, p in blocks.named_parameters()}
    blocks.zero_grad(set_to_none=True)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            got, got_bytes = saved_activation_bytes(lambda: call(fn, blocks, x.clone(), shown="blocks, tensor of shape (8, 16)"), blocks.parameters())
        except ExerciseFailed as err:
            if "missing the required" not in str(err):
                raise
            raise ExerciseFailed(
                f"{what} called the nn.ModuleList itself, which has no forward(): loop over it, `for block in blocks:`, "
                "and checkpoint each block"
            ) from None
        if isinstance(got, torch.Tensor) and got.requires_grad:
            _backward(got.sum(), "the output of checkpointed_forward")
    messages = [str(w.message) for w in caught]
    if got is None:
        raise ExerciseFailed(f"{what} returned None: did you forget to `return` the output?")
    if not isinstance(got, torch.Tensor):
        raise ExerciseFailed(f"{what} returned a {_kind(got)}, expected the output tensor")
    if not got.requires_grad and any("None of the inputs have requires_grad" in m for m in messages):
        raise ExerciseFailed(
            f"{what} returned an output with no graph: with use_reentrant=True and an input that does not require grad, "
            "checkpoint drops the gradients (it warns 'None of the inputs have requires_grad=True'); pass use_reentrant=False"
        )
    if not got.requires_grad:
        raise ExerciseFailed(f"{what} returned an output that does not require grad: autograd did not record the forward pass (torch.no_grad()? .detach()?)")
    if any("use_reentrant" in m for m in messages):
        raise ExerciseFailed(f"{what}: checkpoint warned that use_reentrant should be passed explicitly: pass use_reentrant=False")
    if "CheckpointFunction" in type(got.grad_fn).__name__:
        raise ExerciseFailed(f"{what} used the reentrant checkpoint (use_reentrant=True), the legacy variant: pass use_reentrant=False")
    expect_tensor(got, expected.detach(), what=f"the output of {what}", atol=1e-6)
    if got_bytes >= plain_bytes:
        raise ExerciseFailed(
            f"{what} saved {got_bytes:,} bytes of activations for backward, as many as without checkpointing ({plain_bytes:,}): "
            "run each block through torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)"
        )
    for name, p in blocks.named_parameters():
        if p.grad is None:
            raise ExerciseFailed(f"after backward through {what}, parameter {name!r} has no gradient")
        expect_tensor(p.grad, expected_grads[name], what=f"the gradient of blocks.{name} through {what}", atol=1e-6)
