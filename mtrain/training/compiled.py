"""The fixed-shape fast path of `train.compile`: a batch's forward and loss compiled by
`torch.compile` once for each batch shape.

Training batches come in the few shapes of the shape grid (`data.batching`), so each shape is
compiled once, without dynamic shapes, and reused from then on. torch.compile rather than CUDA
graphs: it fuses the elementwise work between the matrix multiplies (LayerNorm, dropout,
residuals, the loss) on the GPU and the CPU alike, keeps autograd and autocast as they are,
and needs no static buffers; CUDA graphs would only remove launch overhead, and on CUDA only.
A compile beyond the grid's shapes (a shape seen before compiled again, or more shapes than
the grid has) is counted and logged: it costs the time of a first compile every time.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)
BACKEND = "inductor"  # torch.compile's code generator (tests may pick a quicker one)
COMPILE_KEYS = ("recompile_limit", "cache_size_limit")  # dynamo's limit, newer name first


def compiles_on(setting: str | bool, device: torch.device) -> bool:
    """Whether `train.compile` compiles on `device`; `auto` keeps the eager path everywhere:
    on the CPU it measured slower, and on CUDA it is not measured yet (docs/benchmarks.md)."""
    return setting is True


class Compiled:
    """`loss(src, tgt_in, tgt_out)` compiled per batch shape; counts compiles by shape."""

    def __init__(self, loss: Callable[..., torch.Tensor], shapes: int):
        """`loss` computes a batch's loss from its tensors; `shapes`: the grid's shape count."""
        self.shapes = shapes
        self.compiles = 0  # graphs compiled, a shape's pieces apart where the graph breaks
        self.recompiles = 0  # compiles of a shape compiled before
        self.seen: set[tuple[torch.Size, ...]] = set()
        self.warned = False
        for key in COMPILE_KEYS:  # every shape its own compiled graph, the grid's all kept
            if hasattr(torch._dynamo.config, key):
                setattr(torch._dynamo.config, key, max(getattr(torch._dynamo.config, key), shapes))
                break
        self.compiled = torch.compile(loss, dynamic=False, backend=self.backend)

    def backend(self, graph: torch.fx.GraphModule, inputs: list) -> Callable:
        """torch.compile's backend, counting what it compiles."""
        self.compiles += 1
        return torch._dynamo.lookup_backend(BACKEND)(graph, inputs)

    def __call__(self, *tensors: torch.Tensor) -> torch.Tensor:
        shape = tuple(t.shape for t in tensors)
        before = self.compiles
        loss = self.compiled(*tensors)
        if shape in self.seen and self.compiles > before:
            self.recompiles += 1
        self.seen.add(shape)
        if not self.warned and len(self.seen) + self.recompiles > self.shapes:
            self.warned = True
            log.warning(
                "train.compile: %d shapes compiled and %d recompiled, beyond the %d shapes of "
                "the batch grid: each costs a compile (set train.compile: false if it goes on)",
                len(self.seen),
                self.recompiles,
                self.shapes,
            )
        return loss
