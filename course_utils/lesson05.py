"""Lesson 05 (training): reference solutions and the checks for its exercises."""

import contextlib
import copy
import functools
import math
import re
import tempfile
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, LRScheduler, SequentialLR
from torch.utils.data import DataLoader, TensorDataset

from course_utils.tooling.checks import ExerciseFailed, a_type, call, exercise, expect_tensor, expect_unchanged, scoreboard_for
from course_utils.tooling.language import N_, _, ngettext
from course_utils.training import train_one_epoch

scoreboard = scoreboard_for(__name__)  # the lesson's last cell: this session's verdicts


# Reference solutions. The checks compare the learner's answers with these.

def sequence_loss(logits: torch.Tensor, targets: torch.Tensor, pad_index: int) -> torch.Tensor:
    """Mean cross-entropy over the positions of (N, T, C) logits whose (N, T) target is not pad_index."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=pad_index)


def make_adamw(model: nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW over the trainable parameters: weight decay on those with 2+ dimensions, none on the others."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in trainable if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in trainable if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr)


def warmup_cosine(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int, start_factor: float, min_lr: float) -> LRScheduler:
    """Linear warm-up from start_factor x lr to lr over warmup_steps, then a half cosine down to min_lr at total_steps."""
    warmup = LinearLR(optimizer, start_factor=start_factor, total_iters=warmup_steps)
    decay = CosineAnnealingLR(optimizer, T_max=total_steps - warmup_steps, eta_min=min_lr)
    return SequentialLR(optimizer, [warmup, decay], milestones=[warmup_steps])


def accumulation_step(model: nn.Module, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], loss_fn: Callable,
                      optimizer: torch.optim.Optimizer, max_norm: float) -> float:
    """One step as for one batch of all the micro-batches' samples (any sizes), clipped to max_norm; return the norm before clipping."""
    optimizer.zero_grad(set_to_none=True)
    n_samples = sum(len(targets) for _, targets in micro_batches)
    for inputs, targets in micro_batches:
        share = len(targets) / n_samples  # loss_fn gives a mean: weight it by the micro-batch's share of the samples
        (loss_fn(model(inputs), targets) * share).backward()
    norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    return norm.item()


def overfit_one_batch(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, loss_fn: Callable, steps: int, lr: float) -> list[float]:
    """Train on one batch for `steps` Adam steps with dropout off and every other module in train mode; each step's loss; modes restored."""
    modes = {module: module.training for module in model.modules()}
    model.train()
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.eval()  # nothing random: the same batch must give the same forward pass every time
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for _step in range(steps):
        optimizer.zero_grad()
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    for module, training in modes.items():
        module.training = training  # each module its own mode back: model.train(flag) would set them all alike
    return losses


def train_resumable(model: nn.Module, loader: DataLoader, loss_fn: Callable, optimizer: torch.optim.Optimizer,
                    scheduler: LRScheduler, shuffle: torch.Generator, epochs: int, path: Path) -> list[float]:
    """Train until `epochs` epochs are done in all, resuming from `path` if it exists and saving there after each epoch."""
    losses = []
    if path.exists():
        state = torch.load(path, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["torch_rng"])  # dropout draws from it
        shuffle.set_state(state["shuffle_rng"])  # the loader's order of the next epochs
        losses = state["losses"]
    while len(losses) < epochs:
        losses.append(train_one_epoch(model, loader, loss_fn, optimizer))
        scheduler.step()
        torch.save({
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "shuffle_rng": shuffle.get_state(),
            "losses": losses,
        }, path)
    return losses


# Shared helpers of the checks.

def _kind(value) -> str:
    """A value's type as a learner would write it: float, numpy.bool, torch.optim.lr_scheduler.StepLR."""
    kind = type(value)
    if kind.__module__ == "builtins":
        return kind.__name__
    if kind.__module__.startswith("torch.optim.lr_scheduler"):
        return f"torch.optim.lr_scheduler.{kind.__qualname__}"
    if kind.__module__.startswith("torch.optim"):
        return f"torch.optim.{kind.__qualname__}"
    return f"{kind.__module__.split('.')[0]}.{kind.__qualname__}"


def _one_thread(check: Callable) -> Callable:
    """Run a check on one CPU thread: its problems are tiny, and a second thread only adds waiting (seconds on a busy machine)."""

    @functools.wraps(check)
    def run(fn) -> None:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            check(fn)
        finally:
            torch.set_num_threads(threads)

    return run


def _close(a: float, b: float, tol: float = 1e-5) -> bool:
    return math.isclose(a, b, rel_tol=tol, abs_tol=tol / 10)


def _diagnose(got: float, expected: float, variants: list[tuple[float | None, str]], plain: str, tol: float = 1e-5) -> None:
    """Pass when got is expected; else fail with the one known mistake that gives exactly got, or a plain expected/got.

    A variant counts only where its value differs from the right one, and only one message may match:
    a guess at the cause is given only when the numbers leave no other reading.
    """
    if _close(got, expected, tol):
        return
    matched = {message for value, message in variants if value is not None and _close(got, value, tol) and not _close(value, expected, tol)}
    if len(matched) == 1:
        raise ExerciseFailed(matched.pop())
    raise ExerciseFailed(plain)


def _expect_float(got, what: str) -> float:
    """A Python float, or one line saying what came instead."""
    if got is None:
        raise ExerciseFailed(_("{what} is None: did you forget to `return` it?").format(what=what))
    if isinstance(got, torch.Tensor):
        raise ExerciseFailed(_("{what} is a tensor, expected a Python float: call .item() on it").format(what=what))
    if not isinstance(got, float):
        raise ExerciseFailed(_("{what} is {got_type} ({got}), expected a Python float").format(what=what, got_type=a_type(got), got=str(got)[:40]))
    return got


def _param_grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {name: (p.grad.detach().clone() if p.grad is not None else None) for name, p in model.named_parameters()}


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def _changed(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> str | None:
    return next((name for name in before if not torch.equal(before[name], after[name])), None)


# Exercise 1: sequence_loss

def _sequence_case(n: int, t: int, c: int, pad_index: int, lengths: list[int], seed: int, contiguous: bool = True):
    g = torch.Generator().manual_seed(seed)
    if contiguous:
        logits = torch.randn(n, t, c, generator=g)
    else:
        logits = torch.randn(n, c, t, generator=g).transpose(1, 2)  # (N, T, C) over (N, C, T) memory: not contiguous
    real = torch.tensor([k for k in range(c) if k != pad_index])
    targets = real[torch.randint(0, len(real), (n, t), generator=g)]
    if pad_index != 0:
        targets[0, 0] = 0  # a real token of class 0: padding found by `!= 0` must not pass
    for row, length in enumerate(lengths):
        targets[row, length:] = pad_index
    return logits, targets


SEQUENCE_CASES = [  # (N, T, C, pad_index, lengths, seed, contiguous)
    (3, 6, 12, 7, [6, 4, 1], 51, True),    # padding is a class index inside the range; sequences of 6, 4 and 1 tokens
    (2, 5, 5, -1, [5, 2], 52, True),       # T == C: the classes read from the wrong dim give a number, not an error
    (2, 4, 10, 3, [2, 4], 53, False),      # non-contiguous logits: view() cannot flatten them
    (1, 3, 11, 10, [3], 54, True),         # a batch of one sequence, with no padding at all
]


def _sequence_variants(logits: torch.Tensor, targets: torch.Tensor, pad_index: int) -> list[tuple[float | None, str]]:
    """The values the typical wrong answers give on this case, each with its diagnosis."""
    n, t, c = logits.shape
    flat, flat_targets = logits.detach().reshape(-1, c), targets.reshape(-1)
    real = flat_targets != pad_index
    per_token = torch.zeros(len(flat_targets))
    per_token[real] = F.cross_entropy(flat[real], flat_targets[real], reduction="none")
    per_row = per_token.view(n, t)
    lengths = real.view(n, t).sum(dim=1)
    counted = lengths > 0
    in_range = 0 <= pad_index < c
    variants: list[tuple[float | None, str]] = [
        (float(per_token.sum()), _("this is the sum over the real tokens: return their mean")),
        (float(per_token.sum() / (n * t)),
         _("divided by all N x T = {positions} positions, padding included: divide by the number of real tokens").format(positions=n * t)),
        (float((per_row[counted].sum(dim=1) / lengths[counted]).mean()),
         _("this is the mean of each sequence's mean, which weighs the tokens of short sequences more: every real token must count the same")),
        (float(F.cross_entropy(flat.softmax(dim=1), flat_targets, ignore_index=pad_index)),
         _("probabilities went into cross_entropy, which applies log_softmax itself: pass the logits")),
    ]
    if in_range:
        variants.append((float(F.cross_entropy(flat, flat_targets)),
                         _("the padding positions were counted as tokens of class {pad_index}: "
                           "leave out every position whose target is pad_index").format(pad_index=pad_index)))
        nonzero = flat_targets != 0
        variants.append((float(F.cross_entropy(flat[nonzero], flat_targets[nonzero])),
                         _("positions were left out where the target is 0, not where it is pad_index ({pad_index})").format(pad_index=pad_index)))
    if t == c:
        variants.append((float(F.cross_entropy(logits.detach(), targets, ignore_index=pad_index)),
                         _("cross_entropy read dim 1 (the T positions) as the classes: it wants the classes in dim 1, "
                           "as (N, C, T), or flatten to (N*T, C) logits and (N*T,) targets")))
    return variants


@exercise("sequence_loss")
@_one_thread
def check_sequence_loss(fn) -> None:
    hints = {
        "Expected target size": N_("cross_entropy reads dim 1 of its input as the classes"),  # translated by call()
        "out of bounds": N_("a padding position reached cross_entropy as a class index: leave out the positions whose target is pad_index"),
    }
    for n, t, c, pad_index, lengths, seed, contiguous in SEQUENCE_CASES:
        data, targets = _sequence_case(n, t, c, pad_index, lengths, seed, contiguous)
        if contiguous:
            shown = _("logits of shape {logits_shape}, targets of shape {targets_shape}, pad_index={pad_index}")
        else:
            shown = _("logits of shape {logits_shape} (not contiguous), targets of shape {targets_shape}, pad_index={pad_index}")
        shown = shown.format(logits_shape=(n, t, c), targets_shape=(n, t), pad_index=pad_index)
        what = f"sequence_loss({shown})"
        logits = data.clone() if contiguous else data.transpose(1, 2).clone().transpose(1, 2)
        logits.requires_grad_(True)
        target_copy = targets.clone()
        got = call(fn, logits, target_copy, pad_index, shown=shown, hints=hints)
        expect_unchanged(targets, target_copy, what=_("{function} (its targets)").format(function="sequence_loss"))
        expect_unchanged(data, logits.detach(), what=_("{function} (its logits)").format(function="sequence_loss"))
        if isinstance(got, (float, int)) and not isinstance(got, bool):
            raise ExerciseFailed(_("{what} returned a Python number: return the loss tensor itself, so that backward() can run through it").format(what=what))
        if got is None:
            raise ExerciseFailed(_("{what} returned None: did you forget to `return` it?").format(what=what))
        if not isinstance(got, torch.Tensor):
            raise ExerciseFailed(_("{what} is {got_type}, expected a 0-d tensor").format(what=what, got_type=a_type(got)))
        if tuple(got.shape) == (n, t):
            raise ExerciseFailed(_("{what} has shape {shape}, one value per position: "
                                   "expected a 0-d tensor, the mean over the real tokens").format(what=what, shape=(n, t)))
        if tuple(got.shape) == (n,):
            raise ExerciseFailed(_("{what} has shape {shape}, one value per sequence: "
                                   "expected a 0-d tensor, the mean over every real token").format(what=what, shape=(n,)))
        if got.shape != ():
            raise ExerciseFailed(_("{what}: expected a 0-d tensor, got shape {shape}").format(what=what, shape=tuple(got.shape)))
        if not got.requires_grad:
            raise ExerciseFailed(_("{what} does not require grad: it was computed outside autograd (.item(), .detach(), torch.tensor(...) or no_grad), "
                                   "so backward() cannot reach the logits").format(what=what))
        expected = sequence_loss(data, targets, pad_index)
        value = float(got.detach())
        if math.isnan(value):
            raise ExerciseFailed(_("{what} is NaN, expected {expected:.6g}").format(what=what, expected=float(expected)))
        _diagnose(value, float(expected), [(v, _("{what}: {problem}").format(what=what, problem=m)) for v, m in _sequence_variants(data, targets, pad_index)],
                  _("{what}: expected {expected:.6g}, got {got:.6g}").format(what=what, expected=float(expected), got=value))
        reference = data.clone().requires_grad_(True)
        sequence_loss(reference, targets, pad_index).backward()
        try:
            got.backward()
        except RuntimeError as err:
            raise ExerciseFailed(_("backward() on the loss {what} returned raised RuntimeError ({message}): "
                                   "did your function call backward() itself?").format(what=what, message=str(err).splitlines()[0][:100])) from None
        if logits.grad is None:
            raise ExerciseFailed(_("{what}: backward() from your loss gives the logits no gradient: "
                                   "compute it from logits with torch operations").format(what=what))
        expect_tensor(logits.grad, reference.grad, what=_("the gradient of {what} with respect to the logits").format(what=what), atol=1e-6)


# Exercise 2: make_adamw

class _Tagger(nn.Module):
    """A toy tagger holding every kind of parameter the exercise must sort: tied, frozen, 0-D, norm, conv, and a buffer."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(13, 6)
        self.mix = nn.Conv1d(6, 6, kernel_size=3, padding=1, bias=False)
        self.norm = nn.LayerNorm(6)
        self.frozen = nn.Linear(6, 6).requires_grad_(False)
        self.head = nn.Linear(6, 13)
        self.head.weight = self.embed.weight  # tied: one tensor under two names
        self.temperature = nn.Parameter(torch.tensor(1.5))  # registered directly on the model
        self.register_buffer("positions", torch.arange(6.0))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.mix(self.embed(tokens).transpose(1, 2)).transpose(1, 2) + self.positions)
        return self.head(self.frozen(x)) / self.temperature


def _adamw_models() -> list[tuple[nn.Module, float, float, str]]:
    torch.manual_seed(21)
    mlp = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 11))
    return [(_Tagger(), 3e-4, 0.05, _("a tagger (embedding tied to the head, conv, LayerNorm, a frozen layer, a 0-d parameter)")),
            (mlp, 4e-3, 0.2, _("an MLP with BatchNorm1d"))]


ADAMW_DEFAULTS = {"betas": (0.9, 0.999), "eps": 1e-8, "amsgrad": False, "maximize": False}


@exercise("make_adamw")
@_one_thread
def check_make_adamw(fn) -> None:
    for model, lr, weight_decay, described in _adamw_models():
        what = f"make_adamw({described}, lr={lr:g}, weight_decay={weight_decay:g})"
        before = _state(model)
        flags = {name: p.requires_grad for name, p in model.named_parameters()}
        optimizer = call(fn, model, lr, weight_decay, shown=f"model, {lr:g}, {weight_decay:g}")
        changed = next((name for name, p in model.named_parameters() if p.requires_grad != flags[name]), None)
        if changed:
            raise ExerciseFailed(_("make_adamw changed requires_grad of {name!r}: "
                                   "leave the model as it is; parameter groups say what decays").format(name=changed))
        name = _changed(before, _state(model))
        if name:
            raise ExerciseFailed(_("make_adamw changed the model's {name!r}: building an optimizer must leave the model as it is").format(name=name))
        if optimizer is None:
            raise ExerciseFailed(_("{what} returned None: did you forget to `return` the optimizer?").format(what=what))
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ExerciseFailed(_("{what} returned {got_type}, expected a torch.optim.AdamW").format(what=what, got_type=a_type(optimizer)))
        if not isinstance(optimizer, torch.optim.Adam):
            raise ExerciseFailed(_("{what} returned a {optimizer}, expected a torch.optim.AdamW").format(what=what, optimizer=_kind(optimizer)))
        if not all(group.get("decoupled_weight_decay", False) for group in optimizer.param_groups):
            raise ExerciseFailed(_("{what} returned a torch.optim.Adam, whose weight decay is coupled (added to the gradient): "
                                   "use torch.optim.AdamW").format(what=what))
        names = {id(p): name for name, p in model.named_parameters()}
        seen: dict[int, dict] = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in names:
                    raise ExerciseFailed(_("{what}: the optimizer holds a tensor of shape {shape} that is not a parameter of the model").format(
                        what=what, shape=tuple(p.shape)))
                if id(p) in seen:
                    raise ExerciseFailed(_("{what}: {name!r} is in the optimizer twice: each parameter must be in exactly one group").format(
                        what=what, name=names[id(p)]))
                seen[id(p)] = group
        for name, p in model.named_parameters():
            if not p.requires_grad and id(p) in seen:
                raise ExerciseFailed(_("{what}: {name!r} is frozen (requires_grad=False) but is in the optimizer: "
                                       "leave frozen parameters out").format(what=what, name=name))
            if p.requires_grad and id(p) not in seen:
                raise ExerciseFailed(_("{what}: {name!r} (shape {shape}) is not in the optimizer: "
                                       "every trainable parameter must be in one group").format(what=what, name=name, shape=tuple(p.shape)))
        trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        for name, p in trainable:
            if not _close(float(seen[id(p)]["lr"]), lr, 1e-9):
                raise ExerciseFailed(_("{what}: {name!r} has lr {got:g}, expected {expected:g}").format(
                    what=what, name=name, got=float(seen[id(p)]["lr"]), expected=lr))
        decayed = {name for name, p in trainable if float(seen[id(p)]["weight_decay"]) != 0.0}
        should = {name for name, p in trainable if p.ndim >= 2}
        if decayed != should:
            if not decayed:
                raise ExerciseFailed(_("{what}: no parameter has weight decay; "
                                       "the ones with 2 or more dimensions should have weight_decay={weight_decay:g}").format(what=what, weight_decay=weight_decay))
            if decayed == {name for name, _p in trainable}:
                raise ExerciseFailed(_("{what}: every parameter is decayed; the ones with fewer than 2 dimensions "
                                       "({names}) should have weight_decay=0").format(
                    what=what, names=", ".join(sorted(n for n, p in trainable if p.ndim < 2))))
            by_name = [{n for n, _p in trainable if "bias" not in n}, {n for n, _p in trainable if n.endswith("weight")}]
            wrong = sorted(decayed - should) or sorted(should - decayed)
            shape = tuple(dict(trainable)[wrong[0]].shape)
            if decayed in by_name:
                raise ExerciseFailed(_("{what}: {name!r} has shape {shape} but is decayed: "
                                       "decide by the number of dimensions (p.ndim), not by the name").format(what=what, name=wrong[0], shape=shape))
            if wrong[0] in decayed:
                raise ExerciseFailed(_("{what}: {name!r} has shape {shape}, fewer than 2 dimensions, but is decayed").format(
                    what=what, name=wrong[0], shape=shape))
            raise ExerciseFailed(_("{what}: {name!r} has shape {shape}, 2 or more dimensions, but has no weight decay").format(
                what=what, name=wrong[0], shape=shape))
        for name, p in trainable:
            group = seen[id(p)]
            if p.ndim >= 2 and not _close(float(group["weight_decay"]), weight_decay, 1e-9):
                raise ExerciseFailed(_("{what}: {name!r} has weight_decay {got:g}, expected {expected:g}").format(
                    what=what, name=name, got=float(group["weight_decay"]), expected=weight_decay))
            for key, default in ADAMW_DEFAULTS.items():
                if key in group and group[key] != default and not (key == "betas" and tuple(map(float, group[key])) == default):
                    raise ExerciseFailed(_("{what}: {name!r} has {key}={value!r}, expected AdamW's default {default!r}").format(
                        what=what, name=name, key=key, value=group[key], default=default))


# Exercise 3: warmup_cosine

def _target_lr(step: int, base: float, warmup_steps: int, total_steps: int, start_factor: float, min_lr: float) -> float:
    if step < warmup_steps:
        return base * (start_factor + (1 - start_factor) * step / warmup_steps)
    progress = (step - warmup_steps) / (total_steps - warmup_steps)
    return min_lr + (base - min_lr) * (1 + math.cos(math.pi * progress)) / 2


WARMUP_CASES = [  # (learning rates of the param groups, optimizer, warmup_steps, total_steps, start_factor, min_lr)
    ((0.3, 0.06), "SGD", 3, 11, 0.2, 1e-3),
    ((0.02,), "AdamW", 1, 6, 0.5, 2e-4),
]


def _lr_optimizer(lrs: tuple[float, ...], kind: str) -> torch.optim.Optimizer:
    groups = [{"params": [nn.Parameter(torch.zeros(2))], "lr": lr} for lr in lrs]
    return torch.optim.SGD(groups, lr=lrs[0], momentum=0.9) if kind == "SGD" else torch.optim.AdamW(groups, lr=lrs[0])


@exercise("warmup_cosine")
@_one_thread
def check_warmup_cosine(fn) -> None:
    for lrs, kind, warmup, total, start, min_lr in WARMUP_CASES:
        optimizer = _lr_optimizer(lrs, kind)
        args = f"{warmup}, {total}, {start:g}, {min_lr:g}"
        if len(lrs) > 1:
            described = _("{optimizer} with lrs {lrs}").format(optimizer=kind, lrs=", ".join(map(str, lrs)))
        else:
            described = _("{optimizer} with lr {lr}").format(optimizer=kind, lr=lrs[0])
        what = f"warmup_cosine({described}, {args})"
        scheduler = call(fn, optimizer, warmup, total, start, min_lr, shown=f"optimizer, {args}")
        if scheduler is None:
            raise ExerciseFailed(_("{what} returned None: did you forget to `return` the scheduler?").format(what=what))
        if scheduler is optimizer or isinstance(scheduler, torch.optim.Optimizer):
            raise ExerciseFailed(_("{what} returned an optimizer ({optimizer}), expected a learning-rate scheduler").format(
                what=what, optimizer=_kind(scheduler)))
        if not isinstance(scheduler, LRScheduler):
            raise ExerciseFailed(_("{what} returned {got_type}, expected a learning-rate scheduler (torch.optim.lr_scheduler)").format(
                what=what, got_type=a_type(scheduler)))
        if getattr(scheduler, "optimizer", None) is not optimizer:
            raise ExerciseFailed(_("{what}: the scheduler drives another optimizer than the one it was given").format(what=what))
        got = []
        for step in range(total + 1):
            got.append([float(group["lr"]) for group in optimizer.param_groups])
            if step == total:
                break
            optimizer.step()  # no gradients, so nothing moves; it keeps the order warning quiet
            try:
                scheduler.step()
            except Exception as err:  # noqa: BLE001 -- raised by the learner's scheduler
                raise ExerciseFailed(_("{what}: its step() number {number} raised {error}: {message}").format(
                    what=what, number=step + 1, error=type(err).__name__, message=str(err).splitlines()[0][:150])) from None
        for g, base in enumerate(lrs):
            curve = [lr[g] for lr in got]
            expected = [_target_lr(s, base, warmup, total, start, min_lr) for s in range(total + 1)]
            label = _("param group {group}'s lr").format(group=g) if len(lrs) > 1 else _("the lr")
            own = _(" (its own lr is {lr:g})").format(lr=base) if len(lrs) > 1 else ""
            if g > 0 and all(_close(a, b, 1e-6) for a, b in zip(curve, [lr[0] for lr in got])):
                raise ExerciseFailed(_("{what}: param group {group} follows group 0's learning rates: "
                                       "each group must follow its own lr ({lr:g}), scaled").format(what=what, group=g, lr=base))
            if not _close(curve[0], expected[0], 1e-6):
                raise ExerciseFailed(_("{what}: at step 0 {label} is {got:.6g}, expected start_factor x lr = {expected:.6g}{own}").format(
                    what=what, label=label, got=curve[0], expected=expected[0], own=own))
            peak = max(range(total + 1), key=lambda s: (curve[s], -s))
            if peak != warmup and not _close(curve[peak], curve[warmup], 1e-6):
                raise ExerciseFailed(_("{what}: {label} peaks at step {peak}, expected at step warmup_steps = {warmup}").format(
                    what=what, label=label, peak=peak, warmup=warmup))
            if not _close(curve[warmup], base, 1e-6):
                raise ExerciseFailed(_("{what}: at step warmup_steps = {warmup} {label} is {got:.6g}, expected the full lr {lr:g}").format(
                    what=what, warmup=warmup, label=label, got=curve[warmup], lr=base))
            if not _close(curve[total], min_lr, 1e-6):
                raise ExerciseFailed(_("{what}: at step total_steps = {total} {label} is {got:.6g}, expected min_lr = {min_lr:g}").format(
                    what=what, total=total, label=label, got=curve[total], min_lr=min_lr))
            for step, (a, b) in enumerate(zip(curve, expected)):
                if not _close(a, b, 1e-6):
                    phase = _("warm-up") if step < warmup else _("cosine")
                    raise ExerciseFailed(_("{what}: at step {step} ({phase}) {label} is {got:.6g}, expected {expected:.6g}").format(
                        what=what, step=step, phase=phase, label=label, got=a, expected=b))


# Exercise 4: accumulation_step

class _Net(nn.Module):
    """A frozen layer (its .grad stays None), two trained ones and a scalar registered directly on the model."""

    def __init__(self):
        super().__init__()
        self.frozen = nn.Linear(7, 7).requires_grad_(False)
        self.hidden = nn.Linear(7, 9)
        self.out = nn.Linear(9, 12)
        self.scale = nn.Parameter(torch.tensor(0.8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(self.frozen(x)))) * self.scale


ACCUMULATION_CASES = [  # (micro-batch sizes, max_norm, seed): unclipped first, so that a scale error shows
    ([6, 1, 3], 50.0, 31),
    ([5, 5, 5, 2], 0.15, 32),
]
STALE = 0.25  # what the check leaves in .grad before the call


def _micro_batches(sizes: list[int], seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 7, generator=g), torch.randint(0, 12, (n,), generator=g)) for n in sizes]


def _clipped(grads: dict[str, torch.Tensor], max_norm: float) -> dict[str, torch.Tensor]:
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
    scale = min(1.0, max_norm / (float(norm) + 1e-6))
    return {k: g * scale for k, g in grads.items()}


def _gradient(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad()
    F.cross_entropy(model(inputs), targets).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}


def _same_grads(a: dict[str, torch.Tensor | None], b: dict[str, torch.Tensor]) -> bool:
    return all(a.get(k) is not None and a[k].shape == v.shape and torch.allclose(a[k], v, atol=1e-5, rtol=1e-4) for k, v in b.items())


def _flat(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.detach().flatten().double() for g in grads.values()])


def _parallel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """True when two sets of gradients point the same way (one is a positive multiple of the other)."""
    x, y = _flat(a), _flat(b)
    return x.shape == y.shape and bool(F.cosine_similarity(x, y, dim=0) > 1 - 1e-6)


def _record_pass(passes: list[tuple[str, int]], module: nn.Module, args: tuple, output) -> None:
    """A forward hook: note the pass and its batch size, and note again when backward() reaches its output."""
    samples = args[0].shape[0] if args and isinstance(args[0], torch.Tensor) and args[0].ndim else -1
    passes.append(("forward", samples))
    if isinstance(output, torch.Tensor) and output.requires_grad:
        output.register_hook(lambda grad: passes.append(("backward", samples)))


def _expect_one_pass_per_micro_batch(passes: list[tuple[str, int]], sizes: list[int], what: str) -> None:
    """The point of accumulation: the model never sees more than one micro-batch at a time, and frees each graph before the next."""
    forwards = [samples for kind, samples in passes if kind == "forward"]
    total = sum(sizes)
    if total in forwards and len(sizes) > 1:
        raise ExerciseFailed(_("{what} ran the model on all {total} samples at once: accumulation exists because that whole batch does not "
                               "fit in memory; run one forward and one backward per micro-batch").format(what=what, total=total))
    if sorted(forwards) != sorted(sizes):
        raise ExerciseFailed(_("{what}: the model's forward passes got batches of {forwards} samples, expected one pass per micro-batch, "
                               "of {sizes}").format(what=what, forwards=forwards, sizes=sizes))
    for i, ((kind, _samples), (next_kind, _next_samples)) in enumerate(zip(passes, passes[1:])):
        if kind == next_kind == "forward":
            k = sum(1 for p in passes[:i + 1] if p[0] == "forward")
            raise ExerciseFailed(_(
                "{what}: the forward pass of micro-batch {next_batch} ran before the backward() of micro-batch {batch}: each graph holds its "
                "micro-batch's activations until its backward(), so adding up the losses and calling backward() once holds the whole "
                "batch's activations, as one big batch would; call backward() on each micro-batch's loss before the next forward pass"
            ).format(what=what, next_batch=k + 1, batch=k))


@exercise("accumulation_step")
@_one_thread
def check_accumulation_step(fn) -> None:
    for sizes, max_norm, seed in ACCUMULATION_CASES:
        torch.manual_seed(seed)
        model = _Net()
        micro_batches = _micro_batches(sizes, seed)
        k, total = len(sizes), sum(sizes)
        listed = ", ".join(map(str, sizes))
        described = _("micro-batches of {sizes}").format(sizes=listed)
        what = f"accumulation_step({described}, max_norm={max_norm:g})"

        probe = copy.deepcopy(model)
        full = _gradient(probe, torch.cat([x for x, _y in micro_batches]), torch.cat([y for _x, y in micro_batches]))
        parts = [_gradient(probe, x, y) for x, y in micro_batches]
        full_norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in full.values()])))
        expected_grads = _clipped(full, max_norm)
        reference = copy.deepcopy(model)
        ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
        accumulation_step(reference, micro_batches, F.cross_entropy, ref_optimizer, max_norm)

        def combine(weights: list[float], extra: float = 0.0) -> dict[str, torch.Tensor]:
            return {name: sum(w * part[name] for w, part in zip(weights, parts)) + extra for name in full}

        only_last = _("only the last micro-batch's gradient reached the step: clear the gradients once, before the loop, not inside it")
        variants = [
            (_clipped(combine([1 / k] * k), max_norm),
             _("each micro-batch's loss was divided by the number of micro-batches ({k}); with sizes {sizes}, "
               "weight each by its share of the samples, len(targets) / {total}").format(k=k, sizes=sizes, total=total)),
            (_clipped(combine([1.0] * k), max_norm),
             _("the micro-batch losses were added up unweighted: weight each by its share of the samples, "
               "len(targets) / {total}").format(total=total)),
            (_clipped({n: g + STALE for n, g in full.items()}, max_norm),
             _("the gradients left in .grad from before counted too: clear them once, before the first micro-batch")),
            (_clipped(combine([0.0] * (k - 1) + [sizes[-1] / total]), max_norm), only_last),
            (_clipped(combine([0.0] * (k - 1) + [1 / k]), max_norm), only_last),
            (_clipped(combine([0.0] * (k - 1) + [1.0]), max_norm), only_last),
        ]
        if full_norm > max_norm:
            variants.append((full, _("the step used the unclipped gradient: clip with clip_grad_norm_ after the last backward() and before step()")))

        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for p in model.parameters():
            if p.requires_grad:
                p.grad = torch.full_like(p, STALE)  # gradients left over from an earlier step
        at_step: list[dict] = []
        passes: list[tuple[str, int]] = []  # ("forward", samples) per forward pass, ("backward", samples) when backward reaches its output
        handles = [optimizer.register_step_pre_hook(lambda opt, args, kwargs: at_step.append(_param_grads(model))),
                   model.register_forward_hook(functools.partial(_record_pass, passes))]
        given = [(x.clone(), y.clone()) for x, y in micro_batches]
        try:
            counted = _("{n} micro-batches of {sizes}").format(n=k, sizes=listed)
            shown = f"model, {counted}, F.cross_entropy, optimizer, {max_norm:g}"
            got = call(fn, model, given, F.cross_entropy, optimizer, max_norm, shown=shown)
        finally:
            for handle in handles:
                handle.remove()
        for (x, y), (gx, gy) in zip(micro_batches, given):
            expect_unchanged(x, gx, what=_("{function} (its micro-batches)").format(function="accumulation_step"))
            expect_unchanged(y, gy, what=_("{function} (its micro-batches)").format(function="accumulation_step"))
        _expect_one_pass_per_micro_batch(passes, sizes, what)
        if not at_step:
            raise ExerciseFailed(_("{what}: optimizer.step() was never called: the step is part of the exercise").format(what=what))
        if len(at_step) > 1:
            raise ExerciseFailed(_("{what}: optimizer.step() was called {n} times: call it once, after the last micro-batch").format(
                what=what, n=len(at_step)))
        grads = {name: g for name, g in at_step[0].items() if name in full}
        missing = [name for name, g in grads.items() if g is None]
        if missing:
            raise ExerciseFailed(_("{what}: {name!r} had no gradient at the step: call backward() on every micro-batch's loss").format(
                what=what, name=missing[0]))
        if not _same_grads(grads, expected_grads):
            for variant, message in variants:
                if _same_grads(grads, variant) and not _same_grads(variant, expected_grads):
                    raise ExerciseFailed(_("{what}: {problem}").format(what=what, problem=message))
            if _parallel(grads, combine([1.0] * k)) and not _parallel(expected_grads, combine([1.0] * k)):
                raise ExerciseFailed(_("{what}: every micro-batch's loss was given the same weight, whatever its size; with sizes {sizes}, "
                                       "weight each by its share of the samples, len(targets) / {total}").format(what=what, sizes=sizes, total=total))
            if _parallel(grads, full):
                ratio = float(_flat(grads).norm() / _flat(expected_grads).norm())
                raise ExerciseFailed(_("{what}: the gradient at the step points the right way, but is {ratio:.3g} times as long as it should be").format(
                    what=what, ratio=ratio))
            name = next(n for n in full if not torch.allclose(grads[n], expected_grads[n], atol=1e-5, rtol=1e-4))
            expect_tensor(grads[name], expected_grads[name], what=_("{what}: the gradient of {name!r} at the step").format(what=what, name=name),
                          atol=1e-5, rtol=1e-4)
        if isinstance(got, torch.Tensor):
            raise ExerciseFailed(_("{what} returned a tensor, expected a Python float: call .item() on the norm").format(what=what))
        if got is None:
            raise ExerciseFailed(_("{what} returned None: return the total gradient norm from before clipping").format(what=what))
        norm = _expect_float(got, _("the value {what} returned").format(what=what))
        if full_norm > max_norm and _close(norm, max_norm, 1e-4):
            raise ExerciseFailed(_("{what} returned {norm:.6g}, the norm after clipping: return the total norm from before clipping "
                                   "(clip_grad_norm_ returns it)").format(what=what, norm=norm))
        if not _close(norm, full_norm, 1e-4):
            raise ExerciseFailed(_("{what} returned {norm:.6g}, expected the total gradient norm before clipping, {expected:.6g}").format(
                what=what, norm=norm, expected=full_norm))
        name = _changed(_state(reference), _state(model))
        if name:
            expect_tensor(model.state_dict()[name], reference.state_dict()[name], what=_("{what}: {name!r} after the step").format(what=what, name=name),
                          atol=1e-5, rtol=1e-4)


# Exercise 5: overfit_one_batch

def _overfit_cases() -> list[tuple[nn.Module, str, torch.Tensor, torch.Tensor, Callable, str, int, float]]:
    """(model, its mode, inputs, targets, loss_fn, description, steps, lr): a classifier with batch norm and dropout in train mode,
    then a regression model with dropout in eval mode, as a caller in the middle of an evaluation has it."""
    g = torch.Generator().manual_seed(71)
    torch.manual_seed(72)
    classifier = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 5))
    regressor = nn.Sequential(nn.Linear(4, 12), nn.Tanh(), nn.Dropout(0.5), nn.Linear(12, 2))
    return [
        (classifier, "train", torch.randn(6, 6, generator=g), torch.randint(0, 5, (6,), generator=g), F.cross_entropy,
         _("an MLP with batch norm and dropout (train mode), a batch of {n}, {loss_fn}").format(n=6, loss_fn="F.cross_entropy"), 20, 0.03),
        (regressor, "eval", torch.randn(3, 4, generator=g), torch.randn(3, 2, generator=g), F.mse_loss,
         _("a regression MLP with dropout (eval mode), a batch of {n}, {loss_fn}").format(n=3, loss_fn="F.mse_loss"), 12, 0.05),
    ]


def _overfit_run(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, loss_fn: Callable, steps: int,
                 make_optimizer: Callable, zero_grad: bool = True) -> list[float]:
    """A typical wrong answer's losses: another optimizer, or no zero_grad(). Dropout off, as the reference has it."""
    model.train()
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.eval()
    optimizer = make_optimizer(model.parameters())
    losses = []
    for _step in range(steps):
        if zero_grad:
            optimizer.zero_grad()
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _overfit_variants(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, loss_fn: Callable, steps: int,
                      lr: float) -> list[tuple[list[float], str]]:
    """The losses of the typical wrong answers on this case, each with its diagnosis."""
    runs = [
        (lambda p: torch.optim.SGD(p, lr=lr), True, _("these are the losses of torch.optim.SGD: the prompt asks for torch.optim.Adam")),
        (lambda p: torch.optim.AdamW(p, lr=lr), True,
         _("these are the losses of torch.optim.AdamW, which decays the weights by default (weight_decay=0.01): use torch.optim.Adam, "
           "whose default is no decay")),
        (lambda p: torch.optim.Adam(p), True, _("these are the losses of Adam at its default lr, 1e-3: pass lr")),
        (lambda p: torch.optim.Adam(p, lr=lr), False,
         _("the gradients piled up from step to step: call optimizer.zero_grad() before each backward()")),
    ]
    return [(_overfit_run(copy.deepcopy(model), inputs, targets, loss_fn, steps, make, zero_grad), message) for make, zero_grad, message in runs]


def _modes(model: nn.Module) -> dict[str, bool]:
    return {name: module.training for name, module in model.named_modules()}


def _mode_message(before: dict[str, bool], after: dict[str, bool], modules: dict[str, nn.Module]) -> str | None:
    """What differs between the modes a caller gave the model and those it got back, in one line, or None."""
    if after == before:
        return None
    if not any(after.values()) and any(before.values()):
        return _("the model was left in eval mode: put every module back in the mode it had before the call")
    if all(after.values()) and not any(before.values()):
        return _("the model was left in train mode, but the caller had it in eval mode: restore the mode it had, do not assume train")
    name = next(n for n in before if before[n] != after[n])
    label = f"{name!r} ({type(modules[name]).__name__})" if name else _("the model itself")
    was, now = ("train", "eval") if before[name] else ("eval", "train")  # the modes' own names, as model.train() and model.eval() set them
    return _("{module} was in {was} mode before the call and is in {now} mode after: "
             "leave every module in the mode it had").format(module=label, was=was, now=now)


@exercise("overfit_one_batch")
@_one_thread
def check_overfit_one_batch(fn) -> None:
    for model, mode, inputs, targets, loss_fn, described, steps, lr in _overfit_cases():
        model.train(mode == "train")
        shown = f"{described}, steps={steps}, lr={lr:g}"
        what = f"overfit_one_batch({shown})"
        initial, reference = copy.deepcopy(model), copy.deepcopy(model)
        expected = overfit_one_batch(reference, inputs, targets, loss_fn, steps, lr)
        modules = dict(model.named_modules())
        modes_before, rates = _modes(model), {name: m.p for name, m in modules.items() if isinstance(m, nn.Dropout)}
        given = (inputs.clone(), targets.clone())
        forwards: list[bool] = []  # for each forward pass of the model: was its input the batch?
        dropout_active: list[bool] = []
        norm_in_eval: list[bool] = []
        handles = [model.register_forward_pre_hook(lambda m, args: forwards.append(bool(args) and isinstance(args[0], torch.Tensor)
                                                                                   and args[0].shape == inputs.shape and torch.equal(args[0], inputs)))]
        for m in model.modules():
            if isinstance(m, nn.Dropout):
                handles.append(m.register_forward_hook(lambda m, args, out: dropout_active.append(not torch.equal(args[0], out))))
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                handles.append(m.register_forward_pre_hook(lambda m, args: norm_in_eval.append(not m.training)))
        try:
            got = call(fn, model, given[0], given[1], loss_fn, steps, lr, shown=shown)
        finally:
            for handle in handles:
                handle.remove()
        expect_unchanged(inputs, given[0], what=_("{function} (its inputs)").format(function="overfit_one_batch"))
        expect_unchanged(targets, given[1], what=_("{function} (its targets)").format(function="overfit_one_batch"))
        if isinstance(got, torch.Tensor):
            raise ExerciseFailed(_("{what} returned a tensor, expected a list of {steps} Python floats, one per step").format(what=what, steps=steps))
        losses = _expect_losses(got, what, "step")
        if len(forwards) != steps:
            per = _(" ({n:g} per step)").format(n=len(forwards) / steps) if len(forwards) % steps == 0 and forwards else ""
            raise ExerciseFailed(_("{what} ran the model {n} times{per}, expected {steps}: one forward pass per step, "
                                   "whose loss is the step's loss").format(what=what, n=len(forwards), per=per, steps=steps))
        if not all(forwards):
            k = forwards.index(False)
            raise ExerciseFailed(_("{what}: the forward pass of step {step} did not get the batch it was given: every step trains on "
                                   "that one batch, whole and unchanged").format(what=what, step=k + 1))
        if any(dropout_active):
            k = dropout_active.index(True)
            raise ExerciseFailed(_("{what}: dropout was active in the forward pass of step {step}, so each step saw another "
                                   "random network: put every nn.Dropout in eval mode for the run").format(what=what, step=k // len(rates) + 1))
        if any(norm_in_eval):
            raise ExerciseFailed(_("{what}: batch norm ran in eval mode, normalising with its running statistics instead of the batch's: "
                                   "model.eval() switches batch norm too; switch only the dropout layers to eval").format(what=what))
        if len(losses) != steps:
            raise ExerciseFailed(_("{what} returned {n} losses, expected {steps}, one per step").format(what=what, n=len(losses), steps=steps))
        if not all(_close(a, b, 1e-4) for a, b in zip(losses, expected)):
            if len(set(losses)) == 1 and steps > 1:
                raise ExerciseFailed(_("{what}: the loss is {loss:.6g} at every step, so the weights never changed: "
                                       "optimizer.step() must come after backward(), with the gradients still in place").format(what=what, loss=losses[0]))
            k = next(i for i, (a, b) in enumerate(zip(losses, expected)) if not _close(a, b, 1e-4))
            for variant, message in _overfit_variants(initial, inputs, targets, loss_fn, steps, lr):
                if all(_close(a, b, 1e-4) for a, b in zip(losses, variant)):
                    raise ExerciseFailed(_("{what}: {problem}").format(what=what, problem=message))
            raise ExerciseFailed(_("{what}: the loss of step {step} is {got:.6g}, expected {expected:.6g} "
                                   "(one Adam step with lr per forward pass, on the loss of that forward pass)").format(
                what=what, step=k + 1, got=losses[k], expected=expected[k]))
        for name, value in reference.state_dict().items():
            if not torch.allclose(model.state_dict()[name].double(), value.double(), atol=1e-5, rtol=1e-4):
                raise ExerciseFailed(_("{what}: the losses are right, but the model's {name!r} at the end is not what {steps} steps give").format(
                    what=what, name=name, steps=steps))
        message = _mode_message(modes_before, _modes(model), modules)
        if message:
            raise ExerciseFailed(_("{what}: {problem}").format(what=what, problem=message))
        changed = next((name for name, rate in rates.items() if modules[name].p != rate), None)
        if changed:
            raise ExerciseFailed(_("{what} left {name!r} with p={p}, it had p={old_p}: switch dropout off "
                                   "with eval mode, or put its p back afterwards").format(what=what, name=changed, p=modules[changed].p, old_p=rates[changed]))


# Exercise 6: train_resumable

class _Crash(BaseException):
    """The check's crash in the middle of an epoch (a BaseException, so that `except Exception` lets it through, as a kill would)."""


class _CrashingLoader(DataLoader):
    """A DataLoader that raises _Crash after serving `crash_at` batches in all (None: never)."""

    def __init__(self, *args, crash_at: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.crash_at = crash_at
        self.served = 0

    def __iter__(self):
        for batch in super().__iter__():
            if self.crash_at is not None and self.served == self.crash_at:
                raise _Crash()
            self.served += 1
            yield batch


RESUME_EPOCHS, RESUME_BATCH = 4, 5
RESUMED_EPOCHS = 5  # the resumed call asks for more epochs in all than the crashed one did, as a run extended after a stop does
RESUME_SAMPLES = 23  # batches of 5, 5, 5, 5 and 3
RESUME_BATCHES = -(-RESUME_SAMPLES // RESUME_BATCH)


def _resume_run(seed: int, crash_at: int | None = None):
    """Model (with dropout), loader shuffling with its own generator, SGD with momentum, a milestone schedule: all from one seed."""
    g = torch.Generator().manual_seed(61)
    data = TensorDataset(torch.randn(RESUME_SAMPLES, 6, generator=g), torch.randint(0, 12, (RESUME_SAMPLES,), generator=g))
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.25), nn.Linear(16, 12))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[1, 3], gamma=0.5)
    shuffle = torch.Generator().manual_seed(seed + 1)
    loader = _CrashingLoader(data, batch_size=RESUME_BATCH, shuffle=True, generator=shuffle, crash_at=crash_at)
    return model, loader, optimizer, scheduler, shuffle


class _Snapshot:
    """The training state at the model's forward call number `at` (a forward pre-hook), and the number of calls."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: LRScheduler, at: int):
        self.model, self.optimizer, self.scheduler, self.at = model, optimizer, scheduler, at
        self.calls, self.state = 0, None
        self.handle = model.register_forward_pre_hook(self.hook)

    def hook(self, module: nn.Module, args: tuple) -> None:
        if self.calls == self.at:
            momentum = [self.optimizer.state.get(p, {}).get("momentum_buffer") for p in self.model.parameters()]
            self.state = {
                "weights": _state(self.model),
                "momentum": [m.clone() if isinstance(m, torch.Tensor) else None for m in momentum],
                "epochs": self.scheduler.last_epoch,
                "lr": [group["lr"] for group in self.optimizer.param_groups],
                "batch": args[0].detach().clone() if args and isinstance(args[0], torch.Tensor) else None,
                "rng": torch.get_rng_state(),
            }
        self.calls += 1


@contextlib.contextmanager
def _spy_on_torch_load(calls: list) -> Iterator[None]:
    """Record the weights_only argument of every torch.load call made through the torch module."""
    original = torch.load

    def spy(*args, **kwargs):
        calls.append(kwargs.get("weights_only", "default"))
        return original(*args, **kwargs)

    torch.load = spy
    try:
        yield
    finally:
        torch.load = original


def _expect_losses(got, what: str, per: str = "epoch") -> list[float]:
    """The learner's list of losses, one per epoch (per="epoch") or one per step (per="step")."""
    if got is None:
        if per == "step":
            raise ExerciseFailed(_("{what} returned None: return the list of every step's loss").format(what=what))
        raise ExerciseFailed(_("{what} returned None: return the list of every epoch's loss").format(what=what))
    if not isinstance(got, (list, tuple)):
        if per == "step":
            raise ExerciseFailed(_("{what} returned {got_type}, expected a list of floats, one per step").format(what=what, got_type=a_type(got)))
        raise ExerciseFailed(_("{what} returned {got_type}, expected a list of floats, one per epoch").format(what=what, got_type=a_type(got)))
    if any(isinstance(v, torch.Tensor) for v in got):
        raise ExerciseFailed(_("{what} returned tensors in its list: return Python floats (.item() gives one)").format(what=what))
    if not all(isinstance(v, (float, int)) and not isinstance(v, bool) for v in got):
        raise ExerciseFailed(_("{what} returned a list holding {got_type}, expected floats").format(
            what=what, got_type=a_type(next(v for v in got if not isinstance(v, (float, int))))))
    return [float(v) for v in got]


def _load_checkpoint_file(path: Path, when: str) -> None:
    if not path.exists():
        raise ExerciseFailed(_("{when}, there is no checkpoint at `path`: save one there after every epoch with torch.save").format(when=when))
    try:
        checkpoint = torch.load(path, weights_only=True)
    except Exception as err:  # noqa: BLE001 -- the learner's file
        lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip() for line in str(err).strip().splitlines()] or [""]
        reason = next((line for line in lines if "Unsupported global" in line), lines[0]).split(". ")[0][:140]
        raise ExerciseFailed(_("{when}, the checkpoint does not load with torch.load(weights_only=True) ({error}: "
                               "{reason}): save state_dicts, tensors and plain Python values, not objects").format(
            when=when, error=type(err).__name__, reason=reason)) from None
    rng = checkpoint.get("rng") if isinstance(checkpoint, dict) else None
    if isinstance(rng, dict) and {"python", "numpy", "torch"} <= set(rng):
        raise ExerciseFailed(_("the checkpoint has the layout of course_utils' save_checkpoint: this exercise is that function; "
                               "write the dict yourself and save it with torch.save"))


RESUME_SHOWN = f"model, loader, F.cross_entropy, optimizer, scheduler, shuffle, {RESUME_EPOCHS}, path"


@exercise("train_resumable")
@_one_thread
def check_train_resumable(fn) -> None:
    seed, crash_epoch = 5, 3
    model, loader, optimizer, scheduler, _shuffle = _resume_run(seed)  # the run as it goes when nothing interrupts it
    snap = _Snapshot(model, optimizer, scheduler, at=(crash_epoch - 1) * RESUME_BATCHES)
    expected_losses = []
    for epoch in range(1, RESUMED_EPOCHS + 1):
        expected_losses.append(train_one_epoch(model, loader, F.cross_entropy, optimizer))
        scheduler.step()
        if epoch == RESUME_EPOCHS:
            expected_weights, expected_lr = _state(model), optimizer.param_groups[0]["lr"]
    snap.handle.remove()
    resumed_at, final_weights = snap.state, _state(model)

    loads: list = []
    with tempfile.TemporaryDirectory() as folder, _spy_on_torch_load(loads):
        # 1. From scratch, with no checkpoint: the same numbers as plain training.
        path = Path(folder) / "whole.pt"
        model, loader, optimizer, scheduler, shuffle = _resume_run(seed)
        what = _("{call} with no checkpoint yet").format(call=f"train_resumable(..., epochs={RESUME_EPOCHS})")
        losses = _expect_losses(call(fn, model, loader, F.cross_entropy, optimizer, scheduler, shuffle, RESUME_EPOCHS, path, shown=RESUME_SHOWN), what)
        if len(losses) != RESUME_EPOCHS:
            raise ExerciseFailed(_("{what} returned {n} losses, expected {epochs}, one per epoch").format(what=what, n=len(losses), epochs=RESUME_EPOCHS))
        if not _close(optimizer.param_groups[0]["lr"], expected_lr, 1e-9):
            raise ExerciseFailed(_("{what}: the learning rate at the end is {got:.6g}, expected {expected:.6g}: "
                                   "step the scheduler once per epoch").format(what=what, got=optimizer.param_groups[0]["lr"], expected=expected_lr))
        for epoch, (a, b) in enumerate(zip(losses, expected_losses[:RESUME_EPOCHS]), start=1):
            if not _close(a, b, 1e-6):
                raise ExerciseFailed(_("{what}: epoch {epoch}'s loss is {got:.6g}, expected {expected:.6g}, as plain training gives "
                                       "(one train_one_epoch and one scheduler.step() per epoch)").format(what=what, epoch=epoch, got=a, expected=b))
        name = _changed(expected_weights, _state(model))
        if name:
            raise ExerciseFailed(_("{what}: {name!r} at the end differs from plain training's, though the losses agree").format(what=what, name=name))
        _load_checkpoint_file(path, _("after {what}").format(what=what))

        # 2. The same run, crashed in the middle of epoch 3.
        path = Path(folder) / "run.pt"
        model, loader, optimizer, scheduler, shuffle = _resume_run(seed, crash_at=(crash_epoch - 1) * RESUME_BATCHES + 2)
        try:
            call(fn, model, loader, F.cross_entropy, optimizer, scheduler, shuffle, RESUME_EPOCHS, path, shown=RESUME_SHOWN)
        except _Crash:
            pass
        else:
            raise ExerciseFailed(_("the loader raised an exception in the middle of epoch {epoch}, and train_resumable returned "
                                   "as if nothing happened: let exceptions through").format(epoch=crash_epoch))
        _load_checkpoint_file(path, _("after {finished} finished epochs and a crash in epoch {epoch}").format(finished=crash_epoch - 1, epoch=crash_epoch))

        # 3. Resumed with objects built from another seed (other weights, RNG and shuffle generator), now for more epochs in all.
        model, loader, optimizer, scheduler, shuffle = _resume_run(seed + 100)
        snap = _Snapshot(model, optimizer, scheduler, at=0)
        what = _("{call} resumed after a crash in epoch {epoch}").format(call=f"train_resumable(..., epochs={RESUMED_EPOCHS})", epoch=crash_epoch)
        try:
            got = call(fn, model, loader, F.cross_entropy, optimizer, scheduler, shuffle, RESUMED_EPOCHS, path,
                       shown=RESUME_SHOWN.replace(f", {RESUME_EPOCHS}, path", f", {RESUMED_EPOCHS}, path"))
        finally:
            snap.handle.remove()
    left = (RESUMED_EPOCHS - crash_epoch + 1) * RESUME_BATCHES
    if snap.calls != left:
        if snap.calls % RESUME_BATCHES == 0:
            done = _("{epochs:g} epochs").format(epochs=snap.calls / RESUME_BATCHES)
        else:
            done = _("not a whole number of epochs")
        hint = ""
        if snap.calls == (RESUME_EPOCHS - crash_epoch + 1) * RESUME_BATCHES:
            hint = _(" (it stopped after epoch {epoch}, where the crashed call was to stop: go by this call's epochs)").format(epoch=RESUME_EPOCHS)
        raise ExerciseFailed(_("{what}: it trained {batches} batches ({done}), expected {expected}: epochs {first} to {last}, "
                               "starting after the last epoch the checkpoint holds{hint}").format(
            what=what, batches=snap.calls, done=done, expected=left, first=crash_epoch, last=RESUMED_EPOCHS, hint=hint))
    state = snap.state
    if _changed(resumed_at["weights"], state["weights"]):
        raise ExerciseFailed(_("{what}: when training resumed, the weights were not those the uninterrupted run had after epoch {epoch}: "
                               "save model.state_dict() after every epoch and load it with model.load_state_dict").format(what=what, epoch=crash_epoch - 1))
    if any(m is None for m in state["momentum"]) or any(not torch.equal(a, b) for a, b in zip(resumed_at["momentum"], state["momentum"])):
        raise ExerciseFailed(_("{what}: when training resumed, the optimizer's momentum buffers were not those the uninterrupted run had "
                               "after epoch {epoch}: save optimizer.state_dict() and load it with optimizer.load_state_dict").format(
            what=what, epoch=crash_epoch - 1))
    if state["epochs"] != resumed_at["epochs"]:
        raise ExerciseFailed(ngettext(
            "{what}: when training resumed, the scheduler had been stepped {n} time, expected {expected} "
            "(once per finished epoch): save scheduler.state_dict() after its step and load it with scheduler.load_state_dict",
            "{what}: when training resumed, the scheduler had been stepped {n} times, expected {expected} "
            "(once per finished epoch): save scheduler.state_dict() after its step and load it with scheduler.load_state_dict",
            state["epochs"]).format(what=what, n=state["epochs"], expected=resumed_at["epochs"]))
    if state["lr"] != resumed_at["lr"]:
        raise ExerciseFailed(_("{what}: when training resumed, the learning rate was {got:.6g}, expected {expected:.6g}").format(
            what=what, got=state["lr"][0], expected=resumed_at["lr"][0]))
    if state["batch"] is None or not torch.equal(state["batch"], resumed_at["batch"]):
        raise ExerciseFailed(_("{what}: the first batch after resuming is not the one the uninterrupted run drew; the loader shuffles with "
                               "`shuffle`: save shuffle.get_state() and restore it with shuffle.set_state()").format(what=what))
    if not torch.equal(state["rng"], resumed_at["rng"]):
        raise ExerciseFailed(_("{what}: when training resumed, torch's global random state, which dropout draws from, "
                               "was not where the uninterrupted run had it: "
                               "save torch.get_rng_state() and restore it with torch.set_rng_state()").format(what=what))
    losses = _expect_losses(got, what)
    if len(losses) == RESUMED_EPOCHS - crash_epoch + 1:
        raise ExerciseFailed(_("{what} returned only the losses of the epochs after resuming: the curve must hold all {epochs} "
                               "epochs, so keep the losses so far in the checkpoint").format(what=what, epochs=RESUMED_EPOCHS))
    if len(losses) != RESUMED_EPOCHS:
        raise ExerciseFailed(_("{what} returned {n} losses, expected {epochs}, one per epoch").format(what=what, n=len(losses), epochs=RESUMED_EPOCHS))
    for epoch, (a, b) in enumerate(zip(losses, expected_losses), start=1):
        if not _close(a, b, 1e-6):
            raise ExerciseFailed(_("{what}: epoch {epoch}'s loss is {got:.6g}, expected {expected:.6g}, the uninterrupted run's").format(
                what=what, epoch=epoch, got=a, expected=b))
    name = _changed(final_weights, _state(model))
    if name:
        raise ExerciseFailed(_("{what}: {name!r} at the end is not the uninterrupted run's (torch.equal)").format(what=what, name=name))
    if False in loads:
        raise ExerciseFailed(_("torch.load(..., weights_only=False) can run any code a checkpoint file holds: load with weights_only=True"))
