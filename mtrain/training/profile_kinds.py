"""Where an update's time goes, by kind of work: a `torch.profiler` trace's operators summed
into matmuls, casts, attention, the loss, LayerNorm, dropout, the optimizer, batch assembly
and the rest (scripts/bench_train.py --profile; docs/benchmarks.md keeps the tables).

Each operator's self time (its own, not its callees') goes to the first kind that names it or,
failing that, its nearest enclosing operator or range: an `aten::copy_` is a cast wherever it
runs (autocast's, attention's fp32 inputs, a dropout mask's), an `aten::mul` inside dropout's
autograd function is dropout's, one inside nothing named is the rest's. The times are the
CPU's: on a GPU they are what launching the kernels costs, not the kernels' own time."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Protocol

import torch
from torch import nn

from mtrain.model.transformer import Dropout

BATCH_ASSEMBLY = "batch assembly"  # the range bench_train.py puts around fetching an update
DROPOUT = "dropout"  # the range `label_dropout` puts around each dropout module's forward
REST = "the rest"

MATMULS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm", "aten::matmul"}
MATMULS |= {"aten::mv", "aten::addmv", "aten::linear", "aten::_addmm_activation"}

# (kind, the exact names that are its, the pieces that make a lower-cased name its), asked in
# this order; an autograd node's name (`AddmmBackward0`, `NativeLayerNormBackward0`) or a
# range's counts as an operator's does.
KINDS = (
    (BATCH_ASSEMBLY, {BATCH_ASSEMBLY}, ()),
    ("matmuls", MATMULS, ("mmbackward",)),
    ("casts", {"aten::copy_", "aten::_to_copy", "aten::to"}, ("tocopybackward",)),
    ("attention", set(), ("scaled_dot_product", "scaleddotproduct")),
    ("loss", set(), ("smoothedcrossentropy", "log_softmax", "logsoftmax", "nll_loss")),
    ("LayerNorm", set(), ("layer_norm", "layernorm")),
    (DROPOUT, set(), ("keepandscale", "dropout")),
    ("optimizer", set(), ("optimizer.", "_foreach_", "adam")),
)


class Event(Protocol):
    """What is read of a profiler event (torch.autograd.profiler_util.FunctionEvent)."""

    name: str
    self_cpu_time_total: float  # microseconds
    cpu_parent: Event | None


def kind_of(event: Event) -> str:
    """The kind the event's self time counts to: its own name's, else its nearest enclosing
    event's that names one, else the rest."""
    node: Event | None = event
    while node is not None:
        name = node.name.lower()
        for kind, names, pieces in KINDS:
            if node.name in names or any(piece in name for piece in pieces):
                return kind
        node = node.cpu_parent
    return REST


def time_by_kind(events: Iterable[Event]) -> dict[str, dict[str, float]]:
    """Self time in microseconds by kind, and within a kind by operator name."""
    kinds: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for event in events:
        kinds[kind_of(event)][event.name] += event.self_cpu_time_total
    return {k: dict(ops) for k, ops in kinds.items()}


def kind_table(events: Iterable[Event], updates: int, wall_s: float) -> str:
    """The time by kind as a table in milliseconds an update, largest first, with each kind's
    largest operators; the wall time the operators leave out (Python, waiting) on its own row."""
    kinds = time_by_kind(events)
    wall_ms = 1000 * wall_s / updates
    rows = [
        (kind, sum(ops.values()) / 1000 / updates, ops)
        for kind, ops in sorted(kinds.items(), key=lambda kv: -sum(kv[1].values()))
    ]
    outside = wall_ms - sum(ms for _, ms, _ in rows)
    lines = [
        f"time by kind, {wall_ms:,.1f} ms an update over {updates} updates "
        "(operators' self time; casts: every dtype conversion, wherever it runs)",
        f"{'kind':<18}{'ms/update':>10}{'share':>8}  largest operators (ms/update)",
    ]
    for kind, ms, ops in rows:
        top = sorted(ops.items(), key=lambda kv: -kv[1])[:3]
        named = ", ".join(f"{name} {us / 1000 / updates:.1f}" for name, us in top)
        lines.append(f"{kind:<18}{ms:>10.1f}{ms / wall_ms:>8.1%}  {named}")
    lines.append(f"{'outside operators':<18}{outside:>10.1f}{outside / wall_ms:>8.1%}")
    return "\n".join(lines)


def label_dropout(model: nn.Module) -> None:
    """Put each Dropout module's forward in a profiler range named "dropout", so that its
    mask's operators (random numbers, a comparison) count to it: for a profile only."""
    for module in model.modules():
        if isinstance(module, Dropout):
            forward = module.forward

            def labelled(*args, _forward=forward, **kwargs):
                with torch.profiler.record_function(DROPOUT):
                    return _forward(*args, **kwargs)

            module.forward = labelled
