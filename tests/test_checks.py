"""course_utils.tooling.checks: every fault a learner can make becomes one verdict line naming the exercise."""

import sys
import time

import numpy as np
import pytest
import torch
from torch import nn

from course_utils.tooling import checks
from course_utils.tooling.checks import (
    ExerciseFailed,
    ExerciseNotAttempted,
    Verdict,
    call,
    exercise,
    expect_equal,
    expect_function,
    expect_module,
    expect_shape,
    expect_tensor,
    expect_unchanged,
    judge,
    untouched_script,
)

# --- ExerciseFailed itself -------------------------------------------------------------


def test_exercise_failed_str_names_exercise():
    err = ExerciseFailed("expected 3, got 4", "add_one")
    assert str(err) == "add_one: expected 3, got 4"
    assert err.message == "expected 3, got 4"
    assert err.exercise == "add_one"


def test_exercise_failed_without_name_is_just_the_message():
    assert str(ExerciseFailed("bad")) == "bad"


def test_render_traceback_is_one_line():
    lines = ExerciseFailed("expected 3, got 4", "add_one")._render_traceback_()
    assert lines == ["ExerciseFailed: add_one: expected 3, got 4"]
    assert ExerciseNotAttempted("later", "x")._render_traceback_() == ["ExerciseNotAttempted: x: later"]


def test_not_attempted_is_a_failure():
    assert issubclass(ExerciseNotAttempted, ExerciseFailed)


# --- the @exercise decorator -------------------------------------------------------------


def _check(fn, expected):
    """A typical check: call the learner's function and compare."""

    @exercise("double")
    def check_double(learner):
        expect_tensor(call(learner, torch.tensor([1.0, 2.0])), expected)

    return check_double(fn)


def test_exercise_pass_prints_pass_line(capsys):
    _check(lambda x: x * 2, torch.tensor([2.0, 4.0]))
    assert capsys.readouterr().out == "PASS double: all checks passed\n"


def test_exercise_keeps_name_and_metadata():
    @exercise("ex1")
    def check_ex1(fn):
        """Doc."""

    assert check_ex1.exercise_name == "ex1"
    assert check_ex1.__name__ == "check_ex1"
    assert check_ex1.__doc__ == "Doc."


def test_exercise_failure_is_named_and_prints_no_pass(capsys):
    with pytest.raises(ExerciseFailed, match=r"^double: your result: wrong values") as info:
        _check(lambda x: x * 3, torch.tensor([2.0, 4.0]))
    assert info.value.exercise == "double"
    assert type(info.value) is ExerciseFailed
    assert "PASS" not in capsys.readouterr().out


def test_not_implemented_becomes_not_attempted(capsys):
    def double(x):
        raise NotImplementedError()

    with pytest.raises(ExerciseNotAttempted, match=r"^double: not attempted yet: replace `raise NotImplementedError`") as info:
        _check(double, torch.tensor([2.0, 4.0]))
    assert info.value.exercise == "double"
    assert "\n" not in str(info.value)
    assert capsys.readouterr().out == ""


def test_learner_exception_is_one_line_naming_it():
    def double(x):
        raise ValueError("bad input\nsecond line of detail")

    with pytest.raises(ExerciseFailed, match=r"^double: double\(tensor of shape \(2,\)\) raised ValueError: bad input$") as info:
        _check(double, torch.tensor([2.0, 4.0]))
    assert type(info.value) is ExerciseFailed
    assert "\n" not in str(info.value)


def test_learner_exception_without_message():
    def double(x):
        raise ZeroDivisionError

    with pytest.raises(ExerciseFailed, match=r"raised ZeroDivisionError: \(no message\)"):
        _check(double, torch.tensor([2.0, 4.0]))


def test_bug_in_check_is_reported_as_checker_failure():
    @exercise("broken")
    def check_broken(fn):
        {}["missing"]

    with pytest.raises(ExerciseFailed, match=r"^broken: the checker itself failed \(KeyError: 'missing'\); please report this$"):
        check_broken(None)


def test_bug_in_check_with_multiline_error_stays_one_line():
    @exercise("broken")
    def check_broken(fn):
        raise RuntimeError("first line\n  second line\n  third line")

    with pytest.raises(ExerciseFailed, match="checker itself failed") as info:
        check_broken(None)
    assert "\n" not in str(info.value)
    assert "RuntimeError: first line" in str(info.value)
    assert all("\n" not in line for line in info.value._render_traceback_())


@pytest.mark.parametrize(
    "learner",
    [
        lambda x: x * 3,  # wrong answer
        lambda x: (_ for _ in ()).throw(ValueError("boom")),  # learner raises
        lambda x: (_ for _ in ()).throw(NotImplementedError()),  # not attempted
    ],
)
def test_exercise_errors_hide_the_chain(learner):
    """`raise ... from None`: IPython shows no 'During handling of the above exception' chain."""
    with pytest.raises(ExerciseFailed) as info:
        _check(learner, torch.tensor([2.0, 4.0]))
    assert info.value.__cause__ is None
    assert info.value.__context__ is None or info.value.__suppress_context__


def test_checker_bug_hides_the_chain():
    @exercise("broken")
    def check_broken(fn):
        1 / 0

    with pytest.raises(ExerciseFailed) as info:
        check_broken(None)
    assert info.value.__cause__ is None
    assert info.value.__context__ is None or info.value.__suppress_context__


# --- call -------------------------------------------------------------------------------


def test_call_none():
    with pytest.raises(ExerciseFailed, match=r"expected your function, got None: pass it itself"):
        call(None, 1)


def test_call_not_callable():
    with pytest.raises(ExerciseFailed, match=r"expected your function, got a torch.Tensor: pass the function, do not call it first"):
        call(torch.zeros(2), 1)


def test_call_returns_result():
    assert call(lambda a, b=0: a + b, 2, 3) == 5


def test_call_names_modules_and_takes_name_shown_and_hints():
    def broken(model):
        raise RuntimeError("weird internal thing\nsecond line")

    with pytest.raises(ExerciseFailed, match=r"^broken\(a Linear\) raised RuntimeError: weird internal thing$"):
        call(broken, torch.nn.Linear(2, 2))
    with pytest.raises(ExerciseFailed, match=r"^your model\(input of 3\) raised RuntimeError: weird internal thing \(try this\)$"):
        call(broken, 1, name="your model", shown="input of 3", hints={"internal": "try this"})


def test_call_describes_long_list_arguments():
    def total(xs):
        raise TypeError("nope")

    with pytest.raises(ExerciseFailed, match=r"total\(list of 5\) raised TypeError: nope"):
        call(total, [1, 2, 3, 4, 5])


def test_call_lets_the_untouched_stub_through():
    def todo():
        raise NotImplementedError()

    with pytest.raises(NotImplementedError):
        call(todo)


def test_call_reports_torchs_not_implemented_as_an_error():
    """torch raises NotImplementedError for an operator with no kernel for a dtype: that is a failure, named."""
    def swapped(logits, labels):
        return torch.nn.functional.cross_entropy(labels, logits)

    with pytest.raises(ExerciseFailed, match=r"^swapped\(tensor of shape \(4, 3\), tensor of shape \(4,\)\) raised (NotImplementedError|RuntimeError): "):
        call(swapped, torch.randn(4, 3), torch.tensor([0, 1, 2, 0]))


def test_call_refuses_a_model_where_a_function_belongs():
    with pytest.raises(ExerciseFailed, match=r"^expected your function, got a model \(Linear\): pass the function itself, not a module$"):
        call(nn.Linear(2, 2), torch.zeros(1, 2))


def test_call_accepts_a_class_that_builds_the_result():
    assert isinstance(call(nn.Linear, 2, 3), nn.Linear)


def test_call_module_kind():
    assert call(nn.Identity(), 3, kind="module") == 3
    with pytest.raises(ExerciseFailed, match=r"^expected your model, got the class Linear: create one first"):
        call(nn.Linear, 2, kind="module")
    with pytest.raises(ExerciseFailed, match=r"^expected your model \(a torch.nn.Module\), got a function"):
        call(lambda x: x, 2, kind="module")


def test_call_callable_kind_takes_both():
    assert call(nn.Identity(), 3, kind="callable") == 3
    assert call(lambda x: x + 1, 3, kind="callable") == 4


# --- expect_tensor ----------------------------------------------------------------------

EXPECTED = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])


def test_expect_tensor_accepts_equal():
    assert expect_tensor(EXPECTED.clone() + 1e-8, EXPECTED) is None


def test_expect_tensor_none():
    with pytest.raises(ExerciseFailed, match=r"your result is None: did you forget to `return` it\?"):
        expect_tensor(None, EXPECTED)


def test_expect_tensor_list():
    with pytest.raises(ExerciseFailed, match=r"is a list, expected a torch.Tensor$"):
        expect_tensor([EXPECTED[0], EXPECTED[1]], EXPECTED)


def test_expect_tensor_numpy():
    with pytest.raises(ExerciseFailed, match=r"is a numpy.ndarray, expected a torch.Tensor: convert it with torch.from_numpy"):
        expect_tensor(EXPECTED.numpy(), EXPECTED)


def test_expect_tensor_int():
    with pytest.raises(ExerciseFailed, match=r"^your result is an int, expected a torch.Tensor$"):
        expect_tensor(3, EXPECTED)


def test_expect_tensor_names_non_builtin_type():
    with pytest.raises(ExerciseFailed, match=r"is a torch.nn.modules.linear.Linear, expected a torch.Tensor"):
        expect_tensor(nn.Linear(1, 1), EXPECTED)


def test_expect_tensor_transposed():
    with pytest.raises(ExerciseFailed, match=r"expected shape \(2, 3\), got \(3, 2\): is it transposed\?"):
        expect_tensor(EXPECTED.T, EXPECTED)


def test_expect_tensor_missing_size_one_dim():
    expected = EXPECTED.sum(dim=1, keepdim=True)
    with pytest.raises(ExerciseFailed, match=r"expected shape \(2, 1\), got \(2,\): the size-1 dimension 1 is missing \(keepdim=True, or unsqueeze\(1\), keeps it\)$"):
        expect_tensor(EXPECTED.sum(dim=1), expected)


def test_expect_tensor_flattened_is_not_called_a_missing_dim():
    """(2, 3) flattened to (6,): one dimension fewer, but keepdim has nothing to do with it."""
    with pytest.raises(ExerciseFailed, match=r"expected shape \(2, 3\), got \(6,\): the right number of elements, flattened to one dimension$") as info:
        expect_tensor(EXPECTED.flatten(), EXPECTED)
    assert "keepdim" not in str(info.value)


def test_expect_tensor_missing_dim_of_another_size_gets_no_guess():
    """A dimension of size 3 gone: no keepdim advice, just expected and got."""
    with pytest.raises(ExerciseFailed, match=r"expected shape \(2, 3\), got \(2,\)$"):
        expect_tensor(EXPECTED.sum(dim=1), EXPECTED)


def test_expect_tensor_extra_dim():
    with pytest.raises(ExerciseFailed, match=r"got \(1, 2, 3\): an extra size-1 dimension at 0$"):
        expect_tensor(EXPECTED.unsqueeze(0), EXPECTED)


def test_expect_tensor_same_sizes_in_another_order():
    with pytest.raises(ExerciseFailed, match=r"expected shape \(2, 3, 4\), got \(4, 2, 3\): the right sizes in another order$"):
        expect_tensor(torch.zeros(4, 2, 3), torch.zeros(2, 3, 4))


def test_expect_tensor_same_numel_wrong_shape():
    with pytest.raises(ExerciseFailed, match=r"got \(1, 6\): the right number of elements in another shape$"):
        expect_tensor(EXPECTED.reshape(1, 6), EXPECTED)


def test_expect_tensor_different_numel_has_no_hint():
    with pytest.raises(ExerciseFailed, match=r"expected shape \(2, 3\), got \(4, 5\)$"):
        expect_tensor(torch.zeros(4, 5), EXPECTED)


def test_expect_tensor_int_dtype_for_float():
    with pytest.raises(ExerciseFailed, match=r"expected dtype torch.float32, got torch.int64: an integer tensor; convert it with \.float\(\)"):
        expect_tensor(EXPECTED.long(), EXPECTED)


def test_expect_tensor_bool_for_float_is_not_called_integer_arithmetic():
    with pytest.raises(ExerciseFailed, match=r"expected dtype torch.float32, got torch.bool: a comparison gives a bool tensor; convert it with \.to\(dtype\)$") as info:
        expect_tensor(EXPECTED > 3, EXPECTED)
    assert "integer" not in str(info.value)


def test_expect_tensor_float64_for_float32_gets_no_guess():
    with pytest.raises(ExerciseFailed, match=r"expected dtype torch.float32, got torch.float64$"):
        expect_tensor(EXPECTED.double(), EXPECTED)


def test_expect_tensor_none_attribute_gets_no_return_advice():
    with pytest.raises(ExerciseFailed, match=r"^model.bias is None$"):
        expect_tensor(None, EXPECTED, what="model.bias", returned=False)


def test_expect_tensor_bool_dtype_hint():
    with pytest.raises(ExerciseFailed, match=r"expected dtype torch.bool, got torch.int64: a comparison such as x > 0"):
        expect_tensor((EXPECTED > 3).long(), EXPECTED > 3)


def test_expect_tensor_dtype_check_can_be_skipped():
    expect_tensor(EXPECTED.double(), EXPECTED, check_dtype=False)


def test_expect_tensor_wrong_value_names_index_and_values():
    got = EXPECTED.clone()
    got[1, 2] = 7.5
    with pytest.raises(ExerciseFailed, match=r"^x: wrong values, e\.g\. at index \(1, 2\) expected 6, got 7\.5$"):
        expect_tensor(got, EXPECTED, what="x")


def test_expect_tensor_wrong_value_in_scalar():
    with pytest.raises(ExerciseFailed, match=r"at index \(\) expected 2, got 3"):
        expect_tensor(torch.tensor(3.0), torch.tensor(2.0))


def test_expect_tensor_tolerance():
    expect_tensor(EXPECTED + 1e-3, EXPECTED, atol=1e-2)
    with pytest.raises(ExerciseFailed, match="wrong values"):
        expect_tensor(EXPECTED + 1e-3, EXPECTED)


def test_expect_tensor_permuted_values():
    """reshape where transpose was meant: same values, wrong places."""
    square = torch.arange(9.0).reshape(3, 3)
    with pytest.raises(ExerciseFailed, match=r"the right values in the wrong places$"):
        expect_tensor(square.T.contiguous(), square)


def test_expect_tensor_wrong_values_are_not_called_permuted():
    with pytest.raises(ExerciseFailed, match="wrong values") as info:
        expect_tensor(EXPECTED * 2, EXPECTED)
    assert "wrong places" not in str(info.value)


def test_expect_tensor_nan():
    got = EXPECTED.clone()
    got[0, 1] = float("nan")
    with pytest.raises(ExerciseFailed, match=r"^your result contains NaN where no value should be NaN$"):
        expect_tensor(got, EXPECTED)


def test_expect_tensor_expected_nan_matches():
    expected = torch.tensor([1.0, float("nan")])
    expect_tensor(expected.clone(), expected)


def test_expect_tensor_ignores_grad():
    expect_tensor(EXPECTED.clone().requires_grad_(), EXPECTED)


class _AlwaysClose(torch.Tensor):
    """A learner's tensor subclass that answers the comparisons judging it."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in (torch.allclose, torch.equal, torch.Tensor.allclose, torch.Tensor.equal):
            return True
        return super().__torch_function__(func, types, args, kwargs or {})


def test_expect_tensor_refuses_a_tensor_subclass_that_answers_its_own_comparisons():
    wrong = torch.zeros(2, 3).as_subclass(_AlwaysClose)
    assert torch.allclose(wrong, torch.ones(2, 3))  # the attack: it would have passed
    with pytest.raises(ExerciseFailed, match=r"^r is a torch.Tensor subclass \(.*_AlwaysClose\): return a plain tensor$"):
        expect_tensor(wrong, torch.ones(2, 3), what="r")
    with pytest.raises(ExerciseFailed, match=r"torch.Tensor subclass"):
        expect_shape(wrong, (2, 3))


def test_expect_tensor_takes_torchs_own_tensor_types():
    expect_tensor(nn.Parameter(EXPECTED.clone()), EXPECTED)
    expect_shape(nn.Parameter(torch.zeros(2, 3)), (2, 3))
    expect_tensor(nn.Linear(2, 3).weight.detach(), torch.zeros(3, 2), atol=10)


def test_expect_shape_only():
    expect_shape(torch.zeros(2, 3), (2, 3))
    with pytest.raises(ExerciseFailed, match=r"expected shape \(2, 3\), got \(3, 2\)"):
        expect_shape(torch.zeros(3, 2), (2, 3))


# --- expect_equal ---------------------------------------------------------------------


def test_expect_equal_tensor_for_int_says_item():
    with pytest.raises(ExerciseFailed, match=r"is a tensor, expected a Python int: call \.item\(\) on it"):
        expect_equal(torch.tensor(3), 3)


def test_expect_equal_none():
    with pytest.raises(ExerciseFailed, match=r"forget to `return`"):
        expect_equal(None, "cpu")


def test_expect_equal_wrong_type():
    with pytest.raises(ExerciseFailed, match=r"is a str \('\(2, 3\)'\), expected a tuple"):
        expect_equal("(2, 3)", (2, 3))


def test_expect_equal_wrong_value():
    with pytest.raises(ExerciseFailed, match=r"^n: expected 3, got 4$"):
        expect_equal(4, 3, what="n")


def test_expect_equal_type_must_match_exactly():
    """The prompt said "a Python int": 3.0 is not one, and neither is True or numpy's int64."""
    expect_equal((2, 3), (2, 3))
    with pytest.raises(ExerciseFailed, match=r"^n is a float \(3.0\), expected an int$"):
        expect_equal(3.0, 3, what="n")
    with pytest.raises(ExerciseFailed, match=r"^n is a bool \(True\), expected an int$"):
        expect_equal(True, 1, what="n")
    with pytest.raises(ExerciseFailed, match=r"^n is a numpy.int64, expected a Python int: convert it with int\(...\)$"):
        expect_equal(np.int64(3), 3, what="n")
    with pytest.raises(ExerciseFailed, match=r"^x is an int \(2\), expected a float$"):
        expect_equal(2, 2.0, what="x")


class _EqualsAnything(int):
    __module__ = "__main__"  # as if defined in a notebook cell

    def __eq__(self, other):
        return True

    def __ne__(self, other):
        return False

    __hash__ = int.__hash__


def test_expect_equal_refuses_items_of_a_learners_class_inside_containers():
    """A tuple's equality asks its items, and a subclass's __eq__ would answer for them."""
    with pytest.raises(ExerciseFailed, match=r"^t holds a __main__._EqualsAnything \(1\) where an int belongs: return plain values$"):
        expect_equal((_EqualsAnything(1), 2), (5, 2), what="t")
    with pytest.raises(ExerciseFailed, match=r"holds a .*_EqualsAnything"):
        expect_equal({"a": [_EqualsAnything(1)]}, {"a": [3]})
    with pytest.raises(ExerciseFailed, match=r"holds a .*_EqualsAnything"):
        expect_equal({_EqualsAnything(1): "x"}, {2: "x"})


def test_expect_equal_still_takes_librarys_values_inside_containers():
    expect_equal((np.int64(2), 3), (2, 3))  # as before: equal values, the container's type matches
    expect_equal({"a": [1, (2, "b")]}, {"a": [1, (2, "b")]})
    with pytest.raises(ExerciseFailed, match=r"expected \(2, 4\), got \(2, 3\)"):
        expect_equal((2, 3), (2, 4))


# --- expect_module ---------------------------------------------------------------------


def _mlp():
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10))


MLP_PARAMS = 64 * 16 + 16 + 16 * 10 + 10


def test_expect_module_passes_and_returns_output():
    out = expect_module(_mlp(), layer_types=[nn.Linear, nn.ReLU], n_params=MLP_PARAMS, example_input=torch.zeros(4, 1, 8, 8), output_shape=(4, 10))
    assert out.shape == (4, 10)


def test_expect_module_class_instead_of_instance():
    with pytest.raises(ExerciseFailed, match=r"is the class Sequential, expected an instance: create one, e\.g\. Sequential\(...\)"):
        expect_module(nn.Sequential)


def test_expect_module_none_and_wrong_type():
    with pytest.raises(ExerciseFailed, match="forget to `return`"):
        expect_module(None)
    with pytest.raises(ExerciseFailed, match=r"is a function, expected a torch.nn.Module"):
        expect_module(lambda x: x)


def test_expect_module_wrong_param_count():
    with pytest.raises(ExerciseFailed, match=r"your model has 1,210 trainable parameters, expected 1,000"):
        expect_module(_mlp(), n_params=1000)


def test_expect_module_counts_only_trainable():
    model = _mlp()
    model[1].requires_grad_(False)
    expect_module(model, n_params=16 * 10 + 10)


def test_expect_module_missing_layer():
    with pytest.raises(ExerciseFailed, match=r"your model has no Conv2d layer"):
        expect_module(_mlp(), layer_types=[nn.Linear, nn.Conv2d])


def test_expect_module_wrong_output_shape():
    with pytest.raises(ExerciseFailed, match=r"your model's output for an input of shape \(4, 1, 8, 8\): expected shape \(4, 5\), got \(4, 10\)"):
        expect_module(_mlp(), example_input=torch.zeros(4, 1, 8, 8), output_shape=(4, 5))


def test_expect_module_forward_error_is_one_line():
    with pytest.raises(ExerciseFailed, match=r"raised RuntimeError: mat1 and mat2 shapes cannot be multiplied") as info:
        expect_module(_mlp(), example_input=torch.zeros(4, 1, 4, 4), output_shape=(4, 10))
    assert "\n" not in str(info.value)


# --- expect_function / expect_unchanged ---------------------------------------------------


def _reference(x, k):
    return x * k


CASES = [(torch.tensor([1.0, 2.0]), 2), (torch.zeros(3), 5), (torch.tensor([[1.0, -1.0]]), -3)]


def test_expect_function_matches_reference():
    def scale(x, k):
        return k * x

    expect_function(scale, _reference, CASES)


def test_expect_function_names_failing_case():
    def scale(x, k):
        return x * abs(k)

    with pytest.raises(ExerciseFailed, match=r"^scale\(tensor of shape \(1, 2\), -3\): wrong values"):
        expect_function(scale, _reference, CASES)


def test_expect_function_plain_values():
    def count(x):
        return int((x > 0).sum())

    expect_function(count, lambda x: int((x > 0).sum()), [(torch.tensor([1.0, -1.0, 2.0]),)])

    def count_tensor(x):
        return (x > 0).sum()

    with pytest.raises(ExerciseFailed, match=r"count_tensor\(tensor of shape \(3,\)\) is a tensor, expected a Python int"):
        expect_function(count_tensor, lambda x: int((x > 0).sum()), [(torch.tensor([1.0, -1.0, 2.0]),)])


def test_expect_function_learner_mutation_does_not_change_reference_input():
    """Each side gets its own copy: a learner who mutates x in place must not corrupt the reference."""

    def scale(x, k):
        x.mul_(k)
        return x

    expect_function(scale, _reference, CASES)


def test_expect_function_passes_tolerances():
    def scale(x, k):
        return x * k + 1e-3

    expect_function(scale, _reference, CASES, atol=1e-2)
    with pytest.raises(ExerciseFailed, match="wrong values"):
        expect_function(scale, _reference, CASES)


def test_expect_unchanged_detects_in_place():
    x = torch.tensor([1.0, 2.0])
    before = x.clone()
    x.mul_(2)
    with pytest.raises(ExerciseFailed, match=r"^your function modified its input in place"):
        expect_unchanged(before, x)


def test_expect_unchanged_accepts_untouched():
    x = torch.tensor([1.0, 2.0])
    expect_unchanged(x.clone(), x)


def test_exercise_leaves_the_global_random_state_alone():
    """A check that seeds or draws random numbers must not shift the learner's later cells."""
    @exercise("draws")
    def check_draws(fn):
        torch.manual_seed(123)
        fn(torch.rand(5))

    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    check_draws(lambda x: x)
    assert torch.equal(torch.rand(3), expected)


# --- verdicts: what counts as not attempted, whose error it is, time limits -----------------


def _exercise_named(name):
    @exercise(name)
    def check(fn):
        expect_tensor(call(fn, torch.tensor([1.0, 2.0])), torch.tensor([2.0, 4.0]))

    return check


def test_only_the_untouched_stub_is_not_attempted():
    def double(x):
        # YOUR CODE HERE
        raise NotImplementedError()

    verdict = _exercise_named("double").verdict(double)
    assert verdict == Verdict("double", "not attempted", "not attempted yet: replace `raise NotImplementedError` in double with your code")


SKELETON = """import argparse


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    # YOUR CODE HERE
    raise NotImplementedError()


if __name__ == "__main__":
    main()
"""


@pytest.mark.parametrize("text, untouched", [
    (SKELETON, True),
    (SKELETON.replace("    args = parser.parse_args()\n", ""), False),  # no parse_args: the parser lines are code of the learner's
    (SKELETON.replace("    # YOUR CODE HERE\n", "    print(args.epochs)\n"), False),  # a start, then the stub
    (SKELETON.replace("raise NotImplementedError()", "raise NotImplementedError('later')"), False),
    (SKELETON.replace("def main()", "def train()"), False),  # no main(): nothing to tell from
    (SKELETON.replace("def main() -> None:", "def main() -> None"), False),  # does not parse
], ids=["the skeleton", "no parse_args", "a line added", "another raise", "no main", "a syntax error"])
def test_untouched_script_reads_only_the_skeleton_as_untouched(tmp_path, text, untouched):
    script = tmp_path / "train.py"
    script.write_text(text)
    assert untouched_script(script) is untouched


def test_untouched_script_of_a_missing_file_is_false(tmp_path):
    assert untouched_script(tmp_path / "missing.py") is False


def test_a_stub_reached_in_another_function_says_where(tmp_path, monkeypatch):
    """The stub of another cell's function: not this exercise's, so say where it is."""
    (tmp_path / "other_cell.py").write_text("def helper(x):\n    # YOUR CODE HERE\n    raise NotImplementedError()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from other_cell import helper

    def double(x):
        return helper(x) * 2

    verdict = _exercise_named("double").verdict(double)
    assert verdict.status == "not attempted"
    assert verdict.reason == "not attempted yet: your code reaches the `raise NotImplementedError()` stub in helper"


@pytest.mark.parametrize("raising", [
    lambda x: torch.nn.functional.log_softmax(x.long(), dim=0),              # torch's own NotImplementedError / RuntimeError
    lambda x: (_ for _ in ()).throw(NotImplementedError("not yet, says me")),  # a message: not the stub
])
def test_any_other_not_implemented_error_is_a_failure(raising):
    verdict = _exercise_named("double").verdict(raising)
    assert verdict.status == "failed"
    assert "not attempted" not in verdict.reason
    assert "raised" in verdict.reason


def test_learner_error_outside_call_is_the_learners(tmp_path, monkeypatch):
    """A check that calls the learner's model directly: the error in its forward is named as the learner's."""
    (tmp_path / "learner_cell.py").write_text(
        "import torch\nfrom torch import nn\n\n\nclass Broken(nn.Module):\n    def forward(self, x):\n        return x @ torch.zeros(5, 5)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    from learner_cell import Broken

    @exercise("make_model")
    def check_make_model(fn):
        model = call(fn)
        model(torch.zeros(2, 3))  # no `call` around it

    verdict = check_make_model.verdict(lambda: Broken())
    assert verdict.status == "failed"
    assert verdict.reason.startswith("your code raised RuntimeError: mat1 and mat2 shapes cannot be multiplied")
    assert verdict.reason.endswith("(in forward, line 7)")


def test_an_error_in_the_check_itself_is_the_checkers():
    @exercise("broken")
    def check_broken(fn):
        value = call(fn)
        value.shape  # a check that forgot to test the type first

    verdict = check_broken.verdict(lambda: 3)
    assert verdict.reason == "the checker itself failed (AttributeError: 'int' object has no attribute 'shape'); please report this"


def test_endless_loop_is_stopped_at_the_time_limit(monkeypatch):
    monkeypatch.setenv("COURSE_EXERCISE_SECONDS", "0.3")

    def double(x):
        while True:
            try:
                pass
            except Exception:  # a learner's broad except must not swallow the time limit
                pass

    start = time.monotonic()
    verdict = _exercise_named("double").verdict(double)
    assert time.monotonic() - start < 5
    assert verdict == Verdict("double", "failed", "took longer than 0.3 s: an endless loop?")


def test_time_limit_is_cleared_after_the_check(monkeypatch):
    monkeypatch.setenv("COURSE_EXERCISE_SECONDS", "0.2")
    assert _exercise_named("double").verdict(lambda x: x * 2).passed
    time.sleep(0.4)  # no alarm may fire later


def test_exit_in_learner_code_is_a_failure():
    verdict = _exercise_named("double").verdict(lambda x: sys.exit(3))
    assert verdict == Verdict("double", "failed", "your code called exit() (SystemExit: 3): return a value instead")


def test_a_keyboard_interrupt_raised_by_the_learners_code_is_a_verdict_line():
    def double(x):
        raise KeyboardInterrupt

    verdict = _exercise_named("double").verdict(double)
    assert verdict == Verdict("double", "failed", "double(tensor of shape (2,)) raised KeyboardInterrupt: (no message) "
                                                  "(KeyboardInterrupt is what Ctrl-C raises: return a value, or raise an ordinary exception)")


def test_a_real_interrupt_still_stops_the_check():
    """Ctrl-C (SIGINT) while the learner's code runs is not the learner's doing: it must stop the cell."""
    import os
    import signal
    import threading

    def double(x):
        while True:
            time.sleep(0.01)

    # Python's own Ctrl-C handler, as in a kernel: not whatever an earlier test in this process left installed.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
        with pytest.raises(KeyboardInterrupt):
            _exercise_named("double").verdict(double)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert _exercise_named("double").verdict(lambda x: x * 2).passed  # and the next check is not taken for interrupted


def test_call_outside_a_check_lets_keyboard_interrupt_through():
    def raises():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        call(raises)


# --- the time limit holds against learner code that fights it ------------------------------


def _swallows(x):
    while True:
        try:
            time.sleep(0.1)
        except BaseException:  # a retry loop that catches the time limit too
            pass


def _own_alarm_handler(x):
    import signal

    signal.signal(signal.SIGALRM, lambda signum, frame: None)
    while True:
        time.sleep(0.1)


def _own_alarm_handler_and_swallows(x):
    import signal

    signal.signal(signal.SIGALRM, lambda signum, frame: None)
    _swallows(x)


def _cancels_the_timer_and_spins(x):
    import signal

    signal.setitimer(signal.ITIMER_REAL, 0)
    n = 0
    while True:
        try:
            n += 1
        except BaseException:
            pass


def _swallows_at_two_levels(x):
    for _ in range(10_000):
        try:
            _swallows(x)
        except BaseException:
            pass


def _sleeps_long_with_its_own_handler(x):
    import signal

    signal.signal(signal.SIGALRM, lambda signum, frame: None)
    time.sleep(60)


@pytest.mark.parametrize("learner", [_swallows, _own_alarm_handler, _own_alarm_handler_and_swallows,
                                     _cancels_the_timer_and_spins, _swallows_at_two_levels, _sleeps_long_with_its_own_handler])
def test_the_time_limit_holds_against_code_that_swallows_or_replaces_it(monkeypatch, learner):
    import signal

    monkeypatch.setenv("COURSE_EXERCISE_SECONDS", "0.5")
    handler, trace, profile = signal.getsignal(signal.SIGALRM), sys.gettrace(), sys.getprofile()
    start = time.monotonic()
    verdict = _exercise_named("double").verdict(learner)
    assert time.monotonic() - start < 0.5 + 1.5
    assert verdict == Verdict("double", "failed", "took longer than 0.5 s: an endless loop?")
    # everything as it was: the handler before the check, no timer, no trace or profile function
    assert signal.getsignal(signal.SIGALRM) is handler and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert (sys.gettrace(), sys.getprofile()) == (trace, profile)
    time.sleep(0.3)  # no alarm or nudge may arrive later
    assert _exercise_named("double").verdict(lambda x: x * 2).passed


def test_a_check_that_ends_in_time_leaves_no_trace_or_watchdog(monkeypatch):
    import threading

    monkeypatch.setenv("COURSE_EXERCISE_SECONDS", "0.2")
    trace, profile = sys.gettrace(), sys.getprofile()
    assert _exercise_named("double").verdict(lambda x: x * 2).passed
    assert not [t for t in threading.enumerate() if t.name == "course-time-limit"]
    assert (sys.gettrace(), sys.getprofile()) == (trace, profile)


# --- the same in a real kernel, as JupyterLab runs it ------------------------------------------

LAB_CHECK = """
import time, torch
from course_utils.tooling.checks import call, exercise, expect_tensor

@exercise("double")
def check_double(fn):
    expect_tensor(call(fn, torch.tensor([1.0, 2.0])), torch.tensor([2.0, 4.0]))
"""


@pytest.fixture(scope="module")
def lab_kernel(tmp_path_factory):
    """A kernel started as JupyterLab starts one (no COURSE_CHECKER), with a 1 s limit per check."""
    import os

    from jupyter_client.manager import start_new_kernel

    env = {k: v for k, v in os.environ.items() if k not in ("COURSE_CHECKER", "COURSE_WORK_DIR")}
    env["COURSE_EXERCISE_SECONDS"] = "1"
    km, kc = start_new_kernel(kernel_name="python3", env=env, cwd=str(tmp_path_factory.mktemp("lab")))
    try:
        assert kc.execute_interactive(LAB_CHECK, timeout=120)["content"]["status"] == "ok"
        yield km, kc
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def _run_cell(kc, code: str, timeout: float = 60) -> tuple[dict, list[str], float]:
    """(the execute reply's content, every text/plain shown, seconds taken) for one cell."""
    shown = []

    def keep(msg):
        if msg["msg_type"] in ("display_data", "execute_result"):
            shown.append(msg["content"]["data"].get("text/plain", ""))

    start = time.monotonic()
    reply = kc.execute_interactive(code, timeout=timeout, output_hook=keep)
    return reply["content"], shown, time.monotonic() - start


@pytest.mark.parametrize("body", [
    "    while True:\n        try:\n            time.sleep(0.1)\n        except BaseException:\n            pass\n",
    "    import signal\n    signal.signal(signal.SIGALRM, lambda s, f: None)\n    while True:\n        try:\n            time.sleep(0.1)\n"
    "        except BaseException:\n            pass\n",
], ids=["swallows", "own-handler-and-swallows"])
def test_in_jupyterlab_a_check_ends_within_its_limit_whatever_the_learners_code_does(lab_kernel, body):
    _, kc = lab_kernel
    reply, shown, seconds = _run_cell(kc, f"def double(x):\n{body}\ncheck_double(double)\nprint('next line runs')")
    assert reply["status"] == "ok" and seconds < 1 + 1.5
    assert shown == ["FAIL double: took longer than 1 s: an endless loop?"]
    reply, shown, _ = _run_cell(kc, "check_double(lambda x: x * 2)")  # the kernel is fine afterwards
    assert shown == ["PASS double: all checks passed"]


def test_in_jupyterlab_a_raised_keyboard_interrupt_is_a_verdict_and_a_real_one_stops_the_cell(lab_kernel):
    km, kc = lab_kernel
    reply, shown, _ = _run_cell(kc, "def double(x):\n    raise KeyboardInterrupt\ncheck_double(double)")
    assert reply["status"] == "ok"
    assert shown[0].startswith("FAIL double: double(tensor of shape (2,)) raised KeyboardInterrupt")
    import threading

    threading.Timer(1.0, km.interrupt_kernel).start()  # the learner presses Interrupt (the limit is 1 s: set a longer one)
    reply, shown, _ = _run_cell(kc, "import os\nos.environ['COURSE_EXERCISE_SECONDS'] = '30'\n"
                                    "def double(x):\n    while True:\n        time.sleep(0.05)\ncheck_double(double)")
    assert reply["status"] == "error" and reply["ename"] == "KeyboardInterrupt" and shown == []
    _run_cell(kc, "os.environ['COURSE_EXERCISE_SECONDS'] = '1'")


def test_verdict_line():
    assert Verdict("x", "passed").line() == "PASS x: all checks passed"
    assert Verdict("x", "failed", "wrong").line() == "FAIL x: wrong"
    assert Verdict("x", "not attempted", "later").line() == "TODO x: later"


def test_judge_returns_without_raising_or_printing(capsys):
    def check(fn):
        raise ExerciseFailed("nope")

    assert judge(check, "x", None) == Verdict("x", "failed", "nope")
    assert capsys.readouterr().out == ""


# --- where the verdict goes: raised under the checker, shown in JupyterLab, recorded ----------


class FakeShell:
    def __init__(self):
        self.kernel = object()


@pytest.fixture
def in_jupyterlab(monkeypatch):
    """A kernel that the checker did not start: what a learner has in JupyterLab."""
    import IPython
    import IPython.display

    shown = []
    monkeypatch.delenv("COURSE_CHECKER", raising=False)
    monkeypatch.setattr(IPython, "get_ipython", lambda: FakeShell())
    monkeypatch.setattr(IPython.display, "display", lambda obj, raw=False: shown.append(obj))
    return shown


def checks_stub(x):
    raise NotImplementedError()


def test_under_the_checker_a_verdict_raises(monkeypatch):
    monkeypatch.setenv("COURSE_CHECKER", "1")
    with pytest.raises(ExerciseNotAttempted, match="^double: not attempted yet: replace `raise NotImplementedError` in double"):
        _exercise_named("double")(checks_stub)
    with pytest.raises(ExerciseFailed, match="^double: your result: wrong values"):
        _exercise_named("double")(lambda x: x * 3)


def test_in_jupyterlab_a_check_shows_one_line_and_never_raises(in_jupyterlab):
    check = _exercise_named("double")
    check(lambda x: x * 3)
    check(checks_stub)
    check(lambda x: x * 2)
    plain = [obj["text/plain"] for obj in in_jupyterlab]
    assert plain[0].startswith("FAIL double: your result: wrong values")
    assert plain[1].startswith("TODO double: not attempted yet")
    assert plain[2] == "PASS double: all checks passed"
    assert all("course-verdict" in obj["text/html"] for obj in in_jupyterlab)


def test_checker_running_outside_ipython(monkeypatch):
    monkeypatch.delenv("COURSE_CHECKER", raising=False)
    import IPython

    monkeypatch.setattr(IPython, "get_ipython", lambda: None)
    assert checks.checker_running()
    monkeypatch.setattr(IPython, "get_ipython", lambda: FakeShell())
    assert not checks.checker_running()
    monkeypatch.setenv("COURSE_CHECKER", "1")
    assert checks.checker_running()


def test_a_lessons_check_records_its_verdict(monkeypatch):
    from course_utils.tooling import progress

    monkeypatch.setattr(progress, "_session", {})

    def check(fn):
        pass

    check.__module__ = "course_utils.lesson42"
    decorated = exercise("thing")(check)
    decorated(None)
    assert progress._session == {"42": {"thing": Verdict("thing", "passed")}}
    decorated.verdict(None)  # asking for a verdict records nothing new
    assert list(progress._session["42"]) == ["thing"]


def test_lesson_of_module():
    assert checks.lesson_of_module("course_utils.lesson07") == "07"
    assert checks.lesson_of_module("course_utils.training") is None


def test_a_stub_in_the_exercises_own_cell_is_the_exercise_not_attempted(tmp_path, monkeypatch):
    """An exercise whose stub sits in a method of a class defined in the same cell (an autograd Function's backward)."""
    (tmp_path / "cell.py").write_text(
        "class Op:\n    @staticmethod\n    def backward(x):\n        # YOUR CODE HERE\n        raise NotImplementedError()\n\n\n"
        "def double(x):\n    return Op.backward(x)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    from cell import double

    assert _exercise_named("double").verdict(double).reason == (
        "not attempted yet: replace `raise NotImplementedError` in double with your code"
    )


def test_a_check_runs_on_one_thread_and_restores_the_count():
    seen = []

    @exercise("threads")
    def check(fn):
        seen.append(torch.get_num_threads())

    before = torch.get_num_threads()
    check.verdict(None)
    assert seen == [1] and torch.get_num_threads() == before
