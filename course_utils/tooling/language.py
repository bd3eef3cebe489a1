"""The language course_utils speaks to a learner: English, or Simplified Chinese from its gettext catalog.

The course's own setting chooses it, never the locale (LANGUAGE and LC_ALL silently override LANG):
COURSE_LANG if set, else the choice `course_utils lab --lang zh` remembered in work/, else English.
A message is written `_("expected shape {expected}, got {got}").format(expected=..., got=...)`, with named
placeholders so that a translation can put them in its own order. A message without a translation,
or a language without its catalog, falls back to the English text.

The catalog is course_utils/locale/zh_CN/LC_MESSAGES/course_utils.po; the set-up compiles it to a .mo
file beside it. Where that .mo is missing or older than the .po (a copy installed without the set-up),
the .po is compiled in memory instead, so Chinese never silently turns into English.
"""

import functools
import gettext
import io
import os
from pathlib import Path

DOMAIN = "course_utils"
LOCALE_DIR = Path(__file__).resolve().parents[1] / "locale"
LOCALES = {"zh": "zh_CN"}  # the course's language code -> the gettext locale of its catalog
NAMES = {"en": "English", "zh": "简体中文"}
CHOICE_FILE = ".language"  # in work/: the learner's remembered choice


def normalise(code: str | None) -> str | None:
    """'zh', 'zh-CN', 'zh_CN' -> 'zh'; 'en', 'en-US' -> 'en'; anything else None."""
    if not code:
        return None
    base = code.strip().replace("_", "-").split("-")[0].lower()
    return base if base in NAMES else None


def choice_file() -> Path:
    """Where the learner's choice of language is kept: work/.language (work/ is theirs, and git ignores it)."""
    from course_utils.tooling.layout import work_dir

    return work_dir() / CHOICE_FILE


def remembered() -> str | None:
    """The language the learner chose with `lab --lang`, or None."""
    try:
        return normalise(choice_file().read_text(encoding="utf-8"))
    except OSError:
        return None


def remember(code: str) -> str:
    """Keep a learner's choice of language for later runs; return it normalised ('zh' or 'en')."""
    lang = normalise(code)
    if lang is None:
        from course_utils.tooling.layout import CourseError

        raise CourseError(f"{code!r} is not a language of the course: give en (English) or zh (简体中文)")
    path = choice_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(lang + "\n", encoding="utf-8")
    return lang


def notebook_language(path: str | Path) -> str | None:
    """The language of a notebook's edition from its metadata (course.language, e.g. 'zh-CN'), or None (English, or unreadable)."""
    import json

    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f).get("metadata", {})
        return normalise(meta.get("course", {}).get("language"))
    except (OSError, ValueError, AttributeError):
        return None


def current() -> str:
    """The language to speak now: COURSE_LANG, else the remembered choice, else 'en'."""
    return normalise(os.environ.get("COURSE_LANG")) or remembered() or "en"


def catalog_path(lang: str, suffix: str = ".po") -> Path:
    """The .po (or compiled .mo) file of a language's messages."""
    return LOCALE_DIR / LOCALES[lang] / "LC_MESSAGES" / f"{DOMAIN}{suffix}"


@functools.cache
def catalog(lang: str) -> gettext.NullTranslations:
    """The translations of one language: its compiled .mo, else its .po compiled in memory, else none (English)."""
    if lang not in LOCALES:
        return gettext.NullTranslations()
    po, mo = catalog_path(lang), catalog_path(lang, ".mo")
    if mo.exists() and (not po.exists() or mo.stat().st_mtime >= po.stat().st_mtime):
        return gettext.translation(DOMAIN, LOCALE_DIR, [LOCALES[lang]])
    if not po.exists():
        return gettext.NullTranslations()
    from babel.messages.mofile import write_mo
    from babel.messages.pofile import read_po

    with po.open("rb") as f:
        messages = read_po(f, locale=LOCALES[lang])
    compiled = io.BytesIO()
    write_mo(compiled, messages)  # fuzzy entries are left out, as `pybabel compile` does
    compiled.seek(0)
    return gettext.GNUTranslations(compiled)


def _(message: str) -> str:
    """A message in the current language (the English itself where it has no translation)."""
    return catalog(current()).gettext(message)


def N_(message: str) -> str:
    """Mark a message for the catalog without translating it yet (for constants read later through _())."""
    return message


def ngettext(singular: str, plural: str, n: int) -> str:
    """The singular or plural form of a message for n, in the current language (Chinese has one form)."""
    return catalog(current()).ngettext(singular, plural, n)
