"""Scoring by teacher forcing (mtrain/decoding/score.py, `mtrain score`): one read of the
device per batch, a side longer than the model reads scored cut and said so, a line of three
tab-separated fields refused."""

from __future__ import annotations

import json

import pytest
import torch

from mtrain.core.config import DecodeConfig
from mtrain.data.tokenizer import BOS_ID, EOS_ID
from mtrain.decoding import score
from mtrain.decoding.search import allowed
from mtrain.decoding.translator import Translator

from .console import mtrain
from .host_reads import HostReads, count_copies
from .synthetic import number_pairs, small_translator


@pytest.fixture(scope="module")
def translator(tokenizer) -> Translator:
    """A random model with short limits, scoring in batches of at most 60 tokens."""
    return small_translator(tokenizer, DecodeConfig(batch_tokens=60))


def test_scoring_reads_the_device_once_per_batch(translator, monkeypatch):
    pairs = number_pairs(40, seed=5)
    batches = []
    real_batches = score.length_batches
    monkeypatch.setattr(
        score, "length_batches", lambda *args: batches.extend(real_batches(*args)) or batches
    )
    reads = HostReads()
    count_copies(reads, monkeypatch)
    with reads:
        scores = score.score_pairs(translator, [s for s, _ in pairs], [t for _, t in pairs], k=3)
    assert len(batches) > 3
    assert reads.by_step[0] == len(batches), reads.what[0]
    monkeypatch.undo()
    for (source, _), result in zip(pairs[:5], scores):  # as one forward pass gives them
        (src,) = translator.sources([source])
        ids = [p.id for p in result.pieces]
        with torch.inference_mode():
            logits = translator.model(torch.tensor([src.ids]), torch.tensor([[BOS_ID, *ids[:-1]]]))
            log_probs = torch.log_softmax(allowed(logits), dim=-1)[0]  # (n, V)
        assert ids[-1] == EOS_ID and result.truncated == []
        for position, piece in enumerate(result.pieces):
            row = log_probs[position]
            assert piece.log_prob == pytest.approx(float(row[piece.id]), abs=1e-5)
            assert piece.rank == 1 + int((row > row[piece.id]).sum())
            top = row.topk(3)
            assert [lp for _, lp in piece.top] == pytest.approx(top.values.tolist(), abs=1e-5)
            assert [p for p, _ in piece.top] == translator.tokenizer.tgt.id_to_piece(
                top.indices.tolist()
            )


def test_a_side_longer_than_the_model_reads_is_scored_cut_and_named(translator):
    short_zh, short_en = number_pairs(1, seed=3)[0]
    long_zh, long_en = "一二三四五六七八九" * 4, " ".join(["nine eight seven"] * 12)
    scores = score.score_pairs(
        translator, [short_zh, long_zh, short_zh, long_zh], [short_en, short_en, long_en, long_en]
    )
    assert [s.truncated for s in scores] == [[], ["source"], ["target"], ["source", "target"]]
    assert len(scores[2].pieces) == 16  # data.max_tgt_len 16: 15 pieces, then </s>
    assert scores[3].to_dict()["truncated"] == ["source", "target"]
    assert "source and target cut" in str(scores[3]) and "cut" not in str(scores[0])


def test_the_command_names_the_lines_scored_cut_and_refuses_a_third_field(run_dir, tmp_path):
    args = ["score", "--run", str(run_dir), "--device", "cpu", "--json", "--input"]
    tsv = tmp_path / "pairs.tsv"
    tsv.write_text(f"我是谁？\tWho am I?\n{'我是谁' * 40}\tWho am I?\n", encoding="utf-8")
    done = mtrain(*args, str(tsv))
    assert done.returncode == 0, done.stderr
    assert [json.loads(line)["truncated"] for line in done.stdout.splitlines()] == [[], ["source"]]
    cut = f"{tsv}:2: the source is longer than the model reads (data.max_src_len: 32 tokens)"
    assert cut in done.stderr and f"{tsv}:1:" not in done.stderr
    tsv.write_text("我是谁？\tWho am I?\n我是谁？\tWho am I?\tWho is I?\n", encoding="utf-8")
    refused = mtrain(*args, str(tsv))
    assert refused.returncode == 2 and refused.stdout == ""
    assert f"{tsv}:2: expected SOURCE<TAB>TARGET, found 3 tab-separated fields" in refused.stderr
