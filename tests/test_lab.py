"""course_utils.tooling.lab: the JupyterLab command line the course starts with (the browser test opens it)."""

import os
import sys
from pathlib import Path

from course_utils.tooling import lab
from course_utils.tooling.layout import root


def test_lab_opens_lesson_00_from_the_course_folder(monkeypatch):
    monkeypatch.delenv("COURSE_WORK_DIR", raising=False)
    command, _ = lab.lab_command()
    assert command[:3] == [sys.executable, "-m", "jupyterlab"]
    assert f"--ServerApp.root_dir={root().resolve()}" in command  # the file browser shows README.md, data/, work/
    assert "--LabApp.default_url=/lab/tree/work/00_orientation.ipynb" in command


def test_lab_with_work_elsewhere(monkeypatch, tmp_path):
    monkeypatch.setenv("COURSE_WORK_DIR", str(tmp_path / "mine"))
    command, _ = lab.lab_command()
    assert f"--ServerApp.root_dir={tmp_path.resolve()}" in command
    assert "--LabApp.default_url=/lab/tree/mine/00_orientation.ipynb" in command


def test_course_settings_and_python_come_first(monkeypatch):
    monkeypatch.setenv("JUPYTER_CONFIG_PATH", "/elsewhere")
    _, env = lab.lab_command()
    assert env["JUPYTER_CONFIG_PATH"].split(os.pathsep) == [str(root() / ".jupyter"), "/elsewhere"]
    assert env["PATH"].split(os.pathsep)[0] == str(Path(sys.executable).parent)  # a JupyterLab terminal finds the course's python


def test_news_pop_up_is_off_in_the_course_settings():
    import json

    overrides = json.loads((root() / ".jupyter" / "labconfig" / "default_setting_overrides.json").read_text())
    assert overrides["@jupyterlab/apputils-extension:notification"]["fetchNews"] == "false"


def test_allow_root_only_as_root(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert "--allow-root" in lab.lab_command()[0]
    assert lab.lab_command(["--allow-root"])[0].count("--allow-root") == 1
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "--allow-root" not in lab.lab_command()[0]


def test_extra_options_go_to_jupyter(monkeypatch):
    """`python -m course_utils lab --port=8889 --no-browser` passes both on; other commands still refuse unknown options."""
    from course_utils.tooling import cli

    seen = {}
    monkeypatch.setattr(lab, "main", lambda extra: seen.setdefault("extra", extra) and 0)
    assert cli.main(["lab", "--port=8889", "--no-browser"]) == 0
    assert seen["extra"] == ["--port=8889", "--no-browser"]
    try:
        cli.main(["progress", "--port=1"])
    except SystemExit as exit_:
        assert exit_.code == 2
    else:
        raise AssertionError("progress accepted an unknown option")


def test_a_python_without_the_course_packages_gets_one_line(monkeypatch, capsys):
    """A bare `python` in a JupyterLab terminal may be another Python: one line says which to use, no traceback."""
    from course_utils.tooling import cli

    def missing(args):
        raise ModuleNotFoundError("No module named 'torch'", name="torch")

    monkeypatch.setattr(cli, "_run", missing)
    assert cli.main(["progress"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has no torch" in err and "`.venv/bin/python -m course_utils ...`" in err
