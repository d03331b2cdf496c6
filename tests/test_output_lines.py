"""One output line per input line, whatever pieces the model writes.

Byte fallback lets a model write any byte as a piece (`<0x0A>`, `<0x09>`, `<0x0D>`): decoded,
they are a newline, a tab, a carriage return. A model that writes them here (its output biased
towards them) must still give one line out per line in, on every path: `translate` (arguments,
stdin, -i/-o files), `eval`'s hypotheses, the server's JSON, the API and the training log's
examples; and never a tab in a SOURCE<TAB>TARGET file.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import mtrain
from mtrain.cli import main
from mtrain.core.config import Config, DataConfig, DecodeConfig, ModelConfig, TokenizerConfig
from mtrain.data import tokenizer as tokenizer_mod
from mtrain.run.directory import BEST, build_model, save_checkpoint, write_config
from mtrain.training.examples import ExampleSource, translate_examples

from .console import mtrain as command
from .test_serve import Served

CONTROL_PIECES = ("<0x0A>", "<0x09>", "<0x0D>")  # \n, \t, \r
SOURCES = ["一二三", "四五", "六七八九", "零"]


@pytest.fixture(autouse=True)
def warn_again(monkeypatch):
    """Each test sees the once-per-process warning."""
    monkeypatch.setattr(tokenizer_mod, "_control_warned", False)


@pytest.fixture(scope="module")
def writing_controls(tokenizer, tmp_path_factory) -> Path:
    """A run of a random model whose every output piece is a newline, tab or carriage return."""
    path = tmp_path_factory.mktemp("controls") / "run"
    path.mkdir()
    cfg = Config(
        data=DataConfig(src_lang="zh", tgt_lang="en", max_src_len=12, max_tgt_len=10),
        tokenizer=TokenizerConfig(vocab_size=300, tgt_vocab_size=0, character_coverage=1.0),
        model=ModelConfig(
            d_model=32, n_heads=4, n_encoder_layers=1, n_decoder_layers=1, d_ff=64, dropout=0.0
        ),
        decode=DecodeConfig(beam_size=1, max_len_offset=3),
    )
    write_config(path, cfg)
    tokenizer.write(path)
    torch.manual_seed(0)
    model = build_model(cfg, tokenizer)
    with torch.no_grad():
        rows = torch.Generator().manual_seed(2)  # a seed whose rows choose \n thrice, then \t
        for piece in CONTROL_PIECES:  # equal biases; large random rows choose among them
            token = tokenizer.tgt.piece_to_id(piece)
            model.output_projection.bias[token] += 100.0
            model.output_projection.weight[token] = 5 * torch.randn(32, generator=rows)
    state = {"model": model.state_dict(), "tokenizer": tokenizer.fingerprint(), "step": 0}
    save_checkpoint(path / BEST, state)
    return path


def test_decoded_control_characters_become_spaces_said_once(tokenizer, caplog):
    ids = [tokenizer.tgt.piece_to_id(p) for p in ("<0x0A>", "<0x09>", "<0x0D>", "<0x0B>")]
    assert all(tokenizer.tgt.id_to_piece(i) != "<unk>" for i in ids)
    words = tokenizer.encode_tgt(["one two"])[0]
    texts = tokenizer.decode_tgt([words + ids + words, ids, words])
    assert texts == ["one two" + " " * 4 + " one two", " " * 4, "one two"]
    tokenizer.decode_tgt([ids])
    warnings = [r for r in caplog.records if "control characters" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelname == "WARNING"


def test_line_separators_and_every_control_character_are_replaced():
    texts = ["a\u2028b\u2029c\x85d\x00e\x1bf\x7fg", "h\x0ci\x1cj", "ok é 我 \u200b"]
    assert tokenizer_mod.printable(texts) == ["a b c d e f g", "h i j", "ok é 我 \u200b"]
    assert all(len(t.splitlines()) == 1 for t in tokenizer_mod.printable(texts))


def test_translate_gives_one_line_per_input_line(writing_controls, tmp_path, capsys):
    run = str(writing_controls)
    piped = command("translate", "--run", run, input="\n".join(SOURCES) + "\n")
    assert piped.returncode == 0, piped.stderr
    assert len(piped.stdout.splitlines()) == 4
    assert piped.stdout.count("\n") == 4 and "\t" not in piped.stdout and "\r" not in piped.stdout
    assert piped.stderr.count("control characters") == 1, piped.stderr
    assert piped.stdout.strip() == ""  # the model wrote nothing else: spaces only

    with pytest.raises(SystemExit) as exit_:  # in this process: quicker
        main(["translate", "--run", run, *SOURCES])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == piped.stdout

    src, out = tmp_path / "in.zh", tmp_path / "out.en"
    src.write_text("\n".join(SOURCES) + "\n", "utf-8")
    files = command("translate", "--run", run, "-i", str(src), "-o", str(out))
    assert files.returncode == 0, files.stderr
    assert out.read_text("utf-8") == piped.stdout

    # A SOURCE<TAB>TARGET file of the translations has two columns, as `mtrain score` needs.
    pairs = tmp_path / "pairs.tsv"
    pairs.write_text("".join(f"{s}\t{t}\n" for s, t in zip(SOURCES, piped.stdout.splitlines())))
    assert [len(line.split("\t")) for line in pairs.read_text().splitlines()] == [2] * 4


def test_eval_writes_one_hypothesis_per_source(writing_controls, tmp_path):
    src, ref = tmp_path / "dev.zh", tmp_path / "dev.en"
    src.write_text("\n".join(SOURCES) + "\n", "utf-8")
    ref.write_text("one two three\nfour five\nsix seven eight nine\nzero\n", "utf-8")
    result = command("eval", "--run", str(writing_controls), "--src", str(src), "--ref", str(ref))
    assert result.returncode == 0, result.stderr
    hyps = (writing_controls / "dev.zh.hyp.en").read_text("utf-8")
    assert hyps.count("\n") == 4 and len(hyps.splitlines()) == 4 and "\t" not in hyps


def test_the_api_and_the_server_answer_one_line_per_sentence(writing_controls):
    translations = mtrain.load(writing_controls, device="cpu").translate(SOURCES)
    assert len(translations) == 4
    # one line each, not empty, no line end nor tab: the model's pieces became spaces only
    assert all(t.splitlines() == [t] and set(t) == {" "} for t in translations), translations
    served = Served(writing_controls)
    try:
        status, body = served.post("/translate", {"text": SOURCES})
    finally:
        served.stop()
    assert status == 200, body
    texts = [t["text"] for t in body["translations"]]
    assert texts == translations, json.dumps(body)


def test_the_training_logs_examples_are_one_line_each(writing_controls, tokenizer):
    translator = mtrain.load(writing_controls, device="cpu").translator
    model, cfg = translator.model, translator.cfg
    examples = [ExampleSource(s, None) for s in SOURCES]
    done = translate_examples(model, tokenizer, cfg, torch.device("cpu"), examples)
    assert [len(e.translation.splitlines()) for e in done] == [1, 1, 1, 1]
    assert all("\t" not in e.translation and "\r" not in e.translation for e in done)
    assert [set(e.tgt_pieces) for e in done] == [{"<0x0A>"}] * 3 + [{"<0x09>"}]  # as it wrote
