"""Lesson 00's checks against the reference solutions and the wrong answers learners write."""

import pytest

from course_utils import lesson00
from course_utils.tooling.checks import ExerciseFailed
from lesson_contract import contract_tests


PAIRS = [
    (lesson00.check_add_one, lesson00.add_one),
    (lesson00.check_mean_value, lesson00.mean_value),
]

(test_reference_passes, test_stub_is_not_attempted, test_bad_input_is_one_named_line, test_hostile_answers_are_the_learners_fault,
 test_checks_leave_the_learners_random_state_alone, test_checks_are_quick) = contract_tests(PAIRS)


@pytest.mark.parametrize("wrong, message", [
    (lambda x: None, "forget to `return`"),
    (lambda x: x.add_(1) if x.is_floating_point() else x + 1, None),  # in place is accepted, output is right
    (lambda x: (x + 1).float(), "expected dtype torch.int64"),
    (lambda x: x + 2, "wrong values"),
    (lambda x: (x + 1).tolist(), "is a list"),
])
def test_add_one_wrong_answers(wrong, message):
    if message is None:
        lesson00.check_add_one(wrong)
        return
    with pytest.raises(ExerciseFailed, match=message):
        lesson00.check_add_one(wrong)


@pytest.mark.parametrize("wrong, message", [
    (lambda x: x.float().mean(), r"call \.item\(\)"),
    (lambda x: x.mean().item(), "raised RuntimeError"),  # integer input: mean() needs a float dtype
    (lambda x: x.float().sum().item(), "expected 3, got 9"),
    (lambda x: int(x.float().mean().item()), "expected a float"),
])
def test_mean_value_wrong_answers(wrong, message):
    with pytest.raises(ExerciseFailed, match=message) as info:
        lesson00.check_mean_value(wrong)
    assert str(info.value).startswith("mean_value: ")
