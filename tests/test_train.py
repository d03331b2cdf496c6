import fcntl
import itertools
import json
import os
import pty
import re
import signal
import struct
import subprocess
import sys
import termios

import numpy as np
import pytest
import torch

from mtrain.commands.info import echo_training
from mtrain.core import config, jsonl
from mtrain.data.pairs import Batch
from mtrain.data.tokenizer import PAD_ID
from mtrain.run.directory import AVERAGED, load_checkpoint, step_checkpoints, training_summary
from mtrain.training import update_step
from mtrain.training.build import build_trainer
from mtrain.training.trainer import Interrupted, Trainer, Update, Validation
from mtrain.training.validation import Validator

from .synthetic import REPO, overrides, small_config

ENV = {**os.environ, "PYTHONPATH": str(REPO)}

CPU = torch.device("cpu")


def scripted(bleus) -> type[Validator]:
    """A validator for `build_trainer(make_validator=...)` whose dev BLEUs are `bleus`, in turn."""
    bleus = iter(bleus)

    class Scripted(Validator):
        def __call__(self, step: int) -> Validation:
            return Validation(step, self.minutes(), 1.0, next(bleus), 1.0)

    return Scripted


def test_accumulated_batches_give_the_gradient_of_one_big_batch(corpus, tmp_path):
    def trainer(name: str, accumulate: int) -> Trainer:
        # fp32: bf16 autocast rounds each product to bf16, whose sum over one big batch's
        # tokens differs from the sum of three smaller ones by more than the tolerance below
        settings = [*overrides(corpus, accumulate=accumulate, precision="fp32"), "model.dropout=0"]
        cfg = config.load(REPO / "configs" / "tiny.yaml", settings)
        (tmp_path / name).mkdir()
        return build_trainer(cfg, tmp_path / name, CPU)

    accumulating, whole = trainer("accumulate", 3), trainer("whole", 1)
    update = next(accumulating.data.updates(accumulating.group, 3))
    assert len(update.batches) == 3
    indices = np.array(_indices(accumulating, update.batches))
    loss_parts = accumulating.update_step(update)
    loss_whole = whole.update_step(Update.of([whole.data.corpus.collate(indices)]))
    assert float(loss_parts) == pytest.approx(float(loss_whole), rel=1e-5)
    for (name, a), b in zip(accumulating.model.named_parameters(), whole.model.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=name)


def _indices(trainer: Trainer, batches: list[Batch]) -> list[int]:
    """The indices of the training pairs in `batches`, found by their source and target ids."""

    def pairs(batch: Batch) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        return [
            (tuple(t for t in src if t != PAD_ID), tuple(t for t in tgt if t != PAD_ID))
            for src, tgt in zip(batch.src.tolist(), batch.tgt_out.tolist())
        ]

    every = pairs(trainer.data.corpus.collate(np.arange(len(trainer.data.corpus))))
    position = {pair: i for i, pair in enumerate(every)}
    return [position[pair] for batch in batches for pair in pairs(batch)]


def test_early_stopping_after_patience_validations_without_progress(corpus, tmp_path):
    cfg = small_config(corpus, max_steps=100, eval_every=5, patience=2)
    # Dev BLEU 5.0 at every validation: the first is the best, the next two are not better.
    trainer = build_trainer(cfg, tmp_path, CPU, make_validator=scripted(itertools.repeat(5.0)))
    trainer.run()
    assert trainer.step == 15


@pytest.mark.parametrize("average_bleu, average_is_best", [(4.0, True), (0.5, False)])
def test_training_ends_by_averaging_the_last_checkpoints(
    corpus, tmp_path, average_bleu, average_is_best
):
    cfg = small_config(corpus, max_steps=15, eval_every=5, keep_last=3, average_last=3)
    scores = [1.0, 2.0, 3.0, average_bleu]  # steps 5, 10, 15, then the average
    trainer = build_trainer(cfg, tmp_path, CPU, make_validator=scripted(scores))
    trainer.run()

    averaged = load_checkpoint(tmp_path / AVERAGED)
    assert averaged["steps"] == [5, 10, 15]
    steps = [load_checkpoint(p)["model"] for p in step_checkpoints(tmp_path)]
    for name, tensor in averaged["model"].items():
        torch.testing.assert_close(tensor, sum(s[name] for s in steps) / 3)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["event"] for r in records] == ["validation"] * 3 + ["average"]
    assert records[-1]["best"] == average_is_best

    best = load_checkpoint(tmp_path / "best.pt")["model"]
    best_source = averaged["model"] if average_is_best else steps[-1]
    assert all(torch.equal(best[k], v) for k, v in best_source.items())
    # A resumed run compares new validations with the best score, the average's included.
    assert load_checkpoint(tmp_path / "last.pt")["best_bleu"] == max(3.0, average_bleu)


@pytest.mark.parametrize("stop", ["signal", "budget"])
def test_a_run_of_skipped_updates_still_heeds_ctrl_c_and_the_time_budget(
    corpus, tmp_path, monkeypatch, stop
):
    # From step 3 on every loss is NaN, so every update is skipped; the 5th skipped update
    # brings Ctrl-C, or the end of the time budget (after a validation at step 3).
    eval_every = 3 if stop == "budget" else 100
    cfg = small_config(
        corpus, max_steps=100, eval_every=eval_every, max_minutes=60, skip_nonfinite="true"
    )
    seconds = [0.0]  # the run's clock
    trainer = build_trainer(cfg, tmp_path, CPU, clock=lambda: seconds[0])
    real_loss = update_step.loss_fn

    def poisoned(logits, tgt_out, smoothing, reduction="mean"):
        loss = real_loss(logits, tgt_out, smoothing, reduction)
        if trainer.step < 3:
            return loss
        assert trainer.skipped < 20, "skipped updates went on after the stop"
        if trainer.skipped == 4 and stop == "signal":
            signal.raise_signal(signal.SIGINT)
        if trainer.skipped == 4 and stop == "budget":
            seconds[0] = 61.0 * 60
        return loss * float("nan")

    monkeypatch.setattr(update_step, "loss_fn", poisoned)
    if stop == "signal":
        with pytest.raises(Interrupted, match="interrupted at step 3"):
            trainer.run()
    else:
        trainer.run()
    assert trainer.step == 3 and trainer.skipped == 5
    saved = load_checkpoint(tmp_path / "last.pt")
    assert saved["step"] == 3 and saved["skipped"] == 5
    # The budget ended the run after a validation of this very step: none again.
    records = jsonl.read(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == ([3] if stop == "budget" else [])


def test_patience_does_not_end_a_linear_schedule_before_its_planned_end(
    corpus, tmp_path, caplog, capsys
):
    # Dev BLEU never improves after the first validation: patience 1 would stop at step 10.
    keys = {"max_steps": 20, "eval_every": 5, "warmup_steps": 2, "patience": 1}
    cfg = small_config(corpus, lr_schedule="linear", **keys)
    with caplog.at_level("INFO"):
        trainer = build_trainer(cfg, tmp_path, CPU, make_validator=scripted(itertools.repeat(5.0)))
        trainer.run()
    assert trainer.step == 20
    assert caplog.text.count("train.patience is not used under train.lr_schedule: linear") == 1
    assert "finished at step 20: train.max_steps is 20; learning rate 0.00e+00 (0% of its" in (
        caplog.text
    )
    finished = load_checkpoint(tmp_path / "last.pt")["finished"]
    assert finished["limit"] == "max_steps" and finished["lr"] == 0.0
    # `mtrain info` shows it.
    echo_training(training_summary(tmp_path), cfg.train.lr)
    assert "finished: train.max_steps is 20; learning rate then 0.00e+00 (0% of its peak)" in (
        capsys.readouterr().out
    )


def test_patience_still_ends_an_inverse_sqrt_schedule(corpus, tmp_path):
    keys = {"max_steps": 20, "eval_every": 5, "warmup_steps": 2, "patience": 1}
    cfg = small_config(corpus, lr_schedule="inverse_sqrt", **keys)
    trainer = build_trainer(cfg, tmp_path, CPU, make_validator=scripted(itertools.repeat(5.0)))
    trainer.run()
    assert trainer.step == 10
    assert load_checkpoint(tmp_path / "last.pt")["finished"]["limit"] == "patience"


def train_command(corpus, out) -> list[str]:
    """`mtrain train` of the tiny config for 20 steps on the synthetic corpus."""
    command = [sys.executable, "-m", "mtrain", "train", "--config", "configs/tiny.yaml"]
    settings = overrides(corpus, max_steps=20, eval_every=10)
    return [*command, "--out", str(out), *(f"--set={s}" for s in settings)]


def test_progress_is_plain_lines_where_stderr_is_a_file(corpus, tmp_path):
    """`mtrain train 2> FILE` keeps lines a script can read, not the bar's redrawn frames."""
    log_file = tmp_path / "train.log"
    with log_file.open("w") as stderr:
        done = subprocess.run(
            train_command(corpus, tmp_path / "run"), cwd=REPO, env=ENV, stderr=stderr
        )
    text = log_file.read_text("utf-8")
    assert done.returncode == 0, text
    assert "\r" not in text and "train:" not in text
    lines = text.splitlines()
    progress = [line for line in lines if line.startswith("step 10/20  ")]
    assert len(progress) == 1, text  # the first record's line; step 20 is within PLAIN_EVERY
    assert re.fullmatch(r"step 10/20  loss \S+  lr \S+  tok_s \d+", progress[0]), progress
    assert any(re.match(r"step 10  .* dev BLEU", line) for line in lines), text  # validation
    assert any(line.startswith("  我是谁 → ") for line in lines), text  # its example


def test_progress_is_a_bar_on_a_terminal(corpus, tmp_path):
    main, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # 100 columns
    proc = subprocess.Popen(
        train_command(corpus, tmp_path / "run"), cwd=REPO, env=ENV, stderr=child
    )
    os.close(child)
    output = b""
    while True:
        try:
            chunk = os.read(main, 65536)
        except OSError:  # the terminal closes with the process
            break
        if not chunk:
            break
        output += chunk
    os.close(main)
    assert proc.wait() == 0, output
    text = output.decode("utf-8", "replace")
    assert re.search(r"\rtrain: +\d+%", text)  # tqdm's frames
    assert not re.search(r"^step 10/20  loss", text, re.MULTILINE)
    assert re.search(r"step 10  .* dev BLEU", text)
