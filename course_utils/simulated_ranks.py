"""Simulated ranks: a world of N ranks as threads of this process, with torch.distributed's collectives replaced by
exact in-memory ones, for checks that must judge a learner's collective code in milliseconds.

Real ranks are processes that take seconds to start. SimulatedWorld(world_size).run(fn) calls fn(rank) on one thread
per rank with torch.distributed patched for the duration, and records every collective each rank called. It keeps the
real API's contract where an answer can tell the difference: collectives modify their tensors in place, asynchronous
ones only at wait(), wrong argument types raise TypeError as torch does, and tensors of different sizes on different
ranks raise as gloo does. A collective that not every rank joins raises Hang on the waiting rank instead of hanging.
Lesson 09's checks use it; tests/test_simulated_ranks.py holds it to real gloo's behaviour.
"""

import threading
from typing import Callable

import torch
import torch.distributed as dist


class Hang(BaseException):  # not an Exception: call() must not turn it into "your code raised"
    """A simulated rank waited in a collective that another rank never joined."""


class Work:
    """What an async collective returns. As with real gloo, the tensor holds the result only once wait() returned
    (here: not one moment before), so a forgotten wait() leaves the input as it was."""

    def __init__(self, world: "SimulatedWorld", apply: Callable[[], None], tensors: list):
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

    def get_future(self) -> "Future":
        return Future(self)

    def result(self) -> list:
        self.wait()
        return self._tensors


class Future:
    def __init__(self, work: Work):
        self._work = work

    def wait(self) -> list:
        return self._work.result()

    def value(self) -> list:
        return self._work.result()

    def done(self) -> bool:
        return self._work.wait()

    def then(self, callback: Callable) -> "Future":
        self._work.wait()
        value = callback(self)
        done = Work(self._work._world, lambda: None, value)
        done.wait()
        return Future(done)


REDUCE_OPS = {"SUM": lambda s: s.sum(0), "AVG": lambda s: s.mean(0) if s.is_floating_point() else s.sum(0) // len(s),
               "MAX": lambda s: s.max(0).values, "MIN": lambda s: s.min(0).values, "PRODUCT": lambda s: s.prod(0)}


class SimulatedWorld:
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
        self.reductions: list[list[str]] = [[] for _ in range(world_size)]  # the op of each all_reduce or reduce: "SUM", "AVG", ...
        self.sent: list[list] = [[] for _ in range(world_size)]  # what each rank passed to each collective (a copy)
        self.pending: list[list[Work]] = [[] for _ in range(world_size)]
        self.unwaited: set[int] = set()  # ranks that returned with an async collective never waited on
        self.hung: dict[int, str] = {}

    def rank(self) -> int:
        """The rank of the calling thread."""
        return self.local.rank

    def _sync(self, op: str) -> None:
        try:
            self._gate.wait()
        except threading.BrokenBarrierError:
            self.hung.setdefault(self.rank(), op)
            raise Hang(op) from None

    def _exchange(self, op: str, payload) -> list:
        rank = self.rank()
        self.events[rank].append(op)
        self.sent[rank].append(payload)
        self.slots[rank] = (op, payload)
        self._sync(op)
        seen = list(self.slots)
        self._sync(op)  # everyone has read the slots before anyone reuses them
        if len({s[0] for s in seen}) > 1:
            raise Hang(f"mismatched collectives {[s[0] for s in seen]}")
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
        if name not in REDUCE_OPS:
            raise ValueError(f"unsupported op {op} in this lesson's simulated ranks")
        return name

    def _same_sizes(self, op: str, values: list[torch.Tensor]) -> None:
        sizes = {v.numel() for v in values}
        if len(sizes) > 1:
            raise RuntimeError(f"{op}: received data size doesn't match expected size: the ranks passed tensors of "
                               f"{[v.numel() for v in values]} elements. Is there a distributed collective mismatch?")

    def _finish(self, apply: Callable[[], None], tensors: list, async_op: bool):
        if async_op:
            return Work(self, apply, tensors)
        apply()
        return None

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        """dist.all_reduce: every rank's tensor becomes the reduction of all of them."""
        tensor, name = self._tensor("all_reduce", tensor), self._op(op)
        self.reductions[self.rank()].append(name)
        values = self._exchange("all_reduce", tensor.detach().clone())
        self._same_sizes("all_reduce", values)
        result = REDUCE_OPS[name](torch.stack([v.reshape(tensor.shape) for v in values])).to(tensor.dtype)

        def apply():
            with torch.no_grad():
                tensor.copy_(result)
        return self._finish(apply, [tensor], async_op)

    def reduce(self, tensor, dst=None, op=dist.ReduceOp.SUM, group=None, async_op=False, group_dst=None):
        tensor, name = self._tensor("reduce", tensor), self._op(op)
        self.reductions[self.rank()].append(name)
        dst = group_dst if dst is None else dst
        values = self._exchange("reduce", tensor.detach().clone())
        self._same_sizes("reduce", values)
        result = REDUCE_OPS[name](torch.stack([v.reshape(tensor.shape) for v in values])).to(tensor.dtype)

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
                if not isinstance(err, Hang):
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
