"""Lesson 10's checks against the reference solutions and the wrong answers learners write; ONNX Runtime against eager."""

import pickle
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn
from torch.export import Dim

from course_utils import lesson10 as L
from lesson_contract import assert_names_fault, contract_tests

PAIRS = [
    (L.check_load_for_inference, L.load_for_inference),
    (L.check_predict_proba, L.predict_proba),
    (L.check_export_for_serving, L.export_for_serving),
    (L.check_scale_if_raw, L.scale_if_raw),
    (L.check_onnx_max_abs_diff, L.onnx_max_abs_diff),
]

(test_reference_passes, test_stub_is_not_attempted, test_bad_input_is_one_named_line, test_hostile_answers_are_the_learners_fault,
 test_checks_leave_the_learners_random_state_alone, test_checks_are_quick) = contract_tests(PAIRS, max_seconds=2.0)


# Typical wrong answers, one function each.

def load_unsafely(path, model):
    model.load_state_dict(torch.load(path, weights_only=False))
    return model.eval()


def load_in_train_mode(path, model):
    model.load_state_dict(torch.load(path, weights_only=True))
    return model


def load_returns_state_dict(path, model):
    return torch.load(path, weights_only=True)


def load_returns_key_report(path, model):
    model.eval()
    return model.load_state_dict(torch.load(path, weights_only=True))


def load_forgets_to_load(path, model):
    torch.load(path, weights_only=True)
    return model.eval()


def load_non_strict(path, model):  # strict=False ignores the payload key; torch.load has already refused it
    model.load_state_dict(torch.load(path, weights_only=True), strict=False)
    return model.eval()


def load_swallows_errors(path, model):
    try:
        model.load_state_dict(torch.load(path, weights_only=True))
    except pickle.UnpicklingError:
        pass
    return model.eval()


def load_raises_something_else(path, model):
    try:
        model.load_state_dict(torch.load(path, weights_only=True))
    except pickle.UnpicklingError:
        raise ValueError("unsafe file") from None
    return model.eval()


def load_with_default_weights_only(path, model):  # a correct alternative: weights_only=True is the default since 2.6
    model.load_state_dict(torch.load(path))
    model.eval()
    return model


def proba_in_train_mode(model, batch):
    with torch.inference_mode():
        return model(batch).softmax(dim=1)


def proba_with_grad(model, batch):
    model.eval()
    return model(batch).softmax(dim=1)


def proba_logits(model, batch):
    model.eval()
    with torch.inference_mode():
        return model(batch)


def proba_log_softmax(model, batch):
    model.eval()
    with torch.inference_mode():
        return model(batch).log_softmax(dim=1)


def proba_wrong_dim(model, batch):
    model.eval()
    with torch.inference_mode():
        return model(batch).softmax(dim=0)


def proba_classes(model, batch):
    model.eval()
    with torch.inference_mode():
        return model(batch).argmax(dim=1)


def proba_train_then_eval(model, batch):  # a forward pass in train mode first: batch norm's statistics move
    with torch.no_grad():
        model(batch)
    return L.predict_proba(model, batch)


def proba_no_grad(model, batch):  # a correct alternative
    model.eval()
    with torch.no_grad():
        return torch.softmax(model(batch), dim=-1)


def export_static(model, example):
    return torch.export.export(model.eval(), (example,))


def export_train_mode(model, example):
    return torch.export.export(model, (example,), dynamic_shapes=({0: Dim("batch", min=1)},))


def export_module(model, example):
    return L.export_for_serving(model, example).module()


def export_dict_named_x(model, example):
    return torch.export.export(model.eval(), (example,), dynamic_shapes={"x": {0: Dim("batch")}})


def export_small_max(model, example):
    return torch.export.export(model.eval(), (example,), dynamic_shapes=({0: Dim("batch", min=1, max=64)},))


def export_auto(model, example):  # a correct alternative: Dim.DYNAMIC lets export infer the range
    return torch.export.export(model.eval(), (example,), dynamic_shapes=({0: Dim.DYNAMIC},))


def scale_python_if(x):
    if x.max() > 1:
        x = x / 255
    return x


def scale_item(x):
    return x / 255 if x.max().item() > 1 else x


def scale_always(x):
    return x / 255


def scale_elementwise(x):
    return torch.where(x > 1, x / 255, x)


def scale_cond_aliasing(x):
    return torch.cond(x.max() > 1, lambda t: t / 255, lambda t: t, (x,))


def scale_cond(x):  # a correct alternative
    return torch.cond(x.max() > 1, lambda t: t / 255, lambda t: t.clone(), (x,))


def scale_arithmetic(x):  # a correct alternative, without a branch
    raw = (x.max() > 1).to(x.dtype)
    return x / (1 + 254 * raw)


def diff_tensor_input(path, model, x):
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    (out,) = session.run(None, {session.get_inputs()[0].name: x})
    return float(np.abs(out - model.eval()(x).detach().numpy()).max())


def diff_float64(path, model, x):
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    (out,) = session.run(None, {session.get_inputs()[0].name: np.array(x.tolist())})
    return float(np.abs(out - model.eval()(x).detach().numpy()).max())


def diff_input_named_x(path, model, x):
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    (out,) = session.run(None, {"x": x.numpy()})
    return float(np.abs(out - model.eval()(x).detach().numpy()).max())


def diff_with_grad(path, model, x):
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    (out,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    return float(np.abs(out - model.eval()(x).numpy()).max())


def diff_train_mode(path, model, x):
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    (out,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    with torch.inference_mode():
        return float(np.abs(out - model(x).numpy()).max())


def diff_signed(path, model, x):
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    (out,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    with torch.inference_mode():
        return float((out - model.eval()(x).numpy()).max())


def diff_mean(path, model, x):
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    (out,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    with torch.inference_mode():
        return float(np.abs(out - model.eval()(x).numpy()).mean())


def diff_numpy_scalar(path, model, x):
    return np.float32(L.onnx_max_abs_diff(path, model, x))


def diff_array(path, model, x):
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    (out,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    with torch.inference_mode():
        return np.abs(out - model.eval()(x).numpy())


def diff_torch(path, model, x):  # a correct alternative: compare as tensors
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    (out,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    model.eval()
    with torch.no_grad():
        return (torch.from_numpy(out) - model(x)).abs().max().item()


WRONG = [
    (L.check_load_for_inference, load_unsafely, "ran code hidden in a checkpoint.*weights_only=True"),
    (L.check_load_for_inference, load_in_train_mode, "in train mode: call model.eval\\(\\)"),
    (L.check_load_for_inference, load_returns_state_dict, "returned the state_dict itself.*load_state_dict"),
    (L.check_load_for_inference, load_returns_key_report, "key report\\): return the model itself"),
    (L.check_load_for_inference, load_forgets_to_load, "is not the saved value.*model.load_state_dict"),
    (L.check_load_for_inference, load_swallows_errors, "returned normally.*do not catch it"),
    (L.check_load_for_inference, load_raises_something_else, "raised ValueError, expected pickle.UnpicklingError"),
    (L.check_load_for_inference, lambda path, model: None, "returned None"),
    (L.check_load_for_inference, load_non_strict, None),
    (L.check_load_for_inference, load_with_default_weights_only, None),
    (L.check_predict_proba, proba_in_train_mode, "left the model in train mode.*model.eval\\(\\)"),
    (L.check_predict_proba, proba_train_then_eval, "ran the model in train mode.*running statistics"),
    (L.check_predict_proba, proba_with_grad, "autograd tracks.*torch.inference_mode\\(\\)"),
    (L.check_predict_proba, proba_logits, "returned the logits.*softmax\\(dim=1\\)"),
    (L.check_predict_proba, proba_log_softmax, "log-probabilities"),
    (L.check_predict_proba, proba_wrong_dim, "each column sums to 1.*dim=1"),
    (L.check_predict_proba, proba_classes, "returned class indices"),
    (L.check_predict_proba, lambda model, batch: None, "returned None"),
    (L.check_predict_proba, proba_no_grad, None),
    (L.check_export_for_serving, export_static, "refuses a batch of 3.*frozen at 4.*dynamic_shapes"),
    (L.check_export_for_serving, export_train_mode, "in train mode.*model.eval\\(\\) before exporting"),
    (L.check_export_for_serving, export_module, "returned a GraphModule \\(ep.module\\(\\)\\?\\): return the ExportedProgram itself"),
    (L.check_export_for_serving, export_dict_named_x, "raised UserError.*pass dynamic_shapes as a tuple"),
    (L.check_export_for_serving, export_small_max, "refuses a batch of 300.*max is too small"),
    (L.check_export_for_serving, lambda model, example: None, "returned None"),
    (L.check_export_for_serving, export_auto, None),
    (L.check_scale_if_raw, scale_python_if, "could not export scale_if_raw.*torch.where"),
    (L.check_scale_if_raw, scale_item, "could not export scale_if_raw.*torch.where"),
    (L.check_scale_if_raw, scale_always, "divided an already scaled batch by 255"),
    (L.check_scale_if_raw, scale_elementwise, "0s and 1s of the raw batch were not divided.*x.max\\(\\) > 1"),
    (L.check_scale_if_raw, scale_cond_aliasing, "raised UncapturedHigherOrderOpError.*return x.clone\\(\\)"),
    (L.check_scale_if_raw, lambda x: None, "is None"),
    (L.check_scale_if_raw, scale_cond, None),
    (L.check_scale_if_raw, scale_arithmetic, None),
    (L.check_onnx_max_abs_diff, diff_tensor_input, "raised RuntimeError.*pass x.numpy\\(\\)"),
    (L.check_onnx_max_abs_diff, diff_float64, "wants float32"),
    (L.check_onnx_max_abs_diff, diff_input_named_x, "session.get_inputs\\(\\)\\[0\\].name"),
    (L.check_onnx_max_abs_diff, diff_with_grad, "torch.inference_mode\\(\\)"),
    (L.check_onnx_max_abs_diff, diff_train_mode, "model.eval\\(\\).*dropout"),
    (L.check_onnx_max_abs_diff, diff_signed, "largest signed difference.*absolute value"),
    (L.check_onnx_max_abs_diff, diff_mean, "mean absolute difference: return the max"),
    (L.check_onnx_max_abs_diff, diff_numpy_scalar, "returned a numpy.float32, expected a Python float"),
    (L.check_onnx_max_abs_diff, diff_array, "returned an array of shape \\(9, 3\\)"),
    (L.check_onnx_max_abs_diff, lambda path, model, x: None, "returned None"),
    (L.check_onnx_max_abs_diff, diff_torch, None),
]


@pytest.mark.parametrize("check, wrong, message", WRONG, ids=[f"{c.exercise_name}-{getattr(w, '__name__', 'lambda')}-{i}" for i, (c, w, m) in enumerate(WRONG)])
def test_wrong_answers_name_the_fault(check, wrong, message):
    assert_names_fault(check, wrong, message)


def test_checks_print_no_warnings(recwarn, capsys):
    """Export, ONNX Runtime and the trapped checkpoint stay quiet: no warning, nothing on stderr."""
    for check, reference in PAIRS:
        check(reference)
    assert not [str(w.message) for w in recwarn.list]
    assert capsys.readouterr().err == ""


def test_the_trapped_checkpoint_never_runs_for_a_correct_answer():
    L._TRIPPED.clear()
    L.check_load_for_inference(L.load_for_inference)
    assert not L._TRIPPED


def test_the_unsafe_loader_is_caught_and_the_trap_is_reset():
    with pytest.raises(Exception, match="ran code hidden"):
        L.check_load_for_inference(load_unsafely)
    assert not L._TRIPPED


class _Digits(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                                 nn.Flatten(), nn.Dropout(0.3), nn.Linear(128, 10))

    def forward(self, x):
        return self.net(x)


def test_onnxruntime_equals_eager(tmp_path, capsys):
    """The lesson's claim: a dynamo ONNX export with a dynamic batch, run by ONNX Runtime, equals eager PyTorch."""
    torch.manual_seed(0)
    model = _Digits()
    with torch.no_grad():
        model.net[1].running_mean.uniform_(-0.5, 0.5)
        model.net[1].running_var.uniform_(0.5, 2.0)
    model.eval()
    path = tmp_path / "digits.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        warnings.simplefilter("error", FutureWarning)
        torch.onnx.export(model, (torch.rand(4, 1, 8, 8),), path, dynamo=True, dynamic_shapes=({0: Dim("batch", min=1)},),
                          input_names=["images"], output_names=["logits"], verbose=False)
    assert capsys.readouterr().out == ""  # verbose=False: no progress lines
    assert path.with_name("digits.onnx.data").exists()  # the weights go to external data by default
    onnx.checker.check_model(str(path), full_check=True)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for n in (1, 5, 64):
        x = torch.rand(n, 1, 8, 8)
        (out,) = session.run(None, {"images": x.numpy()})
        with torch.inference_mode():
            expected = model(x).numpy()
        assert out.shape == (n, 10)
        assert np.abs(out - expected).max() < 1e-5
        assert L.onnx_max_abs_diff(path, model, x) < 1e-5


def test_torch_export_equals_eager_at_other_batch_sizes():
    torch.manual_seed(1)
    model = _Digits().eval()
    ep = L.export_for_serving(model, torch.rand(4, 1, 8, 8))
    for n in (1, 3, 500):
        x = torch.rand(n, 1, 8, 8)
        with torch.inference_mode():
            assert torch.equal(ep.module()(x), model(x))


def test_weights_only_refuses_the_payload_and_runs_nothing(tmp_path):
    path = tmp_path / "trap.pt"
    torch.save({"w": torch.ones(2), "payload": L._Payload()}, path)
    L._TRIPPED.clear()
    with pytest.raises(pickle.UnpicklingError, match="Unsupported global"):
        torch.load(path, weights_only=True)
    assert not L._TRIPPED


def test_quiet_restores_logging_and_stderr(capsys):
    import logging
    import sys

    logger = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    before, stderr = logger.level, sys.stderr
    with L.quiet():
        print("hidden", file=sys.stderr)
    assert logger.level == before and sys.stderr is stderr
    assert "hidden" not in capsys.readouterr().err
