"""Training never waits for the device between its log steps: no update reads a tensor back,
and a log step reads once.

On CUDA a read (`.item()`, `float(t)`, `bool(t)`, `.tolist()`, `.cpu()`, an op whose output
size depends on the data) waits for every queued kernel, which starves the GPU; host_reads.py
counts them on the CPU.
"""

from __future__ import annotations

import pytest
import torch

from mtrain.training.build import build_trainer
from mtrain.training.run_log import LOG_EVERY
from mtrain.training.trainer import Trainer

from .host_reads import HostReads, count_copies
from .synthetic import small_config


def counted_run(trainer: Trainer, monkeypatch) -> HostReads:
    """Run `trainer`, counting host reads by step, the data's own work (on host tensors,
    before any copy to the device) left out."""
    reads = HostReads()
    count_copies(reads, monkeypatch)
    step, updates = trainer.update_step, trainer.data.updates

    def update_step(update):
        reads.step = step.step + 1  # the update being made, and what follows it
        return real_call(update)

    real_call = step.__call__
    monkeypatch.setattr(trainer, "update_step", step)
    monkeypatch.setattr(type(step), "__call__", lambda self, update: update_step(update))

    def quiet(*args):
        made = updates(*args)
        try:
            while True:
                reads.on = False
                try:
                    update = next(made)
                except StopIteration:
                    return
                finally:
                    reads.on = True
                yield update
        finally:
            made.close()

    monkeypatch.setattr(trainer.data, "updates", quiet)
    with reads:
        trainer.run()
    return reads


@pytest.mark.parametrize("skip_nonfinite", [False, True])
def test_updates_between_log_steps_do_not_read_the_device(
    corpus, tmp_path, monkeypatch, skip_nonfinite
):
    eval_every = 2 * LOG_EVERY
    cfg = small_config(
        corpus, max_steps=2 * eval_every + 3, eval_every=eval_every, skip_nonfinite=skip_nonfinite
    )
    trainer = build_trainer(cfg, tmp_path, torch.device("cpu"))
    reads = counted_run(trainer, monkeypatch)
    assert trainer.step == cfg.train.max_steps
    quiet = [s for s in range(1, trainer.step) if s % LOG_EVERY and s % eval_every]
    # With train.skip_nonfinite each update reads its loss once, to decide before stepping.
    per_update = 1 if skip_nonfinite else 0
    for s in quiet:
        assert reads.by_step[s] == per_update, (s, reads.what[s])
    # A log step reads once more: the losses logged and the non-finite check, together.
    logged = [s for s in range(1, trainer.step) if s % LOG_EVERY == 0 and s % eval_every]
    assert logged == [LOG_EVERY, 3 * LOG_EVERY]
    for s in logged:
        assert reads.by_step[s] == per_update + 1, (s, reads.what[s])
