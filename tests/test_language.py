"""The language course_utils speaks: chosen by the course's own setting, Chinese from its catalog, English as the fallback."""

import gettext
import importlib.resources
import re
import string
import subprocess
import sys
from pathlib import Path

import polib
import pytest

from course_utils.tooling import language, translations
from course_utils.tooling.checks import ExerciseFailed, expect_shape
from course_utils.tooling.language import _

PO = language.catalog_path("zh")


@pytest.fixture
def work(tmp_path, monkeypatch):
    monkeypatch.setenv("COURSE_WORK_DIR", str(tmp_path / "work"))
    monkeypatch.delenv("COURSE_LANG", raising=False)
    return tmp_path / "work"


def test_english_by_default_whatever_the_locale_says(work, monkeypatch):
    for name in ("LANG", "LANGUAGE", "LC_ALL", "LC_MESSAGES"):
        monkeypatch.setenv(name, "zh_CN.UTF-8")
    assert language.current() == "en" and _("all checks passed") == "all checks passed"


def test_course_lang_and_the_remembered_choice(work, monkeypatch):
    assert language.remember("zh-CN") == "zh" and (work / ".language").read_text() == "zh\n"
    assert language.current() == "zh" and _("all checks passed") == "全部检查通过"
    monkeypatch.setenv("COURSE_LANG", "en")  # the environment wins over the remembered choice
    assert language.current() == "en"
    with pytest.raises(Exception, match="'fr' is not a language of the course"):
        language.remember("fr")


def test_a_message_without_a_translation_is_the_english(work, monkeypatch):
    monkeypatch.setenv("COURSE_LANG", "zh")
    assert _("a sentence no catalog holds") == "a sentence no catalog holds"


def test_a_check_fails_in_chinese_with_its_values_in_place(work, monkeypatch):
    import torch

    monkeypatch.setenv("COURSE_LANG", "zh")
    with pytest.raises(ExerciseFailed) as info:
        expect_shape(torch.zeros(3, 2), (2, 3))
    assert str(info.value) == "你的结果：形状应为 (2, 3)，实际是 (3, 2)：是不是转置了？"


def test_every_message_is_translated_and_current():
    assert translations.update_messages("zh", check=True) == 0, "run `python -m course_utils translations update`"
    entries = [e for e in polib.pofile(str(PO)) if not e.obsolete]
    left = [e.msgid for e in entries if not (any(e.msgstr_plural.values()) if e.msgid_plural else e.msgstr) or "fuzzy" in e.flags]
    assert not left, f"{len(left)} course_utils messages lack a current translation, e.g. {left[:5]}"


def _fields(text: str) -> list[str] | None:
    """The placeholders of a str.format message, with their conversions and specs ('{count:,}' -> 'count:,'), or None
    for a text that str.format cannot take (a message shown as it is, such as one about a literal dict `{}`)."""
    try:
        parsed = [(name, conv, spec) for _text, name, spec, conv in string.Formatter().parse(text) if name is not None]
        text.format(**{name: 1 for name, _conv, _spec in parsed if name})
    except (ValueError, IndexError, KeyError):
        return None
    return sorted(f"{name}{'!' + conv if conv else ''}{':' + spec if spec else ''}" for name, conv, spec in parsed)


def test_every_translation_has_the_placeholders_of_its_english():
    # Babel checks %-style placeholders only; {name} ones are checked here, format spec included.
    wrong = []
    for entry in polib.pofile(str(PO)).translated_entries():
        want = _fields(entry.msgid)
        forms = entry.msgstr_plural.values() if entry.msgstr_plural else [entry.msgstr]
        for form in forms:
            got = _fields(form)
            if want is None:  # shown as it is: the translation keeps its braces as they are
                if sorted(re.findall(r"[{}]", form)) != sorted(re.findall(r"[{}]", entry.msgid)):
                    wrong.append(f"{entry.msgid[:60]!r}: its braces differ")
            elif got is None or set(got) != set(want):
                wrong.append(f"{entry.msgid[:60]!r}: {want} in English, {got} translated")
    assert not wrong, "\n".join(wrong)


def test_the_installed_package_holds_the_compiled_chinese_catalog():
    # A missing .mo is how installed packages silently speak English: fallback=False makes that an error.
    localedir = importlib.resources.files("course_utils") / "locale"
    found = gettext.translation(language.DOMAIN, str(localedir), ["zh_CN"], fallback=False)
    assert found.gettext("all checks passed") == "全部检查通过"


def test_without_a_compiled_catalog_the_po_is_compiled_in_memory(tmp_path, monkeypatch):
    folder = tmp_path / "locale" / "zh_CN" / "LC_MESSAGES"
    folder.mkdir(parents=True)
    (folder / "course_utils.po").write_bytes(PO.read_bytes())
    monkeypatch.setattr(language, "LOCALE_DIR", tmp_path / "locale")
    language.catalog.cache_clear()
    try:
        assert language.catalog("zh").gettext("all checks passed") == "全部检查通过"
    finally:
        language.catalog.cache_clear()


def test_a_notebooks_edition_is_read_from_its_metadata(tmp_path):
    import nbformat

    nb = nbformat.v4.new_notebook(metadata={"course": {"lesson": "00", "language": "zh-CN"}})
    path = tmp_path / "00_orientation.ipynb"
    nbformat.write(nb, path)
    assert language.notebook_language(path) == "zh"
    assert language.notebook_language(tmp_path / "missing.ipynb") is None


def test_in_jupyterlab_a_chinese_notebooks_kernel_speaks_chinese(tmp_path):
    import nbformat

    path = tmp_path / "00_orientation.ipynb"
    nbformat.write(nbformat.v4.new_notebook(metadata={"course": {"language": "zh-CN"}}), path)
    code = ("import os, course_utils; course_utils.speak_the_notebooks_language(); "
            "from course_utils.tooling.language import _; print(_('all checks passed'))")
    env = {k: v for k, v in __import__("os").environ.items() if k != "COURSE_LANG"}
    said = subprocess.run([sys.executable, "-c", code], env={**env, "JPY_SESSION_NAME": str(path), "COURSE_WORK_DIR": str(tmp_path)},
                          capture_output=True, text=True, timeout=60)
    assert said.stdout.strip() == "全部检查通过", said.stderr
