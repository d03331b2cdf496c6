"""Reading pairs of sentences, encoding them to ids, and padding them into batches."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from mtrain.data.corpus import BadLine, Corpus, DataError, decode_line, read_pairs, usable
from mtrain.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer, fit, too_long


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
    return [*fit(pieces, max_src_len), EOS_ID]


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
    pairs = [(s, t) for s, t in pairs if usable(s, t)]
    srcs = tokenizer.encode_src([s for s, _ in pairs])
    tgts = tokenizer.encode_tgt([t for _, t in pairs])
    # The source gains </s>; tgt_in and tgt_out each add one token (<s> or </s>) to the pieces.
    return [
        Example(source_ids(src, max_src_len), fit(tgt, max_tgt_len))
        for src, tgt in zip(srcs, tgts)
        if not (drop_long and (too_long(src, max_src_len) or too_long(tgt, max_tgt_len)))
    ]


def pad(seqs: list[list[int]]) -> torch.Tensor:
    """Right-pad sequences with PAD_ID into a (B, max_len) tensor."""
    out = torch.full((len(seqs), max(map(len, seqs))), PAD_ID, dtype=torch.long)
    for i, seq in enumerate(seqs):
        out[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
    return out


@dataclass(frozen=True)
class Shape:
    """A training batch's shape: rows × (source length + decoder length) positions."""

    rows: int
    src_len: int  # source positions, </s> included
    tgt_len: int  # decoder positions: target pieces + 1 (<s> in tgt_in, </s> in tgt_out)


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
        """Non-padding source and target tokens of the batch's pairs (not of rows of padding)."""
        pairs = self.tgt_out[:, 0] != PAD_ID  # (B,) every pair's target holds </s> at least
        return int((self.src[pairs] != PAD_ID).sum() + (self.tgt_out != PAD_ID).sum())

    def padded_to(self, shape: Shape) -> Batch:
        """The batch padded to `shape`: columns of padding, then rows of padding.

        A row of padding alone would hide every key from its queries (NaN out of softmax), so
        it reads a source of </s> and a decoder input of <s>; its targets are all padding, so
        it adds nothing to the loss nor to the gradients.
        """
        n, extra = len(self.src), shape.rows - len(self.src)
        if extra < 0 or shape.src_len < self.src.size(1) or shape.tgt_len < self.tgt_in.size(1):
            # F.pad with a negative width would crop the batch without a word.
            size = f"{n} x ({self.src.size(1)} + {self.tgt_in.size(1)})"
            raise ValueError(f"a batch of {size} does not fit in {shape}")
        src = F.pad(self.src, (0, shape.src_len - self.src.size(1), 0, extra), value=PAD_ID)
        tgt_in, tgt_out = (
            F.pad(t, (0, shape.tgt_len - t.size(1), 0, extra), value=PAD_ID)
            for t in (self.tgt_in, self.tgt_out)
        )
        src[n:, 0], tgt_in[n:, 0] = EOS_ID, BOS_ID
        return Batch(src, tgt_in, tgt_out)

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
