"""Lesson 07 (torch.compile): reference solutions, the checks for its exercises, and the lesson's helpers.

The checks judge behaviour, never speed: which torch.compile calls were made and with which
arguments, how many graphs Dynamo captured and what they hold, where Dynamo breaks a graph,
at which sizes a model ran, and whether the values match eager PyTorch.

Dynamo is always the real one. What a check swaps is the backend: it compiles with
backend="eager", or with a counting backend that runs each captured graph as it is (the same
thing, plus a count). Graph breaks, guards and recompiles are all decided by Dynamo before any
backend runs, so this judges exactly what Inductor would see, without Inductor's C++ compile,
which costs seconds per graph on a small CPU. Where a check stands in for torch.compile itself,
every call still goes through the real torch.compile with the learner's own arguments first,
so a mode or an option that torch rejects is rejected here too (see _CompileSpy).
"""

import contextlib
import copy
import functools
import logging
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterator
from unittest import mock

import torch
import torch._dynamo  # private: the checks read Dynamo's exceptions and its error_on_graph_break switch
import torch.nn.functional as F
from torch import nn

from course_utils.monitors import ActivationMonitor  # its own module: the checker's fresh copy of lesson07 shares it
from course_utils.tooling.checks import (
    ExerciseFailed,
    a_type,
    call,
    exercise,
    expect_tensor,
    expect_unchanged,
    scoreboard_for,
    stub_function,
)
from course_utils.tooling.language import N_, _

scoreboard = scoreboard_for(__name__)  # the lesson's last cell: this session's verdicts


# The lesson's helpers.

def gelu(x: torch.Tensor) -> torch.Tensor:
    """The tanh approximation of GELU, written as a chain of pointwise operations."""
    return 0.5 * x * (1 + torch.tanh(0.7978845608 * (x + 0.044715 * x**3)))


def verdict(eager: Any, compiled: Any) -> str:
    """The measured speed-up of compiled over eager (two course_utils.benchmarking Timings), in words."""
    ratio = eager.median / compiled.median
    if ratio >= 1.1:
        return f"compiled is {ratio:.1f}x faster than eager here"
    if ratio <= 0.9:
        return f"compiled is {1 / ratio:.1f}x slower than eager here"
    return f"no clear difference here ({ratio:.2f}x)"


def break_even_calls(first_call_s: float, eager_s: float, compiled_s: float) -> float | None:
    """After how many calls compiled code (its first call, then compiled_s each) has cost no more than eager; None if never."""
    if compiled_s >= eager_s:
        return None
    # n calls: eager n * eager_s; compiled first_call_s + (n - 1) * compiled_s
    return max(1.0, (first_call_s - compiled_s) / (eager_s - compiled_s))


def plot_compile_tradeoff(workloads: dict[str, tuple[float, float, float]], max_calls: int = 100_000):
    """Total time against the number of calls, eager and compiled (first call included), one panel per workload.

    workloads: {name: (first compiled call in s, eager median in s, compiled median in s)}.
    """
    import matplotlib.pyplot as plt  # here, not at the top: the checker imports this module and draws nothing

    calls = torch.logspace(0, torch.log10(torch.tensor(float(max_calls))).item(), 200)
    fig, axes = plt.subplots(1, len(workloads), figsize=(4.2 * len(workloads), 3.4), squeeze=False)
    for ax, (name, (first, eager, compiled)) in zip(axes.flat, workloads.items()):
        ax.plot(calls, calls * eager, label="eager", color="tab:gray")
        ax.plot(calls, first + (calls - 1) * compiled, label="compiled, compile included", color="tab:blue")
        n = break_even_calls(first, eager, compiled)
        if n is None:
            note = "never pays back here"
        else:
            ax.axvline(n, color="tab:green", linestyle="--", linewidth=1)
            note = f"pays back after {n:,.0f} calls"
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("number of calls")
        ax.set_ylabel("total seconds")
        ax.set_title(f"{name}\n{note}", fontsize=10)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    return fig


# Reference solutions. The checks compare the learner's answers with these.

def compile_for_serving(model: nn.Module, example: torch.Tensor, mode: str) -> nn.Module:
    """model in eval mode, compiled in `mode` as one graph (a graph break is an error), warmed up on example under no_grad."""
    model.eval()
    compiled = torch.compile(model, mode=mode, fullgraph=True)
    with torch.no_grad():
        compiled(example)  # the compile happens here, not in the first request; a graph break raises here
    return compiled


def masked_mean_pool(h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The mean of h (B, T, D) over the positions where mask (B, T) is True, L2-normalised; zeros for a row of padding only."""
    weights = mask.unsqueeze(-1).to(h.dtype)
    pooled = (h * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1)  # an empty row: 0 / 1, not 0 / 0
    return pooled / pooled.norm(dim=1, keepdim=True).clamp(min=1e-6)


def compile_with_eager_monitors(model: nn.Module) -> nn.Module:
    """The model compiled, with each of its ActivationMonitors run eagerly (one graph break per call, never traced)."""
    for module in model.modules():
        if isinstance(module, ActivationMonitor):
            module.forward = torch.compiler.disable(module.forward)  # this instance only, not the class
    return torch.compile(model)


def bucketed_predict(model: nn.Module, batch: torch.Tensor, buckets: tuple[int, ...]) -> torch.Tensor:
    """model(batch), with the model only ever called at a bucket size: pad each chunk to the smallest bucket that holds it."""
    outputs = []
    for chunk in batch.split(max(buckets)):  # a batch larger than every bucket runs in chunks of the largest
        n = len(chunk)
        size = min(b for b in buckets if b >= n)
        padded = torch.cat([chunk, chunk.new_zeros(size - n, *chunk.shape[1:])])
        outputs.append(model(padded)[:n])  # the padding rows' outputs are dropped
    return torch.cat(outputs)


def is_stack(module: nn.Module) -> bool:
    """A stack of repeated blocks: an nn.ModuleList or nn.Sequential of two or more modules of one class."""
    blocks = list(module.children())
    return isinstance(module, (nn.ModuleList, nn.Sequential)) and len(blocks) >= 2 and len({type(b) for b in blocks}) == 1


def compile_repeated_blocks(model: nn.Module) -> list[str]:
    """Compile in place each block of every stack of repeated blocks in model (regional compilation); return the stacks' names."""
    stacks = []
    for name, module in model.named_modules():
        if is_stack(module):
            for block in module.children():
                block.compile()  # in place: same objects, same state_dict keys; one graph per block class, reused
            stacks.append(name)
    return stacks


# Plumbing shared by the checks.

def _isolated(fn: Callable) -> Callable:
    """Run a check with Dynamo's caches emptied before and after, and Dynamo's warnings silenced.

    Every check compiles with a backend of its own, and each new backend adds an entry to
    Dynamo's cache for the code it compiles (nn.Sequential.forward, say). Past
    torch._dynamo.config.recompile_limit entries Dynamo would quietly run the code eagerly,
    so the checks start and end with torch.compiler.reset(). (@exercise leaves the RNG alone.)
    """
    @functools.wraps(fn)
    def run(*args, **kwargs):
        torch.compiler.reset()
        try:
            with _quiet_dynamo():
                return fn(*args, **kwargs)
        finally:
            torch.compiler.reset()

    return run


@contextlib.contextmanager
def _quiet_dynamo() -> Iterator[None]:
    """Silence Dynamo's log (graph breaks, recompile limits, a learner's error seen on fake tensors) during a check."""
    levels = {"torch._dynamo": logging.ERROR, "torch._subclasses.fake_tensor": logging.CRITICAL}
    loggers = {name: logging.getLogger(name) for name in levels}
    before = {name: logger.level for name, logger in loggers.items()}
    for name, logger in loggers.items():
        logger.setLevel(levels[name])
    try:
        yield
    finally:
        for name, logger in loggers.items():
            logger.setLevel(before[name])


def _op_name(target: Any) -> str:
    return getattr(target, "__name__", str(target))


@dataclass
class _Graph:
    """What the counting backend saw of one graph Dynamo captured."""

    ops: list[str]  # its operations, by name
    grad: bool  # grad mode when it was captured
    training: bool | None  # the watched model's training flag when it was captured
    inference: bool | None = None  # inference mode at its first run (Dynamo captures outside inference mode)


class _CompileSpy:
    """Stands in for torch.compile during a check, keeping its contract.

    Each call first goes to the real torch.compile with the learner's own arguments: torch
    validates them there exactly as it always does (mode="fast", mode and options together, an
    unknown Inductor option all raise the real error) and compiles nothing, since torch.compile
    is lazy. The compiled object handed back is then built by the real torch.compile with the
    same arguments except the backend: a counting one that records each graph Dynamo captures
    and runs it as it is. So the learner's fullgraph, dynamic and disable take effect as usual;
    mode and options, which only configure Inductor, are checked but have nothing to configure.
    nn.Module.compile and torch.compiler.compile go through torch.compile, so they are seen too.
    """

    def __init__(self, model: nn.Module | None = None):
        self.calls: list[tuple[Any, dict]] = []  # (what was compiled, the keyword arguments) per torch.compile call
        self.compiled: list[Any] = []  # what each of those calls returned
        self.graphs: list[_Graph] = []
        self.runs = 0  # calls of compiled graphs
        self.model = model  # whose training flag each graph records
        self.real = torch.compile

    def backend(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        ops = [_op_name(node.target) for node in gm.graph.nodes if node.op in ("call_function", "call_method", "call_module")]
        training = None if self.model is None else self.model.training
        graph = _Graph(ops, torch.is_grad_enabled(), training)
        self.graphs.append(graph)
        forward = gm.forward

        def run(*args):
            self.runs += 1
            if graph.inference is None:
                graph.inference = torch.is_inference_mode_enabled()
            return forward(*args)

        return run

    def __call__(self, *args, **kwargs):
        target = args[0] if args else kwargs.get("model")
        options = kwargs.get("options")
        checked = dict(kwargs, options=dict(options)) if isinstance(options, dict) else kwargs  # torch pops keys from options
        validated = self.real(*args, **checked)  # torch's own argument checks; nothing is compiled yet
        if target is None:
            return validated  # the decorator form: applying it calls torch.compile again, that is, this spy
        self.calls.append((target, dict(kwargs)))
        quick = {k: v for k, v in kwargs.items() if k not in ("model", "backend", "mode", "options")}
        if isinstance(options, dict) and "guard_filter_fn" in options:
            quick["options"] = {"guard_filter_fn": options["guard_filter_fn"]}  # a Dynamo option, not Inductor's
        compiled = self.real(target, backend=self.backend, **quick)
        self.compiled.append(compiled)
        return compiled

    @contextlib.contextmanager
    def watching(self) -> Iterator["_CompileSpy"]:
        with mock.patch.object(torch, "compile", self):
            yield self


def _graph_break(err: BaseException) -> BaseException | None:
    """The Dynamo error (a graph break refused, or a data-dependent guard) in err's chain, if any."""
    kinds = (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError)
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, kinds):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def _where_dynamo_stopped(err: BaseException) -> str | None:
    """The learner's line at which Dynamo raised, stripped, when Dynamo says; else None."""
    stack = getattr(err, "real_stack", None) or []
    for frame in reversed(stack):
        if frame.line:
            return frame.line.strip()
    return None


_BREAK_ADVICE = {  # Dynamo's reason -> what it means; only where the reason says it all (translated when shown)
    "Data-dependent branching": N_("a Python `if` (or and/or, bool()) on a tensor's value: compute both outcomes with tensor operations (torch.where, a mask)"),
    "Could not guard on data-dependent expression": N_("a Python decision on a number read from a tensor (.item(), float(), int(), .tolist()): keep it a tensor"),
    "Dynamic shape operator": N_("an operation whose output size depends on the data (boolean-mask indexing, nonzero): keep the shape fixed and use the mask as weights"),
    "Unsupported Tensor.item() call": N_("a tensor turned into a Python number (.item(), float(), int()): keep it a tensor"),
    "Unsupported Tensor.tolist() call": N_("a tensor turned into Python numbers (.tolist()): keep it a tensor"),
}
_PRINT_ADVICE = N_("print() cannot go in a graph: take it out of the function")


def _break_message(err: BaseException, label: str, hint: str) -> str:
    """'compiled {label}, Dynamo breaks the graph at `line`: reason (advice){hint}' for a Dynamo error."""
    lines = str(err).strip().splitlines()
    reason = lines[0] if lines else type(err).__name__
    line = _where_dynamo_stopped(err)
    if "print" in (line or "") or ("builtin" in reason and "print" in str(err)):
        advice = _PRINT_ADVICE
    else:
        advice = next((text for key, text in _BREAK_ADVICE.items() if key in str(err)), "")
    shown_advice = _(" ({advice})").format(advice=_(advice)) if advice else ""
    if line is None:
        return _("compiled {label}, Dynamo breaks the graph: {reason}{advice}{hint}").format(
            label=label, reason=reason, advice=shown_advice, hint=hint)
    return _("compiled {label}, Dynamo breaks the graph at `{line}`: {reason}{advice}{hint}").format(
        label=label, line=line, reason=reason, advice=shown_advice, hint=hint)


@contextlib.contextmanager
def _class_guard(cls: type, names: tuple[str, ...]) -> Iterator[list[str]]:
    """Yield a list that is filled with the names of methods of cls changed inside the block; restore them after."""
    before = {name: cls.__dict__.get(name) for name in names}
    changed: list[str] = []
    try:
        yield changed
    finally:
        for name, value in before.items():
            if cls.__dict__.get(name) is not value:
                changed.append(name)
                setattr(cls, name, value)


# Exercise 1: compile_for_serving

def _serving_net() -> nn.Module:
    torch.manual_seed(0)  # @exercise forks the RNG: the learner's is untouched
    net = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 3))
    with torch.no_grad():  # running statistics that differ from any batch's own
        net[1].running_mean.uniform_(-1, 1)
        net[1].running_var.uniform_(0.5, 2)
    return net.train()  # as it is after training: the function must switch to eval mode itself


class _GuardedNet(nn.Module):
    """A model with one graph break: a Python `if` on a tensor's value."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        if y.abs().max() > 1e3:  # a guard against blow-ups that Dynamo cannot put in a graph
            y = y / y.abs().max()
        return y


_SERVING_HINTS = {  # call() translates hints when it shows them
    "Expected more than 1 value per channel when training": N_("batch norm in train mode cannot normalise a batch of 1: switch the model to eval mode first"),
}


def _serve_once(fn: Callable, mode: str, batch: int, seed: int) -> None:
    model = _serving_net()
    reference = copy.deepcopy(model).eval()
    g = torch.Generator().manual_seed(seed)
    example, later = torch.randn(batch, 6, generator=g), torch.randn(batch, 6, generator=g)
    shown = _("model, example of shape ({batch}, 6), mode={mode!r}").format(batch=batch, mode=mode)
    spy = _CompileSpy(model)
    with spy.watching():
        compiled = call(fn, model, example.clone(), mode, shown=shown, hints=_SERVING_HINTS)
        n_calls, n_graphs = len(spy.calls), len(spy.graphs)
        if compiled is None:
            raise ExerciseFailed(
                _("compile_for_serving returned None: return the compiled module "
                  "(model.compile() compiles in place and returns None; torch.compile(model) returns a new module)")
            )
        if n_calls == 0:
            raise ExerciseFailed(_("torch.compile was never called: the model came back uncompiled"))
        if n_calls > 1:
            raise ExerciseFailed(_("torch.compile was called {n} times for one model: compile it once").format(n=n_calls))
        if not isinstance(compiled, nn.Module):
            raise ExerciseFailed(_("compile_for_serving returned {a_type}, expected the compiled module (a torch.nn.Module)").format(
                a_type=a_type(compiled)))
        got_mode = spy.calls[0][1].get("mode")
        if got_mode != mode:
            raise ExerciseFailed(_("({shown}): torch.compile got mode={got!r}, expected the mode you were given, {expected!r}").format(
                shown=shown, got=got_mode, expected=mode))
        if {id(p) for p in compiled.parameters()} != {id(p) for p in model.parameters()}:
            raise ExerciseFailed(_("the compiled module has its own copy of the weights: compile the model you were given, not a copy"))
        if model.training:
            raise ExerciseFailed(_("the model is still in train mode: switch it to eval mode, "
                                   "so that dropout is off and batch norm uses its running statistics"))
        if n_graphs == 0:
            raise ExerciseFailed(_("nothing was compiled yet: torch.compile is lazy and compiles on the first call; "
                                   "warm the compiled model up on `example`"))
        runs_before = spy.runs
        name, batch_shown = _("the compiled model"), _("a batch of shape {shape}").format(shape=(batch, 6))
        with torch.no_grad():  # how the server calls it: same shape, new values, gradients off
            got = call(compiled, later.clone(), name=name, shown=batch_shown, kind="callable")
            call(compiled, later.clone(), name=name, shown=batch_shown, kind="callable")
        served_runs = spy.runs - runs_before
    if len(spy.calls) > n_calls:
        raise ExerciseFailed(_("torch.compile ran again while the model ran: compile once, in compile_for_serving, and return that module"))
    if len(spy.graphs) > n_graphs:
        warm = spy.graphs[:n_graphs]
        if all(graph.training for graph in warm):
            raise ExerciseFailed(
                _("the warm-up ran in train mode, so the first call in eval mode compiled again: "
                  "switch to eval mode before the warm-up (Dynamo guards on the training flag)")
            )
        if any(graph.inference for graph in warm):
            raise ExerciseFailed(
                _("the warm-up ran under torch.inference_mode(), so the first call under torch.no_grad() compiled again: "
                  "warm up under torch.no_grad(), as the model will be called")
            )
        if all(graph.grad for graph in warm):
            raise ExerciseFailed(
                _("the warm-up ran with gradients on, so the first call under torch.no_grad() compiled again: "
                  "warm up inside `with torch.no_grad():` (Dynamo guards on grad mode)")
            )
        raise ExerciseFailed(_("a later call with the same input shape compiled again: warm up the way the model will be called"))
    if served_runs < 2:
        raise ExerciseFailed(
            _("the module you returned ran no compiled code when the server called it (the warm-up did): return the compiled "
              "module itself, the one torch.compile returned, or the model after model.compile(), not the original"))
    with torch.no_grad():
        expected = reference(later)
    expect_tensor(got, expected, what=_("the compiled model's output for a new batch of shape {shape}").format(shape=(batch, 6)),
                  atol=1e-5)


def _serve_with_a_break(fn: Callable) -> None:
    torch.manual_seed(1)
    model = _GuardedNet()
    example = torch.randn(4, 6, generator=torch.Generator().manual_seed(2))
    spy = _CompileSpy(model)

    def attempt() -> bool:
        try:
            fn(model, example.clone(), "default")
        except Exception as err:  # noqa: BLE001 -- the error wanted here: Dynamo's, or the learner's own about the break
            if not stub_function(err) and (_graph_break(err) is not None or "break" in str(err).lower()):
                return True
            raise
        return False

    with spy.watching():
        refused = call(attempt, name="compile_for_serving",
                       shown=_("a model with a graph break, example of shape (4, 6), mode='default'"))
    if refused:
        return
    if not spy.calls:
        raise ExerciseFailed(_("for a model with a graph break, torch.compile was never called"))
    if spy.calls[-1][1].get("fullgraph") is not True:
        raise ExerciseFailed(
            _("a model with a graph break (a Python `if` on a tensor) compiled silently, in pieces: "
              "compile with fullgraph=True, so that the warm-up raises at the break")
        )
    raise ExerciseFailed(
        _("for a model with a graph break, the warm-up raised Dynamo's error but compile_for_serving returned normally: "
          "let that error reach the caller")
    )


@exercise("compile_for_serving")
@_isolated
def check_compile_for_serving(fn) -> None:
    # Two modes, so that a mode written into the function shows; a batch of 1, so that batch norm in train mode shows.
    for mode, batch, seed in (("reduce-overhead", 5, 3), ("max-autotune-no-cudagraphs", 1, 4)):
        torch.compiler.reset()
        _serve_once(fn, mode, batch, seed)
    torch.compiler.reset()
    _serve_with_a_break(fn)


# Exercise 2: masked_mean_pool

def _pool_cases() -> list[tuple[torch.Tensor, torch.Tensor, str]]:
    g = torch.Generator().manual_seed(11)
    mixed = torch.tensor([[1, 1, 0, 1, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    tiny = torch.randn(2, 4, 3, generator=g)
    tiny[0] *= 1e-9  # a row whose mean has a norm far below 1e-6
    odd = torch.randn(4, 3, 7, generator=g, dtype=torch.float64).transpose(1, 2)  # (4, 7, 3), not contiguous
    return [
        (torch.randn(3, 5, 4, generator=g), mixed, _("h (3, 5, 4) with a partly padded row, a row of padding only and a full row")),
        (torch.randn(1, 1, 6, generator=g), torch.ones(1, 1, dtype=torch.bool), _("h (1, 1, 6): a batch of 1, one position")),
        (torch.randn(1, 3, 2, generator=g), torch.zeros(1, 3, dtype=torch.bool), _("h (1, 3, 2): a batch of 1, padding only")),
        (tiny, torch.tensor([[1, 1, 1, 0], [1, 0, 1, 1]], dtype=torch.bool), _("h (2, 4, 3) whose first row is about 1e-9")),
        (odd, torch.rand(4, 7, generator=g) > 0.4, _("h (4, 7, 3) of float64, not contiguous")),
    ]


def _pool_fault(got: Any, h: torch.Tensor, mask: torch.Tensor, what: str) -> None:
    """The typical wrong pools, named; then the plain comparison."""
    expected = masked_mean_pool(h, mask)
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape or got.dtype != expected.dtype:
        expect_tensor(got, expected, what=what, atol=1e-5)
    if torch.allclose(got, expected, atol=1e-5, rtol=1e-4, equal_nan=False):
        return
    empty = ~mask.any(dim=1)
    if torch.isnan(got).any() and empty.any() and not torch.isnan(got[~empty]).any():
        raise ExerciseFailed(_("{what}: the row of padding only gave NaN: its mean divides 0 by a count of 0; it should be zeros").format(
            what=what))
    weights = mask.unsqueeze(-1).to(h.dtype)
    pooled = (h * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1)
    if torch.allclose(got, pooled, atol=1e-5, rtol=1e-4):
        raise ExerciseFailed(_("{what}: the means are right but not normalised: divide each by its norm, clamped at 1e-6, "
                               "as pool_with_breaks does").format(what=what))
    if torch.allclose(got, F.normalize(pooled, dim=1), atol=1e-5, rtol=1e-4):
        raise ExerciseFailed(
            _("{what}: a row whose mean has a norm below 1e-6 was scaled up to norm 1; "
              "pool_with_breaks divides by the norm clamped at 1e-6").format(what=what)
        )
    everything = h.mean(dim=1)
    if torch.allclose(got, everything / everything.norm(dim=1, keepdim=True).clamp(min=1e-6), atol=1e-5, rtol=1e-4):
        raise ExerciseFailed(_("{what}: the padding positions were averaged in: only the positions where mask is True count").format(
            what=what))
    expect_tensor(got, expected, what=what, atol=1e-5, rtol=1e-4)


@exercise("masked_mean_pool")
@_isolated
def check_masked_mean_pool(fn) -> None:
    cases = _pool_cases()
    for h, mask, description in cases:  # eagerly first: the values, on every edge case
        h_before, mask_before = h.clone(), mask.clone()
        got = call(fn, h, mask, shown=description)
        expect_unchanged(h_before, h, what=f"masked_mean_pool({description})")
        expect_unchanged(mask_before, mask, what=f"masked_mean_pool({description})")
        _pool_fault(got, h, mask, f"masked_mean_pool({description})")
    h, mask, description = cases[0]
    expected = masked_mean_pool(h, mask)
    # backend="eager": where Dynamo breaks a graph is decided before any backend runs, so Inductor would see the same.
    for fullgraph, label, compile_it in (
        (True, N_("with fullgraph=True"), lambda: torch.compile(fn, fullgraph=True, backend="eager")),
        (False, N_("with the default fullgraph=False"), lambda: torch.compile(fn, backend="eager")),
    ):
        label = _(label)
        torch.compiler.reset()
        try:
            with torch._dynamo.error_on_graph_break(True):  # private switch: any graph break raises, with its reason
                got = compile_it()(h.clone(), mask.clone())
        except Exception as err:  # noqa: BLE001 -- Dynamo's verdict on the learner's code
            dynamo = _graph_break(err)
            if dynamo is None:
                raise ExerciseFailed(_("compiled {label}, {call} raised {error}: {message}").format(
                    label=label, call=f"masked_mean_pool({description})", error=type(err).__name__,
                    message=str(err).strip().splitlines()[0] if str(err).strip() else "")) from None
            lines = str(dynamo).strip().splitlines()
            hint = (_(" (fullgraph=True captures it as a symbolic value or size; with the default settings it is a break)")
                    if not fullgraph and not any(k in (lines[0] if lines else "") for k in ("Data-dependent branching", "builtin")) else "")
            raise ExerciseFailed(_break_message(dynamo, label, hint)) from None
        expect_tensor(got, expected, what=_("compiled {label}, {call}").format(label=label, call=f"masked_mean_pool({description})"),
                      atol=1e-5, rtol=1e-4)


# Exercise 3: compile_with_eager_monitors

class _MonitoredBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 5)
        self.monitor = ActivationMonitor()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.monitor(torch.tanh(self.fc(h)))


class _MonitoredNet(nn.Module):
    """Three Linear layers; one monitor at the top level and one nested in a submodule."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.monitor = ActivationMonitor()
        self.block = _MonitoredBlock()
        self.head = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.monitor(torch.relu(self.fc1(x)))
        return self.head(self.block(h))


@exercise("compile_with_eager_monitors")
@_isolated
def check_compile_with_eager_monitors(fn) -> None:
    torch.manual_seed(5)
    model = _MonitoredNet()
    reference = copy.deepcopy(model)
    monitors = {"monitor": (model.monitor, reference.monitor), "block.monitor": (model.block.monitor, reference.block.monitor)}
    g = torch.Generator().manual_seed(6)
    batches = [torch.randn(7, 6, generator=g), torch.randn(7, 6, generator=g)]
    spy = _CompileSpy()
    outputs, graphs_after_first_call = [], 0
    with _class_guard(ActivationMonitor, ("forward", "__call__")) as changed:
        with spy.watching():
            compiled = call(fn, model, shown=_("a model with 2 ActivationMonitors"))
            if compiled is None:
                raise ExerciseFailed(_("compile_with_eager_monitors returned None: return the compiled model (model.compile() returns None)"))
            if not callable(compiled):
                raise ExerciseFailed(_("compile_with_eager_monitors returned {a_type}, expected the compiled model").format(
                    a_type=a_type(compiled)))
            calls = len(spy.calls)
            for x in batches:
                outputs.append(call(compiled, x.clone(), name=_("the compiled model"),
                                    shown=_("a batch of shape {shape}").format(shape=(7, 6)), kind="callable"))
                graphs_after_first_call = graphs_after_first_call or len(spy.graphs)
    if changed:
        raise ExerciseFailed(
            _("you changed ActivationMonitor.{method} on the class itself, which changes every model that uses it: "
              "change only the monitors inside this model").format(method=changed[0])
        )
    if calls == 0:
        raise ExerciseFailed(_("torch.compile was never called: return the model compiled"))
    if not spy.graphs:
        raise ExerciseFailed(_("nothing was compiled: Dynamo captured no graph while the model ran; "
                               "compile the model, and keep only its monitors out"))
    if any("amax" in graph.ops for graph in spy.graphs):
        raise ExerciseFailed(
            _("Dynamo still traced an ActivationMonitor: its operations (abs, amax) are in a compiled graph. "
              "The model holds monitors at 'monitor' and 'block.monitor' (one nested in a submodule): each must run eagerly")
        )
    expected = [reference(x) for x in batches]  # fills the reference monitors' records too
    for name, (monitor, ref) in monitors.items():
        if len(monitor.records) != len(batches):
            raise ExerciseFailed(
                _("the monitor at '{name}' recorded {records} times in {calls} calls of the compiled model: "
                  "keep every monitor in the model, recording at each call").format(
                    name=name, records=len(monitor.records), calls=len(batches))
            )
        for got, want in zip(monitor.records, ref.records):
            if not (isinstance(got, list) and len(got) == len(want) and all(isinstance(a, float) and abs(a - b) <= 1e-5 for a, b in zip(got, want))):
                raise ExerciseFailed(_("the monitor at '{name}' recorded {got}, expected {expected}").format(
                    name=name, got=str(got)[:60], expected=str([round(v, 4) for v in want])[:60]))
    linears = sum(graph.ops.count("linear") for graph in spy.graphs)
    if linears < 3:
        raise ExerciseFailed(
            _("only {n} of the model's 3 Linear layers ran in a compiled graph: "
              "compile the whole model, with only the monitors left out").format(n=linears)
        )
    between = [op for op in ("relu", "tanh") if not any(op in graph.ops for graph in spy.graphs)]
    if between:
        raise ExerciseFailed(
            _("the model's own code between the monitors ran eagerly ({ops} in no compiled graph): "
              "compile the whole model, with only the monitors left out").format(ops=", ".join(between))
        )
    if graphs_after_first_call > len(monitors) + 1:
        raise ExerciseFailed(
            _("one call of the compiled model captured {n} graphs; "
              "with one graph break at each of the 2 monitors, expected at most 3").format(n=graphs_after_first_call)
        )
    for got, want in zip(outputs, expected):
        expect_tensor(got, want, what=_("the compiled model's output for a batch of shape {shape}").format(shape=(7, 6)), atol=1e-5)


# Exercise 4: bucketed_predict

class _SizeRecorder(nn.Module):
    """Records the batch size of every call, then runs a model compiled for fixed shapes."""

    def __init__(self, compiled: Callable):
        super().__init__()
        self.compiled = compiled
        self.sizes: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.sizes.append(len(x))
        try:
            return self.compiled(x)
        except torch._dynamo.exc.TorchRuntimeError as err:  # Dynamo wraps the model's own error: show that one
            found = re.search(r"got (\w+)\('(.+?)'\)", str(err))
            if found is None:
                raise
            raise RuntimeError(_("{message} ({error} in the model, seen by Dynamo)").format(
                message=found.group(2), error=found.group(1))) from None


def _expected_sizes(n: int, buckets: tuple[int, ...]) -> list[int]:
    largest = max(buckets)
    chunks = [largest] * (n // largest) + ([n % largest] if n % largest else [])
    return [min(b for b in buckets if b >= c) for c in chunks]


@exercise("bucketed_predict")
@_isolated
def check_bucketed_predict(fn) -> None:
    torch.manual_seed(7)
    net = nn.Sequential(nn.Linear(5, 12), nn.GELU(), nn.Linear(12, 4)).eval()  # each output row depends on its input row only
    buckets = (4, 16, 32)  # hidden: the notebook shows other sizes
    spy = _CompileSpy()
    recorder = _SizeRecorder(spy.real(net, dynamic=False, backend=spy.backend))  # fixed shapes, as for CUDA graphs
    g = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for n in (5, 1, 4, 16, 17, 32, 70):
            batch = torch.randn(n, 5, generator=g)
            before = batch.clone()
            recorder.sizes.clear()
            shown = _("model, batch of shape ({n}, 5), buckets={buckets}").format(n=n, buckets=buckets)
            got = call(fn, recorder, batch, buckets, shown=shown)
            expect_unchanged(before, batch, what="bucketed_predict")
            sizes, wanted = list(recorder.sizes), _expected_sizes(n, buckets)
            if not sizes:
                raise ExerciseFailed(_("({shown}): the model was never called").format(shown=shown))
            odd = [s for s in sizes if s not in buckets]
            if odd and n > max(buckets) and odd == [n]:
                raise ExerciseFailed(_("a batch of {n} ran at size {n}, which is larger than the largest bucket ({largest}): "
                                       "run it in chunks of {largest}").format(n=n, largest=max(buckets)))
            if odd:
                raise ExerciseFailed(_("a batch of {n} ran the model at size {size}, not a bucket size {buckets}: "
                                       "pad every chunk, the last one too").format(n=n, size=odd[0], buckets=buckets))
            if sizes != wanted:
                if n <= max(buckets) and len(sizes) == 1 and sizes[0] > wanted[0]:
                    raise ExerciseFailed(
                        _("a batch of {n} ran at sizes {sizes}, expected {expected}: use the smallest bucket that holds the rows "
                          "(a bucket of exactly n rows holds n)").format(n=n, sizes=sizes, expected=wanted)
                    )
                raise ExerciseFailed(_("a batch of {n} ran the model at sizes {sizes}, expected {expected} "
                                       "(chunks of {largest}, each padded to the smallest bucket that holds it)").format(
                    n=n, sizes=sizes, expected=wanted, largest=max(buckets)))
            if isinstance(got, torch.Tensor) and got.ndim == 2 and len(got) == sum(sizes) != n:
                raise ExerciseFailed(_("({shown}): returned {rows} rows, the padding rows' outputs too: "
                                       "keep only the {n} rows of the batch").format(shown=shown, rows=len(got), n=n))
            expect_tensor(got, net(batch), what=f"bucketed_predict({shown})", atol=1e-5)
    if len(spy.graphs) > len(buckets):
        raise ExerciseFailed(_("the model compiled {graphs} graphs for {buckets} buckets").format(
            graphs=len(spy.graphs), buckets=len(buckets)))


# Exercise 5: compile_repeated_blocks. A model with two stacks of different block classes (one nested in a submodule,
# one an nn.Sequential) and two lists that are not stacks: a single block, and modules of different classes.

class _EncoderBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class _DecoderBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.mix = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.mix(x))


class _Refiner(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.gate = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(self.gate(x))


class _Encoder(nn.Module):
    def __init__(self, width: int, depth: int):
        super().__init__()
        self.layers = nn.ModuleList(_EncoderBlock(width) for _block in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class _StackedNet(nn.Module):
    """embed -> encoder.layers (3 blocks) -> decoder (an nn.Sequential of 2 blocks) -> refine[0] -> heads[0] + heads[1]."""

    def __init__(self, width: int = 12):
        super().__init__()
        self.embed = nn.Linear(7, width)
        self.encoder = _Encoder(width, 3)
        self.decoder = nn.Sequential(_DecoderBlock(width), _DecoderBlock(width))
        self.refine = nn.ModuleList([_Refiner(width)])
        self.heads = nn.ModuleList([nn.Linear(width, 3), nn.Sequential(nn.Linear(width, 3), nn.Tanh())])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.decoder(self.encoder(self.embed(x)))
        h = self.refine[0](h)
        return self.heads[0](h) + self.heads[1](h)


def _owner(target: Any) -> Any:
    """The module a torch.compile call was about: the module itself, or the owner of a bound method."""
    return getattr(target, "__self__", target)


def _compiled_modules(target: Any, result: Any, model: nn.Module, names_of: dict[int, str]) -> list[str]:
    """The names of the modules a torch.compile call compiled: its target's owner, or the modules whose forward is the result."""
    owner = _owner(target)
    if id(owner) in names_of:
        return [names_of[id(owner)]]
    users = [name for name, module in model.named_modules()
             if getattr(module.__dict__.get("forward"), "__func__", module.__dict__.get("forward")) is result]
    return users or [_("a function or module outside the model")]


def _not_a_stack(name: str, module: nn.Module) -> str:
    """Why a container the learner compiled, or whose modules they compiled, is not a stack of repeated blocks."""
    blocks = list(module.children())
    if len(blocks) < 2:
        return _("{name} holds a single module: nothing repeats, so compiling it costs a compile of its own that no other "
                 "block reuses; compile only stacks of two or more blocks of one class").format(name=name)
    classes = ", ".join(dict.fromkeys(type(b).__name__ for b in blocks))
    return _("{name} holds modules of different classes ({classes}): each would compile a graph of its own, used once; "
             "compile only stacks of blocks of one class").format(name=name, classes=classes)


@exercise("compile_repeated_blocks")
@_isolated
def check_compile_repeated_blocks(fn) -> None:
    torch.manual_seed(9)
    model = _StackedNet()
    reference = copy.deepcopy(model)
    keys = list(model.state_dict())
    objects = {name: module for name, module in model.named_modules()}
    stacks = {name: module for name, module in objects.items() if is_stack(module)}
    blocks = {f"{name}.{i}": block for name, stack in stacks.items() for i, block in enumerate(stack.children())}
    names_of = {id(module): name for name, module in objects.items()}
    x = torch.randn(6, 7, generator=torch.Generator().manual_seed(10))
    spy = _CompileSpy()
    classes = (_EncoderBlock, _DecoderBlock, _Refiner, _Encoder)
    with contextlib.ExitStack() as guards:
        changed = [guards.enter_context(_class_guard(cls, ("forward", "__call__", "_call_impl"))) for cls in classes]
        with spy.watching():
            result = call(fn, model, shown=_("a model with stacks of repeated blocks"))
            calls = list(spy.calls)
            runs_before = spy.runs
            out = call(model, x.clone(), name=_("the model after compile_repeated_blocks"),
                       shown=_("a batch of shape {shape}").format(shape=(6, 7)), kind="callable")
            runs = spy.runs - runs_before
    patched = next(((cls.__name__, names[0]) for cls, names in zip(classes, changed) if names), None)
    if patched:
        raise ExerciseFailed(_("you changed the class {cls} itself ({method}), which changes every model that uses it: "
                               "compile this model's blocks, in place").format(cls=patched[0], method=patched[1]))
    compiled = [name for (target, _kwargs), result in zip(calls, spy.compiled) for name in _compiled_modules(target, result, model, names_of)]
    if "" in compiled:
        raise ExerciseFailed(_("you compiled the whole model: compile each block of each stack of repeated blocks, in place, "
                               "so that one small graph per block class is compiled and reused"))
    for name in compiled:
        if name in stacks:
            raise ExerciseFailed(_("you compiled the stack {name} as one module: its blocks are traced into one graph, each copy "
                                   "again, and nothing is reused; compile each block in it").format(name=name))
        if name not in blocks:
            parent = name.rsplit(".", 1)[0] if "." in name else None
            if parent is not None and parent in objects and isinstance(objects[parent], (nn.ModuleList, nn.Sequential)):
                raise ExerciseFailed(_("you compiled {name}: {reason}").format(name=name, reason=_not_a_stack(parent, objects[parent])))
            raise ExerciseFailed(_("you compiled {name}, which is not a block of a stack of repeated blocks: leave it eager").format(
                name=name))
    missing = [name for name in stacks if not any(c.startswith(name + ".") for c in compiled)]
    if missing:
        where = (_("a stack can be an nn.Sequential as well as an nn.ModuleList") if isinstance(stacks[missing[0]], nn.Sequential)
                 else _("look at every module, at any depth (model.named_modules())"))
        raise ExerciseFailed(_("the blocks of {name} ({n} {block_class}s) were not compiled: {advice}").format(
            name=missing[0], n=len(list(stacks[missing[0]].children())),
            block_class=type(next(stacks[missing[0]].children())).__name__, advice=where))
    partly = next((name for name in blocks if name not in compiled), None)
    if partly:
        raise ExerciseFailed(_("the block {name} was not compiled: compile every block of each stack").format(name=partly))
    if len(compiled) > len(set(compiled)):
        raise ExerciseFailed(_("torch.compile was called {calls} times for {blocks} blocks: compile each block once").format(
            calls=len(compiled), blocks=len(set(compiled))))
    if list(model.state_dict()) != keys:
        odd = next((k for k in model.state_dict() if k not in keys), "")
        raise ExerciseFailed(_("the model's state_dict keys changed (e.g. {key!r}): "
                               "compile each block in place, without replacing it in its stack").format(key=odd))
    if any(objects[name] is not module for name, module in model.named_modules() if name in objects) or len(dict(model.named_modules())) != len(objects):
        raise ExerciseFailed(_("the model holds other modules than before: compile the blocks in place"))
    if runs != len(blocks):
        raise ExerciseFailed(_("{runs} compiled graphs ran in one forward pass, expected {expected}, one per block of the stacks: "
                               "compile each block, in place, so that the model's own forward runs them").format(
            runs=runs, expected=len(blocks)))
    if len(spy.graphs) > len({type(b) for b in blocks.values()}):
        raise ExerciseFailed(_("{graphs} graphs were compiled for {classes} block classes: "
                               "blocks of one class should share one graph (compile each block the same way)").format(
            graphs=len(spy.graphs), classes=len({type(b) for b in blocks.values()})))
    expect_tensor(out, reference(x), what=_("the model's output after compile_repeated_blocks"), atol=1e-5)
    expected = list(stacks)
    if result is None:
        raise ExerciseFailed(_("compile_repeated_blocks returned None, expected the names of the stacks it compiled, {expected}").format(
            expected=expected))
    if not isinstance(result, list) or not all(isinstance(n, str) for n in result):
        raise ExerciseFailed(_("compile_repeated_blocks returned {a_type}, expected a list of names, {expected}").format(
            a_type=a_type(result), expected=expected))
    if result != expected:
        hint = (_(": the names of the stacks (the containers), not of their blocks") if set(result) == set(blocks) else
                _(": in the order model.named_modules() visits them") if sorted(result) == sorted(expected) else "")
        raise ExerciseFailed(_("compile_repeated_blocks returned {got}, expected {expected}{hint}").format(
            got=result, expected=expected, hint=hint))
