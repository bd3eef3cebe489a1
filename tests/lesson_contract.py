"""What every lesson's checks must do, as reusable tests: a test_lessonNN.py module writes

    (test_reference_passes, test_stub_is_not_attempted, test_bad_input_is_one_named_line,
     test_hostile_answers_are_the_learners_fault, test_checks_leave_the_learners_random_state_alone,
     test_checks_are_quick) = contract_tests(PAIRS)

where PAIRS lists (check, reference solution) for each exercise of the lesson, and checks each
typical wrong answer with assert_names_fault(check, wrong, expected message) and each correct
alternative with assert_passes(check, alternative).
"""

import math
import sys
import time
import types
from typing import Callable

import numpy as np
import pytest
import torch
from torch import nn

from course_utils.tooling.checks import ExerciseFailed, ExerciseNotAttempted


def stub(*args, **kwargs):
    """A learner's untouched exercise."""
    raise NotImplementedError()


def stub_named(name: str) -> Callable:
    """The untouched stub of exercise `name`, as the learner copy defines it (same name, same stub line)."""
    return types.FunctionType(stub.__code__.replace(co_name=name, co_qualname=name), stub.__globals__, name)


def _raise(err: BaseException) -> Callable:
    def answer(*args, **kwargs):
        raise err

    return answer


# Answers no check can be fooled by, and none may blame on the checker ("the checker itself failed").
HOSTILE = {
    "returns None": lambda *a, **k: None,
    "returns 0": lambda *a, **k: 0,
    "returns True": lambda *a, **k: True,
    "returns 0.5": lambda *a, **k: 0.5,
    "returns a string": lambda *a, **k: "x",
    "returns a list": lambda *a, **k: [1, 2],
    "returns a dict": lambda *a, **k: {},
    "returns a 0-d tensor": lambda *a, **k: torch.tensor(0.0),
    "returns a (1,) tensor": lambda *a, **k: torch.zeros(1),
    "returns a (2, 3) tensor": lambda *a, **k: torch.zeros(2, 3),
    "returns an int tensor": lambda *a, **k: torch.arange(4),
    "returns a NaN tensor": lambda *a, **k: torch.full((3,), math.nan),
    "returns a numpy array": lambda *a, **k: np.zeros(3),
    "returns a model": lambda *a, **k: nn.Linear(2, 2),
    "returns a function": lambda *a, **k: (lambda *b: None),
    "returns its first argument": lambda *a, **k: a[0] if a else None,
    "returns an object": lambda *a, **k: object(),
    "raises ValueError": _raise(ValueError("learner's own error")),
    "raises torch's broadcast error": _raise(RuntimeError("The size of tensor a (3) must match the size of tensor b (4) at non-singleton dimension 1")),
    "raises torch's NotImplementedError": _raise(NotImplementedError("\"addmm_impl_cpu_\" not implemented for 'Long'")),
    "calls exit()": lambda *a, **k: sys.exit(1),
    "takes no arguments": lambda: None,
}


def contract_tests(pairs: list[tuple[Callable, Callable]], max_seconds: float = 2.0):
    """Six parametrized tests over a lesson's (check, reference) pairs; a second run of a check takes < max_seconds."""
    ids = [reference.__name__ for _, reference in pairs]

    @pytest.mark.parametrize("check, reference", pairs, ids=ids)
    def test_reference_passes(check, reference, capsys):
        check(reference)
        assert capsys.readouterr().out.strip().endswith(f"PASS {check.exercise_name}: all checks passed")

    @pytest.mark.parametrize("check, reference", pairs, ids=ids)
    def test_stub_is_not_attempted(check, reference):
        name = check.exercise_name
        with pytest.raises(ExerciseNotAttempted, match=f"^{name}: not attempted yet: replace `raise NotImplementedError` in {name}"):
            check(stub_named(name))

    @pytest.mark.parametrize("check, reference", pairs, ids=ids)
    @pytest.mark.parametrize("bad", [None, 3, "fn", nn.Linear(2, 2)], ids=["None", "int", "str", "module"])
    def test_bad_input_is_one_named_line(check, reference, bad):
        with pytest.raises(ExerciseFailed) as info:
            check(bad)
        assert str(info.value).startswith(f"{check.exercise_name}: expected your function")
        assert "\n" not in str(info.value)

    @pytest.mark.parametrize("check, reference", pairs, ids=ids)
    @pytest.mark.parametrize("answer", list(HOSTILE.values()), ids=list(HOSTILE))
    def test_hostile_answers_are_the_learners_fault(check, reference, answer):
        """Whatever a learner's function returns or raises, the verdict is a one-line fail, never a checker failure."""
        verdict = check.verdict(answer)
        assert verdict.status == "failed", verdict
        assert "checker itself failed" not in verdict.reason, verdict.reason
        assert "\n" not in verdict.reason

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
            test_hostile_answers_are_the_learners_fault, test_checks_leave_the_learners_random_state_alone,
            test_checks_are_quick)


def assert_names_fault(check: Callable, wrong: Callable, message: str | None) -> None:
    """A typical wrong answer fails with `message` in one line, without a chained traceback (None: it passes)."""
    if message is None:
        check(wrong)
        return
    with pytest.raises(ExerciseFailed, match=message) as info:
        check(wrong)
    assert not isinstance(info.value, ExerciseNotAttempted)
    assert "\n" not in str(info.value)
    assert info.value.__context__ is None or info.value.__suppress_context__  # no chained traceback from inside the checker
    assert "checker itself failed" not in str(info.value)


def assert_passes(check: Callable, answer: Callable) -> None:
    """A correct answer written differently from the reference passes."""
    verdict = check.verdict(answer)
    assert verdict.passed, verdict.line()
