"""Lesson 03 (nn.Module): reference solutions and the checks for its exercises."""

import math
from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from course_utils.tooling.checks import (
    ExerciseFailed,
    call,
    exercise,
    expect_equal,
    expect_module,
    expect_shape,
    expect_tensor,
    expect_unchanged,
    scoreboard_for,
)

scoreboard = scoreboard_for(__name__)  # the lesson's last cell: this session's verdicts


@contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Build the hidden test models from a fixed seed (@exercise keeps the notebook's random state untouched)."""
    torch.manual_seed(seed)
    yield


def _call(fn: Any, *args, shown: str, name: str | None = None, kind: str = "function") -> Any:
    """checks.call, describing the (module) arguments by `shown`."""
    return call(fn, *args, shown=shown, name=name, kind=kind)


def _n_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# Reference solutions. The checks compare the learner's answers with these.

def make_mlp(in_features: int, hidden: int, out_features: int) -> nn.Module:
    """Linear(in_features, hidden) -> ReLU -> Linear(hidden, out_features)."""
    return nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, out_features))


def count_trainable(model: nn.Module) -> int:
    """The number of trainable numbers (elements of parameters with requires_grad=True) in model."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def freeze_all_but_last(model: nn.Module) -> None:
    """Freeze every parameter of model except those of its last child module, in place."""
    model.requires_grad_(False)
    list(model.children())[-1].requires_grad_(True)


def init_weights(module: nn.Module) -> None:
    """For model.apply: xavier-uniform weights and zero biases in every nn.Linear; leave other modules alone."""
    if isinstance(module, nn.Linear):
        nn.init.xavier_uniform_(module.weight)
        if module.bias is not None:
            nn.init.zeros_(module.bias)


def make_residual(channels: int) -> nn.Module:
    """A module computing x + f(x), f = Conv2d(3x3, padding 1) -> ReLU -> Conv2d(3x3, padding 1)."""

    class Residual(nn.Module):
        def __init__(self):
            super().__init__()
            self.f = nn.Sequential(
                nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU(), nn.Conv2d(channels, channels, 3, padding=1)
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.f(x)

    return Residual()


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q @ k^T / sqrt(d)) @ v for q (..., L, d), k (..., S, d), v (..., S, dv) -> (..., L, dv)."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    return scores.softmax(dim=-1) @ v


def load_partial(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> list[str]:
    """Load the entries of state_dict that fit model; return the keys the model has but state_dict lacks."""
    return model.load_state_dict(state_dict, strict=False).missing_keys


# Checks, one per exercise, in notebook order.

def _linears(dims: list[tuple[int, int]]) -> str:
    return ", ".join(f"Linear({a}, {b})" for a, b in dims)


@exercise("make_mlp")
def check_make_mlp(fn) -> None:
    with _seeded(3), torch.no_grad():
        for n_in, hidden, n_out in ((5, 7, 3), (12, 32, 2)):
            what = f"make_mlp({n_in}, {hidden}, {n_out})"
            model = call(fn, n_in, hidden, n_out)
            expect_module(model, what=what, layer_types=[nn.Linear])
            linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
            want = [(n_in, hidden), (hidden, n_out)]
            if len(linears) != 2:
                raise ExerciseFailed(f"{what} has {len(linears)} Linear layer(s), expected 2: {_linears(want)}")
            got = [(layer.in_features, layer.out_features) for layer in linears]
            if got != want:
                raise ExerciseFailed(f"{what} has {_linears(got)}, expected {_linears(want)}")
            n_params = n_in * hidden + hidden + hidden * n_out + n_out
            if all(layer.bias is None for layer in linears):
                raise ExerciseFailed(f"{what}'s Linear layers have no bias: keep the default bias=True")
            expect_module(model, what=what, n_params=n_params)
            x = torch.randn(4, n_in)
            out = _call(model, x, shown=f"tensor of shape (4, {n_in})", name=what + "'s model", kind="module")
            expect_shape(out, (4, n_out), what=f"{what}'s output for an input of shape (4, {n_in})")
            first, second = linears
            expected = second(torch.relu(first(x)))
            if torch.allclose(out, second(first(x)), atol=1e-5):
                raise ExerciseFailed(
                    f"{what} has no ReLU between its Linear layers: without one, two Linears collapse into a single linear map"
                )
            if torch.allclose(out, torch.relu(expected), atol=1e-5):
                raise ExerciseFailed(
                    f"{what} ends with a ReLU: the last Linear's outputs (scores, or logits) must be free to go negative"
                )
            expect_tensor(out, expected, what=f"{what}'s output (Linear, ReLU, Linear)", atol=1e-5)


def _count_model() -> nn.Module:
    model = nn.Sequential(nn.Linear(10, 5), nn.BatchNorm1d(5), nn.ReLU(), nn.Linear(5, 2))
    model[0].requires_grad_(False)
    return model


@exercise("count_trainable")
def check_count_trainable(fn) -> None:
    with _seeded(4):
        model = _count_model()
        shown = "a Sequential with a BatchNorm1d and a frozen first Linear"
        got = _call(fn, model, shown=shown)
        expected = count_trainable(model)  # 22
        if isinstance(got, int) and not isinstance(got, bool):
            params = list(model.parameters())
            if got == _n_params(model):
                raise ExerciseFailed(f"count_trainable({shown}) counted the frozen parameters too: keep only those with p.requires_grad")
            if got == _n_params(model) - expected:
                raise ExerciseFailed(f"count_trainable({shown}) counted the frozen parameters instead of the trainable ones")
            if got in (len(params), sum(p.requires_grad for p in params)):
                raise ExerciseFailed(f"count_trainable({shown}) counted parameter tensors, not numbers: add up p.numel()")
            if got in (sum(t.numel() for t in model.state_dict().values()), expected + 11):
                raise ExerciseFailed(
                    f"count_trainable({shown}) counted buffers too (BatchNorm's running_mean, running_var, num_batches_tracked): "
                    "count model.parameters(), not the state_dict"
                )
        expect_equal(got, expected, what=f"count_trainable({shown})")

        shared = nn.Linear(6, 6)
        tied = nn.Sequential(shared, nn.ReLU(), shared)  # one layer used twice: its parameters count once
        shown = "a Sequential that uses the same Linear(6, 6) twice"
        got = _call(fn, tied, shown=shown)
        if got == 2 * count_trainable(tied):
            raise ExerciseFailed(
                f"count_trainable({shown}) counted the shared layer twice: model.parameters() yields each parameter once"
            )
        expect_equal(got, count_trainable(tied), what=f"count_trainable({shown})")


class _BackboneHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU())
        self.head = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


@exercise("freeze_all_but_last")
def check_freeze_all_but_last(fn) -> None:
    with _seeded(5):
        cases = [
            (nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3)), "a Sequential of 5 layers", "4"),
            (_BackboneHead(), "a model with children .backbone and .head", "head"),
        ]
    for model, shown, last in cases:
        got = _call(fn, model, shown=shown)
        flags = {name: p.requires_grad for name, p in model.named_parameters()}
        expected = {name: name.startswith(last + ".") for name in flags}
        trainable = [name for name, flag in flags.items() if flag]
        where = f"after freeze_all_but_last({shown}),"
        if all(flags.values()):
            if isinstance(got, nn.Module) and got is not model:
                raise ExerciseFailed(
                    f"{where} nothing in it is frozen, and you returned another model: change `model` itself (requires_grad_ works in place)"
                )
            raise ExerciseFailed(f"{where} nothing is frozen: call requires_grad_(False) on every parameter outside the last layer")
        if not trainable:
            raise ExerciseFailed(f"{where} every parameter is frozen: the last child's parameters ({last}.*) must stay trainable")
        if trainable == [list(flags)[-1]]:
            raise ExerciseFailed(
                f"{where} only {trainable[0]} is trainable: list(model.parameters())[-1] is a single tensor, the last layer's bias; "
                "unfreeze every parameter of the last child (its weight too)"
            )
        if set(trainable) < {name for name, flag in expected.items() if flag}:
            frozen = next(name for name, flag in expected.items() if flag and not flags[name])
            raise ExerciseFailed(
                f"{where} {frozen} is frozen, but it belongs to the last child `{last}` (list(model.children())[-1]): unfreeze all of it"
            )
        wrong = next((name for name in flags if flags[name] != expected[name]), None)
        if wrong:
            raise ExerciseFailed(
                f"{where} {wrong}.requires_grad is {flags[wrong]}, expected {expected[wrong]}: "
                "freeze everything, then unfreeze list(model.children())[-1]"
            )


def _init_hint(message: str) -> str:
    if "has no attribute 'weight'" in message:
        return ": model.apply calls it on every module (ReLU and the Sequential itself too); act only `if isinstance(module, nn.Linear)`"
    if "'NoneType'" in message:
        return ": a Linear made with bias=False has module.bias = None; guard with `if module.bias is not None`"
    if "fewer than 2 dimensions" in message:
        return ": xavier needs a 2-D weight, and a LayerNorm's is 1-D; only nn.Linear layers should be initialised"
    return ""


@exercise("init_weights")
def check_init_weights(fn) -> None:
    with _seeded(6), torch.no_grad():
        model = nn.Sequential(
            nn.Linear(400, 200), nn.ReLU(), nn.Linear(200, 50), nn.LayerNorm(50), nn.Linear(50, 450, bias=False)
        )
        # model.apply(fn) calls fn on each child, then on the model itself: do the same, one module at a time.
        for module in [*model, model]:
            shown = "the whole Sequential" if module is model else repr(module)
            try:
                _call(fn, module, shown=shown)
            except ExerciseFailed as err:
                raise ExerciseFailed(err.message + _init_hint(err.message)) from None
        norm = model[3]
        if not (torch.equal(norm.weight, torch.ones(50)) and torch.equal(norm.bias, torch.zeros(50))):
            raise ExerciseFailed("init_weights changed a LayerNorm's parameters: only nn.Linear layers should change")
        for layer in (model[0], model[2], model[4]):
            name = f"Linear({layer.in_features}, {layer.out_features})"
            fan_in, fan_out = layer.in_features, layer.out_features
            std = layer.weight.std().item()
            xavier = math.sqrt(2 / (fan_in + fan_out))
            kaiming = math.sqrt(2 / fan_in)
            default = 1 / math.sqrt(3 * fan_in)
            if abs(std - xavier) < 0.1 * xavier and abs(layer.weight.mean().item()) < 0.1 * xavier:
                if layer.bias is not None and not torch.equal(layer.bias, torch.zeros_like(layer.bias)):
                    raise ExerciseFailed(f"after init_weights, {name}'s bias is not all zeros: nn.init.zeros_(module.bias)")
                continue
            if abs(std - default) < 0.05 * default:
                raise ExerciseFailed(
                    f"after init_weights, {name}'s weights still have PyTorch's default init (std {std:.4f}): "
                    "call nn.init.xavier_uniform_(module.weight), which fills it in place"
                )
            if abs(std - kaiming) < 0.05 * kaiming:
                raise ExerciseFailed(
                    f"after init_weights, {name}'s weights have std {std:.4f} = sqrt(2 / fan_in): that is kaiming (He) init; "
                    "this exercise asks for xavier, nn.init.xavier_uniform_"
                )
            raise ExerciseFailed(
                f"after init_weights, {name}'s weights have mean {layer.weight.mean().item():.4f} and std {std:.4f}, "
                f"expected mean 0 and std about {xavier:.4f} = sqrt(2 / (fan_in + fan_out)), xavier with the default gain"
            )


@exercise("make_residual")
def check_make_residual(fn) -> None:
    with _seeded(7), torch.no_grad():
        for c in (4, 6):
            what = f"make_residual({c})"
            block = call(fn, c)
            expect_module(block, what=what, layer_types=[nn.Conv2d])
            convs = [m for m in block.modules() if isinstance(m, nn.Conv2d)]
            if len(convs) != 2:
                raise ExerciseFailed(f"{what} has {len(convs)} Conv2d layer(s), expected 2: f is conv, ReLU, conv")
            for conv in convs:
                if (conv.in_channels, conv.out_channels) != (c, c):
                    raise ExerciseFailed(
                        f"{what} has a Conv2d({conv.in_channels}, {conv.out_channels}, ...): both map {c} channels to {c}, "
                        "so that x + f(x) lines up"
                    )
                if conv.kernel_size != (3, 3):
                    raise ExerciseFailed(f"{what} has a Conv2d with kernel_size={conv.kernel_size}, expected 3")
                if conv.padding not in ((1, 1), "same") or conv.stride != (1, 1):
                    raise ExerciseFailed(
                        f"{what} has a Conv2d with padding={conv.padding} and stride={conv.stride}: use padding=1 (stride 1) "
                        "so each 3x3 convolution keeps the height and width, and x + f(x) lines up"
                    )
            if all(conv.bias is None for conv in convs):
                raise ExerciseFailed(f"{what}'s convolutions have no bias: keep the default bias=True")
            expect_module(block, what=what, n_params=2 * (9 * c * c + c))
            x = torch.randn(2, c, 8, 8)
            x0 = x.clone()
            out = _call(block, x, shown=f"tensor of shape {tuple(x.shape)}", name=f"{what}'s module", kind="module")
            expect_unchanged(x0, x, what=f"{what}'s forward")
            expect_shape(out, x0.shape, what=f"{what}'s output for an input of shape {tuple(x0.shape)}")
            first, second = convs
            hidden = first(x0)
            f = second(torch.relu(hidden))
            expected = x0 + f
            if torch.allclose(out, f, atol=1e-5):
                raise ExerciseFailed(f"{what} returns f(x) alone: add the input back, return x + f(x)")
            if torch.allclose(out, torch.relu(expected), atol=1e-5):
                raise ExerciseFailed(
                    f"{what} applies a ReLU after the addition: this block returns x + f(x) exactly "
                    "(ResNet's basic block adds that ReLU, this exercise does not)"
                )
            if torch.allclose(out, x0 + second(hidden), atol=1e-5):
                raise ExerciseFailed(f"{what} has no ReLU between the two convolutions: f is conv, ReLU, conv")
            expect_tensor(out, expected, what=f"{what}'s output, expected x + f(x)", atol=1e-5)


@exercise("attention")
def check_attention(fn) -> None:
    with _seeded(8):
        cases = [
            (torch.randn(2, 5, 8), torch.randn(2, 7, 8), torch.randn(2, 7, 6)),
            (torch.randn(2, 3, 4, 16), torch.randn(2, 3, 9, 16), torch.randn(2, 3, 9, 16)),
        ]
    for q, k, v in cases:
        what = f"attention(q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)})"
        got = call(fn, q.clone(), k.clone(), v.clone())
        expected = F.scaled_dot_product_attention(q, k, v)
        if isinstance(got, tuple) and len(got) == 2:
            raise ExerciseFailed(f"{what} returned a tuple of 2 (output and weights?): return only the output tensor")
        if isinstance(got, torch.Tensor) and got.shape == expected.shape:
            d = q.shape[-1]
            scores = q @ k.transpose(-2, -1)
            mistakes = [
                (scores, -1, f"the scores are not scaled: divide q @ k^T by math.sqrt(d), d = q.shape[-1] (here {d})"),
                (scores / d, -1, "the scores are divided by d; the scale is 1 / sqrt(d)"),
                (scores * math.sqrt(d), -1, "the scores are multiplied by sqrt(d); divide by it instead"),
                (
                    scores / math.sqrt(d), -2,
                    "softmax over the wrong dimension: each query's weights over the keys must sum to 1, "
                    "so normalise the (..., L, S) scores over their last dimension, softmax(dim=-1)",
                ),
            ]
            if v.shape[-1] != d:
                mistakes.append((scores / math.sqrt(v.shape[-1]), -1, "the scale uses v's size; use q.shape[-1], the size of queries and keys"))
            for wrong_scores, dim, message in mistakes:
                if torch.allclose(got.detach(), wrong_scores.softmax(dim=dim) @ v, atol=1e-5):
                    raise ExerciseFailed(f"{what}: {message}")
        expect_tensor(got, expected, what=what, atol=1e-5)


def _load_models() -> tuple[nn.Module, dict[str, torch.Tensor], nn.Module]:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    body = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8))
    checkpoint = {**body.state_dict(), "classifier.weight": torch.randn(10, 8), "classifier.bias": torch.randn(10)}
    return model, checkpoint, nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))


@exercise("load_partial")
def check_load_partial(fn) -> None:
    with _seeded(9):
        model, checkpoint, twin = _load_models()
    shown = "a 5-layer Sequential, a checkpoint with its first 3 layers and a classifier"
    what = f"load_partial({shown})"
    try:
        got = _call(fn, model, {k: v.clone() for k, v in checkpoint.items()}, shown=shown)
    except ExerciseFailed as err:
        if "Error(s) in loading state_dict" in err.message:
            raise ExerciseFailed(
                f"{what} raised RuntimeError: Error(s) in loading state_dict: pass strict=False, "
                "and load_state_dict loads what matches and returns the keys that did not"
            ) from None
        raise
    if hasattr(got, "missing_keys"):
        raise ExerciseFailed(f"{what} returned the whole result of load_state_dict: return its .missing_keys")
    missing, unexpected = ["4.weight", "4.bias"], ["classifier.weight", "classifier.bias"]
    if isinstance(got, (list, tuple, set)) and sorted(map(str, got)) == sorted(unexpected):
        raise ExerciseFailed(
            f"{what} returned the unexpected keys (in the checkpoint, not in the model): return the missing ones, .missing_keys"
        )
    for key in ("0.weight", "2.bias"):
        if not torch.equal(model.state_dict()[key], checkpoint[key]):
            raise ExerciseFailed(
                f"after {what}, the model's {key} is not the checkpoint's: call model.load_state_dict(state_dict, strict=False) "
                "on the model you were given"
            )
    if not (isinstance(got, list) and sorted(map(str, got)) == sorted(missing)):
        expect_equal(got, missing, what=what)

    shown = "a 5-layer Sequential, a checkpoint of a model just like it"
    got = _call(fn, model, twin.state_dict(), shown=shown)
    expect_equal(got, [], what=f"load_partial({shown})")
    if not torch.equal(model[4].weight, twin[4].weight):
        raise ExerciseFailed(f"after load_partial({shown}), the model's 4.weight is not the checkpoint's")

