"""The exercise checks' common core: one-line verdicts instead of tracebacks or output comparisons.

A lesson module decorates each check with @exercise("name"). Inside, the check calls
the learner's code through `call` and compares what came back with `expect_tensor`,
`expect_module`, `expect_function` or `expect_equal`. The decorator turns whatever
happens into a Verdict, one of:

- passed;
- not attempted: the learner's code still reaches an untouched `raise NotImplementedError()`
  stub (a NotImplementedError raised anywhere else, by torch for instance, is a failure);
- failed, with one line naming the fault. An exception raised in the learner's code
  is reported as theirs; "the checker itself failed" is kept for bugs in a check.

In JupyterLab the verdict is shown as one styled line and nothing is raised, so Run All
runs the whole lesson. Under the checker (nbval with the course's plugin, which sets
COURSE_CHECKER=1 for its kernels, and `course_utils check`) a verdict other than
passed raises, so the cell fails. Every check runs under a time limit.
"""

import ast
import contextlib
import functools
import inspect
import linecache
import os
import re
import signal
import sys
import sysconfig
import threading
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np
import torch
from torch import nn

from course_utils.tooling.language import N_, _
from course_utils.tooling.verdicts import Verdict, checker_running, verdict_html

DEFAULT_WHATS = (N_("your result"), N_("your model"), N_("your function"))  # what= defaults, translated in each check
STUB_LINE = "raise NotImplementedError()"


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
    """The learner's function still reaches its `raise NotImplementedError()` stub."""


class ExerciseTimeout(BaseException):
    """A check ran past its time limit. A BaseException, so that a learner's `except Exception` cannot swallow it."""


def exercise_seconds() -> float:
    """The time limit of one check, in seconds (COURSE_EXERCISE_SECONDS, default 30)."""
    try:
        return float(os.environ.get("COURSE_EXERCISE_SECONDS", "30"))
    except ValueError:
        return 30.0


def exercise(name: str) -> Callable:
    """Decorate a check: judge the learner's answer, record the verdict, then show it (JupyterLab) or raise (checker)."""

    def decorate(check: Callable) -> Callable:
        lesson = lesson_of_module(check.__module__)

        @functools.wraps(check)
        def run(*args, **kwargs) -> None:
            verdict = judge(check, name, *args, **kwargs)
            if lesson:
                from course_utils.tooling.progress import record

                record(lesson, verdict)
            report(verdict)

        run.exercise_name = name
        run.verdict = functools.partial(judge, check, name)  # the Verdict alone: no record, no display
        return run

    return decorate


def lesson_of_module(module: str) -> str | None:
    """'course_utils.lesson01' -> '01'."""
    match = re.search(r"lesson(\d\d)$", module)
    return match.group(1) if match else None


def judge(check: Callable, name: str, *args, **kwargs) -> Verdict:
    """Run a check under a time limit and with the RNG forked; turn whatever happens into a Verdict.

    An answer left behind by a cell that raised the last time it ran is not judged: the verdict
    names that cell's error (course_utils.tooling.cellruns).
    """
    failed_cell = cell_failure(args)
    if failed_cell:
        return Verdict(name, "failed", failed_cell)
    seconds = exercise_seconds()
    try:
        # Checks seed their own hidden cases; the learner's later cells must draw the same numbers.
        with torch.random.fork_rng(devices=[]), one_thread(), time_limit(seconds):
            check(*args, **kwargs)
    except ExerciseNotAttempted as err:
        return Verdict(name, "not attempted", err.message)
    except ExerciseFailed as err:
        return Verdict(name, "failed", err.message)
    except ExerciseTimeout:
        return Verdict(name, "failed", _("took longer than {seconds:g} s: an endless loop?").format(seconds=seconds))
    except SystemExit as err:
        return Verdict(name, "failed", _("your code called exit() (SystemExit: {code}): return a value instead").format(code=err.code))
    except Exception as err:  # noqa: BLE001 -- anything else is judged by where it was raised
        learner_files = {a.__code__.co_filename for a in args if hasattr(a, "__code__")}
        return Verdict(name, *_blame(err, name, check.__code__.co_filename, learner_files))
    return Verdict(name, "passed")


def cell_failure(args: Sequence[Any]) -> str | None:
    """The message for an answer whose defining cell raised when it last ran, or None (also when that cannot be told)."""
    try:
        from course_utils.tooling.cellruns import failure_for

        for arg in args:
            failure = failure_for(arg)
            if failure is not None:
                return str(failure.message())
    except Exception:  # noqa: BLE001 -- an advisory look: it can make a verdict "failed", never break a check
        return None
    return None


def report(verdict: Verdict) -> None:
    """Under the checker: print a pass, raise anything else. In JupyterLab: show one styled line."""
    if checker_running():
        if verdict.passed:
            print(verdict.line())
            return
        kind = ExerciseNotAttempted if verdict.status == "not attempted" else ExerciseFailed
        raise kind(verdict.reason, verdict.exercise)
    from IPython.display import display

    display({"text/plain": verdict.line(), "text/html": verdict_html(verdict)}, raw=True)


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run a check's small tensors on one thread: on a busy machine, two threads fighting for two cores run a check many times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


RETRY_SECONDS = 0.1  # how often a time limit that learner code swallowed is raised again
NUDGE_SIGNAL = getattr(signal, "SIGUSR2", None)  # the watchdog's own signal, for code that replaced the SIGALRM handler


class time_limit:
    """Raise ExerciseTimeout in this thread after `seconds`, and keep raising it until the check has ended.

    Learner code may swallow the first raise (a bare `except:` in a retry loop) or replace the
    SIGALRM handler, so the limit escalates. SIGALRM raises ExerciseTimeout at the limit and
    traces the learner's frames, so that the next line of their code raises it again: when they
    caught it, that line is their `except` clause, which cannot catch its own raise. The timer
    fires again every RETRY_SECONDS and does the same. From the limit plus three retries, a
    watchdog thread sends NUDGE_SIGNAL to this thread, whose handler puts the course's SIGALRM
    handler back and does the same. When the check ends, the signal handlers, trace and profile
    functions are those it started with. It also tells a real interrupt (SIGINT: Ctrl-C, the
    kernel's Interrupt) from a KeyboardInterrupt raised by the learner's code (see `call`).

    What no in-process limit can stop: a single call into compiled code that never returns to
    Python (a C or C++ extension that loops or blocks while holding the interpreter, a huge torch
    operation), since Python runs signal handlers only between bytecodes; code in threads the
    learner started, which keeps running after the check ends; and code that replaces or blocks
    the handlers of both SIGALRM and NUDGE_SIGNAL (SIGUSR2). Under the checker such a kernel is
    interrupted and then stopped after the grace period; in JupyterLab only Kernel > Restart
    ends it.

    POSIX main thread only; elsewhere there is no limit here, and the checker's per-cell limit
    still holds.
    """

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.usable = seconds > 0 and hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
        self.running = False
        self.real_interrupt = False
        self._previous: dict[int, Any] = {}
        self._traced: list[tuple[Any, Any]] = []
        self._previous_trace: Any = None
        self._previous_profile: Any = None
        self._tracing = False
        self._watchdog: threading.Thread | None = None
        self._stop = threading.Event()

    def __enter__(self) -> "time_limit":
        if not self.usable:
            return self
        self.running = True
        self._install(signal.SIGALRM, self._expire)
        self._install(signal.SIGINT, self._interrupted)
        if NUDGE_SIGNAL is not None:
            self._install(NUDGE_SIGNAL, self._nudged)
        signal.setitimer(signal.ITIMER_REAL, self.seconds, RETRY_SECONDS)
        self._start_watchdog()
        _LIMITS.append(self)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        if not self.usable:
            return
        self.running = False  # first: from here on a late signal or trace event raises nothing
        signal.setitimer(signal.ITIMER_REAL, 0)
        self._stop.set()
        if self._watchdog is not None:
            self._watchdog.join()  # no nudge can arrive once our handler is gone
        self._untrace()
        for signum, handler in reversed(self._previous.items()):
            signal.signal(signum, handler)
        _LIMITS.remove(self)

    def _install(self, signum: int, handler: Callable) -> None:
        """Install a handler, keeping the one it replaces (a handler set outside Python cannot be restored, so it stays)."""
        previous = signal.getsignal(signum)
        if previous is None:
            return
        self._previous[signum] = previous
        signal.signal(signum, handler)

    def _expire(self, signum: int, frame: Any) -> None:
        if self._stopping(frame):
            return
        if signal.getitimer(signal.ITIMER_REAL)[1] == 0:  # the learner's code set the timer: ours again
            signal.setitimer(signal.ITIMER_REAL, RETRY_SECONDS, RETRY_SECONDS)
        self._trace_learner_frames(frame)
        raise ExerciseTimeout()

    def _nudged(self, signum: int, frame: Any) -> None:
        """The watchdog's signal: the limit is past and the check still runs, so SIGALRM's handler is no longer ours."""
        if self._stopping(frame):
            return
        signal.signal(signal.SIGALRM, self._expire)
        signal.setitimer(signal.ITIMER_REAL, RETRY_SECONDS, RETRY_SECONDS)
        self._trace_learner_frames(frame)
        raise ExerciseTimeout()

    def _interrupted(self, signum: int, frame: Any) -> None:
        """A real SIGINT: remember it, then do what the handler we replaced does (raise KeyboardInterrupt)."""
        self.real_interrupt = True
        previous = self._previous.get(signal.SIGINT)
        if previous == signal.SIG_IGN:
            return
        if callable(previous):
            previous(signum, frame)
            return
        raise KeyboardInterrupt

    def _stopping(self, frame: Any) -> bool:
        """True once the check has ended, or while it ends (in __exit__, before `running` is cleared)."""
        return not self.running or (frame is not None and frame.f_code is time_limit.__exit__.__code__)

    def _start_watchdog(self) -> None:
        if NUDGE_SIGNAL not in self._previous:
            return
        main = threading.main_thread().ident
        self._watchdog = threading.Thread(target=self._watch, args=(main,), name="course-time-limit", daemon=True)
        self._watchdog.start()

    def _watch(self, main: int) -> None:
        """From the limit plus three retries until the check ends, nudge the main thread every RETRY_SECONDS."""
        if self._stop.wait(self.seconds + 3 * RETRY_SECONDS):
            return
        while not self._stop.is_set():
            signal.pthread_kill(main, NUDGE_SIGNAL)
            self._stop.wait(RETRY_SECONDS)

    def _trace_learner_frames(self, frame: Any) -> None:
        """Make every line of the learner's code that runs from now on raise ExerciseTimeout, until the check ends."""
        if not self._tracing:
            self._previous_trace, self._previous_profile, self._tracing = sys.gettrace(), sys.getprofile(), True
        known = {id(f) for f, _ in self._traced}
        while frame is not None:
            if id(frame) not in known:
                self._traced.append((frame, frame.f_trace))
            frame.f_trace = self._trace
            frame = frame.f_back
        sys.settrace(self._trace)
        sys.setprofile(self._retrace)

    def _trace(self, frame: Any, event: str, arg: Any) -> Callable | None:
        if self.running and event == "line" and is_learner_file(frame.f_code.co_filename):
            raise ExerciseTimeout()
        return self._trace

    def _retrace(self, frame: Any, event: str, arg: Any) -> None:
        """Python drops a trace function that raised; this profile function, which never raises, sets it again.

        So when ExerciseTimeout leaves a learner function whose caller swallows it too, the
        caller's next line raises it again at once.
        """
        if self.running and sys.gettrace() is None:
            sys.settrace(self._trace)

    def _untrace(self) -> None:
        if self._tracing:
            sys.setprofile(self._previous_profile)
            sys.settrace(self._previous_trace)
        for frame, previous in self._traced:
            frame.f_trace = previous
        self._traced.clear()


_LIMITS: list[time_limit] = []  # the limits of the checks now running, innermost last


def learner_interrupt() -> bool:
    """True for a KeyboardInterrupt that the learner's code raised, False for a real one (Ctrl-C, the kernel's Interrupt).

    A real interrupt arrives as SIGINT, which the running check's time_limit sees; without a
    check watching for it (another thread, no signals) every KeyboardInterrupt counts as real.
    """
    watching = [limit for limit in _LIMITS if limit.usable]
    return bool(watching) and not watching[-1].real_interrupt


def not_attempted_message(name: str) -> str:
    return _("not attempted yet: replace `raise NotImplementedError` in {name} with your code").format(name=name)


def untouched_script(script: Path) -> bool:
    """Whether a script's main() is still the learner copy's skeleton: after parsing its arguments, only the stub.

    Read, not run: a check of a launched script can say "not attempted" without starting a rank.
    """
    try:
        tree = ast.parse(Path(script).read_text(encoding="utf-8", errors="replace"))
    except (OSError, SyntaxError, ValueError):
        return False
    main = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"), None)
    if main is None:
        return False
    parsed = [i for i, n in enumerate(main.body) if isinstance(n, ast.Assign) and "parse_args" in ast.unparse(n.value)]
    rest = main.body[parsed[-1] + 1:] if parsed else main.body
    return len(rest) == 1 and isinstance(rest[0], ast.Raise) and ast.unparse(rest[0]) == "raise NotImplementedError()"


def stub_frame(err: BaseException) -> tuple[str, str] | None:
    """(function name, file) of the untouched `raise NotImplementedError()` stub that raised err, or None.

    Torch raises NotImplementedError too (an operator with no kernel for a dtype); that always
    carries a message and is raised elsewhere, so it is never taken for the stub.
    """
    if not isinstance(err, NotImplementedError) or err.args:
        return None
    tb = err.__traceback__
    if tb is None:
        return None
    while tb.tb_next is not None:
        tb = tb.tb_next
    code = tb.tb_frame.f_code
    line = linecache.getline(code.co_filename, tb.tb_lineno, tb.tb_frame.f_globals).strip()
    return (code.co_name, code.co_filename) if line == STUB_LINE else None


def stub_function(err: BaseException) -> str | None:
    """The name of the function whose untouched stub raised err, or None."""
    frame = stub_frame(err)
    return frame[0] if frame else None


def _library_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    dirs = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    dirs.add(str(Path(__file__).resolve().parents[1]))  # course_utils itself
    return tuple(os.path.realpath(d) + os.sep for d in dirs)


LIBRARY_DIRS = _library_dirs()


def is_learner_file(filename: str) -> bool:
    """True for code the learner wrote: notebook cells and their own files, not the course, Python or libraries."""
    if filename.startswith("<"):
        return filename.startswith("<ipython-input")
    return not os.path.realpath(filename).startswith(LIBRARY_DIRS)


def learner_frame(err: BaseException, checker_file: str = "") -> tuple[str, int, str] | None:
    """(function, line, file) of the innermost frame of the learner's own code in err's traceback, if any.

    checker_file: the file the check itself is defined in, which is never the learner's.
    """
    found = None
    tb = err.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if is_learner_file(code.co_filename) and code.co_filename != checker_file:
            found = (code.co_name, tb.tb_lineno, code.co_filename)
        tb = tb.tb_next
    return found


def where(frame: tuple[str, int, str]) -> str:
    """' (in foo, line 3)' for a learner frame."""
    function, line, _file = frame
    if function != "<module>":
        return _(" (in {function}, line {line})").format(function=function, line=line)
    return _(" (line {line} of its cell)").format(line=line)


def _blame(err: Exception, name: str, checker_file: str = "", learner_files: set[str] = frozenset()) -> tuple[str, str]:
    """(status, reason) for an exception that escaped a check.

    learner_files: the files (notebook cells) of the functions the check was given; a stub in one
    of them, a method of the exercise's own class for instance, belongs to this exercise.
    """
    stub = stub_frame(err)
    if stub and (stub[0] == name or stub[1] in learner_files):
        return "not attempted", not_attempted_message(name)
    if stub:
        return "not attempted", _("not attempted yet: your code reaches the `{stub}` stub in {function}").format(stub=STUB_LINE, function=stub[0])
    frame = learner_frame(err, checker_file)
    if frame:
        return "failed", _("your code raised {error}: {message}{where}").format(
            error=type(err).__name__, message=first_line(err), where=where(frame))
    return "failed", _("the checker itself failed ({error}: {message}); please report this").format(
        error=type(err).__name__, message=first_line(err))


def call(
    fn: Any,
    *args,
    name: str | None = None,
    shown: str | None = None,
    hints: dict[str, str] | None = None,
    kind: str = "function",
) -> Any:
    """Call the learner's function (kind='function') or model (kind='module') on args; report what goes wrong in one line.

    `name` and `shown` replace the function's name and the description of its arguments in that
    line; `hints` adds {text in the error: advice} to ERROR_HINTS. The untouched stub's
    NotImplementedError passes through, for the decorator to call it "not attempted".
    """
    expect_callable(fn, kind)
    try:
        return fn(*args)
    except KeyboardInterrupt as err:
        # Only a KeyboardInterrupt that the learner's code raised becomes a verdict. A real one
        # (Ctrl-C, JupyterLab's Interrupt, the checker stopping a kernel) must still stop the
        # cell. Where it was raised cannot tell them apart, since a real one lands in whatever
        # runs, usually the learner's loop; its SIGINT can, and the check's time_limit notes it.
        if not learner_interrupt():
            raise
        advice = _(" (KeyboardInterrupt is what Ctrl-C raises: return a value, or raise an ordinary exception)")
        raise ExerciseFailed(_("{call} raised KeyboardInterrupt: {message}{advice}").format(call=_described(fn, args, name, shown), message=first_line(err), advice=advice)) from None
    except Exception as err:  # noqa: BLE001 -- the learner's error, reported as theirs
        if stub_function(err):
            raise
        advice = error_hint(err, {**ERROR_HINTS, **(hints or {})})
        raise ExerciseFailed(_("{call} raised {error}: {message}{advice}").format(call=_described(fn, args, name, shown), error=type(err).__name__, message=first_line(err), advice=advice)) from None


def _described(fn: Any, args: Sequence[Any], name: str | None, shown: str | None) -> str:
    """'double(tensor of shape (2,))': the learner's function and its arguments, as call()'s one-line failures name them."""
    label = name or getattr(fn, "__name__", None) or _("your {type}").format(type=type(fn).__name__)
    return f"{label}({_describe_args(args) if shown is None else shown})"


def expect_callable(fn: Any, kind: str = "function") -> None:
    """Fail in one line unless fn can stand for what the check wants.

    kind='function': a function (or a class, which builds its result when called), but not a model;
    kind='module': an nn.Module instance; kind='callable': anything callable.
    """
    wanted = _("your model") if kind == "module" else _("your function")
    if fn is None:
        raise ExerciseFailed(_("expected {wanted}, got None: pass it itself, e.g. check_x(x)").format(wanted=wanted))
    if kind == "module" and inspect.isclass(fn):
        raise ExerciseFailed(_("expected your model, got the class {fn_name}: create one first, e.g. {fn_name}(...)").format(fn_name=fn.__name__))
    if kind == "function" and isinstance(fn, nn.Module):
        raise ExerciseFailed(_("expected your function, got a model ({type_fn_name}): pass the function itself, not a module").format(type_fn_name=type(fn).__name__))
    if kind == "module" and not isinstance(fn, nn.Module):
        raise ExerciseFailed(_("expected your model (a torch.nn.Module), got {a_type_fn}").format(a_type_fn=a_type(fn)))
    if not callable(fn):
        raise ExerciseFailed(_("expected {wanted}, got {a_type_fn}: pass the function, do not call it first").format(wanted=wanted, a_type_fn=a_type(fn)))


# Torch's wording of common errors, and what the words mean. Advice only where the words say it all.
# The advice is translated when it is shown (error_hint); N_ marks it for the catalog.
ERROR_HINTS = {
    "must match the size of tensor": N_("shapes that do not broadcast: compare the two shapes from the right"),
    "shapes cannot be multiplied": N_("for a @ b the last dim of a must equal the first of b"),
    "view size is not compatible": N_("view() of a non-contiguous tensor; reshape() copies when it must"),
    "expected scalar type": N_("mixed dtypes in one operation"),
    "Expected all tensors to be on the same device": N_("tensors on different devices in one operation"),
}


def error_hint(err: Exception, hints: dict[str, str] = ERROR_HINTS) -> str:
    text = str(err)
    return next((_(" ({hint})").format(hint=_(hint)) for key, hint in hints.items() if key in text), "")


def first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else _("(no message)")


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return _("tensor of shape {shape}").format(shape=tuple(value.shape))
    if isinstance(value, nn.Module):
        name = type(value).__name__
        return (_("an {type}") if name[0] in "aeiou" else _("a {type}")).format(type=name)
    if isinstance(value, dict) and len(value) > 3:
        return _("dict of {n} entries").format(n=len(value))
    if isinstance(value, (list, tuple)) and len(value) > 3:
        return f"{type(value).__name__} of {len(value)}"
    return repr(value)


def _describe_args(args: Sequence[Any]) -> str:
    return ", ".join(_describe(a) for a in args)


def a_type(value: Any) -> str:
    """'an int', 'a torch.Tensor': the value's type with its article."""
    name = type_name(value)
    return (_("an {type}") if name[0] in "aeiou" else _("a {type}")).format(type=name)


def type_name(value: Any) -> str:
    """A value's type as a learner would write it: int, list, torch.Tensor, numpy.ndarray."""
    kind = type(value)
    return kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def _none_message(what: str, returned: bool) -> str:
    if returned:
        return _("{what} is None: did you forget to `return` it?").format(what=_(what))
    return _("{what} is None").format(what=_(what))


def expect_tensor(
    got: Any,
    expected: torch.Tensor,
    *,
    what: str = "your result",
    atol: float = 1e-6,
    rtol: float = 1e-5,
    check_dtype: bool = True,
    check_device: bool = True,
    returned: bool = True,
) -> None:
    """Compare a learner's tensor with the expected one: type, shape, dtype, device, then values.

    returned=False for a value that is not a function's result (an attribute, a buffer): then
    a None gets no advice about `return`.
    """
    what = _(what)  # the default, 'your result', in the learner's language
    if got is None:
        raise ExerciseFailed(_none_message(what, returned))
    if isinstance(got, np.ndarray):
        raise ExerciseFailed(_("{what} is a numpy.ndarray, expected a torch.Tensor: convert it with torch.from_numpy(...)").format(what=what))
    if isinstance(got, (list, tuple)):
        raise ExerciseFailed(_("{what} is a {type_got_name}, expected a torch.Tensor").format(what=what, type_got_name=type(got).__name__))
    if not isinstance(got, torch.Tensor):
        raise ExerciseFailed(_("{what} is {a_type_got}, expected a torch.Tensor").format(what=what, a_type_got=a_type(got)))
    expect_plain_tensor(got, what=what)
    shape = tuple(got.shape)
    expect_shape(got, expected.shape, what=what)
    if check_dtype and got.dtype != expected.dtype:
        raise ExerciseFailed(_("{what}: expected dtype {expected_dtype}, got {got_dtype}{hint}").format(what=what, expected_dtype=expected.dtype, got_dtype=got.dtype, hint=_dtype_hint(got.dtype, expected.dtype)))
    if check_device and got.device.type != expected.device.type:
        raise ExerciseFailed(_("{what}: expected it on device {expected_device_type}, got {got_device_type}").format(what=what, expected_device_type=expected.device.type, got_device_type=got.device.type))
    if got.is_complex() or expected.is_complex():
        a, b = got.detach().cpu().to(torch.complex128), expected.detach().cpu().to(torch.complex128)
    else:
        a, b = got.detach().to("cpu", torch.float64), expected.detach().to("cpu", torch.float64)
    if torch.isnan(a).any() and not torch.isnan(b).any():
        raise ExerciseFailed(_("{what} contains NaN where no value should be NaN").format(what=what))
    if not torch.allclose(a, b, atol=atol, rtol=rtol, equal_nan=True):
        diff = (a - b).abs().nan_to_num(nan=float("inf"))
        index = tuple(int(i) for i in np.unravel_index(int(diff.argmax()), shape)) if shape else ()
        hint = ""
        if a.numel() > 1 and not a.is_complex() and torch.allclose(a.flatten().sort().values, b.flatten().sort().values, atol=atol, rtol=rtol):
            hint = _(": the right values in the wrong places")
        raise ExerciseFailed(
            _("{what}: wrong values, e.g. at index {index} expected {b_index_item:.6g}, got {a_index_item:.6g}{hint}").format(what=what, index=index, b_index_item=b[index].item(), a_index_item=a[index].item(), hint=hint)
        )


def expect_plain_tensor(got: torch.Tensor, *, what: str = "your result") -> None:
    """Fail for a tensor of a subclass the learner defined (torch's and libraries' are fine): its comparisons must never decide.

    A subclass can override allclose, equal or __torch_function__, and so answer the very
    comparisons that judge it.
    """
    what = _(what)  # the default, 'your result', in the learner's language
    if any(issubclass(k, torch.Tensor) and learner_module(k.__module__) for k in type(got).__mro__):
        raise ExerciseFailed(_("{what} is a torch.Tensor subclass ({type_name_got}): return a plain tensor").format(what=what, type_name_got=type_name(got)))


def _shape_hint(got: tuple, want: tuple) -> str:
    """A fact about how two shapes differ, when there is one worth saying."""
    if got == want:
        return ""
    if len(got) == 2 and got == want[::-1]:
        return _(": is it transposed?")
    if int(np.prod(got)) == int(np.prod(want)):
        for i in range(len(want)):
            if want[i] == 1 and want[:i] + want[i + 1:] == got:
                return _(": the size-1 dimension {i} is missing (keepdim=True, or unsqueeze({i}), keeps it)").format(i=i)
        for i in range(len(got)):
            if got[i] == 1 and got[:i] + got[i + 1:] == want:
                return _(": an extra size-1 dimension at {i}").format(i=i)
        if len(got) == 1 and len(want) > 1:
            return _(": the right number of elements, flattened to one dimension")
        if sorted(got) == sorted(want):
            return _(": the right sizes in another order")
        return _(": the right number of elements in another shape")
    return ""


def _dtype_hint(got: torch.dtype, want: torch.dtype) -> str:
    if got == torch.bool and want != torch.bool:
        return _(": a comparison gives a bool tensor; convert it with .to(dtype)")
    if want.is_floating_point and not got.is_floating_point and not got.is_complex:
        return _(": an integer tensor; convert it with .float() or create it with a float dtype")
    if want == torch.bool:
        return _(": a comparison such as x > 0 gives a bool tensor")
    return ""


def expect_equal(got: Any, expected: Any, *, what: str = "your result", returned: bool = True) -> None:
    """Compare plain Python values (ints, floats, strings, tuples): the type must match exactly, then the value."""
    what = _(what)  # the default, 'your result', in the learner's language
    if got is None and expected is not None:
        raise ExerciseFailed(_none_message(what, returned))
    if isinstance(expected, (bool, int, float)) and isinstance(got, torch.Tensor):
        raise ExerciseFailed(_("{what} is a tensor, expected a Python {type_expected_name}: call .item() on it").format(what=what, type_expected_name=type(expected).__name__))
    if isinstance(expected, (bool, int, float)) and isinstance(got, np.generic):
        raise ExerciseFailed(_("{what} is {a_type_got}, expected a Python {type_expected_name}: convert it with {type_expected_name}(...)").format(what=what, a_type_got=a_type(got), type_expected_name=type(expected).__name__))
    if type(got) is not type(expected):
        raise ExerciseFailed(_("{what} is {a_type_got} ({short_repr_got}), expected {a_type_expected}").format(what=what, a_type_got=a_type(got), short_repr_got=_short_repr(got), a_type_expected=a_type(expected)))
    inner = _type_mismatch(got, expected)
    if inner:
        raise ExerciseFailed(_("{what} holds {a_type_inner_0} ({short_repr_inner_0}) where {a_type_inner_1} belongs: return plain values").format(what=what, a_type_inner_0=a_type(inner[0]), short_repr_inner_0=_short_repr(inner[0]), a_type_inner_1=a_type(inner[1])))
    if got != expected:
        raise ExerciseFailed(_("{what}: expected {expected!r}, got {short_repr_got}").format(what=what, expected=expected, short_repr_got=_short_repr(got)))


def learner_module(name: str | None) -> bool:
    """True for the notebook's own namespace (__main__) and for a module imported from the learner's folder.

    Decided by the module, not by where its file is: a library installed in a folder that
    sysconfig does not list must never be taken for the learner's code.
    """
    if name in (None, "__main__"):
        return True
    import sys

    file = getattr(sys.modules.get(name), "__file__", None)
    if not file:
        return False
    folder = os.path.realpath(os.getcwd()) + os.sep
    real = os.path.realpath(file)
    course = str(Path(__file__).resolve().parents[1]) + os.sep
    return real.startswith(folder) and not real.startswith(course) and "site-packages" not in real


def _type_mismatch(got: Any, expected: Any) -> tuple[Any, Any] | None:
    """(got's item, expected's item) for the first item inside a tuple, list or dict of a learner's class, else None.

    Equality of containers asks their items, and a subclass's __eq__ would answer for the
    learner's items: so no item may be of a class the learner defined where another type belongs.
    """
    if type(got) is not type(expected):
        return (got, expected) if learner_module(type(got).__module__) else None
    if isinstance(expected, (tuple, list)) and len(got) == len(expected):
        pairs = list(zip(got, expected))
    elif isinstance(expected, dict):
        key_types = {type(k) for k in expected}
        odd_key = next((k for k in got if type(k) not in key_types and learner_module(type(k).__module__)), None)
        if odd_key is not None and expected:
            return odd_key, next(iter(expected))
        pairs = [(got[k], expected[k]) for k in got if k in expected]
    else:
        return None
    return next((found for a, b in pairs if (found := _type_mismatch(a, b))), None)


def _short_repr(value: Any, limit: int = 60) -> str:
    text = repr(value).replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def expect_module(
    module: Any,
    *,
    what: str = "your model",
    layer_types: Iterable[type[nn.Module]] = (),
    n_params: int | None = None,
    example_input: torch.Tensor | None = None,
    output_shape: tuple[int, ...] | None = None,
    returned: bool = True,
) -> torch.Tensor | None:
    """Check a module's layers, trainable parameter count and output shape; return its output."""
    what = _(what)  # the default, 'your result', in the learner's language
    if module is None:
        raise ExerciseFailed(_none_message(what, returned))
    if inspect.isclass(module) and issubclass(module, nn.Module):
        raise ExerciseFailed(_("{what} is the class {module_name}, expected an instance: create one, e.g. {module_name}(...)").format(what=what, module_name=module.__name__))
    if not isinstance(module, nn.Module):
        raise ExerciseFailed(_("{what} is {a_type_module}, expected a torch.nn.Module").format(what=what, a_type_module=a_type(module)))
    present = {type(m) for m in module.modules()}
    for layer in layer_types:
        if not any(issubclass(p, layer) for p in present):
            raise ExerciseFailed(_("{what} has no {layer_name} layer").format(what=what, layer_name=layer.__name__))
    if n_params is not None:
        count = sum(p.numel() for p in module.parameters() if p.requires_grad)
        if count != n_params:
            raise ExerciseFailed(_("{what} has {count:,} trainable parameters, expected {n_params:,}").format(what=what, count=count, n_params=n_params))
    if example_input is None:
        return None
    out = call(module, example_input, name=what, kind="module")
    if output_shape is not None:
        expect_shape(out, output_shape, what=_("{what}'s output for an input of shape {shape}").format(what=what, shape=tuple(example_input.shape)))
    return out


def expect_shape(got: Any, shape: Sequence[int], *, what: str = "your result") -> None:
    """Check only that `got` is a tensor of the given shape."""
    what = _(what)  # the default, 'your result', in the learner's language
    if not isinstance(got, torch.Tensor):
        raise ExerciseFailed(_("{what} is {a_type_got}, expected a torch.Tensor").format(what=what, a_type_got=a_type(got)))
    expect_plain_tensor(got, what=what)
    if tuple(got.shape) != tuple(shape):
        raise ExerciseFailed(_("{what}: expected shape {tuple_shape}, got {tuple_got_shape}{hint}").format(what=what, tuple_shape=tuple(shape), tuple_got_shape=tuple(got.shape), hint=_shape_hint(tuple(got.shape), tuple(shape))))


def expect_function(
    fn: Any,
    reference: Callable,
    cases: Iterable[tuple],
    **tolerances: Any,
) -> None:
    """Call the learner's fn and the reference on hidden cases; compare every result."""
    expect_callable(fn)
    name = getattr(fn, "__name__", None) or _("your function")
    for args in cases:
        expected = reference(*_clone(args))
        got = call(fn, *_clone(args))
        what = f"{name}({_describe_args(args)})"
        if isinstance(expected, torch.Tensor):
            expect_tensor(got, expected, what=what, **tolerances)
        else:
            expect_equal(got, expected, what=what)


def expect_unchanged(before: torch.Tensor, after: torch.Tensor, *, what: str = "your function") -> None:
    """Fail when a function modified its input tensor in place."""
    what = _(what)  # the default, 'your result', in the learner's language
    if before.shape != after.shape or not torch.equal(before, after):
        raise ExerciseFailed(_("{what} modified its input in place: work on a copy, or use an out-of-place op (x * 2, not x.mul_(2))").format(what=what))


def _clone(args: tuple) -> tuple:
    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


def scoreboard_for(module: str) -> Callable[[], None]:
    """A lesson module's `scoreboard()`: the verdicts of this session's checks, shown at the end of the lesson."""
    lesson = lesson_of_module(module)

    def scoreboard() -> None:
        """Show this lesson's exercises with the verdict each check gave in this session."""
        from course_utils.tooling.progress import show_scoreboard

        show_scoreboard(lesson)

    return scoreboard
