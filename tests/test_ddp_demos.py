"""course_utils.ddp_demos: the functions lesson 09's demos run on two gloo ranks, against one process."""

import torch

from course_utils import ddp_demos as D
from course_utils.ddp_models import digits_batch, make_model
from course_utils.distributed import Workers


def test_the_demos_on_two_ranks():
    images, labels = digits_batch(32)
    features = torch.cat([torch.randn(4, 3) + 2.0, torch.randn(4, 3) - 2.0])
    with Workers(2) as workers:  # started once: every demo runs on the same two ranks
        step = D.ddp_matches_single_process(workers)
        divided = workers.run(D.divide_before_all_reduce, show=False)
        representations = workers.run(D.fsdp1_and_fsdp2, show=False)
        prefixes = workers.run(D.compile_and_wrap, show=False)
        synced = workers.run(D.count_syncs, images, labels, 4, False, show=False)
        accumulated = workers.run(D.count_syncs, images, labels, 4, True, show=False)
        fsdp = workers.run(D.fsdp_step, images, labels, 0.01, show=False)
        stats = workers.run(D.sync_batchnorm, features, show=False)
        precision = workers.run(D.fsdp_precision, images, labels, show=False)
        unused = workers.run(D.unused_parameters, images, labels, False, show=False)
        fixed = workers.run(D.unused_parameters, images, labels, True, show=False)
    # One DDP step on 2 ranks with batch B gives the gradients and weights of one process with batch 2B.
    assert step["grads"] < 1e-6 and step["weights"] < 1e-6, step
    # DDP divides by the world size as it copies into the bucket, before the all-reduce: the sum of 3e38 and 3e38 never
    # exists, while the all-reduce of the undivided values overflows.
    assert all(d["ddp"] == torch.tensor(3e38).item() and d["by_hand"] == float("inf") for d in divided)
    rows = representations[0]
    flat = rows["FullyShardedDataParallel(model, use_orig_params=False)"]
    assert flat[0] == "FullyShardedDataParallel" and flat[1][0][0] == "_fsdp_wrapped_module._flat_param"
    assert flat[1][0][2] == (sum(p.numel() for p in make_model().parameters()) // 2,)
    orig = rows["FullyShardedDataParallel(model, use_orig_params=True)"][1]
    assert orig[0][0] == "_fsdp_wrapped_module.1.weight" and len(orig[0][2]) == 1   # a 1-D view into the flat shard
    fsdp2 = rows["fully_shard(model)"]
    assert fsdp2[0].endswith("the same object: True") and fsdp2[1][0] == ("1.weight", "DTensor", (64, 64))
    assert prefixes[0] == {"model.compile(); DDP(model)": "module.1.weight", "DDP(torch.compile(model))": "module._orig_mod.1.weight",
                           "torch.compile(DDP(model))": "_orig_mod.module.1.weight", "fully_shard(model)": "1.weight",
                           "model.compile(); fully_shard(model)": "1.weight", "torch.compile(fully_shard(model))": "_orig_mod.1.weight"}
    assert [r["all_reduces"] for r in synced] == [4, 4]
    assert [r["all_reduces"] for r in accumulated] == [1, 1]
    for a, b in zip(synced[0]["grads"], accumulated[0]["grads"]):
        torch.testing.assert_close(a, b)
    single = D.single_process_step(images, labels, 0.1)
    for a, b in zip(fsdp[0]["grads"], single["grads"]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    assert fsdp[1]["state"] == {} and set(fsdp[0]["state"]) == set(make_model().state_dict())
    adamw = D.single_process_adamw_step(images, labels, 0.01)
    for name, value in adamw.items():
        torch.testing.assert_close(fsdp[0]["state"][name], value, atol=1e-6, rtol=0)
    for s in stats:
        torch.testing.assert_close(s["mean"], features.mean(0))
        torch.testing.assert_close(s["var"], features.var(0, unbiased=False))
    rows = precision[0]
    assert rows["default"]["compute"] == rows["default"]["reduce_scatter"] == torch.float32
    assert rows["param bf16, reduce fp32"]["compute"] == rows["param bf16, reduce fp32"]["all_gather"] == torch.bfloat16
    assert rows["param bf16, reduce fp32"]["reduce_scatter"] == torch.float32
    assert rows["param bf16"]["reduce_scatter"] == torch.bfloat16
    assert all(r["param"] == r["grad"] == torch.float32 for r in rows.values())
    assert all(u.startswith("Expected to have finished reduction in the prior iteration") for u in unused)
    assert fixed == ["", ""]
