"""Lesson 10 (saving, exporting and serving a model): reference solutions and the checks for its exercises."""

import argparse
import contextlib
import io
import logging
import math
import pickle
import re
import tempfile
import warnings
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.export import Dim, ExportedProgram

from course_utils.tooling.checks import (
    ERROR_HINTS,
    ExerciseFailed,
    a_type,
    call,
    error_hint,
    exercise,
    expect_callable,
    expect_tensor,
    expect_unchanged,
    scoreboard_for,
    stub_function,
)
from course_utils.tooling.language import N_, _, ngettext

scoreboard = scoreboard_for(__name__)  # the lesson's last cell: this session's verdicts


# Reference solutions. The checks compare the learner's answers with these.

def load_for_serving(path: str | Path, model: nn.Module) -> nn.Module:
    """Load the weights of a training checkpoint (saved on a GPU, maybe from a compiled or DDP model) into `model`; return it ready for inference."""
    with torch.serialization.safe_globals([argparse.Namespace]):   # the one class the file needs, and nothing else
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    state = {name.removeprefix("_orig_mod.").removeprefix("module."): value for name, value in checkpoint["model"].items()}
    model.load_state_dict(state)
    return model.eval()


def serve_requests(model: nn.Module, requests: list[torch.Tensor], max_batch: int) -> torch.Tensor:
    """Class probabilities (N, classes) for N single-image requests, at most `max_batch` images per forward pass."""
    model.eval()
    answers = []
    with torch.inference_mode():
        for start in range(0, len(requests), max_batch):
            answers.append(model(torch.stack(requests[start:start + max_batch])).softmax(dim=1))
    return torch.cat(answers)


def export_from_request(model: nn.Module, request: torch.Tensor) -> ExportedProgram:
    """Export `model` for inference from one logged request (a batch of 1), for any batch size from 1 to 1024."""
    examples = torch.cat([request, request])   # export specializes sizes 0 and 1, so trace with 2
    batch = Dim("batch", min=1, max=1024)
    return torch.export.export(model.eval(), (examples,), dynamic_shapes=({0: batch},))


def cascade(small: nn.Module, large: nn.Module, x: torch.Tensor, threshold: float) -> torch.Tensor:
    """Class probabilities from `small` if it is sure of every image (top probability >= threshold), else from `large`,
    which then runs alone; exportable."""
    logits = small(x)
    sure = logits.softmax(dim=1).amax(dim=1).min() >= threshold
    return torch.cond(sure, lambda x, logits: logits.softmax(dim=1), lambda x, logits: large(x).softmax(dim=1), (x, logits))


def export_onnx(model: nn.Module, example: torch.Tensor, path: str | Path) -> float:
    """Export `model` to one ONNX file with a dynamic batch; return the largest difference ONNX Runtime shows from eager."""
    import onnxruntime as ort

    model.eval()
    torch.onnx.export(model, (example,), path, dynamo=True, dynamic_shapes=({0: Dim("batch", min=1)},),
                      input_names=["images"], output_names=["logits"], external_data=False, verbose=False)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    worst = 0.0
    with torch.inference_mode():
        for x in (example[:1], example):
            (logits,) = session.run(None, {"images": x.numpy()})
            worst = max(worst, float(np.abs(logits - model(x).numpy()).max()))
    return worst


# Helpers the notebook uses.

@contextlib.contextmanager
def quiet():
    """Keep torch.export's and Inductor's diagnostics off the notebook: the partial graph printed to stderr when an export fails, and log lines."""
    names = ["torch.fx.experimental.symbolic_shapes", "torch._dynamo", "torch.export", "torch._export", "torch.utils.cpp_extension",
             "torch.onnx"]
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def first_lines(err: BaseException, n: int = 1, width: int = 160) -> str:
    """The first n non-empty lines of an error message, each cut to `width` characters."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()][:n]
    return "\n".join(line if len(line) <= width else line[: width - 3] + "..." for line in lines)


class _Wrap(nn.Module):
    """A function as a module, so that torch.export can export it."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


# Hidden cases.

def _small_cnn(seed: int, classes: int = 5) -> nn.Module:
    """A tiny CNN for 1x8x8 inputs with batch norm and dropout, so that train and eval mode differ."""
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Dropout(0.5), nn.Linear(64, classes),
    )
    with torch.no_grad():  # batch-norm statistics far from any batch's own, as after training on other data
        model[1].running_mean.uniform_(-1.0, 1.0)
        model[1].running_var.uniform_(0.2, 3.0)
        model[1].weight.uniform_(0.5, 1.5)
        model[1].num_batches_tracked.fill_(500)
    return model


def _images(seed: int, n: int) -> torch.Tensor:
    return torch.rand(n, 1, 8, 8, generator=torch.Generator().manual_seed(seed))


def _close(got: object, expected: torch.Tensor, atol: float = 1e-5) -> bool:
    """True when got is a tensor of expected's shape and dtype, with values within atol: the test behind each diagnosis."""
    return (isinstance(got, torch.Tensor) and got.shape == expected.shape and got.dtype == expected.dtype
            and torch.allclose(got.detach().cpu(), expected, atol=atol))


def _differs(got: object, expected: torch.Tensor, atol: float = 1e-5) -> bool:
    """True when got is a tensor of expected's shape and dtype whose values are off: only then is a diagnosis worth making."""
    return (isinstance(got, torch.Tensor) and got.shape == expected.shape and got.dtype == expected.dtype
            and not _close(got, expected, atol))


# Exercise 1: load_for_serving

def _save_as_if_on_gpu(obj: object, path: Path, device: str = "cuda:1") -> None:
    """torch.save, with every storage tagged as living on `device`, as a file written by rank 1 of a multi-GPU run is."""
    from torch import serialization

    real = serialization.location_tag
    serialization.location_tag = lambda storage: device
    try:
        torch.save(obj, path)
    finally:
        serialization.location_tag = real


def _training_checkpoint(trained: nn.Module, prefix: str) -> dict:
    """What a training script saves: epoch, model (keys with the wrapper's prefix), optimizer and its command-line args."""
    optimizer = torch.optim.AdamW(trained.parameters(), lr=2e-3)
    return {
        "epoch": 12,
        "model": {prefix + name: value for name, value in trained.state_dict().items()},
        "optimizer": optimizer.state_dict(),
        "args": argparse.Namespace(lr=2e-3, epochs=12, batch_size=64, compile=prefix == "_orig_mod."),
    }


class _Payload:
    """Unpickles as Path.touch(marker): a harmless stand-in for the code a malicious checkpoint would run."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


_LOAD_HINTS = {  # the advice is translated when it is shown (error_hint); N_ marks it for the catalog
    "GLOBAL argparse.Namespace": N_("the checkpoint holds the training script's argparse.Namespace: allow that one class, "
                                    "torch.serialization.safe_globals([argparse.Namespace])"),
    "Attempting to deserialize object on": N_("the file was saved on a GPU: map its tensors to the CPU while loading (map_location)"),
    'Unexpected key(s) in state_dict: "epoch"': N_("that is the whole checkpoint: the weights are under checkpoint['model']"),
    'Unexpected key(s) in state_dict: "_orig_mod.': N_("the keys carry torch.compile's `_orig_mod.` prefix: strip it"),
    'Unexpected key(s) in state_dict: "module.': N_("the keys carry DistributedDataParallel's `module.` prefix: strip it"),
}

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _telling_line(err: BaseException, width: int = 150) -> str:
    """The line of an error that names the problem (torch.load's and load_state_dict's first lines rarely do), without colour codes."""
    lines = [_ANSI.sub("", line).strip() for line in str(err).splitlines() if line.strip()]
    line = next((l for l in lines if l.startswith(("WeightsUnpickler error", "Unexpected key(s)", "Missing key(s)"))),
                lines[0] if lines else _("(no message)"))
    line = line.split(" was not an allowed global")[0]
    return line if len(line) <= width else line[: width - 3] + "..."


def _call(fn, *args, what: str, hints: dict[str, str]):
    """Call the learner's function; report its error in one line by the line that names the problem, plus advice."""
    expect_callable(fn)
    try:
        return fn(*args)
    except Exception as err:  # noqa: BLE001 -- the learner's error, reported as theirs
        if stub_function(err):
            raise
        raise ExerciseFailed(_("{what} raised {error}: {message}{advice}").format(
            what=what, error=type(err).__name__, message=_telling_line(err), advice=error_hint(err, {**ERROR_HINTS, **hints}))) from None


def _named_cnn(seed: int) -> nn.Module:
    """load_for_serving's hidden model: _small_cnn with named layers, whose names begin with letters of "module." and
    "_orig_mod." (decoder, encoder), so that str.lstrip, which strips characters, not a prefix, mangles them."""
    layers = _small_cnn(seed)
    names = ["encoder", "norm", "act", "pool", "flat", "drop", "decoder"]
    return nn.Sequential(OrderedDict(zip(names, layers)))


class _LoadWatch:
    """What a learner's load_for_serving did while it ran: the classes it allowed the weights-only unpickler beyond
    those allowed before, and every model.load_state_dict call on the caller's model (its keys and `strict`)."""

    def __init__(self, model: nn.Module):
        self.model, self.allowed, self.loads = model, set(), []
        self._real_allowed = None

    def __enter__(self) -> "_LoadWatch":
        from torch import _weights_only_unpickler as unpickler

        before, real = set(unpickler._marked_safe_globals_set), unpickler._get_user_allowed_globals
        self._real_allowed = real

        def allowed():
            self.allowed |= set(unpickler._marked_safe_globals_set) - before
            return real()
        unpickler._get_user_allowed_globals = allowed
        real_load = self.model.load_state_dict

        def load_state_dict(state_dict, strict=True, assign=False):
            keys = list(state_dict.keys()) if hasattr(state_dict, "keys") else None
            self.loads.append({"keys": keys, "strict": strict})
            return real_load(state_dict, strict=strict, assign=assign)
        self.model.load_state_dict = load_state_dict  # on the instance: the caller's model reports its own loads
        return self

    def __exit__(self, *exc) -> None:
        from torch import _weights_only_unpickler as unpickler

        unpickler._get_user_allowed_globals = self._real_allowed
        self.model.__dict__.pop("load_state_dict", None)


def _name(obj: object) -> str:
    return f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', obj)}".lstrip(".")


def _key_fault(passed: list[str], expected: list[str], prefix: str) -> str | None:
    """What is wrong with the keys handed to load_state_dict, when their difference from the model's proves it."""
    if set(passed) == set(expected):
        return None
    if "model" in passed and "optimizer" in passed:
        return _("that is the whole checkpoint: the weights are under checkpoint['model']")
    if prefix and all(k.startswith(prefix) for k in passed):
        wrapper = {"_orig_mod.": "torch.compile", "module.": "DistributedDataParallel"}[prefix]
        return _("the keys still carry {wrapper}'s `{prefix}` prefix (e.g. {key!r}): strip it").format(
            wrapper=wrapper, prefix=prefix, key=passed[0])
    mangled = [(k, e) for k in passed for e in expected if k != e and e.endswith(k) and k not in expected]
    if mangled:
        got, want = mangled[0]
        saved = prefix + want
        stripped = {saved.lstrip(a) for a in _WRAPPER_PREFIXES} | {saved.lstrip(a).lstrip(b) for a in _WRAPPER_PREFIXES for b in _WRAPPER_PREFIXES}
        if got in stripped:   # only str.lstrip's character set gives exactly this key
            return _("the keys lost more than the prefix (e.g. {got!r} for {want!r}): str.lstrip removes any of the "
                     "characters you give it from the start, not a prefix; use str.removeprefix").format(got=got, want=want)
        return _("the keys lost more than the prefix (e.g. {got!r} for {want!r}): remove only `module.` or `_orig_mod.`, "
                 "and only from the keys that start with it").format(got=got, want=want)
    kept = [(k, e) for k in passed for e in expected if k not in expected and k.endswith("." + e)]
    if kept:
        got, want = kept[0]
        return _("the keys still carry part of a prefix (e.g. {got!r} for {want!r}): remove the whole `module.` or `_orig_mod.`").format(
            got=got, want=want)
    unknown = [k for k in passed if k not in expected]
    if unknown:
        return _("the keys you passed are not the model's (e.g. {key!r}; the model has {model_key!r}, ...)").format(
            key=unknown[0], model_key=expected[0])
    return None


_WRAPPER_PREFIXES = ("module.", "_orig_mod.")


@exercise("load_for_serving")
def check_load_for_serving(fn) -> None:
    import argparse as _argparse

    x = _images(31, 6)
    cases = [(21, "_orig_mod.", N_("checkpoint of a torch.compile'd model")), (22, "module.", N_("checkpoint of a DDP-wrapped model")),
             (23, "", N_("checkpoint of a plain model"))]
    with tempfile.TemporaryDirectory(prefix="course10_") as folder:
        for seed, prefix, label in cases:
            trained = _named_cnn(seed)
            path = Path(folder) / f"checkpoint_{seed}.pt"
            _save_as_if_on_gpu(_training_checkpoint(trained, prefix), path)
            model = _named_cnn(seed + 100).train()
            before = {name: value.clone() for name, value in model.state_dict().items()}
            expected_keys = list(trained.state_dict())
            what = f"load_for_serving({_(label)}, model)"
            expect_callable(fn)
            with _LoadWatch(model) as watch:
                try:
                    got = fn(str(path), model)
                except Exception as err:  # noqa: BLE001 -- the learner's error, reported as theirs
                    if stub_function(err):
                        raise
                    fault = next((f for load in watch.loads if load["keys"] and (f := _key_fault(load["keys"], expected_keys, prefix))), None)
                    advice = f" ({fault})" if fault else error_hint(err, {**ERROR_HINTS, **_LOAD_HINTS})
                    raise ExerciseFailed(_("{what} raised {error}: {message}{advice}").format(
                        what=what, error=type(err).__name__, message=_telling_line(err), advice=advice)) from None
            extra = sorted(_name(g) for g in watch.allowed if g is not _argparse.Namespace)
            if extra:
                raise ExerciseFailed(_("{what} allowed {classes} as well as argparse.Namespace: the file needs "
                                       "that one class, so allow it and nothing else").format(what=what, classes=", ".join(extra[:3])))
            if got is None:
                raise ExerciseFailed(_("{what} returned None: return the model, with the weights loaded").format(what=what))
            if isinstance(got, dict):
                raise ExerciseFailed(_("{what} returned a dict: load the weights into the model and return the model").format(what=what))
            if isinstance(got, tuple) or type(got).__name__ == "_IncompatibleKeys":
                raise ExerciseFailed(_("{what} returned what load_state_dict returns (the key report): return the model itself").format(
                    what=what))
            if not isinstance(got, nn.Module):
                raise ExerciseFailed(_("{what} returned {a_type}, expected the model (an nn.Module)").format(what=what, a_type=a_type(got)))
            lax = [load for load in watch.loads if load["strict"] is False]
            if lax:
                keys = lax[0]["keys"] or []
                fault = _key_fault(keys, expected_keys, prefix)
                if fault and all(torch.equal(model.state_dict()[k], before[k]) for k in before):
                    raise ExerciseFailed(_("{what}: load_state_dict(strict=False) ignored every key it did not know, so no "
                                           "weight was loaded ({fault}); keep the load strict, so that such a mismatch raises").format(
                        what=what, fault=fault))
                raise ExerciseFailed(_("{what} called load_state_dict(strict=False): keep the load strict, so that a key you "
                                       "missed raises instead of leaving a weight untrained").format(what=what))
            if got is not model:
                raise ExerciseFailed(_("{what} returned another {type} than the model it was given (a copy?): "
                                       "load the weights into `model` itself and return it").format(what=what, type=type(got).__name__))
            state, saved = got.state_dict(), trained.state_dict()
            if all(torch.equal(state[name].cpu(), before[name]) for name in saved if name in before):
                raise ExerciseFailed(_("{what}: the model's weights are unchanged: none of the saved weights reached it").format(what=what))
            for name, value in saved.items():
                if state[name].dtype != value.dtype or not torch.equal(state[name].cpu(), value):
                    raise ExerciseFailed(_("{what}: {name!r} is not the saved value").format(what=what, name=name))
            device = next((p.device for p in got.parameters() if p.device.type != "cpu"), None)
            if device is not None:
                raise ExerciseFailed(_("{what} left the weights on {device}: the server has no GPU; map them to the CPU while loading").format(
                    what=what, device=device))
            with torch.no_grad():
                out = call(got, x, name=_("the loaded model"), kind="module")
                expected = trained.eval()(x)
            if _differs(out, expected) and got.training:
                raise ExerciseFailed(_("{what} returned the model in train mode, so dropout and batch norm behave as in training: "
                                       "make it ready for inference").format(what=what))
            expect_tensor(out, expected, what=_("the loaded model's output on a batch of {n}").format(n=len(x)), atol=1e-5)

        # A checkpoint that also hides code: loading it safely must fail, and must not run the code.
        marker = Path(folder) / "the_checkpoint_ran_code"
        trap = Path(folder) / "checkpoint_with_code.pt"
        checkpoint = _training_checkpoint(_named_cnn(24), "")
        checkpoint["hook"] = _Payload(marker)
        _save_as_if_on_gpu(checkpoint, trap)
        what = "load_for_serving({checkpoint}, model)".format(checkpoint=_("a checkpoint that also holds a pickled call"))
        raised = None
        try:
            fn(str(trap), _named_cnn(25))
        except Exception as err:  # noqa: BLE001 -- the learner's function should raise here
            if stub_function(err):
                raise
            raised = err
        if marker.exists():
            raise ExerciseFailed(_("{what} ran the code hidden in the file (harmless here, it made a file), so the file was not "
                                   "loaded with weights_only=True").format(what=what))
        if raised is None:
            raise ExerciseFailed(_("{what} returned normally: let torch.load(..., weights_only=True) raise its UnpicklingError, "
                                   "do not catch it").format(what=what))
        if not isinstance(raised, pickle.UnpicklingError):
            raise ExerciseFailed(_("{what} raised {error}: {message}; expected pickle.UnpicklingError "
                                   "from torch.load(..., weights_only=True)").format(
                what=what, error=type(raised).__name__, message=_telling_line(raised, 100)))


# Exercise 2: serve_requests

@contextlib.contextmanager
def _grad_mode_kept(what: str):
    """Fail when the learner's call leaves autograd (or inference mode) switched for the rest of the process; put it back."""
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
    try:
        yield
    finally:
        left = (torch.is_grad_enabled(), torch.is_inference_mode_enabled()) != (grad, inference)
        torch.set_grad_enabled(grad)
    if left:
        switched = _("inference mode on") if torch.is_inference_mode_enabled() else (_("autograd off") if grad else _("autograd on"))
        raise ExerciseFailed(_("{what} left {switched} for the rest of the process (torch.set_grad_enabled, or a mode entered "
                               "without its `with`): switch it inside a `with torch.inference_mode():` block, which restores it").format(
            what=what, switched=switched))


class _Log(list):
    """The calls a hidden model saw. Copies of the model (copy.deepcopy) write to the same log."""

    def __deepcopy__(self, memo):
        return self


class _Watched(nn.Module):
    """A hidden model that logs each forward pass: its batch size, whether it ran in train mode, whether autograd recorded."""

    def __init__(self, net: nn.Module, log: _Log):
        super().__init__()
        self.net = net
        self.log = log
        self.shapes = _Log()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.log.append((x.shape[0] if x.ndim == 4 else None, self.training, torch.is_grad_enabled()))
        self.shapes.append(tuple(x.shape))
        return self.net(x)


@exercise("serve_requests")
def check_serve_requests(fn) -> None:
    classes = 12   # more than 9: a softmax over the wrong dimension cannot hide
    for n, max_batch, seed in ((10, 4, 61), (1, 8, 62), (9, 3, 63)):
        log = _Log()
        model = _Watched(_small_cnn(seed, classes), log).train()
        images = _images(seed + 10, n)
        requests = [image for image in images.clone()]
        kept = [r.clone() for r in requests]
        with torch.no_grad():
            logits = _small_cnn(seed, classes).eval()(images)
        expected = logits.softmax(dim=1)
        requests_shown = ngettext("{n} request of shape (1, 8, 8)", "{n} requests of shape (1, 8, 8)", n).format(n=n)
        shown = f"model, {requests_shown}, max_batch={max_batch}"
        what = f"serve_requests({shown})"
        try:
            with _grad_mode_kept(what):
                got = call(fn, model, requests, max_batch, shown=shown)
        except ExerciseFailed as err:
            flat = next((s for s in model.shapes if len(s) == 3), None)
            if flat:
                raise ExerciseFailed(_("{message} (the model got a batch of shape {shape}: torch.cat joined the requests "
                                       "along their channel dimension; torch.stack adds the batch dimension)").format(
                    message=err.message, shape=flat)) from None
            raise
        if len(requests) != n or any(not torch.equal(a, b) for a, b in zip(kept, requests)):
            raise ExerciseFailed(_("{what} changed the list of requests or a request in it: leave the caller's requests as they are").format(
                what=what))
        if got is None:
            raise ExerciseFailed(_("{what} returned None: return the probabilities, one row per request").format(what=what))
        if not log:
            raise ExerciseFailed(_("{what} never called the model").format(what=what))
        sizes = [size for size, _training, _grad in log]
        if any(size is not None and size > max_batch for size in sizes):
            raise ExerciseFailed(_("{what} ran a forward pass on {n} images, more than max_batch={max_batch}").format(
                what=what, n=max(s for s in sizes if s is not None), max_batch=max_batch))
        if isinstance(got, torch.Tensor) and got.shape == (n,) and not got.is_floating_point():
            if torch.equal(got, logits.argmax(dim=1)):
                raise ExerciseFailed(_("{what} returned the predicted classes, shape ({n},): return the probabilities of "
                                       "every class, shape ({n}, {classes}), a softmax over the classes").format(
                    what=what, n=n, classes=classes))
        if _differs(got, expected):
            if any(training for _size, training, _grad in log):
                raise ExerciseFailed(_("{what} ran the model in train mode, where batch norm uses and updates each batch's own "
                                       "statistics and dropout is on: a server runs it in eval mode").format(what=what))
            if _close(got, logits):
                raise ExerciseFailed(_("{what} returned the logits: turn them into probabilities with a softmax over the classes").format(
                    what=what))
            if _close(got, logits.log_softmax(dim=1)):
                raise ExerciseFailed(_("{what} returned log-probabilities: return probabilities, a softmax over the classes").format(
                    what=what))
            columns = torch.cat([chunk.softmax(dim=0) for chunk in logits.split(max_batch)])
            if _close(got, columns):
                raise ExerciseFailed(_("{what}: the softmax ran over the batch (dim 0), so each column sums to 1: "
                                       "take it over the classes, dim=1").format(what=what))
            sums = got.detach().float().sum(dim=1)
            if not torch.allclose(sums, torch.ones_like(sums), atol=1e-4):
                row = int((sums - 1).abs().argmax())
                raise ExerciseFailed(_("{what}: its rows are not probabilities over the classes (row {row} sums to {total:.4g}, "
                                       "not 1): take a softmax over the classes, dim=1").format(what=what, row=row, total=sums[row].item()))
        fewest = math.ceil(n / max_batch)
        if len(log) > fewest:
            raise ExerciseFailed(_("{what} ran {passes} forward passes where {fewest} are enough: "
                                   "put up to max_batch={max_batch} requests in each (batch sizes {sizes})").format(
                what=what, passes=len(log), fewest=fewest, max_batch=max_batch, sizes=sizes))
        if isinstance(got, torch.Tensor) and got.ndim == 2 and len(got) == n - n % max_batch and n % max_batch:
            raise ExerciseFailed(_("{what} returned {rows} rows for {n} requests: the last, partial batch of {partial} is missing").format(
                what=what, rows=len(got), n=n, partial=n % max_batch))
        expect_tensor(got, expected, what=what, atol=1e-5)
        if any(grad for _size, _training, grad in log):
            raise ExerciseFailed(_("{what} ran the model with autograd recording a graph: serve under torch.inference_mode() "
                                   "(or torch.no_grad())").format(what=what))


# Exercise 3: export_from_request

def _graph_in_train_mode(ep: ExportedProgram) -> bool:
    """True when the exported graph holds training-mode dropout or batch norm (the model was exported in train mode)."""
    aten = torch.ops.aten
    for node in ep.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target == aten.dropout.default and len(node.args) > 2 and node.args[2]:
            return True
        if node.target == aten.batch_norm.default and len(node.args) > 5 and node.args[5]:
            return True
        if node.target in (aten._native_batch_norm_legit_functional.default, aten.native_dropout.default):
            return True
    return False


# The advice is translated when it is shown (error_hint); N_ marks it for the catalog.
_SPECIALIZED = N_("export specializes sizes 0 and 1, so a dimension you mark dynamic needs a size of 2 or more in the example: "
                  "trace with a batch of 2 or more (a Dim with min=1 still accepts 1), and mark dimension 0, the batch")
_EXPORT_HINTS = {
    "specialized it to be a constant (1)": _SPECIALIZED,
    "0/1 specialized": _SPECIALIZED,
    "top-level keys must be the arg names": N_("name the argument as forward() does, or pass dynamic_shapes as a tuple: ({0: batch},)"),
    "missing a required argument": N_("forward's argument has another name here: pass the example positionally, in the args tuple"),
    "bias type (float) should be the same": N_("the example's dtype is not the model's (float32): build it from the request, which keeps its dtype"),
    "must have the same dtype": N_("the example's dtype is not the model's (float32): build it from the request, which keeps its dtype"),
}


class _ExportWatch:
    """The torch.export.export calls a learner's function makes (its example and dynamic_shapes), for a diagnosis
    from evidence when the call fails. A learner who imported `export` by name is not seen: the hints remain."""

    def __enter__(self) -> "_ExportWatch":
        self.calls, self._real = [], torch.export.export
        real, calls = self._real, self.calls

        def export(mod, args=(), kwargs=None, *rest, **options):
            calls.append({"args": args, "kwargs": kwargs, "dynamic_shapes": options.get("dynamic_shapes")})
            return real(mod, args, kwargs, *rest, **options)
        torch.export.export = export
        return self

    def __exit__(self, *exc) -> None:
        torch.export.export = self._real

    def fault(self, request: torch.Tensor) -> str | None:
        """What the last export call did wrong, when its arguments prove it."""
        if not self.calls:
            return None
        call = self.calls[-1]
        if call["kwargs"] and not call["args"]:
            names = ", ".join(f"{k}=" for k in call["kwargs"])
            return _("you passed the example by keyword ({names}), but forward's argument is not called that here: pass it "
                     "positionally, in the args tuple, and dynamic_shapes as a tuple").format(names=names)
        example = call["args"][0] if isinstance(call["args"], (tuple, list)) and call["args"] else None
        if not isinstance(example, torch.Tensor):
            return None
        if example.dtype != request.dtype:
            return _("you traced with an example of dtype {dtype}; the model takes {model_dtype} images: build the "
                     "example from the request, which keeps its dtype").format(dtype=example.dtype, model_dtype=request.dtype)
        if example.shape[1:] != request.shape[1:]:
            return _("you traced with an example of shape {shape}; the model takes images shaped like the "
                     "request, (N, {sizes})").format(shape=tuple(example.shape), sizes=", ".join(map(str, request.shape[1:])))
        shapes = call["dynamic_shapes"]
        spec = shapes[0] if isinstance(shapes, (tuple, list)) and shapes else (
            next(iter(shapes.values()), None) if isinstance(shapes, dict) and len(shapes) == 1 else None)
        if isinstance(spec, dict) and spec and 0 not in spec:
            return _("you marked dimension {dims} dynamic; the batch is dimension 0: {spec}").format(
                dims=", ".join(map(str, sorted(spec))), spec="dynamic_shapes=({0: Dim('batch', min=1, max=1024)},)")
        return None


def _refusal(err: BaseException, n: int) -> str:
    """Why an exported program refused a batch of n, from its guard's message."""
    text = first_lines(err, width=90)
    frozen = re.search(r"== (\d+)", text)
    if frozen:
        return _("the exported program refuses a batch of {n} ({message}): its batch size is fixed at {size}; "
                 "trace with an example of 2 or more and mark dimension 0 with a Dim (min=1)").format(n=n, message=text, size=frozen.group(1))
    if "<=" in text:
        return _("the exported program refuses a batch of {n} ({message}): the Dim's max is below what a server sends").format(
            n=n, message=text)
    if ">=" in text:
        return _("the exported program refuses a batch of {n} ({message}): give the Dim min=1 (a server gets single requests)").format(
            n=n, message=text)
    return _("the exported program refuses a batch of {n}: {error}: {message}").format(n=n, error=type(err).__name__, message=text)


@exercise("export_from_request")
def check_export_from_request(fn) -> None:
    classes = 12
    model = _small_cnn(41, classes).train()
    reference = _small_cnn(41, classes).eval()
    request = _images(42, 1)
    kept = request.clone()
    what = "export_from_request(model, {request})".format(request=_("request of shape (1, 1, 8, 8)"))
    expect_callable(fn)
    with quiet(), _ExportWatch() as watch:
        try:
            got = fn(model, request)
        except Exception as err:  # noqa: BLE001 -- the learner's error, reported as theirs
            if stub_function(err):
                raise
            fault = watch.fault(kept)
            advice = f" ({fault})" if fault else error_hint(err, {**ERROR_HINTS, **_EXPORT_HINTS})
            raise ExerciseFailed(_("{what} raised {error}: {message}{advice}").format(
                what=what, error=type(err).__name__, message=_telling_line(err), advice=advice)) from None
    expect_unchanged(kept, request, what=what)
    if got is None:
        raise ExerciseFailed(_("{what} returned None: return the ExportedProgram that torch.export.export gives you").format(what=what))
    if isinstance(got, torch.jit.ScriptModule):
        raise ExerciseFailed(_("{what} returned a TorchScript module ({type}, from torch.jit): export with "
                               "torch.export.export and return its ExportedProgram").format(what=what, type=type(got).__name__))
    if got is model:
        raise ExerciseFailed(_("{what} returned the model it was given: return the ExportedProgram that torch.export.export gives you").format(
            what=what))
    if isinstance(got, torch.fx.GraphModule):
        raise ExerciseFailed(_("{what} returned a {type} (ep.module()?): return the ExportedProgram itself").format(
            what=what, type=type(got).__name__))
    if isinstance(got, nn.Module):
        raise ExerciseFailed(_("{what} returned a {type}, an nn.Module: return the ExportedProgram itself").format(
            what=what, type=type(got).__name__))
    if not isinstance(got, ExportedProgram):
        raise ExerciseFailed(_("{what} returned {a_type}, expected a torch.export.ExportedProgram").format(what=what, a_type=a_type(got)))
    module = got.module()
    for n in (1, 2, 7, 1024):
        x = _images(43 + n, n)
        try:
            with torch.no_grad():
                out = module(x)
        except Exception as err:  # noqa: BLE001 -- the exported program's guard refuses the batch
            raise ExerciseFailed(_refusal(err, n)) from None
        with torch.no_grad():
            expected = reference(x)
        if _differs(out, expected) and _graph_in_train_mode(got):
            raise ExerciseFailed(_("{what} exported the model in train mode (dropout and batch-norm updates are in the graph, "
                                   "and an exported program cannot be switched with .eval()): export it in eval mode").format(what=what))
        expect_tensor(out, expected, what=_("the exported program's output for a batch of {n}").format(n=n), atol=1e-5)


# Exercise 4: cascade

_CLASSES = 12  # more than 9: a softmax over the wrong dimension cannot hide


def _cascade_models(seed: int) -> tuple[nn.Module, nn.Module]:
    """The hidden small and large classifiers (64 pixels -> 12 classes), in eval mode."""
    torch.manual_seed(seed)
    small = nn.Sequential(nn.Flatten(), nn.Linear(64, _CLASSES)).eval()
    large = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, _CLASSES)).eval()
    return small, large


def _batch_with_top_logits(small: nn.Module, tops: list[float], seed: int) -> torch.Tensor:
    """Images whose small-model logits are `top` for one class and 0 for the others: the softmax's top probability of
    a logit of 6 is 0.97, of 4 is 0.83, of 2 is 0.40 (12 classes), whatever the logit itself."""
    g = torch.Generator().manual_seed(seed)
    linear = small[1]
    target = torch.zeros(len(tops), _CLASSES)
    target[torch.arange(len(tops)), torch.randint(0, _CLASSES, (len(tops),), generator=g)] = torch.tensor(tops)
    with torch.no_grad():
        flat = (target - linear.bias) @ torch.linalg.pinv(linear.weight).T
    return flat.reshape(-1, 1, 8, 8)


def _cascade_cases(small: nn.Module) -> list[tuple[str, torch.Tensor, float]]:
    """Batches of 8 and thresholds that separate the near-misses: sure of all, of none, of some, logits above the
    threshold while the probabilities are not, and one batch judged against two thresholds. The labels are English,
    marked for the catalog: the check translates them where it shows them."""
    return [
        (N_("a batch the small model is sure of (top probabilities 0.97)"), _batch_with_top_logits(small, [6.0] * 8, 1), 0.9),
        (N_("a batch it is unsure of (0.40)"), _batch_with_top_logits(small, [2.0] * 8, 2), 0.9),
        (N_("a batch it is sure of but for 3 images (0.97 and 0.20)"), _batch_with_top_logits(small, [6.0] * 5 + [1.0] * 3, 3), 0.9),
        (N_("a batch it is sure of but for 1 image (0.97 and 0.83)"), _batch_with_top_logits(small, [6.0] * 7 + [4.0], 6), 0.9),
        (N_("a batch of top probabilities 0.83, threshold 0.9"), _batch_with_top_logits(small, [4.0] * 8, 4), 0.9),
        (N_("a batch of top probabilities 0.83, threshold 0.75"), _batch_with_top_logits(small, [4.0] * 8, 4), 0.75),
        (N_("a batch of top logits 2 (probabilities 0.40), threshold 0.75"), _batch_with_top_logits(small, [2.0] * 8, 5), 0.75),
        # a top logit of 40 gives a top probability of exactly 1.0 however the softmax is computed: "at least" is >=
        (N_("a batch of top probabilities exactly 1.0, threshold 1.0"), _batch_with_top_logits(small, [40.0] * 8, 7), 1.0),
    ]


class _Cascade(nn.Module):
    """The learner's cascade as a module, with the two models as submodules, so that torch.export lifts their weights."""

    def __init__(self, fn, small: nn.Module, large: nn.Module, threshold: float):
        super().__init__()
        self.fn, self.small, self.large, self.threshold = fn, small, large, threshold

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(self.small, self.large, x, self.threshold)


_CASCADE_HINTS = {  # the advice is translated when it is shown (error_hint); N_ marks it for the catalog
    "data-dependent": N_("a Python `if` (or .item(), bool()) on a tensor's value cannot be exported: put the branch into the "
                         "graph with torch.cond(pred, true_fn, false_fn, operands)"),
    "aliasing": N_("a torch.cond branch may not return one of its operands itself: compute its result inside it (for "
                   "example the softmax) or return a .clone()"),
    "Expected pred to be bool": N_("torch.cond's pred must be one boolean: reduce the per-image test to one value (.all())"),
    "pred must be a": N_("torch.cond's pred must be one boolean: reduce the per-image test to one value (.all())"),
}


def _large_outside_cond(ep: ExportedProgram) -> bool:
    """True when the exported graph computes with the large model's weights outside any torch.cond branch."""
    to_param = ep.graph_signature.inputs_to_parameters
    for node in ep.graph.nodes:
        if node.op == "placeholder" and to_param.get(node.name, "").startswith("large."):
            if any(user.target is not torch.ops.higher_order.cond for user in node.users):
                return True
    return False


def _cascade_shape_fault(label: str, got: object, small_logits: torch.Tensor, large_logits: torch.Tensor,
                         small_p: torch.Tensor, large_p: torch.Tensor, threshold: float) -> str:
    """What a cascade returned instead of either model's probabilities, where the values prove it; else ''."""
    top = small_p.amax(dim=1)
    if _close(got, torch.where((top >= threshold)[:, None], small_p, large_p)):
        return _("on {label}, each image got the model chosen for it alone: the whole batch goes to one model "
                 "(one boolean for the batch, one torch.cond)").format(label=label)
    returned_logits = (
        (small_logits, N_("on {label}, returned the small model's logits: return probabilities, a softmax over the classes")),
        (large_logits, N_("on {label}, returned the large model's logits: return probabilities, a softmax over the classes")),
    )
    for logits, returned in returned_logits:
        if _close(got, logits):
            return _(returned).format(label=label)
        if _close(got, logits.softmax(dim=0)):
            return _("on {label}, the softmax ran over the batch (dim 0): take it over the classes, dim=1").format(label=label)
        if _close(got, logits.log_softmax(dim=1)):
            return _("on {label}, returned log-probabilities: return probabilities, a softmax over the classes").format(label=label)
    return ""


def _routing_fault(runs: list[dict]) -> str:
    """Which rule a cascade's choices of model follow, when it is not the exercise's: every case ran, and each answer
    was one model's probabilities."""
    chose = [r["chose"] for r in runs]
    rules = {  # N_ marks each fault for the catalog; it is translated when returned
        N_("the branches are swapped: it answers with the large model when the small one is sure, and the reverse"):
            [not r["sure"] for r in runs],
        N_("it answers with the small model when it is sure of at least one image (.any()); every image's top probability "
           "must reach the threshold (.all(), or the minimum)"): [bool((r["top"] >= r["threshold"]).any()) for r in runs],
        N_("it compares the mean of the top probabilities with the threshold; every image's must reach it (.all(), or the "
           "minimum)"): [bool(r["top"].mean() >= r["threshold"]) for r in runs],
        N_("it compares the small model's logits with the threshold, not its probabilities (a softmax over the classes)"):
            [bool((r["logit_top"] >= r["threshold"]).all()) for r in runs],
        N_("it answers with the small model only when its top probabilities are above the threshold (>); `at least` the "
           "threshold counts too (>=)"): [bool((r["top"] > r["threshold"]).all()) for r in runs],
    }
    for fault, choices in rules.items():
        if chose == choices:
            return _(fault)
    for fixed in sorted({round(float(v), 3) for r in runs for v in r["top"]} | {0.5, 0.8, 0.9, 0.95}):
        if chose == [bool((r["top"] >= fixed).all()) for r in runs]:
            fixed_threshold = (
                _("its choices follow a fixed threshold, not the `threshold` argument: with threshold "
                  "{threshold:g} it answered {label} with the small model") if chose[5] else
                _("its choices follow a fixed threshold, not the `threshold` argument: with threshold "
                  "{threshold:g} it answered {label} with the large model"))
            return fixed_threshold.format(threshold=runs[5]["threshold"], label=runs[5]["label"])
    wrong = next(r for r in runs if r["chose"] != r["sure"])
    if wrong["chose"]:   # a wrong choice is the other model than the one expected
        return _("answered {label} with the small model, expected the large one").format(label=wrong["label"])
    return _("answered {label} with the large model, expected the small one").format(label=wrong["label"])


@exercise("cascade")
def check_cascade(fn) -> None:
    expect_callable(fn)
    small, large = _cascade_models(71)
    runs = []
    for label, x, threshold in _cascade_cases(small):
        label = _(label)
        given = x.clone()
        with torch.no_grad():
            small_logits, large_logits = small(x), large(x)
        small_p, large_p = small_logits.softmax(dim=1), large_logits.softmax(dim=1)
        top = small_p.amax(dim=1)
        what = f"cascade(small, large, {label})"
        with quiet(), torch.no_grad():
            got = call(fn, small, large, given, threshold, shown=f"small, large, {label}", hints=_CASCADE_HINTS)
        expect_unchanged(x, given, what=what)
        sure = bool((top >= threshold).all())
        expected = small_p if sure else large_p
        if not (_close(got, small_p) or _close(got, large_p)):
            fault = _cascade_shape_fault(label, got, small_logits, large_logits, small_p, large_p, threshold)
            if fault:
                raise ExerciseFailed(f"cascade(small, large, x, threshold) {fault}")
            expect_tensor(got, expected, what=what, atol=1e-5)
        runs.append({"label": label, "threshold": threshold, "top": top, "logit_top": small_logits.amax(dim=1),
                     "sure": sure, "chose": _close(got, small_p)})
    if any(r["chose"] != r["sure"] for r in runs):
        raise ExerciseFailed(f"cascade(small, large, x, threshold): {_routing_fault(runs)}")

    exported = _Cascade(fn, small, large, 0.9).eval()
    first = _cascade_cases(small)[0][1]
    with quiet():
        try:
            ep = torch.export.export(exported, (first,))
        except Exception as err:  # noqa: BLE001 -- the learner's code failed to export
            if stub_function(err):
                raise
            advice = error_hint(err, _CASCADE_HINTS)
            raise ExerciseFailed(_("torch.export.export could not export cascade: {error}: {message}{advice}").format(
                error=type(err).__name__, message=first_lines(err, width=90), advice=advice)) from None
    if _large_outside_cond(ep):
        raise ExerciseFailed(_("the exported cascade runs the large model on every batch (its weights are used outside any "
                               "torch.cond branch, as with torch.where, which computes both sides): put the large model "
                               "inside a torch.cond branch, so that it runs only when needed"))
    module = ep.module()
    for label, x, threshold in _cascade_cases(small)[:3]:
        label = _(label)
        with torch.no_grad():
            small_p, large_p = small(x).softmax(dim=1), large(x).softmax(dim=1)
            expected = small_p if bool((small_p.amax(dim=1) >= threshold).all()) else large_p
            try:
                out = module(x.clone())
            except Exception as err:  # noqa: BLE001 -- a guard of the learner's exported program
                raise ExerciseFailed(_("the exported cascade refuses {label}: {error}: {message}").format(
                    label=label, error=type(err).__name__, message=first_lines(err, width=90))) from None
        expect_tensor(out, expected, what=_("the exported cascade on {label}").format(label=label), atol=1e-5)


# Exercise 5: export_onnx

class _Scorer(nn.Module):
    """The ONNX exercise's hidden model. Its input is called `pixels`, and its logits run to the hundreds, so that
    ONNX Runtime's rounding differs measurably from eager PyTorch's."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.conv = nn.Conv2d(1, 6, 3, padding=1)
        self.norm = nn.BatchNorm2d(6)
        self.drop = nn.Dropout(0.5)
        self.fc = nn.Linear(6 * 4 * 4, 12)
        with torch.no_grad():
            self.norm.running_mean.uniform_(-0.5, 0.5)
            self.norm.running_var.uniform_(0.01, 0.05)
            self.fc.weight.mul_(50)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        features = torch.relu(self.norm(self.conv(pixels)))
        return self.fc(self.drop(nn.functional.max_pool2d(features, 2).flatten(1)))


_ONNX_HINTS = {  # the advice is translated when it is shown (error_hint); N_ marks it for the catalog
    "top-level keys must be the arg names": N_("name the argument as forward() does, or pass dynamic_shapes as a tuple: ({0: batch},)"),
    "Input must be a list of dictionaries or a single numpy array": N_("onnxruntime takes numpy arrays: pass x.numpy()"),
    "expected: (tensor(float))": N_("the file wants float32: x.numpy() keeps float32"),
    "are missing from input feed": N_("feed the input under the name the file gives it"),
    "Can't call numpy() on Tensor that requires grad": N_("run the model inside torch.inference_mode() (or .detach() its output)"),
    "Got invalid dimensions for input": N_("the file's batch size is fixed: export with dynamic_shapes"),
}


def _onnx_warning(messages: list[str], what: str) -> str | None:
    """What the warnings of the learner's export (`what`) say about how it exported, if they say something certain."""
    if any("legacy TorchScript-based ONNX export" in m for m in messages):
        return _("{what} used the legacy TorchScript-based exporter (dynamo=False): export with dynamo=True").format(what=what)
    if any("'dynamic_axes' is not recommended" in m for m in messages):
        return _("{what} used the old dynamic_axes spelling: with the dynamo exporter mark the batch with "
                 "dynamic_shapes and a Dim").format(what=what)
    return None


class _OnnxWatch:
    """What a learner's export_onnx did while it ran: its torch.onnx.export calls (their keyword arguments), the batch
    sizes it ran ONNX Runtime on, and the model's own forward passes on real tensors (batch size, train mode)."""

    def __init__(self, model: nn.Module):
        self.model, self.exports, self.sessions, self.forwards = model, [], [], []
        self.runs, self.outputs = [], []   # (input, output) arrays of each ONNX Runtime run, and of the model in eval mode

    def measures(self, example: torch.Tensor) -> dict[str, float] | None:
        """What the learner's own arrays give for each way of measuring, on the example and its first image; None when
        the runs or the model's outputs on them were not seen."""
        wanted = {"example": example.numpy(), "first image": example[:1].numpy()}
        diffs = {}
        for label, x in wanted.items():
            out = next((o for i, o in reversed(self.runs) if i.shape == x.shape and np.array_equal(i, x)), None)
            ref = next((o for i, o in reversed(self.outputs) if i.shape == x.shape and np.array_equal(i, x)), None)
            if ref is None and label == "first image":   # the learner may slice the example's reference
                ref = next((o[:1] for i, o in reversed(self.outputs) if i.shape == wanted["example"].shape
                            and np.array_equal(i, wanted["example"])), None)
            if out is None or ref is None or out.shape != ref.shape:
                return None
            diffs[label] = out.astype(np.float64) - ref.astype(np.float64)
            diffs[label + " relative"] = diffs[label] / (np.abs(ref.astype(np.float64)) + 1e-12)
            probabilities = [np.exp(a - a.max(axis=1, keepdims=True)) for a in (out.astype(np.float64), ref.astype(np.float64))]
            softmaxed = [p / p.sum(axis=1, keepdims=True) for p in probabilities]
            diffs[label + " probabilities"] = softmaxed[0] - softmaxed[1]
        largest = max(float(np.abs(d).max()) for label, d in diffs.items() if label in wanted)
        return {  # "largest", then each fault in English (marked for the catalog; the check translates the one it shows)
            "largest": largest,
            N_("the largest signed difference (a - b).max(), without the absolute value"): max(float(diffs[label].max()) for label in wanted),
            N_("the largest signed difference (b - a).max(), without the absolute value"): max(float((-diffs[label]).max()) for label in wanted),
            N_("the difference on the first image alone, not the largest over the example and its first image"):
                float(np.abs(diffs["first image"]).max()),
            N_("the difference on the example alone, not the largest over the example and its first image"):
                float(np.abs(diffs["example"]).max()),
            N_("the largest squared difference"): largest ** 2,
            N_("the mean absolute difference"): max(float(np.abs(diffs[label]).mean()) for label in wanted),
            N_("a relative difference, not the largest absolute one"): max(float(np.abs(diffs[label + " relative"]).max()) for label in wanted),
            N_("the largest difference of the probabilities (a softmax of the outputs), not of the outputs"):
                max(float(np.abs(diffs[label + " probabilities"]).max()) for label in wanted),
        }

    def __enter__(self) -> "_OnnxWatch":
        import onnxruntime as ort

        self._export, self._run = torch.onnx.export, ort.InferenceSession.run
        real_export, real_run, watch = self._export, self._run, self

        def export(*args, **kwargs):
            exported = args[0] if args else kwargs.get("model")
            watch.exports.append({**kwargs, "_training": exported.training if isinstance(exported, nn.Module) else None})
            return real_export(*args, **kwargs)

        def run(session, output_names, input_feed, *args, **kwargs):
            sizes = [len(v) for v in input_feed.values()] if isinstance(input_feed, dict) else []
            watch.sessions.append(sizes[0] if sizes else None)
            result = real_run(session, output_names, input_feed, *args, **kwargs)
            feed = list(input_feed.values()) if isinstance(input_feed, dict) else []
            if len(feed) == 1 and isinstance(feed[0], np.ndarray) and result and isinstance(result[0], np.ndarray):
                watch.runs.append((feed[0].copy(), result[0].copy()))
            return result

        def forward_seen(module, args, output):
            x = args[0] if args else None
            if isinstance(x, torch.Tensor) and not isinstance(x, torch._subclasses.FakeTensor) and not torch.compiler.is_compiling():
                watch.forwards.append((len(x), module.training))
                if isinstance(output, torch.Tensor) and not module.training:
                    watch.outputs.append((x.detach().cpu().numpy().copy(), output.detach().cpu().numpy().copy()))

        torch.onnx.export = export
        ort.InferenceSession.run = run
        self._hook = self.model.register_forward_hook(forward_seen)
        return self

    def __exit__(self, *exc) -> None:
        import onnxruntime as ort

        torch.onnx.export = self._export
        ort.InferenceSession.run = self._run
        self._hook.remove()


def _file_matches(path: Path, reference: nn.Module, example: torch.Tensor) -> bool:
    """True when the ONNX file at path gives the reference model's outputs on the example (to 1e-4 of their scale)."""
    import onnxruntime as ort

    try:
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        out = torch.from_numpy(session.run(None, {session.get_inputs()[0].name: example.numpy()})[0])
    except Exception:  # noqa: BLE001 -- no usable file: the learner's error stands as it is
        return False
    with torch.no_grad():
        expected = reference(example)
    return out.shape == expected.shape and torch.allclose(out, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())


def _legacy_file(model_proto) -> bool:
    """True when the file came from the TorchScript-based exporter: the dynamo exporter tags every node with its
    origin (metadata keys pkg.torch.onnx.*), the old one tags none."""
    return bool(model_proto.graph.node) and not any(
        prop.key.startswith("pkg.torch.onnx") for node in model_proto.graph.node for prop in node.metadata_props)


@exercise("export_onnx")
def check_export_onnx(fn) -> None:
    import onnx
    import onnxruntime as ort

    model = _Scorer(51).train()
    reference = _Scorer(51).eval()
    example = _images(52, 5) * 4
    example[0] *= 0.05   # the first image's logits are small, so its difference alone is far below the example's largest
    kept = example.clone()
    shown = "model, {example}, path".format(example=_("example of shape (5, 1, 8, 8)"))
    what = f"export_onnx({shown})"
    with tempfile.TemporaryDirectory(prefix="course10_") as folder:
        path = Path(folder) / "scorer.onnx"
        with warnings.catch_warnings(record=True) as caught, quiet(), _OnnxWatch(model) as watch:
            warnings.simplefilter("always")
            try:
                got = _call(fn, model, example, str(path), what=what, hints=_ONNX_HINTS)
            except ExerciseFailed as err:
                if "Tensor-likes are not close" in err.message and _file_matches(path, reference, kept):
                    raise ExerciseFailed(_("{message} (your file is right: ONNX Runtime's float32 rounding on these logits, "
                                           "which run to the hundreds, is beyond torch.testing.assert_close's default tolerances: "
                                           "measure the difference and return it, or pass rtol and atol)").format(message=err.message)) from None
                raise
        messages = [str(w.message) for w in caught]
        expect_unchanged(kept, example, what=what)
        if any(call.get("dynamo") is False for call in watch.exports):
            raise ExerciseFailed(_("{what} used the legacy TorchScript-based exporter (dynamo=False): export with dynamo=True").format(
                what=what))
        if any(call.get("dynamic_axes") for call in watch.exports):
            raise ExerciseFailed(_("{what} used the old dynamic_axes spelling: with the dynamo exporter mark the batch with "
                                   "dynamic_shapes and a Dim").format(what=what))
        if any(call["_training"] for call in watch.exports):
            raise ExerciseFailed(_("{what} exported the model in train mode (torch.onnx.export warns about it: a train-mode "
                                   "graph may keep dropout on): call model.eval() before exporting").format(what=what))
        how = _onnx_warning(messages, what)
        if how:
            raise ExerciseFailed(how)
        moved = [name for name, value in reference.state_dict().items() if not torch.equal(model.state_dict()[name], value)]
        if moved:
            if any(training for _batch, training in watch.forwards):
                raise ExerciseFailed(_("{what} ran the model in train mode, which updated its batch-norm statistics ({name}; "
                                       "a forward pass in train mode does, even under torch.no_grad()): put it in eval mode first").format(
                    what=what, name=moved[0]))
            raise ExerciseFailed(_("{what} changed the model's {name}: leave its weights and statistics as they are").format(
                what=what, name=moved[0]))
        if not path.exists():
            raise ExerciseFailed(_("{what} wrote no file at path").format(what=what))
        beside = sorted(p.name for p in Path(folder).iterdir() if p != path)
        if beside:
            raise ExerciseFailed(_("{what} wrote {name} beside the model: the server gets one file, so keep the weights inside it "
                                   "(external_data=False)").format(what=what, name=beside[0]))
        try:
            onnx.checker.check_model(str(path), full_check=True)
            proto = onnx.load(str(path), load_external_data=False)
            session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        except Exception as err:  # noqa: BLE001 -- the learner's file
            raise ExerciseFailed(_("the file at path is not a valid ONNX model: {error}: {message}").format(
                error=type(err).__name__, message=first_lines(err, width=90))) from None
        if _legacy_file(proto):
            raise ExerciseFailed(_("{what} wrote its file with the legacy TorchScript-based exporter (its nodes carry none of the "
                                   "dynamo exporter's pkg.torch.onnx metadata): export with dynamo=True").format(what=what))
        inputs, outputs = session.get_inputs(), session.get_outputs()
        if [i.name for i in inputs] != ["images"]:
            raise ExerciseFailed(_("the file's inputs are named {names}, expected ['images']: name them at export").format(
                names=[i.name for i in inputs]))
        if [o.name for o in outputs] != ["logits"]:
            raise ExerciseFailed(_("the file's outputs are named {names}, expected ['logits']: name them at export").format(
                names=[o.name for o in outputs]))
        batch = inputs[0].shape[0] if inputs[0].shape else None
        if not isinstance(batch, str):
            raise ExerciseFailed(_("the file's batch dimension is fixed at {batch}: ONNX Runtime would refuse any other batch size; "
                                   "mark dimension 0 dynamic with dynamic_shapes").format(batch=batch))

        def run(session: ort.InferenceSession, x: torch.Tensor) -> np.ndarray:
            try:
                return session.run(None, {"images": x.numpy()})[0]
            except Exception as err:  # noqa: BLE001 -- the learner's file
                raise ExerciseFailed(_("ONNX Runtime could not run the file on a batch of {n}: {error}: {message}").format(
                    n=len(x), error=type(err).__name__, message=first_lines(err, width=90))) from None

        for n in (1, 2, 9):
            x = _images(53 + n, n) * 4
            with torch.no_grad():
                expected = reference(x)
            out = torch.from_numpy(run(session, x))
            scale = expected.abs().max().item()
            expect_tensor(out, expected, what=_("ONNX Runtime's output for a batch of {n}").format(n=n), atol=1e-4 * scale, rtol=1e-4)

        # The learner's session may use other threads or settings, so measure the range a few sessions give.
        measured, means, relative, firsts = [], [], [], []
        for threads in (0, 1):
            options = ort.SessionOptions()
            options.intra_op_num_threads = threads
            other = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
            with torch.no_grad():
                diffs = [(np.abs(run(other, x) - reference(x).numpy()), reference(x).numpy()) for x in (example[:1], example)]
            measured.append(max(float(d.max()) for d, _reference in diffs))
            means.append(max(float(d.mean()) for d, _reference in diffs))
            relative.append(max(float((d / (np.abs(r) + 1e-12)).max()) for d, r in diffs))
            firsts.append(float(diffs[0][0].max()))
    if got is None:
        raise ExerciseFailed(_("{what} returned None: return the largest absolute difference you measured, a Python float").format(
            what=what))
    if isinstance(got, torch.Tensor):
        raise ExerciseFailed(_("{what} returned a tensor: return a Python float, float(...) or .item()").format(what=what))
    if isinstance(got, (np.ndarray, np.generic)):
        raise ExerciseFailed(_("{what} returned {a_type}: return a Python float, float(...)").format(what=what, a_type=a_type(got)))
    if not isinstance(got, float):
        raise ExerciseFailed(_("{what} returned {a_type}, expected a Python float").format(what=what, a_type=a_type(got)))
    ran = sorted(set(s for s in watch.sessions if s is not None))
    if not watch.sessions:
        raise ExerciseFailed(_("{what} never ran ONNX Runtime: open the file with onnxruntime.InferenceSession and run it on "
                               "the example and on its first image alone").format(what=what))
    if not {1, len(example)} <= set(ran):
        missing = (_("a batch of 1 (the example's first image alone)") if 1 not in ran
                   else _("the whole example ({n})").format(n=len(example)))
        raise ExerciseFailed(_("{what} ran ONNX Runtime on batches of {sizes} only: compare on {missing} too, as the exercise asks").format(
            what=what, sizes=ran, missing=missing))
    if watch.forwards and all(training for _batch, training in watch.forwards):
        raise ExerciseFailed(_("{what} returned {got:.3g}, measured against the model in train mode (dropout on, batch norm "
                               "on the batch's own statistics): put it in eval mode before comparing").format(what=what, got=got))
    seen = watch.measures(kept)
    if seen and not math.isclose(got, seen["largest"], rel_tol=1e-3, abs_tol=1e-9):
        for fault, value in seen.items():
            slack = 0.25 if "probabilities" in fault else 1e-3   # the learner's float32 softmax rounds near 1.0
            if fault != "largest" and math.isclose(got, value, rel_tol=slack, abs_tol=1e-12) \
                    and not math.isclose(value, seen["largest"], rel_tol=1e-2):
                raise ExerciseFailed(_("{what} returned {got:.3g}, {fault}: the largest absolute difference is "
                                       "{largest:.3g} here (np.abs(a - b).max())").format(
                    what=what, got=got, fault=_(fault), largest=seen["largest"]))
    low, high = min(measured), max(measured)
    if not low / 2 - 1e-7 <= got <= 2 * high + 1e-6:   # a max differs from a mean, a zero or a train-mode comparison by more
        near = {fault: got > 0 and min(values) / 2 <= got <= 2 * max(values) for fault, values in (
            (N_("{what} returned {got:.3g}, the mean absolute difference; return the largest, {high:.3g} here (np.abs(a - b).max())"),
             means),
            (N_("{what} returned {got:.3g}, a relative difference; return the largest absolute one, {high:.3g} here "
                "(np.abs(a - b).max())"), relative),
            (N_("{what} returned {got:.3g}, the difference on the first image alone; return the largest over the example and "
                "its first image, {high:.3g} here (np.abs(a - b).max())"), firsts))}
        if sum(near.values()) == 1:   # only when one way of measuring alone comes near it
            fault = next(f for f, hit in near.items() if hit)
            raise ExerciseFailed(_(fault).format(what=what, got=got, high=high))
        raise ExerciseFailed(_("{what} returned {got:.3g}, but ONNX Runtime and the model in eval mode differ by up to {high:.3g} "
                               "on the example and on its first image alone").format(what=what, got=got, high=high))
