"""Reading corpora, normalising, truncating, batching by tokens and padding batches."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from mtrain.text import normalize
from mtrain.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer


class DataError(ValueError):
    """A corpus that cannot be read; the message names the file and line."""


def read_lines(path: Path) -> list[str]:
    """Read a UTF-8 text file (BOM and CRLF tolerated) into lines without line ends."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror})") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise DataError(f"{path}:{line}: not valid UTF-8") from None
    return text.splitlines()


def decode_lines(lines: Iterable[bytes], name: str) -> Iterator[str]:
    """Decode a binary stream's lines as UTF-8 (BOM and CRLF tolerated), naming a bad line."""
    for number, raw in enumerate(lines, 1):
        try:
            line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
        except UnicodeDecodeError:
            raise DataError(f"{name}:{number}: not valid UTF-8") from None
        yield line.rstrip("\r\n")


def file_fingerprint(path: Path) -> str:
    """A hash of a file's bytes, to tell whether a corpus changed."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def read_parallel(
    path: Path, src_lang: str, tgt_lang: str, swap: bool = False
) -> list[tuple[str, str]]:
    """Read a TSV of pairs, `src<TAB>tgt` or Tatoeba's `id<TAB>src<TAB>id<TAB>tgt`, normalised.

    With `swap`, the file holds `tgt<TAB>src` (or `id<TAB>tgt<TAB>id<TAB>src`) instead.
    """
    pairs = []
    for number, line in enumerate(read_lines(path), 1):
        if not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) not in (2, 4):
            raise DataError(
                f"{path}:{number}: expected 2 or 4 tab-separated columns, got {len(fields)}"
            )
        src, tgt = (fields[0], fields[1]) if len(fields) == 2 else (fields[1], fields[3])
        if swap:
            src, tgt = tgt, src
        pairs.append((normalize(src, src_lang), normalize(tgt, tgt_lang)))
    return pairs


def group_references(pairs: list[tuple[str, str]]) -> tuple[list[str], list[list[str]]]:
    """Turn pairs into distinct sources, in first-seen order, each with all its references."""
    refs: dict[str, list[str]] = {}
    for src, tgt in pairs:
        refs.setdefault(src, []).append(tgt)
    return list(refs), list(refs.values())


@dataclass
class Example:
    src: list[int]  # source pieces then </s>
    tgt: list[int]  # target pieces, without <s> or </s>


def source_ids(pieces: list[int], max_src_len: int) -> list[int]:
    """Source pieces truncated to leave room for </s>, then </s>."""
    return [*pieces[: max_src_len - 1], EOS_ID]


def encode_pairs(
    tokenizer: Tokenizer,
    pairs: list[tuple[str, str]],
    max_src_len: int,
    max_tgt_len: int,
    drop_long: bool = False,
) -> list[Example]:
    """Encode pairs, drop those with an empty side, and fit the rest to the maximum lengths:
    truncate them, or drop them with `drop_long` (for training: a truncated target still ends
    in </s>, which would teach the model to stop early)."""
    pairs = [(s, t) for s, t in pairs if s and t]
    srcs = tokenizer.encode_src([s for s, _ in pairs])
    tgts = tokenizer.encode_tgt([t for _, t in pairs])
    # The source gains </s>; tgt_in and tgt_out each add one token (<s> or </s>) to the pieces.
    return [
        Example(source_ids(src, max_src_len), tgt[: max_tgt_len - 1])
        for src, tgt in zip(srcs, tgts)
        if not (drop_long and (len(src) >= max_src_len or len(tgt) >= max_tgt_len))
    ]


def pad(seqs: list[list[int]]) -> torch.Tensor:
    """Right-pad sequences with PAD_ID into a (B, max_len) tensor."""
    out = torch.full((len(seqs), max(map(len, seqs))), PAD_ID, dtype=torch.long)
    for i, seq in enumerate(seqs):
        out[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
    return out


@dataclass
class Batch:
    """A padded batch for teacher forcing: the decoder reads tgt_in and predicts tgt_out."""

    src: torch.Tensor  # (B, S)
    tgt_in: torch.Tensor  # (B, T): <s> y1 .. yn
    tgt_out: torch.Tensor  # (B, T): y1 .. yn </s>

    @classmethod
    def collate(cls, examples: list[Example]) -> Batch:
        return cls(
            src=pad([ex.src for ex in examples]),
            tgt_in=pad([[BOS_ID, *ex.tgt] for ex in examples]),
            tgt_out=pad([[*ex.tgt, EOS_ID] for ex in examples]),
        )

    @property
    def n_tokens(self) -> int:
        """Non-padding source and target tokens."""
        return int((self.src != PAD_ID).sum() + (self.tgt_out != PAD_ID).sum())

    @property
    def n_target_tokens(self) -> int:
        return int((self.tgt_out != PAD_ID).sum())

    def to(self, device: torch.device) -> Batch:
        if device.type == "cuda":
            return Batch(
                *(
                    t.pin_memory().to(device, non_blocking=True)
                    for t in (self.src, self.tgt_in, self.tgt_out)
                )
            )
        return self


def token_batches(
    examples: list[Example], batch_tokens: int, rng: random.Random
) -> list[list[int]]:
    """Group example indices into batches of at most `batch_tokens` padded tokens.

    Examples are sorted by length (ties broken at random) so each batch holds similar lengths
    and little padding; the batch order is then shuffled.
    """
    order = list(range(len(examples)))
    rng.shuffle(order)
    order.sort(key=lambda i: (len(examples[i].src), len(examples[i].tgt)))
    batches, current, max_src, max_tgt = [], [], 0, 0
    for i in order:
        src_len, tgt_len = len(examples[i].src), len(examples[i].tgt) + 1
        new_src, new_tgt = max(max_src, src_len), max(max_tgt, tgt_len)
        if current and (len(current) + 1) * (new_src + new_tgt) > batch_tokens:
            batches.append(current)
            current, new_src, new_tgt = [], src_len, tgt_len
        current.append(i)
        max_src, max_tgt = new_src, new_tgt
    if current:
        batches.append(current)
    rng.shuffle(batches)
    return batches


def epoch_batches(
    examples: list[Example], batch_tokens: int, rng: random.Random
) -> Iterator[Batch]:
    """Yield one epoch of shuffled, token-sized batches."""
    for indices in token_batches(examples, batch_tokens, rng):
        yield Batch.collate([examples[i] for i in indices])


class BatchStream:
    """Training batches, epoch after epoch, each epoch in a new seeded order.

    It yields each batch as the indices of its examples (`collate` makes the tensors), so that
    a process can skip the batches another process trains on. Its position (`state_dict`) is
    the epoch, the batches of it already taken and the generator state its order came from,
    so a resumed run takes exactly the batches an uninterrupted one would have.
    """

    def __init__(self, examples: list[Example], batch_tokens: int, seed: int):
        self.examples, self.batch_tokens = examples, batch_tokens
        self.rng = random.Random(seed)
        self.epoch, self.batches_done = 0, 0
        self.epoch_rng_state = None  # generator state this epoch's order came from

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            if self.epoch_rng_state is None:
                self.epoch_rng_state = self.rng.getstate()
            else:  # resuming inside an epoch: rebuild its batch order exactly
                self.rng.setstate(self.epoch_rng_state)
            order = token_batches(self.examples, self.batch_tokens, self.rng)
            while self.batches_done < len(order):
                indices = order[self.batches_done]
                self.batches_done += 1
                yield indices
            self.epoch, self.batches_done, self.epoch_rng_state = self.epoch + 1, 0, None

    def collate(self, indices: list[int]) -> Batch:
        return Batch.collate([self.examples[i] for i in indices])

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "batches_done": self.batches_done,
            "epoch_rng_state": self.epoch_rng_state,
        }

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.batches_done = state["epoch"], state["batches_done"]
        self.epoch_rng_state = state["epoch_rng_state"]
