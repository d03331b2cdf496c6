"""A recipe that follows the budget: what a run takes from its planned number of updates.

At the 2,662 updates a 2-core CPU without bf16 makes in 29 minutes, dropout 0.1 learned more
than 0.2 (two seeds); at 2,925 and 4,700 bf16 updates 0.2 learned more (docs/recipes.md). So
a run whose end is planned short of `train.short_run_updates` trains with
`train.short_run_dropout` instead of `model.dropout`. The choice is made once, when the end is
first planned (at once under `train.max_steps`, after warmup under a time budget, where the
measured speed plans it), and holds for the rest of the run, resumes included: the checkpoints
keep it, and the run's config.yaml records it in its `chosen` section for people to read. A run
begun before runs chose (its checkpoints have no `chosen` entry) never chooses: resumed by this
mtrain, it keeps model.dropout, as it would have uninterrupted.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mtrain.core.config import Config
from mtrain.model.transformer import Transformer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Choice:
    """What a run chose from its plan."""

    planned_updates: int | None  # the run's planned end when it chose; None: it never chose
    dropout: float

    @classmethod
    def of(cls, cfg: Config, planned_updates: int) -> Choice:
        """The choice a run of `cfg` makes when its end is first planned at `planned_updates`."""
        short = planned_updates < cfg.train.short_run_updates
        return cls(planned_updates, cfg.train.short_run_dropout if short else cfg.model.dropout)

    @classmethod
    def kept(cls, dropout: float) -> Choice:
        """The choice of a run begun before runs chose from their plan: its model.dropout."""
        return cls(None, dropout)

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> Choice:
        planned = record["planned_updates"]
        return cls(None if planned is None else int(planned), float(record["dropout"]))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def describe(self, cfg: Config) -> str:
        """The choice in words, for the log."""
        limit = cfg.train.short_run_updates
        if self.planned_updates is None:
            return f"begun before runs chose from their plan: dropout {self.dropout:g} throughout"
        if self.dropout == cfg.model.dropout:
            if self.planned_updates < limit:
                return f"planned {self.planned_updates} updates: dropout {self.dropout:g}"
            return (
                f"planned {self.planned_updates} updates, at least train.short_run_updates "
                f"({limit}): dropout {self.dropout:g} (model.dropout)"
            )
        return (
            f"planned {self.planned_updates} updates, fewer than train.short_run_updates "
            f"({limit}): dropout {self.dropout:g} (train.short_run_dropout) instead of "
            f"{cfg.model.dropout:g} (model.dropout)"
        )


class BudgetRecipe:
    """Makes a run's choice once its end is first planned: sets the model's dropout, says so,
    and hands the choice to `record` (rank 0 writes it into the run's config.yaml)."""

    def __init__(
        self,
        cfg: Config,
        model: Transformer,
        record: Callable[[Choice], None] | None = None,
    ):
        self.cfg, self.model, self.record = cfg, model, record

    def keep(self, choice: Choice | None) -> None:
        """Train on as a resumed run chose (None: it had not chosen yet)."""
        if choice:
            self.model.set_dropout(choice.dropout)

    def choose(self, planned_updates: int | None) -> Choice | None:
        """The choice for a run whose end is now planned at `planned_updates`; None while it is
        not planned or the config plans no choice. Every rank plans alike, so chooses alike."""
        if planned_updates is None or not self.cfg.train.short_run_updates:
            return None
        choice = Choice.of(self.cfg, planned_updates)
        self.model.set_dropout(choice.dropout)
        if self.record:
            log.info("%s", choice.describe(self.cfg))
            self.record(choice)
        return choice
