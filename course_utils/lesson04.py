"""Lesson 04 (data: Dataset and DataLoader): reference solutions and the checks for its exercises."""

import contextlib
import csv
import io
import itertools
import math
import multiprocessing
import pickle
import re
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
from PIL import Image
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import (DataLoader, Dataset, IterableDataset, RandomSampler, Subset, WeightedRandomSampler, default_convert,
                              get_worker_info, random_split)
from torchvision.datasets import ImageFolder
from torchvision.datasets.folder import find_classes
from torchvision.transforms import v2

from course_utils.tooling.checks import (
    ExerciseFailed,
    a_type,
    call,
    exercise,
    expect_equal,
    expect_shape,
    expect_tensor,
    first_line,
    scoreboard_for,
    type_name,
)
from course_utils.tooling.language import N_, _

scoreboard = scoreboard_for(__name__)  # the lesson's last cell: this session's verdicts

# Reference solutions. The checks compare the learner's answers with these.


def read_item(root: Path, row) -> tuple[torch.Tensor, int]:
    """One row of labels.csv -> (float32 image (1, H, W) in [0, 1], int label)."""
    to_tensor = v2.Compose([v2.ToImage(), v2.ToDtype(torch.float32, scale=True)])
    with Image.open(root / row["filename"]) as file:
        image = to_tensor(file.convert("L"))
    return image, int(row["label"])


def smoothed_targets(labels: torch.Tensor, num_classes: int, smoothing: float) -> torch.Tensor:
    """Class indices (B,) -> (B, num_classes) float32 label-smoothed one-hot rows, as CrossEntropyLoss(label_smoothing=...) uses."""
    share = smoothing / num_classes  # every class's share of the smoothing, the true class's included
    targets = torch.full((len(labels), num_classes), share)
    return targets.scatter_(1, labels.unsqueeze(1), 1 - smoothing + share)


def folder_dataset(root: Path) -> ImageFolder:
    """An ImageFolder over root/<number>/*.png: items (gray float32 image (1, H, W) in [0, 1], the folder's number)."""
    to_gray = v2.Compose([v2.ToImage(), v2.Grayscale(), v2.ToDtype(torch.float32, scale=True)])
    classes, _ = find_classes(root)  # sorted as text, as ImageFolder numbers them: '10' before '2'
    number_of_class = [int(name) for name in classes]
    # A bound method pickles, so worker processes started by spawn can receive the dataset.
    return ImageFolder(root, transform=to_gray, target_transform=number_of_class.__getitem__)


def split_train_val(
    make_dataset: Callable[..., Dataset], val_fraction: float, seed: int, train_transform: Callable, val_transform: Callable
) -> tuple[Subset, Subset]:
    """(train, val): one seeded split, the training part read with train_transform, the validation part with val_transform."""
    augmented, plain = make_dataset(transform=train_transform), make_dataset(transform=val_transform)
    n_val = int(val_fraction * len(plain))
    train, val = random_split(range(len(plain)), [len(plain) - n_val, n_val], generator=torch.Generator().manual_seed(seed))
    return Subset(augmented, train.indices), Subset(plain, val.indices)  # one split, the same indices into both


def pad_collate(batch: list[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[(sequence (L_i,), label), ...] -> (padded (B, L_max), lengths (B,), labels (B,)), padding with 0."""
    sequences, labels = zip(*batch)
    lengths = torch.tensor([len(s) for s in sequences])
    padded = pad_sequence(sequences, batch_first=True, padding_value=0)
    return padded, lengths, torch.tensor(labels)


def balanced_loader(dataset: Dataset, labels: torch.Tensor, batch_size: int, seed: int) -> DataLoader:
    """A DataLoader whose epochs draw every class equally often on average, through a seeded WeightedRandomSampler."""
    count_of_class = torch.bincount(labels)
    weights = 1.0 / count_of_class[labels].double()  # each class's samples share a total weight of 1
    sampler = WeightedRandomSampler(weights, num_samples=len(labels), replacement=True, generator=torch.Generator().manual_seed(seed))
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler)


def time_epoch(loader: DataLoader, step: Callable[[Any], Any]) -> tuple[float, float]:
    """One epoch of step(batch) over loader -> (seconds spent waiting for batches, seconds spent in step)."""
    waiting = stepping = 0.0
    start = time.perf_counter()
    for batch in loader:  # the wait for a batch happens here, inside the loop's hidden next()
        got_batch = time.perf_counter()
        step(batch)
        done = time.perf_counter()
        waiting += got_batch - start
        stepping += done - got_batch
        start = done
    return waiting, stepping


def parallel_loader(loader: DataLoader, workers: int) -> DataLoader:
    """A loader with the batches of `loader`, loaded by `workers` processes that live from one epoch to the next."""
    return DataLoader(
        loader.dataset,
        batch_sampler=loader.batch_sampler,  # the same sampler, batch size and drop_last
        collate_fn=loader.collate_fn,
        num_workers=workers,
        persistent_workers=True,
        generator=loader.generator,  # each epoch's first draw seeds the workers, as it did in the loader
        pin_memory=loader.pin_memory,
    )


# Section 8's streams. They live in a module, not in the notebook, because worker processes started by
# forkserver or spawn import them by name.


class CsvLabels(IterableDataset):
    """The label column of a CSV file, read line by line: a stream, with no len() and no random access."""

    def __init__(self, path: Path, start: int = 0, step: int = 1):
        self.path, self.start, self.step = path, start, step  # this copy reads rows start, start + step, ...

    def __iter__(self) -> Iterator[tuple[int, int]]:
        with open(self.path, newline="") as file:
            for row_number, row in itertools.islice(enumerate(csv.DictReader(file)), self.start, None, self.step):
                yield row_number, int(row["label"])


class ShardedCsvLabels(CsvLabels):
    """CsvLabels that shares its rows out among the DataLoader's workers: worker k of n reads rows k, k + n, k + 2n, ..."""

    def __iter__(self) -> Iterator[tuple[int, int]]:
        worker = get_worker_info()  # None in the main process (num_workers=0)
        if worker is None:
            return super().__iter__()
        mine = CsvLabels(self.path, self.start + worker.id * self.step, self.step * worker.num_workers)
        return iter(mine)


def share_rows(worker_id: int) -> None:
    """A worker_init_fn: make this worker's copy of a CsvLabels read every num_workers-th row, from row worker_id."""
    worker = get_worker_info()
    worker.dataset.start, worker.dataset.step = worker_id, worker.num_workers


# Checks, one per exercise, in notebook order.


def _a(value: Any) -> str:
    """'a tensor of shape (2, 3)', 'an int': a returned value as a message names it."""
    if isinstance(value, torch.Tensor):
        return _("a tensor of shape {shape}").format(shape=tuple(value.shape))
    return "None" if value is None else a_type(value)


# ---- read_item ----------------------------------------------------------------------------------


def _pixels(height: int, width: int, seed: int, channels: int = 0) -> np.ndarray:
    """Random uint8 pixels holding both 0 and 255, so that unscaled or clipped images show."""
    shape = (height, width, channels) if channels else (height, width)
    pixels = np.random.default_rng(seed).integers(1, 255, size=shape, dtype=np.uint8)
    pixels.reshape(-1)[0], pixels.reshape(-1)[-1] = 255, 0
    return pixels


def _write_pictures(root: Path) -> list[dict[str, str]]:
    """Three PNGs unlike the course's digits: a gray one, a colour (RGB) one and one in the folder root."""
    (root / "pics").mkdir()
    files = [
        ("pics/a.png", Image.fromarray(_pixels(7, 5, 1)), "0"),
        ("pics/b.png", Image.fromarray(_pixels(4, 6, 2, channels=3), mode="RGB"), "12"),
        ("c.png", Image.fromarray(_pixels(3, 3, 3)), "10"),
    ]
    for name, image, _label in files:
        image.save(root / name)
    return [{"filename": name, "label": label, "split": "train"} for name, _, label in files]


@exercise("read_item")
def check_read_item(fn) -> None:
    import pandas as pd

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        rows = _write_pictures(root)
        table = pd.DataFrame(rows).astype({"label": int})
        # As csv.DictReader gives a row (label a str) and as pandas does (label a numpy integer).
        cases = [(rows[0], N_("gray")), (table.iloc[1], N_("colour (RGB)")), (rows[2], N_("gray"))]
        for row, kind in cases:
            shown = _("root, row {filename!r}").format(filename=row["filename"])
            what = f"read_item({shown})"
            before = dict(row)
            expected_image, expected_label = read_item(root, row)
            got = call(fn, root, row, shown=shown)
            if not isinstance(got, (tuple, list)) or len(got) != 2:
                raise ExerciseFailed(_("{what} returned {got}: return a tuple (image, label)").format(what=what, got=_a(got)))
            image, label = got
            if isinstance(image, Image.Image):
                raise ExerciseFailed(_("{what}: the image is still a PIL image; "
                                       "convert it to a tensor with v2.ToImage() and v2.ToDtype(...)").format(what=what))
            if isinstance(image, torch.Tensor):
                if image.dtype == torch.uint8:
                    raise ExerciseFailed(_("{what}: the image is uint8 with values 0-255: add v2.ToDtype(torch.float32, scale=True)").format(what=what))
                if image.is_floating_point() and image.numel() and image.max() > 1.5:
                    raise ExerciseFailed(_("{what}: pixel values go up to {max:.0f}: pass scale=True to ToDtype so they land in [0, 1]").format(
                        what=what, max=image.max().item()))
                h, w = expected_image.shape[1:]
                if tuple(image.shape) == (h, w):
                    raise ExerciseFailed(_("{what}: the image has shape {shape}, with no channel dimension: v2.ToImage() gives (1, H, W)").format(
                        what=what, shape=(h, w)))
                if tuple(image.shape) == (3, h, w):
                    raise ExerciseFailed(
                        _("{what}: the image has 3 channels because this file is stored in {kind}; "
                          "convert every image to one gray channel ('L') when you open it").format(what=what, kind=_(kind))
                    )
            # 1.5 grey levels: v2.Grayscale and Pillow's convert('L') may round a colour pixel differently.
            expect_tensor(image, expected_image, what=_("{what}'s image").format(what=what), atol=1.5 / 255)
            if isinstance(label, str):
                raise ExerciseFailed(_("{what}: the label is the string {label!r}: convert it with int()").format(what=what, label=label))
            expect_equal(label, expected_label, what=_("{what}'s label").format(what=what))
            if dict(row) != before:
                raise ExerciseFailed(_("{what} changed the row it was given: read from it, do not write to it").format(what=what))


# ---- smoothed_targets ---------------------------------------------------------------------------

# (labels, num_classes, smoothing): no case has 10 classes or a batch as wide as its classes, and in the
# last two the largest label stops below num_classes - 1, so a width guessed from the labels shows.
_SMOOTHING_CASES = [
    ([3, 11, 0, 3, 7], 12, 0.1),
    ([1], 3, 0.3),
    ([4, 0, 2, 2, 1, 4], 7, 0.0),
]


def _smoothing_variants(labels: torch.Tensor, num_classes: int, smoothing: float) -> list[tuple[torch.Tensor, str]]:
    """The targets the typical wrong answers give on this case, each with its diagnosis."""
    eps, c, rows = smoothing, num_classes, len(labels)
    index = labels.unsqueeze(1)
    variants = [
        (torch.full((rows, c), eps / (c - 1)).scatter_(1, index, 1 - eps),
         _("the smoothing is spread over the {others} other classes; here, as in CrossEntropyLoss(label_smoothing=...), it is spread "
           "over all {classes} classes, the true one included: smoothing / num_classes each, "
           "and 1 - smoothing + smoothing / num_classes on the true class").format(others=c - 1, classes=c)),
        (torch.full((rows, c), eps / c).scatter_(1, index, 1 - eps),
         _("the true class gets 1 - smoothing, but its own share smoothing / num_classes is missing: each row must sum to 1")),
        (torch.full((rows, c), eps / c).scatter_(1, index, 1.0),
         _("the true class gets 1, so each row sums to more than 1: it gets 1 - smoothing + smoothing / num_classes")),
        (torch.zeros(rows, c).scatter_(1, index, 1.0), _("these are plain one-hot rows: the smoothing is missing")),
    ]
    if rows <= c and int(labels.max()) < rows:
        variants.append((torch.full((rows, c), eps / c).scatter_(0, index, 1 - eps + eps / c),
                         _("scatter_ along dim 0 wrote the values down the first column: scatter along dim 1, the classes")))
    return [(v, m) for v, m in variants if not torch.allclose(v, smoothed_targets(labels, num_classes, smoothing))]


@exercise("smoothed_targets")
def check_smoothed_targets(fn) -> None:
    hints = {"Index tensor must have the same number of dimensions": N_("scatter_'s index needs as many dims as the tensor it writes into: "
                                                                        "labels of shape (B,) become an index of shape (B, 1) with labels.unsqueeze(1)"),
             "out of bounds for dimension 0": N_("along dim 0 an index picks a row, one per sample; the classes are dim 1"),
             "out of bounds for dimension 1": N_("a label reached past the last column: make the rows num_classes wide")}  # translated by call()
    for values, num_classes, smoothing in _SMOOTHING_CASES:
        labels = torch.tensor(values)
        given = labels.clone()
        shown = _("labels {labels}, num_classes={num_classes}, smoothing={smoothing}").format(labels=values, num_classes=num_classes, smoothing=smoothing)
        what = f"smoothed_targets({shown})"
        got = call(fn, given, num_classes, smoothing, shown=shown, hints=hints)
        if not torch.equal(given, labels) or given.shape != labels.shape:
            raise ExerciseFailed(_("{what} changed the labels it was given: leave them as they are").format(what=what))
        expected = smoothed_targets(labels, num_classes, smoothing)
        rows = len(values)
        if isinstance(got, torch.Tensor) and got.ndim == 2 and got.shape[0] == rows and got.shape[1] != num_classes:
            width = got.shape[1]
            if width == max(values) + 1:
                raise ExerciseFailed(_("{what} has {width} columns, max(labels) + 1: the number of classes came from the labels, as F.one_hot "
                                       "does without num_classes; make num_classes ({num_classes}) columns").format(
                    what=what, width=width, num_classes=num_classes))
            if width == 10:
                raise ExerciseFailed(_("{what} has 10 columns, the digits' number of classes: this case has num_classes = {num_classes}").format(
                    what=what, num_classes=num_classes))
        if isinstance(got, torch.Tensor) and got.shape == expected.shape and got.dtype != torch.float32:
            hint = _(" (F.one_hot, for one, gives int64: convert with .float())") if not got.is_floating_point() else ""
            raise ExerciseFailed(_("{what} has dtype {dtype}, expected torch.float32: CrossEntropyLoss takes class probabilities as floats{hint}").format(
                what=what, dtype=got.dtype, hint=hint))
        if isinstance(got, torch.Tensor) and got.shape == expected.shape and got.is_floating_point():
            for variant, message in _smoothing_variants(labels, num_classes, smoothing):
                if torch.allclose(got.double(), variant.double(), atol=1e-6):
                    raise ExerciseFailed(_("{what}: {problem}").format(what=what, problem=message))
        expect_tensor(got, expected, what=what)
        if got.requires_grad:
            raise ExerciseFailed(_("{what} requires grad: targets are data, built outside autograd").format(what=what))


# ---- folder_dataset -----------------------------------------------------------------------------

_FOLDER_CLASSES = [str(number) for number in range(12)]  # more than 9 classes: as text, '10' sorts before '2'


def _write_folder(root: Path) -> dict[str, tuple[torch.Tensor, int]]:
    """root/<number>/*.png for 12 classes, one image each and two in class 3, one in colour; {path: (gray image, number)}."""
    expected = {}
    for number, name in enumerate(_FOLDER_CLASSES):
        (root / name).mkdir()
        for k in range(2 if number == 3 else 1):
            height, width = 3 + number % 4, 4 + (number + k) % 3
            colour = number == 7
            image = Image.fromarray(_pixels(height, width, 100 + 10 * number + k, channels=3 if colour else 0), mode="RGB" if colour else "L")
            path = root / name / f"img{k}.png"
            image.save(path)
            expected[str(path)] = (read_item(root, {"filename": f"{name}/img{k}.png", "label": number})[0], number)
    (root / "3" / "notes.txt").write_text("not an image: ImageFolder skips it\n")
    return expected


def _match_file(image: torch.Tensor, expected: dict[str, tuple[torch.Tensor, int]]) -> str | None:
    for path, (gray, _label) in expected.items():
        if image.shape == gray.shape and torch.allclose(image.double(), gray.double(), atol=1.5 / 255, rtol=0):
            return path
    return None


@exercise("folder_dataset")
def check_folder_dataset(fn) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "shapes"
        root.mkdir()
        expected = _write_folder(root)
        shown = _("root with 12 class folders '0' to '11'")
        what = f"folder_dataset({shown})"
        dataset = call(fn, root, shown=shown)
        if not isinstance(dataset, ImageFolder):
            raise ExerciseFailed(_("{what} returned {got}, expected a torchvision.datasets.ImageFolder").format(what=what, got=_a(dataset)))
        if Path(dataset.root).resolve() != root.resolve():
            raise ExerciseFailed(_("{what} reads the folder {folder!r}, not the root it was given").format(what=what, folder=str(dataset.root)))
        if len(dataset) != len(expected):
            raise ExerciseFailed(_("{what} holds {n} items, expected {expected}: one per image file under root").format(
                what=what, n=len(dataset), expected=len(expected)))
        sorted_index = {name: i for i, name in enumerate(sorted(_FOLDER_CLASSES))}
        seen = set()
        for i in range(len(dataset)):
            item = call(dataset.__getitem__, i, name="dataset.__getitem__")
            where = f"{what}[{i}]"
            if not isinstance(item, (tuple, list)) or len(item) != 2:
                raise ExerciseFailed(_("{what} is {got}, expected a pair (image, label)").format(what=where, got=_a(item)))
            image, label = item
            if isinstance(image, Image.Image):
                raise ExerciseFailed(_("{what}: the image is a PIL image; give ImageFolder a transform that makes a float tensor").format(what=where))
            if not isinstance(image, torch.Tensor):
                raise ExerciseFailed(_("{what}: the image is {got}, expected a torch.Tensor").format(what=where, got=_a(image)))
            if image.ndim == 3 and image.shape[0] == 3:
                raise ExerciseFailed(
                    _("{what}: the image has 3 channels, shape {shape}: ImageFolder's default loader opens "
                      "every file as RGB; make it one gray channel").format(what=where, shape=tuple(image.shape))
                )
            if image.dtype == torch.uint8:
                raise ExerciseFailed(_("{what}: the image is uint8 with values 0-255, expected float32 in [0, 1]").format(what=where))
            if image.is_floating_point() and image.numel() and image.max() > 1.5:
                raise ExerciseFailed(_("{what}: pixel values go up to {max:.0f}: scale them to [0, 1] (ToDtype(..., scale=True))").format(
                    what=where, max=image.max().item()))
            if image.dtype != torch.float32:
                raise ExerciseFailed(_("{what}: the image has dtype {dtype}, expected torch.float32").format(what=where, dtype=image.dtype))
            if image.ndim != 3 or image.shape[0] != 1:
                raise ExerciseFailed(_("{what}: the image has shape {shape}, expected (1, H, W)").format(what=where, shape=tuple(image.shape)))
            path = _match_file(image, expected)
            if path is None:
                raise ExerciseFailed(_("{what}: the image matches no file under root, read in gray").format(what=where))
            seen.add(path)
            gray, number = expected[path]
            folder = Path(path).parent.name
            if isinstance(label, torch.Tensor) and label.numel() == 1:
                raise ExerciseFailed(_("{what}: the label is a tensor, expected a Python int: return int(...)").format(what=where))
            is_number = isinstance(label, (int, np.integer)) and not isinstance(label, bool)
            if is_number and label == sorted_index[folder] and label != number:
                raise ExerciseFailed(
                    _("{what}: an image of folder '{folder}' has the label {label}, its position among the folders sorted "
                      "as text ('10' comes before '2'); the label must be the folder's number, {number} (target_transform)").format(
                        what=where, folder=folder, label=label, number=number)
                )
            expect_equal(label, number, what=_("{what}'s label (folder '{folder}')").format(what=where, folder=folder))
        if len(seen) != len(expected):
            raise ExerciseFailed(_("{what}: {n} image files never appear among its items").format(what=what, n=len(expected) - len(seen)))
        _expect_reaches_workers(dataset, what)


class _DefinedInNotebook(Exception):
    """A pickled object names something in __main__, which a worker started by forkserver or spawn does not have."""


class _WorkerUnpickler(pickle.Unpickler):
    """Unpickles as a DataLoader worker started by forkserver or spawn does: by module and name, without the notebook's own names."""

    def find_class(self, module: str, name: str) -> Any:
        if module in ("__main__", "__mp_main__"):
            raise _DefinedInNotebook(name)
        return super().find_class(module, name)


def _worker_problem(part: Any) -> str | None:
    """Why `part` would not reach a worker process started by forkserver or spawn, or None when it would."""
    try:
        data = pickle.dumps(part)
    except Exception as err:  # noqa: BLE001 -- PicklingError, AttributeError or TypeError, by what is unpicklable
        reason = re.sub(r" at 0x[0-9a-f]+", "", first_line(err))
        why = _(": a lambda has no name to look it up by") if "<lambda>" in reason else (
            _(": a function defined inside another has no name a worker can look up") if "local object" in reason else "")
        return _("cannot be pickled ({error}: {reason}){why}").format(error=type(err).__name__, reason=reason, why=why)
    try:
        _WorkerUnpickler(io.BytesIO(data)).load()
    except _DefinedInNotebook as err:
        return _("refers to {name}, defined in the notebook (__main__): pickle sends it by name, and a worker started by forkserver "
                 "or spawn has no such name, so it fails there with AttributeError").format(name=str(err))
    return None


def _expect_reaches_workers(dataset: ImageFolder, what: str) -> None:
    """The dataset must survive the trip to a worker process as this notebook starts them (forkserver), part by part."""
    parts = [(N_("its class"), type(dataset)), (N_("its transform"), dataset.transform), (N_("its target_transform"), dataset.target_transform),
             (N_("its loader"), getattr(dataset, "loader", None)), (N_("the dataset"), dataset)]
    for name, part in parts:
        problem = _worker_problem(part)
        if problem:
            raise ExerciseFailed(_("{what}: {part} {problem}; DataLoader workers could not load this dataset: use a function or class "
                                   "from a module, or a method of a built-in object (a list's or dict's own methods pickle)").format(
                what=what, part=_(name), problem=problem))


# ---- split_train_val ----------------------------------------------------------------------------


class _Pictures(Dataset):
    """Tiny uint8 images with unique labels; `transform` (torchvision's convention) is applied to each image read."""

    def __init__(self, images: torch.Tensor, labels: list[int], transform: Callable | None = None):
        self.images, self.labels, self.transform = images, labels, transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        image = self.images[index]
        return (image if self.transform is None else self.transform(image)), self.labels[index]


class _Jitter:
    """A random augmentation: scale to [0, 1], then add noise below half a grey level, drawn from torch's global RNG."""

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        return image.float() / 255 + torch.rand(image.shape) * (0.5 / 255)


class _Scale:
    """The evaluation transform: scale to [0, 1], nothing random."""

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        return image.float() / 255


def _pictures(n: int, seed: int) -> tuple[torch.Tensor, list[int]]:
    generator = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (n, 1, 3, 3), dtype=torch.uint8, generator=generator)
    labels = (torch.randperm(n, generator=generator) + 100).tolist()  # one label per item, so it names the item
    return images, labels


def _item_at(part: Any, i: int, name: str, what: str) -> tuple[Any, Any]:
    item = call(part.__getitem__, i, name=f"{name}.__getitem__")
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        raise ExerciseFailed(_("{what}: {part}[{index}] is {got}, expected a pair (image, label)").format(what=what, part=name, index=i, got=_a(item)))
    return item[0], item[1]


def _read_part(part: Any, name: str, labels: list[int], what: str) -> list[tuple[int, Any, int]]:
    """[(position, image, index of the item in the dataset)] of one returned part, read once in order."""
    index_of = {label: k for k, label in enumerate(labels)}
    out = []
    for i in range(len(part)):
        image, label = _item_at(part, i, name, what)
        if isinstance(label, torch.Tensor) and label.numel() == 1:
            label = label.item()
        if not isinstance(label, int) or label not in index_of:
            raise ExerciseFailed(_("{what}: {part}[{index}] has the label {label!r}, which no item of the dataset has").format(
                what=what, part=name, index=i, label=label))
        out.append((i, image, index_of[label]))
    return out


def _same_image(got: Any, expected: torch.Tensor) -> bool:
    return isinstance(got, torch.Tensor) and got.shape == expected.shape and got.dtype == expected.dtype and torch.equal(got, expected)


def _is_jittered(got: Any, image: torch.Tensor) -> bool:
    if not isinstance(got, torch.Tensor) or got.shape != image.shape or not got.is_floating_point():
        return False
    noise = got.double() - image.double() / 255
    return bool((noise >= 0).all() and (noise < 0.5 / 255 + 1e-6).all() and (noise > 0).any())


def _parts(got: Any, what: str) -> tuple[Any, Any]:
    """The (train, val) pair a learner returned, each a dataset."""
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        raise ExerciseFailed(_("{what} returned {got}: return the pair (train, val)").format(what=what, got=_a(got)))
    for part, name in zip(got, ("train", "val")):
        if not (hasattr(part, "__len__") and hasattr(part, "__getitem__")):
            raise ExerciseFailed(_("{what}: {part} is {got}, expected a dataset (with __len__ and __getitem__)").format(what=what, part=name, got=_a(part)))
    return got[0], got[1]


def _shared_hint(train: Any, val: Any) -> str:
    if isinstance(train, Subset) and isinstance(val, Subset) and train.dataset is val.dataset:
        return _(" (both parts are Subsets of one dataset, so they read it with the same transform)")
    return ""


@exercise("split_train_val")
def check_split_train_val(fn) -> None:
    jitter, scale = _Jitter(), _Scale()
    for n, val_fraction, seed in ((23, 0.3, 5), (10, 0.5, 0), (9, 0.25, 13)):
        images, labels = _pictures(n, seed=n)

        def make_dataset(transform=None):
            return _Pictures(images, labels, transform)

        shown = f"make_dataset, {val_fraction}, seed={seed}, train_transform, val_transform"
        described = _("dataset of {n}").format(n=n)
        what = f"split_train_val({described}, val_fraction={val_fraction}, seed={seed})"
        original = images.clone()
        state = torch.random.get_rng_state()
        train, val = _parts(call(fn, make_dataset, val_fraction, seed, jitter, scale, shown=shown), what)
        global_rng_touched = not torch.equal(torch.random.get_rng_state(), state)
        n_val = int(val_fraction * n)
        sizes, expected_sizes = [len(train), len(val)], [n - n_val, n_val]
        if sizes != expected_sizes:
            if sizes == expected_sizes[::-1]:
                hint = _(": swapped? return (train, val)")
            else:
                hint = _(" (val gets int({val_fraction} * {n}) items)").format(val_fraction=val_fraction, n=n)
            raise ExerciseFailed(_("{what}: expected sizes (train, val) {expected}, got {got}{hint}").format(
                what=what, expected=expected_sizes, got=sizes, hint=hint))

        # Which dataset item each position of a part holds, named by its unique label.
        torch.manual_seed(seed + 1000)
        train_items = _read_part(train, "train", labels, what)
        val_items = _read_part(val, "val", labels, what)
        train_order, val_order = [k for _i, _image, k in train_items], [k for _i, _image, k in val_items]
        shared = set(train_order) & set(val_order)
        if shared:
            raise ExerciseFailed(
                _("{what}: {n} items are in both parts: the parts come from two different shuffles; "
                  "take both from one seeded split").format(what=what, n=len(shared))
            )
        if len(set(train_order)) != len(train_order) or len(set(val_order)) != len(val_order):
            raise ExerciseFailed(_("{what}: an item appears twice in one part; each item belongs to exactly one part, once").format(what=what))
        for i, image, k in val_items:
            expected = scale(images[k])
            if _same_image(image, expected):
                continue
            if _is_jittered(image, images[k]):
                raise ExerciseFailed(_("{what}: val[{index}] is augmented: the validation part must be read with val_transform{hint}").format(
                    what=what, index=i, hint=_shared_hint(train, val)))
            if _same_image(image, images[k]):
                raise ExerciseFailed(_("{what}: val[{index}] is the raw image: the validation part must apply val_transform").format(what=what, index=i))
            expect_tensor(image, expected, what=_("{what}: {part}[{index}]'s image").format(what=what, part="val", index=i))
        for i, _image, k in train_items:
            torch.manual_seed(seed + 2000 + i)
            image = _item_at(train, i, "train", what)[0]
            torch.manual_seed(seed + 2000 + i)
            expected = jitter(images[k])
            if _same_image(image, expected):
                continue
            if _same_image(image, scale(images[k])):
                raise ExerciseFailed(
                    _("{what}: train[{index}] is not augmented: the training part must be read with train_transform{hint}").format(
                        what=what, index=i, hint=_shared_hint(train, val))
                )
            if _same_image(image, images[k]):
                raise ExerciseFailed(_("{what}: train[{index}] is the raw image: the training part must apply train_transform").format(what=what, index=i))
            if _is_jittered(image, images[k]):
                raise ExerciseFailed(_("{what}: train[{index}] is augmented, but not by a fresh call of train_transform each time it is read").format(
                    what=what, index=i))
            expect_tensor(image, expected, what=_("{what}: {part}[{index}]'s image").format(what=what, part="train", index=i))
        if not torch.equal(images, original):
            raise ExerciseFailed(_("{what} changed the dataset's images").format(what=what))
        if train_order + val_order == list(range(n)) or val_order + train_order == list(range(n)):
            raise ExerciseFailed(_("{what}: the parts hold the items in their original order: shuffle before you split").format(what=what))

        again = _parts(call(fn, make_dataset, val_fraction, seed, jitter, scale, shown=shown), what)
        if [[k for _i, _image, k in _read_part(part, name, labels, what)] for part, name in zip(again, ("train", "val"))] != [train_order, val_order]:
            raise ExerciseFailed(_("{what}: two calls with the same seed gave different splits: seed the split with `seed`").format(what=what))
        if global_rng_touched:
            raise ExerciseFailed(
                _("{what} changed torch's global random state (torch.manual_seed?): give the split a torch.Generator of its own").format(what=what)
            )
        other = _parts(call(fn, make_dataset, val_fraction, seed + 1, jitter, scale, shown=shown), what)
        if sorted(k for _i, _image, k in _read_part(other[1], "val", labels, what)) == sorted(val_order):
            raise ExerciseFailed(_("{what}: seeds {seed} and {other_seed} gave the same split: the split must depend on seed").format(
                what=what, seed=seed, other_seed=seed + 1))


# ---- pad_collate --------------------------------------------------------------------------------


def _sequences(lengths: Sequence[int], labels: Sequence[int], seed: int) -> list[tuple[torch.Tensor, int]]:
    """Token ids 0-14: token 0 is a real token here, inside and at the end of sequences."""
    generator = torch.Generator().manual_seed(seed)
    batch = [(torch.randint(1, 15, (n,), generator=generator), y) for n, y in zip(lengths, labels)]
    for i, (tokens, _label) in enumerate(batch):
        if len(tokens) > 1:
            tokens[i % len(tokens)] = 0
        if i == 0:
            tokens[-1] = 0
    return batch


@exercise("pad_collate")
def check_pad_collate(fn) -> None:
    # Batch sizes differ from the longest length, so a transposed result shows in its shape.
    cases = (((3, 6, 1, 4), (11, 0, 4, 11), 0), ((5,), (13,), 1), ((2, 5, 5), (2, 10, 3), 2))
    for lengths, labels, seed in cases:
        batch = _sequences(lengths, labels, seed)
        shown = _("batch of sequences with lengths {lengths}").format(lengths=list(lengths))
        what = f"pad_collate({shown})"
        given = [(s.clone(), y) for s, y in batch]
        got = call(fn, given, shown=shown)
        if not isinstance(got, (tuple, list)):
            raise ExerciseFailed(_("{what} returned {got}: return a tuple (padded, lengths, labels)").format(what=what, got=_a(got)))
        if len(got) != 3:
            missing = _(": the lengths are missing") if len(got) == 2 else ""
            raise ExerciseFailed(_("{what} returned {n} things, expected 3: (padded, lengths, labels){missing}").format(
                what=what, n=len(got), missing=missing))
        if any(not torch.equal(s, original) for (s, _label), (original, _original_label) in zip(given, batch)):
            raise ExerciseFailed(_("{what} changed the sequences it was given: pad copies, not the originals").format(what=what))
        padded, got_lengths, got_labels = got
        expected_padded, expected_lengths, expected_labels = pad_collate(batch)
        batch_size, longest = expected_padded.shape
        if isinstance(padded, torch.Tensor) and tuple(padded.shape) == (longest, batch_size) and batch_size != longest:
            raise ExerciseFailed(_("{what}: padded has shape {shape}, time first: pass batch_first=True to pad_sequence").format(
                what=what, shape=tuple(padded.shape)))
        expect_shape(padded, expected_padded.shape, what=_("{what}'s padded tensor").format(what=what))
        real = torch.arange(longest)[None, :] < expected_lengths[:, None]
        if torch.equal(padded[real], expected_padded[real]) and not torch.equal(padded[~real], expected_padded[~real]):
            value = padded[~real][0].item()
            raise ExerciseFailed(_("{what}: the padding positions hold {value}, expected 0: use padding_value=0").format(what=what, value=value))
        rows = sorted(map(tuple, expected_padded.tolist()))
        if not torch.equal(padded, expected_padded) and sorted(map(tuple, padded.tolist())) == rows:
            raise ExerciseFailed(
                _("{what}: the rows are reordered; keep the batch order "
                  "(pack_padded_sequence(..., enforce_sorted=False) takes unsorted batches)").format(what=what)
            )
        expect_tensor(padded, expected_padded, what=_("{what}'s padded tensor").format(what=what))
        if isinstance(got_lengths, torch.Tensor) and got_lengths.shape == expected_lengths.shape:
            if len(lengths) > 1 and torch.all(got_lengths == longest):
                raise ExerciseFailed(_("{what}: every length is the padded length {longest}: record len(seq) of each sequence before padding").format(
                    what=what, longest=longest))
            nonzero = (expected_padded != 0).sum(dim=1)
            if torch.equal(got_lengths.long(), nonzero) and not torch.equal(nonzero, expected_lengths):
                raise ExerciseFailed(
                    _("{what}: the lengths count the non-zero tokens, but 0 is a real token too (sequence 0 ends in one): "
                      "take each sequence's length before padding").format(what=what)
                )
        expect_tensor(got_lengths, expected_lengths, what=_("{what}'s lengths").format(what=what))
        expect_tensor(got_labels, expected_labels, what=_("{what}'s labels").format(what=what))


# ---- balanced_loader ----------------------------------------------------------------------------


def _imbalanced_labels(counts: dict[int, int], seed: int) -> torch.Tensor:
    """counts[c] samples of each class c, shuffled."""
    labels = torch.cat([torch.full((k,), c) for c, k in counts.items()])
    return labels[torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))]


# (samples per class, batch_size, seed): classes with gaps (3 and 6 absent in the first), from 24 samples down to 1, a tie
# (classes 4 and 5); the second case changes every parameter, so that no value can be hard-coded.
_BALANCED_CASES = [
    ({0: 24, 1: 9, 2: 2, 4: 4, 5: 4, 7: 6, 8: 3, 9: 2, 10: 6, 11: 1}, 8, 3),
    ({13: 2, 1: 11, 6: 1, 4: 5}, 5, 0),
]


def _drawn(loader: DataLoader, what: str) -> list[int]:
    """The dataset indices one epoch of loader yields (the dataset's items are (index, label))."""

    def one_epoch(loader):
        return [batch for batch in loader]

    batches = call(one_epoch, loader, name=_("one epoch of your loader"), shown="")
    drawn = []
    for batch in batches:
        if not isinstance(batch, (tuple, list)) or len(batch) != 2 or not isinstance(batch[0], torch.Tensor):
            raise ExerciseFailed(_("{what}: a batch is {got}, expected the default collation [indices, labels]").format(what=what, got=_a(batch)))
        drawn += batch[0].tolist()
    return drawn


@exercise("balanced_loader")
def check_balanced_loader(fn) -> None:
    for counts, batch_size, seed in _BALANCED_CASES:
        _check_balanced(fn, _imbalanced_labels(counts, seed=5), batch_size, seed)


def _check_balanced(fn, labels: torch.Tensor, batch_size: int, seed: int) -> None:
    n = len(labels)
    dataset = [(i, int(y)) for i, y in enumerate(labels)]
    described = _("dataset of {n} in {classes} classes").format(n=n, classes=len(labels.unique()))
    what = f"balanced_loader({described}, labels, batch_size={batch_size}, seed={seed})"
    shown = _("dataset of {n}").format(n=n) + f", labels, batch_size={batch_size}, seed={seed}"
    given = labels.clone()
    state = torch.random.get_rng_state()
    loader = call(fn, dataset, given, batch_size, seed, shown=shown)
    built_twice = call(fn, dataset, labels.clone(), batch_size, seed, shown=shown)
    global_rng_touched = not torch.equal(torch.random.get_rng_state(), state)
    if not isinstance(loader, DataLoader):
        raise ExerciseFailed(_("{what} returned {got}, expected a torch.utils.data.DataLoader").format(what=what, got=_a(loader)))
    if not torch.equal(given, labels):
        raise ExerciseFailed(_("{what} changed the labels it was given").format(what=what))
    if loader.dataset is not dataset:
        raise ExerciseFailed(_("{what}: the DataLoader does not wrap the dataset it was given").format(what=what))
    # A BatchSampler passed as batch_sampler= holds the batch size and the sampler instead of the loader.
    by_batch_sampler = loader.batch_size is None and loader.batch_sampler is not None
    expect_equal(getattr(loader.batch_sampler, "batch_size", None) if by_batch_sampler else loader.batch_size, batch_size,
                 what=_("{what}: its batch_size").format(what=what), returned=False)
    sampler = getattr(loader.batch_sampler, "sampler", None) if by_batch_sampler else loader.sampler
    if isinstance(sampler, RandomSampler):
        raise ExerciseFailed(_("{what}: its sampler is a RandomSampler (shuffle=True), which keeps the imbalance; use a WeightedRandomSampler").format(
            what=what))
    if not isinstance(sampler, WeightedRandomSampler):
        raise ExerciseFailed(_("{what}: its sampler is a {sampler_type}, expected a WeightedRandomSampler (pass sampler=...)").format(
            what=what, sampler_type=type_name(sampler)))
    weights = sampler.weights.double()
    counts = torch.bincount(labels).double()
    if weights.shape != (n,):
        if len(weights) == len(counts) or len(weights) == len(labels.unique()):
            raise ExerciseFailed(_("{what}: the sampler has {count} weights, one per class; it needs one per sample ({n})").format(
                what=what, count=len(weights), n=n))
        raise ExerciseFailed(_("{what}: the sampler has {count} weights, expected one per sample ({n})").format(what=what, count=len(weights), n=n))
    share = weights / weights.sum()
    expected = 1 / counts[labels]
    if torch.allclose(share, counts[labels] / counts[labels].sum()):
        raise ExerciseFailed(_("{what}: the weights grow with the class's count; a rare class needs a large weight").format(what=what))
    if torch.allclose(share, torch.full_like(share, 1 / n)):
        raise ExerciseFailed(_("{what}: every sample has the same weight, which keeps the imbalance").format(what=what))
    if not torch.allclose(share, expected / expected.sum()):
        i = int((share - expected / expected.sum()).abs().argmax())
        c = int(labels[i])
        raise ExerciseFailed(
            _("{what}: the weights do not give every class the same total: e.g. sample {index} (class {label}, {count} samples) "
              "gets {share:.4f} of the total, expected {expected:.4f}").format(
                what=what, index=i, label=c, count=int(counts[c]), share=share[i].item(), expected=(expected[i] / expected.sum()).item())
        )
    if not sampler.replacement:
        raise ExerciseFailed(_("{what}: replacement=False draws each sample at most once, so the rare classes run out: use replacement=True").format(
            what=what))
    if sampler.num_samples != n:
        raise ExerciseFailed(_("{what}: the sampler draws {count} samples per epoch; an epoch should draw len(labels) = {n}").format(
            what=what, count=sampler.num_samples, n=n))
    if global_rng_touched:
        raise ExerciseFailed(_("{what} changed torch's global random state (torch.manual_seed?): give the sampler a torch.Generator of its own").format(
            what=what))
    first, second = _drawn(loader, what), _drawn(built_twice, what)
    if len(first) != n:
        drops = getattr(loader.batch_sampler, "drop_last", False) if by_batch_sampler else loader.drop_last
        hint = _(": drop_last=True drops the last, smaller batch") if drops else ""
        raise ExerciseFailed(_("{what}: one epoch yielded {count} samples, expected {n}{hint}").format(what=what, count=len(first), n=n, hint=hint))
    if first != second:
        if sampler.generator is None and loader.generator is not None:
            raise ExerciseFailed(
                _("{what}: two loaders made with the same seed drew different samples: the DataLoader's generator does not "
                  "reach a sampler you pass in; give the WeightedRandomSampler the generator").format(what=what)
            )
        raise ExerciseFailed(_("{what}: two loaders made with the same seed drew different samples: "
                               "seed the sampler's own generator with seed").format(what=what))
    other = call(fn, dataset, labels.clone(), batch_size, seed + 1, shown=shown)
    if _drawn(other, what) == first:
        raise ExerciseFailed(_("{what}: seeds {seed} and {other_seed} drew the same samples: the draws must depend on seed").format(
            what=what, seed=seed, other_seed=seed + 1))


# ---- time_epoch ---------------------------------------------------------------------------------


class _Sleepy(Dataset):
    """n items (tensor(i)) that each take `delay` seconds to load; counts the reads and the time they took."""

    def __init__(self, n: int, delay: float):
        self.n, self.delay = n, delay
        self.reads = 0
        self.seconds = 0.0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        start = time.perf_counter()
        if self.delay:
            time.sleep(self.delay)
        self.reads += 1
        self.seconds += time.perf_counter() - start
        return torch.tensor(index)


class _SleepyStep:
    """A training step that takes `delay` seconds; records the batches it was given, the items the loader had read by then, and its time."""

    def __init__(self, delay: float, dataset: _Sleepy):
        self.delay, self.dataset = delay, dataset
        self.batches: list[list[int]] = []
        self.reads_before: list[int] = []  # dataset.reads when each call began
        self.seconds = 0.0

    def __call__(self, batch: Any) -> None:
        start = time.perf_counter()
        self.reads_before.append(self.dataset.reads)
        self.batches.append(batch.tolist() if isinstance(batch, torch.Tensor) else batch)
        time.sleep(self.delay)
        self.seconds += time.perf_counter() - start


def _within(got: float, truth: float, other: float) -> bool:
    """got measures truth, give or take timer noise: never much less, and at most a little more (never the other part)."""
    return truth * 0.97 - 0.002 <= got <= truth * 1.25 + 0.25 * other + 0.015


def _at_most(got: float, limit: float) -> bool:
    return got <= limit * 1.25 + 0.015


@exercise("time_epoch")
def check_time_epoch(fn) -> None:
    # A slow loader with a quick step, then a quick loader with a slow step: each fault shows in one of them.
    for n, item_delay, step_delay in ((7, 0.015, 0.002), (5, 0.0, 0.04)):
        dataset = _Sleepy(n, item_delay)
        step = _SleepyStep(step_delay, dataset)
        loader = DataLoader(dataset, batch_size=2)
        n_batches = math.ceil(n / 2)
        shown = _("loader of {n} batches").format(n=n_batches) + ", step"
        what = f"time_epoch({shown})"
        got = call(fn, loader, step, shown=shown)
        if not isinstance(got, (tuple, list)) or len(got) != 2:
            raise ExerciseFailed(_("{what} returned {got}: return the pair (load_seconds, step_seconds)").format(what=what, got=_a(got)))
        expected_batches = [list(range(i, min(i + 2, n))) for i in range(0, n, 2)]
        if dataset.reads > n:
            raise ExerciseFailed(_("{what} read {reads} items from a dataset of {n}: go through the loader once, one epoch").format(
                what=what, reads=dataset.reads, n=n))
        if step.batches != expected_batches:
            if len(step.batches) != len(expected_batches):
                raise ExerciseFailed(_("{what} called step {count} times, expected {expected}: once per batch, the last, smaller one too").format(
                    what=what, count=len(step.batches), expected=len(expected_batches)))
            raise ExerciseFailed(_("{what} called step with {got}, expected the loader's batches {expected}, in order").format(
                what=what, got=step.batches, expected=expected_batches))
        # Without workers, the loader reads a batch's items when it is asked for that batch: by step i, batches 0 to i only.
        ahead = next((i for i, reads in enumerate(step.reads_before) if reads > min(2 * (i + 1), n)), None)
        if ahead is not None:
            raise ExerciseFailed(
                _("{what}: when step(batch {batch}) began, the loader had already read {reads} of {n} items, later batches' "
                  "too: collecting the batches first (list(loader)) times a loop that never trains while it waits; take one batch, step on it, "
                  "then take the next").format(what=what, batch=ahead, reads=step.reads_before[ahead], n=n)
            )
        for value, name in zip(got, ("load_seconds", "step_seconds")):
            if isinstance(value, torch.Tensor):
                raise ExerciseFailed(_("{what}: {name} is a tensor, expected a Python float").format(what=what, name=name))
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise ExerciseFailed(_("{what}: {name} is {got}, expected a float (seconds)").format(what=what, name=name, got=_a(value)))
        load, stepping = float(got[0]), float(got[1])
        truth_load, truth_step = dataset.seconds, step.seconds
        ok_load, ok_step = _within(load, truth_load, truth_step), _within(stepping, truth_step, truth_load)
        if ok_load and ok_step:
            continue
        expected = _("expected about ({load:.3f}, {step:.3f}) s, got ({got_load:.4g}, {got_step:.4g})").format(
            load=truth_load, step=truth_step, got_load=load, got_step=stepping)
        if _within(load / 1000, truth_load, truth_step) and _within(stepping / 1000, truth_step, truth_load):
            raise ExerciseFailed(_("{what}: {expected}: milliseconds? return seconds").format(what=what, expected=expected))
        if _within(load, truth_step, truth_load) and _within(stepping, truth_load, truth_step):
            raise ExerciseFailed(_("{what}: {expected}: the two are swapped; return (load_seconds, step_seconds)").format(what=what, expected=expected))
        if _within(load * n_batches, truth_load, truth_step) or _within(stepping * n_batches, truth_step, truth_load):
            raise ExerciseFailed(_("{what}: {expected}: an average per batch? return the totals over the epoch").format(what=what, expected=expected))
        # Too much, but no more than both parts together: the excess can only be the other part's time.
        if not ok_load and load > truth_load and _at_most(load, truth_load + truth_step):
            raise ExerciseFailed(_("{what}: {expected}: the loading time includes time spent in step").format(what=what, expected=expected))
        if not ok_step and stepping > truth_step and _at_most(stepping, truth_step + truth_load):
            raise ExerciseFailed(_("{what}: {expected}: the step time includes time spent waiting for the loader").format(what=what, expected=expected))
        raise ExerciseFailed(_("{what}: {expected}").format(what=what, expected=expected))


# ---- parallel_loader ----------------------------------------------------------------------------


def _token_sequences(n: int) -> list[tuple[torch.Tensor, int]]:
    generator = torch.Generator().manual_seed(n)
    return [(torch.randint(0, 9, (1 + i % 5,), generator=generator), i % 11) for i in range(n)]


def _originals(case: str) -> DataLoader:
    """A loader as a learner would have it, built afresh with the same seeds each time.

    Its dataset and collate_fn are a list and a function of torch's, so that workers started by spawn
    (macOS, Windows) can unpickle them: this module is loaded afresh for every check, and pickle
    would not find its classes under their names.
    """
    if case == "shuffled":
        return DataLoader(list(range(100, 123)), batch_size=4, shuffle=True, drop_last=True, generator=torch.Generator().manual_seed(11))
    sampler = WeightedRandomSampler(torch.linspace(1, 3, 14), num_samples=14, generator=torch.Generator().manual_seed(12))
    return DataLoader(_token_sequences(14), batch_size=3, sampler=sampler, collate_fn=default_convert)


def _shut_down(loader: Any) -> None:
    """Stop a loader's persistent worker processes now, rather than whenever it is garbage-collected."""
    iterator = getattr(loader, "_iterator", None)  # private: the live iterator that owns the workers
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()


@contextlib.contextmanager
def _no_worker_count_warning() -> Iterator[None]:
    """DataLoader warns when workers outnumber this machine's cores; that is the machine's business, not the answer's."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="This DataLoader will create")
        yield


def _as_lists(value: Any) -> Any:
    """Batches as nested Python lists, to compare them whole."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [_as_lists(v) for v in value]
    return value


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _loader_facts(loader: DataLoader) -> tuple:
    """What a loader is made of, as ids of its parts and values of its settings."""
    return (id(loader.dataset), id(loader.sampler), id(loader.batch_sampler), id(loader.collate_fn), id(loader.generator),
            loader.batch_size, loader.drop_last, loader.num_workers, loader.persistent_workers)


def _epoch_of(loader: DataLoader, original: DataLoader, what: str) -> list:
    """One epoch of the learner's loader; an error, a worker's included, becomes one line."""
    try:
        return [batch for batch in loader]
    except Exception as err:  # noqa: BLE001 -- raised by torch for the loader the learner built
        text = str(err)
        lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
        hint = ""
        if loader.collate_fn is not original.collate_fn and "collate" in text:
            hint = _(": it batches with another collate_fn than the loader's")
        if text.startswith("Caught ") and len(lines) > 1:  # the worker's own error, at the end of its traceback
            message = _("{what}: one epoch of it raised in a worker process {error}{hint}").format(what=what, error=lines[-1], hint=hint)
        else:
            message = _("{what}: one epoch of it raised {error}: {message}{hint}").format(
                what=what, error=type(err).__name__, message=lines[0] if lines else _("(no message)"), hint=hint)
        raise ExerciseFailed(message) from None


def _check_parallel(fn, case: str, workers: int, run: bool) -> None:
    original, twin = _originals(case), _originals(case)
    facts = _loader_facts(original)
    shown = f"loader ({_(case)}), workers={workers}"
    what = f"parallel_loader({shown})"
    with _no_worker_count_warning():
        got = call(fn, original, workers, shown=shown)
    try:
        if got is original:
            raise ExerciseFailed(_("{what} returned the loader it was given: return a new DataLoader").format(what=what))
        if _loader_facts(original) != facts:
            raise ExerciseFailed(_("{what} changed the loader it was given: build a new DataLoader and leave that one as it is").format(what=what))
        if not isinstance(got, DataLoader):
            raise ExerciseFailed(_("{what} returned {got}, expected a torch.utils.data.DataLoader").format(what=what, got=_a(got)))
        if got.num_workers != workers:
            raise ExerciseFailed(_("{what}: num_workers is {got}, expected {expected}").format(what=what, got=got.num_workers, expected=workers))
        if not got.persistent_workers:
            raise ExerciseFailed(_("{what}: the workers stop after every epoch and restart at the next: "
                                   "keep them (persistent_workers=True)").format(what=what))
        if not run:
            return
        with _no_worker_count_warning():
            first = _epoch_of(got, original, what)
            _epoch_of(got, original, what)  # a second epoch runs on the same workers
        expected = [batch for batch in twin]
        if len(first) != len(expected):
            if len(first) == len(expected) + 1 and original.drop_last:
                raise ExerciseFailed(_("{what}: {count} batches, expected {expected}: the loader drops the last, smaller batch (drop_last)").format(
                    what=what, count=len(first), expected=len(expected)))
            raise ExerciseFailed(_("{what}: the first epoch has {count} batches, expected {expected}").format(
                what=what, count=len(first), expected=len(expected)))
        got_batches, expected_batches = _as_lists(first), _as_lists(expected)
        if got_batches != expected_batches:
            same_items = sorted(map(str, got_batches)) == sorted(map(str, expected_batches))
            if got.sampler is not original.sampler and isinstance(got.sampler, RandomSampler):
                raise ExerciseFailed(_("{what}: the first epoch comes in another order: shuffle=True makes a new sampler; keep the loader's").format(
                    what=what))
            uses_sampler = got.sampler is original.sampler or getattr(got.batch_sampler, "sampler", None) is original.sampler
            if uses_sampler and original.generator is not None and got.generator is not original.generator:
                raise ExerciseFailed(
                    _("{what}: the first epoch comes in another order: the loader draws a seed for its workers from its "
                      "generator before it shuffles, so the new loader needs the same generator").format(what=what)
                )
            if not uses_sampler and not same_items:
                raise ExerciseFailed(_("{what}: the first epoch's batches differ from the loader's: keep its sampler").format(what=what))
            i = next(i for i, (a, b) in enumerate(zip(got_batches, expected_batches)) if a != b)
            raise ExerciseFailed(_("{what}: batch {index} of the first epoch is {got}, expected {expected}").format(
                what=what, index=i, got=_short(got_batches[i]), expected=_short(expected_batches[i])))
    finally:
        _shut_down(got)


@exercise("parallel_loader")
def check_parallel_loader(fn) -> None:
    try:
        _check_parallel(fn, N_("shuffled"), workers=3, run=False)
        _check_parallel(fn, N_("shuffled"), workers=2, run=True)
        _check_parallel(fn, N_("weighted sampler, own collate_fn"), workers=1, run=True)  # 1: spawn starts each worker slowly
    finally:
        multiprocessing.active_children()  # reaps any worker that has exited
