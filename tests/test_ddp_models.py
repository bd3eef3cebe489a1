"""course_utils.ddp_models: lesson 09's model and data, and the probe that follows a training script's ranks."""

import os
import subprocess
import sys

import torch

from course_utils import ddp_models
from course_utils.ddp_models import Block, block_model, held_out_digits, make_model, training_digits


def test_make_model_is_seeded_and_classifies_digits():
    a, b, c = make_model(), make_model(), make_model(seed=1)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a[1].weight, c[1].weight)
    assert a(torch.rand(5, 1, 8, 8)).shape == (5, 10)
    assert sum(p.numel() for p in a.parameters()) == 4810


def test_training_and_test_digits():
    train = training_digits()
    image, label = train[3]
    assert len(train) == 1438 and image.shape == (1, 8, 8) and label.dtype == torch.int64
    assert 0.0 <= float(train.images.min()) and float(train.images.max()) <= 1.0
    images, labels = held_out_digits()
    assert images.shape == (359, 1, 8, 8) and labels.shape == (359,)
    assert train.reads is None  # the probe is off outside lesson 09's check


def test_block_model_is_blocks_then_a_head():
    model = block_model(dim=8, n_blocks=2, n_classes=5)
    assert [type(m) for m in model] == [Block, Block, torch.nn.Linear]
    assert model(torch.randn(3, 8)).shape == (3, 5)


SCRIPT = """
import torch
from course_utils.ddp_models import make_model, training_digits
model = make_model()
data = training_digits()
model.train()
for i in (4, 0, 9):
    model(data[i][0][None])
torch.save({"w": torch.ones(1)}, "out.pt")
raise NotImplementedError()
"""


def test_run_rank_records_reads_forwards_saves_and_the_stub(tmp_path):
    script = tmp_path / "probe_me.py"
    script.write_text(SCRIPT)
    env = {**os.environ, ddp_models.PROBE_ENV: str(tmp_path), "RANK": "1"}
    ran = subprocess.run([sys.executable, "-c", ddp_models.RANK_COMMAND, str(script)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert ran.returncode == 1
    record = torch.load(tmp_path / "rank1.pt", weights_only=True)
    assert record["reads"] == [4, 0, 9] and record["batches"] == [1, 1, 1] and record["models"] == 1
    assert record["saves"] == [{"path": "out.pt", "type": "dict", "module": False}]
    assert record["error"]["type"] == "NotImplementedError" and record["error"]["stub"]
    assert record["error"]["function"] == "<module>" and record["error"]["line"] == 10
    assert set(record["state"]) == set(make_model().state_dict()) and not record["initialized_at_end"]
    assert set(record["after_two_steps"]) == set(record["state"])  # the weights its third training forward saw
