"""Lesson 08 (hooks, profiling and debugging): reference solutions and the checks for its exercises."""

import functools
import itertools
import math
import os
import warnings
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as module_globals
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils.checkpoint import checkpoint
from torch.utils.hooks import RemovableHandle

from course_utils.benchmarking import saved_activation_bytes
from course_utils.tooling.checks import (
    ExerciseFailed,
    a_type,
    call,
    exercise,
    expect_callable,
    expect_tensor,
    expect_unchanged,
    first_line,
    scoreboard_for,
    stub_function,
)

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


def layer_grad_norms(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable, layer_names: list[str]) -> dict[str, float]:
    """{name: L2 norm of d loss / d that layer's output} for loss_fn(model(x), y); hooks removed, .grad left alone."""
    modules = dict(model.named_modules())
    norms: dict[str, float] = {}
    handles = []
    try:
        for name in layer_names:
            def hook(module, grad_input, grad_output, name=name):
                norms[name] = grad_output[0].norm().item()
            handles.append(modules[name].register_full_backward_hook(hook))
        loss = loss_fn(model(x), y)
        trainable = [p for p in model.parameters() if p.requires_grad]
        torch.autograd.grad(loss, trainable)  # runs the backward pass, and returns the gradients instead of touching .grad
    finally:
        for handle in handles:
            handle.remove()
    return norms


def clip_tensor_grad(t: torch.Tensor, max_abs: float) -> RemovableHandle:
    """Register a hook that clamps every element of t's gradient to [-max_abs, max_abs]; return its handle."""
    return t.register_hook(lambda grad: grad.clamp(-max_abs, max_abs))


def tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors in a module's output: a tensor, or tuples and lists of them, nested."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in tensors_in(item)]
    return []


def first_nonfinite(model: nn.Module, x: torch.Tensor) -> str | None:
    """The name of the first module whose output holds a NaN or an inf during model(x), or None; hooks removed."""
    found: list[str] = []

    def hook(module, args, output, name):
        if not found and not all(t.isfinite().all() for t in tensors_in(output)):
            found.append(name)

    handles = []
    try:
        for name, module in model.named_modules():  # the model itself too: its name is ""
            handles.append(module.register_forward_hook(functools.partial(hook, name=name)))
        with torch.no_grad():
            model(x)
    finally:
        for handle in handles:
            handle.remove()
    return found[0] if found else None


def memory_by_phase(phases: dict[str, Callable[[], None]]) -> dict[str, int]:
    """Run each phase once, in order, under the profiler; {name: bytes the phase left allocated (allocations - frees)}."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for name, phase in phases.items():
            with record_function(name):
                phase()
    regions = {event.key: event for event in prof.key_averages()}
    return {name: regions[name].cpu_memory_usage for name in phases}


def checkpoint_segments(blocks: nn.ModuleList, x: torch.Tensor, segment_size: int) -> torch.Tensor:
    """Run x through the blocks, each run of segment_size consecutive blocks inside one non-reentrant checkpoint."""
    for start in range(0, len(blocks), segment_size):
        segment = nn.Sequential(*blocks[start:start + segment_size])
        x = checkpoint(segment, x, use_reentrant=False)
    return x


# Helpers the notebook uses too.

def quiet_profiler() -> None:
    """Keep the profiler's C++ backend (Kineto) from writing its start and stop messages to stderr."""
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # 6 is above every level Kineto has


# Helpers of the checks.

class ModelError(RuntimeError):
    """What the checks' hidden models raise on purpose, to see that hooks are removed when the forward pass fails."""


HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
GLOBAL_HOOK_DICTS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks", "_global_backward_pre_hooks")


def _global_hooks() -> set[tuple[str, int]]:
    return {(d, key) for d in GLOBAL_HOOK_DICTS for key in getattr(module_globals, d, {})}


def _leaked_hooks(model: nn.Module, global_before: set[tuple[str, int]]) -> list[str]:
    """The modules that still carry hooks (the model itself as 'the model itself'), and any new global module hook."""
    leaked = [name or "the model itself" for name, m in model.named_modules() if any(getattr(m, d) for d in HOOK_DICTS)]
    if _global_hooks() - global_before:
        leaked.append("all modules (a global hook)")
    return leaked


def _remove_hooks(model: nn.Module, global_before: set[tuple[str, int]]) -> None:
    """Take the learner's leaked hooks off, so that later cases (and later cells) start clean."""
    for m in model.modules():
        for d in HOOK_DICTS:
            getattr(m, d).clear()
    for d, key in _global_hooks() - global_before:
        getattr(module_globals, d).pop(key, None)


def _expect_no_hooks(model: nn.Module, global_before: set[tuple[str, int]], what: str, after: str = "") -> None:
    leaked = _leaked_hooks(model, global_before)
    if not leaked:
        return
    _remove_hooks(model, global_before)
    if after:
        raise ExerciseFailed(
            f"{what} {after} and left hooks on {leaked}: remove every handle in a finally: block, which runs when an error passes through"
        )
    raise ExerciseFailed(f"{what} left hooks on {leaked}: they run on every later call; keep each handle that register_* returns and call handle.remove()")


def _expect_model_error(fn: Callable, args: tuple, what: str, model: nn.Module, global_before: set) -> None:
    """Call fn on a model whose forward raises ModelError: the error must reach the caller, and no hook may stay."""
    expect_callable(fn)
    raised = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            fn(*args)
        except Exception as err:  # noqa: BLE001 -- judged below
            if stub_function(err):
                raise
            raised = err
    chain, seen = raised, set()
    while chain is not None and not isinstance(chain, ModelError) and id(chain) not in seen:
        seen.add(id(chain))
        chain = chain.__cause__ or chain.__context__
    if raised is not None and chain is None:
        _remove_hooks(model, global_before)
        raise ExerciseFailed(f"{what} raised {type(raised).__name__}: {first_line(raised)}, expected the model's own ModelError to reach the caller")
    _expect_no_hooks(model, global_before, what, after="let the model's ModelError through" if raised else "")
    if raised is None:
        raise ExerciseFailed(f"{what} returned although the model's forward pass raised ModelError: let the error reach the caller (try/finally, no except)")


def _expect_same_mode(model: nn.Module, was_training: bool, what: str) -> None:
    if model.training != was_training:
        raise ExerciseFailed(f"{what} left the model in {'training' if model.training else 'eval'} mode; it was in {'training' if was_training else 'eval'} mode")


def _expect_dict(got: Any, what: str, returned_what: str) -> dict:
    if got is None:
        raise ExerciseFailed(f"{what} returned None: did you forget to `return` the dict?")
    if not isinstance(got, dict):
        raise ExerciseFailed(f"{what} returned {a_type(got)}, expected a dict {{name: {returned_what}}}")
    return got


def _expect_names(got: Any, names: list[str], what: str, returned_what: str, hook_args: str) -> dict:
    """A dict with exactly the names a hook-registering answer was given; the late-binding closure named."""
    got = _expect_dict(got, what, returned_what)
    if len(got) == 1 and len(names) > 1 and next(iter(got)) == names[-1]:
        raise ExerciseFailed(
            f"{what} returned only the key {names[-1]!r}: every hook used the loop variable's last value; "
            f"bind each name when you define the hook, e.g. def hook({hook_args}, name=name)"
        )
    if set(got) != set(names):
        raise ExerciseFailed(f"{what} returned the keys {sorted(got, key=str)}, expected {sorted(names)} (the names you were given)")
    return got


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a.float(), b.float(), atol=1e-6)


def _backward(loss: torch.Tensor, what: str) -> None:
    """loss.backward(), with an error raised by the learner's hook reported in one line."""
    try:
        loss.backward()
    except Exception as err:
        raise ExerciseFailed(f"backward() through {what} raised {type(err).__name__}: {first_line(err)}") from None


# capture_activations

class _Probe(nn.Module):
    """A small model with named, nested sub-modules; `trip` makes its forward raise after `block` has run."""

    def __init__(self, trip: bool = False):
        super().__init__()
        self.stem = nn.Linear(6, 8)
        self.act = nn.ReLU()
        self.block = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.head = nn.Linear(8, 3)
        self.trip = trip

    def forward(self, x):
        h = self.block(self.act(self.stem(x)))
        if self.trip:
            raise ModelError("the hidden model failed on purpose")
        return self.head(h)


def _probe(seed: int, trip: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    return _Probe(trip)


def _inputs_and_outputs(model: nn.Module, x: torch.Tensor, names: list[str]) -> tuple[dict, dict]:
    modules = dict(model.named_modules())
    inputs, outputs = {}, {}

    def hook(module, args, output, name):  # returns None: a forward hook that returns a value replaces the output
        inputs[name], outputs[name] = args[0].detach(), output.detach()

    handles = [modules[n].register_forward_hook(functools.partial(hook, name=n)) for n in names]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in handles:
            h.remove()
    return inputs, outputs


@exercise("capture_activations")
def check_capture_activations(fn) -> None:
    model = _probe(0)
    g = torch.Generator().manual_seed(1)
    for batch, names in ((5, ["stem", "block.1", "head"]), (1, ["act", "block"])):
        x = torch.randn(batch, 6, generator=g)
        x_before = x.clone()
        shown = f"model, tensor of shape {tuple(x.shape)}, {names}"
        what = f"capture_activations({shown})"
        inputs, expected = _inputs_and_outputs(model, x, names)
        global_before = _global_hooks()
        got = call(fn, model, x, list(names), shown=shown)
        _expect_no_hooks(model, global_before, what)
        expect_unchanged(x_before, x, what="capture_activations")
        _expect_same_mode(model, True, what)
        got = _expect_names(got, names, what, "activation", "module, args, output")
        for name in names:
            value = got[name]
            if isinstance(value, (tuple, list)) and torch.is_tensor(value[0] if value else None):
                raise ExerciseFailed(f"{what}[{name!r}] is a {type(value).__name__}: store the hook's output, a tensor (the inputs come as a tuple)")
            if not isinstance(value, torch.Tensor):
                raise ExerciseFailed(f"{what}[{name!r}] is {a_type(value)}, expected a tensor (the sub-module's output)")
            if value.requires_grad:
                raise ExerciseFailed(
                    f"{what}[{name!r}] still requires grad, so it keeps the whole graph of the forward pass alive: store output.detach()"
                )
            if _same(value, inputs[name]) and not _same(inputs[name], expected[name]):
                raise ExerciseFailed(f"{what}[{name!r}] is the module's input: a forward hook is called as hook(module, args, output); store output")
            expect_tensor(value, expected[name], what=f"{what}[{name!r}]", atol=1e-6)

    tripped = _probe(0, trip=True)
    names = ["stem", "block"]
    x = torch.randn(4, 6, generator=g)
    _expect_model_error(fn, (tripped, x, names), f"capture_activations(a model whose forward raises, tensor of shape (4, 6), {names})",
                        tripped, _global_hooks())


# layer_grad_norms

class _Tower(nn.Module):
    """A small classifier with a nested block; `trip` makes its forward raise after the body has run."""

    def __init__(self, trip: bool = False):
        super().__init__()
        self.stem = nn.Linear(7, 12)
        self.body = nn.Sequential(nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 12), nn.ReLU())
        self.head = nn.Linear(12, 4)
        self.trip = trip

    def forward(self, x):
        h = self.body(self.stem(x))
        if self.trip:
            raise ModelError("the hidden model failed on purpose")
        return self.head(h)


def _tower(seed: int, trip: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    return _Tower(trip)


def _boundary_grad_norms(model: nn.Module, x, y, loss_fn, names) -> tuple[dict[str, float], dict[str, float | None]]:
    """{name: |d loss / d output|} and {name: |d loss / d input|, None where the input needs no gradient}, computed without hooks
    of the learner's kind: the outputs and inputs are kept by forward hooks and differentiated with torch.autograd.grad."""
    modules = dict(model.named_modules())
    outs, ins = {}, {}

    def keep(module, args, output, name):
        ins[name], outs[name] = args[0], output

    handles = [modules[n].register_forward_hook(functools.partial(keep, name=n)) for n in names]
    try:
        loss = loss_fn(model(x), y)
    finally:
        for h in handles:
            h.remove()
    wanted = [outs[n] for n in names] + [ins[n] for n in names if ins[n].requires_grad]
    grads = torch.autograd.grad(loss, wanted)
    out_norms = {n: g.norm().item() for n, g in zip(names, grads)}
    rest = iter(grads[len(names):])
    in_norms = {n: next(rest).norm().item() if ins[n].requires_grad else None for n in names}
    return out_norms, in_norms


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


@exercise("layer_grad_norms")
def check_layer_grad_norms(fn) -> None:
    hints = {
        "'NoneType' object has no attribute": "something your code used is None; grad_input holds None for an input that needs "
                                              "no gradient, such as the data going into the first layer",
        "does not require grad": "some parameters are frozen (requires_grad=False): differentiate only those that require grad",
    }
    g = torch.Generator().manual_seed(11)
    cases = []
    # 1. classes, a nested block and its children, the first layer (whose input is the data), a stale gradient on head.weight
    model = _tower(3)
    model.head.weight.grad = torch.full_like(model.head.weight, 0.25)
    cases.append((model, torch.randn(6, 7, generator=g), torch.randint(0, 4, (6,), generator=g), F.cross_entropy,
                  ["stem", "body.1", "body", "head"], "F.cross_entropy"))
    # 2. a batch of 1, regression, a frozen layer in the middle, the model in eval mode
    model = _tower(4)
    model.body[0].requires_grad_(False)
    model.eval()
    cases.append((model, torch.randn(1, 7, generator=g), torch.randn(1, 4, generator=g), F.mse_loss,
                  ["body.0", "body.2", "head"], "F.mse_loss"))

    for model, x, y, loss_fn, names, loss_name in cases:
        shown = f"model, inputs of shape {tuple(x.shape)}, targets of shape {tuple(y.shape)}, {loss_name}, {names}"
        what = f"layer_grad_norms({shown})"
        expected, grad_inputs = _boundary_grad_norms(model, x, y, loss_fn, names)
        x_before, grads_before, was_training = x.clone(), _grads(model), model.training
        weights = {n: m.weight.detach().norm().item() for n, m in model.named_modules() if isinstance(getattr(m, "weight", None), torch.Tensor)}
        global_before = _global_hooks()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")  # the first layer's input needs no gradient: its full backward hook warns
            got = call(fn, model, x, y, loss_fn, list(names), shown=shown, hints=hints)
        _expect_no_hooks(model, global_before, what)
        if any("non-full backward hook" in str(w.message) for w in caught):
            raise ExerciseFailed(
                f"{what} used register_backward_hook, which is deprecated and misses gradients of modules made of several operations: "
                "use register_full_backward_hook"
            )
        expect_unchanged(x_before, x, what="layer_grad_norms")
        _expect_same_mode(model, was_training, what)
        for n, before in grads_before.items():
            after = dict(model.named_parameters())[n].grad
            if (before is None) != (after is None) or (before is not None and not torch.equal(before, after)):
                state = "None" if before is None else "a stale gradient"
                raise ExerciseFailed(
                    f"{what} changed {n}.grad, which held {state}: a probe leaves .grad as it was "
                    "(torch.autograd.grad returns the gradients without touching .grad)"
                )
        got = _expect_names(got, names, what, "gradient norm", "module, grad_input, grad_output")
        for name in names:
            value = got[name]
            if isinstance(value, torch.Tensor):
                raise ExerciseFailed(f"{what}[{name!r}] is a tensor, expected a Python float: call .item() on the norm")
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ExerciseFailed(f"{what}[{name!r}] is {a_type(value)}, expected a Python float")
        for name in names:
            value, want = got[name], expected[name]
            if math.isclose(value, want, rel_tol=1e-4, abs_tol=1e-7):
                continue
            if grad_inputs[name] is not None and math.isclose(value, grad_inputs[name], rel_tol=1e-4, abs_tol=1e-7):
                raise ExerciseFailed(
                    f"{what}[{name!r}] is {value:.6g}, the norm of the gradient at the layer's input (grad_input); "
                    f"expected {want:.6g}, at its output (grad_output)"
                )
            if name in weights and math.isclose(value, weights[name], rel_tol=1e-5):
                raise ExerciseFailed(f"{what}[{name!r}] is {value:.6g}, the norm of the layer's weight itself; expected {want:.6g}, the norm of d loss / d output")
            raise ExerciseFailed(f"{what}[{name!r}] is {value:.6g}, expected {want:.6g} (the L2 norm of d loss / d the layer's output)")

    tripped = _tower(5, trip=True)
    names = ["stem", "body"]
    x, y = torch.randn(3, 7, generator=g), torch.randint(0, 4, (3,), generator=g)
    _expect_model_error(fn, (tripped, x, y, F.cross_entropy, names),
                        f"layer_grad_norms(a model whose forward raises, inputs of shape (3, 7), targets of shape (3,), F.cross_entropy, {names})",
                        tripped, _global_hooks())


# clip_tensor_grad

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
        raise ExerciseFailed(f"{what} returned {a_type(handle)}: return the handle that t.register_hook(...) gives you")
    _backward(((a + b) * upstream).sum(), f"the hook of {what}")
    if a.grad is None:
        raise ExerciseFailed(f"after {what} and backward(), t.grad is None: the hook must return the new gradient, not None")
    if torch.allclose(a.grad, upstream):
        raise ExerciseFailed(f"after {what}, t's gradient was not clipped: register the hook with t.register_hook(hook), and let the hook return the clipped gradient")
    if not torch.allclose(b.grad, upstream):
        raise ExerciseFailed(
            "another tensor's gradient was clipped too: your hook modified the gradient in place, and autograd shares that tensor; "
            "return a new one, grad.clamp(-max_abs, max_abs)"
        )
    if torch.allclose(a.grad, upstream.clamp(max=max_abs)):
        raise ExerciseFailed(f"after {what}, gradients below -max_abs were not clipped: clamp to both sides, [-max_abs, max_abs]")
    if torch.allclose(a.grad, upstream * max_abs / upstream.norm()):
        raise ExerciseFailed(f"after {what}, the whole gradient was rescaled to norm max_abs: clamp each element instead")
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


# first_nonfinite

class _Exp(nn.Module):
    def forward(self, x):
        return x.exp()


class _Overflow(nn.Module):
    """Returns (x, (tanh(x), x * 1e38)): the last tensor overflows to inf where |x| > 3.4, and nothing downstream uses it."""

    def forward(self, x):
        return x, (x.tanh(), x * 1e38)


class _Ordered(nn.Module):
    """Modules defined in the opposite order to the one they run in; exp overflows to inf, LayerNorm turns inf into NaN,
    and the model hides the NaN from its caller with nan_to_num."""

    def __init__(self, trip: bool = False):
        super().__init__()
        self.head = nn.Linear(8, 3)
        self.norm = nn.LayerNorm(8)
        self.block = nn.Sequential(nn.Linear(8, 8), _Exp())
        self.embed = nn.Linear(5, 8)
        self.out = nn.Softplus()
        self.trip = trip

    def forward(self, x):
        h = self.block(self.embed(x))
        if self.trip:
            raise ModelError("the hidden model failed on purpose")
        return self.out(self.head(self.norm(h))).nan_to_num()


class _Recurrent(nn.Module):
    """An LSTM (whose output is a nested tuple) and a module whose second output can hold inf."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(4, 6, batch_first=True)
        self.split = _Overflow()
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        out, _ = self.lstm(x)
        h, (squashed, _) = self.split(out[:, -1] * 10)
        return self.head(h + squashed)


class _Softmax(nn.Module):
    """Its children give finite logits; its own forward takes a softmax by hand, exp / sum, which overflows to inf / inf = NaN."""

    def __init__(self):
        super().__init__()
        self.hidden = nn.Sequential(nn.Linear(3, 16), nn.ReLU())
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        e = self.out(self.hidden(x)).exp()
        return e / e.sum(-1, keepdim=True)


def _nonfinite_cases() -> list[tuple[str, Callable[[], nn.Module], torch.Tensor]]:
    g = torch.Generator().manual_seed(21)
    small, large = torch.randn(4, 5, generator=g) * 0.1, torch.randn(4, 5, generator=g) * 300

    def build(cls, seed):
        def make():
            torch.manual_seed(seed)
            return cls()
        return make

    sequence = torch.randn(2, 3, 4, generator=g)
    return [
        ("a model with finite outputs everywhere", build(_Ordered, 5), small),
        ("a model whose exp overflows", build(_Ordered, 5), large),
        ("an LSTM model", build(_Recurrent, 6), sequence * 0.01),
        ("an LSTM model", build(_Recurrent, 6), sequence * 40),
        ("a model that takes a softmax by hand", build(_Softmax, 7), torch.randn(3, 3, generator=g) * 400),
    ]


def _outputs_in_run_order(model: nn.Module, x: torch.Tensor) -> list[tuple[str, bool, bool]]:
    """(name, holds NaN, holds inf, is a tuple) for every module output, in the order the forward hooks ran."""
    seen = []

    def hook(module, args, output, name):
        tensors = [t for t in tensors_in(output) if t.is_floating_point()]
        seen.append((name, any(t.isnan().any().item() for t in tensors), any(t.isinf().any().item() for t in tensors),
                     isinstance(output, tuple)))

    handles = [m.register_forward_hook(functools.partial(hook, name=n)) for n, m in model.named_modules()]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in handles:
            h.remove()
    return seen


@exercise("first_nonfinite")
def check_first_nonfinite(fn) -> None:
    hints = {"'tuple' object has no attribute": "a module's output can be a tuple, even a nested one (an LSTM returns output, (h, c))"}
    for label, make, x in _nonfinite_cases():
        model = make()
        order = [name for name, _ in model.named_modules()]
        run = _outputs_in_run_order(model, x)
        expected = next((n for n, nan, inf, _ in run if nan or inf), None)
        x_before, global_before = x.clone(), _global_hooks()
        shown = f"{label}, tensor of shape {tuple(x.shape)}"
        what = f"first_nonfinite({shown})"
        got = call(fn, model, x, shown=shown, hints=hints)
        _expect_no_hooks(model, global_before, what)
        expect_unchanged(x_before, x, what="first_nonfinite")
        _expect_same_mode(model, True, what)
        if any(p.grad is not None for p in model.parameters()):
            raise ExerciseFailed(f"{what} filled the parameters' .grad: finding a non-finite output needs the forward pass only")
        if isinstance(got, nn.Module):
            raise ExerciseFailed(f"{what} returned the module itself ({type(got).__name__}): return its name, as in model.named_modules()")
        if got is not None and not isinstance(got, str):
            raise ExerciseFailed(f"{what} returned {a_type(got)}, expected a module's name (a str) or None")
        if got == expected:
            continue
        flagged = [n for n, nan, inf, _ in run if nan or inf]
        name = repr(expected) if expected else "'' (the model itself)"
        if expected is None:
            raise ExerciseFailed(f"{what} returned {got!r}, expected None: every module's output is finite")
        if got is None and expected == "":
            raise ExerciseFailed(
                f"{what} returned None, but the model's own forward turned its sub-modules' finite outputs into a non-finite one: "
                "hook the model itself too (named_modules() lists it, with the name '')"
            )
        if got is None and next(is_tuple for n, _, _, is_tuple in run if n == expected):
            raise ExerciseFailed(
                f"{what} returned None, but {name} returned a tuple that holds inf: look at every tensor in a module's output, "
                "nested tuples included"
            )
        first_nan = next((n for n, nan, _, _ in run if nan), None)
        if got == first_nan and first_nan != expected:
            raise ExerciseFailed(f"{what} returned {got!r}, where the first NaN appears; {name} produced an inf before it: test for inf too (torch.isfinite)")
        if isinstance(got, str) and got in flagged and (got == "" or expected.startswith(got + ".")):
            raise ExerciseFailed(
                f"{what} returned {got!r}, but its sub-module {name} produced the non-finite value first: "
                "a sub-module finishes, and its forward hook runs, before its parent's"
            )
        if got in flagged and got == min(flagged, key=order.index):
            raise ExerciseFailed(
                f"{what} returned {got!r}, the first non-finite output in named_modules() order; {name} was the first to produce one "
                "in the forward pass: record the order in which the hooks run"
            )
        if got in flagged and got == flagged[-1]:
            raise ExerciseFailed(f"{what} returned {got!r}, the last module with a non-finite output; expected the first, {name}")
        raise ExerciseFailed(f"{what} returned {got!r}, expected {name}")

    tripped = _Ordered(trip=True)
    x = torch.randn(2, 5, generator=torch.Generator().manual_seed(22))
    _expect_model_error(fn, (tripped, x), "first_nonfinite(a model whose forward raises, tensor of shape (2, 5))", tripped, _global_hooks())


# memory_by_phase

class _Phases:
    """Hidden phases that share state, count their calls and record their order; each returns None."""

    def __init__(self, steps: dict[str, Callable[[dict], None]]):
        self.state: dict[str, Any] = {}
        self.order: list[str] = []
        self.steps = steps

    def phases(self) -> dict[str, Callable[[], None]]:
        def phase(name: str) -> None:
            self.order.append(name)
            self.steps[name](self.state)
        return {name: functools.partial(phase, name) for name in self.steps}


def _tensor_steps() -> dict[str, Callable[[dict], None]]:
    """Known sizes: 4,000 bytes allocated, 2,400 in float64, a temporary that is freed at once, a view (no storage), a free, a copy."""
    def temporary(s):
        if "a" in s:
            s["total"] = float((s["a"] + 1).sum())

    def view(s):
        if "b" in s:
            s["v"] = s["b"][:100]

    def free(s):
        s.pop("a", None)

    def concatenate(s):
        if "b" in s:
            s["b"] = torch.cat([s["b"], s["b"]])

    return {  # each step runs in any order without an error, so that the check can say what the order was
        "allocate": lambda s: s.__setitem__("a", torch.zeros(1000)),
        "float64": lambda s: s.__setitem__("b", torch.ones(300, dtype=torch.float64)),
        "temporary": temporary,
        "view": view,
        "free": free,
        "concatenate": concatenate,
    }


def _training_steps() -> dict[str, Callable[[dict], None]]:
    """One training step of a small MLP with Adam, whose first step allocates its state (twice the parameters)."""
    torch.manual_seed(9)
    model = nn.Sequential(nn.Linear(24, 40), nn.ReLU(), nn.Linear(40, 40), nn.Tanh(), nn.Linear(40, 6))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(10)
    x, y = torch.randn(16, 24, generator=g), torch.randint(0, 6, (16,), generator=g)
    def loss(s):
        if "out" in s:
            s["loss"] = F.cross_entropy(s.pop("out"), y)

    def backward(s):
        if "loss" in s:
            s.pop("loss").backward()

    return {
        "forward": lambda s: s.__setitem__("out", model(x)),
        "loss": loss,
        "backward": backward,
        "optimizer step": lambda s: optimizer.step(),
    }


def _memory_cases() -> list[tuple[str, Callable[[], dict]]]:
    return [
        ("tensor phases", _tensor_steps),
        ("a training step", _training_steps),
        ("one phase that does nothing", lambda: {"nothing": lambda s: None}),
    ]


def _profiler_running() -> bool:
    return torch._C._autograd._profiler_enabled()


def _stop_profiler() -> None:
    """Stop a profiler that the learner's code started and left on, so that it does not record the rest of the session."""
    torch.autograd._disable_profiler()
    torch.autograd.profiler._set_is_profiler_enabled(False)


def _profiled(phases: dict[str, Callable[[], None]]) -> tuple[dict[str, int], dict[str, int]]:
    """The reference's numbers and the regions' self memory, from one profile."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for name, phase in phases.items():
            with record_function(name):
                phase()
    regions = {event.key: event for event in prof.key_averages()}
    return ({name: regions[name].cpu_memory_usage for name in phases}, {name: regions[name].self_cpu_memory_usage for name in phases})


@exercise("memory_by_phase")
def check_memory_by_phase(fn) -> None:
    quiet_profiler()
    if _profiler_running():
        raise ExerciseFailed("a profiler is still running in this kernel, started by an earlier cell: stop it (prof.stop()) and run this check again")
    for label, steps in _memory_cases():
        expected, self_only = _profiled(_Phases(steps()).phases())
        hidden = _Phases(steps())
        names = list(hidden.steps)
        what = f"memory_by_phase({label}: {names})"
        try:
            got = call(fn, hidden.phases(), shown=f"{label}: {names}")
        finally:
            left_on = _profiler_running()
            if left_on:
                _stop_profiler()
        if left_on:
            raise ExerciseFailed(f"{what} left the profiler running: use `with profile(...) as prof:`, or call prof.stop()")
        counts = {n: hidden.order.count(n) for n in names}
        if any(count != 1 for count in counts.values()):
            wrong = next(n for n in names if counts[n] != 1)
            raise ExerciseFailed(f"{what} ran the phase {wrong!r} {counts[wrong]} times; run each phase exactly once: a phase changes the state the next one works on")
        if hidden.order != names:
            raise ExerciseFailed(f"{what} ran the phases in the order {hidden.order}, expected the dict's order, {names}")
        got = _expect_dict(got, what, "bytes")
        if set(got) != set(names):
            extra = sorted(set(got) - set(names), key=str)
            if extra and set(names) <= set(got):
                raise ExerciseFailed(f"{what} returned {len(got)} keys, {extra[:3]} among them; expected only the phases' names, {names}")
            raise ExerciseFailed(f"{what} returned the keys {sorted(got, key=str)[:8]}, expected the phases' names, {names}")
        for name in names:
            value = got[name]
            if isinstance(value, bool) or isinstance(value, torch.Tensor) or not isinstance(value, (int, float)):
                raise ExerciseFailed(f"{what}[{name!r}] is {a_type(value)}, expected a Python int (bytes)")
        if any(isinstance(v, float) for v in got.values()):
            if all(math.isclose(got[n] * 2**20, expected[n], abs_tol=1) for n in names):
                raise ExerciseFailed(f"{what} returned MiB: return the bytes themselves, as ints")
            if all(math.isclose(got[n] * 1024, expected[n], abs_tol=1) for n in names):
                raise ExerciseFailed(f"{what} returned KiB: return the bytes themselves, as ints")
            if all(got[n] == expected[n] for n in names):
                raise ExerciseFailed(f"{what} returned floats, expected Python ints (bytes)")
        if got == expected:
            continue
        if any(expected.values()) and not any(got.values()):
            raise ExerciseFailed(f"{what} returned 0 for every phase, expected {expected}; the profiler records memory only when created with profile_memory=True")
        if got == self_only and self_only != expected:
            raise ExerciseFailed(
                f"{what} returned each region's *self* memory, which leaves out the operators the phase ran: "
                "use the region's cpu_memory_usage (everything inside it)"
            )
        cumulative = {n: sum(expected[m] for m in names[i:]) for i, n in enumerate(names)}
        if got == cumulative:
            raise ExerciseFailed(f"{what}: each phase's number includes the phases after it: close each phase's region before the next phase starts")
        wrong = next(n for n in names if got[n] != expected[n])
        raise ExerciseFailed(f"{what}[{wrong!r}] is {got[wrong]!r} bytes, expected {expected[wrong]:,} (allocated minus freed during that phase)")


# checkpoint_segments

def _blocks(seed: int, widths: list[int], dropout: float = 0.0) -> nn.ModuleList:
    """Blocks of different widths, so that each block's input has a size of its own (each wider than all before it together,
    in the first case, so that the bytes saved tell which block inputs were saved)."""
    torch.manual_seed(seed)
    return nn.ModuleList([
        nn.Sequential(nn.Linear(a, b), nn.Tanh(), *([nn.Dropout(dropout)] if dropout else []))
        for a, b in zip(widths, widths[1:])
    ])


def _plain(blocks: nn.ModuleList, x: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """The output without checkpointing, and the bytes of each block's input."""
    sizes = []
    for block in blocks:
        sizes.append(x.untyped_storage().nbytes())
        x = block(x)
    return x, sizes


def _segment_starts(got_bytes: int, sizes: list[int]) -> list[int] | None:
    """Which block inputs add up to got_bytes, when exactly one set of them does (the sizes differ by design)."""
    found = [starts for n in range(1, len(sizes) + 1) for starts in _subsets(len(sizes), n) if sum(sizes[i] for i in starts) == got_bytes]
    return found[0] if len(found) == 1 else None


def _subsets(n: int, k: int):
    return (list(c) for c in itertools.combinations(range(n), k))


@exercise("checkpoint_segments")
def check_checkpoint_segments(fn) -> None:
    cases = [  # 7 blocks in 3 + 3 + 1; dropout, replayed in backward; one segment for all; a segment per block
        ("7 blocks", _blocks(31, [3, 5, 10, 19, 38, 76, 151, 8]), 5, 3),
        ("5 blocks with dropout", _blocks(32, [9, 11, 13, 15, 17, 19], dropout=0.3), 1, 2),
        ("4 blocks", _blocks(33, [6, 7, 8, 9, 10]), 3, 4),
        ("3 blocks", _blocks(34, [5, 8, 11, 14]), 2, 1),
    ]
    g = torch.Generator().manual_seed(35)
    for label, blocks, batch, size in cases:
        n = len(blocks)
        x = torch.randn(batch, blocks[0][0].in_features, generator=g)  # a batch of data: it does not require grad
        shown = f"{label}, tensor of shape {tuple(x.shape)}, {size}"
        what = f"checkpoint_segments({shown})"
        starts = list(range(0, n, size))
        torch.manual_seed(36)
        (expected, sizes), plain_bytes = saved_activation_bytes(lambda: _plain(blocks, x), blocks.parameters())
        expected.sum().backward()
        expected_grads = {name: p.grad.clone() for name, p in blocks.named_parameters()}
        blocks.zero_grad(set_to_none=True)
        expected_bytes = sum(sizes[i] for i in starts)

        calls = [0] * n  # forward calls of each block: 2 inside a checkpoint (the forward pass, then the recomputation), 1 outside
        handles = [b.register_forward_pre_hook(lambda m, args, i=i: calls.__setitem__(i, calls[i] + 1)) for i, b in enumerate(blocks)]
        x_before = x.clone()
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.manual_seed(36)
                got, got_bytes = saved_activation_bytes(lambda: call(fn, blocks, x, size, shown=shown), blocks.parameters())
                if isinstance(got, torch.Tensor) and got.requires_grad:
                    _backward_through_checkpoints(got, what)
        finally:
            for h in handles:
                h.remove()
        messages = [str(w.message) for w in caught]
        expect_unchanged(x_before, x, what="checkpoint_segments")
        if x.requires_grad:
            raise ExerciseFailed(f"{what} switched on requires_grad on the caller's batch: with use_reentrant=False the input need not require grad")
        if got is None:
            raise ExerciseFailed(f"{what} returned None: did you forget to `return` the output?")
        if not isinstance(got, torch.Tensor):
            raise ExerciseFailed(f"{what} returned {a_type(got)}, expected the output tensor")
        if not got.requires_grad and any("None of the inputs have requires_grad" in m for m in messages):
            raise ExerciseFailed(
                f"{what} returned an output with no graph: the reentrant checkpoint (use_reentrant=True, or not passed) drops the gradients "
                "when its input does not require grad; pass use_reentrant=False"
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
                "run each segment through torch.utils.checkpoint.checkpoint(..., use_reentrant=False)"
            )
        outside = [i for i in range(n) if calls[i] == 1]
        if outside and 2 in calls:
            raise ExerciseFailed(
                f"{what}: block {outside[-1]} ran only once, in the forward pass, so it was outside every checkpoint; every block must be "
                "inside one" + (" (checkpoint_sequential leaves its last segment out)" if outside[-1] == n - 1 else "")
            )
        if got_bytes != expected_bytes:
            if size > 1 and got_bytes == sum(sizes):
                raise ExerciseFailed(f"{what} checkpointed every block on its own ({got_bytes:,} bytes of block inputs saved); "
                                     f"expected segments of {size} blocks, saving {expected_bytes:,} bytes")
            found = _segment_starts(got_bytes, sizes)
            saved = f"the inputs of blocks {found} ({got_bytes:,} bytes)" if found else f"{got_bytes:,} bytes"
            raise ExerciseFailed(f"{what} saved {saved} for backward; segments of {size} blocks start at blocks {starts}, "
                                 f"whose inputs take {expected_bytes:,} bytes")
        for name, p in blocks.named_parameters():
            if p.grad is None:
                raise ExerciseFailed(f"after backward through {what}, parameter {name!r} has no gradient")
            if label.endswith("dropout") and not _same(p.grad, expected_grads[name]):
                raise ExerciseFailed(
                    f"the gradient of blocks.{name} through {what} differs from the plain pass, and the blocks without dropout agreed: "
                    "the recomputation in backward drew other dropout masks; keep checkpoint's default preserve_rng_state=True"
                )
            expect_tensor(p.grad, expected_grads[name], what=f"the gradient of blocks.{name} through {what}", atol=1e-6)


def _backward_through_checkpoints(out: torch.Tensor, what: str) -> None:
    """out.sum().backward(); an error in the recomputation is reported in one line."""
    try:
        out.sum().backward()
    except Exception as err:  # noqa: BLE001 -- raised by the recomputation of the learner's checkpointed function
        text = first_line(err)
        if "shape" in text or "Recomputed values" in text or "size of tensor" in text:
            raise ExerciseFailed(
                f"backward through {what} raised {type(err).__name__}: {text[:100]}: the recomputation ran other blocks than the "
                "forward pass did; a function that reads a loop variable when it runs sees the variable's last value"
            ) from None
        raise ExerciseFailed(f"backward through {what} raised {type(err).__name__}: {text}") from None
