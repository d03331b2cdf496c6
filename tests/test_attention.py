"""`--attention`: the weights kept are the ones the search used, and they draw legibly."""

import warnings

import numpy as np
import pytest
import torch
from matplotlib import font_manager
from matplotlib.ft2font import FT2Font
from PIL import Image

from mtrain.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from mtrain.decoding.attention import AttentionRecorder
from mtrain.decoding.search import beam_search, greedy
from mtrain.figures.attention import DPI, figure_size, save_figures
from mtrain.figures.common import cjk_font_path, use_cjk_font

from .synthetic import model_ending_early, small_model

VOCAB = 20


def biased_model(seed=0, eos_bias=2.0):
    return model_ending_early(VOCAB, eos_bias, seed)


def teacher_forced_weights(model, src, tgt_in):
    """The weights of one uncached forward pass over a whole (padded) batch."""
    model.record_attention(True)
    try:
        logits = model(src, tgt_in)
        return logits, model.attention_weights()
    finally:
        model.record_attention(False)


def test_weights_are_distributions_and_masked_keys_get_exactly_zero():
    model = small_model(VOCAB, VOCAB)
    src = torch.tensor([[5, 9, 12, 7, EOS_ID], [6, 8, EOS_ID, PAD_ID, PAD_ID]])
    tgt_in = torch.tensor([[BOS_ID, 4, 11, 9], [BOS_ID, 7, PAD_ID, PAD_ID]])
    logits, weights = teacher_forced_weights(model, src, tgt_in)
    torch.testing.assert_close(logits, model(src, tgt_in), atol=1e-5, rtol=1e-5)
    assert model.attention_weights()["cross"] == [None, None]  # off again: nothing kept
    src_pad = (src == PAD_ID)[:, None, None, :]  # (B, 1, 1, S)
    tgt_pad = (tgt_in == PAD_ID)[:, None, None, :]
    future = torch.ones(4, 4, dtype=torch.bool).triu(1)  # (T, T) above the diagonal
    for kind, hidden in (
        ("encoder", src_pad),
        ("cross", src_pad),
        ("decoder", tgt_pad | future),
    ):
        for w in weights[kind]:
            torch.testing.assert_close(w.sum(-1), torch.ones(w.shape[:-1]))
            assert torch.all(w.masked_select(hidden.expand_as(w)) == 0)
            assert torch.all(w.masked_select(~hidden.expand_as(w)) > 0)


def check_maps_equal_teacher_forcing(model, src_row, maps, out_ids):
    """The maps gathered step by step equal one forward pass over the final output."""
    src = src_row[src_row != PAD_ID][None]
    _, full = teacher_forced_weights(model, src, torch.tensor([[BOS_ID, *out_ids[:-1]]]))
    for kind in ("encoder", "cross", "decoder"):
        for mine, theirs in zip(getattr(maps, kind), full[kind]):
            torch.testing.assert_close(mine, theirs[0], atol=1e-5, rtol=1e-5)
    for w in maps.decoder:  # the look-ahead triangle: exact zeros, and only there
        past = torch.ones(w.shape[1:], dtype=torch.bool).tril()
        assert torch.all(w[:, ~past] == 0) and torch.all(w[:, past] > 0)


SOURCES = [[5, 9, 12, 7, 19, 8, EOS_ID], [6, 6, 8, EOS_ID], [13, 4, EOS_ID]]


@pytest.mark.parametrize("seed, use_cache", [(0, True), (1, True), (0, False)])
def test_greedy_maps_are_those_of_the_search(seed, use_cache):
    model = biased_model(seed)
    for ids in SOURCES:
        src = torch.tensor([ids])
        with AttentionRecorder(model) as recorder:
            (out,) = greedy(model, src, torch.tensor([7]), use_cache, observe=recorder)
        assert not model.decoder.layers[0].cross_attn.keep_weights
        assert greedy(model, src, torch.tensor([7])) == [out]  # recording changed nothing
        maps = recorder.maps(out)
        ended = maps.cross[0].size(1) == len(out) + 1
        check_maps_equal_teacher_forcing(model, src[0], maps, [*out, EOS_ID] if ended else out)


@pytest.mark.parametrize("eos_bias", [0.0, 2.0])
def test_beam_maps_follow_each_hypothesis_through_the_beam(eos_bias):
    model = biased_model(eos_bias=eos_bias)
    ends = set()
    for ids in SOURCES:
        src = torch.tensor([ids])
        with AttentionRecorder(model) as recorder:
            (hyps,) = beam_search(model, src, torch.tensor([6]), 3, 0.6, nbest=3, observe=recorder)
        for hyp in hyps:
            maps = recorder.maps(hyp.tokens)
            ended = maps.cross[0].size(1) == len(hyp.tokens) + 1
            ends.add(ended)
            out = [*hyp.tokens, EOS_ID] if ended else hyp.tokens
            check_maps_equal_teacher_forcing(model, src[0], maps, out)
    assert True in ends if eos_bias else False in ends  # ended with </s>; at the length limit


def test_recorder_refuses_a_batch():
    model = small_model(VOCAB, VOCAB)
    src = torch.tensor([[5, 9, EOS_ID], [6, 8, EOS_ID]])
    with pytest.raises(ValueError, match="one sentence"), AttentionRecorder(model) as recorder:
        greedy(model, src, torch.tensor([3, 3]), observe=recorder)


def test_figures_have_their_size_content_and_every_glyph(tmp_path):
    model = small_model(VOCAB, VOCAB, layers=2)
    src = torch.tensor([[5, 9, 12, EOS_ID]])
    with AttentionRecorder(model) as recorder:
        (out,) = greedy(model, src, torch.tensor([4]), observe=recorder)
    maps = recorder.maps(out)
    src_pieces = ["▁我", "是", "谁", "</s>"]
    tgt_out = ["▁Who", "▁am", "▁I", "?"][: maps.cross[0].size(1)]
    tgt_in = ["<s>", *tgt_out[:-1]]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib warns of every glyph its font lacks
        paths = save_figures(
            maps, src_pieces, tgt_in, tgt_out, "我是谁 → Who am I?", tmp_path / "1"
        )
    assert [p.name for p in paths] == ["1-cross.png", "1-encoder.png", "1-decoder.png"]
    rows = {"cross": len(tgt_out), "encoder": 4, "decoder": len(tgt_in)}
    cols = {"cross": 4, "encoder": 4, "decoder": len(tgt_in)}
    for path, kind in zip(paths, rows):
        image = Image.open(path).convert("L")
        width, height = figure_size(2, 4, rows[kind], cols[kind])
        assert image.size == (round(width * DPI), round(height * DPI))
        pixels = torch.from_numpy(np.array(image)).float()
        assert (pixels < 200).float().mean() > 0.1  # mostly not blank paper
        assert len(pixels.unique()) > 50  # heatmaps and text, not a flat fill

    family = use_cjk_font()
    font = font_manager.findfont(
        font_manager.FontProperties(family=family), fallback_to_default=False
    )
    assert font == str(cjk_font_path())
    charmap = FT2Font(font).get_charmap()
    labels = "".join([*src_pieces, *tgt_in, *tgt_out, "我是谁 → Who am I?"])
    assert [c for c in labels if ord(c) not in charmap] == []
