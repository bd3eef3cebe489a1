"""Lesson 01 (tensors): reference solutions, the checks for its exercises, the camera stand-in, and the stride and broadcasting figures."""

import numpy as np
import torch

from course_utils.tooling.checks import (
    ExerciseFailed,
    a_type,
    call,
    exercise,
    expect_equal,
    expect_tensor,
    expect_unchanged,
    scoreboard_for,
)
from course_utils.tooling.language import _

scoreboard = scoreboard_for(__name__)  # the lesson's last cell: this session's verdicts


class Camera:
    """A stand-in for a frame grabber: read() copies the next frame into one NumPy array and returns that same array."""

    def __init__(self, frames: np.ndarray):
        self.frames = np.asarray(frames)
        self.buffer = np.zeros_like(self.frames[0])  # reused by every read, as some drivers do to save allocations
        self.reads = 0

    def read(self) -> np.ndarray:
        """The next frame (after the last one, the first again), always in the same array."""
        self.buffer[...] = self.frames[self.reads % len(self.frames)]
        self.reads += 1
        return self.buffer


def plot_strides(memory: torch.Tensor, views: dict[str, torch.Tensor]):
    """Draw each 2-D view of a 1-D `memory` as a grid beside the memory cells that its first row reads, with its strides."""
    import matplotlib.pyplot as plt  # here, not at the top: the checker imports this module and draws nothing
    from matplotlib.patches import Rectangle

    cells = memory.numel()
    fig, axes = plt.subplots(len(views), 2, figsize=(10, 2.1 * len(views)), squeeze=False,
                             gridspec_kw={"width_ratios": [1, 2.6]})
    for (grid_ax, memory_ax), (name, view) in zip(axes, views.items()):
        rows, cols = view.shape
        row_step, col_step = view.stride()
        start = (view.data_ptr() - memory.data_ptr()) // view.element_size()
        first_row = [start + j * col_step for j in range(cols)]
        for i in range(rows):
            for j in range(cols):
                colour = "tab:blue" if i == 0 else "#dbe8f5"
                grid_ax.add_patch(Rectangle((j, i), 1, 1, facecolor=colour, edgecolor="white", linewidth=2))
                grid_ax.text(j + 0.5, i + 0.5, f"{view[i, j].item():g}", ha="center", va="center",
                             color="white" if i == 0 else "#33557a", fontsize=10)
        grid_ax.set_xlim(0, cols)
        grid_ax.set_ylim(rows, 0)
        grid_ax.set_aspect("equal")
        grid_ax.axis("off")
        grid_ax.set_title(f"{name}: shape {tuple(view.shape)}, stride {view.stride()}", fontsize=10)
        for k in range(cells):
            read = k in first_row
            memory_ax.add_patch(Rectangle((k, 0), 1, 1, facecolor="tab:blue" if read else "#eeeeee", edgecolor="white", linewidth=2))
            memory_ax.text(k + 0.5, 0.5, f"{memory[k].item():g}", ha="center", va="center",
                           color="white" if read else "#555555", fontsize=10)
            memory_ax.text(k + 0.5, 1.35, str(k), ha="center", va="center", color="#888888", fontsize=7)
        for a, b in zip(first_row, first_row[1:]):  # one bracket per step along the row, labelled with the jump
            memory_ax.plot([a + 0.5, a + 0.5, b + 0.5], [0, -0.45, -0.45], color="tab:orange", linewidth=1.2)
            memory_ax.annotate("", xy=(b + 0.5, 0), xytext=(b + 0.5, -0.46),
                               arrowprops={"arrowstyle": "->", "color": "tab:orange", "linewidth": 1.2})
            memory_ax.text((a + b) / 2 + 0.5, -0.7, f"+{col_step}", ha="center", va="center", color="tab:orange", fontsize=8)
        memory_ax.set_xlim(-0.2, cells + 0.2)
        memory_ax.set_ylim(1.7, -1.2)
        memory_ax.axis("off")
        contiguous = "in order" if col_step == 1 else f"jumping {col_step} cells at a time"
        memory_ax.set_title(f"memory (cell number below): row 0 of {name} reads it {contiguous}; the next row starts "
                            f"{row_step} cell{'s' if row_step != 1 else ''} further", fontsize=9)
    fig.tight_layout()
    return fig


def plot_broadcast(a: torch.Tensor, b: torch.Tensor):
    """Draw a + b for 2-D a and b: each operand stretched to the result's shape (stretched copies pale), then the sum."""
    import matplotlib.pyplot as plt  # here, not at the top: the checker imports this module and draws nothing
    from matplotlib.patches import Rectangle

    out = a + b
    rows, cols = out.shape
    panels = [("a", a), ("b", b), ("a + b", out)]
    fig, axes = plt.subplots(1, 3, figsize=(9.5, 2.9))
    for ax, (name, t) in zip(axes, panels):
        shown = t.expand(rows, cols)
        for i in range(rows):
            for j in range(cols):
                own = i < t.shape[0] and j < t.shape[1]  # the cells the operand really has in memory
                ax.add_patch(Rectangle((j, i), 1, 1, facecolor="tab:blue" if own else "#dbe8f5", edgecolor="white", linewidth=2))
                ax.text(j + 0.5, i + 0.5, f"{shown[i, j].item():g}", ha="center", va="center",
                        color="white" if own else "#5b7da3", fontsize=11)
        ax.set_xlim(0, cols)
        ax.set_ylim(rows, 0)
        ax.set_aspect("equal")
        ax.axis("off")
        stretched = f" stretched to {(rows, cols)}" if tuple(t.shape) != (rows, cols) else ""
        ax.set_title(f"{name}: {tuple(t.shape)}{stretched}", fontsize=10)
    fig.tight_layout()
    return fig


# Reference solutions, in notebook order. The checks compare the learner's answers with these.

def checkerboard(height: int, width: int, square: int) -> torch.Tensor:
    """(height, width) float32 image of square x square squares, alternately 0 and 1, 0 at the top left."""
    rows = torch.arange(height) // square  # which band of squares each row falls in
    cols = torch.arange(width) // square
    return ((rows[:, None] + cols[None, :]) % 2).float()


def minmax_scale(x: torch.Tensor, dim: int) -> torch.Tensor:
    """x with every slice along dim rescaled to [0, 1]: its smallest value to 0, its largest to 1."""
    low = x.amin(dim=dim, keepdim=True)
    high = x.amax(dim=dim, keepdim=True)
    return (x - low) / (high - low)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """What nn.Linear computes for x (..., in), weight (out, in) and bias (out,): a (..., out) result."""
    return x @ weight.T + bias


def pairwise_sq_distances(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(n, m) squared Euclidean distances between the rows of a (n, d) and b (m, d)."""
    return ((a[:, None, :] - b[None, :, :]) ** 2).sum(dim=-1)


def batch_to(batch: dict, device: torch.device | str) -> dict:
    """A new dict: every tensor on `device`, floating-point ones as float32; other values as they are."""
    moved = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor):
            dtype = torch.float32 if value.is_floating_point() else value.dtype
            value = value.to(device, dtype)
        moved[key] = value
    return moved


def target_logits(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """logits (..., C) and int64 targets (...): the logit of each target class, of targets' shape."""
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def record_frames(camera: Camera, n: int) -> torch.Tensor:
    """The camera's next n frames as one float32 tensor (n, H, W), each copied as it is read."""
    return torch.stack([torch.tensor(camera.read(), dtype=torch.float32) for _ in range(n)])


def image_patches(image: torch.Tensor, p: int) -> torch.Tensor:
    """(H, W) image -> (H//p * W//p, p*p): one row per p x p patch, patches left to right then top to bottom."""
    h, w = image.shape
    blocks = image.view(h // p, p, w // p, p)  # splitting a dimension is always a view, contiguous or not
    return blocks.permute(0, 2, 1, 3).reshape(-1, p * p)


# Helpers of the checks.

def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _same(got, expected: torch.Tensor, atol: float = 0.0) -> bool:
    """True when got is a real CPU tensor of expected's shape holding (up to atol) expected's values."""
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape or got.device.type != "cpu":
        return False
    if got.is_complex() or got.is_sparse or got.numel() == 0:
        return False
    return torch.allclose(got.detach().double(), expected.detach().double(), atol=atol, rtol=1e-5 if atol else 0.0)


# Checks, one per exercise, in notebook order.

@exercise("checkerboard")
def check_checkerboard(fn) -> None:
    # Squares of 2 and 3 pixels, boards they do not divide, a square bigger than the board, height != width.
    for height, width, square in [(6, 8, 2), (5, 7, 2), (9, 6, 3), (4, 4, 1), (7, 10, 3), (2, 3, 5)]:
        shown = f"height={height}, width={width}, square={square}"
        got = call(fn, height, width, square, name="checkerboard", shown=shown)
        what = f"checkerboard({shown})"
        expected = checkerboard(height, width, square)
        if isinstance(got, torch.Tensor) and got.shape == expected.shape and not _same(got, expected):
            if square > 1 and _same(got, checkerboard(height, width, 1)):
                raise ExerciseFailed(
                    _("{what}: your squares are 1 pixel wide: each square is `square` pixels wide, so divide the row "
                      "and column numbers by square (//) before you take the parity").format(what=what)
                )
            if _same(got, 1 - expected):
                raise ExerciseFailed(_("{what} is inverted: the top-left square should be 0").format(what=what))
        if isinstance(got, torch.Tensor) and height != width and tuple(got.shape) == (width, height):
            raise ExerciseFailed(_("{what}: expected shape {expected}, got {got}: height is the number of rows").format(
                what=what, expected=(height, width), got=(width, height)))
        rounded_up = (-(-height // square) * square, -(-width // square) * square)
        if isinstance(got, torch.Tensor) and tuple(got.shape) == rounded_up != (height, width):
            raise ExerciseFailed(
                _("{what}: expected shape {expected}, got {got}: whole squares that run past the edge; "
                  "when square does not divide the size, the last squares are cut off at height and width").format(
                    what=what, expected=(height, width), got=rounded_up)
            )
        expect_tensor(got, expected, what=what)


def _slices(shape: tuple[int, ...], seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Distinct values (no slice is constant), a different range in each slice."""
    g = _generator(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * 3 + torch.arange(shape[-1], dtype=torch.float64)).to(dtype)


def _without_keepdim(x: torch.Tensor, dim: int) -> torch.Tensor | None:
    """minmax_scale as written without keepdim: the reduced values line up with x's dimensions from the right."""
    try:
        return (x - x.amin(dim)) / (x.amax(dim) - x.amin(dim))
    except RuntimeError:  # the shapes do not broadcast: that answer raises, and call() reports it
        return None


@exercise("minmax_scale")
def check_minmax_scale(fn) -> None:
    hints = {
        "torch.return_types": _("x.min(dim) and x.max(dim) return a pair (values, indices): take .values, or use amin and amax"),
        "must match the size of tensor": _("shapes that do not broadcast: a reduction such as x.amin(dim) drops that dimension unless keepdim=True"),
    }
    # Square shapes first: there a reduction without keepdim broadcasts silently along the wrong dimension.
    cases = [((4, 4), 1, torch.float32), ((3, 3, 3), -1, torch.float32), ((5, 3), 0, torch.float32),
             ((2, 3, 4), 1, torch.float64), ((3, 4, 4), -2, torch.float32), ((1, 6), 1, torch.float32), ((7,), 0, torch.float64)]
    for k, (shape, dim, dtype) in enumerate(cases):
        x = _slices(shape, 30 + k, dtype)
        before = x.clone()
        if dtype == torch.float64:
            shown = _("x of shape {shape}, float64, dim={dim}").format(shape=shape, dim=dim)
        else:
            shown = _("x of shape {shape}, dim={dim}").format(shape=shape, dim=dim)
        got = call(fn, x, dim, name="minmax_scale", shown=shown, hints=hints)
        what = f"minmax_scale({shown})"
        expect_unchanged(before, x, what="minmax_scale")
        expected = minmax_scale(before, dim)
        if isinstance(got, torch.Tensor) and got.shape == expected.shape and not _same(got, expected, atol=1e-5):
            silent = _without_keepdim(before, dim)
            if silent is not None and silent.shape == expected.shape and _same(got, silent, atol=1e-5):
                raise ExerciseFailed(
                    _("{what}: the min and max of each slice are lined up with the wrong dimension of x: amin(dim) and amax(dim) "
                      "drop the dimension they reduce, and broadcasting matches shapes from the right; keep it with keepdim=True").format(what=what)
                )
            if _same(got, (before - before.min()) / (before.max() - before.min()), atol=1e-5):
                raise ExerciseFailed(_("{what}: you scaled by the smallest and largest value of the whole tensor: scale each slice along dim by its own").format(what=what))
            for other in range(x.ndim):
                if other != dim % x.ndim and _same(got, minmax_scale(before, other), atol=1e-5):
                    raise ExerciseFailed(_("{what}: you scaled the slices along dim {other}, not along the dim={dim} you were given").format(
                        what=what, other=other, dim=dim))
        expect_tensor(got, expected, what=what, atol=1e-5)


@exercise("linear")
def check_linear(fn) -> None:
    g = _generator(2)

    def case(x_shape, out, dtype=torch.float32):
        x = torch.randn(*x_shape, generator=g, dtype=dtype)
        return x, torch.randn(out, x_shape[-1], generator=g, dtype=dtype), torch.randn(out, generator=g, dtype=dtype)

    cases = [
        case((2, 3), 3),  # square weight: a missing transpose keeps the shape, not the values
        case((5, 4), 2),
        case((4,), 3),  # one sample, no batch dimension
        case((2, 3, 4), 5),  # two leading dimensions
        case((1, 3), 1),
        case((3, 2), 4, torch.float64),
    ]
    for x, w, b in cases:
        before = (x.clone(), w.clone(), b.clone())
        if x.dtype == torch.float64:
            shown = _("x of shape {x_shape}, weight of shape {weight_shape}, bias, all float64").format(
                x_shape=tuple(x.shape), weight_shape=tuple(w.shape))
        else:
            shown = _("x of shape {x_shape}, weight of shape {weight_shape}, bias").format(
                x_shape=tuple(x.shape), weight_shape=tuple(w.shape))
        got = call(fn, x, w, b, name="linear", shown=shown)
        what = f"linear({shown})"
        for old, new in zip(before, (x, w, b)):
            expect_unchanged(old, new, what="linear")
        x0, w0, b0 = before
        expected = linear(x0, w0, b0)
        if isinstance(got, torch.Tensor) and got.shape == expected.shape and not _same(got, expected, atol=1e-5):
            if w0.shape[0] == w0.shape[1] and _same(got, x0 @ w0 + b0, atol=1e-5):
                raise ExerciseFailed(
                    _("{what}: you computed x @ weight + bias, but weight is stored as (out_features, in_features): use its transpose, weight.T").format(what=what)
                )
            if _same(got, x0 @ w0.T, atol=1e-5):
                raise ExerciseFailed(_("{what}: the bias is missing: add one bias value to each output feature").format(what=what))
        expect_tensor(got, expected, what=what, atol=1e-5)


@exercise("pairwise_sq_distances")
def check_pairwise_sq_distances(fn) -> None:
    g = _generator(11)
    cases = [
        (torch.randn(5, 3, generator=g), torch.randn(4, 3, generator=g)),
        (torch.randn(4, 2, generator=g), torch.randn(4, 2, generator=g)),  # n == m: a transposed answer keeps the shape
        (torch.randn(1, 6, generator=g), torch.randn(3, 6, generator=g)),
        (torch.randn(3, 1, generator=g), torch.randn(2, 1, generator=g)),
        (torch.randn(4, 5, generator=g).T, torch.randn(2, 4, generator=g)),  # a is not contiguous
        (torch.randn(2, 4, generator=g, dtype=torch.float64), torch.randn(5, 4, generator=g, dtype=torch.float64)),
    ]
    for a, b in cases:
        a_before, b_before = a.clone(), b.clone()
        if a.dtype == torch.float64:
            shown = _("a of shape {a_shape}, b of shape {b_shape}, float64").format(a_shape=tuple(a.shape), b_shape=tuple(b.shape))
        else:
            shown = _("a of shape {a_shape}, b of shape {b_shape}").format(a_shape=tuple(a.shape), b_shape=tuple(b.shape))
        got = call(fn, a, b, name="pairwise_sq_distances", shown=shown)
        what = f"pairwise_sq_distances({shown})"
        expect_unchanged(a_before, a, what="pairwise_sq_distances")
        expect_unchanged(b_before, b, what="pairwise_sq_distances")
        expected = pairwise_sq_distances(a_before, b_before)
        if isinstance(got, torch.Tensor) and got.shape == expected.shape and not _same(got, expected, atol=1e-4):
            d = a.shape[1]
            if _same(got, expected.sqrt(), atol=1e-4):
                raise ExerciseFailed(_("{what}: your values are the distances, not their squares").format(what=what))
            if d > 1 and _same(got * d, expected, atol=1e-4):
                raise ExerciseFailed(_("{what}: your values are the squared distances divided by d = {d}: sum over the coordinates, do not average").format(
                    what=what, d=d))
            if got.shape[0] == got.shape[1] and _same(got.T, expected, atol=1e-4):
                raise ExerciseFailed(_("{what}: entry [i, j] holds the distance from b[i] to a[j]: is it transposed?").format(what=what))
        expect_tensor(got, expected, what=what, atol=1e-4, rtol=1e-4)


def _batch(seed: int) -> dict:
    g = _generator(seed)
    return {
        "pixels": torch.randn(2, 3, 4, dtype=torch.float64, generator=g),
        "target": torch.tensor([11, 3]),
        "valid": torch.tensor([[True, False, True], [False, True, True]]),
        "scale": torch.rand(2, generator=g).to(torch.bfloat16),
        "offset": torch.tensor([0.25, -1.5]),
        "paths": ["scan_07.npy", "scan_12.npy"],
        "step": 40,
    }


@exercise("batch_to")
def check_batch_to(fn) -> None:
    hints = {
        "NVIDIA driver": _("there is no CUDA GPU here: move tensors with .to(device), to the device you are given"),
        "not compiled with CUDA": _("there is no CUDA GPU here: move tensors with .to(device), to the device you are given"),
        "object has no attribute 'to'": _("only tensors have .to(); leave other values as they are"),
    }
    for device in ("cpu", torch.device("meta")):
        batch = _batch(3)
        originals = dict(batch)
        saved = {k: v.clone() for k, v in batch.items() if isinstance(v, torch.Tensor)}
        shown = _("a dict of {n} entries, device={device!r}").format(n=len(batch), device=device)
        got = call(fn, batch, device, name="batch_to", shown=shown, hints=hints)
        what = f"batch_to({shown})"
        if set(batch) != set(originals) or any(batch[k] is not originals[k] for k in originals):
            raise ExerciseFailed(_("{what} changed the caller's dict: build and return a new one").format(what=what))
        for key, copy in saved.items():
            now = originals[key]
            if now.dtype != copy.dtype or now.device != copy.device or not torch.equal(now, copy):
                raise ExerciseFailed(_("{what} changed the caller's tensor batch[{key!r}]: .to() gives you a new tensor, leave the old one alone").format(
                    what=what, key=key))
        if got is batch:
            raise ExerciseFailed(_("{what} returned the caller's dict itself: return a new dict").format(what=what))
        if not isinstance(got, dict):
            raise ExerciseFailed(_("{what} is {a_type}, expected a dict").format(what=what, a_type=a_type(got)))
        missing = [k for k in batch if k not in got]
        if missing:
            raise ExerciseFailed(_("{what} has no {keys}: keep every entry, tensor or not").format(
                what=what, keys=", ".join(map(repr, missing))))
        extra = [k for k in got if k not in batch]
        if extra:
            raise ExerciseFailed(_("{what} has entries the batch did not have: {keys}").format(
                what=what, keys=", ".join(map(repr, extra))))
        expected = batch_to(batch, device)
        for key, want in expected.items():
            have = got[key]
            item = f"{what}[{key!r}]"
            if not isinstance(want, torch.Tensor):
                if isinstance(have, torch.Tensor):
                    raise ExerciseFailed(_("{item} became a tensor; leave values that are not tensors as they are").format(item=item))
                expect_equal(have, want, what=item)
                continue
            if not isinstance(have, torch.Tensor):
                raise ExerciseFailed(_("{item} is {a_type}, expected a tensor").format(item=item, a_type=a_type(have)))
            if have.device.type != want.device.type:
                raise ExerciseFailed(
                    _("{item} is on {got}, expected {expected}: move every tensor to the device you are given "
                      "(the check uses 'meta', a device every PyTorch has, which keeps shapes and dtypes but no values)").format(
                        item=item, got=have.device.type, expected=want.device.type)
                )
            if not batch[key].is_floating_point() and have.dtype != want.dtype:
                raise ExerciseFailed(_("{item}: expected dtype {expected}, got {got}: only floating-point tensors become float32").format(
                    item=item, expected=want.dtype, got=have.dtype))
            if want.device.type == "meta":
                if have.dtype != want.dtype or have.shape != want.shape:
                    raise ExerciseFailed(_("{item}: expected {expected_dtype} of shape {expected_shape}, got {got_dtype} of shape {got_shape}").format(
                        item=item, expected_dtype=want.dtype, expected_shape=tuple(want.shape), got_dtype=have.dtype,
                        got_shape=tuple(have.shape)))
                continue
            expect_tensor(have, want, what=item)


@exercise("target_logits")
def check_target_logits(fn) -> None:
    hints = {
        "Index tensor must have the same number of dimensions": _("gather's index needs as many dimensions as logits: give targets a last dimension of size 1"),
        "indexing tensors could not be broadcast": _("an arange over the rows pairs them with targets only for (B, C) logits; this call has other leading dimensions"),
    }
    g = _generator(8)
    cases = [
        ((5, 12), torch.tensor([0, 11, 3, 3, 10])),  # more than 9 classes, a tie, the first and the last class
        ((2, 5, 5), None),                            # sequences; as many classes as steps, so dim=1 runs too
        ((1, 4, 6), None),                            # a batch of one
        ((3, 1, 7), None),                            # sequences of length one
        ((9,), torch.tensor(4)),                      # one sample, no batch dimension: targets is 0-d
        ((2, 2, 3, 10), None),
    ]
    for k, (shape, targets) in enumerate(cases):
        dtype = torch.float64 if k >= 4 else torch.float32
        logits = torch.randn(shape, generator=g, dtype=dtype)
        if targets is None:
            targets = torch.randint(0, shape[-1], shape[:-1], generator=g)
        saved = (logits.clone(), targets.clone())
        if dtype == torch.float64:
            shown = _("logits of shape {logits_shape}, float64, targets of shape {targets_shape}").format(
                logits_shape=shape, targets_shape=tuple(targets.shape))
        else:
            shown = _("logits of shape {logits_shape}, targets of shape {targets_shape}").format(
                logits_shape=shape, targets_shape=tuple(targets.shape))
        got = call(fn, logits, targets, name="target_logits", shown=shown, hints=hints)
        what = f"target_logits({shown})"
        expect_unchanged(saved[0], logits, what="target_logits")
        expect_unchanged(saved[1], targets, what="target_logits")
        logits, targets = saved
        expected = target_logits(logits, targets)
        if isinstance(got, torch.Tensor) and got.shape != expected.shape:
            if got.shape == expected.shape + (1,) and _same(got.squeeze(-1), expected):
                raise ExerciseFailed(_("{what}: expected shape {expected}, got {got}: gather keeps the size-1 last dimension of its index; remove it (squeeze(-1))").format(
                    what=what, expected=tuple(expected.shape), got=tuple(got.shape)))
            if got.shape == expected.squeeze().shape and _same(got, expected.squeeze()):
                raise ExerciseFailed(
                    _("{what}: expected shape {expected}, got {got}: squeeze() without a dim also removed "
                      "a batch or sequence dimension that happens to be 1 here; squeeze(-1) removes only the one gather added").format(
                        what=what, expected=tuple(expected.shape), got=tuple(got.shape))
                )
            if logits.ndim == 2 and got.shape == (len(targets), len(targets)) and _same(got, logits[:, targets]):
                raise ExerciseFailed(
                    _("{what}: expected shape {expected}, got {got}: logits[:, targets] pairs every row "
                      "with every target; pair row i with targets[i] only (gather, or an arange over the rows)").format(
                        what=what, expected=tuple(expected.shape), got=tuple(got.shape))
                )
        if isinstance(got, torch.Tensor) and got.shape == expected.shape and not _same(got, expected):
            if _same(got, logits.amax(dim=-1)):
                raise ExerciseFailed(_("{what}: your values are the largest logit of each sample, not the logit of its target").format(what=what))
            if _same(got, logits.argmax(dim=-1)):
                raise ExerciseFailed(_("{what}: your values are the predicted classes (argmax), not the logits of the targets").format(what=what))
            if logits.ndim == 3 and _same(got, logits.gather(1, targets.unsqueeze(1)).squeeze(1)):
                raise ExerciseFailed(
                    _("{what}: you gathered along dim 1, which holds the classes only in (B, C) logits: the classes are "
                      "always the last dimension (dim=-1)").format(what=what)
                )
        expect_tensor(got, expected, what=what)


def _camera_frames(seed: int, n: int, shape: tuple[int, int], dtype: np.dtype) -> np.ndarray:
    """n distinct frames: frame t holds values in [20 t, 20 t + 19]."""
    g = _generator(seed)
    base = torch.randint(0, 20, shape, generator=g)
    frames = torch.stack([base + 20 * t for t in range(n)])
    if np.issubdtype(dtype, np.floating):
        frames = frames + torch.rand(frames.shape, generator=g, dtype=torch.float64)
    return frames.numpy().astype(dtype)


@exercise("record_frames")
def check_record_frames(fn) -> None:
    array_first = _("camera.read() gives a NumPy array: make a tensor of it first")
    hints = {"object has no attribute 'to'": array_first, "object has no attribute 'float'": array_first, "expected Tensor as element": array_first}
    cases = [(np.uint8, (3, 5), 4), (np.float32, (4, 2), 3), (np.float64, (2, 3), 2), (np.float32, (3, 3), 1)]
    for k, (dtype, shape, n) in enumerate(cases):
        frames = _camera_frames(k, n + 2, shape, dtype)
        camera = Camera(frames)
        shown = _("a camera of {dtype} frames of shape {shape}, n={n}").format(dtype=np.dtype(dtype).name, shape=shape, n=n)
        got = call(fn, camera, n, name="record_frames", shown=shown, hints=hints)
        what = f"record_frames({shown})"
        if camera.reads != n:
            raise ExerciseFailed(_("{what} read {reads} frame(s) from the camera, expected {n}: read each frame once").format(
                what=what, reads=camera.reads, n=n))
        expected = torch.from_numpy(frames[:n].astype(np.float32))
        if isinstance(got, torch.Tensor) and tuple(got.shape) == (n * shape[0], shape[1]) and n > 1:
            raise ExerciseFailed(
                _("{what}: expected shape {expected}, got {got}: the frames are joined along their rows; "
                  "stack them along a new first dimension").format(what=what, expected=tuple(expected.shape), got=tuple(got.shape))
            )
        if isinstance(got, torch.Tensor) and got.shape == expected.shape and not _same(got, expected, atol=1e-6) and n > 1:
            last = expected[-1].expand_as(expected)
            if _same(got, last, atol=1e-6) and dtype == np.float32 and k > 0:
                raise ExerciseFailed(
                    _("{what}: every frame of your result is the last one read, though uint8 frames worked: a conversion that finds "
                      "the dtype already right returns the same memory (.float(), .to(torch.float32), torch.as_tensor, np.asarray), so nothing was copied").format(what=what)
                )
            if _same(got, last, atol=1e-6):
                raise ExerciseFailed(
                    _("{what}: every frame of your result is the last one read: camera.read() returns the same array every time, "
                      "refilled in place, so whatever keeps that array (a list of it, or torch.from_numpy, which shares its memory) "
                      "ends up with the last frame only: copy each frame when you read it").format(what=what)
                )
            if _same(got, expected.flip(0), atol=1e-6):
                raise ExerciseFailed(_("{what}: the right frames in reverse order: frame 0 is the first one read").format(what=what))
            if dtype == np.uint8 and _same(got * 255, expected, atol=1e-3):
                raise ExerciseFailed(_("{what}: your values are divided by 255: keep the values the camera gives").format(what=what))
        expect_tensor(got, expected, what=what)
        kept = got.clone()
        camera.read()
        if not torch.equal(got, kept):
            raise ExerciseFailed(
                _("{what}: your result changed when the camera read its next frame: it still shares memory with the camera's array; "
                  "copy each frame").format(what=what)
            )


@exercise("image_patches")
def check_image_patches(fn) -> None:
    hints = {"is invalid for input of size": _("a shape that does not fit this image: work the sizes out from image.shape and p")}
    # Every pixel differs from every other, so each way of scrambling them is told apart. The second image
    # is cut by both 2 and 3, so that a patch size fixed in the code gives patches instead of an error.
    cases = [
        (torch.arange(48, dtype=torch.float32).view(6, 8) / 4 - 5, 2, False),
        (torch.arange(72).view(6, 12), 3, False),
        (torch.arange(54).view(6, 9).T, 3, True),  # a transposed view, not contiguous
        (torch.arange(15, dtype=torch.float32).view(3, 5), 1, False),
        (torch.arange(36, dtype=torch.float64).view(6, 6).T, 6, True),
        (torch.arange(200, 232, dtype=torch.uint8).view(4, 8), 4, False),
    ]
    for image, p, transposed in cases:
        before = image.clone()
        if transposed:
            shown = _("image of shape {shape} (a transposed view, not contiguous), p={p}").format(shape=tuple(image.shape), p=p)
        else:
            shown = _("image of shape {shape}, p={p}").format(shape=tuple(image.shape), p=p)
        got = call(fn, image, p, name="image_patches", shown=shown, hints=hints)
        what = f"image_patches({shown})"
        expect_unchanged(before, image, what="image_patches")
        expected = image_patches(before, p)
        h, w = before.shape
        for q in range(1, min(h, w) + 1):
            if q != p and h % q == 0 and w % q == 0 and isinstance(got, torch.Tensor) and _same(got, image_patches(before, q)):
                raise ExerciseFailed(_("{what}: your patches are {q}x{q}, whatever p is: cut p x p patches, with the p you are given").format(
                    what=what, q=q))
        if isinstance(got, torch.Tensor) and got.shape == expected.shape and not _same(got, expected):
            if p > 1 and _same(got, before.reshape(-1, p * p)):
                raise ExerciseFailed(
                    _("{what}: each row of your result is {n} pixels in reading order, which run across several patches: "
                      "a p x p patch spans p image rows, so reorder the dimensions before you merge them (reshape alone is not permute)").format(
                        what=what, n=p * p)
                )
            if _same(got.reshape(-1, p, p).transpose(1, 2).reshape(-1, p * p), expected):
                raise ExerciseFailed(_("{what}: each patch is flattened column by column; flatten it row by row").format(what=what))
            if sorted(map(tuple, got.tolist())) == sorted(map(tuple, expected.tolist())):
                raise ExerciseFailed(
                    _("{what}: every row is a right patch, but the patches come in another order: "
                      "left to right along the top, then the next band down").format(what=what)
                )
        expect_tensor(got, expected, what=what)
