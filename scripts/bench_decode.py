"""Decoding speed on the shipped test split: sentences/s and target tokens/s per search mode.

    python scripts/bench_decode.py --run runs/NAME [--sentences 2000] [--bleu]

Modes: greedy without the key/value cache and with it, at batch 1 and at the configured batch;
beam 4; greedy with dynamic int8 quantization. Prints one line per mode (and BLEU with --bleu).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import torch

from mtrain import checkpoint, runtime
from mtrain.data import group_references, read_parallel
from mtrain.evaluate import score
from mtrain.translate import Translator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run", type=Path, required=True)
    parser.add_argument("--sentences", type=int, default=2000, help="first N test sentences")
    parser.add_argument("--bleu", action="store_true", help="also score each mode")
    args = parser.parse_args()

    device = runtime.pick_device()
    cfg, tokenizer, model = checkpoint.load_run(args.run, device)
    pairs = read_parallel(
        Path(cfg.data.test), cfg.data.src_lang, cfg.data.tgt_lang, cfg.data.swap_columns
    )
    sources, refs = group_references(pairs)
    sources, refs = sources[: args.sentences], refs[: args.sentences]
    batch1 = dataclasses.replace(cfg.decode, batch_tokens=1, beam_size=1)
    greedy_cfg = dataclasses.replace(cfg.decode, beam_size=1)
    beam4 = dataclasses.replace(cfg.decode, beam_size=4)
    batch = f"batch {greedy_cfg.batch_tokens} tok"
    modes = [  # name, model, decoding options, use the key/value cache
        ("greedy, no cache, batch 1", model, batch1, False),
        ("greedy, cache, batch 1", model, batch1, True),
        (f"greedy, no cache, {batch}", model, greedy_cfg, False),
        (f"greedy, cache, {batch}", model, greedy_cfg, True),
        (f"beam 4, cache, {batch}", model, beam4, True),
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
