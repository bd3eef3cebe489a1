"""Lesson 02's checks against the reference solutions, correct answers written differently, and the wrong answers learners write."""

import collections
import re
import warnings

import matplotlib
import matplotlib.pyplot
import matplotlib.text
import pytest
import torch
from lesson_contract import assert_names_fault, assert_passes, contract_tests

from course_utils import lesson02 as L
from course_utils.tooling.checks import ExerciseFailed, ExerciseNotAttempted

matplotlib.use("Agg")

PAIRS = [
    (L.check_count_ops, L.count_ops),
    (L.check_jacobian, L.jacobian),
    (L.check_grad_at, L.grad_at),
    (L.check_frozen_features, L.frozen_features),
    (L.check_leaky_relu, L.leaky_relu),
    (L.check_round_ste, L.round_ste),
    (L.check_nan_culprit, L.nan_culprit),
]


(test_reference_passes, test_stub_is_not_attempted, test_bad_input_is_one_named_line, test_hostile_answers_are_the_learners_fault,
 test_checks_leave_the_learners_random_state_alone, test_checks_are_quick) = contract_tests(PAIRS)


# count_ops

def _nodes(t):
    """Every node of t's graph once (a helper for the answers below)."""
    found, todo = [], [t.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and node not in found:
            found.append(node)
            todo += [parent for parent, _ in node.next_functions]
    return found


def count_recursive(t):  # correct: recursion, a seen set, a Counter
    seen, counts = set(), collections.Counter()

    def visit(node):
        if node is None or node in seen:
            return
        seen.add(node)
        if not hasattr(node, "variable"):
            counts[type(node).__name__] += 1
        for parent, _ in node.next_functions:
            visit(parent)

    visit(t.grad_fn)
    return counts


def count_bfs_names(t):  # correct: breadth first, node.name(), a defaultdict
    counts = collections.defaultdict(int)
    if t.grad_fn is None:
        return {}
    seen, queue = {t.grad_fn}, collections.deque([t.grad_fn])
    while queue:
        node = queue.popleft()
        if "AccumulateGrad" not in node.name():
            counts[node.name()] += 1
        for parent, _ in node.next_functions:
            if parent is not None and parent not in seen:
                seen.add(parent)
                queue.append(parent)
    return counts


def count_collect_then_count(t):  # correct: collect the nodes, then count their kinds
    return dict(collections.Counter(type(n).__name__ for n in _nodes(t) if type(n).__name__ != "AccumulateGrad"))


def count_per_path(t):
    def visit(node):
        if node is None:
            return collections.Counter()
        counts = collections.Counter() if hasattr(node, "variable") else collections.Counter([type(node).__name__])
        for parent, _ in node.next_functions:
            counts += visit(parent)
        return counts

    return dict(visit(t.grad_fn))


def count_kinds_once(t):
    return {type(n).__name__: 1 for n in _nodes(t) if type(n).__name__ != "AccumulateGrad"}


def count_with_accumulate(t):
    return dict(collections.Counter(type(n).__name__ for n in _nodes(t)))


def count_with_none(t):
    counts = collections.Counter()
    seen, todo = set(), [t.grad_fn] if t.grad_fn is not None else []
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        if type(node).__name__ != "AccumulateGrad":
            counts[type(node).__name__] += 1  # None too, as 'NoneType'
        if node is not None:
            todo += [parent for parent, _ in node.next_functions]
    return dict(counts)


def count_without_root(t):
    counts = count_collect_then_count(t)
    if t.grad_fn is not None:
        counts[type(t.grad_fn).__name__] -= 1
    return {k: n for k, n in counts.items() if n}


def count_one_level(t):
    counts = collections.Counter([type(t.grad_fn).__name__]) if t.grad_fn is not None else collections.Counter()
    for parent, _ in (t.grad_fn.next_functions if t.grad_fn is not None else ()):
        if parent is not None and type(parent).__name__ != "AccumulateGrad":
            counts[type(parent).__name__] += 1
    return dict(counts)


def count_after_backward(t):
    if t.requires_grad:
        t.sum().backward(retain_graph=True)
    return L.count_ops(t)


def count_no_leaf_guard(t):
    counts, seen, todo = {}, set(), [t.grad_fn]
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        if type(node).__name__ != "AccumulateGrad":
            counts[type(node).__name__] = counts.get(type(node).__name__, 0) + 1
        todo += [p for p, _ in node.next_functions if p is not None]
    return counts


def count_list_of_names(t):
    return [type(n).__name__ for n in _nodes(t) if type(n).__name__ != "AccumulateGrad"]


def count_node_keys(t):
    return {n: 1 for n in _nodes(t) if type(n).__name__ != "AccumulateGrad"}


def count_str_keys(t):
    return dict(collections.Counter(str(n) for n in _nodes(t) if type(n).__name__ != "AccumulateGrad"))


def count_class_keys(t):
    return dict(collections.Counter(type(n) for n in _nodes(t) if type(n).__name__ != "AccumulateGrad"))


def count_float_values(t):
    return {k: float(n) for k, n in L.count_ops(t).items()}


def count_first_inputs_only(t):
    counts, node = collections.Counter(), t.grad_fn
    while node is not None and not hasattr(node, "variable"):
        counts[type(node).__name__] += 1
        node = node.next_functions[0][0] if node.next_functions else None
    return dict(counts)


def count_on_discovery(t):  # counts a node each time next_functions lists it, walks on from it once
    if t.grad_fn is None:
        return {}
    counts, seen, todo = collections.Counter([type(t.grad_fn).__name__]), {t.grad_fn}, [t.grad_fn]
    while todo:
        for parent, _ in todo.pop().next_functions:
            if parent is None or hasattr(parent, "variable"):
                continue
            counts[type(parent).__name__] += 1
            if parent not in seen:
                seen.add(parent)
                todo.append(parent)
    return dict(counts)


def count_skips_repeated_kinds(t):  # skips a node whose kind it has seen, and so never walks past it
    counts, names, node = collections.Counter(), set(), t.grad_fn
    todo = [node] if node is not None else []
    while todo:
        node = todo.pop()
        if type(node).__name__ in names and type(node).__name__ != "AccumulateGrad":
            continue
        names.add(type(node).__name__)
        if type(node).__name__ != "AccumulateGrad":
            counts[type(node).__name__] += 1
        todo += [p for p, _ in node.next_functions if p is not None]
    return dict(counts)


def count_through_autograd_grad(t):
    leaves = [n.variable for n in _nodes(t) if hasattr(n, "variable")]
    if leaves:
        torch.autograd.grad(t.sum(), leaves)  # frees the graph, fills no .grad
    return L.count_ops(t)


# jacobian

def jac_is_grads_batched(y, x):  # correct: all rows in one batched call
    (rows,) = torch.autograd.grad(y, x, torch.eye(len(y), dtype=y.dtype), retain_graph=True, is_grads_batched=True)
    return rows


def jac_backward_restoring(y, x):  # correct: backward() into x alone, x.grad restored afterwards
    saved, rows = x.grad, []
    for i in range(len(y)):
        x.grad = None
        y[i].backward(retain_graph=True, inputs=[x])
        rows.append(x.grad.clone())
    x.grad = saved
    return torch.stack(rows)


def jac_fill_rows(y, x):  # correct: a preallocated matrix of x's dtype, one-hot vectors
    out = torch.zeros(len(y), len(x), dtype=x.dtype)
    for i in range(len(y)):
        v = torch.zeros_like(y)
        v[i] = 1
        out[i] = torch.autograd.grad(y, x, v, retain_graph=True)[0]
    return out


def jac_no_retain(y, x):
    return torch.stack([torch.autograd.grad(y, x, v)[0] for v in torch.eye(len(y), dtype=y.dtype)])


def jac_retain_all_but_last(y, x):
    rows = []
    for i, v in enumerate(torch.eye(len(y), dtype=y.dtype)):
        rows.append(torch.autograd.grad(y, x, v, retain_graph=i < len(y) - 1)[0])
    return torch.stack(rows)


def jac_cumulative(y, x):  # backward() into x alone, .grad restored, but never cleared between rows
    saved, rows = x.grad, []
    x.grad = None
    for v in torch.eye(len(y), dtype=y.dtype):
        y.backward(v, retain_graph=True, inputs=[x])
        rows.append(x.grad.clone())
    x.grad = saved
    return torch.stack(rows)


def jac_ones_rows(y, x):
    return torch.stack([torch.autograd.grad(y, x, torch.ones_like(y), retain_graph=True)[0] for _ in range(len(y))])


def jac_transposed(y, x):
    return torch.stack([torch.autograd.grad(y, x, v, retain_graph=True)[0] for v in torch.eye(len(y), dtype=y.dtype)], dim=1)


def jac_backward_clearing(y, x):  # reads x.grad, clears it between rows, and leaves it None
    rows = []
    for v in torch.eye(len(y), dtype=y.dtype):
        x.grad = None
        y.backward(v, retain_graph=True)
        rows.append(x.grad.clone())
    x.grad = None
    return torch.stack(rows)


def jac_backward_accumulating(y, x):
    rows = []
    for v in torch.eye(len(y), dtype=y.dtype):
        y.backward(v, retain_graph=True)
        rows.append(x.grad.clone())
    return torch.stack(rows)


def jac_backward_other_leaves(y, x):  # x.grad saved and restored, but every other leaf's .grad grows
    saved, rows = x.grad, []
    for i in range(len(y)):
        x.grad = None
        y[i].backward(retain_graph=True)
        rows.append(x.grad.clone())
    x.grad = saved
    return torch.stack(rows)


def jac_create_graph(y, x):
    return torch.stack([torch.autograd.grad(y, x, v, retain_graph=True, create_graph=True)[0] for v in torch.eye(len(y), dtype=y.dtype)])


def jac_float32(y, x):
    out = torch.zeros(len(y), len(x))
    for i, v in enumerate(torch.eye(len(y), dtype=y.dtype)):
        out[i] = torch.autograd.grad(y, x, v, retain_graph=True)[0]
    return out


def jac_batched_freed(y, x):
    return torch.autograd.grad(y, x, torch.eye(len(y), dtype=y.dtype), is_grads_batched=True)[0]


def jac_wrong_v_shape(y, x):
    return torch.stack([torch.autograd.grad(y, x, torch.ones_like(x), retain_graph=True)[0] for _ in range(len(y))])


# grad_at

def grad_at_accumulates(f, x):
    x.requires_grad_()
    f(x).backward()
    return x.grad


def grad_at_mutates_flag(f, x):
    x.requires_grad_()
    (grad,) = torch.autograd.grad(f(x), x)
    return grad


def grad_at_through_clone(f, x):
    x = x.clone().requires_grad_()
    f(x).backward()
    return x.grad


def grad_at_keeps_graph(f, x):
    x = x.detach().requires_grad_()
    (grad,) = torch.autograd.grad(f(x), x, create_graph=True)
    return grad


def grad_at_no_leaf(f, x):
    f(x).backward()
    return x.grad


def grad_at_stale(f, x):
    x = x if x.requires_grad else x.detach().requires_grad_()
    f(x).backward()
    return x.grad.clone()


def grad_at_clears_caller(f, x):
    x = x if x.requires_grad else x.detach().requires_grad_()
    x.grad = None
    f(x).backward()
    return x.grad.clone()


def grad_at_numeric(f, x):  # a finite difference: right to ~1e-2 only
    eps = 1e-2
    return torch.stack([(f(x + eps * e) - f(x - eps * e)) / (2 * eps) for e in torch.eye(len(x), dtype=x.dtype)])


def grad_at_float32(f, x):
    leaf = x.detach().float().requires_grad_()
    return torch.autograd.grad(f(leaf), leaf)[0]


def grad_at_backward_on_copy(f, x):  # correct: a detached copy, backward(), its .grad
    leaf = x.detach().clone().requires_grad_(True)
    f(leaf).backward()
    return leaf.grad


def grad_at_func(f, x):  # correct: torch.func.grad
    return torch.func.grad(f)(x.detach())


def grad_at_enable_grad(f, x):  # correct: works even when called under no_grad
    with torch.enable_grad():
        leaf = x.detach().requires_grad_(True)
        out = f(leaf)
    return torch.autograd.grad(out, [leaf])[0].detach()


# frozen_features

def _batches(x, batch_size):
    return [x[i : i + batch_size] for i in range(0, len(x), batch_size)]


def ff_split_decorator(encoder, x, batch_size):  # correct: x.split and the decorator form of no_grad
    @torch.no_grad()
    def encode(t):
        return encoder(t)

    return torch.cat([encode(part) for part in x.split(batch_size)])


def ff_inference_then_cat(encoder, x, batch_size):  # correct, though not what the lesson advises: cat runs outside
    with torch.inference_mode():
        parts = [encoder(part) for part in _batches(x, batch_size)]
    return torch.cat(parts)  # a normal tensor: made outside inference mode


def ff_preallocated(encoder, x, batch_size):  # correct: set_grad_enabled(False) as a block, results copied into place
    out = None
    with torch.set_grad_enabled(False):
        for start in range(0, x.shape[0], batch_size):
            part = encoder(x[start : start + batch_size])
            if out is None:
                out = torch.empty(x.shape[0], part.shape[1], dtype=part.dtype)
            out[start : start + len(part)] = part
    return out


def ff_whole(encoder, x, batch_size):
    with torch.no_grad():
        return encoder(x)


def ff_drops_last(encoder, x, batch_size):
    with torch.no_grad():
        return torch.cat([encoder(x[i * batch_size : (i + 1) * batch_size]) for i in range(len(x) // batch_size)])


def ff_overlapping(encoder, x, batch_size):
    with torch.no_grad():
        return torch.cat([encoder(x[i : i + batch_size]) for i in range(0, len(x), batch_size - 1 or 1)])


def ff_recording(encoder, x, batch_size):
    return torch.cat([encoder(part) for part in _batches(x, batch_size)])


def ff_detach_after(encoder, x, batch_size):
    return torch.cat([encoder(part) for part in _batches(x, batch_size)]).detach()


def ff_inference_tensor(encoder, x, batch_size):
    with torch.inference_mode():
        return torch.cat([encoder(part) for part in _batches(x, batch_size)])


def ff_list(encoder, x, batch_size):
    with torch.no_grad():
        return [encoder(part) for part in _batches(x, batch_size)]


def ff_requires_grad(encoder, x, batch_size):
    return L.frozen_features(encoder, x, batch_size).requires_grad_()


def ff_global_switch(encoder, x, batch_size):
    torch.set_grad_enabled(False)
    return torch.cat([encoder(part) for part in _batches(x, batch_size)])


def ff_switch_back_on(encoder, x, batch_size):  # right for a caller with autograd on, wrong for one inside no_grad
    torch.set_grad_enabled(False)
    features = torch.cat([encoder(part) for part in _batches(x, batch_size)])
    torch.set_grad_enabled(True)
    return features


def ff_freezes_weights(encoder, x, batch_size):
    encoder.weight.requires_grad_(False)
    encoder.bias.requires_grad_(False)
    return torch.cat([encoder(part) for part in _batches(x, batch_size)])


def ff_stack(encoder, x, batch_size):
    with torch.no_grad():
        return torch.stack([encoder(part) for part in _batches(x, batch_size)])


def ff_no_encoder(encoder, x, batch_size):
    return x.clone()


def ff_batch_of_rows(encoder, x, batch_size):  # batch_size read as the number of batches
    with torch.no_grad():
        return torch.cat([encoder(part) for part in x.chunk(batch_size)])


# leaky_relu

class StubBackward(torch.autograd.Function):  # the learner copy: forward given, backward still a stub
    @staticmethod
    def forward(ctx, x, slope):
        ctx.save_for_backward(x)
        ctx.slope = slope
        return torch.where(x > 0, x, slope * x)

    @staticmethod
    def backward(ctx, grad_output):
        raise NotImplementedError()


def test_leaky_relu_with_a_stub_backward_is_not_attempted():
    with pytest.raises(ExerciseNotAttempted, match="^leaky_relu: not attempted yet"):
        L.check_leaky_relu(lambda x, slope=0.01: StubBackward.apply(x, slope))


def leaky_with_backward(backward):
    """A leaky_relu whose Function has the given backward(ctx, grad_output)."""

    class Leaky(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, slope):
            ctx.save_for_backward(x)
            ctx.slope = slope
            return torch.where(x > 0, x, slope * x)

    Leaky.backward = staticmethod(backward)

    def leaky_relu(x, slope=0.01):
        return Leaky.apply(x, slope)

    return leaky_relu


def _x(ctx):
    return ctx.saved_tensors[0]


def _masked_copy(ctx, g):
    grad = g.clone()
    grad[_x(ctx) <= 0] *= ctx.slope
    return grad, None


def _masked_in_place(ctx, g):
    g[_x(ctx) <= 0] *= ctx.slope
    return g, None


leaky_right_alternative = leaky_with_backward(lambda ctx, g: (g * torch.where(_x(ctx) > 0, 1.0, ctx.slope), None))
leaky_masks = leaky_with_backward(lambda ctx, g: (g * (_x(ctx) > 0) + ctx.slope * g * (_x(ctx) <= 0), None))
leaky_masked_copy = leaky_with_backward(_masked_copy)
leaky_in_place = leaky_with_backward(_masked_in_place)
leaky_one_grad = leaky_with_backward(lambda ctx, g: torch.where(_x(ctx) > 0, g, ctx.slope * g))
leaky_no_upstream = leaky_with_backward(lambda ctx, g: (torch.where(_x(ctx) > 0, 1.0, ctx.slope).expand_as(g), None))
leaky_relu_grad = leaky_with_backward(lambda ctx, g: (g * (_x(ctx) > 0), None))
leaky_identity = leaky_with_backward(lambda ctx, g: (g, None))
leaky_swapped = leaky_with_backward(lambda ctx, g: (torch.where(_x(ctx) > 0, ctx.slope * g, g), None))
leaky_hard_coded = leaky_with_backward(lambda ctx, g: (torch.where(_x(ctx) > 0, g, 0.01 * g), None))
leaky_typo = leaky_with_backward(lambda ctx, g: (torch.where(_x(ctx) > 0, g, ctx.slop * g), None))
leaky_none = leaky_with_backward(lambda ctx, g: (None, None))


def leaky_builtin(x, slope=0.01):
    return torch.nn.functional.leaky_relu(x, slope)


# round_ste

def round_plain(x):
    return x.round()


def round_detached(x):
    return x.round().detach()


def round_minus(x):
    return (x.round() + x).detach() - x


def round_clipped(x):
    return x.clamp(-1, 1) + (x.round() - x.clamp(-1, 1)).detach()


def round_double(x):
    return 2 * x + (x.round() - 2 * x).detach()


def round_identity(x):
    return x * 1


def round_in_place(x):  # detach() shares memory: round_() on it rounds the caller's x
    return x.detach().round_() + x - x.detach()


def round_half_up(x):
    return x + ((x + 0.5).floor() - x).detach()


def round_other_form(x):  # correct
    return x - (x - torch.round(x)).detach()


def round_three_terms(x):  # correct
    return x.round().detach() + x - x.detach()


class _RoundThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.round()

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output


def round_function(x):  # correct: a custom Function with the identity backward
    return _RoundThrough.apply(x)


# nan_culprit

def nan_uncaught(f, x):
    leaf = x.detach().requires_grad_()
    with torch.autograd.detect_anomaly():
        f(leaf).sum().backward()


def _anomaly_message(f, leaf):
    """The message anomaly detection raises when f(leaf).sum() is backpropagated, or None (the wrong answers' shared part)."""
    try:
        with torch.autograd.detect_anomaly():
            f(leaf).sum().backward()
    except RuntimeError as err:
        return str(err)
    return None


def nan_whole_message(f, x):
    return _anomaly_message(f, x.detach().requires_grad_())


def nan_quoted_name(f, x):
    message = _anomaly_message(f, x.detach().requires_grad_())
    return message and message.split()[1]


def nan_hard_coded(f, x):
    leaf = x.detach().requires_grad_()
    grad = torch.autograd.grad(f(leaf).sum(), leaf)[0]
    return "SqrtBackward0" if grad.isnan().any() else None


def nan_left_on(f, x):
    torch.autograd.set_detect_anomaly(True)
    leaf = x.detach().requires_grad_()
    try:
        f(leaf).sum().backward()
    except RuntimeError as err:
        return str(err).split("'")[1]
    torch.autograd.set_detect_anomaly(False)
    return None


def nan_flags_caller(f, x):
    message = _anomaly_message(f, x.requires_grad_())
    return message and message.split("'")[1]


def nan_into_caller_grad(f, x):
    message = _anomaly_message(f, x if x.requires_grad else x.detach().requires_grad_())
    return message and message.split("'")[1]


def nan_last_node(f, x):  # hooks on every node: the last one to output NaN, not the first
    leaf = x.detach().requires_grad_()
    out = f(leaf).sum()
    seen = []
    for node in _nodes(out):
        node.register_hook(lambda grads, _, node=node: seen.append(node.name()) if any(
            g is not None and g.isnan().any() for g in grads) else None)
    torch.autograd.grad(out, leaf)
    return seen[-1] if seen else None


def nan_string_none(f, x):
    return L.nan_culprit(f, x) or "None"


def nan_non_finite(f, x):  # an inf taken for a NaN
    leaf = x.detach().requires_grad_()
    grad = torch.autograd.grad(f(leaf).sum(), leaf)[0]
    if torch.isfinite(grad).all():
        return None
    return L.nan_culprit(f, x) or "SqrtBackward0"


def nan_set_and_finally(f, x):  # correct: the global switch, reset in finally, a regex
    leaf = x.detach().requires_grad_()
    torch.autograd.set_detect_anomaly(True)
    try:
        torch.autograd.grad(f(leaf).sum(), [leaf])
    except RuntimeError as err:
        return re.search(r"Function '(\w+)'", str(err)).group(1)
    finally:
        torch.autograd.set_detect_anomaly(False)
    return None


def nan_from_warning(f, x):  # correct: the name from anomaly detection's warning
    leaf = x.detach().requires_grad_()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with torch.autograd.detect_anomaly():
                f(leaf).sum().backward()
        except RuntimeError:
            pass
    for warning in caught:
        found = re.search(r"Error detected in (\w+)\.", str(warning.message))
        if found:
            return found.group(1)
    return None


def nan_first_hook(f, x):  # correct without anomaly detection: hooks on every node, the first NaN
    leaf = x.detach().requires_grad_()
    out = f(leaf).sum()
    seen = []
    for node in _nodes(out):
        node.register_hook(lambda grads, _, node=node: seen.append(type(node).__name__) if any(
            g is not None and g.isnan().any() for g in grads) else None)
    torch.autograd.grad(out, leaf)
    return seen[0] if seen else None


RIGHT = [
    (L.check_count_ops, count_recursive),
    (L.check_count_ops, count_bfs_names),
    (L.check_count_ops, count_collect_then_count),
    (L.check_jacobian, jac_is_grads_batched),
    (L.check_jacobian, jac_backward_restoring),
    (L.check_jacobian, jac_fill_rows),
    (L.check_grad_at, grad_at_backward_on_copy),
    (L.check_grad_at, grad_at_func),
    (L.check_grad_at, grad_at_enable_grad),
    (L.check_frozen_features, ff_split_decorator),
    (L.check_frozen_features, ff_inference_then_cat),
    (L.check_frozen_features, ff_preallocated),
    (L.check_leaky_relu, leaky_right_alternative),
    (L.check_leaky_relu, leaky_masks),
    (L.check_leaky_relu, leaky_masked_copy),
    (L.check_round_ste, round_other_form),
    (L.check_round_ste, round_three_terms),
    (L.check_round_ste, round_function),
    (L.check_nan_culprit, nan_set_and_finally),
    (L.check_nan_culprit, nan_from_warning),
    (L.check_nan_culprit, nan_first_hook),
]


@pytest.mark.parametrize("check, answer", RIGHT, ids=[f"{c.__name__}-{a.__name__}" for c, a in RIGHT])
def test_correct_alternatives_pass(check, answer):
    assert_passes(check, answer)


WRONG = [
    (L.check_count_ops, count_per_path, r"counted once per path \('\w+' is 1 node, counted 3 times\).*already seen"),
    (L.check_count_ops, count_kinds_once, r"counts each kind once.*\('AddBackward0' is 2 nodes, counted 1 time\).*nodes, not names"),
    (L.check_count_ops, count_with_accumulate, "counts AccumulateGrad nodes"),
    (L.check_count_ops, count_with_none, "counts None as a node"),
    (L.check_count_ops, count_without_root, r"leaves out t.grad_fn itself \(AddBackward0\)"),
    (L.check_count_ops, count_one_level, "only t.grad_fn and its direct inputs"),
    (L.check_count_ops, count_after_backward, r"ran backward\(\)"),
    (L.check_count_ops, count_no_leaf_guard, "raised AttributeError.*grad_fn is None for a leaf"),
    (L.check_count_ops, count_list_of_names, "list of names: count them"),
    (L.check_count_ops, count_node_keys, "the nodes themselves"),
    (L.check_count_ops, count_str_keys, r"str\(node\)"),
    (L.check_count_ops, count_class_keys, "the keys are classes"),
    (L.check_count_ops, count_float_values, "Python ints, got float"),
    (L.check_count_ops, count_first_inputs_only, r"follows only the first input of each node \(next_functions\[0\]\).*visit them all"),
    (L.check_count_ops, count_through_autograd_grad, "graph no longer works"),
    (L.check_count_ops, count_on_discovery, r"counted once for each link into it \('TanhBackward0' is 1 node, counted 3 times\)"),
    (L.check_count_ops, count_skips_repeated_kinds, r"'AddBackward0': expected 2, got 1 \(expected \{'AddBackward0': 2"),
    (L.check_jacobian, jac_no_retain, "raised RuntimeError: Trying to backward.*retain_graph=True.*every pass"),
    (L.check_jacobian, jac_retain_all_but_last, "graph was freed.*on the last pass too"),
    (L.check_jacobian, jac_cumulative, "row i holds the sum of rows 0 to i"),
    (L.check_jacobian, jac_ones_rows, "sum of all rows.*v = ones"),
    (L.check_jacobian, jac_transposed, r"expected shape \(5, 3\), got \(3, 5\): is it transposed"),
    (L.check_jacobian, jac_backward_clearing, "set x.grad to None"),
    (L.check_jacobian, jac_backward_accumulating, "changed x.grad: backward"),
    (L.check_jacobian, jac_backward_other_leaves, "changed p.grad, the gradient of another leaf"),
    (L.check_jacobian, jac_create_graph, "still attached to a graph"),
    (L.check_jacobian, jac_float32, "expected dtype torch.float64, got torch.float32"),
    (L.check_jacobian, jac_batched_freed, "graph was freed"),
    (L.check_jacobian, jac_wrong_v_shape, "raised RuntimeError: Mismatch in shape.*must have y's shape"),
    (L.check_grad_at, grad_at_accumulates, "twice the gradient"),
    (L.check_grad_at, grad_at_mutates_flag, "switched on requires_grad"),
    (L.check_grad_at, grad_at_through_clone, "not a leaf"),
    (L.check_grad_at, grad_at_keeps_graph, "still attached to a graph"),
    (L.check_grad_at, grad_at_no_leaf, "raised RuntimeError.*requires_grad_"),
    (L.check_grad_at, grad_at_stale, "old gradient plus the new one"),
    (L.check_grad_at, grad_at_clears_caller, "changed the caller's x.grad"),
    (L.check_grad_at, grad_at_numeric, "wrong values"),
    (L.check_grad_at, grad_at_float32, "expected dtype torch.float64, got torch.float32"),
    (L.check_frozen_features, ff_whole, r"ran encoder on 150 rows in one call \(the whole of x at once\), more than batch_size=64"),
    (L.check_frozen_features, ff_drops_last, "the last 22 rows of x never went through encoder: the last batch is smaller"),
    (L.check_frozen_features, ff_overlapping, "ran encoder on 152 rows in all, for an x of 150 rows: each row goes through it once"),
    (L.check_frozen_features, ff_batch_of_rows, r"ran encoder on batches of 3, 3, 3, 3, \.\.\. rows: each batch holds batch_size=64 rows, the last one the rest"),
    (L.check_frozen_features, ff_recording, r"ran encoder while autograd was recording: that builds a graph through the frozen encoder"),
    (L.check_frozen_features, ff_detach_after, r"while autograd was recording.*a \.detach\(\) afterwards comes too late"),
    (L.check_frozen_features, ff_inference_tensor, r"is an inference tensor \(made inside inference_mode\): the head's backward cannot save it"),
    (L.check_frozen_features, ff_list, "is a list of 3 tensors, one per batch: join them into one with torch.cat"),
    (L.check_frozen_features, ff_requires_grad, "requires grad: the features are a constant"),
    (L.check_frozen_features, ff_global_switch, "left autograd switched off for the caller, who had it on"),
    (L.check_frozen_features, ff_switch_back_on, r"inside the caller's torch.no_grad\(\)\) left autograd switched on for the caller, who had it off"),
    (L.check_frozen_features, ff_freezes_weights, "switched off requires_grad on the encoder's weights"),
    (L.check_frozen_features, ff_stack, r"raised RuntimeError: stack expects each tensor to be equal size"),
    (L.check_frozen_features, ff_no_encoder, "never called encoder"),
    (L.check_leaky_relu, leaky_in_place, "modified grad_output in place"),
    (L.check_leaky_relu, leaky_one_grad, "incorrect number of gradients.*return grad_x, None"),
    (L.check_leaky_relu, leaky_no_upstream, "ignores grad_output"),
    (L.check_leaky_relu, leaky_relu_grad, "ReLU's"),
    (L.check_leaky_relu, leaky_identity, "unchanged"),
    (L.check_leaky_relu, leaky_swapped, "swapped"),
    (L.check_leaky_relu, leaky_hard_coded, "ctx.slope"),
    (L.check_leaky_relu, leaky_typo, "backward raised AttributeError"),
    (L.check_leaky_relu, leaky_builtin, "custom autograd.Function"),
    (L.check_leaky_relu, leaky_none, "is None: backward must return the gradient for x"),
    (L.check_leaky_relu, lambda x, slope=0.01: torch.relu(x), "wrong values"),
    (L.check_round_ste, round_plain, "0 everywhere"),
    (L.check_round_ste, round_detached, "not connected to x"),
    (L.check_round_ste, round_minus, "wrong sign"),
    (L.check_round_ste, round_clipped, r"\|x\| > 1"),
    (L.check_round_ste, round_double, "counted twice"),
    (L.check_round_ste, round_identity, "returned x itself"),
    (L.check_round_ste, round_in_place, "modified its input in place"),
    (L.check_round_ste, round_half_up, r"tie such as 2.5.*floor\(x \+ 0.5\) rounds up"),
    (L.check_round_ste, lambda x: x.floor() + x - x.detach(), "wrong values"),
    (L.check_nan_culprit, nan_uncaught, "raised RuntimeError: Function 'SqrtBackward0' returned nan.*catch it"),
    (L.check_nan_culprit, nan_whole_message, "the node's name alone, 'SqrtBackward0'"),
    (L.check_nan_culprit, nan_quoted_name, "the node's name alone"),
    (L.check_nan_culprit, nan_hard_coded, "expected 'MulBackward0', got 'SqrtBackward0'"),
    (L.check_nan_culprit, nan_left_on, "left anomaly detection switched on"),
    (L.check_nan_culprit, nan_flags_caller, "switched on requires_grad of the caller's x"),
    (L.check_nan_culprit, nan_into_caller_grad, "changed the caller's x.grad"),
    (L.check_nan_culprit, nan_last_node, "'SubBackward0' outputs NaN too, but backward runs 'SqrtBackward0' first"),
    (L.check_nan_culprit, nan_string_none, "expected None.*got 'None'"),
    (L.check_nan_culprit, nan_non_finite, r"expected None, the gradient holds no NaN \(an inf is not a NaN\)"),
]


@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")  # grad_at_through_clone's own
@pytest.mark.parametrize("check, wrong, message", WRONG, ids=[f"{c.__name__}-{getattr(w, '__name__', '')}-{i}" for i, (c, w, _) in enumerate(WRONG)])
def test_wrong_answers_name_the_fault(check, wrong, message):
    try:
        assert_names_fault(check, wrong, message)
    finally:
        torch.set_grad_enabled(True)
        torch.autograd.set_detect_anomaly(False)


def test_every_check_has_three_alternatives_and_eight_wrong_answers():
    for check, _ in PAIRS:
        assert sum(c is check for c, _ in RIGHT) + sum(c is check and m is None for c, _, m in WRONG) >= 3, check.__name__
        assert sum(c is check and m is not None for c, _, m in WRONG) >= 8, check.__name__


def test_round_ste_that_rounds_its_input_in_place_is_named():
    def rounds_caller(x):
        with torch.no_grad():
            x.round_()
        return x * 1

    with pytest.raises(ExerciseFailed, match="in place"):
        L.check_round_ste(rounds_caller)


def test_checks_leave_grad_and_anomaly_modes_as_they_were():
    for check, reference in PAIRS:
        check(reference)
        assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled() and not torch.is_anomaly_enabled()
    L.check_nan_culprit.verdict(nan_left_on)
    assert not torch.is_anomaly_enabled()
    L.check_frozen_features.verdict(ff_global_switch)
    assert torch.is_grad_enabled()


def test_nan_culprit_check_prints_no_warning(recwarn):
    L.check_nan_culprit(L.nan_culprit)
    assert not [w for w in recwarn if "Anomaly" in str(w.message) or "Error detected" in str(w.message)]


# The figure.

def test_draw_graph_draws_each_node_once_and_each_link():
    u = torch.tensor([1.0, 2.0], requires_grad=True)
    h = u * 3
    out = (h.sin() + h**2).sum()
    ax = L.draw_graph(out, {"u": u}, title="shared")
    labels = sorted(t.get_text() for t in ax.texts if not isinstance(t, matplotlib.text.Annotation))
    assert labels == sorted(["SumBackward0", "AddBackward0", "SinBackward0", "PowBackward0", "MulBackward0",
                             "AccumulateGrad\n-> u.grad", "None\n(needs no gradient)"])
    # Sum->Add, Add->Sin, Add->Pow, Sin->Mul, Pow->Mul, Mul->AccumulateGrad, Mul->None
    assert len([a for a in ax.texts if isinstance(a, matplotlib.text.Annotation)]) == 7
    assert ax.get_title() == "shared"
    matplotlib.pyplot.close(ax.figure)


def test_draw_graph_refuses_a_tensor_without_a_graph():
    with pytest.raises(ValueError, match="no grad_fn"):
        L.draw_graph(torch.ones(2, requires_grad=True))
