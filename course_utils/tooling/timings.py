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


def study_minutes(nb) -> int | None:
    """The lesson's estimated study time in minutes, from its metadata (`course.study_minutes`), if it has one."""
    minutes = nb.metadata.get("course", {}).get("study_minutes")
    return minutes if isinstance(minutes, (int, float)) and not isinstance(minutes, bool) and minutes > 0 else None


def study_time(minutes: int | None) -> str:
    """'45 min', '1 h 30 min', or '?' for a lesson whose study time is not set yet."""
    if minutes is None:
        return "?"
    hours, rest = divmod(round(minutes), 60)
    return f"{hours} h {rest} min" if hours and rest else f"{hours} h" if hours else f"{rest} min"


def lesson_facts(source: Path) -> dict:
    """Title, topics, exercise count, study time and GPU-cell count, read from the source notebook."""
    nb = nbformat.read(source, as_version=4)
    tags = [t for c in nb.cells for t in c.metadata.get("tags", [])]
    return {
        "name": source.stem.replace("_", " ", 1),
        "topics": nb.metadata.get("course", {}).get("topics", ""),
        "exercises": sum(t.startswith("check:") for t in tags),
        "study": study_time(study_minutes(nb)),
        "gpu": tags.count("gpu"),
    }


HEADER = [
    "| lesson | topics | exercises | study time | nbval, CPU | checker | GPU cells |",
    "|---|---|---|---|---|---|---|",
]


def course_map(repeat: int = 3, log=print) -> str:
    """The README's course-map table, with freshly measured times."""
    lines = list(HEADER)
    total = 0.0
    for source in source_notebooks():
        facts, times = lesson_facts(source), time_lesson(source, repeat)
        total += times["nbval"]
        lines.append(_row(source, facts, f"{times['nbval']:.1f} s", f"{times['check']:.1f} s"))
        if log:
            log(f"{source.stem}: nbval {times['nbval']:.1f} s, checker {times['check']:.1f} s")
    lines.append("")
    lines.append(
        f"Measured by `python -m course_utils timings --repeat {repeat}` on {os.cpu_count()} CPU cores "
        f"({platform.machine()}), as medians of {repeat} runs: *nbval* runs the solution copy under "
        f"`pytest --nbval --nbval-current-env`, *checker* runs `python -m course_utils check` on it. "
        f"Both include a kernel start and `import torch`. The whole course under nbval: {total:.0f} s. "
        f"*Study time* is the lesson's own estimate (`study_minutes` in its notebook metadata; ? where it has none yet)."
    )
    return "\n".join(lines)


def _row(source: Path, facts: dict, nbval: str, check: str) -> str:
    link = learner_path(source).relative_to(root())
    return (f"| [{facts['name']}]({link}) | {facts['topics']} | {facts['exercises']} | {facts['study']} | "
            f"{nbval} | {check} | {facts['gpu']} |")


def refreshed_map(readme: Path | None = None) -> str:
    """The course map with every lesson's facts read afresh and its times kept from README.md (no measuring).

    For metadata changes (topics, study time, exercises) between two timing runs; a lesson
    the README has no times for shows "?".
    """
    text = (readme or root() / "README.md").read_text(encoding="utf-8")
    old = text.split(START, 1)[1].split(END, 1)[0].strip().splitlines()
    columns = [c.strip() for c in old[0].strip("|").split("|")]
    times, footer = {}, [line for line in old if not line.startswith("|")]
    for line in old[2:]:
        if line.startswith("| ["):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            stem = re.search(r"\(([^)]*)\)", cells[0]).group(1).rsplit("/", 1)[-1].removesuffix(".ipynb")
            times[stem] = (cells[columns.index("nbval, CPU")], cells[columns.index("checker")])
    lines = list(HEADER)
    for source in source_notebooks():
        nbval, check = times.get(source.stem, ("?", "?"))
        lines.append(_row(source, lesson_facts(source), nbval, check))
    footer = [line.rstrip() for line in footer]
    note = "*Study time* is the lesson's own estimate"
    if footer and not any(note in line for line in footer):
        footer[-1] += f" {note} (`study_minutes` in its notebook metadata; ? where it has none yet)."
    return "\n".join(lines + footer)


def write_readme(table: str, readme: Path | None = None) -> None:
    """Replace the text between the course-map markers in README.md."""
    readme = readme or root() / "README.md"
    text = readme.read_text(encoding="utf-8")
    if START not in text or END not in text:
        raise ValueError(f"{readme} lacks the {START} / {END} markers")
    pattern = re.compile(re.escape(START) + ".*?" + re.escape(END), re.DOTALL)
    readme.write_text(pattern.sub(lambda _: f"{START}\n{table}\n{END}", text), encoding="utf-8")
