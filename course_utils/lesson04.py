"""Lesson 04 (data: Dataset and DataLoader): reference solutions and the checks for its exercises."""

import math
import tempfile
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from PIL import Image
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Dataset, RandomSampler, Subset, WeightedRandomSampler, random_split
from torchvision.transforms import v2

from course_utils.tooling.checks import ExerciseFailed, call, exercise, expect_equal, expect_shape, expect_tensor, type_name, scoreboard_for

scoreboard = scoreboard_for(__name__)  # the lesson's last cell: this session's verdicts

# Reference solutions. The checks compare the learner's answers with these.


def count_batches(n: int, batch_size: int, drop_last: bool) -> int:
    """How many batches a DataLoader makes from n items."""
    return n // batch_size if drop_last else math.ceil(n / batch_size)


def read_item(root: Path, row) -> tuple[torch.Tensor, int]:
    """One row of labels.csv -> (float32 image (1, H, W) in [0, 1], int label)."""
    to_tensor = v2.Compose([v2.ToImage(), v2.ToDtype(torch.float32, scale=True)])
    with Image.open(root / row["filename"]) as file:
        image = to_tensor(file.convert("L"))
    return image, int(row["label"])


def pad_collate(batch: list[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[(sequence (L_i,), label), ...] -> (padded (B, L_max), lengths (B,), labels (B,)), padding with 0."""
    sequences, labels = zip(*batch)
    lengths = torch.tensor([len(s) for s in sequences])
    padded = pad_sequence(sequences, batch_first=True, padding_value=0)
    return padded, lengths, torch.tensor(labels)


def make_split(dataset: Dataset, fractions: Sequence[float], seed: int) -> tuple[Subset, Subset]:
    """(train, val) Subsets of dataset in the given fractions, the same for the same seed."""
    generator = torch.Generator().manual_seed(seed)
    train, val = random_split(dataset, fractions, generator=generator)
    return train, val


def class_weights_for(labels: torch.Tensor) -> torch.Tensor:
    """One weight per sample: 1 / (how many samples share its class)."""
    counts = torch.bincount(labels)
    return 1.0 / counts[labels].float()


def balanced_loader(dataset: Dataset, labels: torch.Tensor, batch_size: int, seed: int) -> DataLoader:
    """A DataLoader that draws every class equally often, via a seeded WeightedRandomSampler."""
    sampler = WeightedRandomSampler(
        class_weights_for(labels),
        num_samples=len(labels),
        replacement=True,
        generator=torch.Generator().manual_seed(seed),
    )
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler)


# Checks, one per exercise, in notebook order.


@exercise("count_batches")
def check_count_batches(fn) -> None:
    for n, batch_size in ((1438, 64), (10, 3), (128, 64), (5, 8)):
        for drop_last in (False, True):
            got = call(fn, n, batch_size, drop_last)
            expected = count_batches(n, batch_size, drop_last)
            what = f"count_batches({n}, {batch_size}, drop_last={drop_last})"
            if not isinstance(got, (int, float)) or isinstance(got, bool):
                expect_equal(got, expected, what=what)
            if isinstance(got, float) and got == expected:
                raise ExerciseFailed(f"{what} is the float {got!r}: a number of batches is an int; use // or math.ceil")
            if got == count_batches(n, batch_size, not drop_last) and got != expected:
                keep = "drops" if drop_last else "keeps"
                raise ExerciseFailed(f"{what}: expected {expected}, got {got}: drop_last={drop_last} {keep} the last, smaller batch")
            if not drop_last and n % batch_size == 0 and got == expected + 1:
                raise ExerciseFailed(f"{what}: expected {expected}, got {got}: {n} items fill exactly {expected} batches, with none left over")
            expect_equal(got, expected, what=what)


def _write_digits(root: Path) -> list[dict[str, str]]:
    """Two PNGs that are not the course's digits, so the check sees whether `root` is used."""
    (root / "images").mkdir()
    rows = []
    for i, (label, size) in enumerate(((3, (8, 8)), (7, (6, 5)))):
        pixels = np.random.default_rng(i).integers(0, 256, size=size[::-1], dtype=np.uint8)
        pixels[0, 0] = 255  # so that an unscaled image shows 255
        Image.fromarray(pixels).save(root / "images" / f"{i}.png")
        rows.append({"filename": f"images/{i}.png", "label": str(label), "split": "train"})
    return rows


@exercise("read_item")
def check_read_item(fn) -> None:
    import pandas as pd

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        rows = _write_digits(root)
        # As csv.DictReader gives it (label a str) and as a pandas row (label a numpy integer).
        cases = [rows[0], pd.DataFrame(rows).astype({"label": int}).iloc[1]]
        for row in cases:
            what = f"read_item(root, row {row['filename']!r})"
            got = call(fn, root, row, shown=f"root, row {row['filename']!r}")
            if not isinstance(got, (tuple, list)) or len(got) != 2:
                raise ExerciseFailed(f"{what} returned a {type_name(got)}: return a tuple (image, label)")
            image, label = got
            expected_image, expected_label = read_item(root, row)
            if isinstance(image, Image.Image):
                raise ExerciseFailed(f"{what}: the image is still a PIL image; convert it with v2.ToImage() and v2.ToDtype(...)")
            if isinstance(image, torch.Tensor):
                if image.dtype == torch.uint8:
                    raise ExerciseFailed(f"{what}: the image is uint8 with values 0-255: add v2.ToDtype(torch.float32, scale=True)")
                if image.is_floating_point() and image.max() > 1.5:
                    raise ExerciseFailed(f"{what}: pixel values go up to {image.max().item():.0f}: pass scale=True to ToDtype so they land in [0, 1]")
                if tuple(image.shape) == tuple(expected_image.shape[1:]):
                    raise ExerciseFailed(
                        f"{what}: the image has shape {tuple(image.shape)}, with no channel dimension: v2.ToImage() gives (1, H, W)"
                    )
            expect_tensor(image, expected_image, what=f"{what}'s image")
            if isinstance(label, str):
                raise ExerciseFailed(f"{what}: the label is the string {label!r}: convert it with int(row['label'])")
            if isinstance(label, np.integer):
                raise ExerciseFailed(f"{what}: the label is a {type(label).__name__}: convert it with int(row['label'])")
            expect_equal(label, expected_label, what=f"{what}'s label")


def _sequences(lengths: Sequence[int], seed: int) -> list[tuple[torch.Tensor, int]]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randint(1, 10, (n,), generator=generator), i % 3) for i, n in enumerate(lengths)]


@exercise("pad_collate")
def check_pad_collate(fn) -> None:
    # Batch sizes differ from the longest length, so a transposed result shows in its shape.
    for lengths, seed in (((3, 6, 1, 4), 0), ((5, 2, 2), 1), ((2,), 2)):
        batch = _sequences(lengths, seed)
        what = f"pad_collate(batch of sequences with lengths {list(lengths)})"
        got = call(fn, [(s.clone(), y) for s, y in batch], shown=f"batch of sequences with lengths {list(lengths)}")
        if not isinstance(got, (tuple, list)):
            raise ExerciseFailed(f"{what} returned a {type_name(got)}: return a tuple (padded, lengths, labels)")
        if len(got) != 3:
            missing = ": the lengths are missing" if len(got) == 2 else ""
            raise ExerciseFailed(f"{what} returned {len(got)} things, expected 3: (padded, lengths, labels){missing}")
        padded, got_lengths, labels = got
        expected_padded, expected_lengths, expected_labels = pad_collate(batch)
        batch_size, longest = expected_padded.shape
        if isinstance(padded, torch.Tensor) and tuple(padded.shape) == (longest, batch_size) and batch_size != longest:
            raise ExerciseFailed(f"{what}: padded has shape {tuple(padded.shape)}, time first: pass batch_first=True to pad_sequence")
        expect_shape(padded, expected_padded.shape, what=f"{what}'s padded tensor")
        real = torch.arange(longest)[None, :] < expected_lengths[:, None]
        if torch.equal(padded[real], expected_padded[real]) and not torch.equal(padded[~real], expected_padded[~real]):
            value = padded[~real][0].item()
            raise ExerciseFailed(f"{what}: the padding positions hold {value}, expected 0: use padding_value=0")
        rows = sorted(map(tuple, expected_padded.tolist()))
        if not torch.equal(padded, expected_padded) and sorted(map(tuple, padded.tolist())) == rows:
            raise ExerciseFailed(
                f"{what}: the rows are reordered; keep the batch order (pack_padded_sequence(..., enforce_sorted=False) takes unsorted batches)"
            )
        expect_tensor(padded, expected_padded, what=f"{what}'s padded tensor")
        if isinstance(got_lengths, torch.Tensor) and got_lengths.shape == expected_lengths.shape and len(lengths) > 1:
            if torch.all(got_lengths == longest):
                raise ExerciseFailed(f"{what}: every length is the padded length {longest}: record len(seq) of each sequence before padding")
        expect_tensor(got_lengths, expected_lengths, what=f"{what}'s lengths")
        expect_tensor(labels, expected_labels, what=f"{what}'s labels")


def _indices(split: Any) -> list[int] | None:
    return list(split.indices) if isinstance(split, Subset) else None


@exercise("make_split")
def check_make_split(fn) -> None:
    for n, fractions, seed in ((50, (0.8, 0.2), 0), (7, (0.7, 0.3), 3), (20, (0.5, 0.5), 11)):
        dataset = list(range(100, 100 + n))
        what = f"make_split(dataset of {n}, {fractions}, seed={seed})"
        torch.manual_seed(1234)
        state = torch.random.get_rng_state()
        got = call(fn, dataset, fractions, seed, shown=f"dataset of {n}, {fractions}, seed={seed}")
        global_rng_touched = not torch.equal(torch.random.get_rng_state(), state)
        if not isinstance(got, (tuple, list)) or len(got) != 2:
            raise ExerciseFailed(f"{what} returned a {type_name(got)}: return the pair (train, val)")
        if _indices(got[0]) is None or _indices(got[1]) is None:
            kinds = ", ".join(type_name(g) for g in got)
            raise ExerciseFailed(f"{what} returned ({kinds}), expected two torch.utils.data.Subset, as random_split gives")
        expected = make_split(dataset, fractions, seed)
        sizes, expected_sizes = [len(g) for g in got], [len(e) for e in expected]
        if sizes != expected_sizes:
            if sizes == expected_sizes[::-1]:
                hint = ": swapped? return (train, val) in the order of fractions"
            elif sum(sizes) == n:
                hint = ": pass the fractions to random_split as they are; it turns them into sizes itself"
            else:
                hint = ""
            raise ExerciseFailed(f"{what}: expected sizes {expected_sizes}, got {sizes}{hint}")
        again = call(fn, dataset, fractions, seed, shown=f"dataset of {n}, {fractions}, seed={seed}")
        if [_indices(g) for g in got] != [_indices(g) for g in again]:
            raise ExerciseFailed(
                f"{what}: two calls with the same seed gave different splits: pass generator=torch.Generator().manual_seed(seed) to random_split"
            )
        if global_rng_touched:
            raise ExerciseFailed(
                f"{what} changed torch's global random state (torch.manual_seed?): give random_split a generator of its own instead"
            )
        if [_indices(g) for g in got] != [_indices(e) for e in expected]:
            raise ExerciseFailed(
                f"{what}: not the split random_split(dataset, fractions, generator=torch.Generator().manual_seed(seed)) makes"
            )
        if [got[0][i] for i in range(len(got[0]))] != [dataset[i] for i in got[0].indices]:
            raise ExerciseFailed(f"{what}: the train Subset does not index the dataset it was given")


@exercise("class_weights_for")
def check_class_weights_for(fn) -> None:
    generator = torch.Generator().manual_seed(4)
    cases = [
        torch.tensor([0, 0, 0, 1, 2, 2]),
        torch.tensor([3, 1, 1, 3, 3, 3, 1]),  # classes 0 and 2 absent
        torch.randint(0, 10, (200,), generator=generator) % torch.tensor([10, 3]).repeat(100),  # imbalanced
    ]
    for labels in cases:
        what = f"class_weights_for(labels {labels.tolist()[:8]}{'...' if len(labels) > 8 else ''})"
        got = call(fn, labels.clone())
        expected = class_weights_for(labels)
        if isinstance(got, torch.Tensor) and got.ndim == 1 and len(got) != len(labels) and len(got) <= labels.max() + 1:
            raise ExerciseFailed(
                f"{what}: got {len(got)} weights, one per class; WeightedRandomSampler needs one per sample: index them with [labels]"
            )
        expect_shape(got, expected.shape, what=what)
        if not got.is_floating_point():
            raise ExerciseFailed(f"{what}: got dtype {got.dtype}: weights are fractions; use true division 1 / count, not //")
        # Any constant multiple samples the same, so compare shares of the total.
        share, expected_share = got.double() / got.double().sum(), expected.double() / expected.double().sum()
        counts = torch.bincount(labels)[labels].double()
        if torch.allclose(share, counts / counts.sum()):
            raise ExerciseFailed(f"{what}: the weights grow with the class count; a rare class needs a large weight: use 1 / count")
        if torch.allclose(share, torch.full_like(share, 1 / len(labels))):
            raise ExerciseFailed(f"{what}: every sample got the same weight; weigh each by 1 / (count of its class)")
        expect_tensor(share, expected_share, what=f"{what}, as shares of the total", check_dtype=False)


@exercise("balanced_loader")
def check_balanced_loader(fn) -> None:
    generator = torch.Generator().manual_seed(5)
    labels = torch.cat([torch.zeros(40, dtype=torch.long), torch.ones(8, dtype=torch.long), torch.full((2,), 2)])
    labels = labels[torch.randperm(len(labels), generator=generator)]
    dataset = list(zip(torch.arange(len(labels)).tolist(), labels.tolist()))
    what = "balanced_loader(dataset of 50 with classes 40/8/2, labels, batch_size=8, seed=0)"
    shown = "dataset of 50, labels, batch_size=8, seed=0"
    loader = call(fn, dataset, labels.clone(), 8, 0, shown=shown)
    if not isinstance(loader, DataLoader):
        raise ExerciseFailed(f"{what} returned a {type_name(loader)}, expected a torch.utils.data.DataLoader")
    if loader.dataset is not dataset:
        raise ExerciseFailed(f"{what}: the DataLoader does not wrap the dataset it was given")
    expect_equal(loader.batch_size, 8, what=f"{what}: its batch_size")
    sampler = loader.sampler
    if isinstance(sampler, RandomSampler):
        raise ExerciseFailed(f"{what}: its sampler is a RandomSampler (shuffle=True); pass sampler=WeightedRandomSampler(...) instead")
    if not isinstance(sampler, WeightedRandomSampler):
        raise ExerciseFailed(f"{what}: its sampler is a {type(sampler).__name__}, expected a WeightedRandomSampler (pass sampler=...)")
    if not sampler.replacement:
        raise ExerciseFailed(f"{what}: replacement=False draws each sample at most once, so the rare classes run out: use replacement=True")
    if sampler.num_samples != len(labels):
        raise ExerciseFailed(f"{what}: num_samples is {sampler.num_samples}; one epoch should draw len(dataset) = {len(labels)} samples")
    expected = class_weights_for(labels).double()
    weights = sampler.weights.double()
    if weights.shape != expected.shape or not torch.allclose(weights / weights.sum(), expected / expected.sum()):
        raise ExerciseFailed(f"{what}: the sampler's weights are not 1 / (count of each sample's class); use class_weights_for(labels)")
    second = call(fn, dataset, labels.clone(), 8, 0, shown=shown)
    if list(loader.sampler) != list(second.sampler):
        raise ExerciseFailed(
            f"{what}: two loaders made with the same seed drew different samples: give the sampler generator=torch.Generator().manual_seed(seed)"
        )
