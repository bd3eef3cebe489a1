"""The learner's own notebooks: work/NN_topic.ipynb, made on first use and never overwritten.

git ignores work/, and no build writes there, so a learner's edits never conflict with a
course update (`git pull`) and never fail `make test`. The only commands that replace a
learner's notebook are `reset` and `restore`, and both first keep the current file in
work/backups/, then write the new one atomically (a temporary file, then a rename), so a
failure half-way leaves the old file whole. A backup only takes its name once it has been
read back equal to the file it keeps, so a full disk never leaves a truncated backup for a
later `restore` to bring back; and `restore` refuses a backup that is not a readable notebook.
"""

import contextlib
import errno
import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Callable

from course_utils.tooling.layout import (
    CourseError, backups_dir, edition_learner_path, read_notebook_json, shown, source_for, source_notebooks, work_dir, work_path,
    write_atomic,
)
from course_utils.tooling.language import _, current as current_language
from course_utils.tooling.progress import forget

BACKUP_INDEX = ".backups.json"  # when each backup was made and by which command


def ensure_workspace() -> list[Path]:
    """Copy every lesson the learner does not have yet into work/, in the edition of their language; return the copies made.

    Existing files are left alone, whatever their edition: `reset` gives a fresh copy in the current one.
    """
    made = []
    for source in source_notebooks():
        target = work_path(source)
        if not target.exists():
            write_atomic(target, fresh_copy(source).read_text(encoding="utf-8"))
            made.append(target)
    return made


def fresh_copy(source: Path) -> Path:
    """The learner copy a lesson's work/ file starts from: the edition of the learner's language (COURSE_LANG, or `lab --lang`)."""
    return edition_learner_path(source, current_language())


def backup(path: Path, made_by: str = "") -> Path:
    """Copy a learner's notebook to work/backups/NN_topic.YYYYmmdd-HHMMSS.ipynb (never replacing a backup).

    The copy is written under a temporary name and renamed only once it reads back byte for
    byte as the original; otherwise nothing is left behind and a one-line CourseError says why.
    made_by: the command that made it ("reset 01"), noted in work/backups/.backups.json for `restore --list`.
    """
    folder = backups_dir()
    folder.mkdir(parents=True, exist_ok=True)
    target = _free_backup_name(folder, path)
    original = path.read_bytes()
    tmp = folder / f".{target.name}.tmp"  # a dot name, never listed by backups_of
    try:
        shutil.copy2(path, tmp)
        _sync(tmp)
        _verify_backup(tmp, original, path)
        os.replace(tmp, target)
    except OSError as err:
        raise CourseError(_backup_failed(path, err)) from None
    finally:
        tmp.unlink(missing_ok=True)
    if made_by:
        _note_backup(target, made_by)
    return target


def _note_backup(target: Path, made_by: str) -> None:
    """Note in the backups' index when the backup was made and by which command (the backup itself is kept as it was)."""
    index = backup_index()
    index[target.name] = {"made": time.strftime("%Y-%m-%d %H:%M:%S"), "made_by": made_by}
    with contextlib.suppress(OSError):  # the backup is whole; only its note in `restore --list` is lost
        write_atomic(backups_dir() / BACKUP_INDEX, json.dumps(index, indent=1, sort_keys=True) + "\n")


def backup_index() -> dict[str, dict]:
    """{backup's file name: {"made", "made_by"}}; empty when there is no index or it cannot be read."""
    try:
        index = json.loads((backups_dir() / BACKUP_INDEX).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in index.items() if isinstance(v, dict)} if isinstance(index, dict) else {}


def _free_backup_name(folder: Path, path: Path) -> Path:
    """NN_topic.YYYYmmdd-HHMMSS.ipynb, or -1, -2, ... when a backup of that second exists."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = folder / f"{path.stem}.{stamp}{path.suffix}"
    n = 1
    while target.exists():
        target = folder / f"{path.stem}.{stamp}-{n}{path.suffix}"
        n += 1
    return target


def _sync(path: Path) -> None:
    """Flush a file to the disk, so that a full disk shows up now, not after the rename."""
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


class IncompleteBackup(OSError):
    """A backup that does not read back as the file it keeps."""


def _verify_backup(copy: Path, original: bytes, path: Path) -> None:
    """Raise IncompleteBackup unless the copy is byte-equal to the original and, when that is a notebook, parses as one."""
    # A broken notebook is kept as it is: reset is how a learner gets out of one.
    if copy.read_bytes() != original or (_is_notebook(path) and not _is_notebook(copy)):
        raise IncompleteBackup(f"the copy of {shown(path)} is incomplete")


def _is_notebook(path: Path) -> bool:
    try:
        read_notebook_json(path)
    except CourseError:
        return False
    return True


def _backup_failed(path: Path, err: OSError) -> str:
    """One line: why the backup of path failed, that nothing was replaced, and what to do."""
    where = {"path": shown(path), "folder": shown(backups_dir())}
    if err.errno == errno.ENOSPC:
        return _("could not back up {path} to {folder}: the disk is full; nothing was replaced: "
                 "free some disk space, then run the command again").format(**where)
    if isinstance(err, IncompleteBackup):
        return _("could not back up {path} to {folder}: the copy read back incomplete; nothing was replaced: "
                 "check that the disk has space, then run the command again").format(**where)
    return _("could not back up {path} to {folder}: {error}; nothing was replaced: "
             "check that the folder is writable and the disk has space, then run the command again").format(error=err.strerror or err, **where)


def reset(lesson: str, guard: Callable[[Path], None] | None = None) -> tuple[Path, Path | None]:
    """Give the learner a fresh copy of a lesson; return (their notebook, the backup of their previous file or None).

    guard: called with the notebook before anything is written; it refuses by raising (opentabs.TabGuard).
    """
    source = source_for(lesson)
    target, fresh = work_path(source), fresh_copy(source).read_text(encoding="utf-8")
    saved = None
    if target.exists() and target.read_text(encoding="utf-8", errors="replace") == fresh:
        return target, None
    if guard:
        guard(target)
    if target.exists():
        saved = backup(target, made_by=f"reset {source.name[:2]}")
    write_atomic(target, fresh)
    forget(work_dir(), source.name[:2])
    return target, saved


def backups_of(lesson: str) -> list[Path]:
    """The backups of one lesson, oldest first."""
    stem = source_for(lesson).stem
    folder = backups_dir()
    return sorted(folder.glob(f"{stem}.*.ipynb"), key=_backup_order) if folder.exists() else []


def passed_in(path: Path) -> tuple[int, int] | None:
    """(check cells whose saved output is a pass, check cells) in a notebook, from its saved outputs; None if unreadable.

    A quick read of the file, not a run: the verdicts its checks showed when they last ran in it.
    """
    try:
        nb = read_notebook_json(path)
    except CourseError:
        return None
    checks = [c for c in nb.get("cells", []) if isinstance(c, dict)
              and any(str(t).startswith("check:") for t in (c.get("metadata") or {}).get("tags", []) or [])]
    return sum(_shows_a_pass(c) for c in checks), len(checks)


def _shows_a_pass(cell: dict) -> bool:
    for output in cell.get("outputs") or []:
        if not isinstance(output, dict):
            continue
        text = (output.get("data") or {}).get("text/plain", output.get("text", ""))
        text = "".join(text) if isinstance(text, list) else str(text)
        if text.startswith("PASS "):
            return True
    return False


def backup_listing(lesson: str) -> str:
    """`restore --list`: each backup, oldest first, with when it was made, by which command and how many checks passed in it."""
    backups = backups_of(lesson)
    number = source_for(lesson).name[:2]
    if not backups:
        return _("lesson {lesson} has no backups").format(lesson=number)
    index = backup_index()
    rows = []
    for b in backups:
        note = index.get(b.name, {})
        counted = passed_in(b)
        made_by = note.get("made_by")
        rows.append((b.name, str(note.get("made") or _stamp_time(b)),
                     _("by {command}").format(command=made_by) if made_by else _("by (not noted)"),
                     _("{passed} of {total} exercises passed").format(passed=counted[0], total=counted[1]) if counted
                     else _("not a readable notebook")))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [_("lesson {lesson}'s backups in {folder}, oldest first "
               "(`python -m course_utils restore {lesson} NAME` brings one back):").format(lesson=number, folder=shown(backups_dir()))]
    lines += ["  " + "  ".join(f"{cell:{w}}" for cell, w in zip(r[:3], widths)) + f"  {r[3]}" for r in rows]
    return "\n".join(lines)


def _stamp_time(path: Path) -> str:
    """'2026-11-23 10:15:00' from NN_topic.20261123-101500.ipynb."""
    stamp, _order = _backup_order(path)
    return f"{stamp[:4]}-{stamp[4:6]}-{stamp[6:8]} {stamp[9:11]}:{stamp[11:13]}:{stamp[13:15]}" if stamp else "?"


def _backup_order(path: Path) -> tuple[str, int]:
    """NN_topic.20261123-101500.ipynb, then its -1, -2, ... made in the same second."""
    match = re.search(r"\.(\d{8}-\d{6})(?:-(\d+))?$", path.stem)
    return (match.group(1), int(match.group(2) or 0)) if match else ("", 0)


def restore(lesson: str, name: str | None = None, guard: Callable[[Path], None] | None = None) -> tuple[Path, Path, Path | None]:
    """Bring back a backup (the newest, or the one named); return (notebook, backup used, backup of the file it replaced).

    guard: called with the notebook before anything is written; it refuses by raising (opentabs.TabGuard).
    """
    backups = backups_of(lesson)
    if not backups:
        raise CourseError(_("lesson {lesson} has no backups in {folder}").format(lesson=source_for(lesson).name[:2], folder=backups_dir()))
    if name is None:
        chosen = backups[-1]
    else:
        matches = [b for b in backups if b.name == name or b.name == f"{name}.ipynb"]
        if not matches:
            listing = ", ".join(b.name for b in backups)
            raise CourseError(_("no backup named {name!r}; the backups of this lesson are: {backups}").format(name=name, backups=listing))
        chosen = matches[0]
    _refuse_unreadable(chosen, lesson)
    target = work_path(source_for(lesson))
    if guard:
        guard(target)
    saved = backup(target, made_by=f"restore {source_for(lesson).name[:2]}") if target.exists() else None
    write_atomic(target, chosen.read_text(encoding="utf-8"))
    forget(work_dir(), source_for(lesson).name[:2])
    return target, chosen, saved



def _refuse_unreadable(chosen: Path, lesson: str) -> None:
    """A CourseError naming a backup that is not a readable notebook (a truncated copy must never replace a notebook)."""
    try:
        read_notebook_json(chosen)
    except CourseError as err:
        raise CourseError(_("{problem}; it was not restored: pick another with `python -m course_utils restore {lesson} --list`").format(
            problem=err, lesson=source_for(lesson).name[:2])) from None
