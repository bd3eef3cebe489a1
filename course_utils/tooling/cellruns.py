"""Which cells raised the last time they ran, so that a check can say so instead of judging a stale function.

When an exercise's cell raises (a SyntaxError from a missing bracket, a NameError in a line
after the `def`), the kernel keeps what it had before, usually the untouched stub, and a check
run next would judge that and say "not attempted". `%load_ext course_utils` registers
`after_cell` as IPython's `post_run_cell` callback: IPython hands it each cell's source and the
error its run raised (the ExecutionResult), nothing is guessed. For every function or class the
cell defines at its top level, a failed run is kept with what the name is bound to right after
it; a run that succeeds forgets it. A name the failed run left undefined (the cell never ran
without error) is bound to a stand-in that raises the cell's message, so that its check cell does
not stop at a bare NameError. A check given that very object reports the failed cell ("your cell
for `draw` raised SyntaxError at line 2 ...") instead of judging it, in JupyterLab and under the
checker alike. Only a failure can come of this: a record never makes a pass.

The checker's plugin runs outside the kernel and words an exercise cell's own error the same
way, from the error output the kernel sent back (`message_from_output`).
"""

import functools
import re
from dataclasses import dataclass, field
from typing import Any

from course_utils.tooling.language import LOCALES, N_, _, catalog

DEFINES = re.compile(r"^(?:async[ \t]+def|def|class)[ \t]+([A-Za-z_]\w*)", re.M)
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
CELL_LINE = re.compile(r"Cell In\[(\d+)\], line (\d+)")  # how IPython names a cell's line in a traceback
SYNTAX_WHERE = re.compile(r"^(?P<detail>.*) \([^()]*, line (?P<line>\d+)\)$", re.S)  # str(SyntaxError) ends "(file, line N)"
UNBOUND = object()  # the failed cell's name was not defined at all afterwards
RAISED_AT = N_("your cell for `{name}` raised {error} at line {line}{detail}: fix it and run that cell again")
RAISED = N_("your cell for `{name}` raised {error}{detail}: fix it and run that cell again")


@functools.cache
def prefixes() -> tuple[str, ...]:
    """How a cell's failure message starts, in English and in each translation ("your cell for `", ...).

    The checker's plugin tells by it that a check's reason names a cell that raised, whatever the language the
    notebook's kernel said it in. A translation that starts with the name (or its opening `) gives no prefix.
    """
    found = []
    for message in (RAISED_AT, RAISED):
        for text in (message, *(catalog(lang).gettext(message) for lang in LOCALES)):
            head = text.split("{name}")[0]
            if len(head.strip()) >= 2 and head not in found:
                found.append(head)
    return tuple(found)


@dataclass(frozen=True)
class CellFailure:
    """A cell that defines `name` raised `error` at `line` of the cell (None when unknown) the last time it ran."""

    name: str
    error: str
    line: int | None
    detail: str
    value: Any = field(default=UNBOUND, compare=False, repr=False)

    def message(self) -> str:
        return failure_message(self.name, self.error, self.line, self.detail)


_failures: dict[str, CellFailure] = {}


def failure_message(name: str, error: str, line: int | None, detail: str = "") -> str:
    """"your cell for `draw` raised SyntaxError at line 2 (incomplete input): fix it and run that cell again"."""
    detail = " ".join(detail.split())
    detail = f"{detail[:117]}..." if len(detail) > 120 else detail
    detail = _(" ({detail})").format(detail=detail) if detail else ""
    if line:
        return _(RAISED_AT).format(name=name, error=error, line=line, detail=detail)
    return _(RAISED).format(name=name, error=error, detail=detail)


def watch(shell: Any) -> None:
    """Register after_cell with IPython once (a second `%load_ext` or a `%reload_ext` adds no second one)."""
    callbacks = shell.events.callbacks.get("post_run_cell", [])
    for callback in list(callbacks):
        if getattr(callback, "__module__", None) == __name__ and getattr(callback, "__name__", None) == "after_cell":
            shell.events.unregister("post_run_cell", callback)
    shell.events.register("post_run_cell", after_cell)


def after_cell(result: Any) -> None:
    """IPython's post_run_cell callback: keep or forget a failure for each name the cell defines."""
    try:
        _after_cell(result)
    except Exception:  # noqa: BLE001 -- bookkeeping must never add an error to the learner's cell
        pass


def _after_cell(result: Any) -> None:
    names = DEFINES.findall(getattr(result.info, "raw_cell", None) or "")
    if not names:
        return
    error = result.error_before_exec or result.error_in_exec
    if error is None:
        for name in names:
            _failures.pop(name, None)
        return
    namespace = _user_namespace()
    line, detail = where(error)
    for name in names:
        failure = CellFailure(name, type(error).__name__, line, detail)
        value = namespace.get(name, UNBOUND)
        if value is UNBOUND:  # its first run failed: the check cell would meet a bare NameError
            value = namespace[name] = stand_in(failure)
        _failures[name] = CellFailure(name, failure.error, line, detail, value)


class CellRaised(Exception):
    """What the stand-in for a name that a failed cell could not define raises when it is called."""


def stand_in(failure: CellFailure) -> Any:
    """A function bound to `failure.name` until its cell runs without error: it raises that cell's message when
    called, and a check handed it reports the cell's failure, in JupyterLab as under the checker."""
    message = failure.message()

    def cell_raised(*args: Any, **kwargs: Any) -> Any:
        raise CellRaised(message)

    cell_raised.__name__ = cell_raised.__qualname__ = failure.name
    return cell_raised


def _user_namespace() -> dict:
    from IPython import get_ipython

    return get_ipython().user_ns


def where(error: BaseException) -> tuple[int | None, str]:
    """(line of the cell, what the error says) for an error raised by a cell's run."""
    if isinstance(error, SyntaxError):
        return error.lineno, error.msg or ""
    detail = str(error).strip().splitlines()
    tb, cell_file, line = error.__traceback__, None, None
    while tb is not None:  # IPython's run_code first, then the cell's own <module> frame, then what it called
        code = tb.tb_frame.f_code
        if cell_file is None and code.co_name == "<module>":
            cell_file = code.co_filename
        if cell_file is not None and code.co_filename == cell_file:
            line = tb.tb_lineno  # the innermost line in this cell, in a function it defines too
        tb = tb.tb_next
    return line, detail[0] if detail else ""


def failure_for(value: Any) -> CellFailure | None:
    """The failure of a cell whose failed run left `value` (or the class of `value`) bound to a name it defines."""
    for failure in _failures.values():
        if failure.value is not UNBOUND and (failure.value is value or failure.value is type(value)):
            return failure
    return None


def failure_of_unbound(name: str, namespace: dict) -> CellFailure | None:
    """The failure of the cell that was to define `name`, when its failed run left the name undefined."""
    failure = _failures.get(name)
    return failure if failure is not None and failure.value is UNBOUND and name not in namespace else None


def message_from_output(name: str, output: dict) -> str:
    """failure_message for an exercise cell's error output as the kernel sent it (ename, evalue, traceback)."""
    text = str(output.get("evalue", "")).strip()
    detail = text.splitlines()[0] if text else ""
    line = None
    if output.get("ename") in ("SyntaxError", "IndentationError", "TabError"):
        match = SYNTAX_WHERE.match(text)
        if match:  # "incomplete input (3080951878.py, line 2)": the file is IPython's, the line the cell's
            detail, line = match.group("detail"), int(match.group("line"))
    traceback = ANSI.sub("", "\n".join(map(str, output.get("traceback") or [])))
    cells = CELL_LINE.findall(traceback)
    if cells:  # the first is the cell that ran; its innermost line is the last with the same number
        line = int([ln for n, ln in cells if n == cells[0][0]][-1])
    return failure_message(name, str(output.get("ename", "an error")), line, detail)
