"""What a run trains on: the corpora read, the tokenizer, the encoded examples and the updates.

The one place where training reads its data. The rest of training asks a `TrainingData` for
its tokenizer, its dev set, its next updates, the position of its batch stream and the
fingerprints of its corpora, and knows nothing of how they are read or stored.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from mtrain.checkpoint import CheckpointError
from mtrain.config import Config, DataConfig
from mtrain.data import (
    Batch,
    BatchStream,
    DataError,
    Example,
    encode_pairs,
    file_fingerprint,
    group_references,
    read_parallel,
)
from mtrain.distributed import Group
from mtrain.tokenizer import Tokenizer

log = logging.getLogger(__name__)
DATA_KEYS = ("train", "dev")  # the corpora a run reads: a resumed run must find them unchanged


@dataclass
class Update:
    """What one process trains on in one optimizer update."""

    batches: list[Batch]  # this process's share: `train.accumulate` batches
    n_target: int  # target tokens of the whole update, on every process
    n_tokens: int  # source and target tokens of the whole update, for the tokens/s shown

    @classmethod
    def of(cls, batches: list[Batch]) -> Update:
        """An update of one process alone."""
        n_target = sum(batch.n_target_tokens for batch in batches)
        return cls(batches, n_target, sum(batch.n_tokens for batch in batches))


class TrainingData:
    """The tokenizer, the encoded training and dev sets, and the seeded stream of batches."""

    def __init__(self, cfg: Config, run_dir: Path, group: Group, resume: bool):
        """Every process reads the corpora; rank 0 alone trains the tokenizer into `run_dir`
        (or loads the run's own to resume) and sends it to the others."""
        dcfg = cfg.data
        train_pairs, dev_pairs = read_pairs(dcfg, "train"), read_pairs(dcfg, "dev")
        log.info("read %d training and %d dev pairs", len(train_pairs), len(dev_pairs))
        self.paths = {key: getattr(dcfg, key) for key in DATA_KEYS}
        # A resumed run must read the same data, or it would not continue the same run.
        self.fingerprints = {key: file_fingerprint(Path(p)) for key, p in self.paths.items()}
        self.tokenizer = shared_tokenizer(cfg, run_dir, group, resume, train_pairs)
        self.train_examples = encode_training_pairs(self.tokenizer, train_pairs, dcfg)
        self.dev_examples = encode_pairs(
            self.tokenizer, dev_pairs, dcfg.max_src_len, dcfg.max_tgt_len
        )
        self.dev_sources, self.dev_refs = group_references(dev_pairs)
        self.stream = BatchStream(self.train_examples, cfg.train.batch_tokens, cfg.train.seed)

    def updates(self, group: Group, accumulate: int) -> Iterator[Update]:
        """Yield this process's share of each optimizer update.

        An update is the next `world_size × accumulate` batches of the batch stream, which is
        the same on every process; process r trains on the r-th `accumulate` of them. So an
        update holds the same sentences whatever the number of processes, and updates run
        across epoch ends as they do in one process: no process ever runs short of batches.
        """
        mine = slice(group.rank * accumulate, (group.rank + 1) * accumulate)
        stream = iter(self.stream)
        while True:
            indices = [next(stream) for _ in range(group.world_size * accumulate)]
            # Counted on the host from the lengths: no wait for a GPU, no exchange between ranks.
            examples = [self.train_examples[i] for batch in indices for i in batch]
            n_target = sum(len(ex.tgt) + 1 for ex in examples)
            n_source = sum(len(ex.src) for ex in examples)
            yield Update(
                [self.stream.collate(b) for b in indices[mine]], n_target, n_source + n_target
            )

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the data: its fingerprints and the stream's position."""
        return {"data": self.fingerprints, **self.stream.state_dict()}

    def check_unchanged(self, state: dict, path: Path) -> None:
        """Refuse to resume from the checkpoint `path` if a corpus changed since it was written."""
        for key, digest in state.get("data", {}).items():
            if self.fingerprints.get(key) != digest:
                raise CheckpointError(
                    f"data.{key}: {self.paths[key]} changed since {path} was written; resuming "
                    "would not continue the same run (restore the file, or train into another "
                    "--out)"
                )

    def load_state_dict(self, state: dict) -> None:
        """Take the batch stream back to where the checkpoint `state` left it."""
        self.stream.load_state_dict(state)


def read_pairs(dcfg: DataConfig, key: str) -> list[tuple[str, str]]:
    """The sentence pairs of corpus `data.<key>`; one with no usable pair is an error."""
    path = getattr(dcfg, key)
    pairs = read_parallel(Path(path), dcfg.src_lang, dcfg.tgt_lang, dcfg.swap_columns)
    if not any(s and t for s, t in pairs):
        raise DataError(f"{path}: no sentence pairs with both sides non-empty")
    return pairs


def shared_tokenizer(
    cfg: Config, run_dir: Path, group: Group, resume: bool, train_pairs: list[tuple[str, str]]
) -> Tokenizer:
    """Rank 0's tokenizer on every process: trained on the training pairs, or the run's own."""
    tokenizer = None
    if group.is_main and resume:
        tokenizer = Tokenizer.load(run_dir)
    elif group.is_main:
        sources, targets = [s for s, _ in train_pairs], [t for _, t in train_pairs]
        dcfg = cfg.data
        tokenizer = Tokenizer.train(
            sources, targets, cfg.tokenizer, dcfg.src_lang, dcfg.tgt_lang, run_dir, cfg.train.seed
        )
    # The others wait here while rank 0 trains: part of start-up, not bounded by --peer-timeout.
    protos = group.broadcast(tokenizer.protos() if group.is_main else None, startup=True)
    return tokenizer if group.is_main else Tokenizer.from_protos(*protos)


def encode_training_pairs(
    tokenizer: Tokenizer, pairs: list[tuple[str, str]], dcfg: DataConfig
) -> list[Example]:
    """The training pairs encoded, without those longer than the maximum lengths."""
    examples = encode_pairs(tokenizer, pairs, dcfg.max_src_len, dcfg.max_tgt_len, drop_long=True)
    too_long = sum(1 for s, t in pairs if s and t) - len(examples)
    if not examples:
        raise DataError(f"{dcfg.train}: every pair is longer than data.max_src_len/max_tgt_len")
    if too_long:
        log.info(
            "dropped %d training pairs longer than data.max_src_len/max_tgt_len tokens", too_long
        )
    return examples
