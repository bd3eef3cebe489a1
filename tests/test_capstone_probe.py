"""course_utils.capstone_probe: the rank server starts ranks as torchrun would, the probe records what each did, a run
can be killed at a step, a rank that hangs is stopped, and nothing any of them started outlives its run or the server."""

import time

import pytest

from course_utils import capstone_probe
from course_utils.distributed import process_status
from course_utils.tooling.runner import descendants

SCRIPT = '''
import io, os, sys, time
import torch
import torch.distributed as dist
from course_utils import addition

dist.init_process_group("gloo")
rank = dist.get_rank()
print(f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']}: {addition.training_problems()}")
weight = torch.nn.Parameter(torch.ones(3))
optimizer = torch.optim.AdamW([weight], lr=0.5)
states = [None] * dist.get_world_size()
for step in range(3):
    (weight * torch.arange(3.0)).sum().backward()
    optimizer.step()
    dist.all_gather_object(states, {"rank": rank})     # torch.save into memory: not a checkpoint
    if rank == 0:
        torch.save({"step": step + 1, "weight": weight.detach()}, "checkpoint.pt")
    dist.barrier()
torch.load("checkpoint.pt", weights_only=True)
torch.save(weight, io.BytesIO())
if "--linger" in sys.argv and rank == 1:
    time.sleep(60)
if "--spawn" in sys.argv:
    import subprocess
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
dist.destroy_process_group()
'''


@pytest.fixture(scope="module")
def server():
    with capstone_probe.RankServer() as running:
        yield running


def _living() -> set[int]:
    return {pid for pid in descendants() if (status := process_status(pid)) and status[1] != "Z"}


def test_a_run_is_recorded(server, tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    runs = server.launch(script, [], tmp_path / "probe", problems=[[1, 2], [3, 4]], cwd=tmp_path)
    assert [r.returncode for r in runs] == [0, 0]
    assert [r.stdout.strip() for r in runs] == ["rank 0 of 2: [(1, 2), (3, 4)]", "rank 1 of 2: [(1, 2), (3, 4)]"]
    rec = runs[0].record
    assert rec["error"] is None and not rec["initialized_at_end"] and not rec["killed"]
    assert [s["step"] for s in rec["saves"]] == [1, 2, 3] and runs[1].record["saves"] == []
    assert all(s["path"] == "checkpoint.pt" for s in rec["saves"])
    assert [(entry["weights_only"], entry["step"]) for entry in rec["loads"]] == [(True, 3)]
    assert len(rec["steps"]) == 3 and rec["steps"][0]["lr"] == [0.5] and rec["steps"][0]["optimizer"].endswith(".AdamW")
    assert len(rec["after"]) == 3


def test_a_run_is_killed_at_its_step(server, tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    runs = server.launch(script, [], tmp_path / "probe", kill_at=2, cwd=tmp_path)
    assert [r.returncode for r in runs] == [-9, -9]
    assert all(r.record["killed"] and len(r.record["steps"]) == 2 for r in runs)


def test_a_lingering_rank_is_stopped_and_what_a_rank_starts_goes_with_it(server, tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    before = _living()
    start = time.monotonic()
    runs = server.launch(script, ["--linger", "--spawn"], tmp_path / "probe", cwd=tmp_path, grace=2.0)
    assert time.monotonic() - start < 30
    assert [r.stopped for r in runs] == [False, True] and runs[1].returncode == -9
    time.sleep(0.5)
    assert _living() <= before


def test_an_error_is_recorded_with_its_place(server, tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT.replace("rank = dist.get_rank()\n", "rank = dist.get_rank()\nif rank == 1:\n    raise ValueError('no')\n"))
    runs = server.launch(script, [], tmp_path / "probe", cwd=tmp_path, grace=2.0)
    error = runs[1].record["error"]
    assert (error["type"], error["message"], error["file"], error["line"]) == ("ValueError", "no", "script.py", 10)


def test_the_server_leaves_nothing_behind(tmp_path):
    before = _living()
    with capstone_probe.RankServer() as running:
        script = tmp_path / "script.py"
        script.write_text(SCRIPT)
        running.launch(script, [], tmp_path / "probe", cwd=tmp_path)
    time.sleep(0.5)
    assert _living() <= before
