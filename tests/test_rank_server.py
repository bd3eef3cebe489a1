"""course_utils.rank_server: ranks forked from one server are set up as torchrun sets them up, and stopped with it."""

import json
import os
import threading
from pathlib import Path

import pytest

from course_utils import ddp_models, rank_server
from course_utils.rank_server import RankServer

pytestmark = pytest.mark.skipif(not os.uname().sysname == "Linux", reason="the server forks and reads /proc (Linux)")

# Each rank writes what torchrun would have given it, then does what its rank number asks.
SCRIPT = """
import json, os, subprocess, sys, time
rank = int(os.environ["RANK"])
seen = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                                       "COURSE_RANK_SERVER_TEST", "OMP_NUM_THREADS")}
seen.update(cwd=os.getcwd(), argv=sys.argv[1:], torch_loaded="torch" in sys.modules)
with open(f"seen{rank}.json", "w") as f:
    json.dump(seen, f)
print("hello from", rank)
mode = sys.argv[1]
if mode == "leave" and rank == 0:
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "left-by-rank-0"])
if mode == "hang" and rank == 1:
    time.sleep(60)
sys.exit(3 if mode == "fail" and rank == 1 else 0)
"""


@pytest.fixture(scope="module")
def server():
    with RankServer() as running:
        yield running


def run(server, tmp_path: Path, mode: str, **kwargs) -> dict:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    folder = tmp_path / "run"
    env = {"TORCHELASTIC_RUN_ID": "test", ddp_models.PROBE_ENV: str(folder)}  # lesson 09's probe records into folder
    return server.run("course_utils.ddp_models", script, [mode], folder, env, cwd=tmp_path, **kwargs)


def test_each_rank_gets_torchruns_variables_and_the_launchers_environment(server, tmp_path, monkeypatch):
    monkeypatch.setenv("COURSE_RANK_SERVER_TEST", "set after the server started")
    result = run(server, tmp_path, "fail")
    assert result["returncodes"] == [0, 3] and result["stopped"] == [] and result["left"] == []
    seen = [json.loads((tmp_path / f"seen{rank}.json").read_text()) for rank in (0, 1)]
    ports = {s["MASTER_PORT"] for s in seen}
    assert len(ports) == 1 and ports.pop().isdigit()
    for rank, s in enumerate(seen):
        assert (s["RANK"], s["LOCAL_RANK"], s["WORLD_SIZE"], s["MASTER_ADDR"]) == (str(rank), str(rank), "2", "127.0.0.1")
        assert s["TORCHELASTIC_RUN_ID"] == "test" and s["COURSE_RANK_SERVER_TEST"] == "set after the server started"
        assert s["OMP_NUM_THREADS"] == "1"  # the course's setting for child processes
        assert s["cwd"] == str(tmp_path) and s["argv"] == ["fail"]
        assert s["torch_loaded"]  # imported once, by the server
        assert (tmp_path / "run" / f"rank{rank}.out").read_text() == f"hello from {rank}\n"


def test_a_process_a_rank_leaves_is_named_and_killed(server, tmp_path):
    result = run(server, tmp_path, "leave")
    assert result["returncodes"] == [0, 0]
    assert len(result["left"]) == 1 and result["left"][0].endswith("-c import time; time.sleep(60) left-by-rank-0")
    still = [p for p in Path("/proc").glob("[0-9]*") if b"left-by-rank-0" in _cmdline(p)]
    assert still == []


def test_a_rank_still_running_after_the_grace_is_stopped(server, tmp_path):
    result = run(server, tmp_path, "hang", grace=1.0)
    assert result["returncodes"][0] == 0 and result["returncodes"][1] == -9 and result["stopped"] == [1]


def test_closing_the_server_stops_it(tmp_path):
    running = RankServer()
    running.close()
    assert running.process.poll() is not None


def test_a_command_line_read_mid_exec_is_waited_for(tmp_path):
    """/proc shows an empty cmdline while a process execs; the scan reads again rather than name the process ''."""
    (tmp_path / "cmdline").write_bytes(b"")
    timer = threading.Timer(0.2, (tmp_path / "cmdline").write_bytes, [b"/usr/bin/python3\0-c\0pass\0"])
    timer.start()
    try:
        assert rank_server.command_line(tmp_path) == ["/usr/bin/python3", "-c", "pass"]
    finally:
        timer.cancel()


def _cmdline(entry: Path) -> bytes:
    try:
        return (entry / "cmdline").read_bytes()
    except OSError:
        return b""
