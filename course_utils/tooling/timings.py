"""Measure every lesson's runtime and write the course-map table into README.md.

`python -m course_utils timings` runs each solution notebook under nbval and the
checker over it, `--repeat` times each, and records the medians, so that the
README's numbers come from a run, never from typing.
"""

import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import nbformat

from course_utils.tooling.layout import learner_path, root, source_notebooks

START, END = "<!-- course-map:start -->", "<!-- course-map:end -->"


def wall_time(command: list[str], env: dict | None = None) -> tuple[float, int]:
    """Seconds one command took, and its exit code."""
    start = time.perf_counter()
    code = subprocess.run(command, capture_output=True, env=env, cwd=root()).returncode
    return time.perf_counter() - start, code


def time_lesson(source: Path, repeat: int = 3) -> dict:
    """Median nbval time of the solution copy, and median checker time on it, over `repeat` runs."""
    nbval = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval", "--nbval-current-env",
             "--course-strict-warnings", str(source)]
    check = [sys.executable, "-m", "course_utils", "check", str(source)]
    env = {k: v for k, v in os.environ.items() if k != "COURSE_CHECK_MODE"}
    nbval_runs, check_runs = [], []
    for _ in range(repeat):
        seconds, code = wall_time(nbval, env)
        if code != 0:
            raise RuntimeError(f"{source.name} fails under nbval; fix it before timing it")
        nbval_runs.append(seconds)
        check_runs.append(wall_time(check, env)[0])
    return {"nbval": statistics.median(nbval_runs), "check": statistics.median(check_runs)}


def lesson_facts(source: Path) -> dict:
    """Title, topics, exercise count and GPU-cell count, read from the source notebook."""
    nb = nbformat.read(source, as_version=4)
    tags = [t for c in nb.cells for t in c.metadata.get("tags", [])]
    return {
        "name": source.stem.replace("_", " ", 1),
        "topics": nb.metadata.get("course", {}).get("topics", ""),
        "exercises": sum(t.startswith("check:") for t in tags),
        "gpu": tags.count("gpu"),
    }


def course_map(repeat: int = 3, log=print) -> str:
    """The README's course-map table, with freshly measured times."""
    lines = [
        "| lesson | topics | exercises | nbval, CPU | checker | GPU cells |",
        "|---|---|---|---|---|---|",
    ]
    total = 0.0
    for source in source_notebooks():
        facts, times = lesson_facts(source), time_lesson(source, repeat)
        total += times["nbval"]
        link = learner_path(source).relative_to(root())
        lines.append(
            f"| [{facts['name']}]({link}) | {facts['topics']} | {facts['exercises']} | "
            f"{times['nbval']:.1f} s | {times['check']:.1f} s | {facts['gpu']} |"
        )
        if log:
            log(f"{source.stem}: nbval {times['nbval']:.1f} s, checker {times['check']:.1f} s")
    lines.append("")
    lines.append(
        f"Measured by `python -m course_utils timings --repeat {repeat}` on {os.cpu_count()} CPU cores "
        f"({platform.machine()}), as medians of {repeat} runs: *nbval* runs the solution copy under "
        f"`pytest --nbval --nbval-current-env`, *checker* runs `python -m course_utils check` on it. "
        f"Both include a kernel start and `import torch`. The whole course under nbval: {total:.0f} s."
    )
    return "\n".join(lines)


def write_readme(table: str, readme: Path | None = None) -> None:
    """Replace the text between the course-map markers in README.md."""
    readme = readme or root() / "README.md"
    text = readme.read_text(encoding="utf-8")
    if START not in text or END not in text:
        raise ValueError(f"{readme} lacks the {START} / {END} markers")
    pattern = re.compile(re.escape(START) + ".*?" + re.escape(END), re.DOTALL)
    readme.write_text(pattern.sub(lambda _: f"{START}\n{table}\n{END}", text), encoding="utf-8")
