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

from mtrain.core.errors import MtrainError

# Start-up (preparing the corpora, which trains the tokenizer; loading a checkpoint) can keep
# rank 0 busy far longer than any exchange of training while the others wait for what it sends:
# its exchanges go through a group of their own, with this bound instead of the peer timeout. A
# process that exits closes its connections, so the others learn of it at once even so.
STARTUP_TIMEOUT = timedelta(days=1)
_startup_group: dist.ProcessGroup | None = None  # gloo over the CPU, with STARTUP_TIMEOUT


class DistributedError(MtrainError, RuntimeError):
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

    def broadcast(self, obj: Any, startup: bool = False) -> Any:
        """Rank 0's `obj` on every rank; `startup`: sent at start-up, where the others may wait
        for it up to STARTUP_TIMEOUT rather than the peer timeout."""
        if not self.active:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=_startup_group if startup else None)
        return box[0]

    def end_startup(self) -> None:
        """Wait until every rank has started up (up to STARTUP_TIMEOUT): from here on, an
        exchange that waits longer than the peer timeout fails."""
        if self.active:
            dist.barrier(group=_startup_group)

    def gather(self, obj: Any, startup: bool = False) -> list[Any]:
        """Every rank's `obj`, in rank order, on every rank; `startup` as for `broadcast`."""
        if not self.active:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=_startup_group if startup else None)
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
    """Join the group's process group; once start-up is over (`Group.end_startup`), an
    exchange that waits longer than `timeout_minutes` fails."""
    global _startup_group
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
    _startup_group = dist.new_group(backend="gloo", timeout=STARTUP_TIMEOUT)


def stop(group: Group) -> None:
    global _startup_group
    if group.active and dist.is_initialized():
        dist.destroy_process_group()  # and the start-up group with it
    _startup_group = None


def is_peer_loss(error: BaseException) -> bool:
    """Whether `error` says that another process died, hung or could not be reached, rather
    than that this one failed: a lost peer is worth one line, a bug its traceback."""
    if isinstance(error, dist.DistError):  # NCCL's, the rendezvous store's and the network's
        return True
    # gloo raises plain RuntimeErrors, each naming its source file under gloo/ ("Connection
    # closed by peer", "Timed out waiting 300000ms for recv operation to complete").
    return isinstance(error, RuntimeError) and "gloo" in str(error)
