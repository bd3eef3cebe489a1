"""Lesson 04's checks against the reference solutions, correct alternatives, and the wrong answers learners write."""

import collections
import copy
import functools
import multiprocessing
import operator
import os
import sys
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import BatchSampler, DataLoader, Dataset, Subset, WeightedRandomSampler, random_split
from torchvision.datasets import ImageFolder
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as TF

from course_utils import lesson04 as L
from course_utils.data import data_dir
from lesson_contract import assert_names_fault, assert_passes, contract_tests

PAIRS = [
    (L.check_read_item, L.read_item),
    (L.check_smoothed_targets, L.smoothed_targets),
    (L.check_folder_dataset, L.folder_dataset),
    (L.check_split_train_val, L.split_train_val),
    (L.check_pad_collate, L.pad_collate),
    (L.check_balanced_loader, L.balanced_loader),
    (L.check_time_epoch, L.time_epoch),
    (L.check_parallel_loader, L.parallel_loader),
]

(test_reference_passes, test_stub_is_not_attempted, test_bad_input_is_one_named_line, test_hostile_answers_are_the_learners_fault,
 test_checks_leave_the_learners_random_state_alone, test_checks_are_quick) = contract_tests(PAIRS)

NOTEBOOK_FOLDER = __import__("pathlib").Path(__import__("tempfile").mkdtemp()) / "notebook-digits"  # filled below, as the notebook's
for _digit in range(10):
    (NOTEBOOK_FOLDER / str(_digit)).mkdir(parents=True)
    Image.fromarray(np.full((8, 8), 20 * _digit, dtype=np.uint8)).save(NOTEBOOK_FOLDER / str(_digit) / "0.png")

TO_FLOAT = v2.Compose([v2.ToImage(), v2.ToDtype(torch.float32, scale=True)])
TO_GRAY = v2.Compose([v2.ToImage(), v2.Grayscale(), v2.ToDtype(torch.float32, scale=True)])


# ---- read_item ------------------------------------------------------------------------------------


def read_numpy_route(root, row):
    with Image.open(root / row["filename"]) as file:
        pixels = np.array(file.convert("L"), dtype=np.float32) / 255
    return torch.from_numpy(pixels).unsqueeze(0), int(row["label"])


def read_functional(root, row):
    image = Image.open(root / row["filename"]).convert("L")
    return TF.to_dtype(TF.to_image(image), torch.float32, scale=True), int(row["label"])


def read_grayscale_transform(root, row):
    return TO_GRAY(Image.open(root / row["filename"])), int(row["label"])


def read_pil_to_tensor(root, row):
    image = v2.PILToTensor()(Image.open(str(root) + "/" + row["filename"]).convert("L"))
    return image.float().div(255), int(str(row["label"]))


def read_uint8(root, row):
    return v2.ToImage()(Image.open(root / row["filename"]).convert("L")), int(row["label"])


def read_unscaled(root, row):
    return v2.ToDtype(torch.float32)(v2.ToImage()(Image.open(root / row["filename"]).convert("L"))), int(row["label"])


def read_no_channel(root, row):
    return torch.from_numpy(np.array(Image.open(root / row["filename"]).convert("L"))).float() / 255, int(row["label"])


def read_without_convert(root, row):
    return TO_FLOAT(Image.open(root / row["filename"])), int(row["label"])


def read_str_label(root, row):
    return L.read_item(root, row)[0], row["label"]


def read_raw_label(root, row):
    label = row["label"]
    return L.read_item(root, row)[0], label if not isinstance(label, str) else int(label)


def read_float64(root, row):
    pixels = np.array(Image.open(root / row["filename"]).convert("L")) / 255
    return torch.from_numpy(pixels).unsqueeze(0), int(row["label"])


def read_ignores_root(root, row):
    return L.read_item(data_dir() / "digits", {"filename": "images/0000.png", "label": row["label"]})


def read_changes_row(root, row):
    row["label"] = int(row["label"])
    return L.read_item(root, row)


def read_pil(root, row):
    return Image.open(root / row["filename"]), int(row["label"])


def read_numpy(root, row):
    return np.array(Image.open(root / row["filename"]).convert("L")), int(row["label"])


def read_label_tensor(root, row):
    return L.read_item(root, row)[0], torch.tensor(int(row["label"]))


# ---- smoothed_targets -----------------------------------------------------------------------------


def smooth_one_hot(labels, num_classes, smoothing):
    return F.one_hot(labels, num_classes).float() * (1 - smoothing) + smoothing / num_classes


def smooth_scatter_add(labels, num_classes, smoothing):
    rows = torch.full((labels.numel(), num_classes), smoothing / num_classes)
    return rows.scatter_add_(1, labels.view(-1, 1), torch.full((labels.numel(), 1), 1.0 - smoothing))


def smooth_loop(labels, num_classes, smoothing):
    rows = []
    for label in labels.tolist():
        row = torch.full((num_classes,), smoothing / num_classes)
        row[label] += 1 - smoothing
        rows.append(row)
    return torch.stack(rows)


def smooth_where(labels, num_classes, smoothing):
    hit = torch.arange(num_classes)[None, :] == labels[:, None]
    return torch.where(hit, 1 - smoothing + smoothing / num_classes, smoothing / num_classes).float()


def smooth_other_classes(labels, num_classes, smoothing):
    rows = torch.full((len(labels), num_classes), smoothing / (num_classes - 1))
    return rows.scatter_(1, labels[:, None], 1 - smoothing)


def smooth_missing_share(labels, num_classes, smoothing):
    rows = torch.full((len(labels), num_classes), smoothing / num_classes)
    return rows.scatter_(1, labels[:, None], 1 - smoothing)


def smooth_true_is_one(labels, num_classes, smoothing):
    return torch.full((len(labels), num_classes), smoothing / num_classes).scatter_(1, labels[:, None], 1.0)


def smooth_forgotten(labels, num_classes, smoothing):
    return torch.zeros(len(labels), num_classes).scatter_(1, labels[:, None], 1.0)


def smooth_guessed_classes(labels, num_classes, smoothing):
    return F.one_hot(labels).float() * (1 - smoothing) + smoothing / num_classes


def smooth_ten_classes(labels, num_classes, smoothing):
    return L.smoothed_targets(labels, 10, smoothing)


def smooth_unsqueeze_in_place(labels, num_classes, smoothing):
    index = labels.unsqueeze_(1)
    return torch.full((len(index), num_classes), smoothing / num_classes).scatter_(1, index, 1 - smoothing + smoothing / num_classes)


def smooth_no_unsqueeze(labels, num_classes, smoothing):
    return torch.full((len(labels), num_classes), smoothing / num_classes).scatter_(1, labels, 1 - smoothing + smoothing / num_classes)


def smooth_along_dim_0(labels, num_classes, smoothing):
    return torch.full((len(labels), num_classes), smoothing / num_classes).scatter_(0, labels[:, None], 1 - smoothing + smoothing / num_classes)


def smooth_integer_rows(labels, num_classes, smoothing):
    return torch.zeros(len(labels), num_classes, dtype=labels.dtype).scatter_(1, labels[:, None], 1)


def smooth_float64(labels, num_classes, smoothing):
    return L.smoothed_targets(labels, num_classes, smoothing).double()


# ---- folder_dataset -------------------------------------------------------------------------------


class NumberedFolder(ImageFolder):
    """Class folders sorted by their number, so the class index is the number itself."""

    def find_classes(self, directory):
        names = sorted((entry.name for entry in os.scandir(directory) if entry.is_dir()), key=int)
        return names, {name: int(name) for name in names}


def folder_subclass(root):
    return NumberedFolder(root, transform=TO_GRAY)


def folder_lambda(root):
    dataset = ImageFolder(root, transform=TO_GRAY)
    dataset.target_transform = lambda index: int(dataset.classes[index])
    return dataset


def gray_loader(path):
    with Image.open(path) as file:
        return file.convert("L")


def folder_loader_and_dict(root):
    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    number = {i: int(name) for i, name in enumerate(classes)}
    return ImageFolder(str(root), loader=gray_loader, transform=TO_FLOAT, target_transform=number.get)


def folder_grayscale_last(root):
    dataset = ImageFolder(root, transform=v2.Compose([v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.Grayscale()]))
    inverse = {index: int(name) for name, index in dataset.class_to_idx.items()}
    dataset.target_transform = inverse.__getitem__
    return dataset


def folder_partial(root):
    dataset = ImageFolder(root, transform=v2.Compose([v2.ToImage(), v2.Grayscale(), v2.ToDtype(torch.float32, scale=True)]))
    dataset.target_transform = functools.partial(operator.getitem, [int(name) for name in dataset.classes])
    return dataset


def folder_nested_function(root):
    dataset = ImageFolder(root, transform=TO_GRAY)

    def number(index):
        return int(dataset.classes[index])

    dataset.target_transform = number
    return dataset


def _in_notebook(function):
    """The function as if a notebook cell had defined it: named in __main__."""
    function.__module__, function.__qualname__ = "__main__", function.__name__
    setattr(sys.modules["__main__"], function.__name__, function)
    return function


@_in_notebook
def number_of_folder(index):
    return int(sorted(str(n) for n in range(12))[index])


def folder_notebook_function(root):
    return ImageFolder(root, transform=TO_GRAY, target_transform=number_of_folder)


def folder_index_labels(root):
    return ImageFolder(root, transform=TO_GRAY)


def folder_rgb(root):
    return ImageFolder(root, transform=TO_FLOAT, target_transform=L.folder_dataset(root).target_transform)


def folder_pil(root):
    return ImageFolder(root, target_transform=L.folder_dataset(root).target_transform)


def folder_uint8(root):
    return ImageFolder(root, transform=v2.Compose([v2.ToImage(), v2.Grayscale()]), target_transform=L.folder_dataset(root).target_transform)


def folder_unscaled(root):
    to_gray = v2.Compose([v2.ToImage(), v2.Grayscale(), v2.ToDtype(torch.float32)])
    return ImageFolder(root, transform=to_gray, target_transform=L.folder_dataset(root).target_transform)


def folder_red_channel(root):
    return ImageFolder(root, transform=lambda image: TO_FLOAT(image)[:1], target_transform=L.folder_dataset(root).target_transform)


def folder_label_tensor(root):
    dataset = L.folder_dataset(root)
    number = dataset.target_transform
    dataset.target_transform = lambda index: torch.tensor(number(index))
    return dataset


def folder_float64(root):
    to_gray = v2.Compose([v2.ToImage(), v2.Grayscale(), v2.ToDtype(torch.float64, scale=True)])
    return ImageFolder(root, transform=to_gray, target_transform=L.folder_dataset(root).target_transform)


def folder_notebook_global(root):
    return L.folder_dataset(NOTEBOOK_FOLDER)  # the notebook's folder, not the argument


class OwnFolder(Dataset):
    def __init__(self, root):
        self.files = sorted(root.glob("*/*.png"))

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        return TO_GRAY(Image.open(self.files[i])), int(self.files[i].parent.name)


def folder_plus_one(root):
    dataset = L.folder_dataset(root)
    number = dataset.target_transform
    dataset.target_transform = lambda index: number(index) + 1
    return dataset


# ---- split_train_val ------------------------------------------------------------------------------


def split_random_split_twice(make_dataset, val_fraction, seed, train_transform, val_transform):
    fractions = [1 - val_fraction, val_fraction]
    train, _ = random_split(make_dataset(transform=train_transform), fractions, generator=torch.Generator().manual_seed(seed))
    _, val = random_split(make_dataset(transform=val_transform), fractions, generator=torch.Generator().manual_seed(seed))
    return train, val


def split_indices_then_subsets(make_dataset, val_fraction, seed, train_transform, val_transform):
    train_ds, val_ds = make_dataset(train_transform), make_dataset(val_transform)
    n_val = int(val_fraction * len(train_ds))
    train_idx, val_idx = random_split(range(len(train_ds)), [len(train_ds) - n_val, n_val], generator=torch.Generator().manual_seed(seed))
    return Subset(train_ds, list(train_idx)), Subset(val_ds, list(val_idx))


def split_deepcopy(make_dataset, val_fraction, seed, train_transform, val_transform):
    dataset = make_dataset()
    train, val = random_split(dataset, [1 - val_fraction, val_fraction], generator=torch.Generator().manual_seed(seed))
    train_copy, val_copy = copy.copy(dataset), copy.copy(dataset)
    train_copy.transform, val_copy.transform = train_transform, val_transform
    return Subset(train_copy, train.indices), Subset(val_copy, val.indices)


class Transformed(Dataset):
    def __init__(self, part, transform):
        self.part, self.transform = part, transform

    def __len__(self):
        return len(self.part)

    def __getitem__(self, i):
        image, label = self.part[i]
        return self.transform(image), label


def split_wrapper(make_dataset, val_fraction, seed, train_transform, val_transform):
    train, val = random_split(make_dataset(), [1 - val_fraction, val_fraction], generator=torch.Generator().manual_seed(seed))
    return Transformed(train, train_transform), Transformed(val, val_transform)


def split_shared_dataset(make_dataset, val_fraction, seed, train_transform, val_transform):
    train, val = random_split(make_dataset(), [1 - val_fraction, val_fraction], generator=torch.Generator().manual_seed(seed))
    train.dataset.transform = train_transform
    val.dataset.transform = val_transform
    return train, val


def split_train_only(make_dataset, val_fraction, seed, train_transform, val_transform):
    dataset = make_dataset(transform=train_transform)
    return tuple(random_split(dataset, [1 - val_fraction, val_fraction], generator=torch.Generator().manual_seed(seed)))


def split_untransformed(make_dataset, val_fraction, seed, train_transform, val_transform):
    return tuple(random_split(make_dataset(), [1 - val_fraction, val_fraction], generator=torch.Generator().manual_seed(seed)))


def split_unseeded(make_dataset, val_fraction, seed, train_transform, val_transform):
    order = torch.randperm(len(make_dataset())).tolist()
    n_val = int(val_fraction * len(order))
    return Subset(make_dataset(train_transform), order[n_val:]), Subset(make_dataset(val_transform), order[:n_val])


def split_global_seed(make_dataset, val_fraction, seed, train_transform, val_transform):
    torch.manual_seed(seed)
    return split_unseeded(make_dataset, val_fraction, seed, train_transform, val_transform)


def split_one_generator_two_shuffles(make_dataset, val_fraction, seed, train_transform, val_transform):
    generator = torch.Generator().manual_seed(seed)
    fractions = [1 - val_fraction, val_fraction]
    train, _ = random_split(make_dataset(transform=train_transform), fractions, generator=generator)
    _, val = random_split(make_dataset(transform=val_transform), fractions, generator=generator)
    return train, val


def split_swapped(make_dataset, val_fraction, seed, train_transform, val_transform):
    train, val = L.split_train_val(make_dataset, val_fraction, seed, train_transform, val_transform)
    return val, train


def split_rounded(make_dataset, val_fraction, seed, train_transform, val_transform):
    n = len(make_dataset())
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    n_val = round(val_fraction * n)
    return Subset(make_dataset(train_transform), order[n_val:]), Subset(make_dataset(val_transform), order[:n_val])


def split_in_order(make_dataset, val_fraction, seed, train_transform, val_transform):
    n = len(make_dataset())
    n_val = int(val_fraction * n)
    return Subset(make_dataset(train_transform), range(n - n_val)), Subset(make_dataset(val_transform), range(n - n_val, n))


def split_hard_coded_seed(make_dataset, val_fraction, seed, train_transform, val_transform):
    return L.split_train_val(make_dataset, val_fraction, 42, train_transform, val_transform)


def split_materialised(make_dataset, val_fraction, seed, train_transform, val_transform):
    train, val = L.split_train_val(make_dataset, val_fraction, seed, train_transform, val_transform)
    return [train[i] for i in range(len(train))], [val[i] for i in range(len(val))]


def split_transforms_swapped(make_dataset, val_fraction, seed, train_transform, val_transform):
    return L.split_train_val(make_dataset, val_fraction, seed, val_transform, train_transform)


def split_lists_of_indices(make_dataset, val_fraction, seed, train_transform, val_transform):
    train, val = L.split_train_val(make_dataset, val_fraction, seed, train_transform, val_transform)
    return train.indices, val.indices


# ---- pad_collate ----------------------------------------------------------------------------------


def collate_loop(batch):
    longest = max(len(s) for s, _ in batch)
    padded = torch.zeros(len(batch), longest, dtype=torch.long)
    for i, (s, _) in enumerate(batch):
        padded[i, : len(s)] = s
    return padded, torch.tensor([len(s) for s, _ in batch]), torch.tensor([y for _, y in batch])


def collate_f_pad(batch):
    longest = max(s.numel() for s, _ in batch)
    padded = torch.stack([F.pad(s, (0, longest - s.numel())) for s, _ in batch])
    return padded, torch.as_tensor([s.numel() for s, _ in batch]), torch.as_tensor([y for _, y in batch], dtype=torch.int64)


def collate_new_full(batch):
    sequences = [s for s, _ in batch]
    lengths = torch.tensor(list(map(len, sequences)))
    padded = sequences[0].new_full((len(sequences), int(lengths.max())), 0)
    for row, s in zip(padded, sequences):
        row[: len(s)] = s
    return padded, lengths, torch.LongTensor([y for _, y in batch])


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


def collate_nonzero_lengths(batch):
    seqs, labels = zip(*batch)
    padded = pad_sequence(seqs, batch_first=True)
    return padded, (padded != 0).sum(dim=1), torch.tensor(labels)


def collate_sorted(batch):
    return L.pad_collate(sorted(batch, key=lambda item: -len(item[0])))


def collate_list_lengths(batch):
    padded, lengths, labels = L.pad_collate(batch)
    return padded, lengths.tolist(), labels


def collate_float_labels(batch):
    padded, lengths, labels = L.pad_collate(batch)
    return padded, lengths, labels.float()


def collate_in_place(batch):
    for s, _ in batch:
        s.clamp_(max=13)
    return L.pad_collate(batch)


# ---- balanced_loader ------------------------------------------------------------------------------


def loader_unique_inverse(dataset, labels, batch_size, seed):
    _, inverse, counts = torch.unique(labels, return_inverse=True, return_counts=True)
    sampler = WeightedRandomSampler(1 / counts[inverse].float(), len(labels), generator=torch.Generator().manual_seed(seed))
    return DataLoader(dataset, batch_size, sampler=sampler)


def loader_counter(dataset, labels, batch_size, seed):
    count = collections.Counter(labels.tolist())
    weights = [1 / count[y] for y in labels.tolist()]
    generator = torch.Generator()
    generator.manual_seed(seed)
    return DataLoader(dataset, batch_size=batch_size, sampler=WeightedRandomSampler(weights, num_samples=len(dataset), generator=generator))


def loader_scaled_weights(dataset, labels, batch_size, seed):
    counts = torch.bincount(labels, minlength=20).float()
    weights = len(labels) / counts[labels]
    sampler = WeightedRandomSampler(weights.tolist(), num_samples=labels.numel(), replacement=True, generator=torch.Generator().manual_seed(seed))
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=False)


def loader_batch_sampler(dataset, labels, batch_size, seed):
    weights = 1.0 / torch.bincount(labels)[labels].double()
    sampler = WeightedRandomSampler(weights, len(labels), generator=torch.Generator().manual_seed(seed))
    return DataLoader(dataset, batch_sampler=BatchSampler(sampler, batch_size, drop_last=False))


def loader_with(**sampler_kwargs):
    def balanced_loader(dataset, labels, batch_size, seed):
        kwargs = {"num_samples": len(labels), "replacement": True, "generator": torch.Generator().manual_seed(seed)} | sampler_kwargs
        weights = 1.0 / torch.bincount(labels)[labels].double()
        return DataLoader(dataset, batch_size=batch_size, sampler=WeightedRandomSampler(weights, **kwargs))

    return balanced_loader


def loader_shuffled(dataset, labels, batch_size, seed):
    return DataLoader(dataset, batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(seed))


def loader_sampler_and_shuffle(dataset, labels, batch_size, seed):
    sampler = WeightedRandomSampler(1.0 / torch.bincount(labels)[labels].double(), len(labels))
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, shuffle=True)


def loader_weights(make_weights):
    def balanced_loader(dataset, labels, batch_size, seed):
        sampler = WeightedRandomSampler(make_weights(labels), len(labels), generator=torch.Generator().manual_seed(seed))
        return DataLoader(dataset, batch_size=batch_size, sampler=sampler)

    return balanced_loader


def loader_generator_on_the_loader(dataset, labels, batch_size, seed):
    sampler = WeightedRandomSampler(1.0 / torch.bincount(labels)[labels].double(), len(labels))
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, generator=torch.Generator().manual_seed(seed))


def loader_global_seed(dataset, labels, batch_size, seed):
    torch.manual_seed(seed)
    return loader_with(generator=None)(dataset, labels, batch_size, seed)


def loader_hard_coded_seed(dataset, labels, batch_size, seed):
    return L.balanced_loader(dataset, labels, batch_size, 0)


def loader_drop_last(dataset, labels, batch_size, seed):
    loader = L.balanced_loader(dataset, labels, batch_size, seed)
    return DataLoader(dataset, batch_size=batch_size, sampler=loader.sampler, drop_last=True)


def loader_unique_counts(dataset, labels, batch_size, seed):
    counts = torch.unique(labels, return_counts=True)[1]
    return loader_weights(lambda labels: 1.0 / counts[labels].float())(dataset, labels, batch_size, seed)


# ---- time_epoch -----------------------------------------------------------------------------------


def time_while_next(loader, step):
    batches, load, compute = iter(loader), 0.0, 0.0
    while True:
        t0 = time.perf_counter()
        try:
            batch = next(batches)
        except StopIteration:
            break
        t1 = time.perf_counter()
        step(batch)
        t2 = time.perf_counter()
        load, compute = load + (t1 - t0), compute + (t2 - t1)
    return load, compute


def time_ns(loader, step):
    waited = stepped = 0
    mark = time.perf_counter_ns()
    for batch in loader:
        ready = time.perf_counter_ns()
        step(batch)
        done = time.perf_counter_ns()
        waited, stepped, mark = waited + ready - mark, stepped + done - ready, done
    return waited / 1e9, stepped / 1e9


def time_enumerate(loader, step):
    totals = [0.0, 0.0]
    clock = time.perf_counter
    tick = clock()
    for _, batch in enumerate(loader):
        tock = clock()
        step(batch)
        totals[0] += tock - tick
        tick = clock()
        totals[1] += tick - tock
    return totals[0], totals[1]


def time_forgets_return(loader, step):
    L.time_epoch(loader, step)


def time_monotonic(loader, step):
    load = compute = 0.0
    before = time.monotonic()
    for batch in loader:
        after = time.monotonic()
        step(batch)
        end = time.monotonic()
        load += after - before
        compute += end - after
        before = end
    return load, compute


def time_two_phases(loader, step):
    start = time.perf_counter()
    batches = list(loader)
    load = time.perf_counter() - start
    start = time.perf_counter()
    for batch in batches:
        step(batch)
    return load, time.perf_counter() - start


def time_wait_includes_step(loader, step):
    load = compute = 0.0
    last = time.perf_counter()
    for batch in loader:
        now = time.perf_counter()
        load += now - last  # the time since the last batch arrived, which includes the last step
        last = now
        start = time.perf_counter()
        step(batch)
        compute += time.perf_counter() - start
    return load, compute


def time_step_includes_wait(loader, step):
    load = compute = 0.0
    mark = time.perf_counter()
    for batch in loader:
        got = time.perf_counter()
        load += got - mark
        step(batch)
        compute += time.perf_counter() - mark
        mark = time.perf_counter()
    return load, compute


def time_process(loader, step):
    load = compute = 0.0
    start = time.process_time()
    for batch in loader:
        got = time.process_time()
        step(batch)
        done = time.process_time()
        load, compute, start = load + got - start, compute + done - got, done
    return load, compute


def time_two_epochs(loader, step):
    start = time.perf_counter()
    for _ in loader:
        pass
    load = time.perf_counter() - start
    start = time.perf_counter()
    for batch in loader:
        step(batch)
    return load, time.perf_counter() - start - load


def time_per_batch(loader, step):
    load, compute = L.time_epoch(loader, step)
    return load / len(loader), compute / len(loader)


def time_full_batches_only(loader, step):
    load = compute = 0.0
    start = time.perf_counter()
    for batch in loader:
        got = time.perf_counter()
        if len(batch) == loader.batch_size:
            step(batch)
        done = time.perf_counter()
        load, compute, start = load + got - start, compute + done - got, done
    return load, compute


def time_step_on_all(loader, step):
    start = time.perf_counter()
    batches = list(loader)
    load = time.perf_counter() - start
    start = time.perf_counter()
    step(batches)
    return load, time.perf_counter() - start


# ---- parallel_loader ------------------------------------------------------------------------------


def parallel_sampler_and_batch_size(loader, workers):
    return DataLoader(loader.dataset, batch_size=loader.batch_size, sampler=loader.sampler, drop_last=loader.drop_last,
                      collate_fn=loader.collate_fn, generator=loader.generator, num_workers=workers, persistent_workers=True)


def parallel_kwargs(loader, workers):
    kwargs = {name: getattr(loader, name) for name in ("batch_size", "sampler", "drop_last", "collate_fn", "generator")}
    return DataLoader(loader.dataset, **kwargs, num_workers=workers, persistent_workers=workers > 0, prefetch_factor=4)


def parallel_fork(loader, workers):
    return DataLoader(loader.dataset, batch_sampler=loader.batch_sampler, collate_fn=loader.collate_fn, generator=loader.generator,
                      num_workers=workers, persistent_workers=True, multiprocessing_context="fork")


def parallel_mutates(loader, workers):
    loader.num_workers = workers
    return loader


def parallel_two_workers(loader, workers):
    return L.parallel_loader(loader, 2)


def parallel_not_persistent(loader, workers):
    return DataLoader(loader.dataset, batch_sampler=loader.batch_sampler, collate_fn=loader.collate_fn,
                      generator=loader.generator, num_workers=workers)


def parallel_no_generator(loader, workers):
    return DataLoader(loader.dataset, batch_sampler=loader.batch_sampler, collate_fn=loader.collate_fn,
                      num_workers=workers, persistent_workers=True)


def parallel_default_collate(loader, workers):
    return DataLoader(loader.dataset, batch_sampler=loader.batch_sampler, generator=loader.generator,
                      num_workers=workers, persistent_workers=True)


def parallel_keeps_last_batch(loader, workers):
    return DataLoader(loader.dataset, batch_size=loader.batch_size, sampler=loader.sampler, collate_fn=loader.collate_fn,
                      generator=loader.generator, num_workers=workers, persistent_workers=True)


def parallel_shuffle(loader, workers):
    return DataLoader(loader.dataset, batch_size=loader.batch_size, shuffle=True, drop_last=loader.drop_last, collate_fn=loader.collate_fn,
                      generator=loader.generator, num_workers=workers, persistent_workers=True)


def parallel_in_order(loader, workers):
    return DataLoader(loader.dataset, batch_size=loader.batch_size, drop_last=loader.drop_last, collate_fn=loader.collate_fn,
                      num_workers=workers, persistent_workers=True)


def parallel_no_workers(loader, workers):
    return DataLoader(loader.dataset, batch_sampler=loader.batch_sampler, collate_fn=loader.collate_fn, generator=loader.generator)


def parallel_other_batch_size(loader, workers):
    return DataLoader(loader.dataset, batch_size=8, sampler=loader.sampler, drop_last=loader.drop_last, collate_fn=loader.collate_fn,
                      generator=loader.generator, num_workers=workers, persistent_workers=True)


ALTERNATIVES = [
    (L.check_read_item, read_numpy_route),
    (L.check_read_item, read_functional),
    (L.check_read_item, read_grayscale_transform),
    (L.check_read_item, read_pil_to_tensor),
    (L.check_smoothed_targets, smooth_one_hot),
    (L.check_smoothed_targets, smooth_scatter_add),
    (L.check_smoothed_targets, smooth_loop),
    (L.check_smoothed_targets, smooth_where),
    (L.check_folder_dataset, folder_subclass),
    (L.check_folder_dataset, folder_partial),
    (L.check_folder_dataset, folder_loader_and_dict),
    (L.check_folder_dataset, folder_grayscale_last),
    (L.check_split_train_val, split_random_split_twice),
    (L.check_split_train_val, split_indices_then_subsets),
    (L.check_split_train_val, split_deepcopy),
    (L.check_split_train_val, split_wrapper),
    (L.check_pad_collate, collate_loop),
    (L.check_pad_collate, collate_f_pad),
    (L.check_pad_collate, collate_new_full),
    (L.check_balanced_loader, loader_unique_inverse),
    (L.check_balanced_loader, loader_counter),
    (L.check_balanced_loader, loader_scaled_weights),
    (L.check_balanced_loader, loader_batch_sampler),
    (L.check_time_epoch, time_while_next),
    (L.check_time_epoch, time_monotonic),
    (L.check_time_epoch, time_enumerate),
    (L.check_time_epoch, time_ns),
    (L.check_parallel_loader, parallel_sampler_and_batch_size),
    (L.check_parallel_loader, parallel_kwargs),
    (L.check_parallel_loader, parallel_fork),
]


def _id(value):
    return getattr(value, "exercise_name", None) or getattr(value, "__name__", "")


@pytest.mark.parametrize("check, answer", ALTERNATIVES, ids=_id)
def test_correct_alternatives_pass(check, answer):
    assert_passes(check, answer)


WRONG = [
    # read_item
    (L.check_read_item, read_uint8, "uint8 with values 0-255: add v2.ToDtype"),
    (L.check_read_item, read_unscaled, "pass scale=True"),
    (L.check_read_item, read_no_channel, r"no channel dimension: v2.ToImage\(\) gives \(1, H, W\)"),
    (L.check_read_item, read_without_convert, r"'pics/b.png'\): the image has 3 channels because this file is stored in colour \(RGB\)"),
    (L.check_read_item, read_str_label, "the label is the string '0'"),
    (L.check_read_item, read_raw_label, r"'pics/b.png'\)'s label is a numpy.int64, expected a Python int: convert it with int"),
    (L.check_read_item, read_label_tensor, r"label is a tensor, expected a Python int: call \.item\(\)"),
    (L.check_read_item, read_float64, "expected dtype torch.float32, got torch.float64"),
    (L.check_read_item, read_pil, "still a PIL image"),
    (L.check_read_item, read_numpy, "numpy.ndarray"),
    (L.check_read_item, read_ignores_root, r"shape \(1, 7, 5\), got \(1, 8, 8\)"),
    (L.check_read_item, read_changes_row, "changed the row it was given"),
    (L.check_read_item, lambda root, row: L.read_item(root, {"filename": row["filename"] + ".jpg"}), r"^read_item: <lambda>\(root, row 'pics/a.png'\) raised FileNotFoundError"),
    (L.check_read_item, lambda root, row: L.read_item(root, row)[0], r"returned a tensor of shape \(1, 7, 5\): return a tuple"),
    # smoothed_targets
    (L.check_smoothed_targets, smooth_other_classes, r"labels \[3, 11, 0, 3, 7\], .*spread over the 11 other classes; here, as in CrossEntropyLoss"),
    (L.check_smoothed_targets, smooth_missing_share, "the true class gets 1 - smoothing, but its own share smoothing / num_classes is missing"),
    (L.check_smoothed_targets, smooth_true_is_one, "the true class gets 1, so each row sums to more than 1"),
    (L.check_smoothed_targets, smooth_forgotten, "plain one-hot rows: the smoothing is missing"),
    (L.check_smoothed_targets, smooth_guessed_classes, r"labels \[1\], num_classes=3.* has 2 columns, max\(labels\) \+ 1: the number of classes came from the labels"),
    (L.check_smoothed_targets, smooth_ten_classes, r"index 11 is out of bounds for dimension 1 with size 10 \(a label reached past the last column: make the rows num_classes wide\)"),
    (L.check_smoothed_targets, lambda labels, c, s: L.smoothed_targets(labels % 3, 10, s), r"labels \[3, 11, 0, 3, 7\], .*has 10 columns, the digits' number of classes: this case has num_classes = 12"),
    (L.check_smoothed_targets, smooth_unsqueeze_in_place, "changed the labels it was given"),
    (L.check_smoothed_targets, smooth_no_unsqueeze, r"raised RuntimeError: Index tensor must have the same number of dimensions.*labels.unsqueeze\(1\)"),
    (L.check_smoothed_targets, smooth_along_dim_0, r"raised RuntimeError: index 11 is out of bounds for dimension 0.*the classes are dim 1"),
    (L.check_smoothed_targets, smooth_integer_rows, r"has dtype torch.int64, expected torch.float32"),
    (L.check_smoothed_targets, smooth_float64, r"has dtype torch.float64, expected torch.float32"),
    (L.check_smoothed_targets, lambda labels, c, s: L.smoothed_targets(labels, c, s).T, r"expected shape \(5, 12\), got \(12, 5\)"),
    # folder_dataset
    (L.check_folder_dataset, folder_lambda, r"its target_transform cannot be pickled \(\w+: .*<lambda>.*\): a lambda has no name"),
    (L.check_folder_dataset, folder_nested_function, r"its target_transform cannot be pickled .*local object.*: a function defined inside another"),
    (L.check_folder_dataset, folder_notebook_function, r"its target_transform refers to number_of_folder, defined in the notebook \(__main__\)"),
    (L.check_folder_dataset, folder_index_labels, r"folder '10' has the label 2, its position among the folders sorted as text"),
    (L.check_folder_dataset, folder_rgb, "3 channels, shape .*default loader opens every file as RGB"),
    (L.check_folder_dataset, folder_pil, "the image is a PIL image; give ImageFolder a transform"),
    (L.check_folder_dataset, folder_uint8, "uint8 with values 0-255"),
    (L.check_folder_dataset, folder_unscaled, "pixel values go up to 25\\d: scale them"),
    (L.check_folder_dataset, folder_float64, "dtype torch.float64, expected torch.float32"),
    (L.check_folder_dataset, folder_red_channel, r"\[10\]: the image matches no file under root, read in gray"),
    (L.check_folder_dataset, folder_label_tensor, "the label is a tensor, expected a Python int"),
    (L.check_folder_dataset, folder_notebook_global, "reads the folder '.*notebook-digits', not the root it was given"),
    (L.check_folder_dataset, OwnFolder, "returned a .*OwnFolder, expected a torchvision.datasets.ImageFolder"),
    (L.check_folder_dataset, folder_plus_one, r"\[0\]'s label \(folder '0'\): expected 0, got 1"),
    # split_train_val
    (L.check_split_train_val, split_shared_dataset, r"train\[0\] is not augmented.*both parts are Subsets of one dataset"),
    (L.check_split_train_val, split_train_only, r"val\[0\] is augmented: the validation part must be read with val_transform"),
    (L.check_split_train_val, split_transforms_swapped, r"val\[0\] is augmented"),
    (L.check_split_train_val, split_untransformed, r"val\[0\] is the raw image"),
    (L.check_split_train_val, split_unseeded, "two calls with the same seed gave different splits"),
    (L.check_split_train_val, split_global_seed, "changed torch's global random state"),
    (L.check_split_train_val, split_one_generator_two_shuffles, "items are in both parts: the parts come from two different shuffles"),
    (L.check_split_train_val, split_swapped, r"expected sizes \(train, val\) \[17, 6\], got \[6, 17\]: swapped"),
    (L.check_split_train_val, split_rounded, r"expected sizes \(train, val\) \[16, 7\]|\[17, 6\], got \[16, 7\] \(val gets int\(0.3 \* 23\) items\)"),
    (L.check_split_train_val, split_in_order, "the parts hold the items in their original order"),
    (L.check_split_train_val, split_hard_coded_seed, "seeds 5 and 6 gave the same split"),
    (L.check_split_train_val, split_materialised, r"train\[0\] is augmented, but not by a fresh call of train_transform"),
    (L.check_split_train_val, split_lists_of_indices, r"train\[0\] is an int, expected a pair \(image, label\)"),
    # pad_collate
    (L.check_pad_collate, lambda batch: torch.stack([s for s, _ in batch]), r"\(batch of sequences with lengths \[3, 6, 1, 4\]\) raised RuntimeError: stack expects"),
    (L.check_pad_collate, collate_time_first, "time first: pass batch_first=True"),
    (L.check_pad_collate, collate_no_lengths, "the lengths are missing"),
    (L.check_pad_collate, collate_pad_minus_one, "padding positions hold -1, expected 0"),
    (L.check_pad_collate, collate_padded_lengths, "every length is the padded length"),
    (L.check_pad_collate, collate_nonzero_lengths, "the lengths count the non-zero tokens, but 0 is a real token too"),
    (L.check_pad_collate, collate_sorted, "rows are reordered"),
    (L.check_pad_collate, collate_list_lengths, "lengths is a list"),
    (L.check_pad_collate, collate_float_labels, "labels: expected dtype torch.int64, got torch.float32"),
    (L.check_pad_collate, collate_in_place, "changed the sequences it was given"),
    (L.check_pad_collate, lambda batch: L.pad_collate(batch)[0], r"returned a tensor of shape \(4, 6\): return a tuple"),
    # balanced_loader
    (L.check_balanced_loader, loader_shuffled, "RandomSampler .*keeps the imbalance"),
    (L.check_balanced_loader, loader_with(replacement=False), "use replacement=True"),
    (L.check_balanced_loader, loader_with(num_samples=10), "draws 10 samples per epoch"),
    (L.check_balanced_loader, loader_with(generator=None), "same seed drew different samples: seed the sampler's own generator"),
    (L.check_balanced_loader, loader_generator_on_the_loader, "the DataLoader's generator does not reach a sampler you pass in"),
    (L.check_balanced_loader, loader_global_seed, "changed torch's global random state"),
    (L.check_balanced_loader, loader_hard_coded_seed, "seeds 3 and 4 drew the same samples"),
    (L.check_balanced_loader, loader_sampler_and_shuffle, "mutually exclusive with shuffle"),
    (L.check_balanced_loader, loader_weights(lambda labels: torch.bincount(labels)[labels].float()), "grow with the class's count"),
    (L.check_balanced_loader, loader_weights(lambda labels: 1.0 / torch.bincount(labels).float()), "12 weights, one per class"),
    (L.check_balanced_loader, loader_weights(lambda labels: torch.ones(len(labels))), "every sample has the same weight"),
    (L.check_balanced_loader, loader_weights(lambda labels: 1.0 / torch.bincount(labels)[labels].float().sqrt()), r"do not give every class the same total: e.g. sample \d+ \(class"),
    (L.check_balanced_loader, loader_unique_counts, r"raised IndexError"),
    (L.check_balanced_loader, loader_drop_last, "yielded 56 samples, expected 61: drop_last=True"),
    (L.check_balanced_loader, lambda dataset, labels, batch_size, seed: L.balanced_loader(dataset, labels, 4, seed), "batch_size: expected 8, got 4"),
    (L.check_balanced_loader, lambda dataset, labels, batch_size, seed: L.balanced_loader(dataset, labels, 8, seed),
     r"dataset of 19 in 4 classes, .*batch_size=5.*batch_size: expected 5, got 8"),
    (L.check_balanced_loader, lambda dataset, labels, batch_size, seed: L.balanced_loader(dataset, labels, batch_size, seed).sampler, "expected a torch.utils.data.DataLoader"),
    # time_epoch
    (L.check_time_epoch, lambda loader, step: L.time_epoch(loader, step)[::-1], "the two are swapped"),
    (L.check_time_epoch, lambda loader, step: tuple(1000 * t for t in L.time_epoch(loader, step)), "milliseconds"),
    (L.check_time_epoch, time_per_batch, "an average per batch"),
    (L.check_time_epoch, time_wait_includes_step, r"loader of 3 batches, step\): .*the loading time includes time spent in step"),
    (L.check_time_epoch, time_step_includes_wait, r"loader of 4 batches, step\): .*the step time includes time spent waiting"),
    (L.check_time_epoch, time_process, r"loader of 4 batches, step\): expected about \(0\.1\d\d, 0\.0\d\d\) s, got \(0\.00\d+, [\d.e-]+\)$"),
    (L.check_time_epoch, time_two_epochs, "read 14 items from a dataset of 7: go through the loader once"),
    (L.check_time_epoch, time_full_batches_only, "called step 3 times, expected 4: once per batch, the last, smaller one too"),
    (L.check_time_epoch, time_step_on_all, r"called step 1 times, expected 4"),
    (L.check_time_epoch, time_two_phases, r"when step\(batch 0\) began, the loader had already read 7 of 7 items.*list\(loader\)"),
    (L.check_time_epoch, lambda loader, step: tuple(torch.tensor(t) for t in L.time_epoch(loader, step)), "load_seconds is a tensor, expected a Python float"),
    (L.check_time_epoch, time_forgets_return, "returned None: return the pair"),
    (L.check_time_epoch, lambda loader, step: sum(L.time_epoch(loader, step)), "returned a float: return the pair"),
    # parallel_loader
    (L.check_parallel_loader, parallel_mutates, "returned the loader it was given"),
    (L.check_parallel_loader, parallel_two_workers, "num_workers is 2, expected 3"),
    (L.check_parallel_loader, parallel_not_persistent, "the workers stop after every epoch.*persistent_workers=True"),
    (L.check_parallel_loader, parallel_no_workers, "num_workers is 0, expected 3"),
    (L.check_parallel_loader, parallel_no_generator, "draws a seed for its workers from its generator before it shuffles"),
    (L.check_parallel_loader, parallel_default_collate, r"own collate_fn.*one epoch of it raised in a worker process RuntimeError: .*: it batches with another collate_fn than the loader's"),
    (L.check_parallel_loader, parallel_keeps_last_batch, r"6 batches, expected 5: the loader drops the last, smaller batch"),
    (L.check_parallel_loader, parallel_shuffle, r"loader \(weighted sampler, own collate_fn\).*shuffle=True makes a new sampler; keep the loader's"),
    (L.check_parallel_loader, parallel_in_order, "the first epoch's batches differ from the loader's: keep its sampler"),
    (L.check_parallel_loader, parallel_other_batch_size, "the first epoch has 2 batches, expected 5"),
    (L.check_parallel_loader, lambda loader, workers: loader, "returned the loader it was given"),
]


@pytest.mark.parametrize("check, wrong, message", WRONG, ids=[f"{c.exercise_name}-{i}" for i, (c, _, _) in enumerate(WRONG)])
def test_wrong_answers_name_the_fault(check, wrong, message):
    assert_names_fault(check, wrong, message)


def test_every_check_has_three_alternatives_and_eight_wrong_answers():
    for check, _ in PAIRS:
        assert sum(c is check for c, _ in ALTERNATIVES) >= 3, check.exercise_name
        assert sum(c is check for c, _, _ in WRONG) >= 8, check.exercise_name


def test_parallel_loader_leaves_no_worker_behind():
    """The check shuts down the workers of every loader it built, passing or failing."""
    for answer in (L.parallel_loader, parallel_default_collate, parallel_keeps_last_batch):
        L.check_parallel_loader.verdict(answer)
        assert multiprocessing.active_children() == []


def test_read_item_reads_the_shipped_digits():
    """The reference on a real row: the same pixels as load_digits, scaled to [0, 1]."""
    from course_utils.data import digits_rows, load_digits

    image, label = L.read_item(data_dir() / "digits", digits_rows()[5])
    images, labels = load_digits()
    assert image.shape == (1, 8, 8) and image.dtype == torch.float32
    assert torch.equal((image * 255).round().to(torch.uint8), images[5])
    assert label == labels[5].item() and type(label) is int


def test_folder_dataset_pickles_for_spawned_workers(tmp_path):
    """The reference's target_transform is a bound method, not a lambda, so the dataset survives pickling."""
    import pickle

    for number in (0, 1, 10):
        (tmp_path / str(number)).mkdir()
        Image.fromarray(np.full((2, 3), number, dtype=np.uint8)).save(tmp_path / str(number) / "x.png")
    dataset = pickle.loads(pickle.dumps(L.folder_dataset(tmp_path)))
    assert sorted(label for _, label in dataset) == [0, 1, 10]


def test_time_epoch_tolerance_tells_apart_the_faults():
    """The timing window accepts a measurement a little above the truth, never one that holds the other part."""
    assert L._within(0.105, 0.105, 0.008) and L._within(0.125, 0.105, 0.008)
    assert not L._within(0.125, 0.0, 0.12) and not L._within(0.113, 0.008, 0.105)
    assert not L._within(0.105 / 4, 0.105, 0.008)
