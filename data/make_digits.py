"""Rebuild data/digits/ from scikit-learn's copy of the UCI optical digits.

This ran once, by hand, to create the files the course ships; nothing calls it
at run or test time. Usage:

    pip download --no-deps scikit-learn   # any recent wheel carries the file
    unzip -p scikit_learn-*.whl sklearn/datasets/data/digits.csv.gz > digits.csv.gz
    python data/make_digits.py digits.csv.gz
"""

import csv
import gzip
import random
import sys
from pathlib import Path

from PIL import Image

OUT = Path(__file__).parent / "digits"
TEST_FRACTION = 0.2


def main(src: str) -> None:
    rows = [list(map(int, line.split(","))) for line in gzip.open(src, "rt")]
    (OUT / "images").mkdir(parents=True, exist_ok=True)
    # A fixed, stratified split: 20 % of each class goes to the test set.
    rng = random.Random(0)
    by_class: dict[int, list[int]] = {}
    for i, row in enumerate(rows):
        by_class.setdefault(row[64], []).append(i)
    test = set()
    for idx in by_class.values():
        test.update(rng.sample(idx, round(len(idx) * TEST_FRACTION)))
    with open(OUT / "labels.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["filename", "label", "split"])
        for i, row in enumerate(rows):
            # Pixels count "on" cells in a 4x4 block (0..16); stretch to 0..255.
            pixels = bytes(round(v * 255 / 16) for v in row[:64])
            name = f"{i:04d}.png"
            Image.frombytes("L", (8, 8), pixels).save(OUT / "images" / name, optimize=True)
            w.writerow([f"images/{name}", row[64], "test" if i in test else "train"])


if __name__ == "__main__":
    main(sys.argv[1])
