"""The learner's own notebooks: progress across lessons, and a reset that never loses work.

Rule: no command of the course deletes or overwrites a learner's notebook without
first copying it to a timestamped backup beside it.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from course_utils import check_mode
from course_utils.build import learner_copy, learner_path, source_notebooks, tag_source


def backup(path: Path) -> Path:
    """Copy `path` to NN_topic.backup-YYYYmmdd-HHMMSS.ipynb beside it (never replacing a backup)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = path.with_name(f"{path.stem}.backup-{stamp}{path.suffix}")
    n = 1
    while target.exists():
        target = path.with_name(f"{path.stem}.backup-{stamp}-{n}{path.suffix}")
        n += 1
    shutil.copy2(path, target)
    if target.read_bytes() != path.read_bytes():
        raise OSError(f"backup of {path} to {target} is incomplete; {path} was left untouched")
    return target


def write_learner_file(path: Path, content: str) -> Path | None:
    """Write a learner notebook, backing up a different existing file first; return the backup, if any."""
    saved = None
    if path.exists() and path.read_text(encoding="utf-8") != content:
        saved = backup(path)
    path.write_text(content, encoding="utf-8")
    return saved


def fresh_copy(source: Path) -> str:
    """The learner copy of a source notebook, as the text `make build` writes."""
    import nbformat

    nb = nbformat.read(source, as_version=4)
    tag_source(nb)
    return nbformat.writes(learner_copy(nb)) + "\n"


def reset(source: Path) -> Path | None:
    """Give the learner a fresh copy of one lesson, keeping their current file as a backup."""
    return write_learner_file(learner_path(source), fresh_copy(source))


def run_checker(notebooks: list[Path]) -> dict:
    """Run nbval in check mode over notebooks; return the plugin's JSON scoreboard."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        command = [
            sys.executable, "-m", "pytest", "--nbval-lax", "--nbval-current-env", "-q", "-p", "no:cacheprovider",
            "--no-header", "-rN", "--tb=no", "--course-report", str(report), *map(str, notebooks),
        ]
        result = subprocess.run(command, env={**os.environ, "COURSE_CHECK_MODE": "1"}, capture_output=True, text=True)
        if not report.exists():
            raise RuntimeError(f"the checker did not run:\n{result.stdout}{result.stderr}")
        return json.loads(report.read_text())


def progress_rows(results: dict) -> list[dict]:
    """One row per lesson: passed / not attempted / failed / total, from a checker report."""
    rows = []
    for path, notebook in results.items():
        statuses = [v["status"] for v in notebook["exercises"].values()]
        rows.append({
            "lesson": Path(path).stem,
            "passed": statuses.count("passed"),
            "not attempted": statuses.count("not attempted"),
            "failed": statuses.count("failed") + statuses.count("not run"),
            "total": len(statuses),
            "note": f"stopped at {notebook['stopped_at']}" if notebook["stopped_at"] else "",
        })
    return rows


def format_progress(rows: list[dict]) -> str:
    """The progress table, with pandas when it is there and as plain text otherwise."""
    columns = ["passed", "not attempted", "failed", "total"]
    totals = {c: sum(r[c] for r in rows) for c in columns}
    try:
        import pandas as pd
    except ImportError:
        lines = [f"{'lesson':20} " + " ".join(f"{c:>13}" for c in columns)]
        for r in rows + [{"lesson": "TOTAL", **totals}]:
            lines.append(f"{r['lesson']:20} " + " ".join(f"{r[c]:>13}" for c in columns) + (f"  {r['note']}" if r.get("note") else ""))
        return "\n".join(lines)
    table = pd.DataFrame(rows + [{"lesson": "TOTAL", **totals, "note": ""}]).set_index("lesson")
    if not table["note"].any():
        table = table.drop(columns="note")
    return table.to_string()


def progress(lessons: list[Path] | None = None) -> str:
    """Check every learner notebook (or the given ones) and return the progress table."""
    if check_mode():
        return "progress() does not run inside the checker (it would check itself)."
    notebooks = lessons or [learner_path(s) for s in source_notebooks() if learner_path(s).exists()]
    return format_progress(progress_rows(run_checker(notebooks)))
