"""The command line, `python -m course_utils ...`: help, finding notebooks, and one-line errors without tracebacks."""

import re
import subprocess
import sys

import pytest

from course_utils.tooling import cli, layout, workspace


@pytest.fixture
def work(tmp_path, monkeypatch):
    folder = tmp_path / "work"
    monkeypatch.setenv("COURSE_WORK_DIR", str(folder))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))  # no JupyterLab of this machine's is asked
    return folder


def run(*args, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "course_utils", *args], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.parametrize("command, words", [
    ("build", ["--execute", "lessons"]),
    ("check", ["--solutions", "lesson"]),
    ("progress", ["--recheck"]),
    ("restore", ["--list", "backup"]),
])
def test_help_exits_zero(command, words):
    result = run(command, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: python -m course_utils {command}")
    for word in words:
        assert word in result.stdout


def test_help_lists_the_learners_commands_first_and_the_others_in_their_own_groups():
    result = run("--help")
    assert result.returncode == 0 and result.stdout.startswith("usage: python -m course_utils [-h] COMMAND ...")
    groups = [line for line in result.stdout.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert groups == ["options:", "your work:", "for instructors:", "for the course's maintainers:"]
    words = result.stdout.split()
    assert max(words.index(c) for c in ("lab", "check", "progress", "workspace", "reset", "restore")) < words.index("for")
    assert words.index("grade") < words.index("maintainers:") < min(words.index("build"), words.index("timings"))


@pytest.mark.parametrize("argv, said", [
    (["chek", "01"], "error: unknown command 'chek': did you mean check?"),
    (["restor", "01", "--list"], "error: unknown command 'restor': did you mean restore?"),
    (["zzz"], "error: unknown command 'zzz': the commands are lab, check, progress, workspace, reset, restore, grade, autograder, html, build, translations, timings"),
])
def test_a_mistyped_command_gets_a_did_you_mean(capsys, argv, said):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.startswith("usage: python -m course_utils [-h] COMMAND ...") and err.endswith(f"{said}\n")


@pytest.mark.parametrize("argv, said", [
    (["restore", "01", "--list", "extra"], "unrecognized arguments: extra"),
    (["restore", "01", "old", "--list"], "--list lists every backup of lesson 01: give it no backup name ('old')"),
    (["progress", "x"], "unrecognized arguments: x"),
    (["reset"], "the following arguments are required: lesson"),
])
def test_a_commands_own_errors_print_its_own_usage(capsys, argv, said):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert err.startswith(f"usage: python -m course_utils {argv[0]} [-h]") and err.endswith(f"python -m course_utils {argv[0]}: error: {said}\n")


def test_no_command_is_an_error(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main([])
    assert info.value.code == 2
    assert "required" in capsys.readouterr().err


@pytest.mark.parametrize("lesson, message", [
    ("²", "error: '²' is not a lesson: give a number such as 01"),
    ("abc", "error: 'abc' is not a lesson: give a number such as 01"),
    ("99", "error: there is no lesson 99: the lessons are 00, "),
])
def test_a_bad_lesson_is_one_line(lesson, message):
    result = run("check", lesson)
    assert result.returncode == 1
    assert result.stderr.startswith(message) and result.stderr.count("\n") == 1
    assert "Traceback" not in result.stderr + result.stdout


def test_check_without_a_work_copy_says_how_to_make_one(work, capsys):
    assert cli.main(["check", "01"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "does not exist yet: `make lab`" in err


@pytest.mark.parametrize("content, message", [("", "is empty"), ('{"cells": [', "truncated"), ("[]", "is not a notebook")])
def test_check_names_an_unreadable_notebook(tmp_path, capsys, content, message):
    path = tmp_path / "mine.ipynb"
    path.write_text(content)
    assert cli.main(["check", str(path)]) == 1
    assert message in capsys.readouterr().err


def test_find_notebook():
    source = cli.find_notebook("1", solutions=True)
    assert source.name.startswith("01_") and source.parent.name == "solutions"
    assert cli.find_notebook("x/y.ipynb").name == "y.ipynb"


def test_find_notebook_is_the_learners_own_copy(work):
    workspace.ensure_workspace()
    assert cli.find_notebook("01") == work / layout.source_for("01").name


def test_workspace_reset_restore_commands(work, capsys):
    assert cli.main(["workspace"]) == 0
    assert capsys.readouterr().out.startswith(f"made {len(layout.source_notebooks())} notebooks in ")
    assert cli.main(["workspace"]) == 0
    assert "has every lesson" in capsys.readouterr().out
    path = work / layout.source_for("02").name
    path.write_text(path.read_text().replace('"cells": [', '"cells": [{"cell_type": "markdown", "metadata": {}, "source": "mine"},', 1))
    assert cli.main(["reset", "02"]) == 0
    out = capsys.readouterr().out
    assert "is a fresh copy; your previous file is kept as " in out and "backups" in out
    assert cli.main(["restore", "02", "--list"]) == 0
    assert capsys.readouterr().out.count("02_") == 1
    assert cli.main(["restore", "02"]) == 0
    assert "mine" in path.read_text()


def test_restore_list_says_when_each_backup_was_made_by_which_command_and_how_many_passed(work, capsys):
    """Two backups of lesson 00, one with a check's saved PASS in it: the listing tells them apart without a run."""
    import nbformat

    workspace.ensure_workspace()
    path = work / layout.source_for("00").name
    nb = nbformat.read(path, as_version=4)
    checks = [c for c in nb.cells if any(t.startswith("check:") for t in c.metadata.get("tags", []))]
    name = checks[0].metadata["tags"][0].split(":", 1)[1]
    checks[0].outputs = [nbformat.v4.new_output("display_data", {"text/plain": f"PASS {name}: all checks passed"})]
    nbformat.write(nb, path)
    assert cli.main(["reset", "00"]) == 0
    assert cli.main(["restore", "00"]) == 0  # keeps the fresh copy it replaced as a second backup
    capsys.readouterr()
    assert cli.main(["restore", "00", "--list"]) == 0
    header, *rows = capsys.readouterr().out.splitlines()
    assert header.startswith("lesson 00's backups in ") and "oldest first" in header
    first, second = (row.split("  ") for row in rows)
    first, second = [c.strip() for c in first if c.strip()], [c.strip() for c in second if c.strip()]
    assert first[0].startswith("00_orientation.") and re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", first[1])
    assert first[2:] == ["by reset 00", f"1 of {len(checks)} exercises passed"]
    assert second[2:] == ["by restore 00", f"0 of {len(checks)} exercises passed"]


def test_progress_exits_nonzero_and_names_an_unreadable_notebook(work, capsys):
    workspace.ensure_workspace()
    broken = work / layout.source_for("03").name
    broken.write_text("")
    assert cli.main(["progress"]) == 1
    out = capsys.readouterr().out
    assert f"problem: {broken} is empty" in out
    broken.unlink()
    workspace.ensure_workspace()
    assert cli.main(["progress"]) == 0


def test_a_read_only_folder_is_one_line(work, capsys, monkeypatch):
    def refuse(path, text):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(workspace, "write_atomic", refuse)
    assert cli.main(["workspace"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Permission denied (is the folder writable, and is there disk space?)" in err
    assert err.count("\n") == 1


def test_ctrl_c_is_one_line(capsys, monkeypatch):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_run", interrupted)
    assert cli.main(["progress"]) == 130
    err = capsys.readouterr().err
    assert err.startswith("interrupted: ") and err.count("\n") == 1


def test_a_python_without_nbval_is_told_which_python_to_use(monkeypatch):
    import builtins

    from course_utils.tooling import runner

    real_import = builtins.__import__

    def no_nbval(name, *args, **kwargs):
        if name == "nbval":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_nbval)
    with pytest.raises(layout.CourseError, match=r"has no nbval, so it cannot run the checker: use the course's environment, e\.g\. `\.venv/bin/python -m course_utils"):
        runner.require_nbval()


# --- a notebook that holds another lesson than its name says -------------------------------


def _lesson_in_the_wrong_file(work, held: str = "01", named: str = "00"):
    """Lesson `held` saved under lesson `named`'s file name, and `held`'s own record full of passes."""
    from course_utils.tooling import progress
    from course_utils.tooling.verdicts import Verdict

    workspace.ensure_workspace()
    wrong = work / layout.source_for(named).name
    wrong.write_bytes(layout.learner_path(layout.source_for(held)).read_bytes())
    passes = [Verdict(e.name, "passed") for e in layout.exercises(held)]
    progress.save_verdicts(work, held, passes, replace=True)
    return wrong, progress.load_records(work)


def _no_checker(monkeypatch):
    from course_utils.tooling import runner

    def refuse(*args, **kwargs):
        raise AssertionError("the checker was started")

    monkeypatch.setattr(runner, "run_checker", refuse)


def test_check_of_a_file_that_holds_another_lesson_is_refused_in_one_line(work, capsys, monkeypatch):
    from course_utils.tooling import progress

    wrong, before = _lesson_in_the_wrong_file(work)
    _no_checker(monkeypatch)
    assert cli.main(["check", "00"]) == 1  # nothing was checked, so nothing passed
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"error: {wrong} holds lesson 01, not 00: it is not checked as lesson 00 and nothing is recorded for it; ")
    assert "`python -m course_utils reset 00` for a fresh lesson 00" in err
    assert progress.load_records(work) == before  # lesson 01's passes are untouched


def test_check_by_path_judges_what_it_holds_and_records_neither_lesson(work, capsys, monkeypatch):
    from course_utils.tooling import progress, runner

    wrong, before = _lesson_in_the_wrong_file(work)
    names = [e.name for e in layout.exercises("01")]
    result = {"lesson": "01", "exercises": {n: {"status": "not attempted", "reason": "later"} for n in names}, "stopped_at": None}
    monkeypatch.setattr(runner, "run_checker", lambda paths: {str(paths[0]): result})
    assert cli.main(["check", str(wrong)]) == 1
    out = capsys.readouterr().out
    assert out.splitlines()[-1].startswith(f"Not recorded: {wrong} holds lesson 01, not 00")
    assert progress.load_records(work) == before


def test_progress_names_a_file_that_holds_another_lesson_and_recheck_skips_it(work, capsys, monkeypatch):
    from course_utils.tooling import progress, runner

    wrong, before = _lesson_in_the_wrong_file(work)
    rechecked = []
    monkeypatch.setattr(runner, "run_checker", lambda paths: rechecked.extend(paths) or {})
    assert cli.main(["progress", "--recheck"]) == 1
    out = capsys.readouterr().out
    assert f"problem: {wrong} holds lesson 01, not 00" in out
    assert wrong not in rechecked and work / layout.source_for("01").name in rechecked
    table = progress.progress_table()
    assert table.loc[layout.source_for("00").stem, "failing"] == "(holds another lesson)"
    assert progress.load_records(work) == before


def test_check_of_a_correct_notebook_passes_and_is_recorded_despite_a_malformed_record(work, capsys):
    """The real checker, end to end: a broken .progress.json is set aside and the check still passes."""
    from course_utils.tooling import progress

    workspace.ensure_workspace()
    mine = work / layout.source_for("00").name
    mine.write_bytes(layout.source_for("00").read_bytes())  # the solved lesson
    (work / ".progress.json").write_text('{"00": "x"}')
    assert cli.main(["check", "00"]) == 0
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err and "failed" not in out.replace("0 failed", "")
    (kept,) = work.glob(".progress.json.broken-*")  # by the lesson's own progress_table() cell, or by the command
    assert kept.read_text() == '{"00": "x"}'
    statuses = {v["status"] for v in progress.load_records(work)["00"].values()}
    assert statuses == {"passed"}


# --- saved or not: `check` reads the file, the notebook's own checks judge the kernel ---------


def _notebook_passed(work, lesson: str, exercise: str, when: float) -> None:
    """The notebook's own check cell recorded a pass of `exercise` at `when` (as a kernel in work/ does)."""
    import json

    from course_utils.tooling import progress
    from course_utils.tooling.verdicts import Verdict

    progress.save_verdicts(work, lesson, [Verdict(exercise, "passed")], by=progress.NOTEBOOK)
    records = progress.load_records(work)
    records[lesson][exercise]["time"] = when
    (work / progress.PROGRESS_FILE).write_text(json.dumps(records))


@pytest.mark.parametrize("command", [["check", "01"], ["progress", "--recheck"]])
@pytest.mark.parametrize("seconds, unsaved", [(5, True), (-5, False)], ids=["pass-newer-than-the-file", "pass-older"])
def test_a_saved_file_behind_its_notebooks_own_verdicts_is_named_in_one_line(work, capsys, monkeypatch, command, seconds, unsaved):
    from course_utils.tooling import progress, runner

    workspace.ensure_workspace()
    mine = work / layout.source_for("01").name
    names = [e.name for e in layout.exercises("01")]
    _notebook_passed(work, "01", names[0], mine.stat().st_mtime + seconds)
    result = {"lesson": "01", "exercises": {n: {"status": "not attempted", "reason": "not attempted yet"} for n in names},
              "stopped_at": None}
    monkeypatch.setattr(runner, "run_checker", lambda paths: {str(p.resolve()): result for p in paths if p.name == mine.name})
    cli.main(command)
    out = capsys.readouterr().out
    line = "lesson 01 has changes newer than the saved file: save it (Ctrl-S) and check again"
    assert out.count(line) == (1 if unsaved else 0), out
    kept = progress.load_records(work)["01"][names[0]]
    assert (kept["status"], kept["by"]) == (("passed", "notebook") if unsaved else ("not attempted", "check"))
