"""The gradebook's schema and its views: summary tables, the class's HTML page, a feedback page per submission.

`course_utils.tooling.grade` runs the submissions and builds the table (one row per submission
per exercise); everything here only reads that table.

Columns besides the verdict's:
- review: "" for an honest submission, else the routes that need an instructor's look, joined
  with "; " (e.g. "frame inspection"); the same on every row of a submission;
- sandbox: "bwrap" when the submission ran in the sandbox, "none" when graded with --no-sandbox.

The status "error" is the grader's own failure (a kernel or the sandbox that did not start), never
the student's: every view counts it apart, never as a failure, and says to grade it again with
`grade DIR --retry-errors`.
"""

import base64
import hashlib
import html
import io
import re
import shlex
import time
import unicodedata
from collections import Counter
from pathlib import Path

from course_utils.tooling.language import N_, _, current as current_language
from course_utils.tooling.layout import write_atomic  # noqa: F401 (the CSV and the page are written with it)
from course_utils.tooling.verdicts import Verdict, verdict_html

COLUMNS = ["submission", "lesson", "exercise", "status", "reason", "seconds", "review", "sandbox"]
STATUSES = ["pass", "not attempted", "failed", "missing", "unreadable", "error"]
FAILURES = ("failed", "missing")
ERROR = "error"
RETRY = N_("grader error: grade again with --retry-errors")  # translated in _note
REVIEW_MARK = "⚑"
TEXT_COLUMNS = ("submission", "lesson", "exercise", "status", "reason", "review", "sandbox")
# The column titles of the summaries, the matrix and the page's tables, translated when shown (headed); the CSV keeps COLUMNS.
HEADINGS = {
    "submission": N_("submission"), "lesson": N_("lesson"), "exercise": N_("exercise"), "status": N_("status"),
    "reason": N_("reason"), "seconds": N_("seconds"), "review": N_("review"), "sandbox": N_("sandbox"),
    "passed": N_("passed"), "total": N_("total"), "errors": N_("errors"), "score": N_("score"), "note": N_("note"),
    "submissions": N_("submissions"), "pass": N_("pass"), "not attempted": N_("not attempted"), "failed": N_("failed"),
    "missing": N_("missing"), ERROR: N_("error"), "pass rate": N_("pass rate"), "most common failure": N_("most common failure"),
    "student": N_("student"),
}


# ---------------------------------------------------------------- the table as every view reads it

def _printable(text: str) -> str:
    """text without lone surrogates, which no page or terminal can encode: a file name that is not UTF-8 arrives with them.

    Its bytes are shown as \\xNN, so that two such names stay two submissions.
    """
    try:
        raw = text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a surrogate that is no escaped byte
        raw = text.encode("utf-8", "surrogatepass")
    return raw.decode("utf-8", "backslashreplace")


def headed(frame):
    """A table to show, its column titles (and its index's name) in the course's language; the values are left as they are."""
    shown = frame.rename(columns={c: _(HEADINGS[c]) for c in frame.columns if c in HEADINGS})
    return shown.rename_axis(index=_(HEADINGS[frame.index.name])) if frame.index.name in HEADINGS else shown


def _prepared(table):
    """A copy with review and sandbox present and never NaN (a table from before these columns, or a CSV read back), and printable text."""
    table = table.copy()
    for column in ("review", "sandbox"):
        table[column] = table[column].fillna("") if column in table else ""
    for column in TEXT_COLUMNS:
        table[column] = table[column].fillna("").astype(str).map(_printable)
    return table


# ---------------------------------------------------------------- per submission, per exercise, per class

def _first(values) -> str:
    """The first non-empty value, or ''."""
    return next((v for v in values if v), "")


def _score(passed: int, total: int, errors: int) -> str:
    """'3/7'; 'error' when the grader failed on any of it (its score means nothing until graded again); 'unreadable' when nothing was graded."""
    if errors:
        return ERROR
    return f"{passed}/{total}" if total else "unreadable"


def _note(rows) -> str:
    """What the instructor must do or know about a submission beyond its score."""
    if (rows["status"] == ERROR).any():
        return _(RETRY)
    return _first(rows.loc[rows["status"] == "unreadable", "reason"])


def submission_summary(table):
    """Per submission: its lesson, passed out of the lesson's exercises, grader errors, the score, the review routes and a note."""
    import pandas as pd

    table = _prepared(table)
    out = []
    for name, rows in table.groupby("submission", sort=False):
        graded = rows[rows["exercise"] != ""]
        passed, errors = int((graded["status"] == "pass").sum()), int((rows["status"] == ERROR).sum())
        out.append({
            "submission": name,
            "lesson": rows["lesson"].iloc[0],
            "passed": passed,
            "total": len(graded),
            "errors": errors,
            "score": _score(passed, len(graded), errors),
            "review": _first(rows["review"]),
            "note": _note(rows),
        })
    columns = ["submission", "lesson", "passed", "total", "errors", "score", "review", "note"]
    return pd.DataFrame(out, columns=columns).set_index("submission")


def exercise_summary(table):
    """Per exercise: submissions, each status's count, the pass rate and the most common failure.

    The pass rate is over the submissions actually judged on the exercise: error rows (the grader
    failed, not the student) are left out of its denominator, and it is NaN when none was judged.
    Errors are never a failure, so never the most common one.
    """
    import pandas as pd

    table = _prepared(table)
    out = []
    for (lesson, exercise), rows in table[table["exercise"] != ""].groupby(["lesson", "exercise"], sort=False):
        counts = rows["status"].value_counts()
        judged = len(rows) - int(counts.get(ERROR, 0))
        failures = Counter(rows.loc[rows["status"].isin(FAILURES), "reason"])
        common, times = failures.most_common(1)[0] if failures else ("", 0)
        out.append({
            "lesson": lesson,
            "exercise": exercise,
            "submissions": len(rows),
            **{s: int(counts.get(s, 0)) for s in ("pass", "not attempted", "failed", "missing", ERROR)},
            "pass rate": round(100 * counts.get("pass", 0) / judged, 1) if judged else float("nan"),
            "most common failure": f"{common} ({times}x)" if times > 1 else common,
        })
    columns = ["lesson", "exercise", "submissions", "pass", "not attempted", "failed", "missing", ERROR, "pass rate",
               "most common failure"]
    return pd.DataFrame(out, columns=columns)


def class_counts(table) -> dict[str, int]:
    """How many submissions there are, need review, had a grader error, and were graded without the sandbox."""
    table = _prepared(table)
    by_submission = table.groupby("submission", sort=False)
    return {
        "submissions": table["submission"].nunique(),
        "review": int(by_submission["review"].agg(lambda r: any(r)).sum()),
        "errors": int(by_submission["status"].agg(lambda s: (s == ERROR).any()).sum()),
        "unsandboxed": int(by_submission["sandbox"].agg(lambda s: (s == "none").any()).sum()),
    }


def retry_command(folder: str) -> str:
    """The command that grades the submissions with a grader error again."""
    return f"python -m course_utils grade {shlex.quote(folder)} --retry-errors"


def sandbox_warning(counts: dict[str, int]) -> str:
    """The warning for submissions graded with --no-sandbox."""
    return _("WARNING: {unsandboxed} of {submissions} submissions were graded WITHOUT the sandbox "
             "(--no-sandbox): their code ran with your permissions and could have changed anything you can, these grades included").format(
        unsandboxed=counts["unsandboxed"], submissions=counts["submissions"])


def headline(table, folder: str = "DIR") -> list[str]:
    """The counts an instructor reads first, as lines of text; a warning first when the sandbox was off."""
    counts = class_counts(table)
    lines = [sandbox_warning(counts)] if counts["unsandboxed"] else []
    lines.append(_("{submissions} submissions: {review} need review, {errors} had a grader error").format(
        submissions=counts["submissions"], review=counts["review"], errors=counts["errors"]))
    if counts["errors"]:
        lines.append(_("Grader errors are not the students' fault; grade those again: {command}").format(command=retry_command(folder)))
    return lines


# ---------------------------------------------------------------- students × lessons

def _student(submission: str) -> str:
    """A submission's student: its first folder (a file at the top is its own student)."""
    return submission.split("/", 1)[0]


def by_student(table) -> bool:
    """True when the class is a folder per student: some submission sits in a sub-folder and some student has several lessons."""
    table = _prepared(table)
    if not table["submission"].str.contains("/").any():
        return False
    known = table[table["lesson"] != ""]  # an unreadable file's lesson is unknown: not a second lesson
    return bool((known.groupby(known["submission"].map(_student))["lesson"].nunique() > 1).any())


def _cell(row) -> str:
    """A matrix cell: the score, flagged when the submission needs review."""
    return f"{row['score']} {REVIEW_MARK}" if row["review"] else row["score"]


def _total(rows) -> str:
    """passed/total over a student's graded submissions, '+ error' when a grader error keeps a lesson out of it."""
    graded = rows[(rows["errors"] == 0) & (rows["total"] > 0)]
    parts = [f"{int(graded['passed'].sum())}/{int(graded['total'].sum())}"] if len(graded) else []
    if (rows["errors"] > 0).any():
        parts.append(ERROR)
    return " + ".join(parts)


def student_matrix(table):
    """Students × lessons: a row per student, a column per lesson ('?': unknown), cells like '3/7', '3/7 ⚑' (review), 'error', 'unreadable', and a total.

    Two submissions of one lesson share its cell, joined by ', '; the total counts both.
    """
    import pandas as pd

    summary = submission_summary(table).reset_index()
    summary["student"] = summary["submission"].map(_student)
    summary["lesson"] = summary["lesson"].replace("", "?")
    summary["cell"] = summary.apply(_cell, axis=1)
    lessons = sorted(set(summary["lesson"]))  # '?' sorts after the numbers
    out = []
    for student, rows in summary.groupby("student", sort=False):
        cells = {lesson: ", ".join(rows.loc[rows["lesson"] == lesson, "cell"]) for lesson in lessons}
        out.append({"student": student, **cells, "total": _total(rows)})
    return pd.DataFrame(out, columns=["student", *lessons, "total"]).set_index("student")


# ---------------------------------------------------------------- text

MAX_COLUMN = 60  # characters of text a summary column shows in the terminal; the CSV and the page keep it whole


def clipped(text: str, width: int = MAX_COLUMN) -> str:
    """text, cut to `width` characters with '…' when longer; a most common failure keeps its count ' (3x)'."""
    if len(text) <= width:
        return text
    count = re.search(r" \(\d+x\)$", text)
    tail = count.group(0) if count else ""
    return text[:width - 1 - len(tail)] + "…" + tail


def text_table(frame, index: bool = True) -> str:
    """A summary table as text: text columns left-aligned and at most MAX_COLUMN wide, so that one long reason widens nothing else."""
    from pandas.api.types import is_numeric_dtype

    frame = frame.copy()
    formatters = {}
    for column in frame.columns:
        if not is_numeric_dtype(frame[column]):
            frame[column] = frame[column].map(lambda value: clipped(str(value)))
            width = max([len(str(column)), *frame[column].map(len)])
            formatters[column] = lambda value, width=width: f"{value:<{width}}"
    return "\n".join(line.rstrip() for line in frame.to_string(index=index, formatters=formatters, justify="left").splitlines())


def format_summary(table, folder: str = "DIR") -> str:
    """The headline, the students × lessons matrix (for a folder per student) and both summary tables, as text."""
    import pandas as pd

    # Chinese column titles are two columns wide in a terminal: pandas pads them by their width, not their length, when told
    with pd.option_context("display.width", 250, "display.max_rows", None, "display.max_columns", None,
                           "display.unicode.east_asian_width", current_language() == "zh"):
        per_exercise = exercise_summary(table)
        parts = [*headline(table, folder), ""]
        if by_student(table):
            parts += [_("Per student and lesson (passed/total, {mark}: needs review):").format(mark=REVIEW_MARK),
                      text_table(headed(student_matrix(table))), ""]
        return "\n".join(parts + [
            _("Per submission:"),
            text_table(headed(submission_summary(table))),
            "",
            # "%" is a placeholder's value: a literal % in a message would read as a %-format to the catalog's tools
            _("Per exercise (pass rate in {percent_sign} of the submissions judged):").format(percent_sign="%"),
            text_table(headed(per_exercise), index=False) if len(per_exercise) else _("(no submission could be graded)"),
        ])


# ---------------------------------------------------------------- the class's page

def pass_rate_chart(per_exercise) -> str:
    """A horizontal bar chart of pass rates per exercise, as a base64 PNG."""
    from matplotlib.figure import Figure

    labels = [f"{lesson} {exercise}" for lesson, exercise in zip(per_exercise["lesson"], per_exercise["exercise"])]
    fig = Figure(figsize=(7, 0.4 * len(labels) + 1.2), layout="constrained")
    ax = fig.add_subplot()
    bars = ax.barh(labels, per_exercise["pass rate"], color="#1a7f37")
    ax.bar_label(bars, fmt="%.0f%%", padding=3)
    ax.set_xlim(0, 110)
    ax.invert_yaxis()
    ax.set_xlabel("pass rate (% of submissions judged)")
    ax.set_title("Pass rate per exercise")
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _escaped(value) -> str:
    """A cell as HTML text: escaped, and blank for a missing number."""
    if value is None or (isinstance(value, float) and value != value):
        return ""
    return html.escape(str(value))


def html_table(frame, row_classes: list[str] | None = None, cell_classes=None) -> str:
    """A DataFrame as an HTML table with every header and cell escaped; optional CSS classes per row, and per cell (a same-shaped frame)."""
    head = "".join(f"<th>{_escaped(c)}</th>" for c in frame.columns)
    body = []
    for i, row in enumerate(frame.itertuples(index=False)):
        cells = []
        for j, value in enumerate(row):
            css = cell_classes.iat[i, j] if cell_classes is not None else ""
            cells.append(f'<td class="{css}">{_escaped(value)}</td>' if css else f"<td>{_escaped(value)}</td>")
        css = row_classes[i] if row_classes else ""
        body.append(f'<tr class="{css}">{"".join(cells)}</tr>' if css else f"<tr>{''.join(cells)}</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _row_class(review: str, error: bool) -> str:
    """The CSS classes of a row: 'review' (yellow) when flagged, 'error' (pink) when the grader failed on it."""
    return " ".join(name for name, on in (("review", bool(review)), ("error", error)) if on)


def _matrix_class(cell: str) -> str:
    """The CSS class of a matrix cell holding a score or a total (not a student's name, which could end in 'error')."""
    if REVIEW_MARK in cell:
        return "review"
    return "error" if cell.endswith(ERROR) else ""  # 'error', or a total '3/4 + error'; a score never ends so


def _matrix_html(table) -> str:
    """The students × lessons section, or '' when the class is not a folder per student."""
    if not by_student(table):
        return ""
    matrix = student_matrix(table).reset_index()
    classes = matrix.map(_matrix_class)
    classes["student"] = ""  # a folder named 'terror' is no grader error
    return (f"<h2>{_('Per student and lesson')}</h2>\n<p>{_('passed/total; {mark}: needs review.').format(mark=REVIEW_MARK)}</p>\n"
            + html_table(headed(matrix), cell_classes=classes))


def _headline_html(table, folder: str) -> str:
    """The banner when the sandbox was off, then the counts."""
    counts = class_counts(table)
    banner = f'<div class="banner">{html.escape(sandbox_warning(counts))}</div>\n' if counts["unsandboxed"] else ""
    def count(key: str, words: str) -> str:  # highlighted only when there is something to look at
        text = words.format(n=counts[key])
        return f'<span class="{key.rstrip("s")}">{text}</span>' if counts[key] else text

    text = _("<b>{submissions} submissions</b>: {review}, {errors}.").format(
        submissions=counts["submissions"], review=count("review", _("{n} need review")), errors=count("errors", _("{n} had a grader error")))
    if counts["errors"]:
        text += " " + _("Grader errors are not the students' fault; grade those again: {command}").format(
            command=f"<code>{html.escape(retry_command(folder))}</code>")
    return f'{banner}<p class="headline">{text}</p>'


def html_report(table, title: str, folder: str = "DIR") -> str:
    """A self-contained page: headline, matrix, summary tables, pass-rate chart (embedded PNG) and every row, highlighted; nothing from the network."""
    table = _prepared(table)
    per_exercise = exercise_summary(table)
    charted = per_exercise.dropna(subset=["pass rate"])
    alt = html.escape(_("pass rate per exercise"), quote=True)
    chart = f'<img alt="{alt}" src="data:image/png;base64,{pass_rate_chart(charted)}">' if len(charted) else ""
    per_submission = submission_summary(table).reset_index()
    return _PAGE.format(
        lang=_html_lang(),
        title=html.escape(title),
        headline=_headline_html(table, folder),
        graded=_("Graded {when} by {command}. Rows in yellow need an instructor's look (the review\n"
                 "column names why); rows in pink were not judged because the grader itself failed.").format(
            when=time.strftime("%Y-%m-%d %H:%M"), command="<code>python -m course_utils grade</code>"),
        matrix=_matrix_html(table),
        per_exercise_heading=_("Per exercise"),
        chart=chart,
        per_exercise=html_table(headed(per_exercise)),
        per_submission_heading=_("Per submission"),
        per_submission=html_table(headed(per_submission),
                                  [_row_class(r, e > 0) for r, e in zip(per_submission["review"], per_submission["errors"])]),
        rows_heading=_("Every exercise of every submission"),
        rows=html_table(headed(table), [_row_class(r, s == ERROR) for r, s in zip(table["review"], table["status"])]),
    )


def _html_lang() -> str:
    """The language of a page, as its <html lang> says it: 'en', or 'zh-CN' for the Chinese edition."""
    return {"zh": "zh-CN"}.get(current_language(), "en")


_STYLE = """body {{ font: 15px system-ui, sans-serif; max-width: 72em; margin: 2em auto; padding: 0 1em; }}
table {{ border-collapse: collapse; margin: 1em 0; }}
td, th {{ border-bottom: 1px solid #ddd; padding: 4px 8px; text-align: left; vertical-align: top; }}
img {{ max-width: 100%; }}
.review {{ background: #fff3b0; }}
.error {{ background: #ffd8d3; }}
.banner {{ background: #cf222e; color: white; font-weight: bold; padding: 0.8em 1em; border-radius: 4px; }}
"""

_PAGE = """<!DOCTYPE html>
<html lang="{lang}"><head><meta charset="utf-8"><title>{title}</title>
<style>
""" + _STYLE + """</style></head>
<body>
<h1>{title}</h1>
{headline}
<p>{graded}</p>
{matrix}
<h2>{per_exercise_heading}</h2>
{chart}
{per_exercise}
<h2>{per_submission_heading}</h2>
{per_submission}
<h2>{rows_heading}</h2>
{rows}
</body></html>
"""


# ---------------------------------------------------------------- a feedback page per submission

NOT_GRADED = N_("not graded yet: the grader failed on our side, not because of your code; it will be graded again")  # translated where shown
_VERDICT = {"pass": "passed", "not attempted": "not attempted", "failed": "failed", "missing": "failed", ERROR: "not run"}


def feedback_name(submission: str) -> str:
    """A file name for a submission's feedback page: a readable ASCII part, then a hash of the exact name, so two names never share a file."""
    ascii_name = unicodedata.normalize("NFKD", submission).encode("ascii", "ignore").decode("ascii")
    readable = re.sub(r"[^A-Za-z0-9._-]+", "_", ascii_name.replace("/", "__")).lstrip(".")[:60] or "submission"
    digest = hashlib.sha256(submission.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return f"{readable}-{digest}.html"


def _verdict(row) -> Verdict:
    """A row as the verdict the student saw in the notebook; the grader's own error is said as ours, with none of its details."""
    status = row["status"]
    reason = _(NOT_GRADED) if status == ERROR else ("" if status == "pass" else row["reason"])
    return Verdict(row["exercise"], _VERDICT[status], reason)


def _feedback_score(rows) -> str:
    """One sentence: how many exercises passed, or why the file was not graded (never the grader's own details)."""
    graded = rows[rows["exercise"] != ""]
    errors = int((rows["status"] == ERROR).sum())
    if errors and errors >= len(graded):
        return _("{sentence}.").format(sentence=_(NOT_GRADED))
    if not len(graded):
        return _("your file could not be graded: {reason}.").format(reason=_first(rows["reason"]))
    passed = int((graded["status"] == "pass").sum())
    if errors:
        return _("{passed} of {total} exercises passed. {errors} of them could not be graded yet, because of a problem on our side; "
                 "they will be graded again.").format(passed=passed, total=len(graded), errors=errors)
    return _("{passed} of {total} exercises passed.").format(passed=passed, total=len(graded))


def feedback_page(table, submission: str) -> str:
    """A small self-contained page for one submission's student: lesson, score and the scoreboard, without the instructor's review or sandbox columns."""
    table = _prepared(table)
    rows = table[table["submission"] == submission]
    lesson = rows["lesson"].iloc[0]
    verdicts = "".join(verdict_html(_verdict(row)) for _index, row in rows[rows["exercise"] != ""].iterrows())
    score = _feedback_score(rows)
    summary = _("Lesson {lesson}: {score}").format(lesson=lesson, score=score) if lesson else score[:1].upper() + score[1:]
    return _FEEDBACK.format(
        lang=_html_lang(),
        heading=_("Feedback: {name}").format(name=html.escape(submission)),
        summary=html.escape(summary),
        verdicts=f'<div class="course-scoreboard">{verdicts}</div>' if verdicts else "",
        note=_("Each line is what the course's check said about your exercise, as its check cell shows it in your notebook."),
    )


def write_feedback(table, folder: Path) -> list[Path]:
    """Write one feedback page per submission into folder (each atomically); return their paths in the table's order."""
    names = list(_prepared(table)["submission"].drop_duplicates())
    files = {name: feedback_name(name) for name in names}
    taken = Counter(f.casefold() for f in files.values())  # casefold: one file on a case-insensitive disk
    clash = [name for name, f in files.items() if taken[f.casefold()] > 1]
    if clash:  # never write one student's page over another's
        raise RuntimeError(f"feedback pages of {clash[0]!r} and {clash[1]!r} would share the file {files[clash[0]]}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        write_atomic(folder / files[name], feedback_page(table, name))
    return [folder / files[name] for name in names]


_FEEDBACK = """<!DOCTYPE html>
<html lang="{lang}"><head><meta charset="utf-8"><title>{heading}</title>
<style>
body {{ font: 15px system-ui, sans-serif; max-width: 48em; margin: 2em auto; padding: 0 1em; }}
.course-verdict {{ margin: 0.3em 0; }}
</style></head>
<body>
<h1>{heading}</h1>
<p>{summary}</p>
{verdicts}
<p>{note}</p>
</body></html>
"""
