"""The course's datasets: UCI digits shipped in data/, and FashionMNIST as an online option."""

import csv
import os
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from PIL import Image

ENV_VAR = "COURSE_DATA"
DIGITS_CLASSES = [str(d) for d in range(10)]
FASHION_CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"]


def data_dir() -> Path:
    """The course's data/ folder (COURSE_DATA overrides it)."""
    override = os.environ.get(ENV_VAR)
    return Path(override) if override else Path(__file__).resolve().parent.parent / "data"


def digits_rows(split: str | None = None) -> list[dict[str, str]]:
    """Rows of data/digits/labels.csv (filename, label, split), optionally one split only."""
    if split not in (None, "train", "test"):
        raise ValueError(f"split must be 'train', 'test' or None, got {split!r}")
    with open(data_dir() / "digits" / "labels.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    return [r for r in rows if split is None or r["split"] == split]


def load_digits(split: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """All digit images as a uint8 tensor (N, 1, 8, 8) and their labels as int64 (N,)."""
    rows = digits_rows(split)
    root = data_dir() / "digits"
    images = np.stack([np.asarray(Image.open(root / r["filename"])) for r in rows])
    labels = torch.tensor([int(r["label"]) for r in rows])
    return torch.from_numpy(images).unsqueeze(1), labels


def fashion_mnist(root: str | Path | None = None, *, train: bool = True, download: bool = False, transform=None):
    """torchvision's FashionMNIST (70,000 28x28 images): the bigger, online option.

    With download=False it reads files already under `root` (data/fashion by default)
    and never touches the network.
    """
    from torchvision.datasets import FashionMNIST

    root = Path(root) if root is not None else data_dir() / "fashion"
    return FashionMNIST(str(root), train=train, download=download, transform=transform)


def classification_datasets(name: str = "digits", *, download: bool = False):
    """(train, test, class_names) as float image datasets in [0, 1]: 'digits' (offline) or 'fashion'.

    'fashion' is FashionMNIST, 60,000 + 10,000 images of 28x28; it needs
    download=True the first time, so it is the learner's online switch, never a test's.
    """
    from torch.utils.data import TensorDataset

    if name == "digits":
        (x_train, y_train), (x_test, y_test) = load_digits("train"), load_digits("test")
        return TensorDataset(x_train.float() / 255, y_train), TensorDataset(x_test.float() / 255, y_test), DIGITS_CLASSES
    if name == "fashion":
        from torchvision.transforms import v2

        to_tensor = v2.Compose([v2.ToImage(), v2.ToDtype(torch.float32, scale=True)])
        train = fashion_mnist(train=True, download=download, transform=to_tensor)
        test = fashion_mnist(train=False, download=download, transform=to_tensor)
        return train, test, FASHION_CLASSES
    raise ValueError(f"unknown dataset {name!r}: expected 'digits' or 'fashion'")


def to_float_image(image: Image.Image) -> torch.Tensor:
    """A PIL image -> float32 tensor (C, H, W) in [0, 1], with transforms.v2 ToImage and ToDtype."""
    from torchvision.transforms import v2  # imported here: torchvision takes seconds to import

    return v2.ToDtype(torch.float32, scale=True)(v2.ToImage()(image))


class DigitsFiles(torch.utils.data.Dataset):
    """The digits read from disk: labels.csv with pandas, one PNG with Pillow per item (lesson 04)."""

    def __init__(
        self,
        split: str | None = None,
        transform: Callable[[Image.Image], Any] | None = to_float_image,
        target_transform: Callable[[int], Any] | None = None,
    ):
        import pandas as pd

        if split not in (None, "train", "test"):
            raise ValueError(f"split must be 'train', 'test' or None, got {split!r}")
        self.root = data_dir() / "digits"
        table = pd.read_csv(self.root / "labels.csv")
        self.table = table if split is None else table[table["split"] == split].reset_index(drop=True)
        self.transform = transform  # None returns the PIL image itself
        self.target_transform = target_transform

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        row = self.table.iloc[index]
        with Image.open(self.root / row["filename"]) as file:
            image = file.convert("L")  # reads the pixels, so the file can close
        label = int(row["label"])
        if self.transform is not None:
            image = self.transform(image)
        if self.target_transform is not None:
            label = self.target_transform(label)
        return image, label
