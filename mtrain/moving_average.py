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
    """An exponential moving average of a model's floating-point parameters and buffers."""

    def __init__(self, model: torch.nn.Module, decay: float):
        self.model, self.decay = model, decay
        self.names = [name for name, t in model.state_dict().items() if t.is_floating_point()]
        self.average = [t.detach().clone() for t in self._tensors()]
        self.updates = 0  # the averaged updates, for the decay's ramp

    def _tensors(self) -> list[torch.Tensor]:
        state = self.model.state_dict(keep_vars=True)
        return [state[name].detach() for name in self.names]

    def update(self) -> None:
        """Move the average towards the model's weights after one update."""
        self.updates += 1
        decay = min(self.decay, (1 + self.updates) / (10 + self.updates))
        torch._foreach_lerp_(self.average, self._tensors(), 1 - decay)

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """Within this block the model holds the averaged weights; its own come back after."""
        own = [t.clone() for t in self._tensors()]
        torch._foreach_copy_(self._tensors(), self.average)
        try:
            yield
        finally:
            torch._foreach_copy_(self._tensors(), own)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The averaged weights, as the model's state dict holds its own."""
        state = self.model.state_dict()
        return {**state, **dict(zip(self.names, self.average, strict=True))}

    def load_state_dict(self, state: dict[str, torch.Tensor], updates: int) -> None:
        """Continue from averaged weights `state` after `updates` updates."""
        for mine, name in zip(self.average, self.names, strict=True):
            mine.copy_(state[name])
        self.updates = updates
