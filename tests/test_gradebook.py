"""course_utils.tooling.gradebook: the gradebook's views, on small tables built by hand (no kernel)."""

import pandas as pd
import pytest

from course_utils.tooling import grade, gradebook
from course_utils.tooling.classroom import external_references


def _table():
    rows = [
        grade._row("a", "00", "add_one", "pass", "", 0.1),
        grade._row("a", "00", "mean_value", "failed", "returned a tensor", 0.1),
        grade._row("b", "00", "add_one", "failed", "expected 2, got 3", 0.1),
        grade._row("b", "00", "mean_value", "failed", "returned a tensor", 0.1),
        grade._row("c", "00", "add_one", "not attempted", "not attempted yet", 0.1),
        grade._row("c", "00", "mean_value", "missing", "check cell missing: put it back", 0.1),
        grade._row("d", "", "", "unreadable", "the file is empty", 0.0),
    ]
    return pd.DataFrame(rows, columns=grade.COLUMNS)


def test_submission_summary():
    summary = gradebook.submission_summary(_table())
    assert summary.loc["a", "score"] == "1/2" and summary.loc["b", "score"] == "0/2"
    assert summary.loc["d", "score"] == "unreadable" and summary.loc["d", "note"] == "the file is empty"


def test_exercise_summary_pass_rate_and_most_common_failure():
    summary = gradebook.exercise_summary(_table()).set_index("exercise")
    assert summary.loc["add_one", "pass rate"] == pytest.approx(33.3)
    assert summary.loc["mean_value", "pass rate"] == 0
    assert summary.loc["mean_value", "most common failure"] == "returned a tensor (2x)"
    assert summary.loc["mean_value", "missing"] == 1
    assert summary.loc["add_one", "most common failure"] == "expected 2, got 3"


def test_html_report_without_a_kernel():
    page = gradebook.html_report(_table(), "Gradebook: <class>")
    assert "Gradebook: &lt;class&gt;" in page and "data:image/png;base64," in page
    assert not external_references(page)
