"""Lesson 00 (orientation): two warm-up exercises that show how the checker talks."""

import torch

from course_utils.tooling.checks import ExerciseFailed, call, exercise, expect_tensor, scoreboard_for

scoreboard = scoreboard_for(__name__)  # the lesson's last cell: this session's verdicts


def add_one(x: torch.Tensor) -> torch.Tensor:
    """Reference: x + 1, a new tensor of the same shape and dtype."""
    return x + 1


def mean_value(x: torch.Tensor) -> float:
    """Reference: the mean of x as a plain Python float."""
    return x.float().mean().item()


@exercise("add_one")
def check_add_one(fn) -> None:
    for x in (torch.tensor([1.0, 2.0, 3.0]), torch.zeros(2, 3), torch.arange(4)):
        expect_tensor(call(fn, x.clone()), add_one(x), what=f"add_one(tensor of shape {tuple(x.shape)}, dtype {x.dtype})")


@exercise("mean_value")
def check_mean_value(fn) -> None:
    for x in (torch.tensor([1.0, 2.0, 6.0]), torch.arange(10.0).reshape(2, 5), torch.arange(5)):
        got = call(fn, x.clone())
        if isinstance(got, torch.Tensor):
            raise ExerciseFailed("returned a tensor, expected a Python float: call .item() on the 0-d result")
        if not isinstance(got, float):
            raise ExerciseFailed(f"returned a {type(got).__name__}, expected a float")
        if abs(got - mean_value(x)) > 1e-6:
            raise ExerciseFailed(f"mean_value of a tensor of shape {tuple(x.shape)}: expected {mean_value(x):.4g}, got {got:.4g}")
