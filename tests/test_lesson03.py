"""Lesson 03's checks against the reference solutions and the wrong answers learners write."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from course_utils import lesson03 as L
from lesson_contract import assert_names_fault, contract_tests

PAIRS = [
    (L.check_make_mlp, L.make_mlp),
    (L.check_count_trainable, L.count_trainable),
    (L.check_freeze_all_but_last, L.freeze_all_but_last),
    (L.check_init_weights, L.init_weights),
    (L.check_make_residual, L.make_residual),
    (L.check_attention, L.attention),
    (L.check_load_partial, L.load_partial),
]


(test_reference_passes, test_stub_is_not_attempted, test_bad_input_is_one_named_line, test_hostile_answers_are_the_learners_fault,
 test_checks_leave_the_learners_random_state_alone, test_checks_are_quick) = contract_tests(PAIRS)


# Wrong answers, exercise by exercise.

class FunctionalMLP(nn.Module):
    """A correct alternative: a class with F.relu in forward."""

    def __init__(self, i, h, o):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(i, h), nn.Linear(h, o)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


def freeze_last_param(model):
    model.requires_grad_(False)
    list(model.parameters())[-1].requires_grad_(True)


def freeze_last_module(model):
    model.requires_grad_(False)
    list(model.modules())[-1].requires_grad_(True)


def freeze_a_copy(model):
    other = copy.deepcopy(model)
    L.freeze_all_but_last(other)
    return other


def init_unguarded(module):
    nn.init.xavier_uniform_(module.weight)
    nn.init.zeros_(module.bias)


def init_ignoring_bias_false(module):
    if isinstance(module, nn.Linear):
        nn.init.xavier_uniform_(module.weight)
        nn.init.zeros_(module.bias)


def init_anything_with_weight(module):
    if hasattr(module, "weight"):
        nn.init.xavier_uniform_(module.weight)


def init_layernorm_too(module):
    L.init_weights(module)
    if isinstance(module, nn.LayerNorm):
        nn.init.normal_(module.weight)


def init_with(fill, zero_bias=True):
    def init(module):
        if isinstance(module, nn.Linear):
            fill(module.weight)
            if zero_bias and module.bias is not None:
                nn.init.zeros_(module.bias)

    return init


def residual(*, skip=True, relu_between=True, relu_after=False, padding=1, n_convs=2, in_place=False, bias=True):
    """A make_residual variant with one of the typical mistakes."""

    def make(c):
        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                self.convs = nn.ModuleList(nn.Conv2d(c, c, 3, padding=padding, bias=bias) for _ in range(n_convs))

            def forward(self, x):
                h = x
                for i, conv in enumerate(self.convs):
                    h = conv(h)
                    if relu_between and i < len(self.convs) - 1:
                        h = torch.relu(h)
                if in_place:
                    x += h
                    return x
                out = x + h if skip else h
                return torch.relu(out) if relu_after else out

        return Block()

    return make


def attention_scaled(scale, dim=-1):
    def attention(q, k, v):
        return (q @ k.transpose(-2, -1) * scale(q, v)).softmax(dim=dim) @ v

    return attention


WRONG = [
    (L.check_make_mlp, lambda i, h, o: nn.Sequential(nn.Linear(i, h), nn.Linear(h, o)), "no ReLU between"),
    (L.check_make_mlp, lambda i, h, o: nn.Sequential(nn.Linear(i, h), nn.ReLU(), nn.Linear(h, o), nn.ReLU()), "ends with a ReLU"),
    (L.check_make_mlp, lambda i, h, o: nn.Sequential(nn.Linear(i, o)), r"1 Linear layer\(s\), expected 2: Linear\(5, 7\), Linear\(7, 3\)"),
    (L.check_make_mlp, lambda i, h, o: nn.Sequential(nn.Linear(i, h), nn.ReLU(), nn.Linear(o, h)), r"has Linear\(5, 7\), Linear\(3, 7\), expected"),
    (L.check_make_mlp, lambda i, h, o: nn.Sequential(nn.Linear(i, h, bias=False), nn.ReLU(), nn.Linear(h, o, bias=False)), "no bias"),
    (L.check_make_mlp, lambda i, h, o: nn.Sequential(nn.Linear(i, h), nn.Sigmoid(), nn.Linear(h, o)), "wrong values"),
    (L.check_make_mlp, lambda i, h, o: nn.Sequential, "is the class Sequential, expected an instance"),
    (L.check_make_mlp, lambda i, h, o: None, "is None"),
    (L.check_make_mlp, FunctionalMLP, None),  # a correct alternative
    (L.check_count_trainable, lambda m: sum(p.numel() for p in m.parameters()), "frozen parameters too"),
    (L.check_count_trainable, lambda m: sum(p.numel() for p in m.parameters() if not p.requires_grad), "instead of the trainable"),
    (L.check_count_trainable, lambda m: len(list(m.parameters())), "parameter tensors, not numbers"),
    (L.check_count_trainable, lambda m: sum(1 for p in m.parameters() if p.requires_grad), "parameter tensors, not numbers"),
    (L.check_count_trainable, lambda m: sum(t.numel() for t in m.state_dict().values()), "counted buffers too"),
    (L.check_count_trainable, lambda m: sum(p.numel() for layer in m for p in layer.parameters() if p.requires_grad), "shared layer twice"),
    (L.check_count_trainable, lambda m: torch.tensor(L.count_trainable(m)), r"call \.item\(\)"),
    (L.check_count_trainable, lambda m: None, "is None"),
    (L.check_count_trainable, lambda m: sum(p.numel() for _, p in m.named_parameters() if p.requires_grad), None),
    (L.check_freeze_all_but_last, lambda m: None, "nothing is frozen"),
    (L.check_freeze_all_but_last, lambda m: m.requires_grad_(False), "every parameter is frozen"),
    (L.check_freeze_all_but_last, freeze_last_param, "only 4.bias is trainable"),
    (L.check_freeze_all_but_last, freeze_last_module, "head.0.weight is frozen, but it belongs to the last child `head`"),
    (L.check_freeze_all_but_last, freeze_a_copy, "returned another model"),
    (L.check_freeze_all_but_last, lambda m: list(m.children())[0].requires_grad_(False), "2.weight.requires_grad is True, expected False"),
    (L.check_init_weights, init_unguarded, r"no attribute 'weight': model.apply calls it on every module"),
    (L.check_init_weights, init_ignoring_bias_false, "bias=False has module.bias = None"),
    (L.check_init_weights, init_anything_with_weight, "a LayerNorm's is 1-D"),
    (L.check_init_weights, init_layernorm_too, "changed a LayerNorm"),
    (L.check_init_weights, lambda m: None, "default init"),
    (L.check_init_weights, init_with(lambda w: nn.init.kaiming_normal_(w, nonlinearity="relu")), "kaiming"),
    (L.check_init_weights, init_with(nn.init.xavier_uniform_, zero_bias=False), "bias is not all zeros"),
    (L.check_init_weights, init_with(nn.init.normal_), r"expected mean 0 and std about 0\.0577"),
    (L.check_init_weights, init_with(nn.init.xavier_normal_), None),  # a correct alternative
    (L.check_make_residual, residual(skip=False), r"returns f\(x\) alone"),
    (L.check_make_residual, residual(relu_after=True), "ReLU after the addition"),
    (L.check_make_residual, residual(relu_between=False), "no ReLU between the two convolutions"),
    (L.check_make_residual, residual(padding=0), "use padding=1"),
    (L.check_make_residual, residual(in_place=True), "modified its input in place"),
    (L.check_make_residual, residual(n_convs=1), r"1 Conv2d layer\(s\), expected 2"),
    (L.check_make_residual, residual(bias=False), "convolutions have no bias"),
    (L.check_make_residual, lambda c: nn.Conv2d, "is the class Conv2d"),
    (L.check_make_residual, residual(padding="same"), None),  # a correct alternative
    (L.check_attention, attention_scaled(lambda q, v: 1.0), "not scaled"),
    (L.check_attention, attention_scaled(lambda q, v: 1 / q.shape[-1]), "divided by d"),
    (L.check_attention, attention_scaled(lambda q, v: 1 / math.sqrt(q.shape[-1]), dim=-2), r"wrong dimension.*softmax\(dim=-1\)"),
    (L.check_attention, attention_scaled(lambda q, v: 1 / math.sqrt(v.shape[-1])), "uses v's size"),
    (L.check_attention, lambda q, k, v: (L.attention(q, k, v), None), "tuple of 2"),
    (L.check_attention, lambda q, k, v: (q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])) @ v, "wrong values"),
    (L.check_attention, F.scaled_dot_product_attention, None),  # a correct alternative
    (L.check_load_partial, lambda m, sd: m.load_state_dict(sd).missing_keys, "pass strict=False"),
    (L.check_load_partial, lambda m, sd: m.load_state_dict(sd, strict=False), "whole result"),
    (L.check_load_partial, lambda m, sd: m.load_state_dict(sd, strict=False).unexpected_keys, "unexpected keys"),
    (L.check_load_partial, lambda m, sd: [k for k in m.state_dict() if k not in sd], "is not the checkpoint's"),
    (L.check_load_partial, lambda m, sd: copy.deepcopy(m).load_state_dict(sd, strict=False).missing_keys, "is not the checkpoint's"),
    (L.check_load_partial, lambda m, sd: set(m.load_state_dict(sd, strict=False).missing_keys), r"is a set \(.*\), expected a list"),
    (L.check_load_partial, lambda m, sd: m.load_state_dict(sd, strict=False) and None, "is None"),
    (L.check_load_partial, lambda m, sd: sorted(m.load_state_dict(sd, strict=False).missing_keys), None),  # order does not matter
]


@pytest.mark.parametrize("check, wrong, message", WRONG)
def test_wrong_answers_name_the_fault(check, wrong, message):
    assert_names_fault(check, wrong, message)
