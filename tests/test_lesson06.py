"""Lesson 06's checks against the reference solutions and the wrong answers learners write, and its notebook's claims."""

import random
import warnings
from pathlib import Path

import nbformat
import pytest
import torch
from torch import nn

from course_utils import lesson06 as L
from course_utils.tooling.checks import ExerciseFailed
from lesson_contract import assert_names_fault, contract_tests

PAIRS = [
    (L.check_fits_in_range, L.fits_in_range),
    (L.check_autocast_forward, L.autocast_forward),
    (L.check_saved_bytes, L.saved_bytes),
    (L.check_loss_scale_schedule, L.loss_scale_schedule),
    (L.check_scaled_step, L.scaled_step),
    (L.check_accumulate_scaled, L.accumulate_scaled),
]

(test_reference_passes, test_stub_is_not_attempted, test_bad_input_is_one_named_line, test_hostile_answers_are_the_learners_fault,
 test_checks_leave_the_learners_random_state_alone, test_checks_are_quick) = contract_tests(PAIRS, max_seconds=1.0)


# Typical wrong answers, one function each.

def fits_by_casting(x, dtype):  # a correct alternative
    return bool(torch.isfinite(x.to(dtype)).all())


def forward_without_autocast(model, x):
    return model(x)


def forward_with_bf16_model(model, x):
    return model.to(torch.bfloat16)(x.to(torch.bfloat16))


def forward_with_bf16_model_fp32_input(model, x):
    return model.to(torch.bfloat16)(x)


def forward_in_fp16(model, x):
    with torch.autocast("cpu", dtype=torch.float16):
        return model(x)


def forward_on_cuda(model, x):
    with torch.autocast("cuda", dtype=torch.float16):
        return model(x)


def forward_converted_back(model, x):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return model(x).float()


def forward_cast_at_the_end(model, x):
    return model(x).to(torch.bfloat16)


def forward_without_grad(model, x):
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        return model(x)


def forward_leaving_autocast_on(model, x):
    torch.set_autocast_dtype("cpu", torch.bfloat16)
    torch.set_autocast_enabled("cpu", True)
    return model(x)


def forward_amp_autocast(model, x):  # a correct alternative
    with torch.amp.autocast("cpu"):  # bfloat16 is the CPU default
        return model(x)


def _saved(model, x, *, size, dedupe=True, skip_params=True, key=lambda t: t.untyped_storage().data_ptr()):
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    sizes, total = {}, 0

    def pack(t):
        nonlocal total
        if skip_params and t.untyped_storage().data_ptr() in params:
            return t
        if dedupe:
            sizes[key(t)] = size(t)
        else:
            total += size(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return sum(sizes.values()) + total


def saved_numel(model, x):
    return _saved(model, x, size=lambda t: t.numel())


def saved_four_bytes(model, x):
    return _saved(model, x, size=lambda t: 4 * t.numel())


def saved_duplicates(model, x):
    return _saved(model, x, size=lambda t: t.numel() * t.element_size(), dedupe=False)


def saved_with_params(model, x):
    return _saved(model, x, size=lambda t: t.untyped_storage().nbytes(), skip_params=False)


def saved_everything(model, x):
    return _saved(model, x, size=lambda t: t.untyped_storage().nbytes(), dedupe=False, skip_params=False)


def saved_by_data_ptr(model, x):  # a correct alternative: no views into larger storages here
    return _saved(model, x, size=lambda t: t.numel() * t.element_size(), key=lambda t: t.data_ptr())


def saved_under_no_grad(model, x):
    with torch.no_grad():
        return _saved(model, x, size=lambda t: t.numel() * t.element_size())


def saved_output_bytes(model, x):
    out = model(x)
    return out.numel() * out.element_size()


def schedule_no_reset_on_inf(found_inf, init_scale, growth_interval):
    return L._schedule_variant(found_inf, init_scale, growth_interval, reset_on_inf=False)


def schedule_off_by_one(found_inf, init_scale, growth_interval):
    return L._schedule_variant(found_inf, init_scale, growth_interval, off_by_one=True)


def schedule_no_reset_on_growth(found_inf, init_scale, growth_interval):
    return L._schedule_variant(found_inf, init_scale, growth_interval, reset_on_growth=False)


def schedule_before_update(found_inf, init_scale, growth_interval):
    return L._schedule_variant(found_inf, init_scale, growth_interval, before=True)


def schedule_doubling_on_inf(found_inf, init_scale, growth_interval):
    scale, good, scales = init_scale, 0, []
    for inf in found_inf:
        if inf:
            scale, good = scale * 2, 0
        else:
            good += 1
            if good == growth_interval:
                scale, good = scale * 2, 0
        scales.append(scale)
    return scales


def step_clip_before_unscale(model, loss, optimizer, scaler, max_norm):
    scaler.scale(loss).backward()
    nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()


def step_without_clip(model, loss, optimizer, scaler, max_norm):
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()


def step_without_update(model, loss, optimizer, scaler, max_norm):
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)


def step_with_optimizer_step(model, loss, optimizer, scaler, max_norm):
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    scaler.update()


def step_without_scale(model, loss, optimizer, scaler, max_norm):
    loss.backward()
    scaler.unscale_(optimizer)
    nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()


def step_update_first(model, loss, optimizer, scaler, max_norm):
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.update()
    scaler.step(optimizer)


def step_unscale_twice(model, loss, optimizer, scaler, max_norm):
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()


def step_backward_only(model, loss, optimizer, scaler, max_norm):
    scaler.scale(loss).backward()


def step_zeroing_after(model, loss, optimizer, scaler, max_norm):  # a correct alternative
    L.scaled_step(model, loss, optimizer, scaler, max_norm)
    optimizer.zero_grad()


def _accumulate(model, micro_batches, loss_fn, optimizer, scaler, *, dtype=torch.float16, divide=True, zero="start", scale=True, step_each=False, update=True):
    if zero == "start":
        optimizer.zero_grad()
    k = len(micro_batches)
    for inputs, targets in micro_batches:
        if zero == "inside":
            optimizer.zero_grad()
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            loss = loss_fn(model(inputs), targets)
        loss = loss / k if divide else loss
        (scaler.scale(loss) if scale else loss).backward()
        if step_each:
            scaler.step(optimizer)
            scaler.update()
    if not step_each:
        scaler.step(optimizer)
        if update:
            scaler.update()


WRONG = [
    (L.check_fits_in_range, lambda x, d: bool(x.abs().max() <= torch.finfo(d).eps), "compared with torch.finfo\\(dtype\\).eps"),
    (L.check_fits_in_range, lambda x, d: bool(x.abs().max() <= torch.finfo(d).tiny), "compared with torch.finfo\\(dtype\\).tiny"),
    (L.check_fits_in_range, lambda x, d: bool(x.max() <= torch.finfo(d).max), "large negative value.*x.abs\\(\\)"),
    (L.check_fits_in_range, lambda x, d: bool(x.abs().max() < torch.finfo(d).max), "use <=, not <"),
    (L.check_fits_in_range, lambda x, d: bool(x.abs().max() <= 65504), "float16's limit only"),
    (L.check_fits_in_range, lambda x, d: bool(x.abs().max() <= torch.finfo(d).max and x.abs().min() >= torch.finfo(d).tiny), "below finfo\\(dtype\\).tiny do not overflow"),
    (L.check_fits_in_range, lambda x, d: x.abs().max() <= torch.finfo(d).max, "is a tensor, expected a Python bool"),
    (L.check_fits_in_range, lambda x, d: bool(x.abs().max() <= torch.finfo(torch.float16).max), "float16's limit only"),
    (L.check_fits_in_range, lambda x, d: True, "torch.float16\\): expected False, got True"),
    (L.check_fits_in_range, lambda x, d: None, "is None: did you forget to `return` it"),
    (L.check_fits_in_range, fits_by_casting, None),
    (L.check_autocast_forward, forward_without_autocast, "the output is float32, so nothing ran in lower precision"),
    (L.check_autocast_forward, forward_with_bf16_model, "parameters are now torch.bfloat16.*autocast keeps them float32"),
    (L.check_autocast_forward, forward_with_bf16_model_fp32_input, "raised RuntimeError.*leave the model as it is"),
    (L.check_autocast_forward, forward_in_fp16, "float16: on the CPU use dtype=torch.bfloat16"),
    (L.check_autocast_forward, forward_on_cuda if not torch.cuda.is_available() else forward_without_autocast, "device_type='cuda' does nothing" if not torch.cuda.is_available() else "float32"),
    (L.check_autocast_forward, forward_converted_back, "converted back to float32"),
    (L.check_autocast_forward, forward_cast_at_the_end, "only the result was cast"),
    (L.check_autocast_forward, forward_without_grad, "does not require grad"),
    (L.check_autocast_forward, forward_leaving_autocast_on, "still switched on after your function returned"),
    (L.check_autocast_forward, lambda m, x: None, "is None"),
    (L.check_autocast_forward, forward_amp_autocast, None),
    (L.check_saved_bytes, saved_numel, "number of elements.*element_size"),
    (L.check_saved_bytes, saved_four_bytes, "under CPU bf16 autocast.*4 bytes.*element_size"),
    (L.check_saved_bytes, saved_duplicates, "counted more than once.*each storage once"),
    (L.check_saved_bytes, saved_with_params, "parameters were counted"),
    (L.check_saved_bytes, saved_everything, "parameters were counted, and tensors saved twice"),
    (L.check_saved_bytes, saved_under_no_grad, "is 0: nothing was saved"),
    (L.check_saved_bytes, saved_output_bytes, "expected [\\d,]+ bytes$"),
    (L.check_saved_bytes, lambda m, x: torch.tensor(L.saved_bytes(m, x)), "is a tensor.*item"),
    (L.check_saved_bytes, lambda m, x: None, "is None"),
    (L.check_saved_bytes, lambda m, x: L.saved_bytes(m, x) / 2**20, "whole number of bytes"),
    (L.check_saved_bytes, saved_by_data_ptr, None),
    (L.check_loss_scale_schedule, schedule_no_reset_on_inf, "after an inf/NaN step the count of good steps starts again"),
    (L.check_loss_scale_schedule, schedule_off_by_one, "growth_interval-th good step"),
    (L.check_loss_scale_schedule, schedule_no_reset_on_growth, "after the scale doubles, the count"),
    (L.check_loss_scale_schedule, schedule_before_update, "after each step's update\\(\\), not the scale the step used"),
    (L.check_loss_scale_schedule, schedule_doubling_on_inf, "after step 3 \\(found_inf=True\\) the scale should be 8"),
    (L.check_loss_scale_schedule, lambda f, s, g: L.loss_scale_schedule(f, s, g)[:-1], "one scale per step"),
    (L.check_loss_scale_schedule, lambda f, s, g: None, "is None"),
    (L.check_loss_scale_schedule, lambda f, s, g: tuple(L.loss_scale_schedule(f, s, g)), None),  # a tuple is fine
    (L.check_scaled_step, step_clip_before_unscale, "clipped while still scaled.*unscale_"),
    (L.check_scaled_step, step_without_clip, "not clipped.*clip_grad_norm_"),
    (L.check_scaled_step, step_without_update, "scale stayed 1024.*scaler.update\\(\\)"),
    (L.check_scaled_step, step_with_optimizer_step, "became inf/NaN.*scaler.step\\(optimizer\\)"),
    (L.check_scaled_step, step_without_scale, "raised AssertionError.*not scaled anything yet: call scaler.scale\\(loss\\).backward\\(\\)"),
    (L.check_scaled_step, step_update_first, "after scaler.step\\(optimizer\\), not before"),
    (L.check_scaled_step, step_unscale_twice, "raised RuntimeError.*once per step"),
    (L.check_scaled_step, step_backward_only, "did not change: call scaler.step"),
    (L.check_scaled_step, lambda m, loss, o, s, n: None, "no gradients were computed"),
    (L.check_scaled_step, step_zeroing_after, None),
    (L.check_accumulate_scaled, lambda *a: _accumulate(*a, divide=False), "4x too large.*divide"),
    (L.check_accumulate_scaled, lambda *a: _accumulate(*a, zero="none"), "old gradients.*zero_grad\\(\\) once"),
    (L.check_accumulate_scaled, lambda *a: _accumulate(*a, zero="inside"), "only the last micro-batch"),
    (L.check_accumulate_scaled, lambda *a: _accumulate(*a, scale=False), "raised AssertionError.*not scaled anything yet"),
    (L.check_accumulate_scaled, lambda *a: _accumulate(*a, step_each=True), "stepped 4 times"),
    (L.check_accumulate_scaled, lambda *a: _accumulate(*a, update=False), "scale stayed 256.*scaler.update\\(\\)"),
    (L.check_accumulate_scaled, lambda *a: _accumulate(*a, dtype=None), "forward ran in torch.float32.*float16"),
    (L.check_accumulate_scaled, lambda *a: _accumulate(*a, dtype=torch.bfloat16), "forward ran in torch.bfloat16"),
    (L.check_accumulate_scaled, lambda *a: None, "never called"),
]


RAISING = [  # errors inside the learner's code: one line, arguments named briefly
    (L.check_fits_in_range, lambda x, d: x.abs().max() <= d.max, r"^fits_in_range: <lambda>\(torch.tensor\(\[0.5, -3.0, 0.0010000000474974513\]\), torch.float16\) raised AttributeError"),
    (L.check_autocast_forward, lambda m, x: m(x.T), r"^autocast_forward: <lambda>\(model \(float32 weights\), tensor of shape \(16, 12\)\) raised RuntimeError"),
    (L.check_scaled_step, lambda m, loss, o, s, n: s.step(), r"^scaled_step: <lambda>\(model, loss, optimizer, scaler \(scale 1024\), max_norm=0.05\) raised TypeError"),
    (L.check_accumulate_scaled, lambda m, b, fn, o, s: m(b), r"^accumulate_scaled: <lambda>\(model, 4 micro-batches of 5, F.cross_entropy, optimizer, scaler \(scale 256\)\) raised TypeError"),
]


@pytest.mark.parametrize("check, wrong, message", WRONG)
def test_wrong_answers_name_the_fault(check, wrong, message):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # autocast on "cuda" without a GPU says so
        assert_names_fault(check, wrong, message)


@pytest.mark.parametrize("check, wrong, message", RAISING)
def test_errors_inside_the_learners_code_are_one_short_line(check, wrong, message):
    with pytest.raises(ExerciseFailed, match=message) as info:
        check(wrong)
    assert "\n" not in str(info.value) and len(str(info.value)) < 300


@pytest.mark.parametrize("check, reference", PAIRS, ids=[r.__name__ for _, r in PAIRS])
def test_checks_leave_autocast_off(check, reference):
    """A check leaves autocast as it found it (the random state: lesson_contract)."""
    check(reference)
    assert not torch.is_autocast_enabled("cpu")


def test_a_check_switches_off_autocast_a_learner_left_on():
    with pytest.raises(ExerciseFailed):
        L.check_autocast_forward(forward_leaving_autocast_on)
    assert not torch.is_autocast_enabled("cpu")


def test_the_schedule_is_torchs_gradscaler():
    """The reference loss_scale_schedule is what torch.amp.GradScaler does, on random inf patterns."""
    rng = random.Random(0)
    for _ in range(20):
        found_inf = [rng.random() < 0.3 for _ in range(rng.randint(1, 15))]
        init_scale, interval = 2.0 ** rng.randint(1, 16), rng.randint(1, 4)
        assert L.loss_scale_schedule(found_inf, init_scale, interval) == L._gradscaler_scales(found_inf, init_scale, interval)


def test_the_mistake_simulations_differ_from_the_right_answer():
    """Each simulated wrong answer must give different weights from the right one, or its message could never show."""
    right = L._step_variant(False, "right")
    for variant, _ in L._STEP_MISTAKES:
        assert not L._same(L._step_variant(False, variant), right), variant
    right = L._acc_variant("right")
    for variant, _ in L._ACC_MISTAKES:
        assert not L._same(L._acc_variant(variant), right, atol=1e-5), variant


def test_saved_bytes_halves_activations_under_autocast():
    """What the notebook's memory table shows: with a large batch, autocast saves fewer bytes for backward."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    x = torch.randn(2048, 256)
    fp32 = L.saved_bytes(model, x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = L.saved_bytes(model, x)
    assert fp32 == 3 * 2048 * 256 * 4  # the input and two ReLU outputs, float32
    assert bf16 < 0.6 * fp32


NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "solutions" / "06_amp.ipynb"


def _notebook_code() -> list[str]:
    return [c.source for c in nbformat.read(NOTEBOOK, as_version=4).cells if c.cell_type == "code"]


def test_no_deprecated_amp_call_in_code():
    """torch.cuda.amp / torch.cpu.amp are named in markdown prose only: no code cell calls them."""
    for source in _notebook_code():
        for spelling in ("torch.cuda.amp.", "torch.cpu.amp."):
            assert spelling not in source, source.splitlines()[0]