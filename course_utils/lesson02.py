"""Lesson 02 (autograd): reference solutions, the checks for its exercises, and the graph figure."""

import warnings
from collections.abc import Callable
from typing import Any

import torch

from course_utils.tooling.checks import (
    ExerciseFailed,
    a_type,
    call,
    exercise,
    expect_shape,
    expect_tensor,
    scoreboard_for,
)
from course_utils.tooling.language import N_, _, ngettext

scoreboard = scoreboard_for(__name__)  # the lesson's last cell: this session's verdicts

# Reference solutions. The checks compare the learner's answers with these.


def count_ops(t: torch.Tensor) -> dict[str, int]:
    """How many backward nodes of each kind t's graph holds, each node once, AccumulateGrad left out."""
    counts: dict[str, int] = {}
    seen = set()
    todo = [t.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        name = type(node).__name__
        if name != "AccumulateGrad":
            counts[name] = counts.get(name, 0) + 1
        todo.extend(parent for parent, _index in node.next_functions)
    return counts


def jacobian(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The (m, n) Jacobian of a 1-D y with respect to a 1-D leaf x, one pass through y's graph per row."""
    rows = []
    for v in torch.eye(len(y), dtype=y.dtype):
        (row,) = torch.autograd.grad(y, x, v, retain_graph=True)  # the caller may still backpropagate through y
        rows.append(row)
    return torch.stack(rows)


def grad_at(f: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """The gradient of the scalar function f at x, as a plain tensor; the caller's x is left alone."""
    x = x.detach().requires_grad_()
    (grad,) = torch.autograd.grad(f(x), x)
    return grad


def frozen_features(encoder: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, batch_size: int) -> torch.Tensor:
    """encoder's features of every row of x, batch_size rows at a time, recorded in no graph: a constant for a head to train on."""
    batches = []
    with torch.no_grad():  # not inference_mode: the head's backward will save these features
        for start in range(0, len(x), batch_size):
            batches.append(encoder(x[start : start + batch_size]))
    return torch.cat(batches)


class LeakyReLU(torch.autograd.Function):
    """max(x, slope * x) with a hand-written backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, slope: float) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.slope = slope
        return torch.where(x > 0, x, slope * x)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (x,) = ctx.saved_tensors
        grad_x = torch.where(x > 0, grad_output, ctx.slope * grad_output)
        return grad_x, None


def leaky_relu(x: torch.Tensor, slope: float = 0.01) -> torch.Tensor:
    """Leaky ReLU through the custom LeakyReLU Function."""
    return LeakyReLU.apply(x, slope)


def round_ste(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest integer, with a straight-through (identity) gradient."""
    return x + (x.round() - x).detach()


def nan_culprit(f: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> str | None:
    """The name of the backward node that first outputs NaN when f(x).sum() is backpropagated to x, or None."""
    x = x.detach().requires_grad_()
    try:
        with torch.autograd.detect_anomaly():
            torch.autograd.grad(f(x).sum(), x)
    except RuntimeError as err:  # "Function 'SqrtBackward0' returned nan values in its 0th output."
        return str(err).split("'")[1]
    return None


# The figure of section 2.


def _graph(root) -> tuple[list, list[tuple]]:
    """The nodes of the graph behind the node `root`, each once in breadth-first order, and its distinct edges."""
    nodes, edges, queue = [root], [], [root]
    while queue:
        node = queue.pop(0)
        for parent, _index in node.next_functions:
            if parent is None:
                continue
            if (node, parent) not in edges:
                edges.append((node, parent))
            if parent not in nodes:
                nodes.append(parent)
                queue.append(parent)
    return nodes, edges


class _NoGradient:
    """Stands in the figure for a None in next_functions: an input that needs no gradient."""


def draw_graph(root: torch.Tensor, names: dict[str, torch.Tensor] | None = None, *, ax: Any = None, title: str = "") -> Any:
    """Draw the backward graph behind the tensor `root`: a box per node, an arrow per link backward() follows; return the Axes."""
    import matplotlib.pyplot as plt  # here, not at the top: the checker imports this module and needs no matplotlib

    if root.grad_fn is None:
        raise ValueError("root has no grad_fn: it is a leaf or needs no gradient, so there is no graph to draw")
    names = names or {}
    nodes, edges = _graph(root.grad_fn)
    for node in list(nodes):  # each None in next_functions gets a box of its own
        for parent, _index in node.next_functions:
            if parent is None:
                stand_in = _NoGradient()
                nodes.append(stand_in)
                edges.append((node, stand_in))
    depth = {node: 0 for node in nodes}
    for _node in nodes:  # the longest path from the root, so that every arrow points down
        for child, parent in edges:
            depth[parent] = max(depth[parent], depth[child] + 1)
    layers: dict[int, list] = {}
    for node in nodes:
        layers.setdefault(depth[node], []).append(node)
    where = {node: (i - (len(layer) - 1) / 2, -level) for level, layer in layers.items() for i, node in enumerate(layer)}
    if ax is None:
        _figure, ax = plt.subplots(figsize=(2.2 * max(map(len, layers.values())) + 1, 0.9 * len(layers) + 0.6))
    boxes = {}
    for node in nodes:
        style = {"boxstyle": "round,pad=0.35", "facecolor": "#dbe9f6", "edgecolor": "0.3"}
        label = type(node).__name__
        if isinstance(node, _NoGradient):
            label = "None\n(needs no gradient)"
            style.update(facecolor="white", edgecolor="0.6", linestyle="--")
        elif hasattr(node, "variable"):  # AccumulateGrad: where the gradient lands in a leaf's .grad
            leaf = next((name for name, t in names.items() if t is node.variable), "a leaf")
            label, style["facecolor"] = f"{label}\n-> {leaf}.grad", "#d9f0d3"
        elif node is root.grad_fn:
            style["facecolor"] = "#fde0c5"
        boxes[node] = ax.text(*where[node], label, ha="center", va="center", fontsize=8.5, bbox=style,
                              color="0.45" if isinstance(node, _NoGradient) else "black")
    for child, parent in edges:
        dashed = isinstance(parent, _NoGradient)
        ax.annotate("", xy=where[parent], xytext=where[child], arrowprops={
            "arrowstyle": "-|>", "color": "0.6" if dashed else "0.3", "linestyle": "--" if dashed else "-",
            "patchA": boxes[child].get_bbox_patch(), "patchB": boxes[parent].get_bbox_patch(), "shrinkA": 2, "shrinkB": 2})
    half = max(len(layer) for layer in layers.values()) / 2
    ax.set_xlim(-half - 0.1, half + 0.1)
    ax.set_ylim(-max(layers) - 0.6, 0.6)
    ax.axis("off")
    if title:
        ax.set_title(title, fontsize=9, family="monospace")
    return ax


# Helpers for the checks.

# Autograd's wording of the errors this lesson's exercises run into, and what they mean there.
# The advice is translated when it is shown (call's error_hint, _grad_through); N_ marks it for the catalog.
HINTS = {
    "a leaf Variable that requires grad is being used in an in-place operation": N_(
        "an in-place change of a leaf that requires grad must run under torch.no_grad()"
    ),
    "does not require grad and does not have a grad_fn": N_(
        "backward() needs a result computed from a tensor that requires grad: call requires_grad_() on your leaf, and look for a .detach() that cut the graph"
    ),
    "Trying to backward through the graph a second time": N_("run the forward pass again, or pass retain_graph=True to every pass but the last"),
    "grad can be implicitly created only for scalar outputs": N_(
        "the output is not a scalar: reduce it (.sum()) or pass a gradient of its shape, the v of a vector-Jacobian product"
    ),
    "object has no attribute 'next_functions'": N_("grad_fn is None for a leaf and for a tensor that needs no gradient: such a tensor has no graph"),
    "incorrect number of gradients": N_("backward() returns one gradient per input of forward(): `return grad_x, None`, None for the number slope"),
    "modified by an inplace operation": N_("an in-place op changed a tensor autograd had saved; use the out-of-place version"),
    "Can't call numpy() on Tensor that requires grad": N_("stay in torch, or call .detach() first"),
    "returned nan values in its": N_("anomaly detection raises a RuntimeError at the first NaN: catch it (try/except) and read the node's name from its message"),
}


def _call(fn, *args, shown: str | None = None, hints: dict[str, str] | None = None):
    """call(), with this lesson's hints (and the exercise's own, which win) added to the errors autograd raises."""
    return call(fn, *args, shown=shown, hints={**HINTS, **(hints or {})})


def _close(a, b, atol: float = 1e-5) -> bool:
    return (
        isinstance(a, torch.Tensor)
        and isinstance(b, torch.Tensor)
        and a.shape == b.shape
        and not a.is_complex()
        and torch.allclose(a.detach().double(), b.detach().double(), atol=atol, rtol=1e-4)
    )


def _randn(*shape: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=generator)


def _same_grad(before: torch.Tensor | None, after: torch.Tensor | None) -> bool:
    if before is None or after is None:
        return before is None and after is None
    return after.shape == before.shape and torch.equal(after, before)


class _Named:
    """A function shown by its formula in the checks' messages."""

    def __init__(self, text: str, fn: Callable[[torch.Tensor], torch.Tensor]):
        self.text, self.fn = text, fn

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)

    def __repr__(self) -> str:
        return f"lambda x: {self.text}"


# Checks, one per exercise, in notebook order.


class _Halve(torch.autograd.Function):
    """A custom Function in one hidden graph of count_ops: its node is a _HalveBackward."""

    @staticmethod
    def forward(ctx, x):
        return x / 2

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output / 2


def _count_graphs() -> list[tuple[str, torch.Tensor, list[torch.Tensor]]]:
    """(description, tensor, leaves) for count_ops: shared nodes, a shared pair of links, repeated kinds, a multi-output op, a custom node, no graph."""
    g = torch.Generator().manual_seed(21)
    x = _randn(4, 3, generator=g)
    w = _randn(3, generator=g).requires_grad_()
    b = _randn(generator=g).requires_grad_()
    h = torch.tanh(x @ w + b)
    shared = (h * h).sum() + (h * 3).mean()
    p = _randn(5, generator=g).requires_grad_()
    m = (p * 2).sigmoid()
    m = m * m  # two links into one SigmoidBackward0 node, and this node reached along two paths
    twice = m.sum() + m.mean()
    v = _randn(6, generator=g).requires_grad_()
    a, c = v.chunk(2)
    custom = _Halve.apply(a) * c + a.exp()
    u = _randn(5, generator=g).requires_grad_()
    chain = u
    for _step in range(11):
        chain = chain.sin() * 1.1
    return [
        (_("t = (h * h).sum() + (h * 3).mean() with h = torch.tanh(x @ w + b)"), shared, [w, b]),
        (_("t = m.sum() + m.mean() with m = s * s, s = (p * 2).sigmoid()"), twice, [p]),
        (_("t = Halve.apply(a) * c + a.exp() with a, c = v.chunk(2), Halve a custom Function"), custom, [v]),
        (_("t = u.sin() * 1.1, eleven times over"), chain, [u]),
        (_("t = a leaf that requires grad"), u, [u]),
        (_("t = data that needs no gradient"), x, []),
    ]


def _name(node) -> str:
    return type(node).__name__


def _add(counts: dict[str, int], node) -> None:
    if _name(node) != "AccumulateGrad":
        counts[_name(node)] = counts.get(_name(node), 0) + 1


def _count_per_path(t: torch.Tensor) -> dict[str, int]:
    """count_ops without a seen set, recursing: a node reached along k paths counted k times."""

    def visit(node) -> dict[str, int]:
        counts: dict[str, int] = {}
        if node is not None:
            _add(counts, node)
            for parent, _index in node.next_functions:
                for name, n in visit(parent).items():
                    counts[name] = counts.get(name, 0) + n
        return counts

    return visit(t.grad_fn)


def _count_per_link(t: torch.Tensor) -> dict[str, int]:
    """count_ops that counts a node each time next_functions lists it, but walks on from it once."""
    counts: dict[str, int] = {}
    root = t.grad_fn
    if root is None:
        return counts
    _add(counts, root)
    seen, todo = {root}, [root]
    while todo:
        for parent, _index in todo.pop().next_functions:
            if parent is not None:
                _add(counts, parent)
                if parent not in seen:
                    seen.add(parent)
                    todo.append(parent)
    return counts


def _count_kinds_once(t: torch.Tensor) -> dict[str, int]:
    """count_ops with a seen set of names instead of nodes: each kind once."""
    return dict.fromkeys(count_ops(t), 1)


def _count_without_root(t: torch.Tensor) -> dict[str, int]:
    counts = count_ops(t)
    if t.grad_fn is not None:
        counts[_name(t.grad_fn)] -= 1
    return {k: n for k, n in counts.items() if n}


def _count_one_level(t: torch.Tensor) -> dict[str, int]:
    """count_ops that stops at t.grad_fn's direct inputs."""
    counts: dict[str, int] = {}
    root = t.grad_fn
    if root is not None:
        _add(counts, root)
        for parent, _index in root.next_functions:
            if parent is not None:
                _add(counts, parent)
    return counts


def _count_first_inputs(t: torch.Tensor) -> dict[str, int]:
    """count_ops that follows only the first input of each node, next_functions[0]."""
    counts: dict[str, int] = {}
    node = t.grad_fn
    while node is not None and _name(node) != "AccumulateGrad":
        _add(counts, node)
        node = node.next_functions[0][0] if node.next_functions else None
    return counts


def _most_over(expected: dict[str, int], got: dict[str, int]) -> str:
    """The kind counted most times over (or left out the most), shown as 'name' is n node(s), counted k times."""
    name = max([*expected, *(k for k in got if k not in expected)], key=lambda k: abs(got.get(k, 0) - expected.get(k, 0)) / max(expected.get(k, 0), 1))
    n, k = expected.get(name, 0), got.get(name, 0)
    times = ngettext("{k} time", "{k} times", k).format(k=k)
    return ngettext("{name!r} is {n} node, counted {times}", "{name!r} is {n} nodes, counted {times}", n).format(name=name, n=n, times=times)


# A typical wrong walk, and what to say when an answer matches it on every hidden graph.
_COUNT_FAULTS = [
    (_count_per_path, lambda e, g, root: _(
        "a node reached along several paths was counted once per path ({counts}); remember the nodes already seen").format(
            counts=_most_over(e, g))),
    (_count_per_link, lambda e, g, root: _(
        "a node was counted once for each link into it ({counts}): next_functions lists a node once per use; "
        "count a node when you first reach it, and skip it when you meet it again").format(counts=_most_over(e, g))),
    (_count_kinds_once, lambda e, g, root: _(
        "counts each kind once, but separate nodes of one kind count separately ({counts}); "
        "remember nodes, not names").format(counts=_most_over(e, g))),
    (_count_without_root, lambda e, g, root: _(
        "leaves out t.grad_fn itself ({node}): the last operation counts too").format(node=_name(root))),
    (_count_one_level, lambda e, g, root: _("counts only t.grad_fn and its direct inputs: follow next_functions all the way back to the leaves")),
    (_count_first_inputs, lambda e, g, root: _(
        "follows only the first input of each node (next_functions[0]): a node has one entry per input, and each leads "
        "further back; visit them all")),
]


def _first_difference(expected: dict[str, int], got: dict) -> str:
    for name in sorted(set(expected) | set(got), key=str):
        if expected.get(name, 0) != got.get(name, 0):
            return _("{name!r}: expected {expected}, got {got}").format(name=name, expected=expected.get(name, 0), got=got.get(name, 0))
    return ""


def _as_counts(got: Any, what: str) -> dict[str, int]:
    """The learner's answer as a dict of names to ints, or a one-line failure that says what it is instead."""
    if got is None:
        raise ExerciseFailed(_("{what} returned None: did you forget to `return` the dict?").format(what=what))
    if isinstance(got, (list, tuple, set)) and all(isinstance(k, str) for k in got):
        raise ExerciseFailed(_("{what} is a {type} of names: count them, in a dict such as {{'MulBackward0': 2}}").format(
            what=what, type=type(got).__name__))
    if not isinstance(got, dict):
        raise ExerciseFailed(_("{what} is {a_type}, expected a dict such as {{'MulBackward0': 2}}").format(what=what, a_type=a_type(got)))
    got = dict(got)
    keys = list(got)
    if any(isinstance(k, type) for k in keys):
        raise ExerciseFailed(_("{what}: the keys are classes; use their names, type(node).__name__").format(what=what))
    if any(isinstance(k, torch.autograd.graph.Node) for k in keys):
        raise ExerciseFailed(_("{what}: the keys are the nodes themselves; use their class names, type(node).__name__, and count").format(what=what))
    if not all(isinstance(k, str) for k in keys):
        raise ExerciseFailed(_("{what}: the keys must be node names (str), got {type}").format(
            what=what, type=type(next(k for k in keys if not isinstance(k, str))).__name__))
    if any(" object at " in k for k in keys):
        raise ExerciseFailed(_("{what}: the keys are str(node), such as '<MulBackward0 object at 0x...>'; use type(node).__name__").format(what=what))
    if "NoneType" in got or "None" in got:
        raise ExerciseFailed(_("{what} counts None as a node: None in next_functions stands for an input that needs no gradient; skip it").format(what=what))
    if any("AccumulateGrad" in k for k in keys):
        raise ExerciseFailed(_("{what} counts AccumulateGrad nodes: they stand for leaves, not operations; leave them out").format(what=what))
    if not all(type(n) is int for n in got.values()):
        raise ExerciseFailed(_("{what}: the counts must be Python ints, got {type}").format(
            what=what, type=type(next(n for n in got.values() if type(n) is not int)).__name__))
    return got


@exercise("count_ops")
def check_count_ops(fn) -> None:
    graphs = _count_graphs()
    answers = []  # (what, t, expected, got) for each hidden graph
    for text, t, leaves in graphs:
        what = _("count_ops(t) for {graph}").format(graph=text)
        got = _call(fn, t, shown=_("tensor of shape {shape}").format(shape=tuple(t.shape)))
        if any(leaf.grad is not None for leaf in leaves):
            raise ExerciseFailed(_("count_ops ran backward(), which filled the leaves' .grad: only read the graph, through grad_fn and next_functions"))
        answers.append((what, t, count_ops(t), _as_counts(got, what)))
    wrong = [answer for answer in answers if answer[3] != answer[2]]
    if wrong:
        # A typical wrong walk is named only when the answer matches it on every hidden graph.
        for walk, message in _COUNT_FAULTS:
            predicted = [walk(t) for _what, t, _expected, _got in answers]
            if predicted == [got for *_rest, got in answers] and predicted != [expected for _what, _t, expected, _got in answers]:
                what, t, expected, got = next(a for a, p in zip(answers, predicted) if p != a[2])
                raise ExerciseFailed(_("{what}: {problem}").format(what=what, problem=message(expected, got, t.grad_fn)))
        what, t, expected, got = wrong[0]
        if t.grad_fn is None:
            raise ExerciseFailed(_("{what}: expected {{}}, since t has no graph (its grad_fn is None), got {got}").format(what=what, got=got))
        raise ExerciseFailed(_("{what}: {difference} (expected {expected})").format(
            what=what, difference=_first_difference(expected, got), expected=expected))
    for text, t, leaves in _count_graphs()[:1]:  # a fresh graph must still work after the walk
        _call(fn, t, shown=_("tensor of shape {shape}").format(shape=tuple(t.shape)))
        try:
            torch.autograd.grad(t, leaves)
        except RuntimeError as err:
            raise ExerciseFailed(_("after count_ops, t's graph no longer works ({error}...): only read the graph").format(
                error=str(err).splitlines()[0][:70])) from None


def _jacobian_cases() -> list[tuple[str, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]:
    """(description, y, x, other leaves) for jacobian: dense rows, another leaf, stale gradients, float64, m = 1, n = 1."""
    g = torch.Generator().manual_seed(31)
    m = _randn(4, 3, generator=g)
    x1 = _randn(3, generator=g).requires_grad_()
    p = _randn(2, generator=g).requires_grad_()
    x1.grad, p.grad = _randn(3, generator=g), _randn(2, generator=g)  # gradients the caller still needs
    y1 = torch.cat([torch.tanh(m @ x1) * p[0], (x1.exp() * p[1]).sum().reshape(1)])
    x2 = _randn(4, generator=g).double().requires_grad_()
    y2 = torch.stack([(x2**2).sum(), (x2.sin() * x2.roll(1)).sum()])
    x3 = torch.tensor([0.7], requires_grad=True)
    y3 = torch.cat([x3**3, x3.sin(), 2 * x3])
    x4 = _randn(3, generator=g).requires_grad_()
    y4 = (x4.exp() * x4).sum().reshape(1)
    return [
        (_("y = cat([tanh(M @ x) * p[0], [(x.exp() * p[1]).sum()]]), x and p holding gradients"), y1, x1, {"p": p}),
        (_("y = stack([(x ** 2).sum(), (x.sin() * x.roll(1)).sum()]) in float64"), y2, x2, {}),
        (_("y = cat([x ** 3, x.sin(), 2 * x]) for x of one element"), y3, x3, {}),
        (_("y = (x.exp() * x).sum().reshape(1), a single output"), y4, x4, {}),
    ]


JACOBIAN_HINTS = {
    "Trying to backward through the graph a second time": N_(
        "each pass frees y's graph unless you pass retain_graph=True; the caller needs the graph afterwards too, so pass it on every pass"
    ),
    "Mismatch in shape": N_("the gradient you pass for y (the v of the vector-Jacobian product) must have y's shape"),
}


@exercise("jacobian")
def check_jacobian(fn) -> None:
    for text, y, x, others in _jacobian_cases():
        expected = jacobian(y, x)
        m, n = expected.shape
        what = _("jacobian(y, x) for {case}").format(case=text)
        x_before, x_grad = x.detach().clone(), None if x.grad is None else x.grad.clone()
        other_grads = {name: None if t.grad is None else t.grad.clone() for name, t in others.items()}
        got = _call(fn, y, x, shown=_("y of shape ({m},), x of shape ({n},)").format(m=m, n=n), hints=JACOBIAN_HINTS)
        if not _same_grad(x_grad, x.grad):
            if x.grad is None:
                raise ExerciseFailed(_("jacobian set x.grad to None: the gradient the caller kept there is lost; torch.autograd.grad leaves .grad alone"))
            raise ExerciseFailed(_("jacobian changed x.grad: backward() adds into .grad; torch.autograd.grad returns the gradient and leaves .grad alone"))
        for name, leaf in others.items():
            if not _same_grad(other_grads[name], leaf.grad):
                raise ExerciseFailed(_(
                    "jacobian changed {name}.grad, the gradient of another leaf of y's graph: backward() fills every leaf it reaches; torch.autograd.grad(y, x, ...) computes x's alone"
                ).format(name=name))
        if isinstance(got, torch.Tensor) and got.shape == expected.shape and m > 1:
            if _close(got, expected.cumsum(0)):
                raise ExerciseFailed(_("{what}: row i holds the sum of rows 0 to i: .grad accumulates across backward() calls").format(what=what))
            if _close(got, expected.sum(0).expand(m, n)):
                raise ExerciseFailed(_(
                    "{what}: every row is the sum of all rows, the vector-Jacobian product with v = ones; row i needs a v that picks out y[i]"
                ).format(what=what))
        if not isinstance(got, torch.Tensor):
            expect_tensor(got, expected, what=what)  # None, a list, an array: each has its own line
        expect_shape(got, (m, n), what=what)
        if got.requires_grad:
            raise ExerciseFailed(_(
                "{what} is still attached to a graph (grad_fn={grad_fn}): return a plain tensor (no create_graph=True, or .detach() it)"
            ).format(what=what, grad_fn=type(got.grad_fn).__name__))
        expect_tensor(got, expected, what=what, atol=1e-5)
        if not torch.equal(x.detach(), x_before) or not x.requires_grad or not x.is_leaf:
            raise ExerciseFailed(_("jacobian changed the caller's x (its values or its requires_grad): only read the graph"))
        try:
            torch.autograd.grad(y, x, torch.ones_like(y), retain_graph=True)
        except RuntimeError as err:
            if "second time" in str(err):
                raise ExerciseFailed(_(
                    "after jacobian returned, y's graph was freed: the caller can no longer backpropagate through y; pass retain_graph=True on the last pass too"
                )) from None
            raise ExerciseFailed(_("after jacobian returned, y's graph no longer works: {error}").format(error=str(err).splitlines()[0][:100])) from None


_GRAD_AT_FUNCTIONS = [
    _Named("(x ** 2).sum()", lambda x: (x**2).sum()),
    _Named("(x.sin() * x).sum()", lambda x: (x.sin() * x).sum()),
    _Named("x @ A @ x", lambda x: x @ torch.tensor([[1.0, 2.0, 0.0], [-1.0, 0.5, 3.0], [0.0, 1.0, -2.0]], dtype=x.dtype) @ x),
    _Named("x.exp().mean()", lambda x: x.exp().mean()),
]


@exercise("grad_at")
def check_grad_at(fn) -> None:
    g = torch.Generator().manual_seed(5)
    for i, f in enumerate(_GRAD_AT_FUNCTIONS):
        x = _randn(3, generator=g).to(torch.float64 if i == 2 else torch.float32)  # float64 once: the dtype must stay
        expected = grad_at(f, x)
        what = _("grad_at({f!r}, {dtype} tensor of shape (3,))").format(f=f, dtype=x.dtype)
        got = _call(fn, f, x)
        if got is None:
            raise ExerciseFailed(_(
                "{what} returned None: .grad is only filled on a leaf; make one with x.detach().requires_grad_(), or use torch.autograd.grad"
            ).format(what=what))
        if isinstance(got, torch.Tensor) and got.requires_grad:
            raise ExerciseFailed(_(
                "{what} returned a tensor still attached to a graph (grad_fn={grad_fn}): return a plain gradient (no create_graph=True, or .detach() it)"
            ).format(what=what, grad_fn=type(got.grad_fn).__name__))
        expect_tensor(got, expected, what=what, atol=1e-5)
        first = got.clone()
        again = _call(fn, f, x)
        if _close(again, 2 * first):
            raise ExerciseFailed(_(
                "a second call with the same tensor returned twice the gradient: x.grad accumulates across backward() calls; work on a fresh leaf, x.detach().requires_grad_(), or use torch.autograd.grad"
            ))
        expect_tensor(again, expected, what=_("{what}, called a second time").format(what=what), atol=1e-5)
        if x.requires_grad:
            raise ExerciseFailed(_(
                "grad_at switched on requires_grad of the caller's tensor: make a new leaf with x.detach().requires_grad_() instead"
            ))
    # A caller's tensor that already requires grad and holds a gradient, like a model parameter.
    x = _randn(3, generator=g).requires_grad_()
    stale = torch.full((3,), 5.0)
    x.grad = stale.clone()
    f = _GRAD_AT_FUNCTIONS[1]
    expected = grad_at(f, x)
    got = _call(fn, f, x)
    if _close(got, expected + stale):
        raise ExerciseFailed(_(
            "for an x that already held a gradient in x.grad, you returned that old gradient plus the new one: use a fresh leaf, x.detach().requires_grad_(), or torch.autograd.grad"
        ))
    if got is None:
        raise ExerciseFailed(_(
            "for an x that requires grad, grad_at returned None: a copy of x (x.clone()) is not a leaf, so its .grad stays None; use x.detach().requires_grad_()"
        ))
    expect_tensor(got, expected, what=_("grad_at({f!r}, a tensor that requires grad)").format(f=f), atol=1e-5)
    if x.grad is None or not torch.equal(x.grad, stale):
        raise ExerciseFailed(_("grad_at changed the caller's x.grad: work on x.detach().requires_grad_(), a new leaf"))
    if not x.requires_grad or not x.is_leaf:
        raise ExerciseFailed(_("grad_at changed the caller's x, which must stay a leaf that requires grad"))


class _Encoder:
    """A frozen encoder for frozen_features: tanh(x @ weight + bias); it records each call's rows, modes and output."""

    def __init__(self, d_in: int, d_out: int, dtype: torch.dtype, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.weight = _randn(d_in, d_out, generator=g).to(dtype).requires_grad_()
        self.bias = _randn(d_out, generator=g).to(dtype).requires_grad_()
        self.calls: list[tuple[torch.Tensor, bool]] = []  # (rows, whether autograd recorded a graph for this call)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.tanh(x @ self.weight + self.bias)
        self.calls.append((x.detach().clone(), out.requires_grad))
        return out

    def __repr__(self) -> str:
        return f"encoder({self.weight.shape[0]} -> {self.weight.shape[1]})"


# (rows, batch_size, d_in, d_out, dtype, whether the caller has grad mode off): a partial last batch, an exact split,
# a batch_size larger than x, float64.
_FEATURE_CASES = [
    (150, 64, 3, 4, torch.float32, False),
    (12, 5, 2, 3, torch.float64, False),
    (9, 3, 4, 2, torch.float32, True),
    (5, 8, 6, 2, torch.float32, False),
]


def _expect_batches(calls: list, x: torch.Tensor, batch_size: int, what: str) -> None:
    """The encoder saw every row of x once, in order, in batches of batch_size rows, the last one the rest."""
    if not calls:
        raise ExerciseFailed(_("{what} never called encoder: run encoder on each batch of x").format(what=what))
    sizes = [len(rows) for rows, _recorded in calls]
    if max(sizes) > batch_size:
        if max(sizes) == len(x):
            message = _("{what} ran encoder on {rows} rows in one call (the whole of x at once), more than batch_size={batch_size}: "
                        "split x into batches of at most batch_size rows, x[i : i + batch_size]")
        else:
            message = _("{what} ran encoder on {rows} rows in one call, more than batch_size={batch_size}: "
                        "split x into batches of at most batch_size rows, x[i : i + batch_size]")
        raise ExerciseFailed(message.format(what=what, rows=max(sizes), batch_size=batch_size))
    seen = torch.cat([rows for rows, _recorded in calls])
    if seen.shape[1:] == x.shape[1:] and len(seen) < len(x) and torch.equal(seen, x[: len(seen)]):
        raise ExerciseFailed(_(
            "{what}: the last {n} rows of x never went through encoder: the last batch is smaller "
            "and holds the rest; range(0, len(x), batch_size) starts one batch at each multiple of batch_size"
        ).format(what=what, n=len(x) - len(seen)))
    if len(seen) > len(x):
        raise ExerciseFailed(_(
            "{what} ran encoder on {seen} rows in all, for an x of {rows} rows: each row goes through it once"
        ).format(what=what, seen=len(seen), rows=len(x)))
    if not (seen.shape == x.shape and torch.equal(seen, x)):
        raise ExerciseFailed(_("{what} gave encoder other rows than those of x, in order: batch i is x[i * batch_size : (i + 1) * batch_size]").format(what=what))
    full, rest = divmod(len(x), batch_size)
    if sizes != [batch_size] * full + ([rest] if rest else []):
        shown = ", ".join(map(str, sizes[:4])) + (", ..." if len(sizes) > 4 else "")
        raise ExerciseFailed(_(
            "{what} ran encoder on batches of {sizes} rows: each batch holds batch_size={batch_size} rows, the last one the rest"
        ).format(what=what, sizes=shown, batch_size=batch_size))


@exercise("frozen_features")
def check_frozen_features(fn) -> None:
    g = torch.Generator().manual_seed(41)
    for seed, (rows, batch_size, d_in, d_out, dtype, caller_off) in enumerate(_FEATURE_CASES, start=1):
        encoder = _Encoder(d_in, d_out, dtype, seed)
        x = _randn(rows, d_in, generator=g).to(dtype)
        x_before = x.clone()
        with torch.no_grad():
            expected = torch.tanh(x @ encoder.weight + encoder.bias)
        if caller_off:
            what = _("frozen_features(encoder, tensor of shape {shape}, batch_size={batch_size}) (called inside the caller's torch.no_grad())")
        else:
            what = _("frozen_features(encoder, tensor of shape {shape}, batch_size={batch_size})")
        what = what.format(shape=tuple(x.shape), batch_size=batch_size)
        try:
            with torch.set_grad_enabled(not caller_off):  # restores the caller's mode on exit, whatever the learner's code does
                got = _call(fn, encoder, x, batch_size, shown=_("{encoder!r}, tensor of shape {shape}, {batch_size}").format(
                    encoder=encoder, shape=tuple(x.shape), batch_size=batch_size))
                grad_after = torch.is_grad_enabled()
        finally:
            inference_left_on = torch.is_inference_mode_enabled()
        if inference_left_on:
            raise ExerciseFailed(_("frozen_features left inference mode switched on for the caller: a `with` block ends it"))
        if grad_after == caller_off:
            if caller_off:
                message = _("{what} left autograd switched on for the caller, who had it off "
                            "(torch.is_grad_enabled() changed): use `with torch.no_grad():`, which puts back the mode it found")
            else:
                message = _("{what} left autograd switched off for the caller, who had it on "
                            "(torch.is_grad_enabled() changed): use `with torch.no_grad():`, which puts back the mode it found")
            raise ExerciseFailed(message.format(what=what))
        _expect_batches(encoder.calls, x, batch_size, what)
        if any(recorded for _rows, recorded in encoder.calls):
            raise ExerciseFailed(_(
                "{what} ran encoder while autograd was recording: that builds a graph through the frozen encoder and keeps "
                "every batch's intermediate values in memory (a .detach() afterwards comes too late); run it under torch.no_grad()"
            ).format(what=what))
        if isinstance(got, (list, tuple)) and got and all(isinstance(t, torch.Tensor) for t in got):
            raise ExerciseFailed(_("{what} is a {type} of {n} tensors, one per batch: join them into one with torch.cat").format(
                what=what, type=type(got).__name__, n=len(got)))
        if isinstance(got, torch.Tensor) and got.is_inference():
            raise ExerciseFailed(_(
                "{what} is an inference tensor (made inside inference_mode): the head's backward cannot save it; "
                "torch.no_grad() gives ordinary tensors, and inference_mode is for results that never meet autograd again"
            ).format(what=what))
        if isinstance(got, torch.Tensor) and got.requires_grad:
            raise ExerciseFailed(_("{what} requires grad: the features are a constant input for the head; return them without a graph").format(what=what))
        expect_tensor(got, expected, what=what, atol=1e-5)
        if not torch.equal(x, x_before):
            raise ExerciseFailed(_("frozen_features modified the caller's x in place"))
        if not (encoder.weight.requires_grad and encoder.bias.requires_grad):
            raise ExerciseFailed(_(
                "frozen_features switched off requires_grad on the encoder's weights: leave the caller's tensors alone; torch.no_grad() alone stops the recording"
            ))
        if encoder.weight.grad is not None or encoder.bias.grad is not None:
            raise ExerciseFailed(_("frozen_features filled the encoder's .grad: the encoder is frozen, nothing may backpropagate into it"))
        head = _randn(d_out, 2, generator=g).to(dtype).requires_grad_()
        try:
            (got @ head).sum().backward()
        except RuntimeError as err:
            raise ExerciseFailed(_("a head trained on {what} cannot backpropagate: {error}").format(
                what=what, error=str(err).splitlines()[0][:100])) from None


def _grad_through(out: torch.Tensor, x: torch.Tensor, upstream: torch.Tensor, name: str) -> torch.Tensor:
    """d(out * upstream).sum() / dx, with the learner's backward's errors reported in one line."""
    try:
        (grad,) = torch.autograd.grad(out, x, upstream, allow_unused=True)
    except NotImplementedError as err:
        if err.args:
            raise ExerciseFailed(_("{name}'s backward raised NotImplementedError: {message}").format(
                name=name, message=str(err).splitlines()[0])) from None
        raise  # the untouched stub: not attempted
    except Exception as err:  # noqa: BLE001 -- the learner's backward failed: one line, not a traceback
        hint = next((h for key, h in HINTS.items() if key in str(err)), None)
        advice = _(" ({hint})").format(hint=_(hint)) if hint else ""
        raise ExerciseFailed(_("{name}'s backward raised {error}: {message}{advice}").format(
            name=name, error=type(err).__name__, message=str(err).strip().splitlines()[0] if str(err).strip() else "", advice=advice)) from None
    return grad


@exercise("leaky_relu")
def check_leaky_relu(fn) -> None:
    g = torch.Generator().manual_seed(11)
    for shape, slope in (((4, 5), 0.2), ((7,), 0.05)):
        x = _randn(*shape, generator=g).requires_grad_()
        upstream = _randn(*shape, generator=g)
        sent = upstream.clone()  # what autograd hands to backward as grad_output
        what = _("leaky_relu(tensor of shape {shape}, slope={slope})").format(shape=shape, slope=slope)
        out = _call(fn, x, slope)
        expect_tensor(out, leaky_relu(x.detach(), slope), what=what)
        if not isinstance(out.grad_fn, torch.autograd.function.BackwardCFunction):
            raise ExerciseFailed(_(
                "{what} does not go through a custom autograd.Function (its grad_fn is {grad_fn}): return LeakyReLU.apply(x, slope)"
            ).format(what=what, grad_fn=type(out.grad_fn).__name__))
        got = _grad_through(out, x, sent, "LeakyReLU")
        if not torch.equal(sent, upstream):
            raise ExerciseFailed(_(
                "LeakyReLU's backward modified grad_output in place: autograd may share that tensor with other nodes (after a sum() it is one value expanded); build a new tensor"
            ))
        positive = x.detach() > 0
        expected = torch.where(positive, upstream, slope * upstream)
        where = _("the gradient of a leaky_relu with respect to x")
        if _close(got, torch.where(positive, 1.0, slope)):
            raise ExerciseFailed(_(
                "{where} ignores grad_output: the chain rule multiplies the local derivative by grad_output"
            ).format(where=where))
        if _close(got, torch.where(positive, upstream, 0.0)):
            raise ExerciseFailed(_("{where} is ReLU's: negative inputs pass slope * grad_output, not 0").format(where=where))
        if _close(got, upstream):
            raise ExerciseFailed(_("{where} passes grad_output through unchanged: negative inputs get slope * grad_output").format(where=where))
        if _close(got, torch.where(positive, slope * upstream, upstream)):
            raise ExerciseFailed(_("{where} has the two cases swapped: x > 0 passes grad_output, x <= 0 passes slope * grad_output").format(where=where))
        if _close(got, torch.where(positive, upstream, 0.01 * upstream)):
            raise ExerciseFailed(_("{where} uses slope 0.01 when slope={slope} was passed: read it from ctx.slope").format(where=where, slope=slope))
        if got is None:
            raise ExerciseFailed(_("{where} is None: backward must return the gradient for x first, then None for slope").format(where=where))
        expect_tensor(got, expected, what=_("{where} (shape {shape}, slope={slope})").format(where=where, shape=shape, slope=slope), atol=1e-6)
    x = torch.tensor([-2.0, -0.5, 0.3, 1.7], dtype=torch.float64, requires_grad=True)
    if not torch.autograd.gradcheck(lambda t: fn(t, 0.1), (x,), raise_exception=False):
        raise ExerciseFailed(_("LeakyReLU fails torch.autograd.gradcheck in float64: is backward's result cast to another dtype?"))


@exercise("round_ste")
def check_round_ste(fn) -> None:
    g = torch.Generator().manual_seed(12)
    ties = torch.tensor([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 3.5, 0.25], dtype=torch.float64)  # round half to even
    for x in (3 * _randn(6, generator=g), 3 * _randn(3, 4, generator=g), ties, torch.tensor(-1.75)):
        at_ties = x is ties
        x = x.clone().requires_grad_()
        before = x.detach().clone()
        upstream = _randn(*x.shape, generator=g).to(x.dtype)
        shape = tuple(x.shape)
        what = _("round_ste({dtype} tensor of shape {shape})").format(dtype=x.dtype, shape=shape)
        out = _call(fn, x)
        if not torch.equal(x.detach(), before):
            raise ExerciseFailed(_("round_ste modified its input in place: use out-of-place ops (x.round(), not x.round_())"))
        if _close(out, before):
            raise ExerciseFailed(_("{what} returned x itself: the forward value must be rounded, x.round()").format(what=what))
        if at_ties and _close(out, (before + 0.5).floor()):
            raise ExerciseFailed(_("{what}: at a tie such as 2.5, x.round() rounds half to even (2.5 -> 2), floor(x + 0.5) rounds up").format(what=what))
        expect_tensor(out, before.round(), what=what)
        if not out.requires_grad:
            raise ExerciseFailed(_(
                "{what} is not connected to x (no grad_fn): detach only the part that makes the value right, and keep x outside the detach"
            ).format(what=what))
        got = _grad_through(out, x, upstream, "round_ste")
        where = _("the gradient of round_ste")
        if got is None or _close(got, torch.zeros_like(upstream)):
            raise ExerciseFailed(_(
                "{where} is 0 everywhere: that is round()'s true derivative; a straight-through estimator passes grad_output through unchanged"
            ).format(where=where))
        if _close(got, -upstream):
            raise ExerciseFailed(_("{where} has the wrong sign: it is -grad_output; the x outside the detach must be added, not subtracted").format(where=where))
        if _close(got, upstream * (before.abs() <= 1)):
            raise ExerciseFailed(_(
                "{where} is zero where |x| > 1 (the clipped estimator for sign()); round_ste passes grad_output through everywhere"
            ).format(where=where))
        if _close(got, 2 * upstream):
            raise ExerciseFailed(_("{where} is 2 * grad_output: x's gradient is counted twice; detach everything except one x").format(where=where))
        expect_tensor(got, upstream, what=_("{where} (shape {shape})").format(where=where, shape=shape))


# nan_culprit: (f, x, whether the caller's x requires grad and holds a gradient). Each NaN starts in one node.
_NAN_CASES = [
    (_Named("torch.where(x > 1, (x - 1).sqrt(), 0.0)", lambda x: torch.where(x > 1, (x - 1).sqrt(), 0.0)), [3.0, 1.0, 0.5, 2.5], False),
    (_Named("torch.where(x > 0, x * x.log(), 0.0)", lambda x: torch.where(x > 0, x * x.log(), 0.0)), [0.0, 2.0, -3.0], True),
    (_Named("(x + 1).sqrt()", lambda x: (x + 1).sqrt()), [-1.0, 3.0, 0.5], False),  # an inf in the gradient, but no NaN
    (_Named("torch.where(x.abs() < 1, x.acos(), 0.0)", lambda x: torch.where(x.abs() < 1, x.acos(), 0.0)), [1.5, 0.25, -0.75], False),
    (_Named("x ** 3 - 2 * x", lambda x: x**3 - 2 * x), [0.5], True),
    (_Named("torch.where(x != 0, 1 / x, 0.0)", lambda x: torch.where(x != 0, 1 / x, 0.0)), [-2.0, 0.0, 0.5], False),
]


def _nan_nodes(f: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> list[str]:
    """The names of the backward nodes whose output holds NaN, in the order backward runs them."""
    x = x.detach().requires_grad_()
    out = f(x).sum()
    found: list[str] = []
    nodes, _edges = _graph(out.grad_fn)
    for node in nodes:
        node.register_hook(lambda grads, _outputs, node=node: found.append(type(node).__name__) if any(
            g is not None and torch.isnan(g).any() for g in grads) else None)
    torch.autograd.grad(out, x)
    return found


@exercise("nan_culprit")
def check_nan_culprit(fn) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # anomaly detection warns on every use; the learner's cell stays quiet
        for f, values, caller_grad in _NAN_CASES:
            x = torch.tensor(values)
            expected = nan_culprit(f, x)
            if caller_grad:
                x.requires_grad_()
                x.grad = torch.full_like(x, 0.5)
            before, grad_before = x.detach().clone(), None if x.grad is None else x.grad.clone()
            what = f"nan_culprit({f!r}, x={values})"
            try:
                got = _call(fn, f, x, shown=f"{f!r}, tensor({values})")
            finally:
                anomaly_left_on = torch.is_anomaly_enabled()
                torch.autograd.set_detect_anomaly(False)
            if expected is None and got is not None:
                raise ExerciseFailed(_("{what}: expected None, the gradient holds no NaN (an inf is not a NaN), got {got!r}").format(what=what, got=got))
            if expected is not None:
                if got is None:
                    raise ExerciseFailed(_("{what}: expected {expected!r}, got None, but the gradient of f(x).sum() holds NaN here").format(
                        what=what, expected=expected))
                if isinstance(got, str) and expected in got and got != expected:
                    raise ExerciseFailed(_("{what}: return the node's name alone, {expected!r}, not {got!r}").format(
                        what=what, expected=expected, got=got[:60]))
                if not isinstance(got, str):
                    raise ExerciseFailed(_("{what}: expected the node's name, a str such as {expected!r}, got {type}").format(
                        what=what, expected=expected, type=type(got).__name__))
                if got != expected:
                    later = _nan_nodes(f, x)[1:]
                    if got in later:
                        raise ExerciseFailed(_(
                            "{what}: {got!r} outputs NaN too, but backward runs {expected!r} first, and the first NaN is the culprit (anomaly detection stops there)"
                        ).format(what=what, got=got, expected=expected))
                    raise ExerciseFailed(_("{what}: expected {expected!r}, got {got!r}").format(what=what, expected=expected, got=got[:60]))
            if anomaly_left_on:
                raise ExerciseFailed(_("nan_culprit left anomaly detection switched on: use `with torch.autograd.detect_anomaly():`, which restores the setting at the end"))
            if not torch.equal(x.detach(), before):
                raise ExerciseFailed(_("nan_culprit modified the caller's x in place"))
            if x.requires_grad != caller_grad:
                raise ExerciseFailed(_("nan_culprit switched on requires_grad of the caller's x: make a leaf of your own, x.detach().requires_grad_()"))
            if not _same_grad(grad_before, x.grad):
                raise ExerciseFailed(_(
                    "nan_culprit changed the caller's x.grad: backpropagate into a leaf of your own (x.detach().requires_grad_()), or use torch.autograd.grad"
                ))
