"""course_utils.tooling.timings: the README's course map is written from measurements."""

import nbformat
import pytest

from course_utils.tooling import studytime, timings
from course_utils.tooling.layout import exercises, source_notebooks


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
    assert facts["name"] == "01 tensors" and facts["exercises"] == len(exercises("01")) >= 5 and facts["gpu"] == 1
    assert facts["topics"]


def test_course_map_uses_measured_times(monkeypatch):
    """Every number in the table comes from time_lesson, i.e. from a run."""
    monkeypatch.setattr(timings, "time_floor", lambda repeat: 4.0)
    monkeypatch.setattr(timings, "time_lesson", lambda source, repeat: {"nbval": 12.34, "check": 5.67})
    table = timings.course_map(repeat=2, log=None)
    rows = [line for line in table.splitlines() if line.startswith("| [")]
    assert len(rows) == len(source_notebooks())
    assert all("| 12.3 s | 5.7 s |" in row for row in rows)
    assert "--repeat 2" in table


def test_readme_has_the_markers():
    text = (timings.root() / "README.md").read_text()
    assert timings.START in text and timings.END in text


def test_course_map_shows_the_estimated_study_time(monkeypatch):
    """The study-time column is the stated method's core and whole estimates, read from each notebook."""
    monkeypatch.setattr(timings, "time_floor", lambda repeat: 1.0)
    monkeypatch.setattr(timings, "time_lesson", lambda source, repeat: {"nbval": 1.0, "check": 2.0})
    lines = timings.course_map(repeat=1, log=None).splitlines()
    assert lines[0] == "| lesson | topics | exercises | study time, core / all | nbval, CPU | checker | GPU cells |"
    for source, line in zip(source_notebooks(), lines[2:]):
        est = studytime.estimate(nbformat.read(source, as_version=4))
        assert f"| {studytime.shown(est.core)} / {studytime.shown(est.whole)} | 1.0 s | 2.0 s |" in line
    assert "110 words a minute" in lines[-1] and "going further" in lines[-1]


def test_floor_is_measured_in_the_same_run_and_stated(monkeypatch):
    calls = []
    monkeypatch.setattr(timings, "time_floor", lambda repeat: calls.append("floor") or 3.25)
    monkeypatch.setattr(timings, "time_lesson", lambda source, repeat: calls.append(source.name) or {"nbval": 9.0, "check": 6.5})
    logged = []
    floor, times = timings.measure(source_notebooks()[:2], repeat=1, log=logged.append)
    assert calls[0] == "floor" and floor == 3.25 and len(times) == 2
    assert logged[1].endswith("checker 6.5 s (2.0x the floor)")


def test_time_floor_runs_a_one_cell_notebook(monkeypatch):
    seen = []

    def fake_wall_time(command, env=None):
        notebook = command[-1]
        seen.append(nbformat.read(notebook, as_version=4).cells[0].source)
        return 2.0, 0

    monkeypatch.setattr(timings, "wall_time", fake_wall_time)
    assert timings.time_floor(repeat=3) == 2.0 and seen == ["import torch"] * 3


def test_refreshed_map_keeps_the_measured_times(tmp_path):
    """--keep-times: fresh facts, the README's times, its footer; no lesson is run."""
    first, second = source_notebooks()[:2]
    old = "\n".join([
        "| lesson | topics | exercises | nbval, CPU | checker | GPU cells |",
        "|---|---|---|---|---|---|",
        f"| [{first.stem}](notebooks/{first.name}) | old topics | 1 | 6.8 s | 6.2 s | 0 |",
        "",
        "Measured by someone. The whole course: 166 s.",
    ])
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{timings.START}\n{old}\n{timings.END}\n")
    lines = timings.refreshed_map(readme).splitlines()
    assert lines[0] == timings.HEADER[0]
    assert "| 6.8 s | 6.2 s |" in lines[2] and "old topics" not in lines[2]
    assert lines[3].startswith(f"| [{second.name[:2]} ") and "| ? | ? |" in lines[3]  # no times yet for that lesson
    assert lines[-1].startswith("Measured by someone. The whole course: 166 s. *Study time* is estimated")
