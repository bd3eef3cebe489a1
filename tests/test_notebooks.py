"""The notebooks as a whole: learner copies in sync with their sources, and the checker's verdicts on them."""

import json
import os
import re
import subprocess
import sys

import nbformat
import pytest

from course_utils.tooling import studytime
from course_utils.tooling.build import BEGIN, END, learner_copy, solution_blocks, tag_source
from course_utils.tooling.layout import exercises, learner_path, source_notebooks

SOURCES = source_notebooks()
IDS = [s.stem for s in SOURCES]


def test_every_lesson_has_a_source_and_a_learner_copy():
    """Lessons 00 and 01 at least, each with both copies."""
    assert {"00_orientation", "01_tensors"} <= set(IDS)
    for source in SOURCES:
        assert learner_path(source).exists(), f"{learner_path(source)} is missing: run `make build`"


@pytest.mark.parametrize("source", SOURCES, ids=IDS)
def test_learner_copy_is_up_to_date(source):
    """The committed learner copy is exactly what the build makes from the committed source."""
    nb = nbformat.read(source, as_version=4)
    tagged = nbformat.writes(nb)
    tag_source(nb)
    assert nbformat.writes(nb) == tagged, f"{source.name}: exercise tags are stale; run `make build`"
    committed = nbformat.writes(nbformat.read(learner_path(source), as_version=4))
    assert committed == nbformat.writes(learner_copy(nb)), f"{learner_path(source).name} is out of date with {source.name}: run `make build`"


@pytest.mark.parametrize("source", SOURCES, ids=IDS)
def test_learner_copy_holds_no_solution(source):
    """No solution marker and no solution block's text survives in the learner copy."""
    learner = learner_path(source).read_text()
    assert BEGIN not in learner and END not in learner
    nb = nbformat.read(source, as_version=4)
    blocks = [b for cell in nb.cells if cell.cell_type == "code" for b in solution_blocks(cell.source)]
    assert blocks, f"{source.name} has no exercises"
    learner_nb = nbformat.read(learner_path(source), as_version=4)
    learner_code = "\n".join(c.source for c in learner_nb.cells if c.cell_type == "code")
    for block in blocks:
        assert block.strip() not in learner_code, f"solution text leaked into {learner_path(source).name}: {block.strip()[:60]}"


@pytest.mark.parametrize("source", SOURCES, ids=IDS)
def test_source_outputs_come_from_a_run(source):
    """Every code cell of a solution copy was executed, in order, with no error output."""
    nb = nbformat.read(source, as_version=4)
    counts = [c.execution_count for c in nb.cells if c.cell_type == "code"]
    assert counts == list(range(1, len(counts) + 1)), f"{source.name}: re-run it with `make notebooks`"
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not [o for o in cell.outputs if o.output_type == "error"], f"{source.name} has an error output"


def test_learner_copies_fail_only_their_check_cells(tmp_path):
    """nbval over the untouched learner copies: every check 'not attempted', no other cell fails."""
    report = tmp_path / "report.json"
    learners = [str(learner_path(s)) for s in SOURCES]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--nbval-lax", "--nbval-current-env", "-p", "no:cacheprovider",
         "-q", "-rf", "--course-report", str(report), *learners],
        capture_output=True, text=True, env={**os.environ, "COURSE_CHECK_MODE": "1"},
    )
    results = json.loads(report.read_text())
    failed_lines = [line for line in result.stdout.splitlines() if line.startswith("FAILED")]
    n_checks = 0
    for source in SOURCES:
        assert results[str(learner_path(source))]["stopped_at"] is None
        exercises = results[str(learner_path(source))]["exercises"]
        n_checks += len(exercises)
        assert exercises, f"{source.name}: no exercises found"
        for name, verdict in exercises.items():
            assert verdict["status"] == "not attempted", f"{source.name} {name}: {verdict}"
            assert "not attempted yet" in verdict["reason"]
    assert len(failed_lines) == n_checks, "\n".join(failed_lines)
    assert all("::check " in line for line in failed_lines), "\n".join(failed_lines)


def _fill(nb, name: str, body: str) -> None:
    """Replace the stub of exercise `name` in a learner notebook with `body` (indented code)."""
    for cell in nb.cells:
        if f"exercise:{name}" in cell.metadata.get("tags", []):
            cell.source = cell.source.replace("    # YOUR CODE HERE\n    raise NotImplementedError()", body)
            return
    raise AssertionError(f"no exercise {name}")


def _solution_of(source, name: str) -> str:
    """The learner copy's cell for exercise `name`, solved as the source solves it."""
    nb = nbformat.read(source, as_version=4)
    (cell,) = [c for c in nb.cells if f"exercise:{name}" in c.metadata.get("tags", [])]
    return cell.source


def test_checker_on_a_filled_in_learner_notebook(tmp_path):
    """A right answer passes, a wrong one fails naming its fault, the rest stay 'not attempted'."""
    source = next(s for s in SOURCES if s.name.startswith("01_"))
    names = [e.name for e in exercises("01")]
    nb = nbformat.read(learner_path(source), as_version=4)
    (first,) = [c for c in nb.cells if f"exercise:{names[0]}" in c.metadata.get("tags", [])]
    first.source = _solution_of(source, names[0])
    _fill(nb, names[1], "    return None")
    mine = tmp_path / "renamed.ipynb"
    nbformat.write(nb, mine)
    result = subprocess.run([sys.executable, "-m", "course_utils", "check", str(mine)], capture_output=True, text=True)
    assert result.returncode == 1
    lines = {line.split()[1]: line for line in result.stdout.splitlines() if line.startswith("  ") and len(line.split()) > 1}
    assert lines[names[0]].split()[0] == "PASS"
    assert lines[names[1]].split()[0] == "FAIL" and "None" in lines[names[1]]
    assert all(lines[n].split()[0] == "TODO" for n in names[2:])
    assert f"{len(names)} exercises: 1 passed, {len(names) - 2} not attempted, 1 failed" in result.stdout


def test_checker_stops_after_a_broken_demo_cell(tmp_path):
    """A failing non-exercise cell is named, and the cells after it are not run."""
    source = next(s for s in SOURCES if s.name.startswith("00_"))
    nb = nbformat.read(learner_path(source), as_version=4)
    first_demo = next(c for c in nb.cells if c.cell_type == "code" and "seed_everything(42)" in c.source)
    first_demo.source = "undefined_name + 1\n" + first_demo.source
    mine = tmp_path / source.name
    nbformat.write(nb, mine)
    result = subprocess.run([sys.executable, "-m", "course_utils", "check", str(mine)], capture_output=True, text=True)
    assert result.returncode == 1
    assert "NameError: name 'undefined_name' is not defined" in result.stdout
    assert "so the cells after it did not run" in result.stdout
    assert "stopped early at Cell" in result.stdout


def _plain_env() -> dict:
    """The environment of a JupyterLab a learner starts: not the checker's."""
    return {k: v for k, v in os.environ.items() if k not in ("COURSE_CHECKER", "COURSE_CHECK_MODE", "PYTEST_ADDOPTS")}


# Run All of every learner copy would run each lesson a third time: what it could find is found already.
# Its demo cells are the solution's, which nbval runs in full (`make test`); with the stubs in place,
# test_learner_copies_fail_only_their_check_cells runs every learner copy, and test_no_demo_cell_calls_an_exercise
# shows no demo depends on a learner's answer. What stays is how a check cell behaves in JupyterLab, the same
# code in every lesson: run here on the first lesson and on the capstone, whose exercises are files;
# tests/test_browser.py does it in a real JupyterLab for the Chinese 00. (Lesson 09's script check, the other one that
# starts processes, tells its untouched skeleton without starting any: checks.untouched_script.)
# The demos run as the checker runs them (COURSE_CHECK_MODE: fewer epochs, figures not drawn), since what is
# tested is the check cells' JupyterLab side, which COURSE_CHECKER, left unset, decides; strict nbval runs
# the demos in full on the solutions.
RUN_ALL = [s for s in SOURCES if s.name[:2] in ("00", "11")]


@pytest.mark.slow
@pytest.mark.parametrize("source", RUN_ALL, ids=[s.stem for s in RUN_ALL])
def test_run_all_of_an_untouched_learner_copy_runs_every_cell(source, tmp_path):
    """As Run All in JupyterLab (demos shortened as for the checker): no check stops the notebook; each shows its
    TODO line; the scoreboard ends it."""
    from nbclient import NotebookClient

    nb = nbformat.read(learner_path(source), as_version=4)
    client = NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    client.execute(env={**_plain_env(), "COURSE_CHECK_MODE": "1"})
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count is not None for c in code), "a cell did not run"
    assert not [o for c in code for o in c.outputs if o.output_type == "error"], "a cell raised"
    names = [e.name for e in exercises(source.name[:2])]
    shown = [o["data"]["text/plain"] for c in code if any(t.startswith("check:") for t in c.metadata.get("tags", []))
             for o in c.outputs if o.output_type == "display_data"]
    assert shown == [f"TODO {n}: not attempted yet: replace `raise NotImplementedError` in {n} with your code" for n in names]
    scoreboard = [o["data"]["text/plain"] for o in code[-1].outputs if o.output_type == "display_data"]
    assert scoreboard and scoreboard[0].startswith(f"Lesson {source.name[:2]} scoreboard: {len(names)} exercises: 0 passed, {len(names)} not attempted")


@pytest.mark.slow
def test_run_all_of_an_untouched_chinese_learner_copy_speaks_chinese(tmp_path):
    """Lesson 00's Chinese copy, run as JupyterLab runs it (the kernel told its notebook by JPY_SESSION_NAME, not by
    COURSE_LANG): every cell runs, and each check and the scoreboard say their verdicts in Chinese."""
    from nbclient import NotebookClient

    from course_utils.tooling.layout import edition_learner_path

    path = edition_learner_path(SOURCES[0], "zh")
    nb = nbformat.read(path, as_version=4)
    env = {k: v for k, v in _plain_env().items() if k != "COURSE_LANG"}
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute(
        env={**env, "COURSE_CHECK_MODE": "1", "JPY_SESSION_NAME": str(path), "COURSE_WORK_DIR": str(tmp_path / "work")})
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count is not None for c in code) and not [o for c in code for o in c.outputs if o.output_type == "error"]
    names = [e.name for e in exercises("00")]
    shown = [o["data"]["text/plain"] for c in code if any(t.startswith("check:") for t in c.metadata.get("tags", []))
             for o in c.outputs if o.output_type == "display_data"]
    assert shown == [f"TODO {n}: 尚未作答：把 {n} 中的 `raise NotImplementedError` 换成你的代码" for n in names]
    scoreboard = [o["data"]["text/plain"] for o in code[-1].outputs if o.output_type == "display_data"]
    assert scoreboard and scoreboard[0].startswith(f"第 00 课记分板：共 {len(names)} 个练习：0 个通过，{len(names)} 个未作答")


@pytest.mark.parametrize("source", SOURCES, ids=IDS)
def test_no_demo_cell_calls_an_exercise(source):
    """Learner copies raise NotImplementedError in exercises, so only check cells may call them (demos use lessonNN.<name>)."""
    nb = nbformat.read(source, as_version=4)
    tags = [t for c in nb.cells for t in c.metadata.get("tags", [])]
    names = [t.split(":", 1)[1] for t in tags if t.startswith("exercise:")]
    for cell in nb.cells:
        own = [t for t in cell.metadata.get("tags", []) if t.startswith(("exercise:", "check:"))]
        if cell.cell_type != "code" or own:
            continue
        for name in names:
            calls = [line for line in cell.source.splitlines()
                     if re.search(rf"(?<![\w.]){name}\(", line) and f"def {name}(" not in line]
            assert not calls, f"{source.name}: a demo cell calls the exercise {name}: {calls[0].strip()}"


@pytest.mark.parametrize("source", SOURCES, ids=IDS)
def test_each_lesson_states_its_study_time(source):
    """The first cell states the study time that the stated method (tooling.studytime) gives, for the core and the whole."""
    nb = nbformat.read(source, as_version=4)
    line = studytime.statement(studytime.estimate(nb))
    assert line in studytime.first_markdown(nb).source, (
        f"{source.name}: the first cell should say {line!r}: run `python -m course_utils.tooling.studytime --write {source}`")


@pytest.mark.parametrize("source", SOURCES, ids=IDS)
def test_each_lesson_has_a_core_path_of_at_most_90_minutes(source):
    """A first pass through a lesson fits in about 90 minutes; the rest is marked *going further*."""
    est = studytime.estimate(nbformat.read(source, as_version=4))
    assert est.core <= studytime.CORE_LIMIT_MINUTES, (
        f"{source.name}: its core path is estimated at {est.core} min (words, demo code lines, exercises: "
        f"{est.words[0]}, {est.code_lines[0]}, {est.exercises[0]}): mark more sections *going further*")


RECORDED = re.compile(r"^\*Recorded on an? .+ with torch \d+\.\d+\.\d+\S*, .* of \d{4}-\d{2}-\d{2}.*\*\n\n```text\n.+\n```$", re.S)


@pytest.mark.parametrize("source", SOURCES, ids=IDS)
def test_recorded_gpu_outputs_sit_beside_their_cells(source):
    """A GPU output shown in markdown follows its gpu cell and names the device, torch and the date; no placeholder."""
    cells = nbformat.read(source, as_version=4).cells
    for i, cell in enumerate(cells):
        if studytime.RECORDED_TAG in cell.metadata.get("tags", []):
            assert i > 0 and "gpu" in cells[i - 1].metadata.get("tags", []), f"{source.name}: cell {i} follows no gpu cell"
            assert RECORDED.match(cell.source), f"{source.name}: cell {i} should name the device, torch and the date: {cell.source[:120]!r}"
        if cell.cell_type == "markdown":
            assert not cell.source.startswith("*Recorded on a GPU: not yet"), f"{source.name}: cell {i} is a placeholder"
