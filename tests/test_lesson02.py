"""Lesson 02's checks against the reference solutions and the wrong answers learners write."""

import pytest
import torch

from course_utils import lesson02 as L
from course_utils.tooling.checks import ExerciseFailed, ExerciseNotAttempted
from lesson_contract import assert_names_fault, contract_tests

PAIRS = [
    (L.check_grad_at, L.grad_at),
    (L.check_predict, L.predict),
    (L.check_sgd_step, L.sgd_step),
    (L.check_accumulate_grads, L.accumulate_grads),
    (L.check_leaky_relu, L.leaky_relu),
    (L.check_round_ste, L.round_ste),
]


(test_reference_passes, test_stub_is_not_attempted, test_bad_input_is_one_named_line, test_hostile_answers_are_the_learners_fault,
 test_checks_leave_the_learners_random_state_alone, test_checks_are_quick) = contract_tests(PAIRS)


# The learner copy of leaky_relu: forward given, backward still a stub.
class StubBackward(torch.autograd.Function):
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


# grad_at: typical wrong answers.

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
    return torch.stack([(f(x + eps * e) - f(x - eps * e)) / (2 * eps) for e in torch.eye(len(x))])


# predict

def predict_tracked(w, b, x):
    return x @ w + b


def predict_detached_after(w, b, x):
    return (x @ w + b).detach()


def predict_inference_mode(w, b, x):  # a correct alternative
    with torch.inference_mode():
        return x @ w + b


def predict_detached_params(w, b, x):  # also correct: no graph is recorded
    return x @ w.detach() + b.detach()


def predict_with_backward(w, b, x):
    (x @ w + b).sum().backward()
    with torch.no_grad():
        return x @ w + b


def predict_no_bias(w, b, x):
    with torch.no_grad():
        return x @ w


# sgd_step

def sgd_no_no_grad(w, b, x, y, lr):
    loss = ((x @ w + b - y) ** 2).mean()
    loss.backward()
    w -= lr * w.grad
    b -= lr * b.grad
    return loss.item()


def sgd_rebinds(w, b, x, y, lr):
    loss = ((x @ w + b - y) ** 2).mean()
    loss.backward()
    with torch.no_grad():
        w = w - lr * w.grad
        b = b - lr * b.grad
    return loss.item()


def sgd_through_data(w, b, x, y, lr):
    loss = ((x @ w + b - y) ** 2).mean()
    loss.backward()
    w.data -= lr * w.grad
    b.data -= lr * b.grad
    w.grad = b.grad = None
    return loss.item()


def sgd_wrong_sign(w, b, x, y, lr):
    loss = ((x @ w + b - y) ** 2).mean()
    loss.backward()
    with torch.no_grad():
        w += lr * w.grad
        b += lr * b.grad
    w.grad = b.grad = None
    return loss.item()


def sgd_no_lr(w, b, x, y, lr):
    loss = ((x @ w + b - y) ** 2).mean()
    loss.backward()
    with torch.no_grad():
        w -= w.grad
        b -= b.grad
    w.grad = b.grad = None
    return loss.item()


def sgd_sum(w, b, x, y, lr):
    loss = ((x @ w + b - y) ** 2).sum()
    loss.backward()
    with torch.no_grad():
        w -= lr * w.grad
        b -= lr * b.grad
    w.grad = b.grad = None
    return loss.item()


def sgd_no_zero(w, b, x, y, lr):
    loss = ((x @ w + b - y) ** 2).mean()
    loss.backward()
    with torch.no_grad():
        w -= lr * w.grad
        b -= lr * b.grad
    return loss.item()


def sgd_zero_first(w, b, x, y, lr):  # a correct alternative: clear before backward
    w.grad = b.grad = None
    loss = ((x @ w + b - y) ** 2).mean()
    loss.backward()
    with torch.no_grad():
        w -= lr * w.grad
        b -= lr * b.grad
    return loss.item()


def sgd_zero_underscore_first(w, b, x, y, lr):
    w.grad.zero_()
    return L.sgd_step(w, b, x, y, lr)


def sgd_returns_tensor(w, b, x, y, lr):
    loss = ((x @ w + b - y) ** 2).mean()
    L.sgd_step(w, b, x, y, lr)
    return loss


def sgd_returns_loss_after(w, b, x, y, lr):
    L.sgd_step(w, b, x, y, lr)
    return ((x @ w + b - y) ** 2).mean().item()


# accumulate_grads

def acc_full_batch(w, b, x, y, n_micro):
    w.grad = b.grad = None
    ((x @ w + b - y) ** 2).mean().backward()


def acc_stale(w, b, x, y, n_micro):
    for xs, ys in zip(x.chunk(n_micro), y.chunk(n_micro)):
        (((xs @ w + b - ys) ** 2).mean() / n_micro).backward()


def acc_unscaled(w, b, x, y, n_micro):
    w.grad = b.grad = None
    for xs, ys in zip(x.chunk(n_micro), y.chunk(n_micro)):
        ((xs @ w + b - ys) ** 2).mean().backward()


def acc_zero_inside(w, b, x, y, n_micro):
    for xs, ys in zip(x.chunk(n_micro), y.chunk(n_micro)):
        w.grad = b.grad = None
        (((xs @ w + b - ys) ** 2).mean() / n_micro).backward()


def acc_sum_over_n(w, b, x, y, n_micro):  # a correct alternative: sum of squared errors / len(x)
    w.grad = b.grad = None
    for xs, ys in zip(x.chunk(n_micro), y.chunk(n_micro)):
        (((xs @ w + b - ys) ** 2).sum() / len(x)).backward()


def acc_updates(w, b, x, y, n_micro):
    L.accumulate_grads(w, b, x, y, n_micro)
    with torch.no_grad():
        w -= 0.1 * w.grad


def acc_nothing(w, b, x, y, n_micro):
    w.grad = b.grad = None


def acc_one_graph_twice(w, b, x, y, n_micro):
    w.grad = b.grad = None
    loss = ((x @ w + b - y) ** 2).mean() / n_micro
    for _ in range(n_micro):
        loss.backward()


# leaky_relu

leaky_right_alternative = leaky_with_backward(lambda ctx, g: (g * torch.where(_x(ctx) > 0, 1.0, ctx.slope), None))
leaky_one_grad = leaky_with_backward(lambda ctx, g: torch.where(_x(ctx) > 0, g, ctx.slope * g))
leaky_no_upstream = leaky_with_backward(lambda ctx, g: (torch.where(_x(ctx) > 0, 1.0, ctx.slope).expand_as(g), None))
leaky_relu_grad = leaky_with_backward(lambda ctx, g: (g * (_x(ctx) > 0), None))
leaky_identity = leaky_with_backward(lambda ctx, g: (g, None))
leaky_swapped = leaky_with_backward(lambda ctx, g: (torch.where(_x(ctx) > 0, ctx.slope * g, g), None))
leaky_hard_coded = leaky_with_backward(lambda ctx, g: (torch.where(_x(ctx) > 0, g, 0.01 * g), None))
leaky_typo = leaky_with_backward(lambda ctx, g: (torch.where(_x(ctx) > 0, g, ctx.slop * g), None))


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


def round_other_form(x):  # a correct alternative
    return x - (x - torch.round(x)).detach()


WRONG = [
    (L.check_grad_at, grad_at_accumulates, "twice the gradient"),
    (L.check_grad_at, grad_at_mutates_flag, "switched on requires_grad"),
    (L.check_grad_at, grad_at_through_clone, "not a leaf"),
    (L.check_grad_at, grad_at_keeps_graph, "still attached to a graph"),
    (L.check_grad_at, grad_at_no_leaf, "raised RuntimeError.*requires_grad_"),
    (L.check_grad_at, grad_at_stale, "old gradient plus the new one"),
    (L.check_grad_at, grad_at_clears_caller, "changed the caller's x.grad"),
    (L.check_grad_at, grad_at_numeric, "wrong values"),
    (L.check_predict, predict_tracked, "tracked by autograd.*torch.no_grad"),
    (L.check_predict, predict_detached_after, "detached the result afterwards"),
    (L.check_predict, predict_inference_mode, None),
    (L.check_predict, predict_detached_params, None),
    (L.check_predict, predict_with_backward, "filled w.grad"),
    (L.check_predict, predict_no_bias, "wrong values"),
    (L.check_sgd_step, sgd_no_no_grad, "leaf Variable.*torch.no_grad"),
    (L.check_sgd_step, sgd_rebinds, "w did not change.*rebinds"),
    (L.check_sgd_step, sgd_through_data, r"\.data"),
    (L.check_sgd_step, sgd_wrong_sign, "up the gradient"),
    (L.check_sgd_step, sgd_no_lr, "ignores lr"),
    (L.check_sgd_step, sgd_sum, "mean of the squared errors"),
    (L.check_sgd_step, sgd_no_zero, "sum of both steps' gradients"),
    (L.check_sgd_step, sgd_zero_first, None),
    (L.check_sgd_step, sgd_zero_underscore_first, "None until a backward"),
    (L.check_sgd_step, sgd_returns_tensor, r"loss\.item\(\)"),
    (L.check_sgd_step, sgd_returns_loss_after, "before the update"),
    (L.check_accumulate_grads, acc_full_batch, "only once"),
    (L.check_accumulate_grads, acc_stale, "stale gradient"),
    (L.check_accumulate_grads, acc_unscaled, "times too big"),
    (L.check_accumulate_grads, acc_zero_inside, "only the last micro-batch"),
    (L.check_accumulate_grads, acc_sum_over_n, None),
    (L.check_accumulate_grads, acc_updates, "no update step"),
    (L.check_accumulate_grads, acc_nothing, "is None"),
    (L.check_accumulate_grads, acc_one_graph_twice, "backward through the graph a second time.*forward pass again"),
    (L.check_leaky_relu, leaky_right_alternative, None),
    (L.check_leaky_relu, leaky_one_grad, "incorrect number of gradients.*return grad_x, None"),
    (L.check_leaky_relu, leaky_no_upstream, "ignores grad_output"),
    (L.check_leaky_relu, leaky_relu_grad, "ReLU's"),
    (L.check_leaky_relu, leaky_identity, "unchanged"),
    (L.check_leaky_relu, leaky_swapped, "swapped"),
    (L.check_leaky_relu, leaky_hard_coded, "ctx.slope"),
    (L.check_leaky_relu, leaky_typo, "backward raised AttributeError"),
    (L.check_leaky_relu, leaky_builtin, "custom autograd.Function"),
    (L.check_leaky_relu, lambda x, slope=0.01: torch.relu(x), "wrong values"),
    (L.check_round_ste, round_plain, "0 everywhere"),
    (L.check_round_ste, round_detached, "not connected to x"),
    (L.check_round_ste, round_minus, "wrong sign"),
    (L.check_round_ste, round_clipped, r"\|x\| > 1"),
    (L.check_round_ste, round_double, "counted twice"),
    (L.check_round_ste, round_identity, "returned x itself"),
    (L.check_round_ste, round_in_place, "modified its input in place"),
    (L.check_round_ste, round_other_form, None),
    (L.check_round_ste, lambda x: x.floor() + x - x.detach(), "wrong values"),
]


@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")  # grad_at_through_clone's own
@pytest.mark.parametrize("check, wrong, message", WRONG, ids=[f"{c.__name__}-{getattr(w, '__name__', '')}-{i}" for i, (c, w, _) in enumerate(WRONG)])
def test_wrong_answers_name_the_fault(check, wrong, message):
    assert_names_fault(check, wrong, message)


def test_round_ste_that_rounds_its_input_in_place_is_named():
    def rounds_caller(x):
        with torch.no_grad():
            x.round_()
        return x * 1

    with pytest.raises(ExerciseFailed, match="in place"):
        L.check_round_ste(rounds_caller)
