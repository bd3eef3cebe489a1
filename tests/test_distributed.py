"""course_utils.distributed: ranks start, run, report and always stop; torchrun runs the course's script."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from course_utils import distributed
from course_utils.distributed import RankError, Workers


# Functions the spawned ranks import from this module.

def rank_and_sum(rank: int, world_size: int, offset: float) -> tuple[int, float]:
    print(f"line one of rank {rank}")
    print("line two")
    x = torch.tensor([rank + offset])
    dist.all_reduce(x)
    return rank, x.item()


def fail_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("bad input on rank one")


def sleep_forever(rank: int, world_size: int) -> None:
    time.sleep(3600)


def exit_on_rank_zero(rank: int, world_size: int) -> None:
    if rank == 0:
        os._exit(3)
    time.sleep(3600)


def noisy_stderr(rank: int, world_size: int) -> int:
    os.write(2, b"C++ noise on fd 2\n")
    return rank


def test_free_port_can_be_bound():
    port = distributed.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_launch_runs_on_every_rank_and_prints_in_rank_order(capsys):
    values = distributed.launch(rank_and_sum, world_size=2, args=(10.0,))
    assert values == [(0, 21.0), (1, 21.0)]
    assert capsys.readouterr().out.splitlines() == [
        "[rank 0] line one of rank 0", "[rank 0] line two", "[rank 1] line one of rank 1", "[rank 1] line two"]


def test_workers_run_several_tasks_then_close_leaving_no_process(capfd):
    with Workers(2) as workers:
        assert workers.alive() == 2
        assert workers.run(rank_and_sum, 0.5, show=False) == [(0, 2.0), (1, 2.0)]
        assert workers.run(noisy_stderr, show=False) == [0, 1]
        processes = list(workers.processes)
    assert not any(p.is_alive() for p in processes)
    assert "C++ noise" not in capfd.readouterr().err     # the ranks' fd 2 goes to a log file, not to the notebook


def ddp_once(rank: int, world_size: int) -> int:
    from torch.nn.parallel import DistributedDataParallel as DDP

    DDP(torch.nn.Linear(2, 2))(torch.ones(1, 2)).sum().backward()   # imports torch._dynamo, whose shutdown is slow
    return rank


def test_ranks_leave_at_once_on_close_even_after_ddp():
    """Each rank sends its last reply and leaves with os._exit: close() never has to terminate one (exit code 0, not -15)."""
    with Workers(2) as workers:
        assert workers.run(ddp_once, show=False) == [0, 1]
        processes = list(workers.processes)
    assert [p.exitcode for p in processes] == [0, 0]


def test_one_rank_group_is_real_and_removed_afterwards():
    hook = sys.excepthook
    with distributed.one_rank_group() as usable:
        assert usable and dist.is_initialized() and dist.get_world_size() == 1
        t = torch.ones(2)
        dist.all_reduce(t)
        assert torch.equal(t, torch.ones(2))
    assert not dist.is_initialized() and sys.excepthook is hook


def test_an_error_on_one_rank_is_reported_and_the_workers_go_on():
    with Workers(2) as workers:
        with pytest.raises(RankError, match="rank 1 raised ValueError: bad input on rank one"):
            workers.run(fail_on_rank_one, show=False)
        assert workers.run(rank_and_sum, 0.0, show=False) == [(0, 1.0), (1, 1.0)]


def test_a_hanging_rank_is_stopped_after_the_timeout():
    workers = Workers(2)
    processes = list(workers.processes)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] did not finish within 2 s; every rank was stopped"):
        workers.run(sleep_forever, timeout=2, show=False)
    assert time.monotonic() - start < 20
    assert not any(p.is_alive() for p in processes)
    assert workers.alive() == 0


def test_a_rank_that_dies_stops_all_of_them():
    workers = Workers(2)
    processes = list(workers.processes)
    with pytest.raises(RankError, match="rank0 exited"):
        workers.run(exit_on_rank_zero, timeout=60, show=False)
    assert not any(p.is_alive() for p in processes)



ORPHAN_PARENT = """
import sys, time
from course_utils.distributed import Workers
workers = Workers(2)
print(*[p.pid for p in workers.processes], flush=True)
time.sleep(120)
"""


def test_ranks_exit_when_their_parent_is_killed():
    """A kernel killed with SIGKILL runs no clean-up; its ranks notice that their parent is gone and exit."""
    parent = subprocess.Popen([sys.executable, "-c", ORPHAN_PARENT], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(pid) for pid in parent.stdout.readline().split()]
        assert len(pids) == 2
    finally:
        parent.kill()
        parent.wait()
    alive = _still_running_after(pids, seconds=10)
    assert not alive, f"rank processes {alive} outlived their parent"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux's /proc and PR_SET_PDEATHSIG")
def test_a_killed_kernel_takes_its_torchrun_along():
    """torchrun started by distributed.torchrun ends when the process that started it is killed with SIGKILL."""
    launch = "from course_utils import distributed\ndistributed.torchrun('course_utils.train_ddp', args=['--epochs', '200'], timeout=300)"
    parent = subprocess.Popen([sys.executable, "-c", launch])
    try:
        deadline, launcher = time.monotonic() + 60, []
        while not launcher and time.monotonic() < deadline:
            time.sleep(0.3)
            launcher = [pid for pid in _children_of(parent.pid) if "torch.distributed.run" in _command(pid)]
        assert launcher, "torchrun did not start"
    finally:
        parent.kill()
        parent.wait()
    alive = _still_running_after(launcher, seconds=30)
    assert not alive, "torchrun outlived the process that started it"


def _still_running_after(pids: list[int], seconds: float) -> list[int]:
    """Wait until none of pids runs, or `seconds` pass; SIGKILL and return those still running."""
    deadline = time.monotonic() + seconds
    while any(_running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    alive = [pid for pid in pids if _running(pid)]
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    return alive


def _children_of(pid: int) -> list[int]:
    from pathlib import Path

    return [int(p.name) for p in Path("/proc").glob("[0-9]*") if (distributed.process_status(int(p.name)) or (0,))[0] == pid]


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _running(pid: int) -> bool:
    """Whether pid is a process that has not exited (a zombie has exited)."""
    status = distributed.process_status(pid)
    return status is not None and status[1] != "Z"


def test_a_busy_port_is_one_clear_error():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        original = distributed.free_port
        distributed.free_port = lambda: port
        try:
            start = time.monotonic()
            with pytest.raises(RankError, match="rank 0 could not join the process group: .*EADDRINUSE"):
                Workers(2, timeout=30)
            assert time.monotonic() - start < 25
        finally:
            distributed.free_port = original


def test_child_stderr_captures_a_spawned_process():
    import multiprocessing

    with distributed.child_stderr() as captured:
        child = multiprocessing.get_context("spawn").Process(target=os.abort)
        child.start()
    child.join(30)
    assert child.exitcode != 0
    text = captured.text()
    assert isinstance(text, str)


def test_print_rank_lines_orders_by_rank(capsys):
    distributed.print_rank_lines({1: "b\n", 0: "a1\na2\n"})
    assert capsys.readouterr().out == "[rank 0] a1\n[rank 0] a2\n[rank 1] b\n"


def test_torchrun_runs_the_training_script(tmp_path):
    out = tmp_path / "weights.pt"
    finished = distributed.torchrun("course_utils.train_ddp", nproc=2, args=["--epochs", "1", "--out", str(out)], timeout=180)
    assert finished.returncode == 0 or distributed.aborted_on_exit(finished), finished.stderr[-2000:]
    lines = finished.stdout.splitlines()
    assert lines[0].startswith("2 ranks, backend gloo")
    assert any(line.startswith("epoch 1/1: train loss") for line in lines)
    assert lines[-1] == "saved weights.pt"
    from course_utils.ddp_models import make_model

    make_model().load_state_dict(torch.load(out, weights_only=True))


FAILING_SCRIPT = """
import torch.distributed as dist
dist.init_process_group("gloo")
if dist.get_rank() == 1:
    raise ValueError("rank one has no data")
dist.barrier()
dist.destroy_process_group()
"""


def test_torchrun_runs_a_script_in_its_folder_and_names_the_first_failure(tmp_path):
    (tmp_path / "fails.py").write_text(FAILING_SCRIPT)
    finished = distributed.torchrun("fails.py", nproc=2, cwd=tmp_path, timeout=120)
    assert finished.returncode != 0
    assert finished.args[-2:] == ["--nproc-per-node=2", "fails.py"]  # a script, not -m module
    assert distributed.first_failure(finished) == "rank 1 failed first: ValueError: rank one has no data"


def _finished(returncode: int, stdout: str = "", stderr: str = "") -> subprocess.CompletedProcess:
    return subprocess.CompletedProcess(["torchrun"], returncode, stdout, stderr)


def test_print_outcome_shows_the_output_a_failure_or_an_abort_on_exit(capsys):
    distributed.print_outcome(_finished(0, "epoch 1\n"))
    assert capsys.readouterr().out == "epoch 1\n"
    abort = "terminate called without an active exception\n...\nRoot Cause (first observed failure):\n[0]:\n  rank      : 1 (local_rank: 1)\n"
    assert distributed.aborted_on_exit(_finished(1, stderr=abort))
    distributed.print_outcome(_finished(1, "epoch 1\n", abort))
    shown = capsys.readouterr()
    assert shown.out == "epoch 1\n" and "a rank aborted as it exited" in shown.err
    failed = "[rank1]: ValueError: bad\nterminate called without an active exception\nRoot Cause (first observed failure):\n[0]:\n  rank      : 1 (local_rank: 1)\n"
    assert not distributed.aborted_on_exit(_finished(1, stderr=failed))
    assert not distributed.aborted_on_exit(_finished(1, stderr="KeyError: 'RANK'\n" + abort))  # raised before joining
    distributed.print_outcome(_finished(1, "epoch 1\n", failed))
    assert capsys.readouterr().out == "torchrun exit code 1, rank 1 failed first: ValueError: bad\n"


def test_torchrun_timeout_kills_the_launcher_and_its_ranks():
    with pytest.raises(TimeoutError, match="did not finish within 3 s"):
        distributed.torchrun("course_utils.train_ddp", nproc=2, args=["--epochs", "50"], timeout=3)


def test_process_status_reads_parent_and_state():
    assert distributed.process_status(os.getpid()) == (os.getppid(), "R")   # this process is running now
    zombie = subprocess.Popen(["true"])
    while distributed.process_status(zombie.pid)[1] != "Z":   # exited, not yet waited for
        time.sleep(0.05)
    assert distributed.process_status(zombie.pid) == (os.getpid(), "Z")
    zombie.wait()
    assert distributed.process_status(zombie.pid) is None
