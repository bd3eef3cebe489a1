"""What the checker runs in place of a learner's check cell: the course's own check, on the learner's function.

Under nbval with the course's plugin, each check cell's text is replaced by a call of `run`. It
evaluates the check cell as the course's copy of the lesson writes it, against a fresh copy of
the lesson's module loaded from its file. So a learner's cell that rebinds `lesson01`,
reassigns `lesson01.check_linear`, or edits its check cell cannot change the verdict: only the
learner's functions, looked up by name in their namespace, come from the notebook.
"""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from course_utils.tooling import checks
from course_utils.tooling.layout import exercises

_FRESH: dict[str, tuple[tuple[float, float], ModuleType]] = {}


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fresh_lesson(lesson: str) -> ModuleType:
    """lessonNN as its file defines it, with a fresh copy of the checks it imports (cached while neither file changes)."""
    package = Path(checks.__file__).resolve().parents[1]
    lesson_path, checks_path = package / f"lesson{lesson}.py", package / "tooling" / "checks.py"
    stamp = (lesson_path.stat().st_mtime, checks_path.stat().st_mtime)
    cached = _FRESH.get(lesson)
    if cached and cached[0] == stamp:
        return cached[1]
    names = ("course_utils.tooling.checks", f"course_utils.lesson{lesson}")
    saved = {name: sys.modules.get(name) for name in names}
    try:
        # The lesson's `from course_utils.tooling.checks import ...` must find the fresh checks.
        sys.modules[names[0]] = fresh_checks = _load(names[0], checks_path)
        sys.modules[names[1]] = module = _load(names[1], lesson_path)
    finally:
        for name, original in saved.items():
            if original is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = original
    module._fresh_checks = fresh_checks
    _FRESH[lesson] = (stamp, module)
    return module


def run(lesson: str, exercise: str, namespace: dict) -> None:
    """Run the course's check cell of `exercise` against the learner's namespace."""
    (wanted,) = [e for e in exercises(lesson) if e.name == exercise]
    module = fresh_lesson(lesson)
    scope = {**namespace, f"lesson{lesson}": module}
    code = compile(wanted.check_source, f"<course check {exercise}>", "exec")
    try:
        exec(code, scope)
    except NameError as err:
        # The check cell names the learner's function; a NameError here means it was never defined.
        verdict = checks.Verdict(exercise, "failed", f"{err.name} is not defined: run the cell that defines it (was it renamed or deleted?)")
        from course_utils.tooling.progress import record

        record(lesson, verdict)
        module._fresh_checks.report(verdict)
