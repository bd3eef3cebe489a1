"""The exercise checker: checks that raise one-line, named errors instead of comparing outputs.

A lesson module decorates each check with @exercise("name"). Inside, the check
calls the learner's code through `call`, and compares what came back with
`expect_tensor`, `expect_module`, `expect_function` or `expect_equal`. Whatever
goes wrong, the learner sees one line naming the exercise and the fault, never a
traceback from inside the checker.
"""

import functools
import inspect
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch
from torch import nn

PASS_MARK = "PASS"
NOT_ATTEMPTED = "not attempted yet"


class ExerciseFailed(Exception):
    """A learner's answer is wrong; str() gives 'exercise: what is wrong'."""

    def __init__(self, message: str, exercise: str | None = None):
        super().__init__(message)
        self.message = message
        self.exercise = exercise

    def __str__(self) -> str:
        return f"{self.exercise}: {self.message}" if self.exercise else self.message

    # IPython shows these lines instead of a traceback, in JupyterLab and under nbval.
    def _render_traceback_(self) -> list[str]:
        return [f"{type(self).__name__}: {self}"]


class ExerciseNotAttempted(ExerciseFailed):
    """The learner's function still raises NotImplementedError."""


def exercise(name: str) -> Callable:
    """Decorate a check: name its failures, turn any exception into one line, leave the RNG alone, print a pass line."""

    def decorate(check: Callable) -> Callable:
        @functools.wraps(check)
        def run(*args, **kwargs) -> None:
            try:
                # Checks seed their own hidden cases; the learner's later cells must draw the same numbers.
                with torch.random.fork_rng(devices=[]):
                    check(*args, **kwargs)
            except ExerciseFailed as err:
                raise type(err)(err.message, exercise=name) from None
            except NotImplementedError:
                raise _not_attempted(name) from None
            except Exception as err:  # a bug in the checker itself; still one line
                raise ExerciseFailed(f"the checker itself failed ({type(err).__name__}: {_first_line(err)}); please report this", name) from None
            print(f"{PASS_MARK} {name}: all checks passed")

        run.exercise_name = name
        return run

    return decorate


def _not_attempted(name: str) -> ExerciseNotAttempted:
    return ExerciseNotAttempted(f"{NOT_ATTEMPTED}: replace `raise NotImplementedError` in {name} with your code", name)


def call(
    fn: Any,
    *args,
    name: str | None = None,
    shown: str | None = None,
    hints: dict[str, str] | None = None,
) -> Any:
    """Call the learner's function (or module) on args; report a missing one, or an error inside it, in one line.

    `name` and `shown` replace the function's name and the description of its
    arguments in that line; `hints` adds {text in the error: advice} to ERROR_HINTS.
    """
    if fn is None:
        raise ExerciseFailed("expected your function, got None: pass the function itself, e.g. check_x(x)")
    if not callable(fn):
        raise ExerciseFailed(f"expected your function, got a {type(fn).__name__}: pass the function, do not call it first")
    try:
        return fn(*args)
    except NotImplementedError:
        raise
    except Exception as err:
        label = name or getattr(fn, "__name__", None) or f"your {type(fn).__name__}"
        where = f"{label}({_describe_args(args) if shown is None else shown})"
        advice = _error_hint(err, {**ERROR_HINTS, **(hints or {})})
        raise ExerciseFailed(f"{where} raised {type(err).__name__}: {_first_line(err)}{advice}") from None


# Torch's wording of common shape errors, and what they usually mean in a learner's code.
ERROR_HINTS = {
    "must match the size of tensor": "shapes that do not broadcast; a reduction without keepdim=True?",
    "shapes cannot be multiplied": "for a @ b the last dim of a must equal the first of b; transpose one?",
    "view size is not compatible": "view() needs contiguous memory; use reshape() or .contiguous()",
    "expected scalar type": "mixed dtypes; convert one side with .to(other.dtype)",
    "Expected all tensors to be on the same device": "move both operands to one device with .to(device)",
}


def _error_hint(err: Exception, hints: dict[str, str] = ERROR_HINTS) -> str:
    text = str(err)
    return next((f" ({hint})" for key, hint in hints.items() if key in text), "")


def _first_line(err: Exception) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else "(no message)"


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor of shape {tuple(value.shape)}"
    if isinstance(value, nn.Module):
        return f"a {type(value).__name__}"
    if isinstance(value, dict) and len(value) > 3:
        return f"dict of {len(value)} entries"
    if isinstance(value, (list, tuple)) and len(value) > 3:
        return f"{type(value).__name__} of {len(value)}"
    return repr(value)


def _describe_args(args: Sequence[Any]) -> str:
    return ", ".join(_describe(a) for a in args)


def type_name(value: Any) -> str:
    """A value's type as a learner would write it: int, list, torch.Tensor, numpy.ndarray."""
    kind = type(value)
    return kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def expect_tensor(
    got: Any,
    expected: torch.Tensor,
    *,
    what: str = "your result",
    atol: float = 1e-6,
    rtol: float = 1e-5,
    check_dtype: bool = True,
    check_device: bool = True,
) -> None:
    """Compare a learner's tensor with the expected one: type, shape, dtype, device, then values."""
    if got is None:
        raise ExerciseFailed(f"{what} is None: did you forget to `return` it?")
    if isinstance(got, np.ndarray):
        raise ExerciseFailed(f"{what} is a numpy.ndarray, expected a torch.Tensor: convert it with torch.from_numpy(...)")
    if isinstance(got, (list, tuple)):
        raise ExerciseFailed(
            f"{what} is a {type(got).__name__}, expected a torch.Tensor: build one with torch.stack(...) or torch.tensor(...)"
        )
    if not isinstance(got, torch.Tensor):
        raise ExerciseFailed(f"{what} is a {type_name(got)}, expected a torch.Tensor")
    shape = tuple(got.shape)
    expect_shape(got, expected.shape, what=what)
    if check_dtype and got.dtype != expected.dtype:
        raise ExerciseFailed(f"{what}: expected dtype {expected.dtype}, got {got.dtype}{_dtype_hint(got.dtype, expected.dtype)}")
    if check_device and got.device.type != expected.device.type:
        raise ExerciseFailed(f"{what}: expected it on device {expected.device.type}, got {got.device.type}")
    a = got.detach().to("cpu", torch.float64)
    b = expected.detach().to("cpu", torch.float64)
    if torch.isnan(a).any() and not torch.isnan(b).any():
        raise ExerciseFailed(f"{what} contains NaN: a division by zero or a log of a negative number?")
    if not torch.allclose(a, b, atol=atol, rtol=rtol, equal_nan=True):
        diff = (a - b).abs().nan_to_num(nan=float("inf"))
        index = tuple(int(i) for i in np.unravel_index(int(diff.argmax()), shape)) if shape else ()
        hint = ""
        if a.numel() > 1 and torch.allclose(a.flatten().sort().values, b.flatten().sort().values, atol=atol, rtol=rtol):
            hint = ": the values are right but in the wrong places; did you reshape/view where permute/transpose was needed?"
        raise ExerciseFailed(
            f"{what}: wrong values, e.g. at index {index} expected {b[index].item():.6g}, got {a[index].item():.6g}{hint}"
        )


def _shape_hint(got: tuple, want: tuple) -> str:
    if len(got) == 2 and got == want[::-1]:
        return ": is it transposed?"
    if len(got) == len(want) - 1:
        return ": one dimension is missing; keepdim=True or unsqueeze may help"
    if len(got) == len(want) + 1:
        return ": one dimension too many; did you forget squeeze, or stack where cat was meant?"
    if int(np.prod(got)) == int(np.prod(want)):
        return ": the right number of elements in the wrong shape"
    return ""


def _dtype_hint(got: torch.dtype, want: torch.dtype) -> str:
    if want.is_floating_point and not got.is_floating_point:
        return ": integer arithmetic; create the tensor with dtype=torch.float32 or call .float()"
    if want == torch.bool:
        return ": a comparison such as x > 0 gives a bool tensor"
    return ""


def expect_equal(got: Any, expected: Any, *, what: str = "your result") -> None:
    """Compare plain Python values (ints, strings, tuples), naming both on a mismatch."""
    if isinstance(expected, (int, float)) and isinstance(got, torch.Tensor):
        raise ExerciseFailed(f"{what} is a tensor, expected a Python {type(expected).__name__}: call .item() on it")
    if got is None and expected is not None:
        raise ExerciseFailed(f"{what} is None: did you forget to `return` it?")
    if type(got) is not type(expected) and not (isinstance(got, (int, float)) and isinstance(expected, (int, float))):
        raise ExerciseFailed(f"{what} is a {type_name(got)}, expected a {type_name(expected)}")
    if got != expected:
        raise ExerciseFailed(f"{what}: expected {expected!r}, got {got!r}")


def expect_module(
    module: Any,
    *,
    what: str = "your model",
    layer_types: Iterable[type[nn.Module]] = (),
    n_params: int | None = None,
    example_input: torch.Tensor | None = None,
    output_shape: tuple[int, ...] | None = None,
) -> torch.Tensor | None:
    """Check a module's layers, trainable parameter count and output shape; return its output."""
    if module is None:
        raise ExerciseFailed(f"{what} is None: did you forget to `return` it?")
    if inspect.isclass(module) and issubclass(module, nn.Module):
        raise ExerciseFailed(f"{what} is the class {module.__name__}, expected an instance: call it, e.g. {module.__name__}()")
    if not isinstance(module, nn.Module):
        raise ExerciseFailed(f"{what} is a {type_name(module)}, expected a torch.nn.Module")
    present = {type(m) for m in module.modules()}
    for layer in layer_types:
        if not any(issubclass(p, layer) for p in present):
            raise ExerciseFailed(f"{what} has no {layer.__name__} layer")
    if n_params is not None:
        count = sum(p.numel() for p in module.parameters() if p.requires_grad)
        if count != n_params:
            raise ExerciseFailed(f"{what} has {count:,} trainable parameters, expected {n_params:,}")
    if example_input is None:
        return None
    out = call(module, example_input)
    if output_shape is not None:
        expect_shape(out, output_shape, what=f"{what}'s output for an input of shape {tuple(example_input.shape)}")
    return out


def expect_shape(got: Any, shape: Sequence[int], *, what: str = "your result") -> None:
    """Check only that `got` is a tensor of the given shape."""
    if not isinstance(got, torch.Tensor):
        raise ExerciseFailed(f"{what} is a {type_name(got)}, expected a torch.Tensor")
    if tuple(got.shape) != tuple(shape):
        raise ExerciseFailed(f"{what}: expected shape {tuple(shape)}, got {tuple(got.shape)}{_shape_hint(tuple(got.shape), tuple(shape))}")


def expect_function(
    fn: Any,
    reference: Callable,
    cases: Iterable[tuple],
    **tolerances: Any,
) -> None:
    """Call the learner's fn and the reference on hidden cases; compare every result."""
    name = getattr(fn, "__name__", "your function")
    for args in cases:
        expected = reference(*_clone(args))
        learner_args = _clone(args)
        got = call(fn, *learner_args)
        what = f"{name}({_describe_args(args)})"
        if isinstance(expected, torch.Tensor):
            expect_tensor(got, expected, what=what, **tolerances)
        else:
            expect_equal(got, expected, what=what)


def expect_unchanged(before: torch.Tensor, after: torch.Tensor, *, what: str = "your function") -> None:
    """Fail when a function modified its input tensor in place."""
    if not torch.equal(before, after):
        raise ExerciseFailed(f"{what} modified its input in place: work on a copy, or use an out-of-place op (x * 2, not x.mul_(2))")


def _clone(args: tuple) -> tuple:
    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
