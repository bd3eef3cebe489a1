"""course_utils.tooling.timings: the README's course map is written from measurements."""

import nbformat
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


@pytest.mark.parametrize("metadata, shown", [
    ({"study_minutes": 45}, "45 min"), ({"study_minutes": 90}, "1 h 30 min"), ({"study_minutes": 120}, "2 h"),
    ({}, "?"), ({"study_minutes": "soon"}, "?"), ({"study_minutes": 0}, "?"), ({"study_minutes": True}, "?"),
])
def test_study_time_from_metadata(metadata, shown):
    nb = nbformat.v4.new_notebook(metadata={"course": metadata})
    assert timings.study_time(timings.study_minutes(nb)) == shown


def test_course_map_has_a_study_time_column(monkeypatch, tmp_path):
    """A lesson with `study_minutes` shows it; one without shows '?'."""
    sources = source_notebooks()[:2]
    patched = []
    for source, minutes in zip(sources, (40, None)):
        nb = nbformat.read(source, as_version=4)
        nb.metadata["course"].pop("study_minutes", None)
        if minutes:
            nb.metadata["course"]["study_minutes"] = minutes
        patched.append(tmp_path / source.name)
        nbformat.write(nb, patched[-1])
    monkeypatch.setattr(timings, "source_notebooks", lambda: patched)
    monkeypatch.setattr(timings, "learner_path", lambda source: timings.root() / "notebooks" / source.name)
    monkeypatch.setattr(timings, "time_lesson", lambda source, repeat: {"nbval": 1.0, "check": 2.0})
    lines = timings.course_map(repeat=1, log=None).splitlines()
    assert lines[0] == "| lesson | topics | exercises | study time | nbval, CPU | checker | GPU cells |"
    assert lines[2].endswith("| 40 min | 1.0 s | 2.0 s | 1 |")
    assert "| ? | 1.0 s | 2.0 s |" in lines[3]


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
    assert lines[-1].startswith("Measured by someone. The whole course: 166 s. *Study time*")
