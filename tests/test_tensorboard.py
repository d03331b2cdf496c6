"""TensorBoard's event files of a run with `train.tensorboard: true`, read back by its reader."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from mtrain.core import jsonl
from mtrain.run.directory import EXAMPLES, TENSORBOARD
from mtrain.training.build import build_trainer

from .synthetic import REPO, overrides, small_config

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


@pytest.fixture(scope="module")
def events(corpus, tmp_path_factory):
    """The tiny config trained 20 updates with TensorBoard on, two validations and an average."""
    run = tmp_path_factory.mktemp("tensorboard")
    settings = dict(max_steps=20, eval_every=10, keep_last=2, average_last=2, tensorboard="true")
    build_trainer(small_config(corpus, **settings), run, torch.device("cpu")).run()
    reader = event_accumulator.EventAccumulator(
        str(run / TENSORBOARD), size_guidance={event_accumulator.IMAGES: 0}
    )
    return run, reader.Reload()


def steps(reader, tag: str) -> list[int]:
    return [event.step for event in reader.Scalars(tag)]


def test_training_curves_at_every_log_step(events):
    _, reader = events
    for tag in ("train/loss", "train/lr", "train/tokens_per_s"):
        assert steps(reader, tag) == [10, 20], tag
    assert all(event.value > 0 for event in reader.Scalars("train/tokens_per_s"))


def test_dev_scores_at_every_validation_and_the_average_at_the_end(events):
    run, reader = events
    for tag in ("dev/loss", "dev/bleu", "dev/chrf"):
        assert steps(reader, tag) == [10, 20], tag
    assert steps(reader, "average/bleu") == [20]
    assert [r["event"] for r in jsonl.read(run / EXAMPLES)] == ["validation"] * 2 + ["average"]


def test_examples_as_text_and_the_first_ones_attention_as_a_picture(events):
    _, reader = events
    tags = reader.Tags()
    (text,) = [t for t in tags["tensors"] if t.startswith("dev/examples")]
    assert [e.step for e in reader.Tensors(text)] == [10, 20]
    table = reader.Tensors(text)[0].tensor_proto.string_val[0].decode("utf-8")
    assert "我是谁" in table
    images = reader.Images("dev/attention")
    assert [image.step for image in images] == [10, 20]
    assert images[0].width > 0 and images[0].height > 0


def test_tensorboard_missing_is_one_line_before_training(corpus, tmp_path):
    """A tensorboard package that cannot be imported, as where it is not installed."""
    shadow = tmp_path / "shadow" / "tensorboard"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('not installed')\n")
    settings = [*overrides(corpus, tensorboard="true"), "train.max_steps=1"]
    command = [sys.executable, "-m", "mtrain", "train", "--config", "configs/tiny.yaml"]
    command += ["--out", str(tmp_path / "run"), *(f"--set={s}" for s in settings)]
    env = {**os.environ, "PYTHONPATH": f"{shadow.parent}{os.pathsep}{REPO}"}
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "mtrain: error: train.tensorboard: true needs the tensorboard package "
        "(pip install 'mtrain[tensorboard]'), or set it to false"
    ]
    assert not (tmp_path / "run").exists()  # refused before the run directory was made
