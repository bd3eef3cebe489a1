"""course_utils.tooling.cellruns: a check names the exercise cell that raised, in JupyterLab and under the checker alike."""

import subprocess
import sys
from types import SimpleNamespace

import nbformat
import pytest

from course_utils.tooling import cellruns
from course_utils.tooling.checks import call, exercise, expect_equal
from course_utils.tooling.layout import learner_path, source_for
from course_utils.tooling.verdicts import Verdict

STUB = "raise NotImplementedError()"


@pytest.fixture(autouse=True)
def namespace(monkeypatch):
    """The kernel's namespace as the callback sees it, and no failures recorded yet."""
    names: dict = {}
    monkeypatch.setattr(cellruns, "_failures", {})
    monkeypatch.setattr(cellruns, "_user_namespace", lambda: names)
    return names


def ran(source: str, error: BaseException | None = None, before: bool = False) -> None:
    """What IPython hands post_run_cell after a cell ran: its source and the error, before or during execution."""
    result = SimpleNamespace(info=SimpleNamespace(raw_cell=source),
                             error_before_exec=error if before else None, error_in_exec=None if before else error)
    cellruns.after_cell(result)


def syntax_error(source: str) -> SyntaxError:
    try:
        compile(source, "/tmp/ipykernel_1/3080951878.py", "exec")
    except SyntaxError as err:
        return err
    raise AssertionError("it compiled")


@exercise("double")
def check_double(fn) -> None:
    expect_equal(call(fn, 2), 4)


def test_a_check_of_what_a_failed_cell_left_names_that_cell(namespace):
    def double(x):
        raise NotImplementedError()

    namespace["double"] = double
    source = "def double(x):\n    return (x * 2\n"
    error = syntax_error(source)
    ran(source, error, before=True)
    assert check_double.verdict(double) == Verdict(
        "double", "failed", f"your cell for `double` raised SyntaxError at line 2 ({error.msg}): fix it and run that cell again")
    ran("def double(x):\n    return x * 2\n")  # run again, fixed: the stale record is gone
    assert check_double.verdict(double).status == "not attempted"


def test_a_name_bound_since_by_another_cell_is_judged_as_usual(namespace):
    namespace["double"] = stale = lambda x: x
    source = "def double(x):\n    return (x * 2\n"
    ran(source, syntax_error(source), before=True)
    assert cellruns.failure_for(stale) is not None
    assert check_double.verdict(lambda x: 2 * x).passed  # not the object the failed run left: no record applies


def test_a_cell_that_raised_after_its_def_names_the_line_it_raised_at(namespace):
    def double(x):
        return x * 2

    namespace["double"] = double
    try:
        exec(compile("def double(x):\n    return x * 2\n\ndouble(nothing)\n", "/tmp/ipykernel_1/1.py", "exec"), {})
    except NameError as err:
        error = err
    ran("def double(x):\n    return x * 2\n\ndouble(nothing)\n", error)
    assert check_double.verdict(double).reason == (
        "your cell for `double` raised NameError at line 4 (name 'nothing' is not defined): fix it and run that cell again")


def test_a_name_its_first_failed_run_left_undefined_gets_a_stand_in_that_names_the_cell(namespace):
    source = "class Net:\n  x = 1\n    y = 2\n"
    ran(source, syntax_error(source), before=True)
    message = ("your cell for `Net` raised IndentationError at line 3 (unexpected indent): "
               "fix it and run that cell again")
    stand_in = namespace["Net"]
    with pytest.raises(cellruns.CellRaised, match="your cell for `Net` raised IndentationError"):
        stand_in()
    assert cellruns.failure_for(stand_in).message() == message
    ran("class Net:\n  x = 1\n")  # fixed and run: the record is gone (the cell itself rebinds the name)
    assert cellruns.failure_for(stand_in) is None


def test_an_undefined_name_is_named_through_its_failed_cell(namespace, monkeypatch):
    """Where no stand-in could be bound (the learner deleted it since), the checker's NameError path names the cell."""
    source = "class Net:\n  x = 1\n    y = 2\n"
    ran(source, syntax_error(source), before=True)
    monkeypatch.setitem(cellruns._failures, "Net", cellruns.CellFailure("Net", "IndentationError", 3, "unexpected indent"))
    failure = cellruns.failure_of_unbound("Net", {})
    assert failure.message() == ("your cell for `Net` raised IndentationError at line 3 (unexpected indent): "
                                 "fix it and run that cell again")
    assert cellruns.failure_of_unbound("Net", {"Net": object()}) is None


def test_cells_that_define_nothing_and_broken_bookkeeping_change_nothing(namespace):
    ran("x = 1 / 0", ZeroDivisionError("division by zero"))
    assert cellruns._failures == {}
    cellruns.after_cell(object())  # never raises into the learner's cell


def test_the_plugin_words_an_error_output_the_same_way():
    syntax = {"ename": "SyntaxError", "evalue": "incomplete input (3080951878.py, line 2)",
              "traceback": ["\x1b[36mCell\x1b[39m \x1b[32mIn[4]\x1b[39m\x1b[32m, line 2\x1b[39m", "SyntaxError: incomplete input"]}
    assert cellruns.message_from_output("record_frames", syntax) == (
        "your cell for `record_frames` raised SyntaxError at line 2 (incomplete input): fix it and run that cell again")
    runtime = {"ename": "ZeroDivisionError", "evalue": "division by zero",
               "traceback": ["Traceback", "Cell In[7], line 4\n----> 4 g(0)", "Cell In[7], line 2, in g(x)", "Cell In[3], line 9, in h"]}
    assert "raised ZeroDivisionError at line 2 (division by zero)" in cellruns.message_from_output("g", runtime)


# ---------------------------------------------------------------- one broken cell, in JupyterLab and under the checker

@pytest.mark.slow
def test_the_notebook_and_the_checker_give_one_verdict_on_the_same_broken_cell(tmp_path, monkeypatch):
    """A learner's answer with a missing bracket: its check cell in a JupyterLab kernel and `course_utils check` say the same line."""
    nb = nbformat.read(learner_path(source_for("00")), as_version=4)
    setup = next(c for c in nb.cells if c.cell_type == "code")
    code = next(c for c in nb.cells if any(t.startswith("exercise:") for t in c.metadata.get("tags", [])))
    name = next(t for t in code.metadata["tags"] if t.startswith("exercise:")).split(":", 1)[1]
    check = next(c for c in nb.cells if f"check:{name}" in c.metadata.get("tags", []))
    line = code.source.splitlines().index(next(ln for ln in code.source.splitlines() if ln.strip() == STUB)) + 1
    broken = nbformat.v4.new_code_cell(code.source.replace(STUB, "return (1 +"), metadata=code.metadata)
    nb.cells = [setup, broken, check]  # the lesson's other cells change nothing here, and cost seconds
    path = tmp_path / "00_orientation.ipynb"
    nbformat.write(nb, path)
    session = nbformat.read(path, as_version=4)  # in JupyterLab the learner wrote the answer before ever running the cell
    checker = subprocess.Popen([sys.executable, "-m", "course_utils", "check", str(path)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        from nbclient import NotebookClient

        monkeypatch.delenv("COURSE_CHECKER", raising=False)  # a learner's kernel, as JupyterLab starts it
        monkeypatch.setenv("COURSE_WORK_DIR", str(tmp_path / "work"))
        NotebookClient(session, timeout=120, allow_errors=True, resources={"metadata": {"path": str(tmp_path)}}).execute()
        shown = [o["data"]["text/plain"] for o in session.cells[2].outputs if o.get("output_type") == "display_data"]
        out, _ = checker.communicate(timeout=300)
    finally:
        checker.kill()
        checker.wait()
    expected = f"your cell for `{name}` raised SyntaxError at line {line} (incomplete input): fix it and run that cell again"
    assert shown == [f"FAIL {name}: {expected}"]
    assert [ln.split(None, 2) for ln in out.splitlines() if ln.split()[:2] == ["FAIL", name]] == [["FAIL", name, expected]], out
    assert ".py" not in out.split("exercises:")[0]  # no IPython file name such as 3080951878.py
