"""Reading corpora, normalising, truncating, padding, and batching by tokens: pairs or sources."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from mtrain.corpus import BadLine, Corpus, DataError, decode_line, read_pairs
from mtrain.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer


def read_lines(path: Path) -> list[str]:
    """Read a UTF-8 text file (BOM and CRLF tolerated) into lines without line ends."""
    try:
        with path.open("rb") as f:
            return list(decode_lines(f, str(path)))
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror})") from None


def decode_lines(lines: Iterable[bytes], name: str) -> Iterator[str]:
    """Decode a binary stream's lines as UTF-8 (BOM and CRLF tolerated), naming a bad line.

    Lines end at "\n" only, as in every reader here: `str.splitlines` would also split at
    U+2028, U+0085 or a form feed inside a sentence and misalign the file with its pair.
    """
    for number, raw in enumerate(lines, 1):
        try:
            yield decode_line(raw, number == 1)
        except BadLine as e:
            raise DataError(f"{name}:{number}: {e}") from None


def read_parallel(
    path: Path, src_lang: str, tgt_lang: str, swap: bool = False
) -> list[tuple[str, str]]:
    """Read a TSV of pairs, `src<TAB>tgt` or Tatoeba's `id<TAB>src<TAB>id<TAB>tgt`, normalised.

    With `swap`, the file holds `tgt<TAB>src` (or `id<TAB>tgt<TAB>id<TAB>src`) instead.
    """
    return read_pairs(Corpus(path, swap=swap), src_lang, tgt_lang)


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
    src_len: np.ndarray, tgt_len: np.ndarray, batch_tokens: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """Group pair indices into batches of at most `batch_tokens` padded tokens.

    Pairs are sorted by (source, target) length, ties in random order, so each batch holds
    similar lengths and little padding; the order of the batches is then shuffled. `tgt_len`
    counts pieces: the decoder's side of a pair is one longer (<s> or </s>).
    """
    n = len(src_len)
    # 4-byte indices and one 4-byte key: at 10M pairs the process's peak fell from 596 to 472 MB.
    shuffled = rng.permutation(np.arange(n, dtype=np.int32 if n < 1 << 31 else np.int64))
    key = src_len[shuffled].astype(np.uint32) << 16 | tgt_len[shuffled].astype(np.uint32)
    order = shuffled[np.argsort(key, kind="stable")]  # by (source, target) length, ties random
    del shuffled, key
    batches = split_batches(order, src_len, tgt_len, batch_tokens)
    return [batches[i] for i in rng.permutation(len(batches))]


def length_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Indices of sources sorted by length (ties in input order), cut into batches of at most
    `batch_tokens` padded tokens: the batches of translation, which has no target."""
    src_len = np.array(lengths, dtype=np.int64)
    order = np.argsort(src_len, kind="stable")
    return [batch.tolist() for batch in split_batches(order, src_len, None, batch_tokens)]


def split_batches(
    order: np.ndarray, src_len: np.ndarray, tgt_len: np.ndarray | None, batch_tokens: int
) -> list[np.ndarray]:
    """Cut `order` into consecutive batches, each the most pairs that fit in `batch_tokens`.

    A batch of k pairs costs k × (longest source + longest target), which only grows with k,
    so each cut is a binary search; the longest pair is no shorter than the first, so k is at
    most batch_tokens // (first pair's cost): that bounds how far it looks. The result is the
    greedy one-pair-at-a-time partition, computed a batch at a time. With no `tgt_len`, the
    batches hold sources alone, and k sources cost k × the longest.
    """
    src = src_len[order].astype(np.int32)
    tgt = np.zeros_like(src) if tgt_len is None else tgt_len[order].astype(np.int32) + 1
    batches, start, n = [], 0, len(order)
    while start < n:
        window = min(n - start, batch_tokens // int(src[start] + tgt[start]) + 1)
        end = start + window
        cost = np.arange(1, window + 1) * (
            np.maximum.accumulate(src[start:end]) + np.maximum.accumulate(tgt[start:end])
        )
        size = max(1, int(np.searchsorted(cost, batch_tokens, side="right")))
        batches.append(order[start : start + size])
        start += size
    return batches


def example_batches(examples: list[Example], batch_tokens: int) -> Iterator[Batch]:
    """Padded batches of in-memory examples (dev), grouped by length in a fixed order."""
    src_len = np.array([len(ex.src) for ex in examples])
    tgt_len = np.array([len(ex.tgt) for ex in examples])
    for indices in token_batches(src_len, tgt_len, batch_tokens, np.random.default_rng(0)):
        yield Batch.collate([examples[i] for i in indices])
