"""Local multi-process plumbing for the DDP lesson: spawn ranks, run functions on each, clean up, call torchrun.

The lesson is about torch.distributed itself; this module only hides the process
bookkeeping that a notebook needs and a cluster job does not: capturing each
rank's printed lines, printing them in rank order, and making sure that a rank
that hangs or dies never leaves the notebook (or CI) waiting, or a process behind.
"""

import contextlib
import io
import multiprocessing
import os
import pickle
import queue
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

# Children read these before importing torch: one thread each (two ranks share two cores),
# no C++ log lines below ERROR level, and tracebacks without colour codes (a Jupyter kernel
# sets FORCE_COLOR, with which Python 3.13 colours the tracebacks its children print).
_PLAIN_TRACEBACKS = {"PYTHON_COLORS": "0"}
CHILD_ENV = {"OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR", **_PLAIN_TRACEBACKS}


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """os.environ with `values` set inside the block (for the processes started there), as it was after."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankError(RuntimeError):
    """A function raised on one or more ranks; the message gives each rank's error."""


def _child(rank: int, world_size: int, port: int, backend: str, pg_timeout: float, tasks, results, log_dir: str) -> None:
    """The body of one spawned rank: join the group, run tasks until told to stop, leave the group."""
    # C++ code (gloo, c10d) writes to the process's file descriptors 1 and 2, not to sys.stdout:
    # send them to a file, so that nothing interleaves with the notebook's output.
    log = os.open(os.path.join(log_dir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    _exit_with_parent()
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        try:
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=pg_timeout))
        except Exception as err:
            results.put((rank, "init", None, "", f"{type(err).__name__}: {err}"))
            return
        results.put((rank, "init", None, "", None))
        while True:
            task = tasks.get()
            if task is None:
                return
            fn, args = pickle.loads(task)
            buffer = io.StringIO()
            try:
                with contextlib.redirect_stdout(buffer):
                    value = fn(rank, world_size, *args)
                results.put((rank, "done", pickle.dumps(value), buffer.getvalue(), None))
            except BaseException as err:  # noqa: BLE001 -- reported to the parent, which raises
                lines = traceback.format_exception_only(type(err), err)
                results.put((rank, "done", None, buffer.getvalue(), "".join(lines).strip()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        # Python's own shutdown of a process that imported torch (and, after DDP, torch._dynamo) takes seconds:
        # send what is queued for the parent, then leave at once.
        results.close()
        results.join_thread()
        sys.stdout.flush()
        os._exit(0)


def _exit_with_parent() -> None:
    """Exit as soon as the process that started this one is gone (a kernel killed with SIGKILL runs no clean-up)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


class Workers:
    """`world_size` spawned processes joined in one process group; run(fn, *args) calls fn(rank, world_size, *args) on each.

    The processes start once (importing torch costs seconds) and stay up until close(),
    like the ranks of a training job. Use it as a context manager, or call close().
    """

    def __init__(self, world_size: int = 2, *, backend: str = "gloo", timeout: float = 60.0, pg_timeout: float = 30.0):
        self.world_size = world_size
        self.timeout = timeout
        self.port = free_port()
        self._log_dir = tempfile.TemporaryDirectory(prefix="course-ranks-")
        ctx = multiprocessing.get_context("spawn")
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        self.processes = []
        with _environment(CHILD_ENV):
            for rank in range(world_size):
                p = ctx.Process(target=_child, name=f"rank{rank}", daemon=True,
                                args=(rank, world_size, self.port, backend, pg_timeout, self._tasks[rank], self._results, self._log_dir.name))
                p.start()
                self.processes.append(p)
        try:
            self._collect("init", timeout)
        except BaseException:
            self.close()
            raise

    def _collect(self, kind: str, timeout: float) -> dict[int, tuple[Any, str, str | None]]:
        """Wait for one reply of `kind` from every rank; kill every rank if one dies or the time runs out."""
        deadline = time.monotonic() + timeout
        replies: dict[int, tuple[Any, str, str | None]] = {}
        while len(replies) < self.world_size:
            try:
                rank, got_kind, value, output, error = self._results.get(timeout=0.2)
            except queue.Empty:
                dead = [p.name for p in self.processes if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    waiting = sorted(set(range(self.world_size)) - set(replies))
                    codes = [p.exitcode for p in self.processes]
                    self.close(timeout=1.0)   # a rank is stuck or gone: no use waiting long
                    if dead:
                        raise RankError(f"{', '.join(dead)} exited (exit codes {codes}); "
                                        f"no answer from ranks {waiting}; every rank was stopped") from None
                    raise TimeoutError(f"ranks {waiting} did not finish within {timeout:g} s; every rank was stopped") from None
                continue
            if got_kind == kind:
                replies[rank] = (value, output, error)
                if kind == "init" and error:     # the others would wait for it until their own timeout
                    self.close(timeout=1.0)   # a rank is stuck or gone: no use waiting long
                    raise RankError(f"rank {rank} could not join the process group: {error}")
        return replies

    def run(self, fn: Callable, *args: Any, timeout: float | None = None, show: bool = True) -> list[Any]:
        """Call fn(rank, world_size, *args) on every rank; print what each printed as [rank N] lines; return the values."""
        if not self.processes:
            raise RuntimeError("these workers are closed; start new ones")
        payload = pickle.dumps((fn, args))  # fn must be importable: defined in a module, not in the notebook
        for q in self._tasks:
            q.put(payload)
        replies = self._collect("done", self.timeout if timeout is None else timeout)
        if show:
            print_rank_lines({rank: output for rank, (_, output, _) in replies.items()})
        errors = {rank: err for rank, (_, _, err) in replies.items() if err}
        if errors:
            raise RankError("; ".join(f"rank {r} raised {e.splitlines()[-1]}" for r, e in sorted(errors.items())))
        return [pickle.loads(replies[rank][0]) for rank in range(self.world_size)]

    def alive(self) -> int:
        """How many of the rank processes are still running."""
        return sum(p.is_alive() for p in self.processes)

    def close(self, timeout: float = 10.0) -> None:
        """Ask every rank to leave the group and exit; terminate, then kill, any that do not."""
        if not self.processes:
            return
        for q in self._tasks:
            with contextlib.suppress(Exception):
                q.put(None)
        deadline = time.monotonic() + timeout
        for p in self.processes:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.processes:
            if p.is_alive():
                p.terminate()
                p.join(2)
            if p.is_alive():
                p.kill()
                p.join(2)
        for q in (*self._tasks, self._results):
            q.close()
            q.join_thread()
        self.processes = []
        self._log_dir.cleanup()

    def __enter__(self) -> "Workers":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _CapturedStderr:
    def __init__(self):
        self.file = tempfile.TemporaryFile()

    def text(self) -> str:
        """Everything written so far to the captured stderr."""
        self.file.seek(0)
        return self.file.read().decode(errors="replace")


@contextlib.contextmanager
def child_stderr() -> Iterator[_CapturedStderr]:
    """Processes started inside the block write their stderr (fd 2), tracebacks uncoloured, to a file; read it later with .text()."""
    captured = _CapturedStderr()
    sys.stderr.flush()
    saved = os.dup(2)
    os.dup2(captured.file.fileno(), 2)
    try:
        with _environment(_PLAIN_TRACEBACKS):
            yield captured
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def print_rank_lines(outputs: dict[int, str]) -> None:
    """Print each rank's text, every line prefixed with [rank N], in rank order."""
    for rank in sorted(outputs):
        for line in outputs[rank].splitlines():
            print(f"[rank {rank}] {line}")


@contextlib.contextmanager
def one_rank_group() -> Iterator[bool]:
    """A real one-rank gloo process group in this process, destroyed after the block; yields False (and creates none)
    when a group of several ranks is already initialized here."""
    import torch.distributed as dist

    created = not dist.is_initialized()
    hook = sys.excepthook  # init_process_group wraps it to prefix "[rank0]:"; leave the process as it was
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.get_world_size() == 1
    finally:
        if created:
            dist.destroy_process_group()
        sys.excepthook = hook


def launch(worker: Callable, world_size: int = 2, args: Sequence[Any] = (), timeout: float = 60.0) -> list[Any]:
    """Start `world_size` gloo ranks, run worker(rank, world_size, *args) on each, stop them; return the values."""
    with Workers(world_size, timeout=timeout) as workers:
        return workers.run(worker, *args)


def process_status(pid: int) -> tuple[int, str] | None:
    """(parent pid, state letter such as 'R', 'S' or 'Z' for an exited zombie) from /proc (Linux); None if there is no such process."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[1]), fields[0]


def _descendants(pid: int) -> list[int]:
    """The processes below pid, from /proc (Linux); empty elsewhere."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        status = process_status(int(entry.name))
        if status:
            children.setdefault(status[0], []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _stop_tree(proc: subprocess.Popen) -> None:
    """Stop torchrun and its ranks: torchrun starts each rank in a session of its own, so killing its group is not enough."""
    ranks = _descendants(proc.pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)      # torchrun forwards SIGTERM to its ranks
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        pass
    for pid in [proc.pid, *ranks, *_descendants(proc.pid)]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def torchrun(target: str | os.PathLike, nproc: int = 2, args: Sequence[str] = (), timeout: float = 120.0,
             cwd: str | os.PathLike | None = None) -> subprocess.CompletedProcess:
    """Run `torchrun --standalone --nproc-per-node=N target args` (target: a script's path, or a module name run
    with -m); return the finished process. It dies with this process, even one killed with SIGKILL (Linux)."""
    from course_utils.tooling.runner import guarded

    script = str(target).endswith(".py") or isinstance(target, os.PathLike)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               *([] if script else ["-m"]), str(target), *args]
    env = {**os.environ, **CHILD_ENV}
    folder = Path(cwd) if cwd is not None else Path(__file__).resolve().parent.parent
    # start_new_session: on a timeout, the launcher and every rank it started are killed together.
    with subprocess.Popen(guarded(command), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                          start_new_session=True, cwd=folder) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _stop_tree(proc)
            out, err = proc.communicate()
            raise TimeoutError(f"torchrun {target} did not finish within {timeout:g} s; it was killed. Last output: {out[-500:]}{err[-500:]}") from None
        except BaseException:
            _stop_tree(proc)   # Ctrl-C, or a check's time limit: never leave torchrun or a rank behind
            raise
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def first_failure(finished: subprocess.CompletedProcess) -> str:
    """One line for a torchrun that failed: the first failed rank, as torchrun names it, and that rank's exception."""
    root = re.search(r"Root Cause.*?rank\s*:\s*(\d+)", finished.stderr, re.S)
    rank = root.group(1) if root else None
    errors = re.findall(r"^\[rank(\d+)\]: (\w+(?:Error|Exception|Interrupt|Exit)\b.*)$", finished.stderr, re.M)
    if not errors:  # raised before init_process_group, which prefixes each traceback line with [rankN]:
        errors = [(rank, line) for line in finished.stderr.splitlines() if re.match(r"^\w+(Error|Exception)\b", line)]
    error = next((line for r, line in errors if r == rank), errors[0][1] if errors else None)
    return (f"rank {rank} failed first" if rank is not None else "a rank failed") + (f": {error.strip()}" if error else "")


EXIT_ABORT = "terminate called without an active exception"


def aborted_on_exit(finished: subprocess.CompletedProcess) -> bool:
    """True when torchrun failed only because a rank aborted as its process exited, after its Python code had ended.

    gloo's shutdown races with the exit of a process whose peer is closing its connections at that
    moment: about one launch in ten on a 2-core machine, a rank dies there with EXIT_ABORT, after the
    script has done all its work (its output and files are complete).
    """
    ranks_errors = re.search(r"^(\[rank\d+\]: )?\w+(Error|Exception)\b", finished.stderr, re.M)  # a rank's own error
    return finished.returncode != 0 and EXIT_ABORT in finished.stderr and not ranks_errors


def print_outcome(finished: subprocess.CompletedProcess) -> None:
    """Print what the ranks printed; a failed launch as one line naming the first failed rank; an abort on exit as a note on stderr."""
    if finished.returncode == 0 or aborted_on_exit(finished):
        print(finished.stdout, end="")
        if finished.returncode:
            print(f"torchrun exit code {finished.returncode}: a rank aborted as it exited, after its work ({EXIT_ABORT}); "
                  "a race in gloo's shutdown, not in the script", file=sys.stderr)
        return
    print(f"torchrun exit code {finished.returncode}, {first_failure(finished)}")

