"""A Gradescope autograder for a lesson: `python -m course_utils autograder NN --out DIR [--points FILE]` (or `all`).

It writes `autograder-NN.zip` to Gradescope's published specification: `setup.sh` and
`run_autograder` at the root of the zip, beside the parts of the course the checker reads
(course_utils/, the lesson's source notebook without its outputs, data/) and `autograder.toml`,
which names the lesson and the points of each exercise (1 by default) for an instructor to edit.

Gradescope unpacks the zip into /autograder/source, runs setup.sh once to build its image, then
for each submission runs run_autograder as root with the upload in /autograder/submission. That
calls `python -m course_utils.tooling.autograder /autograder` (`run` below), which grades the
submission with the course's own grader (course_utils.tooling.grade.Grader, the same checks and
protections as `grade`) and writes /autograder/results/results.json: one test per exercise
(name, score, max_score, status, and the check's one-line reason as output), a submission-level
output that says what was graded, and the execution time.

The student's code never runs as root. Where bubblewrap can make a sandbox in the container
(`sandbox.problem()` is None), each notebook is checked in one, exactly as `grade` does, as the
user nobody; where it cannot (a container without the capability to make namespaces), the checker
runs as nobody by a privilege drop (setpriv, no capabilities, no new privileges), with the course
and the results folder owned by root and not writable by others. Either way only this root process
writes results.json, after every process of the submission has ended.
"""

import io
import json
import os
import pwd
import shutil
import sys
import time
import tomllib
import zipfile
from pathlib import Path

from course_utils.tooling import sandbox
from course_utils.tooling.grade import CHECK_CALL, Grader, Settings, submission_lesson
from course_utils.tooling.layout import (
    CourseError, cell_tags, exercises, lesson_number, read_notebook_json, root, source_for, source_notebooks,
)
from course_utils.tooling.runner import become_subreaper, guarded, kill_descendants

MAX_ZIP_BYTES = 1_500_000  # Gradescope rebuilds its image from setup.sh: the zip carries the course, not its packages
# (1.01 MB for lesson 05 once the Chinese message catalog came in: its .po is 0.12 MB of it, compressed)
TEMPLATES = Path(__file__).resolve().parent / "templates" / "autograder"
CONFIG = "autograder.toml"
INDEX = "lessons.json"  # every lesson's file and exercises, to name a notebook of another lesson
ISOLATION_VARIABLE = "COURSE_AUTOGRADER_ISOLATION"  # bwrap or setpriv: the tests choose; normally detected
DEFAULT_TIMEOUT = 480  # seconds for one notebook: under Gradescope's default 10 minutes for the whole run
TOP_FILES = ("pyproject.toml", "constraints.txt", "README.md", "LICENSE")
SKIPPED_PARTS = {"__pycache__", ".ipynb_checkpoints", "fashion"}  # data/fashion is FashionMNIST, fetched online
# Built files: bytecode, and the compiled message catalog, which course_utils compiles in memory from its .po when absent.
SKIPPED_SUFFIXES = (".pyc", ".pyo", ".mo")
EXECUTABLE = 0o100755 << 16
REGULAR = 0o100644 << 16


# ---------------------------------------------------------------- the zip

def _course_files() -> list[Path]:
    """The course's own files that every autograder carries: the package, the data, and what setup.sh installs from."""
    files = [root() / name for name in TOP_FILES if (root() / name).is_file()]
    for folder in ("course_utils", "data"):
        for path in sorted((root() / folder).rglob("*")):
            parts = path.relative_to(root()).parts
            if path.is_file() and not SKIPPED_PARTS & set(parts) and not any(p.startswith(".") for p in parts) \
                    and path.suffix not in SKIPPED_SUFFIXES:
                files.append(path)
    return files


def _without_outputs(source: Path) -> bytes:
    """A source notebook as the checker reads it (its tags and check cells), without the outputs it does not need."""
    nb = json.loads(source.read_text(encoding="utf-8"))
    for cell in nb["cells"]:
        if cell.get("cell_type") == "code":
            cell["outputs"], cell["execution_count"] = [], None
    return (json.dumps(nb, indent=1, ensure_ascii=False) + "\n").encode()


def lesson_index() -> dict[str, dict]:
    """Every lesson of the course: its notebook's name and its exercises (so another lesson's notebook is named as such)."""
    return {s.name[:2]: {"notebook": s.name, "exercises": [e.name for e in exercises(s.name[:2])]} for s in source_notebooks()}


def read_points(text: str, lesson: str, where: str = CONFIG) -> dict[str, float]:
    """The points of each exercise of the lesson from an autograder.toml text: 1 for every exercise it does not name."""
    try:
        config = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise CourseError(f"{where} is not valid TOML: {err}") from None
    table = config.get("points", {})
    if not isinstance(table, dict):
        raise CourseError(f"{where}: [points] must be a table of exercise = points")
    names = [e.name for e in exercises(lesson)]
    unknown = sorted(set(table) - set(names))
    if unknown:
        raise CourseError(f"{where}: lesson {lesson} has no exercise {', '.join(unknown)}; its exercises are {', '.join(names)}")
    points = {}
    for name in names:
        value = table.get(name, 1)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise CourseError(f"{where}: the points of {name} must be a number of 0 or more, not {value!r}")
        points[name] = float(value)
    return points


def config_text(lesson: str, points: dict[str, float] | None = None, timeout: int = DEFAULT_TIMEOUT) -> str:
    """autograder.toml: the lesson it grades, the time limit of one notebook, and every exercise's points."""
    source = source_for(lesson)
    points = points or {e.name: 1.0 for e in exercises(lesson)}
    lines = [
        f"# The Gradescope autograder of lesson {lesson} ({source.stem}), made by `python -m course_utils autograder {lesson}`.",
        "# Points per exercise (1 by default): change them here, zip the files again (the files, not their folder)",
        "# and upload, or give your own file to `python -m course_utils autograder --points FILE`.",
        f'lesson = "{lesson}"',
        "# Seconds for one notebook, under the assignment's autograder timeout on Gradescope (10 minutes by default).",
        f"timeout = {timeout}",
        "",
        "[points]",
        *(f"{name} = {value:g}" for name, value in points.items()),
    ]
    return "\n".join(lines) + "\n"


def zip_entries(lesson: str, points_text: str | None = None) -> dict[str, bytes]:
    """What autograder-NN.zip holds, by name: the scripts, autograder.toml, the lesson index and the course's parts."""
    lesson = lesson_number(lesson)
    source = source_for(lesson)
    if points_text is None:
        points_text = config_text(lesson)
    else:  # the instructor's file, checked now and written back in the course's form
        config = _config(points_text, "--points")
        if str(config.get("lesson", lesson)) != lesson:
            raise CourseError(f"--points: the file is for lesson {config['lesson']}, not lesson {lesson}")
        timeout = _valid_timeout(config.get("timeout", DEFAULT_TIMEOUT), "--points")
        points_text = config_text(lesson, read_points(points_text, lesson, "--points"), timeout)
    entries = {
        "setup.sh": (TEMPLATES / "setup.sh").read_bytes(),
        "run_autograder": (TEMPLATES / "run_autograder").read_bytes(),
        CONFIG: points_text.encode(),
        INDEX: (json.dumps(lesson_index(), indent=1) + "\n").encode(),
        f"notebooks/solutions/{source.name}": _without_outputs(source),
    }
    for path in _course_files():
        entries[path.relative_to(root()).as_posix()] = path.read_bytes()
    return entries


def write_zip(lesson: str, out: Path, points_text: str | None = None) -> Path:
    """Write autograder-NN.zip into out (made if missing); refuse one over MAX_ZIP_BYTES."""
    lesson = lesson_number(lesson)
    entries = zip_entries(lesson, points_text)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as archive:
        for name, data in entries.items():
            info = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))  # the same zip from the same course
            info.external_attr = EXECUTABLE if name in ("setup.sh", "run_autograder") else REGULAR
            info.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(info, data)
    data = buffer.getvalue()
    if len(data) > MAX_ZIP_BYTES:
        raise CourseError(f"autograder-{lesson}.zip would be {len(data) / 1e6:.2f} MB, over {MAX_ZIP_BYTES / 1e6:g} MB: "
                          "what made it grow? (the zip carries course_utils, data/ and the lesson's notebook)")
    out.mkdir(parents=True, exist_ok=True)
    target = out / f"autograder-{lesson}.zip"
    target.write_bytes(data)
    return target


def build(lessons: list[str], out: str, points: str | None = None) -> int:
    """The `autograder` command: one zip per lesson asked for (`all`: every lesson)."""
    if lessons == ["all"]:
        lessons = [s.name[:2] for s in source_notebooks()]
    if points and len(lessons) != 1:
        raise CourseError("--points gives one lesson's points: build that lesson's autograder alone")
    points_text = Path(points).read_text(encoding="utf-8") if points else None
    for lesson in lessons:
        path = write_zip(lesson, Path(out), points_text)
        print(f"wrote {path} ({path.stat().st_size / 1000:.0f} kB): upload it on the assignment's Configure Autograder page")
    return 0


# ---------------------------------------------------------------- grading one submission (inside Gradescope's container)

def _config(text: str, where: str = CONFIG) -> dict:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise CourseError(f"{where} is not valid TOML: {err}") from None


def _valid_timeout(value, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise CourseError(f"{where}: timeout must be a number of seconds above 0, not {value!r}")
    return int(value)


def visible_files(folder: Path) -> list[Path]:
    """Every file under folder, in name order, hidden files and folders (.ipynb_checkpoints, __MACOSX) left out."""
    if not folder.is_dir():
        return []
    return [p for p in sorted(folder.rglob("*"))
            if p.is_file() and not any(part.startswith((".", "__MACOSX")) for part in p.relative_to(folder).parts)]


def other_lesson(nb: dict, lesson: str, index: dict[str, dict]) -> str | None:
    """The lesson of the course this notebook holds when it is not `lesson` (its stamp, its tags, its check calls), else None."""
    stamped = nb.get("metadata", {}).get("course", {})
    stamp = stamped.get("lesson") if isinstance(stamped, dict) else None
    if isinstance(stamp, str) and stamp in index and stamp != lesson:
        return stamp
    if submission_lesson(nb) == lesson:
        return None
    names = {t.split(":", 1)[1] for cell in nb.get("cells", []) if isinstance(cell, dict)
             for t in cell_tags(cell) if t.startswith(("exercise:", "check:"))}
    overlap = {n: len(names & set(info["exercises"])) for n, info in index.items() if n != lesson}
    best = max(overlap, key=overlap.get, default=None)
    if best and overlap[best]:
        return best
    calls = [n for cell in nb.get("cells", []) if isinstance(cell, dict) and cell.get("cell_type") == "code"
             for n in CHECK_CALL.findall("".join(cell.get("source", "")) if isinstance(cell.get("source"), list) else str(cell.get("source", "")))]
    return next((n for n in calls if n in index and n != lesson), None)


def classify(files: list[Path], folder: Path, lesson: str, index: dict[str, dict]) -> tuple[list[Path], list[str]]:
    """The notebooks of the lesson among the submitted files, and one line for each other file saying why it is not graded."""
    mine, notes = [], []
    for path in files:
        name = path.relative_to(folder).as_posix()
        try:
            nb = read_notebook_json(path)
        except CourseError as err:
            if path.suffix == ".ipynb" or _looks_like_json(path):
                notes.append(f"{name} {_file_problem(err, path)}")  # "is empty", "is not a readable notebook: ..."
            else:
                notes.append(f"{name} is not a notebook")
            continue
        held = other_lesson(nb, lesson, index)
        if held:
            notes.append(f"{name} is lesson {held} ({index[held]['notebook']}), not lesson {lesson}: "
                         f"submit your {index[lesson]['notebook']}")
        elif submission_lesson(nb) == lesson:
            mine.append(path)
        else:
            notes.append(f"{name} is not a notebook of this course: no exercise of lesson {lesson} in it")
    return mine, notes


def _looks_like_json(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(64).lstrip().startswith(b"{")


def _file_problem(err: CourseError, path: Path) -> str:
    message = str(err)
    for prefix in (str(path), path.name):
        if message.startswith(prefix + " "):
            return message[len(prefix) + 1:]
    return message


def chosen(notebooks: list[Path], lesson: str, index: dict[str, dict]) -> Path:
    """The one notebook graded when several hold the lesson: the one named like the lesson's, else the first by name."""
    named = [p for p in notebooks if p.name == index[lesson]["notebook"]]
    return (named or notebooks)[0]


def isolation() -> str | None:
    """How the submission's code is kept from root's files here: bwrap, setpriv (a privilege drop), or None (neither works)."""
    forced = os.environ.get(ISOLATION_VARIABLE)
    if forced in ("bwrap", "setpriv"):
        return forced
    if sandbox.problem() is None:
        return "bwrap"
    if os.getuid() == 0 and shutil.which("setpriv") and _nobody() is not None:
        return "setpriv"
    return None


def _nobody() -> pwd.struct_passwd | None:
    try:
        return pwd.getpwnam(sandbox.SANDBOX_USER)
    except KeyError:
        return None


def _no_new_privileges() -> list[str]:
    """setpriv as nobody with no capabilities, none to gain (setuid programs stay nobody's) and no supplementary groups."""
    # sandbox's drop, plus --no-new-privs: without bwrap around it, the container's setuid programs are in reach.
    entry = _nobody()
    return ["setpriv", f"--reuid={entry.pw_uid}", f"--regid={entry.pw_gid}", "--clear-groups", "--inh-caps=-all",
            "--bounding-set=-all", "--no-new-privs", "--"]


class AutograderGrader(Grader):
    """grade's Grader; where bwrap cannot make a sandbox, its child runs as nobody by a privilege drop instead."""

    def __init__(self, settings: Settings, mode: str):
        super().__init__(settings)
        self.mode = mode

    def _command(self, child, workdir, settings, result_fd):
        if self.mode == "bwrap":
            return Grader._command(child, workdir, settings, result_fd)
        home = workdir / "home"
        home.mkdir(mode=0o700, exist_ok=True)
        entry = _nobody()
        os.chown(home, entry.pw_uid, entry.pw_gid)
        os.chown(workdir, entry.pw_uid, 0)
        os.chmod(workdir, 0o770)
        limits = settings.limits
        child = [*child, f"--memory-mb={limits.memory_mb}", f"--processes={limits.processes}",
                 f"--open-files={limits.open_files}", f"--file-size-mb={limits.file_size_mb}"]
        env = {"PATH": f"{sys.prefix}/bin:/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
               "HOME": str(home), "TMPDIR": "/tmp", "USER": sandbox.SANDBOX_USER, "LOGNAME": sandbox.SANDBOX_USER,
               "PYTHONPATH": str(root()), **dict(settings.env)}
        if settings.threads:
            env.setdefault("OMP_NUM_THREADS", str(settings.threads))
        return [*_no_new_privileges(), *guarded(child)], env


def _protect(folder: Path) -> None:
    """Root owns folder and everything in it, and no one else may write there (setpriv mode: nobody shares the file system)."""
    for path in [folder, *folder.rglob("*")]:
        if path.is_symlink():
            continue
        os.chown(path, 0, 0)
        executable = path.is_dir() or path.stat().st_mode & 0o111
        os.chmod(path, 0o755 if executable else 0o644)


def test_result(name: str, points: float, status: str, reason: str) -> dict:
    """One Gradescope test from a gradebook status: full points for pass, none otherwise; the check's reason as its output."""
    passed = status == "pass"
    if passed:
        output = "passed"
    elif status == "error":
        output = f"not judged: {reason} (the autograder failed here, not your notebook: ask for a regrade)"
    else:
        output = reason or status
    return {"name": name, "score": points if passed else 0.0, "max_score": points,
            "status": "passed" if passed else "failed", "output": output}


def results(lesson: str, points: dict[str, float], rows: list[dict] | None, graded: str | None,
            notes: list[str], problem: str | None, seconds: float, mode: str | None) -> dict:
    """results.json: one test per exercise, the score, what was graded and anything an instructor must look at."""
    index_name = source_for(lesson).name
    if rows is not None:
        by_exercise = {r["exercise"]: r for r in rows if r["exercise"]}
        unreadable = next((r["reason"] for r in rows if not r["exercise"]), None)
        tests = []
        for name, value in points.items():
            row = by_exercise.get(name)
            if row is None:
                tests.append(test_result(name, value, "unreadable", unreadable or "not judged"))
            else:
                tests.append(test_result(name, value, row["status"], row["reason"]))
        review = next((r["review"] for r in rows if r.get("review")), "")
    else:
        tests = [test_result(name, value, "missing", problem or "no notebook was graded") for name, value in points.items()]
        review = ""
    score = sum(t["score"] for t in tests)
    passed = sum(t["status"] == "passed" for t in tests)
    if graded is not None:
        lines = [f"Graded {graded} as lesson {lesson} ({index_name}): {passed} of {len(tests)} exercises passed, "
                 f"{score:g} of {sum(points.values()):g} points."]
        if rows and not any(r["exercise"] for r in rows):
            lines.append(f"It could not be graded: {rows[0]['reason']}.")
    else:
        lines = [f"Nothing was graded: {problem}.", f"Upload your lesson {lesson} notebook ({index_name}), saved, as a .ipynb file."]
    if review:
        lines.append(f"Needs review by your instructor: {review}.")
    lines += [f"Not graded: {note}." for note in notes]
    return {
        "score": score,
        "execution_time": round(seconds),
        "output": "\n".join(lines),
        "output_format": "text",
        "test_output_format": "text",
        "tests": tests,
        "extra_data": {"lesson": lesson, "graded": graded, "review": review, "isolation": mode},
    }


def _write_results(path: Path, data: dict) -> None:
    """Write results.json whole (a temporary file, then a rename), as root, in a folder only root may write."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def run(base: Path) -> dict:
    """Grade the submission under base/submission and write base/results/results.json (base is /autograder on Gradescope)."""
    start = time.monotonic()
    source, results_dir = base / "source", base / "results"
    config = _config((source / CONFIG).read_text(encoding="utf-8"))
    lesson = lesson_number(str(config["lesson"]))
    points = read_points((source / CONFIG).read_text(encoding="utf-8"), lesson)
    timeout = _valid_timeout(config.get("timeout", DEFAULT_TIMEOUT), CONFIG)
    index = json.loads((source / INDEX).read_text(encoding="utf-8"))
    mode = isolation()
    if mode == "setpriv":
        results_dir.mkdir(parents=True, exist_ok=True)
        _protect(results_dir)  # the results folder and the course: root's alone to write
        _protect(source)
        metadata = base / "submission_metadata.json"  # Gradescope's: the students' names and earlier results
        if metadata.exists():
            os.chmod(metadata, 0o600)
    files = visible_files(base / "submission")
    notebooks, notes = classify(files, base / "submission", lesson, index)
    rows = graded = problem = None
    if mode is None:
        problem = ("the autograder cannot keep the submission's code apart from its own files here: "
                   f"{sandbox.problem()}, and it does not run as root to drop to the user nobody")
    elif not notebooks:  # missing, empty, not a notebook, another lesson: each file's own line says which
        problem = "; ".join(notes) if notes else "the submission holds no files"
        notes = []
    else:
        path = chosen(notebooks, lesson, index)
        graded = path.relative_to(base / "submission").as_posix()
        notes += [f"{p.relative_to(base / 'submission').as_posix()} (one notebook is graded: {graded})" for p in notebooks if p != path]
        settings = Settings(timeout=timeout, cell_timeout=min(600, timeout), sandboxed=mode == "bwrap",
                            hide=(base.resolve() / "submission", results_dir.resolve()))
        become_subreaper()
        try:
            rows = AutograderGrader(settings, mode).grade(path, graded)
        finally:
            kill_descendants()  # every process the submission left behind ends before results.json is written
    data = results(lesson, points, rows, graded, notes, problem, time.monotonic() - start, mode)
    _write_results(results_dir / "results.json", data)
    return data


def main(argv: list[str]) -> int:
    """`python -m course_utils.tooling.autograder BASE`: what run_autograder runs."""
    base = Path(argv[0] if argv else "/autograder")
    data = run(base)
    print(data["output"])
    for test in data["tests"]:
        print(f"  {test['status']:6}  {test['score']:g}/{test['max_score']:g}  {test['name']}: {test['output']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
