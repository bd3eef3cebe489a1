"""course_utils.tooling.leftovers: an orphan in a session of its own is adopted, listed and killed."""

import subprocess
import sys
import time

import pytest

from course_utils.tooling import leftovers

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux's /proc and PR_SET_CHILD_SUBREAPER")


@pytest.fixture
def adopting():
    assert leftovers.adopt_orphans(True)
    try:
        yield set(leftovers.children())
    finally:
        leftovers.adopt_orphans(False)


def _orphan(command: str) -> int:
    """Start command in a session of its own, as torchrun starts a rank, from a shell that exits at once: its pid."""
    shell = subprocess.run(["sh", "-c", f"setsid {command} >/dev/null 2>&1 & echo $!"], capture_output=True, text=True, timeout=10)
    return int(shell.stdout)


def test_an_orphan_in_a_session_of_its_own_is_found_and_killed(adopting):
    pid = _orphan("sleep 30")
    left = leftovers.survivors(adopting, grace=1)
    assert list(left) == [pid]
    time.sleep(0.2)
    assert leftovers._status(pid) is None, "the survivor was not killed and reaped"


def test_a_survivors_own_children_are_killed_too(adopting):
    pid = _orphan("sh -c 'sleep 30 & sleep 30; wait'")
    time.sleep(0.3)  # the shell starts its two sleeps
    left = leftovers.survivors(adopting, grace=0.5)
    assert pid in left
    time.sleep(0.2)
    assert not leftovers.children().keys() - adopting


def test_a_process_that_exits_within_the_grace_is_no_survivor(adopting):
    _orphan("sleep 0.5")
    assert leftovers.survivors(adopting, grace=5) == {}


def test_children_that_were_there_before_are_left_alone():
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        assert leftovers.adopt_orphans(True)
        before = set(leftovers.children())
        assert sleeper.pid in before
        assert leftovers.survivors(before, grace=0) == {}
        assert sleeper.poll() is None
    finally:
        leftovers.adopt_orphans(False)
        sleeper.kill()
        sleeper.wait()
