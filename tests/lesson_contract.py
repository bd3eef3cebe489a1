"""What every lesson's checks must do, as reusable tests: a test_lessonNN.py module writes

    (test_reference_passes, test_stub_is_not_attempted, test_bad_input_is_one_named_line,
     test_checks_leave_the_learners_random_state_alone, test_checks_are_quick) = contract_tests(PAIRS)

where PAIRS lists (check, reference solution) for each exercise of the lesson, and checks each
typical wrong answer with assert_names_fault(check, wrong, expected message).
"""

from typing import Callable

import time

import pytest
import torch

from course_utils.checks import ExerciseFailed, ExerciseNotAttempted


def stub(*args, **kwargs):
    """A learner's untouched exercise."""
    raise NotImplementedError()


def contract_tests(pairs: list[tuple[Callable, Callable]], max_seconds: float = 2.0):
    """Five parametrized tests over a lesson's (check, reference) pairs; a second run of a check takes < max_seconds."""
    ids = [reference.__name__ for _, reference in pairs]

    @pytest.mark.parametrize("check, reference", pairs, ids=ids)
    def test_reference_passes(check, reference, capsys):
        check(reference)
        assert capsys.readouterr().out.strip().endswith(f"PASS {check.exercise_name}: all checks passed")

    @pytest.mark.parametrize("check, reference", pairs, ids=ids)
    def test_stub_is_not_attempted(check, reference):
        with pytest.raises(ExerciseNotAttempted, match=f"^{check.exercise_name}: not attempted yet"):
            check(stub)

    @pytest.mark.parametrize("check, reference", pairs, ids=ids)
    @pytest.mark.parametrize("bad", [None, 3, "fn"])
    def test_bad_input_is_one_named_line(check, reference, bad):
        with pytest.raises(ExerciseFailed) as info:
            check(bad)
        assert str(info.value).startswith(f"{check.exercise_name}: expected your function")
        assert "\n" not in str(info.value)

    @pytest.mark.parametrize("check, reference", pairs, ids=ids)
    def test_checks_leave_the_learners_random_state_alone(check, reference):
        """A check seeds its own problems; the notebook's later cells must draw the same numbers as without it."""
        torch.manual_seed(7)
        expected = torch.rand(3)
        torch.manual_seed(7)
        check(reference)
        assert torch.equal(torch.rand(3), expected)

    @pytest.mark.parametrize("check, reference", pairs, ids=ids)
    def test_checks_are_quick(check, reference):
        check(reference)  # the first call may import parts of torch, or warm up Dynamo or the profiler
        start = time.perf_counter()
        check(reference)
        assert time.perf_counter() - start < max_seconds

    return (test_reference_passes, test_stub_is_not_attempted, test_bad_input_is_one_named_line,
            test_checks_leave_the_learners_random_state_alone, test_checks_are_quick)


def assert_names_fault(check: Callable, wrong: Callable, message: str | None) -> None:
    """A typical wrong answer fails with `message` in one line, without a chained traceback (None: it passes)."""
    if message is None:
        check(wrong)
        return
    with pytest.raises(ExerciseFailed, match=message) as info:
        check(wrong)
    assert not isinstance(info.value, ExerciseNotAttempted)
    assert "\n" not in str(info.value)
    assert info.value.__suppress_context__  # no chained traceback from inside the checker
    assert "checker itself failed" not in str(info.value)
