"""course_utils.tooling.runner: an interrupted or killed checker leaves no pytest, kernel or process of theirs behind."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook

from course_utils.tooling.runner import descendants, guarded

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the clean-up uses Linux's prctl and /proc")]


def alive(pid: int) -> bool:
    """True while pid is a process that has not exited (a zombie has exited)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_gone(pids, seconds: float = 15) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.2)
    return [p for p in pids if alive(p)]


def wait_for(path: Path, seconds: float = 90) -> str:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text()
        time.sleep(0.2)
    raise AssertionError(f"{path} never appeared")


def test_a_guarded_child_dies_with_its_parent():
    code = (
        "import subprocess, sys, time\n"
        "from course_utils.tooling.runner import guarded\n"
        "child = subprocess.Popen(guarded(['sleep', '120']))\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    assert alive(child)
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    assert wait_gone([child], 5) == []


def test_guarded_leaves_the_command_as_it_is():
    result = subprocess.run(guarded([sys.executable, "-c", "import sys; print(sys.argv[1:])", "a b", "c"]), capture_output=True, text=True)
    assert result.stdout.strip() == "['a b', 'c']"


def test_run_guarded_kills_what_its_command_left_behind():
    """A process the command started in a session of its own, and then left running, is killed too."""
    code = (
        "import sys\n"
        "from course_utils.tooling.runner import run_guarded\n"
        "inner = \"import subprocess; p = subprocess.Popen(['sleep', '120'], start_new_session=True); print(p.pid)\"\n"
        "print(run_guarded([sys.executable, '-c', inner]).stdout.strip())\n"
    )
    orphan = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout)
    assert wait_gone([orphan], 5) == []


def hanging_notebook(tmp_path: Path, with_orphan: bool) -> Path:
    """A notebook whose second cell records the kernel's pid (and maybe starts a detached process), then hangs."""
    cell = (
        "import os, subprocess, time\n"
        + ("orphan = subprocess.Popen(['sleep', '300'], start_new_session=True).pid\n" if with_orphan else "orphan = None\n")
        + "open('pids.json', 'w').write(__import__('json').dumps({'kernel': os.getpid(), 'orphan': orphan}))\n"
        + "time.sleep(300)\n"
    )
    nb = new_notebook(cells=[new_code_cell("x = 1"), new_code_cell(cell)])
    path = tmp_path / "hang.ipynb"
    nbformat.write(nb, path)
    return path


def start_checker(notebook: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("COURSE_CHECKER", "PYTEST_ADDOPTS")}
    return subprocess.Popen([sys.executable, "-m", "course_utils", "check", str(notebook)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)


def test_a_checker_killed_with_sigkill_leaves_no_pytest_or_kernel(tmp_path):
    checker = start_checker(hanging_notebook(tmp_path, with_orphan=False))
    pids = json.loads(wait_for(tmp_path / "pids.json"))
    below = descendants(checker.pid)
    assert pids["kernel"] in below and len(below) >= 2  # pytest and the kernel at least
    os.kill(checker.pid, signal.SIGKILL)
    checker.wait()
    assert wait_gone(below) == [], "left running after the checker was killed"


def test_ctrl_c_stops_the_checker_and_everything_below_it(tmp_path):
    """Ctrl-C in a terminal sends SIGINT to the foreground group: the checker says so in one line and cleans up."""
    checker = start_checker(hanging_notebook(tmp_path, with_orphan=True))
    pids = json.loads(wait_for(tmp_path / "pids.json"))
    below = descendants(checker.pid)
    os.killpg(checker.pid, signal.SIGINT)
    out, err = checker.communicate(timeout=60)
    assert checker.returncode == 130, (out, err)
    assert err.strip().startswith("interrupted: ") and "Traceback" not in err
    assert wait_gone([*below, pids["orphan"]]) == []


# ---------------------------------------------------------------- the fake fail of a class graded with --jobs 2

# Loaded into the checker through PYTEST_PLUGINS: the moment jupyter_client picks the kernel's IOPub port
# (its second pick: shell, iopub, stdin, hb, control), another process takes it, as a checker starting at
# the same moment could (jupyter_client issue #487). Over TCP the kernel then hangs, alive but silent,
# until nbval's start limit, and every check "did not run": a correct submission graded 0.
TAKE_IOPUB_PORT = '''
import os, socket
from jupyter_client import connect

_original, _picked, _held = connect.LocalPortCache.find_available_port, [], []

def _find_available_port(self, ip):
    port = _original(self, ip)
    _picked.append(port)
    if len(_picked) == 2:
        taker = socket.socket()
        taker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taker.bind((ip, port))
        taker.listen()
        _held.append(taker)
        with open(os.environ["PORT_TAKEN_LOG"], "a") as log:
            log.write(f"port {port} taken\\n")
    return port

def pytest_configure(config):
    connect.LocalPortCache.find_available_port = _find_available_port
'''


def test_a_kernel_port_taken_by_a_neighbour_cannot_stall_the_checker(tmp_path, monkeypatch):
    from course_utils.tooling.runner import run_checker
    from test_grade import solved

    (tmp_path / "plugin").mkdir()
    (tmp_path / "plugin" / "take_iopub_port.py").write_text(TAKE_IOPUB_PORT)
    log = tmp_path / "taken.log"
    monkeypatch.setenv("PYTEST_PLUGINS", "take_iopub_port")
    monkeypatch.setenv("PORT_TAKEN_LOG", str(log))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "plugin"), os.environ.get("PYTHONPATH", "")]))
    notebook = tmp_path / "05_training.ipynb"
    nbformat.write(solved("00"), notebook)
    start = time.monotonic()
    result = run_checker([notebook], kernel_start_timeout=10)[str(notebook)]
    assert {name: v["status"] for name, v in result["exercises"].items()} == {"add_one": "passed", "draw": "passed"}
    assert "error" not in result
    assert not log.exists()  # the kernel's sockets are Unix sockets: no TCP port was picked, so none could be taken
    assert time.monotonic() - start < 30


def installed_plugin(folder: Path) -> Path:
    """A folder holding a pytest plugin as pip installs one (a dist-info with a pytest11 entry point) that breaks pytest."""
    folder.mkdir()
    (folder / "breaker_plugin.py").write_text('def pytest_configure(config):\n    raise SystemExit("the breaker plugin was loaded")\n')
    info = folder / "breaker_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: breaker-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[pytest11]\nbreaker = breaker_plugin\n")
    return folder


def test_no_other_installed_pytest_plugin_reaches_the_checker(tmp_path, monkeypatch):
    from course_utils.tooling.runner import run_checker
    from test_grade import solved

    plugin = installed_plugin(tmp_path / "site")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(plugin), os.environ.get("PYTHONPATH", "")]))
    # the control: any other pytest run here loads it
    plain = subprocess.run([sys.executable, "-m", "pytest", "--co", "-q", "-p", "no:cacheprovider"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=120)
    assert "the breaker plugin was loaded" in plain.stdout + plain.stderr
    notebook = tmp_path / "00_orientation.ipynb"
    nbformat.write(solved("00"), notebook)
    result = run_checker([notebook])[str(notebook)]
    assert {name: v["status"] for name, v in result["exercises"].items()} == {"add_one": "passed", "draw": "passed"}
