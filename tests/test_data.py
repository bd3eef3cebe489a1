"""course_utils.data: the shipped digits and an offline FashionMNIST, with the network cut off."""

import csv
import socket
import struct

import numpy as np
import pytest
import torch
from PIL import Image

from course_utils import data


class NetworkUsed(AssertionError):
    pass


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Any attempt to open a connection or resolve a name fails the test."""

    def refuse(*args, **kwargs):
        raise NetworkUsed(f"a data test tried to use the network: {args[1:]!r}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.delenv(data.ENV_VAR, raising=False)


def test_network_guard_works():
    with pytest.raises(NetworkUsed):
        socket.create_connection(("192.0.2.1", 80), timeout=0.1)


def test_load_digits_shapes_and_dtypes():
    images, labels = data.load_digits()
    assert images.shape == (1797, 1, 8, 8)
    assert images.dtype == torch.uint8
    assert labels.shape == (1797,)
    assert labels.dtype == torch.int64
    assert set(labels.tolist()) == set(range(10))
    assert images.max() > 0  # not all black


def test_digits_split_sizes():
    train_images, train_labels = data.load_digits("train")
    test_images, test_labels = data.load_digits("test")
    assert train_images.shape == (1438, 1, 8, 8) and train_labels.shape == (1438,)
    assert test_images.shape == (359, 1, 8, 8) and test_labels.shape == (359,)
    assert set(test_labels.tolist()) == set(range(10))


def test_digits_splits_do_not_overlap():
    train = {r["filename"] for r in data.digits_rows("train")}
    test = {r["filename"] for r in data.digits_rows("test")}
    assert len(train) == 1438 and len(test) == 359
    assert not train & test
    assert train | test == {r["filename"] for r in data.digits_rows()}


def test_digits_rows_match_labels_csv():
    rows = data.digits_rows()
    assert rows[0] == {"filename": "images/0000.png", "label": "0", "split": "train"}
    assert {r["split"] for r in rows} == {"train", "test"}


def test_split_images_match_full_set():
    """load_digits("test") returns the same pixels as picking the test rows out of the full set."""
    all_images, all_labels = data.load_digits()
    rows = data.digits_rows()
    test_index = [i for i, r in enumerate(rows) if r["split"] == "test"]
    test_images, test_labels = data.load_digits("test")
    assert torch.equal(all_images[test_index], test_images)
    assert torch.equal(all_labels[test_index], test_labels)


@pytest.mark.parametrize("split", ["val", "Train", ""])
def test_digits_rows_bad_split(split):
    with pytest.raises(ValueError, match="split must be"):
        data.digits_rows(split)


def test_course_data_override(tmp_path, monkeypatch):
    digits = tmp_path / "digits"
    (digits / "images").mkdir(parents=True)
    pixels = [np.full((8, 8), 10 * (i + 1), dtype=np.uint8) for i in range(3)]
    with open(digits / "labels.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["filename", "label", "split"])
        for i, (p, label, split) in enumerate(zip(pixels, [7, 2, 9], ["train", "test", "train"])):
            Image.fromarray(p).save(digits / "images" / f"{i}.png")
            writer.writerow([f"images/{i}.png", label, split])
    monkeypatch.setenv(data.ENV_VAR, str(tmp_path))
    assert data.data_dir() == tmp_path
    images, labels = data.load_digits("train")
    assert images.shape == (2, 1, 8, 8)
    assert labels.tolist() == [7, 9]
    assert images[1].unique().tolist() == [30]


def _write_idx(path, array: np.ndarray, magic: int) -> None:
    header = struct.pack(">I", magic) + b"".join(struct.pack(">I", n) for n in array.shape)
    path.write_bytes(header + array.astype(np.uint8).tobytes())


def _fake_fashion(root, n_train=5, n_test=2):
    raw = root / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    sets = {}
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = (np.arange(n) * 3 + 1) % 10
        _write_idx(raw / f"{prefix}-images-idx3-ubyte", images, 2051)
        _write_idx(raw / f"{prefix}-labels-idx1-ubyte", labels, 2049)
        sets[prefix] = images, labels
    return sets


def test_fashion_mnist_offline_train(tmp_path):
    sets = _fake_fashion(tmp_path)
    ds = data.fashion_mnist(tmp_path, train=True, download=False)
    images, labels = sets["train"]
    assert len(ds) == 5
    for i in range(5):
        image, label = ds[i]
        assert label == labels[i]
        assert np.array_equal(np.asarray(image), images[i])
    assert list(ds.classes) == data.FASHION_CLASSES


def test_fashion_mnist_offline_test_split_and_transform(tmp_path):
    sets = _fake_fashion(tmp_path)
    ds = data.fashion_mnist(tmp_path, train=False, transform=lambda img: torch.from_numpy(np.array(img)))
    images, labels = sets["t10k"]
    assert len(ds) == 2
    image, label = ds[1]
    assert label == labels[1]
    assert torch.equal(image, torch.from_numpy(images[1]))


def test_fashion_mnist_default_root_under_course_data(tmp_path, monkeypatch):
    _fake_fashion(tmp_path / "fashion")
    monkeypatch.setenv(data.ENV_VAR, str(tmp_path))
    assert len(data.fashion_mnist()) == 5


def test_fashion_mnist_missing_files_fail_without_network(tmp_path):
    """download=False on an empty folder says the files are missing; it never reaches for the network."""
    with pytest.raises(RuntimeError, match="not found"):
        data.fashion_mnist(tmp_path, download=False)


def test_classification_datasets_digits_are_floats_in_unit_range():
    train, test, classes = data.classification_datasets("digits")
    assert (len(train), len(test), classes) == (1438, 359, data.DIGITS_CLASSES)
    image, label = train[0]
    assert image.shape == (1, 8, 8) and image.dtype == torch.float32
    assert 0.0 <= image.min() and image.max() <= 1.0 and 0 <= int(label) <= 9


def test_classification_datasets_fashion_switch_offline(tmp_path, monkeypatch):
    """The online switch, exercised on IDX files the test writes: same (1, H, W) float layout as digits."""
    _fake_fashion(tmp_path / "fashion")
    monkeypatch.setenv(data.ENV_VAR, str(tmp_path))
    train, test, classes = data.classification_datasets("fashion")
    assert (len(train), len(test), classes) == (5, 2, data.FASHION_CLASSES)
    image, label = train[0]
    assert image.shape == (1, 28, 28) and image.dtype == torch.float32 and image.max() <= 1.0
    assert label == 1


def test_classification_datasets_unknown_name():
    with pytest.raises(ValueError, match="expected 'digits' or 'fashion'"):
        data.classification_datasets("cifar")
