"""Setting the course up in a hosted runtime (Colab, Kaggle), where nothing of it is installed.

Each lesson's first code cell (written by `python -m course_utils build`, from
course_utils.tooling.publish) does nothing outside a hosted runtime. In one, it clones the course's
repository next to the notebook (the course is needed whole: notebooks/solutions defines the
exercises, data/ holds the datasets) and calls `set_up`, which:

- installs course_utils from that clone, editable (so it finds notebooks/ and data/ there);
- uses the runtime's own torch when it is recent enough for the lesson (the lesson's
  `"course": {"min_torch": "X.Y"}` metadata, else the course's pinned minor version), and installs
  the course's pinned torch and torchvision otherwise, saying which in one line, and why;
- installs, at the course's pins, the few packages the runtime lacks (nbval, onnx, ...), and
  never replaces one it has (Colab's numpy or pandas are imported by its own tools);
- keeps the learner's progress in the notebook's folder (COURSE_WORK_DIR), which ends with the runtime.
"""

import importlib
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Callable

KAGGLE_VARIABLE = "KAGGLE_KERNEL_RUN_TYPE"
NOT_NEEDED_THERE = {"jupyterlab"}  # the hosted runtime brings its own notebook interface


def hosted_runtime() -> str | None:
    """'Colab' or 'Kaggle' when this kernel runs in one of them, else None."""
    if "google.colab" in sys.modules:
        return "Colab"
    if KAGGLE_VARIABLE in os.environ:
        return "Kaggle"
    return None


def version_tuple(version: str) -> tuple[int, ...]:
    """'2.9.0+cu126' -> (2, 9, 0): the release numbers, without a local label or a pre-release suffix."""
    release = version.split("+", 1)[0]
    return tuple(int(m.group()) for m in (re.match(r"\d+", part) for part in release.split(".")) if m)


def pins(course: Path) -> dict[str, str]:
    """The course's exact pins from constraints.txt, by lower-case package name."""
    found = {}
    for line in (course / "constraints.txt").read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9_.-]+)==([^\s;#]+)", line.strip())
        if match:
            found[match.group(1).lower().replace("_", "-")] = match.group(2)
    return found


def dependencies(course: Path) -> list[str]:
    """The names of the packages the course depends on (pyproject.toml), lower-case."""
    project = tomllib.loads((course / "pyproject.toml").read_text())["project"]
    return [re.match(r"[A-Za-z0-9_.-]+", d).group().lower().replace("_", "-") for d in project["dependencies"]]


def needed_torch(lesson: str, course: Path) -> str:
    """The oldest torch the lesson is known to run on: its notebook's course.min_torch, else the pin's major.minor."""
    for source in sorted((course / "notebooks" / "solutions").glob(f"{lesson}_*.ipynb")):
        stated = json.loads(source.read_text(encoding="utf-8")).get("metadata", {}).get("course", {}).get("min_torch")
        if stated:
            return str(stated)
    return ".".join(pins(course)["torch"].split(".")[:2])


def installed(name: str) -> str | None:
    """The installed version of a distribution, or None."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def torch_plan(have: str | None, needed: str, pin: str, lesson: str) -> tuple[bool, str]:
    """(install the course's pin?, the one line that tells the learner which torch is used and why)."""
    if have is not None and version_tuple(have) >= version_tuple(needed):
        return False, f"torch {have}: this runtime's own, recent enough for lesson {lesson} (it needs {needed} or newer)."
    why = f"this runtime's {have} is older than lesson {lesson} needs ({needed})" if have else "this runtime has no torch"
    return True, f"torch {pin}: the course's pinned version, installed because {why}."


class SetUpFailed(RuntimeError):
    """pip could not install what the lesson needs (its own messages say why, above the error)."""


def _pip(args: list[str], run: Callable) -> None:
    done = run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *args], check=False)
    if done.returncode:
        raise SetUpFailed(f"`pip install {' '.join(args)}` failed (exit {done.returncode}): pip says why just above")


def set_up(lesson: str, folder: str, *, run: Callable = subprocess.run) -> list[str]:
    """Install course_utils from the cloned course in `folder`, the right torch and what else is missing; print and return what was done."""
    course = Path(folder).resolve()
    os.environ.setdefault("COURSE_WORK_DIR", os.getcwd())  # the checks record progress where the notebook runs
    try:  # offline first: the runtime's setuptools builds the editable install
        _pip(["--no-deps", "--no-build-isolation", "-e", str(course)], run)
    except SetUpFailed:  # a setuptools too old for pyproject.toml's editable installs: pip fetches a newer one
        _pip(["--no-deps", "-e", str(course)], run)
    pinned = pins(course)
    install, torch_line = torch_plan(installed("torch"), needed_torch(lesson, course), pinned["torch"], lesson)
    wanted = [name for name in dependencies(course) if name not in NOT_NEEDED_THERE | {"torch", "torchvision"}]
    missing = [f"{name}=={pinned[name]}" for name in wanted if installed(name) is None]
    if install:
        missing = [f"torch=={pinned['torch']}", f"torchvision=={pinned['torchvision']}", *missing]
    if missing:
        _pip(missing, run)
    importlib.invalidate_caches()
    lines = [torch_line]
    if install and "torch" in sys.modules:
        lines.append("torch was imported before this cell: restart the session (Runtime > Restart session), then run all cells.")
    lines.append(f"The course is in {course}; your progress is kept in {os.environ['COURSE_WORK_DIR']}/.progress.json "
                 "until this runtime ends.")
    print("\n".join(lines))
    return lines
