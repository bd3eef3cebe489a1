"""Lesson 03 (nn.Module): reference solutions and the checks for its exercises."""

import itertools
import math
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from course_utils.tooling.checks import (
    ExerciseFailed,
    a_type,
    call,
    exercise,
    expect_module,
    expect_tensor,
    expect_unchanged,
    scoreboard_for,
)
from course_utils.tooling.language import N_, _

scoreboard = scoreboard_for(__name__)  # the lesson's last cell: this session's verdicts


@contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Build the hidden test models from a fixed seed (@exercise keeps the notebook's random state untouched)."""
    torch.manual_seed(seed)
    yield


# Reference solutions. The checks compare the learner's answers with these.

def layer_shapes(model: nn.Sequential, input_shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The output shape of each layer of model for an input of input_shape, worked out from the layers' settings."""

    def pair(value):
        return tuple(value) if isinstance(value, (tuple, list)) else (value, value)

    shape, shapes = list(input_shape), []
    for layer in model:
        if isinstance(layer, (nn.Conv2d, nn.MaxPool2d, nn.AvgPool2d)):
            kernel, stride, padding = pair(layer.kernel_size), pair(layer.stride), pair(layer.padding)
            dilation = pair(getattr(layer, "dilation", 1))  # AvgPool2d has no dilation
            for i, dim in enumerate((-2, -1)):
                span = dilation[i] * (kernel[i] - 1) + 1
                shape[dim] = (shape[dim] + 2 * padding[i] - span) // stride[i] + 1
            if isinstance(layer, nn.Conv2d):
                shape[-3] = layer.out_channels
        elif isinstance(layer, nn.Flatten):
            start, end = layer.start_dim % len(shape), layer.end_dim % len(shape)
            shape[start : end + 1] = [math.prod(shape[start : end + 1])]
        elif isinstance(layer, nn.Linear):
            shape[-1] = layer.out_features
        shapes.append(tuple(shape))
    return shapes


def freeze_all_but_last(model: nn.Module) -> None:
    """Freeze every parameter of model except those of its last child module, in place."""
    model.requires_grad_(False)
    list(model.children())[-1].requires_grad_(True)


def init_relu_net(model: nn.Module) -> None:
    """Kaiming-normal weights (fan_in, for ReLU) and zero biases in every Conv2d and Linear of model, in place."""
    for module in model.modules():
        if isinstance(module, (nn.Conv2d, nn.Linear)):
            nn.init.kaiming_normal_(module.weight, mode="fan_in", nonlinearity="relu")
            if module.bias is not None:
                nn.init.zeros_(module.bias)


def make_causal_attention(embed_dim: int, num_heads: int, max_len: int) -> nn.Module:
    """Causal multi-head self-attention: (N, L, E) -> (N, L, E), with a fused qkv projection and a mask buffer."""

    class CausalSelfAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(embed_dim, 3 * embed_dim)
            self.proj = nn.Linear(embed_dim, embed_dim)
            allowed = torch.ones(max_len, max_len, dtype=torch.bool).tril()  # query i may see keys j <= i
            self.register_buffer("allowed", allowed, persistent=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            n, length, _ = x.shape
            head_dim = embed_dim // num_heads
            q, k, v = (t.view(n, length, num_heads, head_dim).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
            scores = q @ k.transpose(-2, -1) / math.sqrt(head_dim)
            scores = scores.masked_fill(~self.allowed[:length, :length], float("-inf"))
            heads = scores.softmax(dim=-1) @ v
            return self.proj(heads.transpose(1, 2).reshape(n, length, embed_dim))

    return CausalSelfAttention()


def make_norm_block(f: nn.Module, dim: int, norm_first: bool) -> nn.Module:
    """A residual block around the sublayer f with a LayerNorm(dim) of its own: x + f(norm(x)) if norm_first, else norm(x + f(x))."""

    class NormBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.f = f
            self.norm = nn.LayerNorm(dim)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if norm_first:
                return x + self.f(self.norm(x))  # pre-norm (GPT-2 onward): the skip path stays untouched
            return self.norm(x + self.f(x))  # post-norm (the original Transformer)

    return NormBlock()


def evaluate(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """The accuracy of model over batches, in eval mode and without a graph; every module keeps the mode it had."""
    modes = {module: module.training for module in model.modules()}
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for inputs, labels in batches:
            correct += (model(inputs).argmax(dim=-1) == labels).sum().item()
            total += len(labels)
    for module, training in modes.items():
        module.training = training
    return correct / total


def load_pretrained(make_model: Callable[[], nn.Module], path: str) -> nn.Module:
    """The model make_model() builds, filled from the checkpoint at path without allocating twice or copying; what the file lacks, new."""
    with torch.device("meta"):
        model = make_model()
    checkpoint = torch.load(path, mmap=True, weights_only=True)
    missing = model.load_state_dict(checkpoint, strict=False, assign=True).missing_keys
    for name in {key.rpartition(".")[0] for key in missing}:
        layer = model.get_submodule(name)
        layer.to_empty(device="cpu")
        layer.reset_parameters()
    return model


# Checks, one per exercise, in notebook order.

# ---- layer_shapes -------------------------------------------------------------------------------

# The messages are translated when they are shown; N_ marks them for the catalog.
_NO_BATCH = N_("the shapes leave out the batch dimension: keep it first, as model(x) does")
_SHAPE_MISTAKES = {
    "channels": N_("the channel count does not change at a Conv2d: its output has out_channels channels"),
    "dilation": N_("the shapes ignore dilation: with dilation d, a kernel of size k spans d * (k - 1) + 1 pixels"),
    "square": N_("the width uses the height's setting: kernel_size, stride, padding and dilation may be pairs "
                 "(height, width), so read each dimension's own value"),
    "ceil": N_("the sizes are rounded up: PyTorch rounds the division down (floor, //)"),
    "linear": N_("a Linear replaced every dimension after the batch: it acts on the last dimension only, the others pass through"),
    "flatten": N_("Flatten merged every dimension after the batch: it merges its start_dim to its end_dim "
                  "(Flatten(start_dim=2) keeps the channels apart)"),
    "end_dim": N_("Flatten merged every dimension from its start_dim to the last: it stops at its end_dim "
                  "(Flatten(1, 2) turns (N, C, H, W) into (N, C * H, W))"),
    "pool dilation": N_("the pooling shapes ignore dilation: MaxPool2d has a dilation too, which spreads its window "
                        "as a Conv2d's (AvgPool2d has none)"),
}


def _predict(model: nn.Sequential, input_shape: tuple[int, ...], fault: str | None = None) -> list[tuple[int, ...]]:
    """The shapes layer_shapes should return, or, with `fault`, what one typical mistake returns."""

    def pair(value):
        value = tuple(value) if isinstance(value, (tuple, list)) else (value, value)
        return (value[0], value[0]) if fault == "square" else value

    shape, shapes = list(input_shape), []
    for layer in model:
        if isinstance(layer, (nn.Conv2d, nn.MaxPool2d, nn.AvgPool2d)):
            kernel, stride, padding = pair(layer.kernel_size), pair(layer.stride), pair(layer.padding)
            ignored = fault == "dilation" or (fault == "pool dilation" and not isinstance(layer, nn.Conv2d))
            dilation = (1, 1) if ignored else pair(getattr(layer, "dilation", 1))
            for i, dim in enumerate((-2, -1)):
                top = shape[dim] + 2 * padding[i] - dilation[i] * (kernel[i] - 1) - 1
                shape[dim] = (-(-top // stride[i]) if fault == "ceil" else top // stride[i]) + 1
            if isinstance(layer, nn.Conv2d) and fault != "channels":
                shape[-3] = layer.out_channels
        elif isinstance(layer, nn.Flatten):
            start, end = (1, -1) if fault == "flatten" else (layer.start_dim, -1 if fault == "end_dim" else layer.end_dim)
            start, end = start % len(shape), end % len(shape)
            shape[start : end + 1] = [math.prod(shape[start : end + 1])]
        elif isinstance(layer, nn.Linear):
            shape = shape[:1] + [layer.out_features] if fault == "linear" else shape[:-1] + [layer.out_features]
        shapes.append(tuple(shape))
    return shapes


def _shape_models() -> list[tuple[nn.Sequential, tuple[int, ...], str]]:
    """Hidden models: pairs of settings, dilation (of a pool too), padded and default-stride pooling, Flatten(start_dim=2),
    Flatten(1, 2), batch of 1."""
    first = nn.Sequential(
        nn.Conv2d(3, 10, kernel_size=(3, 5), stride=(2, 1), padding=(1, 2)), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(10, 12, 3, dilation=2), nn.BatchNorm2d(12), nn.AvgPool2d(3, stride=2, padding=1),
        nn.Dropout(0.2), nn.Flatten(), nn.Linear(216, 11),
    )
    second = nn.Sequential(
        nn.Conv2d(2, 4, kernel_size=5, stride=3), nn.MaxPool2d((2, 3)), nn.Flatten(start_dim=2), nn.Linear(30, 7), nn.ReLU(),
    )
    third = nn.Sequential(
        nn.Conv2d(1, 6, kernel_size=(4, 3), stride=2, padding=(0, 3), dilation=(1, 2)), nn.ReLU(),
        nn.MaxPool2d(3, stride=1, padding=1), nn.AvgPool2d((3, 2)), nn.Flatten(), nn.Linear(54, 13),
    )
    fourth = nn.Sequential(
        nn.Conv2d(3, 5, 3, padding=2), nn.MaxPool2d(3, stride=2, dilation=2), nn.Flatten(1, 2), nn.Linear(11, 6),
    )
    return [
        (first, (2, 3, 37, 30), _("a 9-layer CNN")),
        (second, (1, 2, 41, 50), _("a CNN ending in Flatten(start_dim=2), Linear")),
        (third, (3, 1, 20, 9), _("a CNN with a dilated (4, 3) kernel")),
        (fourth, (2, 3, 17, 23), _("a CNN with a dilated MaxPool2d and Flatten(1, 2)")),
    ]


def _refuse_to_run(module: nn.Module, args: tuple) -> None:
    raise RuntimeError(_("layer_shapes must not run the model or its layers: work out each shape from the layers' settings"))


def _run_shapes(model: nn.Sequential, input_shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The real shapes, by running the layers once (the check's ground truth)."""
    model.eval()
    x, shapes = torch.zeros(input_shape), []
    with torch.no_grad():
        for layer in model:
            x = layer(x)
            shapes.append(tuple(x.shape))
    return shapes


def _as_shapes(got: Any, what: str, n_layers: int, input_shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The learner's answer as a list of tuples of ints, or a one-line failure saying what it is instead."""
    if got is None:
        raise ExerciseFailed(_("{what} is None: did you forget to `return` the list?").format(what=what))
    if isinstance(got, tuple) and all(isinstance(n, int) for n in got):
        raise ExerciseFailed(_("{what} is a single shape {shape}: return a list with one shape per layer").format(what=what, shape=tuple(got)))
    if not isinstance(got, list):
        raise ExerciseFailed(_("{what} is {a_type}, expected a list of shapes, one per layer").format(what=what, a_type=a_type(got)))
    if len(got) == n_layers + 1 and got[0] == tuple(input_shape):
        raise ExerciseFailed(
            _("{what} starts with the input's shape: list only what each of the {n_layers} layers returns").format(what=what, n_layers=n_layers)
        )
    if len(got) != n_layers:
        raise ExerciseFailed(_("{what} has {n} shapes, expected {n_layers}, one per layer").format(what=what, n=len(got), n_layers=n_layers))
    for i, shape in enumerate(got):
        if isinstance(shape, torch.Tensor) or not isinstance(shape, tuple):
            raise ExerciseFailed(
                _("{what}[{i}] is {a_type}, expected a tuple of ints such as (2, 10, 19, 30)").format(what=what, i=i, a_type=a_type(shape))
            )
        for n in shape:
            if isinstance(n, bool) or not isinstance(n, int):
                hint = _(": use // (or int()) so sizes stay whole numbers") if isinstance(n, float) else ""
                raise ExerciseFailed(
                    _("{what}[{i}] = {shape!r} holds {a_type}, expected ints{hint}").format(what=what, i=i, shape=shape, a_type=a_type(n), hint=hint)
                )
    return [tuple(shape) for shape in got]


@exercise("layer_shapes")
def check_layer_shapes(fn) -> None:
    with _seeded(31):
        cases = _shape_models()
    answers = []
    for model, input_shape, shown in cases:
        what = f"layer_shapes({shown}, {input_shape})"
        handles = [m.register_forward_pre_hook(_refuse_to_run) for m in model.modules()]
        try:
            got = call(fn, model, input_shape, shown=f"{shown}, {input_shape}")
        finally:
            for handle in handles:
                handle.remove()
        expected = _run_shapes(model, input_shape)
        answers.append((model, input_shape, what, _as_shapes(got, what, len(model), input_shape), expected))
    if all(got[0] == expected[0][1:] for *_rest, got, expected in answers):
        raise ExerciseFailed(_(_NO_BATCH))
    # A typical mistake is named only when the answer matches it on every hidden model.
    for fault, message in _SHAPE_MISTAKES.items():
        predicted = [_predict(model, shape, fault) for model, shape, *_rest in answers]
        if predicted != [expected for *_rest, expected in answers] and predicted == [got for *_rest, got, _expected in answers]:
            raise ExerciseFailed(_(message))
    for model, _input_shape, what, got, expected in answers:
        for i, (mine, right) in enumerate(zip(got, expected)):
            if mine != right:
                raise ExerciseFailed(
                    _("{what}: the output of layer {i}, {layer!r}, has shape {expected}, got {got}").format(
                        what=what, i=i, layer=model[i], expected=right, got=mine)
                )


# ---- freeze_all_but_last ------------------------------------------------------------------------

class _BackboneHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU())
        self.temperature = nn.Parameter(torch.tensor([1.5]))  # registered on the model itself, in no child
        self.head = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x)) / self.temperature


def _freeze_cases() -> list[tuple[nn.Module, str, str]]:
    plain = nn.Sequential(nn.Linear(5, 9), nn.Tanh(), nn.Linear(9, 9), nn.Tanh(), nn.Linear(9, 4))
    model = _BackboneHead()
    with torch.no_grad():
        model.backbone[1].running_mean.uniform_(-1, 1)
    model.head[0].requires_grad_(False)  # frozen by the caller earlier: it must end up trainable
    model.eval()
    return [
        (plain, _("a Sequential of 5 layers"), "4"),
        (model, _("a model in eval mode with .backbone, .temperature and .head, whose head.0 was frozen"), "head"),
    ]


def _snapshot(model: nn.Module) -> dict[str, Any]:
    return {
        "modes": {name: m.training for name, m in model.named_modules()},
        "tensors": {name: t.detach().clone() for name, t in itertools.chain(model.named_parameters(), model.named_buffers())},
    }


def _expect_untouched(model: nn.Module, before: dict[str, Any], where: str) -> None:
    """Fail if model's modes, parameter or buffer values differ from the snapshot."""
    for name, training in before["modes"].items():
        now = model.get_submodule(name).training
        if now != training:
            label = f"'{name}'" if name else _("the model")
            if now:
                message = _("{where} {label} is in train mode, but it was in eval mode: leave the modes as they were")
            else:
                message = _("{where} {label} is in eval mode, but it was in train mode: leave the modes as they were")
            raise ExerciseFailed(message.format(where=where, label=label))
    now = dict(itertools.chain(model.named_parameters(), model.named_buffers()))
    for name, value in before["tensors"].items():
        if name not in now or not torch.equal(now[name].detach(), value):
            if name in dict(model.named_buffers()):
                raise ExerciseFailed(_("{where} the buffer {name} changed its values: leave them as they were").format(where=where, name=name))
            raise ExerciseFailed(_("{where} the parameter {name} changed its values: leave them as they were").format(where=where, name=name))


@exercise("freeze_all_but_last")
def check_freeze_all_but_last(fn) -> None:
    with _seeded(5):
        cases = _freeze_cases()
    for model, shown, last in cases:
        before = _snapshot(model)
        got = call(fn, model, shown=shown)
        flags = {name: p.requires_grad for name, p in model.named_parameters()}
        expected = {name: name.startswith(last + ".") for name in flags}
        trainable = [name for name, flag in flags.items() if flag]
        where = _("after {call},").format(call=f"freeze_all_but_last({shown})")
        if all(flags[name] for name in flags if not expected[name]):
            if isinstance(got, nn.Module) and got is not model:
                raise ExerciseFailed(
                    _("{where} nothing in it is frozen, and you returned another model: "
                      "change `model` itself (requires_grad_ works in place)").format(where=where)
                )
            raise ExerciseFailed(_("{where} nothing outside the last child is frozen: set requires_grad to False on those parameters").format(where=where))
        if not trainable:
            raise ExerciseFailed(
                _("{where} every parameter is frozen: the last child's parameters ({last}.*) must stay trainable").format(where=where, last=last)
            )
        if trainable == [list(flags)[-1]]:
            raise ExerciseFailed(
                _("{where} only {name} is trainable: list(model.parameters())[-1] is a single tensor, the last layer's bias; "
                  "every parameter of the last child (its weight too) must stay trainable").format(where=where, name=trainable[0])
            )
        frozen = next((name for name in flags if expected[name] and not flags[name]), None)
        if frozen:
            raise ExerciseFailed(
                _("{where} {name} is frozen, but it belongs to the last child `{last}` (list(model.children())[-1]): "
                  "every parameter of the last child must end up trainable, even one that was frozen before").format(where=where, name=frozen, last=last)
            )
        if flags.get("temperature"):
            raise ExerciseFailed(
                _("{where} temperature is still trainable: it is registered on the model itself, in no child, "
                  "so it is not part of the last child and must be frozen too").format(where=where)
            )
        wrong = next((name for name in flags if flags[name] != expected[name]), None)
        if wrong:
            raise ExerciseFailed(
                _("{where} {name}.requires_grad is {got}, expected {expected}").format(where=where, name=wrong, got=flags[wrong], expected=expected[wrong])
            )
        _expect_untouched(model, before, where)


# ---- init_relu_net ------------------------------------------------------------------------------

class _ReluNet(nn.Module):
    """Parts of a ReLU network; only the Conv2d and Linear layers are to be initialised."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(8, 40, (3, 5), padding=1, bias=False)  # fan_in 120, fan_out 600
        self.norm = nn.BatchNorm2d(40)
        self.conv = nn.Conv2d(40, 24, 3)  # fan_in 360, fan_out 216
        self.embed = nn.Embedding(30, 16)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(240, 100), nn.ReLU(), nn.LayerNorm(100), nn.Linear(100, 64))
        self.temperature = nn.Parameter(torch.randn(8, 8))  # registered on the model itself: not a layer's weight


def _relu_net() -> nn.Module:
    model = _ReluNet()
    with torch.no_grad():
        model.norm.weight.uniform_(0.5, 1.5)
        model.norm.bias.uniform_(-0.5, 0.5)
        model.norm.running_mean.uniform_(-1, 1)
        model.norm.running_var.uniform_(0.5, 2)
        model.head[3].weight.uniform_(0.5, 1.5)
    model.stem.requires_grad_(False)  # a frozen layer is initialised all the same
    return model


_INIT_HINTS = {  # the advice is translated when it is shown (checks.error_hint)
    "'NoneType'": N_("a layer made with bias=False has bias = None; skip it with `if module.bias is not None`"),
    "fewer than 2 dimensions": N_("kaiming needs a weight of 2 or more dimensions; only Conv2d and Linear weights are to be initialised"),
    "a leaf Variable that requires grad": N_("fill parameters inside `with torch.no_grad():` (the torch.nn.init functions do that for you)"),
    "has no attribute 'weight'": N_("not every module has a weight: act only on Conv2d and Linear layers"),
}


def _ks_normal(z: torch.Tensor) -> float:
    """Kolmogorov-Smirnov distance between the values z and the standard normal distribution."""
    z = z.detach().double().flatten().sort().values
    n = z.numel()
    cdf = 0.5 * (1 + torch.erf(z / math.sqrt(2)))
    rank = torch.arange(1, n + 1, dtype=torch.float64)
    return max((rank / n - cdf).max().item(), (cdf - (rank - 1) / n).max().item())


def _fan_in(weight: torch.Tensor) -> int:
    return math.prod(weight.shape[1:])


def _kaiming_fault(name: str, weight: torch.Tensor) -> str | None:
    """What is wrong with one layer's weights, or None when they follow N(0, 2 / fan_in)."""
    fan_in, fan_out = _fan_in(weight), weight.shape[0] * math.prod(weight.shape[2:])
    target = math.sqrt(2 / fan_in)
    w = weight.detach().double().flatten()
    if not torch.isfinite(w).all():
        return _("{name}'s weights hold NaN or inf").format(name=name)
    std = w.std().item()
    limit = 2.2 / math.sqrt(w.numel())  # a true normal sample of this size exceeds this KS distance with p ≈ 1e-4
    if _ks_normal(w / target) < limit and abs(std / target - 1) < 0.05:
        return None
    if std > 0 and w.abs().max().item() <= 1.02 * math.sqrt(3) * std:
        if abs(std / target - 1) < 0.05:
            return _("{name}'s weights are uniform (kaiming's spread: that is kaiming_uniform_); the exercise asks for the normal "
                     "distribution N(0, std²) with std = sqrt(2 / fan_in) = {target:.4f}").format(name=name, target=target)
        return _("{name}'s weights are uniform (std {std:.4f}); the exercise asks for the normal distribution "
                 "N(0, std²) with std = sqrt(2 / fan_in) = {target:.4f}").format(name=name, std=std, target=target)
    if std > 0 and _ks_normal((w - w.mean()) / std) < limit:
        gain_one = 1 / math.sqrt(fan_in)
        causes = [  # (the std a mistake gives, the message naming it)
            (math.sqrt(2 / fan_out), _("{name}'s weights have std {std:.4f} = sqrt(2 / fan_out), fan_out = {fan_out}: use mode='fan_in'")),
            (math.sqrt(2 / (fan_in + fan_out)), _("{name}'s weights have std {std:.4f} = sqrt(2 / (fan_in + fan_out)): that is xavier_normal_, not kaiming")),
            (gain_one, _("{name}'s weights have std {std:.4f} = sqrt(1 / fan_in): the gain for ReLU is sqrt(2), nonlinearity='relu'")),
            (5 / 3 * gain_one, _("{name}'s weights have std {std:.4f} = the gain for tanh: for ReLU it is sqrt(2), nonlinearity='relu'")),
            (1.0, _("{name}'s weights have std {std:.4f} = 1: pass the std, or use kaiming_normal_")),
        ]
        if weight.dim() > 2:
            causes.append((math.sqrt(2 / weight.shape[1]), _("{name}'s weights have std {std:.4f} = sqrt(2 / in_channels): a Conv2d's fan_in "
                                                             "is in_channels × kernel height × kernel width")))
        for value, message in causes:
            if abs(std / value - 1) < 0.04:
                return message.format(name=name, std=std, fan_out=fan_out)
        return _("{name}'s weights are normal with std {std:.4f}, expected sqrt(2 / fan_in) = {target:.4f} (fan_in = {fan_in})").format(
            name=name, std=std, target=target, fan_in=fan_in)
    return _("{name}'s weights do not follow the normal distribution N(0, std²) with std = sqrt(2 / fan_in) = {target:.4f} "
             "(got mean {mean:.4f}, std {std:.4f})").format(name=name, target=target, mean=w.mean().item(), std=std)


@exercise("init_relu_net")
def check_init_relu_net(fn) -> None:
    with _seeded(6):
        model = _relu_net()
    before = _snapshot(model)
    objects = {name: (p, p.data_ptr(), p.requires_grad) for name, p in model.named_parameters()}
    shown = _("a model with Conv2d, BatchNorm2d, Embedding, Linear and LayerNorm layers")
    with _seeded(60):
        got = call(fn, model, shown=shown, hints=_INIT_HINTS)
    where = _("after {call},").format(call=f"init_relu_net({shown})")
    now = dict(model.named_parameters())
    for name, (param, pointer, flag) in objects.items():
        if now.get(name) is not param or param.data_ptr() != pointer:
            raise ExerciseFailed(
                _("{where} {name} is a new tensor: fill the existing one in place (nn.init's functions do), "
                  "so that an optimiser holding it still sees it").format(where=where, name=name)
            )
        if param.requires_grad != flag:
            raise ExerciseFailed(
                _("{where} {name}.requires_grad is {got}, but it was {flag}: leave the flags as they were").format(
                    where=where, name=name, got=param.requires_grad, flag=flag)
            )
    targets = {"stem": model.stem, "conv": model.conv, "head.1": model.head[1], "head.4": model.head[4]}
    if all(torch.equal(t, before["tensors"][name]) for name, t in model.state_dict().items()):
        if isinstance(got, nn.Module) and got is not model:
            raise ExerciseFailed(_("{where} the model is unchanged, and you returned another one: change `model` itself, in place").format(where=where))
        raise ExerciseFailed(_("{where} nothing changed: fill the weights and biases of every Conv2d and Linear, in place").format(where=where))
    target_names = {f"{prefix}.{kind}" for prefix in targets for kind in ("weight", "bias")}
    for name, value in model.state_dict().items():
        if name not in target_names and not torch.equal(value, before["tensors"][name]):
            owner = name.rpartition(".")[0]
            kind_of_layer = type(model.get_submodule(owner)).__name__
            if owner:
                layer = (_("an {type}") if kind_of_layer[0] in "AEIOU" else _("a {type}")).format(type=kind_of_layer)
            else:
                layer = _("the model itself, in no layer")
            if name in dict(model.named_buffers()):
                message = _("{where} the buffer {name} changed, and it belongs to {layer}: change only Conv2d and Linear layers")
            else:
                message = _("{where} the parameter {name} changed, and it belongs to {layer}: change only Conv2d and Linear layers")
            raise ExerciseFailed(message.format(where=where, name=name, layer=layer))
    for prefix, layer in targets.items():
        weight = layer.weight
        if torch.equal(weight, before["tensors"][f"{prefix}.weight"]):
            raise ExerciseFailed(
                _("{where} {prefix}.weight still has its old values: every Conv2d and Linear weight is to be filled").format(where=where, prefix=prefix)
            )
        fault = _kaiming_fault(prefix, weight)
        if fault:
            raise ExerciseFailed(_("{where} {fault}").format(where=where, fault=fault))
        if layer.bias is not None and not torch.equal(layer.bias, torch.zeros_like(layer.bias)):
            if torch.equal(layer.bias, before["tensors"][f"{prefix}.bias"]):
                raise ExerciseFailed(_("{where} {prefix}.bias still has its old values: biases start at zero").format(where=where, prefix=prefix))
            raise ExerciseFailed(_("{where} {prefix}.bias is not all zeros: biases start at zero").format(where=where, prefix=prefix))


# ---- make_causal_attention ----------------------------------------------------------------------

def _attend(x: torch.Tensor, qkv: nn.Linear, proj: nn.Linear, heads: int, fault: str | None = None) -> torch.Tensor:
    """Causal self-attention as the exercise asks for it, or, with `fault`, as one typical mistake computes it."""
    n, length, e = x.shape
    d = e // heads
    q, k, v = qkv(x).chunk(3, dim=-1)
    if fault and fault.startswith("order"):
        q, k, v = (q, k, v)[int(fault[-3])], (q, k, v)[int(fault[-2])], (q, k, v)[int(fault[-1])]

    def split(t):
        return t.reshape(n, heads, length, d) if fault == "split" else t.reshape(n, length, heads, d).transpose(1, 2)

    q, k, v = split(q), split(k), split(v)
    scale = {"scale E": math.sqrt(e), "no scale": 1.0}.get(fault, math.sqrt(d))
    scores = q @ k.transpose(-2, -1) / scale
    allowed = torch.ones(length, length, dtype=torch.bool)
    allowed = {"no mask": allowed, "future": allowed.triu()}.get(fault, allowed.tril())
    if fault == "after softmax":
        weights = scores.softmax(dim=-1) * allowed
    elif fault == "fill 0":
        weights = scores.masked_fill(~allowed, 0.0).softmax(dim=-1)
    else:
        weights = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-2 if fault == "dim -2" else -1)
    out = weights @ v
    out = out.reshape(n, length, e) if fault == "join" else out.transpose(1, 2).reshape(n, length, e)
    return out if fault == "no proj" else proj(out)


# The messages are translated when they are shown ({what}: the call that built the module); N_ marks them for the catalog.
_ATTENTION_FAULTS = {
    "no mask": N_("{what}: there is no causal mask: every position also attends to later ones; hide the scores of keys j > i"),
    "future": N_("{what}: the mask hides the past instead of the future: query i may see keys j <= i, a lower triangle (tril)"),
    "scale E": N_("{what}: the scores are divided by sqrt(embed_dim); each head works on head_dim = embed_dim / num_heads features, "
                  "so divide by sqrt(head_dim)"),
    "no scale": N_("{what}: the scores are not scaled: divide q @ k^T by sqrt(head_dim)"),
    "after softmax": N_("{what}: the mask is applied after the softmax, so the kept weights no longer sum to 1: "
                        "fill the hidden scores with float('-inf') before it"),
    "fill 0": N_("{what}: the hidden scores are set to 0, and exp(0) still gives them weight: fill them with float('-inf')"),
    "split": N_("{what}: the heads are split wrongly: each head takes head_dim of the features at every position, "
                "so view (N, L, E) as (N, L, num_heads, head_dim), then transpose(1, 2)"),
    "join": N_("{what}: the heads are joined wrongly: transpose (N, num_heads, L, head_dim) back to (N, L, num_heads, head_dim) "
               "before reshaping to (N, L, E)"),
    "dim -2": N_("{what}: the softmax runs over the queries: each query's weights over the keys must sum to 1, softmax(dim=-1)"),
    "no proj": N_("{what}: proj is never applied: the joined heads go through proj"),
    **{
        f"order{''.join(map(str, p))}": N_("{what}: q, k and v are taken from qkv's output in the wrong order: it is q, then k, then v "
                                           "(the layout of nn.MultiheadAttention's in_proj_weight)")
        for p in itertools.permutations(range(3))
        if p != (0, 1, 2)
    },
}


@contextmanager
def _spy_on_sdpa() -> Iterator[list[int]]:
    """Count the calls to F.scaled_dot_product_attention (still computing it) while the learner's module runs."""
    real, calls = F.scaled_dot_product_attention, []

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    F.scaled_dot_product_attention = spy
    try:
        yield calls
    finally:
        F.scaled_dot_product_attention = real


def _expect_attention_layout(module: nn.Module, what: str, e: int, max_len: int) -> None:
    """The module's layers, parameters and mask buffer, as the exercise lays them out."""
    for attr, shape in (("qkv", (e, 3 * e)), ("proj", (e, e))):
        layer = getattr(module, attr, None)
        if not isinstance(layer, nn.Linear) or (layer.in_features, layer.out_features) != shape:
            if layer is None:
                raise ExerciseFailed(_("{what}.{attr} is nothing, expected nn.Linear{shape}").format(what=what, attr=attr, shape=shape))
            raise ExerciseFailed(_("{what}.{attr} is {layer!r}, expected nn.Linear{shape}").format(what=what, attr=attr, layer=layer, shape=shape))
        if layer.bias is None:
            raise ExerciseFailed(_("{what}.{attr} has no bias: keep the default bias=True, as nn.MultiheadAttention has").format(what=what, attr=attr))
    if any(isinstance(m, nn.MultiheadAttention) for m in module.modules()):
        raise ExerciseFailed(_("{what} holds an nn.MultiheadAttention: write the attention yourself").format(what=what))
    params = dict(module.named_parameters())
    wanted = {"qkv.weight", "qkv.bias", "proj.weight", "proj.bias"}
    square = (max_len, max_len)

    def is_mask(t: Any) -> bool:  # (max_len, max_len), or with leading size-1 dims, as in (1, 1, max_len, max_len)
        return isinstance(t, torch.Tensor) and tuple(t.shape[-2:]) == square and t.numel() == max_len * max_len

    extra = [name for name in params if name not in wanted]
    if extra:
        if any(is_mask(params[name]) for name in extra):
            raise ExerciseFailed(
                _("{what} registers the mask as a Parameter, which an optimiser would train: use register_buffer").format(what=what)
            )
        raise ExerciseFailed(_("{what} has parameters besides qkv and proj: {names}").format(what=what, names=", ".join(extra)))
    buffers = [name for name, b in module.named_buffers() if is_mask(b)]
    if not buffers:
        plain = [name for name, value in vars(module).items() if is_mask(value)]
        if plain:
            raise ExerciseFailed(
                _("{what} keeps the mask in a plain attribute, {name}, which .to(device) does not move: "
                  "register it with register_buffer").format(what=what, name=plain[0])
            )
        raise ExerciseFailed(
            _("{what} has no buffer of shape {shape}: keep the causal mask for up to max_len positions in one (register_buffer)").format(
                what=what, shape=square)
        )
    saved = [name for name in module.state_dict() if name not in wanted]
    if saved:
        raise ExerciseFailed(
            _("{what}'s state_dict holds {name}: register the mask with persistent=False, so checkpoints hold only the weights").format(
                what=what, name=saved[0])
        )


def _load_mha(module: nn.Module, reference: nn.MultiheadAttention) -> None:
    with torch.no_grad():
        module.qkv.weight.copy_(reference.in_proj_weight)
        module.qkv.bias.copy_(reference.in_proj_bias)
        module.proj.weight.copy_(reference.out_proj.weight)
        module.proj.bias.copy_(reference.out_proj.bias)


@exercise("make_causal_attention")
def check_make_causal_attention(fn) -> None:
    for e, heads, max_len, shapes in (
        (12, 3, 9, [(2, 6), (1, 9), (3, 1)]),
        (10, 2, 5, [(3, 4)]),
    ):
        what = f"make_causal_attention({e}, {heads}, {max_len})"
        with _seeded(8):
            module = call(fn, e, heads, max_len)
            reference = nn.MultiheadAttention(e, heads, batch_first=True)
            with torch.no_grad():  # its biases start at zero, which would hide a missing bias
                reference.in_proj_bias.normal_(0, 0.5)
                reference.out_proj.bias.normal_(0, 0.5)
        expect_module(module, what=what)
        _expect_attention_layout(module, what, e, max_len)
        _load_mha(module, reference)
        for n, length in shapes:
            with _seeded(9 + length):
                x = torch.randn(n, length, e)
            x0 = x.clone()
            shown = _("x of shape {shape}").format(shape=tuple(x.shape))
            try:
                with _spy_on_sdpa() as sdpa_calls:
                    got = call(module, x, name=_("{what}'s module").format(what=what), shown=shown, kind="module")
            except ExerciseFailed as err:
                if length < max_len and f"({length})" in err.message and f"({max_len})" in err.message:
                    raise ExerciseFailed(
                        _("{message}: the ({max_len}, {max_len}) mask meets ({length}, {length}) scores; "
                          "slice it to the sequence, [:L, :L]").format(message=err.message, max_len=max_len, length=length)
                    ) from None
                raise
            if sdpa_calls:
                raise ExerciseFailed(
                    _("{what}'s module calls F.scaled_dot_product_attention: write the scores, mask and softmax yourself").format(what=what)
                )
            expect_unchanged(x0, x, what=_("{what}'s forward").format(what=what))
            with torch.no_grad():
                causal = ~torch.ones(length, length, dtype=torch.bool).tril()
                expected = reference(x0, x0, x0, attn_mask=causal, need_weights=False)[0]
            label = _("{what}'s output for {shown}").format(what=what, shown=shown)
            if isinstance(got, tuple):
                raise ExerciseFailed(_("{what} is a tuple: return only the output tensor").format(what=label))
            if isinstance(got, torch.Tensor) and got.shape == expected.shape and not torch.allclose(got, expected, atol=1e-5):
                if length > 1 and torch.isnan(got[:, 0]).any() and not torch.isnan(got[:, 1:]).any():
                    raise ExerciseFailed(
                        _("{what} is NaN at position 0, which then attends to nothing: "
                          "each position must see itself too (keep the diagonal)").format(what=label)
                    )
                with torch.no_grad():
                    for fault, message in _ATTENTION_FAULTS.items():
                        if torch.allclose(got.detach(), _attend(x0, module.qkv, module.proj, heads, fault), atol=1e-5):
                            raise ExerciseFailed(_(message).format(what=what))
            expect_tensor(got, expected, what=label, atol=1e-5)


# ---- make_norm_block ----------------------------------------------------------------------------

class _Sublayer(nn.Module):
    """The hidden f of make_norm_block: a small MLP that notes each call's input."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.inputs: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.inputs.append(x.detach().clone())
        return self.down(F.gelu(self.up(x)))


def _orders(x: torch.Tensor, f: Callable, norm: Callable) -> dict[str, torch.Tensor]:
    """What each way of combining x, f and norm gives: the two right orders and the typical mistakes."""
    return {
        "pre": x + f(norm(x)),
        "post": norm(x + f(x)),
        "normed skip": norm(x) + f(norm(x)),
        "no skip, pre": f(norm(x)),
        "no skip, post": norm(f(x)),
        "norm of f": x + norm(f(x)),
        "norm twice": norm(x + f(norm(x))),
    }


# The messages are translated when they are shown ({what}: the call that built the block); N_ marks them for the catalog.
# Keyed by norm_first: what the block built instead of the order asked for.
_WRONG_ORDER = {
    True: N_("{what} built the post-norm order, norm(x + f(x)); norm_first=True asks for the norm first, inside the branch: "
             "the pre-norm order, x + f(norm(x))"),
    False: N_("{what} built the pre-norm order, x + f(norm(x)); norm_first=False asks for the norm last, on the sum: "
              "the post-norm order, norm(x + f(x))"),
}
_ORDER_FAULTS = {
    "normed skip": N_("{what} adds norm(x) to the branch, norm(x) + f(norm(x)): in pre-norm only f sees the normalised x; "
                      "the skip carries x itself, untouched"),
    "no skip, pre": N_("{what} returns f(norm(x)) with no skip connection: add x, the residual"),
    "no skip, post": N_("{what} returns norm(f(x)) with no skip connection: add x before the norm, norm(x + f(x))"),
    "norm of f": N_("{what} returns x + norm(f(x)), which normalises f's output: pre-norm normalises f's input, post-norm the sum"),
    "norm twice": N_("{what} applies the norm both to f's input and to the sum, norm(x + f(norm(x))): use one, as norm_first says"),
}


def _norm_cases() -> list[tuple[int, int, bool, tuple[int, ...]]]:
    """(dim, hidden, norm_first, input shape): both orders for each dim, 2-D and 3-D inputs, a batch of 1."""
    return [(6, 12, True, (4, 6)), (6, 12, False, (2, 5, 6)), (10, 7, False, (3, 10)), (10, 7, True, (1, 3, 10))]


def _own_norms(block: nn.Module, f: nn.Module) -> list[nn.LayerNorm]:
    inside_f = {id(m) for m in f.modules()}
    return [m for m in block.modules() if isinstance(m, nn.LayerNorm) and id(m) not in inside_f]


def _expect_norm_layout(block: nn.Module, f: nn.Module, dim: int, what: str) -> list[nn.LayerNorm]:
    """f registered in the block, and a LayerNorm(dim) of the block's own, with a learnable scale and shift."""
    expect_module(block, what=what)
    if not any(m is f for m in block.modules()):
        raise ExerciseFailed(
            _("{what} does not hold f as a sub-module (block.modules() lacks it), so f's parameters are not the block's: "
              "assign it as an attribute, self.f = f").format(what=what)
        )
    norms = _own_norms(block, f)
    if not norms:
        raise ExerciseFailed(_("{what} holds no nn.LayerNorm of its own: create self.norm = nn.LayerNorm(dim) in __init__").format(what=what))
    for norm in norms:
        if tuple(norm.normalized_shape) != (dim,):
            raise ExerciseFailed(
                _("{what}'s LayerNorm normalises over {shape}, expected ({dim},): the last dimension, dim").format(
                    what=what, shape=tuple(norm.normalized_shape), dim=dim)
            )
        if norm.weight is None:
            raise ExerciseFailed(_("{what}'s LayerNorm has no learnable scale and shift: keep elementwise_affine=True").format(what=what))
    known = {id(p) for p in f.parameters()} | {id(p) for n in norms for p in n.parameters()}
    extra = [name for name, p in block.named_parameters() if id(p) not in known]
    if extra:
        raise ExerciseFailed(_("{what} has parameters besides f's and its LayerNorm's: {names}").format(what=what, names=", ".join(extra)))
    return norms


@exercise("make_norm_block")
def check_make_norm_block(fn) -> None:
    for dim, hidden, norm_first, shape in _norm_cases():
        with _seeded(30 + dim + norm_first):
            f = _Sublayer(dim, hidden)
            x = 3 * torch.randn(shape) + 1.5  # far from normalised, so that a norm shows where it acts
        what = f"make_norm_block(f, {dim}, norm_first={norm_first})"
        block = call(fn, f, dim, norm_first, shown=f"f, {dim}, {norm_first}")
        norms = _expect_norm_layout(block, f, dim, what)
        with torch.no_grad():  # a trained-looking scale and shift, so that a norm without them shows
            for norm in norms:
                norm.weight.uniform_(0.5, 1.5)
                norm.bias.uniform_(-0.5, 0.5)
        x0 = x.clone()
        f.inputs.clear()
        shown = _("x of shape {shape}").format(shape=tuple(x.shape))
        got = call(block, x, name=_("{what}'s block").format(what=what), shown=shown, kind="module")
        expect_unchanged(x0, x, what=_("{what}'s forward").format(what=what))
        if len(f.inputs) != 1:
            raise ExerciseFailed(
                _("{what}'s forward called f {n} times: call it once per forward").format(what=what, n=len(f.inputs))
            )
        label = _("{what}'s output for {shown}").format(what=what, shown=shown)
        right, wrong = ("pre", "post") if norm_first else ("post", "pre")
        with torch.no_grad():
            candidates = [_orders(x0, f.forward, norm) for norm in norms]  # one set per LayerNorm the block holds
        if not (isinstance(got, torch.Tensor) and got.shape == x.shape):
            expect_tensor(got, candidates[0][right], what=label)  # not a tensor, or the wrong shape: its own line
        if not any(torch.allclose(got, c[right], atol=1e-5) for c in candidates):
            if any(torch.allclose(got, c[wrong], atol=1e-5) for c in candidates):
                raise ExerciseFailed(_(_WRONG_ORDER[norm_first]).format(what=what))
            for fault, message in _ORDER_FAULTS.items():
                if any(torch.allclose(got, c[fault], atol=1e-5) for c in candidates):
                    raise ExerciseFailed(_(message).format(what=what))
            with torch.no_grad():
                plain = _orders(x0, f.forward, lambda t: F.layer_norm(t, (dim,)))
            if torch.allclose(got, plain[right], atol=1e-5):
                raise ExerciseFailed(
                    _("{what}'s norm ignores the LayerNorm's own weight and bias (a LayerNorm made afresh in forward, "
                      "or F.layer_norm without them): create self.norm once in __init__ and call it").format(what=what)
                )
            expect_tensor(got, candidates[0][right], what=label, atol=1e-5)
        if not got.requires_grad:
            raise ExerciseFailed(
                _("{what} carries no graph: a block must stay trainable, so do not run it under torch.no_grad()").format(what=label)
            )


# ---- evaluate -----------------------------------------------------------------------------------

Batches = list[tuple[torch.Tensor, torch.Tensor]]


def _eval_problem() -> tuple[nn.Module, list[tuple[Batches, list[int]]]]:
    """A 12-class model with BatchNorm and Dropout; batches of 8, 8 and 3 with 6, 2 and 3 right, and of 1 and 5 with 1 and 2 right."""
    model = nn.Sequential(nn.Linear(7, 20), nn.BatchNorm1d(20), nn.ReLU(), nn.Dropout(0.3), nn.Linear(20, 12))
    with torch.no_grad():
        model[1].running_mean.uniform_(-1, 1)
        model[1].running_var.uniform_(0.5, 2)

    def batches(sizes: tuple[int, ...], right: tuple[int, ...]) -> tuple[Batches, list[int]]:
        out = []
        for size, n_right in zip(sizes, right):
            x = torch.randn(size, 7)
            model.eval()
            with torch.no_grad():
                predicted = model(x).argmax(dim=-1)
            is_right = torch.zeros(size, dtype=torch.bool)
            is_right[torch.randperm(size)[:n_right]] = True
            out.append((x, torch.where(is_right, predicted, (predicted + 1 + torch.arange(size)) % 12)))
        model.train()
        return out, list(right)

    return model, [batches((8, 8, 3), (6, 2, 3)), batches((1, 5), (1, 2))]


def _recorder(name: str, seen: list) -> Callable:
    """A forward pre-hook noting, each time the module runs, its name, its mode and whether gradients are tracked."""

    def record(module: nn.Module, args: tuple) -> None:
        seen.append((name, module.training, torch.is_grad_enabled()))

    return record


_EVAL_HINTS = {  # the advice is translated when it is shown (checks.error_hint)
    "Expected more than 1 value per channel when training": N_("BatchNorm raises this in train mode only: switch the model to eval mode"),
}


def _mode_name(training: bool) -> str:
    """'train' or 'eval', as model.train() and model.eval() name the mode: code, left in English in every language."""
    return "train" if training else "eval"


@exercise("evaluate")
def check_evaluate(fn) -> None:
    with _seeded(11):
        model, ((batches, right), (tiny, right_tiny)) = _eval_problem()

    def set_up(mode: str) -> None:
        model.train(mode != "eval")
        model.requires_grad_(True)
        if mode == "mixed":  # a fine-tuning set-up: a frozen first layer and a BatchNorm kept in eval mode
            model[1].eval()
            model[0].requires_grad_(False)

    scenarios = [  # (modes, batches, right answers per batch, shown, whether the caller tracks gradients)
        ("train", batches, right, _("a model in train mode, batches of 8, 8 and 3"), True),
        ("eval", batches, right, _("a model in eval mode, batches of 8, 8 and 3"), True),
        ("mixed", batches, right, _("a model in train mode with its BatchNorm in eval mode, batches of 8, 8 and 3"), True),
        ("train", tiny, right_tiny, _("a model in train mode, batches of 1 and 5"), True),
        ("train", tiny, right_tiny, _("a model in train mode, batches of 1 and 5, called inside the caller's torch.no_grad()"), False),
    ]
    for mode, data, right, shown, caller_grad in scenarios:
        set_up(mode)
        before = _snapshot(model)
        flags = {name: p.requires_grad for name, p in model.named_parameters()}
        inputs = [(x.clone(), y.clone()) for x, y in data]
        seen: list[tuple[str, bool, bool]] = []
        handles = [m.register_forward_pre_hook(_recorder(name, seen)) for name, m in model.named_modules()]
        what = f"evaluate({shown})"
        try:
            with torch.set_grad_enabled(caller_grad):  # restores the caller's setting, whatever the learner's code sets
                got = call(fn, model, inputs, shown=shown, hints=_EVAL_HINTS)
                grad_after = torch.is_grad_enabled()
        finally:
            for handle in handles:
                handle.remove()
        in_train = next((name for name, training, _grad in seen if training), None)
        if in_train is not None:
            layer = f"'{in_train}' ({type(model.get_submodule(in_train)).__name__})" if in_train else _("the model")
            raise ExerciseFailed(_("{what} ran {layer} in train mode: switch the model to eval mode before running it").format(what=what, layer=layer))
        if any(grad for *_rest, grad in seen):
            raise ExerciseFailed(
                _("{what} ran the model with gradient tracking on: run it under torch.no_grad() (or torch.inference_mode())").format(what=what)
            )
        if grad_after != caller_grad and caller_grad:
            raise ExerciseFailed(
                _("{what} left gradient tracking switched off for everything after it: "
                  "use `with torch.no_grad():`, which ends with its block").format(what=what)
            )
        if grad_after != caller_grad:
            raise ExerciseFailed(
                _("{what} switched gradient tracking on for the code after it, which had it off: put back the setting you found "
                  "(a `with torch.no_grad():` block does; torch.set_grad_enabled(True) does not)").format(what=what)
            )
        for name, training in before["modes"].items():
            now = model.get_submodule(name).training
            if now != training:
                label = f"'{name}' ({type(model.get_submodule(name)).__name__})" if name else _("the model")
                advice = (
                    _(": model.train() sets every sub-module; record each module's mode before and put each one back")
                    if mode == "mixed"
                    else _(": put back the mode the model had ({mode})").format(mode=_mode_name(training))
                )
                if now:
                    message = _("after {what}, {label} is in train mode, but it was in eval mode{advice}")
                else:
                    message = _("after {what}, {label} is in eval mode, but it was in train mode{advice}")
                raise ExerciseFailed(message.format(what=what, label=label, advice=advice))
        changed = next((name for name, p in model.named_parameters() if p.requires_grad != flags[name]), None)
        if changed:
            raise ExerciseFailed(
                _("after {what}, {name}.requires_grad is {got}, but it was {flag}: "
                  "evaluating must not freeze or unfreeze parameters; torch.no_grad() is enough").format(
                    what=what, name=changed, got=not flags[changed], flag=flags[changed])
            )
        _expect_untouched(model, before, _("after {call},").format(call=what))
        for (x, y), (x0, y0) in zip(inputs, data):
            expect_unchanged(x0, x, what=what)
            expect_unchanged(y0, y, what=what)
        _expect_accuracy(got, right, [len(y) for _x, y in data], what)


def _expect_accuracy(got: Any, right: list[int], sizes: list[int], what: str) -> None:
    correct = sum(right)
    expected = correct / sum(sizes)
    if isinstance(got, torch.Tensor):
        raise ExerciseFailed(_("{what} is a tensor, expected a Python float: call .item() on it").format(what=what))
    if isinstance(got, np.generic):
        raise ExerciseFailed(_("{what} is {a_type}, expected a Python float: convert it with float(...)").format(what=what, a_type=a_type(got)))
    if isinstance(got, int) and not isinstance(got, bool) and got == correct:
        raise ExerciseFailed(
            _("{what} returned {got}, the number of right predictions: divide it by the number of samples").format(what=what, got=got)
        )
    if type(got) is not float:
        raise ExerciseFailed(_("{what} is {a_type}, expected a Python float").format(what=what, a_type=a_type(got)))
    if abs(got - expected) < 1e-6:
        return
    if abs(got - 100 * expected) < 1e-4:
        raise ExerciseFailed(_("{what} returned a percentage, {got:.4g}: return the fraction right, between 0 and 1").format(what=what, got=got))
    if len(set(sizes)) > 1:
        if abs(got - sum(r / n for r, n in zip(right, sizes)) / len(sizes)) < 1e-6:
            raise ExerciseFailed(
                _("{what} averaged the per-batch accuracies, so the smaller last batch weighs as much as a full one: "
                  "add up the right predictions and the samples over all batches, then divide once").format(what=what)
            )
        if abs(got - correct / (len(sizes) * sizes[0])) < 1e-6:
            raise ExerciseFailed(
                _("{what} divided by the number of batches times the batch size; the last batch is smaller, so count the samples").format(what=what)
            )
    raise ExerciseFailed(
        _("{what}: expected accuracy {expected:.6f} ({correct} of {total} right), got {got:.6f}").format(
            what=what, expected=expected, correct=correct, total=sum(sizes), got=got)
    )


# ---- load_pretrained ----------------------------------------------------------------------------

class _Finetuned(nn.Module):
    """A body, a parameter of the model's own, and a new head named `head_name`."""

    def __init__(self, head_name: str, head: nn.Module):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(9, 24), nn.BatchNorm1d(24), nn.ReLU(), nn.Linear(24, 24), nn.ReLU())
        self.scale = nn.Parameter(torch.ones(1))
        self.head_name = head_name
        self.add_module(head_name, head)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.get_submodule(self.head_name)(self.body(x)) * self.scale


def _pretrained_checkpoint(head_name: str, old_head_name: str) -> dict[str, torch.Tensor]:
    """An earlier model's weights: the same body, a 10-class head under another name, trained-looking statistics."""
    earlier = _Finetuned(old_head_name, nn.Linear(24, 10))
    with torch.no_grad():
        earlier.scale.fill_(1.75)
        earlier.body[1].running_mean.uniform_(-1, 1)
        earlier.body[1].running_var.uniform_(0.5, 2)
        earlier.body[1].num_batches_tracked.fill_(40)
    return earlier.state_dict()


def _new_head(head_name: str) -> nn.Module:
    return nn.Linear(24, 13) if head_name == "head" else nn.Sequential(nn.Linear(24, 16), nn.ReLU(), nn.Linear(16, 5))


def _model_factory(head_name: str, built: list[str], allocated: list[str]) -> Callable[[], nn.Module]:
    """The learner's make_model: builds the new model, noting on which device each call builds it, and which of its
    tensors already held memory when load_state_dict came to fill them from the checkpoint."""

    def note_allocated(module: nn.Module, state_dict: dict, prefix: str, *_unused: Any) -> None:
        for name, t in itertools.chain(module.named_parameters(recurse=False), module.named_buffers(recurse=False)):
            if prefix + name in state_dict and not t.is_meta:
                allocated.append(prefix + name)

    def make_model() -> nn.Module:
        built.append(torch.empty(0).device.type)
        model = _Finetuned(head_name, _new_head(head_name))
        model.body[0].requires_grad_(False)  # fine-tuning keeps the first layer frozen
        for module in model.modules():
            module.register_load_state_dict_pre_hook(note_allocated)
        return model

    return make_model


def _default_init_fault(name: str, layer: nn.Linear) -> str | None:
    """What is wrong with a Linear that should hold a fresh default init (uniform within ±1/sqrt(in_features))."""
    bound = 1 / math.sqrt(layer.in_features)
    for kind in ("weight", "bias"):
        values = getattr(layer, kind).detach()
        fresh = (
            torch.isfinite(values).all()
            and values.abs().max() <= bound
            and values.unique().numel() > values.numel() // 2
            and (kind == "bias" or values.abs().max() >= 0.8 * bound)
        )
        if not fresh:
            return _("{name}.{kind} does not hold a new layer's values, uniform within ±{bound:.4f} as a new nn.Linear draws them "
                     "(got values from {low:.4g} to {high:.4g}): after to_empty, call the layer's reset_parameters()").format(
                name=name, kind=kind, bound=bound, low=values.min().item(), high=values.max().item())
    return None


@exercise("load_pretrained")
def check_load_pretrained(fn) -> None:
    for head_name, old_head_name in (("head", "classifier"), ("classifier", "head")):
        with _seeded(12 if head_name == "head" else 13):
            checkpoint = _pretrained_checkpoint(head_name, old_head_name)
        old_keys = [k for k in checkpoint if k.startswith(old_head_name + ".")]
        shown = _("make_model (a new {head}), a checkpoint with the body and an old {old_head}").format(head=head_name, old_head=old_head_name)
        what = f"load_pretrained({shown})"
        built: list[str] = []
        allocated: list[str] = []
        make_model = _model_factory(head_name, built, allocated)

        with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as folder:
            path = os.path.join(folder, "pretrained.pt")
            torch.save(checkpoint, path)
            default_device = torch.get_default_device()
            keys_hint = _("the checkpoint lacks the new {head} and holds the old {old_head}: "
                          "strict=False loads what matches and reports the rest").format(head=head_name, old_head=old_head_name)
            try:
                with _seeded(14):
                    got = call(fn, make_model, path, shown=shown, hints={
                        "Missing key(s) in state_dict": keys_hint, "Unexpected key(s) in state_dict": keys_hint,
                    })
            finally:
                left = torch.get_default_device()
                if left != default_device:
                    torch.set_default_device(None if default_device.type == "cpu" else default_device)
            if left != default_device:
                raise ExerciseFailed(
                    _("{what} left the default device at {device}: build inside `with torch.device('meta'):`, "
                      "which ends with its block").format(what=what, device=left)
                )
            try:
                _expect_pretrained(got, built, allocated, checkpoint, path, head_name, old_keys, what)
            finally:
                del got


def _expect_pretrained(
    got: Any, built: list[str], allocated: list[str], checkpoint: dict, path: str, head_name: str, old_keys: list[str], what: str
) -> None:
    if not built:
        raise ExerciseFailed(_("{what} never called make_model(): build the model with it").format(what=what))
    if len(built) > 1:
        raise ExerciseFailed(_("{what} called make_model() {n} times: build the model once, on the meta device").format(what=what, n=len(built)))
    if built[0] != "meta":
        raise ExerciseFailed(
            _("{what} called make_model() on the {device} device, which allocates and initialises every weight only to "
              "overwrite it: build it inside `with torch.device('meta'):`").format(what=what, device=built[0])
        )
    if allocated:
        raise ExerciseFailed(
            _("{what} gave {name} memory before load_state_dict filled it from the checkpoint: that allocates a weight "
              "the file then overwrites; load first (assign=True), then give memory (to_empty) only to the layers "
              "the checkpoint lacks").format(what=what, name=allocated[0])
        )
    expect_module(got, what=what)
    tensors = dict(itertools.chain(got.named_parameters(), got.named_buffers()))
    on_meta = [name for name, t in tensors.items() if t.is_meta]
    if on_meta:
        name = on_meta[0]
        if name in checkpoint:
            raise ExerciseFailed(
                _("in the model {what} returned, {name} is still on the meta device, though the checkpoint holds it: "
                  "load_state_dict(..., assign=True) makes the checkpoint's tensors the model's "
                  "(copying into meta tensors does nothing)").format(what=what, name=name)
            )
        raise ExerciseFailed(
            _("in the model {what} returned, {name} is still on the meta device: the checkpoint lacks it, so give its layer "
              "memory (to_empty) and initialise it (reset_parameters)").format(what=what, name=name)
        )
    wanted = [k for k in checkpoint if k not in old_keys]
    params = dict(got.named_parameters())
    with torch.device("meta"):
        should_be_params = set(dict(_Finetuned(head_name, _new_head(head_name)).named_parameters()))
    for name in wanted:
        if name not in tensors:
            raise ExerciseFailed(_("the model {what} returned has no {name}").format(what=what, name=name))
        if name in should_be_params and name not in params:
            raise ExerciseFailed(
                _("in the model {what} returned, {name} is no longer a parameter: load it with load_state_dict").format(what=what, name=name)
            )
    for name, param in params.items():
        frozen = name.startswith("body.0.")
        if param.requires_grad == frozen:
            raise ExerciseFailed(
                _("in the model {what} returned, {name}.requires_grad is {got}, but make_model set it to {flag}: "
                  "keep the flags the model was built with (load_state_dict(..., assign=True) keeps them)").format(
                    what=what, name=name, got=param.requires_grad, flag=not frozen)
            )
    for name in wanted:
        if tensors[name].dtype != checkpoint[name].dtype or not torch.equal(tensors[name].detach(), checkpoint[name]):
            if name not in params:
                raise ExerciseFailed(
                    _("in the model {what} returned, the buffer {name} does not hold the checkpoint's values").format(what=what, name=name)
                )
            raise ExerciseFailed(
                _("in the model {what} returned, the parameter {name} does not hold the checkpoint's values").format(what=what, name=name)
            )
    mapped = torch.load(path, mmap=True, weights_only=True)
    first = wanted[0]
    offsets = {name: mapped[name].data_ptr() - mapped[first].data_ptr() for name in wanted}
    if any(tensors[name].data_ptr() - tensors[first].data_ptr() != offsets[name] for name in wanted):
        raise ExerciseFailed(
            _("in the model {what} returned, the weights are not the tensors mapped from the file: load it with "
              "torch.load(path, mmap=True, weights_only=True) and hand them over with load_state_dict(..., assign=True), "
              "which takes them instead of copying").format(what=what)
        )
    for name, module in got.get_submodule(head_name).named_modules(prefix=head_name):
        if isinstance(module, nn.Linear):
            fault = _default_init_fault(name, module)
            if fault:
                raise ExerciseFailed(_("in the model {what} returned, {fault}").format(what=what, fault=fault))
