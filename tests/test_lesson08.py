"""Lesson 08's checks against the reference solutions and the wrong answers learners write."""

import re
import warnings
from pathlib import Path

import nbformat
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from course_utils import lesson08 as L
from course_utils.tooling.checks import ExerciseFailed
from lesson_contract import assert_names_fault, contract_tests

PAIRS = [
    (L.check_capture_activations, L.capture_activations),
    (L.check_grad_norms, L.grad_norms),
    (L.check_clip_tensor_grad, L.clip_tensor_grad),
    (L.check_find_nan_op, L.find_nan_op),
    (L.check_slowest_op, L.slowest_op),
    (L.check_checkpointed_forward, L.checkpointed_forward),
]

(test_reference_passes, test_stub_is_not_attempted, test_bad_input_is_one_named_line, test_hostile_answers_are_the_learners_fault,
 test_checks_leave_the_learners_random_state_alone, test_checks_are_quick) = contract_tests(PAIRS, max_seconds=1.0)


# Typical wrong answers, one function each.

def capture_without_remove(model, x, names):
    modules, captured = dict(model.named_modules()), {}
    for name in names:
        modules[name].register_forward_hook(lambda m, a, o, name=name: captured.__setitem__(name, o.detach()))
    model(x)
    return captured


def capture_without_detach(model, x, names):
    modules, captured, handles = dict(model.named_modules()), {}, []
    for name in names:
        handles.append(modules[name].register_forward_hook(lambda m, a, o, name=name: captured.__setitem__(name, o)))
    model(x)
    for h in handles:
        h.remove()
    return captured


def capture_late_binding(model, x, names):
    modules, captured, handles = dict(model.named_modules()), {}, []
    for name in names:
        def hook(m, a, o):
            captured[name] = o.detach()  # `name` is read when the hook runs: always the last one
        handles.append(modules[name].register_forward_hook(hook))
    model(x)
    for h in handles:
        h.remove()
    return captured


def capture_inputs(model, x, names):
    modules, captured, handles = dict(model.named_modules()), {}, []
    for name in names:
        handles.append(modules[name].register_forward_hook(lambda m, a, o, name=name: captured.__setitem__(name, a[0].detach())))
    model(x)
    for h in handles:
        h.remove()
    return captured


def capture_input_tuples(model, x, names):
    modules, captured, handles = dict(model.named_modules()), {}, []
    for name in names:
        handles.append(modules[name].register_forward_hook(lambda m, a, o, name=name: captured.__setitem__(name, a)))
    with torch.no_grad():
        model(x)
    for h in handles:
        h.remove()
    return captured


def capture_by_index(model, x, names):
    result = L.capture_activations(model, x, names)
    return {i: v for i, v in enumerate(result.values())}


def capture_under_no_grad(model, x, names):  # a correct alternative
    with torch.no_grad():
        return L.capture_activations(model, x, names)


def capture_with_pre_hooks_left(model, x, names):
    result = L.capture_activations(model, x, names)
    model.register_forward_pre_hook(lambda m, a: None)
    return result


def norms_of_weights(model, x, y, loss_fn):
    model.zero_grad()
    loss_fn(model(x), y).backward()
    return {name: p.detach().norm().item() for name, p in model.named_parameters()}


def norms_without_zero_grad(model, x, y, loss_fn):
    loss_fn(model(x), y).backward()
    return {name: p.grad.norm().item() for name, p in model.named_parameters()}


def norms_as_tensors(model, x, y, loss_fn):
    model.zero_grad()
    loss_fn(model(x), y).backward()
    return {name: p.grad.norm() for name, p in model.named_parameters()}


def norms_of_weights_only(model, x, y, loss_fn):
    return {k: v for k, v in L.grad_norms(model, x, y, loss_fn).items() if k.endswith("weight")}


def norms_squared(model, x, y, loss_fn):
    return {k: v**2 for k, v in L.grad_norms(model, x, y, loss_fn).items()}


def norms_with_hooks(model, x, y, loss_fn):  # a correct alternative: gradients read in tensor hooks
    model.zero_grad()
    result, handles = {}, []
    for name, p in model.named_parameters():
        handles.append(p.register_hook(lambda g, name=name: result.__setitem__(name, g.norm().item())))
    loss_fn(model(x), y).backward()
    for h in handles:
        h.remove()
    return result


def clip_in_place(t, max_abs):
    def hook(grad):
        grad.clamp_(-max_abs, max_abs)
    return t.register_hook(hook)


def clip_upper_only(t, max_abs):
    return t.register_hook(lambda g: g.clamp(max=max_abs))


def clip_by_norm(t, max_abs):
    return t.register_hook(lambda g: g * max_abs / g.norm())


def clip_without_returning(t, max_abs):
    return t.register_hook(lambda g: None)


def clip_no_handle(t, max_abs):
    t.register_hook(lambda g: g.clamp(-max_abs, max_abs))


def clip_returns_a_function(t, max_abs):
    hook = lambda g: g.clamp(-max_abs, max_abs)  # noqa: E731
    t.register_hook(hook)
    return hook


def clip_two_hooks(t, max_abs):  # the handle removes only the second, identical hook: the first keeps clipping
    t.register_hook(lambda g: g.clamp(-max_abs, max_abs))
    return t.register_hook(lambda g: g.clamp(-max_abs, max_abs))


def clip_with_torch_clamp(t, max_abs):  # a correct alternative
    return t.register_hook(lambda g: torch.clamp(g, min=-max_abs, max=max_abs))


def nan_without_anomaly(fn, x):
    x = x.detach().requires_grad_()
    fn(x).sum().backward()
    return None


def nan_full_message(fn, x):
    x = x.detach().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with torch.autograd.detect_anomaly():
                fn(x).sum().backward()
        except RuntimeError as err:
            return str(err)
    return None


def nan_not_caught(fn, x):
    x = x.detach().requires_grad_()
    with torch.autograd.detect_anomaly():
        fn(x).sum().backward()
    return None


def nan_left_on(fn, x):
    torch.autograd.set_detect_anomaly(True)
    x = x.detach().requires_grad_()
    try:
        fn(x).sum().backward()
    except RuntimeError as err:
        return re.search(r"'(\w+)'", str(err)).group(1)
    return None


def nan_on_callers_tensor(fn, x):
    x.requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with torch.autograd.detect_anomaly():
                fn(x).sum().backward()
        except RuntimeError as err:
            return re.search(r"'(\w+)'", str(err)).group(1)
    return None


def nan_without_sum(fn, x):
    x = x.detach().requires_grad_()
    with torch.autograd.detect_anomaly():
        fn(x).backward()


def nan_forward_name(fn, x):
    name = L.find_nan_op(fn, x)
    return None if name is None else name.removesuffix("Backward0").lower()


def nan_empty_string(fn, x):
    return L.find_nan_op(fn, x) or ""


def slowest_by_total(prof):
    return max(prof.key_averages(), key=lambda e: e.cpu_time_total).key


def slowest_min(prof):
    return min(prof.key_averages(), key=lambda e: e.self_cpu_time_total).key


def slowest_per_call(prof):
    return max(prof.key_averages(), key=lambda e: e.self_cpu_time_total / e.count).key


def slowest_first_row(prof):
    return prof.key_averages()[0].key


def slowest_event(prof):
    return max(prof.key_averages(), key=lambda e: e.self_cpu_time_total)


def slowest_sorted(prof):  # a correct alternative
    return sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[0].key


def forward_plain(blocks, x):
    for block in blocks:
        x = block(x)
    return x


def forward_reentrant(blocks, x):
    for block in blocks:
        x = checkpoint(block, x, use_reentrant=True)
    return x


def forward_default_reentrant(blocks, x):
    for block in blocks:
        x = checkpoint(block, x)
    return x


def forward_reentrant_with_grad_input(blocks, x):
    x = x.requires_grad_()
    for block in blocks:
        x = checkpoint(block, x, use_reentrant=True)
    return x


def forward_one_checkpoint(blocks, x):  # a correct alternative: the whole stack in one checkpoint
    return checkpoint(nn.Sequential(*blocks), x, use_reentrant=False)


def forward_skips_last(blocks, x):
    for block in blocks[:-1]:
        x = checkpoint(block, x, use_reentrant=False)
    return x


def forward_detached(blocks, x):
    with torch.no_grad():
        out = L.checkpointed_forward(blocks, x)
    return out


WRONG = [
    (L.check_capture_activations, capture_without_remove, "left hooks on .*handle.remove\\(\\)"),
    (L.check_capture_activations, capture_with_pre_hooks_left, "left hooks on \\['the model itself'\\]"),
    (L.check_capture_activations, capture_without_detach, "still requires grad.*output.detach\\(\\)"),
    (L.check_capture_activations, capture_late_binding, "only the key 'head'.*name=name"),
    (L.check_capture_activations, capture_inputs, "is the module's input.*store output"),
    (L.check_capture_activations, capture_input_tuples, "is a tuple: store the hook's output"),
    (L.check_capture_activations, capture_by_index, "returned the keys \\[0, 1, 2\\]"),
    (L.check_capture_activations, lambda m, x, n: list(L.capture_activations(m, x, n).values()), "expected a dict"),
    (L.check_capture_activations, lambda m, x, n: None, "returned None"),
    (L.check_capture_activations, capture_under_no_grad, None),
    (L.check_grad_norms, norms_of_weights, "norms of the parameters themselves.*p.grad"),
    (L.check_grad_norms, norms_without_zero_grad, "doubled on its second call.*zero_grad"),
    (L.check_grad_norms, norms_as_tensors, "is a tensor.*\\.item\\(\\)"),
    (L.check_grad_norms, norms_of_weights_only, "returned the keys .*named_parameters"),
    (L.check_grad_norms, norms_squared, "expected"),
    (L.check_grad_norms, lambda m, x, y, f: None, "returned None"),
    (L.check_grad_norms, norms_with_hooks, None),
    (L.check_clip_tensor_grad, clip_in_place, "in place.*grad.clamp"),
    (L.check_clip_tensor_grad, clip_upper_only, "below -max_abs were not clipped"),
    (L.check_clip_tensor_grad, clip_by_norm, "rescaled to norm max_abs.*clamp each element"),
    (L.check_clip_tensor_grad, clip_without_returning, "was not clipped.*return grad.clamp"),
    (L.check_clip_tensor_grad, clip_no_handle, "returned None: return the handle"),
    (L.check_clip_tensor_grad, clip_returns_a_function, "returned a function: return the handle"),
    (L.check_clip_tensor_grad, clip_two_hooks, "after handle.remove\\(\\), the gradient was still clipped"),
    (L.check_clip_tensor_grad, clip_with_torch_clamp, None),
    (L.check_find_nan_op, nan_without_anomaly, "returned None, but its gradient has NaN.*detect_anomaly"),
    (L.check_find_nan_op, nan_full_message, "return only the function's name, 'PowBackward0'"),
    (L.check_find_nan_op, nan_not_caught, "raised RuntimeError.*catch the RuntimeError"),
    (L.check_find_nan_op, nan_left_on, "anomaly detection is still on.*context manager"),
    (L.check_find_nan_op, nan_on_callers_tensor, "caller's tensor.*x.detach\\(\\).requires_grad_\\(\\)"),
    (L.check_find_nan_op, nan_without_sum, "raised RuntimeError.*fn\\(x\\).sum\\(\\)"),
    (L.check_find_nan_op, nan_forward_name, "returned the forward op 'pow'.*'PowBackward0'"),
    (L.check_find_nan_op, nan_empty_string, "returned '', expected None"),
    (L.check_slowest_op, slowest_by_total, "largest \\*total\\* CPU time.*self_cpu_time_total"),
    (L.check_slowest_op, slowest_min, "the fastest operator"),
    (L.check_slowest_op, slowest_per_call, "slowest per call"),
    (L.check_slowest_op, slowest_first_row, "the first event: key_averages\\(\\) is not sorted"),
    (L.check_slowest_op, slowest_event, "whole FunctionEventAvg: return its name, event.key"),
    (L.check_slowest_op, lambda prof: None, "returned None"),
    (L.check_slowest_op, slowest_sorted, None),
    (L.check_checkpointed_forward, forward_plain, "as many as without checkpointing.*checkpoint\\(block, x, use_reentrant=False\\)"),
    (L.check_checkpointed_forward, forward_reentrant, "no graph: with use_reentrant=True.*pass use_reentrant=False"),
    (L.check_checkpointed_forward, forward_default_reentrant, "no graph: with use_reentrant=True.*pass use_reentrant=False"),
    (L.check_checkpointed_forward, forward_skips_last, "expected shape|wrong values"),
    (L.check_checkpointed_forward, forward_detached, "does not require grad: autograd did not record"),
    (L.check_checkpointed_forward, forward_reentrant_with_grad_input, "reentrant checkpoint \\(use_reentrant=True\\).*use_reentrant=False"),
    (L.check_checkpointed_forward, lambda blocks, x: None, "returned None"),
    (L.check_checkpointed_forward, lambda blocks, x: checkpoint(blocks, x, use_reentrant=False), "called the nn.ModuleList itself.*for block in blocks"),
    (L.check_checkpointed_forward, forward_one_checkpoint, None),
]


@pytest.mark.parametrize("check, wrong, message", WRONG, ids=[f"{c.exercise_name}-{getattr(w, '__name__', 'lambda')}-{i}" for i, (c, w, m) in enumerate(WRONG)])
def test_wrong_answers_name_the_fault(check, wrong, message):
    assert_names_fault(check, wrong, message)


def test_checks_print_no_warnings(recwarn, capsys):
    """Anomaly mode, the profiler and checkpoint all warn; the checks keep every warning out of the learner's output."""
    for check, reference in PAIRS:
        check(reference)
    assert not [str(w.message) for w in recwarn.list]
    assert capsys.readouterr().err == ""


def test_find_nan_op_check_restores_anomaly_mode_after_a_failure():
    with pytest.raises(ExerciseFailed):
        L.check_find_nan_op(nan_left_on)
    assert not torch.is_anomaly_enabled()


def test_capture_check_leaves_the_hidden_model_clean_after_a_leak():
    with pytest.raises(ExerciseFailed, match="left hooks"):
        L.check_capture_activations(capture_without_remove)
    # the next, correct run must not see the previous hooks
    L.check_capture_activations(L.capture_activations)


RAISING = [  # errors inside the learner's code: one line, arguments named briefly
    (L.check_capture_activations, lambda m, x, n: m(n), r"^capture_activations: <lambda>\(model, tensor of shape \(5, 6\), \['stem', 'block.1', 'head'\]\) raised TypeError"),
    (L.check_grad_norms, lambda m, x, y, f: f(m(y), x), r"^grad_norms: <lambda>\(model, inputs of shape \(9, 5\), targets of shape \(9,\), F.cross_entropy\) raised RuntimeError"),
    (L.check_clip_tensor_grad, lambda t, c: t.clamp_(-c, c), r"^clip_tensor_grad: <lambda>\(t, 1.0\) raised RuntimeError"),
    (L.check_clip_tensor_grad, lambda t, c: t.register_hook(lambda g: g.sum()), r"^clip_tensor_grad: backward\(\) through the hook of clip_tensor_grad\(t, 1.0\) raised RuntimeError"),
    (L.check_slowest_op, lambda prof: prof.key_averages().missing, r"^slowest_op: <lambda>\(prof\) raised AttributeError"),
    (L.check_checkpointed_forward, lambda blocks, x: blocks[0](x[:, :3]), r"^checkpointed_forward: <lambda>\(blocks, tensor of shape \(8, 16\)\) raised RuntimeError"),
]


@pytest.mark.parametrize("check, wrong, message", RAISING, ids=[c.exercise_name for c, _, _ in RAISING])
def test_errors_inside_the_learners_code_are_one_short_line(check, wrong, message):
    with pytest.raises(ExerciseFailed, match=message) as info:
        check(wrong)
    assert "\n" not in str(info.value) and len(str(info.value)) < 300


def test_saved_activation_bytes_counts_distinct_storages_without_parameters():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8, bias=False), nn.ReLU(), nn.Linear(8, 2, bias=False))
    x = torch.randn(5, 4)
    _, nbytes = L.saved_activation_bytes(lambda: net(x), net.parameters())
    # Linear 1 saves x (5x4); ReLU saves its result (5x8), which Linear 2 saves too: one storage.
    assert nbytes == (5 * 4 + 5 * 8) * 4


NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "solutions" / "08_hooks.ipynb"


def _notebook_code() -> list[str]:
    return [c.source for c in nbformat.read(NOTEBOOK, as_version=4).cells if c.cell_type == "code"]


def test_the_notebooks_saved_activation_counter_is_the_checks():
    """The notebook teaches saved_activation_bytes; the check of checkpointed_forward counts with the same code."""
    import inspect

    source = next(c for c in _notebook_code() if "def saved_activation_bytes(" in c)
    reference = inspect.getsource(L.saved_activation_bytes)
    strip = lambda text: [line.split("#")[0].rstrip() for line in text.splitlines() if line.split("#")[0].strip()]  # noqa: E731
    assert strip(reference) == strip(source.split("\n\n\nparam_bytes")[0])
