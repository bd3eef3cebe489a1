"""A lesson's study time, estimated from its notebook by one stated method, for its core path and for the whole.

The method (the README's course map states it too):

- **prose**: every word of the markdown cells, at `WORDS_PER_MINUTE` (technical text read with care,
  about half the speed of ordinary reading);
- **demo code**: every non-blank line of the code cells that are not exercises or checks, at
  `CODE_LINES_PER_MINUTE` (read, run, and compare with what it prints);
- **exercises**: `EXERCISE_MINUTES` each, for writing, checking and fixing (their prompts are prose,
  counted above);

rounded up to 5 minutes. Outputs are not counted, whether a cell printed them or they were recorded
on a GPU and shown in a markdown cell tagged `RECORDED_TAG` beside their `gpu` cell. The **core path** leaves out every section whose heading says *going further*
(from that heading to the next heading of the same or a higher level), with the exercises in it.
A lesson keeps its core at `CORE_LIMIT_MINUTES` or less.

`python -m course_utils.tooling.studytime [NOTEBOOK ...]` prints both estimates and the line the
lesson's first cell must carry; `--write` puts that line into each notebook's first cell (then run
`python -m course_utils build` for the learner copies).
"""

import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import nbformat

from course_utils.tooling.publish import PLUMBING_TAGS

WORDS_PER_MINUTE = 110
CODE_LINES_PER_MINUTE = 8
EXERCISE_MINUTES = 12
CORE_LIMIT_MINUTES = 90
GOING_FURTHER = re.compile(r"going further", re.IGNORECASE)
HEADING = re.compile(r"^(#{1,6})\s+(.*)$")
RECORDED_TAG = "gpu-recorded"  # a gpu cell's output from the course's GPU run, shown where a CPU cannot make it


@dataclass(frozen=True)
class Estimate:
    """Minutes for the core path and for the whole lesson, with what they were counted from."""

    core: int
    whole: int
    words: tuple[int, int]  # core, whole
    code_lines: tuple[int, int]
    exercises: tuple[int, int]


def _round_up(minutes: float) -> int:
    return max(5, 5 * math.ceil(minutes / 5 - 1e-9))


def _is_exercise(cell) -> bool:
    return any(t.startswith(("exercise:", "check:")) for t in cell.metadata.get("tags", []))


def _words(markdown: str) -> int:
    text = re.sub(r"<!--.*?-->", " ", markdown, flags=re.DOTALL)
    return len(re.findall(r"[\w`'’.-]+", text))


def core_flags(nb) -> list[bool]:
    """For each cell, whether it lies on the core path (outside every *going further* section)."""
    flags, skipping_from = [], None  # the level of the going-further heading we are inside, if any
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            # A cell's first heading decides where the cell itself belongs; later headings in it move the state on.
            headings = [HEADING.match(line) for line in cell.source.splitlines()]
            headings = [(len(m.group(1)), m.group(2)) for m in headings if m]
            in_core = None
            for level, title in headings:
                if skipping_from is not None and level <= skipping_from:
                    skipping_from = None
                if skipping_from is None and GOING_FURTHER.search(title):
                    skipping_from = level
                if in_core is None:
                    in_core = skipping_from is None
            flags.append(in_core if in_core is not None else skipping_from is None)
        else:
            flags.append(skipping_from is None)
    return flags


def estimate(nb) -> Estimate:
    """The study-time estimate of a notebook (an nbformat node), by the method in this module's docstring."""
    words, lines, exercises = [0, 0], [0, 0], [0, 0]
    for cell, core in zip(nb.cells, core_flags(nb)):
        if any(t in (*PLUMBING_TAGS, RECORDED_TAG) for t in cell.metadata.get("tags", [])):
            continue  # the Colab set-up cell and the badges are plumbing; a recorded GPU output is an output
        parts = (0, 1) if core else (1,)
        for i in parts:
            if cell.cell_type == "markdown":
                words[i] += _words(cell.source)
            elif cell.cell_type == "code" and _is_exercise(cell):
                exercises[i] += any(t.startswith("exercise:") for t in cell.metadata.get("tags", []))
            elif cell.cell_type == "code":
                lines[i] += sum(1 for line in cell.source.splitlines() if line.strip())
    minutes = [words[i] / WORDS_PER_MINUTE + lines[i] / CODE_LINES_PER_MINUTE + exercises[i] * EXERCISE_MINUTES
               for i in (0, 1)]
    return Estimate(_round_up(minutes[0]), _round_up(minutes[1]), tuple(words), tuple(lines), tuple(exercises))


def shown(minutes: int) -> str:
    """'45 min', '1 h 30 min' or '2 h'."""
    hours, rest = divmod(minutes, 60)
    return f"{hours} h {rest} min" if hours and rest else f"{hours} h" if hours else f"{rest} min"


def statement(est: Estimate) -> str:
    """The sentence a lesson's first cell carries, word for word."""
    if est.core == est.whole:
        return f"Estimated study time: about {shown(est.whole)} (the whole lesson is its core path)."
    return f"Estimated study time: about {shown(est.core)} for the core path, {shown(est.whole)} with every section."


STATED = re.compile(r"^.*Estimated study time.*$", re.MULTILINE)


def first_markdown(nb):
    """The lesson's first markdown cell, where its objectives and study time are stated."""
    return next(c for c in nb.cells if c.cell_type == "markdown")


def restate(path: Path) -> bool:
    """Rewrite the study-time line of a notebook's first cell from its estimate; True when the file changed."""
    nb = nbformat.read(path, as_version=4)
    cell = first_markdown(nb)
    before = cell.source
    if not STATED.search(before):
        raise ValueError(f"{path.name}: its first markdown cell has no 'Estimated study time' line to rewrite")
    for _ in range(3):  # the line's own words count too: settle on a fixed point
        cell.source = STATED.sub(lambda _: statement(estimate(nb)), cell.source, count=1)
    if cell.source == before:
        return False
    nbformat.write(nb, path)
    return True


def main(args: list[str]) -> int:
    from course_utils.tooling.layout import source_notebooks

    write = "--write" in args
    paths = [Path(a) for a in args if a != "--write"] or source_notebooks()
    for path in paths:
        if write and restate(path):
            print(f"rewrote the study-time line of {path.name}")
        est = estimate(nbformat.read(path, as_version=4))
        over = "  (core over the limit!)" if est.core > CORE_LIMIT_MINUTES else ""
        print(f"{path.name}: core {est.core} min, whole {est.whole} min; words {est.words}, demo code lines "
              f"{est.code_lines}, exercises {est.exercises}{over}\n  {statement(est)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
