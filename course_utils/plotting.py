"""Figures the lessons share: image grids, training curves and speed bars."""

from typing import Mapping, Sequence

import matplotlib.pyplot as plt
import torch


def show_images(
    images: torch.Tensor,
    labels: Sequence[object] | None = None,
    *,
    ncols: int = 8,
    size: float = 1.2,
    cmap: str = "gray",
):
    """Plot a batch of images (N, H, W) or (N, C, H, W) in a grid, with optional titles; return the figure."""
    images = images.detach().cpu()
    if images.ndim == 3:
        images = images.unsqueeze(1)
    if images.ndim != 4:
        raise ValueError(f"expected images of shape (N, H, W) or (N, C, H, W), got {tuple(images.shape)}")
    n = images.shape[0]
    nrows = max(1, -(-n // ncols))
    fig, axes = plt.subplots(nrows, ncols, figsize=(ncols * size, nrows * size), squeeze=False)
    for i, ax in enumerate(axes.flat):
        ax.axis("off")
        if i >= n:
            continue
        # matplotlib wants H, W, C, and a numpy array: a tensor gives numpy 2 a DeprecationWarning (no copy=)
        img = images[i].permute(1, 2, 0).numpy()
        ax.imshow(img.squeeze(-1) if img.shape[-1] == 1 else img, cmap=cmap)
        if labels is not None:
            ax.set_title(str(labels[i]), fontsize=9)
    fig.tight_layout()
    return fig


def plot_curves(history: Mapping[str, Sequence[float]], *, xlabel: str = "epoch", title: str = ""):
    """Plot training curves; keys containing 'loss' go on the left axes, the rest on the right."""
    losses = {k: v for k, v in history.items() if "loss" in k}
    others = {k: v for k, v in history.items() if "loss" not in k}
    ncols = 2 if losses and others else 1
    fig, axes = plt.subplots(1, ncols, figsize=(5 * ncols, 3.2), squeeze=False)
    for ax, group in zip(axes.flat, [g for g in (losses, others) if g]):
        for name, values in group.items():
            ax.plot(range(1, len(values) + 1), list(values), marker="o", markersize=3, label=name)
        ax.set_xlabel(xlabel)
        ax.legend()
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_speed(ms_by_name: Mapping[str, float], *, title: str = "median time (lower is better)"):
    """Horizontal bars of median milliseconds, labelled with their values."""
    names = list(ms_by_name)
    values = [ms_by_name[n] for n in names]
    fig, ax = plt.subplots(figsize=(6, 0.5 + 0.45 * len(names)))
    bars = ax.barh(names, values, color="tab:blue")
    ax.bar_label(bars, labels=[f"{v:.3g} ms" for v in values], padding=3)
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title(title)
    ax.set_xlim(0, max(values) * 1.25)
    fig.tight_layout()
    return fig
