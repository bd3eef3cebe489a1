"""The harness that starts a learner's training script on several ranks for a check, as torchrun would.

torchrun starts each rank as a fresh interpreter, which pays its imports each time (torch, torch.distributed,
DistributedDataParallel's torch._dynamo): seconds of CPU per rank on a 2-core machine, more than the script's
own training in lessons 09 and 11. The rank server imports all that once; each rank of each run is then a
fork of it, set up as torchrun sets a rank up (RANK, WORLD_SIZE, MASTER_ADDR/PORT ... in its environment) and
handed to the probe module the check names (course_utils.ddp_models or course_utils.capstone_probe), whose
run_rank() runs the script with its probe in place.

The kernel's end is RankServer, a context manager: a check starts one, launches its runs through it, and
stops it, and every rank with it.
"""

import contextlib
import ctypes
import importlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

SERVER_COMMAND = "from course_utils.rank_server import rank_server; rank_server()"
PROBES = ("course_utils.ddp_models", "course_utils.capstone_probe")  # the modules whose run_rank() a job may name
PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def _living_in_group(pgid: int) -> list[Path]:
    """The /proc entries of the processes in a process group that have not exited (zombies excluded)."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
                found.append(entry)
    return found


def group_members(pgid: int) -> list[str]:
    """The command lines of the living processes in a process group (Linux /proc; elsewhere none)."""
    found = []
    for entry in _living_in_group(pgid):
        with contextlib.suppress(OSError, IndexError):
            argv = command_line(entry)
            # the program's name, not its path: a message reads the same in any checkout
            found.append(" ".join([Path(argv[0]).name, *argv[1:]]))
    return found


def command_line(entry: Path) -> list[str]:
    """A process's argv from /proc; a process in the middle of exec shows an empty one for a moment, so wait it out."""
    for _ in range(20):
        raw = (entry / "cmdline").read_bytes()
        if raw:
            break
        time.sleep(0.05)
    return raw.decode(errors="replace").rstrip("\0").split("\0")


def _become_rank(job: dict, rank: int, server: int) -> None:
    """In a forked child of the server: become rank `rank` of the job (environment, folder, output files), then run it."""
    os.setpgid(0, 0)  # a process group of its own: whatever the rank starts is stopped with it
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))  # die with the server
    if os.getppid() != server:
        os._exit(1)
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_DFL)
    folder = Path(job["folder"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # the server's commands are not the rank's
    for fd, name in ((1, f"rank{rank}.out"), (2, f"rank{rank}.err")):
        os.dup2(os.open(folder / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    sys.stdout.reconfigure(line_buffering=True)
    os.environ.clear()  # exactly the launcher's environment, whenever the server was started
    os.environ.update(job["env"])
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "ROLE_RANK": str(rank)})
    os.chdir(job["cwd"])
    sys.argv = ["-c", job["script"], *job["args"]]
    importlib.import_module(job["probe"]).run_rank()  # ends the process


def _run_job(job: dict) -> dict:
    """Fork the job's ranks, wait for them, stop any still running `grace` s after another ended or after `timeout` s.

    Answers each rank's exit code, the ranks that were stopped, and what was still running in the ranks' process
    groups once they had all ended (a process a rank started and left behind); that is killed too."""
    pids = []
    for rank in range(job["world_size"]):
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            try:
                _become_rank(job, rank, os.getppid())
            finally:
                os._exit(1)
        pids.append(pid)
    codes: dict[int, int] = {}
    stopped: set[int] = set()
    start, first_end = time.monotonic(), None
    while len(codes) < len(pids):
        for rank, pid in enumerate(pids):
            if rank not in codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[rank] = os.waitstatus_to_exitcode(status)
        now = time.monotonic()
        if first_end is None and codes:
            first_end = now
        if len(codes) < len(pids) and (now - start > job["timeout"] or (first_end is not None and now - first_end > job["grace"])):
            for rank, pid in enumerate(pids):
                if rank not in codes:
                    stopped.add(rank)
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            for rank, pid in enumerate(pids):
                if rank not in codes:
                    codes[rank] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        time.sleep(0.01)
    left = [command for pid in pids for command in group_members(pid)]
    for pid in pids:  # whatever a rank started goes with it
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
    # SIGKILL is delivered asynchronously: answer only once they are gone, so "killed" is true when the caller reads it
    deadline = time.monotonic() + 5.0
    while any(_living_in_group(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.01)
    return {"returncodes": [codes[r] for r in range(len(pids))], "stopped": sorted(stopped), "left": left}


def rank_server() -> None:
    """Import what every rank needs, once; then, for each job read on stdin (a JSON line), fork its ranks and answer
    with their exit codes (a JSON line on stdout). Ends when stdin closes."""
    import numpy  # noqa: F401 -- imported here once, for every rank forked below
    import torch._dynamo  # noqa: F401 -- DistributedDataParallel and the optimizers import it: a rank's most costly import
    import torch.distributed  # noqa: F401
    import torch.nn.parallel  # noqa: F401
    import torch.utils.data  # noqa: F401

    from course_utils import addition, training  # noqa: F401
    from course_utils.tooling import checks  # noqa: F401

    for probe in PROBES:
        importlib.import_module(probe)
    out = sys.stdout
    out.write("ready\n")
    out.flush()
    for line in sys.stdin:
        out.write(json.dumps(_run_job(json.loads(line))) + "\n")
        out.flush()


@contextlib.contextmanager
def _signals_held():
    """Hold SIGALRM and SIGUSR2 (the checks' time limit) and SIGINT until the block ends; they are delivered then."""
    held = {signal.SIGALRM, signal.SIGUSR2, signal.SIGINT}
    main = threading.current_thread() is threading.main_thread()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held) if main else None
    try:
        yield
    finally:
        if main:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def rank_files(folder: Path, rank: int) -> tuple[str, str, dict | None]:
    """What a rank of a run left in its folder: its output, its errors, and its probe's record (None if it wrote none)."""
    import torch

    path = folder / f"rank{rank}.pt"
    record = torch.load(path, weights_only=True) if path.exists() else None
    out, err = ((folder / f"rank{rank}.{kind}").read_text(errors="replace") for kind in ("out", "err"))
    return out, err, record


class RankServer:
    """The kernel's end of rank_server: start it, launch runs through it, stop it (a context manager)."""

    def __init__(self, start_timeout: float = 120.0):
        from course_utils.distributed import CHILD_ENV
        from course_utils.tooling.runner import guarded

        self.process = subprocess.Popen(guarded([sys.executable, "-c", SERVER_COMMAND]), stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                        env={**os.environ, **CHILD_ENV, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
        if self._answer(start_timeout) != "ready":
            self.close()
            raise RuntimeError("the rank server did not start")

    def _answer(self, timeout: float) -> str | None:
        import select

        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        if not ready:
            return None
        line = self.process.stdout.readline()
        return line.strip() if line else None

    def run(self, probe: str, script: Path, args: list[str], folder: Path, env: dict[str, str], *, world_size: int = 2,
            timeout: float = 20.0, grace: float = 5.0, cwd: Path | None = None) -> dict:
        """Run `world_size` ranks of the script under `probe`'s run_rank, with torchrun's variables for a free port and
        `env` added to this process's environment; answer {"returncodes", "stopped", "left"}. Each rank's output is
        in `folder` as rank<N>.out and rank<N>.err."""
        from course_utils.distributed import CHILD_ENV, free_port

        folder.mkdir(parents=True, exist_ok=True)
        torchrun = {"WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size), "GROUP_RANK": "0",
                    "GROUP_WORLD_SIZE": "1", "ROLE_NAME": "default", "ROLE_WORLD_SIZE": str(world_size),
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "TORCHELASTIC_RESTART_COUNT": "0",
                    "TORCHELASTIC_MAX_RESTARTS": "0", "PYTHONUNBUFFERED": "1"}
        job = {"probe": probe, "script": str(script), "args": list(args), "folder": str(folder), "cwd": str(cwd or folder),
               "env": {**os.environ, **CHILD_ENV, **torchrun, **env}, "world_size": world_size, "timeout": timeout,
               "grace": grace}
        self.process.stdin.write(json.dumps(job) + "\n")
        self.process.stdin.flush()
        answer = self._answer(timeout + grace + 30)
        if answer is None:
            self.close()
            raise RuntimeError("the rank server stopped answering")
        return json.loads(answer)

    def close(self) -> None:
        """Stop the server and every rank it runs (they die with it), whatever interrupts this."""
        with _signals_held():  # a check's time limit raises again and again once past: it must not cut this short
            with contextlib.suppress(OSError, ValueError):
                self.process.stdin.close()
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
            with contextlib.suppress(OSError, ValueError):
                self.process.stdout.close()

    def __enter__(self) -> "RankServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
