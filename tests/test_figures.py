"""Figures: real content at the expected size, every label drawable, masks from the model's code."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from mtrain.cli import app, main
from mtrain.figures.common import cjk_font_path, save, use_cjk_font
from mtrain.figures.curves import draw_curves
from mtrain.figures.masks import draw_masks, mask_inputs
from mtrain.figures.positional import draw_positional
from mtrain.training.build import build_trainer

from .synthetic import small_config, small_model

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def two_runs(corpus, tmp_path_factory) -> list[Path]:
    """Two short runs of the tiny config on the synthetic corpus, with different peak rates."""
    runs = []
    for lr in ("3e-3", "1e-3"):
        run = tmp_path_factory.mktemp("runs") / f"lr-{lr}"
        run.mkdir()
        cfg = small_config(corpus, max_steps=20, eval_every=10, lr=lr)
        build_trainer(cfg, run, CPU).run()
        runs.append(run)
    return runs


def _texts(fig) -> list[str]:
    from matplotlib.text import Text

    return [t.get_text() for t in fig.findobj(Text) if t.get_text().strip()]


def _assert_png(path: Path, fig_size: tuple[float, float], dpi: int = 120) -> None:
    """The PNG has the figure's pixel size and is not blank."""
    from matplotlib.image import imread

    pixels = imread(path)  # (H, W, 4) floats in [0, 1]
    assert pixels.shape[:2] == (round(fig_size[1] * dpi), round(fig_size[0] * dpi))
    ink = (pixels[..., :3] < 0.9).any(axis=-1).mean()  # share of pixels that are not white-ish
    assert ink > 0.02


def _assert_every_glyph(fig) -> None:
    """Every character of every (non-mathtext) label has a glyph in the CJK font in use."""
    from matplotlib import font_manager
    from matplotlib.ft2font import FT2Font
    from matplotlib.text import Text

    fig.canvas.draw()  # tick labels exist only once drawn
    path = str(cjk_font_path())
    charmap = FT2Font(path).get_charmap()
    for text in fig.findobj(Text):
        label = text.get_text()
        if not label.strip() or "$" in label:  # mathtext is drawn with its own math fonts
            continue
        assert font_manager.findfont(text.get_fontproperties()) == path, label
        missing = {c for c in label if not c.isspace() and ord(c) not in charmap}
        assert not missing, f"{label!r}: no glyph for {missing}"


def test_cjk_font_is_registered_and_named():
    import matplotlib

    family = use_cjk_font()
    assert family == "Noto Sans CJK SC"
    assert matplotlib.get_backend().lower() == "agg"


def test_curves_of_two_runs(two_runs, tmp_path):
    for run in two_runs:
        records = [json.loads(line) for line in (run / "train.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records] == [10, 20]
        assert all(math.isfinite(r["loss"]) and r["lr"] > 0 for r in records)
    result = CliRunner().invoke(
        app, ["plot", "curves", *map(str, two_runs), "-o", str(tmp_path / "c.png")]
    )
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == str(tmp_path / "c.png")
    fig = draw_curves(two_runs)
    assert {"lr-3e-3", "lr-1e-3"} <= set(_texts(fig))
    _assert_every_glyph(fig)
    _assert_png(save(fig, tmp_path / "curves.png"), (11, 12))


def test_curves_of_a_run_logged_before_train_jsonl(two_runs, tmp_path):
    old = tmp_path / "old"
    old.mkdir()
    records = (two_runs[0] / "metrics.jsonl").read_text().splitlines()
    # Older validation records had no "event" key, and there was no train.jsonl.
    stripped = [{k: v for k, v in json.loads(r).items() if k != "event"} for r in records]
    (old / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in stripped))
    fig = draw_curves([old])
    assert any("not logged" in t for t in _texts(fig))


def test_curves_refuses_a_folder_that_is_not_a_run(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:  # through main(), which makes errors one line
        main(["plot", "curves", str(tmp_path)])
    assert exit_.value.code == 2
    output = capsys.readouterr()
    assert output.out == ""
    assert output.err.count("\n") == 1 and "mtrain: error:" in output.err


def test_positional_heatmap_is_the_models_encoding(tmp_path):
    d_model, max_len = 16, 12
    fig = draw_positional(d_model, max_len)
    heatmap = fig.axes[0].images[0].get_array()  # (positions, dimensions), sin dims first
    for pos in range(max_len):
        for i in range(d_model // 2):
            angle = pos / 10000 ** (2 * i / d_model)
            assert heatmap[pos, i] == pytest.approx(math.sin(angle), abs=1e-5)
            assert heatmap[pos, d_model // 2 + i] == pytest.approx(math.cos(angle), abs=1e-5)
    _assert_every_glyph(fig)
    _assert_png(save(fig, tmp_path / "p.png"), (14, 5.2))


def training_masks(model, src: torch.Tensor, tgt_in: torch.Tensor):
    """The masks a training forward hands the first encoder and decoder self-attention."""
    seen = {}

    def keep(name):
        def hook(module, args):
            seen[name] = args[2]  # MultiHeadAttention.forward(query, key_value, mask)

        return hook

    hooks = [
        model.encoder.layers[0].self_attn.register_forward_pre_hook(keep("encoder")),
        model.decoder.layers[0].self_attn.register_forward_pre_hook(keep("decoder")),
    ]
    try:
        model.train()(src, tgt_in)
    finally:
        for hook in hooks:
            hook.remove()
    return seen["encoder"], seen["decoder"]  # (B, 1, 1, S), (B, 1, T, T)


def test_masks_are_the_training_masks_and_labels_have_glyphs(tokenizer, tmp_path):
    sources, targets = ["一二三", "四五六七八九"], ["one two three", "four five"]
    src_ids, tgt_ids = tokenizer.encode_src(sources), tokenizer.encode_tgt(targets)
    inputs = mask_inputs(
        src_ids,
        [[tokenizer.src.id_to_piece(i) for i in ids] for ids in src_ids],
        tgt_ids,
        [[tokenizer.tgt.id_to_piece(i) for i in ids] for ids in tgt_ids],
        max_src_len=32,
    )
    fig = draw_masks(inputs)
    batch = inputs.batch
    src_panel, causal_panel, *decoder_panels = fig.axes
    model = small_model(tokenizer.src_vocab_size, tokenizer.tgt_vocab_size)
    encoder_mask, decoder = training_masks(model, batch.src, batch.tgt_in)
    expected_src = encoder_mask[:, 0, 0, :]
    assert not expected_src.all()  # the shorter sentence is padded
    assert (src_panel.images[0].get_array() == expected_src.numpy()).all()
    length = batch.tgt_in.size(1)
    lookahead = torch.tensor([[key <= query for key in range(length)] for query in range(length)])
    assert (causal_panel.images[0].get_array() == lookahead.numpy()).all()
    assert len(decoder_panels) == len(sources)
    for i, panel in enumerate(decoder_panels):
        assert (panel.images[0].get_array() == decoder[i, 0].numpy()).all()
    assert "▁一" in "".join(_texts(fig)) or "一" in "".join(_texts(fig))
    _assert_every_glyph(fig)
    _assert_png(save(fig, tmp_path / "m.png"), tuple(fig.get_size_inches()))


def test_masks_without_a_run_use_characters(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no ./runs/ here
    out = tmp_path / "masks.png"
    result = CliRunner().invoke(app, ["plot", "masks", "我是谁", "今天是星期二", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert out.is_file()
