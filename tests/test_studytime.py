"""course_utils.tooling.studytime: one stated method for every lesson's study time, core path and whole."""

import nbformat
import pytest

from course_utils.tooling import studytime

md, code = nbformat.v4.new_markdown_cell, nbformat.v4.new_code_cell


def lesson(*cells):
    return nbformat.v4.new_notebook(cells=list(cells))


def exercise(name):
    return [code(f"def {name}():\n    pass", metadata={"tags": [f"exercise:{name}"]}),
            code(f"check_{name}({name})", metadata={"tags": [f"check:{name}"]})]


def test_prose_code_and_exercises_are_counted_at_the_stated_rates():
    nb = lesson(md("word " * 220), code("x = 1\n\ny = 2\n" * 8), *exercise("a"))
    est = studytime.estimate(nb)
    assert est.words == (220, 220) and est.code_lines == (16, 16) and est.exercises == (1, 1)
    assert est.whole == 20  # 2 + 2 + 12 = 16, rounded up to 20


def test_a_recorded_gpu_output_is_not_counted_as_prose():
    recorded = md("*Recorded on a GPU:*\n\n```\n" + "12.5 ms " * 220 + "\n```", metadata={"tags": [studytime.RECORDED_TAG]})
    nb = lesson(md("word " * 220), code("%%gpu\nx = 1"), recorded)
    assert studytime.estimate(nb).words == (220, 220)


def test_a_going_further_section_is_left_out_of_the_core_until_the_next_heading_of_its_level():
    nb = lesson(md("# Lesson\n\n" + "w " * 110), *exercise("core"),
                md("## 5. Going further: deeper\n\n" + "w " * 550), code("a\n" * 40), *exercise("extra"),
                md("### 5.1 still deeper\n\n" + "w " * 110),
                md("## 6. Pitfalls\n\n" + "w " * 110), code("b\n" * 8))
    flags = studytime.core_flags(nb)
    assert flags == [True, True, True, False, False, False, False, False, True, True]
    est = studytime.estimate(nb)
    assert est.exercises == (1, 2) and est.code_lines == (8, 48)
    assert est.core < est.whole


def test_a_heading_that_says_going_further_in_any_case_marks_the_section():
    nb = lesson(md("## Core"), md("## (going further) Appendix"), code("x\n"))
    assert studytime.core_flags(nb) == [True, False, False]


def test_statement_says_both_times_or_that_the_whole_lesson_is_core():
    assert studytime.statement(studytime.Estimate(80, 125, (0, 0), (0, 0), (0, 0))) == (
        "Estimated study time: about 1 h 20 min for the core path, 2 h 5 min with every section.")
    assert studytime.statement(studytime.Estimate(45, 45, (0, 0), (0, 0), (0, 0))) == (
        "Estimated study time: about 45 min (the whole lesson is its core path).")


@pytest.mark.parametrize("minutes, shown", [(45, "45 min"), (60, "1 h"), (90, "1 h 30 min"), (125, "2 h 5 min")])
def test_shown(minutes, shown):
    assert studytime.shown(minutes) == shown


def test_restate_rewrites_the_line_and_settles(tmp_path):
    path = tmp_path / "01_x.ipynb"
    nbformat.write(lesson(md("# 01\n\nEstimated study time: about 3 minutes.\n\nMore."), code("a = 1")), path)
    assert studytime.restate(path) is True
    nb = nbformat.read(path, as_version=4)
    assert studytime.statement(studytime.estimate(nb)) in nb.cells[0].source and nb.cells[0].source.endswith("More.")
    assert studytime.restate(path) is False


def test_restate_refuses_a_notebook_without_the_line(tmp_path):
    path = tmp_path / "01_x.ipynb"
    nbformat.write(lesson(md("# 01"), code("a = 1")), path)
    with pytest.raises(ValueError, match="no 'Estimated study time' line"):
        studytime.restate(path)
