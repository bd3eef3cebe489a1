"""Lesson 07 (torch.compile): reference solutions and the checks for its exercises.

The checks judge behaviour, never speed: how often `torch.compile` is called, how many
graphs Dynamo hands to a backend, how many graph breaks `torch._dynamo.explain` finds,
and whether the values match eager PyTorch. They replace the learner's backend with a
counting one that runs each graph eagerly, so no check waits for Inductor's C++ compiler.
"""

import contextlib
import copy
import functools
import logging
import math
import types
from typing import Callable, Iterator
from unittest import mock

import torch
import torch._dynamo
import torch.nn.functional as F
from torch import nn

from course_utils.tooling.checks import ExerciseFailed, call, exercise, expect_tensor, type_name, scoreboard_for

scoreboard = scoreboard_for(__name__)  # the lesson's last cell: this session's verdicts


# Reference solutions. The checks compare the learner's answers with these.

def gelu(x: torch.Tensor) -> torch.Tensor:
    """The tanh approximation of GELU, written as a chain of pointwise operations."""
    return 0.5 * x * (1 + torch.tanh(0.7978845608 * (x + 0.044715 * x**3)))


def compile_for_inference(model: nn.Module, example: torch.Tensor) -> nn.Module:
    """Put model in eval mode, compile it, warm it up once on example under no_grad; return the compiled module."""
    model.eval()
    compiled = torch.compile(model)
    with torch.no_grad():
        compiled(example)  # the first call pays for the compile, here rather than in the first real request
    return compiled


def compiled_train_step(model: nn.Module, loss_fn: Callable, optimizer: torch.optim.Optimizer) -> Callable:
    """A compiled function step(inputs, targets) doing one optimisation step and returning the loss, detached."""

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad()
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()
        return loss.detach()

    return torch.compile(step)


def no_break_gelu(x: torch.Tensor) -> torch.Tensor:
    """gelu(x), after scaling x down so that its largest absolute value is at most 4; no graph break."""
    peak = x.abs().amax()
    scale = torch.clamp(4.0 / peak, max=1.0)  # 1 when peak <= 4; a tensor, never a Python number
    return gelu(x * scale)


def count_compiles(fn: Callable, inputs: list[torch.Tensor]) -> int:
    """How many graphs Dynamo compiles when a fresh torch.compile(fn) runs on each input in turn."""
    torch.compiler.reset()  # forget graphs and shape decisions from earlier runs
    graphs = 0

    def counting_backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        nonlocal graphs
        graphs += 1
        return gm.forward  # run the captured graph as it is

    compiled = torch.compile(fn, backend=counting_backend)
    for x in inputs:
        compiled(x)
    return graphs


def mark_batch_dynamic(x: torch.Tensor) -> torch.Tensor:
    """Mark dimension 0 (the batch) of x as dynamic, so that a new batch size does not recompile; return x."""
    torch._dynamo.mark_dynamic(x, 0)
    return x


# Plumbing shared by the checks.

def _isolated(fn: Callable) -> Callable:
    """Run a check with Dynamo's caches emptied before and after (@exercise leaves the RNG alone).

    Every check compiles with a backend of its own, and each new backend adds an entry to
    Dynamo's cache for the code it compiles (nn.Sequential.forward, say). Past
    torch._dynamo.config.recompile_limit entries Dynamo would quietly run the code eagerly,
    so the checks start and end with torch.compiler.reset().
    """
    @functools.wraps(fn)
    def run(*args, **kwargs):
        torch.compiler.reset()
        try:
            return fn(*args, **kwargs)
        finally:
            torch.compiler.reset()
    return run


@contextlib.contextmanager
def _quiet_dynamo() -> Iterator[None]:
    """Silence Dynamo's warnings (e.g. the one for a graph break at .item()) for the length of a check."""
    logger = logging.getLogger("torch._dynamo")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _fresh(fn: Callable) -> Callable:
    """A copy of fn with its own code object, so that Dynamo's caches and shape history start empty for it."""
    _fresh.serial = getattr(_fresh, "serial", 0) + 1
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{_fresh.serial}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


class _Spy:
    """Stands in for torch.compile: records each call and swaps the backend for a counting one.

    The counting backend runs every captured graph eagerly (no code generation), so the
    checks are fast, and it records the grad mode each graph was captured under.
    """

    def __init__(self, model: nn.Module | None = None):
        self.compiled = []  # what torch.compile was called on
        self.graphs = []  # one (grad mode, model.training) pair per graph Dynamo handed to the backend
        self.model = model
        self.real = torch.compile

    def backend(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        self.graphs.append((torch.is_grad_enabled(), self.model is not None and self.model.training))
        return gm.forward

    def __call__(self, model=None, **kwargs):
        self.compiled.append(model)
        for option in ("mode", "options"):
            kwargs.pop(option, None)  # they only configure Inductor, which the checks skip
        kwargs["backend"] = self.backend
        return self.real(model, **kwargs)

    @contextlib.contextmanager
    def watching(self) -> Iterator["_Spy"]:
        with mock.patch.object(torch, "compile", self), _quiet_dynamo():
            yield self


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 1e-6) -> bool:
    return all(torch.allclose(a[k], b[k], atol=atol, rtol=1e-5) for k in a)


# Checks, one per exercise, in notebook order.

def _inference_net() -> nn.Module:
    torch.manual_seed(0)  # @exercise forks the RNG: the learner's is untouched
    net = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 3))
    with torch.no_grad():  # give batch norm running statistics that differ from a fresh batch's
        net[1].running_mean.uniform_(-1, 1)
        net[1].running_var.uniform_(0.5, 2)
    return net.train()  # as it is after training: the function must switch to eval mode itself


@exercise("compile_for_inference")
@_isolated
def check_compile_for_inference(fn) -> None:
    model = _inference_net()
    reference = copy.deepcopy(model).eval()
    g = torch.Generator().manual_seed(1)
    example, later = torch.randn(8, 6, generator=g), torch.randn(8, 6, generator=g)
    spy = _Spy(model)
    with spy.watching():
        compiled = call(fn, model, example.clone(), shown="model, example of shape (8, 6)")
        n_calls, n_graphs = len(spy.compiled), len(spy.graphs)
        if compiled is None:
            raise ExerciseFailed(
                "compile_for_inference returned None: return the compiled module "
                "(model.compile() compiles in place and returns None; torch.compile(model) returns a new module)"
            )
        if not isinstance(compiled, nn.Module):
            raise ExerciseFailed(
                f"compile_for_inference returned a {type_name(compiled)}, expected a torch.nn.Module: "
                "compile the module itself, torch.compile(model), not model.forward"
            )
        if n_calls == 0:
            raise ExerciseFailed("torch.compile was never called: the model came back uncompiled; return torch.compile(model)")
        if {id(p) for p in compiled.parameters()} != {id(p) for p in model.parameters()}:
            raise ExerciseFailed("the compiled module has its own copy of the weights: compile the model you were given, not a copy")
        if model.training:
            raise ExerciseFailed("the model is still in train mode: call model.eval() so that dropout is off and batch norm uses its running statistics")
        if n_graphs == 0:
            raise ExerciseFailed(
                "nothing was compiled yet: torch.compile is lazy and compiles on the first call; "
                "warm the compiled model up by calling it once on `example`"
            )
        with torch.no_grad():
            got = call(compiled, later.clone(), name="the compiled model", shown="a batch of shape (8, 6)", kind="callable")
            call(compiled, later.clone(), name="the compiled model", shown="a batch of shape (8, 6)", kind="callable")
    if len(spy.compiled) > n_calls:
        raise ExerciseFailed("torch.compile ran again while the model ran: compile once, in compile_for_inference, and return that module")
    if len(spy.graphs) > n_graphs:
        if all(training for _, training in spy.graphs[:n_graphs]):
            raise ExerciseFailed(
                "the warm-up ran in train mode, so the first call in eval mode compiled again: "
                "call model.eval() before the warm-up (Dynamo guards on the training flag)"
            )
        if all(grad for grad, _ in spy.graphs[:n_graphs]):
            raise ExerciseFailed(
                "the warm-up ran with gradients on, so the first call under torch.no_grad() compiled again: "
                "warm up inside `with torch.no_grad():` (Dynamo guards on grad mode)"
            )
        raise ExerciseFailed("a later call with the same input shape compiled again: warm up the way the model will be called")
    with torch.no_grad():
        expected = reference(later)
    expect_tensor(got, expected, what="the compiled model's output for a new batch", atol=1e-5)


def _train_net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def _batch(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def _eager_steps(batches, *, zero_grad: bool = True) -> tuple[nn.Module, list[float]]:
    model = _train_net(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for inputs, targets in batches:
        if zero_grad:
            optimizer.zero_grad()
        loss = F.cross_entropy(model(inputs), targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return model, losses


@exercise("compiled_train_step")
@_isolated
def check_compiled_train_step(fn) -> None:
    batches = [_batch(8, 1), _batch(8, 2)]
    model = _train_net(0)
    start = _params(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    spy = _Spy()
    with spy.watching():
        step = call(fn, model, F.cross_entropy, optimizer, shown="model, F.cross_entropy, optimizer")
        n_calls = len(spy.compiled)
        if step is None:
            raise ExerciseFailed("compiled_train_step returned None: return the compiled step function")
        if not callable(step):
            raise ExerciseFailed(f"compiled_train_step returned a {type_name(step)}, expected a function step(inputs, targets)")
        if any(isinstance(target, nn.Module) for target in spy.compiled):
            raise ExerciseFailed(
                "you compiled the model only: compile the whole step, a function doing zero_grad, forward, loss, "
                "backward and optimizer.step(), with torch.compile(step)"
            )
        first = call(step, *batches[0], name="step", shown="inputs of shape (8, 6), targets of shape (8,)")
        compiles_in_step = len(spy.compiled) - n_calls
        call(step, *batches[1], name="step", shown="inputs of shape (8, 6), targets of shape (8,)")
    if compiles_in_step or len(spy.compiled) > n_calls:
        raise ExerciseFailed("torch.compile ran inside the step, on every call: compile once in compiled_train_step and return the compiled function")
    if n_calls == 0:
        raise ExerciseFailed("torch.compile was never called: the step runs eagerly; return torch.compile(step)")
    if not spy.graphs:
        raise ExerciseFailed("torch.compile was called, but Dynamo never ran: return the compiled function and let it do the step")
    if isinstance(first, float):
        raise ExerciseFailed(
            "step returned a Python float: .item() inside a compiled function is a graph break; "
            "return loss.detach() and call .item() outside, when you need the number"
        )
    if not isinstance(first, torch.Tensor):
        raise ExerciseFailed(f"step returned a {type_name(first)}, expected the loss as a tensor")
    if first.requires_grad:
        raise ExerciseFailed("the returned loss still requires grad and holds on to its graph: return loss.detach()")
    expected_model, expected_losses = _eager_steps(batches)
    if _same(_params(model), start, atol=0.0):
        raise ExerciseFailed("the weights did not change: call loss.backward() and then optimizer.step() in the step")
    if not math.isclose(first.item(), expected_losses[0], rel_tol=1e-5, abs_tol=1e-6):
        raise ExerciseFailed(f"the first step returned {first.item():.6g}, expected {expected_losses[0]:.6g}: return this batch's loss, computed before the step")
    if not _same(_params(model), _params(expected_model), atol=1e-5):
        if _same(_params(model), _params(_eager_steps(batches, zero_grad=False)[0]), atol=1e-5):
            raise ExerciseFailed("gradients accumulate across steps: call optimizer.zero_grad() at the start of each step")
        name, value = next((k, v) for k, v in _params(model).items() if not torch.allclose(v, _params(expected_model)[k], atol=1e-5))
        expect_tensor(value, _params(expected_model)[name], what=f"parameter {name!r} after two steps", atol=1e-5)


def _explain(fn: Callable, x: torch.Tensor):
    with _quiet_dynamo():
        return torch._dynamo.explain(fn)(x)


def _break_advice(reason: str, line: str) -> str:
    first = reason.strip().splitlines()[0] if reason.strip() else "(no reason given)"
    if "item()" in first or ".item()" in line:
        return ".item() turns a tensor into a Python number, which leaves the graph: keep the peak a tensor (no .item(), float() or int())"
    if "print" in reason or line.lstrip().startswith("print("):
        return "print() cannot be traced: remove it from the compiled code"
    if "generic_jump" in first or "Data-dependent" in first:
        return "a Python `if` on a tensor's value is a data-dependent branch: compute both cases, e.g. with torch.clamp or torch.where"
    return f"first reason: {first} (at `{line.strip()}`)"


@exercise("no_break_gelu")
@_isolated
def check_no_break_gelu(fn) -> None:
    g = torch.Generator().manual_seed(3)
    cases = [torch.randn(6, 5, generator=g), 6 * torch.randn(6, 5, generator=g), torch.randn(7, generator=g) * 10, torch.zeros(3)]
    for x in cases:
        what = f"no_break_gelu(tensor of shape {tuple(x.shape)}, largest |value| {x.abs().max().item():.3g})"
        expected = no_break_gelu(x.clone())
        got = call(fn, x.clone(), shown=f"tensor of shape {tuple(x.shape)}")
        if isinstance(got, torch.Tensor) and x.abs().max() > 4 and got.shape == x.shape:
            if torch.allclose(got, gelu(x.clamp(-4, 4)), atol=1e-5) and not torch.allclose(got, expected, atol=1e-5):
                raise ExerciseFailed(f"{what}: clamp clips each value to [-4, 4]; scale the whole tensor by 4 / peak instead")
            if torch.allclose(got, gelu(x), atol=1e-5):
                raise ExerciseFailed(f"{what} was not scaled: when the largest |value| is above 4, multiply x by 4 / peak before the GELU")
        if isinstance(got, torch.Tensor) and got.shape == x.shape:
            scaled = x * torch.clamp(4.0 / x.abs().amax(), max=1.0)
            if torch.allclose(got, F.gelu(scaled), atol=1e-5) and not torch.allclose(got, expected, atol=1e-5):
                raise ExerciseFailed(f"{what}: that is the exact (erf) GELU; use the tanh approximation, gelu() above or F.gelu(x, approximate='tanh')")
        expect_tensor(got, expected, what=what, atol=1e-5)
        explained = call(lambda t: _explain(fn, t), x.clone(), name="torch._dynamo.explain(no_break_gelu)", shown=f"tensor of shape {tuple(x.shape)}")
        if explained.graph_break_count:
            reason = explained.break_reasons[0]
            line = reason.user_stack[-1].line if reason.user_stack else ""
            raise ExerciseFailed(
                f"torch._dynamo.explain found {explained.graph_break_count} graph break(s) for {what}: {_break_advice(reason.reason, line or '')}"
            )


def _smooth(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x) * 2 + 1


def _with_print(x: torch.Tensor) -> torch.Tensor:
    y = torch.sin(x) * 2
    print("", end="")  # a graph break that prints nothing
    return y + 1


_COUNT_CASES = [  # in this order, each typical wrong answer fails on a case that tells it apart from the others
    (_with_print, (8,), "a function with one print(), on one batch of 8"),
    (_with_print, (8, 16, 32), "a function with one print(), on batches of 8, 16 and 32"),
    (_smooth, (8, 16, 32, 32), "a function without graph breaks, on batches of 8, 16, 32 and 32"),
]


@functools.cache
def _expected_count(case: int) -> int:
    """The reference's count for one case; the same on every run, so it is computed once per process."""
    template, sizes, _ = _COUNT_CASES[case]
    with _quiet_dynamo():
        return count_compiles(_fresh(template), [torch.zeros(n, 3) for n in sizes])


@exercise("count_compiles")
@_isolated
def check_count_compiles(fn) -> None:
    g = torch.Generator().manual_seed(4)
    hints = {"backend=": "the backend failed: it must return a callable that runs the graph, e.g. return gm.forward"}
    with _quiet_dynamo():
        for case, (template, sizes, description) in enumerate(_COUNT_CASES):
            inputs = [torch.randn(n, 3, generator=g) for n in sizes]
            expected = _expected_count(case)
            probe = _fresh(template)
            got = call(fn, probe, [x.clone() for x in inputs], shown=description, hints=hints)
            if got is None:
                raise ExerciseFailed("count_compiles returned None: did you forget to `return` the count?")
            if isinstance(got, torch.Tensor) or isinstance(got, bool) or not isinstance(got, int):
                raise ExerciseFailed(f"count_compiles returned a {type_name(got)}, expected a Python int")
            if got == expected:
                if case == 1:  # a second run on new shapes shows whether the first one was forgotten
                    again = call(fn, probe, [x.clone() for x in inputs], shown=f"{description}, a second time", hints=hints)
                    if again != expected:
                        raise ExerciseFailed(
                            f"for {description} the first run counted {got} graphs and a second run {again}: Dynamo still "
                            "remembered the first run (its cache and the shapes it saw); call torch.compiler.reset() first"
                        )
                continue
            explained = sum(torch._dynamo.explain(_fresh(template))(x).graph_count for x in inputs)
            if got == len(inputs) and got != explained:
                raise ExerciseFailed(
                    f"for {description}: {got} is the number of calls; count graphs instead, inside the backend, "
                    "which Dynamo calls once per graph it compiles"
                )
            if got == explained:
                raise ExerciseFailed(
                    f"for {description}: expected {expected} graphs, got {got}; torch._dynamo.explain resets Dynamo on every call, "
                    "so it never sees a recompile: count with your own backend"
                )
            raise ExerciseFailed(f"for {description}: expected {expected} graphs, got {got}")


def _probe(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x) * 3 - x.mean(dim=0)


@exercise("mark_batch_dynamic")
@_isolated
def check_mark_batch_dynamic(fn) -> None:
    g = torch.Generator().manual_seed(5)
    spy = _Spy()
    compiled = spy.real(_fresh(_probe), backend=spy.backend)
    marked = []
    with _quiet_dynamo():
        for n in (8, 16, 32):
            x = torch.randn(n, 6, generator=g)
            got = call(fn, x, shown=f"tensor of shape ({n}, 6)")
            if got is None:
                raise ExerciseFailed("mark_batch_dynamic returned None: torch._dynamo.mark_dynamic marks x in place and returns None; return x")
            expect_tensor(got, x, what=f"mark_batch_dynamic(tensor of shape ({n}, 6))")
            marked.append(set(getattr(got, "_dynamo_dynamic_indices", set())))
            compiled(got)
    if len(spy.graphs) <= 1:
        return
    wrong = next((dims for dims in marked if dims and 0 not in dims), None)
    if wrong:
        raise ExerciseFailed(f"you marked dimension {sorted(wrong)[0]} dynamic; the batch is dimension 0: torch._dynamo.mark_dynamic(x, 0)")
    raise ExerciseFailed(
        f"batches of 8, 16 and 32 compiled {len(spy.graphs)} graphs, expected 1: mark dimension 0 dynamic with "
        "torch._dynamo.mark_dynamic(x, 0) on the tensor you return"
    )
