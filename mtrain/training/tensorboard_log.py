"""TensorBoard event files of a run (`train.tensorboard`), under RUN/tensorboard: the training
and dev curves, each validation's example translations as text and the first example's
cross-attention as a picture.

Written through torch.utils.tensorboard, which needs the tensorboard package (the `tensorboard`
extra); `require` looks for it before training starts.
"""

from __future__ import annotations

from pathlib import Path

from mtrain.core.config import ConfigError, TrainConfig
from mtrain.training.examples import ExampleTranslation
from mtrain.training.validation import Validation

PREFIX = {"validation": "dev", "average": "average"}  # the tags of each kind of validation


def require(cfg: TrainConfig) -> None:
    """Refuse `train.tensorboard: true` where the tensorboard package is missing."""
    if not cfg.tensorboard:
        return
    try:
        import torch.utils.tensorboard  # noqa: F401  (it imports tensorboard)
    except ImportError:
        raise ConfigError(
            "train.tensorboard: true needs the tensorboard package "
            "(pip install 'mtrain[tensorboard]'), or set it to false"
        ) from None


def examples_table(examples: list[ExampleTranslation]) -> str:
    """The examples as a Markdown table, which TensorBoard's text tab draws."""

    def cell(text: str | None) -> str:
        return "" if text is None else text.replace("|", "\\|")

    rows = ["| source | translation | reference |", "|---|---|---|"]
    rows += [
        f"| {cell(e.source)} | {cell(e.translation)} | {cell(e.reference)} |" for e in examples
    ]
    return "\n".join(rows)


class TensorBoardLog:
    """A run's TensorBoard writer, on rank 0."""

    def __init__(self, log_dir: Path, step: int):
        """`step`: where the run starts or resumes; TensorBoard hides the events after it
        that an earlier start wrote, as the JSON-lines logs are cut back to it."""
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(log_dir), purge_step=step + 1 if step else None)

    def train(self, step: int, loss: float, lr: float, tokens_per_s: float) -> None:
        """The training loss (as train.jsonl has it), learning rate and tokens/s at `step`."""
        self.writer.add_scalar("train/loss", loss, step)
        self.writer.add_scalar("train/lr", lr, step)
        self.writer.add_scalar("train/tokens_per_s", tokens_per_s, step)

    def validation(self, event: str, val: Validation) -> None:
        """A validation's scores, its examples as text and the first one's cross-attention
        (the last layer's, mean of its heads) as a picture."""
        from mtrain.figures.attention import cross_attention_image

        prefix, step = PREFIX[event], val.step
        self.writer.add_scalar(f"{prefix}/loss", val.dev_loss, step)
        self.writer.add_scalar(f"{prefix}/bleu", val.dev_bleu, step)
        self.writer.add_scalar(f"{prefix}/chrf", val.dev_chrf, step)
        if val.examples:
            self.writer.add_text(f"{prefix}/examples", examples_table(val.examples), step)
            first = val.examples[0]
            title = f"step {step}: cross-attention, last layer, mean of heads"
            weights = first.attention[-1].mean(dim=0)  # (tgt, src)
            image = cross_attention_image(weights, first.src_pieces, first.tgt_pieces, title)
            self.writer.add_image(f"{prefix}/attention", image, step, dataformats="HWC")
        self.writer.flush()  # a validation is seen as soon as it is logged

    def close(self) -> None:
        self.writer.close()
