"""The command line, `python -m course_utils build|check`: help, and finding a lesson's notebook."""

import subprocess
import sys

import pytest

from course_utils.__main__ import find_notebook, main


@pytest.mark.parametrize("command, words", [("build", ["--execute", "lessons"]), ("check", ["--solutions", "lesson"])])
def test_help_exits_zero(command, words):
    result = subprocess.run([sys.executable, "-m", "course_utils", command, "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: python -m course_utils {command}")
    for word in words:
        assert word in result.stdout


def test_no_command_is_an_error(capsys):
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2
    assert "required" in capsys.readouterr().err


@pytest.mark.parametrize("lesson", ["99", "abc", ""])
def test_find_notebook_unknown_lesson(lesson):
    with pytest.raises(SystemExit, match=rf"no lesson '{lesson}': give a number such as 01"):
        find_notebook(lesson)


def test_find_notebook_missing_path(tmp_path):
    with pytest.raises(SystemExit, match="no such notebook"):
        find_notebook(str(tmp_path / "nope.ipynb"))


def test_find_notebook_existing_path(tmp_path):
    path = tmp_path / "mine.ipynb"
    path.write_text("{}")
    assert find_notebook(str(path)) == path


def test_find_notebook_by_number():
    """'1' and '01' name the same lesson; the learner copy sits one folder above its source."""
    source = find_notebook("1", solutions=True)
    assert source.name.startswith("01_") and source.parent.name == "solutions"
    assert find_notebook("01") == source.parent.parent / source.name
