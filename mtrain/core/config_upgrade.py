"""A run's recorded config in today's schema, with the values that run used, not today's defaults.

A run records its config (its config.yaml, an export's mtrain.yaml) with the schema `VERSION`
it was written in, and its checkpoints name the version too. A key added to the schema later
is absent from an older record; read with today's default, it would change the run (a target
vocabulary of 4,000 pieces for a run that has one of the source's size, a dropout chosen on
resume). `upgrade` is the one place that turns an older record into today's schema. A config
file a person writes names no version and is read with today's defaults.
"""

from __future__ import annotations

import copy
from typing import Any

# The schema of the configs and checkpoints this mtrain writes. 1: every record written before
# records carried a version (416dbc9 to 116cbc2); its keys say which mtrain wrote it.
VERSION = 2
VERSION_KEY = "version"

# Each key added to the schema since the first run directory (416dbc9), with the value that
# does what mtrain did before the key existed, and the commit that added it.
ADDED: dict[tuple[str, str], Any] = {
    # fe3ae92: beam search; before, greedy search in batches of sentences, + 10 tokens at most
    ("decode", "batch_tokens"): 6000,
    ("decode", "beam_size"): 1,
    ("decode", "alpha"): 0.6,  # unused by greedy search
    ("decode", "max_len_offset"): 10,
    # c8b9337: before, no step-N.pt checkpoints, and a non-finite loss stopped the run
    ("train", "keep_last"): 0,
    ("train", "skip_nonfinite"): False,
    # ff2b51d: before, untied embeddings, one batch per update, no early stop or averaging,
    # fp32 on the CPU (what "auto" did then; it means bf16 on a CPU that has it today)
    ("model", "tie_embeddings"): False,
    ("train", "accumulate"): 1,
    ("train", "patience"): 0,
    ("train", "average_last"): 0,
    ("train", "precision"): "fp32",
    # 683f2a0: before, the files held the source first
    ("data", "swap_columns"): False,
    # da5aa77 (prepared corpora, final punctuation, the linear schedule): before, no length
    # ratio filter, no dropped punctuation, inverse-square-root decay. The tokenizers read
    # every sentence: 200,000 sampled is every one of a corpus below that size, and a resumed
    # run keeps the tokenizers it has.
    ("data", "prepared_dir"): "prepared",
    ("data", "max_len_ratio"): 0.0,
    ("data", "drop_final_punct"): 0.0,
    ("tokenizer", "input_sentence_size"): 200_000,
    ("train", "lr_schedule"): "inverse_sqrt",
    # dc6eecf: before, no example translations and no TensorBoard files
    ("train", "examples"): [],
    ("train", "dev_examples"): 0,
    ("train", "tensorboard"): False,
    # a2a5f5e: before, a target model of the source's size and no moving average
    ("tokenizer", "tgt_vocab_size"): 0,
    ("train", "ema_decay"): 0.0,
    # 6028b16: before, no recipe that follows the budget (model.dropout throughout)
    ("train", "short_run_updates"): 0,
    ("train", "short_run_dropout"): 0.1,  # unused while short_run_updates is 0
    # 7e56b24: before, no subword sampling
    ("data", "src_sampling_alpha"): 0.0,
    # version 2: before, every run ran eagerly and started from random weights
    ("train", "compile"): False,
    ("train", "init_from"): "",
    # before model variants, every model was the textbook's
    ("model", "variant"): "textbook",
}

# Keys the schema no longer has: what they set is now fixed (decode.batch_size became
# decode.batch_tokens).
REMOVED = {("decode", "batch_size")}

# Keys an older schema had with another meaning: dropped from an older record, which then
# takes their ADDED value (train.compile of ff2b51d compiled the whole model and went in
# e91f4b9; version 2's compiles per batch shape).
REDEFINED = {("train", "compile")}


def upgrade(record: dict[str, Any], version: int) -> dict[str, Any]:
    """A run's config record of schema `version` (its `VERSION_KEY` taken out) in today's."""
    record = without_removed(record)
    if version < 2:
        for section, key in REDEFINED:
            if isinstance(record.get(section), dict):
                record[section].pop(key, None)
        for (section, key), value in ADDED.items():
            values = record.setdefault(section, {})
            if isinstance(values, dict):  # else refused, with its key, when the config is built
                values.setdefault(key, copy.deepcopy(value))
    return record


def without_removed(raw: dict[str, Any]) -> dict[str, Any]:
    """A config mapping less the keys the schema no longer has (REMOVED); a copy."""
    raw = {
        name: dict(values) if isinstance(values, dict) else values for name, values in raw.items()
    }
    for section, key in REMOVED:
        if isinstance(raw.get(section), dict):
            raw[section].pop(key, None)
    return raw
