"""course_utils.tooling.progress: verdicts recorded as checks run, scoreboards, and the instant progress table."""

import json
import multiprocessing
import time

import pytest

from course_utils.tooling import layout, progress
from course_utils.tooling.checks import Verdict


@pytest.fixture
def work(tmp_path, monkeypatch):
    """An empty work folder, and a fresh session record."""
    folder = tmp_path / "work"
    folder.mkdir()
    monkeypatch.setenv("COURSE_WORK_DIR", str(folder))
    monkeypatch.setattr(progress, "_session", {})
    monkeypatch.delenv("COURSE_CHECKER", raising=False)  # set by the course's plugin in this pytest process too
    monkeypatch.delenv("JPY_SESSION_NAME", raising=False)
    return folder


def _names(lesson):
    return [e.name for e in layout.exercises(lesson)]


def test_a_check_run_in_the_work_folder_is_recorded(work, monkeypatch):
    monkeypatch.chdir(work)
    name = _names("01")[0]
    progress.record("01", Verdict(name, "failed", "wrong values"))
    records = json.loads((work / ".progress.json").read_text())
    assert records["01"][name]["status"] == "failed"
    assert records["01"][name]["reason"] == "wrong values"
    assert abs(records["01"][name]["time"] - time.time()) < 60
    assert records["01"][name]["by"] == "notebook"  # judged in the kernel, saved or not


def test_newer_in_notebook_compares_the_saved_files_verdict_with_the_notebooks_later_one(work):
    saved = time.time() - 100
    progress.save_verdicts(work, "01", [Verdict("a", "passed"), Verdict("b", "failed", "x"), Verdict("c", "passed")],
                           by=progress.NOTEBOOK)
    progress.save_verdicts(work, "01", [Verdict("d", "passed")])  # by the checker: the saved file's own verdict
    judged = [Verdict("a", "not attempted", "x"), Verdict("b", "not attempted", "x"), Verdict("c", "passed"),
              Verdict("d", "failed", "x")]
    assert progress.newer_in_notebook(work, "01", judged, saved) == ["a", "b"]  # c is no worse; d was not the notebook's
    assert progress.newer_in_notebook(work, "01", judged, time.time() + 100) == []  # saved since: the file is the newer


def test_a_check_run_elsewhere_is_kept_for_the_session_only(work, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    progress.record("01", Verdict("x", "passed"))
    assert not (work / ".progress.json").exists()
    assert progress._session == {"01": {"x": Verdict("x", "passed")}}


def test_save_merges_and_replaces(work):
    progress.save_verdicts(work, "02", [Verdict("a", "passed"), Verdict("b", "failed", "no")])
    progress.save_verdicts(work, "02", [Verdict("b", "passed")])
    assert {k: v["status"] for k, v in progress.load_records(work)["02"].items()} == {"a": "passed", "b": "passed"}
    progress.save_verdicts(work, "02", [Verdict("c", "not attempted", "later")], replace=True)
    assert list(progress.load_records(work)["02"]) == ["c"]
    progress.forget(work, "02")
    assert progress.load_records(work) == {}


@pytest.mark.parametrize("content", ["", "{", "[1]", "null"])
def test_an_unreadable_record_counts_as_none(work, content):
    (work / ".progress.json").write_text(content)
    assert progress.load_records(work) == {}
    progress.save_verdicts(work, "03", [Verdict("a", "passed")])  # and is replaced on the next save
    assert progress.load_records(work)["03"]["a"]["status"] == "passed"


MALFORMED = {
    "a string for a lesson": '{"00": "x"}',
    "a list": "[1, 2]",
    "not JSON": "{not json",
    "a string for an exercise": '{"00": {"draw": "passed"}}',
    "an exercise without a status": '{"00": {"draw": {"reason": "x"}}}',
    "not UTF-8": b"\xff\xfe{",
    "empty": "",
}


def _write(path, content):
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)


def _set_aside(work):
    return sorted(p for p in work.iterdir() if p.name.startswith(".progress.json.broken-"))


@pytest.mark.parametrize("content", MALFORMED.values(), ids=MALFORMED.keys())
def test_a_malformed_record_is_set_aside_with_one_line(work, capsys, content):
    _write(work / ".progress.json", content)
    original = (work / ".progress.json").read_bytes()
    assert progress.load_records(work) == {}
    (kept,) = _set_aside(work)
    assert kept.read_bytes() == original and not (work / ".progress.json").exists()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"{work / '.progress.json'} was ") and f"so it was set aside as {kept.name}; progress is recorded afresh" in err
    progress.save_verdicts(work, "03", [Verdict("a", "passed")])
    assert progress.load_records(work) == {"03": {"a": {"status": "passed", "reason": "", "by": "check",
                                                        "time": progress.load_records(work)["03"]["a"]["time"]}}}


@pytest.mark.parametrize("content", MALFORMED.values(), ids=MALFORMED.keys())
def test_a_malformed_record_never_fails_a_check(work, monkeypatch, capsys, content):
    """The symptom: a check in the work folder raised from record(), so a correct answer failed."""
    import IPython
    import IPython.display

    from course_utils.tooling.checks import exercise

    shown = []
    monkeypatch.delenv("COURSE_CHECKER", raising=False)
    monkeypatch.setattr(IPython, "get_ipython", lambda: type("Shell", (), {"kernel": 1})())
    monkeypatch.setattr(IPython.display, "display", lambda obj, raw=False: shown.append(obj))
    monkeypatch.chdir(work)
    _write(work / ".progress.json", content)

    def passing(fn):
        pass

    passing.__module__ = "course_utils.lesson00"  # a lesson's check records its verdict
    exercise("draw")(passing)(lambda: None)
    assert [obj["text/plain"] for obj in shown] == ["PASS draw: all checks passed"]
    assert progress.load_records(work)["00"]["draw"]["status"] == "passed"
    assert len(_set_aside(work)) == 1


@pytest.mark.parametrize("content", MALFORMED.values(), ids=MALFORMED.keys())
def test_progress_command_survives_a_malformed_record(work, capsys, content):
    from course_utils.tooling import cli, workspace

    workspace.ensure_workspace()
    _write(work / ".progress.json", content)
    assert cli.main(["progress"]) == 0
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err and "TOTAL" in out
    assert err.count("\n") == 1 and "set aside as .progress.json.broken-" in err


def test_two_malformed_records_in_one_second_are_both_kept(work):
    for content in ('{"00": "x"}', "[1]"):
        (work / ".progress.json").write_text(content)
        progress.load_records(work)
    assert sorted(p.read_text() for p in _set_aside(work)) == ['[1]', '{"00": "x"}']


def _writer(folder: str, lesson: str, n: int) -> None:
    for i in range(n):
        progress.save_verdicts(layout.Path(folder), lesson, [Verdict(f"e{i}", "passed")])


def test_two_kernels_recording_at_once_lose_nothing(work):
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(str(work), lesson, 25)) for lesson in ("04", "05")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    records = progress.load_records(work)
    assert len(records["04"]) == len(records["05"]) == 25


def test_scoreboard_lists_the_lessons_exercises_in_order():
    names = _names("01")
    rows = progress.scoreboard_rows("01", {names[1]: Verdict(names[1], "failed", "wrong values")})
    assert [r.exercise for r in rows] == names
    assert rows[1].status == "failed"
    assert rows[0] == Verdict(names[0], "not run", "not checked yet: run its check cell")
    text = progress.scoreboard_text("01", rows)
    assert text.splitlines()[0] == f"Lesson 01 scoreboard: {len(names)} exercises: 0 passed, 0 not attempted, 1 failed, {len(names) - 1} not checked"
    assert text.splitlines()[2].split() == ["FAIL", names[1], "wrong", "values"]


def test_show_scoreboard_prints_under_the_checker(monkeypatch, capsys):
    monkeypatch.setenv("COURSE_CHECKER", "1")
    names = _names("00")
    monkeypatch.setattr(progress, "_session", {"00": {n: Verdict(n, "passed") for n in names}})
    progress.show_scoreboard("00")
    out = capsys.readouterr().out
    assert out.startswith(f"Lesson 00 scoreboard: {len(names)} exercises: {len(names)} passed, 0 not attempted, 0 failed\n")


def test_show_scoreboard_displays_in_jupyterlab(monkeypatch):
    import IPython
    import IPython.display

    shown = []
    monkeypatch.delenv("COURSE_CHECKER", raising=False)
    monkeypatch.setattr(IPython, "get_ipython", lambda: type("Shell", (), {"kernel": 1})())
    monkeypatch.setattr(IPython.display, "display", lambda obj, raw=False: shown.append(obj))
    monkeypatch.setattr(progress, "_session", {})
    progress.show_scoreboard("00")
    (obj,) = shown
    assert obj["text/plain"].startswith("Lesson 00 scoreboard:")
    assert obj["text/html"].count("course-verdict") == len(_names("00"))


def test_progress_table_is_instant_and_names_what_fails(work):
    for source in layout.source_notebooks():
        (work / source.name).write_text(layout.learner_path(source).read_text())
    names = _names("01")
    progress.save_verdicts(work, "01", [Verdict(names[0], "passed"), Verdict(names[1], "failed", "no"), Verdict(names[2], "not attempted", "later")])
    start = time.perf_counter()
    table = progress.progress_table()
    assert time.perf_counter() - start < 1.0
    row = table.loc[layout.source_for("01").stem]
    assert (row["passed"], row["failed"], row["not attempted"], row["not checked"], row["total"]) == (1, 1, 1, len(names) - 3, len(names))
    assert row["failing"] == names[1]
    assert table.loc["TOTAL", "total"] == sum(len(_names(s.name[:2])) for s in layout.source_notebooks())
    assert table.attrs["problems"] == []


def test_progress_table_names_missing_and_unreadable_notebooks(work):
    sources = layout.source_notebooks()
    for source in sources[1:]:
        (work / source.name).write_text(layout.learner_path(source).read_text())
    (work / sources[2].name).write_text('{"cells": [')
    table = progress.progress_table()
    problems = table.attrs["problems"]
    assert len(problems) == 2
    assert problems[0].endswith(f"{sources[0].name} does not exist")
    assert "truncated" in problems[1]
    assert table.loc[sources[2].stem, "failing"] == "(notebook unreadable)"
    assert table.loc[sources[0].stem, "failing"] == "(not made yet)"  # missing is not unreadable
    text = progress.format_progress(table)
    assert text.splitlines()[-2].startswith("problem: ") and text.splitlines()[-1].startswith("problem: ")


@pytest.mark.parametrize("env, recorded", [
    ({}, True),  # a plain kernel in the work folder
    ({"JPY_SESSION_NAME": "/course/work/01_tensors.ipynb"}, True),  # JupyterLab, the lesson's own notebook
    ({"JPY_SESSION_NAME": "/course/work/00_orientation.ipynb"}, False),  # lesson 01's checks in lesson 00's file
    ({"JPY_SESSION_NAME": "/course/work/Untitled.ipynb"}, False),  # a scratch notebook
    ({"COURSE_CHECKER": "1"}, False),  # the checker: `course_utils check` records once it knows the lesson
])
def test_only_the_lessons_own_notebook_records_into_the_work_folder(work, monkeypatch, env, recorded):
    monkeypatch.chdir(work)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    progress.save_verdicts(work, "01", [Verdict("x", "passed")])
    progress.record("01", Verdict("x", "failed", "from another notebook"))
    assert progress._session["01"]["x"].status == "failed"  # this session's scoreboard has it either way
    assert progress.load_records(work)["01"]["x"]["status"] == ("failed" if recorded else "passed")


def test_a_notebook_holding_another_lesson_is_a_problem(work):
    sources = layout.source_notebooks()
    for source in sources:
        (work / source.name).write_text(layout.learner_path(source).read_text())
    wrong = work / sources[0].name
    wrong.write_text(layout.learner_path(sources[1]).read_text())
    held = sources[1].name[:2]
    assert progress.notebook_problem(wrong).startswith(f"{wrong} holds lesson {held}, not {sources[0].name[:2]}: ")
    assert progress.notebook_problem(work / sources[1].name) is None
    table = progress.progress_table()
    assert table.attrs["problems"] == [progress.notebook_problem(wrong)]
    assert table.loc[sources[0].stem, "failing"] == "(holds another lesson)"
