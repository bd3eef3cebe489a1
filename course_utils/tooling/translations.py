"""The Chinese edition of the notebooks, built from the English source notebooks and one gettext PO catalog per lesson.

A unit of text is a heading, paragraph, list item or table row of a markdown cell, or a comment of a code
cell (a run of whole-line comments at one indent, or one comment after code). Each unit is a PO entry:
its msgid is the English, its location the notebook and cell id (`03_modules.ipynb#cell-id`, the unit's
number in the cell). Code, fenced code blocks and outputs are never translated.

`update` merges every catalog with the current English through Babel: a new unit arrives untranslated, and
one whose English changed keeps its old translation, marked fuzzy, with the previous English beside it
(`#| msgid`), so a translator sees what changed. `build` writes notebooks/zh-CN/solutions/NN_topic.ipynb
(keeping the outputs of each code cell whose code did not change) and the learner copy beside them.
"""

import copy
import io
import re
import tokenize
from dataclasses import dataclass
from pathlib import Path

from course_utils.tooling.language import LOCALES
from course_utils.tooling.layout import EDITION_FOLDERS, root, source_notebooks, write_atomic

LANGUAGES = LOCALES  # the course's language code -> the gettext locale of its catalogs
FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(\s*#{1,6}\s+)(.*)$")
LIST_ITEM = re.compile(r"^(\s*(?:[-*+]|\d+[.)])\s+)(.*)$")
TABLE_RULE = re.compile(r"^\s*\|?[\s:|-]+\|?\s*$")
# Comments that are markers or tool directives, not prose: the build and linters read them as they are.
KEEP_COMMENTS = re.compile(r"^#(#+ (BEGIN|END) SOLUTION|\s*YOUR CODE HERE|!|\s*(noqa|type:|fmt:|pragma)|\s*%%)")


@dataclass
class Unit:
    """One translatable piece of a cell: the English text, and how to put a translation back in its place."""

    text: str
    prefix: str = ""  # a heading's hashes, a list item's marker, a comment's indent and '# '
    indent: str = ""  # the indent of a unit's later lines
    inline: bool = False  # a comment after code, on the code's line


def _prose(text: str) -> bool:
    return re.search(r"[A-Za-z]", text) is not None


def markdown_pieces(source: str) -> list[str | Unit]:
    """A markdown cell as literal lines (str) and Units, in order; joined with newlines, they give the cell back."""
    pieces: list[str | Unit] = []
    lines = source.split("\n")
    fenced = False
    current: Unit | None = None

    def close() -> None:
        nonlocal current
        if current is not None:
            pieces.append(current)
            current = None

    for line in lines:
        if FENCE.match(line) or fenced:
            close()
            fenced = fenced != bool(FENCE.match(line))
            pieces.append(line)
            continue
        if not line.strip():
            close()
            pieces.append(line)
            continue
        heading, item = HEADING.match(line), LIST_ITEM.match(line)
        if heading:
            close()
            pieces.append(Unit(heading.group(2), heading.group(1)))
        elif line.lstrip().startswith("|"):
            close()
            pieces.append(line if TABLE_RULE.match(line) else Unit(line.strip(), line[: len(line) - len(line.lstrip())]))
        elif item:
            close()
            current = Unit(item.group(2), item.group(1), " " * len(item.group(1)))
        elif current is not None:
            current.text += "\n" + line.strip()
        else:
            current = Unit(line.strip(), line[: len(line) - len(line.lstrip())], line[: len(line) - len(line.lstrip())])
    close()
    return [p if isinstance(p, str) or _prose(p.text) else _literal(p) for p in pieces]


def _literal(unit: Unit) -> str:
    return unit.prefix + unit.text.replace("\n", "\n" + unit.indent)


def _tokenizable(source: str) -> str:
    """The cell with its IPython lines (%magic, %%cell magic, !shell) blanked, so tokenize reads the Python."""
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in source.split("\n"))


def _comments(source: str) -> list[tuple[int, int, str]]:
    """(line index, column, text) of every comment token in a code cell."""
    found = []
    tokens = tokenize.generate_tokens(io.StringIO(_tokenizable(source) + "\n").readline)
    for tok in tokens:
        if tok.type == tokenize.COMMENT:
            found.append((tok.start[0] - 1, tok.start[1], tok.string))
    return found


def _comment_text(comment: str) -> str:
    return re.sub(r"^#+\s?", "", comment)


def code_pieces(source: str) -> list[str | Unit]:
    """A code cell as literal text and Units (its comments); joined back, the literal text is the code."""
    lines = source.split("\n")
    comments = [c for c in _comments(source) if not KEEP_COMMENTS.match(c[2]) and _prose(c[2])]
    by_line: dict[int, tuple[int, str]] = {row: (col, text) for row, col, text in comments}
    pieces: list[str | Unit] = []
    row = 0
    while row < len(lines):
        line = lines[row]
        if row not in by_line:
            pieces.append(line)
            row += 1
            continue
        col, text = by_line[row]
        if line[:col].strip():  # a comment after code
            pieces.append(line[:col])
            pieces.append(Unit(_comment_text(text), "# ", inline=True))
            row += 1
            continue
        block = [_comment_text(text)]  # a run of whole-line comments at one indent is one unit
        row += 1
        while row in by_line and by_line[row][0] == col and not lines[row][:col].strip():
            block.append(_comment_text(by_line[row][1]))
            row += 1
        pieces.append(Unit("\n".join(block), line[:col] + "# ", line[:col] + "# "))
    return pieces


def pieces(cell) -> list[str | Unit]:
    """The literal text and translatable units of one cell (the Colab and Kaggle badges have none)."""
    from course_utils.tooling.publish import BADGES_TAG

    if BADGES_TAG in cell.get("metadata", {}).get("tags", []):
        return [cell.source]
    if cell.cell_type == "markdown":
        return markdown_pieces(cell.source)
    if cell.cell_type == "code":
        return code_pieces(cell.source)
    return [cell.source]


def units(cell) -> list[str]:
    """The English text of every translatable unit of a cell, in order."""
    return [p.text for p in pieces(cell) if isinstance(p, Unit)]


def assemble(cell_pieces: list[str | Unit], translate) -> str:
    """The cell's source with each unit replaced by translate(unit text) (or the English when that is None)."""
    out: list[str] = []
    for piece in cell_pieces:
        if isinstance(piece, str):
            out.append(piece)
            continue
        text = translate(piece.text) or piece.text
        if piece.inline:
            out[-1] += piece.prefix + text.replace("\n", " ")
            continue
        out.append(piece.prefix + text.replace("\n", "\n" + piece.indent))
    return "\n".join(out)


def code_without_comments(source: str) -> list[tuple[int, str]]:
    """A code cell's tokens, comments and line layout left out: what must be the same in every edition."""
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
    magics = [line.strip() for line in source.split("\n") if line.lstrip().startswith(("%", "!"))]
    toks = tokenize.generate_tokens(io.StringIO(_tokenizable(source) + "\n").readline)
    return [(0, m) for m in magics] + [(t.type, t.string) for t in toks if t.type not in skip]


# Catalogs.

def catalog_dir(lang: str) -> Path:
    """Where a language's notebook catalogs live: notebooks/locale/<locale>/, one NN_topic.po per lesson."""
    return root() / "notebooks" / "locale" / LANGUAGES[lang]


def catalog_path(source: Path, lang: str) -> Path:
    """The PO catalog of one lesson."""
    return catalog_dir(lang) / f"{source.stem}.po"


def edition_dir(lang: str) -> Path:
    """The learner copies of an edition: notebooks/zh-CN/ (solutions in its solutions/ folder)."""
    return root() / "notebooks" / EDITION_FOLDERS[lang]


def template(source: Path):
    """A Babel catalog of every unit of one English source notebook, located by cell id."""
    import nbformat
    from babel.messages.catalog import Catalog

    nb = nbformat.read(source, as_version=4)
    catalog = Catalog(project="PyTorch course", fuzzy=False)
    for cell in nb.cells:
        for number, text in enumerate(units(cell), start=1):
            catalog.add(text, locations=[(f"{source.name}#{cell.get('id')}", number)])
    return catalog


def update(lang: str, sources: list[Path] | None = None) -> list[Path]:
    """Merge each lesson's catalog with its current English (Babel: changed units go fuzzy, with the previous msgid); return the files written."""
    from babel.messages.catalog import Catalog
    from babel.messages.pofile import read_po

    written = []
    for source in sources or source_notebooks():
        path = catalog_path(source, lang)
        if path.exists():
            with path.open("rb") as f:
                catalog = read_po(f, locale=LANGUAGES[lang])
        else:
            catalog = Catalog(locale=LANGUAGES[lang], project="PyTorch course", fuzzy=False)
        catalog.update(template(source), update_creation_date=False)
        if write_catalog(catalog, path):
            written.append(path)
    return written


def write_catalog(catalog, path: Path, dry_run: bool = False) -> bool:
    """Write a Babel catalog as a PO file with polib; True when the file changed (dry_run: would change).

    Babel's own writer wraps a fuzzy entry's previous msgid (`#| msgid ...`) in the middle of its
    string, which polib and msgfmt then refuse; polib writes it as GNU msgmerge does.
    """
    import polib

    po = polib.POFile(wrapwidth=0)
    po.header = f"Simplified Chinese translation of the PyTorch course ({path.name}).\n" \
                "Kept in step with the English by `python -m course_utils translations update` (CONTRIBUTING.md)."
    po.metadata = {k: v for k, v in catalog.mime_headers
                   if k and k not in ("POT-Creation-Date", "PO-Revision-Date", "Last-Translator", "Report-Msgid-Bugs-To", "Language-Team")}
    po.metadata["Project-Id-Version"] = "PyTorch course"
    for message in catalog:
        if not message.id:
            continue
        plural = isinstance(message.id, (list, tuple))
        entry = polib.POEntry(
            msgid=message.id[0] if plural else message.id,
            msgid_plural=message.id[1] if plural else "",
            occurrences=[(file, str(line) if line else "") for file, line in message.locations],
            flags=sorted(message.flags),
            comment="\n".join(message.auto_comments),
            tcomment="\n".join(message.user_comments),
        )
        if plural:
            strings = message.string if isinstance(message.string, (list, tuple)) else [message.string]
            entry.msgstr_plural = {i: text or "" for i, text in enumerate(strings)}
        else:
            entry.msgstr = message.string or ""
        if message.fuzzy and message.previous_id:
            entry.previous_msgid = message.previous_id[0]
        po.append(entry)
    text = po.__unicode__() if hasattr(po, "__unicode__") else str(po)
    if path.exists() and path.read_text(encoding="utf-8") == text:
        return False
    if not dry_run:
        write_atomic(path, text)
    return True


def translations(source: Path, lang: str) -> dict[str, str]:
    """English -> translation for every translated, non-fuzzy entry of a lesson's catalog."""
    import polib

    path = catalog_path(source, lang)
    if not path.exists():
        return {}
    return {e.msgid: e.msgstr for e in polib.pofile(str(path)).translated_entries()}


def missing(source: Path, lang: str) -> list[str]:
    """Every unit of a lesson with no current translation, said as `NN_topic.ipynb, cell <id>, unit N (fuzzy|untranslated): <English>`."""
    import nbformat
    import polib

    path = catalog_path(source, lang)
    entries = {e.msgid: e for e in polib.pofile(str(path))} if path.exists() else {}
    nb = nbformat.read(source, as_version=4)
    found = []
    for cell in nb.cells:
        for number, text in enumerate(units(cell), start=1):
            entry = entries.get(text)
            if entry is None:
                state = "not in the catalog: run `python -m course_utils translations update`"
            elif entry.obsolete or not entry.msgstr:
                state = "untranslated"
            elif "fuzzy" in entry.flags:
                state = "fuzzy: its English changed"
            else:
                continue
            first = text.split("\n")[0]
            found.append(f"{source.name}, cell {cell.get('id')}, unit {number} ({state}): {first[:80]}")
    return found


def translated_notebook(source: Path, lang: str):
    """The source notebook in another language: its text from the catalog, its code and metadata the same."""
    import nbformat

    nb = nbformat.read(source, as_version=4)
    table = translations(source, lang)
    for cell in nb.cells:
        if cell.cell_type in ("markdown", "code"):
            cell.source = assemble(pieces(cell), table.get)
    nb.metadata.setdefault("course", {})["language"] = EDITION_FOLDERS[lang]
    return nb


def solution_path(source: Path, lang: str) -> Path:
    """The translated solution copy of an English source notebook."""
    return edition_dir(lang) / "solutions" / source.name


def keep_outputs(nb, previous) -> list[str]:
    """Give each code cell of nb the outputs of previous's cell of the same id when its code is unchanged; return the ids left without."""
    old = {c.get("id"): c for c in previous.cells if c.cell_type == "code"} if previous is not None else {}
    stale = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        before = old.get(cell.get("id"))
        if before is not None and code_without_comments(before.source) == code_without_comments(cell.source):
            cell.outputs, cell.execution_count = copy.deepcopy(before.outputs), before.execution_count
        else:
            cell.outputs, cell.execution_count = [], None
            stale.append(cell.get("id"))
    return stale


def _point_badges(nb, folder: str) -> None:
    """Make the Colab and Kaggle badges open this edition's copy (`folder` in the repository)."""
    from course_utils.tooling.publish import BADGES_TAG

    for cell in nb.cells:
        if BADGES_TAG in cell.metadata.get("tags", []):
            cell.source = re.sub(r"/notebooks/(\S*/)?(?=\d\d_\w+\.ipynb)", folder, cell.source)


def build(lang: str, sources: list[Path] | None = None, *, run: bool = False) -> list[Path]:
    """Write each lesson's translated solution copy (its outputs kept, or re-run with run=True) and learner copy; return the files written."""
    import nbformat

    from course_utils.tooling import build as english

    written = []
    for source in sources or source_notebooks():
        nb = translated_notebook(source, lang)
        target = solution_path(source, lang)
        previous = nbformat.read(target, as_version=4) if target.exists() else None
        stale = keep_outputs(nb, previous)
        _point_badges(nb, f"/notebooks/{EDITION_FOLDERS[lang]}/solutions/")
        if run:
            with english._environment(COURSE_LANG=lang):
                english.execute(nb, source)
        elif stale and previous is not None:
            print(f"{target.name}: code changed in cells {', '.join(map(str, stale))}: run `python -m course_utils build --execute --lang {lang}`")
        write_atomic(target, nbformat.writes(nb) + "\n")
        learner = edition_dir(lang) / source.name
        learner_nb = english.learner_copy(nb)
        _point_badges(learner_nb, f"/notebooks/{EDITION_FOLDERS[lang]}/")
        write_atomic(learner, nbformat.writes(learner_nb) + "\n")
        written += [target, learner]
    return written


# What a translation must keep exactly as the English has it.

CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.DOTALL)
LINK_TARGET = re.compile(r"\]\(([^)\s]+)\)")
MATH = re.compile(r"\$\$.+?\$\$|\$[^$\n]+\$", re.DOTALL)
HTML_TAG = re.compile(r"</?[a-zA-Z][^>]*>")


def kept(text: str) -> dict[str, list[str]]:
    """The code spans, link targets, math and HTML tags of a text: a translation must hold the same ones."""
    return {
        "code": sorted(m.group(0) for m in CODE_SPAN.finditer(text)),
        "link": sorted(LINK_TARGET.findall(text)),
        "math": sorted(MATH.findall(CODE_SPAN.sub("", text))),
        "html": sorted(HTML_TAG.findall(CODE_SPAN.sub("", text))),
    }


# A translator's flag on an entry that quotes the course's own output (a verdict line): its code spans are that
# output as this edition prints it, so they are translated like the messages themselves.
COURSE_OUTPUT = "course-output"


def entry_problems(msgid: str, msgstr: str, flags: list[str] | tuple[str, ...] = ()) -> list[str]:
    """What a translation of msgid changed that it must keep: code spans, links, math, HTML tags, table cells, bold marks."""
    if not msgstr:
        return []
    problems = []
    want, got = kept(msgid), kept(msgstr)
    for kind in want:
        if kind == "code" and COURSE_OUTPUT in flags:
            continue
        if want[kind] != got[kind]:
            lost = [x for x in want[kind] if x not in got[kind]]
            added = [x for x in got[kind] if x not in want[kind]]
            problems.append(f"{kind} changed: missing {lost}, added {added}")
    if msgid.startswith("|") and msgid.count("|") != msgstr.count("|"):
        problems.append(f"a table row with {msgid.count('|')} '|', translated with {msgstr.count('|')}")
    if CODE_SPAN.sub("", msgid).count("**") != CODE_SPAN.sub("", msgstr).count("**"):
        problems.append("the ** (bold) marks differ in number")
    return problems


def catalog_problems(path: Path) -> list[str]:
    """entry_problems for every translated entry of a PO file, each said with its English."""
    import polib

    found = []
    for entry in polib.pofile(str(path)).translated_entries():
        for problem in entry_problems(entry.msgid, entry.msgstr, entry.flags):
            found.append(f"{path.name}: {entry.msgid[:70]!r}: {problem}")
    return found


# course_utils's own messages: one catalog, handled with Babel's command line (pybabel) as translators know it.

MESSAGES_DOMAIN = "course_utils"


def messages_dir() -> Path:
    """course_utils/locale: <locale>/LC_MESSAGES/course_utils.po, and the .mo the set-up compiles beside it."""
    return root() / "course_utils" / "locale"


def pybabel(*args: str) -> int:
    """Run one `pybabel` command in this process; its exit status."""
    from babel.messages.frontend import BaseError, CommandLineInterface

    try:
        CommandLineInterface().run(["pybabel", "--quiet", *args])
    except SystemExit as stop:
        return int(stop.code or 0)
    except BaseError:  # update --check: the catalog is behind
        return 1
    return 0


def extract_messages(template: Path) -> None:
    """`pybabel extract`: every _("...") and N_("...") message of course_utils into a template (.pot)."""
    import contextlib

    with contextlib.chdir(root()):  # locations relative to the course folder, the same on every machine
        pybabel("extract", "--project=PyTorch course", "--add-location=file", "--sort-by-file", "--no-wrap",
                "-o", str(template), "course_utils")


def update_messages(lang: str, check: bool = False) -> int:
    """`pybabel update --previous` of a language's message catalog from a fresh extraction (check=True: only say whether it is behind)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="course-pot-") as folder:
        template = Path(folder) / f"{MESSAGES_DOMAIN}.pot"
        extract_messages(template)
        po = messages_dir() / LANGUAGES[lang] / "LC_MESSAGES" / f"{MESSAGES_DOMAIN}.po"
        if not po.exists():
            return pybabel("init", "-i", str(template), "-d", str(messages_dir()), "-D", MESSAGES_DOMAIN, "-l", LANGUAGES[lang],
                           "--no-wrap")
        # What `pybabel update --previous` does, written with polib (see write_catalog). Its --check compares
        # each entry's line number in the file too, so it fails on any file Babel's writer did not write:
        # check=True instead merges in memory and says whether the file would change.
        from babel.messages.pofile import read_po

        with template.open("rb") as f:
            messages = read_po(f)
        with po.open("rb") as f:
            catalog = read_po(f, locale=LANGUAGES[lang])
        catalog.update(messages, update_creation_date=False)
        changed = write_catalog(catalog, po, dry_run=check)
        return int(check and changed)


def messages_path(lang: str) -> Path:
    """A language's message catalog (.po)."""
    return messages_dir() / LANGUAGES[lang] / "LC_MESSAGES" / f"{MESSAGES_DOMAIN}.po"


def update_all() -> list[Path]:
    """Merge every notebook catalog and the message catalog with the current English; return the notebook catalogs rewritten."""
    written = []
    for lang in LANGUAGES:
        written += update(lang)
        update_messages(lang)
    return written


def status() -> list[str]:
    """One line per notebook unit or message without a current translation, in every language."""
    import polib

    left = []
    for lang in LANGUAGES:
        for source in source_notebooks():
            left += missing(source, lang)
        po = messages_path(lang)
        entries = polib.pofile(str(po)) if po.exists() else []
        for entry in entries:
            if entry.obsolete:
                continue
            translated = any(entry.msgstr_plural.values()) if entry.msgid_plural else bool(entry.msgstr)
            if not translated or "fuzzy" in entry.flags:
                state = "fuzzy" if translated else "untranslated"
                left.append(f"course_utils message ({state}): {entry.msgid[:80]}")
    return left
