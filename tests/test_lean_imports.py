"""course_utils.tooling.lean_imports: every pytest the course starts skips rfc3987_syntax, and still reads notebooks."""

import subprocess
import sys

from course_utils.tooling import runner, timings

PROBE = """
import sys
import course_utils.tooling.lean_imports
import jsonschema, nbformat
nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1")])
nbformat.validate(nb)
bad = nbformat.from_dict({**nb, "cells": [{"cell_type": "code", "source": 1}]})
try:
    nbformat.validate(bad)
except nbformat.ValidationError:
    print("invalid caught")
print("rfc3987_syntax", sys.modules.get("rfc3987_syntax", "absent"))
"""


def test_notebooks_are_still_validated_without_the_grammar():
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["invalid caught", "rfc3987_syntax None"]


def test_the_checker_and_the_timings_load_it_before_nbval(monkeypatch, tmp_path):
    seen = []

    def fake_run(command, **kwargs):
        seen.append(command)
        raise RuntimeError("stop here")

    monkeypatch.setattr(runner, "run_guarded", fake_run)
    try:
        runner.run_checker([tmp_path / "nb.ipynb"])
    except RuntimeError:
        pass
    for command in (seen[0], timings._nbval_command(tmp_path / "nb.ipynb")):
        plugins = [command[i + 1] for i, part in enumerate(command) if part == "-p"]
        assert "course_utils.tooling.lean_imports" in plugins, command


def test_the_courses_own_pytest_runs_load_it_too():
    import tomllib
    from course_utils.tooling.layout import root

    addopts = tomllib.loads((root() / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["addopts"]
    assert "-p course_utils.tooling.lean_imports" in addopts
    assert "rfc3987_syntax" in sys.modules and sys.modules["rfc3987_syntax"] is None
