"""Validation: the teacher-forced dev loss and the greedy dev BLEU and chrF of a model."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from mtrain import runtime
from mtrain.config import Config
from mtrain.data import example_batches
from mtrain.evaluate import Scores, score
from mtrain.model import Transformer
from mtrain.optim import loss_fn
from mtrain.training_data import TrainingData
from mtrain.translator import Translator


@dataclass
class Validation:
    """One validation, as metrics.jsonl records it."""

    step: int
    minutes: float
    dev_loss: float
    dev_bleu: float
    dev_chrf: float


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
