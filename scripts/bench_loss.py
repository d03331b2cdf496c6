"""The training loss alone: forward and backward of mtrain's label-smoothed cross-entropy
against `F.cross_entropy`'s, on logits of one default batch's shape.

    python scripts/bench_loss.py [--tokens 1400] [--vocab 4000 8000] [--repeats 30]

Prints, for each vocabulary size and dtype, the median milliseconds of one forward + backward
of each and the largest difference of their losses and gradients (they are one loss). A default
batch of 3,000 tokens holds about 1,400 target positions.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from mtrain.data.tokenizer import PAD_ID
from mtrain.training.optim import loss_fn

LABEL_SMOOTHING = 0.1


def reference_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The loss as mtrain computed it up to 2026-12-03: `F.cross_entropy` over fp32 logits."""
    return F.cross_entropy(
        logits.flatten(0, 1).float(),  # (B*T, V)
        target.flatten(),  # (B*T,)
        ignore_index=PAD_ID,
        label_smoothing=LABEL_SMOOTHING,
        reduction="sum",
    )


def ours(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return loss_fn(logits, target, LABEL_SMOOTHING, reduction="sum")


def time_one(fn, logits: torch.Tensor, target: torch.Tensor, repeats: int) -> float:
    """Median milliseconds of fn's forward and backward."""
    times = []
    for _ in range(repeats + 3):  # the first three warm the allocator and kernels
        x = logits.detach().requires_grad_()
        start = time.perf_counter()
        fn(x, target).backward()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times[3:])


def difference(logits: torch.Tensor, target: torch.Tensor) -> tuple[float, float]:
    """The largest absolute differences of the two losses and of their gradients."""
    results = []
    for fn in (reference_loss, ours):
        x = logits.detach().requires_grad_()
        loss = fn(x, target)
        loss.backward()
        results.append((loss.detach(), x.grad.float()))
    (loss_a, grad_a), (loss_b, grad_b) = results
    return (loss_a - loss_b).abs().item(), (grad_a - grad_b).abs().max().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1400, help="target positions per batch")
    parser.add_argument("--vocab", type=int, nargs="+", default=[4000, 8000])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    torch.manual_seed(0)
    batch = 50
    length = args.tokens // batch
    print(f"threads {torch.get_num_threads()}, logits ({batch}, {length}, V), 10% padding")
    print("V\tdtype\tF.cross_entropy ms\tmtrain ms\tloss diff\tgrad diff")
    for vocab in args.vocab:
        target = torch.randint(4, vocab, (batch, length))  # (B, T)
        target[:, -length // 10 :] = PAD_ID
        for dtype in (torch.float32, torch.bfloat16):
            logits = (3 * torch.randn(batch, length, vocab)).to(dtype)  # (B, T, V)
            before = time_one(reference_loss, logits, target, args.repeats)
            after = time_one(ours, logits, target, args.repeats)
            loss_diff, grad_diff = difference(logits, target)
            name = str(dtype).removeprefix("torch.")
            print(f"{vocab}\t{name}\t{before:.1f}\t{after:.1f}\t{loss_diff:.2g}\t{grad_diff:.2g}")


if __name__ == "__main__":
    main()
