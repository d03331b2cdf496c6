"""Validation: the teacher-forced dev loss and the greedy dev BLEU and chrF of a model, its
example translations, and the scoreboard of a run's validations (best dev BLEU, patience)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from mtrain.core import runtime
from mtrain.core.config import Config
from mtrain.core.metrics import Scores, score
from mtrain.data.batching import example_batches
from mtrain.decoding.translator import Translator
from mtrain.model.transformer import Transformer
from mtrain.training.data import TrainingData
from mtrain.training.examples import ExampleTranslation, choose, translate_examples
from mtrain.training.optim import loss_fn


@dataclass
class Validation:
    """One validation: its scores, as metrics.jsonl records them, and its example translations."""

    step: int
    minutes: float
    dev_loss: float
    dev_bleu: float
    dev_chrf: float
    examples: list[ExampleTranslation] = field(default_factory=list, repr=False)

    def scores(self) -> dict[str, Any]:
        """The record's fields of metrics.jsonl: all but the examples."""
        return {k: v for k, v in vars(self).items() if k != "examples"}


@torch.no_grad()
def dev_scores(
    model: Transformer,
    data: TrainingData,
    cfg: Config,
    device: torch.device,
    amp_dtype: torch.dtype | None,
) -> tuple[float, Scores]:
    """The dev loss per target token (teacher-forced, without label smoothing), and the BLEU
    and chrF of greedy translations of the dev sources against all their references."""
    model.eval()
    total, tokens = 0.0, 0
    for batch in example_batches(data.dev_examples, cfg.train.batch_tokens):
        batch = batch.to(device)
        with runtime.autocast(device, amp_dtype):
            logits = model(batch.src, batch.tgt_in)  # (B, T, V)
        total += loss_fn(logits, batch.tgt_out, 0.0, "sum").item()
        tokens += batch.n_target_tokens
    greedy = dataclasses.replace(cfg.decode, beam_size=1)
    # TrainingData warned of the dev sources truncated when it read them: not again here.
    translator = Translator(model, data.tokenizer, cfg, device, greedy, warn_truncated=False)
    hyps = translator.translate(data.dev_sources)
    return total / tokens, score(hyps, data.dev_refs, cfg.data.tgt_lang)


class Validator:
    """Validates a model as it is now: its dev loss, BLEU and chrF (`dev_scores`), and its
    translations of the run's examples."""

    def __init__(
        self,
        model: Transformer,
        data: TrainingData,
        cfg: Config,
        device: torch.device,
        amp_dtype: torch.dtype | None,
        minutes: Callable[[], float],
    ):
        """`minutes`: the run's clock, minutes of training so far."""
        self.model, self.data, self.cfg = model, data, cfg
        self.device, self.amp_dtype, self.minutes = device, amp_dtype, minutes
        self.examples = choose(cfg, data.tokenizer, data.dev_sources, data.dev_refs)

    def __call__(self, step: int) -> Validation:
        """Dev loss, BLEU and chrF of the model as it is now, at update `step`, and its
        translations of the examples."""
        dev_loss, scores = dev_scores(self.model, self.data, self.cfg, self.device, self.amp_dtype)
        model, tokenizer = self.model, self.data.tokenizer
        examples = translate_examples(model, tokenizer, self.cfg, self.device, self.examples)
        return Validation(step, self.minutes(), dev_loss, scores.bleu, scores.chrf, examples)


class Scoreboard:
    """The best dev BLEU of a run and the validations since it last improved; `patience` of
    them without a better one (0: never) end the run."""

    def __init__(self, patience: int):
        self.patience = patience
        self.best_bleu = -1.0
        self.stale = 0  # validations since dev BLEU last improved

    def record(self, bleu: float) -> bool:
        """Count a validation's dev BLEU; whether it is the best so far."""
        improved = bleu > self.best_bleu
        self.best_bleu = max(self.best_bleu, bleu)
        self.stale = 0 if improved else self.stale + 1
        return improved

    def record_average(self, bleu: float) -> bool:
        """Count the averaged model's dev BLEU, which ends the run: no patience is spent."""
        improved = bleu > self.best_bleu
        self.best_bleu = max(self.best_bleu, bleu)
        return improved

    @property
    def exhausted(self) -> bool:
        """Whether `patience` validations in a row found no better dev BLEU."""
        return bool(self.patience) and self.stale >= self.patience

    def state_dict(self) -> dict[str, Any]:
        return {"best_bleu": self.best_bleu, "stale": self.stale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best_bleu, self.stale = state["best_bleu"], state["stale"]
