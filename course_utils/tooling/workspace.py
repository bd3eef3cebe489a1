"""The learner's own notebooks: work/NN_topic.ipynb, made on first use and never overwritten.

git ignores work/, and no build writes there, so a learner's edits never conflict with a
course update (`git pull`) and never fail `make test`. The only commands that replace a
learner's notebook are `reset` and `restore`, and both first keep the current file in
work/backups/, then write the new one atomically (a temporary file, then a rename), so a
failure half-way leaves the old file whole.
"""

import re
import shutil
import time
from pathlib import Path

from course_utils.tooling.layout import (
    CourseError, backups_dir, learner_path, source_for, source_notebooks, work_dir, work_path, write_atomic,
)
from course_utils.tooling.progress import forget


def ensure_workspace() -> list[Path]:
    """Copy every lesson the learner does not have yet into work/; return the copies made (existing files are left alone)."""
    made = []
    for source in source_notebooks():
        target = work_path(source)
        if not target.exists():
            write_atomic(target, learner_path(source).read_text(encoding="utf-8"))
            made.append(target)
    return made


def backup(path: Path) -> Path:
    """Copy a learner's notebook to work/backups/NN_topic.YYYYmmdd-HHMMSS.ipynb (never replacing a backup)."""
    folder = backups_dir()
    folder.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = folder / f"{path.stem}.{stamp}{path.suffix}"
    n = 1
    while target.exists():
        target = folder / f"{path.stem}.{stamp}-{n}{path.suffix}"
        n += 1
    shutil.copy2(path, target)
    if target.read_bytes() != path.read_bytes():
        raise OSError(f"the backup {target} is incomplete, so {path} was left untouched")
    return target


def reset(lesson: str) -> tuple[Path, Path | None]:
    """Give the learner a fresh copy of a lesson; return (their notebook, the backup of their previous file or None)."""
    source = source_for(lesson)
    target, fresh = work_path(source), learner_path(source).read_text(encoding="utf-8")
    saved = None
    if target.exists():
        if target.read_text(encoding="utf-8", errors="replace") == fresh:
            return target, None
        saved = backup(target)
    write_atomic(target, fresh)
    forget(work_dir(), source.name[:2])
    return target, saved


def backups_of(lesson: str) -> list[Path]:
    """The backups of one lesson, oldest first."""
    stem = source_for(lesson).stem
    folder = backups_dir()
    return sorted(folder.glob(f"{stem}.*.ipynb"), key=_backup_order) if folder.exists() else []


def _backup_order(path: Path) -> tuple[str, int]:
    """NN_topic.20261123-101500.ipynb, then its -1, -2, ... made in the same second."""
    match = re.search(r"\.(\d{8}-\d{6})(?:-(\d+))?$", path.stem)
    return (match.group(1), int(match.group(2) or 0)) if match else ("", 0)


def restore(lesson: str, name: str | None = None) -> tuple[Path, Path, Path | None]:
    """Bring back a backup (the newest, or the one named); return (notebook, backup used, backup of the file it replaced)."""
    backups = backups_of(lesson)
    if not backups:
        raise CourseError(f"lesson {source_for(lesson).name[:2]} has no backups in {backups_dir()}")
    if name is None:
        chosen = backups[-1]
    else:
        matches = [b for b in backups if b.name == name or b.name == f"{name}.ipynb"]
        if not matches:
            listing = ", ".join(b.name for b in backups)
            raise CourseError(f"no backup named {name!r}; the backups of this lesson are: {listing}")
        chosen = matches[0]
    target = work_path(source_for(lesson))
    saved = backup(target) if target.exists() else None
    write_atomic(target, chosen.read_text(encoding="utf-8"))
    forget(work_dir(), source_for(lesson).name[:2])
    return target, chosen, saved
