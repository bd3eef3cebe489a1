"""course_utils.simulated_ranks: threads that stand in for ranks keep real gloo's contract, and undo their patches."""

import torch
import torch.distributed as dist
from torch import nn

from course_utils.distributed import Workers
from course_utils.simulated_ranks import Hang, SimulatedWorld


# The simulated ranks keep gloo's contract: the same calls on two real gloo ranks and on two simulated ones.

def _sum_of_ranks(rank, world_size):
    t = torch.tensor([1.0 + rank, 2.0 * rank])
    dist.all_reduce(t)
    return t


def _average_of_ranks(rank, world_size):
    t = torch.tensor([1.0 + rank, 4.0])
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    return t


def _max_of_integers(rank, world_size):
    t = torch.tensor([3 - rank, 5 * rank])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t


def _async_then_wait(rank, world_size):
    t = torch.ones(3) * (rank + 1)
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    return t


def _future_value(rank, world_size):
    t = torch.ones(2) * (rank + 1)
    return dist.all_reduce(t, async_op=True).get_future().wait()[0]


def _transposed_and_zero_d(rank, world_size):
    x = torch.arange(6.0).reshape(2, 3).t() + rank
    s = torch.tensor(float(rank + 1))
    dist.all_reduce(x)
    dist.all_reduce(s)
    return torch.cat([x.flatten(), s.reshape(1)])


def _parameter_in_place(rank, world_size):
    p = nn.Parameter(torch.ones(2) * (rank + 1))
    dist.all_reduce(p)
    return p.detach()


def _broadcast_from_one(rank, world_size):
    t = torch.tensor([10.0 * rank])
    dist.broadcast(t, src=1)
    return t


def _gather_tensors(rank, world_size):
    out = [torch.zeros(2) for _ in range(world_size)]
    dist.all_gather(out, torch.tensor([rank, rank + 0.5]))
    return torch.stack(out)


def _gather_objects(rank, world_size):
    out = [None] * world_size
    dist.all_gather_object(out, {"rank": rank})
    return out


def _reduce_to_zero(rank, world_size):
    t = torch.tensor([2.0 + rank])
    dist.reduce(t, dst=0)
    return t if rank == 0 else None


def _wrong_argument_types(rank, world_size):
    errors = []
    for call in (lambda: dist.all_reduce([torch.ones(1)]), lambda: dist.all_reduce(torch.ones(1), op="sum")):
        try:
            call()
            errors.append(None)
        except Exception as err:  # noqa: BLE001 -- the type of error is what is compared
            errors.append(type(err).__name__)
    return errors


SCENARIOS = [_sum_of_ranks, _average_of_ranks, _max_of_integers, _async_then_wait, _future_value, _transposed_and_zero_d,
             _parameter_in_place, _broadcast_from_one, _gather_tensors, _gather_objects, _reduce_to_zero, _wrong_argument_types]


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_simulated_collectives_behave_as_real_gloo():
    with Workers(2) as workers:
        real = {s.__name__: workers.run(s, show=False) for s in SCENARIOS}
    for scenario in SCENARIOS:
        outcome = SimulatedWorld(2).run(lambda rank: scenario(rank, 2))
        simulated = [value for value, _ in outcome]
        assert all(err is None for _, err in outcome), (scenario.__name__, outcome)
        assert all(_same(a, b) for a, b in zip(real[scenario.__name__], simulated)), (scenario.__name__, real[scenario.__name__], simulated)


def test_an_async_collective_completes_only_at_wait():
    def body(rank):
        t = torch.ones(2) * (rank + 1)
        work = dist.all_reduce(t, async_op=True)
        before = t.clone()
        work.wait()
        return before, t

    outcome = SimulatedWorld(2).run(body)
    for (before, after), err in outcome:
        assert err is None
        assert torch.equal(before, torch.ones(2) * before[0]) and torch.equal(after, torch.full((2,), 3.0))


def test_it_records_each_reduction_op_and_undoes_its_patches():
    def body(rank):
        t = torch.ones(1)
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        dist.all_reduce(t)
        return t

    real = {name: getattr(dist, name) for name in SimulatedWorld.PATCHED}
    world = SimulatedWorld(2)
    world.run(body)
    assert world.reductions == [["AVG", "SUM"], ["AVG", "SUM"]]
    assert world.events == [["all_reduce", "all_reduce"]] * 2
    assert {name: getattr(dist, name) for name in SimulatedWorld.PATCHED} == real


def test_a_collective_that_one_rank_skips_raises_hang_instead_of_hanging():
    def body(rank):
        if rank == 0:
            dist.all_reduce(torch.ones(1))

    world = SimulatedWorld(2, timeout=0.5)
    outcome = world.run(body)
    assert isinstance(outcome[0][1], Hang) and outcome[1] == (None, None)
    assert world.hung == {0: "all_reduce"}
