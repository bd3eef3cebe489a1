"""nbval as an exercise checker: registered through the `pytest11` entry point.

What it adds to an nbval run:
- kernels run with COURSE_CHECKER=1, so a check that does not pass raises (in JupyterLab it only shows a line);
- the exercises judged are the lesson's, read from the course's source notebook: each check cell
  runs the course's own check (course_utils.tooling.checkcell), whatever the learner's copy of the cell
  says, and a check cell the learner deleted is reported as missing, and fails;
- cells tagged `check:<exercise>` or `exercise:<exercise>` are reported by exercise name, with a
  one-line reason when they fail, and summed up in a scoreboard;
- time limits: --course-exercise-timeout for exercise and check cells, --course-cell-timeout for
  the rest; a kernel that dies is noticed within a second, not at the time limit;
- a kernel exits when the pytest that started it dies (Linux), so a killed checker leaves none behind;
- cells tagged `gpu` are skipped, with the reason, when no CUDA device is usable;
- stderr (warnings) never fails an output comparison;
- after a non-exercise cell fails, the rest of that notebook is skipped, not cascaded;
- `--course-strict-warnings` fails a cell that prints a DeprecationWarning or FutureWarning;
- `--course-report FILE` writes the scoreboard as JSON, with the seconds each exercise's cells took
  and the routes to fool the checker that the run saw ("review"), for an instructor to look at;
- a check passes only on the verdict record that the course's check published in its cell
  (checkcell.publish, with a nonce this plugin put into the cell): a check cell that merely did
  not raise, because the checker was patched or bypassed, fails;
- under strict nbval (`--nbval`, as `make test` runs the solution copies), a check cell that names a route
  to fool the checker for review (in its verdict record, or a forged record, or no verdict) fails with
  "needs review under strict nbval: <route>": the course's own notebooks must give an instructor nothing
  to look at. The learner's checker (`course_utils check`, `grade`, the autograder) runs `--nbval-lax`,
  where a route is only named in the report;
- nbval's tags and comment markers (raises-exception, skip, NBVAL_RAISES_EXCEPTION...) on an
  exercise's cells are ignored: the course's checks run as the course defines them;
- `--course-no-leftovers` (Linux) fails a notebook that leaves a process running once its kernel has
  stopped: a DDP rank, a server, a worker in a session of its own. `make test` runs every lesson so.
"""

import glob
import json
import os
import re
import secrets
import tempfile
import time
from pathlib import Path
from queue import Empty

import pytest

from course_utils.tooling import leftovers
from course_utils.tooling.cellruns import message_from_output, prefixes as cell_failed_prefixes
from course_utils.tooling.language import _, normalise
from course_utils.tooling.verdicts import CHECK_MISSING, DID_NOT_RUN, SYMBOL
from course_utils.tooling.layout import CourseError, exercises, lesson_of
from course_utils.tooling.runner import not_dumpable
from course_utils.tooling.tamper import NO_VERDICT, RECORD_MIME, FORGE

CHECK_TAG = "check:"
EXERCISE_TAG = "exercise:"
GPU_TAG = "gpu"
DEPRECATION = re.compile(r"\b(DeprecationWarning|FutureWarning)\b")
EXERCISE_GRACE = 15  # seconds the checker waits beyond a check's own time limit before interrupting the kernel

_cuda: bool | None = None


class KernelDied(Exception):
    """The notebook's kernel process ended while a cell ran."""


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("course", "PyTorch course exercise checker")
    group.addoption("--course-report", metavar="FILE", help="write the exercise scoreboard as JSON to FILE")
    group.addoption(
        "--course-strict-warnings",
        action="store_true",
        help="fail a notebook cell whose output contains a DeprecationWarning or FutureWarning",
    )
    group.addoption("--course-exercise-timeout", type=float, default=30, metavar="S",
                    help="time limit of one exercise or check cell, in seconds (default 30)")
    group.addoption("--course-no-leftovers", action="store_true",
                    help="fail a notebook that leaves a process running after its kernel stops (Linux)")
    group.addoption("--course-cell-timeout", type=float, default=600, metavar="S",
                    help="time limit of any other notebook cell, in seconds (default 600)")


def pytest_configure(config: pytest.Config) -> None:
    # notebook path -> {"lesson", "exercises": {name: {"status", "reason"}}, "stopped_at": None or "Cell N: error"}
    config._course_results = {}
    # Kernels start after this and inherit it: checks raise, and each check has this time limit.
    os.environ["COURSE_CHECKER"] = "1"
    os.environ["COURSE_EXERCISE_SECONDS"] = f"{config.getoption('course_exercise_timeout'):g}"
    if config.getoption("course_strict_warnings", False):
        # Show every deprecation, not only __main__'s.
        os.environ["PYTHONWARNINGS"] = "default::DeprecationWarning,default::FutureWarning"
    if config.getoption("nbval", False):
        # Strict nbval compares saved outputs digit for digit: its kernels use the kernels the build used.
        from course_utils.reproducibility import same_kernels_env

        os.environ.update(same_kernels_env())
    if config.getoption("course_report", None):
        # The scoreboard leaves through a pipe only this process holds: no notebook may open it through /proc.
        not_dumpable()
    _watch_kernels_die()
    _kernels_over_ipc()


def _watch_kernels_die() -> None:
    """Make nbval's kernel wait in slices of a second and notice a kernel that died (nbval would wait for its timeout)."""
    try:
        from nbval.kernel import RunningKernel
    except ImportError:
        return
    if getattr(RunningKernel.get_message, "course_patched", False):
        return
    original = RunningKernel.get_message

    def get_message(self, stream, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            step = 1.0 if deadline is None else max(0.0, min(1.0, deadline - time.monotonic()))
            try:
                return original(self, stream, timeout=step)
            except Empty:
                if not self.is_alive():
                    raise KernelDied(f"the kernel died ({_exit_status(self)})") from None
                if deadline is not None and time.monotonic() >= deadline:
                    raise

    get_message.course_patched = True
    RunningKernel.get_message = get_message


def _kernels_over_ipc() -> None:
    """Start nbval's kernels on Unix sockets in a private folder instead of TCP ports on 127.0.0.1.

    jupyter_client picks a kernel's five TCP ports by binding port 0 and closing the socket; the
    kernel binds them half a second later. A checker started at the same moment (`grade --jobs 2`)
    can take one in between (jupyter_client issue #487). When it is the IOPub port, the kernel does
    not exit but hangs, and nbval waits out its 60 s start limit: every check then "did not run".
    Unix sockets in a folder of this process's own have no port to race for.
    """
    if os.name != "posix":
        return
    try:
        import nbval.kernel
        from jupyter_client.manager import KernelManager
    except ImportError:
        return
    if getattr(nbval.kernel.KernelManager, "course_ipc", False):
        return

    class IpcKernelManager(KernelManager):
        course_ipc = True

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.transport = "ipc"
            # Short: a Unix socket's path has a limit of about 100 bytes.
            self.ip = os.path.join(tempfile.mkdtemp(prefix="k", dir=_socket_dir()), "k")

    nbval.kernel.KernelManager = IpcKernelManager


_sockets: list[str] = []


def _socket_dir() -> str:
    """This pytest's folder for its kernels' sockets, removed when it ends."""
    if not _sockets:
        _sockets.append(tempfile.mkdtemp(prefix="course-kernels-"))
    return _sockets[0]


def pytest_unconfigure(config: pytest.Config) -> None:
    import shutil

    while _sockets:
        shutil.rmtree(_sockets.pop(), ignore_errors=True)


def _exit_status(kernel) -> str:
    process = getattr(getattr(getattr(kernel, "km", None), "provisioner", None), "process", None)
    code = process.poll() if process is not None else None
    if code is None:
        return "exit status unknown"
    return f"killed by signal {-code}" if code < 0 else f"exit {code}"


# Run in each kernel before the notebook's first cell: the kernel dies with the pytest that started it.
KERNEL_PRELUDE = """\
import ctypes as _c, os as _o, signal as _s, sys as _y
if _y.platform.startswith("linux"):
    _c.CDLL(None, use_errno=True).prctl(1, int(_s.SIGKILL))  # PR_SET_PDEATHSIG
    if _o.getppid() != {parent}:
        _o._exit(1)
del _c, _o, _s, _y
"""


def _is_cell(item: pytest.Item) -> bool:
    return type(item).__name__ == "IPyNbCell" and hasattr(item, "cell")


def _tag(item: pytest.Item, prefix: str) -> str | None:
    for tag in item.cell.metadata.get("tags", []):
        if tag.startswith(prefix):
            return tag[len(prefix):]
    return None


def _cuda_available() -> bool:
    global _cuda
    if _cuda is None:
        # Importing torch costs the checker ~2 s; without an NVIDIA device node (or WSL's
        # /dev/dxg) there is no CUDA anyway, so look for one first.
        if not glob.glob("/dev/nvidia[0-9]*") and not os.path.exists("/dev/dxg"):
            _cuda = False
        else:
            from course_utils.device import cuda_available

            _cuda = cuda_available()
    return _cuda


def _drop_stderr(outputs: list) -> list:
    """The outputs nbval compares: neither stderr (warnings) nor the checker's verdict records."""
    return [o for o in outputs if not (o.get("output_type") == "stream" and o.get("name") == "stderr") and not _record_of(o)]


def _record_of(output: dict) -> dict | None:
    """The verdict record a check published in this output, if it is one."""
    data = output.get("data") if output.get("output_type") == "display_data" else None
    record = data.get(RECORD_MIME) if isinstance(data, dict) else None
    return record if isinstance(record, dict) else None


def _course_options(item: pytest.Item) -> None:
    """Undo nbval's options that a learner's tags or comment markers set on an exercise's cells: they run, and an error fails them."""
    item.options["skip"] = False
    item.options["check_exception"] = False


def _rename(item: pytest.Item, name: str) -> None:
    item.name = name
    if hasattr(item.parent, "id"):  # pytest >= 9 keeps a structured node id
        item._id = item.parent.id.child(name)
    else:
        item._nodeid = f"{item.parent.nodeid}::{name}"
    description = f"{item.parent.name}::{name}"
    item.reportinfo = lambda: (item.path, 0, description)


def verdict_source(lesson: str, exercise: str, nonce: str | None = None) -> str:
    """What the checker runs in place of a check cell (one line, so that no name is left behind)."""
    extra = f", {nonce!r}" if nonce else ""
    return f'__import__("course_utils.tooling.checkcell", fromlist=["run"]).run({lesson!r}, {exercise!r}, globals(){extra})'


class MissingCheck(pytest.Item):
    """An exercise of the lesson whose check cell is not in the learner's notebook."""

    def __init__(self, *, exercise: str, check_source: str, **kwargs):
        super().__init__(**kwargs)
        self.course_exercise = exercise
        self.check_source = check_source

    def runtest(self) -> None:
        raise AssertionError(_results(self)[self.course_exercise]["reason"])

    def repr_failure(self, excinfo, style=None) -> str:
        return f"{self.course_exercise} failed: {excinfo.value}"

    def reportinfo(self):
        return self.path, 0, f"{self.parent.name}::{self.name}"


# The checker's own notes are in the language of the process that runs it: the learner's choice for `check`,
# English under make test and in the grader's sandbox (whose environment is cleared).
def _missing_reason(exercise: str, check_source: str) -> str:
    return _("{check_missing}: put the cell `{check_source}` back below your {exercise}").format(
        check_missing=_(CHECK_MISSING), check_source=check_source, exercise=exercise)


def _new_exercise_reason(lesson: str) -> str:
    return _("{check_missing}: your notebook is an earlier version of lesson {lesson}, and this exercise is new; "
             "`python -m course_utils reset {lesson}` gives you the new version and keeps yours as a backup").format(
        check_missing=_(CHECK_MISSING), lesson=lesson)


def _notebook(item: pytest.Item) -> dict:
    return item.config._course_results.setdefault(
        str(item.parent.path), {"lesson": None, "exercises": {}, "stopped_at": None, "seconds": {}, "review": []})


def _results(item: pytest.Item) -> dict:
    return _notebook(item)["exercises"]


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    by_notebook: dict = {}
    for item in items:
        if _is_cell(item):
            by_notebook.setdefault(item.parent, []).append(item)
    for nbfile, cells in by_notebook.items():
        extra = _prepare_notebook(nbfile, cells)
        if extra:
            last = items.index(cells[-1])
            items[last + 1:last + 1] = extra


def _prepare_notebook(nbfile, cells: list[pytest.Item]) -> list[pytest.Item]:
    """Name and time the cells; put the course's checks in; return items for check cells that are missing."""
    try:
        lesson = lesson_of(nbfile.nb, nbfile.path)
        course = exercises(lesson) if lesson else []
    except CourseError:
        lesson, course = None, []
    record = _notebook(cells[0])
    record["lesson"] = lesson
    for ex in course:  # the scoreboard lists the lesson's exercises in the course's order
        record["exercises"][ex.name] = {"status": "not run", "reason": _(DID_NOT_RUN)}
    canonical = {ex.check_source: ex.name for ex in course}
    known = {ex.name for ex in course}
    seen, outdated = set(), set()
    for item in cells:
        original_compare = item.compare_outputs
        item.compare_outputs = lambda test, ref, skip=None, _cmp=original_compare: _cmp(_drop_stderr(test), _drop_stderr(ref), skip)
        check = _tag(item, CHECK_TAG) or canonical.get(item.cell.source.strip())
        code = _tag(item, EXERCISE_TAG)
        if course and (check or code) and (check or code) not in known:
            # An exercise of an earlier version of the lesson: nothing judges it any more.
            _rename(item, f"{'check' if check else 'exercise'} {check or code} (no longer in this lesson)")
            item.add_marker(pytest.mark.skip(reason=f"{check or code} is not an exercise of lesson {lesson} any more"))
            outdated.add(check or code)
            continue
        if check:
            item.course_exercise = item.course_check = check
            _rename(item, f"check {check}")
            _course_options(item)
            record["exercises"].setdefault(check, {"status": "not run", "reason": _(DID_NOT_RUN)})
            if check in known:
                item.course_nonce = secrets.token_hex(16)
                item.cell.source = verdict_source(lesson, check, item.course_nonce)
                seen.add(check)
        elif code:
            item.course_exercise = code
            _rename(item, f"exercise {code} (your code)")
            _course_options(item)
        if GPU_TAG in item.cell.metadata.get("tags", []):
            item.options["check"] = False  # CPU and GPU runs print different things
            if not _cuda_available():
                item.add_marker(pytest.mark.skip(reason="GPU cell: no usable CUDA device on this machine"))
    missing = []
    for ex in course:
        if ex.name not in seen:
            reason = _new_exercise_reason(lesson) if outdated else _missing_reason(ex.name, ex.check_source)
            record["exercises"][ex.name] = {"status": "failed", "reason": reason}
            missing.append(MissingCheck.from_parent(nbfile, name=f"check {ex.name} (cell missing)", exercise=ex.name, check_source=ex.check_source))
    _start_kernels_with_prelude(nbfile)
    if nbfile.config.getoption("course_no_leftovers", False):
        _fail_on_leftovers(nbfile)
    return missing


def _start_kernels_with_prelude(nbfile) -> None:
    original_setup = nbfile.setup
    lang = normalise((nbfile.nb.metadata.get("course") or {}).get("language"))

    def setup():
        original_setup()
        kernel = nbfile.kernel
        prelude = KERNEL_PRELUDE.format(parent=os.getpid())
        if lang:  # a Chinese copy is checked in Chinese, whatever the checker's own language
            prelude += f"import os as _o; _o.environ['COURSE_LANG'] = {lang!r}; del _o\n"
        msg_id = kernel.execute_cell_input(prelude, allow_stdin=False)
        kernel.await_reply(msg_id, timeout=30)
        kernel.await_idle(msg_id, timeout=30)

    nbfile.setup = setup


class LeftoverProcesses(Exception):
    """Processes that the notebook started were still running after its kernel stopped."""


def _fail_on_leftovers(nbfile) -> None:
    """Adopt the notebook's orphans while it runs; once its kernel has stopped, fail it if any still run, and kill them."""
    original_setup, original_teardown = nbfile.setup, nbfile.teardown

    def setup():
        # A rank or a server that starts a session of its own would otherwise be re-parented to init, out of sight.
        nbfile.course_before = set(leftovers.children()) if leftovers.adopt_orphans(True) else None
        original_setup()

    def teardown():
        try:
            original_teardown()
        finally:
            before = getattr(nbfile, "course_before", None)
            left = leftovers.survivors(before) if before is not None else {}
            leftovers.adopt_orphans(False)
        if left:
            listing = "; ".join(f"{pid}: {command}" for pid, command in sorted(left.items()))
            raise LeftoverProcesses(f"{len(left)} process(es) outlived the notebook, and were killed: {listing}")

    nbfile.setup, nbfile.teardown = setup, teardown


def _limit(item: pytest.Item) -> float:
    if getattr(item, "course_exercise", None):
        return item.config.getoption("course_exercise_timeout") + EXERCISE_GRACE
    return item.config.getoption("course_cell_timeout")


def pytest_runtest_setup(item: pytest.Item) -> None:
    if _is_cell(item) or isinstance(item, MissingCheck):
        broken = getattr(item.parent, "course_broken", None)
        if broken and _is_cell(item):
            pytest.skip(f"not run: {broken}")
    if _is_cell(item):
        item.config.option.nbval_cell_timeout = _limit(item)  # nbval reads it for each cell


def _error_output(item: pytest.Item) -> dict | None:
    for out in reversed(item.test_outputs or []):
        if out.get("output_type") == "error":
            return out
    return None


def _error_line(item: pytest.Item) -> str:
    out = _error_output(item)
    if out:
        lines = str(out["evalue"]).strip().splitlines()
        return f"{out['ename']}: {lines[0]}" if lines else out["ename"]
    return getattr(item, "course_warning", None) or "its outputs differ from the saved ones"


def _exercise_message(item: pytest.Item) -> tuple[str, str]:
    """(status, reason) for a failed exercise cell, from the error the kernel sent back."""
    out = _error_output(item)
    if out:
        reason = str(out["evalue"]).strip().splitlines()[0] if str(out["evalue"]).strip() else out["ename"]
        prefix = f"{item.course_exercise}: "
        reason = reason[len(prefix):] if reason.startswith(prefix) else reason
        if out["ename"] == "ExerciseNotAttempted":
            return "not attempted", reason
        if out["ename"] == "ExerciseFailed":
            return "failed", reason
        return "failed", f"{out['ename']}: {reason}"
    return "failed", getattr(item, "course_warning", None) or "cell outputs differ from the saved ones"


def _code_cell_message(item: pytest.Item) -> str:
    """An exercise's code cell that raised, named as the check in the kernel names it: its function, line and error."""
    out = _error_output(item)
    if out:
        return message_from_output(item.course_exercise, out)
    warning = getattr(item, "course_warning", None)
    return f"your code cell {warning}" if warning else "your code cell's outputs differ from the saved ones"


def _interrupted(item: pytest.Item, call: pytest.CallInfo) -> str | None:
    """Why a cell did not finish: it ran past its limit, or its kernel died; None when it finished."""
    if call.excinfo is not None and call.excinfo.errisinstance(KernelDied):
        return str(call.excinfo.value)
    if call.excinfo is not None and "Timeout of" in str(call.excinfo.value):
        alive = item.parent.kernel is not None and item.parent.kernel.is_alive()
        if alive:
            return _("took longer than {seconds:g} s: an endless loop?").format(seconds=_limit(item))
        return _("took longer than {seconds:g} s and could not be interrupted, so the kernel was stopped").format(seconds=_limit(item))
    return None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    if call.when == "setup" and report.failed and _is_cell(item):
        _kernel_did_not_start(item, call)
    if call.when != "call":
        return report
    if isinstance(item, MissingCheck):
        return report
    if not _is_cell(item):
        return report
    if report.passed and item.config.getoption("course_strict_warnings"):
        stderr = "".join(o.get("text", "") for o in item.test_outputs or [] if o.get("name") == "stderr")
        match = DEPRECATION.search(stderr)
        if match:
            report.outcome = "failed"
            line = next(l for l in stderr.splitlines() if match.group(0) in l)
            item.course_warning = f"printed a {match.group(0)} (--course-strict-warnings): {line.strip()}"
            report.longrepr = f"{item.name} {item.course_warning}"
    exercise = getattr(item, "course_exercise", None)
    is_check = getattr(item, "course_check", None) is not None
    if exercise:  # the exercise's code cell and its check, for the grader's CSV
        seconds = _notebook(item)["seconds"]
        seconds[exercise] = seconds.get(exercise, 0.0) + report.duration
    stopped = _interrupted(item, call) if report.failed else None
    kernel_ok = item.parent.kernel is not None and item.parent.kernel.is_alive()
    if is_check and getattr(item, "course_nonce", None) and not stopped:
        _judge_by_record(item, report)
    if stopped:
        item.parent.timed_out = False  # nbval would mark every later cell as an expected failure
    if report.failed and exercise:
        if stopped:
            status, reason = "failed", stopped
        elif is_check:
            status, reason = getattr(item, "course_record", None) or _exercise_message(item)
        else:
            status, reason = "failed", _code_cell_message(item)
        report.longrepr = f"{exercise} {status}: {reason}"
        results = _results(item)
        if is_check:
            previous = results.get(exercise, {})
            # The check of a cell that raised names that cell (cellruns, in the kernel); a check that could not
            # tell (the extension not loaded) would judge what the kernel had before: the cell's error says more.
            told = status == "failed" and reason.startswith(cell_failed_prefixes())
            if previous.get("status") == "failed" and previous.get("from_code") and not stopped and not told:
                status, reason = "failed", previous["reason"]
            results[exercise] = {"status": status, "reason": reason}
        else:
            results[exercise] = {"status": "failed", "reason": f"your code cell {reason}" if stopped else reason, "from_code": True}
        if not kernel_ok:
            _stop_notebook(item, f"{item.name}: {stopped or 'the kernel stopped'}")
    elif report.failed and getattr(item, "course_warning", None):
        pass  # the report names the warning; the kernel's state is intact, so the notebook goes on
    elif report.failed:
        why = stopped or _error_line(item)
        _stop_notebook(item, f"{item.name}: {why}")
        report.longrepr = f"{item.name} failed ({why}); the rest of this notebook is skipped\n\n{report.longrepr}"
    elif report.passed and is_check:
        _results(item)[exercise] = {"status": "passed", "reason": ""}
    return report


def _kernel_did_not_start(item: pytest.Item, call: pytest.CallInfo) -> None:
    """The notebook's kernel did not start: the checker's own failure, never the learner's, so it is recorded apart."""
    record = _notebook(item)
    if record.get("error"):
        return  # every cell of the notebook fails in the same setup
    lines = str(call.excinfo.value).strip().splitlines() if call.excinfo else []
    what = f"{call.excinfo.typename}: {lines[0]}" if lines else (call.excinfo.typename if call.excinfo else "unknown")
    record["error"] = f"the notebook's kernel did not start ({what})"
    for verdict in record["exercises"].values():
        if verdict["status"] == "not run":
            verdict["reason"] = f"not run: {record['error']}; run the check again"


def _judge_by_record(item: pytest.Item, report: pytest.TestReport) -> None:
    """Let the check's verdict record decide: a pass needs one; a record that is not a pass fails the cell with its reason.

    Under strict nbval, a pass whose cell names a route for review fails too, naming the routes.

    Sets item.course_record to (status, reason) when the cell must fail for it. Records without
    the cell's nonce, or for another exercise, were not published by the course's check.
    """
    records = [r for r in map(_record_of, item.test_outputs or []) if r is not None]
    genuine = [r for r in records if r.get("nonce") == item.course_nonce and r.get("exercise") == item.course_exercise]
    routes = [r for g in genuine for r in g.get("review", []) if isinstance(r, str)]
    if len(genuine) < len(records):
        routes.append(f"{FORGE}: a record the check did not publish ({item.course_exercise})")
    not_passed = [r for r in genuine if r.get("status") != "passed"]
    if not_passed:
        item.course_record = (str(not_passed[0].get("status")), str(not_passed[0].get("reason", "")))
    elif not genuine and report.passed:
        routes.append(f"{NO_VERDICT}: {item.course_exercise}")
        item.course_record = ("failed", "the check did not report a verdict: was the checker patched or bypassed?")
    elif routes and _strict(item.config):
        # The course's own notebooks must give an instructor nothing to look at: a route there is a fault of
        # the notebook or a false positive of the detection, and either must fail `make test`.
        item.course_record = ("failed", f"needs review under strict nbval: {'; '.join(dict.fromkeys(routes))}")
    for route in routes:
        _add_review(item, route)
    if getattr(item, "course_record", None) and report.passed:
        report.outcome = "failed"


def _strict(config: pytest.Config) -> bool:
    """Whether this is a strict nbval run (`--nbval`: outputs compared), as nbval decides it: `--nbval-lax` wins."""
    return not config.getoption("nbval_lax", False)


def _add_review(item: pytest.Item, route: str) -> None:
    """Name a route to fool the checker in the notebook's report, once."""
    review = _notebook(item)["review"]
    if route not in review:
        review.append(route)


def _stop_notebook(item: pytest.Item, why: str) -> None:
    item.parent.course_broken = f"{why.split(':')[0]} failed earlier in this notebook"
    _notebook(item)["stopped_at"] = why
    for verdict in _results(item).values():
        if verdict["status"] == "not run":
            verdict["reason"] = _("not run: the checker stopped at {why}").format(why=why)


def scoreboard_lines(results: dict[str, dict]) -> list[str]:
    """Human-readable scoreboard: one line per exercise, and a total per notebook."""
    lines = []
    for notebook, result in results.items():
        exercises_ = result["exercises"]
        if not exercises_ and not result["stopped_at"]:
            continue
        lines.append(Path(notebook).name)
        width = max((len(name) for name in exercises_), default=0)
        counts: dict[str, int] = {}
        for name, verdict in exercises_.items():
            counts[verdict["status"]] = counts.get(verdict["status"], 0) + 1
            lines.append(f"  {SYMBOL[verdict['status']]}  {name:{width}}  {verdict['reason']}".rstrip())
        total = _("{total} exercises: {passed} passed, {not_attempted} not attempted, {failed} failed").format(
            total=len(exercises_), passed=counts.get("passed", 0), not_attempted=counts.get("not attempted", 0),
            failed=counts.get("failed", 0))
        extra = _(", {n} not run").format(n=counts["not run"]) if counts.get("not run") else ""
        lines.append(f"  {total}{extra}")
        if result["stopped_at"]:
            lines.append("  " + _("stopped early at {where}; the cells after it did not run").format(where=result["stopped_at"]))
        if result.get("error"):
            lines.append("  " + _("the checker failed, not your notebook: {error}; run the check again").format(error=result["error"]))
        lines += ["  " + _("needs review: {route}").format(route=route) for route in result.get("review", [])]
    return lines


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    results = {
        path: {
            "lesson": nb["lesson"],
            "exercises": {name: {"status": v["status"], "reason": v["reason"]} for name, v in nb["exercises"].items()},
            "stopped_at": nb["stopped_at"],
            "seconds": {name: round(s, 2) for name, s in nb.get("seconds", {}).items()},
            **({"error": nb["error"]} if nb.get("error") else {}),
            "review": list(nb.get("review", [])),
        }
        for path, nb in config._course_results.items()
    }
    path = config.getoption("course_report")
    if path:
        Path(path).write_text(json.dumps(results, indent=2))
    lines = scoreboard_lines(results)
    if lines:
        terminalreporter.section("exercise scoreboard")
        for line in lines:
            terminalreporter.line(line)
