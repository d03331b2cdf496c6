import hashlib
import sys
from pathlib import Path

import pytest
import torch

from mtrain.data.corpus import Corpus, read_pairs
from mtrain.data.pairs import (
    Batch,
    DataError,
    Example,
    Shape,
    decode_lines,
    encode_pairs,
    group_references,
    read_lines,
)
from mtrain.data.text import normalize
from mtrain.data.token_corpus import drop_final_punctuation
from mtrain.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from mtrain.training.optim import loss_fn

from .synthetic import small_model

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "data" / "tatoeba"
sys.path.insert(0, str(REPO / "scripts"))
import prepare_tatoeba  # noqa: E402


def shipped_split(name):
    return prepare_tatoeba.read_export(DATA / f"{name}.tsv")[0]


def test_shipped_split_has_no_leakage():
    train = shipped_split("train")
    seen_zh = {normalize(r[1], "zh") for r in train}
    seen_en = {r[3] for r in train}
    for name in ("dev", "test"):
        rows = shipped_split(name)
        assert rows
        assert not {normalize(r[1], "zh") for r in rows} & seen_zh, name
        assert not {r[3] for r in rows} & seen_en, name
    dev, test = shipped_split("dev"), shipped_split("test")
    assert not {r[3] for r in dev} & {r[3] for r in test}
    assert not {normalize(r[1], "zh") for r in dev} & {normalize(r[1], "zh") for r in test}


def test_shipped_dev_has_2000_sources_each_with_every_reference():
    """Validation reads the dev split as 2,000 sources, each scored against all its English."""
    sources, refs = group_references(read_pairs(Corpus(DATA / "dev.tsv"), "zh", "en", scored=True))
    assert len(sources) == len(set(sources)) == 2000
    expected: dict[str, set[str]] = {}
    for _, zh, _, en in shipped_split("dev"):
        expected.setdefault(normalize(zh, "zh"), set()).add(en)
    assert {s: set(r) for s, r in zip(sources, refs)} == expected
    assert sum(map(len, refs)) == len(shipped_split("dev"))


def test_shipped_test_split_is_the_one_every_published_score_used():
    digest = hashlib.sha256((DATA / "test.tsv").read_bytes()).hexdigest()
    assert digest == "2228e3631c53374ae0a8036470854558288f0dc34cda363d0574dbf82c3d8d56"


def test_split_is_deterministic_and_reproduces_the_shipped_data():
    """The split depends only on the pairs: re-splitting the shipped files gives them back."""
    parts = [shipped_split(n) for n in ("train", "dev", "test")]
    rows = [r for part in reversed(parts) for r in part]  # any order must give the same split
    groups = prepare_tatoeba.connected_groups(prepare_tatoeba.drop_duplicates(rows))
    again = prepare_tatoeba.split(groups, 2000, 2000, 8)
    assert [sorted(p) for p in again] == [sorted(p) for p in parts]


def test_prepare_handles_bom_crlf_whitespace_and_duplicates(tmp_path):
    export = tmp_path / "export.tsv"
    export.write_bytes(
        "\ufeff1\t我们  试试看！\t10\tLet's try.\r\n"
        "1\t我们 试试看！\t10\t Let's try. \r\n"
        "2\t我是誰\t20\tWho am I?\r\n"
        "broken line\r\n".encode()
    )
    rows, skipped = prepare_tatoeba.read_export(export)
    assert skipped == 1
    assert rows[0] == ("1", "我们 试试看！", "10", "Let's try.")
    assert len(prepare_tatoeba.drop_duplicates(rows)) == 2


def test_reference_files_split_at_newlines_only_as_translate_does(tmp_path):
    refs = tmp_path / "refs.en"
    refs.write_bytes("\ufeffWho am I?\u2028Who?\r\nIt\x85s Tuesday.\x0c\n\nLast".encode())
    lines = ["Who am I?\u2028Who?", "It\x85s Tuesday.\x0c", "", "Last"]
    assert read_lines(refs) == lines
    with refs.open("rb") as f:
        assert list(decode_lines(f, "refs")) == lines
    refs.write_bytes(b"one\ntwo \xff\n")
    with pytest.raises(DataError, match=f"^{refs}:2: not valid UTF-8$"):
        read_lines(refs)


def test_groups_join_traditional_and_simplified():
    rows = [("1", "我是誰", "10", "Who am I?"), ("2", "我是谁", "11", "Who am I, then?")]
    assert len(prepare_tatoeba.connected_groups(rows)) == 1


def test_read_pairs_formats_and_normalisation(tmp_path):
    two = tmp_path / "two.tsv"
    two.write_text("我是誰\tWho am I?\n\n今天  是星期二\tIt's Tuesday.\n", encoding="utf-8")
    assert read_pairs(Corpus(two), "zh", "en") == [
        ("我是谁", "Who am I?"),
        ("今天 是星期二", "It's Tuesday."),
    ]


def test_read_pairs_swapped_reads_the_second_text_column_as_source(tmp_path):
    two, four = tmp_path / "two.tsv", tmp_path / "four.tsv"
    two.write_text("我是誰\tWho am I?\n", encoding="utf-8")
    four.write_text("1\t我是誰\t10\tWho am I?\n", encoding="utf-8")
    for path in (two, four):
        # Each side is normalised for its own language: the Chinese target becomes simplified.
        assert read_pairs(Corpus(path, swap=True), "en", "zh") == [("Who am I?", "我是谁")]


def test_pairs_to_be_scored_warn_of_an_empty_side_naming_the_first(tmp_path, caplog):
    path = tmp_path / "dev.tsv"
    path.write_text("我是谁\tWho am I?\n\n你好\t \n\tHello.\n", encoding="utf-8")
    with caplog.at_level("WARNING"):
        pairs = read_pairs(Corpus(path), "zh", "en", scored=True)
    assert pairs == [("我是谁", "Who am I?"), ("你好", ""), ("", "Hello.")]  # scored as they are
    assert f"{path}:3: a sentence pair with an empty side (2 in the file)" in caplog.text
    caplog.clear()
    read_pairs(Corpus(path), "zh", "en")  # held-out sources read to keep them out of training
    assert not caplog.text


def test_read_pairs_errors_name_file_and_line(tmp_path):
    bad = tmp_path / "bad.tsv"
    bad.write_text("a\tb\nonly one column\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"bad\.tsv:2: expected 2 or 4"):
        read_pairs(Corpus(bad), "zh", "en")
    binary = tmp_path / "bin.tsv"
    binary.write_bytes(b"a\tb\nc\t\xff\xfe\n")
    with pytest.raises(DataError, match=r"bin\.tsv:2: not valid UTF-8"):
        read_pairs(Corpus(binary), "zh", "en")
    with pytest.raises(DataError, match="cannot read"):
        read_pairs(Corpus(tmp_path / "missing.tsv"), "zh", "en")


def test_group_references():
    pairs = [("a", "1"), ("b", "2"), ("a", "3")]
    assert group_references(pairs) == (["a", "b"], [["1", "3"], ["2"]])


def test_tgt_out_is_tgt_in_shifted():
    batch = Batch.collate([Example([5, 6, EOS_ID], [7, 8, 9]), Example([5, EOS_ID], [7])])
    assert batch.tgt_in.tolist() == [[BOS_ID, 7, 8, 9], [BOS_ID, 7, PAD_ID, PAD_ID]]
    assert batch.tgt_out.tolist() == [[7, 8, 9, EOS_ID], [7, EOS_ID, PAD_ID, PAD_ID]]
    real = batch.tgt_in[:, 1:] != PAD_ID
    assert (batch.tgt_in[:, 1:][real] == batch.tgt_out[:, :-1][real]).all()
    assert batch.src.tolist() == [[5, 6, EOS_ID], [5, EOS_ID, PAD_ID]]
    assert batch.n_tokens == 5 + 6


def test_truncation_to_maximum_lengths(tokenizer):
    long = " ".join(["one two three"] * 20)
    (ex,) = encode_pairs(tokenizer, [("一二三" * 20, long)], max_src_len=8, max_tgt_len=5)
    assert len(ex.src) == 8 and ex.src[-1] == EOS_ID
    batch = Batch.collate([ex])
    assert batch.tgt_in.shape[1] == 5 and batch.tgt_out[0, -1] == EOS_ID


def test_over_long_training_pairs_are_dropped_not_truncated(tokenizer):
    pairs = [("一二", "one two"), ("一二三" * 20, "one"), ("一", " ".join(["one two"] * 20))]
    kept = encode_pairs(tokenizer, pairs, max_src_len=8, max_tgt_len=5, drop_long=True)
    assert len(kept) == 1
    (ex,) = kept
    assert len(ex.src) <= 8 and len(ex.tgt) + 1 <= 5
    assert ex.tgt == tokenizer.encode_tgt(["one two"])[0]  # whole, not cut
    fits = encode_pairs(tokenizer, pairs[:1], max_src_len=8, max_tgt_len=5, drop_long=True)
    assert fits == encode_pairs(tokenizer, pairs[:1], max_src_len=8, max_tgt_len=5)


def test_empty_pairs_are_dropped(tokenizer):
    assert len(encode_pairs(tokenizer, [("", "one"), ("一", ""), ("一", "one")], 8, 8)) == 1


def test_final_punctuation_is_dropped_with_its_probability():
    punctuation = torch.tensor([9])
    src = torch.tensor([[5, 9, EOS_ID], [5, 6, EOS_ID], [9, EOS_ID, PAD_ID]] * 2000)
    torch.manual_seed(0)
    out = drop_final_punctuation(src, punctuation, 0.3)
    ends_in_punctuation = src[0::3]
    dropped = (out[0::3] != ends_in_punctuation).any(1)
    assert 0.27 < dropped.float().mean() < 0.33
    assert out[0::3][dropped].tolist() == [[5, EOS_ID, PAD_ID]] * int(dropped.sum())
    assert out[1::3].equal(src[1::3])  # no final punctuation: unchanged
    assert out[2::3].equal(src[2::3])  # punctuation alone: never emptied
    assert (
        drop_final_punctuation(src, punctuation, 1.0)[0::3].tolist() == [[5, EOS_ID, PAD_ID]] * 2000
    )


def test_a_batch_is_never_padded_to_a_shape_smaller_than_itself():
    batch = Batch.collate([Example([5, 6, EOS_ID], [7, 8]), Example([5, EOS_ID], [7])])
    assert batch.src.shape == (2, 3) and batch.tgt_in.shape == (2, 3)
    assert batch.padded_to(Shape(rows=2, src_len=3, tgt_len=3)).src.equal(batch.src)
    for smaller in (Shape(1, 3, 3), Shape(2, 2, 3), Shape(2, 3, 2)):
        with pytest.raises(ValueError, match="does not fit"):
            batch.padded_to(smaller)


def test_rows_and_columns_of_padding_change_neither_loss_nor_gradients():
    torch.manual_seed(0)
    examples = [
        Example([*torch.randint(4, 50, (n,)).tolist(), EOS_ID], torch.randint(4, 50, (m,)).tolist())
        for n, m in ((5, 7), (3, 2), (8, 4))
    ]
    batch = Batch.collate(examples)
    padded = batch.padded_to(Shape(rows=7, src_len=12, tgt_len=13))
    assert padded.src.shape == (7, 12) and padded.tgt_in.shape == padded.tgt_out.shape == (7, 13)
    assert padded.n_tokens == batch.n_tokens
    assert padded.n_target_tokens == batch.n_target_tokens

    def loss_and_grads(b: Batch) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model = small_model(50, 50).double()  # no dropout: its masks would follow the shape
        loss = loss_fn(model(b.src, b.tgt_in), b.tgt_out, 0.1, "sum")
        loss.backward()
        return loss.detach(), [p.grad for p in model.parameters()]

    loss, grads = loss_and_grads(batch)
    padded_loss, padded_grads = loss_and_grads(padded)
    torch.testing.assert_close(padded_loss, loss)
    for a, b in zip(padded_grads, grads):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b)


def test_dev_sources_truncated_are_warned_of_once_with_their_number(corpus, tmp_path, caplog):
    from mtrain.training.build import build_trainer

    from .synthetic import small_config

    dev = tmp_path / "dev.tsv"
    long = "一二三四五六七八九" * 12
    dev.write_text(f"一二\tone two\n{long}\tlong\n{long}五\tlonger\n", encoding="utf-8")
    cfg = small_config({**corpus, "dev": str(dev), "prepared_dir": str(tmp_path / "prepared")})
    with caplog.at_level("WARNING"):
        trainer = build_trainer(cfg, tmp_path, torch.device("cpu"))
        trainer.validator(trainer.step)
        trainer.validator(trainer.step)
    warned = [r.getMessage() for r in caplog.records if "truncated" in r.getMessage()]
    assert warned == [f"{dev}: 2 source sentence(s) truncated to 32 tokens at every validation"]
