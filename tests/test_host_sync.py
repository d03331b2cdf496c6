"""Training never waits for the device between its log steps: no update reads a tensor back,
and a log step reads once.

On CUDA a read (`.item()`, `float(t)`, `bool(t)`, `.tolist()`, `.cpu()`, an op whose output
size depends on the data) waits for every queued kernel, which starves the GPU. On the CPU
nothing queues, so these tests count the reads themselves: the aten ops that read a value
(seen by a dispatch mode) and the Python methods that copy to the host (patched).
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mtrain.training.build import build_trainer
from mtrain.training.run_log import LOG_EVERY
from mtrain.training.trainer import Trainer

from .synthetic import small_config

aten = torch.ops.aten
# aten ops that need a value on the host: on CUDA each waits for the device
READS = {
    aten._local_scalar_dense.default,  # .item(), float(t), int(t), bool(t)
    aten.is_nonzero.default,
    aten.equal.default,
    aten.nonzero.default,
    aten.masked_select.default,
    aten._unique2.default,
    aten.unique_consecutive.default,
    aten.repeat_interleave.Tensor,
}
COPIES = ("tolist", "cpu", "numpy")  # Tensor methods that copy to the host


class HostReads(TorchDispatchMode):
    """Counts host reads by the step they happen after, while `on`."""

    def __init__(self):
        super().__init__()
        self.on, self.step = True, 0
        self.by_step: collections.Counter[int] = collections.Counter()
        self.what: dict[int, list[str]] = collections.defaultdict(list)

    def note(self, name: str) -> None:
        if self.on:
            self.by_step[self.step] += 1
            self.what[self.step].append(name)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        boolean_index = func is aten.index.Tensor and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]
        )
        if func in READS or boolean_index:
            self.note(str(func))
        return func(*args, **(kwargs or {}))


def counted_run(trainer: Trainer, monkeypatch) -> HostReads:
    """Run `trainer`, counting host reads by step, the data's own work (on host tensors,
    before any copy to the device) left out."""
    reads = HostReads()
    for name in COPIES:
        real = getattr(torch.Tensor, name)

        def copy(self, *args, _real=real, _name=name, **kwargs):
            reads.note(_name)
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, copy)
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
