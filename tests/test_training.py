"""course_utils.training: the shared loop, evaluation, early stopping, checkpoints and exact resume."""

import random

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from course_utils.reproducibility import deterministic, seed_everything
from course_utils.training import evaluate, fit, load_checkpoint, rng_state, save_checkpoint, set_rng_state, train_one_epoch


def blobs(n: int = 256, seed: int = 0) -> TensorDataset:
    """Three well-separated Gaussian blobs in 2-D: learnable in a few epochs."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 3, (n,), generator=g)
    centres = torch.tensor([[0.0, 3.0], [3.0, -2.0], [-3.0, -2.0]])
    return TensorDataset(centres[labels] + 0.5 * torch.randn(n, 2, generator=g), labels)


def setup(seed: int = 0, lr: float = 0.05):
    seed_everything(seed)
    model = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    generator = torch.Generator().manual_seed(seed)
    loader = DataLoader(blobs(), batch_size=32, shuffle=True, generator=generator)
    return model, optimizer, scheduler, generator, loader


def test_fit_learns_and_returns_one_row_per_epoch(capsys):
    model, optimizer, _, _, loader = setup()
    history = fit(model, loader, DataLoader(blobs(seed=1), batch_size=64), nn.functional.cross_entropy, optimizer, epochs=4)
    assert list(history.index) == [1, 2, 3, 4]
    assert {"train_loss", "val_loss", "val_accuracy", "lr"} <= set(history.columns)
    assert history["val_accuracy"].iloc[-1] > 0.95
    assert history["train_loss"].iloc[-1] < history["train_loss"].iloc[0]
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 and lines[0].startswith("epoch 1/4") and "val_acc" in lines[0]


def test_evaluate_uses_eval_mode_and_no_grad():
    model, _, _, _, loader = setup()
    model.train()
    seen = []
    model.register_forward_hook(lambda m, i, o: seen.append((m.training, o.requires_grad)))
    metrics = evaluate(model, loader, nn.functional.cross_entropy)
    assert set(metrics) == {"loss", "accuracy"} and 0.0 <= metrics["accuracy"] <= 1.0
    assert seen and all(not training and not grad for training, grad in seen)


def test_evaluate_regression_has_no_accuracy():
    data = TensorDataset(torch.randn(20, 3), torch.randn(20, 1))
    metrics = evaluate(nn.Linear(3, 1), DataLoader(data, batch_size=8), nn.functional.mse_loss)
    assert set(metrics) == {"loss"}


def test_batch_scheduler_steps_every_batch():
    model, optimizer, _, _, loader = setup()
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=len(loader))
    train_one_epoch(model, loader, nn.functional.cross_entropy, optimizer, batch_scheduler=scheduler)
    assert scheduler.last_epoch == len(loader)


def test_early_stopping_and_best_checkpoint(tmp_path, capsys):
    model, optimizer, _, _, loader = setup(lr=0.0)  # lr 0: validation loss never improves after epoch 1
    history = fit(model, loader, loader, nn.functional.cross_entropy, optimizer, epochs=10, patience=2,
                  best_path=tmp_path / "best.pt")
    assert len(history) == 3
    assert "early stop" in capsys.readouterr().out
    assert torch.load(tmp_path / "best.pt", weights_only=True)["epoch"] == 1


def test_best_checkpoint_holds_the_loaders_generator(tmp_path):
    """fit's checkpoint restores the shuffle order of the epochs after the best one, not only the weights."""
    model, optimizer, scheduler, generator, loader = setup()
    fit(model, loader, loader, nn.functional.cross_entropy, optimizer, epochs=2, scheduler=scheduler,
        best_path=tmp_path / "best.pt", log=None)
    checkpoint = torch.load(tmp_path / "best.pt", weights_only=True)
    assert {"epoch", "model", "optimizer", "scheduler", "rng"} <= set(checkpoint)
    assert {"python", "numpy", "torch", "generator"} <= set(checkpoint["rng"])
    other = torch.Generator().manual_seed(99)
    load_checkpoint(tmp_path / "best.pt", model=model, generator=other)
    assert torch.equal(other.get_state(), checkpoint["rng"]["generator"])


def test_rng_state_round_trip():
    generator = torch.Generator().manual_seed(3)
    state = rng_state(generator)
    first = (random.random(), np.random.rand(), torch.rand(1).item(), torch.rand(1, generator=generator).item())
    set_rng_state(state, generator)
    assert (random.random(), np.random.rand(), torch.rand(1).item(), torch.rand(1, generator=generator).item()) == first


def _train(model, optimizer, scheduler, loader, epochs):
    for _ in range(epochs):
        train_one_epoch(model, loader, nn.functional.cross_entropy, optimizer)
        scheduler.step()


def test_resume_from_checkpoint_is_bit_for_bit(tmp_path):
    """2 epochs, save, fresh objects, load, 2 more == 4 uninterrupted epochs, exactly."""
    with deterministic():
        model, optimizer, scheduler, _, loader = setup()
        _train(model, optimizer, scheduler, loader, 4)
        straight = {k: v.clone() for k, v in model.state_dict().items()}

        model, optimizer, scheduler, generator, loader = setup()
        _train(model, optimizer, scheduler, loader, 2)
        save_checkpoint(tmp_path / "ck.pt", model=model, optimizer=optimizer, scheduler=scheduler, epoch=2, generator=generator)

        model, optimizer, scheduler, generator, loader = setup(seed=123)  # different init and RNG on purpose
        checkpoint = load_checkpoint(tmp_path / "ck.pt", model=model, optimizer=optimizer, scheduler=scheduler, generator=generator)
        assert checkpoint["epoch"] == 2
        _train(model, optimizer, scheduler, loader, 2)
        resumed = model.state_dict()
    for name, value in straight.items():
        assert torch.equal(value, resumed[name]), f"{name} differs after resume"


def test_resume_without_rng_state_differs(tmp_path):
    """The test above can fail: skip restoring the shuffle generator and dropout RNG, and weights drift."""
    model, optimizer, scheduler, _, loader = setup()
    _train(model, optimizer, scheduler, loader, 4)
    straight = model.state_dict()["0.weight"].clone()
    model, optimizer, scheduler, generator, loader = setup()
    _train(model, optimizer, scheduler, loader, 2)
    save_checkpoint(tmp_path / "ck.pt", model=model, optimizer=optimizer, scheduler=scheduler, epoch=2)
    model, optimizer, scheduler, generator, loader = setup(seed=123)
    load_checkpoint(tmp_path / "ck.pt", model=model, optimizer=optimizer, scheduler=scheduler)  # generator not restored
    _train(model, optimizer, scheduler, loader, 2)
    assert not torch.equal(model.state_dict()["0.weight"], straight)


def test_checkpoint_loads_with_weights_only(tmp_path):
    model, optimizer, scheduler, generator, _ = setup()
    save_checkpoint(tmp_path / "ck.pt", model=model, optimizer=optimizer, scheduler=scheduler, epoch=5, generator=generator, note="hi")
    checkpoint = torch.load(tmp_path / "ck.pt", weights_only=True)
    assert checkpoint["epoch"] == 5 and checkpoint["note"] == "hi"
    assert {"model", "optimizer", "scheduler", "rng"} <= set(checkpoint)
