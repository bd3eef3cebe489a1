"""course_utils.tooling.opentabs: `reset` and `restore` ask a real running Jupyter server whether the notebook is open."""

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import psutil
import pytest

from course_utils.tooling import cli, layout, opentabs, workspace

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`jupyter server` on the course's work folder, in a runtime folder of its own; no process of it outlives the tests.

    Its one session has lesson 01 open, with a kernel that only sleeps (the sessions API needs a
    kernel; a real one costs seconds and is not what is tested here).
    """
    base = tmp_path_factory.mktemp("opentabs")
    (base / "work").mkdir()
    kernel = base / "jupyter" / "kernels" / "sleeper"
    kernel.mkdir(parents=True)
    (kernel / "kernel.json").write_text(json.dumps(
        {"argv": [sys.executable, "-c", "import time; time.sleep(300)", "{connection_file}"], "display_name": "sleeper", "language": "python"}))
    port, token = free_port(), secrets.token_hex(16)
    env = {k: v for k, v in os.environ.items() if k not in ("COURSE_CHECKER", "PYTEST_ADDOPTS")}
    env |= {"JUPYTER_RUNTIME_DIR": str(base / "runtime"), "JUPYTER_PATH": str(base / "jupyter"), "JUPYTER_CONFIG_DIR": str(base / "config")}
    # No extension is needed to answer /api/sessions: without them it starts in a fraction of the time.
    off = {name: False for name in ("jupyterlab", "jupyter_lsp", "notebook_shim", "jupyter_server_terminals")}
    (base / "config").mkdir()
    (base / "config" / "jupyter_server_config.json").write_text(json.dumps({"ServerApp": {"jpserver_extensions": off}}))
    command = [sys.executable, "-m", "jupyter_server", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
               f"--ServerApp.token={token}", f"--ServerApp.root_dir={base}"]
    if os.geteuid() == 0:
        command.append("--allow-root")
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True, env=env)
    tracked = [psutil.Process(process.pid)]
    try:
        deadline = time.monotonic() + 60
        while not list((base / "runtime").glob("jpserver-*.json")):
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"jupyter server did not start: {process.stderr.read().decode()[-2000:]}")
            time.sleep(0.2)
        url = f"http://127.0.0.1:{port}/api/sessions"
        body = json.dumps({"path": "work/01_tensors.ipynb", "type": "notebook", "name": "", "kernel": {"name": "sleeper"}})
        request = urllib.request.Request(url, data=body.encode(), method="POST", headers={"Authorization": f"token {token}"})
        urllib.request.urlopen(request, timeout=30).close()
        tracked += tracked[0].children(recursive=True)  # the kernel runs in a session of its own
        yield {"base": base, "runtime": base / "runtime", "url": url}
    finally:
        tracked += [c for c in tracked[0].children(recursive=True) if c not in tracked] if tracked[0].is_running() else []
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        gone, alive = psutil.wait_procs(tracked, timeout=10)
        for proc in alive:
            proc.kill()
        assert not alive, f"processes left behind by jupyter server: {[p.pid for p in alive]}"


@pytest.fixture
def work(server, monkeypatch):
    """The server's work folder with a learner's lesson 00 and 01, each edited; the learner's runtime folder is the server's."""
    folder = server["base"] / "work"
    monkeypatch.setenv("COURSE_WORK_DIR", str(folder))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(server["runtime"]))
    for lesson in ("00", "01"):
        path = folder / layout.source_for(lesson).name
        path.write_text(layout.learner_path(layout.source_for(lesson)).read_text().replace('"cells": [', '"cells": [{"cell_type": "markdown", "metadata": {}, "source": "mine"},', 1))
    return folder


ADVICE = "use File → Reload Notebook from Disk in its tab (or close it without saving): saving that tab would undo this"


def test_the_server_says_which_notebook_is_open(work):
    opened = opentabs.ask(work / "01_tensors.ipynb")
    assert len(opened.open_in) == 1 and opened.open_in[0].startswith("http://") and not opened.unknown
    assert opentabs.ask(work / layout.source_for("00").name) == opentabs.Answer([], False)


@pytest.mark.parametrize("command", ["reset", "restore"])
def test_reset_and_restore_refuse_in_one_line_while_the_notebook_is_open(work, capsys, command):
    path = work / "01_tensors.ipynb"
    if command == "restore":
        workspace.backup(path)
    before, backups = path.read_bytes(), sorted(workspace.backups_of("01"))
    assert cli.main([command, "01"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {path} is open in JupyterLab (http://")
    assert f"close its tab, then run `{command} 01` again; or run it with --force, then use File → Reload Notebook from Disk in that tab" in err
    assert path.read_bytes() == before and sorted(workspace.backups_of("01")) == backups  # nothing written, nothing backed up


def test_force_goes_ahead_and_says_to_reload_the_tab(work, capsys):
    path = work / "01_tensors.ipynb"
    assert cli.main(["reset", "01", "--force"]) == 0
    out = capsys.readouterr().out
    assert path.read_bytes() == layout.learner_path(layout.source_for("01")).read_bytes()
    assert out.splitlines()[-1] == f"if {path} is open in JupyterLab, {ADVICE} reset"


def test_a_notebook_no_server_has_open_is_reset_without_advice(work, capsys):
    assert cli.main(["reset", "00"]) == 0
    assert "Reload Notebook" not in capsys.readouterr().out


def test_where_no_server_can_be_asked_the_advice_comes_after_writing(work, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path))  # no server here: a JupyterLab elsewhere cannot be asked
    assert cli.main(["reset", "00"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith(f"{ADVICE} reset")
    stale = json.loads(next(work.parent.glob("runtime/jpserver-*.json")).read_text()) | {"url": "http://127.0.0.1:9/"}
    (tmp_path / "jpserver-1.json").write_text(json.dumps(stale | {"pid": os.getpid()}))  # one that does not answer
    assert opentabs.ask(work / "01_tensors.ipynb").unknown
