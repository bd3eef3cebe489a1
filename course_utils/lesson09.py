"""Lesson 09 (distributed data parallel on a CPU): rank functions for the demos, reference solutions, checks.

The functions with the signature fn(rank, world_size, ...) run inside the spawned ranks of
course_utils.distributed.Workers: spawn imports them from here, which it could not do
from a notebook.
"""

import contextlib
import math
import os
import re
import sys
import tempfile
import threading
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data.distributed import DistributedSampler

from course_utils.tooling.checks import ExerciseFailed, call, exercise, type_name, scoreboard_for

scoreboard = scoreboard_for(__name__)  # the lesson's last cell: this session's verdicts


# Reference solutions. The checks compare the learner's answers with these.

def rank_indices(n: int, world_size: int, rank: int) -> list[int]:
    """The dataset indices DistributedSampler(shuffle=False) gives `rank`: padded by wrap-around, then strided."""
    per_rank = math.ceil(n / world_size)
    padded = [i % n for i in range(per_rank * world_size)]  # 0..n-1, then again from 0
    return padded[rank::world_size]


def shuffled_rank_indices(n: int, world_size: int, rank: int, epoch: int, seed: int = 0) -> list[int]:
    """The indices DistributedSampler(shuffle=True, seed=seed) gives `rank` after set_epoch(epoch)."""
    g = torch.Generator()
    g.manual_seed(seed + epoch)  # the same permutation on every rank, a new one every epoch
    order = torch.randperm(n, generator=g).tolist()
    per_rank = math.ceil(n / world_size)
    padded = [order[i % n] for i in range(per_rank * world_size)]
    return padded[rank::world_size]


def average_gradients(model: nn.Module) -> None:
    """Replace every parameter's .grad by its mean over all ranks (what DDP does during backward)."""
    world_size = dist.get_world_size()
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            p.grad /= world_size


def accumulate_with_no_sync(ddp_model: nn.Module, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], loss_fn: Callable) -> None:
    """Leave in .grad the gradient of the mean loss over all micro-batches, all-reduced once, after the last one."""
    ddp_model.zero_grad()
    *first, last = micro_batches
    with ddp_model.no_sync():  # forward and backward inside: DDP decides at forward time whether to sync
        for inputs, targets in first:
            (loss_fn(ddp_model(inputs), targets) / len(micro_batches)).backward()
    inputs, targets = last
    (loss_fn(ddp_model(inputs), targets) / len(micro_batches)).backward()  # this backward all-reduces the sum


def save_on_rank0(ddp_model: nn.Module, path: str) -> None:
    """Rank 0 saves the wrapped module's state_dict to path; every rank then waits at a barrier."""
    if dist.get_rank() == 0:
        torch.save(ddp_model.module.state_dict(), path)
    dist.barrier()


# The lesson's model and data.

def make_model(seed: int = 0) -> nn.Module:
    """The lesson's digits classifier (the one course_utils.train_ddp trains), seeded."""
    from course_utils.train_ddp import make_model as build

    torch.manual_seed(seed)
    return build()


def digits_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first n training digits (images (n, 1, 8, 8) in [0, 1], labels (n,))."""
    from course_utils.data import classification_datasets

    train_set, _, _ = classification_datasets("digits")
    images, labels = train_set.tensors
    return images[:n].clone(), labels[:n].clone()


def _my_slice(x: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    per_rank = len(x) // world_size
    return x[rank * per_rank:(rank + 1) * per_rank]


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


def ddp_step(rank: int, world_size: int, images: torch.Tensor, labels: torch.Tensor, lr: float) -> dict:
    """One DDP training step on this rank's slice of the batch, with the all-reduce made visible; also the manual version."""
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

    manual = make_model()                                    # the same step without DDP: average_gradients by hand
    F.cross_entropy(manual(x), y).backward()
    average_gradients(manual)
    manual_diff = max((a.grad - b).abs().max().item() for a, b in zip(manual.parameters(), grads))
    print(f"my loss {loss.item():.4f}; manual all-reduce vs DDP, max gradient difference: {manual_diff:.1e}")
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
    if use_no_sync:
        accumulate_with_no_sync(model, chunks, F.cross_entropy)
    else:
        model.zero_grad()
        for inputs, targets in chunks:
            (F.cross_entropy(model(inputs), targets) / micro_batches).backward()
    return {"all_reduces": len(calls), "values_sent": sum(calls), "grads": [p.grad.clone() for p in model.parameters()]}


def fsdp_step(rank: int, world_size: int, images: torch.Tensor, labels: torch.Tensor) -> dict:
    """FSDP2 on CPU: shard the model, show the shards, one forward/backward, gather a full state_dict on rank 0."""
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
    x, y = _my_slice(images, rank, world_size), _my_slice(labels, rank, world_size)
    F.cross_entropy(model(x), y).backward()                  # gradients are reduce-scattered: each rank keeps its shard
    grad = dict(model.named_parameters())["1.weight"].grad
    print(f"1.weight.grad is a {type(grad).__name__} with local shard {tuple(grad.to_local().shape)}")
    full_grads = [p.grad.full_tensor() for p in model.parameters()]   # a collective: every rank calls it
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    print(f"get_model_state_dict(full_state_dict=True, cpu_offload=True): {len(state)} tensors"
          + (f", e.g. 1.weight {type(state['1.weight']).__name__} {tuple(state['1.weight'].shape)}" if state else ""))
    return {"grads": full_grads, "state": state, "local_numel": local_numel}


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


# Helpers of the checks.

class _Hang(BaseException):  # not an Exception: call() must not turn it into "your code raised"
    """A simulated rank waited in a collective that another rank never joined."""


class _SimulatedWorld:
    """world_size ranks as threads in this process, with torch.distributed's collectives replaced by exact in-memory ones.

    The checks use it instead of real processes, which take seconds to start; it records every
    call, and turns a collective that not every rank joins into an error instead of a hang.
    """

    PATCHED = ("all_reduce", "reduce", "broadcast", "barrier", "all_gather", "get_rank", "get_world_size", "is_initialized")

    def __init__(self, world_size: int, timeout: float = 1.5):
        self.world_size = world_size
        self._gate = threading.Barrier(world_size, timeout=timeout)
        self.slots: list = [None] * world_size
        self.local = threading.local()
        self.events: list[list[str]] = [[] for _ in range(world_size)]
        self.hung: dict[int, str] = {}

    def rank(self) -> int:
        return self.local.rank

    def _sync(self, op: str) -> None:
        try:
            self._gate.wait()
        except threading.BrokenBarrierError:
            self.hung.setdefault(self.rank(), op)
            raise _Hang(op) from None

    def _exchange(self, op: str, tensor: torch.Tensor | None) -> list:
        if op != "barrier" and not isinstance(tensor, torch.Tensor):
            raise TypeError(f"dist.{op} expects a tensor, got {type(tensor).__name__}")
        rank = self.rank()
        self.events[rank].append(op)
        self.slots[rank] = (op, None if tensor is None else tensor.detach().clone())
        self._sync(op)
        seen = list(self.slots)
        self._sync(op)  # everyone has read the slots before anyone reuses them
        if len({s[0] for s in seen}) > 1:
            raise _Hang(f"mismatched collectives {[s[0] for s in seen]}")
        return [s[1] for s in seen]

    # The collectives, with torch.distributed's signatures.
    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        values = self._exchange("all_reduce", tensor)
        result = self._combine(values, op)
        with torch.no_grad():
            tensor.copy_(result)
        return _Done() if async_op else None

    def reduce(self, tensor, dst=0, op=dist.ReduceOp.SUM, group=None, async_op=False, group_dst=None):
        values = self._exchange("reduce", tensor)
        if self.rank() == dst:
            with torch.no_grad():
                tensor.copy_(self._combine(values, op))
        return _Done() if async_op else None

    def broadcast(self, tensor, src=0, group=None, async_op=False, group_src=None):
        values = self._exchange("broadcast", tensor)
        with torch.no_grad():
            tensor.copy_(values[src])
        return _Done() if async_op else None

    def all_gather(self, tensor_list, tensor, group=None, async_op=False):
        values = self._exchange("all_gather", tensor)
        with torch.no_grad():
            for out, v in zip(tensor_list, values):
                out.copy_(v)
        return _Done() if async_op else None

    def barrier(self, group=None, async_op=False, device_ids=None):
        self._exchange("barrier", None)
        return _Done() if async_op else None

    def get_rank(self, group=None):
        return self.rank()

    def get_world_size(self, group=None):
        return self.world_size

    def is_initialized(self):
        return True

    @staticmethod
    def _combine(values: list[torch.Tensor], op) -> torch.Tensor:
        stacked = torch.stack(values)
        if op == dist.ReduceOp.SUM:
            return stacked.sum(0)
        if op == dist.ReduceOp.AVG:
            return stacked.mean(0)
        if op == dist.ReduceOp.MAX:
            return stacked.max(0).values
        if op == dist.ReduceOp.MIN:
            return stacked.min(0).values
        if op == dist.ReduceOp.PRODUCT:
            return stacked.prod(0)
        raise ValueError(f"unsupported op {op}")

    def run(self, fn: Callable[[int], object]) -> list:
        """Run fn(rank) on one thread per rank with torch.distributed patched; return [(value, exception)] per rank."""
        outcome: list = [(None, None)] * self.world_size

        def body(rank: int) -> None:
            self.local.rank = rank
            try:
                outcome[rank] = (fn(rank), None)
            except BaseException as err:  # noqa: BLE001 -- reported by the check
                outcome[rank] = (None, err)
                if not isinstance(err, _Hang):
                    self._gate.abort()  # the others would wait for this rank forever

        saved = {name: getattr(dist, name) for name in self.PATCHED}
        for name in self.PATCHED:
            setattr(dist, name, getattr(self, name))
        try:
            threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(self.world_size)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(10)
        finally:
            for name, value in saved.items():
                setattr(dist, name, value)
        return outcome


class _Done:
    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _raise_first_error(outcome: list, what: str, hints: dict[str, str] | None = None) -> None:
    """Report a learner's exception on a simulated rank in one line (NotImplementedError passes through)."""
    for rank, (_, err) in enumerate(outcome):
        if isinstance(err, NotImplementedError):
            raise err
    for rank, (_, err) in enumerate(outcome):
        if err is not None and not isinstance(err, _Hang):
            text = str(err).strip().splitlines()
            advice = next((f" ({hint})" for key, hint in (hints or {}).items() if key in str(err)), "")
            raise ExerciseFailed(f"{what} raised {type(err).__name__} on rank {rank}: {text[0] if text else '(no message)'}{advice}")


def _expect_index_list(got, what: str) -> list[int]:
    if got is None:
        raise ExerciseFailed(f"{what} returned None: did you forget to `return` the list?")
    if isinstance(got, torch.Tensor):
        raise ExerciseFailed(f"{what} returned a tensor: return a list of ints (tensor.tolist())")
    if not isinstance(got, list):
        raise ExerciseFailed(f"{what} returned a {type_name(got)}, expected a list of ints")
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in got):
        kinds = sorted({type_name(i) for i in got if not isinstance(i, int) or isinstance(i, bool)})
        raise ExerciseFailed(f"{what} returned a list holding {', '.join(kinds)}: return plain ints (tensor.tolist() gives them)")
    return got


def _sampler_indices(n: int, world_size: int, rank: int, shuffle: bool, epoch: int = 0, seed: int = 0) -> list[int]:
    sampler = DistributedSampler(range(n), num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed)
    sampler.set_epoch(epoch)
    return list(sampler)


# Checks, one per exercise, in notebook order.

@exercise("rank_indices")
def check_rank_indices(fn) -> None:
    for n, world_size in [(10, 3), (8, 2), (5, 4), (2, 5), (11, 4)]:
        shares = [_expect_index_list(call(fn, n, world_size, rank), f"rank_indices({n}, {world_size}, {rank})") for rank in range(world_size)]
        expected = [_sampler_indices(n, world_size, rank, shuffle=False) for rank in range(world_size)]
        if shares == expected:
            continue
        rank = next(r for r in range(world_size) if shares[r] != expected[r])
        got, what, per_rank = shares[rank], f"rank_indices({n}, {world_size}, {rank})", len(expected[0])
        padded = [i % n for i in range(per_rank * world_size)]
        if shares == [padded[r * per_rank:(r + 1) * per_rank] for r in range(world_size)]:
            raise ExerciseFailed(
                f"{what} returned a contiguous block {got}: DistributedSampler deals indices out like cards, "
                f"rank r takes r, r + world_size, r + 2 * world_size, ... (expected {expected[rank]})"
            )
        if shares == [list(range(r, (n // world_size) * world_size, world_size)) for r in range(world_size)]:
            raise ExerciseFailed(
                f"{what} returned {got}: that drops the last n % world_size indices, as drop_last=True does; "
                f"the default pads instead, repeating indices from the start (expected {expected[rank]})"
            )
        if len(got) != per_rank:
            raise ExerciseFailed(
                f"{what} returned {got}, {len(got)} indices, but every rank must get {per_rank}: pad the list of indices "
                f"by repeating it from its start until its length is a multiple of world_size, wrapping around as often "
                f"as needed (ranks with fewer batches would stop early, and the others would wait forever in their next all-reduce)"
            )
        raise ExerciseFailed(f"{what}: expected {expected[rank]}, got {got}")


@exercise("shuffled_rank_indices")
def check_shuffled_rank_indices(fn) -> None:
    hint = "shuffle all n indices with torch.randperm(n, generator=g), g seeded with seed + epoch; then pad and stride as in rank_indices"
    for n, world_size, seed in [(10, 2, 0), (11, 3, 5), (7, 4, 1)]:
        per_epoch = {}
        for epoch in (0, 3):
            shares = []
            for rank in range(world_size):
                args = (n, world_size, rank, epoch, seed)
                what = f"shuffled_rank_indices({n}, {world_size}, {rank}, epoch={epoch}, seed={seed})"
                got = _expect_index_list(call(fn, *args, shown=f"{n}, {world_size}, {rank}, {epoch}, {seed}"), what)
                again = call(fn, *args, shown=f"{n}, {world_size}, {rank}, {epoch}, {seed}")
                if again != got:
                    raise ExerciseFailed(
                        f"{what} returned a different list when called again with the same arguments: the ranks are separate "
                        "processes and must agree on one permutation; draw it from torch.Generator() seeded with seed + epoch, "
                        "not from the global random state"
                    )
                shares.append(got)
            per_epoch[epoch] = shares
            expected = [_sampler_indices(n, world_size, r, True, epoch, seed) for r in range(world_size)]
            if shares == expected:
                continue
            covered = sorted(i for share in shares for i in share)
            if len(set(covered)) < n or any(i not in range(n) for i in covered):
                missing = sorted(set(range(n)) - set(covered))
                raise ExerciseFailed(
                    f"shuffled_rank_indices({n}, {world_size}, rank, epoch={epoch}, seed={seed}) over all ranks never covers "
                    f"the indices {missing}: every rank must shuffle with the same seed (seed + epoch, not the rank) and "
                    "then take its own stride, so that together the ranks see every sample"
                )
            if epoch == 3 and shares == per_epoch[0] and expected != [_sampler_indices(n, world_size, r, True, 0, seed) for r in range(world_size)]:
                raise ExerciseFailed(
                    f"shuffled_rank_indices({n}, {world_size}, rank, epoch=3, seed={seed}) gives the same order as epoch 0: "
                    "seed the generator with seed + epoch, which is what sampler.set_epoch(epoch) feeds in"
                )
            rank = next(r for r in range(world_size) if shares[r] != expected[r])
            raise ExerciseFailed(
                f"shuffled_rank_indices({n}, {world_size}, {rank}, epoch={epoch}, seed={seed}): expected {expected[rank]}, "
                f"got {shares[rank]}: {hint}"
            )


def _grad_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))
    model[2].requires_grad_(False)  # a frozen layer: its parameters have no .grad
    return model


def _replicas_with_local_grads(world_size: int) -> list[nn.Module]:
    """One replica per rank, same weights, each with the gradient of its own batch."""
    replicas = []
    for rank in range(world_size):
        model = _grad_model(0)
        g = torch.Generator().manual_seed(100 + rank)
        x, y = torch.randn(5, 4, generator=g), torch.randint(0, 3, (5,), generator=g)
        F.cross_entropy(model(x), y).backward()
        replicas.append(model)
    return replicas


@exercise("average_gradients")
def check_average_gradients(fn) -> None:
    hints = {"NoneType": "a frozen parameter has p.grad None: skip those (if p.grad is not None)",
             "got None": "a frozen parameter has p.grad None: skip those (if p.grad is not None)"}
    for world_size in (2, 3):
        replicas = _replicas_with_local_grads(world_size)
        weights = [[p.detach().clone() for p in m.parameters()] for m in replicas]
        local = [[None if p.grad is None else p.grad.clone() for p in m.parameters()] for m in replicas]
        trainable = [i for i, g in enumerate(local[0]) if g is not None]
        mean = {i: torch.stack([local[r][i] for r in range(world_size)]).mean(0) for i in trainable}
        world = _SimulatedWorld(world_size)
        what = f"average_gradients(model) on {world_size} ranks"
        outcome = world.run(lambda rank: call(fn, replicas[rank], shown="model", hints=hints))
        for rank, (_, err) in enumerate(outcome):
            if isinstance(err, ExerciseFailed):
                raise ExerciseFailed(err.message.replace("average_gradients(model)", what))
        _raise_first_error(outcome, what, hints)
        if world.hung:
            waiting = {r: op for r, op in world.hung.items()}
            absent = [r for r in range(world_size) if not world.events[r]]
            raise ExerciseFailed(
                f"{what}: rank {min(waiting)} waited in {waiting[min(waiting)]} for ranks that never joined it "
                f"{'(ranks ' + str(absent) + ' called no collective)' if absent else '(they called other collectives)'}: "
                "every rank must call the same collectives in the same order; a real job would hang here"
            )
        grads = [[p.grad for p in m.parameters()] for m in replicas]
        if any(grads[r][i] is not None for r in range(world_size) for i in range(len(local[0])) if i not in trainable):
            raise ExerciseFailed(f"{what} gave a frozen parameter a gradient: leave parameters whose .grad is None alone")
        moved = any(not torch.equal(p.detach(), w) for m, ws in zip(replicas, weights) for p, w in zip(m.parameters(), ws))
        if moved:
            raise ExerciseFailed(
                f"{what} changed the parameters themselves: all-reduce each parameter's gradient p.grad, not the parameter p"
            )
        untouched = all(torch.equal(grads[r][i], local[r][i]) for r in range(world_size) for i in trainable)
        if untouched and any(world.events[r] for r in range(world_size)):
            raise ExerciseFailed(
                f"{what} called {world.events[0][0] if world.events[0] else 'a collective'} but left every gradient as it was: "
                "all-reduce each parameter's gradient p.grad (in place), not the parameter p or p.data, or a copy"
            )
        if not any(world.events[r] for r in range(world_size)):
            same_as_local = all(torch.allclose(grads[r][i], local[r][i] / world_size) for r in range(world_size) for i in trainable)
            raise ExerciseFailed(
                f"{what} called no collective: "
                + ("the gradients were divided by the world size but never summed across ranks; " if same_as_local else "")
                + "call dist.all_reduce(p.grad) on every parameter's gradient"
            )
        def agrees(r, scale=1.0):
            return all(torch.allclose(grads[r][i], mean[i] * scale, atol=1e-6) for i in trainable)
        if all(agrees(r, world_size) for r in range(world_size)):
            raise ExerciseFailed(
                f"{what} left the SUM of the ranks' gradients, {world_size} times the mean: divide by dist.get_world_size() "
                "after the all_reduce (or use op=dist.ReduceOp.AVG)"
            )
        if world_size == 3 and all(agrees(r, 1.5) for r in range(world_size)):
            raise ExerciseFailed(f"{what} divided the sum by 2: divide by dist.get_world_size(), not a fixed number")
        if agrees(0) and not all(agrees(r) for r in range(world_size)) and "reduce" in world.events[0]:
            raise ExerciseFailed(
                f"{what}: only rank 0 got the averaged gradients; dist.reduce sends the result to one rank, "
                "dist.all_reduce to every rank, and every rank needs them for its optimizer step"
            )
        if "broadcast" in world.events[0] and all(
                torch.allclose(grads[r][i], local[0][i], atol=1e-6) for r in range(world_size) for i in trainable):
            raise ExerciseFailed(f"{what} gave every rank rank 0's gradients: broadcast copies, all_reduce sums every rank's")
        for r in range(world_size):
            for i in trainable:
                if not torch.allclose(grads[r][i], mean[i], atol=1e-6):
                    name = [n for n, _ in replicas[r].named_parameters()][i]
                    raise ExerciseFailed(
                        f"{what}: on rank {r}, {name}.grad is not the mean of the ranks' gradients "
                        f"(e.g. {grads[r][i].flatten()[0].item():.6g}, expected {mean[i].flatten()[0].item():.6g})"
                    )


@contextlib.contextmanager
def _single_rank_group():
    """A one-rank gloo process group in this process, for a real DDP model; destroyed afterwards."""
    created = not dist.is_initialized()
    hook = sys.excepthook  # init_process_group wraps it to prefix "[rank0]:"; leave the learner's process as it was
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        if created:
            dist.destroy_process_group()
        sys.excepthook = hook


def _counted_ddp(seed: int):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(_grad_model(seed).requires_grad_(True))
    calls = []
    forwards = [0]
    model.module.register_forward_pre_hook(lambda module, args: forwards.__setitem__(0, forwards[0] + 1))

    def counting_allreduce(state, bucket):
        calls.append(forwards[0])             # how many forward passes had run when this all-reduce started
        fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
        return fut.then(lambda fut: fut.value()[0])

    model.register_comm_hook(None, counting_allreduce)
    return model, calls


@exercise("accumulate_with_no_sync")
def check_accumulate_with_no_sync(fn) -> None:
    g = torch.Generator().manual_seed(11)
    micro = [(torch.randn(4, 4, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(3)]
    inputs, targets = torch.cat([m[0] for m in micro]), torch.cat([m[1] for m in micro])
    plain = _grad_model(3).requires_grad_(True)
    F.cross_entropy(plain(inputs), targets).backward()
    expected = [p.grad for p in plain.parameters()]
    what = "accumulate_with_no_sync(ddp_model, 3 micro-batches, F.cross_entropy)"
    with _single_rank_group():
        reference, reference_calls = _counted_ddp(3)
        accumulate_with_no_sync(reference, micro, F.cross_entropy)
        n_buckets = len(reference_calls)               # one all-reduce per bucket, once
        ddp, calls = _counted_ddp(3)
        for p in ddp.parameters():                   # stale gradients from an earlier step
            p.grad = torch.ones_like(p)
        call(fn, ddp, micro, F.cross_entropy, shown="ddp_model, 3 micro-batches, F.cross_entropy")
    grads = [p.grad for p in ddp.parameters()]
    if any(gr is None for gr in grads):
        raise ExerciseFailed(f"after {what}, some .grad is None: run backward() on every micro-batch's loss")
    if not calls:
        raise ExerciseFailed(
            f"{what} never all-reduced the gradients: run the LAST micro-batch's forward and backward outside no_sync(), "
            "through ddp_model(...) (not ddp_model.module(...))"
        )
    if len(calls) >= 3 * n_buckets:
        raise ExerciseFailed(
            f"{what} all-reduced after every micro-batch ({len(calls)} all-reduces): run the forward and backward of all but "
            "the last micro-batch inside `with ddp_model.no_sync():` (DDP decides at forward time whether to sync)"
        )
    if len(calls) > n_buckets:
        raise ExerciseFailed(
            f"{what} all-reduced {len(calls)} times: only the last micro-batch should sync; put the forward and backward of "
            "every other micro-batch inside no_sync() (DDP decides at forward time whether to sync)"
        )
    if min(calls) < len(micro):
        raise ExerciseFailed(
            f"{what} all-reduced after micro-batch {min(calls)} of {len(micro)}: the gradients of the later micro-batches were "
            "never averaged across ranks; only the last micro-batch's backward, outside no_sync(), should sync"
        )
    if all(torch.allclose(a, b + 1, atol=1e-5) for a, b in zip(grads, expected)):
        raise ExerciseFailed(f"{what} added to stale gradients from before: zero them first (ddp_model.zero_grad())")
    if all(torch.allclose(a, 3 * b, atol=1e-5) for a, b in zip(grads, expected)):
        raise ExerciseFailed(
            f"{what} left 3 times the gradient of the mean loss: divide each micro-batch's loss by len(micro_batches)"
        )
    for (name, _), a, b in zip(plain.named_parameters(), grads, expected):
        if not torch.allclose(a, b, atol=1e-5):
            raise ExerciseFailed(
                f"{what}: {name}.grad is not the gradient of the mean loss over all micro-batches "
                f"(e.g. {a.flatten()[0].item():.6g}, expected {b.flatten()[0].item():.6g})"
            )


class _Wrapped(nn.Module):
    """Stands in for DistributedDataParallel in the simulated world: the network is .module, state_dict keys start with 'module.'."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args):
        return self.module(*args)


@exercise("save_on_rank0")
def check_save_on_rank0(fn) -> None:
    world_size = 2
    replicas = [_Wrapped(_grad_model(5)) for _ in range(world_size)]
    world = _SimulatedWorld(world_size)
    real_save = torch.save
    saved = {}

    def recording_save(obj, f, *args, **kwargs):
        rank = world.rank()
        world.events[rank].append("save")
        saved[rank] = obj
        return real_save(obj, f, *args, **kwargs)

    what = "save_on_rank0(ddp_model, path)"
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "checkpoint.pt")
        torch.save = recording_save
        try:
            outcome = world.run(lambda rank: call(fn, replicas[rank], path, shown="ddp_model, path"))
        finally:
            torch.save = real_save
        for rank, (_, err) in enumerate(outcome):
            if isinstance(err, ExerciseFailed):
                raise ExerciseFailed(err.message)
        _raise_first_error(outcome, what)
        if world.hung:
            waiting = min(world.hung)
            raise ExerciseFailed(
                f"{what}: rank {waiting} waited in {world.hung[waiting]} that rank {1 - waiting} never called: every rank "
                "must reach the barrier, so put dist.barrier() after the `if`, not inside it (a real job would hang here)"
            )
        if not saved:
            raise ExerciseFailed(f"{what}: no rank called torch.save: rank 0 (dist.get_rank() == 0) should save")
        if 1 in saved:
            raise ExerciseFailed(
                f"{what}: rank 1 saved too: only rank 0 should write (if dist.get_rank() == 0:); with many ranks "
                "they would all write the same file at once"
            )
        obj = saved[0]
        if isinstance(obj, nn.Module):
            raise ExerciseFailed(
                f"{what} saved the whole module object (a pickle of its class): save ddp_model.module.state_dict()"
            )
        if not isinstance(obj, dict):
            raise ExerciseFailed(f"{what} saved a {type_name(obj)}: save ddp_model.module.state_dict()")
        if any(str(k).startswith("module.") for k in obj):
            raise ExerciseFailed(
                f"{what} saved keys like {next(iter(obj))!r}: that is the DDP wrapper's state_dict; save "
                "ddp_model.module.state_dict(), which loads into the plain model"
            )
        for rank in range(world_size):
            if "barrier" not in world.events[rank]:
                raise ExerciseFailed(
                    f"{what}: rank {rank} never called dist.barrier(): every rank should wait at a barrier after the save, "
                    "so that none goes on (say, to load the file) before it is written"
                )
        if world.events[0].index("barrier") < world.events[0].index("save"):
            raise ExerciseFailed(
                f"{what}: rank 0 saved after the barrier, so the other ranks went on before the file existed: save first, "
                "then dist.barrier()"
            )
        fresh = _grad_model(99)
        try:
            fresh.load_state_dict(torch.load(path, weights_only=True))
        except Exception as err:
            raise ExerciseFailed(f"the saved file does not load into the plain model: {type(err).__name__}: {str(err).splitlines()[0]}") from None
    for (name, p), q in zip(fresh.named_parameters(), replicas[0].module.parameters()):
        if not torch.equal(p, q):
            raise ExerciseFailed(f"{what}: the saved {name} differs from the model's")
