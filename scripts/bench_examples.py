"""What watching a run costs: one validation with and without its example translations, and
the TensorBoard writes of a validation and of a log step.

    python scripts/bench_examples.py --run runs/RUN            # a trained run's last.pt
    python scripts/bench_examples.py --config configs/default.yaml [--set k=v ...]

With --run, the model is the run's last checkpoint (read only: nothing in the run directory is
written); with --config, a fresh model in a temporary directory, whose greedy outputs run to
the length limit: the examples' dearest case. Each part is timed --repeats times, after an
untimed call (but for the validation itself, whose first call is as long), and the median
printed: the dev loss and dev BLEU of a validation (`dev_scores`), the examples decoded in one
greedy batch with cross-attention (`translate_examples`), and, if tensorboard is installed, the
TensorBoard record of the validation (scores, the examples' text, the attention picture). Run it
alone on the machine: the figures are wall-clock times.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from mtrain.core import config, runtime
from mtrain.run.directory import CONFIG_FILE
from mtrain.training.build import build_trainer
from mtrain.training.examples import translate_examples
from mtrain.training.validation import Validation, dev_scores


def median_seconds(repeats: int, work, warm_up: bool = True) -> tuple[float, object]:
    """The median wall-clock seconds of `work()` over `repeats` calls, and its last result;
    with `warm_up`, after an untimed call (first-call costs: a font loaded, a weight copied)."""
    times, result = [], None
    if warm_up:
        work()
    for _ in range(repeats):
        start = time.perf_counter()
        result = work()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--run", type=Path, help="a run directory with last.pt")
    source.add_argument("--config", type=Path)
    parser.add_argument("--set", action="append", default=[], help="override, e.g. train.lr=1e-3")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()

    device = runtime.pick_device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        if args.run:
            cfg = config.load(args.run / CONFIG_FILE, args.set)
            trainer = build_trainer(cfg, args.run, device, resume=True)
        else:
            cfg = config.load(args.config, args.set)
            trainer = build_trainer(cfg, Path(tmp), device)
        model, data, amp = trainer.model, trainer.data, trainer.update_step.amp_dtype
        examples = trainer.validator.examples
        validation, (dev_loss, scores) = median_seconds(
            args.repeats, lambda: dev_scores(model, data, cfg, device, amp), warm_up=False
        )
        decoding, translated = median_seconds(
            args.repeats,
            lambda: translate_examples(model, data.tokenizer, cfg, device, examples),
        )
        print(
            f"step {trainer.step}: {len(data.dev_sources)} dev sentences, {len(examples)} examples"
        )
        print(f"validation without examples  {validation:8.3f} s  (dev BLEU {scores.bleu:.2f})")
        print(
            f"the examples' greedy batch   {decoding:8.3f} s  ({100 * decoding / validation:.2f}%)"
        )
        for example in translated:
            print(f"  {example.source} → {example.translation}")
        try:
            from mtrain.training.tensorboard_log import TensorBoardLog

            board = TensorBoardLog(Path(tmp) / "tensorboard", 0)
        except ImportError:
            print("tensorboard is not installed: its writes are not timed")
            return
        val = Validation(trainer.step, 0.0, dev_loss, scores.bleu, scores.chrf, translated)
        writing, _ = median_seconds(args.repeats, lambda: board.validation("validation", val))
        print(f"TensorBoard, a validation    {writing:8.3f} s  ({100 * writing / validation:.2f}%)")
        logging, _ = median_seconds(100, lambda: board.train(10, 2.0, 1e-3, 1000.0))
        print(f"TensorBoard, a log step      {1000 * logging:8.3f} ms (every 10 updates)")
        board.close()


if __name__ == "__main__":
    main()
