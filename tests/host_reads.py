"""Counting the reads of the device: on CUDA each waits for every queued kernel, which starves
the GPU. On the CPU nothing queues, so the reads are counted themselves: the aten ops that read a
value (seen by a dispatch mode) and the Python methods that copy to the host (patched)."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

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


def count_copies(reads: HostReads, monkeypatch: pytest.MonkeyPatch) -> None:
    """Have `reads` count the Tensor methods that copy to the host, too."""
    for name in COPIES:
        real = getattr(torch.Tensor, name)

        def copy(self, *args, _real=real, _name=name, **kwargs):
            reads.note(_name)
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, copy)
