"""Lesson 03's checks against the reference solutions, correct alternatives, and the wrong answers learners write."""

import contextlib
import copy
import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from course_utils import lesson03 as L
from lesson_contract import assert_names_fault, assert_passes, contract_tests

PAIRS = [
    (L.check_layer_shapes, L.layer_shapes),
    (L.check_freeze_all_but_last, L.freeze_all_but_last),
    (L.check_init_relu_net, L.init_relu_net),
    (L.check_make_causal_attention, L.make_causal_attention),
    (L.check_make_norm_block, L.make_norm_block),
    (L.check_evaluate, L.evaluate),
    (L.check_load_pretrained, L.load_pretrained),
]


(test_reference_passes, test_stub_is_not_attempted, test_bad_input_is_one_named_line, test_hostile_answers_are_the_learners_fault,
 test_checks_leave_the_learners_random_state_alone, test_checks_are_quick) = contract_tests(PAIRS)


# ---- the checks' own ground truth ----------------------------------------------------------------

def test_hidden_shape_models_run_and_the_reference_predicts_them():
    for model, shape, _ in L._shape_models():
        assert L.layer_shapes(model, shape) == L._predict(model, shape) == L._run_shapes(model, shape)


def test_each_shape_mistake_shows_on_the_hidden_models_and_differs_from_the_others():
    cases = L._shape_models()
    right = [L._run_shapes(m, s) for m, s, _ in cases]
    signatures = {fault: [L._predict(m, s, fault) for m, s, _ in cases] for fault in L._SHAPE_MISTAKES}
    assert all(sig != right for sig in signatures.values())
    assert all(signatures[a] != signatures[b] for a, b in itertools.combinations(signatures, 2))


def test_the_attention_helper_matches_multihead_attention_and_its_mistakes_differ():
    torch.manual_seed(0)
    reference = nn.MultiheadAttention(12, 3, batch_first=True)
    with torch.no_grad():
        reference.in_proj_bias.normal_(0, 0.5)
    module = L.make_causal_attention(12, 3, 9)
    L._load_mha(module, reference)
    x = torch.randn(2, 6, 12)
    with torch.no_grad():
        expected = reference(x, x, x, attn_mask=~torch.ones(6, 6, dtype=torch.bool).tril(), need_weights=False)[0]
        assert torch.allclose(module(x), expected, atol=1e-6)
        outputs = {fault: L._attend(x, module.qkv, module.proj, 3, fault) for fault in [None, *L._ATTENTION_FAULTS]}
    for a, b in itertools.combinations(outputs, 2):
        assert not torch.allclose(outputs[a], outputs[b], atol=1e-4), (a, b)


def test_the_evaluate_problem_has_the_right_counts_it_states_and_more_than_9_classes():
    torch.manual_seed(11)
    model, problems = L._eval_problem()
    model.eval()
    for batches, right in problems:
        with torch.no_grad():
            assert [int((model(x).argmax(-1) == y).sum()) for x, y in batches] == right
    labels = torch.cat([y for batches, _ in problems for _, y in batches])
    assert labels.max() >= 10


def test_the_normal_test_accepts_normal_values_and_rejects_uniform_ones():
    generator = torch.Generator().manual_seed(3)
    weight = torch.empty(40, 8, 3, 5)
    for seed in range(20):
        generator.manual_seed(seed)
        weight.normal_(0, math.sqrt(2 / 120), generator=generator)
        assert L._kaiming_fault("w", weight) is None
    nn.init.kaiming_uniform_(weight, nonlinearity="relu")
    assert "kaiming_uniform_" in L._kaiming_fault("w", weight)
    nn.init.xavier_uniform_(weight)
    assert "uniform" in L._kaiming_fault("w", weight)
    nn.init.xavier_normal_(weight)
    assert "xavier_normal_" in L._kaiming_fault("w", weight)


# ---- layer_shapes ---------------------------------------------------------------------------------

def learner_shapes(*, dilation=True, pool_dilation=True, pairs=True, floor=True, channels=True, linear_last=True,
                   flatten_dims=True, end_dim=True, batch=True, as_float=False, inner=tuple, final_only=False, with_input=False):
    """A learner's layer_shapes, with one or more typical mistakes switched on."""

    def answer(model, input_shape):
        def both(value):
            if isinstance(value, int):
                return value, value
            return (value[0], value[0]) if not pairs else tuple(value)

        shape = list(input_shape)
        shapes = [inner(shape)] if with_input else []
        for layer in model:
            if isinstance(layer, (nn.Conv2d, nn.MaxPool2d, nn.AvgPool2d)):
                k, s, p = both(layer.kernel_size), both(layer.stride), both(layer.padding)
                d = both(getattr(layer, "dilation", 1)) if dilation else (1, 1)
                d = d if pool_dilation or isinstance(layer, nn.Conv2d) else (1, 1)
                for i in (0, 1):
                    top = shape[2 + i] + 2 * p[i] - d[i] * (k[i] - 1) - 1
                    size = top / s[i] + 1 if as_float else (math.ceil(top / s[i]) if not floor else top // s[i]) + 1
                    shape[2 + i] = size
                if isinstance(layer, nn.Conv2d) and channels:
                    shape[1] = layer.out_channels
            elif isinstance(layer, nn.Flatten):
                start = layer.start_dim if flatten_dims else 1
                end = layer.end_dim % len(shape) + 1 if flatten_dims and end_dim else len(shape)
                shape = shape[:start] + [math.prod(shape[start:end])] + shape[end:]
            elif isinstance(layer, nn.Linear):
                shape = shape[:-1] + [layer.out_features] if linear_last else [shape[0], layer.out_features]
            shapes.append(inner(shape if batch else shape[1:]))
        return shapes[-1] if final_only else shapes

    return answer


def shapes_by_running(model, input_shape):
    x, out = torch.zeros(input_shape), []
    for layer in model:
        x = layer(x)
        out.append(tuple(x.shape))
    return out


def shapes_as_sizes(model, input_shape):
    """Correct: torch.Size entries, math.floor, and the conv arithmetic in one helper."""

    def out_size(n, k, s, p, d):
        return math.floor((n + 2 * p - d * (k - 1) - 1) / s) + 1

    def two(v):
        return v if isinstance(v, tuple) else (v, v)

    n, c, h, w = input_shape
    dims, result = [n, c, h, w], []
    for layer in model:
        if hasattr(layer, "kernel_size"):
            k, s, p, d = two(layer.kernel_size), two(layer.stride), two(layer.padding), two(getattr(layer, "dilation", 1))
            dims[-2] = out_size(dims[-2], k[0], s[0], p[0], d[0])
            dims[-1] = out_size(dims[-1], k[1], s[1], p[1], d[1])
            if hasattr(layer, "out_channels"):
                dims[-3] = layer.out_channels
        elif isinstance(layer, nn.Flatten):
            start, stop = layer.start_dim % len(dims), layer.end_dim % len(dims) + 1
            dims = dims[:start] + [math.prod(dims[start:stop])] + dims[stop:]
        elif isinstance(layer, nn.Linear):
            dims[-1] = layer.out_features
        result.append(torch.Size(dims))
    return result


def shapes_by_dispatch(model, input_shape):
    """Correct: one small function per kind of layer."""

    def spatial(shape, layer):
        def get(v, i):
            return v[i] if isinstance(v, tuple) else v

        dil = getattr(layer, "dilation", 1)
        h, w = (
            (shape[-2 + i] + 2 * get(layer.padding, i) - get(dil, i) * (get(layer.kernel_size, i) - 1) - 1) // get(layer.stride, i) + 1
            for i in (0, 1)
        )
        channels = layer.out_channels if isinstance(layer, nn.Conv2d) else shape[-3]
        return shape[:-3] + (channels, h, w)

    def flatten(shape, layer):
        end = layer.end_dim % len(shape)
        return shape[: layer.start_dim] + (math.prod(shape[layer.start_dim : end + 1]),) + shape[end + 1 :]

    rules = {nn.Conv2d: spatial, nn.MaxPool2d: spatial, nn.AvgPool2d: spatial, nn.Flatten: flatten,
             nn.Linear: lambda shape, layer: shape[:-1] + (layer.out_features,)}
    shape, out = tuple(input_shape), []
    for layer in model:
        shape = rules.get(type(layer), lambda shape, layer: shape)(shape, layer)
        out.append(shape)
    return out


@pytest.mark.parametrize("answer", [shapes_as_sizes, shapes_by_dispatch, learner_shapes()])
def test_layer_shapes_accepts(answer):
    assert_passes(L.check_layer_shapes, answer)


@pytest.mark.parametrize("wrong, message", [
    (shapes_by_running, "must not run the model or its layers"),
    (learner_shapes(dilation=False), "ignore dilation"),
    (learner_shapes(pairs=False), "the width uses the height's setting"),
    (learner_shapes(floor=False), "rounded up: PyTorch rounds the division down"),
    (learner_shapes(channels=False), "out_channels channels"),
    (learner_shapes(linear_last=False), "acts on the last dimension only"),
    (learner_shapes(flatten_dims=False), r"merges its start_dim to its end_dim"),
    (learner_shapes(end_dim=False), r"merged every dimension from its start_dim to the last: it stops at its end_dim"),
    (learner_shapes(pool_dilation=False), r"the pooling shapes ignore dilation: MaxPool2d has a dilation too"),
    (learner_shapes(batch=False), "leave out the batch dimension"),
    (learner_shapes(as_float=True), r"holds a float, expected ints: use //"),
    (learner_shapes(inner=list), r"\[0\] is a list, expected a tuple of ints"),
    (learner_shapes(final_only=True), r"is a single shape \(2, 11\): return a list"),
    (learner_shapes(with_input=True), "starts with the input's shape"),
    (learner_shapes(dilation=False, floor=False), r"the output of layer 2, MaxPool2d.*has shape \(2, 10, 9, 15\), got \(2, 10, 10, 15\)"),
    (lambda model, shape: None, "is None: did you forget to `return`"),
])
def test_layer_shapes_names_the_fault(wrong, message):
    assert_names_fault(L.check_layer_shapes, wrong, message)


# ---- freeze_all_but_last --------------------------------------------------------------------------

def freeze_by_name(model):
    last = list(model.named_children())[-1][0]
    for name, p in model.named_parameters():
        p.requires_grad = name.startswith(last + ".")


def freeze_with_loops(model):
    for p in model.parameters():
        p.requires_grad_(False)
    for p in list(model.children())[-1].parameters():
        p.requires_grad_(True)


def freeze_by_identity(model):
    keep = {id(p) for p in list(model.children())[-1].parameters()}
    for p in model.parameters():
        p.requires_grad_(id(p) in keep)


@pytest.mark.parametrize("answer", [freeze_by_name, freeze_with_loops, freeze_by_identity])
def test_freeze_all_but_last_accepts(answer):
    assert_passes(L.check_freeze_all_but_last, answer)


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


def freeze_other_children(model):
    for child in list(model.children())[:-1]:
        child.requires_grad_(False)


def freeze_other_children_and_unfreeze_last(model):
    freeze_other_children(model)
    list(model.children())[-1].requires_grad_(True)


def freeze_and_eval(model):
    L.freeze_all_but_last(model)
    model.eval()


def freeze_in_the_wrong_order(model):
    list(model.children())[-1].requires_grad_(True)
    model.requires_grad_(False)


def freeze_and_reset_statistics(model):
    L.freeze_all_but_last(model)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm1d):
            m.reset_running_stats()


@pytest.mark.parametrize("wrong, message", [
    (lambda m: None, "nothing outside the last child is frozen"),
    (lambda m: m.requires_grad_(False), "every parameter is frozen"),
    (freeze_in_the_wrong_order, "every parameter is frozen"),
    (freeze_last_param, "only 4.bias is trainable"),
    (freeze_last_module, "head.0.weight is frozen, but it belongs to the last child `head`"),
    (freeze_other_children, "head.0.weight is frozen, but it belongs to the last child `head`.*even one that was frozen before"),
    (freeze_other_children_and_unfreeze_last, "temperature is still trainable: it is registered on the model itself"),
    (freeze_a_copy, "returned another model"),
    (freeze_and_eval, "the model is in eval mode, but it was in train mode"),
    (freeze_and_reset_statistics, "the buffer backbone.1.running_mean changed its values"),
    (lambda m: list(m.named_children())[-1].requires_grad_(True), "raised AttributeError"),
])
def test_freeze_all_but_last_names_the_fault(wrong, message):
    assert_names_fault(L.check_freeze_all_but_last, wrong, message)


# ---- init_relu_net --------------------------------------------------------------------------------

def init_with_apply(model):
    def init(module):
        if isinstance(module, (nn.Linear, nn.Conv2d)):
            nn.init.kaiming_normal_(module.weight)  # the defaults (a=0, leaky_relu) give ReLU's gain sqrt(2)
            if module.bias is not None:
                module.bias.data.zero_()

    model.apply(init)


def init_by_hand(model):
    with torch.no_grad():
        for module in model.modules():
            if type(module) in (nn.Conv2d, nn.Linear):
                fan_in = module.weight[0].numel()
                module.weight.normal_(0, math.sqrt(2 / fan_in))
                if module.bias is not None:
                    module.bias.fill_(0)


def init_by_names(model):
    for name, module in model.named_modules():
        if isinstance(module, nn.Conv2d | nn.Linear):
            std = math.sqrt(2.0) / math.sqrt(module.weight.shape[1] * math.prod(module.weight.shape[2:]))
            nn.init.normal_(module.weight, mean=0.0, std=std)
            for bias in [module.bias] if module.bias is not None else []:
                nn.init.constant_(bias, 0.0)


@pytest.mark.parametrize("answer", [init_with_apply, init_by_hand, init_by_names])
def test_init_relu_net_accepts(answer):
    assert_passes(L.check_init_relu_net, answer)


def init_layers(fill, *, kinds=(nn.Conv2d, nn.Linear), zero_bias=True, guard=True):
    def init(model):
        for module in model.modules():
            if isinstance(module, kinds):
                fill(module.weight)
                if zero_bias and (module.bias is not None or not guard):
                    nn.init.zeros_(module.bias)

    return init


def init_every_matrix(model):
    for p in model.parameters():
        if p.dim() >= 2:
            nn.init.kaiming_normal_(p, nonlinearity="relu")


def init_anything_with_a_weight(model):
    for module in model.modules():
        if getattr(module, "weight", None) is not None:
            nn.init.kaiming_normal_(module.weight, nonlinearity="relu")


def init_and_reset_norms(model):
    L.init_relu_net(model)
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.reset_parameters()


def init_and_reset_statistics(model):
    L.init_relu_net(model)
    model.norm.reset_running_stats()


def init_new_parameters(model):
    for module in model.modules():
        if isinstance(module, (nn.Conv2d, nn.Linear)):
            fan_in = module.weight[0].numel()
            module.weight = nn.Parameter(torch.randn_like(module.weight) * math.sqrt(2 / fan_in))


def init_without_no_grad(model):
    for module in model.modules():
        if isinstance(module, (nn.Conv2d, nn.Linear)):
            module.weight.normal_(0, math.sqrt(2 / module.weight[0].numel()))


def init_conv_fan_from_channels(model):
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (nn.Conv2d, nn.Linear)):
                module.weight.normal_(0, math.sqrt(2 / module.weight.shape[1]))
                if module.bias is not None:
                    module.bias.zero_()


def init_a_copy(model):
    other = copy.deepcopy(model)
    L.init_relu_net(other)
    return other


@pytest.mark.parametrize("wrong, message", [
    (lambda m: None, "nothing changed: fill the weights and biases"),
    (init_a_copy, "the model is unchanged, and you returned another one"),
    (init_layers(nn.init.xavier_normal_), r"std 0\.05\d+ = sqrt\(2 / \(fan_in \+ fan_out\)\): that is xavier_normal_"),
    (init_layers(nn.init.xavier_uniform_), r"stem's weights are uniform \(std"),
    (init_layers(lambda w: nn.init.kaiming_uniform_(w, nonlinearity="relu")), r"uniform \(kaiming's spread: that is kaiming_uniform_\)"),
    (init_layers(lambda w: nn.init.kaiming_normal_(w, mode="fan_out", nonlinearity="relu")), "fan_out = 600: use mode='fan_in'"),
    (init_layers(lambda w: nn.init.kaiming_normal_(w, nonlinearity="linear")), r"the gain for ReLU is sqrt\(2\)"),
    (init_layers(lambda w: nn.init.kaiming_normal_(w, nonlinearity="tanh")), "the gain for tanh"),
    (init_layers(nn.init.normal_), r"std (0\.9|1\.0)\d+ = 1: pass the std"),
    (init_conv_fan_from_channels, r"sqrt\(2 / in_channels\): a Conv2d's fan_in is in_channels × kernel height × kernel width"),
    (init_layers(lambda w: nn.init.kaiming_normal_(w), guard=False), "bias=False has bias = None"),
    (init_layers(lambda w: nn.init.kaiming_normal_(w), zero_bias=False), "conv.bias still has its old values"),
    (init_layers(lambda w: nn.init.kaiming_normal_(w), kinds=nn.Linear), "stem.weight still has its old values"),
    (init_every_matrix, "the parameter temperature changed, and it belongs to the model itself, in no layer"),
    (init_layers(nn.init.kaiming_normal_, kinds=(nn.Conv2d, nn.Linear, nn.Embedding), zero_bias=False),
     "the parameter embed.weight changed, and it belongs to an Embedding: change only Conv2d and Linear layers"),
    (init_anything_with_a_weight, "kaiming needs a weight of 2 or more dimensions"),
    (init_and_reset_norms, "the parameter norm.weight changed, and it belongs to a BatchNorm2d"),
    (init_and_reset_statistics, "the buffer norm.running_mean changed"),
    (init_new_parameters, "stem.weight is a new tensor: fill the existing one in place"),
    (init_without_no_grad, r"a leaf Variable.*inside `with torch.no_grad\(\):`"),
])
def test_init_relu_net_names_the_fault(wrong, message):
    assert_names_fault(L.check_init_relu_net, wrong, message)


def test_init_relu_net_names_a_changed_parameter_of_the_model_itself():
    def init_and_touch_temperature(model):
        L.init_relu_net(model)
        with torch.no_grad():
            model.temperature.zero_()

    assert_names_fault(L.check_init_relu_net, init_and_touch_temperature, "temperature changed, and it belongs to the model itself")


# ---- make_causal_attention ------------------------------------------------------------------------

def causal(*, mask="tril", fill=float("-inf"), scale="head", split="right", join="right", order="qkv", dim=-1,
           project=True, slice_mask=True, keep="buffer", persistent=False, fused=True, qkv_bias=True, returns_weights=False,
           sdpa=False, in_place=False):
    """A learner's make_causal_attention, with one or more typical mistakes switched on."""

    def make(embed_dim, num_heads, max_len):
        class Attention(nn.Module):
            def __init__(self):
                super().__init__()
                if fused:
                    self.qkv = nn.Linear(embed_dim, 3 * embed_dim, bias=qkv_bias)
                else:
                    self.q, self.k, self.v = (nn.Linear(embed_dim, embed_dim) for _ in range(3))
                self.proj = nn.Linear(embed_dim, embed_dim)
                ones = torch.ones(max_len, max_len)
                allowed = {"tril": ones.tril(), "triu": ones.triu(), "strict": ones.tril(-1), None: ones}[mask].bool()
                if keep == "buffer":
                    self.register_buffer("allowed", allowed, persistent=persistent)
                elif keep == "parameter":
                    self.allowed = nn.Parameter(allowed.float(), requires_grad=False)
                elif keep == "plain":
                    self.allowed = allowed

            def forward(self, x):
                n, length, e = x.shape
                d = e // num_heads
                if fused:
                    parts = dict(zip(order, self.qkv(x).chunk(3, dim=-1)))
                else:
                    parts = {"q": self.q(x), "k": self.k(x), "v": self.v(x)}

                def heads(t):
                    return t.reshape(n, num_heads, length, d) if split == "wrong" else t.reshape(n, length, num_heads, d).transpose(1, 2)

                q, k, v = heads(parts["q"]), heads(parts["k"]), heads(parts["v"])
                allowed = self.allowed.bool()
                allowed = allowed[:length, :length] if slice_mask else allowed
                if sdpa:
                    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
                else:
                    scores = q @ k.transpose(-2, -1) / {"head": math.sqrt(d), "embed": math.sqrt(e), None: 1.0}[scale]
                    if mask is None:
                        weights = scores.softmax(dim=dim)
                    elif fill == "after":
                        weights = scores.softmax(dim=dim) * allowed
                    else:
                        weights = scores.masked_fill(~allowed, fill).softmax(dim=dim)
                    out = weights @ v
                out = out.reshape(n, length, e) if join == "wrong" else out.transpose(1, 2).reshape(n, length, e)
                out = self.proj(out) if project else out
                if in_place:
                    x.mul_(0)
                return (out, None) if returns_weights else out

        return Attention()

    return make


def causal_with_einsum(embed_dim, num_heads, max_len):
    """Correct: einsum, an additive float mask (0 or -inf), unflatten."""

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(embed_dim, 3 * embed_dim)
            self.proj = nn.Linear(embed_dim, embed_dim)
            future = torch.triu(torch.full((max_len, max_len), float("-inf")), diagonal=1)
            self.register_buffer("bias", future, persistent=False)

        def forward(self, x):
            length = x.shape[1]
            q, k, v = self.qkv(x).unflatten(-1, (3, num_heads, -1)).unbind(dim=2)  # each (N, L, heads, d)
            scores = torch.einsum("nqhd,nkhd->nhqk", q, k) / q.shape[-1] ** 0.5 + self.bias[:length, :length]
            out = torch.einsum("nhqk,nkhd->nqhd", scores.softmax(-1), v)
            return self.proj(out.flatten(-2))

    return Attention()


def causal_with_where(embed_dim, num_heads, max_len):
    """Correct: split with view/permute, a (1, 1, max_len, max_len) float mask of 0/1, torch.where and a large negative number."""

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(embed_dim, 3 * embed_dim)
            self.proj = nn.Linear(embed_dim, embed_dim)
            mask = torch.tril(torch.ones(max_len, max_len)).view(1, 1, max_len, max_len)  # nanoGPT's layout
            self.register_buffer("mask", mask, persistent=False)

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = self.qkv(x).split(c, dim=2)
            q, k, v = (z.view(b, t, num_heads, c // num_heads).permute(0, 2, 1, 3) for z in (q, k, v))
            att = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(k.size(-1)))
            att = torch.where(self.mask[:, :, :t, :t] == 0, torch.tensor(-1e9), att)
            y = F.softmax(att, dim=-1) @ v
            return self.proj(y.permute(0, 2, 1, 3).contiguous().view(b, t, c))

    return Attention()


@pytest.mark.parametrize("answer", [causal(), causal_with_einsum, causal_with_where])
def test_make_causal_attention_accepts(answer):
    assert_passes(L.check_make_causal_attention, answer)


@pytest.mark.parametrize("wrong, message", [
    (causal(mask=None), "there is no causal mask"),
    (causal(mask="triu"), "the mask hides the past instead of the future"),
    (causal(mask="strict"), "NaN at position 0, which then attends to nothing"),
    (causal(scale="embed"), r"divided by sqrt\(embed_dim\)"),
    (causal(scale=None), "the scores are not scaled"),
    (causal(fill="after"), "the mask is applied after the softmax"),
    (causal(fill=0.0), r"exp\(0\) still gives them weight"),
    (causal(split="wrong"), "the heads are split wrongly"),
    (causal(join="wrong"), "the heads are joined wrongly"),
    (causal(order="kqv"), "in the wrong order: it is q, then k, then v"),
    (causal(order="vkq"), "in the wrong order"),
    (causal(dim=-2), "the softmax runs over the queries"),
    (causal(project=False), "proj is never applied"),
    (causal(slice_mask=False), r"the \(9, 9\) mask meets \(6, 6\) scores; slice it"),
    (causal(keep="parameter"), "registers the mask as a Parameter"),
    (causal(keep="plain"), "keeps the mask in a plain attribute, allowed"),
    (causal(persistent=True), "state_dict holds allowed: register the mask with persistent=False"),
    (causal(fused=False), r"\.qkv is nothing, expected nn.Linear\(12, 36\)"),
    (causal(qkv_bias=False), r"\.qkv has no bias"),
    (causal(sdpa=True), "calls F.scaled_dot_product_attention"),
    (causal(returns_weights=True), "is a tuple: return only the output tensor"),
    (causal(in_place=True), "modified its input in place"),
    (causal(mask="triu", scale="embed"), r"wrong values, e\.g\. at index"),
    (lambda e, h, n: nn.MultiheadAttention(e, h, batch_first=True), r"\.qkv is nothing"),
])
def test_make_causal_attention_names_the_fault(wrong, message):
    assert_names_fault(L.check_make_causal_attention, wrong, message)


def test_make_causal_attention_names_a_wrapped_multihead_attention():
    def wrapped(e, h, n):
        module = causal()(e, h, n)
        module.inner = nn.MultiheadAttention(e, h, bias=False, batch_first=True)
        module.inner.requires_grad_(False)
        return module

    assert_names_fault(L.check_make_causal_attention, wrapped, "holds an nn.MultiheadAttention")


# ---- make_norm_block ------------------------------------------------------------------------------

def test_the_hidden_norm_cases_tell_every_order_apart():
    for dim, hidden, norm_first, shape in L._norm_cases():
        torch.manual_seed(dim)
        f, norm, x = L._Sublayer(dim, hidden), nn.LayerNorm(dim), 3 * torch.randn(shape) + 1.5
        with torch.no_grad():
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.uniform_(-0.5, 0.5)
            outputs = L._orders(x, f, norm)
            outputs["plain"] = L._orders(x, f, lambda t: F.layer_norm(t, (dim,)))["pre" if norm_first else "post"]
        for a, b in itertools.combinations(outputs, 2):
            assert not torch.allclose(outputs[a], outputs[b], atol=1e-3), (a, b)


def norm_block(combine, *, register=True, norm="module", dim_of=None, affine=True):
    """A learner's make_norm_block whose forward is combine(x, f, norm, norm_first)."""

    def make(f, dim, norm_first):
        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                if register:
                    self.f = f
                else:
                    self.parts = [f]
                if norm == "module":
                    self.norm = nn.LayerNorm(dim_of or dim, elementwise_affine=affine)

            def forward(self, x):
                sub = self.f if register else self.parts[0]
                if norm == "fresh":
                    layer = nn.LayerNorm(dim)
                elif norm == "functional":
                    layer = lambda t: F.layer_norm(t, (dim,))  # noqa: E731
                else:
                    layer = self.norm
                return combine(x, sub, layer, norm_first)

        return Block()

    return make


def _pre(x, f, norm):
    return x + f(norm(x))


def _post(x, f, norm):
    return norm(x + f(x))


def norm_two_classes(f, dim, norm_first):  # correct: one class per order, chosen by the flag
    class PreNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln, self.sublayer = nn.LayerNorm(dim), f

        def forward(self, x):
            return x + self.sublayer(self.ln(x))

    class PostNorm(PreNorm):
        def forward(self, x):
            return self.ln(x + self.sublayer(x))

    return PreNorm() if norm_first else PostNorm()


def norm_functional_with_weights(f, dim, norm_first):  # correct: F.layer_norm with the module's own scale and shift
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.f, self.norm = f, nn.LayerNorm(dim)
            self.norm_first = norm_first

        def forward(self, x):
            def normed(t):
                return F.layer_norm(t, self.norm.normalized_shape, self.norm.weight, self.norm.bias, self.norm.eps)

            if self.norm_first:
                return x + self.f(normed(x))
            return normed(x + self.f(x))

    return Block()


def norm_in_steps(f, dim, norm_first):  # correct: a Sequential-style layout, two steps
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleDict({"f": f, "norm": nn.LayerNorm(dim)})

        def forward(self, x):
            h = self.layers["norm"](x) if norm_first else x
            y = x + self.layers["f"](h)
            return y if norm_first else self.layers["norm"](y)

    return Block()


def norm_both_computed(f, dim, norm_first):
    block = norm_block(lambda x, f, n, first: [_post(x, f, n), _pre(x, f, n)][first])(f, dim, norm_first)
    return block


def norm_in_place(f, dim, norm_first):
    def combine(x, f, n, first):
        if first:
            x += f(n(x))
            return x
        return n(x + f(x))

    return norm_block(combine)(f, dim, norm_first)


@pytest.mark.parametrize("answer", [norm_two_classes, norm_functional_with_weights, norm_in_steps])
def test_make_norm_block_accepts(answer):
    assert_passes(L.check_make_norm_block, answer)


@pytest.mark.parametrize("wrong, message", [
    (norm_block(lambda x, f, n, first: _post(x, f, n) if first else _pre(x, f, n)),
     r"norm_first=True\) built the post-norm order, norm\(x \+ f\(x\)\); norm_first=True asks for the norm first, inside the branch: "
     r"the pre-norm order, x \+ f\(norm\(x\)\)"),
    (norm_block(lambda x, f, n, first: _pre(x, f, n)),
     r"make_norm_block\(f, 6, norm_first=False\) built the pre-norm order, x \+ f\(norm\(x\)\); norm_first=False asks for the norm last"),
    (norm_block(lambda x, f, n, first: _post(x, f, n)), r"norm_first=True\) built the post-norm order"),
    (norm_block(lambda x, f, n, first: n(x) + f(n(x)) if first else _post(x, f, n)), "adds norm\\(x\\) to the branch.*the skip carries x itself"),
    (norm_block(lambda x, f, n, first: f(n(x)) if first else n(f(x))), r"returns f\(norm\(x\)\) with no skip connection"),
    (norm_block(lambda x, f, n, first: _pre(x, f, n) if first else n(f(x))), r"returns norm\(f\(x\)\) with no skip connection"),
    (norm_block(lambda x, f, n, first: x + n(f(x))), r"returns x \+ norm\(f\(x\)\), which normalises f's output"),
    (norm_block(lambda x, f, n, first: n(x + f(n(x))) if first else _post(x, f, n)), "applies the norm both to f's input and to the sum"),
    (norm_block(lambda x, f, n, first: _pre(x, f, n) if first else _post(x, f, n), norm="fresh"), "holds no nn.LayerNorm of its own"),
    (norm_block(lambda x, f, n, first: _pre(x, f, n) if first else _post(x, f, n), norm="functional"), "holds no nn.LayerNorm of its own"),
    (norm_block(lambda x, f, n, first: _pre(x, f, n) if first else _post(x, f, n), register=False), "does not hold f as a sub-module"),
    (norm_block(lambda x, f, n, first: _pre(x, f, n) if first else _post(x, f, n), affine=False), "has no learnable scale and shift"),
    (norm_block(lambda x, f, n, first: _pre(x, f, n) if first else _post(x, f, n), dim_of=1), r"normalises over \(1,\), expected \(6,\)"),
    (norm_both_computed, "called f 2 times: call it once per forward"),
    (norm_in_place, "modified its input in place"),
    (lambda f, dim, norm_first: f, "holds no nn.LayerNorm of its own"),
])
def test_make_norm_block_names_the_fault(wrong, message):
    assert_names_fault(L.check_make_norm_block, wrong, message)


def test_make_norm_block_names_a_norm_without_its_weights():
    def make(f, dim, norm_first):
        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                self.f, self.norm = f, nn.LayerNorm(dim)

            def forward(self, x):
                def normed(t):
                    return F.layer_norm(t, (dim,))

                return x + self.f(normed(x)) if norm_first else normed(x + self.f(x))

        return Block()

    assert_names_fault(L.check_make_norm_block, make, "ignores the LayerNorm's own weight and bias")


# ---- evaluate -------------------------------------------------------------------------------------

def evaluate_a_copy(model, batches):
    clone = copy.deepcopy(model).eval()
    with torch.inference_mode():
        right = sum((clone(x).argmax(1) == y).sum().item() for x, y in batches)
    return right / sum(y.numel() for _, y in batches)


def evaluate_all_at_once(model, batches):
    modes = [m.training for m in model.modules()]
    try:
        model.eval()
        with torch.no_grad():
            logits = torch.cat([model(x) for x, _ in batches])
        labels = torch.cat([y for _, y in batches])
        return (logits.argmax(dim=1) == labels).float().mean().item()
    finally:
        for m, mode in zip(model.modules(), modes):
            m.train(mode)


def evaluate_with_train_calls(model, batches):
    was = {name: m.training for name, m in model.named_modules()}
    model.train(False)
    right = total = 0
    for x, y in batches:
        with torch.no_grad():
            right += int((model(x).max(dim=1).indices == y).sum())
        total += y.shape[0]
    for name, m in model.named_modules():
        m.training = was[name]
    return float(right) / total


@pytest.mark.parametrize("answer", [evaluate_a_copy, evaluate_all_at_once, evaluate_with_train_calls])
def test_evaluate_accepts(answer):
    assert_passes(L.check_evaluate, answer)


def learner_evaluate(*, eval_mode=True, no_grad=True, restore="each", average="samples", returns="float", freeze=False,
                     global_off=False, global_on_after=False):
    """A learner's evaluate, with one or more typical mistakes switched on."""

    def evaluate(model, batches):
        modes = {m: m.training for m in model.modules()}
        was_training = model.training
        if eval_mode:
            model.eval()
        if freeze:
            model.requires_grad_(False)
        if global_off:
            torch.set_grad_enabled(False)
        rights, sizes = [], []
        for x, y in batches:
            with torch.no_grad() if no_grad else contextlib.nullcontext():
                rights.append((model(x).argmax(dim=-1) == y).sum().item())
            sizes.append(len(y))
        if restore == "each":
            for m, mode in modes.items():
                m.training = mode
        elif restore == "top":
            model.train(was_training)
        elif restore == "train":
            model.train()
        if global_on_after:
            torch.set_grad_enabled(True)
        if average == "batches":
            accuracy = sum(r / s for r, s in zip(rights, sizes)) / len(sizes)
        elif average == "full batches":
            accuracy = sum(rights) / (len(sizes) * sizes[0])
        else:
            accuracy = sum(rights) / sum(sizes)
        return {"float": accuracy, "tensor": torch.tensor(accuracy), "count": sum(rights), "percent": 100 * accuracy}[returns]

    return evaluate


@pytest.mark.parametrize("wrong, message", [
    (learner_evaluate(eval_mode=False), "ran the model in train mode: switch the model to eval mode"),
    (learner_evaluate(no_grad=False), r"gradient tracking on: run it under torch\.no_grad\(\)"),
    (learner_evaluate(global_off=True), "left gradient tracking switched off for everything after it"),
    (learner_evaluate(global_off=True, no_grad=False, global_on_after=True),
     r"called inside the caller's torch.no_grad\(\)\) switched gradient tracking on for the code after it, which had it off"),
    (learner_evaluate(restore=None), "the model is in eval mode, but it was in train mode: put back the mode the model had"),
    (learner_evaluate(restore="train"), r"the model is in train mode, but it was in eval mode: put back the mode the model had \(eval\)"),
    (learner_evaluate(restore="top"), r"'1' \(BatchNorm1d\) is in train mode, but it was in eval mode: model\.train\(\) sets every sub-module"),
    (learner_evaluate(freeze=True), "0.weight.requires_grad is False, but it was True"),
    (learner_evaluate(average="batches"), "averaged the per-batch accuracies"),
    (learner_evaluate(average="full batches"), "divided by the number of batches times the batch size"),
    (learner_evaluate(returns="count"), "returned 11, the number of right predictions"),
    (learner_evaluate(returns="tensor"), r"is a tensor, expected a Python float: call \.item\(\)"),
    (learner_evaluate(returns="percent"), "returned a percentage"),
    (lambda model, batches: sum((model(x).argmax(0)[: len(y)] == y).sum().item() for x, y in batches) / 19,
     r"ran the model in train mode"),
    (learner_evaluate(average="batches", returns="percent"), r"expected accuracy 0\.578947 \(11 of 19 right\), got 66\.6"),
])
def test_evaluate_names_the_fault(wrong, message):
    assert_names_fault(L.check_evaluate, wrong, message)


def test_evaluate_names_batchnorm_on_one_sample_in_train_mode():
    def eval_only_when_training_is_false(model, batches):
        # forgets eval() when the model is already ... in train mode, and calls it on the BatchNorm only
        model[1].eval()
        with torch.no_grad():
            return L.evaluate(model, batches)

    assert_names_fault(L.check_evaluate, eval_only_when_training_is_false, r"'1' \(BatchNorm1d\) is in eval mode, but it was in train mode")


# ---- load_pretrained ------------------------------------------------------------------------------

def load_generic(make_model, path):
    """Correct: materialise every module that still holds meta tensors, one module at a time."""
    with torch.device("meta"):
        model = make_model()
    model.load_state_dict(torch.load(path, mmap=True, weights_only=True, map_location="cpu"), strict=False, assign=True)
    for module in model.modules():
        if any(t.is_meta for t in itertools.chain(module.parameters(recurse=False), module.buffers(recurse=False))):
            module.to_empty(device="cpu", recurse=False)
            module.reset_parameters()
    return model


def load_with_default_device(make_model, path):
    """Correct: the default device set to meta and put back."""
    torch.set_default_device("meta")
    try:
        model = make_model()
    finally:
        torch.set_default_device(None)
    state = torch.load(path, mmap=True)  # relies on the default, weights_only=True: a learner may too
    result = model.load_state_dict(state, assign=True, strict=False)
    for key in result.missing_keys:
        owner = model.get_submodule(key.rsplit(".", 1)[0])
        if any(p.is_meta for p in owner.parameters()):
            owner.to_empty(device=torch.device("cpu"))
            owner.reset_parameters()
    return model


def load_with_filtered_keys(make_model, path):
    """Correct: keep only the keys the model has, then rebuild the missing layers from their settings."""
    with torch.device("meta"):
        model = make_model()
    state = {k: v for k, v in torch.load(path, mmap=True).items() if k in model.state_dict()}
    missing = model.load_state_dict(state, strict=False, assign=True).missing_keys
    for name in sorted({k.rpartition(".")[0] for k in missing}):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        old = getattr(parent, child)
        setattr(parent, child, nn.Linear(old.in_features, old.out_features))
    return model


@pytest.mark.parametrize("answer", [load_generic, load_with_default_device, load_with_filtered_keys])
def test_load_pretrained_accepts(answer):
    assert_passes(L.check_load_pretrained, answer)


def learner_load(*, meta="context", mmap=True, assign=True, strict=False, head="reset", after=None):
    """A learner's load_pretrained, with one or more typical mistakes switched on."""

    def load(make_model, path):
        if meta == "context":
            with torch.device("meta"):
                model = make_model()
        elif meta == "to":
            model = make_model().to("meta")
        elif meta == "global":
            torch.set_default_device("meta")
            model = make_model()
        elif meta == "twice":
            with torch.device("meta"):
                model = make_model()
            fresh = make_model()
        else:
            model = make_model()
        if after == "to_empty first":
            model.to_empty(device="cpu")
        state = torch.load(path, mmap=mmap)
        missing = model.load_state_dict(state, strict=strict, assign=assign).missing_keys
        for name in {k.rpartition(".")[0] for k in missing}:
            layer = model.get_submodule(name)
            if head == "reset":
                layer.to_empty(device="cpu")
                layer.reset_parameters()
            elif head == "empty":
                layer.to_empty(device="cpu")
                with torch.no_grad():
                    for p in layer.parameters():
                        p.fill_(0.0)
            elif head == "xavier":
                layer.to_empty(device="cpu")
                nn.init.xavier_uniform_(layer.weight)
                nn.init.zeros_(layer.bias)
            elif head == "fresh":
                layer.load_state_dict(fresh.get_submodule(name).state_dict(), assign=True)
        if head == "hard-coded":
            model.head = nn.Linear(24, 13)
        if after == "unfreeze":
            model.requires_grad_(True)
        return model

    return load


@pytest.mark.parametrize("wrong, message", [
    (learner_load(meta=None), "called make_model\\(\\) on the cpu device, which allocates and initialises every weight"),
    (learner_load(meta="to"), "called make_model\\(\\) on the cpu device"),
    (learner_load(meta="global"), "left the default device at meta"),
    (learner_load(meta="twice", head="fresh"), "called make_model\\(\\) 2 times"),
    (learner_load(strict=True), (r"raised RuntimeError: Error\(s\) in loading state_dict for _Finetuned: \(the checkpoint lacks "
                                 r"the new head and holds the old classifier: strict=False loads what matches")),
    (learner_load(assign=False), r"scale is still on the meta device, though the checkpoint holds it: load_state_dict\(\.\.\., assign=True\)"),
    (learner_load(mmap=False), "the weights are not the tensors mapped from the file"),
    (learner_load(after="to_empty first", assign=False), "gave scale memory before load_state_dict filled it from the checkpoint"),
    (learner_load(after="to_empty first"), r"gave scale memory before load_state_dict filled it.*load first \(assign=True\), then give memory \(to_empty\) only to the layers"),
    (learner_load(head=None), "head.weight is still on the meta device: the checkpoint lacks it"),
    (learner_load(head="empty"), r"head.weight does not hold a new layer's values, uniform within ±0\.2041"),
    (learner_load(head="xavier"), r"head.weight does not hold a new layer's values"),
    (learner_load(head="hard-coded"), "classifier.0.weight is still on the meta device: the checkpoint lacks it"),
    (learner_load(after="unfreeze"), "body.0.weight.requires_grad is True, but make_model set it to False"),
    (lambda make_model, path: None, "never called make_model"),
])
@pytest.mark.filterwarnings("ignore:for .*copying from a non-meta parameter:UserWarning")  # PyTorch's own hint to the learner
def test_load_pretrained_names_the_fault(wrong, message):
    assert_names_fault(L.check_load_pretrained, wrong, message)


def test_load_pretrained_restores_the_default_device_it_finds():
    L.check_load_pretrained.verdict(learner_load(meta="global"))
    assert torch.get_default_device() == torch.device("cpu")
    assert torch.empty(1).device.type == "cpu"


def test_load_pretrained_names_buffers_that_were_not_loaded():
    def load_parameters_only(make_model, path):
        model = L.load_pretrained(make_model, path)
        with torch.no_grad():
            model.body[1].running_var.fill_(1.0)
        return model

    assert_names_fault(L.check_load_pretrained, load_parameters_only, "the buffer body.1.running_var does not hold the checkpoint's values")
