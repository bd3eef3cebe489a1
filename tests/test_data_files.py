"""course_utils.data.DigitsFiles: the digits as a file-based Dataset, the one lesson 04's workers import."""

import csv
import pickle

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from course_utils import data


@pytest.fixture(autouse=True)
def shipped_data(monkeypatch):
    monkeypatch.delenv(data.ENV_VAR, raising=False)


def test_splits_match_load_digits():
    for split, n in (("train", 1438), ("test", 359), (None, 1797)):
        ds = data.DigitsFiles(split)
        images, labels = data.load_digits(split)
        assert len(ds) == n
        for i in (0, n // 2, n - 1):
            image, label = ds[i]
            assert image.shape == (1, 8, 8) and image.dtype == torch.float32
            assert 0.0 <= image.min() and image.max() <= 1.0
            assert torch.equal((image * 255).round().to(torch.uint8), images[i])
            assert label == labels[i].item() and type(label) is int


def test_transform_none_gives_the_pil_image():
    image, _ = data.DigitsFiles("test", transform=None)[0]
    assert isinstance(image, Image.Image) and image.mode == "L" and image.size == (8, 8)


def test_transforms_are_applied():
    ds = data.DigitsFiles("train", transform=lambda img: np.asarray(img).sum(), target_transform=lambda y: y + 100)
    total, label = ds[0]
    assert total == data.load_digits("train")[0][0].sum().item()
    assert label == data.load_digits("train")[1][0].item() + 100


def test_to_float_image():
    pixels = np.array([[0, 255], [51, 102]], dtype=np.uint8)
    out = data.to_float_image(Image.fromarray(pixels))
    assert out.dtype == torch.float32 and out.shape == (1, 2, 2)
    assert torch.allclose(out, torch.tensor([[[0.0, 1.0], [0.2, 0.4]]]))


@pytest.mark.parametrize("split", ["val", "Train", ""])
def test_bad_split(split):
    with pytest.raises(ValueError, match="split must be"):
        data.DigitsFiles(split)


def test_reads_from_course_data(tmp_path, monkeypatch):
    digits = tmp_path / "digits"
    (digits / "images").mkdir(parents=True)
    with open(digits / "labels.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["filename", "label", "split"])
        for i, (label, split) in enumerate([(4, "train"), (8, "test"), (1, "train")]):
            Image.fromarray(np.full((8, 8), 17 * (i + 1), dtype=np.uint8)).save(digits / "images" / f"{i}.png")
            writer.writerow([f"images/{i}.png", label, split])
    monkeypatch.setenv(data.ENV_VAR, str(tmp_path))
    ds = data.DigitsFiles("train", transform=None)
    assert len(ds) == 2
    assert [ds[i][1] for i in range(2)] == [4, 1]
    assert np.asarray(ds[1][0]).tolist() == [[51] * 8] * 8


def test_pickles_for_spawned_workers():
    """Spawned DataLoader workers receive the dataset pickled: it must come back whole."""
    ds = data.DigitsFiles("test")
    copy = pickle.loads(pickle.dumps(ds))
    assert len(copy) == len(ds)
    assert torch.equal(copy[7][0], ds[7][0])


@pytest.mark.slow
def test_loads_in_spawned_workers():
    """A worker started with spawn (as on macOS and Windows) finds the class, since it is importable."""
    ds = data.DigitsFiles("test")
    loader = DataLoader(ds, batch_size=100, num_workers=1, multiprocessing_context="spawn")
    batches = list(loader)
    assert [len(y) for _, y in batches] == [100, 100, 100, 59]
    assert torch.equal(torch.cat([x for x, _ in batches]), torch.stack([ds[i][0] for i in range(len(ds))]))
