"""Lesson 01's checks against the reference solutions and the wrong answers learners write."""

import pytest
import torch

from course_utils import lesson01 as L
from course_utils.tooling.checks import ExerciseFailed
from lesson_contract import assert_names_fault, contract_tests

PAIRS = [
    (L.check_checkerboard, L.checkerboard),
    (L.check_normalize_rows, L.normalize_rows),
    (L.check_pairwise_sq_distances, L.pairwise_sq_distances),
    (L.check_to_channels_last, L.to_channels_last),
    (L.check_relu_copy, L.relu_copy),
    (L.check_linear, L.linear),
    (L.check_stack_points, L.stack_points),
]

(test_reference_passes, test_stub_is_not_attempted, test_bad_input_is_one_named_line, test_hostile_answers_are_the_learners_fault,
 test_checks_leave_the_learners_random_state_alone, test_checks_are_quick) = contract_tests(PAIRS)


WRONG = [
    (L.check_checkerboard, lambda n: 1 - L.checkerboard(n), "inverted"),
    (L.check_checkerboard, lambda n: (torch.arange(n)[:, None] + torch.arange(n)) % 2, "expected dtype torch.float32, got torch.int64"),
    (L.check_checkerboard, lambda n: L.checkerboard(n).flatten(), "expected shape"),
    (L.check_normalize_rows, lambda x: x / x.norm(dim=1), "raised RuntimeError.*shapes that do not broadcast"),  # (4, 3) / (4,)
    (L.check_normalize_rows, lambda x: x / x.norm(), "wrong values"),
    (L.check_normalize_rows, lambda x: x / x.norm(dim=0, keepdim=True), "wrong values"),
    (L.check_pairwise_sq_distances, lambda a, b: ((a[None] - b[:, None]) ** 2).sum(-1), "transposed"),
    (L.check_pairwise_sq_distances, lambda a, b: (a[:, None] - b[None]).norm(dim=-1), "wrong values"),
    (L.check_pairwise_sq_distances, lambda a, b: ((a[:, None] - b[None]) ** 2).sum(0), "expected shape"),
    (L.check_to_channels_last, lambda x: x.reshape(x.shape[0], x.shape[2], x.shape[3], x.shape[1]), "wrong places"),
    (L.check_to_channels_last, lambda x: x.permute(0, 3, 2, 1), "expected shape"),
    (L.check_to_channels_last, lambda x: x.numpy().transpose(0, 2, 3, 1), "numpy"),
    (L.check_relu_copy, lambda x: x.clamp_(min=0), "in place"),
    (L.check_relu_copy, lambda x: x * (x > 0), None),  # a correct alternative
    (L.check_relu_copy, lambda x: x[x > 0], "expected shape"),
    (L.check_linear, lambda x, w, b: x @ w + b, "weight.T"),
    (L.check_linear, lambda x, w, b: x * w + b, "raised RuntimeError.*broadcast"),
    (L.check_linear, lambda x, w, b: x @ w.T, "wrong values"),
    (L.check_stack_points, torch.cat, "torch.cat joins"),
    (L.check_stack_points, lambda p: p, "is a list"),
    (L.check_stack_points, lambda p: torch.stack(p, dim=1), "transposed"),
]


@pytest.mark.parametrize("check, wrong, message", WRONG)
def test_wrong_answers_name_the_fault(check, wrong, message):
    assert_names_fault(check, wrong, message)


def test_wrong_answer_for_a_square_input_explains_keepdim():
    """Without keepdim, a square input divides columns by row norms silently."""
    def no_keepdim(x):
        return x / x.norm(dim=1) if x.shape[0] == x.shape[1] else x / x.norm(dim=1, keepdim=True)

    with pytest.raises(ExerciseFailed, match="keepdim=True"):
        L.check_normalize_rows(no_keepdim)
