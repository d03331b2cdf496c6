"""Weights averaged as training goes: an exponential moving average kept beside the model.

After every update the average moves a step towards the model's weights,
`average += (1 - decay) * (weights - average)`, with the decay ramped up over the first
updates (`min(decay, (1 + t) / (10 + t))`) so that the random initial weights are soon
forgotten. Validations and the checkpoints' `model` use the average; the weights the
optimizer trains are kept beside it for a resume.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class MovingAverage:
    """An exponential moving average of a model's parameters (a tied matrix averaged once)."""

    def __init__(self, model: torch.nn.Module, decay: float):
        self.model, self.decay = model, decay
        # named_parameters() names a shared parameter once; loading a state dict copies into
        # these same tensors, so the list holds for the model's life.
        self.names, params = zip(*model.named_parameters(), strict=True)
        self.params = [p.detach() for p in params]
        self.average = [p.clone() for p in self.params]
        self.updates = 0  # the averaged updates, for the decay's ramp

    def update(self) -> None:
        """Move the average towards the model's weights after one update."""
        self.updates += 1
        decay = min(self.decay, (1 + self.updates) / (10 + self.updates))
        torch._foreach_lerp_(self.average, self.params, 1 - decay)

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """Within this block the model holds the averaged weights; its own come back after."""
        own = [p.clone() for p in self.params]
        torch._foreach_copy_(self.params, self.average)
        try:
            yield
        finally:
            torch._foreach_copy_(self.params, own)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The averaged weights, as the model's state dict holds its own (every name of a tied
        matrix included)."""
        with self.applied():
            return {name: t.clone() for name, t in self.model.state_dict().items()}

    def load_state_dict(self, state: dict[str, torch.Tensor], updates: int) -> None:
        """Continue from averaged weights `state` after `updates` updates."""
        for mine, name in zip(self.average, self.names, strict=True):
            mine.copy_(state[name])
        self.updates = updates
