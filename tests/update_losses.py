"""The losses of 40 training updates of a small Transformer with dropout, in fp32 and in bf16,
through the trainer's own update step: what a change made for speed must leave as it was.

`python -m tests.update_losses > tests/fixtures/update_losses.json` writes them with the code
checked out; the committed file was written by the code before the speed work it guards
(its "made_by"), and tests/test_update_losses.py holds today's code to it. Write it again only
with a change meant to change the numbers, and say so in the commit.
"""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from mtrain.core.config import ModelConfig, TrainConfig
from mtrain.core.distributed import Group
from mtrain.data.pairs import Batch, Example
from mtrain.data.tokenizer import PAD_ID
from mtrain.model.transformer import Transformer
from mtrain.training.data import Update
from mtrain.training.optim import build_optimizer
from mtrain.training.update_step import LossSettings, UpdateStep

UPDATES = 40
VOCAB = 64
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16}


def batches(n: int, seed: int = 0) -> list[Batch]:
    """`n` batches of 16 random pairs, sources of 3 to 20 tokens, targets of 3 to 16, padded."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        src_len = torch.randint(3, 21, (16,), generator=g)
        tgt_len = torch.randint(3, 17, (16,), generator=g)
        examples = [
            Example(
                src=torch.randint(4, VOCAB, (s,), generator=g).tolist(),
                tgt=torch.randint(4, VOCAB, (t,), generator=g).tolist(),
            )
            for s, t in zip(src_len.tolist(), tgt_len.tolist())
        ]
        out.append(Batch.collate(examples))
    return out


def losses(precision: str, updates: int = UPDATES) -> list[float]:
    """Each update's mean loss per target token: 2 + 2 layers of width 64, dropout 0.1, label
    smoothing 0.1, AdamW at 1e-3 after 10 warmup updates, on the CPU in `precision`."""
    torch.manual_seed(0)
    model_cfg = ModelConfig(
        d_model=64, n_heads=4, n_encoder_layers=2, n_decoder_layers=2, d_ff=128, dropout=0.1
    )
    model = Transformer(model_cfg, VOCAB, VOCAB, max_len=32, pad_id=PAD_ID)
    train_cfg = TrainConfig(lr=1e-3, warmup_steps=10, label_smoothing=0.1, max_minutes=0)
    optimizer, schedule = build_optimizer(model, train_cfg)
    step = UpdateStep(
        net=model,
        model=model,
        optimizer=optimizer,
        scaler=torch.amp.GradScaler(enabled=False),
        schedule=schedule,
        group=Group(),
        device=torch.device("cpu"),
        amp_dtype=PRECISIONS[precision],
        loss=LossSettings.of(train_cfg),
    )
    return [float(step(Update.of([batch]))) for batch in batches(updates)]


def main() -> None:
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    made = {"made_by": commit, **{p: losses(p) for p in PRECISIONS}}
    json.dump(made, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
