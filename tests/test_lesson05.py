"""Lesson 05's checks against the reference solutions, correct alternatives and the wrong answers learners write, and its accuracy claim."""

import math
import os
import warnings
from pathlib import Path

import nbformat
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.lr_scheduler import CosineAnnealingLR, LambdaLR, LinearLR, LRScheduler, SequentialLR
from torch.utils.data import DataLoader, random_split

from course_utils import lesson05 as L
from course_utils.data import classification_datasets
from course_utils.reproducibility import seed_everything
from course_utils.tooling.checks import ExerciseFailed
from course_utils.training import evaluate, fit, load_checkpoint, save_checkpoint, train_one_epoch
from lesson_contract import assert_names_fault, assert_passes, contract_tests

PAIRS = [
    (L.check_sequence_loss, L.sequence_loss),
    (L.check_make_adamw, L.make_adamw),
    (L.check_warmup_cosine, L.warmup_cosine),
    (L.check_accumulation_step, L.accumulation_step),
    (L.check_overfit_one_batch, L.overfit_one_batch),
    (L.check_train_resumable, L.train_resumable),
]

(test_reference_passes, test_stub_is_not_attempted, test_bad_input_is_one_named_line, test_hostile_answers_are_the_learners_fault,
 test_checks_leave_the_learners_random_state_alone, test_checks_are_quick) = contract_tests(PAIRS, max_seconds=1.0)


# Exercise 1: sequence_loss

def loss_permuted(logits, targets, pad_index):
    return F.cross_entropy(logits.permute(0, 2, 1), targets, ignore_index=pad_index)


def loss_masked(logits, targets, pad_index):
    real = targets != pad_index
    return F.cross_entropy(logits[real], targets[real])


def loss_weighted_by_hand(logits, targets, pad_index):
    real = targets != pad_index
    safe = targets.masked_fill(~real, 0)  # any valid class; these positions are weighted 0 below
    per_token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), safe.reshape(-1), reduction="none")
    return (per_token * real.flatten()).sum() / real.sum()


def loss_log_softmax_gather(logits, targets, pad_index):
    real = targets != pad_index
    log_p = logits.log_softmax(dim=-1)
    nll = -log_p.gather(-1, torch.where(real, targets, 0).unsqueeze(-1)).squeeze(-1)
    return nll[real].mean()


def loss_counts_padding(logits, targets, pad_index):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def loss_pad_is_zero(logits, targets, pad_index):
    real = targets != 0
    return F.cross_entropy(logits[real], targets[real])


def loss_per_sequence(logits, targets, pad_index):
    means = []
    for row_logits, row_targets in zip(logits, targets):
        real = row_targets != pad_index
        if real.any():
            means.append(F.cross_entropy(row_logits[real], row_targets[real]))
    return torch.stack(means).mean()


def loss_summed(logits, targets, pad_index):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=pad_index, reduction="sum")


def loss_over_all_positions(logits, targets, pad_index):
    real = targets != pad_index
    per_token = F.cross_entropy(logits.flatten(0, 1), targets.masked_fill(~real, 0).flatten(), reduction="none")
    return (per_token * real.flatten()).sum() / real.numel()


def loss_item(logits, targets, pad_index):
    return L.sequence_loss(logits, targets, pad_index).item()


def loss_classes_in_dim_2(logits, targets, pad_index):
    return F.cross_entropy(logits, targets, ignore_index=pad_index)


def loss_view(logits, targets, pad_index):
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1), ignore_index=pad_index)


def loss_softmax_first(logits, targets, pad_index):
    return F.cross_entropy(logits.softmax(dim=-1).flatten(0, 1), targets.flatten(), ignore_index=pad_index)


def loss_overwrites_targets(logits, targets, pad_index):
    targets[targets == pad_index] = -100
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def loss_detached(logits, targets, pad_index):
    return L.sequence_loss(logits.detach(), targets, pad_index)


def loss_per_token(logits, targets, pad_index):
    return F.cross_entropy(logits.permute(0, 2, 1), targets, ignore_index=pad_index, reduction="none")


def loss_calls_backward(logits, targets, pad_index):
    loss = L.sequence_loss(logits, targets, pad_index)
    loss.backward()
    return loss


# Exercise 2: make_adamw

def adamw_named(model, lr, weight_decay):
    no_decay, decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return torch.optim.AdamW([{"params": no_decay, "weight_decay": 0.0}, {"params": decay}], lr=lr, weight_decay=weight_decay)


def adamw_lr_per_group(model, lr, weight_decay):
    trainable = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW([
        {"params": [p for p in trainable if len(p.shape) >= 2], "lr": lr, "weight_decay": weight_decay},
        {"params": [p for p in trainable if len(p.shape) < 2], "lr": lr, "weight_decay": 0},
    ])


def adam_decoupled(model, lr, weight_decay):
    groups = {True: [], False: []}
    for p in model.parameters():
        if p.requires_grad:
            groups[p.ndim > 1].append(p)
    return torch.optim.Adam([{"params": groups[True], "weight_decay": weight_decay}, {"params": groups[False], "weight_decay": 0.0}],
                            lr=lr, decoupled_weight_decay=True)


def adamw_generators(model, lr, weight_decay):
    return torch.optim.AdamW([
        {"params": (p for p in model.parameters() if p.requires_grad and p.ndim >= 2)},
        {"params": (p for p in model.parameters() if p.requires_grad and p.ndim < 2), "weight_decay": 0.0},
    ], lr=lr, weight_decay=weight_decay)


def adamw_all_decayed(model, lr, weight_decay):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=weight_decay)


def adamw_by_name(model, lr, weight_decay):
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return torch.optim.AdamW([
        {"params": [p for n, p in named if "bias" not in n], "weight_decay": weight_decay},
        {"params": [p for n, p in named if "bias" in n], "weight_decay": 0.0},
    ], lr=lr)


def adamw_with_frozen(model, lr, weight_decay):
    params = list(model.parameters())
    return torch.optim.AdamW([
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ], lr=lr)


def adam_coupled(model, lr, weight_decay):
    trainable = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.Adam([{"params": [p for p in trainable if p.ndim >= 2], "weight_decay": weight_decay},
                             {"params": [p for p in trainable if p.ndim < 2], "weight_decay": 0.0}], lr=lr)


def adamw_no_decay(model, lr, weight_decay):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)


def adamw_modules_only(model, lr, weight_decay):
    decay, no_decay = [], []
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Conv1d, nn.Embedding)) and module.weight.requires_grad and all(p is not module.weight for p in decay):
            decay.append(module.weight)
        if getattr(module, "bias", None) is not None and module.bias.requires_grad:
            no_decay.append(module.bias)
        if isinstance(module, (nn.LayerNorm, nn.BatchNorm1d)):
            no_decay.append(module.weight)
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}], lr=lr)


def adamw_freezes_the_rest(model, lr, weight_decay):
    for p in model.parameters():
        if p.ndim < 2:
            p.requires_grad_(False)
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=weight_decay)


def adamw_default_lr(model, lr, weight_decay):
    trainable = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW([{"params": [p for p in trainable if p.ndim >= 2], "weight_decay": weight_decay},
                              {"params": [p for p in trainable if p.ndim < 2], "weight_decay": 0.0}])


def adamw_other_eps(model, lr, weight_decay):
    trainable = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW([{"params": [p for p in trainable if p.ndim >= 2], "weight_decay": weight_decay},
                              {"params": [p for p in trainable if p.ndim < 2], "weight_decay": 0.0}], lr=lr, eps=1e-6)


def adamw_more_than_two_dims(model, lr, weight_decay):
    trainable = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW([{"params": [p for p in trainable if p.ndim > 2], "weight_decay": weight_decay},
                              {"params": [p for p in trainable if p.ndim <= 2], "weight_decay": 0.0}], lr=lr)


def adamw_fixed_decay(model, lr, weight_decay):
    trainable = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW([{"params": [p for p in trainable if p.ndim >= 2], "weight_decay": 0.01},
                              {"params": [p for p in trainable if p.ndim < 2], "weight_decay": 0.0}], lr=lr)


def adamw_tied_twice(model, lr, weight_decay):
    decay = [m.weight for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv1d, nn.Embedding)) and m.weight.requires_grad]
    decay_ids = {id(p) for p in decay}
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in decay_ids]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns about the duplicate, which is the point
        return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}], lr=lr)


def sgd_groups(model, lr, weight_decay):
    trainable = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.SGD([{"params": [p for p in trainable if p.ndim >= 2], "weight_decay": weight_decay},
                            {"params": [p for p in trainable if p.ndim < 2], "weight_decay": 0.0}], lr=lr)


# Exercise 3: warmup_cosine

def warmup_lambdas(optimizer, warmup_steps, total_steps, start_factor, min_lr):
    def factor_for(base):
        def factor(step):
            if step < warmup_steps:
                return start_factor + (1 - start_factor) * step / warmup_steps
            progress = (step - warmup_steps) / (total_steps - warmup_steps)
            return (min_lr + (base - min_lr) * 0.5 * (1 + math.cos(math.pi * progress))) / base
        return factor
    return LambdaLR(optimizer, [factor_for(group["lr"]) for group in optimizer.param_groups])


class WarmupCosine(LRScheduler):  # a scheduler class of one's own, closed form
    def __init__(self, optimizer, warmup_steps, total_steps, start_factor, min_lr):
        self.warmup_steps, self.total_steps, self.start_factor, self.min_lr = warmup_steps, total_steps, start_factor, min_lr
        super().__init__(optimizer)

    def get_lr(self):
        t = self.last_epoch
        if t < self.warmup_steps:
            return [base * (self.start_factor + (1 - self.start_factor) * t / self.warmup_steps) for base in self.base_lrs]
        progress = (t - self.warmup_steps) / (self.total_steps - self.warmup_steps)
        return [self.min_lr + (base - self.min_lr) * (1 + math.cos(math.pi * progress)) / 2 for base in self.base_lrs]


def warmup_keywords(optimizer, warmup_steps, total_steps, start_factor, min_lr):
    phases = [LinearLR(optimizer, start_factor=start_factor, end_factor=1.0, total_iters=warmup_steps),
              CosineAnnealingLR(optimizer, T_max=total_steps - warmup_steps, eta_min=min_lr)]
    return SequentialLR(optimizer, schedulers=phases, milestones=[warmup_steps])


def warmup_cosine_too_long(optimizer, warmup_steps, total_steps, start_factor, min_lr):
    return SequentialLR(optimizer, [LinearLR(optimizer, start_factor, total_iters=warmup_steps),
                                    CosineAnnealingLR(optimizer, T_max=total_steps, eta_min=min_lr)], milestones=[warmup_steps])


def warmup_no_eta_min(optimizer, warmup_steps, total_steps, start_factor, min_lr):
    return SequentialLR(optimizer, [LinearLR(optimizer, start_factor, total_iters=warmup_steps),
                                    CosineAnnealingLR(optimizer, T_max=total_steps - warmup_steps)], milestones=[warmup_steps])


def warmup_default_start(optimizer, warmup_steps, total_steps, start_factor, min_lr):
    return SequentialLR(optimizer, [LinearLR(optimizer, total_iters=warmup_steps),
                                    CosineAnnealingLR(optimizer, T_max=total_steps - warmup_steps, eta_min=min_lr)], milestones=[warmup_steps])


def warmup_default_length(optimizer, warmup_steps, total_steps, start_factor, min_lr):
    return SequentialLR(optimizer, [LinearLR(optimizer, start_factor),
                                    CosineAnnealingLR(optimizer, T_max=total_steps - warmup_steps, eta_min=min_lr)], milestones=[warmup_steps])


def cosine_only(optimizer, warmup_steps, total_steps, start_factor, min_lr):
    return CosineAnnealingLR(optimizer, T_max=total_steps, eta_min=min_lr)


def warmup_shared_lambda(optimizer, warmup_steps, total_steps, start_factor, min_lr):
    base = optimizer.param_groups[0]["lr"]

    def set_all(step):
        if step < warmup_steps:
            return start_factor + (1 - start_factor) * step / warmup_steps
        return (min_lr + (base - min_lr) * (1 + math.cos(math.pi * (step - warmup_steps) / (total_steps - warmup_steps))) / 2) / base

    return LambdaLR(optimizer, set_all)


class WarmupOneLr(WarmupCosine):  # writes group 0's learning rate into every group
    def get_lr(self):
        first = super().get_lr()[0]
        return [first for _ in self.base_lrs]


def warmup_milestone_late(optimizer, warmup_steps, total_steps, start_factor, min_lr):
    return SequentialLR(optimizer, [LinearLR(optimizer, start_factor, total_iters=warmup_steps),
                                    CosineAnnealingLR(optimizer, T_max=total_steps - warmup_steps, eta_min=min_lr)],
                        milestones=[warmup_steps + 1])


def warmup_parts_list(optimizer, warmup_steps, total_steps, start_factor, min_lr):
    return [LinearLR(optimizer, start_factor, total_iters=warmup_steps), CosineAnnealingLR(optimizer, T_max=total_steps - warmup_steps, eta_min=min_lr)]


def one_cycle(optimizer, warmup_steps, total_steps, start_factor, min_lr):
    return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=optimizer.param_groups[0]["lr"], total_steps=total_steps + 1,
                                               pct_start=warmup_steps / total_steps, anneal_strategy="cos")


def warmup_other_optimizer(optimizer, warmup_steps, total_steps, start_factor, min_lr):
    own = torch.optim.SGD([{"params": group["params"], "lr": group["lr"]} for group in optimizer.param_groups])
    return L.warmup_cosine(own, warmup_steps, total_steps, start_factor, min_lr)


# Exercise 4: accumulation_step

def accumulate_as_one_batch(model, micro_batches, loss_fn, optimizer, max_norm):
    optimizer.zero_grad()
    inputs = torch.cat([x for x, _ in micro_batches])
    targets = torch.cat([y for _, y in micro_batches])
    loss_fn(model(inputs), targets).backward()
    norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    return float(norm)


def accumulate_sums_then_divides(model, micro_batches, loss_fn, optimizer, max_norm):
    model.zero_grad()
    count = 0
    for x, y in micro_batches:
        (loss_fn(model(x), y) * len(y)).backward()
        count += len(y)
    params = [p for p in model.parameters() if p.grad is not None]
    for p in params:
        p.grad /= count
    norm = nn.utils.clip_grad_norm_(params, max_norm)
    optimizer.step()
    return norm.item()


def accumulate_clips_by_hand(model, micro_batches, loss_fn, optimizer, max_norm):
    optimizer.zero_grad()
    total = sum(y.numel() for _, y in micro_batches)
    for x, y in micro_batches:
        loss = loss_fn(model(x), y) * y.numel() / total
        loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = torch.sqrt(sum((g ** 2).sum() for g in grads))
    if norm > max_norm:
        for g in grads:
            g.mul_(max_norm / norm)
    optimizer.step()
    return norm.item()


def _weighted_backward(model, micro_batches, loss_fn, optimizer):
    """The right accumulation, for the wrong answers whose mistake comes after it."""
    optimizer.zero_grad()
    total = sum(len(y) for _, y in micro_batches)
    for x, y in micro_batches:
        (loss_fn(model(x), y) * len(y) / total).backward()


def accumulate_reverse_order(model, micro_batches, loss_fn, optimizer, max_norm):
    for p in model.parameters():
        p.grad = None
    sizes = [y.shape[0] for _, y in micro_batches]
    for (x, y), size in zip(reversed(micro_batches), reversed(sizes)):
        torch.autograd.backward(loss_fn(model(x), y) * (size / sum(sizes)))
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, error_if_nonfinite=True)
    optimizer.step()
    return float(norm)


def accumulate_one_backward(model, micro_batches, loss_fn, optimizer, max_norm):
    optimizer.zero_grad()
    total = sum(len(y) for _, y in micro_batches)
    loss = sum(loss_fn(model(x), y) * len(y) / total for x, y in micro_batches)  # every graph alive until this one backward
    loss.backward()
    norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    return norm.item()


def accumulate_divided_by_k(model, micro_batches, loss_fn, optimizer, max_norm):
    optimizer.zero_grad()
    for x, y in micro_batches:
        (loss_fn(model(x), y) / len(micro_batches)).backward()
    norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    return norm.item()


def accumulate_divided_by_four(model, micro_batches, loss_fn, optimizer, max_norm):
    optimizer.zero_grad()
    for x, y in micro_batches:
        (loss_fn(model(x), y) / 4).backward()  # the demo's k, hard-coded
    norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    return norm.item()


def accumulate_summed_losses(model, micro_batches, loss_fn, optimizer, max_norm):
    optimizer.zero_grad()
    for x, y in micro_batches:
        (loss_fn(model(x), y) * len(y)).backward()  # a sum over samples, never divided by their number
    norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    return norm.item()


def accumulate_undivided(model, micro_batches, loss_fn, optimizer, max_norm):
    optimizer.zero_grad()
    for x, y in micro_batches:
        loss_fn(model(x), y).backward()
    norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    return norm.item()


def accumulate_without_zero_grad(model, micro_batches, loss_fn, optimizer, max_norm):
    total = sum(len(y) for _, y in micro_batches)
    for x, y in micro_batches:
        (loss_fn(model(x), y) * len(y) / total).backward()
    norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    return norm.item()


def accumulate_zeroing_inside(model, micro_batches, loss_fn, optimizer, max_norm):
    total = sum(len(y) for _, y in micro_batches)
    for x, y in micro_batches:
        optimizer.zero_grad()
        (loss_fn(model(x), y) * len(y) / total).backward()
    norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    return norm.item()


def accumulate_without_clipping(model, micro_batches, loss_fn, optimizer, max_norm):
    _weighted_backward(model, micro_batches, loss_fn, optimizer)
    optimizer.step()
    return nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None]).item()


def accumulate_clips_after_step(model, micro_batches, loss_fn, optimizer, max_norm):
    _weighted_backward(model, micro_batches, loss_fn, optimizer)
    optimizer.step()
    return nn.utils.clip_grad_norm_(model.parameters(), max_norm).item()


def accumulate_steps_each(model, micro_batches, loss_fn, optimizer, max_norm):
    optimizer.zero_grad()
    total = sum(len(y) for _, y in micro_batches)
    norm = 0.0
    for x, y in micro_batches:
        (loss_fn(model(x), y) * len(y) / total).backward()
        norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm).item()
        optimizer.step()
    return norm


def accumulate_never_steps(model, micro_batches, loss_fn, optimizer, max_norm):
    _weighted_backward(model, micro_batches, loss_fn, optimizer)
    return nn.utils.clip_grad_norm_(model.parameters(), max_norm).item()


def accumulate_returns_tensor(model, micro_batches, loss_fn, optimizer, max_norm):
    _weighted_backward(model, micro_batches, loss_fn, optimizer)
    norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    return norm


def accumulate_returns_clipped_norm(model, micro_batches, loss_fn, optimizer, max_norm):
    _weighted_backward(model, micro_batches, loss_fn, optimizer)
    nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    return nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None]).item()


def accumulate_returns_nothing(model, micro_batches, loss_fn, optimizer, max_norm):
    L.accumulation_step(model, micro_batches, loss_fn, optimizer, max_norm)


def accumulate_clips_each(model, micro_batches, loss_fn, optimizer, max_norm):
    optimizer.zero_grad()
    total = sum(len(y) for _, y in micro_batches)
    norm = 0.0
    for x, y in micro_batches:
        (loss_fn(model(x), y) * len(y) / total).backward()
        norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm).item()  # clips the running sum every time
    optimizer.step()
    return norm


def accumulate_clips_values(model, micro_batches, loss_fn, optimizer, max_norm):
    _weighted_backward(model, micro_batches, loss_fn, optimizer)
    norm = nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    nn.utils.clip_grad_value_(model.parameters(), max_norm)
    optimizer.step()
    return norm.item()


def accumulate_grad_of_none(model, micro_batches, loss_fn, optimizer, max_norm):  # a manual norm that forgets frozen parameters
    _weighted_backward(model, micro_batches, loss_fn, optimizer)
    norm = sum(p.grad.pow(2).sum() for p in model.parameters()).sqrt()
    return norm.item()


# Exercise 5: overfit_one_batch

def _dropout_off(model):
    """model.train(), then every nn.Dropout in eval mode; returns each module's mode from before, in model.modules() order."""
    saved = [(m, m.training) for m in model.modules()]
    model.train()
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.eval()
    return saved


def _restore(saved):
    for m, flag in saved:  # parents before children, so that each child's own flag is set last
        m.train(flag)


def overfit_apply(model, inputs, targets, loss_fn, steps, lr):
    saved = [(m, m.training) for m in model.modules()]
    model.train()
    model.apply(lambda m: m.eval() if isinstance(m, nn.Dropout) else None)
    opt = torch.optim.Adam(model.parameters(), lr)
    out = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=False)
        loss = loss_fn(model(inputs), targets)
        out.append(float(loss.detach()))
        loss.backward()
        opt.step()
    _restore(saved)
    return out


def overfit_tutorial_order(model, inputs, targets, loss_fn, steps, lr):
    saved = _dropout_off(model)
    optimizer = torch.optim.Adam(params=list(model.parameters()), lr=lr)
    losses = []
    for step in range(steps):
        prediction = model(inputs)
        loss = loss_fn(prediction, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()  # the official tutorial's order
        losses.append(loss.detach().item())
    _restore(saved)
    return losses


def overfit_p_zero(model, inputs, targets, loss_fn, steps, lr):
    """Dropout switched off by p = 0 rather than eval mode, and put back afterwards."""
    rates = {m: m.p for m in model.modules() if isinstance(m, nn.Dropout)}
    modes = {m: m.training for m in model.modules()}
    model.train()
    for m in rates:
        m.p = 0.0
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    while len(losses) < steps:
        optimizer.zero_grad()
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    for m, p in rates.items():
        m.p = p
    for m, flag in modes.items():
        m.training = flag
    return losses


def _overfit(make_optimizer=lambda params, lr: torch.optim.Adam(params, lr=lr), *, dropout_off=True, whole_eval=False, restore=True,
             order="right", loss_after_step=False, batch=lambda x: x, steps_offset=0, as_tensor=False):
    """An overfit_one_batch that gets one thing wrong, chosen by the arguments."""
    def answer(model, inputs, targets, loss_fn, steps, lr):
        modes = {m: m.training for m in model.modules()}
        if whole_eval:
            model.eval()
        else:
            model.train()
            for m in model.modules():
                if dropout_off and isinstance(m, nn.Dropout):
                    m.eval()
        optimizer = make_optimizer(model.parameters(), lr)
        losses = []
        for _ in range(steps + steps_offset):
            if order == "right":
                optimizer.zero_grad()
            loss = loss_fn(model(batch(inputs)), targets[: len(batch(inputs))])
            loss.backward()
            if order == "between":
                optimizer.zero_grad()
            optimizer.step()
            if loss_after_step:
                loss = loss_fn(model(inputs), targets)
            losses.append(loss.detach() if as_tensor else loss.item())
        if restore:
            for m, flag in modes.items():
                m.training = flag
        return losses
    return answer


def overfit_restores_train(model, inputs, targets, loss_fn, steps, lr):
    losses = _overfit(restore=False)(model, inputs, targets, loss_fn, steps, lr)
    model.train()
    return losses


def overfit_p_zero_kept(model, inputs, targets, loss_fn, steps, lr):
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    return _overfit(dropout_off=False)(model, inputs, targets, loss_fn, steps, lr)


def overfit_normalises_inputs(model, inputs, targets, loss_fn, steps, lr):
    inputs -= inputs.mean(dim=0)
    return L.overfit_one_batch(model, inputs, targets, loss_fn, steps, lr)


def resumable_own_loop(model, loader, loss_fn, optimizer, scheduler, shuffle, epochs, path):
    history, start = [], 0
    if os.path.exists(path):
        saved = torch.load(path)
        model.load_state_dict(saved["weights"])
        optimizer.load_state_dict(saved["optim"])
        scheduler.load_state_dict(saved["sched"])
        torch.random.set_rng_state(saved["rng"]["cpu"])
        shuffle.set_state(saved["rng"]["loader"])
        history, start = list(saved["history"]), saved["epoch"]
    for epoch in range(start, epochs):
        model.train()
        total, count = torch.zeros(()), 0
        for x, y in loader:
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            total += loss.detach() * len(y)
            count += len(y)
        history.append((total / count).item())
        scheduler.step()
        temporary = Path(path).with_suffix(".tmp")  # written whole, then renamed: a crash never leaves half a file
        torch.save({"weights": model.state_dict(), "optim": optimizer.state_dict(), "sched": scheduler.state_dict(),
                    "rng": {"cpu": torch.random.get_rng_state(), "loader": shuffle.get_state()},
                    "history": history, "epoch": epoch + 1}, temporary)
        os.replace(temporary, path)
    return history


def resumable_nested(model, loader, loss_fn, optimizer, scheduler, shuffle, epochs, path):
    objects = {"model": model, "optimizer": optimizer, "scheduler": scheduler}
    losses = []
    if path.is_file():
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
        for key, obj in objects.items():
            obj.load_state_dict(checkpoint["states"][key])
        torch.set_rng_state(checkpoint["rng"][0])
        shuffle.set_state(checkpoint["rng"][1])
        losses = checkpoint["losses"]
    for _ in range(len(losses), epochs):
        losses.append(train_one_epoch(model, loader, loss_fn, optimizer))
        scheduler.step()
        torch.save({"states": {key: obj.state_dict() for key, obj in objects.items()},
                    "rng": [torch.get_rng_state(), shuffle.get_state()], "losses": losses}, path)
    return losses


def resumable_epoch_counter(model, loader, loss_fn, optimizer, scheduler, shuffle, epochs, path):
    done, losses = 0, []
    if path.exists():
        ck = torch.load(path, weights_only=True)
        model.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        scheduler.load_state_dict(ck["scheduler"])
        torch.set_rng_state(ck["torch"])
        shuffle.set_state(ck["generator"])
        done, losses = ck["epoch"], ck["losses"]
    while done < epochs:
        losses = losses + [train_one_epoch(model, loader, loss_fn, optimizer)]
        scheduler.step()
        done += 1
        torch.save(dict(model=model.state_dict(), optimizer=optimizer.state_dict(), scheduler=scheduler.state_dict(),
                        torch=torch.get_rng_state(), generator=shuffle.get_state(), epoch=done, losses=losses), path)
    return losses


def _resumable(save=("model", "optimizer", "scheduler", "torch", "shuffle"), *, keep_losses=True, extra_epochs=False,
               save_every_epoch=True, step_scheduler=True, save_before_step=False, weights_only=True):
    """A train_resumable that gets one thing wrong, chosen by the arguments."""
    def answer(model, loader, loss_fn, optimizer, scheduler, shuffle, epochs, path):
        losses, done = [], 0
        if path.exists():
            ck = torch.load(path, weights_only=weights_only)
            "model" in save and model.load_state_dict(ck["model"])
            "optimizer" in save and optimizer.load_state_dict(ck["optimizer"])
            "scheduler" in save and scheduler.load_state_dict(ck["scheduler"])
            "torch" in save and torch.set_rng_state(ck["torch"])
            "shuffle" in save and shuffle.set_state(ck["shuffle"])
            done = ck["epoch"]
            losses = ck["losses"] if keep_losses else []
        for epoch in range(0 if extra_epochs else done, epochs):
            losses.append(train_one_epoch(model, loader, loss_fn, optimizer))
            if save_before_step and save_every_epoch:
                _save(path, model, optimizer, scheduler, shuffle, epoch + 1, losses)
            if step_scheduler:
                scheduler.step()
            if save_every_epoch and not save_before_step:
                _save(path, model, optimizer, scheduler, shuffle, epoch + 1, losses)
        if not save_every_epoch:
            _save(path, model, optimizer, scheduler, shuffle, epochs, losses)
        return losses
    return answer


def resumable_epochs_from_checkpoint(model, loader, loss_fn, optimizer, scheduler, shuffle, epochs, path):
    losses = []
    if path.exists():
        ck = torch.load(path, weights_only=True)
        model.load_state_dict(ck["model"]), optimizer.load_state_dict(ck["optimizer"]), scheduler.load_state_dict(ck["scheduler"])
        torch.set_rng_state(ck["torch"]), shuffle.set_state(ck["shuffle"])
        losses, epochs = ck["losses"], ck["epochs"]  # the run's length, as first asked for
    while len(losses) < epochs:
        losses.append(train_one_epoch(model, loader, loss_fn, optimizer))
        scheduler.step()
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                    "torch": torch.get_rng_state(), "shuffle": shuffle.get_state(), "losses": losses, "epochs": epochs}, path)
    return losses


def _save(path, model, optimizer, scheduler, shuffle, epoch, losses):
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "torch": torch.get_rng_state(), "shuffle": shuffle.get_state(), "epoch": epoch, "losses": losses}, path)


def resumable_saves_objects(model, loader, loss_fn, optimizer, scheduler, shuffle, epochs, path):
    losses = []
    if path.exists():
        ck = torch.load(path, weights_only=False)
        model.load_state_dict(ck["model"].state_dict())
        optimizer.load_state_dict(ck["optimizer"].state_dict())
        losses = ck["losses"]
    while len(losses) < epochs:
        losses.append(train_one_epoch(model, loader, loss_fn, optimizer))
        scheduler.step()
        torch.save({"model": model, "optimizer": optimizer, "losses": losses}, path)
    return losses


def resumable_with_course_helpers(model, loader, loss_fn, optimizer, scheduler, shuffle, epochs, path):
    losses = []
    if path.exists():
        losses = load_checkpoint(path, model=model, optimizer=optimizer, scheduler=scheduler, generator=shuffle)["losses"]
    while len(losses) < epochs:
        losses.append(train_one_epoch(model, loader, loss_fn, optimizer))
        scheduler.step()
        save_checkpoint(path, model=model, optimizer=optimizer, scheduler=scheduler, epoch=len(losses), generator=shuffle, losses=losses)
    return losses


def resumable_saves_on_the_way_out(model, loader, loss_fn, optimizer, scheduler, shuffle, epochs, path):
    losses = []
    if path.exists():
        ck = torch.load(path, weights_only=True)
        model.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        scheduler.load_state_dict(ck["scheduler"])
        torch.set_rng_state(ck["torch"])
        shuffle.set_state(ck["shuffle"])
        losses = ck["losses"]
    try:
        while len(losses) < epochs:
            losses.append(train_one_epoch(model, loader, loss_fn, optimizer))
            scheduler.step()
    finally:  # saves also when a crash stops an epoch half-way: those weights belong to no finished epoch
        _save(path, model, optimizer, scheduler, shuffle, len(losses), losses)
    return losses


def resumable_swallows_crashes(model, loader, loss_fn, optimizer, scheduler, shuffle, epochs, path):
    try:
        return L.train_resumable(model, loader, loss_fn, optimizer, scheduler, shuffle, epochs, path)
    except BaseException:  # noqa: BLE001 -- the mistake under test
        return []


def resumable_returns_nothing(model, loader, loss_fn, optimizer, scheduler, shuffle, epochs, path):
    L.train_resumable(model, loader, loss_fn, optimizer, scheduler, shuffle, epochs, path)


def resumable_tensor_losses(model, loader, loss_fn, optimizer, scheduler, shuffle, epochs, path):
    return [torch.tensor(v) for v in L.train_resumable(model, loader, loss_fn, optimizer, scheduler, shuffle, epochs, path)]


OneCycle = torch.optim.lr_scheduler.OneCycleLR

ALTERNATIVES = [
    (L.check_sequence_loss, loss_permuted),
    (L.check_sequence_loss, loss_masked),
    (L.check_sequence_loss, loss_weighted_by_hand),
    (L.check_sequence_loss, loss_log_softmax_gather),
    (L.check_make_adamw, adamw_named),
    (L.check_make_adamw, adamw_lr_per_group),
    (L.check_make_adamw, adam_decoupled),
    (L.check_make_adamw, adamw_generators),
    (L.check_warmup_cosine, warmup_lambdas),
    (L.check_warmup_cosine, WarmupCosine),
    (L.check_warmup_cosine, warmup_keywords),
    (L.check_accumulation_step, accumulate_reverse_order),
    (L.check_accumulation_step, accumulate_sums_then_divides),
    (L.check_accumulation_step, accumulate_clips_by_hand),
    (L.check_overfit_one_batch, overfit_apply),
    (L.check_overfit_one_batch, overfit_tutorial_order),
    (L.check_overfit_one_batch, overfit_p_zero),
    (L.check_train_resumable, resumable_own_loop),
    (L.check_train_resumable, resumable_nested),
    (L.check_train_resumable, resumable_epoch_counter),
]


@pytest.mark.parametrize("check, answer", ALTERNATIVES, ids=[f"{c.exercise_name}-{a.__name__}" for c, a in ALTERNATIVES])
def test_correct_alternatives_pass(check, answer):
    assert_passes(check, answer)


WRONG = [
    (L.check_sequence_loss, loss_counts_padding, "padding positions were counted as tokens of class 7"),
    (L.check_sequence_loss, loss_pad_is_zero, r"left out where the target is 0, not where it is pad_index \(7\)"),
    (L.check_sequence_loss, loss_per_sequence, "mean of each sequence's mean"),
    (L.check_sequence_loss, loss_summed, "the sum over the real tokens: return their mean"),
    (L.check_sequence_loss, loss_over_all_positions, "divided by all N x T = 18 positions"),
    (L.check_sequence_loss, loss_item, "returned a Python number: return the loss tensor itself"),
    (L.check_sequence_loss, loss_classes_in_dim_2, "raised (RuntimeError|ValueError): Expected target size.*reads dim 1 of its input as the classes"),
    (L.check_sequence_loss, loss_view, r"raised RuntimeError: view size is not compatible.*reshape\(\) copies"),
    (L.check_sequence_loss, loss_softmax_first, "probabilities went into cross_entropy"),
    (L.check_sequence_loss, loss_overwrites_targets, r"sequence_loss \(its targets\) modified its input in place"),
    (L.check_sequence_loss, loss_detached, "does not require grad"),
    (L.check_sequence_loss, loss_per_token, r"shape \(3, 6\), one value per position"),
    (L.check_sequence_loss, loss_calls_backward, "did your function call backward\\(\\) itself"),
    (L.check_make_adamw, adamw_all_decayed, "every parameter is decayed; the ones with fewer than 2 dimensions"),
    (L.check_make_adamw, adamw_by_name, r"'norm.weight' has shape \(6,\) but is decayed: decide by the number of dimensions"),
    (L.check_make_adamw, adamw_with_frozen, r"'frozen.weight' is frozen \(requires_grad=False\) but is in the optimizer"),
    (L.check_make_adamw, adam_coupled, "torch.optim.Adam, whose weight decay is coupled"),
    (L.check_make_adamw, adamw_no_decay, "no parameter has weight decay"),
    (L.check_make_adamw, adamw_modules_only, r"'temperature' \(shape \(\)\) is not in the optimizer"),
    (L.check_make_adamw, adamw_freezes_the_rest, "changed requires_grad of 'temperature'"),
    (L.check_make_adamw, adamw_default_lr, "'temperature' has lr 0.001, expected 0.0003"),
    (L.check_make_adamw, adamw_other_eps, "has eps=1e-06, expected AdamW's default 1e-08"),
    (L.check_make_adamw, adamw_more_than_two_dims, r"'embed.weight' has shape \(13, 6\), 2 or more dimensions, but has no weight decay"),
    (L.check_make_adamw, adamw_fixed_decay, "'embed.weight' has weight_decay 0.01, expected 0.05"),
    (L.check_make_adamw, adamw_tied_twice, "'embed.weight' is in the optimizer twice"),
    (L.check_make_adamw, sgd_groups, "returned a torch.optim.SGD, expected a torch.optim.AdamW"),
    (L.check_make_adamw, lambda model, lr, wd: None, "returned None"),
    (L.check_warmup_cosine, warmup_cosine_too_long, "at step total_steps = 11 param group 0's lr is .*, expected min_lr = 0.001"),
    (L.check_warmup_cosine, warmup_no_eta_min, "at step total_steps = 11 param group 0's lr is 0, expected min_lr = 0.001"),
    (L.check_warmup_cosine, warmup_default_start, r"at step 0 param group 0's lr is 0.1, expected start_factor x lr = 0.06"),
    (L.check_warmup_cosine, warmup_default_length, r"at step 1 \(warm-up\) param group 0's lr is"),
    (L.check_warmup_cosine, cosine_only, "at step 0 param group 0's lr is 0.3, expected start_factor x lr = 0.06"),
    (L.check_warmup_cosine, warmup_shared_lambda, "at step total_steps = 11 param group 1's lr is 0.0002, expected min_lr = 0.001"),
    (L.check_warmup_cosine, WarmupOneLr, "param group 1 follows group 0's learning rates"),
    (L.check_warmup_cosine, warmup_milestone_late, "at step total_steps = 11 param group 0's lr is 0.01238, expected min_lr = 0.001"),
    (L.check_warmup_cosine, warmup_parts_list, "returned a list, expected a learning-rate scheduler"),
    (L.check_warmup_cosine, one_cycle, "at step 0 param group 0's lr is 0.012, expected start_factor x lr = 0.06"),
    (L.check_warmup_cosine, warmup_other_optimizer, "drives another optimizer"),
    (L.check_warmup_cosine, lambda opt, w, t, s, m: None, "returned None"),
    (L.check_accumulation_step, accumulate_divided_by_k, r"divided by the number of micro-batches \(3\); with sizes \[6, 1, 3\]"),
    (L.check_accumulation_step, accumulate_undivided, "added up unweighted"),
    (L.check_accumulation_step, accumulate_divided_by_four, r"every micro-batch's loss was given the same weight, whatever its size; with sizes \[6, 1, 3\]"),
    (L.check_accumulation_step, accumulate_summed_losses, "the gradient at the step points the right way, but is 10 times as long as it should be"),
    (L.check_accumulation_step, accumulate_without_zero_grad, "left in .grad from before counted too"),
    (L.check_accumulation_step, accumulate_zeroing_inside, "only the last micro-batch's gradient reached the step"),
    (L.check_accumulation_step, accumulate_without_clipping, r"micro-batches of 5, 5, 5, 2, max_norm=0.15\): the step used the unclipped gradient"),
    (L.check_accumulation_step, accumulate_clips_after_step, "the step used the unclipped gradient"),
    (L.check_accumulation_step, accumulate_steps_each, "optimizer.step\\(\\) was called 3 times"),
    (L.check_accumulation_step, accumulate_never_steps, "optimizer.step\\(\\) was never called"),
    (L.check_accumulation_step, accumulate_returns_tensor, "returned a tensor, expected a Python float"),
    (L.check_accumulation_step, accumulate_returns_clipped_norm, r"returned 0\.\d+, the norm after clipping: return the total norm from before clipping"),
    (L.check_accumulation_step, accumulate_returns_nothing, "returned None: return the total gradient norm"),
    (L.check_accumulation_step, accumulate_clips_values, "the step used the unclipped gradient"),  # no value is above 0.15
    (L.check_accumulation_step, accumulate_clips_each, r"the gradient of '.*' at the step: wrong values"),
    (L.check_accumulation_step, accumulate_grad_of_none, r"raised AttributeError: 'NoneType' object has no attribute 'pow'"),
    (L.check_accumulation_step, accumulate_as_one_batch, r"ran the model on all 10 samples at once: accumulation exists because that whole batch does not fit"),
    (L.check_accumulation_step, accumulate_one_backward, r"the forward pass of micro-batch 2 ran before the backward\(\) of micro-batch 1: each graph holds"),
    (L.check_overfit_one_batch, _overfit(whole_eval=True), r"batch norm ran in eval mode.*switch only the dropout layers to eval"),
    (L.check_overfit_one_batch, _overfit(dropout_off=False), r"dropout was active in the forward pass of step 1.*put every nn.Dropout in eval mode"),
    (L.check_overfit_one_batch, _overfit(lambda params, lr: torch.optim.SGD(params, lr=lr)), "these are the losses of torch.optim.SGD"),
    (L.check_overfit_one_batch, _overfit(lambda params, lr: torch.optim.AdamW(params, lr=lr)), r"torch.optim.AdamW, which decays the weights by default \(weight_decay=0.01\)"),
    (L.check_overfit_one_batch, _overfit(lambda params, lr: torch.optim.Adam(params)), "Adam at its default lr, 1e-3: pass lr"),
    (L.check_overfit_one_batch, _overfit(order="never"), r"the gradients piled up from step to step: call optimizer.zero_grad\(\) before each backward\(\)"),
    (L.check_overfit_one_batch, _overfit(order="between"), r"the loss is [\d.]+ at every step, so the weights never changed"),
    (L.check_overfit_one_batch, _overfit(loss_after_step=True), r"ran the model 40 times \(2 per step\), expected 20"),
    (L.check_overfit_one_batch, _overfit(steps_offset=-1), r"ran the model 19 times, expected 20"),
    (L.check_overfit_one_batch, _overfit(batch=lambda x: x[:4]), r"the forward pass of step 1 did not get the batch it was given"),
    (L.check_overfit_one_batch, _overfit(as_tensor=True), r"returned tensors in its list: return Python floats"),
    (L.check_overfit_one_batch, _overfit(restore=False), r"'3' \(Dropout\) was in train mode before the call and is in eval mode after"),
    (L.check_overfit_one_batch, overfit_restores_train, r"regression MLP .*left in train mode, but the caller had it in eval mode"),
    (L.check_overfit_one_batch, overfit_p_zero_kept, r"left '3' with p=0.0, it had p=0.3"),
    (L.check_overfit_one_batch, overfit_normalises_inputs, r"changed|modif"),
    (L.check_overfit_one_batch, lambda m, x, y, fn, steps, lr: L.overfit_one_batch(m, x, y, fn, steps, lr)[-1], r"returned a float, expected a list of floats, one per step"),
    (L.check_train_resumable, _resumable(save=("model", "shuffle", "torch")), "when training resumed, the optimizer.s momentum buffers were not those the uninterrupted run had after epoch 2"),
    (L.check_train_resumable, _resumable(save=("model", "optimizer", "shuffle", "torch")), "the scheduler had been stepped 0 times, expected 2"),
    (L.check_train_resumable, _resumable(save=("model", "optimizer", "scheduler", "torch")), r"first batch after resuming .* shuffle.get_state\(\)"),
    (L.check_train_resumable, _resumable(save=("model", "optimizer", "scheduler", "shuffle")), r"global random state, which dropout draws from, .* torch.get_rng_state\(\)"),
    (L.check_train_resumable, _resumable(save=("optimizer", "scheduler", "shuffle", "torch")), "when training resumed, the weights were not those the uninterrupted run had after epoch 2"),
    (L.check_train_resumable, _resumable(save_every_epoch=False), "after 2 finished epochs and a crash in epoch 3, there is no checkpoint at `path`"),
    (L.check_train_resumable, _resumable(keep_losses=False), "returned only the losses of the epochs after resuming"),
    (L.check_train_resumable, _resumable(extra_epochs=True), r"it trained 25 batches \(5 epochs\), expected 15"),
    (L.check_train_resumable, resumable_epochs_from_checkpoint, r"epochs=5\) resumed .* trained 10 batches \(2 epochs\), expected 15: .*it stopped after epoch 4, where the crashed call was to stop"),
    (L.check_train_resumable, _resumable(step_scheduler=False), "the learning rate at the end is 0.2, expected 0.05: step the scheduler once per epoch"),
    (L.check_train_resumable, _resumable(save_before_step=True), "the scheduler had been stepped 1 time, expected 2 \\(once per finished epoch\\): save scheduler.state_dict\\(\\) after its step"),
    (L.check_train_resumable, _resumable(weights_only=False), r"torch.load\(..., weights_only=False\)"),
    (L.check_train_resumable, resumable_saves_objects, r"does not load with torch.load\(weights_only=True\) \(UnpicklingError: WeightsUnpickler error: Unsupported global: GLOBAL torch.nn.modules.container.Sequential was not an allowed global by default\)"),
    (L.check_train_resumable, resumable_with_course_helpers, "layout of course_utils' save_checkpoint"),
    (L.check_train_resumable, resumable_saves_on_the_way_out, "when training resumed, the weights were not those the uninterrupted run had after epoch 2"),
    (L.check_train_resumable, resumable_swallows_crashes, "let exceptions through"),
    (L.check_train_resumable, resumable_returns_nothing, "returned None: return the list of every epoch's loss"),
    (L.check_train_resumable, resumable_tensor_losses, "returned tensors in its list"),
]


@pytest.mark.parametrize("check, wrong, message", WRONG, ids=[f"{c.exercise_name}-{i}" for i, (c, _, _) in enumerate(WRONG)])
def test_wrong_answers_name_the_fault(check, wrong, message):
    assert_names_fault(check, wrong, message)


def test_every_check_has_enough_alternatives_and_wrong_answers():
    for check, _ in PAIRS:
        assert sum(c is check for c, _ in ALTERNATIVES) >= 3, check.exercise_name
        assert sum(c is check for c, _, _ in WRONG) >= 8, check.exercise_name


def test_overfit_variants_differ_from_the_reference_and_each_other():
    """Each diagnosed wrong answer gives losses unlike the right ones and unlike every other diagnosis, so none is a guess."""
    for model, mode, inputs, targets, loss_fn, _, steps, lr in L._overfit_cases():
        model.train(mode == "train")
        expected = L.overfit_one_batch(__import__("copy").deepcopy(model), inputs, targets, loss_fn, steps, lr)
        curves = [expected] + [v for v, _ in L._overfit_variants(model, inputs, targets, loss_fn, steps, lr)]
        for i, a in enumerate(curves):
            for b in curves[i + 1:]:
                assert not all(math.isclose(x, y, rel_tol=1e-4) for x, y in zip(a, b))
        assert expected[-1] < 0.5 * expected[0]  # the hidden setups do learn


RAISING = [  # errors inside the learner's code: one line, arguments named briefly (no tensor or optimizer reprs)
    (L.check_sequence_loss, lambda logits, targets, pad: logits @ targets,
     r"^sequence_loss: <lambda>\(logits of shape \(3, 6, 12\), targets of shape \(3, 6\), pad_index=7\) raised RuntimeError"),
    (L.check_make_adamw, lambda model, lr, wd: model(lr), r"^make_adamw: <lambda>\(model, 0.0003, 0.05\) raised"),
    (L.check_warmup_cosine, lambda opt, w, t, s, m: LinearLR(opt, start_factor=0.0), r"^warmup_cosine: <lambda>\(optimizer, 3, 11, 0.2, 0.001\) raised ValueError"),
    (L.check_accumulation_step, lambda m, b, fn, opt, mx: m(b), r"^accumulation_step: <lambda>\(model, 3 micro-batches of 6, 1, 3, F.cross_entropy, optimizer, 50\) raised TypeError"),
    (L.check_overfit_one_batch, lambda m, x, y, fn, steps, lr: fn(m(x), y.float()),
     r"^overfit_one_batch: <lambda>\(an MLP with batch norm and dropout \(train mode\), a batch of 6, F.cross_entropy, steps=20, lr=0.03\) raised RuntimeError"),
    (L.check_train_resumable, lambda m, ld, fn, opt, s, g, e, p: torch.load(p, weights_only=True),
     r"^train_resumable: <lambda>\(model, loader, F.cross_entropy, optimizer, scheduler, shuffle, 4, path\) raised FileNotFoundError"),
]


@pytest.mark.parametrize("check, wrong, message", RAISING, ids=[c.exercise_name for c, _, _ in RAISING])
def test_errors_inside_the_learners_code_are_one_short_line(check, wrong, message):
    with pytest.raises(ExerciseFailed, match=message) as info:
        check(wrong)
    assert "\n" not in str(info.value) and len(str(info.value)) < 300


def test_a_scheduler_that_fails_to_step_is_the_learners_fault():
    verdict = L.check_warmup_cosine.verdict(lambda opt, w, t, s, m: torch.optim.lr_scheduler.ReduceLROnPlateau(opt))
    assert verdict.status == "failed" and "step() number 1 raised TypeError" in verdict.reason, verdict


def test_resume_check_leaves_no_files_and_restores_torch_load(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    load = torch.load
    L.check_train_resumable(L.train_resumable)
    assert torch.load is load
    assert list(tmp_path.iterdir()) == []


NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "solutions" / "05_training.ipynb"


def _notebook_code() -> list[str]:
    return [c.source for c in nbformat.read(NOTEBOOK, as_version=4).cells if c.cell_type == "code"]


def test_the_lessons_accuracy_claim():
    """The lesson says its model reaches >= 95 % test accuracy on the digits: train it exactly as the notebook does."""
    cells = _notebook_code()
    settings = next(c for c in cells if "def make_model(" in c)
    namespace = {"nn": nn, "torch": torch, "check_mode": lambda: False}
    exec(settings, namespace)  # the notebook's own model and settings
    split = next(c for c in cells if "random_split(" in c and "train_full" in c)
    training = next(c for c in cells if "history = fit(" in c and "scheduler_per_batch=True" in c)
    # The recipe below must be the notebook's: fail here if someone changes one without the other.
    for line, cell in (
        ("train_set, val_set = random_split(train_full, [0.8, 0.2], generator=torch.Generator().manual_seed(0))", split),
        ("optimizer = torch.optim.AdamW(model.parameters(), lr=MAX_LR, weight_decay=WEIGHT_DECAY)", training),
        ("scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=MAX_LR, epochs=EPOCHS, steps_per_epoch=len(train_loader))", training),
        ("history = fit(model, train_loader, val_loader, loss_fn, optimizer,", training),
        ("epochs=EPOCHS, scheduler=scheduler, scheduler_per_batch=True)", training),
    ):
        assert line in cell, f"the notebook's training recipe changed: {line}"
    assert any('assert test["accuracy"] >= 0.95' in c for c in cells)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the notebook's first cell does
    try:
        train_full, test_set, class_names = classification_datasets("digits")
        train_set, val_set = random_split(train_full, [0.8, 0.2], generator=torch.Generator().manual_seed(0))
        generator = seed_everything(0)
        train_loader = DataLoader(train_set, batch_size=namespace["BATCH_SIZE"], shuffle=True, generator=generator)
        val_loader = DataLoader(val_set, batch_size=256)
        seed_everything(0)
        generator.manual_seed(0)
        model = namespace["make_model"](train_full[0][0].numel(), len(class_names))
        MAX_LR, EPOCHS = namespace["MAX_LR"], namespace["EPOCHS"]
        optimizer = torch.optim.AdamW(model.parameters(), lr=MAX_LR, weight_decay=namespace["WEIGHT_DECAY"])
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=MAX_LR, epochs=EPOCHS, steps_per_epoch=len(train_loader))
        fit(model, train_loader, val_loader, nn.CrossEntropyLoss(), optimizer,
            epochs=EPOCHS, scheduler=scheduler, scheduler_per_batch=True, log=None)
        test = evaluate(model, DataLoader(test_set, batch_size=256), nn.CrossEntropyLoss())
    finally:
        torch.set_num_threads(threads)
    assert test["accuracy"] >= 0.95, test


@pytest.mark.parametrize("check, reference", PAIRS, ids=[r.__name__ for _, r in PAIRS])
def test_checks_leave_the_thread_count_alone(check, reference):
    """The checks run on one thread for speed, and give the caller's setting back."""
    threads = torch.get_num_threads()
    check(reference)
    assert torch.get_num_threads() == threads
