"""course_utils.tooling.checks: every fault a learner can make becomes one line naming the exercise."""

import pytest
import torch
from torch import nn

from course_utils.tooling.checks import (
    ExerciseFailed,
    ExerciseNotAttempted,
    call,
    exercise,
    expect_equal,
    expect_function,
    expect_module,
    expect_shape,
    expect_tensor,
    expect_unchanged,
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
    assert info.value.__suppress_context__ is True


def test_checker_bug_hides_the_chain():
    @exercise("broken")
    def check_broken(fn):
        1 / 0

    with pytest.raises(ExerciseFailed) as info:
        check_broken(None)
    assert info.value.__cause__ is None
    assert info.value.__suppress_context__ is True


# --- call -------------------------------------------------------------------------------


def test_call_none():
    with pytest.raises(ExerciseFailed, match=r"expected your function, got None: pass the function itself"):
        call(None, 1)


def test_call_not_callable():
    with pytest.raises(ExerciseFailed, match=r"expected your function, got a Tensor: pass the function, do not call it first"):
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


def test_call_lets_not_implemented_through():
    def todo():
        raise NotImplementedError

    with pytest.raises(NotImplementedError):
        call(todo)


# --- expect_tensor ----------------------------------------------------------------------

EXPECTED = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])


def test_expect_tensor_accepts_equal():
    assert expect_tensor(EXPECTED.clone() + 1e-8, EXPECTED) is None


def test_expect_tensor_none():
    with pytest.raises(ExerciseFailed, match=r"your result is None: did you forget to `return` it\?"):
        expect_tensor(None, EXPECTED)


def test_expect_tensor_list():
    with pytest.raises(ExerciseFailed, match=r"is a list, expected a torch.Tensor: build one with torch.stack"):
        expect_tensor([EXPECTED[0], EXPECTED[1]], EXPECTED)


def test_expect_tensor_numpy():
    with pytest.raises(ExerciseFailed, match=r"is a numpy.ndarray, expected a torch.Tensor: convert it with torch.from_numpy"):
        expect_tensor(EXPECTED.numpy(), EXPECTED)


def test_expect_tensor_int():
    with pytest.raises(ExerciseFailed, match=r"^your result is a int, expected a torch.Tensor$"):
        expect_tensor(3, EXPECTED)


def test_expect_tensor_names_non_builtin_type():
    with pytest.raises(ExerciseFailed, match=r"is a torch.nn.modules.linear.Linear, expected a torch.Tensor"):
        expect_tensor(nn.Linear(1, 1), EXPECTED)


def test_expect_tensor_transposed():
    with pytest.raises(ExerciseFailed, match=r"expected shape \(2, 3\), got \(3, 2\): is it transposed\?"):
        expect_tensor(EXPECTED.T, EXPECTED)


def test_expect_tensor_missing_dim():
    expected = EXPECTED.sum(dim=1, keepdim=True)
    with pytest.raises(ExerciseFailed, match=r"expected shape \(2, 1\), got \(2,\): one dimension is missing; keepdim=True"):
        expect_tensor(EXPECTED.sum(dim=1), expected)


def test_expect_tensor_extra_dim():
    with pytest.raises(ExerciseFailed, match=r"one dimension too many"):
        expect_tensor(EXPECTED.unsqueeze(0), EXPECTED)


def test_expect_tensor_same_numel_wrong_shape():
    with pytest.raises(ExerciseFailed, match=r"got \(1, 6\): the right number of elements in the wrong shape"):
        expect_tensor(EXPECTED.reshape(1, 6), EXPECTED)


def test_expect_tensor_int_dtype_for_float():
    with pytest.raises(ExerciseFailed, match=r"expected dtype torch.float32, got torch.int64: integer arithmetic; .*\.float\(\)"):
        expect_tensor(EXPECTED.long(), EXPECTED)


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
    with pytest.raises(ExerciseFailed, match=r"the values are right but in the wrong places"):
        expect_tensor(square.T.contiguous(), square)


def test_expect_tensor_wrong_values_are_not_called_permuted():
    with pytest.raises(ExerciseFailed, match="wrong values") as info:
        expect_tensor(EXPECTED * 2, EXPECTED)
    assert "wrong places" not in str(info.value)


def test_expect_tensor_nan():
    got = EXPECTED.clone()
    got[0, 1] = float("nan")
    with pytest.raises(ExerciseFailed, match=r"your result contains NaN"):
        expect_tensor(got, EXPECTED)


def test_expect_tensor_expected_nan_matches():
    expected = torch.tensor([1.0, float("nan")])
    expect_tensor(expected.clone(), expected)


def test_expect_tensor_ignores_grad():
    expect_tensor(EXPECTED.clone().requires_grad_(), EXPECTED)


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
    with pytest.raises(ExerciseFailed, match=r"is a str, expected a tuple"):
        expect_equal("(2, 3)", (2, 3))


def test_expect_equal_wrong_value():
    with pytest.raises(ExerciseFailed, match=r"^n: expected 3, got 4$"):
        expect_equal(4, 3, what="n")


def test_expect_equal_numbers_mix():
    expect_equal(3.0, 3)
    expect_equal((2, 3), (2, 3))


# --- expect_module ---------------------------------------------------------------------


def _mlp():
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10))


MLP_PARAMS = 64 * 16 + 16 + 16 * 10 + 10


def test_expect_module_passes_and_returns_output():
    out = expect_module(_mlp(), layer_types=[nn.Linear, nn.ReLU], n_params=MLP_PARAMS, example_input=torch.zeros(4, 1, 8, 8), output_shape=(4, 10))
    assert out.shape == (4, 10)


def test_expect_module_class_instead_of_instance():
    with pytest.raises(ExerciseFailed, match=r"is the class Sequential, expected an instance: call it, e\.g\. Sequential\(\)"):
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
