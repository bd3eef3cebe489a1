"""Lesson 08's checks against the reference solutions, correct alternatives, and the wrong answers learners write."""

import contextlib
import functools
import itertools
import json
import math
import tempfile
import tracemalloc
import warnings
from pathlib import Path

import nbformat
import psutil
import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

from course_utils import lesson08 as L
from course_utils.tooling.checks import ExerciseFailed
from lesson_contract import assert_names_fault, assert_passes, contract_tests

L.quiet_profiler()

PAIRS = [
    (L.check_capture_activations, L.capture_activations),
    (L.check_layer_grad_norms, L.layer_grad_norms),
    (L.check_add_gradient_reversal, L.add_gradient_reversal),
    (L.check_first_nonfinite, L.first_nonfinite),
    (L.check_memory_by_phase, L.memory_by_phase),
    (L.check_checkpoint_segments, L.checkpoint_segments),
]

(test_reference_passes, test_stub_is_not_attempted, test_bad_input_is_one_named_line, test_hostile_answers_are_the_learners_fault,
 test_checks_leave_the_learners_random_state_alone, test_checks_are_quick) = contract_tests(PAIRS)


def _guarded(run, clean, finally_: bool = True, swallow: bool = False) -> None:
    """run(), then clean(): in a finally block or after it, letting an error through or swallowing it."""
    if not finally_:
        run()
        clean()
        return
    try:
        run()
    except Exception:
        if not swallow:
            raise
    finally:
        clean()


# capture_activations

def capture_with_partial(model, x, names):
    captured, handles = {}, []

    def keep(module, args, output, name):
        captured[name] = output.detach()

    try:
        for name in names:
            handles.append(model.get_submodule(name).register_forward_hook(functools.partial(keep, name=name)))
        model(x)
    finally:
        for h in handles:
            h.remove()
    return captured


def capture_with_exit_stack(model, x, names):
    modules, captured = dict(model.named_modules()), {}
    with contextlib.ExitStack() as stack:
        for name in names:
            handle = modules[name].register_forward_hook(lambda m, a, o, name=name: captured.update({name: o.detach().clone()}))
            stack.callback(handle.remove)
        model(x)
    return captured


def capture_under_no_grad(model, x, names):
    with torch.no_grad():
        return L.capture_activations(model, x, names)


def _capture(model, x, names, store=lambda args, output: output.detach(), remove=True, finally_=True, swallow=False, no_grad=False):
    """Variants of the reference, one fault each."""
    modules, captured, handles = dict(model.named_modules()), {}, []

    def run():
        for name in names:
            handles.append(modules[name].register_forward_hook(lambda m, a, o, name=name: captured.__setitem__(name, store(a, o))))
        with torch.no_grad() if no_grad else contextlib.nullcontext():
            model(x)

    def clean():
        if remove:
            for h in handles:
                h.remove()

    _guarded(run, clean, finally_, swallow)
    return captured


def capture_without_remove(model, x, names):
    return _capture(model, x, names, remove=False)


def capture_without_finally(model, x, names):
    return _capture(model, x, names, finally_=False)


def capture_swallowing_errors(model, x, names):
    return _capture(model, x, names, swallow=True)


def capture_without_detach(model, x, names):
    return _capture(model, x, names, store=lambda args, output: output)


def capture_late_binding(model, x, names):
    modules, captured, handles = dict(model.named_modules()), {}, []
    try:
        for name in names:
            def hook(m, a, o):
                captured[name] = o.detach()  # `name` is read when the hook runs: always the last one
            handles.append(modules[name].register_forward_hook(hook))
        model(x)
    finally:
        for h in handles:
            h.remove()
    return captured


def capture_inputs(model, x, names):
    return _capture(model, x, names, store=lambda args, output: args[0].detach())


def capture_input_tuples(model, x, names):
    return _capture(model, x, names, store=lambda args, output: args, no_grad=True)


def capture_by_index(model, x, names):
    result = L.capture_activations(model, x, names)
    return {i: v for i, v in enumerate(result.values())}


def capture_with_pre_hooks_left(model, x, names):
    result = L.capture_activations(model, x, names)
    model.register_forward_pre_hook(lambda m, a: None)
    return result


def capture_in_eval_mode(model, x, names):
    model.eval()
    return L.capture_activations(model, x, names)


def capture_with_a_global_hook_left(model, x, names):
    torch.nn.modules.module.register_module_forward_hook(lambda m, a, o: None)
    return L.capture_activations(model, x, names)


# layer_grad_norms

def lgn_backward_and_restore(model, x, y, loss_fn, names):
    modules, norms, handles = dict(model.named_modules()), {}, []
    saved = {p: p.grad for p in model.parameters()}
    try:
        for name in names:
            handles.append(modules[name].register_full_backward_hook(
                lambda m, gin, gout, name=name: norms.__setitem__(name, float(torch.linalg.vector_norm(gout[0])))))
        for p in model.parameters():
            p.grad = None
        loss_fn(model(x), y).backward()
    finally:
        for h in handles:
            h.remove()
        for p, g in saved.items():
            p.grad = g
    return norms


def lgn_pre_hooks(model, x, y, loss_fn, names):
    modules, norms, handles = dict(model.named_modules()), {}, []
    try:
        for name in names:
            handles.append(modules[name].register_full_backward_pre_hook(
                lambda m, gout, name=name: norms.__setitem__(name, gout[0].norm().item())))
        loss = loss_fn(model(x), y)
        torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])
    finally:
        for h in handles:
            h.remove()
    return norms


def lgn_tensor_hooks_on_outputs(model, x, y, loss_fn, names):
    modules, norms, handles = dict(model.named_modules()), {}, []

    def on_output(module, args, output, name):
        output.register_hook(lambda grad: norms.__setitem__(name, grad.norm().item()))

    try:
        for name in names:
            handles.append(modules[name].register_forward_hook(functools.partial(on_output, name=name)))
        loss = loss_fn(model(x), y)
    finally:
        for h in handles:
            h.remove()
    torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])
    return norms


def lgn_backward_to_a_copy_of_the_input(model, x, y, loss_fn, names):
    modules, norms, handles = dict(model.named_modules()), {}, []
    try:
        for name in names:
            handles.append(modules[name].register_full_backward_hook(
                lambda m, gin, gout, name=name: norms.__setitem__(name, gout[0].norm().item())))
        probe = x.detach().clone().requires_grad_()
        loss_fn(model(probe), y).backward(inputs=[probe])
    finally:
        for h in handles:
            h.remove()
    return norms


def _lgn(model, x, y, loss_fn, names, hook_of, backward=None, remove=True, finally_=True, swallow=False, register="register_full_backward_hook"):
    """Variants of the reference, one fault each."""
    modules, norms, handles = dict(model.named_modules()), {}, []

    def run():
        for name in names:
            handles.append(getattr(modules[name], register)(hook_of(norms, name)))
        loss = loss_fn(model(x), y)
        (backward or (lambda loss: torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])))(loss)

    def clean():
        if remove:
            for h in handles:
                h.remove()

    _guarded(run, clean, finally_, swallow)
    return norms


def output_norm(norms, name):
    return lambda m, gin, gout: norms.__setitem__(name, gout[0].norm().item())


def lgn_no_remove(model, x, y, loss_fn, names):
    return _lgn(model, x, y, loss_fn, names, output_norm, remove=False)


def lgn_not_in_finally(model, x, y, loss_fn, names):
    return _lgn(model, x, y, loss_fn, names, output_norm, finally_=False)


def lgn_swallowing_errors(model, x, y, loss_fn, names):
    return _lgn(model, x, y, loss_fn, names, output_norm, swallow=True)


def lgn_grad_input(model, x, y, loss_fn, names):
    return _lgn(model, x, y, loss_fn, names, lambda norms, name: lambda m, gin, gout: norms.__setitem__(name, gin[0].norm().item()))


def lgn_grad_input_where_there_is_one(model, x, y, loss_fn, names):
    def hook_of(norms, name):
        return lambda m, gin, gout: norms.__setitem__(name, (gin[0] if gin[0] is not None else gout[0]).norm().item())
    return _lgn(model, x, y, loss_fn, names, hook_of)


def lgn_late_binding(model, x, y, loss_fn, names):
    modules, norms, handles = dict(model.named_modules()), {}, []
    try:
        for name in names:
            def hook(m, gin, gout):
                norms[name] = gout[0].norm().item()
            handles.append(modules[name].register_full_backward_hook(hook))
        torch.autograd.grad(loss_fn(model(x), y), [p for p in model.parameters() if p.requires_grad])
    finally:
        for h in handles:
            h.remove()
    return norms


def lgn_plain_backward(model, x, y, loss_fn, names):
    return _lgn(model, x, y, loss_fn, names, output_norm, backward=lambda loss: loss.backward())


def lgn_zero_grad_then_backward(model, x, y, loss_fn, names):
    model.zero_grad()
    return lgn_plain_backward(model, x, y, loss_fn, names)


def lgn_every_parameter(model, x, y, loss_fn, names):
    return _lgn(model, x, y, loss_fn, names, output_norm, backward=lambda loss: torch.autograd.grad(loss, list(model.parameters())))


def lgn_tensors(model, x, y, loss_fn, names):
    return _lgn(model, x, y, loss_fn, names, lambda norms, name: lambda m, gin, gout: norms.__setitem__(name, gout[0].norm()))


def lgn_squared(model, x, y, loss_fn, names):
    return _lgn(model, x, y, loss_fn, names, lambda norms, name: lambda m, gin, gout: norms.__setitem__(name, gout[0].pow(2).sum().item()))


def lgn_old_hooks(model, x, y, loss_fn, names):
    return _lgn(model, x, y, loss_fn, names, output_norm, register="register_backward_hook")


def lgn_in_train_mode(model, x, y, loss_fn, names):
    model.train()
    return L.layer_grad_norms(model, x, y, loss_fn, names)


def lgn_weight_norms(model, x, y, loss_fn, names):
    L.layer_grad_norms(model, x, y, loss_fn, names)
    modules = dict(model.named_modules())
    return {n: modules[n].weight.norm().item() if hasattr(modules[n], "weight") else 0.0 for n in names}


# add_gradient_reversal

class _Reverse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, lam):
        ctx.lam = lam
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return -ctx.lam * grad, None


def gr_autograd_function(module, strength):
    return module.register_forward_pre_hook(lambda m, args: (_Reverse.apply(args[0], strength()),))


def gr_clone_returned_alone(module, strength):
    def pre(m, args):
        x = args[0]
        if torch.is_grad_enabled() and x.requires_grad:
            lam = float(strength())
            y = x.clone()
            y.register_hook(lambda g, lam=lam: g * -lam)
            return y  # a single value: PyTorch wraps it in a tuple
    return module.register_forward_pre_hook(pre)


def gr_times_one(module, strength):
    def pre(m, args):
        (x,) = args
        if x.requires_grad and torch.is_grad_enabled():
            lam = strength()
            x = x * 1
            x.register_hook(lambda g: torch.neg(g) * lam)
            return (x,)
    return module.register_forward_pre_hook(pre)


def gr_global_pre_hook_for_the_module(module, strength):
    """A correct alternative: a global forward pre-hook that acts on this module only."""
    def pre(m, args):
        (x,) = args
        if m is not module or not (torch.is_grad_enabled() and x.requires_grad):
            return None
        lam = strength()
        y = x.view_as(x)
        y.register_hook(lambda g: -lam * g)
        return (y,)
    return nn.modules.module.register_module_forward_pre_hook(pre)


def _gr(module, strength, *, scale=lambda lam: -lam, when="forward", new_node=True, give_back=True, in_place=False, guard=True):
    """Variants of the reference, one fault each."""
    fixed = strength()

    def pre(m, args):
        (x,) = args
        if guard and not (torch.is_grad_enabled() and x.requires_grad):
            return None
        lam = strength() if when == "forward" else fixed
        y = x.view_as(x) if new_node else x

        def hook(grad):
            factor = scale(strength() if when == "backward" else lam)
            if in_place:
                return grad.mul_(factor)
            return grad * factor

        y.register_hook(hook)
        return (y,) if give_back else None
    return module.register_forward_pre_hook(pre)


def gr_hook_on_the_input(module, strength):
    return _gr(module, strength, new_node=False)


def gr_at_the_output(module, strength):
    def post(m, args, out):
        if out.requires_grad:
            lam = strength()
            out.register_hook(lambda g: -lam * g)
    return module.register_forward_hook(post)


def gr_plus(module, strength):
    return _gr(module, strength, scale=lambda lam: lam)


def gr_minus_one(module, strength):
    return _gr(module, strength, scale=lambda lam: -1.0)


def gr_squared(module, strength):
    return _gr(module, strength, scale=lambda lam: -lam * lam)


def gr_read_once(module, strength):
    return _gr(module, strength, when="registration")


def gr_read_in_backward(module, strength):
    return _gr(module, strength, when="backward")


def gr_in_place(module, strength):
    return _gr(module, strength, in_place=True)


def gr_unguarded(module, strength):
    return _gr(module, strength, guard=False)


def gr_guard_on_requires_grad_only(module, strength):  # under no_grad, x * 1 needs no grad, and register_hook raises
    def pre(m, args):
        (x,) = args
        if x.requires_grad:
            lam = strength()
            y = x * 1
            y.register_hook(lambda g: -lam * g)
            return (y,)
    return module.register_forward_pre_hook(pre)


def gr_new_tensor_not_returned(module, strength):
    return _gr(module, strength, give_back=False)


def gr_no_handle(module, strength):
    L.add_gradient_reversal(module, strength)


def gr_two_hooks(module, strength):
    L.add_gradient_reversal(module, strength)
    return module.register_forward_pre_hook(lambda m, a: None)


def gr_full_backward_hook(module, strength):
    return module.register_full_backward_hook(lambda m, gin, gout: tuple(None if g is None else -strength() * g for g in gin))


def gr_last_strength_for_all(module, strength):
    seen = {}
    module.register_forward_pre_hook(lambda m, a: seen.update(lam=strength()))
    return module.register_full_backward_hook(lambda m, gin, gout: tuple(None if g is None else -seen["lam"] * g for g in gin))


def gr_negated_value(module, strength):
    return module.register_forward_pre_hook(lambda m, args: (-strength() * args[0],))


def gr_hook_returns_a_sum(module, strength):
    def pre(m, args):
        y = args[0].view_as(args[0])
        y.register_hook(lambda g: g.sum())  # a gradient of the wrong shape: backward raises
        return (y,)
    return module.register_forward_pre_hook(pre)


def gr_freezes_the_module(module, strength):
    module.requires_grad_(False)
    return L.add_gradient_reversal(module, strength)


# first_nonfinite

def _nonfinite(value) -> bool:
    return any(not torch.isfinite(t).all() for t in L.tensors_in(value))


def fn_record_all_then_first(model, x):
    flagged, handles = [], []
    try:
        for name, module in model.named_modules():
            handles.append(module.register_forward_hook(lambda m, a, o, name=name: flagged.append(name) if _nonfinite(o) else None))
        with torch.no_grad():
            model(x)
    finally:
        for h in handles:
            h.remove()
    return flagged[0] if flagged else None


class _Found(Exception):
    pass


def fn_stop_at_the_first(model, x):
    handles = []

    def hook(module, args, output, name):
        if _nonfinite(output):
            raise _Found(name)

    try:
        for name, module in model.named_modules():
            handles.append(module.register_forward_hook(functools.partial(hook, name=name)))
        model(x)
    except _Found as found:
        return found.args[0]
    finally:
        for h in handles:
            h.remove()
    return None


def fn_one_global_hook(model, x):
    names = {module: name for name, module in model.named_modules()}
    found = []

    def hook(module, args, output):
        if module in names and not found and _nonfinite(output):
            found.append(names[module])

    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    try:
        with torch.inference_mode():
            model(x)
    finally:
        handle.remove()
    return found[0] if found else None


def _fn(model, x, test=_nonfinite, modules=None, pick=lambda flagged, model: flagged[0], remove=True, finally_=True, name_of=None):
    """Variants of the reference, one fault each."""
    flagged, handles = [], []

    def run():
        for name, module in (modules(model) if modules else model.named_modules()):
            handles.append(module.register_forward_hook(
                lambda m, a, o, name=name: flagged.append(name_of(m, name) if name_of else name) if test(o) else None))
        with torch.no_grad():
            model(x)

    def clean():
        if remove:
            for h in handles:
                h.remove()

    _guarded(run, clean, finally_)
    return pick(flagged, model) if flagged else None


def fn_isnan_only(model, x):
    return _fn(model, x, test=lambda o: any(t.isnan().any() for t in L.tensors_in(o)))


def fn_leaves_only(model, x):
    return _fn(model, x, modules=lambda m: [(n, c) for n, c in m.named_modules() if not list(c.children())])


def fn_children_only(model, x):
    return _fn(model, x, modules=lambda m: m.named_children())


def fn_named_modules_order(model, x):
    order = [n for n, _ in model.named_modules()]
    return _fn(model, x, pick=lambda flagged, model: min(flagged, key=order.index))


def fn_last(model, x):
    return _fn(model, x, pick=lambda flagged, model: flagged[-1])


def fn_tensor_outputs_only(model, x):
    return _fn(model, x, test=lambda o: not o.isfinite().all())


def fn_first_element_of_tuples(model, x):
    return _fn(model, x, test=lambda o: not (o[0] if isinstance(o, tuple) else o).isfinite().all())


def fn_no_remove(model, x):
    return _fn(model, x, remove=False)


def fn_not_in_finally(model, x):
    return _fn(model, x, finally_=False)


def fn_returns_the_module(model, x):
    return _fn(model, x, name_of=lambda m, name: m)


def fn_empty_string_for_none(model, x):
    return L.first_nonfinite(model, x) or ""


def fn_final_output_only(model, x):
    with torch.no_grad():
        return "" if _nonfinite(model(x)) else None


# memory_by_phase

def mem_separate_profiles(phases):
    result = {}
    for name, phase in phases.items():
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            phase()
        result[name] = sum(event.self_cpu_memory_usage for event in prof.key_averages())
    return result


def mem_from_events(phases):
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for name, phase in phases.items():
            with record_function(name):
                phase()
    events = prof.events()
    return {name: next(e for e in events if e.name == name).cpu_memory_usage for name in phases}


def mem_start_and_stop(phases):
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    prof.start()
    try:
        for name, phase in phases.items():
            with record_function(name):
                phase()
    finally:
        prof.stop()
    rows = prof.key_averages()
    return {name: int(sum(r.cpu_memory_usage for r in rows if r.key == name)) for name in phases}


def _mem(phases, memory=True, read=lambda e: e.cpu_memory_usage, order=lambda phases: list(phases.items()), repeat=1, convert=lambda v: v):
    """Variants of the reference, one fault each."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=memory) as prof:
        for _ in range(repeat):
            for name, phase in order(phases):
                with record_function(name):
                    phase()
    events = {e.key: e for e in prof.key_averages()}
    return {name: convert(read(events[name])) for name in phases}


def mem_without_profile_memory(phases):
    return _mem(phases, memory=False)


def mem_self(phases):
    return _mem(phases, read=lambda e: e.self_cpu_memory_usage)


def mem_nested_regions(phases):
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with contextlib.ExitStack() as stack:
            for name, phase in phases.items():
                stack.enter_context(record_function(name))
                phase()
    events = {e.key: e for e in prof.key_averages()}
    return {name: events[name].cpu_memory_usage for name in phases}


def mem_sorted(phases):
    return _mem(phases, order=lambda phases: sorted(phases.items()))


def mem_warm_up_first(phases):
    return _mem(phases, repeat=2)


def mem_in_mib(phases):
    return _mem(phases, convert=lambda v: v / 2**20)


def mem_left_running(phases):
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    prof.start()
    for name, phase in phases.items():
        with record_function(name):
            phase()
    return {name: 0 for name in phases}


def mem_events_themselves(phases):
    return _mem(phases, read=lambda e: e)


def mem_every_row(phases):
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for name, phase in phases.items():
            with record_function(name):
                phase()
    return {e.key: e.cpu_memory_usage for e in prof.key_averages()}


def mem_rss(phases):
    process, result = psutil.Process(), {}
    for name, phase in phases.items():
        before = process.memory_info().rss
        phase()
        result[name] = process.memory_info().rss - before
    return result


def mem_operators_only(phases):
    result = {}
    for name, phase in phases.items():
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            phase()
        result[name] = sum(e.self_cpu_memory_usage for e in prof.key_averages() if e.key.startswith("aten::"))
    return result


def mem_floats(phases):
    return _mem(phases, convert=float)


# checkpoint_segments

def cs_closure_with_bound_blocks(blocks, x, size):
    for start in range(0, len(blocks), size):
        def run(h, group=blocks[start:start + size]):
            for block in group:
                h = block(h)
            return h
        x = checkpoint(run, x, use_reentrant=False)
    return x


def _run_group(group, h):
    for block in group:
        h = block(h)
    return h


def cs_partial(blocks, x, size):
    groups = [list(blocks)[i:i + size] for i in range(0, len(blocks), size)]
    for group in groups:
        x = checkpoint(functools.partial(_run_group, group), x, use_reentrant=False)
    return x


def cs_grouped_by_index(blocks, x, size):
    groups = {}
    for i, block in enumerate(blocks):
        groups.setdefault(i // size, []).append(block)
    h = x
    for _, group in sorted(groups.items()):
        h = checkpoint(nn.Sequential(*group), h, use_reentrant=False)
    return h


def cs_plain(blocks, x, size):
    for block in blocks:
        x = block(x)
    return x


def cs_each_block(blocks, x, size):
    for block in blocks:
        x = checkpoint(block, x, use_reentrant=False)
    return x


def cs_full_segments_only(blocks, x, size):
    n_full = len(blocks) // size * size
    for start in range(0, n_full, size):
        x = checkpoint(nn.Sequential(*blocks[start:start + size]), x, use_reentrant=False)
    for block in blocks[n_full:]:
        x = block(x)
    return x


def cs_checkpoint_sequential(blocks, x, size):
    return checkpoint_sequential(nn.Sequential(*blocks), math.ceil(len(blocks) / size), x, use_reentrant=False)


def cs_reentrant(blocks, x, size):
    for start in range(0, len(blocks), size):
        x = checkpoint(nn.Sequential(*blocks[start:start + size]), x, use_reentrant=True)
    return x


def cs_default_variant(blocks, x, size):
    for start in range(0, len(blocks), size):
        x = checkpoint(nn.Sequential(*blocks[start:start + size]), x)
    return x


def cs_late_binding(blocks, x, size):
    for start in range(0, len(blocks), size):
        def run(h):
            for block in blocks[start:start + size]:  # `start` is read in backward too: by then, the last one
                h = block(h)
            return h
        x = checkpoint(run, x, use_reentrant=False)
    return x


def cs_without_rng_replay(blocks, x, size):
    for start in range(0, len(blocks), size):
        x = checkpoint(nn.Sequential(*blocks[start:start + size]), x, use_reentrant=False, preserve_rng_state=False)
    return x


def cs_starting_at_one(blocks, x, size):
    x = blocks[0](x)
    for start in range(1, len(blocks), size):
        x = checkpoint(nn.Sequential(*blocks[start:start + size]), x, use_reentrant=False)
    return x


def cs_under_no_grad(blocks, x, size):
    with torch.no_grad():
        return L.checkpoint_segments(blocks, x, size)


def cs_reentrant_with_grad_input(blocks, x, size):
    x.requires_grad_()
    return cs_reentrant(blocks, x, size)


def cs_segments_one_too_long(blocks, x, size):
    return L.checkpoint_segments(blocks, x, size + 1)


# More wrong answers, from a set written against the learner copy alone before the checks were read (the general ones)

def capture_once_per_layer(model, x, names):
    captured = {}
    for name in names:
        captured.update(L.capture_activations(model, x, [name]))
    return captured


def capture_with_forward_method(model, x, names):
    modules, captured, handles = dict(model.named_modules()), {}, []
    try:
        for name in names:
            handles.append(modules[name].register_forward_hook(lambda m, a, o, name=name: captured.__setitem__(name, o.detach())))
        model.forward(x)
    finally:
        for h in handles:
            h.remove()
    return captured


def capture_switching_on_grad(model, x, names):
    x.requires_grad_(True)
    return L.capture_activations(model, x, names)


def capture_top_level_names_only(model, x, names):
    children = dict(model.named_children())
    return L.capture_activations(model, x, [n for n in names if n in children])


def lgn_mean_abs(model, x, y, loss_fn, names):
    return _lgn(model, x, y, loss_fn, names, lambda norms, name: lambda m, gin, gout: norms.__setitem__(name, gout[0].abs().mean().item()))


def lgn_per_sample(model, x, y, loss_fn, names):
    return _lgn(model, x, y, loss_fn, names,
                lambda norms, name: lambda m, gin, gout: norms.__setitem__(name, gout[0].flatten(1).norm(dim=1).mean().item()))


def lgn_max_norm(model, x, y, loss_fn, names):
    return _lgn(model, x, y, loss_fn, names, lambda norms, name: lambda m, gin, gout: norms.__setitem__(name, gout[0].abs().max().item()))


def lgn_unfreezing(model, x, y, loss_fn, names):
    model.requires_grad_(True)
    return L.layer_grad_norms(model, x, y, loss_fn, names)


def lgn_two_forward_passes(model, x, y, loss_fn, names):
    with torch.no_grad():
        model(x)  # "a look at the output first"
    return L.layer_grad_norms(model, x, y, loss_fn, names)


def lgn_input_requires_grad(model, x, y, loss_fn, names):
    x.requires_grad_(True)
    return L.layer_grad_norms(model, x, y, loss_fn, names)


def lgn_old_hooks_quietly(model, x, y, loss_fn, names):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return lgn_old_hooks(model, x, y, loss_fn, names)


def fn_inputs_not_outputs(model, x):
    flagged, handles = [], []
    try:
        for name, module in model.named_modules():
            handles.append(module.register_forward_pre_hook(lambda m, a, name=name: flagged.append(name) if _nonfinite(a) else None))
        with torch.no_grad():
            model(x)
    finally:
        for h in handles:
            h.remove()
    return flagged[0] if flagged else None


def fn_everywhere_only(model, x):
    return _fn(model, x, test=lambda o: any(not t.isfinite().any() for t in L.tensors_in(o)))


def fn_two_passes(model, x):
    with torch.no_grad():
        model(x)
    return L.first_nonfinite(model, x)


def fn_in_eval_mode(model, x):
    model.eval()
    return L.first_nonfinite(model, x)


def mem_running_total(phases):
    return dict(zip(phases, itertools.accumulate(L.memory_by_phase(phases).values())))


def _mem_trace(phases, of_changes):
    result = {}
    for name, phase in phases.items():
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            phase()
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "trace.json"
            prof.export_chrome_trace(str(path))
            events = json.loads(path.read_text())["traceEvents"]
        changes = [e["args"]["Bytes"] for e in sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"])]
        result[name] = int(of_changes(changes))
    return result


def mem_peak(phases):
    return _mem_trace(phases, lambda changes: max(itertools.accumulate(changes), default=0))


def mem_allocations_only(phases):
    return _mem_trace(phases, lambda changes: sum(c for c in changes if c > 0))


def mem_clipped(phases):
    return {name: max(0, v) for name, v in L.memory_by_phase(phases).items()}


def mem_kib(phases):
    return {name: v // 1024 for name, v in L.memory_by_phase(phases).items()}


def mem_tracemalloc(phases):
    result = {}
    for name, phase in phases.items():
        tracemalloc.start()
        phase()
        result[name] = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
    return result


def mem_changes_the_dict(phases):
    result = L.memory_by_phase(phases)
    phases.clear()
    return result


def cs_default_variant_quietly(blocks, x, size):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cs_default_variant(blocks, x, size)


def cs_detached_between_segments(blocks, x, size):
    for start in range(0, len(blocks), size):
        x = checkpoint(nn.Sequential(*blocks[start:start + size]), x.detach(), use_reentrant=False)
    return x


def cs_size_as_count(blocks, x, size):
    return L.checkpoint_segments(blocks, x, math.ceil(len(blocks) / size))


def cs_skipping_a_block(blocks, x, size):
    for start in range(0, len(blocks), size):
        x = checkpoint(nn.Sequential(*blocks[start:start + size - 1] if size > 1 else blocks[start:start + 1]), x, use_reentrant=False)
    return x


def cs_dropping_the_last_segment(blocks, x, size):
    for start in range(0, len(blocks) - len(blocks) % size, size):
        x = checkpoint(nn.Sequential(*blocks[start:start + size]), x, use_reentrant=False)
    return x


def cs_reversed(blocks, x, size):
    return L.checkpoint_segments(nn.ModuleList(list(blocks)[::-1]), x, size)


def cs_in_eval_mode(blocks, x, size):
    blocks.eval()
    return L.checkpoint_segments(blocks, x, size)


RIGHT = [
    (L.check_capture_activations, capture_with_partial),
    (L.check_capture_activations, capture_with_exit_stack),
    (L.check_capture_activations, capture_under_no_grad),
    (L.check_layer_grad_norms, lgn_backward_and_restore),
    (L.check_layer_grad_norms, lgn_pre_hooks),
    (L.check_layer_grad_norms, lgn_backward_to_a_copy_of_the_input),
    (L.check_add_gradient_reversal, gr_autograd_function),
    (L.check_add_gradient_reversal, gr_clone_returned_alone),
    (L.check_add_gradient_reversal, gr_times_one),
    (L.check_add_gradient_reversal, gr_global_pre_hook_for_the_module),
    (L.check_first_nonfinite, fn_record_all_then_first),
    (L.check_first_nonfinite, fn_stop_at_the_first),
    (L.check_first_nonfinite, fn_one_global_hook),
    (L.check_memory_by_phase, mem_separate_profiles),
    (L.check_memory_by_phase, mem_from_events),
    (L.check_memory_by_phase, mem_start_and_stop),
    (L.check_checkpoint_segments, cs_closure_with_bound_blocks),
    (L.check_checkpoint_segments, cs_partial),
    (L.check_checkpoint_segments, cs_grouped_by_index),
]


@pytest.mark.parametrize("check, answer", RIGHT, ids=[f"{c.exercise_name}-{a.__name__}" for c, a in RIGHT])
def test_correct_alternatives_pass(check, answer):
    assert_passes(check, answer)


WRONG = [
    (L.check_capture_activations, capture_without_remove, r"left hooks on \['stem', 'block.1', 'head'\].*handle.remove\(\)"),
    (L.check_capture_activations, capture_without_finally, r"a model whose forward raises.*let the model's ModelError through and left hooks on \['stem', 'block', 'head'\].*finally"),
    (L.check_capture_activations, capture_swallowing_errors, "returned although the model's forward pass raised ModelError"),
    (L.check_capture_activations, capture_with_pre_hooks_left, r"left hooks on \['the model itself'\]"),
    (L.check_capture_activations, capture_with_a_global_hook_left, r"left hooks on \['all modules \(a global hook\)'\]"),
    (L.check_capture_activations, capture_without_detach, r"still requires grad.*output.detach\(\)"),
    (L.check_capture_activations, capture_late_binding, "only the key 'head'.*name=name"),
    (L.check_capture_activations, capture_inputs, "is the module's input.*store output"),
    (L.check_capture_activations, capture_input_tuples, "is a tuple that holds the module's input.*store output"),
    (L.check_capture_activations, capture_by_index, r"returned the keys \[0, 1, 2\]"),
    (L.check_capture_activations, capture_in_eval_mode, "left the model in eval mode; it was in training mode"),
    (L.check_capture_activations, lambda m, x, n: list(L.capture_activations(m, x, n).values()), "returned a list, expected a dict"),
    (L.check_capture_activations, lambda m, x, n: None, r"never ran the model: call model\(x\) once"),
    (L.check_layer_grad_norms, lgn_no_remove, r"left hooks on \['stem', 'body', 'body.1', 'head'\]"),
    (L.check_layer_grad_norms, lgn_not_in_finally, r"let the model's ModelError through and left hooks on \['stem', 'body'\]"),
    (L.check_layer_grad_norms, lgn_swallowing_errors, "returned although the model's forward pass raised ModelError.*no except"),
    (L.check_layer_grad_norms, lgn_grad_input, r"raised AttributeError: 'NoneType' object has no attribute 'norm' \(something your code used is None; grad_input holds None"),
    (L.check_layer_grad_norms, lgn_grad_input_where_there_is_one, r"\['body.1'\] is .*at the layer's input \(grad_input\).*grad_output"),
    (L.check_layer_grad_norms, lgn_late_binding, "only the key 'head'.*name=name"),
    (L.check_layer_grad_norms, lgn_plain_backward, r"changed stem.weight.grad, which held None: a probe leaves .grad as it was.*torch.autograd.grad"),
    (L.check_layer_grad_norms, lgn_zero_grad_then_backward, r"changed stem.weight.grad, which held None"),
    (L.check_layer_grad_norms, lgn_every_parameter, r"raised RuntimeError: One of the differentiated Tensors does not require grad \(some parameters are frozen"),
    (L.check_layer_grad_norms, lgn_tensors, r"is a tensor, expected a Python float.*\.item\(\)"),
    (L.check_layer_grad_norms, lgn_squared, r"\['stem'\] is 0.00166121, the squared norm .*take its square root"),
    (L.check_layer_grad_norms, lgn_old_hooks, "used register_backward_hook.*register_full_backward_hook"),
    (L.check_layer_grad_norms, lgn_in_train_mode, "left the model in training mode; it was in eval mode"),
    (L.check_layer_grad_norms, lgn_weight_norms, r"\['stem'\] is .*the norm of the layer's weight itself"),
    (L.check_layer_grad_norms, lambda m, x, y, f, n: None, r"never ran the model: call model\(x\) once"),
    (L.check_add_gradient_reversal, gr_hook_on_the_input, "the label head.*got the reversed gradient too.*summed over every use.*view_as"),
    (L.check_add_gradient_reversal, gr_at_the_output, "the module's own parameters learned from the reversed gradient.*forward pre-hook"),
    (L.check_add_gradient_reversal, gr_plus, r"multiplied by \+strength\(\), not -strength\(\)"),
    (L.check_add_gradient_reversal, gr_minus_one, r"multiplied by -1 whatever strength\(\) returned"),
    (L.check_add_gradient_reversal, gr_squared, r"-strength\(\) squared"),
    (L.check_add_gradient_reversal, gr_read_once, r"the strength at the time add_gradient_reversal was called \(0.05\)"),
    (L.check_add_gradient_reversal, gr_read_in_backward, r"the strength at the time backward ran \(1.7\)"),
    (L.check_add_gradient_reversal, gr_full_backward_hook, r"the strength at the time backward ran \(1.7\)"),
    (L.check_add_gradient_reversal, gr_last_strength_for_all, r"the strength of the last forward call \(0.8\)"),
    (L.check_add_gradient_reversal, gr_in_place, "modified the gradient tensor it received in place"),
    (L.check_add_gradient_reversal, gr_unguarded, r"domain\(features, on features that need no gradient\) raised RuntimeError: cannot register a hook.*nothing to reverse"),
    (L.check_add_gradient_reversal, gr_guard_on_requires_grad_only, r"domain\(features, under torch.no_grad\(\)\) raised RuntimeError: cannot register a hook"),
    (L.check_add_gradient_reversal, gr_new_tensor_not_returned, "came back unchanged: nothing was reversed"),
    (L.check_add_gradient_reversal, gr_no_handle, "returned None: return the handle"),
    (L.check_add_gradient_reversal, gr_two_hooks, r"after handle.remove\(\), hooks are still on the module"),
    (L.check_add_gradient_reversal, gr_negated_value, "output with the reversal on .the forward pass must not change.: wrong values"),
    (L.check_add_gradient_reversal, gr_freezes_the_module, "switched requires_grad off for offset, which was trainable"),
    (L.check_add_gradient_reversal, lambda module, strength: (lambda *a: None), "returned a function: return the handle"),
    (L.check_first_nonfinite, fn_isnan_only, "returned 'norm', expected 'block.1': it tests for NaN only and misses inf: test with torch.isfinite"),
    (L.check_first_nonfinite, fn_leaves_only, "returned None, expected '' .the model itself.: it skips the modules that have children: hook every module"),
    (L.check_first_nonfinite, fn_children_only, "returned 'block', but its sub-module 'block.1' produced the non-finite value first"),
    (L.check_first_nonfinite, fn_named_modules_order, r"returned 'head', the first non-finite output in named_modules\(\) order; 'block.1'"),
    (L.check_first_nonfinite, fn_last, "returned 'out', the last module with a non-finite output; expected the first, 'block.1'"),
    (L.check_first_nonfinite, fn_tensor_outputs_only, r"raised AttributeError: 'tuple' object has no attribute 'isfinite' \(a module's output can be a tuple"),
    (L.check_first_nonfinite, fn_first_element_of_tuples, "returned None, expected 'split': it misses non-finite values inside a tuple output"),
    (L.check_first_nonfinite, fn_no_remove, r"left hooks on \['the model itself', 'head', 'norm', 'block', 'block.0', 'block.1', 'embed', 'out'\]"),
    (L.check_first_nonfinite, fn_not_in_finally, "let the model's ModelError through and left hooks"),
    (L.check_first_nonfinite, fn_returns_the_module, r"returned the module itself \(_Exp\): return its name"),
    (L.check_first_nonfinite, fn_empty_string_for_none, "finite outputs everywhere.*returned '', expected None"),
    (L.check_first_nonfinite, fn_final_output_only, "exp overflows.*returned None, expected 'block.1'"),
    (L.check_memory_by_phase, mem_without_profile_memory, r"returned 0 for every phase: the profiler ran without profile_memory=True"),
    (L.check_memory_by_phase, mem_self, r"\*self\* memory.*cpu_memory_usage"),
    (L.check_memory_by_phase, mem_nested_regions, "includes the phases after it: close each phase's region"),
    (L.check_memory_by_phase, mem_sorted, r"ran the phases in the order \['allocate', 'concatenate', 'float64', 'free', 'temporary', 'view'\], expected the dict's order"),
    (L.check_memory_by_phase, mem_warm_up_first, "ran the phase 'allocate' 2 times; run each phase exactly once"),
    (L.check_memory_by_phase, mem_in_mib, "returned MiB: return the bytes themselves"),
    (L.check_memory_by_phase, mem_left_running, "left the profiler running"),
    (L.check_memory_by_phase, mem_events_themselves, r"\['allocate'\] is a torch.autograd.profiler_util.FunctionEventAvg, expected a Python int"),
    (L.check_memory_by_phase, mem_every_row, r"returned \d+ keys, \['aten::.*among them; expected only the phases' names"),
    (L.check_memory_by_phase, mem_rss, r"ran the phases with no profiler running: measure them with torch.profiler.profile"),
    (L.check_memory_by_phase, mem_operators_only, r"the operators' own allocations only: a free that happens outside every operator.*'\[memory\]'"),
    (L.check_memory_by_phase, mem_floats, "returned floats, expected Python ints"),
    (L.check_memory_by_phase, lambda phases: [phase() for phase in phases.values()] and None, "ran the phases with no profiler running"),
    (L.check_checkpoint_segments, cs_plain, r"no block was recomputed in backward, so none ran inside a checkpoint.*use_reentrant=False"),
    (L.check_checkpoint_segments, cs_each_block, r"7 blocks.*checkpointed every block on its own.*segments of 3 blocks"),
    (L.check_checkpoint_segments, cs_full_segments_only, "block 6 ran outside every checkpoint; every block must be inside one$"),
    (L.check_checkpoint_segments, cs_checkpoint_sequential, r"blocks \[4, 5, 6\] ran outside every checkpoint.*checkpoint_sequential leaves its last segment out"),
    (L.check_checkpoint_segments, cs_reentrant, "used the reentrant checkpoint.*pass use_reentrant=False"),
    (L.check_checkpoint_segments, cs_default_variant, "used the reentrant checkpoint .use_reentrant=True, or not passed.*pass use_reentrant=False"),
    (L.check_checkpoint_segments, cs_late_binding, "the recomputation ran other blocks than the forward pass did.*loop variable"),
    (L.check_checkpoint_segments, cs_without_rng_replay, "5 blocks with dropout.*other dropout masks.*preserve_rng_state=True"),
    (L.check_checkpoint_segments, cs_starting_at_one, "block 0 ran outside every checkpoint; every block must be inside one$"),
    (L.check_checkpoint_segments, cs_under_no_grad, "ran the blocks with gradient recording off"),
    (L.check_checkpoint_segments, cs_reentrant_with_grad_input, "switched on requires_grad on the caller's batch"),
    (L.check_checkpoint_segments, cs_segments_one_too_long, r"checkpointed the blocks in the segments \[\[0, 1, 2, 3\], \[4, 5, 6\]\]; segments of 3 blocks are \[\[0, 1, 2\], \[3, 4, 5\], \[6\]\]"),
    (L.check_checkpoint_segments, lambda blocks, x, size: None, "returned None"),
    # the set written against the learner copy alone
    (L.check_capture_activations, capture_once_per_layer, r"ran the model 3 times; run model\(x\) once"),
    (L.check_capture_activations, capture_with_forward_method, r"called model.forward\(x\), which skips the model's own hooks"),
    (L.check_capture_activations, capture_switching_on_grad, "switched on requires_grad on the caller's x"),
    (L.check_capture_activations, capture_top_level_names_only, r"no entry for the nested name \['block.1'\].*named_modules"),
    (L.check_layer_grad_norms, lgn_tensor_hooks_on_outputs, r"no full backward hook on \['stem', 'body.1', 'body', 'head'\].*register_full_backward_hook"),
    (L.check_layer_grad_norms, lgn_old_hooks_quietly, "used register_backward_hook.*register_full_backward_hook"),
    (L.check_layer_grad_norms, lgn_mean_abs, r"the mean of \|grad\|, not the L2 norm"),
    (L.check_layer_grad_norms, lgn_per_sample, "the mean of the per-sample norms, not the norm of the whole gradient"),
    (L.check_layer_grad_norms, lgn_max_norm, r"the largest \|grad\| \(the max norm\)"),
    (L.check_layer_grad_norms, lgn_unfreezing, "switched requires_grad on for body.0.weight, which was frozen"),
    (L.check_layer_grad_norms, lgn_two_forward_passes, "ran the model 2 times"),
    (L.check_layer_grad_norms, lgn_input_requires_grad, "switched on requires_grad on the caller's x"),
    (L.check_first_nonfinite, fn_inputs_not_outputs, "it names the module after the culprit, whose input holds the non-finite value"),
    (L.check_first_nonfinite, fn_everywhere_only, "it flags an output only when every element is non-finite"),
    (L.check_first_nonfinite, fn_two_passes, "ran the model 2 times"),
    (L.check_first_nonfinite, fn_in_eval_mode, "left the model in eval mode"),
    (L.check_memory_by_phase, mem_running_total, "returned a running total: each number includes the phases before it"),
    (L.check_memory_by_phase, mem_peak, r"returned each phase's peak \(the most it held at once\) instead of what it left allocated"),
    (L.check_memory_by_phase, mem_allocations_only, "returned only the allocations: a free counts too, as negative bytes"),
    (L.check_memory_by_phase, mem_clipped, "returned negative numbers clipped to 0"),
    (L.check_memory_by_phase, mem_kib, "returned KiB: return the bytes themselves"),
    (L.check_memory_by_phase, mem_tracemalloc, "ran the phases with no profiler running"),
    (L.check_memory_by_phase, mem_changes_the_dict, "changed the caller's dict of phases"),
    (L.check_checkpoint_segments, cs_default_variant_quietly, "used the reentrant checkpoint .use_reentrant=True, or not passed"),
    (L.check_checkpoint_segments, cs_detached_between_segments, "the input of block 6 did not require grad, though block 5's output did: the graph is cut"),
    (L.check_checkpoint_segments, cs_size_as_count, r"5 blocks with dropout.*checkpointed the blocks in the segments \[\[0, 1, 2\], \[3, 4\]\]; segments of 2 blocks"),
    (L.check_checkpoint_segments, cs_skipping_a_block, r"raised RuntimeError: mat1 and mat2 shapes cannot be multiplied.*: it never ran block 2 \(the order was \[0, 1, 3\]\)"),
    (L.check_checkpoint_segments, cs_dropping_the_last_segment, r"never ran block 6 \(the order was \[0, 1, 2, 3, 4, 5\]\)"),
    (L.check_checkpoint_segments, cs_reversed, r"raised RuntimeError.*: it ran block 6 first"),
    (L.check_checkpoint_segments, cs_in_eval_mode, "left the model in eval mode"),
]


@pytest.mark.parametrize("check, wrong, message", WRONG, ids=[f"{c.exercise_name}-{getattr(w, '__name__', 'lambda')}-{i}" for i, (c, w, m) in enumerate(WRONG)])
def test_wrong_answers_name_the_fault(check, wrong, message):
    assert_names_fault(check, wrong, message)


# A second set, written after the checks were revised, of kinds the first set and the tests above lacked (the general ones)

def capture_in_eval_then_train(model, x, names):
    model.eval()
    try:
        return L.capture_activations(model, x, names)
    finally:
        model.train()


def capture_clearing_every_hook(model, x, names):
    modules, captured = dict(model.named_modules()), {}
    for name in names:
        modules[name].register_forward_hook(lambda m, a, o, name=name: captured.__setitem__(name, o.detach()))
    try:
        model(x)
    finally:
        for m in model.modules():
            m._forward_hooks.clear()
    return captured


def capture_through_modules_dict(model, x, names):
    captured, handles = {}, []
    try:
        for name in names:
            handles.append(model._modules[name].register_forward_hook(lambda m, a, o, name=name: captured.__setitem__(name, o.detach())))
        model(x)
    finally:
        for h in handles:
            h.remove()
    return captured


def lgn_sum_of_sample_norms(model, x, y, loss_fn, names):
    return _lgn(model, x, y, loss_fn, names,
                lambda norms, name: lambda m, gin, gout: norms.__setitem__(name, gout[0].flatten(1).norm(dim=1).sum().item()))


def lgn_forward_under_no_grad(model, x, y, loss_fn, names):
    def backward(loss):
        torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])
    modules, norms, handles = dict(model.named_modules()), {}, []
    try:
        for name in names:
            handles.append(modules[name].register_full_backward_hook(output_norm(norms, name)))
        with torch.no_grad():
            loss = loss_fn(model(x), y)
        backward(loss)
    finally:
        for h in handles:
            h.remove()
    return norms


def fn_class_name(model, x):
    name = L.first_nonfinite(model, x)
    return None if name is None else type(dict(model.named_modules())[name]).__name__


def fn_with_a_prefix(model, x):
    name = L.first_nonfinite(model, x)
    return None if name is None else f"model.{name}" if name else "model"


def fn_clearing_every_hook(model, x):
    found = []
    for name, m in model.named_modules():
        m.register_forward_hook(lambda mod, a, o, name=name: found.append(name) if _nonfinite(o) else None)
    try:
        with torch.no_grad():
            model(x)
    finally:
        for m in model.modules():
            m._forward_hooks.clear()
    return found[0] if found else None


def fn_first_leaf(model, x):
    leaves = {n for n, m in model.named_modules() if next(m.children(), None) is None}
    flagged = []
    _fn(model, x, pick=lambda found, model: flagged.extend(found))
    return next((n for n in flagged if n in leaves), flagged[0] if flagged else None)


def mem_no_regions(phases):
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for phase in phases.values():
            phase()
    total = int(sum(e.self_cpu_memory_usage for e in prof.key_averages()))
    return {name: total for name in phases}


def mem_call_counts(phases):
    return _mem(phases, read=lambda e: e.count)


def cs_sequential_of_the_slice(blocks, x, size):
    for start in range(0, len(blocks), size):
        x = checkpoint(nn.Sequential(blocks[start:start + size]), x, use_reentrant=False)
    return x


def cs_reentrant_on_a_copy_that_requires_grad(blocks, x, size):
    return cs_reentrant(blocks, x.clone().requires_grad_(), size)


def cs_nested(blocks, x, size):
    def run(h, start):
        for block in blocks[start:start + size]:
            h = checkpoint(block, h, use_reentrant=False)
        return h
    for start in range(0, len(blocks), size):
        x = checkpoint(run, x, start, use_reentrant=False)
    return x


def gr_cut(module, strength):
    return module.register_forward_pre_hook(lambda m, args: (args[0].detach(),))


def gr_first_strength_cached(module, strength):
    cache = {}

    def pre(m, args):
        (x,) = args
        if torch.is_grad_enabled() and x.requires_grad:
            lam = cache.setdefault("lam", strength())
            y = x.view_as(x)
            y.register_hook(lambda g: -lam * g)
            return (y,)
    return module.register_forward_pre_hook(pre)


SECOND_SET = [
    (L.check_capture_activations, capture_in_eval_then_train, "left the model in training mode; it was in eval mode"),
    (L.check_capture_activations, capture_clearing_every_hook, "removed 1 hook that the caller had put on the model"),
    (L.check_capture_activations, capture_through_modules_dict, r"raised KeyError: 'block.1' \(a nested name.*named_modules"),
    (L.check_layer_grad_norms, lgn_sum_of_sample_norms, "the sum of the per-sample norms, not the norm of the whole gradient"),
    (L.check_layer_grad_norms, lgn_forward_under_no_grad, "element 0 of tensors does not require grad.*the loss has no graph"),
    (L.check_first_nonfinite, fn_class_name, "returned '_Exp', the class of the culprit"),
    (L.check_first_nonfinite, fn_with_a_prefix, "returned 'model.block.1', a name with a prefix"),
    (L.check_first_nonfinite, fn_clearing_every_hook, "removed 1 hook that the caller had put on the model"),
    (L.check_first_nonfinite, fn_first_leaf, "returned 'head', expected 'block': it prefers a leaf module to the container whose own forward made"),
    (L.check_memory_by_phase, mem_no_regions, "returned the same number for every phase, the whole run's total"),
    (L.check_memory_by_phase, mem_call_counts, "returned each region's count of calls"),
    (L.check_checkpoint_segments, cs_sequential_of_the_slice, r"a ModuleList cannot be called.*nn.Sequential\(\*blocks\[i:j\]\)"),
    (L.check_checkpoint_segments, cs_reentrant_on_a_copy_that_requires_grad, "used the reentrant checkpoint .* the legacy variant"),
    (L.check_checkpoint_segments, cs_nested, "ran blocks inside a checkpoint inside another checkpoint"),
    (L.check_add_gradient_reversal, gr_cut, "the gradient from the module back into its input was zero"),
    (L.check_add_gradient_reversal, gr_first_strength_cached, r"both steps used the strength of the first forward call \(0.3\)"),
]


@pytest.mark.parametrize("check, wrong, message", SECOND_SET, ids=[f"{c.exercise_name}-{w.__name__}" for c, w, m in SECOND_SET])
def test_second_set_of_wrong_answers_name_the_fault(check, wrong, message):
    assert_names_fault(check, wrong, message)


# A third set, written after the second revision, run once before any change (the general ones)

def capture_paired_in_run_order(model, x, names):
    outputs, handles, modules = [], [], dict(model.named_modules())
    try:
        for name in names:
            handles.append(modules[name].register_forward_hook(lambda m, a, o: outputs.append(o.detach())))
        model(x)
    finally:
        for h in handles:
            h.remove()
    return dict(zip(names, outputs))


def capture_on_a_batch_of_one_more_dim(model, x, names):
    return L.capture_activations(model, x.unsqueeze(0), names)


def lgn_paired_in_firing_order(model, x, y, loss_fn, names):
    fired, handles, modules = [], [], dict(model.named_modules())
    try:
        for name in names:
            handles.append(modules[name].register_full_backward_hook(lambda m, gin, gout: fired.append(gout[0].norm().item())))
        torch.autograd.grad(loss_fn(model(x), y), [p for p in model.parameters() if p.requires_grad])
    finally:
        for h in handles:
            h.remove()
    return dict(zip(names, fired))


def lgn_hook_returns_the_norm(model, x, y, loss_fn, names):
    return _lgn(model, x, y, loss_fn, names, lambda norms, name: lambda m, gin, gout: norms.setdefault(name, gout[0].norm().item()))


def lgn_spectral_norm(model, x, y, loss_fn, names):
    return _lgn(model, x, y, loss_fn, names,
                lambda norms, name: lambda m, gin, gout: norms.__setitem__(name, torch.linalg.norm(gout[0], ord=2).item()))


def fn_misses_minus_inf(model, x):
    return _fn(model, x, test=lambda o: any((t.isnan() | (t == math.inf)).any() for t in L.tensors_in(o)))


def fn_misses_nan(model, x):
    return _fn(model, x, test=lambda o: any((t.abs() == math.inf).any() for t in L.tensors_in(o)))


def fn_parameter_modules_only(model, x):
    return _fn(model, x, modules=lambda m: [(n, c) for n, c in m.named_modules() if list(c.parameters(recurse=False))])


def fn_first_sample_only(model, x):
    return L.first_nonfinite(model, x[:1])


def mem_aten_rows(phases):
    result = {}
    for name, phase in phases.items():
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            phase()
        result[name] = int(sum(e.cpu_memory_usage for e in prof.key_averages() if e.key.startswith("aten::")))
    return result


def mem_under_no_grad(phases):
    with torch.no_grad():
        return L.memory_by_phase(phases)


def cs_under_no_grad_then_a_leaf(blocks, x, size):
    with torch.no_grad():
        out = L.checkpoint_segments(blocks, x, size)
    return out.requires_grad_()


def gr_first_call_only(module, strength):
    done = []

    def pre(m, args):
        (x,) = args
        if not done and torch.is_grad_enabled() and x.requires_grad:
            done.append(True)
            lam = strength()
            y = x.view_as(x)
            y.register_hook(lambda g: -lam * g)
            return (y,)
    return module.register_forward_pre_hook(pre)


def gr_one_minus_strength(module, strength):
    return module.register_forward_pre_hook(lambda m, args: (args[0] + (args[0] - args[0].detach()) * -strength(),))


THIRD_SET = [
    (L.check_capture_activations, capture_paired_in_run_order, r"\['head'\] is 'stem''s output: store each output under its own module's name"),
    (L.check_capture_activations, capture_on_a_batch_of_one_more_dim, r"ran the model on an input other than x \(of shape \(1, 5, 6\)"),
    (L.check_layer_grad_norms, lgn_paired_in_firing_order, r"\['stem'\] is .*, the norm at 'head''s output.*under its own layer's name"),
    (L.check_layer_grad_norms, lgn_hook_returns_the_norm, r"has no len\(\) \(a full backward hook's return value replaces grad_input"),
    (L.check_layer_grad_norms, lgn_spectral_norm, r"the spectral norm \(the largest singular value"),
    (L.check_first_nonfinite, fn_misses_minus_inf, "returned 'head', expected 'log': it misses -inf"),
    (L.check_first_nonfinite, fn_misses_nan, "expected '' .the model itself.: it misses NaN"),
    (L.check_first_nonfinite, fn_parameter_modules_only, "it skips the modules without parameters of their own"),
    (L.check_first_nonfinite, fn_first_sample_only, r"ran the model on an input other than x \(of shape \(1, 5\)"),
    (L.check_memory_by_phase, mem_aten_rows, "the sum of the aten:: rows' cpu_memory_usage"),
    (L.check_memory_by_phase, mem_under_no_grad, "element 0 of tensors does not require grad.*a phase's backward found no graph"),
    (L.check_checkpoint_segments, cs_under_no_grad_then_a_leaf, "ran the blocks with gradient recording off"),
    (L.check_add_gradient_reversal, gr_first_call_only, "only the first forward call's gradient was reversed"),
    (L.check_add_gradient_reversal, gr_one_minus_strength, r"multiplied by 1 - strength\(\), not -strength\(\)"),
]


@pytest.mark.parametrize("check, wrong, message", THIRD_SET, ids=[f"{c.exercise_name}-{w.__name__}" for c, w, m in THIRD_SET])
def test_third_set_of_wrong_answers_name_the_fault(check, wrong, message):
    assert_names_fault(check, wrong, message)


# A fourth set, written from the learner copy alone by fresh eyes before reading the checks (the general ones)

def capture_with_self_removing_hooks(model, x, names):
    captured, modules = {}, dict(model.named_modules())

    def register(name):
        handle = None

        def hook(m, a, o):
            captured[name] = o.detach()
            handle.remove()  # a one-shot hook: gone once it has run, but one that never runs stays
        handle = modules[name].register_forward_hook(hook)

    for name in names:
        register(name)
    model(x)
    return captured


def capture_leaves_only(model, x, names):
    leaves = [(n, m) for n, m in model.named_modules() if next(m.children(), None) is None and n in names]
    captured, handles = {}, []
    try:
        for name, m in leaves:
            handles.append(m.register_forward_hook(lambda mod, a, o, name=name: captured.__setitem__(name, o.detach())))
        model(x)
    finally:
        for h in handles:
            h.remove()
    return captured


def capture_first_sample(model, x, names):
    return _capture(model, x, names, store=lambda args, output: output[0].detach())


def lgn_grad_input_or_zero(model, x, y, loss_fn, names):
    return _lgn(model, x, y, loss_fn, names, lambda norms, name: lambda m, gin, gout: norms.__setitem__(
        name, 0.0 if gin[0] is None else gin[0].norm().item()))


def lgn_grad_with_respect_to_the_output(model, x, y, loss_fn, names):
    modules, norms, handles = dict(model.named_modules()), {}, []
    try:
        for name in names:
            handles.append(modules[name].register_full_backward_hook(output_norm(norms, name)))
        out = model(x)
        torch.autograd.grad(loss_fn(out, y), out)  # the gradient stops at the model's output: no layer's hook runs
    finally:
        for h in handles:
            h.remove()
    return norms


def gr_switching_on_the_inputs_grad(module, strength):
    def pre(m, args):
        (x,) = args
        if not x.requires_grad:
            x.requires_grad_()  # the caller's tensor
        lam = strength()
        y = x.view_as(x)
        if torch.is_grad_enabled():
            y.register_hook(lambda g: -lam * g)
        return (y,)
    return module.register_forward_pre_hook(pre)


def gr_no_reversal_at_zero(module, strength):
    return _gr(module, strength, scale=lambda lam: -lam if lam else 1.0)


def gr_backward_pre_hook_on_the_output(module, strength):
    def pre(m, args):
        m.lam = strength()

    module.register_forward_pre_hook(pre)
    return module.register_full_backward_pre_hook(lambda m, grad_output: tuple(-m.lam * g for g in grad_output))


def fn_late_binding(model, x):
    found, handles = [], []
    try:
        for name, m in model.named_modules():
            handles.append(m.register_forward_hook(lambda mod, a, o: found.append(name) if not found and _nonfinite(o) else None))
        with torch.no_grad():
            model(x)
    finally:
        for h in handles:
            h.remove()
    return found[0] if found else None


def fn_zero_grad_first(model, x):
    model.zero_grad()
    return L.first_nonfinite(model, x)


def fn_none_for_a_nonfinite_input(model, x):
    return None if not x.isfinite().all() else L.first_nonfinite(model, x)


def fn_last_output_of_each_module(model, x):
    outputs = {}  # a module that runs twice keeps its first place in the dict, with its last output
    handles = [m.register_forward_hook(lambda mod, a, o, name=name: outputs.__setitem__(name, o)) for name, m in model.named_modules()]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in handles:
            h.remove()
    return next((name for name, o in outputs.items() if _nonfinite(o)), None)


def mem_phase_outside_its_region(phases):
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for name, phase in phases.items():
            with record_function(name):
                pass
            phase()
    rows = {e.key: e.cpu_memory_usage for e in prof.key_averages()}
    return {name: rows[name] for name in phases}


def mem_nonzero_only(phases):
    result = L.memory_by_phase(phases)
    return {name: value for name, value in result.items() if value}


def mem_absolute(phases):
    return _mem(phases, convert=abs)


def cs_new_leaf_between_segments(blocks, x, size):
    for start in range(0, len(blocks), size):
        x = checkpoint(nn.Sequential(*blocks[start:start + size]), x, use_reentrant=False).detach().requires_grad_()
    return x


def capture_a_list_per_name(model, x, names):
    return _capture(model, x, names, store=lambda args, output: [output.detach()])


def lgn_grad_with_respect_to_x(model, x, y, loss_fn, names):
    return _lgn(model, x, y, loss_fn, names, output_norm, backward=lambda loss: torch.autograd.grad(loss, x))


def lgn_summed_loss(model, x, y, loss_fn, names):
    return _lgn(model, x, y, loss_fn, names, output_norm,
                backward=lambda loss: torch.autograd.grad(loss * len(x), [p for p in model.parameters() if p.requires_grad]))


def gr_half_strength(module, strength):
    return _gr(module, strength, scale=lambda lam: -lam / 2)


def fn_sum_is_finite(model, x):
    return _fn(model, x, test=lambda o: any(not t.sum().isfinite() for t in L.tensors_in(o)))


def mem_opposite_sign(phases):
    return _mem(phases, convert=lambda v: -v)


def capture_freezing_for_the_call(model, x, names):
    model.requires_grad_(False)  # no graph to detach from... then every parameter switched back on, the frozen ones too
    try:
        return _capture(model, x, names, store=lambda args, output: output)
    finally:
        model.requires_grad_(True)


def lgn_per_element(model, x, y, loss_fn, names):
    return _lgn(model, x, y, loss_fn, names, lambda norms, name: lambda m, gin, gout: norms.__setitem__(
        name, (gout[0].norm() / gout[0].numel()).item()))


def fn_name_or_none(model, x):
    flagged = []
    _fn(model, x, pick=lambda found, model: flagged.extend(found))
    return (flagged[0] if flagged else None) or None  # '' is false: the model itself is lost


def mem_read_inside_the_profile(phases):
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for name, phase in phases.items():
            with record_function(name):
                phase()
        rows = {e.key: e.cpu_memory_usage for e in prof.key_averages()}
    return {name: rows[name] for name in phases}


def cs_reseeding_each_segment(blocks, x, size):
    def run(group, h):
        torch.manual_seed(0)
        return _run_group(group, h)
    for start in range(0, len(blocks), size):
        x = checkpoint(functools.partial(run, list(blocks)[start:start + size]), x, use_reentrant=False)
    return x


FOURTH_SET = [
    (L.check_capture_activations, capture_freezing_for_the_call, "switched requires_grad on for block.0.weight, which was frozen"),
    (L.check_layer_grad_norms, lgn_per_element, "the norm divided by the number of elements"),
    (L.check_first_nonfinite, fn_name_or_none, r"returned None, expected '' \(the model itself\): a hook of yours was on the model itself.*is None"),
    (L.check_memory_by_phase, mem_read_inside_the_profile, "while the profiler was still running, inside its `with` block"),
    (L.check_checkpoint_segments, cs_reseeding_each_segment, "reseeded .torch.manual_seed. or drew random numbers of its own"),
    (L.check_capture_activations, capture_a_list_per_name, r"\['stem'\] is a list that holds the output: store the output itself"),
    (L.check_layer_grad_norms, lgn_grad_with_respect_to_x, "does not require grad: no parameter of this model is frozen, and the data x needs no gradient"),
    (L.check_layer_grad_norms, lgn_summed_loss, r"every norm is 6 times the expected one \(the batch size\).*the loss was summed"),
    (L.check_add_gradient_reversal, gr_half_strength, "multiplied by -0.15 in the step with strength.. = 0.3 and by -0.4"),
    (L.check_first_nonfinite, fn_sum_is_finite, "returned 'split', expected None.*whose sum overflows to inf"),
    (L.check_memory_by_phase, mem_opposite_sign, "each change with the opposite sign"),
    (L.check_capture_activations, capture_with_self_removing_hooks, r"let the model's ModelError through and left hooks on \['head'\]"),
    (L.check_capture_activations, capture_leaves_only, r"has no entry for 'block', '' \(the model itself\): exactly the names of modules that have children"),
    (L.check_capture_activations, capture_first_sample, r"\['stem'\] is the first sample's output only \(output\[0\]\)"),
    (L.check_layer_grad_norms, lgn_grad_input_or_zero, r"\['stem'\] is 0.0, and the other values are the norms at the layers' inputs: you read grad_input"),
    (L.check_layer_grad_norms, lgn_grad_with_respect_to_the_output, "returned an empty dict: no gradient reached the layers' outputs"),
    (L.check_add_gradient_reversal, gr_switching_on_the_inputs_grad, "on features that need no gradient.*switched on requires_grad on the caller's features"),
    (L.check_add_gradient_reversal, gr_no_reversal_at_zero, r"at strength\(\) = 0 the gradient came back unchanged"),
    (L.check_add_gradient_reversal, gr_backward_pre_hook_on_the_output,
     r"own parameters learned from the reversed gradient.*; and both steps used the strength of the last forward call \(0.8\)"),
    (L.check_first_nonfinite, fn_late_binding, r"answered the name of the last module in named_modules\(\).*loop variable"),
    (L.check_first_nonfinite, fn_zero_grad_first, "changed head.weight.grad, which held a stale gradient"),
    (L.check_first_nonfinite, fn_none_for_a_nonfinite_input, "a batch that holds an inf.*never ran the model"),
    (L.check_first_nonfinite, fn_last_output_of_each_module, "returned 'shared', which runs 2 times: its first output was finite"),
    (L.check_memory_by_phase, mem_phase_outside_its_region, "while no record_function region was open"),
    (L.check_memory_by_phase, mem_nonzero_only, r"has no entry for \['temporary', 'view'\], the phases that left 0 bytes"),
    (L.check_memory_by_phase, mem_absolute, "each change without its sign"),
    (L.check_checkpoint_segments, cs_new_leaf_between_segments, "the input of block 6 is a new leaf tensor.*the graph is cut"),
]


@pytest.mark.parametrize("check, wrong, message", FOURTH_SET, ids=[f"{c.exercise_name}-{w.__name__}" for c, w, m in FOURTH_SET])
def test_fourth_set_of_wrong_answers_name_the_fault(check, wrong, message):
    assert_names_fault(check, wrong, message)


def test_every_check_has_three_alternatives_and_eight_wrong_answers():
    for check, _ in PAIRS:
        assert sum(c is check for c, _ in RIGHT) >= 3, check.exercise_name
        assert sum(c is check for c, _, _ in WRONG) >= 8, check.exercise_name


def test_checks_print_no_warnings(recwarn, capsys):
    """The profiler, full backward hooks and checkpoint all warn; the checks keep every warning out of the learner's output."""
    for check, reference in PAIRS:
        check(reference)
    assert not [str(w.message) for w in recwarn.list]
    assert capsys.readouterr().err == ""


def test_checks_leave_no_hook_and_no_profiler_behind():
    before = L._global_hooks()
    for check, wrong in [(L.check_capture_activations, capture_with_a_global_hook_left), (L.check_memory_by_phase, mem_left_running),
                         (L.check_first_nonfinite, fn_not_in_finally)]:
        with pytest.raises(ExerciseFailed):
            check(wrong)
        assert L._global_hooks() == before
        assert not L._profiler_running()
    L.check_memory_by_phase(L.memory_by_phase)  # a profile starts cleanly afterwards


def test_capture_check_leaves_the_hidden_model_clean_after_a_leak():
    with pytest.raises(ExerciseFailed, match="left hooks"):
        L.check_capture_activations(capture_without_remove)
    L.check_capture_activations(L.capture_activations)


def test_memory_check_refuses_to_start_under_a_running_profiler():
    prof = profile(activities=[ProfilerActivity.CPU])
    prof.start()
    try:
        with pytest.raises(ExerciseFailed, match="a profiler is still running in this kernel"):
            L.check_memory_by_phase(L.memory_by_phase)
    finally:
        prof.stop()


RAISING = [  # errors inside the learner's code: one line, arguments named briefly
    (L.check_capture_activations, lambda m, x, n: m(n), r"^capture_activations: <lambda>\(model, tensor of shape \(5, 6\), \['stem', 'block.1', 'head'\]\) raised TypeError"),
    (L.check_layer_grad_norms, lambda m, x, y, f, n: f(m(y), x), r"^layer_grad_norms: <lambda>\(model, inputs of shape \(6, 7\), targets of shape \(6,\), F.cross_entropy, .*\) raised RuntimeError"),
    (L.check_add_gradient_reversal, lambda m, s: s(1), r"^add_gradient_reversal: <lambda>\(domain classifier, strength\) raised TypeError"),
    (L.check_add_gradient_reversal, lambda m, s: m.register_forward_pre_hook(lambda mod, a: (a[0] @ a[0],)),
     r"^add_gradient_reversal: domain\(features of step 1, strength\(\) = 0.3\) raised RuntimeError: mat1 and mat2 shapes"),
    (L.check_add_gradient_reversal, gr_hook_returns_a_sum,
     r"^add_gradient_reversal: backward\(\) through the domain classifier with the reversal on raised RuntimeError"),
    (L.check_first_nonfinite, lambda m, x: m(x.T), r"^first_nonfinite: <lambda>\(a model with finite outputs everywhere, tensor of shape \(4, 5\)\) raised RuntimeError"),
    (L.check_memory_by_phase, lambda phases: phases["missing"](), r"^memory_by_phase: <lambda>\(tensor phases: \[.*\]\) raised KeyError"),
    (L.check_checkpoint_segments, lambda blocks, x, size: blocks[1](x), r"^checkpoint_segments: <lambda>\(7 blocks, tensor of shape \(5, 3\), 3\) raised RuntimeError"),
]


@pytest.mark.parametrize("check, wrong, message", RAISING, ids=[c.exercise_name + str(i) for i, (c, _, _) in enumerate(RAISING)])
def test_errors_inside_the_learners_code_are_one_short_line(check, wrong, message):
    with pytest.raises(ExerciseFailed, match=message) as info:
        check(wrong)
    assert "\n" not in str(info.value) and len(str(info.value)) < 300


# The hidden data separates the near-misses it is meant to separate.

def test_nonfinite_cases_have_the_culprits_the_check_expects():
    culprits = [L.first_nonfinite(make(), x) for _, make, x in L._nonfinite_cases()]
    assert culprits == [None, "block.1", "embed", "boom", None, "split", "", "block", "log"]


def test_tensor_phases_have_the_sizes_a_learner_can_work_out():
    expected, _ = L._profiled(L._Phases(L._tensor_steps()).phases())
    # zeros(1000) float32; ones(300) float64; a temporary, freed at once; a view; the free; cat makes 600 float64,
    # and the old b stays alive through the view v
    assert expected == {"allocate": 4000, "float64": 2400, "temporary": 0, "view": 0, "free": -4000, "concatenate": 4800}


def test_training_phases_are_the_same_on_every_run():
    runs = [L._profiled(L._Phases(L._training_steps()).phases())[0] for _ in range(2)]
    assert runs[0] == runs[1]
    n_params = (24 * 40 + 40) + (40 * 40 + 40) + (40 * 6 + 6)
    assert runs[0]["optimizer step"] >= 2 * 4 * n_params  # Adam's first step allocates exp_avg and exp_avg_sq


def test_checkpoint_segments_saves_one_block_input_per_segment():
    blocks = L._blocks(0, [4, 5, 6, 7, 8, 9])
    x = torch.randn(2, 4)
    for size, starts in [(1, [0, 1, 2, 3, 4]), (2, [0, 2, 4]), (3, [0, 3]), (5, [0])]:
        _, nbytes = L.saved_activation_bytes(lambda: L.checkpoint_segments(blocks, x, size), blocks.parameters())
        assert nbytes == sum(2 * (4 + i) * 4 for i in starts)


NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "solutions" / "08_hooks.ipynb"


def _notebook_code() -> list[str]:
    return [c.source for c in nbformat.read(NOTEBOOK, as_version=4).cells if c.cell_type == "code"]


def test_the_notebooks_saved_activation_counter_is_the_checks():
    """The notebook teaches saved_activation_bytes; the check of checkpoint_segments counts with the same code."""
    import inspect

    source = next(c for c in _notebook_code() if "def saved_activation_bytes(" in c)
    reference = inspect.getsource(L.saved_activation_bytes)
    strip = lambda text: [line.split("#")[0].rstrip() for line in text.splitlines() if line.split("#")[0].strip()]  # noqa: E731
    body = source[source.index("def saved_activation_bytes("):]
    assert strip(reference) == strip(body)[:len(strip(reference))]
