"""The Chinese edition: catalogs complete and current, notebooks generated from them, code identical in both editions."""

import csv
import re
import shutil
from pathlib import Path

import nbformat
import polib
import pytest

from course_utils.tooling import build, translations
from course_utils.tooling.layout import EDITION_FOLDERS, learner_path, root, source_notebooks
from course_utils.tooling.translations import Unit, assemble, code_pieces, markdown_pieces, pieces

SOURCES = source_notebooks()
LESSONS = [s.name for s in SOURCES]
GLOSSARY = root() / "notebooks" / "locale" / "zh_CN" / "glossary.csv"


def _read(path: Path):
    return nbformat.read(path, as_version=4)


# How cells split into units, and back.

def test_markdown_units_are_headings_paragraphs_list_items_and_table_rows():
    source = ("## 2. Shapes\n\nA paragraph\nthat wraps.\n\n- first item\n  continued\n- second\n\n"
              "| a | b |\n|---|---|\n| `x` | one cell |\n\n```python\nx = 1  # not prose\n```\nAfter.")
    units = [p for p in markdown_pieces(source) if isinstance(p, Unit)]
    assert [u.text for u in units] == ["2. Shapes", "A paragraph\nthat wraps.", "first item\ncontinued", "second",
                                       "| a | b |", "| `x` | one cell |", "After."]
    assert assemble(markdown_pieces(source), lambda s: None) == source


def test_a_translation_takes_each_units_place_and_keeps_the_markers():
    source = "# Title\n\n- one\n  two\n1. step\n\nText."
    table = {"Title": "标题", "one\ntwo": "一\n二", "step": "步骤", "Text.": "正文。"}
    assert assemble(markdown_pieces(source), table.get) == "# 标题\n\n- 一\n  二\n1. 步骤\n\n正文。"


def test_code_units_are_comment_runs_and_trailing_comments_never_code_or_markers():
    source = ("%%writefile {folder}/train.py\n# Why this is so:\n# two lines.\nx = 1  # a trailing note\n"
              "def f():\n    ### BEGIN SOLUTION\n    return '# not a comment'\n    ### END SOLUTION\n# YOUR CODE HERE\ny = 2  # noqa: E501")
    units = [p.text for p in code_pieces(source) if isinstance(p, Unit)]
    assert units == ["Why this is so:\ntwo lines.", "a trailing note"]
    translated = assemble(code_pieces(source), {"Why this is so:\ntwo lines.": "原因：\n两行。", "a trailing note": "行尾注释"}.get)
    assert translated.splitlines()[1:4] == ["# 原因：", "# 两行。", "x = 1  # 行尾注释"]
    assert translations.code_without_comments(translated) == translations.code_without_comments(source)


@pytest.mark.parametrize("source", SOURCES, ids=LESSONS)
def test_every_cell_of_every_lesson_splits_and_joins_back_unchanged(source):
    for cell in _read(source).cells:
        assert assemble(pieces(cell), lambda s: None) == cell.source, f"{source.name}, cell {cell.get('id')}"


def test_code_identity_notices_a_changed_token_but_not_a_changed_comment():
    english = "x = torch.ones(3)  # three ones\nprint(x)"
    assert translations.code_without_comments("x = torch.ones(3)  # 三个 1\nprint(x)") == translations.code_without_comments(english)
    assert translations.code_without_comments("x = torch.ones(4)  # three ones\nprint(x)") != translations.code_without_comments(english)


# The catalogs: complete, current, and faithful to what must not change.

@pytest.mark.parametrize("source", SOURCES, ids=LESSONS)
def test_every_unit_of_every_lesson_has_a_current_chinese_translation(source):
    left = translations.missing(source, "zh")
    assert not left, f"{len(left)} units of {source.name} lack a current translation:\n" + "\n".join(left[:20])


def test_a_changed_english_sentence_is_named_by_lesson_cell_and_unit(tmp_path, monkeypatch):
    # The fixture: lesson 00 with one sentence of its first markdown cell changed, against the real catalog.
    source = SOURCES[0]
    nb = _read(source)
    cell = next(c for c in nb.cells if c.cell_type == "markdown" and len(translations.units(c)) > 1)
    first = translations.units(cell)[1]
    cell.source = cell.source.replace(first, first + " This sentence is new.")
    copy = tmp_path / source.name
    nbformat.write(nb, copy)
    left = translations.missing(copy, "zh")
    assert left == [f"{source.name}, cell {cell.id}, unit 2 (not in the catalog: run `python -m course_utils translations update`): "
                    f"{(first + ' This sentence is new.').splitlines()[0][:80]}"]


def test_update_keeps_a_changed_units_translation_as_fuzzy_with_the_previous_english(tmp_path, monkeypatch):
    source = SOURCES[0]
    catalogs = tmp_path / "locale"
    catalogs.mkdir()
    shutil.copy(translations.catalog_path(source, "zh"), catalogs / f"{source.stem}.po")
    monkeypatch.setattr(translations, "catalog_dir", lambda lang: catalogs)
    nb = _read(source)
    cell = next(c for c in nb.cells if c.cell_type == "markdown" and len(translations.units(c)) > 1)
    old = translations.units(cell)[1]
    new = old.replace(".", ", as the next cell shows.", 1) if "." in old else old + " (changed)"
    cell.source = cell.source.replace(old, new)
    changed = tmp_path / "notebooks" / source.name
    changed.parent.mkdir()
    nbformat.write(nb, changed)
    translations.update("zh", [changed])
    entry = polib.pofile(str(catalogs / f"{source.stem}.po")).find(new)
    assert entry is not None and "fuzzy" in entry.flags and entry.previous_msgid == old and entry.msgstr
    assert any("fuzzy" in line for line in translations.missing(changed, "zh"))


@pytest.mark.parametrize("source", SOURCES, ids=LESSONS)
def test_translations_keep_code_links_math_tables_and_bold(source):
    assert translations.catalog_problems(translations.catalog_path(source, "zh")) == []


def _glossary() -> list[dict]:
    with GLOSSARY.open(encoding="utf-8") as f:
        return list(csv.DictReader(f))


def test_the_glossary_terms_are_used_wherever_the_english_uses_them():
    misses = []
    for source in SOURCES:
        for entry in polib.pofile(str(translations.catalog_path(source, "zh"))).translated_entries():
            prose = re.sub(r"\]\([^)]*\)|https?://\S+", "", re.sub(r"`[^`]*`", "", entry.msgid)).lower()
            for term in _glossary():
                if re.search(r"(?<![.\w])" + re.escape(term["source"].lower()) + r"(s|es)?(?![\w(]|\.\w)", prose) \
                        and term["target"] not in entry.msgstr:
                    misses.append(f"{source.name}: {term['source']!r} is not {term['target']} in: {entry.msgid[:70]}")
    assert not misses, "\n".join(misses[:20])


# The generated notebooks.

def _edition(source: Path) -> tuple[Path, Path]:
    folder = root() / "notebooks" / EDITION_FOLDERS["zh"]
    return folder / "solutions" / source.name, folder / source.name


@pytest.mark.parametrize("source", SOURCES, ids=LESSONS)
def test_the_chinese_notebooks_are_the_build_of_the_english_and_the_catalog(source):
    solution, learner = _edition(source)
    assert solution.exists() and learner.exists(), f"run `python -m course_utils build --lang zh --execute {source.name[:2]}`"
    written, expected = _read(solution), translations.translated_notebook(source, "zh")
    assert [(c.get("id"), c.cell_type, c.source) for c in written.cells] == [(c.get("id"), c.cell_type, c.source) for c in expected.cells], \
        f"{solution.name} is not the build of the English and its catalog: run `python -m course_utils build --lang zh`"
    assert written.metadata["course"]["language"] == "zh-CN"
    copy = build.learner_copy(written)
    assert [c.source for c in _read(learner).cells if c.cell_type == "code"] == [c.source for c in copy.cells if c.cell_type == "code"]


@pytest.mark.parametrize("source", SOURCES, ids=LESSONS)
def test_code_is_the_same_in_both_editions_but_for_comments(source):
    solution, learner = _edition(source)
    for english, chinese in [(source, solution), (learner_path(source), learner)]:
        a, b = _read(english), _read(chinese)
        assert [c.get("id") for c in a.cells] == [c.get("id") for c in b.cells]
        for x, y in zip(a.cells, b.cells):
            if x.cell_type == "code":
                assert translations.code_without_comments(x.source) == translations.code_without_comments(y.source), \
                    f"{chinese.name}, cell {x.get('id')}: its code differs from the English"
                assert x.metadata.get("tags", []) == y.metadata.get("tags", [])


@pytest.mark.parametrize("source", SOURCES, ids=LESSONS)
def test_every_chinese_solution_cell_holds_outputs_from_a_run(source):
    solution, _ = _edition(source)
    english = {c.get("id"): c for c in _read(source).cells if c.cell_type == "code"}
    for cell in _read(solution).cells:
        if cell.cell_type == "code" and english[cell.get("id")].outputs:
            assert cell.outputs, f"{solution.name}, cell {cell.get('id')}: no outputs: run `python -m course_utils build --lang zh --execute`"


@pytest.mark.parametrize("source", SOURCES, ids=LESSONS)
def test_the_chinese_check_cells_say_their_verdicts_in_chinese(source):
    solution, _ = _edition(source)
    said = [o.get("text", "") for c in _read(solution).cells if any(t.startswith("check:") for t in c.metadata.get("tags", []))
            for o in c.outputs if o.get("output_type") == "stream"]
    passes = [line for text in said for line in text.splitlines() if line.startswith("PASS ")]
    assert passes and all(line.endswith("全部检查通过") for line in passes), passes[:3]


def test_the_badges_open_the_chinese_copies():
    for source in SOURCES:
        solution, learner = _edition(source)
        for path, folder in [(solution, "notebooks/zh-CN/solutions/"), (learner, "notebooks/zh-CN/")]:
            badges = [c.source for c in _read(path).cells if "hosted-badges" in c.metadata.get("tags", [])]
            assert all(f"/{folder}{source.name}" in b for b in badges), path


@pytest.mark.parametrize("source", SOURCES, ids=LESSONS)
def test_no_figure_of_the_chinese_edition_lacks_a_glyph(source):
    # Figure text stays English, so no font is needed; a CJK string in a figure would show here as matplotlib's warning.
    solution, _ = _edition(source)
    said = [o.get("text", "") for c in _read(solution).cells if c.cell_type == "code" for o in c.outputs if o.get("output_type") == "stream"]
    assert not [t for t in said if re.search(r"Glyph \d+ .*missing from font", t)]


def test_a_quoted_verdict_line_may_follow_the_edition_only_when_flagged():
    english, chinese = "**PASS** `add_one: all checks passed`;", "**PASS** `add_one: 全部检查通过`；"
    assert translations.entry_problems(english, chinese)[0].startswith("code changed")
    assert translations.entry_problems(english, chinese, ["course-output"]) == []
    assert translations.entry_problems("see [docs](https://a.b)", "见[文档](https://c.d)", ["course-output"])  # links still kept


def test_the_chinese_readme_links_to_files_that_exist_and_the_readmes_link_each_other():
    text = (root() / "README.zh-CN.md").read_text(encoding="utf-8")
    targets = [t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", text) if not t.startswith(("http", "#"))]
    assert targets and not [t for t in targets if not (root() / t).exists()]
    assert [f"notebooks/zh-CN/{s.name}" for s in SOURCES] == [t for t in targets if t.startswith("notebooks/zh-CN/")]
    assert "[English](README.md)" in text.splitlines()[2]
    assert "[简体中文](README.zh-CN.md)" in (root() / "README.md").read_text(encoding="utf-8").splitlines()[2]
