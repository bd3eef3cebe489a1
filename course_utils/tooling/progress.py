"""Progress: every check's verdict recorded as it runs, each lesson's scoreboard, and the course-wide table.

A check records its verdict in this kernel's session and, when the notebook runs in the
learner's work folder, in work/.progress.json. So the progress table is current the moment a
check cell ran, saved or not, and costs no kernel to show. `course_utils progress --recheck`
re-runs the checker over every lesson for an exact answer.

A lesson's record holds only the verdicts of that lesson's own file, work/NN_topic.ipynb: a
kernel of another notebook (a copy, or lesson 01 saved as 00_orientation.ipynb) keeps its
verdicts for its session, and under the checker the command line records them once it has
seen which lesson the notebook holds.

Each verdict is recorded with when it ran and by whom: "notebook" (a check cell in the learner's
kernel, which judges what the kernel holds, saved or not) or "check" (`course_utils check`,
which judges the saved file). When the saved file is judged worse than a verdict the notebook
recorded after the file was last saved, the learner has unsaved work: `check` says so, and the
notebook's newer verdict stays in the record (`newer_in_notebook`).
"""

import contextlib
import html
import json
import os
import sys
import time
from pathlib import Path
from typing import Iterator

from course_utils.tooling.language import N_, _
from course_utils.tooling.verdicts import SYMBOL, Verdict, checker_running, verdict_html
from course_utils.tooling.layout import (
    CourseError, exercises, lesson_of, lesson_of_path, read_notebook_json, shown, source_notebooks, work_dir, write_atomic,
)

PROGRESS_FILE = ".progress.json"
NOTEBOOK, CHECKER = "notebook", "check"  # who recorded a verdict: a check cell in the learner's kernel, or `course_utils check`
# The progress table's headings, translated when it is printed (format_progress).
COLUMNS = (N_("lesson"), N_("passed"), N_("not attempted"), N_("failed"), N_("not checked"), N_("total"), N_("failing"), N_("TOTAL"))
RANK = {"passed": 2, "failed": 1, "not attempted": 0}  # better verdicts rank higher; "not run" ranks below all
NOT_CHECKED = N_("not checked yet: run its check cell")  # translated in scoreboard_rows

_session: dict[str, dict[str, Verdict]] = {}


def record(lesson: str, verdict: Verdict) -> None:
    """Keep a check's verdict for this session's scoreboard and, in the work folder, for the progress table."""
    _session.setdefault(lesson, {})[verdict.exercise] = verdict
    if _in_work_dir() and _kernel_may_record(lesson):
        with contextlib.suppress(OSError):  # a read-only folder must not break a check
            save_verdicts(work_dir(), lesson, [verdict], by=NOTEBOOK)


def _kernel_may_record(lesson: str) -> bool:
    """Whether this kernel's verdicts of `lesson` belong in the work folder's record."""
    if os.environ.get("COURSE_CHECKER") == "1":
        return False  # `course_utils check` records them itself, and only for a notebook that holds its own lesson
    notebook = os.environ.get("JPY_SESSION_NAME")  # the notebook jupyter_server started this kernel for
    return notebook is None or lesson_of_path(Path(notebook)) == lesson


def _in_work_dir() -> bool:
    try:
        return Path.cwd().resolve() == work_dir().resolve()
    except OSError:
        return False


def progress_file(folder: Path) -> Path:
    return folder / PROGRESS_FILE


def load_records(folder: Path) -> dict[str, dict[str, dict]]:
    """{lesson: {exercise: {"status", "reason", "time"}}}; empty when there is no record.

    A file that is not such a record (not JSON, a list, {"00": "x"}, ...) is set aside with a
    one-line message and counts as none, so that it never breaks a check or the progress table.
    """
    path = progress_file(folder)
    try:
        data = path.read_bytes()
    except OSError:  # none yet, or unreadable: nothing to show, and nothing to set aside
        return {}
    records, problem = parse_records(data)
    if problem:
        set_aside(path, problem)
        return {}
    return records


def parse_records(data: bytes) -> tuple[dict, str | None]:
    """(the records, None), or ({}, what is wrong with them)."""
    try:
        records = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return {}, N_("empty") if not data.strip() else N_("not JSON")  # translated where they are said (set_aside)
    if not _well_formed(records):
        return {}, N_('not of the form {lesson: {exercise: {"status": ...}}}')
    return records, None


def _well_formed(records: object) -> bool:
    return isinstance(records, dict) and all(
        isinstance(lesson, str) and isinstance(entries, dict) and all(
            isinstance(entry, dict) and isinstance(entry.get("status"), str) for entry in entries.values())
        for lesson, entries in records.items())


def set_aside(path: Path, problem: str) -> Path | None:
    """Rename a malformed progress file to .progress.json.broken-<time> and say so in one line; return the new name."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    kept = path.with_name(f"{path.name}.broken-{stamp}")
    n = 1
    while kept.exists():
        kept = path.with_name(f"{path.name}.broken-{stamp}-{n}")
        n += 1
    try:
        path.rename(kept)
    except FileNotFoundError:  # another kernel set it aside first
        return None
    except OSError as err:
        print(_("{path} is {problem} and could not be set aside ({error}): delete it").format(
            path=shown(path), problem=_(problem), error=err.strerror), file=sys.stderr)
        return None
    print(_("{path} was {problem}, so it was set aside as {kept}; progress is recorded afresh "
            "(`python -m course_utils progress --recheck` rebuilds it)").format(path=shown(path), problem=_(problem), kept=kept.name),
          file=sys.stderr)
    return kept


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """One writer at a time (two notebooks' kernels may record at once)."""
    try:
        import fcntl
    except ImportError:  # Windows: the atomic rename still keeps the file whole
        yield
        return
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".progress.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def save_verdicts(folder: Path, lesson: str, verdicts: list[Verdict], *, replace: bool = False, by: str = CHECKER,
                  keep: tuple[str, ...] | list[str] = ()) -> None:
    """Add verdicts to the folder's record (replace=True: they are the lesson's whole new record).

    by: who judged them (NOTEBOOK or CHECKER); keep: exercises whose recorded verdict stays as it is.
    """
    with _locked(folder):
        records = load_records(folder)
        previous = records.get(lesson, {})
        lesson_records = {} if replace else dict(previous)
        now = round(time.time(), 3)
        for v in verdicts:
            if v.exercise in keep and v.exercise in previous:
                lesson_records[v.exercise] = previous[v.exercise]
            else:
                lesson_records[v.exercise] = {"status": v.status, "reason": v.reason, "time": now, "by": by}
        records[lesson] = lesson_records
        write_atomic(progress_file(folder), json.dumps(records, indent=1, sort_keys=True) + "\n")


def newer_in_notebook(folder: Path, lesson: str, verdicts: list[Verdict], saved: float) -> list[str]:
    """The exercises judged worse in the saved file than a verdict the notebook recorded after `saved` (the file's mtime)."""
    recorded = load_records(folder).get(lesson, {})
    newer = []
    for v in verdicts:
        entry = recorded.get(v.exercise, {})
        when = entry.get("time")
        if (entry.get("by") == NOTEBOOK and isinstance(when, (int, float)) and when > saved
                and RANK.get(entry.get("status"), -1) > RANK.get(v.status, -1)):
            newer.append(v.exercise)
    return newer


def unsaved_message(lesson: str) -> str:
    """The one line for a saved file that is behind its notebook."""
    return _("lesson {lesson} has changes newer than the saved file: save it (Ctrl-S) and check again").format(lesson=lesson)


def forget(folder: Path, lesson: str) -> None:
    """Drop a lesson's record (its notebook was replaced)."""
    with _locked(folder):
        records = load_records(folder)
        if records.pop(lesson, None) is not None:
            write_atomic(progress_file(folder), json.dumps(records, indent=1, sort_keys=True) + "\n")


def exercise_names(lesson: str) -> list[str]:
    """The lesson's exercises in notebook order (this session's order if the course's notebooks are not at hand)."""
    try:
        return [e.name for e in exercises(lesson)]
    except CourseError:
        return list(_session.get(lesson, {}))


def scoreboard_rows(lesson: str, verdicts: dict[str, Verdict]) -> list[Verdict]:
    """One verdict per exercise of the lesson, 'not run' for those not checked."""
    return [verdicts.get(name) or Verdict(name, "not run", _(NOT_CHECKED)) for name in exercise_names(lesson)]


def summary(rows: list[Verdict]) -> str:
    """'7 exercises: 5 passed, 1 not attempted, 1 failed' (and how many were not checked)."""
    counts = {s: sum(r.status == s for r in rows) for s in ("passed", "not attempted", "failed", "not run")}
    text = _("{total} exercises: {passed} passed, {not_attempted} not attempted, {failed} failed").format(
        total=len(rows), passed=counts["passed"], not_attempted=counts["not attempted"], failed=counts["failed"])
    return text + (_(", {n} not checked").format(n=counts["not run"]) if counts["not run"] else "")


def scoreboard_text(lesson: str, rows: list[Verdict]) -> str:
    width = max((len(r.exercise) for r in rows), default=0)
    lines = [_("Lesson {lesson} scoreboard: {summary}").format(lesson=lesson, summary=summary(rows))]
    lines += [f"  {SYMBOL[r.status]}  {r.exercise:{width}}  {r.reason}".rstrip() for r in rows]
    return "\n".join(lines)


def scoreboard_html(lesson: str, rows: list[Verdict]) -> str:
    items = "".join(verdict_html(r) for r in rows)
    title = html.escape(_("Lesson {lesson} scoreboard:").format(lesson=lesson))
    return f'<div class="course-scoreboard"><p><b>{title}</b> {html.escape(summary(rows))}</p>{items}</div>'


def show_scoreboard(lesson: str) -> None:
    """Print (checker) or display (JupyterLab) the lesson's scoreboard from this session's checks."""
    rows = scoreboard_rows(lesson, _session.get(lesson, {}))
    text = scoreboard_text(lesson, rows)
    if checker_running():
        print(text)
        return
    from IPython.display import display

    display({"text/plain": text, "text/html": scoreboard_html(lesson, rows)}, raw=True)


def notebook_problem(path: Path) -> str | None:
    """Why a learner's notebook cannot be checked (missing, empty, truncated, not a notebook, another lesson), or None."""
    return unreadable_problem(path) or wrong_lesson_problem(path)


def unreadable_problem(path: Path) -> str | None:
    """Why a notebook cannot be read (missing, empty, truncated, not a notebook), or None."""
    try:
        read_notebook_json(path)
    except CourseError as err:
        return str(err)
    return None


def other_lesson(path: Path, nb: dict) -> str | None:
    """The lesson a notebook holds when its file name names another ('01' for lesson 01 saved as 00_orientation.ipynb)."""
    named, held = lesson_of_path(path), lesson_of(nb, path)
    return held if named and held and held != named else None


def wrong_lesson_message(path: Path, held: str) -> str:
    """One line: the notebook holds another lesson than its name says, so it is neither checked nor recorded as its name's."""
    named = lesson_of_path(path)
    return _("{path} holds lesson {held}, not {named}: it is not checked as lesson {named} and nothing is recorded "
             "for it; rename it, or `python -m course_utils reset {named}` for a fresh lesson {named} (yours is kept as a backup)").format(
        path=shown(path), held=held, named=named)


def wrong_lesson_problem(path: Path) -> str | None:
    """wrong_lesson_message for a readable notebook that holds another lesson than its name says, else None."""
    try:
        held = other_lesson(path, read_notebook_json(path))
    except CourseError:
        return None
    return wrong_lesson_message(path, held) if held else None


def progress_rows(folder: Path | None = None) -> tuple[list[dict], list[str]]:
    """One row per lesson from the recorded verdicts, and the problems with the learner's notebooks."""
    folder = folder or work_dir()
    records = load_records(folder)
    rows, problems = [], []
    for source in source_notebooks():
        lesson = source.name[:2]
        unreadable = unreadable_problem(folder / source.name)
        problem = unreadable or wrong_lesson_problem(folder / source.name)
        if problem:
            problems.append(problem)
        names = exercise_names(lesson)
        statuses = {n: records.get(lesson, {}).get(n, {}).get("status", "not run") for n in names}
        counts = {s: sum(v == s for v in statuses.values()) for s in ("passed", "not attempted", "failed", "not run")}
        rows.append({
            "lesson": source.stem,
            "passed": counts["passed"],
            "not attempted": counts["not attempted"],
            "failed": counts["failed"],
            "not checked": counts["not run"],
            "total": len(names),
            "failing": ", ".join(n for n, s in statuses.items() if s == "failed") or _problem_label(folder / source.name, unreadable, problem),
        })
    return rows, problems


def _problem_label(path: Path, unreadable: str | None, problem: str | None) -> str:
    if not path.exists():
        return _("(not made yet)")  # before `make lab` or `workspace` makes it: nothing is wrong with it
    if unreadable:
        return _("(notebook unreadable)")
    return _("(holds another lesson)") if problem else ""


def progress_table(folder: Path | None = None):
    """The progress table as a pandas DataFrame (one row per lesson, and a total), from the recorded verdicts."""
    import pandas as pd

    rows, problems = progress_rows(folder)
    columns = ["passed", "not attempted", "failed", "not checked", "total"]
    total = {"lesson": "TOTAL", **{c: sum(r[c] for r in rows) for c in columns}, "failing": ""}
    table = pd.DataFrame(rows + [total]).set_index("lesson")
    table.attrs["problems"] = problems
    return table


def format_progress(table) -> str:
    """The table as text, followed by a line per notebook that could not be read."""
    shown_table = table.rename(columns={c: _(c) for c in table.columns}, index={"TOTAL": _("TOTAL")})
    shown_table.index.name = _(table.index.name or "lesson")
    lines = [shown_table.to_string()]
    lines += [_("problem: {problem}").format(problem=p) for p in table.attrs.get("problems", [])]
    return "\n".join(lines)
