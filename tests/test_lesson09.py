"""Lesson 09's checks against the reference solutions and the wrong answers learners write; the DDP proof; no leaked process."""

import contextlib
import ctypes
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from course_utils import lesson09 as L
from course_utils.tooling.checks import ExerciseFailed
from course_utils.distributed import process_status
from lesson_contract import assert_names_fault, contract_tests

PAIRS = [
    (L.check_rank_indices, L.rank_indices),
    (L.check_shuffled_rank_indices, L.shuffled_rank_indices),
    (L.check_average_gradients, L.average_gradients),
    (L.check_accumulate_with_no_sync, L.accumulate_with_no_sync),
    (L.check_save_on_rank0, L.save_on_rank0),
]

(test_reference_passes, test_stub_is_not_attempted, test_bad_input_is_one_named_line, test_hostile_answers_are_the_learners_fault,
 test_checks_leave_the_learners_random_state_alone, test_checks_are_quick) = contract_tests(PAIRS, max_seconds=2.0)


# Typical wrong answers, one function each.

def indices_contiguous(n, world_size, rank):
    per_rank = -(-n // world_size)
    padded = [i % n for i in range(per_rank * world_size)]
    return padded[rank * per_rank:(rank + 1) * per_rank]


def indices_unpadded(n, world_size, rank):
    return list(range(rank, n, world_size))


def indices_drop_last(n, world_size, rank):
    return list(range(rank, (n // world_size) * world_size, world_size))


def indices_pad_once(n, world_size, rank):  # pads with indices[:padding], which is too short when world_size > 2n
    per_rank = -(-n // world_size)
    indices = list(range(n))
    indices += indices[:per_rank * world_size - n]
    return indices[rank::world_size]


def indices_tensor(n, world_size, rank):
    return torch.tensor(L.rank_indices(n, world_size, rank))


def indices_of_tensor_ints(n, world_size, rank):
    return list(torch.tensor(L.rank_indices(n, world_size, rank)))


def indices_with_sampler(n, world_size, rank):  # a correct alternative
    from torch.utils.data.distributed import DistributedSampler
    return list(DistributedSampler(range(n), num_replicas=world_size, rank=rank, shuffle=False))


def shuffled_ignoring_epoch(n, world_size, rank, epoch, seed=0):
    return L.shuffled_rank_indices(n, world_size, rank, 0, seed)


def shuffled_seeded_by_rank(n, world_size, rank, epoch, seed=0):
    return L.shuffled_rank_indices(n, world_size, rank, epoch, seed + rank)


def shuffled_global_rng(n, world_size, rank, epoch, seed=0):
    order = torch.randperm(n).tolist()
    per_rank = -(-n // world_size)
    return [order[i % n] for i in range(per_rank * world_size)][rank::world_size]


def shuffled_after_sharding(n, world_size, rank, epoch, seed=0):
    mine = L.rank_indices(n, world_size, rank)
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return [mine[i] for i in torch.randperm(len(mine), generator=g).tolist()]


def shuffled_seed_times_epoch(n, world_size, rank, epoch, seed=0):
    return L.shuffled_rank_indices(n, world_size, rank, 0, seed * epoch)


def shuffled_with_sampler(n, world_size, rank, epoch, seed=0):  # a correct alternative
    from torch.utils.data.distributed import DistributedSampler
    sampler = DistributedSampler(range(n), num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
    sampler.set_epoch(epoch)
    return list(sampler)


def average_without_divide(model):
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)


def average_parameters(model):
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.data)
            p.data /= dist.get_world_size()


def average_with_reduce(model):
    for p in model.parameters():
        if p.grad is not None:
            dist.reduce(p.grad, dst=0)
            p.grad /= dist.get_world_size()


def average_by_two(model):
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= 2


def average_on_rank0_only(model):
    if dist.get_rank() == 0:
        L.average_gradients(model)


def average_divide_only(model):
    for p in model.parameters():
        if p.grad is not None:
            p.grad /= dist.get_world_size()


def average_broadcast(model):
    for p in model.parameters():
        if p.grad is not None:
            dist.broadcast(p.grad, src=0)


def average_including_frozen(model):
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


def average_with_avg_op(model):  # a correct alternative: gloo and nccl support ReduceOp.AVG
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)


def average_flattened(model):  # a correct alternative: one all-reduce of all gradients
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def average_async(model):  # a correct alternative: launch every all-reduce, then wait
    works = [(p, dist.all_reduce(p.grad, async_op=True)) for p in model.parameters() if p.grad is not None]
    for p, work in works:
        work.wait()
        p.grad /= dist.get_world_size()


def accumulate_without_no_sync(ddp_model, micro_batches, loss_fn):
    ddp_model.zero_grad()
    for inputs, targets in micro_batches:
        (loss_fn(ddp_model(inputs), targets) / len(micro_batches)).backward()


def accumulate_all_in_no_sync(ddp_model, micro_batches, loss_fn):
    ddp_model.zero_grad()
    with ddp_model.no_sync():
        for inputs, targets in micro_batches:
            (loss_fn(ddp_model(inputs), targets) / len(micro_batches)).backward()


def accumulate_forward_outside_no_sync(ddp_model, micro_batches, loss_fn):
    ddp_model.zero_grad()
    for i, (inputs, targets) in enumerate(micro_batches):
        loss = loss_fn(ddp_model(inputs), targets) / len(micro_batches)
        if i < len(micro_batches) - 1:
            with ddp_model.no_sync():
                loss.backward()
        else:
            loss.backward()


def accumulate_without_scaling(ddp_model, micro_batches, loss_fn):
    ddp_model.zero_grad()
    *first, last = micro_batches
    with ddp_model.no_sync():
        for inputs, targets in first:
            loss_fn(ddp_model(inputs), targets).backward()
    loss_fn(ddp_model(last[0]), last[1]).backward()


def accumulate_without_zero_grad(ddp_model, micro_batches, loss_fn):
    *first, last = micro_batches
    with ddp_model.no_sync():
        for inputs, targets in first:
            (loss_fn(ddp_model(inputs), targets) / len(micro_batches)).backward()
    (loss_fn(ddp_model(last[0]), last[1]) / len(micro_batches)).backward()


def accumulate_last_through_module(ddp_model, micro_batches, loss_fn):
    ddp_model.zero_grad()
    *first, last = micro_batches
    with ddp_model.no_sync():
        for inputs, targets in first:
            (loss_fn(ddp_model(inputs), targets) / len(micro_batches)).backward()
    (loss_fn(ddp_model.module(last[0]), last[1]) / len(micro_batches)).backward()


def accumulate_one_sync_in_the_middle(ddp_model, micro_batches, loss_fn):
    ddp_model.zero_grad()
    for i, (inputs, targets) in enumerate(micro_batches):
        context = ddp_model.no_sync() if i != 1 else torch.enable_grad()
        with context:
            (loss_fn(ddp_model(inputs), targets) / len(micro_batches)).backward()
    # the second micro-batch synced, the last did not: one all-reduce, of a partial sum


def accumulate_with_set_to_none(ddp_model, micro_batches, loss_fn):  # a correct alternative
    ddp_model.zero_grad(set_to_none=True)
    n = len(micro_batches)
    for i, (inputs, targets) in enumerate(micro_batches):
        if i < n - 1:
            with ddp_model.no_sync():
                (loss_fn(ddp_model(inputs), targets) / n).backward()
        else:
            (loss_fn(ddp_model(inputs), targets) / n).backward()


def save_on_every_rank(ddp_model, path):
    torch.save(ddp_model.module.state_dict(), path)
    dist.barrier()


def save_wrapper_state(ddp_model, path):
    if dist.get_rank() == 0:
        torch.save(ddp_model.state_dict(), path)
    dist.barrier()


def save_without_barrier(ddp_model, path):
    if dist.get_rank() == 0:
        torch.save(ddp_model.module.state_dict(), path)


def save_barrier_inside_if(ddp_model, path):
    if dist.get_rank() == 0:
        torch.save(ddp_model.module.state_dict(), path)
        dist.barrier()


def save_barrier_first(ddp_model, path):
    dist.barrier()
    if dist.get_rank() == 0:
        torch.save(ddp_model.module.state_dict(), path)


def save_whole_module(ddp_model, path):
    if dist.get_rank() == 0:
        torch.save(ddp_model.module, path)
    dist.barrier()


def save_nothing(ddp_model, path):
    dist.barrier()


def save_on_last_rank(ddp_model, path):  # rank 1 saves, rank 0 does not
    if dist.get_rank() == dist.get_world_size() - 1:
        torch.save(ddp_model.module.state_dict(), path)
    dist.barrier()


def save_stripping_prefix(ddp_model, path):  # a correct alternative
    if dist.get_rank() == 0:
        torch.save({k.removeprefix("module."): v for k, v in ddp_model.state_dict().items()}, path)
    dist.barrier()


WRONG = [
    (L.check_rank_indices, indices_contiguous, "contiguous block.*like cards"),
    (L.check_rank_indices, indices_unpadded, r"rank_indices\(10, 3, 1\) returned \[1, 4, 7\], 3 indices, but every rank must get 4: pad the list"),
    (L.check_rank_indices, indices_drop_last, "drops the last n % world_size.*drop_last=True"),
    (L.check_rank_indices, indices_pad_once, r"rank_indices\(2, 5, 4\) returned \[\], 0 indices, but every rank must get 1.*wrapping around"),
    (L.check_rank_indices, indices_tensor, "returned a tensor.*tolist"),
    (L.check_rank_indices, indices_of_tensor_ints, "returned a list holding torch.Tensor.*plain ints"),
    (L.check_rank_indices, lambda n, w, r: None, "returned None"),
    (L.check_rank_indices, indices_with_sampler, None),
    (L.check_shuffled_rank_indices, shuffled_ignoring_epoch, "epoch=3.*same order as epoch 0.*seed \\+ epoch"),
    (L.check_shuffled_rank_indices, shuffled_seeded_by_rank, "never covers the indices.*same seed"),
    (L.check_shuffled_rank_indices, shuffled_global_rng, "different list when called again.*torch.Generator"),
    (L.check_shuffled_rank_indices, shuffled_after_sharding, "expected .*shuffle all n indices"),
    (L.check_shuffled_rank_indices, shuffled_seed_times_epoch, "seed \\+ epoch"),
    (L.check_shuffled_rank_indices, lambda n, w, r, e, s=0: L.rank_indices(n, w, r), "expected .*shuffle all n indices"),
    (L.check_shuffled_rank_indices, shuffled_with_sampler, None),
    (L.check_average_gradients, average_without_divide, "SUM of the ranks' gradients, 2 times the mean.*get_world_size"),
    (L.check_average_gradients, average_parameters, "called all_reduce but left every gradient as it was.*p.grad"),
    (L.check_average_gradients, average_with_reduce, "only rank 0 got.*dist.reduce.*all_reduce"),
    (L.check_average_gradients, average_by_two, "on 3 ranks divided the sum by 2.*not a fixed number"),
    (L.check_average_gradients, average_on_rank0_only, "rank 0 waited in all_reduce.*ranks \\[1\\] called no collective.*same order"),
    (L.check_average_gradients, average_divide_only, "called no collective: the gradients were divided.*never summed"),
    (L.check_average_gradients, average_broadcast, "rank 0's gradients: broadcast copies"),
    (L.check_average_gradients, average_including_frozen, "raised TypeError.*p.grad None: skip those"),
    (L.check_average_gradients, lambda model: None, "called no collective"),
    (L.check_average_gradients, average_with_avg_op, None),
    (L.check_average_gradients, average_flattened, None),
    (L.check_average_gradients, average_async, None),
    (L.check_accumulate_with_no_sync, accumulate_without_no_sync, "after every micro-batch \\(3 all-reduces\\).*no_sync"),
    (L.check_accumulate_with_no_sync, accumulate_all_in_no_sync, "never all-reduced.*LAST micro-batch"),
    (L.check_accumulate_with_no_sync, accumulate_forward_outside_no_sync, "after every micro-batch.*forward and backward.*forward time"),
    (L.check_accumulate_with_no_sync, accumulate_without_scaling, "3 times the gradient of the mean loss.*len\\(micro_batches\\)"),
    (L.check_accumulate_with_no_sync, accumulate_without_zero_grad, "stale gradients.*zero_grad"),
    (L.check_accumulate_with_no_sync, accumulate_last_through_module, "never all-reduced.*not ddp_model.module"),
    (L.check_accumulate_with_no_sync, accumulate_one_sync_in_the_middle, "after micro-batch 2 of 3.*only the last"),
    (L.check_accumulate_with_no_sync, lambda m, b, f: None, "some .grad is None|never all-reduced"),
    (L.check_accumulate_with_no_sync, accumulate_with_set_to_none, None),
    (L.check_save_on_rank0, save_on_every_rank, "rank 1 saved too.*get_rank\\(\\) == 0"),
    (L.check_save_on_rank0, save_wrapper_state, "keys like 'module.*ddp_model.module.state_dict\\(\\)"),
    (L.check_save_on_rank0, save_without_barrier, "rank 0 never called dist.barrier\\(\\)"),
    (L.check_save_on_rank0, save_barrier_inside_if, "rank 0 waited in barrier.*after the `if`"),
    (L.check_save_on_rank0, save_barrier_first, "saved after the barrier.*save first"),
    (L.check_save_on_rank0, save_whole_module, "whole module object.*state_dict\\(\\)"),
    (L.check_save_on_rank0, save_nothing, "no rank called torch.save"),
    (L.check_save_on_rank0, save_on_last_rank, "rank 1 saved too"),
    (L.check_save_on_rank0, save_stripping_prefix, None),
]


@pytest.mark.parametrize("check, wrong, message", WRONG, ids=[f"{c.exercise_name}-{getattr(w, '__name__', 'lambda')}-{i}" for i, (c, w, m) in enumerate(WRONG)])
def test_wrong_answers_name_the_fault(check, wrong, message):
    assert_names_fault(check, wrong, message)


def test_checks_leave_torch_distributed_as_they_found_it():
    """The simulated ranks patch torch.distributed and the no_sync check makes a process group: both are undone."""
    before = {name: getattr(dist, name) for name in L._SimulatedWorld.PATCHED}
    hook = sys.excepthook
    for check, wrong, _ in WRONG:
        try:
            check(wrong)
        except ExerciseFailed:
            pass
    assert {name: getattr(dist, name) for name in L._SimulatedWorld.PATCHED} == before
    assert not dist.is_initialized()
    assert sys.excepthook is hook


def test_a_rank_that_skips_a_collective_fails_within_seconds():
    start = time.perf_counter()
    with pytest.raises(ExerciseFailed, match="a real job would hang here"):
        L.check_average_gradients(average_on_rank0_only)
    assert time.perf_counter() - start < 5


def test_ddp_equals_one_process_on_the_whole_batch():
    """One DDP step on 2 gloo ranks with batch B gives the gradients and weights of one process with batch 2B."""
    diff = L.ddp_matches_single_process()
    assert diff["grads"] < 1e-6 and diff["weights"] < 1e-6, diff


def test_no_sync_sends_one_all_reduce_and_the_same_gradients():
    from course_utils.distributed import Workers

    images, labels = L.digits_batch(32)
    with Workers(2) as workers:
        synced = workers.run(L.count_syncs, images, labels, 4, False, show=False)
        accumulated = workers.run(L.count_syncs, images, labels, 4, True, show=False)
        fsdp = workers.run(L.fsdp_step, images, labels, show=False)
    assert [r["all_reduces"] for r in synced] == [4, 4]
    assert [r["all_reduces"] for r in accumulated] == [1, 1]
    for a, b in zip(synced[0]["grads"], accumulated[0]["grads"]):
        torch.testing.assert_close(a, b)
    single = L.single_process_step(images, labels, 0.1)
    for a, b in zip(fsdp[0]["grads"], single["grads"]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    assert fsdp[1]["state"] == {} and set(fsdp[0]["state"]) == set(L.make_model().state_dict())


NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "solutions" / "09_ddp.ipynb"


PR_SET_CHILD_SUBREAPER = 36  # from <linux/prctl.h>


def _living_children() -> dict[int, str]:
    """This process's children that are still running (not zombies), with their command lines."""
    found = {}
    for entry in Path("/proc").iterdir():
        status = process_status(int(entry.name)) if entry.name.isdigit() else None
        if status and status[0] == os.getpid() and status[1] != "Z":
            try:
                found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:120]
            except OSError:
                continue
    return found


def _reap() -> None:
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


@contextlib.contextmanager
def _subreaper():
    """While inside, orphaned descendants are re-parented to this process instead of init, whatever session they
    started for themselves (torchrun starts each rank in a session of its own), so a leftover one is our child."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        pytest.skip("prctl(PR_SET_CHILD_SUBREAPER) is not available here")
    try:
        yield
    finally:
        libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
        _reap()


def _survivors(before: dict[int, str]) -> dict[int, str]:
    """Children that were not there before, after giving them a few seconds to exit."""
    deadline = time.monotonic() + 5
    while True:
        _reap()
        left = {pid: command for pid, command in _living_children().items() if pid not in before}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def _kill(pids) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 9)
    time.sleep(0.2)
    _reap()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux's /proc and PR_SET_CHILD_SUBREAPER")
def test_no_process_survives_the_notebook(tmp_path):
    """Run the solution notebook under nbval; when it exits, none of the processes it started may remain."""
    with _subreaper():
        before = _living_children()
        proc = subprocess.Popen(
            [sys.executable, "-m", "pytest", "--nbval", "--nbval-current-env", "-p", "no:cacheprovider", "-q", str(NOTEBOOK)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
        )
        try:
            out, _ = proc.communicate(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        left = _survivors(before)
        _kill(left)
    assert proc.returncode == 0, out[-3000:]
    assert not left, f"processes outlived the notebook: {left}"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux's /proc and PR_SET_CHILD_SUBREAPER")
def test_the_scan_sees_a_leftover_process_in_a_session_of_its_own():
    """The scan above would notice a leak: a `sleep` that outlives its shell, in a new session as a torchrun rank is."""
    with _subreaper():
        before = _living_children()
        shell = subprocess.run(["sh", "-c", "setsid sleep 30 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True, timeout=10)
        leftover = int(shell.stdout)
        try:
            left = {pid: c for pid, c in _living_children().items() if pid not in before}
            assert leftover in left and "sleep" in left[leftover]
            assert os.getsid(leftover) != os.getsid(0)
        finally:
            _kill([leftover])
