"""Lesson 06's checks against the reference solutions, correct alternatives, the wrong answers learners write, and its notebook's claims."""

import contextlib
import copy
import math
import pickle
import random
import warnings
from pathlib import Path

import nbformat
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from course_utils import lesson06 as L
from course_utils.benchmarking import saved_activation_bytes
from course_utils.tooling.checks import ExerciseFailed
from lesson_contract import assert_names_fault, assert_passes, contract_tests

PAIRS = [
    (L.check_fits_in_range, L.fits_in_range),
    (L.check_run_in_float32, L.run_in_float32),
    (L.check_loss_scale_schedule, L.loss_scale_schedule),
    (L.check_amp_step, L.amp_step),
    (L.check_resume_amp, L.resume_amp),
    (L.check_accumulate_step, L.accumulate_step),
]

(test_reference_passes, test_stub_is_not_attempted, test_bad_input_is_one_named_line, test_hostile_answers_are_the_learners_fault,
 test_checks_leave_the_learners_random_state_alone, test_checks_are_quick) = contract_tests(PAIRS, max_seconds=1.5)

HALF = (torch.bfloat16, torch.float16)


# fits_in_range

def fits_by_casting(x, dtype):
    return bool(torch.isfinite(x.to(dtype)).all())


def fits_elementwise(x, dtype):
    return bool((x.abs() <= torch.finfo(dtype).max).all())


def fits_by_item(x, dtype):
    return x.abs().max().item() <= torch.finfo(dtype).max


def fits_by_any(x, dtype):
    limit = torch.finfo(dtype).max
    return not bool((x > limit).any() or (x < -limit).any())


# run_in_float32

def f32_itemsize(fn, *args):
    cast = tuple(a.to(torch.float32) if isinstance(a, torch.Tensor) and a.is_floating_point() and a.element_size() == 2 else a
                 for a in args)
    device = next(a for a in args if isinstance(a, torch.Tensor)).device.type
    with torch.amp.autocast(device_type=device, enabled=False):
        return fn(*cast)


def f32_manual_restore(fn, *args):
    device = next(a.device.type for a in args if torch.is_tensor(a))
    was_on = torch.is_autocast_enabled(device)
    torch.set_autocast_enabled(device, False)
    try:
        return fn(*[a.float() if torch.is_tensor(a) and a.dtype in (torch.half, torch.bfloat16) else a for a in args])
    finally:
        torch.set_autocast_enabled(device, was_on)


def f32_decorated(fn, *args):
    (device,) = {a.device.type for a in args if isinstance(a, torch.Tensor)}
    args = [a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() and a.dtype != torch.float64 else a for a in args]
    return torch.autocast(device, enabled=False)(fn)(*args)


def f32_loop(fn, *args):
    ready = []
    for a in args:
        if isinstance(a, torch.Tensor) and a.dtype in HALF:
            a = a.type(torch.float32)
        ready.append(a)
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    with torch.autocast(tensors[0].device.type, enabled=False):
        result = fn(*ready)
    return result


def _f32(fn, args, *, disable=True, cast=lambda a: a.dtype in HALF, device="cpu", detach=False):
    ready = [(a.detach() if detach else a).float() if isinstance(a, torch.Tensor) and cast(a) else a for a in args]
    with torch.autocast(device, enabled=False) if disable else contextlib.nullcontext():
        return fn(*ready)


def f32_cast_only(fn, *args):
    return _f32(fn, args, disable=False)


def f32_disable_only(fn, *args):
    return _f32(fn, args, cast=lambda a: False)


def f32_on_cuda(fn, *args):
    return _f32(fn, args, device="cuda")


def f32_casting_float64_down(fn, *args):
    return _f32(fn, args, cast=lambda a: a.is_floating_point())


def f32_casting_everything(fn, *args):
    return _f32(fn, args, cast=lambda a: True)


def f32_detached(fn, *args):
    return _f32(fn, args, detach=True)


def f32_no_grad(fn, *args):
    with torch.no_grad():
        return _f32(fn, args)


def f32_left_off(fn, *args):
    torch.set_autocast_enabled("cpu", False)
    return fn(*[a.float() if isinstance(a, torch.Tensor) and a.dtype in HALF else a for a in args])


def f32_switched_back_on(fn, *args):
    torch.set_autocast_enabled("cpu", False)
    result = fn(*[a.float() if isinstance(a, torch.Tensor) and a.dtype in HALF else a for a in args])
    torch.set_autocast_enabled("cpu", True)
    return result


def f32_restored_without_finally(fn, *args):
    device = next(a.device.type for a in args if isinstance(a, torch.Tensor))
    was_on = torch.is_autocast_enabled(device)
    torch.set_autocast_enabled(device, False)
    result = fn(*[a.float() if isinstance(a, torch.Tensor) and a.dtype in HALF else a for a in args])
    torch.set_autocast_enabled(device, was_on)
    return result


def f32_autocast_in_float32(fn, *args):
    with torch.autocast("cpu", dtype=torch.float32):
        return fn(*[a.float() if isinstance(a, torch.Tensor) and a.dtype in HALF else a for a in args])


def f32_swallowing_errors(fn, *args):
    try:
        return L.run_in_float32(fn, *args)
    except Exception:  # noqa: BLE001 -- the wrong answer under test swallows every error
        return None


def f32_twice(fn, *args):
    L.run_in_float32(fn, *args)
    return L.run_in_float32(fn, *args)


def f32_cast_back(fn, *args):
    return L.run_in_float32(fn, *args).to(args[0].dtype)


def f32_float_everything(fn, *args):
    with torch.autocast("cpu", enabled=False):
        return fn(*[a.float() for a in args])


def f32_resetting_the_dtype(fn, *args):
    with torch.autocast("cpu", enabled=False):
        result = fn(*[a.float() if isinstance(a, torch.Tensor) and a.dtype in HALF else a for a in args])
    torch.set_autocast_dtype("cpu", torch.bfloat16)
    return result


# loss_scale_schedule

def schedule_variant(**options):
    return lambda found_inf, init_scale, growth_interval: L._schedule_variant(found_inf, init_scale, growth_interval, **options)


def _schedule(found_inf, init_scale, growth_interval, backoff):
    """The schedule with another rule for an inf/NaN step (backoff: old scale -> new scale)."""
    scale, good, scales = init_scale, 0, []
    for inf in found_inf:
        if inf:
            scale, good = backoff(scale), 0
        else:
            good += 1
            if good == growth_interval:
                scale, good = scale * 2, 0
        scales.append(scale)
    return scales


def schedule_doubling_on_inf(found_inf, init_scale, growth_interval):
    return _schedule(found_inf, init_scale, growth_interval, backoff=lambda scale: scale * 2)


def schedule_ints(found_inf, init_scale, growth_interval):
    return _schedule(found_inf, int(init_scale), growth_interval, backoff=lambda scale: scale // 2)


def schedule_with_a_real_scaler(found_inf, init_scale, growth_interval):
    return L._gradscaler_scales(found_inf, init_scale, growth_interval)


def schedule_by_modulo(found_inf, init_scale, growth_interval):
    scales, streak, scale = [], 0, float(init_scale)
    for bad in found_inf:
        streak = 0 if bad else streak + 1
        scale = scale / 2 if bad else (scale * 2 if streak % growth_interval == 0 else scale)
        scales.append(scale)
    return scales


def schedule_with_powers(found_inf, init_scale, growth_interval):
    exponent, good, out = 0, 0, []
    for inf in found_inf:
        if inf:
            exponent, good = exponent - 1, 0
        elif (good := good + 1) == growth_interval:
            exponent, good = exponent + 1, 0
        out.append(init_scale * 2.0 ** exponent)
    return out


def schedule_generator(found_inf, init_scale, growth_interval):
    def scales():
        scale, good = init_scale, 0
        for inf in found_inf:
            good = 0 if inf else good + 1
            scale *= 0.5 if inf else 1.0
            if good == growth_interval:
                scale, good = scale * 2.0, 0
            yield scale
    return scales()


# amp_step

def amp_relying_on_the_scaler(model, inputs, targets, loss_fn, optimizer, scaler, dtype, max_norm):
    optimizer.zero_grad()
    ctx = torch.amp.autocast(inputs.device.type, dtype=dtype) if dtype in HALF else contextlib.nullcontext()
    with ctx:
        loss = loss_fn(model(inputs), targets)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if scaler.is_enabled():
        before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        return scaler.get_scale() >= before
    if not torch.isfinite(norm):
        return False
    optimizer.step()
    return True


def amp_checking_every_gradient(model, inputs, targets, loss_fn, optimizer, scaler, dtype, max_norm):
    for p in model.parameters():
        p.grad = None
    with torch.autocast(inputs.device.type, dtype=dtype, enabled=dtype is not torch.float32):
        logits = model(inputs)
        loss = loss_fn(logits, targets)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    finite = all(bool(g.isfinite().all()) for g in grads)
    nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if finite:
        scaler.step(optimizer)
    scaler.update()
    return finite


def amp_loss_on_float32_logits(model, inputs, targets, loss_fn, optimizer, scaler, dtype, max_norm):
    optimizer.zero_grad(set_to_none=False)
    with torch.autocast(inputs.device.type, dtype=dtype, enabled=dtype != torch.float32):
        logits = model(inputs)
    loss = loss_fn(logits.float(), targets)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    ok = math.isfinite(norm.item())
    if ok:
        optimizer.step()  # after unscale_, a plain step is right: the guard has done what scaler.step would
    scaler.update()
    return ok


def amp_loss_outside_autocast(model, inputs, targets, loss_fn, optimizer, scaler, dtype, max_norm):
    optimizer.zero_grad()
    with torch.autocast(inputs.device.type, dtype=dtype, enabled=dtype != torch.float32):
        logits = model(inputs)
    loss = loss_fn(logits, targets)  # on 16-bit logits, outside autocast: a 16-bit loss
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    ok = bool(nn.utils.clip_grad_norm_(model.parameters(), max_norm).isfinite())
    if ok:
        scaler.step(optimizer)
    scaler.update()
    return ok


def amp_zeroing_only_at_the_end(model, inputs, targets, loss_fn, optimizer, scaler, dtype, max_norm):
    ok = _amp(model, inputs, targets, loss_fn, optimizer, scaler, dtype, max_norm, zero=False)
    optimizer.zero_grad()  # too late: the check left stale gradients before the first step
    return ok


def amp_with_error_if_nonfinite(model, inputs, targets, loss_fn, optimizer, scaler, dtype, max_norm):
    optimizer.zero_grad()
    with torch.autocast(inputs.device.type, dtype=dtype, enabled=dtype != torch.float32):
        loss = loss_fn(model(inputs), targets)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    try:
        nn.utils.clip_grad_norm_(model.parameters(), max_norm, error_if_nonfinite=True)
    except RuntimeError:
        scaler.update()
        return False
    scaler.step(optimizer)
    scaler.update()
    return True


def _amp(model, inputs, targets, loss_fn, optimizer, scaler, dtype, max_norm, *, guard="norm", zero=True, clip="after",
         update="always", autocast_dtype=None, always_autocast=False, device=None, cast_model=False, ret="bool", on_skip=None,
         scale=True):
    """amp_step with one typical mistake; with an enabled scaler it reports a skip from the scale, as learners do."""
    if zero:
        optimizer.zero_grad()
    if cast_model:
        model.to(dtype)
        inputs = inputs.to(dtype)
    scale_before = scaler.get_scale()
    enabled = always_autocast or autocast_dtype is not None or dtype != torch.float32
    with torch.autocast(device or inputs.device.type, dtype=autocast_dtype or dtype, enabled=enabled):
        loss = loss_fn(model(inputs), targets)
    (scaler.scale(loss) if scale else loss).backward()
    if clip == "before":
        norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        scaler.unscale_(optimizer)
    elif clip == "each":
        scaler.unscale_(optimizer)
        norm = torch.stack([nn.utils.clip_grad_norm_(p, max_norm) for p in model.parameters() if p.grad is not None]).norm()
    else:
        scaler.unscale_(optimizer)
        norm = nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
        if clip == "after":
            nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    ok = {"norm": bool(torch.isfinite(norm)), "loss": bool(torch.isfinite(loss)), "nan": not bool(torch.isnan(norm)),
          "none": True, "inverted": not bool(torch.isfinite(norm))}[guard]
    if ok:
        scaler.step(optimizer)
    elif on_skip == "zero_and_step":
        optimizer.zero_grad()
        optimizer.step()
    if update == "always" or (update == "on_step" and ok):
        scaler.update()
    if scaler.is_enabled() and guard != "inverted":
        ok = ok and scaler.get_scale() >= scale_before
    return {"bool": ok, "none": None, "loss": loss, "tensor": torch.tensor(ok)}[ret]


def amp_wrong(**options):
    return lambda *args: _amp(*args, **options)


# fits_in_range, run_in_float32, loss_scale_schedule, amp_step: answers that change the caller's objects

def fits_cast_in_place(x, dtype):
    x.data = x.data.to(dtype)  # "converts" the caller's tensor
    return bool(torch.isfinite(x).all())


def f32_cast_in_place(fn, *args):
    for a in args:
        if isinstance(a, torch.Tensor) and a.dtype in HALF:
            a.data = a.data.float()  # the caller's tensors, converted in place
    with torch.autocast("cpu", enabled=False):
        return fn(*args)


def schedule_consuming_the_list(found_inf, init_scale, growth_interval):
    scale, good, scales = init_scale, 0, []
    while found_inf:
        inf = found_inf.pop(0)
        good = 0 if inf else good + 1
        scale = scale * 0.5 if inf else scale
        if good == growth_interval:
            scale, good = scale * 2.0, 0
        scales.append(scale)
    return scales


def amp_cleaning_the_batch(model, inputs, targets, loss_fn, optimizer, scaler, dtype, max_norm):
    torch.nan_to_num_(inputs)  # "cleans" the caller's batch in place
    return L.amp_step(model, inputs, targets, loss_fn, optimizer, scaler, dtype, max_norm)


def amp_guarding_the_loss_first(model, inputs, targets, loss_fn, optimizer, scaler, dtype, max_norm, *, update=False):
    optimizer.zero_grad()
    with torch.autocast(inputs.device.type, dtype=dtype, enabled=dtype != torch.float32):
        loss = loss_fn(model(inputs), targets)
    if not torch.isfinite(loss):  # skips before backward: no inf check for update() to read
        if update:
            scaler.update()
        return False
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    ok = bool(torch.isfinite(norm))
    if ok:
        scaler.step(optimizer)
    scaler.update()
    return ok


def amp_guarding_the_loss_then_backing_off(model, inputs, targets, loss_fn, optimizer, scaler, dtype, max_norm):
    """A correct alternative: on a NaN loss it backs the scale off by hand, as update() would."""
    optimizer.zero_grad()
    with torch.autocast(inputs.device.type, dtype=dtype, enabled=dtype != torch.float32):
        loss = loss_fn(model(inputs), targets)
    if not torch.isfinite(loss):
        if scaler.is_enabled():
            scaler.update(scaler.get_scale() * scaler.get_backoff_factor())
        return False
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    ok = bool(nn.utils.clip_grad_norm_(model.parameters(), max_norm).isfinite())
    if ok:
        scaler.step(optimizer)
    scaler.update()
    return ok


# resume_amp

def resume_checking_the_precision(path, model, optimizer, scaler):
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    if scaler.is_enabled() and len(checkpoint["scaler"]) > 0:
        scaler.load_state_dict(checkpoint["scaler"])
    return int(checkpoint["step"])


def resume_from_a_file_object(path, model, optimizer, scaler):
    with open(path, "rb") as file:
        checkpoint = torch.load(file, weights_only=True)
    for obj, key in ((model, "model"), (optimizer, "optimizer")):
        obj.load_state_dict(checkpoint[key])
    try:
        scaler.load_state_dict(checkpoint["scaler"])
    except RuntimeError:  # "The source state dict is empty": a run without loss scaling
        pass
    return checkpoint["step"]


def resume_with_get(path, model, optimizer, scaler):
    checkpoint = torch.load(Path(path), weights_only=True)
    model.load_state_dict(checkpoint["model"], strict=True)
    optimizer.load_state_dict(checkpoint["optimizer"])
    state = checkpoint.get("scaler") or {}
    if state:
        scaler.load_state_dict(state)
    return checkpoint["step"]


def _resume(path, model, optimizer, scaler, *, load=("model", "optimizer", "scaler"), guard=True, ret=lambda c: c["step"],
            weights_only=True):
    checkpoint = torch.load(path, weights_only=weights_only)
    objects = {"model": model, "optimizer": optimizer, "scaler": scaler}
    for key in load:
        if key == "scaler" and guard and not checkpoint["scaler"]:
            continue
        objects[key].load_state_dict(checkpoint[key])
    return ret(checkpoint)


def resume_wrong(**options):
    return lambda path, model, optimizer, scaler: _resume(path, model, optimizer, scaler, **options)


def resume_into_a_new_scaler(path, model, optimizer, scaler):
    checkpoint = torch.load(path, weights_only=True)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    scaler = torch.amp.GradScaler("cpu", enabled=bool(checkpoint["scaler"]))
    scaler.load_state_dict(checkpoint["scaler"])
    return checkpoint["step"]


def resume_scale_only(path, model, optimizer, scaler):
    checkpoint = torch.load(path, weights_only=True)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    if checkpoint["scaler"]:
        scaler.load_state_dict({**scaler.state_dict(), "scale": checkpoint["scaler"]["scale"]})
    return checkpoint["step"]


def resume_resetting_to_defaults(path, model, optimizer, scaler):
    checkpoint = torch.load(path, weights_only=True)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    scaler.load_state_dict(checkpoint["scaler"] or torch.amp.GradScaler("cpu").state_dict())
    return checkpoint["step"]


def resume_enabling_the_scaler(path, model, optimizer, scaler):
    checkpoint = torch.load(path, weights_only=True)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    if checkpoint["scaler"]:
        scaler._enabled = True  # "the run had a scaler, so this one needs it too"
        scaler.load_state_dict(checkpoint["scaler"])
    return checkpoint["step"]


def resume_the_whole_checkpoint_into_the_model(path, model, optimizer, scaler):
    checkpoint = torch.load(path, weights_only=True)
    model.load_state_dict(checkpoint)
    return checkpoint["step"]


# accumulate_step

def accumulate_summing_the_losses(model, micro_batches, loss_fn, optimizer, scaler, dtype, max_norm):
    """One backward of the weighted sum: the same gradients, more memory."""
    optimizer.zero_grad()
    n = sum(t.shape[0] for _, t in micro_batches)
    total = 0.0
    for inputs, targets in micro_batches:
        with torch.autocast("cpu", dtype=dtype, enabled=dtype in HALF):
            total = total + loss_fn(model(inputs), targets) * targets.shape[0] / n
    scaler.scale(total).backward()
    scaler.unscale_(optimizer)
    norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if not math.isfinite(norm.item()):
        scaler.update()
        return False
    scaler.step(optimizer)
    scaler.update()
    return True


def accumulate_with_sum_losses(model, micro_batches, loss_fn, optimizer, scaler, dtype, max_norm):
    """Sums instead of means: each micro-batch's mean times its size, the total divided once by the count."""
    for p in model.parameters():
        p.grad = None
    count = sum(len(t) for _, t in micro_batches)
    for inputs, targets in micro_batches:
        with torch.autocast(inputs.device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss_sum = loss_fn(model(inputs), targets) * len(targets)
        scaler.scale(loss_sum / count).backward()
    scaler.unscale_(optimizer)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    finite = all(bool(g.isfinite().all()) for g in grads)
    nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if finite:
        scaler.step(optimizer)
    scaler.update()
    return finite


def accumulate_on_float32_logits(model, micro_batches, loss_fn, optimizer, scaler, dtype, max_norm):
    optimizer.zero_grad(set_to_none=False)
    weights = [len(t) / sum(len(u) for _, u in micro_batches) for _, t in micro_batches]
    for (inputs, targets), w in zip(micro_batches, weights):
        with torch.autocast(inputs.device.type, dtype=dtype, enabled=dtype != torch.float32):
            logits = model(inputs)
        scaler.scale(w * loss_fn(logits.float(), targets)).backward()
    scaler.unscale_(optimizer)
    ok = bool(torch.isfinite(nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
    if ok:
        scaler.step(optimizer)
    scaler.update()
    return ok


def accumulate_relying_on_the_scaler(model, micro_batches, loss_fn, optimizer, scaler, dtype, max_norm):
    """No NaN guard of its own: scaler.step skips a float16 step, and a disabled scaler skips nothing."""
    before = scaler.get_scale()
    optimizer.zero_grad()
    n = sum(len(t) for _, t in micro_batches)
    for inputs, targets in micro_batches:
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            loss = loss_fn(model(inputs), targets) * (len(targets) / n)
        scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()
    return scaler.get_scale() >= before


def _accumulate(model, micro_batches, loss_fn, optimizer, scaler, dtype, max_norm, *, weight="share", zero="once",
                step_each=False, update_each=False, unscale_each=False, clip="after", guard=True, concat=False,
                loss_outside=False, ret="bool"):
    """accumulate_step with one typical mistake."""
    if zero == "once":
        optimizer.zero_grad()
    total, k = sum(len(t) for _, t in micro_batches), len(micro_batches)
    if concat:
        micro_batches = [(torch.cat([x for x, _ in micro_batches]), torch.cat([t for _, t in micro_batches]))]
    for inputs, targets in micro_batches:
        if zero == "each":
            optimizer.zero_grad()
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            logits = model(inputs)
            loss = None if loss_outside else loss_fn(logits, targets)
        if loss_outside:
            loss = loss_fn(logits, targets)
        w = {"share": len(targets) / total, "k": 1 / k, "none": 1.0}[weight] if not concat else 1.0
        scaler.scale(loss * w).backward()
        if unscale_each:
            scaler.unscale_(optimizer)
        if step_each:
            scaler.step(optimizer)
        if update_each:
            scaler.update()
    if step_each and update_each:
        return True
    if clip == "before":
        nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if not unscale_each:
        scaler.unscale_(optimizer)
    norm = nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    if clip == "after":
        nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    ok = bool(torch.isfinite(norm)) or not guard
    if ok and not step_each:
        scaler.step(optimizer)
    if not update_each:
        scaler.update()
    return {"bool": ok, "none": None}[ret]


def accumulate_wrong(**options):
    return lambda *args: _accumulate(*args, **options)


ALTERNATIVES = [
    (L.check_fits_in_range, fits_by_casting),
    (L.check_fits_in_range, fits_elementwise),
    (L.check_fits_in_range, fits_by_item),
    (L.check_fits_in_range, fits_by_any),
    (L.check_run_in_float32, f32_itemsize),
    (L.check_run_in_float32, f32_manual_restore),
    (L.check_run_in_float32, f32_decorated),
    (L.check_run_in_float32, f32_loop),
    (L.check_loss_scale_schedule, lambda f, s, g: tuple(L.loss_scale_schedule(f, s, g))),
    (L.check_loss_scale_schedule, schedule_with_a_real_scaler),
    (L.check_loss_scale_schedule, schedule_by_modulo),
    (L.check_loss_scale_schedule, schedule_with_powers),
    (L.check_loss_scale_schedule, lambda f, s, g: torch.tensor(L.loss_scale_schedule(f, s, g), dtype=torch.float64)),
    (L.check_amp_step, amp_relying_on_the_scaler),
    (L.check_amp_step, amp_checking_every_gradient),
    (L.check_amp_step, amp_loss_on_float32_logits),
    (L.check_amp_step, amp_with_error_if_nonfinite),
    (L.check_amp_step, amp_guarding_the_loss_then_backing_off),
    (L.check_resume_amp, resume_checking_the_precision),
    (L.check_resume_amp, resume_from_a_file_object),
    (L.check_resume_amp, resume_with_get),
    (L.check_accumulate_step, accumulate_summing_the_losses),
    (L.check_accumulate_step, accumulate_with_sum_losses),
    (L.check_accumulate_step, accumulate_on_float32_logits),
]


@pytest.mark.parametrize("check, answer", ALTERNATIVES, ids=lambda v: getattr(v, "exercise_name", None) or getattr(v, "__name__", ""))
def test_correct_alternatives_pass(check, answer):
    assert_passes(check, answer)


WRONG = [
    # fits_in_range
    (L.check_fits_in_range, lambda x, d: bool(x.abs().max() <= torch.finfo(d).eps), "compared with torch.finfo\\(dtype\\).eps"),
    (L.check_fits_in_range, lambda x, d: bool(x.abs().max() <= torch.finfo(d).tiny), "compared with torch.finfo\\(dtype\\).tiny"),
    (L.check_fits_in_range, lambda x, d: bool(x.max() <= torch.finfo(d).max), "large negative value.*x.abs\\(\\)"),
    (L.check_fits_in_range, lambda x, d: bool(x.abs().max() < torch.finfo(d).max), "use <=, not <"),
    (L.check_fits_in_range, lambda x, d: bool(x.abs().max() <= 65504), "float16's limit only"),
    (L.check_fits_in_range, lambda x, d: bool(x.abs().max() <= torch.finfo(d).max and x.abs().min() >= torch.finfo(d).tiny),
     "below finfo\\(dtype\\).tiny do not overflow"),
    (L.check_fits_in_range, lambda x, d: x.abs().max() <= torch.finfo(d).max, "is a tensor, expected a Python bool"),
    (L.check_fits_in_range, lambda x, d: bool(x.abs().max() <= torch.finfo(torch.float16).max), "float16's limit only"),
    (L.check_fits_in_range, lambda x, d: True, r"torch.float16\) returned True, expected False: \|70000\| is above torch.finfo\(torch.float16\).max = 65504"),
    (L.check_fits_in_range, lambda x, d: bool(x.abs().max() <= torch.finfo(torch.bfloat16).max), "compared every dtype with bfloat16's limit"),
    (L.check_fits_in_range, lambda x, d: bool(x.abs().max() <= torch.finfo(torch.float32).max), "compared every dtype with float32's limit"),
    (L.check_fits_in_range, lambda x, d: bool(x.abs().max() <= torch.finfo(d).max) if d != torch.bfloat16 else True,
     r"fits_in_range\(torch.tensor\(\[-3.4e\+38\]\), torch.bfloat16\) returned True, expected False: \|3.4e\+38\| is above torch.finfo\(torch.bfloat16\).max = 3.38953e\+38, so the cast gives inf"),
    (L.check_fits_in_range, fits_cast_in_place, "changed the caller's tensor x \\(now float16"),
    (L.check_fits_in_range, lambda x, d: None, "is None: did you forget to `return` it"),
    (L.check_fits_in_range, lambda x, d: (x.abs().max() <= torch.finfo(d).max).numpy(), "is a numpy.ndarray, expected a Python bool: wrap it in bool"),
    # run_in_float32
    (L.check_run_in_float32, f32_cast_only, "autocast was still on while fn ran, so its matmul ran in bfloat16 although you passed float32"),
    (L.check_run_in_float32, f32_disable_only, "fn received a as bfloat16: with autocast off each op runs in its inputs' dtype"),
    (L.check_run_in_float32, f32_on_cuda, "autocast was still on while fn ran.*for the tensors' device type"),
    (L.check_run_in_float32, f32_casting_float64_down, r"fn received b \(float64 in the call\) as float32: cast only bfloat16 and float16"),
    (L.check_run_in_float32, f32_casting_everything, r"fn received index \(int64 in the call\) as float32"),
    (L.check_run_in_float32, f32_detached, r"fn received a detached copy of a \(requires_grad=False\), so no gradient reaches the caller's a"),
    (L.check_run_in_float32, f32_no_grad, r"gradient recording was off while fn ran \(torch.no_grad\(\) or torch.inference_mode\(\) around it\)"),
    (L.check_run_in_float32, f32_left_off, "autocast was off after your function returned"),
    (L.check_run_in_float32, f32_switched_back_on, "outside autocast: autocast was on after your function returned, though it was off before"),
    (L.check_run_in_float32, f32_restored_without_finally, "when fn raised, autocast stayed switched off in the caller"),
    (L.check_run_in_float32, f32_swallowing_errors, "when fn raised, your function returned normally"),
    (L.check_run_in_float32, f32_twice, "fn was called 2 times: call it once"),
    (L.check_run_in_float32, f32_cast_back, "fn returned a float32 tensor, and your function returned it converted to bfloat16"),
    (L.check_run_in_float32, f32_float_everything, "raised AttributeError: 'float' object has no attribute 'float'"),
    (L.check_run_in_float32, f32_resetting_the_dtype, "autocast's dtype was bfloat16 after your function returned, expected float16"),
    (L.check_run_in_float32, lambda fn, *args: fn, "fn was never called"),
    (L.check_run_in_float32, f32_cast_in_place, "the caller's tensor a is now float32, it was bfloat16: cast into new tensors"),
    (L.check_run_in_float32, f32_autocast_in_float32, r"torch.autocast\(..., dtype=torch.float32\) warned and switched itself off: switch autocast off with enabled=False"),
    # loss_scale_schedule
    (L.check_loss_scale_schedule, schedule_variant(reset_on_inf=False), "after an inf/NaN step the count of good steps starts again"),
    (L.check_loss_scale_schedule, schedule_variant(off_by_one=True), "growth_interval-th good step"),
    (L.check_loss_scale_schedule, schedule_variant(reset_on_growth=False), "after the scale doubles, the count"),
    (L.check_loss_scale_schedule, schedule_variant(before=True), "after each step's update\\(\\), not the scale the step used"),
    (L.check_loss_scale_schedule, schedule_doubling_on_inf, "after step 3 \\(found_inf=True\\) the scale should be 8"),
    (L.check_loss_scale_schedule, lambda f, s, g: L.loss_scale_schedule(f, s, g)[:-1], "one scale per step"),
    (L.check_loss_scale_schedule, lambda f, s, g: None, "is None"),
    (L.check_loss_scale_schedule, schedule_ints, r"\[True, True, False, True\], init_scale=2, growth_interval=3\): after step 1 the scale should be 0.5, got 0: the value was rounded down, as // and int\(\) do"),
    (L.check_loss_scale_schedule, schedule_consuming_the_list, "changed the caller's list found_inf \\(now \\[\\]\\): only read it"),
    (L.check_loss_scale_schedule, lambda f, s, g: [s] * len(f), ("after step 1 \\(found_inf=False\\) the scale should be 16, got 8.0: this step completes "
                                                                 "growth_interval=2 good steps in a row .*so the scale doubles \\(growth_factor 2.0\\), from 8 to 16")),
    (L.check_loss_scale_schedule, lambda f, s, g: [s * (0.5 if inf else 1.0) for inf in f], "after step 1 .*the scale should be 16, got 8.0: this step completes growth_interval=2"),
    (L.check_loss_scale_schedule, schedule_generator, "is a generator, expected a list of floats"),
    (L.check_loss_scale_schedule, lambda f, s, g: L.loss_scale_schedule(f, s, g)[-1] if f else [], "is a float, expected a list"),
    # amp_step
    (L.check_amp_step, amp_wrong(guard="none"), "bfloat16, step 3: the loss was NaN .*stepped anyway: a disabled scaler skips nothing"),
    (L.check_amp_step, amp_wrong(guard="loss"), "bfloat16, step 7: the loss was finite, but a gradient overflowed to inf in backward, and the optimizer stepped anyway"),
    (L.check_amp_step, amp_wrong(guard="nan"), "bfloat16, step 7: the loss was finite, but a gradient overflowed"),
    (L.check_amp_step, amp_wrong(guard="inverted"), "float16, step 0: the loss and the gradients of this step are finite in the reference solution, but your optimizer did not step"),
    (L.check_amp_step, amp_wrong(clip="before"), "float16, step 0: the gradients were clipped while still scaled"),
    (L.check_amp_step, amp_wrong(clip="none"), "float16, step 0: the gradients were not clipped"),
    (L.check_amp_step, amp_wrong(clip="each"), "clipped on its own"),
    (L.check_amp_step, amp_wrong(zero=False), "float16, step 0: old gradients were still in .grad"),
    (L.check_amp_step, amp_wrong(update="on_step"), "float16, step 1: the loss was NaN.*back off from 262144 to 131072.*update\\(\\) on skipped steps too"),
    (L.check_amp_step, amp_wrong(update="never"), "float16, step 0: the scale is 131072, expected 262144"),
    (L.check_amp_step, amp_wrong(autocast_dtype=torch.bfloat16), "float16, step 0: the forward ran in bfloat16: use the dtype you were given, float16"),
    (L.check_amp_step, amp_wrong(always_autocast=True), r"float32, step 0: torch.autocast\(..., dtype=torch.float32\) warned"),
    (L.check_amp_step, amp_wrong(device="cuda"), "device_type='cuda' does nothing for CPU tensors"),
    (L.check_amp_step, amp_wrong(cast_model=True), "raised ValueError: Attempting to unscale FP16 gradients. .the parameters are float16"),
    (L.check_amp_step, amp_wrong(ret="none"), "returned None, expected a Python bool"),
    (L.check_amp_step, amp_wrong(ret="loss"), "returned torch.Tensor, expected a Python bool"),
    (L.check_amp_step, amp_wrong(ret="tensor"), "returned torch.Tensor, expected a Python bool"),
    (L.check_amp_step, amp_wrong(scale=False), "raised AssertionError.*not scaled anything yet"),
    (L.check_amp_step, amp_wrong(guard="loss", on_skip="zero_and_step"), "float16, step 1: the loss was NaN .*the optimizer stepped anyway"),
    (L.check_amp_step, lambda *args: None, "the model was never called"),
    (L.check_amp_step, amp_loss_outside_autocast, ("float16, step 0: the loss came out float16: it was computed outside autocast on "
                                                    "float16 logits; scaling a float16 loss by 131072, above float16's largest value "
                                                    "65504, overflows")),
    (L.check_amp_step, amp_zeroing_only_at_the_end, "float16, step 0: old gradients were still in .grad"),
    (L.check_amp_step, amp_cleaning_the_batch, "float16, step 1: the caller's inputs or targets changed"),
    (L.check_amp_step, amp_guarding_the_loss_first, ("float16, step 1: the loss was NaN .*you skipped the step before backward, so the scale "
                                                     "stayed 262144 instead of backing off to 131072.*run scaler.scale\\(loss\\).backward\\(\\) and unscale_ even when the loss is not finite")),
    (L.check_amp_step, lambda *a: amp_guarding_the_loss_first(*a, update=True), ("raised AssertionError: No inf checks were recorded prior to update. "
                                                                                 "\\(scaler.update\\(\\) needs this step's inf check.*skip only the optimizer step, then call update\\(\\)")),
    # resume_amp
    (L.check_resume_amp, resume_wrong(guard=False), (r"path \(a bfloat16 run's checkpoint, step 4\), model, optimizer, scaler \(fresh, for a float16 run\)\) raised "
                                                     "RuntimeError: The source state dict is empty.*load the scaler's state only when the checkpoint holds one")),
    (L.check_resume_amp, resume_wrong(load=("model", "optimizer")),
     r"step 7\), model, optimizer, scaler \(fresh, for a float16 run\)\): the scaler you were given still has its fresh state \(scale 4096\), not the saved one"),
    (L.check_resume_amp, resume_into_a_new_scaler, "the scaler you were given still has its fresh state"),
    (L.check_resume_amp, resume_scale_only, r"the scaler's 'growth_interval' is 5, saved 3: load the whole of checkpoint\['scaler'\]"),
    (L.check_resume_amp, resume_resetting_to_defaults, r"bfloat16 run's checkpoint, step 4\), .*: this checkpoint holds no scaler state .*should stay as it was, \{'scale': 4096.0"),
    (L.check_resume_amp, resume_wrong(load=("model", "scaler")), "the optimizer's state .* is not the saved one"),
    (L.check_resume_amp, resume_wrong(load=("optimizer", "scaler")), "the model's weights are not the saved ones"),
    (L.check_resume_amp, resume_wrong(weights_only=False), r"read the file with torch.load\(..., weights_only=False\), which runs whatever code"),
    (L.check_resume_amp, resume_wrong(ret=lambda c: c["step"] + 1), "returned 8, expected 7: return the step stored in the checkpoint"),
    (L.check_resume_amp, resume_wrong(ret=lambda c: None), "is None: did you forget to `return` it"),
    (L.check_resume_amp, resume_wrong(ret=lambda c: torch.tensor(c["step"])), "returned a tensor, expected the Python int 7"),
    (L.check_resume_amp, resume_wrong(ret=lambda c: c), "is a dict .*expected an int"),
    (L.check_resume_amp, resume_the_whole_checkpoint_into_the_model, r"raised RuntimeError: Error\(s\) in loading state_dict.*each object takes its own entry"),
    # accumulate_step
    (L.check_accumulate_step, accumulate_wrong(weight="k"), (r"float16, step 0 \(3 micro-batches of \[6, 6, 3\] rows\): each micro-batch's loss was divided by "
                                                             r"the number of micro-batches, 3, which weights every sample of a smaller micro-batch more")),
    (L.check_accumulate_step, accumulate_wrong(weight="none"), "the 3 micro-batch losses were added up unweighted"),
    (L.check_accumulate_step, accumulate_wrong(zero="each"), "the gradients were cleared before each micro-batch, so only the last one counted"),
    (L.check_accumulate_step, accumulate_wrong(zero="never"), r"old gradients were still in .grad: clear them once"),
    (L.check_accumulate_step, accumulate_wrong(clip="none"), "the gradients were not clipped"),
    (L.check_accumulate_step, accumulate_wrong(clip="before"), "float16, step .*clipped while still scaled: call scaler.unscale_\\(optimizer\\) once, after the last micro-batch"),
    (L.check_accumulate_step, accumulate_wrong(step_each=True, update_each=True), "the optimizer stepped 3 times in one call: step once"),
    (L.check_accumulate_step, accumulate_wrong(update_each=True), r"raised AssertionError: No inf checks were recorded prior to update. \(scaler.update\(\) ran before this step's scaler.unscale_\(optimizer\): update once per step"),
    (L.check_accumulate_step, accumulate_wrong(unscale_each=True), r"raised RuntimeError: unscale_\(\) has already been called on this optimizer since the last update\(\). \(unscale_ once per step, after the last micro-batch"),
    (L.check_accumulate_step, accumulate_wrong(guard=False), "float16, step 2 .*the loss of one micro-batch was NaN .*rightly skipped, but you returned True"),
    (L.check_accumulate_step, accumulate_relying_on_the_scaler,
     r"bfloat16, step 4 .*the loss of one micro-batch was NaN .*and the optimizer stepped anyway: a disabled scaler skips nothing"),
    (L.check_accumulate_step, accumulate_wrong(concat=True), r"the model ran on \[15\] rows at a time: run it on each micro-batch on its own \(\[6, 6, 3\] rows\)"),
    (L.check_accumulate_step, accumulate_wrong(loss_outside=True), "float16, step 0 .*the loss came out float16: it was computed outside autocast"),
    (L.check_accumulate_step, accumulate_wrong(ret="none"), "returned None, expected a Python bool"),
    (L.check_accumulate_step, lambda model, micro, *rest: L.accumulate_step(model, micro[:1], *rest), r"the model ran on batches of \[6\] rows, expected one call per micro-batch, \[6, 6, 3\]"),
]


@pytest.mark.parametrize("check, wrong, message", WRONG, ids=lambda v: getattr(v, "exercise_name", None) if callable(v) else None)
def test_wrong_answers_name_the_fault(check, wrong, message):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # autocast on "cuda" without a GPU says so
        assert_names_fault(check, wrong, message)


@pytest.mark.parametrize("check", [c for c, _ in PAIRS], ids=lambda c: c.exercise_name)
def test_each_check_is_tested_enough(check):
    """The bar: at least 3 correct alternatives and 8 typical wrong answers per check."""
    assert sum(c is check for c, _ in ALTERNATIVES) >= 3
    assert sum(c is check for c, _, _ in WRONG) >= 8


RAISING = [  # errors inside the learner's code: one line, arguments named briefly
    (L.check_fits_in_range, lambda x, d: x.abs().max() <= d.max, r"^fits_in_range: <lambda>\(torch.tensor\(\[0.5, -3.0, 0.0010000000474974513\]\), torch.float16\) raised AttributeError"),
    (L.check_run_in_float32, lambda fn, *a: fn(*a[:2]), r"^run_in_float32: run_in_float32\(fn, a \(bfloat16\), b \(bfloat16\), index \(int64\), 0.5\) raised TypeError: fn takes 4 arguments"),
    (L.check_amp_step, lambda m, x, y, f, o, s, d, n: s.step(), r"^amp_step: amp_step\(model, inputs, targets, F.cross_entropy, optimizer, scaler \(enabled\), torch.float16, max_norm=0.5\) raised TypeError"),
    (L.check_resume_amp, lambda path, m, o, s: torch.load(path)["epoch"], r"^resume_amp: resume_amp\(path \(a float16 run's checkpoint, step 7\), model, optimizer, scaler \(fresh, for a float16 run\)\) raised KeyError"),
    (L.check_accumulate_step, lambda m, micro, *rest: m(torch.cat(micro)), r"^accumulate_step: accumulate_step\(model, 3 micro-batches of 6, 6, 3 rows, .*\) raised TypeError"),
]


@pytest.mark.parametrize("check, wrong, message", RAISING)
def test_errors_inside_the_learners_code_are_one_short_line(check, wrong, message):
    with pytest.raises(ExerciseFailed, match=message) as info:
        check(wrong)
    assert "\n" not in str(info.value) and len(str(info.value)) < 300


@pytest.mark.parametrize("check, reference", PAIRS, ids=[r.__name__ for _, r in PAIRS])
def test_checks_leave_autocast_and_threads_alone(check, reference):
    """A check leaves autocast and the thread count as it found them (the random state: lesson_contract)."""
    threads = torch.get_num_threads()
    check(reference)
    assert not torch.is_autocast_enabled("cpu")
    assert torch.get_num_threads() == threads


def test_a_check_switches_off_autocast_a_learner_left_on():
    with pytest.raises(ExerciseFailed):
        L.check_run_in_float32(f32_switched_back_on)
    assert not torch.is_autocast_enabled("cpu")


def test_the_schedule_is_torchs_gradscaler():
    """The reference loss_scale_schedule is what torch.amp.GradScaler does, on random inf patterns."""
    rng = random.Random(0)
    for _ in range(20):
        found_inf = [rng.random() < 0.3 for _ in range(rng.randint(1, 15))]
        init_scale, interval = 2.0 ** rng.randint(1, 16), rng.randint(1, 4)
        assert L.loss_scale_schedule(found_inf, init_scale, interval) == L._gradscaler_scales(found_inf, init_scale, interval)


def test_run_in_float32_matches_torchs_custom_fwd():
    """The reference casts as torch.amp.custom_fwd(cast_inputs=torch.float32) does: 16-bit floats up, float64 and ints kept."""
    seen = {}

    class Probe(torch.autograd.Function):
        @staticmethod
        @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
        def forward(ctx, a, b, index):
            seen["torch"] = (a.dtype, b.dtype, index.dtype, torch.is_autocast_enabled("cpu"))
            return a.sum() + b.sum()

        @staticmethod
        def backward(ctx, grad):
            return None, None, None

    def mine(a, b, index):
        seen["mine"] = (a.dtype, b.dtype, index.dtype, torch.is_autocast_enabled("cpu"))

    for dtype in HALF:
        a, b, index = torch.ones(2, dtype=dtype), torch.ones(2, dtype=torch.float64), torch.arange(2)
        with torch.autocast("cpu", dtype=dtype):
            Probe.apply(a, b, index)
            L.run_in_float32(mine, a, b, index)
        assert seen["mine"] == seen["torch"] == (torch.float32, torch.float64, torch.int64, False)


def test_the_hidden_amp_runs_go_wrong_where_the_check_says():
    """Each precision's hidden run has a NaN loss and a backward overflow on steps of its own; float16 overflows by itself too."""
    skipped = {}
    for dtype in L._AMP_ORDER:
        batches, nan_step, overflow_step = L._amp_batches(dtype)
        run = L._AmpRun(dtype)
        results = []
        for step, (x, y) in enumerate(batches):
            run.overflow = step == overflow_step
            results.append(L.amp_step(run.model, x, y, F.cross_entropy, run.optimizer, run.scaler, dtype, L._AMP_MAX_NORM))
        skipped[dtype] = [s for s, ok in enumerate(results) if not ok]
        assert {nan_step, overflow_step} <= set(skipped[dtype]) and results[0]
    assert len(skipped[torch.float16]) == 3 and len(skipped[torch.bfloat16]) == len(skipped[torch.float32]) == 2


def test_the_mistake_simulations_differ_from_the_right_answer():
    """Each simulated mistake must change the weights of a good step, or its message could never show."""
    for dtype in L._AMP_ORDER:
        (x, y), *_ = L._amp_batches(dtype)[0]
        right = L._AmpRun(dtype)
        L.amp_step(right.model, x, y, F.cross_entropy, right.optimizer, right.scaler, dtype, L._AMP_MAX_NORM)
        for variant, _ in L._AMP_MISTAKES:
            if variant == "clip_before_unscale" and dtype != torch.float16:
                continue
            wrong = L._AmpRun(dtype)
            L._amp_variant(wrong, x, y, variant)
            assert L._first_difference(L._params(wrong.model), L._params(right.model), L._AMP_ATOL) is not None, (dtype, variant)


def test_a_fresh_scaler_after_a_resume_replays_the_overflows(tmp_path):
    """Why the scaler goes into the checkpoint: resumed with a fresh one, the run skips steps the original did not."""
    original = L._trained_run(torch.float16, 6, init_scale=2.0 ** 24)
    L.save_amp_checkpoint(tmp_path / "amp.pt", original.model, original.optimizer, original.scaler, 6)
    fresh = L._AmpRun(torch.float16, seed=9)
    fresh.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24, growth_interval=3)
    state = torch.load(tmp_path / "amp.pt", weights_only=True)
    fresh.model.load_state_dict(state["model"])
    fresh.optimizer.load_state_dict(state["optimizer"])
    L._continue(original, 4, seed=5)
    L._continue(fresh, 4, seed=5)
    assert original.scaler.get_scale() != fresh.scaler.get_scale()


def test_autocast_saves_fewer_bytes_for_backward():
    """What the notebook's memory table shows: with a large batch, autocast saves fewer bytes for backward."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    x = torch.randn(2048, 256)
    _, fp32 = saved_activation_bytes(lambda: model(x), model.parameters())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, bf16 = saved_activation_bytes(lambda: model(x), model.parameters())
    assert fp32 == 3 * 2048 * 256 * 4  # the input and two ReLU outputs, float32
    assert bf16 < 0.6 * fp32
    rows = L.saved_tensors(model, x[:8])
    assert [r["storage"] for r in rows] == ["new", "new", "again", "parameter", "new", "again", "parameter"]
    assert not model[0]._forward_pre_hooks  # the listing removes its hooks


NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "solutions" / "06_amp.ipynb"


def _notebook() -> nbformat.NotebookNode:
    return nbformat.read(NOTEBOOK, as_version=4)


def test_no_deprecated_amp_call_in_code():
    """torch.cuda.amp / torch.cpu.amp are called only in Pitfall 1, inside a block that catches their warnings."""
    for cell in _notebook().cells:
        if cell.cell_type != "code":
            continue
        calls = [line for line in cell.source.splitlines() if "torch.cuda.amp." in line or "torch.cpu.amp." in line]
        if calls:
            assert cell.source.startswith("# 1. and 2. The deprecated spellings"), cell.source.splitlines()[0]
            block = cell.source.split("with warnings.catch_warnings(record=True) as caught:", 1)[1].split("\nfor warning", 1)[0]
            assert all(line in block for line in calls)


def test_the_learner_writes_the_central_apis():
    """The issue's list: the learner writes scaler.state_dict() into a checkpoint, loads it back, and a float32 region."""
    solutions = {tag.split(":", 1)[1]: cell.source for cell in _notebook().cells
                 for tag in cell.metadata.get("tags", []) if tag.startswith("exercise:")}
    assert "load_state_dict" in solutions["resume_amp"] and "weights_only=True" in solutions["resume_amp"]
    assert "unscale_" in solutions["accumulate_step"] and "scaler.scale" in solutions["accumulate_step"]
    assert "enabled=False" in solutions["run_in_float32"]
    assert "unscale_" in solutions["amp_step"] and "clip_grad_norm_" in solutions["amp_step"]


def test_a_float16_loss_skips_the_first_step_and_caps_the_scale():
    """Pitfall 8: a float16 loss outside autocast skips step 0 and every attempt to grow back to 2**16, nothing else."""
    def float16_loss(logits, targets):
        with torch.autocast("cpu", enabled=False):
            return F.cross_entropy(logits, targets)

    torch.manual_seed(0)
    model = nn.Linear(16, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", growth_interval=3)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    used = []
    for _ in range(12):
        used.append((scaler.get_scale(), L.amp_step(model, x, y, float16_loss, optimizer, scaler, torch.float16, 1.0)))
    assert [i for i, (_, taken) in enumerate(used) if not taken] == [0, 4, 8]
    assert max(scale for scale, taken in used if taken) == 2.0 ** 15


def test_float16_zones_round_to_nearest():
    """Below half the smallest subnormal a value becomes 0; at or above it, it survives (the text of section 1)."""
    smallest = 2.0 ** -24
    values = torch.tensor([smallest * 0.49, smallest * 0.51, 1e-5, 1.0, 7e4], dtype=torch.float64)
    assert values.half().tolist()[:2] == [0.0, smallest]
    zones = L.float16_zones(values)
    assert zones == {"become 0": 0.2, "subnormal": 0.4, "normal": 0.2, "inf": 0.2}
