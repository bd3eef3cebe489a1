"""The functions lesson 09's demos run on every rank, fn(rank, world_size, ...), and their one-process counterparts.

They live in a module because the spawn start method makes each rank import the function it runs: a function
defined in the notebook lives in the kernel's __main__, which a rank cannot import. They print; Workers prefixes
each line with [rank N]. The notebook shows their source with inspect.getsource.
"""

import contextlib
import re
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from course_utils.ddp_models import digits_batch, make_model


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


def divide_before_all_reduce(rank: int, world_size: int) -> dict:
    """Where DDP divides by the world size: a gradient of 3e38 on every rank, whose sum overflows float32 (max 3.4e38)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    layer = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        layer.weight.fill_(1.0)
    DDP(layer)(torch.tensor([[3e38]])).sum().backward()        # d(w * 3e38)/dw = 3e38 on every rank
    by_hand = torch.tensor([3e38])
    dist.all_reduce(by_hand)                                   # sum first: 6e38 is beyond float32's range
    by_hand /= world_size
    print(f"DDP's mean gradient: {layer.weight.grad.item():.3g}; all_reduce, then divide: {by_hand.item():.3g}")
    return {"ddp": layer.weight.grad.item(), "by_hand": by_hand.item()}


def fsdp1_and_fsdp2(rank: int, world_size: int) -> dict:
    """What FSDP1 (a wrapper with one flat parameter per unit) and FSDP2 (in place, a DTensor per parameter) make of a model."""
    import warnings

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard

    def describe(model):
        return [(name, type(p).__name__, tuple(p.shape)) for name, p in model.named_parameters()][:2]

    rows = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                        # FSDP1's notes about CPU tensors are not the point here
        for orig in (False, True):
            wrapped = FullyShardedDataParallel(make_model(), device_id=torch.device("cpu"), use_orig_params=orig)
            rows[f"FullyShardedDataParallel(model, use_orig_params={orig})"] = (type(wrapped).__name__, describe(wrapped))
    model = make_model()
    sharded = fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    rows["fully_shard(model)"] = (f"{type(sharded).__name__}, the same object: {sharded is model}", describe(sharded))
    if rank == 0:
        for call, (kind, params) in rows.items():
            print(f"{call}\n    returns {kind}; parameters {params}")
    return rows


def compile_and_wrap(rank: int, world_size: int) -> dict[str, str]:
    """The first state_dict key when torch.compile and a DDP or FSDP2 wrapping are combined in each order."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    inner = make_model()
    inner.compile(backend="eager")                             # in place: no wrapper (any backend: the keys are the same)
    fsdp = make_model()
    fully_shard(fsdp, mesh=init_device_mesh("cpu", (world_size,)))
    fsdp_compiled = make_model()
    fsdp_compiled.compile(backend="eager")
    fully_shard(fsdp_compiled, mesh=init_device_mesh("cpu", (world_size,)))
    keys = {
        "model.compile(); DDP(model)": DDP(inner),
        "DDP(torch.compile(model))": DDP(torch.compile(make_model(), backend="eager")),
        "torch.compile(DDP(model))": torch.compile(DDP(make_model()), backend="eager"),
        "fully_shard(model)": fsdp,
        "model.compile(); fully_shard(model)": fsdp_compiled,
        "torch.compile(fully_shard(model))": torch.compile(fsdp, backend="eager"),
    }
    first = {how: next(iter(model.state_dict())) for how, model in keys.items()}
    if rank == 0:
        for how, key in first.items():
            print(f"{how:38} first state_dict key: {key}")
    return first
