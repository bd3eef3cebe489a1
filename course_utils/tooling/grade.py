"""A class gradebook: `python -m course_utils grade DIR [--out FILE.csv] [--html FILE.html] [--feedback DIR2] [--jobs N]`.

Every notebook under DIR (*.ipynb, hidden files and folders such as .ipynb_checkpoints left
out) is a submission, whatever its name; other files are listed once as ignored. Its lesson comes from its content
(the lesson number in its metadata, else its exercise tags, else the `lessonNN.check_...` calls
in its cells), never from its file name.

Each submission is graded in a sandbox of its own (course_utils.tooling.sandbox, made with
bubblewrap): a copy of the notebook and a private HOME and /tmp are all it can write; the course
and its Python are read-only; DIR, every other submission, the gradebook and the grader's
environment are not there at all; it has no network but its own loopback, and its own process
namespace, which ends with it. Its verdicts come back through a pipe that only the grading
process inside its sandbox holds, and the CSV and HTML are written by this process once every
sandbox has ended. `--no-sandbox` grades without it (unsafe: a submission can then reach all of
that), and the gradebook says so.

Statuses, one row per submission per exercise:
- pass, not attempted, failed: the check's verdict (a check that did not run because an earlier
  cell hung, failed or killed the kernel is failed, with that reason);
- missing: the submission lacks the exercise's check cell;
- unreadable: the file is empty, truncated, not a notebook, or no lesson of this course;
- error: the grader's own machinery failed (a kernel that did not start, the sandbox that did not
  start, a crash of the grading process), twice: never the student's fault; `--retry-errors`
  grades those submissions again.
The `review` column names what a submission did that an instructor should look at (it imported
the course's reference, inspected the check's frame, patched the checker, killed the checker...).
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
from dataclasses import dataclass, field, replace
from pathlib import Path

from course_utils.tooling import sandbox
from course_utils.tooling.gradebook import COLUMNS, STATUSES, format_summary, html_report, write_atomic, write_feedback  # noqa: F401
from course_utils.tooling.language import N_, _
from course_utils.tooling.layout import CourseError, NotebookUnreadable, exercises, lesson_of, read_notebook_json, root, source_for
from course_utils.tooling.runner import become_subreaper, guarded, kill_descendants, not_dumpable, read_all
from course_utils.tooling.verdicts import CHECK_MISSING, DID_NOT_RUN

SUBMISSION_TIMEOUT = 900  # seconds for a whole submission, on top of the checker's limits per cell
KERNEL_START = 60  # nbval's default limit for a kernel to start; a retry doubles it
CHECK_CALL = re.compile(r"\blesson(\d\d)\.check_\w+\(")
NO_SANDBOX_WARNING = N_("warning: grading WITHOUT a sandbox (--no-sandbox): each submission runs with your user's rights and can "
                        "read, change or kill anything you can, other students' grades included; the gradebook records this")


@dataclass(frozen=True)
class Settings:
    """How each submission is graded: the checker's time limits, the sandbox and its limits."""

    exercise_timeout: float | None = None
    cell_timeout: float | None = None
    timeout: float = SUBMISSION_TIMEOUT
    kernel_start_timeout: float = KERNEL_START
    sandboxed: bool = True
    limits: sandbox.Limits = field(default_factory=sandbox.Limits)
    hide: tuple[Path, ...] = ()  # inside the course's folders, yet never to be seen by a submission (DIR, the gradebook)
    threads: int | None = None
    env: tuple[tuple[str, str], ...] = ()  # extra environment for the submission's processes


# ---------------------------------------------------------------- which submissions, which lesson

def _visible_files(folder: Path) -> list[Path]:
    """Every file under folder, in name order, leaving out hidden files and folders (.ipynb_checkpoints, .git)."""
    return [path for path in sorted(folder.rglob("*"))
            if path.is_file() and not any(p.startswith(".") for p in path.relative_to(folder).parts)]


def find_submissions(folder: Path) -> list[Path]:
    """Every notebook (*.ipynb) under folder, in name order, leaving out hidden files and folders."""
    return [path for path in _visible_files(folder) if path.suffix == ".ipynb"]


def ignored_files(folder: Path) -> list[Path]:
    """The files under folder that are not submissions: not notebooks (notes.txt, data.csv), hidden ones left out."""
    return [path for path in _visible_files(folder) if path.suffix != ".ipynb"]


def ignored_line(folder: Path, shown_at_most: int = 10) -> str | None:
    """'ignored (not notebooks): notes.txt, data/x.csv', once per run; None when there are none."""
    ignored = [p.relative_to(folder).as_posix() for p in ignored_files(folder)]
    if not ignored:
        return None
    files = ", ".join(ignored[:shown_at_most])
    if len(ignored) > shown_at_most:
        return _("ignored (not notebooks, *.ipynb): {files} and {n} more").format(files=files, n=len(ignored) - shown_at_most)
    return _("ignored (not notebooks, *.ipynb): {files}").format(files=files)


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
    for number, _count in calls.most_common():
        try:
            source_for(number)
        except CourseError:
            continue
        return number
    return None


# ---------------------------------------------------------------- one submission

def _row(name: str, lesson: str, exercise: str, status: str, reason: str, seconds: float | None,
         review: str = "", sandbox_used: str = "bwrap") -> dict:
    values = (name, lesson, exercise, status, reason, None if seconds is None else round(seconds, 2), review, sandbox_used)
    return dict(zip(COLUMNS, values))


def _status(verdict: dict) -> tuple[str, str]:
    """The checker's (status, reason) in the gradebook's words."""
    status, reason = verdict["status"], verdict["reason"]
    if status == "passed":
        return "pass", ""
    if status == "not attempted":
        return "not attempted", reason
    if status == "failed" and reason.startswith((CHECK_MISSING, _(CHECK_MISSING))):
        return "missing", reason
    if status == "not run" and reason in (DID_NOT_RUN, _(DID_NOT_RUN)):
        return "failed", _("its check cell did not run")
    return "failed", reason  # failed, or not run after an earlier cell failed, hung or killed the kernel


def rows_from_report(name: str, lesson: str, result: dict, seconds: float) -> list[dict]:
    """Rows for one submission from the checker's JSON scoreboard of it."""
    times = result.get("seconds", {})
    rows = []
    for exercise, verdict in result["exercises"].items():
        status, reason = _status(verdict)
        rows.append(_row(name, lesson, exercise, status, reason, times.get(exercise, 0.0)))
    if not rows:
        rows.append(_row(name, lesson, "", "unreadable", _("the checker found no exercises in it"), seconds))
    return rows


def lesson_rows(name: str, lesson: str, status: str, reason: str) -> list[dict]:
    """Every exercise of the lesson with one status and reason (the checker did not finish, so no exercise's time is known)."""
    return [_row(name, lesson, ex.name, status, reason, None) for ex in exercises(lesson)]


def failed_rows(name: str, lesson: str, reason: str) -> list[dict]:
    """Every exercise of the lesson failed with one reason."""
    return lesson_rows(name, lesson, "failed", reason)


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else _("no output")


def _flags(nb: dict) -> list[str]:
    """What the submission's code does that an instructor should look at, read from its cells without running them."""
    from course_utils.tooling.tamper import scan

    return scan(nb)


class Grader:
    """Runs submissions, each in a sandbox of its own (or a plain child process with --no-sandbox), and can stop them all."""

    def __init__(self, settings: Settings = Settings()):
        self.settings = settings
        self._running: set[subprocess.Popen] = set()
        self._lock = threading.Lock()
        self.stopping = False

    def grade(self, path: Path, name: str) -> list[dict]:
        """The rows of one submission (never raises for anything the submission does)."""
        rows = self._grade(path, name)
        used = "bwrap" if self.settings.sandboxed else "none"
        return [{**row, "sandbox": used} for row in rows]

    def _grade(self, path: Path, name: str) -> list[dict]:
        start = time.perf_counter()
        try:
            nb = read_notebook_json(path)
        except CourseError as err:
            return [_row(name, "", "", "unreadable", _unreadable_reason(err, path), time.perf_counter() - start)]
        lesson = submission_lesson(nb)
        if lesson is None:
            return [_row(name, "", "", "unreadable", _("not a notebook of this course: no lesson's exercises in it"), time.perf_counter() - start)]
        review = _flags(nb)
        outcome = self._attempt(path, lesson, self.settings)
        if "machinery" in outcome and not self.stopping:  # the grader's fault: once more, with more time to start
            longer = replace(self.settings, kernel_start_timeout=2 * self.settings.kernel_start_timeout)
            outcome = self._attempt(path, lesson, longer)
        review += [flag for flag in outcome.get("review", []) if flag not in review]
        seconds = time.perf_counter() - start
        if "result" in outcome:
            rows = rows_from_report(name, lesson, outcome["result"], seconds)
        elif "unreadable" in outcome:
            rows = [_row(name, lesson, "", "unreadable", outcome["unreadable"], seconds)]
        elif "machinery" in outcome:
            rows = lesson_rows(name, lesson, "error", _("the grader failed, not the submission: {problem}; grade this submission again").format(
                problem=outcome["machinery"]))
        else:
            rows = failed_rows(name, lesson, outcome["failed"])
        return [{**row, "review": "; ".join(review)} for row in rows]

    def _attempt(self, path: Path, lesson: str, settings: Settings) -> dict:
        """Grade one copy of the submission once: the child's outcome (result, unreadable, failed or machinery)."""
        with tempfile.TemporaryDirectory(prefix="course-grade-") as tmp:
            workdir = Path(tmp)
            copy = workdir / source_for(lesson).name  # nbval wants .ipynb; the kernel runs in workdir
            shutil.copyfile(path, copy)
            return self._run_child(copy, workdir, settings)

    def _run_child(self, copy: Path, workdir: Path, settings: Settings) -> dict:
        read_end, write_end = os.pipe()
        reader = read_all(read_end)
        child = [sys.executable, "-m", "course_utils.tooling.grade", str(copy), f"--result-fd={write_end}", *_child_options(settings)]
        err = tempfile.TemporaryFile("w+")  # a file, not a pipe: nothing left holding it can keep this call waiting
        try:
            command, env = self._command(child, workdir, settings, write_end)
            with self._lock:
                if self.stopping:
                    err.close()
                    return {"failed": _("grading was interrupted")}
                proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=err, stderr=err, text=True,
                                        env=env, cwd=workdir, pass_fds=(write_end,))
                self._running.add(proc)
        except (OSError, RuntimeError) as failure:  # the sandbox could not be set up, or the process not started
            err.close()
            return {"machinery": _("the grading process could not be started: {failure}").format(failure=failure)}
        finally:
            os.close(write_end)  # the child holds its own copy; the reader sees EOF once the child is gone
        with err:
            try:
                proc.wait(timeout=settings.timeout + 60)  # the child keeps its own limit; this is a backstop
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                return {"failed": _("the checker did not finish within {seconds:g} s").format(seconds=settings.timeout)}
            finally:
                with self._lock:
                    self._running.discard(proc)
                reader.join(10)
            err.seek(0)
            stderr = err.read()
        if self.stopping:
            return {"failed": _("grading was interrupted")}
        try:
            return json.loads(reader.text)
        except json.JSONDecodeError:
            if settings.sandboxed:
                crashed = _("the sandbox did not start or crashed (exit {code}): {output}")
            else:
                crashed = _("the grading process crashed (exit {code}): {output}")
            return {"machinery": crashed.format(code=proc.returncode, output=_last_line(stderr))}

    @staticmethod
    def _command(child: list[str], workdir: Path, settings: Settings, result_fd: int) -> tuple[list[str], dict | None]:
        """The command line and environment of one grading process: in its sandbox, or (--no-sandbox) guarded."""
        env = dict(settings.env)
        if settings.threads:  # a few kernels share the cores: one thread pool each, not one per core each
            env.setdefault("OMP_NUM_THREADS", str(settings.threads))
        if not settings.sandboxed:
            return guarded(child), {**os.environ, **env}
        env.setdefault("PYTHONPATH", str(root()))  # the same course inside as the grader's, whatever the editable install says
        return sandbox.command(child, workdir=workdir, env=env, hide=settings.hide, keep_fds=[result_fd]), None

    def stop(self) -> None:
        """Kill every submission being graded (each child takes its checker and kernel with it)."""
        with self._lock:
            self.stopping = True
            for proc in self._running:
                proc.kill()


def _child_options(settings: Settings) -> list[str]:
    options = [f"--timeout={settings.timeout:g}", f"--kernel-start-timeout={settings.kernel_start_timeout:g}"]
    if settings.exercise_timeout is not None:
        options.append(f"--exercise-timeout={settings.exercise_timeout:g}")
    if settings.cell_timeout is not None:
        options.append(f"--cell-timeout={settings.cell_timeout:g}")
    if settings.sandboxed:
        limits = settings.limits
        options += [f"--memory-mb={limits.memory_mb}", f"--processes={limits.processes}",
                    f"--open-files={limits.open_files}", f"--file-size-mb={limits.file_size_mb}"]
    return options


def _unreadable_reason(err: CourseError, path: Path) -> str:
    """What is wrong with the file, without its name (the row names the submission already)."""
    if isinstance(err, NotebookUnreadable):
        if err.kind == "truncated":
            with open(path, "rb") as f:
                if not f.read(4096).lstrip().startswith(b"{"):
                    return _("the file is not a notebook (it is not JSON)")
        return err.problem
    return str(err)


def _keep_private(fd: int) -> None:
    """Nothing this process starts inherits fd, and no other process of this user can open it through /proc."""
    os.set_inheritable(fd, False)
    not_dumpable()


def _check_one(args) -> dict:
    """Check the copied submission; the outcome as the grader reads it."""
    from course_utils.tooling.runner import CheckerKilled, run_checker

    try:
        results = run_checker([args.notebook], exercise_timeout=args.exercise_timeout, cell_timeout=args.cell_timeout,
                              timeout=args.timeout, kernel_start_timeout=args.kernel_start_timeout)
    except CheckerKilled as err:  # only the submission's own processes share its sandbox
        return {"failed": _("{error}: the notebook's code stopped the checker").format(error=err),
                "review": ["the checker was killed from inside the submission"]}
    except TimeoutError as err:
        return {"failed": str(err)}
    except CourseError as err:  # the checker did not run: nbval could not read the notebook
        return {"unreadable": _("the checker could not read it: {error}").format(error=_last_line(str(err)))}
    result = next(iter(results.values()), None)
    if not result:
        return {"unreadable": _("the checker could not collect it as a notebook")}
    if result.get("error"):
        return {"machinery": result["error"], "review": result.get("review", [])}
    return {"result": result, "review": result.get("review", [])}


def _child(argv: list[str]) -> int:
    """In the child process (inside the sandbox): check one copied submission and write the outcome as JSON to --result-fd."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m course_utils.tooling.grade", description="check one submission (used by grade)")
    parser.add_argument("notebook", type=Path)
    parser.add_argument("--result-fd", type=int, required=True)
    parser.add_argument("--timeout", type=float, default=SUBMISSION_TIMEOUT)
    parser.add_argument("--kernel-start-timeout", type=float, default=KERNEL_START)
    parser.add_argument("--exercise-timeout", type=float, default=None)
    parser.add_argument("--cell-timeout", type=float, default=None)
    parser.add_argument("--memory-mb", type=int, default=None)
    parser.add_argument("--processes", type=int, default=None)
    parser.add_argument("--open-files", type=int, default=None)
    parser.add_argument("--file-size-mb", type=int, default=None)
    args = parser.parse_args(argv)
    _keep_private(args.result_fd)
    if args.memory_mb is not None:  # before any of the submission's code runs, so that all of it inherits them
        sandbox.apply_limits(sandbox.Limits(memory_mb=args.memory_mb, processes=args.processes,
                                            open_files=args.open_files, file_size_mb=args.file_size_mb))
    try:
        outcome = _check_one(args)
    except Exception as err:  # noqa: BLE001 - the grader reports its own crash as an error, never as the student's
        outcome = {"machinery": _("the grading process failed: {error}: {message}").format(error=type(err).__name__, message=err)}
    with os.fdopen(args.result_fd, "w") as result:
        result.write(json.dumps(outcome))
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
        if self.done == self.total:
            eta = _("done")
        else:
            eta = _("about {time} left").format(time=_clock(left)) if left is not None else _("estimating time left")
        return _("grading [{bar}] {done}/{total} submissions, {elapsed} elapsed, {eta}").format(
            bar="#" * filled + "." * (self.width - filled), done=self.done, total=self.total, elapsed=_clock(elapsed), eta=eta)

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


def grade_folder(folder: Path, *, jobs: int | None = None, settings: Settings = Settings(), progress: bool = True,
                 only: set[str] | None = None):
    """Grade the submissions under folder (only those named in `only`, if given); return the gradebook as a pandas DataFrame."""
    import pandas as pd

    folder = Path(folder)
    submissions = [p for p in find_submissions(folder) if only is None or p.relative_to(folder).as_posix() in only]
    jobs = max(1, min(jobs or default_jobs(), len(submissions) or 1))
    grader = Grader(replace(settings, threads=max(1, default_jobs() // jobs)))
    bar = ProgressBar(len(submissions)) if progress else None
    rows: dict[Path, list[dict]] = {}
    become_subreaper()  # without the sandbox, anything a submission leaves behind is adopted here, and killed at the end
    pool = ThreadPoolExecutor(max_workers=jobs)
    try:
        futures = {pool.submit(grader.grade, p, p.relative_to(folder).as_posix()): p for p in submissions}
        for future in as_completed(futures):
            path = futures[future]
            rows[path] = future.result()
            if bar:
                passed = sum(r["status"] == "pass" for r in rows[path])
                bar.step(_("{submission}: {passed}/{total} passed").format(
                    submission=path.relative_to(folder).as_posix(), passed=passed, total=len([r for r in rows[path] if r["exercise"]])))
    except BaseException:
        grader.stop()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        kill_descendants()
    return pd.DataFrame([r for p in submissions for r in rows.get(p, [])], columns=COLUMNS)


def _inside(path: Path, folder: Path) -> bool:
    return path.resolve().is_relative_to(folder.resolve())


def _writable_target(target: str, what: str) -> None:
    """Refuse now, before any grading, a place the gradebook could not be written to (by trying: root passes os.access)."""
    path = Path(target)
    if path.is_dir() and what != "--feedback":
        raise CourseError(_("{option} {target} is a folder: give a file name").format(option=what, target=target))
    if path.exists() and not path.is_dir() and what == "--feedback":
        raise CourseError(_("{option} {target} is a file: give a folder").format(option=what, target=target))
    parent = path if what == "--feedback" else path.parent
    existing = next(p for p in [parent, *parent.parents] if p.exists())
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as err:
        raise CourseError(_("cannot write {option} {target}: {folder} is not a writable folder ({error})").format(
            option=what, target=target, folder=existing, error=err.strerror)) from None


def validate(folder: str, *, out: str | None, html_out: str | None, feedback: str | None, jobs: int | None,
             exercise_timeout: float | None, cell_timeout: float | None, timeout: float,
             retry_errors: bool, sandboxed: bool, limits: sandbox.Limits) -> None:
    """Every argument of `grade`, checked before any grading starts (an hour of grading must not end in a bad path)."""
    folder_path = Path(folder)
    if not folder_path.is_dir():
        raise CourseError(_("{folder} is not a folder of submissions").format(folder=folder))
    if not find_submissions(folder_path):
        raise CourseError(_("{folder} holds no notebooks (*.ipynb) to grade").format(folder=folder))
    for name, value in (("--timeout", timeout), ("--exercise-timeout", exercise_timeout), ("--cell-timeout", cell_timeout)):
        if value is not None and not value > 0:
            raise CourseError(_("{option} must be a number of seconds above 0, not {value:g}").format(option=name, value=value))
    if jobs is not None and jobs < 1:
        raise CourseError(_("{option} must be 1 or more, not {value}").format(option="--jobs", value=jobs))
    for name in ("memory_mb", "processes", "open_files", "file_size_mb"):
        if getattr(limits, name) < 1:
            raise CourseError(_("{option} must be 1 or more, not {value}").format(option="--" + name.replace("_", "-"), value=getattr(limits, name)))
    for target, what in ((out, "--out"), (html_out, "--html"), (feedback, "--feedback")):
        if target and _inside(Path(target), folder_path):
            raise CourseError(_("write {option} {target} outside {folder}: grading writes nothing into the submissions' folder").format(
                option=what, target=target, folder=folder))
        if target:
            _writable_target(target, what)
    if retry_errors and not (out and Path(out).is_file()):
        raise CourseError(_("--retry-errors regrades the `error` rows of an earlier gradebook: give that CSV with --out"))
    if sandboxed and not sandbox.bwrap_path():
        raise CourseError(_("grading needs bubblewrap (bwrap) to keep each submission in a sandbox: "
                            "install it (Debian/Ubuntu: `sudo apt-get install bubblewrap`), or grade with --no-sandbox (unsafe)"))
    if sandboxed and (why := sandbox.problem()):
        raise CourseError(_("{problem}; or grade with --no-sandbox (unsafe)").format(problem=why))


def _merge_retried(previous, regraded):
    """The earlier gradebook with the regraded submissions' rows put in place of their old ones."""
    import pandas as pd

    kept = previous[~previous["submission"].isin(set(regraded["submission"]))]
    order = {name: i for i, name in enumerate(dict.fromkeys(previous["submission"]))}
    table = pd.concat([kept, regraded], ignore_index=True)
    return table.sort_values("submission", key=lambda names: names.map(order), kind="stable").reset_index(drop=True)


def _read_gradebook(path: str):
    import pandas as pd

    table = pd.read_csv(path, dtype=str, keep_default_na=False)
    missing = [c for c in COLUMNS if c not in table.columns]
    if missing:
        raise CourseError(_("{path} is not a gradebook of this course: it lacks the column(s) {columns}").format(
            path=path, columns=", ".join(missing)))
    table["seconds"] = pd.to_numeric(table["seconds"], errors="coerce")
    return table


def main(folder: str, out: str | None = None, html_out: str | None = None, jobs: int | None = None,
         exercise_timeout: float | None = None, cell_timeout: float | None = None, timeout: float = SUBMISSION_TIMEOUT, *,
         feedback: str | None = None, retry_errors: bool = False, sandboxed: bool = True,
         limits: sandbox.Limits = sandbox.Limits()) -> int:
    """The `grade` command: check the arguments, grade, print the summary, then write the CSV, the page and the feedback."""
    validate(folder, out=out, html_out=html_out, feedback=feedback, jobs=jobs, exercise_timeout=exercise_timeout,
             cell_timeout=cell_timeout, timeout=timeout, retry_errors=retry_errors, sandboxed=sandboxed, limits=limits)
    if not sandboxed:
        print(_(NO_SANDBOX_WARNING), file=sys.stderr)
    folder_path = Path(folder)
    ignored = ignored_line(folder_path)
    if ignored:
        print(ignored, flush=True)
    hidden = tuple(Path(p).resolve() for p in (folder, out, html_out, feedback) if p)
    settings = Settings(exercise_timeout=exercise_timeout, cell_timeout=cell_timeout, timeout=timeout,
                        sandboxed=sandboxed, limits=limits, hide=hidden)
    previous = _read_gradebook(out) if retry_errors else None
    only = set(previous.loc[previous["status"] == "error", "submission"]) if retry_errors else None
    if only is not None and not only:
        print(_("{out} has no `error` rows: nothing to grade again").format(out=out))
        table = previous
    else:
        table = grade_folder(folder_path, jobs=jobs, settings=settings, only=only)
        if previous is not None:
            table = _merge_retried(previous, table)
    # Every sandbox has ended: only now is anything written, and each file appears whole or not at all.
    print(format_summary(table, folder=str(folder)))
    if out:
        write_atomic(Path(out), table.to_csv(index=False))
        print("\n" + _("wrote {path} ({n} rows)").format(path=out, n=len(table)))
    if html_out:
        write_atomic(Path(html_out), html_report(table, _("Gradebook: {folder}").format(folder=folder_path.resolve().name), folder=str(folder)))
        print(_("wrote {path}").format(path=html_out))
    if feedback:
        pages = write_feedback(table, Path(feedback))
        print(_("wrote {n} feedback pages to {folder}").format(n=len(pages), folder=feedback))
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
