"""course_utils.tooling.layout: the course's folders, lesson numbers, a notebook's lesson, its exercises."""

import json
import os

import nbformat
import pytest

from course_utils.tooling import layout
from course_utils.tooling.layout import CourseError


def test_folders():
    root = layout.root()
    assert (root / "course_utils" / "tooling" / "layout.py").exists()
    assert layout.solutions_dir() == root / "notebooks" / "solutions"
    sources = layout.source_notebooks()
    assert [s.name[:2] for s in sources] == sorted(s.name[:2] for s in sources)
    assert layout.learner_path(sources[0]) == root / "notebooks" / sources[0].name


def test_work_dir_is_ignored_by_git_and_can_move(monkeypatch, tmp_path):
    assert "work/" in (layout.root() / ".gitignore").read_text().splitlines()
    monkeypatch.delenv("COURSE_WORK_DIR", raising=False)
    assert layout.work_dir() == layout.root() / "work"
    monkeypatch.setenv("COURSE_WORK_DIR", str(tmp_path))
    assert layout.work_dir() == tmp_path
    assert layout.backups_dir() == tmp_path / "backups"
    assert layout.work_path(layout.source_notebooks()[1]) == tmp_path / layout.source_notebooks()[1].name


@pytest.mark.parametrize("text, number", [("1", "01"), ("01", "01"), (" 7 ", "07"), ("01_tensors", "01"), ("10", "10")])
def test_lesson_number(text, number):
    assert layout.lesson_number(text) == number


@pytest.mark.parametrize("text", ["²", "abc", "", "123", "1.5", "-1", "٣"])
def test_lesson_number_refuses_anything_else(text):
    with pytest.raises(CourseError, match=r"is not a lesson: give a number such as 01$"):
        layout.lesson_number(text)


def test_source_for_unknown_lesson_lists_the_lessons():
    with pytest.raises(CourseError, match=r"^there is no lesson 99: the lessons are 00, 01, .*, 11$"):
        layout.source_for("99")


@pytest.mark.parametrize("content, message", [
    (None, "does not exist"),
    ("", "is empty"),
    ("  \n", "is empty"),
    ('{"cells": [', "is not a readable notebook: its JSON breaks off at line 1 (truncated?)"),
    ("[1, 2]", "is not a notebook (no list of cells)"),
    ('{"metadata": {}}', "is not a notebook (no list of cells)"),
    (b"\xff\xfe\x00", "is not a notebook (not UTF-8 text)"),
])
def test_read_notebook_json_names_what_is_wrong(tmp_path, content, message):
    path = tmp_path / "mine.ipynb"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(CourseError) as info:
        layout.read_notebook_json(path)
    assert str(info.value) == f"{path} {message}"


def test_exercises_come_from_the_source_notebook():
    for source in layout.source_notebooks():
        lesson = source.name[:2]
        nb = json.loads(source.read_text())
        tagged = [t.split(":", 1)[1] for c in nb["cells"] for t in c.get("metadata", {}).get("tags", []) if t.startswith("check:")]
        found = layout.exercises(lesson)
        assert [e.name for e in found] == tagged
        assert all(e.check_source == f"lesson{lesson}.check_{e.name}({e.name})" for e in found), found


def _learner(lesson: str):
    return nbformat.read(layout.learner_path(layout.source_for(lesson)), as_version=4)


def test_lesson_of_reads_the_metadata_first(tmp_path):
    nb = _learner("01")
    assert nb.metadata["course"]["lesson"] == "01"
    assert layout.lesson_of(nb, tmp_path / "renamed.ipynb") == "01"
    assert layout.lesson_of(nb, tmp_path / "03_modules.ipynb") == "01"  # content wins over the name


def test_lesson_of_falls_back_to_the_exercise_tags(tmp_path):
    nb = _learner("02")
    del nb.metadata["course"]
    assert layout.lesson_of(nb, tmp_path / "anything.ipynb") == "02"


def test_lesson_of_falls_back_to_the_name(tmp_path):
    nb = nbformat.v4.new_notebook()
    assert layout.lesson_of(nb, tmp_path / "04_data.ipynb") == "04"
    assert layout.lesson_of(nb, tmp_path / "notes.ipynb") is None
    nb.metadata["course"] = {"lesson": "77"}  # no such lesson: ignored
    assert layout.lesson_of(nb, tmp_path / "notes.ipynb") is None


def test_write_atomic_replaces_whole_files(tmp_path):
    path = tmp_path / "sub" / "f.ipynb"
    layout.write_atomic(path, "one")
    assert path.read_text() == "one"
    os.chmod(path, 0o640)
    layout.write_atomic(path, "two")
    assert path.read_text() == "two"
    assert oct(path.stat().st_mode & 0o777) == oct(0o640)  # the file keeps its permissions
    assert [p.name for p in path.parent.iterdir()] == ["f.ipynb"]


def test_write_atomic_failure_leaves_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "f.ipynb"
    path.write_text("learner's work")

    def fail(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(layout.os, "replace", fail)
    with pytest.raises(OSError, match="No space left"):
        layout.write_atomic(path, "new")
    assert path.read_text() == "learner's work"
    assert [p.name for p in tmp_path.iterdir()] == ["f.ipynb"]  # no temporary file left behind
