"""Lesson 01 (tensors): reference solutions and the checks for its exercises."""

import torch

from course_utils.tooling.checks import ExerciseFailed, call, exercise, expect_function, expect_tensor, expect_unchanged, scoreboard_for

scoreboard = scoreboard_for(__name__)  # the lesson's last cell: this session's verdicts


def _cases(*shapes: tuple[int, ...], seed: int = 1) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=generator) for shape in shapes]


# Reference solutions. The checks compare the learner's answers with these.

def checkerboard(n: int) -> torch.Tensor:
    """(n, n) float32 tensor: 0 where row + column is even, 1 where it is odd."""
    i = torch.arange(n)
    return ((i[:, None] + i[None, :]) % 2).float()


def normalize_rows(x: torch.Tensor) -> torch.Tensor:
    """Divide each row of a 2-D tensor by its L2 norm."""
    return x / x.norm(dim=1, keepdim=True)


def pairwise_sq_distances(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(n, m) squared Euclidean distances between the rows of a (n, d) and b (m, d)."""
    return ((a[:, None, :] - b[None, :, :]) ** 2).sum(dim=-1)


def to_channels_last(images: torch.Tensor) -> torch.Tensor:
    """(N, C, H, W) -> (N, H, W, C), each pixel keeping its own channel values."""
    return images.permute(0, 2, 3, 1)


def relu_copy(x: torch.Tensor) -> torch.Tensor:
    """A copy of x with negative entries set to zero; x itself is left unchanged."""
    out = x.clone()
    out[out < 0] = 0
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """What nn.Linear computes: x (B, in) @ weight (out, in) transposed, plus bias (out,)."""
    return x @ weight.T + bias


def stack_points(points: list[torch.Tensor]) -> torch.Tensor:
    """A list of n tensors of shape (2,) -> one (n, 2) tensor."""
    return torch.stack(points)


# Checks, one per exercise, in notebook order.

@exercise("checkerboard")
def check_checkerboard(fn) -> None:
    for n in (5, 2, 1):
        got = call(fn, n)
        expected = checkerboard(n)
        if isinstance(got, torch.Tensor) and got.shape == expected.shape and n > 1 and torch.equal(got.float(), 1 - expected):
            raise ExerciseFailed(f"checkerboard({n}) is inverted: the top-left entry [0, 0] should be 0")
        expect_tensor(got, expected, what=f"checkerboard({n})")


@exercise("normalize_rows")
def check_normalize_rows(fn) -> None:
    # A square input matters: without keepdim=True, (n,) silently broadcasts against the columns.
    for x in _cases((4, 3), (5, 5), (1, 7)):
        got = call(fn, x.clone())
        expected = normalize_rows(x)
        square = x.shape[0] == x.shape[1] > 1
        if square and isinstance(got, torch.Tensor) and got.shape == x.shape and torch.allclose(got, x / x.norm(dim=1), atol=1e-6):
            raise ExerciseFailed(
                "on a square input each *column* j was divided by the norm of row j: use keepdim=True so the norms have shape (n, 1)"
            )
        expect_tensor(got, expected, what=f"normalize_rows(tensor of shape {tuple(x.shape)})", atol=1e-5)


@exercise("pairwise_sq_distances")
def check_pairwise_sq_distances(fn) -> None:
    a, b = _cases((4, 3), (6, 3))
    cases = [(a, b), (b, a), (a[:1], b)]
    expect_function(fn, pairwise_sq_distances, cases, atol=1e-4)


@exercise("to_channels_last")
def check_to_channels_last(fn) -> None:
    (images,) = _cases((2, 3, 4, 5))
    got = call(fn, images.clone())
    expect_tensor(got, to_channels_last(images), what="to_channels_last(tensor of shape (2, 3, 4, 5))")


@exercise("relu_copy")
def check_relu_copy(fn) -> None:
    for x in _cases((6,), (3, 4)):
        before = x.clone()
        got = call(fn, x)
        expect_unchanged(before, x, what="relu_copy")
        expect_tensor(got, relu_copy(before), what=f"relu_copy(tensor of shape {tuple(x.shape)})")
        if got.data_ptr() == x.data_ptr():
            raise ExerciseFailed("relu_copy returned its input tensor itself: return a new tensor")


@exercise("linear")
def check_linear(fn) -> None:
    # Square weights first: they hide a missing transpose from the shapes, but not from the values.
    x, w, b = _cases((2, 3), (3, 3), (3,), seed=2)
    got = call(fn, x, w, b)
    if isinstance(got, torch.Tensor) and got.shape == (2, 3) and torch.allclose(got, x @ w + b, atol=1e-5):
        raise ExerciseFailed("you computed x @ weight; nn.Linear stores weight as (out, in), so use x @ weight.T")
    expect_tensor(got, linear(x, w, b), what="linear with a square (3, 3) weight", atol=1e-5)
    x, w, b = _cases((4, 3), (2, 3), (2,))
    expect_function(fn, linear, [(x, w, b)], atol=1e-5)


@exercise("stack_points")
def check_stack_points(fn) -> None:
    points = [torch.tensor([float(i), float(-i)]) for i in range(5)]
    got = call(fn, [p.clone() for p in points])
    if isinstance(got, torch.Tensor) and got.shape == (10,):
        raise ExerciseFailed("got shape (10,): torch.cat joins along an existing dimension; torch.stack adds a new one")
    expect_tensor(got, stack_points(points), what="stack_points(list of 5 tensors of shape (2,))")
