"""Lesson 09 (distributed data parallel on a CPU): rank functions for the demos, reference solutions, the launcher
that runs a learner's training script on two ranks, and the checks.

The functions with the signature fn(rank, world_size, ...) run inside the spawned ranks of
course_utils.distributed.Workers: spawn imports them from here, which it could not do
from a notebook. The lesson's model and data live in course_utils.ddp_models, which the
learner's training script imports; when check_ddp_digits runs that script, they record what
each rank did.
"""

import contextlib
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from course_utils import ddp_models
from course_utils.ddp_models import (  # noqa: F401 -- the notebook reaches the lesson's model and data as lesson09.*
    RANK_COMMAND,
    Block,
    TrainingDigits,
    block_model,
    digits_batch,
    held_out_digits,
    make_model,
    training_digits,
)
from course_utils.tooling.checks import (
    ERROR_HINTS,
    ExerciseFailed,
    ExerciseNotAttempted,
    a_type,
    call,
    error_hint,
    exercise,
    expect_callable,
    first_line,
    learner_frame,
    not_attempted_message,
    scoreboard_for,
    stub_function,
    type_name,
    where,
)

scoreboard = scoreboard_for(__name__)  # the lesson's last cell: this session's verdicts


# Reference solutions. The checks compare the learner's answers with these.

def global_accuracy(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """The accuracy over every rank's samples (the shares may differ in size), the same float on every rank."""
    counts = torch.stack([(logits.argmax(dim=1) == labels).sum(), torch.tensor(len(labels))]).double()
    dist.all_reduce(counts)  # sums, not means: a rank with more samples weighs more
    return (counts[0] / counts[1]).item()


def average_gradients(model: nn.Module) -> None:
    """Replace every .grad by its mean over all ranks with one all-reduce of all gradients, as one DDP bucket."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    for g, mean in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(mean.view_as(g))


def train_accumulated(ddp_model: nn.Module, optimizer: torch.optim.Optimizer,
                      micro_batches: list[tuple[torch.Tensor, torch.Tensor]], accumulate: int) -> None:
    """One optimizer step per `accumulate` micro-batches (the last group may be shorter), all-reduced once per step."""
    for start in range(0, len(micro_batches), accumulate):
        group = micro_batches[start:start + accumulate]
        optimizer.zero_grad()
        for i, (inputs, targets) in enumerate(group):
            last = i == len(group) - 1
            with contextlib.nullcontext() if last else ddp_model.no_sync():  # forward and backward inside
                (F.cross_entropy(ddp_model(inputs), targets) / len(group)).backward()
        optimizer.step()


def shard_model(model: nn.Sequential, mesh) -> torch.optim.Optimizer:
    """Shard each Block as one FSDP2 unit and the root, computing in bfloat16; return AdamW over the sharded parameters."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model:
        if isinstance(layer, Block):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return torch.optim.AdamW(model.parameters(), lr=1e-3)  # after fully_shard: it swapped in DTensor parameters


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
               grace: float = 6.0) -> list[RankRun]:
    """Start `world_size` ranks of a script as torchrun would (RANK, WORLD_SIZE, MASTER_ADDR/PORT in the environment),
    each recorded by course_utils.ddp_models' probe; kill any rank still running `grace` s after another ended, or after `timeout` s."""
    from course_utils.distributed import CHILD_ENV, free_port
    from course_utils.tooling.runner import guarded

    port = free_port()
    base = {**os.environ, **CHILD_ENV, "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size), "GROUP_RANK": "0",
            "GROUP_WORLD_SIZE": "1", "ROLE_NAME": "default", "ROLE_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": "lesson09-check",
            "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0", "PYTHONUNBUFFERED": "1",
            ddp_models.PROBE_ENV: str(folder)}
    procs, files, left = [], [], []
    try:
        for rank in range(world_size):
            env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank), "ROLE_RANK": str(rank)}
            out, err = open(folder / f"rank{rank}.out", "w+"), open(folder / f"rank{rank}.err", "w+")
            files += [out, err]
            group = {"process_group": 0 if rank == 0 else procs[0].pid}  # one process group: one killpg stops all
            procs.append(subprocess.Popen(guarded([sys.executable, "-c", RANK_COMMAND, str(script), *args]),
                                          stdout=out, stderr=err, env=env, cwd=folder, **group))
        start, first_end, killed = time.monotonic(), None, set()
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if first_end is None and any(p.poll() is not None for p in procs):
                first_end = now
            if now - start > timeout or (first_end is not None and now - first_end > grace):
                for rank, p in enumerate(procs):
                    if p.poll() is None:
                        killed.add(rank)
                        p.kill()
                break
            time.sleep(0.05)
        for p in procs:
            p.wait()
        left = _group_members(procs[0].pid)  # the ranks have ended: whatever is left in their process group, they started
    finally:
        if procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(procs[0].pid, signal.SIGKILL)  # never leave a rank, or anything it started, behind
        for p in procs:
            p.wait()
        texts = []
        for f in files:
            f.seek(0)
            texts.append(f.read())
            f.close()
    runs = []
    for rank, p in enumerate(procs):
        path = folder / f"rank{rank}.pt"
        record = torch.load(path, weights_only=True) if path.exists() else None
        runs.append(RankRun(rank, p.returncode, texts[2 * rank], texts[2 * rank + 1], record, rank in killed, left))
    return runs


def _group_members(pgid: int) -> list[str]:
    """The command lines of the living processes in a process group (Linux /proc; elsewhere none)."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                argv = _command_line(entry)
                # the program's name, not its path: a message reads the same in any checkout
                found.append(" ".join([Path(argv[0]).name, *argv[1:]]))
    return found


def _command_line(entry: Path) -> list[str]:
    """A process's argv from /proc; a process in the middle of exec shows an empty one for a moment, so wait it out."""
    for _ in range(20):
        raw = (entry / "cmdline").read_bytes()
        if raw:
            break
        time.sleep(0.05)
    return raw.decode(errors="replace").rstrip("\0").split("\0")


# Functions that run on every rank: fn(rank, world_size, ...). They print; Workers prefixes [rank N].

def hello(rank: int, world_size: int) -> dict:
    """Show what a rank knows, and three collectives: all_reduce, broadcast, all_gather."""
    print(f"I am rank {dist.get_rank()} of world size {dist.get_world_size()}, backend {dist.get_backend()}")
    x = torch.tensor([float(rank + 1)])
    before = x.item()
    dist.all_reduce(x, op=dist.ReduceOp.SUM)                 # every rank ends with the sum
    print(f"all_reduce(SUM): my {before:g} became {x.item():g}")
    y = torch.tensor([100.0 + rank])
    dist.broadcast(y, src=0)                                 # every rank ends with rank 0's value
    print(f"broadcast(src=0): my {100 + rank} became {y.item():g}")
    gathered = [torch.zeros(1) for _ in range(world_size)]
    dist.all_gather(gathered, torch.tensor([rank * 10.0]))   # every rank ends with everybody's value
    print(f"all_gather: {[t.item() for t in gathered]}")
    return {"rank": rank, "sum": x.item()}


def _my_slice(x: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    per_rank = len(x) // world_size
    return x[rank * per_rank:(rank + 1) * per_rank]


def ddp_step(rank: int, world_size: int, images: torch.Tensor, labels: torch.Tensor, lr: float) -> dict:
    """One DDP training step on this rank's slice of the batch, with the all-reduce made visible; also by hand."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    x, y = _my_slice(images, rank, world_size), _my_slice(labels, rank, world_size)
    model = DDP(make_model())                                # broadcasts rank 0's weights to every rank
    log = []

    def logging_allreduce(state, bucket):
        """A DDP communication hook: called once per bucket of gradients, instead of the built-in all-reduce."""
        local = bucket.buffer().norm().item()
        fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()

        def average(fut):
            averaged = fut.value()[0].div_(world_size)
            log.append((bucket.index(), bucket.buffer().numel(), local, averaged.norm().item()))
            return averaged
        return fut.then(average)

    model.register_comm_hook(None, logging_allreduce)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    print(f"my samples: {rank * len(x)}..{(rank + 1) * len(x) - 1}")
    loss = F.cross_entropy(model(x), y)
    loss.backward()                                          # the hook runs here, once per bucket
    for index, numel, local, averaged in sorted(log):
        print(f"bucket {index}: {numel:5} gradient values, norm {local:.4f} on this rank -> {averaged:.4f} after all-reduce")
    grads = [p.grad.clone() for p in model.parameters()]
    optimizer.step()

    manual = make_model()                                    # the same step without DDP: one all-reduce per parameter
    F.cross_entropy(manual(x), y).backward()
    for p in manual.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)        # in place: the sum over ranks, on every rank
        p.grad /= world_size
    manual_diff = max((a.grad - b).abs().max().item() for a, b in zip(manual.parameters(), grads))
    print(f"my loss {loss.item():.4f}; by hand ({len(grads)} all-reduces) vs DDP, max gradient difference: {manual_diff:.1e}")
    return {"grads": grads, "weights": [p.detach().clone() for p in model.parameters()]}


def single_process_step(images: torch.Tensor, labels: torch.Tensor, lr: float) -> dict:
    """The same step in one process on the whole batch."""
    model = make_model()
    F.cross_entropy(model(images), labels).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    torch.optim.SGD(model.parameters(), lr=lr).step()
    return {"grads": grads, "weights": [p.detach().clone() for p in model.parameters()]}


def max_difference(a: dict, b: dict) -> dict[str, float]:
    """Largest absolute difference of gradients and of weights between two steps' results."""
    return {key: max((u - v).abs().max().item() for u, v in zip(a[key], b[key])) for key in ("grads", "weights")}


def ddp_matches_single_process(workers=None, batch_per_rank: int = 16, lr: float = 0.1) -> dict[str, float]:
    """Max |difference| of gradients and weights: one DDP step on 2 ranks x batch B vs one process on 2B."""
    from course_utils.distributed import Workers

    images, labels = digits_batch(2 * batch_per_rank)
    with contextlib.nullcontext(workers) if workers is not None else Workers(2) as pool:
        per_rank = pool.run(ddp_step, images, labels, lr, show=False)
    single = single_process_step(images, labels, lr)
    diffs = [max_difference(result, single) for result in per_rank]
    return {key: max(d[key] for d in diffs) for key in ("grads", "weights")}


def count_syncs(rank: int, world_size: int, images: torch.Tensor, labels: torch.Tensor, micro_batches: int, use_no_sync: bool) -> dict:
    """Accumulate gradients over micro-batches with DDP; count the all-reduce calls and the values sent."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(make_model())
    calls = []

    def counting_allreduce(state, bucket):
        calls.append(bucket.buffer().numel())
        fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
        return fut.then(lambda fut: fut.value()[0].div_(world_size))

    model.register_comm_hook(None, counting_allreduce)
    x, y = _my_slice(images, rank, world_size), _my_slice(labels, rank, world_size)
    chunks = list(zip(x.chunk(micro_batches), y.chunk(micro_batches)))
    model.zero_grad()
    for i, (inputs, targets) in enumerate(chunks):
        syncs = not use_no_sync or i == len(chunks) - 1
        with contextlib.nullcontext() if syncs else model.no_sync():
            (F.cross_entropy(model(inputs), targets) / micro_batches).backward()
    return {"all_reduces": len(calls), "values_sent": sum(calls), "grads": [p.grad.clone() for p in model.parameters()]}


def sync_batchnorm(rank: int, world_size: int, features: torch.Tensor) -> dict:
    """What SyncBatchNorm computes: batch statistics over every rank's samples, from all-reduced sums."""
    bn = nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.BatchNorm1d(features.shape[1])))
    print(f"convert_sync_batchnorm: {type(bn[0]).__name__}")
    x = _my_slice(features, rank, world_size)
    try:
        bn(x)                                                # training mode: needs the batch statistics
    except ValueError as err:
        print(f"on a CPU tensor: ValueError: {err}")
    local_mean = x.mean(0)
    sums = torch.cat([x.sum(0), (x * x).sum(0), torch.tensor([float(len(x))])])
    dist.all_reduce(sums)                                    # what SyncBatchNorm all-reduces (in its CUDA kernels)
    n = sums[-1]
    mean = sums[:x.shape[1]] / n
    var = sums[x.shape[1]:-1] / n - mean ** 2
    print(f"feature 0: mean of my {len(x)} samples {local_mean[0]:+.3f}, of all {int(n)} samples {mean[0]:+.3f}")
    return {"local_mean": local_mean, "mean": mean, "var": var}


def fsdp_step(rank: int, world_size: int, images: torch.Tensor, labels: torch.Tensor, lr: float) -> dict:
    """FSDP2 on CPU: shard each Linear, show the shards, one AdamW step; gather a full state_dict on rank 0."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (world_size,))
    model = make_model()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)                    # each Linear: one unit, gathered just before it runs
    fully_shard(model, mesh=mesh)                            # the root: whatever is left
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor)
        print(f"{name:8} {type(p).__name__} {str(tuple(p.shape)):9} placements {p.placements}: "
              f"local shard {tuple(p.to_local().shape)}")
    local_numel = sum(p.to_local().numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)  # after fully_shard: over the DTensor shards
    x, y = _my_slice(images, rank, world_size), _my_slice(labels, rank, world_size)
    F.cross_entropy(model(x), y).backward()                  # gradients are reduce-scattered: each rank keeps its shard
    grad = model[1].weight.grad
    print(f"1.weight.grad is a {type(grad).__name__} with local shard {tuple(grad.to_local().shape)}")
    full_grads = [p.grad.full_tensor() for p in model.parameters()]   # a collective: every rank calls it
    optimizer.step()                                         # each rank updates its own shard only
    moment = optimizer.state[model[1].weight]["exp_avg"]
    print(f"AdamW's exp_avg for 1.weight: {type(moment).__name__}, local shard {tuple(moment.to_local().shape)}")
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    print(f"get_model_state_dict(full_state_dict=True, cpu_offload=True): {len(state)} tensors"
          + (f", e.g. 1.weight {type(state['1.weight']).__name__} {tuple(state['1.weight'].shape)}" if state else ""))
    return {"grads": full_grads, "state": state, "local_numel": local_numel}


def single_process_adamw_step(images: torch.Tensor, labels: torch.Tensor, lr: float) -> dict:
    """One AdamW step of the lesson's model in one process on the whole batch: its new weights."""
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    F.cross_entropy(model(images), labels).backward()
    optimizer.step()
    return {name: p.detach().clone() for name, p in model.state_dict().items()}


def fsdp_precision(rank: int, world_size: int, images: torch.Tensor, labels: torch.Tensor) -> dict:
    """The dtypes FSDP2 sends and computes in, under three MixedPrecisionPolicy settings."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    x, y = _my_slice(images, rank, world_size), _my_slice(labels, rank, world_size)
    seen = {}
    real = {name: getattr(dist, name) for name in ("all_gather_single", "reduce_scatter_single")}

    def spy(name):
        def collective(output, input, *args, **kwargs):
            seen.setdefault(name, input.dtype)
            return real[name](output, input, *args, **kwargs)
        return collective

    rows = {}
    policies = {"default": MixedPrecisionPolicy(),
                "param bf16, reduce fp32": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
                "param bf16": MixedPrecisionPolicy(param_dtype=torch.bfloat16)}
    for label, policy in policies.items():
        seen.clear()
        model = make_model()
        compute = []
        model[1].register_forward_pre_hook(lambda module, args: compute.append(module.weight.dtype))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        for name in real:
            setattr(dist, name, spy(name))
        try:
            F.cross_entropy(model(x).float(), y).backward()
        finally:
            for name, fn in real.items():
                setattr(dist, name, fn)
        rows[label] = {"compute": compute[0], "all_gather": seen.get("all_gather_single"),
                       "reduce_scatter": seen.get("reduce_scatter_single"), "param": model[1].weight.dtype,
                       "grad": model[1].weight.grad.dtype}
    if rank == 0:
        print(f"{'mp_policy':24} {'forward in':11} {'all-gather':11} {'reduce-scatter':15} {'sharded param':14} grad")
        for label, r in rows.items():
            print(f"{label:24} {_short(r['compute']):11} {_short(r['all_gather']):11} {_short(r['reduce_scatter']):15} "
                  f"{_short(r['param']):14} {_short(r['grad'])}")
    return rows


def _short(dtype) -> str:
    return str(dtype).replace("torch.", "") if dtype is not None else "-"


class TwoHeads(nn.Module):
    """A shared body with one head per task; a batch of one task leaves the other head unused."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(64, 32)
        self.digits = nn.Linear(32, 10)
        self.parity = nn.Linear(32, 2)

    def forward(self, x: torch.Tensor, task: str = "digits") -> torch.Tensor:
        h = F.relu(self.body(x.flatten(1)))
        return self.digits(h) if task == "digits" else self.parity(h)


def unused_parameters(rank: int, world_size: int, images: torch.Tensor, labels: torch.Tensor, find_unused: bool) -> str:
    """Two DDP steps of TwoHeads on the digits task only: the parity head never gets a gradient."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(TwoHeads(), find_unused_parameters=find_unused)
    x, y = _my_slice(images, rank, world_size), _my_slice(labels, rank, world_size)
    say = print if rank == 0 else (lambda *args: None)      # the ranks fail alike: rank 0 speaks for both
    for step in range(2):
        try:
            F.cross_entropy(model(x), y).backward()
        except RuntimeError as err:
            first = str(err).split(". ")[0]
            say(f"step {step}: RuntimeError: {first}.")
            unused = re.search(r"did not receive grad for rank \d+: ([\d ]+)", str(err))
            names = [n for n, _ in model.module.named_parameters()]
            if unused:
                say(f"        parameters that received no gradient: {[names[int(i)] for i in unused.group(1).split()]}")
            return first
        say(f"step {step}: loss computed, backward done")
    return ""


def diverge(rank: int, world_size: int, timeout_s: float) -> str:
    """Rank 0 calls all_reduce, the others skip it: rank 0 waits until the group's timeout, then raises."""
    group = dist.new_group(timeout=timedelta(seconds=timeout_s))   # a group with a short timeout, for this demo
    if rank == 0:
        try:
            dist.all_reduce(torch.ones(3), group=group)
        except RuntimeError as err:
            first = re.sub(r"^\[[^\]]*\] ", "", str(err).strip().splitlines()[0])   # drop gloo's [source file:line]
            print(f"{type(err).__name__}: {first}")
            return first
        return ""
    print("skipped the all_reduce (say, `if not torch.isfinite(loss): continue` was true only here)")
    return ""


# Simulated ranks: threads of this process, with torch.distributed's collectives replaced by exact in-memory ones.

class _Hang(BaseException):  # not an Exception: call() must not turn it into "your code raised"
    """A simulated rank waited in a collective that another rank never joined."""


class _Work:
    """What an async collective returns. As with real gloo, the tensor holds the result only once wait() returned
    (here: not one moment before), so a forgotten wait() leaves the input as it was."""

    def __init__(self, world: "_SimulatedWorld", apply: Callable[[], None], tensors: list):
        self._world, self._apply, self._tensors, self._done = world, apply, tensors, False
        world.pending[world.rank()].append(self)

    def wait(self, timeout=None) -> bool:
        if not self._done:
            self._done = True
            self._apply()
            self._world.pending[self._world.rank()].remove(self)
        return True

    def is_completed(self) -> bool:
        return self.wait()

    def get_future(self) -> "_Future":
        return _Future(self)

    def result(self) -> list:
        self.wait()
        return self._tensors


class _Future:
    def __init__(self, work: _Work):
        self._work = work

    def wait(self) -> list:
        return self._work.result()

    def value(self) -> list:
        return self._work.result()

    def done(self) -> bool:
        return self._work.wait()

    def then(self, callback: Callable) -> "_Future":
        self._work.wait()
        value = callback(self)
        done = _Work(self._work._world, lambda: None, value)
        done.wait()
        return _Future(done)


_REDUCE_OPS = {"SUM": lambda s: s.sum(0), "AVG": lambda s: s.mean(0) if s.is_floating_point() else s.sum(0) // len(s),
               "MAX": lambda s: s.max(0).values, "MIN": lambda s: s.min(0).values, "PRODUCT": lambda s: s.prod(0)}


class _SimulatedWorld:
    """world_size ranks as threads, each calling the learner's function with torch.distributed patched.

    The checks use it instead of real processes, which take seconds to start. It keeps the real API's
    contract where a learner's answer can tell: collectives modify their tensors in place, async ones
    only at wait(); wrong argument types raise TypeError as torch does; tensors of different sizes on
    different ranks raise as gloo does. It records every call, and turns a collective that not every
    rank joins into an error instead of a hang.
    """

    PATCHED = ("all_reduce", "reduce", "broadcast", "all_gather", "all_gather_object", "all_gather_into_tensor",
               "all_gather_single", "barrier", "get_rank", "get_world_size", "is_initialized", "get_backend")

    def __init__(self, world_size: int, timeout: float = 1.5):
        self.world_size = world_size
        self._gate = threading.Barrier(world_size, timeout=timeout)
        self.slots: list = [None] * world_size
        self.local = threading.local()
        self.events: list[list[str]] = [[] for _ in range(world_size)]
        self.pending: list[list[_Work]] = [[] for _ in range(world_size)]
        self.unwaited: set[int] = set()  # ranks that returned with an async collective never waited on
        self.hung: dict[int, str] = {}

    def rank(self) -> int:
        return self.local.rank

    def _sync(self, op: str) -> None:
        try:
            self._gate.wait()
        except threading.BrokenBarrierError:
            self.hung.setdefault(self.rank(), op)
            raise _Hang(op) from None

    def _exchange(self, op: str, payload) -> list:
        rank = self.rank()
        self.events[rank].append(op)
        self.slots[rank] = (op, payload)
        self._sync(op)
        seen = list(self.slots)
        self._sync(op)  # everyone has read the slots before anyone reuses them
        if len({s[0] for s in seen}) > 1:
            raise _Hang(f"mismatched collectives {[s[0] for s in seen]}")
        return [s[1] for s in seen]

    @staticmethod
    def _tensor(op: str, tensor) -> torch.Tensor:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"Invalid function argument. Expected parameter `tensor` of type torch.Tensor but got "
                            f"{type(tensor)} instead.")  # torch.distributed's own wording
        return tensor

    @staticmethod
    def _op(op) -> str:
        if not isinstance(op, (dist.ReduceOp, dist.ReduceOp.RedOpType)):
            raise TypeError(f"allreduce(): incompatible function arguments: op must be a torch.distributed.ReduceOp, "
                            f"got {type(op).__name__}")
        name = str(op).split(".")[-1]
        if name not in _REDUCE_OPS:
            raise ValueError(f"unsupported op {op} in this lesson's simulated ranks")
        return name

    def _same_sizes(self, op: str, values: list[torch.Tensor]) -> None:
        sizes = {v.numel() for v in values}
        if len(sizes) > 1:
            raise RuntimeError(f"{op}: received data size doesn't match expected size: the ranks passed tensors of "
                               f"{[v.numel() for v in values]} elements. Is there a distributed collective mismatch?")

    def _finish(self, apply: Callable[[], None], tensors: list, async_op: bool):
        if async_op:
            return _Work(self, apply, tensors)
        apply()
        return None

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        tensor, name = self._tensor("all_reduce", tensor), self._op(op)
        values = self._exchange("all_reduce", tensor.detach().clone())
        self._same_sizes("all_reduce", values)
        result = _REDUCE_OPS[name](torch.stack([v.reshape(tensor.shape) for v in values])).to(tensor.dtype)

        def apply():
            with torch.no_grad():
                tensor.copy_(result)
        return self._finish(apply, [tensor], async_op)

    def reduce(self, tensor, dst=None, op=dist.ReduceOp.SUM, group=None, async_op=False, group_dst=None):
        tensor, name = self._tensor("reduce", tensor), self._op(op)
        dst = group_dst if dst is None else dst
        values = self._exchange("reduce", tensor.detach().clone())
        self._same_sizes("reduce", values)
        result = _REDUCE_OPS[name](torch.stack([v.reshape(tensor.shape) for v in values])).to(tensor.dtype)

        def apply():
            if self.rank() == (dst or 0):
                with torch.no_grad():
                    tensor.copy_(result)
        return self._finish(apply, [tensor], async_op)

    def broadcast(self, tensor, src=None, group=None, async_op=False, group_src=None):
        tensor = self._tensor("broadcast", tensor)
        src = group_src if src is None else src
        values = self._exchange("broadcast", tensor.detach().clone())
        self._same_sizes("broadcast", values)

        def apply():
            with torch.no_grad():
                tensor.copy_(values[src or 0].reshape(tensor.shape))
        return self._finish(apply, [tensor], async_op)

    def all_gather(self, tensor_list, tensor, group=None, async_op=False):
        tensor = self._tensor("all_gather", tensor)
        if not isinstance(tensor_list, list) or len(tensor_list) != self.world_size:
            raise ValueError(f"all_gather: tensor_list must be a list of world_size ({self.world_size}) tensors")
        values = self._exchange("all_gather", tensor.detach().clone())
        for i, out in enumerate(tensor_list):
            if not isinstance(out, torch.Tensor) or out.shape != values[i].shape:
                raise RuntimeError(f"ProcessGroupGloo::allgather: invalid tensor size at index {i} (expected "
                                   f"{tuple(values[i].shape)}, got {tuple(getattr(out, 'shape', ()))})")

        def apply():
            with torch.no_grad():
                for out, v in zip(tensor_list, values):
                    out.copy_(v)
        return self._finish(apply, tensor_list, async_op)

    def all_gather_single(self, output_tensor, input_tensor, group=None, async_op=False):
        tensor = self._tensor("all_gather_single", input_tensor)
        values = self._exchange("all_gather_single", tensor.detach().clone())
        self._same_sizes("all_gather_single", values)
        gathered = torch.cat([v.reshape(-1) for v in values])
        if not isinstance(output_tensor, torch.Tensor) or output_tensor.numel() != gathered.numel():
            raise ValueError(f"all_gather_single: the output tensor must hold world_size x {tensor.numel()} elements")

        def apply():
            with torch.no_grad():
                output_tensor.copy_(gathered.reshape(output_tensor.shape))
        return self._finish(apply, [output_tensor], async_op)

    all_gather_into_tensor = all_gather_single

    def all_gather_object(self, object_list, obj, group=None):
        values = self._exchange("all_gather_object", obj)
        for i, v in enumerate(values):
            object_list[i] = v

    def barrier(self, group=None, async_op=False, device_ids=None):
        self._exchange("barrier", None)
        return self._finish(lambda: None, [], async_op)

    def get_rank(self, group=None):
        return self.rank()

    def get_world_size(self, group=None):
        return self.world_size

    def is_initialized(self):
        return True

    def get_backend(self, group=None):
        return "gloo"

    def run(self, fn: Callable[[int], object], learner: Callable | None = None) -> list:
        """Run fn(rank) on one thread per rank with torch.distributed patched; return [(value, exception)] per rank.

        Names in the learner function's globals bound to the real collectives (from torch.distributed import
        all_reduce) are pointed at the simulated ones too, for the run only.
        """
        outcome: list = [(None, None)] * self.world_size

        def body(rank: int) -> None:
            self.local.rank = rank
            try:
                outcome[rank] = (fn(rank), None)
            except BaseException as err:  # noqa: BLE001 -- reported by the check
                outcome[rank] = (None, err)
                if not isinstance(err, _Hang):
                    self._gate.abort()  # the others would wait for this rank forever
            if self.pending[rank]:
                self.unwaited.add(rank)

        saved = {name: getattr(dist, name) for name in self.PATCHED}
        c10d = dist.distributed_c10d  # where the collectives are defined: a learner may call them from there
        defined = {name: getattr(c10d, name) for name in self.PATCHED if getattr(c10d, name, None) is saved[name]}
        namespace = getattr(learner, "__globals__", None)
        if not isinstance(namespace, dict):
            namespace = {}
        rebound = {key: value for key, value in namespace.items()
                   if any(value is real for real in saved.values()) and not key.startswith("__")}
        for name in self.PATCHED:
            setattr(dist, name, getattr(self, name))
        for name in defined:
            setattr(c10d, name, getattr(self, name))
        for key, value in rebound.items():
            namespace[key] = getattr(self, next(n for n, real in saved.items() if real is value))
        try:
            threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(self.world_size)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(10)
        finally:
            for name, value in saved.items():
                setattr(dist, name, value)
            for name, value in defined.items():
                setattr(c10d, name, value)
            namespace.update(rebound)
        return outcome


def _raise_first_error(outcome: list, what: str, hints: dict[str, str] | None = None) -> None:
    """Report a learner's exception on a simulated rank in one line, naming the rank (the untouched stub passes through)."""
    for rank, (_, err) in enumerate(outcome):
        if isinstance(err, NotImplementedError) and stub_function(err):
            raise err
    for rank, (_, err) in enumerate(outcome):
        if isinstance(err, SystemExit):
            raise ExerciseFailed(f"{what}: rank {rank} called exit() (SystemExit: {err.code}): return a value instead")
        if err is not None and not isinstance(err, _Hang):
            frame = learner_frame(err)
            advice = error_hint(err, {**ERROR_HINTS, **(hints or {})})
            raise ExerciseFailed(f"{what} raised {type(err).__name__} on rank {rank}: {first_line(err)}"
                                 f"{where(frame) if frame else ''}{advice}")


def _raise_hang(world: _SimulatedWorld, what: str) -> None:
    if not world.hung:
        return
    waiting = min(world.hung)
    absent = [r for r in range(world.world_size) if not world.events[r]]
    raise ExerciseFailed(
        f"{what}: rank {waiting} waited in {world.hung[waiting]} for ranks that never joined it "
        f"{'(ranks ' + str(absent) + ' called no collective)' if absent else '(they called other collectives)'}: "
        "every rank must call the same collectives in the same order; a real job would hang here"
    )


def _raise_unwaited(world: _SimulatedWorld, what: str) -> None:
    if world.unwaited:
        rank = min(world.unwaited)
        raise ExerciseFailed(
            f"{what}: rank {rank} started a collective with async_op=True and never called .wait() on the work it "
            "returned: the tensor holds the result only after wait() returns"
        )


@contextlib.contextmanager
def _single_rank_group():
    """A real one-rank gloo process group in this process (for DDP and FSDP in a check); destroyed afterwards."""
    created = not dist.is_initialized()
    hook = sys.excepthook  # init_process_group wraps it to prefix "[rank0]:"; leave the learner's process as it was
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.get_world_size() == 1
    finally:
        if created:
            dist.destroy_process_group()
        sys.excepthook = hook


def _real_once(fn: Callable, args: tuple, what: str, shown: str):
    """Call the learner's function once in a real one-rank gloo group: the API's own checks, not the stand-in's."""
    with _single_rank_group() as usable:
        if not usable:
            return None
        try:
            return call(fn, *args, shown=shown)
        except ExerciseFailed as err:
            raise ExerciseFailed(f"with a real one-rank gloo process group, {err.message}") from None


# Checks, one per exercise, in notebook order.

def _accuracy_case(sizes: list[int], n_classes: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-rank (logits, labels) with shares of the given sizes and local accuracies that differ between ranks."""
    g = torch.Generator().manual_seed(seed)
    shares = []
    for rank, n in enumerate(sizes):
        labels = torch.randint(0, n_classes, (n,), generator=g)
        logits = torch.randn(n, n_classes, generator=g)
        right = torch.rand(n, generator=g) < (0.9 if rank % 2 == 0 else 0.3)   # one rank good, the next poor
        logits[right, labels[right]] += 10.0                                    # no ties: a clear argmax
        shares.append((logits, labels))
    return shares


@exercise("global_accuracy")
def check_global_accuracy(fn) -> None:
    expect_callable(fn)
    hints = {"must match the size": "the ranks' shares differ in size: all_reduce sums, it does not concatenate",
             "received data size": "every rank must pass a tensor of the same size to a collective",
             "invalid tensor size": "all_gather needs tensors of the same size on every rank; the shares differ"}
    for sizes, n_classes, seed in [([7, 3], 12, 1), ([5, 0, 9], 11, 2), ([1, 6], 13, 4)]:  # uneven, empty, one sample
        world_size = len(sizes)
        shares = _accuracy_case(sizes, n_classes, seed)
        originals = [(x.clone(), y.clone()) for x, y in shares]
        correct = [int((x.argmax(1) == y).sum()) for x, y in shares]
        expected = sum(correct) / sum(sizes)
        what = f"global_accuracy(logits, labels) on {world_size} ranks with {sizes} samples"
        world = _SimulatedWorld(world_size)
        outcome = world.run(lambda rank: fn(*shares[rank]), learner=fn)
        _raise_first_error(outcome, what, hints)
        _raise_hang(world, what)
        _raise_unwaited(world, what)
        for rank, ((x, y), (x0, y0)) in enumerate(zip(shares, originals)):
            if not (torch.equal(x, x0) and torch.equal(y, y0)):
                which = "logits" if not torch.equal(x, x0) else "labels"
                raise ExerciseFailed(f"{what}: rank {rank}'s {which} changed: leave the inputs as they are (collectives, "
                                     "and methods whose name ends in _, work in place)")
        got = [value for value, _ in outcome]
        for rank, value in enumerate(got):
            if isinstance(value, torch.Tensor):
                raise ExerciseFailed(f"{what}: rank {rank} returned a tensor, expected a Python float: call .item() on it")
            if not isinstance(value, float) or isinstance(value, bool):
                raise ExerciseFailed(f"{what}: rank {rank} returned {a_type(value)}, expected a Python float")
        if not any(world.events):
            raise ExerciseFailed(f"{what} called no collective, so each rank knew only its own samples: combine the "
                                 "ranks' counts with dist.all_reduce")
        if all(math.isclose(v, expected, rel_tol=1e-6) for v in got):  # float32 sums are fine
            continue
        local = [c / n if n else math.nan for c, n in zip(correct, sizes)]
        mean_of_means = sum(local) / world_size
        if any(math.isnan(v) for v in got) and 0 in sizes:
            raise ExerciseFailed(f"{what}: got nan; rank {sizes.index(0)} has no samples, so its own accuracy is 0/0: "
                                 "all-reduce the number of correct predictions and the number of samples, then divide")
        if all(math.isclose(v, mean_of_means, rel_tol=1e-6) for v in got):
            raise ExerciseFailed(f"{what} returned the mean of the ranks' accuracies, {mean_of_means:.4f}; with shares of "
                                 f"different sizes that is not the accuracy over all samples ({expected:.4f}): all-reduce "
                                 "the counts of correct predictions and of samples, then divide")
        if any(not math.isclose(v, got[0], rel_tol=1e-6) for v in got if not math.isnan(v)):
            used_reduce = any("reduce" in events for events in world.events)
            raise ExerciseFailed(f"{what}: the ranks returned different values {[round(v, 4) for v in got]}: every rank "
                                 "must end with the same global accuracy"
                                 + (" (dist.reduce leaves the result on one rank only; dist.all_reduce on all)" if used_reduce else ""))
        raise ExerciseFailed(f"{what}: expected {expected:.6g} on every rank, got {[round(v, 6) for v in got]}")
    logits, labels = _accuracy_case([6], 10, 3)[0]
    value = _real_once(fn, (logits, labels), "global_accuracy", "logits, labels")
    expected = float((logits.argmax(1) == labels).float().mean())
    if value is not None and not (isinstance(value, float) and math.isclose(value, expected, rel_tol=1e-6)):
        raise ExerciseFailed(f"with a real one-rank gloo process group, global_accuracy returned {value!r}, expected {expected:.6g}")


class _ScaledNet(nn.Module):
    """Three layers, the middle one frozen, plus a parameter registered directly on the model."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.first = nn.Linear(4, 6)
        self.frozen = nn.Linear(6, 6).requires_grad_(False)  # no .grad: skip it
        self.last = nn.Linear(6, 3)
        self.scale = nn.Parameter(torch.tensor([1.5, 0.5, 1.0]))
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(torch.tanh(self.frozen(torch.tanh(self.first(x))))) * self.scale


def _replicas_with_local_grads(world_size: int, seed: int = 0) -> list[nn.Module]:
    """One replica per rank, same weights, each with the gradient of its own batch."""
    replicas = []
    for rank in range(world_size):
        model = _ScaledNet(seed)
        g = torch.Generator().manual_seed(100 + rank + 10 * seed)
        x, y = torch.randn(5, 4, generator=g), torch.randint(0, 3, (5,), generator=g)
        F.cross_entropy(model(x), y).backward()
        replicas.append(model)
    return replicas


@exercise("average_gradients")
def check_average_gradients(fn) -> None:
    expect_callable(fn)
    hints = {"NoneType": "a frozen parameter has p.grad None: leave those out",
             "got None": "a frozen parameter has p.grad None: leave those out",
             "view size is not compatible": "view() of a non-contiguous tensor; reshape() copies when it must"}
    for world_size in (2, 3):
        replicas = _replicas_with_local_grads(world_size, seed=world_size)
        names = [n for n, _ in replicas[0].named_parameters()]
        weights = [[p.detach().clone() for p in m.parameters()] for m in replicas]
        local = [[None if p.grad is None else p.grad.clone() for p in m.parameters()] for m in replicas]
        trainable = [i for i, g in enumerate(local[0]) if g is not None]
        mean = {i: torch.stack([local[r][i] for r in range(world_size)]).mean(0) for i in trainable}
        world = _SimulatedWorld(world_size)
        what = f"average_gradients(model) on {world_size} ranks"
        outcome = world.run(lambda rank: fn(replicas[rank]), learner=fn)
        _raise_first_error(outcome, what, hints)
        _raise_hang(world, what)
        grads = [[p.grad for p in m.parameters()] for m in replicas]
        if any(grads[r][i] is not None for r in range(world_size) for i in range(len(names)) if i not in trainable):
            raise ExerciseFailed(f"{what} gave the frozen parameter frozen.weight a gradient: leave parameters whose "
                                 ".grad is None as they are")
        if any(not torch.equal(p.detach(), w) for m, ws in zip(replicas, weights) for p, w in zip(m.parameters(), ws)):
            raise ExerciseFailed(f"{what} changed the parameters themselves: average the gradients p.grad, not the parameters")
        calls = [len(e) for e in world.events]
        if not any(calls):
            raise ExerciseFailed(f"{what} called no collective: put every gradient into one tensor and all-reduce it")
        if max(calls) > 1:
            raise ExerciseFailed(
                f"{what} called {max(calls)} collectives on each rank ({', '.join(sorted(set(world.events[0])))}): "
                "put every gradient into one flat tensor (torch.cat) and all-reduce it once, as one DDP bucket"
            )
        _raise_unwaited(world, what)
        untouched = all(torch.equal(grads[r][i], local[r][i]) for r in range(world_size) for i in trainable)
        if untouched:
            raise ExerciseFailed(
                f"{what} called {world.events[0][0]}, but every .grad is as it was: the averaged values must end up in "
                "each p.grad (a flat tensor made with torch.cat is a copy)"
            )

        def agrees(r, scale=1.0):
            return all(grads[r][i] is not None and grads[r][i].shape == mean[i].shape
                       and torch.allclose(grads[r][i], mean[i] * scale, atol=1e-6) for i in trainable)
        if all(agrees(r, world_size) for r in range(world_size)):
            raise ExerciseFailed(f"{what} left the SUM of the ranks' gradients, {world_size} times the mean: divide by "
                                 "dist.get_world_size() (or use op=dist.ReduceOp.AVG)")
        if world_size == 3 and all(agrees(r, 1.5) for r in range(world_size)):
            raise ExerciseFailed(f"{what} divided the sum by 2: divide by dist.get_world_size(), not a fixed number")
        if agrees(0) and not all(agrees(r) for r in range(world_size)):
            used_reduce = any("reduce" in events for events in world.events)
            raise ExerciseFailed(f"{what}: only rank 0 got the mean gradients, and every rank needs them for its optimizer "
                                 "step" + ("; dist.reduce leaves the result on one rank, dist.all_reduce on every rank"
                                           if used_reduce else ""))
        for r in range(world_size):
            for i in trainable:
                got = grads[r][i]
                if got is None or got.shape != mean[i].shape:
                    raise ExerciseFailed(f"{what}: on rank {r}, {names[i]}.grad became "
                                         f"{'None' if got is None else 'of shape ' + str(tuple(got.shape))}, expected "
                                         f"shape {tuple(mean[i].shape)}")
                if not torch.allclose(got, mean[i], atol=1e-6):
                    raise ExerciseFailed(
                        f"{what}: on rank {r}, {names[i]}.grad is not the mean of the ranks' gradients "
                        f"(e.g. {got.flatten()[0].item():.6g}, expected {mean[i].flatten()[0].item():.6g}): are the "
                        "values copied back to the parameters they came from, in order?"
                    )
    model = _replicas_with_local_grads(1, seed=7)[0]
    before = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    _real_once(fn, (model,), "average_gradients", "model")
    for name, p in model.named_parameters():
        if name in before and not torch.allclose(p.grad, before[name], atol=1e-6):
            raise ExerciseFailed(f"with a real one-rank gloo process group, average_gradients changed {name}.grad, "
                                 "though the mean over one rank is its own gradient")


def _counted_ddp(seed: int):
    """A real one-rank DDP model of _ScaledNet whose all-reduces and forwards are counted."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(_ScaledNet(seed).requires_grad_(True))
    log = {"forwards": 0, "syncs": [], "steps": []}

    def count_forward(module, args):
        log["forwards"] += 1
    model.module.register_forward_pre_hook(count_forward)

    def counting_allreduce(state, bucket):
        log["syncs"].append(log["forwards"])  # how many forward passes had run when this all-reduce started
        fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
        return fut.then(lambda fut: fut.value()[0])

    model.register_comm_hook(None, counting_allreduce)
    return model, log


def _plain_training(seed: int, micro: list, groups: list[list[int]], lr: float, *, divide_by: int | None = None,
                    zero: str = "before") -> list[torch.Tensor]:
    """SGD on a plain _ScaledNet that starts with stale gradients: one step per group of micro-batch indices.

    zero: when the gradients are zeroed, "before" each group (right), "never", "once" at the start, or "after" each step.
    """
    model = _ScaledNet(seed).requires_grad_(True)
    for p in model.parameters():
        p.grad = torch.full_like(p, _STALE)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    if zero == "once":
        optimizer.zero_grad()
    for group in groups:
        if zero == "before":
            optimizer.zero_grad()
        for i in group:
            inputs, targets = micro[i]
            (F.cross_entropy(model(inputs), targets) / (divide_by or len(group))).backward()
        optimizer.step()
        if zero == "after":
            optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


_STALE = 0.25  # the gradient every parameter holds when train_accumulated is called


@exercise("train_accumulated")
def check_train_accumulated(fn) -> None:
    expect_callable(fn)
    for n_micro, accumulate in [(7, 3), (4, 4), (3, 1)]:
        g = torch.Generator().manual_seed(20 + n_micro)
        micro = [(torch.randn(4, 4, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(n_micro)]
        groups = [list(range(s, min(s + accumulate, n_micro))) for s in range(0, n_micro, accumulate)]
        ends = [group[-1] + 1 for group in groups]
        lr = 0.5
        what = f"train_accumulated(ddp_model, optimizer, {n_micro} micro-batches, accumulate={accumulate})"
        with _single_rank_group():
            ddp, log = _counted_ddp(3)
            for p in ddp.parameters():  # stale gradients from an earlier step
                p.grad = torch.full_like(p, _STALE)
            optimizer = torch.optim.SGD(ddp.parameters(), lr=lr)
            optimizer.register_step_post_hook(lambda opt, args, kwargs: log["steps"].append(log["forwards"]))
            call(fn, ddp, optimizer, micro, accumulate, shown=f"ddp_model, optimizer, {n_micro} micro-batches, {accumulate}")
        names = [n for n, _ in ddp.module.named_parameters()]
        got = [p.detach() for p in ddp.module.parameters()]
        steps, syncs = log["steps"], log["syncs"]
        if not steps:
            raise ExerciseFailed(f"{what} never called optimizer.step()")
        if len(steps) == n_micro and n_micro != len(groups):
            raise ExerciseFailed(f"{what} stepped the optimizer after every micro-batch: step once per group of "
                                 f"{accumulate} ({len(groups)} steps here)")
        if len(steps) == n_micro // accumulate and n_micro % accumulate:
            raise ExerciseFailed(f"{what} stepped {len(steps)} times: the last {n_micro % accumulate} micro-batch(es) "
                                 f"form a shorter group that needs its own step ({len(groups)} steps here)")
        if log["forwards"] != n_micro:
            raise ExerciseFailed(f"{what} ran {log['forwards']} forward passes, expected one per micro-batch ({n_micro})")
        if steps != ends:
            raise ExerciseFailed(f"{what} stepped after micro-batches {steps}, expected after {ends}")
        if not syncs:
            raise ExerciseFailed(f"{what} never all-reduced the gradients: run the forward and backward of the last "
                                 "micro-batch of each group outside no_sync(), through ddp_model(...)")
        if len(set(syncs)) == n_micro and n_micro != len(groups):
            raise ExerciseFailed(f"{what} all-reduced after every micro-batch: run all but the last micro-batch of each "
                                 "group inside `with ddp_model.no_sync():`, forward and backward (DDP decides at "
                                 "forward time whether to sync)")
        if sorted(set(syncs)) != ends:
            raise ExerciseFailed(f"{what} all-reduced after micro-batches {sorted(set(syncs))}, expected once per group, "
                                 f"after micro-batches {ends}: only the last micro-batch of a group syncs")

        def same(weights):
            return all(torch.allclose(a, b, atol=1e-5) for a, b in zip(got, weights))
        if same(_plain_training(3, micro, groups, lr)):
            continue
        if n_micro % accumulate and same(_plain_training(3, micro, groups, lr, divide_by=accumulate)):
            raise ExerciseFailed(f"{what}: the last, shorter group divided its loss by {accumulate}: divide by the "
                                 "number of micro-batches in the group, so that each step uses the mean loss")
        if same(_plain_training(3, micro, groups, lr, divide_by=1)):
            raise ExerciseFailed(f"{what} stepped on the sum of the micro-batch losses: divide each by the number of "
                                 "micro-batches in its group, so that each step uses the mean loss")
        for zero, fault in [("never", "never zeroed the gradients, so each group's gradients leaked into the later steps"),
                            ("once", "zeroed the gradients only once, so each group's gradients leaked into the later steps"),
                            ("after", "zeroed the gradients only after each step, so the stale ones the model came with "
                                      "leaked into the first step")]:
            if same(_plain_training(3, micro, groups, lr, zero=zero)):
                raise ExerciseFailed(f"{what} {fault}: zero them before each group")
        expected = _plain_training(3, micro, groups, lr)
        name = next(n for n, a, b in zip(names, got, expected) if not torch.allclose(a, b, atol=1e-5))
        raise ExerciseFailed(f"{what}: {name} after training differs from SGD on the mean loss of each group "
                             "(the gradient of the mean loss over its micro-batches, one step per group)")


def _fsdp_units(model: nn.Module) -> dict[str, bool]:
    from torch.distributed.fsdp import FSDPModule

    return {name: isinstance(m, FSDPModule) for name, m in model.named_modules()}


def _raise_precision_fault(what: str, compute: dict[str, torch.dtype], head: str, crashed: str | None = None) -> None:
    """Fail unless every Linear recorded so far computed in bfloat16; say which units lack the policy."""
    if torch.float16 in compute.values():
        raise ExerciseFailed(f"{what}: the model computed in float16; the exercise asks for bfloat16, which keeps "
                             "float32's range")
    blocks = {dtype for name, dtype in compute.items() if name != head}
    head_dtype = compute.get(head)
    why = f" (the forward then raised {crashed.split(' raised ', 1)[-1]})" if crashed else ""
    if torch.float32 in blocks and (head_dtype == torch.bfloat16 or crashed):
        raise ExerciseFailed(f"{what}: the blocks computed in float32 but the head in bfloat16{why}: give each Block's "
                             "fully_shard the mixed-precision policy too")
    if blocks == {torch.bfloat16} and head_dtype == torch.float32:
        raise ExerciseFailed(f"{what}: the blocks computed in bfloat16 but the head in float32{why}: give the root's "
                             "fully_shard the same policy")
    if blocks | {head_dtype} != {torch.bfloat16}:
        raise ExerciseFailed(f"{what}: the model computed in {_short(head_dtype or next(iter(blocks), None))}{why}: give "
                             "fully_shard a MixedPrecisionPolicy whose param_dtype is torch.bfloat16")


@exercise("shard_model")
def check_shard_model(fn) -> None:
    expect_callable(fn)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    for dim, n_blocks, n_classes, seed in [(12, 3, 7, 4), (8, 2, 11, 5)]:
        model = block_model(dim, n_blocks, n_classes, seed)
        what = f"shard_model(model with {n_blocks} Blocks and a head, mesh)"
        old = {id(p) for p in model.parameters()}
        compute: dict[str, torch.dtype] = {}

        def recorder(name):
            def record(module, args):
                compute.setdefault(name, module.weight.dtype)  # the weight FSDP gathered for this forward
            return record
        for name, m in model.named_modules():
            if isinstance(m, nn.Linear):
                m.register_forward_pre_hook(recorder(name))
        g = torch.Generator().manual_seed(seed)
        x, y = torch.randn(6, dim, generator=g), torch.randint(0, n_classes, (6,), generator=g)
        with _single_rank_group() as usable:
            if not usable:
                raise ExerciseFailed("a process group of several ranks is already initialized in this kernel, so the "
                                     "check cannot build its one-rank mesh: restart the kernel")
            mesh = init_device_mesh("cpu", (1,))
            optimizer = call(fn, model, mesh, shown="model, mesh")
            if optimizer is None:
                raise ExerciseFailed(f"{what} returned None: return the optimizer you made for the sharded model")
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise ExerciseFailed(f"{what} returned {a_type(optimizer)}, expected a torch.optim.Optimizer")
            units = _fsdp_units(model)
            blocks = [str(i) for i in range(n_blocks)]
            if not units[""]:
                raise ExerciseFailed(f"{what}: the model itself is not sharded: call fully_shard on the root too, after "
                                     "the blocks, so that it holds whatever the blocks do not (the head)")
            missing = [b for b in blocks if not units[b]]
            if missing:
                raise ExerciseFailed(f"{what}: block {missing[0]} is not an FSDP unit of its own: call fully_shard on "
                                     "each Block before the root")
            inner = [name for name, unit in units.items() if unit and "." in name]
            if inner:
                raise ExerciseFailed(f"{what} made {inner[0]} a unit of its own: each Block is one unit, gathered whole "
                                     "just before it runs; do not shard the layers inside it separately")
            params = list(model.parameters())
            held = [p for group in optimizer.param_groups for p in group["params"]]
            if held and all(id(p) in old for p in held):
                raise ExerciseFailed(f"{what} returned an optimizer made before fully_shard: it holds the old parameters, "
                                     "which fully_shard replaced by DTensors, so its step would update nothing the model "
                                     "uses; make the optimizer after sharding")
            if {id(p) for p in held} != {id(p) for p in params} or len(held) != len(params):
                raise ExerciseFailed(f"{what}: the optimizer holds {len(held)} tensors, the model has {len(params)} "
                                     "parameters: give it model.parameters() after sharding")
            if type(optimizer) is not torch.optim.AdamW:
                raise ExerciseFailed(f"{what} returned {type_name(optimizer)}, expected torch.optim.AdamW")
            lr = optimizer.param_groups[0].get("lr")
            if lr != 1e-3:
                raise ExerciseFailed(f"{what}: the optimizer's lr is {lr!r}, expected 1e-3")
            low = [name for name, p in model.named_parameters() if p.dtype != torch.float32]
            if low:
                raise ExerciseFailed(f"{what}: the sharded parameter {low[0]} is {_short(dict(model.named_parameters())[low[0]].dtype)}: "
                                     "keep the parameters (and so the optimizer's step) in float32; the policy casts "
                                     "copies for the forward and backward")
            if not all(isinstance(p, DTensor) for p in params):
                raise ExerciseFailed(f"{what}: not every parameter is a DTensor: shard the root with fully_shard")
            before = [p.detach().full_tensor().clone() for p in params]
            try:
                out = call(model, x, name="the sharded model", kind="module")
            except ExerciseFailed as err:
                if "must have the same dtype" in err.message:  # a bfloat16 unit fed a float32 one, or the reverse
                    _raise_precision_fault(what, compute, str(n_blocks), crashed=err.message)
                raise
            if not isinstance(out, torch.Tensor):
                raise ExerciseFailed(f"the sharded model returned {a_type(out)}, expected a tensor of logits")
            _raise_precision_fault(what, compute, str(n_blocks))
            F.cross_entropy(out.float(), y).backward()
            optimizer.step()
            still = [name for (name, p), b in zip(model.named_parameters(), before) if torch.equal(p.detach().full_tensor(), b)]
            if still:
                raise ExerciseFailed(f"{what}: after one backward and optimizer.step(), {still[0]} did not change")


# The training script: run on two real ranks, judged by what each rank did.

_SCRIPT_EPOCHS, _SCRIPT_BATCH, _SCRIPT_LR = 2, 48, 0.05


def _expect_script(script) -> Path:
    if script is None:
        raise ExerciseFailed("expected the path of your script, got None: run the cell that sets it")
    if isinstance(script, bool) or not isinstance(script, (str, os.PathLike)):
        raise ExerciseFailed(f"expected the path of your script (a str or pathlib.Path), got {a_type(script)}")
    path = Path(script)
    if not path.is_file():
        raise ExerciseFailed(f"expected the path of your script, but {path.name} does not exist: run the %%writefile cell above")
    return path


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _judge_launch(runs: list[RankRun], name: str, timeout: float, grace: float) -> None:
    """Errors first: the untouched stub is 'not attempted'; otherwise the first rank's error, in one line, naming the rank."""
    errors = [(run.record["error"], run) for run in runs if run.record and run.record.get("error")]
    stub = next((err for err, _ in errors if err["stub"]), None)
    if stub:
        raise ExerciseNotAttempted(not_attempted_message("ddp_digits"))  # a rank reached the script's untouched stub
    if errors:
        err, run = min(errors, key=lambda e: e[0]["time"])
        if err["type"] == "SystemExit":
            detail = _last_line(run.stderr)
            raise ExerciseFailed(f"rank {run.rank} exited with code {err['message'].split()[-1]}"
                                 + (f": {detail}" if detail else ""))
        where = f" ({name}, line {err['line']}, in {err['function']})" if err["line"] else ""
        hint = ""
        others = [r for r in runs if r is not run]
        if re.search(r"Connection (closed|reset) by peer", err["message"]) and all(
                r.record and not r.record.get("error") for r in others):
            hint = (f" (rank {others[0].rank} had already finished: a collective that only rank {run.rank} called, "
                    "say inside `if rank == 0:`?)")
        message = err["message"] if err["message"] else "(no message)"
        raise ExerciseFailed(f"rank {run.rank} raised {err['type']}: {message}{where}{hint}")
    killed = [run for run in runs if run.killed]
    if killed and len(killed) == len(runs):
        raise ExerciseFailed(f"no rank finished within {timeout:g} s, so they were stopped: does a rank wait in a "
                             "collective that the other never calls?")
    if killed:
        done = next(run for run in runs if not run.killed)
        raise ExerciseFailed(f"rank {killed[0].rank} was still running {grace:g} s after rank {done.rank} had finished, "
                             "and was stopped: it waited in a collective that rank "
                             f"{done.rank} never called (a barrier or all_reduce inside `if rank == 0:`?)")
    if runs and runs[0].left_behind:
        first = runs[0].left_behind[0]
        raise ExerciseFailed(f"the ranks exited but left {len(runs[0].left_behind)} process(es) running, e.g. "
                             f"{first[:80]!r}: a script must stop what it starts before it ends (the check stopped them)")
    for run in runs:
        if run.record is None:
            code = run.returncode
            how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
            detail = _last_line(run.stderr)
            raise ExerciseFailed(f"rank {run.rank} ended ({how}) before the script finished"
                                 + (f": {detail}" if detail else " without a message (os._exit?)"))


def _one_process(steps: list[list[int]], lr: float, momentum: float = 0.0, zero: bool = True) -> dict[str, torch.Tensor]:
    """The weights of one process trained with SGD on the given global batches (lists of training-set indices)."""
    data = TrainingDigits()
    images, labels = data.images, data.labels
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    for index in steps:
        if zero:
            optimizer.zero_grad()
        F.cross_entropy(model(images[index]), labels[index]).backward()
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b)


def _judge_training(runs: list[RankRun], out: Path) -> None:
    """What the ranks did, in the order a learner should fix it."""
    epochs, batch, lr = _SCRIPT_EPOCHS, _SCRIPT_BATCH, _SCRIPT_LR
    records = [run.record for run in runs]
    n = 1438
    share = n // len(runs)
    for rank, rec in enumerate(records):
        if not rec["models"]:
            raise ExerciseFailed(f"rank {rank} never called make_model(): build the model with "
                                 "course_utils.ddp_models.make_model(), so that the check can follow it")
        reads = rec["reads"]
        if not reads:
            raise ExerciseFailed(f"rank {rank} read no sample of training_digits() in its own process: train on "
                                 "course_utils.ddp_models.training_digits() through a DataLoader without num_workers")
        if len(reads) == epochs * n:
            raise ExerciseFailed(f"rank {rank} read all {n:,} training samples in every epoch: give the DataLoader a "
                                 "DistributedSampler, so that each rank reads its own share")
        if len(reads) == epochs * (share - share % batch):
            raise ExerciseFailed(f"rank {rank} read {share - share % batch} of its {share} samples per epoch: the last, "
                                 "shorter batch was dropped (drop_last=True?); every sample counts once per epoch")
        if len(reads) != epochs * share:
            raise ExerciseFailed(f"rank {rank} read {len(reads)} training samples in {epochs} epochs, expected "
                                 f"{epochs} x {share}: read training_digits() only through the training DataLoader")
    per_epoch = [[rec["reads"][e * share:(e + 1) * share] for e in range(epochs)] for rec in records]
    for e in range(epochs):
        shares = [set(p[e]) for p in per_epoch]
        common = shares[0] & shares[1]
        if common:
            raise ExerciseFailed(f"in epoch {e + 1}, ranks 0 and 1 read {len(common)} of the same samples: each rank must "
                                 "read its own share (DistributedSampler takes the rank and world size from the process "
                                 "group; do not pass other values)")
        if sorted(i for p in per_epoch for i in p[e]) != list(range(n)):
            raise ExerciseFailed(f"in epoch {e + 1}, the ranks together did not read every training sample exactly once")
    for rank, epochs_read in enumerate(per_epoch):
        if all(order == sorted(order) for order in epochs_read):
            raise ExerciseFailed(f"rank {rank} read its samples in index order: leave DistributedSampler's shuffling on")
        if len({tuple(order) for order in epochs_read}) < epochs:
            raise ExerciseFailed(f"rank {rank} read its samples in the same order in every epoch: call "
                                 "sampler.set_epoch(epoch) at the start of each epoch, on every rank")
    steps_per_rank = []
    for rank, rec in enumerate(records):
        sizes = rec["batches"]
        if sum(sizes) != len(rec["reads"]):
            raise ExerciseFailed(f"rank {rank}'s model ran training forward passes on {sum(sizes)} samples, but the rank "
                                 f"read {len(rec['reads'])}: run one forward pass per batch of the DataLoader, in train mode")
        if max(sizes) != batch:
            raise ExerciseFailed(f"rank {rank} trained on batches of {max(sizes)} samples, expected --batch-size "
                                 f"({batch} here) per rank")
        bounds = torch.tensor([0, *sizes]).cumsum(0).tolist()
        steps_per_rank.append([rec["reads"][a:b] for a, b in zip(bounds, bounds[1:])])
    if len(steps_per_rank[0]) != len(steps_per_rank[1]):
        raise ExerciseFailed(f"rank 0 took {len(steps_per_rank[0])} steps, rank 1 {len(steps_per_rank[1])}: every rank "
                             "must take the same number, or one waits forever in its next all-reduce")
    for rank, rec in enumerate(records):
        if not any(rec["ddp_wraps"]):
            raise ExerciseFailed(f"rank {rank} never wrapped the model from make_model() in DistributedDataParallel")
    states = [rec["state"] for rec in records]
    apart = _max_diff(states[0], states[1])
    if apart > 1e-5:
        raise ExerciseFailed(f"the ranks ended with different weights (max |difference| {apart:.1e}): their gradients "
                             "were not averaged at every step; DDP averages them in a backward that follows a forward "
                             "through the DDP model itself")
    steps = [a + b for a, b in zip(*steps_per_rank)]
    expected = _one_process(steps, lr)
    off = _max_diff(states[0], expected)
    if off > 1e-4:
        for variant, fault in [({"momentum": 0.9}, "with momentum 0.9: use plain SGD, no momentum"),
                               ({"zero": False}, "without zeroing the gradients: zero them at every step")]:
            if _max_diff(states[0], _one_process(steps, lr, **variant)) < 1e-4:
                raise ExerciseFailed(f"the ranks trained {fault}")
        raise ExerciseFailed(f"rank 0's weights after training differ from one process trained on the same global "
                             f"batches with SGD(lr={lr:g}) on the mean cross-entropy (max |difference| {off:.1e}): "
                             "one optimizer step per batch, lr=--lr, no momentum")
    spoke = _last_line(runs[1].stdout)
    if spoke:
        raise ExerciseFailed(f"rank 1 printed {spoke[:60]!r}: only rank 0 logs, or every line appears once per rank")
    logged = [line for line in runs[0].stdout.splitlines() if line.strip().lower().startswith("epoch")]
    if len(logged) != epochs:
        raise ExerciseFailed(f"rank 0 printed {len(logged)} lines that start with 'epoch', expected one per epoch ({epochs})")
    saves = [rec["saves"] for rec in records]
    if saves[1]:
        raise ExerciseFailed("rank 1 called torch.save too: only rank 0 writes the checkpoint (if rank == 0:)")
    if not saves[0]:
        raise ExerciseFailed("rank 0 never called torch.save: save the trained weights to --out after the last epoch")
    if len(saves[0]) > 1:
        raise ExerciseFailed(f"rank 0 called torch.save {len(saves[0])} times: save once, after the last epoch")
    path = Path(saves[0][0]["path"])
    if not path.is_absolute() or path.resolve() != out.resolve():
        if (out.parent / path).resolve() != out.resolve():
            raise ExerciseFailed(f"rank 0 saved to {str(path)!r}, not to the path given as --out")
    try:
        state = torch.load(out, weights_only=True)
    except Exception as err:  # noqa: BLE001 -- an unloadable file is the learner's
        raise ExerciseFailed(f"the checkpoint does not load with torch.load(weights_only=True) ({type(err).__name__}): "
                             "save model.module.state_dict(), not the model object") from None
    if not isinstance(state, dict):
        raise ExerciseFailed(f"the checkpoint holds {a_type(state)}: save model.module.state_dict()")
    if any(str(k).startswith("module.") for k in state):
        raise ExerciseFailed(f"the checkpoint's keys are like {next(iter(state))!r}, the DDP wrapper's state_dict: save "
                             "model.module.state_dict(), which loads into the plain model")
    plain = make_model()
    try:
        plain.load_state_dict(state)
    except Exception as err:  # noqa: BLE001
        raise ExerciseFailed(f"the checkpoint does not load into make_model(): {str(err).strip().splitlines()[0]}") from None
    if _max_diff(plain.state_dict(), states[0]) > 0:
        raise ExerciseFailed("the checkpoint holds other weights than the model's at the end of training: save after "
                             "the last epoch")
    for rank, rec in enumerate(records):
        if rec["initialized_at_end"]:
            raise ExerciseFailed(f"rank {rank} never called dist.destroy_process_group(): call it at the end, on every rank")


@exercise("ddp_digits")
def check_ddp_digits(script) -> None:
    from course_utils.tooling.checks import exercise_seconds

    path = _expect_script(script).resolve()
    timeout, grace = max(5.0, exercise_seconds() - 5), 6.0  # leave the check time to judge
    with tempfile.TemporaryDirectory(prefix="lesson09-check-") as tmp:
        folder = Path(tmp)
        out = folder / "trained.pt"
        args = ["--epochs", str(_SCRIPT_EPOCHS), "--batch-size", str(_SCRIPT_BATCH), "--lr", str(_SCRIPT_LR),
                "--out", str(out)]
        runs = run_script(path, args, folder, timeout=timeout, grace=grace)
        if any(run.record and run.record.get("error") and "EADDRINUSE" in run.record["error"]["message"] for run in runs):
            for f in folder.iterdir():
                f.unlink()
            runs = run_script(path, args, folder, timeout=timeout, grace=grace)  # another program took the port
        _judge_launch(runs, path.name, timeout, grace)
        _judge_training(runs, out)
