"""Lesson 07's checks against the reference solutions and the wrong answers learners write."""

import copy
import logging
from pathlib import Path

import nbformat
import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch import nn

from course_utils import lesson07 as L
from course_utils.tooling.checks import ExerciseFailed
from lesson_contract import assert_names_fault, contract_tests

PAIRS = [
    (L.check_compile_for_inference, L.compile_for_inference),
    (L.check_compiled_train_step, L.compiled_train_step),
    (L.check_no_break_gelu, L.no_break_gelu),
    (L.check_count_compiles, L.count_compiles),
    (L.check_mark_batch_dynamic, L.mark_batch_dynamic),
]

(test_reference_passes, test_stub_is_not_attempted, test_bad_input_is_one_named_line, test_hostile_answers_are_the_learners_fault,
 test_checks_leave_the_learners_random_state_alone, test_checks_are_quick) = contract_tests(PAIRS, max_seconds=10.0)


# Typical wrong answers, one function each.

def inference_in_place(model, example):  # a correct alternative: model.compile() works in place
    model.eval()
    model.compile()
    with torch.no_grad():
        model(example)
    return model


def inference_returns_compile_result(model, example):
    model.eval()
    return model.compile()


def inference_not_warmed_up(model, example):
    model.eval()
    return torch.compile(model)


def inference_warmed_with_grad(model, example):
    model.eval()
    compiled = torch.compile(model)
    compiled(example)
    return compiled


def inference_eval_after_warm_up(model, example):
    compiled = torch.compile(model)
    with torch.no_grad():
        compiled(example)
    model.eval()
    return compiled


def inference_without_eval(model, example):
    compiled = torch.compile(model)
    with torch.no_grad():
        compiled(example)
    return compiled


class CompilesInForward(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return torch.compile(self.model)(x)


def inference_compiles_in_forward(model, example):
    model.eval()
    wrapper = CompilesInForward(model)
    with torch.no_grad():
        wrapper(example)
    return wrapper


def _eager_step(model, loss_fn, optimizer):
    def step(inputs, targets):
        optimizer.zero_grad()
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()
        return loss.detach()
    return step


def step_uncompiled(model, loss_fn, optimizer):
    return _eager_step(model, loss_fn, optimizer)


def step_compiles_every_call(model, loss_fn, optimizer):
    return lambda inputs, targets: torch.compile(_eager_step(model, loss_fn, optimizer))(inputs, targets)


def step_compiles_the_model_only(model, loss_fn, optimizer):
    return _eager_step(torch.compile(model), loss_fn, optimizer)


def step_returns_item(model, loss_fn, optimizer):
    @torch.compile
    def step(inputs, targets):
        optimizer.zero_grad()
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()
        return loss.item()
    return step


def step_without_detach(model, loss_fn, optimizer):
    @torch.compile
    def step(inputs, targets):
        optimizer.zero_grad()
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()
        return loss
    return step


def step_without_zero_grad(model, loss_fn, optimizer):
    @torch.compile
    def step(inputs, targets):
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()
        return loss.detach()
    return step


def step_without_optimizer_step(model, loss_fn, optimizer):
    @torch.compile
    def step(inputs, targets):
        optimizer.zero_grad()
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        return loss.detach()
    return step


def step_with_compiled_decorator(model, loss_fn, optimizer):  # a correct alternative
    @torch.compile(fullgraph=False)
    def step(inputs, targets):
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()
        return loss.detach()
    return step


def gelu_with_item(x):
    peak = x.abs().max().item()
    return L.gelu(x * min(1.0, 4.0 / peak) if peak > 0 else x)


def gelu_with_if(x):
    peak = x.abs().amax()
    if peak > 4:
        x = x * (4 / peak)
    return L.gelu(x)


def gelu_with_print(x):
    peak = x.abs().amax()
    print("", end="")
    return L.gelu(x * torch.clamp(4 / peak, max=1.0))


def gelu_with_where(x):  # a correct alternative
    peak = x.abs().amax()
    return L.gelu(torch.where(peak > 4, x * 4 / peak, x))


def gelu_builtin_tanh(x):  # a correct alternative
    return F.gelu(x * torch.clamp(4 / x.abs().amax(), max=1.0), approximate="tanh")


def gelu_exact_erf(x):
    return F.gelu(x * torch.clamp(4 / x.abs().amax(), max=1.0))


def count_without_reset(fn, inputs):
    graphs = 0

    def backend(gm, example_inputs):
        nonlocal graphs
        graphs += 1
        return gm.forward

    compiled = torch.compile(fn, backend=backend)
    for x in inputs:
        compiled(x)
    return graphs


def count_calls(fn, inputs):
    return len(inputs)


def count_with_explain(fn, inputs):
    return sum(torch._dynamo.explain(fn)(x).graph_count for x in inputs)


def count_with_backend_returning_none(fn, inputs):
    torch.compiler.reset()
    compiled = torch.compile(fn, backend=lambda gm, example_inputs: None)
    for x in inputs:
        compiled(x)
    return 0


def count_as_tensor(fn, inputs):
    return torch.tensor(L.count_compiles(fn, inputs))


def mark_returns_none(x):
    return torch._dynamo.mark_dynamic(x, 0)


def mark_dimension_1(x):
    torch._dynamo.mark_dynamic(x, 1)
    return x


def mark_then_clone(x):
    torch._dynamo.mark_dynamic(x, 0)
    return x.clone()


def maybe_mark(x):  # a correct alternative
    torch._dynamo.maybe_mark_dynamic(x, 0)
    return x


WRONG = [
    (L.check_compile_for_inference, inference_in_place, None),
    (L.check_compile_for_inference, lambda model, example: model, "torch.compile was never called"),
    (L.check_compile_for_inference, inference_returns_compile_result, "returned None.*model.compile\\(\\) compiles in place"),
    (L.check_compile_for_inference, inference_not_warmed_up, "torch.compile is lazy.*warm"),
    (L.check_compile_for_inference, inference_warmed_with_grad, "gradients on.*torch.no_grad"),
    (L.check_compile_for_inference, inference_eval_after_warm_up, "warm-up ran in train mode.*model.eval\\(\\) before"),
    (L.check_compile_for_inference, inference_without_eval, "still in train mode.*model.eval\\(\\)"),
    (L.check_compile_for_inference, inference_compiles_in_forward, "torch.compile ran again while the model ran"),
    (L.check_compile_for_inference, lambda model, example: L.compile_for_inference(copy.deepcopy(model), example), "its own copy of the weights"),
    (L.check_compile_for_inference, lambda model, example: L.compile_for_inference(model, example).forward, "expected a torch.nn.Module"),
    (L.check_compiled_train_step, step_with_compiled_decorator, None),
    (L.check_compiled_train_step, step_uncompiled, "torch.compile was never called"),
    (L.check_compiled_train_step, step_compiles_every_call, "torch.compile ran inside the step"),
    (L.check_compiled_train_step, step_compiles_the_model_only, "compiled the model only"),
    (L.check_compiled_train_step, step_returns_item, "Python float: .item\\(\\) inside a compiled function is a graph break"),
    (L.check_compiled_train_step, step_without_detach, "still requires grad.*loss.detach\\(\\)"),
    (L.check_compiled_train_step, step_without_zero_grad, "gradients accumulate.*zero_grad"),
    (L.check_compiled_train_step, step_without_optimizer_step, "weights did not change"),
    (L.check_compiled_train_step, lambda model, loss_fn, optimizer: None, "returned None"),
    (L.check_no_break_gelu, gelu_with_where, None),
    (L.check_no_break_gelu, gelu_builtin_tanh, None),
    (L.check_no_break_gelu, gelu_with_item, "1 graph break.*\\.item\\(\\) turns a tensor into a Python number"),
    (L.check_no_break_gelu, gelu_with_if, "1 graph break.*Python `if` on a tensor"),
    (L.check_no_break_gelu, gelu_with_print, "1 graph break.*print\\(\\) cannot be traced"),
    (L.check_no_break_gelu, lambda x: L.gelu(x.clamp(-4, 4)), "clamp clips each value"),
    (L.check_no_break_gelu, lambda x: L.gelu(x), "was not scaled"),
    (L.check_no_break_gelu, gelu_exact_erf, "exact \\(erf\\) GELU.*tanh approximation"),
    (L.check_count_compiles, count_without_reset, "second run.*torch.compiler.reset\\(\\)"),
    (L.check_count_compiles, count_calls, "number of calls; count graphs"),
    (L.check_count_compiles, count_with_explain, "explain resets Dynamo on every call"),
    (L.check_count_compiles, count_with_backend_returning_none, "raised BackendCompilerFailed.*return gm.forward"),
    (L.check_count_compiles, count_as_tensor, "expected a Python int"),
    (L.check_count_compiles, lambda fn, inputs: None, "returned None"),
    (L.check_mark_batch_dynamic, maybe_mark, None),
    (L.check_mark_batch_dynamic, mark_returns_none, "returned None.*return x"),
    (L.check_mark_batch_dynamic, lambda x: x, "compiled 2 graphs, expected 1"),
    (L.check_mark_batch_dynamic, mark_dimension_1, "marked dimension 1.*batch is dimension 0"),
    (L.check_mark_batch_dynamic, mark_then_clone, "compiled 2 graphs, expected 1.*on the tensor you return"),
    (L.check_mark_batch_dynamic, lambda x: x * 2, "wrong values"),
]


@pytest.mark.parametrize("check, wrong, message", WRONG)
def test_wrong_answers_name_the_fault(check, wrong, message):
    assert_names_fault(check, wrong, message)


RAISING = [  # errors inside the learner's code: one line, arguments named briefly
    (L.check_compile_for_inference, lambda model, example: model(example, example), r"^compile_for_inference: <lambda>\(model, example of shape \(8, 6\)\) raised TypeError"),
    (L.check_compiled_train_step, lambda model, loss_fn, optimizer: loss_fn(model), r"^compiled_train_step: <lambda>\(model, F.cross_entropy, optimizer\) raised TypeError"),
    (L.check_no_break_gelu, lambda x: x @ torch.ones(2), r"^no_break_gelu: <lambda>\(tensor of shape \(6, 5\)\) raised RuntimeError"),
    (L.check_count_compiles, lambda fn, inputs: fn(inputs), r"^count_compiles: <lambda>\(a function with one print\(\), on one batch of 8\) raised"),
    (L.check_mark_batch_dynamic, lambda x: x.reshape(5, -1), r"^mark_batch_dynamic: <lambda>\(tensor of shape \(8, 6\)\) raised RuntimeError"),
]


@pytest.mark.parametrize("check, wrong, message", RAISING)
def test_errors_inside_the_learners_code_are_one_short_line(check, wrong, message):
    with pytest.raises(ExerciseFailed, match=message) as info:
        check(wrong)
    assert "\n" not in str(info.value) and len(str(info.value)) < 300


@pytest.mark.parametrize("check, reference", PAIRS, ids=[r.__name__ for _, r in PAIRS])
def test_checks_leave_the_learners_state_alone(check, reference):
    """The checks restore the global RNG, torch.compile itself and Dynamo's log level, however they end."""
    compile_before = torch.compile
    level_before = logging.getLogger("torch._dynamo").level
    for answer in (reference, lambda *args: None):
        torch.manual_seed(7)
        expected = torch.rand(3)
        torch.manual_seed(7)
        try:
            check(answer)
        except ExerciseFailed:
            pass
        assert torch.equal(torch.rand(3), expected)
        assert torch.compile is compile_before
        assert logging.getLogger("torch._dynamo").level == level_before


@pytest.mark.parametrize("check, reference", PAIRS, ids=[r.__name__ for _, r in PAIRS])
def test_checks_pass_again_and_again(check, reference):
    """Each check compiles with a backend of its own; run past Dynamo's recompile limit, they still judge the same."""
    with torch._dynamo.config.patch(recompile_limit=2):  # a low limit, to reach it in a few runs
        for _ in range(3):
            check(reference)


def test_references_behave_as_the_lesson_says():
    """The counts and break-free claims the notebook prints come from these references."""
    assert L.count_compiles(L._smooth, [torch.randn(n, 3) for n in (8, 16, 32)]) == 2
    assert L.count_compiles(L._with_print, [torch.randn(8, 3)]) == 2
    marked = [L.mark_batch_dynamic(torch.randn(n, 3)) for n in (8, 16, 32)]
    assert L.count_compiles(L._smooth, marked) == 1
    explained = torch._dynamo.explain(L.no_break_gelu)(10 * torch.randn(5))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)


NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "solutions" / "07_compile.ipynb"


def _notebook_code() -> list[str]:
    return [c.source for c in nbformat.read(NOTEBOOK, as_version=4).cells if c.cell_type == "code"]


def test_non_default_modes_run_only_in_gpu_cells():
    """reduce-overhead and max-autotune gain nothing on a CPU and cost a long compile: GPU cells only."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code" and ("reduce-overhead" in cell.source or "max-autotune" in cell.source):
            assert "gpu" in cell.metadata.get("tags", []) and cell.source.startswith("%%gpu"), cell.source[:80]
