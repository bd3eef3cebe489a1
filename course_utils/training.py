"""The training loop the lessons share from lesson 05 on: train, evaluate, fit, checkpoints.

Lesson 05 builds this loop step by step; later lessons call it so that they can
spend their time on mixed precision, compilation, hooks, DDP or export instead.
"""

import random
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd
import torch
from torch import nn
from torch.utils.data import DataLoader


def train_one_epoch(
    model: nn.Module,
    loader: DataLoader,
    loss_fn: Callable,
    optimizer: torch.optim.Optimizer,
    *,
    device: torch.device | str = "cpu",
    batch_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    clip_grad_norm: float | None = None,
) -> float:
    """One pass over `loader` in train mode; return the mean training loss."""
    model.train()
    total = torch.zeros((), device=device)
    count = 0
    for inputs, targets in loader:
        inputs, targets = inputs.to(device), targets.to(device)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        if clip_grad_norm is not None:
            nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)
        optimizer.step()
        if batch_scheduler is not None:  # OneCycleLR and warm-ups step every batch
            batch_scheduler.step()
        # Accumulate on the device: a .item() here would wait for the GPU every step.
        total += loss.detach() * len(targets)
        count += len(targets)
    return (total / count).item()


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader: DataLoader,
    loss_fn: Callable,
    *,
    device: torch.device | str = "cpu",
) -> dict[str, float]:
    """Mean loss (and accuracy, for class-index targets) over `loader`, in eval mode."""
    model.eval()
    total = torch.zeros((), device=device)
    correct = torch.zeros((), device=device, dtype=torch.long)
    count = 0
    classification = True
    for inputs, targets in loader:
        inputs, targets = inputs.to(device), targets.to(device)
        outputs = model(inputs)
        total += loss_fn(outputs, targets) * len(targets)
        count += len(targets)
        classification = classification and outputs.ndim == 2 and not targets.is_floating_point()
        if classification:
            correct += (outputs.argmax(dim=1) == targets).sum()
    metrics = {"loss": (total / count).item()}
    if classification:
        metrics["accuracy"] = correct.item() / count
    return metrics


def fit(
    model: nn.Module,
    train_loader: DataLoader,
    val_loader: DataLoader,
    loss_fn: Callable,
    optimizer: torch.optim.Optimizer,
    *,
    epochs: int,
    device: torch.device | str = "cpu",
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    scheduler_per_batch: bool = False,
    clip_grad_norm: float | None = None,
    patience: int | None = None,
    best_path: str | Path | None = None,
    log: Callable[[str], None] | None = print,
) -> pd.DataFrame:
    """Train for up to `epochs`, validating after each; return one row of metrics per epoch.

    With `patience`, stop once validation loss has not improved for that many epochs.
    With `best_path`, save a full checkpoint whenever validation loss improves: weights, optimizer,
    scheduler, epoch and every random number generator's state, train_loader's own generator included.
    """
    rows = []
    best_loss, since_best = float("inf"), 0
    for epoch in range(1, epochs + 1):
        train_loss = train_one_epoch(
            model, train_loader, loss_fn, optimizer, device=device,
            batch_scheduler=scheduler if scheduler_per_batch else None, clip_grad_norm=clip_grad_norm,
        )
        lr = optimizer.param_groups[0]["lr"]
        if scheduler is not None and not scheduler_per_batch:
            scheduler.step()
        val = evaluate(model, val_loader, loss_fn, device=device)
        rows.append({"epoch": epoch, "train_loss": train_loss, **{f"val_{k}": v for k, v in val.items()}, "lr": lr})
        improved = val["loss"] < best_loss
        if improved:
            best_loss, since_best = val["loss"], 0
            if best_path is not None:
                # The loader's generator decides the next epochs' order: without it a resumed run shuffles differently.
                save_checkpoint(best_path, model=model, optimizer=optimizer, scheduler=scheduler, epoch=epoch,
                                generator=getattr(train_loader, "generator", None))
        else:
            since_best += 1
        if log is not None:
            log(_epoch_line(rows[-1], epochs, improved and best_path is not None))
        if patience is not None and since_best >= patience:
            if log is not None:
                log(f"early stop: validation loss has not improved for {patience} epochs (best {best_loss:.4f})")
            break
    return pd.DataFrame(rows).set_index("epoch")


def _epoch_line(row: dict, epochs: int, saved: bool) -> str:
    parts = [f"epoch {row['epoch']:>{len(str(epochs))}}/{epochs}", f"train_loss {row['train_loss']:.4f}", f"val_loss {row['val_loss']:.4f}"]
    if "val_accuracy" in row:
        parts.append(f"val_acc {row['val_accuracy']:.2%}")
    return "  ".join(parts) + ("  (best so far, saved)" if saved else "")


def rng_state(generator: torch.Generator | None = None) -> dict:
    """Every random number generator's state, in types torch.load(weights_only=True) accepts."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if generator is not None:
        state["generator"] = generator.get_state()
    return state


def set_rng_state(state: dict, generator: torch.Generator | None = None) -> None:
    """Restore what rng_state() captured."""
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if generator is not None and "generator" in state:
        generator.set_state(state["generator"])


def save_checkpoint(
    path: str | Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    epoch: int = 0,
    generator: torch.Generator | None = None,
    **extra,
) -> None:
    """Save everything needed to resume training exactly: weights, optimizer, scheduler, epoch, RNG states."""
    checkpoint = {"epoch": epoch, "model": model.state_dict(), "rng": rng_state(generator), **extra}
    if optimizer is not None:
        checkpoint["optimizer"] = optimizer.state_dict()
    if scheduler is not None:
        checkpoint["scheduler"] = scheduler.state_dict()
    torch.save(checkpoint, path)


def load_checkpoint(
    path: str | Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    generator: torch.Generator | None = None,
    map_location: torch.device | str = "cpu",
) -> dict:
    """Load a save_checkpoint() file into the given objects (weights_only, so no code runs); return it."""
    checkpoint = torch.load(path, map_location=map_location, weights_only=True)
    model.load_state_dict(checkpoint["model"])
    if optimizer is not None:
        optimizer.load_state_dict(checkpoint["optimizer"])
    if scheduler is not None:
        scheduler.load_state_dict(checkpoint["scheduler"])
    set_rng_state(checkpoint["rng"], generator)
    return checkpoint
