import pytest

from mtrain.core.metrics import reference_streams, score


def test_references_against_themselves_score_100():
    refs = ["The cat sat on the mat.", "I don't know who I am.", "Let's try it!"]
    s = score(refs, [[r] for r in refs], "en")
    assert s.bleu == pytest.approx(100.0) and s.chrf == pytest.approx(100.0)
    assert "tok:13a" in s.bleu_signature


def test_any_reference_may_match():
    hyps = ["Let's try it.", "Who am I?"]
    refs = [["Let's have a try.", "Let's try it."], ["Who am I?"]]
    assert score(hyps, refs, "en").bleu == pytest.approx(100.0)
    assert score(hyps, [[r[0]] for r in refs], "en").bleu < 100


def test_streams_pad_with_none():
    assert reference_streams([["a", "b"], ["c"]]) == [["a", "c"], ["b", None]]


def test_chinese_target_uses_zh_tokenizer():
    assert "tok:zh" in score(["我是谁"], [["我是谁"]], "zh").bleu_signature


def test_mismatched_lengths():
    with pytest.raises(ValueError):
        score(["a"], [["a"], ["b"]], "en")
