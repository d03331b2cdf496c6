"""SentencePiece models for source and target: training, loading, batch encode/decode."""

from __future__ import annotations

import hashlib
import io
import logging
import re
import unicodedata
from collections.abc import Iterable, Sequence
from pathlib import Path

import sentencepiece as spm

from mtrain.core.config import ConfigError, TokenizerConfig
from mtrain.core.errors import MtrainError
from mtrain.core.files import write_atomic

log = logging.getLogger(__name__)
PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
SRC_MODEL, TGT_MODEL = "spm.src.model", "spm.tgt.model"
# What would break one output line per input line (or a SOURCE<TAB>TARGET file): the control
# characters (Unicode category Cc, U+0000-U+001F and U+007F-U+009F: \n, \r, \t, U+0085 ..)
# and the line and paragraph separators str.splitlines() also splits on. Byte fallback lets a
# model write any of them.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_control_warned = False


def printable(texts: list[str]) -> list[str]:
    """`texts` with each control character or line separator replaced by a space, so that a
    translation is one line of text; the first time one is replaced, a warning says so."""
    global _control_warned
    out = [_CONTROL.sub(" ", text) for text in texts]
    if not _control_warned and out != texts:
        _control_warned = True
        log.warning(
            "the model wrote control characters (newline, tab, ..: byte-fallback pieces); "
            "each is replaced by a space, so that each input line gets one output line"
        )
    return out


def too_long(pieces: Sequence[int], max_len: int) -> bool:
    """The length rule: whether `pieces` leave no room within `max_len` tokens for the one
    their side gains (</s> after a source; <s> or </s> around a target). Such a sentence is
    cut to fit (`fit`) where it is translated, and such a pair dropped where it is trained on."""
    return len(pieces) >= max_len


def fit(pieces: list[int], max_len: int) -> list[int]:
    """`pieces`, cut where they are `too_long` to leave room for the token their side gains."""
    return pieces[: max_len - 1]


class TokenizerError(MtrainError, ValueError):
    """A SentencePiece model that cannot be used; the message names the file."""


def _train_model(
    sentences: Iterable[str],
    cfg: TokenizerConfig,
    size: int,
    coverage: float,
    seed: int,
    key: str = "tokenizer.vocab_size",
) -> bytes:
    """A SentencePiece model of at most `size` pieces (`key` asked for them), serialised."""
    spm.set_random_generator_seed(seed)
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences),
            model_writer=model,
            vocab_size=size,
            model_type=cfg.model_type,
            character_coverage=coverage,
            byte_fallback=True,  # characters outside the vocabulary become bytes, never <unk>
            hard_vocab_limit=False,  # a small corpus may not support the full size
            pad_id=PAD_ID,
            unk_id=UNK_ID,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            num_threads=1,  # repeatable for a given seed
            minloglevel=2,
        )
    except RuntimeError as e:
        # SentencePiece reports "<file>(<line>) [<check>] <message>": keep the message.
        reason = str(e).rsplit("] ", 1)[-1].split(" Increase")[0]
        raise ConfigError(
            f"tokenizer: SentencePiece training failed: {reason} (raise tokenizer.vocab_size "
            "or lower tokenizer.character_coverage)"
        ) from None
    proto = model.getvalue()
    made = spm.SentencePieceProcessor(model_proto=proto).get_piece_size()
    if made < size:  # hard_vocab_limit=False: the corpus holds no more pieces
        log.warning(
            "%s: %d asked, SentencePiece could make %d from this corpus; the model has %d",
            key,
            size,
            made,
            made,
        )
    return proto


def check_ids(sp: spm.SentencePieceProcessor, name: str) -> None:
    """Refuse a model whose special ids are not those mtrain pins."""
    pinned = (sp.pad_id(), sp.unk_id(), sp.bos_id(), sp.eos_id())
    if pinned != (PAD_ID, UNK_ID, BOS_ID, EOS_ID):
        raise TokenizerError(f"{name}: special ids {pinned}, expected 0-3 (not an mtrain model)")


def load_model(path: Path) -> spm.SentencePieceProcessor:
    """Load one SentencePiece model file of a run."""
    try:
        proto = path.read_bytes()
    except FileNotFoundError:
        raise TokenizerError(f"{path}: no such file (a SentencePiece model of the run)") from None
    except OSError as e:
        raise TokenizerError(f"{path}: cannot read ({e.strerror})") from None
    try:
        if not proto:  # SentencePiece would build an empty model from no bytes
            raise ValueError
        sp = spm.SentencePieceProcessor(model_proto=proto)
    except (RuntimeError, ValueError):  # its parser and checks: a cut or damaged file
        raise TokenizerError(
            f"{path}: not a loadable SentencePiece model (truncated or corrupt)"
        ) from None
    check_ids(sp, str(path))
    return sp


class Tokenizer:
    """A source and a target SentencePiece model (the same model when the vocabulary is joint)."""

    def __init__(self, src: spm.SentencePieceProcessor, tgt: spm.SentencePieceProcessor):
        self.src, self.tgt = src, tgt
        for sp in (src, tgt):
            check_ids(sp, "SentencePiece model")

    @classmethod
    def train(
        cls,
        src_sentences: Sequence[str],
        tgt_sentences: Sequence[str],
        cfg: TokenizerConfig,
        src_lang: str,
        tgt_lang: str,
        out_dir: Path,
        seed: int = 1,
    ) -> Tokenizer:
        """Train on (normalised) training sentences and write the models into `out_dir`."""

        def coverage(*langs: str) -> float:
            # Chinese has thousands of rare characters: leave the rarest to byte fallback.
            return cfg.character_coverage if {"zh", "ja"} & set(langs) else 1.0

        if cfg.joint:
            both = [*src_sentences, *tgt_sentences]
            src = tgt = _train_model(both, cfg, cfg.vocab_size, coverage(src_lang, tgt_lang), seed)
        else:
            src = _train_model(src_sentences, cfg, cfg.vocab_size, coverage(src_lang), seed)
            key = "tokenizer.tgt_vocab_size" if cfg.tgt_vocab_size else "tokenizer.vocab_size"
            tgt = _train_model(tgt_sentences, cfg, cfg.tgt_size, coverage(tgt_lang), seed, key)
        write_atomic(out_dir / SRC_MODEL, src)
        write_atomic(out_dir / TGT_MODEL, tgt)
        return cls.load(out_dir)

    @classmethod
    def load(cls, run_dir: Path) -> Tokenizer:
        """Load the models that `train` wrote into a run directory."""
        return cls(load_model(run_dir / SRC_MODEL), load_model(run_dir / TGT_MODEL))

    @classmethod
    def from_protos(cls, src: bytes, tgt: bytes) -> Tokenizer:
        """The tokenizer whose serialised models `protos` returned."""
        load = spm.SentencePieceProcessor
        return cls(load(model_proto=src), load(model_proto=tgt))

    def write(self, out_dir: Path) -> Tokenizer:
        """Write both models into `out_dir` (a run or a prepared corpus), as `load` reads them."""
        write_atomic(out_dir / SRC_MODEL, self.src.serialized_model_proto())
        write_atomic(out_dir / TGT_MODEL, self.tgt.serialized_model_proto())
        return self

    def protos(self) -> tuple[bytes, bytes]:
        """Both models, serialised: what another process needs to rebuild this tokenizer."""
        return self.src.serialized_model_proto(), self.tgt.serialized_model_proto()

    def fingerprint(self) -> str:
        """A hash of both models, stored in checkpoints to catch a swapped tokenizer."""
        digest = hashlib.sha256(self.src.serialized_model_proto())
        digest.update(self.tgt.serialized_model_proto())
        return digest.hexdigest()

    @property
    def src_vocab_size(self) -> int:
        return self.src.get_piece_size()

    @property
    def tgt_vocab_size(self) -> int:
        return self.tgt.get_piece_size()

    def vocab_sizes(self) -> dict[str, int]:
        """Each side's vocabulary size, by side: as manifests and /model record them."""
        return {"src": self.src_vocab_size, "tgt": self.tgt_vocab_size}

    def encode_src(self, texts: list[str]) -> list[list[int]]:
        return self.src.encode(texts, out_type=int)

    def encode_tgt(self, texts: list[str]) -> list[list[int]]:
        return self.tgt.encode(texts, out_type=int)

    def decode_tgt(self, ids: list[list[int]]) -> list[str]:
        """Target ids as text, one line each: control characters replaced (`printable`)."""
        return printable(self.tgt.decode(ids))

    def src_punctuation_ids(self) -> list[int]:
        """Source pieces made of punctuation marks only (。 ? ! , . and the like, no quotes)."""

        def is_punctuation(piece: str) -> bool:
            text = piece.replace("▁", "")
            return bool(text) and all(unicodedata.category(ch) == "Po" for ch in text)

        pieces = (self.src.id_to_piece(i) for i in range(self.src_vocab_size))
        return [i for i, piece in enumerate(pieces) if is_punctuation(piece)]
