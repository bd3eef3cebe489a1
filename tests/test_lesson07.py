"""Lesson 07's checks against the reference solutions, correct answers written differently, and the wrong answers learners write."""

import bisect
import copy
import logging
import types
from pathlib import Path

import matplotlib
import nbformat
import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch import nn

from course_utils import lesson07 as L
from course_utils.tooling.checks import ExerciseFailed
from lesson_contract import assert_names_fault, assert_passes, contract_tests

matplotlib.use("Agg")

PAIRS = [
    (L.check_compile_for_serving, L.compile_for_serving),
    (L.check_masked_mean_pool, L.masked_mean_pool),
    (L.check_compile_with_eager_monitors, L.compile_with_eager_monitors),
    (L.check_bucketed_predict, L.bucketed_predict),
    (L.check_compile_repeated_blocks, L.compile_repeated_blocks),
]

(test_reference_passes, test_stub_is_not_attempted, test_bad_input_is_one_named_line, test_hostile_answers_are_the_learners_fault,
 test_checks_leave_the_learners_random_state_alone, test_checks_are_quick) = contract_tests(PAIRS, max_seconds=5.0)


# compile_for_serving

def serve_in_place(model, example, mode):
    model.eval()
    model.compile(mode=mode, fullgraph=True)
    with torch.no_grad():
        model(example)
    return model


def serve_with_set_grad_enabled(model, example, mode):
    model.train(False)
    compiled = torch.compile(model, fullgraph=True, mode=mode, dynamic=False)
    with torch.set_grad_enabled(False):
        compiled(example)
    return compiled


def serve_through_torch_compiler(model, example, mode):
    compiled = torch.compiler.compile(model.eval(), mode=mode, fullgraph=True)

    @torch.no_grad()
    def warm_up():
        compiled(example)

    warm_up()
    return compiled


def serve_with_decorator_style(model, example, mode):
    model.eval()
    compiled = torch.compile(fullgraph=True, mode=mode)(model)
    with torch.no_grad():
        compiled(example.clone())
    return compiled


def serve_variant(*, eval_first=True, eval_after=False, grad=False, inference=False, warm=True, mode=None, fullgraph=True,
                  options=False, swallow=False, twice=False):
    def answer(model, example, given_mode):
        if eval_first:
            model.eval()
        kwargs = {"options": {"mode": given_mode}} if options else {"mode": mode or given_mode}
        compiled = torch.compile(model, fullgraph=fullgraph, **kwargs)
        if twice:
            compiled = torch.compile(compiled, mode=given_mode, fullgraph=fullgraph)
        if warm:
            context = torch.inference_mode() if inference else torch.enable_grad() if grad else torch.no_grad()
            try:
                with context:
                    compiled(example)
            except Exception:
                if not swallow:
                    raise
                return model
        if eval_after:
            model.eval()
        return compiled
    return answer


def serve_checking_with_explain(model, example, mode):  # a correct alternative: its own error at a graph break
    model.eval()
    with torch.no_grad():
        if torch._dynamo.explain(model)(example).break_reasons:
            raise RuntimeError("the model has a graph break")
        compiled = torch.compile(model, mode=mode)
        compiled(example)
    return compiled


class CompilesInForward(nn.Module):
    def __init__(self, model, mode):
        super().__init__()
        self.model, self.mode = model, mode

    def forward(self, x):
        return torch.compile(self.model, mode=self.mode, fullgraph=True)(x)


def serve_compiling_in_forward(model, example, mode):
    model.eval()
    wrapper = CompilesInForward(model, mode)
    with torch.no_grad():
        wrapper(example)
    return wrapper


# masked_mean_pool

def pool_without_print(h, mask):  # the notebook's pool_with_breaks, its print taken out
    pooled = []
    for row, keep in zip(h, mask):
        if keep.any():
            pooled.append(row[keep].mean(dim=0))
        else:
            pooled.append(h.new_zeros(h.shape[-1]))
    out = torch.stack(pooled)
    return out / out.norm(dim=1, keepdim=True).clamp(min=1e-6)


def pool_with_breaks(h, mask):  # the notebook's function: the same, and a print
    out = pool_without_print(h, mask)
    print(f"pooled {len(out)} rows")
    return out


def pool_keeping_print(h, mask):
    print("", end="")
    return L.masked_mean_pool(h, mask)


def pool_where_of_masked_select(h, mask):
    pooled = [torch.where(keep.any(), row[keep].mean(dim=0), torch.zeros_like(row[0])) for row, keep in zip(h, mask)]
    out = torch.stack(pooled)
    return out / out.norm(dim=1, keepdim=True).clamp(min=1e-6)


def pool_zero_division(h, mask):
    w = mask.unsqueeze(-1).to(h.dtype)
    pooled = (h * w).sum(1) / w.sum(1)
    return pooled / pooled.norm(dim=1, keepdim=True).clamp(min=1e-6)


def pool_not_normalised(h, mask):
    w = mask.unsqueeze(-1).to(h.dtype)
    return (h * w).sum(1) / w.sum(1).clamp(min=1)


def pool_normalize_default_eps(h, mask):
    w = mask.unsqueeze(-1).to(h.dtype)
    return F.normalize((h * w).sum(1) / w.sum(1).clamp(min=1), dim=1)


def pool_ignoring_mask(h, mask):
    pooled = h.mean(dim=1)
    return pooled / pooled.norm(dim=1, keepdim=True).clamp(min=1e-6)


def pool_in_float32(h, mask):
    return L.masked_mean_pool(h.float(), mask)


def pool_with_item_norms(h, mask):
    w = mask.unsqueeze(-1).to(h.dtype)
    pooled = (h * w).sum(1) / w.sum(1).clamp(min=1)
    return torch.stack([row / max(row.norm().item(), 1e-6) for row in pooled])


def pool_in_place(h, mask):
    h.mul_(mask.unsqueeze(-1))
    pooled = h.sum(1) / mask.sum(1, keepdim=True).clamp(min=1)
    return pooled / pooled.norm(dim=1, keepdim=True).clamp(min=1e-6)


def pool_masked_fill(h, mask):
    summed = h.masked_fill(~mask.unsqueeze(-1), 0).sum(dim=1)
    pooled = summed / mask.sum(dim=1, keepdim=True).clamp(min=1)
    return F.normalize(pooled, dim=1, eps=1e-6)


def pool_einsum(h, mask):
    w = mask.to(h.dtype)
    pooled = torch.einsum("btd,bt->bd", h, w) / torch.clamp(w.sum(-1, keepdim=True), min=1.0)
    norm = torch.linalg.vector_norm(pooled, dim=-1, keepdim=True)
    return pooled / torch.maximum(norm, torch.full_like(norm, 1e-6))


def pool_loop_with_where(h, mask):
    rows = []
    for row, keep in zip(h, mask):
        w = keep.to(h.dtype)
        total = (row * w[:, None]).sum(0)
        rows.append(torch.where(w.sum() > 0, total / w.sum().clamp(min=1), torch.zeros_like(total)))
    out = torch.stack(rows)
    return out / out.norm(dim=1, keepdim=True).clamp(min=1e-6)


# compile_with_eager_monitors

def monitors_of(model):
    return [m for m in model.modules() if isinstance(m, L.ActivationMonitor)]


def eager_monitors_in_place(model):
    for name, module in model.named_modules():
        if type(module).__name__ == "ActivationMonitor":
            module.forward = torch.compiler.disable(module.forward)
    model.compile()
    return model


def eager_monitors_by_replacement(model):
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, L.ActivationMonitor):
                setattr(parent, name, torch.compiler.disable(child))
    return torch.compile(model)


def eager_monitors_not_recursive(model):
    for monitor in monitors_of(model):
        monitor.forward = torch.compiler.disable(monitor.forward, recursive=False, reason="Python-side statistics")
    return torch.compile(model, dynamic=False)


def monitors_not_disabled(model):
    return torch.compile(model)


def monitors_children_only(model):
    for module in model.children():
        if isinstance(module, L.ActivationMonitor):
            module.forward = torch.compiler.disable(module.forward)
    return torch.compile(model)


def monitors_disabled_on_the_class(model):
    L.ActivationMonitor.forward = torch.compiler.disable(L.ActivationMonitor.forward)
    return torch.compile(model)


def monitors_compiled_with_disable_flag(model):
    for monitor in monitors_of(model):
        monitor.compile(disable=True)
    return torch.compile(model)


def monitors_removed(model):
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, L.ActivationMonitor):
                setattr(parent, name, nn.Identity())
    return torch.compile(model)


def monitors_top_level_only(model):
    model.monitor.forward = torch.compiler.disable(model.monitor.forward)
    return torch.compile(model)


def monitors_nested_only(model):
    model.block.monitor.forward = torch.compiler.disable(model.block.monitor.forward)
    return torch.compile(model)


def monitors_skipped_while_compiling(model):
    for monitor in monitors_of(model):
        original = monitor.forward
        monitor.forward = lambda h, original=original: h if torch.compiler.is_compiling() else original(h)
    return torch.compile(model)


def monitors_but_linears_compiled_one_by_one(model):
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.compile()
    return model


def monitors_with_the_model_disabled(model):
    model.forward = torch.compiler.disable(model.forward)
    return torch.compile(model)


def monitors_not_compiled(model):
    for monitor in monitors_of(model):
        monitor.forward = torch.compiler.disable(monitor.forward)
    return model


def monitors_returning_compile_result(model):
    for monitor in monitors_of(model):
        monitor.forward = torch.compiler.disable(monitor.forward)
    return model.compile()


# bucketed_predict

def bucketed_with_f_pad(model, batch, buckets):
    outs = []
    for start in range(0, len(batch), buckets[-1]):
        chunk = batch[start:start + buckets[-1]]
        size = buckets[bisect.bisect_left(buckets, len(chunk))]
        outs.append(model(F.pad(chunk, (0, 0, 0, size - len(chunk))))[: len(chunk)])
    return torch.cat(outs)


def bucketed_padding_in_front(model, batch, buckets):
    outs = []
    for chunk in torch.split(batch, max(buckets)):
        size = next(b for b in sorted(buckets) if b >= len(chunk))
        padded = torch.cat([chunk.new_zeros(size - len(chunk), chunk.shape[1]), chunk])
        outs.append(model(padded)[size - len(chunk):])
    return torch.cat(outs)


def bucketed_repeating_the_last_row(model, batch, buckets):
    results = []
    for chunk in batch.split(max(buckets)):
        n = chunk.shape[0]
        size = min(b for b in buckets if b >= n)
        padded = torch.cat([chunk, chunk[-1:].expand(size - n, -1)])
        results.append(model(padded).narrow(0, 0, n))
    return torch.cat(results, dim=0)


def smallest(buckets, n):
    return min(b for b in buckets if b >= n)


def run_padded(model, chunk, size, *, front=False, keep_padding=False, pad_dtype=None):
    """model on chunk padded to size rows (zeros at the end, or in front), the real rows' outputs (or all of them)."""
    n = len(chunk)
    pad = torch.zeros(size - n, chunk.shape[1], dtype=pad_dtype or chunk.dtype)
    out = model(torch.cat([pad, chunk] if front else [chunk, pad]))
    return out if keep_padding else out[:n]


def bucketed_unpadded(model, batch, buckets):
    return model(batch)


def bucketed_largest_always(model, batch, buckets):
    return torch.cat([run_padded(model, c, max(buckets)) for c in batch.split(max(buckets))])


def bucketed_off_by_one(model, batch, buckets):
    return torch.cat([run_padded(model, c, min((b for b in buckets if b > len(c)), default=max(buckets))) for c in batch.split(max(buckets))])


def bucketed_keeping_padding(model, batch, buckets):
    return torch.cat([run_padded(model, c, smallest(buckets, len(c)), keep_padding=True) for c in batch.split(max(buckets))])


def bucketed_without_chunks(model, batch, buckets):
    n = len(batch)
    return run_padded(model, batch, min((b for b in buckets if b >= n), default=n))


def bucketed_last_chunk_unpadded(model, batch, buckets):
    chunks = batch.split(max(buckets))
    last = len(chunks) - 1 if len(chunks) > 1 else None
    return torch.cat([model(c) if i == last else run_padded(model, c, smallest(buckets, len(c))) for i, c in enumerate(chunks)])


def bucketed_front_padding_first_rows(model, batch, buckets):
    return torch.cat([run_padded(model, c, smallest(buckets, len(c)), front=True) for c in batch.split(max(buckets))])


def bucketed_row_by_row(model, batch, buckets):
    return torch.cat([model(row[None]) for row in batch])


def bucketed_equal_chunks(model, batch, buckets):
    chunks = batch.chunk(-(-len(batch) // max(buckets)))
    return torch.cat([run_padded(model, c, smallest(buckets, len(c))) for c in chunks])


def bucketed_float64_padding(model, batch, buckets):
    return torch.cat([run_padded(model, c, smallest(buckets, len(c)), pad_dtype=torch.float64) for c in batch.split(max(buckets))])


# compile_for_serving: the original model returned after warming up the compiled one

def serve_returning_the_original(model, example, mode):
    model.eval()
    compiled = torch.compile(model, mode=mode, fullgraph=True)
    with torch.no_grad():
        compiled(example)
    return model


# compile_repeated_blocks

def stacks_by_recursion(model):
    found = []

    def visit(module, prefix):
        children = list(module.named_children())
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and len(children) > 1 and all(type(c) is type(children[0][1]) for _, c in children):
            for _, block in children:
                block.forward = torch.compile(block.forward)
            found.append(prefix)
        for name, child in children:
            visit(child, f"{prefix}.{name}" if prefix else name)

    visit(model, "")
    return found


def stacks_sharing_one_compiled_function(model):
    names, compiled = [], {}
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        kinds = {type(block) for block in module}
        if len(module) >= 2 and len(kinds) == 1:
            cls = kinds.pop()
            compiled.setdefault(cls, torch.compile(cls.forward))
            for block in module:
                block.forward = types.MethodType(compiled[cls], block)
            names.append(name)
    return names


def stacks_by_class_names(model):
    names = []
    for name, module in model.named_modules():
        if type(module).__name__ in ("ModuleList", "Sequential"):
            classes = [type(b).__name__ for b in module.children()]
            if len(classes) >= 2 and len(set(classes)) == 1:
                for block in module.children():
                    block.compile(dynamic=False)
                names.append(name)
    return names


def _stacks(model, *, kinds=(nn.ModuleList, nn.Sequential), same_class=True, at_least=2, top_level=False, compile_container=False,
            ret="names", order=lambda names: names):
    names = []
    items = model.named_children() if top_level else model.named_modules()
    for name, module in items:
        blocks = list(module.children())
        if isinstance(module, kinds) and len(blocks) >= at_least and (not same_class or len({type(b) for b in blocks}) == 1):
            if compile_container:
                module.compile()
            else:
                for block in blocks:
                    block.compile()
            names.append(name)
    return {"names": order(names), "model": model, "blocks": [f"{n}.{i}" for n in names for i in range(len(list(dict(model.named_modules())[n].children())))]}[ret]


def stacks_wrong(**options):
    return lambda model: _stacks(model, **options)


def stacks_replaced_by_wrappers(model):
    names = []
    for name, module in model.named_modules():
        if L.is_stack(module):
            for i, block in enumerate(list(module.children())):
                module[i] = torch.compile(block)
            names.append(name)
    return names


def stacks_class_patched(model):
    names = []
    for name, module in model.named_modules():
        if L.is_stack(module):
            cls = type(next(module.children()))
            cls.forward = torch.compile(cls.forward)
            names.append(name)
    return names


def stacks_by_compiling_the_model(model):
    model.compile()
    return [name for name, module in model.named_modules() if L.is_stack(module)]


def stacks_in_a_new_model(model):
    L.compile_repeated_blocks(model)
    return nn.Sequential(model)


def stacks_compiled_twice(model):
    names = L.compile_repeated_blocks(model)
    for name in names:
        for block in dict(model.named_modules())[name].children():
            block.compile()
    return names


ALTERNATIVES = [
    (L.check_compile_for_serving, serve_in_place),
    (L.check_compile_for_serving, serve_with_set_grad_enabled),
    (L.check_compile_for_serving, serve_through_torch_compiler),
    (L.check_compile_for_serving, serve_with_decorator_style),
    (L.check_compile_for_serving, serve_checking_with_explain),
    (L.check_masked_mean_pool, pool_masked_fill),
    (L.check_masked_mean_pool, pool_einsum),
    (L.check_masked_mean_pool, pool_loop_with_where),
    (L.check_compile_with_eager_monitors, eager_monitors_in_place),
    (L.check_compile_with_eager_monitors, eager_monitors_by_replacement),
    (L.check_compile_with_eager_monitors, eager_monitors_not_recursive),
    (L.check_bucketed_predict, bucketed_with_f_pad),
    (L.check_bucketed_predict, bucketed_padding_in_front),
    (L.check_bucketed_predict, bucketed_repeating_the_last_row),
    (L.check_compile_repeated_blocks, stacks_by_recursion),
    (L.check_compile_repeated_blocks, stacks_sharing_one_compiled_function),
    (L.check_compile_repeated_blocks, stacks_by_class_names),
]


@pytest.mark.parametrize("check, answer", ALTERNATIVES, ids=lambda v: getattr(v, "exercise_name", None) or getattr(v, "__name__", ""))
def test_correct_alternatives_pass(check, answer):
    assert_passes(check, answer)


WRONG = [
    # compile_for_serving
    (L.check_compile_for_serving, lambda model, example, mode: model, "torch.compile was never called"),
    (L.check_compile_for_serving, lambda model, example, mode: model.eval().compile(mode=mode, fullgraph=True), "returned None.*model.compile\\(\\) compiles in place"),
    (L.check_compile_for_serving, serve_variant(warm=False), "torch.compile is lazy.*warm"),
    (L.check_compile_for_serving, serve_variant(grad=True), "gradients on.*torch.no_grad"),
    (L.check_compile_for_serving, serve_variant(inference=True), "torch.inference_mode\\(\\).*compiled again.*warm up under torch.no_grad"),
    (L.check_compile_for_serving, serve_variant(eval_first=False, eval_after=True), "warm-up ran in train mode.*eval mode before the warm-up"),
    (L.check_compile_for_serving, serve_variant(eval_first=False), "still in train mode"),
    (L.check_compile_for_serving, serve_variant(mode="reduce-overhead"), "got mode='reduce-overhead', expected the mode you were given, 'max-autotune-no-cudagraphs'"),
    (L.check_compile_for_serving, serve_variant(mode="fast"), "raised RuntimeError: Unrecognized mode=fast, should be one of"),
    (L.check_compile_for_serving, serve_variant(options=True), "raised RuntimeError: Unexpected optimization option mode"),
    (L.check_compile_for_serving, serve_variant(fullgraph=False), "graph break.*compiled silently.*fullgraph=True"),
    (L.check_compile_for_serving, serve_variant(swallow=True), "raised Dynamo's error but compile_for_serving returned normally"),
    (L.check_compile_for_serving, serve_variant(twice=True), "torch.compile was called 2 times for one model: compile it once"),
    (L.check_compile_for_serving, serve_compiling_in_forward, "torch.compile ran again while the model ran"),
    (L.check_compile_for_serving, lambda model, example, mode: L.compile_for_serving(copy.deepcopy(model), example, mode), "its own copy of the weights"),
    (L.check_compile_for_serving, lambda model, example, mode: L.compile_for_serving(model, example, mode).forward, "expected the compiled module"),
    (L.check_compile_for_serving, serve_returning_the_original, "the module you returned ran no compiled code when the server called it"),
    # masked_mean_pool
    (L.check_masked_mean_pool, pool_with_breaks, "fullgraph=True, Dynamo breaks the graph at `if keep.any\\(\\):`: Data-dependent branching \\(a Python `if`"),
    (L.check_masked_mean_pool, pool_without_print, "fullgraph=True, Dynamo breaks the graph at `if keep.any\\(\\):`: Data-dependent branching"),
    (L.check_masked_mean_pool, pool_keeping_print, "fullgraph=True, Dynamo breaks the graph at `print\\(\"\", end=\"\"\\)`.*print\\(\\) cannot go in a graph"),
    (L.check_masked_mean_pool, pool_where_of_masked_select, "default fullgraph=False, Dynamo breaks the graph at .*row\\[keep\\].*Dynamic shape operator.*fullgraph=True captures it"),
    (L.check_masked_mean_pool, pool_with_item_norms, "Dynamo breaks the graph at `return torch.stack\\(\\[row / max\\(row.norm\\(\\).item\\(\\), 1e-6\\)"),
    (L.check_masked_mean_pool, pool_zero_division, "row of padding only gave NaN"),
    (L.check_masked_mean_pool, pool_not_normalised, "not normalised"),
    (L.check_masked_mean_pool, pool_normalize_default_eps, "norm below 1e-6 was scaled up to norm 1"),
    (L.check_masked_mean_pool, pool_ignoring_mask, "padding positions were averaged in"),
    (L.check_masked_mean_pool, pool_in_float32, "float64.*expected dtype torch.float64, got torch.float32"),
    (L.check_masked_mean_pool, pool_in_place, "modified its input in place"),
    (L.check_masked_mean_pool, lambda h, mask: None, "is None"),
    # compile_with_eager_monitors
    (L.check_compile_with_eager_monitors, monitors_not_disabled, "Dynamo still traced an ActivationMonitor.*'block.monitor'"),
    (L.check_compile_with_eager_monitors, monitors_children_only, "Dynamo still traced an ActivationMonitor.*nested in a submodule"),
    (L.check_compile_with_eager_monitors, monitors_top_level_only, "Dynamo still traced an ActivationMonitor"),
    (L.check_compile_with_eager_monitors, monitors_nested_only, "Dynamo still traced an ActivationMonitor"),
    (L.check_compile_with_eager_monitors, monitors_disabled_on_the_class, "changed ActivationMonitor.forward on the class itself"),
    (L.check_compile_with_eager_monitors, monitors_compiled_with_disable_flag, "Dynamo still traced an ActivationMonitor"),
    (L.check_compile_with_eager_monitors, monitors_removed, "the monitor at 'monitor' recorded 0 times in 2 calls"),
    (L.check_compile_with_eager_monitors, monitors_skipped_while_compiling, "the monitor at 'monitor' recorded 0 times in 2 calls"),
    (L.check_compile_with_eager_monitors, monitors_but_linears_compiled_one_by_one, "the model's own code between the monitors ran eagerly"),
    (L.check_compile_with_eager_monitors, monitors_with_the_model_disabled, "nothing was compiled"),
    (L.check_compile_with_eager_monitors, monitors_not_compiled, "torch.compile was never called"),
    (L.check_compile_with_eager_monitors, monitors_returning_compile_result, "returned None.*model.compile\\(\\) returns None"),
    # bucketed_predict
    (L.check_bucketed_predict, bucketed_unpadded, "a batch of 5 ran the model at size 5, not a bucket size \\(4, 16, 32\\)"),
    (L.check_bucketed_predict, bucketed_largest_always, "a batch of 5 ran at sizes \\[32\\], expected \\[16\\]: use the smallest bucket"),
    (L.check_bucketed_predict, bucketed_off_by_one, "a batch of 4 ran at sizes \\[16\\], expected \\[4\\].*exactly n rows holds n"),
    (L.check_bucketed_predict, bucketed_keeping_padding, "returned 16 rows, the padding rows' outputs too"),
    (L.check_bucketed_predict, bucketed_without_chunks, "a batch of 70 ran at size 70, which is larger than the largest bucket \\(32\\): run it in chunks of 32"),
    (L.check_bucketed_predict, bucketed_last_chunk_unpadded, "a batch of 70 ran the model at size 6, not a bucket size.*the last one too"),
    (L.check_bucketed_predict, bucketed_front_padding_first_rows, "wrong values"),
    (L.check_bucketed_predict, bucketed_row_by_row, "a batch of 5 ran the model at size 1, not a bucket size"),
    (L.check_bucketed_predict, bucketed_equal_chunks, "a batch of 70 ran the model at sizes \\[32, 32, 32\\], expected \\[32, 32, 16\\]"),
    (L.check_bucketed_predict, bucketed_float64_padding, "raised RuntimeError"),
    # compile_repeated_blocks
    (L.check_compile_repeated_blocks, stacks_by_compiling_the_model, "you compiled the whole model"),
    (L.check_compile_repeated_blocks, stacks_wrong(kinds=(nn.ModuleList,)), r"the blocks of decoder \(2 _DecoderBlocks\) were not compiled: a stack can be an nn.Sequential"),
    (L.check_compile_repeated_blocks, stacks_wrong(top_level=True), r"the blocks of encoder.layers \(3 _EncoderBlocks\) were not compiled: look at every module, at any depth"),
    (L.check_compile_repeated_blocks, stacks_wrong(same_class=False), r"you compiled heads.0: heads holds modules of different classes \(Linear, Sequential\)"),
    (L.check_compile_repeated_blocks, stacks_wrong(at_least=1, same_class=False, kinds=(nn.ModuleList,)), r"you compiled refine.0: refine holds a single module: nothing repeats"),
    (L.check_compile_repeated_blocks, stacks_wrong(compile_container=True), "you compiled the stack encoder.layers as one module"),
    (L.check_compile_repeated_blocks, stacks_wrong(ret="model"), r"returned .*Net, expected a list of names, \['encoder.layers', 'decoder'\]"),
    (L.check_compile_repeated_blocks, stacks_wrong(ret="blocks"), "the names of the stacks \\(the containers\\), not of their blocks"),
    (L.check_compile_repeated_blocks, stacks_wrong(order=lambda names: sorted(names)), r"returned \['decoder', 'encoder.layers'\].*in the order model.named_modules\(\) visits them"),
    (L.check_compile_repeated_blocks, stacks_replaced_by_wrappers, r"state_dict keys changed \(e.g. 'encoder.layers.0._orig_mod.norm.weight'\)"),
    (L.check_compile_repeated_blocks, stacks_class_patched, "you changed the class _EncoderBlock itself"),
    (L.check_compile_repeated_blocks, stacks_wrong(at_least=1), r"you compiled refine.0: refine holds a single module: nothing repeats"),
    (L.check_compile_repeated_blocks, stacks_in_a_new_model, r"returned .*Sequential, expected a list of names"),
    (L.check_compile_repeated_blocks, stacks_compiled_twice, "torch.compile was called 10 times for 5 blocks: compile each block once"),
    (L.check_compile_repeated_blocks, lambda model: [], "the blocks of encoder.layers \\(3 _EncoderBlocks\\) were not compiled"),
]


@pytest.mark.parametrize("check, wrong, message", WRONG, ids=lambda v: getattr(v, "exercise_name", None) or getattr(v, "__name__", None) if callable(v) else None)
def test_wrong_answers_name_the_fault(check, wrong, message):
    assert_names_fault(check, wrong, message)


@pytest.mark.parametrize("check", [c for c, _ in PAIRS], ids=lambda c: c.exercise_name)
def test_each_check_is_tested_enough(check):
    """The bar: at least 3 correct alternatives and 8 typical wrong answers per check."""
    assert sum(c is check for c, _ in ALTERNATIVES) >= 3
    assert sum(c is check for c, _, _ in WRONG) >= 8


RAISING = [  # errors inside the learner's code: one line, arguments named briefly
    (L.check_compile_for_serving, lambda model, example, mode: model(example, example),
     r"^compile_for_serving: <lambda>\(model, example of shape \(5, 6\), mode='reduce-overhead'\) raised TypeError"),
    (L.check_masked_mean_pool, lambda h, mask: h @ mask, r"^masked_mean_pool: <lambda>\(h \(3, 5, 4\) with a partly padded row.*\) raised RuntimeError"),
    (L.check_compile_with_eager_monitors, lambda model: model.missing, r"^compile_with_eager_monitors: <lambda>\(a model with 2 ActivationMonitors\) raised AttributeError"),
    (L.check_bucketed_predict, lambda model, batch, buckets: model(batch[:, :2]), r"^bucketed_predict: <lambda>\(model, batch of shape \(5, 5\), buckets=\(4, 16, 32\)\) raised RuntimeError"),
    (L.check_compile_repeated_blocks, lambda model: model.blocks[0], r"^compile_repeated_blocks: <lambda>\(a model with stacks of repeated blocks\) raised AttributeError"),
]


@pytest.mark.parametrize("check, wrong, message", RAISING)
def test_errors_inside_the_learners_code_are_one_short_line(check, wrong, message):
    with pytest.raises(ExerciseFailed, match=message) as info:
        check(wrong)
    assert "\n" not in str(info.value) and len(str(info.value)) < 300


def test_a_batch_of_one_in_train_mode_names_batch_norm():
    """The hidden batch of 1 tells a warm-up in train mode by batch norm's own error."""
    def warm_before_eval(model, example, mode):
        compiled = torch.compile(model, mode=mode, fullgraph=True)
        if len(example) == 1:
            with torch.no_grad():
                compiled(example)
        model.eval()
        with torch.no_grad():
            compiled(example)
        return compiled

    with pytest.raises(ExerciseFailed, match="example of shape \\(1, 6\\).*batch norm in train mode cannot normalise a batch of 1"):
        L.check_compile_for_serving(warm_before_eval)


@pytest.mark.parametrize("check, reference", PAIRS, ids=[r.__name__ for _, r in PAIRS])
def test_checks_leave_the_learners_state_alone(check, reference):
    """The checks restore the global RNG, torch.compile itself and Dynamo's log level, however they end."""
    compile_before = torch.compile
    level_before = logging.getLogger("torch._dynamo").level
    for answer in (reference, lambda *args: None):
        torch.manual_seed(7)
        expected = torch.rand(3)
        torch.manual_seed(7)
        try:
            check(answer)
        except ExerciseFailed:
            pass
        assert torch.equal(torch.rand(3), expected)
        assert torch.compile is compile_before
        assert logging.getLogger("torch._dynamo").level == level_before


def test_a_check_undoes_a_class_patch():
    """An answer that patches ActivationMonitor (or a block class) for everyone fails, and the class is put back."""
    forward = L.ActivationMonitor.__dict__["forward"]
    with pytest.raises(ExerciseFailed):
        L.check_compile_with_eager_monitors(monitors_disabled_on_the_class)
    assert L.ActivationMonitor.__dict__["forward"] is forward
    block_forward = L._EncoderBlock.__dict__["forward"]
    with pytest.raises(ExerciseFailed):
        L.check_compile_repeated_blocks(stacks_class_patched)
    assert L._EncoderBlock.__dict__["forward"] is block_forward


@pytest.mark.parametrize("check, reference", PAIRS, ids=[r.__name__ for _, r in PAIRS])
def test_checks_pass_again_and_again(check, reference):
    """Each check compiles with a backend of its own; run past Dynamo's recompile limit, they still judge the same."""
    with torch._dynamo.config.patch(recompile_limit=2):  # a low limit, to reach it in a few runs
        for _ in range(3):
            check(reference)


def test_the_stand_in_keeps_torch_compiles_contract():
    """What torch.compile rejects, the checks' stand-in rejects with the same error; what it accepts, it accepts."""
    spy = L._CompileSpy()
    model = nn.Linear(2, 2)
    for kwargs in ({"mode": "fast"}, {"mode": "default", "options": {"max_autotune": True}}, {"options": {"no_such_option": 1}}):
        with pytest.raises(Exception) as real:
            torch.compile(model, **kwargs)
        with spy.watching(), pytest.raises(type(real.value)) as spied:
            torch.compile(model, **kwargs)
        assert str(spied.value) == str(real.value)
    with spy.watching():
        for mode in ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"):
            torch.compile(model, mode=mode, fullgraph=True)(torch.randn(3, 2))

        @torch.compile(fullgraph=True, mode="max-autotune")
        def double(x):
            return x * 2

        double(torch.randn(3))
    assert [kwargs.get("mode") for _, kwargs in spy.calls] == ["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs", "max-autotune"]
    assert all(kwargs["fullgraph"] for _, kwargs in spy.calls)
    torch.compiler.reset()


def test_references_behave_as_the_lesson_says():
    """The notebook's claims about the references: same values as the function with breaks, one graph, three graphs."""
    for h, mask, _ in L._pool_cases():
        assert torch.allclose(L.masked_mean_pool(h, mask), pool_with_breaks(h, mask), atol=1e-6)
    torch.compiler.reset()
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    h, mask, _ = L._pool_cases()[0]
    torch.compile(L.masked_mean_pool, backend=counting, fullgraph=True)(h, mask)
    assert len(graphs) == 1
    graphs.clear()
    torch.compiler.reset()
    net = L._MonitoredNet()
    for monitor in monitors_of(net):
        monitor.forward = torch.compiler.disable(monitor.forward)
    torch.compile(net, backend=counting)(torch.randn(3, 6))
    assert len(graphs) == 3  # a break at each of the two monitors
    torch.compiler.reset()


def test_break_even_and_the_tradeoff_figure():
    assert L.break_even_calls(1.0, 0.003, 0.001) == pytest.approx((1.0 - 0.001) / 0.002)
    assert L.break_even_calls(1.0, 0.001, 0.002) is None
    assert L.break_even_calls(0.0, 0.003, 0.001) == 1.0
    fig = L.plot_compile_tradeoff({"a": (1.0, 0.003, 0.001), "b": (0.5, 0.001, 0.002)})
    assert len(fig.axes) == 2
    assert "pays back after 500 calls" in fig.axes[0].get_title()
    assert "never pays back" in fig.axes[1].get_title()


NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "solutions" / "07_compile.ipynb"


def test_non_default_modes_run_only_in_gpu_cells():
    """reduce-overhead and max-autotune gain nothing on a CPU and cost a long compile: GPU cells only."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code" and ("reduce-overhead" in cell.source or "max-autotune" in cell.source):
            assert "gpu" in cell.metadata.get("tags", []) and cell.source.startswith("%%gpu"), cell.source[:80]


def test_private_apis_are_labelled_private():
    """Every torch._dynamo, torch._functorch or torch._inductor name the notebook's code uses is called private in its text."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    text = " ".join(c.source for c in nb.cells if c.cell_type == "markdown")
    for module in ("torch._dynamo", "torch._functorch", "torch._inductor"):
        if any(module in c.source for c in nb.cells if c.cell_type == "code"):
            assert module in text
    assert text.count("private") >= 5


def test_the_monitor_records_python_floats_and_passes_its_input_through():
    monitor = L.ActivationMonitor()
    h = torch.tensor([[1.0, -3.0], [-2.0, 0.5]])
    assert monitor(h) is h
    assert monitor.records == [[2.0, 3.0]] and all(type(v) is float for v in monitor.records[0])


def test_the_checks_share_the_notebooks_monitor_class():
    """The checker loads a fresh copy of lesson07; the monitor class must stay the one the notebook imports."""
    from course_utils.monitors import ActivationMonitor
    from course_utils.tooling.checkcell import fresh_lesson

    assert fresh_lesson("07").ActivationMonitor is ActivationMonitor


def test_a_break_in_a_loop_skips_only_that_frame():
    """What section 4 teaches: a break in a loop leaves that frame eager, but a function it calls is compiled whole."""
    layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(3))
    log = torch.compiler.disable(lambda h: None)

    def body(layer, h):
        return torch.tanh(layer(h)) * 2

    def inline(x):
        for layer in layers:
            x = torch.tanh(layer(x)) * 2
            log(x)
        return x.sum()

    def calling(x):
        for layer in layers:
            x = body(layer, x)
            log(x)
        return x.sum()

    graphs = {}
    for fn in (inline, calling):
        torch.compiler.reset()
        ops = []

        def counting(gm, example_inputs):
            ops.append([getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes if n.op == "call_function"])
            return gm.forward

        torch.compile(fn, backend=counting)(torch.randn(4, 6))
        graphs[fn.__name__] = ops
    torch.compiler.reset()
    assert graphs["inline"] == []
    assert graphs["calling"] and all(g == ["linear", "tanh", "mul"] for g in graphs["calling"])


def test_the_stances_the_lesson_shows():
    """set_stance: force_eager captures nothing; fail_on_recompile runs cached graphs and refuses a new size."""
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compiler.reset()
    compiled = torch.compile(lambda x: torch.tanh(x) * 2 + 1, backend=counting, dynamic=False)
    with torch.compiler.set_stance("force_eager"):
        compiled(torch.randn(8, 4))
    assert graphs == []
    compiled(torch.randn(8, 4))
    with torch.compiler.set_stance("fail_on_recompile"):
        compiled(torch.randn(8, 4))
        with pytest.raises(RuntimeError, match="Detected recompile when torch.compile stance is 'fail_on_recompile'"):
            compiled(torch.randn(16, 4))
    assert len(graphs) == 1
    torch.compiler.reset()


def test_core_aten_is_a_small_part_of_aten():
    """The counts the lesson prints come from the dispatcher: core ATen operators are a small subset of ATen's."""
    names = [n for n in torch._C._dispatch_get_all_op_names() if n.startswith("aten::")]
    bases = {n.split("::")[1].split(".")[0] for n in names}
    core = {op for op in bases if any(torch.Tag.core in getattr(getattr(torch.ops.aten, op), ov).tags
                                      for ov in getattr(torch.ops.aten, op).overloads())}
    assert len(bases) > 1000 and 100 < len(core) < 300
    assert {"addmm", "permute", "sigmoid", "mul", "native_layer_norm"} <= core and not {"linear", "silu", "layer_norm"} & core
