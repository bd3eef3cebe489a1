"""Lesson 04's checks against the reference solutions and the wrong answers learners write."""

import math

import numpy as np
import pytest
import torch
from PIL import Image
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, WeightedRandomSampler, random_split
from torchvision.transforms import v2

from course_utils import lesson04 as L
from course_utils.data import data_dir
from lesson_contract import assert_names_fault, contract_tests

PAIRS = [
    (L.check_count_batches, L.count_batches),
    (L.check_read_item, L.read_item),
    (L.check_pad_collate, L.pad_collate),
    (L.check_make_split, L.make_split),
    (L.check_class_weights_for, L.class_weights_for),
    (L.check_balanced_loader, L.balanced_loader),
]

(test_reference_passes, test_stub_is_not_attempted, test_bad_input_is_one_named_line, test_hostile_answers_are_the_learners_fault,
 test_checks_leave_the_learners_random_state_alone, test_checks_are_quick) = contract_tests(PAIRS)


# Typical wrong answers, written as learners write them.


def read_uint8(root, row):
    return v2.ToImage()(Image.open(root / row["filename"])), int(row["label"])


def read_unscaled(root, row):
    return v2.ToDtype(torch.float32)(v2.ToImage()(Image.open(root / row["filename"]))), int(row["label"])


def read_no_channel(root, row):
    return torch.from_numpy(np.array(Image.open(root / row["filename"]))).float() / 255, int(row["label"])


def read_str_label(root, row):
    return L.read_item(root, row)[0], row["label"]


def read_ignores_root(root, row):
    return L.read_item(data_dir() / "digits", {"filename": "images/0000.png", "label": row["label"]})


def read_pil(root, row):
    return Image.open(root / row["filename"]), int(row["label"])


def read_numpy(root, row):
    return np.array(Image.open(root / row["filename"])), int(row["label"])


def collate_time_first(batch):
    seqs, labels = zip(*batch)
    return pad_sequence(seqs), torch.tensor([len(s) for s in seqs]), torch.tensor(labels)


def collate_no_lengths(batch):
    seqs, labels = zip(*batch)
    return pad_sequence(seqs, batch_first=True), torch.tensor(labels)


def collate_pad_minus_one(batch):
    seqs, labels = zip(*batch)
    return pad_sequence(seqs, batch_first=True, padding_value=-1), torch.tensor([len(s) for s in seqs]), torch.tensor(labels)


def collate_padded_lengths(batch):
    seqs, labels = zip(*batch)
    padded = pad_sequence(seqs, batch_first=True)
    return padded, torch.tensor([len(p) for p in padded]), torch.tensor(labels)


def collate_sorted(batch):
    batch = sorted(batch, key=lambda item: -len(item[0]))
    return L.pad_collate(batch)


def collate_list_lengths(batch):
    padded, lengths, labels = L.pad_collate(batch)
    return padded, lengths.tolist(), labels


def split_unseeded(dataset, fractions, seed):
    train, val = random_split(dataset, fractions)
    return train, val


def split_global_seed(dataset, fractions, seed):
    torch.manual_seed(seed)
    train, val = random_split(dataset, fractions)
    return train, val


def split_swapped(dataset, fractions, seed):
    train, val = L.make_split(dataset, fractions, seed)
    return val, train


def split_own_sizes(dataset, fractions, seed):
    n_train = int(fractions[0] * len(dataset))
    return random_split(dataset, [n_train, len(dataset) - n_train], generator=torch.Generator().manual_seed(seed))


def split_indices(dataset, fractions, seed):
    train, val = L.make_split(dataset, fractions, seed)
    return train.indices, val.indices


def split_other_seed(dataset, fractions, seed):
    return L.make_split(dataset, fractions, seed + 1)


def loader_with(**sampler_kwargs):
    def balanced_loader(dataset, labels, batch_size, seed):
        kwargs = {"num_samples": len(labels), "replacement": True, "generator": torch.Generator().manual_seed(seed)} | sampler_kwargs
        sampler = WeightedRandomSampler(L.class_weights_for(labels), **kwargs)
        return DataLoader(dataset, batch_size=batch_size, sampler=sampler)

    return balanced_loader


def loader_shuffled(dataset, labels, batch_size, seed):
    return DataLoader(dataset, batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(seed))


def loader_sampler_and_shuffle(dataset, labels, batch_size, seed):
    sampler = WeightedRandomSampler(L.class_weights_for(labels), len(labels))
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, shuffle=True)


def loader_class_counts_as_weights(dataset, labels, batch_size, seed):
    weights = torch.bincount(labels)[labels].float()
    sampler = WeightedRandomSampler(weights, len(labels), generator=torch.Generator().manual_seed(seed))
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler)


WRONG = [
    (L.check_count_batches, lambda n, b, drop_last: math.ceil(n / b) if drop_last else n // b, "drop_last=False keeps the last"),
    (L.check_count_batches, lambda n, b, drop_last: n // b, "drop_last=False keeps the last"),
    (L.check_count_batches, lambda n, b, drop_last: n // b if drop_last else n // b + 1, "fill exactly 2 batches"),
    (L.check_count_batches, lambda n, b, drop_last: n // b if drop_last else n / b, r"is a float \(22\.46875\), expected an int"),
    (L.check_count_batches, lambda n, b, drop_last: float(L.count_batches(n, b, drop_last)), "is the float 23.0"),
    (L.check_count_batches, lambda n, b, drop_last: torch.tensor(L.count_batches(n, b, drop_last)), r"call \.item\(\)"),
    (L.check_count_batches, lambda n, b, drop_last: -(-n // b) if not drop_last else n // b, None),  # a correct alternative
    (L.check_read_item, read_uint8, "uint8 with values 0-255: add v2.ToDtype"),
    (L.check_read_item, read_unscaled, "pass scale=True"),
    (L.check_read_item, read_no_channel, r"no channel dimension: v2.ToImage\(\) gives \(1, H, W\)"),
    (L.check_read_item, read_str_label, "the label is the string '3'"),
    (L.check_read_item, read_pil, "still a PIL image"),
    (L.check_read_item, read_numpy, "numpy.ndarray"),
    (L.check_read_item, lambda root, row: L.read_item(root, {"filename": row["filename"] + ".jpg"}), r"^read_item: <lambda>\(root, row 'images/0.png'\) raised FileNotFoundError"),
    (L.check_read_item, lambda root, row: (L.read_item(root, row)[0], int(row["label"]) if isinstance(row, dict) else 1 / 0), r"<lambda>\(root, row 'images/1.png'\) raised ZeroDivisionError"),
    (L.check_read_item, lambda root, row: L.read_item(root, row)[0], "return a tuple"),
    (L.check_read_item, read_ignores_root, "wrong values"),
    (L.check_pad_collate, lambda batch: torch.stack([s for s, _ in batch]), r"\(batch of sequences with lengths \[3, 6, 1, 4\]\) raised RuntimeError: stack expects"),
    (L.check_pad_collate, collate_time_first, "time first: pass batch_first=True"),
    (L.check_pad_collate, collate_no_lengths, "the lengths are missing"),
    (L.check_pad_collate, collate_pad_minus_one, "padding positions hold -1, expected 0"),
    (L.check_pad_collate, collate_padded_lengths, "every length is the padded length"),
    (L.check_pad_collate, collate_sorted, "rows are reordered"),
    (L.check_pad_collate, collate_list_lengths, "lengths is a list"),
    (L.check_pad_collate, lambda batch: L.pad_collate(batch)[0], "returned a torch.Tensor: return a tuple"),
    (L.check_make_split, split_unseeded, "different splits: pass generator="),
    (L.check_make_split, split_global_seed, "changed torch's global random state"),
    (L.check_make_split, split_swapped, "swapped"),
    (L.check_make_split, split_own_sizes, "pass the fractions to random_split as they are"),
    (L.check_make_split, split_indices, "expected two torch.utils.data.Subset"),
    (L.check_make_split, split_other_seed, "not the split random_split"),
    (L.check_class_weights_for, lambda labels: 1.0 / torch.bincount(labels).float(), "one per class"),
    (L.check_class_weights_for, lambda labels: torch.bincount(labels)[labels].float(), "grow with the class count"),
    (L.check_class_weights_for, lambda labels: 1 // torch.bincount(labels)[labels], "true division"),
    (L.check_class_weights_for, lambda labels: torch.ones(len(labels)), "every sample got the same weight"),
    (L.check_class_weights_for, lambda labels: (1.0 / torch.bincount(labels).float())[labels] * 7, None),  # scale does not matter
    (L.check_class_weights_for, lambda labels: 1.0 / torch.unique(labels, return_counts=True)[1][labels].float(), "raised IndexError|wrong values|one per class"),
    (L.check_balanced_loader, loader_shuffled, "RandomSampler"),
    (L.check_balanced_loader, loader_with(replacement=False), "use replacement=True"),
    (L.check_balanced_loader, loader_with(num_samples=10), "num_samples is 10"),
    (L.check_balanced_loader, loader_with(generator=None), "same seed drew different samples"),
    (L.check_balanced_loader, loader_sampler_and_shuffle, "mutually exclusive with shuffle"),
    (L.check_balanced_loader, loader_class_counts_as_weights, "weights are not 1 / "),
    (L.check_balanced_loader, lambda dataset, labels, batch_size, seed: L.balanced_loader(dataset, labels, 4, seed), "batch_size: expected 8, got 4"),
    (L.check_balanced_loader, lambda dataset, labels, batch_size, seed: L.balanced_loader(dataset, labels, batch_size, seed).sampler, "expected a torch.utils.data.DataLoader"),
]


@pytest.mark.parametrize("check, wrong, message", WRONG)
def test_wrong_answers_name_the_fault(check, wrong, message):
    assert_names_fault(check, wrong, message)


def test_read_item_reads_the_shipped_digits():
    """The reference on a real row: the same pixels as load_digits, scaled to [0, 1]."""
    from course_utils.data import digits_rows, load_digits

    image, label = L.read_item(data_dir() / "digits", digits_rows()[5])
    images, labels = load_digits()
    assert image.shape == (1, 8, 8) and image.dtype == torch.float32
    assert torch.equal((image * 255).round().to(torch.uint8), images[5])
    assert label == labels[5].item() and type(label) is int
