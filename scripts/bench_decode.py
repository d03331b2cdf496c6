"""Decoding speed on the shipped test split: sentences/s and target tokens/s per search mode.

    python scripts/bench_decode.py --run runs/NAME [--sentences 2000] [--bleu]
    python scripts/bench_decode.py --long-outputs 20 (--run runs/NAME | --random-model CONFIG)
    python scripts/bench_decode.py --run runs/NAME --ctranslate2 [--threads N]

Modes: greedy without the key/value cache and with it, at batch 1 and at the configured batch;
beam search with the run's beam size and length penalty; greedy with dynamic int8
quantization. Prints one line per mode (and BLEU with --bleu).

With --long-outputs N, instead: N random sources decoded one at a time (batch 1), greedy
without and with the cache, each output forced to a length drawn from 40-64 pieces (the model's
</s> is disabled), on a run's model or a randomly initialised one of a config: where the cache
pays, since recomputation re-reads the whole prefix at every step.
With --ctranslate2, instead: mtrain and CTranslate2 side by side on the run exported to a
temporary directory (needs `pip install ctranslate2`), greedy, beam 4 and int8 greedy, at the
configured batch and the same thread count: a Markdown table of sentences/s, BLEU and how many
outputs are the same as mtrain's.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

from mtrain.core import config, runtime
from mtrain.core.metrics import score
from mtrain.data.pairs import group_references, read_parallel
from mtrain.data.tokenizer import EOS_ID, PAD_ID
from mtrain.decoding.search import OutputLayer, greedy
from mtrain.decoding.translator import Translator
from mtrain.export import engine as ct2_engine
from mtrain.export.converter import export_run
from mtrain.model.transformer import Transformer
from mtrain.run.directory import load_run

CPU = torch.device("cpu")
LONG = (40, 64)  # output pieces with --long-outputs
LENGTH_RATIO = 1.5  # source pieces = output pieces / this, as configs/default.yaml's limit


def long_output_model(args, device: torch.device) -> Transformer:
    """A run's model, or a randomly initialised one of a config, that never outputs </s>."""
    if args.run is not None:
        model = load_run(args.run, device).model
    else:
        cfg = config.load(args.random_model)
        torch.manual_seed(0)
        vocab = cfg.tokenizer.vocab_size
        # positions for the longest output timed here, whatever the config's data lengths
        model = Transformer(cfg.model, vocab, vocab, LONG[1], PAD_ID).to(device).eval()
    positions = model.tgt_embed.positions.pe.size(0)
    if positions < LONG[1]:
        sys.exit(f"bench_decode.py: the model has {positions} positions; 40-64 pieces need 64")
    with torch.no_grad():  # every output then runs to its length limit
        model.output_projection.bias[EOS_ID] = float("-inf")
    return model


def long_outputs(args, device: torch.device) -> None:
    """Batch-1 greedy, without and with the cache, on outputs forced to 40-64 pieces."""
    model = long_output_model(args, device)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(LONG[0], LONG[1] + 1, (args.long_outputs,), generator=g).tolist()
    vocab = model.src_embed.tokens.num_embeddings
    sources = [  # (1, S) random pieces (ids from 4: not special), then </s>
        torch.cat(
            [
                torch.randint(4, vocab, (1, math.ceil(n / LENGTH_RATIO) - 1), generator=g),
                torch.tensor([[EOS_ID]]),
            ],
            dim=1,
        ).to(device)
        for n in lengths
    ]
    what = "random model of " + str(args.random_model) if args.run is None else str(args.run)
    print(
        f"{len(lengths)} random sources, outputs of {min(lengths)}-{max(lengths)} pieces "
        f"(mean {sum(lengths) / len(lengths):.1f}), batch 1, {what}, "
        f"{torch.get_num_threads()} threads, device {device}"
    )
    output = OutputLayer(model)  # made once, as a Translator does
    greedy(model, sources[0], torch.tensor([LONG[0]]), output=output)  # warm-up: first-call costs
    seconds = {False: 0.0, True: 0.0}
    for src, n in zip(sources, lengths):  # alternating, so both modes see the same machine
        for use_cache in (False, True):
            start = time.perf_counter()
            (out,) = greedy(model, src, torch.tensor([n]), use_cache, output=output)
            seconds[use_cache] += time.perf_counter() - start
            assert len(out) == n, "an output stopped before its length"
    for use_cache, took in seconds.items():
        name = f"greedy, {'cache' if use_cache else 'no cache'}, batch 1, 40-64 pieces"
        print(
            f"{name:38s} {took:7.2f} s  {len(lengths) / took:8.2f} sent/s  "
            f"{sum(lengths) / took:8.0f} tgt tok/s"
        )
    print(f"the cache is {seconds[False] / seconds[True]:.2f}x faster than recomputation")


def timed(translator: Translator, sources: list[str]) -> tuple[list[str], float]:
    """The translations of `sources` and the seconds they took (after a short warm-up)."""
    translator.translate(sources[:10])
    start = time.perf_counter()
    hyps = translator.translate(sources)
    return hyps, time.perf_counter() - start


def side_by_side(run: Path, cfg, tokenizer, model, sources, refs) -> None:
    """mtrain and CTranslate2 on the same sentences, batches and threads: a Markdown table."""
    greedy_cfg = dataclasses.replace(cfg.decode, beam_size=1)
    beam4 = dataclasses.replace(cfg.decode, beam_size=4)
    int8 = runtime.quantize_int8(model)
    threads = torch.get_num_threads()
    print(f"{len(sources)} test sentences, {threads} threads, CPU, batch {cfg.decode.batch_tokens}")
    print("| search | engine | seconds | sentences/s | BLEU | outputs equal to mtrain's |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        exported = export_run(run, Path(tmp) / "ct2")
        engines = {int8_: ct2_engine.load(exported, "cpu", int8_)[2] for int8_ in (False, True)}
        for name, decode, quantized in (
            ("greedy", greedy_cfg, False),
            ("beam 4", beam4, False),
            ("greedy, int8", greedy_cfg, True),
        ):
            ours = Translator(int8 if quantized else model, tokenizer, cfg, CPU, decode)
            theirs = ct2_engine.CT2Translator(engines[quantized], tokenizer, cfg, decode)
            reference = None
            for engine, translator in (("mtrain", ours), ("CTranslate2", theirs)):
                hyps, seconds = timed(translator, sources)
                reference = reference or hyps
                same = sum(a == b for a, b in zip(hyps, reference)) / len(hyps)
                bleu = score(hyps, refs, cfg.data.tgt_lang).bleu
                print(
                    f"| {name} | {engine} | {seconds:.2f} | {len(sources) / seconds:.1f} | "
                    f"{bleu:.2f} | {100 * same:.1f}% |",
                    flush=True,
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run", type=Path)
    parser.add_argument("--sentences", type=int, default=2000, help="first N test sentences")
    parser.add_argument("--bleu", action="store_true", help="also score each mode")
    parser.add_argument(
        "--long-outputs", type=int, default=0, metavar="N", help="instead: N long outputs"
    )
    parser.add_argument(
        "--random-model", type=Path, metavar="CONFIG", help="--long-outputs without a run"
    )
    parser.add_argument("--ctranslate2", action="store_true", help="instead: beside CTranslate2")
    parser.add_argument("--threads", type=int, help="intra-op threads (default: PyTorch's)")
    parser.add_argument("--device", default="auto", help="auto (CUDA where present), cpu, cuda")
    args = parser.parse_args()
    if args.long_outputs and (args.run is None) == (args.random_model is None):
        parser.error("--long-outputs needs --run or --random-model")
    if not args.long_outputs and (args.run is None or args.random_model is not None):
        parser.error("--run is required; --random-model goes with --long-outputs")

    device = runtime.pick_device(args.device)
    if args.long_outputs:
        return long_outputs(args, device)
    run = load_run(args.run, device)
    cfg, tokenizer, model = run.cfg, run.tokenizer, run.model
    pairs = read_parallel(
        Path(cfg.data.test), cfg.data.src_lang, cfg.data.tgt_lang, cfg.data.swap_columns
    )
    sources, refs = group_references(pairs)
    sources, refs = sources[: args.sentences], refs[: args.sentences]
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.ctranslate2:
        return side_by_side(args.run, cfg, tokenizer, model.cpu(), sources, refs)
    batch1 = dataclasses.replace(cfg.decode, batch_tokens=1, beam_size=1)
    greedy_cfg = dataclasses.replace(cfg.decode, beam_size=1)
    batch = f"batch {greedy_cfg.batch_tokens} tok"
    modes = [  # name, model, decoding options, use the key/value cache
        ("greedy, no cache, batch 1", model, batch1, False),
        ("greedy, cache, batch 1", model, batch1, True),
        (f"greedy, no cache, {batch}", model, greedy_cfg, False),
        (f"greedy, cache, {batch}", model, greedy_cfg, True),
        (f"beam {cfg.decode.beam_size} (the run's), cache, {batch}", model, cfg.decode, True),
    ]
    if device.type == "cpu":
        modes.append(
            (f"greedy, cache, int8, {batch}", runtime.quantize_int8(model), greedy_cfg, True)
        )
    print(f"{len(sources)} test sentences, {torch.get_num_threads()} threads, device {device}")
    for name, m, decode, use_cache in modes:
        translator = Translator(m, tokenizer, cfg, device, decode, use_cache=use_cache)
        start = time.perf_counter()
        hyps = translator.translate(sources)
        seconds = time.perf_counter() - start
        tokens = sum(len(ids) + 1 for ids in tokenizer.encode_tgt(hyps))  # + </s>
        line = (
            f"{name:38s} {seconds:7.2f} s  {len(sources) / seconds:8.1f} sent/s  "
            f"{tokens / seconds:8.0f} tgt tok/s"
        )
        if args.bleu:
            line += f"  BLEU {score(hyps, refs, cfg.data.tgt_lang).bleu:5.2f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
