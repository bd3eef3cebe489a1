"""Lesson 00 (orientation): the map of PyTorch, and two warm-up exercises that show how the checker talks."""

import torch

from course_utils.tooling.checks import ExerciseFailed, call, exercise, expect_tensor, expect_unchanged, scoreboard_for
from course_utils.tooling.language import _

scoreboard = scoreboard_for(__name__)  # the lesson's last cell: this session's verdicts


# The map of PyTorch: (layer, part, what it is for, the lesson that teaches it), bottom layer first.
PYTORCH_MAP = [
    ("foundations", "torch.Tensor", "arrays, dtypes, devices", "01"),
    ("foundations", "torch.autograd", "gradients, automatically", "02"),
    ("build and train", "torch.nn", "layers and models", "03"),
    ("build and train", "torch.utils.data", "Dataset, DataLoader", "04"),
    ("build and train", "torch.optim", "optimizers, LR schedules", "05"),
    ("faster and bigger", "torch.amp", "16-bit mixed precision", "06"),
    ("faster and bigger", "torch.compile", "graphs, generated kernels", "07"),
    ("faster and bigger", "hooks, torch.profiler", "looking inside a model", "08"),
    ("faster and bigger", "torch.distributed", "many GPUs, many machines", "09"),
    ("ship", "torch.export", "ONNX, AOTInductor, serving", "10"),
]


def plot_pytorch_map():
    """Draw PYTORCH_MAP: one row of boxes per layer, each part labelled with the lesson that teaches it (None while
    the exercise checker runs: it needs the cells to run, not the figure, and lesson 00 is the one graded most)."""
    from course_utils import check_mode

    if check_mode():
        return None
    import matplotlib.pyplot as plt  # here, not at the top: the checker imports this module and draws nothing
    from matplotlib.patches import FancyBboxPatch

    layers = list(dict.fromkeys(layer for layer, *_ in PYTORCH_MAP))
    colours = ["#4c72b0", "#55a868", "#dd8452", "#8172b3"]
    fig, ax = plt.subplots(figsize=(10, 4.6))
    for row, layer in enumerate(layers):
        parts = [entry for entry in PYTORCH_MAP if entry[0] == layer]
        y = row  # the foundations at the bottom, what is built on them above
        ax.text(-0.1, y + 0.45, layer, ha="right", va="center", fontsize=10, fontweight="bold", color=colours[row])
        width = 8.0 / 4  # four slots per row: rows with fewer parts leave the right free
        for k, (_name, part, purpose, lesson) in enumerate(parts):
            x = k * width
            ax.add_patch(FancyBboxPatch((x + 0.05, y + 0.08), width - 0.1, 0.74, boxstyle="round,pad=0.02",
                                        facecolor=colours[row], edgecolor="none", alpha=0.9))
            ax.text(x + width / 2, y + 0.6, part, ha="center", va="center", fontsize=10, color="white", fontweight="bold")
            ax.text(x + width / 2, y + 0.4, purpose, ha="center", va="center", fontsize=8, color="white")
            ax.text(x + width / 2, y + 0.2, f"lesson {lesson}", ha="center", va="center", fontsize=8.5, color="white",
                    fontstyle="italic")
    ax.set_xlim(-1.9, 8.05)
    ax.set_ylim(0, len(layers))
    ax.axis("off")
    ax.set_title("PyTorch in one picture: each part, and the lesson that teaches it", fontsize=11)
    fig.tight_layout()
    return fig


# Reference solutions. The checks compare the learner's answers with these.

def add_one(x: torch.Tensor) -> torch.Tensor:
    """x + 1, a new tensor of the same shape and dtype; x itself unchanged."""
    return x + 1


def draw(seed: int, n: int) -> torch.Tensor:
    """The first n numbers torch.randn draws from a generator seeded with `seed`; the global RNG untouched."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=generator)


# Checks, one per exercise, in notebook order.

_ADD_ONE_CASES = [
    torch.tensor([0.5, -2.0, 7.25]),
    torch.arange(-3, 3),                            # int64: the result must stay an integer tensor
    torch.zeros(2, 3, dtype=torch.float64),
    torch.tensor(4.0),                              # 0-d
    torch.empty(0),
    torch.arange(12.0).reshape(3, 4).T,             # not contiguous
]


@exercise("add_one")
def check_add_one(fn) -> None:
    for x in _ADD_ONE_CASES:
        before, mine = x.clone(), x.clone()
        shown = _("tensor of shape {shape}, dtype {dtype}").format(shape=tuple(x.shape), dtype=x.dtype)
        what = f"add_one({shown})"
        got = call(fn, mine, shown=shown)
        expect_unchanged(before, mine, what="add_one")
        expect_tensor(got, add_one(before), what=what)
        if got is mine:
            raise ExerciseFailed(_("{what} returned its input tensor itself: return a new tensor").format(what=what))


_DRAWS = [(7, 5), (2024, 1), (31337, 0), (99, 64)]


@exercise("draw")
def check_draw(fn) -> None:
    for seed, n in _DRAWS:
        what = f"draw({seed}, {n})"
        state = torch.get_rng_state()
        got = call(fn, seed, n)
        if not torch.equal(torch.get_rng_state(), state):
            raise ExerciseFailed(
                _("{what} changed torch's global random state, which the notebook's other cells draw from: "
                  "leave it alone, and draw from a torch.Generator of your own").format(what=what)
            )
        expected = draw(seed, n)
        if isinstance(got, torch.Tensor) and got.shape == expected.shape and n > 1:
            uniform = torch.rand(n, generator=torch.Generator().manual_seed(seed))
            if torch.equal(got.float(), uniform):
                raise ExerciseFailed(
                    _("{what} drew from torch.rand, the uniform distribution on [0, 1); torch.randn draws from the standard normal").format(what=what)
                )
        expect_tensor(got, expected, what=what, atol=0, rtol=0)
        again = call(fn, seed, n)
        expect_tensor(again, expected, what=_("{what}, called a second time").format(what=what), atol=0, rtol=0)
