"""Measure every lesson's runtime and write the course-map table into README.md.

`python -m course_utils timings` runs each solution notebook under nbval and the
checker over it, `--repeat` times each, and records the medians, so that the
README's numbers come from a run, never from typing. In the same run it measures
the *floor*: nbval on a one-cell notebook that imports torch (pytest, nbval, a
kernel start and `import torch`, which every lesson pays), and prints each
lesson's checker time as a multiple of it.
"""

import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import tempfile

import nbformat

from course_utils.tooling.layout import learner_path, root, source_notebooks
from course_utils.tooling.publish import map_badges
from course_utils.tooling.studytime import estimate, shown

START, END = "<!-- course-map:start -->", "<!-- course-map:end -->"


def wall_time(command: list[str], env: dict | None = None) -> tuple[float, int]:
    """Seconds one command took, and its exit code."""
    start = time.perf_counter()
    code = subprocess.run(command, capture_output=True, env=env, cwd=root()).returncode
    return time.perf_counter() - start, code


def _nbval_command(notebook: Path) -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "course_utils.tooling.lean_imports", "--nbval", "--nbval-current-env",
            "--course-strict-warnings", str(notebook)]


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if k != "COURSE_CHECK_MODE"}


def time_floor(repeat: int = 3) -> float:
    """Median nbval time of a one-cell notebook that imports torch: what every lesson's run costs at least."""
    with tempfile.TemporaryDirectory() as folder:
        notebook = Path(folder) / "floor.ipynb"
        nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("import torch")]), notebook)
        runs = []
        for _ in range(repeat):
            seconds, code = wall_time(_nbval_command(notebook), _env())
            if code != 0:
                raise RuntimeError("the one-cell floor notebook fails under nbval")
            runs.append(seconds)
    return statistics.median(runs)


def time_lesson(source: Path, repeat: int = 3) -> dict:
    """Median nbval time of the solution copy, and median checker time on it, over `repeat` runs."""
    nbval = _nbval_command(source)
    check = [sys.executable, "-m", "course_utils", "check", str(source)]
    env = _env()
    nbval_runs, check_runs = [], []
    for _ in range(repeat):
        seconds, code = wall_time(nbval, env)
        if code != 0:
            raise RuntimeError(f"{source.name} fails under nbval; fix it before timing it")
        nbval_runs.append(seconds)
        check_runs.append(wall_time(check, env)[0])
    return {"nbval": statistics.median(nbval_runs), "check": statistics.median(check_runs)}


def study_time(nb) -> str:
    """'1 h 20 min / 2 h 5 min': the core path's estimated study time, then the whole lesson's (tooling.studytime)."""
    est = estimate(nb)
    return f"{shown(est.core)} / {shown(est.whole)}"


def lesson_facts(source: Path) -> dict:
    """Title, topics, exercise count, study time and GPU-cell count, read from the source notebook."""
    nb = nbformat.read(source, as_version=4)
    tags = [t for c in nb.cells for t in c.metadata.get("tags", [])]
    return {
        "name": source.stem.replace("_", " ", 1),
        "topics": nb.metadata.get("course", {}).get("topics", ""),
        "exercises": sum(t.startswith("check:") for t in tags),
        "study": study_time(nb),
        "gpu": tags.count("gpu"),
    }


HEADER = [
    "| lesson | topics | exercises | study time, core / all | nbval, CPU | checker | GPU cells |",
    "|---|---|---|---|---|---|---|",
]

STUDY_NOTE = (
    "*Study time* is estimated from each notebook by one stated method (`course_utils/tooling/studytime.py`): "
    "its prose at 110 words a minute, its demo code at 8 lines a minute (read, run and compared with the output) "
    "and 12 minutes per exercise, rounded up to 5 minutes. The *core* path leaves out the sections marked "
    "*going further*, which a first pass may skip."
)


def measure(sources: list[Path], repeat: int = 3, log=print) -> tuple[float, dict[Path, dict]]:
    """The floor and every given lesson's times, measured in one run."""
    floor = time_floor(repeat)
    if log:
        log(f"floor (nbval on a one-cell notebook that imports torch): {floor:.1f} s")
    times = {}
    for source in sources:
        times[source] = t = time_lesson(source, repeat)
        if log:
            log(f"{source.stem}: nbval {t['nbval']:.1f} s, checker {t['check']:.1f} s "
                f"({t['check'] / floor:.1f}x the floor)")
    return floor, times


def course_map(repeat: int = 3, log=print) -> str:
    """The README's course-map table, with freshly measured times."""
    lines = list(HEADER)
    floor, times = measure(source_notebooks(), repeat, log)
    for source, t in times.items():
        lines.append(_row(source, lesson_facts(source), f"{t['nbval']:.1f} s", f"{t['check']:.1f} s"))
    total = sum(t["nbval"] for t in times.values())
    lines.append("")
    lines.append(
        f"Measured by `python -m course_utils timings --repeat {repeat}` on {os.cpu_count()} CPU cores "
        f"({platform.machine()}), {'as medians of ' + str(repeat) + ' runs' if repeat > 1 else 'in one run'}: *nbval* runs the solution copy under "
        f"`pytest --nbval --nbval-current-env`, *checker* runs `python -m course_utils check` on it. "
        f"Both include a kernel start and `import torch`; nbval on a one-cell notebook that only imports torch "
        f"took {floor:.1f} s in the same run. The whole course under nbval: {total:.0f} s. {STUDY_NOTE}"
    )
    return "\n".join(lines)


def _row(source: Path, facts: dict, nbval: str, check: str) -> str:
    link = learner_path(source).relative_to(root())
    return (f"| [{facts['name']}]({link}){map_badges(learner_path(source))} | {facts['topics']} | {facts['exercises']} | {facts['study']} | "
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
    footer = [re.sub(r" ?\*Study time\*.*$", "", line.rstrip()) for line in footer]
    if footer and footer[-1]:
        footer[-1] += f" {STUDY_NOTE}"
    return "\n".join(lines + footer)


def write_readme(table: str, readme: Path | None = None) -> None:
    """Replace the text between the course-map markers in README.md."""
    readme = readme or root() / "README.md"
    text = readme.read_text(encoding="utf-8")
    if START not in text or END not in text:
        raise ValueError(f"{readme} lacks the {START} / {END} markers")
    pattern = re.compile(re.escape(START) + ".*?" + re.escape(END), re.DOTALL)
    readme.write_text(pattern.sub(lambda _: f"{START}\n{table}\n{END}", text), encoding="utf-8")
