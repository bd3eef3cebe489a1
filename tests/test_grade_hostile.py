"""Grading a hostile class: each submission attacks the grader, the course or a classmate; none of it may work.

Every attack runs inside one lesson-00 notebook (its demo cells left out), graded together with two honest classmates in the
sandbox (course_utils.tooling.sandbox). For each the test asserts what the issue asks: the course's
files are unchanged, no process is left, nothing leaked into the gradebook, no exercise passed that
was not solved, and every other submission is graded as if it were alone. That last one is checked
two ways:

- the honest classmates (ada.ipynb, who solved both exercises, and cy.ipynb, with a wrong add_one and
  an untouched draw), the victims it protects, are also graded in a run of their own, with no attacker;
  their rows in the class run must equal those, status and reason;
- each attacking submission's rows, status and reason per exercise, must equal what its own code
  earns, written in expected_verdicts() from lesson 00's checks run in this process: an untouched
  stub is "not attempted" with the check's stub reason, reader.ipynb's add_one fails with the
  ValueError it raises when its sandbox shows it nothing to leak, and selfkill.ipynb's two rows are
  the failure of a checker killed from inside. An attack that reached another submission (a checker
  killed or a report forged by forger.ipynb) changes that submission's rows, and the test fails.

An attack is not graded alone as well: in a run of its own it has no classmate to reach, so its
verdicts there are the ones the table fixes, and eight more runs (about 8 s of CPU each) would add
nothing to what the table proves.
"""

import csv
import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

from course_utils import lesson00
from course_utils.tooling import sandbox
from course_utils.tooling.layout import root as course_root
from test_grade import learner as whole_learner, solved as whole_solved, without_demos

pytestmark = pytest.mark.skipif(sandbox.bwrap_path() is None, reason="bubblewrap (bwrap) is not installed: .ci/run installs it")

MARK = f"hostile-{os.getpid()}"  # in every attack's process names and files, so that leftovers can be found
SECRET = f"instructor-token-{os.getpid()}"
CLASSMATE_TEXT = f"classmate-answer-{os.getpid()}"
HONEST = ("ada.ipynb", "cy.ipynb")  # the classmates the attacks must leave alone: graded without them too, to compare
KILLED = "the checker was killed by SIGKILL while the notebook ran: the notebook's code stopped the checker"


def learner(lesson: str):
    """The learner copy without its demos: twelve kernels grade this class, and the demos prove nothing here."""
    return without_demos(whole_learner(lesson))


def solved(lesson: str):
    """The solved copy without its demos, for the same reason."""
    return without_demos(whole_solved(lesson))


def with_cell(nb, code: str):
    """The notebook with a code cell of the student's own put right after add_one's exercise cell (so it can redefine add_one)."""
    exercise = next(i for i, c in enumerate(nb.cells) if "exercise:add_one" in c.metadata.get("tags", []))
    nb.cells.insert(exercise + 1, nbformat.v4.new_code_cell(code))
    return nb


def course_files() -> dict[str, str]:
    """The hash of every file the checker reads from the course (its package, notebooks and data)."""
    root = course_root()
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for folder in ("course_utils", "notebooks", "data") for p in sorted((root / folder).rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts}


def processes_named(word: str) -> list[str]:
    """Command lines of running processes that contain word (zombies have none)."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if word in cmdline and str(os.getpid()) != entry.name:
            found.append(cmdline)
    return found


def attacks(folder: Path, out: Path) -> dict[str, str]:
    """File name -> the code of one attack, each aimed at this class's real paths."""
    course_file = course_root() / "course_utils" / "lesson00.py"
    return {
        "rewrite.ipynb": f"""
import pathlib
target = pathlib.Path({str(course_file)!r})
try:
    target.write_text(target.read_text() + "\\ndef check_add_one(*args, **kwargs):\\n    pass\\n")
except OSError as err:
    print("could not rewrite the course:", type(err).__name__)
""",
        "forger.ipynb": """
import os, pathlib, signal
mine, pid = set(), os.getpid()
while pid > 1:
    mine.add(pid)
    pid = int(pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
for entry in pathlib.Path("/proc").glob("[0-9]*"):
    try:
        argv = (entry / "cmdline").read_bytes().split(b"\\0")
    except OSError:
        continue
    if b"--course-report" in argv and int(entry.name) not in mine:
        report = argv[argv.index(b"--course-report") + 1].decode()
        try:
            pathlib.Path(report).write_text('{"x": {"lesson": "00", "exercises": {}, "stopped_at": "copied from another submission"}}')
        except OSError:
            pass
        os.kill(int(entry.name), signal.SIGKILL)
""",
        "selfkill.ipynb": """
import json, os, pathlib, signal
checker = os.getppid()
argv = pathlib.Path(f"/proc/{checker}/cmdline").read_bytes().split(b"\\0")
if b"--course-report" in argv:
    report = argv[argv.index(b"--course-report") + 1].decode().replace("/dev/fd/", f"/proc/{checker}/fd/")
    passed = {"status": "passed", "reason": ""}
    fake = {"x": {"lesson": "00", "exercises": {"add_one": passed, "draw": passed}, "stopped_at": None}}
    try:
        pathlib.Path(report).write_text(json.dumps(fake))
    except OSError as err:
        print("could not forge the report:", type(err).__name__)
os.kill(checker, signal.SIGKILL)
""",
        "editor.ipynb": f"""
import subprocess, sys
code = '''
import pathlib, time
time.sleep(3)
for path in [pathlib.Path({str(out / "grades.csv")!r}), *pathlib.Path("/tmp").rglob("*.csv")]:
    try:
        path.write_text("submission,status\\\\neditor.ipynb,pass\\\\n")
    except OSError:
        pass
'''
subprocess.Popen([sys.executable, "-c", code, "csv-editor-{MARK}"], start_new_session=True)
""",
        "reader.ipynb": f"""
import os
def add_one(x):
    found = []
    for path in ({str(folder / "ada.ipynb")!r}, {str(out)!r}):
        try:
            found.append(open(path).read() if os.path.isfile(path) else " ".join(os.listdir(path)))
        except OSError as err:
            found.append(type(err).__name__)
    found.append(os.environ.get("GRADER_SECRET", "no secret"))
    raise ValueError("LEAK " + " | ".join(found)[:3000])
""",
        "writer.ipynb": f"""
import pathlib
for target in ({f"/tmp/{MARK}-tmp.txt"!r}, {str(folder / f"{MARK}-dir.txt")!r}, {str(course_root() / f"{MARK}-course.txt")!r},
               {str(out / f"{MARK}-out.txt")!r}):
    try:
        pathlib.Path(target).write_text("written by writer.ipynb")
    except OSError as err:
        print(target, type(err).__name__)
""",
        "hopper.ipynb": f"""
import subprocess, sys
hop = '''
import os, time
while True:
    time.sleep(0.05)
    if os.fork():
        os._exit(0)
'''
subprocess.Popen([sys.executable, "-c", hop, "fork-hopper-{MARK}"], start_new_session=True)
""",
    }


def grade(folder: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "course_utils", "grade", str(folder), "--out", str(out / "grades.csv"),
         "--html", str(out / "grades.html"), "--jobs", "2", "--exercise-timeout", "5", *extra],
        capture_output=True, text=True, timeout=900, env={**os.environ, "GRADER_SECRET": SECRET},
    )


def read_rows(out: Path) -> dict[str, dict[str, tuple[str, str]]]:
    with open(out / "grades.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    by_submission: dict[str, dict[str, tuple[str, str]]] = {}
    for r in rows:
        by_submission.setdefault(r["submission"], {})[r["exercise"]] = (r["status"], r["reason"])
    return by_submission, rows


def honest_classmates(folder: Path) -> None:
    solved_00 = solved("00")
    solved_00.cells.insert(0, nbformat.v4.new_markdown_cell(CLASSMATE_TEXT))
    nbformat.write(solved_00, folder / "ada.ipynb")
    wrong = learner("00")
    cell = next(c for c in wrong.cells if "exercise:add_one" in c.metadata.get("tags", []))
    cell.source = cell.source.replace("    # YOUR CODE HERE\n    raise NotImplementedError()", "    return x + 2")
    nbformat.write(wrong, folder / "cy.ipynb")


def write_class(folder: Path, out: Path) -> None:
    """The honest pair, every attack, and an untouched notebook whose check cells are tagged raises-exception."""
    honest_classmates(folder)
    for name, code in attacks(folder, out).items():
        nbformat.write(with_cell(learner("00"), code), folder / name)
    tagged = learner("00")
    for cell in tagged.cells:
        if any(t.startswith("check:") for t in cell.metadata.get("tags", [])):
            cell.metadata["tags"] = [*cell.metadata["tags"], "raises-exception"]
    nbformat.write(tagged, folder / "tagger.ipynb")


def graded_alone(tmp_path_factory, folder: Path) -> dict[str, dict[str, tuple[str, str]]]:
    """The honest classmates graded in a run of their own, with no attacker in it."""
    single, out = tmp_path_factory.mktemp("alone"), tmp_path_factory.mktemp("alone-out")
    for name in HONEST:
        (single / name).write_bytes((folder / name).read_bytes())
    assert grade(single, out).returncode == 0
    return read_rows(out)[0]


def expected_verdicts() -> dict[str, dict[str, tuple[str, str]]]:
    """What each attacking submission must get, (status, reason) per exercise: lesson 00's checks run here on what its code amounts to."""

    def add_one(x):  # as the learner copy hands it out
        raise NotImplementedError()

    def draw(seed, n):
        raise NotImplementedError()

    def leaking_add_one():
        def add_one(x):  # reader.ipynb's, in a sandbox with no classmate's file, no gradebook folder and no secret
            raise ValueError("LEAK FileNotFoundError | FileNotFoundError | no secret")
        return add_one

    def row(verdict) -> tuple[str, str]:
        assert not verdict.passed  # "not attempted" and "failed" are the gradebook's words too ("passed" is "pass")
        return verdict.status, verdict.reason

    untouched = {"add_one": row(lesson00.check_add_one.verdict(add_one)), "draw": row(lesson00.check_draw.verdict(draw))}
    return {
        "rewrite.ipynb": untouched,
        "forger.ipynb": untouched,
        "selfkill.ipynb": {"add_one": ("failed", KILLED), "draw": ("failed", KILLED)},
        "editor.ipynb": untouched,
        "reader.ipynb": {**untouched, "add_one": row(lesson00.check_add_one.verdict(leaking_add_one()))},
        "writer.ipynb": untouched,
        "hopper.ipynb": untouched,
        "tagger.ipynb": untouched,
    }


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    """The honest classmates graded without the attackers, then the whole class together; returns both gradebooks and what was seen after."""
    folder, out = tmp_path_factory.mktemp("class"), tmp_path_factory.mktemp("out")
    write_class(folder, out)
    lesson00_file = course_root() / "course_utils" / "lesson00.py"
    original = lesson00_file.read_bytes()
    before = course_files()
    try:
        alone = graded_alone(tmp_path_factory, folder)
        run = grade(folder, out)
    finally:
        changed = course_files() != before
        lesson00_file.write_bytes(original)  # should the sandbox ever fail, the checkout is put right for the next tests
    csv_right_after = (out / "grades.csv").read_bytes()
    time.sleep(4)  # the editor's process would write 3 s after grading ended
    assert run.returncode == 0, run.stdout + run.stderr
    graded, rows = read_rows(out)
    return {"alone": alone, "graded": graded, "rows": rows, "run": run, "out": out, "folder": folder,
            "course changed": changed, "csv right after": csv_right_after}


def test_the_course_files_are_unchanged(hostile):
    assert not hostile["course changed"]
    assert "could not rewrite" not in hostile["run"].stdout  # a cell's print never reaches the grader's output


def test_every_submission_is_graded_as_if_it_were_alone(hostile):
    graded, expected = hostile["graded"], expected_verdicts()
    assert set(graded) == set(HONEST) | set(expected) == {p.name for p in hostile["folder"].glob("*.ipynb")}
    assert {name: graded[name] for name in HONEST} == hostile["alone"]
    assert {s for s, _ in graded["ada.ipynb"].values()} == {"pass"}
    for name, verdicts in expected.items():
        assert graded[name] == verdicts, name


def test_no_fake_pass(hostile):
    for name, verdicts in hostile["graded"].items():
        if name not in ("ada.ipynb", "cy.ipynb"):
            assert "pass" not in {status for status, _ in verdicts.values()}, (name, verdicts)


def test_the_raises_exception_tag_changes_nothing_and_is_named_for_review(hostile):
    assert {s for s, _ in hostile["graded"]["tagger.ipynb"].values()} == {"not attempted"}
    reviews = {r["review"] for r in hostile["rows"] if r["submission"] == "tagger.ipynb"}
    assert len(reviews) == 1 and reviews.pop().startswith("nbval tags or markers on an exercise or check cell")


def test_nothing_leaked_into_the_gradebook(hostile):
    run, out = hostile["run"], hostile["out"]
    for text in (run.stdout, run.stderr, (out / "grades.csv").read_text(), (out / "grades.html").read_text()):
        assert SECRET not in text and CLASSMATE_TEXT not in text
    status, reason = hostile["graded"]["reader.ipynb"]["add_one"]
    assert status == "failed" and "LEAK FileNotFoundError | FileNotFoundError | no secret" in reason


def test_no_write_reached_outside_the_submission(hostile):
    assert not Path(f"/tmp/{MARK}-tmp.txt").exists()
    assert not (hostile["folder"] / f"{MARK}-dir.txt").exists()
    assert not (course_root() / f"{MARK}-course.txt").exists()
    assert not (hostile["out"] / f"{MARK}-out.txt").exists()


def test_no_process_outlives_grading(hostile):
    assert processes_named(MARK) == []


def test_the_gradebook_is_not_edited_after_grading(hostile):
    out = hostile["out"]
    assert (out / "grades.csv").read_bytes() == hostile["csv right after"]
    assert "editor.ipynb,pass" not in (out / "grades.csv").read_text()


def test_every_row_says_it_was_sandboxed(hostile):
    assert {r["sandbox"] for r in hostile["rows"]} == {"bwrap"}
    assert {r["review"] for r in hostile["rows"] if r["submission"] in ("ada.ipynb", "cy.ipynb")} == {""}


def test_a_forged_report_and_a_killed_checker_fail_and_are_flagged(hostile):
    rows = [r for r in hostile["rows"] if r["submission"] == "selfkill.ipynb"]
    assert [r["exercise"] for r in rows] == ["add_one", "draw"]
    for r in rows:
        assert r["status"] == "failed"
        assert r["reason"] == KILLED
        assert "the checker was killed from inside the submission" in r["review"]
