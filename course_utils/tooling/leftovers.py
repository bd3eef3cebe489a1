"""Processes that outlive what started them: adopt the orphans, list the survivors, kill them (Linux).

A notebook's kernel may start processes that leave its process tree: torchrun starts each rank in a
session of its own, and a daemon forks twice. As a child subreaper, this process adopts every such
orphan instead of init, so that once the kernel has stopped, whatever still runs is one of its children.
"""

import contextlib
import ctypes
import os
import signal
import sys
import time
from pathlib import Path

from course_utils.distributed import process_status as _status

PR_SET_CHILD_SUBREAPER = 36  # from <linux/prctl.h>


def adopt_orphans(on: bool) -> bool:
    """Make this process a child subreaper (or stop being one); False where Linux's prctl is not available."""
    if not sys.platform.startswith("linux"):
        return False
    return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) == 0


def _command(pid: int) -> str:
    try:
        return (Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip())[:120]
    except OSError:
        return "?"


def children() -> dict[int, str]:
    """This process's living children (zombies left out), with their command lines."""
    found = {}
    for entry in Path("/proc").glob("[0-9]*"):
        status = _status(int(entry.name))
        if status and status[0] == os.getpid() and status[1] != "Z":
            found[int(entry.name)] = _command(int(entry.name))
    return found


def _reap(pids) -> None:
    """Collect the exit status of those of pids that have exited, so that no zombie is left."""
    for pid in pids:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)


def _new_children(before: set[int]) -> set[int]:
    """Children that were not there before, zombies included (they are ours to reap)."""
    found = set()
    for entry in Path("/proc").glob("[0-9]*"):
        status = _status(int(entry.name))
        if status and status[0] == os.getpid() and int(entry.name) not in before:
            found.add(int(entry.name))
    return found


def survivors(before: set[int], grace: float = 5.0) -> dict[int, str]:
    """Children that were not there before and still run after grace seconds; they are then killed and reaped."""
    deadline = time.monotonic() + grace  # a rank that is exiting gets a few seconds
    while True:
        new = _new_children(before)
        _reap(new)
        left = {pid: command for pid, command in children().items() if pid in new}
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    _kill_all(before)
    return left


def _kill_all(before: set[int]) -> None:
    """SIGKILL the new children until none is left: a killed one's own children are adopted in turn."""
    for _ in range(10):
        new = _new_children(before)
        living = [pid for pid in new if (status := _status(pid)) and status[1] != "Z"]
        for pid in living:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
        _reap(new)
        if not living:
            return
