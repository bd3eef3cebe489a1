"""Running the checker (pytest with nbval and the course's plugin) so that nothing outlives it.

The chain of processes is: this process -> pytest -> a kernel per notebook -> whatever the
notebook starts (DDP ranks, torchrun). Each link ends with the one above it:
- pytest is started through a tiny shim that asks Linux to send it SIGTERM when its parent dies;
- the plugin has each kernel ask for SIGKILL when pytest dies (course_utils.tooling.pytest_plugin);
- the course's ranks exit when their parent is gone (course_utils.distributed);
- and this process becomes a child subreaper, so that on Ctrl-C, or after the run, every
  process orphaned below it is re-parented to it and killed.
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from course_utils.tooling.layout import CourseError

PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER = 1, 4, 36

# Runs in the child before it becomes `command`: it dies with its parent, even a parent killed with SIGKILL.
_SHIM = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))\n"
    "if os.getppid() != int(sys.argv[1]): os._exit(1)\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


def _linux() -> bool:
    return sys.platform.startswith("linux")


def guarded(command: list[str]) -> list[str]:
    """`command`, wrapped so that it receives SIGTERM when this process dies (Linux; elsewhere unchanged)."""
    if not _linux():
        return command
    return [sys.executable, "-c", _SHIM, str(os.getpid()), *command]


def become_subreaper() -> bool:
    """Adopt every orphaned descendant (Linux), so that none escapes the clean-up."""
    if not _linux():
        return False
    import ctypes

    return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1) == 0


def not_dumpable() -> None:
    """Keep other processes of this user (a notebook's code) out of this one's /proc/PID/fd and /proc/PID/mem (Linux).

    Without CAP_SYS_PTRACE, which the grading sandbox drops, nothing else can then open a pipe
    this process holds or write into its memory.
    """
    if _linux():
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0)


def _children() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            ppid = int(Path(entry, "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    return children


def descendants(pid: int | None = None) -> list[int]:
    """Every process below pid (default: this one), from /proc; empty where there is no /proc."""
    if not Path("/proc").is_dir():
        return []
    children, found, todo = _children(), [], [pid or os.getpid()]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_descendants() -> None:
    """SIGKILL every process below this one, and reap them."""
    for pid in descendants():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG) != (0, 0):
            pass


class CheckerKilled(CourseError):
    """The checker (pytest) was ended by a signal before it wrote its scoreboard."""


def run_guarded(command: list[str], *, env: dict | None = None, cwd: Path | None = None,
                timeout: float | None = None, pass_fds: tuple[int, ...] = ()) -> subprocess.CompletedProcess:
    """Run a command and everything it starts; on return, Ctrl-C, or a time-out, none of it is left running.

    For a process that runs one such command at a time (the command line, one grading job):
    the clean-up kills every process below this one. Output goes to files, not pipes, so that a
    process left behind holding them cannot keep this call waiting.
    """
    become_subreaper()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(guarded(command), stdout=out, stderr=err, text=True, env=env, cwd=cwd, pass_fds=pass_fds)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"the checker did not finish within {timeout:g} s") from None
        except BaseException:
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
            raise
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            kill_descendants()
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(command, proc.returncode, out.read(), err.read())


def require_nbval() -> None:
    """A clear error when this Python cannot run the checker (e.g. a system python, not the course's .venv)."""
    try:
        import nbval  # noqa: F401
    except ImportError:
        raise CourseError(
            f"this Python ({sys.executable}) has no nbval, so it cannot run the checker: "
            "use the course's environment, e.g. `.venv/bin/python -m course_utils ...` (make lab creates it)"
        ) from None


def read_all(fd: int) -> "threading.Thread":
    """Read a pipe until EOF in a thread (so that a writer never blocks on a full pipe); the text is in thread.text."""
    def drain() -> None:
        chunks = []
        with os.fdopen(fd, "rb") as pipe:
            while chunk := pipe.read(65536):
                chunks.append(chunk)
        reader.text = b"".join(chunks).decode("utf-8", "replace")

    reader = threading.Thread(target=drain, daemon=True)
    reader.text = ""
    reader.start()
    return reader


def run_checker(notebooks: list[Path], *, exercise_timeout: float | None = None, cell_timeout: float | None = None,
                timeout: float | None = None, kernel_start_timeout: float | None = None) -> dict:
    """Run the checker (nbval, check mode) over notebooks; return the plugin's JSON scoreboard.

    The scoreboard comes back through a pipe that only pytest holds (the plugin makes pytest
    non-dumpable, so a notebook's code cannot open it through /proc), never through a file that
    the notebook's code could write first. A pytest killed by a signal raises CheckerKilled.
    """
    require_nbval()
    with tempfile.TemporaryDirectory() as tmp:
        read_end, write_end = os.pipe()
        reader = read_all(read_end)
        command = [
            sys.executable, "-m", "pytest", "-p", "course_utils.tooling.lean_imports", "-p", "nbval.plugin",
            "-p", "course_utils.tooling.pytest_plugin", "--nbval-lax", "--nbval-current-env",
            "-q", "-p", "no:cacheprovider", "--no-header", "-rN", "--tb=no", "--course-report", f"/dev/fd/{write_end}",
        ]
        if exercise_timeout is not None:
            command.append(f"--course-exercise-timeout={exercise_timeout:g}")
        if cell_timeout is not None:
            command.append(f"--course-cell-timeout={cell_timeout:g}")
        if kernel_start_timeout is not None:
            command.append(f"--nbval-kernel-startup-timeout={kernel_start_timeout:g}")
        command += [str(Path(n).resolve()) for n in notebooks]
        # Only the plugins named above: no other pytest plugin installed beside the course (one that reorders or
        # reruns tests) reaches the checker, and pytest skips scanning every package's entry points (0.4 s).
        env = {**os.environ, "COURSE_CHECK_MODE": "1", "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
        env.pop("PYTEST_ADDOPTS", None)
        try:
            result = run_guarded(command, env=env, cwd=Path(tmp), timeout=timeout, pass_fds=(write_end,))
        finally:
            os.close(write_end)  # every other holder is gone (run_guarded killed them), so the reader sees EOF
            reader.join()
        if result.returncode < 0:
            name = signal.Signals(-result.returncode).name
            raise CheckerKilled(f"the checker was killed by {name} while the notebook ran")
        if not reader.text:
            raise CourseError(f"the checker did not run:\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
        return json.loads(reader.text)
