"""Lesson 09's checks against the reference solutions, correct alternatives and the wrong answers learners write;
the simulated ranks against real gloo; the training-script check on real ranks; the demos; no leaked process."""

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from course_utils import lesson09 as L
from course_utils import rank_server
from course_utils.ddp_models import Block
from course_utils.distributed import process_status
from course_utils.simulated_ranks import SimulatedWorld
from course_utils.tooling.checks import ExerciseFailed, ExerciseNotAttempted
from lesson_contract import assert_names_fault, assert_passes, contract_tests

PAIRS = [
    (L.check_global_accuracy, L.global_accuracy),
    (L.check_average_gradients, L.average_gradients),
    (L.check_train_accumulated, L.train_accumulated),
    (L.check_shard_model, L.shard_model),
]

(test_reference_passes, test_stub_is_not_attempted, test_bad_input_is_one_named_line, test_hostile_answers_are_the_learners_fault,
 test_checks_leave_the_learners_random_state_alone, test_checks_are_quick) = contract_tests(PAIRS, max_seconds=3.0)

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "solutions" / "09_ddp.ipynb"


# global_accuracy: correct alternatives and typical wrong answers.

def accuracy_two_reductions(logits, labels):
    correct = (logits.argmax(1) == labels).sum()
    count = torch.tensor(len(labels))
    dist.all_reduce(correct)
    dist.all_reduce(count)
    return correct.item() / count.item()


def accuracy_gather_objects(logits, labels):
    mine = (int((logits.argmax(1) == labels).sum()), len(labels))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return sum(c for c, _ in everyone) / sum(n for _, n in everyone)


def accuracy_async_float32(logits, labels):
    totals = torch.tensor([float((logits.argmax(-1) == labels).sum()), float(labels.shape[0])])
    work = dist.all_reduce(totals, op=dist.ReduceOp.SUM, async_op=True)
    work.wait()
    return float(totals[0] / totals[1])


def accuracy_local_only(logits, labels):
    return (logits.argmax(1) == labels).float().mean().item()


def accuracy_mean_of_means(logits, labels):
    acc = (logits.argmax(1) == labels).float().mean()
    dist.all_reduce(acc, op=dist.ReduceOp.AVG)
    return acc.item()


def accuracy_reduce(logits, labels):
    totals = torch.stack([(logits.argmax(1) == labels).sum(), torch.tensor(len(labels))]).double()
    dist.reduce(totals, dst=0)
    return (totals[0] / totals[1]).item()


def accuracy_returns_tensor(logits, labels):
    totals = torch.stack([(logits.argmax(1) == labels).sum(), torch.tensor(len(labels))]).double()
    dist.all_reduce(totals)
    return totals[0] / totals[1]


def accuracy_in_place_on_labels(logits, labels):
    hits = labels.eq_(logits.argmax(1))
    totals = torch.stack([hits.sum(), torch.tensor(len(labels))]).double()
    dist.all_reduce(totals)
    return (totals[0] / totals[1]).item()


def accuracy_without_wait(logits, labels):
    totals = torch.stack([(logits.argmax(1) == labels).sum(), torch.tensor(len(labels))]).double()
    dist.all_reduce(totals, async_op=True)
    return (totals[0] / totals[1]).item()


def accuracy_equal_shares(logits, labels):
    correct = (logits.argmax(1) == labels).sum().double()
    dist.all_reduce(correct)
    return (correct / (len(labels) * dist.get_world_size())).item()


def accuracy_integer_division(logits, labels):
    totals = torch.stack([(logits.argmax(1) == labels).sum(), torch.tensor(len(labels))])
    dist.all_reduce(totals)
    return int(totals[0]) // int(totals[1])


def accuracy_on_rank0_only(logits, labels):
    totals = torch.stack([(logits.argmax(1) == labels).sum(), torch.tensor(len(labels))]).double()
    if dist.get_rank() == 0:
        dist.all_reduce(totals)
    return (totals[0] / totals[1]).item()


def accuracy_gather_labels(logits, labels):
    everyone = [torch.zeros_like(labels) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, (logits.argmax(1) == labels).long())
    return torch.cat(everyone).float().mean().item()


def accuracy_weighted_means(logits, labels):
    weighted = torch.stack([(logits.argmax(1) == labels).double().mean() * len(labels), torch.tensor(float(len(labels)))])
    dist.all_reduce(weighted)
    return (weighted[0] / weighted[1]).item()


def accuracy_floor_of_floats(logits, labels):
    totals = torch.stack([(logits.argmax(1) == labels).sum(), torch.tensor(len(labels))])
    dist.all_reduce(totals)
    return float(totals[0] // totals[1])


def accuracy_broadcast_from_rank0(logits, labels):
    mine = torch.tensor([(logits.argmax(1) == labels).double().mean().item() if len(labels) else 0.0])
    dist.broadcast(mine, src=0)
    return mine.item()


# average_gradients.

def average_with_avg_op(model):
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.AVG)
    for g, chunk in zip(grads, torch.split(flat, [g.numel() for g in grads])):
        g.copy_(chunk.reshape(g.shape))


def average_into_views(model):
    params = [p for p in model.parameters() if p.grad is not None]
    flat = torch.cat([p.grad.view(-1) for p in params]) / dist.get_world_size()
    work = dist.all_reduce(flat, async_op=True)
    work.wait()
    offset = 0
    for p in params:
        p.grad = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()


def average_by_gathering(model):
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.flatten() for g in grads])
    everyone = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, flat)
    mean = torch.stack(everyone).mean(0)
    start = 0
    for g in grads:
        g.copy_(mean[start:start + g.numel()].view_as(g))
        start += g.numel()


def average_per_parameter(model):
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()


def average_without_copy_back(model):
    flat = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()


def average_sum_only(model):
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat)
    for g, chunk in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(chunk.view_as(g))


def average_by_two(model):
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat)
    flat /= 2
    for g, chunk in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(chunk.view_as(g))


def average_including_frozen(model):
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat)


def average_to_rank0(model):
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.flatten() for g in grads])
    dist.reduce(flat, dst=0)
    flat /= dist.get_world_size()
    for g, chunk in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(chunk.view_as(g))


def average_the_parameters(model):
    params = [p for p in model.parameters() if p.grad is not None]
    flat = torch.cat([p.data.flatten() for p in params])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    for p, chunk in zip(params, flat.split([p.numel() for p in params])):
        p.data.copy_(chunk.view_as(p))


def average_without_wait(model):
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat, async_op=True)
    flat /= dist.get_world_size()
    for g, chunk in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(chunk.view_as(g))


def average_zeros_for_frozen(model):
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    L.average_gradients(model)


def average_on_rank0_only(model):
    if dist.get_rank() == 0:
        L.average_gradients(model)


def average_in_reverse(model):
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    start = 0
    for g in reversed(grads):   # the chunks come back in the wrong order
        g.copy_(flat[start:start + g.numel()].view_as(g))
        start += g.numel()


def average_avg_then_divide(model):
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.AVG)
    flat /= dist.get_world_size()
    for g, chunk in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(chunk.view_as(g))


def average_floor_division(model):
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat //= dist.get_world_size()
    for g, chunk in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(chunk.view_as(g))


def average_submodules_only(model):  # misses the parameter registered on the model itself
    grads = [p.grad for child in model.children() for p in child.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    for g, chunk in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(chunk.view_as(g))


def average_offsets_count_frozen(model):
    params = list(model.parameters())
    flat = torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    start = 0
    for p in params:
        if p.grad is not None:
            p.grad.copy_(flat[start:start + p.numel()].view_as(p))
        start += p.numel()


# train_accumulated.

def accumulate_by_index(ddp_model, optimizer, micro_batches, accumulate):
    n = len(micro_batches)
    for i, (x, y) in enumerate(micro_batches):
        if i % accumulate == 0:
            optimizer.zero_grad(set_to_none=True)
            size = min(accumulate, n - i)
        last = (i + 1) % accumulate == 0 or i == n - 1
        if last:
            (F.cross_entropy(ddp_model(x), y) / size).backward()
            optimizer.step()
        else:
            with ddp_model.no_sync():
                (F.cross_entropy(ddp_model(x), y) / size).backward()


def accumulate_with_exit_stack(ddp_model, optimizer, micro_batches, accumulate):
    for start in range(0, len(micro_batches), accumulate):
        group = micro_batches[start:start + accumulate]
        ddp_model.zero_grad()
        for j, (x, y) in enumerate(group):
            with contextlib.ExitStack() as stack:
                if j < len(group) - 1:
                    stack.enter_context(ddp_model.no_sync())
                loss = F.cross_entropy(ddp_model(x), y) / len(group)
                loss.backward()
        optimizer.step()


def accumulate_mean_of_group(ddp_model, optimizer, micro_batches, accumulate):
    chunks = [micro_batches[i:i + accumulate] for i in range(0, len(micro_batches), accumulate)]
    for chunk in chunks:
        optimizer.zero_grad()
        if len(chunk) > 1:
            with ddp_model.no_sync():
                for x, y in chunk[:-1]:
                    F.cross_entropy(ddp_model(x), y).div(len(chunk)).backward()
        x, y = chunk[-1]
        F.cross_entropy(ddp_model(x), y).div(len(chunk)).backward()
        optimizer.step()


def accumulate_every_micro_batch_syncs(ddp_model, optimizer, micro_batches, accumulate):
    for start in range(0, len(micro_batches), accumulate):
        group = micro_batches[start:start + accumulate]
        optimizer.zero_grad()
        for x, y in group:
            (F.cross_entropy(ddp_model(x), y) / len(group)).backward()
        optimizer.step()


def accumulate_never_syncs(ddp_model, optimizer, micro_batches, accumulate):
    for start in range(0, len(micro_batches), accumulate):
        group = micro_batches[start:start + accumulate]
        optimizer.zero_grad()
        with ddp_model.no_sync():
            for x, y in group:
                (F.cross_entropy(ddp_model(x), y) / len(group)).backward()
        optimizer.step()


def accumulate_forward_outside(ddp_model, optimizer, micro_batches, accumulate):
    for start in range(0, len(micro_batches), accumulate):
        group = micro_batches[start:start + accumulate]
        optimizer.zero_grad()
        for j, (x, y) in enumerate(group):
            loss = F.cross_entropy(ddp_model(x), y) / len(group)
            if j < len(group) - 1:
                with ddp_model.no_sync():
                    loss.backward()
            else:
                loss.backward()
        optimizer.step()


def accumulate_step_every_micro_batch(ddp_model, optimizer, micro_batches, accumulate):
    for i, (x, y) in enumerate(micro_batches):
        optimizer.zero_grad()
        context = ddp_model.no_sync() if (i + 1) % accumulate else contextlib.nullcontext()
        with context:
            (F.cross_entropy(ddp_model(x), y) / accumulate).backward()
        optimizer.step()


def accumulate_dropping_the_last_group(ddp_model, optimizer, micro_batches, accumulate):
    for g in range(len(micro_batches) // accumulate):
        L.train_accumulated(ddp_model, optimizer, micro_batches[g * accumulate:(g + 1) * accumulate], accumulate)


def accumulate_dividing_by_accumulate(ddp_model, optimizer, micro_batches, accumulate):
    for start in range(0, len(micro_batches), accumulate):
        group = micro_batches[start:start + accumulate]
        optimizer.zero_grad()
        with ddp_model.no_sync():
            for x, y in group[:-1]:
                (F.cross_entropy(ddp_model(x), y) / accumulate).backward()
        (F.cross_entropy(ddp_model(group[-1][0]), group[-1][1]) / accumulate).backward()
        optimizer.step()


def accumulate_summing_losses(ddp_model, optimizer, micro_batches, accumulate):
    for start in range(0, len(micro_batches), accumulate):
        group = micro_batches[start:start + accumulate]
        optimizer.zero_grad()
        with ddp_model.no_sync():
            for x, y in group[:-1]:
                F.cross_entropy(ddp_model(x), y).backward()
        F.cross_entropy(ddp_model(group[-1][0]), group[-1][1]).backward()
        optimizer.step()


def accumulate_without_zero_grad(ddp_model, optimizer, micro_batches, accumulate):
    for start in range(0, len(micro_batches), accumulate):
        group = micro_batches[start:start + accumulate]
        with ddp_model.no_sync():
            for x, y in group[:-1]:
                (F.cross_entropy(ddp_model(x), y) / len(group)).backward()
        (F.cross_entropy(ddp_model(group[-1][0]), group[-1][1]) / len(group)).backward()
        optimizer.step()


def accumulate_zero_after_step(ddp_model, optimizer, micro_batches, accumulate):
    for start in range(0, len(micro_batches), accumulate):
        group = micro_batches[start:start + accumulate]
        with ddp_model.no_sync():
            for x, y in group[:-1]:
                (F.cross_entropy(ddp_model(x), y) / len(group)).backward()
        (F.cross_entropy(ddp_model(group[-1][0]), group[-1][1]) / len(group)).backward()
        optimizer.step()
        optimizer.zero_grad()


def accumulate_zero_once(ddp_model, optimizer, micro_batches, accumulate):
    optimizer.zero_grad()
    accumulate_without_zero_grad(ddp_model, optimizer, micro_batches, accumulate)


def accumulate_last_through_module(ddp_model, optimizer, micro_batches, accumulate):
    for start in range(0, len(micro_batches), accumulate):
        group = micro_batches[start:start + accumulate]
        optimizer.zero_grad()
        with ddp_model.no_sync():
            for x, y in group[:-1]:
                (F.cross_entropy(ddp_model(x), y) / len(group)).backward()
        (F.cross_entropy(ddp_model.module(group[-1][0]), group[-1][1]) / len(group)).backward()
        optimizer.step()


def accumulate_zero_every_micro_batch(ddp_model, optimizer, micro_batches, accumulate):
    for start in range(0, len(micro_batches), accumulate):
        group = micro_batches[start:start + accumulate]
        for i, (inputs, targets) in enumerate(group):
            optimizer.zero_grad()
            with ddp_model.no_sync() if i < len(group) - 1 else contextlib.nullcontext():
                (F.cross_entropy(ddp_model(inputs), targets) / len(group)).backward()
        optimizer.step()


# shard_model.

def shard_slicing_blocks(model, mesh):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for block in model[:-1]:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return torch.optim.AdamW(model.parameters(), lr=0.001)


def shard_head_too(model, mesh):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for _, child in model.named_children():
        fully_shard(child, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return torch.optim.AdamW(model.parameters())  # lr=1e-3 is AdamW's default


def shard_by_class_name(model, mesh):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs = {"mesh": mesh, "mp_policy": MixedPrecisionPolicy(torch.bfloat16, torch.float32)}
    [fully_shard(m, **kwargs) for m in model.modules() if type(m).__name__ == "Block"]
    fully_shard(model, **kwargs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    return optimizer


def _shard(model, mesh, blocks=True, root=True, block_policy=True, root_policy=True, dtype=torch.bfloat16, inner=False):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=dtype)
    for block in model:
        if isinstance(block, Block) and blocks:
            if inner:
                fully_shard(block.up, mesh=mesh, mp_policy=policy)
                fully_shard(block.down, mesh=mesh, mp_policy=policy)
            fully_shard(block, mesh=mesh, **({"mp_policy": policy} if block_policy else {}))
    if root:
        fully_shard(model, mesh=mesh, **({"mp_policy": policy} if root_policy else {}))


def shard_optimizer_first(model, mesh):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _shard(model, mesh)
    return optimizer


def _sharded(name: str, make_optimizer=lambda model: torch.optim.AdamW(model.parameters(), lr=1e-3), **how):
    """A wrong shard_model: _shard(model, mesh, **how), then make_optimizer(model) returned."""
    def answer(model, mesh):
        _shard(model, mesh, **how)
        return make_optimizer(model)
    answer.__name__ = answer.__qualname__ = name
    return answer


shard_without_policy = _sharded("shard_without_policy", block_policy=False, root_policy=False)
shard_root_without_policy = _sharded("shard_root_without_policy", root_policy=False)
shard_blocks_without_policy = _sharded("shard_blocks_without_policy", block_policy=False)
shard_blocks_only = _sharded("shard_blocks_only", root=False)
shard_root_only = _sharded("shard_root_only", blocks=False)
shard_inner_layers = _sharded("shard_inner_layers", inner=True)
shard_in_float16 = _sharded("shard_in_float16", dtype=torch.float16)
shard_without_return = _sharded("shard_without_return", make_optimizer=lambda model: None)
shard_with_sgd = _sharded("shard_with_sgd", make_optimizer=lambda model: torch.optim.SGD(model.parameters(), lr=1e-3))
def shard_root_first(model, mesh):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    for block in model[:-1]:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def shard_without_casting_inputs(model, mesh):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, cast_forward_inputs=False)
    for block in model[:-1]:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


shard_with_another_lr = _sharded("shard_with_another_lr", make_optimizer=lambda model: torch.optim.AdamW(model.parameters(), lr=1e-2))


def shard_a_bfloat16_model(model, mesh):
    model.to(torch.bfloat16)
    _shard(model, mesh, block_policy=False, root_policy=False)
    return torch.optim.AdamW(model.parameters(), lr=1e-3)



# Wrong answers of the blind round on lesson 09 (each names a class of fault the check now tells apart).

def accuracy_max_op(logits, labels):
    totals = torch.tensor([(logits.argmax(1) == labels).sum().item(), len(labels)], dtype=torch.float64)
    dist.all_reduce(totals, op=dist.ReduceOp.MAX)
    return (totals[0] / totals[1]).item()


def accuracy_bfloat16_counts(logits, labels):
    totals = torch.tensor([(logits.argmax(1) == labels).sum().item(), len(labels)], dtype=torch.bfloat16)
    dist.all_reduce(totals)
    return float(totals[0] / totals[1])


def accuracy_in_percent(logits, labels):
    totals = torch.tensor([(logits.argmax(1) == labels).sum().item(), len(labels)], dtype=torch.float64)
    dist.all_reduce(totals)
    return (100 * totals[0] / totals[1]).item()


def accuracy_over_numel(logits, labels):
    totals = torch.tensor([(logits.argmax(1) == labels).sum().item(), logits.numel()], dtype=torch.float64)
    dist.all_reduce(totals)
    return (totals[0] / totals[1]).item()


def accuracy_argmax_over_samples(logits, labels):  # wrong counts, then a float division: no integer-division story
    predictions = logits.argmax(0)[: len(labels)] if len(logits) else labels
    totals = torch.tensor([(predictions == labels[: len(predictions)]).sum().item(), len(labels)], dtype=torch.float64)
    dist.all_reduce(totals)
    return (totals[0] / totals[1]).item()


def _flat_grads(model):
    return [p.grad for p in model.parameters() if p.grad is not None]


def _write_back(grads, flat):
    for g, piece in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(piece.view_as(g))


def average_max_op(model):
    grads = _flat_grads(model)
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.MAX)
    _write_back(grads, flat)


def average_broadcast_rank0(model):
    grads = _flat_grads(model)
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.broadcast(flat, src=0)
    _write_back(grads, flat)


def average_in_float16(model):
    grads = _flat_grads(model)
    flat = torch.cat([g.reshape(-1) for g in grads]).half()
    dist.all_reduce(flat)
    _write_back(grads, flat / dist.get_world_size())


def average_first_gradient_only(model):
    p = next(p for p in model.parameters() if p.grad is not None)  # only the first gradient goes into the collective
    dist.all_reduce(p.grad)
    p.grad /= dist.get_world_size()


def accumulate_consumes_the_list(ddp_model, optimizer, micro_batches, accumulate):
    import contextlib
    while micro_batches:
        group = [micro_batches.pop(0) for _ in range(min(accumulate, len(micro_batches)))]
        optimizer.zero_grad()
        for i, (x, y) in enumerate(group):
            with contextlib.nullcontext() if i == len(group) - 1 else ddp_model.no_sync():
                (F.cross_entropy(ddp_model(x), y) / len(group)).backward()
        optimizer.step()


def accumulate_in_eval_mode(ddp_model, optimizer, micro_batches, accumulate):
    ddp_model.eval()
    L.train_accumulated(ddp_model, optimizer, micro_batches, accumulate)


def _accumulate(ddp_model, optimizer, micro_batches, accumulate, loss_of, zero_between=False):
    import contextlib
    for start in range(0, len(micro_batches), accumulate):
        group = micro_batches[start:start + accumulate]
        if not zero_between:
            optimizer.zero_grad()
        for i, (x, y) in enumerate(group):
            with contextlib.nullcontext() if i == len(group) - 1 else ddp_model.no_sync():
                loss_of(ddp_model(x), y, len(group), len(micro_batches)).backward()
        if zero_between:
            optimizer.zero_grad()
        optimizer.step()


def accumulate_sum_reduction(ddp_model, optimizer, micro_batches, accumulate):
    _accumulate(ddp_model, optimizer, micro_batches, accumulate,
                lambda out, y, n_group, n_all: F.cross_entropy(out, y, reduction="sum") / n_group)


def accumulate_over_all_micro_batches(ddp_model, optimizer, micro_batches, accumulate):
    _accumulate(ddp_model, optimizer, micro_batches, accumulate,
                lambda out, y, n_group, n_all: F.cross_entropy(out, y) / n_all)


def accumulate_zero_before_step(ddp_model, optimizer, micro_batches, accumulate):
    _accumulate(ddp_model, optimizer, micro_batches, accumulate,
                lambda out, y, n_group, n_all: F.cross_entropy(out, y) / n_group, zero_between=True)


def accumulate_own_optimizer(ddp_model, optimizer, micro_batches, accumulate):
    mine = torch.optim.SGD(ddp_model.parameters(), lr=optimizer.param_groups[0]["lr"])
    L.train_accumulated(ddp_model, mine, micro_batches, accumulate)


def accumulate_concatenated_groups(ddp_model, optimizer, micro_batches, accumulate):
    for start in range(0, len(micro_batches), accumulate):
        group = micro_batches[start:start + accumulate]
        optimizer.zero_grad()
        F.cross_entropy(ddp_model(torch.cat([x for x, _ in group])), torch.cat([y for _, y in group])).backward()
        optimizer.step()


def shard_without_mesh(model, mesh):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for block in model[:-1]:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def shard_output_dtype_only(model, mesh):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(output_dtype=torch.bfloat16)
    for block in model[:-1]:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


ALTERNATIVES = [
    (L.check_global_accuracy, accuracy_two_reductions),
    (L.check_global_accuracy, accuracy_gather_objects),
    (L.check_global_accuracy, accuracy_async_float32),
    (L.check_average_gradients, average_with_avg_op),
    (L.check_average_gradients, average_into_views),
    (L.check_average_gradients, average_by_gathering),
    (L.check_train_accumulated, accumulate_by_index),
    (L.check_train_accumulated, accumulate_with_exit_stack),
    (L.check_train_accumulated, accumulate_mean_of_group),
    (L.check_shard_model, shard_slicing_blocks),
    (L.check_shard_model, shard_head_too),
    (L.check_shard_model, shard_by_class_name),
]

WRONG = [
    (L.check_global_accuracy, accuracy_local_only, "called no collective, so each rank knew only its own samples"),
    (L.check_global_accuracy, accuracy_mean_of_means, r"on 2 ranks .* returned the mean of the ranks' accuracies, 0\.\d+; .*counts"),
    (L.check_global_accuracy, accuracy_reduce, r"the ranks returned different values .*dist\.reduce leaves the result on one rank"),
    (L.check_global_accuracy, accuracy_returns_tensor, r"rank 0 returned a tensor, expected a Python float: call \.item\(\)"),
    (L.check_global_accuracy, accuracy_in_place_on_labels, r"rank 0's labels changed: leave the inputs as they are"),
    (L.check_global_accuracy, accuracy_without_wait, r"rank 0 started a collective with async_op=True and never called \.wait\(\)"),
    (L.check_global_accuracy, accuracy_equal_shares, r"each rank divided the global number of correct predictions \(\d+\) by its own number of samples times the world size, which assumes equal shares"),
    (L.check_global_accuracy, accuracy_floor_of_floats, r"returned 0 on every rank where the accuracy is 0\.7 \(7 of 10\): its whole-number part, which is what integer division \(//\) gives"),
    (L.check_global_accuracy, accuracy_broadcast_from_rank0, r"returned rank 0's own accuracy, 0\.\d+, on every rank \(broadcast copies rank 0's value to every rank\)"),
    (L.check_global_accuracy, accuracy_integer_division, "rank 0 returned an int, expected a Python float"),
    (L.check_global_accuracy, accuracy_on_rank0_only, r"rank 0 waited in all_reduce .*ranks \[1\] called no collective.*a real job would hang"),
    (L.check_global_accuracy, accuracy_gather_labels, r"raised RuntimeError on rank \d: ProcessGroupGloo::allgather: invalid tensor size .*\(all_gather needs tensors of the same size"),
    (L.check_global_accuracy, accuracy_weighted_means, r"on 3 ranks with \[5, 0, 9\] samples: got nan; rank 1 has no samples"),
    (L.check_average_gradients, average_per_parameter, r"called 5 collectives on each rank \(all_reduce\): put every gradient into one flat tensor"),
    (L.check_average_gradients, average_without_copy_back, r"called all_reduce, but every \.grad is as it was: the averaged values must end up in each p\.grad"),
    (L.check_average_gradients, average_sum_only, r"left the SUM of the ranks' gradients, 2 times the mean"),
    (L.check_average_gradients, average_by_two, r"on 3 ranks divided the sum by 2"),
    (L.check_average_gradients, average_including_frozen, r"raised AttributeError on rank 0: 'NoneType' object has no attribute 'flatten' \(in .*, line \d+\) \(a frozen parameter has p\.grad None"),
    (L.check_average_gradients, average_to_rank0, r"only rank 0 got the mean gradients, .*; dist\.reduce leaves the result on one rank"),
    (L.check_average_gradients, average_the_parameters, r"passed the parameters to all_reduce, not their gradients, and every \.grad is as it was"),
    (L.check_average_gradients, average_without_wait, r"rank 0 started a collective with async_op=True and never called \.wait\(\)"),
    (L.check_average_gradients, average_zeros_for_frozen, r"gave the frozen parameter frozen\.weight a gradient"),
    (L.check_average_gradients, average_on_rank0_only, r"rank 0 waited in all_reduce .*a real job would hang"),
    (L.check_average_gradients, average_in_reverse, r"raised RuntimeError on rank 0: .*a slice of the flat tensor had another size|the averaged values are all there, but in the wrong parameters"),
    (L.check_average_gradients, average_avg_then_divide, r"left the mean divided by 2 once more: all_reduce with op=ReduceOp\.AVG already divides by the world size"),
    (L.check_average_gradients, average_floor_division, r"left the mean rounded down to whole numbers .*floor division \(//\) drops the fraction"),
    (L.check_average_gradients, average_submodules_only, r"scale\.grad is still each rank's own gradient while the others were averaged: never put into the collective \(model\.parameters\(\) yields every parameter, those registered on the model itself too"),
    (L.check_average_gradients, average_offsets_count_frozen, r"raised RuntimeError on rank \d: .*a slice of the flat tensor had another size than the gradient it goes back to"),
    (L.check_train_accumulated, accumulate_every_micro_batch_syncs, r"all-reduced after every micro-batch: .*no_sync"),
    (L.check_train_accumulated, accumulate_never_syncs, r"never all-reduced the gradients"),
    (L.check_train_accumulated, accumulate_forward_outside, r"all-reduced after every micro-batch: .*forward and backward"),
    (L.check_train_accumulated, accumulate_step_every_micro_batch, r"stepped the optimizer after every micro-batch"),
    (L.check_train_accumulated, accumulate_dropping_the_last_group, r"stepped 2 times: the last 1 micro-batch\(es\) form a shorter group"),
    (L.check_train_accumulated, accumulate_dividing_by_accumulate, r"the last, shorter group divided its loss by 3"),
    (L.check_train_accumulated, accumulate_summing_losses, r"stepped on the sum of the micro-batch losses"),
    (L.check_train_accumulated, accumulate_without_zero_grad, r"never zeroed the gradients"),
    (L.check_train_accumulated, accumulate_zero_after_step, r"zeroed the gradients only after each step, so the stale ones"),
    (L.check_train_accumulated, accumulate_zero_once, r"zeroed the gradients only once"),
    (L.check_train_accumulated, accumulate_zero_every_micro_batch, r"zeroed the gradients before every micro-batch, so each step used the last micro-batch of its group alone"),
    (L.check_train_accumulated, accumulate_last_through_module, r"never all-reduced the gradients: .*through ddp_model\(\.\.\.\)"),
    (L.check_shard_model, shard_optimizer_first, r"returned an optimizer made before fully_shard: it holds the old parameters"),
    (L.check_shard_model, shard_without_policy, r"the model computed in float32: give fully_shard a MixedPrecisionPolicy"),
    (L.check_shard_model, shard_root_without_policy, r"the blocks computed in bfloat16 but the head in float32 \(the forward then raised RuntimeError: mat1 and mat2 must have the same dtype.*\): give the root's fully_shard"),
    (L.check_shard_model, shard_blocks_without_policy, r"the blocks computed in float32 but the head in bfloat16 \(the forward then raised RuntimeError.*\): give each Block's fully_shard"),
    (L.check_shard_model, shard_blocks_only, r"the model itself is not sharded: call fully_shard on the root too"),
    (L.check_shard_model, shard_root_only, r"block 0 is not an FSDP unit of its own: call fully_shard on each Block, whole, before the root"),
    (L.check_shard_model, shard_inner_layers, r"made 0\.up a unit of its own: each Block is one unit"),
    (L.check_shard_model, shard_in_float16, r"computed in float16; the exercise asks for bfloat16"),
    (L.check_shard_model, shard_a_bfloat16_model, r"the sharded parameter 0\.norm\.weight is bfloat16: keep the parameters .* float32"),
    (L.check_shard_model, shard_without_return, r"returned None: return the optimizer"),
    (L.check_shard_model, shard_with_sgd, r"returned torch\.optim\.sgd\.SGD, expected torch\.optim\.AdamW"),
    (L.check_shard_model, shard_with_another_lr, r"the optimizer's lr is 0\.01, expected 1e-3"),
    (L.check_shard_model, shard_root_first, r"raised TypeError: .*\(fully_shard ran on a Block after the root was sharded.*shard bottom-up, each Block first, then the root\)"),
    (L.check_shard_model, shard_without_casting_inputs, r"raised RuntimeError: .*\(the policy of the root has cast_forward_inputs=False, so its float32 input met bfloat16 weights"),
    (L.check_global_accuracy, accuracy_max_op, r"returned \[0\.\d+, 0\.\d+\], expected 0\.7000: it all-reduced with ReduceOp\.MAX, which does not add the ranks' counts"),
    (L.check_global_accuracy, accuracy_bfloat16_counts, r"it passed a bfloat16 tensor to a collective, and bfloat16 keeps too few bits .*count in int64 or float64$"),
    (L.check_global_accuracy, accuracy_in_percent, r"returned 70, 100 times the accuracy 0\.7: return the fraction of correct predictions \(between 0 and 1\), not a percentage$"),
    (L.check_global_accuracy, accuracy_over_numel, r"returned 0\.0583333, the accuracy 0\.7 divided by the 12 classes: it counted logits\.numel\(\)"),
    (L.check_global_accuracy, accuracy_argmax_over_samples, r"with \[7, 3\] samples: expected 0\.7 on every rank, got \[0\.0, 0\.0\]$"),
    (L.check_average_gradients, average_max_op, r"the \.grad values are not the ranks' mean: it all-reduced with ReduceOp\.MAX; sum"),
    (L.check_average_gradients, average_broadcast_rank0, r"every rank ended with rank 0's own gradients: broadcast copies one rank's tensor, all_reduce combines every rank's$"),
    (L.check_average_gradients, average_in_float16, r"the \.grad values are the mean only to about 3 digits: it all-reduced a float16 tensor"),
    (L.check_average_gradients, average_first_gradient_only, r"first\.weight\.grad, first\.bias\.grad, last\.weight\.grad, last\.bias\.grad are still each rank's own gradient .*: put every parameter's gradient, from model\.parameters\(\), into the flat tensor$"),
    (L.check_train_accumulated, accumulate_consumes_the_list, r"changed the caller's list of micro-batches \(it holds 0 items now, 7 before\)"),
    (L.check_train_accumulated, accumulate_in_eval_mode, r"left the model in eval mode: it came in training mode"),
    (L.check_train_accumulated, accumulate_sum_reduction, r"used F\.cross_entropy\(\.\.\., reduction=\"sum\"\) \(divided by the group's size\)"),
    (L.check_train_accumulated, accumulate_over_all_micro_batches, r"divided each loss by the number of all micro-batches \(7\): divide by the number in its group"),
    (L.check_train_accumulated, accumulate_zero_before_step, r"called optimizer\.step\(\) 3 times, but no weight changed: the gradients were zero or None when it stepped"),
    (L.check_train_accumulated, accumulate_own_optimizer, r"never called optimizer\.step\(\), though the weights changed: step the optimizer it was given$"),
    (L.check_train_accumulated, accumulate_concatenated_groups, r"ran 3 forward passes, expected one per micro-batch \(7\): one forward per group is not accumulation"),
    (L.check_shard_model, shard_without_mesh, r"the root was sharded over another device mesh than the one passed in: give fully_shard mesh=mesh"),
    (L.check_shard_model, shard_output_dtype_only, r"the MixedPrecisionPolicy of the root sets output_dtype=bfloat16 but not param_dtype, the dtype the unit computes in"),
]


@pytest.mark.parametrize("check, answer", ALTERNATIVES, ids=[f"{c.exercise_name}-{a.__name__}" for c, a in ALTERNATIVES])
def test_correct_alternatives_pass(check, answer):
    assert_passes(check, answer)


@pytest.mark.parametrize("check, wrong, message", WRONG, ids=[f"{c.exercise_name}-{w.__name__}" for c, w, _ in WRONG])
def test_wrong_answers_name_the_fault(check, wrong, message):
    assert_names_fault(check, wrong, message)


def test_every_check_has_three_alternatives_and_eight_wrong_answers():
    for check, _ in PAIRS:
        assert sum(c is check for c, _ in ALTERNATIVES) >= 3, check.exercise_name
        assert sum(c is check for c, _, _ in WRONG) >= 8, check.exercise_name
    assert len(SCRIPT_ALTERNATIVES) >= 3 and len(SCRIPT_WRONG) >= 8


def test_checks_leave_torch_distributed_as_they_found_it():
    """The simulated ranks patch torch.distributed and the real-group checks make a process group: both are undone."""
    modules = (dist, dist.distributed_c10d)
    before = [{name: getattr(m, name, None) for name in SimulatedWorld.PATCHED} for m in modules]
    hook = sys.excepthook
    for check, wrong, _ in WRONG[:12] + WRONG[22:25] + WRONG[33:36]:
        with contextlib.suppress(ExerciseFailed):
            check(wrong)
    assert [{name: getattr(m, name, None) for name in SimulatedWorld.PATCHED} for m in modules] == before
    assert not dist.is_initialized()
    assert sys.excepthook is hook


def test_a_learner_name_bound_to_a_collective_is_simulated_too():
    """`from torch.distributed import all_reduce` in the notebook binds the real function; the check swaps it for the run."""
    namespace = {"all_reduce": dist.all_reduce, "torch": torch}
    exec("def answer(logits, labels):\n"
         "    t = torch.stack([(logits.argmax(1) == labels).sum(), torch.tensor(len(labels))]).double()\n"
         "    all_reduce(t)\n"
         "    return (t[0] / t[1]).item()\n", namespace)
    assert_passes(L.check_global_accuracy, namespace["answer"])
    assert namespace["all_reduce"] is dist.all_reduce


def test_a_rank_that_skips_a_collective_fails_within_seconds():
    start = time.perf_counter()
    with pytest.raises(ExerciseFailed, match="a real job would hang here"):
        L.check_average_gradients(average_on_rank0_only)
    assert time.perf_counter() - start < 6


# The training script: run on two real ranks and judged by what they did.

def _notebook_cell(tag: str) -> str:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    return next(c.source for c in nb.cells if tag in c.metadata.get("tags", []))


REFERENCE_SCRIPT = _notebook_cell("exercise:ddp_digits").split("\n", 1)[1]  # without its %%writefile line
COURSE_SCRIPT = Path(L.__file__).with_name("train_ddp.py")


def _script(*edits: tuple[str, str]) -> str:
    """The notebook's reference script with each (old, new) replacement made; each old text must be there."""
    text = REFERENCE_SCRIPT
    for old, new in edits:
        assert old in text, f"not in the reference script: {old!r}"
        text = text.replace(old, new)
    return text


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "ddp_digits.py"
    path.write_text(text)
    return path


SET_EPOCH = "        sampler.set_epoch(epoch)                   # a new order every epoch, the same on every rank\n"
SAVE = ("    if rank == 0:\n        torch.save(model.module.state_dict(), args.out)   # the plain model's weights: no \"module.\" prefix\n")
DESTROY = "    dist.destroy_process_group()\n"
LOADER = "    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)\n"
DDP_LINE = "    model = DDP(make_model())\n"
FORWARD = "            loss = F.cross_entropy(model(images), labels)\n"
PRINT = "        if rank == 0:\n            print(f\"epoch {epoch + 1}"
OPTIMIZER = "    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)\n"
ZERO = "            optimizer.zero_grad()\n"

SCRIPT_ALTERNATIVES = {
    "environment and try/finally": _script(
        (DESTROY + "    ### END SOLUTION", "    ### END SOLUTION"),
        ("    dist.init_process_group(\"gloo\")", "    import os\n    dist.init_process_group(backend=\"gloo\", init_method=\"env://\")"),
        ("    rank = dist.get_rank()\n", "    rank, world = int(os.environ[\"RANK\"]), int(os.environ[\"WORLD_SIZE\"])\n    try:\n        train(args, rank, world)\n    finally:\n        dist.destroy_process_group()\n\n\ndef train(args, rank, world):\n"),
        ("    sampler = DistributedSampler(dataset)", "    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=1)"),
        (SET_EPOCH, "        loader.sampler.set_epoch(epoch)\n"),
        (SAVE, "    if rank == 0:\n        torch.save({k.removeprefix(\"module.\"): v for k, v in model.state_dict().items()}, args.out)\n"),
    ),
    "loss over every rank, barrier": _script(
        (PRINT, "        totals = torch.tensor([total, float(seen)])\n        dist.all_reduce(totals)\n        if rank == 0:\n            print(f\"epoch {epoch + 1}: loss {totals[0] / totals[1]:.4f} over {int(totals[1])} samples\")\n        if False:\n            print(f\"epoch {epoch + 1}"),
        (ZERO, "            optimizer.zero_grad(set_to_none=True)\n"),
        (FORWARD, "            loss = torch.nn.CrossEntropyLoss()(model(images), labels)\n"),
        (DESTROY, "    dist.barrier()\n    dist.destroy_process_group()\n"),
    ),
    "record decorator and a step function": _script(
        ("from course_utils.ddp_models import make_model, training_digits\n",
         "from course_utils.ddp_models import make_model, training_digits\nfrom torch.distributed.elastic.multiprocessing.errors import record\n\n\n"
         "def step(model, optimizer, images, labels):\n    optimizer.zero_grad()\n    loss = F.cross_entropy(model(images), labels)\n"
         "    loss.backward()\n    optimizer.step()\n    return loss.item()\n"),
        ("def main() -> None:", "@record\ndef main() -> None:"),
        (ZERO + FORWARD + "            loss.backward()                        # DDP averages the gradients over the ranks here\n"
         "            optimizer.step()\n            total, seen = total + loss.item() * len(labels), seen + len(labels)\n",
         "            total, seen = total + step(model, optimizer, images, labels) * len(labels), seen + len(labels)\n"),
        (DDP_LINE, "    model = DDP(make_model(), find_unused_parameters=False)\n    model.train()\n"),
    ),
}

RANK_ONE_FAILS = "    rank = dist.get_rank()\n"
SCRIPT_WRONG = {
    "forgets set_epoch": (_script((SET_EPOCH, "")), r"rank 0 read its samples in the same order in every epoch: call sampler\.set_epoch\(epoch\)"),
    "saves on every rank": (_script((SAVE, "    torch.save(model.module.state_dict(), args.out)\n")), r"rank 1 called torch\.save too: only rank 0"),
    "no DistributedSampler": (_script(("    sampler = DistributedSampler(dataset)", "    sampler = None"), (SET_EPOCH, ""),
                                      (LOADER, "    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True)\n")),
                              r"rank 0 read all 1,438 training samples in every epoch: give the DataLoader a DistributedSampler"),
    "never destroys the group": (_script((DESTROY, "")), r"rank 0 never called dist\.destroy_process_group\(\)"),
    "rank 1 raises": (_script((RANK_ONE_FAILS, RANK_ONE_FAILS + "    if rank == 1:\n        raise ValueError(\"no data on this rank\")\n")),
                      r"^ddp_digits: rank 1 raised ValueError: no data on this rank \(ddp_digits\.py, line \d+, in main\)$"),
    "no DDP": (_script((DDP_LINE, "    model = make_model()\n"), (SAVE, SAVE.replace("model.module", "model"))),
               r"rank 0 never wrapped the model from make_model\(\) in DistributedDataParallel"),
    "forward through .module": (_script((FORWARD, FORWARD.replace("model(images)", "model.module(images)"))),
                                r"the ranks ended with different weights .*a forward through the DDP model itself"),
    "logs on every rank": (_script((PRINT, "        if True:\n            print(f\"epoch {epoch + 1}")),
                           r"rank 1 printed .epoch 2: .*only rank 0 logs"),
    "saves the DDP wrapper's state": (_script((SAVE, SAVE.replace("model.module.state_dict()", "model.state_dict()"))),
                                      r"the checkpoint's keys are like 'module\.1\.weight'.*model\.module\.state_dict\(\)"),
    "saves every epoch": (_script((PRINT, SAVE.replace("    ", "        ", 1).replace("\n    ", "\n        ") + PRINT)),
                          r"rank 0 called torch\.save 3 times: save once, after the last epoch"),
    "barrier on rank 0 only": (_script((SAVE, SAVE + "        dist.barrier()\n")),
                               r"rank 0 (raised .*rank 1 had already finished|was still running .* after rank 1 had finished)"),
    "momentum": (_script((OPTIMIZER, OPTIMIZER.replace("lr=args.lr", "lr=args.lr, momentum=0.9"))), r"the ranks trained with momentum 0\.9"),
    "no zero_grad": (_script((ZERO, "")), r"the ranks trained without zeroing the gradients"),
    "drops the last batch": (_script((LOADER, LOADER.replace("sampler=sampler", "sampler=sampler, drop_last=True"))),
                             r"rank 0 read 672 of its 719 samples per epoch: the last, shorter batch was dropped"),
    "no shuffling": (_script(("DistributedSampler(dataset)", "DistributedSampler(dataset, shuffle=False)")),
                     r"rank 0 read its samples in index order: leave DistributedSampler's shuffling on"),
    "fixed batch size": (_script((LOADER, LOADER.replace("batch_size=args.batch_size", "batch_size=32"))),
                         r"rank 0 trained on batches of 32 samples, expected --batch-size \(48 here\)"),
    "the same share on both ranks": (_script(("DistributedSampler(dataset)", "DistributedSampler(dataset, num_replicas=2, rank=0)")),
                                     r"in epoch 1, ranks 0 and 1 read 719 of the same samples"),
    "shuffle and a sampler": (_script((LOADER, LOADER.replace("sampler=sampler", "sampler=sampler, shuffle=True"))),
                              r"rank \d raised ValueError: sampler option is mutually exclusive with shuffle \(ddp_digits\.py, line \d+, in main\)"),
    "no process group": (_script(("    dist.init_process_group(\"gloo\")", "    pass"), (RANK_ONE_FAILS, "    rank = 0\n")),
                         r"rank \d raised ValueError: Default process group has not been initialized"),
    "leaves a process behind": (_script((DESTROY, DESTROY + "    if rank == 0:\n        import subprocess, sys\n"
                                                  "        subprocess.Popen([sys.executable, \"-c\", \"import time; time.sleep(60)\"])\n")),
                                r"the ranks exited but left 1 process\(es\) running, e\.g\. 'python[\d.]* -c import time; time\.sleep\(60\)'"),
    "renamed argument": (_script(("\"--batch-size\"", "\"--batch\"")), r"rank \d exited with code 2: .*unrecognized arguments: --batch-size 48"),
    "lr times the world size": (_script((OPTIMIZER, OPTIMIZER.replace("lr=args.lr", "lr=args.lr * dist.get_world_size()"))),
                                r"the ranks trained with lr 0\.1, --lr times the world size: use --lr as given"),
    "summed loss": (_script((FORWARD, FORWARD.replace("labels)", "labels, reduction=\"sum\")"))),
                    r"the ranks trained on the sum of the cross-entropy over each batch \(reduction='sum'\): use the mean"),
    "indexes the dataset itself": (_script(("    sampler = DistributedSampler(dataset)", "    first_image, first_label = dataset[0]\n    sampler = DistributedSampler(dataset)")),
                                   r"^ddp_digits: rank 0 read 1 training sample outside a DataLoader \(by indexing training_digits\(\) in its own code\)"),
    "one epoch short": (_script(("range(args.epochs)", "range(1, args.epochs)")),
                        r"rank 0 read its share of 719 samples 1 time, so it trained 1 epoch: run --epochs epochs \(2 here\)$"),
    "hard-coded lr": (_script((OPTIMIZER, OPTIMIZER.replace("lr=args.lr", "lr=0.5"))),
                      r"the ranks trained with lr 0\.5, not --lr \(0\.05 here\): pass args\.lr to the optimizer$"),
    "saves the module object": (_script((SAVE, SAVE.replace("model.module.state_dict()", "model.module"))),
                                r"rank 0 saved the model object itself \(torch\.save of a Sequential\): save model\.module\.state_dict\(\)"),
}


@pytest.fixture(scope="module")
def shared_server():
    """One rank server for the module's script checks: starting one costs the imports of torch, DDP and Dynamo."""
    with rank_server.RankServer() as server:
        yield server


@pytest.fixture()
def one_server(monkeypatch, shared_server):
    """check_ddp_digits with the shared server in place of a new one (same class, same contract). The reference
    script's test keeps the check's own server, started and stopped as in a learner's check."""

    monkeypatch.setattr(rank_server, "RankServer", lambda: contextlib.nullcontext(shared_server))


def test_the_reference_script_passes(tmp_path, capsys):
    L.check_ddp_digits(_write(tmp_path, REFERENCE_SCRIPT))
    assert capsys.readouterr().out.strip() == "PASS ddp_digits: all checks passed"


def test_the_course_script_passes(one_server):
    assert_passes(L.check_ddp_digits, COURSE_SCRIPT)


@pytest.mark.parametrize("name", list(SCRIPT_ALTERNATIVES))
def test_correct_scripts_written_differently_pass(name, tmp_path, one_server):
    assert_passes(L.check_ddp_digits, _write(tmp_path, SCRIPT_ALTERNATIVES[name]))


@pytest.mark.parametrize("name", list(SCRIPT_WRONG))
def test_wrong_scripts_name_their_fault(name, tmp_path, one_server):
    text, message = SCRIPT_WRONG[name]
    assert_names_fault(L.check_ddp_digits, _write(tmp_path, text), message)


def test_the_untouched_skeleton_is_not_attempted(tmp_path, one_server):
    """The learner copy's cell, as the build makes it: every rank dies on the stub line, which is 'not attempted'."""
    from course_utils.tooling.build import stub

    skeleton = stub(_notebook_cell("exercise:ddp_digits")).split("\n", 1)[1]
    with pytest.raises(ExerciseNotAttempted, match=r"^ddp_digits: not attempted yet: replace `raise NotImplementedError` in ddp_digits with your code$"):
        L.check_ddp_digits(_write(tmp_path, skeleton))
    half_done = skeleton.replace("    # YOUR CODE HERE\n", "    dist.init_process_group(\"gloo\")\n")
    with pytest.raises(ExerciseNotAttempted):  # it still reaches the stub
        L.check_ddp_digits(_write(tmp_path, half_done))
    moved = skeleton.replace("    raise NotImplementedError()", "    raise NotImplementedError(\"later\")")
    assert_names_fault(L.check_ddp_digits, _write(tmp_path, moved), r"rank \d raised NotImplementedError: later")


def test_the_untouched_skeleton_is_told_without_starting_a_rank(tmp_path, monkeypatch):
    import course_utils.rank_server as rank_server
    from course_utils.tooling.build import stub

    def no_server(*args, **kwargs):
        raise AssertionError("a rank server was started for the untouched skeleton")

    monkeypatch.setattr(rank_server, "RankServer", no_server)
    skeleton = stub(_notebook_cell("exercise:ddp_digits")).split("\n", 1)[1]
    with pytest.raises(ExerciseNotAttempted, match=r"^ddp_digits: not attempted yet"):
        L.check_ddp_digits(_write(tmp_path, skeleton))


@pytest.mark.parametrize("bad, message", [(None, "expected the path of your script, got None"),
                                          (3, "expected the path of your script .*got an int"),
                                          (nn.Linear(2, 2), "expected the path of your script .*got a torch.nn"),
                                          ("no_such_script.py", "no_such_script.py does not exist: run the %%writefile cell")])
def test_script_check_bad_input_is_one_named_line(bad, message):
    with pytest.raises(ExerciseFailed, match=message) as info:
        L.check_ddp_digits(bad)
    assert "\n" not in str(info.value)


def _living_descendants() -> list[int]:
    from course_utils.tooling.runner import descendants

    return [pid for pid in descendants() if (status := process_status(pid)) and status[1] != "Z"]


def test_a_hanging_script_is_stopped_and_leaves_no_process(tmp_path, monkeypatch, one_server):
    """Rank 1 waits forever in a barrier that rank 0 never reaches (rank 0 sleeps): the check stops both ranks."""
    monkeypatch.setenv("COURSE_EXERCISE_SECONDS", "12")  # the ranks get 7 s of it
    hang = _script((RANK_ONE_FAILS, RANK_ONE_FAILS + "    if rank == 0:\n        import time\n        time.sleep(3600)\n"
                    "    dist.barrier()\n"))
    before = set(_living_descendants())
    start = time.monotonic()
    assert_names_fault(L.check_ddp_digits, _write(tmp_path, hang), r"no rank finished within 7 s, so they were stopped")
    assert time.monotonic() - start < 12
    assert set(_living_descendants()) <= before


def test_the_script_check_leaves_the_random_state_and_files_alone(tmp_path, one_server):
    path = _write(tmp_path, REFERENCE_SCRIPT)
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    L.check_ddp_digits.verdict(path)
    assert torch.equal(torch.rand(3), expected)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ddp_digits.py"]
