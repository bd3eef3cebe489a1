"""Lesson 02 (autograd): reference solutions and the checks for its exercises."""

from typing import Callable

import torch

from course_utils.tooling.checks import ExerciseFailed, call, exercise, expect_tensor, scoreboard_for

scoreboard = scoreboard_for(__name__)  # the lesson's last cell: this session's verdicts

# Reference solutions. The checks compare the learner's answers with these.


def grad_at(f: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """The gradient of the scalar function f at x, as a plain tensor; the caller's x is left alone."""
    x = x.detach().requires_grad_()
    (grad,) = torch.autograd.grad(f(x), x)
    return grad


def predict(w: torch.Tensor, b: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """x @ w + b, computed without recording a graph."""
    with torch.no_grad():
        return x @ w + b


def sgd_step(w: torch.Tensor, b: torch.Tensor, x: torch.Tensor, y: torch.Tensor, lr: float) -> float:
    """One gradient-descent step on the mean squared error of x @ w + b; return the loss before the step."""
    loss = ((x @ w + b - y) ** 2).mean()
    loss.backward()
    with torch.no_grad():
        w -= lr * w.grad
        b -= lr * b.grad
    w.grad = None
    b.grad = None
    return loss.item()


def accumulate_grads(w: torch.Tensor, b: torch.Tensor, x: torch.Tensor, y: torch.Tensor, n_micro: int) -> None:
    """Leave in w.grad and b.grad the full-batch MSE gradient, computed one micro-batch at a time."""
    w.grad = None
    b.grad = None
    for xs, ys in zip(x.chunk(n_micro), y.chunk(n_micro)):
        loss = ((xs @ w + b - ys) ** 2).mean() / n_micro
        loss.backward()


class LeakyReLU(torch.autograd.Function):
    """max(x, slope * x) with a hand-written backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, slope: float) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.slope = slope
        return torch.where(x > 0, x, slope * x)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (x,) = ctx.saved_tensors
        grad_x = torch.where(x > 0, grad_output, ctx.slope * grad_output)
        return grad_x, None


def leaky_relu(x: torch.Tensor, slope: float = 0.01) -> torch.Tensor:
    """Leaky ReLU through the custom LeakyReLU Function."""
    return LeakyReLU.apply(x, slope)


def round_ste(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest integer, with a straight-through (identity) gradient."""
    return x + (x.round() - x).detach()


# Helpers for the checks.

# Autograd's wording of the errors this lesson's exercises run into, and what they mean there.
HINTS = {
    "a leaf Variable that requires grad is being used in an in-place operation": (
        "update parameters inside `with torch.no_grad():`"
    ),
    "does not require grad and does not have a grad_fn": (
        "backward() needs a result computed from a tensor that requires grad: call requires_grad_() on your leaf, and look for a .detach() that cut the graph"
    ),
    "Trying to backward through the graph a second time": "run the forward pass again before each backward()",
    "object has no attribute 'zero_'": "a .grad is None until a backward() reaches it: clear it with `.grad = None` instead",
    "incorrect number of gradients": "backward() returns one gradient per input of forward(): `return grad_x, None`, None for the number slope",
    "modified by an inplace operation": "an in-place op changed a tensor autograd had saved; use the out-of-place version",
    "Can't call numpy() on Tensor that requires grad": "stay in torch, or call .detach() first",
}


def _call(fn, *args):
    """call(), with this lesson's hints added to the errors autograd raises."""
    return call(fn, *args, hints=HINTS)


def _close(a, b, atol: float = 1e-5) -> bool:
    return (
        isinstance(a, torch.Tensor)
        and isinstance(b, torch.Tensor)
        and a.shape == b.shape
        and torch.allclose(a.detach().double(), b.detach().double(), atol=atol, rtol=1e-4)
    )


def _randn(*shape: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=generator)


def _regression(seed: int, n: int = 8, d: int = 3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (n, d), y (n,), and starting values for w (d,) and b (a 0-d tensor)."""
    g = torch.Generator().manual_seed(seed)
    return _randn(n, d, generator=g), _randn(n, generator=g), _randn(d, generator=g), _randn(generator=g)


def _leaves(*values: torch.Tensor) -> list[torch.Tensor]:
    return [v.clone().requires_grad_() for v in values]


def _mse_grads(w: torch.Tensor, b: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    w, b = _leaves(w.detach(), b.detach())
    return torch.autograd.grad(((x @ w + b - y) ** 2).mean(), (w, b))


class _Scalar:
    """A named scalar function for grad_at's hidden cases (its repr shows in messages)."""

    def __init__(self, text: str, fn: Callable[[torch.Tensor], torch.Tensor]):
        self.text, self.fn = text, fn

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)

    def __repr__(self) -> str:
        return f"lambda x: {self.text}"


_A = torch.tensor([[1.0, 2.0, 0.0], [-1.0, 0.5, 3.0], [0.0, 1.0, -2.0]])
_FUNCTIONS = [
    _Scalar("(x ** 2).sum()", lambda x: (x**2).sum()),
    _Scalar("(x.sin() * x).sum()", lambda x: (x.sin() * x).sum()),
    _Scalar("x @ A @ x", lambda x: x @ _A @ x),
    _Scalar("x.exp().mean()", lambda x: x.exp().mean()),
]


# Checks, one per exercise, in notebook order.


@exercise("grad_at")
def check_grad_at(fn) -> None:
    g = torch.Generator().manual_seed(5)
    for f in _FUNCTIONS:
        x = _randn(3, generator=g)
        expected = grad_at(f, x)
        what = f"grad_at({f!r}, tensor of shape (3,))"
        got = _call(fn, f, x)
        if got is None:
            raise ExerciseFailed(
                f"{what} returned None: .grad is only filled on a leaf; make one with x.detach().requires_grad_(), or use torch.autograd.grad"
            )
        if isinstance(got, torch.Tensor) and got.requires_grad:
            raise ExerciseFailed(
                f"{what} returned a tensor still attached to a graph (grad_fn={type(got.grad_fn).__name__}): return a plain gradient (no create_graph=True, or .detach() it)"
            )
        expect_tensor(got, expected, what=what, atol=1e-5)
        first = got.clone()
        again = _call(fn, f, x)
        if _close(again, 2 * first):
            raise ExerciseFailed(
                "a second call with the same tensor returned twice the gradient: x.grad accumulates across backward() calls; work on a fresh leaf, x.detach().requires_grad_(), or use torch.autograd.grad"
            )
        expect_tensor(again, expected, what=f"{what}, called a second time", atol=1e-5)
        if x.requires_grad:
            raise ExerciseFailed(
                "grad_at switched on requires_grad of the caller's tensor: make a new leaf with x.detach().requires_grad_() instead"
            )
    # A caller's tensor that already requires grad and holds a gradient, like a model parameter.
    x = _randn(3, generator=g).requires_grad_()
    stale = torch.full((3,), 5.0)
    x.grad = stale.clone()
    f = _FUNCTIONS[1]
    expected = grad_at(f, x)
    got = _call(fn, f, x)
    if _close(got, expected + stale):
        raise ExerciseFailed(
            "for an x that already held a gradient in x.grad, you returned that old gradient plus the new one: use a fresh leaf, x.detach().requires_grad_(), or torch.autograd.grad"
        )
    if got is None:
        raise ExerciseFailed(
            "for an x that requires grad, grad_at returned None: a copy of x (x.clone()) is not a leaf, so its .grad stays None; use x.detach().requires_grad_()"
        )
    expect_tensor(got, expected, what=f"grad_at({f!r}, a tensor that requires grad)", atol=1e-5)
    if x.grad is None or not torch.equal(x.grad, stale):
        raise ExerciseFailed("grad_at changed the caller's x.grad: work on x.detach().requires_grad_(), a new leaf")


@exercise("predict")
def check_predict(fn) -> None:
    for seed, n in ((4, 5), (6, 1)):
        x, _, w0, b0 = _regression(seed, n=n)
        w, b = _leaves(w0, b0)
        expected = predict(w, b, x)
        what = f"predict(w, b, tensor of shape {tuple(x.shape)})"
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(1) or t, lambda t: t):
            got = _call(fn, w, b, x)
        if isinstance(got, torch.Tensor) and got.requires_grad:
            raise ExerciseFailed(
                f"{what} is tracked by autograd (grad_fn={type(got.grad_fn).__name__}): compute it inside `with torch.no_grad():`"
            )
        if w.grad is not None or b.grad is not None:
            raise ExerciseFailed("predict filled w.grad or b.grad: a prediction needs no backward()")
        if isinstance(got, torch.Tensor) and saved:
            raise ExerciseFailed(
                "predict recorded a graph (autograd saved tensors for backward) and detached the result afterwards: compute inside `with torch.no_grad():`, so that no graph is built at all"
            )
        expect_tensor(got, expected, what=what, atol=1e-5)


def _expect_updated(name: str, param: torch.Tensor, start: torch.Tensor, version: int) -> None:
    if not param.requires_grad or not param.is_leaf:
        raise ExerciseFailed(f"{name} is no longer a leaf that requires grad: update it in place inside `with torch.no_grad():`")
    if torch.equal(param.detach(), start):
        raise ExerciseFailed(
            f"{name} did not change: update it in place ({name} -= lr * {name}.grad) inside torch.no_grad(); `{name} = {name} - ...` only rebinds a local name"
        )
    if param._version == version:
        raise ExerciseFailed(
            f"{name} changed without autograd seeing it (through .data?): update it with `{name} -= lr * {name}.grad` inside `with torch.no_grad():`"
        )


@exercise("sgd_step")
def check_sgd_step(fn) -> None:
    x, y, w0, b0 = _regression(7)
    lr = 0.1
    w, b = _leaves(w0, b0)
    ref_w, ref_b = _leaves(w0, b0)
    versions = (w._version, b._version)
    gw, gb = _mse_grads(w0, b0, x, y)
    loss = _call(fn, w, b, x, y, lr)
    ref_loss = sgd_step(ref_w, ref_b, x, y, lr)
    _expect_updated("w", w, w0, versions[0])
    _expect_updated("b", b, b0, versions[1])
    if _close(w, w0 + lr * gw):
        raise ExerciseFailed("w moved up the gradient, so the loss grows: subtract, w -= lr * w.grad")
    if _close(w, w0 - gw):
        raise ExerciseFailed("the step ignores lr: w -= lr * w.grad")
    if _close(w, w0 - lr * len(x) * gw):
        raise ExerciseFailed("the step is len(x) times too big: use the mean of the squared errors, not their sum")
    expect_tensor(w.detach(), ref_w.detach(), what="w after one sgd_step", atol=1e-5)
    expect_tensor(b.detach(), ref_b.detach(), what="b after one sgd_step", atol=1e-5)
    if isinstance(loss, torch.Tensor):
        raise ExerciseFailed("sgd_step returned a tensor: return the loss as a Python float with loss.item()")
    if not isinstance(loss, float):
        raise ExerciseFailed(f"sgd_step returned a {type(loss).__name__}, expected the loss as a float")
    if abs(loss - ref_loss) > 1e-4 * max(1.0, abs(ref_loss)):
        raise ExerciseFailed(f"sgd_step returned loss {loss:.6g}, expected {ref_loss:.6g}: the mean squared error before the update")
    # A second step: gradients left over from the first one must not leak into it.
    w1, b1 = w.detach().clone(), b.detach().clone()
    gw1, gb1 = _mse_grads(w1, b1, x, y)
    _call(fn, w, b, x, y, lr)
    sgd_step(ref_w, ref_b, x, y, lr)
    if _close(w, w1 - lr * (gw + gw1)) and not _close(w, ref_w):
        raise ExerciseFailed(
            "the second step used the sum of both steps' gradients: .grad accumulates, so clear w.grad and b.grad (set them to None) after each update"
        )
    expect_tensor(w.detach(), ref_w.detach(), what="w after two sgd_steps", atol=1e-5)
    expect_tensor(b.detach(), ref_b.detach(), what="b after two sgd_steps", atol=1e-5)


@exercise("accumulate_grads")
def check_accumulate_grads(fn) -> None:
    for seed, n_micro in ((8, 3), (9, 4), (10, 1)):
        x, y, w0, b0 = _regression(seed, n=12)
        w, b = _leaves(w0, b0)
        stale = 1.0
        w.grad, b.grad = torch.full_like(w0, stale), torch.full_like(b0, stale)
        backward_calls = []
        handle = w.register_hook(lambda grad: backward_calls.append(1))
        try:
            _call(fn, w, b, x, y, n_micro)
        finally:
            handle.remove()
        what = f"accumulate_grads(w, b, x of shape {tuple(x.shape)}, y, n_micro={n_micro})"
        if not torch.equal(w.detach(), w0) or not torch.equal(b.detach(), b0):
            raise ExerciseFailed("accumulate_grads changed w or b: it only computes gradients, there is no update step here")
        if w.grad is None or b.grad is None:
            raise ExerciseFailed(f"after {what}, w.grad or b.grad is None: call backward() on each micro-batch's loss")
        if not backward_calls:
            raise ExerciseFailed(f"{what} never ran a backward() that reached w")
        gw, gb = _mse_grads(w0, b0, x, y)
        last_x, last_y = x.chunk(n_micro)[-1], y.chunk(n_micro)[-1]
        lw, _ = _mse_grads(w0, b0, last_x, last_y)
        if n_micro > 1 and len(backward_calls) == 1:
            raise ExerciseFailed(
                f"with n_micro={n_micro}, backward() reached w only once: split x and y into micro-batches (x.chunk(n_micro)) and call backward() on each one's loss"
            )
        if _close(w.grad - stale, gw) or (n_micro > 1 and _close(w.grad - stale, gw * n_micro)):
            raise ExerciseFailed(
                "w.grad includes the stale gradient it held before the call: clear w.grad and b.grad (set them to None) before the first micro-batch"
            )
        if n_micro > 1 and _close(w.grad, gw * n_micro):
            raise ExerciseFailed(
                f"w.grad is n_micro={n_micro} times too big: divide each micro-batch's mean loss by n_micro before backward()"
            )
        if n_micro > 1 and (_close(w.grad, lw / n_micro) or _close(w.grad, lw)):
            raise ExerciseFailed(
                "w.grad holds only the last micro-batch's gradient: clear the gradients once before the loop, not inside it"
            )
        expect_tensor(w.grad, gw, what=f"w.grad after {what}", atol=1e-5)
        expect_tensor(b.grad, gb, what=f"b.grad after {what}", atol=1e-5)


def _grad_through(out: torch.Tensor, x: torch.Tensor, upstream: torch.Tensor, name: str) -> torch.Tensor:
    """d(out * upstream).sum() / dx, with the learner's backward's errors reported in one line."""
    try:
        (grad,) = torch.autograd.grad(out, x, upstream)
    except NotImplementedError:
        raise
    except Exception as err:
        message = f"{name}'s backward raised {type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
        hint = next((h for key, h in HINTS.items() if key in str(err)), None)
        raise ExerciseFailed(f"{message} ({hint})" if hint else message) from None
    return grad


@exercise("leaky_relu")
def check_leaky_relu(fn) -> None:
    g = torch.Generator().manual_seed(11)
    for shape, slope in (((4, 5), 0.2), ((7,), 0.05)):
        x = _randn(*shape, generator=g).requires_grad_()
        upstream = _randn(*shape, generator=g)
        what = f"leaky_relu(tensor of shape {shape}, slope={slope})"
        out = _call(fn, x, slope)
        expect_tensor(out, leaky_relu(x.detach(), slope), what=what)
        if not isinstance(out.grad_fn, torch.autograd.function.BackwardCFunction):
            raise ExerciseFailed(
                f"{what} does not go through a custom autograd.Function (its grad_fn is {type(out.grad_fn).__name__}): return LeakyReLU.apply(x, slope)"
            )
        got = _grad_through(out, x, upstream, "LeakyReLU")
        positive = x.detach() > 0
        expected = torch.where(positive, upstream, slope * upstream)
        where = "the gradient of a leaky_relu with respect to x"
        if _close(got, torch.where(positive, 1.0, slope)):
            raise ExerciseFailed(
                f"{where} ignores grad_output: the chain rule multiplies the local derivative by grad_output"
            )
        if _close(got, torch.where(positive, upstream, 0.0)):
            raise ExerciseFailed(f"{where} is ReLU's: negative inputs pass slope * grad_output, not 0")
        if _close(got, upstream):
            raise ExerciseFailed(f"{where} passes grad_output through unchanged: negative inputs get slope * grad_output")
        if _close(got, torch.where(positive, slope * upstream, upstream)):
            raise ExerciseFailed(f"{where} has the two cases swapped: x > 0 passes grad_output, x <= 0 passes slope * grad_output")
        if _close(got, torch.where(positive, upstream, 0.01 * upstream)):
            raise ExerciseFailed(f"{where} uses slope 0.01 when slope={slope} was passed: read it from ctx.slope")
        expect_tensor(got, expected, what=f"{where} (shape {shape}, slope={slope})", atol=1e-6)
    x = torch.tensor([-2.0, -0.5, 0.3, 1.7], dtype=torch.float64, requires_grad=True)
    if not torch.autograd.gradcheck(lambda t: fn(t, 0.1), (x,), raise_exception=False):
        raise ExerciseFailed("LeakyReLU fails torch.autograd.gradcheck in float64: is backward's result cast to another dtype?")


@exercise("round_ste")
def check_round_ste(fn) -> None:
    g = torch.Generator().manual_seed(12)
    for shape in ((6,), (3, 4)):
        x = (3 * _randn(*shape, generator=g)).requires_grad_()
        before = x.detach().clone()
        upstream = _randn(*shape, generator=g)
        what = f"round_ste(tensor of shape {shape})"
        out = _call(fn, x)
        if not torch.equal(x.detach(), before):
            raise ExerciseFailed("round_ste modified its input in place: use out-of-place ops (x.round(), not x.round_())")
        if _close(out, before):
            raise ExerciseFailed(f"{what} returned x itself: the forward value must be rounded, x.round()")
        expect_tensor(out, before.round(), what=what)
        if not out.requires_grad:
            raise ExerciseFailed(
                f"{what} is not connected to x (no grad_fn): detach only the part that makes the value right, and keep x outside the detach"
            )
        (got,) = torch.autograd.grad(out, x, upstream, allow_unused=True)
        where = "the gradient of round_ste"
        if got is None or _close(got, torch.zeros_like(upstream)):
            raise ExerciseFailed(
                f"{where} is 0 everywhere: that is round()'s true derivative; a straight-through estimator passes grad_output through unchanged"
            )
        if _close(got, -upstream):
            raise ExerciseFailed(f"{where} has the wrong sign: it is -grad_output; the x outside the detach must be added, not subtracted")
        if _close(got, upstream * (before.abs() <= 1)):
            raise ExerciseFailed(
                f"{where} is zero where |x| > 1 (the clipped estimator for sign()); round_ste passes grad_output through everywhere"
            )
        if _close(got, 2 * upstream):
            raise ExerciseFailed(f"{where} is 2 * grad_output: x's gradient is counted twice; detach everything except one x")
        expect_tensor(got, upstream, what=f"{where} (shape {shape})")
