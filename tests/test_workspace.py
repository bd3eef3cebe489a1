"""course_utils.tooling.workspace: progress, and the promise that no learner file is lost."""

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from course_utils import workspace
from course_utils.tooling.build import build, learner_path

SOLUTION = 'def add_one(x):\n    """x + 1."""\n    ### BEGIN SOLUTION\n    return x + 1\n    ### END SOLUTION'
CHECK = "lesson00.check_add_one(add_one)"


def make_course(tmp_path: Path) -> Path:
    """A one-lesson course in tmp_path; return its source notebook."""
    solutions = tmp_path / "notebooks" / "solutions"
    solutions.mkdir(parents=True)
    source = solutions / "00_orientation.ipynb"
    nb = new_notebook(cells=[new_markdown_cell("# 00"), new_code_cell(SOLUTION), new_code_cell(CHECK)])
    nbformat.write(nb, source)
    build([source])
    return source


def digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.glob("*.ipynb")}


def learner_work(source: Path) -> bytes:
    """Simulate a learner: fill in the exercise and save, the way JupyterLab would."""
    path = learner_path(source)
    nb = nbformat.read(path, as_version=4)
    nb.cells[1].source = nb.cells[1].source.replace("raise NotImplementedError()", "return x + 1  # mine")
    nbformat.write(nb, path)
    return path.read_bytes()


def test_reset_keeps_a_backup_with_the_learners_work(tmp_path):
    source = make_course(tmp_path)
    work = learner_work(source)
    saved = workspace.reset(source)
    assert saved is not None and saved.parent == learner_path(source).parent
    assert saved.name.startswith("00_orientation.backup-") and saved.suffix == ".ipynb"
    assert saved.read_bytes() == work
    assert b"raise NotImplementedError()" in learner_path(source).read_bytes()


def test_reset_of_a_fresh_copy_makes_no_backup(tmp_path):
    source = make_course(tmp_path)
    assert workspace.reset(source) is None
    assert [p.name for p in learner_path(source).parent.glob("*.ipynb")] == ["00_orientation.ipynb"]


def test_two_resets_in_one_second_keep_both_backups(tmp_path):
    source = make_course(tmp_path)
    first = learner_work(source)
    a = workspace.reset(source)
    learner_work(source)
    path = learner_path(source)
    path.write_bytes(path.read_bytes().replace(b"# mine", b"# mine, again"))
    second = path.read_bytes()
    b = workspace.reset(source)
    assert a != b and a.read_bytes() == first and b.read_bytes() == second


@pytest.mark.parametrize("command", ["reset", "build"])
def test_no_learner_file_is_lost(tmp_path, command):
    """Every learner file that existed before reset or build still exists, byte for byte, somewhere."""
    source = make_course(tmp_path)
    learner_work(source)
    folder = learner_path(source).parent
    (folder / "my_notes.ipynb").write_text(nbformat.writes(new_notebook()))
    before = digest(folder)
    if command == "reset":
        workspace.reset(source)
    else:
        nb = nbformat.read(source, as_version=4)  # the course changes under the learner
        nb.cells[0].source = "# 00, revised"
        nbformat.write(nb, source)
        build([source])
    after = digest(folder)
    assert set(before.values()) <= set(after.values()), "a learner's file disappeared without a backup"
    assert after["my_notes.ipynb"] == before["my_notes.ipynb"]


def test_backup_refuses_to_leave_a_partial_copy(tmp_path, monkeypatch):
    """If the copy comes out different, the learner's file is not replaced."""
    source = make_course(tmp_path)
    work = learner_work(source)
    monkeypatch.setattr(workspace.shutil, "copy2", lambda src, dst: Path(dst).write_bytes(b"truncated"))
    with pytest.raises(OSError, match="left untouched"):
        workspace.reset(source)
    assert learner_path(source).read_bytes() == work


def test_progress_rows_and_table():
    results = {
        "/x/notebooks/00_orientation.ipynb": {"exercises": {
            "a": {"status": "passed", "reason": ""}, "b": {"status": "not attempted", "reason": "..."}}, "stopped_at": None},
        "/x/notebooks/01_tensors.ipynb": {"exercises": {
            "c": {"status": "failed", "reason": "..."}, "d": {"status": "not run", "reason": "..."}}, "stopped_at": "Cell 3: NameError: x"},
    }
    rows = workspace.progress_rows(results)
    assert rows[0] == {"lesson": "00_orientation", "passed": 1, "not attempted": 1, "failed": 0, "total": 2, "note": ""}
    assert rows[1]["failed"] == 2 and "Cell 3" in rows[1]["note"]
    table = workspace.format_progress(rows)
    lines = table.splitlines()
    assert "passed" in lines[0] and "not attempted" in lines[0]
    assert lines[-1].split()[:5] == ["TOTAL", "1", "1", "2", "4"]


def test_progress_plain_text_fallback(monkeypatch):
    """Without pandas the same table comes out as plain text."""
    monkeypatch.setitem(sys.modules, "pandas", None)
    rows = [{"lesson": "00_orientation", "passed": 2, "not attempted": 0, "failed": 0, "total": 2, "note": ""}]
    table = workspace.format_progress(rows)
    assert table.splitlines()[-1].split() == ["TOTAL", "2", "0", "0", "2"]


def test_progress_does_not_run_inside_the_checker(monkeypatch):
    monkeypatch.setenv("COURSE_CHECK_MODE", "1")
    assert "does not run inside the checker" in workspace.progress()


@pytest.mark.slow
def test_progress_command_on_the_real_learner_copies():
    """`python -m course_utils progress` over the committed learner copies: everything not attempted."""
    env = {k: v for k, v in os.environ.items() if k != "COURSE_CHECK_MODE"}
    result = subprocess.run([sys.executable, "-m", "course_utils", "progress"], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[-1].startswith("TOTAL")
    total = lines[-1].split()
    assert total[1] == "0" and total[3] == "0" and total[2] == total[4] != "0"
