import dataclasses

import pytest

from mtrain.core.config import DecodeConfig
from mtrain.decoding.translator import Translator

from .synthetic import number_pairs, small_translator


@pytest.fixture(scope="module")
def translator(tokenizer) -> Translator:
    return small_translator(
        tokenizer, DecodeConfig(batch_tokens=40, beam_size=1, alpha=0.6, max_len_offset=4)
    )


def test_output_does_not_depend_on_batching(translator):
    texts = [zh for zh, _ in number_pairs(30, seed=5)]
    together = translator.translate(texts)
    assert together == [translator.translate([t])[0] for t in texts]
    small = Translator(
        translator.model,
        translator.tokenizer,
        translator.cfg,
        translator.device,
        dataclasses.replace(translator.decode, batch_tokens=12),
    )
    assert small.translate(texts) == together
    beam = dataclasses.replace(translator.decode, beam_size=3)
    beamer = Translator(
        translator.model, translator.tokenizer, translator.cfg, translator.device, beam, nbest=2
    )
    nbest = beamer.translate_nbest(texts)
    for text, hyps in zip(texts, nbest):
        alone = beamer.translate_nbest([text])[0]
        assert [h.text for h in alone] == [h.text for h in hyps]
        assert [h.score for h in alone] == pytest.approx([h.score for h in hyps], abs=1e-4)


def test_empty_lines_and_order(translator):
    out = translator.translate(["一二", "", "三", "  "])
    assert out[1] == "" and out[3] == ""
    assert out[0] == translator.translate(["一二"])[0]


def test_stream_equals_list_and_keeps_order(translator):
    texts = [zh for zh, _ in number_pairs(25, seed=6)] + [""]
    streamed = [t[0].text for t in translator.stream(iter(texts), chunk_lines=4)]
    assert streamed == translator.translate(texts)


def test_overlong_input_is_truncated_with_a_warning(translator, caplog):
    with caplog.at_level("WARNING"):
        (out,) = translator.translate(["一二三四五六七八九" * 10])
    assert "truncated to 12 tokens" in caplog.text
    assert isinstance(out, str)
