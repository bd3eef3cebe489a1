"""Lesson 09's model and data, which the learner's training script imports; the probe that lets the lesson's check
follow that script on each rank; and run_script, which starts the script's ranks as torchrun would, with the probe.

They live outside course_utils/lesson09.py because the checker judges with a fresh copy of that
module: a class defined there (Block) would be another class than the one the notebook sees.
The probe is off unless the rank was started by run_script (a fork of course_utils.rank_server) or with RANK_COMMAND.
"""

import contextlib
import os
import runpy
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from course_utils.tooling.checks import stub_frame


def make_model(seed: int = 0) -> nn.Module:
    """The lesson's digits classifier, 64 pixels -> 10 classes, its weights drawn with torch.manual_seed(seed)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    if _PROBE is not None:
        _PROBE.track(model)
    return model


class TrainingDigits(Dataset):
    """The course's 1,438 training digits as (image (1, 8, 8) in [0, 1], label) pairs."""

    def __init__(self):
        from course_utils.data import classification_datasets

        self.images, self.labels = classification_datasets("digits")[0].tensors
        self.reads = _PROBE.reads if _PROBE is not None else None
        self.outside = _PROBE.outside if _PROBE is not None else None

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.reads is not None:
            self.reads.append(int(index))
            if not _called_by_a_dataloader():
                self.outside.append(int(index))
        return self.images[index], self.labels[index]


def _called_by_a_dataloader(depth: int = 12) -> bool:
    """Whether a DataLoader's fetcher is among the callers (directly, or through datasets that wrap this one)."""
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return False
        if f"torch{os.sep}utils{os.sep}data{os.sep}" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


def training_digits() -> TrainingDigits:
    """The training set the lesson's script trains on: 1,438 digits."""
    return TrainingDigits()


def held_out_digits() -> tuple[torch.Tensor, torch.Tensor]:
    """The 359 test digits as two tensors: images (359, 1, 8, 8) and labels (359,)."""
    from course_utils.data import classification_datasets

    return classification_datasets("digits")[1].tensors


def digits_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first n training digits (images (n, 1, 8, 8) in [0, 1], labels (n,))."""
    from course_utils.data import classification_datasets

    images, labels = classification_datasets("digits")[0].tensors
    return images[:n].clone(), labels[:n].clone()


class Block(nn.Module):
    """A residual MLP block, x + W2 relu(W1 norm(x)): the unit FSDP shards in the lesson's exercise."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.relu(self.up(self.norm(x))))


def block_model(dim: int = 16, n_blocks: int = 3, n_classes: int = 10, seed: int = 0) -> nn.Sequential:
    """n_blocks Blocks, then a Linear head: the model of the FSDP exercise."""
    torch.manual_seed(seed)
    return nn.Sequential(*[Block(dim) for _ in range(n_blocks)], nn.Linear(dim, n_classes))


# What one rank of a script did, recorded for lesson 09's check.

PROBE_ENV = "COURSE_LESSON09_PROBE"
_PROBE = None


class _BatchRecorder:
    """A forward pre-hook that records the batch size of each training forward, and the weights the third one sees
    (after two optimizer steps: early enough that a wrong setting is told apart before training amplifies rounding).
    A class, not a closure, so that a script that pickles the whole model (torch.save(model)) works as without it."""

    def __init__(self):
        self.batches: list[int] = []
        self.after_two_steps: dict[str, torch.Tensor] | None = None

    def __call__(self, module: nn.Module, args: tuple) -> None:
        if module.training and torch.is_grad_enabled() and args and isinstance(args[0], torch.Tensor):
            self.batches.append(len(args[0]))
            if len(self.batches) == 3:
                self.after_two_steps = {k: v.detach().clone() for k, v in module.state_dict().items()}


class _ScriptProbe:
    """Records, in one rank of a script, which training samples it read, its model's training forwards and final
    weights, every torch.save, every DistributedDataParallel it built, and the process group's state at the end."""

    def __init__(self, rank: int):
        self.rank = rank
        self.reads: list[int] = []
        self.outside: list[int] = []  # the reads that no DataLoader made (the learner's own training_digits()[i])
        self.models: list[tuple[nn.Module, list[int]]] = []
        self.saves: list[dict] = []
        self.ddp_wraps: list[bool] = []
        self.real_save = torch.save

    def track(self, model: nn.Module) -> None:
        recorder = _BatchRecorder()
        model.register_forward_pre_hook(recorder)
        self.models.append((model, recorder))

    def install(self) -> None:
        from torch.nn.parallel import DistributedDataParallel

        real_init, real_save, probe = DistributedDataParallel.__init__, self.real_save, self

        def recording_init(ddp, module, *args, **kwargs):
            probe.ddp_wraps.append(any(module is m for m, _ in probe.models))
            real_init(ddp, module, *args, **kwargs)

        def recording_save(obj, f, *args, **kwargs):
            where = os.fspath(f) if isinstance(f, (str, os.PathLike)) else getattr(f, "name", type(f).__name__)
            probe.saves.append({"path": str(where), "type": type(obj).__name__, "module": isinstance(obj, nn.Module)})
            return real_save(obj, f, *args, **kwargs)

        DistributedDataParallel.__init__ = recording_init
        torch.save = recording_save

    def result(self) -> dict:
        trained = max(self.models, key=lambda m: len(m[1].batches), default=None)
        state = None
        if trained is not None:
            state = {k: v.detach().clone() for k, v in trained[0].state_dict().items()}
        return {"reads": self.reads, "outside": len(self.outside), "batches": trained[1].batches if trained else [],
                "models": len(self.models),
                "state": state, "after_two_steps": trained[1].after_two_steps if trained else None, "saves": self.saves,
                "ddp_wraps": self.ddp_wraps, "initialized_at_end": dist.is_available() and dist.is_initialized()}


def _error_record(err: BaseException, script: str) -> dict:
    """One rank's exception: its type, first line, whether it is the untouched stub, and where in the script."""
    tb, frame = err.__traceback__, None
    while tb is not None:
        if os.path.realpath(tb.tb_frame.f_code.co_filename) == os.path.realpath(script):
            frame = (tb.tb_frame.f_code.co_name, tb.tb_lineno)
        tb = tb.tb_next
    stub_at = stub_frame(err)
    stub = stub_at is not None and os.path.realpath(stub_at[1]) == os.path.realpath(script)
    lines = str(err).strip().splitlines()
    return {"type": type(err).__name__, "message": lines[0] if lines else "", "stub": stub,
            "function": frame[0] if frame else None, "line": frame[1] if frame else None, "time": time.time()}


def run_rank() -> None:
    """One rank of a script run by lesson 09's check (sys.argv: -c, the script, its arguments), the probe in place."""
    global _PROBE
    script, *args = sys.argv[1:]
    folder = os.environ[PROBE_ENV]
    _PROBE = _ScriptProbe(int(os.environ["RANK"]))
    _PROBE.install()
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python script.py` does
    error, code = None, 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as err:
        code = err.code if isinstance(err.code, int) else (0 if err.code is None else 1)
        if code:
            error = {"type": "SystemExit", "message": f"exit code {code}", "stub": False, "function": None,
                     "line": None, "time": time.time()}
    except BaseException as err:  # noqa: BLE001 -- every error is the learner's, reported by the check
        error, code = _error_record(err, script), 1
        import traceback

        traceback.print_exc()
    record = {**_PROBE.result(), "error": error}
    _PROBE.real_save(record, os.path.join(folder, f"rank{_PROBE.rank}.pt"))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no interpreter shutdown: the process group may be left in any state


RANK_COMMAND = "from course_utils.ddp_models import run_rank; run_rank()"


# The parent's side: start a script's ranks as torchrun would, each recorded by the probe.

@dataclass
class RankRun:
    """What one rank of a launched script did: exit code, output, the probe's record, and whether it was killed."""

    rank: int
    returncode: int | None
    stdout: str
    stderr: str
    record: dict | None
    killed: bool
    left_behind: list[str]


def run_script(script: Path, args: list[str], folder: Path, world_size: int = 2, timeout: float = 20.0,
               grace: float = 6.0, server=None) -> list[RankRun]:
    """Start `world_size` ranks of a script as torchrun would (RANK, WORLD_SIZE, MASTER_ADDR/PORT in the environment),
    each recorded by this module's probe; kill any rank still running `grace` s after another ended, or after `timeout` s.

    The ranks are forked by `server` (a course_utils.rank_server.RankServer), or by one started and stopped here."""
    from course_utils.rank_server import RankServer, rank_files

    with contextlib.ExitStack() as stack:
        if server is None:
            server = stack.enter_context(RankServer())
        env = {"TORCHELASTIC_RUN_ID": "lesson09-check", PROBE_ENV: str(folder)}
        result = server.run(__name__, script, args, folder, env, world_size=world_size, timeout=timeout, grace=grace)
    return [RankRun(rank, result["returncodes"][rank], *rank_files(folder, rank), rank in result["stopped"], result["left"])
            for rank in range(world_size)]
