"""Lesson 10 (saving, exporting and serving a model): reference solutions and the checks for its exercises."""

import contextlib
import io
import logging
import pickle
import tempfile
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.export import Dim, ExportedProgram

from course_utils.tooling.checks import ExerciseFailed, call, exercise, expect_tensor, type_name, scoreboard_for

scoreboard = scoreboard_for(__name__)  # the lesson's last cell: this session's verdicts


# Reference solutions. The checks compare the learner's answers with these.

def load_for_inference(path: str | Path, model: nn.Module) -> nn.Module:
    """Load the state_dict saved at `path` into `model` without running any code from the file; return it in eval mode."""
    model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    return model.eval()


def predict_proba(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Class probabilities (N, classes) for a batch: eval mode, no autograd tracking."""
    model.eval()
    with torch.inference_mode():
        return model(batch).softmax(dim=1)


def export_for_serving(model: nn.Module, example: torch.Tensor) -> ExportedProgram:
    """Export `model` for inference with torch.export, so that the program accepts any batch size."""
    batch = Dim("batch", min=1, max=65_536)
    return torch.export.export(model.eval(), (example,), dynamic_shapes=({0: batch},))


def scale_if_raw(x: torch.Tensor) -> torch.Tensor:
    """Divide the batch by 255 if any value exceeds 1 (raw pixel values), else return it unchanged; exportable."""
    return torch.where(x.max() > 1, x / 255, x)


def onnx_max_abs_diff(onnx_path: str | Path, model: nn.Module, x: torch.Tensor) -> float:
    """Run the ONNX file with onnxruntime and the model in eval mode on x; return the largest absolute difference."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    input_name = session.get_inputs()[0].name
    (onnx_out,) = session.run(None, {input_name: x.numpy()})
    model.eval()
    with torch.inference_mode():
        eager = model(x).numpy()
    return float(np.abs(onnx_out - eager).max())


# Helpers the notebook uses.

@contextlib.contextmanager
def quiet():
    """Keep torch.export's and Inductor's diagnostics off the notebook: the partial graph printed to stderr when an export fails, and log lines."""
    names = ["torch.fx.experimental.symbolic_shapes", "torch._dynamo", "torch.export", "torch._export", "torch.utils.cpp_extension"]
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


# Hidden cases.

def _small_cnn(seed: int) -> nn.Module:
    """A tiny CNN for 1x8x8 inputs with batch norm and dropout, so that train and eval mode differ."""
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Dropout(0.5), nn.Linear(64, 5),
    )
    with torch.no_grad():  # batch-norm statistics that are not the defaults, as after training
        model[1].running_mean.uniform_(-0.5, 0.5)
        model[1].running_var.uniform_(0.5, 2.0)
        model[1].weight.uniform_(0.5, 1.5)
    return model


def _images(seed: int, n: int) -> torch.Tensor:
    return torch.rand(n, 1, 8, 8, generator=torch.Generator().manual_seed(seed))


_TRIPPED: list[str] = []


def _trip(note: str) -> None:
    """What the booby-trapped checkpoint 'runs' if a learner loads it with weights_only=False: it only records the fact."""
    _TRIPPED.append(note)


class _Payload:
    """Pickles as a call to _trip: a harmless stand-in for the code a malicious checkpoint would run."""

    def __reduce__(self):
        return (_trip, ("the checkpoint's code ran",))


@exercise("load_for_inference")
def check_load_for_inference(fn) -> None:
    saved, fresh = _small_cnn(1), _small_cnn(2)
    x = _images(3, 6)
    with tempfile.TemporaryDirectory(prefix="course10_") as folder:
        path = Path(folder) / "weights.pt"
        torch.save(saved.state_dict(), path)
        fresh.train()
        what = "load_for_inference(path, model)"
        got = call(fn, str(path), fresh, shown="path, model")
        if got is None:
            raise ExerciseFailed(f"{what} returned None: return the model, after model.load_state_dict(...)")
        if isinstance(got, dict):
            raise ExerciseFailed(f"{what} returned the state_dict itself: load it with model.load_state_dict(...) and return the model")
        if isinstance(got, tuple) or type(got).__name__ == "_IncompatibleKeys":
            raise ExerciseFailed(f"{what} returned what load_state_dict returns (the key report): return the model itself")
        if not isinstance(got, nn.Module):
            raise ExerciseFailed(f"{what} returned a {type_name(got)}, expected the model (an nn.Module)")
        state = got.state_dict()
        for name, value in saved.state_dict().items():
            if name not in state or not torch.equal(state[name], value):
                raise ExerciseFailed(
                    f"{what}: {name!r} is not the saved value: load the file into the model, "
                    "model.load_state_dict(torch.load(path, weights_only=True))"
                )
        if got.training:
            raise ExerciseFailed(f"{what} returned the model in train mode: call model.eval(), or dropout and batch norm behave as in training")
        with torch.no_grad():
            expect_tensor(got(x), saved.eval()(x), what=f"the loaded model's output on a batch of shape {tuple(x.shape)}")

        # A checkpoint with a payload: loading it safely must fail, and must not run its code.
        trap = Path(folder) / "trap.pt"
        torch.save({**saved.state_dict(), "payload": _Payload()}, trap)
        _TRIPPED.clear()
        raised = None
        try:
            fn(str(trap), _small_cnn(2))
        except NotImplementedError:
            raise
        except Exception as err:  # noqa: BLE001 - the learner's function should raise
            raised = err
        if _TRIPPED:
            _TRIPPED.clear()
            raise ExerciseFailed(
                f"{what} ran code hidden in a checkpoint (harmless here): it loaded with weights_only=False; "
                "use torch.load(path, weights_only=True), which refuses anything but tensors and plain containers"
            )
        if raised is None:
            raise ExerciseFailed(
                f"{what} returned normally for a checkpoint that holds a pickled callable: let torch.load(..., weights_only=True) "
                "raise its UnpicklingError, do not catch it"
            )
        if not isinstance(raised, pickle.UnpicklingError):
            raise ExerciseFailed(
                f"{what} on a checkpoint holding a pickled callable raised {type(raised).__name__}, expected pickle.UnpicklingError "
                "from torch.load(path, weights_only=True)"
            )


@exercise("predict_proba")
def check_predict_proba(fn) -> None:
    model = _small_cnn(4).train()
    batch = _images(5, 7)
    expected = predict_proba(_small_cnn(4), batch)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    what = f"predict_proba(model, tensor of shape {tuple(batch.shape)})"
    got = call(fn, model, batch.clone(), shown=f"model, tensor of shape {tuple(batch.shape)}")
    if got is None:
        raise ExerciseFailed(f"{what} returned None: did you forget to `return` the probabilities?")
    if not isinstance(got, torch.Tensor):
        raise ExerciseFailed(f"{what} returned a {type_name(got)}, expected a torch.Tensor of probabilities")
    if model.training:
        raise ExerciseFailed(f"{what} left the model in train mode: call model.eval() first, or dropout and batch norm change the outputs")
    if any(not torch.equal(model.state_dict()[name], value) for name, value in before.items()):
        raise ExerciseFailed(f"{what} ran the model in train mode, which updated batch norm's running statistics: call model.eval() before the forward pass")
    if got.requires_grad:
        raise ExerciseFailed(f"{what} returned a tensor that autograd tracks (requires_grad=True): run the model inside `with torch.inference_mode():`")
    if got.dtype.is_floating_point is False and got.ndim == 1:
        raise ExerciseFailed(f"{what} returned class indices: return the probabilities, model(batch).softmax(dim=1)")
    if tuple(got.shape) == tuple(expected.shape):
        with torch.no_grad():
            logits = _small_cnn(4).eval()(batch)
        if torch.allclose(got, logits, atol=1e-5):
            raise ExerciseFailed(f"{what} returned the logits: turn them into probabilities with .softmax(dim=1)")
        if torch.allclose(got, logits.log_softmax(dim=1), atol=1e-5):
            raise ExerciseFailed(f"{what} returned log-probabilities: use .softmax(dim=1)")
        if torch.allclose(got, logits.softmax(dim=0), atol=1e-5):
            raise ExerciseFailed(f"{what}: each column sums to 1: softmax over the classes, dim=1, not over the batch")
    expect_tensor(got, expected, what=what, atol=1e-6)


def _graph_in_train_mode(ep: ExportedProgram) -> bool:
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


@exercise("export_for_serving")
def check_export_for_serving(fn) -> None:
    model = _small_cnn(6).train()
    reference = _small_cnn(6).eval()
    example = _images(7, 4)
    what = "export_for_serving(model, example of batch 4)"
    hints = {
        "top-level keys must be the arg names": "name the argument as forward() does, or pass dynamic_shapes as a tuple: ({0: batch},)",
        "Could not guard on data-dependent": "the model has no data-dependent branches; did you change it?",
    }
    with quiet():
        got = call(fn, model, example.clone(), shown="model, example of batch 4", hints=hints)
    if got is None:
        raise ExerciseFailed(f"{what} returned None: return the ExportedProgram that torch.export.export gives you")
    if isinstance(got, nn.Module):
        raise ExerciseFailed(f"{what} returned a {type(got).__name__} (ep.module()?): return the ExportedProgram itself")
    if not isinstance(got, ExportedProgram):
        raise ExerciseFailed(f"{what} returned a {type_name(got)}, expected a torch.export.ExportedProgram")
    if _graph_in_train_mode(got):
        raise ExerciseFailed(
            f"{what} exported the model in train mode (dropout and batch-norm updates are in the graph, and the exported "
            "program cannot be switched with .eval()): call model.eval() before exporting"
        )
    module = got.module()
    for n in (4, 3, 1, 300):
        x = _images(8 + n, n)
        try:
            out = module(x)
        except Exception as err:  # noqa: BLE001 - the exported program's guard
            text = str(err)
            if n == 4:
                raise ExerciseFailed(f"the exported program failed on the example's own batch size: {type(err).__name__}: {first_lines(err)}") from None
            if "<=" in text:
                raise ExerciseFailed(
                    f"the exported program refuses a batch of {n} ({first_lines(err)}): the Dim's max is too small; "
                    "leave it out, or make it generous"
                ) from None
            if ">=" in text:
                raise ExerciseFailed(
                    f"the exported program refuses a batch of {n} ({first_lines(err)}): give the Dim min=1 (a server gets single requests)"
                ) from None
            raise ExerciseFailed(
                f"the exported program refuses a batch of {n} ({first_lines(err)}): the batch size was frozen at 4; "
                "pass dynamic_shapes=({0: torch.export.Dim('batch', min=1)},)"
            ) from None
        with torch.no_grad():
            expect_tensor(out, reference(x), what=f"the exported program's output for a batch of {n}", atol=1e-5)


def _raw_and_scaled(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (3, 1, 4, 4), generator=g).float()
    raw[0, 0, 0, :3] = torch.tensor([0.0, 1.0, 255.0])  # a raw batch has values <= 1 too
    scaled = torch.rand(5, 1, 4, 4, generator=g)
    scaled[0, 0, 0, 0] = 1.0                              # 1 is a valid scaled value: it stays as it is
    return [("a raw batch, values 0 to 255", raw), ("a scaled batch, values in [0, 1]", scaled)]


class _Wrap(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


_SCALE_HINTS = {
    "data-dependent": "a Python `if` (or .item()) on a tensor's value cannot be exported: use torch.where(cond, a, b) or torch.cond",
    "aliasing": "a torch.cond branch may not return its input itself: return x.clone()",
}


@exercise("scale_if_raw")
def check_scale_if_raw(fn) -> None:
    cases = _raw_and_scaled(9)
    for label, x in cases:
        what = f"scale_if_raw({label})"
        got = call(fn, x.clone(), shown=label, hints=_SCALE_HINTS)
        if isinstance(got, torch.Tensor) and label.startswith("a raw") and got.shape == x.shape:
            elementwise = torch.where(x > 1, x / 255, x)
            if torch.equal(got, elementwise) and not torch.equal(got, scale_if_raw(x)):
                raise ExerciseFailed(
                    f"{what}: the 0s and 1s of the raw batch were not divided: the test must be on the whole batch, "
                    "x.max() > 1, not on each element"
                )
        if isinstance(got, torch.Tensor) and label.startswith("a scaled") and torch.allclose(got, x / 255):
            raise ExerciseFailed(f"{what} divided an already scaled batch by 255: divide only when x.max() > 1")
        expect_tensor(got, scale_if_raw(x), what=what)

    with quiet():
        try:
            ep = torch.export.export(_Wrap(fn), (cases[1][1],), dynamic_shapes=({0: Dim("batch", min=1)},))
        except NotImplementedError:
            raise
        except Exception as err:  # noqa: BLE001 - the learner's code failed to export
            text = str(err)
            advice = next((hint for key, hint in _SCALE_HINTS.items() if key in text), "")
            raise ExerciseFailed(f"torch.export.export could not export scale_if_raw: {type(err).__name__}: {first_lines(err, width=90)}"
                                 + (f" ({advice})" if advice else "")) from None
    module = ep.module()
    for label, x in cases:
        expect_tensor(module(x.clone()), scale_if_raw(x), what=f"the exported scale_if_raw on {label}")


def _mlp_and_onnx(seed: int, folder: Path, nudge: float = 0.0) -> tuple[nn.Module, Path]:
    """A small MLP (with dropout) and an ONNX file of it built by hand; `nudge` is subtracted from the file's last bias."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 3))
    w1, b1, w2, b2 = (p.detach().numpy().copy() for p in model.parameters())
    b2[-1] -= np.float32(nudge)
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["features", "w1", "b1"], ["h"], transB=1),
         helper.make_node("Relu", ["h"], ["r"]),
         helper.make_node("Gemm", ["r", "w2", "b2"], ["scores"], transB=1)],
        "mlp",
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", 6])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["batch", 3])],
        initializer=[numpy_helper.from_array(a, name) for a, name in ((w1, "w1"), (b1, "b1"), (w2, "w2"), (b2, "b2"))],
    )
    onnx_model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    path = folder / f"mlp_{seed}.onnx"
    onnx.save(onnx_model, path)
    return model, path


@exercise("onnx_max_abs_diff")
def check_onnx_max_abs_diff(fn) -> None:
    hints = {
        "Input must be a list of dictionaries or a single numpy array": "onnxruntime takes numpy arrays: pass x.numpy()",
        "expected: (tensor(float))": "the model wants float32: x.numpy() keeps float32; do not convert to float64",
        "are missing from input feed": "read the input's name from session.get_inputs()[0].name",
        "Can't call numpy() on Tensor that requires grad": "run the model inside torch.inference_mode() (or .detach() its output)",
    }
    import onnxruntime as ort

    x = torch.randn(9, 6, generator=torch.Generator().manual_seed(11))
    with tempfile.TemporaryDirectory(prefix="course10_") as folder:
        for seed, nudge, label in ((12, 0.0, "an exact export"), (13, 0.01, "a file whose last bias is 0.01 lower")):
            model, path = _mlp_and_onnx(seed, Path(folder), nudge)
            model.train()
            what = f"onnx_max_abs_diff({label}, model, x)"
            got = call(fn, str(path), model, x.clone(), shown=f"path, model, tensor of shape {tuple(x.shape)}", hints=hints)
            expected = onnx_max_abs_diff(path, model, x)
            session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
            (onnx_out,) = session.run(None, {"features": x.numpy()})
            with torch.inference_mode():
                diff = onnx_out - model.eval()(x).numpy()
            if got is None:
                raise ExerciseFailed(f"{what} returned None: did you forget to `return` the difference?")
            if isinstance(got, torch.Tensor):
                raise ExerciseFailed(f"{what} returned a tensor: return a Python float, float(...) or .item()")
            if isinstance(got, np.ndarray) and got.ndim > 0:
                raise ExerciseFailed(f"{what} returned an array of shape {got.shape}: reduce it to one number, the max of the absolute differences")
            if not isinstance(got, float):
                raise ExerciseFailed(f"{what} returned a {type_name(got)}, expected a Python float: wrap it in float(...)")
            if nudge and np.isclose(got, float(diff.max()), rtol=1e-3) and not np.isclose(got, expected, rtol=1e-3):
                raise ExerciseFailed(f"{what} returned the largest signed difference, {got:.3g}: take the absolute value first, np.abs(a - b).max()")
            if nudge and np.isclose(got, float(np.abs(diff).mean()), rtol=1e-3) and not np.isclose(got, expected, rtol=1e-3):
                raise ExerciseFailed(f"{what} returned the mean absolute difference: return the max")
            if got > 10 * expected + 1e-4:
                raise ExerciseFailed(
                    f"{what} returned {got:.3g}, expected {expected:.3g}: compare with the model in eval mode (model.eval()); "
                    "in train mode dropout changes the outputs"
                )
            if not np.isclose(got, expected, rtol=1e-3, atol=1e-6):
                raise ExerciseFailed(f"{what} returned {got:.6g}, expected {expected:.6g}")
