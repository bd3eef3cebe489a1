"""Train a small MLP on the course's digits with DistributedDataParallel. Launch it with torchrun:

    torchrun --standalone --nproc-per-node=2 -m course_utils.train_ddp --epochs 3

torchrun starts one process per rank and gives each one RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT in its environment. The same file runs on two CPU processes,
on the 8 GPUs of one machine or on many machines: only the launcher's arguments change.
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from course_utils.ddp_models import held_out_digits, make_model, training_digits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank: the global batch is world_size times this")
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--out", default="ddp_digits.pt", help="where rank 0 saves the trained weights")
    args = parser.parse_args()

    # 1. Who am I? torchrun set these; the rendezvous reads MASTER_ADDR and MASTER_PORT.
    rank, local_rank, world_size = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():                    # one GPU per process: cuda:LOCAL_RANK, NCCL between GPUs
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:                                            # this lesson: CPU processes, gloo over TCP
        device = torch.device("cpu")
        torch.set_num_threads(1)
        backend = "gloo"
    dist.init_process_group(backend)
    is_main = rank == 0                              # rank 0 alone logs and saves

    # 2. Data: every rank reads the dataset; the sampler hands each rank its own share of the indices.
    train_set = training_digits()
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)   # no shuffle=True: the sampler shuffles

    # 3. Model: DDP broadcasts rank 0's initial weights, then all-reduces the gradients in every backward.
    model = DDP(make_model(seed=0).to(device), device_ids=[local_rank] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    loss_fn = nn.CrossEntropyLoss()

    shares = [None] * world_size
    dist.all_gather_object(shares, (rank, local_rank, len(sampler)))   # a collective: every rank calls it
    if is_main:
        print(f"{world_size} ranks, backend {backend}, device {device.type}; (rank, local rank, samples per epoch): {shares}")
        print(f"global batch {args.batch_size} x {world_size} = {args.batch_size * world_size}, {len(loader)} steps per epoch")

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)                     # a new shuffle each epoch, the same one on every rank
        model.train()
        totals = torch.zeros(2, device=device)       # sum of losses, number of samples (this rank)
        for inputs, targets in loader:
            inputs, targets = inputs.to(device), targets.to(device)
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(inputs), targets)
            loss.backward()                          # DDP all-reduces (averages) the gradients here
            optimizer.step()
            totals += torch.stack([loss.detach() * len(targets), torch.tensor(len(targets), device=device)])
        dist.all_reduce(totals)                      # sum over ranks: the loss over the whole epoch
        if is_main:
            model.eval()                             # evaluate the plain module: no DDP, no collectives
            with torch.no_grad():
                inputs, targets = held_out_digits()
                accuracy = (model.module(inputs.to(device)).argmax(1) == targets.to(device)).float().mean().item()
            print(f"epoch {epoch + 1}/{args.epochs}: train loss {totals[0] / totals[1]:.4f} over {int(totals[1])} samples, "
                  f"test accuracy {accuracy:.2%}")

    # 4. Rank 0 saves the plain module's weights; the others wait until the file exists.
    if is_main:
        torch.save(model.module.state_dict(), args.out)
        print(f"saved {os.path.basename(args.out)}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
