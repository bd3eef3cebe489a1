"""course_utils.tooling.timings: the README's course map is written from measurements."""

import pytest

from course_utils.tooling import timings
from course_utils.tooling.layout import source_notebooks


def test_write_readme_replaces_only_the_marked_table(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{timings.START}\nold table\n{timings.END}\noutro\n")
    timings.write_readme("| new |", readme)
    assert readme.read_text() == f"intro\n{timings.START}\n| new |\n{timings.END}\noutro\n"


def test_write_readme_needs_the_markers(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("no markers")
    with pytest.raises(ValueError, match="markers"):
        timings.write_readme("| x |", readme)


def test_lesson_facts_count_exercises_and_gpu_cells():
    facts = timings.lesson_facts(next(s for s in source_notebooks() if s.name.startswith("01_")))
    assert facts["name"] == "01 tensors" and facts["exercises"] == 7 and facts["gpu"] == 1
    assert facts["topics"]


def test_course_map_uses_measured_times(monkeypatch):
    """Every number in the table comes from time_lesson, i.e. from a run."""
    monkeypatch.setattr(timings, "time_lesson", lambda source, repeat: {"nbval": 12.34, "check": 5.67})
    table = timings.course_map(repeat=2, log=None)
    rows = [line for line in table.splitlines() if line.startswith("| [")]
    assert len(rows) == len(source_notebooks())
    assert all("| 12.3 s | 5.7 s |" in row for row in rows)
    assert "--repeat 2" in table


def test_readme_has_the_markers():
    text = (timings.root() / "README.md").read_text()
    assert timings.START in text and timings.END in text
