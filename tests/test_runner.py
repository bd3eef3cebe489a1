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
