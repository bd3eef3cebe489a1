"""course_utils.tooling.grade: a class's submissions graded in one run, and the pieces of the gradebook."""

import csv
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pandas as pd
import pytest

from course_utils.distributed import process_status
from course_utils.tooling import grade, layout, sandbox
from course_utils.tooling.build import BEGIN, END
from course_utils.tooling.classroom import external_references
from course_utils.tooling.layout import edition_learner_path, source_for
from course_utils.tooling.translations import solution_path
from course_utils.tooling.runner import become_subreaper, descendants

STUB = "    # YOUR CODE HERE\n    raise NotImplementedError()"


def learner(lesson: str, lang: str = "en"):
    """The course's learner copy of a lesson, as a learner receives it (lang='zh': the Chinese edition's)."""
    return nbformat.read(edition_learner_path(source_for(lesson), lang), as_version=4)


def without_demos(nb):
    """The notebook with only what grading needs: its set-up cells, exercises, checks and scoreboard (no demo runs).

    For the tests that grade many copies of one lesson to see what an attack or a fault does: the demos
    would run again in each, and strict nbval runs them on the solutions.
    """
    def needed(cell) -> bool:
        tags = cell.metadata.get("tags", [])
        return (cell.cell_type != "code" or "hosted-setup" in tags or "%load_ext course_utils" in cell.source
                or any(t.startswith(("exercise:", "check:")) for t in tags) or ".scoreboard()" in cell.source)

    nb.cells = [c for c in nb.cells if needed(c)]
    return nb


def exercise_cell(nb, name: str):
    return next(c for c in nb.cells if f"exercise:{name}" in c.metadata.get("tags", []))


def fill(nb, name: str, body: str):
    """Replace the stub of one exercise with body (indented code)."""
    cell = exercise_cell(nb, name)
    assert STUB in cell.source
    cell.source = cell.source.replace(STUB, body)
    return nb


def solved(lesson: str, lang: str = "en"):
    """A learner copy with every exercise filled in from the lesson's own solution copy (lang='zh': the Chinese edition's)."""
    nb = learner(lesson, lang)
    solutions = nbformat.read(source_for(lesson) if lang == "en" else solution_path(source_for(lesson), lang), as_version=4)
    for cell in solutions.cells:
        names = [t.split(":", 1)[1] for t in cell.metadata.get("tags", []) if t.startswith("exercise:")]
        if names:
            code = "\n".join(line for line in cell.source.splitlines() if line.strip() not in (BEGIN, END))
            exercise_cell(nb, names[0]).source = code
    return nb


def snapshot(folder: Path) -> dict[str, tuple[str, int]]:
    """Every path under folder, with its content's hash and modification time."""
    return {
        str(p.relative_to(folder)): (hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir", p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
    }


# ---------------------------------------------------------------- the whole class in one run

@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """Grade a folder of lesson 00 and 01 submissions with every kind of trouble; return (CSV rows, the run, the output folder, leftover processes)."""
    folder = tmp_path_factory.mktemp("submissions")
    out = tmp_path_factory.mktemp("out")
    nbformat.write(solved("01"), folder / "ada.ipynb")
    nbformat.write(learner("01"), folder / "bob.ipynb")  # untouched
    # The lesson-00 submissions leave out the demos: what is graded here is each one's trouble, not the lesson.
    wrong = fill(fill(without_demos(learner("00")), "add_one", "    return x + 2"), "draw", "    return torch.randn(n)")
    nbformat.write(wrong, folder / "cy.ipynb")
    # The same answers in the Chinese edition, in the same class: a solved copy and cy's wrong one.
    nbformat.write(fill(fill(without_demos(learner("00", "zh")), "add_one", "    return x + 2"), "draw", "    return torch.randn(n)"),
                   folder / "zh-cy.ipynb")
    nbformat.write(without_demos(solved("00", "zh")), folder / "zh-hal.ipynb")
    (folder / "dee.ipynb").write_text(nbformat.writes(solved("00"))[:300])  # truncated
    (folder / "empty.ipynb").write_text("")
    (folder / "notes.txt").write_text("my answers are in the notebook\n")  # not a notebook: ignored, and listed once
    (folder / "text.ipynb").write_text("my answers are in the notebook\n")  # named as one: unreadable
    looping = fill(without_demos(learner("00")), "add_one", "    while True:\n        pass")
    nbformat.write(fill(looping, "draw", "    return torch.randn(n, generator=torch.Generator().manual_seed(seed))"), folder / "eve.ipynb")
    # Renamed, and its lesson stamp removed: a lesson 00 notebook named like lesson 05 is graded as lesson 00.
    renamed = without_demos(solved("00"))
    renamed.metadata.pop("course", None)
    nbformat.write(renamed, folder / "05_training.ipynb")
    crash = fill(without_demos(learner("00")), "add_one", "    import os, signal\n    os.kill(os.getpid(), signal.SIGKILL)")
    nbformat.write(crash, folder / "fay.ipynb")
    no_check = without_demos(solved("00"))
    no_check.cells = [c for c in no_check.cells if "check:draw" not in c.metadata.get("tags", [])]
    (folder / "sub").mkdir()
    nbformat.write(no_check, folder / "sub" / "gus.ipynb")
    (folder / ".ipynb_checkpoints").mkdir()
    (folder / ".ipynb_checkpoints" / "ada-checkpoint.ipynb").write_text("{}")
    before = snapshot(folder)

    become_subreaper()  # so that any process the grading left behind would be re-parented to this one
    running = set(descendants())  # earlier tests' children, if any, are not the grader's
    run = subprocess.run(
        [sys.executable, "-m", "course_utils", "grade", str(folder), "--out", str(out / "grades.csv"),
         "--html", str(out / "grades.html"), "--jobs", "2", "--exercise-timeout", "3"],
        capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    leftover = [pid for pid in descendants() if pid not in running and (process_status(pid) or (0, "Z"))[1] != "Z"]
    assert snapshot(folder) == before, "grading wrote to the submissions' folder"
    with open(out / "grades.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    return rows, run, out, leftover


def verdicts(rows, submission):
    return {r["exercise"]: (r["status"], r["reason"]) for r in rows if r["submission"] == submission}


def test_csv_has_the_issue_columns(graded):
    rows, *_ = graded
    assert list(rows[0]) == ["submission", "lesson", "exercise", "status", "reason", "seconds", "review", "sandbox"]
    assert {r["status"] for r in rows} <= set(grade.STATUSES)


def test_solved_passes_and_untouched_is_not_attempted(graded):
    rows, *_ = graded
    ada, bob = verdicts(rows, "ada.ipynb"), verdicts(rows, "bob.ipynb")
    assert len(ada) == len(bob) == len(layout.exercises("01"))
    assert {s for s, _ in ada.values()} == {"pass"}
    assert {s for s, _ in bob.values()} == {"not attempted"}
    assert all("not attempted yet" in r for _, r in bob.values())
    assert {r["lesson"] for r in rows if r["submission"] in ("ada.ipynb", "bob.ipynb")} == {"01"}


def test_a_class_mixing_editions_gets_the_same_statuses_with_each_reason_in_its_language(graded):
    rows, *_ = graded
    english, chinese = verdicts(rows, "cy.ipynb"), verdicts(rows, "zh-cy.ipynb")
    assert {n: s for n, (s, _) in chinese.items()} == {n: s for n, (s, _) in english.items()} == {"add_one": "failed", "draw": "failed"}
    assert all(re.search(r"[\u4e00-\u9fff]", reason) for _, reason in chinese.values()), chinese
    assert {s for s, _ in verdicts(rows, "zh-hal.ipynb").values()} == {"pass"}
    assert {r["lesson"] for r in rows if r["submission"].startswith("zh-")} == {"00"}


def test_wrong_answers_fail_with_the_checks_reason(graded):
    rows, *_ = graded
    cy = verdicts(rows, "cy.ipynb")
    assert cy["add_one"][0] == "failed" and "expected" in cy["add_one"][1]
    assert cy["draw"] == ("failed", "draw(7, 5) changed torch's global random state, which the notebook's other cells draw from: "
                                    "leave it alone, and draw from a torch.Generator of your own")


def test_unreadable_files_are_rows_not_crashes(graded):
    rows, *_ = graded
    (status, reason), = verdicts(rows, "dee.ipynb").values()
    assert status == "unreadable" and reason.startswith("the file is not a readable notebook: its JSON breaks off at line")
    assert verdicts(rows, "empty.ipynb") == {"": ("unreadable", "the file is empty")}
    assert verdicts(rows, "text.ipynb") == {"": ("unreadable", "the file is not a notebook (it is not JSON)")}


def test_files_that_are_not_notebooks_are_ignored_and_listed_once(graded):
    rows, run, *_ = graded
    assert not [r for r in rows if r["submission"] == "notes.txt"]
    assert run.stdout.count("notes.txt") == 1
    assert "ignored (not notebooks, *.ipynb): notes.txt\n" in run.stdout


def test_endless_loop_fails_and_grading_goes_on(graded):
    rows, *_ = graded
    eve = verdicts(rows, "eve.ipynb")
    assert eve["add_one"] == ("failed", "took longer than 3 s: an endless loop?")
    assert eve["draw"][0] == "pass"


def test_dead_kernel_fails_its_rows(graded):
    rows, *_ = graded
    fay = verdicts(rows, "fay.ipynb")
    assert fay["add_one"][0] == "failed" and "kernel died" in fay["add_one"][1]
    assert fay["draw"][0] == "failed" and "kernel died" in fay["draw"][1]


def test_lesson_comes_from_content_not_name(graded):
    rows, *_ = graded
    renamed = [r for r in rows if r["submission"] == "05_training.ipynb"]
    assert {r["lesson"] for r in renamed} == {"00"}
    assert {r["exercise"]: r["status"] for r in renamed} == {"add_one": "pass", "draw": "pass"}


def test_missing_check_cell_and_subfolders(graded):
    rows, *_ = graded
    gus = verdicts(rows, "sub/gus.ipynb")
    assert gus["add_one"][0] == "pass"
    assert gus["draw"][0] == "missing" and gus["draw"][1].startswith("check cell missing")
    assert not [r for r in rows if "checkpoint" in r["submission"]]  # hidden folders are not submissions


def test_summary_tables_printed(graded):
    _, run, *_ = graded
    assert "Per submission:" in run.stdout and "Per exercise" in run.stdout
    count = len(layout.exercises("01"))  # ada solved every exercise of lesson 01, bob none
    assert "ada.ipynb" in run.stdout and f"{count}/{count}" in run.stdout and f"0/{count}" in run.stdout
    assert "changed torch's global random state" in run.stdout  # draw's only failure reason
    summary = run.stdout[run.stdout.index("Per submission:"):]
    assert max(map(len, summary.splitlines())) <= 200 and "…" in summary  # long reasons are cut, not padded out


def test_progress_bar_on_stderr(graded):
    _, run, *_ = graded
    lines = [line for line in run.stderr.splitlines() if line.startswith("grading [")]
    assert len(lines) == 12
    assert lines[-1].startswith("grading [########################] 12/12 submissions") and lines[-1].endswith("passed)")
    assert "left" in lines[0] or "estimating" in lines[0]


def test_html_page_is_self_contained(graded):
    _, _, out, _ = graded
    page = (out / "grades.html").read_text()
    assert "data:image/png;base64," in page
    assert not external_references(page)
    assert "http://" not in page and "https://" not in page
    assert "Per exercise" in page and "draw" in page and "ada.ipynb" in page


def test_no_process_left_behind(graded):
    *_, leftover = graded
    assert leftover == []


# ---------------------------------------------------------------- the pieces, without a kernel

@pytest.mark.parametrize("verdict, expected", [
    ({"status": "passed", "reason": ""}, ("pass", "")),
    ({"status": "not attempted", "reason": "not attempted yet: x"}, ("not attempted", "not attempted yet: x")),
    ({"status": "failed", "reason": "expected 3, got 4"}, ("failed", "expected 3, got 4")),
    ({"status": "failed", "reason": "check cell missing: put the cell `x` back"}, ("missing", "check cell missing: put the cell `x` back")),
    ({"status": "not run", "reason": "not run: check a: the kernel died (killed by signal 9)"},
     ("failed", "not run: check a: the kernel died (killed by signal 9)")),
    ({"status": "not run", "reason": "the check cell did not run"}, ("failed", "its check cell did not run")),
])
def test_status_words(verdict, expected):
    assert grade._status(verdict) == expected


def test_lesson_from_metadata_tags_or_check_calls():
    nb = json.loads(nbformat.writes(learner("01")))
    assert grade.submission_lesson(nb) == "01"
    nb["metadata"].pop("course")
    assert grade.submission_lesson(nb) == "01"  # from the exercise tags
    for cell in nb["cells"]:
        cell["metadata"].pop("tags", None)
    assert grade.submission_lesson(nb) == "01"  # from `lesson01.check_...(...)` in the check cells
    for cell in nb["cells"]:
        cell["source"] = "x = 1"
    assert grade.submission_lesson(nb) is None


def test_find_submissions_skips_hidden(tmp_path):
    (tmp_path / "a.ipynb").write_text("{}")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "c.json").write_text("{}")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "x").write_text("")
    (tmp_path / ".hidden.ipynb").write_text("")
    (tmp_path / "b" / "d.ipynb").write_text("{}")
    (tmp_path / ".ipynb_checkpoints").mkdir()
    (tmp_path / ".ipynb_checkpoints" / "a-checkpoint.ipynb").write_text("{}")
    assert [p.relative_to(tmp_path).as_posix() for p in grade.find_submissions(tmp_path)] == ["a.ipynb", "b/d.ipynb"]
    assert [p.relative_to(tmp_path).as_posix() for p in grade.ignored_files(tmp_path)] == ["b/c.json"]
    assert grade.ignored_line(tmp_path) == "ignored (not notebooks, *.ipynb): b/c.json"


def test_progress_bar_lines():
    stream = io.StringIO()
    bar = grade.ProgressBar(3, stream=stream, width=6)
    bar.step("a: 1/2 passed")
    bar.step()
    bar.step()
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("grading [##....] 1/3 submissions") and "left" in lines[0] and lines[0].endswith("(a: 1/2 passed)")
    assert lines[-1].startswith("grading [######] 3/3 submissions") and ", done" in lines[-1]


def test_outputs_inside_the_folder_are_refused(tmp_path, capsys):
    from course_utils.tooling.cli import main

    (tmp_path / "a.ipynb").write_text("")
    assert main(["grade", str(tmp_path), "--out", str(tmp_path / "grades.csv")]) == 1
    assert "outside" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.ipynb"]


def test_empty_or_missing_folder(tmp_path, capsys):
    from course_utils.tooling.cli import main

    assert main(["grade", str(tmp_path)]) == 1
    assert "no notebooks (*.ipynb) to grade" in capsys.readouterr().err
    (tmp_path / "notes.txt").write_text("x")
    assert main(["grade", str(tmp_path)]) == 1
    assert "no notebooks (*.ipynb) to grade" in capsys.readouterr().err
    assert main(["grade", str(tmp_path / "nope")]) == 1
    assert "is not a folder" in capsys.readouterr().err


def test_grade_help():
    result = subprocess.run([sys.executable, "-m", "course_utils", "grade", "--help"], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "COLUMNS": "200"})
    assert result.returncode == 0
    for word in ("--out", "--html", "--jobs", "--feedback", "--retry-errors", "--no-sandbox", "bubblewrap"):
        assert word in result.stdout


# ---------------------------------------------------------------- the grader's own failures are `error`, never the student's

def test_a_kernel_that_does_not_start_is_an_error_not_a_fail(tmp_path):
    """The fake fail: a kernel that never answered made every check `failed, its check cell did not run`."""
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "ipykernel_launcher.py").write_text("import sys\nsys.exit('this kernel never starts')\n")
    folder, out = tmp_path / "class", tmp_path / "out"
    folder.mkdir()
    nbformat.write(solved("00"), folder / "ada.ipynb")
    run = subprocess.run(
        [sys.executable, "-m", "course_utils", "grade", str(folder), "--out", str(out / "grades.csv"), "--no-sandbox"],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(broken), str(layout.root())])},
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "grading WITHOUT a sandbox" in run.stderr
    with open(out / "grades.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert {(r["exercise"], r["status"]) for r in rows} == {("add_one", "error"), ("draw", "error")}
    for r in rows:
        assert r["reason"].startswith("the grader failed, not the submission: the notebook's kernel did not start (RuntimeError: ")
        assert r["reason"].endswith("; grade this submission again") and r["sandbox"] == "none"


def test_a_sandbox_that_does_not_start_is_retried_once_then_an_error(tmp_path, monkeypatch):
    calls = []

    def failing_bwrap(argv, **kwargs):
        calls.append(argv)
        return [sys.executable, "-c", "import sys; sys.exit('bwrap: Creating new namespace failed: Operation not permitted')"]

    monkeypatch.setattr(sandbox, "command", failing_bwrap)
    nbformat.write(solved("00"), tmp_path / "ada.ipynb")
    rows = grade.Grader(grade.Settings()).grade(tmp_path / "ada.ipynb", "ada.ipynb")
    assert len(calls) == 2
    assert [(r["exercise"], r["status"]) for r in rows] == [("add_one", "error"), ("draw", "error")]
    assert rows[0]["reason"] == ("the grader failed, not the submission: the sandbox did not start or crashed (exit 1): "
                                 "bwrap: Creating new namespace failed: Operation not permitted; grade this submission again")


def test_a_sandbox_that_cannot_be_set_up_is_an_error_and_grading_goes_on(tmp_path, monkeypatch):
    def refusing(argv, **kwargs):
        raise RuntimeError("bwrap cannot make a sandbox on this machine (setting up uid map: Permission denied)")

    monkeypatch.setattr(sandbox, "command", refusing)
    nbformat.write(solved("00"), tmp_path / "ada.ipynb")
    rows = grade.Grader(grade.Settings()).grade(tmp_path / "ada.ipynb", "ada.ipynb")
    assert {r["status"] for r in rows} == {"error"}
    assert rows[0]["reason"] == ("the grader failed, not the submission: the grading process could not be started: bwrap cannot make "
                                 "a sandbox on this machine (setting up uid map: Permission denied); grade this submission again")


def test_retry_errors_regrades_only_the_error_rows(tmp_path):
    folder, out = tmp_path / "class", tmp_path / "out"
    folder.mkdir()
    out.mkdir()
    nbformat.write(solved("00"), folder / "ada.ipynb")
    nbformat.write(learner("00"), folder / "bob.ipynb")
    earlier = pd.DataFrame([
        grade._row("ada.ipynb", "00", "add_one", "error", "the grader failed, not the submission: x; grade this submission again", None),
        grade._row("ada.ipynb", "00", "draw", "error", "the grader failed, not the submission: x; grade this submission again", None),
        grade._row("bob.ipynb", "00", "add_one", "pass", "", 0.1),  # not true of bob.ipynb: it must stay as it was
        grade._row("bob.ipynb", "00", "draw", "pass", "", 0.1),
    ], columns=grade.COLUMNS)
    earlier.to_csv(out / "grades.csv", index=False)
    run = subprocess.run([sys.executable, "-m", "course_utils", "grade", str(folder), "--out", str(out / "grades.csv"), "--retry-errors"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    with open(out / "grades.csv", newline="") as f:
        rows = [(r["submission"], r["exercise"], r["status"]) for r in csv.DictReader(f)]
    assert rows == [("ada.ipynb", "add_one", "pass"), ("ada.ipynb", "draw", "pass"),
                    ("bob.ipynb", "add_one", "pass"), ("bob.ipynb", "draw", "pass")]
    assert "grading [########################] 1/1 submissions" in run.stderr


@pytest.mark.parametrize("arguments, message", [
    (["--timeout", "0"], "--timeout must be a number of seconds above 0, not 0"),
    (["--exercise-timeout", "-1"], "--exercise-timeout must be a number of seconds above 0, not -1"),
    (["--cell-timeout", "0"], "--cell-timeout must be a number of seconds above 0, not 0"),
    (["--jobs", "0"], "--jobs must be 1 or more, not 0"),
    (["--memory-mb", "0"], "--memory-mb must be 1 or more, not 0"),
    (["--out", "/proc/no/such/grades.csv"], "cannot write --out /proc/no/such/grades.csv: /proc is not a writable folder ("),
    (["--html", "{tmp}"], "--html {tmp} is a folder: give a file name"),
    (["--feedback", "{tmp}/file.txt"], "--feedback {tmp}/file.txt is a file: give a folder"),
    (["--retry-errors"], "--retry-errors regrades the `error` rows of an earlier gradebook: give that CSV with --out"),
])
def test_bad_arguments_are_refused_before_any_grading(tmp_path, capsys, arguments, message):
    from course_utils.tooling.cli import main

    folder = tmp_path / "class"
    folder.mkdir()
    nbformat.write(solved("00"), folder / "ada.ipynb")
    (tmp_path / "file.txt").write_text("")
    arguments = [a.replace("{tmp}", str(tmp_path)) for a in arguments]
    start = time.perf_counter()
    assert main(["grade", str(folder), *arguments]) == 1
    assert message.replace("{tmp}", str(tmp_path)) in capsys.readouterr().err
    assert time.perf_counter() - start < 5  # refused at once: no kernel was started


def test_without_bubblewrap_grading_refuses_in_one_line(tmp_path, capsys, monkeypatch):
    from course_utils.tooling.cli import main

    monkeypatch.setattr(sandbox, "bwrap_path", lambda: None)
    nbformat.write(solved("00"), tmp_path / "ada.ipynb")
    assert main(["grade", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "install it (Debian/Ubuntu: `sudo apt-get install bubblewrap`), or grade with --no-sandbox (unsafe)" in err
