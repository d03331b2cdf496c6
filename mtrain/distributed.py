"""The processes that train one model together under `torchrun`, and what they exchange.

One process per device: `torchrun` sets RANK, WORLD_SIZE and LOCAL_RANK, and the processes meet
through `torch.distributed` (NCCL between GPUs, gloo between CPUs). A plain `mtrain train` is a
group of one, whose exchanges are no-ops.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


class DistributedError(RuntimeError):
    """A process of the group died, hung or disagreed; the message says which."""


@dataclass(frozen=True)
class Group:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0  # the process's device on its machine

    @property
    def is_main(self) -> bool:
        """Rank 0 alone validates, logs and writes the run directory."""
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world_size > 1

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        if not self.active:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order, on every rank."""
        if not self.active:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        """The sum of `value` over the ranks."""
        if self.active:
            dist.all_reduce(value)
        return value


def from_env() -> Group:
    """The group `torchrun` started this process in (a group of one without it)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return Group()
    return Group(int(os.environ["RANK"]), world_size, int(os.environ.get("LOCAL_RANK", "0")))


def start(group: Group, device: torch.device, timeout_minutes: float) -> None:
    """Join the group's process group; a collective that waits longer than the timeout fails."""
    if not group.active:
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":  # NCCL exchanges objects through the current device
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        rank=group.rank,
        world_size=group.world_size,
        timeout=timedelta(minutes=timeout_minutes),
        device_id=device if device.type == "cuda" else None,
    )


def stop(group: Group) -> None:
    if group.active and dist.is_initialized():
        dist.destroy_process_group()
