"""Lesson 05's checks against the reference solutions and the wrong answers learners write, and its accuracy claim."""

from pathlib import Path

import nbformat
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from course_utils import lesson05 as L
from course_utils.tooling.checks import ExerciseFailed
from course_utils.data import classification_datasets
from course_utils.reproducibility import seed_everything
from course_utils.training import fit
from lesson_contract import assert_names_fault, contract_tests

PAIRS = [
    (L.check_train_step, L.train_step),
    (L.check_make_onecycle, L.make_onecycle),
    (L.check_accuracy, L.accuracy),
    (L.check_evaluate_model, L.evaluate_model),
    (L.check_accumulate_gradients, L.accumulate_gradients),
    (L.check_early_stop, L.early_stop),
]

(test_reference_passes, test_stub_is_not_attempted, test_bad_input_is_one_named_line, test_hostile_answers_are_the_learners_fault,
 test_checks_leave_the_learners_random_state_alone, test_checks_are_quick) = contract_tests(PAIRS, max_seconds=1.0)


# Typical wrong answers, one function each.

def step_returns_tensor(model, batch, loss_fn, optimizer):
    optimizer.zero_grad()
    loss = loss_fn(model(batch[0]), batch[1])
    loss.backward()
    optimizer.step()
    return loss


def step_without_zero_grad(model, batch, loss_fn, optimizer):
    loss = loss_fn(model(batch[0]), batch[1])
    loss.backward()
    optimizer.step()
    return loss.item()


def step_before_backward(model, batch, loss_fn, optimizer):
    optimizer.zero_grad()
    loss = loss_fn(model(batch[0]), batch[1])
    optimizer.step()
    loss.backward()
    return loss.item()


def zero_grad_after_backward(model, batch, loss_fn, optimizer):
    loss = loss_fn(model(batch[0]), batch[1])
    loss.backward()
    optimizer.zero_grad()
    optimizer.step()
    return loss.item()


def step_returns_loss_after_step(model, batch, loss_fn, optimizer):
    L.train_step(model, batch, loss_fn, optimizer)
    with torch.no_grad():
        return loss_fn(model(batch[0]), batch[1]).item()


def step_returns_nothing(model, batch, loss_fn, optimizer):
    L.train_step(model, batch, loss_fn, optimizer)


def evaluate_in_train_mode(model, loader, loss_fn):
    with torch.no_grad():
        return _evaluate_body(model, loader, loss_fn)


def evaluate_with_grad(model, loader, loss_fn):
    model.eval()
    return _evaluate_body(model, loader, loss_fn)


def _evaluate_body(model, loader, loss_fn):
    total, correct, count = 0.0, 0, 0
    for x, y in loader:
        out = model(x)
        total += loss_fn(out, y).item() * len(y)
        correct += (out.argmax(1) == y).sum().item()
        count += len(y)
    return {"loss": total / count, "accuracy": correct / count}


def evaluate_mean_of_batch_means(model, loader, loss_fn):
    model.eval()
    with torch.no_grad():
        losses = [loss_fn(model(x), y).item() for x, y in loader]
        correct = sum((model(x).argmax(1) == y).sum().item() for x, y in loader)
    return {"loss": sum(losses) / len(losses), "accuracy": correct / len(loader.dataset)}


def evaluate_mean_of_batch_accuracies(model, loader, loss_fn):
    result = L.evaluate_model(model, loader, loss_fn)
    with torch.no_grad():
        accs = [(model(x).argmax(1) == y).float().mean().item() for x, y in loader]
    return {"loss": result["loss"], "accuracy": sum(accs) / len(accs)}


def evaluate_with_inference_mode(model, loader, loss_fn):  # a correct alternative
    model.eval()
    with torch.inference_mode():
        return _evaluate_body(model, loader, loss_fn)


def evaluate_tensor_values(model, loader, loss_fn):
    result = L.evaluate_model(model, loader, loss_fn)
    return {k: torch.tensor(v) for k, v in result.items()}


def accumulate_undivided(model, micro_batches, loss_fn):
    model.zero_grad()
    for x, y in micro_batches:
        loss_fn(model(x), y).backward()


def accumulate_without_zero_grad(model, micro_batches, loss_fn):
    for x, y in micro_batches:
        (loss_fn(model(x), y) / len(micro_batches)).backward()


def accumulate_zeroing_inside(model, micro_batches, loss_fn):
    for x, y in micro_batches:
        model.zero_grad()
        (loss_fn(model(x), y) / len(micro_batches)).backward()


def accumulate_and_step(model, micro_batches, loss_fn):
    L.accumulate_gradients(model, micro_batches, loss_fn)
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad


def accumulate_as_one_batch(model, micro_batches, loss_fn):  # a correct alternative
    model.zero_grad()
    x, y = torch.cat([b[0] for b in micro_batches]), torch.cat([b[1] for b in micro_batches])
    loss_fn(model(x), y).backward()


def early_stop_strict(losses, patience):
    return bool(losses) and len(losses) - 1 - losses.index(min(losses)) > patience


def early_stop_vs_previous(losses, patience):
    recent = losses[-(patience + 1):]
    return len(recent) == patience + 1 and all(b >= a for a, b in zip(recent, recent[1:]))


def early_stop_ties_improve(losses, patience):
    if not losses:
        return False
    last_best = len(losses) - 1 - losses[::-1].index(min(losses))
    return len(losses) - 1 - last_best >= patience


def early_stop_numpy(losses, patience):
    import numpy as np

    return np.bool_(L.early_stop(losses, patience))


def early_stop_empty_crashes(losses, patience):
    return len(losses) - 1 - losses.index(min(losses)) >= patience


OneCycle = torch.optim.lr_scheduler.OneCycleLR

WRONG = [
    (L.check_train_step, step_returns_tensor, "returned a tensor: return loss.item()"),
    (L.check_train_step, step_without_zero_grad, "gradients accumulate across calls.*zero_grad"),
    (L.check_train_step, step_before_backward, "did not change although gradients were computed"),
    (L.check_train_step, zero_grad_after_backward, "no gradient was left.*not between backward and step"),
    (L.check_train_step, step_returns_loss_after_step, "computed before the step"),
    (L.check_train_step, step_returns_nothing, "is None"),
    (L.check_make_onecycle, lambda opt, m, e, s: OneCycle(opt, max_lr=m, total_steps=e), "ended before .* once per batch"),
    (L.check_make_onecycle, lambda opt, m, e, s: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=e * s), "expected a torch.optim.lr_scheduler.OneCycleLR"),
    (L.check_make_onecycle, lambda opt, m, e, s: OneCycle(opt, max_lr=opt.param_groups[0]["lr"], epochs=e, steps_per_epoch=s), "peaks at .* max_lr=0.1"),
    (L.check_make_onecycle, lambda opt, m, e, s: OneCycle(opt, max_lr=m, epochs=e, steps_per_epoch=s, pct_start=0.5), "at batch \\d+ the learning rate"),
    (L.check_make_onecycle, lambda opt, m, e, s: None, "returned None"),
    (L.check_make_onecycle, lambda opt, m, e, s: OneCycle(opt, max_lr=m, total_steps=e * s), None),  # a correct alternative
    (L.check_accuracy, lambda lg, t: (lg.argmax(1) == t).float().mean(), "is a tensor.*item"),
    (L.check_accuracy, lambda lg, t: (lg.argmax(1) == t).sum().item(), "number of correct predictions"),
    (L.check_accuracy, lambda lg, t: 100 * (lg.argmax(1) == t).float().mean().item(), "percentage"),
    (L.check_accuracy, lambda lg, t: (lg.argmax(0) == t).float().mean().item(), "dim=0 .* dim=1"),
    (L.check_accuracy, lambda lg, t: (lg.argmax(1) == t).mean().item(), "raised RuntimeError.*call .float\\(\\) before .mean\\(\\)"),
    (L.check_accuracy, lambda lg, t: (lg.argmax(-1) == t).sum().item() / len(t), None),  # a correct alternative
    (L.check_evaluate_model, evaluate_in_train_mode, "train mode.*model.eval\\(\\)"),
    (L.check_evaluate_model, evaluate_with_grad, "required grad.*torch.no_grad"),
    (L.check_evaluate_model, evaluate_mean_of_batch_means, "mean of the batch means.*weight each batch"),
    (L.check_evaluate_model, evaluate_mean_of_batch_accuracies, "per-batch accuracies"),
    (L.check_evaluate_model, lambda m, ld, fn: tuple(L.evaluate_model(m, ld, fn).values()), "expected a dict"),
    (L.check_evaluate_model, lambda m, ld, fn: {"val_loss": 0.0}, "keys"),
    (L.check_evaluate_model, evaluate_tensor_values, "is a tensor.*item"),
    (L.check_evaluate_model, evaluate_with_inference_mode, None),
    (L.check_accumulate_gradients, accumulate_undivided, "4x too large.*divide"),
    (L.check_accumulate_gradients, accumulate_without_zero_grad, "old gradients.*zero_grad"),
    (L.check_accumulate_gradients, accumulate_zeroing_inside, "only the last micro-batch"),
    (L.check_accumulate_gradients, accumulate_and_step, "the weights changed"),
    (L.check_accumulate_gradients, lambda m, b, fn: None, "left untouched.*loss.backward"),
    (L.check_accumulate_gradients, accumulate_as_one_batch, None),
    (L.check_early_stop, early_stop_strict, "exactly 2 epochs old"),
    (L.check_early_stop, early_stop_vs_previous, "best loss so far, not with the previous epoch"),
    (L.check_early_stop, early_stop_ties_improve, "equal to the best is not an improvement"),
    (L.check_early_stop, early_stop_numpy, "wrap it in bool"),
    (L.check_early_stop, lambda losses, p: torch.tensor(L.early_stop(losses, p)), "is a tensor.*item"),
    (L.check_early_stop, early_stop_empty_crashes, "raised ValueError.*with no losses yet, return False"),
]


def step_passes_the_batch_as_input(model, batch, loss_fn, optimizer):
    return loss_fn(model(batch), batch[1]).item()


RAISING = [  # errors inside the learner's code: one line, arguments named briefly (no tensor or optimizer reprs)
    (L.check_train_step, step_passes_the_batch_as_input,
     r"^train_step: step_passes_the_batch_as_input\(model, \(inputs of shape \(8, 6\), targets of shape \(8,\)\), F.cross_entropy, optimizer\) raised TypeError"),
    (L.check_evaluate_model, lambda m, ld, fn: m(ld), r"^evaluate_model: <lambda>\(model, loader of batches 4, 4 and 2, F.cross_entropy\) raised TypeError"),
    (L.check_accumulate_gradients, lambda m, b, fn: m(b), r"^accumulate_gradients: <lambda>\(model, 4 micro-batches of 5, F.cross_entropy\) raised TypeError"),
    (L.check_make_onecycle, lambda opt, m, e, s: OneCycle(opt, max_lr=m, epochs=e), r"^make_onecycle: <lambda>\(optimizer, 0.1, 3, 7\) raised ValueError"),
    (L.check_accuracy, lambda lg, t: lg.argmax(1).eq(t).mean().item(), r"^accuracy: <lambda>\(tensor of shape \(10, 10\), tensor of shape \(10,\)\) raised RuntimeError"),
    (L.check_early_stop, lambda losses, p: losses[-1 - p] < 0, r"^early_stop: <lambda>\(\[\], 2\) raised IndexError"),
]


@pytest.mark.parametrize("check, wrong, message", RAISING)
def test_errors_inside_the_learners_code_are_one_short_line(check, wrong, message):
    with pytest.raises(ExerciseFailed, match=message) as info:
        check(wrong)
    assert "\n" not in str(info.value) and len(str(info.value)) < 300


@pytest.mark.parametrize("check, wrong, message", WRONG)
def test_wrong_answers_name_the_fault(check, wrong, message):
    assert_names_fault(check, wrong, message)


NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "solutions" / "05_training.ipynb"


def _notebook_code() -> list[str]:
    return [c.source for c in nbformat.read(NOTEBOOK, as_version=4).cells if c.cell_type == "code"]


def test_the_lessons_accuracy_claim():
    """The lesson says its model reaches >= 95 % test accuracy on the digits: train it exactly as the notebook does."""
    cells = _notebook_code()
    settings = next(c for c in cells if "def make_model(" in c)
    namespace = {"nn": nn, "torch": torch, "check_mode": lambda: False}
    exec(settings, namespace)  # the notebook's own model and settings
    training = next(c for c in cells if "history = fit(" in c and "scheduler_per_batch=True" in c)
    # The recipe below must be the notebook's: fail here if someone changes one without the other.
    for line in (
        "optimizer = torch.optim.AdamW(model.parameters(), lr=MAX_LR, weight_decay=WEIGHT_DECAY)",
        "scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=MAX_LR, epochs=EPOCHS, steps_per_epoch=len(train_loader))",
        "epochs=EPOCHS, scheduler=scheduler, scheduler_per_batch=True)",
    ):
        assert line in training, f"the notebook's training cell changed: {line}"
    assert any('assert history["val_accuracy"].iloc[-1] >= 0.95' in c for c in cells)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the notebook's first cell does
    try:
        train_set, test_set, class_names = classification_datasets("digits")
        generator = seed_everything(0)
        train_loader = DataLoader(train_set, batch_size=namespace["BATCH_SIZE"], shuffle=True, generator=generator)
        test_loader = DataLoader(test_set, batch_size=256)
        seed_everything(0)
        generator.manual_seed(0)
        model = namespace["make_model"](train_set[0][0].numel(), len(class_names))
        MAX_LR, EPOCHS = namespace["MAX_LR"], namespace["EPOCHS"]
        optimizer = torch.optim.AdamW(model.parameters(), lr=MAX_LR, weight_decay=namespace["WEIGHT_DECAY"])
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=MAX_LR, epochs=EPOCHS, steps_per_epoch=len(train_loader))
        history = fit(model, train_loader, test_loader, nn.CrossEntropyLoss(), optimizer,
                      epochs=EPOCHS, scheduler=scheduler, scheduler_per_batch=True, log=None)
    finally:
        torch.set_num_threads(threads)
    assert history["val_accuracy"].iloc[-1] >= 0.95, history.round(4).to_string()
