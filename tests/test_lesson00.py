"""Lesson 00's checks against the reference solutions, correct alternatives, and the wrong answers learners write."""

import numpy as np
import pytest
import torch

from course_utils import lesson00 as L
from lesson_contract import assert_names_fault, assert_passes, contract_tests

PAIRS = [
    (L.check_add_one, L.add_one),
    (L.check_draw, L.draw),
]

(test_reference_passes, test_stub_is_not_attempted, test_bad_input_is_one_named_line, test_hostile_answers_are_the_learners_fault,
 test_checks_leave_the_learners_random_state_alone, test_checks_are_quick) = contract_tests(PAIRS)


def add_one_by_add(x):
    return torch.add(x, 1)


def add_one_on_a_clone(x):
    y = x.clone()
    y += 1
    return y


def add_one_with_ones_like(x):
    return x + torch.ones_like(x)


def draw_with_a_local_generator(seed, n):
    g = torch.Generator()
    g.manual_seed(seed)
    return torch.randn(n, generator=g)


def draw_a_row_and_take_it(seed, n):
    return torch.randn(1, n, generator=torch.Generator().manual_seed(seed))[0]


def draw_with_forked_global_state(seed, n):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return torch.randn(n)


def draw_with_a_size_tuple(seed, n):
    generator = torch.Generator()
    return torch.randn(size=(n,), generator=generator.manual_seed(seed), dtype=torch.float32)


@pytest.mark.parametrize("check, answer", [
    (L.check_add_one, add_one_by_add),
    (L.check_add_one, add_one_on_a_clone),
    (L.check_add_one, add_one_with_ones_like),
    (L.check_add_one, lambda x: 1 + x),
    (L.check_draw, draw_with_a_local_generator),
    (L.check_draw, draw_a_row_and_take_it),
    (L.check_draw, draw_with_forked_global_state),
    (L.check_draw, draw_with_a_size_tuple),
])
def test_correct_alternatives_pass(check, answer):
    assert_passes(check, answer)


_shared = torch.Generator()


def draw_from_one_shared_generator(seed, n):
    """Seeds a generator once, at the first call: the next call with the same seed goes on where it stopped."""
    if not getattr(draw_from_one_shared_generator, "seeded", False):
        _shared.manual_seed(seed)
        draw_from_one_shared_generator.seeded = True
    return torch.randn(n, generator=_shared)


def add_one_in_place(x):
    x.add_(1)
    return x


def add_one_returns_input(x):
    return x


WRONG = [
    (L.check_add_one, lambda x: None, r"add_one\(tensor of shape \(3,\), dtype torch.float32\) is None: did you forget to `return` it\?"),
    (L.check_add_one, add_one_in_place, "add_one modified its input in place"),
    (L.check_add_one, lambda x: x + 1.0, r"add_one\(tensor of shape \(6,\), dtype torch.int64\): expected dtype torch.int64, got torch.float32"),
    (L.check_add_one, lambda x: (x + 1).float(), r"expected dtype torch.int64, got torch.float32"),
    (L.check_add_one, lambda x: x + 2, r"wrong values, e\.g\. at index \(0,\) expected 1.5, got 2.5"),
    (L.check_add_one, lambda x: (x + 1).tolist(), "is a list, expected a torch.Tensor"),
    (L.check_add_one, lambda x: (x + 1).numpy(), r"is a numpy.ndarray, expected a torch.Tensor"),
    (L.check_add_one, lambda x: x.flatten() + 1, r"dtype torch.float64\): expected shape \(2, 3\), got \(6,\): the right number of elements, flattened"),
    (L.check_add_one, lambda x: (x + 1).reshape(-1, *x.shape[1:]) if x.dim() else torch.tensor([x.item() + 1]), r"expected shape \(\), got \(1,\)"),
    (L.check_add_one, add_one_returns_input, r"wrong values"),
    (L.check_draw, lambda seed, n: (torch.manual_seed(seed), torch.randn(n))[1], "changed torch's global random state"),
    (L.check_draw, lambda seed, n: torch.randn(n), "changed torch's global random state"),
    (L.check_draw, lambda seed, n: torch.rand(n, generator=torch.Generator().manual_seed(seed)), "drew from torch.rand, the uniform distribution"),
    (L.check_draw, lambda seed, n: torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64), "expected dtype torch.float32, got torch.float64"),
    (L.check_draw, lambda seed, n: torch.randn(n, generator=torch.Generator().manual_seed(seed)).tolist(), "is a list"),
    (L.check_draw, lambda seed, n: np.random.default_rng(seed).standard_normal(n), "is a numpy.ndarray"),
    (L.check_draw, lambda seed, n: torch.randn(5, generator=torch.Generator().manual_seed(seed)), r"draw\(2024, 1\): expected shape \(1,\), got \(5,\)"),
    (L.check_draw, lambda seed, n: torch.randn(n, generator=torch.Generator().manual_seed(seed + 1)), r"draw\(7, 5\): wrong values"),
    (L.check_draw, lambda seed, n: torch.randn(n, generator=torch.Generator().manual_seed(42)), r"draw\(7, 5\): wrong values"),
    (L.check_draw, draw_from_one_shared_generator, r"draw\(7, 5\), called a second time: wrong values"),
]


@pytest.mark.parametrize("check, wrong, message", WRONG)
def test_wrong_answers_name_the_fault(check, wrong, message):
    assert_names_fault(check, wrong, message)


# Where each part of the map is taught: text that the lesson's notebook must contain.
TAUGHT_BY = {
    "torch.Tensor": "tensor", "torch.autograd": "torch.autograd", "torch.nn": "nn.Module", "torch.utils.data": "DataLoader",
    "torch.optim": "torch.optim", "torch.amp": "torch.amp", "torch.compile": "torch.compile",
    "hooks, torch.profiler": "torch.profiler", "torch.distributed": "torch.distributed", "torch.export": "torch.export",
}


def test_the_map_names_each_part_of_pytorch_and_a_lesson_that_teaches_it():
    from course_utils.tooling.layout import source_notebooks

    parts = {part for _, part, _, _ in L.PYTORCH_MAP}
    assert {"torch.Tensor", "torch.autograd", "torch.nn", "torch.optim", "torch.utils.data", "torch.amp", "torch.compile",
            "torch.distributed", "torch.export"} <= parts
    notebooks = {path.name[:2]: path for path in source_notebooks()}
    for _, part, _, lesson in L.PYTORCH_MAP:
        assert TAUGHT_BY[part] in notebooks[lesson].read_text(), f"lesson {lesson} does not mention {TAUGHT_BY[part]}"


def test_plot_pytorch_map_draws_one_box_per_part_with_its_lesson():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = L.plot_pytorch_map()
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert len(fig.axes[0].patches) == len(L.PYTORCH_MAP)
    for _, part, _, lesson in L.PYTORCH_MAP:
        assert part in texts and f"lesson {lesson}" in texts
    plt.close(fig)


def test_the_map_is_not_drawn_while_the_checker_runs(monkeypatch):
    import matplotlib.pyplot as plt

    monkeypatch.setenv("COURSE_CHECK_MODE", "1")
    before = plt.get_fignums()
    assert L.plot_pytorch_map() is None
    assert plt.get_fignums() == before
