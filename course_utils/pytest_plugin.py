"""nbval as an exercise checker: registered through the `pytest11` entry point.

What it adds to an nbval run:
- cells tagged `check:<exercise>` or `exercise:<exercise>` are reported by exercise name,
  with a one-line reason when they fail, and summed up in a scoreboard;
- cells tagged `gpu` are skipped, with the reason, when no CUDA device is usable;
- stderr (warnings) never fails an output comparison;
- after a non-exercise cell fails, the rest of that notebook is skipped, not cascaded;
- `--course-strict-warnings` fails a cell that prints a DeprecationWarning or FutureWarning;
- `--course-report FILE` writes the scoreboard as JSON.
"""

import glob
import json
import os
import re
from pathlib import Path

import pytest

CHECK_TAG = "check:"
EXERCISE_TAG = "exercise:"
GPU_TAG = "gpu"
DEPRECATION = re.compile(r"\b(DeprecationWarning|FutureWarning)\b")

_cuda: bool | None = None


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("course", "PyTorch course exercise checker")
    group.addoption("--course-report", metavar="FILE", help="write the exercise scoreboard as JSON to FILE")
    group.addoption(
        "--course-strict-warnings",
        action="store_true",
        help="fail a notebook cell whose output contains a DeprecationWarning or FutureWarning",
    )


def pytest_configure(config: pytest.Config) -> None:
    # notebook path -> {"exercises": {name: {"status", "reason"}}, "stopped_at": None or "Cell N: error"}
    config._course_results = {}
    if config.getoption("course_strict_warnings", False):
        # Kernels start after this and inherit it: show every deprecation, not only __main__'s.
        os.environ["PYTHONWARNINGS"] = "default::DeprecationWarning,default::FutureWarning"


def _is_cell(item: pytest.Item) -> bool:
    return type(item).__name__ == "IPyNbCell" and hasattr(item, "cell")


def _tag(item: pytest.Item, prefix: str) -> str | None:
    for tag in item.cell.metadata.get("tags", []):
        if tag.startswith(prefix):
            return tag[len(prefix):]
    return None


def _cuda_available() -> bool:
    global _cuda
    if _cuda is None:
        # Importing torch costs the checker ~2 s; without an NVIDIA device node (or WSL's
        # /dev/dxg) there is no CUDA anyway, so look for one first.
        if not glob.glob("/dev/nvidia[0-9]*") and not os.path.exists("/dev/dxg"):
            _cuda = False
        else:
            from course_utils.device import cuda_available

            _cuda = cuda_available()
    return _cuda


def _drop_stderr(outputs: list) -> list:
    return [o for o in outputs if not (o.get("output_type") == "stream" and o.get("name") == "stderr")]


def _rename(item: pytest.Item, name: str) -> None:
    item.name = name
    if hasattr(item.parent, "id"):  # pytest >= 9 keeps a structured node id
        item._id = item.parent.id.child(name)
    else:
        item._nodeid = f"{item.parent.nodeid}::{name}"
    description = f"{item.parent.name}::{name}"
    item.reportinfo = lambda: (item.path, 0, description)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if not _is_cell(item):
            continue
        original_compare = item.compare_outputs
        item.compare_outputs = lambda test, ref, skip=None, _cmp=original_compare: _cmp(_drop_stderr(test), _drop_stderr(ref), skip)
        check = _tag(item, CHECK_TAG)
        code = _tag(item, EXERCISE_TAG)
        if check:
            item.course_exercise = check
            _rename(item, f"check {check}")
            _results(item).setdefault(check, {"status": "not run", "reason": "the check cell did not run"})
        elif code:
            item.course_exercise = code
            _rename(item, f"exercise {code} (your code)")
        if GPU_TAG in item.cell.metadata.get("tags", []):
            item.options["check"] = False  # CPU and GPU runs print different things
            if not _cuda_available():
                item.add_marker(pytest.mark.skip(reason="GPU cell: no usable CUDA device on this machine"))


def _notebook(item: pytest.Item) -> dict:
    return item.config._course_results.setdefault(str(item.parent.path), {"exercises": {}, "stopped_at": None})


def _results(item: pytest.Item) -> dict:
    return _notebook(item)["exercises"]


def pytest_runtest_setup(item: pytest.Item) -> None:
    if _is_cell(item):
        broken = getattr(item.parent, "course_broken", None)
        if broken:
            pytest.skip(f"not run: {broken} failed earlier in this notebook")


def _error_line(item: pytest.Item) -> str:
    for out in reversed(item.test_outputs or []):
        if out.get("output_type") == "error":
            lines = str(out["evalue"]).strip().splitlines()
            return f"{out['ename']}: {lines[0]}" if lines else out["ename"]
    return getattr(item, "course_warning", None) or "its outputs differ from the saved ones"


def _exercise_message(item: pytest.Item) -> tuple[str, str]:
    """(status, reason) for a failed exercise cell, from the error the kernel sent back."""
    for out in reversed(item.test_outputs or []):
        if out.get("output_type") == "error":
            reason = str(out["evalue"]).strip().splitlines()[0] if str(out["evalue"]).strip() else out["ename"]
            prefix = f"{item.course_exercise}: "
            reason = reason[len(prefix):] if reason.startswith(prefix) else reason
            if out["ename"] == "ExerciseNotAttempted":
                return "not attempted", reason
            if out["ename"] == "ExerciseFailed":
                return "failed", reason
            return "failed", f"{out['ename']}: {reason}"
    return "failed", getattr(item, "course_warning", None) or "cell outputs differ from the saved ones"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    if not _is_cell(item) or call.when != "call":
        return report
    if report.passed and item.config.getoption("course_strict_warnings"):
        stderr = "".join(o.get("text", "") for o in item.test_outputs or [] if o.get("name") == "stderr")
        match = DEPRECATION.search(stderr)
        if match:
            report.outcome = "failed"
            line = next(l for l in stderr.splitlines() if match.group(0) in l)
            item.course_warning = f"printed a {match.group(0)} (--course-strict-warnings): {line.strip()}"
            report.longrepr = f"{item.name} {item.course_warning}"
    exercise = getattr(item, "course_exercise", None)
    is_check = _tag(item, CHECK_TAG) is not None
    if report.failed and exercise:
        status, reason = _exercise_message(item)
        report.longrepr = f"{exercise} {status}: {reason}"
        results = _results(item)
        if is_check:
            previous = results.get(exercise, {})
            if previous.get("status") == "failed" and previous.get("from_code"):
                status, reason = "failed", previous["reason"]
            results[exercise] = {"status": status, "reason": reason}
        else:
            results[exercise] = {"status": "failed", "reason": f"your code cell raised {reason}", "from_code": True}
    elif report.failed and getattr(item, "course_warning", None):
        pass  # the report names the warning; the kernel's state is intact, so the notebook goes on
    elif report.failed:
        item.parent.course_broken = item.name
        _notebook(item)["stopped_at"] = f"{item.name}: {_error_line(item)}"
        report.longrepr = f"{item.name} failed ({_error_line(item)}); the rest of this notebook is skipped\n\n{report.longrepr}"
    elif report.passed and is_check:
        _results(item)[exercise] = {"status": "passed", "reason": ""}
    return report


SYMBOL = {"passed": "PASS", "not attempted": "TODO", "failed": "FAIL", "not run": "SKIP"}


def scoreboard_lines(results: dict[str, dict]) -> list[str]:
    """Human-readable scoreboard: one line per exercise, and a total per notebook."""
    lines = []
    for notebook, result in results.items():
        exercises = result["exercises"]
        if not exercises and not result["stopped_at"]:
            continue
        lines.append(Path(notebook).name)
        width = max((len(name) for name in exercises), default=0)
        counts: dict[str, int] = {}
        for name, verdict in exercises.items():
            counts[verdict["status"]] = counts.get(verdict["status"], 0) + 1
            lines.append(f"  {SYMBOL[verdict['status']]}  {name:{width}}  {verdict['reason']}".rstrip())
        total = ", ".join(f"{counts.get(s, 0)} {s}" for s in ("passed", "not attempted", "failed"))
        extra = f", {counts['not run']} not run" if counts.get("not run") else ""
        lines.append(f"  {len(exercises)} exercises: {total}{extra}")
        if result["stopped_at"]:
            lines.append(f"  stopped early: {result['stopped_at']} (not an exercise); the cells after it did not run")
    return lines


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    results = {
        path: {
            "exercises": {name: {"status": v["status"], "reason": v["reason"]} for name, v in nb["exercises"].items()},
            "stopped_at": nb["stopped_at"],
        }
        for path, nb in config._course_results.items()
    }
    path = config.getoption("course_report")
    if path:
        Path(path).write_text(json.dumps(results, indent=2))
    lines = scoreboard_lines(results)
    if lines:
        terminalreporter.section("exercise scoreboard")
        for line in lines:
            terminalreporter.line(line)
