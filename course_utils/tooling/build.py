"""Turn each source notebook (the solution copy) into the course's learner copy.

Source: notebooks/solutions/NN_name.ipynb, with every solution inside a function
body between `### BEGIN SOLUTION` and `### END SOLUTION` (in a cell that defines that
function, or in a `%%writefile <path>` cell, whose script is the exercise), a check cell that
calls `lessonNN.check_<exercise>(...)`, and a last code cell `lessonNN.scoreboard()`.
The learner copy, notebooks/NN_name.ipynb, has each solution replaced by
`raise NotImplementedError()`, no outputs, the exercise tags the checker reads,
and the lesson's number in its metadata. Learners never work in it: their own
copies live in work/ (course_utils.tooling.workspace), which no build touches.
"""

import contextlib
import copy
import os
import re
from pathlib import Path, PurePosixPath
from typing import Iterator

from course_utils.tooling import publish
from course_utils.tooling.layout import learner_path, lesson_of_path, source_notebooks, write_atomic

BEGIN = "### BEGIN SOLUTION"
END = "### END SOLUTION"
CHECK_CALL = re.compile(r"^lesson\d+\.check_(\w+)\(", re.MULTILINE)  # a top-level call; one inside try: is a demo
DEF = re.compile(r"^def (\w+)\(", re.MULTILINE)
WRITEFILE = "%%writefile"  # a cell that writes a script: the exercise is named after the file's stem
OWN_TAGS = ("check:", "exercise:")
SOURCE_ONLY_TAGS = ("nbval-ignore-output", "nbval-check-output")  # output checks: solution copy only


class BuildError(Exception):
    """A source notebook breaks the authoring conventions."""


def stub(source: str, where: str = "cell") -> str:
    """Replace each BEGIN/END SOLUTION block with a NotImplementedError stub at the same indent."""
    out, inside = [], False
    for line in source.splitlines():
        stripped = line.strip()
        if stripped == BEGIN:
            if inside:
                raise BuildError(f"{where}: nested {BEGIN}")
            indent = line[: len(line) - len(line.lstrip())]
            if not indent:
                raise BuildError(f"{where}: a solution must sit inside a function body, so later cells still run")
            out += [f"{indent}# YOUR CODE HERE", f"{indent}raise NotImplementedError()"]
            inside = True
        elif stripped == END:
            if not inside:
                raise BuildError(f"{where}: {END} without {BEGIN}")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise BuildError(f"{where}: {BEGIN} is never closed")
    return "\n".join(out)


def solution_blocks(source: str) -> list[str]:
    """The text of every solution block in a cell (to prove the learner copy lacks it)."""
    return re.findall(rf"{re.escape(BEGIN)}\n(.*?)\n[ \t]*{re.escape(END)}", source, re.DOTALL)


def script_name(source: str) -> str | None:
    """The exercise name of a `%%writefile [-a] <path>` cell: the file's stem (`{folder}/train.py` -> train); else None."""
    first = source.lstrip().split("\n", 1)[0].split()
    if not first or first[0] != WRITEFILE:
        return None
    paths = [word for word in first[1:] if word not in ("-a", "--append")]
    if len(paths) != 1:
        raise BuildError(f"a {WRITEFILE} exercise needs one file to write, e.g. {WRITEFILE} {{folder}}/train.py")
    stem = PurePosixPath(paths[0].strip("'\"")).stem
    if not stem.isidentifier():
        raise BuildError(f"a {WRITEFILE} exercise is named after its file, so {stem!r} must be a Python name, e.g. train_ddp.py")
    return stem


def exercise_tags(cell) -> list[str]:
    """The tags a code cell should carry: exercise:<name> on solution cells, check:<name> on check cells."""
    if BEGIN in cell.source:
        script = script_name(cell.source)
        if script:
            return [f"exercise:{script}"]
        names = DEF.findall(cell.source)
        if len(names) != 1:
            raise BuildError(f"a solution cell must define exactly one top-level function, found {names or 'none'}")
        return [f"exercise:{names[0]}"]
    checks = CHECK_CALL.findall(cell.source)
    if len(checks) > 1:
        raise BuildError(f"one check per cell, found {checks}")
    return [f"check:{checks[0]}"] if checks else []


def tag_source(nb) -> list[str]:
    """Set the exercise tags on a source notebook in place; return the exercise names in order."""
    exercises, checked = [], []
    for cell in nb.cells:
        if cell.cell_type != "code":
            if BEGIN in cell.source:
                raise BuildError("solution markers belong in code cells only")
            continue
        tags = [t for t in cell.metadata.get("tags", []) if not t.startswith(OWN_TAGS)]
        new = exercise_tags(cell)
        tags += new
        if tags:
            cell.metadata["tags"] = tags
        else:
            cell.metadata.pop("tags", None)
        for tag in new:
            kind, name = tag.split(":")
            (exercises if kind == "exercise" else checked).append(name)
    if sorted(exercises) != sorted(checked):
        raise BuildError(f"every exercise needs exactly one check cell: exercises {exercises}, checks {checked}")
    code = [cell.source.strip() for cell in nb.cells if cell.cell_type == "code"]
    lesson = nb.metadata.get("course", {}).get("lesson") or r"\d\d"
    if exercises and (not code or not re.fullmatch(rf"lesson{lesson}\.scoreboard\(\)", code[-1])):
        raise BuildError(f"the last code cell must show the scoreboard: lesson{nb.metadata.get('course', {}).get('lesson', 'NN')}.scoreboard()")
    return exercises


def learner_copy(nb):
    """A learner copy of a tagged source notebook: stubs instead of solutions, no outputs."""
    learner = copy.deepcopy(nb)
    for i, cell in enumerate(learner.cells):
        if cell.cell_type != "code":
            continue
        cell.source = stub(cell.source, where=f"cell {i}")
        cell.outputs = []
        cell.execution_count = None
        tags = [t for t in cell.metadata.get("tags", []) if not t.startswith(SOURCE_ONLY_TAGS)]
        cell.metadata = {"tags": tags} if tags else {}
    for cell in learner.cells:  # the badges open the learner's copy, not the solution copy
        if publish.BADGES_TAG in cell.metadata.get("tags", []):
            cell.source = publish.learner_badges(cell.source)
    learner.metadata.pop("widgets", None)
    return learner


def execute(nb, path: Path) -> None:
    """Run a notebook top to bottom in its own folder, storing fresh outputs in `nb`.

    The kernel runs as under the checker (COURSE_CHECKER=1), so that the stored outputs are the
    ones nbval compares with: a check prints its PASS line instead of displaying it. Its work
    folder (COURSE_WORK_DIR) is a new empty one, so that what a cell shows of a learner's work
    (lesson 00's progress table) is a fresh clone's, never the builder's own work/. Its CPU kernels
    are those strict nbval pins (course_utils.reproducibility.same_kernels_env).
    """
    import tempfile

    from nbclient import NotebookClient

    from course_utils.reproducibility import same_kernels_env

    with tempfile.TemporaryDirectory(prefix="course-build-work-") as empty, \
            _environment(COURSE_CHECKER="1", COURSE_WORK_DIR=str(Path(empty) / "work"), **same_kernels_env()):
        NotebookClient(
            nb,
            timeout=600,
            kernel_name="python3",
            record_timing=False,
            resources={"metadata": {"path": str(path.parent)}},
        ).execute()
    coalesce_streams(nb)


@contextlib.contextmanager
def _environment(**values: str) -> Iterator[None]:
    """Set environment variables (inherited by the kernel) for the block, then restore them."""
    previous = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def coalesce_streams(nb) -> None:
    """Join each cell's consecutive stdout (or stderr) chunks into one output, as JupyterLab shows them.

    The kernel sends a cell's prints in chunks that depend on timing, so without this a re-run
    splits the same text differently and the committed notebook changes for nothing.
    """
    for cell in nb.cells:
        merged = []
        for out in cell.get("outputs", []):
            last = merged[-1] if merged else None
            if (out.get("output_type") == "stream" and last is not None
                    and last.get("output_type") == "stream" and last.get("name") == out.get("name")):
                last["text"] += out["text"]
            else:
                merged.append(out)
        if "outputs" in cell:
            cell.outputs = merged


def stamp_lesson(nb, source: Path) -> None:
    """Record the lesson's number in the notebook's metadata, where the checker and the grader look first."""
    nb.metadata.setdefault("course", {})["lesson"] = lesson_of_path(source)


def build(sources: list[Path] | None = None, *, run: bool = False) -> list[Path]:
    """Tag each source notebook, refresh its hosted set-up cell and badges, optionally re-execute it, and write its learner copy.

    Returns the learner copies written.
    """
    import nbformat  # imported here: it costs the checker's command line over a second

    written = []
    for source in sources or source_notebooks():
        nb = nbformat.read(source, as_version=4)
        stamp_lesson(nb, source)
        tag_source(nb)
        publish.refresh(nb, source)  # the Colab and Kaggle set-up cell and badges, from pyproject.toml's URL
        write_atomic(source, nbformat.writes(nb) + "\n")  # tagged before it runs: its scoreboard reads the tags
        if run:
            execute(nb, source)
            write_atomic(source, nbformat.writes(nb) + "\n")
        target = learner_path(source)
        write_atomic(target, nbformat.writes(learner_copy(nb)) + "\n")
        written.append(target)
    return written
