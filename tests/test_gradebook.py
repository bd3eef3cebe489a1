"""course_utils.tooling.gradebook: the gradebook's views, on small tables built by hand (no kernel)."""

import math
import os
import re

import pandas as pd
import pytest

from course_utils.tooling import gradebook
from course_utils.tooling.classroom import external_references
from course_utils.tooling.verdicts import COLOURS

FRAME = "frame inspection"
ERROR_REASON = "the kernel did not start twice: grade this submission again"


def _row(name, lesson, exercise, status, reason="", seconds=0.1, review="", sandbox="bwrap"):
    return dict(zip(gradebook.COLUMNS, (name, lesson, exercise, status, reason, seconds, review, sandbox)))


def _frame(rows):
    return pd.DataFrame(rows, columns=gradebook.COLUMNS)


def _table():
    """A flat class: every status once at least; c needs review; e hit a grader error."""
    return _frame([
        _row("a", "00", "add_one", "pass"),
        _row("a", "00", "mean_value", "failed", "returned a tensor"),
        _row("b", "00", "add_one", "failed", "expected 2, got 3"),
        _row("b", "00", "mean_value", "failed", "returned a tensor"),
        _row("c", "00", "add_one", "not attempted", "not attempted yet", review=FRAME),
        _row("c", "00", "mean_value", "missing", "check cell missing: put it back", review=FRAME),
        _row("d", "", "", "unreadable", "the file is empty", 0.0),
        _row("e", "00", "add_one", "error", ERROR_REASON, None),
        _row("e", "00", "mean_value", "error", ERROR_REASON, None),
    ])


def _class_by_student():
    """A folder per student: alice did lessons 00 and 01 (01 flagged), bob did 00 and sent a broken 01, cy's 00 hit a grader error and 01 was graded."""
    return _frame([
        _row("alice/00.ipynb", "00", "add_one", "pass"),
        _row("alice/00.ipynb", "00", "mean_value", "pass"),
        _row("alice/01_tensors.ipynb", "01", "linear", "pass", review=FRAME),
        _row("alice/01_tensors.ipynb", "01", "norm", "failed", "expected 1.0, got 2.0", review=FRAME),
        _row("bob/00.ipynb", "00", "add_one", "failed", "expected 2, got 3"),
        _row("bob/00.ipynb", "00", "mean_value", "pass"),
        _row("bob/01.ipynb", "", "", "unreadable", "the file is empty", 0.0),
        _row("cy/00.ipynb", "00", "add_one", "error", ERROR_REASON, None),
        _row("cy/00.ipynb", "00", "mean_value", "error", ERROR_REASON, None),
        _row("cy/01.ipynb", "01", "linear", "pass"),
        _row("cy/01.ipynb", "01", "norm", "not attempted", "not attempted yet"),
    ])


# ---------------------------------------------------------------- per submission

def test_submission_summary():
    summary = gradebook.submission_summary(_table())
    assert list(summary.columns) == ["lesson", "passed", "total", "errors", "score", "review", "note"]
    assert summary.loc["a", "score"] == "1/2" and summary.loc["b", "score"] == "0/2" and summary.loc["c", "score"] == "0/2"
    assert summary.loc["d", "score"] == "unreadable" and summary.loc["d", "note"] == "the file is empty"
    assert summary.loc["a", "note"] == "" and summary.loc["a", "errors"] == 0


def test_submission_summary_grader_error_is_not_a_score():
    summary = gradebook.submission_summary(_table())
    assert summary.loc["e", "score"] == "error" and summary.loc["e", "errors"] == 2 and summary.loc["e", "passed"] == 0
    assert summary.loc["e", "note"] == "grader error: grade again with --retry-errors"


def test_submission_summary_review():
    summary = gradebook.submission_summary(_table())
    assert summary.loc["c", "review"] == FRAME
    assert summary.loc[["a", "b", "d", "e"], "review"].tolist() == ["", "", "", ""]


def test_a_table_without_the_new_columns_or_read_back_from_csv(tmp_path):
    old = _table()[gradebook.COLUMNS[:6]]
    assert gradebook.submission_summary(old).loc["c", "review"] == ""
    _table().to_csv(tmp_path / "g.csv", index=False)
    back = pd.read_csv(tmp_path / "g.csv", dtype={"lesson": str})  # empty cells come back as NaN
    assert gradebook.submission_summary(back).loc["a", "review"] == "" and gradebook.class_counts(back)["review"] == 1


# ---------------------------------------------------------------- per exercise

def test_exercise_summary_pass_rate_and_most_common_failure():
    summary = gradebook.exercise_summary(_table()).set_index("exercise")
    assert summary.loc["add_one", "pass rate"] == pytest.approx(33.3)  # 1 pass of 3 judged: e's error is not judged
    assert summary.loc["mean_value", "pass rate"] == 0
    assert summary.loc["mean_value", "most common failure"] == "returned a tensor (2x)"
    assert summary.loc["mean_value", "missing"] == 1
    assert summary.loc["add_one", "most common failure"] == "expected 2, got 3"


def test_exercise_summary_counts_errors_apart():
    summary = gradebook.exercise_summary(_table()).set_index("exercise")
    assert summary.loc["add_one", "error"] == 1 and summary.loc["add_one", "failed"] == 1
    assert summary.loc["add_one", "submissions"] == 4
    assert ERROR_REASON not in summary["most common failure"].str.cat()


def test_exercise_summary_errors_only():
    table = _frame([_row("e", "00", "add_one", "error", ERROR_REASON), _row("f", "00", "add_one", "error", ERROR_REASON)])
    (rate, common, failed), = gradebook.exercise_summary(table)[["pass rate", "most common failure", "failed"]].itertuples(index=False)
    assert math.isnan(rate) and common == "" and failed == 0


# ---------------------------------------------------------------- the class's counts and text

def test_class_counts():
    assert gradebook.class_counts(_table()) == {"submissions": 5, "review": 1, "errors": 1, "unsandboxed": 0}


def test_format_summary_headline():
    text = gradebook.format_summary(_table(), folder="class 2026")
    lines = text.splitlines()
    assert lines[0] == "5 submissions: 1 need review, 1 had a grader error"
    assert lines[1] == "Grader errors are not the students' fault; grade those again: python -m course_utils grade 'class 2026' --retry-errors"
    assert "WARNING" not in text
    assert "Per submission:" in text and "Per exercise" in text and "grader error: grade again with --retry-errors" in text
    assert "Per student" not in text  # a flat folder has no matrix


def test_format_summary_without_errors_has_no_hint():
    text = gradebook.format_summary(_table().iloc[:4])
    assert text.splitlines()[0] == "2 submissions: 0 need review, 0 had a grader error"
    assert "--retry-errors" not in text


def test_html_headline_highlights_only_counts_above_zero():
    page = gradebook.html_report(_table().iloc[:4], "Gradebook")
    assert "<b>2 submissions</b>: 0 need review, 0 had a grader error." in page


def test_format_summary_warns_without_the_sandbox():
    table = _table()
    table.loc[table["submission"].isin(["a", "b"]), "sandbox"] = "none"
    first = gradebook.format_summary(table).splitlines()[0]
    assert first.startswith("WARNING: 2 of 5 submissions were graded WITHOUT the sandbox (--no-sandbox)")


# ---------------------------------------------------------------- students × lessons

def test_student_matrix():
    matrix = gradebook.student_matrix(_class_by_student())
    assert list(matrix.index) == ["alice", "bob", "cy"]
    assert list(matrix.columns) == ["00", "01", "?", "total"]
    assert matrix.loc["alice"].tolist() == ["2/2", "1/2 ⚑", "", "3/4"]
    assert matrix.loc["bob"].tolist() == ["1/2", "", "unreadable", "1/2"]
    assert matrix.loc["cy"].tolist() == ["error", "1/2", "", "1/2 + error"]  # 00 is out of the total until graded again


def test_student_matrix_two_submissions_of_one_lesson_share_a_cell():
    table = pd.concat([_class_by_student(), _frame([_row("alice/00_again.ipynb", "00", "add_one", "failed", "x"),
                                                    _row("alice/00_again.ipynb", "00", "mean_value", "pass")])])
    matrix = gradebook.student_matrix(table)
    assert matrix.loc["alice", "00"] == "2/2, 1/2" and matrix.loc["alice", "total"] == "4/6"


def test_matrix_only_for_a_folder_per_student():
    assert gradebook.by_student(_class_by_student())
    assert not gradebook.by_student(_table())  # flat
    one_lesson_each = _frame([_row("sub/gus.ipynb", "00", "add_one", "pass"), _row("ada.ipynb", "01", "linear", "pass")])
    assert not gradebook.by_student(one_lesson_each)
    late = _frame([_row("late/ann.ipynb", "00", "add_one", "pass"), _row("late/ben.ipynb", "00", "add_one", "pass"),
                   _row("late/notes.txt", "", "", "unreadable", "the file is not a notebook (it is not JSON)")])
    assert not gradebook.by_student(late)  # a folder of one lesson's submissions is not a student


def test_format_summary_shows_the_matrix_for_a_folder_per_student():
    text = gradebook.format_summary(_class_by_student())
    assert "Per student and lesson (passed/total, ⚑: needs review):" in text
    alice = next(line for line in text.splitlines() if line.startswith("alice "))
    assert alice.split() == ["alice", "2/2", "1/2", "⚑", "3/4"]


# ---------------------------------------------------------------- the class's page

def _body_rows(page: str, heading: str) -> list[str]:
    """The <tr> elements of the table after a heading."""
    section = page.split(f"<h2>{heading}</h2>", 1)[1]
    table = section.split("<tbody>", 1)[1].split("</tbody>", 1)[0]
    return re.findall(r"<tr[^>]*>.*?</tr>", table)


def test_html_report_without_a_kernel():
    page = gradebook.html_report(_table(), "Gradebook: <class>")
    assert "Gradebook: &lt;class&gt;" in page and "data:image/png;base64," in page
    assert not external_references(page)
    assert "http://" not in page and "https://" not in page


def test_html_report_headline_and_highlights():
    page = gradebook.html_report(_table(), "Gradebook", folder="class")
    assert '<b>5 submissions</b>: <span class="review">1 need review</span>, <span class="error">1 had a grader error</span>' in page
    assert "<code>python -m course_utils grade class --retry-errors</code>" in page
    rows = _body_rows(page, "Every exercise of every submission")
    assert [r.split("</td>", 1)[0].rsplit(">", 1)[1] for r in rows if r.startswith('<tr class="review">')] == ["c", "c"]
    assert [r.split("</td>", 1)[0].rsplit(">", 1)[1] for r in rows if r.startswith('<tr class="error">')] == ["e", "e"]
    assert sum(r.startswith("<tr>") for r in rows) == 5
    assert f"<td>{FRAME}</td>" in rows[4]  # the route is shown on the highlighted row
    submissions = _body_rows(page, "Per submission")
    assert submissions[2].startswith('<tr class="review"><td>c</td>') and submissions[4].startswith('<tr class="error"><td>e</td>')
    assert 'class="banner"' not in page and "Per student and lesson" not in page


def test_html_report_red_banner_without_the_sandbox():
    table = _table()
    table["sandbox"] = "none"
    page = gradebook.html_report(table, "Gradebook")
    assert '<div class="banner">WARNING: 5 of 5 submissions were graded WITHOUT the sandbox (--no-sandbox)' in page
    assert ".banner { background: #cf222e;" in page
    assert page.index('class="banner"') < page.index("<h2>")  # above everything else


def test_html_report_matrix_for_a_folder_per_student():
    page = gradebook.html_report(_class_by_student(), "Gradebook")
    rows = _body_rows(page, "Per student and lesson")
    assert rows[0] == '<tr><td>alice</td><td>2/2</td><td class="review">1/2 ⚑</td><td></td><td>3/4</td></tr>'
    assert rows[2] == '<tr><td>cy</td><td class="error">error</td><td>1/2</td><td></td><td class="error">1/2 + error</td></tr>'


def test_html_report_matrix_highlights_scores_not_names():
    table = _frame([_row("terror/00.ipynb", "00", "add_one", "pass"), _row("terror/01.ipynb", "01", "linear", "pass")])
    assert _body_rows(gradebook.html_report(table, "Gradebook"), "Per student and lesson") == [
        "<tr><td>terror</td><td>1/1</td><td>1/1</td><td>2/2</td></tr>"]


def test_html_report_errors_only_has_no_chart():
    table = _frame([_row("e", "00", "add_one", "error", ERROR_REASON)])
    page = gradebook.html_report(table, "Gradebook")
    assert "data:image/png" not in page and "1 had a grader error" in page


# ---------------------------------------------------------------- learner-provided text is escaped everywhere

EVIL = "<script>alert(1)</script>"


def _evil_class():
    """Student folders and reasons holding markup, in a class laid out per student (so the matrix shows)."""
    student = "<script>alert(1)<"  # a folder's name cannot hold '/': the rest becomes a sub-folder
    return _frame([
        _row(f"{student}/script>/00.ipynb", "00", "add_one", "failed", f"expected 1, got '{EVIL}'", review=f"imports {EVIL}"),
        _row(f"{student}/01.ipynb", "01", "linear", "pass"),
        _row(f"{EVIL}.ipynb", "00", "add_one", "not attempted", EVIL),
        _row("bob/00.ipynb", "00", "add_one", "missing", EVIL),
    ])


def test_markup_is_escaped_in_the_class_page():
    table = _evil_class()
    assert gradebook.by_student(table)
    page = gradebook.html_report(table, EVIL)
    assert "<script" not in page.lower()
    assert "&lt;script&gt;alert(1)&lt;/script&gt;.ipynb" in page  # a submission's name
    assert "&lt;script&gt;alert(1)&lt;</td>" in page  # the matrix's student
    assert "expected 1, got &#x27;&lt;script&gt;" in page  # a reason


def test_markup_is_escaped_in_the_feedback_pages(tmp_path):
    pages = gradebook.write_feedback(_evil_class(), tmp_path)
    assert len(pages) == 4
    for path in pages:
        assert "<script" not in path.read_text(encoding="utf-8").lower()
    assert "<title>Feedback: &lt;script&gt;alert(1)&lt;/script&gt;.ipynb</title>" in pages[2].read_text(encoding="utf-8")


def test_a_name_that_is_not_utf8_is_shown_not_a_crash(tmp_path):
    names = [os.fsdecode(b"caf\xe9.ipynb"), os.fsdecode(b"caf\xe8.ipynb")]  # Latin-1 file names, as Linux hands them to Python
    table = _frame([_row(names[0], "00", "add_one", "pass"), _row(names[1], "00", "add_one", "failed", "x")])
    assert "<td>caf\\xe9.ipynb</td>" in gradebook.html_report(table, "Gradebook").encode("utf-8").decode("utf-8")
    assert "caf\\xe8.ipynb" in gradebook.format_summary(table).encode("utf-8").decode("utf-8")
    first, second = gradebook.write_feedback(table, tmp_path)  # still two submissions, two pages
    assert "<h1>Feedback: caf\\xe9.ipynb</h1>" in first.read_text(encoding="utf-8")
    assert ">FAIL</span>" in second.read_text(encoding="utf-8")


# ---------------------------------------------------------------- feedback pages

def test_feedback_page_scoreboard():
    table = _table()
    page = gradebook.feedback_page(table, "a")
    assert "<h1>Feedback: a</h1>" in page and "<p>Lesson 00: 1 of 2 exercises passed.</p>" in page
    assert f'<span style="background: {COLOURS["passed"]}; color: white; padding: 0 6px; border-radius: 3px;">PASS</span> <b>add_one</b>: all checks passed' in page
    assert f'<span style="background: {COLOURS["failed"]}; color: white; padding: 0 6px; border-radius: 3px;">FAIL</span> <b>mean_value</b>: returned a tensor' in page
    c = gradebook.feedback_page(table, "c")
    assert f'background: {COLOURS["not attempted"]}; color: white; padding: 0 6px; border-radius: 3px;">TODO</span> <b>add_one</b>: not attempted yet' in c
    assert ">FAIL</span> <b>mean_value</b>: check cell missing: put it back" in c
    assert not external_references(page) and "http" not in page


def test_feedback_page_hides_the_instructors_columns():
    table = _table()
    table["sandbox"] = "none"
    page = gradebook.feedback_page(table, "c")
    assert FRAME not in page and "review" not in page.lower() and "sandbox" not in page.lower() and "bwrap" not in page


def test_feedback_page_for_unreadable_and_grader_error():
    table = _table()
    assert "<p>Your file could not be graded: the file is empty.</p>" in gradebook.feedback_page(table, "d")
    e = gradebook.feedback_page(table, "e")
    assert "<p>Lesson 00: not graded yet: the grader failed on our side, not because of your code; it will be graded again.</p>" in e
    assert ">----</span> <b>add_one</b>: not graded yet: the grader failed on our side, not because of your code" in e
    assert "kernel did not start" not in e  # the grader's own trouble is the instructor's to read
    partly = _frame([_row("f", "00", "add_one", "pass"), _row("f", "00", "mean_value", "error", ERROR_REASON)])
    assert ("<p>Lesson 00: 1 of 2 exercises passed. 1 of them could not be graded yet, because of a problem on our side; "
            "they will be graded again.</p>") in gradebook.feedback_page(partly, "f")


def test_feedback_names_are_safe_and_distinct():
    names = ["alice/00.ipynb", "alice__00.ipynb", "..", "../..", ".hidden", "my work.ipynb", "my_work.ipynb",
             "zoë.ipynb", "zoe.ipynb", "Zoe.ipynb", "日本.ipynb", "a" * 300, ""]
    files = [gradebook.feedback_name(n) for n in names]
    assert len({f.casefold() for f in files}) == len(names)  # distinct, even on a disk that ignores case
    for f in files:
        assert re.fullmatch(r"[A-Za-z0-9_-][A-Za-z0-9._-]*-[0-9a-f]{16}\.html", f) and len(f) < 100
    assert files[0].startswith("alice__00.ipynb-") and files[7].startswith("zoe.ipynb-") and files[2].startswith("submission-")
    assert gradebook.feedback_name("alice/00.ipynb") == files[0]  # the same name, the same file, run after run


def test_write_feedback_one_page_per_submission(tmp_path):
    out = tmp_path / "feedback"
    table = _class_by_student()
    pages = gradebook.write_feedback(table, out)
    assert [p.parent for p in pages] == [out] * 6
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in pages)  # no temporary file left
    assert pages[0].name.startswith("alice__00.ipynb-") and "<h1>Feedback: alice/00.ipynb</h1>" in pages[0].read_text(encoding="utf-8")
    pages[0].write_text("stale")
    assert gradebook.write_feedback(table, out) == pages and pages[0].read_text(encoding="utf-8") != "stale"


def test_write_feedback_refuses_two_submissions_on_one_file(tmp_path, monkeypatch):
    monkeypatch.setattr(gradebook, "feedback_name", lambda name: "same.html")
    with pytest.raises(RuntimeError, match="would share the file same.html"):
        gradebook.write_feedback(_table(), tmp_path)
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- writing atomically

def test_write_atomic_replaces_a_file_whole(tmp_path):
    path = tmp_path / "grades.csv"
    path.write_text("a much longer old content\n" * 100)
    gradebook.write_atomic(path, "new\n")
    assert path.read_text() == "new\n"
    assert [p.name for p in tmp_path.iterdir()] == ["grades.csv"]


def test_write_atomic_failure_while_writing_keeps_the_old_file(tmp_path):
    path = tmp_path / "grades.html"
    path.write_text("old page")
    with pytest.raises(UnicodeEncodeError):
        gradebook.write_atomic(path, "half a page, then " + "\ud800")  # a lone surrogate cannot be written as UTF-8
    assert path.read_text() == "old page"
    assert [p.name for p in tmp_path.iterdir()] == ["grades.html"]  # no temporary file left behind


def test_write_atomic_failure_at_the_rename_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "grades.html"
    path.write_text("old page")

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(OSError, match="No space left"):
        gradebook.write_atomic(path, "new page")
    assert path.read_text() == "old page"
    assert [p.name for p in tmp_path.iterdir()] == ["grades.html"]


def test_summary_columns_are_capped_in_width():
    reason = "f(x of shape (6, 8)): " + "each row of your result runs across several patches, " * 4
    table = pd.DataFrame([_row(f"s{i}.ipynb", "01", "f", "failed", reason) for i in range(3)] +
                         [_row("s0.ipynb", "01", "g", "pass")], columns=gradebook.COLUMNS)
    text = gradebook.format_summary(table)
    assert max(map(len, text.splitlines())) < 60 + 100  # the text column at most 60 wide, the numbers beside it
    (failure,) = [line for line in text.splitlines() if line.startswith("01") and " f " in line]
    assert failure.endswith("… (3x)")  # cut, and still counted
    assert gradebook.clipped("short") == "short" and len(gradebook.clipped("x" * 100)) == gradebook.MAX_COLUMN

