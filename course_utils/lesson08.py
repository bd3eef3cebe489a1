"""Lesson 08 (hooks, profiling and debugging): reference solutions and the checks for its exercises."""

import contextlib
import functools
import gc
import itertools
import json
import math
import os
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

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
    first_line,
    learner_frame,
    scoreboard_for,
    stub_function,
    where,
)
from course_utils.tooling.language import N_, _, ngettext

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


def add_gradient_reversal(module: nn.Module, strength: Callable[[], float]) -> RemovableHandle:
    """From now on, module(x) passes x on unchanged and multiplies the gradient flowing back through x by -strength(),
    read at that forward call; return the handle that undoes it."""
    def reverse(module, args):
        (x,) = args
        if not (torch.is_grad_enabled() and x.requires_grad):  # evaluation, or a batch of data: no gradient flows back
            return None
        lam = strength()  # this step's strength, fixed when the graph is built
        x = x.view_as(x)  # a node of this branch's own: a hook on x itself would see every use's gradient
        x.register_hook(lambda grad: -lam * grad)
        return (x,)
    return module.register_forward_pre_hook(reverse)


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


def _hook_keys(model: nn.Module) -> set[tuple[int, str, int]]:
    """(module id, hook dict, hook id) for every module hook on the model: what the caller had before a call."""
    return {(id(m), d, key) for m in model.modules() for d in HOOK_DICTS for key in getattr(m, d)}


def _leaked_hooks(model: nn.Module, global_before: set[tuple[str, int]], kept: set = frozenset()) -> list[str]:
    """The modules that carry hooks other than the caller's own (`kept`), the model itself as 'the model itself', and any new
    global module hook."""
    leaked = [name or _("the model itself") for name, m in model.named_modules()
              if any((id(m), d, key) not in kept for d in HOOK_DICTS for key in getattr(m, d))]
    if _global_hooks() - global_before:
        leaked.append(_("all modules (a global hook)"))
    return leaked


def _remove_hooks(model: nn.Module, global_before: set[tuple[str, int]], kept: set = frozenset()) -> None:
    """Take the learner's leaked hooks off (the caller's own, `kept`, stay), so that later cases and cells start clean."""
    for m in model.modules():
        for d in HOOK_DICTS:
            hooks = getattr(m, d)
            for key in [k for k in hooks if (id(m), d, k) not in kept]:
                del hooks[key]
    for d, key in _global_hooks() - global_before:
        getattr(module_globals, d).pop(key, None)


def _expect_no_hooks(model: nn.Module, global_before: set[tuple[str, int]], what: str, let_through: bool = False,
                     kept: set = frozenset()) -> None:
    """`let_through`: the call let the model's ModelError through (then a leaked hook means a missing finally: block)."""
    gone = [key for key in kept if key not in _hook_keys(model)]
    if gone:
        raise ExerciseFailed(ngettext("{what} removed {n} hook that the caller had put on the model: "
                                      "remove only the hooks you registered, through their handles",
                                      "{what} removed {n} hooks that the caller had put on the model: "
                                      "remove only the hooks you registered, through their handles", len(gone)).format(what=what, n=len(gone)))
    leaked = _leaked_hooks(model, global_before, kept)
    if not leaked:
        return
    _remove_hooks(model, global_before, kept)
    if let_through:
        raise ExerciseFailed(
            _("{what} let the model's ModelError through and left hooks on {leaked}: remove every handle in a finally: block, "
              "which runs when an error passes through").format(what=what, leaked=leaked)
        )
    raise ExerciseFailed(_("{what} left hooks on {leaked}: they run on every later call; keep each handle that register_* returns "
                           "and call handle.remove()").format(what=what, leaked=leaked))


def _callers_hook(model: nn.Module, seen: list[int] | None = None) -> set[tuple[int, str, int]]:
    """Put a hook of the caller's own on the model (a forward hook that only looks); return the model's hook keys with it.
    Each time it runs it notes in `seen` how many other forward hooks, the global ones included, the model has then."""
    def look(module, args, output):
        if seen is not None:
            seen.append(len(module._forward_hooks) - 1 + len(module_globals._global_forward_hooks))

    model.register_forward_hook(look)
    return _hook_keys(model)


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
        raise ExerciseFailed(_("{what} raised {error}: {message}, expected the model's own ModelError to reach the caller").format(
            what=what, error=type(raised).__name__, message=first_line(raised)))
    _expect_no_hooks(model, global_before, what, let_through=bool(raised))
    if raised is None:
        raise ExerciseFailed(_("{what} returned although the model's forward pass raised ModelError: let the error reach the caller "
                               "(try/finally, no except)").format(what=what))


def _model_state(model: nn.Module) -> dict[str, dict]:
    """What a check must find unchanged on the caller's model: each module's mode, each parameter's values, requires_grad
    flag and .grad, and the buffers."""
    return {
        "mode": {n: m.training for n, m in model.named_modules()},
        "values": {n: p.detach().clone() for n, p in model.named_parameters()},
        "requires_grad": {n: p.requires_grad for n, p in model.named_parameters()},
        "grads": {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
        "buffers": {n: b.clone() for n, b in model.named_buffers()},
    }


def _expect_model_unchanged(model: nn.Module, before: dict[str, dict], what: str, probe: bool = True) -> None:
    """Fail when the learner's call changed the caller's model: a mode, a parameter, a requires_grad flag, a .grad, a buffer."""
    modules, params, buffers = dict(model.named_modules()), dict(model.named_parameters()), dict(model.named_buffers())
    for name, was_training in before["mode"].items():
        if name in modules and modules[name].training != was_training:
            if name == "":
                message = (_("{what} left the model in training mode; it was in eval mode") if modules[name].training
                           else _("{what} left the model in eval mode; it was in training mode"))
            else:
                message = (_("{what} left {name!r} in training mode; it was in eval mode") if modules[name].training
                           else _("{what} left {name!r} in eval mode; it was in training mode"))
            raise ExerciseFailed(message.format(what=what, name=name))
    for name, flag in before["requires_grad"].items():
        if name in params and params[name].requires_grad != flag:
            if not flag:
                message = _("{what} switched requires_grad on for {name}, which was frozen (requires_grad=False): "
                            "leave the caller's parameters as they were")
            else:
                message = _("{what} switched requires_grad off for {name}, which was trainable: "
                            "leave the caller's parameters as they were")
            raise ExerciseFailed(message.format(what=what, name=name))
    for name, value in before["values"].items():
        if name in params and not torch.equal(params[name].detach(), value):
            raise ExerciseFailed(_("{what} changed the values of parameter {name}: an optimizer step or an in-place operation on "
                                   "the caller's model").format(what=what, name=name))
    for name, grad in before["grads"].items():
        after = params[name].grad if name in params else None
        if (grad is None) != (after is None) or (grad is not None and not torch.equal(grad, after)):
            advice = (_("a probe leaves .grad as it was (torch.autograd.grad returns the gradients without touching .grad)") if probe
                      else _("leave .grad as it was"))
            if grad is None:
                message = _("{what} changed {name}.grad, which held None: {advice}")
            else:
                message = _("{what} changed {name}.grad, which held a stale gradient: {advice}")
            raise ExerciseFailed(message.format(what=what, name=name, advice=advice))
    for name, value in before["buffers"].items():
        if name in buffers and not torch.equal(buffers[name], value):
            raise ExerciseFailed(_("{what} changed the buffer {name} of the caller's model").format(what=what, name=name))


def _expect_tensor_unchanged(before: torch.Tensor, requires_grad: bool, after: torch.Tensor, what: str, name: str) -> None:
    """Fail when the learner's call changed the caller's tensor: its values, or its requires_grad flag."""
    if after.requires_grad != requires_grad:
        if after.requires_grad:
            message = _("{what} switched on requires_grad on the caller's {name}: leave the caller's tensor as it was")
        else:
            message = _("{what} switched off requires_grad on the caller's {name}: leave the caller's tensor as it was")
        raise ExerciseFailed(message.format(what=what, name=name))
    if before.shape != after.shape or not torch.equal(before, after.detach()):
        raise ExerciseFailed(_("{what} modified the caller's {name} in place: work on a copy, or use out-of-place operations").format(
            what=what, name=name))


def _expect_dict(got: Any, what: str, returned_what: str) -> dict:
    if got is None:
        raise ExerciseFailed(_("{what} returned None: did you forget to `return` the dict?").format(what=what))
    if not isinstance(got, dict):
        raise ExerciseFailed(_("{what} returned {a_type}, expected a dict {{name: {returned_what}}}").format(
            what=what, a_type=a_type(got), returned_what=returned_what))
    return got


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a.float(), b.float(), atol=1e-6)


def _backward(loss: torch.Tensor, what: str) -> None:
    """loss.backward(), with an error raised by the learner's hook reported in one line."""
    try:
        loss.backward()
    except Exception as err:  # noqa: BLE001 -- raised by the learner's hook, reported as theirs
        frame = learner_frame(err, __file__)
        place = where(frame) if frame else ""
        raise ExerciseFailed(_("backward() through {what} raised {error}: {message}{place}").format(
            what=what, error=type(err).__name__, message=first_line(err), place=place)) from None


# capture_activations

class _Counted(nn.Module):
    """A hidden model that counts its forward passes (`runs`, counted by its forward) and the calls that came through
    model(x), which runs the hooks (`calls`), rather than through model.forward(x), which skips the model's own."""

    def __init__(self):
        super().__init__()
        self.runs = 0
        self.calls = 0
        self.inputs: list[Any] = []

    def __call__(self, *args, **kwargs):
        self.calls += 1
        self.inputs.append(args[0] if args else None)
        return super().__call__(*args, **kwargs)

    def recount(self) -> None:
        self.runs = self.calls = 0
        self.inputs = []


def _expect_one_run(model: _Counted, what: str, x: torch.Tensor) -> None:
    """The prompt says "run model(x) once": its forward ran exactly once, called as model(x), on x itself."""
    if model.runs == 0:
        raise ExerciseFailed(_("{what} never ran the model: call model(x) once, with the hooks on").format(what=what))
    if model.runs > 1:
        raise ExerciseFailed(_("{what} ran the model {runs} times; run model(x) once: the hooks see every pass").format(
            what=what, runs=model.runs))
    if model.calls == 0:
        raise ExerciseFailed(_("{what} called model.forward(x), which skips the model's own hooks: call model(x)").format(what=what))
    given = model.inputs[0]
    if not isinstance(given, torch.Tensor) or given.shape != x.shape or not torch.equal(given.detach(), x):
        if isinstance(given, torch.Tensor):
            raise ExerciseFailed(_("{what} ran the model on an input other than x (of shape {given_shape}, x has shape {x_shape}): "
                                   "run model(x)").format(what=what, given_shape=tuple(given.shape), x_shape=tuple(x.shape)))
        raise ExerciseFailed(_("{what} ran the model on an input other than x ({given_type}, x has shape {x_shape}): run model(x)").format(
            what=what, given_type=a_type(given), x_shape=tuple(x.shape)))


class _Probe(_Counted):
    """A small model with named, nested sub-modules; `trip` makes its forward raise after `block` has run."""

    def __init__(self, trip: bool = False):
        super().__init__()
        self.stem = nn.Linear(6, 8)
        self.act = nn.ReLU()
        self.block = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.head = nn.Linear(8, 3)
        self.trip = trip

    def forward(self, x):
        self.runs += 1
        h = self.block(self.act(self.stem(x)))
        if self.trip:
            raise ModelError("the hidden model failed on purpose")
        return self.head(h)


def _probe(seed: int, trip: bool = False) -> _Probe:
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


def _expect_names(got: Any, names: list[str], what: str, returned_what: str, hook_args: str, model: nn.Module | None = None) -> dict:
    """A dict with exactly the names a hook-registering answer was given; the late-binding closure, nested names and the
    modules that have children named."""
    got = _expect_dict(got, what, returned_what)
    if len(got) == 1 and len(names) > 1 and next(iter(got)) == names[-1]:
        raise ExerciseFailed(
            _("{what} returned only the key {last!r}: every hook used the loop variable's last value; "
              "bind each name when you define the hook, e.g. def hook({hook_args}, name=name)").format(
                what=what, last=names[-1], hook_args=hook_args)
        )
    missing, extra = [n for n in names if n not in got], [k for k in got if k not in names]
    if missing and not extra and all("." in n for n in missing):
        raise ExerciseFailed(ngettext(
            "{what} has no entry for the nested name {missing}: look each name up in dict(model.named_modules()), "
            "which spells nested modules with dots (named_children() lists only the top level)",
            "{what} has no entry for the nested names {missing}: look each name up in dict(model.named_modules()), "
            "which spells nested modules with dots (named_children() lists only the top level)", len(missing)).format(
                what=what, missing=missing))
    if missing == [""] and not extra:
        raise ExerciseFailed(_("{what} has no entry for '' (the model itself): named_modules() lists the model first, with the name ''; "
                               "its own forward hook runs only when you call model(x)").format(what=what))
    if model is not None and missing and not extra:
        modules = dict(model.named_modules())
        parents = {n for n in names if n in modules and next(modules[n].children(), None) is not None}
        if set(missing) == parents:
            shown = ", ".join(_("'' (the model itself)") if n == "" else repr(n) for n in missing)
            raise ExerciseFailed(_("{what} has no entry for {shown}: exactly the names of modules that have children are missing; "
                                   "every name you were given counts, containers and the model itself too").format(what=what, shown=shown))
    if set(got) != set(names):
        raise ExerciseFailed(_("{what} returned the keys {got_keys}, expected {names} (the names you were given)").format(
            what=what, got_keys=sorted(got, key=str), names=sorted(names)))
    return got


NESTED_NAME_HINT = {"'block.1'": N_("a nested name: model._modules and named_children() know only the top level; look names up in "
                                    "dict(model.named_modules())"),
                    "'body.1'": N_("a nested name: model._modules and named_children() know only the top level; look names up in "
                                   "dict(model.named_modules())")}


@exercise("capture_activations")
def check_capture_activations(fn) -> None:
    model = _probe(0)
    g = torch.Generator().manual_seed(1)
    for batch, names, training in ((5, ["stem", "block.1", "head"], True), (1, ["act", "block", ""], False),
                                   (3, ["head", "block.0", "stem"], True)):
        model.train(training)
        model.block[0].requires_grad_(batch != 3)  # a frozen layer in the last case: it stays frozen
        x = torch.randn(batch, 6, generator=g)
        x_before = x.clone()
        shown = _("model, tensor of shape {shape}, {names}").format(shape=tuple(x.shape), names=names)
        what = f"capture_activations({shown})"
        inputs, expected = _inputs_and_outputs(model, x, [n for n in names if n])
        every = [n for n, _module in model.named_modules() if n]
        outputs_of_all = dict(sorted(_inputs_and_outputs(model, x, every)[1].items(), key=lambda item: every.index(item[0])))
        if "" in names:
            with torch.no_grad():
                inputs[""], expected[""] = x, model(x)
        global_before, state, kept = _global_hooks(), _model_state(model), _callers_hook(model)
        model.recount()
        got = call(fn, model, x, list(names), shown=shown, hints=NESTED_NAME_HINT)
        _expect_no_hooks(model, global_before, what, kept=kept)
        _remove_hooks(model, global_before)
        _expect_one_run(model, what, x)
        _expect_tensor_unchanged(x_before, False, x, what, "x")
        _expect_model_unchanged(model, state, what, probe=False)
        got = _expect_names(got, names, what, _("activation"), "module, args, output", model)
        for name in names:
            value = got[name]
            if isinstance(value, (tuple, list)) and torch.is_tensor(value[0] if value else None):
                container = type(value).__name__
                if len(value) == 1 and _same(value[0].detach(), expected[name]):
                    raise ExerciseFailed(_("{what}[{name!r}] is a {container} that holds the output: store the output itself, "
                                           "one tensor per name").format(what=what, name=name, container=container))
                if _same(value[0].detach(), inputs[name]):
                    raise ExerciseFailed(_("{what}[{name!r}] is a {container} that holds the module's input: a forward hook is "
                                           "called as hook(module, args, output), and args is the tuple of inputs; store output").format(
                                               what=what, name=name, container=container))
                raise ExerciseFailed(_("{what}[{name!r}] is a {container}, expected a tensor (the sub-module's output)").format(
                    what=what, name=name, container=container))
            if not isinstance(value, torch.Tensor):
                raise ExerciseFailed(_("{what}[{name!r}] is {a_type}, expected a tensor (the sub-module's output)").format(
                    what=what, name=name, a_type=a_type(value)))
            if value.requires_grad:
                raise ExerciseFailed(
                    _("{what}[{name!r}] still requires grad, so it keeps the whole graph of the forward pass alive: "
                      "store output.detach()").format(what=what, name=name)
                )
            if _same(value, inputs[name]) and not _same(inputs[name], expected[name]):
                raise ExerciseFailed(_("{what}[{name!r}] is the module's input: a forward hook is called as hook(module, args, output); "
                                       "store output").format(what=what, name=name))
            if value.ndim == expected[name].ndim - 1 and expected[name].shape[0] > 1 and _same(value, expected[name][0]):
                raise ExerciseFailed(_("{what}[{name!r}] is the first sample's output only (output[0]), of shape {shape}: "
                                       "store the whole batch's output, of shape {expected_shape}").format(
                                           what=what, name=name, shape=tuple(value.shape), expected_shape=tuple(expected[name].shape)))
            other = next((n for n, out in outputs_of_all.items() if n != name and _same(value, out) and not _same(out, expected[name])), None)
            if other is not None:
                if other == "":
                    message = _("{what}[{name!r}] is the model's output: store each output under its own module's name")
                else:
                    message = _("{what}[{name!r}] is {other!r}'s output: store each output under its own module's name")
                raise ExerciseFailed(message.format(what=what, name=name, other=other))
            expect_tensor(value, expected[name], what=f"{what}[{name!r}]", atol=1e-6)

    tripped = _probe(0, trip=True)
    names = ["stem", "block", "head"]  # head never runs: its hook must go although it was never called
    x = torch.randn(4, 6, generator=g)
    shown = _("a model whose forward raises, tensor of shape (4, 6), {names}").format(names=names)
    _expect_model_error(fn, (tripped, x, names), f"capture_activations({shown})", tripped, _global_hooks())


# layer_grad_norms

class _Tower(_Counted):
    """A small classifier with a nested block; `trip` makes its forward raise after the body has run."""

    def __init__(self, trip: bool = False):
        super().__init__()
        self.stem = nn.Linear(7, 12)
        self.body = nn.Sequential(nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 12), nn.ReLU())
        self.head = nn.Linear(12, 4)
        self.trip = trip

    def forward(self, x):
        self.runs += 1
        h = self.body(self.stem(x))
        if self.trip:
            raise ModelError("the hidden model failed on purpose")
        return self.head(h)


def _tower(seed: int, trip: bool = False) -> _Tower:
    torch.manual_seed(seed)
    return _Tower(trip)


def _boundary_grads(model: nn.Module, x, y, loss_fn, names) -> tuple[dict, dict, dict]:
    """{name: d loss / d output}, {name: |d loss / d input|, None where the input needs no gradient} and {name: |d loss / d weight|
    where the module has a trainable weight}, computed with torch.autograd.grad on the outputs and inputs that forward hooks kept."""
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
    weights = {n: modules[n].weight for n in names if isinstance(getattr(modules[n], "weight", None), nn.Parameter)
               and modules[n].weight.requires_grad}
    wanted = [outs[n] for n in names] + [ins[n] for n in names if ins[n].requires_grad] + list(weights.values())
    grads = torch.autograd.grad(loss, wanted)
    out_grads = dict(zip(names, grads))
    rest = iter(grads[len(names):])
    in_norms = {n: next(rest).norm().item() if ins[n].requires_grad else None for n in names}
    weight_norms = {n: next(rest).norm().item() for n in weights}
    return out_grads, in_norms, weight_norms


# What a learner's number is, when it is one of these instead of the norm of d loss / d output (g: that gradient).
NORM_MIX_UPS = {
    N_("the squared norm (the sum of squares): take its square root, grad.norm()"): lambda g: g.pow(2).sum(),
    N_("the mean of |grad|, not the L2 norm"): lambda g: g.abs().mean(),
    N_("the L1 norm (the sum of |grad|), not the L2 norm"): lambda g: g.abs().sum(),
    N_("the largest |grad| (the max norm), not the L2 norm"): lambda g: g.abs().max(),
    N_("the mean of the squares, not the L2 norm"): lambda g: g.pow(2).mean(),
    N_("the root mean square, not the L2 norm (the mean divides by the number of elements)"): lambda g: g.pow(2).mean().sqrt(),
    N_("half the squared norm, not the L2 norm"): lambda g: g.pow(2).sum() / 2,
    N_("the mean of the per-sample norms, not the norm of the whole gradient"): lambda g: g.flatten(1).norm(dim=1).mean(),
    N_("the sum of the per-sample norms, not the norm of the whole gradient"): lambda g: g.flatten(1).norm(dim=1).sum(),
    N_("the norm divided by the batch size: the L2 norm of the whole gradient is wanted, as it is"): lambda g: g.norm() / g.shape[0],
    N_("the norm divided by the number of elements: the L2 norm of the whole gradient is wanted, as it is"): lambda g: g.norm() / g.numel(),
    N_("the norm of the first sample's gradient only, not of the whole batch's"): lambda g: g[0].norm(),
    N_("the spectral norm (the largest singular value, ord=2 of a matrix), not the L2 norm of all elements"):
        lambda g: torch.linalg.matrix_norm(g.flatten(1), ord=2),
    N_("the norm of the gradient averaged over the batch, not of the whole gradient"): lambda g: g.mean(0).norm(),
}


def _hook_kinds(model: nn.Module, names: list[str]) -> tuple[dict[str, set], set[str], list]:
    """Watch which backward hooks are on each named module when its forward runs (the learner registers them before
    the forward pass, where PyTorch sets them up): {name: {'full', 'old'}}; the names whose output a gradient reached
    during the call (filled by the backward pass); and the watching hooks' handles."""
    modules, seen, reached = dict(model.named_modules()), {n: set() for n in names}, set()

    def mark(module, args, output, name):  # returns None: only looks
        for t in tensors_in(output):
            if t.requires_grad:
                t.register_hook(lambda grad, name=name: reached.add(name))

    def look(module, args, name):
        full_global = bool(module_globals._global_backward_hooks) and module_globals._global_is_full_backward_hook
        if module._backward_pre_hooks or module_globals._global_backward_pre_hooks or full_global:
            seen[name].add("full")
        if module._backward_hooks:
            seen[name].add("full" if module._is_full_backward_hook else "old")
        if module_globals._global_backward_hooks and not module_globals._global_is_full_backward_hook:
            seen[name].add("old")

    handles = [modules[n].register_forward_pre_hook(functools.partial(look, name=n)) for n in names]
    handles += [modules[n].register_forward_hook(functools.partial(mark, name=n)) for n in names]
    return seen, reached, handles


@exercise("layer_grad_norms")
def check_layer_grad_norms(fn) -> None:
    hints = {
        "'NoneType' object has no attribute": N_("something your code used is None; grad_input holds None for an input that needs "
                                                 "no gradient, such as the data going into the first layer"),
        "One of the differentiated Tensors does not require grad": N_("some parameters are frozen (requires_grad=False): "
                                                                     "differentiate only those that require grad"),
        "element 0 of tensors does not require grad": N_("the loss has no graph: the forward pass ran with gradients off "
                                                         "(torch.no_grad(), inference_mode) or its output was detached"),
        "has no len()": N_("a full backward hook's return value replaces grad_input, so it must be None or a tuple; your hook "
                           "returned something else (dict.setdefault returns the value)"),
        **NESTED_NAME_HINT,
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
        shown = _("model, inputs of shape {x_shape}, targets of shape {y_shape}, {loss_fn}, {names}").format(
            x_shape=tuple(x.shape), y_shape=tuple(y.shape), loss_fn=loss_name, names=names)
        what = f"layer_grad_norms({shown})"
        out_grads, grad_inputs, weight_norms = _boundary_grads(model, x, y, loss_fn, names)
        expected = {n: grad.norm().item() for n, grad in out_grads.items()}
        x_before, y_before, state = x.clone(), y.clone(), _model_state(model)
        global_before = _global_hooks()
        kinds, reached, watchers = _hook_kinds(model, names)
        model.recount()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the first layer's input needs no gradient: its full backward hook warns
                frozen = any(not p.requires_grad for p in model.parameters())
                got = call(fn, model, x, y, loss_fn, list(names), shown=shown, hints={**hints, **({} if frozen else {
                    "One of the differentiated Tensors does not require grad": N_("a tensor you differentiated with respect to does not "
                    "require grad: no parameter of this model is frozen, and the data x needs no gradient; differentiate with respect "
                    "to the trainable parameters")})})
        finally:
            for handle in watchers:
                handle.remove()
        _expect_no_hooks(model, global_before, what)
        _expect_one_run(model, what, x)
        if any("old" in k for k in kinds.values()):
            raise ExerciseFailed(
                _("{what} used register_backward_hook, which is deprecated and misses gradients of modules made of several operations: "
                  "use register_full_backward_hook").format(what=what)
            )
        unhooked = [n for n in names if not kinds[n]]
        _expect_tensor_unchanged(x_before, False, x, what, "x")
        _expect_tensor_unchanged(y_before, False, y, what, "y")
        _expect_model_unchanged(model, state, what)
        if unhooked and all("." in n for n in unhooked) and len(unhooked) < len(names) and isinstance(got, dict) and \
                not any(n in got for n in unhooked):
            raise ExerciseFailed(ngettext(
                "{what} put no hook on the nested name {unhooked}: look each name up in dict(model.named_modules()), "
                "which spells nested modules with dots (named_children() lists only the top level)",
                "{what} put no hook on the nested names {unhooked}: look each name up in dict(model.named_modules()), "
                "which spells nested modules with dots (named_children() lists only the top level)", len(unhooked)).format(
                    what=what, unhooked=unhooked))
        if unhooked:
            raise ExerciseFailed(_("{what} ran the forward pass with no full backward hook on {unhooked}: the prompt asks for "
                                   "module.register_full_backward_hook, registered before the forward pass").format(what=what, unhooked=unhooked))
        if isinstance(got, dict) and not any(n in got for n in names) and not reached:
            if not got:
                message = _("{what} returned an empty dict: no gradient reached the layers' outputs during the call, so no backward "
                            "hook ran; run the loss backwards through the layers (with respect to tensors before them, such as the "
                            "trainable parameters)")
            else:
                message = _("{what} returned the keys {keys}: no gradient reached the layers' outputs during the call, so no backward "
                            "hook ran; run the loss backwards through the layers (with respect to tensors before them, such as the "
                            "trainable parameters)")
            raise ExerciseFailed(message.format(what=what, keys=sorted(got, key=str)[:6]))
        got = _expect_names(got, names, what, _("gradient norm"), "module, grad_input, grad_output", model)
        weight_values = {n: m.weight.detach().norm().item() for n, m in model.named_modules()
                         if n in names and isinstance(getattr(m, "weight", None), torch.Tensor)}
        _expect_norms(got, names, expected, out_grads, grad_inputs, weight_norms, weight_values, what,
                      {y.numel(): _("the number of target elements"), len(x): _("the batch size")})  # the batch size wins a tie

    tripped = _tower(5, trip=True)
    names = ["stem", "body"]
    x, y = torch.randn(3, 7, generator=g), torch.randint(0, 4, (3,), generator=g)
    shown = _("a model whose forward raises, inputs of shape (3, 7), targets of shape (3,), F.cross_entropy, {names}").format(names=names)
    _expect_model_error(fn, (tripped, x, y, F.cross_entropy, names), f"layer_grad_norms({shown})", tripped, _global_hooks())


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-7)


def _expect_norms(got: dict, names: list[str], expected: dict, out_grads: dict, grad_inputs: dict, weight_norms: dict,
                  weight_values: dict, what: str, counts: dict[int, str]) -> None:
    """Each value a Python float equal to the norm at the layer's output; a value that is a known other quantity named. `counts`:
    the sizes a loss summed instead of averaged would multiply every norm by, with their names."""
    numbers = {n: v for n, v in got.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}

    def stand_in(v: Any) -> bool:  # what a learner writes where grad_input holds None: None itself, 0, or NaN
        return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and (v == 0 or math.isnan(v)))

    # grad_input instead of grad_output: None (or a stand-in) exactly where the input needs no gradient, its norm elsewhere
    if any(grad_inputs[n] is None for n in names) and any(grad_inputs[n] is not None and not _close(grad_inputs[n], expected[n])
                                                          for n in names) and all(
            stand_in(got[n]) if grad_inputs[n] is None else (n in numbers and _close(numbers[n], grad_inputs[n])) for n in names):
        first = next(n for n in names if grad_inputs[n] is None)
        raise ExerciseFailed(_("{what}[{name!r}] is {value!r}, and the other values are the norms at the layers' inputs: you read "
                               "grad_input, which holds None for an input that needs no gradient (the data); the gradient at the output is "
                               "grad_output[0]").format(what=what, name=first, value=got[first]))
    for name in names:
        value = got[name]
        if isinstance(value, torch.Tensor):
            raise ExerciseFailed(_("{what}[{name!r}] is a tensor, expected a Python float: call .item() on the norm").format(what=what, name=name))
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ExerciseFailed(_("{what}[{name!r}] is {a_type}, expected a Python float").format(what=what, name=name, a_type=a_type(value)))
    ratios = [got[n] / expected[n] for n in names if expected[n] > 0]
    if ratios and all(math.isclose(r, ratios[0], rel_tol=1e-4) for r in ratios):
        scale = next(((count, label) for count, label in counts.items() if count > 1 and math.isclose(ratios[0], count, rel_tol=1e-4)), None)
        if scale:
            raise ExerciseFailed(_("{what}: every norm is {factor} times the expected one ({count_name}), e.g. [{name!r}] is "
                                   "{value:.6g}, expected {want:.6g}: the loss was summed where loss_fn averages "
                                   "(reduction='sum', or the mean multiplied by a count); use loss_fn(model(x), y) as it is").format(
                                       what=what, factor=scale[0], count_name=scale[1], name=names[0], value=got[names[0]],
                                       want=expected[names[0]]))
    for name in names:
        value, want = got[name], expected[name]
        if _close(value, want):
            continue
        if grad_inputs[name] is not None and _close(value, grad_inputs[name]):
            raise ExerciseFailed(
                _("{what}[{name!r}] is {value:.6g}, the norm of the gradient at the layer's input (grad_input); "
                  "expected {want:.6g}, at its output (grad_output)").format(what=what, name=name, value=value, want=want)
            )
        if name in weight_values and _close(value, weight_values[name]):
            raise ExerciseFailed(_("{what}[{name!r}] is {value:.6g}, the norm of the layer's weight itself; expected {want:.6g}, "
                                   "the norm of d loss / d the layer's output").format(what=what, name=name, value=value, want=want))
        if name in weight_norms and _close(value, weight_norms[name]):
            raise ExerciseFailed(_("{what}[{name!r}] is {value:.6g}, the norm of the gradient of the layer's weight; expected {want:.6g}, "
                                   "the norm of d loss / d the layer's output (grad_output)").format(what=what, name=name, value=value, want=want))
        other = next((n for n in names if n != name and _close(value, expected[n])), None)
        if other is not None:
            raise ExerciseFailed(_("{what}[{name!r}] is {value:.6g}, the norm at {other!r}'s output; expected {want:.6g}: record each norm "
                                   "under its own layer's name (the backward hooks run in the reverse order of the layers)").format(
                                       what=what, name=name, value=value, other=other, want=want))
        mix_up = next((_(text) for text, of in NORM_MIX_UPS.items() if _close(value, of(out_grads[name]).item())), None)
        if mix_up:
            raise ExerciseFailed(_("{what}[{name!r}] is {value:.6g}, {mix_up}; expected {want:.6g}").format(
                what=what, name=name, value=value, mix_up=mix_up, want=want))
        raise ExerciseFailed(_("{what}[{name!r}] is {value:.6g}, expected {want:.6g} (the L2 norm of d loss / d the layer's output)").format(
            what=what, name=name, value=value, want=want))


# add_gradient_reversal

class _Domain(nn.Module):
    """A domain classifier whose first operation adds a shift of the input's own shape. The check rebuilds the shift from
    the `offset` parameter before each call, so autograd hands one gradient tensor to both the input and the shift and
    reaches the shift last: a hook that edits its gradient in place shows in offset.grad."""

    def __init__(self, batch: int, width: int):
        super().__init__()
        self.offset = nn.Parameter(torch.zeros(batch, width))
        self.lin = nn.Linear(width, 2)
        self.shift = torch.zeros(batch, width)

    def rebuild(self) -> None:
        self.shift = self.offset * 1.0

    def forward(self, x):
        return self.lin(torch.tanh(x + self.shift))


class _Scale(torch.autograd.Function):
    """Identity in the forward pass; multiplies the gradient by a constant in the backward pass (the check's own reversal)."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


class _Adversarial:
    """Two training steps of a domain-adversarial model: features h = data @ w feed a label head and the domain classifier."""

    def __init__(self, seed: int):
        g = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)
        self.data = [torch.randn(4, 5, generator=g) for _step in range(2)]
        self.w = torch.randn(5, 6, generator=g).requires_grad_()
        self.label = nn.Linear(6, 3)
        self.domain = _Domain(4, 6)
        with torch.no_grad():
            self.domain.offset.copy_(torch.randn(4, 6, generator=g) * 0.3)
        self.label_weight, self.domain_weight = torch.randn(4, 3, generator=g), torch.randn(4, 2, generator=g)

    def params(self) -> dict[str, torch.Tensor]:
        return {"w": self.w, **{f"label.{n}": p for n, p in self.label.named_parameters()},
                **{f"domain.{n}": p for n, p in self.domain.named_parameters()}}

    def grads(self) -> dict[str, torch.Tensor | None]:
        """The gradients, which it then clears."""
        grads = {n: p.grad for n, p in self.params().items()}
        for p in self.params().values():
            p.grad = None
        return grads

    def loss(self, h: torch.Tensor, domain_out: torch.Tensor) -> torch.Tensor:
        return (self.label(h) * self.label_weight).sum() + (domain_out * self.domain_weight).sum()

    def plain_output(self, h: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.domain.lin(torch.tanh(h + self.domain.offset))

    def run(self, lams: tuple[float, ...], schedule: dict | None = None) -> dict[str, torch.Tensor]:
        """The gradients of len(lams) steps through the domain classifier with whatever hooks it has, strength() at lams[i]."""
        total = 0
        for data, lam in zip(self.data, lams):
            if schedule is not None:
                schedule["lam"] = lam
            self.domain.rebuild()
            h = data @ self.w
            total = total + self.loss(h, self.domain(h))
        total.backward()
        return self.grads()

    def simulate(self, factors: tuple[float, ...], where: str = "branch") -> dict[str, torch.Tensor]:
        """The gradients of len(factors) steps in which the gradient is multiplied by factors[i]: at the domain classifier's
        input ('branch', the exercise), on the features for every use ('input'), or at the classifier's output ('output').
        The module's own hooks are off meanwhile."""
        saved = {d: dict(getattr(self.domain, d)) for d in HOOK_DICTS}
        saved_global = {d: dict(getattr(module_globals, d)) for d in GLOBAL_HOOK_DICTS if hasattr(module_globals, d)}
        for d in HOOK_DICTS:
            getattr(self.domain, d).clear()
        for d in saved_global:
            getattr(module_globals, d).clear()
        try:
            total = 0
            for data, factor in zip(self.data, factors):
                self.domain.rebuild()
                h = data @ self.w
                if where == "input":
                    h = _Scale.apply(h, factor)
                out = self.domain(_Scale.apply(h, factor) if where == "branch" else h)
                total = total + self.loss(h, _Scale.apply(out, factor) if where == "output" else out)
            total.backward()
            return self.grads()
        finally:
            for d, hooks in saved.items():
                getattr(self.domain, d).update(hooks)
            for d, hooks in saved_global.items():
                getattr(module_globals, d).update(hooks)


def _same_grads(a: dict, b: dict) -> bool:
    return all((a[n] is None) == (b[n] is None) and (a[n] is None or torch.allclose(a[n], b[n], rtol=1e-4, atol=1e-7)) for n in a)


def _reversal_fault(world: _Adversarial, got: dict, lams: tuple[float, float], registered: float, late: float) -> str:
    """The usual mistake that explains a wrong set of gradients exactly, or ''."""
    expected = world.simulate((-lams[0], -lams[1]))
    others = [n for n in expected if n != "domain.offset"]
    if _same_grads({n: got[n] for n in others}, {n: expected[n] for n in others}):
        return _("the module's offset, which its first operation adds to the input, learned from the reversed gradient too: your hook "
                 "modified the gradient tensor it received in place, and autograd hands that tensor to the offset as well; "
                 "return a new one (-lam * grad)")
    places = [
        ("branch", ""),
        ("input", _("the features' other use (the label head) got the reversed gradient too: a hook on the input tensor itself sees its "
                    "gradient summed over every use; hook a tensor of the module's own branch instead (x.view_as(x))")),
        ("output", _("the module's own parameters learned from the reversed gradient: reverse the gradient at the module's input "
                     "(a forward pre-hook), not at its output")),
    ]
    factors = [  # the right factors first: then only the place is wrong
        ((-lams[0], -lams[1]), ""),
        ((1.0, 1.0), _("the gradient through the module came back unchanged: nothing was reversed")),
        ((lams[0], lams[1]), _("the gradient was multiplied by +strength(), not -strength()")),
        ((-1.0, -1.0), _("the gradient was multiplied by -1 whatever strength() returned")),
        ((-registered, -registered), _("both steps used the strength at the time add_gradient_reversal was called ({strength}): "
                                       "call strength() at each forward call").format(strength=registered)),
        ((-late, -late), _("both steps used the strength at the time backward ran ({strength}), not the one of the forward call that "
                           "built the graph: read strength() in the forward pass, and keep that value for its hook").format(strength=late)),
        ((-lams[1], -lams[1]), _("both steps used the strength of the last forward call ({strength}): give each forward call's hook its "
                                 "own strength").format(strength=lams[1])),
        ((-lams[0] ** 2, -lams[1] ** 2), _("the gradient was multiplied by -strength() squared: the reversal was applied twice")),
        ((-lams[0], -lams[0]), _("both steps used the strength of the first forward call ({strength}): read strength() at every "
                                 "forward call").format(strength=lams[0])),
        ((-1 / lams[0], -1 / lams[1]), _("the gradient was divided by strength(), not multiplied by it")),
        ((0.0, 0.0), _("the gradient from the module back into its input was zero: reverse it, do not stop it")),
        ((-lams[0], 1.0), _("only the first forward call's gradient was reversed: reverse it at every call")),
        ((1 - lams[0], 1 - lams[1]), _("the gradient was multiplied by 1 - strength(), not -strength()")),
    ]
    for scale, factor_fault in factors:
        for place, place_fault in places:
            if (place_fault or factor_fault) and not (place_fault and scale == (1.0, 1.0)) and \
                    _same_grads(got, world.simulate(scale, place)):
                if place_fault and factor_fault:
                    return _("{place_fault}; and {factor_fault}").format(place_fault=place_fault, factor_fault=factor_fault)
                return place_fault or factor_fault
    fitted = _fitted_factors(world, got)
    if fitted is not None:
        return _("the gradient through the module was multiplied by {first:.4g} in the step with strength() = {first_strength} and by "
                 "{second:.4g} in the step with {second_strength}; expected {first_expected:.4g} and {second_expected:.4g} "
                 "(-strength())").format(first=fitted[0], first_strength=lams[0], second=fitted[1], second_strength=lams[1],
                                         first_expected=-lams[0], second_expected=-lams[1])
    return ""


def _fitted_factors(world: _Adversarial, got: dict) -> tuple[float, float] | None:
    """The two factors by which the gradient through the module's branch was multiplied, when some pair explains every
    gradient exactly (the gradients are linear in them), else None."""
    if got["w"] is None:
        return None
    base = world.simulate((0.0, 0.0))
    first, second = (world.simulate(f)["w"] - base["w"] for f in ((1.0, 0.0), (0.0, 1.0)))
    basis = torch.stack([first.flatten(), second.flatten()], 1).double()
    solution = torch.linalg.lstsq(basis, (got["w"] - base["w"]).flatten().double().unsqueeze(1)).solution.flatten()
    factors = (solution[0].item(), solution[1].item())
    return factors if all(math.isfinite(f) for f in factors) and _same_grads(got, world.simulate(factors)) else None


@exercise("add_gradient_reversal")
def check_add_gradient_reversal(fn) -> None:
    hints = {
        "cannot register a hook on a tensor that doesn't require gradient": N_("under torch.no_grad(), or for an input that needs no "
        "gradient, there is nothing to reverse: leave such an input alone"),
    }
    world = _Adversarial(41)
    domain = world.domain
    schedule = {"lam": 0.05}
    shown = _("domain classifier, strength")
    what = f"add_gradient_reversal({shown})"
    before = _model_state(domain)
    handle = call(fn, domain, lambda: schedule["lam"], shown=shown)
    try:
        _expect_model_unchanged(domain, before, what)
        if handle is None:
            raise ExerciseFailed(_("{what} returned None: return the handle that register_forward_pre_hook(...) gives you, "
                                   "so that the caller can remove the hook").format(what=what))
        if not isinstance(handle, RemovableHandle):
            raise ExerciseFailed(_("{what} returned {a_type}: return the handle that module.register_forward_pre_hook(...) gives you").format(
                what=what, a_type=a_type(handle)))
        _judge_reversal(world, schedule, hints)
        handle.remove()
        if _leaked_hooks(domain, _global_hooks()):
            raise ExerciseFailed(_("after handle.remove(), hooks are still on the module: register one hook and return its handle"))
        if not _same_grads(world.run((0.3, 0.8)), world.simulate((1.0, 1.0))):
            raise ExerciseFailed(_("after handle.remove(), the gradient is still changed: return the handle of the hook that reverses it"))
    finally:
        _remove_hooks(domain, set())


def _reversed_steps(world: _Adversarial, schedule: dict, hints: dict, lams: tuple[float, float], late: float) -> dict:
    """Two forward passes through the learner's hooked module with strength() at lams, one backward after it moved to late;
    the gradients. The forward pass must leave the output and the caller's features as they were."""
    domain, total = world.domain, 0
    for step, (data, lam) in enumerate(zip(world.data, lams), 1):
        schedule["lam"] = lam
        domain.rebuild()
        h = data @ world.w
        h_before = h.detach().clone()
        shown = _("features of step {step}, strength() = {strength}").format(step=step, strength=lam)
        out = call(domain, h, name="domain", shown=shown, hints=hints, kind="module")
        _expect_tensor_unchanged(h_before, True, h, f"domain({shown})", _("features"))
        expect_tensor(out, world.plain_output(h), what=_("the domain classifier's output with the reversal on (the forward pass must "
                                                          "not change)"), atol=1e-6)
        total = total + world.loss(h, out)
    schedule["lam"] = late
    _backward(total, _("the domain classifier with the reversal on"))
    return world.grads()


def _judge_reversal(world: _Adversarial, schedule: dict, hints: dict) -> None:
    """Two forward passes with strength() at 0.3 and then 0.8, one backward after it moved to 1.7; the same from strength 0,
    where DANN's schedule starts; then evaluation calls."""
    domain, lams, late = world.domain, (0.3, 0.8), 1.7
    got = _reversed_steps(world, schedule, hints, lams, late)
    if not _same_grads(got, world.simulate((-lams[0], -lams[1]))):
        fault = _reversal_fault(world, got, lams, registered=0.05, late=late)
        if fault:
            raise ExerciseFailed(_("after two steps with strength() = {first}, then {second}: {fault}").format(
                first=lams[0], second=lams[1], fault=fault))
        expected = world.simulate((-lams[0], -lams[1]))
        wrong = next(n for n in got if not _same_grads({n: got[n]}, {n: expected[n]}))
        if got[wrong] is None:
            raise ExerciseFailed(_("after two steps with the reversal on, {name}.grad is None: the gradient no longer reaches it").format(
                name=wrong))
        expect_tensor(got[wrong], expected[wrong], what=_("the gradient of {name} after two steps with strength() = {first}, "
                                                          "then {second}").format(name=wrong, first=lams[0], second=lams[1]),
                      rtol=1e-4, atol=1e-7)
    start = (0.0, 0.5)  # -0 * grad is 0: at the schedule's start no gradient flows back from the module
    got = _reversed_steps(world, schedule, hints, start, late)
    expected = world.simulate((-start[0], -start[1]))
    if not _same_grads(got, expected):
        if _same_grads(got, world.simulate((1.0, -start[1]))):
            raise ExerciseFailed(_("after two steps with strength() = {first}, then {second}: at strength() = 0 the gradient came back "
                                   "unchanged; multiply it by -strength() at every strength, 0 included (then no gradient flows back from "
                                   "the module)").format(first=start[0], second=start[1]))
        wrong = next(n for n in got if not _same_grads({n: got[n]}, {n: expected[n]}))
        if got[wrong] is None:
            raise ExerciseFailed(_("after two steps with strength() = {first}, then {second}, {name}.grad is None: the gradient no "
                                   "longer reaches it").format(first=start[0], second=start[1], name=wrong))
        expect_tensor(got[wrong], expected[wrong], what=_("the gradient of {name} after two steps with strength() = {first}, "
                                                          "then {second}").format(name=wrong, first=start[0], second=start[1]),
                      rtol=1e-4, atol=1e-7)
    for shown, output_what, grad_mode, h in (
            (_("features, under torch.no_grad()"), _("the domain classifier's output under torch.no_grad()"),
             False, world.data[0] @ world.w),
            (_("features, on features that need no gradient"), _("the domain classifier's output on features that need no gradient"),
             True, world.data[1] @ world.w.detach())):
        domain.rebuild()
        h_before, needs_grad = h.detach().clone(), h.requires_grad
        with torch.set_grad_enabled(grad_mode):
            out = call(domain, h, name="domain", shown=shown, hints=hints, kind="module")
        _expect_tensor_unchanged(h_before, needs_grad, h, f"domain({shown})", _("features"))
        expect_tensor(out, world.plain_output(h), what=output_what, atol=1e-6)


# first_nonfinite

class _Exp(nn.Module):
    def forward(self, x):
        return x.exp()


class _Overflow(nn.Module):
    """Returns (x, (tanh(x), x * 1e38)): the last tensor overflows to inf where |x| > 3.4, and nothing downstream uses it."""

    def forward(self, x):
        return x, (x.tanh(), x * 1e38)


class _Ordered(_Counted):
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
        self.runs += 1
        h = self.block(self.embed(x))
        if self.trip:
            raise ModelError("the hidden model failed on purpose")
        return self.out(self.head(self.norm(h))).nan_to_num()


class _Recurrent(_Counted):
    """An LSTM (whose output is a nested tuple) and a module whose second output can hold inf."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(4, 6, batch_first=True)
        self.split = _Overflow()
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        self.runs += 1
        out, _state = self.lstm(x)
        h, (squashed, _huge) = self.split(out[:, -1] * 10)
        return self.head(h + squashed)


class _Softmax(_Counted):
    """Its children give finite logits; its own forward takes a softmax by hand, exp / sum, which overflows to inf / inf = NaN."""

    def __init__(self):
        super().__init__()
        self.hidden = nn.Sequential(nn.Linear(3, 16), nn.ReLU())
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        self.runs += 1
        e = self.out(self.hidden(x)).exp()
        return e / e.sum(-1, keepdim=True)


class _LogBlock(nn.Module):
    """A module with a child whose own forward takes a log: the child's output is finite, its negative values' log is NaN."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 4)

    def forward(self, x):
        return self.inner(x).log()


class _Nested(_Counted):
    """The NaN starts in a container's own forward ('block'), and every later module's output holds it too."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(3, 4)
        self.block = _LogBlock()
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        self.runs += 1
        return self.head(self.block(self.stem(x)))


class _Log(nn.Module):
    def forward(self, x):
        return x.log()


class _LogModel(_Counted):
    """log of a ReLU's output: log(0) is -inf, and only -inf, until the next layer mixes it into inf and NaN."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(4, 6)
        self.relu = nn.ReLU()
        self.log = _Log()
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        self.runs += 1
        return self.head(self.log(self.relu(self.stem(x))))


def _nonfinite_cases() -> list[tuple[str, Callable[[], nn.Module], torch.Tensor]]:
    g = torch.Generator().manual_seed(21)
    small, large = torch.randn(4, 5, generator=g) * 0.1, torch.randn(4, 5, generator=g) * 300

    def build(cls, seed, stale=False):
        def make():
            torch.manual_seed(seed)
            model = cls()
            if stale:  # a gradient left from a training step: it must stay as it is
                model.head.weight.grad = torch.full_like(model.head.weight, 0.5)
            return model
        return make

    sequence = torch.randn(2, 3, 4, generator=g)
    bad_batch = small.clone()
    bad_batch[1, 2] = math.inf
    return [
        (_("a model with finite outputs everywhere"), build(_Ordered, 5), small),
        (_("a model whose exp overflows"), build(_Ordered, 5, stale=True), large),
        (_("a model given a batch that holds an inf"), build(_Ordered, 5), bad_batch),
        (_("a model that calls one layer twice"), build(_Reused, 10), torch.randn(4, 3, generator=torch.Generator().manual_seed(25))),
        (_("an LSTM model"), build(_Recurrent, 6), sequence * 0.01),
        (_("an LSTM model"), build(_Recurrent, 6), sequence * 40),
        (_("a model that takes a softmax by hand"), build(_Softmax, 7), torch.randn(3, 3, generator=g) * 400),
        (_("a model whose block takes a log"), build(_Nested, 8), torch.randn(3, 3, generator=g)),
        (_("a model that takes the log of a ReLU"), build(_LogModel, 9), torch.randn(5, 4, generator=g)),
    ]


def _outputs_in_run_order(model: nn.Module, x: torch.Tensor) -> list[tuple[str, bool, bool, bool, bool]]:
    """(name, holds NaN, holds inf, is a tuple, non-finite everywhere) for every module output, in the order the forward hooks ran."""
    seen = []

    def hook(module, args, output, name):
        tensors = [t for t in tensors_in(output) if t.is_floating_point()]
        seen.append((name, any(t.isnan().any().item() for t in tensors), any(t.isinf().any().item() for t in tensors),
                     isinstance(output, tuple), bool(tensors) and all((~t.isfinite()).all().item() for t in tensors)))

    handles = [m.register_forward_hook(functools.partial(hook, name=n)) for n, m in model.named_modules()]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in handles:
            h.remove()
    return seen


class _Emit(nn.Module):
    """Adds a fixed pattern to its input: where the pattern holds inf or NaN, so does the output."""

    def __init__(self, pattern: list[float]):
        super().__init__()
        self.register_buffer("pattern", torch.tensor(pattern))

    def forward(self, x):
        return x + self.pattern


class _Reused(_Counted):
    """One Linear layer called twice, before and after a module that adds a partial inf: its first output is finite, its second is not."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(3, 3)
        self.boom = _Emit([0.0, math.inf, 0.0])

    def forward(self, x):
        self.runs += 1
        return self.shared(self.boom(self.shared(x)))


class _Container(nn.Module):
    """A module with a child whose own forward adds a partial inf after the child has run."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(3, 3)

    def forward(self, x):
        return self.inner(x) + torch.tensor([0.0, math.inf, 0.0])


class _SplitEmit(nn.Module):
    """Returns (x, (tanh(x), x plus a partial inf)): the inf sits inside a nested tuple, and nothing downstream uses it."""

    def forward(self, x):
        return x, (x.tanh(), x + torch.tensor([0.0, math.inf, 0.0]))


class _TupleProbe(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.split = _SplitEmit()

    def forward(self, x):
        h, (t, _partial) = self.split(self.lin(x))
        return h + t


class _RootProbe(nn.Module):
    """Its own forward adds a partial inf to its child's finite output."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        return self.lin(x) + torch.tensor([0.0, math.inf, 0.0])


def _probes() -> dict[str, tuple[nn.Module, str]]:
    """Small models, each with one kind of culprit, and the culprit's name."""
    torch.manual_seed(23)
    inf, nan = math.inf, math.nan
    infinite_bias = nn.Linear(3, 3)
    with torch.no_grad():
        infinite_bias.bias[1] = inf
    return {
        "partial inf": (nn.Sequential(nn.Linear(3, 3), _Emit([0.0, inf, 0.0]), nn.Tanh()), "1"),
        "partial inf, two layers before the end": (nn.Sequential(nn.Linear(3, 3), _Emit([0.0, inf, 0.0]), nn.Linear(3, 3), nn.Tanh()), "1"),
        "large finite values": (nn.Sequential(nn.Linear(3, 3), _Emit([3e38, 3e38, 0.0]), nn.Tanh()), None),  # finite; their sum is inf
        "partial -inf": (nn.Sequential(nn.Linear(3, 3), _Emit([0.0, -inf, 0.0]), nn.Tanh()), "1"),
        "partial NaN": (nn.Sequential(nn.Linear(3, 3), _Emit([0.0, nan, 0.0]), nn.Linear(3, 3)), "1"),
        "inf everywhere": (nn.Sequential(nn.Linear(3, 3), _Emit([inf, inf, inf]), nn.Tanh()), "1"),
        "a layer with parameters": (nn.Sequential(nn.Linear(3, 3), infinite_bias, nn.Tanh()), "1"),
        "a container's own forward": (nn.Sequential(nn.Linear(3, 3), _Container(), nn.Tanh()), "1"),
        "a container, then a leaf": (nn.Sequential(nn.Linear(3, 3), _Container(), nn.Linear(3, 3)), "1"),
        "a nested tuple": (_TupleProbe(), "split"),
        "the model itself": (_RootProbe(), ""),
    }


# The usual mistakes, each as the answers it gives on the probes (a: the learner's answers, ok(k): right on probe k); the first
# that fits names the fault. Each fits only answers that no other rule, and no right answer, gives.
NONFINITE_RULES = [
    (lambda a, ok: ok("partial NaN") and all(a[k] is None for k in ("partial inf", "partial -inf", "inf everywhere",
                                                                   "a layer with parameters")),
     N_("it tests for NaN only and misses inf: test with torch.isfinite, which catches NaN, inf and -inf")),
    (lambda a, ok: a["large finite values"] == "1" and ok("partial inf") and ok("partial NaN"),
     N_("it flags an output whose elements are all finite but whose sum overflows to inf: test the elements, t.isfinite().all(), "
        "not their sum")),
    (lambda a, ok: a["partial -inf"] is None and ok("partial inf") and ok("partial NaN"),
     N_("it misses -inf: test with torch.isfinite, which catches NaN, inf and -inf")),
    (lambda a, ok: a["partial NaN"] is None and ok("partial inf") and ok("partial -inf"),
     N_("it misses NaN: test with torch.isfinite, which catches NaN, inf and -inf")),
    (lambda a, ok: a["partial inf"] is None and a["partial NaN"] == "2" and ok("inf everywhere"),
     N_("it flags an output only when every element is non-finite: flag it when any element is (not t.isfinite().all())")),
    (lambda a, ok: all(a[k] == "2" for k in ("partial inf", "partial NaN", "inf everywhere", "partial inf, two layers before the end")),
     N_("it names the module after the culprit, whose input holds the non-finite value: test each module's output")),
    (lambda a, ok: ok("a layer with parameters") and a["partial inf"] is None and a["inf everywhere"] is None and a["partial NaN"] == "2",
     N_("it skips the modules without parameters of their own: every module counts")),
    (lambda a, ok: a["a container's own forward"] is None and a["the model itself"] is None and ok("partial inf"),
     N_("it skips the modules that have children: hook every module, containers and the model itself too")),
    (lambda a, ok: a["a container's own forward"] is None and ok("the model itself") and ok("partial inf"),
     N_("it skips the modules that have children: hook every module, containers too")),
    (lambda a, ok: a["the model itself"] is None and ok("a container's own forward") and ok("partial inf"),
     N_("it skips the model itself: named_modules() lists it too, with the name ''")),
    (lambda a, ok: a["a container, then a leaf"] == "2" and ok("a container's own forward") and ok("partial inf"),
     N_("it prefers a leaf module to the container whose own forward made the value: every module counts, the first to finish wins")),
    (lambda a, ok: a["a nested tuple"] is None and ok("partial inf") and ok("the model itself"),
     N_("it misses non-finite values inside a tuple output: look at every tensor of an output, nested tuples included "
        "(an LSTM returns output, (h, c))")),
]


def _nonfinite_fault(fn: Callable, root_hooked: bool = False) -> str:
    """Run the learner's function on the probes; name the usual mistake whose answers its answers fit, else ''. `root_hooked`:
    the learner's function put a hook on the model itself (seen on the check's own model)."""
    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(24))
    global_before, answers, culprits, lasts = _global_hooks(), {}, {}, {}
    try:
        for label, (model, culprit) in _probes().items():
            culprits[label], lasts[label] = culprit, list(model.named_modules())[-1][0]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                answers[label] = fn(model, x)
    except Exception:  # noqa: BLE001 -- no diagnosis then; the plain expected/got stands
        return ""
    finally:
        for d, key in _global_hooks() - global_before:
            getattr(module_globals, d).pop(key, None)
    root = "the model itself"
    if root_hooked and answers[root] is None and all(answers[k] == culprits[k] for k in culprits if k != root):
        return _("a hook of yours was on the model itself, and every other culprit was found, but not '': the name of the model itself "
                 "is a false value, so `name or None` or `if not name:` turns it into None; test `is None`")
    if answers != culprits and all(answers[k] == lasts[k] for k in culprits if culprits[k] is not None):
        return _("on every model it answered the name of the last module in named_modules(), whatever the culprit: each hook read the "
                 "loop variable when it ran, and saw its last value; bind the name when you define each hook (name=name, or "
                 "functools.partial)")
    return next((_(fault) for fits, fault in NONFINITE_RULES if fits(answers, lambda k: answers[k] == culprits[k])), "")


@exercise("first_nonfinite")
def check_first_nonfinite(fn) -> None:
    hints = {"'tuple' object has no attribute": N_("a module's output can be a tuple, even a nested one (an LSTM returns output, (h, c))"),
             "not tuple": N_("a module's output can be a tuple, even a nested one (an LSTM returns output, (h, c))")}
    for label, make, x in _nonfinite_cases():
        model = make()
        order = [name for name, _module in model.named_modules()]
        run = _outputs_in_run_order(model, x)
        expected = next((n for n, nan, inf, _is_tuple, _everywhere in run if nan or inf), None)
        root_hooks: list[int] = []
        x_before, global_before, state, kept = x.clone(), _global_hooks(), _model_state(model), _callers_hook(model, root_hooks)
        shown = _("{label}, tensor of shape {shape}").format(label=label, shape=tuple(x.shape))
        what = f"first_nonfinite({shown})"
        model.recount()
        got = call(fn, model, x, shown=shown, hints=hints)
        _expect_no_hooks(model, global_before, what, kept=kept)
        _expect_one_run(model, what, x)
        _expect_tensor_unchanged(x_before, False, x, what, "x")
        if any(p.grad is not None and state["grads"][n] is None for n, p in model.named_parameters()):
            raise ExerciseFailed(_("{what} filled the parameters' .grad: finding a non-finite output needs the forward pass only").format(
                what=what))
        _expect_model_unchanged(model, state, what, probe=False)
        if isinstance(got, nn.Module):
            raise ExerciseFailed(_("{what} returned the module itself ({module_class}): return its name, as in model.named_modules()").format(
                what=what, module_class=type(got).__name__))
        if got is not None and not isinstance(got, str):
            raise ExerciseFailed(_("{what} returned {a_type}, expected a module's name (a str) or None").format(what=what, a_type=a_type(got)))
        if got == expected:
            continue
        flagged = [n for n, nan, inf, _is_tuple, _everywhere in run if nan or inf]
        name = repr(expected) if expected else _("'' (the model itself)")
        if expected is None:
            fault = _nonfinite_fault(fn)
            if fault:
                message = _("{what} returned {got!r}, expected None: every module's output is finite; {fault}")
            else:
                message = _("{what} returned {got!r}, expected None: every module's output is finite")
            raise ExerciseFailed(message.format(what=what, got=got, fault=fault))
        if isinstance(got, str) and got in flagged and (got == "" or expected.startswith(got + ".")):
            raise ExerciseFailed(
                _("{what} returned {got!r}, but its sub-module {name} produced the non-finite value first: "
                  "a sub-module finishes, and its forward hook runs, before its parent's").format(what=what, got=got, name=name)
            )
        fault = _nonfinite_fault(fn, root_hooked=any(root_hooks))
        if fault:
            raise ExerciseFailed(_("{what} returned {got!r}, expected {name}: {fault}").format(what=what, got=got, name=name, fault=fault))
        calls = [(n, nan or inf) for n, nan, inf, _is_tuple, _everywhere in run if n == got]
        if len(calls) > 1 and not calls[0][1] and any(bad for _n, bad in calls):
            raise ExerciseFailed(_("{what} returned {got!r}, which runs {n} times: its first output was finite, and {name} "
                                   "finished with a non-finite output before {got!r} made one; judge each output as it finishes, "
                                   "call by call").format(what=what, got=got, n=len(calls), name=name))
        if got is None and not x.isfinite().all():
            raise ExerciseFailed(_("{what} returned None, expected {name}: x itself holds a non-finite value, and {name}, the first "
                                   "module to finish, passed it on in its output; a non-finite input counts too").format(what=what, name=name))
        if got in flagged and got == min(flagged, key=order.index) and got != flagged[0]:
            raise ExerciseFailed(
                _("{what} returned {got!r}, the first non-finite output in named_modules() order; {name} was the first to produce one "
                  "in the forward pass: record the order in which the hooks run").format(what=what, got=got, name=name)
            )
        if got in flagged and got == flagged[-1]:
            raise ExerciseFailed(_("{what} returned {got!r}, the last module with a non-finite output; expected the first, {name}").format(
                what=what, got=got, name=name))
        modules, ran = dict(model.named_modules()), [n for n, *_rest in run]
        if isinstance(got, str) and got == type(modules[expected]).__name__:
            raise ExerciseFailed(_("{what} returned {got!r}, the class of the culprit: return its name as named_modules() spells it, "
                                   "{name}").format(what=what, got=got, name=name))
        if isinstance(got, str) and got.endswith("." + expected) and got not in modules:
            raise ExerciseFailed(_("{what} returned {got!r}, a name with a prefix; named_modules() without one spells it {name}").format(
                what=what, got=got, name=name))
        if got in ran and ran.index(got) == ran.index(expected) - 1:
            raise ExerciseFailed(_("{what} returned {got!r}, the module that finished just before {name}, which produced the first "
                                   "non-finite output").format(what=what, got=got, name=name))
        if got is None and expected == "":
            raise ExerciseFailed(_("{what} returned None; the model's own forward made a non-finite output from its sub-modules' "
                                   "finite ones").format(what=what))
        if got is None and next(is_tuple for n, _nan, _inf, is_tuple, _everywhere in run if n == expected):
            raise ExerciseFailed(_("{what} returned None; {name} returned a tuple that holds inf").format(what=what, name=name))
        raise ExerciseFailed(_("{what} returned {got!r}, expected {name}").format(what=what, got=got, name=name))

    tripped = _Ordered(trip=True)
    x = torch.randn(2, 5, generator=torch.Generator().manual_seed(22))
    shown = _("a model whose forward raises, tensor of shape (2, 5)")
    _expect_model_error(fn, (tripped, x), f"first_nonfinite({shown})", tripped, _global_hooks())


# memory_by_phase

@contextlib.contextmanager
def _watching_profilers(log: "_Phases") -> Iterator[None]:
    """Meanwhile, note in `log`: the profile_memory flag of every profiler started (torch.profiler.profile and
    torch.autograd.profiler.profile both start through torch.autograd.profiler.profile._start_trace); the record_function
    regions open at each moment and every one opened (torch.profiler.record_function is the same class); and whether a
    profile's events were read (key_averages(), events()) while a profiler was still running."""
    rf, autograd_profile = torch.autograd.profiler.record_function, torch.autograd.profiler.profile
    start_trace, ensure_events, enter, leave = (autograd_profile._start_trace, autograd_profile._ensure_function_events,
                                                rf.__enter__, rf.__exit__)

    def start(self):
        log.started.append(bool(self.profile_memory))
        return start_trace(self)

    def read(self):
        log.early_reads.append(_profiler_running())
        return ensure_events(self)

    def open_region(self):
        log.open_regions.append(str(self.name))
        log.opened_regions.append(str(self.name))
        return enter(self)

    def close_region(self, *exc):
        regions = log.open_regions
        if str(self.name) in regions:
            del regions[len(regions) - 1 - regions[::-1].index(str(self.name))]
        return leave(self, *exc)

    autograd_profile._start_trace, autograd_profile._ensure_function_events = start, read
    rf.__enter__, rf.__exit__ = open_region, close_region
    try:
        yield
    finally:
        autograd_profile._start_trace, autograd_profile._ensure_function_events = start_trace, ensure_events
        rf.__enter__, rf.__exit__ = enter, leave


class _Phases:
    """Hidden phases that share state, count their calls and record their order; each returns None. Each call also notes
    whether a profiler was running, and whether the last one started was told to record memory (None: none started)."""

    def __init__(self, steps: dict[str, Callable[[dict], None]], started: list[bool] | None = None):
        self.state: dict[str, Any] = {}
        self.order: list[str] = []
        self.profiling: list[bool] = []
        self.memory: list[bool | None] = []
        self.started = started if started is not None else []  # filled by _watching_profilers
        self.open_regions: list[str] = []  # likewise
        self.opened_regions: list[str] = []  # likewise
        self.early_reads: list[bool] = []  # likewise: per read of a profile's events, whether a profiler was running
        self.inside: list[tuple[str, ...]] = []  # the regions open at each call
        self.steps = steps

    def phases(self) -> dict[str, Callable[[], None]]:
        def phase(name: str) -> None:
            self.order.append(name)
            self.profiling.append(_profiler_running())
            self.memory.append(self.started[-1] if self.started else None)
            self.inside.append(tuple(self.open_regions))
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
        (_("tensor phases"), _tensor_steps),
        (_("a training step"), _training_steps),
        (_("one phase that does nothing"), lambda: {"nothing": lambda s: None}),
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


def _memory_mix_ups(steps: Callable[[], dict], names: list[str], expected: dict[str, int]) -> dict[str, dict[str, int]]:
    """What the usual wrong readings of a profile give for fresh copies of the phases: {description: {phase: bytes}}."""
    quiet_profiler()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for name, phase in _Phases(steps()).phases().items():
            with record_function(f"phase {name}"):
                phase()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    memory = sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"])
    peaks, allocations, frees = {}, {}, {}
    for name in names:
        region = next(e for e in events if e.get("name") == f"phase {name}" and e.get("ph") == "X")
        changes = [e["args"]["Bytes"] for e in memory if region["ts"] <= e["ts"] <= region["ts"] + region["dur"]]
        peaks[name] = max(itertools.accumulate(changes), default=0)
        allocations[name] = sum(c for c in changes if c > 0)
        frees[name] = sum(c for c in changes if c < 0)
    every_row, operators, aten_rows = {}, {}, {}
    for name, phase in _Phases(steps()).phases().items():
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as one:
            phase()
        rows = one.key_averages()
        every_row[name] = sum(event.cpu_memory_usage for event in rows)
        operators[name] = sum(event.self_cpu_memory_usage for event in rows if event.key != "[memory]")
        aten_rows[name] = sum(event.cpu_memory_usage for event in rows if event.key.startswith("aten::"))
    # The descriptions are shown stripped and translated (_check_memory_by_phase); a trailing space keeps a second reading of
    # the same description a key of its own.
    peak = N_("each phase's peak (the most it held at once) instead of what it left allocated when it ended")
    kib = N_("KiB: return the bytes themselves")
    return {
        peak: peaks,
        peak + " ": {n: max(0, v) for n, v in peaks.items()},
        N_("only the allocations: a free counts too, as negative bytes"): allocations,
        N_("only the frees: each phase's allocations count too"): frees,
        N_("the same number for every phase, the whole run's total: give each phase a region of its own (record_function(name)) and "
           "read that region's row"): {n: sum(expected.values()) for n in names},
        N_("each region's count of calls, not its memory: read the region's cpu_memory_usage"): {n: 1 for n in names},
        N_("a running total: each number includes the phases before it; give each phase its own allocations minus frees"):
            dict(zip(names, itertools.accumulate(expected[n] for n in names))),
        N_("for each phase, the sum of every row's cpu_memory_usage, which counts an operator's allocations again in each operator "
           "that called it: read one region's cpu_memory_usage, or sum the self column"): every_row,
        N_("for each phase, the sum of the aten:: rows' cpu_memory_usage, which counts an operator's allocations again in each "
           "operator that called it (aten::ones calls aten::empty): read one region's cpu_memory_usage, or sum the self column"): aten_rows,
        N_("the operators' own allocations only: a free that happens outside every operator (a tensor's last reference dropped) "
           "has a row of its own, '[memory]', which counts too"): operators,
        N_("negative numbers clipped to 0: a phase that frees more than it allocates leaves a negative number"):
            {n: max(0, v) for n, v in expected.items()},
        N_("each change without its sign: a phase that frees more than it allocates leaves a negative number"):
            {n: abs(v) for n, v in expected.items()},
        N_("each change with the opposite sign: allocations minus frees is positive for a phase that allocates"):
            {n: -v for n, v in expected.items()},
        kib: {n: v // 1024 for n, v in expected.items()},
        kib + " ": {n: round(v / 1024) for n, v in expected.items()},
        N_("MiB: return the bytes themselves"): {n: round(v / 2**20) for n, v in expected.items()},
    }


EARLY_READ = N_("read a profile's events (key_averages(), events()) while the profiler was still running, inside its `with` block: "
                "they are complete only once it has stopped; read them after the block")


@exercise("memory_by_phase")
def check_memory_by_phase(fn) -> None:
    quiet_profiler()
    if _profiler_running():
        raise ExerciseFailed(_("a profiler is still running in this kernel, started by an earlier cell: stop it (prof.stop()) and run "
                               "this check again"))
    with _no_garbage_collection():
        _check_memory_by_phase(fn)


@contextlib.contextmanager
def _no_garbage_collection() -> Iterator[None]:
    """Collect the garbage now, then none until the block ends: the profiler counts every tensor freed while it runs,
    and a tensor of an earlier cell freed by the collector inside a phase would count as that phase's."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _check_memory_by_phase(fn) -> None:
    for label, steps in _memory_cases():
        expected, self_only = _profiled(_Phases(steps()).phases())
        hidden = _Phases(steps())
        names = list(hidden.steps)
        what = f"memory_by_phase({label}: {names})"
        phases = hidden.phases()
        given = dict(phases)
        try:
            with _watching_profilers(hidden):
                try:
                    got = call(fn, phases, shown=f"{label}: {names}", hints={
                        "element 0 of tensors does not require grad": N_("a phase's backward found no graph: the phases ran with "
                                                                         "gradients off (torch.no_grad() or inference_mode); run them as they are")})
                except ExerciseFailed as err:
                    if any(hidden.early_reads):
                        raise ExerciseFailed(_("{message}; it {early_read}").format(message=err.message, early_read=_(EARLY_READ))) from None
                    raise
        finally:
            left_on = _profiler_running()
            if left_on:
                _stop_profiler()
        if left_on:
            raise ExerciseFailed(_("{what} left the profiler running: use `with profile(...) as prof:`, or call prof.stop()").format(what=what))
        if list(phases) != names or any(phases[n] is not given[n] for n in names):
            raise ExerciseFailed(_("{what} changed the caller's dict of phases: read it, do not change it").format(what=what))
        counts = {n: hidden.order.count(n) for n in names}
        if any(count != 1 for count in counts.values()):
            wrong = next(n for n in names if counts[n] != 1)
            raise ExerciseFailed(_("{what} ran the phase {phase!r} {count} times; run each phase exactly once: a phase changes the state "
                                   "the next one works on").format(what=what, phase=wrong, count=counts[wrong]))
        if hidden.order != names:
            raise ExerciseFailed(_("{what} ran the phases in the order {order}, expected the dict's order, {names}").format(
                what=what, order=hidden.order, names=names))
        outside = [n for n, on in zip(hidden.order, hidden.profiling) if not on]
        if outside == names:
            raise ExerciseFailed(_("{what} ran the phases with no profiler running: measure them with torch.profiler.profile("
                                   "activities=[ProfilerActivity.CPU], profile_memory=True)").format(what=what))
        if outside:
            raise ExerciseFailed(ngettext("{what} ran the phase {outside} with no profiler running",
                                          "{what} ran the phases {outside} with no profiler running", len(outside)).format(
                                              what=what, outside=outside))
        got = _expect_dict(got, what, _("bytes"))
        if set(got) != set(names):
            extra = sorted(set(got) - set(names), key=str)
            if extra and set(names) <= set(got):
                raise ExerciseFailed(_("{what} returned {n} keys, {extra} among them; expected only the phases' names, {names}").format(
                    what=what, n=len(got), extra=extra[:3], names=names))
            missing = [n for n in names if n not in got]
            if not extra and all(expected[n] == 0 for n in missing):
                raise ExerciseFailed(ngettext("{what} has no entry for {missing}, the phase that left 0 bytes: return every phase, 0 included",
                                              "{what} has no entry for {missing}, the phases that left 0 bytes: return every phase, 0 included",
                                              len(missing)).format(what=what, missing=missing))
            raise ExerciseFailed(_("{what} returned the keys {keys}, expected the phases' names, {names}").format(
                what=what, keys=sorted(got, key=str)[:8], names=names))
        for name in names:
            value = got[name]
            if isinstance(value, bool) or isinstance(value, torch.Tensor) or not isinstance(value, (int, float)):
                raise ExerciseFailed(_("{what}[{name!r}] is {a_type}, expected a Python int (bytes)").format(
                    what=what, name=name, a_type=a_type(value)))
        if any(isinstance(v, float) for v in got.values()):
            if all(math.isclose(got[n] * 2**20, expected[n], abs_tol=1) for n in names):
                raise ExerciseFailed(_("{what} returned MiB: return the bytes themselves, as ints").format(what=what))
            if all(math.isclose(got[n] * 1024, expected[n], abs_tol=1) for n in names):
                raise ExerciseFailed(_("{what} returned KiB: return the bytes themselves, as ints").format(what=what))
            if all(got[n] == expected[n] for n in names):
                raise ExerciseFailed(_("{what} returned floats, expected Python ints (bytes)").format(what=what))
        if got == expected:
            continue
        if any(hidden.early_reads):
            early_read = _(EARLY_READ)
            raise ExerciseFailed(f"{what} {early_read}")
        if hidden.opened_regions:
            outside = [n for n, inside in zip(hidden.order, hidden.inside) if not inside]
            if outside:
                raise ExerciseFailed(ngettext(
                    "{what} ran the phase {outside} while no record_function region was open: call each phase inside its own "
                    "`with record_function(name):` block",
                    "{what} ran the phases {outside} while no record_function region was open: call each phase inside its own "
                    "`with record_function(name):` block", len(outside)).format(what=what, outside=outside))
            elsewhere = [(n, inside[-1]) for n, inside in zip(hidden.order, hidden.inside) if inside[-1] != n and inside[-1] in names]
            if elsewhere:
                n, region = elsewhere[0]
                raise ExerciseFailed(_("{what} ran the phase {phase!r} inside the region {region!r}: give each phase its own region, "
                                       "named after it").format(what=what, phase=n, region=region))
        if any(expected.values()) and not any(got.values()) and all(m is False for m in hidden.memory):
            raise ExerciseFailed(_("{what} returned 0 for every phase: the profiler ran without profile_memory=True, so it recorded "
                                   "no allocations").format(what=what))
        if got == self_only and self_only != expected:
            raise ExerciseFailed(
                _("{what} returned each region's *self* memory, which leaves out the operators the phase ran: "
                  "use the region's cpu_memory_usage (everything inside it)").format(what=what)
            )
        cumulative = {n: sum(expected[m] for m in names[i:]) for i, n in enumerate(names)}
        if got == cumulative:
            raise ExerciseFailed(_("{what}: each phase's number includes the phases after it: close each phase's region before the next "
                                   "phase starts").format(what=what))
        mix_up = next((_(text.strip()) for text, values in _memory_mix_ups(steps, names, expected).items()
                       if values != expected and any(values.values()) and got == values), None)
        if mix_up:
            raise ExerciseFailed(_("{what} returned {mix_up}").format(what=what, mix_up=mix_up))
        wrong = next(n for n in names if got[n] != expected[n])
        raise ExerciseFailed(_("{what}[{name!r}] is {got!r} bytes, expected {expected:,} (allocated minus freed during that phase)").format(
            what=what, name=wrong, got=got[wrong], expected=expected[wrong]))


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


CHECKPOINT_FILE = os.path.realpath(torch.utils.checkpoint.__file__)


def _checkpoint_variant(frame: Any) -> str:
    """Which checkpoint the calling frames are inside: 'reentrant', 'non-reentrant', 'nested' (a checkpoint inside another)
    or '' (none); 'sequential' marks checkpoint_sequential's own frames, which run its last segment without a checkpoint."""
    names = []
    while frame is not None:
        if os.path.realpath(frame.f_code.co_filename) == CHECKPOINT_FILE:
            names.append(frame.f_code.co_qualname)
        frame = frame.f_back
    if "CheckpointFunction.forward" in names or "CheckpointFunction.backward" in names:
        return "reentrant"
    if names.count("_checkpoint_impl") > 1:
        return "nested"
    if "_checkpoint_impl" in names or "checkpoint" in names:
        return "non-reentrant"
    return "sequential" if "checkpoint_sequential" in names else ""


class _BlockWatch:
    """Forward pre-hooks on each block that note, call by call: the block's index, whether gradients were on, which checkpoint
    variant it ran inside, and whether its input required grad; split into the learner's forward pass and the backward."""

    def __init__(self, blocks: nn.ModuleList):
        self.calls: list[tuple[int, bool, str, bool]] = []
        self.leaf_inputs: list[bool] = []  # per call: the input requires grad but has no grad_fn (a new leaf, cut from the graph)
        self.forward_calls = 0  # how many of self.calls belong to the learner's forward pass
        self.handles = [b.register_forward_pre_hook(functools.partial(self._note, i)) for i, b in enumerate(blocks)]

    def _note(self, i: int, module: nn.Module, args: tuple) -> None:
        x = args[0] if args else None
        self.leaf_inputs.append(isinstance(x, torch.Tensor) and x.requires_grad and x.grad_fn is None)
        self.calls.append((i, torch.is_grad_enabled(), _checkpoint_variant(sys._getframe(1)),
                           isinstance(x, torch.Tensor) and x.requires_grad))

    def end_forward(self) -> None:
        self.forward_calls = len(self.calls)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

    def forward_order(self) -> list[int]:
        return [i for i, *_rest in self.calls[:self.forward_calls]]

    def recomputed_segments(self) -> list[list[int]]:
        """The runs of blocks that the backward pass recomputed together, in forward order: each is one checkpoint's blocks."""
        runs: list[list[int]] = []
        for i, *_rest in self.calls[self.forward_calls:]:
            if runs and i == runs[-1][-1] + 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        return sorted(runs)


def _blocks_text(indices: list[int]) -> str:
    if len(indices) == 1:
        return _("block {index}").format(index=indices[0])
    return _("blocks {indices}").format(indices=indices)


def _order_fault(order: list[int], n: int, finished: bool = True) -> str:
    """What is wrong with the order in which the learner's forward pass ran the blocks, or ''. When the pass raised
    (finished=False), only what happened before the error counts."""
    if order == list(range(n)) or (not finished and order == list(range(len(order)))):
        return ""
    if order and order[0] != 0:
        return _("ran {blocks} first (the order was {order}): start with block 0 and follow the ModuleList's order").format(
            blocks=_blocks_text(order[:1]), order=order)
    repeated = sorted({i for i in order if order.count(i) > 1})
    if repeated:
        return _("ran {blocks} more than once in the forward pass (the order was {order}): run each block once").format(
            blocks=_blocks_text(repeated), order=order)
    last = max(order) if order else -1
    skipped = [i for i in range(last if not finished else n) if i not in order]
    if skipped and order == sorted(order):
        return _("never ran {blocks} (the order was {order}): run every block, in order").format(blocks=_blocks_text(skipped), order=order)
    return _("ran the blocks in the order {order}, expected {expected}").format(order=order, expected=list(range(n)))


CHECKPOINT_HINTS = {
    'Module [ModuleList] is missing the required "forward" function': N_("a ModuleList cannot be called: nn.Sequential(blocks[i:j]) "
    "holds the slice as one module; unpack it, nn.Sequential(*blocks[i:j]), or loop over the blocks"),
    "must have the same dtype": N_("mixed dtypes in one operation: the batch and the blocks' weights must share a dtype"),
}


@exercise("checkpoint_segments")
def check_checkpoint_segments(fn) -> None:
    cases = [  # 7 blocks in 3 + 3 + 1; dropout, replayed in backward; one segment for all; a segment per block
        (N_("7 blocks"), _blocks(31, [3, 5, 10, 19, 38, 76, 151, 8]), 5, 3),  # N_: the English label is tested, the translation shown
        (N_("5 blocks with dropout"), _blocks(32, [9, 11, 13, 15, 17, 19], dropout=0.3), 1, 2),
        (N_("4 blocks"), _blocks(33, [6, 7, 8, 9, 10]), 3, 4),
        (N_("3 blocks"), _blocks(34, [5, 8, 11, 14]), 2, 1),
    ]
    g = torch.Generator().manual_seed(35)
    for label, blocks, batch, size in cases:
        n = len(blocks)
        x = torch.randn(batch, blocks[0][0].in_features, generator=g)  # a batch of data: it does not require grad
        shown = _("{label}, tensor of shape {shape}, {size}").format(label=_(label), shape=tuple(x.shape), size=size)
        what = f"checkpoint_segments({shown})"
        starts = list(range(0, n, size))
        segments = [list(range(s, min(s + size, n))) for s in starts]
        torch.manual_seed(36)
        (expected, sizes), _saved = saved_activation_bytes(lambda: _plain(blocks, x), blocks.parameters())
        rng_after = torch.get_rng_state()  # where the plain forward pass left the random state: dropout drew its masks from it
        expected.sum().backward()
        expected_grads = {name: p.grad.clone() for name, p in blocks.named_parameters()}
        blocks.zero_grad(set_to_none=True)
        expected_bytes = sum(sizes[i] for i in starts)
        x_before, state = x.clone(), _model_state(blocks)
        watch = _BlockWatch(blocks)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.manual_seed(36)
                try:
                    got, got_bytes = saved_activation_bytes(lambda: call(fn, blocks, x, size, shown=shown, hints=CHECKPOINT_HINTS),
                                                            blocks.parameters())
                except ExerciseFailed as err:
                    fault = _order_fault([i for i, *_rest in watch.calls], n, finished=False)
                    raise ExerciseFailed(_("{message}: it {fault}").format(message=err.message, fault=fault) if fault else err.message) from None
                watch.end_forward()
                _expect_tensor_unchanged(x_before, False, x, what, _("batch x (with use_reentrant=False the input need not require grad)"))
                if got is None:
                    raise ExerciseFailed(_("{what} returned None: did you forget to `return` the output?").format(what=what))
                if not isinstance(got, torch.Tensor):
                    raise ExerciseFailed(_("{what} returned {a_type}, expected the output tensor").format(what=what, a_type=a_type(got)))
                rng_now = torch.get_rng_state()
                _judge_forward(watch, got, n, what)
                if label.endswith("dropout") and not _same(got.detach(), expected.detach()) and not torch.equal(rng_now, rng_after):
                    raise ExerciseFailed(_("the output of {what} differs from the plain pass, and your call left the random state elsewhere "
                                           "than the plain pass does: it reseeded (torch.manual_seed) or drew random numbers of its own, so "
                                           "dropout drew other masks; leave the random state alone").format(what=what))
                expect_tensor(got, expected.detach(), what=_("the output of {what}").format(what=what), atol=1e-6)
                _backward_through_checkpoints(got, what)
        finally:
            watch.remove()
        _expect_blocks_unchanged(blocks, state, what)
        _judge_segments(watch, blocks, segments, size, what)
        if got_bytes != expected_bytes:
            found = _segment_starts(got_bytes, sizes)
            if found:
                saved = _("the inputs of blocks {found} ({got_bytes:,} bytes)").format(found=found, got_bytes=got_bytes)
            else:
                saved = _("{got_bytes:,} bytes").format(got_bytes=got_bytes)
            raise ExerciseFailed(_("{what} saved {saved} for backward; segments of {size} blocks start at blocks {starts}, "
                                   "whose inputs take {expected_bytes:,} bytes").format(
                                       what=what, saved=saved, size=size, starts=starts, expected_bytes=expected_bytes))
        for name, p in blocks.named_parameters():
            if label.endswith("dropout") and not _same(p.grad, expected_grads[name]):
                raise ExerciseFailed(
                    _("the gradient of blocks.{name} through {what} differs from the plain pass, and the blocks without dropout agreed: "
                      "the recomputation in backward drew other dropout masks; keep checkpoint's default "
                      "preserve_rng_state=True").format(name=name, what=what)
                )
            expect_tensor(p.grad, expected_grads[name], what=_("the gradient of blocks.{name} through {what}").format(name=name, what=what),
                          atol=1e-6)


def _expect_blocks_unchanged(blocks: nn.ModuleList, state: dict, what: str) -> None:
    """The blocks' modes, values and requires_grad flags as the caller had them (their .grad is the check's own backward)."""
    _expect_model_unchanged(blocks, {**state, "grads": {}}, what, probe=False)


def _judge_forward(watch: _BlockWatch, got: torch.Tensor, n: int, what: str) -> None:
    """What the learner's forward pass did, watched block by block: the variant of checkpoint, the order, the graph."""
    forward = watch.calls[:watch.forward_calls]
    if any(variant == "reentrant" for _i, _grad_on, variant, _needs_grad in forward) and not got.requires_grad:
        raise ExerciseFailed(
            _("{what} used the reentrant checkpoint (use_reentrant=True, or not passed: PyTorch then falls back to it), whose output "
              "has no graph when its input does not require grad, as a batch of data does not: pass use_reentrant=False").format(what=what)
        )
    if any(variant == "reentrant" for _i, _grad_on, variant, _needs_grad in forward):
        raise ExerciseFailed(_("{what} used the reentrant checkpoint (use_reentrant=True, or not passed: PyTorch then falls back to "
                               "it), the legacy variant: use the non-reentrant one, use_reentrant=False").format(what=what))
    if any(variant == "nested" for _i, _grad_on, variant, _needs_grad in forward):
        raise ExerciseFailed(_("{what} ran blocks inside a checkpoint inside another checkpoint: put each segment in one checkpoint, "
                               "with its blocks called plainly inside it").format(what=what))
    fault = _order_fault(watch.forward_order(), n)
    if fault:
        raise ExerciseFailed(f"{what} {fault}")
    if not any(grad_on for _i, grad_on, _variant, _needs_grad in forward):
        raise ExerciseFailed(_("{what} ran the blocks with gradient recording off (torch.is_grad_enabled() was False, as under "
                               "torch.no_grad()): its output has no graph through them to backpropagate").format(what=what))
    if not got.requires_grad:
        raise ExerciseFailed(_("{what} returned an output that does not require grad, though the blocks ran with gradients on: "
                               "it was detached after them").format(what=what))
    cut = [i for i, _grad_on, _variant, needs_grad in forward if i > 0 and not needs_grad]
    if cut:
        raise ExerciseFailed(_("{what}: the input of block {block} did not require grad, though block {previous}'s output did: "
                               "the graph is cut between them, and backward cannot reach blocks 0 to {previous} "
                               "(.detach() and .data cut it)").format(what=what, block=cut[-1], previous=cut[-1] - 1))
    leaves = [i for (i, *_rest), leaf in zip(forward, watch.leaf_inputs) if i > 0 and leaf]
    if leaves:
        raise ExerciseFailed(_("{what}: the input of block {block} is a new leaf tensor (it requires grad but has no grad_fn), not "
                               "block {previous}'s output with its graph: the graph is cut between them (.detach() or .data, then "
                               "requires_grad_()), and backward cannot reach blocks 0 to {previous}").format(
                                   what=what, block=leaves[-1], previous=leaves[-1] - 1))


def _judge_segments(watch: _BlockWatch, blocks: nn.ModuleList, segments: list[list[int]], size: int, what: str) -> None:
    """The checkpoints the backward pass recomputed, block by block, against the segments the prompt asks for."""
    recomputed = watch.recomputed_segments()
    if recomputed == segments:
        return
    inside = {i for segment in recomputed for i in segment}
    outside = [i for i in range(len(blocks)) if i not in inside]
    if not recomputed:
        raise ExerciseFailed(_("{what}: no block was recomputed in backward, so none ran inside a checkpoint: run each segment "
                               "through torch.utils.checkpoint.checkpoint(..., use_reentrant=False)").format(what=what))
    if outside:
        sequential = any(variant == "sequential" for i, _grad_on, variant, _needs_grad in watch.calls[:watch.forward_calls] if i in outside)
        if sequential:
            message = _("{what}: {blocks} ran outside every checkpoint; every block must be inside one "
                        "(checkpoint_sequential leaves its last segment out)")
        else:
            message = _("{what}: {blocks} ran outside every checkpoint; every block must be inside one")
        raise ExerciseFailed(message.format(what=what, blocks=_blocks_text(outside)))
    if size > 1 and all(len(s) == 1 for s in recomputed):
        raise ExerciseFailed(_("{what} checkpointed every block on its own; expected segments of {size} blocks: {segments}").format(
            what=what, size=size, segments=segments))
    raise ExerciseFailed(_("{what} checkpointed the blocks in the segments {recomputed}; segments of {size} blocks are {segments}").format(
        what=what, recomputed=recomputed, size=size, segments=segments))


def _segment_starts(got_bytes: int, sizes: list[int]) -> list[int] | None:
    """Which block inputs add up to got_bytes, when exactly one set of them does (the sizes differ by design)."""
    found = [starts for n in range(1, len(sizes) + 1) for starts in _subsets(len(sizes), n) if sum(sizes[i] for i in starts) == got_bytes]
    return found[0] if len(found) == 1 else None


def _subsets(n: int, k: int):
    return (list(c) for c in itertools.combinations(range(n), k))


def _backward_through_checkpoints(out: torch.Tensor, what: str) -> None:
    """out.sum().backward(); an error in the recomputation is reported in one line."""
    try:
        out.sum().backward()
    except Exception as err:  # noqa: BLE001 -- raised by the recomputation of the learner's checkpointed function
        text = first_line(err)
        if "shape" in text or "Recomputed values" in text or "size of tensor" in text:
            raise ExerciseFailed(
                _("backward through {what} raised {error}: {message}: the recomputation ran other blocks than the "
                  "forward pass did; a function that reads a loop variable when it runs sees the variable's last value").format(
                      what=what, error=type(err).__name__, message=text[:100])
            ) from None
        raise ExerciseFailed(_("backward through {what} raised {error}: {message}").format(
            what=what, error=type(err).__name__, message=text)) from None
