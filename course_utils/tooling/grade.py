"""A class gradebook: `python -m course_utils grade DIR [--out FILE.csv] [--html FILE.html] [--jobs N]`.

Every file under DIR is a submission, whatever its name. Its lesson comes from its content
(the lesson number in its metadata, else its exercise tags, else the `lessonNN.check_...` calls
in its cells), never from its file name. Each submission is copied into a temporary folder and
checked there by the course's checker in a process of its own, with the checker's time limits,
so nothing is written to DIR and a hang or a dead kernel costs one submission, not the run.

Grading runs the submitted code: run it in a container, or as an unprivileged user.

Statuses, one row per submission per exercise:
- pass, not attempted, failed: the check's verdict (a check that did not run because an earlier
  cell hung, failed or killed the kernel is failed, with that reason);
- missing: the submission lacks the exercise's check cell;
- unreadable: the file is empty, truncated, not a notebook, or no lesson of this course.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from course_utils.tooling.gradebook import COLUMNS, STATUSES, format_summary, html_report  # noqa: F401 (STATUSES: the statuses, for callers)
from course_utils.tooling.layout import CourseError, exercises, lesson_of, read_notebook_json, shown, source_for
from course_utils.tooling.runner import become_subreaper, guarded, kill_descendants

SUBMISSION_TIMEOUT = 900  # seconds for a whole submission, on top of the checker's limits per cell
CHECK_CALL = re.compile(r"\blesson(\d\d)\.check_\w+\(")


# ---------------------------------------------------------------- which submissions, which lesson

def find_submissions(folder: Path) -> list[Path]:
    """Every file under folder, in name order, leaving out hidden files and folders (.ipynb_checkpoints, .git)."""
    found = []
    for path in sorted(folder.rglob("*")):
        parts = path.relative_to(folder).parts
        if path.is_file() and not any(p.startswith(".") for p in parts):
            found.append(path)
    return found


def submission_lesson(nb: dict) -> str | None:
    """The lesson a notebook is, from its content: metadata, exercise tags, then the check calls in its code."""
    lesson = lesson_of(nb)
    if lesson:
        return lesson
    # Tags lost (cells pasted into a new notebook): the check cells still call lessonNN.check_<name>.
    calls = Counter(
        number
        for cell in nb["cells"] if isinstance(cell, dict) and cell.get("cell_type") == "code"
        for number in CHECK_CALL.findall("".join(cell.get("source", "")) if isinstance(cell.get("source"), list) else str(cell.get("source", "")))
    )
    for number, _ in calls.most_common():
        try:
            source_for(number)
        except CourseError:
            continue
        return number
    return None


# ---------------------------------------------------------------- one submission

def _row(name: str, lesson: str, exercise: str, status: str, reason: str, seconds: float | None) -> dict:
    return dict(zip(COLUMNS, (name, lesson, exercise, status, reason, None if seconds is None else round(seconds, 2))))


def _status(verdict: dict) -> tuple[str, str]:
    """The checker's (status, reason) in the gradebook's words."""
    status, reason = verdict["status"], verdict["reason"]
    if status == "passed":
        return "pass", ""
    if status == "not attempted":
        return "not attempted", reason
    if status == "failed" and reason.startswith("check cell missing"):
        return "missing", reason
    if status == "not run" and reason == "the check cell did not run":
        return "failed", "its check cell did not run"
    return "failed", reason  # failed, or not run after an earlier cell failed, hung or killed the kernel


def rows_from_report(name: str, lesson: str, result: dict, seconds: float) -> list[dict]:
    """Rows for one submission from the checker's JSON scoreboard of it."""
    times = result.get("seconds", {})
    rows = []
    for exercise, verdict in result["exercises"].items():
        status, reason = _status(verdict)
        rows.append(_row(name, lesson, exercise, status, reason, times.get(exercise, 0.0)))
    if not rows:
        rows.append(_row(name, lesson, "", "unreadable", "the checker found no exercises in it", seconds))
    return rows


def failed_rows(name: str, lesson: str, reason: str) -> list[dict]:
    """Every exercise of the lesson failed with one reason (the checker did not finish, so no exercise's time is known)."""
    return [_row(name, lesson, ex.name, "failed", reason, None) for ex in exercises(lesson)]


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


class Grader:
    """Runs submissions in child processes, a few at a time, and can stop them all."""

    def __init__(self, *, exercise_timeout: float | None = None, cell_timeout: float | None = None,
                 timeout: float = SUBMISSION_TIMEOUT, threads: int | None = None):
        self.exercise_timeout, self.cell_timeout, self.timeout, self.threads = exercise_timeout, cell_timeout, timeout, threads
        self._running: set[subprocess.Popen] = set()
        self._lock = threading.Lock()
        self.stopping = False

    def grade(self, path: Path, name: str) -> list[dict]:
        """The rows of one submission (never raises for anything the submission does)."""
        start = time.perf_counter()
        try:
            nb = read_notebook_json(path)
        except CourseError as err:
            return [_row(name, "", "", "unreadable", _unreadable_reason(err, path), time.perf_counter() - start)]
        lesson = submission_lesson(nb)
        if lesson is None:
            return [_row(name, "", "", "unreadable", "not a notebook of this course: no lesson's exercises in it", time.perf_counter() - start)]
        with tempfile.TemporaryDirectory(prefix="course-grade-") as tmp:
            copy = Path(tmp) / source_for(lesson).name  # nbval wants .ipynb; the kernel runs in tmp
            shutil.copyfile(path, copy)
            outcome = self._run_child(copy, Path(tmp) / "result.json")
        seconds = time.perf_counter() - start
        if "result" in outcome:
            return rows_from_report(name, lesson, outcome["result"], seconds)
        if outcome.get("unreadable"):
            return [_row(name, lesson, "", "unreadable", outcome["unreadable"], seconds)]
        return failed_rows(name, lesson, outcome["error"])

    def _run_child(self, copy: Path, out: Path) -> dict:
        command = [sys.executable, "-m", "course_utils.tooling.grade", str(copy), str(out), f"--timeout={self.timeout:g}"]
        if self.exercise_timeout is not None:
            command.append(f"--exercise-timeout={self.exercise_timeout:g}")
        if self.cell_timeout is not None:
            command.append(f"--cell-timeout={self.cell_timeout:g}")
        env = dict(os.environ)
        if self.threads:  # a few kernels share the cores: one thread pool each, not one per core each
            env.setdefault("OMP_NUM_THREADS", str(self.threads))
        with self._lock:
            if self.stopping:
                return {"error": "grading was interrupted"}
            proc = subprocess.Popen(guarded(command), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    env=env, cwd=copy.parent)
            self._running.add(proc)
        try:
            _, err = proc.communicate(timeout=self.timeout + 60)  # the child keeps its own limit; this is a backstop
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
            return {"error": f"the checker did not finish within {self.timeout:g} s"}
        finally:
            with self._lock:
                self._running.discard(proc)
        if out.exists():
            return json.loads(out.read_text())
        if self.stopping:
            return {"error": "grading was interrupted"}
        return {"error": f"the checker crashed: {_last_line(err)}"}

    def stop(self) -> None:
        """Kill every submission being graded (each child takes its checker and kernel with it)."""
        with self._lock:
            self.stopping = True
            for proc in self._running:
                proc.kill()


def _unreadable_reason(err: CourseError, path: Path) -> str:
    """What is wrong with the file, without its name (the row names the submission already)."""
    message = str(err)
    if "JSON breaks off" in message:
        with open(path, "rb") as f:
            if not f.read(4096).lstrip().startswith(b"{"):
                return "the file is not a notebook (it is not JSON)"
    for shown_as in (shown(path), str(path), path.name):
        if message.startswith(shown_as + " "):
            return "the file " + message[len(shown_as) + 1:]
    return message


def _child(argv: list[str]) -> int:
    """In the child process: check one copied submission and write the checker's scoreboard (or what went wrong) as JSON."""
    import argparse

    from course_utils.tooling.runner import run_checker

    parser = argparse.ArgumentParser(prog="python -m course_utils.tooling.grade", description="check one submission (used by grade)")
    parser.add_argument("notebook", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--timeout", type=float, default=SUBMISSION_TIMEOUT)
    parser.add_argument("--exercise-timeout", type=float, default=None)
    parser.add_argument("--cell-timeout", type=float, default=None)
    args = parser.parse_args(argv)
    try:
        results = run_checker([args.notebook], exercise_timeout=args.exercise_timeout,
                              cell_timeout=args.cell_timeout, timeout=args.timeout)
        result = next(iter(results.values()), None)
        outcome = {"result": result} if result else {"unreadable": "the checker could not collect it as a notebook"}
    except TimeoutError as err:
        outcome = {"error": str(err)}
    except CourseError as err:  # the checker did not run: nbval could not read the notebook
        outcome = {"unreadable": f"the checker could not read it: {_last_line(str(err))}"}
    args.out.write_text(json.dumps(outcome))
    return 0


# ---------------------------------------------------------------- the whole class

def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class ProgressBar:
    """Submissions done and time left, on stderr: redrawn in place on a terminal, a line per submission elsewhere."""

    def __init__(self, total: int, stream=None, width: int = 24):
        self.total, self.done, self.width = total, 0, width
        self.stream = stream or sys.stderr
        self.start = time.perf_counter()
        self.tty = getattr(self.stream, "isatty", lambda: False)()

    def line(self) -> str:
        elapsed = time.perf_counter() - self.start
        filled = self.width * self.done // max(self.total, 1)
        left = elapsed / self.done * (self.total - self.done) if self.done else None
        eta = "done" if self.done == self.total else (f"about {_clock(left)} left" if left is not None else "estimating time left")
        return f"grading [{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} submissions, {_clock(elapsed)} elapsed, {eta}"

    def step(self, note: str = "") -> None:
        self.done += 1
        text = self.line() + (f"  ({note})" if note and not self.tty else "")
        self.stream.write(("\r" + text + ("\n" if self.done == self.total else "")) if self.tty else text + "\n")
        self.stream.flush()


def default_jobs() -> int:
    """The number of cores this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def grade_folder(folder: Path, *, jobs: int | None = None, exercise_timeout: float | None = None,
                 cell_timeout: float | None = None, timeout: float = SUBMISSION_TIMEOUT, progress: bool = True):
    """Grade every submission under folder; return the gradebook as a pandas DataFrame (one row per submission per exercise)."""
    import pandas as pd

    folder = Path(folder)
    if not folder.is_dir():
        raise CourseError(f"{folder} is not a folder of submissions")
    submissions = find_submissions(folder)
    if not submissions:
        raise CourseError(f"{folder} holds no files to grade")
    jobs = max(1, min(jobs or default_jobs(), len(submissions)))
    grader = Grader(exercise_timeout=exercise_timeout, cell_timeout=cell_timeout, timeout=timeout,
                    threads=max(1, default_jobs() // jobs))
    bar = ProgressBar(len(submissions)) if progress else None
    rows: dict[Path, list[dict]] = {}
    become_subreaper()  # anything a submission leaves behind is adopted here, and killed at the end
    pool = ThreadPoolExecutor(max_workers=jobs)
    try:
        futures = {pool.submit(grader.grade, p, p.relative_to(folder).as_posix()): p for p in submissions}
        for future in as_completed(futures):
            path = futures[future]
            rows[path] = future.result()
            if bar:
                passed = sum(r["status"] == "pass" for r in rows[path])
                bar.step(f"{path.relative_to(folder).as_posix()}: {passed}/{len([r for r in rows[path] if r['exercise']])} passed")
    except BaseException:
        grader.stop()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        kill_descendants()
    table = pd.DataFrame([r for p in submissions for r in rows.get(p, [])], columns=COLUMNS)
    return table


def _inside(path: Path, folder: Path) -> bool:
    return path.resolve().is_relative_to(folder.resolve())


def main(folder: str, out: str | None = None, html_out: str | None = None, jobs: int | None = None,
         exercise_timeout: float | None = None, cell_timeout: float | None = None, timeout: float = SUBMISSION_TIMEOUT) -> int:
    """The `grade` command: grade, print the summary, write the CSV and the page."""
    folder_path = Path(folder)
    for target in (out, html_out):
        if target and folder_path.is_dir() and _inside(Path(target), folder_path):
            raise CourseError(f"write {target} outside {folder}: grading writes nothing into the submissions' folder")
    table = grade_folder(folder_path, jobs=jobs, exercise_timeout=exercise_timeout, cell_timeout=cell_timeout, timeout=timeout)
    print(format_summary(table))
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        table.to_csv(out, index=False)
        print(f"\nwrote {out} ({len(table)} rows)")
    if html_out:
        Path(html_out).parent.mkdir(parents=True, exist_ok=True)
        Path(html_out).write_text(html_report(table, f"Gradebook: {folder_path.resolve().name}"), encoding="utf-8")
        print(f"wrote {html_out}")
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
