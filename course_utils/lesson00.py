"""Lesson 00 (orientation): two warm-up exercises that show how the checker talks."""

import torch

from course_utils.tooling.checks import ExerciseFailed, call, exercise, expect_tensor, expect_unchanged, scoreboard_for

scoreboard = scoreboard_for(__name__)  # the lesson's last cell: this session's verdicts


# Reference solutions. The checks compare the learner's answers with these.

def add_one(x: torch.Tensor) -> torch.Tensor:
    """x + 1, a new tensor of the same shape and dtype; x itself unchanged."""
    return x + 1


def draw(seed: int, n: int) -> torch.Tensor:
    """The first n numbers torch.randn draws from a generator seeded with `seed`; the global RNG untouched."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=generator)


# Checks, one per exercise, in notebook order.

_ADD_ONE_CASES = [
    torch.tensor([0.5, -2.0, 7.25]),
    torch.arange(-3, 3),                            # int64: the result must stay an integer tensor
    torch.zeros(2, 3, dtype=torch.float64),
    torch.tensor(4.0),                              # 0-d
    torch.empty(0),
    torch.arange(12.0).reshape(3, 4).T,             # not contiguous
]


@exercise("add_one")
def check_add_one(fn) -> None:
    for x in _ADD_ONE_CASES:
        before, mine = x.clone(), x.clone()
        what = f"add_one(tensor of shape {tuple(x.shape)}, dtype {x.dtype})"
        got = call(fn, mine, shown=f"tensor of shape {tuple(x.shape)}, dtype {x.dtype}")
        expect_unchanged(before, mine, what="add_one")
        expect_tensor(got, add_one(before), what=what)
        if got is mine:
            raise ExerciseFailed(f"{what} returned its input tensor itself: return a new tensor")


_DRAWS = [(7, 5), (2024, 1), (31337, 0), (99, 64)]


@exercise("draw")
def check_draw(fn) -> None:
    for seed, n in _DRAWS:
        what = f"draw({seed}, {n})"
        state = torch.get_rng_state()
        got = call(fn, seed, n)
        if not torch.equal(torch.get_rng_state(), state):
            raise ExerciseFailed(
                f"{what} changed torch's global random state, which the notebook's other cells draw from: "
                "leave it alone, and draw from a torch.Generator of your own"
            )
        expected = draw(seed, n)
        if isinstance(got, torch.Tensor) and got.shape == expected.shape and n > 1:
            uniform = torch.rand(n, generator=torch.Generator().manual_seed(seed))
            if torch.equal(got.float(), uniform):
                raise ExerciseFailed(f"{what} drew from torch.rand, the uniform distribution on [0, 1); torch.randn draws from the standard normal")
        expect_tensor(got, expected, what=what, atol=0, rtol=0)
        again = call(fn, seed, n)
        expect_tensor(again, expected, what=f"{what}, called a second time", atol=0, rtol=0)
