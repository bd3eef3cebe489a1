"""Lesson 05 (training): reference solutions and the checks for its exercises."""

import copy
import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from course_utils.tooling.checks import ExerciseFailed, call, exercise, expect_equal, expect_tensor, scoreboard_for

scoreboard = scoreboard_for(__name__)  # the lesson's last cell: this session's verdicts


# Reference solutions. The checks compare the learner's answers with these.

def train_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], loss_fn: Callable, optimizer: torch.optim.Optimizer) -> float:
    """One optimisation step on one batch (inputs, targets); return the batch's loss as a Python float."""
    inputs, targets = batch
    optimizer.zero_grad()
    loss = loss_fn(model(inputs), targets)
    loss.backward()
    optimizer.step()
    return loss.item()


def make_onecycle(optimizer: torch.optim.Optimizer, max_lr: float, epochs: int, steps_per_epoch: int) -> torch.optim.lr_scheduler.OneCycleLR:
    """A OneCycleLR schedule that peaks at max_lr and lasts epochs * steps_per_epoch batches."""
    return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=max_lr, epochs=epochs, steps_per_epoch=steps_per_epoch)


def accuracy(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """Fraction (0 to 1) of rows of logits (N, C) whose largest entry is at the target class index."""
    return (logits.argmax(dim=1) == targets).float().mean().item()


def evaluate_model(model: nn.Module, loader: DataLoader, loss_fn: Callable) -> dict[str, float]:
    """{"loss": mean loss per sample, "accuracy": fraction correct} over loader, in eval mode without gradients."""
    model.eval()
    total_loss, correct, count = 0.0, 0, 0
    with torch.no_grad():
        for inputs, targets in loader:
            logits = model(inputs)
            total_loss += loss_fn(logits, targets).item() * len(targets)
            correct += (logits.argmax(dim=1) == targets).sum().item()
            count += len(targets)
    return {"loss": total_loss / count, "accuracy": correct / count}


def accumulate_gradients(model: nn.Module, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], loss_fn: Callable) -> None:
    """Leave in .grad the gradient of the mean loss over all micro-batches (equal sizes), as one big batch would."""
    model.zero_grad()
    for inputs, targets in micro_batches:
        loss = loss_fn(model(inputs), targets) / len(micro_batches)
        loss.backward()


def early_stop(val_losses: list[float], patience: int) -> bool:
    """True when the best (lowest) validation loss is `patience` or more epochs old."""
    if not val_losses:
        return False
    best_epoch = val_losses.index(min(val_losses))  # the first time the best value was reached
    return len(val_losses) - 1 - best_epoch >= patience


# Hidden test problems, seeded so that every check run sees the same numbers.

def _net(seed: int, p_drop: float = 0.0) -> nn.Module:
    torch.manual_seed(seed)  # the check's own stream; the learner's RNG state does not matter here
    layers = [nn.Linear(6, 8), nn.ReLU()]
    if p_drop:
        layers.append(nn.Dropout(p_drop))
    return nn.Sequential(*layers, nn.Linear(8, 3))


def _batch(n: int, seed: int, n_features: int = 6, n_classes: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, n_features, generator=g), torch.randint(0, n_classes, (n,), generator=g)


def _kind(value) -> str:
    """A value's type as a learner would write it: float, numpy.bool, torch.optim.lr_scheduler.StepLR."""
    kind = type(value)
    if kind.__module__ == "builtins":
        return kind.__name__
    if kind.__module__.startswith("torch.optim.lr_scheduler"):
        return f"torch.optim.lr_scheduler.{kind.__qualname__}"
    return f"{kind.__module__.split('.')[0]}.{kind.__qualname__}"


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 1e-6) -> bool:
    return all(torch.allclose(a[k], b[k], atol=atol, rtol=1e-5) for k in a)


def _expect_float(got, what: str, hint: str = "call .item() on it") -> float:
    if got is None:
        raise ExerciseFailed(f"{what} is None: did you forget to `return` it?")
    if isinstance(got, torch.Tensor):
        raise ExerciseFailed(f"{what} is a tensor, expected a Python float: {hint}")
    if isinstance(got, bool) or not isinstance(got, (int, float)):
        raise ExerciseFailed(f"{what} is a {_kind(got)}, expected a Python float")
    return float(got)


# Checks, one per exercise, in notebook order.

@exercise("train_step")
def check_train_step(fn) -> None:
    model = _net(0)
    start = _params(model)
    batches = [_batch(8, 1), _batch(8, 2)]

    reference = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    expected_losses = [train_step(reference, b, F.cross_entropy, ref_opt) for b in batches]

    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    shown = "model, (inputs of shape (8, 6), targets of shape (8,)), F.cross_entropy, optimizer"
    got = call(fn, model, batches[0], F.cross_entropy, optimizer, shown=shown)
    if isinstance(got, torch.Tensor):
        raise ExerciseFailed("train_step returned a tensor: return loss.item(), a Python float, so the caller holds no graph or device memory")
    first = _expect_float(got, "the value train_step returned")
    if _same(_params(model), start, atol=0.0):
        if any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters()):
            raise ExerciseFailed("the weights did not change although gradients were computed: call optimizer.step() after loss.backward()")
        raise ExerciseFailed(
            "the weights did not change and no gradient was left: call loss.backward() before optimizer.step(), "
            "and optimizer.zero_grad() before backward, not between backward and step"
        )
    if not math.isclose(first, expected_losses[0], rel_tol=1e-5, abs_tol=1e-6):
        raise ExerciseFailed(f"train_step returned {first:.6g}, expected {expected_losses[0]:.6g}: return this batch's loss, computed before the step")
    call(fn, model, batches[1], F.cross_entropy, optimizer, shown=shown)
    if not _same(_params(model), _params(reference)):
        # The same two steps without zero_grad: the second step uses the sum of both batches' gradients.
        stale = _net(0)
        stale_opt = torch.optim.SGD(stale.parameters(), lr=0.5)
        for inputs, targets in batches:
            F.cross_entropy(stale(inputs), targets).backward()
            stale_opt.step()
        if _same(_params(model), _params(stale)):
            raise ExerciseFailed(
                "gradients accumulate across calls: the second step used both batches' gradients; "
                "call optimizer.zero_grad() at the start of each step"
            )
        name, expected = next((k, v) for k, v in _params(reference).items() if not torch.allclose(v, _params(model)[k], atol=1e-6))
        expect_tensor(_params(model)[name], expected, what=f"parameter {name!r} after two calls (one SGD step each)", atol=1e-6)


def _lrs(scheduler, optimizer: torch.optim.Optimizer, steps: int) -> list[float]:
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()  # no gradients, so nothing moves; it keeps the scheduler's order warning quiet
        scheduler.step()
    return lrs


@exercise("make_onecycle")
def check_make_onecycle(fn) -> None:
    for max_lr, epochs, steps_per_epoch in ((0.1, 3, 7), (0.02, 2, 10)):
        what = f"make_onecycle(optimizer, max_lr={max_lr}, epochs={epochs}, steps_per_epoch={steps_per_epoch})"
        optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.5, momentum=0.9)
        scheduler = call(fn, optimizer, max_lr, epochs, steps_per_epoch, shown=f"optimizer, {max_lr}, {epochs}, {steps_per_epoch}")
        if scheduler is None:
            raise ExerciseFailed(f"{what} returned None: did you forget to `return` the scheduler?")
        if not isinstance(scheduler, torch.optim.lr_scheduler.OneCycleLR):
            raise ExerciseFailed(f"{what} returned a {_kind(scheduler)}, expected a torch.optim.lr_scheduler.OneCycleLR")
        if scheduler.optimizer is not optimizer:
            raise ExerciseFailed(f"{what}: the scheduler drives another optimizer; pass the one you were given")
        total = epochs * steps_per_epoch
        try:
            got = _lrs(scheduler, optimizer, total)
        except ValueError as err:
            if "Tried to step" in str(err):
                raise ExerciseFailed(
                    f"{what}: the schedule ended before {total} batches; OneCycleLR is stepped once per batch, "
                    "so it must last epochs * steps_per_epoch steps"
                ) from None
            raise
        ref_opt = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.5, momentum=0.9)
        expected = _lrs(make_onecycle(ref_opt, max_lr, epochs, steps_per_epoch), ref_opt, total)
        if not math.isclose(max(got), max(expected), rel_tol=1e-5):
            raise ExerciseFailed(f"{what}: the learning rate peaks at {max(got):.6g}, expected {max(expected):.6g}; pass max_lr={max_lr:g} to OneCycleLR")
        for step, (a, b) in enumerate(zip(got, expected)):
            if not math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-12):
                raise ExerciseFailed(f"{what}: at batch {step} the learning rate is {a:.6g}, expected {b:.6g}; keep OneCycleLR's other defaults")


@exercise("accuracy")
def check_accuracy(fn) -> None:
    # A square case first: argmax over the wrong dimension gives a silent, plausible number.
    g = torch.Generator().manual_seed(5)
    cases = [
        (torch.randn(10, 10, generator=g), torch.randint(0, 10, (10,), generator=g)),
        (torch.randn(7, 4, generator=g), torch.randint(0, 4, (7,), generator=g)),
    ]
    cases[0][1][:6] = cases[0][0][:6].argmax(dim=1)  # make 6 of 10 right, so the answers are easy to tell apart
    for logits, targets in cases:
        what = f"accuracy(tensor of shape {tuple(logits.shape)}, tensor of shape {tuple(targets.shape)})"
        expected = accuracy(logits, targets)
        got = call(fn, logits.clone(), targets.clone(), hints={"could not infer output dtype": "a comparison gives a bool tensor: call .float() before .mean()"})
        value = _expect_float(got, what)
        n_correct = int((logits.argmax(dim=1) == targets).sum())
        if value == n_correct and n_correct not in (0, 1):
            raise ExerciseFailed(f"{what} returned {value:g}, the number of correct predictions: divide by the number of targets")
        if math.isclose(value, 100 * expected, abs_tol=1e-4) and expected > 0:
            raise ExerciseFailed(f"{what} returned {value:g}, a percentage: return a fraction between 0 and 1")
        if logits.shape[0] == logits.shape[1] and math.isclose(value, (logits.argmax(dim=0) == targets).float().mean().item(), abs_tol=1e-6):
            raise ExerciseFailed("argmax over dim=0 picks a sample for each class; the classes are dim=1 (logits are (N, C))")
        if not math.isclose(value, expected, abs_tol=1e-6):
            raise ExerciseFailed(f"{what}: expected {expected:.6g}, got {value:.6g}")


def _probe(model: nn.Module) -> list[tuple[str, bool]]:
    """Record, for every forward pass, whether dropout was active and whether the output required grad."""
    seen = []
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.register_forward_hook(lambda m, i, o: seen.append(("dropout training", m.training)))
    model.register_forward_hook(lambda m, i, o: seen.append(("output requires grad", o.requires_grad)))
    return seen


@exercise("evaluate_model")
def check_evaluate_model(fn) -> None:
    model = _net(3, p_drop=0.5)
    model.train()  # as it is after training: the function must switch to eval mode itself
    inputs, targets = _batch(10, 4)
    loader = DataLoader(TensorDataset(inputs, targets), batch_size=4)  # batches of 4, 4 and 2
    expected = evaluate_model(copy.deepcopy(model), loader, F.cross_entropy)
    model.train()
    seen = _probe(model)
    got = call(fn, model, loader, F.cross_entropy, shown="model, loader of batches 4, 4 and 2, F.cross_entropy")
    if ("dropout training", True) in seen:
        raise ExerciseFailed("the model was still in train mode, so dropout was active: call model.eval() before the loop")
    if ("output requires grad", True) in seen:
        raise ExerciseFailed("the outputs required grad, so autograd recorded a graph: run the loop inside `with torch.no_grad():`")
    if not isinstance(got, dict):
        raise ExerciseFailed(f"evaluate_model returned a {_kind(got)}, expected a dict with keys 'loss' and 'accuracy'")
    if set(got) != {"loss", "accuracy"}:
        raise ExerciseFailed(f"evaluate_model returned a dict with keys {sorted(got)}, expected ['accuracy', 'loss']")
    loss = _expect_float(got["loss"], "the 'loss' entry", "call .item() on each batch's loss")
    acc = _expect_float(got["accuracy"], "the 'accuracy' entry", "call .item(), or count with Python ints")
    with torch.no_grad():
        model.eval()
        batches = [(model(x), y) for x, y in loader]
    mean_of_means = sum(F.cross_entropy(o, y).item() for o, y in batches) / len(batches)
    acc_of_means = sum((o.argmax(1) == y).float().mean().item() for o, y in batches) / len(batches)
    if math.isclose(loss, mean_of_means, rel_tol=1e-5) and not math.isclose(loss, expected["loss"], rel_tol=1e-5):
        raise ExerciseFailed(
            "the loss is the mean of the batch means, but the last batch is smaller: "
            "weight each batch's loss by its size and divide by the number of samples"
        )
    if math.isclose(acc, acc_of_means, rel_tol=1e-5) and not math.isclose(acc, expected["accuracy"], rel_tol=1e-5):
        raise ExerciseFailed("the accuracy is the mean of per-batch accuracies, but the last batch is smaller: count correct predictions over all samples")
    if not math.isclose(loss, expected["loss"], rel_tol=1e-5):
        raise ExerciseFailed(f"the 'loss' entry: expected {expected['loss']:.6g} (mean per sample), got {loss:.6g}")
    if not math.isclose(acc, expected["accuracy"], rel_tol=1e-5):
        raise ExerciseFailed(f"the 'accuracy' entry: expected {expected['accuracy']:.6g}, got {acc:.6g}")


@exercise("accumulate_gradients")
def check_accumulate_gradients(fn) -> None:
    n_steps = 4
    micro_batches = [_batch(5, 10 + i) for i in range(n_steps)]
    model = _net(6)
    big = copy.deepcopy(model)
    inputs, targets = torch.cat([x for x, _ in micro_batches]), torch.cat([y for _, y in micro_batches])
    F.cross_entropy(big(inputs), targets).backward()  # the gradient of one batch of 20
    expected = {name: p.grad.clone() for name, p in big.named_parameters()}
    last = copy.deepcopy(model)
    F.cross_entropy(last(micro_batches[-1][0]), micro_batches[-1][1]).backward()
    last_only = {name: p.grad.clone() for name, p in last.named_parameters()}

    for p in model.parameters():
        p.grad = torch.full_like(p, 0.25)  # gradients left over from an earlier step
    before = _params(model)
    call(fn, model, [(x.clone(), y.clone()) for x, y in micro_batches], F.cross_entropy,
         shown=f"model, {n_steps} micro-batches of 5, F.cross_entropy")
    if not _same(_params(model), before, atol=0.0):
        raise ExerciseFailed("the weights changed: accumulate_gradients only computes gradients; the optimizer steps later")
    got = {name: p.grad for name, p in model.named_parameters()}
    missing = [name for name, g in got.items() if g is None]
    if missing:
        raise ExerciseFailed(f"parameter {missing[0]!r} has no .grad: call loss.backward() for every micro-batch")

    if all(torch.equal(g, torch.full_like(g, 0.25)) for g in got.values()):
        raise ExerciseFailed("the old gradients were left untouched: clear them with model.zero_grad(), then call loss.backward() for every micro-batch")

    def close(factor: float, reference: dict, offset: float = 0.0) -> bool:
        return all(torch.allclose(got[k], factor * reference[k] + offset, atol=1e-5, rtol=1e-4) for k in got)

    if close(1, expected, 0.25) or close(n_steps, expected, 0.25):
        raise ExerciseFailed("old gradients were still in .grad: call model.zero_grad() once, before the loop")
    if close(n_steps, expected):
        raise ExerciseFailed(
            f"the gradients are {n_steps}x too large: divide each micro-batch's loss by the number of micro-batches ({n_steps}) before backward()"
        )
    if close(1, last_only) or close(1 / n_steps, last_only):
        raise ExerciseFailed("only the last micro-batch's gradient is left: zero the gradients once, before the loop, not inside it")
    for name, value in got.items():
        expect_tensor(value, expected[name], what=f"the .grad of {name!r}", atol=1e-5, rtol=1e-4)


@exercise("early_stop")
def check_early_stop(fn) -> None:
    cases = [
        ([], 2),
        ([1.0, 0.8, 0.7], 2),
        ([1.0, 0.5, 0.6, 0.7], 2),           # best 2 epochs ago: stop (exactly `patience`)
        ([1.0, 0.5, 0.6], 2),                 # best 1 epoch ago: keep going
        ([1.0, 0.5, 0.6, 0.55, 0.58], 3),     # worse than the best for 3 epochs, though 0.55 < 0.6
        ([1.0, 0.5, 0.5, 0.5], 2),            # equal is not better: the best is still the first 0.5
        ([0.9, 0.8, 0.85, 0.7, 0.75], 2),
        ([0.9, 0.8, 0.85, 0.7, 0.75, 0.72], 2),
    ]
    for losses, patience in cases:
        what = f"early_stop({losses}, patience={patience})"
        expected = early_stop(list(losses), patience)
        got = call(fn, list(losses), patience, hints={"empty sequence": "with no losses yet, return False"})
        if isinstance(got, torch.Tensor):
            raise ExerciseFailed(f"{what} is a tensor, expected a Python bool: call .item() on it")
        if got is not None and not isinstance(got, bool) and type(got).__name__ in ("bool_", "bool"):
            raise ExerciseFailed(f"{what} is a {_kind(got)}, expected a Python bool: wrap it in bool(...)")
        if not isinstance(got, bool):
            expect_equal(got, expected, what=what)
        if got == expected:
            continue
        if losses == [1.0, 0.5, 0.6, 0.7] and got is False:
            raise ExerciseFailed(f"{what} should be True: the best loss is exactly {patience} epochs old, and stopping starts at `patience`, not after it")
        if losses == [1.0, 0.5, 0.6, 0.55, 0.58]:
            raise ExerciseFailed(f"{what} should be True: compare with the best loss so far, not with the previous epoch")
        if losses == [1.0, 0.5, 0.5, 0.5]:
            raise ExerciseFailed(f"{what} should be True: a loss equal to the best is not an improvement")
        expect_equal(got, expected, what=what)
