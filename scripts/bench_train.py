"""Training speed of a config on this machine: tokens/s, padding, FLOPs, MFU, peak memory.

    python scripts/bench_train.py --config configs/default.yaml [--steps 40] [--set k=v ...]
    python scripts/bench_train.py --config configs/base-gpu.yaml --steps 3 --repeat 8 \
        --set train.compile=true

Runs the real update step (`UpdateStep`, built here without a whole run) on the config's
training data, after a few untimed warm-up steps, and prints:
- source + target non-padding tokens per second, and the padding fraction of the timed batches
  and of a whole epoch's batches;
- model FLOPs per token: the matrix multiplies of forward and backward (3 × forward) for each
  sentence's own lengths, attention scores included, LayerNorm/softmax/loss not counted;
- achieved FLOP/s, and MFU: achieved FLOP/s over the matrix-multiply peak that this script
  measures before and after training (the better of the two), in the precision training
  computes in (fp32, or bf16 under autocast);
- the time the loop waited for each update's batches; with `--set data.src_sampling_alpha=A`,
  the milliseconds (wall and CPU) the batch thread spent sampling each batch's sources;
- peak resident memory of the process (and peak CUDA memory on a GPU);
- with `--profile N`: where N more updates spend their time, by kind (matmuls, casts,
  attention, the loss, LayerNorm, dropout, the optimizer, batch assembly, the rest:
  mtrain/training/profile_kinds.py), then a `torch.profiler` table by operator.

With `--repeat R` the timed window runs the same `--steps` updates R times, after running
them once untimed: with `train.compile`, every shape they hold is compiled before the clock
starts, and few shapes are compiled (each costs a compile of its own); time the eager updates
the same way to compare.

Under `torchrun --nproc_per_node N scripts/bench_train.py ...` every process trains its share
of each update (DDP), and rank 0 prints each rank's tokens/s and their total.
"""

from __future__ import annotations

import argparse
import resource
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

import torch

from mtrain.core import config, distributed, runtime
from mtrain.core.config import Config
from mtrain.data.pairs import Batch
from mtrain.data.tokenizer import PAD_ID
from mtrain.training import compiled
from mtrain.training.data import TrainingData
from mtrain.training.profile_kinds import BATCH_ASSEMBLY, kind_table, label_dropout
from mtrain.training.speed import update_step
from mtrain.training.update_step import UpdateStep


def forward_flops(cfg: Config, vocab: int, src_len: int, tgt_len: int) -> int:
    """Matrix-multiply FLOPs of one sentence pair's forward pass (2 per multiply-add)."""
    d, f, s, t = cfg.model.d_model, cfg.model.d_ff, src_len, tgt_len
    encoder_layer = 2 * s * 4 * d * d + 2 * s * 2 * d * f + 2 * 2 * s * s * d
    decoder_layer = (
        2 * t * 4 * d * d  # self-attention projections
        + 2 * 2 * t * t * d  # self-attention scores and weighted values
        + 2 * t * 2 * d * d  # cross-attention query and output projections
        + 2 * s * 2 * d * d  # cross-attention keys and values from the encoder output
        + 2 * 2 * t * s * d  # cross-attention scores and weighted values
        + 2 * t * 2 * d * f  # feed-forward
    )
    return (
        cfg.model.n_encoder_layers * encoder_layer
        + cfg.model.n_decoder_layers * decoder_layer
        + 2 * t * d * vocab  # output projection
    )


def matmul_peak(shapes: list[tuple[int, int, int]], device: torch.device, dtype, say) -> float:
    """The best FLOP/s of (m×k)·(k×n) multiplies of the given shapes, each timed for ~1 s."""
    best = 0.0
    for m, k, n in shapes:
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        for _ in range(3):
            a @ b
        runs, start = 0, time.perf_counter()
        while time.perf_counter() - start < 1.0:
            for _ in range(10):
                a @ b
            runs += 10
            if device.type == "cuda":
                torch.cuda.synchronize()
        flops = 2 * m * k * n * runs / (time.perf_counter() - start)
        say(f"matmul {m}x{k}x{n} {str(dtype).removeprefix('torch.')}: {flops / 1e9:,.0f} GFLOP/s")
        best = max(best, flops)
    return best


def padding_fraction(batches: Iterable[Batch]) -> float:
    """Share of padding among the source and target positions of padded batches."""
    real = total = 0
    for b in batches:
        real += b.n_tokens
        total += b.src.numel() + b.tgt_out.numel()
    return 1 - real / total


def timed_sampling(data: TrainingData) -> list[tuple[float, float]]:
    """Time each batch's subword sampling where it runs: (wall, CPU) seconds, one a batch."""
    times, resegment = [], data.sampler.resegment

    def timed(*args):
        wall, cpu = time.perf_counter(), time.thread_time()
        out = resegment(*args)
        times.append((time.perf_counter() - wall, time.thread_time() - cpu))
        return out

    data.sampler.resegment = timed
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--set", action="append", default=[], help="override, e.g. train.lr=1e-3")
    parser.add_argument("--steps", type=int, default=40, help="timed optimizer updates")
    parser.add_argument("--warmup", type=int, default=5, help="untimed updates first")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--profile", type=int, default=0, help="profile this many more updates")
    parser.add_argument(
        "--repeat", type=int, default=1, help="time the updates this many times over, warmed"
    )
    parser.add_argument(
        "--compile-backend", default=compiled.BACKEND, help="torch.compile's, with train.compile"
    )
    args = parser.parse_args()

    cfg = config.load(args.config, args.set)
    compiled.BACKEND = args.compile_backend
    group = distributed.from_env()
    device = runtime.pick_device(args.device, group.local_rank)
    distributed.start(group, device, timeout_minutes=10)
    runtime.set_seed(cfg.train.seed)
    runtime.configure(device)
    with tempfile.TemporaryDirectory() as tmp:  # where a run would keep its tokenizer
        data = TrainingData(cfg, Path(tmp), group, resume=False)
    step = update_step(cfg, data, device, group)
    dtype = step.amp_dtype or torch.float32
    say = print if group.is_main else lambda *a: None
    say(
        f"{args.config}: device {device}, {torch.get_num_threads()} threads, computing in {dtype}"
        + (f", {group.world_size} processes (DDP)" if group.active else "")
    )

    tokens = cfg.train.batch_tokens // 2
    d, f = cfg.model.d_model, cfg.model.d_ff
    shapes = [(tokens, d, f), (tokens, f, d), (2048, 2048, 2048)]
    if device.type == "cuda":  # a GPU reaches its peak only on larger products
        shapes.append((8192, 8192, 8192))
    peak = matmul_peak(shapes, device, dtype, say)  # measured again after training: the best

    epoch_padding = data.stream.grid.padding  # of an epoch padded to the shape grid

    sampling = timed_sampling(data) if data.sampler else None
    updates = data.updates(group, cfg.train.accumulate)
    start = time.perf_counter()
    for _ in range(args.warmup):
        step(next(updates))
    warmup_s = time.perf_counter() - start
    timed, waited = [], 0.0
    if sampling:
        sampling.clear()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    if args.repeat > 1:  # the same updates, run once untimed: every shape of theirs warmed
        held = [next(updates) for _ in range(args.steps)]
        start = time.perf_counter()
        for update in held:
            step(update)
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        say(f"shapes warmed: {args.steps} updates in {time.perf_counter() - start:.1f} s")
        repeated = iter(held * args.repeat)
    start = time.perf_counter()
    for _ in range(args.steps * args.repeat):
        asked = time.perf_counter()
        update = next(updates if args.repeat == 1 else repeated)
        waited += time.perf_counter() - asked
        step(update)
        timed += update.batches
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    if step.compiled is not None:
        fast = step.compiled
        say(f"compiled: {len(fast.seen)} shapes, {fast.compiles} graphs, {fast.recompiles} again")

    peak = max(peak, matmul_peak(shapes, device, dtype, say))
    vocab = data.tokenizer.tgt_vocab_size
    n_tokens = sum(b.n_tokens for b in timed)
    flops = 3 * sum(
        forward_flops(cfg, vocab, int(s), int(t))
        for b in timed
        for s, t in zip((b.src != PAD_ID).sum(1), (b.tgt_out != PAD_ID).sum(1))
    )
    per_rank = group.gather(n_tokens / seconds)
    achieved = flops / seconds
    say(f"warm-up: {args.warmup} updates in {warmup_s:.1f} s")
    n_updates = args.steps * args.repeat
    say(f"timed: {n_updates} updates ({len(timed)} batches) in {seconds:.1f} s")
    say(f"updates/s: {n_updates / seconds:.2f}")
    say(f"waiting for the next update's batches: {1000 * waited / n_updates:.1f} ms an update")
    if sampling:
        wall, cpu = (1000 * sum(x) / len(sampling) for x in zip(*sampling))
        say(f"subword sampling, in the batch thread: {wall:.1f} ms a batch ({cpu:.1f} ms CPU)")
    if group.active:
        say("tokens/s per rank: " + ", ".join(f"{t:,.0f}" for t in per_rank))
    say(f"tokens/s (source + target, non-padding): {sum(per_rank):,.0f}")
    say(f"padding fraction: {padding_fraction(timed):.1%} timed, {epoch_padding:.1%} epoch")
    say(f"batch shapes (rows, source, target) a run meets: {len(data.stream.grid.shapes)}")
    say(f"model FLOPs per token (training): {flops / n_tokens / 1e6:.1f} M")
    say(f"achieved{' (rank 0)' if group.active else ''}: {achieved / 1e9:,.1f} GFLOP/s")
    say(f"matmul peak ({str(dtype).removeprefix('torch.')}): {peak / 1e9:,.0f} GFLOP/s")
    say(f"MFU{' (rank 0)' if group.active else ''}: {achieved / peak:.1%}")
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    say(f"peak resident memory{' (rank 0)' if group.active else ''}: {rss_mb:,.0f} MB")
    if device.type == "cuda":
        say(f"peak CUDA memory: {torch.cuda.max_memory_allocated() / 2**20:,.0f} MB")
    if args.profile and group.is_main:
        say(profile(step, updates, args.profile))
    distributed.stop(group)


def profile(step: UpdateStep, updates, n: int, rows: int = 30) -> str:
    """Where `n` updates spend their time: by kind, then by operator, slowest first."""
    from torch.profiler import ProfilerActivity, record_function

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    label_dropout(step.model)
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(n):
            with record_function(BATCH_ASSEMBLY):
                update = next(updates)
            step(update)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall_s = time.perf_counter() - start
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)
    return (
        f"{kind_table(prof.events(), n, wall_s)}\n\n"
        f"profile of {n} updates (self: an operator's own time, not its callees')\n{table}"
    )


if __name__ == "__main__":
    main()
