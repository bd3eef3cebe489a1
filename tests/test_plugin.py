"""course_utils.tooling.pytest_plugin, end to end: nbval runs tiny notebooks in a subprocess with the plugin loaded."""

import json
import subprocess
import sys
import time

import nbformat
import pytest
import torch
from nbformat.v4 import new_code_cell, new_notebook, new_output

pytestmark = pytest.mark.slow

# The real exception classes (importing them costs the kernel a torch import, ~2 s)...
IMPORT = new_code_cell("from course_utils.tooling.checks import ExerciseFailed, ExerciseNotAttempted")
# ...and stand-ins: the plugin goes by the exception's class name and message, as the kernel reports them.
STAND_INS = new_code_cell("class ExerciseFailed(Exception): pass\nclass ExerciseNotAttempted(ExerciseFailed): pass")


@pytest.fixture(autouse=True)
def plain_env(monkeypatch):
    for name in ("COURSE_DEVICE", "COURSE_CHECK_MODE", "PYTEST_ADDOPTS"):
        monkeypatch.delenv(name, raising=False)


def run(pytester, *cells, flags=()):
    """Write the cells as nb.ipynb and check it with nbval + the course plugin; return (result, report)."""
    nb = new_notebook()
    nb.cells = list(cells)
    nbformat.write(nb, pytester.path / "nb.ipynb")
    result = pytester.runpytest_subprocess(
        "-p", "course_utils.tooling.lean_imports", "--nbval-lax", "--nbval-current-env", "-p", "no:cacheprovider", "-v", "-rs",
        "--course-report", "r.json", *flags, "nb.ipynb",
    )
    report = json.loads((pytester.path / "r.json").read_text())
    return result, report


def exercises(report):
    """The one notebook's {exercise: {"status", "reason"}} from the JSON scoreboard."""
    (notebook,) = report.values()
    return notebook["exercises"]


def check_cell(name, source):
    return new_code_cell(source, metadata={"tags": [f"check:{name}"]})


def test_not_attempted_check(pytester):
    result, report = run(
        pytester,
        IMPORT,
        check_cell("foo", 'raise ExerciseNotAttempted("not attempted yet: replace `raise NotImplementedError` in foo", "foo")'),
    )
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*check foo FAILED*", "*foo not attempted: not attempted yet*"])
    assert exercises(report) == {"foo": {"status": "not attempted", "reason": "not attempted yet: replace `raise NotImplementedError` in foo"}}
    result.stdout.fnmatch_lines(["*exercise scoreboard*", "*TODO  foo*", "*1 exercises: 0 passed, 1 not attempted, 0 failed*"])


def test_passing_check(pytester):
    result, report = run(pytester, check_cell("bar", 'print("PASS bar: all checks passed")'))
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*check bar PASSED*"])
    assert exercises(report) == {"bar": {"status": "passed", "reason": ""}}


def test_failed_check_gives_one_line_reason(pytester):
    result, report = run(pytester, STAND_INS, check_cell("baz", 'raise ExerciseFailed("baz: expected 3, got 4")'), new_code_cell("x = 1"))
    result.assert_outcomes(passed=2, failed=1)  # an exercise failure does not stop the notebook
    assert exercises(report) == {"baz": {"status": "failed", "reason": "expected 3, got 4"}}
    result.stdout.fnmatch_lines(["*nb.ipynb::check baz*", "baz failed: expected 3, got 4"])
    assert "Traceback" not in result.stdout.str()


def test_failing_exercise_code_is_blamed_in_check(pytester):
    """The learner's code cell raises: its check reports that error, not merely 'not attempted'."""
    code = new_code_cell('def foo():\n    raise NotImplementedError()\n\nfoo_value = 1 / 0', metadata={"tags": ["exercise:foo"]})
    check = check_cell("foo", 'raise ExerciseNotAttempted("foo: not attempted yet")')
    result, report = run(pytester, STAND_INS, code, check)
    result.assert_outcomes(passed=1, failed=2)
    result.stdout.fnmatch_lines(["*exercise foo (your code) FAILED*", "*check foo FAILED*"])
    assert exercises(report) == {"foo": {"status": "failed", "reason": "your cell for `foo` raised ZeroDivisionError at line 4 "
                                                           "(division by zero): fix it and run that cell again"}}


def test_failure_outside_exercise_skips_rest(pytester):
    before = new_code_cell('open("before.txt", "w").write("ran")')
    broken = new_code_cell('raise ValueError("boom")')
    after = new_code_cell('open("after.txt", "w").write("ran")')
    result, report = run(pytester, before, broken, check_cell("late", 'print("PASS")'), after)
    result.assert_outcomes(passed=1, failed=1, skipped=2)
    result.stdout.fnmatch_lines(["*Cell 1 failed (ValueError: boom); the rest of this notebook is skipped*"])
    result.stdout.fnmatch_lines(["SKIPPED [[]2[]] *not run: Cell 1 failed earlier in this notebook"])
    assert (pytester.path / "before.txt").exists()  # the kernel did run in this folder...
    assert not (pytester.path / "after.txt").exists()  # ...and stopped before the last cell
    assert exercises(report) == {"late": {"status": "not run", "reason": "not run: the checker stopped at Cell 1: ValueError: boom"}}


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_gpu_cell_skipped_without_cuda(pytester):
    gpu = new_code_cell('open("gpu.txt", "w").write("ran")\nraise RuntimeError("the gpu cell ran")', metadata={"tags": ["gpu"]})
    result, _ = run(pytester, gpu, new_code_cell("x = 1"))
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["SKIPPED [[]1[]] *GPU cell: no usable CUDA device on this machine*"])
    assert not (pytester.path / "gpu.txt").exists()


def _output_cell(source, *outputs):
    return new_code_cell(source, metadata={"tags": ["nbval-check-output"]}, execution_count=1, outputs=list(outputs))


def _stream(name, text):
    return new_output("stream", name=name, text=text)


def test_stderr_never_fails_output_check(pytester):
    differs_in_stderr = _output_cell(
        'import sys\nprint("hello")\nprint("a new warning", file=sys.stderr)',
        _stream("stdout", "hello\n"),
        _stream("stderr", "an old warning\n"),
    )
    warns = new_code_cell('import warnings\nwarnings.warn("old api", FutureWarning, stacklevel=1)')  # fine without the flag
    differs_in_stdout = _output_cell('print("goodbye")', _stream("stdout", "hello\n"))  # control: stdout is compared
    result, _ = run(pytester, differs_in_stderr, warns, differs_in_stdout)
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["*Cell 0 PASSED*", "*Cell 1 PASSED*", "*Cell 2 FAILED*"])


def test_strict_warnings(pytester):
    """--course-strict-warnings fails a check cell (naming the warning) and an ordinary cell that print a FutureWarning."""
    warn = 'import warnings\nwarnings.warn("old api", FutureWarning, stacklevel=1)'
    check = check_cell("foo", warn + '\nprint("PASS foo")')
    result, report = run(pytester, check, new_code_cell(warn), new_code_cell("x = 1"), flags=["--course-strict-warnings"])
    result.assert_outcomes(failed=2, passed=1)  # a warning does not stop the notebook
    assert next(iter(report.values()))["stopped_at"] is None
    result.stdout.fnmatch_lines([
        "foo failed: printed a FutureWarning (--course-strict-warnings): *FutureWarning: old api",
        "*Cell 1 printed a FutureWarning (--course-strict-warnings): *FutureWarning: old api*",
    ])
    (verdict,) = exercises(report).values()
    assert verdict["status"] == "failed"
    assert verdict["reason"].startswith("printed a FutureWarning (--course-strict-warnings)")


# --- a real lesson: the course's exercises, the course's checks, time limits, dead kernels -----

from course_utils.tooling import layout  # noqa: E402
from course_utils.tooling.build import stub  # noqa: E402
from test_grade import without_demos  # noqa: E402


def lesson_notebook(lesson: str, solved: bool = True):
    """A lesson as a learner would have it: the solution copy (all solved) or the learner copy (untouched)."""
    source = layout.source_for(lesson)
    return nbformat.read(source if solved else layout.learner_path(source), as_version=4)


def cell_index(nb, tag: str) -> int:
    (index,) = [i for i, c in enumerate(nb.cells) if tag in c.metadata.get("tags", [])]
    return index


def answer(nb, name: str, body: str) -> None:
    """Give exercise `name` the function body `body` (indented by 4), whatever it was."""
    cell = nb.cells[cell_index(nb, f"exercise:{name}")]
    cell.source = stub(cell.source).replace("    # YOUR CODE HERE\n    raise NotImplementedError()", body)


def run_lesson(pytester, nb, *flags):
    nbformat.write(nb, pytester.path / "mine.ipynb")
    result = pytester.runpytest_subprocess(
        "-p", "course_utils.tooling.lean_imports", "--nbval-lax", "--nbval-current-env", "-p", "no:cacheprovider", "-v",
        "--course-report", "r.json", *flags, "mine.ipynb",
    )
    return result, exercises(json.loads((pytester.path / "r.json").read_text()))


def test_learner_cells_cannot_fake_a_pass(pytester):
    """A reassigned check, a rebound lesson module, an edited or deleted check cell, a renamed function, an endless loop."""
    names = [e.name for e in layout.exercises("01")]
    assert len(names) >= 6
    nb = lesson_notebook("01")
    # 0: wrong, and its check cell reassigns the check to one that always passes
    answer(nb, names[0], "    return None")
    nb.cells[cell_index(nb, f"check:{names[0]}")].source = (
        f"lesson01.check_{names[0]} = lambda fn: print('PASS {names[0]}: all checks passed')\nlesson01.check_{names[0]}({names[0]})"
    )
    # 1: wrong, and a cell before its check rebinds the lesson's module
    answer(nb, names[1], "    return None")
    nb.cells.insert(cell_index(nb, f"check:{names[1]}"), new_code_cell(
        "import course_utils.lesson01 as real\n\n"
        "class AlwaysPass:\n    def __getattr__(self, name):\n"
        "        return (lambda fn: print('PASS')) if name.startswith('check_') else getattr(real, name)\n\n"
        "lesson01 = AlwaysPass()"
    ))
    # 2: right, but its check cell is deleted
    del nb.cells[cell_index(nb, f"check:{names[2]}")]
    # 3: wrong, and its check cell's text replaced
    answer(nb, names[3], "    return None")
    nb.cells[cell_index(nb, f"check:{names[3]}")].source = f"print('PASS {names[3]}: all checks passed')"
    # 4: an endless loop
    answer(nb, names[4], "    while True:\n        pass")
    # 5: the function renamed
    cell = nb.cells[cell_index(nb, f"exercise:{names[5]}")]
    cell.source = cell.source.replace(f"def {names[5]}(", f"def my_{names[5]}(")
    result, verdicts = run_lesson(pytester, nb, "--course-exercise-timeout=3")
    assert verdicts[names[0]]["status"] == "failed" and "None" in verdicts[names[0]]["reason"]
    assert verdicts[names[1]]["status"] == "failed" and "None" in verdicts[names[1]]["reason"]
    assert verdicts[names[2]] == {"status": "failed", "reason": f"check cell missing: put the cell `lesson01.check_{names[2]}({names[2]})` back below your {names[2]}"}
    assert verdicts[names[3]]["status"] == "failed" and "None" in verdicts[names[3]]["reason"]
    assert verdicts[names[4]] == {"status": "failed", "reason": "took longer than 3 s: an endless loop?"}
    assert verdicts[names[5]] == {"status": "failed", "reason": f"{names[5]} is not defined: run the cell that defines it (was it renamed or deleted?)"}
    assert all(verdicts[n]["status"] == "passed" for n in names[6:]), verdicts
    assert list(verdicts) == names  # the course's exercises, in the course's order
    result.stdout.fnmatch_lines([f"*check {names[2]} (cell missing) FAILED*"])
    assert result.ret == 1


def test_a_dead_kernel_is_reported_as_one(pytester):
    names = [e.name for e in layout.exercises("00")]
    nb = lesson_notebook("00", solved=False)
    answer(nb, names[0], "    import os\n    os._exit(3)")
    start = time.monotonic()
    result, verdicts = run_lesson(pytester, nb)
    assert time.monotonic() - start < 60  # not the 45 s time limit on top of a kernel start
    assert verdicts[names[0]] == {"status": "failed", "reason": "the kernel died (exit 3)"}
    for name in names[1:]:
        assert verdicts[name]["status"] == "not run"
        assert verdicts[name]["reason"] == f"not run: the checker stopped at check {names[0]}: the kernel died (exit 3)"
    assert "outputs differ" not in result.stdout.str()


def test_a_cell_that_cannot_be_interrupted_is_stopped(pytester):
    nb = new_notebook(cells=[
        new_code_cell("x = 1"),
        new_code_cell("import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True:\n    pass"),
        new_code_cell("y = 2"),
    ])
    start = time.monotonic()
    result, _ = run(pytester, *nb.cells, flags=["--course-cell-timeout=2"])
    assert time.monotonic() - start < 40
    result.assert_outcomes(passed=1, failed=1, skipped=1)
    result.stdout.fnmatch_lines(["*Cell 1 failed (took longer than 2 s and could not be interrupted, so the kernel was stopped)*"])
    assert "outputs differ" not in result.stdout.str()


# An untouched learner copy, every check 'not attempted' and no other cell failed: tests/test_notebooks.py, all lessons.


def test_an_earlier_version_of_a_lesson_is_told_to_reset(pytester):
    """A learner's copy from before the course replaced an exercise: the old one is skipped, the new one says how to get it."""
    names = [e.name for e in layout.exercises("00")]
    nb = lesson_notebook("00", solved=False)
    old, gone = "mean_value", names[-1]
    for cell in nb.cells:
        tags = cell.metadata.get("tags", [])
        if f"exercise:{gone}" in tags:
            cell.metadata["tags"] = [f"exercise:{old}"]
            cell.source = f"def {old}(x):\n    return x.float().mean().item()"
        if f"check:{gone}" in tags:
            cell.metadata["tags"] = [f"check:{old}"]
            cell.source = f"lesson00.check_{old}({old})"
    result, verdicts = run_lesson(pytester, nb)
    assert old not in verdicts
    assert verdicts[gone]["status"] == "failed"
    assert verdicts[gone]["reason"] == ("check cell missing: your notebook is an earlier version of lesson 00, and this exercise is new; "
                                       "`python -m course_utils reset 00` gives you the new version and keeps yours as a backup")
    result.stdout.fnmatch_lines([f"*check {old} (no longer in this lesson) SKIPPED*"])


LEAK = new_code_cell("import subprocess\nsubprocess.run(['sh', '-c', 'setsid sleep 60 >/dev/null 2>&1 &'], check=True)")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux's /proc and PR_SET_CHILD_SUBREAPER")
def test_no_leftovers_fails_a_notebook_that_leaves_a_process(pytester):
    """A process in a session of its own outlives the kernel: the notebook fails, naming it, and it is killed."""
    result, _ = run(pytester, new_code_cell("x = 1"), LEAK, flags=("--course-no-leftovers",))
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(["*LeftoverProcesses: 1 process(es) outlived the notebook, and were killed: *sleep 60*"])
    assert not [line for line in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout.splitlines()
                if line.strip() == "sleep 60"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux's /proc and PR_SET_CHILD_SUBREAPER")
def test_no_leftovers_passes_a_notebook_whose_processes_end(pytester):
    ended = new_code_cell("import subprocess\nsubprocess.run(['sh', '-c', 'setsid sleep 1 >/dev/null 2>&1 &'], check=True)")
    result, _ = run(pytester, ended, flags=("--course-no-leftovers",))
    result.assert_outcomes(passed=1)


def test_without_the_flag_a_leftover_is_not_looked_for(pytester):
    result, _ = run(pytester, new_code_cell("import subprocess\nsubprocess.run(['sh', '-c', 'setsid sleep 3 >/dev/null 2>&1 &'], check=True)"))
    result.assert_outcomes(passed=1)


def test_strict_nbval_fails_a_check_that_names_a_route_for_review(pytester):
    """`make test`'s gate on the solutions: under --nbval a check that passes but names a route for review fails, naming it.

    The solution, its demos left out, with a cell that defines a torch.Tensor subclass (harmless here, but a
    route the checker names for an instructor): the check after it passes as a check and fails as a cell,
    while add_one's, before it, passes. The untouched solutions pass with nothing to review: `make test` runs
    every one of them under this same strict nbval.
    """
    from course_utils.tooling import tamper

    flagged = without_demos(lesson_notebook("00"))
    flagged.cells.insert(cell_index(flagged, "check:draw"), new_code_cell("class Tagged(torch.Tensor):\n    pass"))
    (pytester.path / "flagged").mkdir()
    nbformat.write(flagged, pytester.path / "flagged" / layout.source_for("00").name)
    result = pytester.runpytest_subprocess(
        "-p", "course_utils.tooling.lean_imports", "--nbval", "--nbval-current-env", "-p", "no:cacheprovider", "-v",
        "--course-report", "r.json", "flagged",
    )
    route = f"{tamper.SUBCLASS}: class Tagged"
    result.stdout.fnmatch_lines(["*flagged/*::check draw FAILED*", f"draw failed: needs review under strict nbval: {route}"])
    assert result.parseoutcomes()["failed"] == 1
    (report,) = json.loads((pytester.path / "r.json").read_text()).values()
    assert report["exercises"] == {"add_one": {"status": "passed", "reason": ""},
                                   "draw": {"status": "failed", "reason": f"needs review under strict nbval: {route}"}}
    assert report["review"] == [route] and report["stopped_at"] is None
