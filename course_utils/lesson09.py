"""Lesson 09 (distributed data parallel on a CPU): the reference solutions and the checks of its exercises.

The functions the demos run on the ranks live in course_utils.ddp_demos, the lesson's model and data (and the probe
that follows a learner's training script on each rank) in course_utils.ddp_models, the threads that stand in for ranks
in course_utils.simulated_ranks, and the process plumbing in course_utils.distributed.
"""

import contextlib
import math
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from course_utils.ddp_models import Block, RankRun, TrainingDigits, block_model, make_model, run_script
from course_utils.distributed import one_rank_group
from course_utils.simulated_ranks import Hang, SimulatedWorld
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
    untouched_script,
    where,
)
from course_utils.tooling.language import _, ngettext

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

def _raise_first_error(outcome: list, what: str, hints: dict[str, str] | None = None) -> None:
    """Report a learner's exception on a simulated rank in one line, naming the rank (the untouched stub passes through)."""
    for rank, (_value, err) in enumerate(outcome):
        if isinstance(err, NotImplementedError) and stub_function(err):
            raise err
    for rank, (_value, err) in enumerate(outcome):
        if isinstance(err, SystemExit):
            raise ExerciseFailed(_("{what}: rank {rank} called exit() (SystemExit: {code}): return a value instead").format(
                what=what, rank=rank, code=err.code))
        if err is not None and not isinstance(err, Hang):
            frame = learner_frame(err)
            advice = error_hint(err, {**ERROR_HINTS, **(hints or {})})
            raise ExerciseFailed(_("{what} raised {error} on rank {rank}: {message}{where}{advice}").format(
                what=what, error=type(err).__name__, rank=rank, message=first_line(err),
                where=where(frame) if frame else "", advice=advice))


def _raise_hang(world: SimulatedWorld, what: str) -> None:
    if not world.hung:
        return
    waiting = min(world.hung)
    absent = [r for r in range(world.world_size) if not world.events[r]]
    if absent:
        raise ExerciseFailed(
            _("{what}: rank {rank} waited in {op} for ranks that never joined it (ranks {absent} called no collective): "
              "every rank must call the same collectives in the same order; a real job would hang here").format(
                what=what, rank=waiting, op=world.hung[waiting], absent=absent)
        )
    raise ExerciseFailed(
        _("{what}: rank {rank} waited in {op} for ranks that never joined it (they called other collectives): "
          "every rank must call the same collectives in the same order; a real job would hang here").format(
            what=what, rank=waiting, op=world.hung[waiting])
    )


def _raise_unwaited(world: SimulatedWorld, what: str) -> None:
    if world.unwaited:
        rank = min(world.unwaited)
        raise ExerciseFailed(
            _("{what}: rank {rank} started a collective with async_op=True and never called .wait() on the work it "
              "returned: the tensor holds the result only after wait() returns").format(what=what, rank=rank)
        )


def _real_once(fn: Callable, args: tuple, what: str, shown: str):
    """Call the learner's function once in a real one-rank gloo group: the API's own checks, not the stand-in's."""
    with one_rank_group() as usable:
        if not usable:
            return None
        try:
            return call(fn, *args, shown=shown)
        except ExerciseFailed as err:
            raise ExerciseFailed(_("with a real one-rank gloo process group, {message}").format(message=err.message)) from None


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


def _close_all(values: list[float], targets: list[float]) -> bool:
    return all(math.isclose(v, w, rel_tol=1e-6) for v, w in zip(values, targets))


_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _other_reduction(world: SimulatedWorld) -> str | None:
    """The first reduce op a rank used other than SUM and AVG (MAX, MIN, PRODUCT), or None."""
    return next((op for ops in world.reductions for op in ops if op not in ("SUM", "AVG")), None)


def _low_precision_sent(world: SimulatedWorld) -> torch.dtype | None:
    """The dtype of the first float16 or bfloat16 tensor a rank passed to a collective, or None."""
    return next((t.dtype for sent in world.sent for t in sent
                 if isinstance(t, torch.Tensor) and t.dtype in _LOW_PRECISION), None)


def _counts_summed(world: SimulatedWorld, correct: int, samples: int) -> bool:
    """Whether the ranks' collectives, summed over the ranks, carried both the right global counts."""
    sums = set()
    for k in range(min(len(sent) for sent in world.sent)):
        tensors = [sent[k] for sent in world.sent]
        if all(isinstance(t, torch.Tensor) and t.shape == tensors[0].shape for t in tensors):
            sums.update(torch.stack([t.double() for t in tensors]).sum(0).flatten().tolist())
    return correct in sums and samples in sums


def _accuracy_fault(what: str, got: list[float], correct: list[int], sizes: list[int], world: SimulatedWorld,
                    n_classes: int) -> str:
    """Why the ranks' values differ from the global accuracy, where the values themselves prove it; else expected/got."""
    world_size, total = len(sizes), sum(correct)
    expected = total / sum(sizes)
    local = [c / n if n else math.nan for c, n in zip(correct, sizes)]
    mean_of_means = sum(local) / world_size
    op = _other_reduction(world)
    if op:
        return _("{what} returned {got}, expected {expected:.4f}: it all-reduced with ReduceOp.{op}, "
                 "which does not add the ranks' counts: sum them (ReduceOp.SUM, the default)").format(
            what=what, got=[round(v, 4) for v in got], expected=expected, op=op)
    low = _low_precision_sent(world)
    if low is not None and all(abs(v - expected) < 0.02 for v in got):
        return _("{what} returned {got}, expected {expected:.6g}: it passed a {dtype} tensor "
                 "to a collective, and {dtype} keeps too few bits (bfloat16 8, float16 11), so the counts or their "
                 "quotient were rounded: count in int64 or float64").format(
            what=what, got=[round(v, 6) for v in got], expected=expected, dtype=_dtype_name(low))
    if _close_all(got, [100 * expected] * world_size):
        return _("{what} returned {got:g}, 100 times the accuracy {expected:.4g}: return the fraction of correct "
                 "predictions (between 0 and 1), not a percentage").format(what=what, got=got[0], expected=expected)
    if _close_all(got, [expected / n_classes] * world_size):
        return _("{what} returned {got:.6g}, the accuracy {expected:.4g} divided by the {n_classes} classes: it counted "
                 "logits.numel() (samples x classes) as the number of samples; count samples with len(labels)").format(
            what=what, got=got[0], expected=expected, n_classes=n_classes)
    if any(math.isnan(v) for v in got) and 0 in sizes:
        return _("{what}: got nan; rank {rank} has no samples, so its own accuracy is 0/0: "
                 "all-reduce the number of correct predictions and the number of samples, then divide").format(
            what=what, rank=sizes.index(0))
    if _close_all(got, [mean_of_means] * world_size):
        return _("{what} returned the mean of the ranks' accuracies, {mean:.4f}; with shares of different sizes that "
                 "is not the accuracy over all samples ({expected:.4f}): all-reduce the counts of correct predictions and "
                 "of samples, then divide").format(what=what, mean=mean_of_means, expected=expected)
    if 0 < expected < 1 and _counts_summed(world, total, sum(sizes)) and all(v == math.floor(expected) for v in got):
        return _("{what} returned {got:g} on every rank where the accuracy is {expected:.4g} ({correct} of {samples}): "
                 "its whole-number part, which is what integer division (//) gives: divide as floats").format(
            what=what, got=got[0], expected=expected, correct=total, samples=sum(sizes))
    if _close_all(got, [local[0]] * world_size):
        broadcast = any("broadcast" in events for events in world.events)
        if broadcast:
            return _("{what} returned rank 0's own accuracy, {local:.4f}, on every rank (broadcast copies rank 0's value "
                     "to every rank), not the accuracy over all samples ({expected:.4f}): all-reduce every rank's "
                     "counts").format(what=what, local=local[0], expected=expected)
        return _("{what} returned rank 0's own accuracy, {local:.4f}, on every rank, "
                 "not the accuracy over all samples ({expected:.4f}): all-reduce every rank's counts").format(
            what=what, local=local[0], expected=expected)
    if 0 not in sizes and _close_all(got, local):
        return _("{what}: each rank returned its own accuracy {got}: combine every rank's counts with "
                 "dist.all_reduce and use the combined counts").format(what=what, got=[round(v, 4) for v in got])
    if 0 not in sizes and _close_all(got, [total / (n * world_size) for n in sizes]):
        return _("{what}: each rank divided the global number of correct predictions ({correct}) by its own number of "
                 "samples times the world size, which assumes equal shares {sizes}: all-reduce the number of samples as "
                 "well").format(what=what, correct=total, sizes=sizes)
    if 0 not in sizes and _close_all(got, [total / n for n in sizes]):
        return _("{what}: each rank divided the global number of correct predictions ({correct}) by its own number of "
                 "samples {sizes}: all-reduce the number of samples as well, and divide by the total").format(
            what=what, correct=total, sizes=sizes)
    if any(not math.isclose(v, got[0], rel_tol=1e-6) for v in got if not math.isnan(v)):
        used_reduce = any("reduce" in events for events in world.events)
        if used_reduce:
            return _("{what}: the ranks returned different values {got}: every rank must end with the same global "
                     "accuracy (dist.reduce leaves the result on one rank only; dist.all_reduce on all)").format(
                what=what, got=[round(v, 4) for v in got])
        return _("{what}: the ranks returned different values {got}: every rank must end with the same "
                 "global accuracy").format(what=what, got=[round(v, 4) for v in got])
    return _("{what}: expected {expected:.6g} on every rank, got {got}").format(
        what=what, expected=expected, got=[round(v, 6) for v in got])


@exercise("global_accuracy")
def check_global_accuracy(fn) -> None:
    expect_callable(fn)
    hints = {"must match the size": _("the ranks' shares differ in size: all_reduce sums, it does not concatenate"),
             "received data size": _("every rank must pass a tensor of the same size to a collective"),
             "invalid tensor size": _("all_gather needs tensors of the same size on every rank; the shares differ")}
    for sizes, n_classes, seed in [([7, 3], 12, 1), ([5, 0, 9], 11, 2), ([1, 6], 13, 4)]:  # uneven, empty, one sample
        world_size = len(sizes)
        shares = _accuracy_case(sizes, n_classes, seed)
        originals = [(x.clone(), y.clone()) for x, y in shares]
        correct = [int((x.argmax(1) == y).sum()) for x, y in shares]
        expected = sum(correct) / sum(sizes)
        what = _("global_accuracy(logits, labels) on {world_size} ranks with {sizes} samples").format(
            world_size=world_size, sizes=sizes)
        world = SimulatedWorld(world_size)
        outcome = world.run(lambda rank: fn(*shares[rank]), learner=fn)
        _raise_first_error(outcome, what, hints)
        _raise_hang(world, what)
        _raise_unwaited(world, what)
        for rank, ((x, y), (x0, y0)) in enumerate(zip(shares, originals)):
            if not (torch.equal(x, x0) and torch.equal(y, y0)):
                which = "logits" if not torch.equal(x, x0) else "labels"
                raise ExerciseFailed(_("{what}: rank {rank}'s {which} changed: leave the inputs as they are (collectives, "
                                       "and methods whose name ends in _, work in place)").format(
                    what=what, rank=rank, which=which))
        got = [value for value, _err in outcome]
        for rank, value in enumerate(got):
            if isinstance(value, torch.Tensor):
                raise ExerciseFailed(_("{what}: rank {rank} returned a tensor, expected a Python float: call .item() on "
                                       "it").format(what=what, rank=rank))
            if not isinstance(value, float) or isinstance(value, bool):
                raise ExerciseFailed(_("{what}: rank {rank} returned {a_type}, expected a Python float").format(
                    what=what, rank=rank, a_type=a_type(value)))
        if not any(world.events):
            raise ExerciseFailed(_("{what} called no collective, so each rank knew only its own samples: combine the "
                                   "ranks' counts with dist.all_reduce").format(what=what))
        if all(math.isclose(v, expected, rel_tol=1e-6) for v in got):  # float32 sums are fine
            continue
        raise ExerciseFailed(_accuracy_fault(what, got, correct, sizes, world, n_classes))
    logits, labels = _accuracy_case([6], 10, 3)[0]
    value = _real_once(fn, (logits, labels), "global_accuracy", "logits, labels")
    expected = float((logits.argmax(1) == labels).float().mean())
    if value is not None and not (isinstance(value, float) and math.isclose(value, expected, rel_tol=1e-6)):
        raise ExerciseFailed(_("with a real one-rank gloo process group, global_accuracy returned {value!r}, expected "
                               "{expected:.6g}").format(value=value, expected=expected))


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
    hints = {"NoneType": _("a frozen parameter has p.grad None: leave those out"),
             "got None": _("a frozen parameter has p.grad None: leave those out"),
             "is invalid for input of size": _("a slice of the flat tensor had another size than the gradient it goes "
                                               "back to: the offsets must count only the gradients that went into it, in "
                                               "the same order"),
             "view size is not compatible": _("view() of a non-contiguous tensor; reshape() copies when it must")}
    for world_size in (2, 3):
        replicas = _replicas_with_local_grads(world_size, seed=world_size)
        names = [n for n, _p in replicas[0].named_parameters()]
        weights = [[p.detach().clone() for p in m.parameters()] for m in replicas]
        local = [[None if p.grad is None else p.grad.clone() for p in m.parameters()] for m in replicas]
        trainable = [i for i, g in enumerate(local[0]) if g is not None]
        mean = {i: torch.stack([local[r][i] for r in range(world_size)]).mean(0) for i in trainable}
        world = SimulatedWorld(world_size)
        what = _("average_gradients(model) on {world_size} ranks").format(world_size=world_size)
        outcome = world.run(lambda rank: fn(replicas[rank]), learner=fn)
        _raise_first_error(outcome, what, hints)
        _raise_hang(world, what)
        grads = [[p.grad for p in m.parameters()] for m in replicas]
        if any(grads[r][i] is not None for r in range(world_size) for i in range(len(names)) if i not in trainable):
            raise ExerciseFailed(_("{what} gave the frozen parameter frozen.weight a gradient: leave parameters whose "
                                   ".grad is None as they are").format(what=what))
        if any(not torch.equal(p.detach(), w) for m, ws in zip(replicas, weights) for p, w in zip(m.parameters(), ws)):
            raise ExerciseFailed(_("{what} changed the parameters themselves: average the gradients p.grad, not the "
                                   "parameters").format(what=what))
        calls = [len(e) for e in world.events]
        if not any(calls):
            raise ExerciseFailed(_("{what} called no collective: put every gradient into one tensor and all-reduce "
                                   "it").format(what=what))
        if max(calls) > 1:
            raise ExerciseFailed(
                _("{what} called {n} collectives on each rank ({ops}): "
                  "put every gradient into one flat tensor (torch.cat) and all-reduce it once, as one DDP bucket").format(
                    what=what, n=max(calls), ops=", ".join(sorted(set(world.events[0]))))
            )
        _raise_unwaited(world, what)
        untouched = all(torch.equal(grads[r][i], local[r][i]) for r in range(world_size) for i in trainable)
        if untouched:
            sent = world.sent[0][0] if world.sent[0] else None
            flat_grads = torch.cat([local[0][i].flatten() for i in trainable])
            as_weights = [torch.cat([w.flatten() for w in weights[0]]),
                          torch.cat([weights[0][i].flatten() for i in trainable])]  # every parameter, or those with a .grad
            if isinstance(sent, torch.Tensor) and any(sent.numel() == w.numel() and torch.equal(sent.flatten().to(w.dtype), w)
                                                      for w in as_weights):
                raise ExerciseFailed(_("{what} passed the parameters to {op}, not their gradients, and every "
                                       ".grad is as it was: put the p.grad tensors in the flat tensor").format(
                    what=what, op=world.events[0][0]))
            copy = isinstance(sent, torch.Tensor) and sent.numel() == flat_grads.numel() and torch.allclose(
                sent.flatten().to(flat_grads.dtype), flat_grads, atol=1e-6)
            if copy:
                raise ExerciseFailed(
                    _("{what} called {op}, but every .grad is as it was: the averaged values must end up in "
                      "each p.grad (the flat tensor you all-reduced, made with torch.cat, is a copy: copy its slices "
                      "back into the gradients)").format(what=what, op=world.events[0][0])
                )
            raise ExerciseFailed(
                _("{what} called {op}, but every .grad is as it was: the averaged values must end up in "
                  "each p.grad").format(what=what, op=world.events[0][0])
            )

        def agrees(r, scale=1.0):
            return all(grads[r][i] is not None and grads[r][i].shape == mean[i].shape
                       and torch.allclose(grads[r][i], mean[i] * scale, atol=1e-6) for i in trainable)
        if all(agrees(r, world_size) for r in range(world_size)):
            raise ExerciseFailed(_("{what} left the SUM of the ranks' gradients, {world_size} times the mean: divide by "
                                   "dist.get_world_size() (or use op=dist.ReduceOp.AVG)").format(
                what=what, world_size=world_size))
        if world_size == 3 and all(agrees(r, 1.5) for r in range(world_size)):
            raise ExerciseFailed(_("{what} divided the sum by 2: divide by dist.get_world_size(), not a fixed "
                                   "number").format(what=what))
        if agrees(0) and not all(agrees(r) for r in range(world_size)):
            used_reduce = any("reduce" in events for events in world.events)
            if used_reduce:
                raise ExerciseFailed(_("{what}: only rank 0 got the mean gradients, and every rank needs them for its "
                                       "optimizer step; dist.reduce leaves the result on one rank, dist.all_reduce on "
                                       "every rank").format(what=what))
            raise ExerciseFailed(_("{what}: only rank 0 got the mean gradients, and every rank needs them for its optimizer "
                                   "step").format(what=what))
        for r in range(world_size):
            for i in trainable:
                got = grads[r][i]
                if got is None:
                    raise ExerciseFailed(_("{what}: on rank {rank}, {name}.grad became None, expected shape {expected}").format(
                        what=what, rank=r, name=names[i], expected=tuple(mean[i].shape)))
                if got.shape != mean[i].shape:
                    raise ExerciseFailed(_("{what}: on rank {rank}, {name}.grad became of shape {shape}, expected shape "
                                           "{expected}").format(
                        what=what, rank=r, name=names[i], shape=tuple(got.shape), expected=tuple(mean[i].shape)))
        if all(agrees(r) for r in range(world_size)):
            continue
        op = _other_reduction(world)
        if op:
            raise ExerciseFailed(_("{what}: the .grad values are not the ranks' mean: it all-reduced with ReduceOp.{op}; "
                                   "sum (ReduceOp.SUM) and divide by the world size, or use ReduceOp.AVG").format(
                what=what, op=op))
        if "broadcast" in world.events[0] and all(torch.equal(grads[r][i], local[0][i]) for r in range(world_size) for i in trainable):
            raise ExerciseFailed(_("{what}: every rank ended with rank 0's own gradients: broadcast copies one rank's "
                                   "tensor, all_reduce combines every rank's").format(what=what))
        low = _low_precision_sent(world)
        if low is not None and all(torch.allclose(grads[r][i], mean[i], rtol=1e-2, atol=1e-4)
                                   for r in range(world_size) for i in trainable):
            raise ExerciseFailed(_("{what}: the .grad values are the mean only to about 3 digits: it all-reduced a "
                                   "{dtype} tensor, which rounds the gradients; keep the flat tensor in the "
                                   "gradients' dtype (float32)").format(what=what, dtype=_dtype_name(low)))
        if all(agrees(r, 1 / world_size) for r in range(world_size)):
            avg = any("AVG" in ops for ops in world.reductions)
            if avg:
                raise ExerciseFailed(_("{what} left the mean divided by {world_size} once more: all_reduce with "
                                       "op=ReduceOp.AVG already divides by the world size, so do not divide "
                                       "again").format(what=what, world_size=world_size))
            raise ExerciseFailed(_("{what} left the mean divided by {world_size} once more: divide the sum by the world "
                                   "size once").format(what=what, world_size=world_size))
        summed = {i: torch.stack([local[r][i] for r in range(world_size)]).sum(0) for i in trainable}
        if all(torch.equal(grads[r][i], torch.div(summed[i], world_size, rounding_mode="floor"))
               for r in range(world_size) for i in trainable):
            raise ExerciseFailed(_("{what} left the mean rounded down to whole numbers (e.g. "
                                   "{got:g} for {expected:.4g}): "
                                   "floor division (//) drops the fraction; divide with /").format(
                what=what, got=grads[0][trainable[0]].flatten()[0].item(), expected=mean[trainable[0]].flatten()[0].item()))
        kept = [i for i in trainable if all(torch.equal(grads[r][i], local[r][i]) for r in range(world_size))]
        averaged = [i for i in trainable if all(torch.allclose(grads[r][i], mean[i], atol=1e-6) for r in range(world_size))]
        if kept and len(kept) + len(averaged) == len(trainable):
            direct = all("." not in names[i] for i in kept)  # only parameters registered on the model itself were left out
            left = ", ".join(names[i] + ".grad" for i in kept)
            if direct:
                raise ExerciseFailed(ngettext(
                    "{what}: {names} is still each rank's own gradient while the others were averaged: never put into "
                    "the collective (model.parameters() yields every parameter, those registered on the model itself "
                    "too; model.children() misses them)",
                    "{what}: {names} are still each rank's own gradient while the others were averaged: never put into "
                    "the collective (model.parameters() yields every parameter, those registered on the model itself "
                    "too; model.children() misses them)", len(kept)).format(what=what, names=left))
            raise ExerciseFailed(ngettext(
                "{what}: {names} is still each rank's own gradient while the others were averaged: never put into "
                "the collective: put every parameter's gradient, from model.parameters(), into the flat tensor",
                "{what}: {names} are still each rank's own gradient while the others were averaged: never put into "
                "the collective: put every parameter's gradient, from model.parameters(), into the flat tensor",
                len(kept)).format(what=what, names=left))
        wrong = next((r, i) for r in range(world_size) for i in trainable if not torch.allclose(grads[r][i], mean[i], atol=1e-6))
        r, i = wrong
        values = torch.cat([grads[r][j].flatten() for j in trainable]).sort().values
        if torch.allclose(values, torch.cat([mean[j].flatten() for j in trainable]).sort().values, atol=1e-6):
            raise ExerciseFailed(_("{what}: on rank {rank}, the averaged values are all there, but in the wrong parameters "
                                   "({name}.grad holds values of others): copy them back in the order you flattened "
                                   "them").format(what=what, rank=r, name=names[i]))
        got = grads[r][i]
        raise ExerciseFailed(_("{what}: on rank {rank}, {name}.grad is not the mean of the ranks' gradients "
                               "(e.g. {got:.6g}, expected {expected:.6g})").format(
            what=what, rank=r, name=names[i], got=got.flatten()[0].item(), expected=mean[i].flatten()[0].item()))
    model = _replicas_with_local_grads(1, seed=7)[0]
    before = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    _real_once(fn, (model,), "average_gradients", "model")
    for name, p in model.named_parameters():
        if name in before and not torch.allclose(p.grad, before[name], atol=1e-6):
            raise ExerciseFailed(_("with a real one-rank gloo process group, average_gradients changed {name}.grad, "
                                   "though the mean over one rank is its own gradient").format(name=name))


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
                    zero: str = "before", reduction: str = "mean") -> list[torch.Tensor]:
    """SGD on a plain _ScaledNet that starts with stale gradients: one step per group of micro-batch indices.

    zero: when the gradients are zeroed, "before" each group (right), "never", "once" at the start, "after" each step,
    or "each" micro-batch.
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
            if zero == "each":
                optimizer.zero_grad()
            inputs, targets = micro[i]
            (F.cross_entropy(model(inputs), targets, reduction=reduction) / (divide_by or len(group))).backward()
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
        micro = [(torch.randn(4, 4, generator=g), torch.randint(0, 3, (4,), generator=g)) for _k in range(n_micro)]
        groups = [list(range(s, min(s + accumulate, n_micro))) for s in range(0, n_micro, accumulate)]
        ends = [group[-1] + 1 for group in groups]
        lr = 0.5
        what = _("train_accumulated(ddp_model, optimizer, {n} micro-batches, accumulate={accumulate})").format(
            n=n_micro, accumulate=accumulate)
        given = list(micro)
        with one_rank_group():
            ddp, log = _counted_ddp(3)
            for p in ddp.parameters():  # stale gradients from an earlier step
                p.grad = torch.full_like(p, _STALE)
            optimizer = torch.optim.SGD(ddp.parameters(), lr=lr)
            optimizer.register_step_post_hook(lambda opt, args, kwargs: log["steps"].append(log["forwards"]))
            call(fn, ddp, optimizer, micro, accumulate,
                 shown=_("ddp_model, optimizer, {n} micro-batches, {accumulate}").format(n=n_micro, accumulate=accumulate))
        names = [n for n, _p in ddp.module.named_parameters()]
        got = [p.detach() for p in ddp.module.parameters()]
        steps, syncs = log["steps"], log["syncs"]
        if len(micro) != len(given) or any(a is not b for a, b in zip(micro, given)):
            raise ExerciseFailed(_("{what} changed the caller's list of micro-batches (it holds {now} items now, "
                                   "{before} before): read it, do not pop from it or reassign its items").format(
                what=what, now=len(micro), before=len(given)))
        if not ddp.training or not ddp.module.training:
            raise ExerciseFailed(_("{what} left the model in eval mode: it came in training mode, and a training loop "
                                   "trains in it (no model.eval() here)").format(what=what))
        if not steps:
            moved = not all(torch.equal(a, b.detach()) for a, b in zip(got, _ScaledNet(3).parameters()))
            if moved:
                raise ExerciseFailed(_("{what} never called optimizer.step(), though the weights changed: step the "
                                       "optimizer it was given").format(what=what))
            raise ExerciseFailed(_("{what} never called optimizer.step()").format(what=what))
        if len(steps) == n_micro and n_micro != len(groups):
            raise ExerciseFailed(_("{what} stepped the optimizer after every micro-batch: step once per group of "
                                   "{accumulate} ({steps} steps here)").format(
                what=what, accumulate=accumulate, steps=len(groups)))
        if len(steps) == n_micro // accumulate and n_micro % accumulate:
            raise ExerciseFailed(_("{what} stepped {n} times: the last {left} micro-batch(es) "
                                   "form a shorter group that needs its own step ({steps} steps here)").format(
                what=what, n=len(steps), left=n_micro % accumulate, steps=len(groups)))
        if log["forwards"] != n_micro:
            one_per_group = log["forwards"] == len(groups) and len(groups) < n_micro
            if one_per_group:
                raise ExerciseFailed(_("{what} ran {n} forward passes, expected one per micro-batch ({n_micro}): one "
                                       "forward per group is not accumulation; micro-batches exist because a whole "
                                       "group does not fit in memory at once").format(
                    what=what, n=log["forwards"], n_micro=n_micro))
            raise ExerciseFailed(_("{what} ran {n} forward passes, expected one per micro-batch ({n_micro})").format(
                what=what, n=log["forwards"], n_micro=n_micro))
        if steps != ends:
            raise ExerciseFailed(_("{what} stepped after micro-batches {steps}, expected after {ends}").format(
                what=what, steps=steps, ends=ends))
        if not syncs:
            raise ExerciseFailed(_("{what} never all-reduced the gradients: run the forward and backward of the last "
                                   "micro-batch of each group outside no_sync(), through ddp_model(...)").format(what=what))
        if len(set(syncs)) == n_micro and n_micro != len(groups):
            raise ExerciseFailed(_("{what} all-reduced after every micro-batch: run all but the last micro-batch of each "
                                   "group inside `with ddp_model.no_sync():`, forward and backward (DDP decides at "
                                   "forward time whether to sync)").format(what=what))
        if sorted(set(syncs)) != ends:
            raise ExerciseFailed(_("{what} all-reduced after micro-batches {syncs}, expected once per group, "
                                   "after micro-batches {ends}: only the last micro-batch of a group syncs").format(
                what=what, syncs=sorted(set(syncs)), ends=ends))

        def same(weights):
            return all(torch.allclose(a, b, atol=1e-5) for a, b in zip(got, weights))
        if same(_plain_training(3, micro, groups, lr)):
            continue
        if n_micro % accumulate and same(_plain_training(3, micro, groups, lr, divide_by=accumulate)):
            raise ExerciseFailed(_("{what}: the last, shorter group divided its loss by {accumulate}: divide by the "
                                   "number of micro-batches in the group, so that each step uses the mean loss").format(
                what=what, accumulate=accumulate))
        if same(_plain_training(3, micro, groups, lr, divide_by=1)):
            raise ExerciseFailed(_("{what} stepped on the sum of the micro-batch losses: divide each by the number of "
                                   "micro-batches in its group, so that each step uses the mean loss").format(what=what))
        if same([p.detach() for p in _ScaledNet(3).parameters()]):
            raise ExerciseFailed(_("{what} called optimizer.step() {n} times, but no weight changed: the "
                                   "gradients were zero or None when it stepped (zero them before a group's first "
                                   "backward, not between backward and step)").format(what=what, n=len(steps)))
        if n_micro > accumulate and same(_plain_training(3, micro, groups, lr, divide_by=n_micro)):
            raise ExerciseFailed(_("{what} divided each loss by the number of all micro-batches ({n_micro}): divide by "
                                   "the number in its group, so that each step uses that group's mean loss").format(
                what=what, n_micro=n_micro))
        for divide_by, fault in [(None, _("{what} used F.cross_entropy(..., reduction=\"sum\") (divided by the group's "
                                          "size): the loss of each micro-batch is the mean over its samples, the default "
                                          "reduction")),
                                 (1, _("{what} used F.cross_entropy(..., reduction=\"sum\") (summed): the loss of each "
                                       "micro-batch is the mean over its samples, the default reduction"))]:
            if same(_plain_training(3, micro, groups, lr, divide_by=divide_by, reduction="sum")):
                raise ExerciseFailed(fault.format(what=what))
        for zero, fault in [("never", _("{what} never zeroed the gradients, so each group's gradients leaked into the "
                                        "later steps: zero them once per group, before its first micro-batch")),
                            ("once", _("{what} zeroed the gradients only once, so each group's gradients leaked into the "
                                       "later steps: zero them once per group, before its first micro-batch")),
                            ("after", _("{what} zeroed the gradients only after each step, so the stale ones the model "
                                        "came with leaked into the first step: zero them once per group, before its "
                                        "first micro-batch")),
                            ("each", _("{what} zeroed the gradients before every micro-batch, so each step used the last "
                                       "micro-batch of its group alone: zero them once per group, before its first "
                                       "micro-batch"))]:
            if same(_plain_training(3, micro, groups, lr, zero=zero)):
                raise ExerciseFailed(fault.format(what=what))
        expected = _plain_training(3, micro, groups, lr)
        name = next(n for n, a, b in zip(names, got, expected) if not torch.allclose(a, b, atol=1e-5))
        raise ExerciseFailed(_("{what}: {name} after training differs from SGD on the mean loss of each group "
                               "(the gradient of the mean loss over its micro-batches, one step per group)").format(
            what=what, name=name))


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "") if dtype is not None else "-"


def _fsdp_units(model: nn.Module) -> dict[str, bool]:
    from torch.distributed.fsdp import FSDPModule

    return {name: isinstance(m, FSDPModule) for name, m in model.named_modules()}


def _unit_mesh(unit: nn.Module):
    """The device mesh an FSDP2 unit was sharded over, or None where this torch keeps it elsewhere."""
    try:
        return unit._get_fsdp_state()._fsdp_param_group.mesh_info.mesh
    except AttributeError:
        return None


def _policy(unit: nn.Module):
    """The MixedPrecisionPolicy an FSDP2 unit was given, or None where this torch keeps it elsewhere."""
    try:
        return unit._get_fsdp_state()._mp_policy
    except AttributeError:
        return None


def _raise_precision_fault(what: str, compute: dict[str, torch.dtype], head: str, crashed: str | None = None) -> None:
    """Fail unless every Linear recorded so far computed in bfloat16; say which units lack the policy.

    crashed: the error the forward then raised, as 'RuntimeError: ...' (without the call that raised it)."""
    if torch.float16 in compute.values():
        raise ExerciseFailed(_("{what}: the model computed in float16; the exercise asks for bfloat16, which keeps "
                               "float32's range").format(what=what))
    blocks = {dtype for name, dtype in compute.items() if name != head}
    head_dtype = compute.get(head)
    why = _(" (the forward then raised {error})").format(error=crashed) if crashed else ""
    if torch.float32 in blocks and (head_dtype == torch.bfloat16 or crashed):
        raise ExerciseFailed(_("{what}: the blocks computed in float32 but the head in bfloat16{why}: give each Block's "
                               "fully_shard the mixed-precision policy too").format(what=what, why=why))
    if blocks == {torch.bfloat16} and head_dtype == torch.float32:
        raise ExerciseFailed(_("{what}: the blocks computed in bfloat16 but the head in float32{why}: give the root's "
                               "fully_shard the same policy").format(what=what, why=why))
    if blocks | {head_dtype} != {torch.bfloat16}:
        raise ExerciseFailed(_("{what}: the model computed in {dtype}{why}: give "
                               "fully_shard a MixedPrecisionPolicy whose param_dtype is torch.bfloat16").format(
            what=what, dtype=_dtype_name(head_dtype or next(iter(blocks), None)), why=why))


def _unit_label(name: str) -> str:
    """An FSDP unit as a message names it: 'the root' in the learner's language, a Block by its name ('0')."""
    return _("the root") if name == "the root" else name


def _raised(err: ExerciseFailed) -> str:
    """'RuntimeError: ...': what the learner's call raised, as call()'s one-line failure ends, without the call."""
    cause = err.__context__  # call() raises its ExerciseFailed while handling the learner's exception
    if isinstance(cause, Exception):
        return f"{type(cause).__name__}: {first_line(cause)}{error_hint(cause, ERROR_HINTS)}"
    return err.message.split(" raised ", 1)[-1]


@exercise("shard_model")
def check_shard_model(fn) -> None:
    expect_callable(fn)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    for dim, n_blocks, n_classes, seed in [(12, 3, 7, 4), (8, 2, 11, 5)]:
        model = block_model(dim, n_blocks, n_classes, seed)
        what = _("shard_model(model with {n_blocks} Blocks and a head, mesh)").format(n_blocks=n_blocks)
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
        with one_rank_group() as usable:
            if not usable:
                raise ExerciseFailed(_("a process group of several ranks is already initialized in this kernel, so the "
                                       "check cannot build its one-rank mesh: restart the kernel"))
            mesh = init_device_mesh("cpu", (1,))
            try:
                optimizer = call(fn, model, mesh, shown="model, mesh")
            except ExerciseFailed as err:
                units = _fsdp_units(model)
                if units[""] and not all(units[str(i)] for i in range(n_blocks)):
                    raise ExerciseFailed(_("{message} (fully_shard ran on a Block after the root was sharded, and the "
                                           "root's call had taken every parameter not yet in a unit, the Blocks' too: "
                                           "shard bottom-up, each Block first, then the root)").format(
                        message=err.message)) from None
                raise
            if optimizer is None:
                raise ExerciseFailed(_("{what} returned None: return the optimizer you made for the sharded model").format(
                    what=what))
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise ExerciseFailed(_("{what} returned {a_type}, expected a torch.optim.Optimizer").format(
                    what=what, a_type=a_type(optimizer)))
            units = _fsdp_units(model)
            blocks = [str(i) for i in range(n_blocks)]
            if not units[""]:
                raise ExerciseFailed(_("{what}: the model itself is not sharded: call fully_shard on the root too, after "
                                       "the blocks, so that it holds whatever the blocks do not (the head)").format(
                    what=what))
            missing = [b for b in blocks if not units[b]]
            inner = [name for name, unit in units.items() if unit and "." in name]
            if missing and inner:
                raise ExerciseFailed(_("{what}: block {block} is not an FSDP unit of its own (you made {inner} inside it "
                                       "one): call fully_shard on each Block, whole, before the root").format(
                    what=what, block=missing[0], inner=inner[0]))
            if missing:
                raise ExerciseFailed(_("{what}: block {block} is not an FSDP unit of its own: call fully_shard on each "
                                       "Block, whole, before the root").format(what=what, block=missing[0]))
            if inner:
                raise ExerciseFailed(_("{what} made {inner} a unit of its own: each Block is one unit, gathered whole "
                                       "just before it runs; do not shard the layers inside it separately").format(
                    what=what, inner=inner[0]))
            sharded = {name or "the root": m for name, m in model.named_modules() if isinstance(m, FSDPModule)}
            other_mesh = [name for name, m in sharded.items() if _unit_mesh(m) is not None and _unit_mesh(m) is not mesh]
            if other_mesh:
                raise ExerciseFailed(_("{what}: {unit} was sharded over another device mesh than the one passed "
                                       "in: give fully_shard mesh=mesh for each unit (without it, FSDP2 builds a mesh over "
                                       "every rank of the default group)").format(what=what, unit=_unit_label(other_mesh[0])))
            no_param_dtype = [(name, _policy(m)) for name, m in sharded.items()
                              if _policy(m) is not None and _policy(m).param_dtype is None
                              and (_policy(m).output_dtype is not None or _policy(m).reduce_dtype is not None)]
            if no_param_dtype:
                name, policy = no_param_dtype[0]
                given = ", ".join(f"{field}={_dtype_name(getattr(policy, field))}" for field in ("reduce_dtype", "output_dtype")
                                  if getattr(policy, field) is not None)
                if name == "the root":
                    raise ExerciseFailed(_("{what}: the MixedPrecisionPolicy of the root sets {given} but not param_dtype, "
                                           "the dtype the unit computes in: set param_dtype=torch.bfloat16").format(
                        what=what, given=given))
                raise ExerciseFailed(_("{what}: the MixedPrecisionPolicy of block {block} sets {given} but not "
                                       "param_dtype, the dtype the unit computes in: set param_dtype=torch.bfloat16").format(
                    what=what, block=name, given=given))
            params = list(model.parameters())
            held = [p for group in optimizer.param_groups for p in group["params"]]
            if held and all(id(p) in old for p in held):
                raise ExerciseFailed(_("{what} returned an optimizer made before fully_shard: it holds the old parameters, "
                                       "which fully_shard replaced by DTensors, so its step would update nothing the model "
                                       "uses; make the optimizer after sharding").format(what=what))
            if {id(p) for p in held} != {id(p) for p in params} or len(held) != len(params):
                raise ExerciseFailed(_("{what}: the optimizer holds {held} tensors, the model has {params} "
                                       "parameters: give it model.parameters() after sharding").format(
                    what=what, held=len(held), params=len(params)))
            if type(optimizer) is not torch.optim.AdamW:
                raise ExerciseFailed(_("{what} returned {type}, expected torch.optim.AdamW").format(
                    what=what, type=type_name(optimizer)))
            lr = optimizer.param_groups[0].get("lr")
            if lr != 1e-3:
                raise ExerciseFailed(_("{what}: the optimizer's lr is {lr!r}, expected 1e-3").format(what=what, lr=lr))
            low = [name for name, p in model.named_parameters() if p.dtype != torch.float32]
            if low:
                raise ExerciseFailed(_("{what}: the sharded parameter {name} is {dtype}: "
                                       "keep the parameters (and so the optimizer's step) in float32; the policy casts "
                                       "copies for the forward and backward").format(
                    what=what, name=low[0], dtype=_dtype_name(dict(model.named_parameters())[low[0]].dtype)))
            if not all(isinstance(p, DTensor) for p in params):
                raise ExerciseFailed(_("{what}: not every parameter is a DTensor: shard the root with fully_shard").format(
                    what=what))
            before = [p.detach().full_tensor().clone() for p in params]
            try:
                out = call(model, x, name=_("the sharded model"), kind="module")
            except ExerciseFailed as err:
                if "must have the same dtype" in err.message or "mixed dtype" in err.message:
                    no_cast = [name or "the root" for name, m in model.named_modules()
                               if isinstance(m, FSDPModule) and not m._get_fsdp_state()._mp_policy.cast_forward_inputs]
                    if no_cast:
                        raise ExerciseFailed(_("{message} (the policy of {unit} has cast_forward_inputs=False, so "
                                               "its float32 input met bfloat16 weights: leave cast_forward_inputs at "
                                               "True)").format(message=err.message, unit=_unit_label(no_cast[0]))) from None
                    _raise_precision_fault(what, compute, str(n_blocks), crashed=_raised(err))  # a bfloat16 unit fed a float32 one
                raise
            if not isinstance(out, torch.Tensor):
                raise ExerciseFailed(_("the sharded model returned {a_type}, expected a tensor of logits").format(
                    a_type=a_type(out)))
            _raise_precision_fault(what, compute, str(n_blocks))
            F.cross_entropy(out.float(), y).backward()
            optimizer.step()
            still = [name for (name, p), b in zip(model.named_parameters(), before) if torch.equal(p.detach().full_tensor(), b)]
            if still:
                raise ExerciseFailed(_("{what}: after one backward and optimizer.step(), {name} did not change").format(
                    what=what, name=still[0]))


# The training script: run on two real ranks, judged by what each rank did.

_SCRIPT_EPOCHS, _SCRIPT_BATCH, _SCRIPT_LR = 2, 48, 0.05


def _expect_script(script) -> Path:
    if script is None:
        raise ExerciseFailed(_("expected the path of your script, got None: run the cell that sets it"))
    if isinstance(script, bool) or not isinstance(script, (str, os.PathLike)):
        raise ExerciseFailed(_("expected the path of your script (a str or pathlib.Path), got {a_type}").format(
            a_type=a_type(script)))
    path = Path(script)
    if not path.is_file():
        raise ExerciseFailed(_("expected the path of your script, but {file} does not exist: run the %%writefile cell "
                               "above").format(file=path.name))
    return path


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _judge_launch(runs: list[RankRun], name: str, timeout: float, grace: float) -> None:
    """Errors first: the untouched stub is 'not attempted'; otherwise the first rank's error, in one line, naming the rank."""
    errors = [(run.record["error"], run) for run in runs if run.record and run.record.get("error")]
    stub = next((err for err, _run in errors if err["stub"]), None)
    if stub:
        raise ExerciseNotAttempted(not_attempted_message("ddp_digits"))  # a rank reached the script's untouched stub
    if errors:
        err, run = min(errors, key=lambda e: e[0]["time"])
        if err["type"] == "SystemExit":
            detail = _last_line(run.stderr)
            code = err["message"].split()[-1]
            if detail:
                raise ExerciseFailed(_("rank {rank} exited with code {code}: {detail}").format(
                    rank=run.rank, code=code, detail=detail))
            raise ExerciseFailed(_("rank {rank} exited with code {code}").format(rank=run.rank, code=code))
        where = _(" ({file}, line {line}, in {function})").format(
            file=name, line=err["line"], function=err["function"]) if err["line"] else ""
        hint = ""
        others = [r for r in runs if r is not run]
        if re.search(r"Connection (closed|reset) by peer", err["message"]) and all(
                r.record and not r.record.get("error") for r in others):
            hint = _(" (rank {other} had already finished: a collective that only rank {rank} called, "
                     "say inside `if rank == 0:`?)").format(other=others[0].rank, rank=run.rank)
        saves = run.record.get("saves") or []
        if not hint and saves and saves[-1].get("module") and "pickle" in err["message"]:
            hint = _(" (torch.save of the {type} object pickles it whole, process group included: save "
                     "model.module.state_dict())").format(type=saves[-1]["type"])
        message = re.sub(r"^\[[^\]]*\] ", "", err["message"]) or _("(no message)")  # drop gloo's [source file:line]
        if hint:
            message = message.split(". ")[0]
        raise ExerciseFailed(_("rank {rank} raised {error}: {message}{where}{hint}").format(
            rank=run.rank, error=err["type"], message=message, where=where, hint=hint))
    killed = [run for run in runs if run.killed]
    if killed and len(killed) == len(runs):
        raise ExerciseFailed(_("no rank finished within {timeout:g} s, so they were stopped: does a rank wait in a "
                               "collective that the other never calls?").format(timeout=timeout))
    if killed:
        done = next(run for run in runs if not run.killed)
        raise ExerciseFailed(_("rank {rank} was still running {grace:g} s after rank {done} had finished, "
                               "and was stopped: it waited in a collective that rank "
                               "{done} never called (a barrier or all_reduce inside `if rank == 0:`?)").format(
            rank=killed[0].rank, grace=grace, done=done.rank))
    if runs and runs[0].left_behind:
        first = runs[0].left_behind[0]
        raise ExerciseFailed(_("the ranks exited but left {n} process(es) running, e.g. "
                               "{command!r}: a script must stop what it starts before it ends (the check stopped "
                               "them)").format(n=len(runs[0].left_behind), command=first[:80]))
    for run in runs:
        if run.record is None:
            code = run.returncode
            how = (_("killed by signal {signal}").format(signal=-code) if code is not None and code < 0
                   else _("exit code {code}").format(code=code))
            detail = _last_line(run.stderr)
            if detail:
                raise ExerciseFailed(_("rank {rank} ended ({how}) before the script finished: {detail}").format(
                    rank=run.rank, how=how, detail=detail))
            raise ExerciseFailed(_("rank {rank} ended ({how}) before the script finished without a message "
                                   "(os._exit?)").format(rank=run.rank, how=how))


def _one_process(steps: list[list[int]], lr: float, momentum: float = 0.0, zero: bool = True,
                 reduction: str = "mean", world_size: int = 2) -> dict[str, torch.Tensor]:
    """The weights of one process trained with SGD on the given global batches (lists of training-set indices).

    reduction="sum": what DDP gives when each rank steps on the sum of its losses (the mean over ranks of the sums)."""
    data = TrainingDigits()
    images, labels = data.images, data.labels
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    for index in steps:
        if zero:
            optimizer.zero_grad()
        loss = F.cross_entropy(model(images[index]), labels[index], reduction=reduction)
        (loss / world_size if reduction == "sum" else loss).backward()
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _fitted_lr(early: dict, steps: list[list[int]]) -> float | None:
    """The lr with which two plain SGD steps on these global batches give the weights `early`, if one does, else None."""
    data = TrainingDigits()
    batches = [(data.images[index], data.labels[index]) for index in steps]

    def miss(log_lr: float) -> float:
        model = make_model()
        for images, labels in batches:
            grads = torch.autograd.grad(F.cross_entropy(model(images), labels), list(model.parameters()))
            with torch.no_grad():
                for p, g in zip(model.parameters(), grads):
                    p.sub_(g, alpha=10 ** log_lr)
        return _max_diff(early, model.state_dict())
    low, high = -5.0, 1.5  # lr from 1e-5 to about 30, searched on a log scale (the miss is smooth in lr)
    golden = (5 ** 0.5 - 1) / 2
    a, b = high - golden * (high - low), low + golden * (high - low)
    fa, fb = miss(a), miss(b)
    for _step in range(36):
        if fa < fb:
            high, b, fb = b, a, fa
            a = high - golden * (high - low)
            fa = miss(a)
        else:
            low, a, fa = a, b, fb
            b = low + golden * (high - low)
            fb = miss(b)
    best = a if fa < fb else b
    return 10 ** best if min(fa, fb) < 1e-5 else None


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
            raise ExerciseFailed(_("rank {rank} never called make_model(): build the model with "
                                   "course_utils.ddp_models.make_model(), so that the check can follow it").format(rank=rank))
        reads = rec["reads"]
        if not reads:
            raise ExerciseFailed(_("rank {rank} read no sample of training_digits() in its own process: train on "
                                   "course_utils.ddp_models.training_digits() through a DataLoader without "
                                   "num_workers").format(rank=rank))
        if rec.get("outside"):
            raise ExerciseFailed(ngettext(
                "rank {rank} read {n:,} training sample outside a DataLoader (by indexing training_digits() in its own "
                "code): read them only through the training DataLoader, with its DistributedSampler",
                "rank {rank} read {n:,} training samples outside a DataLoader (by indexing training_digits() in its own "
                "code): read them only through the training DataLoader, with its DistributedSampler",
                rec["outside"]).format(rank=rank, n=rec["outside"]))
        if len(reads) == epochs * n:
            raise ExerciseFailed(_("rank {rank} read all {n:,} training samples in every epoch: give the DataLoader a "
                                   "DistributedSampler, so that each rank reads its own share").format(rank=rank, n=n))
        if len(reads) == epochs * (share - share % batch):
            raise ExerciseFailed(_("rank {rank} read {read} of its {share} samples per epoch: the last, "
                                   "shorter batch was dropped (drop_last=True?); every sample counts once per "
                                   "epoch").format(rank=rank, read=share - share % batch, share=share))
        if len(reads) % share == 0 and len(reads) != epochs * share and rec.get("outside") == 0:
            k = len(reads) // share
            raise ExerciseFailed(ngettext(
                "rank {rank} read its share of {share} samples {k} time, so it trained {k} epoch: run --epochs epochs "
                "({epochs} here)",
                "rank {rank} read its share of {share} samples {k} times, so it trained {k} epochs: run --epochs epochs "
                "({epochs} here)", k).format(rank=rank, share=share, k=k, epochs=epochs))
        if len(reads) != epochs * share:
            raise ExerciseFailed(_("rank {rank} read {read} training samples in {epochs} epochs, expected "
                                   "{epochs} x {share}: read training_digits() only through the training "
                                   "DataLoader").format(rank=rank, read=len(reads), epochs=epochs, share=share))
    per_epoch = [[rec["reads"][e * share:(e + 1) * share] for e in range(epochs)] for rec in records]
    for e in range(epochs):
        shares = [set(p[e]) for p in per_epoch]
        common = shares[0] & shares[1]
        if common:
            raise ExerciseFailed(_("in epoch {epoch}, ranks 0 and 1 read {n} of the same samples: each rank must "
                                   "read its own share (DistributedSampler takes the rank and world size from the process "
                                   "group; do not pass other values)").format(epoch=e + 1, n=len(common)))
        if sorted(i for p in per_epoch for i in p[e]) != list(range(n)):
            raise ExerciseFailed(_("in epoch {epoch}, the ranks together did not read every training sample exactly "
                                   "once").format(epoch=e + 1))
    for rank, epochs_read in enumerate(per_epoch):
        if all(order == sorted(order) for order in epochs_read):
            raise ExerciseFailed(_("rank {rank} read its samples in index order: leave DistributedSampler's shuffling "
                                   "on").format(rank=rank))
        if len({tuple(order) for order in epochs_read}) < epochs:
            raise ExerciseFailed(_("rank {rank} read its samples in the same order in every epoch: call "
                                   "sampler.set_epoch(epoch) at the start of each epoch, on every rank").format(rank=rank))
    steps_per_rank = []
    for rank, rec in enumerate(records):
        sizes = rec["batches"]
        if sum(sizes) != len(rec["reads"]):
            raise ExerciseFailed(_("rank {rank}'s model ran training forward passes on {n} samples, but the rank "
                                   "read {read}: run one forward pass per batch of the DataLoader, in train mode").format(
                rank=rank, n=sum(sizes), read=len(rec["reads"])))
        if max(sizes) != batch:
            raise ExerciseFailed(_("rank {rank} trained on batches of {n} samples, expected --batch-size "
                                   "({batch} here) per rank").format(rank=rank, n=max(sizes), batch=batch))
        bounds = torch.tensor([0, *sizes]).cumsum(0).tolist()
        steps_per_rank.append([rec["reads"][a:b] for a, b in zip(bounds, bounds[1:])])
    if len(steps_per_rank[0]) != len(steps_per_rank[1]):
        raise ExerciseFailed(_("rank 0 took {steps_0} steps, rank 1 {steps_1}: every rank "
                               "must take the same number, or one waits forever in its next all-reduce").format(
            steps_0=len(steps_per_rank[0]), steps_1=len(steps_per_rank[1])))
    for rank, rec in enumerate(records):
        if not any(rec["ddp_wraps"]):
            raise ExerciseFailed(_("rank {rank} never wrapped the model from make_model() in "
                                   "DistributedDataParallel").format(rank=rank))
    states = [rec["state"] for rec in records]
    apart = _max_diff(states[0], states[1])
    if apart > 1e-5:
        raise ExerciseFailed(_("the ranks ended with different weights (max |difference| {apart:.1e}): their gradients "
                               "were not averaged at every step; DDP averages them in a backward that follows a forward "
                               "through the DDP model itself").format(apart=apart))
    steps = [a + b for a, b in zip(*steps_per_rank)]
    expected = _one_process(steps, lr)
    off = _max_diff(states[0], expected)
    if off > 1e-4:
        world_size, early = len(runs), records[0].get("after_two_steps")
        for variant, fault in [({"momentum": 0.9}, _("the ranks trained with momentum 0.9: use plain SGD, no momentum")),
                               ({"zero": False}, _("the ranks trained without zeroing the gradients: zero them at every "
                                                   "step")),
                               ({"lr": lr * world_size}, _("the ranks trained with lr {lr:g}, --lr times the world size: "
                                                           "use --lr as given (scaling it is the launcher's choice, not "
                                                           "the script's)").format(lr=lr * world_size)),
                               ({"reduction": "sum"}, _("the ranks trained on the sum of the cross-entropy over each batch "
                                                        "(reduction='sum'): use the mean"))]:
            # After two steps, before training amplifies the rounding of a large step (lr x world size, a summed loss).
            if early is not None and len(steps) > 2 and _max_diff(early, _one_process(steps[:2], **{"lr": lr, **variant})) < 1e-4:
                raise ExerciseFailed(fault)
        used = _fitted_lr(early, steps[:2]) if early is not None and len(steps) > 2 else None
        if used is not None and not math.isclose(used, lr, rel_tol=0.01):
            raise ExerciseFailed(_("the ranks trained with lr {used:.3g}, not --lr ({lr:g} here): pass args.lr to the "
                                   "optimizer").format(used=used, lr=lr))
        raise ExerciseFailed(_("rank 0's weights after training differ from one process trained on the same global "
                               "batches with SGD(lr={lr:g}) on the mean cross-entropy (max |difference| {off:.1e}): "
                               "one optimizer step per batch, lr=--lr, no momentum").format(lr=lr, off=off))
    spoke = _last_line(runs[1].stdout)
    if spoke:
        raise ExerciseFailed(_("rank 1 printed {line!r}: only rank 0 logs, or every line appears once per rank").format(
            line=spoke[:60]))
    logged = [line for line in runs[0].stdout.splitlines() if line.strip().lower().startswith("epoch")]
    if len(logged) != epochs:
        raise ExerciseFailed(_("rank 0 printed {n} lines that start with 'epoch', expected one per epoch "
                               "({epochs})").format(n=len(logged), epochs=epochs))
    saves = [rec["saves"] for rec in records]
    if saves[1]:
        raise ExerciseFailed(_("rank 1 called torch.save too: only rank 0 writes the checkpoint (if rank == 0:)"))
    if not saves[0]:
        raise ExerciseFailed(_("rank 0 never called torch.save: save the trained weights to --out after the last epoch"))
    if len(saves[0]) > 1:
        raise ExerciseFailed(_("rank 0 called torch.save {n} times: save once, after the last epoch").format(
            n=len(saves[0])))
    path = Path(saves[0][0]["path"])
    if not path.is_absolute() or path.resolve() != out.resolve():
        if (out.parent / path).resolve() != out.resolve():
            raise ExerciseFailed(_("rank 0 saved to {path!r}, not to the path given as --out").format(path=str(path)))
    if saves[0][0].get("module"):
        raise ExerciseFailed(_("rank 0 saved the model object itself (torch.save of a {type}): save "
                               "model.module.state_dict(), which loads with torch.load(weights_only=True) into "
                               "make_model()").format(type=saves[0][0]["type"]))
    try:
        state = torch.load(out, weights_only=True)
    except Exception as err:  # noqa: BLE001 -- an unloadable file is the learner's
        raise ExerciseFailed(_("the checkpoint does not load with torch.load(weights_only=True) ({error}): "
                               "save model.module.state_dict(), not the model object").format(
            error=type(err).__name__)) from None
    if not isinstance(state, dict):
        raise ExerciseFailed(_("the checkpoint holds {a_type}: save model.module.state_dict()").format(a_type=a_type(state)))
    if any(str(k).startswith("module.") for k in state):
        raise ExerciseFailed(_("the checkpoint's keys are like {key!r}, the DDP wrapper's state_dict: save "
                               "model.module.state_dict(), which loads into the plain model").format(key=next(iter(state))))
    plain = make_model()
    try:
        plain.load_state_dict(state)
    except Exception as err:  # noqa: BLE001
        raise ExerciseFailed(_("the checkpoint does not load into make_model(): {message}").format(
            message=str(err).strip().splitlines()[0])) from None
    if _max_diff(plain.state_dict(), states[0]) > 0:
        raise ExerciseFailed(_("the checkpoint holds other weights than the model's at the end of training: save after "
                               "the last epoch"))
    for rank, rec in enumerate(records):
        if rec["initialized_at_end"]:
            raise ExerciseFailed(_("rank {rank} never called dist.destroy_process_group(): call it at the end, on every "
                                   "rank").format(rank=rank))


@exercise("ddp_digits")
def check_ddp_digits(script) -> None:
    from course_utils.rank_server import RankServer
    from course_utils.tooling.checks import exercise_seconds

    path = _expect_script(script).resolve()
    if untouched_script(path):  # told without starting the ranks (about 4 s)
        raise ExerciseNotAttempted(not_attempted_message("ddp_digits"))
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="lesson09-check-") as tmp, RankServer() as server:
        # the ranks get what the server's start left of the check's time, less 5 s to judge
        timeout, grace = max(5.0, round(exercise_seconds() - 5 - (time.monotonic() - started))), 6.0
        folder = Path(tmp)
        out = folder / "trained.pt"
        args = ["--epochs", str(_SCRIPT_EPOCHS), "--batch-size", str(_SCRIPT_BATCH), "--lr", str(_SCRIPT_LR),
                "--out", str(out)]
        runs = run_script(path, args, folder, timeout=timeout, grace=grace, server=server)
        if any(run.record and run.record.get("error") and "EADDRINUSE" in run.record["error"]["message"] for run in runs):
            for f in folder.iterdir():
                f.unlink()
            runs = run_script(path, args, folder, timeout=timeout, grace=grace, server=server)  # another program took the port
        _judge_launch(runs, path.name, timeout, grace)
        _judge_training(runs, out)
